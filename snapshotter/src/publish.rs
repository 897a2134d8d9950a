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

use layerstack_publisher as publisher;
use layerstack_store::{escape_path, ConflictRecord, Outcome, OutcomeKind, SessionId, SessionInfo, Store, StoreError};
use tokio::sync::{Mutex, Notify, OwnedMutexGuard};
use tracing::{info, warn};

/// Why a publish could not run (a gate conflict is an outcome, not an error).
#[derive(Debug, thiserror::Error)]
pub enum PublishFailure {
    #[error("no session for container {container:?} in namespace {namespace:?}: was it created with --snapshotter layerstack?")]
    NoSession { namespace: String, container: String },
    #[error("session {0}'s rootfs is still mounted (upperdir {1}); stop the container's task before publishing")]
    Mounted(SessionId, String),
    #[error("store")]
    Store(#[from] StoreError),
    #[error("publish task failed: {0}")]
    Join(String),
}

/// Serializes publishes and wakes `Wait` callers.
pub struct Publisher {
    store: Arc<Store>,
    gate: Mutex<()>,
    sessions: Mutex<HashMap<SessionId, Arc<Mutex<()>>>>,
    /// Notified after every recorded outcome.
    pub outcomes: Notify,
}

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Whether an overlay with this upperdir is mounted in our mount namespace
/// (`/proc/self/mountinfo` super options, `upperdir=` field).
pub fn upper_is_mounted(upper: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let needle = format!("upperdir={}", upper.display());
    info.lines().any(|l| {
        l.split(',')
            .flat_map(|f| f.split(' '))
            .any(|f| f == needle)
    })
}

impl Publisher {
    pub fn new(store: Arc<Store>) -> Self {
        Self {
            store,
            gate: Mutex::new(()),
            sessions: Mutex::new(HashMap::new()),
            outcomes: Notify::new(),
        }
    }

    /// The store this publisher writes to.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Take the per-session lock (held across a publish, and by `Remove`).
    pub async fn lock_session(&self, id: SessionId) -> OwnedMutexGuard<()> {
        let m = {
            let mut map = self.sessions.lock().await;
            map.entry(id).or_insert_with(|| Arc::new(Mutex::new(()))).clone()
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
    pub async fn find(&self, namespace: &str, container: &str) -> Result<SessionInfo, PublishFailure> {
        let (ns, c) = (namespace.to_string(), container.to_string());
        self.blocking(move |s| s.find_session(&ns, &c))
            .await?
            .ok_or_else(|| PublishFailure::NoSession {
                namespace: namespace.to_string(),
                container: container.to_string(),
            })
    }

    /// Publish `session` (taking its lock). Returns the session with its outcome.
    pub async fn publish(&self, session: SessionId, why: &str) -> Result<SessionInfo, PublishFailure> {
        let _g = self.lock_session(session).await;
        self.publish_locked(session, why).await
    }

    /// Publish with the session lock already held by the caller. A session whose
    /// current run already has an outcome, or that holds no lease, is returned
    /// unchanged: nothing is ever published twice.
    pub async fn publish_locked(&self, session: SessionId, why: &str) -> Result<SessionInfo, PublishFailure> {
        let current = self.blocking(move |s| s.session(session)).await?;
        if current.outcome.is_some() || current.lease_manifest.is_none() || current.released {
            return Ok(current);
        }
        if upper_is_mounted(&current.upper) {
            return Err(PublishFailure::Mounted(session, current.upper.display().to_string()));
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
                    message: Some(msg),
                    at_ns: now_ns(),
                };
                self.blocking(move |s| s.record_outcome(session, rec)).await?;
                self.blocking(move |s| s.session(session)).await
            }
        };
        self.outcomes.notify_waiters();
        result
    }

    /// Drop the current run's writes without publishing: outcome `discarded`, a
    /// fresh upper, no lease. A run that already has an outcome is left alone.
    pub async fn discard(&self, session: SessionId, why: &str) -> Result<SessionInfo, PublishFailure> {
        let _g = self.lock_session(session).await;
        let current = self.blocking(move |s| s.session(session)).await?;
        if current.outcome.is_some() || current.lease_manifest.is_none() || current.released {
            return Ok(current);
        }
        if upper_is_mounted(&current.upper) {
            return Err(PublishFailure::Mounted(session, current.upper.display().to_string()));
        }
        let rec = Outcome {
            kind: OutcomeKind::Discarded,
            layer: None,
            conflicts: vec![],
            message: Some(format!("writes dropped: {why}")),
            at_ns: now_ns(),
        };
        self.blocking(move |s| s.record_outcome(session, rec)).await?;
        info!(session.id = session, outcome = "discarded", why, "discarded");
        self.outcomes.notify_waiters();
        self.blocking(move |s| s.session(session)).await
    }

    async fn run(&self, session: SessionId, why: &str) -> Result<(), RunError> {
        let ctx = {
            let store = self.store.clone();
            tokio::task::spawn_blocking(move || store.publish_context(session)).await??
        };
        let upper = ctx.session.upper.clone();
        // Capture and seal outside the gate: they only read the lease and the
        // quiescent upper.
        let changeset = {
            let lowers = ctx.lease_lowers.clone();
            let upper = upper.clone();
            tokio::task::spawn_blocking(move || -> Result<publisher::Changeset, RunError> {
                let view = publisher::LayerView::new(lowers);
                let cs = publisher::capture(&upper, &view)?;
                if !cs.is_empty() {
                    publisher::seal_layer(&upper)?;
                }
                Ok(cs)
            })
            .await??
        };
        for (p, why) in &changeset.skipped {
            warn!(session.id = session, path = %escape_path(p), reason = %why, "not captured");
        }
        if changeset.is_empty() {
            let rec = Outcome {
                kind: OutcomeKind::NoChange,
                layer: None,
                conflicts: vec![],
                message: Some("the session changed nothing".into()),
                at_ns: now_ns(),
            };
            let store = self.store.clone();
            tokio::task::spawn_blocking(move || store.record_outcome(session, rec)).await??;
            info!(session.id = session, outcome = "no-change", why, "published");
            return Ok(());
        }
        let records: Vec<(Vec<u8>, String)> = changeset
            .entries
            .iter()
            .map(|(p, c)| {
                let hc = publisher::HeadChange::from_change(p, c);
                (p.clone(), serde_json::to_string(&hc).unwrap_or_default())
            })
            .collect();
        let count = records.len();

        // The serialized step: check head → gate → prepend.
        let _gate = self.gate.lock().await;
        let store = self.store.clone();
        let lease = ctx.lease_manifest;
        tokio::task::spawn_blocking(move || -> Result<(), RunError> {
            let delta = store.head_delta(session, lease)?;
            let mut head = Vec::with_capacity(delta.changes.len());
            for (p, c) in &delta.changes {
                let hc: publisher::HeadChange = serde_json::from_str(c)
                    .map_err(|e| RunError::Index(escape_path(p), e.to_string()))?;
                head.push(hc);
            }
            match publisher::check_gate(&changeset, &head) {
                publisher::GateDecision::Clean => {
                    let msg = format!("{count} path(s)");
                    let p = store.commit_publish(session, delta.head, &records, Some(msg))?;
                    info!(session.id = session, layer.id = p.layer, manifest = p.manifest, outcome = "committed", "published");
                }
                publisher::GateDecision::Conflict { paths } => {
                    let conflicts: Vec<ConflictRecord> = paths
                        .iter()
                        .map(|c| ConflictRecord {
                            path: escape_path(&c.path),
                            reason: c.reason.clone(),
                        })
                        .collect();
                    info!(session.id = session, outcome = "conflict", paths = conflicts.len(), "rejected");
                    store.record_outcome(
                        session,
                        Outcome {
                            kind: OutcomeKind::Conflict,
                            layer: None,
                            message: Some(format!(
                                "{} path(s) changed on branch head since the lease; nothing of this session was published; its upper is kept",
                                conflicts.len()
                            )),
                            conflicts,
                            at_ns: now_ns(),
                        },
                    )?;
                }
            }
            Ok(())
        })
        .await??;
        Ok(())
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
    #[error("publish task failed")]
    Join(#[from] tokio::task::JoinError),
}
