//! The SandboxGraph through the engine (ARCHITECTURE.md §12; seed `002`,
//! phase 2): attempts, checkpoints, merges, promotes, prunes and retries.
//!
//! * **checkpoint** turns an attempt's quiescent upper into a child node's layer
//!   by rename — the same capture and sealing as a publish, but no gate: a new
//!   child never conflicts, and nothing is copied.
//! * **merge** publishes what node `b` changed since the lowest common ancestor
//!   onto a working branch at node `a`'s root, through the same gate as every
//!   publish (disjoint changes land, text merges, conflicts refuse whole); the
//!   result becomes a merge node. A conflict makes no node.
//! * **promote** moves a branch to a node's root: fast-forward, merge, or refused
//!   whole — a stale promote never overwrites newer work.
//! * **prune** releases a subtree's leases unless something live reaches it;
//!   GC then collects what nothing else reaches.
//!
//! Every mutating operation takes the client's idempotency key; the answer is
//! stored with the effect (see the store's `graph` module).

use std::sync::Arc;

use layerstack_publisher::{self as publisher, LayerView};
use layerstack_store::{
    AttemptInfo, AttemptStatus, GroupInfo, MountSpec, NodeInfo, OutcomeKind, OutcomeRecord, Owner,
    Provenance, PublishTimings, RolloutEnding, SessionId, SessionInfo,
};
use tracing::{info, warn};

use crate::error::{error_chain, EngineError, RunError};
use crate::history::Promoted;
use crate::index::{index_of, records};
use crate::Engine;

/// What a node merge did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeMerged {
    /// The merge node.
    Node(Box<NodeInfo>),
    /// The changes conflict, or the merge's publish failed (an I/O error): no
    /// node; the operation's session holds the outcome (`conflict` with the
    /// verdicts, or `failed` with the reason).
    Conflict { session: Box<SessionInfo> },
}

fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// The arguments of a keyed promote: the node and the branch.
fn promote_args(node: &str, branch: &str) -> layerstack_store::KeyArgs {
    layerstack_store::KeyArgs::new()
        .with("node", node)
        .with("branch", branch)
}

impl Engine {
    /// Creates graph `name` on `stack` rooted at `branch`'s head.
    pub async fn graph_create(
        &self,
        name: &str,
        stack: &str,
        branch: &str,
        key: Option<String>,
    ) -> Result<(GroupInfo, NodeInfo), EngineError> {
        let (n, s, b) = (name.to_string(), stack.to_string(), branch.to_string());
        self.blocking(move |st| st.create_group(&n, &s, &b, key.as_deref()))
            .await
    }

    /// Starts an attempt of `node` in a new session of `owner` (Mode B: the
    /// caller mounts the returned spec and runs its command).
    pub async fn attempt_start(
        &self,
        node: &str,
        owner: Owner,
        key: Option<String>,
        exit_policy: Option<crate::policy::ExitPolicy>,
    ) -> Result<(AttemptInfo, SessionInfo, MountSpec, bool), EngineError> {
        let opts = layerstack_store::SessionOptions {
            exit_policy: exit_policy.map(|p| p.as_str().to_string()),
            ignore_mtime: false,
            daemon_owned: false,
            id_map: None,
        };
        self.attempt_start_with(node, owner, key, opts).await
    }

    /// [`Engine::attempt_start`] with every option the session records in the
    /// same transaction ([`layerstack_store::SessionOptions`]; `exit_policy`
    /// `None`: `checkpoint`).
    pub async fn attempt_start_with(
        &self,
        node: &str,
        owner: Owner,
        key: Option<String>,
        opts: layerstack_store::SessionOptions,
    ) -> Result<(AttemptInfo, SessionInfo, MountSpec, bool), EngineError> {
        let n = node.to_string();
        self.blocking_here(move |st| st.start_attempt_with(&n, &owner, key.as_deref(), &opts))
            .await
    }

    /// Retries attempt `attempt`: a new attempt of the same node.
    pub async fn attempt_retry(
        &self,
        attempt: i64,
        owner: Owner,
        key: Option<String>,
        exit_policy: Option<crate::policy::ExitPolicy>,
    ) -> Result<(AttemptInfo, SessionInfo, MountSpec, bool), EngineError> {
        let a = self.blocking(move |st| st.attempt(attempt)).await?;
        self.attempt_start(&a.node, owner, key, exit_policy).await
    }

    /// Checkpoints the attempt running in session `id` (taking its lock): see the
    /// module docs. `state`: the node's logical state (JSON, default `{}`).
    ///
    /// Errors: `FailedPrecondition` (not a running attempt), `Mounted`,
    /// `InvalidArgument` (state); a failed capture is an error, the upper kept.
    pub async fn checkpoint(
        self: &Arc<Self>,
        id: SessionId,
        state: Option<String>,
        prov: Provenance,
        key: Option<String>,
    ) -> Result<NodeInfo, EngineError> {
        let me = self.clone();
        tokio::spawn(async move {
            let _g = me.lock_session(id).await;
            me.checkpoint_locked(id, state, prov, key, None).await
        })
        .await
        .map_err(|e| EngineError::Join(e.to_string()))?
    }

    /// [`Engine::checkpoint`] with the session lock held by the caller.
    /// `rollout`: the session is a rollout attempt's sandbox, which ends with
    /// this checkpoint in the same transaction ([`Store::commit_checkpoint`]).
    pub async fn checkpoint_locked(
        &self,
        id: SessionId,
        state: Option<String>,
        mut prov: Provenance,
        key: Option<String>,
        rollout: Option<RolloutEnding>,
    ) -> Result<NodeInfo, EngineError> {
        if let Some(k) = &key {
            let k2 = k.clone();
            let args = layerstack_store::checkpoint_args(id, state.as_deref().unwrap_or("{}"));
            if let Some(node) = self
                .blocking(move |st| st.graph_op(&k2, "checkpoint", &args))
                .await?
            {
                return self.blocking(move |st| st.node(&node)).await;
            }
        }
        let current = self.session(id).await?;
        if current.run_finished() || current.lease_manifest.is_none() {
            return Err(EngineError::Store(
                layerstack_store::StoreError::FailedPrecondition(format!(
                    "session {id}'s run already ended: nothing to checkpoint"
                )),
            ));
        }
        self.ensure_quiescent(&current).await?;
        let store = self.store.clone();
        let settings = self.settings.clone();
        let state = state.unwrap_or_else(|| "{}".to_string());
        let started = std::time::Instant::now();
        let node = tokio::task::spawn_blocking(move || -> Result<NodeInfo, EngineError> {
            let run = || -> Result<(layerstack_store::Staged, Provenance, u64), RunError> {
                let ctx = store.publish_context(id)?;
                let upper = ctx.session.upper.clone();
                let view =
                    LayerView::new(ctx.lease_lowers.clone()).with_userxattr(settings.userxattr);
                let cs = publisher::capture_with(
                    &upper,
                    &view,
                    &settings.capture_options(&ctx.session),
                )?;
                if !cs.edits.is_empty() {
                    publisher::prepare_upper(&upper, &cs, settings.userxattr)?;
                }
                crate::publish::seal(&store, &upper, settings.userxattr)?;
                // A child never conflicts: plan against no head changes at all.
                let files = publisher::FsFiles {
                    lease: view.clone(),
                    head: view,
                    upper: upper.clone(),
                    userxattr: settings.userxattr,
                };
                let plan = publisher::plan_gate(&cs, &[], &files, &settings.merge)?;
                prov.private_bytes = layerstack_store::fs::disk_usage(&upper)
                    .ok()
                    .map(|(b, _)| u64::try_from(b).unwrap_or(0));
                let staged = store.stage_publish(id, &index_of(&plan), &records(&plan))?;
                // Blame, like any layer that enters history: against the lease
                // (the node's view), which is also the "head" a child plans on.
                // A promote then shows these lines' owners, not `unknown`.
                crate::blame::stage(
                    &store,
                    &settings,
                    &ctx.session,
                    (ctx.lease_manifest, ctx.lease_manifest),
                    &[],
                    &plan,
                    &upper,
                    staged.layer,
                    None,
                );
                if let Err(e) =
                    layerstack_store::failpoints::fail("checkpoint.staged", store.root())
                {
                    let _ = store.abandon_staged(staged);
                    return Err(layerstack_store::StoreError::Io(upper.clone(), e).into());
                }
                Ok((staged, prov, cs.written_bytes()))
            };
            let (staged, prov, capture_bytes) = run().map_err(|e| EngineError::Run(Box::new(e)))?;
            let timings = PublishTimings {
                capture_us: micros(started.elapsed()),
                total_us: micros(started.elapsed()),
                capture_bytes,
                ..Default::default()
            };
            match store.commit_checkpoint(
                id,
                staged,
                &state,
                &prov,
                Some(timings),
                key.as_deref(),
                rollout.as_ref(),
            ) {
                Ok(n) => Ok(n),
                Err(e) => {
                    let _ = store.abandon_staged(staged);
                    Err(e.into())
                }
            }
        })
        .await
        .map_err(|e| EngineError::Join(e.to_string()))??;
        let s = self.session(id).await?;
        self.notify(&s);
        info!(session.id = id, node = %node.id, "checkpointed");
        Ok(node)
    }

    /// An exit that checkpoints (policy `checkpoint`, a sandbox close): the
    /// checkpoint, or on failure the outcome `failed` with the upper kept (the
    /// reason names what to do). Returns the session as it is then.
    pub(crate) async fn checkpoint_or_fail_locked(
        &self,
        id: SessionId,
        state: Option<String>,
        prov: Provenance,
        rollout: Option<RolloutEnding>,
    ) -> Result<SessionInfo, EngineError> {
        match self.checkpoint_locked(id, state, prov, None, rollout).await {
            Ok(_) => self.session(id).await,
            // Not a failed step: the caller may wait for the holder's mount to
            // go (a sandbox close retries) and checkpoint then.
            Err(e @ EngineError::Mounted(..)) => Err(e),
            Err(e) => {
                warn!(session.id = id, error = %error_chain(&e), "checkpoint failed");
                let rec = failed_checkpoint(&e);
                self.blocking(move |s| s.record_outcome(id, rec, None))
                    .await?;
                self.after_outcome(id).await
            }
        }
    }

    /// Merges node `b` into node `a` over their lowest common ancestor (see the
    /// module docs). `operation` names the merge's session in blame.
    pub async fn node_merge(
        self: &Arc<Self>,
        a: &str,
        b: &str,
        state: Option<String>,
        key: Option<String>,
    ) -> Result<NodeMerged, EngineError> {
        if let Some(k) = &key {
            let k2 = k.clone();
            let args = layerstack_store::merge_args(&[a, b], state.as_deref().unwrap_or("{}"));
            if let Some(node) = self
                .blocking(move |st| st.graph_op(&k2, "merge", &args))
                .await?
            {
                let n = self.blocking(move |st| st.node(&node)).await?;
                return Ok(NodeMerged::Node(Box::new(n)));
            }
        }
        if a == b {
            return Err(EngineError::InvalidArgument(format!(
                "cannot merge node {a} with itself: a merge node needs two different parents (start an attempt on {a} to build on it)"
            )));
        }
        let (an, bn) = (a.to_string(), b.to_string());
        let (na, nb, group) = self
            .blocking(move |st| Ok((st.node(&an)?, st.node(&bn)?, st.node_group(&an)?)))
            .await?;
        if na.group != nb.group {
            return Err(EngineError::InvalidArgument(format!(
                "nodes {a} and {b} belong to different graphs ({} and {})",
                na.group, nb.group
            )));
        }
        let op = key
            .clone()
            .unwrap_or_else(|| format!("merge-{a}-{b}-{}", std::process::id()));
        let work = format!(
            "{}{}/{op}",
            layerstack_store::INTERNAL_BRANCH_PREFIX,
            group.name
        );
        let (s, w) = (group.stack.clone(), work.clone());
        let am = na.manifest;
        self.blocking(move |st| st.create_branch_at(&s, &w, am))
            .await?;
        layerstack_store::failpoints::hit("merge.branched");
        let merged = self
            .promote_manifest(&group.stack, nb.manifest, &work, &op, None)
            .await;
        layerstack_store::failpoints::hit("merge.published");
        let (s, w) = (group.stack.clone(), work.clone());
        let head = self.blocking(move |st| st.branch_head(&s, &w)).await;
        let (s, w) = (group.stack.clone(), work.clone());
        let _ = self.blocking(move |st| st.drop_branch(&s, &w)).await;
        let merged = merged?;
        let head = head?;
        layerstack_store::failpoints::hit("merge.branch_dropped");
        match merged {
            Promoted::Conflict { session } => Ok(NodeMerged::Conflict { session }),
            _ => {
                let state = state.unwrap_or_else(|| "{}".to_string());
                let g = group.name.clone();
                let (a, b) = (a.to_string(), b.to_string());
                let n = self
                    .blocking(move |st| {
                        st.add_merge_node(&g, head, &[&a, &b], &state, key.as_deref())
                    })
                    .await?;
                info!(node = %n.id, "merge node");
                Ok(NodeMerged::Node(Box::new(n)))
            }
        }
    }

    /// Promotes node `node`'s root onto `branch` of its stack (see the module
    /// docs). Same `key` → the stored answer, one effect.
    pub async fn node_promote(
        self: &Arc<Self>,
        node: &str,
        branch: &str,
        key: Option<String>,
    ) -> Result<Promoted, EngineError> {
        layerstack_store::validate_branch(branch).map_err(|why| {
            EngineError::InvalidArgument(format!("cannot promote to {branch:?}: {why}"))
        })?;
        if let Some(k) = &key {
            let k2 = k.clone();
            let args = promote_args(node, branch);
            if let Some(r) = self
                .blocking(move |st| st.graph_op(&k2, "promote", &args))
                .await?
            {
                return self.stored_promote(&r).await;
            }
        }
        let n = node.to_string();
        let (stack, manifest) = self.blocking(move |st| st.node_manifest(&n)).await?;
        let op = key
            .clone()
            .unwrap_or_else(|| format!("promote-{node}-{}", std::process::id()));
        layerstack_store::failpoints::hit("promote.started");
        let out = self
            .promote_manifest(&stack, manifest, branch, &op, key.as_deref())
            .await?;
        layerstack_store::failpoints::hit("promote.moved");
        if let (Some(k), false) = (&key, matches!(out, Promoted::Conflict { .. })) {
            let answer = match &out {
                Promoted::UpToDate { head } => format!("up-to-date:{head}"),
                Promoted::FastForward { head } => format!("fast-forward:{head}"),
                Promoted::Merged { session } => format!("merged:{}", session.id),
                Promoted::Conflict { .. } => unreachable!("a conflict is not recorded"),
            };
            let k = k.clone();
            let args = promote_args(node, branch);
            self.blocking(move |st| st.record_graph_op(&k, "promote", &answer, &args))
                .await?;
        }
        Ok(out)
    }

    /// The answer a promote recorded for its key: the same variant again.
    async fn stored_promote(&self, r: &str) -> Result<Promoted, EngineError> {
        let bad = || {
            EngineError::Store(layerstack_store::StoreError::corrupt(
                "graph_ops",
                0,
                format!("promote answer {r:?}"),
            ))
        };
        let (kind, v) = r.split_once(':').ok_or_else(bad)?;
        let v: i64 = v.parse().map_err(|_| bad())?;
        Ok(match kind {
            "up-to-date" => Promoted::UpToDate { head: v },
            "fast-forward" => Promoted::FastForward { head: v },
            "merged" => Promoted::Merged {
                session: Box::new(self.session(v).await?),
            },
            _ => return Err(bad()),
        })
    }

    /// Prunes `node`'s subtree (see `Store::prune_node`).
    pub async fn node_prune(
        &self,
        node: &str,
        key: Option<String>,
    ) -> Result<Vec<String>, EngineError> {
        let n = node.to_string();
        self.blocking(move |st| st.prune_node(&n, key.as_deref()))
            .await
    }

    /// After an outcome that ended an attempt's run without a checkpoint: the
    /// attempt (`attempt`, the session's latest, read with the outcome) ends
    /// `failed` with the outcome as its reason — `interrupted` when an
    /// infrastructure failure ended the run (outcome `interrupted`).
    pub(crate) async fn end_attempt_of(&self, s: &SessionInfo, attempt: Option<AttemptInfo>) {
        let Some(o) = &s.outcome else { return };
        let Some(a) = attempt else {
            return;
        };
        if a.status != AttemptStatus::Running {
            return;
        }
        let msg = format!(
            "its run ended with outcome {}{}",
            o.kind.as_str(),
            o.message
                .as_deref()
                .map(|m| format!(": {m}"))
                .unwrap_or_default()
        );
        let status = if o.kind == OutcomeKind::Interrupted {
            // An infrastructure failure, not the task's: a retry is the way on.
            AttemptStatus::Interrupted
        } else if o.kind == OutcomeKind::Discarded || !o.kind.is_retryable() {
            AttemptStatus::Failed
        } else {
            return;
        };
        if let Err(e) = self
            .blocking(move |st| st.end_attempt(a.id, status, &msg))
            .await
        {
            warn!(attempt = a.id, error = %error_chain(&e), "cannot end the attempt");
        }
    }

    /// At start, before serving: graph merges and promotes the last run left
    /// half-done died with it. Their working branches (`.graph/…`) are dropped
    /// and their operation sessions discarded and released; a layer such an
    /// operation published stays only while a branch, lease or node reaches it
    /// (GC collects the rest). The same call with the same idempotency key then
    /// redoes the operation whole. Returns how many were cleaned up.
    pub async fn recover_operations(self: &Arc<Self>) -> Result<usize, EngineError> {
        layerstack_store::failpoints::hit("recover.started");
        let (ops, branches) = self
            .blocking(|st| {
                let ops: Vec<(SessionId, bool)> = st
                    .sessions()?
                    .into_iter()
                    .filter(|s| matches!(s.owner, Owner::Operation { .. }) && !s.released)
                    .map(|s| (s.id, s.outcome.is_some()))
                    .collect();
                Ok((ops, st.graph_work_branches()?))
            })
            .await?;
        let n = ops.len() + branches.len();
        for (id, ended) in ops {
            if ended {
                // Its run has its outcome (a refused promote the daemon died
                // before releasing): no second one, nothing kept.
                self.blocking(move |st| st.release_session_dropping(id))
                    .await?;
                info!(
                    session.id = id,
                    "released the session of an operation the last daemon left half-done"
                );
                layerstack_store::failpoints::hit("recover.operation_released");
                continue;
            }
            if let Err(e) = self
                .discard(id, "its operation ended with the last daemon")
                .await
            {
                warn!(session.id = id, error = %error_chain(&e), "cannot discard a dead operation's session");
            }
            self.blocking(move |st| st.release_session(id, false))
                .await?;
            info!(
                session.id = id,
                "released the session of an operation the last daemon left half-done"
            );
            layerstack_store::failpoints::hit("recover.operation_released");
        }
        for (stack, branch) in branches {
            let (s, b) = (stack.clone(), branch.clone());
            self.blocking(move |st| st.drop_branch(&s, &b)).await?;
            info!(stack = %stack, branch = %branch, "dropped the working branch of a merge the last daemon left half-done");
            layerstack_store::failpoints::hit("recover.branch_dropped");
        }
        Ok(n)
    }

    /// At start: attempts whose session vanished end `abandoned`.
    pub async fn recover_graph(&self) -> Result<usize, EngineError> {
        self.blocking(|st| st.abandon_orphan_attempts()).await
    }
}

/// The record of a failed checkpoint, for callers that end a run with one.
pub(crate) fn failed_checkpoint(e: &EngineError) -> OutcomeRecord {
    OutcomeRecord {
        kind: OutcomeKind::Failed,
        message: Some(format!(
            "checkpoint failed: {}; nothing was published, the upper is kept: checkpoint again or discard",
            error_chain(e)
        )),
        paths: Vec::new(),
        timings: None,
        interrupted_by: None,
    }
}
