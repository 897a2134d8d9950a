//! The publication gate (ARCHITECTURE §7; design record `docs/merge-rules.md`).
//!
//! A captured [`Changeset`] is compared with everything published on the branch
//! head since the session's lease ([`HeadChange`]s, newest layer first). The result
//! is a [`GatePlan`]: one [`PathReport`] per path (clean, merged, conflict,
//! excluded) and the [`Action`]s that turn the upper into the layer to publish.
//! Any conflict rejects the whole changeset; a plan is applied ([`apply_plan`](crate::apply_plan)) only
//! when it has none. Planning reads files but never changes anything, so it is also
//! the dry run.
//!
//! Same-path rules (both the session and the head changed path `P`):
//! * same final state (type, content, mode, owner, xattrs; directories: mode,
//!   owner, xattrs, opacity) → clean;
//! * otherwise, when both sides leave the same type, **field by field** against the
//!   lease's state (the base): content, mode, uid, gid, xattrs each take the side
//!   that changed it; a field both sides changed differently conflicts, except
//!   regular-file content, which is three-way merged ([`merge_text`]: binary gate,
//!   size and time limits, git diff3 semantics);
//! * a deletion or a type change on one side against anything else on the other
//!   → conflict (unless the other side's final state equals the base);
//! * copy-up noise ([`Changeset::unchanged`]) never conflicts on its own: when the
//!   head changed such a path, the noise is dropped from the upper (a directory
//!   gets the head's metadata instead) so the head's version stays visible;
//! * a regular file hardlinked inside the upper is never merged or dropped (that
//!   would break the link) → conflict. Only links among published paths count:
//!   capture leaves out links whose other names are excluded.
//!
//! Hierarchy rules, between a directory `D` and paths strictly below it:
//! * one side deleted `D`, replaced it with a non-directory, or made it opaque, and
//!   the other side changed something below `D` → conflict on that path. A deletion
//!   below `D` agrees with the removal of `D` and does not conflict.
//! * A captured opaque directory that the head changed (deletion included), changed
//!   something below, or hid with an ancestor must first be expanded
//!   ([`opaque_dirs_to_expand`], then capture again with
//!   [`CaptureOptions::expand_opaque`](crate::CaptureOptions)): it becomes a plain
//!   directory plus one deletion per path of the **lease's** view, so files the head
//!   added survive, head edits of lease files the session removed conflict as
//!   delete-vs-edit, and a head deletion of a directory the session only emptied
//!   wins (its own state is the lease's: a copy-up parent).
//! * Copy-up noise below a directory the head removed is dropped with its topmost
//!   copy-up parent when nothing but noise and deletions is below it.
//!
//! Text merges run last, after every other rule: in a real publish
//! ([`PlanMode::Publish`]) none is started once any path conflicts (the changeset is
//! rejected anyway; the paths left are reported as conflicts "not evaluated"), and
//! all merges of one plan share one time budget, [`MergeOptions::timeout`]
//! ([`MergeBudget`]). A dry run ([`PlanMode::DryRun`]) attempts every merge, within
//! the same budget.
//!
//! Cost: `O((n + m) log(n + m) + k)` path work for `n` captured paths, `m` head
//! changes and `k` reports, plus file reads only for paths changed on both sides,
//! plus at most `MergeOptions::timeout` of waiting for merges.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::io;
use std::ops::Bound;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::capture::{digest_bytes, is_overlay_private, list_digest, Change, Changeset};
use crate::fsx;
use crate::merge::{merge_text_traced_within, LineOrigin, MergeBudget, MergeOptions, TracedMerge};
use crate::meta::{Meta, XattrList};
use crate::view::{opaque_name, FileKind, LayerView};

/// The kind of one change published on the head, as recorded in a layer's path index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum HeadChangeKind {
    /// [`Change::Write`].
    Write,
    /// [`Change::Symlink`].
    Symlink,
    /// [`Change::Mkdir`] with `opaque: false`.
    Mkdir,
    /// [`Change::Delete`].
    Delete,
    /// [`Change::Mkdir`] with `opaque: true`.
    Opaque,
    /// [`Change::Meta`].
    Meta,
    /// [`Change::Special`].
    Special,
}

impl HeadChangeKind {
    /// True when the change hides everything the lease had below the path.
    fn hides_below(self) -> bool {
        !matches!(self, HeadChangeKind::Mkdir | HeadChangeKind::Meta)
    }

    fn describe(self) -> &'static str {
        match self {
            HeadChangeKind::Write => "file written",
            HeadChangeKind::Symlink => "symlink written",
            HeadChangeKind::Mkdir => "directory created",
            HeadChangeKind::Delete => "deleted",
            HeadChangeKind::Opaque => "directory replaced (opaque)",
            HeadChangeKind::Meta => "directory metadata changed",
            HeadChangeKind::Special => "special file written",
        }
    }
}

/// One path changed on the branch head since a lease: the compact form of a
/// [`Change`] that the daemon stores as each published layer's path index.
///
/// `digest` identifies content: BLAKE3 of the file content ([`HeadChangeKind::Write`]),
/// of the target bytes ([`HeadChangeKind::Symlink`]), or of the file type and device
/// number ([`HeadChangeKind::Special`]); `None` otherwise. `mode` (permission bits
/// incl. setuid/setgid/sticky), `uid` and `gid` are `None` for deletions and `mode`
/// is `None` for symlinks. `xattrs` is the digest of the non-private xattrs, `None`
/// when there are none (index entries written before xattrs were recorded read as
/// `None` too).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HeadChange {
    /// Relative path, bytes (same form as [`Changeset::entries`] keys).
    pub path: Vec<u8>,
    /// What happened.
    pub kind: HeadChangeKind,
    /// Content identity, see above.
    pub digest: Option<[u8; 32]>,
    /// Permission bits.
    pub mode: Option<u32>,
    /// Owner user id.
    pub uid: Option<u32>,
    /// Owner group id.
    pub gid: Option<u32>,
    /// Digest of the non-private xattrs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xattrs: Option<[u8; 32]>,
}

impl HeadChange {
    /// The index record of `change` at `path`, without xattrs.
    #[must_use]
    pub fn from_change(path: &[u8], change: &Change) -> HeadChange {
        let s = State::of_change(change, None);
        HeadChange {
            path: path.to_vec(),
            kind: head_kind(change),
            digest: s.content,
            mode: s.mode,
            uid: s.uid,
            gid: s.gid,
            xattrs: None,
        }
    }

    /// The same record with the xattrs digest `xattrs`.
    #[must_use]
    pub fn with_xattrs(mut self, xattrs: Option<[u8; 32]>) -> HeadChange {
        self.xattrs = xattrs;
        self
    }

    fn state(&self) -> State {
        use HeadChangeKind as K;
        let kind = match self.kind {
            K::Delete => None,
            K::Write => Some(FileKind::Regular),
            K::Symlink => Some(FileKind::Symlink),
            K::Mkdir | K::Opaque | K::Meta => Some(FileKind::Dir),
            // The exact special kind is folded into the digest.
            K::Special => Some(FileKind::Fifo),
        };
        State {
            kind: kind.map(|k| {
                if self.kind == K::Special {
                    Kind::Special
                } else {
                    Kind::Plain(k)
                }
            }),
            content: self.digest,
            mode: self.mode,
            uid: self.uid,
            gid: self.gid,
            xattrs: self.xattrs,
            opaque: self.kind == K::Opaque,
        }
    }
}

impl Changeset {
    /// The path-index record of the captured change at `path` (with xattrs).
    #[must_use]
    pub fn head_change(&self, path: &[u8]) -> Option<HeadChange> {
        self.entries
            .get(path)
            .map(|c| HeadChange::from_change(path, c).with_xattrs(self.xattrs_of(path)))
    }
}

fn head_kind(change: &Change) -> HeadChangeKind {
    use HeadChangeKind as K;
    match change {
        Change::Write { .. } => K::Write,
        Change::Symlink { .. } => K::Symlink,
        Change::Mkdir { opaque: true, .. } => K::Opaque,
        Change::Mkdir { .. } => K::Mkdir,
        Change::Delete => K::Delete,
        Change::Meta { .. } => K::Meta,
        Change::Special { .. } => K::Special,
    }
}

/// Content identity of a special file: its type and device number.
fn special_digest(kind: FileKind, rdev: u64) -> [u8; 32] {
    let tag: u8 = match kind {
        FileKind::Fifo => b'p',
        FileKind::CharDev => b'c',
        FileKind::BlockDev => b'b',
        _ => b'?',
    };
    let mut bytes = b"layerstack-special\0".to_vec();
    bytes.push(tag);
    bytes.extend_from_slice(&rdev.to_le_bytes());
    digest_bytes(&bytes)
}

/// Type at a path for the gate: specials compare by their digest only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Plain(FileKind),
    Special,
}

impl Kind {
    fn of(k: FileKind) -> Kind {
        match k {
            FileKind::Fifo | FileKind::CharDev | FileKind::BlockDev | FileKind::Socket => {
                Kind::Special
            }
            other => Kind::Plain(other),
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Kind::Plain(FileKind::Regular) => "a file",
            Kind::Plain(FileKind::Dir) => "a directory",
            Kind::Plain(FileKind::Symlink) => "a symlink",
            _ => "a special file",
        }
    }
}

/// The state a side leaves at one path, field by field.
#[derive(Debug, Clone, PartialEq, Eq)]
struct State {
    /// `None`: absent.
    kind: Option<Kind>,
    content: Option<[u8; 32]>,
    mode: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    xattrs: Option<[u8; 32]>,
    opaque: bool,
}

impl State {
    const ABSENT: State = State {
        kind: None,
        content: None,
        mode: None,
        uid: None,
        gid: None,
        xattrs: None,
        opaque: false,
    };

    fn of_change(change: &Change, xattrs: Option<[u8; 32]>) -> State {
        let plain = |k| Some(Kind::Plain(k));
        match change {
            Change::Write {
                mode,
                uid,
                gid,
                digest,
                ..
            } => State {
                kind: plain(FileKind::Regular),
                content: Some(*digest),
                mode: Some(*mode),
                uid: Some(*uid),
                gid: Some(*gid),
                xattrs,
                opaque: false,
            },
            Change::Symlink { target, uid, gid } => State {
                kind: plain(FileKind::Symlink),
                content: Some(digest_bytes(target)),
                mode: None,
                uid: Some(*uid),
                gid: Some(*gid),
                xattrs,
                opaque: false,
            },
            Change::Mkdir {
                mode,
                uid,
                gid,
                opaque,
            } => State {
                kind: plain(FileKind::Dir),
                content: None,
                mode: Some(*mode),
                uid: Some(*uid),
                gid: Some(*gid),
                xattrs,
                opaque: *opaque,
            },
            Change::Meta { mode, uid, gid } => State {
                kind: plain(FileKind::Dir),
                content: None,
                mode: Some(*mode),
                uid: Some(*uid),
                gid: Some(*gid),
                xattrs,
                opaque: false,
            },
            Change::Delete => State::ABSENT,
            Change::Special {
                kind,
                mode,
                uid,
                gid,
                rdev,
            } => State {
                kind: Some(Kind::Special),
                content: Some(special_digest(*kind, *rdev)),
                mode: Some(*mode),
                uid: Some(*uid),
                gid: Some(*gid),
                xattrs,
                opaque: false,
            },
        }
    }

    fn describe(&self) -> &'static str {
        match self.kind {
            None => "deleted",
            Some(k) => k.describe(),
        }
    }
}

/// Which version of a path a [`GateFiles`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The lease's view (the common ancestor).
    Base,
    /// The session's upper.
    Ours,
    /// The branch head's view.
    Theirs,
}

/// What [`GateFiles::stat`] reports about one path of one side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileState {
    /// File type.
    pub kind: FileKind,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Owner user id.
    pub uid: u32,
    /// Owner group id.
    pub gid: u32,
    /// `st_size` in bytes.
    pub size: u64,
    /// `st_rdev`.
    pub rdev: u64,
    /// Non-private xattrs, sorted by name (without the opaque marker of the
    /// mount's namespace; the other namespace's `overlay.*` names are data).
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

/// Read access to the three versions of the tree the gate compares. Only paths
/// changed on both sides are ever read.
pub trait GateFiles {
    /// Type and metadata of `path` on `side`; `None` when nothing is there.
    ///
    /// # Errors
    /// Any read error.
    fn stat(&self, side: Side, path: &[u8]) -> io::Result<Option<FileState>>;
    /// Content of a regular file, or target of a symlink.
    ///
    /// # Errors
    /// Any read error.
    fn read(&self, side: Side, path: &[u8]) -> io::Result<Vec<u8>>;
    /// BLAKE3 of [`read`](Self::read) (streamed where the implementation can).
    ///
    /// # Errors
    /// Any read error.
    fn digest(&self, side: Side, path: &[u8]) -> io::Result<[u8; 32]> {
        Ok(digest_bytes(&self.read(side, path)?))
    }
    /// A directory below which the regular file `path` of `side` can be opened
    /// (no-follow) at [`apply_plan`](crate::apply_plan) time, so that its content is streamed into
    /// the upper ([`Action::CopyFile`]) rather than read into memory. `None` (the
    /// default) when the implementation has no such directory: the gate then reads
    /// the file ([`read`](Self::read)) into an [`Action::WriteFile`].
    ///
    /// # Errors
    /// Any read error.
    fn source(&self, side: Side, path: &[u8]) -> io::Result<Option<PathBuf>> {
        let _ = (side, path);
        Ok(None)
    }
    /// The session was mounted with `userxattr`: `user.overlay.*` rather than
    /// `trusted.overlay.*` is the overlay's private namespace. Default `false`.
    fn userxattr(&self) -> bool {
        false
    }
}

/// [`GateFiles`] over real directories: the lease's and the head's layer views and
/// the session's upper. Every access is no-follow and works for long paths.
#[derive(Debug, Clone)]
pub struct FsFiles {
    /// The lease's view.
    pub lease: LayerView,
    /// The branch head's view (same per-container and image layers as the lease,
    /// the head manifest's published layers).
    pub head: LayerView,
    /// The session's upper directory.
    pub upper: PathBuf,
    /// The session was mounted with `userxattr`.
    pub userxattr: bool,
}

impl FsFiles {
    /// The layer directory holding `path` on `side`, `None` when absent.
    fn locate(&self, side: Side, path: &[u8]) -> io::Result<Option<(PathBuf, std::fs::Metadata)>> {
        let base = match side {
            Side::Ours => self.upper.clone(),
            Side::Base | Side::Theirs => {
                let view = if side == Side::Base {
                    &self.lease
                } else {
                    &self.head
                };
                match view.lookup(path)? {
                    Some(e) => view.layer(e.layer_index).to_path_buf(),
                    None => return Ok(None),
                }
            }
        };
        match fsx::lstat(&base, path) {
            Ok(md) => Ok(Some((base, md))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl GateFiles for FsFiles {
    fn stat(&self, side: Side, path: &[u8]) -> io::Result<Option<FileState>> {
        let Some((base, md)) = self.locate(side, path)? else {
            return Ok(None);
        };
        if crate::view::is_whiteout(md.mode(), md.rdev()) {
            return Ok(None);
        }
        let Some(kind) = FileKind::from_mode(md.mode()) else {
            return Ok(None);
        };
        let at = fsx::at(&base, path)?;
        let mut xattrs = fsx::xattrs_of(at.path())?;
        let opaque = opaque_name(self.userxattr).as_bytes();
        xattrs.retain(|(n, _)| !is_overlay_private(n, self.userxattr) && n != opaque);
        Ok(Some(FileState {
            kind,
            mode: md.mode() & 0o7777,
            uid: md.uid(),
            gid: md.gid(),
            size: md.size(),
            rdev: md.rdev(),
            xattrs,
        }))
    }

    fn read(&self, side: Side, path: &[u8]) -> io::Result<Vec<u8>> {
        let Some((base, md)) = self.locate(side, path)? else {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        };
        if md.file_type().is_symlink() {
            fsx::read_link(&base, path)
        } else {
            fsx::read_file(&base, path)
        }
    }

    fn digest(&self, side: Side, path: &[u8]) -> io::Result<[u8; 32]> {
        let Some((base, md)) = self.locate(side, path)? else {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        };
        if md.file_type().is_symlink() {
            Ok(digest_bytes(&fsx::read_link(&base, path)?))
        } else {
            crate::capture::hash(fsx::open_read(&base, path)?)
        }
    }

    /// The layer directory (or the upper) holding `path`: layers are immutable,
    /// so the file is still the same when the plan is applied.
    fn source(&self, side: Side, path: &[u8]) -> io::Result<Option<PathBuf>> {
        Ok(self
            .locate(side, path)?
            .filter(|(_, md)| md.file_type().is_file())
            .map(|(base, _)| base))
    }

    fn userxattr(&self) -> bool {
        self.userxattr
    }
}

/// The gate's verdict on one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PathStatus {
    /// Published as captured (or, for copy-up noise, dropped in favour of the head).
    Clean,
    /// Published as a three-way (content) or field-by-field (metadata) merge.
    Merged,
    /// Rejected; the whole changeset is rejected with it.
    Conflict,
    /// Left out by policy (or a socket, never published).
    Excluded,
}

impl PathStatus {
    /// Lowercase name.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            PathStatus::Clean => "clean",
            PathStatus::Merged => "merged",
            PathStatus::Conflict => "conflict",
            PathStatus::Excluded => "excluded",
        }
    }
}

/// The gate's verdict on one path, with why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathReport {
    /// Relative path, bytes.
    pub path: Vec<u8>,
    /// The verdict.
    pub status: PathStatus,
    /// Why, lowercase.
    pub reason: String,
}

/// One edit of the upper that [`apply_plan`](crate::apply_plan) carries out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Replace a regular file's content and metadata (a new inode: temp file,
    /// `fsync`, `rename` over the old one).
    WriteFile {
        /// Relative path.
        path: Vec<u8>,
        /// The merged content.
        content: Vec<u8>,
        /// The merged metadata.
        meta: Meta,
    },
    /// Replace a regular file's content with another version's, **streamed** from
    /// `from`/`path` (never read into memory: no size limit applies), and its
    /// metadata; a new inode as for [`WriteFile`](Action::WriteFile). Holes of a
    /// sparse source stay holes where the filesystem reports them.
    CopyFile {
        /// Relative path, in the upper and below `from`.
        path: Vec<u8>,
        /// The directory holding the version to copy (a head layer, from
        /// [`GateFiles::source`]).
        from: PathBuf,
        /// The merged metadata.
        meta: Meta,
    },
    /// Replace a symlink by one with `target` (the head's) and the merged metadata
    /// (a new inode: created in the scratch directory, owner and xattrs set, then
    /// renamed over the old one). Never followed.
    WriteSymlink {
        /// Relative path.
        path: Vec<u8>,
        /// The link target, bytes as `readlink(2)` returns them.
        target: Vec<u8>,
        /// The merged metadata (`mode` is ignored: a symlink has none).
        meta: Meta,
    },
    /// Set the metadata of an upper entry in place (a directory or a file whose
    /// content stays).
    SetMeta {
        /// Relative path.
        path: Vec<u8>,
        /// The merged metadata.
        meta: Meta,
    },
    /// Remove copy-up noise (a whole subtree for a directory), so the head's
    /// version shows through.
    Remove {
        /// Relative path.
        path: Vec<u8>,
    },
}

/// The outcome of planning a publish.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GatePlan {
    /// One report per captured, excluded or skipped path (copy-up noise only when
    /// the gate acted on it), sorted by path.
    pub reports: Vec<PathReport>,
    /// Edits of the upper (only meaningful without conflicts).
    pub actions: Vec<Action>,
    /// The path index of the layer the upper becomes once the actions are applied.
    pub index: Vec<HeadChange>,
    /// The session was mounted with `userxattr` ([`GateFiles::userxattr`]): which
    /// overlay xattr namespace [`apply_plan`](crate::apply_plan) leaves alone.
    pub userxattr: bool,
    /// Blame: for every path whose content was three-way merged (an
    /// [`Action::WriteFile`]), where each line of the merged text comes from —
    /// the lease's version ([`Side::Base`]), the session's or the head's.
    pub origins: BTreeMap<Vec<u8>, Vec<LineOrigin>>,
    /// Conflicting paths whose only trouble is that both sides changed the same
    /// or adjacent lines of a text file: conflict markers can show them
    /// (`layerstack conflict show`, `layerstack session rebase`).
    pub text_conflicts: BTreeSet<Vec<u8>>,
}

/// How [`plan_gate_with`] treats text merges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PlanMode {
    /// A real publish: once any path conflicts, no further merge is started (the
    /// changeset is rejected anyway); the paths still needing one are reported as
    /// conflicts, "not evaluated".
    #[default]
    Publish,
    /// A dry run: every merge is attempted, within the same total time budget.
    DryRun,
}

impl GatePlan {
    /// The conflicting paths.
    pub fn conflicts(&self) -> impl Iterator<Item = &PathReport> + '_ {
        self.reports
            .iter()
            .filter(|r| r.status == PathStatus::Conflict)
    }

    /// True when at least one path conflicts (the changeset is rejected).
    #[must_use]
    pub fn is_conflict(&self) -> bool {
        self.conflicts().next().is_some()
    }

    /// True when at least one path was merged.
    #[must_use]
    pub fn is_merged(&self) -> bool {
        self.reports.iter().any(|r| r.status == PathStatus::Merged)
    }
}

/// Why planning failed (a conflict is a plan, not an error).
#[derive(Debug, thiserror::Error)]
pub enum GateError {
    /// Reading one of the three versions of a path failed.
    #[error("cannot read the {side:?} version of {}", .path.display())]
    Read {
        /// Which version.
        side: Side,
        /// Relative path.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The captured changeset still holds an opaque directory with head changes
    /// below it: capture again with these directories in
    /// [`CaptureOptions::expand_opaque`](crate::CaptureOptions).
    #[error("{} opaque director(ies) must be expanded first", .0.len())]
    NeedsExpansion(BTreeSet<Vec<u8>>),
}

pub(crate) fn rel_path(rel: &[u8]) -> PathBuf {
    PathBuf::from(OsString::from_vec(rel.to_vec()))
}

/// The captured opaque directories that the head changed, changed something below,
/// or hid (deleted or replaced it or one of its ancestors): they must be expanded
/// (captured again with [`CaptureOptions::expand_opaque`](crate::CaptureOptions))
/// before [`plan_gate`], so that they are judged as what they are relative to the
/// lease (ARCHITECTURE §7): a plain directory, whose own metadata merges field by
/// field or, when it equals the lease's, is a copy-up parent, plus one deletion per
/// path of the lease's view.
///
/// Judged whole, an opaque directory never equals the lease's directory (opacity
/// differs), even when the session only emptied it (`rm -rf d; mkdir d`, over an
/// empty lease directory a no-op): a head that deleted `d` would then conflict as
/// delete vs edit although the session's `d` itself is the lease's. Expanded, it is
/// a copy-up parent and the lease content's deletions, which agree with the
/// head's removal, so the head's deletion wins unless the session changed `d`'s
/// metadata or put something below it.
#[must_use]
pub fn opaque_dirs_to_expand(
    captured: &Changeset,
    head_changes: &[HeadChange],
) -> BTreeSet<Vec<u8>> {
    let mut head: BTreeMap<&[u8], HeadChangeKind> = BTreeMap::new();
    // Paths the head removed, replaced or made opaque (any occurrence).
    let mut hiding: BTreeSet<Vec<u8>> = BTreeSet::new();
    for h in head_changes {
        head.entry(h.path.as_slice()).or_insert(h.kind);
        if h.kind.hides_below() {
            hiding.insert(h.path.clone());
        }
    }
    captured
        .entries
        .iter()
        .filter(|(_, c)| matches!(c, Change::Mkdir { opaque: true, .. }))
        .filter(|(d, _)| {
            head.contains_key(d.as_slice())
                || below(&head, d).next().is_some()
                || is_below_any(&hiding, d)
        })
        .map(|(d, _)| d.clone())
        .collect()
}

/// Flattens the path indexes of the layers published on the head since a lease,
/// **newest layer first**, into the list [`plan_gate`] takes.
///
/// Entries of an older layer below a path that a newer layer hid are
/// dropped: a newer layer that deleted a directory, replaced it by a
/// non-directory, or replaced it by an opaque directory (`rm -rf d; mkdir d`)
/// removed everything older below it, as overlayfs' lookup stops at its
/// whiteout or opaque marker (kernel `Documentation/filesystems/overlayfs.rst`,
/// "whiteouts and opaque directories"). Such an older change is not part of the
/// head's final state, so it must neither be taken as the head's version of the
/// path nor count as a head change below a directory. The hiding entry itself,
/// and any occurrence of a path that the newer layers did not hide, are kept in
/// order: the first occurrence of a path is its final state, every occurrence
/// counts for the directory rules.
#[must_use]
pub fn flatten_head_layers<I>(layers: I) -> Vec<HeadChange>
where
    I: IntoIterator<Item = Vec<HeadChange>>,
{
    let mut out = Vec::new();
    // Paths hidden by a layer newer than the one being read.
    let mut hidden: BTreeSet<Vec<u8>> = BTreeSet::new();
    for layer in layers {
        let kept: Vec<HeadChange> = layer
            .into_iter()
            .filter(|h| !is_below_any(&hidden, &h.path))
            .collect();
        for h in &kept {
            if h.kind.hides_below() {
                hidden.insert(h.path.clone());
            }
        }
        out.extend(kept);
    }
    out
}

/// True when `path` is strictly below one of `dirs`.
fn is_below_any(dirs: &BTreeSet<Vec<u8>>, path: &[u8]) -> bool {
    let mut end = path.len();
    while let Some(slash) = path[..end].iter().rposition(|&b| b == b'/') {
        if dirs.contains(&path[..slash]) {
            return true;
        }
        end = slash;
    }
    false
}

/// Plans the publish of `captured` against `head_changes` (the changes of all
/// layers published on the branch head since the lease, **newest layer first**,
/// as [`flatten_head_layers`] returns them; a path may appear several times, its
/// first occurrence is the head's final state and every occurrence counts for the
/// hierarchy rules). Rules: see the module docs.
/// A real publish: [`plan_gate_with`] in [`PlanMode::Publish`].
///
/// # Errors
/// [`GateError::NeedsExpansion`] when an opaque directory must be expanded first
/// (see [`opaque_dirs_to_expand`]); [`GateError::Read`] when a file cannot be read.
pub fn plan_gate(
    captured: &Changeset,
    head_changes: &[HeadChange],
    files: &dyn GateFiles,
    limits: &MergeOptions,
) -> Result<GatePlan, GateError> {
    plan_gate_with(captured, head_changes, files, limits, PlanMode::Publish)
}

/// [`plan_gate`] in `mode`: a real publish stops merging at the first conflict, a
/// dry run attempts every merge; both within one time budget of `limits.timeout`
/// for all merges together.
///
/// # Errors
/// As [`plan_gate`].
pub fn plan_gate_with(
    captured: &Changeset,
    head_changes: &[HeadChange],
    files: &dyn GateFiles,
    limits: &MergeOptions,
    mode: PlanMode,
) -> Result<GatePlan, GateError> {
    let expand = opaque_dirs_to_expand(captured, head_changes);
    if !expand.is_empty() {
        return Err(GateError::NeedsExpansion(expand));
    }
    let mut head: BTreeMap<&[u8], &HeadChange> = BTreeMap::new();
    // Directories the head removed, replaced or made opaque (any occurrence).
    let mut head_hiding: BTreeMap<&[u8], HeadChangeKind> = BTreeMap::new();
    for h in head_changes {
        head.entry(h.path.as_slice()).or_insert(h);
        if h.kind.hides_below() {
            head_hiding.entry(h.path.as_slice()).or_insert(h.kind);
        }
    }
    let mut p = Planner {
        captured,
        files,
        limits,
        mode,
        budget: MergeBudget::new(limits.timeout),
        pending: Vec::new(),
        reports: BTreeMap::new(),
        actions: Vec::new(),
        index: BTreeMap::new(),
        removed: BTreeSet::new(),
        origins: BTreeMap::new(),
        text_conflicts: BTreeSet::new(),
    };

    for (path, why) in &captured.excluded {
        p.report(
            path,
            PathStatus::Excluded,
            format!("excluded by policy pattern {why:?}"),
        );
    }
    for (path, why) in &captured.skipped {
        p.report(
            path,
            PathStatus::Excluded,
            format!("{why}: never published"),
        );
    }

    // Same path on both sides.
    for (path, change) in &captured.entries {
        match head.get(path.as_slice()) {
            None => {
                let reason = if *change == Change::Delete {
                    "deleted; untouched on head"
                } else {
                    "untouched on head"
                };
                p.report(path, PathStatus::Clean, reason.into());
                p.index_entry(path);
            }
            Some(h) => p.same_path(path, change, h, false)?,
        }
    }
    for (path, change) in &captured.unchanged {
        if let Some(h) = head.get(path.as_slice()) {
            p.same_path(path, change, h, true)?;
        }
    }

    // The session removed, replaced or made opaque a directory; the head changed below.
    for (dir, change) in &captured.entries {
        let verb = match change {
            Change::Delete => "deleted",
            Change::Mkdir { opaque: true, .. } => "replaced (opaque)",
            Change::Mkdir { .. } | Change::Meta { .. } => continue,
            _ => "replaced with a non-directory",
        };
        for (path, h) in below(&head, dir) {
            if h.kind != HeadChangeKind::Delete {
                p.conflict(
                    path,
                    format!(
                        "session {verb} ancestor {}, head {} here",
                        show(dir),
                        h.kind.describe()
                    ),
                );
            }
        }
    }

    // The head removed, replaced or made opaque a directory; the session has something below.
    let mut lease_had: BTreeMap<Vec<u8>, bool> = BTreeMap::new();
    for (dir, kind) in &head_hiding {
        let what = kind.describe();
        for (path, change) in below(&captured.entries, dir) {
            let dir_now = head.get(*dir).is_some_and(|h| {
                matches!(
                    h.kind,
                    HeadChangeKind::Opaque | HeadChangeKind::Mkdir | HeadChangeKind::Meta
                )
            });
            if dir_now {
                // The head replaced the directory (`rm -rf d; mkdir d` in one layer,
                // or a deletion or type change followed by a new directory in a
                // later one, whatever metadata changes came after): it removed what
                // the lease had there, nothing else. A path the session added below
                // it, under a name the lease did not have, survives.
                let top = top_below(dir, path);
                let had = match lease_had.get(top) {
                    Some(&v) => v,
                    None => {
                        let v = files
                            .stat(Side::Base, top)
                            .map_err(Planner::read_err(Side::Base, top))?
                            .is_some();
                        lease_had.insert(top.to_vec(), v);
                        v
                    }
                };
                if !had {
                    continue;
                }
            }
            if *change != Change::Delete && !p.is_removed(path) {
                p.conflict(
                    path,
                    format!(
                        "head {what} ancestor {}, session changed this path",
                        show(dir)
                    ),
                );
            }
        }
        for (path, _) in below(&captured.unchanged, dir) {
            if p.is_removed(path) {
                continue;
            }
            let real = below(&captured.entries, path).any(|(_, c)| *c != Change::Delete);
            if real {
                p.conflict(
                    path,
                    format!(
                        "head {what} ancestor {}, and the upper holds a copy-up here that would bring it back",
                        show(dir)
                    ),
                );
            } else {
                // Copy-up noise the head removed: drop it (with its subtree).
                p.actions.push(Action::Remove {
                    path: path.to_vec(),
                });
                p.removed.insert(path.to_vec());
                p.report(
                    path,
                    PathStatus::Clean,
                    format!(
                        "unchanged copy-up dropped; head {what} ancestor {}",
                        show(dir)
                    ),
                );
            }
        }
    }

    // Text merges, last: the expensive part.
    p.run_merges()?;

    // Nothing of a dropped subtree is published.
    let index = p
        .index
        .iter()
        .filter(|(path, _)| !p.is_removed(path))
        .map(|(_, h)| h.clone())
        .collect();
    Ok(GatePlan {
        reports: p.reports.into_values().collect(),
        actions: p.actions,
        index,
        userxattr: files.userxattr(),
        origins: p.origins,
        text_conflicts: p.text_conflicts,
    })
}

struct Planner<'a> {
    captured: &'a Changeset,
    files: &'a dyn GateFiles,
    limits: &'a MergeOptions,
    mode: PlanMode,
    /// Time left for all text merges of this plan.
    budget: MergeBudget,
    /// Paths whose content needs a three-way text merge, in path order; run last.
    pending: Vec<PendingMerge>,
    reports: BTreeMap<Vec<u8>, PathReport>,
    actions: Vec<Action>,
    index: BTreeMap<Vec<u8>, HeadChange>,
    /// Upper paths dropped (with their subtree).
    removed: BTreeSet<Vec<u8>>,
    /// Line origins of merged texts ([`GatePlan::origins`]).
    origins: BTreeMap<Vec<u8>, Vec<LineOrigin>>,
    /// Paths whose text merge conflicted ([`GatePlan::text_conflicts`]).
    text_conflicts: BTreeSet<Vec<u8>>,
}

/// The metadata fields of a same-type path, already merged field by field.
#[derive(Debug, Clone, Copy)]
struct Fields {
    mode: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    xattrs: Option<[u8; 32]>,
}

/// A path whose regular-file content both sides changed: decided by a text merge
/// once every other rule has run.
struct PendingMerge {
    path: Vec<u8>,
    head: HeadChange,
    ours: State,
    theirs: State,
    base: Option<FileState>,
    fields: Fields,
}

/// Three-way choice of one field: `Ok` with the result, `Err` when both sides
/// changed it differently.
fn pick<T: PartialEq + Copy>(base: Option<T>, ours: T, theirs: T) -> Result<T, ()> {
    if ours == theirs {
        Ok(ours)
    } else if base == Some(ours) {
        Ok(theirs)
    } else if base == Some(theirs) {
        Ok(ours)
    } else {
        Err(())
    }
}

impl Planner<'_> {
    fn report(&mut self, path: &[u8], status: PathStatus, reason: String) {
        // A conflict always wins over an earlier verdict on the same path.
        match self.reports.get(path) {
            Some(r) if r.status == PathStatus::Conflict => {}
            Some(_) if status != PathStatus::Conflict => {}
            _ => {
                self.reports.insert(
                    path.to_vec(),
                    PathReport {
                        path: path.to_vec(),
                        status,
                        reason,
                    },
                );
            }
        }
    }

    fn conflict(&mut self, path: &[u8], reason: String) {
        self.report(path, PathStatus::Conflict, reason);
    }

    fn index_entry(&mut self, path: &[u8]) {
        if let Some(h) = self.captured.head_change(path) {
            self.index.insert(path.to_vec(), h);
        }
    }

    fn is_removed(&self, path: &[u8]) -> bool {
        self.removed
            .iter()
            .any(|r| r.as_slice() == path || strictly_below(r, path))
    }

    fn read_err(side: Side, path: &[u8]) -> impl FnOnce(io::Error) -> GateError + '_ {
        move |source| GateError::Read {
            side,
            path: rel_path(path),
            source,
        }
    }

    fn base_state(&self, path: &[u8]) -> Result<(State, Option<FileState>), GateError> {
        let Some(fs) = self
            .files
            .stat(Side::Base, path)
            .map_err(Self::read_err(Side::Base, path))?
        else {
            return Ok((State::ABSENT, None));
        };
        let kind = Kind::of(fs.kind);
        let content = match fs.kind {
            FileKind::Regular | FileKind::Symlink => Some(
                self.files
                    .digest(Side::Base, path)
                    .map_err(Self::read_err(Side::Base, path))?,
            ),
            FileKind::Dir => None,
            k => Some(special_digest(k, fs.rdev)),
        };
        let state = State {
            kind: Some(kind),
            content,
            mode: (fs.kind != FileKind::Symlink).then_some(fs.mode),
            uid: Some(fs.uid),
            gid: Some(fs.gid),
            xattrs: list_digest(&fs.xattrs),
            opaque: false,
        };
        Ok((state, Some(fs)))
    }

    /// Decides one path that both the capture (`noise`: an unchanged copy-up) and
    /// the head changed.
    fn same_path(
        &mut self,
        path: &[u8],
        change: &Change,
        h: &HeadChange,
        noise: bool,
    ) -> Result<(), GateError> {
        let ours = State::of_change(change, self.captured.xattrs_of(path));
        let theirs = h.state();
        if ours == theirs {
            if !noise {
                self.report(path, PathStatus::Clean, "same change on both sides".into());
                self.index_entry(path);
            }
            return Ok(());
        }
        let hardlinked = self.captured.hardlinks.contains_key(path);
        let (base, base_fs) = self.base_state(path)?;
        if noise {
            return self.noise(path, &ours, &theirs, h, hardlinked);
        }
        if theirs == base {
            // The head changed the path and changed it back.
            self.report(
                path,
                PathStatus::Clean,
                "head's change here was reverted on head".into(),
            );
            self.index_entry(path);
            return Ok(());
        }
        if ours.kind.is_none() || theirs.kind.is_none() || ours.kind != theirs.kind {
            let reason = if ours.kind.is_none() || theirs.kind.is_none() {
                format!(
                    "delete vs edit: session left {}, head {}",
                    ours.describe(),
                    h.kind.describe()
                )
            } else {
                format!(
                    "type change: session left {}, head left {}",
                    ours.describe(),
                    theirs.describe()
                )
            };
            self.conflict(path, reason);
            return Ok(());
        }
        let expanded = self
            .captured
            .edits
            .unopaque
            .iter()
            .any(|d| d.as_slice() == path);
        if ours.opaque != theirs.opaque && !expanded {
            self.conflict(
                path,
                "directory replaced on one side and changed on the other".into(),
            );
            return Ok(());
        }
        // Same type on both sides: field by field against the base.
        let same_kind_base = base.kind == ours.kind;
        let b = |f: fn(&State) -> Option<u32>| if same_kind_base { f(&base) } else { None };
        let mut clashes = Vec::new();
        let mut field =
            |name: &str, base: Option<u32>, o: Option<u32>, t: Option<u32>| -> Option<u32> {
                match (o, t) {
                    (Some(o), Some(t)) => match pick(base, o, t) {
                        Ok(v) => Some(v),
                        Err(()) => {
                            clashes.push(name.to_string());
                            Some(o)
                        }
                    },
                    _ => o.or(t),
                }
            };
        let mode = field("mode", b(|s| s.mode), ours.mode, theirs.mode);
        let uid = field("owner uid", b(|s| s.uid), ours.uid, theirs.uid);
        let gid = field("owner gid", b(|s| s.gid), ours.gid, theirs.gid);
        let base_x = if same_kind_base {
            Some(base.xattrs)
        } else {
            None
        };
        let xattrs = match pick(base_x, ours.xattrs, theirs.xattrs) {
            Ok(v) => v,
            Err(()) => {
                clashes.push("xattrs".into());
                ours.xattrs
            }
        };
        if !clashes.is_empty() {
            self.conflict(
                path,
                format!("both sides changed {} differently", clashes.join(", ")),
            );
            return Ok(());
        }
        let fields = Fields {
            mode,
            uid,
            gid,
            xattrs,
        };
        // Content.
        let base_content = if same_kind_base {
            Some(base.content)
        } else {
            None
        };
        let content = match pick(base_content, ours.content, theirs.content) {
            Ok(c) => c,
            Err(()) => {
                let regular = ours.kind == Some(Kind::Plain(FileKind::Regular));
                if !regular {
                    self.conflict(
                        path,
                        format!(
                            "both sides changed {} differently",
                            ours.describe().trim_start_matches("a ")
                        ),
                    );
                    return Ok(());
                }
                if !same_kind_base {
                    self.conflict(path, "created on both sides with different content".into());
                    return Ok(());
                }
                if hardlinked {
                    self.conflict(
                        path,
                        "hardlinked file changed on both sides: merging would break the link"
                            .into(),
                    );
                    return Ok(());
                }
                // Merged last (run_merges), after every cheaper rule.
                self.pending.push(PendingMerge {
                    path: path.to_vec(),
                    head: h.clone(),
                    ours,
                    theirs,
                    base: base_fs,
                    fields,
                });
                return Ok(());
            }
        };
        self.finish(
            path,
            h,
            &ours,
            &theirs,
            base_fs.as_ref(),
            fields,
            content,
            None,
        )
    }

    /// The first conflicting path so far, in path order.
    fn first_conflict(&self) -> Option<Vec<u8>> {
        self.reports
            .values()
            .find(|r| r.status == PathStatus::Conflict)
            .map(|r| r.path.clone())
    }

    /// Runs the pending text merges in path order, within the plan's budget. In a
    /// real publish, none is started once any path conflicts.
    fn run_merges(&mut self) -> Result<(), GateError> {
        for m in std::mem::take(&mut self.pending) {
            if self
                .reports
                .get(&m.path)
                .is_some_and(|r| r.status == PathStatus::Conflict)
            {
                // Already rejected by a hierarchy rule.
                continue;
            }
            if self.mode == PlanMode::Publish {
                if let Some(first) = self.first_conflict() {
                    self.conflict(
                        &m.path,
                        format!(
                            "not evaluated: both sides changed this file, and the changeset is already rejected (conflict at {}); a publish stops merging at the first conflict",
                            show(&first)
                        ),
                    );
                    continue;
                }
            }
            match self.merge_content(&m.path, m.base.as_ref())? {
                TracedMerge::Clean {
                    content: bytes,
                    origins,
                } => {
                    if let Some(o) = origins {
                        self.origins.insert(m.path.clone(), o);
                    }
                    let d = digest_bytes(&bytes);
                    self.finish(
                        &m.path,
                        &m.head,
                        &m.ours,
                        &m.theirs,
                        m.base.as_ref(),
                        m.fields,
                        Some(d),
                        Some(bytes),
                    )?;
                }
                TracedMerge::Overlap(reason) => {
                    self.text_conflicts.insert(m.path.clone());
                    self.conflict(&m.path, reason);
                }
                TracedMerge::Conflict(reason) => self.conflict(&m.path, reason),
            }
        }
        Ok(())
    }

    /// Records the decision for a same-type path whose fields are merged:
    /// `content` is the chosen content digest, `merged_bytes` the text merge's
    /// output when there was one.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &mut self,
        path: &[u8],
        h: &HeadChange,
        ours: &State,
        theirs: &State,
        base_fs: Option<&FileState>,
        fields: Fields,
        content: Option<[u8; 32]>,
        mut merged_bytes: Option<Vec<u8>>,
    ) -> Result<(), GateError> {
        let hardlinked = self.captured.hardlinks.contains_key(path);
        let result = State {
            kind: ours.kind,
            content,
            mode: fields.mode,
            uid: fields.uid,
            gid: fields.gid,
            xattrs: fields.xattrs,
            opaque: ours.opaque,
        };
        if result == *ours {
            self.report(
                path,
                PathStatus::Clean,
                "head's change here is already in the session's version".into(),
            );
            self.index_entry(path);
            return Ok(());
        }
        let meta = self.meta_for(path, &result, ours, theirs, base_fs)?;
        let what = if merged_bytes.is_some() {
            "three-way merged text".to_string()
        } else if result.content != ours.content {
            "content from head, metadata from session".to_string()
        } else {
            "metadata merged field by field".to_string()
        };
        let kind = ours.kind;
        let mut copy_from: Option<PathBuf> = None;
        if merged_bytes.is_none() && result.content != ours.content {
            // Head's content with merged metadata.
            if hardlinked {
                self.conflict(
                    path,
                    "hardlinked file: taking head's content would break the link".into(),
                );
                return Ok(());
            }
            if kind == Some(Kind::Plain(FileKind::Symlink)) {
                // The head's target with the merged owner and xattrs.
                let target = self
                    .files
                    .read(Side::Theirs, path)
                    .map_err(Self::read_err(Side::Theirs, path))?;
                self.actions.push(Action::WriteSymlink {
                    path: path.to_vec(),
                    target,
                    meta: meta.clone(),
                });
                self.report(
                    path,
                    PathStatus::Merged,
                    "target from head, metadata from session".into(),
                );
                self.index_merged(path, h, kind, &result);
                return Ok(());
            }
            if kind != Some(Kind::Plain(FileKind::Regular)) {
                self.conflict(
                    path,
                    "special file: head changed its type or device number, the session its metadata"
                        .into(),
                );
                return Ok(());
            }
            // Streamed at apply time where the files have a directory (no size
            // limit, nothing held in memory); read only as a fallback.
            copy_from = self
                .files
                .source(Side::Theirs, path)
                .map_err(Self::read_err(Side::Theirs, path))?;
            if copy_from.is_none() {
                merged_bytes = Some(
                    self.files
                        .read(Side::Theirs, path)
                        .map_err(Self::read_err(Side::Theirs, path))?,
                );
            }
        }
        match (merged_bytes, copy_from) {
            (Some(content), _) => self.actions.push(Action::WriteFile {
                path: path.to_vec(),
                content,
                meta: meta.clone(),
            }),
            (None, Some(from)) => self.actions.push(Action::CopyFile {
                path: path.to_vec(),
                from,
                meta: meta.clone(),
            }),
            (None, None) => {
                if hardlinked {
                    self.conflict(
                        path,
                        "hardlinked file: changing its metadata here would change every link"
                            .into(),
                    );
                    return Ok(());
                }
                self.actions.push(Action::SetMeta {
                    path: path.to_vec(),
                    meta: meta.clone(),
                })
            }
        }
        self.report(path, PathStatus::Merged, what);
        self.index_merged(path, h, kind, &result);
        Ok(())
    }

    /// Index record of the merged state `result` at `path`.
    fn index_merged(&mut self, path: &[u8], h: &HeadChange, kind: Option<Kind>, result: &State) {
        let mut hc = self.captured.head_change(path).unwrap_or_else(|| h.clone());
        hc.digest = if kind == Some(Kind::Plain(FileKind::Dir)) {
            None
        } else {
            result.content
        };
        hc.mode = result.mode;
        hc.uid = result.uid;
        hc.gid = result.gid;
        hc.xattrs = result.xattrs;
        self.index.insert(path.to_vec(), hc);
    }

    /// Copy-up noise at a path the head changed: the head's version wins.
    fn noise(
        &mut self,
        path: &[u8],
        ours: &State,
        theirs: &State,
        h: &HeadChange,
        hardlinked: bool,
    ) -> Result<(), GateError> {
        let is_dir = ours.kind == Some(Kind::Plain(FileKind::Dir));
        if is_dir && theirs.kind == ours.kind {
            // A copy-up parent: keep the directory (things below need it) with the
            // head's metadata. (Below a directory the head replaced, the hierarchy
            // rules judge what is in it.)
            let meta = self.meta_for(path, theirs, ours, theirs, None)?;
            self.actions.push(Action::SetMeta {
                path: path.to_vec(),
                meta,
            });
            self.report(
                path,
                PathStatus::Clean,
                format!("copy-up parent; head's {} kept", h.kind.describe()),
            );
            return Ok(());
        }
        if hardlinked {
            self.conflict(
                path,
                format!(
                    "head {} here, and the upper holds a hardlinked copy-up of the lease's version",
                    h.kind.describe()
                ),
            );
            return Ok(());
        }
        if is_dir {
            // Head removed or replaced the directory: drop the copy-up parent with
            // its subtree, if nothing below it is a real change.
            let real = below(&self.captured.entries, path).any(|(_, c)| *c != Change::Delete);
            if real {
                self.conflict(
                    path,
                    format!(
                        "head {} here, and the session changed paths below it",
                        h.kind.describe()
                    ),
                );
                return Ok(());
            }
        }
        self.actions.push(Action::Remove {
            path: path.to_vec(),
        });
        self.removed.insert(path.to_vec());
        self.report(
            path,
            PathStatus::Clean,
            format!(
                "unchanged copy-up dropped; head's {} kept",
                h.kind.describe()
            ),
        );
        Ok(())
    }

    /// The concrete metadata of `result`: xattrs are taken from whichever side
    /// has the chosen digest.
    fn meta_for(
        &self,
        path: &[u8],
        result: &State,
        ours: &State,
        theirs: &State,
        base: Option<&FileState>,
    ) -> Result<Meta, GateError> {
        let xattrs = if result.xattrs.is_none() {
            Vec::new()
        } else if result.xattrs == ours.xattrs {
            self.stat_xattrs(Side::Ours, path)?
        } else if result.xattrs == theirs.xattrs {
            self.stat_xattrs(Side::Theirs, path)?
        } else {
            base.map(|b| b.xattrs.clone()).unwrap_or_default()
        };
        Ok(Meta {
            mode: result.mode.unwrap_or(0),
            uid: result.uid.unwrap_or(0),
            gid: result.gid.unwrap_or(0),
            xattrs,
        })
    }

    fn stat_xattrs(&self, side: Side, path: &[u8]) -> Result<XattrList, GateError> {
        Ok(self
            .files
            .stat(side, path)
            .map_err(Self::read_err(side, path))?
            .map(|s| s.xattrs)
            .unwrap_or_default())
    }

    fn merge_content(
        &mut self,
        path: &[u8],
        base: Option<&FileState>,
    ) -> Result<TracedMerge, GateError> {
        let limit = self.limits.max_bytes;
        let ours_fs = self
            .files
            .stat(Side::Ours, path)
            .map_err(Self::read_err(Side::Ours, path))?;
        let theirs_fs = self
            .files
            .stat(Side::Theirs, path)
            .map_err(Self::read_err(Side::Theirs, path))?;
        for (side, fs) in [
            ("base", base),
            ("session", ours_fs.as_ref()),
            ("head", theirs_fs.as_ref()),
        ] {
            if let Some(fs) = fs {
                if fs.size > limit {
                    return Ok(TracedMerge::Conflict(format!(
                        "not merged: the {side} version is {} bytes, over the merge limit of {limit} bytes",
                        fs.size
                    )));
                }
            }
        }
        if self.budget.is_used_up() {
            // Nothing more is merged in this publish: do not even read the files.
            return Ok(TracedMerge::Conflict(self.budget.used_up_reason()));
        }
        let b = self
            .files
            .read(Side::Base, path)
            .map_err(Self::read_err(Side::Base, path))?;
        let o = self
            .files
            .read(Side::Ours, path)
            .map_err(Self::read_err(Side::Ours, path))?;
        let t = self
            .files
            .read(Side::Theirs, path)
            .map_err(Self::read_err(Side::Theirs, path))?;
        Ok(merge_text_traced_within(
            &b,
            &o,
            &t,
            self.limits,
            &mut self.budget,
        ))
    }
}

/// The ancestor of `path` (or `path` itself) one component below `dir`.
fn top_below<'p>(dir: &[u8], path: &'p [u8]) -> &'p [u8] {
    let start = dir.len() + 1;
    match path[start..].iter().position(|&b| b == b'/') {
        Some(i) => &path[..start + i],
        None => path,
    }
}

/// True when `path` is strictly below `dir`.
fn strictly_below(dir: &[u8], path: &[u8]) -> bool {
    path.len() > dir.len() && path.starts_with(dir) && path[dir.len()] == b'/'
}

/// Entries of `map` strictly below directory `dir`: keys in `[dir + "/", dir + "0")`.
fn below<'m, K, V>(map: &'m BTreeMap<K, V>, dir: &[u8]) -> impl Iterator<Item = (&'m [u8], &'m V)>
where
    K: std::borrow::Borrow<[u8]> + Ord,
{
    let mut lo = dir.to_vec();
    lo.push(b'/');
    let mut hi = dir.to_vec();
    hi.push(b'/' + 1);
    map.range::<[u8], _>((
        Bound::Included(lo.as_slice()),
        Bound::Excluded(hi.as_slice()),
    ))
    .map(|(k, v)| (k.borrow(), v))
}

/// A path for a message (lossy only for display; never written back).
fn show(path: &[u8]) -> String {
    format!("'{}'", String::from_utf8_lossy(path))
}

#[cfg(test)]
mod tests;
