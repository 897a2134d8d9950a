//! Crash recovery and containerd's `Cleanup`: one sweep (ARCHITECTURE.md §8).
//!
//! At start ([`SweepMode::Startup`], nothing else runs yet): staged publishes that
//! never committed are dropped (their sessions publish again), committed publishes
//! whose rename did not happen are rolled forward, sessions in a run whose
//! directories a crash kept from being made get them, and directories without a row
//! are removed — every entry of `staging/` (merged files, squashes and imported
//! bases being built, trees let go of: none has a row) and an `l/<n>` renamed
//! in by a squash or a base import whose transaction never committed. On
//! containerd's `Cleanup` ([`SweepMode::Cleanup`], while the daemon
//! serves) only directories without a row go, and never one an operation in
//! flight registered ([`crate::InFlight`]): its row may not be committed yet.
//!
//! No directory tree is removed inside a transaction: the candidates are found
//! first (directory listing, then the in-flight set, then the rows in one read
//! transaction — in that order, so a directory created concurrently is either
//! in flight or already has its row), and removed after.

use std::collections::HashSet;
use std::path::PathBuf;

use tracing::warn;

use crate::db::Cached;
use crate::error::StoreError;
use crate::{fs, LayerKind, Store};

/// What a sweep did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SweepReport {
    /// Directories removed because no row references them.
    pub removed: Vec<PathBuf>,
    /// Rows whose directory is missing (reported, not repaired).
    pub missing: Vec<PathBuf>,
    /// Published layers whose directory was moved into place after a crash.
    pub rolled_forward: Vec<PathBuf>,
    /// Staged publishes dropped because they never committed.
    pub dropped_staged: usize,
    /// Export leases released (their exports died with the last daemon).
    pub released_exports: usize,
    /// Sessions in a run whose directories were made (their start was
    /// interrupted between its transaction and making them).
    pub readied: Vec<i64>,
    /// [`SweepMode::Check`]: directories a cleanup would remove.
    pub would_remove: Vec<PathBuf>,
}

/// When a sweep runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepMode {
    /// At open, before anything else uses the store.
    Startup,
    /// While serving (containerd's `Cleanup`).
    Cleanup,
    /// As `Cleanup`, but only reports what it would remove (`fsck`).
    Check,
}

impl Store {
    /// The startup sweep (see the module docs).
    pub fn sweep(&self) -> Result<SweepReport, StoreError> {
        self.sweep_with(SweepMode::Startup)
    }

    /// Sweep in `mode` (see the module docs).
    pub fn sweep_with(&self, mode: SweepMode) -> Result<SweepReport, StoreError> {
        let mut report = SweepReport::default();
        if mode == SweepMode::Startup {
            self.recover(&mut report)?;
            report.released_exports = self.release_stale_exports()?;
        }
        // 1. What is on disk.
        let mut on_disk: Vec<(String, PathBuf)> = Vec::new();
        for sub in ["l", "w", "s", "staging"] {
            let dir = self.root.join(sub);
            let rd = match std::fs::read_dir(&dir) {
                Ok(rd) => rd,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(StoreError::io(&dir, e)),
            };
            for e in rd {
                let e = e.map_err(|e| StoreError::io(&dir, e))?;
                let name = e.file_name().to_string_lossy().into_owned();
                on_disk.push((format!("{sub}/{name}"), e.path()));
            }
        }
        // 2. What is in flight.
        let inflight = self.inflight.snapshot();
        // 3. What the rows keep.
        let keep = self.db.read(|conn| {
            let mut keep: HashSet<String> = HashSet::new();
            let mut missing = Vec::new();
            let mut stmt = conn.prepare_cached("SELECT id, path, kind, dropped FROM layers")?;
            let rows = stmt.query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, i64>(3)? != 0,
                ))
            })?;
            for r in rows {
                let (id, path, kind, dropped) = r?;
                if dropped {
                    // Freed by GC; the row only keeps a squash's path index.
                    continue;
                }
                let kind = LayerKind::parse(&kind)
                    .ok_or_else(|| StoreError::corrupt("layers", id, format!("kind {kind:?}")))?;
                if kind == LayerKind::Active {
                    keep.insert(format!("w/{id}"));
                }
                if kind == LayerKind::Pending {
                    continue;
                }
                if let Some(rest) = path.strip_prefix("s/") {
                    // A committed session's upper is a layer: keep its session dir.
                    if let Some((sid, _)) = rest.split_once('/') {
                        keep.insert(format!("s/{sid}"));
                    }
                } else if !self.root.join(&path).exists() {
                    missing.push(self.root.join(&path));
                }
                keep.insert(path);
            }
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT id FROM sessions WHERE {}",
                crate::sessions::KEEPS_DIRS
            ))?;
            for id in stmt.query_map([], |r| r.get::<_, i64>(0))? {
                keep.insert(format!("s/{}", id?));
            }
            Ok((keep, missing))
        })?;
        let (keep, missing) = keep;
        report.missing = missing;
        // 4. Remove the rest, outside any transaction.
        for (rel, path) in on_disk {
            if keep.contains(&rel) || inflight.contains(&rel) {
                continue;
            }
            if mode != SweepMode::Startup && rel.starts_with("staging/") {
                // Staging entries belong to operations in flight; they register
                // themselves, but a leftover from before the start is removed by
                // the startup sweep only.
                continue;
            }
            if mode == SweepMode::Check {
                report.would_remove.push(path);
                continue;
            }
            match fs::remove_tree(&path) {
                Ok(()) => {
                    report.removed.push(path);
                    crate::failpoints::hit("sweep.removed");
                }
                Err(e) => {
                    warn!(path = %path.display(), error = %e, "sweep cannot remove directory; will retry")
                }
            }
        }
        Ok(report)
    }

    /// Startup only: drop staged publishes (moving an upper already renamed
    /// into its layer directory back), roll committed ones forward (stores of an
    /// earlier build renamed after the commit).
    fn recover(&self, report: &mut SweepReport) -> Result<(), StoreError> {
        let pending: Vec<(i64, i64)> = self.db.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT id, session_id FROM layers WHERE kind = 'pending' AND session_id IS NOT NULL",
            )?;
            let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
            Ok(rows.collect::<Result<_, _>>()?)
        })?;
        for (layer, sid) in pending {
            let dir = self.layer_path(layer);
            if std::fs::symlink_metadata(&dir).is_err() {
                continue;
            }
            let upper = self.upper_path(sid);
            if let Ok(mut d) = std::fs::read_dir(&upper) {
                if d.next().is_none() {
                    std::fs::remove_dir(&upper).map_err(|e| StoreError::io(&upper, e))?;
                }
            }
            std::fs::rename(&dir, &upper).map_err(|e| StoreError::io(&dir, e))?;
            crate::failpoints::hit("sweep.restored");
            warn!(
                layer.id = layer,
                session.id = sid,
                "moved the upper of a publish interrupted before its commit back to its session"
            );
        }
        report.dropped_staged = self.db.write(|tx| {
            let n = tx.exec(
                "DELETE FROM layer_paths WHERE layer_id IN (SELECT id FROM layers WHERE kind = 'pending')",
                [],
            )?;
            let _ = n;
            tx.exec(
                "DELETE FROM publish_paths WHERE publish_id IN (SELECT id FROM publishes WHERE outcome = 'pending')",
                [],
            )?;
            tx.exec("DELETE FROM publishes WHERE outcome = 'pending'", [])?;
            Ok(tx.exec("DELETE FROM layers WHERE kind = 'pending'", [])?)
        })?;
        crate::failpoints::hit("sweep.staged_dropped");
        // Sessions in a run whose directories a crash kept from being made
        // (between the transaction that started the run and `ready_run`): made
        // now, as their next mount would — a session holding a lease always has
        // its upper (what `fsck` checks).
        let bare: Vec<i64> = self.db.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT id FROM sessions WHERE released = 0 AND lease_id IS NOT NULL",
            )?;
            let rows = stmt.query_map([], |r| r.get(0))?;
            Ok(rows.collect::<Result<_, _>>()?)
        })?;
        for sid in bare {
            if std::fs::symlink_metadata(self.upper_path(sid)).is_ok() {
                continue;
            }
            if let Err(e) = self.session_mount(sid) {
                // A full disk must not keep the daemon from starting (fsck
                // names the session; its next mount makes them).
                warn!(session.id = sid, error = %e, "cannot make the directories of a session whose start was interrupted by a crash; its next mount makes them");
                continue;
            }
            warn!(
                session.id = sid,
                "made the directories of a session whose start was interrupted by a crash"
            );
            report.readied.push(sid);
        }
        let candidates: Vec<(i64, String, i64)> = self.db.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT id, path, session_id FROM layers WHERE kind = 'published' AND session_id IS NOT NULL",
            )?;
            let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
            Ok(rows.collect::<Result<_, _>>()?)
        })?;
        for (id, path, sid) in candidates {
            let dst = self.root.join(&path);
            let upper = self.upper_path(sid);
            if dst.exists() || !upper.exists() {
                continue;
            }
            std::fs::rename(&upper, &dst).map_err(|e| StoreError::io(&upper, e))?;
            fs::fsync_dir(&self.root.join("l")).map_err(|e| StoreError::io(&dst, e))?;
            warn!(
                layer.id = id,
                session.id = sid,
                "rolled forward a publish interrupted by a crash"
            );
            report.rolled_forward.push(dst);
            if let Err(e) = self.make_session_dirs(sid) {
                warn!(session.id = sid, error = %e, "cannot recreate the session's upper");
            }
        }
        Ok(())
    }
}
