//! The rollout fabric through the engine (ARCHITECTURE.md §12; seed `002`
//! stage 03; docs/fabric.md): runs, attempts of samples in sandboxes, their
//! ends with rewards — exactly once — and the search statistics beside the
//! graph. The records and their transactions are the store's `rollout`
//! module; the engine adds what takes more than one step: ending an attempt
//! together with its sandbox (a checkpoint in the same transaction as the
//! reward, or a discard right after it).
//!
//! The daemon starts an attempt's sandbox itself (it owns inits): it calls
//! [`Engine::begin_rollout`], creates the daemon-owned session with the
//! attempt's key, then [`Engine::attach_rollout`].
//!
//! A **remote attempt** (`RolloutBegin::worker`: it runs on another machine,
//! e.g. a Ray worker next to that machine's daemon) is recorded here with no
//! sandbox here, and ends with the checkpoint node the worker pushed and the
//! caller pulled into this store (`result_node` of [`Engine::end_rollout`]).
//!
//! **Trajectories.** The daemon records every command it runs in a running
//! attempt's sandbox ([`Engine::record_exec`], before the command's exit is
//! answered): an attempt whose harness crashed, or that an infrastructure
//! failure ended, keeps the commands it ran; an end without a trajectory
//! from the harness takes the daemon's.

use std::collections::BTreeMap;
use std::time::Duration;

use layerstack_store::{
    Begun, Disposition, ExecRecord, NodeStats, RolloutAttempt, RolloutBegin, RolloutEnding,
    RolloutResult, RolloutStatus, RunAudit, RunInfo, SampleInfo, SampleKey, SessionId, StoreError,
};
use tracing::info;

use crate::error::EngineError;
use crate::sandbox::EndAction;
use crate::Engine;

/// What [`Engine::end_rollout`] does with the attempt's sandbox and
/// checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum RolloutKeep {
    /// Checkpoint the live sandbox into a child node of the attempt's node
    /// (its `state`, `labels`), in the transaction that ends the attempt; an
    /// attempt whose session ended already keeps the checkpoint it made.
    Checkpoint {
        state: Option<String>,
        labels: BTreeMap<String, String>,
    },
    /// Discard the live sandbox's writes; prune a checkpoint the attempt made
    /// before (a rejected, graded result).
    Discard,
}

/// How long an attempt's end waits for its sandbox's upper to be unmounted
/// everywhere (the sandbox close's patience).
const CLOSE_PATIENCE: Duration = Duration::from_secs(10);

impl Engine {
    /// Creates run `name` over graph `graph` (the same again: the run as it
    /// is, `false`). Errors: `NotFound`, `AlreadyExists`, `InvalidArgument`.
    pub async fn create_run(
        &self,
        name: &str,
        graph: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<(RunInfo, bool), EngineError> {
        let (n, g) = (name.to_string(), graph.to_string());
        self.blocking(move |st| st.create_run(&n, &g, &labels))
            .await
    }

    /// Every run, by name.
    pub async fn runs(&self) -> Result<Vec<RunInfo>, EngineError> {
        self.blocking(|st| st.runs()).await
    }

    /// Starts (or finds again) attempt `b.attempt` of sample `b.key`: see
    /// `Store::begin_rollout`. The caller then starts its sandbox with the
    /// idempotency key [`rollout_session_key`] and attaches it.
    pub async fn begin_rollout(&self, b: RolloutBegin) -> Result<Begun, EngineError> {
        self.blocking(move |st| st.begin_rollout(&b)).await
    }

    /// The id of the running rollout attempt whose sandbox is session `sid`,
    /// if it is one (`Exec` asks it first). A sandbox no attempt records
    /// (most: [`crate::sandbox::Unrecorded`]) is answered from memory;
    /// otherwise a read on this worker thread.
    pub async fn running_rollout_of_session(
        &self,
        sid: SessionId,
    ) -> Result<Option<i64>, EngineError> {
        let attaches = {
            let u = self.sandboxes.unrecorded();
            if u.sessions.contains(&sid) {
                return Ok(None);
            }
            u.attaches
        };
        let r = self
            .blocking_here(move |st| st.running_rollout_of_session(sid))
            .await?;
        if r.is_none() {
            self.sandboxes.remember_unrecorded(sid, attaches);
        }
        Ok(r)
    }

    /// Records a command run in session `sid` in the trajectory of the
    /// running attempt that session is the sandbox of: the daemon's own
    /// record, kept whatever becomes of the harness (a crashed client's
    /// attempt keeps its commands; `end_rollout` without a trajectory uses
    /// it). Returns the attempt's id; `None` when the session is no running
    /// attempt's (nothing recorded).
    pub async fn record_exec(
        &self,
        sid: SessionId,
        record: ExecRecord,
    ) -> Result<Option<i64>, EngineError> {
        self.blocking(move |st| st.record_rollout_exec(sid, &record))
            .await
    }

    /// Records that rollout attempt `id` runs in sandbox session `sid` (and
    /// the graph attempt that session is).
    pub async fn attach_rollout(
        &self,
        id: i64,
        sid: SessionId,
    ) -> Result<RolloutAttempt, EngineError> {
        let forget = || {
            let mut u = self.sandboxes.unrecorded();
            u.attaches += 1;
            u.sessions.remove(&sid);
        };
        forget();
        let r = self
            .blocking(move |st| {
                let ga = st.attempt_of_session(sid)?.map(|a| a.id);
                st.attach_rollout_session(id, sid, ga)
            })
            .await;
        // Again: a read that began after the count above but before this
        // commit may have remembered the session meanwhile.
        forget();
        r
    }

    /// Rollout attempt `id`.
    pub async fn rollout(&self, id: i64) -> Result<RolloutAttempt, EngineError> {
        self.blocking(move |st| st.rollout(id)).await
    }

    /// Ends rollout attempt `id` (see the module docs of the store's
    /// `rollout`): with a live sandbox, [`RolloutKeep::Checkpoint`] closes it
    /// with a checkpoint that ends the attempt in its own transaction, and
    /// [`RolloutKeep::Discard`] ends the attempt, then discards the sandbox.
    /// An attempt whose sandbox ended already (checkpointed for grading) is
    /// ended in one transaction, its checkpoint kept or pruned. A repeated
    /// end with the same result answers the recorded end.
    ///
    /// `trajectory` and `artifacts` are stored as content-addressed blobs
    /// first (outside any transaction; a blob nothing names is harmless).
    /// Without a `trajectory`, the attempt's is the daemon's record of the
    /// commands it ran in the attempt's sandbox ([`Engine::record_exec`]),
    /// if any: stored once the attempt ended (no command is added to it
    /// after), whichever way it ended — a failed checkpoint's
    /// `infra_failed` too; a fold that fails now is retried at the next
    /// (`Store::fold_rollout_execs`), the end stands.
    ///
    /// `result_node`: a remote attempt's checkpoint, a node already in this
    /// store whose parent is the attempt's node (`Store::end_remote_rollout`),
    /// kept in the transaction that records the reward; refused for a local
    /// attempt and with [`RolloutKeep::Discard`]. A remote attempt ends in
    /// one transaction, with or without it.
    ///
    /// Errors: `NotFound`, `FailedPrecondition` (ended otherwise; the
    /// checkpoint failed — the attempt then ends `infra_failed`
    /// (checkpoint-failed) with the session's reason; `result_node` of a
    /// local attempt or not a child of its node), `InvalidArgument`.
    #[allow(clippy::too_many_arguments)]
    pub async fn end_rollout(
        self: &std::sync::Arc<Self>,
        id: i64,
        result: RolloutResult,
        evaluator: Option<layerstack_store::Evaluator>,
        trajectory: Option<Vec<u8>>,
        artifacts: Vec<(String, Vec<u8>)>,
        backprop: Option<f64>,
        message: String,
        keep: RolloutKeep,
        result_node: Option<String>,
    ) -> Result<RolloutAttempt, EngineError> {
        // One end of an attempt at a time: a second, concurrent one (a
        // client's retry after a timeout) waits and is answered as a repeat —
        // it found the sandbox closing and was refused "still runs". The end
        // runs in a task of its own, with the lock: a caller that goes away
        // (its deadline) does not drop the lock while the end goes on.
        let me = self.clone();
        tokio::spawn(async move {
            let _one = me.attempts.lock(id).await;
            let ended: Result<RolloutAttempt, EngineError> = async {
                if result_node.is_some() && keep == RolloutKeep::Discard {
                    return Err(EngineError::Store(layerstack_store::discard_with_node(id)));
                }
                let (trajectory, artifacts) = me
                    .blocking(move |st| {
                        let t = trajectory
                            .map(|b| st.put_blob(&b).map(|(d, _)| d))
                            .transpose()?;
                        let mut arts = Vec::with_capacity(artifacts.len());
                        for (name, bytes) in artifacts {
                            if name.is_empty() || name.len() > 256 {
                                return Err(StoreError::InvalidArgument(format!(
                                    "artifact name {name:?}: give 1 to 256 bytes"
                                )));
                            }
                            let (digest, size) = st.put_blob(&bytes)?;
                            arts.push(layerstack_store::Artifact { name, digest, size });
                        }
                        Ok((t, arts))
                    })
                    .await?;
                let ending = RolloutEnding {
                    result,
                    evaluator,
                    trajectory,
                    artifacts,
                    backprop,
                    message,
                };
                let a = me.blocking(move |st| st.rollout(id)).await?;
                let end_keep = match keep {
                    RolloutKeep::Checkpoint { .. } => layerstack_store::EndKeep::Checkpoint,
                    RolloutKeep::Discard => layerstack_store::EndKeep::Discard,
                };
                if a.worker.is_some() || result_node.is_some() {
                    // A remote attempt: nothing of it lives here; one transaction
                    // (the store refuses a result node for a local attempt).
                    return me
                        .blocking(move |st| st.end_remote_rollout(id, &ending, result_node.as_deref(), end_keep))
                        .await;
                }
                let live = match (a.status, a.session) {
                    (RolloutStatus::Running, Some(sid)) => {
                        // A close of its sandbox under way (a checkpoint for
                        // grading whose caller gave up waiting, then ended
                        // the attempt): this end is decided once it is done,
                        // not refused "still runs" in between.
                        drop(me.lock_session(sid).await);
                        let s = me.session(sid).await?;
                        (!s.released && !s.run_finished()).then_some(sid)
                    }
                    _ => None,
                };
                match (live, keep) {
                    (Some(sid), RolloutKeep::Checkpoint { state, labels }) => {
                        let s = me
                            .close_sandbox_session(
                                sid,
                                EndAction::Checkpoint {
                                    exit_status: None,
                                    state,
                                    command: None,
                                    labels,
                                    rollout: Some(ending.clone()),
                                },
                                "rollout attempt ended",
                                CLOSE_PATIENCE,
                            )
                            .await?;
                        let after = me.blocking(move |st| st.rollout(id)).await?;
                        if after.status == RolloutStatus::Running {
                            // The checkpoint failed (the session's outcome says why):
                            // the attempt ends as an infrastructure failure, never
                            // with the reward it was given.
                            let why = s
                                .outcome
                                .as_ref()
                                .and_then(|o| o.message.clone())
                                .unwrap_or_default();
                            let failed = RolloutEnding {
                                result: RolloutResult::InfraFailed {
                                    kind: "checkpoint-failed".into(),
                                },
                                evaluator: None,
                                trajectory: ending.trajectory.clone(),
                                artifacts: Vec::new(),
                                backprop: None,
                                message: why.clone(),
                            };
                            me.blocking(move |st| st.end_rollout(id, &failed, Disposition::Keep))
                                .await?;
                            return Err(EngineError::Store(StoreError::FailedPrecondition(format!(
                                "rollout attempt {id}: its checkpoint failed ({why}); the attempt ended infra_failed(checkpoint-failed): retry the sample with a new attempt"
                            ))));
                        }
                        info!(rollout.attempt = id, status = after.status.as_str(), node = ?after.result_node, "rollout attempt ended with its checkpoint");
                        // A concurrent end may have come first: this call's ending is
                        // then answered as a repeat (the same result) or refused.
                        me.blocking(move |st| st.end_rollout(id, &ending, Disposition::Keep))
                            .await
                    }
                    (Some(sid), RolloutKeep::Discard) => {
                        let e = ending.clone();
                        let ended = me
                            .blocking(move |st| st.end_rollout(id, &e, Disposition::Discard))
                            .await?;
                        me.close_sandbox_session(
                            sid,
                            EndAction::Discard,
                            "rollout attempt ended",
                            CLOSE_PATIENCE,
                        )
                        .await?;
                        Ok(ended)
                    }
                    (None, keep) => {
                        let how = match keep {
                            RolloutKeep::Checkpoint { .. } => Disposition::Keep,
                            RolloutKeep::Discard => Disposition::Prune,
                        };
                        let ended = me
                            .blocking(move |st| st.end_rollout(id, &ending, how))
                            .await?;
                        // A sandbox an infrastructure failure ended keeps its upper
                        // until released: nothing will use it now.
                        me.discard_ended_rollout_sandboxes().await?;
                        Ok(ended)
                    }
                }
            }
            .await;
            // The daemon's record becomes the trajectory of an attempt that
            // ended without one (its end left the rows; none is added now).
            if let Err(e) = me.blocking(move |st| st.fold_rollout_execs_of(id)).await {
                tracing::warn!(rollout.attempt = id, error = %crate::error_chain(&e), "cannot store the ended attempt's recorded commands as its trajectory yet; the next fold tries again");
            }
            match ended {
                // This fold, or the one that ran with the discard of ended
                // attempts' sandboxes, may have given it its trajectory.
                Ok(a) if a.trajectory.is_none() => me.rollout(id).await,
                other => other,
            }
        })
        .await
        .map_err(|e| EngineError::Join(e.to_string()))?
    }

    /// The attempts of run `run` (`step`: of that step only) after attempt id
    /// `after`, at most `limit`, by id.
    pub async fn rollouts(
        &self,
        run: &str,
        step: Option<i64>,
        after: i64,
        limit: usize,
    ) -> Result<Vec<RolloutAttempt>, EngineError> {
        let r = run.to_string();
        self.blocking(move |st| st.rollouts(&r, step, after, limit))
            .await
    }

    /// Sample `key`.
    pub async fn sample(&self, key: SampleKey) -> Result<SampleInfo, EngineError> {
        self.blocking(move |st| st.sample(&key)).await
    }

    /// Run `run`'s exactly-once audit (after ending what infrastructure
    /// failures ended).
    pub async fn audit_run(
        self: &std::sync::Arc<Self>,
        run: &str,
    ) -> Result<RunAudit, EngineError> {
        let r = run.to_string();
        self.blocking(|st| st.sync_rollouts(false)).await?;
        self.discard_ended_rollout_sandboxes().await?;
        self.blocking(move |st| st.audit_run(&r)).await
    }

    /// At start: attempts whose sandbox the last daemon's end took, or that
    /// never got one, end `infra_failed`, and their sandboxes are discarded.
    pub async fn recover_rollouts(self: &std::sync::Arc<Self>) -> Result<usize, EngineError> {
        let n = self.blocking(|st| st.sync_rollouts(true)).await?;
        self.discard_ended_rollout_sandboxes().await?;
        Ok(n)
    }

    /// Discards (and releases) the sandboxes of ended rollout attempts that
    /// an infrastructure failure left unreleased: an interrupted session keeps
    /// its upper for a person to look at, but an ended attempt's writes are
    /// never used (its end recorded whether anything was kept).
    pub async fn discard_ended_rollout_sandboxes(
        self: &std::sync::Arc<Self>,
    ) -> Result<usize, EngineError> {
        // Attempts an infrastructure failure ended keep the daemon's record
        // of their commands as their trajectory.
        self.blocking(|st| Ok(st.fold_rollout_execs())).await?;
        let ids = self.blocking(|st| st.ended_rollout_sessions()).await?;
        let n = ids.len();
        for sid in ids {
            let closed = self
                .close_sandbox_session(
                    sid,
                    EndAction::Discard,
                    "its rollout attempt ended",
                    CLOSE_PATIENCE,
                )
                .await;
            if let Err(e) = closed {
                tracing::warn!(session.id = sid, error = %crate::error_chain(&e), "cannot discard an ended rollout attempt's sandbox");
            }
        }
        Ok(n)
    }

    /// Search statistics of `node` and (`children`) of its children.
    pub async fn node_stats(
        &self,
        node: &str,
        children: bool,
    ) -> Result<(NodeStats, Vec<NodeStats>), EngineError> {
        let n = node.to_string();
        self.blocking(move |st| {
            let me = st.node_stats(&n)?;
            let kids = if children {
                st.children_stats(&n)?
            } else {
                Vec::new()
            };
            Ok((me, kids))
        })
        .await
    }

    /// Sets `node`'s prior.
    pub async fn set_prior(&self, node: &str, prior: f64) -> Result<NodeStats, EngineError> {
        let n = node.to_string();
        self.blocking(move |st| st.set_prior(&n, prior)).await
    }

    /// Leases (`lease`) or releases `nodes` for frontier `holder` (release
    /// with no nodes: all of them); answers the holder's frontier after.
    pub async fn frontier(
        &self,
        holder: &str,
        nodes: Vec<String>,
        lease: bool,
    ) -> Result<Vec<String>, EngineError> {
        let h = holder.to_string();
        self.blocking(move |st| {
            if lease {
                st.lease_frontier(&h, &nodes)?;
            } else {
                st.release_frontier(&h, &nodes)?;
            }
            st.frontier(&h)
        })
        .await
    }

    /// The store checked against its filesystem (`Store::fsck_with`); `repair`
    /// fixes what loses no committed change; `content` hashes every written
    /// file of a live layer against its index digest.
    pub async fn fsck(
        &self,
        repair: bool,
        content: bool,
    ) -> Result<layerstack_store::FsckReport, EngineError> {
        let mut r = self
            .blocking(move |st| st.fsck_with(repair, content))
            .await?;
        if content {
            let store = self.store.clone();
            let userxattr = self.settings().userxattr;
            let bases = tokio::task::spawn_blocking(move || imported_bases_torn(&store, userxattr))
                .await
                .map_err(|e| EngineError::Join(e.to_string()))??;
            r.problems.extend(bases);
        }
        Ok(r)
    }

    /// A blob's bytes (a trajectory, an artifact).
    pub async fn blob(&self, digest: &str) -> Result<Vec<u8>, EngineError> {
        let d = digest.to_string();
        self.blocking(move |st| st.blob(&d)).await
    }
}

/// The idempotency key of rollout attempt `id`'s sandbox session: a repeated
/// begin finds the same session.
pub fn rollout_session_key(id: i64) -> String {
    format!("rollout-attempt:{id}")
}

/// `fsck --content` for imported bases, which have no path index: each base's
/// tree written as a layer tar again must have the digest its import recorded
/// (its stack id; `crate::import::tree_digest`). A base torn by a power cut in
/// the `disposable` profile, or changed by hand, does not. Layers unpacked by
/// containerd or pulled from a registry are not checked here: their content
/// was checked against its diff ID when it arrived, and a tar of them written
/// again need not reproduce another writer's bytes.
fn imported_bases_torn(
    store: &layerstack_store::Store,
    userxattr: bool,
) -> Result<Vec<layerstack_store::Problem>, EngineError> {
    let mut out = Vec::new();
    for s in store.stacks()? {
        let Some(want) = s.id.strip_prefix("import:") else {
            continue;
        };
        for l in &s.base_layers {
            let dir = store.layer_path(*l);
            if std::fs::symlink_metadata(&dir).is_err() {
                continue; // `layer-missing`, reported by the store's fsck.
            }
            let got = crate::import::tree_digest(&dir, userxattr)?;
            if got != want {
                out.push(layerstack_store::Problem {
                    kind: "content-mismatch",
                    subject: format!("layer {l} (the base of stack {})", s.id),
                    detail: format!(
                        "its tree written as a layer tar is {got}, its import recorded {want}: a file of the base was torn (a power cut in the disposable profile) or changed by hand; import the base again from its source into a new store, or restore the store"
                    ),
                    repaired: false,
                });
            }
        }
    }
    Ok(out)
}
