//! The daemon's side of the process spawner
//! (`layerstack_sandbox::spawner`): forked first thing in `main`, adopted
//! once the runtime runs, asked synchronously for each init and each exec
//! waiter, and replaced when it dies (see the parent module's docs).

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex, OnceLock};

use layerstack_sandbox::spawner::{self, Forked, Request};
use tracing::{error, info};

use super::*;

/// What `main` forked, until [`Spawner::adopt`] takes it.
static FORKED: Mutex<Option<io::Result<Forked>>> = Mutex::new(None);

/// How long the spawner may take to answer one request (a clone of a small
/// process: well under a millisecond) before the daemon gives up on it,
/// kills it and fails what needs it.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// Forks the process spawner. Called first thing in `main`, while the
/// daemon is still one thread; the result waits for [`Spawner::adopt`].
pub fn fork_at_start() {
    // SAFETY: main calls this before the tokio runtime (or anything else)
    // starts a thread.
    let r = unsafe { spawner::fork() };
    *FORKED.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
}

/// How soon after its start a spawner that died is replaced at the
/// earliest: one that dies at once is not restarted in a loop.
const RESTART_AFTER: Duration = Duration::from_secs(1);

/// One spawner process, as the daemon holds it.
struct Current {
    /// The socket, used for one request and its reply at a time (under
    /// [`Spawner::cur`]'s lock).
    sock: OwnedFd,
    pid: i32,
    pidfd: Arc<OwnedFd>,
    /// Why it is no longer usable (it ended, or stopped answering).
    gone: Arc<OnceLock<String>>,
    started: std::time::Instant,
}

/// The daemon's handle on the process spawner: the one `main` forked, then
/// each replacement of one that died.
pub struct Spawner {
    cur: Mutex<Current>,
    /// Where the reaper tasks run.
    rt: tokio::runtime::Handle,
    /// Asks the spawners' parent thread for a new spawner.
    restart: Mutex<std::sync::mpsc::Sender<std::sync::mpsc::Sender<io::Result<Forked>>>>,
    /// Spawners started after the first.
    restarts: std::sync::atomic::AtomicU64,
    /// When the last request ended, µs after `epoch`; `u64::MAX` while one
    /// runs ([`Spawner::idle_for`]).
    last_end: std::sync::atomic::AtomicU64,
    epoch: std::time::Instant,
}

impl Spawner {
    /// Takes the spawner `main` forked and starts the task that reaps it
    /// (and logs it, should it end before the daemon), and the thread that
    /// starts its replacements. Call once, in the runtime. Errors: why there
    /// is none (the fork failed), as a sentence.
    pub fn adopt() -> Result<Arc<Spawner>, String> {
        let forked = FORKED.lock().unwrap_or_else(|p| p.into_inner()).take();
        let f = match forked {
            None => return Err("the daemon did not fork a process spawner at its start".into()),
            Some(Err(e)) => {
                return Err(format!(
                    "forking the process spawner at the daemon's start failed: {e}"
                ))
            }
            Some(Ok(f)) => f,
        };
        let rt = tokio::runtime::Handle::current();
        let cur = watch(&rt, f)?;
        // Inits and waiters are cloned with CLONE_PARENT: their parent-death
        // signal follows the daemon thread that started their spawner, so a
        // replacement is started by a thread that never ends.
        let (tx, rx) = std::sync::mpsc::channel::<std::sync::mpsc::Sender<io::Result<Forked>>>();
        std::thread::Builder::new()
            .name("ls-spawner-parent".into())
            .spawn(move || {
                let exe = std::path::PathBuf::from("/proc/self/exe");
                while let Ok(reply) = rx.recv() {
                    let _ = reply.send(spawner::exec(&exe));
                }
                // The daemon dropped its handle: it is ending. Stay, so
                // the spawner started here keeps its parent thread.
                loop {
                    std::thread::park();
                }
            })
            .map_err(|e| format!("starting the spawners' parent thread: {e}"))?;
        Ok(Arc::new(Spawner {
            cur: Mutex::new(cur),
            rt,
            restart: Mutex::new(tx),
            restarts: std::sync::atomic::AtomicU64::new(0),
            last_end: std::sync::atomic::AtomicU64::new(0),
            epoch: std::time::Instant::now(),
        }))
    }

    /// How long no request has run (zero while one runs): the ready-init
    /// pool asks only an idle spawner (`super::ready`).
    pub fn idle_for(&self) -> Duration {
        match self.last_end.load(std::sync::atomic::Ordering::Relaxed) {
            u64::MAX => Duration::ZERO,
            t => self
                .epoch
                .elapsed()
                .saturating_sub(Duration::from_micros(t)),
        }
    }

    /// The current spawner's pid.
    pub fn pid(&self) -> u32 {
        self.cur.lock().unwrap_or_else(|p| p.into_inner()).pid as u32
    }

    fn gone_status(pid: i32, why: &str, next: &str) -> Status {
        Status::unavailable(format!(
            "the daemon's process spawner (pid {pid}) is gone ({why}): {next}"
        ))
    }

    /// A new spawner in place of `cur`, which is gone. Errors: UNAVAILABLE
    /// when `cur` started less than [`RESTART_AFTER`] ago or no new one
    /// starts.
    fn replace(&self, cur: &mut Current, why: &str) -> Result<(), Status> {
        if cur.started.elapsed() < RESTART_AFTER {
            return Err(Self::gone_status(
                cur.pid,
                why,
                "it died within a second of its start; a new one is started on a request after that — retry",
            ));
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let sent = self
            .restart
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(tx)
            .is_ok();
        let started = match rx.recv() {
            Ok(r) if sent => r.map_err(|e| e.to_string()),
            _ => Err("the spawners' parent thread is gone".to_string()),
        };
        let f = started.map_err(|e| {
            error!(spawner.pid = cur.pid, error = %e, "a new process spawner could not be started");
            Self::gone_status(
                cur.pid,
                why,
                &format!("a new one could not be started ({e}); the daemon's log has the reason"),
            )
        })?;
        let old = cur.pid;
        *cur = watch(&self.rt, f).map_err(|e| Self::gone_status(old, why, &e))?;
        let n = 1 + self
            .restarts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        info!(old.pid = old, spawner.pid = cur.pid, restarts = n, reason = %why, "the daemon's process spawner was replaced");
        Ok(())
    }

    /// Sends `req` and waits for the reply: the pid of the child the
    /// spawner cloned (a child of this daemon) and the descriptors that came
    /// with it. Blocks the calling thread for the round trip (a clone of a
    /// small process). `what` names the child for errors. A spawner found
    /// dead is replaced first ([`RESTART_AFTER`]); one that fails during the
    /// request fails it with UNAVAILABLE (retry: the next request gets a new
    /// spawner).
    pub fn spawn(&self, what: &str, req: &Request) -> Result<(i32, Vec<OwnedFd>), Status> {
        use std::sync::atomic::Ordering;
        let mut cur = self.cur.lock().unwrap_or_else(|p| p.into_inner());
        self.last_end.store(u64::MAX, Ordering::Relaxed);
        let r = self.spawn_locked(&mut cur, what, req);
        let now = u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX - 1);
        self.last_end.store(now, Ordering::Relaxed);
        r
    }

    fn spawn_locked(
        &self,
        cur: &mut Current,
        what: &str,
        req: &Request,
    ) -> Result<(i32, Vec<OwnedFd>), Status> {
        if let Some(why) = cur.gone.get().cloned() {
            self.replace(cur, &why)?;
        }
        match spawner::round_trip(cur.sock.as_raw_fd(), req) {
            Ok((Ok(pid), fds)) => Ok((pid, fds)),
            Ok((Err(e), _)) => Err(io_status(&format!("cannot start {what}"), &e)),
            Err(e) => {
                let why = if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) {
                    // A stuck spawner would hold every later request: end it.
                    let _ = sys::pidfd_kill(&cur.pidfd, libc::SIGKILL);
                    format!(
                        "it did not answer within {} s and was killed",
                        ANSWER_WITHIN.as_secs()
                    )
                } else {
                    format!("its socket: {e}")
                };
                error!(spawner.pid = cur.pid, reason = %why, "the daemon's process spawner failed");
                let _ = cur.gone.set(why.clone());
                Err(Self::gone_status(
                    cur.pid,
                    &why,
                    &format!(
                        "{what} was not started; the next request starts a new spawner — retry"
                    ),
                ))
            }
        }
    }
}

/// `f` with the task that reaps it and records why it ended.
fn watch(rt: &tokio::runtime::Handle, f: Forked) -> Result<Current, String> {
    let pidfd = Arc::new(
        sys::pidfd_open(f.pid)
            .map_err(|e| format!("a pidfd for the process spawner (pid {}): {e}", f.pid))?,
    );
    sys::set_timeouts(f.sock.as_raw_fd(), ANSWER_WITHIN)
        .map_err(|e| format!("timeouts on the process spawner's socket: {e}"))?;
    let gone = Arc::new(OnceLock::new());
    let (fd, g, pid) = (pidfd.clone(), gone.clone(), f.pid);
    rt.spawn(async move {
        let x = wait_pidfd(&fd).await;
        let why = match x {
            Ok(x) => format!("it ended with status {}", x.shell_status()),
            Err(e) => format!("waiting for it failed: {e}"),
        };
        error!(spawner.pid = pid, reason = %why, "the daemon's process spawner is gone: the next daemon-owned session or Exec starts a new one");
        let _ = g.set(why);
    });
    Ok(Current {
        sock: f.sock,
        pid: f.pid,
        pidfd,
        gone,
        started: std::time::Instant::now(),
    })
}
