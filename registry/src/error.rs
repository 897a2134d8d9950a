//! [`RegistryError`]: every failure of this crate, with its [`ErrorKind`], and
//! the one place that turns `oci-client` / `reqwest` / `rustls` errors into it
//! ([`classify`]).

use std::error::Error as StdError;
use std::io;
use std::path::PathBuf;

use layerstack_types::ErrorKind;
use oci_client::errors::{OciDistributionError, OciEnvelope, OciErrorCode};

/// What the user is told to do when a registry refuses the caller.
pub const LOGIN_HINT: &str = "log in (docker login REGISTRY) or put credentials in config.json";

/// A failure of a registry operation. Every message names the registry or the
/// reference, and what to do. [`RegistryError::kind`] gives the
/// LayerStack error kind (`layerstack_types::ErrorKind`).
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// A reference that does not parse (kind `invalid_argument`).
    #[error("invalid reference {reference:?}: {reason}; expected REGISTRY[:PORT]/REPOSITORY[:TAG][@sha256:HEX], e.g. registry.example.com:5000/team/checkpoints:step-12")]
    InvalidReference {
        /// The text given.
        reference: String,
        /// Why it was refused.
        reason: String,
    },
    /// A digest that is not `sha256:` and 64 lowercase hex digits (kind
    /// `invalid_argument`; only sha256 is supported).
    #[error("invalid digest {digest:?}: expected sha256: followed by 64 lowercase hex digits")]
    InvalidDigest {
        /// The text given.
        digest: String,
    },
    /// Another argument the caller must fix: a CA file, a media type, a file
    /// whose size is not the size given (kind `invalid_argument`).
    #[error("{what}: {detail}")]
    InvalidArgument {
        /// What was wrong (`CA file /etc/x.pem`, `media type "…"`).
        what: String,
        /// Why, and what to do.
        detail: String,
    },
    /// The registry answered 401 or 403 (kind `permission_denied`).
    #[error("registry {registry} refused to {op} {target} (HTTP {status}): {}; {}", if *.anonymous { "no credentials were sent" } else { "the credentials sent were refused" }, LOGIN_HINT.replace("REGISTRY", registry))]
    Denied {
        /// `host[:port]`.
        registry: String,
        /// `push` / `pull` / `check`.
        op: &'static str,
        /// `manifest REF` / `blob sha256:…` in `REPO`.
        target: String,
        /// 401 or 403 (0 when oci-client did not say which).
        status: u16,
        /// True when the request carried no credentials.
        anonymous: bool,
    },
    /// The manifest or blob is not in the registry (kind `not_found`).
    #[error("{target} not found in registry {registry}; check the reference (push it first, or pull another tag or digest)")]
    NotFound {
        /// `host[:port]`.
        registry: String,
        /// `manifest REF` / `blob sha256:… in REPO`.
        target: String,
    },
    /// Connection refused or reset, a timeout, a DNS failure (kind
    /// `unavailable`).
    #[error("cannot reach registry {registry}: {detail}; check that it is running and that the host and port are right")]
    Unreachable {
        /// `host[:port]`.
        registry: String,
        /// The innermost cause.
        detail: String,
        /// True when trying again may help (refused, reset, timed out, a
        /// temporary DNS failure); false for a name that does not resolve.
        transient: bool,
    },
    /// HTTPS was used and the registry does not speak TLS (kind
    /// `failed_precondition`).
    #[error("registry {registry} does not answer HTTPS ({detail}); if it serves plain HTTP, add it to the daemon's plain-HTTP registries (configuration: `[registry] insecure = [\"{registry}\"]`): plain HTTP is only used for a registry named there")]
    NotHttps {
        /// `host[:port]`.
        registry: String,
        /// The TLS error.
        detail: String,
    },
    /// Plain HTTP was used (the registry is named insecure) and it serves
    /// HTTPS (kind `failed_precondition`).
    #[error("registry {registry} is named insecure but answers plain HTTP with {detail:?}; it serves HTTPS: remove {registry} from the daemon's `[registry] insecure`")]
    NotPlainHttp {
        /// `host[:port]`.
        registry: String,
        /// What it answered.
        detail: String,
    },
    /// The registry's certificate does not verify (kind `failed_precondition`).
    #[error("TLS certificate of registry {registry} is not trusted: {detail}; add the CA certificate (PEM) that signed it to the registry CA files (ca_files), or to the system's trust store")]
    TlsUntrusted {
        /// `host[:port]`.
        registry: String,
        /// rustls' verdict.
        detail: String,
    },
    /// Content that is not what its digest or size says (kind `corrupt`).
    /// Nothing of it was kept.
    #[error("{target} from registry {registry} is corrupt: expected {expected}, got {actual}; nothing was kept, pull again (if it persists, the registry's copy is damaged: a push sends only blobs the registry lacks, so delete that blob from the registry — its API's DELETE /v2/<name>/blobs/<digest>, or its garbage collection — then push again)")]
    Corrupt {
        /// `host[:port]`.
        registry: String,
        /// `manifest REF` / `blob sha256:… in REPO`.
        target: String,
        /// The digest or size it must have.
        expected: String,
        /// What arrived.
        actual: String,
    },
    /// A pushed file that the registry found not to hash to the digest it was
    /// pushed as (kind `corrupt`). The registry kept nothing.
    #[error("file {} is not blob {digest}: registry {registry} computed another digest for its content ({detail}); the local copy is damaged or the digest given is wrong (check with sha256sum)", path.display())]
    NotThatBlob {
        /// `host[:port]`.
        registry: String,
        /// The digest it was pushed as.
        digest: String,
        /// The file.
        path: PathBuf,
        /// The registry's verdict.
        detail: String,
    },
    /// A manifest above [`crate::MAX_MANIFEST_BYTES`] (kind `unsupported`).
    #[error("manifest {reference} is {size} bytes, above the limit of {limit} bytes; LayerStack does not pull manifests that large")]
    ManifestTooLarge {
        /// The reference.
        reference: String,
        /// Its size in bytes.
        size: u64,
        /// The limit in bytes.
        limit: u64,
    },
    /// Any other refusal of the registry (kind `unavailable` for HTTP 5xx,
    /// 429 and 408, `invalid_argument` for other 4xx, else `internal`).
    #[error("registry {registry} failed to {op} {target}: {detail}")]
    Rejected {
        /// `host[:port]`.
        registry: String,
        /// `push` / `pull` / `check`.
        op: &'static str,
        /// `manifest REF` / `blob sha256:… in REPO`.
        target: String,
        /// The HTTP status, when there was one.
        status: Option<u16>,
        /// The registry's `Retry-After`, seconds, when the transport passed
        /// it on (oci-client 0.18 keeps no response headers in its errors, so
        /// today this is always `None` and a 429 is retried on the backoff
        /// schedule; see the crate docs, "Retries").
        retry_after_s: Option<u64>,
        /// The registry's message.
        detail: String,
    },
    /// A transient failure (see the crate docs, "Retries") that lasted
    /// through every attempt; kind: `last`'s (`unavailable` for a registry
    /// that cannot be reached or answers 5xx / 429).
    #[error("registry {registry}: {op} {target} failed {attempts} times in a row (waited {waited_ms} ms in all between attempts); the last failure: {last}; the registry is down, restarting, overloaded or stalled: try again when it is back, or let the daemon wait longer (configuration `[registry] retry_attempts`, `retry_max_ms`; for a slow registry `connect_timeout_ms`, `read_timeout_ms`)")]
    GaveUp {
        /// `host[:port]`.
        registry: String,
        /// `push` / `pull` / `check`.
        op: &'static str,
        /// `manifest REF` / `blob sha256:… in REPO`.
        target: String,
        /// Attempts made (the configured number).
        attempts: u32,
        /// The sum of the delays slept between them, ms.
        waited_ms: u64,
        /// The last attempt's failure.
        last: Box<RegistryError>,
    },
    /// A local file could not be read or written (kind `no_space` when the
    /// disk is full, else `internal`).
    #[error("{op} {}", path.display())]
    Io {
        /// `read`, `create temp file in`, `rename into` …
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A docker `config.json` that does not parse (kind `invalid_argument`).
    #[error("docker config {}: {detail}; fix the file, or point $DOCKER_CONFIG at another directory", path.display())]
    DockerConfig {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A credential helper named in `config.json` failed (kind `unavailable`),
    /// or is not installed (kind `failed_precondition`: nothing to retry).
    #[error("credential helper docker-credential-{helper} (named in {} for {registry}): {detail}", config.display())]
    CredentialHelper {
        /// The helper's name (`pass`, `secretservice`, …).
        helper: String,
        /// `false`: no such program on PATH.
        installed: bool,
        /// The registry asked for.
        registry: String,
        /// The config file naming it.
        config: PathBuf,
        /// What failed, and what to do.
        detail: String,
    },
}

impl RegistryError {
    /// The LayerStack error kind (see each variant).
    #[must_use]
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::InvalidReference { .. }
            | Self::InvalidDigest { .. }
            | Self::InvalidArgument { .. }
            | Self::DockerConfig { .. } => ErrorKind::InvalidArgument,
            Self::Denied { .. } => ErrorKind::PermissionDenied,
            Self::NotFound { .. } => ErrorKind::NotFound,
            Self::CredentialHelper {
                installed: false, ..
            } => ErrorKind::FailedPrecondition,
            Self::Unreachable { .. } | Self::CredentialHelper { .. } => ErrorKind::Unavailable,
            Self::NotHttps { .. } | Self::NotPlainHttp { .. } | Self::TlsUntrusted { .. } => {
                ErrorKind::FailedPrecondition
            }
            Self::Corrupt { .. } | Self::NotThatBlob { .. } => ErrorKind::Corrupt,
            Self::ManifestTooLarge { .. } => ErrorKind::Unsupported,
            Self::GaveUp { last, .. } => last.kind(),
            Self::Rejected { status, .. } => match status {
                Some(s) if *s >= 500 || *s == 429 || *s == 408 => ErrorKind::Unavailable,
                Some(s) if *s >= 400 => ErrorKind::InvalidArgument,
                _ => ErrorKind::Internal,
            },
            Self::Io { source, .. } => match source.kind() {
                io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded => ErrorKind::NoSpace,
                _ => ErrorKind::Internal,
            },
        }
    }

    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

/// What an operation was doing, for [`classify`]'s messages.
pub(crate) struct Ctx<'a> {
    /// `host[:port]` as the client resolves it.
    pub registry: &'a str,
    /// True when the registry is named insecure (plain HTTP).
    pub insecure: bool,
    /// True when no credentials were sent.
    pub anonymous: bool,
    pub op: &'static str,
    pub target: String,
}

/// Turns an `oci-client` error into a [`RegistryError`]. The TLS and
/// connection cases are found by walking the source chain (reqwest → hyper →
/// io::Error → rustls::Error).
pub(crate) fn classify(err: OciDistributionError, ctx: Ctx<'_>) -> RegistryError {
    match err {
        OciDistributionError::UnauthorizedError { .. } => ctx.denied(401),
        // The token endpoint refused the credentials.
        OciDistributionError::AuthenticationFailure(_) => ctx.denied(401),
        OciDistributionError::RegistryError { envelope, .. } => envelope_error(envelope, &ctx),
        OciDistributionError::ServerError { code, message, .. } => {
            // extract_location_header reports a 4xx with its JSON envelope
            // as text.
            match serde_json::from_str::<OciEnvelope>(&message) {
                Ok(envelope) if !envelope.errors.is_empty() => envelope_error(envelope, &ctx),
                _ => status_error(code, message.trim().to_string(), &ctx),
            }
        }
        OciDistributionError::DigestError(e) => RegistryError::Corrupt {
            registry: ctx.registry.to_string(),
            target: ctx.target,
            expected: "the digest named".into(),
            actual: e.to_string(),
        },
        OciDistributionError::RequestError(e) => match e.status() {
            Some(status) => status_error(status.as_u16(), String::new(), &ctx),
            None => transport_error(&e, &ctx).unwrap_or_else(|| ctx.rejected(None, chain_text(&e))),
        },
        OciDistributionError::IoError(e) => ctx.rejected(None, chain_text(&e)),
        other => ctx.rejected(None, other.to_string()),
    }
}

impl Ctx<'_> {
    fn denied(&self, status: u16) -> RegistryError {
        RegistryError::Denied {
            registry: self.registry.to_string(),
            op: self.op,
            target: self.target.clone(),
            status,
            anonymous: self.anonymous,
        }
    }

    fn rejected(&self, status: Option<u16>, detail: String) -> RegistryError {
        RegistryError::Rejected {
            registry: self.registry.to_string(),
            op: self.op,
            target: self.target.clone(),
            status,
            retry_after_s: None,
            detail,
        }
    }

    fn not_found(&self) -> RegistryError {
        RegistryError::NotFound {
            registry: self.registry.to_string(),
            target: self.target.clone(),
        }
    }
}

/// A distribution error envelope (`{"errors":[{"code":…}]}`).
fn envelope_error(envelope: OciEnvelope, ctx: &Ctx<'_>) -> RegistryError {
    let code = envelope.errors.first().map(|e| &e.code);
    match code {
        Some(OciErrorCode::Unauthorized) => ctx.denied(401),
        Some(OciErrorCode::Denied) => ctx.denied(403),
        Some(
            OciErrorCode::BlobUnknown
            | OciErrorCode::ManifestUnknown
            | OciErrorCode::NameUnknown
            | OciErrorCode::NotFound,
        ) if ctx.op != "push" => ctx.not_found(),
        Some(OciErrorCode::DigestInvalid | OciErrorCode::SizeInvalid) => RegistryError::Corrupt {
            registry: ctx.registry.to_string(),
            target: ctx.target.clone(),
            expected: "the digest and size given".into(),
            actual: envelope_text(&envelope),
        },
        _ => ctx.rejected(Some(400), envelope_text(&envelope)),
    }
}

/// `CODE: message` of each error in an envelope.
fn envelope_text(envelope: &OciEnvelope) -> String {
    envelope
        .errors
        .iter()
        .map(|e| format!("{:?}: {}", e.code, e.message))
        .collect::<Vec<_>>()
        .join("; ")
}

fn status_error(code: u16, message: String, ctx: &Ctx<'_>) -> RegistryError {
    match code {
        401 | 403 => ctx.denied(code),
        404 => ctx.not_found(),
        // Go's net/http answers a plain request on a TLS port with 400
        // "Client sent an HTTP request to an HTTPS server." (a HEAD gets the
        // status alone).
        400 if ctx.insecure
            && (message.contains("HTTP request to an HTTPS server") || message.is_empty()) =>
        {
            RegistryError::NotPlainHttp {
                registry: ctx.registry.to_string(),
                detail: if message.is_empty() {
                    "400 Bad Request".into()
                } else {
                    message
                },
            }
        }
        _ => ctx.rejected(
            Some(code),
            if message.is_empty() {
                format!("HTTP {code}")
            } else {
                format!("HTTP {code}: {message}")
            },
        ),
    }
}

/// TLS and connection failures, from the source chain of a reqwest error.
fn transport_error(e: &reqwest::Error, ctx: &Ctx<'_>) -> Option<RegistryError> {
    let registry = ctx.registry.to_string();
    let mut cur: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = cur {
        let tls = err.downcast_ref::<rustls::Error>().or_else(|| {
            err.downcast_ref::<io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        if let Some(tls) = tls {
            return Some(match tls {
                rustls::Error::InvalidCertificate(_)
                | rustls::Error::InvalidCertRevocationList(_)
                | rustls::Error::NoCertificatesPresented => RegistryError::TlsUntrusted {
                    registry,
                    detail: tls.to_string(),
                },
                rustls::Error::InvalidMessage(_) => RegistryError::NotHttps {
                    registry,
                    detail: tls.to_string(),
                },
                _ => RegistryError::Rejected {
                    registry,
                    op: ctx.op,
                    target: ctx.target.clone(),
                    status: None,
                    retry_after_s: None,
                    detail: format!("TLS: {tls}"),
                },
            });
        }
        if let Some(io) = err.downcast_ref::<io::Error>() {
            if matches!(
                io.kind(),
                io::ErrorKind::ConnectionRefused
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::TimedOut
                    | io::ErrorKind::HostUnreachable
                    | io::ErrorKind::NetworkUnreachable
            ) {
                return Some(RegistryError::Unreachable {
                    registry,
                    detail: io.to_string(),
                    transient: true,
                });
            }
        }
        cur = err.source();
    }
    // rustls' error is not always reachable by downcasting (an io::Error's
    // `source()` skips its inner error): its texts then.
    let text = chain_text(e);
    if text.contains("invalid peer certificate") {
        return Some(RegistryError::TlsUntrusted {
            registry,
            detail: format!("invalid peer certificate: {}", innermost(&text)),
        });
    }
    if text.contains("received corrupt message") || text.contains("InvalidContentType") {
        return Some(RegistryError::NotHttps {
            registry,
            detail: innermost(&text),
        });
    }
    if text.contains("dns error") {
        // getaddrinfo's EAI_AGAIN ("Temporary failure in name resolution")
        // may pass; a name that does not resolve will not.
        let transient = text.contains("Temporary failure") || text.contains("try again");
        return Some(RegistryError::Unreachable {
            registry,
            detail: text,
            transient,
        });
    }
    // A connection that failed or broke mid-request (hyper's "connection
    // closed before message completed", a reset while the body was sent or
    // read) and timeouts: the request may not have been seen whole.
    if e.is_connect() || e.is_timeout() || e.is_request() || e.is_body() {
        return Some(RegistryError::Unreachable {
            registry,
            detail: text,
            transient: true,
        });
    }
    None
}

/// The last part of a `chain_text` (the root cause).
fn innermost(text: &str) -> String {
    text.rsplit(": ").next().unwrap_or(text).to_string()
}

/// `a: b: c` from an error and its sources, repeated texts dropped.
pub(crate) fn chain_text(e: &(dyn StdError + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut cur: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = cur {
        let s = err.to_string();
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
        cur = err.source();
    }
    parts.join(": ")
}
