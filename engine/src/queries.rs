//! What front ends read and the small changes they ask for, as engine verbs:
//! the daemon's admin, history, graph, metrics and event handlers call these,
//! never the store (ARCHITECTURE.md §4: "exposes verbs, never its store").
//!
//! Reads run on a blocking thread against the store's read connections (one
//! consistent snapshot each, never waiting for the writer). The changes here
//! take what orders them against the engine's other work: deleting a branch
//! takes its gate (no publish of it is between its re-check and its commit),
//! an exit policy and an attempt's node are set under the session's lock.

use layerstack_store::{
    AttemptInfo, BranchInfo, DiskUsage, GraphDump, GroupInfo, IndexEntry, LayerId, LogEntry,
    ManifestId, MountSpec, NodeInfo, Outcome, PathRecord, PathStatus, PublishId, SessionId,
    SessionInfo, StackInfo,
};

use crate::{Engine, EngineError};

impl Engine {
    /// The branch a session uses when nothing names one (configured; `main`).
    pub fn default_branch(&self) -> &str {
        self.store.default_branch()
    }

    /// The store's root directory.
    pub fn root(&self) -> &std::path::Path {
        self.store.root()
    }

    /// The layer of `layers` (a manifest's, newest first) that compacted layer
    /// `member` (a squashed layer holding it, at any depth), or `None`. Blocking:
    /// for callers already on a blocking thread (an export's preparation).
    /// Error: `Corrupt`.
    pub fn compacted_into(
        &self,
        layers: &[LayerId],
        member: LayerId,
    ) -> Result<Option<LayerId>, EngineError> {
        Ok(self.store.compacted_into(layers, member)?)
    }

    /// Every session, oldest first.
    pub async fn sessions(&self) -> Result<Vec<SessionInfo>, EngineError> {
        self.blocking(|s| s.sessions()).await
    }

    /// Outcome `id`. Error: `Corrupt` when it does not exist.
    pub async fn outcome(&self, id: PublishId) -> Result<Outcome, EngineError> {
        self.blocking(move |s| s.outcome(id)).await
    }

    /// Outcome `id`'s per-path verdicts in path order, a page at a time: at most
    /// `limit` after `after` (exclusive), only `status` when given. Checks that
    /// the outcome exists (`Corrupt` otherwise).
    pub async fn outcome_paths(
        &self,
        id: PublishId,
        after: Option<Vec<u8>>,
        limit: usize,
        status: Option<PathStatus>,
    ) -> Result<Vec<PathRecord>, EngineError> {
        self.blocking(move |s| {
            s.outcome(id)?;
            s.outcome_paths(id, after.as_deref(), limit, status)
        })
        .await
    }

    /// The stack `spec` names in containerd namespace `namespace`: a stack id, or
    /// a base digest (`sha256:…` or 12+ hex digits, unique in the namespace).
    /// `None` when nothing matches. Error: `InvalidArgument` (ambiguous prefix).
    pub async fn resolve_stack(
        &self,
        namespace: &str,
        spec: &str,
    ) -> Result<Option<String>, EngineError> {
        let (ns, sp) = (namespace.to_string(), spec.to_string());
        // A short read on the caller's worker: a sandbox's create asks it
        // first, and a hand-off to the blocking pool costs a wake-up.
        self.blocking_here(move |s| s.resolve_stack(&ns, &sp)).await
    }

    /// The stack of image `chain` (its top chainID) in `namespace`, made from
    /// the image's committed layers if it is not a stack yet; `None` when
    /// containerd never unpacked that image into this snapshotter.
    pub async fn ensure_image_stack(
        &self,
        namespace: &str,
        chain: &str,
    ) -> Result<Option<String>, EngineError> {
        let (ns, c) = (namespace.to_string(), chain.to_string());
        self.blocking(move |s| s.ensure_image_stack(&ns, &c)).await
    }

    /// Every stack.
    pub async fn stacks(&self) -> Result<Vec<StackInfo>, EngineError> {
        self.blocking(|s| s.stacks()).await
    }

    /// The base layers of `stack`, newest first. Error: `StackNotFound`.
    pub async fn base_layers(&self, stack: &str) -> Result<Vec<LayerId>, EngineError> {
        let st = stack.to_string();
        self.blocking(move |s| s.base_layers(&st)).await
    }

    /// The branches of `stack`.
    pub async fn branches(&self, stack: &str) -> Result<Vec<BranchInfo>, EngineError> {
        let st = stack.to_string();
        self.blocking(move |s| s.branches(&st)).await
    }

    /// The head manifest of `branch` on `stack`. Error: `BranchNotFound`.
    pub async fn branch_head(&self, stack: &str, branch: &str) -> Result<ManifestId, EngineError> {
        let (st, br) = (stack.to_string(), branch.to_string());
        self.blocking(move |s| s.branch_head(&st, &br)).await
    }

    /// `branch`'s head and the number of layers it shows.
    /// Error: `BranchNotFound`.
    pub async fn branch_depth(
        &self,
        stack: &str,
        branch: &str,
    ) -> Result<(ManifestId, usize), EngineError> {
        let (st, br) = (stack.to_string(), branch.to_string());
        self.blocking(move |s| {
            let h = s.branch_head(&st, &br)?;
            Ok((h, s.manifest_depth(h)?))
        })
        .await
    }

    /// The layers manifest `id` shows, newest first. Error: `Corrupt`.
    pub async fn manifest(&self, id: ManifestId) -> Result<Vec<LayerId>, EngineError> {
        self.blocking(move |s| s.manifest(id)).await
    }

    /// The distinct layers the manifests `heads` show together.
    pub async fn layers_of(&self, heads: Vec<ManifestId>) -> Result<usize, EngineError> {
        self.blocking(move |s| {
            let mut all = std::collections::BTreeSet::new();
            for h in heads {
                all.extend(s.manifest(h)?);
            }
            Ok(all.len())
        })
        .await
    }

    /// `branch`'s log on `stack`, newest first (squashed layers with their
    /// members). Error: `BranchNotFound`.
    pub async fn log(&self, stack: &str, branch: &str) -> Result<Vec<LogEntry>, EngineError> {
        let (st, br) = (stack.to_string(), branch.to_string());
        self.blocking(move |s| s.log(&st, &br)).await
    }

    /// The path index of `layer`, by path. Error: `LayerNotFound`.
    pub async fn layer_index(&self, layer: LayerId) -> Result<Vec<IndexEntry>, EngineError> {
        self.blocking(move |s| s.layer_index(layer)).await
    }

    /// The store's accounting (ARCHITECTURE.md §10). Walks every layer and upper:
    /// seconds on a large store.
    pub async fn disk_usage(&self) -> Result<DiskUsage, EngineError> {
        self.blocking(|s| s.disk_usage()).await
    }

    /// Creates branch `name` on `stack` at `from`'s head, or at layer `at` of its
    /// log (see `Store::create_branch`). Errors: `InvalidArgument`,
    /// `FailedPrecondition` (exists), `BranchNotFound`.
    pub async fn create_branch(
        &self,
        stack: &str,
        name: &str,
        from: &str,
        at: Option<LayerId>,
    ) -> Result<BranchInfo, EngineError> {
        let (st, n, f) = (stack.to_string(), name.to_string(), from.to_string());
        self.blocking(move |s| s.create_branch(&st, &n, &f, at))
            .await
    }

    /// Deletes branch `name` of `stack` under its gate: a publish of the branch
    /// is never between its re-check and its commit when the branch goes (it
    /// fails `BranchNotFound` at its re-check instead, its writes kept).
    /// Errors: `BranchNotFound`, `FailedPrecondition` (the default branch,
    /// sessions on it).
    pub async fn delete_branch(&self, stack: &str, name: &str) -> Result<(), EngineError> {
        let _gate = self.gates.lock((stack.to_string(), name.to_string())).await;
        let (st, n) = (stack.to_string(), name.to_string());
        self.blocking(move |s| s.delete_branch(&st, &n)).await
    }

    /// Records session `id`'s exit policy (`on-exit`, `on-success`, `never`,
    /// `checkpoint`; an invalid value is recorded too, so that the run is
    /// refused rather than published), under the session's lock: never between
    /// a publish's decision and its end. Error: `SessionNotFound`.
    pub async fn set_exit_policy(
        &self,
        id: SessionId,
        policy: String,
    ) -> Result<SessionInfo, EngineError> {
        let _g = self.lock_session(id).await;
        self.blocking(move |s| s.set_session_policy(id, &policy))
            .await
    }

    /// Makes session `id` (a container's, never mounted yet) an attempt of node
    /// `node`, moving its lease to the node's manifest — under the session's
    /// lock, its upper proven unmounted everywhere. Returns the attempt, the
    /// session and its mount spec now.
    ///
    /// Errors: [`EngineError::Mounted`]; `InvalidArgument` (pruned node, other
    /// stack); `FailedPrecondition` (the run ended).
    pub async fn attach_attempt(
        &self,
        id: SessionId,
        node: &str,
        key: Option<String>,
    ) -> Result<(AttemptInfo, SessionInfo, MountSpec), EngineError> {
        let _g = self.lock_session(id).await;
        let s = self.session(id).await?;
        self.ensure_quiescent(&s).await?;
        let n = node.to_string();
        self.blocking(move |st| st.attach_attempt(id, &n, key.as_deref()))
            .await
    }

    /// Every SandboxGraph.
    pub async fn graphs(&self) -> Result<Vec<GroupInfo>, EngineError> {
        self.blocking(|s| s.groups()).await
    }

    /// Graph `name` whole: its group, nodes and attempts. Error: `NotFound`.
    pub async fn graph(&self, name: &str) -> Result<GraphDump, EngineError> {
        let n = name.to_string();
        self.blocking(move |s| s.graph(&n)).await
    }

    /// Group `name`. Error: `NotFound`.
    pub async fn graph_group(&self, name: &str) -> Result<GroupInfo, EngineError> {
        let n = name.to_string();
        self.blocking(move |s| s.group(&n)).await
    }

    /// At most `limit` nodes of graph `name` after `after` (the `created_ns`
    /// and id of the previous page's last; `None`: from the first), in
    /// creation order ([`layerstack_store::Store::graph_nodes_page`]).
    pub async fn graph_nodes_page(
        &self,
        name: &str,
        after: Option<(i64, String)>,
        limit: usize,
    ) -> Result<Vec<NodeInfo>, EngineError> {
        let n = name.to_string();
        self.blocking(move |s| {
            s.graph_nodes_page(&n, after.as_ref().map(|(t, i)| (*t, i.as_str())), limit)
        })
        .await
    }

    /// At most `limit` attempts of graph `name` with an id above `after`
    /// ([`layerstack_store::Store::graph_attempts_page`]).
    pub async fn graph_attempts_page(
        &self,
        name: &str,
        after: i64,
        limit: usize,
    ) -> Result<Vec<AttemptInfo>, EngineError> {
        let n = name.to_string();
        self.blocking(move |s| s.graph_attempts_page(&n, after, limit))
            .await
    }

    /// Node `id`. Error: `NotFound`.
    pub async fn node(&self, id: &str) -> Result<NodeInfo, EngineError> {
        let n = id.to_string();
        self.blocking(move |s| s.node(&n)).await
    }

    /// The graph node `id` belongs to. Error: `NotFound`.
    pub async fn node_group(&self, id: &str) -> Result<GroupInfo, EngineError> {
        let n = id.to_string();
        self.blocking(move |s| s.node_group(&n)).await
    }

    /// The stack and manifest of node `id`. Error: `NotFound`.
    pub async fn node_manifest(&self, id: &str) -> Result<(String, ManifestId), EngineError> {
        let n = id.to_string();
        self.blocking(move |s| s.node_manifest(&n)).await
    }

    /// The attempts of node `node`, oldest first.
    pub async fn attempts(&self, node: &str) -> Result<Vec<AttemptInfo>, EngineError> {
        let n = node.to_string();
        self.blocking(move |s| s.attempts(&n)).await
    }

    /// The attempt session `id` runs (its newest), if it is an attempt of a
    /// graph node.
    pub async fn attempt_of_session(
        &self,
        id: SessionId,
    ) -> Result<Option<AttemptInfo>, EngineError> {
        self.blocking(move |s| s.attempt_of_session(id)).await
    }
}
