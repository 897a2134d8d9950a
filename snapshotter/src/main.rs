//! `containerd-layerstack-grpc`: the LayerStack daemon. Serves containerd's
//! Snapshots API as a proxy plugin and LayerStack's admin API, each on its own
//! unix socket, and publishes sessions when containerd deletes their task.

// tonic::Status is the error type of every gRPC handler here (containerd-snapshots'
// trait fixes it); boxing it would only move the allocation.
#![allow(clippy::result_large_err)]

mod admin;
mod containerd;
mod publish;
mod service;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Parser;
use layerstack_config::{Config, Durability};
use layerstack_store::{Store, StoreOptions};
use tokio_stream::wrappers::UnixListenerStream;
use tracing::{error, info};

/// LayerStack daemon: containerd proxy snapshotter + admin API.
#[derive(Debug, Parser)]
#[command(name = "containerd-layerstack-grpc", version)]
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
    /// Print the containerd config snippet for this daemon and exit.
    #[arg(long)]
    print_containerd_config: bool,
}

fn bind(path: &Path) -> Result<tokio::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create socket directory {}", dir.display()))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(e).with_context(|| format!("cannot remove stale socket {}", path.display()))
        }
    }
    let l = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("cannot listen on {}", path.display()))?;
    // Only root (and the socket's group) may talk to the daemon, whatever the umask.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .with_context(|| format!("cannot set mode of {}", path.display()))?;
    Ok(l)
}

/// Refuse configurations that would only fail later, naming what to change.
fn validate(cfg: &mut Config) -> Result<()> {
    layerstack_store::validate_branch(&cfg.default_branch)
        .map_err(|e| anyhow::anyhow!("default_branch: {e}"))?;
    if cfg.address == cfg.admin_address {
        anyhow::bail!(
            "the snapshots socket and the admin socket are both {}: give --address and --admin-address different paths",
            cfg.address.display()
        );
    }
    if cfg.root.is_relative() {
        let cwd = std::env::current_dir().context("cannot resolve the relative --root")?;
        cfg.root = cwd.join(&cfg.root);
    }
    Ok(())
}

fn main() {
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
}

async fn async_main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Args::parse()).await {
        // One line on stderr (the tracing log also goes to stderr).
        error!("{e:#}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Result<()> {
    let mut cfg = match &args.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
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
    if args.print_containerd_config {
        print!(
            "{}",
            layerstack_config::CONTAINERD_SNIPPET.replace(
                "/run/layerstack/snapshotter.sock",
                &cfg.address.display().to_string()
            )
        );
        return Ok(());
    }

    validate(&mut cfg)?;
    let opts = StoreOptions {
        durability: match cfg.durability {
            Durability::Disposable => layerstack_store::Durability::Disposable,
            Durability::Durable => layerstack_store::Durability::Durable,
        },
        default_branch: cfg.default_branch.clone(),
    };
    let store = Arc::new(Store::open(&cfg.root, &opts)?);
    info!(root = %cfg.root.display(), "store open");
    let exclude =
        layerstack_publisher::ExcludePolicy::new(&cfg.exclude).context("config key `exclude`")?;
    let policy = publish::PublishPolicy {
        exclude,
        merge: layerstack_publisher::MergeOptions {
            max_bytes: cfg.merge.max_file_bytes,
            max_lines: usize::try_from(cfg.merge.max_lines).unwrap_or(usize::MAX),
            timeout: std::time::Duration::from_millis(cfg.merge.timeout_ms),
            diff_algorithm: match cfg.merge.diff_algorithm {
                layerstack_config::DiffAlgorithm::Histogram => {
                    layerstack_publisher::DiffAlgorithm::Histogram
                }
                layerstack_config::DiffAlgorithm::Myers => {
                    layerstack_publisher::DiffAlgorithm::Myers
                }
            },
        },
        userxattr: false,
    };
    let publisher = Arc::new(publish::Publisher::new(store.clone()).with_policy(policy));

    let snap_listener = bind(&cfg.address)?;
    let admin_listener = bind(&cfg.admin_address)?;
    let snapshots = containerd_snapshots::server(Arc::new(service::LayerStackSnapshotter::new(
        store.clone(),
        publisher.clone(),
    )));
    let admin = layerstack_api::AdminServer::new(admin::AdminService::new(
        publisher.clone(),
        cfg.containerd_address.clone(),
        cfg.default_branch.clone(),
    ));
    info!(address = %cfg.address.display(), admin = %cfg.admin_address.display(), "serving");

    if cfg.publish_on_task_delete {
        tokio::spawn(containerd::watch_events(
            cfg.containerd_address.clone(),
            publisher.clone(),
        ));
    }

    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        info!("shutting down");
    };
    let snap_srv = containerd_snapshots::tonic::transport::Server::builder()
        .add_service(snapshots)
        .serve_with_incoming(UnixListenerStream::new(snap_listener));
    let admin_srv = tonic::transport::Server::builder()
        .add_service(admin)
        .serve_with_incoming(UnixListenerStream::new(admin_listener));
    tokio::select! {
        r = snap_srv => r.context("snapshots server")?,
        r = admin_srv => r.context("admin server")?,
        _ = shutdown => {}
    }
    let _ = std::fs::remove_file(&cfg.address);
    let _ = std::fs::remove_file(&cfg.admin_address);
    Ok(())
}
