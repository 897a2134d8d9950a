//! [`RegistryClient`]: blobs and manifests over the OCI distribution API.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::errors::OciDistributionError;
use oci_client::manifest::{
    IMAGE_MANIFEST_LIST_MEDIA_TYPE, IMAGE_MANIFEST_MEDIA_TYPE, OCI_IMAGE_INDEX_MEDIA_TYPE,
    OCI_IMAGE_MEDIA_TYPE,
};
use oci_client::secrets::RegistryAuth;
use oci_client::Reference;
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt;

use crate::error::{classify, Ctx};
use crate::retry::{
    transient, Backoff, Jitter, DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_READ_TIMEOUT_MS,
    DEFAULT_RETRY_ATTEMPTS, DEFAULT_RETRY_BASE_MS, DEFAULT_RETRY_MAX_MS, MAX_RETRY_ATTEMPTS,
    MAX_RETRY_MAX_MS, MAX_TIMEOUT_MS,
};
use crate::{Credentials, RegistryError};

/// The largest manifest [`RegistryClient::pull_manifest`] accepts, in bytes
/// (4 MiB: distribution's own limit on a manifest PUT, `maxManifestBodySize`).
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;

/// Bytes read from a file per request body chunk when pushing.
const PUSH_READ_BYTES: usize = 1 << 20;
const USER_AGENT: &str = concat!("layerstack/", env!("CARGO_PKG_VERSION"));

/// How a [`RegistryClient`] reaches registries, and how long it keeps trying
/// one that fails transiently (see the crate docs, "Retries").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryOptions {
    /// Registries reached over plain HTTP, each `host[:port]` exactly as a
    /// reference names it (`127.0.0.1:5000`; `localhost:5000` is another
    /// name). Every other registry is HTTPS only.
    pub insecure: Vec<String>,
    /// Extra PEM files of CA certificates trusted for HTTPS, in addition to
    /// the system's (`/etc/ssl/certs`, through rustls-platform-verifier).
    pub ca_files: Vec<PathBuf>,
    /// Attempts per idempotent step (a `HEAD`, a manifest `GET` or `PUT`, a
    /// blob download, a blob upload from a new session), the first one
    /// included: 1 = no retry. 1..=[`MAX_RETRY_ATTEMPTS`]; default
    /// [`DEFAULT_RETRY_ATTEMPTS`] (4).
    pub retry_attempts: u32,
    /// The first retry's delay ceiling, ms; doubled per retry, the delay drawn
    /// in `[ceiling/2, ceiling]`. Default [`DEFAULT_RETRY_BASE_MS`] (200).
    pub retry_base_ms: u64,
    /// The longest delay between two attempts, ms (a `Retry-After` included),
    /// ≥ `retry_base_ms`, ≤ [`MAX_RETRY_MAX_MS`]. Default
    /// [`DEFAULT_RETRY_MAX_MS`] (5000).
    pub retry_max_ms: u64,
    /// Longest wait for a TCP (and TLS) connection to a registry, ms; a
    /// timeout is a retried failure. 1..=[`MAX_TIMEOUT_MS`]; default
    /// [`DEFAULT_CONNECT_TIMEOUT_MS`] (15 s).
    pub connect_timeout_ms: u64,
    /// Longest wait for one read from a registry (not for a whole blob),
    /// ms: a registry that stalls this long is cut off, a retried failure.
    /// 1..=[`MAX_TIMEOUT_MS`]; default [`DEFAULT_READ_TIMEOUT_MS`] (120 s).
    pub read_timeout_ms: u64,
}

impl Default for RegistryOptions {
    fn default() -> Self {
        Self {
            insecure: Vec::new(),
            ca_files: Vec::new(),
            retry_attempts: DEFAULT_RETRY_ATTEMPTS,
            retry_base_ms: DEFAULT_RETRY_BASE_MS,
            retry_max_ms: DEFAULT_RETRY_MAX_MS,
            connect_timeout_ms: DEFAULT_CONNECT_TIMEOUT_MS,
            read_timeout_ms: DEFAULT_READ_TIMEOUT_MS,
        }
    }
}

impl RegistryOptions {
    /// The retry options checked: `Err` names the option and the bound.
    fn backoff(&self) -> Result<Backoff, RegistryError> {
        let bad = |what: &str, detail: String| RegistryError::InvalidArgument {
            what: format!("registry option {what}"),
            detail,
        };
        if !(1..=MAX_RETRY_ATTEMPTS).contains(&self.retry_attempts) {
            return Err(bad(
                "retry_attempts",
                format!(
                    "is {}; it must be 1..={MAX_RETRY_ATTEMPTS} (1: no retry)",
                    self.retry_attempts
                ),
            ));
        }
        if self.retry_max_ms > MAX_RETRY_MAX_MS {
            return Err(bad(
                "retry_max_ms",
                format!(
                    "is {} ms; it must be at most {MAX_RETRY_MAX_MS} ms",
                    self.retry_max_ms
                ),
            ));
        }
        for (what, ms) in [
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("read_timeout_ms", self.read_timeout_ms),
        ] {
            if !(1..=MAX_TIMEOUT_MS).contains(&ms) {
                return Err(bad(
                    what,
                    format!("is {ms} ms; it must be 1..={MAX_TIMEOUT_MS} ms"),
                ));
            }
        }
        if self.retry_base_ms > self.retry_max_ms {
            return Err(bad(
                "retry_base_ms",
                format!(
                    "is {} ms, above retry_max_ms ({} ms); it must be at most retry_max_ms",
                    self.retry_base_ms, self.retry_max_ms
                ),
            ));
        }
        Ok(Backoff {
            attempts: self.retry_attempts,
            base: Duration::from_millis(self.retry_base_ms),
            max: Duration::from_millis(self.retry_max_ms),
        })
    }
}

/// A manifest as the registry holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PulledManifest {
    /// The bytes, exactly as stored (at most [`MAX_MANIFEST_BYTES`]).
    pub body: Vec<u8>,
    /// `sha256:…` of `body` (computed here; equal to the reference's digest
    /// when the reference names one).
    pub digest: String,
    /// The body's `mediaType` field; when absent, inferred: a body with
    /// `manifests` is an OCI index, else an OCI image manifest.
    pub media_type: String,
}

/// What [`RegistryClient::push_blob_file`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlobPush {
    /// The blob was sent.
    Uploaded,
    /// The registry already had it (`HEAD` answered 200): nothing was sent.
    AlreadyPresent,
}

/// A client of OCI registries. One per process is enough: it keeps one HTTP
/// connection pool (and token cache) per registry and credentials. Every
/// method takes the reference (its registry and repository are used; its tag
/// or digest only by the manifest methods) and the credentials to send.
pub struct RegistryClient {
    insecure: Vec<String>,
    roots: Vec<Certificate>,
    clients: Mutex<HashMap<(String, Credentials), oci_client::Client>>,
    backoff: Backoff,
    /// (connect, read) timeouts.
    timeouts: (Duration, Duration),
    jitter: Mutex<Jitter>,
    retries: AtomicU64,
}

impl std::fmt::Debug for RegistryClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryClient")
            .field("insecure", &self.insecure)
            .field("ca_certificates", &self.roots.len())
            .field("backoff", &self.backoff)
            .field("timeouts", &self.timeouts)
            .finish_non_exhaustive()
    }
}

/// The sha256 hex of a `sha256:HEX` digest, or [`RegistryError::InvalidDigest`].
pub(crate) fn check_digest(digest: &str) -> Result<&str, RegistryError> {
    match digest.strip_prefix("sha256:") {
        Some(hex)
            if hex.len() == 64
                && hex
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) =>
        {
            Ok(hex)
        }
        _ => Err(RegistryError::InvalidDigest {
            digest: digest.to_string(),
        }),
    }
}

/// `sha256:…` of `bytes`.
#[must_use]
pub fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

/// `path` opened for a push of blob `digest`, checked to be `size` bytes.
///
/// Errors: `invalid_argument` for a malformed digest or another size;
/// `internal` when the file cannot be opened.
async fn open_sized(
    path: &Path,
    digest: &str,
    size: u64,
) -> Result<tokio::fs::File, RegistryError> {
    check_digest(digest)?;
    let file = tokio::fs::File::open(path)
        .await
        .map_err(|e| RegistryError::io("open", path, e))?;
    let len = file
        .metadata()
        .await
        .map_err(|e| RegistryError::io("stat", path, e))?
        .len();
    if len != size {
        return Err(RegistryError::InvalidArgument {
            what: format!("blob file {}", path.display()),
            detail: format!("is {len} bytes, not the {size} bytes given for {digest}"),
        });
    }
    Ok(file)
}

impl RegistryClient {
    /// A client for `opts`. Reads the CA files now. Installs rustls' `ring`
    /// provider as the process default if none is installed (see the crate
    /// docs, "TLS").
    ///
    /// Errors: `invalid_argument` when a CA file cannot be read or holds no
    /// PEM certificate, or a retry option is out of its range (the message
    /// names the option).
    pub fn new(opts: RegistryOptions) -> Result<Self, RegistryError> {
        let backoff = opts.backoff()?;
        // Err means a provider is installed already: that one is used.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut roots = Vec::new();
        for path in &opts.ca_files {
            let data = std::fs::read(path).map_err(|e| RegistryError::InvalidArgument {
                what: format!("registry CA file {}", path.display()),
                detail: format!("cannot read it ({e})"),
            })?;
            if !data
                .windows(b"-----BEGIN CERTIFICATE-----".len())
                .any(|w| w == b"-----BEGIN CERTIFICATE-----")
            {
                return Err(RegistryError::InvalidArgument {
                    what: format!("registry CA file {}", path.display()),
                    detail: "holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into(),
                });
            }
            roots.push(Certificate {
                encoding: CertificateEncoding::Pem,
                data,
            });
        }
        let this = Self {
            insecure: opts.insecure,
            roots,
            clients: Mutex::new(HashMap::new()),
            backoff,
            timeouts: (
                Duration::from_millis(opts.connect_timeout_ms),
                Duration::from_millis(opts.read_timeout_ms),
            ),
            jitter: Mutex::new(Jitter::from_entropy()),
            retries: AtomicU64::new(0),
        };
        // Build one now, so a bad certificate is refused here.
        this.build().map_err(|e| RegistryError::InvalidArgument {
            what: "registry CA files".into(),
            detail: format!(
                "{}; check that each holds PEM certificates",
                crate::error::chain_text(&e)
            ),
        })?;
        Ok(this)
    }

    fn build(&self) -> Result<oci_client::Client, OciDistributionError> {
        oci_client::Client::try_from(ClientConfig {
            protocol: ClientProtocol::HttpsExcept(self.insecure.clone()),
            extra_root_certificates: self.roots.clone(),
            // One streamed PUT per blob (POST, then PUT ?digest= with the
            // body): chunked PATCHes would be one request per read.
            use_monolithic_push: true,
            platform_resolver: None,
            connect_timeout: Some(self.timeouts.0),
            read_timeout: Some(self.timeouts.1),
            user_agent: USER_AGENT,
            ..ClientConfig::default()
        })
    }

    /// The oci-client for `r`'s registry and `creds`, made on first use.
    /// oci-client keeps the first credentials it is given for a registry,
    /// hence one client per (registry, credentials).
    async fn client(
        &self,
        r: &Reference,
        creds: &Credentials,
    ) -> Result<oci_client::Client, RegistryError> {
        let registry = r.resolve_registry().to_string();
        let key = (registry.clone(), creds.clone());
        let existing = self
            .clients
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .cloned();
        if let Some(c) = existing {
            return Ok(c);
        }
        let built = self.build().map_err(|e| RegistryError::Rejected {
            registry: registry.clone(),
            op: "connect to",
            target: "the registry".into(),
            status: None,
            retry_after_s: None,
            detail: crate::error::chain_text(&e),
        })?;
        let c = self
            .clients
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key)
            .or_insert(built)
            .clone();
        c.store_auth_if_needed(&registry, &registry_auth(creds))
            .await;
        Ok(c)
    }

    fn ctx<'a>(
        &self,
        r: &'a Reference,
        creds: &Credentials,
        op: &'static str,
        target: String,
    ) -> Ctx<'a> {
        let registry = r.resolve_registry();
        Ctx {
            registry,
            insecure: self.insecure.iter().any(|i| i == registry),
            anonymous: creds.is_anonymous(),
            op,
            target,
        }
    }

    /// Retries made since this client was created: each one a transient
    /// failure of a step that was then tried again (see the crate docs,
    /// "Retries"). For metrics and tests.
    #[must_use]
    pub fn retries_total(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    /// Runs `step` until it succeeds, fails with an error that is not
    /// transient ([`transient`]), or has been tried `backoff.attempts`
    /// times; between tries it sleeps the backoff's delay and logs a warning.
    /// Out of attempts, the last error is wrapped in
    /// [`RegistryError::GaveUp`] (same kind). `step` must be a whole
    /// idempotent step: it is called again from its start.
    async fn with_retries<T, F, Fut>(
        &self,
        r: &Reference,
        op: &'static str,
        target: &str,
        mut step: F,
    ) -> Result<T, RegistryError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, RegistryError>>,
    {
        let mut waited = Duration::ZERO;
        let mut attempt: u32 = 1;
        loop {
            let err = match step().await {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            let Some(why) = transient(&err) else {
                return Err(err);
            };
            if attempt >= self.backoff.attempts {
                if attempt == 1 {
                    // Retries are off (retry_attempts = 1): the error as is.
                    return Err(err);
                }
                return Err(RegistryError::GaveUp {
                    registry: r.resolve_registry().to_string(),
                    op,
                    target: target.to_string(),
                    attempts: attempt,
                    waited_ms: u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
                    last: Box::new(err),
                });
            }
            let unit = self
                .jitter
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .next_unit();
            let delay = self.backoff.delay(attempt, unit, why.retry_after);
            tracing::warn!(
                registry = %r.resolve_registry(),
                operation = op,
                target,
                attempt,
                attempts = self.backoff.attempts,
                delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                cause = %err,
                "registry step failed transiently; retrying"
            );
            self.retries.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(delay).await;
            waited += delay;
            attempt += 1;
        }
    }

    /// True when `r`'s repository holds blob `digest` (`HEAD
    /// /v2/REPO/blobs/DIGEST`: 200 → true, 404 → false).
    ///
    /// Errors: `invalid_argument` (digest), `permission_denied`,
    /// `unavailable`, `failed_precondition` (TLS / insecure), see
    /// [`RegistryError`].
    pub async fn blob_exists(
        &self,
        r: &Reference,
        creds: &Credentials,
        digest: &str,
    ) -> Result<bool, RegistryError> {
        check_digest(digest)?;
        let target = format!("blob {digest} in {}", r.repository());
        self.with_retries(r, "check", &target, || {
            self.blob_exists_once(r, creds, digest, &target)
        })
        .await
    }

    /// One `HEAD` of blob `digest`.
    async fn blob_exists_once(
        &self,
        r: &Reference,
        creds: &Credentials,
        digest: &str,
        target: &str,
    ) -> Result<bool, RegistryError> {
        let c = self.client(r, creds).await?;
        c.blob_exists(r, digest)
            .await
            .map_err(|e| classify(e, self.ctx(r, creds, "check", target.to_string())))
    }

    /// Sends the file at `path` as blob `digest` (`size` bytes) to `r`'s
    /// repository, unless [`RegistryClient::blob_exists`] says it is there.
    /// Streamed from the file ([`PUSH_READ_BYTES`] at a time, one `PUT`),
    /// never whole in memory; the registry verifies the digest.
    ///
    /// Errors: `invalid_argument` when the file is not `size` bytes or the
    /// digest is malformed; `corrupt` when the registry computes another
    /// digest (the file is not that blob); the rest as
    /// [`RegistryClient::blob_exists`].
    pub async fn push_blob_file(
        &self,
        r: &Reference,
        creds: &Credentials,
        path: &Path,
        digest: &str,
        size: u64,
    ) -> Result<BlobPush, RegistryError> {
        // The file is checked first, even when the registry has the blob.
        drop(open_sized(path, digest, size).await?);
        if self.blob_exists(r, creds, digest).await? {
            return Ok(BlobPush::AlreadyPresent);
        }
        self.upload(r, creds, path, digest, size).await?;
        Ok(BlobPush::Uploaded)
    }

    /// [`RegistryClient::push_blob_file`] without asking first whether the
    /// registry has the blob: for a caller that just asked.
    ///
    /// Errors: as [`RegistryClient::push_blob_file`].
    pub async fn upload_blob_file(
        &self,
        r: &Reference,
        creds: &Credentials,
        path: &Path,
        digest: &str,
        size: u64,
    ) -> Result<(), RegistryError> {
        self.upload(r, creds, path, digest, size).await
    }

    /// Uploads blob `digest` (`size` bytes) from the file at `path`, with
    /// retries: each attempt opens a new upload session (`POST`) and streams
    /// the file again from its start (one `PUT ?digest=`).
    async fn upload(
        &self,
        r: &Reference,
        creds: &Credentials,
        path: &Path,
        digest: &str,
        size: u64,
    ) -> Result<(), RegistryError> {
        let target = format!("blob {digest} to {}", r.repository());
        self.with_retries(r, "push", &target, || {
            self.upload_once(r, creds, path, digest, size, &target)
        })
        .await
    }

    /// One upload session: `POST`, then one streamed `PUT` of the file.
    async fn upload_once(
        &self,
        r: &Reference,
        creds: &Credentials,
        path: &Path,
        digest: &str,
        size: u64,
        target: &str,
    ) -> Result<(), RegistryError> {
        let file = open_sized(path, digest, size).await?;
        let c = self.client(r, creds).await?;
        let stream = tokio_util::io::ReaderStream::with_capacity(file, PUSH_READ_BYTES)
            .map_err(OciDistributionError::IoError);
        c.push_blob_stream(r, stream, digest, Some(size))
            .await
            .map_err(
                |e| match classify(e, self.ctx(r, creds, "push", target.to_string())) {
                    RegistryError::Corrupt {
                        registry, actual, ..
                    } => RegistryError::NotThatBlob {
                        registry,
                        digest: digest.to_string(),
                        path: path.to_path_buf(),
                        detail: actual,
                    },
                    other => other,
                },
            )?;
        Ok(())
    }

    /// Fetches blob `digest` (`size` bytes) of `r`'s repository into `dst`:
    /// streamed into a temp file in `dst`'s directory while its sha256 and
    /// length are checked, fsynced, then renamed onto `dst`. On any error
    /// nothing is left at `dst` (an existing `dst` is untouched) and the temp
    /// file is removed.
    ///
    /// Errors: `corrupt` when more or fewer than `size` bytes arrive or they
    /// do not hash to `digest`; `not_found` when the registry lacks the blob;
    /// `internal` / `no_space` for local writes; the rest as
    /// [`RegistryClient::blob_exists`].
    pub async fn pull_blob_to_file(
        &self,
        r: &Reference,
        creds: &Credentials,
        digest: &str,
        size: u64,
        dst: &Path,
    ) -> Result<(), RegistryError> {
        check_digest(digest)?;
        let target = format!("blob {digest} in {}", r.repository());
        self.with_retries(r, "pull", &target, || {
            self.pull_blob_once(r, creds, digest, size, dst, &target)
        })
        .await
    }

    /// One `GET` of blob `digest` into a new temp file beside `dst`, renamed
    /// onto `dst` when whole and verified; on any error the temp file is
    /// removed (dropped), so a retry starts from nothing.
    async fn pull_blob_once(
        &self,
        r: &Reference,
        creds: &Credentials,
        digest: &str,
        size: u64,
        dst: &Path,
        target: &str,
    ) -> Result<(), RegistryError> {
        let registry = r.resolve_registry().to_string();
        let corrupt = |expected: String, actual: String| RegistryError::Corrupt {
            registry: registry.clone(),
            target: target.to_string(),
            expected,
            actual,
        };
        let dir = match dst.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let c = self.client(r, creds).await?;
        let mut stream = c
            .pull_blob_stream(r, digest)
            .await
            .map_err(|e| classify(e, self.ctx(r, creds, "pull", target.to_string())))?;
        if let Some(len) = stream.content_length {
            if len != size {
                return Err(corrupt(
                    format!("{size} bytes"),
                    format!("{len} bytes announced"),
                ));
            }
        }
        let tmp = tempfile::Builder::new()
            .prefix(".layerstack-pull-")
            .tempfile_in(&dir)
            .map_err(|e| RegistryError::io("create a temp file in", &dir, e))?;
        let (std_file, tmp_path) = tmp.into_parts();
        let mut file = tokio::fs::File::from_std(std_file);
        let mut hasher = Sha256::new();
        let mut received: u64 = 0;
        while let Some(chunk) = stream.next().await {
            let chunk = match chunk {
                Ok(c) => c,
                Err(e) => {
                    // oci-client's own check fails the last read on a
                    // mismatch: report it as ours.
                    let ours = format!("sha256:{:x}", hasher.clone().finalize());
                    if received == size && ours != digest {
                        return Err(corrupt(digest.to_string(), ours));
                    }
                    return Err(RegistryError::Unreachable {
                        registry: registry.clone(),
                        transient: true,
                        detail: format!(
                            "reading {target} after {received} of {size} bytes: {}",
                            crate::error::chain_text(&e)
                        ),
                    });
                }
            };
            received += chunk.len() as u64;
            if received > size {
                return Err(corrupt(
                    format!("{size} bytes"),
                    format!("more ({received} bytes so far)"),
                ));
            }
            hasher.update(&chunk);
            file.write_all(&chunk)
                .await
                .map_err(|e| RegistryError::io("write", tmp_path.to_path_buf(), e))?;
        }
        if received != size {
            return Err(corrupt(
                format!("{size} bytes"),
                format!("{received} bytes"),
            ));
        }
        let actual = format!("sha256:{:x}", hasher.finalize());
        if actual != digest {
            return Err(corrupt(digest.to_string(), actual));
        }
        file.flush()
            .await
            .map_err(|e| RegistryError::io("write", tmp_path.to_path_buf(), e))?;
        file.sync_all()
            .await
            .map_err(|e| RegistryError::io("fsync", tmp_path.to_path_buf(), e))?;
        drop(file);
        tmp_path
            .persist(dst)
            .map_err(|e| RegistryError::io("rename into", dst, e.error))?;
        Ok(())
    }

    /// Stores `body` as a manifest of `media_type` at `r` (its tag, or its
    /// digest, which must then be the body's). The blobs it names must be
    /// pushed first. Returns `sha256:…` of `body`.
    ///
    /// Errors: `invalid_argument` when `r`'s digest is not the body's, the
    /// media type is not a header value, or the registry refuses the
    /// manifest (HTTP 400: `MANIFEST_INVALID`, `MANIFEST_BLOB_UNKNOWN`); the
    /// rest as [`RegistryClient::blob_exists`].
    pub async fn push_manifest(
        &self,
        r: &Reference,
        creds: &Credentials,
        media_type: &str,
        body: &[u8],
    ) -> Result<String, RegistryError> {
        let digest = sha256_digest(body);
        if let Some(named) = r.digest() {
            if named != digest {
                return Err(RegistryError::InvalidArgument {
                    what: format!("manifest reference {}", r.whole()),
                    detail: format!(
                        "names digest {named} but the body's is {digest}; push by tag, or by the body's digest"
                    ),
                });
            }
        }
        let content_type = media_type
            .parse()
            .map_err(|_| RegistryError::InvalidArgument {
                what: format!("media type {media_type:?}"),
                detail: "is not a valid HTTP header value".into(),
            })?;
        let target = format!("manifest {}", r.whole());
        self.with_retries(r, "push", &target, || {
            self.push_manifest_once(r, creds, body, &content_type, &target)
        })
        .await?;
        Ok(digest)
    }

    /// One manifest `PUT` (idempotent: the same body at the same reference).
    async fn push_manifest_once(
        &self,
        r: &Reference,
        creds: &Credentials,
        body: &[u8],
        content_type: &reqwest::header::HeaderValue,
        target: &str,
    ) -> Result<(), RegistryError> {
        let c = self.client(r, creds).await?;
        c.push_manifest_raw(r, body.to_vec(), content_type.clone())
            .await
            .map_err(|e| classify(e, self.ctx(r, creds, "push", target.to_string())))?;
        Ok(())
    }

    /// Fetches the manifest `r` names (by tag, or by digest: then the body
    /// must hash to it). Accepts OCI image manifests and indexes and docker
    /// schema 2 manifests and lists.
    ///
    /// The size limit ([`MAX_MANIFEST_BYTES`]) is checked on the body
    /// oci-client read whole (it has no streaming manifest call).
    ///
    /// Errors: `not_found`; `corrupt` when the body does not hash to `r`'s
    /// digest; `unsupported` above the size limit; the rest as
    /// [`RegistryClient::blob_exists`].
    pub async fn pull_manifest(
        &self,
        r: &Reference,
        creds: &Credentials,
    ) -> Result<PulledManifest, RegistryError> {
        let target = format!("manifest {}", r.whole());
        let body = self
            .with_retries(r, "pull", &target, || {
                self.pull_manifest_once(r, creds, &target)
            })
            .await?;
        if body.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(RegistryError::ManifestTooLarge {
                reference: r.whole(),
                size: body.len() as u64,
                limit: MAX_MANIFEST_BYTES,
            });
        }
        let digest = sha256_digest(&body);
        if let Some(named) = r.digest() {
            if named != digest {
                return Err(RegistryError::Corrupt {
                    registry: r.resolve_registry().to_string(),
                    target,
                    expected: named.to_string(),
                    actual: digest,
                });
            }
        }
        let media_type = manifest_media_type(&body);
        Ok(PulledManifest {
            body: body.to_vec(),
            digest,
            media_type,
        })
    }

    /// One manifest `GET`.
    async fn pull_manifest_once(
        &self,
        r: &Reference,
        creds: &Credentials,
        target: &str,
    ) -> Result<bytes::Bytes, RegistryError> {
        let c = self.client(r, creds).await?;
        let (body, _) = c
            .pull_manifest_raw(r, &registry_auth(creds), accepted_manifest_types())
            .await
            .map_err(|e| classify(e, self.ctx(r, creds, "pull", target.to_string())))?;
        Ok(body)
    }
}

fn registry_auth(creds: &Credentials) -> RegistryAuth {
    match creds {
        Credentials::Anonymous => RegistryAuth::Anonymous,
        Credentials::Basic { username, password } => {
            RegistryAuth::Basic(username.clone(), password.clone())
        }
        Credentials::Bearer(t) => RegistryAuth::Bearer(t.clone()),
    }
}

/// The manifest media types asked for.
fn accepted_manifest_types() -> &'static [&'static str] {
    &[
        OCI_IMAGE_MEDIA_TYPE,
        OCI_IMAGE_INDEX_MEDIA_TYPE,
        IMAGE_MANIFEST_MEDIA_TYPE,
        IMAGE_MANIFEST_LIST_MEDIA_TYPE,
    ]
}

/// The `mediaType` field of a manifest body, else inferred (see
/// [`PulledManifest::media_type`]).
fn manifest_media_type(body: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct Probe {
        #[serde(rename = "mediaType", default)]
        media_type: Option<String>,
        #[serde(default)]
        manifests: Option<serde_json::Value>,
    }
    match serde_json::from_slice::<Probe>(body) {
        Ok(Probe {
            media_type: Some(m),
            ..
        }) if !m.is_empty() => m,
        Ok(Probe {
            manifests: Some(_), ..
        }) => OCI_IMAGE_INDEX_MEDIA_TYPE.to_string(),
        _ => OCI_IMAGE_MEDIA_TYPE.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn digests_are_checked() {
        let d = sha256_digest(b"abc");
        assert_eq!(
            d,
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(check_digest(&d).is_ok());
        for bad in [
            "",
            "sha256:",
            "sha512:ab",
            "sha256:BA7816BF8F01CFEA414140DE5DAE2223B00361A396177A9CB410FF61F20015AD",
            &d[..70],
        ] {
            let e = check_digest(bad).unwrap_err();
            assert_eq!(
                e.kind(),
                layerstack_types::ErrorKind::InvalidArgument,
                "{bad}"
            );
        }
    }

    #[test]
    fn media_type_from_body() {
        assert_eq!(
            manifest_media_type(
                br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json"}"#
            ),
            OCI_IMAGE_MEDIA_TYPE
        );
        assert_eq!(
            manifest_media_type(br#"{"schemaVersion":2,"manifests":[]}"#),
            OCI_IMAGE_INDEX_MEDIA_TYPE
        );
        assert_eq!(
            manifest_media_type(br#"{"schemaVersion":2,"layers":[]}"#),
            OCI_IMAGE_MEDIA_TYPE
        );
    }

    #[test]
    fn retry_options_are_checked_and_named() {
        let d = RegistryOptions::default();
        assert_eq!(
            (d.retry_attempts, d.retry_base_ms, d.retry_max_ms),
            (4, 200, 5000)
        );
        for (opts, key) in [
            (
                RegistryOptions {
                    retry_attempts: 0,
                    ..Default::default()
                },
                "retry_attempts",
            ),
            (
                RegistryOptions {
                    retry_attempts: MAX_RETRY_ATTEMPTS + 1,
                    ..Default::default()
                },
                "retry_attempts",
            ),
            (
                RegistryOptions {
                    retry_max_ms: MAX_RETRY_MAX_MS + 1,
                    ..Default::default()
                },
                "retry_max_ms",
            ),
            (
                RegistryOptions {
                    retry_base_ms: 6000,
                    ..Default::default()
                },
                "retry_base_ms",
            ),
            (
                RegistryOptions {
                    connect_timeout_ms: 0,
                    ..Default::default()
                },
                "connect_timeout_ms",
            ),
            (
                RegistryOptions {
                    read_timeout_ms: MAX_TIMEOUT_MS + 1,
                    ..Default::default()
                },
                "read_timeout_ms",
            ),
        ] {
            let e = RegistryClient::new(opts).unwrap_err();
            assert_eq!(e.kind(), layerstack_types::ErrorKind::InvalidArgument);
            assert!(e.to_string().contains(key), "{key}: {e}");
        }
        assert!(RegistryClient::new(RegistryOptions {
            retry_attempts: 1,
            retry_base_ms: 0,
            retry_max_ms: 0,
            ..Default::default()
        })
        .is_ok());
    }

    fn quick(attempts: u32) -> RegistryClient {
        RegistryClient::new(RegistryOptions {
            retry_attempts: attempts,
            retry_base_ms: 1,
            retry_max_ms: 2,
            ..Default::default()
        })
        .unwrap()
    }

    fn status(s: u16) -> RegistryError {
        RegistryError::Rejected {
            registry: "reg.example:5000".into(),
            op: "push",
            target: "blob x".into(),
            status: Some(s),
            retry_after_s: None,
            detail: format!("HTTP {s}"),
        }
    }

    #[tokio::test]
    async fn transient_failures_are_retried_until_the_attempts_run_out() {
        use std::sync::atomic::AtomicU32;
        let r = crate::parse_reference("reg.example:5000/a/b:c").unwrap();

        // Always 503: tried exactly `attempts` times, then GaveUp of the same
        // kind naming the registry, the attempts, the last cause, the remedy.
        let client = quick(4);
        let calls = AtomicU32::new(0);
        let e = client
            .with_retries(&r, "push", "blob x to a/b", || async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(status(503))
            })
            .await
            .unwrap_err();
        assert_eq!(calls.load(Ordering::SeqCst), 4);
        assert_eq!(client.retries_total(), 3);
        assert_eq!(e.kind(), layerstack_types::ErrorKind::Unavailable);
        assert!(
            matches!(&e, RegistryError::GaveUp { attempts: 4, .. }),
            "{e:?}"
        );
        let msg = e.to_string();
        for part in ["reg.example:5000", "4 times", "HTTP 503", "retry_attempts"] {
            assert!(msg.contains(part), "{part}: {msg}");
        }

        // 503, 429, then success: three calls, the value returned.
        let client = quick(4);
        let calls = AtomicU32::new(0);
        let v = client
            .with_retries(&r, "pull", "manifest", || async {
                match calls.fetch_add(1, Ordering::SeqCst) {
                    0 => Err(status(503)),
                    1 => Err(status(429)),
                    _ => Ok(7),
                }
            })
            .await
            .unwrap();
        assert_eq!((v, calls.load(Ordering::SeqCst)), (7, 3));
        assert_eq!(client.retries_total(), 2);

        // Not transient (404, 400, 501): one call, the error as is.
        for s in [404, 400, 501] {
            let client = quick(4);
            let calls = AtomicU32::new(0);
            let e = client
                .with_retries(&r, "pull", "manifest", || async {
                    calls.fetch_add(1, Ordering::SeqCst);
                    Err::<(), _>(status(s))
                })
                .await
                .unwrap_err();
            assert_eq!(calls.load(Ordering::SeqCst), 1, "{s}");
            assert!(matches!(e, RegistryError::Rejected { .. }), "{s}");
        }

        // retry_attempts = 1: no retry, the error unwrapped.
        let client = quick(1);
        let calls = AtomicU32::new(0);
        let e = client
            .with_retries(&r, "check", "blob", || async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(status(502))
            })
            .await
            .unwrap_err();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(matches!(e, RegistryError::Rejected { .. }));
        assert_eq!(client.retries_total(), 0);
    }

    #[test]
    fn unreadable_or_empty_ca_file_is_invalid_argument() {
        let d = tempfile::tempdir().unwrap();
        let missing = d.path().join("missing.pem");
        let e = RegistryClient::new(RegistryOptions {
            ca_files: vec![missing.clone()],
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(e.kind(), layerstack_types::ErrorKind::InvalidArgument);
        assert!(
            e.to_string().contains(&missing.display().to_string()),
            "{e}"
        );
        let junk = d.path().join("junk.pem");
        std::fs::write(&junk, "not a certificate").unwrap();
        let e = RegistryClient::new(RegistryOptions {
            ca_files: vec![junk],
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("no PEM certificate"), "{e}");
    }
}
