//! LayerStack's own admin API (`api/proto/admin.proto`), served on the admin
//! socket: thin calls into the engine.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use layerstack_api as api;
use layerstack_engine::store::{Owner, PathRecord, PathStatus, SessionInfo, READY_OWNER};
use layerstack_engine::{Engine, EngineError};
use tonic::{Request, Response, Status};

/// Verdicts per streamed dry-run reply, and the default page size.
const BATCH: usize = 1000;
/// The largest page a client may ask for.
const MAX_PAGE: usize = 10_000;

/// The admin service.
#[derive(Clone)]
pub struct AdminService {
    pub(crate) engine: Arc<Engine>,
    pub(crate) containerd_address: PathBuf,
    events_subscribed: Arc<AtomicBool>,
    metrics_address: Option<std::net::SocketAddr>,
    /// Mode B: holders of sandbox sessions (the mount socket's side).
    pub(crate) holders: Arc<crate::sandbox::Holders>,
    /// The registry client of Push / Pull (`[registry]`), or why there is
    /// none (a CA file that cannot be read); `None`: not set up.
    pub(crate) registries: Option<Result<Arc<crate::push::Registries>, String>>,
}

pub(crate) fn engine_status(e: EngineError) -> Status {
    crate::wire::engine_status(&e)
}

pub(crate) fn require(field: &str, v: &str) -> Result<(), Status> {
    if v.is_empty() {
        return Err(Status::invalid_argument(format!("{field} is required")));
    }
    Ok(())
}

impl AdminService {
    pub fn new(
        engine: Arc<Engine>,
        containerd_address: PathBuf,
        events_subscribed: Arc<AtomicBool>,
    ) -> Self {
        Self {
            engine,
            containerd_address,
            events_subscribed,
            metrics_address: None,
            holders: crate::sandbox::Holders::new(PathBuf::new()),
            registries: None,
        }
    }

    /// The registry client of Push / Pull, made from `[registry]`.
    /// A client that cannot be made (an unreadable CA file) is logged at
    /// ERROR now, and every Push / Pull then fails naming it; a
    /// `docker_config` that is not there is a WARN (credentials may appear
    /// later: it is read per request).
    pub fn with_registry(mut self, cfg: &layerstack_config::RegistryConfig) -> Self {
        let made = crate::push::Registries::new(cfg)
            .map(Arc::new)
            .map_err(|e| e.to_string());
        if let Err(why) = &made {
            tracing::error!(
                error = %why,
                "[registry] is unusable: every push and pull will fail until it is fixed and the daemon restarted"
            );
        }
        if let Some(p) = &cfg.docker_config {
            if let Err(e) = std::fs::metadata(p) {
                tracing::warn!(
                    path = %p.display(),
                    error = %e,
                    "[registry] docker_config cannot be read: requests without credentials go anonymous until it can"
                );
            }
        }
        self.registries = Some(made);
        self
    }

    /// Reports the Prometheus endpoint's address in `Status` (none: off).
    pub fn with_metrics_address(mut self, a: Option<std::net::SocketAddr>) -> Self {
        self.metrics_address = a;
        self
    }

    /// The holders of sandbox sessions the mount socket serves.
    pub fn with_holders(mut self, holders: Arc<crate::sandbox::Holders>) -> Self {
        self.holders = holders;
        self
    }

    /// The session a request names: `session_id`, else the newest session of
    /// container `container` in `namespace`.
    pub(crate) async fn resolve(
        &self,
        id: i64,
        namespace: &str,
        container: &str,
    ) -> Result<SessionInfo, Status> {
        if id != 0 {
            return self.engine.session(id).await.map_err(engine_status);
        }
        require("container (or session_id)", container)?;
        self.engine
            .find(namespace, container)
            .await
            .map_err(engine_status)
    }

    /// The wire form of `s`, with the first conflicts of its outcome inlined.
    pub(crate) async fn to_api(&self, s: SessionInfo) -> Result<api::Session, Status> {
        let conflicts = match s.outcome.as_ref() {
            Some(o) if o.counts.conflict > 0 => {
                let id = o.id;
                self.engine
                    .outcome_paths(
                        id,
                        None,
                        crate::wire::INLINE_CONFLICTS + 1,
                        Some(PathStatus::Conflict),
                    )
                    .await
                    .map_err(engine_status)?
            }
            _ => Vec::new(),
        };
        // The node a checkpoint made is the outcome's own field (store
        // `Outcome::node`).
        let mut out = crate::wire::session(&s, &conflicts);
        // Live limits of a live session only: a released one's init may
        // still be on its way out (its holder entry goes when it has exited).
        out.limits = if s.released {
            None
        } else {
            self.holders.owned_limits(s.id)
        };
        Ok(out)
    }
}

/// How much of the rest of a refused client stream is read (bytes), for how
/// long in all, and how long a pause of the client ends it
/// ([`drain_refused`]).
const DRAIN_BYTES: usize = 64 << 20;
const DRAIN_FOR: std::time::Duration = std::time::Duration::from_secs(10);
const DRAIN_IDLE: std::time::Duration = std::time::Duration::from_millis(250);

/// The end of a client-streaming call (`WriteFile`, `UploadTar`) whose
/// handler answered `r`: a refusal (`Err`) is answered once the client has
/// sent the rest of its stream — read and dropped, at most [`DRAIN_BYTES`]
/// within [`DRAIN_FOR`], and no longer than [`DRAIN_IDLE`] of the client
/// sending nothing — and the stream is dropped only after the answer has
/// gone out: a task keeps reading it within what is left of the same
/// budget (any answer, a success included: a tar's padding may follow its
/// end-of-archive blocks).
///
/// Why: a refusal answered while the client is still sending makes the
/// client's next write fail. grpcio's asyncio client then replaces the
/// server's status with its own `INTERNAL: Internal error from Core`
/// (grpc/grpc#36066; 103 of 1,500 refused 1 MiB writes here), and a
/// stream dropped before its answer is reset (`RST_STREAM(CANCEL)`), each
/// DATA frame the client had in flight for it counting against the 1,024
/// protocol-error resets h2 allows a connection before GOAWAY
/// (`max_local_error_reset_streams`). A client that sends more than the
/// budget, or pauses, gets the refusal then, and a `RST_STREAM(NO_ERROR)`
/// after it (RFC 9113 §8.1: the answer stands).
async fn drain_refused<T: Send + 'static, R>(
    mut s: tonic::Streaming<T>,
    r: Result<R, Status>,
    len: fn(&T) -> usize,
) -> Result<R, Status> {
    let until = tokio::time::Instant::now() + DRAIN_FOR;
    let mut seen = 0usize;
    if r.is_err() {
        drain(&mut s, until, Some(DRAIN_IDLE), &mut seen, len).await;
    }
    // Held until the answer is out, within what is left of the budget.
    tokio::spawn(async move { drain(&mut s, until, None, &mut seen, len).await });
    r
}

/// Reads and drops `s`'s messages until it ends or fails, `until`, a pause
/// of `idle`, or [`DRAIN_BYTES`] counted in `seen` ([`drain_refused`]).
async fn drain<T>(
    s: &mut tonic::Streaming<T>,
    until: tokio::time::Instant,
    idle: Option<std::time::Duration>,
    seen: &mut usize,
    len: fn(&T) -> usize,
) {
    while *seen < DRAIN_BYTES {
        let by = idle.map_or(until, |i| until.min(tokio::time::Instant::now() + i));
        match tokio::time::timeout_at(by, s.message()).await {
            Ok(Ok(Some(m))) => *seen += len(&m).max(1),
            _ => break,
        }
    }
}

type DryRunStream = Pin<Box<dyn futures::Stream<Item = Result<api::DryRunReply, Status>> + Send>>;

#[tonic::async_trait]
impl api::Admin for AdminService {
    type PublishDryRunStream = DryRunStream;

    async fn set_policy(
        &self,
        req: Request<api::SetPolicyRequest>,
    ) -> Result<Response<api::Session>, Status> {
        let r = req.into_inner();
        let p: api::policy::ExitPolicy = r
            .policy
            .parse()
            .map_err(|e| Status::invalid_argument(api::error_chain(&e)))?;
        let s = self.resolve(0, &r.namespace, &r.container).await?;
        // Under the session's lock, which the engine takes.
        let id = s.id;
        let out = self
            .engine
            .set_exit_policy(id, p.as_str().to_string())
            .await
            .map_err(engine_status)?;
        Ok(Response::new(self.to_api(out).await?))
    }

    async fn status(
        &self,
        _req: Request<api::StatusRequest>,
    ) -> Result<Response<api::StatusResponse>, Status> {
        Ok(Response::new(api::StatusResponse {
            version: env!("CARGO_PKG_VERSION").to_string(),
            root: self.engine.root().display().to_string(),
            containerd_address: self.containerd_address.display().to_string(),
            events_subscribed: self.events_subscribed.load(Ordering::SeqCst),
            default_branch: self.engine.default_branch().to_string(),
            pid: u64::from(std::process::id()),
            metrics_address: self
                .metrics_address
                .map(|a| a.to_string())
                .unwrap_or_default(),
            mount_address: self.holders.mount_address().display().to_string(),
            sandbox_sessions: self.engine.sandbox_load().0 as u64,
            sandbox_max_sessions: self.engine.sandbox_load().1 as u64,
            executors: [
                ("linux", crate::owned::spawner_up(&self.holders)),
                ("wasi", crate::wasi::runtime_up()),
            ]
            .into_iter()
            .filter(|(_, up)| *up)
            .map(|(name, _)| name.to_string())
            .collect(),
        }))
    }

    async fn list_sessions(
        &self,
        req: Request<api::ListSessionsRequest>,
    ) -> Result<Response<api::ListSessionsResponse>, Status> {
        let r = req.into_inner();
        let after: i64 = if r.page_token.is_empty() {
            0
        } else {
            r.page_token.parse().map_err(|_| {
                Status::invalid_argument(format!(
                    "bad page_token {:?}: pass the next_page_token of the previous page",
                    r.page_token
                ))
            })?
        };
        let size = match r.page_size as usize {
            0 => BATCH,
            n => n.min(MAX_PAGE),
        };
        let sessions = self.engine.sessions().await.map_err(engine_status)?;
        let mut page: Vec<SessionInfo> = sessions
            .into_iter()
            .filter(|s| s.id > after)
            // Sandbox sessions (Mode B) have no namespace: always listed.
            .filter(|s| {
                r.all_namespaces || s.owner.namespace() == r.namespace || s.owner.is_sandbox()
            })
            .filter(|s| r.owner_kind.is_empty() || s.owner.kind().as_str() == r.owner_kind)
            // WASI sessions made ahead of requests are the daemon's, not a
            // caller's (crate::wasi::Ready): a claimed one has its caller's name.
            .filter(|s| !matches!(&s.owner, Owner::Wasi { name } if name == READY_OWNER))
            .take(size + 1)
            .collect();
        let next_page_token = if page.len() > size {
            page.truncate(size);
            page.last().map(|s| s.id.to_string()).unwrap_or_default()
        } else {
            String::new()
        };
        let mut out = Vec::with_capacity(page.len());
        for s in page {
            out.push(self.to_api(s).await?);
        }
        Ok(Response::new(api::ListSessionsResponse {
            sessions: out,
            next_page_token,
        }))
    }

    async fn wait(&self, req: Request<api::WaitRequest>) -> Result<Response<api::Session>, Status> {
        let r = req.into_inner();
        let s = self
            .resolve(r.session_id, &r.namespace, &r.container)
            .await?;
        let timeout = (r.timeout_ms > 0).then(|| Duration::from_millis(r.timeout_ms.into()));
        match self
            .engine
            .wait(s.id, timeout)
            .await
            .map_err(engine_status)?
        {
            Some(s) => Ok(Response::new(self.to_api(s).await?)),
            None => Err(Status::deadline_exceeded(format!(
                "session {} ({}) has no outcome after {} ms; its task may still be running",
                s.id,
                s.owner.display(),
                r.timeout_ms
            ))),
        }
    }

    async fn publish(
        &self,
        req: Request<api::PublishRequest>,
    ) -> Result<Response<api::Session>, Status> {
        let r = req.into_inner();
        let s = self
            .resolve(r.session_id, &r.namespace, &r.container)
            .await?;
        // A DISCARD of a live daemon-owned sandbox is its CloseSession DISCARD
        // (its init stopped, its overlay released): the engine's discard
        // alone would refuse its still-mounted upper.
        if r.action == api::EndAction::Discard as i32 && s.daemon_owned && !s.released {
            return self
                .sandbox_close(api::CloseSessionRequest {
                    session_id: s.id,
                    action: api::EndAction::Discard as i32,
                    reason: if r.reason.is_empty() {
                        "admin discard".into()
                    } else {
                        r.reason
                    },
                    ..Default::default()
                })
                .await
                .map(Response::new);
        }
        crate::wasi::refuse_live(self, s.id, "an end of its run through Publish")?;
        let why = if r.reason.is_empty() {
            "admin publish".to_string()
        } else {
            r.reason.clone()
        };
        let out = match api::EndAction::from_i32(r.action) {
            Some(api::EndAction::Publish) => self.engine.publish(s.id, &why).await,
            Some(api::EndAction::Discard) => self.engine.discard(s.id, &why).await,
            Some(api::EndAction::Auto) => {
                let exit = r.has_exit_status.then_some(r.exit_status);
                self.engine.finish(s.id, None, exit, &why).await
            }
            Some(api::EndAction::Checkpoint) => {
                let prov = layerstack_engine::store::Provenance {
                    exit_status: r
                        .has_exit_status
                        .then(|| i32::try_from(r.exit_status).unwrap_or(i32::MAX)),
                    ..Default::default()
                };
                match self.engine.checkpoint(s.id, None, prov, None).await {
                    Ok(_) => self.engine.session(s.id).await,
                    Err(e) => Err(e),
                }
            }
            None => {
                return Err(Status::invalid_argument(format!(
                    "unknown end action {}: use PUBLISH, DISCARD, AUTO or CHECKPOINT",
                    r.action
                )))
            }
        }
        .map_err(engine_status)?;
        Ok(Response::new(self.to_api(out).await?))
    }

    async fn publish_dry_run(
        &self,
        req: Request<api::PublishRequest>,
    ) -> Result<Response<Self::PublishDryRunStream>, Status> {
        let r = req.into_inner();
        if api::EndAction::from_i32(r.action) != Some(api::EndAction::Publish) {
            return Err(Status::invalid_argument("a dry run needs policy PUBLISH"));
        }
        let s = self
            .resolve(r.session_id, &r.namespace, &r.container)
            .await?;
        crate::wasi::refuse_live(self, s.id, "a dry run of its publish")?;
        let d = self.engine.dry_run(s.id).await.map_err(engine_status)?;
        let mut head = crate::wire::session(&d.session, &d.paths);
        head.dry_run = true;
        head.layer = 0;
        head.outcome_id = 0;
        head.timings = None;
        head.outcome = d.kind.map(|k| k.as_str().to_string()).unwrap_or_default();
        head.counts = Some(crate::wire::path_counts(&d.counts));
        head.message = d.message;
        let mut replies = vec![Ok(api::DryRunReply {
            session: Some(head),
            paths: vec![],
        })];
        for chunk in d.paths.chunks(BATCH) {
            replies.push(Ok(api::DryRunReply {
                session: None,
                paths: chunk.iter().map(crate::wire::path_verdict).collect(),
            }));
        }
        Ok(Response::new(Box::pin(futures::stream::iter(replies))))
    }

    async fn list_outcome_paths(
        &self,
        req: Request<api::ListOutcomePathsRequest>,
    ) -> Result<Response<api::ListOutcomePathsResponse>, Status> {
        let r = req.into_inner();
        if r.outcome_id == 0 {
            return Err(Status::invalid_argument(
                "outcome_id is required (Session.outcome_id)",
            ));
        }
        let status = crate::wire::parse_status(&r.status).map_err(Status::invalid_argument)?;
        let size = match r.page_size as usize {
            0 => BATCH,
            n => n.min(MAX_PAGE),
        };
        let after = if r.page_token.is_empty() {
            None
        } else {
            Some(hex_decode(&r.page_token).ok_or_else(|| {
                Status::invalid_argument(format!(
                    "bad page_token {:?}: pass the next_page_token of the previous page",
                    r.page_token
                ))
            })?)
        };
        let id = r.outcome_id;
        let paths: Vec<PathRecord> = self
            .engine
            .outcome_paths(id, after, size, status)
            .await
            .map_err(engine_status)?;
        let next_page_token = if paths.len() == size {
            paths
                .last()
                .map(|p| hex_encode(&p.path))
                .unwrap_or_default()
        } else {
            String::new()
        };
        Ok(Response::new(api::ListOutcomePathsResponse {
            paths: paths.iter().map(crate::wire::path_verdict).collect(),
            next_page_token,
        }))
    }

    type LogStream = crate::history::LogStream;

    async fn log(
        &self,
        req: Request<api::LogRequest>,
    ) -> Result<Response<Self::LogStream>, Status> {
        self.history_log(req.into_inner()).await.map(Response::new)
    }

    async fn list_stacks(
        &self,
        req: Request<api::ListStacksRequest>,
    ) -> Result<Response<api::ListStacksResponse>, Status> {
        self.stacks(req.into_inner()).await.map(Response::new)
    }

    async fn remove_stack(
        &self,
        req: Request<api::RemoveStackRequest>,
    ) -> Result<Response<api::GcResponse>, Status> {
        self.stack_rm(req.into_inner()).await.map(Response::new)
    }

    async fn list_branches(
        &self,
        req: Request<api::ListBranchesRequest>,
    ) -> Result<Response<api::ListBranchesResponse>, Status> {
        self.branches(req.into_inner()).await.map(Response::new)
    }

    async fn create_branch(
        &self,
        req: Request<api::CreateBranchRequest>,
    ) -> Result<Response<api::Branch>, Status> {
        self.branch_create(req.into_inner())
            .await
            .map(Response::new)
    }

    async fn delete_branch(
        &self,
        req: Request<api::DeleteBranchRequest>,
    ) -> Result<Response<api::DeleteBranchResponse>, Status> {
        self.branch_delete(req.into_inner())
            .await
            .map(Response::new)
    }

    async fn promote(
        &self,
        req: Request<api::PromoteRequest>,
    ) -> Result<Response<api::PromoteResponse>, Status> {
        self.branch_promote(req.into_inner())
            .await
            .map(Response::new)
    }

    async fn squash(
        &self,
        req: Request<api::SquashRequest>,
    ) -> Result<Response<api::SquashResponse>, Status> {
        self.branch_squash(req.into_inner())
            .await
            .map(Response::new)
    }

    async fn gc(&self, _req: Request<api::GcRequest>) -> Result<Response<api::GcResponse>, Status> {
        self.collect().await.map(Response::new)
    }

    async fn disk_usage(
        &self,
        req: Request<api::DiskUsageRequest>,
    ) -> Result<Response<api::DiskUsageResponse>, Status> {
        self.usage(req.into_inner()).await.map(Response::new)
    }

    async fn create_session(
        &self,
        req: Request<api::CreateSessionRequest>,
    ) -> Result<Response<api::CreateSessionResponse>, Status> {
        self.sandbox_create(req.into_inner())
            .await
            .map(Response::new)
    }

    async fn push(
        &self,
        req: Request<api::PushRequest>,
    ) -> Result<Response<api::PushResponse>, Status> {
        let r = req.into_inner();
        let (auth, reference) = (r.auth.clone(), r.reference.clone());
        self.push(r)
            .await
            .map(Response::new)
            .map_err(|st| crate::push::with_credential_source(self, st, auth.as_ref(), &reference))
    }

    async fn pull(
        &self,
        req: Request<api::PullRequest>,
    ) -> Result<Response<api::PullResponse>, Status> {
        let r = req.into_inner();
        let (auth, reference) = (r.auth.clone(), r.reference.clone());
        self.pull(r)
            .await
            .map(Response::new)
            .map_err(|st| crate::push::with_credential_source(self, st, auth.as_ref(), &reference))
    }

    async fn close_session(
        &self,
        req: Request<api::CloseSessionRequest>,
    ) -> Result<Response<api::Session>, Status> {
        self.sandbox_close(req.into_inner())
            .await
            .map(Response::new)
    }

    type RunSessionStream = crate::owned::Stream<api::RunSessionReply>;

    async fn run_session(
        &self,
        req: Request<api::RunSessionRequest>,
    ) -> Result<Response<Self::RunSessionStream>, Status> {
        crate::run::run_session(self, req.into_inner())
            .await
            .map(Response::new)
    }

    type ExecStream = crate::owned::Stream<api::ExecReply>;
    type ReadFileStream = crate::owned::Stream<api::FileChunk>;
    type DownloadTarStream = crate::owned::Stream<api::FileChunk>;

    async fn exec(
        &self,
        req: Request<api::ExecRequest>,
    ) -> Result<Response<Self::ExecStream>, Status> {
        crate::owned::exec(self, req.into_inner())
            .await
            .map(Response::new)
    }

    async fn read_file(
        &self,
        req: Request<api::ReadFileRequest>,
    ) -> Result<Response<Self::ReadFileStream>, Status> {
        crate::owned::read_file(self, req.into_inner())
            .await
            .map(Response::new)
    }

    async fn write_file(
        &self,
        req: Request<tonic::Streaming<api::WriteFileRequest>>,
    ) -> Result<Response<api::FileStat>, Status> {
        let mut s = req.into_inner();
        let r = crate::owned::write_file(self, &mut s).await;
        drain_refused(s, r, |m| m.data.len())
            .await
            .map(Response::new)
    }

    async fn list_dir(
        &self,
        req: Request<api::ListDirRequest>,
    ) -> Result<Response<api::ListDirResponse>, Status> {
        crate::owned::list_dir(self, req.into_inner())
            .await
            .map(Response::new)
    }

    async fn stat_path(
        &self,
        req: Request<api::StatPathRequest>,
    ) -> Result<Response<api::FileStat>, Status> {
        crate::owned::stat_path(self, req.into_inner())
            .await
            .map(Response::new)
    }

    async fn remove_path(
        &self,
        req: Request<api::RemovePathRequest>,
    ) -> Result<Response<api::RemovePathResponse>, Status> {
        crate::owned::remove_path(self, req.into_inner())
            .await
            .map(Response::new)
    }

    async fn upload_tar(
        &self,
        req: Request<tonic::Streaming<api::UploadTarRequest>>,
    ) -> Result<Response<api::UploadTarResponse>, Status> {
        let mut s = req.into_inner();
        let r = crate::owned::upload_tar(self, &mut s).await;
        drain_refused(s, r, |m| m.data.len())
            .await
            .map(Response::new)
    }

    async fn download_tar(
        &self,
        req: Request<api::DownloadTarRequest>,
    ) -> Result<Response<Self::DownloadTarStream>, Status> {
        crate::owned::download_tar(self, req.into_inner())
            .await
            .map(Response::new)
    }

    async fn set_branch(
        &self,
        req: Request<api::SetBranchRequest>,
    ) -> Result<Response<api::SetBranchResponse>, Status> {
        let r = req.into_inner();
        require("branch", &r.branch)?;
        let s = self.resolve(0, &r.namespace, &r.container).await?;
        let (info, spec, changed) =
            self.engine
                .rebranch(s.id, r.branch.clone())
                .await
                .map_err(|e| match e {
                    EngineError::Mounted(id, upper) => Status::failed_precondition(format!(
                        "session {id} is mounted (upperdir {}): its branch cannot change",
                        upper.display()
                    )),
                    e => engine_status(e),
                })?;
        Ok(Response::new(api::SetBranchResponse {
            session: Some(self.to_api(info).await?),
            changed,
            mounts: crate::wire::mounts(&spec),
        }))
    }

    // ---- Blame, diff, conflicts (snapshotter/src/inspect.rs) ----

    async fn blame(
        &self,
        req: Request<api::BlameRequest>,
    ) -> Result<Response<api::BlameResponse>, Status> {
        self.blame_file(req.into_inner()).await.map(Response::new)
    }

    type DiffStream = crate::inspect::DiffStream;

    async fn diff(
        &self,
        req: Request<api::DiffRequest>,
    ) -> Result<Response<Self::DiffStream>, Status> {
        self.diff_stream(req.into_inner()).await.map(Response::new)
    }

    type ShowConflictsStream = crate::inspect::ConflictsStream;

    async fn show_conflicts(
        &self,
        req: Request<api::ShowConflictsRequest>,
    ) -> Result<Response<Self::ShowConflictsStream>, Status> {
        self.conflicts_stream(req.into_inner())
            .await
            .map(Response::new)
    }

    type ExportStream = crate::export::ExportStream;

    async fn export(
        &self,
        req: Request<api::ExportRequest>,
    ) -> Result<Response<Self::ExportStream>, Status> {
        self.export_stream(req.into_inner())
            .await
            .map(Response::new)
    }

    async fn import_base(
        &self,
        req: Request<api::ImportBaseRequest>,
    ) -> Result<Response<api::ImportBaseResponse>, Status> {
        self.base_import(req.into_inner()).await.map(Response::new)
    }

    async fn rebase_session(
        &self,
        req: Request<api::RebaseSessionRequest>,
    ) -> Result<Response<api::RebaseSessionResponse>, Status> {
        self.rebase(req.into_inner()).await.map(Response::new)
    }

    // ---- SandboxGraph (graph.rs) ----

    async fn create_graph(
        &self,
        req: Request<api::CreateGraphRequest>,
    ) -> Result<Response<api::Graph>, Status> {
        self.graph_create(req.into_inner()).await.map(Response::new)
    }

    async fn list_graphs(
        &self,
        req: Request<api::ListGraphsRequest>,
    ) -> Result<Response<api::ListGraphsResponse>, Status> {
        self.graphs(req.into_inner()).await.map(Response::new)
    }

    type ShowGraphStream = crate::graph::GraphStream;

    async fn show_graph(
        &self,
        req: Request<api::ShowGraphRequest>,
    ) -> Result<Response<Self::ShowGraphStream>, Status> {
        self.graph_pages(req.into_inner()).await.map(Response::new)
    }

    async fn show_node(
        &self,
        req: Request<api::ShowNodeRequest>,
    ) -> Result<Response<api::Node>, Status> {
        self.node_show(req.into_inner()).await.map(Response::new)
    }

    async fn start_attempt(
        &self,
        req: Request<api::StartAttemptRequest>,
    ) -> Result<Response<api::AttemptResponse>, Status> {
        self.attempt_start(req.into_inner())
            .await
            .map(Response::new)
    }

    async fn retry_attempt(
        &self,
        req: Request<api::RetryAttemptRequest>,
    ) -> Result<Response<api::AttemptResponse>, Status> {
        self.attempt_retry(req.into_inner())
            .await
            .map(Response::new)
    }

    async fn list_attempts(
        &self,
        req: Request<api::ListAttemptsRequest>,
    ) -> Result<Response<api::ListAttemptsResponse>, Status> {
        self.attempts(req.into_inner()).await.map(Response::new)
    }

    async fn checkpoint(
        &self,
        req: Request<api::CheckpointRequest>,
    ) -> Result<Response<api::Node>, Status> {
        self.checkpoint_node(req.into_inner())
            .await
            .map(Response::new)
    }

    async fn merge_nodes(
        &self,
        req: Request<api::MergeNodesRequest>,
    ) -> Result<Response<api::MergeNodesResponse>, Status> {
        self.node_merge(req.into_inner()).await.map(Response::new)
    }

    async fn promote_node(
        &self,
        req: Request<api::PromoteNodeRequest>,
    ) -> Result<Response<api::PromoteResponse>, Status> {
        self.node_promote(req.into_inner()).await.map(Response::new)
    }

    async fn prune_node(
        &self,
        req: Request<api::PruneNodeRequest>,
    ) -> Result<Response<api::PruneNodeResponse>, Status> {
        self.node_prune(req.into_inner()).await.map(Response::new)
    }

    async fn set_node(
        &self,
        req: Request<api::SetNodeRequest>,
    ) -> Result<Response<api::SetBranchResponse>, Status> {
        self.node_set(req.into_inner()).await.map(Response::new)
    }

    async fn create_run(
        &self,
        req: Request<api::CreateRunRequest>,
    ) -> Result<Response<api::CreateRunResponse>, Status> {
        self.run_create(req.into_inner()).await.map(Response::new)
    }

    async fn list_runs(
        &self,
        _req: Request<api::ListRunsRequest>,
    ) -> Result<Response<api::ListRunsResponse>, Status> {
        self.run_list().await.map(Response::new)
    }

    async fn begin_rollout(
        &self,
        req: Request<api::BeginRolloutRequest>,
    ) -> Result<Response<api::BeginRolloutResponse>, Status> {
        self.rollout_begin(req.into_inner())
            .await
            .map(Response::new)
    }

    async fn end_rollout(
        &self,
        req: Request<api::EndRolloutRequest>,
    ) -> Result<Response<api::RolloutAttempt>, Status> {
        self.rollout_end(req.into_inner()).await.map(Response::new)
    }

    async fn list_rollouts(
        &self,
        req: Request<api::ListRolloutsRequest>,
    ) -> Result<Response<api::ListRolloutsResponse>, Status> {
        self.rollout_list(req.into_inner()).await.map(Response::new)
    }

    async fn fsck(
        &self,
        req: Request<api::FsckRequest>,
    ) -> Result<Response<api::FsckReport>, Status> {
        self.store_fsck(req.into_inner()).await.map(Response::new)
    }

    async fn get_sample(
        &self,
        req: Request<api::SampleKey>,
    ) -> Result<Response<api::Sample>, Status> {
        self.sample_get(req.into_inner()).await.map(Response::new)
    }

    async fn audit_run(
        &self,
        req: Request<api::AuditRunRequest>,
    ) -> Result<Response<api::RunAudit>, Status> {
        self.run_audit(req.into_inner()).await.map(Response::new)
    }

    type ReadBlobStream = crate::owned::Stream<api::FileChunk>;

    async fn read_blob(
        &self,
        req: Request<api::ReadBlobRequest>,
    ) -> Result<Response<Self::ReadBlobStream>, Status> {
        self.blob_read(req.into_inner()).await.map(Response::new)
    }

    async fn get_node_stats(
        &self,
        req: Request<api::GetNodeStatsRequest>,
    ) -> Result<Response<api::GetNodeStatsResponse>, Status> {
        self.stats_get(req.into_inner()).await.map(Response::new)
    }

    async fn set_prior(
        &self,
        req: Request<api::SetPriorRequest>,
    ) -> Result<Response<api::NodeStats>, Status> {
        self.prior_set(req.into_inner()).await.map(Response::new)
    }

    async fn lease_frontier(
        &self,
        req: Request<api::FrontierRequest>,
    ) -> Result<Response<api::FrontierResponse>, Status> {
        self.frontier_change(req.into_inner(), true)
            .await
            .map(Response::new)
    }

    async fn release_frontier(
        &self,
        req: Request<api::FrontierRequest>,
    ) -> Result<Response<api::FrontierResponse>, Status> {
        self.frontier_change(req.into_inner(), false)
            .await
            .map(Response::new)
    }
}

/// One page of a list ordered by a byte-string key (a stack id, a branch or
/// graph name, an attempt id as big-endian bytes): the items whose key sorts
/// after the one `token` names, at most `size` of them (0: [`BATCH`]; at most
/// [`MAX_PAGE`]), and the token of the next page (the hex of the page's last
/// key; "" on the last page). INVALID_ARGUMENT: a token that is not hex.
pub(crate) fn page<T>(
    mut items: Vec<T>,
    key: impl Fn(&T) -> Vec<u8>,
    size: u32,
    token: &str,
) -> Result<(Vec<T>, String), Status> {
    let size = match size as usize {
        0 => BATCH,
        n => n.min(MAX_PAGE),
    };
    let after = match token {
        "" => None,
        t => Some(hex_decode(t).ok_or_else(|| {
            Status::invalid_argument(format!(
                "bad page_token {t:?}: pass the next_page_token of the previous page"
            ))
        })?),
    };
    items.sort_by_key(|x| key(x));
    if let Some(after) = after {
        items.retain(|x| key(x) > after);
    }
    if items.len() <= size {
        return Ok((items, String::new()));
    }
    items.truncate(size);
    let next = items
        .last()
        .map(|x| hex_encode(&key(x)))
        .unwrap_or_default();
    Ok((items, next))
}

/// Lowercase hex of `b` (page tokens carry raw path bytes).
fn hex_encode(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Bytes of lowercase (or uppercase) hex `s`; `None` for an odd length or a
/// non-hex digit.
pub(crate) fn hex_decode(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn pages_walk_every_item_once_in_key_order() {
        let items: Vec<String> = (0..25).rev().map(|i| format!("s{i:02}")).collect();
        let key = |s: &String| s.as_bytes().to_vec();
        let (mut seen, mut token) = (Vec::new(), String::new());
        loop {
            let (p, next) = page(items.clone(), key, 10, &token).unwrap();
            assert!(p.len() <= 10);
            seen.extend(p);
            if next.is_empty() {
                break;
            }
            token = next;
        }
        let mut want = items.clone();
        want.sort();
        assert_eq!(seen, want);
        // An exact fit has no next page.
        let (p, next) = page(items.clone(), key, 25, "").unwrap();
        assert_eq!((p.len(), next.as_str()), (25, ""));
        let bad = page(items, key, 10, "not-hex").unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument);
        assert!(bad.message().contains("page_token"), "{}", bad.message());
    }

    #[test]
    fn page_tokens_round_trip_any_bytes() {
        let p = b"a/\xff\x00b".to_vec();
        assert_eq!(hex_decode(&hex_encode(&p)), Some(p));
        assert_eq!(hex_decode("zz"), None);
        assert_eq!(hex_decode("abc"), None);
    }
}
