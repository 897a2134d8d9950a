//! `layerstack config …`: configuration for the tools around LayerStack, printed
//! on stdout. These commands never talk to the daemon (they work before it is
//! installed); the documents come from `layerstack_config::snippets`, their one
//! source.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use layerstack_config::snippets::{self, ContainerdVersion, Endpoints};
use layerstack_config::Config;

/// Options shared by every `config` document.
#[derive(Debug, Args)]
pub struct ConfigArgs {
    #[command(subcommand)]
    pub what: ConfigCmd,
    /// The daemon's Snapshots API socket.
    #[arg(long, value_name = "SOCKET", global = true, default_value_os_t = Config::default().address)]
    pub address: PathBuf,
    /// The daemon's store root.
    #[arg(long, value_name = "DIR", global = true, default_value_os_t = Config::default().root)]
    pub root: PathBuf,
    /// containerd's socket.
    #[arg(long, value_name = "SOCKET", global = true, default_value_os_t = Config::default().containerd_address)]
    pub containerd_address: PathBuf,
    /// The daemon's Prometheus endpoint (HOST:PORT).
    #[arg(long, value_name = "ADDR", global = true, default_value_t = Config::default().metrics.address())]
    pub metrics_address: SocketAddr,
    /// Where the runtime shim's settings file goes (`layerstack config shim`);
    /// named in containerd's and Docker's runtime options only when
    /// --admin-address is not the default.
    #[arg(long, value_name = "FILE", global = true, default_value_os_t = PathBuf::from(snippets::DEFAULT_SHIM_CONFIG))]
    pub shim_config: PathBuf,
}

#[derive(Debug, Subcommand)]
pub enum ConfigCmd {
    /// containerd config.toml entries: the proxy snapshotter, the CRI snapshotter
    /// and runtime handler `layerstack`, and for 2.x the transfer service's
    /// unpack_config.
    Containerd {
        /// containerd release line: 1.6, 1.7 or 2 (config version 2 for 1.x, 3 for
        /// 2.x) [default: the version of `containerd` on PATH, else 1.6].
        #[arg(long = "version", value_name = "VERSION")]
        containerd_version: Option<ContainerdVersion>,
        /// Platform of containerd 2.x's unpack_config entries [default: this host's].
        #[arg(long, value_name = "OS/ARCH")]
        platform: Option<String>,
    },
    /// nerdctl.toml (/etc/nerdctl/nerdctl.toml): containerd's socket and the
    /// snapshotter.
    Nerdctl,
    /// Docker daemon.json (Docker >= 24, containerd image store): the snapshotter
    /// and the runtime `layerstack`.
    Docker,
    /// The runtime shim's settings file (its admin socket).
    Shim,
    /// The daemon's config file, commented defaults (/etc/layerstack/config.toml),
    /// with the given sockets and root set.
    Daemon,
    /// Why there is no CRI-O configuration (CRI-O does not use containerd).
    #[command(name = "crio-none")]
    CrioNone,
}

/// The release line of the `containerd` on `PATH`, if any.
fn installed_containerd() -> Option<(ContainerdVersion, String)> {
    let out = Command::new("containerd").arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    ContainerdVersion::from_version_output(&text).map(|v| (v, text))
}

/// Prints the document `args` asks for. `admin_address`: the global
/// `--admin-address` (the daemon's admin socket).
pub fn run(args: ConfigArgs, admin_address: PathBuf) -> Result<ExitCode> {
    let e = Endpoints {
        root: args.root,
        address: args.address,
        admin_address,
        containerd_address: args.containerd_address,
        metrics_address: args.metrics_address,
        shim_config: args.shim_config,
    };
    let text = match args.what {
        ConfigCmd::Containerd {
            containerd_version,
            platform,
        } => {
            let version = match containerd_version {
                Some(v) => v,
                None => match installed_containerd() {
                    Some((v, found)) => {
                        eprintln!("layerstack: config for the containerd on PATH ({found}); --version chooses another");
                        v
                    }
                    None => {
                        eprintln!(
                            "layerstack: no containerd on PATH; writing containerd 1.6 config (--version to choose)"
                        );
                        ContainerdVersion::V1_6
                    }
                },
            };
            let platform = platform.unwrap_or_else(snippets::host_platform);
            snippets::containerd(version, &e, &platform)
        }
        ConfigCmd::Nerdctl => snippets::nerdctl(&e),
        ConfigCmd::Docker => snippets::docker(&e),
        ConfigCmd::Shim => snippets::shim(&e),
        ConfigCmd::Daemon => snippets::daemon(&e),
        ConfigCmd::CrioNone => Ok(snippets::CRIO_UNSUPPORTED.to_string()),
    }
    .context("cannot generate the configuration")?;
    crate::out!("{}", text.trim_end_matches('\n'));
    Ok(ExitCode::SUCCESS)
}
