//! Ready inits: inits of daemon-owned sessions cloned ahead of the sessions
//! that will use them (`[sandbox] ready_inits`), so that `CreateSession` does
//! not wait for the clone into new namespaces — its most expensive step after
//! the store transaction (a new network namespace alone is hundreds of µs).
//!
//! ```text
//! refill task   spawner ready_request: clone(NEWNS|NEWPID|NEWIPC|NEWUTS|NEWNET)
//!               init: fds closed, PR_SET_PDEATHSIG, / private, lo up, then
//!               blocks on its claim socket (SOCK_SEQPACKET)
//! CreateSession (root mode, no network, no limit, no id map): take one,
//!               send the hostname + the detached overlay (spawner::claim);
//!               init attaches it, mounts /proc, /dev…, pivot_root, writes
//!               its ready byte — the rest as any daemon-owned session
//! ```
//!
//! A ready init is no session: no store row, nothing mounted, no cgroup.
//! It dies with the daemon (parent-death signal) and when the pool lets it
//! go (end of file on its socket: it exits 0). One that died unclaimed is
//! reaped when the pool finds it. The refill waits until the process
//! spawner has been idle for [`QUIET`]: a refill never makes a session's
//! Exec wait for the spawner.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use layerstack_sandbox::spawner;
use layerstack_sandbox::sys;
use tracing::{debug, warn};

use crate::sandbox::Holders;

/// How long the spawner must have been idle before the pool asks it for a
/// ready init.
const QUIET: Duration = Duration::from_millis(3);

/// After a refill failed, the pool tries again this much later.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// An init made ahead, waiting for its session.
pub(crate) struct ReadyInit {
    pub pid: i32,
    pub pidfd: OwnedFd,
    /// Where [`spawner::claim`] sends the session's hostname and overlay.
    pub claim: OwnedFd,
    /// Init's ready pipe (one byte once the session is set up).
    pub ready: OwnedFd,
    /// The pool's watch of it ([`ReadyInits::watch`]), ended when it
    /// leaves the pool: a session's init is watched by its session.
    watch: Option<tokio::task::AbortHandle>,
}

/// The pool (see the module docs).
pub(crate) struct ReadyInits {
    /// How many to keep (`[sandbox] ready_inits`; 0: none).
    want: std::sync::atomic::AtomicUsize,
    items: Mutex<Vec<ReadyInit>>,
    wake: tokio::sync::Notify,
    /// `layerstack_sandbox_ready_inits`, when the daemon serves metrics.
    gauge: std::sync::OnceLock<prometheus_client::metrics::gauge::Gauge>,
}

impl ReadyInits {
    /// An empty pool that keeps none until [`ReadyInits::set_want`].
    pub(crate) fn new() -> Arc<ReadyInits> {
        Arc::new(ReadyInits {
            want: std::sync::atomic::AtomicUsize::new(0),
            items: Mutex::new(Vec::new()),
            wake: tokio::sync::Notify::new(),
            gauge: std::sync::OnceLock::new(),
        })
    }

    /// Keep `n` ready inits (0: none, [`ReadyInits::take`] then never
    /// answers one). Set before [`ReadyInits::start`].
    pub(crate) fn set_want(&self, n: usize) {
        self.want.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Reports the pool's size on `g` from now on.
    pub(crate) fn set_gauge(&self, g: prometheus_client::metrics::gauge::Gauge) {
        let _ = self.gauge.set(g);
    }

    fn counted(&self, n: usize) {
        if let Some(g) = self.gauge.get() {
            g.set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    fn want(&self) -> usize {
        self.want.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Ready inits waiting now.
    pub(crate) fn len(&self) -> usize {
        self.items.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// A live ready init, if one waits; the pool refills behind it. Dead
    /// ones met on the way are reaped and dropped.
    pub(crate) fn take(&self) -> Option<ReadyInit> {
        let mut popped = false;
        let got = loop {
            let r = {
                let mut items = self.items.lock().unwrap_or_else(|p| p.into_inner());
                let r = items.pop();
                self.counted(items.len());
                r
            };
            let Some(mut r) = r else { break None };
            popped = true;
            if let Some(w) = r.watch.take() {
                w.abort();
            }
            if sys::pidfd_exited(&r.pidfd) {
                let _ = sys::reap_pidfd(&r.pidfd);
                warn!(init = r.pid, "a ready init died unclaimed: dropped");
                continue;
            }
            break Some(r);
        };
        // Whatever left the pool, live or dead, the refill replaces.
        if popped {
            self.wake.notify_one();
        }
        got
    }

    /// Starts the task that keeps the pool full, with the process spawner
    /// of `holders`. Call once, in the runtime.
    pub(crate) fn start(self: &Arc<Self>, holders: Arc<Holders>) {
        if self.want() == 0 {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                while me.len() < me.want() {
                    match me.make_one(&holders).await {
                        Ok(mut r) => {
                            debug!(init = r.pid, "ready init made");
                            r.watch = Some(me.watch(&r));
                            let mut items = me.items.lock().unwrap_or_else(|p| p.into_inner());
                            items.push(r);
                            me.counted(items.len());
                        }
                        Err(e) => {
                            warn!(error = %e, "cannot make a ready init (CreateSession clones its init itself meanwhile); retrying in 1 s");
                            tokio::time::sleep(RETRY_AFTER).await;
                        }
                    }
                }
                me.wake.notified().await;
            }
        });
    }

    /// Watches pooled init `r`: one that dies while it waits (killed) is
    /// reaped and replaced at once, not when a create next meets it — a
    /// pool of dead inits would make every create clone its own, and a
    /// dying one a create claims is replaced by the create itself
    /// (`owned::create`).
    fn watch(self: &Arc<Self>, r: &ReadyInit) -> tokio::task::AbortHandle {
        let fd = r.pidfd.try_clone();
        let (me, pid) = (self.clone(), r.pid);
        tokio::spawn(async move {
            let Ok(fd) = fd else { return };
            if super::exited(&fd).await.is_err() {
                return;
            }
            let dead = {
                let mut items = me.items.lock().unwrap_or_else(|p| p.into_inner());
                let i = items.iter().position(|x| x.pid == pid);
                let dead = i.map(|i| items.remove(i));
                me.counted(items.len());
                dead
            };
            // Still pooled: no session has it, so nothing else reaps it.
            if let Some(d) = dead {
                let _ = sys::reap_pidfd(&d.pidfd);
                warn!(init = pid, "a ready init died unclaimed: replaced");
                me.wake.notify_one();
            }
        })
        .abort_handle()
    }

    async fn make_one(&self, holders: &Arc<Holders>) -> Result<ReadyInit, String> {
        let sp = super::spawner(holders).map_err(|s| s.message().to_string())?;
        loop {
            let idle = sp.idle_for();
            if idle >= QUIET {
                break;
            }
            tokio::time::sleep(QUIET - idle).await;
        }
        let req = spawner::ready_request(true).map_err(|e| e.to_string())?;
        let (pid, fds) = tokio::task::spawn_blocking(move || sp.spawn("a ready init", &req))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|s| s.message().to_string())?;
        let pidfd = match sys::pidfd_open(pid) {
            Ok(p) => p,
            Err(e) => {
                sys::kill(pid, libc::SIGKILL);
                return Err(format!("a pidfd for ready init {pid}: {e}"));
            }
        };
        let mut fds = fds.into_iter();
        match (fds.next(), fds.next()) {
            (Some(ready), Some(claim)) => Ok(ReadyInit {
                pid,
                pidfd,
                claim,
                ready,
                watch: None,
            }),
            _ => {
                let _ = sys::pidfd_kill(&pidfd, libc::SIGKILL);
                let _ = super::wait_pidfd(&pidfd).await;
                Err("the process spawner answered a ready init without its descriptors".into())
            }
        }
    }
}

impl ReadyInit {
    /// Hands this init its session: `hostname` and the detached overlay
    /// `mount_fd` ([`spawner::claim`]). Errors: it is gone (it is then
    /// reaped here).
    pub(crate) fn claim(&self, hostname: &[u8], mount_fd: &OwnedFd) -> std::io::Result<()> {
        let r = spawner::claim(self.claim.as_raw_fd(), hostname, mount_fd.as_raw_fd());
        if r.is_err() {
            let _ = sys::pidfd_kill(&self.pidfd, libc::SIGKILL);
        }
        r
    }
}
