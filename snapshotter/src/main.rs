//! `containerd-layerstack-grpc`: the LayerStack daemon. Serves containerd's
//! Snapshots API as a proxy plugin and LayerStack's admin API, each on its own
//! unix socket, publishes sessions when containerd deletes their task, and serves
//! Prometheus metrics. The engine does the work; this binary only wires it
//! (config, logging, sockets, readiness, metrics).

// tonic::Status is the error type of every gRPC handler here (containerd-snapshots'
// trait fixes it); boxing it would only move the allocation.
#![allow(clippy::result_large_err)]

mod admin;
mod auth;
mod base_image;
mod containerd;
mod export;
mod filters;
mod graph;
mod history;
mod import;
mod inspect;
mod memory;
mod metrics;
mod notify;
mod outcomes;
mod owned;
mod pull;
mod push;
mod rollout;
mod run;
mod sandbox;
mod service;
mod sockets;
mod wasi;
mod wire;

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use layerstack_config::{Config, Durability};
use layerstack_engine::store::{Store, StoreLock, StoreOptions};
use layerstack_engine::{Engine, EngineSettings};
use tokio_stream::wrappers::UnixListenerStream;
use tracing::{error, info, warn};

/// Log line format.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    /// Human-readable lines (colour only on a terminal).
    Text,
    /// One JSON object per line.
    Json,
}

impl From<layerstack_config::LogFormat> for LogFormat {
    fn from(f: layerstack_config::LogFormat) -> Self {
        match f {
            layerstack_config::LogFormat::Text => Self::Text,
            layerstack_config::LogFormat::Json => Self::Json,
        }
    }
}

/// LayerStack daemon: containerd proxy snapshotter, admin API, publisher.
#[derive(Debug, Parser)]
#[command(
    name = "containerd-layerstack-grpc",
    version,
    about = "LayerStack daemon: containerd proxy snapshotter, admin API and publisher",
    long_about = "LayerStack daemon: serves containerd's Snapshots API (proxy plugin \"layerstack\") and \
LayerStack's admin API on unix sockets, publishes a container's writes when containerd deletes its \
task, and serves Prometheus metrics. Settings come from --config FILE (commented defaults: \
`layerstack config daemon`); flags override the file. Under systemd (Type=notify) it reports \
READY=1 once both sockets answer. docs/operations.md has the details."
)]
struct Args {
    /// Config file (TOML); flags override its values.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Store root (local ext4, xfs or btrfs) [default: /var/lib/layerstack].
    #[arg(long, value_name = "DIR")]
    root: Option<PathBuf>,
    /// Snapshots API socket [default: /run/layerstack/snapshotter.sock].
    #[arg(long, value_name = "SOCKET")]
    address: Option<PathBuf>,
    /// Admin API socket [default: /run/layerstack/admin.sock].
    #[arg(long, value_name = "SOCKET")]
    admin_address: Option<PathBuf>,
    /// containerd's socket [default: /run/containerd/containerd.sock].
    #[arg(long, value_name = "SOCKET")]
    containerd_address: Option<PathBuf>,
    /// Prometheus endpoint, HOST:PORT (port 0: any free port); an address
    /// given here that cannot be bound stops the daemon [default:
    /// 127.0.0.1:9464, or a free port if that one is taken; `[metrics] enabled =
    /// false` turns it off].
    #[arg(long, value_name = "ADDR")]
    metrics_address: Option<SocketAddr>,
    /// Print containerd 1.6/1.7 config entries for this daemon and exit (`layerstack
    /// config containerd` covers containerd 2.x, nerdctl and Docker too).
    #[arg(long)]
    print_containerd_config: bool,
    /// Log filter: a level (error, warn, info, debug, trace) or a tracing
    /// directive list such as `info,layerstack_engine=debug` [default: $RUST_LOG,
    /// else `[log] level`, else info].
    #[arg(long, value_name = "FILTER")]
    log_level: Option<String>,
    /// Log line format [default: `[log] format`, else text].
    #[arg(long, value_enum)]
    log_format: Option<LogFormat>,
    /// Live Mode B sessions at most ([sandbox] max_sessions) [default: 256].
    #[arg(long, value_name = "N")]
    sandbox_max_sessions: Option<u64>,
}

/// Refuse configurations that would only fail later, naming what to change.
fn validate(cfg: &mut Config) -> Result<()> {
    layerstack_engine::store::validate_branch(&cfg.default_branch)
        .map_err(|e| anyhow::anyhow!("default_branch: {e}"))?;
    if cfg.address == cfg.admin_address {
        anyhow::bail!(
            "the snapshots socket and the admin socket are both {}: give --address and --admin-address different paths",
            cfg.address.display()
        );
    }
    sandbox_limits(cfg)
        .validate("[sandbox] default_")
        .map_err(|e| anyhow::anyhow!(e))?;
    if let Some(p) = &cfg.sandbox.cgroup_parent {
        if !p.starts_with('/') || p.split('/').any(|c| c == ".." || c == ".") || p == "/" {
            anyhow::bail!(
                "[sandbox] cgroup_parent = {p:?} is not a cgroup path below the hierarchy's root: give an absolute path such as \"/layerstack.slice/sandboxes\" (no . or .. components)"
            );
        }
    }
    if cfg.root.is_relative() {
        let cwd = std::env::current_dir().context("cannot resolve the relative --root")?;
        cfg.root = cwd.join(&cfg.root);
    }
    Ok(())
}

/// Logging to stderr. The filter: `--log-level`, else `$RUST_LOG`, else the
/// config's `[log] level`, else `info`.
fn init_logging(flag: Option<&str>, config: Option<&str>, format: LogFormat) {
    let filter = match flag {
        Some(l) => tracing_subscriber::EnvFilter::new(l),
        None => tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(config.unwrap_or("info"))),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only where a human reads them: never into files,
        // journald or pipes.
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

/// Raise the open-file limit to its hard maximum: the mount census and deep
/// fd-relative walks hold one descriptor per directory level.
fn raise_nofile() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
        }
    }
}

fn main() {
    // Before any thread allocates: one malloc arena per core.
    memory::limit_arenas();
    // A replacement process spawner runs this binary again (see
    // layerstack_sandbox::spawner::exec): it serves and never returns.
    layerstack_sandbox::spawner::exec_entry(&std::env::args_os().skip(1).collect::<Vec<_>>());
    // First, while the daemon is one small thread: the process that clones
    // daemon-owned sessions' inits and Exec's waiters (a fork of it copies
    // little; a fork of the running daemon copied its whole address space).
    owned::fork_at_start();
    // Named threads: a system-wide profile (`perf`, the benchmarks) tells the
    // daemon's workers from every other tokio program's `tokio-rt-worker`.
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("layerstack-grpc")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the tokio runtime: {e}");
            std::process::exit(1);
        }
    };
    rt.block_on(async_main());
    // A blocking call that never returns (a WASI module's open of a FIFO no
    // one writes) must not keep a stopping daemon alive: what is still
    // running after the shutdown's grace is abandoned.
    rt.shutdown_timeout(std::time::Duration::from_secs(5));
}

async fn async_main() {
    let args = Args::parse();
    let loaded = match &args.config {
        Some(p) => Config::load(p).map_err(anyhow::Error::from),
        None => Ok(Config::default()),
    };
    let (level, format) = match &loaded {
        Ok(c) => (c.log.level.clone(), c.log.format.into()),
        Err(_) => (None, LogFormat::Text),
    };
    init_logging(
        args.log_level.as_deref(),
        level.as_deref(),
        args.log_format.unwrap_or(format),
    );
    let result = match loaded {
        Ok(cfg) => run(args, cfg).await,
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        // One line on stderr (the tracing log also goes to stderr).
        error!("{e:#}");
        std::process::exit(1);
    }
}

/// Both sockets answer a request: the admin API its `Status`, the Snapshots API a
/// `List` that matches nothing. Retried for `within`.
async fn probe(snapshots: &Path, admin: &Path, within: Duration) -> Result<()> {
    use containerd_snapshots::api::snapshots::v1::{
        snapshots_client::SnapshotsClient, ListSnapshotsRequest,
    };
    let once = || async {
        let mut a = layerstack_api::connect(admin.to_path_buf())
            .await
            .context("admin socket")?;
        a.status(layerstack_api::StatusRequest {})
            .await
            .context("admin Status")?;
        let path = snapshots.to_path_buf();
        let ch = tonic::transport::Endpoint::try_from("http://[::]:50051")?
            .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                tokio::net::UnixStream::connect(path.clone())
            }))
            .await
            .context("snapshots socket")?;
        let mut stream = SnapshotsClient::new(ch)
            .list(ListSnapshotsRequest {
                snapshotter: layerstack_config::snippets::SNAPSHOTTER.to_string(),
                filters: vec!["name==\"layerstack.readiness-probe\"".to_string()],
            })
            .await
            .context("snapshots List")?
            .into_inner();
        while stream.message().await.context("snapshots List")?.is_some() {}
        anyhow::Ok(())
    };
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let attempt = match tokio::time::timeout(Duration::from_secs(5), once()).await {
            Ok(r) => r,
            Err(_) => Err(anyhow::anyhow!("no answer within 5 s")),
        };
        match attempt {
            Ok(()) => return Ok(()),
            Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// The default limits of daemon-owned sessions (`[sandbox] default_*`).
fn sandbox_limits(cfg: &Config) -> layerstack_sandbox::cgroup::Limits {
    layerstack_sandbox::cgroup::Limits {
        cpu_millis: cfg.sandbox.default_cpu_millis,
        memory_bytes: cfg.sandbox.default_memory_bytes,
        pids: cfg.sandbox.default_pids,
    }
}

/// Probes the machine's cgroups for session limits and logs what is there
/// (docs/operations.md "Session limits"): never fails the start.
/// `companions`: the daemon's helper processes (its process spawner).
fn probe_cgroups(cfg: &Config, companions: &[u32]) -> layerstack_sandbox::cgroup::Cgroups {
    // A tag stable for this store (FNV-1a of the root's path): leftovers of
    // an earlier run are this daemon's to remove, another daemon's are not.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in cfg.root.as_os_str().as_encoded_bytes() {
        h = (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
    }
    let tag = format!("ls{:08x}", h as u32);
    let cg = layerstack_sandbox::cgroup::Cgroups::probe(
        cfg.sandbox.cgroup_parent.as_deref(),
        &tag,
        companions,
    );
    for n in &cg.notes {
        info!(note = %n, "session cgroups");
    }
    let defaults = sandbox_limits(cfg);
    for (c, r) in cg.summary() {
        let asked = match c {
            layerstack_sandbox::cgroup::Controller::Cpu => defaults.cpu_millis,
            layerstack_sandbox::cgroup::Controller::Memory => defaults.memory_bytes,
            layerstack_sandbox::cgroup::Controller::Pids => defaults.pids,
        } != 0;
        match r {
            Ok(dir) => info!(controller = c.name(), parent = %dir, "session limits available"),
            Err(why) if asked => {
                warn!(controller = c.name(), reason = %why, "a default session limit ([sandbox] default_*) needs a cgroup controller the machine does not offer: every daemon-owned session will fail to start until it is fixed or the default is 0")
            }
            Err(why) => {
                info!(controller = c.name(), reason = %why, "session limits of this controller are not available")
            }
        }
    }
    cg
}

async fn run(args: Args, mut cfg: Config) -> Result<()> {
    if let Some(v) = args.root {
        cfg.root = v;
    }
    if let Some(v) = args.address {
        cfg.address = v;
    }
    if let Some(v) = args.admin_address {
        cfg.admin_address = v;
    }
    if let Some(v) = args.containerd_address {
        cfg.containerd_address = v;
    }
    if let Some(v) = args.metrics_address {
        cfg.metrics.address = Some(v);
    }
    if let Some(v) = args.sandbox_max_sessions {
        cfg.sandbox.max_sessions = v;
    }
    if args.print_containerd_config {
        let e = layerstack_config::snippets::Endpoints {
            root: cfg.root.clone(),
            address: cfg.address.clone(),
            admin_address: cfg.admin_address.clone(),
            containerd_address: cfg.containerd_address.clone(),
            metrics_address: cfg.metrics.address(),
            ..Default::default()
        };
        print!(
            "{}",
            layerstack_config::snippets::containerd(
                layerstack_config::snippets::ContainerdVersion::V1_6,
                &e,
                &layerstack_config::snippets::host_platform(),
            )?
        );
        return Ok(());
    }

    validate(&mut cfg)?;
    raise_nofile();
    let exclude = layerstack_engine::publisher::ExclusionRules::new(&cfg.exclude)
        .context("config key `exclude`")?;
    // Refuse to start before touching anything: another daemon on the root, a
    // socket another process serves.
    let tcp = cfg
        .api
        .tcp
        .as_ref()
        .map(auth::TcpSettings::load)
        .transpose()?;
    let lock = StoreLock::acquire(&cfg.root)?;
    // Who may call (auth.rs): the snapshots socket serves containerd (root);
    // the admin socket root and `[api]`'s uids and gids. Every socket is 0660
    // (never world-writable); the allowed uids and gids reach the admin socket
    // through a POSIX ACL, and the peer check is the gate.
    let admin_policy = auth::PeerPolicy::admin(&cfg.api);
    let snap_socket = sockets::Socket::bind(&cfg.address, 0o660)?;
    let admin_socket = sockets::Socket::bind_granting(
        &cfg.admin_address,
        0o660,
        &cfg.api.allowed_uids,
        &cfg.api.allowed_gids,
    )?;
    let tcp_listener = match &tcp {
        Some(t) => {
            let l = std::net::TcpListener::bind(t.address).with_context(|| {
                format!(
                    "cannot serve the admin API on {}: choose another [api.tcp] address",
                    t.address
                )
            })?;
            l.set_nonblocking(true)?;
            Some(tokio::net::TcpListener::from_std(l)?)
        }
        None => None,
    };
    let metrics_listener = cfg
        .metrics
        .enabled
        .then(|| metrics::bind(cfg.metrics.address(), cfg.metrics.address.is_some()))
        .transpose()?;
    let metrics_address = match &metrics_listener {
        Some(l) => Some(l.local_addr().context("metrics listener address")?),
        None => None,
    };
    let notifier = notify::Notifier::from_env().unwrap_or_else(|e| {
        warn!(error = %e, "not reporting readiness to the service manager");
        notify::Notifier::disabled()
    });
    let mount_address = cfg.mount_address();
    // Root only: its peer check is in sandbox.rs (Mode B needs root).
    let mount_socket = sockets::Socket::bind(&mount_address, 0o660)?;
    let opts = StoreOptions {
        durability: match cfg.durability {
            Durability::Disposable => layerstack_engine::store::Durability::Disposable,
            Durability::Durable => layerstack_engine::store::Durability::Durable,
        },
        default_branch: cfg.default_branch.clone(),
        startup_sweep: true,
    };
    let store = Arc::new(Store::open(&cfg.root, &opts)?);
    info!(root = %cfg.root.display(), lock = %lock.path().display(), "store open");
    let settings = EngineSettings {
        exclude,
        merge: layerstack_engine::publisher::MergeOptions {
            max_bytes: cfg.merge.max_file_bytes,
            max_lines: usize::try_from(cfg.merge.max_lines).unwrap_or(usize::MAX),
            timeout: std::time::Duration::from_millis(cfg.merge.timeout_ms),
            diff_algorithm: match cfg.merge.diff_algorithm {
                layerstack_config::DiffAlgorithm::Histogram => {
                    layerstack_engine::publisher::DiffAlgorithm::Histogram
                }
                layerstack_config::DiffAlgorithm::Myers => {
                    layerstack_engine::publisher::DiffAlgorithm::Myers
                }
            },
        },
        userxattr: false,
        max_capture_paths: cfg.capture.max_paths,
        max_capture_bytes: cfg.capture.max_bytes,
        history: layerstack_engine::HistorySettings {
            squash_threshold: usize::try_from(cfg.history.squash_threshold).unwrap_or(usize::MAX),
            squash_keep: usize::try_from(cfg.history.squash_keep).unwrap_or(usize::MAX),
            kept_upper_retention: std::time::Duration::from_secs(
                cfg.history.kept_upper_retention_h.saturating_mul(3600),
            ),
        },
        sandbox: layerstack_engine::SandboxSettings {
            max_sessions: usize::try_from(cfg.sandbox.max_sessions).unwrap_or(usize::MAX),
            create_rate: cfg.sandbox.create_rate,
            holder_grace: std::time::Duration::from_secs(cfg.sandbox.holder_grace_s),
            cpu_budget_millis: cfg.sandbox.cpu_budget_millis,
            memory_budget_bytes: cfg.sandbox.memory_budget_bytes,
        },
        publish_workers: usize::try_from(cfg.publish_workers).unwrap_or(usize::MAX),
    };
    let engine = Engine::new(store.clone(), settings);
    if cfg.history.gc_interval_s > 0 {
        engine.spawn_periodic_gc(std::time::Duration::from_secs(cfg.history.gc_interval_s));
    }
    // Graph operations the last run left half-done: before serving, so a new
    // operation is never mistaken for a dead one.
    match engine.recover_operations().await {
        Ok(0) => {}
        Ok(n) => info!(
            operations = n,
            "cleaned up graph operations interrupted by the last stop"
        ),
        Err(e) => {
            return Err(anyhow::anyhow!(
                "cannot clean up graph operations interrupted by the last stop: {}",
                layerstack_engine::error_chain(&e)
            ))
        }
    }
    // Finishing releases interrupted by the last stop may publish large
    // sessions: in the background, never delaying serving.
    {
        let engine = engine.clone();
        tokio::spawn(async move {
            match engine.recover().await {
                Ok(0) => {}
                Ok(n) => info!(
                    sessions = n,
                    "finished releases interrupted by the last stop"
                ),
                Err(e) => {
                    tracing::warn!(error = %layerstack_engine::error_chain(&e), "cannot finish interrupted releases")
                }
            }
        });
    }
    let sandboxes = engine.recover_sandboxes().await?;
    if sandboxes > 0 {
        info!(
            sessions = sandboxes,
            "sandbox sessions of the last run: daemon-owned ones ended interrupted (their inits died with the last daemon); those held by a `layerstack` holder are kept for their holder's close (`session run` reconnects), and finished by their policy without an exit status if none comes within 60 s of their namespaces going"
        );
    }
    // After the sandboxes: an attempt whose sandbox that just ended (or that
    // never got one) ends infra_failed, never with a reward.
    let rollouts = engine.recover_rollouts().await?;
    if rollouts > 0 {
        info!(
            attempts = rollouts,
            "rollout attempts whose sandbox ended with the last daemon ended infra_failed (their samples can be retried)"
        );
    }
    let subscribed = Arc::new(AtomicBool::new(false));
    let metrics = metrics_listener
        .is_some()
        .then(|| Arc::new(metrics::Metrics::new()));
    // Before anything can publish: every outcome gets its log line and metrics.
    tokio::spawn(outcomes::watch(&engine, metrics.clone()));
    tokio::spawn(memory::watch(store.clone()));
    let holders = sandbox::Holders::new(mount_address.clone());
    let spawner = owned::Spawner::adopt();
    if let Err(why) = &spawner {
        error!(reason = %why, "no process spawner: daemon-owned sessions (CreateSession with sandbox options) and Exec will fail until the daemon restarts");
    }
    let companions: Vec<u32> = spawner.iter().map(|s| s.pid()).collect();
    let _ = holders.spawner.set(spawner);
    holders
        .wasi_ready
        .set_per_branch(cfg.sandbox.wasi_ready as usize);
    let _ = holders.limits.set(Arc::new(owned::SessionLimits {
        cgroups: Some(probe_cgroups(&cfg, &companions)),
        defaults: sandbox_limits(&cfg),
        id_map: cfg.sandbox.id_map(),
        file_stream_idle: (cfg.sandbox.file_stream_idle_s > 0)
            .then(|| std::time::Duration::from_secs(cfg.sandbox.file_stream_idle_s)),
        sockets: vec![
            cfg.admin_address.clone(),
            mount_address.clone(),
            cfg.address.clone(),
        ],
    }));
    holders
        .ready_inits
        .set_want(cfg.sandbox.ready_inits as usize);
    if let Some(m) = &metrics {
        holders.ready_inits.set_gauge(m.ready_inits_gauge());
    }
    holders.ready_inits.start(holders.clone());

    let snapshots = containerd_snapshots::server(Arc::new(service::LayerStackSnapshotter::new(
        engine.clone(),
        Some(cfg.containerd_address.clone()),
    )));
    let service = admin::AdminService::new(
        engine.clone(),
        cfg.containerd_address.clone(),
        subscribed.clone(),
    )
    .with_metrics_address(metrics_address)
    .with_holders(holders)
    .with_registry(&cfg.registry);
    let admin_server = |s: admin::AdminService| {
        layerstack_api::AdminServer::new(s)
            .max_decoding_message_size(layerstack_api::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(layerstack_api::MAX_MESSAGE_BYTES)
    };
    let admin = admin_server(service.clone());
    let tcp_address = match &tcp_listener {
        Some(l) => Some(l.local_addr().context("TCP listener address")?),
        None => None,
    };
    // The files were checked by `TcpSettings::load`, before anything was bound.
    let tcp_srv = match (tcp, tcp_listener) {
        (Some(t), Some(listener)) => {
            let tokens = t.tokens.clone();
            let check = move |req| match &tokens {
                Some(tokens) => tokens.check(req),
                None => Ok(req),
            };
            let srv = tonic::transport::Server::builder()
                .tls_config(t.tls)
                .context("[api.tcp] cert, key or client_ca")?
                .layer(metrics::error_layer(metrics.clone(), "admin"))
                .layer(tonic::service::interceptor(check))
                .add_service(admin_server(service.clone()))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
            Some(srv)
        }
        _ => None,
    };
    info!(
        address = %cfg.address.display(),
        admin = %cfg.admin_address.display(),
        admin_tcp = %tcp_address.map(|a| format!("https://{a}")).unwrap_or_else(|| "off".into()),
        allowed_uids = ?cfg.api.allowed_uids,
        allowed_gids = ?cfg.api.allowed_gids,
        mount = %mount_address.display(),
        metrics = %metrics_address.map(|a| format!("http://{a}/metrics")).unwrap_or_else(|| "off".into()),
        pid = std::process::id(),
        "serving"
    );
    if let (Some(listener), Some(m)) = (metrics_listener, metrics.clone()) {
        let (engine, subscribed) = (engine.clone(), subscribed.clone());
        tokio::spawn(async move {
            if let Err(e) = metrics::serve(listener, m, engine, subscribed).await {
                error!("{e:#}");
            }
        });
    }
    tokio::spawn(sandbox::serve(mount_socket.listener()?, service.clone()));

    if cfg.publish_on_task_delete {
        tokio::spawn(containerd::watch_events(
            cfg.containerd_address.clone(),
            engine.clone(),
            subscribed,
        ));
    }

    // READY=1 only once both sockets answer a request.
    let (snap_path, admin_path) = (cfg.address.clone(), cfg.admin_address.clone());
    let notifier = Arc::new(notifier);
    let ready_notifier = notifier.clone();
    tokio::spawn(async move {
        match probe(&snap_path, &admin_path, Duration::from_secs(30)).await {
            Ok(()) => {
                info!("ready: both sockets answer");
                let status = format!("STATUS=serving {}", snap_path.display());
                if ready_notifier.enabled() {
                    info!("reporting READY=1 to the service manager (NOTIFY_SOCKET)");
                }
                if let Err(e) = ready_notifier.notify(&format!("READY=1\n{status}")) {
                    error!(error = %e, "cannot report readiness to the service manager (NOTIFY_SOCKET)");
                }
            }
            Err(e) => error!("the daemon's own sockets do not answer; not reporting ready: {e:#}"),
        }
    });

    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        info!("shutting down");
    };
    // Test hook (integration/tests/ops.rs): hold the servers back after the
    // sockets are bound, to show that READY=1 waits until they answer.
    if let Some(ms) = std::env::var("LAYERSTACK_TEST_DELAY_SERVE_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        warn!(
            ms,
            "LAYERSTACK_TEST_DELAY_SERVE_MS: serving late (a test hook)"
        );
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let snap_srv = containerd_snapshots::tonic::transport::Server::builder()
        .layer(metrics::error_layer(metrics.clone(), "snapshots"))
        .layer(auth::PeerPolicy::root_only("snapshots").layer())
        .add_service(snapshots)
        .serve_with_incoming(UnixListenerStream::new(snap_socket.listener()?));
    let admin_srv = tonic::transport::Server::builder()
        .layer(metrics::error_layer(metrics.clone(), "admin"))
        .layer(admin_policy.layer())
        .add_service(admin)
        .serve_with_incoming(UnixListenerStream::new(admin_socket.listener()?));
    let tcp_srv = async {
        match tcp_srv {
            Some(srv) => srv.await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        r = snap_srv => r.context("snapshots server")?,
        r = admin_srv => r.context("admin server")?,
        r = tcp_srv => r.context("admin server on TCP")?,
        _ = shutdown => {}
    }
    if let Err(e) = notifier.notify("STOPPING=1") {
        warn!(error = %e, "cannot report stopping to the service manager");
    }
    // Ready WASI sessions end discarded, not `interrupted` at the next start.
    if tokio::time::timeout(Duration::from_secs(5), wasi::discard_all_ready(&service))
        .await
        .is_err()
    {
        warn!("ready WASI sessions not all discarded within 5 s: the next start ends them interrupted");
    }
    // The sockets are removed when they drop, and only if they are still ours.
    drop(snap_socket);
    drop(admin_socket);
    drop(mount_socket);
    drop(lock);
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn config_merge_defaults_are_the_publisher_defaults() {
        let c = layerstack_config::MergeConfig::default();
        let d = layerstack_engine::publisher::MergeOptions::default();
        assert_eq!(c.max_file_bytes, d.max_bytes);
        assert_eq!(usize::try_from(c.max_lines).ok(), Some(d.max_lines));
        assert_eq!(u128::from(c.timeout_ms), d.timeout.as_millis());
    }
}
