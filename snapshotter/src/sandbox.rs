//! Mode B in the daemon: the admin RPCs `CreateSession` / `CloseSession`, and the
//! mount socket (`layerstack_sandbox::wire`), where holders receive their
//! session's overlay as a detached mount fd and keep a connection for the
//! session's life.
//!
//! Why a second socket: the overlay must be built where the layer paths resolve
//! (this daemon's mount namespace: host paths), and attached where the session
//! lives (the holder's private mount namespace — on the host or inside a
//! privileged container that only has the admin socket's directory). The new
//! mount API gives a detached mount as a descriptor; tonic cannot carry
//! descriptors, a unix socket can (`SCM_RIGHTS`).
//!
//! Lifecycle of a holder connection (one per session):
//! ```text
//! attach  → session must be a live sandbox session without a holder; its overlay
//!           is built (fsopen/fsconfig/fsmount) and sent; the connection is the
//!           session's holder from now on
//! ready   ← init (pid 1 of the session) reports; its pid arrives by
//!           SCM_CREDENTIALS and is kept as a pidfd (session exec joins it;
//!           CloseSession stops it)
//! end     ← every holder process closed it: CloseSession was called (nothing to
//!           do) or the holder was killed: the engine finishes the session by its
//!           recorded policy once its namespaces are gone
//! resume  → after a restart, the holder of a session of the last daemon
//!           takes it back on a new connection (to close it with its command's
//!           exit status); the connection is the session's holder again
//! ```

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use layerstack_api as api;
use layerstack_engine::store::ErrorKind;
use layerstack_engine::store::{LeaseTarget, MountSpec, SessionId};
use layerstack_engine::{EndAction, Engine, EngineError, SandboxRequest, Writers};
use layerstack_sandbox::sys;
use layerstack_sandbox::wire::{self, Mode, Reply, Request};
use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};
use tonic::Status;
use tracing::{debug, info, warn};

use crate::admin::{engine_status, require, AdminService};

/// How long CloseSession waits for a session's namespaces to go.
const CLOSE_PATIENCE: Duration = Duration::from_secs(10);

/// How long a DISCARD CloseSession of a daemon-owned session waits for its
/// killed init to end before it takes the census's path instead (the init
/// of a pid namespace ends once every process in it is reaped: a few
/// hundred µs for an idle session, longer for one whose processes are
/// stuck in the kernel).
const INIT_EXIT_PATIENCE: Duration = Duration::from_secs(2);

/// The holder of one session.
pub(crate) struct Holder {
    pub(crate) conn: u64,
    /// Init (pid 1 of the session) once it reported ready: its pid in this
    /// daemon's pid namespace and a pidfd.
    pub(crate) init: Option<(i32, Arc<OwnedFd>)>,
    pub(crate) mode: Mode,
    pub(crate) workdir: String,
    /// CloseSession runs: the end of the connection is expected.
    pub(crate) closing: bool,
    /// A daemon-owned session: its init is this daemon's child
    /// (`crate::owned`), with Exec's defaults.
    pub(crate) owned: Option<Arc<crate::owned::Defaults>>,
    /// A WASI session (`crate::wasi`): no init; the daemon holds its overlay.
    pub(crate) wasi: Option<Arc<crate::wasi::WasiLive>>,
}

/// Live holders by session, shared by the mount socket and the admin service.
pub struct Holders {
    mount_address: PathBuf,
    map: Mutex<HashMap<SessionId, Holder>>,
    pub(crate) next_conn: AtomicU64,
    /// The process that clones daemon-owned sessions' inits and Exec's
    /// waiters (set once at start; `Err`: why there is none).
    pub(crate) spawner: std::sync::OnceLock<Result<Arc<crate::owned::Spawner>, String>>,
    /// Limits and hidden paths of daemon-owned sessions (set once at start;
    /// unset: no cgroup setup, no socket to hide).
    pub limits: std::sync::OnceLock<Arc<crate::owned::SessionLimits>>,
    /// WASI sessions made ahead of their requests (`[sandbox] wasi_ready`).
    pub(crate) wasi_ready: crate::wasi::Ready,
    /// A user namespace per uid/gid mapping sessions asked for, kept for the
    /// daemon's life: what their lowers are idmapped with.
    userns: Mutex<HashMap<layerstack_engine::IdMap, Arc<OwnedFd>>>,
    /// Inits of daemon-owned sessions made ahead (`[sandbox] ready_inits`).
    pub(crate) ready_inits: Arc<crate::owned::ReadyInits>,
    /// Sandbox creates in flight by (namespace, idempotency key): a retry of
    /// a key waits for the create it repeats (whose caller may have gone
    /// away), then is answered with its sandbox.
    pub(crate) creates: layerstack_engine::LockMap<(String, String)>,
}

impl Holders {
    /// The limits of daemon-owned session `id` while its init lives
    /// (`Session.limits`); `None` for any other session.
    pub(crate) fn owned_limits(&self, id: SessionId) -> Option<api::SandboxLimits> {
        let m = self.map();
        let h = m.get(&id)?;
        h.init.as_ref()?;
        let d = h.owned.as_ref()?;
        Some(api::SandboxLimits {
            cpu_millis: d.limits.cpu_millis,
            memory_bytes: d.limits.memory_bytes,
            pids: d.limits.pids,
            network: d.network,
        })
    }

    pub fn new(mount_address: PathBuf) -> Arc<Holders> {
        Arc::new(Holders {
            mount_address,
            map: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            spawner: std::sync::OnceLock::new(),
            creates: layerstack_engine::LockMap::new(),
            limits: std::sync::OnceLock::new(),
            wasi_ready: Default::default(),
            userns: Mutex::new(HashMap::new()),
            ready_inits: crate::owned::ReadyInits::new(),
        })
    }

    /// The user namespace with mapping `m` (made at its first use:
    /// `sys::userns_fd`, a clone of the daemon).
    pub(crate) fn userns(&self, m: &layerstack_engine::IdMap) -> std::io::Result<Arc<OwnedFd>> {
        let mut c = self.userns.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(fd) = c.get(m) {
            return Ok(fd.clone());
        }
        let fd = Arc::new(sys::userns_fd(m)?);
        c.insert(*m, fd.clone());
        Ok(fd)
    }

    pub(crate) fn map(&self) -> std::sync::MutexGuard<'_, HashMap<SessionId, Holder>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The mount socket's path.
    pub fn mount_address(&self) -> &std::path::Path {
        &self.mount_address
    }
}

pub(crate) fn wire_error(e: &EngineError) -> Reply {
    Reply::error(e.kind(), api::error_chain(e))
}

/// Serves the mount socket until the listener fails. `admin` answers `start`
/// and `close` as the admin API's `CreateSession` and `CloseSession`.
pub async fn serve(listener: UnixListener, admin: AdminService) {
    let (engine, holders) = (admin.engine.clone(), admin.holders.clone());
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "mount socket: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (engine, holders, admin) = (engine.clone(), holders.clone(), admin.clone());
        tokio::spawn(async move {
            if let Err(e) = connection(stream, &engine, &holders, &admin).await {
                debug!(error = %e, "mount socket connection ended with an error");
            }
        });
    }
}

async fn send(stream: &UnixStream, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let fd = stream.as_raw_fd();
    let mut off = 0;
    while off < data.len() {
        stream.writable().await?;
        let with = if off == 0 { fds } else { &[] };
        match stream.try_io(Interest::WRITABLE, || {
            sys::send_with_fds(fd, &data[off..], with)
        }) {
            Ok(n) => off += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The next line and the pid of its sender (when credentials came with it);
/// `None` at the end of the connection.
async fn read_line(
    stream: &UnixStream,
    buf: &mut Vec<u8>,
) -> io::Result<Option<(Vec<u8>, Option<i32>)>> {
    let fd = stream.as_raw_fd();
    let mut pid = None;
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(i) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=i).collect();
            return Ok(Some((line, pid)));
        }
        if buf.len() > 64 * 1024 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "mount socket line too long",
            ));
        }
        stream.readable().await?;
        match stream.try_io(Interest::READABLE, || sys::recv_msg(fd, &mut chunk)) {
            Ok(r) if r.len == 0 => return Ok(None),
            Ok(r) => {
                // Descriptors sent to the daemon are never wanted: dropped (closed).
                drop(r.fds);
                if r.pid.is_some() {
                    pid = r.pid;
                }
                buf.extend_from_slice(&chunk[..r.len]);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
}

/// The refusal of a second session on one holder connection.
fn one_session() -> Reply {
    Reply::error(
        ErrorKind::FailedPrecondition,
        "this connection holds a session already: one connection per session",
    )
}

/// A wire error from an admin API status: its errdefs kind ([`api::kind_name`]:
/// a gRPC code no error kind maps to keeps its own snake-case name).
fn status_reply(st: &Status) -> Reply {
    Reply {
        ok: false,
        code: api::status_kind(st).to_string(),
        message: st.message().to_string(),
        ..Reply::default()
    }
}

/// Refuses a caller's session name the daemon keeps for itself: the ready
/// WASI sessions it makes ahead are named `(ready)` (`store::READY_OWNER`),
/// hidden from ListSessions and handed to the next request — a caller's
/// session of that name would be handed over too.
pub(crate) fn refuse_reserved_name(name: &str) -> Result<(), Status> {
    if name == layerstack_engine::store::READY_OWNER {
        return Err(Status::invalid_argument(format!(
            "session name {name:?} is reserved for the ready WASI sessions the daemon makes ahead; choose another name (or none)"
        )));
    }
    Ok(())
}

/// `start`: `CreateSession`, then `attach` on this connection. A session this
/// call created whose overlay cannot be attached is discarded again.
async fn start(
    admin: &AdminService,
    conn: u64,
    attached: Option<SessionId>,
    r: wire::Start,
) -> Result<(api::Session, bool, OwnedFd), Reply> {
    if attached.is_some() {
        return Err(one_session());
    }
    refuse_reserved_name(&r.name).map_err(|st| status_reply(&st))?;
    let (session, spec, created) = admin
        .sandbox_create_spec(
            api::CreateSessionRequest {
                namespace: r.namespace,
                stack: r.stack,
                branch: r.branch,
                node: r.node,
                name: r.name,
                idempotency_key: r.idempotency_key,
                policy: r.policy,
                wait_ms: r.wait_ms,
                ignore_mtime: r.ignore_mtime,
                sandbox: None,
                wasi: None,
            },
            false,
            Default::default(),
            None,
        )
        .await
        .map_err(|st| status_reply(&st))?;
    // A session created now is a live sandbox session without a holder, and
    // its spec is the run's: no second look at it.
    let fresh = created.then_some(spec);
    match attach(&admin.engine, &admin.holders, conn, session.id, fresh).await {
        Ok(fd) => Ok((session, created, fd)),
        Err(reply) => {
            if created {
                let engine = admin.engine.clone();
                let id = session.id;
                tokio::spawn(async move {
                    if let Err(e) = engine
                        .close_sandbox_session(
                            id,
                            EndAction::Discard,
                            "session setup failed",
                            CLOSE_PATIENCE,
                        )
                        .await
                    {
                        warn!(session.id = id, error = %api::error_chain(&e), "cannot discard a session whose overlay could not be attached");
                    }
                });
            }
            Err(reply)
        }
    }
}

async fn connection(
    stream: UnixStream,
    engine: &Arc<Engine>,
    holders: &Arc<Holders>,
    admin: &AdminService,
) -> io::Result<()> {
    let fd = stream.as_raw_fd();
    let (peer_pid, uid) = sys::peer_cred(fd)?;
    if uid != 0 {
        warn!(uid, pid = peer_pid, "mount socket: refused a caller");
        let r = Reply::error(
            ErrorKind::PermissionDenied,
            format!(
                "permission denied: the mount socket serves root only (uid {uid} asked): Mode B sessions need root"
            ),
        );
        return send(&stream, &wire::line(&r), &[]).await;
    }
    sys::set_passcred(fd)?;
    let conn = holders.next_conn.fetch_add(1, Ordering::Relaxed);
    let mut attached: Option<SessionId> = None;
    let mut buf = Vec::new();
    let result = loop {
        let (line, pid) = match read_line(&stream, &mut buf).await {
            Ok(Some(l)) => l,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        };
        let req: Request = match serde_json::from_slice(&line) {
            Ok(r) => r,
            Err(e) => {
                let r = Reply::error(ErrorKind::InvalidArgument, format!("bad request line: {e}"));
                send(&stream, &wire::line(&r), &[]).await?;
                continue;
            }
        };
        match req {
            Request::Attach { session } => {
                let r = match attached {
                    Some(_) => Err(one_session()),
                    None => attach(engine, holders, conn, session, None).await,
                };
                let (reply, fd) = match r {
                    Ok(fd) => {
                        attached = Some(session);
                        (Reply::ok(), Some(fd))
                    }
                    Err(r) => (r, None),
                };
                let fds: Vec<RawFd> = fd.iter().map(AsRawFd::as_raw_fd).collect();
                // The daemon's copy of the mount closes when `fd` drops, right
                // after sending: only the holder keeps the overlay alive.
                send(&stream, &wire::line(&reply), &fds).await?;
            }
            Request::Ready { mode, workdir } => {
                let Some(id) = attached else { continue };
                let init = match pid.map(|p| (p, sys::pidfd_open(p))) {
                    Some((p, Ok(fd))) => Some((p, Arc::new(fd))),
                    Some((p, Err(e))) => {
                        warn!(session.id = id, pid = p, error = %e, "cannot open a pidfd for the session's init");
                        None
                    }
                    None => {
                        warn!(session.id = id, "ready without credentials: session exec will not find the session's init");
                        None
                    }
                };
                if let Some(h) = holders.map().get_mut(&id).filter(|h| h.conn == conn) {
                    h.init = init;
                    h.mode = mode;
                    h.workdir = workdir;
                }
                if mode == Mode::Root {
                    engine.sandbox_root_mode(id);
                }
                debug!(session.id = id, holder = peer_pid, init = ?pid, "sandbox session ready");
            }
            Request::Join { session } => {
                let (mut reply, fds) = join(holders, session);
                if !reply.ok && reply.code == ErrorKind::NotFound.as_str() {
                    reply = no_holder(engine, session).await;
                }
                let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
                send(&stream, &wire::line(&reply), &raw).await?;
            }
            Request::Start(r) => {
                let (reply, fd) = match start(admin, conn, attached, r).await {
                    Ok((session, created, fd)) => {
                        attached = Some(session.id);
                        let reply = Reply {
                            ok: true,
                            session: api::session_to_hex(&session),
                            created: Some(created),
                            ..Default::default()
                        };
                        (reply, Some(fd))
                    }
                    Err(r) => (r, None),
                };
                let fds: Vec<RawFd> = fd.iter().map(AsRawFd::as_raw_fd).collect();
                send(&stream, &wire::line(&reply), &fds).await?;
            }
            Request::Resume {
                session,
                mode,
                workdir,
            } => {
                let reply = match attached {
                    Some(_) => one_session(),
                    None => match resume(engine, holders, conn, session, mode, workdir).await {
                        Ok(()) => {
                            attached = Some(session);
                            info!(
                                session.id = session,
                                holder = peer_pid,
                                "a holder resumed its session on a new connection"
                            );
                            Reply::ok()
                        }
                        Err(r) => r,
                    },
                };
                send(&stream, &wire::line(&reply), &[]).await?;
            }
            Request::Close(r) => {
                let reply = match close(admin, attached, r).await {
                    Ok(session) => Reply {
                        ok: true,
                        session: api::session_to_hex(&session),
                        ..Default::default()
                    },
                    Err(r) => r,
                };
                send(&stream, &wire::line(&reply), &[]).await?;
            }
        }
    };
    if let Some(id) = attached {
        let closing = {
            let mut m = holders.map();
            match m.get(&id) {
                Some(h) if h.conn == conn => m.remove(&id).is_some_and(|h| h.closing),
                _ => true,
            }
        };
        if !closing {
            let released = engine.session(id).await.map(|s| s.released).unwrap_or(true);
            if !released {
                info!(
                    session.id = id,
                    holder = peer_pid,
                    "the holder of a sandbox session is gone without closing it"
                );
                engine.sandbox_holder_gone(id);
            }
        }
    }
    result
}

/// Attaches session `id` to holder connection `conn`: its overlay as a detached
/// mount. `fresh`: the mount spec of a session created a moment ago for this
/// connection (it is checked and mounted only when not given).
pub(crate) async fn attach(
    engine: &Arc<Engine>,
    holders: &Arc<Holders>,
    conn: u64,
    id: SessionId,
    fresh: Option<MountSpec>,
) -> Result<OwnedFd, Reply> {
    attach_mapped(engine, holders, conn, id, fresh, None).await
}

/// [`attach`] of a session with uid/gid mapping `id_map`: its lowers are
/// idmapped by a user namespace with that mapping
/// (`sys::overlay_fd_mapped`) and its upper's root is owned by the mapped
/// root (`host_uid:host_gid`), so the session's root sees `/` as its own.
/// UNSUPPORTED on a kernel without idmapped overlay layers by descriptor
/// (Linux < 6.13).
pub(crate) async fn attach_mapped(
    engine: &Arc<Engine>,
    holders: &Arc<Holders>,
    conn: u64,
    id: SessionId,
    fresh: Option<MountSpec>,
    id_map: Option<layerstack_engine::IdMap>,
) -> Result<OwnedFd, Reply> {
    let userns = match id_map {
        None => None,
        Some(m) => Some(holders.userns(&m).map_err(|e| {
            Reply::error(
                ErrorKind::Internal,
                format!("cannot make a user namespace with the mapping {m} for session {id}: {e}"),
            )
        })?),
    };
    let _g = engine.lock_session(id).await;
    if holders.map().contains_key(&id) {
        return Err(Reply::error(
            ErrorKind::AlreadyExists,
            format!(
                "session {id} has a holder already (one holder per session; session exec joins it)"
            ),
        ));
    }
    // The checks and the run's mount spec (the engine's), then the overlay.
    let spec = match fresh {
        Some(spec) => spec,
        None => engine
            .sandbox_run_spec(id)
            .await
            .map_err(|e| wire_error(&e))?,
    };
    // A sandbox session's overlay is mounted once and captured only after it
    // is gone: it is `volatile` (no sync of the upper at unmount) unless the
    // store is durable, whose seal syncs what it publishes anyway.
    let volatile = !engine.durable();
    let fd = layerstack_engine::here_or_pool(move || {
        let MountSpec::Overlay {
            lowers,
            upper: Some((upper, work)),
        } = spec
        else {
            return Err(Reply::error(
                ErrorKind::Internal,
                format!("session {id} has no writable overlay"),
            ));
        };
        // A marker a volatile mount of this workdir left would refuse the
        // mount: it goes first.
        if volatile {
            let incompat = work.join("incompat");
            if let Err(e) = layerstack_engine::store::fs::remove_tree(&incompat) {
                return Err(Reply::error(
                    ErrorKind::Internal,
                    format!("cannot clear {}: {e}", incompat.display()),
                ));
            }
        }
        if let Some(m) = &id_map {
            if let Err(e) = std::os::unix::fs::chown(&upper, Some(m.host_uid), Some(m.host_gid)) {
                return Err(Reply::error(
                    ErrorKind::Internal,
                    format!(
                        "cannot give session {id}'s upper {} to its mapped root {}:{}: {e}",
                        upper.display(),
                        m.host_uid,
                        m.host_gid
                    ),
                ));
            }
        }
        sys::overlay_fd_mapped(&lowers, &upper, &work, volatile, userns.as_deref()).map_err(|e| {
            let unsupported = e.source.raw_os_error() == Some(libc::EINVAL)
                && e.step.starts_with("fsconfig lowerdir+");
            let code = if unsupported {
                ErrorKind::Unsupported
            } else {
                ErrorKind::Internal
            };
            Reply::error(
                code,
                format!("cannot build session {id}'s overlay: {e}: {}", e.source),
            )
        })
    })
    .await
    .map_err(|e| Reply::error(ErrorKind::Internal, format!("mount task failed: {e}")))??;
    holders.map().insert(
        id,
        Holder {
            conn,
            init: None,
            mode: Mode::Root,
            workdir: String::new(),
            closing: false,
            owned: None,
            wasi: None,
        },
    );
    Ok(fd)
}

/// `resume`: connection `conn` holds session `id` again (its holder's first
/// connection broke: the daemon restarted; see
/// `Engine::recover_sandboxes`). No overlay is sent: the holder's init keeps
/// the one it has. A session closed already can be resumed too: the close
/// that follows answers its recorded outcome.
async fn resume(
    engine: &Arc<Engine>,
    holders: &Arc<Holders>,
    conn: u64,
    id: SessionId,
    mode: Mode,
    workdir: String,
) -> Result<(), Reply> {
    let _g = engine.lock_session(id).await;
    let s = engine.session(id).await.map_err(|e| wire_error(&e))?;
    if !matches!(s.owner, layerstack_engine::store::Owner::Sandbox { .. }) {
        return Err(Reply::error(
            ErrorKind::InvalidArgument,
            format!(
                "session {id} belongs to {}, not to a sandbox holder: only `layerstack session run|create` sessions can be resumed",
                s.owner.display()
            ),
        ));
    }
    if s.daemon_owned {
        return Err(Reply::error(
            ErrorKind::FailedPrecondition,
            format!("session {id} is daemon-owned: the daemon holds it, no holder can resume it (close it with CloseSession)"),
        ));
    }
    let mut m = holders.map();
    if m.contains_key(&id) {
        return Err(Reply::error(
            ErrorKind::AlreadyExists,
            format!("session {id} has a live holder connection already (one holder per session)"),
        ));
    }
    m.insert(
        id,
        Holder {
            conn,
            init: None,
            mode,
            workdir,
            closing: false,
            owned: None,
            wasi: None,
        },
    );
    drop(m);
    if mode == Mode::Root {
        engine.sandbox_root_mode(id);
    }
    Ok(())
}

/// `close`: `CloseSession` of the session this connection holds.
async fn close(
    admin: &AdminService,
    attached: Option<SessionId>,
    r: wire::Close,
) -> Result<api::Session, Reply> {
    let Some(id) = attached else {
        return Err(Reply::error(
            ErrorKind::FailedPrecondition,
            "this connection holds no session: start or attach one first",
        ));
    };
    let policy = match r.policy.as_str() {
        "" | "auto" => api::EndAction::Auto,
        "publish" => api::EndAction::Publish,
        "discard" => api::EndAction::Discard,
        "checkpoint" => api::EndAction::Checkpoint,
        other => {
            return Err(Reply::error(
                ErrorKind::InvalidArgument,
                format!("end action {other:?} is not one of auto, publish, discard, checkpoint"),
            ))
        }
    };
    admin
        .sandbox_close(api::CloseSessionRequest {
            session_id: id,
            action: policy as i32,
            reason: r.reason,
            has_exit_status: r.exit_status.is_some(),
            exit_status: r.exit_status.unwrap_or(0),
            state: r.state,
            command: r.command,
            labels: Default::default(),
        })
        .await
        .map_err(|st| status_reply(&st))
}

/// Why session `id`, which has no live holder, cannot be joined: no such
/// session (`not_found`), or one that exists but is closed or was never held
/// by `session create`/`run` (`failed_precondition`, naming its outcome).
async fn no_holder(engine: &Arc<Engine>, id: SessionId) -> Reply {
    match engine.session(id).await {
        Ok(s) => Reply::error(
            ErrorKind::FailedPrecondition,
            format!(
                "session {id} ({}) has no live holder: {}",
                s.owner.display(),
                match (&s.outcome, s.released) {
                    (Some(o), true) => format!(
                        "it is closed (outcome {}); start another with `layerstack session create`",
                        o.kind.as_str()
                    ),
                    _ => "it was not made by `layerstack session create` or `run`, or its holder is gone".to_string(),
                }
            ),
        ),
        Err(e) => Reply::error(e.kind(), api::error_chain(&e)),
    }
}

fn join(holders: &Holders, id: SessionId) -> (Reply, Vec<OwnedFd>) {
    let m = holders.map();
    let Some(h) = m.get(&id) else {
        return (
            Reply::error(
                ErrorKind::NotFound,
                format!("session {id} has no live holder (not created with `layerstack session create`/`run`, or closed)"),
            ),
            vec![],
        );
    };
    let Some((pid, pidfd)) = &h.init else {
        return (
            Reply::error(
                ErrorKind::FailedPrecondition,
                format!("session {id}'s holder is not ready yet"),
            ),
            vec![],
        );
    };
    if let Some(m) = h.owned.as_ref().and_then(|d| d.id_map) {
        // A joiner would run as the host's root in the session's
        // namespaces: the daemon's Exec runs it in the user namespace.
        return (
            Reply::error(
                ErrorKind::FailedPrecondition,
                format!("session {id} runs in a user namespace (uid/gid mapping {m}): it is not joined through the mount socket; run commands with the admin API's Exec (`layerstack session exec` falls back to it)"),
            ),
            vec![],
        );
    }
    let fds = pidfd.try_clone().and_then(|p| {
        let root = sys::open_dir_path(&PathBuf::from(format!("/proc/{pid}/root")))?;
        Ok(vec![p, root])
    });
    match fds {
        Ok(fds) if !sys::pidfd_exited(pidfd) => (
            Reply {
                ok: true,
                mode: Some(h.mode),
                workdir: h.workdir.clone(),
                ..Default::default()
            },
            fds,
        ),
        Ok(_) => (
            Reply::error(
                ErrorKind::FailedPrecondition,
                format!("session {id}'s init has exited"),
            ),
            vec![],
        ),
        Err(e) => (
            Reply::error(
                ErrorKind::Internal,
                format!("cannot open session {id}'s init: {e}"),
            ),
            vec![],
        ),
    }
}

impl AdminService {
    /// The stack a Mode B request names: a stack id or base digest known to the
    /// store, else an image reference resolved through containerd — whose stack
    /// is recorded now if this is the image's first session.
    pub(crate) async fn sandbox_stack(
        &self,
        namespace: &str,
        spec: &str,
    ) -> Result<String, Status> {
        require("stack (an image reference, stack id or base digest)", spec)?;
        let (ns, sp) = (namespace.to_string(), spec.to_string());
        if let Some(id) = self
            .engine
            .resolve_stack(&ns, &sp)
            .await
            .map_err(engine_status)?
        {
            return Ok(id);
        }
        let stack = self.stack_of(namespace, spec).await?;
        let chain = stack
            .strip_prefix(&format!("{namespace}/"))
            .unwrap_or(&stack)
            .to_string();
        let ns = namespace.to_string();
        self.engine
            .ensure_image_stack(&ns, &chain)
            .await
            .map_err(engine_status)?
            .ok_or_else(|| {
                Status::not_found(format!(
                    "image {spec:?} is not unpacked for the layerstack snapshotter in namespace {namespace:?} (ctr images pull/import --snapshotter layerstack)"
                ))
            })
    }

    pub(crate) async fn sandbox_create(
        &self,
        r: api::CreateSessionRequest,
    ) -> Result<api::CreateSessionResponse, Status> {
        refuse_reserved_name(&r.name)?;
        if r.wasi.is_some() || r.sandbox.is_some() {
            return self.sandbox_create_detached(r).await;
        }
        let (session, spec, created) = self
            .sandbox_create_spec(r, false, Default::default(), None)
            .await?;
        Ok(api::CreateSessionResponse {
            mounts: crate::wire::mounts(&spec),
            session: Some(session),
            created,
        })
    }

    /// A daemon-owned (or WASI) sandbox's create, run to its end in a task of
    /// its own: a caller that goes away meanwhile (a cancelled call, its
    /// deadline) must not leave half a sandbox — rows without an init the
    /// daemon knows, an overlay held in a namespace nobody owns, an init
    /// nobody reaps. A sandbox made for a caller that is gone is discarded
    /// (outcome `discarded`), unless the request carried an idempotency key:
    /// a retry with the key waits for it ([`Holders::creates`]) and is
    /// answered with it.
    async fn sandbox_create_detached(
        &self,
        r: api::CreateSessionRequest,
    ) -> Result<api::CreateSessionResponse, Status> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let me = self.clone();
        let keyed = !r.idempotency_key.is_empty();
        tokio::spawn(async move {
            let _one = match keyed {
                true => Some(
                    me.holders
                        .creates
                        .lock((r.namespace.clone(), r.idempotency_key.clone()))
                        .await,
                ),
                false => None,
            };
            let answer = if r.wasi.is_some() {
                crate::wasi::create(&me, r).await
            } else {
                crate::owned::create(&me, r).await
            };
            let Err(Ok(made)) = tx.send(answer) else {
                return;
            };
            let Some(id) = made
                .session
                .filter(|_| made.created && !keyed)
                .map(|s| s.id)
            else {
                return;
            };
            let discard = api::CloseSessionRequest {
                session_id: id,
                action: api::EndAction::Discard as i32,
                reason: "its create's caller went away before it was answered".into(),
                ..Default::default()
            };
            match me.sandbox_close(discard).await {
                Ok(_) => info!(
                    session.id = id,
                    "a sandbox whose creator went away was discarded"
                ),
                Err(e) => {
                    warn!(session.id = id, error = %e.message(), "cannot discard a sandbox whose creator went away")
                }
            }
        });
        rx.await.map_err(|_| {
            Status::internal("the sandbox's create ended without an answer (see the daemon's log)")
        })?
    }

    /// `CreateSession`: the session, its mount spec and whether it was created
    /// now. `daemon_owned`: the daemon starts the session's init itself
    /// (recorded on the session: `SessionOptions::daemon_owned`). `reserve`:
    /// what it counts against the pool's CPU and memory budgets (its limits).
    /// `id_map`: the session's uid/gid mapping (a daemon-owned sandbox's).
    pub(crate) async fn sandbox_create_spec(
        &self,
        r: api::CreateSessionRequest,
        daemon_owned: bool,
        reserve: layerstack_engine::Reservation,
        id_map: Option<layerstack_engine::IdMap>,
    ) -> Result<(api::Session, MountSpec, bool), Status> {
        let mut req = self.sandbox_request(r, daemon_owned, reserve).await?;
        req.id_map = id_map;
        // A session made ahead never takes the slot of another one made ahead.
        let ahead = req.wasi && req.name == layerstack_engine::store::READY_OWNER;
        let (s, spec, created) = match self.engine.create_sandbox_session(req.clone()).await {
            // The cap is reached: a ready WASI session (made ahead, unused)
            // gives its slot to the request.
            Err(EngineError::Busy(_)) if !ahead && crate::wasi::yield_slot(self).await => {
                self.engine.create_sandbox_session(req).await
            }
            made => made,
        }
        .map_err(engine_status)?;
        Ok((self.to_api(s).await?, spec, created))
    }

    /// The engine's request for CreateSession `r`: its exit policy checked,
    /// its stack resolved (an image reference, stack id or base digest), its
    /// branch defaulted.
    pub(crate) async fn sandbox_request(
        &self,
        r: api::CreateSessionRequest,
        daemon_owned: bool,
        reserve: layerstack_engine::Reservation,
    ) -> Result<SandboxRequest, Status> {
        self.sandbox_request_with(r, daemon_owned, reserve, true)
            .await
    }

    /// [`AdminService::sandbox_request`]; without `resolve`, the stack is
    /// left empty (a claim of a ready session, whose stack is its own).
    pub(crate) async fn sandbox_request_with(
        &self,
        r: api::CreateSessionRequest,
        daemon_owned: bool,
        reserve: layerstack_engine::Reservation,
        resolve: bool,
    ) -> Result<SandboxRequest, Status> {
        let policy = match r.policy.as_str() {
            "" => None,
            p => Some(p.parse::<api::policy::ExitPolicy>().map_err(|_| {
                Status::invalid_argument(format!(
                    "exit policy {p:?} is not one of on-exit, on-success, never, checkpoint"
                ))
            })?),
        };
        if policy == Some(api::policy::ExitPolicy::Checkpoint) && r.node.is_empty() {
            return Err(Status::invalid_argument(
                "exit policy checkpoint makes a child node of the session's node: start the session on a node (--node ID), or use on-exit, on-success or never",
            ));
        }
        let node = (!r.node.is_empty()).then(|| r.node.clone());
        let stack = if node.is_some() || !resolve {
            String::new()
        } else {
            self.sandbox_stack(&r.namespace, &r.stack).await?
        };
        let branch = if r.branch.is_empty() {
            self.engine.default_branch().to_string()
        } else {
            r.branch.clone()
        };
        Ok(SandboxRequest {
            name: if r.name.is_empty() {
                "session".into()
            } else {
                r.name
            },
            stack,
            target: LeaseTarget::Branch(branch),
            idempotency_key: (!r.idempotency_key.is_empty()).then_some(r.idempotency_key),
            policy,
            wait: (r.wait_ms > 0).then(|| Duration::from_millis(r.wait_ms.into())),
            node,
            ignore_mtime: r.ignore_mtime,
            daemon_owned,
            wasi: r.wasi.is_some(),
            reserve,
            id_map: None,
        })
    }

    pub(crate) async fn sandbox_close(
        &self,
        r: api::CloseSessionRequest,
    ) -> Result<api::Session, Status> {
        if r.session_id == 0 {
            return Err(Status::invalid_argument("session_id is required"));
        }
        let id = r.session_id;
        let how = match api::EndAction::from_i32(r.action) {
            Some(api::EndAction::Publish) => EndAction::Publish,
            Some(api::EndAction::Discard) => EndAction::Discard,
            Some(api::EndAction::Auto) => EndAction::Auto {
                exit_status: r.has_exit_status.then_some(r.exit_status),
                state: (!r.state.is_empty()).then(|| r.state.clone()),
                command: (!r.command.is_empty()).then(|| r.command.clone()),
                labels: r.labels.clone().into_iter().collect(),
            },
            Some(api::EndAction::Checkpoint) => EndAction::Checkpoint {
                exit_status: r.has_exit_status.then_some(r.exit_status),
                state: (!r.state.is_empty()).then(|| r.state.clone()),
                command: (!r.command.is_empty()).then(|| r.command.clone()),
                labels: r.labels.clone().into_iter().collect(),
                rollout: None,
            },
            None => {
                return Err(Status::invalid_argument(format!(
                    "unknown end action {}: use PUBLISH, DISCARD, AUTO or CHECKPOINT",
                    r.action
                )))
            }
        };
        // A checkpoint's state must be JSON: refused before the init is
        // stopped (the sandbox stays live, the close can be sent again).
        check_close_state(&r)?;
        // A checkpoint needs a running attempt of a graph node: refused before
        // anything ends (the sandbox stays live), unless the session has
        // ended already (a repeated close answers its recorded end).
        // So does a state or labels an AUTO close could not record.
        let auto_records =
            matches!(how, EndAction::Auto { .. }) && (!r.state.is_empty() || !r.labels.is_empty());
        if matches!(how, EndAction::Checkpoint { .. }) || auto_records {
            let s = self.engine.session(id).await.map_err(engine_status)?;
            let running = self
                .engine
                .attempt_of_session(id)
                .await
                .map_err(engine_status)?
                .is_some_and(|a| a.status == layerstack_engine::store::AttemptStatus::Running);
            if !s.released && !running {
                return Err(Status::failed_precondition(if auto_records {
                    format!(
                        "session {id} is not a running attempt of a graph node: its AUTO close cannot checkpoint, so nothing would record the state and labels given; leave them out, or start the session on a node (CreateSession.node, sandbox(node=…))"
                    )
                } else {
                    format!(
                        "session {id} is not a running attempt of a graph node: only a session started on a node (CreateSession.node, sandbox(node=…)) can be checkpointed; publish or discard this one"
                    )
                }));
            }
        }
        let started = std::time::Instant::now();
        let init = self.stop_init(id);
        let ready = crate::wasi::release(self, id, matches!(how, EndAction::Discard)).await;
        // A discard of a daemon-owned session waits for its init to end (its
        // pid namespace empty): then no census is needed (`Writers::Gone`).
        let writers = match init {
            Some(fd) if matches!(how, EndAction::Discard) => {
                match tokio::time::timeout(INIT_EXIT_PATIENCE, crate::owned::exited(&fd)).await {
                    Ok(Ok(())) => Writers::Gone,
                    _ => Writers::Unknown,
                }
            }
            _ => Writers::Unknown,
        };
        let released_us = started.elapsed().as_micros() as u64;
        let why = if r.reason.is_empty() {
            "session closed".to_string()
        } else {
            r.reason
        };
        let out = self
            .engine
            .close_sandbox_session_with(id, how, &why, CLOSE_PATIENCE, writers)
            .await;
        if out.is_err() {
            self.close_failed(id);
        }
        crate::wasi::closed(self, ready);
        let s = out.map_err(engine_status)?;
        let closed_us = started.elapsed().as_micros() as u64;
        let s = self.to_api(s).await;
        debug!(
            session.id = id,
            released_us,
            closed_us,
            answered_us = started.elapsed().as_micros() as u64,
            "CloseSession"
        );
        s
    }

    /// Stops session `id`'s init if it still runs (a daemon-owned session, or
    /// a holder's in create mode): the end of its connection is expected from
    /// now on, and its mounts go with its mount namespace. Answers the
    /// init's pidfd when the session is daemon-owned (the init is this
    /// daemon's child: `crate::owned::exited` can wait for it).
    pub(crate) fn stop_init(&self, id: SessionId) -> Option<Arc<OwnedFd>> {
        let (init, owned) = {
            let mut m = self.holders.map();
            match m.get_mut(&id) {
                Some(h) => {
                    h.closing = true;
                    (h.init.as_ref().map(|(_, fd)| fd.clone()), h.owned.is_some())
                }
                None => (None, false),
            }
        };
        if let Some(fd) = &init {
            if !sys::pidfd_exited(fd) {
                if let Err(e) = sys::pidfd_kill(fd, libc::SIGKILL) {
                    debug!(session.id = id, error = %e, "stopping the session's init");
                }
            }
        }
        init.filter(|_| owned)
    }

    /// The close that [`AdminService::stop_init`] announced failed: the end
    /// of the holder's connection is unexpected again.
    pub(crate) fn close_failed(&self, id: SessionId) {
        if let Some(h) = self.holders.map().get_mut(&id) {
            h.closing = false;
        }
    }
}

/// A close's `state` (CHECKPOINT, or AUTO whose policy may checkpoint) is a
/// node state the store takes (`store::validate_state`: JSON, at most
/// 64 KiB): checked before anything of the session ends — by CloseSession
/// before its init is stopped, by RunSession before the session is made.
pub(crate) fn check_close_state(r: &api::CloseSessionRequest) -> Result<(), Status> {
    let checkpoints = matches!(
        api::EndAction::from_i32(r.action),
        Some(api::EndAction::Checkpoint | api::EndAction::Auto)
    );
    if !checkpoints && (!r.state.is_empty() || !r.labels.is_empty()) {
        return Err(Status::invalid_argument(
            "state and labels are recorded by a checkpoint only: close with CHECKPOINT (or AUTO, on a node's attempt), or leave them out",
        ));
    }
    if checkpoints && !r.state.is_empty() {
        layerstack_engine::store::validate_state(&r.state).map_err(|e| {
            Status::invalid_argument(format!(
                "the close's state: {} (give a JSON object, e.g. {{\"reward\": 1.0}})",
                api::error_chain(&e)
            ))
        })?;
    }
    Ok(())
}
