//! Read-only resolution of paths over a stack of overlay-format layers.
//!
//! The rules are the kernel's overlayfs lookup rules
//! (Documentation/filesystems/overlayfs.rst, "Whiteouts and opaque directories",
//! and `ovl_lookup_single` in fs/overlayfs/namei.c), applied to lower layers only:
//!
//! * layers are ordered newest first; the first layer holding a name wins;
//! * a character device with device number 0:0 (a *whiteout*) hides the name in
//!   every older layer, and is itself invisible;
//! * a non-directory hides every older layer's entry of that name, and so hides
//!   everything below that name;
//! * a directory merges with the same directory in older layers, until an older
//!   layer holds a whiteout or a non-directory there, or until a directory carrying
//!   the xattr `trusted.overlay.opaque` = `y` (with [`LayerView::with_userxattr`]:
//!   `user.overlay.opaque` = `y` instead, as the kernel reads only the mount's own
//!   namespace), which ends the merge below itself.
//!
//! Not handled, because nothing in LayerStack produces them: redirects, metacopy
//! and xattr-based whiteouts (`overlay.whiteout`, opaque value `x`, Linux 6.7+).
//! An opaque value other than `y` counts as not opaque.

/// Directories kept open down a path: (layer position, the open directory).
type OpenDirs<'v> = Vec<(usize, crate::fsx::Parent<'v>)>;

use std::collections::BTreeMap;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The xattr that marks an opaque directory on a normal (privileged) overlay mount.
pub(crate) const TRUSTED_OPAQUE: &str = "trusted.overlay.opaque";
/// The xattr that marks an opaque directory on a `userxattr` (rootless) overlay mount.
pub(crate) const USER_OPAQUE: &str = "user.overlay.opaque";

/// The opaque xattr of a mount's namespace: [`USER_OPAQUE`] with `userxattr`, else
/// [`TRUSTED_OPAQUE`]. The other one is ordinary data there.
pub(crate) fn opaque_name(userxattr: bool) -> &'static str {
    if userxattr {
        USER_OPAQUE
    } else {
        TRUSTED_OPAQUE
    }
}

/// The type of a file, from the `S_IFMT` bits of `st_mode` (inode(7)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum FileKind {
    /// `S_IFREG`.
    Regular,
    /// `S_IFDIR`.
    Dir,
    /// `S_IFLNK`.
    Symlink,
    /// `S_IFIFO`.
    Fifo,
    /// `S_IFCHR` (a 0:0 character device is a whiteout, never reported as a file).
    CharDev,
    /// `S_IFBLK`.
    BlockDev,
    /// `S_IFSOCK`.
    Socket,
}

impl FileKind {
    /// The kind encoded in a raw `st_mode`, `None` for an unknown `S_IFMT` value.
    pub(crate) fn from_mode(mode: u32) -> Option<FileKind> {
        match mode & libc::S_IFMT {
            libc::S_IFREG => Some(FileKind::Regular),
            libc::S_IFDIR => Some(FileKind::Dir),
            libc::S_IFLNK => Some(FileKind::Symlink),
            libc::S_IFIFO => Some(FileKind::Fifo),
            libc::S_IFCHR => Some(FileKind::CharDev),
            libc::S_IFBLK => Some(FileKind::BlockDev),
            libc::S_IFSOCK => Some(FileKind::Socket),
            _ => None,
        }
    }
}

/// True for an overlay whiteout: a character device with device number 0:0.
pub(crate) fn is_whiteout(mode: u32, rdev: u64) -> bool {
    mode & libc::S_IFMT == libc::S_IFCHR && rdev == 0
}

/// One resolved path of a [`LayerView`], from `lstat(2)` of the winning layer's inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// File type.
    pub kind: FileKind,
    /// Permission bits including setuid, setgid and sticky (`st_mode & 0o7777`).
    pub mode: u32,
    /// Owner user id.
    pub uid: u32,
    /// Owner group id.
    pub gid: u32,
    /// `st_size` in bytes (for a symlink: the length of its target).
    pub size: u64,
    /// `st_rdev` (device number of a device node, 0 otherwise).
    pub rdev: u64,
    /// Modification time: seconds and nanoseconds since the Unix epoch.
    pub mtime: (i64, i64),
    /// Index into [`LayerView::layers`] of the layer the entry comes from
    /// (for a merged directory: the newest layer holding it, whose attributes win).
    pub layer_index: usize,
}

impl Entry {
    /// From `lstat`'s answer (as [`Entry::from_metadata`]).
    #[allow(clippy::unnecessary_cast)] // the field types differ between targets
    fn from_stat(st: &rustix::fs::Stat, layer_index: usize) -> Option<Entry> {
        let mode = st.st_mode as u32;
        Some(Entry {
            kind: FileKind::from_mode(mode)?,
            mode: mode & 0o7777,
            uid: st.st_uid as u32,
            gid: st.st_gid as u32,
            size: st.st_size as u64,
            rdev: st.st_rdev as u64,
            mtime: (st.st_mtime as i64, st.st_mtime_nsec as i64),
            layer_index,
        })
    }

    fn from_metadata(md: &std::fs::Metadata, layer_index: usize) -> Option<Entry> {
        Some(Entry {
            kind: FileKind::from_mode(md.mode())?,
            mode: md.mode() & 0o7777,
            uid: md.uid(),
            gid: md.gid(),
            size: md.size(),
            rdev: md.rdev(),
            mtime: (md.mtime(), md.mtime_nsec()),
            layer_index,
        })
    }
}

/// A read-only, merged view of overlay-format layer directories, newest first:
/// what an overlay mount with `lowerdir=layers[0]:layers[1]:…` would show.
///
/// Paths given to it are relative byte strings: no leading `/`, components separated
/// by a single `/`, no `.` or `..` components, no NUL; the empty string is the root.
/// Others are refused with [`io::ErrorKind::InvalidInput`].
///
/// Nothing is ever followed: every layer entry is examined with `lstat(2)`, and an
/// older layer is only looked into below a component that every contributing layer
/// holds as a real directory. Layers are immutable, so there is no race to defend
/// against. A layer directory that does not exist contributes nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerView {
    layers: Vec<PathBuf>,
    userxattr: bool,
}

/// A merged directory of a view: its relative path and the layers that contribute
/// to its content, newest first.
#[derive(Debug, Clone)]
pub(crate) struct Cursor {
    rel: Vec<u8>,
    run: Vec<usize>,
}

/// The result of resolving one name inside a [`Cursor`].
#[derive(Debug)]
pub(crate) struct Step {
    /// The visible entry, `None` when the name does not exist or is whited out.
    pub entry: Option<Entry>,
    /// For a directory entry: the cursor to resolve its children.
    pub dir: Option<Cursor>,
}

impl LayerView {
    /// A view of `layers`, newest first (the order of overlay's `lowerdir=`).
    #[must_use]
    pub fn new(layers: Vec<PathBuf>) -> LayerView {
        LayerView {
            layers,
            userxattr: false,
        }
    }

    /// Read the layers as an overlay mounted with `userxattr` (rootless) does:
    /// `user.overlay.opaque` = `y` marks an opaque directory and
    /// `trusted.overlay.opaque` is ordinary data (the kernel reads only the mount's
    /// own namespace).
    #[must_use]
    pub fn with_userxattr(mut self, userxattr: bool) -> LayerView {
        self.userxattr = userxattr;
        self
    }

    /// The layer directories, newest first.
    #[must_use]
    pub fn layers(&self) -> &[PathBuf] {
        &self.layers
    }

    /// Resolves `rel` as overlayfs would and returns what is visible there.
    ///
    /// `Ok(None)` when nothing is visible: the name exists in no layer, is whited
    /// out, is hidden by an opaque directory, or an ancestor resolves to a
    /// non-directory. `lookup(b"")` returns the root of the newest layer.
    ///
    /// # Errors
    /// [`io::ErrorKind::InvalidInput`] for a malformed `rel`; any `lstat(2)` or
    /// `lgetxattr(2)` error other than `ENOENT`/`ENOTDIR`.
    pub fn lookup(&self, rel: &[u8]) -> io::Result<Option<Entry>> {
        self.lookups().lookup(rel)
    }

    /// A walker for many lookups in a row (see [`Lookups`]).
    #[must_use]
    pub fn lookups(&self) -> Lookups<'_> {
        // The contributing layers' directories stay open from one component to
        // the next: a component costs an `fstatat` per layer (and an `openat`
        // and `fgetxattr` per directory), never a walk from a layer's root.
        Lookups {
            view: self,
            names: Vec::new(),
            dirs: vec![self
                .layers
                .iter()
                .enumerate()
                .map(|(i, l)| (i, crate::fsx::Parent::Base(l)))
                .collect()],
        }
    }

    /// One component of a lookup (`ovl_lookup` for one name, lower layers
    /// only), the one resolution [`lookup`](Self::lookup), [`Lookups`] and
    /// [`step`](Self::step) share: the entry `name` resolves to in the merged
    /// directory `dirs` (its contributing layers, newest first, each opened),
    /// and — with `descend`, when it is a directory — its own contributing
    /// layers, opened.
    fn step_open<'v>(
        &'v self,
        dirs: &[(usize, crate::fsx::Parent<'v>)],
        name: &[u8],
        descend: bool,
    ) -> io::Result<(Option<Entry>, OpenDirs<'v>)> {
        let mut found: Option<Entry> = None;
        let mut run = Vec::new();
        for (i, parent) in dirs {
            let st = match parent.lstat(name) {
                Ok(st) => st,
                Err(e) if absent(&e) => continue,
                Err(e) => return Err(e),
            };
            #[allow(clippy::unnecessary_cast)]
            let (mode, rdev) = (st.st_mode as u32, st.st_rdev as u64);
            if is_whiteout(mode, rdev) {
                break;
            }
            if mode & libc::S_IFMT != libc::S_IFDIR {
                if found.is_none() {
                    found = Entry::from_stat(&st, *i);
                }
                break;
            }
            if found.is_none() {
                found = Entry::from_stat(&st, *i);
            }
            let Some(fd) = parent.open_dir(name)? else {
                // Replaced since the lstat (only a live upper can change).
                break;
            };
            let opaque = crate::fsx::xattr_is_y(&fd, opaque_name(self.userxattr))?;
            if descend {
                run.push((*i, crate::fsx::Parent::Fd(fd)));
            }
            if opaque {
                break;
            }
        }
        if found.is_none_or(|e| e.kind != FileKind::Dir) {
            run.clear();
        }
        Ok((found, run))
    }

    /// The names visible in the merged directory `rel`, sorted bytewise, without
    /// `.` and `..`: whiteouts removed, entries of older layers included unless
    /// hidden by a whiteout, a non-directory or an opaque directory.
    ///
    /// This follows the kernel's *lookup*: every listed name resolves with
    /// [`lookup`](Self::lookup). (The kernel's readdir of a directory held by a single
    /// layer passes that directory through unfiltered, so a whiteout there shows up in
    /// `readdir` although `stat` says `ENOENT`; this view never lists it.)
    ///
    /// # Errors
    /// [`io::ErrorKind::NotFound`] when nothing is visible at `rel`; `ENOTDIR` when it
    /// is not a directory; [`io::ErrorKind::InvalidInput`] for a malformed `rel`;
    /// any error from reading a layer directory.
    pub fn list_dir(&self, rel: &[u8]) -> io::Result<Vec<Vec<u8>>> {
        let comps = split_rel(rel)?;
        let mut cursor = self.root();
        if self.root_entry()?.is_none() {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        for comp in &comps {
            let step = self.step(&cursor, comp)?;
            match (step.entry, step.dir) {
                (_, Some(dir)) => cursor = dir,
                (Some(_), None) => return Err(io::Error::from_raw_os_error(libc::ENOTDIR)),
                (None, None) => return Err(io::Error::from(io::ErrorKind::NotFound)),
            }
        }
        self.names(&cursor)
    }

    /// The visible names of the merged directory `cursor` (see [`list_dir`](Self::list_dir)).
    pub(crate) fn names(&self, cursor: &Cursor) -> io::Result<Vec<Vec<u8>>> {
        // The newest layer holding a name decides: a whiteout hides it, anything
        // else shows it (overlayfs readdir, fs/overlayfs/readdir.c).
        let mut seen: BTreeMap<Vec<u8>, bool> = BTreeMap::new();
        for &i in &cursor.run {
            let dir = crate::fsx::at(&self.layers[i], &cursor.rel)?;
            for dent in std::fs::read_dir(dir.path())? {
                let dent = dent?;
                let name = dent.file_name().as_bytes().to_vec();
                if seen.contains_key(&name) {
                    continue;
                }
                let whiteout = dent.file_type()?.is_char_device() && dent.metadata()?.rdev() == 0;
                seen.insert(name, !whiteout);
            }
        }
        Ok(seen
            .into_iter()
            .filter_map(|(name, visible)| visible.then_some(name))
            .collect())
    }

    /// The cursor of the merged root: every layer contributes.
    pub(crate) fn root(&self) -> Cursor {
        Cursor {
            rel: Vec::new(),
            run: (0..self.layers.len()).collect(),
        }
    }

    fn root_entry(&self) -> io::Result<Option<Entry>> {
        for (i, layer) in self.layers.iter().enumerate() {
            match std::fs::symlink_metadata(layer) {
                Ok(md) if md.is_dir() => return Ok(Entry::from_metadata(&md, i)),
                Ok(_) => return Ok(None),
                Err(e) if absent(&e) => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// The directory of layer `index`.
    pub(crate) fn layer(&self, index: usize) -> &Path {
        &self.layers[index]
    }

    /// The content of the regular file visible at `rel` (`O_NOFOLLOW`; reached
    /// through descriptors when the path is long). `Ok(None)` when nothing or
    /// something other than a regular file is visible there.
    ///
    /// # Errors
    /// As [`lookup`](Self::lookup), and any error reading the file.
    pub fn read_regular(&self, rel: &[u8]) -> io::Result<Option<Vec<u8>>> {
        match self.lookup(rel)? {
            Some(e) if e.kind == FileKind::Regular => {
                crate::fsx::read_file(&self.layers[e.layer_index], rel).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The content of the regular file `entry` that [`lookup`](Self::lookup)
    /// of `rel` returned (no second lookup).
    ///
    /// # Errors
    /// [`io::ErrorKind::InvalidInput`] when `entry` is not a regular file; any
    /// error opening or reading it.
    pub fn read_entry(&self, rel: &[u8], entry: &Entry) -> io::Result<Vec<u8>> {
        if entry.kind != FileKind::Regular {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "read_entry of an entry that is not a regular file",
            ));
        }
        crate::fsx::read_file(&self.layers[entry.layer_index], rel)
    }

    /// The regular file visible at `rel`, opened for reading (`O_NOFOLLOW`), for
    /// streaming; `Ok(None)` when nothing or something else is visible there.
    ///
    /// # Errors
    /// As [`lookup`](Self::lookup), and any error opening the file.
    pub fn open_regular(&self, rel: &[u8]) -> io::Result<Option<std::fs::File>> {
        match self.lookup(rel)? {
            Some(e) if e.kind == FileKind::Regular => {
                crate::fsx::open_read(&self.layers[e.layer_index], rel).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The target of the symlink visible at `rel` (never followed). `Ok(None)`
    /// when nothing or something other than a symlink is visible there.
    ///
    /// # Errors
    /// As [`lookup`](Self::lookup), and any error reading the link.
    pub fn read_symlink(&self, rel: &[u8]) -> io::Result<Option<Vec<u8>>> {
        match self.lookup(rel)? {
            Some(e) if e.kind == FileKind::Symlink => {
                crate::fsx::read_link(&self.layers[e.layer_index], rel).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Resolves the single component `name` inside the merged directory `dir`
    /// (`ovl_lookup` for one component, lower layers only).
    pub(crate) fn step(&self, dir: &Cursor, name: &[u8]) -> io::Result<Step> {
        // The cursor's directories opened afresh in each layer (a cursor holds
        // no descriptors), then the same resolution as a lookup's.
        let mut dirs = Vec::with_capacity(dir.run.len());
        for &i in &dir.run {
            match crate::fsx::Parent::open(&self.layers[i], &dir.rel) {
                Ok(p) => dirs.push((i, p)),
                Err(e) if absent(&e) => continue,
                Err(e) => return Err(e),
            }
        }
        let (entry, run) = self.step_open(&dirs, name, true)?;
        let dir = match entry {
            Some(e) if e.kind == FileKind::Dir => Some(Cursor {
                rel: join_rel(&dir.rel, name),
                run: run.into_iter().map(|(i, _)| i).collect(),
            }),
            _ => None,
        };
        Ok(Step { entry, dir })
    }
}

/// Many [`LayerView::lookup`]s in a row, sharing the directories of the
/// previous path: the contributing layers' directories of its ancestors stay
/// open, so a path in the same directory as the last one costs one `fstatat`
/// per contributing layer instead of a walk from the root. Give paths in byte
/// order for the most sharing; any order gives the same answers. Holds at most
/// (depth × contributing layers) descriptors.
pub struct Lookups<'v> {
    view: &'v LayerView,
    /// `names[k]` is the k-th component of the directory `dirs[k + 1]` is;
    /// `dirs[0]` is the root's layers.
    names: Vec<Vec<u8>>,
    dirs: Vec<Vec<(usize, crate::fsx::Parent<'v>)>>,
}

impl<'v> Lookups<'v> {
    /// What [`LayerView::lookup`] of `rel` returns.
    ///
    /// # Errors
    /// As [`LayerView::lookup`].
    pub fn lookup(&mut self, rel: &[u8]) -> io::Result<Option<Entry>> {
        let comps = split_rel(rel)?;
        let Some((last, parents)) = comps.split_last() else {
            return self.view.root_entry();
        };
        let keep = self
            .names
            .iter()
            .zip(parents.iter())
            .take_while(|(a, b)| a.as_slice() == **b)
            .count();
        self.names.truncate(keep);
        self.dirs.truncate(keep + 1);
        for comp in &parents[keep..] {
            let Some(dirs) = self.dirs.last() else {
                return Ok(None);
            };
            match self.view.step_open(dirs, comp, true)? {
                (Some(e), next) if e.kind == FileKind::Dir => {
                    self.names.push(comp.to_vec());
                    self.dirs.push(next);
                }
                _ => return Ok(None),
            }
        }
        match self.dirs.last() {
            Some(dirs) => Ok(self.view.step_open(dirs, last, false)?.0),
            None => Ok(None),
        }
    }

    /// [`LayerView::read_entry`].
    ///
    /// # Errors
    /// As [`LayerView::read_entry`].
    pub fn read_entry(&self, rel: &[u8], entry: &Entry) -> io::Result<Vec<u8>> {
        self.view.read_entry(rel, entry)
    }

    /// What [`LayerView::read_regular`] of `rel` returns.
    ///
    /// # Errors
    /// As [`LayerView::read_regular`].
    pub fn read_regular(&mut self, rel: &[u8]) -> io::Result<Option<Vec<u8>>> {
        match self.lookup(rel)? {
            Some(e) if e.kind == FileKind::Regular => self.view.read_entry(rel, &e).map(Some),
            _ => Ok(None),
        }
    }
}

/// `ENOENT` or `ENOTDIR` (or `ELOOP` from a descriptor walk meeting a symlink):
/// the name is simply not in that layer.
fn absent(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound
        || matches!(e.raw_os_error(), Some(libc::ENOTDIR) | Some(libc::ELOOP))
}

#[cfg(test)]
/// True when the directory at `path` carries the opaque xattr of the mount's
/// namespace ([`opaque_name`]) with value `y` (read with `lgetxattr(2)`, never
/// following a symlink).
pub(crate) fn is_opaque_path(path: &Path, userxattr: bool) -> io::Result<bool> {
    opaque_value(xattr::get(path, opaque_name(userxattr)))
}

/// Interprets the result of reading an opaque xattr: `y` is opaque; absent, any
/// other value, or a filesystem without xattr support is not.
pub(crate) fn opaque_value(value: io::Result<Option<Vec<u8>>>) -> io::Result<bool> {
    match value {
        Ok(v) => Ok(v.as_deref() == Some(b"y")),
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `parent/name`, or `name` at the root.
pub(crate) fn join_rel(parent: &[u8], name: &[u8]) -> Vec<u8> {
    let mut rel = Vec::with_capacity(parent.len() + 1 + name.len());
    if !parent.is_empty() {
        rel.extend_from_slice(parent);
        rel.push(b'/');
    }
    rel.extend_from_slice(name);
    rel
}

/// Splits a relative path into components, refusing malformed ones.
fn split_rel(rel: &[u8]) -> io::Result<Vec<&[u8]>> {
    if rel.is_empty() {
        return Ok(Vec::new());
    }
    let comps: Vec<&[u8]> = rel.split(|&b| b == b'/').collect();
    let bad = comps
        .iter()
        .any(|c| c.is_empty() || *c == b"." || *c == b".." || c.contains(&0));
    if bad {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "malformed relative path: want components separated by single '/', no '.', '..' or NUL",
        ));
    }
    Ok(comps)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::testutil::*;

    /// Three layer directories `l0` (newest) … `l2` under `t`.
    fn three_layers(t: &tempfile::TempDir) -> (PathBuf, PathBuf, PathBuf) {
        let l = |n: &str| t.path().join(n);
        (l("l0"), l("l1"), l("l2"))
    }

    #[test]
    fn newest_layer_wins_and_dirs_merge() {
        let t = tmp();
        let (l0, l1) = (t.path().join("l0"), t.path().join("l1"));
        write(&l1, "d/old", b"old", 0o644);
        write(&l1, "d/shared", b"lower", 0o644);
        write(&l0, "d/shared", b"upper!", 0o600);
        write(&l0, "d/new", b"n", 0o644);
        let v = LayerView::new(vec![l0, l1]);
        let e = v.lookup(b"d/shared").unwrap().unwrap();
        assert_eq!(
            (e.kind, e.mode, e.size, e.layer_index),
            (FileKind::Regular, 0o600, 6, 0)
        );
        assert_eq!(v.lookup(b"d/old").unwrap().unwrap().layer_index, 1);
        assert_eq!(v.lookup(b"d").unwrap().unwrap().layer_index, 0);
        assert_eq!(v.lookup(b"d/missing").unwrap(), None);
        assert_eq!(v.list_dir(b"d").unwrap(), names(&["new", "old", "shared"]));
        assert_eq!(v.lookup(b"").unwrap().unwrap().kind, FileKind::Dir);
    }

    #[test]
    fn whiteout_hides_older_layers() {
        if !have_root("whiteout_hides_older_layers") {
            return;
        }
        let t = tmp();
        let (l0, l1) = (t.path().join("l0"), t.path().join("l1"));
        write(&l1, "d/gone", b"x", 0o644);
        write(&l1, "d/kept", b"x", 0o644);
        write(&l1, "dir/child", b"x", 0o644);
        whiteout(&l0, "d/gone");
        whiteout(&l0, "dir");
        let v = LayerView::new(vec![l0, l1]);
        assert_eq!(v.lookup(b"d/gone").unwrap(), None);
        assert_eq!(v.lookup(b"dir").unwrap(), None);
        assert_eq!(v.lookup(b"dir/child").unwrap(), None);
        assert!(v.lookup(b"d/kept").unwrap().is_some());
        assert_eq!(v.list_dir(b"d").unwrap(), names(&["kept"]));
        assert_eq!(v.list_dir(b"").unwrap(), names(&["d"]));
    }

    #[test]
    fn whiteout_in_a_middle_layer_ends_a_directory_merge() {
        if !have_root("whiteout_in_a_middle_layer_ends_a_directory_merge") {
            return;
        }
        let t = tmp();
        let (l0, l1, l2) = three_layers(&t);
        write(&l0, "d/top", b"x", 0o644);
        whiteout(&l1, "d");
        write(&l2, "d/buried", b"x", 0o644);
        let v = LayerView::new(vec![l0, l1, l2]);
        assert_eq!(v.lookup(b"d").unwrap().unwrap().layer_index, 0);
        assert_eq!(v.lookup(b"d/buried").unwrap(), None);
        assert_eq!(v.list_dir(b"d").unwrap(), names(&["top"]));
    }

    #[test]
    fn a_shared_walker_answers_as_fresh_lookups_in_any_order() {
        let t = tmp();
        let (l0, l1, l2) = three_layers(&t);
        write(&l2, "o/ancient", b"x", 0o644);
        write(&l2, "a/b/c", b"x", 0o644);
        write(&l2, "a/x/deep/f", b"2", 0o644);
        write(&l1, "o/old", b"x", 0o644);
        write(&l1, "a/x/deep/g", b"1", 0o644);
        write(&l0, "o/fresh", b"x", 0o644);
        write(&l0, "a/b", b"a file over the directory", 0o644);
        write(&l0, "a/x/deep/f", b"0", 0o644);
        symlink(&l0, "a/s", b"x");
        xattr::set(l1.join("o"), USER_OPAQUE, b"y").unwrap();
        let v = LayerView::new(vec![l0, l1, l2]).with_userxattr(true);
        let mut paths: Vec<&[u8]> = vec![
            b"",
            b"a",
            b"a/b",
            b"a/b/c",
            b"a/s",
            b"a/s/deep/f",
            b"a/x",
            b"a/x/deep",
            b"a/x/deep/f",
            b"a/x/deep/g",
            b"a/x/deep/missing",
            b"a/x/nope/f",
            b"o/ancient",
            b"o/fresh",
            b"o/old",
            b"zz/top",
        ];
        let fresh: Vec<Option<Entry>> = paths.iter().map(|p| v.lookup(p).unwrap()).collect();
        // What the layers hold, so that a walker agreeing with a broken lookup fails.
        let order = paths.clone();
        let at = |p: &[u8]| fresh[order.iter().position(|q| *q == p).unwrap()];
        assert_eq!(at(b"a/b").unwrap().kind, FileKind::Regular);
        assert_eq!(at(b"a/b/c"), None);
        assert_eq!(at(b"a/s/deep/f"), None);
        assert_eq!(at(b"a/x/deep/f").unwrap().layer_index, 0);
        assert_eq!(at(b"a/x/deep/g").unwrap().layer_index, 1);
        assert_eq!(at(b"o/ancient"), None);
        assert_eq!(at(b"o/old").unwrap().layer_index, 1);
        for round in 0..3 {
            match round {
                1 => paths.reverse(),
                2 => paths.sort_by_key(|p| (p.len() % 3, p.to_vec())),
                _ => {}
            }
            let mut walker = v.lookups();
            for p in &paths {
                assert_eq!(
                    walker.lookup(p).unwrap(),
                    at(p),
                    "round {round}, path {}",
                    String::from_utf8_lossy(p)
                );
            }
        }
        assert_eq!(
            v.lookups().read_regular(b"a/x/deep/f").unwrap().unwrap(),
            b"0"
        );
    }

    #[test]
    fn opaque_dir_hides_older_content_user_xattr() {
        // user.overlay.opaque needs no privilege, so this one runs everywhere.
        let t = tmp();
        let (l0, l1, l2) = three_layers(&t);
        write(&l2, "o/ancient", b"x", 0o644);
        write(&l1, "o/old", b"x", 0o644);
        write(&l1, "o/sub/f", b"x", 0o644);
        write(&l0, "o/fresh", b"x", 0o644);
        xattr::set(l1.join("o"), USER_OPAQUE, b"y").unwrap();
        let plain = LayerView::new(vec![l0.clone(), l1.clone(), l2.clone()]);
        assert!(
            plain.lookup(b"o/ancient").unwrap().is_some(),
            "user xattr ignored without userxattr"
        );
        let v = plain.with_userxattr(true);
        assert_eq!(v.lookup(b"o/ancient").unwrap(), None);
        assert_eq!(v.lookup(b"o/old").unwrap().unwrap().layer_index, 1);
        assert_eq!(v.lookup(b"o/sub/f").unwrap().unwrap().layer_index, 1);
        assert_eq!(v.list_dir(b"o").unwrap(), names(&["fresh", "old", "sub"]));
    }

    #[test]
    fn opaque_dir_hides_older_content_trusted_xattr() {
        if !have_root("opaque_dir_hides_older_content_trusted_xattr") {
            return;
        }
        let t = tmp();
        let (l0, l1) = (t.path().join("l0"), t.path().join("l1"));
        write(&l1, "o/old", b"x", 0o644);
        write(&l0, "o/fresh", b"x", 0o644);
        xattr::set(l0.join("o"), TRUSTED_OPAQUE, b"y").unwrap();
        write(&l0, "p/fresh", b"x", 0o644);
        write(&l1, "p/old", b"x", 0o644);
        // Only the exact value "y" is opaque.
        xattr::set(l0.join("p"), TRUSTED_OPAQUE, b"n").unwrap();
        let v = LayerView::new(vec![l0, l1]);
        assert_eq!(v.lookup(b"o/old").unwrap(), None);
        assert_eq!(v.list_dir(b"o").unwrap(), names(&["fresh"]));
        assert!(v.lookup(b"p/old").unwrap().is_some());
        // A userxattr mount reads only user.overlay.*: the trusted marker is data.
        let v = v.with_userxattr(true);
        assert!(v.lookup(b"o/old").unwrap().is_some());
    }

    #[test]
    fn non_directory_at_ancestor_hides_everything_below() {
        let t = tmp();
        let (l0, l1) = (t.path().join("l0"), t.path().join("l1"));
        write(&l1, "a/b/c", b"x", 0o644);
        write(&l0, "a/b", b"now a file", 0o644);
        symlink(&l0, "s", b"../l1/a");
        write(&l1, "s/inner", b"x", 0o644);
        let v = LayerView::new(vec![l0.clone(), l1.clone()]);
        assert_eq!(v.lookup(b"a/b").unwrap().unwrap().kind, FileKind::Regular);
        assert_eq!(v.lookup(b"a/b/c").unwrap(), None);
        // A symlink is a non-directory too, and is never followed.
        assert_eq!(v.lookup(b"s").unwrap().unwrap().kind, FileKind::Symlink);
        assert_eq!(v.lookup(b"s/inner").unwrap(), None);
        // Below the root too (reached through descriptors): a symlink to a
        // directory outside, or to an older layer's directory, is not entered.
        let outside = t.path().join("outside");
        write(&outside, "secret", b"host file", 0o600);
        write(&l0, "d/keep", b"k", 0o644);
        std::os::unix::fs::symlink(&outside, l0.join("d/host")).unwrap();
        symlink(&l0, "d/up", b"../../l1/a");
        let v = LayerView::new(vec![l0.clone(), l1.clone()]);
        assert_eq!(
            v.lookup(b"d/host").unwrap().unwrap().kind,
            FileKind::Symlink
        );
        assert_eq!(v.lookup(b"d/host/secret").unwrap(), None);
        assert_eq!(v.read_regular(b"d/host/secret").unwrap(), None);
        assert_eq!(v.lookup(b"d/up/b/c").unwrap(), None);
        assert_eq!(v.read_regular(b"d/keep").unwrap().unwrap(), b"k");
        assert_eq!(
            v.list_dir(b"s").unwrap_err().raw_os_error(),
            Some(libc::ENOTDIR)
        );
        assert_eq!(
            v.list_dir(b"zzz").unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
    }

    #[test]
    fn directory_above_older_non_directory_does_not_merge_with_it() {
        let t = tmp();
        let (l0, l1, l2) = three_layers(&t);
        write(&l0, "x/new", b"x", 0o644);
        write(&l1, "x", b"file in the middle", 0o644);
        write(&l2, "x/buried", b"x", 0o644);
        let v = LayerView::new(vec![l0, l1, l2]);
        assert_eq!(v.lookup(b"x").unwrap().unwrap().kind, FileKind::Dir);
        assert_eq!(v.lookup(b"x/buried").unwrap(), None);
        assert_eq!(v.list_dir(b"x").unwrap(), names(&["new"]));
    }

    #[test]
    fn malformed_paths_are_refused() {
        let v = LayerView::new(vec![]);
        for bad in [&b"/abs"[..], b"a//b", b"a/", b"./a", b"a/../b", b"a\0b"] {
            let err = v.lookup(bad).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{bad:?}");
        }
        assert_eq!(v.lookup(b"").unwrap(), None);
    }

    #[test]
    fn byte_names_are_exact() {
        let t = tmp();
        let l0 = t.path().join("l0");
        write_bytes(&l0, b"caf\xe9/\xff\xfe", b"x", 0o644);
        let v = LayerView::new(vec![l0]);
        assert!(v.lookup(b"caf\xe9/\xff\xfe").unwrap().is_some());
        assert_eq!(v.list_dir(b"caf\xe9").unwrap(), vec![b"\xff\xfe".to_vec()]);
    }
}
