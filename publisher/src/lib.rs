//! LayerStack's publisher: capture of a session's overlay upper, the publication
//! gate, and sealing of a published layer (ARCHITECTURE §6 steps 4–6, §7).
//!
//! * [`LayerView`] resolves paths over a lease's layers, newest first, as overlayfs
//!   does (whiteouts, opaque directories, non-directories hiding what is below).
//! * [`capture`] walks a quiescent upperdir without following anything and returns
//!   a [`Changeset`]: writes, symlinks, directories, deletions, metadata changes and
//!   special files relative to the lease, with copy-up noise separated out.
//! * [`ExclusionRules`] (globs of paths never published) and [`prepare_upper`]
//!   apply publish policy to the upper.
//! * [`plan_gate`] compares a changeset with the changes published on the branch
//!   head since the lease ([`HeadChange`]): per path clean, merged (three-way text
//!   merge, [`merge_text`], or field-by-field metadata), conflict or excluded, and
//!   the edits ([`Action`]) that make the upper the layer to publish. Any conflict
//!   rejects the whole changeset. Planning changes nothing (it is the dry run,
//!   [`PlanMode::DryRun`]); [`apply_plan`] carries the edits out. All text merges
//!   of one plan share one time budget ([`MergeOptions::timeout`]), and a real
//!   publish starts none once a path conflicts.
//! * [`write_layer_tar`] writes a layer directory as an OCI layer tar (whiteouts,
//!   opaque markers, hardlinks, PAX names and xattrs; deterministic) for export.
//! * [`import_tree`] builds a base without containerd: a directory tree, a layer
//!   tar or an OCI image layout flattened into one directory, every entry
//!   written beneath the staging root (hostile archives are refused by entry).
//! * [`seal_layer_with`] strips overlay-private xattrs from the upper and syncs it, so
//!   it can be renamed into the store as an immutable layer.
//!
//! Paths are relative byte strings (`Vec<u8>`, `/`-separated, no leading `/`),
//! never converted through UTF-8. Every file access is fd-relative or no-follow,
//! and works for paths longer than `PATH_MAX`.
//!
//! ```no_run
//! use std::path::PathBuf;
//! use layerstack_publisher::*;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // The session's lease and the branch head: lowerdirs, newest first.
//! let lease = LayerView::new(vec![PathBuf::from("/var/lib/layerstack/l/1")]);
//! let head = LayerView::new(vec![PathBuf::from("/var/lib/layerstack/l/2"), PathBuf::from("/var/lib/layerstack/l/1")]);
//! let upper = PathBuf::from("/var/lib/layerstack/s/7/upper");
//! // Same filesystem as the upper, never captured: merged files are written here.
//! let scratch = PathBuf::from("/var/lib/layerstack/staging");
//! let mut options = CaptureOptions { exclude: ExclusionRules::new(["/tmp/**"])?, ..Default::default() };
//! // After the rootfs is unmounted (outside the gate's lock):
//! let mut changeset = capture_with(&upper, &lease, &options)?;
//! prepare_upper(&upper, &changeset, false)?;
//! seal_layer(&upper)?;
//! // Inside the gate's lock: the path index of every layer published since the lease.
//! let head_changes: Vec<HeadChange> = Vec::new();
//! let expand = opaque_dirs_to_expand(&changeset, &head_changes);
//! if !expand.is_empty() {
//!     options.expand_opaque = expand;
//!     let first = std::mem::replace(&mut changeset, capture_with(&upper, &lease, &options)?);
//!     // The first pass already removed excluded paths and sockets: keep its reports.
//!     changeset.keep_reports_of(&first);
//!     prepare_upper(&upper, &changeset, false)?;
//! }
//! let files = FsFiles { lease, head, upper: upper.clone(), userxattr: false };
//! let plan = plan_gate(&changeset, &head_changes, &files, &MergeOptions::default())?;
//! for r in &plan.reports {
//!     println!("{} {}: {}", r.status.as_str(), String::from_utf8_lossy(&r.path), r.reason);
//! }
//! if !plan.is_conflict() {
//!     apply_plan(&upper, &plan, &scratch)?;
//!     // rename the upper into l/<n>, prepend it to the manifest, and store
//!     // `plan.index` as the new layer's path index.
//! }
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod apply;
mod capture;
mod exclusion;
mod export;
mod fsx;
mod gate;
mod import;
mod layer;
mod merge;
mod meta;
mod squash;
#[cfg(test)]
mod testutil;
mod textdiff;
mod view;

pub use apply::{apply_plan, apply_plan_with, ApplyError};
pub use capture::{
    capture, capture_with, CaptureError, CaptureOptions, Change, Changeset, RootMeta, UpperEdits,
};
pub use exclusion::{ExclusionError, ExclusionRules};
pub use export::{
    write_layer_tar, TarError, TarOptions, TarReport, OPAQUE_MARKER, WHITEOUT_PREFIX,
};
pub use gate::{
    flatten_head_layers, opaque_dirs_to_expand, plan_gate, plan_gate_with, Action, FileState,
    FsFiles, GateError, GateFiles, GatePlan, HeadChange, HeadChangeKind, PathReport, PathStatus,
    PlanMode, Side,
};
pub use import::{
    apply_layer_tar, extract_tar_into, extract_tar_into_shifted, flatten_layer_tars, host_platform,
    import_tree, ImportError, ImportKind, ImportOptions, ImportReport, LayerApplied,
    LayerApplyOptions,
};
pub use layer::{prepare_upper, seal_layer, seal_layer_unsynced, seal_layer_with, SealError};
pub use merge::{
    is_binary, merge_text, merge_text_within, DiffAlgorithm, MergeBudget, MergeOptions, TextMerge,
    BINARY_SNIFF_BYTES, DEFAULT_MAX_BYTES, DEFAULT_MAX_LINES, DEFAULT_TIMEOUT,
};
pub use meta::{Meta, XattrList};
pub use squash::{
    copy_paths, flatten_layers, flatten_layers_over, tree_digest, CopyPath, FlattenReport,
    SquashError,
};
// Blame, diff and conflicts (issue 10): line origins, markers, patches.
pub use capture::{digest_bytes, hash as digest_reader};
pub use merge::{
    conflict_blocks, merge_text_traced_within, render_conflict, unchanged_lines, LineOrigin,
    TracedMerge, MARKER_BASE, MARKER_OURS, MARKER_SEP, MARKER_THEIRS, OVERLAP_REASON,
};
pub use textdiff::unified_patch;
pub use view::{Entry, FileKind, LayerView, Lookups};
