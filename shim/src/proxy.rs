//! The Task API v2 service the proxy serves to containerd: every RPC is
//! forwarded to the inner shim; `Create` applies the container's labels (branch,
//! policy validation) and runtime options, and the init process's `Delete`
//! publishes the session before it returns.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use containerd_shim::asynchronous::ExitSignal;
use containerd_shim_protos::api::*;
use containerd_shim_protos::protobuf::MessageField;
use containerd_shim_protos::shim_async::{Task, TaskClient};
use containerd_shim_protos::ttrpc::r#async::TtrpcContext;
use containerd_shim_protos::ttrpc::{self, context, Code};
use layerstack_api as api;
use log::{debug, error, info, warn};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use crate::config::RuntimeOptions;
use crate::daemon;
use crate::events::EventGate;
use crate::inner;
use crate::policy::{self, Decision, ExitPolicy};
use crate::state::{self, BundleState};

/// Timeout for reading the container's labels from containerd.
const LABELS_TIMEOUT: Duration = Duration::from_secs(10);
/// Timeout for `SetBranch` on the daemon.
const SET_BRANCH_TIMEOUT: Duration = Duration::from_secs(30);

fn status(code: Code, msg: impl ToString) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg))
}

fn fwd(ctx: &TtrpcContext) -> context::Context {
    context::Context {
        metadata: ctx.metadata.clone(),
        timeout_nano: ctx.timeout_nano,
    }
}

#[derive(Default)]
struct Init {
    /// Create succeeded.
    created: bool,
    /// The init process's Delete went through.
    deleted: bool,
    /// The rootfs containerd sent was not empty (a snapshot, maybe ours).
    has_rootfs: bool,
    /// The rootfs overlay's `upperdir` (the session's upper), if it has one.
    upper: Option<PathBuf>,
    /// Labels read at Create (fallback at Delete).
    labels: Option<HashMap<String, String>>,
}

/// The proxy's Task service for one container.
pub struct Proxy {
    pub(crate) id: String,
    pub(crate) namespace: String,
    pub(crate) bundle: PathBuf,
    /// containerd's gRPC socket (`-address`).
    pub(crate) containerd: PathBuf,
    pub(crate) state: BundleState,
    pub(crate) gate: Arc<EventGate>,
    pub(crate) exit: Arc<ExitSignal>,
    client: Mutex<Option<TaskClient>>,
    /// The inner shim connection, being made since the proxy started.
    connecting: Mutex<Option<JoinHandle<Result<TaskClient, inner::InnerError>>>>,
    /// The container's labels, being read from containerd since the proxy
    /// started (containerd created the container before it started the shim),
    /// so `Create` does not wait for a fresh gRPC connection and a round trip.
    labels_prefetch: Mutex<Option<JoinHandle<LabelsResult>>>,
    init: Mutex<Init>,
}

type LabelsResult = Result<Option<HashMap<String, String>>, daemon::DaemonError>;

impl Proxy {
    pub(crate) fn new(
        id: String,
        namespace: String,
        bundle: PathBuf,
        containerd: PathBuf,
        state: BundleState,
        gate: Arc<EventGate>,
        exit: Arc<ExitSignal>,
    ) -> Self {
        // Both run while containerd connects to us and sends its first RPCs
        // (must be called inside the tokio runtime).
        let connecting = (!state.inner_address.is_empty()).then(|| {
            let addr = state.inner_address.clone();
            tokio::spawn(async move { inner::connect(&addr, Duration::from_secs(10)).await })
        });
        let labels_prefetch = {
            let (c, ns, id) = (containerd.clone(), namespace.clone(), id.clone());
            tokio::spawn(
                async move { daemon::container_labels(&c, &ns, &id, LABELS_TIMEOUT).await },
            )
        };
        Self {
            id,
            namespace,
            bundle,
            containerd,
            state,
            gate,
            exit,
            client: Mutex::new(None),
            connecting: Mutex::new(connecting),
            labels_prefetch: Mutex::new(Some(labels_prefetch)),
            init: Mutex::new(Init::default()),
        }
    }

    async fn client(&self) -> ttrpc::Result<TaskClient> {
        let mut c = self.client.lock().await;
        if let Some(c) = c.as_ref() {
            return Ok(c.clone());
        }
        if self.state.inner_address.is_empty() {
            return Err(status(
                Code::FAILED_PRECONDITION,
                "no inner shim recorded in the bundle",
            ));
        }
        // The connection started with the proxy, if it worked; else a new one.
        let pending = self.connecting.lock().await.take();
        let early = match pending {
            Some(h) => h.await.ok().and_then(Result::ok),
            None => None,
        };
        let client = match early {
            Some(client) => client,
            None => inner::connect(&self.state.inner_address, Duration::from_secs(10))
                .await
                .map_err(|e| status(Code::UNAVAILABLE, crate::error_chain(&e)))?,
        };
        *c = Some(client.clone());
        Ok(client)
    }

    /// Forward one RPC; a transport failure drops the cached connection.
    async fn call<T, F, Fut>(&self, f: F) -> ttrpc::Result<T>
    where
        F: FnOnce(TaskClient) -> Fut,
        Fut: Future<Output = ttrpc::Result<T>>,
    {
        let c = self.client().await?;
        let r = f(c).await;
        if let Err(e) = &r {
            if !matches!(e, ttrpc::Error::RpcStatus(_)) {
                // Also the normal end: runc-v2 exits on Shutdown before replying.
                debug!("inner shim connection failed ({e}); reconnecting on the next call");
                *self.client.lock().await = None;
            }
        }
        r
    }

    /// The container's labels: the read started with the proxy if it found the
    /// container, else a fresh one.
    async fn labels(&self) -> LabelsResult {
        let pending = self.labels_prefetch.lock().await.take();
        if let Some(h) = pending {
            if let Ok(Ok(Some(labels))) = h.await {
                return Ok(Some(labels));
            }
        }
        daemon::container_labels(&self.containerd, &self.namespace, &self.id, LABELS_TIMEOUT).await
    }

    /// Records the container's exit policy on its session in the daemon, so the
    /// daemon's own fallbacks (task-delete event, reconcile, snapshot Remove, the
    /// `delete` action after a SIGKILL) apply it even when this proxy cannot. A
    /// policy other than on-exit that cannot be recorded fails the create: it
    /// must never be lost to a fallback that publishes.
    async fn record_policy(&self, p: ExitPolicy) -> ttrpc::Result<()> {
        let admin = &self.state.admin_address;
        match daemon::set_policy(
            admin,
            &self.namespace,
            &self.id,
            p.as_str(),
            SET_BRANCH_TIMEOUT,
        )
        .await
        {
            Ok(_) => Ok(()),
            Err(e) if p == ExitPolicy::OnExit => {
                warn!(
                    "cannot record policy {p} in the daemon: {}",
                    crate::error_chain(&e)
                );
                Ok(())
            }
            Err(e) => Err(status(
                Code::FAILED_PRECONDITION,
                format!(
                    "container label {}={p}: cannot record it with the layerstack daemon: {}",
                    policy::PUBLISH_LABEL,
                    crate::error_chain(&e)
                ),
            )),
        }
    }

    /// Applies `layerstack.node` before the rootfs is mounted: the session
    /// becomes an attempt of the node and leases its root.
    async fn apply_node(&self, node: &str, req: &mut CreateTaskRequest) -> ttrpc::Result<()> {
        let admin = &self.state.admin_address;
        match daemon::set_node(admin, &self.namespace, &self.id, node, SET_BRANCH_TIMEOUT).await {
            Ok(Some(resp)) => {
                let template = req.rootfs.first().cloned().unwrap_or_default();
                req.rootfs = resp
                    .mounts
                    .into_iter()
                    .map(|m| {
                        let mut out = template.clone();
                        out.type_ = m.r#type;
                        out.source = m.source;
                        out.options = m.options;
                        out
                    })
                    .collect();
                info!("container label {}={node}: session is an attempt of node {node}", policy::NODE_LABEL);
                Ok(())
            }
            Ok(None) => Err(status(
                Code::FAILED_PRECONDITION,
                format!(
                    "container label {}={node}: the container's rootfs is not a layerstack session (run it with --snapshotter layerstack)",
                    policy::NODE_LABEL
                ),
            )),
            Err(e) => Err(status(
                Code::FAILED_PRECONDITION,
                format!(
                    "container label {}={node}: cannot start an attempt of that node: {}",
                    policy::NODE_LABEL,
                    crate::error_chain(&e)
                ),
            )),
        }
    }

    /// Applies `layerstack.branch` (if set) before the rootfs is mounted.
    async fn apply_branch(&self, branch: &str, req: &mut CreateTaskRequest) -> ttrpc::Result<()> {
        let admin = &self.state.admin_address;
        match daemon::set_branch(admin, &self.namespace, &self.id, branch, SET_BRANCH_TIMEOUT).await
        {
            Ok(Some(resp)) => {
                let on = resp
                    .session
                    .as_ref()
                    .map(|s| s.branch.clone())
                    .unwrap_or_default();
                if resp.changed {
                    let template = req.rootfs.first().cloned().unwrap_or_default();
                    req.rootfs = resp
                        .mounts
                        .into_iter()
                        .map(|m| {
                            let mut out = template.clone();
                            out.type_ = m.r#type;
                            out.source = m.source;
                            out.options = m.options;
                            out
                        })
                        .collect();
                    info!(
                        "container label {}={branch}: session re-pointed to branch {on:?}",
                        policy::BRANCH_LABEL
                    );
                } else if on != branch {
                    warn!(
                        "container label {}={branch} ignored: the snapshot label containerd.io/snapshot/{} chose branch {on:?}",
                        policy::BRANCH_LABEL,
                        policy::BRANCH_LABEL
                    );
                }
                Ok(())
            }
            Ok(None) => {
                debug!(
                    "no layerstack session for {}: label {} ignored",
                    self.id,
                    policy::BRANCH_LABEL
                );
                Ok(())
            }
            Err(e) => Err(status(
                Code::FAILED_PRECONDITION,
                format!(
                    "container label {}={branch}: cannot move the session to that branch: {}",
                    policy::BRANCH_LABEL,
                    crate::error_chain(&e)
                ),
            )),
        }
    }

    /// The init process's publish step: read the labels, decide, ask the daemon,
    /// log the outcome. Never fails: the task's exit status is what matters here.
    async fn publish_step(&self, exit_status: u32) {
        // The labels read at create decide (they were validated, and recorded in
        // the daemon); a label changed later does not (it could fail open).
        let cached = self.init.lock().await.labels.clone();
        let labels = match cached {
            Some(l) => l,
            None => match self.labels().await {
                Ok(l) => l.unwrap_or_default(),
                Err(e) => {
                    warn!("cannot read the container's labels ({}); the daemon applies the recorded policy", crate::error_chain(&e));
                    publish_auto(&self.state, &self.namespace, &self.id, exit_status).await;
                    return;
                }
            },
        };
        let policy = policy::policy_from_labels(&labels).unwrap_or_else(|e| {
            warn!("{e}; using on-exit");
            ExitPolicy::OnExit
        });
        publish_now(&self.state, &self.namespace, &self.id, policy, exit_status).await;
    }
}

/// Whether `dir` exists and has no entries (an error counts as "not empty":
/// the publish step then runs as usual).
fn dir_is_empty(dir: &std::path::Path) -> bool {
    std::fs::read_dir(dir)
        .map(|mut d| d.next().is_none())
        .unwrap_or(false)
}

/// Ask the daemon to end the run by the policy recorded on the session
/// (`SetPolicy` at create; on-exit if none) and `exit_status`: the path for when
/// this process no longer knows the container's labels.
pub(crate) async fn publish_auto(state: &BundleState, namespace: &str, id: &str, exit_status: u32) {
    let timeout = Duration::from_millis(state.publish_timeout_ms.max(1));
    publish_auto_with_timeout(state, namespace, id, exit_status, timeout).await
}

pub(crate) async fn publish_auto_with_timeout(
    state: &BundleState,
    namespace: &str,
    id: &str,
    exit_status: u32,
    timeout: Duration,
) {
    let reason = format!("exit status {exit_status}, by the recorded policy");
    match daemon::publish(&state.admin_address, namespace, id, api::EndAction::Auto, Some(exit_status), &reason, timeout).await {
        Ok(Some(s)) => info!("layerstack end of run ({reason}): {}", daemon::describe_session(&s)),
        Ok(None) => debug!("no layerstack session for {namespace}/{id}: nothing to publish"),
        Err(e) => error!(
            "layerstack publish of {namespace}/{id} failed ({}); the exit status is returned anyway and the session stays unpublished",
            crate::error_chain(&e)
        ),
    }
}

/// Ask the daemon to publish or discard, per `policy` and `exit_status`, waiting
/// at most the configured publish timeout. Logs the outcome or the failure.
pub(crate) async fn publish_now(
    state: &BundleState,
    namespace: &str,
    id: &str,
    policy: ExitPolicy,
    exit_status: u32,
) {
    publish_with_timeout(
        state,
        namespace,
        id,
        policy,
        exit_status,
        Duration::from_millis(state.publish_timeout_ms.max(1)),
    )
    .await
}

pub(crate) async fn publish_with_timeout(
    state: &BundleState,
    namespace: &str,
    id: &str,
    policy: ExitPolicy,
    exit_status: u32,
    timeout: Duration,
) {
    let (decision, reason) = policy::decide(policy, exit_status);
    let p = match decision {
        Decision::Publish => api::EndAction::Publish,
        Decision::Discard => api::EndAction::Discard,
        // The daemon applies the policy recorded at create: a checkpoint.
        Decision::Checkpoint => api::EndAction::Auto,
    };
    let started = std::time::Instant::now();
    match daemon::publish(&state.admin_address, namespace, id, p, Some(exit_status), &reason, timeout).await {
        Ok(Some(s)) => info!(
            "layerstack {} ({policy}, exit status {exit_status}) in {} ms: {}",
            if decision == Decision::Publish { "publish" } else { "discard" },
            started.elapsed().as_millis(),
            daemon::describe_session(&s)
        ),
        Ok(None) => debug!("no layerstack session for {namespace}/{id}: nothing to publish"),
        Err(e) => error!(
            "layerstack publish of {namespace}/{id} failed ({}); the exit status is returned anyway and the session stays unpublished",
            crate::error_chain(&e)
        ),
    }
}

#[async_trait]
impl Task for Proxy {
    async fn state(&self, ctx: &TtrpcContext, req: StateRequest) -> ttrpc::Result<StateResponse> {
        let cx = fwd(ctx);
        self.call(|c| async move { c.state(cx, &req).await }).await
    }

    async fn create(
        &self,
        ctx: &TtrpcContext,
        mut req: CreateTaskRequest,
    ) -> ttrpc::Result<CreateTaskResponse> {
        // Without the daemon this container's writes could never be published:
        // refuse it now, not silently at delete (only a task with a rootfs has a
        // session; an exec'd or rootfs-less task has nothing to publish).
        if !req.rootfs.is_empty() {
            daemon::probe_admin(&self.state.admin_address)
                .map_err(|m| status(Code::FAILED_PRECONDITION, m))?;
        }
        let labels = match self.labels().await {
            Ok(l) => l,
            Err(e) => {
                warn!(
                    "cannot read the container's labels at create: {}",
                    crate::error_chain(&e)
                );
                None
            }
        };
        if let Some(l) = &labels {
            let p = policy::policy_from_labels(l).map_err(|e| status(Code::INVALID_ARGUMENT, e))?;
            if l.contains_key(policy::PUBLISH_LABEL) {
                self.record_policy(p).await?;
            }
        }
        // Runtime options: ours never reach runc-v2.
        let opts = match req.options.take() {
            Some(any) => RuntimeOptions::from_any(any)
                .map_err(|e| status(Code::INVALID_ARGUMENT, crate::error_chain(&e)))?,
            None => RuntimeOptions::None,
        };
        if let RuntimeOptions::Other(t) = &opts {
            warn!(
                "runtime options of type {t} are not understood by {}; dropped",
                crate::config::INNER_SHIM_NAME
            );
        }
        let bundle = if req.bundle.is_empty() {
            self.bundle.clone()
        } else {
            PathBuf::from(&req.bundle)
        };
        let systemd = crate::config::bundle_cgroups_path(&bundle)
            .is_some_and(|p| crate::config::is_systemd_cgroups_path(&p));
        if systemd && !matches!(opts, RuntimeOptions::Runc(_)) {
            info!("cgroupsPath is in systemd form and no runc options came along: using runc's systemd cgroup driver");
        }
        req.options = MessageField::from_option(
            opts.for_inner_with(self.state.runc_root.as_deref(), systemd),
        );
        let has_rootfs = !req.rootfs.is_empty();
        let node = labels
            .as_ref()
            .and_then(policy::node_from_labels)
            .map(str::to_string);
        if let Some(branch) = labels.as_ref().and_then(policy::branch_from_labels) {
            if node.is_some() {
                return Err(status(
                    Code::INVALID_ARGUMENT,
                    format!(
                        "container labels {} and {} both set: a node's attempt runs on the node's root, not a branch head; set only one",
                        policy::NODE_LABEL,
                        policy::BRANCH_LABEL
                    ),
                ));
            }
            if has_rootfs {
                let branch = branch.to_string();
                self.apply_branch(&branch, &mut req).await?;
            }
        }
        if let (Some(node), true) = (&node, has_rootfs) {
            self.apply_node(node, &mut req).await?;
        }
        let upper = req
            .rootfs
            .iter()
            .flat_map(|m| m.options.iter())
            .find_map(|o| o.strip_prefix("upperdir="))
            .map(PathBuf::from);
        if let Some(up) = &upper {
            debug!("create {}: upperdir {}", self.id, up.display());
        }
        let cx = fwd(ctx);
        let r = self.call(|c| async move { c.create(cx, &req).await }).await;
        if r.is_ok() {
            if let Err(e) = state::mark_created(&self.bundle) {
                warn!(
                    "cannot record the create in {}: {e}",
                    state::state_path(&self.bundle).display()
                );
            }
            let mut init = self.init.lock().await;
            init.created = true;
            init.has_rootfs = has_rootfs;
            init.upper = upper;
            init.labels = labels;
        }
        r
    }

    async fn start(&self, ctx: &TtrpcContext, req: StartRequest) -> ttrpc::Result<StartResponse> {
        let cx = fwd(ctx);
        self.call(|c| async move { c.start(cx, &req).await }).await
    }

    async fn delete(
        &self,
        ctx: &TtrpcContext,
        req: DeleteRequest,
    ) -> ttrpc::Result<DeleteResponse> {
        let is_init = req.exec_id.is_empty();
        let cx = fwd(ctx);
        let r = self.call(|c| async move { c.delete(cx, &req).await }).await;
        if !is_init {
            return r;
        }
        match &r {
            Ok(resp) => {
                // The inner shim has run `runc delete` and unmounted the rootfs.
                let status = resp.exit_status;
                if let Err(e) = state::update(&self.bundle, |s| {
                    s.exit_status = Some(status);
                    s.init_deleted = true;
                }) {
                    warn!(
                        "cannot record the exit status in {}: {e}",
                        state::state_path(&self.bundle).display()
                    );
                }
                let (has_rootfs, upper) = {
                    let init = self.init.lock().await;
                    (init.has_rootfs, init.upper.clone())
                };
                if has_rootfs {
                    match upper.filter(|u| dir_is_empty(u)) {
                        // Nothing to publish, discard or read back: the run ends
                        // through the daemon's /tasks/delete handler (released
                        // below), with the recorded policy, without a round trip
                        // on the path of this Delete.
                        Some(u) => debug!(
                            "{} wrote nothing (upper {} is empty): the daemon ends its run on /tasks/delete",
                            self.id,
                            u.display()
                        ),
                        None => self.publish_step(resp.exit_status).await,
                    }
                }
                if let Err(e) = state::mark_published(&self.bundle) {
                    warn!(
                        "cannot record the publish in {}: {e}",
                        state::state_path(&self.bundle).display()
                    );
                }
                self.init.lock().await.deleted = true;
                self.gate.release();
            }
            Err(ttrpc::Error::RpcStatus(st)) if st.code() == Code::NOT_FOUND => {
                debug!(
                    "inner delete of {}: {}; nothing to publish",
                    self.id,
                    st.message()
                )
            }
            Err(ttrpc::Error::RpcStatus(st)) => warn!(
                "inner delete of {} failed: {}; not publishing",
                self.id,
                st.message()
            ),
            Err(e) => warn!("inner delete of {} failed: {e}; not publishing", self.id),
        }
        r
    }

    async fn pids(&self, ctx: &TtrpcContext, req: PidsRequest) -> ttrpc::Result<PidsResponse> {
        let cx = fwd(ctx);
        self.call(|c| async move { c.pids(cx, &req).await }).await
    }

    async fn pause(&self, ctx: &TtrpcContext, req: PauseRequest) -> ttrpc::Result<Empty> {
        let cx = fwd(ctx);
        self.call(|c| async move { c.pause(cx, &req).await }).await
    }

    async fn resume(&self, ctx: &TtrpcContext, req: ResumeRequest) -> ttrpc::Result<Empty> {
        let cx = fwd(ctx);
        self.call(|c| async move { c.resume(cx, &req).await }).await
    }

    async fn checkpoint(
        &self,
        ctx: &TtrpcContext,
        req: CheckpointTaskRequest,
    ) -> ttrpc::Result<Empty> {
        let cx = fwd(ctx);
        self.call(|c| async move { c.checkpoint(cx, &req).await })
            .await
    }

    async fn kill(&self, ctx: &TtrpcContext, req: KillRequest) -> ttrpc::Result<Empty> {
        let cx = fwd(ctx);
        self.call(|c| async move { c.kill(cx, &req).await }).await
    }

    async fn exec(&self, ctx: &TtrpcContext, req: ExecProcessRequest) -> ttrpc::Result<Empty> {
        let cx = fwd(ctx);
        self.call(|c| async move { c.exec(cx, &req).await }).await
    }

    async fn resize_pty(&self, ctx: &TtrpcContext, req: ResizePtyRequest) -> ttrpc::Result<Empty> {
        let cx = fwd(ctx);
        self.call(|c| async move { c.resize_pty(cx, &req).await })
            .await
    }

    async fn close_io(&self, ctx: &TtrpcContext, req: CloseIORequest) -> ttrpc::Result<Empty> {
        let cx = fwd(ctx);
        self.call(|c| async move { c.close_io(cx, &req).await })
            .await
    }

    async fn update(&self, ctx: &TtrpcContext, req: UpdateTaskRequest) -> ttrpc::Result<Empty> {
        let cx = fwd(ctx);
        self.call(|c| async move { c.update(cx, &req).await }).await
    }

    async fn wait(&self, ctx: &TtrpcContext, req: WaitRequest) -> ttrpc::Result<WaitResponse> {
        let cx = fwd(ctx);
        self.call(|c| async move { c.wait(cx, &req).await }).await
    }

    async fn stats(&self, ctx: &TtrpcContext, req: StatsRequest) -> ttrpc::Result<StatsResponse> {
        let cx = fwd(ctx);
        self.call(|c| async move { c.stats(cx, &req).await }).await
    }

    async fn connect(
        &self,
        ctx: &TtrpcContext,
        req: ConnectRequest,
    ) -> ttrpc::Result<ConnectResponse> {
        let cx = fwd(ctx);
        let mut r = self
            .call(|c| async move { c.connect(cx, &req).await })
            .await?;
        // To containerd, the shim is the proxy.
        r.shim_pid = std::process::id();
        Ok(r)
    }

    async fn shutdown(&self, ctx: &TtrpcContext, req: ShutdownRequest) -> ttrpc::Result<Empty> {
        let done = {
            let init = self.init.lock().await;
            !init.created || init.deleted
        };
        // runc-v2 exits only when it serves no container any more.
        let cx = fwd(ctx);
        if let Err(e) = self
            .call(|c| async move { c.shutdown(cx, &req).await })
            .await
        {
            debug!("inner shutdown: {e}");
        }
        if done {
            self.exit.signal();
        }
        Ok(Empty::new())
    }
}
