//! The store's errors. Every error type carries an [`ErrorKind`] (containerd's
//! errdefs, `errdefs/errors.go`), which front ends map to their wire codes in one
//! place (`layerstack_api::status` maps them to gRPC).

use std::path::{Path, PathBuf};

use crate::{LayerId, ManifestId, SessionId};

/// containerd's error classes (errdefs), one spelling each; defined in the
/// vocabulary crate so that clients share it without linking the store.
pub use layerstack_types::ErrorKind;

/// Why [`crate::Store::open`] refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The root is not on local ext4, xfs or btrfs. Nothing was written.
    #[error("store root {root} is on {fs}: unsupported; LayerStack needs a local ext4, xfs or btrfs filesystem (choose another --root)")]
    Unsupported { root: PathBuf, fs: String },
    /// The store was written by another format version (`-1`: not a LayerStack store).
    #[error("store at {root} has format version {found}, this build reads version {expected}: {}", version_advice(root, *found, *expected))]
    Version {
        root: PathBuf,
        found: i64,
        expected: i64,
    },
    /// Another process holds the store's lock.
    #[error("store {root} is in use by another daemon (pid {pid}; lock file {lock}): stop it first, or give this one another --root")]
    Locked {
        root: PathBuf,
        lock: PathBuf,
        pid: String,
    },
    #[error("store i/o on {0}")]
    Io(PathBuf, #[source] std::io::Error),
    #[error("store database")]
    Db(#[from] rusqlite::Error),
    #[error("startup sweep")]
    Store(#[source] StoreError),
}

impl OpenError {
    /// The errdefs class of this error.
    #[must_use]
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Unsupported { .. } | Self::Version { .. } => ErrorKind::Unsupported,
            Self::Locked { .. } => ErrorKind::Unavailable,
            Self::Io(_, e) if layerstack_types::is_no_space(e) => ErrorKind::NoSpace,
            Self::Db(e) if db_full(e) => ErrorKind::NoSpace,
            Self::Io(..) | Self::Db(_) => ErrorKind::Internal,
            Self::Store(e) => e.kind(),
        }
    }
}

/// What to do about a store of format `found` when this build reads `expected`
/// (older formats it can migrate never get here).
fn version_advice(root: &std::path::Path, found: i64, expected: i64) -> String {
    if found > expected {
        // A downgrade: the store is fine, the binary is old. Never suggest
        // removing it.
        "it was written by a newer LayerStack: run that version (or a newer one) on it; \
         a store is never converted back to an older format, and this build changed nothing"
            .to_string()
    } else {
        format!(
            "start a fresh store root (formats this old are not migrated; the old one can be \
             removed with `rm -rf {}` once nothing uses it)",
            root.display()
        )
    }
}

/// Whether SQLite answered `SQLITE_FULL` (it could not grow the database or
/// its WAL: the filesystem is full) or an i/o error whose cause is `ENOSPC`.
fn db_full(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::DiskFull)
        || layerstack_types::is_no_space(e)
}

/// Failures of store operations: containerd's snapshot calls, sessions, history.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A containerd snapshot key or name that does not exist.
    #[error("snapshot {0} not found")]
    SnapshotNotFound(String),
    /// A name that is taken (a graph's); the message names it and what to do.
    #[error("{0}")]
    AlreadyExists(String),
    /// A containerd snapshot key or name that is taken.
    #[error("snapshot {0} already exists")]
    SnapshotExists(String),
    #[error("session {0} not found")]
    SessionNotFound(SessionId),
    #[error("stack {0} not found")]
    StackNotFound(String),
    #[error("branch {branch:?} not found on stack {stack}")]
    BranchNotFound { stack: String, branch: String },
    #[error("layer {0} not found")]
    LayerNotFound(LayerId),
    /// Another named thing (a graph, a node) that does not exist; the message
    /// names it and where to look.
    #[error("{0}")]
    NotFound(String),
    #[error(
        "session {0} holds no lease (nothing mounted since its last outcome): nothing to publish"
    )]
    NoLease(SessionId),
    /// The branch moved between planning and committing: plan again.
    #[error("branch head moved from manifest {expected} to {found} while publishing")]
    HeadMoved {
        expected: ManifestId,
        found: ManifestId,
    },
    /// The operation cannot run in the current state; the message says what to do.
    #[error("{0}")]
    FailedPrecondition(String),
    /// Bad input; the message names it and what is accepted.
    #[error("{0}")]
    InvalidArgument(String),
    /// A limit is reached.
    #[error("{0}")]
    Busy(String),
    /// A row that does not parse, or a directory a row promises that is not there.
    #[error("corrupt store: table {table}, {key}: {detail}; the row is left as it is (restore it or remove what uses it)")]
    Corrupt {
        table: &'static str,
        key: String,
        detail: String,
    },
    #[error("i/o on {0}")]
    Io(PathBuf, #[source] std::io::Error),
    #[error("store database")]
    Db(#[from] rusqlite::Error),
}

impl StoreError {
    /// The errdefs class of this error.
    #[must_use]
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::SnapshotNotFound(_)
            | Self::SessionNotFound(_)
            | Self::StackNotFound(_)
            | Self::BranchNotFound { .. }
            | Self::LayerNotFound(_)
            | Self::NotFound(_) => ErrorKind::NotFound,
            Self::SnapshotExists(_) | Self::AlreadyExists(_) => ErrorKind::AlreadyExists,
            Self::NoLease(_) | Self::FailedPrecondition(_) => ErrorKind::FailedPrecondition,
            Self::HeadMoved { .. } => ErrorKind::Conflict,
            Self::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Self::Busy(_) => ErrorKind::Busy,
            Self::Corrupt { .. } => ErrorKind::Corrupt,
            Self::Io(_, e) if layerstack_types::is_no_space(e) => ErrorKind::NoSpace,
            Self::Io(..) => ErrorKind::Internal,
            Self::Db(e) if db_full(e) => ErrorKind::NoSpace,
            // SQLITE_BUSY past the busy timeout: another writer holds the database.
            Self::Db(rusqlite::Error::SqliteFailure(e, _))
                if e.code == rusqlite::ErrorCode::DatabaseBusy =>
            {
                ErrorKind::Unavailable
            }
            Self::Db(_) => ErrorKind::Internal,
        }
    }

    pub(crate) fn io(p: &Path, e: std::io::Error) -> Self {
        Self::Io(p.to_path_buf(), e)
    }

    /// A row of `table` that cannot be what it says (`Corrupt`).
    pub fn corrupt(
        table: &'static str,
        key: impl std::fmt::Display,
        detail: impl std::fmt::Display,
    ) -> Self {
        Self::Corrupt {
            table,
            key: key.to_string(),
            detail: detail.to_string(),
        }
    }
}

/// Result of store operations.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// The kind a caller must act on (free space), whichever layer saw the
    /// full disk: a write's `ENOSPC`/`EDQUOT`, SQLite's `SQLITE_FULL`.
    #[test]
    fn a_full_disk_is_no_space_whoever_reports_it() {
        let io = |n| StoreError::io(Path::new("/s/l/1"), std::io::Error::from_raw_os_error(n));
        assert_eq!(io(libc::ENOSPC).kind(), ErrorKind::NoSpace);
        assert_eq!(io(libc::EDQUOT).kind(), ErrorKind::NoSpace);
        assert_eq!(io(libc::EIO).kind(), ErrorKind::Internal);
        let db = |code| {
            StoreError::Db(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(code),
                None,
            ))
        };
        assert_eq!(db(rusqlite::ffi::SQLITE_FULL).kind(), ErrorKind::NoSpace);
        assert_eq!(db(rusqlite::ffi::SQLITE_IOERR).kind(), ErrorKind::Internal);
        let open = OpenError::Io(
            PathBuf::from("/s"),
            std::io::Error::from_raw_os_error(libc::ENOSPC),
        );
        assert_eq!(open.kind(), ErrorKind::NoSpace);
    }
}
