//! The rollout fabric's RPCs (docs/fabric.md): thin calls into the engine's
//! `rollout` verbs, plus the one step only the daemon can take — starting an
//! attempt's daemon-owned sandbox (`owned::create`) between the engine's
//! begin and attach.

use layerstack_api as api;
use layerstack_engine::store::{
    Evaluator, NodeStats, RolloutAttempt, RolloutBegin, RolloutResult, RunAudit, RunInfo,
    SampleInfo, SampleKey,
};
use layerstack_engine::{rollout_session_key, RolloutKeep};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::admin::{engine_status, require, AdminService};

/// Bytes per ReadBlob chunk.
const CHUNK: usize = 64 * 1024;

fn key_from(k: Option<api::SampleKey>) -> Result<SampleKey, Status> {
    let k = k.ok_or_else(|| {
        Status::invalid_argument("sample is required: give run, step, prompt and sample")
    })?;
    require("sample.run", &k.run)?;
    require("sample.prompt", &k.prompt)?;
    Ok(SampleKey {
        run: k.run,
        step: k.step,
        prompt: k.prompt,
        sample: k.sample,
    })
}

fn key_to(k: &SampleKey) -> api::SampleKey {
    api::SampleKey {
        run: k.run.clone(),
        step: k.step,
        prompt: k.prompt.clone(),
        sample: k.sample,
    }
}

fn run_to(r: RunInfo) -> api::Run {
    api::Run {
        name: r.name,
        graph: r.graph,
        labels: r.labels.into_iter().collect(),
        created_ns: r.created_ns,
    }
}

fn sample_to(s: &SampleInfo) -> api::Sample {
    api::Sample {
        key: Some(key_to(&s.key)),
        node: s.node.clone(),
        has_reward: s.reward.is_some(),
        reward: s.reward.unwrap_or_default(),
        reward_attempt: s.reward_attempt.unwrap_or_default(),
        attempts: s.attempts,
        max_attempt: s.max_attempt,
        running: s.running.clone(),
        task_failed_attempt: s.task_failed_attempt.unwrap_or_default(),
    }
}

pub(crate) fn attempt_to(a: &RolloutAttempt) -> api::RolloutAttempt {
    api::RolloutAttempt {
        id: a.id,
        sample: Some(key_to(&a.key)),
        attempt: a.attempt,
        node: a.node.clone(),
        session: a.session.unwrap_or_default(),
        graph_attempt: a.graph_attempt.unwrap_or_default(),
        policy: a.policy.clone(),
        has_seed: a.seed.is_some(),
        seed: a.seed.unwrap_or_default(),
        status: a.status.as_str().to_string(),
        infra_kind: a.infra_kind.clone().unwrap_or_default(),
        has_reward: a.reward.is_some(),
        reward: a.reward.unwrap_or_default(),
        accepted: a.accepted.unwrap_or(false),
        applied: a.applied,
        evaluator: a.evaluator.as_ref().map(|e| api::Evaluator {
            name: e.name.clone(),
            version: e.version.clone(),
            digest: e.digest.clone(),
        }),
        result_node: a.result_node.clone().unwrap_or_default(),
        trajectory: a.trajectory.clone().unwrap_or_default(),
        artifacts: a
            .artifacts
            .iter()
            .map(|x| api::Artifact {
                name: x.name.clone(),
                digest: x.digest.clone(),
                size: x.size,
            })
            .collect(),
        backpropagated: a.backprop.is_some(),
        backprop: a.backprop.unwrap_or_default(),
        message: a.message.clone(),
        created_ns: a.created_ns,
        ended_ns: a.ended_ns.unwrap_or_default(),
        worker: a.worker.clone().unwrap_or_default(),
    }
}

fn stats_to(s: NodeStats) -> api::NodeStats {
    api::NodeStats {
        node: s.node,
        visits: s.visits,
        value_sum: s.value_sum,
        has_prior: s.prior.is_some(),
        prior: s.prior.unwrap_or_default(),
        frontier: s.frontier,
    }
}

fn audit_to(a: RunAudit) -> api::RunAudit {
    api::RunAudit {
        samples: a.samples,
        rewarded: a.rewarded,
        attempts: a.attempts,
        running: a.running,
        completed: a.completed,
        task_failed: a.task_failed,
        infra_failed: a.infra_failed.into_iter().collect(),
        backprops: a.backprops,
        violations: a.violations,
        by_worker: a.by_worker.into_iter().collect(),
    }
}

fn result_from(r: &api::EndRolloutRequest) -> Result<RolloutResult, Status> {
    Ok(match r.status.as_str() {
        "completed" => RolloutResult::Completed {
            reward: r.reward,
            accepted: r.accepted,
        },
        "task_failed" => RolloutResult::TaskFailed,
        "infra_failed" => {
            require("infra_kind", &r.infra_kind)?;
            RolloutResult::InfraFailed {
                kind: r.infra_kind.clone(),
            }
        }
        s => {
            return Err(Status::invalid_argument(format!(
                "status {s:?} is not one of completed, task_failed, infra_failed"
            )))
        }
    })
}

impl AdminService {
    pub(crate) async fn run_create(
        &self,
        r: api::CreateRunRequest,
    ) -> Result<api::CreateRunResponse, Status> {
        require("name", &r.name)?;
        require("graph", &r.graph)?;
        let (run, created) = self
            .engine
            .create_run(&r.name, &r.graph, r.labels.into_iter().collect())
            .await
            .map_err(engine_status)?;
        Ok(api::CreateRunResponse {
            run: Some(run_to(run)),
            created,
        })
    }

    pub(crate) async fn run_list(&self) -> Result<api::ListRunsResponse, Status> {
        let runs = self.engine.runs().await.map_err(engine_status)?;
        Ok(api::ListRunsResponse {
            runs: runs.into_iter().map(run_to).collect(),
        })
    }

    /// `BeginRollout`: the engine's begin, the attempt's sandbox (an
    /// idempotent daemon-owned `CreateSession` keyed by the attempt), then
    /// the engine's attach. A crash between any two steps is repaired by the
    /// same call again: the begin finds the attempt, the create finds its
    /// session (or the restart ended the attempt `infra_failed`).
    pub(crate) async fn rollout_begin(
        &self,
        r: api::BeginRolloutRequest,
    ) -> Result<api::BeginRolloutResponse, Status> {
        let key = key_from(r.sample)?;
        require("node", &r.node)?;
        require("policy", &r.policy)?;
        let worker = (!r.worker.is_empty()).then(|| r.worker.clone());
        if worker.is_some() && r.wasi.is_some() {
            return Err(Status::invalid_argument(format!(
                "worker {:?} with wasi: a remote attempt's sandbox is its worker's, not this daemon's; give one of them",
                r.worker
            )));
        }
        let begun = self
            .engine
            .begin_rollout(RolloutBegin {
                key: key.clone(),
                attempt: r.attempt,
                node: r.node.clone(),
                policy: r.policy,
                seed: r.has_seed.then_some(r.seed),
                worker: worker.clone(),
            })
            .await
            .map_err(engine_status)?;
        let (a, created) = match begun {
            layerstack_engine::store::Begun::Rewarded(s) => {
                return Ok(api::BeginRolloutResponse {
                    attempt: None,
                    created: false,
                    rewarded: true,
                    sample: Some(sample_to(&s)),
                    session: None,
                })
            }
            layerstack_engine::store::Begun::Attempt { attempt, created } => (attempt, created),
        };
        let answer = |a: &RolloutAttempt, session: Option<api::Session>, sample: SampleInfo| {
            api::BeginRolloutResponse {
                attempt: Some(attempt_to(a)),
                created,
                rewarded: false,
                sample: Some(sample_to(&sample)),
                session,
            }
        };
        if a.status != layerstack_engine::store::RolloutStatus::Running || a.worker.is_some() {
            // Ended already, or remote: no sandbox here.
            let sample = self.engine.sample(key).await.map_err(engine_status)?;
            return Ok(answer(&a, None, sample));
        }
        let made = self
            .sandbox_create(api::CreateSessionRequest {
                node: a.node.clone(),
                name: format!("rollout-{}", a.id),
                idempotency_key: rollout_session_key(a.id),
                wait_ms: r.wait_ms,
                sandbox: match r.wasi {
                    Some(_) => r.sandbox,
                    None => Some(r.sandbox.unwrap_or_default()),
                },
                wasi: r.wasi,
                ..Default::default()
            })
            .await;
        let made = match made {
            Ok(m) => m,
            Err(st) => {
                // No sandbox: the attempt ends as an infrastructure failure
                // (the caller retries the sample with the next attempt) —
                // except `busy`, which starts nothing and may be asked again.
                if st.code() != tonic::Code::ResourceExhausted {
                    let kind = "sandbox-start".to_string();
                    let _ = self
                        .engine
                        .end_rollout(
                            a.id,
                            RolloutResult::InfraFailed { kind },
                            None,
                            None,
                            Vec::new(),
                            None,
                            st.message().to_string(),
                            RolloutKeep::Discard,
                            None,
                        )
                        .await;
                }
                return Err(st);
            }
        };
        let session = made
            .session
            .ok_or_else(|| Status::internal("CreateSession answered no session"))?;
        let a = self
            .engine
            .attach_rollout(a.id, session.id)
            .await
            .map_err(engine_status)?;
        let sample = self.engine.sample(key).await.map_err(engine_status)?;
        Ok(answer(&a, Some(session), sample))
    }

    pub(crate) async fn rollout_end(
        &self,
        r: api::EndRolloutRequest,
    ) -> Result<api::RolloutAttempt, Status> {
        let result = result_from(&r)?;
        let keep = match api::end_rollout_request::Keep::from_i32(r.keep) {
            Some(api::end_rollout_request::Keep::Checkpoint) => RolloutKeep::Checkpoint {
                state: (!r.state.is_empty()).then_some(r.state),
                labels: r.labels.into_iter().collect(),
            },
            // A discard records no node: a state or labels given with it
            // would be dropped without a word (CloseSession refuses the same).
            Some(api::end_rollout_request::Keep::Discard)
                if !r.state.is_empty() || !r.labels.is_empty() =>
            {
                return Err(Status::invalid_argument(format!(
                    "rollout attempt {}: state and labels are recorded by a checkpoint only, and keep DISCARD records none: end with keep CHECKPOINT, or leave them out",
                    r.attempt
                )));
            }
            Some(api::end_rollout_request::Keep::Discard) => RolloutKeep::Discard,
            None => {
                return Err(Status::invalid_argument(format!(
                    "keep {} is not CHECKPOINT or DISCARD",
                    r.keep
                )))
            }
        };
        // Refused before the sandbox is touched (the store checks again).
        let finite = |what: &str, v: f64| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(Status::invalid_argument(format!(
                    "{what} {v} is not a finite number"
                )))
            }
        };
        if let RolloutResult::Completed { reward, .. } = &result {
            finite("reward", *reward)?;
        }
        if r.has_backprop {
            finite("backprop", r.backprop)?;
            if matches!(result, RolloutResult::InfraFailed { .. }) {
                return Err(Status::invalid_argument(
                    "an infra_failed attempt has no value to backpropagate: end it without backprop",
                ));
            }
        }
        // A live sandbox's init is stopped first, as CloseSession does: its
        // mounts go with it, then the engine checkpoints or discards its upper.
        let a = self
            .engine
            .rollout(r.attempt)
            .await
            .map_err(engine_status)?;
        // A result node is a remote attempt's: refused before a local
        // attempt's sandbox is touched (the engine and the store check again).
        if !r.result_node.is_empty() {
            if a.worker.is_none() {
                return Err(Status::failed_precondition(format!(
                    "rollout attempt {} is local (it has no worker): its checkpoint is its sandbox's; end it without result_node",
                    a.id
                )));
            }
            if matches!(keep, RolloutKeep::Discard) {
                return Err(Status::invalid_argument(format!(
                    "rollout attempt {}: keep DISCARD with result_node {}: a discarded result keeps no node; omit result_node or keep CHECKPOINT",
                    a.id, r.result_node
                )));
            }
        }
        // A checkpoint's state is checked before the sandbox is stopped (a
        // refusal after would leave the attempt's init killed and the
        // attempt running).
        if let RolloutKeep::Checkpoint {
            state: Some(state), ..
        } = &keep
        {
            layerstack_engine::store::validate_state(state).map_err(|e| {
                Status::invalid_argument(format!(
                    "EndRollout.state: {} (give a JSON object)",
                    api::error_chain(&e)
                ))
            })?;
        }
        let live = match (a.status, a.session) {
            (layerstack_engine::store::RolloutStatus::Running, Some(sid)) => Some(sid),
            _ => None,
        };
        if let Some(sid) = live {
            self.stop_init(sid);
            let ready = crate::wasi::release(self, sid, false).await;
            crate::wasi::closed(self, ready);
        }
        let evaluator = r.evaluator.map(|e| Evaluator {
            name: e.name,
            version: e.version,
            digest: e.digest,
        });
        let a = self
            .engine
            .end_rollout(
                r.attempt,
                result,
                evaluator,
                (!r.trajectory.is_empty()).then_some(r.trajectory),
                r.artifacts.into_iter().map(|x| (x.name, x.data)).collect(),
                r.has_backprop.then_some(r.backprop),
                r.message,
                keep,
                (!r.result_node.is_empty()).then_some(r.result_node),
            )
            .await;
        if let (Err(_), Some(sid)) = (&a, live) {
            self.close_failed(sid);
        }
        let a = a.map_err(engine_status)?;
        Ok(attempt_to(&a))
    }

    pub(crate) async fn rollout_list(
        &self,
        r: api::ListRolloutsRequest,
    ) -> Result<api::ListRolloutsResponse, Status> {
        require("run", &r.run)?;
        let after = match r.page_token.as_str() {
            "" => 0,
            t => t.parse::<i64>().map_err(|_| {
                Status::invalid_argument(format!(
                    "bad page_token {t:?}: pass the next_page_token of the previous page"
                ))
            })?,
        };
        let size = match r.page_size {
            0 => 1000,
            n => (n as usize).min(10_000),
        };
        let mut list = self
            .engine
            .rollouts(&r.run, r.has_step.then_some(r.step), after, size + 1)
            .await
            .map_err(engine_status)?;
        let next = if list.len() > size {
            list.truncate(size);
            list.last().map(|a| a.id.to_string()).unwrap_or_default()
        } else {
            String::new()
        };
        Ok(api::ListRolloutsResponse {
            attempts: list.iter().map(attempt_to).collect(),
            next_page_token: next,
        })
    }

    pub(crate) async fn store_fsck(&self, r: api::FsckRequest) -> Result<api::FsckReport, Status> {
        let f = self
            .engine
            .fsck(r.repair, r.content)
            .await
            .map_err(engine_status)?;
        let unrepaired = u64::try_from(f.unrepaired()).unwrap_or(u64::MAX);
        Ok(api::FsckReport {
            layers: f.layers,
            manifests: f.manifests,
            leases: f.leases,
            sessions: f.sessions,
            paths: f.paths,
            runs: f.runs,
            outcomes: f.outcomes,
            problems: f
                .problems
                .into_iter()
                .map(|p| api::FsckProblem {
                    kind: p.kind.to_string(),
                    subject: p.subject,
                    detail: p.detail,
                    repaired: p.repaired,
                })
                .collect(),
            unrepaired,
        })
    }

    pub(crate) async fn sample_get(&self, k: api::SampleKey) -> Result<api::Sample, Status> {
        let key = key_from(Some(k))?;
        let s = self.engine.sample(key).await.map_err(engine_status)?;
        Ok(sample_to(&s))
    }

    pub(crate) async fn run_audit(&self, r: api::AuditRunRequest) -> Result<api::RunAudit, Status> {
        require("run", &r.run)?;
        let a = self.engine.audit_run(&r.run).await.map_err(engine_status)?;
        Ok(audit_to(a))
    }

    pub(crate) async fn blob_read(
        &self,
        r: api::ReadBlobRequest,
    ) -> Result<crate::owned::Stream<api::FileChunk>, Status> {
        require("digest", &r.digest)?;
        let bytes = self.engine.blob(&r.digest).await.map_err(engine_status)?;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            for c in bytes.chunks(CHUNK) {
                if tx
                    .send(Ok(api::FileChunk { data: c.to_vec() }))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
        Ok(Box::pin(ReceiverStream::new(rx)))
    }

    pub(crate) async fn stats_get(
        &self,
        r: api::GetNodeStatsRequest,
    ) -> Result<api::GetNodeStatsResponse, Status> {
        require("node", &r.node)?;
        let (me, kids) = self
            .engine
            .node_stats(&r.node, r.children)
            .await
            .map_err(engine_status)?;
        Ok(api::GetNodeStatsResponse {
            node: Some(stats_to(me)),
            children: kids.into_iter().map(stats_to).collect(),
        })
    }

    pub(crate) async fn prior_set(
        &self,
        r: api::SetPriorRequest,
    ) -> Result<api::NodeStats, Status> {
        require("node", &r.node)?;
        let s = self
            .engine
            .set_prior(&r.node, r.prior)
            .await
            .map_err(engine_status)?;
        Ok(stats_to(s))
    }

    pub(crate) async fn frontier_change(
        &self,
        r: api::FrontierRequest,
        lease: bool,
    ) -> Result<api::FrontierResponse, Status> {
        require("holder", &r.holder)?;
        if lease && r.nodes.is_empty() {
            return Err(Status::invalid_argument(
                "nodes is required: name the nodes to lease",
            ));
        }
        let nodes = self
            .engine
            .frontier(&r.holder, r.nodes, lease)
            .await
            .map_err(engine_status)?;
        Ok(api::FrontierResponse { nodes })
    }
}
