//! Error kinds (containerd's errdefs) and the text of an error with its causes.

use std::fmt;

/// containerd's error classes (errdefs, `errdefs/errors.go`), plus the two
/// LayerStack needs (`Busy`, `Corrupt`). `PermissionDenied` and
/// `Unauthenticated` come only from the daemon's caller checks (the admin
/// socket's `SO_PEERCRED` check, the TCP listener's token), never from the
/// store or the engine. Every error type of the store and the
/// engine carries one; front ends map it to their wire codes in one place (the
/// admin API's `status`, containerd `errdefs/grpc.go`).
///
/// Spelling: [`ErrorKind::as_str`] is the one name of a kind everywhere it is
/// printed — logs, metrics labels, the mount socket's error replies, the CLI's
/// messages and the Python client's `kind` attribute: `not_found`,
/// `already_exists`, `failed_precondition`, `invalid_argument`, `conflict`,
/// `unavailable`, `busy`, `unsupported`, `corrupt`, `internal`,
/// `permission_denied`, `unauthenticated`, `no_space`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// `errdefs.ErrNotFound`.
    NotFound,
    /// `errdefs.ErrAlreadyExists`: containerd's unpacker relies on it from
    /// Prepare and Commit.
    AlreadyExists,
    /// `errdefs.ErrFailedPrecondition`: containerd's GC retries a Remove that
    /// fails with it.
    FailedPrecondition,
    /// `errdefs.ErrInvalidArgument`.
    InvalidArgument,
    /// `errdefs.ErrConflict` (gRPC `Aborted`): an optimistic check failed; try again.
    Conflict,
    /// `errdefs.ErrUnavailable`.
    Unavailable,
    /// `errdefs.ErrResourceExhausted`: a limit is reached and the caller asked not
    /// to wait.
    Busy,
    /// `errdefs.ErrNotImplemented`: refused by design (a filesystem, a format).
    Unsupported,
    /// `errdefs.ErrDataLoss`: a stored row or directory is not what it must be.
    Corrupt,
    /// `errdefs.ErrUnknown`: anything else (i/o, database).
    Internal,
    /// `errdefs.ErrPermissionDenied`: the caller is known and not allowed (a uid
    /// the admin socket's `[api]` configuration does not list).
    PermissionDenied,
    /// `errdefs.ErrUnauthenticated`: the caller did not prove who it is (no or a
    /// wrong bearer token on the TCP listener).
    Unauthenticated,
    /// The filesystem holding the store is full (`ENOSPC` or `EDQUOT` from a
    /// write, `SQLITE_FULL` from the database): nothing of the operation was
    /// kept; free space there, then try again. A kind of its own, not
    /// `internal` (a bug or a broken disk) nor `busy` (wait and retry): the
    /// caller must act — on the wire it is gRPC `ResourceExhausted`, gRPC's
    /// code for "the entire file system is out of space", told apart from
    /// `busy` by the `layerstack-kind` trailer (`layerstack_api::status`).
    NoSpace,
}

impl ErrorKind {
    /// Every kind, in declaration order (for tables and exhaustive tests).
    pub const ALL: [ErrorKind; 13] = [
        Self::NotFound,
        Self::AlreadyExists,
        Self::FailedPrecondition,
        Self::InvalidArgument,
        Self::Conflict,
        Self::Unavailable,
        Self::Busy,
        Self::Unsupported,
        Self::Corrupt,
        Self::Internal,
        Self::PermissionDenied,
        Self::Unauthenticated,
        Self::NoSpace,
    ];

    /// The kind's one name, snake case (see the type's docs).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotFound => "not_found",
            Self::AlreadyExists => "already_exists",
            Self::FailedPrecondition => "failed_precondition",
            Self::InvalidArgument => "invalid_argument",
            Self::Conflict => "conflict",
            Self::Unavailable => "unavailable",
            Self::Busy => "busy",
            Self::Unsupported => "unsupported",
            Self::Corrupt => "corrupt",
            Self::Internal => "internal",
            Self::PermissionDenied => "permission_denied",
            Self::Unauthenticated => "unauthenticated",
            Self::NoSpace => "no_space",
        }
    }

    /// The kind named `s` (exactly as [`ErrorKind::as_str`] spells it); `None`
    /// for anything else.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether `e` or one of its sources is an i/o error saying the filesystem
/// is full: `ENOSPC` ("No space left on device") or `EDQUOT` (a quota), or
/// one made with [`std::io::ErrorKind::StorageFull`].
/// Errors that carry a full disk in another form (SQLite's `SQLITE_FULL`)
/// are recognised by their own type's `kind()`.
///
/// ```
/// let e = std::io::Error::from_raw_os_error(28); // ENOSPC
/// assert!(layerstack_types::is_no_space(&e));
/// assert!(!layerstack_types::is_no_space(&std::io::Error::other("x")));
/// ```
pub fn is_no_space(e: &(dyn std::error::Error + 'static)) -> bool {
    /// `ENOSPC` and `EDQUOT` on Linux (errno(3)).
    const FULL: [i32; 2] = [28, 122];
    let mut cur = Some(e);
    while let Some(c) = cur {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::StorageFull
                || io.raw_os_error().is_some_and(|n| FULL.contains(&n))
            {
                return true;
            }
        }
        cur = c.source();
    }
    false
}

/// "outer: inner: root cause" — an error with its source chain, for messages
/// that leave the process (outcomes, gRPC statuses, the CLI's stderr, log
/// lines).
///
/// Errors in this workspace do not repeat their source in their own message
/// (STYLE.md); some of our dependencies do (hyper 0.14's `error trying to
/// connect: <io error>` also returns that io error as its source). So a source
/// whose text the last message written already contains is left out:
/// `transport error: error trying to connect: Connection refused (os error
/// 111)`, not `…: Connection refused (os error 111): Connection refused (os
/// error 111)`. The sources below a skipped one are still walked.
///
/// ```
/// let e = std::io::Error::other("disk on fire");
/// assert_eq!(layerstack_types::error_chain(&e), "disk on fire");
/// ```
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut last = s.clone();
    let mut src = e.source();
    while let Some(c) = src {
        let text = c.to_string();
        if !last.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
            last = text;
        }
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error with a fixed text and an optional source.
    #[derive(Debug)]
    struct E(&'static str, Option<Box<E>>);

    impl fmt::Display for E {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for E {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    fn chain(texts: &[&'static str]) -> E {
        let mut e: Option<Box<E>> = None;
        for t in texts.iter().rev() {
            e = Some(Box::new(E(t, e)));
        }
        *e.expect("at least one text")
    }

    #[test]
    fn every_kind_has_one_snake_case_name_that_parses_back() {
        let mut seen = std::collections::HashSet::new();
        for k in ErrorKind::ALL {
            let name = k.as_str();
            assert!(
                name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{name} is not snake case"
            );
            assert!(seen.insert(name), "{name} twice");
            assert_eq!(ErrorKind::parse(name), Some(k));
            assert_eq!(k.to_string(), name);
        }
        assert_eq!(ErrorKind::parse("not-found"), None, "one spelling only");
        assert_eq!(ErrorKind::parse("NotFound"), None);
    }

    #[test]
    fn a_chain_joins_every_source() {
        assert_eq!(
            error_chain(&chain(&[
                "publish step failed",
                "i/o on /l/3",
                "Permission denied"
            ])),
            "publish step failed: i/o on /l/3: Permission denied"
        );
        assert_eq!(error_chain(&chain(&["alone"])), "alone");
    }

    #[test]
    fn a_chain_skips_a_source_the_previous_message_already_says() {
        // tonic 0.9 + hyper 0.14 on a refused unix socket: hyper prints its cause
        // and returns it as its source too.
        let e = chain(&[
            "transport error",
            "error trying to connect: Connection refused (os error 111)",
            "Connection refused (os error 111)",
        ]);
        assert_eq!(
            error_chain(&e),
            "transport error: error trying to connect: Connection refused (os error 111)"
        );
        // An empty text adds nothing either; what lies below it is still read.
        assert_eq!(
            error_chain(&chain(&["export", "", "broken pipe"])),
            "export: broken pipe"
        );
        // Only the message just written counts: a cause that an outer message
        // happens to mention is still printed where it belongs.
        assert_eq!(
            error_chain(&chain(&[
                "cannot read x: not found",
                "layer 3",
                "not found"
            ])),
            "cannot read x: not found: layer 3: not found"
        );
    }
}
