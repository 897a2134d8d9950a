//! Daemon-owned sessions and the session RPCs a pure gRPC client drives a
//! sandbox with: `CreateSession{sandbox}`, `Exec`, the file RPCs
//! (`ReadFile`, `WriteFile`, `ListDir`, `StatPath`, `RemovePath`,
//! `UploadTar`, `DownloadTar`). docs/architecture.md "Daemon-owned sessions".
//!
//! ```text
//! CreateSession{sandbox}   session row + lease (the engine's), overlay built
//!                          (sandbox::attach), init cloned by the spawner thread
//!                          (holder::start, daemon_owned: every other fd closed,
//!                          PR_SET_PDEATHSIG = SIGKILL), its pidfd in Holders;
//!                          a task waits on the pidfd and reaps init
//! Exec                     waiter = clone, setns(init's pidfd), chroot(init's
//!                          root); command = its child, own process group; pipes
//!                          for stdio, the waiter's pidfd polled for the end
//! files                    /proc/<init>/root opened, pidfd checked alive after,
//!                          then openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
//! CloseSession             unchanged (sandbox_close): init SIGKILLed by pidfd,
//!                          census, end action, release
//! ```
//!
//! Why one spawner thread: the parent-death signal fires when the *thread*
//! that cloned init exits, not the process. Tokio's blocking threads retire
//! when idle; the spawner lives as long as the daemon, so init dies exactly
//! when the daemon does. Exec's waiters need no such signal (their command is
//! in the session's pid namespace, which dies with init).
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
use layerstack_sandbox::holder::{self, Command, Hide, Placement, Setup, DEFAULT_PATH};
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
const CHUNK: usize = 64 * 1024;

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

type Job = Box<dyn FnOnce() + Send>;

/// The thread that clones daemon-owned sessions' inits (see the module docs).
pub struct Spawner {
    tx: std::sync::Mutex<std::sync::mpsc::Sender<Job>>,
}

impl Spawner {
    fn new() -> io::Result<Spawner> {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("layerstack-init-spawner".into())
            .spawn(move || {
                // Lives as long as the daemon: the parent-death signal of every
                // init it cloned fires when this thread exits.
                while let Ok(job) = rx.recv() {
                    job();
                }
            })?;
        Ok(Spawner {
            tx: std::sync::Mutex::new(tx),
        })
    }

    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Status> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(f());
        });
        self.tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(job)
            .map_err(|_| Status::internal("the init spawner thread is gone"))?;
        rx.await
            .map_err(|_| Status::internal("the init spawner thread dropped a job"))
    }
}

fn reply_status(r: Reply) -> Status {
    let kind = ErrorKind::parse(&r.code).unwrap_or(ErrorKind::Internal);
    api::status(kind, r.message)
}

fn io_status(what: &str, e: &io::Error) -> Status {
    Status::internal(format!("{what}: {e}"))
}

/// A `KEY=VALUE` list, checked.
fn parse_env(field: &str, env: &[String]) -> Result<Vec<(String, String)>, Status> {
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

fn absolute(field: &str, p: &str) -> Result<(), Status> {
    if !p.starts_with('/') || p.contains('\0') {
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
            Some(p.to_string())
        }
    };
    let hostname = if opts.hostname.is_empty() {
        if r.name.is_empty() {
            "session".to_string()
        } else {
            r.name.clone()
        }
    } else {
        opts.hostname.clone()
    };
    if hostname.len() > 64 {
        return Err(Status::invalid_argument(format!(
            "hostname {hostname:?} is longer than 64 bytes (HOST_NAME_MAX): give sandbox.hostname"
        )));
    }
    let rt = admin.holders.limits.get().cloned();
    let limits = session_limits(&opts, rt.as_ref().map(|r| r.defaults).unwrap_or_default())?;
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
    let (session, spec, created) = admin.sandbox_create_spec(r, true).await?;
    let id = session.id;
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
        let fd = crate::sandbox::attach(&admin.engine, &holders, conn, id, Some(spec.clone()))
            .await
            .map_err(reply_status)?;
        let spawner = match holders.spawner.get() {
            Some(s) => s,
            None => {
                let s = Spawner::new().map_err(|e| io_status("cannot start the init spawner thread", &e))?;
                let _ = holders.spawner.set(s);
                holders.spawner.get().ok_or_else(|| Status::internal("init spawner"))?
            }
        };
        let placement_c = match &placement {
            None => Placement::Root,
            Some(p) => Placement::At(
                CString::new(p.as_bytes()).map_err(|_| Status::invalid_argument("sandbox.placement holds a NUL byte"))?,
            ),
        };
        let setup = Setup {
            placement: placement_c,
            net_none: !opts.network,
            hostname: hostname.clone().into_bytes(),
            mount_fd: fd.as_raw_fd(),
            holder_sock: None,
            ready_line: Vec::new(),
            die_with_parent: true,
            daemon_owned: true,
            cgroup_procs: procs,
            hide,
        };
        let r = spawner
            .run(move || {
                let r = holder::start(&setup, None);
                // Only init keeps the overlay from now on.
                drop(fd);
                // The cgroup's descriptors stay open until init joined.
                drop(keep_cg);
                r
            })
            .await?;
        match r {
            Ok(Ok(init)) => Ok(init.pid),
            Ok(Err(x)) => Err(Status::internal(format!(
                "session {id}'s init could not set the session up (exit status {}; the daemon's log has init's reason)",
                x.shell_status()
            ))),
            Err(e) => Err(io_status("cannot start the session's init", &e)),
        }
    }
    .await;
    let pid = match started {
        Ok(pid) => pid,
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
    let pidfd = match sys::pidfd_open(pid) {
        Ok(fd) => Arc::new(fd),
        Err(e) => {
            // Cannot happen for a child not yet reaped; stop it anyway.
            sys::kill(pid, libc::SIGKILL);
            if let Some(cg) = cgroup.take() {
                remove_cgroup(id, cg);
            }
            return Err(io_status("cannot open a pidfd for the session's init", &e));
        }
    };
    let defaults = Arc::new(Defaults {
        env,
        user: opts.has_user.then_some((opts.uid, opts.gid)),
        hostname,
        placement: placement.clone(),
        cgroup: cgroup.clone(),
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
    watch_init(admin.clone(), id, conn, pidfd, cgroup.clone());
    info!(
        session.id = id,
        init = pid,
        ?limits,
        "daemon-owned session started"
    );
    let session = admin
        .to_api(
            admin
                .engine
                .session(id)
                .await
                .map_err(crate::admin::engine_status)?,
        )
        .await?;
    Ok(api::CreateSessionResponse {
        mounts: crate::wire::mounts(&spec),
        session: Some(session),
        created: true,
    })
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

/// Waits until the child of `pidfd` ends, and reaps it.
async fn wait_pidfd(pidfd: &OwnedFd) -> io::Result<Exit> {
    let dup = pidfd.try_clone()?;
    // SAFETY: `dup` is an OwnedFd moved into the AsyncFd: it stays open and
    // names the same pidfd until the AsyncFd drops.
    let afd = unsafe { AsyncFd::register_with_interest(dup, tokio::io::Interest::READABLE) }
        .map_err(io::Error::from)?;
    loop {
        if let Some(x) = sys::reap_pidfd(afd.get_ref())? {
            return Ok(x);
        }
        let mut g = afd.readable().await?;
        g.clear_ready();
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
            Err(Status::failed_precondition(format!(
                "session {id} ({}) has no live init: {}",
                s.owner.display(),
                if s.released {
                    "it was closed"
                } else {
                    "it was not created daemon-owned (CreateSession.sandbox) nor by `layerstack session create|run`, or its init is gone"
                }
            )))
        }
    }
}

/// An `O_PATH` descriptor of init's root, opened through `/proc/<pid>/root`
/// and valid only if init (the pidfd) still runs after the open: a recycled
/// pid can not lend its root.
fn open_root(l: &Live, id: SessionId) -> Result<OwnedFd, Status> {
    let root = match sys::open_dir_path(std::path::Path::new(&format!("/proc/{}/root", l.pid))) {
        Ok(r) => r,
        // Init ended (and was reaped) between the lookup and the open: the
        // session is ending, as below.
        Err(e)
            if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH))
                || sys::pidfd_exited(&l.pidfd) =>
        {
            return Err(Status::failed_precondition(format!(
                "session {id}'s init has exited: the session is ending"
            )))
        }
        Err(e) => return Err(io_status(&format!("cannot open session {id}'s root"), &e)),
    };
    if sys::pidfd_exited(&l.pidfd) {
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

// ---------------------------------------------------------------- Exec

fn command(l: &Live, r: &api::ExecRequest) -> Result<Command, Status> {
    let first = r.argv.first().filter(|a| !a.is_empty()).ok_or_else(|| {
        Status::invalid_argument("argv is required (the command and its arguments)")
    })?;
    let d = l.owned.clone().unwrap_or_default();
    let ids = if r.has_user {
        Some((r.uid, r.gid))
    } else {
        d.user
    };
    let uid = ids.map_or(0, |(u, _)| u);
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), DEFAULT_PATH.into()),
        ("HOSTNAME".into(), d.hostname.clone()),
        ("HOME".into(), if uid == 0 { "/root" } else { "/" }.into()),
    ];
    for (k, v) in d.env.iter().cloned().chain(parse_env("env", &r.env)?) {
        env.retain(|(ek, _)| *ek != k);
        env.push((k, v));
    }
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| DEFAULT_PATH.into());
    let cwd = if r.cwd.is_empty() {
        l.workdir.clone()
    } else {
        absolute("cwd", &r.cwd)?;
        r.cwd.clone()
    };
    let nul = |what: &str| Status::invalid_argument(format!("{what} holds a NUL byte"));
    Ok(Command {
        candidates: holder::candidates(OsStr::new(first), OsStr::new(&path))
            .map_err(|_| nul("argv[0]"))?,
        argv: CArgs::new(r.argv.iter().map(|a| a.clone().into_bytes())).map_err(|_| nul("argv"))?,
        envp: CArgs::new(
            env.into_iter()
                .map(|(k, v)| format!("{k}={v}").into_bytes()),
        )
        .map_err(|_| nul("env"))?,
        name: first.as_bytes().to_vec(),
        ids,
        workdir: CString::new(cwd).map_err(|_| nul("cwd"))?,
    })
}

fn exit_reply(x: Exit, timed_out: bool, started: Instant) -> api::ExecReply {
    let (code, signal) = match x {
        Exit::Code(c) => (c, 0),
        Exit::Signal(s) => (128 + s, s),
    };
    api::ExecReply {
        kind: Some(api::exec_reply::Kind::Exit(api::ExecExit {
            code,
            signal,
            timed_out,
            duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            ..Default::default()
        })),
    }
}

/// `Exec`: see the module docs and `holder::spawn_joined`.
pub(crate) async fn exec(
    admin: &AdminService,
    r: api::ExecRequest,
) -> Result<Stream<api::ExecReply>, Status> {
    let id = r.session_id;
    let l = live(admin, id).await?;
    let cmd = command(&l, &r)?;
    let root = open_root(&l, id)?;
    let (in_r, in_w) = sys::pipe().map_err(|e| io_status("pipe", &e))?;
    let (out_r, out_w) = sys::pipe().map_err(|e| io_status("pipe", &e))?;
    let (err_r, err_w) = sys::pipe().map_err(|e| io_status("pipe", &e))?;
    let (st_r, st_w) = sys::pipe().map_err(|e| io_status("pipe", &e))?;
    let stdio = holder::Stdio {
        fds: [in_r.as_raw_fd(), out_w.as_raw_fd(), err_w.as_raw_fd()],
        status: st_w.as_raw_fd(),
    };
    let cgroup = l.owned.as_ref().and_then(|d| d.cgroup.clone());
    let procs = cgroup.as_ref().map(|c| c.procs_fds()).unwrap_or_default();
    let oom_before = cgroup.as_ref().map_or(0, |c| c.usage().oom_kills);
    let started = Instant::now();
    let pid = holder::spawn_joined(&l.pidfd, &root, &cmd, &stdio, &procs)
        .map_err(|e| io_status("cannot start the command's process", &e))?;
    drop((in_r, out_w, err_w, st_w, root));
    let waiter =
        sys::pidfd_open(pid).map_err(|e| io_status("pidfd of the command's waiter", &e))?;
    let (tx, rx) = mpsc::channel(16);
    let stdin = r.stdin;
    let timeout = (r.timeout_ms > 0).then(|| Duration::from_millis(r.timeout_ms.into()));
    tokio::spawn(async move {
        let run = async {
            let mut w = tokio::net::unix::pipe::Sender::from_owned_fd(in_w)?;
            let mut out = tokio::net::unix::pipe::Receiver::from_owned_fd(out_r)?;
            let mut err = tokio::net::unix::pipe::Receiver::from_owned_fd(err_r)?;
            let feed = async move {
                // A command that does not read its stdin closes the pipe: EPIPE
                // is not an error of the exec.
                let _ = w.write_all(&stdin).await;
                drop(w);
            };
            tokio::spawn(feed);
            let waiter2 = waiter.try_clone()?;
            let mut ended = Box::pin(wait_pidfd(&waiter2));
            let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
            let sleep =
                tokio::time::sleep_until(deadline.unwrap_or_else(|| {
                    tokio::time::Instant::now() + Duration::from_secs(86400 * 365)
                }));
            tokio::pin!(sleep);
            let (mut bo, mut be) = (vec![0u8; CHUNK], vec![0u8; CHUNK]);
            let (mut out_open, mut err_open) = (true, true);
            let mut timed_out = false;
            let mut killed_at: Option<tokio::time::Instant> = None;
            let mut waiter_exit: Option<io::Result<Exit>> = None;
            let mut drain_until: Option<tokio::time::Instant> = None;
            loop {
                if waiter_exit.is_some() && !out_open && !err_open {
                    break;
                }
                let drain = async {
                    match drain_until {
                        Some(t) => tokio::time::sleep_until(t).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    n = out.read(&mut bo), if out_open => match n {
                        Ok(0) | Err(_) => out_open = false,
                        Ok(n) => {
                            if tx.send(Ok(api::ExecReply { kind: Some(api::exec_reply::Kind::Stdout(bo[..n].to_vec())) })).await.is_err() {
                                kill_group(&waiter);
                            }
                        }
                    },
                    n = err.read(&mut be), if err_open => match n {
                        Ok(0) | Err(_) => err_open = false,
                        Ok(n) => {
                            if tx.send(Ok(api::ExecReply { kind: Some(api::exec_reply::Kind::Stderr(be[..n].to_vec())) })).await.is_err() {
                                kill_group(&waiter);
                            }
                        }
                    },
                    x = &mut ended, if waiter_exit.is_none() => {
                        waiter_exit = Some(x);
                        drain_until = Some(tokio::time::Instant::now() + DRAIN);
                    },
                    () = &mut sleep, if deadline.is_some() && waiter_exit.is_none() && (!timed_out || killed_at.is_some()) => {
                        if timed_out {
                            // The waiter did not end within 2 s of the kill: end it.
                            let _ = sys::pidfd_kill(&waiter, libc::SIGKILL);
                            killed_at = None;
                        } else {
                            timed_out = true;
                            kill_group(&waiter);
                            killed_at = Some(tokio::time::Instant::now());
                            sleep.as_mut().reset(tokio::time::Instant::now() + Duration::from_secs(2));
                        }
                    },
                    () = drain => {
                        out_open = false;
                        err_open = false;
                    },
                }
            }
            let elapsed_from = started;
            // The waiter wrote the command's exact exit before it exited.
            let mut st = tokio::net::unix::pipe::Receiver::from_owned_fd(st_r)?;
            let mut b = [0u8; holder::EXIT_BYTES];
            let x = match st.read_exact(&mut b).await {
                Ok(_) => holder::decode_exit(&b),
                Err(_) => waiter_exit.unwrap_or(Ok(Exit::Code(holder::SETUP_FAILED)))?,
            };
            let mut reply = exit_reply(x, timed_out, elapsed_from);
            if let (Some(cg), Some(api::exec_reply::Kind::Exit(e))) = (&cgroup, &mut reply.kind) {
                let u = cg.usage();
                e.oom_killed = u.oom_kills > oom_before && x == Exit::Signal(libc::SIGKILL);
                e.session_memory_peak_bytes = u.memory_peak_bytes;
                e.session_cpu_usec = u.cpu_usec;
            }
            Ok::<_, io::Error>(reply)
        };
        let last = run.await.map_err(|e| io_status("exec", &e));
        let _ = tx.send(last).await;
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// Asks the waiter to SIGKILL the command's process group (SIGTERM to the
/// waiter means exactly that: `holder::spawn_joined`).
fn kill_group(waiter: &OwnedFd) {
    if let Err(e) = sys::pidfd_kill(waiter, libc::SIGTERM) {
        debug!(error = %e, "signalling an exec's waiter");
    }
}

// ---------------------------------------------------------------- files

/// A request path, relative to the files root: `..` and NUL refused, empty
/// and `/` are the root (`"."`).
fn rel_path(p: &str) -> Result<Vec<u8>, Status> {
    if p.contains('\0') {
        return Err(Status::invalid_argument(format!(
            "path {p:?} holds a NUL byte"
        )));
    }
    let mut out: Vec<u8> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                return Err(Status::invalid_argument(format!(
                "path {p:?}: a `..` component is refused (name the path from the session's root)"
            )))
            }
            c => {
                if !out.is_empty() {
                    out.push(b'/');
                }
                out.extend_from_slice(c.as_bytes());
            }
        }
    }
    Ok(out)
}

fn cpath(rel: &[u8]) -> CString {
    // rel_path refused NUL bytes.
    CString::new(if rel.is_empty() {
        b".".to_vec()
    } else {
        rel.to_vec()
    })
    .unwrap_or_default()
}

fn split(rel: &[u8]) -> (&[u8], &[u8]) {
    match rel.iter().rposition(|&b| b == b'/') {
        Some(i) => (&rel[..i], &rel[i + 1..]),
        None => (&[], rel),
    }
}

/// The status of a failed file operation on `path`, naming it and the reason.
fn file_status(path: &str, what: &str, e: &io::Error) -> Status {
    let msg = format!("{what} {path:?}: {e}");
    match e.raw_os_error() {
        Some(libc::ENOENT) => Status::not_found(msg),
        Some(
            libc::ENOTDIR
            | libc::EISDIR
            | libc::ELOOP
            | libc::EXDEV
            | libc::ENOTEMPTY
            | libc::EEXIST
            | libc::EINVAL
            | libc::ENAMETOOLONG,
        ) => Status::invalid_argument(msg),
        Some(libc::EACCES | libc::EPERM | libc::EROFS) => Status::failed_precondition(msg),
        _ => Status::internal(msg),
    }
}

fn nix_io(e: nix::Error) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

// nix 0.29 takes raw descriptors: these keep ownership in `OwnedFd`s.

fn at_openat<P: ?Sized + nix::NixPath>(
    dir: &OwnedFd,
    name: &P,
    flags: OFlag,
) -> io::Result<OwnedFd> {
    let fd = nix::fcntl::openat(
        Some(dir.as_raw_fd()),
        name,
        flags | OFlag::O_CLOEXEC,
        NMode::from_bits_truncate(0o600),
    )
    .map_err(nix_io)?;
    // SAFETY: openat returned a new descriptor nothing else owns.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

fn at_fstatat<P: ?Sized + nix::NixPath>(
    dir: &OwnedFd,
    name: &P,
) -> io::Result<nix::sys::stat::FileStat> {
    nix::sys::stat::fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW)
        .map_err(nix_io)
}

fn at_unlinkat<P: ?Sized + nix::NixPath>(dir: &OwnedFd, name: &P, d: bool) -> io::Result<()> {
    let f = if d {
        nix::unistd::UnlinkatFlags::RemoveDir
    } else {
        nix::unistd::UnlinkatFlags::NoRemoveDir
    };
    nix::unistd::unlinkat(Some(dir.as_raw_fd()), name, f).map_err(nix_io)
}

fn dir_names(dir: &OwnedFd) -> io::Result<Vec<Vec<u8>>> {
    use std::os::fd::IntoRawFd;
    let d = nix::dir::Dir::from_fd(dir.try_clone()?.into_raw_fd()).map_err(nix_io)?;
    let mut names = Vec::new();
    for ent in d.into_iter() {
        let ent = ent.map_err(nix_io)?;
        let n = ent.file_name().to_bytes();
        if n != b"." && n != b".." {
            names.push(n.to_vec());
        }
    }
    names.sort();
    Ok(names)
}

fn kind_of(mode: u32) -> &'static str {
    match SFlag::from_bits_truncate(mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFREG => "file",
        SFlag::S_IFDIR => "dir",
        SFlag::S_IFLNK => "symlink",
        SFlag::S_IFIFO => "fifo",
        SFlag::S_IFCHR => "char",
        SFlag::S_IFBLK => "block",
        SFlag::S_IFSOCK => "socket",
        _ => "",
    }
}

fn stat_of(name: &[u8], st: &nix::sys::stat::FileStat, target: Option<Vec<u8>>) -> api::FileStat {
    api::FileStat {
        name: String::from_utf8_lossy(name).into_owned(),
        raw_name: name.to_vec(),
        kind: kind_of(st.st_mode).to_string(),
        size: u64::try_from(st.st_size).unwrap_or(0),
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        mtime_ns: st
            .st_mtime
            .saturating_mul(1_000_000_000)
            .saturating_add(st.st_mtime_nsec),
        link_target: target
            .map(|t| String::from_utf8_lossy(&t).into_owned())
            .unwrap_or_default(),
    }
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)` and, for a symlink, its target.
fn stat_at(dir: &OwnedFd, name: &[u8]) -> io::Result<api::FileStat> {
    let st = at_fstatat(dir, OsStr::from_bytes(name))?;
    let target = if kind_of(st.st_mode) == "symlink" {
        Some(
            nix::fcntl::readlinkat(Some(dir.as_raw_fd()), OsStr::from_bytes(name))
                .map_err(nix_io)?
                .as_bytes()
                .to_vec(),
        )
    } else {
        None
    };
    Ok(stat_of(name, &st, target))
}

/// Opens the parent directory of `rel` beneath `root` (symlinks in it resolve
/// inside the root), making missing directories (0755, owned by `owner`)
/// when `make` is set. Returns it and the last component.
fn open_parent<'a>(
    root: &OwnedFd,
    rel: &'a [u8],
    make: bool,
    owner: Option<(u32, u32)>,
) -> io::Result<(OwnedFd, &'a [u8])> {
    let (parent, name) = split(rel);
    let flags = libc::O_PATH | libc::O_DIRECTORY;
    match sys::openat2_in_root(root, &cpath(parent), flags, 0) {
        Ok(fd) => return Ok((fd, name)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) && make => {}
        Err(e) => return Err(e),
    }
    let mut dir = sys::openat2_in_root(root, c".", flags, 0)?;
    for comp in parent.split(|&b| b == b'/') {
        let c = OsStr::from_bytes(comp);
        match nix::sys::stat::mkdirat(Some(dir.as_raw_fd()), c, NMode::from_bits_truncate(0o755)) {
            Ok(()) => {
                if let Some((u, g)) = owner {
                    nix::unistd::fchownat(
                        Some(dir.as_raw_fd()),
                        c,
                        Some(u.into()),
                        Some(g.into()),
                        AtFlags::AT_SYMLINK_NOFOLLOW,
                    )
                    .map_err(nix_io)?;
                }
            }
            Err(nix::Error::EEXIST) => {}
            Err(e) => return Err(nix_io(e)),
        }
        let mut p = b"./".to_vec();
        p.extend_from_slice(comp);
        // Relative to `dir`, resolved in the session's root: a symlink that
        // exists here resolves inside the session.
        let next = {
            let cp = CString::new(p).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
            openat2_beneath_dir(&dir, root, &cp)?
        };
        dir = next;
    }
    Ok((dir, name))
}

/// Opens `name` (a directory) relative to `dir` while staying inside `root`:
/// a plain `openat(O_NOFOLLOW)` (a component just made or checked by name);
/// a symlink there is resolved through `root` instead, never outside it.
fn openat2_beneath_dir(dir: &OwnedFd, root: &OwnedFd, name: &CString) -> io::Result<OwnedFd> {
    match at_openat(
        dir,
        name.as_c_str(),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
    ) {
        Ok(fd) => Ok(fd),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
            // A symlink: refuse rather than resolve it with a second path
            // walk (the parent chain was made by this call).
            let _ = root;
            Err(io::Error::from_raw_os_error(libc::ENOTDIR))
        }
        Err(e) => Err(e),
    }
}

fn owner_of(l: &Live, has: bool, uid: u32, gid: u32) -> Option<(u32, u32)> {
    if has {
        Some((uid, gid))
    } else {
        l.owned.as_ref().and_then(|d| d.user)
    }
}

/// `ReadFile`.
pub(crate) async fn read_file(
    admin: &AdminService,
    r: api::ReadFileRequest,
) -> Result<Stream<api::FileChunk>, Status> {
    let l = live(admin, r.session_id).await?;
    let rel = rel_path(&r.path)?;
    let root = files_root(&l, r.session_id)?;
    let path = r.path.clone();
    let fd = sys::openat2_in_root(
        &root,
        &cpath(&rel),
        libc::O_RDONLY | libc::O_NOCTTY | libc::O_NONBLOCK,
        0,
    )
    .map_err(|e| file_status(&path, "cannot open", &e))?;
    let st = nix::sys::stat::fstat(fd.as_raw_fd())
        .map_err(|e| file_status(&path, "cannot stat", &nix_io(e)))?;
    if kind_of(st.st_mode) != "file" {
        return Err(Status::invalid_argument(format!(
            "{path:?} is a {}, not a regular file: ReadFile reads regular files (ListDir lists a directory)",
            kind_of(st.st_mode)
        )));
    }
    let (tx, rx) = mpsc::channel(4);
    let (offset, limit) = (r.offset, r.limit);
    tokio::task::spawn_blocking(move || {
        let f = std::fs::File::from(fd);
        let mut off = offset;
        let end = if limit == 0 {
            u64::MAX
        } else {
            offset.saturating_add(limit)
        };
        let mut buf = vec![0u8; CHUNK];
        while off < end {
            let want = usize::try_from((end - off).min(CHUNK as u64)).unwrap_or(CHUNK);
            match std::os::unix::fs::FileExt::read_at(&f, &mut buf[..want], off) {
                Ok(0) => break,
                Ok(n) => {
                    off += n as u64;
                    if tx
                        .blocking_send(Ok(api::FileChunk {
                            data: buf[..n].to_vec(),
                        }))
                        .is_err()
                    {
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let _ = tx.blocking_send(Err(file_status(&path, "cannot read", &e)));
                    return;
                }
            }
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// `WriteFile`: temp file in the target's directory, then rename.
pub(crate) async fn write_file(
    admin: &AdminService,
    mut s: tonic::Streaming<api::WriteFileRequest>,
) -> Result<api::FileStat, Status> {
    let first = s.message().await?.ok_or_else(|| {
        Status::invalid_argument("empty stream: the first message carries the header")
    })?;
    let h = first.header.clone().ok_or_else(|| {
        Status::invalid_argument("the first message carries no header (session_id, path)")
    })?;
    let l = live(admin, h.session_id).await?;
    let rel = rel_path(&h.path)?;
    if rel.is_empty() {
        return Err(Status::invalid_argument(format!(
            "path {:?} names the root, not a file",
            h.path
        )));
    }
    let root = files_root(&l, h.session_id)?;
    let owner = owner_of(&l, h.has_owner, h.uid, h.gid);
    let mode = if h.mode == 0 { 0o644 } else { h.mode & 0o7777 };
    let path = h.path.clone();
    let (ctx, crx) = std::sync::mpsc::sync_channel::<Vec<u8>>(4);
    let abort = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let aborted = abort.clone();
    let job = tokio::task::spawn_blocking(move || -> Result<api::FileStat, Status> {
        let (parent, name) = open_parent(&root, &rel, h.make_parents, owner)
            .map_err(|e| file_status(&path, "cannot open the directory of", &e))?;
        // An O_PATH parent cannot be written through: reopen it as a directory.
        let dir = at_openat(&parent, c".", OFlag::O_RDONLY | OFlag::O_DIRECTORY)
            .map_err(|e| file_status(&path, "cannot open the directory of", &e))?;
        let name = OsStr::from_bytes(name);
        let tmp = format!(".layerstack-write-{}-{}", std::process::id(), rand_suffix());
        let fd = at_openat(
            &dir,
            tmp.as_str(),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW,
        )
        .map_err(|e| file_status(&path, "cannot create a temporary file beside", &e))?;
        let mut f = std::fs::File::from(fd);
        let done = (|| -> io::Result<()> {
            for chunk in crx.iter() {
                f.write_all(&chunk)?;
            }
            if aborted.load(Ordering::Relaxed) {
                return Err(io::Error::new(
                    io::ErrorKind::Interrupted,
                    "the client's stream ended with an error",
                ));
            }
            if let Some((u, g)) = owner {
                nix::unistd::fchown(f.as_raw_fd(), Some(u.into()), Some(g.into()))
                    .map_err(nix_io)?;
            }
            // fchmod on the open file: after chown (which clears setuid bits).
            nix::sys::stat::fchmod(f.as_raw_fd(), NMode::from_bits_truncate(mode))
                .map_err(nix_io)?;
            nix::fcntl::renameat(
                Some(dir.as_raw_fd()),
                tmp.as_str(),
                Some(dir.as_raw_fd()),
                name,
            )
            .map_err(nix_io)
        })();
        if let Err(e) = done {
            let _ = at_unlinkat(&dir, tmp.as_str(), false);
            return Err(file_status(&path, "cannot write", &e));
        }
        stat_at(&dir, name.as_bytes()).map_err(|e| file_status(&path, "cannot stat", &e))
    });
    let feed = async {
        if !first.data.is_empty() && ctx.send(first.data).is_err() {
            return Ok(());
        }
        while let Some(m) = s.message().await? {
            if m.header.is_some() {
                return Err(Status::invalid_argument(
                    "a header after the first message: one file per stream",
                ));
            }
            if !m.data.is_empty() && ctx.send(m.data).is_err() {
                break;
            }
        }
        Ok(())
    };
    let fed: Result<(), Status> = feed.await;
    if let Err(st) = fed {
        // The client's stream broke: the data is incomplete. The blocking
        // side must not rename it over the target: `abort` tells it.
        abort.store(true, Ordering::Relaxed);
        drop(ctx);
        let _ = job.await;
        return Err(st);
    }
    drop(ctx);
    job.await
        .map_err(|e| Status::internal(format!("write task: {e}")))?
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

/// `ListDir`.
pub(crate) async fn list_dir(
    admin: &AdminService,
    r: api::ListDirRequest,
) -> Result<api::ListDirResponse, Status> {
    let l = live(admin, r.session_id).await?;
    let rel = rel_path(&r.path)?;
    let root = files_root(&l, r.session_id)?;
    let path = r.path.clone();
    tokio::task::spawn_blocking(move || {
        let fd = sys::openat2_in_root(&root, &cpath(&rel), libc::O_RDONLY | libc::O_DIRECTORY, 0)
            .map_err(|e| file_status(&path, "cannot open the directory", &e))?;
        let names =
            dir_names(&fd).map_err(|e| file_status(&path, "cannot read the directory", &e))?;
        let mut entries = Vec::with_capacity(names.len());
        for n in names {
            match stat_at(&fd, &n) {
                Ok(s) => entries.push(s),
                // Removed meanwhile.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(file_status(&path, "cannot stat an entry of", &e)),
            }
        }
        Ok(api::ListDirResponse { entries })
    })
    .await
    .map_err(|e| Status::internal(format!("list task: {e}")))?
}

/// `StatPath`.
pub(crate) async fn stat_path(
    admin: &AdminService,
    r: api::StatPathRequest,
) -> Result<api::FileStat, Status> {
    let l = live(admin, r.session_id).await?;
    let rel = rel_path(&r.path)?;
    let root = files_root(&l, r.session_id)?;
    let path = r.path;
    if rel.is_empty() {
        let st = nix::sys::stat::fstat(root.as_raw_fd())
            .map_err(|e| file_status(&path, "cannot stat", &nix_io(e)))?;
        return Ok(stat_of(b"", &st, None));
    }
    let (parent, name) =
        open_parent(&root, &rel, false, None).map_err(|e| file_status(&path, "cannot stat", &e))?;
    stat_at(&parent, name).map_err(|e| file_status(&path, "cannot stat", &e))
}

/// Removes `name` in `dir` and, for a directory, everything below it; never
/// follows a symlink (each level is opened `O_NOFOLLOW`). Returns the entries
/// removed.
fn remove_tree_at(dir: &OwnedFd, name: &OsStr) -> io::Result<u64> {
    let sub = match at_openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
    ) {
        Ok(fd) => fd,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => {
            at_unlinkat(dir, name, false)?;
            return Ok(1);
        }
        Err(e) => return Err(e),
    };
    let mut n = 0;
    for c in dir_names(&sub)? {
        n += remove_tree_at(&sub, OsStr::from_bytes(&c))?;
    }
    at_unlinkat(dir, name, true)?;
    Ok(n + 1)
}

/// `RemovePath`.
pub(crate) async fn remove_path(
    admin: &AdminService,
    r: api::RemovePathRequest,
) -> Result<api::RemovePathResponse, Status> {
    let l = live(admin, r.session_id).await?;
    let rel = rel_path(&r.path)?;
    if rel.is_empty() {
        return Err(Status::invalid_argument(format!(
            "path {:?} names the session's root, which cannot be removed",
            r.path
        )));
    }
    let root = files_root(&l, r.session_id)?;
    let path = r.path;
    let recursive = r.recursive;
    tokio::task::spawn_blocking(move || {
        let (parent, name) = open_parent(&root, &rel, false, None)
            .map_err(|e| file_status(&path, "cannot remove", &e))?;
        let dir = at_openat(&parent, c".", OFlag::O_RDONLY | OFlag::O_DIRECTORY)
            .map_err(|e| file_status(&path, "cannot remove", &e))?;
        let name = OsStr::from_bytes(name);
        let st =
            stat_at(&dir, name.as_bytes()).map_err(|e| file_status(&path, "cannot remove", &e))?;
        let removed = if st.kind == "dir" {
            if recursive {
                remove_tree_at(&dir, name)
            } else {
                at_unlinkat(&dir, name, true).map(|()| 1)
            }
        } else {
            at_unlinkat(&dir, name, false).map(|()| 1)
        };
        let removed = removed.map_err(|e| {
            if e.raw_os_error() == Some(libc::ENOTEMPTY) {
                Status::failed_precondition(format!(
                    "cannot remove {path:?}: the directory is not empty (set recursive)"
                ))
            } else {
                file_status(&path, "cannot remove", &e)
            }
        })?;
        Ok(api::RemovePathResponse { removed })
    })
    .await
    .map_err(|e| Status::internal(format!("remove task: {e}")))?
}

/// A reader over chunks sent from the async side.
struct ChunkReader {
    rx: std::sync::mpsc::Receiver<Vec<u8>>,
    cur: Vec<u8>,
    pos: usize,
}

impl Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.cur.len() {
            match self.rx.recv() {
                Ok(c) => {
                    self.cur = c;
                    self.pos = 0;
                }
                Err(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.cur.len() - self.pos);
        buf[..n].copy_from_slice(&self.cur[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// `UploadTar`: the publisher's import rules (`extract_tar_into`) beneath the
/// destination directory, opened inside the session's root.
pub(crate) async fn upload_tar(
    admin: &AdminService,
    mut s: tonic::Streaming<api::UploadTarRequest>,
) -> Result<api::UploadTarResponse, Status> {
    let first = s.message().await?.ok_or_else(|| {
        Status::invalid_argument(
            "empty stream: the first message names the session and the directory",
        )
    })?;
    let l = live(admin, first.session_id).await?;
    let rel = rel_path(&first.path)?;
    let root = files_root(&l, first.session_id)?;
    let owner = l.owned.as_ref().and_then(|d| d.user);
    let path = first.path.clone();
    let make = first.make_parents;
    let (ctx, crx) = std::sync::mpsc::sync_channel::<Vec<u8>>(4);
    let job = tokio::task::spawn_blocking(move || -> Result<api::UploadTarResponse, Status> {
        let dir = if rel.is_empty() {
            sys::openat2_in_root(&root, c".", libc::O_RDONLY | libc::O_DIRECTORY, 0)
        } else {
            let mut with_self = rel.clone();
            with_self.extend_from_slice(b"/.");
            open_parent(&root, &with_self, make, owner)
                .and_then(|(p, _)| at_openat(&p, c".", OFlag::O_RDONLY | OFlag::O_DIRECTORY))
        }
        .map_err(|e| file_status(&path, "cannot open the upload directory", &e))?;
        // The stage opens its root by path: the resolved directory's own
        // descriptor, through /proc/self/fd (".": its last component is no
        // symlink).
        let base = std::path::PathBuf::from(format!("/proc/self/fd/{}/.", dir.as_raw_fd()));
        let reader = ChunkReader {
            rx: crx,
            cur: Vec::new(),
            pos: 0,
        };
        let rep = layerstack_engine::publisher::extract_tar_into(&base, reader, "the uploaded tar")
            .map_err(|e| {
                let msg = format!("upload into {path:?}: {}", api::error_chain(&e));
                match e {
                    layerstack_engine::publisher::ImportError::Invalid(_)
                    | layerstack_engine::publisher::ImportError::Refused { .. }
                    | layerstack_engine::publisher::ImportError::Archive { .. } => {
                        Status::invalid_argument(msg)
                    }
                    _ => Status::internal(msg),
                }
            })?;
        drop(dir);
        Ok(api::UploadTarResponse {
            files: rep.files,
            dirs: rep.dirs + rep.implied_dirs,
            symlinks: rep.symlinks,
            hardlinks: rep.hardlinks,
            bytes: rep.content_bytes,
        })
    });
    let fed = async {
        if !first.data.is_empty() && ctx.send(first.data).is_err() {
            return Ok(());
        }
        while let Some(m) = s.message().await? {
            if !m.data.is_empty() && ctx.send(m.data).is_err() {
                break;
            }
        }
        Ok::<(), Status>(())
    }
    .await;
    drop(ctx);
    let out = job
        .await
        .map_err(|e| Status::internal(format!("upload task: {e}")))?;
    fed?;
    out
}

/// A writer that sends what it is given as `FileChunk`s.
struct ChunkWriter {
    tx: mpsc::Sender<Result<api::FileChunk, Status>>,
    buf: Vec<u8>,
}

impl ChunkWriter {
    fn flush_full(&mut self, all: bool) -> io::Result<()> {
        while self.buf.len() >= CHUNK || (all && !self.buf.is_empty()) {
            let n = self.buf.len().min(CHUNK);
            let data: Vec<u8> = self.buf.drain(..n).collect();
            self.tx
                .blocking_send(Ok(api::FileChunk { data }))
                .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the client went away"))?;
        }
        Ok(())
    }
}

impl Write for ChunkWriter {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(b);
        self.flush_full(false)?;
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        self.flush_full(true)
    }
}

fn header_of(st: &nix::sys::stat::FileStat) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_mode(st.st_mode & 0o7777);
    h.set_uid(st.st_uid.into());
    h.set_gid(st.st_gid.into());
    h.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
    h.set_size(0);
    h
}

/// Appends `name` of `dir` (path `at` in the tar) and, for a directory,
/// everything below it, never following a symlink.
fn append_at(
    b: &mut tar::Builder<ChunkWriter>,
    dir: &OwnedFd,
    name: &OsStr,
    at: &std::path::Path,
) -> io::Result<()> {
    let st = at_fstatat(dir, name)?;
    let mut h = header_of(&st);
    match kind_of(st.st_mode) {
        "file" => {
            let fd = at_openat(
                dir,
                name,
                OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NOCTTY | OFlag::O_NONBLOCK,
            )?;
            let f = std::fs::File::from(fd);
            let len = f.metadata()?.len();
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(len);
            b.append_data(&mut h, at, f.take(len))
        }
        "symlink" => {
            let t = nix::fcntl::readlinkat(Some(dir.as_raw_fd()), name).map_err(nix_io)?;
            h.set_entry_type(tar::EntryType::Symlink);
            b.append_link(&mut h, at, std::path::Path::new(&t))
        }
        "dir" => {
            h.set_entry_type(tar::EntryType::Directory);
            b.append_data(&mut h, at, io::empty())?;
            let sub = at_openat(
                dir,
                name,
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
            )?;
            for n in dir_names(&sub)? {
                let c = OsStr::from_bytes(&n);
                append_at(b, &sub, c, &at.join(c))?;
            }
            Ok(())
        }
        "fifo" => {
            h.set_entry_type(tar::EntryType::Fifo);
            b.append_data(&mut h, at, io::empty())
        }
        "char" | "block" => {
            h.set_entry_type(if kind_of(st.st_mode) == "char" {
                tar::EntryType::Char
            } else {
                tar::EntryType::Block
            });
            h.set_device_major(nix::sys::stat::major(st.st_rdev) as u32)?;
            h.set_device_minor(nix::sys::stat::minor(st.st_rdev) as u32)?;
            b.append_data(&mut h, at, io::empty())
        }
        // Sockets: a tar cannot hold one.
        _ => Ok(()),
    }
}

/// `DownloadTar`.
pub(crate) async fn download_tar(
    admin: &AdminService,
    r: api::DownloadTarRequest,
) -> Result<Stream<api::FileChunk>, Status> {
    let l = live(admin, r.session_id).await?;
    let rel = rel_path(&r.path)?;
    let root = files_root(&l, r.session_id)?;
    let path = r.path;
    let (parent, name) = if rel.is_empty() {
        let fd = sys::openat2_in_root(&root, c".", libc::O_RDONLY | libc::O_DIRECTORY, 0)
            .map_err(|e| file_status(&path, "cannot open", &e))?;
        (fd, b".".to_vec())
    } else {
        let (p, n) = open_parent(&root, &rel, false, None)
            .map_err(|e| file_status(&path, "cannot open", &e))?;
        let p = at_openat(&p, c".", OFlag::O_RDONLY | OFlag::O_DIRECTORY)
            .map_err(|e| file_status(&path, "cannot open", &e))?;
        (p, n.to_vec())
    };
    // Refuse a missing path before the stream starts.
    at_fstatat(&parent, OsStr::from_bytes(&name))
        .map_err(|e| file_status(&path, "cannot stat", &e))?;
    let (tx, rx) = mpsc::channel(4);
    tokio::task::spawn_blocking(move || {
        let w = ChunkWriter {
            tx: tx.clone(),
            buf: Vec::new(),
        };
        let mut b = tar::Builder::new(w);
        b.follow_symlinks(false);
        let n = OsStr::from_bytes(&name);
        let r = append_at(&mut b, &parent, n, std::path::Path::new(n))
            .and_then(|()| b.into_inner())
            .and_then(|mut w| w.flush());
        if let Err(e) = r {
            let _ = tx.blocking_send(Err(file_status(&path, "cannot archive", &e)));
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}
