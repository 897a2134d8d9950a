//! The transport against a real registry: Debian's `docker-registry`
//! (distribution 2.8) started privately on 127.0.0.1 by
//! `layerstack_integration::registry::TestRegistry` — plain HTTP, TLS with a
//! throwaway CA, TLS + htpasswd basic auth. Without `docker-registry` (or
//! `openssl` / `htpasswd`) a test prints SKIPPED, or fails when `CI=true`.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use layerstack_integration::registry::{
    require_docker_registry, write_credential_helper, RegistryKind, TestRegistry, REGISTRY_USER,
};
use layerstack_registry::{
    credentials_from_docker_config, parse_reference, sha256_digest, BlobPush, Credentials,
    Reference, RegistryClient, RegistryError, RegistryOptions,
};
use layerstack_types::ErrorKind;

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

fn start(kind: RegistryKind) -> Option<TestRegistry> {
    if !require_docker_registry(kind) {
        return None;
    }
    Some(TestRegistry::start(kind).expect("start docker-registry"))
}

/// A client that may reach `reg` (insecure for plain, its CA for TLS).
fn client_for(reg: &TestRegistry) -> RegistryClient {
    let opts = match reg.ca_pem() {
        Some(ca) => RegistryOptions {
            ca_files: vec![ca],
            ..Default::default()
        },
        None => RegistryOptions {
            insecure: vec![reg.host()],
            ..Default::default()
        },
    };
    RegistryClient::new(opts).unwrap()
}

fn reference(reg: &TestRegistry, repo_tag: &str) -> Reference {
    parse_reference(&format!("{}/{repo_tag}", reg.host())).unwrap()
}

/// Writes `len` bytes derived from `seed` to `dir/name`; (path, digest).
fn blob_file(dir: &Path, name: &str, seed: u8, len: usize) -> (PathBuf, String) {
    let data: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect();
    let p = dir.join(name);
    std::fs::write(&p, &data).unwrap();
    (p, sha256_digest(&data))
}

fn expect_kind<T: std::fmt::Debug>(r: Result<T, RegistryError>, kind: ErrorKind) -> RegistryError {
    let e = r.expect_err("expected an error");
    eprintln!("{kind}: {e}");
    assert_eq!(e.kind(), kind, "{e}");
    e
}

/// Where distribution 2.8's filesystem driver keeps a blob's bytes.
fn stored_blob(reg: &TestRegistry, digest: &str) -> PathBuf {
    let hex = digest.strip_prefix("sha256:").unwrap();
    reg.dir()
        .join("data/docker/registry/v2/blobs/sha256")
        .join(&hex[..2])
        .join(hex)
        .join("data")
}

/// An OCI image manifest naming `config` and `layers` (digest, size).
fn manifest(config: (&str, u64), layers: &[(&str, u64)]) -> Vec<u8> {
    let layers: Vec<serde_json::Value> = layers
        .iter()
        .map(|(d, s)| {
            serde_json::json!({
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": d, "size": s,
            })
        })
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config.0, "size": config.1,
        },
        "layers": layers,
        "annotations": {"org.layerstack.node": "n-1"},
    }))
    .unwrap()
}

#[tokio::test]
async fn blobs_push_pull_verify_and_skip() {
    let Some(reg) = start(RegistryKind::Plain) else {
        return;
    };
    let client = client_for(&reg);
    let anon = Credentials::Anonymous;
    let r = reference(&reg, "team/node:v1");
    let tmp = tempfile::tempdir().unwrap();
    // 3 MiB + 5: several reads of the pushing side, several chunks pulled.
    let size = 3 * 1024 * 1024 + 5;
    let (path, digest) = blob_file(tmp.path(), "layer", 7, size);
    let size = size as u64;

    assert!(!client.blob_exists(&r, &anon, &digest).await.unwrap());
    assert_eq!(
        client
            .push_blob_file(&r, &anon, &path, &digest, size)
            .await
            .unwrap(),
        BlobPush::Uploaded
    );
    assert!(client.blob_exists(&r, &anon, &digest).await.unwrap());
    assert_eq!(reg.blob_uploads_completed().unwrap(), 1);

    // A second push is skipped after the HEAD: still one upload.
    assert_eq!(
        client
            .push_blob_file(&r, &anon, &path, &digest, size)
            .await
            .unwrap(),
        BlobPush::AlreadyPresent
    );
    assert_eq!(
        reg.blob_uploads_completed().unwrap(),
        1,
        "{}",
        reg.log_tail(20)
    );

    // Pull: the same bytes.
    let dst = tmp.path().join("pulled");
    client
        .pull_blob_to_file(&r, &anon, &digest, size, &dst)
        .await
        .unwrap();
    assert_eq!(std::fs::read(&dst).unwrap(), std::fs::read(&path).unwrap());
    assert_eq!(reg.blob_gets().unwrap(), 1);

    // The wrong size: corrupt, nothing at the destination.
    let dst2 = tmp.path().join("wrong-size");
    let e = expect_kind(
        client
            .pull_blob_to_file(&r, &anon, &digest, size - 1, &dst2)
            .await,
        ErrorKind::Corrupt,
    );
    assert!(e.to_string().contains(&reg.host()), "{e}");
    assert!(!dst2.exists());

    // A digest the registry lacks: not_found, nothing at the destination.
    let missing = sha256_digest(b"not pushed");
    let e = expect_kind(
        client
            .pull_blob_to_file(&r, &anon, &missing, 10, &dst2)
            .await,
        ErrorKind::NotFound,
    );
    assert!(e.to_string().contains(&missing), "{e}");
    assert!(!dst2.exists());

    // The registry serves bytes that do not hash to the digest (its stored
    // copy damaged, same length): corrupt, nothing at the destination, and
    // no temp file left in the directory.
    let stored = stored_blob(&reg, &digest);
    let mut bytes = std::fs::read(&stored).unwrap();
    bytes[size as usize / 2] ^= 0xff;
    std::fs::write(&stored, &bytes).unwrap();
    let e = expect_kind(
        client
            .pull_blob_to_file(&r, &anon, &digest, size, &dst2)
            .await,
        ErrorKind::Corrupt,
    );
    assert!(e.to_string().contains(&digest), "{e}");
    assert!(!dst2.exists());
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 2, "only the source and the good pull: {left:?}");

    // A file that is not the size given is refused before anything is sent.
    expect_kind(
        client
            .push_blob_file(&r, &anon, &path, &missing, size + 1)
            .await,
        ErrorKind::InvalidArgument,
    );
    // A file that is not the blob it is pushed as: the registry refuses it.
    let e = expect_kind(
        client
            .push_blob_file(&r, &anon, &path, &missing, size)
            .await,
        ErrorKind::Corrupt,
    );
    assert!(e.to_string().contains(&path.display().to_string()), "{e}");
    expect_kind(
        client.blob_exists(&r, &anon, "sha256:abc").await,
        ErrorKind::InvalidArgument,
    );
}

#[tokio::test]
async fn manifests_round_trip_by_tag_and_digest() {
    let Some(reg) = start(RegistryKind::Plain) else {
        return;
    };
    let client = client_for(&reg);
    let anon = Credentials::Anonymous;
    let tmp = tempfile::tempdir().unwrap();
    let r = reference(&reg, "team/node:step-1");
    let (layer, layer_digest) = blob_file(tmp.path(), "layer", 1, 1000);
    let (config, config_digest) = blob_file(tmp.path(), "config", 2, 100);
    for (p, d, s) in [
        (&layer, &layer_digest, 1000),
        (&config, &config_digest, 100),
    ] {
        client.push_blob_file(&r, &anon, p, d, s).await.unwrap();
    }
    let body = manifest((&config_digest, 100), &[(&layer_digest, 1000)]);
    let digest = client
        .push_manifest(&r, &anon, OCI_MANIFEST, &body)
        .await
        .unwrap();
    assert_eq!(digest, sha256_digest(&body));

    let by_tag = client.pull_manifest(&r, &anon).await.unwrap();
    assert_eq!(by_tag.body, body);
    assert_eq!(by_tag.digest, digest);
    assert_eq!(by_tag.media_type, OCI_MANIFEST);

    let by_digest_ref = parse_reference(&format!("{}/team/node@{digest}", reg.host())).unwrap();
    let by_digest = client.pull_manifest(&by_digest_ref, &anon).await.unwrap();
    assert_eq!(by_digest, by_tag);

    // Pushing by digest: the body's digest only.
    assert_eq!(
        client
            .push_manifest(&by_digest_ref, &anon, OCI_MANIFEST, &body)
            .await
            .unwrap(),
        digest
    );
    let other = manifest((&config_digest, 100), &[]);
    expect_kind(
        client
            .push_manifest(&by_digest_ref, &anon, OCI_MANIFEST, &other)
            .await,
        ErrorKind::InvalidArgument,
    );

    // A manifest naming a blob the registry lacks is refused.
    let dangling = manifest((&config_digest, 100), &[(&sha256_digest(b"nope"), 4)]);
    let e = expect_kind(
        client
            .push_manifest(
                &reference(&reg, "team/node:dangling"),
                &anon,
                OCI_MANIFEST,
                &dangling,
            )
            .await,
        ErrorKind::InvalidArgument,
    );
    assert!(e.to_string().contains(&reg.host()), "{e}");

    let missing = reference(&reg, "team/node:never-pushed");
    let e = expect_kind(
        client.pull_manifest(&missing, &anon).await,
        ErrorKind::NotFound,
    );
    assert!(e.to_string().contains("never-pushed"), "{e}");
}

#[tokio::test]
async fn basic_auth_over_tls_with_docker_config() {
    let Some(reg) = start(RegistryKind::TlsBasicAuth) else {
        return;
    };
    let client = client_for(&reg);
    let r = reference(&reg, "team/node:v1");
    let tmp = tempfile::tempdir().unwrap();
    let (path, digest) = blob_file(tmp.path(), "layer", 3, 4096);
    let host = reg.host();
    let password = reg.password().unwrap().to_string();

    // No credentials: permission_denied, with the hint naming the registry.
    let e = expect_kind(
        client
            .blob_exists(&r, &Credentials::Anonymous, &digest)
            .await,
        ErrorKind::PermissionDenied,
    );
    let msg = e.to_string();
    assert!(msg.contains(&format!("docker login {host}")), "{msg}");
    assert!(msg.contains("config.json"), "{msg}");
    assert!(msg.contains("no credentials"), "{msg}");

    // The wrong password: permission_denied, for a push too.
    let wrong = Credentials::Basic {
        username: REGISTRY_USER.into(),
        password: "wrong".into(),
    };
    let e = expect_kind(
        client
            .push_blob_file(&r, &wrong, &path, &digest, 4096)
            .await,
        ErrorKind::PermissionDenied,
    );
    assert!(e.to_string().contains("refused"), "{e}");
    assert_eq!(reg.blob_uploads_completed().unwrap(), 0);

    // config.json with `auth` (base64 user:password).
    use base64::Engine as _;
    let auth =
        base64::engine::general_purpose::STANDARD.encode(format!("{REGISTRY_USER}:{password}"));
    let config = tmp.path().join("config.json");
    std::fs::write(
        &config,
        format!(r#"{{"auths":{{"https://{host}":{{"auth":"{auth}"}}}}}}"#),
    )
    .unwrap();
    let creds = credentials_from_docker_config(&config, r.registry()).unwrap();
    assert!(!format!("{creds:?}").contains(&password));
    assert_eq!(
        client
            .push_blob_file(&r, &creds, &path, &digest, 4096)
            .await
            .unwrap(),
        BlobPush::Uploaded
    );
    let body = manifest((&digest, 4096), &[]);
    client
        .push_manifest(&r, &creds, OCI_MANIFEST, &body)
        .await
        .unwrap();
    assert_eq!(client.pull_manifest(&r, &creds).await.unwrap().body, body);

    // config.json naming a credential helper for this registry.
    let bin = tmp.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    write_credential_helper(&bin, "lsttest", &host, REGISTRY_USER, &password).unwrap();
    let mut dirs = vec![bin];
    dirs.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    std::env::set_var("PATH", std::env::join_paths(dirs).unwrap());
    std::fs::write(
        &config,
        format!(r#"{{"auths":{{}},"credHelpers":{{"{host}":"lsttest"}}}}"#),
    )
    .unwrap();
    let creds = credentials_from_docker_config(&config, r.registry()).unwrap();
    assert!(matches!(&creds, Credentials::Basic { username, .. } if username == REGISTRY_USER));
    let dst = tmp.path().join("pulled");
    client
        .pull_blob_to_file(&r, &creds, &digest, 4096, &dst)
        .await
        .unwrap();
    assert_eq!(std::fs::read(&dst).unwrap(), std::fs::read(&path).unwrap());
}

#[tokio::test]
async fn tls_needs_the_ca_and_https_needs_tls() {
    let Some(tls) = start(RegistryKind::Tls) else {
        return;
    };
    let anon = Credentials::Anonymous;
    let digest = sha256_digest(b"x");
    let r = reference(&tls, "a/b:c");

    // With the CA: works.
    assert!(!client_for(&tls)
        .blob_exists(&r, &anon, &digest)
        .await
        .unwrap());

    // Without it: the registry and the CA option named.
    let bare = RegistryClient::new(RegistryOptions::default()).unwrap();
    let e = expect_kind(
        bare.blob_exists(&r, &anon, &digest).await,
        ErrorKind::FailedPrecondition,
    );
    let msg = e.to_string();
    assert!(
        msg.contains(&tls.host()) && msg.contains("ca_files"),
        "{msg}"
    );

    // Named insecure while it serves HTTPS.
    let plain_client = RegistryClient::new(RegistryOptions {
        insecure: vec![tls.host()],
        ..Default::default()
    })
    .unwrap();
    let e = expect_kind(
        plain_client.blob_exists(&r, &anon, &digest).await,
        ErrorKind::FailedPrecondition,
    );
    assert!(e.to_string().contains("remove"), "{e}");
    let e = expect_kind(
        plain_client.pull_manifest(&r, &anon).await,
        ErrorKind::FailedPrecondition,
    );
    assert!(e.to_string().contains(&tls.host()), "{e}");

    // A plain-HTTP registry not named insecure: HTTPS refused, clearly.
    let Some(plain) = start(RegistryKind::Plain) else {
        return;
    };
    let r = reference(&plain, "a/b:c");
    let e = expect_kind(
        bare.blob_exists(&r, &anon, &digest).await,
        ErrorKind::FailedPrecondition,
    );
    let msg = e.to_string();
    assert!(
        msg.contains(&plain.host()) && msg.contains("insecure"),
        "{msg}"
    );
    // Named insecure: works.
    assert!(!client_for(&plain)
        .blob_exists(&r, &anon, &digest)
        .await
        .unwrap());
    assert_eq!(plain.blob_uploads_completed().unwrap(), 0);
}

#[tokio::test]
async fn nothing_listening_is_unavailable() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let host = format!("127.0.0.1:{port}");
    let client = RegistryClient::new(RegistryOptions {
        insecure: vec![host.clone()],
        ..Default::default()
    })
    .unwrap();
    let r = parse_reference(&format!("{host}/a/b:c")).unwrap();
    let e = expect_kind(
        client.pull_manifest(&r, &Credentials::Anonymous).await,
        ErrorKind::Unavailable,
    );
    assert!(e.to_string().contains(&host), "{e}");
    let r = parse_reference("no-such-host.invalid/a/b:c").unwrap();
    let e = expect_kind(
        client
            .blob_exists(&r, &Credentials::Anonymous, &sha256_digest(b""))
            .await,
        ErrorKind::Unavailable,
    );
    assert!(e.to_string().contains("no-such-host.invalid"), "{e}");
}

/// One scripted refusal of [`FlakyProxy`]: the next request whose method is
/// `method` and whose path contains `path` is answered `status` (with
/// `Retry-After` when given) instead of being forwarded.
struct Refusal {
    method: &'static str,
    path: &'static str,
    status: u16,
    retry_after: Option<u32>,
}

/// A small HTTP/1.1 proxy on 127.0.0.1 in front of `upstream`, one request
/// per connection (`Connection: close` both ways): each request's head and
/// body are read whole, then either refused by the script (or by
/// `refuse_all`, a path part refused with 503 forever) or forwarded, the
/// answer relayed until the registry closes. `log` keeps `METHOD PATH ->
/// STATUS|forwarded` per request, so a test counts the retried requests.
struct FlakyProxy {
    host: String,
    script: std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<Refusal>>>,
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl FlakyProxy {
    async fn start(
        upstream: std::net::SocketAddr,
        script: Vec<Refusal>,
        refuse_all: Option<&'static str>,
    ) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let host = listener.local_addr().unwrap().to_string();
        let script = std::sync::Arc::new(std::sync::Mutex::new(script.into()));
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (s, l) = (script.clone(), log.clone());
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(proxy_one(conn, upstream, s.clone(), l.clone(), refuse_all));
            }
        });
        Self { host, script, log }
    }

    /// The log lines that are refusals.
    fn refused(&self) -> Vec<String> {
        let log = self.log.lock().unwrap();
        log.iter()
            .filter(|l| !l.ends_with("forwarded"))
            .cloned()
            .collect()
    }

    fn script_left(&self) -> usize {
        self.script.lock().unwrap().len()
    }
}

async fn proxy_one(
    mut conn: tokio::net::TcpStream,
    upstream: std::net::SocketAddr,
    script: std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<Refusal>>>,
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    refuse_all: Option<&'static str>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = Vec::new();
    let mut chunk = [0u8; 65536];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.split("\r\n");
    let first = lines.next().unwrap_or("").to_string();
    let mut parts = first.split(' ');
    let method = parts.next().unwrap_or("").to_string();
    let path = parts.next().unwrap_or("").to_string();
    let mut length = 0usize;
    let mut headers = Vec::new();
    for line in lines.filter(|l| !l.is_empty()) {
        let lower = line.to_ascii_lowercase();
        assert!(
            !lower.starts_with("transfer-encoding"),
            "the proxy handles Content-Length bodies only: {first}"
        );
        if let Some(v) = lower.strip_prefix("content-length:") {
            length = v.trim().parse().unwrap();
        }
        if !lower.starts_with("connection:") {
            headers.push(line.to_string());
        }
    }
    while buf.len() < head_end + length {
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let refusal = {
        let mut script = script.lock().unwrap();
        match script.front() {
            Some(r) if r.method == method && path.contains(r.path) => script.pop_front(),
            _ => refuse_all.filter(|p| path.contains(p)).map(|_| Refusal {
                method: "",
                path: "",
                status: 503,
                retry_after: None,
            }),
        }
    };
    let short = path.split('?').next().unwrap_or("").to_string();
    if let Some(r) = refusal {
        log.lock()
            .unwrap()
            .push(format!("{method} {short} -> {}", r.status));
        let extra = r
            .retry_after
            .map(|s| format!("Retry-After: {s}\r\n"))
            .unwrap_or_default();
        let answer = format!(
            "HTTP/1.1 {} Refused\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n",
            r.status
        );
        let _ = conn.write_all(answer.as_bytes()).await;
        let _ = conn.shutdown().await;
        return;
    }
    log.lock()
        .unwrap()
        .push(format!("{method} {short} -> forwarded"));
    let Ok(mut up) = tokio::net::TcpStream::connect(upstream).await else {
        return;
    };
    let mut out = format!("{first}\r\n");
    for h in headers {
        out.push_str(&h);
        out.push_str("\r\n");
    }
    out.push_str("Connection: close\r\n\r\n");
    if up.write_all(out.as_bytes()).await.is_err()
        || up
            .write_all(&buf[head_end..head_end + length])
            .await
            .is_err()
    {
        return;
    }
    let _ = tokio::io::copy(&mut up, &mut conn).await;
    let _ = conn.shutdown().await;
}

fn refuse(method: &'static str, path: &'static str, status: u16) -> Refusal {
    Refusal {
        method,
        path,
        status,
        retry_after: None,
    }
}

/// A registry behind a proxy that refuses (429 with `Retry-After: 1`, 503,
/// 502, 504, 500) one request of each step for a while: push and pull
/// succeed, each refused request retried once (counted by the proxy and the
/// client's counter, not by the clock); one that never recovers fails
/// `unavailable` after exactly the configured attempts.
#[tokio::test]
async fn transient_refusals_are_retried_and_give_up_after_the_attempts() {
    let Some(reg) = start(RegistryKind::Plain) else {
        return;
    };
    let anon = Credentials::Anonymous;
    let tmp = tempfile::tempdir().unwrap();
    let size = 300_000u64;
    let (path, digest) = blob_file(tmp.path(), "layer", 3, size as usize);
    let proxy = FlakyProxy::start(
        reg.addr(),
        vec![
            Refusal {
                method: "HEAD",
                path: "/blobs/sha256:",
                status: 429,
                retry_after: Some(1),
            },
            refuse("HEAD", "/blobs/sha256:", 503),
            refuse("POST", "/blobs/uploads/", 503),
            refuse("PUT", "/blobs/uploads/", 502),
            refuse("PUT", "/manifests/", 503),
            refuse("GET", "/manifests/", 500),
            refuse("GET", "/blobs/sha256:", 504),
        ],
        None,
    )
    .await;
    let host = proxy.host.clone();
    let client = RegistryClient::new(RegistryOptions {
        insecure: vec![host.clone()],
        retry_attempts: 4,
        retry_base_ms: 10,
        retry_max_ms: 100,
        ..Default::default()
    })
    .unwrap();
    let r = parse_reference(&format!("{host}/team/flaky:v1")).unwrap();
    assert_eq!(
        client
            .push_blob_file(&r, &anon, &path, &digest, size)
            .await
            .unwrap(),
        BlobPush::Uploaded
    );
    let body = manifest((&digest, size), &[]);
    client
        .push_manifest(&r, &anon, OCI_MANIFEST, &body)
        .await
        .unwrap();
    assert_eq!(client.pull_manifest(&r, &anon).await.unwrap().body, body);
    let dst = tmp.path().join("pulled");
    client
        .pull_blob_to_file(&r, &anon, &digest, size, &dst)
        .await
        .unwrap();
    assert_eq!(std::fs::read(&dst).unwrap(), std::fs::read(&path).unwrap());

    // Every scripted refusal was met, and each was one retry of ours.
    assert_eq!(proxy.script_left(), 0, "{:?}", proxy.log.lock().unwrap());
    let refused = proxy.refused();
    assert_eq!(refused.len(), 7, "{refused:?}");
    assert_eq!(client.retries_total(), 7, "{refused:?}");
    // The blob arrived once: the refused PUT's session was not completed,
    // the retry's was.
    assert_eq!(
        reg.blob_uploads_completed().unwrap(),
        1,
        "{}",
        reg.log_tail(20)
    );
    let log = proxy.log.lock().unwrap().clone();
    let posts = log
        .iter()
        .filter(|l| l.starts_with("POST ") && l.contains("/blobs/uploads/"))
        .count();
    assert_eq!(posts, 3, "a new upload session per upload attempt: {log:?}");

    // Never recovers: 3 attempts, then unavailable naming the attempts.
    let down = FlakyProxy::start(reg.addr(), vec![], Some("/manifests/")).await;
    let client = RegistryClient::new(RegistryOptions {
        insecure: vec![down.host.clone()],
        retry_attempts: 3,
        retry_base_ms: 10,
        retry_max_ms: 100,
        ..Default::default()
    })
    .unwrap();
    let r = parse_reference(&format!("{}/team/flaky:v1", down.host)).unwrap();
    let e = expect_kind(
        client.pull_manifest(&r, &anon).await,
        ErrorKind::Unavailable,
    );
    assert_eq!(down.refused().len(), 3, "{:?}", down.log.lock().unwrap());
    assert!(
        matches!(e, RegistryError::GaveUp { attempts: 3, .. }),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains(&down.host) && msg.contains("3 times") && msg.contains("503"),
        "{msg}"
    );
}

/// A registry that is down when the push starts and comes up on the same
/// port while the client is retrying: the push succeeds. The registry is
/// started only after the client has retried once (its retry counter), so the
/// first attempt did fail; nothing is timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_that_comes_back_during_the_retries_gets_the_push() {
    if !require_docker_registry(RegistryKind::Plain) {
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let host = format!("127.0.0.1:{port}");
    let client = std::sync::Arc::new(
        RegistryClient::new(RegistryOptions {
            insecure: vec![host.clone()],
            // Room for docker-registry to start: 40 attempts, delays up to
            // 500 ms (at least ~9 s of waiting in all).
            retry_attempts: 40,
            retry_base_ms: 50,
            retry_max_ms: 500,
            ..Default::default()
        })
        .unwrap(),
    );
    let tmp = tempfile::tempdir().unwrap();
    let (path, digest) = blob_file(tmp.path(), "layer", 9, 100_000);
    let r = parse_reference(&format!("{host}/team/late:v1")).unwrap();
    let push = {
        let (client, r, path, digest) = (client.clone(), r.clone(), path.clone(), digest.clone());
        tokio::spawn(async move {
            client
                .push_blob_file(&r, &Credentials::Anonymous, &path, &digest, 100_000)
                .await
        })
    };
    // Wait (bounded) for the first retry: the registry was down for it.
    for _ in 0..3000 {
        if client.retries_total() >= 1 || push.is_finished() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(client.retries_total() >= 1, "the client never retried");
    let reg = tokio::task::spawn_blocking(move || {
        TestRegistry::start_on_port(RegistryKind::Plain, port).expect("start docker-registry")
    })
    .await
    .unwrap();
    assert_eq!(push.await.unwrap().unwrap(), BlobPush::Uploaded);
    assert_eq!(
        reg.blob_uploads_completed().unwrap(),
        1,
        "{}",
        reg.log_tail(20)
    );
    assert!(client
        .blob_exists(&r, &Credentials::Anonymous, &digest)
        .await
        .unwrap());
}

/// Nothing ever listens: `unavailable` after exactly the configured attempts
/// (counted by the client's retry counter: attempts - 1 retries), the message
/// naming the registry, the attempts and what to do.
#[tokio::test]
async fn a_registry_that_stays_down_is_unavailable_after_the_attempts() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let host = format!("127.0.0.1:{port}");
    let client = RegistryClient::new(RegistryOptions {
        insecure: vec![host.clone()],
        retry_attempts: 3,
        retry_base_ms: 10,
        retry_max_ms: 20,
        ..Default::default()
    })
    .unwrap();
    let r = parse_reference(&format!("{host}/a/b:c")).unwrap();
    let e = expect_kind(
        client
            .blob_exists(&r, &Credentials::Anonymous, &sha256_digest(b"x"))
            .await,
        ErrorKind::Unavailable,
    );
    assert_eq!(client.retries_total(), 2);
    assert!(
        matches!(e, RegistryError::GaveUp { attempts: 3, .. }),
        "{e:?}"
    );
    let msg = e.to_string();
    for part in [host.as_str(), "3 times", "refused", "retry_attempts"] {
        assert!(msg.contains(part), "{part}: {msg}");
    }
}

/// A registry that accepts the connection and never answers is cut off by
/// `read_timeout_ms` (here 300 ms, not the 120 s default) and the step fails
/// `unavailable` after its attempts — each attempt a new connection.
#[tokio::test]
async fn a_stalled_registry_is_cut_off_by_the_read_timeout() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let host = listener.local_addr().unwrap().to_string();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = accepted.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            held.push(conn); // read nothing, answer nothing
        }
    });
    let client = RegistryClient::new(RegistryOptions {
        insecure: vec![host.clone()],
        retry_attempts: 2,
        retry_base_ms: 10,
        retry_max_ms: 20,
        read_timeout_ms: 300,
        ..Default::default()
    })
    .unwrap();
    let r = parse_reference(&format!("{host}/a/b:c")).unwrap();
    let started = std::time::Instant::now();
    let e = expect_kind(
        client.pull_manifest(&r, &Credentials::Anonymous).await,
        ErrorKind::Unavailable,
    );
    let took = started.elapsed();
    assert!(
        took >= std::time::Duration::from_millis(600) && took < std::time::Duration::from_secs(30),
        "two attempts of 300 ms took {took:?}: {e}"
    );
    assert!(
        accepted.load(std::sync::atomic::Ordering::SeqCst) >= 2,
        "{e}"
    );
    assert!(
        matches!(e, RegistryError::GaveUp { attempts: 2, .. }),
        "{e:?}"
    );
}
