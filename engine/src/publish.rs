//! The publish protocol (ARCHITECTURE.md §6 steps 4–6, §9; design record in
//! `docs/architecture.md`, "Publish protocol").
//!
//! ```text
//! outside any lock (side by side)          under the branch's gate (one at a time)
//! ───────────────────────────────          ───────────────────────────────────────
//! census: upper unmounted everywhere       head now == head observed?
//! capture the upper against the lease        no → index rows of the layers added
//! policy edits, seal                              since, at this publish's paths:
//! observe the head H                              none, or only a directory's
//! index rows at this publish's paths,               repeating what was planned
//!   in layers of H the lease lacks                  → the plan stands
//! plan (merges included) against H                some → leave the gate, plan
//! conflict → reject (no gate needed)                     again outside, come back
//! stage: pending layer + index + verdicts                (3 times; then plan here)
//!                                           apply the plan's edits to the upper
//!                                             (no store transaction open)
//!                                           commit: head CAS, prepend, move branch,
//!                                             rename the upper into l/<n> —
//!                                             one transaction of rows
//! ```
//!
//! Why the plan can be made outside the gate: layers are immutable and a branch
//! only moves by prepending (under its gate). The head at commit time is the
//! observed head plus layers added on top; the gate's verdict on a path depends
//! only on index rows at that path, its ancestors and (for what the session
//! deleted or replaced) its subtree. If no added layer has a row there, the
//! verdicts against the new head are the verdicts against the observed one, and
//! the edits (merged files, metadata) stay right. Nor if the only rows there are
//! a directory's, repeating exactly the state the plan took for it (N sessions
//! creating files in one shared directory each add such a row: `moves_the_plan`).
//! Otherwise the gate plans again, against the real head, before anything is
//! written.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use layerstack_publisher::{self as publisher, Changeset, HeadChange, LayerView};
use layerstack_store::{
    ErrorKind, HeadView, IndexEntry, OutcomeKind, OutcomeRecord, Owner, PathCounts, PathQuery,
    PathRecord, PathStatus, PublishContext, PublishTimings, SessionId, SessionInfo, Staged, Store,
};
use tracing::{debug, warn};

use crate::error::{error_chain, EngineError, RunError};
use crate::index::{head_changes, index_of, moves_the_plan, query_for, records};
use crate::policy::{self, Decision, ExitPolicy};
use crate::{Engine, EngineSettings};
pub(crate) use layerstack_store::priority::{store_write, Priority};

/// How long a run that has ended waits for its upper to leave every mount
/// namespace before its publish is refused as [`EngineError::Mounted`]
/// (`Engine::settle_quiescent`): transient copies last milliseconds.
pub const SETTLE_AFTER_EXIT: Duration = Duration::from_secs(5);

/// What a dry run found: the would-be outcome and every path's verdict.
#[derive(Debug, Clone)]
pub struct DryRun {
    /// The session as it is (nothing was changed).
    pub session: SessionInfo,
    /// The would-be outcome; `None` when there is nothing to publish.
    pub kind: Option<OutcomeKind>,
    /// Every path's verdict, sorted by path.
    pub paths: Vec<PathRecord>,
    pub counts: PathCounts,
    pub message: String,
}

/// A test hook, called with the session's upper.
#[cfg(any(test, feature = "failpoints"))]
pub(crate) type Hook = Box<dyn Fn(&std::path::Path) + Send + Sync>;

/// Test hooks in the publish path.
#[cfg(any(test, feature = "failpoints"))]
#[derive(Default)]
pub(crate) struct Failpoints {
    /// Runs after the plan is made (outside the gate), before anything is staged.
    pub(crate) after_plan: std::sync::Mutex<Option<Hook>>,
    /// Runs under the gate, before the plan is applied.
    pub(crate) before_apply: std::sync::Mutex<Option<Hook>>,
    /// Runs before each attempt to take the gate (kept for every publish).
    pub(crate) before_gate: std::sync::Mutex<Option<Arc<Hook>>>,
}

#[cfg(any(test, feature = "failpoints"))]
impl Engine {
    /// Sets a hook run after planning, with the upper's path (tests only).
    pub fn failpoint_after_plan(&self, f: impl Fn(&std::path::Path) + Send + Sync + 'static) {
        *self
            .failpoints
            .after_plan
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(Box::new(f));
    }

    /// Sets a hook run before each attempt of every publish to take its gate,
    /// with the upper's path, on a blocking thread (tests only).
    pub fn failpoint_before_gate(&self, f: impl Fn(&std::path::Path) + Send + Sync + 'static) {
        *self
            .failpoints
            .before_gate
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(Box::new(f)));
    }

    /// Sets a hook run under the gate before applying, with the upper's path (tests only).
    pub fn failpoint_before_apply(&self, f: impl Fn(&std::path::Path) + Send + Sync + 'static) {
        *self
            .failpoints
            .before_apply
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(Box::new(f));
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// What ends a run: the session's recorded exit policy (from the runtime shim),
/// else the container label's (`label`, when the container record was readable),
/// else `on-exit`, applied to the init process's exit status. `on-success`
/// without an exit status discards: success cannot be shown.
///
/// # Errors
/// The reason, when the recorded policy or the label is not a policy: such a run
/// is never published (and never silently discarded either): it ends `failed`
/// with the upper kept.
pub fn exit_decision(
    session: &SessionInfo,
    label: Option<Result<ExitPolicy, policy::UnknownExitPolicy>>,
    exit_status: Option<u32>,
) -> Result<(Decision, String), String> {
    let recorded = match session.policy.as_deref() {
        Some(p) => Some(p.parse::<ExitPolicy>().map_err(|e| {
            format!("{e} (recorded on the session); nothing was published, the upper is kept: fix the label and publish or discard it (layerstack publish [--discard])")
        })?),
        None => None,
    };
    let label = match (recorded, label) {
        (Some(_), _) | (None, None) => None,
        (None, Some(Ok(p))) => Some(p),
        (None, Some(Err(e))) => {
            return Err(format!(
                "{e}; nothing was published, the upper is kept: fix the label and publish or discard it (layerstack publish [--discard])"
            ))
        }
    };
    let p = recorded.or(label).unwrap_or_default();
    Ok(match exit_status {
        Some(code) => policy::decide(p, code),
        None if p == ExitPolicy::OnSuccess => (
            Decision::Discard,
            "policy on-success and the exit status is unknown".to_string(),
        ),
        None => policy::decide(p, 0),
    })
}

/// The reports of a changeset that never reaches the gate (nothing to publish):
/// only its excluded and skipped paths.
fn plan_without_head(cs: &Changeset) -> publisher::GatePlan {
    let mut reports: Vec<publisher::PathReport> = cs
        .excluded
        .iter()
        .map(|(p, pat)| publisher::PathReport {
            path: p.clone(),
            status: publisher::PathStatus::Excluded,
            reason: format!("excluded by policy pattern {pat:?}"),
        })
        .chain(cs.skipped.iter().map(|(p, why)| publisher::PathReport {
            path: p.clone(),
            status: publisher::PathStatus::Excluded,
            reason: format!("{why}: never published"),
        }))
        .collect();
    reports.sort_by(|a, b| a.path.cmp(&b.path));
    publisher::GatePlan {
        reports,
        ..Default::default()
    }
}

fn decision(plan: &publisher::GatePlan) -> OutcomeKind {
    if plan.is_conflict() {
        OutcomeKind::Conflict
    } else if plan.is_merged() {
        OutcomeKind::Merged
    } else {
        OutcomeKind::Committed
    }
}

/// What a refused or failed run leaves, for its outcome's message. A
/// container's or sandbox's upper is kept (published again, shown by `conflict
/// show`, dropped by `publish --discard`); an operation's (promote, node merge)
/// is dropped when the operation ends, leaving the branch as it was.
fn what_is_kept(s: &SessionInfo) -> String {
    match s.owner {
        Owner::Operation { .. } => format!(
            "nothing of it was published and nothing is kept (the operation's upper is dropped): {} is unchanged",
            s.branch
        ),
        _ => "nothing of this session was published; its upper is kept".into(),
    }
}

/// After a step of a staged publish failed: its outcome `failed` (the staged
/// rows dropped, the upper kept), with why.
fn record_failed(
    store: &Store,
    id: SessionId,
    e: &RunError,
    s: &SessionInfo,
    staged: Staged,
    started: Instant,
) -> Result<(), RunError> {
    let msg = error_chain(e);
    let mut rec = OutcomeRecord::new(
        OutcomeKind::Failed,
        failed_message(&msg, e.kind() == ErrorKind::NoSpace, s),
    );
    rec.timings = Some(total_only(started));
    warn!(session.id = id, error = %msg, "publish failed");
    store_write(|| store.record_outcome(id, rec, Some(staged)))?;
    Ok(())
}

/// The message of a run whose publish failed (`msg`: why; `no_space`: the
/// store's filesystem is full, error kind `no_space` — said in words, since
/// `ENOSPC` and SQLite's `SQLITE_FULL` read differently, with what to do).
fn failed_message(msg: &str, no_space: bool, s: &SessionInfo) -> String {
    let msg = if no_space {
        format!("{msg}: no space left on device (error kind no_space): the filesystem holding the store is full; free space on it (`df` the daemon's --root)")
    } else {
        msg.to_string()
    };
    match s.owner {
        Owner::Operation { .. } => format!(
            "{msg}; nothing was published and nothing is kept (the operation's upper is dropped): {} is unchanged",
            s.branch
        ),
        _ => format!("{msg}; nothing was published, the upper is kept: publish again or discard"),
    }
}

fn summary(paths: &[PathRecord], kind: OutcomeKind, s: &SessionInfo) -> String {
    let c = PathCounts::of(paths);
    let not_evaluated = paths
        .iter()
        .filter(|r| r.status == PathStatus::Conflict && r.reason.starts_with("not evaluated"))
        .count() as u64;
    let (clean, merged, excluded) = (c.clean, c.merged, c.excluded);
    match kind {
        OutcomeKind::Conflict if not_evaluated > 0 => format!(
            "{} path(s) conflict with changes on the branch head since the lease, {not_evaluated} more changed on both sides were not evaluated (merging stops at the first conflict); {clean} clean, {merged} merged, {excluded} excluded; {}",
            c.conflict - not_evaluated,
            what_is_kept(s)
        ),
        OutcomeKind::Conflict => format!(
            "{} path(s) conflict with changes on the branch head since the lease; {clean} clean, {merged} merged, {excluded} excluded; {}",
            c.conflict,
            what_is_kept(s)
        ),
        _ => format!(
            "{} path(s): {clean} clean, {merged} merged, {excluded} excluded",
            clean + merged
        ),
    }
}

/// A capture ready for the gate.
pub(crate) struct GateInput {
    pub(crate) cs: Changeset,
    query: PathQuery,
    pub(crate) head: Vec<HeadChange>,
}

/// The plan made outside the gate, and what it was made against.
struct Ready {
    /// Keeps the observed head's layers from GC while the plan refers to them.
    _pin: crate::history::Pin,
    ctx: PublishContext,
    view: LayerView,
    input: GateInput,
    observed: HeadView,
    plan: publisher::GatePlan,
    staged: Staged,
    capture: Duration,
    /// [`Changeset::written_bytes`] of `input.cs`, counted outside the gate.
    capture_bytes: u64,
    /// The index rows and verdicts of a plan made again after staging (the
    /// head moved at this publish's paths): written by the commit in place of
    /// the staged ones.
    replanned: Option<(Vec<IndexEntry>, Vec<PathRecord>)>,
    /// The outcome's message for `plan`, written outside the gate (counting
    /// every path's verdict is O(paths): not for the gate's hold).
    message: String,
}

/// How many times a publish whose head moved at its paths plans again outside
/// the gate before it plans under it (which always ends: nothing else can move
/// the head meanwhile). Each round costs the gate nothing; a publish that keeps
/// losing the race to others on the same paths still ends in bounded time.
pub(crate) const OPTIMISTIC_REPLANS: u32 = 3;

/// What the step under the gate did.
enum GateStep {
    /// Committed (the outcome id), or an outcome was recorded (`None`).
    Done(Option<layerstack_store::PublishId>),
    /// The head moved at this publish's paths since its plan: plan again
    /// outside the gate, then come back.
    Replan(Box<Ready>),
}

/// What a new plan came to.
enum Replanned {
    /// A conflict against the new head: its outcome is recorded.
    Conflict,
    Ready,
}

enum Prepared {
    /// An outcome was recorded already (no change, conflict).
    Done,
    Ready(Box<Ready>),
}

/// The index rows at `cs`'s paths in the layers manifest `head` has and
/// manifest `lease` lacks,
/// after expanding the opaque directories that need it (capturing again; with
/// `edit`, the upper is edited and sealed again to match).
pub(crate) fn gate_input(
    store: &Store,
    settings: &EngineSettings,
    upper: &std::path::Path,
    view: &LayerView,
    session: &SessionInfo,
    mut cs: Changeset,
    (lease, head): (i64, i64),
    edit: bool,
) -> Result<GateInput, RunError> {
    let mut query = query_for(&cs);
    let mut changes = head_changes(store.changes_between(lease, head, &query)?);
    let expand = publisher::opaque_dirs_to_expand(&cs, &changes);
    if !expand.is_empty() {
        // Opaque directories with head changes below: publish them as per-path
        // deletions of the lease's content instead.
        let mut options = settings.capture_options(session);
        options.expand_opaque = expand;
        let first = std::mem::replace(&mut cs, publisher::capture_with(upper, view, &options)?);
        // The first pass removed excluded paths and sockets (and reset the root
        // directory): the outcome still reports them.
        cs.keep_reports_of(&first);
        if edit {
            publisher::prepare_upper(upper, &cs, settings.userxattr)?;
            seal(store, upper, settings.userxattr)?;
        }
        query = query_for(&cs);
        changes = head_changes(store.changes_between(lease, head, &query)?);
    }
    Ok(GateInput {
        cs,
        query,
        head: changes,
    })
}

pub(crate) fn seal(
    store: &Store,
    upper: &std::path::Path,
    userxattr: bool,
) -> Result<(), RunError> {
    match store.durability() {
        layerstack_store::Durability::Durable => publisher::seal_layer_with(upper, userxattr)?,
        layerstack_store::Durability::Disposable => {
            publisher::seal_layer_unsynced(upper, userxattr)?
        }
    }
    Ok(())
}

pub(crate) fn files(
    settings: &EngineSettings,
    view: &LayerView,
    head: &HeadView,
    upper: PathBuf,
) -> publisher::FsFiles {
    publisher::FsFiles {
        lease: view.clone(),
        head: LayerView::new(head.lowers.clone()).with_userxattr(settings.userxattr),
        upper,
        userxattr: settings.userxattr,
    }
}

impl Engine {
    /// Publishes session `id` (taking its lock) and returns it with its outcome.
    /// A run that already has an outcome that ends it, or that holds no lease, is
    /// returned unchanged: nothing is ever published twice.
    ///
    /// The publish runs as its own task: a caller that goes away (an RPC whose
    /// client hit its deadline) never leaves it half done.
    ///
    /// Errors: `SessionNotFound`; [`EngineError::Mounted`] when the upper is
    /// mounted anywhere. A failed step is not an error: it is recorded as outcome
    /// `failed` with the upper kept.
    pub async fn publish(
        self: &Arc<Self>,
        id: SessionId,
        why: &str,
    ) -> Result<SessionInfo, EngineError> {
        let me = self.clone();
        let why = why.to_string();
        let s = tokio::spawn(async move {
            let _g = me.lock_session(id).await;
            me.publish_locked(id, &why).await
        })
        .await
        .map_err(|e| EngineError::Join(e.to_string()))??;
        self.after_publish(&s).await;
        Ok(s)
    }

    /// After a publish that added a layer: an automatic squash when the branch
    /// got too deep.
    pub(crate) async fn after_publish(self: &Arc<Self>, s: &SessionInfo) {
        let Some(o) = &s.outcome else { return };
        if !o.kind.is_published() {
            return;
        }
        let (stack, branch) = (s.stack.clone(), s.branch.clone());
        let depth = self
            .blocking(move |st| st.manifest_depth(st.branch_head(&stack, &branch)?))
            .await;
        if let Ok(depth) = depth {
            self.maybe_squash(&s.stack, &s.branch, depth);
        }
    }

    /// [`Engine::publish`] with the session lock already held by the caller.
    pub async fn publish_locked(
        &self,
        id: SessionId,
        why: &str,
    ) -> Result<SessionInfo, EngineError> {
        self.publish_locked_with(id, why, false).await
    }

    /// [`Engine::publish_locked`]; with `proven`, the caller proved under the
    /// same session lock that the upper is unmounted everywhere (no second
    /// census).
    async fn publish_locked_with(
        &self,
        id: SessionId,
        why: &str,
        proven: bool,
    ) -> Result<SessionInfo, EngineError> {
        let current = self.session(id).await?;
        if current.run_finished() || current.lease_manifest.is_none() {
            return Ok(current);
        }
        if !proven {
            self.ensure_quiescent(&current).await?;
        }
        let started = Instant::now();
        if let Err(e) = self.run(id, why).await {
            // Record the failure so `wait` returns; upper and lease are kept.
            let msg = error_chain(&e);
            warn!(session.id = id, error = %msg, "publish failed");
            let mut rec = OutcomeRecord::new(
                OutcomeKind::Failed,
                failed_message(&msg, e.kind() == ErrorKind::NoSpace, &current),
            );
            rec.timings = Some(total_only(started));
            self.blocking(move |s| s.record_outcome(id, rec, None))
                .await?;
        }
        self.after_outcome(id).await
    }

    /// After an outcome: wakes watchers; a released session whose run ended
    /// loses its directories.
    pub(crate) async fn after_outcome(&self, id: SessionId) -> Result<SessionInfo, EngineError> {
        let settled = self.blocking(move |st| settled(st, id)).await?;
        Ok(self.announce(settled).await)
    }

    /// Wakes watchers of a settled session and ends its attempt's run if the
    /// outcome ended it.
    async fn announce(
        &self,
        (s, attempt): (SessionInfo, Option<layerstack_store::AttemptInfo>),
    ) -> SessionInfo {
        self.notify(&s);
        self.end_attempt_of(&s, attempt).await;
        s
    }

    /// Drops the current run's writes without publishing: outcome `discarded`, a
    /// fresh upper, no lease. A run that already ended is left alone, except a
    /// conflicting (or failed) run, whose kept upper this drops.
    pub async fn discard(
        self: &Arc<Self>,
        id: SessionId,
        why: &str,
    ) -> Result<SessionInfo, EngineError> {
        let _g = self.lock_session(id).await;
        self.discard_locked(id, why).await
    }

    /// [`Engine::discard`] with the session lock already held by the caller.
    pub async fn discard_locked(
        &self,
        id: SessionId,
        why: &str,
    ) -> Result<SessionInfo, EngineError> {
        self.discard_locked_with(id, why, false).await
    }

    /// [`Engine::discard_locked`]; `proven` as in `publish_locked_with`.
    async fn discard_locked_with(
        &self,
        id: SessionId,
        why: &str,
        proven: bool,
    ) -> Result<SessionInfo, EngineError> {
        if !proven {
            let current = self.session(id).await?;
            if current.run_finished() || current.lease_manifest.is_none() {
                return Ok(current);
            }
            self.ensure_unmounted(&current).await?;
        }
        let started = Instant::now();
        let why_owned = why.to_string();
        let done = self
            .blocking(move |st| discard_in(st, id, &why_owned, started, false, |_| true))
            .await?;
        match done {
            Err(current) => Ok(current),
            Ok(settled) => {
                debug!(session.id = id, outcome = "discarded", why, "discarded");
                Ok(self.announce(settled).await)
            }
        }
    }

    /// CloseSession DISCARD of a live WASI session, or of a live
    /// daemon-owned session whose processes are gone
    /// ([`crate::Writers::Gone`]) (session lock held by the caller), in one
    /// blocking step: the owner's release, the outcome `discarded` and the
    /// release completed. What [`Engine::close_sandbox_session`] does in its
    /// several steps, without the census (no census sees a WASI upper:
    /// `census_applies`; nothing is left to hold a daemon-owned session's).
    /// `None`: not such a session's running run; the caller takes the
    /// general path.
    pub(crate) async fn discard_closing(
        &self,
        id: SessionId,
        why: &str,
        writers: crate::Writers,
    ) -> Result<Option<SessionInfo>, EngineError> {
        let started = Instant::now();
        let why = why.to_string();
        let done = self
            .blocking_here(move |st| {
                let live = |s: &SessionInfo| {
                    !s.released
                        && (matches!(s.owner, layerstack_store::Owner::Wasi { .. })
                            || (writers == crate::Writers::Gone && s.daemon_owned))
                };
                discard_in(st, id, &why, started, true, live).map(Result::ok)
            })
            .await?;
        Ok(match done {
            Some(settled) => Some(self.announce(settled).await),
            None => None,
        })
    }

    /// Ends the current run of `id` with outcome `interrupted` (session lock
    /// held by the caller): an infrastructure failure (`by`) ended it, not its
    /// owner. Nothing is read, published or checkpointed; the upper and the
    /// lease are kept for inspection until discarded (the outcome is
    /// retryable); the session's running attempt ends `interrupted`. A run
    /// that has ended (or already ended `interrupted`) is left alone: returns
    /// the session as it is.
    pub async fn interrupt_locked(
        &self,
        id: SessionId,
        by: layerstack_store::Interruption,
        why: &str,
    ) -> Result<SessionInfo, EngineError> {
        let rec = OutcomeRecord::interrupted(
            by,
            format!("interrupted ({by}): {why}; the exit status is unknown, nothing was published, the writes are kept until discarded"),
        );
        let done = self
            .blocking(move |st| {
                let current = st.session(id)?;
                let ended = current.run_finished()
                    || current.lease_manifest.is_none()
                    || current.outcome.as_ref().is_some_and(|o| {
                        o.kind == OutcomeKind::Interrupted && o.run == current.run
                    });
                if ended {
                    return Ok(Err(current));
                }
                st.record_outcome(id, rec, None)?;
                settled(st, id).map(Ok)
            })
            .await?;
        match done {
            Err(current) => Ok(current),
            Ok(settled) => {
                tracing::info!(session.id = id, outcome = "interrupted", interrupted_by = %by, why, "run interrupted");
                Ok(self.announce(settled).await)
            }
        }
    }

    /// Ends the run of `session` per [`exit_decision`] (session lock held by the
    /// caller): publish, discard, or — for an invalid policy — outcome `failed`
    /// with the upper kept. A run that has ended waits (at most
    /// [`SETTLE_AFTER_EXIT`]) for its upper to leave every mount namespace only
    /// when the decision reads the upper (publish, checkpoint).
    pub async fn finish_locked(
        &self,
        session: &SessionInfo,
        label: Option<Result<ExitPolicy, policy::UnknownExitPolicy>>,
        exit_status: Option<u32>,
        why: &str,
    ) -> Result<SessionInfo, EngineError> {
        let proven = !session.run_finished() && session.lease_manifest.is_some();
        let decision = exit_decision(session, label, exit_status);
        // What reads the upper (a publish's capture, a checkpoint's rename)
        // needs it unmounted everywhere; a discard or a refusal does not (a
        // discard drops the upper whether or not a copy of the mount lingers
        // somewhere: nothing is read from it).
        let reads_the_upper = matches!(decision, Ok((Decision::Publish | Decision::Checkpoint, _)));
        if proven && reads_the_upper {
            // The run has ended (task deleted, holder gone, snapshot removed):
            // a mount still seen now is a transient copy in another namespace.
            self.settle_quiescent(session, SETTLE_AFTER_EXIT).await?;
        }
        match decision {
            Ok((Decision::Publish, reason)) => {
                self.publish_locked_with(session.id, &format!("{why}: {reason}"), proven)
                    .await
            }
            Ok((Decision::Discard, reason)) => {
                self.discard_locked_with(session.id, &format!("{why}: {reason}"), proven)
                    .await
            }
            Ok((Decision::Checkpoint, _)) => {
                let prov = layerstack_store::Provenance {
                    exit_status: exit_status.map(|c| i32::try_from(c).unwrap_or(i32::MAX)),
                    ..Default::default()
                };
                self.checkpoint_or_fail_locked(session.id, None, prov, None)
                    .await
            }
            Err(reason) => {
                let id = session.id;
                if session.run_finished() || session.lease_manifest.is_none() {
                    return Ok(session.clone());
                }
                warn!(session.id = id, reason = %reason, "invalid exit policy: not published");
                let rec = OutcomeRecord::new(OutcomeKind::Failed, reason);
                self.blocking(move |s| s.record_outcome(id, rec, None))
                    .await?;
                self.after_outcome(id).await
            }
        }
    }

    /// [`Engine::finish_locked`], taking the session lock, as its own task.
    pub async fn finish(
        self: &Arc<Self>,
        id: SessionId,
        label: Option<Result<ExitPolicy, policy::UnknownExitPolicy>>,
        exit_status: Option<u32>,
        why: &str,
    ) -> Result<SessionInfo, EngineError> {
        let me = self.clone();
        let why = why.to_string();
        let s = tokio::spawn(async move {
            let _g = me.lock_session(id).await;
            let current = me.session(id).await?;
            me.finish_locked(&current, label, exit_status, &why).await
        })
        .await
        .map_err(|e| EngineError::Join(e.to_string()))??;
        self.after_publish(&s).await;
        Ok(s)
    }

    async fn run(&self, id: SessionId, why: &str) -> Result<(), RunError> {
        let started = Instant::now();
        let store = self.store.clone();
        let settings = self.settings.clone();
        #[cfg(any(test, feature = "failpoints"))]
        let hook = self
            .failpoints
            .after_plan
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let pins = self.pins.clone();
        // The semaphore is never closed: `None` cannot happen.
        let permit = self.preparing.clone().acquire_owned().await.ok();
        // The capture clock starts with the work, not with the wait for a worker
        // (that wait is in the total only).
        let queued = started.elapsed();
        let prepared = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let _background = Priority::background();
            let r = prepare(&store, &settings, &pins, id, (started, queued));
            #[cfg(any(test, feature = "failpoints"))]
            if let (Some(h), Ok(Prepared::Ready(_))) = (&hook, &r) {
                h(&store.upper_path(id));
            }
            r
        })
        .await??;
        let ready = match prepared {
            Prepared::Done => return Ok(()),
            Prepared::Ready(r) => r,
        };
        // The serialized step. A plan the head's moves made stale is made again
        // outside the gate (at most OPTIMISTIC_REPLANS times, then under it).
        let key = (
            ready.ctx.session.stack.clone(),
            ready.ctx.session.branch.clone(),
        );
        #[cfg(any(test, feature = "failpoints"))]
        let hook: Option<Arc<Hook>> = self
            .failpoints
            .before_apply
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .map(Arc::new);
        let mut ready = ready;
        let mut gate_wait = Duration::ZERO;
        let mut rounds = 0;
        let (committed, _gate) = loop {
            #[cfg(any(test, feature = "failpoints"))]
            let before_gate = self
                .failpoints
                .before_gate
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            #[cfg(any(test, feature = "failpoints"))]
            if let Some(h) = before_gate {
                let upper = ready.ctx.session.upper.clone();
                tokio::task::spawn_blocking(move || h(&upper)).await?;
            }
            let waiting = Instant::now();
            let gate = self.gates.lock(key.clone()).await;
            gate_wait += waiting.elapsed();
            let holding = Instant::now();
            let (store, settings, pins) =
                (self.store.clone(), self.settings.clone(), self.pins.clone());
            let optimistic = rounds < OPTIMISTIC_REPLANS;
            let why = why.to_string();
            #[cfg(any(test, feature = "failpoints"))]
            let hook = hook.clone();
            let step = self
                .committers
                .run(move || {
                    let staged = ready.staged;
                    let session = ready.ctx.session.clone();
                    let times = (started, gate_wait, holding);
                    #[cfg(any(test, feature = "failpoints"))]
                    let r = commit(
                        &store, &settings, &pins, id, ready, optimistic, times, &why, hook,
                    );
                    #[cfg(not(any(test, feature = "failpoints")))]
                    let r = commit(&store, &settings, &pins, id, ready, optimistic, times, &why);
                    match r {
                        Ok(GateStep::Replan(ready)) => Ok(Err(ready)),
                        // The whole hold: the commit transaction and the rename
                        // included (the row was written before they ran).
                        Ok(GateStep::Done(o)) => Ok(Ok(o.map(|o| (o, holding.elapsed())))),
                        Err(e) => {
                            // Nothing was committed: drop the staged rows, keep the upper.
                            record_failed(&store, id, &e, &session, staged, started)?;
                            Ok::<_, RunError>(Ok(None))
                        }
                    }
                })
                .await??;
            match step {
                Ok(done) => break (done, gate),
                Err(mut stale) => {
                    drop(gate);
                    rounds += 1;
                    let (store, settings, pins) =
                        (self.store.clone(), self.settings.clone(), self.pins.clone());
                    let again = tokio::task::spawn_blocking(move || {
                        let _background = Priority::background();
                        let gate = (gate_wait, None);
                        match replan(&store, &settings, &pins, id, &mut stale, started, gate) {
                            Ok(Replanned::Ready) => Ok(Some(stale)),
                            Ok(Replanned::Conflict) => Ok(None),
                            Err(e) => {
                                // Nothing was committed: drop the staged rows, keep the upper.
                                let s = &stale.ctx.session;
                                record_failed(&store, id, &e, s, stale.staged, started)?;
                                Ok::<_, RunError>(None)
                            }
                        }
                    })
                    .await??;
                    match again {
                        Some(stale) => ready = stale,
                        None => return Ok(()),
                    }
                }
            }
        };
        let store2 = self.store.clone();
        drop(_gate);
        if let Some((outcome, hold)) = committed {
            // Figures only: the publish is committed whatever happens here.
            let total = started.elapsed();
            let r = tokio::task::spawn_blocking(move || {
                // Still under the session lock: the next run's upper.
                store2.renew_session_dirs(id);
                store2.record_commit_times(outcome, micros(hold), micros(total))
            })
            .await;
            if let Err(e) = r
                .map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| e.to_string()))
            {
                warn!(session.id = id, error = %e, "the publish committed; its gate hold and total time were not recorded");
            }
        }
        Ok(())
    }

    /// What publishing session `id` now would do, changing nothing: the upper is
    /// captured and planned against the current branch head; no policy edit, no
    /// merge written, no layer, no outcome. Takes the session lock; the upper must
    /// be quiescent. The same runs a publish accepts (also a `conflict` or `failed`
    /// run) are evaluated; every merge is attempted (within the same time budget).
    ///
    /// Errors: `SessionNotFound`, [`EngineError::Mounted`], [`EngineError::Run`].
    pub async fn dry_run(&self, id: SessionId) -> Result<DryRun, EngineError> {
        let _g = self.lock_session(id).await;
        let current = self.session(id).await?;
        if current.run_finished() || current.lease_manifest.is_none() {
            let message = match &current.outcome {
                Some(o) if current.run_finished() => format!(
                    "nothing to publish: the session's current run already ended with outcome {}",
                    o.kind.as_str()
                ),
                _ => {
                    "nothing to publish: the session holds no lease (its next run has not started)"
                        .into()
                }
            };
            return Ok(DryRun {
                session: current,
                kind: None,
                paths: vec![],
                counts: PathCounts::default(),
                message,
            });
        }
        self.ensure_quiescent(&current).await?;
        let store = self.store.clone();
        let settings = self.settings.clone();
        let (kind, paths, message) = tokio::task::spawn_blocking(
            move || -> Result<(OutcomeKind, Vec<PathRecord>, String), RunError> {
                let ctx = store.publish_context(id)?;
                let upper = ctx.session.upper.clone();
                let view =
                    LayerView::new(ctx.lease_lowers.clone()).with_userxattr(settings.userxattr);
                let cs = publisher::capture_with(
                    &upper,
                    &view,
                    &settings.capture_options(&ctx.session),
                )?;
                // Conflict markers a rebase wrote, still there (engine/src/conflicts.rs).
                if let Some(rec) =
                    crate::conflicts::markers_left(&store, id, &upper, settings.userxattr)?
                {
                    return Ok((
                        OutcomeKind::Conflict,
                        rec.paths,
                        rec.message.unwrap_or_default(),
                    ));
                }
                if cs.is_empty() {
                    let paths = records(&plan_without_head(&cs));
                    return Ok((
                        OutcomeKind::NoChange,
                        paths,
                        "the session changed nothing publishable".into(),
                    ));
                }
                let head = store.head_view(id)?;
                let input = gate_input(
                    &store,
                    &settings,
                    &upper,
                    &view,
                    &ctx.session,
                    cs,
                    (ctx.lease_manifest, head.manifest),
                    false,
                )?;
                let f = files(&settings, &view, &head, upper);
                let plan = publisher::plan_gate_with(
                    &input.cs,
                    &input.head,
                    &f,
                    &settings.merge,
                    publisher::PlanMode::DryRun,
                )?;
                let kind = decision(&plan);
                let paths = records(&plan);
                let message = summary(&paths, kind, &ctx.session);
                Ok((kind, paths, message))
            },
        )
        .await
        .map_err(|e| EngineError::Join(e.to_string()))?
        .map_err(|e| EngineError::Run(Box::new(e)))?;
        Ok(DryRun {
            session: current,
            kind: Some(kind),
            counts: PathCounts::of(&paths),
            paths,
            message: format!("dry run, nothing was changed: {message}"),
        })
    }
}

/// Session `id` as an outcome leaves it, in one blocking step: a released
/// session whose run ended completes its release (directories to the reaper
/// unless the outcome keeps them), and its latest graph attempt, if any, to be
/// ended by the outcome.
/// The blocking step of every discard (session lock held by the caller): one
/// write transaction of the store ([`Store::discard_session`]) — the run's
/// check again, `release` the owner's release first (a live WASI session
/// closing: nothing else holds its upper), the outcome `discarded` and the
/// release completed — so nothing is seen half done. `accept`: the caller's
/// check of the session as it is. `Err(current)`: refused, or the run has
/// ended or holds no lease; nothing done.
fn discard_in(
    st: &Store,
    id: SessionId,
    why: &str,
    started: Instant,
    release: bool,
    accept: impl FnOnce(&SessionInfo) -> bool,
) -> Result<
    Result<(SessionInfo, Option<layerstack_store::AttemptInfo>), SessionInfo>,
    layerstack_store::StoreError,
> {
    let mut rec = OutcomeRecord::new(OutcomeKind::Discarded, format!("writes dropped: {why}"));
    rec.timings = Some(total_only(started));
    st.discard_session(id, rec, release, accept)
}

fn settled(
    st: &Store,
    id: SessionId,
) -> Result<(SessionInfo, Option<layerstack_store::AttemptInfo>), layerstack_store::StoreError> {
    let mut s = st.session(id)?;
    if s.release_due() {
        st.complete_release(id)?;
        s = st.session(id)?;
    }
    let attempt = match s.outcome {
        Some(_) => st.attempt_of_session(id)?,
        None => None,
    };
    Ok((s, attempt))
}

/// Outside the gate: capture, seal, plan against the observed head, stage.
/// `started`: the publish's start; `queued`: how long it then waited for a
/// worker (not part of the capture figure).
fn prepare(
    store: &Store,
    settings: &EngineSettings,
    pins: &Arc<crate::history::Pins>,
    id: SessionId,
    (started, queued): (Instant, Duration),
) -> Result<Prepared, RunError> {
    let ctx = store.publish_context(id)?;
    let upper = ctx.session.upper.clone();
    let view = LayerView::new(ctx.lease_lowers.clone()).with_userxattr(settings.userxattr);
    let cs = publisher::capture_with(&upper, &view, &settings.capture_options(&ctx.session))?;
    if !cs.edits.is_empty() {
        publisher::prepare_upper(&upper, &cs, settings.userxattr)?;
    }
    for (p, why) in &cs.skipped {
        warn!(session.id = id, path = %layerstack_store::escape_path(p), reason = %why, "not captured");
    }
    // A rebased session whose files still hold the conflict markers the rebase
    // wrote is refused (engine/src/conflicts.rs).
    if let Some(rec) = crate::conflicts::markers_left(store, id, &upper, settings.userxattr)? {
        debug!(
            session.id = id,
            outcome = "conflict",
            "conflict markers left"
        );
        let mut rec = rec;
        rec.timings = Some(total_only(started));
        store_write(|| store.record_outcome(id, rec, None))?;
        return Ok(Prepared::Done);
    }
    if cs.is_empty() {
        let paths = records(&plan_without_head(&cs));
        let message = if cs.excluded.is_empty() {
            "the session changed nothing".to_string()
        } else {
            format!(
                "the session changed nothing publishable ({} path(s) excluded by policy)",
                cs.excluded.len()
            )
        };
        store_write(|| {
            store.record_outcome(
                id,
                OutcomeRecord {
                    kind: OutcomeKind::NoChange,
                    message: Some(message),
                    paths,
                    timings: Some(PublishTimings {
                        capture_us: micros(started.elapsed().saturating_sub(queued)),
                        total_us: micros(started.elapsed()),
                        ..Default::default()
                    }),
                    interrupted_by: None,
                },
                None,
            )
        })?;
        debug!(session.id = id, outcome = "no-change", "published");
        return Ok(Prepared::Done);
    }
    seal(store, &upper, settings.userxattr)?;
    let observed = store.head_view(id)?;
    let pin = pins.pin(observed.manifest);
    let input = gate_input(
        store,
        settings,
        &upper,
        &view,
        &ctx.session,
        cs,
        (ctx.lease_manifest, observed.manifest),
        true,
    )?;
    let f = files(settings, &view, &observed, upper.clone());
    let plan = publisher::plan_gate(&input.cs, &input.head, &f, &settings.merge)?;
    let capture = started.elapsed().saturating_sub(queued);
    if plan.is_conflict() {
        let paths = records(&plan);
        let message = summary(&paths, OutcomeKind::Conflict, &ctx.session);
        debug!(
            session.id = id,
            outcome = "conflict",
            paths = plan.conflicts().count(),
            "rejected"
        );
        store_write(|| {
            store.record_outcome(
                id,
                OutcomeRecord {
                    kind: OutcomeKind::Conflict,
                    message: Some(message),
                    paths,
                    timings: Some(PublishTimings {
                        capture_us: micros(capture),
                        total_us: micros(started.elapsed()),
                        capture_bytes: input.cs.written_bytes(),
                        ..Default::default()
                    }),
                    interrupted_by: None,
                },
                None,
            )
        })?;
        return Ok(Prepared::Done);
    }
    let t0 = Instant::now();
    let paths = records(&plan);
    let staged = store_write(|| store.stage_publish(id, &index_of(&plan), &paths))?;
    let message = summary(&paths, decision(&plan), &ctx.session);
    drop(paths);
    let t1 = Instant::now();
    // Blame (engine/src/blame.rs): computed and staged with the layer, outside the gate.
    crate::blame::stage(
        store,
        settings,
        &ctx.session,
        (ctx.lease_manifest, observed.manifest),
        &input.head,
        &plan,
        &upper,
        staged.layer,
        None,
    );
    debug!(
        session.id = id,
        layer.id = staged.layer,
        stage_us = micros(t1 - t0),
        blame_us = micros(t1.elapsed()),
        "staged"
    );
    Ok(Prepared::Ready(Box::new(Ready {
        _pin: pin,
        ctx,
        view,
        capture_bytes: input.cs.written_bytes(),
        input,
        observed,
        plan,
        staged,
        capture,
        replanned: None,
        message,
    })))
}

/// Plans `ready` again against the branch head as it is now (its head moved at
/// this publish's paths since the plan): the index query and expansion, the
/// whole gate plan (merges included), and blame for the paths the head
/// changed. A conflict is recorded as the outcome (the staged rows dropped).
/// Runs outside the gate (optimistically, [`OPTIMISTIC_REPLANS`] times) or
/// under it (the last resort, when the head cannot move meanwhile).
#[allow(clippy::too_many_arguments)]
fn replan(
    store: &Store,
    settings: &EngineSettings,
    pins: &Arc<crate::history::Pins>,
    id: SessionId,
    ready: &mut Ready,
    started: Instant,
    gate: (Duration, Option<Instant>),
) -> Result<Replanned, RunError> {
    let upper = ready.ctx.session.upper.clone();
    let current = store.head_view(id)?;
    let pin = pins.pin(current.manifest);
    let cs = std::mem::take(&mut ready.input.cs);
    let input = gate_input(
        store,
        settings,
        &upper,
        &ready.view,
        &ready.ctx.session,
        cs,
        (ready.ctx.lease_manifest, current.manifest),
        true,
    )?;
    ready.capture_bytes = input.cs.written_bytes();
    let f = files(settings, &ready.view, &current, upper.clone());
    let plan = publisher::plan_gate(&input.cs, &input.head, &f, &settings.merge)?;
    let paths = records(&plan);
    if plan.is_conflict() {
        let message = summary(&paths, OutcomeKind::Conflict, &ready.ctx.session);
        debug!(
            session.id = id,
            outcome = "conflict",
            paths = plan.conflicts().count(),
            under_gate = gate.1.is_some(),
            "rejected"
        );
        let rec = OutcomeRecord {
            kind: OutcomeKind::Conflict,
            message: Some(message),
            paths,
            timings: Some(PublishTimings {
                capture_us: micros(ready.capture),
                gate_wait_us: micros(gate.0),
                gate_hold_us: gate.1.map(|h| micros(h.elapsed())).unwrap_or(0),
                total_us: micros(started.elapsed()),
                capture_bytes: ready.capture_bytes,
            }),
            interrupted_by: None,
        };
        store_write(|| store.record_outcome(id, rec, Some(ready.staged)))?;
        return Ok(Replanned::Conflict);
    }
    // Blame: only the paths the head changed can own other lines now.
    let touched: std::collections::BTreeSet<Vec<u8>> =
        input.head.iter().map(|h| h.path.clone()).collect();
    crate::blame::stage(
        store,
        settings,
        &ready.ctx.session,
        (ready.ctx.lease_manifest, current.manifest),
        &input.head,
        &plan,
        &upper,
        ready.staged.layer,
        Some(&touched),
    );
    ready.message = summary(&paths, decision(&plan), &ready.ctx.session);
    ready.replanned = Some((index_of(&plan), paths));
    ready.plan = plan;
    ready.input = input;
    ready.observed = current;
    ready._pin = pin;
    Ok(Replanned::Ready)
}

/// Under the gate: re-check the head (reads only); when it moved at this
/// publish's paths, hand the publish back to be planned again outside the gate
/// ([`GateStep::Replan`], while `optimistic`) or plan again here; then apply
/// the plan to the upper with no store transaction open, and commit: a
/// compare-and-swap of the head from the one re-checked, rows only (plus the
/// rename of the upper into `l/<n>`).
#[allow(clippy::too_many_arguments)]
fn commit(
    store: &Store,
    settings: &EngineSettings,
    pins: &Arc<crate::history::Pins>,
    id: SessionId,
    mut ready: Box<Ready>,
    optimistic: bool,
    (started, gate_wait, holding): (Instant, Duration, Instant),
    why: &str,
    #[cfg(any(test, feature = "failpoints"))] hook: Option<Arc<Hook>>,
) -> Result<GateStep, RunError> {
    let durable = store.durability() == layerstack_store::Durability::Durable;
    let staging = store.staging_path();
    let recheck = store.recheck_head(id, ready.observed.manifest, &ready.input.query)?;
    layerstack_store::failpoints::hit("publish.rechecked");
    let stands = recheck
        .changes
        .is_none_or(|delta| !moves_the_plan(delta, &ready.input.head));
    let expected_head = match (stands, optimistic) {
        (true, _) => recheck.head,
        (false, true) => return Ok(GateStep::Replan(ready)),
        (false, false) => {
            // Past the optimistic rounds: plan again here, where the head
            // cannot move; its rows replace the staged ones in the commit.
            let gate = (gate_wait, Some(holding));
            if let Replanned::Conflict =
                replan(store, settings, pins, id, &mut ready, started, gate)?
            {
                return Ok(GateStep::Done(None));
            }
            ready.observed.manifest
        }
    };
    let Ready {
        ctx,
        plan,
        staged,
        capture,
        capture_bytes,
        replanned,
        message,
        ..
    } = *ready;
    let upper = ctx.session.upper.clone();
    // The plan's edits of the upper (merged files are written in the store's
    // staging directory and renamed in; synced only in the durable profile, as
    // a `syncfs` here waited for every dirty page of the filesystem). No store
    // transaction is open: only this branch's publishes wait for it.
    #[cfg(any(test, feature = "failpoints"))]
    if let Some(h) = hook {
        h(&upper);
    }
    publisher::apply_plan_with(&upper, &plan, &staging, durable)?;
    layerstack_store::failpoints::hit("publish.applied");
    let kind = decision(&plan);
    let timings = PublishTimings {
        capture_us: micros(capture),
        gate_wait_us: micros(gate_wait),
        // Up to the commit; the whole hold, commit included, is set once it is
        // done (`Store::record_commit_times`).
        gate_hold_us: micros(holding.elapsed()),
        total_us: micros(started.elapsed()),
        capture_bytes,
    };
    let p = store.commit_publish(
        id,
        staged,
        expected_head,
        layerstack_store::CommitRecord {
            kind: Some(kind),
            message: Some(message),
            timings: Some(timings),
            replanned: replanned
                .as_ref()
                .map(|(i, r)| (i.as_slice(), r.as_slice())),
            // After the gate (`publish_locked`).
            renew_later: true,
        },
    )?;
    debug!(
        session.id = id,
        layer.id = p.layer,
        manifest = p.manifest,
        outcome = kind.as_str(),
        why,
        gate_wait_us = timings.gate_wait_us,
        gate_hold_us = micros(holding.elapsed()),
        capture_us = timings.capture_us,
        capture_bytes,
        replanned = replanned.is_some(),
        "publish committed"
    );
    Ok(GateStep::Done(Some(p.outcome)))
}

/// Timings of an outcome that has only a duration (failed, discarded, …).
fn total_only(started: Instant) -> PublishTimings {
    PublishTimings {
        total_us: micros(started.elapsed()),
        ..Default::default()
    }
}
