//! LayerStack's OCI distribution transport: what `layerstack push` / `pull`
//! move through an OCI registry (the distribution spec, v2 API), and nothing
//! above it — which blobs make a node, provenance, adopting pulled layers are
//! the daemon's. This crate knows no store, engine or publisher.
//!
//! | call | HTTP | memory | on a transient failure (see "Retries") |
//! |---|---|---|---|
//! | [`RegistryClient::blob_exists`] | `HEAD /v2/REPO/blobs/DIGEST` | — | the `HEAD` again |
//! | [`RegistryClient::push_blob_file`] | `HEAD`, then `POST …/blobs/uploads/` + one streamed `PUT …?digest=` | 1 MiB read buffer | the `HEAD` again; the upload from a new `POST`, the file re-read |
//! | [`RegistryClient::pull_blob_to_file`] | `GET /v2/REPO/blobs/DIGEST`, sha256 and size checked while writing | one chunk | the temp file dropped, the `GET` again |
//! | [`RegistryClient::push_manifest`] | `PUT /v2/REPO/manifests/TAG-or-DIGEST` | the body | the `PUT` again |
//! | [`RegistryClient::pull_manifest`] | `GET /v2/REPO/manifests/TAG-or-DIGEST` | ≤ [`MAX_MANIFEST_BYTES`] | the `GET` again |
//!
//! The distribution API is `oci-client` (oras-project; auth challenges,
//! bearer tokens from the registry's token service, upload sessions). Only
//! sha256 digests (`sha256:` + 64 lowercase hex) are accepted.
//!
//! **Credentials** are passed per call ([`Credentials`]); where they come
//! from is the caller's choice: [`credentials_from_docker_config`] reads
//! docker's `config.json` ([`docker_config_path`]) the way the docker CLI
//! does, credential helpers included.
//!
//! **Transport security.** HTTPS for every registry except those named in
//! [`RegistryOptions::insecure`] (plain HTTP only for those). Roots: the
//! system's plus [`RegistryOptions::ca_files`]. A registry that answers in the
//! other protocol, or whose certificate does not verify, is refused with a
//! message naming the registry and the option to set ([`RegistryError`]).
//!
//! **TLS: rustls with the `ring` provider.** `oci-client`'s default TLS
//! feature turns on reqwest 0.13's `rustls`, whose crypto provider is
//! aws-lc-rs: that adds `aws-lc-sys`, a large C library (cmake/cc build of
//! several minutes on this project's 2-core machines) for nothing the
//! registry needs. This crate uses `oci-client`'s `rustls-tls-no-provider`
//! instead and installs rustls' `ring` provider as the process default in
//! [`RegistryClient::new`] (unless the process installed one already). `ring`
//! is already in the workspace (tonic's rustls 0.21 uses it), so the registry
//! client adds no new C build.
//!
//! **Errors** ([`RegistryError`], [`RegistryError::kind`]): an invalid
//! reference → `invalid_argument`; 401/403 → `permission_denied` with "log in
//! (docker login REGISTRY) or put credentials in config.json"; an unknown
//! manifest or blob → `not_found`; connection refused, DNS → `unavailable`;
//! HTTPS to a plain-HTTP registry or plain HTTP to an HTTPS one, and an
//! untrusted certificate → `failed_precondition`; content that does not match
//! its digest or size → `corrupt`; HTTP 408, 429, 5xx → `unavailable`.
//!
//! **Retries.** Each row of the table above is one step, and a step that
//! fails transiently is run again whole: connection refused or reset, a
//! timeout, a connection that broke mid-request, a temporary DNS failure, HTTP
//! 408, 429 and 5xx except 501. Never retried: other 4xx, 401/403, not found,
//! digest or size mismatches, invalid references, TLS and protocol
//! mismatches, a name that does not resolve. A blob upload starts a new upload
//! session (`POST`) and streams the file again from its start; a download
//! that broke is discarded with its temp file and fetched again. Up to
//! [`RegistryOptions::retry_attempts`] tries in all (default 4); before retry
//! `n` a delay drawn in `[c/2, c]`, `c = min(retry_max_ms, retry_base_ms ·
//! 2^(n-1))` (defaults 200 and 5000 ms). Each retry is a `tracing` warning
//! (registry, operation, target, attempt, delay_ms, cause) and counts in
//! [`RegistryClient::retries_total`]. Out of attempts the error is
//! [`RegistryError::GaveUp`]: the last failure's kind, its message naming the
//! registry, the attempts, the last cause and what to do. `Retry-After`:
//! oci-client 0.18 keeps no response headers in its errors, so a 429 is
//! retried on the schedule ([`RegistryError::Rejected`]'s `retry_after_s`
//! is where one would come in; the schedule would honour it, capped at
//! `retry_max_ms`).
//!
//! ```no_run
//! # async fn f() -> Result<(), layerstack_registry::RegistryError> {
//! use layerstack_registry::*;
//! let client = RegistryClient::new(RegistryOptions::default())?;
//! let r = parse_reference("registry.example.com/team/checkpoints:step-12")?;
//! let creds = match docker_config_path() {
//!     Some(p) => credentials_from_docker_config(&p, r.registry())?,
//!     None => Credentials::Anonymous,
//! };
//! let m = client.pull_manifest(&r, &creds).await?;
//! println!("{} {} ({} bytes)", m.digest, m.media_type, m.body.len());
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

mod client;
mod credentials;
mod error;
pub mod image;
mod retry;

pub use client::{
    sha256_digest, BlobPush, PulledManifest, RegistryClient, RegistryOptions, MAX_MANIFEST_BYTES,
};
pub use credentials::{credentials_from_docker_config, docker_config_path, Credentials};
pub use error::{RegistryError, LOGIN_HINT};
/// A parsed reference (`oci-client`'s, from `oci-spec`): `registry()`,
/// `repository()`, `tag()`, `digest()`, `whole()`.
pub use oci_client::Reference;
pub use retry::{
    DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_READ_TIMEOUT_MS, DEFAULT_RETRY_ATTEMPTS,
    DEFAULT_RETRY_BASE_MS, DEFAULT_RETRY_MAX_MS, MAX_RETRY_ATTEMPTS, MAX_RETRY_MAX_MS,
    MAX_TIMEOUT_MS,
};

/// Parses `REGISTRY[:PORT]/REPOSITORY[:TAG][@sha256:HEX]` (docker's grammar:
/// a name without a registry is Docker Hub's, `docker.io/library/NAME`; no
/// tag and no digest means `:latest`).
///
/// Errors: `invalid_argument` ([`RegistryError::InvalidReference`]) naming
/// the text and the expected form; a digest other than sha256 is refused.
pub fn parse_reference(s: &str) -> Result<Reference, RegistryError> {
    let bad = |reason: String| RegistryError::InvalidReference {
        reference: s.to_string(),
        reason,
    };
    if s.is_empty() || s.trim() != s {
        return Err(bad("empty, or surrounded by white space".into()));
    }
    let r = Reference::try_from(s).map_err(|e| {
        // The distribution spec's repository names are lowercase; docker's
        // own message for it is as terse as oci-client's.
        let path = s.split(['@']).next().unwrap_or(s);
        let repo = match path.split_once('/') {
            Some((first, rest)) if first.contains(['.', ':']) || first == "localhost" => rest,
            _ => path,
        };
        let repo = repo.rsplit_once(':').map_or(repo, |(r, _)| r);
        if repo.chars().any(|c| c.is_ascii_uppercase()) {
            bad(format!(
                "{e}: repository names are lowercase ({:?})",
                repo.to_ascii_lowercase()
            ))
        } else {
            bad(e.to_string())
        }
    })?;
    if let Some(d) = r.digest() {
        client::check_digest(d).map_err(|e| bad(e.to_string()))?;
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use layerstack_types::ErrorKind;

    #[test]
    fn references_parse() {
        let r = parse_reference("127.0.0.1:5000/team/node:v1").unwrap();
        assert_eq!(r.registry(), "127.0.0.1:5000");
        assert_eq!(r.repository(), "team/node");
        assert_eq!(r.tag(), Some("v1"));
        assert_eq!(r.digest(), None);

        let d = sha256_digest(b"x");
        let r = parse_reference(&format!("reg.example/a/b@{d}")).unwrap();
        assert_eq!(r.digest(), Some(d.as_str()));
        assert_eq!(r.registry(), "reg.example");

        let r = parse_reference("busybox").unwrap();
        assert_eq!(r.registry(), "docker.io");
        assert_eq!(r.repository(), "library/busybox");
        assert_eq!(r.tag(), Some("latest"));
    }

    #[test]
    fn bad_references_name_the_text_and_the_form() {
        for bad in [
            "",
            " reg.example/a:b",
            "reg.example/A:b",
            "reg.example/a:b:c",
            "reg.example/a@sha256:123",
            "reg.example/a@md5:d41d8cd98f00b204e9800998ecf8427e",
        ] {
            let e = parse_reference(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad}");
            let msg = e.to_string();
            assert!(msg.contains(&format!("{bad:?}")), "{msg}");
            assert!(msg.contains("expected REGISTRY[:PORT]/REPOSITORY"), "{msg}");
        }
        let e = parse_reference("127.0.0.1:5000/RL/Task:x").unwrap_err();
        assert!(e.to_string().contains("lowercase (\"rl/task\")"), "{e}");
        let e = parse_reference("reg.example/a:b:c").unwrap_err();
        assert!(!e.to_string().contains("lowercase"), "{e}");
    }
}
