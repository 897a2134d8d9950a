//! Mode B (ARCHITECTURE.md §12): `layerstack session run|create|exec|close` —
//! sessions without a container, each in mount, pid, ipc and uts namespaces of
//! its own (and a network namespace with only `lo` for `--net none`).
//!
//! `run` is the holder: it asks the daemon for a session and receives its
//! overlay as a detached mount, in one round trip on the mount socket (`start`:
//! the admin API's `CreateSession` and an attach), starts the session's init
//! (`layerstack_sandbox::holder`), runs the command with stdin, stdout and
//! stderr passed through untouched, and once the command and every process of
//! the session are gone asks the daemon, on the same connection, to close the
//! session by its exit policy (`close`: `CloseSession` with the exit status).
//! While the command runs a thread watches the connection: if the daemon
//! restarts, it reconnects and takes the session back (`resume`) at once. If
//! the connection is broken at the close (the daemon was down when the command
//! ended, or died during the close), it reconnects with back-off for at most
//! `--reconnect-timeout` seconds, takes the session back and closes it there:
//! the restarted daemon applies the policy to the exit status, or answers the
//! outcome it recorded. It writes the outcome as one line on stderr (and as JSON to `--outcome FILE`) and
//! exits with the command's status (127: not found, 126: not executable, 128 + n:
//! killed by signal n; 125: the session could not be started, or `run` failed
//! otherwise; the error is on stderr, as `--error-format` says).
//!
//! `create` leaves a session's init running in the background (the session stays
//! mounted); `exec` runs a command in it, joining its namespaces (exiting with
//! its status, and 125 when `exec` itself fails); `close` ends it.

use std::ffi::{OsStr, OsString};
use std::io::Write as _;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use layerstack_api as api;
use layerstack_api::types::OutcomeKind;
use layerstack_sandbox::client::MountConn;
use layerstack_sandbox::holder::{self, Command, Placement, Setup, DEFAULT_PATH, SETUP_FAILED};
use layerstack_sandbox::sys::{self, CArgs, Exit};
use layerstack_sandbox::wire::{self, Mode, Request};
use serde_json::json;

use crate::errors::{failure, with_kind, Failure};
use crate::sessions::{print_outcome, session_json};
use crate::{out, Cli};

/// `--publish`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EndAction {
    /// Publish whatever the exit status.
    OnExit,
    /// Publish on exit status 0; discard otherwise (and when the holder is killed).
    OnSuccess,
    /// Discard the writes.
    Never,
    /// Make the writes a child node of the --node it started from (SandboxGraph),
    /// whatever the exit status.
    Checkpoint,
}

impl EndAction {
    /// The exit policy's name, as the daemon records it.
    pub(crate) fn as_str(self) -> &'static str {
        use api::policy::ExitPolicy;
        match self {
            Self::OnExit => ExitPolicy::OnExit,
            Self::OnSuccess => ExitPolicy::OnSuccess,
            Self::Never => ExitPolicy::Never,
            Self::Checkpoint => ExitPolicy::Checkpoint,
        }
        .as_str()
    }
}

/// `--net`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum Net {
    /// The caller's network namespace.
    #[default]
    Host,
    /// A network namespace of its own with only `lo`.
    None,
}

/// What the command runs as and where (run, exec).
#[derive(Debug, Clone, Args)]
pub struct ProcessArgs {
    /// Run the command as UID[:GID] (numbers; GID defaults to UID).
    #[arg(long, value_name = "UID[:GID]")]
    pub user: Option<String>,
    /// Working directory of the command [default: / in root mode, the mount
    /// directory with --mount-at].
    #[arg(long, value_name = "DIR")]
    pub workdir: Option<PathBuf>,
    /// Environment variable K=V (repeatable); a bare K takes the caller's value.
    #[arg(long = "env", short = 'e', value_name = "K=V")]
    pub env: Vec<OsString>,
}

/// How a session is made (run, create).
#[derive(Debug, Clone, Args)]
pub struct SessionArgs {
    /// STACK[@BRANCH]: an image reference, stack id or base digest, and the
    /// branch whose head the session leases [default branch: the daemon's].
    #[arg(required_unless_present = "node", conflicts_with = "node")]
    pub stack: Option<String>,
    /// Start from a SandboxGraph node instead of a branch head: the session is a
    /// new attempt of the node (`layerstack graph show` lists them).
    #[arg(long, value_name = "ID")]
    pub node: Option<String>,
    /// What happens to the session's writes when it ends [default: on-exit;
    /// checkpoint with --node].
    #[arg(long, value_enum)]
    pub publish: Option<EndAction>,
    /// Workspace mode: mount the session at DIR and keep the caller's root (the
    /// sandbox's own tools work on the tree) instead of making it the root.
    #[arg(long, value_name = "DIR")]
    pub mount_at: Option<PathBuf>,
    /// Network: the caller's (host) or a namespace with only `lo` (none)
    /// [default: host; none for `session create --sandbox`].
    #[arg(long, value_enum)]
    pub net: Option<Net>,
    /// The same key returns the same session (a retried create makes no second one).
    #[arg(long, value_name = "KEY")]
    pub idempotency_key: Option<String>,
    /// Owner label of the session (`sandbox:NAME`) [default: HOST:PID].
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    /// Fail at once (Busy) when the daemon's cap of live sandbox sessions is reached.
    #[arg(long, conflicts_with = "wait_timeout")]
    pub no_wait: bool,
    /// Wait at most this many seconds for a free slot under the cap.
    #[arg(long, value_name = "SECS", default_value_t = 600)]
    pub wait_timeout: u32,
    /// Publish content history only: a file rewritten with the same content,
    /// mode, owner and xattrs (`sed -i` that matched nothing) is not a change
    /// although its mtime moved [default: an mtime change is a change].
    #[arg(long)]
    pub ignore_mtime: bool,
}

/// `session run`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub session: SessionArgs,
    #[command(flatten)]
    pub process: ProcessArgs,
    /// Also write the outcome as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub outcome: Option<PathBuf>,
    /// With --publish checkpoint: the child node's logical state, a JSON object
    /// (the reward, the step, …) [default: {}].
    #[arg(long, value_name = "JSON")]
    pub state: Option<String>,
    /// When the daemon's connection broke (a restart while the command ran or
    /// during the close): for how many seconds to retry reaching it again to
    /// close the session with the command's exit status (0: no retry). The
    /// daemon waits 60 s for a holder to come back after it sees the session's
    /// namespaces gone; a longer timeout may find the session finished without
    /// the exit status.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub reconnect_timeout: u32,
    #[command(flatten)]
    pub wasi: crate::wasi::WasiArgs,
    /// The command and its arguments (after `--`); with --wasi, the module's
    /// arguments.
    #[arg(
        required_unless_present = "wasi",
        last = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    pub cmd: Vec<OsString>,
}

/// `session create`.
#[derive(Debug, Clone, Args)]
pub struct CreateArgs {
    #[command(flatten)]
    pub session: SessionArgs,
    /// Print the session as one JSON object (default: its id).
    #[arg(long)]
    pub json: bool,
    /// A sandbox the daemon owns: the daemon starts the session's init itself
    /// (no root needed, no process of the caller's holds it); `session exec`
    /// runs commands in it through the admin API and `session close` ends it.
    /// Its network is off (only `lo`) unless `--net host`. If the daemon
    /// stops, the session ends `interrupted` (nothing published).
    #[arg(long, conflicts_with = "mount_at")]
    pub sandbox: bool,
    #[command(flatten)]
    pub defaults: SandboxDefaults,
}

/// A daemon-owned sandbox's defaults and limits (`session create --sandbox`;
/// the admin API's `SandboxOptions`).
#[derive(Debug, Clone, Args)]
pub struct SandboxDefaults {
    /// Default user of `session exec` and of file writes, UID[:GID] (numbers;
    /// GID defaults to UID) [default: 0:0].
    #[arg(long, value_name = "UID[:GID]", requires = "sandbox")]
    pub user: Option<String>,
    /// Default working directory of `session exec`, absolute in the sandbox
    /// [default: /].
    #[arg(long, value_name = "DIR", requires = "sandbox")]
    pub workdir: Option<String>,
    /// Default environment variable of `session exec`, K=V (repeatable); a
    /// bare K takes the caller's value.
    #[arg(long = "env", short = 'e', value_name = "K=V", requires = "sandbox")]
    pub env: Vec<OsString>,
    /// The sandbox's hostname [default: the session's name].
    #[arg(long, value_name = "NAME", requires = "sandbox")]
    pub hostname: Option<String>,
    /// CPU limit, thousandths of one CPU (100: a tenth of a CPU, 2000: two
    /// CPUs); 0: none [default: the daemon's `[sandbox] default_cpu_millis`].
    #[arg(long, value_name = "MILLIS", requires = "sandbox")]
    pub cpu_millis: Option<u64>,
    /// Memory limit of the sandbox's processes together, bytes (at least
    /// 4 MiB; a K, M or G suffix multiplies by 1024s); 0: none [default: the
    /// daemon's `[sandbox] default_memory_bytes`].
    #[arg(long, value_name = "BYTES", value_parser = parse_size, requires = "sandbox")]
    pub memory_bytes: Option<u64>,
    /// Processes and threads alive at once, init included (at least 2); 0:
    /// none [default: the daemon's `[sandbox] default_pids`].
    #[arg(long, value_name = "N", requires = "sandbox")]
    pub pids: Option<u64>,
    /// Run the sandbox's processes in a user namespace whose ids 0..SIZE are
    /// the host's HOST_UID.. and HOST_GID.. (its root is not the host's
    /// root); HOST_UID and HOST_GID must be SIZE or more [default: the
    /// daemon's `[sandbox] id_map`, none unless configured].
    #[arg(long, value_name = "HOST_UID:HOST_GID:SIZE", value_parser = parse_id_map, requires = "sandbox")]
    pub id_map: Option<api::IdMap>,
}

/// `HOST_UID:HOST_GID:SIZE`, checked as the daemon checks it.
fn parse_id_map(v: &str) -> std::result::Result<api::IdMap, String> {
    let m: api::types::IdMap = v.parse().map_err(|e| format!("{e}"))?;
    Ok(api::IdMap {
        host_uid: m.host_uid,
        host_gid: m.host_gid,
        size: m.size,
    })
}

/// `N`, `NK`, `NM` or `NG` (powers of 1024) as bytes.
fn parse_size(v: &str) -> std::result::Result<u64, String> {
    let (num, mult) = match v.as_bytes().last() {
        Some(b'K' | b'k') => (&v[..v.len() - 1], 1u64 << 10),
        Some(b'M' | b'm') => (&v[..v.len() - 1], 1 << 20),
        Some(b'G' | b'g') => (&v[..v.len() - 1], 1 << 30),
        _ => (v, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| {
            format!("{v:?} is no size: give bytes, or a number with K, M or G (e.g. 512M)")
        })
}

/// `session exec`.
#[derive(Debug, Clone, Args)]
pub struct ExecArgs {
    /// The session id (`session create` printed it).
    pub session: i64,
    #[command(flatten)]
    pub process: ProcessArgs,
    /// The command and its arguments (after `--`).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    pub cmd: Vec<OsString>,
}

/// `session close`.
#[derive(Debug, Clone, Args)]
pub struct CloseArgs {
    /// The session id.
    pub session: i64,
    /// The exit status the recorded policy applies to, 0..255 as a shell's
    /// `$?` (unknown if absent: on-exit publishes, on-success discards).
    #[arg(long, value_name = "N", conflicts_with_all = ["publish", "discard"],
          value_parser = clap::value_parser!(u32).range(0..=255))]
    pub exit_status: Option<u32>,
    /// Publish whatever the recorded policy.
    #[arg(long, conflicts_with = "discard")]
    pub publish: bool,
    /// Discard whatever the recorded policy.
    #[arg(long, conflicts_with = "checkpoint")]
    pub discard: bool,
    /// Make the writes a child node of the session's --node whatever the
    /// recorded policy.
    #[arg(long, conflicts_with = "publish")]
    pub checkpoint: bool,
    /// When the close checkpoints: the child node's logical state, a JSON
    /// object [default: {}].
    #[arg(long, value_name = "JSON")]
    pub state: Option<String>,
    /// Also write the outcome as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub outcome: Option<PathBuf>,
    /// Print the outcome as one JSON object.
    #[arg(long)]
    pub json: bool,
}

fn require_root(what: &str) -> Result<()> {
    if sys::euid() != 0 {
        return Err(failure(
            api::ErrorKind::FailedPrecondition,
            format!("`layerstack session {what}` needs root (euid 0): it creates mount, pid, ipc and uts namespaces and attaches an overlay; run it as root, or inside a privileged container with the daemon's socket directory mounted; or, as a uid the daemon's [api] allows, let the daemon own the session: `layerstack session create --sandbox …` (then `session exec` / `session close`) or the Python SDK's `client.sandbox(…)`"),
        ));
    }
    Ok(())
}

/// The mount socket: `--mount-address`, else `mount.sock` beside the admin socket.
fn mount_address(cli: &Cli) -> PathBuf {
    cli.mount_address.clone().unwrap_or_else(|| {
        cli.admin_address
            .parent()
            .unwrap_or_else(|| Path::new("/"))
            .join(wire::MOUNT_SOCKET_NAME)
    })
}

fn connect_mount(path: &Path) -> Result<MountConn> {
    MountConn::connect(path)
        .with_context(|| {
            format!(
                "cannot reach the daemon's mount socket {} (set --mount-address or LAYERSTACK_MOUNT_ADDRESS; in a container, mount the admin socket's directory)",
                path.display()
            )
        })
        .map_err(|e| with_kind(api::ErrorKind::Unavailable, e))
}

fn parse_ids(user: &str) -> Result<(u32, u32)> {
    let bad = || {
        failure(
            api::ErrorKind::InvalidArgument,
            format!("--user {user:?}: give UID or UID:GID as numbers"),
        )
    };
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let uid: u32 = u.parse().map_err(|_| bad())?;
    let gid: u32 = match g {
        Some(g) => g.parse().map_err(|_| bad())?,
        None => uid,
    };
    Ok((uid, gid))
}

/// The command's environment: a container's defaults in root mode (PATH,
/// HOSTNAME, HOME, the caller's TERM), the caller's own in workspace mode; then
/// `--env`.
fn environment(
    mode: Mode,
    hostname: &str,
    uid: u32,
    extra: &[OsString],
) -> Vec<(OsString, OsString)> {
    let mut env: Vec<(OsString, OsString)> = match mode {
        Mode::Workspace => std::env::vars_os().collect(),
        Mode::Root => {
            let mut e = vec![
                ("PATH".into(), DEFAULT_PATH.into()),
                ("HOSTNAME".into(), hostname.into()),
                ("HOME".into(), if uid == 0 { "/root" } else { "/" }.into()),
            ];
            if let Some(t) = std::env::var_os("TERM") {
                e.push(("TERM".into(), t));
            }
            e
        }
    };
    for kv in extra {
        let b = kv.as_bytes();
        let (k, v) = match b.iter().position(|&c| c == b'=') {
            Some(i) => (
                OsStr::from_bytes(&b[..i]).to_os_string(),
                OsStr::from_bytes(&b[i + 1..]).to_os_string(),
            ),
            None => match std::env::var_os(kv) {
                Some(v) => (kv.clone(), v),
                None => continue,
            },
        };
        env.retain(|(ek, _)| *ek != k);
        env.push((k, v));
    }
    env
}

/// The command to exec: arguments, environment, `PATH` candidates, ids, workdir.
fn command(
    mode: Mode,
    hostname: &str,
    default_workdir: &Path,
    p: &ProcessArgs,
    cmd: &[OsString],
) -> Result<Command> {
    let ids = p.user.as_deref().map(parse_ids).transpose()?;
    let env = environment(mode, hostname, ids.map_or(0, |(u, _)| u), &p.env);
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| DEFAULT_PATH.into());
    let workdir = match (&p.workdir, mode) {
        (Some(w), Mode::Root) if w.is_relative() => {
            return Err(failure(
                api::ErrorKind::InvalidArgument,
                format!(
                    "--workdir {}: give an absolute path in the session's root",
                    w.display()
                ),
            ))
        }
        (Some(w), _) if w.is_relative() => std::env::current_dir()?.join(w),
        (Some(w), _) => w.clone(),
        (None, _) => default_workdir.to_path_buf(),
    };
    let first = cmd.first().context("no command given (after --)")?;
    Ok(Command {
        candidates: holder::candidates(first, &path)?,
        argv: CArgs::new(cmd.iter().map(|a| a.clone().into_vec()))?,
        envp: CArgs::new(env.into_iter().map(|(k, v)| {
            let mut kv = k.into_vec();
            kv.push(b'=');
            kv.extend(v.into_vec());
            kv
        }))?,
        name: first.as_bytes().to_vec(),
        ids,
        workdir: std::ffi::CString::new(workdir.into_os_string().into_vec())
            .context("--workdir contains a NUL byte")?,
        userns: false,
    })
}

pub(crate) fn default_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}:{}", host.trim(), std::process::id())
}

/// A refusal the daemon answered on the mount socket: its message is for the
/// user, its kind is the reply's `code`.
fn refused(reply: wire::Reply) -> anyhow::Error {
    Failure {
        kind: reply.code,
        message: reply.message,
    }
    .into()
}

/// Refusals that need no daemon, then `start` on the mount socket: the session
/// (the daemon's `CreateSession`) and its overlay in one round trip. Returns
/// the connection, which holds the session from now on.
fn start(
    mount: &Path,
    ns: &str,
    a: &SessionArgs,
) -> Result<(MountConn, api::Session, std::os::fd::OwnedFd)> {
    if a.publish == Some(EndAction::Checkpoint) && a.node.is_none() {
        return Err(failure(
            api::ErrorKind::InvalidArgument,
            "--publish checkpoint makes a child node of the node the session starts from: give --node ID (layerstack graph show lists nodes), or use on-exit, on-success or never",
        ));
    }
    let (stack, branch) = match &a.stack {
        Some(s) => crate::history::split_branch(s),
        None => (String::new(), String::new()),
    };
    let mut conn = connect_mount(mount)?;
    let (reply, mut fds) = conn
        .request(&Request::Start(wire::Start {
            namespace: ns.to_string(),
            stack,
            branch,
            node: a.node.clone().unwrap_or_default(),
            name: a.name.clone().unwrap_or_else(default_name),
            idempotency_key: a.idempotency_key.clone().unwrap_or_default(),
            ignore_mtime: a.ignore_mtime,
            policy: a
                .publish
                .map(|p| p.as_str().to_string())
                .unwrap_or_default(),
            wait_ms: if a.no_wait {
                0
            } else {
                a.wait_timeout.saturating_mul(1000)
            },
        }))
        .context("starting a session on the mount socket")?;
    if !reply.ok {
        return Err(refused(reply));
    }
    let session = api::session_from_hex(&reply.session)
        .map_err(|e| anyhow::anyhow!("the daemon's answer to start: {e}"))?;
    let fd = fds.pop().context("the daemon sent no mount")?;
    Ok((conn, session, fd))
}

/// `close` of the session `conn` holds. Errors: a [`Refused`] answer, or the
/// connection broke (the daemon restarted: close through the admin API).
fn close_on(
    conn: &mut MountConn,
    policy: api::EndAction,
    exit: Option<u32>,
    reason: &str,
    node: &NodeInfo,
) -> Result<api::Session> {
    let policy = match policy {
        api::EndAction::Publish => "publish",
        api::EndAction::Discard => "discard",
        api::EndAction::Checkpoint => "checkpoint",
        api::EndAction::Auto => "auto",
    };
    let (reply, _) = conn
        .request(&Request::Close(wire::Close {
            policy: policy.to_string(),
            reason: reason.to_string(),
            exit_status: exit,
            state: node.state.clone().unwrap_or_default(),
            command: node.command.clone().unwrap_or_default(),
        }))
        .context("closing the session on the mount socket")?;
    if !reply.ok {
        return Err(refused(reply));
    }
    api::session_from_hex(&reply.session)
        .map_err(|e| anyhow::anyhow!("the daemon's answer to close: {e}"))
}

/// A new connection to the mount socket holding session `id` again
/// (`resume`): its holder's connection broke, the daemon restarted. A
/// refusal is a [`Failure`]; anything else means the daemon is not back yet.
fn resume(mount: &Path, id: i64, (mode, workdir): (Mode, &Path)) -> Result<MountConn> {
    let mut conn = MountConn::connect(mount)?;
    let (reply, _) = conn.request(&Request::Resume {
        session: id,
        mode,
        workdir: workdir.to_string_lossy().into_owned(),
    })?;
    if !reply.ok {
        return Err(refused(reply));
    }
    Ok(conn)
}

/// The holder's connection while the command runs, kept by a thread: when
/// the daemon closes it (a restart), the thread reconnects with back-off
/// ([`reconnect_backoff`]) until the daemon answers or the command ends, and
/// takes the session back ([`resume`]), so that the restarted daemon holds
/// it as its holder's again (its end without a close is the holder's death,
/// as before the restart) while the command still runs.
struct Keeper {
    /// Closing it stops the thread.
    stop: std::os::fd::OwnedFd,
    thread: std::thread::JoinHandle<MountConn>,
}

impl Keeper {
    fn start(
        conn: MountConn,
        mount: PathBuf,
        id: i64,
        (mode, workdir): (Mode, PathBuf),
    ) -> Result<Keeper> {
        let (stop_r, stop) = sys::pipe().context("a pipe for the connection keeper")?;
        let thread = std::thread::Builder::new()
            .name("holder-conn".into())
            .spawn(move || keep(conn, &stop_r, &mount, id, (mode, &workdir)))
            .context("starting the connection keeper thread")?;
        Ok(Keeper { stop, thread })
    }

    /// Stops the thread; the connection that holds the session now (the
    /// first, or one the thread resumed on — possibly broken: the close then
    /// reconnects itself).
    fn finish(self) -> Result<MountConn> {
        drop(self.stop);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the connection keeper thread panicked"))
    }
}

fn keep(
    mut conn: MountConn,
    stop: &std::os::fd::OwnedFd,
    mount: &Path,
    id: i64,
    place: (Mode, &Path),
) -> MountConn {
    use layerstack_sandbox::client::{wait_either, Woken};
    use std::os::fd::AsRawFd;
    let stop = stop.as_raw_fd();
    loop {
        if wait_either(Some(conn.raw_fd()), stop, -1).ok() != Some(Woken::Conn) {
            return conn;
        }
        let mut attempt = 0;
        loop {
            let ms = i32::try_from(reconnect_backoff(attempt).as_millis()).unwrap_or(2000);
            if wait_either(None, stop, ms).ok() != Some(Woken::Timeout) {
                return conn;
            }
            match resume(mount, id, place) {
                Ok(c) => {
                    conn = c;
                    break;
                }
                // Refused: the close says why.
                Err(e) if e.downcast_ref::<Failure>().is_some() => return conn,
                Err(_) => attempt += 1,
            }
        }
    }
}

/// Back-off between attempts to reach a restarted daemon: 100 ms doubling to 2 s.
fn reconnect_backoff(attempt: u32) -> std::time::Duration {
    std::time::Duration::from_millis((100u64 << attempt.min(5)).min(2000))
}

/// The close of session `id` after its holder connection broke (the daemon
/// restarted while the command ran, or died during the close): reconnects to
/// the mount socket with back-off ([`reconnect_backoff`]) for at most
/// `patience`, takes the session back (`resume`) and closes it there. The
/// restarted daemon applies the exit policy to `exit` as the last one would
/// have, or answers the outcome it recorded already (it finished the close
/// the last one started). A refusal is final; only an unreachable daemon is
/// retried.
#[allow(clippy::too_many_arguments)]
fn close_after_restart(
    mount: &Path,
    id: i64,
    (mode, workdir): (Mode, &Path),
    policy: api::EndAction,
    exit: Option<u32>,
    reason: &str,
    node: &NodeInfo,
    patience: std::time::Duration,
) -> Result<api::Session> {
    let deadline = std::time::Instant::now() + patience;
    let mut attempt = 0;
    loop {
        let r = resume(mount, id, (mode, workdir))
            .and_then(|mut conn| close_on(&mut conn, policy, exit, reason, node));
        let e = match r {
            Ok(s) => return Ok(s),
            Err(e) if e.downcast_ref::<Failure>().is_some() => return Err(e),
            Err(e) => e,
        };
        let wait = reconnect_backoff(attempt);
        if std::time::Instant::now() + wait > deadline {
            let status = exit.map_or("unknown".to_string(), |x| x.to_string());
            return Err(with_kind(
                api::ErrorKind::Unavailable,
                e.context(format!(
                    "the daemon's connection broke and its mount socket {} did not answer within {} s (--reconnect-timeout): session {id} (command exit status {status}) is not closed; the daemon finishes it by its policy, with no exit status, once it runs again",
                    mount.display(),
                    patience.as_secs()
                )),
            ));
        }
        if attempt == 0 {
            eprintln!(
                "layerstack: the daemon's connection broke; reconnecting to close session {id} (at most {} s)",
                patience.as_secs()
            );
        }
        std::thread::sleep(wait);
        attempt += 1;
    }
}

/// Where the overlay goes, the mode, and the default working directory.
fn placement(a: &SessionArgs) -> Result<(Placement, Mode, PathBuf)> {
    match &a.mount_at {
        None => Ok((Placement::Root, Mode::Root, PathBuf::from("/"))),
        Some(d) => {
            let d = std::fs::canonicalize(d)
                .with_context(|| format!("--mount-at {}: the directory must exist", d.display()))
                .map_err(|e| with_kind(api::ErrorKind::InvalidArgument, e))?;
            if !d.is_dir() {
                return Err(failure(
                    api::ErrorKind::InvalidArgument,
                    format!("--mount-at {}: not a directory", d.display()),
                ));
            }
            let c = std::ffi::CString::new(d.as_os_str().as_bytes())
                .context("--mount-at contains a NUL byte")?;
            Ok((Placement::At(c), Mode::Workspace, d))
        }
    }
}

/// Starts session `session`'s init with its overlay `mount_fd`, held by
/// `conn` (see the module docs). `Err(exit)` inside: init could not set the
/// session up.
fn hold(
    conn: &MountConn,
    mount_fd: std::os::fd::OwnedFd,
    session: &api::Session,
    (placement, mode, default_workdir): (Placement, Mode, PathBuf),
    a: &SessionArgs,
    run: Option<(&ProcessArgs, &[OsString])>,
) -> Result<Result<holder::Init, Exit>> {
    let hostname = format!("ls-{}", session.id);
    let cmd = match run {
        Some((p, argv)) => Some(command(mode, &hostname, &default_workdir, p, argv)?),
        None => None,
    };
    conn.pass_credentials()?;
    let setup = Setup {
        placement,
        net_none: a.net == Some(Net::None),
        hostname: hostname.into_bytes(),
        mount_fd: std::os::fd::AsRawFd::as_raw_fd(&mount_fd),
        claim: false,
        holder_sock: Some(conn.raw_fd()),
        ready_line: wire::line(&Request::Ready {
            mode,
            workdir: default_workdir.to_string_lossy().into_owned(),
        }),
        die_with_parent: cmd.is_some(),
        daemon_owned: false,
        // Limits and hidden sockets are the daemon-owned sessions' (the
        // admin API's CreateSession.sandbox).
        cgroup_procs: Vec::new(),
        hide: Vec::new(),
        // Id maps too: a holder's session runs as the host's root.
        id_map: None,
    };
    let init = holder::start(&setup, cmd.as_ref()).context("starting the session's init")?;
    // Only init keeps the overlay: a descriptor of it here would keep the mount
    // alive after the session's namespaces are gone.
    drop(mount_fd);
    Ok(init)
}

/// One line on stderr: `layerstack: session 12 committed (layer 34; 3 clean, 0 merged, 0 excluded)`.
pub(crate) fn outcome_line(s: &api::Session) -> String {
    let c = s.counts.clone().unwrap_or_default();
    let mut l = format!(
        "layerstack: session {} {}",
        s.id,
        if s.outcome.is_empty() {
            "no outcome"
        } else {
            &s.outcome
        }
    );
    let mut detail = Vec::new();
    if s.layer != 0 {
        detail.push(format!("layer {}", s.layer));
    }
    if !s.node.is_empty() {
        detail.push(format!("node {}", s.node));
    }
    let kind = OutcomeKind::parse(&s.outcome);
    if !s.outcome.is_empty() && kind != Some(OutcomeKind::Discarded) {
        detail.push(format!(
            "{} clean, {} merged, {} conflict, {} excluded",
            c.clean, c.merged, c.conflict, c.excluded
        ));
    }
    // A published layer needs no words, nor a checkpoint that names its node;
    // anything else says why.
    if !s.message.is_empty() && !kind.is_some_and(OutcomeKind::is_published) && s.node.is_empty() {
        detail.push(s.message.clone());
    }
    if !detail.is_empty() {
        l.push_str(&format!(" ({})", detail.join("; ")));
    }
    l
}

pub(crate) fn write_outcome(file: &Path, s: &api::Session, exit: Option<i32>) -> Result<()> {
    write_outcome_with(file, s, exit, None)
}

/// [`write_outcome`] with one more field (`session run --wasi`'s `wasi`).
pub(crate) fn write_outcome_with(
    file: &Path,
    s: &api::Session,
    exit: Option<i32>,
    extra: Option<(&str, serde_json::Value)>,
) -> Result<()> {
    let mut v = session_json(s, None);
    v["exit_status"] = exit.map_or(serde_json::Value::Null, |x| json!(x));
    if let Some((k, x)) = extra {
        v[k] = x;
    }
    let mut f =
        std::fs::File::create(file).with_context(|| format!("--outcome {}", file.display()))?;
    writeln!(f, "{v}").with_context(|| format!("--outcome {}", file.display()))?;
    Ok(())
}

/// What a close that checkpoints records on the child node.
#[derive(Debug, Clone, Default)]
pub(crate) struct NodeInfo {
    pub(crate) state: Option<String>,
    pub(crate) command: Option<String>,
}

impl NodeInfo {
    /// What a close with `policy` sends: nothing for a DISCARD, which
    /// records no node (and is refused with a state it would not record).
    pub(crate) fn for_end(self, policy: api::EndAction) -> NodeInfo {
        if policy == api::EndAction::Discard {
            NodeInfo::default()
        } else {
            self
        }
    }
}

pub(crate) async fn close(
    c: &mut api::AdminClient<tonic::transport::Channel>,
    id: i64,
    policy: api::EndAction,
    exit: Option<u32>,
    reason: &str,
    node: &NodeInfo,
) -> Result<api::Session> {
    Ok(c.close_session(api::CloseSessionRequest {
        session_id: id,
        action: policy as i32,
        reason: reason.to_string(),
        has_exit_status: exit.is_some(),
        exit_status: exit.unwrap_or(0),
        state: node.state.clone().unwrap_or_default(),
        command: node.command.clone().unwrap_or_default(),
        labels: Default::default(),
    })
    .await?
    .into_inner())
}

/// Exit 125 for an error of `run` or `exec` itself, reported on stderr (the
/// command's statuses are the command's).
pub(crate) fn own_error(cli: &Cli, r: Result<ExitCode>) -> Result<ExitCode> {
    match r {
        Ok(code) => Ok(code),
        Err(e) => {
            crate::errors::report(cli.error_format, &e);
            Ok(ExitCode::from(SETUP_FAILED as u8))
        }
    }
}

/// `session run`: errors of its own exit 125 (the command's status is for the command).
pub async fn run(cli: &Cli, a: RunArgs) -> Result<ExitCode> {
    own_error(cli, run_inner(cli, a).await)
}

async fn run_inner(cli: &Cli, a: RunArgs) -> Result<ExitCode> {
    crate::check_state(a.state.as_deref())?;
    let checkpoints = match a.session.publish {
        Some(p) => matches!(p, EndAction::Checkpoint),
        None => a.session.node.is_some(),
    };
    if a.state.is_some() && !checkpoints {
        return Err(failure(
            api::ErrorKind::InvalidArgument,
            "--state is the child node's state, recorded by a checkpoint: run on a --node (whose default end is checkpoint) or with --publish checkpoint",
        ));
    }
    if a.wasi.wasi.is_some() {
        return crate::wasi::run(cli, a).await;
    }
    require_root("run")?;
    let place = placement(&a.session)?;
    let (mode, workdir) = (place.1, place.2.clone());
    let mount = mount_address(cli);
    let (mut conn, session, mount_fd) = start(&mount, &cli.namespace, &a.session)?;
    note_new_branch(&session, false);
    let id = session.id;
    let init = match hold(
        &conn,
        mount_fd,
        &session,
        place,
        &a.session,
        Some((&a.process, &a.cmd)),
    ) {
        Ok(i) => i,
        Err(e) => {
            let _ = close_on(
                &mut conn,
                api::EndAction::Discard,
                None,
                "session setup failed",
                &NodeInfo::default(),
            );
            return Err(e);
        }
    };
    let keeper = Keeper::start(conn, mount.clone(), id, (mode, workdir.clone()))?;
    let waited = match init {
        Ok(init) => Ok(init.wait().context("waiting for the session's init")),
        Err(x) => Err(x),
    };
    let mut conn = keeper.finish()?;
    let (exit, policy, reason) = match waited {
        Ok(x) => {
            let x = x?;
            let code = x.shell_status();
            (
                code,
                api::EndAction::Auto,
                format!("session run: command exited with status {code}"),
            )
        }
        Err(x) => (
            x.shell_status(),
            api::EndAction::Discard,
            "session setup failed".to_string(),
        ),
    };
    let status = u32::try_from(exit).ok();
    let node = NodeInfo {
        state: a.state.clone(),
        command: Some(
            a.cmd
                .iter()
                .map(|x| x.to_string_lossy())
                .collect::<Vec<_>>()
                .join(" "),
        ),
    }
    .for_end(policy);
    let s = match close_on(&mut conn, policy, status, &reason, &node) {
        Ok(s) => s,
        Err(e) if e.downcast_ref::<Failure>().is_some() => return Err(e),
        // The connection broke: the daemon restarted meanwhile, or died
        // during the close (the new one keeps the session for its holder).
        Err(_) => close_after_restart(
            &mount,
            id,
            (mode, &workdir),
            policy,
            status,
            &reason,
            &node,
            std::time::Duration::from_secs(a.reconnect_timeout.into()),
        )?,
    };
    drop(conn);
    // Whether this run's start made its branch: a field of the outcome, as
    // of CreateSession's answer (a later read of the session says false).
    let s = api::Session {
        branch_created: session.branch_created,
        ..s
    };
    eprintln!("{}", outcome_line(&s));
    if let Some(f) = &a.outcome {
        write_outcome(f, &s, Some(exit))?;
    }
    Ok(ExitCode::from(u8::try_from(exit).unwrap_or(255)))
}

/// `session create`: prints the session id once its init is ready.
pub async fn create_cmd(cli: &Cli, a: CreateArgs) -> Result<ExitCode> {
    if a.sandbox {
        return create_sandbox(cli, a).await;
    }
    require_root("create")?;
    let place = placement(&a.session)?;
    let (mut conn, session, mount_fd) = start(&mount_address(cli), &cli.namespace, &a.session)?;
    note_new_branch(&session, true);
    let id = session.id;
    let init = match hold(&conn, mount_fd, &session, place, &a.session, None) {
        Ok(i) => i,
        Err(e) => {
            let _ = close_on(
                &mut conn,
                api::EndAction::Discard,
                None,
                "session setup failed",
                &NodeInfo::default(),
            );
            return Err(e);
        }
    };
    if let Err(x) = init {
        let _ = close_on(
            &mut conn,
            api::EndAction::Discard,
            None,
            "session setup failed",
            &NodeInfo::default(),
        );
        bail!(
            "session {id} could not be set up (init exited with status {})",
            x.shell_status()
        );
    }
    if a.json {
        out!("{}", session_json(&session, None));
    } else {
        out!("{id}");
    }
    Ok(ExitCode::SUCCESS)
}

/// `--env` arguments as the admin API takes them, `K=V` each: a bare `K`
/// takes the caller's value, and is left out when the caller has none.
pub(crate) fn env_pairs(vars: &[OsString]) -> Result<Vec<String>> {
    let mut out = Vec::with_capacity(vars.len());
    for kv in vars {
        let kv = api_text("--env", kv)?;
        if kv.contains('=') {
            out.push(kv);
        } else if let Some(v) = std::env::var_os(&kv) {
            out.push(format!(
                "{kv}={}",
                api_text(&format!("--env {kv} (from this environment)"), &v)?
            ));
        }
    }
    Ok(out)
}

/// `s` as the text the admin API carries (its argv, env and paths are
/// protobuf strings); INVALID_ARGUMENT naming `what` when it is not UTF-8 —
/// never changed silently (a lossy conversion turned `\xff` into U+FFFD).
pub(crate) fn api_text(what: &str, s: &std::ffi::OsStr) -> Result<String> {
    s.to_str().map(str::to_string).ok_or_else(|| {
        failure(
            api::ErrorKind::InvalidArgument,
            format!(
                "{what} {:?} is not UTF-8: the admin API carries arguments, environment and paths as text; pass binary data in a file or on stdin",
                s.to_string_lossy()
            ),
        )
    })
}

/// The command's arguments as [`api_text`] (each named by its position).
pub(crate) fn api_argv(cmd: &[OsString]) -> Result<Vec<String>> {
    cmd.iter()
        .enumerate()
        .map(|(i, x)| api_text(&format!("argument {}", i + 1), x))
        .collect()
}

/// The CreateSession request of a session the daemon runs (a daemon-owned
/// sandbox, a WASI session) from `s`: its stack and branch (or node), owner
/// name, idempotency key, exit policy, wait for a slot and mtime rule; the
/// caller sets `sandbox` or `wasi`.
pub(crate) fn daemon_session_request(cli: &Cli, s: &SessionArgs) -> api::CreateSessionRequest {
    let (stack, branch) = match &s.stack {
        Some(st) => crate::history::split_branch(st),
        None => (String::new(), String::new()),
    };
    api::CreateSessionRequest {
        namespace: cli.namespace.clone(),
        stack,
        branch,
        node: s.node.clone().unwrap_or_default(),
        name: s.name.clone().unwrap_or_else(default_name),
        idempotency_key: s.idempotency_key.clone().unwrap_or_default(),
        policy: s
            .publish
            .map(|p| p.as_str().to_string())
            .unwrap_or_default(),
        wait_ms: if s.no_wait {
            0
        } else {
            s.wait_timeout.saturating_mul(1000)
        },
        ignore_mtime: s.ignore_mtime,
        ..Default::default()
    }
}

/// Says on stderr that creating session `s` also created its branch
/// (`Session.branch_created`): `STACK@NAME` with a NAME that did not exist
/// forks a new branch, which is what a misspelt name does too. `own_stderr`:
/// the binary's stderr is its own (`session create`); otherwise it is the
/// command's (`session run`, whose caller reads the command's stderr as it
/// was), and the line goes only to a terminal — a program reads the field
/// (`--json`, `--outcome`).
pub(crate) fn note_new_branch(s: &api::Session, own_stderr: bool) {
    use std::io::IsTerminal;
    if s.branch_created && (own_stderr || std::io::stderr().is_terminal()) {
        eprintln!(
            "layerstack: branch {:?} of stack {} did not exist: created it from the default branch's head (`layerstack branch ls {}` lists the others; a misspelt name makes a new branch)",
            s.branch, s.stack, s.stack
        );
    }
}

/// `session create --sandbox`: a daemon-owned session made through the admin
/// API's CreateSession (its `sandbox` options); prints its id (or JSON).
async fn create_sandbox(cli: &Cli, a: CreateArgs) -> Result<ExitCode> {
    let s = &a.session;
    let d = &a.defaults;
    let ids = d.user.as_deref().map(parse_ids).transpose()?;
    let env = env_pairs(&d.env)?;
    let mut c = crate::connect(&cli.admin_address).await?;
    let created = c
        .create_session(api::CreateSessionRequest {
            sandbox: Some(api::SandboxOptions {
                network: s.net == Some(Net::Host),
                has_user: ids.is_some(),
                uid: ids.map_or(0, |(u, _)| u),
                gid: ids.map_or(0, |(_, g)| g),
                workdir: d.workdir.clone().unwrap_or_default(),
                env,
                placement: String::new(),
                hostname: d.hostname.clone().unwrap_or_default(),
                cpu_millis: d.cpu_millis,
                memory_bytes: d.memory_bytes,
                pids: d.pids,
                id_map: d.id_map.clone(),
            }),
            ..daemon_session_request(cli, s)
        })
        .await?
        .into_inner();
    let session = created.session.context("the daemon answered no session")?;
    note_new_branch(&session, true);
    if a.json {
        let mut v = session_json(&session, None);
        v["created"] = json!(created.created);
        out!("{v}");
    } else {
        out!("{}", session.id);
    }
    Ok(ExitCode::SUCCESS)
}

/// `session exec`: the command's exit status; 125 when `exec` fails itself.
pub async fn exec_cmd(cli: &Cli, a: ExecArgs) -> Result<ExitCode> {
    // Root joins the session's namespaces through the mount socket (the
    // caller's terminal and stdio, interactive); anyone else, and any session
    // the daemon cannot hand over that way (a WASI one), goes through the
    // admin API's Exec.
    if sys::euid() != 0 {
        return own_error(cli, exec_rpc(cli, a).await);
    }
    match exec_inner(cli, &a) {
        Err(e) if joined_never(&e) => own_error(cli, exec_rpc(cli, a).await),
        r => own_error(cli, r),
    }
}

/// Whether `e` is a refusal of the mount socket's Join (nothing ran).
fn joined_never(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<Failure>()
            .is_some_and(|f| f.message.starts_with("cannot join session"))
    })
}

/// Stdin an Exec carries at most (bytes): the admin API's 4 MiB message
/// limit, less room for the rest of the request.
const EXEC_STDIN_MAX: usize = 4 << 20 >> 1;

/// `session exec` through the admin API's Exec (no root, no mount socket;
/// stdout and stderr streamed; stdin read whole first when it is not a
/// terminal, at most [`EXEC_STDIN_MAX`] bytes).
async fn exec_rpc(cli: &Cli, a: ExecArgs) -> Result<ExitCode> {
    use std::io::{IsTerminal as _, Read as _};
    let ids = a.process.user.as_deref().map(parse_ids).transpose()?;
    let env = env_pairs(&a.process.env)?;
    let cwd = match &a.process.workdir {
        Some(w) if w.is_relative() => {
            return Err(failure(
                api::ErrorKind::InvalidArgument,
                format!(
                    "--workdir {}: give an absolute path in the session's root",
                    w.display()
                ),
            ))
        }
        Some(w) => w.to_string_lossy().into_owned(),
        None => String::new(),
    };
    let mut stdin = Vec::new();
    if !std::io::stdin().is_terminal() {
        std::io::stdin()
            .take(EXEC_STDIN_MAX as u64 + 1)
            .read_to_end(&mut stdin)
            .context("reading stdin")?;
        if stdin.len() > EXEC_STDIN_MAX {
            return Err(failure(
                api::ErrorKind::InvalidArgument,
                format!("stdin is over {EXEC_STDIN_MAX} bytes: an exec through the admin API carries it whole; write large inputs into the session as files (WriteFile, UploadTar) or run as root"),
            ));
        }
    }
    let mut c = crate::connect(&cli.admin_address).await?;
    let stream = c
        .exec(api::ExecRequest {
            session_id: a.session,
            argv: api_argv(&a.cmd)?,
            env,
            cwd,
            has_user: ids.is_some(),
            uid: ids.map_or(0, |(u, _)| u),
            gid: ids.map_or(0, |(_, g)| g),
            stdin,
            ..Default::default()
        })
        .await?
        .into_inner();
    let x = copy_exec(stream).await?;
    Ok(ExitCode::from(u8::try_from(x.code).unwrap_or(255)))
}

/// An Exec's replies: stdout and stderr copied to ours as they come, then
/// its exit.
pub(crate) async fn copy_exec(
    mut stream: tonic::Streaming<api::ExecReply>,
) -> Result<api::ExecExit> {
    let mut exit = None;
    // A stream we cannot write (a closed pipe: `| head`) is dropped from
    // then on, as the rest of its output: the command ran on in its
    // session, and its exit — not our printing — decides how it ends.
    let (mut out_open, mut err_open) = (true, true);
    while let Some(r) = stream.message().await? {
        match r.kind {
            Some(api::exec_reply::Kind::Stdout(b)) if out_open => {
                let mut o = std::io::stdout().lock();
                out_open = o.write_all(&b).and_then(|()| o.flush()).is_ok();
            }
            Some(api::exec_reply::Kind::Stderr(b)) if err_open => {
                err_open = std::io::stderr().lock().write_all(&b).is_ok();
            }
            Some(api::exec_reply::Kind::Stdout(_) | api::exec_reply::Kind::Stderr(_)) => {}
            Some(api::exec_reply::Kind::Exit(x)) => exit = Some(x),
            None => {}
        }
    }
    exit.context("the daemon's Exec stream ended without an exit")
}

fn exec_inner(cli: &Cli, a: &ExecArgs) -> Result<ExitCode> {
    require_root("exec")?;
    let mut conn = connect_mount(&mount_address(cli))?;
    let (reply, mut fds) = conn
        .request(&Request::Join { session: a.session })
        .context("joining the session on the mount socket")?;
    if !reply.ok {
        return Err(Failure {
            kind: reply.code,
            message: format!("cannot join session {}: {}", a.session, reply.message),
        }
        .into());
    }
    drop(conn);
    if fds.len() != 2 {
        bail!(
            "the daemon sent {} descriptors, not 2 (pidfd, root)",
            fds.len()
        );
    }
    let root = fds.pop().context("root")?;
    let pidfd = fds.pop().context("pidfd")?;
    let mode = reply.mode.unwrap_or_default();
    let hostname = format!("ls-{}", a.session);
    let cmd = command(
        mode,
        &hostname,
        Path::new(&reply.workdir),
        &a.process,
        &a.cmd,
    )?;
    let x =
        holder::join_and_run(pidfd, root, &cmd).context("running the command in the session")?;
    Ok(ExitCode::from(
        u8::try_from(x.shell_status()).unwrap_or(255),
    ))
}

/// `session close`: prints the outcome; exits 3 on conflict.
pub async fn close_cmd(cli: &Cli, a: CloseArgs) -> Result<ExitCode> {
    crate::check_state(a.state.as_deref())?;
    let mut c = crate::connect(&cli.admin_address).await?;
    let policy = if a.publish {
        api::EndAction::Publish
    } else if a.discard {
        api::EndAction::Discard
    } else if a.checkpoint {
        api::EndAction::Checkpoint
    } else {
        api::EndAction::Auto
    };
    let s = close(
        &mut c,
        a.session,
        policy,
        a.exit_status,
        "layerstack session close",
        &NodeInfo {
            state: a.state.clone(),
            command: None,
        },
    )
    .await?;
    if let Some(f) = &a.outcome {
        write_outcome(f, &s, a.exit_status.map(|x| x as i32))?;
    }
    let code = print_outcome(&s, None, a.json);
    if let Some(why) = close_came_late(policy, &s) {
        crate::errors::report(cli.error_format, &anyhow::anyhow!(why));
        return Ok(ExitCode::FAILURE);
    }
    Ok(code)
}

/// A close answered by an end recorded before it (a close is idempotent: a
/// repeated one answers the session's recorded end) that is not the end
/// asked for: a `--discard` of writes that were published or checkpointed,
/// a `--publish` or `--checkpoint` of writes already dropped or kept the
/// other way. Printing that end with status 0 would read as if the close
/// had done what it was asked.
fn close_came_late(policy: api::EndAction, s: &api::Session) -> Option<String> {
    let kind = OutcomeKind::parse(&s.outcome)?;
    if kind == OutcomeKind::Interrupted
        && matches!(policy, api::EndAction::Publish | api::EndAction::Checkpoint)
    {
        return Some(format!(
            "session {} ended interrupted ({}): nothing of its run can be published or checkpointed; \
             its writes are kept until discarded: layerstack session close {} --discard",
            s.id,
            if s.interrupted_by.is_empty() { "an infrastructure failure" } else { &s.interrupted_by },
            s.id
        ));
    }
    let kept = match kind {
        OutcomeKind::Committed | OutcomeKind::Merged => format!(" (layer {})", s.layer),
        OutcomeKind::Checkpointed => format!(" (node {})", s.node),
        _ => String::new(),
    };
    let (asked, late) = match policy {
        api::EndAction::Discard => (
            "discard",
            matches!(
                kind,
                OutcomeKind::Committed | OutcomeKind::Merged | OutcomeKind::Checkpointed
            ),
        ),
        api::EndAction::Publish => (
            "publish",
            matches!(kind, OutcomeKind::Discarded | OutcomeKind::Checkpointed),
        ),
        api::EndAction::Checkpoint => (
            "checkpoint",
            matches!(
                kind,
                OutcomeKind::Discarded | OutcomeKind::Committed | OutcomeKind::Merged
            ),
        ),
        api::EndAction::Auto => ("close", false),
    };
    late.then(|| {
        format!(
            "session {} had ended {} already{kept}: the {asked} changed nothing (a session ends once; \
             its recorded end is printed above)",
            s.id, s.outcome
        )
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn arguments_and_environment_that_are_not_utf8_are_refused_not_changed() {
        use std::os::unix::ffi::OsStringExt;
        let bad = OsString::from_vec(vec![b'x', 0xff, 0xfe]);
        let e = api_argv(&[OsString::from("ok"), bad.clone()]).unwrap_err();
        let (kind, m) = crate::errors::describe(&e);
        assert_eq!(kind, "invalid_argument");
        assert!(
            m.starts_with("argument 2 ") && m.contains("is not UTF-8"),
            "{m}"
        );
        let mut kv = b"ODD=".to_vec();
        kv.push(0xff);
        let e = env_pairs(&[OsString::from_vec(kv)]).unwrap_err();
        assert!(crate::errors::describe(&e).1.starts_with("--env "), "{e}");
        assert_eq!(
            env_pairs(&[OsString::from("A=b")]).unwrap(),
            vec!["A=b".to_string()]
        );
        assert_eq!(
            api_argv(&[OsString::from("é")]).unwrap(),
            vec!["é".to_string()]
        );
    }

    #[test]
    fn every_publish_flag_value_is_the_exit_policy_of_that_name() {
        for p in EndAction::value_variants() {
            let flag = p.to_possible_value().unwrap();
            assert_eq!(flag.get_name(), p.as_str());
            assert_eq!(
                p.as_str()
                    .parse::<api::policy::ExitPolicy>()
                    .unwrap()
                    .as_str(),
                p.as_str()
            );
        }
    }

    #[test]
    fn ids_and_environment() {
        assert_eq!(parse_ids("1000").unwrap(), (1000, 1000));
        assert_eq!(parse_ids("1000:5").unwrap(), (1000, 5));
        assert!(parse_ids("bob").is_err());
        let env = environment(Mode::Root, "ls-1", 0, &["A=1".into(), "PATH=/x".into()]);
        let get = |k: &str| env.iter().find(|(ek, _)| ek == k).map(|(_, v)| v.clone());
        assert_eq!(get("PATH"), Some("/x".into()));
        assert_eq!(get("A"), Some("1".into()));
        assert_eq!(get("HOME"), Some("/root".into()));
        assert_eq!(get("HOSTNAME"), Some("ls-1".into()));
    }

    #[test]
    fn a_close_answered_by_another_earlier_end_is_an_error() {
        use api::EndAction::{Auto, Checkpoint, Discard, Publish};
        let ended = |outcome: &str| api::Session {
            id: 4,
            outcome: outcome.into(),
            layer: 9,
            node: "n3".into(),
            ..Default::default()
        };
        let late = close_came_late(Discard, &ended("committed")).unwrap();
        assert!(
            late.contains("session 4 had ended committed already (layer 9): the discard"),
            "{late}"
        );
        let late = close_came_late(Discard, &ended("checkpointed")).unwrap();
        assert!(late.contains("(node n3)"), "{late}");
        let late = close_came_late(Checkpoint, &ended("merged")).unwrap();
        assert!(late.contains("the checkpoint changed nothing"), "{late}");
        assert!(close_came_late(Publish, &ended("discarded")).is_some());
        let late = close_came_late(Publish, &ended("interrupted")).unwrap();
        assert!(late.contains("--discard"), "{late}");
        assert_eq!(close_came_late(Discard, &ended("interrupted")), None);
        // What the close itself can end with, and AUTO, are no error.
        for (p, o) in [
            (Discard, "discarded"),
            (Discard, "conflict"),
            (Publish, "committed"),
            (Publish, "merged"),
            (Publish, "conflict"),
            (Publish, "no-change"),
            (Checkpoint, "checkpointed"),
            (Auto, "committed"),
            (Auto, "discarded"),
        ] {
            assert_eq!(close_came_late(p, &ended(o)), None, "{p:?} {o}");
        }
    }

    #[test]
    fn the_outcome_line_is_one_line() {
        let s = api::Session {
            id: 4,
            outcome: "committed".into(),
            layer: 9,
            counts: Some(api::PathCounts {
                clean: 2,
                ..Default::default()
            }),
            ..Default::default()
        };
        let l = outcome_line(&s);
        assert_eq!(
            l,
            "layerstack: session 4 committed (layer 9; 2 clean, 0 merged, 0 conflict, 0 excluded)"
        );
        let s = api::Session {
            id: 5,
            outcome: "discarded".into(),
            message: "writes dropped: x".into(),
            ..Default::default()
        };
        assert_eq!(
            outcome_line(&s),
            "layerstack: session 5 discarded (writes dropped: x)"
        );
        let s = api::Session {
            id: 6,
            outcome: "checkpointed".into(),
            layer: 3,
            node: "n-9".into(),
            message: "checkpointed as node n-9".into(),
            ..Default::default()
        };
        assert_eq!(
            outcome_line(&s),
            "layerstack: session 6 checkpointed (layer 3; node n-9; 0 clean, 0 merged, 0 conflict, 0 excluded)"
        );
    }

    #[test]
    fn the_outcome_file_names_the_node() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("outcome.json");
        let s = api::Session {
            id: 6,
            outcome: "checkpointed".into(),
            node: "n-9".into(),
            ..Default::default()
        };
        write_outcome(&f, &s, Some(0)).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
        assert_eq!((&v["node"], &v["exit_status"]), (&json!("n-9"), &json!(0)));
    }
}
