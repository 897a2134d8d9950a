//! Capture: turn a quiescent overlay upperdir into a [`Changeset`] (ARCHITECTURE §6 step 4).
//!
//! The upper is walked with fd-relative, no-follow system calls only: every
//! directory is opened with `openat(O_DIRECTORY|O_NOFOLLOW)` relative to its
//! parent's descriptor, every entry is examined with `fstatat(AT_SYMLINK_NOFOLLOW)`,
//! regular files are opened with `O_NOFOLLOW`, symlinks are read with `readlinkat`,
//! and fifos, devices and sockets are never opened. One descriptor is held per
//! directory level while walking, so paths longer than `PATH_MAX` work; the lower
//! layers are read the same way when a path is long (see `fsx`).
//!
//! Upper-format rules come from the kernel (Documentation/filesystems/overlayfs.rst):
//! a 0:0 character device is a whiteout (the kernel links all whiteouts of a mount
//! to one shared inode, so a whiteout's `st_nlink` may be large — it is never taken
//! for a hardlink), a directory with the xattr `trusted.overlay.opaque` = `y`
//! (`user.overlay.opaque` under `userxattr`: the kernel reads only the mount's own
//! namespace) is opaque (`x` is not: since Linux 6.7 it marks a directory holding
//! xattr whiteouts, which LayerStack's mounts never create). Uppers written with
//! `redirect_dir=on` or `metacopy=on` are refused ([`CaptureError::Unsupported`]):
//! LayerStack mounts sessions with `index=off,redirect_dir=off,metacopy=off`
//! (ARCHITECTURE §5).
//!
//! Extended attributes are part of a file's metadata: a file whose content, mode
//! and owner equal the lease's but whose xattrs differ (`setfattr`, or the kernel
//! dropping `security.capability` on `chown`) is a change. Overlay-private xattrs
//! of the mount's namespace (`trusted.overlay.*`, or `user.overlay.*` under
//! `userxattr`; its opaque marker is compared on its own, as opacity) are not
//! compared; escaped ones (`*.overlay.overlay.*`, a nested overlay's data, Linux
//! 6.7+) and `overlay.*` names of the other namespace (e.g. `user.overlay.opaque`
//! on a session mounted without `userxattr`) are ordinary data.
//!
//! The upper's root directory is the container's `/`; it is not a path of the
//! changeset. Its mode, owner and xattrs are never published: a change of them is
//! reported in [`Changeset::skipped`] (path `""`) and [`UpperEdits::root`] resets
//! them to the lease's before the upper becomes a layer.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{FileStat, Mode};
use serde::{Deserialize, Serialize};
use xattr::FileExt;

use crate::exclusion::ExclusionRules;
use crate::fsx::{self, DirFd};
use crate::view::{is_whiteout, join_rel, opaque_name, opaque_value};
use crate::view::{Cursor, Entry, FileKind, LayerView};

/// One captured change at one path, relative to the session's lease (the lower view).
///
/// Modes are permission bits including setuid, setgid and sticky (`st_mode & 0o7777`);
/// digests are BLAKE3-256 of the file content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Change {
    /// A regular file that is new or differs from the lease (content or metadata).
    Write {
        /// Permission bits.
        mode: u32,
        /// Owner user id.
        uid: u32,
        /// Owner group id.
        gid: u32,
        /// Content length in bytes.
        size: u64,
        /// BLAKE3 of the content.
        digest: [u8; 32],
    },
    /// A symlink; `target` is the verbatim `readlink` bytes, never resolved.
    Symlink {
        /// Target bytes as stored.
        target: Vec<u8>,
        /// Owner user id.
        uid: u32,
        /// Owner group id.
        gid: u32,
    },
    /// A directory that the lease does not have as a directory (new, or replacing a
    /// non-directory), or an opaque directory (`opaque`: older layers' content of this
    /// directory is hidden, e.g. after `rm -rf d; mkdir d`).
    Mkdir {
        /// Permission bits.
        mode: u32,
        /// Owner user id.
        uid: u32,
        /// Owner group id.
        gid: u32,
        /// The upper directory carries the opaque xattr with value `y`.
        opaque: bool,
    },
    /// A whiteout (0:0 character device): the path is deleted. Reported even when the
    /// lease has nothing there, because the published layer would still hide the path.
    Delete,
    /// A directory present in the lease as a directory, not opaque, whose mode, uid,
    /// gid or xattrs changed. Its content is not replaced; changes below it are
    /// separate entries.
    Meta {
        /// Permission bits.
        mode: u32,
        /// Owner user id.
        uid: u32,
        /// Owner group id.
        gid: u32,
    },
    /// A fifo, character device (not 0:0) or block device; never opened.
    Special {
        /// [`FileKind::Fifo`], [`FileKind::CharDev`] or [`FileKind::BlockDev`].
        kind: FileKind,
        /// Permission bits.
        mode: u32,
        /// Owner user id.
        uid: u32,
        /// Owner group id.
        gid: u32,
        /// Device number (`st_rdev`, 0 for a fifo).
        rdev: u64,
    },
}

impl Change {
    /// The file type at the path after the change; `None` for [`Change::Delete`].
    #[must_use]
    pub fn file_kind(&self) -> Option<FileKind> {
        match self {
            Change::Write { .. } => Some(FileKind::Regular),
            Change::Symlink { .. } => Some(FileKind::Symlink),
            Change::Mkdir { .. } | Change::Meta { .. } => Some(FileKind::Dir),
            Change::Delete => None,
            Change::Special { kind, .. } => Some(*kind),
        }
    }
}

/// Filesystem edits that make an upper match its [`Changeset`] after policy was
/// applied: they are computed by capture and carried out by
/// [`prepare_upper`](crate::prepare_upper) (never by capture itself, so a dry run
/// leaves the upper untouched).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpperEdits {
    /// Excluded paths to remove from the upper (whole subtrees), with the pattern.
    pub remove: Vec<(Vec<u8>, String)>,
    /// Opaque directories to turn into plain directories (their opaque xattr is
    /// removed) because they were expanded into per-path deletions.
    pub unopaque: Vec<Vec<u8>>,
    /// Whiteouts to create: per-path deletions of an expanded opaque directory, and
    /// lease files that a socket replaced (the socket itself is removed).
    pub whiteouts: Vec<Vec<u8>>,
    /// The upper's root directory (the container's `/`) has another mode, owner or
    /// set of xattrs than the lease's root: set it back to the lease's, so a
    /// published layer never changes `/` for later containers.
    #[serde(default)]
    pub root: Option<RootMeta>,
}

/// Metadata of a layer's root directory ([`UpperEdits::root`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootMeta {
    /// Permission bits.
    pub mode: u32,
    /// Owner user id.
    pub uid: u32,
    /// Owner group id.
    pub gid: u32,
    /// The xattrs, sorted by name, without overlay-private names and the opaque
    /// marker of the mount's namespace (those are left as they are).
    #[serde(default)]
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl UpperEdits {
    /// True when there is nothing to do.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.remove.is_empty()
            && self.unopaque.is_empty()
            && self.whiteouts.is_empty()
            && self.root.is_none()
    }
}

/// Everything a capture found in one upper. Paths are relative byte strings
/// (no leading `/`, `/`-separated, exactly the bytes of the file names).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Changeset {
    /// The changes to publish, by path.
    pub entries: BTreeMap<Vec<u8>, Change>,
    /// Paths the upper holds whose state equals the lease's: copy-up parent
    /// directories (as [`Change::Meta`] with the lease's own mode/uid/gid) and
    /// content-identical copy-ups of files, symlinks and special files (copy-up noise,
    /// e.g. after `touch` or `chown` to the same owner). They are not changes, but
    /// they are in the upper, so a layer built from the upper as is carries the
    /// lease's version of them: the gate checks them against the head so that
    /// publishing never silently reverts a newer head change.
    pub unchanged: BTreeMap<Vec<u8>, Change>,
    /// Paths not captured, with the reason, sorted by path: sockets
    /// ([`seal_layer`](crate::seal_layer) removes them from the layer) and, as path
    /// `""`, a mode or owner change of the root directory ([`UpperEdits::root`]).
    pub skipped: Vec<(Vec<u8>, String)>,
    /// Paths left out by the [`ExclusionRules`] (the topmost excluded path of each
    /// excluded subtree), with the pattern that matched, sorted by path.
    #[serde(default)]
    pub excluded: Vec<(Vec<u8>, String)>,
    /// BLAKE3 digest of the non-private xattrs (see the module docs) of every path in
    /// `entries` or `unchanged` that has any.
    #[serde(default)]
    pub xattrs: BTreeMap<Vec<u8>, [u8; 32]>,
    /// Regular files of the upper linked at more than one captured path: path →
    /// inode number. Paths with the same inode are one hardlinked file. Links at
    /// excluded paths do not count (they are removed before publishing).
    #[serde(default)]
    pub hardlinks: BTreeMap<Vec<u8>, u64>,
    /// Edits the upper needs so that a layer renamed from it publishes exactly
    /// this changeset.
    #[serde(default)]
    pub edits: UpperEdits,
}

impl Changeset {
    /// True when there is nothing to publish (`entries` is empty; `unchanged`,
    /// `skipped` and `excluded` do not count).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Content bytes of the regular files written ([`Change::Write`] sizes,
    /// summed; a hardlinked file counts at each of its paths): what the capture
    /// hashed and the layer holds.
    #[must_use]
    pub fn written_bytes(&self) -> u64 {
        self.entries
            .values()
            .map(|c| match c {
                Change::Write { size, .. } => *size,
                _ => 0,
            })
            .sum()
    }

    /// The changed paths, in bytewise order.
    pub fn paths(&self) -> impl Iterator<Item = &[u8]> + '_ {
        self.entries.keys().map(Vec::as_slice)
    }

    /// Adds the `excluded` and `skipped` reports of `earlier`, a capture of the same
    /// upper before [`prepare_upper`](crate::prepare_upper) and
    /// [`seal_layer`](crate::seal_layer) removed those paths (and reset the root
    /// directory): a capture again (an opaque directory expanded) no longer sees
    /// them, but the outcome must still report them. Paths already reported keep
    /// this capture's reason.
    pub fn keep_reports_of(&mut self, earlier: &Changeset) {
        fn merge(now: &mut Vec<(Vec<u8>, String)>, before: &[(Vec<u8>, String)]) {
            let mut all: BTreeMap<Vec<u8>, String> = before.iter().cloned().collect();
            all.extend(now.drain(..));
            *now = all.into_iter().collect();
        }
        merge(&mut self.excluded, &earlier.excluded);
        merge(&mut self.skipped, &earlier.skipped);
    }

    /// Digest of the non-private xattrs at `path`, `None` when it has none.
    #[must_use]
    pub fn xattrs_of(&self, path: &[u8]) -> Option<[u8; 32]> {
        self.xattrs.get(path).copied()
    }
}

/// Knobs for [`capture_with`].
#[derive(Debug, Clone, Default)]
pub struct CaptureOptions {
    /// The upper was written by an overlay mounted with `userxattr` (rootless):
    /// `user.overlay.opaque` = `y` (not `trusted.`) marks an opaque directory, and
    /// `user.overlay.redirect` / `user.overlay.metacopy` are refused too. Pair it
    /// with [`LayerView::with_userxattr`]. It also decides which xattr namespace is
    /// overlay-private (the other one is data).
    pub userxattr: bool,
    /// Paths never published ([`Changeset::excluded`]).
    pub exclude: ExclusionRules,
    /// Opaque upper directories to expand: instead of hiding the lease's whole
    /// directory, they become plain directories with one deletion per lease path
    /// the session does not have (ARCHITECTURE §7, "opaque dir in capture"). An
    /// opaque directory is also expanded when the policy might exclude something
    /// below it, so excluded lease paths stay visible.
    pub expand_opaque: BTreeSet<Vec<u8>>,
    /// A regular file whose size, mode, owner, xattrs and content equal the
    /// lease's is copy-up noise (`unchanged`) even when its mtime differs: a
    /// tool that rewrote it without changing it (`sed -i` matching nothing)
    /// publishes nothing. Default off: an mtime that differs is a change
    /// (`touch`), as the kernel's copy-up keeps the lower file's.
    pub ignore_mtime: bool,
    /// The upper was written by a session with this uid/gid mapping: an
    /// owner in its host range is read as the session's id (`host_uid + u`
    /// is `u`), so that a live session's diff compares the session's ids
    /// with the lease's. An upper whose ids were shifted back already
    /// (before a publish or checkpoint) reads the same.
    pub id_map: Option<layerstack_types::IdMap>,
    /// Most entries (files, directories, links, whiteouts…) an upper may hold;
    /// 0 = unlimited. Counted as the walk goes, so an upper of a million files
    /// is refused after `max_paths + 1` `fstatat(2)`, not after indexing them all
    /// ([`CaptureError::OverLimit`]).
    pub max_paths: u64,
    /// Most bytes the regular files of an upper may hold, by apparent size
    /// (`st_size`: a 100 GiB sparse file counts 100 GiB — capture reads and
    /// hashes every byte of it); 0 = unlimited. Checked at each file's
    /// `fstatat(2)`, before its content is read ([`CaptureError::OverLimit`]).
    pub max_bytes: u64,
}

impl CaptureOptions {
    /// An upper entry's owner as the session sees it ([`CaptureOptions::id_map`]).
    fn seen_ids(&self, uid: u32, gid: u32) -> (u32, u32) {
        match &self.id_map {
            Some(m) => (
                m.uid_from_host(uid).unwrap_or(uid),
                m.gid_from_host(gid).unwrap_or(gid),
            ),
            None => (uid, gid),
        }
    }
}

/// Why [`capture`] failed. Paths are relative to the upper unless stated.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The upper directory itself could not be opened (absolute path; a symlink is refused).
    #[error("cannot open upper directory {}", .path.display())]
    OpenUpper {
        /// The upper directory.
        path: PathBuf,
        /// The `open(2)` error.
        #[source]
        source: io::Error,
    },
    /// Reading an entry of the upper failed.
    #[error("cannot read {} in the upper", .path.display())]
    Upper {
        /// Relative path of the entry.
        path: PathBuf,
        /// The system call error.
        #[source]
        source: io::Error,
    },
    /// Resolving or reading a path in the lower view failed.
    #[error("cannot read {} in the lower layers", .path.display())]
    Lower {
        /// Relative path.
        path: PathBuf,
        /// The system call error.
        #[source]
        source: io::Error,
    },
    /// The upper uses an overlay feature that capture does not interpret.
    #[error("{} carries overlay xattr {xattr}: uppers from redirect_dir or metacopy mounts are not supported", .path.display())]
    Unsupported {
        /// Relative path of the entry.
        path: PathBuf,
        /// The xattr found, e.g. `trusted.overlay.redirect`.
        xattr: &'static str,
    },
    /// The upper holds more than a limit allows ([`CaptureOptions::max_paths`],
    /// [`CaptureOptions::max_bytes`]): nothing more of it was read.
    #[error("the session wrote more than {limit} {unit} (reached at {}): over the capture limit `[capture] max_{unit}` of the daemon's configuration; raise it, or discard the session", .path.display())]
    OverLimit {
        /// `paths` or `bytes`.
        unit: &'static str,
        /// The limit that was passed.
        limit: u64,
        /// The entry at which it was passed (relative to the upper).
        path: PathBuf,
    },
}

/// Captures `upper` against `lower` with default [`CaptureOptions`].
///
/// See [`capture_with`].
///
/// # Errors
/// As [`capture_with`].
pub fn capture(upper: &Path, lower: &LayerView) -> Result<Changeset, CaptureError> {
    capture_with(upper, lower, &CaptureOptions::default())
}

/// Walks the quiescent (unmounted) overlay upperdir `upper` and classifies every
/// entry against `lower`, the lease's view (the session's lowerdirs, newest first).
///
/// * regular file → [`Change::Write`], unless the lease has a regular file there with
///   the same size, mode, uid, gid, xattrs, mtime (unless
///   [`CaptureOptions::ignore_mtime`]) and BLAKE3 digest (copy-up noise →
///   `unchanged`: the kernel's copy-up keeps the mtime, so a file opened for writing
///   but unchanged, or renamed away and back, is noise, while `touch` is a change);
/// * symlink → [`Change::Symlink`], unless identical target, uid, gid and xattrs in
///   the lease;
/// * 0:0 character device → [`Change::Delete`];
/// * directory → [`Change::Mkdir`] when the lease has no directory there or the upper
///   directory is opaque (and not expanded); [`Change::Meta`] when mode/uid/gid/xattrs
///   differ from the lease's directory; otherwise a copy-up parent (`unchanged`).
///   Always walked into; below a new or opaque directory nothing of the lease is
///   visible, so every entry there is a change;
/// * fifo, character or block device → [`Change::Special`], unless identical in the lease;
/// * socket → `skipped`; if it hides a lease path, that path is deleted
///   ([`Change::Delete`] plus a whiteout in [`UpperEdits::whiteouts`]);
/// * a path the policy excludes → `excluded` (and [`UpperEdits::remove`]); nothing
///   below it is looked at.
///
/// Directory timestamps are never compared (mtime-only changes are noise).
/// The upper's root directory itself is not captured: a mode or owner that
/// differs from the lease's root is reported in `skipped` (path `""`) and reset by
/// [`prepare_upper`](crate::prepare_upper) ([`UpperEdits::root`]).
///
/// # Errors
/// [`CaptureError`]: the upper cannot be opened or read, a lower path cannot be
/// resolved, or the upper uses redirect/metacopy xattrs.
pub fn capture_with(
    upper: &Path,
    lower: &LayerView,
    options: &CaptureOptions,
) -> Result<Changeset, CaptureError> {
    let root = fsx::open_dir(upper).map_err(|source| CaptureError::OpenUpper {
        path: upper.to_path_buf(),
        source,
    })?;
    let mut walker = Walker {
        lower,
        options,
        out: Changeset::default(),
        paths: 0,
        bytes: 0,
    };
    walker.root_meta(&root)?;
    walker.walk(root, &[], Some(lower.root()), false)?;
    // A file linked elsewhere only at excluded paths (removed before publishing)
    // is not hardlinked in the layer.
    let mut names: BTreeMap<u64, usize> = BTreeMap::new();
    for ino in walker.out.hardlinks.values() {
        *names.entry(*ino).or_default() += 1;
    }
    walker.out.hardlinks.retain(|_, ino| names[ino] > 1);
    walker.out.skipped.sort();
    walker.out.excluded.sort();
    walker.out.edits.remove.sort();
    walker.out.edits.whiteouts.sort();
    walker.out.edits.unopaque.sort();
    tracing::debug!(
        upper = %upper.display(),
        entries = walker.out.entries.len(),
        unchanged = walker.out.unchanged.len(),
        skipped = walker.out.skipped.len(),
        excluded = walker.out.excluded.len(),
        "captured upper"
    );
    Ok(walker.out)
}

/// Redirected directories (`redirect_dir=on`): content lives elsewhere in the lowers.
const REDIRECT: [&str; 2] = ["trusted.overlay.redirect", "user.overlay.redirect"];
/// Metadata-only copy-ups (`metacopy=on`): the data is still in a lower file.
const METACOPY: [&str; 2] = ["trusted.overlay.metacopy", "user.overlay.metacopy"];

/// True for an xattr name that belongs to the overlay mount itself (its private
/// namespace: `trusted.overlay.` or, with `userxattr`, `user.overlay.`), other than
/// an escaped name (`<ns>.overlay.overlay.*`, which is data).
pub(crate) fn is_overlay_private(name: &[u8], userxattr: bool) -> bool {
    let ns: &[u8] = if userxattr {
        b"user.overlay."
    } else {
        b"trusted.overlay."
    };
    match name.strip_prefix(ns) {
        Some(rest) => !rest.starts_with(b"overlay."),
        None => false,
    }
}

/// Digest of a sorted xattr list without overlay-private names; `None` when empty.
pub(crate) fn xattr_digest(list: &[(Vec<u8>, Vec<u8>)], userxattr: bool) -> Option<[u8; 32]> {
    let kept: Vec<(Vec<u8>, Vec<u8>)> = list
        .iter()
        .filter(|(n, _)| !is_overlay_private(n, userxattr))
        .cloned()
        .collect();
    list_digest(&kept)
}

/// Digest of a sorted xattr list as is; `None` when empty.
pub(crate) fn list_digest(list: &[(Vec<u8>, Vec<u8>)]) -> Option<[u8; 32]> {
    let mut h = blake3::Hasher::new();
    let mut any = false;
    for (name, value) in list {
        any = true;
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name);
        h.update(&(value.len() as u64).to_le_bytes());
        h.update(value);
    }
    any.then(|| *h.finalize().as_bytes())
}

/// An owned descriptor of a regular file, closed on drop (nix 0.29's `openat`
/// returns a raw descriptor; this keeps the crate free of `unsafe`).
pub(crate) struct FileFd(pub(crate) RawFd);

impl Drop for FileFd {
    fn drop(&mut self) {
        let _ = nix::unistd::close(self.0);
    }
}

impl AsRawFd for FileFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

impl FileExt for FileFd {}

impl io::Read for FileFd {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        nix::unistd::read(self.0, buf).map_err(io::Error::from)
    }
}

/// Every xattr readable through `fd`, sorted by name.
pub(crate) fn fd_xattrs(fd: &impl FileExt) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let names = match fd.list_xattr() {
        Ok(n) => n,
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for name in names {
        match fd.get_xattr(&name) {
            Ok(Some(v)) => out.push((name.as_bytes().to_vec(), v)),
            Ok(None) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENODATA) => {}
            Err(e) => return Err(e),
        }
    }
    out.sort();
    Ok(out)
}

struct Walker<'a> {
    lower: &'a LayerView,
    options: &'a CaptureOptions,
    out: Changeset,
    /// Entries of the upper looked at so far ([`CaptureOptions::max_paths`]).
    paths: u64,
    /// Apparent bytes of its regular files so far ([`CaptureOptions::max_bytes`]).
    bytes: u64,
}

impl Walker<'_> {
    /// Counts entry `rel` (stat `st`) against the limits.
    fn count(&mut self, rel: &[u8], st: &nix::sys::stat::FileStat) -> Result<(), CaptureError> {
        self.paths += 1;
        let o = self.options;
        if o.max_paths > 0 && self.paths > o.max_paths {
            return Err(CaptureError::OverLimit {
                unit: "paths",
                limit: o.max_paths,
                path: rel_path(rel),
            });
        }
        if st.st_mode & libc::S_IFMT == libc::S_IFREG {
            self.bytes = self
                .bytes
                .saturating_add(u64::try_from(st.st_size).unwrap_or(0));
            if o.max_bytes > 0 && self.bytes > o.max_bytes {
                return Err(CaptureError::OverLimit {
                    unit: "bytes",
                    limit: o.max_bytes,
                    path: rel_path(rel),
                });
            }
        }
        Ok(())
    }
}

fn rel_path(rel: &[u8]) -> PathBuf {
    PathBuf::from(std::ffi::OsString::from_vec(rel.to_vec()))
}

fn upper_err(rel: &[u8]) -> impl FnOnce(io::Error) -> CaptureError + '_ {
    move |source| CaptureError::Upper {
        path: rel_path(rel),
        source,
    }
}

fn lower_err(rel: &[u8]) -> impl FnOnce(io::Error) -> CaptureError + '_ {
    move |source| CaptureError::Lower {
        path: rel_path(rel),
        source,
    }
}

impl Walker<'_> {
    /// Compares the upper's root directory with the lease's root: a different mode,
    /// owner or set of xattrs is not published (see [`UpperEdits::root`]).
    fn root_meta(&mut self, root: &DirFd) -> Result<(), CaptureError> {
        let Some(lease) = self.lower.lookup(b"").map_err(lower_err(b""))? else {
            return Ok(());
        };
        let userxattr = self.options.userxattr;
        let data = |list: Vec<(Vec<u8>, Vec<u8>)>| -> Vec<(Vec<u8>, Vec<u8>)> {
            strip_opaque(list, userxattr)
                .into_iter()
                .filter(|(n, _)| !is_overlay_private(n, userxattr))
                .collect()
        };
        let st = nix::sys::stat::fstat(root.as_raw_fd()).map_err(|e| upper_err(b"")(e.into()))?;
        let (uid, gid) = self.options.seen_ids(st.st_uid, st.st_gid);
        let mode = st.st_mode & 0o7777;
        let upper_x = data(fd_xattrs(root).map_err(upper_err(b""))?);
        let at = fsx::at(self.lower.layer(lease.layer_index), b"").map_err(lower_err(b""))?;
        let lease_x = data(fsx::xattrs_of(at.path()).map_err(lower_err(b""))?);
        let same_meta = (mode, uid, gid) == (lease.mode, lease.uid, lease.gid);
        if same_meta && upper_x == lease_x {
            return Ok(());
        }
        let mut why = Vec::new();
        if !same_meta {
            why.push(format!(
                "mode/owner {mode:04o} {uid}:{gid} differs from the lease's {:04o} {}:{}",
                lease.mode, lease.uid, lease.gid
            ));
        }
        if upper_x != lease_x {
            let names = |l: &[(Vec<u8>, Vec<u8>)]| -> BTreeMap<Vec<u8>, Vec<u8>> {
                l.iter().cloned().collect()
            };
            let (u, l) = (names(&upper_x), names(&lease_x));
            let changed: Vec<String> = u
                .keys()
                .chain(l.keys())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .filter(|n| u.get(*n) != l.get(*n))
                .map(|n| String::from_utf8_lossy(n).into_owned())
                .collect();
            why.push(format!(
                "xattrs {} differ from the lease's",
                changed.join(", ")
            ));
        }
        self.out
            .skipped
            .push((Vec::new(), format!("root directory {}", why.join("; "))));
        self.out.edits.root = Some(RootMeta {
            mode: lease.mode,
            uid: lease.uid,
            gid: lease.gid,
            xattrs: lease_x,
        });
        Ok(())
    }

    /// Walks the upper directory `dir` at `rel`; `lower` is the lease's merged
    /// directory at the same path, `None` when nothing of the lease shows through.
    /// `expand`: `dir` replaces the lease's directory as an expanded opaque
    /// directory, so every lease name it lacks is deleted explicitly.
    fn walk(
        &mut self,
        mut dir: DirFd,
        rel: &[u8],
        lower: Option<Cursor>,
        expand: bool,
    ) -> Result<(), CaptureError> {
        let mut names = Vec::new();
        for dent in dir.0.iter() {
            let dent = dent.map_err(|e| upper_err(rel)(e.into()))?;
            let name = dent.file_name().to_bytes();
            if name != b"." && name != b".." {
                names.push(name.to_vec());
            }
        }
        names.sort();
        for name in &names {
            let child = join_rel(rel, name);
            if let Some(pattern) = self.options.exclude.excluded_by(&child) {
                let pattern = pattern.to_string();
                self.out.excluded.push((child.clone(), pattern.clone()));
                self.out.edits.remove.push((child, pattern));
                continue;
            }
            let st = nix::sys::stat::fstatat(
                Some(dir.as_raw_fd()),
                name.as_slice(),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .map_err(|e| upper_err(&child)(e.into()))?;
            self.count(&child, &st)?;
            let (lower_entry, lower_dir) = match &lower {
                Some(cursor) => {
                    let step = self.lower.step(cursor, name).map_err(lower_err(&child))?;
                    (step.entry, step.dir)
                }
                None => (None, None),
            };
            self.entry(&dir, name, child, &st, lower_entry, lower_dir, expand)?;
        }
        if expand {
            if let Some(cursor) = &lower {
                let upper_names: BTreeSet<&Vec<u8>> = names.iter().collect();
                for name in self.lower.names(cursor).map_err(lower_err(rel))? {
                    if upper_names.contains(&name) {
                        continue;
                    }
                    let child = join_rel(rel, &name);
                    if self.options.exclude.is_excluded(&child) {
                        // Excluded lease paths stay visible: no whiteout.
                        continue;
                    }
                    self.out.entries.insert(child.clone(), Change::Delete);
                    self.out.edits.whiteouts.push(child);
                }
            }
        }
        Ok(())
    }

    /// The non-private xattrs digest of the lower entry `e` at `rel`.
    fn lower_xattrs(&self, e: &Entry, rel: &[u8]) -> Result<Option<[u8; 32]>, CaptureError> {
        let at = fsx::at(self.lower.layer(e.layer_index), rel).map_err(lower_err(rel))?;
        let list = fsx::xattrs_of(at.path()).map_err(lower_err(rel))?;
        Ok(xattr_digest(&list, self.options.userxattr))
    }

    #[allow(clippy::too_many_arguments)]
    fn entry(
        &mut self,
        dir: &DirFd,
        name: &[u8],
        rel: Vec<u8>,
        st: &FileStat,
        lower: Option<Entry>,
        lower_dir: Option<Cursor>,
        expand: bool,
    ) -> Result<(), CaptureError> {
        let (uid, gid) = self.options.seen_ids(st.st_uid, st.st_gid);
        let mode = st.st_mode & 0o7777;
        let rdev = st.st_rdev;
        let userxattr = self.options.userxattr;
        if is_whiteout(st.st_mode, rdev) {
            self.out.entries.insert(rel, Change::Delete);
            return Ok(());
        }
        let Some(kind) = FileKind::from_mode(st.st_mode) else {
            self.out.skipped.push((rel, "unknown file type".into()));
            return Ok(());
        };
        let same_meta =
            |e: &Entry| e.kind == kind && e.mode == mode && e.uid == uid && e.gid == gid;
        match kind {
            FileKind::Dir => {
                let sub = fsx::open_dir_at(dir, name).map_err(upper_err(&rel))?;
                self.refuse(&sub, &rel, REDIRECT)?;
                let xattrs = xattr_digest(
                    &strip_opaque(fd_xattrs(&sub).map_err(upper_err(&rel))?, userxattr),
                    userxattr,
                );
                let opaque_xattr = self.is_opaque(&sub, &rel)?;
                let lease_dir = lower.filter(|e| e.kind == FileKind::Dir);
                // An opaque directory is expanded (made plain, with explicit
                // deletions) when asked to, when its parent is being expanded, or
                // when the policy may exclude something below it.
                let expand_here = opaque_xattr
                    && (expand
                        || self.options.expand_opaque.contains(&rel)
                        || self.options.exclude.may_match_below(&rel));
                let opaque = opaque_xattr && !expand_here;
                if expand_here {
                    self.out.edits.unopaque.push(rel.clone());
                }
                if let Some(x) = xattrs {
                    self.out.xattrs.insert(rel.clone(), x);
                }
                // Below an expanded directory, the lease's content must be deleted
                // name by name: that holds for every directory under it too.
                let expand_below = (expand || expand_here) && lease_dir.is_some();
                let change = match lease_dir {
                    Some(e) if !opaque => {
                        let same = same_meta(&e) && self.lower_dir_xattrs(&e, &rel)? == xattrs;
                        if same {
                            let parent = Change::Meta { mode, uid, gid };
                            self.out.unchanged.insert(rel.clone(), parent);
                            return self.walk(sub, &rel, lower_dir, expand_below);
                        }
                        Change::Meta { mode, uid, gid }
                    }
                    _ => Change::Mkdir {
                        mode,
                        uid,
                        gid,
                        opaque,
                    },
                };
                let below = if opaque { None } else { lower_dir };
                self.out.entries.insert(rel.clone(), change);
                self.walk(sub, &rel, below, expand_below)
            }
            FileKind::Regular => {
                let flags =
                    OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NOCTTY;
                let fd = nix::fcntl::openat(Some(dir.as_raw_fd()), name, flags, Mode::empty())
                    .map(FileFd)
                    .map_err(|e| upper_err(&rel)(e.into()))?;
                self.refuse(&fd, &rel, METACOPY)?;
                let xattrs = xattr_digest(&fd_xattrs(&fd).map_err(upper_err(&rel))?, userxattr);
                if st.st_nlink > 1 {
                    self.out.hardlinks.insert(rel.clone(), st.st_ino);
                }
                let size = u64::try_from(st.st_size).unwrap_or(0);
                let digest = hash(fd).map_err(upper_err(&rel))?;
                // The kernel's copy-up keeps the lower file's mtime, so an mtime
                // that differs is the session's doing (`touch`): a change.
                let mtime = (st.st_mtime, st.st_mtime_nsec);
                let noise = match lower {
                    Some(e)
                        if same_meta(&e)
                            && e.size == size
                            && (self.options.ignore_mtime || e.mtime == mtime) =>
                    {
                        let layer = self.lower.layer(e.layer_index);
                        let f = fsx::open_read(layer, &rel).map_err(lower_err(&rel))?;
                        hash(f).map_err(lower_err(&rel))? == digest
                            && self.lower_xattrs(&e, &rel)? == xattrs
                    }
                    _ => false,
                };
                let change = Change::Write {
                    mode,
                    uid,
                    gid,
                    size,
                    digest,
                };
                self.record(rel, change, noise, xattrs);
                Ok(())
            }
            FileKind::Symlink => {
                let target = nix::fcntl::readlinkat(Some(dir.as_raw_fd()), name)
                    .map_err(|e| upper_err(&rel)(e.into()))?
                    .into_vec();
                let list = fsx::xattrs_of(&fsx::proc_path(dir, name)).map_err(upper_err(&rel))?;
                let xattrs = xattr_digest(&list, userxattr);
                let noise = match lower {
                    Some(e) if e.kind == kind && e.uid == uid && e.gid == gid => {
                        let layer = self.lower.layer(e.layer_index);
                        let lower_target = fsx::read_link(layer, &rel).map_err(lower_err(&rel))?;
                        lower_target == target && self.lower_xattrs(&e, &rel)? == xattrs
                    }
                    _ => false,
                };
                self.record(rel, Change::Symlink { target, uid, gid }, noise, xattrs);
                Ok(())
            }
            FileKind::Fifo | FileKind::CharDev | FileKind::BlockDev => {
                let list = fsx::xattrs_of(&fsx::proc_path(dir, name)).map_err(upper_err(&rel))?;
                let xattrs = xattr_digest(&list, userxattr);
                let noise = match lower {
                    Some(e) if same_meta(&e) && e.rdev == rdev => {
                        self.lower_xattrs(&e, &rel)? == xattrs
                    }
                    _ => false,
                };
                let change = Change::Special {
                    kind,
                    mode,
                    uid,
                    gid,
                    rdev,
                };
                self.record(rel, change, noise, xattrs);
                Ok(())
            }
            FileKind::Socket => {
                if lower.is_some() {
                    // The socket hides a lease path: publishing it as a deletion keeps
                    // the session's view (the socket itself is never published).
                    self.out.entries.insert(rel.clone(), Change::Delete);
                    self.out.edits.whiteouts.push(rel.clone());
                }
                self.out.skipped.push((rel, "socket".into()));
                Ok(())
            }
        }
    }

    /// The xattr digest of a lease directory, without its opaque marker.
    fn lower_dir_xattrs(&self, e: &Entry, rel: &[u8]) -> Result<Option<[u8; 32]>, CaptureError> {
        let at = fsx::at(self.lower.layer(e.layer_index), rel).map_err(lower_err(rel))?;
        let list = fsx::xattrs_of(at.path()).map_err(lower_err(rel))?;
        let userxattr = self.options.userxattr;
        Ok(xattr_digest(&strip_opaque(list, userxattr), userxattr))
    }

    fn record(&mut self, rel: Vec<u8>, change: Change, noise: bool, xattrs: Option<[u8; 32]>) {
        if let Some(x) = xattrs {
            self.out.xattrs.insert(rel.clone(), x);
        }
        if noise {
            self.out.unchanged.insert(rel, change);
        } else {
            self.out.entries.insert(rel, change);
        }
    }

    /// The directory carries the opaque marker of the mount's namespace, `y`.
    fn is_opaque(&self, dir: &DirFd, rel: &[u8]) -> Result<bool, CaptureError> {
        opaque_value(dir.get_xattr(opaque_name(self.options.userxattr))).map_err(upper_err(rel))
    }

    /// Fails when `fd` carries the trusted xattr of `names` (or the user one too
    /// with `userxattr`).
    fn refuse(
        &self,
        fd: &impl FileExt,
        rel: &[u8],
        names: [&'static str; 2],
    ) -> Result<(), CaptureError> {
        let checked = if self.options.userxattr {
            &names[..]
        } else {
            &names[..1]
        };
        for &xattr in checked {
            let present = match fd.get_xattr(xattr) {
                Ok(v) => v.is_some(),
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => false,
                Err(e) => return Err(upper_err(rel)(e)),
            };
            if present {
                return Err(CaptureError::Unsupported {
                    path: rel_path(rel),
                    xattr,
                });
            }
        }
        Ok(())
    }
}

/// Drops the opaque marker of the mount's namespace from a directory's xattr list
/// (opacity is compared on its own); the other namespace's is data and stays.
fn strip_opaque(mut list: Vec<(Vec<u8>, Vec<u8>)>, userxattr: bool) -> Vec<(Vec<u8>, Vec<u8>)> {
    let opaque = opaque_name(userxattr).as_bytes();
    list.retain(|(n, _)| n != opaque);
    list
}

/// BLAKE3 of everything readable from `reader` (the path index's content digest).
///
/// # Errors
/// Any read error.
pub fn hash(mut reader: impl io::Read) -> io::Result<[u8; 32]> {
    let mut hasher = blake3::Hasher::new();
    hasher.update_reader(&mut reader)?;
    Ok(*hasher.finalize().as_bytes())
}

/// The BLAKE3 digest of a byte string (file contents, symlink targets,
/// special-file identities): the path index's content digest.
#[must_use]
pub fn digest_bytes(bytes: &[u8]) -> [u8; 32] {
    *blake3::hash(bytes).as_bytes()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::view::{TRUSTED_OPAQUE, USER_OPAQUE};

    struct Fixture {
        _t: tempfile::TempDir,
        lower: PathBuf,
        upper: PathBuf,
    }

    fn fixture() -> Fixture {
        let t = tmp();
        let (lower, upper) = (t.path().join("lower"), t.path().join("upper"));
        std::fs::create_dir(&lower).unwrap();
        std::fs::create_dir(&upper).unwrap();
        Fixture {
            _t: t,
            lower,
            upper,
        }
    }

    impl Fixture {
        fn capture(&self) -> Changeset {
            capture(&self.upper, &LayerView::new(vec![self.lower.clone()])).unwrap()
        }
    }

    fn digest(b: &[u8]) -> [u8; 32] {
        *blake3::hash(b).as_bytes()
    }

    fn keys(m: &BTreeMap<Vec<u8>, Change>) -> Vec<String> {
        m.keys()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .collect()
    }

    fn uid() -> u32 {
        nix::unistd::geteuid().as_raw()
    }

    fn gid() -> u32 {
        nix::unistd::getegid().as_raw()
    }

    #[test]
    fn new_and_modified_files_are_writes() {
        let f = fixture();
        write(&f.lower, "mod", b"old", 0o644);
        write(&f.lower, "keep", b"k", 0o644);
        write(&f.upper, "mod", b"new content", 0o644);
        write(&f.upper, "new", b"fresh", 0o600);
        let c = f.capture();
        assert_eq!(keys(&c.entries), ["mod", "new"]);
        let (u, g) = (uid(), gid());
        assert_eq!(
            c.entries[&b"mod".to_vec()],
            Change::Write {
                mode: 0o644,
                uid: u,
                gid: g,
                size: 11,
                digest: digest(b"new content")
            }
        );
        assert_eq!(
            c.entries[&b"new".to_vec()],
            Change::Write {
                mode: 0o600,
                uid: u,
                gid: g,
                size: 5,
                digest: digest(b"fresh")
            }
        );
        assert!(c.unchanged.is_empty() && c.skipped.is_empty());
        assert!(!c.is_empty());
        assert_eq!(c.paths().collect::<Vec<_>>(), [&b"mod"[..], b"new"]);
    }

    #[test]
    fn copy_up_noise_is_dropped() {
        let f = fixture();
        write(&f.lower, "d/same", b"identical", 0o644);
        write(&f.lower, "d/samesize", b"aaaa", 0o644);
        write(&f.lower, "d/chmod", b"c", 0o644);
        // Same content and metadata (e.g. after `touch`): noise.
        write(&f.upper, "d/same", b"identical", 0o644);
        copy_mtime(&f.lower, &f.upper, b"d/same");
        // Same size, other bytes: a real write.
        write(&f.upper, "d/samesize", b"bbbb", 0o644);
        // Same content, other mode: a real write.
        write(&f.upper, "d/chmod", b"c", 0o755);
        std::fs::set_permissions(
            f.lower.join("d"),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        std::fs::set_permissions(
            f.upper.join("d"),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let c = f.capture();
        assert_eq!(keys(&c.entries), ["d/chmod", "d/samesize"]);
        assert_eq!(
            keys(&c.unchanged),
            ["d", "d/same"],
            "copy-up parent and identical file"
        );
        assert_eq!(
            c.unchanged[&b"d".to_vec()],
            Change::Meta {
                mode: 0o755,
                uid: uid(),
                gid: gid()
            }
        );
    }

    /// `touch` (or `sed -i` matching nothing) moves only the mtime: a change by
    /// default, noise with `ignore_mtime`; a content change is a change either way.
    #[test]
    fn an_mtime_only_change_is_noise_only_when_asked() {
        let f = fixture();
        write(&f.lower, "same", b"x", 0o644);
        write(&f.upper, "same", b"x", 0o644);
        write(&f.lower, "edited", b"x", 0o644);
        write(&f.upper, "edited", b"y", 0o644);
        copy_mtime(&f.lower, &f.upper, b"edited");
        let later = nix::sys::time::TimeSpec::new(2_000_000_000, 0);
        nix::sys::stat::utimensat(
            None,
            &f.upper.join("same"),
            &later,
            &later,
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        )
        .unwrap();
        let lower = LayerView::new(vec![f.lower.clone()]);
        let c = capture_with(&f.upper, &lower, &CaptureOptions::default()).unwrap();
        assert_eq!(
            keys(&c.entries),
            ["edited", "same"],
            "by default an mtime is a change"
        );
        let c = capture_with(
            &f.upper,
            &lower,
            &CaptureOptions {
                ignore_mtime: true,
                ..CaptureOptions::default()
            },
        )
        .unwrap();
        assert_eq!(keys(&c.entries), ["edited"], "content changes stay changes");
        assert_eq!(keys(&c.unchanged), ["same"]);
    }

    #[test]
    fn only_noise_is_an_empty_changeset() {
        let f = fixture();
        write(&f.lower, "a", b"x", 0o644);
        write(&f.upper, "a", b"x", 0o644);
        copy_mtime(&f.lower, &f.upper, b"a");
        let c = f.capture();
        assert!(c.is_empty());
        assert_eq!(keys(&c.unchanged), ["a"]);
    }

    #[test]
    fn whiteout_is_a_delete() {
        if !have_root("whiteout_is_a_delete") {
            return;
        }
        let f = fixture();
        write(&f.lower, "gone", b"x", 0o644);
        write(&f.lower, "dir/child", b"x", 0o644);
        whiteout(&f.upper, "gone");
        whiteout(&f.upper, "dir");
        whiteout(&f.upper, "never_in_lower");
        let c = f.capture();
        assert_eq!(keys(&c.entries), ["dir", "gone", "never_in_lower"]);
        assert!(c.entries.values().all(|ch| *ch == Change::Delete));
        assert_eq!(c.entries[&b"dir".to_vec()].file_kind(), None);
    }

    #[test]
    fn char_device_that_is_not_a_whiteout_is_special() {
        if !have_root("char_device_that_is_not_a_whiteout_is_special") {
            return;
        }
        let f = fixture();
        let path = f.upper.join("null");
        let dev = nix::sys::stat::makedev(1, 3);
        nix::sys::stat::mknod(
            &path,
            nix::sys::stat::SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            dev,
        )
        .unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o666))
            .unwrap();
        let c = f.capture();
        assert_eq!(
            c.entries[&b"null".to_vec()],
            Change::Special {
                kind: FileKind::CharDev,
                mode: 0o666,
                uid: 0,
                gid: 0,
                rdev: dev
            }
        );
    }

    fn opaque_dir(userxattr: bool) {
        let f = fixture();
        write(&f.lower, "o/f", b"same", 0o644);
        write(&f.lower, "o/old", b"x", 0o644);
        mkdir(&f.lower, "o", 0o755);
        write(&f.upper, "o/f", b"same", 0o644);
        copy_mtime(&f.lower, &f.upper, b"o/f");
        mkdir(&f.upper, "o", 0o755);
        let name = if userxattr {
            USER_OPAQUE
        } else {
            TRUSTED_OPAQUE
        };
        xattr::set(f.upper.join("o"), name, b"y").unwrap();
        let lower = LayerView::new(vec![f.lower.clone()]).with_userxattr(userxattr);
        let c = capture_with(
            &f.upper,
            &lower,
            &CaptureOptions {
                userxattr,
                ..CaptureOptions::default()
            },
        )
        .unwrap();
        assert_eq!(
            c.entries[&b"o".to_vec()],
            Change::Mkdir {
                mode: 0o755,
                uid: uid(),
                gid: gid(),
                opaque: true
            }
        );
        // Below an opaque directory nothing of the lease shows: o/f is a change.
        assert!(matches!(c.entries[&b"o/f".to_vec()], Change::Write { .. }));
        assert_eq!(keys(&c.entries), ["o", "o/f"]);
        assert!(c.unchanged.is_empty());
        if userxattr {
            // Without the option user.overlay.opaque is not the mount's marker but
            // ordinary data: o is not opaque, and its xattrs changed (a Meta).
            let c = capture(&f.upper, &LayerView::new(vec![f.lower.clone()])).unwrap();
            assert_eq!(keys(&c.entries), ["o"]);
            assert_eq!(
                c.entries[&b"o".to_vec()],
                Change::Meta {
                    mode: 0o755,
                    uid: uid(),
                    gid: gid()
                }
            );
            assert!(c.xattrs.contains_key(b"o".as_slice()));
            assert_eq!(keys(&c.unchanged), ["o/f"]);
        }
    }

    #[test]
    fn opaque_dir_trusted_xattr() {
        if have_root("opaque_dir_trusted_xattr") {
            opaque_dir(false);
        }
    }

    #[test]
    fn opaque_dir_user_xattr() {
        opaque_dir(true);
    }

    #[test]
    fn opaque_value_must_be_exactly_y() {
        let f = fixture();
        mkdir(&f.lower, "o", 0o755);
        mkdir(&f.upper, "o", 0o755);
        xattr::set(f.upper.join("o"), USER_OPAQUE, b"yes").unwrap();
        let lower = LayerView::new(vec![f.lower.clone()]).with_userxattr(true);
        let c = capture_with(
            &f.upper,
            &lower,
            &CaptureOptions {
                userxattr: true,
                ..CaptureOptions::default()
            },
        )
        .unwrap();
        assert!(c.entries.is_empty());
        assert_eq!(keys(&c.unchanged), ["o"]);
    }

    #[test]
    fn symlinks_are_verbatim_and_never_followed() {
        let f = fixture();
        symlink(&f.upper, "dangling", b"no/such/thing");
        symlink(&f.upper, "abs", b"/etc/passwd");
        symlink(&f.upper, "escape", b"/etc");
        symlink(&f.upper, "bytes", b"caf\xe9");
        symlink(&f.lower, "same", b"t");
        symlink(&f.upper, "same", b"t");
        symlink(&f.lower, "retarget", b"old");
        symlink(&f.upper, "retarget", b"new");
        let c = f.capture();
        let link = |t: &[u8]| Change::Symlink {
            target: t.to_vec(),
            uid: uid(),
            gid: gid(),
        };
        assert_eq!(
            keys(&c.entries),
            ["abs", "bytes", "dangling", "escape", "retarget"]
        );
        assert_eq!(c.entries[&b"dangling".to_vec()], link(b"no/such/thing"));
        assert_eq!(c.entries[&b"abs".to_vec()], link(b"/etc/passwd"));
        assert_eq!(c.entries[&b"escape".to_vec()], link(b"/etc"));
        assert_eq!(c.entries[&b"bytes".to_vec()], link(b"caf\xe9"));
        assert_eq!(c.entries[&b"retarget".to_vec()], link(b"new"));
        assert_eq!(keys(&c.unchanged), ["same"]);
    }

    #[test]
    fn directories_new_meta_and_copy_up_parents() {
        let f = fixture();
        mkdir(&f.lower, "chmodded", 0o755);
        mkdir(&f.lower, "parent", 0o755);
        write(&f.lower, "was_file", b"x", 0o644);
        mkdir(&f.upper, "chmodded", 0o700);
        write(&f.upper, "parent/new", b"n", 0o644);
        mkdir(&f.upper, "parent", 0o755);
        write(&f.upper, "fresh/x", b"x", 0o644);
        mkdir(&f.upper, "fresh", 0o750);
        mkdir(&f.upper, "was_file", 0o755);
        let c = f.capture();
        let (u, g) = (uid(), gid());
        assert_eq!(
            keys(&c.entries),
            ["chmodded", "fresh", "fresh/x", "parent/new", "was_file"]
        );
        assert_eq!(
            c.entries[&b"chmodded".to_vec()],
            Change::Meta {
                mode: 0o700,
                uid: u,
                gid: g
            }
        );
        assert_eq!(
            c.entries[&b"fresh".to_vec()],
            Change::Mkdir {
                mode: 0o750,
                uid: u,
                gid: g,
                opaque: false
            }
        );
        assert_eq!(
            c.entries[&b"was_file".to_vec()],
            Change::Mkdir {
                mode: 0o755,
                uid: u,
                gid: g,
                opaque: false
            }
        );
        assert_eq!(keys(&c.unchanged), ["parent"]);
    }

    #[test]
    fn directory_owner_change_is_meta() {
        if !have_root("directory_owner_change_is_meta") {
            return;
        }
        let f = fixture();
        mkdir(&f.lower, "d", 0o755);
        mkdir(&f.upper, "d", 0o755);
        std::os::unix::fs::lchown(f.upper.join("d"), Some(1000), Some(1001)).unwrap();
        write(&f.lower, "file", b"x", 0o644);
        write(&f.upper, "file", b"x", 0o644);
        std::os::unix::fs::lchown(f.upper.join("file"), Some(7), None).unwrap();
        let c = f.capture();
        assert_eq!(
            c.entries[&b"d".to_vec()],
            Change::Meta {
                mode: 0o755,
                uid: 1000,
                gid: 1001
            }
        );
        assert!(
            matches!(c.entries[&b"file".to_vec()], Change::Write { uid: 7, .. }),
            "chown-only is a write"
        );
    }

    #[test]
    fn fifo_is_special_and_never_opened() {
        let f = fixture();
        fifo(&f.upper, "pipe", 0o640);
        fifo(&f.lower, "same", 0o600);
        fifo(&f.upper, "same", 0o600);
        // Opening a fifo without a writer would block: finishing proves it was not opened.
        let c = f.capture();
        assert_eq!(keys(&c.entries), ["pipe"]);
        assert_eq!(
            c.entries[&b"pipe".to_vec()],
            Change::Special {
                kind: FileKind::Fifo,
                mode: 0o640,
                uid: uid(),
                gid: gid(),
                rdev: 0
            }
        );
        assert_eq!(keys(&c.unchanged), ["same"]);
    }

    #[test]
    fn sockets_are_skipped() {
        let f = fixture();
        socket(&f.upper, "run/app.sock");
        write(&f.upper, "run/pid", b"1", 0o644);
        let c = f.capture();
        assert_eq!(keys(&c.entries), ["run", "run/pid"]);
        assert_eq!(
            c.skipped,
            vec![(b"run/app.sock".to_vec(), "socket".to_string())]
        );
    }

    #[test]
    fn non_utf8_names_are_byte_exact() {
        let f = fixture();
        write_bytes(&f.upper, b"d\xff/caf\xe9", b"x", 0o644);
        write_bytes(&f.lower, b"lat\xedn1", b"y", 0o644);
        write_bytes(&f.upper, b"lat\xedn1", b"y", 0o644);
        copy_mtime(&f.lower, &f.upper, b"lat\xedn1");
        let c = f.capture();
        assert_eq!(
            c.entries.keys().cloned().collect::<Vec<_>>(),
            vec![b"d\xff".to_vec(), b"d\xff/caf\xe9".to_vec()]
        );
        assert_eq!(
            c.unchanged.keys().cloned().collect::<Vec<_>>(),
            vec![b"lat\xedn1".to_vec()]
        );
    }

    #[test]
    fn lower_stack_is_respected() {
        let t = tmp();
        let (l0, l1, up) = (
            t.path().join("l0"),
            t.path().join("l1"),
            t.path().join("up"),
        );
        write(&l1, "f", b"base", 0o644);
        write(&l0, "f", b"published", 0o644);
        write(&up, "f", b"published", 0o644);
        copy_mtime(&l0, &up, b"f");
        let c = capture(&up, &LayerView::new(vec![l0.clone(), l1.clone()])).unwrap();
        assert!(c.entries.is_empty(), "identical to the newest layer");
        let c = capture(&up, &LayerView::new(vec![l1])).unwrap();
        assert_eq!(
            keys(&c.entries),
            ["f"],
            "differs from the older layer alone"
        );
    }

    #[test]
    fn redirect_and_metacopy_are_refused() {
        let f = fixture();
        write(&f.upper, "d/f", b"x", 0o644);
        xattr::set(f.upper.join("d/f"), "user.overlay.metacopy", b"").unwrap();
        let lower = LayerView::new(vec![f.lower.clone()]).with_userxattr(true);
        let err = capture_with(
            &f.upper,
            &lower,
            &CaptureOptions {
                userxattr: true,
                ..CaptureOptions::default()
            },
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                CaptureError::Unsupported {
                    xattr: "user.overlay.metacopy",
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(err.to_string(), "d/f carries overlay xattr user.overlay.metacopy: uppers from redirect_dir or metacopy mounts are not supported");
        xattr::remove(f.upper.join("d/f"), "user.overlay.metacopy").unwrap();
        xattr::set(f.upper.join("d"), "user.overlay.redirect", b"/x").unwrap();
        let err = capture_with(
            &f.upper,
            &lower,
            &CaptureOptions {
                userxattr: true,
                ..CaptureOptions::default()
            },
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                CaptureError::Unsupported {
                    xattr: "user.overlay.redirect",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn links_at_excluded_paths_do_not_count() {
        let f = fixture();
        write(&f.lower, "etc/conf", b"x", 0o644);
        write(&f.upper, "etc/conf", b"edited", 0o644);
        std::fs::create_dir_all(f.upper.join("tmp")).unwrap();
        std::fs::hard_link(f.upper.join("etc/conf"), f.upper.join("tmp/backup")).unwrap();
        let lower = LayerView::new(vec![f.lower.clone()]);
        let options = CaptureOptions {
            exclude: ExclusionRules::new(["/tmp/**"]).unwrap(),
            ..CaptureOptions::default()
        };
        let c = capture_with(&f.upper, &lower, &options).unwrap();
        assert_eq!(keys(&c.entries), ["etc/conf", "tmp"]);
        assert!(
            c.hardlinks.is_empty(),
            "the other name is excluded (removed before publishing): {:?}",
            c.hardlinks
        );
        // Without the exclusion both names are one hardlinked file.
        let c = f.capture();
        assert_eq!(c.hardlinks.len(), 2);
        // Another published name keeps the link, whatever is excluded.
        std::fs::hard_link(f.upper.join("etc/conf"), f.upper.join("etc/conf2")).unwrap();
        let c = capture_with(&f.upper, &lower, &options).unwrap();
        assert_eq!(
            c.hardlinks.keys().cloned().collect::<Vec<_>>(),
            names(&["etc/conf", "etc/conf2"])
        );
    }

    #[test]
    fn root_directory_xattrs_are_reported_and_reset_never_published() {
        let f = fixture();
        xattr::set(&f.lower, "user.kept", b"lease").unwrap();
        xattr::set(&f.lower, "user.dropped", b"1").unwrap();
        xattr::set(&f.upper, "user.kept", b"session").unwrap();
        xattr::set(&f.upper, "user.added", b"2").unwrap();
        // An overlay-private name on the upper root (as the kernel may leave) is
        // neither compared nor touched.
        let private = if nix::unistd::geteuid().is_root() {
            xattr::set(&f.upper, "trusted.overlay.impure", b"y").unwrap();
            true
        } else {
            false
        };
        let c = f.capture();
        assert!(c.entries.is_empty(), "{:?}", c.entries);
        assert_eq!(c.skipped.len(), 1);
        assert_eq!(
            c.skipped[0].1,
            "root directory xattrs user.added, user.dropped, user.kept differ from the lease's"
        );
        let root = c.edits.root.clone().unwrap();
        assert_eq!(
            root.xattrs,
            [
                (b"user.dropped".to_vec(), b"1".to_vec()),
                (b"user.kept".to_vec(), b"lease".to_vec())
            ]
        );
        crate::layer::prepare_upper(&f.upper, &c, false).unwrap();
        let mut got: Vec<(Vec<u8>, Vec<u8>)> = crate::fsx::xattrs_of(&f.upper).unwrap();
        if private {
            assert!(got.contains(&(b"trusted.overlay.impure".to_vec(), b"y".to_vec())));
            got.retain(|(n, _)| !n.starts_with(b"trusted."));
        }
        assert_eq!(got, root.xattrs);
        let c = f.capture();
        assert!(
            c.skipped.is_empty() && c.edits.root.is_none(),
            "{:?}",
            c.skipped
        );
    }

    #[test]
    fn root_directory_metadata_is_reported_and_reset_never_published() {
        let f = fixture();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&f.lower, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&f.upper, std::fs::Permissions::from_mode(0o700)).unwrap();
        write(&f.upper, "new", b"n", 0o644);
        let c = f.capture();
        assert_eq!(keys(&c.entries), ["new"], "the root is not a path");
        assert_eq!(c.skipped.len(), 1);
        assert_eq!(c.skipped[0].0, b"");
        assert!(
            c.skipped[0].1.contains("root directory mode/owner 0700"),
            "{}",
            c.skipped[0].1
        );
        let root = RootMeta {
            mode: 0o755,
            uid: uid(),
            gid: gid(),
            xattrs: Vec::new(),
        };
        assert_eq!(c.edits.root, Some(root));
        assert!(!c.edits.is_empty());
        crate::layer::prepare_upper(&f.upper, &c, false).unwrap();
        let md = std::fs::metadata(&f.upper).unwrap();
        assert_eq!(md.permissions().mode() & 0o7777, 0o755);
        // Once reset, nothing is left to report.
        let c = f.capture();
        assert!(c.skipped.is_empty() && c.edits.root.is_none());
        // A capture again keeps the first pass's reports.
        let mut again = f.capture();
        let mut first = Changeset::default();
        first.skipped.push((Vec::new(), "root".into()));
        first.excluded.push((b"tmp/x".to_vec(), "/tmp/**".into()));
        again.skipped.push((b"s.sock".to_vec(), "socket".into()));
        again.keep_reports_of(&first);
        assert_eq!(
            again.skipped,
            [
                (Vec::new(), "root".to_string()),
                (b"s.sock".to_vec(), "socket".to_string())
            ]
        );
        assert_eq!(again.excluded, first.excluded);
    }

    #[test]
    fn upper_must_be_a_real_directory() {
        let f = fixture();
        let link = f.lower.parent().unwrap().join("upper-link");
        std::os::unix::fs::symlink(&f.upper, &link).unwrap();
        let err = capture(&link, &LayerView::new(vec![])).unwrap_err();
        assert!(matches!(err, CaptureError::OpenUpper { .. }), "{err}");
        let err = capture(&f.lower.join("missing"), &LayerView::new(vec![])).unwrap_err();
        assert!(matches!(err, CaptureError::OpenUpper { .. }), "{err}");
    }
}
