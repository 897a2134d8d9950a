//! `containerd-shim-layerstack-v1`: see the `layerstack_shim` crate docs.
//!
//! containerd runs this binary with `start`, with `delete`, and (through the
//! crate's `spawn`) as the long-running ttrpc server. stdout carries only the
//! address (`start`) or the protobuf `DeleteResponse` (`delete`).

use containerd_shim::Config;
use layerstack_shim::service::ProxyShim;

/// `--help` text: what the binary is and who runs it.
const HELP: &str = "\
containerd-shim-layerstack-v1: LayerStack's containerd runtime shim (runtime type
io.containerd.layerstack.v1). containerd starts it (`start`, `delete`, then as a
long-running ttrpc server); it runs each task through io.containerd.runc.v2 and,
when the task is deleted, has the LayerStack daemon publish the container's writes
before containerd's delete returns (read-your-writes).

Configure it with `layerstack config shim` (admin socket, inner runtime); see
docs/operations.md. Not meant to be run by hand.

Usage: containerd-shim-layerstack-v1 [-namespace NS -address ADDR -id ID ...] start|delete
       containerd-shim-layerstack-v1 --version | --help
";

/// What a person running the binary by hand gets on stderr (exit 2).
const USAGE: &str = "\
containerd-shim-layerstack-v1: containerd runs this shim (runtime io.containerd.layerstack.v1); not meant to be run by hand
Usage: containerd-shim-layerstack-v1 -namespace NS -address ADDR -id ID [...] start|delete   (see --help)
";

/// Whether `args` carry the `-namespace` flag containerd always passes (to
/// `start`, `delete` and the server it spawns), as `-namespace NS` or
/// `-namespace=NS`, with one dash or two.
fn from_containerd(args: &[String]) -> bool {
    args.iter().any(|a| {
        let flag = a.split_once('=').map_or(a.as_str(), |(f, _)| f);
        matches!(flag, "-namespace" | "--namespace")
    })
}

fn main() {
    // containerd never calls the shim with only one of these; the shim library's
    // own flag parser answers them with a debug string and exit 1.
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag] = args.as_slice() {
        match flag.as_str() {
            "--version" | "-version" | "-v" | "-V" => {
                println!(
                    "containerd-shim-layerstack-v1 {}",
                    env!("CARGO_PKG_VERSION")
                );
                return;
            }
            "--help" | "-help" | "-h" => {
                print!("{HELP}");
                return;
            }
            _ => {}
        }
    }
    // Run by hand (no arguments, or none of containerd's): the shim library
    // would print a debug value (`Env(NotPresent)`) and exit 1.
    if !from_containerd(&args) {
        eprint!("{USAGE}");
        std::process::exit(2);
    }
    // Named threads, so a system-wide profile tells ours from other tokio programs'.
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("layerstack-shim")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the tokio runtime: {e}");
            std::process::exit(1);
        }
    };
    rt.block_on(run());
}

async fn run() {
    let config = Config {
        // The proxy runs no container processes: no SIGCHLD reaper (it would steal
        // the exit status of the inner shim's `start`/`delete` we wait for) and no
        // subreaper (nothing should be reparented to us).
        no_reaper: true,
        no_sub_reaper: true,
        // Our own FIFO logger (layerstack_shim::logging) filters library noise.
        no_setup_logger: true,
        ..Default::default()
    };
    containerd_shim::asynchronous::run::<ProxyShim>(layerstack_shim::RUNTIME_NAME, Some(config))
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_containerd_s_invocations_reach_the_shim_library() {
        let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(!from_containerd(&v(&[])));
        assert!(!from_containerd(&v(&["start"])));
        assert!(from_containerd(&v(&[
            "-namespace",
            "default",
            "-address",
            "/run/containerd/containerd.sock",
            "-id",
            "c1",
            "start"
        ])));
        assert!(from_containerd(&v(&[
            "--namespace=k8s.io",
            "-id",
            "c1",
            "delete"
        ])));
        assert!(USAGE.lines().count() == 2 && USAGE.contains("Usage:"));
    }
}
