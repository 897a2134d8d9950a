//! LayerStack's own admin API (`api/proto/admin.proto`), served on the admin socket.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use layerstack_api as api;
use layerstack_store::{SessionInfo, StoreError};
use tonic::{Request, Response, Status};

use crate::publish::{PublishFailure, Publisher};
use crate::service::error_chain;

/// The admin service.
pub struct AdminService {
    publisher: Arc<Publisher>,
    containerd_address: PathBuf,
    default_branch: String,
}

impl AdminService {
    /// The newest session of `container` in `namespace` (`container` required).
    async fn session_of(&self, namespace: &str, container: &str) -> Result<SessionInfo, Status> {
        require("container", container)?;
        self.publisher
            .find(namespace, container)
            .await
            .map_err(publish_status)
    }

    fn status_response(&self) -> api::StatusResponse {
        api::StatusResponse {
            version: env!("CARGO_PKG_VERSION").to_string(),
            root: self.publisher.store().root().display().to_string(),
            containerd_address: self.containerd_address.display().to_string(),
            events_subscribed: self
                .publisher
                .events_subscribed
                .load(std::sync::atomic::Ordering::SeqCst),
            default_branch: self.default_branch.clone(),
        }
    }
}

impl AdminService {
    pub fn new(
        publisher: Arc<Publisher>,
        containerd_address: PathBuf,
        default_branch: String,
    ) -> Self {
        Self {
            publisher,
            containerd_address,
            default_branch,
        }
    }
}

/// Session as sent on the wire.
pub fn to_api(s: SessionInfo) -> api::Session {
    let timings = s
        .outcome
        .as_ref()
        .and_then(|o| o.timings)
        .map(|t| api::PublishTimings {
            capture_us: t.capture_us,
            gate_wait_us: t.gate_wait_us,
            gate_hold_us: t.gate_hold_us,
            total_us: t.total_us,
        });
    let (outcome, conflicts, layer, message, paths) = match s.outcome {
        Some(o) => (
            o.kind.as_str().to_string(),
            o.conflicts
                .into_iter()
                .map(|c| api::ConflictPath {
                    path: c.path,
                    reason: c.reason,
                })
                .collect(),
            o.layer.unwrap_or(0),
            o.message.unwrap_or_default(),
            o.paths.into_iter().map(path_verdict).collect(),
        ),
        None => (String::new(), vec![], 0, String::new(), vec![]),
    };
    api::Session {
        id: s.id,
        namespace: s.namespace,
        container: s.container,
        key: s.key,
        stack: s.stack,
        branch: s.branch,
        state: s.state.as_str().to_string(),
        outcome,
        conflicts,
        layer,
        message,
        released: s.released,
        runs: s.runs,
        paths,
        dry_run: false,
        timings,
    }
}

fn path_verdict(p: layerstack_store::PathRecord) -> api::PathVerdict {
    api::PathVerdict {
        path: p.path,
        status: p.status,
        reason: p.reason,
    }
}

/// The answer to a dry-run publish: the session as it is, with `outcome`,
/// `conflicts`, `paths` and `message` saying what a publish would do.
fn dry_run_to_api(d: crate::publish::DryRun) -> api::Session {
    let mut out = to_api(d.session);
    out.dry_run = true;
    out.layer = 0;
    out.outcome = d.kind.map(|k| k.as_str().to_string()).unwrap_or_default();
    out.conflicts = d
        .paths
        .iter()
        .filter(|p| p.status == "conflict")
        .map(|p| api::ConflictPath {
            path: p.path.clone(),
            reason: p.reason.clone(),
        })
        .collect();
    out.paths = d.paths.into_iter().map(path_verdict).collect();
    out.message = d.message;
    out
}

fn store_status(e: StoreError) -> Status {
    let msg = error_chain(&e);
    match e {
        StoreError::SessionNotFound(_) | StoreError::BranchNotFound { .. } => {
            Status::not_found(msg)
        }
        StoreError::NoLease(_) => Status::failed_precondition(msg),
        _ => Status::internal(msg),
    }
}

fn publish_status(e: PublishFailure) -> Status {
    let msg = error_chain(&e);
    match e {
        PublishFailure::NoSession { .. } => Status::not_found(msg),
        PublishFailure::Mounted(..) => Status::failed_precondition(msg),
        PublishFailure::Store(e) => store_status(e),
        PublishFailure::Join(_) | PublishFailure::DryRun(_) => Status::internal(msg),
    }
}

fn require(field: &str, v: &str) -> Result<(), Status> {
    if v.is_empty() {
        return Err(Status::invalid_argument(format!("{field} is required")));
    }
    Ok(())
}

#[tonic::async_trait]
impl api::Admin for AdminService {
    async fn set_policy(
        &self,
        req: Request<api::SetPolicyRequest>,
    ) -> Result<Response<api::Session>, Status> {
        let r = req.into_inner();
        let p: layerstack_api::policy::Policy = r
            .policy
            .parse()
            .map_err(|e| Status::invalid_argument(layerstack_api::error_chain(&e)))?;
        let s = self.session_of(&r.namespace, &r.container).await?;
        let _g = self.publisher.lock_session(s.id).await;
        let store = self.publisher.store().clone();
        let out = tokio::task::spawn_blocking(move || store.set_session_policy(s.id, p.as_str()))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(store_status)?;
        Ok(Response::new(to_api(out)))
    }

    async fn status(
        &self,
        _req: Request<api::StatusRequest>,
    ) -> Result<Response<api::StatusResponse>, Status> {
        Ok(Response::new(self.status_response()))
    }

    async fn list_sessions(
        &self,
        _req: Request<api::ListSessionsRequest>,
    ) -> Result<Response<api::ListSessionsResponse>, Status> {
        let store = self.publisher.store().clone();
        let sessions = tokio::task::spawn_blocking(move || store.sessions())
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(store_status)?;
        Ok(Response::new(api::ListSessionsResponse {
            sessions: sessions
                .into_iter()
                .map(|s| api::Session {
                    paths: vec![],
                    ..to_api(s)
                })
                .collect(),
        }))
    }

    async fn wait(&self, req: Request<api::WaitRequest>) -> Result<Response<api::Session>, Status> {
        let r = req.into_inner();
        let deadline = (r.timeout_ms > 0)
            .then(|| tokio::time::Instant::now() + Duration::from_millis(r.timeout_ms.into()));
        loop {
            // Arm the notification before looking, so an outcome recorded in
            // between is not missed.
            let notified = self.publisher.outcomes.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let s = self.session_of(&r.namespace, &r.container).await?;
            if s.outcome.is_some() {
                return Ok(Response::new(to_api(s)));
            }
            let poll = tokio::time::sleep(Duration::from_millis(500));
            match deadline {
                Some(d) => {
                    if tokio::time::Instant::now() >= d {
                        return Err(Status::deadline_exceeded(format!(
                            "container {:?} (session {}) has no outcome after {} ms; its task may still be running",
                            r.container, s.id, r.timeout_ms
                        )));
                    }
                    tokio::select! {
                        _ = &mut notified => {}
                        _ = poll => {}
                        _ = tokio::time::sleep_until(d) => {}
                    }
                }
                None => {
                    tokio::select! {
                        _ = &mut notified => {}
                        _ = poll => {}
                    }
                }
            }
        }
    }

    async fn publish(
        &self,
        req: Request<api::PublishRequest>,
    ) -> Result<Response<api::Session>, Status> {
        let r = req.into_inner();
        let s = self.session_of(&r.namespace, &r.container).await?;
        let why = if r.reason.is_empty() {
            "admin publish".to_string()
        } else {
            r.reason.clone()
        };
        let out = match api::PublishPolicy::from_i32(r.policy) {
            Some(api::PublishPolicy::Publish) => self.publisher.publish(s.id, &why).await,
            Some(api::PublishPolicy::Discard) => self.publisher.discard(s.id, &why).await,
            Some(api::PublishPolicy::Auto) => {
                let exit = r.has_exit_status.then_some(r.exit_status);
                self.publisher.finish(s.id, None, exit, &why).await
            }
            None => {
                return Err(Status::invalid_argument(format!(
                    "unknown publish policy {}",
                    r.policy
                )))
            }
        }
        .map_err(publish_status)?;
        Ok(Response::new(to_api(out)))
    }

    async fn publish_dry_run(
        &self,
        req: Request<api::PublishRequest>,
    ) -> Result<Response<api::Session>, Status> {
        let r = req.into_inner();
        if api::PublishPolicy::from_i32(r.policy) != Some(api::PublishPolicy::Publish) {
            return Err(Status::invalid_argument("a dry run needs policy PUBLISH"));
        }
        let s = self.session_of(&r.namespace, &r.container).await?;
        let d = self.publisher.dry_run(s.id).await.map_err(publish_status)?;
        Ok(Response::new(dry_run_to_api(d)))
    }

    async fn log(
        &self,
        req: Request<api::LogRequest>,
    ) -> Result<Response<api::LogResponse>, Status> {
        let r = req.into_inner();
        require("image", &r.image)?;
        let branch = if r.branch.is_empty() {
            self.default_branch.clone()
        } else {
            r.branch
        };
        let chain =
            crate::containerd::resolve_stack(&self.containerd_address, &r.namespace, &r.image)
                .await
                .map_err(|e| {
                    let m = error_chain(&e);
                    match e {
                        crate::containerd::ContainerdError::ImageNotFound { .. } => {
                            Status::not_found(m)
                        }
                        crate::containerd::ContainerdError::Connect(..) => Status::unavailable(m),
                        _ => Status::internal(m),
                    }
                })?;
        let stack = layerstack_store::stack_id(&r.namespace, &chain);
        let store = self.publisher.store().clone();
        let (st, br) = (stack.clone(), branch.clone());
        let entries = tokio::task::spawn_blocking(move || store.log(&st, &br))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(|e| match e {
                StoreError::BranchNotFound { .. } => Status::not_found(format!(
                    "{}: no container of image {:?} has run on the layerstack snapshotter with branch {branch:?} yet",
                    error_chain(&e),
                    r.image
                )),
                other => store_status(other),
            })?;
        Ok(Response::new(api::LogResponse {
            stack,
            branch,
            entries: entries
                .into_iter()
                .map(|e| api::LogEntry {
                    layer: e.layer,
                    manifest: e.manifest,
                    session: e.session.unwrap_or(0),
                    namespace: e.namespace.unwrap_or_default(),
                    container: e.container.unwrap_or_default(),
                    paths: e.paths,
                    created_ns: e.created_ns,
                })
                .collect(),
        }))
    }

    async fn set_branch(
        &self,
        req: Request<api::SetBranchRequest>,
    ) -> Result<Response<api::SetBranchResponse>, Status> {
        let r = req.into_inner();
        require("branch", &r.branch)?;
        let s = self.session_of(&r.namespace, &r.container).await?;
        // Ordered against a publish of the same session.
        let _g = self.publisher.lock_session(s.id).await;
        if crate::publish::upper_is_mounted(&s.upper) {
            return Err(Status::failed_precondition(format!(
                "session {} is mounted (upperdir {}): its branch cannot change",
                s.id,
                s.upper.display()
            )));
        }
        let store = self.publisher.store().clone();
        let (id, branch) = (s.id, r.branch.clone());
        let (info, spec, changed) =
            tokio::task::spawn_blocking(move || store.rebranch_session(id, &branch))
                .await
                .map_err(|e| Status::internal(e.to_string()))?
                .map_err(|e| match &e {
                    StoreError::Snapshot(inner) => match **inner {
                        layerstack_store::SnapshotError::InvalidArgument(_) => {
                            Status::invalid_argument(error_chain(&e))
                        }
                        layerstack_store::SnapshotError::FailedPrecondition(_) => {
                            Status::failed_precondition(error_chain(&e))
                        }
                        _ => store_status(e),
                    },
                    _ => store_status(e),
                })?;
        let options = spec.overlay_options();
        let mount = match spec {
            layerstack_store::MountSpec::Bind { source, .. } => api::Mount {
                r#type: "bind".into(),
                source: source.display().to_string(),
                options,
            },
            layerstack_store::MountSpec::Overlay { .. } => api::Mount {
                r#type: "overlay".into(),
                source: "overlay".into(),
                options,
            },
        };
        Ok(Response::new(api::SetBranchResponse {
            session: Some(to_api(info)),
            changed,
            mounts: vec![mount],
        }))
    }
}
