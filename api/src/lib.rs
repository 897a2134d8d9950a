//! LayerStack's admin API: generated gRPC types (`proto/admin.proto`), a
//! unix-socket client connector, and the one mapping of error kinds to gRPC
//! codes. It speaks the vocabulary of `layerstack-types` and links neither the
//! engine nor the store: the conversions from the engine's types to the wire
//! live in the daemon (`snapshotter/src/wire.rs`), the only crate that links the
//! engine (ARCHITECTURE.md §4).
//!
//! ```no_run
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! let mut c = layerstack_api::connect("/run/layerstack/admin.sock").await?;
//! let r = c.list_sessions(layerstack_api::ListSessionsRequest::default()).await?;
//! println!("{} sessions", r.into_inner().sessions.len());
//! # Ok(()) }
//! ```

#![allow(clippy::unwrap_used)]

/// The shared vocabulary (error kinds, label names, outcome and path names).
pub use layerstack_types as types;
/// The exit policy and its labels (`layerstack.publish`, `layerstack.branch`,
/// `layerstack.node`), shared by the daemon and the shim.
pub use layerstack_types::policy;
pub use layerstack_types::{error_chain, ErrorKind};

/// Generated code of package `layerstack.admin.v1`.
pub mod v1 {
    tonic::include_proto!("layerstack.admin.v1");
}

pub use v1::admin_client::AdminClient;
pub use v1::admin_server::{Admin, AdminServer};
pub use v1::*;

use std::path::PathBuf;

use tonic::transport::{Channel, Endpoint, Uri};

/// Default admin socket path (ARCHITECTURE.md §3).
pub const DEFAULT_ADMIN_ADDRESS: &str = "/run/layerstack/admin.sock";

/// The largest message of the admin API either side takes, bytes: an
/// `ExecRequest` carrying a WASI module of up to 64 MiB (the daemon's
/// `MAX_MODULE_BYTES`) with its argv, env and stdin, or a large `ListDir`
/// answer. tonic's and grpcio's default of 4 MiB refused a 5 MiB stdin or
/// module with `out_of_range` ("message length too large"). The daemon's
/// server and [`connect`]'s client both use it; the Python SDK's channels
/// too (`layerstack._channel.MAX_MESSAGE_BYTES`).
pub const MAX_MESSAGE_BYTES: usize = 80 << 20;

/// The largest WASI module an `ExecRequest` carries (or a session's tree
/// holds for an exec by path), bytes: 64 MiB. A larger one is refused —
/// by the CLI and the Python SDK before they make a session for it.
pub const MAX_WASI_MODULE_BYTES: u64 = 64 << 20;

/// Connect to the admin API on the unix socket `path` (messages up to
/// [`MAX_MESSAGE_BYTES`]).
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
    Ok(AdminClient::new(ch)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES))
}

/// The gRPC code of error kind `kind` (containerd `errdefs/grpc.go`): the one
/// place error kinds meet wire codes. `Busy` is `ResourceExhausted`, `Corrupt`
/// is `DataLoss`, `Unsupported` is `Unimplemented`, `Internal` is `Unknown`.
/// `NoSpace` is `ResourceExhausted` too (gRPC's code for "the entire file
/// system is out of space"): the only code two kinds share; [`status`] names
/// the kind in the `layerstack-kind` trailer and [`status_kind`] reads it.
#[must_use]
pub fn code(kind: ErrorKind) -> tonic::Code {
    use tonic::Code;
    match kind {
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
        ErrorKind::PermissionDenied => Code::PermissionDenied,
        ErrorKind::Unauthenticated => Code::Unauthenticated,
        ErrorKind::NoSpace => Code::ResourceExhausted,
    }
}

/// The metadata key (a trailer) naming a status's error kind
/// ([`ErrorKind::as_str`]), set by [`status`] on every error it makes.
pub const KIND_METADATA: &str = "layerstack-kind";

/// The gRPC status of an error of kind `kind` ([`code`]), its kind named in
/// the [`KIND_METADATA`] trailer. `message` is the error with its source
/// chain ([`error_chain`]); for `no_space` it gets what to do appended.
pub fn status(kind: ErrorKind, message: String) -> tonic::Status {
    let message = if kind == ErrorKind::NoSpace && !message.contains(NO_SPACE_ADVICE) {
        format!("{message}; {NO_SPACE_ADVICE}")
    } else {
        message
    };
    let mut md = tonic::metadata::MetadataMap::new();
    md.insert(
        KIND_METADATA,
        tonic::metadata::MetadataValue::from_static(kind.as_str()),
    );
    tonic::Status::with_metadata(code(kind), message, md)
}

/// What to do about an error of kind `no_space`, appended to its message.
pub const NO_SPACE_ADVICE: &str = "no space left on device (the filesystem holding the \
     store is full): nothing of this operation was kept; free space on it (`df` the daemon's \
     --root), then try again";

/// The error kind `st` names: its [`KIND_METADATA`] trailer when it is a
/// kind's name, else [`kind_name`] of its code (a status from another
/// server, or made without [`status`]).
#[must_use]
pub fn status_kind(st: &tonic::Status) -> &'static str {
    st.metadata()
        .get(KIND_METADATA)
        .and_then(|v| v.to_str().ok())
        .and_then(ErrorKind::parse)
        .map_or_else(|| kind_name(st.code()), ErrorKind::as_str)
}

/// The error kind a gRPC status code stands for: the inverse of [`code`];
/// `None` for codes it never produces (`Ok`, a client's deadline, a transport
/// failure, …).
#[must_use]
pub fn error_kind(c: tonic::Code) -> Option<ErrorKind> {
    ErrorKind::ALL.into_iter().find(|&k| code(k) == c)
}

/// The error kind a gRPC status code stands for, as named in metrics, logs and
/// the mount socket: [`ErrorKind::as_str`] of [`error_kind`] (`Aborted` is
/// `conflict`, `ResourceExhausted` is `busy`, …); codes [`status`] never produces
/// keep their gRPC name in snake case (`Internal`, which no kind maps to, is
/// `grpc_internal`).
pub fn kind_name(c: tonic::Code) -> &'static str {
    use tonic::Code;
    if let Some(k) = error_kind(c) {
        return k.as_str();
    }
    match c {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::OutOfRange => "out_of_range",
        Code::Internal => "grpc_internal",
        // Every other code is some kind's (above).
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_kind_round_trips_through_its_code() {
        for kind in ErrorKind::ALL {
            let st = status(kind, String::new());
            assert_eq!(status_kind(&st), kind.as_str());
            if kind == ErrorKind::NoSpace {
                // The one kind sharing a code: the code alone says `busy`.
                assert_eq!(error_kind(st.code()), Some(ErrorKind::Busy));
                assert!(st.message().contains("free space"), "{}", st.message());
                continue;
            }
            assert_eq!(error_kind(st.code()), Some(kind));
            assert_eq!(kind_name(st.code()), kind.as_str());
        }
        let bare = tonic::Status::new(tonic::Code::ResourceExhausted, "x");
        assert_eq!(status_kind(&bare), "busy");
        assert_eq!(error_kind(tonic::Code::Internal), None);
        assert_eq!(kind_name(tonic::Code::Internal), "grpc_internal");
        assert_eq!(
            kind_name(tonic::Code::DeadlineExceeded),
            "deadline_exceeded"
        );
    }

    /// The table the Python client's `layerstack.errors` must cover, one exception
    /// class per row (its test, `clients/python/tests/test_errors.py`, holds the
    /// same table): gRPC code name → error kind.
    #[test]
    fn the_wire_table_is_the_one_the_python_client_maps() {
        let table: Vec<(String, &str)> = ErrorKind::ALL
            .into_iter()
            .map(|k| (format!("{:?}", code(k)), k.as_str()))
            .collect();
        let expected = [
            ("NotFound", "not_found"),
            ("AlreadyExists", "already_exists"),
            ("FailedPrecondition", "failed_precondition"),
            ("InvalidArgument", "invalid_argument"),
            ("Aborted", "conflict"),
            ("Unavailable", "unavailable"),
            ("ResourceExhausted", "busy"),
            ("Unimplemented", "unsupported"),
            ("DataLoss", "corrupt"),
            ("Unknown", "internal"),
            ("PermissionDenied", "permission_denied"),
            ("Unauthenticated", "unauthenticated"),
            ("ResourceExhausted", "no_space"),
        ];
        assert_eq!(
            table,
            expected
                .iter()
                .map(|(c, k)| (c.to_string(), *k))
                .collect::<Vec<_>>()
        );
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
