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
        let listener = bind_private(path, mode)?;
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
fn bind_private(path: &Path, mode: u32) -> Result<std::os::unix::net::UnixListener> {
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
}
