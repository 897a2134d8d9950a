//! The shim's lifecycle for containerd (`containerd_shim::asynchronous::Shim`):
//! `start` (run the inner shim, then our server), the server itself, and
//! `delete` (clean up after the proxy, also after a SIGKILL).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use containerd_shim::asynchronous::publisher::RemotePublisher;
use containerd_shim::asynchronous::{spawn, ExitSignal, Shim};
use containerd_shim::{socket_address, Config, Error, Flags, StartOpts};
use containerd_shim_protos::api::{DeleteRequest, KillRequest, ShutdownRequest, WaitRequest};
use containerd_shim_protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim_protos::protobuf::{Message as _, MessageField};
use containerd_shim_protos::shim::shim::DeleteResponse;
use containerd_shim_protos::shim_async::create_events;
use containerd_shim_protos::ttrpc::context;
use containerd_shim_protos::ttrpc::r#async::Server;
use log::{debug, error, info, warn};
use tokio::sync::Mutex;

use crate::config::{self, RuntimeOptions};
use crate::events::{EventGate, Upstream};
use crate::inner::{self, InnerArgs};
use crate::proxy::{self, Proxy};
use crate::state::{self, BundleState};

/// Budget of the `delete` action: containerd 1.6 kills it after 5 s
/// (`io.containerd.timeout.shim.cleanup`).
const DELETE_BUDGET: Duration = Duration::from_millis(4500);

fn other(e: impl std::error::Error) -> Error {
    Error::Other(crate::error_chain(&e))
}

/// The proxy shim (see the crate docs).
pub struct ProxyShim {
    id: String,
    namespace: String,
    /// containerd's gRPC socket.
    address: String,
    publish_binary: String,
    bundle: String,
    debug: bool,
    exit: Arc<ExitSignal>,
    events_server: Mutex<Option<Server>>,
    upstream: Mutex<Option<Arc<Upstream>>>,
    state: Mutex<Option<BundleState>>,
}

fn now_timestamp() -> Timestamp {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mut t = Timestamp::new();
    t.seconds = d.as_secs() as i64;
    t.nanos = d.subsec_nanos() as i32;
    t
}

fn remove_socket_file(address: &str) {
    if address.is_empty() {
        return;
    }
    let p = inner::socket_path(address);
    match std::fs::remove_file(p) {
        Ok(()) => debug!("removed socket {p}"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => warn!("cannot remove socket {p}: {e}"),
    }
}

/// Whether something accepts connections on `address`.
fn listening(address: &str) -> bool {
    std::os::unix::net::UnixStream::connect(inner::socket_path(address)).is_ok()
}

impl ProxyShim {
    fn inner_args(&self, bin: PathBuf) -> InnerArgs {
        InnerArgs {
            bin,
            namespace: self.namespace.clone(),
            id: self.id.clone(),
            address: self.address.clone(),
            publish_binary: self.publish_binary.clone(),
            debug: self.debug,
        }
    }

    fn bundle_dir(&self) -> PathBuf {
        if self.bundle.is_empty() {
            std::env::current_dir().unwrap_or_default()
        } else {
            PathBuf::from(&self.bundle)
        }
    }

    /// Binds the events socket and serves [`EventGate`] on it.
    async fn serve_events(&self, address: &str, gate: Arc<EventGate>) -> Result<Server, Error> {
        let path = Path::new(inner::socket_path(address));
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(other)?;
        }
        let _ = std::fs::remove_file(path);
        let server = Server::new().bind(address).map_err(Error::Ttrpc)?;
        // Only root (containerd, runc-v2) may inject events.
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                .map_err(other)?;
        }
        let mut server = server.register_service(create_events(gate));
        server.start().await.map_err(Error::Ttrpc)?;
        Ok(server)
    }

    /// Stops the inner shim server of a task whose proxy is gone: through its
    /// API (kill, wait, delete, shutdown), then SIGKILL if it still runs and
    /// serves nobody else. Returns the init's DeleteResponse if the API gave one.
    async fn stop_inner(&self, st: &BundleState) -> Option<DeleteResponse> {
        let mut resp = None;
        if !st.inner_address.is_empty() {
            if let Ok(c) = inner::connect(&st.inner_address, Duration::from_millis(500)).await {
                let short = || context::with_duration(Duration::from_secs(1));
                let mut k = KillRequest::new();
                k.id = self.id.clone();
                k.signal = libc::SIGKILL as u32;
                k.all = true;
                if let Err(e) = c.kill(short(), &k).await {
                    debug!("inner kill: {e}");
                }
                let mut w = WaitRequest::new();
                w.id = self.id.clone();
                if let Err(e) = c
                    .wait(context::with_duration(Duration::from_secs(2)), &w)
                    .await
                {
                    debug!("inner wait: {e}");
                }
                let mut d = DeleteRequest::new();
                d.id = self.id.clone();
                match c
                    .delete(context::with_duration(Duration::from_secs(2)), &d)
                    .await
                {
                    Ok(r) => resp = Some(r),
                    Err(e) => debug!("inner delete: {e}"),
                }
                let mut s = ShutdownRequest::new();
                s.id = self.id.clone();
                s.now = true;
                let _ = c.shutdown(short(), &s).await;
            }
        }
        if !st.inner_grouped {
            if let Some(pid) = st.inner_pid {
                let until = Instant::now() + Duration::from_millis(500);
                while inner::alive(pid) && Instant::now() < until {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                if inner::alive(pid)
                    && inner::is_inner_server(
                        pid,
                        &st.inner_shim,
                        &self.namespace,
                        &self.id,
                        &self.address,
                    )
                {
                    warn!("inner shim {pid} still runs after shutdown; killing it");
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
            if !listening(&st.inner_address) {
                remove_socket_file(&st.inner_address);
            }
        }
        resp
    }
}

#[async_trait]
impl Shim for ProxyShim {
    type T = Proxy;

    async fn new(_runtime_id: &str, args: &Flags, _config: &mut Config) -> Self {
        Self {
            id: args.id.clone(),
            namespace: args.namespace.clone(),
            address: args.address.clone(),
            publish_binary: args.publish_binary.clone(),
            bundle: args.bundle.clone(),
            debug: args.debug,
            exit: Arc::new(ExitSignal::default()),
            events_server: Mutex::new(None),
            upstream: Mutex::new(None),
            state: Mutex::new(None),
        }
    }

    /// `start`: stdout and stderr are read together by containerd as the address,
    /// so nothing here logs; errors go back through the crate (stderr, exit 1).
    async fn start_shim(&mut self, opts: StartOpts) -> Result<String, Error> {
        let bundle = std::env::current_dir().map_err(other)?;
        let mut raw = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut raw).map_err(other)?;
        let ropts = RuntimeOptions::from_any_bytes(&raw).map_err(other)?;
        let cfg = config::resolve(ropts.file_config().map_err(other)?, |k| {
            std::env::var(k).ok()
        });

        let me = std::env::current_exe().and_then(|p| p.canonicalize()).ok();
        if me.is_some() && std::fs::canonicalize(&cfg.inner_shim).ok() == me {
            return Err(Error::InvalidArgument(format!(
                "the inner shim {} is this binary; point inner_shim / {} at containerd-shim-runc-v2",
                cfg.inner_shim.display(),
                config::INNER_SHIM_ENV
            )));
        }
        let grouping = format!("layerstack/{}", opts.id);
        let events_address = socket_address(
            &opts.address,
            &opts.namespace,
            &format!("layerstack-events/{}", opts.id),
        );
        let args = InnerArgs {
            bin: cfg.inner_shim.clone(),
            namespace: opts.namespace.clone(),
            id: opts.id.clone(),
            address: opts.address.clone(),
            publish_binary: opts.publish_binary.clone(),
            debug: opts.debug,
        };
        let inner_opts = ropts
            .for_inner(cfg.runc_root.as_deref())
            .and_then(|a| a.write_to_bytes().ok());
        let inner_address = inner::start(&args, &bundle, inner_opts.as_deref(), &events_address)
            .await
            .map_err(other)?;
        let inner_grouped =
            inner_address != socket_address(&opts.address, &opts.namespace, &opts.id);
        let inner_pid = if inner_grouped {
            None
        } else {
            inner::find_server_pid(&cfg.inner_shim, &opts.namespace, &opts.id, &opts.address)
        };
        let st = BundleState {
            address: socket_address(&opts.address, &opts.namespace, &grouping),
            events_address,
            inner_address,
            inner_pid,
            inner_grouped,
            inner_shim: cfg.inner_shim.clone(),
            admin_address: cfg.admin_address.clone(),
            runc_root: cfg.runc_root.clone(),
            publish_timeout_ms: cfg.publish_timeout.as_millis() as u64,
            created: false,
            exit_status: None,
            published: false,
        };
        state::save(&bundle, &st).map_err(other)?;

        let address = match spawn(opts, &grouping, Vec::new()).await {
            Ok(a) => a,
            Err(e) => {
                // Leave no inner shim behind.
                self.stop_inner(&st).await;
                return Err(e);
            }
        };
        // containerd (re)connects through this file, also after a restart.
        state::write_atomic(&bundle, state::ADDRESS_FILE, address.as_bytes()).map_err(other)?;
        Ok(address)
    }

    /// `delete`: runs after every shim exit (containerd 1.6 "cleaning up after
    /// shim disconnected") and must be idempotent. stdout is the reply only.
    async fn delete_shim(&mut self) -> Result<DeleteResponse, Error> {
        let started = Instant::now();
        let bundle = self.bundle_dir();
        crate::logging::init_delete_logger(&bundle, &self.namespace, &self.id, self.debug);
        let st = match state::load(&bundle) {
            Ok(s) => s,
            Err(e) => {
                warn!("cannot read {}: {e}", state::state_path(&bundle).display());
                None
            }
        };
        let mut resp = None;
        if let Some(st) = &st {
            resp = self.stop_inner(st).await;
        }
        // runc delete --force + unmount, as containerd would have asked runc-v2.
        let bin = st
            .as_ref()
            .map(|s| s.inner_shim.clone())
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or_else(|| config::resolve(None, |k| std::env::var(k).ok()).inner_shim);
        if bundle.is_dir() {
            let left = DELETE_BUDGET
                .saturating_sub(started.elapsed())
                .min(Duration::from_secs(3));
            match inner::delete_action(&self.inner_args(bin), &bundle, left).await {
                Ok((r, stderr)) => {
                    if !stderr.is_empty() {
                        debug!("{} delete: {stderr}", config::INNER_SHIM_NAME);
                    }
                    resp.get_or_insert(r);
                }
                Err(e) => warn!("{}", crate::error_chain(&e)),
            }
        }
        if let Some(st) = &st {
            if st.created && !st.published {
                let exit_status = st
                    .exit_status
                    .or(resp.as_ref().map(|r| r.exit_status))
                    .unwrap_or(137);
                let left = DELETE_BUDGET.saturating_sub(started.elapsed());
                if left > Duration::from_millis(200) {
                    // `ctr run --rm` may have deleted the container record: the
                    // daemon applies the policy recorded at create.
                    info!("the proxy of {} is gone; ending its run here (exit status {exit_status}, recorded policy)", self.id);
                    proxy::publish_auto_with_timeout(
                        st,
                        &self.namespace,
                        &self.id,
                        exit_status,
                        left,
                    )
                    .await;
                } else {
                    error!(
                        "no time left to publish {}; the daemon's /tasks/delete handler will",
                        self.id
                    );
                }
                if let Err(e) = state::mark_published(&bundle) {
                    debug!("cannot record the publish: {e}");
                }
            }
            // Sockets of a proxy that was killed.
            for a in [&st.address, &st.events_address] {
                if !listening(a) {
                    remove_socket_file(a);
                }
            }
        }
        info!("delete done in {} ms", started.elapsed().as_millis());
        Ok(resp.unwrap_or_else(|| {
            let mut r = DeleteResponse::new();
            r.exit_status = 137;
            r.exited_at = MessageField::some(now_timestamp());
            r
        }))
    }

    async fn wait(&mut self) {
        self.exit.wait().await;
        if let Some(up) = self.upstream.lock().await.as_ref() {
            // The held /tasks/delete and the rest go out before we exit.
            up.flush(Duration::from_secs(5)).await;
        }
        if let Some(mut s) = self.events_server.lock().await.take() {
            let _ = s.shutdown().await;
        }
        if let Some(st) = self.state.lock().await.as_ref() {
            remove_socket_file(&st.events_address);
            if !st.inner_grouped {
                // runc-v2 removes the socket named in <bundle>/address on exit —
                // ours — and leaves its own.
                let until = Instant::now() + Duration::from_secs(2);
                while listening(&st.inner_address) && Instant::now() < until {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                if !listening(&st.inner_address) {
                    remove_socket_file(&st.inner_address);
                }
            }
        }
        info!("proxy for {} exits", self.id);
    }

    async fn create_task_service(&self, _publisher: RemotePublisher) -> Proxy {
        crate::logging::init_server_logger(&self.namespace, &self.id, self.debug);
        let bundle = std::env::current_dir().unwrap_or_default();
        let st = match state::load(&bundle) {
            Ok(Some(s)) => s,
            Ok(None) => {
                error!(
                    "no {} in {}: the proxy cannot reach its inner shim",
                    state::STATE_FILE,
                    bundle.display()
                );
                BundleState::default()
            }
            Err(e) => {
                error!("cannot read {}: {e}", state::state_path(&bundle).display());
                BundleState::default()
            }
        };
        let ttrpc = std::env::var("TTRPC_ADDRESS").unwrap_or_default();
        let upstream = Upstream::new(&ttrpc);
        let hold = Duration::from_millis(st.publish_timeout_ms) + Duration::from_secs(60);
        let gate = EventGate::new(&self.id, upstream.clone(), hold);
        if !st.events_address.is_empty() {
            match self.serve_events(&st.events_address, gate.clone()).await {
                Ok(s) => *self.events_server.lock().await = Some(s),
                Err(e) => error!("cannot serve events on {}: {e}", st.events_address),
            }
        }
        *self.upstream.lock().await = Some(upstream);
        *self.state.lock().await = Some(st.clone());
        if let (Some(pid), false) = (st.inner_pid, st.inner_grouped) {
            // If the inner shim dies (killed, crashed), nobody supervises the
            // container and every forwarded RPC fails: stop serving, so containerd
            // sees this shim gone and runs our `delete` action, which has runc-v2
            // kill and delete the container and ends the session's run.
            let exit = self.exit.clone();
            let id = self.id.clone();
            tokio::spawn(async move {
                while inner::alive(pid) {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                // A normal Shutdown also ends the inner shim: let it finish first.
                tokio::time::sleep(Duration::from_secs(1)).await;
                error!("inner shim {pid} of {id} is gone; this proxy exits so containerd cleans up the task");
                exit.signal();
            });
        }
        info!(
            "proxy for {}/{} serving; inner shim {} (pid {:?}), admin socket {}",
            self.namespace,
            self.id,
            st.inner_address,
            st.inner_pid,
            st.admin_address.display()
        );
        Proxy::new(
            self.id.clone(),
            self.namespace.clone(),
            bundle,
            PathBuf::from(&self.address),
            st,
            gate,
            self.exit.clone(),
        )
    }
}
