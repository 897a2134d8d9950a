//! LayerStack's publisher: capture of a session's overlay upper, the publication
//! gate, and sealing of a published layer (ARCHITECTURE §6 steps 4–6, §7).
//!
//! * [`LayerView`] resolves paths over a lease's layers, newest first, as overlayfs
//!   does (whiteouts, opaque directories, non-directories hiding what is below).
//! * [`capture`] walks a quiescent upperdir without following anything and returns
//!   a [`Changeset`]: writes, symlinks, directories, deletions, metadata changes and
//!   special files relative to the lease, with copy-up noise separated out.
//! * [`check_gate`] compares a changeset with the changes published on the branch
//!   head since the lease ([`HeadChange`]) and accepts or rejects it as a whole.
//! * [`seal_layer`] strips overlay-private xattrs from the upper and syncs it, so it
//!   can be renamed into the store as an immutable layer.
//!
//! Paths are relative byte strings (`Vec<u8>`, `/`-separated, no leading `/`),
//! never converted through UTF-8.
//!
//! ```no_run
//! use std::path::PathBuf;
//! use layerstack_publisher::{capture, check_gate, seal_layer, GateDecision, HeadChange, LayerView};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // The session's lease: its lowerdirs, newest first.
//! let lease = LayerView::new(vec![PathBuf::from("/var/lib/layerstack/l/2"), PathBuf::from("/var/lib/layerstack/l/1")]);
//! // After the rootfs is unmounted:
//! let upper = PathBuf::from("/var/lib/layerstack/s/7/upper");
//! let changeset = capture(&upper, &lease)?;
//! // The path index of every layer published on the head since the lease, newest first.
//! let head: Vec<HeadChange> = Vec::new();
//! match check_gate(&changeset, &head) {
//!     GateDecision::Clean => {
//!         seal_layer(&upper)?;
//!         // rename the upper into l/<n>, prepend it to the manifest, and store
//!         // `HeadChange::from_change` of every entry as the new layer's path index.
//!     }
//!     GateDecision::Conflict { paths } => {
//!         for c in paths {
//!             eprintln!("{}: {}", String::from_utf8_lossy(&c.path), c.reason);
//!         }
//!     }
//! }
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod capture;
mod gate;
mod layer;
#[cfg(test)]
mod testutil;
mod view;

pub use capture::{capture, capture_with, CaptureError, CaptureOptions, Change, Changeset};
pub use gate::{
    check_gate, resolve_path, ConflictPath, GateDecision, HeadChange, HeadChangeKind,
    PathResolution,
};
pub use layer::{seal_layer, SealError};
pub use view::{Entry, FileKind, LayerView};
