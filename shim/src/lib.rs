//! `containerd-shim-layerstack-v1`, the runtime `io.containerd.layerstack.v1`
//! (ARCHITECTURE.md §3): a ttrpc proxy in front of Debian's
//! `containerd-shim-runc-v2` that publishes a container's LayerStack session on
//! the init process's `Delete`, after the inner shim has unmounted the rootfs, and
//! returns only when the session has an outcome (read-your-writes for
//! `ctr run --rm`).
//!
//! Processes (one set per container):
//!
//! ```text
//! containerd ──ttrpc (Task API v2)──▶ proxy (this crate, socket grouping "layerstack/<id>")
//!                                        │ forwards every Task RPC
//!                                        ▼
//!                                     containerd-shim-runc-v2 (grouping <id>, or the pod's)
//!                                        │ events (TTRPC_ADDRESS = the proxy's events socket)
//!                                        ▼
//!                                     proxy ──▶ containerd's ttrpc events (init /tasks/delete
//!                                               held back until the publish has an outcome)
//! ```
//!
//! The pure parts (labels → policy, runtime options, bundle state) are unit
//! tested here; the process plumbing is covered by `integration/tests/shim.rs`.
//!
//! ```
//! use layerstack_shim::policy::{decide, Decision, ExitPolicy};
//! let p: ExitPolicy = "on-success".parse().unwrap();
//! assert_eq!(decide(p, 0).0, Decision::Publish);
//! assert_eq!(decide(p, 3).0, Decision::Discard);
//! ```

#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod config;
pub mod daemon;
pub mod events;
pub mod inner;
pub mod logging;
/// The exit policy and its labels, shared with the daemon (defined in
/// `layerstack-types`, re-exported by `layerstack-api`).
pub use layerstack_api::policy;
pub mod proxy;
pub mod service;
pub mod state;

/// Runtime name containerd maps to this binary (`containerd-shim-<name>-<version>`).
pub const RUNTIME_NAME: &str = "io.containerd.layerstack.v1";

pub use layerstack_api::error_chain;
