//! Daemon-owned sessions and the session RPCs a pure gRPC client drives a
//! sandbox with: `CreateSession{sandbox}`, `Exec`, the file RPCs
//! (`ReadFile`, `WriteFile`, `ListDir`, `StatPath`, `RemovePath`,
//! `UploadTar`, `DownloadTar`). docs/architecture.md "Daemon-owned sessions".
//!
//! ```text
//! CreateSession{sandbox}   session row + lease (the engine's), overlay built
//!                          (sandbox::attach), init cloned by the process
//!                          spawner (spawn.rs; holder::clone_init with
//!                          daemon_owned: every other fd closed,
//!                          PR_SET_PDEATHSIG = SIGKILL, CLONE_PARENT: the
//!                          daemon's child), its ready pipe awaited, its
//!                          pidfd in Holders; a task waits on the pidfd and
//!                          reaps init
//! Exec                     waiter = cloned by the spawner (CLONE_PARENT),
//!                          setns(init's pidfd), chroot(init's root); command
//!                          = its child, own process group; pipes for stdio,
//!                          the waiter's pidfd polled for the end
//! files                    /proc/<init>/root opened, pidfd checked alive after,
//!                          then openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
//! CloseSession             unchanged (sandbox_close): init SIGKILLed by pidfd,
//!                          census, end action, release
//! ```
//!
//! Why a spawner process: a clone of the running daemon copies its page
//! tables, the cost of every sandbox start and exec (benchmark P7b); the
//! spawner, forked at the start of `main`, is small. Why `CLONE_PARENT`: the
//! daemon reaps inits and waiters by pidfd, and an init's parent-death
//! signal follows the daemon's main thread, so init dies exactly when the
//! daemon does. docs/architecture.md "Daemon-owned sessions".
//!
//! Both daemon-owned sessions and sessions held by `layerstack session
//! create|run` have an init pidfd in [`Holders`]: Exec and the files serve
//! both.

use std::ffi::{CString, OsStr};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use layerstack_api as api;
use layerstack_engine::store::{ErrorKind, SessionId};
use layerstack_engine::EndAction;
use layerstack_sandbox::cgroup::{CgroupError, Cgroups, Limits, SessionCgroup};
use layerstack_sandbox::holder::{self, Command, Hide, Placement, DEFAULT_PATH};
use layerstack_sandbox::spawner::{self, InitSpec};
use layerstack_sandbox::sys::{self, CArgs, Exit};
use layerstack_sandbox::wire::{Mode, Reply};
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{Mode as NMode, SFlag};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tracing::{debug, info, warn};

use crate::admin::AdminService;
use crate::sandbox::Holder;

/// A server stream of the session RPCs.
pub type Stream<T> = Pin<Box<dyn futures::Stream<Item = Result<T, Status>> + Send>>;

/// Largest chunk of a streamed reply (stdout, stderr, file content), bytes.
pub(crate) const CHUNK: usize = 64 * 1024;

/// How long Exec keeps reading stdout/stderr after the command ended, for
/// output still in the pipes; a background child that keeps them open longer
/// is not waited for.
const DRAIN: Duration = Duration::from_millis(100);

/// Exec's defaults of a daemon-owned session.
#[derive(Debug, Clone, Default)]
pub struct Defaults {
    pub env: Vec<(String, String)>,
    pub user: Option<(u32, u32)>,
    pub hostname: String,
    /// Workspace placement: the directory the overlay is mounted at.
    pub placement: Option<String>,
    /// The session's cgroup (a limit was asked): exec'd commands join it.
    pub cgroup: Option<Arc<SessionCgroup>>,
    /// The limits its cgroup enforces (0: none) — `Session.limits`.
    pub limits: layerstack_sandbox::cgroup::Limits,
    /// It shares the daemon's network namespace.
    pub network: bool,
    /// Its uid/gid mapping: Exec joins its user namespace, and the file RPCs
    /// translate ids between the session's and the host's.
    pub id_map: Option<layerstack_engine::IdMap>,
}

/// What the daemon applies to every daemon-owned session: cgroup limits and
/// the socket paths a workspace-mode session must not reach.
pub struct SessionLimits {
    /// The machine's cgroup setup, probed at start (`None`: not probed; a
    /// limit is then refused as unavailable).
    pub cgroups: Option<Cgroups>,
    /// `[sandbox] default_*`: a limit CreateSession leaves unset.
    pub defaults: Limits,
    /// The daemon's sockets (admin, mount, snapshots).
    pub sockets: Vec<std::path::PathBuf>,
    /// `[sandbox] id_map`: the uid/gid mapping of a session that gives none.
    pub id_map: Option<layerstack_engine::IdMap>,
    /// `[sandbox] file_stream_idle_s`: how long a client stream of the file
    /// RPCs may send nothing, or a reader take nothing (`None`: no limit).
    pub file_stream_idle: Option<Duration>,
}

/// The limits a session gets: each field of `opts` given, else the daemon's
/// default; checked (INVALID_ARGUMENT naming the field).
fn session_limits(opts: &api::SandboxOptions, d: Limits) -> Result<Limits, Status> {
    let l = Limits {
        cpu_millis: opts.cpu_millis.unwrap_or(d.cpu_millis),
        memory_bytes: opts.memory_bytes.unwrap_or(d.memory_bytes),
        pids: opts.pids.unwrap_or(d.pids),
    };
    l.validate("sandbox.").map_err(Status::invalid_argument)?;
    Ok(l)
}

fn cgroup_status(e: &CgroupError) -> Status {
    match e {
        CgroupError::Unavailable { .. } => Status::failed_precondition(format!(
            "{e} (docs/operations.md \"Session limits\"; or create the session without this limit)"
        )),
        CgroupError::Io { source, .. } => Status::internal(format!("{e}: {source}")),
    }
}

/// What a workspace-mode session covers so it cannot reach the daemon's
/// sockets: each socket's directory (a tmpfs over it), or the socket itself
/// when its directory is `/`. A placement inside a covered directory is
/// refused (INVALID_ARGUMENT): the session could not see its own overlay.
fn hide_list(sockets: &[std::path::PathBuf], placement: &str) -> Result<Vec<Hide>, Status> {
    use std::path::Path;
    let mut dirs: Vec<&Path> = Vec::new();
    let mut files: Vec<&Path> = Vec::new();
    for s in sockets {
        match s.parent() {
            Some(d) if d != Path::new("/") && !d.as_os_str().is_empty() => dirs.push(d),
            _ => files.push(s),
        }
    }
    dirs.sort();
    dirs.dedup();
    for d in &dirs {
        if Path::new(placement).starts_with(d) {
            return Err(Status::invalid_argument(format!(
                "sandbox.placement {placement:?} is inside {}, the directory of the daemon's sockets, which workspace sessions do not see: place the session elsewhere",
                d.display()
            )));
        }
    }
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| Status::internal("a socket path holds a NUL byte"))
    };
    let mut v = Vec::new();
    for d in dirs {
        v.push(Hide::Dir(c(d)?));
    }
    for f in files {
        v.push(Hide::File(c(f)?));
    }
    Ok(v)
}

pub(crate) fn reply_status(r: Reply) -> Status {
    let kind = ErrorKind::parse(&r.code).unwrap_or(ErrorKind::Internal);
    api::status(kind, r.message)
}

fn io_status(what: &str, e: &io::Error) -> Status {
    Status::internal(format!("{what}: {e}"))
}

/// A `KEY=VALUE` list, checked.
pub(crate) fn parse_env(field: &str, env: &[String]) -> Result<Vec<(String, String)>, Status> {
    env.iter()
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() && !kv.contains('\0') => {
                Ok((k.to_string(), v.to_string()))
            }
            _ => Err(Status::invalid_argument(format!(
                "{field} entry {kv:?} is not KEY=VALUE (a non-empty key, no NUL byte)"
            ))),
        })
        .collect()
}

/// Refuses uid or gid 4294967295: `(uid_t) -1`, which setresuid(2) and
/// setresgid(2) read as "leave it unchanged" (the command would keep the
/// daemon's ids — or fail). `prefix`: the fields' prefix (`sandbox.`).
pub(crate) fn check_ids(prefix: &str, uid: u32, gid: u32) -> Result<(), Status> {
    for (field, id) in [("uid", uid), ("gid", gid)] {
        if id == u32::MAX {
            return Err(Status::invalid_argument(format!(
                "{prefix}{field} {id} is (uid_t) -1, which the kernel reads as \"unchanged\": give an id below 4294967295"
            )));
        }
    }
    Ok(())
}

/// The most bytes of a hostname (HOST_NAME_MAX).
const HOSTNAME_MAX: usize = 64;

/// Refuses a hostname that is not 1 to 64 letters, digits, `-`, `.` or `_`
/// (RFC 1123 names, and `_` as many tools accept): it becomes the session's
/// `uname -n` and its commands' `HOSTNAME`.
fn check_hostname(h: &str) -> Result<(), Status> {
    let ok = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_');
    let first_ok = h.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric());
    if !first_ok || h.len() > HOSTNAME_MAX || !h.bytes().all(ok) {
        return Err(Status::invalid_argument(format!(
            "sandbox.hostname {h:?}: give 1 to {HOSTNAME_MAX} letters, digits, '-', '.' or '_', starting with a letter or digit"
        )));
    }
    Ok(())
}

/// The default hostname: the sandbox's name with what a hostname cannot
/// hold replaced by `-`, cut to 64 bytes; "session" for none.
fn default_hostname(name: &str) -> String {
    let h: String = name
        .bytes()
        .take(HOSTNAME_MAX)
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_') {
                b as char
            } else {
                '-'
            }
        })
        .collect();
    // "session" for none, or for one that does not start with a letter or digit.
    if check_hostname(&h).is_ok() {
        h
    } else {
        "session".to_string()
    }
}

fn absolute(field: &str, p: &str) -> Result<(), Status> {
    if p.contains('\0') {
        return Err(Status::invalid_argument(format!(
            "{field} {p:?} holds a NUL byte, which no path can"
        )));
    }
    if !p.starts_with('/') {
        return Err(Status::invalid_argument(format!(
            "{field} {p:?} is not an absolute path in the session's view (start it with /)"
        )));
    }
    Ok(())
}

/// `CreateSession` with `sandbox` options: see the module docs.
pub(crate) async fn create(
    admin: &AdminService,
    mut r: api::CreateSessionRequest,
) -> Result<api::CreateSessionResponse, Status> {
    let opts = r.sandbox.take().unwrap_or_default();
    let env = parse_env("sandbox.env", &opts.env)?;
    if !opts.workdir.is_empty() {
        absolute("sandbox.workdir", &opts.workdir)?;
    }
    let placement = match opts.placement.as_str() {
        "" | "/" => None,
        p => {
            absolute("sandbox.placement", p)?;
            // The overlay is mounted there from the daemon's mount namespace
            // view of the host: it must be a directory now (a missing one
            // would fail inside init, where the reason cannot reach the caller).
            match std::fs::metadata(p) {
                Ok(md) if md.is_dir() => {}
                Ok(_) => {
                    return Err(Status::invalid_argument(format!(
                        "sandbox.placement {p:?} is not a directory on the daemon's host: give an existing directory (workspace mode mounts the session's tree there)"
                    )))
                }
                Err(e) => {
                    return Err(Status::invalid_argument(format!(
                        "sandbox.placement {p:?} on the daemon's host: {e}: give an existing directory (workspace mode mounts the session's tree there)"
                    )))
                }
            }
            Some(p.to_string())
        }
    };
    let hostname = if opts.hostname.is_empty() {
        default_hostname(&r.name)
    } else {
        check_hostname(&opts.hostname)?;
        opts.hostname.clone()
    };
    if opts.has_user {
        check_ids("sandbox.", opts.uid, opts.gid)?;
    }
    let rt = admin.holders.limits.get().cloned();
    let limits = session_limits(&opts, rt.as_ref().map(|r| r.defaults).unwrap_or_default())?;
    let id_map = match &opts.id_map {
        Some(m) => {
            let m = layerstack_engine::IdMap {
                host_uid: m.host_uid,
                host_gid: m.host_gid,
                size: m.size,
            };
            m.validate()
                .map_err(|e| Status::invalid_argument(format!("sandbox.{e}")))?;
            Some(m)
        }
        None => rt.as_ref().and_then(|r| r.id_map),
    };
    if let (Some(m), Some(p)) = (&id_map, &placement) {
        return Err(Status::invalid_argument(format!(
            "sandbox.placement {p:?} with the uid/gid mapping {m}: a workspace-mode session keeps the host's tree, whose ids the session's user namespace does not map; give no placement (the session's tree becomes its root){}",
            if opts.id_map.is_none() { " (the mapping is the daemon's [sandbox] id_map)" } else { ", or no id_map" }
        )));
    }
    if let Some((u, g)) = opts.has_user.then_some((opts.uid, opts.gid)) {
        if let Some(m) = id_map.filter(|m| u >= m.size || g >= m.size) {
            return Err(Status::invalid_argument(format!(
                "sandbox user {u}:{g} is outside the session's uid/gid mapping {m} (ids 0..{}): give ids below {}",
                m.size, m.size
            )));
        }
    }
    if !limits.is_empty() {
        // Unavailable controllers are refused before a session is made.
        match rt.as_ref().and_then(|r| r.cgroups.as_ref()) {
            Some(cg) => cg.check(&limits).map_err(|e| cgroup_status(&e))?,
            None => {
                return Err(Status::failed_precondition(
                    "session limits are not set up in this daemon (no cgroup probe): create the session without limits",
                ))
            }
        }
    }
    let hide = match (&placement, &rt) {
        (Some(p), Some(rt)) => hide_list(&rt.sockets, p)?,
        _ => Vec::new(),
    };
    let reserve = layerstack_engine::Reservation {
        cpu_millis: limits.cpu_millis,
        memory_bytes: limits.memory_bytes,
    };
    // The phases of the create, µs since here, in its log line: the session
    // made (store rows, directories), its overlay built, its init cloned or
    // a ready one claimed, init ready.
    let t0 = Instant::now();
    let (session, spec, created) = admin.sandbox_create_spec(r, true, reserve, id_map).await?;
    let made_us = t0.elapsed().as_micros() as u64;
    let mut overlay_us = 0u64;
    let mut claim_us = 0u64;
    let id = session.id;
    // The mapping recorded with the session (a retry of its key had to give
    // the same).
    let session_id_map = id_map;
    let holders = admin.holders.clone();
    if !created && session.released {
        // A retry of a key whose session ended: its end as recorded.
        return Ok(api::CreateSessionResponse {
            mounts: Vec::new(),
            session: Some(session),
            created: false,
        });
    }
    if !created {
        // An idempotency key's earlier session: the same session, no second init.
        return match holders.map().get(&id) {
            Some(h) if h.init.is_some() => Ok(api::CreateSessionResponse {
                mounts: crate::wire::mounts(&spec),
                session: Some(session),
                created: false,
            }),
            _ => Err(Status::failed_precondition(format!(
                "idempotency key names session {id}, which has no live init (its init ended, or it was not daemon-owned): close it and create another"
            ))),
        };
    }
    let conn = holders.next_conn.fetch_add(1, Ordering::Relaxed);
    let mut cgroup: Option<Arc<SessionCgroup>> = None;
    let started = async {
        if let Some(cg) = rt.as_ref().and_then(|r| r.cgroups.as_ref()) {
            cgroup = cg
                .create(id, &limits)
                .map_err(|e| cgroup_status(&e))?
                .map(Arc::new);
        }
        let procs = cgroup.as_ref().map(|c| c.procs_fds()).unwrap_or_default();
        let keep_cg = cgroup.clone();
        let fd = crate::sandbox::attach_mapped(
            &admin.engine,
            &holders,
            conn,
            id,
            Some(spec.clone()),
            session_id_map,
        )
        .await
        .map_err(reply_status)?;
        overlay_us = t0.elapsed().as_micros() as u64;
        // A root-mode session without network, limits or mapping: an init
        // made ahead takes the overlay (`ready`), else one is cloned now.
        let made_ahead = if placement.is_none()
            && !opts.network
            && cgroup.is_none()
            && session_id_map.is_none()
        {
            holders.ready_inits.take()
        } else {
            None
        };
        // A ready init that dies as it is claimed (killed meanwhile: the
        // claim's send can still succeed) ends without its ready byte: a
        // cloned init then takes the overlay, through this copy of its fd.
        let mut spare: Option<OwnedFd> = None;
        let mut hide = Some(hide);
        let (pid, pidfd, ready, go) = match made_ahead {
            Some(r) => match r.claim(hostname.as_bytes(), &fd) {
                Ok(()) => {
                    spare = Some(fd);
                    debug!(session.id = id, init = r.pid, "a ready init took the session");
                    (r.pid, r.pidfd, r.ready, None)
                }
                Err(e) => {
                    // Gone meanwhile (killed): clone one as usual.
                    warn!(session.id = id, init = r.pid, error = %e, "a ready init could not be claimed: cloning one");
                    let _ = wait_pidfd(&r.pidfd).await;
                    clone_init(&holders, &placement, &opts, &hostname, hide.take().unwrap_or_default(), session_id_map, fd, &procs).await?
                }
            },
            None => clone_init(&holders, &placement, &opts, &hostname, hide.take().unwrap_or_default(), session_id_map, fd, &procs).await?,
        };
        drop(keep_cg);
        claim_us = t0.elapsed().as_micros() as u64;
        match await_ready(id, pid, &pidfd, ready, go, session_id_map).await {
            Ok(()) => Ok((pid, pidfd)),
            Err(st) => match spare {
                Some(fd) => {
                    warn!(session.id = id, init = pid, error = %st.message(), "a claimed ready init ended before it was ready: cloning one");
                    let (pid, pidfd, ready, go) = clone_init(&holders, &placement, &opts, &hostname, hide.take().unwrap_or_default(), session_id_map, fd, &procs).await?;
                    await_ready(id, pid, &pidfd, ready, go, session_id_map)
                        .await
                        .map(|()| (pid, pidfd))
                }
                None => Err(st),
            },
        }
    }
    .await;
    // The working directory, made when missing (root mode: the session's
    // tree is its root; in workspace mode it is the host's tree, never
    // written here). A workdir that cannot be one ends the create.
    let started = match started {
        Ok((pid, pidfd)) if placement.is_none() && !opts.workdir.is_empty() => {
            let owner = match session_id_map {
                None => opts.has_user.then_some((opts.uid, opts.gid)),
                Some(m) => {
                    let (u, g) = if opts.has_user {
                        (opts.uid, opts.gid)
                    } else {
                        (0, 0)
                    };
                    // Checked against the mapping above.
                    m.uid_to_host(u).zip(m.gid_to_host(g))
                }
            };
            match workdir(id, pid, &pidfd, &opts.workdir, owner) {
                Ok(()) => Ok((pid, pidfd)),
                Err(st) => {
                    let _ = sys::pidfd_kill(&pidfd, libc::SIGKILL);
                    let _ = wait_pidfd(&pidfd).await;
                    Err(st)
                }
            }
        }
        other => other,
    };
    let (pid, pidfd) = match started {
        Ok((pid, pidfd)) => (pid, Arc::new(pidfd)),
        Err(st) => {
            if let Some(cg) = cgroup.take() {
                remove_cgroup(id, cg);
            }
            {
                let mut m = holders.map();
                if m.get(&id).is_some_and(|h| h.conn == conn) {
                    m.remove(&id);
                }
            }
            if let Err(e) = admin
                .engine
                .close_sandbox_session(
                    id,
                    EndAction::Discard,
                    "session setup failed",
                    Duration::from_secs(10),
                )
                .await
            {
                warn!(session.id = id, error = %api::error_chain(&e), "cannot discard a session whose init could not start");
            }
            return Err(st);
        }
    };
    if placement.is_none() {
        admin.engine.sandbox_root_mode(id);
    }
    let defaults = Arc::new(Defaults {
        env,
        user: opts.has_user.then_some((opts.uid, opts.gid)),
        hostname,
        placement: placement.clone(),
        cgroup: cgroup.clone(),
        limits,
        network: opts.network,
        id_map: session_id_map,
    });
    {
        let mut m = holders.map();
        if let Some(h) = m.get_mut(&id).filter(|h| h.conn == conn) {
            h.init = Some((pid, pidfd.clone()));
            h.mode = if placement.is_some() {
                Mode::Workspace
            } else {
                Mode::Root
            };
            h.workdir = if opts.workdir.is_empty() {
                placement.clone().unwrap_or_else(|| "/".into())
            } else {
                opts.workdir.clone()
            };
            h.owned = Some(defaults);
        }
    }
    let ready_us = t0.elapsed().as_micros() as u64;
    watch_init(admin.clone(), id, conn, pidfd, cgroup.clone());
    info!(
        session.id = id,
        init = pid,
        ?limits,
        made_us,
        overlay_us,
        claim_us,
        ready_us,
        "daemon-owned session started"
    );
    // The session as made, with the limits its init now runs under: no
    // second read of the store on the create's path (a thread hand-off and
    // a query after every start).
    let session = api::Session {
        limits: holders.owned_limits(id),
        ..session
    };
    Ok(api::CreateSessionResponse {
        mounts: crate::wire::mounts(&spec),
        session: Some(session),
        created: true,
    })
}

/// Makes sandbox `id`'s working directory `workdir` in its tree (init
/// `pid`, ready) when missing ([`files::make_workdir`]). Errors:
/// INVALID_ARGUMENT naming the workdir when it is not a directory of the
/// tree; FAILED_PRECONDITION when init ended meanwhile.
fn workdir(
    id: SessionId,
    pid: i32,
    pidfd: &OwnedFd,
    workdir: &str,
    owner: Option<(u32, u32)>,
) -> Result<(), Status> {
    let rel = files::rel_path(workdir)
        .map_err(|st| Status::invalid_argument(format!("sandbox.workdir: {}", st.message())))?;
    let root = open_root_of(id, pid, pidfd)?;
    match files::make_workdir(&root, &rel, owner) {
        Ok(()) => Ok(()),
        Err(e) => Err(Status::invalid_argument(format!(
            "sandbox.workdir {workdir:?} cannot be the session's working directory: {e}: give a directory of the session's tree, or a path that does not exist yet (it is made, as Docker makes a missing WORKDIR)"
        ))),
    }
}

/// Waits for the ready byte of session `id`'s init (`pid`, `pidfd`) on its
/// `ready` pipe — with a uid/gid mapping `map`, first its `u`, answered by
/// the mapping and a byte on `go`. Init ended before it was ready: it is
/// reaped, INTERNAL with its exit status (init's reason is in the daemon's
/// log).
async fn await_ready(
    id: SessionId,
    pid: i32,
    pidfd: &OwnedFd,
    ready: OwnedFd,
    go: Option<OwnedFd>,
    map: Option<layerstack_engine::IdMap>,
) -> Result<(), Status> {
    let mut ready = tokio::net::unix::pipe::Receiver::from_owned_fd(ready)
        .map_err(|e| io_status("init's ready pipe", &e))?;
    let mut b = [0u8; 1];
    let mut r = ready.read(&mut b).await;
    if let (Ok(1), b'u', Some(go), Some(map)) = (&r, b[0], &go, &map) {
        // A mapped init unshared its user namespace: its mapping, then go.
        if let Err(e) = layerstack_sandbox::holder::map_ids(pid, map, go) {
            let _ = sys::pidfd_kill(pidfd, libc::SIGKILL);
            let _ = wait_pidfd(pidfd).await;
            return Err(io_status(&format!("session {id}'s init"), &e));
        }
        r = ready.read(&mut b).await;
    }
    match r {
        Ok(1) if b[0] == b'r' => Ok(()),
        r => {
            // Init ended before it was ready: setup failed (or the pipe
            // broke: then init is ended here). Reap it for its status.
            if r.is_err() {
                let _ = sys::pidfd_kill(pidfd, libc::SIGKILL);
            }
            let x = wait_pidfd(pidfd)
                .await
                .map_err(|e| io_status("waiting for the session's init", &e))?;
            Err(Status::internal(format!(
                "session {id}'s init could not set the session up (exit status {}; the daemon's log has init's reason)",
                x.shell_status()
            )))
        }
    }
}

/// Clones a daemon-owned session's init with the process spawner (the
/// overlay `fd`, the cgroup's `procs` descriptors): its pid, pidfd, the
/// read end of its ready pipe and, with `id_map`, the write end of its `go`
/// pipe ([`layerstack_sandbox::holder::map_ids`]). The spawner keeps no
/// copy of `fd`.
#[allow(clippy::too_many_arguments)]
async fn clone_init(
    holders: &crate::sandbox::Holders,
    placement: &Option<String>,
    opts: &api::SandboxOptions,
    hostname: &str,
    hide: Vec<Hide>,
    id_map: Option<layerstack_engine::IdMap>,
    fd: OwnedFd,
    procs: &[std::os::fd::RawFd],
) -> Result<(i32, OwnedFd, OwnedFd, Option<OwnedFd>), Status> {
    let sp = spawner(holders)?;
    let placement_c = match placement {
        None => Placement::Root,
        Some(p) => Placement::At(
            CString::new(p.as_bytes())
                .map_err(|_| Status::invalid_argument("sandbox.placement holds a NUL byte"))?,
        ),
    };
    let init = InitSpec {
        placement: placement_c,
        net_none: !opts.network,
        hostname: hostname.as_bytes().to_vec(),
        hide,
        id_map,
    };
    let req = spawner::init_request(&init, fd.as_raw_fd(), procs)
        .map_err(|e| io_status("the init's spawn request", &e))?;
    let (pid, fds) = sp.spawn("the session's init", &req)?;
    // The spawner has its copies: only init keeps the overlay and the
    // cgroup's descriptors from now on.
    drop(fd);
    let pidfd = match sys::pidfd_open(pid) {
        Ok(p) => p,
        Err(e) => {
            // Cannot happen for a child not yet reaped; stop it anyway.
            sys::kill(pid, libc::SIGKILL);
            return Err(io_status("cannot open a pidfd for the session's init", &e));
        }
    };
    let mut fds = fds.into_iter();
    let (ready, go) = (fds.next(), fds.next());
    let (Some(ready), true) = (ready, go.is_some() == id_map.is_some()) else {
        let _ = sys::pidfd_kill(&pidfd, libc::SIGKILL);
        let _ = wait_pidfd(&pidfd).await;
        return Err(Status::internal(
            "the process spawner answered without init's ready pipe (or its go pipe)",
        ));
    };
    Ok((pid, pidfd, ready, go))
}

/// Waits for a daemon-owned session's init to end and reaps it. An end that
/// CloseSession did not ask for (init killed, setup of the namespaces gone
/// wrong) is an infrastructure failure: the run ends `interrupted`
/// (`init-gone`), never by its policy, its writes kept until discarded.
fn watch_init(
    admin: AdminService,
    id: SessionId,
    conn: u64,
    pidfd: Arc<OwnedFd>,
    cgroup: Option<Arc<SessionCgroup>>,
) {
    tokio::spawn(async move {
        let exit = match wait_pidfd(&pidfd).await {
            Ok(x) => Some(x),
            Err(e) => {
                warn!(session.id = id, error = %e, "cannot wait for the session's init");
                None
            }
        };
        if let Some(cg) = cgroup {
            remove_cgroup(id, cg);
        }
        let closing = {
            let mut m = admin.holders.map();
            match m.get(&id) {
                Some(h) if h.conn == conn => m.remove(&id).is_some_and(|h| h.closing),
                _ => true,
            }
        };
        debug!(session.id = id, ?exit, closing, "daemon-owned init ended");
        if !closing {
            let released = admin
                .engine
                .session(id)
                .await
                .map(|s| s.released)
                .unwrap_or(true);
            if !released {
                info!(
                    session.id = id,
                    "the init of a daemon-owned session ended without CloseSession"
                );
                admin.engine.sandbox_init_gone(id);
            }
        }
    });
}

/// Removes a session's cgroup once its processes are gone: init's exit made
/// the kernel kill the session's pid namespace, whose processes may take a
/// moment to leave (retried for up to 10 s, then logged; the next daemon
/// start removes what is left).
fn remove_cgroup(id: SessionId, cg: Arc<SessionCgroup>) {
    tokio::spawn(async move {
        let t0 = Instant::now();
        let mut wait = Duration::from_millis(2);
        loop {
            match cg.remove() {
                Ok(()) => {
                    debug!(session.id = id, "session cgroup removed");
                    return;
                }
                Err(e) if t0.elapsed() > Duration::from_secs(10) => {
                    warn!(session.id = id, error = %e, "a session's cgroup is still busy: left for the next daemon start");
                    return;
                }
                Err(_) => {
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_millis(200));
                }
            }
        }
    });
}

/// Waits until the process of `pidfd` has ended (its pidfd is readable),
/// without reaping it: [`watch_init`] reaps a session's init.
pub(crate) async fn exited(pidfd: &OwnedFd) -> io::Result<()> {
    if sys::pidfd_exited(pidfd) {
        return Ok(());
    }
    let dup = pidfd.try_clone()?;
    // SAFETY: `dup` is an OwnedFd moved into the AsyncFd: it stays open and
    // names the same pidfd until the AsyncFd drops.
    let afd = unsafe { AsyncFd::register_with_interest(dup, tokio::io::Interest::READABLE) }
        .map_err(io::Error::from)?;
    loop {
        if sys::pidfd_exited(afd.get_ref()) {
            return Ok(());
        }
        let mut g = afd.readable().await?;
        g.clear_ready();
    }
}

/// Waits until the child of `pidfd` ends, and reaps it.
async fn wait_pidfd(pidfd: &OwnedFd) -> io::Result<Exit> {
    loop {
        if let Some(x) = sys::reap_pidfd(pidfd)? {
            return Ok(x);
        }
        exited(pidfd).await?;
    }
}

/// The live init of session `id`: pid, pidfd, mode, default workdir and
/// daemon-owned defaults.
struct Live {
    pid: i32,
    pidfd: Arc<OwnedFd>,
    mode: Mode,
    workdir: String,
    owned: Option<Arc<Defaults>>,
}

/// A session the session RPCs serve: one with an init (daemon-owned or a
/// holder's), or a WASI session (`crate::wasi`: no process, the daemon holds
/// its overlay).
enum Served {
    Init(Live),
    /// Held for the call: CloseSession releases the overlay once no call
    /// holds it.
    Wasi(#[allow(dead_code)] Arc<crate::wasi::WasiLive>),
}

/// The session the file RPCs serve and the directory they resolve beneath:
/// the init's root (see [`files_root`]) or the WASI session's overlay.
async fn served_root(admin: &AdminService, id: SessionId) -> Result<(Served, OwnedFd), Status> {
    if id != 0 {
        if let Some(w) = crate::wasi::live(admin, id) {
            let root = w.root(id)?;
            return Ok((Served::Wasi(w), root));
        }
    }
    let l = live(admin, id).await?;
    let root = files_root(&l, id)?;
    Ok((Served::Init(l), root))
}

impl Served {
    /// The default owner of files the RPCs create (a WASI session's: 0:0).
    fn default_user(&self) -> Option<(u32, u32)> {
        match self {
            Served::Init(l) => l.owned.as_ref().and_then(|d| d.user),
            Served::Wasi(_) => None,
        }
    }

    /// The session's uid/gid mapping (a daemon-owned sandbox's).
    fn id_map(&self) -> Option<layerstack_engine::IdMap> {
        match self {
            Served::Init(l) => l.owned.as_ref().and_then(|d| d.id_map),
            Served::Wasi(_) => None,
        }
    }
}

async fn live(admin: &AdminService, id: SessionId) -> Result<Live, Status> {
    if id == 0 {
        return Err(Status::invalid_argument("session_id is required"));
    }
    let found = {
        let m = admin.holders.map();
        m.get(&id).map(|h: &Holder| {
            h.init.as_ref().map(|(pid, fd)| Live {
                pid: *pid,
                pidfd: fd.clone(),
                mode: h.mode,
                workdir: h.workdir.clone(),
                owned: h.owned.clone(),
            })
        })
    };
    match found {
        Some(Some(l)) if !sys::pidfd_exited(&l.pidfd) => Ok(l),
        Some(Some(_)) => Err(Status::failed_precondition(format!(
            "session {id}'s init has exited: the session is ending (CloseSession records its outcome)"
        ))),
        Some(None) => Err(Status::failed_precondition(format!(
            "session {id}'s holder is not ready yet: retry in a moment"
        ))),
        None => {
            // Unknown session: NOT_FOUND; a known one without an init: not live.
            let s = admin.engine.session(id).await.map_err(crate::admin::engine_status)?;
            let interrupted = s.outcome.as_ref().filter(|o| {
                o.kind == layerstack_engine::store::OutcomeKind::Interrupted && o.run == s.run
            });
            Err(Status::failed_precondition(format!(
                "session {id} ({}) has no live init: {}",
                s.owner.display(),
                match (interrupted, s.released) {
                    (Some(o), _) => format!(
                        "its run ended interrupted ({}): its writes are kept until discarded — discard it (Python: sb.discard(); CLI: `layerstack session close {id} --discard`; API: CloseSession DISCARD) and start the task again in a new sandbox",
                        o.interrupted_by.map_or_else(|| "an infrastructure failure".to_string(), |b| b.to_string())
                    ),
                    (None, true) => match &s.outcome {
                        Some(o) => format!("it was closed ({}): make a new sandbox", o.kind.as_str()),
                        None => format!("it is ending (its init is gone, or a close is under way) and its outcome is not recorded yet: wait for it (Wait; `layerstack wait {id}`), then make a new sandbox"),
                    },
                    (None, false) => format!("it is ending (its init is gone, or a close is under way: wait for its outcome with Wait, `layerstack wait {id}`), or it was not created daemon-owned (CreateSession.sandbox) nor by `layerstack session create|run`"),
                }
            )))
        }
    }
}

/// An `O_PATH` descriptor of init's root, opened through `/proc/<pid>/root`
/// and valid only if init (the pidfd) still runs after the open: a recycled
/// pid can not lend its root.
fn open_root(l: &Live, id: SessionId) -> Result<OwnedFd, Status> {
    open_root_of(id, l.pid, &l.pidfd)
}

/// [`open_root`] of init `pid` (`pidfd`).
fn open_root_of(id: SessionId, pid: i32, pidfd: &OwnedFd) -> Result<OwnedFd, Status> {
    let root = match sys::open_dir_path(std::path::Path::new(&format!("/proc/{pid}/root"))) {
        Ok(r) => r,
        // Init ended (and was reaped) between the lookup and the open: the
        // session is ending, as below.
        Err(e)
            if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH))
                || sys::pidfd_exited(pidfd) =>
        {
            return Err(Status::failed_precondition(format!(
                "session {id}'s init has exited: the session is ending"
            )))
        }
        Err(e) => return Err(io_status(&format!("cannot open session {id}'s root"), &e)),
    };
    if sys::pidfd_exited(pidfd) {
        return Err(Status::failed_precondition(format!(
            "session {id}'s init has exited: the session is ending"
        )));
    }
    Ok(root)
}

/// The directory the file RPCs resolve beneath: the session's root, or, in
/// workspace placement, the overlay's directory in it.
fn files_root(l: &Live, id: SessionId) -> Result<OwnedFd, Status> {
    let root = open_root(l, id)?;
    let dir = match (&l.owned, l.mode) {
        (Some(d), _) => d.placement.clone(),
        (None, Mode::Workspace) => Some(l.workdir.clone()),
        (None, Mode::Root) => None,
    };
    match dir {
        None => Ok(root),
        Some(d) => {
            let c = CString::new(d.as_bytes())
                .map_err(|_| Status::internal("placement holds a NUL byte"))?;
            sys::openat2_in_root(&root, &c, libc::O_PATH | libc::O_DIRECTORY, 0)
                .map_err(|e| io_status(&format!("cannot open session {id}'s overlay at {d}"), &e))
        }
    }
}

mod exec;
mod files;
mod ready;
mod spawn;

pub(crate) use ready::ReadyInits;
pub use spawn::{fork_at_start, Spawner};

/// The daemon's process spawner, or why there is none (INTERNAL).
/// The process spawner is up: daemon-owned (linux) sessions can start.
pub(crate) fn spawner_up(holders: &crate::sandbox::Holders) -> bool {
    matches!(holders.spawner.get(), Some(Ok(_)))
}

fn spawner(holders: &crate::sandbox::Holders) -> Result<Arc<Spawner>, Status> {
    match holders.spawner.get() {
        Some(Ok(s)) => Ok(s.clone()),
        Some(Err(why)) => Err(Status::internal(format!(
            "no process spawner in this daemon ({why}): daemon-owned sessions cannot start; restart the daemon"
        ))),
        None => Err(Status::internal(
            "no process spawner in this daemon (it is set up at the daemon's start): daemon-owned sessions cannot start",
        )),
    }
}

pub(crate) use exec::exec;
pub(crate) use files::{cpath, rel_path};
pub(crate) use files::{
    download_tar, list_dir, read_file, remove_path, stat_path, upload_tar, write_file,
};
