//! LayerStack Mode B ("N sessions in one sandbox", ARCHITECTURE.md §12): what a
//! session without a container needs from the kernel, shared by the daemon and
//! the `layerstack` holder.
//!
//! * [`sys`] — every kernel call (new mount API, `clone` with namespaces,
//!   `pivot_root`, `setns`, pidfds, descriptor passing), each `unsafe` block with
//!   its invariant;
//! * [`wire`] — the mount socket's protocol (the daemon hands a detached overlay
//!   mount to the holder with `SCM_RIGHTS`);
//! * [`holder`] — the holder's processes: init (pid 1 of the session), the
//!   command, `session exec`'s join;
//! * [`client`] — a blocking client of the mount socket;
//! * [`spawner`] — the daemon's process spawner: a small process forked at
//!   the daemon's start that clones daemon-owned inits and Exec's waiters;
//! * [`cgroup`] — per-session limits (CPU, memory, pids): the daemon's cgroup
//!   parent, one cgroup per limited session, its usage.
//!
//! The daemon builds the overlay where the layer paths resolve (its own mount
//! namespace) and passes the detached mount; the holder attaches it in a mount
//! namespace of its own, on the host or inside a privileged container that has
//! the admin socket's directory mounted. Linux ≥ 6.8 (`lowerdir+`).
//!
//! ```no_run
//! # fn f() -> Result<(), Box<dyn std::error::Error>> {
//! use layerstack_sandbox::{client::MountConn, wire::Request};
//! let mut c = MountConn::connect("/run/layerstack/mount.sock".as_ref())?;
//! let (reply, fds) = c.request(&Request::Attach { session: 1 })?;
//! assert!(reply.ok && fds.len() == 1);
//! # Ok(()) }
//! ```

pub mod cgroup;
pub mod client;
pub mod holder;
pub mod spawner;
pub mod sys;
pub mod wire;
