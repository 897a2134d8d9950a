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

    /// [`Self::graph_show`] in replies of at most [`GRAPH_PAGE`] nodes and
    /// attempts each, the group in the first (a search graph of 100,000 nodes is
    /// tens of MB: past gRPC's 4 MiB message limit in one reply).
    pub(crate) async fn graph_pages(
        &self,
        r: api::ShowGraphRequest,
    ) -> Result<GraphStream, Status> {
        let g = self.graph_show(r).await?;
        Ok(Box::pin(futures::stream::iter(
            paginate(g).into_iter().map(Ok),
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

/// Nodes and attempts per `ShowGraph` reply, at most.
pub(crate) const GRAPH_PAGE: usize = 1000;

/// `g` cut into replies of at most [`GRAPH_PAGE`] nodes and attempts, in order;
/// the group in the first. Always at least one reply.
pub(crate) fn paginate(g: api::Graph) -> Vec<api::Graph> {
    let mut nodes = g.nodes.into_iter().peekable();
    let mut attempts = g.attempts.into_iter().peekable();
    let mut out = vec![api::Graph {
        group: g.group,
        nodes: nodes.by_ref().take(GRAPH_PAGE).collect(),
        attempts: attempts.by_ref().take(GRAPH_PAGE).collect(),
    }];
    while nodes.peek().is_some() || attempts.peek().is_some() {
        out.push(api::Graph {
            group: None,
            nodes: nodes.by_ref().take(GRAPH_PAGE).collect(),
            attempts: attempts.by_ref().take(GRAPH_PAGE).collect(),
        });
    }
    out
}

#[cfg(test)]
mod page_tests {
    use super::*;

    #[test]
    fn a_graph_is_cut_into_pages_that_concatenate_to_it() {
        let g = api::Graph {
            group: Some(api::GraphGroup {
                name: "g".into(),
                ..Default::default()
            }),
            nodes: (0..2 * GRAPH_PAGE + 3)
                .map(|i| api::Node {
                    id: format!("n{i}"),
                    ..Default::default()
                })
                .collect(),
            attempts: (0..5)
                .map(|i| api::Attempt {
                    id: i,
                    ..Default::default()
                })
                .collect(),
        };
        let pages = paginate(g.clone());
        assert_eq!(pages.len(), 3);
        assert!(pages[0].group.is_some() && pages[1].group.is_none());
        assert!(pages.iter().all(|p| p.nodes.len() <= GRAPH_PAGE));
        let mut whole = api::Graph::default();
        for p in pages {
            whole.group = whole.group.or(p.group);
            whole.nodes.extend(p.nodes);
            whole.attempts.extend(p.attempts);
        }
        assert_eq!(whole, g);
        assert_eq!(paginate(api::Graph::default()).len(), 1);
    }
}
