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
