//! The threads that run a publish's commit under its branch's gate.
//!
//! Every other publish of the branch waits for that commit, so it should not
//! wait for a CPU either. A commit sent to tokio's blocking pool starts on a
//! thread at the default priority that must first be scheduled (measured under
//! a 1,024-publish burst on 2 cores: 10 % of commits spent 2–3 ms there before
//! their first read). These threads are started once and wait at
//! [`Priority::gate_holder`](layerstack_store::priority::Priority::gate_holder) priority (nice −5), so the kernel
//! runs one as soon as a commit is handed to it.

use std::panic::AssertUnwindSafe;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use tracing::warn;

type Job = Box<dyn FnOnce() + Send>;

/// A fixed set of commit threads (see the module docs).
pub(crate) struct Committers {
    jobs: Mutex<mpsc::Sender<Job>>,
}

impl Committers {
    /// Starts `n` (at least one) commit threads. They end when the engine is
    /// dropped (the channel closes).
    pub(crate) fn start(n: usize) -> Committers {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..n.max(1) {
            let rx = rx.clone();
            let started = std::thread::Builder::new()
                .name(format!("ls-commit-{i}"))
                .spawn(move || {
                    let _p = crate::publish::Priority::gate_holder();
                    loop {
                        let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                        let Ok(job) = job else { return };
                        // A panicking commit reaches its caller as a closed
                        // reply; the thread stays.
                        let _ = std::panic::catch_unwind(AssertUnwindSafe(job));
                    }
                });
            if let Err(e) = started {
                warn!(error = %e, "cannot start a commit thread");
            }
        }
        Committers {
            jobs: Mutex::new(tx),
        }
    }

    /// Runs `f` on a commit thread and returns its result.
    ///
    /// Errors: [`CommitFailed`] when `f` panicked or no thread runs.
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, CommitFailed> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(f());
        });
        self.jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(job)
            .map_err(|_| CommitFailed::NoThread)?;
        rx.await.map_err(|_| CommitFailed::Panicked)
    }
}

/// A commit that did not run to its end on a commit thread.
#[derive(Debug, thiserror::Error)]
pub enum CommitFailed {
    #[error("the commit panicked (a bug: the daemon log has its message); the session's outcome shows whether it landed")]
    Panicked,
    #[error("no commit thread runs (the daemon could not start one); nothing was published")]
    NoThread,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_commit_runs_on_a_commit_thread_and_a_panic_is_an_error() {
        let c = Committers::start(1);
        let name = c
            .run(|| std::thread::current().name().map(str::to_string))
            .await
            .unwrap();
        assert_eq!(name.as_deref(), Some("ls-commit-0"));
        let e = c.run(|| -> () { panic!("boom") }).await.unwrap_err();
        assert!(matches!(e, CommitFailed::Panicked), "{e}");
        // The thread survived its job's panic.
        assert_eq!(c.run(|| 7).await.unwrap(), 7);
    }
}
