//! History operations through the engine: squash (on demand and automatic),
//! garbage collection, promote, branches and stack removal (ARCHITECTURE.md §2,
//! §8, §10; seed `000`).
//!
//! **Squash** builds its layer outside the gate — the run it compacts is
//! immutable — then, under the branch's gate, replaces the run in the head as it
//! is by then (publishes that landed meanwhile stay on top: the run is found in
//! the new head, and the layers above it are prepended again). Sessions leased
//! before keep their manifests, so they read their own view; GC frees the old
//! layers once nothing reaches them.
//!
//! **Promote** advances branch `to` to branch `from`'s head: a fast-forward
//! (compare-and-swap of `to`'s head under its gate) when `to`'s head is an
//! ancestor of `from`'s; otherwise a publish through the same gate of what `from`
//! changed since their merge base, by a session owned by the operation — so a
//! stale promote merges or is refused whole, never overwrites newer work.
//! Ancestry and the merge base are decided on the layers as published (squashed
//! layers expanded), so a squash on either side changes neither; when a squash of
//! `from` compacted its own layers together with the merge base's, its changes
//! are copied path by path (`publisher::copy_paths`) rather than flattened.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use layerstack_publisher as publisher;
use layerstack_store::{
    GcReport, LeaseTarget, ManifestId, OutcomeKind, Owner, SessionInfo, Squashed,
};
use tracing::{info, warn};

use crate::error::{error_chain, EngineError};
use crate::Engine;

/// Settings of history maintenance.
#[derive(Debug, Clone)]
pub struct HistorySettings {
    /// A branch whose head shows more published layers than this is squashed
    /// automatically after a publish (0: never automatically). Default 64: with
    /// the image's own layers, a session mounts well under one page of lowerdir
    /// options and far below overlayfs' 500 (ARCHITECTURE.md §5).
    pub squash_threshold: usize,
    /// The newest layers a squash leaves as they are. Default 8.
    pub squash_keep: usize,
    /// Upper directories kept after a conflict (or another retryable outcome) of a
    /// session whose owner is gone are dropped after this long. Default 7 days.
    pub kept_upper_retention: Duration,
}

impl Default for HistorySettings {
    fn default() -> Self {
        Self {
            squash_threshold: 64,
            squash_keep: 8,
            kept_upper_retention: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

/// Manifests that operations in flight read (a publish's observed head, a
/// squash's run): garbage collection keeps them.
#[derive(Default)]
pub(crate) struct Pins(Mutex<HashMap<ManifestId, usize>>);

/// Unpins on drop.
pub(crate) struct Pin {
    pins: Arc<Pins>,
    manifest: ManifestId,
}

impl Pins {
    pub(crate) fn pin(self: &Arc<Self>, manifest: ManifestId) -> Pin {
        *self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(manifest)
            .or_default() += 1;
        Pin {
            pins: self.clone(),
            manifest,
        }
    }

    fn pinned(&self) -> Vec<ManifestId> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .copied()
            .collect()
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut m = self.pins.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.manifest) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.manifest);
            }
        }
    }
}

/// What a promote did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Promoted {
    /// `to` already shows everything `from` has.
    UpToDate { head: ManifestId },
    /// `to` now points at `from`'s head.
    FastForward { head: ManifestId },
    /// What `from` changed since the merge base was published onto `to` by the
    /// operation's session (outcome `committed` or `merged`).
    Merged { session: Box<SessionInfo> },
    /// The merge conflicts (or its publish failed): nothing changed on `to`.
    /// The operation's session (released, nothing kept) holds the outcome — one,
    /// `conflict` or `failed` — with every path's verdict.
    Conflict { session: Box<SessionInfo> },
}

/// What a garbage collection did through the engine.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Collected {
    pub report: GcReport,
    /// Kept uppers of sessions whose owner is gone, dropped after the retention.
    pub uppers_released: u64,
}

/// Squash and GC runs since the engine started, for the daemon's metrics.
#[derive(Debug, Default)]
pub(crate) struct RunCounters {
    squashes: std::sync::atomic::AtomicU64,
    squashed_layers: std::sync::atomic::AtomicU64,
    gcs: std::sync::atomic::AtomicU64,
    gc_layers: std::sync::atomic::AtomicU64,
    gc_bytes: std::sync::atomic::AtomicU64,
}

/// A snapshot of [`Engine::history_runs`]: counts since the engine started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HistoryRuns {
    /// Squashes that committed a squashed layer (automatic and on demand).
    pub squashes: u64,
    /// Layers those squashes replaced.
    pub squashed_layers: u64,
    /// GC runs that completed (periodic and on demand).
    pub gcs: u64,
    /// Layer directories GC freed.
    pub gc_layers: u64,
    /// Real allocated bytes GC freed.
    pub gc_bytes_freed: u64,
}

impl Engine {
    /// Squash and GC runs since the engine started.
    pub fn history_runs(&self) -> HistoryRuns {
        use std::sync::atomic::Ordering::Relaxed;
        let r = &self.runs;
        HistoryRuns {
            squashes: r.squashes.load(Relaxed),
            squashed_layers: r.squashed_layers.load(Relaxed),
            gcs: r.gcs.load(Relaxed),
            gc_layers: r.gc_layers.load(Relaxed),
            gc_bytes_freed: r.gc_bytes.load(Relaxed),
        }
    }

    /// Squashes `branch` of `stack` now: all but its newest
    /// [`HistorySettings::squash_keep`] layers become one squashed layer (see the
    /// module docs). `Ok(None)` when there is nothing to squash.
    ///
    /// Errors: `BranchNotFound`; a failed build, [`EngineError::Squash`] (kind
    /// `Internal`; the staging directory is dropped, no branch moves).
    pub async fn squash(&self, stack: &str, branch: &str) -> Result<Option<Squashed>, EngineError> {
        self.squash_with(stack, branch, 0).await
    }

    async fn squash_with(
        &self,
        stack: &str,
        branch: &str,
        threshold: usize,
    ) -> Result<Option<Squashed>, EngineError> {
        let key = (stack.to_string(), branch.to_string());
        let _one = self.squashes.lock(key.clone()).await;
        let started = std::time::Instant::now();
        let keep = self.settings.history.squash_keep;
        let (s, b) = (stack.to_string(), branch.to_string());
        let Some((head, run)) = self
            .blocking(move |st| st.squash_candidate(&s, &b, threshold, keep))
            .await?
        else {
            return Ok(None);
        };
        let _pin = self.pins.pin(head);
        let store = self.store.clone();
        let userxattr = self.settings.userxattr;
        let run2 = run.clone();
        let (stack2, branch2) = (stack.to_string(), branch.to_string());
        let (dir, guard) = tokio::task::spawn_blocking(move || -> Result<_, EngineError> {
            // Background work: publishes (and their commits under the gate) go
            // first on a busy machine; the squash catches up between bursts.
            let _background = crate::publish::Priority::background();
            let dirs = store.layer_paths(&run2)?;
            // The layers the squash will lie on: the head's view under the run.
            let view = store.manifest_view(&stack2, head)?;
            let below = match dirs.last().and_then(|l| view.iter().position(|v| v == l)) {
                Some(i) => view[i + 1..].to_vec(),
                None => {
                    return Err(EngineError::SquashRunNotInView {
                        stack: stack2,
                        branch: branch2,
                        head,
                    })
                }
            };
            let below = publisher::LayerView::new(below).with_userxattr(userxattr);
            let (dir, guard) = store.staging_dir("squash")?;
            if let Err(source) = publisher::flatten_layers_over(&dirs, &below, &dir, userxattr) {
                let _ = layerstack_store::fs::remove_tree(&dir);
                return Err(EngineError::Squash {
                    stack: stack2,
                    branch: branch2,
                    source,
                });
            }
            if let Err(e) = layerstack_store::failpoints::fail("squash.built", store.root()) {
                let _ = layerstack_store::fs::remove_tree(&dir);
                return Err(layerstack_store::StoreError::Io(dir, e).into());
            }
            Ok((dir, guard))
        })
        .await
        .map_err(|e| EngineError::Join(e.to_string()))??;
        let run_len = run.len() as u64;
        let built = started.elapsed();
        let _gate = self.gates.lock(key).await;
        let (s, b) = (stack.to_string(), branch.to_string());
        let dir2 = dir.clone();
        let r = self
            .blocking(move |st| {
                let now = st.branch_head(&s, &b)?;
                st.commit_squash(&s, &b, now, &run, &dir2)
            })
            .await;
        drop(guard);
        if r.is_err() {
            let _ = layerstack_store::fs::remove_tree(&dir);
        } else {
            use std::sync::atomic::Ordering::Relaxed;
            self.runs.squashes.fetch_add(1, Relaxed);
            self.runs.squashed_layers.fetch_add(run_len, Relaxed);
            let layer = r.as_ref().map(|s| s.layer).unwrap_or_default();
            info!(
                stack,
                branch,
                layer.id = layer,
                automatic = threshold > 0,
                layers = run_len,
                build_ms = built.as_millis() as u64,
                total_ms = started.elapsed().as_millis() as u64,
                "squashed"
            );
        }
        r.map(Some)
    }

    /// After a publish to `branch`: squashes it in the background when its head
    /// is deeper than [`HistorySettings::squash_threshold`] (one squash per branch
    /// at a time; a squash already running covers it).
    pub(crate) fn maybe_squash(self: &Arc<Self>, stack: &str, branch: &str, depth: usize) {
        let threshold = self.settings.history.squash_threshold;
        if threshold == 0 || depth <= threshold {
            return;
        }
        if self
            .squashes
            .is_locked(&(stack.to_string(), branch.to_string()))
        {
            return;
        }
        let me = self.clone();
        let (stack, branch) = (stack.to_string(), branch.to_string());
        tokio::spawn(async move {
            match me.squash_with(&stack, &branch, threshold).await {
                Ok(_) => {}
                Err(e) => {
                    warn!(stack, branch, error = %error_chain(&e), "automatic squash failed; the next publish tries again")
                }
            }
        });
    }

    /// Collects garbage (see `Store::gc`), keeping what operations in flight read,
    /// and first drops kept uppers of released sessions older than
    /// [`HistorySettings::kept_upper_retention`].
    pub async fn gc(self: &Arc<Self>) -> Result<Collected, EngineError> {
        let retention = self.settings.history.kept_upper_retention;
        let cutoff =
            now_ns().saturating_sub(i64::try_from(retention.as_nanos()).unwrap_or(i64::MAX));
        let old: Vec<SessionInfo> = self
            .blocking(|s| s.sessions())
            .await?
            .into_iter()
            .filter(|s| {
                s.released
                    && s.lease_manifest.is_some()
                    && s.outcome
                        .as_ref()
                        .is_some_and(|o| o.kind.is_retryable() && o.at_ns < cutoff)
            })
            .collect();
        let mut released = 0;
        for s in old {
            match self.discard(s.id, "kept upper past its retention").await {
                Ok(_) => released += 1,
                Err(e) => {
                    warn!(session.id = s.id, error = %error_chain(&e), "cannot drop a kept upper")
                }
            }
        }
        let pinned = self.pins.pinned();
        let report = self.blocking(move |s| s.gc(&pinned)).await?;
        {
            use std::sync::atomic::Ordering::Relaxed;
            self.runs.gcs.fetch_add(1, Relaxed);
            self.runs
                .gc_layers
                .fetch_add(report.layers.len() as u64, Relaxed);
            self.runs.gc_bytes.fetch_add(report.bytes_freed, Relaxed);
        }
        Ok(Collected {
            report,
            uppers_released: released,
        })
    }

    /// Advances branch `to` of `stack` to branch `from`'s head (see the module
    /// docs); `operation` names the operation (blame shows `operation:<id>`).
    ///
    /// Errors: `BranchNotFound`; `FailedPrecondition` when the merge base can
    /// no longer be built (see `Store::merge_base`); `Mounted`/store errors of
    /// the merge publish.
    pub async fn promote(
        self: &Arc<Self>,
        stack: &str,
        from: &str,
        to: &str,
        operation: &str,
    ) -> Result<Promoted, EngineError> {
        layerstack_store::validate_branch(to).map_err(|why| {
            EngineError::InvalidArgument(format!("cannot promote to {to:?}: {why}"))
        })?;
        let (s, f) = (stack.to_string(), from.to_string());
        let from_head = self.blocking(move |st| st.branch_head(&s, &f)).await?;
        self.promote_manifest(stack, from_head, to, operation, None)
            .await
    }

    /// Advances branch `to` of `stack` to manifest `from_head` (a branch head, a
    /// graph node's root): a fast-forward by compare-and-swap under `to`'s gate
    /// when `to`'s head is an ancestor, else a merge publish through the gate,
    /// refused whole on conflict. Ancestry, the merge base and what `from_head`
    /// changed since are computed on the layers as published (squashed layers
    /// expanded: `Store::merge_base`), so a squash on either side changes none
    /// of them.
    ///
    /// `key`: the caller's idempotency key. The merge's operation session carries
    /// it, so a call repeated after a crash that struck once its publish had
    /// committed returns that publish instead of making a second one.
    pub async fn promote_manifest(
        self: &Arc<Self>,
        stack: &str,
        from_head: ManifestId,
        to: &str,
        operation: &str,
        key: Option<&str>,
    ) -> Result<Promoted, EngineError> {
        let (s, t) = (stack.to_string(), to.to_string());
        let to_head = self.blocking(move |st| st.branch_head(&s, &t)).await?;
        if from_head == to_head {
            return Ok(Promoted::UpToDate { head: to_head });
        }
        // Compared as published: a squash on either side changes no ancestry.
        let (fl, tl) = self
            .blocking(move |st| {
                Ok((
                    st.expand_layers(&st.manifest(from_head)?)?,
                    st.expand_layers(&st.manifest(to_head)?)?,
                ))
            })
            .await?;
        if tl.ends_with(&fl) {
            return Ok(Promoted::UpToDate { head: to_head });
        }
        if fl.ends_with(&tl) {
            // Fast-forward, under `to`'s gate, by compare-and-swap.
            let _gate = self.gates.lock((stack.to_string(), to.to_string())).await;
            let (s, t) = (stack.to_string(), to.to_string());
            self.blocking(move |st| st.move_branch(&s, &t, to_head, from_head))
                .await?;
            info!(stack, to, manifest = from_head, "promoted (fast-forward)");
            return Ok(Promoted::FastForward { head: from_head });
        }
        // A merge: what `from_head` changed since the merge base, published onto `to`.
        let _pin = self.pins.pin(from_head);
        let s = stack.to_string();
        let mb = self
            .blocking(move |st| st.merge_base(&s, from_head, to_head))
            .await?;
        // GC keeps it (and the member directories it may be built of) until the
        // operation's session leases it.
        let _base_pin = self.pins.pin(mb.manifest);
        let base = mb.manifest;
        let owner = Owner::Operation {
            id: operation.to_string(),
        };
        let op_key = key.map(|k| format!("promote:{k}"));
        let (s, t) = (stack.to_string(), to.to_string());
        let (mut session, _, mut created) = self
            .create_session(
                owner.clone(),
                &s,
                LeaseTarget::Manifest {
                    manifest: base,
                    branch: t.clone(),
                },
                op_key,
            )
            .await?;
        if !created {
            let done = session.outcome.as_ref().map(|o| o.kind);
            if matches!(
                done,
                Some(OutcomeKind::Committed | OutcomeKind::Merged | OutcomeKind::NoChange)
            ) {
                info!(
                    stack,
                    to,
                    session.id = session.id,
                    "promote already published (same key)"
                );
                return Ok(Promoted::Merged {
                    session: Box::new(session),
                });
            }
            // The keyed run died before publishing: a fresh one.
            (session, _, created) = self
                .create_session(
                    owner,
                    &s,
                    LeaseTarget::Manifest {
                        manifest: base,
                        branch: t,
                    },
                    None,
                )
                .await?;
        }
        debug_assert!(created);
        let store = self.store.clone();
        let upper = session.upper.clone();
        let userxattr = self.settings.userxattr;
        let stack_id = stack.to_string();
        tokio::task::spawn_blocking(move || -> Result<(), EngineError> {
            let failed = |e: &dyn std::error::Error| {
                EngineError::InvalidArgument(format!(
                    "building the promote's changes failed: {}",
                    error_chain(e)
                ))
            };
            match &mb.a_layers {
                // Whole layers above the merge base: flattened as they are.
                Some(run) => {
                    let dirs = store.layer_paths(run)?;
                    publisher::flatten_layers(&dirs, &upper, userxattr).map_err(|e| failed(&e))?;
                }
                // A squashed layer of `from` also compacted layers of the merge
                // base: only the paths `from` changed since, as `from` shows them.
                None => {
                    let paths: Vec<publisher::CopyPath> = store
                        .paths_changed(&mb.a_changes)?
                        .into_iter()
                        .map(|(path, replaced)| publisher::CopyPath { path, replaced })
                        .collect();
                    let view =
                        publisher::LayerView::new(store.manifest_view(&stack_id, from_head)?)
                            .with_userxattr(userxattr);
                    let base_view =
                        publisher::LayerView::new(store.manifest_view(&stack_id, mb.manifest)?)
                            .with_userxattr(userxattr);
                    publisher::copy_paths(&view, &base_view, &paths, &upper, userxattr)
                        .map_err(|e| failed(&e))?;
                }
            }
            Ok(())
        })
        .await
        .map_err(|e| EngineError::Join(e.to_string()))??;
        let out = self
            .publish(session.id, &format!("promote onto {to} ({operation})"))
            .await?;
        layerstack_store::failpoints::hit("promote.operation_published");
        let id = session.id;
        let kind = out.outcome.as_ref().map(|o| o.kind);
        let result = match kind {
            Some(OutcomeKind::Committed | OutcomeKind::Merged | OutcomeKind::NoChange) => {
                info!(stack, to, session.id = id, outcome = ?kind, "promoted (merge)");
                Promoted::Merged {
                    session: Box::new(out),
                }
            }
            _ => {
                // Refused whole (or failed): the run ended with that outcome, the
                // one announced. What the operation flattened is dropped with its
                // session — no second (`discarded`) outcome for the same run; the
                // outcome's message says nothing is kept.
                self.blocking(move |st| st.release_session_dropping(id))
                    .await?;
                self.changed();
                info!(stack, to, session.id = id, outcome = ?kind, "promote refused; nothing kept");
                return Ok(Promoted::Conflict {
                    session: Box::new(self.session(id).await?),
                });
            }
        };
        self.blocking(move |st| st.release_session(id, false))
            .await?;
        Ok(result)
    }

    /// Removes stack `id` (see `Store::remove_stack`); with `force`, live sessions
    /// are discarded first — unless one is mounted somewhere (refused: a running
    /// container reads the stack's layers). Then collects its layers.
    pub async fn remove_stack(
        self: &Arc<Self>,
        id: &str,
        force: bool,
    ) -> Result<Collected, EngineError> {
        if force {
            let sessions: Vec<SessionInfo> = self
                .blocking(|s| s.sessions())
                .await?
                .into_iter()
                .filter(|s| s.stack == id && !s.released)
                .collect();
            for s in &sessions {
                if self.upper_mounted(&s.upper).await? {
                    return Err(EngineError::Mounted(s.id, s.upper.clone()));
                }
            }
        }
        let i = id.to_string();
        self.blocking(move |s| s.remove_stack(&i, force)).await?;
        self.gc().await
    }

    /// Runs garbage collection every `every` until the engine is dropped.
    pub fn spawn_periodic_gc(self: &Arc<Self>, every: Duration) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(me) = weak.upgrade() else { return };
                if let Err(e) = me.gc().await {
                    warn!(error = %error_chain(&e), "periodic garbage collection failed");
                }
            }
        });
    }
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
