//! Unix sockets the daemon serves, taken and given back carefully
//! (ARCHITECTURE.md §8): a socket path that a live process serves is never
//! unlinked or taken over — the daemon refuses to start instead — and at exit a
//! socket is removed only if the path is still the one this daemon bound (a
//! later daemon's socket at the same path is left alone).
//!
//! No window between `bind` and `chmod`: a socket is bound in a fresh directory
//! only its owner can enter (mode 0700, `.b<pid>` beside the final path), given
//! its final mode there, and only then linked to its name (`link(2)`, which
//! never replaces a path that appeared meanwhile). Nobody can connect to it
//! before it has its mode; who may then call is checked per connection
//! (`auth.rs`).

use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// A bound listening socket; removes its path on drop if it is still this one.
pub struct Socket {
    path: PathBuf,
    id: (u64, u64),
    listener: Option<std::os::unix::net::UnixListener>,
}

impl Socket {
    /// Binds `path` (creating its directory) with file mode `mode` (e.g. 0o660:
    /// root and the socket's group may connect), set before the path exists. An
    /// existing socket is replaced only when nothing answers on it (a stale file
    /// left by a crash).
    ///
    /// # Errors
    /// The path is served by a live process, exists and is not a socket, or
    /// cannot be bound; the message names the path and what to do.
    pub fn bind(path: &Path, mode: u32) -> Result<Socket> {
        Self::bind_granting(path, mode, &[], &[])
    }

    /// [`Socket::bind`], and the uids `uids` and gids `gids` may also connect:
    /// a POSIX ACL (`system.posix_acl_access`, acl(5)) grants each of them
    /// read and write, set with the mode before the path exists. The mode stays
    /// what it is (e.g. 0660): the socket is never world-writable, whoever is
    /// allowed; the daemon's per-connection peer check still decides
    /// (`auth.rs`).
    ///
    /// # Errors
    /// As [`Socket::bind`]; and, when some are granted, a filesystem without
    /// POSIX ACLs (the message names it and what to do).
    pub fn bind_granting(path: &Path, mode: u32, uids: &[u32], gids: &[u32]) -> Result<Socket> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create socket directory {}", dir.display()))?;
        }
        match std::fs::symlink_metadata(path) {
            Ok(md) if md.file_type().is_socket() => {
                match std::os::unix::net::UnixStream::connect(path) {
                    Ok(_) => bail!(
                        "socket {} is served by another live process (another daemon?): stop it, or give this daemon another address",
                        path.display()
                    ),
                    Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                        // Stale: nothing listens. Safe to replace.
                        std::fs::remove_file(path).with_context(|| {
                            format!("cannot remove stale socket {}", path.display())
                        })?;
                    }
                    Err(e) => {
                        return Err(e).with_context(|| {
                            format!("cannot tell whether socket {} is in use", path.display())
                        })
                    }
                }
            }
            Ok(_) => bail!(
                "{} exists and is not a socket: remove it or choose another address",
                path.display()
            ),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("cannot stat {}", path.display())),
        }
        let listener = bind_private(path, mode, uids, gids)?;
        let md = std::fs::symlink_metadata(path)
            .with_context(|| format!("cannot stat {}", path.display()))?;
        listener.set_nonblocking(true)?;
        Ok(Socket {
            path: path.to_path_buf(),
            id: (md.dev(), md.ino()),
            listener: Some(listener),
        })
    }

    /// The listener, for the async server (once).
    pub fn listener(&self) -> Result<tokio::net::UnixListener> {
        let l = self
            .listener
            .as_ref()
            .context("socket listener taken")?
            .try_clone()?;
        Ok(tokio::net::UnixListener::from_std(l)?)
    }
}

/// Binds a socket in a directory only this process's user can enter, sets its
/// mode, links it to `path` and removes the private name (module doc).
fn bind_private(
    path: &Path,
    mode: u32,
    uids: &[u32],
    gids: &[u32],
) -> Result<std::os::unix::net::UnixListener> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or_else(|| Path::new("."));
    // Short, so the private path is hardly longer than the final one (a unix
    // socket path holds at most 107 bytes).
    let private = dir.join(format!(".b{}", std::process::id()));
    // A leftover of a crashed process that had this pid: nothing serves it.
    let _ = std::fs::remove_dir_all(&private);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&private)
        .with_context(|| format!("cannot create {}", private.display()))?;
    let tmp = private.join("s");
    let bound = (|| {
        let l = std::os::unix::net::UnixListener::bind(&tmp)
            .with_context(|| format!("cannot listen on {}", path.display()))?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("cannot set mode of {}", path.display()))?;
        if !uids.is_empty() || !gids.is_empty() {
            xattr::set(&tmp, "system.posix_acl_access", &access_acl(mode, uids, gids))
                .with_context(|| {
                    format!(
                        "cannot grant uids {uids:?} and gids {gids:?} access to {} with a POSIX ACL (its filesystem must support ACLs, as ext4, xfs and tmpfs do): move the socket to such a filesystem, or allow only root",
                        path.display()
                    )
                })?;
        }
        match std::fs::hard_link(&tmp, path) {
            Ok(()) => Ok(l),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => bail!(
                "socket {} appeared while this daemon was binding it (another daemon starting?): stop it, or give this daemon another address",
                path.display()
            ),
            Err(e) => Err(e).with_context(|| format!("cannot create socket {}", path.display())),
        }
    })();
    let _ = std::fs::remove_file(&tmp);
    let _ = std::fs::remove_dir(&private);
    bound
}

/// The binary `system.posix_acl_access` value (acl(5); the kernel's
/// `posix_acl_xattr` format, version 2: a header, then `{tag u16, perm u16, id
/// u32}` little-endian entries sorted by tag then id): the owner, group and
/// other bits of `mode`, plus read-write for each of `uids` and `gids`, and a
/// mask of read-write so they take effect.
fn access_acl(mode: u32, uids: &[u32], gids: &[u32]) -> Vec<u8> {
    const USER_OBJ: u16 = 0x01;
    const USER: u16 = 0x02;
    const GROUP_OBJ: u16 = 0x04;
    const GROUP: u16 = 0x08;
    const MASK: u16 = 0x10;
    const OTHER: u16 = 0x20;
    const UNDEFINED: u32 = u32::MAX;
    const RW: u16 = 6;
    let bits = |shift: u32| ((mode >> shift) & 7) as u16;
    let mut uids = uids.to_vec();
    let mut gids = gids.to_vec();
    uids.sort_unstable();
    uids.dedup();
    gids.sort_unstable();
    gids.dedup();
    let mut entries = vec![(USER_OBJ, bits(6), UNDEFINED)];
    entries.extend(uids.iter().map(|u| (USER, RW, *u)));
    entries.push((GROUP_OBJ, bits(3), UNDEFINED));
    entries.extend(gids.iter().map(|g| (GROUP, RW, *g)));
    entries.push((MASK, RW | bits(3), UNDEFINED));
    entries.push((OTHER, bits(0), UNDEFINED));
    let mut out = 2u32.to_le_bytes().to_vec();
    for (tag, perm, id) in entries {
        out.extend_from_slice(&tag.to_le_bytes());
        out.extend_from_slice(&perm.to_le_bytes());
        out.extend_from_slice(&id.to_le_bytes());
    }
    out
}

impl Drop for Socket {
    fn drop(&mut self) {
        self.listener.take();
        if let Ok(md) = std::fs::symlink_metadata(&self.path) {
            if (md.dev(), md.ino()) == self.id {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_live_socket_is_never_taken_over_and_a_stale_one_is() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("s.sock");
        let first = Socket::bind(&p, 0o660).unwrap();
        let e = Socket::bind(&p, 0o660).err().unwrap().to_string();
        assert!(e.contains("served by another live process"), "{e}");
        assert!(p.exists(), "the live socket is untouched");
        // The first owner goes away without cleaning up (crash): stale file.
        let mut first = first;
        first.listener.take();
        std::mem::forget(first);
        let second = Socket::bind(&p, 0o660).unwrap();
        // A later socket at the path is not removed by an earlier owner's drop.
        let id = second.id;
        drop(second);
        assert!(!p.exists());
        let _ = id;
        std::fs::write(&p, b"x").unwrap();
        let e = Socket::bind(&p, 0o660).err().unwrap().to_string();
        assert!(e.contains("is not a socket"), "{e}");
    }

    #[test]
    fn a_socket_has_its_mode_when_it_appears_and_leaves_no_private_dir() {
        let t = tempfile::tempdir().unwrap();
        for mode in [0o660, 0o666] {
            let p = t.path().join(format!("m{mode:o}.sock"));
            let s = Socket::bind(&p, mode).unwrap();
            let md = std::fs::symlink_metadata(&p).unwrap();
            assert!(md.file_type().is_socket());
            assert_eq!(md.mode() & 0o7777, mode);
            assert_eq!(md.nlink(), 1, "the private name is gone");
            std::os::unix::net::UnixStream::connect(&p).unwrap();
            drop(s);
        }
        let left: Vec<_> = std::fs::read_dir(t.path()).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn the_acl_grants_the_listed_ids_read_write_and_keeps_the_mode() {
        let acl = access_acl(0o660, &[1000, 65534, 1000], &[42]);
        assert_eq!(acl[..4], 2u32.to_le_bytes(), "version 2");
        let entries: Vec<(u16, u16, u32)> = acl[4..]
            .chunks(8)
            .map(|e| {
                (
                    u16::from_le_bytes([e[0], e[1]]),
                    u16::from_le_bytes([e[2], e[3]]),
                    u32::from_le_bytes([e[4], e[5], e[6], e[7]]),
                )
            })
            .collect();
        assert_eq!(
            entries,
            vec![
                (0x01, 6, u32::MAX),
                (0x02, 6, 1000),
                (0x02, 6, 65534),
                (0x04, 6, u32::MAX),
                (0x08, 6, 42),
                (0x10, 6, u32::MAX),
                (0x20, 0, u32::MAX),
            ],
            "owner, users sorted and deduplicated, group, groups, mask, other"
        );
    }
}
