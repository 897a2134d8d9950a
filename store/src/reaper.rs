//! Removing directory trees off the paths that wait for an answer.
//!
//! A tree the store no longer needs (a closed session's directory, a session's
//! old workdir and upper) is first renamed into `staging/` — one `rename(2)`,
//! so its path is free at once and a crash leaves it where the startup sweep
//! removes it (ARCHITECTURE.md §8: delete after the DB commit, outside it) —
//! and then removed by the store's reaper thread.
//!
//! Why not remove it right away: freeing a directory's blocks on ext4 mounted
//! with `discard` (common on cloud VMs, and on the machine the benchmarks ran
//! on) waits for the device to discard them — `ext4_free_blocks` →
//! `blkdev_issue_discard` → `submit_bio_wait`, 0.1–1 ms per directory — and a
//! session's end removes four directories (its own, `upper`, `work`,
//! `work/work`), on the path of a publish's fresh upper and of every Mode B
//! session's close.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tracing::warn;

use crate::fs;

/// Trees waiting for the reaper thread, and the thread's queue.
pub(crate) struct Reaper {
    queue: Mutex<Option<mpsc::Sender<PathBuf>>>,
    pending: Arc<(Mutex<usize>, Condvar)>,
    staging: PathBuf,
    next: AtomicU64,
}

impl Reaper {
    /// A reaper moving trees into `staging` (the store's `staging/`). The
    /// thread starts with the first tree.
    pub(crate) fn new(staging: PathBuf) -> Reaper {
        Reaper {
            queue: Mutex::new(None),
            pending: Arc::new((Mutex::new(0), Condvar::new())),
            staging,
            next: AtomicU64::new(0),
        }
    }

    /// Takes `path` (a directory tree, or a file) out of the store's view now
    /// and removes it in the background. A missing `path` is nothing to do. If
    /// it cannot be moved into staging, or no reaper thread runs, it is
    /// removed here; a failure is logged (the startup sweep retries).
    pub(crate) fn drop_tree(&self, path: &Path, what: &str) {
        if std::fs::symlink_metadata(path).is_err() {
            return;
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let target = self
            .staging
            .join(format!("reap-{}-{n}-{what}", std::process::id()));
        match std::fs::rename(path, &target) {
            Ok(()) => crate::failpoints::hit("reap.staged"),
            Err(e) => {
                warn!(path = %path.display(), error = %e, "cannot move a directory into staging; removing it in place");
                remove(path);
                return;
            }
        }
        {
            let (count, _) = &*self.pending;
            *count.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        }
        if let Err(mpsc::SendError(target)) = self.sender().send(target) {
            remove(&target);
            self.done();
        }
    }

    /// Waits until every tree handed over so far is removed, at most `within`.
    /// Returns whether the queue is empty (accounting that compares with `du`
    /// waits for it).
    pub(crate) fn settle(&self, within: Duration) -> bool {
        let (count, cvar) = &*self.pending;
        let g = count.lock().unwrap_or_else(|p| p.into_inner());
        let (g, _) = cvar
            .wait_timeout_while(g, within, |n| *n > 0)
            .unwrap_or_else(|p| p.into_inner());
        *g == 0
    }

    fn done(&self) {
        let (count, cvar) = &*self.pending;
        let mut n = count.lock().unwrap_or_else(|p| p.into_inner());
        *n = n.saturating_sub(1);
        if *n == 0 {
            cvar.notify_all();
        }
    }

    /// The queue of the reaper thread, started on first use.
    fn sender(&self) -> mpsc::Sender<PathBuf> {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = q.as_ref() {
            return tx.clone();
        }
        let (tx, rx) = mpsc::channel::<PathBuf>();
        let pending = self.pending.clone();
        let started = std::thread::Builder::new()
            .name("store-reaper".into())
            .spawn(move || {
                // Behind everything that waits for an answer: a removal can wait.
                crate::priority::background_thread();
                // Ends when the store (the sender) is dropped, after the queue.
                for path in rx {
                    remove(&path);
                    let (count, cvar) = &*pending;
                    let mut n = count.lock().unwrap_or_else(|p| p.into_inner());
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        cvar.notify_all();
                    }
                }
            });
        if let Err(e) = started {
            // The send below fails and `drop_tree` removes the tree itself.
            warn!(error = %e, "cannot start the store's reaper thread; trees are removed in place");
            let (dead, _) = mpsc::channel();
            return dead;
        }
        *q = Some(tx.clone());
        tx
    }
}

fn remove(path: &Path) {
    if let Err(e) = fs::remove_tree(path) {
        warn!(path = %path.display(), error = %e, "failed to remove a directory; the sweep at the next start will");
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_tree_leaves_its_path_at_once_and_is_removed_in_the_background() {
        let t = tempfile::tempdir().unwrap();
        let staging = t.path().join("staging");
        std::fs::create_dir(&staging).unwrap();
        let r = Reaper::new(staging.clone());
        for i in 0..20 {
            let d = t.path().join(format!("s{i}"));
            std::fs::create_dir_all(d.join("upper/a/b")).unwrap();
            std::fs::write(d.join("upper/a/b/f"), b"x").unwrap();
            r.drop_tree(&d, "session");
            assert!(!d.exists(), "the path is free at once");
        }
        // A missing path is nothing to do.
        r.drop_tree(&t.path().join("gone"), "session");
        assert!(r.settle(Duration::from_secs(10)));
        assert_eq!(std::fs::read_dir(&staging).unwrap().count(), 0);
    }

    #[test]
    fn without_a_staging_directory_a_tree_is_removed_in_place() {
        let t = tempfile::tempdir().unwrap();
        let r = Reaper::new(t.path().join("no-staging"));
        let d = t.path().join("s1");
        std::fs::create_dir_all(d.join("upper")).unwrap();
        r.drop_tree(&d, "session");
        assert!(!d.exists());
        assert!(r.settle(Duration::from_secs(1)));
    }
}
