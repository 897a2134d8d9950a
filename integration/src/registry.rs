//! A private OCI registry for tests: Debian's `docker-registry` (CNCF
//! distribution 2.8, `/usr/bin/docker-registry`) started on `127.0.0.1`.
//!
//! [`TestRegistry::start`] writes a config YAML into a temp dir below
//! [`tmp_base`](crate::tmp_base) (storage `filesystem` in that dir, `http.addr`
//! `127.0.0.1:<free port>`, the access log on), starts `docker-registry serve
//! CONFIG` with its stdout and stderr in `registry.log` there, and returns once
//! `GET /v2/` answers. A free port is found by binding `127.0.0.1:0` and
//! closing it; when the registry then fails to bind it (another process took
//! the port in between) it is started again on a new port, up to 5 times.
//! Drop kills the child by its pid (SIGKILL), reaps it and removes the dir.
//!
//! Three variants ([`RegistryKind`]): plain HTTP; TLS with a throwaway CA and a
//! server certificate for `127.0.0.1` / `localhost` (`fixtures/make_tls.sh`,
//! needs `openssl`); TLS plus HTTP basic auth from an htpasswd file (bcrypt,
//! `htpasswd -B` from Debian's `apache2-utils`).
//!
//! Counting what was sent: the registry's access log (gorilla's combined log
//! format on stdout, one line per request: `… "PUT /v2/NAME/blobs/uploads/UUID?…digest=… HTTP/1.1" 201 …`)
//! is parsed by [`TestRegistry::access_log`]; [`TestRegistry::blob_uploads_completed`]
//! and [`TestRegistry::blob_gets`] count from it, so a test can say "only one
//! blob was sent" or "nothing was fetched".

use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use crate::{ensure_success, fixtures_dir, skip, tail_file, tmp_base, which};

/// The registry binary (Debian package `docker-registry`).
pub const REGISTRY_BIN: &str = "docker-registry";
/// The user name of [`RegistryKind::TlsBasicAuth`]'s one account.
pub const REGISTRY_USER: &str = "layerstack";

const START_ATTEMPTS: usize = 5;
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// True when `docker-registry` is on `$PATH` (and, for the TLS variants,
/// `openssl`; for basic auth, `htpasswd`), as `kind` needs. Otherwise, with
/// `CI=true` it panics with the reason (CI must never skip silently), else it
/// prints `SKIPPED: …` to stderr and returns false.
pub fn require_docker_registry(kind: RegistryKind) -> bool {
    let mut needed = vec![(REGISTRY_BIN, "docker-registry")];
    if kind != RegistryKind::Plain {
        needed.push(("openssl", "openssl"));
    }
    if kind == RegistryKind::TlsBasicAuth {
        needed.push(("htpasswd", "apache2-utils"));
    }
    let missing: Vec<String> = needed
        .iter()
        .filter(|(bin, _)| which(bin).is_none())
        .map(|(bin, pkg)| format!("`{bin}` on PATH (Debian package {pkg})"))
        .collect();
    if missing.is_empty() {
        return true;
    }
    skip(&format!(
        "registry tests need {}; run scripts/install-deps.sh as root",
        missing.join(", ")
    ))
}

/// Writes an executable `dir/docker-credential-NAME` that speaks the
/// docker-credential-helpers protocol for `get` only: for `server` on stdin
/// it prints `{"ServerURL","Username":user,"Secret":secret}`; for anything
/// else "credentials not found in native keychain" and exit 1. Test data: the
/// secret is in the script.
pub fn write_credential_helper(
    dir: &Path,
    name: &str,
    server: &str,
    user: &str,
    secret: &str,
) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let script = format!(
        "#!/bin/sh\n[ \"$1\" = get ] || exit 2\nread -r s\nif [ \"$s\" = '{server}' ]; then\n  printf '{{\"ServerURL\":\"%s\",\"Username\":\"{user}\",\"Secret\":\"{secret}\"}}\\n' \"$s\"\nelse\n  echo 'credentials not found in native keychain'; exit 1\nfi\n"
    );
    let p = dir.join(format!("docker-credential-{name}"));
    fs::write(&p, script).with_context(|| format!("write {}", p.display()))?;
    fs::set_permissions(&p, fs::Permissions::from_mode(0o755))?;
    Ok(p)
}

/// How the test registry serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegistryKind {
    /// Plain HTTP, anonymous (a client must name it insecure).
    Plain,
    /// HTTPS with a certificate from a throwaway CA ([`TestRegistry::ca_pem`]),
    /// anonymous.
    Tls,
    /// HTTPS as [`RegistryKind::Tls`], and HTTP basic auth: one account,
    /// [`REGISTRY_USER`] with [`TestRegistry::password`]; anything else is 401.
    TlsBasicAuth,
}

/// One line of the registry's access log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessEntry {
    /// The HTTP method (`GET`, `HEAD`, `PUT`, …).
    pub method: String,
    /// The request target: path and query as sent (`/v2/NAME/blobs/sha256:…`).
    pub target: String,
    /// The response status (`201`, `404`, …).
    pub status: u16,
}

impl AccessEntry {
    /// The target's path, without the query.
    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("")
    }

    /// True for the request that completes a blob upload (`PUT
    /// /v2/NAME/blobs/uploads/UUID?digest=…` answered 201 Created, after a
    /// chunked or a monolithic upload alike).
    pub fn is_blob_upload_completed(&self) -> bool {
        self.method == "PUT"
            && self.status == 201
            && self.path().starts_with("/v2/")
            && self.path().contains("/blobs/uploads/")
    }

    /// True for a `GET /v2/NAME/blobs/DIGEST`, whatever it was answered.
    pub fn is_blob_get(&self) -> bool {
        self.method == "GET"
            && self.path().starts_with("/v2/")
            && self.path().contains("/blobs/")
            && !self.path().contains("/blobs/uploads/")
    }
}

/// A running private registry; killed (by pid) and removed on drop.
pub struct TestRegistry {
    child: Child,
    kind: RegistryKind,
    addr: SocketAddr,
    dir: tempfile::TempDir,
    password: Option<String>,
}

impl TestRegistry {
    /// Starts a registry of `kind` (see the module docs). Errors name what
    /// failed, with the tail of the registry's log.
    pub fn start(kind: RegistryKind) -> Result<Self> {
        Self::start_inner(kind, None)
    }

    /// [`TestRegistry::start`] on `127.0.0.1:port` exactly (a test that
    /// brings a registry up where a client is already trying to reach one);
    /// no retry on another port when `port` is taken.
    pub fn start_on_port(kind: RegistryKind, port: u16) -> Result<Self> {
        Self::start_inner(kind, Some(port))
    }

    fn start_inner(kind: RegistryKind, fixed_port: Option<u16>) -> Result<Self> {
        let base = tmp_base();
        fs::create_dir_all(&base).with_context(|| format!("create {}", base.display()))?;
        let dir = tempfile::Builder::new()
            .prefix("lst-registry-")
            .tempdir_in(&base)
            .with_context(|| format!("temp dir below {}", base.display()))?;
        let root = dir.path().to_path_buf();
        fs::create_dir_all(root.join("data"))?;

        let mut tls = None;
        if kind != RegistryKind::Plain {
            let tls_dir = root.join("tls");
            let out = Command::new("bash")
                .arg(fixtures_dir().join("make_tls.sh"))
                .arg(&tls_dir)
                .stdin(Stdio::null())
                .output()
                .context("run make_tls.sh")?;
            ensure_success("make_tls.sh", out)?;
            tls = Some(tls_dir);
        }
        let mut password = None;
        if kind == RegistryKind::TlsBasicAuth {
            let pw = format!("pw-{:016x}", random_u64());
            let out = Command::new("htpasswd")
                .args(["-B", "-b", "-n", REGISTRY_USER, &pw])
                .stdin(Stdio::null())
                .output()
                .context("run htpasswd (Debian apache2-utils)")?;
            let out = ensure_success("htpasswd -B", out)?;
            fs::write(root.join("htpasswd"), &out.stdout)?;
            password = Some(pw);
        }

        let log = root.join("registry.log");
        let config = root.join("config.yml");
        let mut last_err = anyhow!("not started");
        for _ in 0..START_ATTEMPTS {
            let port = match fixed_port {
                Some(p) => p,
                None => free_port()?,
            };
            let addr: SocketAddr = ([127, 0, 0, 1], port).into();
            fs::write(
                &config,
                config_yaml(&root, addr, tls.as_deref(), password.is_some()),
            )?;
            let mut child = spawn_registry(&config, &log)?;
            match wait_ready(&mut child, addr) {
                Ok(()) => {
                    return Ok(TestRegistry {
                        child,
                        kind,
                        addr,
                        dir,
                        password,
                    })
                }
                Err(e) => {
                    // By pid: Child::kill sends SIGKILL to this child only.
                    let _ = child.kill();
                    let _ = child.wait();
                    last_err = e;
                    if fixed_port.is_some()
                        || !tail_file(&log, 40).contains("address already in use")
                    {
                        break;
                    }
                }
            }
        }
        Err(last_err.context(format!(
            "start docker-registry; its log ({}):\n{}",
            log.display(),
            tail_file(&log, 40)
        )))
    }

    fn stop(&mut self) {
        // By pid: Child::kill sends SIGKILL to this child only.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The variant this registry runs as.
    pub fn kind(&self) -> RegistryKind {
        self.kind
    }

    /// `127.0.0.1:PORT`: the registry part of a reference, and the name to
    /// pass as insecure for [`RegistryKind::Plain`].
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The CA certificate (PEM) that signed the server's certificate; `None`
    /// for [`RegistryKind::Plain`].
    pub fn ca_pem(&self) -> Option<PathBuf> {
        (self.kind != RegistryKind::Plain).then(|| self.dir.path().join("tls/ca.pem"))
    }

    /// [`REGISTRY_USER`]'s password for [`RegistryKind::TlsBasicAuth`] (random
    /// per registry); `None` otherwise.
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// The temp dir holding the config, the data, the certificates and the log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The registry's log (its stdout and stderr: access log and app log).
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("registry.log")
    }

    /// The last `n` lines of the log, for failure messages.
    pub fn log_tail(&self, n: usize) -> String {
        tail_file(&self.log_path(), n)
    }

    /// Every access-log line so far, in order (lines that are not access-log
    /// lines are skipped).
    pub fn access_log(&self) -> Result<Vec<AccessEntry>> {
        let path = self.log_path();
        let bytes = fs::read(&path).with_context(|| format!("read {}", path.display()))?;
        Ok(String::from_utf8_lossy(&bytes)
            .lines()
            .filter_map(parse_access_line)
            .collect())
    }

    /// How many blob uploads completed so far
    /// ([`AccessEntry::is_blob_upload_completed`]).
    pub fn blob_uploads_completed(&self) -> Result<usize> {
        Ok(self
            .access_log()?
            .iter()
            .filter(|e| e.is_blob_upload_completed())
            .count())
    }

    /// How many blob GETs happened so far ([`AccessEntry::is_blob_get`]).
    pub fn blob_gets(&self) -> Result<usize> {
        Ok(self
            .access_log()?
            .iter()
            .filter(|e| e.is_blob_get())
            .count())
    }
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `docker-registry serve CONFIG`, stdout and stderr to `log`.
fn spawn_registry(config: &Path, log: &Path) -> Result<Child> {
    let log_file = fs::File::create(log).with_context(|| format!("create {}", log.display()))?;
    let mut cmd = Command::new(REGISTRY_BIN);
    cmd.arg("serve")
        .arg(config)
        .stdin(Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file);
    // distribution overrides its config from REGISTRY_* variables.
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("REGISTRY_") {
            cmd.env_remove(k);
        }
    }
    cmd.spawn()
        .with_context(|| format!("start {REGISTRY_BIN} (Debian package docker-registry)"))
}

/// Waits until the registry at `addr` answers `GET /v2/`.
fn wait_ready(child: &mut Child, addr: SocketAddr) -> Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("docker-registry exited with {status} before answering GET /v2/");
        }
        // Plain HTTP answers 200 (401 with auth); a TLS port answers a plain
        // request with Go's "400 Client sent an HTTP request to an HTTPS
        // server": the server is serving either way.
        if let Ok(200 | 400 | 401) = probe_v2(addr) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("docker-registry on {addr} did not answer GET /v2/ within {READY_TIMEOUT:?}");
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// Parses one combined-log-format line:
/// `HOST - USER [TIME] "METHOD TARGET PROTO" STATUS SIZE "REFERER" "UA"`.
fn parse_access_line(line: &str) -> Option<AccessEntry> {
    let start = line.find("] \"")? + 3;
    let rest = &line[start..];
    let end = rest.find('"')?;
    let mut req = rest[..end].split(' ');
    let method = req.next()?.to_string();
    let target = req.next()?.to_string();
    if !req.next()?.starts_with("HTTP/") {
        return None;
    }
    let status = rest[end + 1..].split_whitespace().next()?.parse().ok()?;
    Some(AccessEntry {
        method,
        target,
        status,
    })
}

fn config_yaml(root: &Path, addr: SocketAddr, tls: Option<&Path>, auth: bool) -> String {
    let mut y = format!(
        "version: 0.1\n\
         log:\n  level: info\n  accesslog:\n    disabled: false\n\
         storage:\n  filesystem:\n    rootdirectory: {data}\n  delete:\n    enabled: true\n\
         \x20 maintenance:\n    uploadpurging:\n      enabled: false\n\
         http:\n  addr: {addr}\n  secret: layerstack-test-{secret:016x}\n",
        data = root.join("data").display(),
        secret = random_u64(),
    );
    if let Some(tls) = tls {
        y.push_str(&format!(
            "  tls:\n    certificate: {}\n    key: {}\n",
            tls.join("server.pem").display(),
            tls.join("server.key").display()
        ));
    }
    if auth {
        y.push_str(&format!(
            "auth:\n  htpasswd:\n    realm: layerstack-test\n    path: {}\n",
            root.join("htpasswd").display()
        ));
    }
    y
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("bind 127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Sends `GET /v2/ HTTP/1.0` in plain text; the status code of the answer.
fn probe_v2(addr: SocketAddr) -> Result<u16> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(b"GET /v2/ HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut buf = Vec::new();
    s.take(4096).read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    let status = text
        .split_whitespace()
        .nth(1)
        .ok_or_else(|| anyhow!("no HTTP answer"))?;
    Ok(status.parse()?)
}

fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_combined_log_lines() {
        let put = r#"127.0.0.1 - - [04/Dec/2026:12:00:00 +0000] "PUT /v2/a/b/blobs/uploads/0d1e?_state=x&digest=sha256%3Aab HTTP/1.1" 201 0 "" "layerstack""#;
        let e = parse_access_line(put).expect("parsed");
        assert_eq!(e.method, "PUT");
        assert_eq!(e.status, 201);
        assert_eq!(e.path(), "/v2/a/b/blobs/uploads/0d1e");
        assert!(e.is_blob_upload_completed());
        assert!(!e.is_blob_get());
        let get = r#"127.0.0.1 - - [04/Dec/2026:12:00:00 +0000] "GET /v2/a/blobs/sha256:ab HTTP/1.1" 200 3 "" "x""#;
        let e = parse_access_line(get).expect("parsed");
        assert!(e.is_blob_get());
        assert!(!e.is_blob_upload_completed());
        let app = r#"time="2026-12-04T12:00:00Z" level=info msg="listening on 127.0.0.1:5000""#;
        assert_eq!(parse_access_line(app), None);
    }
}
