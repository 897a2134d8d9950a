//! The engine's errors. A gate conflict is an outcome, not an error.

use std::path::PathBuf;

use layerstack_publisher as publisher;
use layerstack_store::{ErrorKind, ManifestId, SessionId, StoreError};

/// Why an engine operation could not run.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// No session for a container.
    #[error("no session for container {container:?} in namespace {namespace:?}: was it created with --snapshotter layerstack?")]
    NoSession {
        namespace: String,
        container: String,
    },
    /// The upper is an overlay upperdir somewhere: the session is not quiescent.
    #[error("session {0}'s upper {1} is still mounted (in some mount namespace): stop its container or holder first")]
    Mounted(SessionId, PathBuf),
    /// containerd `Remove` of a snapshot whose session's upper is mounted.
    #[error("snapshot {key} is mounted (session {session}, upper {}): remove it after its task is deleted", upper.display())]
    SnapshotMounted {
        key: String,
        session: SessionId,
        upper: PathBuf,
    },
    /// The mount census failed.
    #[error("cannot tell whether upper {0} is mounted")]
    Census(PathBuf, #[source] std::io::Error),
    /// The store's error, as it says it (its own messages name the store
    /// where that helps: "store database", "store i/o on …"; a "store:"
    /// prefix only put an internal word before "session 7 not found"). Not
    /// `transparent`: the store error stays in the chain (`no_space`).
    #[error("{0}")]
    Store(#[from] StoreError),
    /// A limit is reached and the caller asked not to wait.
    #[error("{0}")]
    Busy(String),
    /// Bad input; the message names it.
    #[error("{0}")]
    InvalidArgument(String),
    /// Capturing, planning or applying failed (during a dry run; a real publish
    /// records it as outcome `failed`).
    #[error("publish step failed")]
    Run(#[source] Box<RunError>),
    #[error("engine task failed: {0}")]
    Join(String),
    /// Blame, diff, conflicts: what was named does not exist (a path on a head,
    /// a layer of a log).
    #[error("{0}")]
    NotFound(String),
    /// Blame, diff, conflicts: the state does not allow it (a binary file, a
    /// session that is not in conflict); the message says what to do.
    #[error("{0}")]
    FailedPrecondition(String),
    /// Reading a layer or an upper failed.
    #[error("cannot read {0}")]
    Read(String, #[source] std::io::Error),
    /// Writing a layer as a tar failed (a layer that cannot be read, or a
    /// receiver that went away).
    #[error("export")]
    Export(#[source] Box<publisher::TarError>),
    /// Building the squashed layer of `stack`'s `branch` failed: a layer of the
    /// run or the staging directory could not be read or written (the source
    /// names the path). The staging directory is dropped; no branch moved.
    #[error("building the squash of {stack}@{branch} failed")]
    Squash {
        stack: String,
        branch: String,
        #[source]
        source: publisher::SquashError,
    },
    /// The run of layers a squash of `stack`'s `branch` was planned for is not
    /// in the view of the manifest `head` it was planned on: the store's rows
    /// disagree with each other. Nothing was built.
    #[error("cannot squash {stack}@{branch}: its run is not in the view of manifest {head}")]
    SquashRunNotInView {
        stack: String,
        branch: String,
        head: ManifestId,
    },
    /// A pulled layer blob that could not be applied into staging (nothing of
    /// the pull was kept); `origin` names the layer and the image.
    #[error("cannot apply {origin}")]
    Pull {
        origin: String,
        #[source]
        source: Box<publisher::ImportError>,
    },
    /// A base import that could not be made (nothing of it was kept).
    #[error("cannot import {}", path.display())]
    Import {
        path: PathBuf,
        #[source]
        source: Box<publisher::ImportError>,
    },
}

impl EngineError {
    /// The errdefs class of this error.
    #[must_use]
    pub fn kind(&self) -> ErrorKind {
        if no_space(self) {
            return ErrorKind::NoSpace;
        }
        match self {
            Self::NoSession { .. } => ErrorKind::NotFound,
            Self::Mounted(..) | Self::SnapshotMounted { .. } => ErrorKind::FailedPrecondition,
            Self::Store(e) => e.kind(),
            Self::Busy(_) => ErrorKind::Busy,
            Self::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Self::Run(e) => e.kind(),
            Self::Census(..) | Self::Join(_) => ErrorKind::Internal,
            Self::NotFound(_) => ErrorKind::NotFound,
            Self::FailedPrecondition(_) => ErrorKind::FailedPrecondition,
            Self::Export(e) if e.is_reserved_name() => ErrorKind::FailedPrecondition,
            Self::Read(..) | Self::Export(_) => ErrorKind::Internal,
            Self::Squash { .. } | Self::SquashRunNotInView { .. } => ErrorKind::Internal,
            Self::Import { source, .. } if source.is_not_found() => ErrorKind::NotFound,
            Self::Import { source, .. } if source.is_input() => ErrorKind::InvalidArgument,
            Self::Import { .. } => ErrorKind::Internal,
            Self::Pull { source, .. } if source.is_input() => ErrorKind::InvalidArgument,
            Self::Pull { .. } => ErrorKind::Internal,
        }
    }
}

/// Whether the filesystem being full caused `e`: an `ENOSPC`/`EDQUOT` i/o
/// error or a store error of kind `no_space` (`SQLITE_FULL`) anywhere in its
/// chain — whatever step (capture, seal, squash, import, commit) it came
/// through.
pub(crate) fn no_space(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(c) = cur {
        let store = c
            .downcast_ref::<StoreError>()
            .or(match c.downcast_ref::<RunError>() {
                Some(RunError::Store(s)) => Some(s),
                _ => None,
            });
        if store.is_some_and(|s| s.kind() == ErrorKind::NoSpace) {
            return true;
        }
        cur = c.source();
    }
    layerstack_types::is_no_space(e)
}

/// A step of a publish that failed (recorded as outcome `failed`, upper kept).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Capture(#[from] publisher::CaptureError),
    #[error(transparent)]
    Seal(#[from] publisher::SealError),
    #[error(transparent)]
    Gate(#[from] publisher::GateError),
    #[error(transparent)]
    Apply(#[from] publisher::ApplyError),
    #[error("publish task failed")]
    Join(#[from] tokio::task::JoinError),
    #[error(transparent)]
    Commit(#[from] crate::committer::CommitFailed),
    #[cfg(any(test, feature = "failpoints"))]
    #[error("failpoint {0}")]
    Failpoint(&'static str),
}

impl RunError {
    /// The errdefs class of this error.
    #[must_use]
    pub fn kind(&self) -> ErrorKind {
        if no_space(self) {
            return ErrorKind::NoSpace;
        }
        match self {
            Self::Store(e) => e.kind(),
            // The session's writes are over a configured limit: nothing is
            // wrong with the store; the caller raises the limit or discards.
            Self::Capture(publisher::CaptureError::OverLimit { .. }) => {
                ErrorKind::FailedPrecondition
            }
            _ => ErrorKind::Internal,
        }
    }
}

/// "outer: inner: root cause" (defined in the vocabulary crate, which clients
/// share).
pub use layerstack_types::error_chain;
