//! Error types, one per operation family. Kinds follow containerd's errdefs so the
//! snapshotter adapter can map them to gRPC codes.

use std::path::{Path, PathBuf};

use crate::{LayerId, ManifestId, SessionId};

/// Why [`crate::Store::open`] refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The root is not on local ext4, xfs or btrfs. Nothing was written.
    #[error("store root {root} is on {fs}: unsupported; LayerStack needs a local ext4, xfs or btrfs filesystem (choose another --root)")]
    Unsupported { root: PathBuf, fs: String },
    /// The store was written by another format version (`-1`: not a LayerStack store).
    #[error("store at {root} has format version {found}, this build reads version {expected}: start a fresh store root (stores are never migrated silently)")]
    Version {
        root: PathBuf,
        found: i64,
        expected: i64,
    },
    #[error("store i/o on {0}")]
    Io(PathBuf, #[source] std::io::Error),
    #[error("store database")]
    Db(#[from] rusqlite::Error),
    #[error("startup sweep")]
    Store(#[source] StoreError),
}

/// Failures of containerd snapshot operations.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// errdefs.NotFound
    #[error("snapshot {0} not found")]
    NotFound(String),
    /// errdefs.AlreadyExists — containerd's unpacker relies on it.
    #[error("snapshot {0} already exists")]
    AlreadyExists(String),
    /// errdefs.FailedPrecondition
    #[error("{0}")]
    FailedPrecondition(String),
    /// errdefs.InvalidArgument
    #[error("{0}")]
    InvalidArgument(String),
    #[error("i/o on {0}")]
    Io(PathBuf, #[source] std::io::Error),
    #[error("store database")]
    Db(#[from] rusqlite::Error),
    #[error("internal: {0}")]
    Internal(String),
}

impl SnapshotError {
    pub(crate) fn io(p: &Path, e: std::io::Error) -> Self {
        Self::Io(p.to_path_buf(), e)
    }
}

impl From<StoreError> for SnapshotError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Db(e) => Self::Db(e),
            StoreError::Io(p, e) => Self::Io(p, e),
            other => Self::Internal(other.to_string()),
        }
    }
}

/// Failures of session, branch and history queries.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("session {0} not found")]
    SessionNotFound(SessionId),
    #[error(
        "session {0} holds no lease (nothing mounted since its last publish): nothing to publish"
    )]
    NoLease(SessionId),
    #[error("layer {0} not found")]
    LayerNotFound(LayerId),
    #[error("branch {branch:?} not found on stack {stack}")]
    BranchNotFound { stack: String, branch: String },
    #[error("i/o on {0}")]
    Io(PathBuf, #[source] std::io::Error),
    #[error("store database")]
    Db(#[from] rusqlite::Error),
    #[error("snapshot")]
    Snapshot(#[source] Box<SnapshotError>),
}

impl StoreError {
    pub(crate) fn from_snapshot(e: SnapshotError) -> Self {
        match e {
            SnapshotError::Db(e) => Self::Db(e),
            other => Self::Snapshot(Box::new(other)),
        }
    }
}

/// Failures of [`crate::Store::commit_publish`].
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The branch moved between gating and committing; gate again.
    #[error("branch head moved from manifest {expected} to {found} while publishing")]
    HeadMoved {
        expected: ManifestId,
        found: ManifestId,
    },
    #[error("i/o on {0}")]
    Io(PathBuf, #[source] std::io::Error),
    #[error("store database")]
    Db(#[from] rusqlite::Error),
    #[error(transparent)]
    Store(#[from] StoreError),
}
