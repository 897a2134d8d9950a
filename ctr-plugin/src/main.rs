//! `layerstack`: the LayerStack operator CLI. Talks to the daemon's admin socket.
//!
//! Exit codes: 0 success; 1 error (message on stderr); 2 usage; 3 the session
//! ended in conflict (`wait`, `publish`), or would (`publish --dry-run`).

mod history;
mod inspect;
mod output;
mod sessions;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use layerstack_api as api;

/// A client of the daemon's admin socket.
pub async fn connect(
    address: &std::path::Path,
) -> Result<api::AdminClient<tonic::transport::Channel>> {
    api::connect(address.to_path_buf()).await.with_context(|| {
        format!(
            "cannot reach the LayerStack daemon at {} (is containerd-layerstack-grpc running? set --admin-address or LAYERSTACK_ADMIN_ADDRESS)",
            address.display()
        )
    })
}

#[derive(Debug, Parser)]
#[command(name = "layerstack", version, about = "LayerStack operator CLI")]
pub struct Cli {
    /// Admin API socket of containerd-layerstack-grpc.
    #[arg(long, env = "LAYERSTACK_ADMIN_ADDRESS", default_value = api::DEFAULT_ADMIN_ADDRESS, global = true)]
    pub admin_address: PathBuf,
    /// containerd namespace of the containers and images named.
    #[arg(
        long,
        short = 'n',
        env = "CONTAINERD_NAMESPACE",
        default_value = "default",
        global = true
    )]
    pub namespace: String,
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Debug, Subcommand)]
pub enum Cmd {
    /// Daemon status: store root, containerd connection.
    Status {
        /// Print the status as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Sessions: one per container rootfs on the layerstack snapshotter.
    Session {
        #[command(subcommand)]
        cmd: SessionCmd,
    },
    /// Wait until a session has an outcome; print it. Exits 3 on conflict.
    Wait {
        /// The container whose session to wait for (`-n` namespace).
        #[arg(required_unless_present = "session")]
        container: Option<String>,
        /// The session id instead of a container (any owner kind).
        #[arg(long, conflicts_with = "container")]
        session: Option<i64>,
        /// Give up after this many seconds (0: wait forever).
        #[arg(long, default_value_t = 0)]
        timeout: u32,
        /// List every path's verdict (fetched page by page), not only the summary.
        #[arg(long)]
        paths: bool,
        /// Print the outcome as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Capture and publish a stopped container's writes now.
    Publish {
        /// The container whose session to publish (`-n` namespace).
        #[arg(required_unless_present = "session")]
        container: Option<String>,
        /// The session id instead of a container (any owner kind).
        #[arg(long, conflicts_with = "container")]
        session: Option<i64>,
        /// List every path's verdict (fetched page by page), not only the summary.
        #[arg(long)]
        paths: bool,
        /// Drop the writes instead of publishing them.
        #[arg(long, conflicts_with = "dry_run")]
        discard: bool,
        /// Only show what the gate would do (per path: clean, merged, conflict,
        /// excluded); change nothing. Exits 3 if it would conflict.
        #[arg(long)]
        dry_run: bool,
        /// Print the outcome as one JSON object.
        #[arg(long)]
        json: bool,
    },
    #[command(flatten)]
    History(history::HistoryCmd),
    #[command(flatten)]
    Inspect(inspect::InspectCmd),
}

#[derive(Debug, Subcommand)]
pub enum SessionCmd {
    /// List the sessions of the namespace (`-n`), or of all namespaces (`-A`).
    Ls {
        /// Sessions of every namespace, not only `-n`'s.
        #[arg(long, short = 'A')]
        all_namespaces: bool,
        /// Print the sessions as one JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Move a session whose last publish conflicted (its container stopped)
    /// onto its branch's head: what merges is merged into its upper, conflicting
    /// text files get git-style markers. Its next publish goes through the gate
    /// again and is refused while a file still holds those markers.
    Rebase {
        /// The container whose session to rebase (`-n` namespace).
        #[arg(required_unless_present = "session")]
        container: Option<String>,
        /// The session id instead of a container.
        #[arg(long, conflicts_with = "container")]
        session: Option<i64>,
        /// Print the result as one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::History(h) => history::run(&cli.admin_address, &cli.namespace, h).await,
        Cmd::Inspect(i) => inspect::run(&cli.admin_address, &cli.namespace, i).await,
        Cmd::Session {
            cmd:
                SessionCmd::Rebase {
                    container,
                    session,
                    json,
                },
        } => inspect::rebase(&cli.admin_address, &cli.namespace, container, session, json).await,
        _ => sessions::run(cli).await,
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            match e.downcast_ref::<tonic::Status>() {
                Some(st) if st.message().is_empty() => eprintln!(
                    "layerstack: the daemon answered {:?} without a message (is --admin-address the admin socket, not the snapshots socket?)",
                    st.code()
                ),
                Some(st) => eprintln!("layerstack: {}", st.message()),
                None => eprintln!("layerstack: {e:#}"),
            }
            ExitCode::from(1)
        }
    }
}
