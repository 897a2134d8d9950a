//! Unix sockets the daemon serves, taken and given back carefully
//! (ARCHITECTURE.md §8): a socket path that a live process serves is never
//! unlinked or taken over — the daemon refuses to start instead — and at exit a
//! socket is removed only if the path is still the one this daemon bound (a
//! later daemon's socket at the same path is left alone).

use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// A bound listening socket; removes its path on drop if it is still this one.
pub struct Socket {
    path: PathBuf,
    id: (u64, u64),
    listener: Option<std::os::unix::net::UnixListener>,
}

impl Socket {
    /// Binds `path` (creating its directory), mode 0660. An existing socket is
    /// replaced only when nothing answers on it (a stale file left by a crash).
    ///
    /// # Errors
    /// The path is served by a live process, exists and is not a socket, or
    /// cannot be bound; the message names the path and what to do.
    pub fn bind(path: &Path) -> Result<Socket> {
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
        let listener = std::os::unix::net::UnixListener::bind(path)
            .with_context(|| format!("cannot listen on {}", path.display()))?;
        // Only root (and the socket's group) may talk to the daemon, whatever the umask.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
            .with_context(|| format!("cannot set mode of {}", path.display()))?;
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
        let first = Socket::bind(&p).unwrap();
        let e = Socket::bind(&p).err().unwrap().to_string();
        assert!(e.contains("served by another live process"), "{e}");
        assert!(p.exists(), "the live socket is untouched");
        // The first owner goes away without cleaning up (crash): stale file.
        let mut first = first;
        first.listener.take();
        std::mem::forget(first);
        let second = Socket::bind(&p).unwrap();
        // A later socket at the path is not removed by an earlier owner's drop.
        let id = second.id;
        drop(second);
        assert!(!p.exists());
        let _ = id;
        std::fs::write(&p, b"x").unwrap();
        let e = Socket::bind(&p).err().unwrap().to_string();
        assert!(e.contains("is not a socket"), "{e}");
    }
}
