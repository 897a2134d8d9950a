//! The store's owner lock: `<root>/lock`, an exclusive `flock(2)` held for the
//! life of the daemon (ARCHITECTURE.md §8). The file holds the owner's pid, so a
//! refused second daemon can name the first.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

use crate::error::OpenError;

/// An exclusive lock on a store root. Dropping it releases the lock (the kernel
/// also releases it when the process dies, so a crash never leaves it stuck).
pub struct StoreLock {
    _lock: Flock<File>,
    path: PathBuf,
}

impl StoreLock {
    /// Takes the lock of the store at `root` (created if missing), without
    /// waiting, and records this process's pid in it.
    ///
    /// # Errors
    /// [`OpenError::Unsupported`] (before anything is written) when the root is
    /// not on local ext4, xfs or btrfs; [`OpenError::Locked`] naming the holder's
    /// pid when another process holds it; [`OpenError::Io`] otherwise.
    pub fn acquire(root: &Path) -> Result<StoreLock, OpenError> {
        let io = |e| OpenError::Io(root.to_path_buf(), e);
        // Refuse an unsupported filesystem before writing anything (even the lock).
        if let Err(found) = crate::fs::check_supported_fs(root).map_err(io)? {
            return Err(OpenError::Unsupported {
                root: root.to_path_buf(),
                fs: found,
            });
        }
        std::fs::create_dir_all(root).map_err(io)?;
        let path = root.join("lock");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| OpenError::Io(path.clone(), e))?;
        let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(l) => l,
            Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
                let mut pid = String::new();
                let _ = file.read_to_string(&mut pid);
                let pid = pid.trim();
                return Err(OpenError::Locked {
                    root: root.to_path_buf(),
                    lock: path,
                    pid: if pid.is_empty() {
                        "unknown".into()
                    } else {
                        pid.to_string()
                    },
                });
            }
            Err((_, e)) => return Err(OpenError::Io(path, std::io::Error::from(e))),
        };
        let write = |f: &mut File| -> std::io::Result<()> {
            f.set_len(0)?;
            f.seek(SeekFrom::Start(0))?;
            writeln!(f, "{}", std::process::id())?;
            f.sync_all()
        };
        write(&mut lock).map_err(|e| OpenError::Io(path.clone(), e))?;
        Ok(StoreLock { _lock: lock, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_naming_the_holder() {
        let t = tempfile::Builder::new()
            .prefix("ls-lock-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let first = StoreLock::acquire(t.path()).unwrap();
        let err = StoreLock::acquire(t.path()).err().unwrap();
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        assert!(matches!(err, OpenError::Locked { .. }));
        drop(first);
        StoreLock::acquire(t.path()).unwrap();
    }
}
