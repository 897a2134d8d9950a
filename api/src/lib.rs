//! LayerStack's admin API: generated gRPC types (`proto/admin.proto`), a
//! unix-socket client connector, the conversions from the engine's types to the
//! wire, and the one mapping of error kinds to gRPC codes.
//!
//! ```no_run
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! let mut c = layerstack_api::connect("/run/layerstack/admin.sock").await?;
//! let r = c.list_sessions(layerstack_api::ListSessionsRequest::default()).await?;
//! println!("{} sessions", r.into_inner().sessions.len());
//! # Ok(()) }
//! ```

#![allow(clippy::unwrap_used)]

/// Exit policy labels (`layerstack.publish`, `layerstack.branch`), shared by the
/// daemon and the shim; defined by the engine.
pub use layerstack_engine::policy;

/// Generated code of package `layerstack.admin.v1`.
pub mod v1 {
    tonic::include_proto!("layerstack.admin.v1");
}

pub use v1::admin_client::AdminClient;
pub use v1::admin_server::{Admin, AdminServer};
pub use v1::*;

use std::path::PathBuf;

use layerstack_engine::store::{
    escape_path, ErrorKind, MountSpec, Owner, PathCounts as StorePathCounts, PathRecord,
    PathStatus, SessionInfo,
};
use tonic::transport::{Channel, Endpoint, Uri};

pub use layerstack_engine::error_chain;

/// Default admin socket path (ARCHITECTURE.md §3).
pub const DEFAULT_ADMIN_ADDRESS: &str = "/run/layerstack/admin.sock";

/// At most this many conflicts are inlined in a [`Session`].
pub const INLINE_CONFLICTS: usize = 100;

/// Connect to the admin API on the unix socket `path`.
///
/// Errors: the transport error when the socket does not exist or refuses.
pub async fn connect(
    path: impl Into<PathBuf>,
) -> Result<AdminClient<Channel>, tonic::transport::Error> {
    let path: PathBuf = path.into();
    // The URI is a placeholder: the connector below dials the socket.
    let ch = Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = path.clone();
            async move { tokio::net::UnixStream::connect(p).await }
        }))
        .await?;
    Ok(AdminClient::new(ch))
}

/// The gRPC status of an error of kind `kind` (containerd `errdefs/grpc.go`):
/// the one place error kinds meet wire codes. `message` is the error with its
/// source chain ([`error_chain`]).
pub fn status(kind: ErrorKind, message: String) -> tonic::Status {
    use tonic::Code;
    let code = match kind {
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::AlreadyExists => Code::AlreadyExists,
        ErrorKind::FailedPrecondition => Code::FailedPrecondition,
        ErrorKind::InvalidArgument => Code::InvalidArgument,
        ErrorKind::Conflict => Code::Aborted,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::Busy => Code::ResourceExhausted,
        ErrorKind::Unsupported => Code::Unimplemented,
        ErrorKind::Corrupt => Code::DataLoss,
        ErrorKind::Internal => Code::Unknown,
    };
    tonic::Status::new(code, message)
}

/// The error kind a gRPC status code stands for, as named in metrics and logs:
/// the inverse of [`status`] (`Aborted` is `conflict`, `ResourceExhausted` is
/// `busy`, …); codes [`status`] never produces (a client's deadline, a transport
/// failure) keep their gRPC name in snake case.
pub fn kind_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "ok",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::FailedPrecondition => "failed_precondition",
        Code::InvalidArgument => "invalid_argument",
        Code::Aborted => "conflict",
        Code::Unavailable => "unavailable",
        Code::ResourceExhausted => "busy",
        Code::Unimplemented => "unsupported",
        Code::DataLoss => "corrupt",
        Code::Unknown => "internal",
        Code::Cancelled => "cancelled",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::PermissionDenied => "permission_denied",
        Code::OutOfRange => "out_of_range",
        Code::Internal => "grpc_internal",
        Code::Unauthenticated => "unauthenticated",
    }
}

/// [`status`] of an engine error.
pub fn engine_status(e: &layerstack_engine::EngineError) -> tonic::Status {
    status(e.kind(), error_chain(e))
}

/// [`status`] of a store error.
pub fn store_status(e: &layerstack_engine::store::StoreError) -> tonic::Status {
    status(e.kind(), error_chain(e))
}

/// The wire form of a path verdict.
pub fn path_verdict(p: &PathRecord) -> PathVerdict {
    PathVerdict {
        path: escape_path(&p.path),
        status: p.status.as_str().to_string(),
        reason: p.reason.clone(),
        raw_path: p.path.clone(),
    }
}

/// The wire form of verdict counts.
pub fn path_counts(c: &StorePathCounts) -> PathCounts {
    PathCounts {
        clean: c.clean,
        merged: c.merged,
        conflict: c.conflict,
        excluded: c.excluded,
    }
}

/// The wire form of a session; `conflicts` are the first conflicting paths of its
/// outcome (the caller reads at most [`INLINE_CONFLICTS`] + 1 to know whether
/// there are more).
pub fn session(s: &SessionInfo, conflicts: &[PathRecord]) -> Session {
    let (namespace, container) = match &s.owner {
        Owner::Container { namespace, id } => (namespace.clone(), id.clone()),
        Owner::Sandbox { .. } | Owner::Operation { .. } => (String::new(), String::new()),
    };
    let o = s.outcome.as_ref();
    Session {
        id: s.id,
        namespace,
        container,
        key: s.key.clone().unwrap_or_default(),
        stack: s.stack.clone(),
        branch: s.branch.clone(),
        state: s.state.as_str().to_string(),
        outcome: o.map(|o| o.kind.as_str().to_string()).unwrap_or_default(),
        conflicts: conflicts
            .iter()
            .filter(|p| p.status == PathStatus::Conflict)
            .take(INLINE_CONFLICTS)
            .map(|p| ConflictPath {
                path: escape_path(&p.path),
                reason: p.reason.clone(),
            })
            .collect(),
        conflicts_truncated: conflicts
            .iter()
            .filter(|p| p.status == PathStatus::Conflict)
            .count()
            > INLINE_CONFLICTS,
        layer: o.and_then(|o| o.layer).unwrap_or(0),
        message: o.and_then(|o| o.message.clone()).unwrap_or_default(),
        released: s.released,
        run: s.run,
        paths: vec![],
        dry_run: false,
        timings: o.and_then(|o| o.timings).map(|t| PublishTimings {
            capture_us: t.capture_us,
            gate_wait_us: t.gate_wait_us,
            gate_hold_us: t.gate_hold_us,
            total_us: t.total_us,
            capture_bytes: t.capture_bytes,
        }),
        owner_kind: owner_kind(&s.owner).to_string(),
        owner: s.owner.display(),
        outcome_id: o.map(|o| o.id).unwrap_or(0),
        counts: o.map(|o| path_counts(&o.counts)),
        policy: s.policy.clone().unwrap_or_default(),
    }
}

/// The owner kind's wire name: `container`, `sandbox` or `operation`.
pub fn owner_kind(o: &Owner) -> &'static str {
    match o {
        Owner::Container { .. } => "container",
        Owner::Sandbox { .. } => "sandbox",
        Owner::Operation { .. } => "operation",
    }
}

/// The wire form of a mount spec (containerd's `Mount`, without target).
pub fn mounts(spec: &MountSpec) -> Vec<Mount> {
    let options = spec.overlay_options();
    match spec {
        MountSpec::Bind { source, .. } => vec![Mount {
            r#type: "bind".into(),
            source: source.display().to_string(),
            options,
        }],
        MountSpec::Overlay { .. } => vec![Mount {
            r#type: "overlay".into(),
            source: "overlay".into(),
            options,
        }],
    }
}

/// The status named `s` in a request ("" = any).
///
/// # Errors
/// The message for an `InvalidArgument`, naming the accepted values.
pub fn parse_status(s: &str) -> Result<Option<PathStatus>, String> {
    if s.is_empty() {
        return Ok(None);
    }
    PathStatus::parse(s).map(Some).ok_or_else(|| {
        format!("unknown path status {s:?}: use clean, merged, conflict or excluded")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_kind_round_trips_through_its_code() {
        for (kind, name) in [
            (ErrorKind::NotFound, "not_found"),
            (ErrorKind::AlreadyExists, "already_exists"),
            (ErrorKind::FailedPrecondition, "failed_precondition"),
            (ErrorKind::InvalidArgument, "invalid_argument"),
            (ErrorKind::Conflict, "conflict"),
            (ErrorKind::Unavailable, "unavailable"),
            (ErrorKind::Busy, "busy"),
            (ErrorKind::Unsupported, "unsupported"),
            (ErrorKind::Corrupt, "corrupt"),
            (ErrorKind::Internal, "internal"),
        ] {
            assert_eq!(kind_name(status(kind, String::new()).code()), name);
        }
    }
}

/// `s` as the mount socket carries it (`layerstack_sandbox::wire`): the
/// protobuf encoding, as lowercase hex.
pub fn session_to_hex(s: &Session) -> String {
    use prost::Message;
    use std::fmt::Write;
    let bytes = s.encode_to_vec();
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// The inverse of [`session_to_hex`].
///
/// # Errors
/// The text is not hex digits in pairs, or the bytes are not a `Session`.
pub fn session_from_hex(h: &str) -> Result<Session, String> {
    use prost::Message;
    if !h.len().is_multiple_of(2) {
        return Err("an odd number of hex digits".into());
    }
    let bytes = (0..h.len())
        .step_by(2)
        .map(|i| {
            h.get(i..i + 2)
                .and_then(|d| u8::from_str_radix(d, 16).ok())
                .ok_or_else(|| format!("not a hex digit pair at {i}"))
        })
        .collect::<Result<Vec<u8>, String>>()?;
    Session::decode(bytes.as_slice()).map_err(|e| format!("not a session: {e}"))
}

#[cfg(test)]
mod hex_tests {
    use super::*;

    #[test]
    fn a_session_round_trips_through_hex() {
        let s = Session {
            id: 42,
            outcome: "discarded".into(),
            message: "writes dropped: ünïcode".into(),
            counts: Some(PathCounts {
                clean: 3,
                ..Default::default()
            }),
            ..Default::default()
        };
        let h = session_to_hex(&s);
        assert!(h
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(session_from_hex(&h), Ok(s));
        assert!(session_from_hex("abc").is_err());
        assert!(session_from_hex("zz").is_err());
    }
}
