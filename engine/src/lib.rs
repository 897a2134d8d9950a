//! LayerStack's engine: the one path every front end takes to create sessions,
//! publish, dry-run, discard and end them (ARCHITECTURE.md §4). The containerd
//! Snapshots adapter, the admin API, the event watcher, the runtime shim (through
//! the admin API) and the Mode B runner are thin callers of an [`Engine`].
//!
//! It joins the store (history model, SQLite) and the publisher (capture, gate,
//! merge) and adds what neither has alone:
//!
//! * **The publish protocol** ([`Engine::publish`]): capture, sealing and gate
//!   planning run side by side, outside any lock, against the branch head they
//!   observed; only the short step that re-checks the head, re-plans the paths
//!   that changed on it meanwhile, applies and commits is serialized — per
//!   (stack, branch), never per daemon. A publish asks the path index only about
//!   its own paths, so its cost is O(its paths + what the head changed at them),
//!   not O(everything published since its lease). The design record is
//!   `docs/architecture.md`, "Publish protocol".
//! * **Session locks** that order a publish, a discard, a mount and the end of a
//!   session, pruned when unused; containerd's `Remove` never waits on one.
//! * **Proof of quiescence** before a capture: the upper is no overlay's
//!   upperdir in any mount namespace (a census of `/proc`).
//! * **The outcome watch** ([`Engine::wait`], [`Engine::subscribe`]).
//! * **Base import** ([`Engine::import_base`]): a stack made from a directory,
//!   a layer tar or an OCI layout, content-addressed, with no containerd.
//!
//! No tonic, no TOML: front ends map [`EngineError::kind`] to their wire codes.
//!
//! ```no_run
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use layerstack_engine::{Engine, EngineSettings};
//! use layerstack_store::{Store, StoreOptions};
//! let store = Arc::new(Store::open("/var/lib/layerstack".as_ref(), &StoreOptions::default())?);
//! let engine = Engine::new(store, EngineSettings::default());
//! let s = engine.find("default", "c1").await?;
//! let s = engine.publish(s.id, "operator").await?;
//! println!("{:?}", s.outcome.map(|o| o.kind));
//! # Ok(()) }
//! ```

mod blame;
mod census;
mod committer;
mod conflicts;
mod diff;
mod error;
pub mod export;
mod graph;
mod history;
mod import;
mod index;
mod locks;
mod publish;
mod pull;
mod queries;
mod rollout;
mod sandbox;
mod snapshots;

use std::sync::Arc;
use std::time::Duration;

use layerstack_store::{
    LeaseTarget, MountSpec, OutcomeKind, Owner, SessionId, SessionInfo, Store, StoreError,
};
use tokio::sync::{broadcast, watch};
use tracing::{debug, info, warn};

pub use census::scan_upperdirs;
pub use error::{error_chain, EngineError, RunError};
pub use export::{write_layer_blob, Compression, Export, LayerBlob};
pub use graph::NodeMerged;
pub use history::{Collected, HistoryRuns, HistorySettings, Promoted};
pub use import::{tree_digest, BaseImported, ImportRequest};
pub use layerstack_types::IdMap;
pub use locks::LockMap;
pub use rollout::{rollout_session_key, RolloutKeep};
/// The publisher's types the engine's settings and answers use (not the
/// crate: front ends call the engine, never capture, plan or apply themselves).
pub mod publisher {
    pub use layerstack_publisher::{
        extract_tar_into, extract_tar_into_shifted, DiffAlgorithm, ExclusionRules, FileKind,
        ImportError, ImportKind, ImportReport, MergeOptions,
    };
}
/// The store's types the engine's verbs take and answer, and what a daemon
/// needs to open a store and give it to [`Engine::new`] (not the crate: front
/// ends never call the store; ARCHITECTURE.md §4).
pub mod store {
    pub use layerstack_store::{
        escape_path, fs, stack_id, validate_branch, validate_state, AttemptInfo, AttemptStatus,
        BranchInfo, ChangeKind, Durability, ErrorKind, ExportLayer, ExportSource, GraphDump,
        GroupInfo, LeaseTarget, LogEntry, MountSpec, NodeInfo, OutcomeKind, Owner, PathCounts,
        PathRecord, PathStatus, Provenance, PublishTimings, SessionId, SessionInfo, SessionState,
        SnapshotInfo, SnapshotKind, Store, StoreError, StoreLock, StoreOptions, Usage,
    };
    pub use layerstack_store::{
        AdoptGroup, AdoptNode, Adopted, AdoptedLayers, BlobCompression, BlobRef, LayerBlob,
        LayerId, NodeKind, READY_OWNER,
    };
    pub use layerstack_store::{
        Artifact, Begun, Evaluator, ExecRecord, NodeStats, RolloutAttempt, RolloutBegin,
        RolloutResult, RolloutStatus, RunAudit, RunInfo, SampleInfo, SampleKey,
        EXEC_RECORD_KEEP_BYTES,
    };
}
pub use layerstack_types as types;
/// The exit policy and its labels (defined in the vocabulary crate).
pub use layerstack_types::policy;
pub use locks::LockGuard;
pub use publish::{exit_decision, DryRun};
pub use pull::{Landed, PulledContent, PulledLayer};
pub use sandbox::{EndAction, Reservation, SandboxRequest, SandboxSettings, Writers};
// Blame, diff and conflicts (issue 10).
pub use blame::Blame;
pub use conflicts::{ConflictView, Rebased};
pub use diff::{Diff, DiffChange, DiffEntry, DiffTarget, EntryInfo};

/// Publish settings the engine applies to every session.
#[derive(Debug, Clone, Default)]
pub struct EngineSettings {
    /// Paths never published (globs; `/tmp/**` …).
    pub exclude: publisher::ExclusionRules,
    /// Limits of the three-way text merge.
    pub merge: publisher::MergeOptions,
    /// Sessions are mounted with `userxattr` (rootless).
    pub userxattr: bool,
    /// Squash, retention.
    pub history: HistorySettings,
    /// Mode B: the cap on live sandbox sessions.
    pub sandbox: SandboxSettings,
    /// Publishes prepared (captured, planned, staged) at once, outside the gate;
    /// 0: one per CPU (`std::thread::available_parallelism`).
    pub publish_workers: usize,
    /// Most entries a session's upper may hold to be captured (published,
    /// checkpointed, diffed); 0 = unlimited (`[capture] max_paths`).
    pub max_capture_paths: u64,
    /// Most bytes (apparent sizes of regular files) a session's upper may hold
    /// to be captured; 0 = unlimited (`[capture] max_bytes`).
    pub max_capture_bytes: u64,
}

impl EngineSettings {
    /// What capture of `session`'s upper uses: the daemon's settings and the
    /// session's own options ([`layerstack_store::SessionOptions`]).
    pub(crate) fn capture_options(
        &self,
        session: &SessionInfo,
    ) -> layerstack_publisher::CaptureOptions {
        layerstack_publisher::CaptureOptions {
            userxattr: self.userxattr,
            exclude: self.exclude.clone(),
            ignore_mtime: session.ignore_mtime,
            id_map: session.id_map,
            max_paths: self.max_capture_paths,
            max_bytes: self.max_capture_bytes,
            ..Default::default()
        }
    }
}

/// One recorded outcome, as [`Engine::subscribe`] delivers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutcomeEvent {
    pub session: SessionId,
    pub kind: OutcomeKind,
    /// Run of the session the outcome ended.
    pub run: i64,
}

/// See the crate docs.
pub struct Engine {
    store: Arc<Store>,
    settings: EngineSettings,
    sessions: locks::LockMap<SessionId>,
    /// Rollout attempts being ended ([`Engine::end_rollout`]): two ends of
    /// one attempt run one after the other — the second then answers as a
    /// repeat of the first, or is refused as another result.
    attempts: locks::LockMap<i64>,
    gates: locks::LockMap<(String, String)>,
    /// Permits to prepare a publish outside the gate ([`EngineSettings::publish_workers`]):
    /// a burst of N publishes keeps the CPUs busy without starving the one
    /// holding a gate (its hold is what every other publish of the branch waits on).
    preparing: Arc<tokio::sync::Semaphore>,
    /// The threads that run commits under a gate (`committer.rs`), as many as
    /// preparation workers.
    committers: committer::Committers,
    /// One squash per (stack, branch) at a time.
    squashes: locks::LockMap<(String, String)>,
    /// Manifests operations in flight read; GC keeps them.
    pins: Arc<history::Pins>,
    census: census::Census,
    /// Bumped after every recorded outcome (wakes [`Engine::wait`]).
    generation: watch::Sender<u64>,
    events: broadcast::Sender<OutcomeEvent>,
    /// Mode B: the cap and the permits of live sandbox sessions.
    sandboxes: sandbox::Sandboxes,
    /// Squash and GC runs since the engine started (metrics).
    runs: history::RunCounters,
    #[cfg(any(test, feature = "failpoints"))]
    pub(crate) failpoints: publish::Failpoints,
}

/// Runs blocking `f` on the caller's worker thread (`block_in_place`: no
/// hand-off to the blocking pool and back, each of which wakes an idle
/// vCPU — 0.1-0.35 ms on this machine, bench P7b), or on the blocking pool
/// in a single-thread runtime (tests), where `block_in_place` panics.
pub async fn here_or_pool<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, tokio::task::JoinError> {
    if tokio::runtime::Handle::current().runtime_flavor()
        == tokio::runtime::RuntimeFlavor::MultiThread
    {
        return Ok(tokio::task::block_in_place(f));
    }
    tokio::task::spawn_blocking(f).await
}

impl Engine {
    /// An engine over `store`.
    pub fn new(store: Arc<Store>, settings: EngineSettings) -> Arc<Engine> {
        let (generation, _) = watch::channel(0);
        let (events, _) = broadcast::channel(1024);
        let sandboxes = sandbox::Sandboxes::new(&settings.sandbox);
        let workers = match settings.publish_workers {
            0 => std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get),
            n => n,
        };
        Arc::new(Engine {
            store,
            settings,
            sessions: locks::LockMap::new(),
            attempts: locks::LockMap::new(),
            gates: locks::LockMap::new(),
            preparing: Arc::new(tokio::sync::Semaphore::new(workers)),
            committers: committer::Committers::start(workers),
            squashes: locks::LockMap::new(),
            pins: Arc::new(history::Pins::default()),
            census: census::Census::new(),
            generation,
            events,
            sandboxes,
            runs: history::RunCounters::default(),
            #[cfg(any(test, feature = "failpoints"))]
            failpoints: publish::Failpoints::default(),
        })
    }

    /// The store (the engine's own: front ends call the engine's verbs).
    pub(crate) fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// The settings.
    pub fn settings(&self) -> &EngineSettings {
        &self.settings
    }

    /// Outcomes as they are recorded. A slow receiver may miss some (the channel
    /// keeps the last 1,024); [`Engine::wait`] never misses one.
    pub fn subscribe(&self) -> broadcast::Receiver<OutcomeEvent> {
        self.events.subscribe()
    }

    /// Number of session locks alive (held or waited for): unused ones are pruned.
    pub fn live_session_locks(&self) -> usize {
        self.sessions.len()
    }

    /// Takes the lock of session `id`: held across a publish, a discard, a mount
    /// and the end of a session. Not reentrant: every engine verb on a session
    /// takes it itself, so a front end never holds it around a verb (it would
    /// wait for itself); only a front end's own step on the session (a holder's
    /// mount) is done under it.
    pub async fn lock_session(&self, id: SessionId) -> LockGuard<SessionId> {
        self.sessions.lock(id).await
    }

    /// Whether a publish (or another locked step) of session `id` runs now.
    pub fn session_busy(&self, id: SessionId) -> bool {
        self.sessions.is_locked(&id)
    }

    /// [`Engine::blocking`] for a short store step on a latency path (a
    /// ready session's claim, a WASI session's discard): run on this worker
    /// thread under `block_in_place` — no hand-off to the blocking pool and
    /// back, two thread wake-ups saved. Only on a multi-thread runtime (else
    /// as `blocking`).
    pub(crate) async fn blocking_here<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, EngineError> {
        // (Send + 'static: the single-thread fallback hands `f` to the pool.)
        let store = self.store.clone();
        here_or_pool(move || f(&store))
            .await
            .map_err(|e| EngineError::Join(e.to_string()))?
            .map_err(EngineError::from)
    }

    pub(crate) async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, EngineError> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(|e| EngineError::Join(e.to_string()))?
            .map_err(EngineError::from)
    }

    /// Wakes [`Engine::wait`] callers without announcing an outcome (a
    /// session's release).
    pub(crate) fn changed(&self) {
        self.generation.send_modify(|g| *g += 1);
    }

    pub(crate) fn notify(&self, session: &SessionInfo) {
        self.generation.send_modify(|g| *g += 1);
        if let Some(o) = &session.outcome {
            let _ = self.events.send(OutcomeEvent {
                session: session.id,
                kind: o.kind,
                run: session.run,
            });
        }
    }

    /// One session by id. Error: `SessionNotFound`.
    pub async fn session(&self, id: SessionId) -> Result<SessionInfo, EngineError> {
        self.blocking(move |s| s.session(id)).await
    }

    /// The newest session of container `container` in containerd namespace
    /// `namespace`. Error: [`EngineError::NoSession`].
    pub async fn find(&self, namespace: &str, container: &str) -> Result<SessionInfo, EngineError> {
        let (ns, c) = (namespace.to_string(), container.to_string());
        self.blocking(move |s| s.find_session(&ns, &c))
            .await?
            .ok_or_else(|| EngineError::NoSession {
                namespace: namespace.to_string(),
                container: container.to_string(),
            })
    }

    /// Whether `upper` is an overlay upperdir in any mount namespace now.
    pub async fn upper_mounted(&self, upper: &std::path::Path) -> Result<bool, EngineError> {
        self.census
            .is_mounted(upper)
            .await
            .map_err(|e| EngineError::Census(upper.to_path_buf(), e))
    }

    /// Whether the census can tell anything about `s`'s upper. A WASI
    /// session's upper is mounted by the daemon alone, detached (fsmount
    /// without move_mount: in no mount table, so no census sees it), and the
    /// daemon closes that mount before any end of the run
    /// (snapshotter/src/wasi.rs `release`; ends other than CloseSession are
    /// refused while it lives): a census of it would only cost its scan of
    /// every process (~1 ms, benchmark P11).
    fn census_applies(s: &SessionInfo) -> bool {
        !matches!(s.owner, Owner::Wasi { .. })
    }

    /// Errors unless `s`'s upper is unmounted everywhere
    /// ([`EngineError::Mounted`]); then, for a session with a uid/gid
    /// mapping, shifts its upper's ids back to the session's
    /// ([`sandbox::shift_back_ids`]) — what every capture of an upper
    /// (publish, checkpoint, rebase, dry run) passes through first.
    pub(crate) async fn ensure_quiescent(&self, s: &SessionInfo) -> Result<(), EngineError> {
        self.ensure_unmounted(s).await?;
        self.shift_back(s).await
    }

    /// [`EngineError::Mounted`] unless `s`'s upper is unmounted everywhere
    /// (what a discard needs: it reads nothing of the upper).
    pub(crate) async fn ensure_unmounted(&self, s: &SessionInfo) -> Result<(), EngineError> {
        if Self::census_applies(s) && self.upper_mounted(&s.upper).await? {
            return Err(EngineError::Mounted(s.id, s.upper.clone()));
        }
        Ok(())
    }

    /// [`sandbox::shift_back_ids`] of `s`'s upper when `s` has a mapping.
    async fn shift_back(&self, s: &SessionInfo) -> Result<(), EngineError> {
        let Some(map) = s.id_map else {
            return Ok(());
        };
        let (id, upper) = (s.id, s.upper.clone());
        tokio::task::spawn_blocking(move || match sandbox::shift_back_ids(&upper, &map) {
            Ok(n) => {
                if n > 0 {
                    debug!(session.id = id, entries = n, id_map = %map, "upper's ids shifted back to the session's");
                }
                Ok(())
            }
            // No upper (discarded before): nothing to shift.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(EngineError::Read(
                format!(
                    "session {id}'s upper {} (shifting its ids back from the host's, mapping {map})",
                    upper.display()
                ),
                e,
            )),
        })
        .await
        .map_err(|e| EngineError::Join(e.to_string()))?
    }

    /// Waits up to `within` for `s`'s upper to be unmounted in every mount
    /// namespace, polling the census (`sandbox::backoff`: 1 ms doubling to 100 ms).
    /// For callers that know the run has ended (its task was deleted, its holder
    /// is gone, its snapshot removed) but may look while another namespace still
    /// holds a transient copy of the mount: a `runc init` starting a sibling
    /// container clones the host's mount table, ours included, and drops it only
    /// when it detaches its old root, some milliseconds later.
    ///
    /// Errors: [`EngineError::Mounted`] when it is still mounted after `within`;
    /// [`EngineError::Census`].
    pub(crate) async fn settle_quiescent(
        &self,
        s: &SessionInfo,
        within: Duration,
    ) -> Result<(), EngineError> {
        let deadline = tokio::time::Instant::now() + within;
        let mut attempt = 0u32;
        loop {
            if !Self::census_applies(s) || !self.upper_mounted(&s.upper).await? {
                return self.shift_back(s).await;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(EngineError::Mounted(s.id, s.upper.clone()));
            }
            tokio::time::sleep(sandbox::backoff(attempt)).await;
            attempt += 1;
        }
    }

    /// Creates a session for `owner` on `stack`, leasing `target`; with
    /// `idempotency_key`, the same key returns the first call's session. Returns
    /// the session, its mount spec, and whether it was created now.
    ///
    /// Errors: `StackNotFound`, `InvalidArgument`, `FailedPrecondition`.
    pub async fn create_session(
        &self,
        owner: Owner,
        stack: &str,
        target: LeaseTarget,
        idempotency_key: Option<String>,
    ) -> Result<(SessionInfo, MountSpec, bool), EngineError> {
        let stack = stack.to_string();
        self.blocking(move |s| {
            s.create_session(&owner, &stack, &target, idempotency_key.as_deref())
        })
        .await
    }

    /// Waits until session `id`'s current run has an outcome, at most `timeout`
    /// (`None`: forever). Returns the session; `Ok(None)` on timeout.
    pub async fn wait(
        &self,
        id: SessionId,
        timeout: Option<Duration>,
    ) -> Result<Option<SessionInfo>, EngineError> {
        let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        let mut rx = self.generation.subscribe();
        loop {
            rx.borrow_and_update();
            let s = self.session(id).await?;
            if s.outcome.is_some() {
                return Ok(Some(s));
            }
            let changed = rx.changed();
            match deadline {
                Some(d) => {
                    if tokio::time::timeout_at(d, changed).await.is_err() {
                        return Ok(None);
                    }
                }
                None => {
                    let _ = changed.await;
                }
            }
        }
    }

    /// containerd removed session `id`'s snapshot (the store marked it released,
    /// [`layerstack_store::snapshots::Removed::Session`]). Returns at once: a task
    /// ends the run by its recorded policy when it still has unpublished writes
    /// (a missed task-delete event must not lose them) — after any publish in
    /// flight, never racing it — and then completes the release.
    pub fn session_released(self: &Arc<Self>, id: SessionId) {
        let me = self.clone();
        tokio::spawn(async move {
            if let Err(e) = me.end_released(id).await {
                warn!(session.id = id, error = %error_chain(&e), "cannot finish a released session; retried at the next start");
            }
        });
    }

    /// Ends released session `id`'s run if it has none, and completes its
    /// release. Returns false when there was nothing to do, or when the run
    /// is left to its holder (see below).
    async fn end_released(self: &Arc<Self>, id: SessionId) -> Result<bool, EngineError> {
        let _g = self.lock_session(id).await;
        let s = self.session(id).await?;
        if !s.released || !s.remove_pending {
            return Ok(false);
        }
        // Every run ends with an outcome, an empty one too (`no-change`, or
        // `discarded` by its policy): a `layerstack wait` on it must answer.
        let unfinished = !s.run_finished() && s.outcome.is_none() && s.lease_manifest.is_some();
        if unfinished && s.owner.is_sandbox() && !s.daemon_owned {
            // A holder's close the last daemon did not finish: the holder
            // reconnects and closes again with the command's exit status
            // ([`Engine::recover_sandboxes`] waits for it).
            return Ok(false);
        }
        if unfinished && s.daemon_owned {
            // A CloseSession the last daemon did not finish: what it was asked
            // to do was not recorded, and the init died with that daemon.
            self.interrupt_locked(
                id,
                layerstack_store::Interruption::DaemonRestart,
                "the daemon ended during the session's close",
            )
            .await?;
        } else if unfinished {
            self.finish_locked(&s, None, None, "snapshot removed")
                .await?;
        }
        self.blocking(move |st| st.complete_release(id)).await?;
        info!(session.id = id, "session released");
        Ok(true)
    }

    /// At start: finishes sessions whose release was interrupted.
    pub async fn recover(self: &Arc<Self>) -> Result<usize, EngineError> {
        // Releases first: the end of such a run ends its attempt as it should
        // (checkpointed by its policy, `interrupted` for a daemon-owned
        // session); only attempts still running after that are orphans.
        let pending = self.blocking(|s| s.pending_releases()).await?;
        let mut n = 0;
        for id in pending {
            match self.end_released(id).await {
                Ok(done) => n += usize::from(done),
                Err(e) => {
                    warn!(session.id = id, error = %error_chain(&e), "cannot finish a released session")
                }
            }
        }
        let abandoned = self.recover_graph().await?;
        if abandoned > 0 {
            info!(
                attempts = abandoned,
                "attempts whose session vanished ended abandoned"
            );
        }
        Ok(n)
    }
}

#[cfg(test)]
mod inspect_tests;
#[cfg(test)]
mod test_support;
#[cfg(test)]
mod tests;
