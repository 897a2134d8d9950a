//! Turning a captured upper into an immutable lower layer.
//!
//! Every walk here is fd-relative (one open directory per level, entries named as
//! `/proc/self/fd/<dir>/<name>` for the `l*` calls), so paths longer than
//! `PATH_MAX` work and nothing is ever followed.

use std::ffi::OsString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use nix::fcntl::AtFlags;
use nix::sys::stat::{Mode, SFlag};
use nix::unistd::UnlinkatFlags;

use crate::capture::{is_overlay_private, Changeset};
use crate::fsx::{self, DirFd};
use crate::view::{opaque_name, TRUSTED_OPAQUE, USER_OPAQUE};

/// Why [`seal_layer`] or [`prepare_upper`] failed. Paths are absolute (under the
/// sealed directory) or, for long paths, relative to it.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// `lstat(2)` or reading a directory failed.
    #[error("cannot read {}", .path.display())]
    Read {
        /// The entry.
        path: PathBuf,
        /// The system call error.
        #[source]
        source: io::Error,
    },
    /// `llistxattr(2)` failed.
    #[error("cannot list xattrs of {}", .path.display())]
    ListXattr {
        /// The entry.
        path: PathBuf,
        /// The system call error.
        #[source]
        source: io::Error,
    },
    /// `lremovexattr(2)` failed.
    #[error("cannot remove xattr {} from {}", .name.to_string_lossy(), .path.display())]
    RemoveXattr {
        /// The entry.
        path: PathBuf,
        /// The xattr name.
        name: OsString,
        /// The system call error.
        #[source]
        source: io::Error,
    },
    /// Removing a socket (never published) failed.
    #[error("cannot remove socket {}", .path.display())]
    RemoveSocket {
        /// The socket.
        path: PathBuf,
        /// The system call error.
        #[source]
        source: io::Error,
    },
    /// Editing the upper ([`prepare_upper`]) failed.
    #[error("cannot {what} {}", .path.display())]
    Edit {
        /// What was being done.
        what: &'static str,
        /// The entry, relative to the upper.
        path: PathBuf,
        /// The system call error.
        #[source]
        source: io::Error,
    },
    /// `syncfs(2)` reported an error (including earlier writeback errors).
    #[error("cannot sync the filesystem of {}", .path.display())]
    Sync {
        /// The sealed directory.
        path: PathBuf,
        /// The system call error.
        #[source]
        source: io::Error,
    },
}

/// True for an overlay-private xattr that must not survive into a lower layer:
/// the mount's private namespace (`trusted.overlay.*`, or `user.overlay.*` with
/// `userxattr`: origin, impure, nlink, redirect, metacopy, upper, uuid, …) except
/// `*.overlay.opaque`, which is part of the layer format, and escaped names
/// (`*.overlay.overlay.*`), which are data (Documentation/filesystems/overlayfs.rst).
/// Stale `origin`/`impure` in a lower could make a later mount misreport inode numbers.
fn is_private_xattr(name: &[u8], userxattr: bool) -> bool {
    if name == TRUSTED_OPAQUE.as_bytes() || name == USER_OPAQUE.as_bytes() {
        return false;
    }
    is_overlay_private(name, userxattr)
}

/// [`seal_layer_with`] for an upper of a normal (privileged) overlay mount.
///
/// # Errors
/// As [`seal_layer_with`].
pub fn seal_layer(dir: &Path) -> Result<(), SealError> {
    seal_layer_with(dir, false)
}

/// Prepares the captured, quiescent upper `dir` to be an immutable lower layer:
///
/// 1. walks it without following anything (one open directory per level) and
///    removes every overlay-private xattr (see above; `userxattr` names the
///    namespace the session was mounted with) from every entry, including `dir`
///    itself; whiteouts, `*.overlay.opaque` and escaped `*.overlay.overlay.*` are kept;
/// 2. removes sockets (capture skips them, so they are never published);
/// 3. makes it durable with one `syncfs(2)` on `dir`.
///
/// The layer is otherwise the upper as is: copy-up noise stays (it shadows an
/// identical lease file; the gate checks such paths against the head), holes of
/// sparse files and hardlinks between upper files are kept (the directory is
/// renamed, never copied).
///
/// Why `syncfs` rather than an `fsync` per file and directory: one call covers the
/// data, inodes, xattr removals and directory entries of the whole tree; on ext4
/// and xfs every `fsync` forces its own journal commit, so per-file syncing of a
/// large upper costs one commit per file. The price is that other dirty data on the
/// same filesystem is flushed too. Since Linux 5.8 `syncfs` reports writeback
/// errors that happened since the descriptor was opened.
///
/// # Errors
/// [`SealError`] with the failing path; the tree may then be partially stripped.
pub fn seal_layer_with(dir: &Path, userxattr: bool) -> Result<(), SealError> {
    seal(dir, userxattr, true)
}

/// [`seal_layer_with`] without the final `syncfs(2)`: for a store whose
/// durability profile does not promise to survive an OS crash (ARCHITECTURE.md
/// §8, *Disposable*). The upper is renamed into the store, never copied, so a
/// crash of the daemon alone loses nothing either way; what is skipped is only
/// the flush to disk, which on a busy filesystem costs every concurrent publish
/// a wait for all dirty data.
///
/// # Errors
/// As [`seal_layer_with`], without [`SealError::Sync`].
pub fn seal_layer_unsynced(dir: &Path, userxattr: bool) -> Result<(), SealError> {
    seal(dir, userxattr, false)
}

fn seal(dir: &Path, userxattr: bool, durable: bool) -> Result<(), SealError> {
    let root = fsx::open_dir(dir).map_err(|source| SealError::Read {
        path: dir.to_path_buf(),
        source,
    })?;
    strip_xattrs(dir, dir, userxattr)?;
    strip_tree(&root, dir, &mut Vec::new(), userxattr)?;
    if durable {
        sync(dir)?;
    }
    tracing::debug!(layer = %dir.display(), "sealed layer");
    Ok(())
}

/// `syncfs(2)` on the filesystem holding `dir`.
pub(crate) fn sync(dir: &Path) -> Result<(), SealError> {
    let sync_err = |source| SealError::Sync {
        path: dir.to_path_buf(),
        source,
    };
    let root = std::fs::File::open(dir).map_err(sync_err)?;
    nix::unistd::syncfs(root.as_raw_fd()).map_err(|e| sync_err(e.into()))
}

fn shown(base: &Path, rel: &[u8]) -> PathBuf {
    if base.as_os_str().len() + rel.len() < fsx::SHORT_PATH {
        base.join(std::ffi::OsStr::from_bytes(rel))
    } else {
        PathBuf::from(OsString::from_vec(rel.to_vec()))
    }
}

fn strip_tree(
    dir: &DirFd,
    base: &Path,
    rel: &mut Vec<u8>,
    userxattr: bool,
) -> Result<(), SealError> {
    let mut names = Vec::new();
    {
        let read_err = |source| SealError::Read {
            path: shown(base, rel),
            source,
        };
        let mut d = nix::dir::Dir::openat(
            Some(dir.as_raw_fd()),
            ".",
            nix::fcntl::OFlag::O_RDONLY
                | nix::fcntl::OFlag::O_DIRECTORY
                | nix::fcntl::OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| read_err(e.into()))?;
        for dent in d.iter() {
            let dent = dent.map_err(|e| read_err(e.into()))?;
            let name = dent.file_name().to_bytes();
            if name != b"." && name != b".." {
                names.push(name.to_vec());
            }
        }
    }
    for name in names {
        let len = rel.len();
        if !rel.is_empty() {
            rel.push(b'/');
        }
        rel.extend_from_slice(&name);
        let st = nix::sys::stat::fstatat(
            Some(dir.as_raw_fd()),
            name.as_slice(),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| SealError::Read {
            path: shown(base, rel),
            source: e.into(),
        })?;
        let fmt = st.st_mode & libc::S_IFMT;
        if fmt == libc::S_IFSOCK {
            nix::unistd::unlinkat(
                Some(dir.as_raw_fd()),
                name.as_slice(),
                UnlinkatFlags::NoRemoveDir,
            )
            .map_err(|e| SealError::RemoveSocket {
                path: shown(base, rel),
                source: e.into(),
            })?;
        } else if fmt == libc::S_IFDIR {
            let sub = fsx::open_dir_at(dir, &name).map_err(|source| SealError::Read {
                path: shown(base, rel),
                source,
            })?;
            strip_xattrs(&fsx::proc_path(&sub, b""), &shown(base, rel), userxattr)?;
            strip_tree(&sub, base, rel, userxattr)?;
        } else {
            strip_xattrs(&fsx::proc_path(dir, &name), &shown(base, rel), userxattr)?;
        }
        rel.truncate(len);
    }
    Ok(())
}

/// Removes the private xattrs of the entry at the short path `path` (`shown` is
/// the path for messages).
fn strip_xattrs(path: &Path, shown: &Path, userxattr: bool) -> Result<(), SealError> {
    let names = match xattr::list(path) {
        Ok(names) => names,
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => return Ok(()),
        Err(source) => {
            return Err(SealError::ListXattr {
                path: shown.to_path_buf(),
                source,
            })
        }
    };
    for name in names.filter(|n| is_private_xattr(n.as_bytes(), userxattr)) {
        match xattr::remove(path, &name) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENODATA) => {}
            Err(source) => {
                return Err(SealError::RemoveXattr {
                    path: shown.to_path_buf(),
                    name,
                    source,
                })
            }
        }
    }
    Ok(())
}

/// Carries out the [`UpperEdits`](crate::UpperEdits) of `changeset` on the quiescent
/// upper `upper`, so that the upper publishes exactly the changeset:
///
/// 1. removes every excluded path (whole subtrees);
/// 2. removes sockets that hide a lease path and puts a whiteout there, and
///    creates the per-path whiteouts of expanded opaque directories;
/// 3. removes the opaque xattr of the mount's namespace (`trusted.overlay.opaque`,
///    or `user.overlay.opaque` with `userxattr`) of expanded directories;
/// 4. sets the upper root's mode, owner and xattrs back to the lease root's
///    ([`UpperEdits::root`](crate::UpperEdits)): the root directory's metadata is
///    never published.
///
/// Idempotent. Everything is reached through descriptors without following
/// symlinks. Not durable by itself: [`seal_layer_with`] syncs afterwards.
///
/// # Errors
/// [`SealError::Edit`] with the path.
pub fn prepare_upper(
    upper: &Path,
    changeset: &Changeset,
    userxattr: bool,
) -> Result<(), SealError> {
    let edits = &changeset.edits;
    let err = |what: &'static str, rel: &[u8]| {
        let path = PathBuf::from(OsString::from_vec(rel.to_vec()));
        move |source: io::Error| SealError::Edit { what, path, source }
    };
    for (rel, _) in &edits.remove {
        remove_tree_at(upper, rel).map_err(err("remove excluded path", rel))?;
    }
    for rel in &edits.whiteouts {
        let (parent, name) = fsx::split_parent(rel);
        let dir = fsx::walk_dir(upper, parent).map_err(err("open the parent of", rel))?;
        match nix::sys::stat::fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) if crate::view::is_whiteout(st.st_mode, st.st_rdev) => continue,
            Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFSOCK => {
                nix::unistd::unlinkat(Some(dir.as_raw_fd()), name, UnlinkatFlags::NoRemoveDir)
                    .map_err(|e| err("remove socket", rel)(e.into()))?;
            }
            Ok(_) => {
                return Err(err("create a whiteout at", rel)(
                    io::Error::from_raw_os_error(libc::EEXIST),
                ))
            }
            Err(nix::errno::Errno::ENOENT) => {}
            Err(e) => return Err(err("stat", rel)(e.into())),
        }
        nix::sys::stat::mknodat(
            Some(dir.as_raw_fd()),
            name,
            SFlag::S_IFCHR,
            Mode::empty(),
            nix::sys::stat::makedev(0, 0),
        )
        .map_err(|e| err("create a whiteout at", rel)(e.into()))?;
    }
    for rel in &edits.unopaque {
        let dir = fsx::walk_dir(upper, rel).map_err(err("open", rel))?;
        let path = fsx::proc_path(&dir, b"");
        match xattr::remove(&path, opaque_name(userxattr)) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ENODATA) | Some(libc::EOPNOTSUPP)
                ) => {}
            Err(e) => return Err(err("remove the opaque xattr of", rel)(e)),
        }
    }
    if let Some(root) = &edits.root {
        // Owner before mode (chown may clear setgid); the opaque marker and
        // overlay-private xattrs are left alone.
        let meta = crate::meta::Meta {
            mode: root.mode,
            uid: root.uid,
            gid: root.gid,
            xattrs: root.xattrs.clone(),
        };
        let dir = fsx::open_dir(upper).map_err(err("open", b""))?;
        crate::meta::set_meta(&fsx::proc_path(&dir, b""), &meta, userxattr)
            .map_err(err("reset the metadata of the root directory", b""))?;
    }
    Ok(())
}

/// Removes `rel` below `base` and, for a directory, everything below it
/// (descriptor-relative; `ENOENT` is success).
pub(crate) fn remove_tree_at(base: &Path, rel: &[u8]) -> io::Result<()> {
    let (parent, name) = fsx::split_parent(rel);
    let dir = match fsx::walk_dir(base, parent) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    remove_entry(&dir, name)
}

fn remove_entry(dir: &DirFd, name: &[u8]) -> io::Result<()> {
    let st =
        match nix::sys::stat::fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(nix::errno::Errno::ENOENT) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
    if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
        let sub = fsx::open_dir_at(dir, name)?;
        let mut names = Vec::new();
        {
            let mut d = nix::dir::Dir::openat(
                Some(sub.as_raw_fd()),
                ".",
                nix::fcntl::OFlag::O_RDONLY
                    | nix::fcntl::OFlag::O_DIRECTORY
                    | nix::fcntl::OFlag::O_CLOEXEC,
                Mode::empty(),
            )?;
            for dent in d.iter() {
                let dent = dent?;
                let n = dent.file_name().to_bytes();
                if n != b"." && n != b".." {
                    names.push(n.to_vec());
                }
            }
        }
        for n in names {
            remove_entry(&sub, &n)?;
        }
        nix::unistd::unlinkat(Some(dir.as_raw_fd()), name, UnlinkatFlags::RemoveDir)?;
    } else {
        nix::unistd::unlinkat(Some(dir.as_raw_fd()), name, UnlinkatFlags::NoRemoveDir)?;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::testutil::*;

    fn xattrs(path: &Path) -> Vec<Vec<u8>> {
        let mut v: Vec<Vec<u8>> = xattr::list(path)
            .unwrap()
            .map(|n| n.as_bytes().to_vec())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn private_xattr_names() {
        assert!(is_private_xattr(b"trusted.overlay.origin", false));
        assert!(is_private_xattr(b"trusted.overlay.impure", false));
        assert!(is_private_xattr(b"user.overlay.redirect", true));
        assert!(
            !is_private_xattr(b"user.overlay.redirect", false),
            "data on a trusted mount"
        );
        assert!(
            !is_private_xattr(b"trusted.overlay.origin", true),
            "not the userxattr namespace"
        );
        assert!(is_private_xattr(b"trusted.overlay.opaquex", false));
        assert!(!is_private_xattr(b"trusted.overlay.opaque", false));
        assert!(!is_private_xattr(b"user.overlay.opaque", true));
        assert!(
            !is_private_xattr(b"trusted.overlay.overlay.origin", false),
            "escaped: data"
        );
        assert!(
            !is_private_xattr(b"user.overlay.overlay.x", true),
            "escaped: data"
        );
        assert!(!is_private_xattr(b"user.mime_type", false));
        assert!(!is_private_xattr(b"security.capability", false));
    }

    #[test]
    fn user_overlay_xattrs_are_stripped_and_opaque_kept() {
        // user.* needs no privilege: this variant runs everywhere.
        let t = tmp();
        let up = t.path().join("upper");
        write(&up, "d/f", b"x", 0o644);
        xattr::set(up.join("d/f"), "user.overlay.origin", b"\x00\xfb").unwrap();
        xattr::set(up.join("d/f"), "user.keep", b"v").unwrap();
        xattr::set(up.join("d"), "user.overlay.opaque", b"y").unwrap();
        xattr::set(up.join("d"), "user.overlay.impure", b"y").unwrap();
        xattr::set(&up, "user.overlay.uuid", b"u").unwrap();
        socket(&up, "d/s.sock");
        seal_layer_with(&up, true).unwrap();
        assert_eq!(xattrs(&up.join("d/f")), names(&["user.keep"]));
        assert_eq!(xattrs(&up.join("d")), names(&["user.overlay.opaque"]));
        assert_eq!(xattrs(&up), Vec::<Vec<u8>>::new());
        assert!(!up.join("d/s.sock").exists(), "socket removed");
        assert_eq!(std::fs::read(up.join("d/f")).unwrap(), b"x");
    }

    #[test]
    fn trusted_overlay_xattrs_are_stripped_and_opaque_kept() {
        if !have_root("trusted_overlay_xattrs_are_stripped_and_opaque_kept") {
            return;
        }
        let t = tmp();
        let up = t.path().join("upper");
        write(&up, "o/f", b"x", 0o644);
        whiteout(&up, "gone");
        symlink(&up, "link", b"/nowhere");
        for (rel, name) in [
            ("o/f", "trusted.overlay.origin"),
            ("o/f", "trusted.overlay.nlink"),
            ("o/f", "trusted.overlay.metacopy"),
            ("o", "trusted.overlay.impure"),
            ("o", "trusted.overlay.redirect"),
            ("link", "trusted.overlay.origin"),
            ("gone", "trusted.overlay.origin"),
        ] {
            xattr::set(up.join(rel), name, b"v").unwrap();
        }
        xattr::set(up.join("o"), "trusted.overlay.opaque", b"y").unwrap();
        xattr::set(up.join("o/f"), "trusted.other", b"keep").unwrap();
        seal_layer(&up).unwrap();
        assert_eq!(xattrs(&up.join("o")), names(&["trusted.overlay.opaque"]));
        assert_eq!(xattrs(&up.join("o/f")), names(&["trusted.other"]));
        assert_eq!(xattrs(&up.join("link")), Vec::<Vec<u8>>::new());
        assert_eq!(xattrs(&up.join("gone")), Vec::<Vec<u8>>::new());
        // The symlink was not followed, and the whiteout is still a whiteout.
        assert_eq!(
            std::fs::read_link(up.join("link")).unwrap(),
            Path::new("/nowhere")
        );
        let md = std::fs::symlink_metadata(up.join("gone")).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert!(crate::view::is_whiteout(md.mode(), md.rdev()));
    }

    #[test]
    fn missing_dir_is_an_error() {
        let t = tmp();
        let err = seal_layer(&t.path().join("nope")).unwrap_err();
        assert!(
            matches!(err, SealError::ListXattr { .. } | SealError::Read { .. }),
            "{err:?}"
        );
    }
}
