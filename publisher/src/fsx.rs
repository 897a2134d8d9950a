//! Path access beneath a base directory that never follows a symlink and works
//! for paths longer than `PATH_MAX`.
//!
//! A relative path below a base directory (an upper or a layer, whose content a
//! container controls) is reached like this:
//! * a single component: the joined path (the base is the daemon's own
//!   directory; the `l*` system calls and `O_NOFOLLOW` do not follow the last
//!   component);
//! * otherwise: the parent directory is opened with `openat2(2)` and
//!   `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS` (Linux ≥ 5.6;
//!   before that, component by component with `openat(O_DIRECTORY|O_NOFOLLOW)`),
//!   and the entry is named as `/proc/self/fd/<parent fd>/<name>` — a short path
//!   whose last component the `l*` system calls resolve without following it.
//!
//! Either way the caller gets an [`At`]: a short path valid while the `At` lives,
//! usable with `lstat`, `readlink`, `l*xattr`, `open(O_NOFOLLOW)`, `unlink`,
//! `rename` and `read_dir`. A symlink in a directory position is never followed:
//! reaching through it fails with `ELOOP`/`ENOTDIR` instead, so a directory
//! swapped for a symlink to `/` between two steps of the daemon cannot steer a
//! read, chmod, chown, xattr write or delete to a host path (ARCHITECTURE.md §8).
//! (The kernel's `PATH_MAX` is 4096 bytes, include/uapi/linux/limits.h.)

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::dir::Dir;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

/// Paths at least this long (in bytes) are reached through descriptors.
pub(crate) const SHORT_PATH: usize = 3072;

/// An open directory; implements [`xattr::FileExt`] (`fgetxattr(2)` and friends).
pub(crate) struct DirFd(pub(crate) Dir);

impl AsRawFd for DirFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl xattr::FileExt for DirFd {}

const DIR_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);

/// Opens the directory `path` itself (a symlink is refused with `ELOOP`).
pub(crate) fn open_dir(path: &Path) -> io::Result<DirFd> {
    Dir::open(path, DIR_FLAGS, Mode::empty())
        .map(DirFd)
        .map_err(io::Error::from)
}

/// Opens the directory `name` inside `dir` (a symlink is refused).
pub(crate) fn open_dir_at(dir: &impl AsRawFd, name: &[u8]) -> io::Result<DirFd> {
    Dir::openat(Some(dir.as_raw_fd()), name, DIR_FLAGS, Mode::empty())
        .map(DirFd)
        .map_err(io::Error::from)
}

/// The names in the open directory `dir` (without `.` and `..`), in byte order.
pub(crate) fn names_of(dir: &impl AsRawFd) -> io::Result<Vec<Vec<u8>>> {
    let mut d = Dir::openat(Some(dir.as_raw_fd()), ".", DIR_FLAGS, Mode::empty())?;
    let mut names = Vec::new();
    for ent in d.iter() {
        let ent = ent?;
        let n = ent.file_name().to_bytes();
        if n != b"." && n != b".." {
            names.push(n.to_vec());
        }
    }
    names.sort();
    Ok(names)
}

/// Opens the directory `rel` below `base` without leaving `base` and without
/// following any symlink (see the module docs). `rel` may be empty: `base`.
pub(crate) fn open_beneath(base: &Path, rel: &[u8]) -> io::Result<DirFd> {
    use std::os::fd::IntoRawFd;
    match Parent::open(base, rel)? {
        Parent::Base(b) => open_dir(b),
        Parent::Fd(fd) => Dir::from_fd(fd.into_raw_fd())
            .map(DirFd)
            .map_err(io::Error::from),
    }
}

/// Opens `rel` below `base` component by component (`rel` may be empty: `base`).
pub(crate) fn walk_dir(base: &Path, rel: &[u8]) -> io::Result<DirFd> {
    let mut dir = open_dir(base)?;
    if rel.is_empty() {
        return Ok(dir);
    }
    for comp in rel.split(|&b| b == b'/') {
        dir = open_dir_at(&dir, comp)?;
    }
    Ok(dir)
}

/// `/proc/self/fd/<fd>/<name>`: names `name` in the open directory `dir` with a
/// short path (the magic link is followed, `name` itself is not by `l*` calls).
/// An empty `name` gives `/proc/self/fd/<fd>/.`, the directory itself (without the
/// `.`, `l*` calls would act on the magic link).
pub(crate) fn proc_path(dir: &impl AsRawFd, name: &[u8]) -> PathBuf {
    let mut p = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
    if name.is_empty() {
        p.push(".");
    } else {
        p.push(OsStr::from_bytes(name));
    }
    p
}

/// `(parent, name)` of a relative path; the parent of a single component is `""`.
pub(crate) fn split_parent(rel: &[u8]) -> (&[u8], &[u8]) {
    match rel.iter().rposition(|&b| b == b'/') {
        Some(i) => (&rel[..i], &rel[i + 1..]),
        None => (&[], rel),
    }
}

/// A short path to `rel` below a base directory; see the module docs. Keeps the
/// parent directory open (when needed) for as long as it lives.
pub(crate) struct At {
    _parent: Option<DirFd>,
    path: PathBuf,
}

impl At {
    /// The short path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

/// Reaches `rel` (relative byte path, may be empty) below `base`; see the
/// module docs.
///
/// # Errors
/// Opening the parent directory failed (`ENOENT`, `ENOTDIR`, `ELOOP` for a
/// symlink or a path leaving `base`, …).
pub(crate) fn at(base: &Path, rel: &[u8]) -> io::Result<At> {
    if rel.is_empty() {
        return Ok(At {
            _parent: None,
            path: base.to_path_buf(),
        });
    }
    let (parent, name) = split_parent(rel);
    if parent.is_empty() {
        return Ok(At {
            _parent: None,
            path: base.join(OsStr::from_bytes(name)),
        });
    }
    let dir = open_beneath(base, parent)?;
    let path = proc_path(&dir, name);
    Ok(At {
        _parent: Some(dir),
        path,
    })
}

/// The directory an entry is named in, for the calls that take a directory
/// and one name (`fstatat`, `openat`, `fgetxattr` of an `openat`): the base
/// itself (named by its path, the daemon's own directory), or a directory below
/// it opened as in [`open_beneath`]. Nothing goes through `/proc/self/fd` and no
/// `DIR` stream is allocated: a lookup costs one `openat2` for the parent and
/// one call per question — the hot path of every [`LayerView`](crate::LayerView)
/// lookup (capture, gate, blame).
pub(crate) enum Parent<'a> {
    Base(&'a Path),
    Fd(std::os::fd::OwnedFd),
}

const RAW_DIR_FLAGS: rustix::fs::OFlags = rustix::fs::OFlags::RDONLY
    .union(rustix::fs::OFlags::DIRECTORY)
    .union(rustix::fs::OFlags::NOFOLLOW)
    .union(rustix::fs::OFlags::CLOEXEC);

impl<'a> Parent<'a> {
    /// The directory `rel` below `base` (empty: `base`); see the module docs.
    ///
    /// # Errors
    /// As [`open_beneath`].
    pub(crate) fn open(base: &'a Path, rel: &[u8]) -> io::Result<Parent<'a>> {
        use rustix::fs::{openat, openat2, Mode as RMode, ResolveFlags, CWD};
        if rel.is_empty() {
            return Ok(Parent::Base(base));
        }
        let root = openat(CWD, base, RAW_DIR_FLAGS, RMode::empty())?;
        let resolve =
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
        match openat2(&root, rel, RAW_DIR_FLAGS, RMode::empty(), resolve) {
            Ok(fd) => Ok(Parent::Fd(fd)),
            // No openat2 (kernel < 5.6, a seccomp filter), or a path longer
            // than PATH_MAX: one component at a time.
            Err(
                rustix::io::Errno::NOSYS | rustix::io::Errno::PERM | rustix::io::Errno::NAMETOOLONG,
            ) => {
                let mut dir = root;
                for comp in rel.split(|&b| b == b'/') {
                    dir = openat(&dir, comp, RAW_DIR_FLAGS, RMode::empty())?;
                }
                Ok(Parent::Fd(dir))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Runs `f` on (directory, name) for `name` in this directory: the
    /// descriptor and `name`, or the current directory and the joined path
    /// for the base itself.
    fn at<T>(
        &self,
        name: &[u8],
        f: impl FnOnce(std::os::fd::BorrowedFd<'_>, &Path) -> rustix::io::Result<T>,
    ) -> io::Result<T> {
        use std::os::fd::AsFd;
        Ok(match self {
            Parent::Base(b) => f(rustix::fs::CWD, &b.join(OsStr::from_bytes(name)))?,
            Parent::Fd(d) => f(d.as_fd(), Path::new(OsStr::from_bytes(name)))?,
        })
    }

    /// `lstat` of `name` in this directory (never following it).
    pub(crate) fn lstat(&self, name: &[u8]) -> io::Result<rustix::fs::Stat> {
        use rustix::fs::{statat, AtFlags};
        self.at(name, |d, n| statat(d, n, AtFlags::SYMLINK_NOFOLLOW))
    }

    /// Opens the directory `name` in this directory (never following it);
    /// `None` when `name` is not a directory (any more).
    pub(crate) fn open_dir(&self, name: &[u8]) -> io::Result<Option<std::os::fd::OwnedFd>> {
        use rustix::fs::{openat, Mode as RMode};
        match self.at(name, |d, n| openat(d, n, RAW_DIR_FLAGS, RMode::empty())) {
            Ok(d) => Ok(Some(d)),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Opens the regular file `name` in this directory read-only, never
    /// following a symlink and never becoming a controlling terminal.
    ///
    /// Anything else is refused (`InvalidInput`, "not a regular file"): the
    /// open does not block on a fifo (`O_NONBLOCK`, which regular files
    /// ignore), and a fifo or a device such as `/dev/zero` is never read (it
    /// could block or never end).
    pub(crate) fn open_read(&self, name: &[u8]) -> io::Result<std::fs::File> {
        use rustix::fs::{openat, Mode as RMode, OFlags};
        let flags =
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NOCTTY | OFlags::CLOEXEC | OFlags::NONBLOCK;
        let fd = self.at(name, |d, n| openat(d, n, flags, RMode::empty()))?;
        let f = std::fs::File::from(fd);
        if !f.metadata()?.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file (a fifo, device, socket or directory)",
            ));
        }
        Ok(f)
    }
}

/// Whether the open directory `dir` carries xattr `key` with the value `y`
/// (`fgetxattr(2)`); `false` when it has none or the filesystem has no xattrs.
pub(crate) fn xattr_is_y(dir: &std::os::fd::OwnedFd, key: &str) -> io::Result<bool> {
    use rustix::io::Errno;
    // Room for one byte more than `y`: a longer value is not `y` (ERANGE).
    let mut buf = [0u8; 2];
    match rustix::fs::fgetxattr(dir, key, &mut buf[..]) {
        Ok(n) => Ok(&buf[..n] == b"y"),
        Err(Errno::NODATA | Errno::RANGE | Errno::OPNOTSUPP) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// `lstat` of `rel` below `base`.
pub(crate) fn lstat(base: &Path, rel: &[u8]) -> io::Result<std::fs::Metadata> {
    std::fs::symlink_metadata(at(base, rel)?.path())
}

/// Opens the regular file `rel` below `base` read-only, never following a symlink
/// and never becoming a controlling terminal.
pub(crate) fn open_read(base: &Path, rel: &[u8]) -> io::Result<std::fs::File> {
    let (parent, name) = split_parent(rel);
    if name.is_empty() {
        // The base itself: not a regular file.
        return Err(io::Error::from_raw_os_error(libc::EISDIR));
    }
    Parent::open(base, parent)?.open_read(name)
}

/// The whole content of the regular file `rel` below `base`.
pub(crate) fn read_file(base: &Path, rel: &[u8]) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let mut f = open_read(base, rel)?;
    let mut v = Vec::new();
    f.read_to_end(&mut v)?;
    Ok(v)
}

/// The target of the symlink `rel` below `base`, verbatim.
pub(crate) fn read_link(base: &Path, rel: &[u8]) -> io::Result<Vec<u8>> {
    let t = std::fs::read_link(at(base, rel)?.path())?;
    Ok(t.into_os_string().into_encoded_bytes())
}

/// Every xattr of the entry at `path` (not following a symlink), sorted by name;
/// an `EOPNOTSUPP` filesystem has none.
pub(crate) fn xattrs_of(path: &Path) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let names = match xattr::list(path) {
        Ok(n) => n,
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for name in names {
        match xattr::get(path, &name) {
            Ok(Some(v)) => out.push((name.as_bytes().to_vec(), v)),
            Ok(None) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENODATA) => {}
            Err(e) => return Err(e),
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::testutil::*;

    #[test]
    fn long_paths_are_reached_through_descriptors() {
        let t = tmp();
        let base = t.path().join("b");
        std::fs::create_dir(&base).unwrap();
        // 40 components of 200 bytes: ~8 KiB, twice PATH_MAX.
        let comp = "d".repeat(200);
        let mut rel = Vec::new();
        let mut dir = open_dir(&base).unwrap();
        for _ in 0..40 {
            nix::sys::stat::mkdirat(
                Some(dir.as_raw_fd()),
                comp.as_str(),
                Mode::from_bits_truncate(0o755),
            )
            .unwrap();
            dir = open_dir_at(&dir, comp.as_bytes()).unwrap();
            if !rel.is_empty() {
                rel.push(b'/');
            }
            rel.extend_from_slice(comp.as_bytes());
        }
        std::fs::write(proc_path(&dir, b"f"), b"deep").unwrap();
        let mut file = rel.clone();
        file.extend_from_slice(b"/f");
        assert!(base.as_os_str().len() + file.len() > 4096);
        assert_eq!(read_file(&base, &file).unwrap(), b"deep");
        assert!(lstat(&base, &file).unwrap().is_file());
        assert!(lstat(&base, &rel).unwrap().is_dir());
        assert_eq!(
            lstat(&base, b"nope/x").unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        assert_eq!(split_parent(b"a/b/c"), (&b"a/b"[..], &b"c"[..]));
        assert_eq!(split_parent(b"c"), (&b""[..], &b"c"[..]));
    }

    #[test]
    fn symlinks_in_directory_position_are_not_followed() {
        let t = tmp();
        let base = t.path().join("b");
        write(&base, "real/f", b"x", 0o644);
        std::os::unix::fs::symlink("real", base.join("link")).unwrap();
        assert!(walk_dir(&base, b"link").is_err());
        assert!(walk_dir(&base, b"real").is_ok());
        // Short paths too: nothing below a symlinked directory is reached.
        write(&base, "real/sub/g", b"y", 0o644);
        assert!(open_beneath(&base, b"link/sub").is_err());
        assert!(lstat(&base, b"link/f").is_err());
        assert!(read_file(&base, b"link/f").is_err());
        assert_eq!(read_file(&base, b"real/f").unwrap(), b"x");
        std::os::unix::fs::symlink("/", base.join("root")).unwrap();
        assert!(
            lstat(&base, b"root/etc").is_err(),
            "a symlink to / is not followed"
        );
        assert!(
            open_beneath(&base, b"real/../..").is_err(),
            "never leaves the base"
        );
    }
}
