//! `containerd-layerstack-grpc`: the LayerStack daemon. Serves containerd's
//! Snapshots API as a proxy plugin and LayerStack's admin API, each on its own
//! unix socket, and publishes sessions when containerd deletes their task. The
//! engine does the work; this binary only wires it (config, logging, sockets).

// tonic::Status is the error type of every gRPC handler here (containerd-snapshots'
// trait fixes it); boxing it would only move the allocation.
#![allow(clippy::result_large_err)]

mod admin;
mod containerd;
mod filters;
mod history;
mod inspect;
mod service;
mod sockets;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use layerstack_config::{Config, Durability};
use layerstack_engine::store::{Store, StoreLock, StoreOptions};
use layerstack_engine::{Engine, EngineSettings};
use tokio_stream::wrappers::UnixListenerStream;
use tracing::{error, info};

/// Log line format.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    /// Human-readable lines (colour only on a terminal).
    Text,
    /// One JSON object per line.
    Json,
}

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
    /// Log filter: a level (error, warn, info, debug, trace) or a tracing
    /// directive list such as `info,layerstack_engine=debug` [default: $RUST_LOG, else info].
    #[arg(long, value_name = "FILTER")]
    log_level: Option<String>,
    /// Log line format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
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
    if cfg.root.is_relative() {
        let cwd = std::env::current_dir().context("cannot resolve the relative --root")?;
        cfg.root = cwd.join(&cfg.root);
    }
    Ok(())
}

fn init_logging(level: Option<&str>, format: LogFormat) {
    let filter = match level {
        Some(l) => tracing_subscriber::EnvFilter::new(l),
        None => tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
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

#[tokio::main]
async fn main() {
    let args = Args::parse();
    init_logging(args.log_level.as_deref(), args.log_format);
    if let Err(e) = run(args).await {
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
    raise_nofile();
    let exclude = layerstack_engine::publisher::ExcludePolicy::new(&cfg.exclude)
        .context("config key `exclude`")?;
    // Refuse to start before touching anything: another daemon on the root, a
    // socket another process serves.
    let lock = StoreLock::acquire(&cfg.root)?;
    let snap_socket = sockets::Socket::bind(&cfg.address)?;
    let admin_socket = sockets::Socket::bind(&cfg.admin_address)?;
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
        history: layerstack_engine::HistorySettings {
            squash_threshold: usize::try_from(cfg.history.squash_threshold).unwrap_or(usize::MAX),
            squash_keep: usize::try_from(cfg.history.squash_keep).unwrap_or(usize::MAX),
            kept_upper_retention: std::time::Duration::from_secs(
                cfg.history.kept_upper_retention_h.saturating_mul(3600),
            ),
        },
    };
    let engine = Engine::new(store, settings);
    if cfg.history.gc_interval_s > 0 {
        engine.spawn_periodic_gc(std::time::Duration::from_secs(cfg.history.gc_interval_s));
    }
    let recovered = engine.recover().await?;
    if recovered > 0 {
        info!(
            sessions = recovered,
            "finished releases interrupted by the last stop"
        );
    }
    let subscribed = Arc::new(AtomicBool::new(false));

    let snapshots = containerd_snapshots::server(Arc::new(service::LayerStackSnapshotter::new(
        engine.clone(),
    )));
    let admin = layerstack_api::AdminServer::new(admin::AdminService::new(
        engine.clone(),
        cfg.containerd_address.clone(),
        subscribed.clone(),
    ));
    info!(address = %cfg.address.display(), admin = %cfg.admin_address.display(), pid = std::process::id(), "serving");

    if cfg.publish_on_task_delete {
        tokio::spawn(containerd::watch_events(
            cfg.containerd_address.clone(),
            engine.clone(),
            subscribed,
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
        .serve_with_incoming(UnixListenerStream::new(snap_socket.listener()?));
    let admin_srv = tonic::transport::Server::builder()
        .add_service(admin)
        .serve_with_incoming(UnixListenerStream::new(admin_socket.listener()?));
    tokio::select! {
        r = snap_srv => r.context("snapshots server")?,
        r = admin_srv => r.context("admin server")?,
        _ = shutdown => {}
    }
    // The sockets are removed when they drop, and only if they are still ours.
    drop(snap_socket);
    drop(admin_socket);
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
