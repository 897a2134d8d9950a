//! LayerStack's shared vocabulary (ARCHITECTURE.md §2, §4): the names every
//! crate, the admin API, the CLI and the Python client agree on, and nothing
//! else. It depends on nothing of ours, so a client (the runtime shim, the CLI)
//! can speak the daemon's language without linking the engine or SQLite.
//!
//! * [`ErrorKind`]: containerd's errdefs classes with one snake-case spelling
//!   each; [`error_chain`], the text of an error with its causes.
//! * [`labels`]: the snapshot and container label names, one constant per string.
//! * [`policy`]: the exit policy (`layerstack.publish`) and the end action it
//!   decides.
//! * [`OutcomeKind`], [`Interruption`], [`PathStatus`], [`SessionState`],
//!   [`OwnerKind`]: the names of the model's states as the store records them
//!   and the wire carries them.
//! * [`IdMap`]: a session's uid/gid mapping (its user namespace).
//! * [`IMPORT_STACK_PREFIX`]: how an imported base's stack id begins.
//!
//! ```
//! use layerstack_types::{policy, ErrorKind, OutcomeKind};
//! assert_eq!(ErrorKind::NotFound.as_str(), "not_found");
//! assert_eq!(ErrorKind::parse("failed_precondition"), Some(ErrorKind::FailedPrecondition));
//! assert!(OutcomeKind::parse("conflict").is_some_and(OutcomeKind::is_retryable));
//! let p: policy::ExitPolicy = "on-success".parse()?;
//! assert_eq!(policy::decide(p, 3).0, policy::Decision::Discard);
//! # Ok::<(), policy::UnknownExitPolicy>(())
//! ```

#![forbid(unsafe_code)]

mod error;
mod idmap;
pub mod labels;
mod names;
pub mod policy;
mod state;
pub mod time;

pub use error::{error_chain, is_no_space, ErrorKind};
pub use idmap::{BadIdMap, IdMap};
pub use names::{Interruption, OutcomeKind, OwnerKind, PathStatus, SessionState};
pub use state::{check_adopted_node_state, check_node_state, MAX_NODE_STATE_BYTES};

/// The prefix of the id of a stack whose base was imported without containerd
/// (`layerstack base import`): `import:sha256:<hex>`, the digest of the base's
/// content. A containerd stack is `<namespace>/<chainID>` and a containerd
/// namespace never holds a `:`, so the two cannot collide.
pub const IMPORT_STACK_PREFIX: &str = "import:";
