//! The staged tree of an import: every write beneath the staging root, with
//! the OCI layer semantics of applying one layer over the ones before it.
//!
//! Paths are relative byte strings already checked by [`normalize`] (no
//! leading `/`, no `.`, `..` or empty component, no NUL). Every entry is
//! created by name in its parent directory, which is opened beneath the root
//! with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` ([`fsx::Parent`]) or,
//! where a parent must be made, one component at a time with
//! `openat(O_DIRECTORY | O_NOFOLLOW)`: a symlink an earlier entry planted is
//! never followed, so nothing is written outside the root. A path whose parent
//! is (or passes through) a symlink or a non-directory is refused.
//!
//! Layer semantics (OCI image-spec `layer.md`, "Applying Changesets" and
//! "Whiteouts"), for layer *k* applied over the result of layers < *k*:
//! * an entry replaces what is at its path, except that a directory over a
//!   directory keeps what the directory holds (its metadata is the entry's);
//! * a whiteout `.wh.<name>` removes `<name>` of the layers below; an opaque
//!   marker `.wh..wh..opq` removes everything its directory held from the
//!   layers below. What layer *k* itself wrote stays, whatever the order of
//!   its entries ("files present in the same layer as a whiteout file can only
//!   be hidden by whiteout files in subsequent layers"): the paths a layer
//!   wrote, and the directories above them, are remembered until the next
//!   layer starts ([`Stage::next_layer`]).
//!
//! **Overlay mode** ([`Stage::overlay`], for a layer pulled from a registry:
//! [`crate::apply_layer_tar`]): one layer tar applied onto an empty directory
//! and kept in overlay upper format — exactly what the kernel's overlayfs and
//! the capture write, so the directory can be a lower layer of a mount as it
//! is — instead of flattened: a whiteout `.wh.<name>` becomes a 0:0 character
//! device `<name>` (mode 0, as overlayfs makes one; owner and mtime of the
//! `.wh.` entry), an opaque marker `.wh..wh..opq` the opaque xattr of its
//! directory (`trusted.overlay.opaque=y`, `user.overlay.opaque=y` with
//! `userxattr`; set by [`Stage::finish`], so a directory entry after its
//! marker does not clear it); nothing is pruned (there is nothing below).
//! A whiteout of a directory this layer made, or a directory entry that
//! replaces a whiteout, makes that directory opaque (OCI: what the layer itself
//! writes stays; the layers below are hidden). An opaque marker at the root is
//! refused: overlayfs reads no opacity of a layer's root.
//!
//! Metadata: mode (with setuid, setgid, sticky), numeric owner, xattrs (never
//! an overlayfs-private one: refused, a base has no whiteouts nor opaque
//! directories) and mtime in whole seconds. Owner before mode (`chown` clears
//! setuid bits), xattrs after both (`chown` clears `security.capability`).
//! Directory mtimes change as entries are made in them, so they are kept aside
//! and set last ([`Stage::finish`]); a directory made only because an entry
//! lies below it gets mtime 0. The root is 0755, owner 0:0, mtime 0, no xattrs.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{
    self as rfs, AtFlags, FileType, Gid, Mode, OFlags, Timespec, Timestamps, Uid, XattrFlags,
};
use rustix::io::Errno;

use crate::capture::is_overlay_private;
use crate::fsx::{self, Parent};

use super::ImportReport;

/// Why a staged write failed: a refusal (the input is at fault) or an i/o
/// error on the staging side.
#[derive(Debug)]
pub(crate) enum StageError {
    /// The entry is refused; the reason says why and what to do.
    Refused(String),
    /// A system call on the staged tree failed.
    Io(&'static str, io::Error),
    /// Reading an entry's content from the input failed (a truncated or
    /// corrupt archive): the input is at fault, not the staging side.
    Read(io::Error),
}

impl From<Errno> for StageError {
    fn from(e: Errno) -> Self {
        StageError::Io("write", e.into())
    }
}

type R<T> = Result<T, StageError>;

fn io_err(what: &'static str) -> impl FnOnce(Errno) -> StageError {
    move |e| StageError::Io(what, e.into())
}

/// [`io_err`] for a step on a name the stage just cleared (made room at,
/// or found a non-directory at): `EEXIST` or `EISDIR` there means someone
/// else changed the tree meanwhile — a live session's processes during an
/// upload — and the entry is refused, naming it.
fn raced_err<'a>(what: &'static str, rel: &'a [u8]) -> impl FnOnce(Errno) -> StageError + 'a {
    move |e| match e {
        Errno::EXIST | Errno::ISDIR => StageError::Refused(format!(
            "{} was changed by someone else while it was being made ({what}: {e})",
            show(rel)
        )),
        e => StageError::Io(what, e.into()),
    }
}

/// A failed set of xattr `name` (`len` bytes of value) on `fd`'s filesystem.
/// A value too large for it is the input's fault, refused by name: over 64
/// KiB (`E2BIG`), or more than the filesystem keeps per inode (`ENOSPC` on
/// ext4 past ~4 KiB) while it has free space. Anything else is the staging
/// side's.
fn xattr_err(fd: &impl AsFd, name: &[u8], len: usize, e: Errno) -> StageError {
    let has_room = || {
        rfs::fstatvfs(fd)
            .map(|s| s.f_bavail.saturating_mul(s.f_frsize) > 16 << 20)
            .unwrap_or(false)
    };
    // `system.*` names are the filesystem's own (ACLs, …): one it does not
    // implement is the input's, not the host's.
    if e == Errno::OPNOTSUPP && name.starts_with(b"system.") {
        return StageError::Refused(format!(
            "xattr {} is not one the store's filesystem implements ({e}): drop it from the source",
            show(name)
        ));
    }
    // The kernel parses these values (a file capability's vfs_cap_data, a
    // POSIX ACL): a malformed one is the input's fault.
    if e == Errno::INVAL && (name.starts_with(b"security.") || name.starts_with(b"system.")) {
        return StageError::Refused(format!(
            "xattr {} has a value the kernel refuses ({e}): a security.capability is a vfs_cap_data (what setcap writes), a system.posix_acl_* an ACL (what setfacl writes); fix or drop it in the source",
            show(name)
        ));
    }
    if e == Errno::TOOBIG || e == Errno::RANGE || (e == Errno::NOSPC && has_room()) {
        return StageError::Refused(format!(
            "xattr {} has a {len}-byte value, more than the store's filesystem keeps for one file ({e}): drop it or make it smaller",
            show(name)
        ));
    }
    StageError::Io(
        "set an xattr of",
        io::Error::other(format!("{}: {e}", show(name))),
    )
}

/// The metadata of one entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Meta {
    /// Permission bits with setuid, setgid and sticky (`& 0o7777`).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Seconds since the epoch.
    pub mtime: i64,
    /// Name → value; names are complete (`user.x`, `security.capability`).
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Meta {
    /// Refuses what a base cannot hold: an owner id of −1 (`chown`'s "leave
    /// as is"), an overlayfs-private xattr.
    fn check(&self) -> R<()> {
        for id in [self.uid, self.gid] {
            if id == u32::MAX {
                return Err(StageError::Refused(format!(
                    "its owner id {id} is no valid user or group id (it means \"unchanged\" to chown)"
                )));
            }
        }
        for (name, _) in &self.xattrs {
            check_xattr_name(name)?;
            // Both namespaces: a trusted.overlay.* xattr steers a privileged
            // mount, a user.overlay.* one a rootless (userxattr) mount.
            if is_overlay_private(name, false) || is_overlay_private(name, true) {
                return Err(StageError::Refused(format!(
                    "it carries the overlayfs-private xattr {}, which steers how overlayfs reads a layer (an opaque directory, a redirect) and which a base never holds: remove it from the source (setfattr -x)",
                    String::from_utf8_lossy(name)
                )));
            }
        }
        Ok(())
    }
}

/// The xattr namespaces Linux knows (`xattr(7)`): a name in any other, or
/// with nothing after its namespace, is refused before any I/O — the kernel
/// would answer `EOPNOTSUPP` or `EINVAL`, which reads as the staging
/// filesystem's fault.
const XATTR_NAMESPACES: [&[u8]; 4] = [b"security.", b"system.", b"trusted.", b"user."];

/// Refuses an xattr name outside [`XATTR_NAMESPACES`] or with an empty
/// suffix, naming it.
fn check_xattr_name(name: &[u8]) -> R<()> {
    let known = XATTR_NAMESPACES
        .iter()
        .any(|ns| name.len() > ns.len() && name.starts_with(ns));
    if known {
        return Ok(());
    }
    Err(StageError::Refused(format!(
        "it carries the xattr {}, which is in no namespace Linux knows (security., system., trusted. or user., followed by a name): rename or drop it in the source",
        show(name)
    )))
}

/// A device or fifo.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Special {
    Char(u32, u32),
    Block(u32, u32),
    Fifo,
}

/// Checks and normalizes an entry's path: `./` prefixes, `.` and empty
/// components are dropped; an absolute path, a `..` component or a NUL is
/// refused. `Ok(None)`: the root itself (`.`, `./`).
pub(crate) fn normalize(raw: &[u8]) -> Result<Option<Vec<u8>>, String> {
    if raw.contains(&0) {
        return Err("its path holds a NUL byte".into());
    }
    if raw.first() == Some(&b'/') {
        return Err(
            "its path is absolute; the entries of an image layer are relative to its root (fix the archive: GNU tar strips a leading `/` unless given -P)"
                .into(),
        );
    }
    let mut out = Vec::with_capacity(raw.len());
    for comp in raw.split(|&b| b == b'/') {
        match comp {
            b"" | b"." => {}
            b".." => {
                return Err(
                    "its path has a `..` component, which would reach outside the root".into(),
                )
            }
            c => {
                if !out.is_empty() {
                    out.push(b'/');
                }
                out.extend_from_slice(c);
            }
        }
    }
    Ok((!out.is_empty()).then_some(out))
}

pub(crate) fn show(rel: &[u8]) -> String {
    String::from_utf8_lossy(rel).into_owned()
}

/// The staged tree (see the module docs).
pub(crate) struct Stage {
    root: PathBuf,
    /// Paths the current layer wrote, and every directory above them.
    touched: HashSet<Vec<u8>>,
    /// Whether `touched` is kept (a directory copy has no whiteouts: no need).
    track: bool,
    /// Leave the root's metadata as it is (an extraction into an existing
    /// directory, [`crate::extract_tar_into`]).
    pub(crate) keep_root: bool,
    /// The mtime of every directory below the root, set by [`Stage::finish`].
    dir_mtimes: BTreeMap<Vec<u8>, i64>,
    /// Overlay mode (see the module docs): `Some(userxattr)`.
    overlay: Option<bool>,
    /// Overlay mode: the directories to mark opaque in [`Stage::finish`].
    opaque_dirs: BTreeSet<Vec<u8>>,
    /// The owner of the directories made because an entry lies below them
    /// (`0:0`; an extraction into a session with a uid/gid mapping: its
    /// root's host ids).
    pub(crate) implied_owner: (u32, u32),
    /// The tree is a live session's ([`crate::extract_tar_into`]): its
    /// processes change it while the extraction runs (see [`set_at_meta`]).
    pub(crate) live: bool,
    /// The root's filesystem (`st_dev`), once read: nothing is written on
    /// another one mounted below the root ([`Stage::on_root_fs`]).
    root_dev: std::cell::Cell<Option<u64>>,
    pub(crate) report: ImportReport,
}

/// How an existing path compares with what replaces it.
enum Existing {
    None,
    Dir,
    Other,
}

impl Stage {
    /// A stage writing into the empty directory `root`.
    pub(crate) fn new(root: &Path) -> Stage {
        Stage {
            root: root.to_path_buf(),
            touched: HashSet::new(),
            track: true,
            keep_root: false,
            dir_mtimes: BTreeMap::new(),
            overlay: None,
            opaque_dirs: BTreeSet::new(),
            root_dev: std::cell::Cell::new(None),
            implied_owner: (0, 0),
            live: false,
            report: ImportReport::default(),
        }
    }

    /// `fd` (the directory `rel`, opened beneath the root), if it lies on
    /// the root's filesystem. An extraction into a live session's tree
    /// (`UploadTar`) runs as the host's root in a tree whose mounts the
    /// session makes: a directory there may be a mount point of another
    /// filesystem (a cgroup hierarchy, a bind mount of a kernel file), and
    /// nothing is written, chowned or removed on it. Checked on the
    /// descriptor, after the open. Errors: `Refused` naming `rel`.
    fn on_root_fs(&self, fd: OwnedFd, rel: &[u8]) -> R<OwnedFd> {
        on_dev(fd, self.root_dev()?, rel)
    }

    /// The root's filesystem (`st_dev`), read once.
    fn root_dev(&self) -> R<u64> {
        if let Some(d) = self.root_dev.get() {
            return Ok(d);
        }
        let d = rfs::stat(&self.root)
            .map_err(io_err("stat the staging root"))?
            .st_dev;
        self.root_dev.set(Some(d));
        Ok(d)
    }

    /// A stage that keeps one layer in overlay upper format in the empty
    /// directory `root` (see the module docs); `userxattr`: opaque
    /// directories are marked `user.overlay.opaque`, else
    /// `trusted.overlay.opaque`.
    pub(crate) fn overlay(root: &Path, userxattr: bool) -> Stage {
        Stage {
            track: false,
            overlay: Some(userxattr),
            ..Stage::new(root)
        }
    }

    /// Whether whiteouts and opaque markers apply here (flattening, which
    /// remembers the layer's paths, or overlay mode, which keeps them); an
    /// extraction into a directory refuses them.
    pub(crate) fn applies_whiteouts(&self) -> bool {
        self.track || self.overlay.is_some()
    }

    /// A stage that does not remember what it wrote: for a directory copy,
    /// which has no whiteouts (a million paths would be kept for nothing).
    pub(crate) fn untracked(root: &Path) -> Stage {
        Stage {
            track: false,
            ..Stage::new(root)
        }
    }

    /// A directory made because an entry lies below it (0755, owned by
    /// [`Stage::implied_owner`]).
    fn implied(&self) -> Meta {
        Meta {
            uid: self.implied_owner.0,
            gid: self.implied_owner.1,
            ..implied()
        }
    }

    /// The staging root.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// Starts the next layer: whiteouts hide what was written until now.
    pub(crate) fn next_layer(&mut self) {
        self.touched.clear();
    }

    fn touch(&mut self, rel: &[u8]) {
        if !self.track {
            return;
        }
        let mut p = rel;
        loop {
            if !self.touched.insert(p.to_vec()) {
                return;
            }
            match p.iter().rposition(|&b| b == b'/') {
                Some(i) => p = &p[..i],
                None => return,
            }
        }
    }

    /// The parent directory of `rel`, opened beneath the root without
    /// following a symlink; missing directories on the way are made (0755,
    /// 0:0, mtime 0) when `create`, else `Ok(None)`.
    fn parent(&mut self, rel: &[u8], create: bool) -> R<Option<(OwnedFd, Vec<u8>)>> {
        let (parent, name) = fsx::split_parent(rel);
        let name = name.to_vec();
        match Parent::open(&self.root, parent) {
            Ok(Parent::Fd(fd)) => return Ok(Some((self.on_root_fs(fd, parent)?, name))),
            Ok(Parent::Base(_)) => return Ok(Some((self.open_dir(b"")?, name))),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {}
            Err(e) => return Err(StageError::Io("open the parent of", e)),
        }
        // Component by component: find the symlink or non-directory to name,
        // or make what is missing.
        let mut dir = rfs::openat(rfs::CWD, &self.root, dir_flags(), Mode::empty())
            .map_err(io_err("open the staging root"))?;
        let mut at = Vec::new();
        for comp in parent.split(|&b| b == b'/') {
            if !at.is_empty() {
                at.push(b'/');
            }
            at.extend_from_slice(comp);
            match rfs::openat(&dir, os(comp), dir_flags(), Mode::empty()) {
                Ok(d) => dir = self.on_root_fs(d, &at)?,
                Err(Errno::NOENT) if create => {
                    dir = make_dir(&dir, comp, &self.implied(), self.root_dev()?)?;
                    self.dir_mtimes.insert(at.clone(), 0);
                    self.report.implied_dirs += 1;
                }
                Err(Errno::NOENT) => return Ok(None),
                Err(Errno::LOOP | Errno::NOTDIR) => {
                    let st = rfs::statat(&dir, os(comp), AtFlags::SYMLINK_NOFOLLOW)
                        .map_err(io_err("stat"))?;
                    let what = if FileType::from_raw_mode(st.st_mode) == FileType::Symlink {
                        "is a symlink (made by an earlier entry, or already in the tree the entries are written into); an entry is never written through a symlink"
                    } else {
                        "is not a directory"
                    };
                    return Err(StageError::Refused(format!("{} {what}", show(&at))));
                }
                Err(e) => return Err(StageError::Io("open the parent of", e.into())),
            }
        }
        Ok(Some((dir, name)))
    }

    /// [`Stage::parent`], making what is missing.
    fn parent_made(&mut self, rel: &[u8]) -> R<(OwnedFd, Vec<u8>)> {
        self.parent(rel, true)?.ok_or_else(|| {
            StageError::Io(
                "open the parent of",
                io::Error::from_raw_os_error(libc::ENOENT),
            )
        })
    }

    /// The directory `rel` (empty: the root), opened beneath the root.
    fn open_dir(&self, rel: &[u8]) -> R<OwnedFd> {
        let fd = match Parent::open(&self.root, rel).map_err(|e| StageError::Io("open", e))? {
            Parent::Fd(fd) => fd,
            Parent::Base(b) => rfs::openat(rfs::CWD, b, dir_flags(), Mode::empty())
                .map_err(io_err("open the staging root"))?,
        };
        self.on_root_fs(fd, rel)
    }

    /// What is at `name` in `dir` now.
    fn existing(dir: &OwnedFd, name: &[u8]) -> R<Existing> {
        match rfs::statat(dir, os(name), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
                Ok(Existing::Dir)
            }
            Ok(_) => Ok(Existing::Other),
            Err(Errno::NOENT) => Ok(Existing::None),
            Err(e) => Err(StageError::Io("stat", e.into())),
        }
    }

    /// Removes `name` of `dir` (at `rel`) whatever it is; forgets the mtimes
    /// of the directories it held.
    fn remove(&mut self, dir: &OwnedFd, name: &[u8], rel: &[u8]) -> R<()> {
        match Self::existing(dir, name)? {
            Existing::None => return Ok(()),
            Existing::Other => {
                rfs::unlinkat(dir, os(name), AtFlags::empty()).map_err(raced_err("remove", rel))?
            }
            Existing::Dir => {
                remove_tree(dir, name, rel, self.root_dev()?)?;
                let mut below = rel.to_vec();
                below.push(b'/');
                let mut end = rel.to_vec();
                end.push(b'/' + 1);
                let gone: Vec<Vec<u8>> = self
                    .dir_mtimes
                    .range(below.clone()..end.clone())
                    .map(|(k, _)| k.clone())
                    .collect();
                for k in gone {
                    self.dir_mtimes.remove(&k);
                }
                let gone: Vec<Vec<u8>> = self.opaque_dirs.range(below..end).cloned().collect();
                for k in gone {
                    self.opaque_dirs.remove(&k);
                }
            }
        }
        self.dir_mtimes.remove(rel);
        self.opaque_dirs.remove(rel);
        Ok(())
    }

    /// Makes room for a non-directory at `rel`; returns its parent and name.
    fn replace(&mut self, rel: &[u8], meta: &Meta) -> R<(OwnedFd, Vec<u8>)> {
        meta.check()?;
        let (dir, name) = self.parent_made(rel)?;
        self.remove(&dir, &name, rel)?;
        self.touch(rel);
        Ok((dir, name))
    }

    /// A regular file with the content of `data`.
    pub(crate) fn file(&mut self, rel: &[u8], meta: &Meta, data: &mut dyn Read) -> R<u64> {
        let (dir, name) = self.replace(rel, meta)?;
        let flags = OFlags::WRONLY
            | OFlags::CREATE
            | OFlags::EXCL
            | OFlags::NOFOLLOW
            | OFlags::NOCTTY
            | OFlags::CLOEXEC;
        let fd = rfs::openat(&dir, os(&name), flags, Mode::from_raw_mode(0o600))
            .map_err(io_err("create"))?;
        let mut f = std::fs::File::from(fd);
        // Not io::copy: a read error is the input's, a write error staging's.
        let mut buf = vec![0u8; 64 * 1024];
        let mut n = 0u64;
        loop {
            let k = match data.read(&mut buf) {
                Ok(0) => break,
                Ok(k) => k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(StageError::Read(e)),
            };
            f.write_all(&buf[..k])
                .map_err(|e| StageError::Io("write", e))?;
            n += k as u64;
        }
        set_fd_meta(&f, meta)?;
        self.report.files += 1;
        self.report.content_bytes += n;
        Ok(n)
    }

    /// A directory: made, or the existing one's metadata replaced (what it
    /// holds stays).
    pub(crate) fn dir(&mut self, rel: &[u8], meta: &Meta) -> R<()> {
        meta.check()?;
        let (dir, name) = self.parent_made(rel)?;
        match Self::existing(&dir, &name)? {
            Existing::Dir => {
                let d = rfs::openat(&dir, os(&name), dir_flags(), Mode::empty())
                    .map_err(io_err("open"))?;
                let d = on_dev(d, self.root_dev()?, rel)?;
                // Replace, not add to, the xattrs it had.
                for n in fd_xattr_names(&d)? {
                    rfs::fremovexattr(&d, os(&n)).map_err(io_err("remove an xattr of"))?;
                }
                set_fd_meta(
                    &d,
                    &Meta {
                        mtime: 0,
                        ..meta.clone()
                    },
                )?;
            }
            Existing::Other => {
                if self.overlay.is_some() && is_whiteout_at(&dir, &name)? {
                    // OCI: the layer hides what was below and makes a new
                    // directory there — in overlay format, an opaque one.
                    self.opaque_dirs.insert(rel.to_vec());
                }
                rfs::unlinkat(&dir, os(&name), AtFlags::empty()).map_err(io_err("remove"))?;
                make_dir(&dir, &name, meta, self.root_dev()?)?;
            }
            Existing::None => {
                make_dir(&dir, &name, meta, self.root_dev()?)?;
            }
        }
        self.dir_mtimes.insert(rel.to_vec(), meta.mtime);
        self.touch(rel);
        self.report.dirs += 1;
        Ok(())
    }

    /// A symlink to `target` (verbatim; never followed).
    pub(crate) fn symlink(&mut self, rel: &[u8], target: &[u8], meta: &Meta) -> R<()> {
        if target.is_empty() || target.contains(&0) {
            return Err(StageError::Refused(
                "it is a symlink with an empty target or one holding a NUL byte".into(),
            ));
        }
        no_user_xattrs(meta, "symlink")?;
        let (dir, name) = self.replace(rel, meta)?;
        rfs::symlinkat(os(target), &dir, os(&name)).map_err(raced_err("create symlink", rel))?;
        set_at_meta(
            &dir,
            &name,
            meta,
            FileType::Symlink,
            rel,
            (self.root_dev()?, self.live),
        )?;
        self.report.symlinks += 1;
        Ok(())
    }

    /// A device or fifo. A character device 0:0 is refused: overlayfs reads
    /// it as a whiteout.
    pub(crate) fn special(&mut self, rel: &[u8], kind: Special, meta: &Meta) -> R<()> {
        if kind == Special::Char(0, 0) {
            return Err(StageError::Refused(
                "it is a character device 0:0, which overlayfs reads as a whiteout; a base has no whiteouts (in a layer tar, write `.wh.<name>` instead)".into(),
            ));
        }
        no_user_xattrs(meta, "device or fifo")?;
        let (dir, name) = self.replace(rel, meta)?;
        let (ft, dev) = match kind {
            Special::Char(ma, mi) => (FileType::CharacterDevice, rfs::makedev(ma, mi)),
            Special::Block(ma, mi) => (FileType::BlockDevice, rfs::makedev(ma, mi)),
            Special::Fifo => (FileType::Fifo, 0),
        };
        rfs::mknodat(&dir, os(&name), ft, Mode::from_raw_mode(0o600), dev)
            .map_err(raced_err("create device or fifo", rel))?;
        set_at_meta(&dir, &name, meta, ft, rel, (self.root_dev()?, self.live))?;
        self.report.specials += 1;
        Ok(())
    }

    /// A hardlink at `rel` to the existing non-directory `target` (a path of
    /// the staged tree, reached beneath the root without following symlinks).
    /// The link shares its target's metadata; the entry's own `meta` is only
    /// checked (an overlayfs-private xattr is refused wherever it is given).
    pub(crate) fn hardlink(&mut self, rel: &[u8], target: &[u8], meta: &Meta) -> R<()> {
        meta.check()?;
        if rel == target {
            return Err(StageError::Refused("it is a hardlink to itself".into()));
        }
        let missing = || {
            StageError::Refused(format!(
                "it is a hardlink to {}, which is not in the tree (a hardlink must come after its target, and cannot reach outside the root)",
                show(target)
            ))
        };
        let (tdir, tname) = match self.parent(target, false) {
            Ok(Some(p)) => p,
            Ok(None) => return Err(missing()),
            Err(StageError::Refused(why)) => {
                return Err(StageError::Refused(format!(
                    "it is a hardlink to {}, and {why}",
                    show(target)
                )))
            }
            Err(e) => return Err(e),
        };
        match Self::existing(&tdir, &tname)? {
            Existing::None => return Err(missing()),
            Existing::Dir => {
                return Err(StageError::Refused(format!(
                    "it is a hardlink to the directory {}",
                    show(target)
                )))
            }
            Existing::Other => {}
        }
        let (dir, name) = self.replace(rel, &Meta::default())?;
        rfs::linkat(&tdir, os(&tname), &dir, os(&name), AtFlags::empty())
            .map_err(io_err("link"))?;
        self.report.hardlinks += 1;
        Ok(())
    }

    /// A whiteout of `rel` (`.wh.<name>` in its parent, whose metadata is
    /// `meta`): what the layers below had there goes; what this layer wrote
    /// there stays. In overlay mode, a 0:0 character device at `rel`.
    pub(crate) fn whiteout(&mut self, rel: &[u8], meta: &Meta) -> R<()> {
        if self.overlay.is_some() {
            return self.overlay_whiteout(rel, meta);
        }
        debug_assert!(self.track, "whiteouts need the paths this layer wrote");
        self.report.whiteouts += 1;
        let Some((dir, name)) = self.parent(rel, false)? else {
            return Ok(());
        };
        if !self.touched.contains(rel) {
            return self.remove(&dir, &name, rel);
        }
        match Self::existing(&dir, &name)? {
            Existing::Dir => self.prune(rel),
            _ => Ok(()),
        }
    }

    /// Overlay mode's whiteout (see the module docs): a 0:0 character device,
    /// mode 0 (overlayfs' `WHITEOUT_MODE`), owner and mtime of the entry.
    fn overlay_whiteout(&mut self, rel: &[u8], meta: &Meta) -> R<()> {
        meta.check()?;
        self.report.whiteouts += 1;
        let (dir, name) = self.parent_made(rel)?;
        match Self::existing(&dir, &name)? {
            // This layer made the directory: it stays, what is below goes.
            Existing::Dir => {
                self.opaque_dirs.insert(rel.to_vec());
                Ok(())
            }
            // A file, link or whiteout of this layer hides what is below already.
            Existing::Other => Ok(()),
            Existing::None => {
                rfs::mknodat(
                    &dir,
                    os(&name),
                    FileType::CharacterDevice,
                    Mode::empty(),
                    rfs::makedev(0, 0),
                )
                .map_err(io_err("create whiteout"))?;
                set_at_meta(
                    &dir,
                    &name,
                    &Meta {
                        mode: 0,
                        xattrs: Vec::new(),
                        ..meta.clone()
                    },
                    FileType::CharacterDevice,
                    rel,
                    (self.root_dev()?, self.live),
                )
            }
        }
    }

    /// An opaque marker in directory `rel` (empty: the root): what the layers
    /// below had in it goes. In overlay mode, the directory is marked opaque
    /// (by [`Stage::finish`]); nothing is pruned.
    pub(crate) fn opaque(&mut self, rel: &[u8]) -> R<()> {
        if self.overlay.is_some() && rel.is_empty() {
            return Err(StageError::Refused(
                "it marks the layer's root opaque, which overlayfs does not read (an upper's root is merged with what is below whatever its xattrs): the layer cannot be kept in overlay format".into(),
            ));
        }
        debug_assert!(
            self.track || self.overlay.is_some(),
            "opaque markers need the paths this layer wrote"
        );
        self.report.opaque += 1;
        if !rel.is_empty() {
            // The marker is in this layer, so is its directory.
            let (dir, name) = self.parent_made(rel)?;
            match Self::existing(&dir, &name)? {
                Existing::Dir => {}
                Existing::None => {
                    make_dir(&dir, &name, &self.implied(), self.root_dev()?)?;
                    self.dir_mtimes.insert(rel.to_vec(), 0);
                    self.report.implied_dirs += 1;
                }
                Existing::Other => {
                    return Err(StageError::Refused(format!(
                        "it marks {} opaque, which is not a directory",
                        show(rel)
                    )))
                }
            }
            self.touch(rel);
        }
        if self.overlay.is_some() {
            self.opaque_dirs.insert(rel.to_vec());
            return Ok(());
        }
        self.prune(rel)
    }

    /// Removes from directory `rel` every entry this layer did not write, at
    /// any depth.
    fn prune(&mut self, rel: &[u8]) -> R<()> {
        let d = self.open_dir(rel)?;
        let names = fsx::names_of(&d).map_err(|e| StageError::Io("list", e))?;
        for name in names {
            let child = join(rel, &name);
            if !self.touched.contains(&child) {
                self.remove(&d, &name, &child)?;
            } else if let Existing::Dir = Self::existing(&d, &name)? {
                self.prune(&child)?;
            }
        }
        Ok(())
    }

    /// Sets every directory's mtime and the root's metadata (see the module
    /// docs). Returns the report.
    pub(crate) fn finish(self) -> R<ImportReport> {
        let root = self.open_dir(b"")?;
        if !self.keep_root {
            for n in fd_xattr_names(&root)? {
                rfs::fremovexattr(&root, os(&n)).map_err(io_err("remove an xattr of"))?;
            }
            set_fd_meta(&root, &implied())?;
        }
        if let Some(userxattr) = self.overlay {
            let key = crate::view::opaque_name(userxattr);
            for rel in &self.opaque_dirs {
                let d = self.open_dir(rel)?;
                rfs::fsetxattr(&d, key, b"y", XattrFlags::empty()).map_err(|e| {
                    StageError::Io(
                        "mark opaque",
                        io::Error::other(format!("{} ({key}): {e}", show(rel))),
                    )
                })?;
            }
        }
        for (rel, mtime) in &self.dir_mtimes {
            let (parent, name) = fsx::split_parent(rel);
            let p = match Parent::open(&self.root, parent) {
                Ok(p) => p,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                Err(e) => return Err(StageError::Io("open the parent of", e)),
            };
            let fd = match p {
                Parent::Fd(fd) => fd,
                Parent::Base(_) => root.try_clone().map_err(|e| StageError::Io("dup", e))?,
            };
            // By descriptor, on the root's filesystem: a mount point put there
            // meanwhile keeps its times.
            let d = match rfs::openat(&fd, os(name), dir_flags(), Mode::empty()) {
                Ok(d) => self.on_root_fs(d, rel)?,
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(StageError::Io("open", e.into())),
            };
            rfs::futimens(&d, &times(*mtime)).map_err(io_err("set the mtime of"))?;
        }
        Ok(self.report)
    }
}

/// Whether `name` in `dir` is an overlayfs whiteout (a 0:0 character device).
fn is_whiteout_at(dir: &OwnedFd, name: &[u8]) -> R<bool> {
    let st = rfs::statat(dir, os(name), AtFlags::SYMLINK_NOFOLLOW).map_err(io_err("stat"))?;
    Ok(crate::view::is_whiteout(st.st_mode, st.st_rdev))
}

/// Refuses `user.*` xattrs on what is not a regular file nor a directory:
/// Linux keeps them on those only (`xattr(7)`), so the entry cannot be
/// staged as it is.
fn no_user_xattrs(meta: &Meta, what: &str) -> R<()> {
    match meta.xattrs.iter().find(|(n, _)| n.starts_with(b"user.")) {
        Some((n, _)) => Err(StageError::Refused(format!(
            "it is a {what} with the xattr {}, and Linux keeps user.* xattrs on regular files and directories only: remove it from the archive",
            show(n)
        ))),
        None => Ok(()),
    }
}

/// A directory made because an entry lies below it.
fn implied() -> Meta {
    Meta {
        mode: 0o755,
        ..Meta::default()
    }
}

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

fn os(b: &[u8]) -> &OsStr {
    OsStr::from_bytes(b)
}

pub(crate) fn join(parent: &[u8], name: &[u8]) -> Vec<u8> {
    let mut p = parent.to_vec();
    if !p.is_empty() {
        p.push(b'/');
    }
    p.extend_from_slice(name);
    p
}

fn times(mtime: i64) -> Timestamps {
    let t = Timespec {
        tv_sec: mtime,
        tv_nsec: 0,
    };
    Timestamps {
        last_access: t,
        last_modification: t,
    }
}

fn ids(meta: &Meta) -> (Option<Uid>, Option<Gid>) {
    (Some(Uid::from_raw(meta.uid)), Some(Gid::from_raw(meta.gid)))
}

/// `mkdir` + metadata (mtime set later, by [`Stage::finish`]); the new
/// directory, opened (on the root's filesystem `dev`: [`on_dev`]).
fn make_dir(dir: &OwnedFd, name: &[u8], meta: &Meta, dev: u64) -> R<OwnedFd> {
    rfs::mkdirat(dir, os(name), Mode::from_raw_mode(0o700)).map_err(io_err("create directory"))?;
    let d = rfs::openat(dir, os(name), dir_flags(), Mode::empty()).map_err(io_err("open"))?;
    let d = on_dev(d, dev, name)?;
    set_fd_meta(&d, meta)?;
    Ok(d)
}

/// `fd` (at `rel`), if it lies on the filesystem `dev`. Errors: `Refused`
/// naming `rel`.
fn on_dev(fd: OwnedFd, dev: u64, rel: &[u8]) -> R<OwnedFd> {
    if rfs::fstat(&fd).map_err(io_err("stat"))?.st_dev != dev {
        return Err(StageError::Refused(format!(
            "{} is a mount point of another filesystem: an archive is never written into one",
            show(rel)
        )));
    }
    Ok(fd)
}

/// Removes the directory `name` of `dir` (at `rel`) and all it holds, one
/// descriptor at a time: a symlink inside is unlinked, never followed
/// (O_NOFOLLOW, as std's remove_dir_all since CVE-2022-21658), and a
/// directory of a filesystem other than the root's (`dev`) mounted inside
/// is refused, never descended into ([`on_dev`]).
fn remove_tree(dir: &OwnedFd, name: &[u8], rel: &[u8], dev: u64) -> R<()> {
    let d = rfs::openat(dir, os(name), dir_flags(), Mode::empty()).map_err(io_err("open"))?;
    let d = on_dev(d, dev, rel)?;
    for n in fsx::names_of(&d).map_err(|e| StageError::Io("list", e))? {
        let below = join(rel, &n);
        match rfs::statat(&d, os(&n), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
                remove_tree(&d, &n, &below, dev)?
            }
            Ok(_) => rfs::unlinkat(&d, os(&n), AtFlags::empty()).map_err(io_err("remove"))?,
            Err(Errno::NOENT) => {}
            Err(e) => return Err(StageError::Io("stat", e.into())),
        }
    }
    rfs::unlinkat(dir, os(name), AtFlags::REMOVEDIR).map_err(io_err("remove"))
}

/// Owner, mode, xattrs, then times of an open file or directory.
fn set_fd_meta(fd: &impl AsFd, meta: &Meta) -> R<()> {
    let (u, g) = ids(meta);
    rfs::fchown(fd, u, g).map_err(io_err("set the owner of"))?;
    rfs::fchmod(fd, Mode::from_raw_mode(meta.mode & 0o7777)).map_err(io_err("set the mode of"))?;
    for (n, v) in &meta.xattrs {
        rfs::fsetxattr(fd, os(n), v, XattrFlags::empty())
            .map_err(|e| xattr_err(fd, n, v.len(), e))?;
    }
    rfs::futimens(fd, &times(meta.mtime)).map_err(io_err("set the mtime of"))
}

/// Owner, mode (not for a symlink), xattrs, then times of `name` in `dir`
/// (at `rel`), just made there as a `kind` (a symlink, a device, a fifo, a
/// whiteout): all through an `O_PATH` descriptor of it, checked to be that
/// kind on the root's filesystem `dev` ([`on_dev`]) — never by name. In a live
/// session's tree (`UploadTar`) the session may swap the name for a
/// symlink to a host path or a bind mount of a host file between the
/// `mknod` and the metadata; by name, the daemon (the host's root) would
/// then chmod or chown that (a review did, and ran a set-user-ID host
/// binary as root). Errors: `Refused` when the entry was replaced.
fn set_at_meta(
    dir: &OwnedFd,
    name: &[u8],
    meta: &Meta,
    kind: FileType,
    rel: &[u8],
    (dev, live): (u64, bool),
) -> R<()> {
    use std::os::fd::AsRawFd;
    let fd = rfs::openat(
        dir,
        os(name),
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(io_err("open"))?;
    let fd = on_dev(fd, dev, rel)?;
    let st = rfs::fstat(&fd).map_err(io_err("stat"))?;
    if FileType::from_raw_mode(st.st_mode) != kind {
        return Err(StageError::Refused(format!(
            "{} was replaced by something else while it was being made",
            show(rel)
        )));
    }
    let (u, g) = ids(meta);
    let here = AtFlags::EMPTY_PATH | AtFlags::SYMLINK_NOFOLLOW;
    rfs::chownat(&fd, "", u, g, here).map_err(io_err("set the owner of"))?;
    if kind == FileType::Symlink {
        if !meta.xattrs.is_empty() {
            symlink_xattrs(dir, name, meta, live)?;
        }
    } else {
        // The descriptor's own inode through its magic link (a device or a
        // fifo: nothing further to follow).
        let by_fd = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        rfs::chmod(&by_fd, Mode::from_raw_mode(meta.mode & 0o7777))
            .map_err(io_err("set the mode of"))?;
        for (n, v) in &meta.xattrs {
            rfs::setxattr(&by_fd, os(n), v, XattrFlags::empty())
                .map_err(|e| xattr_err(dir, n, v.len(), e))?;
        }
    }
    rfs::utimensat(&fd, "", &times(meta.mtime), here).map_err(io_err("set the mtime of"))
}

/// The xattrs of the symlink `name` in `dir`, by name: Linux sets a
/// symlink's xattrs only by path (`lsetxattr`; `setxattrat(2)` on its
/// descriptor is Linux ≥ 6.13, beyond this crate's safe code). Not in a
/// tree someone else writes meanwhile ([`Stage::live`]): refused there.
fn symlink_xattrs(dir: &OwnedFd, name: &[u8], meta: &Meta, live: bool) -> R<()> {
    if live {
        return Err(StageError::Refused(
            "it is a symlink with xattrs, which an extraction into a live session's tree does not set (they are set by name, and the session may swap the name meanwhile): remove them from the archive".into(),
        ));
    }
    for (n, v) in &meta.xattrs {
        rfs::lsetxattr(fsx::proc_path(dir, name), os(n), v, XattrFlags::empty())
            .map_err(|e| xattr_err(dir, n, v.len(), e))?;
    }
    Ok(())
}

/// The xattr names of an open directory.
fn fd_xattr_names(fd: &OwnedFd) -> R<Vec<Vec<u8>>> {
    let mut buf = vec![0u8; 4096];
    loop {
        match rfs::flistxattr(fd, &mut buf[..]) {
            Ok(n) => {
                return Ok(buf[..n]
                    .split(|&b| b == 0)
                    .filter(|s| !s.is_empty())
                    .map(<[u8]>::to_vec)
                    .collect())
            }
            Err(Errno::RANGE) if buf.len() < 1 << 20 => buf.resize(buf.len() * 4, 0),
            Err(Errno::OPNOTSUPP) => return Ok(Vec::new()),
            Err(e) => return Err(StageError::Io("list the xattrs of", e.into())),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::{check_xattr_name, normalize, xattr_err, Errno, StageError};

    #[test]
    fn a_value_the_kernel_refuses_to_parse_is_the_inputs_fault() {
        let dir = std::fs::File::open("/").unwrap();
        for name in [&b"security.capability"[..], b"system.posix_acl_access"] {
            match xattr_err(&dir, name, 1, Errno::INVAL) {
                StageError::Refused(m) => assert!(m.contains("value the kernel refuses"), "{m}"),
                other => panic!("{other:?}"),
            }
        }
        // EINVAL on a name the kernel does not parse: the staging side's.
        assert!(matches!(
            xattr_err(&dir, b"user.k", 1, Errno::INVAL),
            StageError::Io(..)
        ));
    }

    #[test]
    fn xattr_names_outside_the_kernels_namespaces_are_refused() {
        for ok in [
            &b"user.k"[..],
            b"trusted.k",
            b"security.capability",
            b"system.posix_acl_access",
        ] {
            assert!(
                check_xattr_name(ok).is_ok(),
                "{}",
                String::from_utf8_lossy(ok)
            );
        }
        for bad in [&b"urusted.k"[..], b"user.", b"k", b"", b"USER.k"] {
            match check_xattr_name(bad) {
                Err(StageError::Refused(m)) => {
                    assert!(m.contains("no namespace Linux knows"), "{m}")
                }
                other => panic!("{}: {other:?}", String::from_utf8_lossy(bad)),
            }
        }
    }

    #[test]
    fn paths_are_normalized_or_refused() {
        assert_eq!(normalize(b"./a//b/./c/").unwrap(), Some(b"a/b/c".to_vec()));
        assert_eq!(normalize(b"./").unwrap(), None);
        assert_eq!(normalize(b".").unwrap(), None);
        assert!(normalize(b"/etc/x").unwrap_err().contains("absolute"));
        assert!(normalize(b"../x").unwrap_err().contains(".."));
        assert!(normalize(b"a/../../x").unwrap_err().contains(".."));
        assert!(normalize(b"a\0b").unwrap_err().contains("NUL"));
    }
}
