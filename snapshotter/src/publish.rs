//! Publishing a session: capture its quiescent upper, gate it against the branch
//! head, and commit one layer or reject the whole changeset (ARCHITECTURE.md §6).
//!
//! Capture, hashing and sealing run side by side for different sessions; only
//! check-head → gate → prepend is serialized (one gate lock per daemon).
//! A session is published at most once per run: a per-session lock orders the
//! task-delete event, `layerstack publish`, and containerd's `Remove`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use layerstack_api::policy;
use layerstack_publisher as publisher;
use layerstack_store::{
    escape_path, ConflictRecord, Outcome, OutcomeKind, PathRecord, SessionId, SessionInfo, Store,
    StoreError,
};
use tokio::sync::{Mutex, Notify, OwnedMutexGuard};
use tracing::{info, warn};

/// Why a publish could not run (a gate conflict is an outcome, not an error).
#[derive(Debug, thiserror::Error)]
pub enum PublishFailure {
    #[error("no session for container {container:?} in namespace {namespace:?}: was it created with --snapshotter layerstack?")]
    NoSession {
        namespace: String,
        container: String,
    },
    #[error("session {0}'s rootfs is still mounted (upperdir {1}); stop the container's task before publishing")]
    Mounted(SessionId, String),
    #[error("store")]
    Store(#[from] StoreError),
    #[error("publish task failed: {0}")]
    Join(String),
    #[error("dry run failed: {0}")]
    DryRun(String),
}

/// Serializes publishes and wakes `Wait` callers.
pub struct Publisher {
    store: Arc<Store>,
    policy: PublishPolicy,
    gate: Mutex<()>,
    sessions: Mutex<HashMap<SessionId, Arc<Mutex<()>>>>,
    /// Notified after every recorded outcome.
    pub outcomes: Notify,
    /// Subscribed to containerd's task events (set by the event watcher).
    pub events_subscribed: std::sync::atomic::AtomicBool,
}

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// What ends a run: the session's recorded exit policy (`SetPolicy`, from the
/// runtime shim), else the container label's (`label`, when the container record
/// was readable), else `on-exit`, applied to the init process's exit status.
/// `on-success` without an exit status discards: success cannot be shown.
pub fn exit_decision(
    session: &SessionInfo,
    label: Option<policy::Policy>,
    exit_status: Option<u32>,
) -> (policy::Decision, String) {
    let recorded = session
        .policy
        .as_deref()
        .and_then(|p| p.parse::<policy::Policy>().ok());
    let p = recorded.or(label).unwrap_or_default();
    match exit_status {
        Some(code) => policy::decide(p, code),
        None if p == policy::Policy::OnSuccess => (
            policy::Decision::Discard,
            "policy on-success and the exit status is unknown".to_string(),
        ),
        None => policy::decide(p, 0),
    }
}

impl Publisher {
    /// End the run of `session` per [`exit_decision`] (session lock held by the
    /// caller): publish or discard.
    pub async fn finish_locked(
        &self,
        session: &SessionInfo,
        label: Option<policy::Policy>,
        exit_status: Option<u32>,
        why: &str,
    ) -> Result<SessionInfo, PublishFailure> {
        let (decision, reason) = exit_decision(session, label, exit_status);
        let why = format!("{why}: {reason}");
        match decision {
            policy::Decision::Publish => self.publish_locked(session.id, &why).await,
            policy::Decision::Discard => self.discard_locked(session.id, &why).await,
        }
    }

    /// [`Publisher::finish_locked`], taking the session lock, as its own task (see
    /// [`Publisher::publish`]).
    pub async fn finish(
        self: &Arc<Self>,
        session: SessionId,
        label: Option<policy::Policy>,
        exit_status: Option<u32>,
        why: &str,
    ) -> Result<SessionInfo, PublishFailure> {
        let me = self.clone();
        let why = why.to_string();
        tokio::spawn(async move {
            let _g = me.lock_session(session).await;
            let current = me.blocking(move |s| s.session(session)).await?;
            me.finish_locked(&current, label, exit_status, &why).await
        })
        .await
        .map_err(|e| PublishFailure::Join(e.to_string()))?
    }
}

/// Whether the session's current run is over: it has an outcome that must not be
/// repeated (committed, merged, no-change, discarded). A failed or conflicting run
/// can be published again (gated anew against the head) or discarded.
fn run_finished(s: &SessionInfo) -> bool {
    s.outcome
        .as_ref()
        .is_some_and(|o| !matches!(o.kind, OutcomeKind::Failed | OutcomeKind::Conflict))
}

/// Whether an overlay with this upperdir is mounted in our mount namespace
/// (`/proc/self/mountinfo` super options, `upperdir=` field).
pub fn upper_is_mounted(upper: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let needle = format!("upperdir={}", upper.display());
    info.lines()
        .any(|l| l.split(',').flat_map(|f| f.split(' ')).any(|f| f == needle))
}

impl Publisher {
    pub fn new(store: Arc<Store>) -> Self {
        Self {
            store,
            policy: PublishPolicy::default(),
            gate: Mutex::new(()),
            sessions: Mutex::new(HashMap::new()),
            outcomes: Notify::new(),
            events_subscribed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Use `policy` (exclusions, merge limits) for every publish.
    pub fn with_policy(mut self, policy: PublishPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The store this publisher writes to.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Take the per-session lock (held across a publish, and by `Remove`).
    pub async fn lock_session(&self, id: SessionId) -> OwnedMutexGuard<()> {
        let m = {
            let mut map = self.sessions.lock().await;
            map.entry(id)
                .or_insert_with(|| Arc::new(Mutex::new(())))
                .clone()
        };
        m.lock_owned().await
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, PublishFailure> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(|e| PublishFailure::Join(e.to_string()))?
            .map_err(PublishFailure::from)
    }

    /// Find the session of `(namespace, container)`.
    pub async fn find(
        &self,
        namespace: &str,
        container: &str,
    ) -> Result<SessionInfo, PublishFailure> {
        let (ns, c) = (namespace.to_string(), container.to_string());
        self.blocking(move |s| s.find_session(&ns, &c))
            .await?
            .ok_or_else(|| PublishFailure::NoSession {
                namespace: namespace.to_string(),
                container: container.to_string(),
            })
    }

    /// Publish `session` (taking its lock). Returns the session with its outcome.
    ///
    /// The publish runs as its own task: a caller that goes away (an admin RPC
    /// whose client hit its deadline, the shim's 5 s cleanup budget) never leaves
    /// a publish half done between capture and commit.
    pub async fn publish(
        self: &Arc<Self>,
        session: SessionId,
        why: &str,
    ) -> Result<SessionInfo, PublishFailure> {
        let me = self.clone();
        let why = why.to_string();
        tokio::spawn(async move {
            let _g = me.lock_session(session).await;
            me.publish_locked(session, &why).await
        })
        .await
        .map_err(|e| PublishFailure::Join(e.to_string()))?
    }

    /// Publish with the session lock already held by the caller. A session whose
    /// current run already has an outcome, or that holds no lease, is returned
    /// unchanged: nothing is ever published twice.
    pub async fn publish_locked(
        &self,
        session: SessionId,
        why: &str,
    ) -> Result<SessionInfo, PublishFailure> {
        let current = self.blocking(move |s| s.session(session)).await?;
        if run_finished(&current) || current.lease_manifest.is_none() || current.released {
            return Ok(current);
        }
        if upper_is_mounted(&current.upper) {
            return Err(PublishFailure::Mounted(
                session,
                current.upper.display().to_string(),
            ));
        }
        let outcome = self.run(session, why).await;
        let result = match outcome {
            Ok(()) => self.blocking(move |s| s.session(session)).await,
            Err(e) => {
                // Record the failure so `wait` returns; upper and lease are kept.
                let msg = crate::service::error_chain(&e);
                warn!(session.id = session, error = %msg, "publish failed");
                let rec = Outcome {
                    kind: OutcomeKind::Failed,
                    layer: None,
                    conflicts: vec![],
                    paths: vec![],
                    message: Some(msg),
                    at_ns: now_ns(),
                    timings: None,
                };
                self.blocking(move |s| s.record_outcome(session, rec))
                    .await?;
                self.blocking(move |s| s.session(session)).await
            }
        };
        self.outcomes.notify_waiters();
        result
    }

    /// Drop the current run's writes without publishing: outcome `discarded`, a
    /// fresh upper, no lease. A run that already has an outcome is left alone.
    pub async fn discard(
        &self,
        session: SessionId,
        why: &str,
    ) -> Result<SessionInfo, PublishFailure> {
        let _g = self.lock_session(session).await;
        self.discard_locked(session, why).await
    }

    /// [`Publisher::discard`] with the session lock already held by the caller.
    pub async fn discard_locked(
        &self,
        session: SessionId,
        why: &str,
    ) -> Result<SessionInfo, PublishFailure> {
        let current = self.blocking(move |s| s.session(session)).await?;
        // A conflicted upper is kept after containerd removed the snapshot; this
        // is how it is dropped.
        let kept_conflict =
            current.released && current.state == layerstack_store::SessionState::Conflict;
        if !kept_conflict
            && (run_finished(&current) || current.lease_manifest.is_none() || current.released)
        {
            return Ok(current);
        }
        if upper_is_mounted(&current.upper) {
            return Err(PublishFailure::Mounted(
                session,
                current.upper.display().to_string(),
            ));
        }
        let rec = Outcome {
            kind: OutcomeKind::Discarded,
            layer: None,
            conflicts: vec![],
            paths: vec![],
            message: Some(format!("writes dropped: {why}")),
            at_ns: now_ns(),
            timings: None,
        };
        self.blocking(move |s| s.record_outcome(session, rec))
            .await?;
        info!(
            session.id = session,
            outcome = "discarded",
            why,
            "discarded"
        );
        self.outcomes.notify_waiters();
        self.blocking(move |s| s.session(session)).await
    }

    /// What publishing `session` now would do, without changing anything: the
    /// upper is captured and gated against the current branch head, nothing is
    /// written (no policy edits, no merges, no layer, no outcome). Takes the
    /// session lock; the rootfs must be unmounted. The same runs as
    /// [`publish_locked`](Self::publish_locked) would publish: a run that ended in
    /// `conflict` or `failed` is gated anew.
    pub async fn dry_run(&self, session: SessionId) -> Result<DryRun, PublishFailure> {
        let _g = self.lock_session(session).await;
        let current = self.blocking(move |s| s.session(session)).await?;
        if run_finished(&current) || current.lease_manifest.is_none() || current.released {
            let message = match &current.outcome {
                Some(o) if run_finished(&current) => format!(
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
                message,
            });
        }
        if upper_is_mounted(&current.upper) {
            return Err(PublishFailure::Mounted(
                session,
                current.upper.display().to_string(),
            ));
        }
        let policy = self.policy.clone();
        let store = self.store.clone();
        let result = tokio::task::spawn_blocking(
            move || -> Result<(OutcomeKind, Vec<PathRecord>, String), RunError> {
                let ctx = store.publish_context(session)?;
                let upper = ctx.session.upper.clone();
                let view = publisher::LayerView::new(ctx.lease_lowers.clone())
                    .with_userxattr(policy.userxattr);
                let mut options = policy.capture_options();
                let mut cs = publisher::capture_with(&upper, &view, &options)?;
                if cs.is_empty() {
                    let paths = records(&plan_without_head(&cs));
                    return Ok((
                        OutcomeKind::NoChange,
                        paths,
                        "the session changed nothing publishable".into(),
                    ));
                }
                let delta = store.head_delta(session, ctx.lease_manifest)?;
                let head = parse_head(&delta.layers)?;
                let expand = publisher::opaque_dirs_to_expand(&cs, &head);
                if !expand.is_empty() {
                    options.expand_opaque = expand;
                    let first = std::mem::replace(
                        &mut cs,
                        publisher::capture_with(&upper, &view, &options)?,
                    );
                    cs.keep_reports_of(&first);
                }
                let files = publisher::FsFiles {
                    lease: view,
                    head: publisher::LayerView::new(store.head_lowers(session, delta.head)?)
                        .with_userxattr(policy.userxattr),
                    upper,
                    userxattr: policy.userxattr,
                };
                let plan = publisher::plan_gate_with(
                    &cs,
                    &head,
                    &files,
                    &policy.merge,
                    publisher::PlanMode::DryRun,
                )?;
                let kind = decision(&plan);
                Ok((kind, records(&plan), summary(&plan, kind)))
            },
        )
        .await
        .map_err(|e| PublishFailure::Join(e.to_string()))?;
        match result {
            Ok((kind, paths, message)) => Ok(DryRun {
                session: current,
                kind: Some(kind),
                paths,
                message: format!("dry run, nothing was changed: {message}"),
            }),
            Err(e) => Err(PublishFailure::DryRun(crate::service::error_chain(&e))),
        }
    }

    async fn run(&self, session: SessionId, why: &str) -> Result<(), RunError> {
        let started = std::time::Instant::now();
        let ctx = {
            let store = self.store.clone();
            tokio::task::spawn_blocking(move || store.publish_context(session)).await??
        };
        let upper = ctx.session.upper.clone();
        let policy = self.policy.clone();
        // Capture, policy edits and sealing run outside the gate: they only read
        // the lease and the quiescent upper.
        let changeset = {
            let lowers = ctx.lease_lowers.clone();
            let upper = upper.clone();
            let policy = policy.clone();
            tokio::task::spawn_blocking(move || -> Result<publisher::Changeset, RunError> {
                let view = publisher::LayerView::new(lowers).with_userxattr(policy.userxattr);
                let cs = publisher::capture_with(&upper, &view, &policy.capture_options())?;
                if !cs.edits.is_empty() {
                    publisher::prepare_upper(&upper, &cs, policy.userxattr)?;
                }
                if !cs.is_empty() {
                    publisher::seal_layer_with(&upper, policy.userxattr)?;
                }
                Ok(cs)
            })
            .await??
        };
        let captured = started.elapsed();
        for (p, why) in &changeset.skipped {
            warn!(session.id = session, path = %escape_path(p), reason = %why, "not captured");
        }
        if changeset.is_empty() {
            let plan = plan_without_head(&changeset);
            let rec = Outcome {
                kind: OutcomeKind::NoChange,
                layer: None,
                conflicts: vec![],
                paths: records(&plan),
                message: Some(if changeset.excluded.is_empty() {
                    "the session changed nothing".into()
                } else {
                    format!(
                        "the session changed nothing publishable ({} path(s) excluded by policy)",
                        changeset.excluded.len()
                    )
                }),
                at_ns: now_ns(),
                timings: None,
            };
            let store = self.store.clone();
            tokio::task::spawn_blocking(move || store.record_outcome(session, rec)).await??;
            info!(
                session.id = session,
                outcome = "no-change",
                why,
                "published"
            );
            return Ok(());
        }

        // The serialized step: check head → (expand) → gate/merge → apply → prepend.
        let waiting = std::time::Instant::now();
        let _gate = self.gate.lock().await;
        let gate_wait = waiting.elapsed();
        let holding = std::time::Instant::now();
        let store = self.store.clone();
        let lease = ctx.lease_manifest;
        let lowers = ctx.lease_lowers.clone();
        tokio::task::spawn_blocking(move || -> Result<(), RunError> {
            let delta = store.head_delta(session, lease)?;
            let head = parse_head(&delta.layers)?;
            let view = publisher::LayerView::new(lowers).with_userxattr(policy.userxattr);
            let mut changeset = changeset;
            let expand = publisher::opaque_dirs_to_expand(&changeset, &head);
            if !expand.is_empty() {
                // Opaque directories the head changed, changed below or hid:
                // publish them as per-path deletions of the lease's content instead.
                let mut options = policy.capture_options();
                options.expand_opaque = expand;
                let first = std::mem::replace(&mut changeset, publisher::capture_with(&upper, &view, &options)?);
                // The first pass removed excluded paths and sockets (and reset the
                // root directory): the outcome still reports them.
                changeset.keep_reports_of(&first);
                publisher::prepare_upper(&upper, &changeset, policy.userxattr)?;
                publisher::seal_layer_with(&upper, policy.userxattr)?;
            }
            let files = publisher::FsFiles {
                lease: view,
                head: publisher::LayerView::new(store.head_lowers(session, delta.head)?).with_userxattr(policy.userxattr),
                upper: upper.clone(),
                userxattr: policy.userxattr,
            };
            let plan = publisher::plan_gate(&changeset, &head, &files, &policy.merge)?;
            let kind = decision(&plan);
            let paths = records(&plan);
            if plan.is_conflict() {
                let conflicts: Vec<ConflictRecord> = plan
                    .conflicts()
                    .map(|c| ConflictRecord {
                        path: escape_path(&c.path),
                        reason: c.reason.clone(),
                    })
                    .collect();
                info!(session.id = session, outcome = "conflict", paths = conflicts.len(), "rejected");
                let not_evaluated = conflicts.iter().filter(|c| c.reason.starts_with("not evaluated")).count();
                let more = if not_evaluated > 0 {
                    format!(" ({not_evaluated} more path(s) changed on both sides were not evaluated: merging stops at the first conflict)")
                } else {
                    String::new()
                };
                store.record_outcome(
                    session,
                    Outcome {
                        kind: OutcomeKind::Conflict,
                        layer: None,
                        message: Some(format!(
                            "{} path(s) conflict with changes on the branch head since the lease{more}; nothing of this session was published; its upper is kept",
                            conflicts.len() - not_evaluated
                        )),
                        conflicts,
                        paths,
                        at_ns: now_ns(),
                        timings: None,
                    },
                )?;
                return Ok(());
            }
            // Merged files are written in the store's staging directory (same
            // filesystem, never captured, emptied by the sweep) and renamed in.
            publisher::apply_plan(&upper, &plan, &store.staging_path())?;
            let index: Vec<(Vec<u8>, String)> = plan
                .index
                .iter()
                .map(|hc| (hc.path.clone(), serde_json::to_string(hc).unwrap_or_default()))
                .collect();
            let micros = |d: std::time::Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
            // Measured up to the commit transaction (which is part of the hold).
            let timings = layerstack_store::PublishTimings {
                capture_us: micros(captured),
                gate_wait_us: micros(gate_wait),
                gate_hold_us: micros(holding.elapsed()),
                total_us: micros(started.elapsed()),
            };
            let p = store.commit_publish_outcome(session, delta.head, &index, kind, Some(summary(&plan, kind)), paths, Some(timings))?;
            info!(session.id = session, layer.id = p.layer, manifest = p.manifest, outcome = kind.as_str(), "published");
            Ok(())
        })
        .await??;
        Ok(())
    }
}

/// Publish settings the daemon reads from its configuration.
#[derive(Debug, Clone, Default)]
pub struct PublishPolicy {
    /// Paths never published.
    pub exclude: publisher::ExcludePolicy,
    /// Limits of the three-way text merge.
    pub merge: publisher::MergeOptions,
    /// Sessions are mounted with `userxattr` (rootless).
    pub userxattr: bool,
}

impl PublishPolicy {
    fn capture_options(&self) -> publisher::CaptureOptions {
        publisher::CaptureOptions {
            userxattr: self.userxattr,
            exclude: self.exclude.clone(),
            ..Default::default()
        }
    }
}

/// What a publish would do ([`Publisher::dry_run`]).
#[derive(Debug, Clone)]
pub struct DryRun {
    /// The session as it is (unchanged).
    pub session: SessionInfo,
    /// The outcome a publish would have now; `None` when there is nothing to publish.
    pub kind: Option<OutcomeKind>,
    /// The gate's verdict per path.
    pub paths: Vec<PathRecord>,
    /// Summary.
    pub message: String,
}

/// The head's path index in the form the gate takes (see
/// [`publisher::flatten_head_layers`]), from the store's per-layer index.
fn parse_head(
    layers: &[layerstack_store::LayerIndex],
) -> Result<Vec<publisher::HeadChange>, RunError> {
    let parsed = layers
        .iter()
        .map(|(_, changes)| {
            changes
                .iter()
                .map(|(p, c)| {
                    serde_json::from_str(c)
                        .map_err(|e| RunError::Index(escape_path(p), e.to_string()))
                })
                .collect::<Result<Vec<publisher::HeadChange>, RunError>>()
        })
        .collect::<Result<Vec<_>, RunError>>()?;
    Ok(publisher::flatten_head_layers(parsed))
}

/// The reports of a changeset that never reaches the gate (nothing to publish):
/// only its excluded and skipped paths.
fn plan_without_head(cs: &publisher::Changeset) -> publisher::GatePlan {
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

fn records(plan: &publisher::GatePlan) -> Vec<PathRecord> {
    plan.reports
        .iter()
        .map(|r| PathRecord {
            path: escape_path(&r.path),
            status: r.status.as_str().to_string(),
            reason: r.reason.clone(),
        })
        .collect()
}

fn summary(plan: &publisher::GatePlan, kind: OutcomeKind) -> String {
    let count = |st| plan.reports.iter().filter(|r| r.status == st).count();
    let (clean, merged, conflict, excluded) = (
        count(publisher::PathStatus::Clean),
        count(publisher::PathStatus::Merged),
        count(publisher::PathStatus::Conflict),
        count(publisher::PathStatus::Excluded),
    );
    let not_evaluated = plan
        .conflicts()
        .filter(|r| r.reason.starts_with("not evaluated"))
        .count();
    match kind {
        OutcomeKind::Conflict if not_evaluated > 0 => format!(
            "{} path(s) conflict, {not_evaluated} more not evaluated (merging stops at the first conflict); {clean} clean, {merged} merged, {excluded} excluded",
            conflict - not_evaluated
        ),
        OutcomeKind::Conflict => format!(
            "{conflict} path(s) conflict; {clean} clean, {merged} merged, {excluded} excluded"
        ),
        _ => format!(
            "{} path(s): {clean} clean, {merged} merged, {excluded} excluded",
            clean + merged
        ),
    }
}

#[derive(Debug, thiserror::Error)]
enum RunError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Commit(#[from] layerstack_store::PublishError),
    #[error(transparent)]
    Capture(#[from] publisher::CaptureError),
    #[error(transparent)]
    Seal(#[from] publisher::SealError),
    #[error("corrupt path index entry for {0}: {1}")]
    Index(String, String),
    #[error(transparent)]
    Gate(#[from] publisher::GateError),
    #[error(transparent)]
    Apply(#[from] publisher::ApplyError),
    #[error("publish task failed")]
    Join(#[from] tokio::task::JoinError),
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use layerstack_store::{MountSpec, StoreOptions, SNAPSHOT_REF_LABEL};
    use std::collections::BTreeMap;
    use std::os::unix::fs::PermissionsExt;

    /// Root is needed (chown, trusted.* xattrs, the store's sweep). Without it the
    /// test skips, except under `CI=true`, where it fails.
    fn have_root(test: &str) -> bool {
        if nix::unistd::geteuid().is_root() {
            return true;
        }
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{test} needs root under CI=true"
        );
        eprintln!("skipping {test}: needs root");
        false
    }

    const BASE: &[u8] =
        b"# app\r\nkey1 = 1\r\nkey2 = 2\nkey3 = 3\nkey4 = 4\nkey5 = 5\nkey6 = 6\nlast = 7";

    fn write(dir: &Path, rel: &str, content: &[u8]) {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        for d in p.ancestors().skip(1).take(rel.matches('/').count()) {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        std::fs::write(&p, content).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    }

    /// A store with a one-layer image holding etc/app.conf and three sessions on it.
    fn setup(dir: &Path) -> (Arc<Store>, Vec<SessionInfo>) {
        let store = Store::open(&dir.join("root"), &StoreOptions::default()).unwrap();
        let labels = BTreeMap::from([(SNAPSHOT_REF_LABEL.to_string(), "sha256:aaa".to_string())]);
        let (_, spec) = store
            .prepare("ns/1/extract-1 sha256:aaa", "", labels, false)
            .unwrap();
        let dir = match spec {
            MountSpec::Bind { source, .. } => source,
            MountSpec::Overlay {
                upper: Some((u, _)),
                ..
            } => u,
            other => panic!("{other:?}"),
        };
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        write(&dir, "etc/app.conf", BASE);
        write(&dir, "tmp/.keep", b"");
        store
            .commit(
                "ns/2/sha256:aaa",
                "ns/1/extract-1 sha256:aaa",
                BTreeMap::new(),
            )
            .unwrap();
        let mut sessions = Vec::new();
        for (i, c) in ["a", "b", "c"].iter().enumerate() {
            store
                .prepare(
                    &format!("ns/{}/{c}", 3 + i),
                    "ns/2/sha256:aaa",
                    BTreeMap::new(),
                    false,
                )
                .unwrap();
            let s = store.find_session("ns", c).unwrap().unwrap();
            std::fs::set_permissions(&s.upper, std::fs::Permissions::from_mode(0o755)).unwrap();
            sessions.push(s);
        }
        (Arc::new(store), sessions)
    }

    fn edit(line: &str, to: &str) -> Vec<u8> {
        String::from_utf8(BASE.to_vec())
            .unwrap()
            .replace(line, to)
            .into_bytes()
    }

    #[tokio::test]
    async fn merge_dry_run_and_conflict_end_to_end() {
        if !have_root("merge_dry_run_and_conflict_end_to_end") {
            return;
        }
        let t = tempfile::Builder::new()
            .prefix("ls-publish-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let (store, s) = setup(t.path());
        // a: line 2; b: line 6 (separate hunk); c: line 3 (adjacent to a's): conflict.
        write(&s[0].upper, "etc/app.conf", &edit("key2 = 2", "key2 = A"));
        write(&s[1].upper, "etc/app.conf", &edit("key6 = 6", "key6 = B"));
        write(&s[1].upper, "tmp/scratch", b"excluded");
        write(&s[2].upper, "etc/app.conf", &edit("key3 = 3", "key3 = C"));
        let policy = PublishPolicy {
            exclude: publisher::ExcludePolicy::new(["/tmp/**"]).unwrap(),
            ..Default::default()
        };
        let p = Arc::new(Publisher::new(store.clone()).with_policy(policy));

        let a = p.publish(s[0].id, "test").await.unwrap();
        assert_eq!(a.outcome.as_ref().unwrap().kind, OutcomeKind::Committed);

        // Dry run of b: says merged, changes nothing.
        let before = std::fs::read(s[1].upper.join("etc/app.conf")).unwrap();
        let d = p.dry_run(s[1].id).await.unwrap();
        assert_eq!(d.kind, Some(OutcomeKind::Merged), "{d:?}");
        let st: Vec<(&str, &str)> = d
            .paths
            .iter()
            .map(|r| (r.path.as_str(), r.status.as_str()))
            .collect();
        assert_eq!(
            st,
            [("/etc/app.conf", "merged"), ("/tmp/scratch", "excluded")]
        );
        assert!(
            d.message.starts_with("dry run, nothing was changed"),
            "{}",
            d.message
        );
        assert_eq!(
            std::fs::read(s[1].upper.join("etc/app.conf")).unwrap(),
            before
        );
        assert!(
            s[1].upper.join("tmp/scratch").exists(),
            "a dry run applies no policy edits"
        );
        assert!(
            store.session(s[1].id).unwrap().outcome.is_none(),
            "no outcome recorded"
        );

        let b = p.publish(s[1].id, "test").await.unwrap();
        let out = b.outcome.unwrap();
        assert_eq!(out.kind, OutcomeKind::Merged, "{out:?}");
        let layer = store.layer_path(out.layer.unwrap());
        let merged = edit("key2 = 2", "key2 = A");
        let merged = String::from_utf8(merged)
            .unwrap()
            .replace("key6 = 6", "key6 = B")
            .into_bytes();
        assert_eq!(
            std::fs::read(layer.join("etc/app.conf")).unwrap(),
            merged,
            "byte-exact: CRLF lines and no final newline"
        );
        assert!(
            !layer.join("tmp/scratch").exists(),
            "excluded path not published"
        );
        let md = std::fs::metadata(layer.join("etc/app.conf")).unwrap();
        assert_eq!(md.permissions().mode() & 0o7777, 0o644);
        assert!(out
            .paths
            .iter()
            .any(|r| r.path == "/tmp/scratch" && r.status == "excluded"));

        let c = p.publish(s[2].id, "test").await.unwrap();
        let out = c.outcome.unwrap();
        assert_eq!(out.kind, OutcomeKind::Conflict);
        assert_eq!(out.conflicts.len(), 1);
        assert_eq!(out.conflicts[0].path, "/etc/app.conf");
        assert!(
            out.conflicts[0].reason.contains("adjacent"),
            "{}",
            out.conflicts[0].reason
        );
        assert_eq!(
            std::fs::read(s[2].upper.join("etc/app.conf")).unwrap(),
            edit("key3 = 3", "key3 = C"),
            "a rejected upper is kept as it was"
        );

        // A conflicting run can be published again, so it can be dry-run again.
        let d = p.dry_run(s[2].id).await.unwrap();
        assert_eq!(d.kind, Some(OutcomeKind::Conflict), "{d:?}");
        assert!(d
            .paths
            .iter()
            .any(|r| r.path == "/etc/app.conf" && r.status == "conflict"));
        // A finished run cannot: it says why, and reports no outcome kind.
        let d = p.dry_run(s[0].id).await.unwrap();
        assert_eq!(d.kind, None);
        assert!(d.message.starts_with("nothing to publish"), "{}", d.message);
    }

    #[test]
    fn config_merge_defaults_are_the_publisher_defaults() {
        let c = layerstack_config::MergeConfig::default();
        let d = publisher::MergeOptions::default();
        assert_eq!(c.max_file_bytes, d.max_bytes);
        assert_eq!(usize::try_from(c.max_lines).unwrap(), d.max_lines);
        assert_eq!(u128::from(c.timeout_ms), d.timeout.as_millis());
    }

    #[tokio::test]
    async fn opaque_expansion_keeps_excluded_and_skipped_reports() {
        if !have_root("opaque_expansion_keeps_excluded_and_skipped_reports") {
            return;
        }
        let t = tempfile::Builder::new()
            .prefix("ls-publish-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let (store, s) = setup(t.path());
        let policy = PublishPolicy {
            exclude: publisher::ExcludePolicy::new(["/tmp/**"]).unwrap(),
            ..Default::default()
        };
        let p = Arc::new(Publisher::new(store.clone()).with_policy(policy));
        // The head adds etc/new.
        write(&s[0].upper, "etc/new", b"from head\n");
        let a = p.publish(s[0].id, "test").await.unwrap();
        assert_eq!(a.outcome.as_ref().unwrap().kind, OutcomeKind::Committed);
        // b, through its real overlay mount: `rm -rf /etc; mkdir /etc` (the kernel
        // makes it opaque), an excluded file and a socket.
        let spec = store.mounts("ns/4/b").unwrap();
        let m = t.path().join("mnt");
        std::fs::create_dir(&m).unwrap();
        nix::mount::mount(
            Some("overlay"),
            &m,
            Some("overlay"),
            nix::mount::MsFlags::empty(),
            Some(spec.overlay_options().join(",").as_str()),
        )
        .unwrap();
        let ops = || -> std::io::Result<()> {
            std::fs::remove_dir_all(m.join("etc"))?;
            std::fs::create_dir(m.join("etc"))?;
            std::fs::set_permissions(m.join("etc"), std::fs::Permissions::from_mode(0o755))?;
            std::fs::write(m.join("etc/mine"), b"mine\n")?;
            std::fs::write(m.join("tmp/scratch"), b"excluded")?;
            drop(std::os::unix::net::UnixListener::bind(m.join("app.sock"))?);
            Ok(())
        };
        let done = ops();
        nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH).unwrap();
        done.unwrap();
        let want = |paths: &[PathRecord]| {
            let got: Vec<(&str, &str)> = paths
                .iter()
                .map(|r| (r.path.as_str(), r.status.as_str()))
                .collect();
            assert_eq!(
                got,
                [
                    ("/app.sock", "excluded"),
                    ("/etc/app.conf", "clean"),
                    ("/etc/mine", "clean"),
                    ("/tmp/scratch", "excluded"),
                ],
                "{paths:#?}"
            );
        };
        let d = p.dry_run(s[1].id).await.unwrap();
        assert_eq!(d.kind, Some(OutcomeKind::Committed), "{d:?}");
        want(&d.paths);
        let b = p.publish(s[1].id, "test").await.unwrap();
        let out = b.outcome.unwrap();
        assert_eq!(out.kind, OutcomeKind::Committed, "{out:?}");
        want(&out.paths);
        let deleted = out
            .paths
            .iter()
            .find(|r| r.path == "/etc/app.conf")
            .unwrap();
        assert_eq!(deleted.reason, "deleted; untouched on head");
        let layer = store.layer_path(out.layer.unwrap());
        assert!(!layer.join("tmp/scratch").exists());
        assert!(!layer.join("app.sock").exists());
        assert_eq!(std::fs::read(layer.join("etc/mine")).unwrap(), b"mine\n");
        // The expanded directory is plain: the head's etc/new shows through it.
        let a_layer = store.layer_path(a.outcome.as_ref().unwrap().layer.unwrap());
        let view = publisher::LayerView::new(vec![layer, a_layer]);
        assert!(view.lookup(b"etc/new").unwrap().is_some());
    }
}
