//! `containerd-shim-layerstack-v1`: see the `layerstack_shim` crate docs.
//!
//! containerd runs this binary with `start`, with `delete`, and (through the
//! crate's `spawn`) as the long-running ttrpc server. stdout carries only the
//! address (`start`) or the protobuf `DeleteResponse` (`delete`).

use containerd_shim::Config;
use layerstack_shim::service::ProxyShim;

fn main() {
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
