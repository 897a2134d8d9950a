//! Admin RPCs of the SandboxGraph: graphs, nodes, attempts (ARCHITECTURE.md §12).

use layerstack_api as api;
use layerstack_engine::policy::ExitPolicy;
use layerstack_engine::store::{AttemptInfo, GraphDump, GroupInfo, NodeInfo, Owner, Provenance};
use layerstack_engine::{NodeMerged, Promoted};
use tonic::Status;

use crate::admin::{engine_status, require, AdminService};

fn key(k: &str) -> Option<String> {
    (!k.is_empty()).then(|| k.to_string())
}

pub(crate) fn group(g: &GroupInfo) -> api::GraphGroup {
    api::GraphGroup {
        name: g.name.clone(),
        stack: g.stack.clone(),
        branch: g.branch.clone(),
        root: g.root.clone(),
        created_ns: g.created_ns,
    }
}

pub(crate) fn node(n: &NodeInfo) -> api::Node {
    api::Node {
        id: n.id.clone(),
        group: n.group.clone(),
        kind: n.kind.as_str().to_string(),
        manifest: n.manifest,
        state: n.state.clone(),
        parents: n.parents.clone(),
        attempt: n.attempt.unwrap_or(0),
        command: n.command.clone().unwrap_or_default(),
        labels: n.labels.clone().into_iter().collect(),
        has_exit_status: n.exit_status.is_some(),
        exit_status: n.exit_status.unwrap_or(0),
        private_bytes: n.private_bytes.unwrap_or(0),
        base_digest: n.base_digest.clone(),
        pruned: n.pruned,
        created_ns: n.created_ns,
        missing_parents: n.missing_parents.clone(),
        declared_parents: n.declared_parents.clone(),
    }
}

pub(crate) fn attempt(a: &AttemptInfo) -> api::Attempt {
    api::Attempt {
        id: a.id,
        node: a.node.clone(),
        session: a.session.unwrap_or(0),
        status: a.status.as_str().to_string(),
        key: a.idempotency_key.clone().unwrap_or_default(),
        result_node: a.result_node.clone().unwrap_or_default(),
        message: a.message.clone().unwrap_or_default(),
        created_ns: a.created_ns,
        ended_ns: a.ended_ns.unwrap_or(0),
    }
}

fn graph(d: &GraphDump) -> api::Graph {
    api::Graph {
        group: Some(group(&d.group)),
        nodes: d.nodes.iter().map(node).collect(),
        attempts: d.attempts.iter().map(attempt).collect(),
    }
}

fn policy(p: &str) -> Result<Option<ExitPolicy>, Status> {
    if p.is_empty() {
        return Ok(None);
    }
    p.parse::<ExitPolicy>()
        .map(Some)
        .map_err(|e| Status::invalid_argument(api::error_chain(&e)))
}

impl AdminService {
    pub(crate) async fn graph_create(
        &self,
        r: api::CreateGraphRequest,
    ) -> Result<api::Graph, Status> {
        require("name", &r.name)?;
        let stack = self.stack_of(&r.namespace, &r.stack).await?;
        let branch = if r.branch.is_empty() {
            self.engine.default_branch().to_string()
        } else {
            r.branch.clone()
        };
        let (g, _) = self
            .engine
            .graph_create(&r.name, &stack, &branch, key(&r.key))
            .await
            .map_err(engine_status)?;
        self.graph_show(api::ShowGraphRequest { name: g.name })
            .await
    }

    pub(crate) async fn graphs(
        &self,
        r: api::ListGraphsRequest,
    ) -> Result<api::ListGraphsResponse, Status> {
        let gs = self.engine.graphs().await.map_err(engine_status)?;
        let (gs, next_page_token) = crate::admin::page(
            gs,
            |g| g.name.as_bytes().to_vec(),
            r.page_size,
            &r.page_token,
        )?;
        Ok(api::ListGraphsResponse {
            graphs: gs.iter().map(group).collect(),
            next_page_token,
        })
    }

    pub(crate) async fn graph_show(&self, r: api::ShowGraphRequest) -> Result<api::Graph, Status> {
        let d = self.engine.graph(&r.name).await.map_err(engine_status)?;
        Ok(graph(&d))
    }

    /// Graph `r.name` in replies of at most [`GRAPH_PAGE`] nodes and
    /// attempts each, the group in the first (a search graph of 100,000 nodes
    /// is tens of MB: past gRPC's 4 MiB message limit in one reply). Each
    /// reply is read from the store when the client takes it
    /// ([`Engine::graph_nodes_page`]): the daemon never holds more than a
    /// page, whatever the graph's size (it held the whole graph before: a
    /// graph of 1,000,000 nodes, P12). The pages are read one after another,
    /// not in one snapshot: a node made during the walk is in it or not.
    pub(crate) async fn graph_pages(
        &self,
        r: api::ShowGraphRequest,
    ) -> Result<GraphStream, Status> {
        let g = self
            .engine
            .graph_group(&r.name)
            .await
            .map_err(engine_status)?;
        let st = PageState {
            engine: self.engine.clone(),
            name: r.name,
            group: Some(group(&g)),
            after_node: None,
            nodes_done: false,
            after_attempt: 0,
            attempts_done: false,
        };
        Ok(Box::pin(futures::stream::unfold(
            Some(st),
            |st| async move {
                let mut st = st?;
                match st.next().await {
                    Ok(Some(page)) => Some((Ok(page), Some(st))),
                    Ok(None) => None,
                    Err(e) => Some((Err(e), None)),
                }
            },
        )))
    }

    pub(crate) async fn node_show(&self, r: api::ShowNodeRequest) -> Result<api::Node, Status> {
        let n = self.engine.node(&r.id).await.map_err(engine_status)?;
        Ok(node(&n))
    }

    async fn attempt_answer(
        &self,
        out: (
            AttemptInfo,
            layerstack_engine::store::SessionInfo,
            layerstack_engine::store::MountSpec,
            bool,
        ),
    ) -> Result<api::AttemptResponse, Status> {
        let (a, s, spec, created) = out;
        Ok(api::AttemptResponse {
            attempt: Some(attempt(&a)),
            session: Some(self.to_api(s).await?),
            mounts: crate::wire::mounts(&spec),
            created,
        })
    }

    pub(crate) async fn attempt_start(
        &self,
        r: api::StartAttemptRequest,
    ) -> Result<api::AttemptResponse, Status> {
        require("node", &r.node)?;
        let p = policy(&r.policy)?;
        let owner = Owner::Sandbox {
            name: if r.owner.is_empty() {
                format!("attempt-of-{}", r.node)
            } else {
                r.owner.clone()
            },
        };
        let out = self
            .engine
            .attempt_start(&r.node, owner, key(&r.key), p)
            .await
            .map_err(engine_status)?;
        self.attempt_answer(out).await
    }

    pub(crate) async fn attempt_retry(
        &self,
        r: api::RetryAttemptRequest,
    ) -> Result<api::AttemptResponse, Status> {
        let p = policy(&r.policy)?;
        let owner = Owner::Sandbox {
            name: if r.owner.is_empty() {
                format!("retry-of-{}", r.attempt)
            } else {
                r.owner.clone()
            },
        };
        let out = self
            .engine
            .attempt_retry(r.attempt, owner, key(&r.key), p)
            .await
            .map_err(engine_status)?;
        self.attempt_answer(out).await
    }

    pub(crate) async fn attempts(
        &self,
        r: api::ListAttemptsRequest,
    ) -> Result<api::ListAttemptsResponse, Status> {
        let list = self.engine.attempts(&r.node).await.map_err(engine_status)?;
        let (list, next_page_token) = crate::admin::page(
            list,
            |a| a.id.to_be_bytes().to_vec(),
            r.page_size,
            &r.page_token,
        )?;
        Ok(api::ListAttemptsResponse {
            attempts: list.iter().map(attempt).collect(),
            next_page_token,
        })
    }

    pub(crate) async fn checkpoint_node(
        &self,
        r: api::CheckpointRequest,
    ) -> Result<api::Node, Status> {
        let s = self
            .resolve(r.session_id, &r.namespace, &r.container)
            .await?;
        crate::wasi::refuse_live(self, s.id, "a checkpoint")?;
        let prov = Provenance {
            command: key(&r.command),
            exit_status: r.has_exit_status.then_some(r.exit_status),
            labels: Default::default(),
            private_bytes: None,
        };
        let n = self
            .engine
            .checkpoint(s.id, key(&r.state), prov, key(&r.key))
            .await
            .map_err(engine_status)?;
        Ok(node(&n))
    }

    pub(crate) async fn node_merge(
        &self,
        r: api::MergeNodesRequest,
    ) -> Result<api::MergeNodesResponse, Status> {
        require("a", &r.a)?;
        require("b", &r.b)?;
        match self
            .engine
            .node_merge(&r.a, &r.b, key(&r.state), key(&r.key))
            .await
            .map_err(engine_status)?
        {
            NodeMerged::Node(n) => Ok(api::MergeNodesResponse {
                node: Some(node(&n)),
                session: None,
            }),
            NodeMerged::Conflict { session } => Ok(api::MergeNodesResponse {
                node: None,
                session: Some(self.to_api(*session).await?),
            }),
        }
    }

    pub(crate) async fn node_promote(
        &self,
        r: api::PromoteNodeRequest,
    ) -> Result<api::PromoteResponse, Status> {
        require("node", &r.node)?;
        if !r.stack.is_empty() {
            let want = self.stack_of(&r.namespace, &r.stack).await?;
            let n = r.node.clone();
            let group = self.engine.node_group(&n).await.map_err(engine_status)?;
            if group.stack != want {
                return Err(Status::invalid_argument(format!(
                    "node {} belongs to stack {} (graph {}), not to {} ({want}): promote it onto a branch of its own stack",
                    r.node, group.stack, group.name, r.stack
                )));
            }
        }
        let branch = if r.branch.is_empty() {
            let n = r.node.clone();
            self.engine
                .node_group(&n)
                .await
                .map_err(engine_status)?
                .branch
        } else {
            r.branch.clone()
        };
        let out = self
            .engine
            .node_promote(&r.node, &branch, key(&r.key))
            .await
            .map_err(engine_status)?;
        let (stack, _) = self
            .engine
            .node_manifest(&r.node)
            .await
            .map_err(engine_status)?;
        let head = self
            .engine
            .branch_head(&stack, &branch)
            .await
            .map_err(engine_status)?;
        Ok(match out {
            Promoted::UpToDate { .. } => api::PromoteResponse {
                result: "up-to-date".into(),
                head,
                session: None,
                message: format!("{branch} already shows node {}", r.node),
            },
            Promoted::FastForward { .. } => api::PromoteResponse {
                result: "fast-forward".into(),
                head,
                session: None,
                message: format!("{branch} now points at node {}", r.node),
            },
            Promoted::Merged { session } => api::PromoteResponse {
                result: "merged".into(),
                head,
                message: format!("node {} merged onto {branch}", r.node),
                session: Some(self.to_api(*session).await?),
            },
            Promoted::Conflict { session } => api::PromoteResponse {
                result: "conflict".into(),
                head,
                message: format!(
                    "refused whole: node {} conflicts with newer work on {branch}, which is unchanged",
                    r.node
                ),
                session: Some(self.to_api(*session).await?),
            },
        })
    }

    pub(crate) async fn node_prune(
        &self,
        r: api::PruneNodeRequest,
    ) -> Result<api::PruneNodeResponse, Status> {
        require("node", &r.node)?;
        let pruned = self
            .engine
            .node_prune(&r.node, key(&r.key))
            .await
            .map_err(engine_status)?;
        Ok(api::PruneNodeResponse { pruned })
    }

    pub(crate) async fn node_set(
        &self,
        r: api::SetNodeRequest,
    ) -> Result<api::SetBranchResponse, Status> {
        require("node", &r.node)?;
        let s = self.resolve(0, &r.namespace, &r.container).await?;
        // The engine takes the session's lock and proves the upper unmounted
        // (EngineError::Mounted otherwise): not here too — the lock is not
        // reentrant.
        let (id, n, k) = (s.id, r.node.clone(), key(&r.key));
        let (_, info, spec) = self
            .engine
            .attach_attempt(id, &n, k)
            .await
            .map_err(engine_status)?;
        Ok(api::SetBranchResponse {
            session: Some(self.to_api(info).await?),
            changed: true,
            mounts: crate::wire::mounts(&spec),
        })
    }
}

/// The replies of `ShowGraph`.
pub(crate) type GraphStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<api::Graph, Status>> + Send>>;

/// Where a `ShowGraph` stream is: the next reply starts after these.
struct PageState {
    engine: std::sync::Arc<layerstack_engine::Engine>,
    name: String,
    /// The group, until the first reply carries it.
    group: Option<api::GraphGroup>,
    after_node: Option<(i64, String)>,
    nodes_done: bool,
    after_attempt: i64,
    attempts_done: bool,
}

impl PageState {
    /// The next reply; `None` after the last. The first is always sent (the
    /// group, an empty graph's too).
    async fn next(&mut self) -> Result<Option<api::Graph>, Status> {
        if self.group.is_none() && self.nodes_done && self.attempts_done {
            return Ok(None);
        }
        let mut nodes = Vec::new();
        if !self.nodes_done {
            // One more than a page: whether another follows.
            nodes = self
                .engine
                .graph_nodes_page(&self.name, self.after_node.clone(), GRAPH_PAGE + 1)
                .await
                .map_err(engine_status)?;
            self.nodes_done = nodes.len() <= GRAPH_PAGE;
            nodes.truncate(GRAPH_PAGE);
            if let Some(n) = nodes.last() {
                self.after_node = Some((n.created_ns, n.id.clone()));
            }
        }
        let mut attempts = Vec::new();
        if !self.attempts_done {
            attempts = self
                .engine
                .graph_attempts_page(&self.name, self.after_attempt, GRAPH_PAGE + 1)
                .await
                .map_err(engine_status)?;
            self.attempts_done = attempts.len() <= GRAPH_PAGE;
            attempts.truncate(GRAPH_PAGE);
            if let Some(a) = attempts.last() {
                self.after_attempt = a.id;
            }
        }
        Ok(Some(api::Graph {
            group: self.group.take(),
            nodes: nodes.iter().map(node).collect(),
            attempts: attempts.iter().map(attempt).collect(),
        }))
    }
}

/// Nodes and attempts per `ShowGraph` reply, at most.
pub(crate) const GRAPH_PAGE: usize = 1000;
