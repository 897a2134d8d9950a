//! Turning a captured upper into an immutable lower layer.

use std::ffi::OsString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

/// Why [`seal_layer`] failed. Paths are absolute (under the sealed directory).
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
/// `trusted.overlay.*` and `user.overlay.*` (origin, impure, nlink, redirect,
/// metacopy, upper, uuid, …) except `*.overlay.opaque`, which is part of the layer
/// format (Documentation/filesystems/overlayfs.rst). Stale `origin`/`impure` in a
/// lower could make a later mount misreport inode numbers.
fn is_private_xattr(name: &[u8]) -> bool {
    for prefix in [&b"trusted.overlay."[..], b"user.overlay."] {
        if let Some(rest) = name.strip_prefix(prefix) {
            return rest != b"opaque";
        }
    }
    false
}

/// Prepares the captured, quiescent upper `dir` to be an immutable lower layer:
///
/// 1. walks it without following symlinks (`lstat`, `llistxattr`, `lremovexattr`)
///    and removes every overlay-private xattr (see above) from every entry,
///    including `dir` itself; whiteouts and `*.overlay.opaque` are kept;
/// 2. removes sockets (capture skips them, so they are never published);
/// 3. makes it durable with one `syncfs(2)` on `dir`.
///
/// The layer is otherwise the upper as is: copy-up noise stays (it shadows an
/// identical lease file; the gate checks such paths against the head).
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
pub fn seal_layer(dir: &Path) -> Result<(), SealError> {
    strip_tree(dir)?;
    let sync_err = |source| SealError::Sync {
        path: dir.to_path_buf(),
        source,
    };
    let root = std::fs::File::open(dir).map_err(sync_err)?;
    nix::unistd::syncfs(root.as_raw_fd()).map_err(|e| sync_err(e.into()))?;
    tracing::debug!(layer = %dir.display(), "sealed layer");
    Ok(())
}

fn strip_tree(dir: &Path) -> Result<(), SealError> {
    strip_xattrs(dir)?;
    let read_err = |source| SealError::Read {
        path: dir.to_path_buf(),
        source,
    };
    for dent in std::fs::read_dir(dir).map_err(read_err)? {
        let dent = dent.map_err(read_err)?;
        let path = dent.path();
        // DirEntry::file_type never follows a symlink.
        let ft = dent.file_type().map_err(|source| SealError::Read {
            path: path.clone(),
            source,
        })?;
        if ft.is_socket() {
            std::fs::remove_file(&path)
                .map_err(|source| SealError::RemoveSocket { path, source })?;
        } else if ft.is_dir() {
            strip_tree(&path)?;
        } else {
            strip_xattrs(&path)?;
        }
    }
    Ok(())
}

fn strip_xattrs(path: &Path) -> Result<(), SealError> {
    let names = match xattr::list(path) {
        Ok(names) => names,
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => return Ok(()),
        Err(source) => {
            return Err(SealError::ListXattr {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    for name in names.filter(|n| is_private_xattr(n.as_bytes())) {
        match xattr::remove(path, &name) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENODATA) => {}
            Err(source) => {
                return Err(SealError::RemoveXattr {
                    path: path.to_path_buf(),
                    name,
                    source,
                })
            }
        }
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
        assert!(is_private_xattr(b"trusted.overlay.origin"));
        assert!(is_private_xattr(b"trusted.overlay.impure"));
        assert!(is_private_xattr(b"user.overlay.redirect"));
        assert!(is_private_xattr(b"trusted.overlay.opaquex"));
        assert!(!is_private_xattr(b"trusted.overlay.opaque"));
        assert!(!is_private_xattr(b"user.overlay.opaque"));
        assert!(!is_private_xattr(b"user.mime_type"));
        assert!(!is_private_xattr(b"security.capability"));
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
        seal_layer(&up).unwrap();
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
