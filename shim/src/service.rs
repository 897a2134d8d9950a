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
            // A proxy killed within milliseconds of its start may not have
            // recorded the pid yet.
            let pid = st.inner_pid.or_else(|| {
                inner::find_server_pid(&st.inner_shim, &self.namespace, &self.id, &self.address)
            });
            if let Some(pid) = pid {
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

/// The reply of `delete` after a normal run, when nothing is left to clean up:
/// the proxy's init `Delete` went through the inner shim (runc deleted the
/// container, the rootfs is unmounted), the publish step ran, and the inner
/// server (not shared with a pod) is gone. runc-v2's own `delete` action would
/// then only `runc delete --force` a container that no longer exists and
/// unmount nothing, at the cost of two process starts (~10 ms) on the path of
/// every `ctr run --rm`: containerd 1.6 waits for this action before the task
/// delete returns. `None`: something may be left; the full cleanup runs.
fn clean_exit_reply(st: &BundleState) -> Option<DeleteResponse> {
    if !(st.init_deleted && st.published) || st.inner_grouped {
        return None;
    }
    if inner::alive(st.inner_pid?) {
        return None;
    }
    let mut r = DeleteResponse::new();
    // containerd uses the reply only if the task is still listed (a lost Delete
    // reply): the real exit status beats runc-v2's 137 then.
    r.exit_status = st.exit_status.unwrap_or(137);
    r.exited_at = MessageField::some(now_timestamp());
    Some(r)
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
        let st = BundleState {
            address: socket_address(&opts.address, &opts.namespace, &grouping),
            events_address,
            inner_address,
            // Found by the server, off the path of `start` (a /proc scan: 1–6 ms).
            inner_pid: None,
            inner_grouped,
            inner_shim: cfg.inner_shim.clone(),
            admin_address: cfg.admin_address.clone(),
            runc_root: cfg.runc_root.clone(),
            publish_timeout_ms: cfg.publish_timeout.as_millis() as u64,
            created: false,
            exit_status: None,
            published: false,
            init_deleted: false,
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
        if let Some(reply) = st.as_ref().and_then(clean_exit_reply) {
            if let Some(st) = &st {
                for a in [&st.address, &st.events_address, &st.inner_address] {
                    if !listening(a) {
                        remove_socket_file(a);
                    }
                }
            }
            info!(
                "delete done in {} ms (clean exit: nothing left to clean up)",
                started.elapsed().as_millis()
            );
            return Ok(reply);
        }
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
        if !st.inner_grouped {
            // Find the inner server's pid (runc-v2 1.6 writes no pid file) and
            // record it for `delete`. Then, if the inner shim dies (killed,
            // crashed), nobody supervises the container and every forwarded RPC
            // fails: stop serving, so containerd sees this shim gone and runs our
            // `delete` action, which has runc-v2 kill and delete the container and
            // ends the session's run.
            let exit = self.exit.clone();
            let id = self.id.clone();
            let (known, bin, ns, address) = (
                st.inner_pid,
                st.inner_shim.clone(),
                self.namespace.clone(),
                self.address.clone(),
            );
            let bundle = bundle.clone();
            tokio::spawn(async move {
                let pid = match known {
                    Some(pid) => Some(pid),
                    None => {
                        let i = id.clone();
                        let found = tokio::task::spawn_blocking(move || {
                            inner::find_server_pid(&bin, &ns, &i, &address)
                        })
                        .await
                        .ok()
                        .flatten();
                        if let Some(pid) = found {
                            if let Err(e) = state::update(&bundle, |s| s.inner_pid = Some(pid)) {
                                warn!("cannot record the inner shim's pid {pid}: {e}");
                            }
                        }
                        found
                    }
                };
                let Some(pid) = pid else {
                    warn!("the inner shim server of {id} is not in /proc: its death would go unnoticed");
                    return;
                };
                debug!("inner shim server of {id}: pid {pid}");
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
            "proxy for {}/{} serving; inner shim {}, admin socket {}",
            self.namespace,
            self.id,
            st.inner_address,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A pid that surely is not running: a child that exited and was reaped.
    fn dead_pid() -> i32 {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id() as i32;
        c.wait().unwrap();
        pid
    }

    #[test]
    fn delete_takes_the_short_path_only_after_a_clean_run() {
        let clean = BundleState {
            inner_pid: Some(dead_pid()),
            created: true,
            exit_status: Some(3),
            published: true,
            init_deleted: true,
            ..Default::default()
        };
        let r = clean_exit_reply(&clean).expect("a clean run has nothing left");
        assert_eq!(r.exit_status, 3);
        // Anything that may still need runc-v2's cleanup takes the full path.
        let not = |f: fn(&mut BundleState)| {
            let mut s = clean.clone();
            f(&mut s);
            clean_exit_reply(&s).is_none()
        };
        assert!(not(|s| s.init_deleted = false), "init not deleted");
        assert!(not(|s| s.published = false), "publish step not run");
        assert!(not(|s| s.inner_grouped = true), "inner shim serves a pod");
        assert!(not(|s| s.inner_pid = None), "inner pid unknown");
        assert!(
            not(|s| s.inner_pid = Some(std::process::id() as i32)),
            "inner shim still running"
        );
    }
}
