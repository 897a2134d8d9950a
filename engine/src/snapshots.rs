//! The containerd Snapshots adapter's verbs (ARCHITECTURE.md §5): every snapshot
//! call the daemon serves to containerd goes through one of these, so a change
//! that ends a session (a `Commit` of an active session, a `Remove`) is the
//! engine's: its watchers are woken and its run ended by its exit policy.
//!
//! | containerd call | engine verb | waits for a publish? |
//! |---|---|---|
//! | `Prepare`, `View` | [`Engine::snapshot_prepare`] | never |
//! | `Commit` | [`Engine::snapshot_commit`] | never (an active session's run ends `discarded`; `wait` wakes) |
//! | `Remove` | [`Engine::snapshot_remove`] | never: a session is marked released and ended after its publish |
//! | `Cleanup` | [`Engine::snapshot_cleanup`] | never (in-flight directories are kept) |
//! | `Mounts` | [`Engine::snapshot_session_lock`] then [`Engine::snapshot_mounts`] | yes: a restart never mounts an upper being captured |
//! | `Stat`, `Update`, `Usage`, `List`/`Walk` | reads and a label update | never |
//!
//! containerd's GC holds its metadata lock across a proxy `Remove`
//! (containerd#13798 wedged whole nodes that way): nothing here that serves
//! `Prepare`, `Remove` or `Cleanup` takes a session lock or a branch's gate.

use std::collections::BTreeMap;

use layerstack_store::{
    snapshots::Removed, MountSpec, SessionId, SessionInfo, SnapshotInfo, SweepMode, SweepReport,
};
use tracing::debug;

use crate::{Engine, EngineError, LockGuard};

impl Engine {
    /// containerd `Stat`. Error: `SnapshotNotFound`.
    pub async fn snapshot_stat(&self, key: String) -> Result<SnapshotInfo, EngineError> {
        self.blocking(move |s| s.stat(&key)).await
    }

    /// containerd `Update`: sets `labels` (only `fieldpaths`' labels when given,
    /// containerd's `labels.<name>` field paths). Error: `SnapshotNotFound`.
    pub async fn snapshot_update(
        &self,
        key: String,
        labels: BTreeMap<String, String>,
        fieldpaths: Vec<String>,
    ) -> Result<SnapshotInfo, EngineError> {
        self.blocking(move |s| s.update_labels(&key, labels, &fieldpaths))
            .await
    }

    /// containerd `Usage`: (bytes, inodes) allocated by the snapshot's own
    /// directory. Error: `SnapshotNotFound`.
    pub async fn snapshot_usage(&self, key: String) -> Result<(i64, i64), EngineError> {
        self.blocking(move |s| s.usage(&key)).await
    }

    /// containerd `List` (the caller applies `Walk`'s filters).
    pub async fn snapshot_list(&self) -> Result<Vec<SnapshotInfo>, EngineError> {
        self.blocking(|s| s.list()).await
    }

    /// containerd `Prepare` (`view = false`) or `View`: the mount spec of the new
    /// snapshot. Never waits for a publish. Errors: `SnapshotExists`,
    /// `SnapshotNotFound` (parent), `InvalidArgument`.
    pub async fn snapshot_prepare(
        &self,
        key: String,
        parent: String,
        labels: BTreeMap<String, String>,
        view: bool,
    ) -> Result<MountSpec, EngineError> {
        let (_, spec) = self
            .blocking(move |s| s.prepare(&key, &parent, labels, view))
            .await?;
        Ok(spec)
    }

    /// containerd `Commit(name, key)`. Committing an active session freezes what it
    /// saw and ends its run `discarded` (not published): [`Engine::wait`] callers
    /// and [`Engine::subscribe`]rs learn it like any other outcome.
    /// Errors: `SnapshotNotFound`, `SnapshotExists`, `FailedPrecondition`.
    pub async fn snapshot_commit(
        &self,
        name: String,
        key: String,
        labels: BTreeMap<String, String>,
    ) -> Result<(), EngineError> {
        let ended = self
            .blocking(move |s| s.commit(&name, &key, labels))
            .await?;
        if let Some(sid) = ended {
            let s = self.session(sid).await?;
            debug!(
                session.id = sid,
                "run ended by containerd's commit of its snapshot"
            );
            self.notify(&s);
        }
        Ok(())
    }

    /// containerd `Remove`. Returns at once: a session's snapshot is marked
    /// released and the engine ends its run by its exit policy after any publish
    /// in flight ([`Engine::session_released`]).
    ///
    /// Errors: `FailedPrecondition` while the session's upper is mounted (`ctr
    /// snapshots rm` of a running container: containerd's GC retries after the
    /// task is gone) or while children exist; `SnapshotNotFound`.
    pub async fn snapshot_remove(
        self: &std::sync::Arc<Self>,
        key: String,
    ) -> Result<(), EngineError> {
        let k = key.clone();
        if let Some(sid) = self.blocking(move |s| s.snapshot_session(&k)).await? {
            let upper = self.store.upper_path(sid);
            if self.upper_mounted(&upper).await? {
                return Err(EngineError::SnapshotMounted {
                    key,
                    session: sid,
                    upper,
                });
            }
        }
        match self.blocking(move |s| s.remove(&key)).await? {
            Removed::Session(sid) => self.session_released(sid),
            Removed::Plain => {}
        }
        Ok(())
    }

    /// containerd `Cleanup`: removes directories with no row and no in-flight
    /// owner (never a running publish's or squash's).
    pub async fn snapshot_cleanup(&self) -> Result<SweepReport, EngineError> {
        self.blocking(|s| s.sweep_with(SweepMode::Cleanup)).await
    }

    /// For containerd `Mounts`: the session behind snapshot `key`, if any, with
    /// its lock held (a restart of the container never mounts an upper that a
    /// publish of the previous run is capturing or renaming).
    pub async fn snapshot_session_lock(
        &self,
        key: String,
    ) -> Result<Option<(SessionInfo, LockGuard<SessionId>)>, EngineError> {
        let Some(sid) = self.blocking(move |s| s.snapshot_session(&key)).await? else {
            return Ok(None);
        };
        let g = self.lock_session(sid).await;
        let s = self.session(sid).await?;
        Ok(Some((s, g)))
    }

    /// containerd `Mounts`: the mount spec of snapshot `key` (a session's lease
    /// is renewed on its branch's head when its previous run ended).
    /// Error: `SnapshotNotFound`.
    pub async fn snapshot_mounts(&self, key: String) -> Result<MountSpec, EngineError> {
        self.blocking(move |s| s.mounts(&key)).await
    }

    /// The branch snapshot label (`containerd.io/snapshot/layerstack.branch`) of
    /// session `id`'s snapshot, if it has one: it pins the session's branch.
    pub async fn snapshot_branch_label(
        &self,
        id: SessionId,
    ) -> Result<Option<String>, EngineError> {
        self.blocking(move |s| s.snapshot_branch_label(id)).await
    }

    /// Re-points session `id`, whose current run was never mounted, to `branch`
    /// (a new branch forks the default one), under its session lock: the one
    /// rebranch every front end uses (admin `SetBranch`, the shim, the
    /// container label read at `Mounts`). A snapshot label naming a branch wins:
    /// the session is left where it is (`changed = false`).
    ///
    /// Errors: [`EngineError::Mounted`] when its upper is mounted anywhere;
    /// `FailedPrecondition` when the run has an outcome, holds no lease, was
    /// released or its upper is not empty; `InvalidArgument` (branch name).
    pub async fn rebranch(
        &self,
        id: SessionId,
        branch: String,
    ) -> Result<(SessionInfo, MountSpec, bool), EngineError> {
        let _g = self.lock_session(id).await;
        self.rebranch_locked(id, branch).await
    }

    /// [`Engine::rebranch`] for a caller that holds session `id`'s lock.
    pub async fn rebranch_locked(
        &self,
        id: SessionId,
        branch: String,
    ) -> Result<(SessionInfo, MountSpec, bool), EngineError> {
        let s = self.session(id).await?;
        self.ensure_quiescent(&s).await?;
        self.blocking(move |st| {
            let pinned = st.snapshot_branch_label(id)?.is_some();
            st.rebranch_session(id, &branch, pinned)
        })
        .await
    }
}
