//! The daemon's side of the process spawner
//! (`layerstack_sandbox::spawner`): forked first thing in `main`, adopted
//! once the runtime runs, asked synchronously for each init and each exec
//! waiter (see the parent module's docs).

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex, OnceLock};

use layerstack_sandbox::spawner::{self, Forked, Request};
use tracing::error;

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

/// The daemon's handle on the process spawner.
pub struct Spawner {
    /// The socket, locked for one request and its reply.
    sock: Mutex<OwnedFd>,
    pid: i32,
    pidfd: OwnedFd,
    /// Why the spawner is no longer usable (it ended, or stopped answering).
    gone: OnceLock<String>,
}

impl Spawner {
    /// Takes the spawner `main` forked and starts the task that reaps it
    /// (and logs it, should it end before the daemon). Call once, in the
    /// runtime. Errors: why there is none (the fork failed), as a sentence.
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
        let pidfd = sys::pidfd_open(f.pid)
            .map_err(|e| format!("a pidfd for the process spawner (pid {}): {e}", f.pid))?;
        sys::set_timeouts(f.sock.as_raw_fd(), ANSWER_WITHIN)
            .map_err(|e| format!("timeouts on the process spawner's socket: {e}"))?;
        let s = Arc::new(Spawner {
            sock: Mutex::new(f.sock),
            pid: f.pid,
            pidfd,
            gone: OnceLock::new(),
        });
        let me = s.clone();
        tokio::spawn(async move {
            let x = wait_pidfd(&me.pidfd).await;
            let why = match x {
                Ok(x) => format!("it ended with status {}", x.shell_status()),
                Err(e) => format!("waiting for it failed: {e}"),
            };
            error!(spawner.pid = me.pid, reason = %why, "the daemon's process spawner is gone: daemon-owned sessions cannot start and Exec cannot run until the daemon restarts");
            let _ = me.gone.set(why);
        });
        Ok(s)
    }

    /// The spawner's pid.
    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    fn gone_status(&self, why: &str) -> Status {
        Status::internal(format!(
            "the daemon's process spawner (pid {}) is gone ({why}): daemon-owned sessions cannot start and Exec cannot run until the daemon is restarted (its log has the reason)",
            self.pid
        ))
    }

    /// Sends `req` and waits for the reply: the pid of the child the
    /// spawner cloned (a child of this daemon) and the descriptors that came
    /// with it. Blocks the calling thread for the round trip (a clone of a
    /// small process). `what` names the child for errors.
    pub fn spawn(&self, what: &str, req: &Request) -> Result<(i32, Vec<OwnedFd>), Status> {
        if let Some(why) = self.gone.get() {
            return Err(self.gone_status(why));
        }
        let r = {
            let sock = self.sock.lock().unwrap_or_else(|p| p.into_inner());
            spawner::round_trip(sock.as_raw_fd(), req)
        };
        match r {
            Ok((Ok(pid), fds)) => Ok((pid, fds)),
            Ok((Err(e), _)) => Err(io_status(&format!("cannot start {what}"), &e)),
            Err(e) => {
                let why = if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) {
                    // A stuck spawner would hold every later request: end it.
                    let _ = sys::pidfd_kill(&self.pidfd, libc::SIGKILL);
                    format!(
                        "it did not answer within {} s and was killed",
                        ANSWER_WITHIN.as_secs()
                    )
                } else {
                    format!("its socket: {e}")
                };
                error!(spawner.pid = self.pid, reason = %why, "the daemon's process spawner failed");
                let _ = self.gone.set(why);
                Err(self.gone_status(self.gone.get().map_or("", String::as_str)))
            }
        }
    }
}
