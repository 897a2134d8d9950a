//! `layerstack`: the LayerStack operator CLI. Talks to the daemon's admin socket,
//! except `layerstack config …`, which only prints configuration.
//!
//! Exit codes: 0 success; 1 error (message on stderr); 2 usage; 3 the session
//! ended in conflict (`wait`, `publish`), or would (`publish --dry-run`); 4
//! `rollout audit` found violations, `fsck` found problems it did not repair.
//! `session run` and `session exec` exit with the command's status, and 125
//! when they fail themselves.
//!
//! An error is printed as `layerstack: MESSAGE`, or with `--error-format json`
//! as one JSON line `{"error":{"kind":…,"message":…}}` (module `errors`).

mod base;
mod config;
mod errors;
mod export;
mod fabric;
mod fsck;
mod graph;
mod history;
mod inspect;
mod output;
mod push;
mod run;
mod sessions;
mod wasi;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use layerstack_api as api;

/// A client of the daemon's admin socket.
pub async fn connect(
    address: &std::path::Path,
) -> Result<api::AdminClient<tonic::transport::Channel>> {
    match api::connect(address.to_path_buf()).await {
        Ok(c) => Ok(c),
        // The socket is 0660 with an ACL for `[api]`'s uids and gids: anyone
        // else is refused by the kernel at connect(2), before the daemon's
        // peer check could name the remedy — so the CLI names it.
        Err(e) if permission_denied(&e) => {
            let me = whoami();
            Err(errors::with_kind(
            api::ErrorKind::PermissionDenied,
            anyhow::anyhow!(
                "permission denied: uid {} (gid {}) may not connect to the LayerStack daemon's admin socket {}: only root and the uids and gids in the daemon's `[api] allowed_uids` / `allowed_gids` may; ask its operator to add yours, or run as root",
                me.0,
                me.1,
                address.display()
            ),
        ))
        }
        Err(e) => Err(errors::with_kind(
            api::ErrorKind::Unavailable,
            anyhow::Error::new(e).context(format!(
                "cannot reach the LayerStack daemon at {} (is containerd-layerstack-grpc running? set --admin-address or LAYERSTACK_ADMIN_ADDRESS)",
                address.display()
            )),
        )),
    }
}

/// This process's effective uid and gid (the owner of `/proc/self`).
/// `--state JSON`: a node's logical state, checked as the daemon checks it
/// (JSON, at most 64 KiB) before anything starts — refused by the daemon at
/// the close, the session would already have ended. Errors: an
/// `invalid_argument` failure naming the flag.
pub(crate) fn check_state(state: Option<&str>) -> Result<()> {
    let Some(s) = state else { return Ok(()) };
    api::types::check_node_state(s).map_err(|e| {
        errors::failure(
            api::ErrorKind::InvalidArgument,
            format!("--state {e}: give the child node's state as JSON, e.g. --state '{{\"reward\": 1}}'"),
        )
    })
}

fn whoami() -> (u32, u32) {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").map_or((u32::MAX, u32::MAX), |m| (m.uid(), m.gid()))
}

/// Whether `e` is, at its root, an `EACCES` from connect(2).
fn permission_denied(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cur {
        if c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::PermissionDenied)
        {
            return true;
        }
        cur = c.source();
    }
    false
}

#[derive(Debug, Parser)]
#[command(name = "layerstack", version, about = "LayerStack operator CLI")]
pub struct Cli {
    /// Admin API socket of containerd-layerstack-grpc (for `config`: the socket
    /// the generated configuration names).
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
    /// Mount socket of containerd-layerstack-grpc (Mode B) [default: mount.sock
    /// beside the admin socket].
    #[arg(long, env = "LAYERSTACK_MOUNT_ADDRESS", global = true)]
    pub mount_address: Option<PathBuf>,
    /// How an error is printed on stderr: `layerstack: MESSAGE` (text), or one
    /// line `{"error":{"kind":KIND,"message":MESSAGE}}` (json; the default of a
    /// command given `--json`), KIND spelled as
    /// everywhere (not_found, already_exists, failed_precondition,
    /// invalid_argument, conflict, unavailable, busy, unsupported, corrupt,
    /// internal, no_space, permission_denied, unauthenticated).
    #[arg(
        long,
        env = "LAYERSTACK_ERROR_FORMAT",
        value_enum,
        default_value_t = errors::ErrorFormat::Text,
        global = true
    )]
    pub error_format: errors::ErrorFormat,
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Debug, Subcommand)]
pub enum Cmd {
    /// Print configuration for containerd, nerdctl, Docker, the runtime shim or
    /// the daemon (no daemon needed).
    Config(config::ConfigArgs),
    /// Daemon status: version, store root, containerd connection, metrics endpoint.
    Status {
        /// Print the status as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Sessions: one per container rootfs on the layerstack snapshotter (Mode A),
    /// or one per `session run` / `session create` (Mode B).
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
    /// Export a branch head (STACK[@BRANCH]) or a graph node (--node) as a
    /// standard OCI image layout: the base's layers plus one layer per published
    /// or squashed layer, for `ctr images import`, skopeo or a registry.
    Export(export::ExportArgs),
    /// Push a graph node (--node ID, its id kept) or a branch head (--stack
    /// STACK[@BRANCH]) to an OCI registry as an image: only the blobs the
    /// registry lacks are sent; the node's provenance and state go in the
    /// manifest's annotations.
    Push(push::PushArgs),
    /// Pull an image `layerstack push` made from an OCI registry: a node keeps
    /// its id, state and provenance; a branch head lands on a branch (made,
    /// fast-forwarded or merged; a conflict refused whole). Only the layers
    /// this store lacks are downloaded.
    Pull(push::PullArgs),
    /// Bases made without containerd: `base import` a directory tree, a layer
    /// tar or an OCI image layout as a stack.
    Base {
        #[command(subcommand)]
        cmd: base::BaseCmd,
    },
    #[command(flatten)]
    History(history::HistoryCmd),
    #[command(flatten)]
    Inspect(inspect::InspectCmd),
    #[command(flatten)]
    Graph(graph::GraphCmd),
    #[command(flatten)]
    Fabric(fabric::FabricCmd),
    /// Check the store against its filesystem: orphan directories, missing
    /// layers, leases whose holder is gone, path-index rows their tree
    /// contradicts, outcomes that history or the branch heads do not bear
    /// out, rollout runs' exactly-once violations. Exits 4 when problems
    /// remain.
    Fsck {
        /// Fix what loses no committed change: remove orphan directories,
        /// release leases whose holder is gone for good.
        #[arg(long)]
        repair: bool,
        /// Also hash every written file of a live layer against the digest
        /// its path index recorded, and check every imported base against the
        /// digest its import recorded (reads them all: minutes on a large
        /// store).
        #[arg(long)]
        content: bool,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
    },
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
        /// Only sessions of this owner kind: container, sandbox, wasi or operation.
        #[arg(long, value_name = "KIND")]
        owner: Option<String>,
    },
    /// Run CMD in a new session without a container (Mode B) and exit with its
    /// status: STACK[@BRANCH] [OPTIONS] -- CMD [ARGS...]. The session's writes are
    /// published, discarded or kept by --publish when CMD ends; the outcome goes
    /// to stderr as one line (and to --outcome FILE as JSON). With --wasi
    /// MODULE.wasm, a WebAssembly module runs instead, in a WASI session the
    /// daemon runs (no root needed).
    Run(Box<run::RunArgs>),
    /// Create a session without a container and keep it mounted in namespaces of
    /// its own (Mode B); prints its id. `session exec` runs commands in it,
    /// `session close` ends it.
    Create(run::CreateArgs),
    /// Run CMD in a live session and exit with CMD's status. As root, in a
    /// session `session create` holds: joins its namespaces (the caller's
    /// terminal and stdio). Otherwise (not root; a session the daemon owns or
    /// a WASI one): through the admin API's Exec — output streamed, stdin
    /// sent whole when it is not a terminal (at most 2 MiB).
    Exec(run::ExecArgs),
    /// End a Mode B session: stop its processes, then publish, discard, or apply
    /// its recorded policy; print the outcome. Exits 3 on conflict.
    Close(run::CloseArgs),
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
    let matches = Cli::command().get_matches();
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    cli.error_format = errors::effective_format(&matches, cli.error_format);
    let error_format = cli.error_format;
    let result = match cli.cmd {
        Cmd::Config(args) => config::run(args, cli.admin_address),
        Cmd::Session {
            cmd: SessionCmd::Run(ref a),
        } => run::run(&cli, (**a).clone()).await,
        Cmd::Session {
            cmd: SessionCmd::Create(ref a),
        } => run::create_cmd(&cli, a.clone()).await,
        Cmd::Session {
            cmd: SessionCmd::Exec(ref a),
        } => run::exec_cmd(&cli, a.clone()).await,
        Cmd::Session {
            cmd: SessionCmd::Close(ref a),
        } => run::close_cmd(&cli, a.clone()).await,
        Cmd::Export(a) => export::run(&cli.admin_address, &cli.namespace, a).await,
        Cmd::Push(ref a) => push::run(&cli, a.clone()).await,
        Cmd::Pull(ref a) => push::pull(&cli, a.clone()).await,
        Cmd::Base { cmd } => base::run(&cli.admin_address, cmd).await,
        Cmd::History(h) => history::run(&cli.admin_address, &cli.namespace, h).await,
        Cmd::Inspect(i) => inspect::run(&cli.admin_address, &cli.namespace, i).await,
        Cmd::Graph(g) => graph::run(&cli.admin_address, &cli.namespace, g).await,
        Cmd::Fabric(f) => fabric::run(&cli.admin_address, f).await,
        Cmd::Fsck {
            repair,
            content,
            json,
        } => fsck::run(&cli.admin_address, repair, content, json).await,
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
    match result {
        Ok(code) => code,
        Err(e) => {
            errors::report(error_format, &e);
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn walk(cmd: &clap::Command, path: &str, f: &mut impl FnMut(&str, &clap::Arg)) {
        for a in cmd.get_arguments() {
            f(path, a);
        }
        for sub in cmd.get_subcommands() {
            walk(sub, &format!("{path} {}", sub.get_name()), f);
        }
    }

    #[test]
    fn the_command_line_is_well_formed_and_every_flag_has_help() {
        Cli::command().debug_assert();
        let mut json_flags = 0;
        walk(&Cli::command(), "layerstack", &mut |path, a| {
            let help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
            assert!(
                !help.trim().is_empty() || a.is_positional(),
                "{path} --{} has no help text",
                a.get_id()
            );
            if a.get_long() == Some("json") {
                json_flags += 1;
            }
        });
        assert!(
            json_flags >= 5,
            "every --json flag was checked ({json_flags})"
        );
    }

    #[test]
    fn an_error_with_context_prints_each_cause_once() {
        /// hyper 0.14's connect error: prints its cause and returns it as source.
        #[derive(Debug)]
        struct Connect(std::io::Error);
        impl std::fmt::Display for Connect {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "error trying to connect: {}", self.0)
            }
        }
        impl std::error::Error for Connect {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        // ECONNREFUSED: "Connection refused (os error 111)".
        let refused = || std::io::Error::from_raw_os_error(111);
        let e = anyhow::Error::new(Connect(refused())).context("cannot reach the daemon");
        let text = api::error_chain(e.as_ref());
        assert!(
            text.starts_with("cannot reach the daemon: error trying to connect: "),
            "{text}"
        );
        assert_eq!(text.matches(&refused().to_string()).count(), 1, "{text}");
    }

    #[test]
    fn config_commands_parse_without_a_daemon() {
        let cli = Cli::try_parse_from([
            "layerstack",
            "config",
            "containerd",
            "--version",
            "2",
            "--address",
            "/x/s.sock",
        ])
        .unwrap();
        let Cmd::Config(args) = cli.cmd else {
            panic!("not a config command")
        };
        assert_eq!(args.address, std::path::Path::new("/x/s.sock"));
        let config::ConfigCmd::Containerd {
            containerd_version, ..
        } = args.what
        else {
            panic!("not containerd")
        };
        assert_eq!(
            containerd_version,
            Some(layerstack_config::snippets::ContainerdVersion::V2)
        );
        let e = Cli::try_parse_from(["layerstack", "config", "containerd", "--version", "1.5"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("1.6, 1.7 or 2"), "{e}");
        for what in ["nerdctl", "docker", "shim", "daemon", "crio-none"] {
            Cli::try_parse_from(["layerstack", "config", what]).unwrap();
        }
    }

    /// A command asked for `--json` fails in JSON; `--error-format` wins.
    #[test]
    fn json_output_means_json_errors() {
        let format = |args: &[&str]| {
            let m = Cli::command().try_get_matches_from(args).unwrap();
            let cli = Cli::from_arg_matches(&m).unwrap();
            errors::effective_format(&m, cli.error_format)
        };
        use errors::ErrorFormat::{Json, Text};
        let push = ["layerstack", "push", "--node", "n1", "r.example/x"];
        assert_eq!(format(&push), Text);
        let json: Vec<&str> = push.iter().copied().chain(["--json"]).collect();
        assert_eq!(format(&json), Json);
        let text: Vec<&str> = json
            .iter()
            .copied()
            .chain(["--error-format", "text"])
            .collect();
        assert_eq!(format(&text), Text);
        assert_eq!(format(&["layerstack", "graph", "ls", "--json"]), Json);
        assert_eq!(format(&["layerstack", "fsck", "--json"]), Json);
    }
}
