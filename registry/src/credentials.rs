//! Registry credentials as the docker CLI keeps them: `config.json`
//! (`$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`).
//!
//! Parsed here rather than with the `docker_credential` crate: that crate
//! reports neither `registrytoken` nor which entry matched, and the rules are
//! short. For registry `R` (`host[:port]`), in this order (docker CLI's
//! `cli/config/configfile`, `credentials/native_store.go`):
//!
//! 1. `credHelpers[R]` = `NAME`: run `docker-credential-NAME get` with the
//!    server on stdin; its JSON `{"ServerURL","Username","Secret"}` answer
//!    gives the credentials. "credentials not found" (exit ≠ 0) → anonymous.
//! 2. `auths[K]` where `K` names `R` (`K` may carry a scheme and a path:
//!    `https://R/v1/`): `auth` (base64 `user:password`), else
//!    `username`/`password`, else `registrytoken` (sent as a bearer token),
//!    else `identitytoken` (see [`Credentials`]).
//! 3. `credsStore` = `NAME`: the helper as in 1.
//! 4. Anonymous.
//!
//! Docker Hub's names (`docker.io`, `index.docker.io`,
//! `registry-1.docker.io`) are one registry, keyed `https://index.docker.io/v1/`.

use std::collections::BTreeMap;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use base64::Engine;
use serde::Deserialize;

use crate::RegistryError;

/// Credentials for one registry. `Debug` never prints a secret.
///
/// An `identitytoken` (an OAuth2 refresh token that `docker login` stores for
/// some registries) is reported as `Basic { username: "<token>" or the entry's
/// username, password: token }`, the way credential helpers report it:
/// registries whose token service takes it as basic auth (Azure ACR) work;
/// registries that need the OAuth2 refresh-token grant do not (oci-client
/// 0.18 does not implement that grant).
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub enum Credentials {
    /// No credentials.
    #[default]
    Anonymous,
    /// HTTP basic auth, or basic auth to the registry's token service.
    Basic {
        /// The user name.
        username: String,
        /// The password (secret).
        password: String,
    },
    /// A bearer token sent as is (secret).
    Bearer(String),
}

impl Credentials {
    /// True for [`Credentials::Anonymous`].
    #[must_use]
    pub fn is_anonymous(&self) -> bool {
        matches!(self, Self::Anonymous)
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Anonymous => f.write_str("Anonymous"),
            Self::Basic { username, .. } => f
                .debug_struct("Basic")
                .field("username", username)
                .field("password", &"<redacted>")
                .finish(),
            Self::Bearer(_) => f.debug_tuple("Bearer").field(&"<redacted>").finish(),
        }
    }
}

/// `$DOCKER_CONFIG/config.json` when `$DOCKER_CONFIG` is set, else
/// `$HOME/.docker/config.json`; `None` when neither variable is set. The file
/// need not exist.
#[must_use]
pub fn docker_config_path() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("DOCKER_CONFIG").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(dir).join("config.json"));
    }
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|h| PathBuf::from(h).join(".docker/config.json"))
}

#[derive(Deserialize, Default)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, AuthEntry>,
    #[serde(default, rename = "credHelpers")]
    cred_helpers: BTreeMap<String, String>,
    #[serde(default, rename = "credsStore")]
    creds_store: Option<String>,
}

#[derive(Deserialize, Default)]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    identitytoken: Option<String>,
    #[serde(default)]
    registrytoken: Option<String>,
}

#[derive(Deserialize)]
struct HelperAnswer {
    #[serde(rename = "Username", default)]
    username: String,
    #[serde(rename = "Secret", default)]
    secret: String,
}

const DOCKER_HUB_KEY: &str = "https://index.docker.io/v1/";
const TOKEN_USERNAME: &str = "<token>";

/// `registry` as config.json keys name it: Docker Hub's aliases become
/// `index.docker.io`; anything else is kept (`host[:port]`, lowercased).
fn canonical_host(registry: &str) -> String {
    let host = registry.to_ascii_lowercase();
    match host.as_str() {
        "docker.io" | "index.docker.io" | "registry-1.docker.io" => "index.docker.io".into(),
        _ => host,
    }
}

/// The `host[:port]` an `auths` key names: scheme and path stripped.
fn key_host(key: &str) -> String {
    let k = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    canonical_host(k.split('/').next().unwrap_or(k))
}

/// What a helper is asked for: Docker Hub's legacy URL, else `host[:port]`.
fn helper_server(registry: &str) -> String {
    if canonical_host(registry) == "index.docker.io" {
        DOCKER_HUB_KEY.into()
    } else {
        registry.to_string()
    }
}

/// The credentials `config.json` at `path` holds for `registry`
/// (`host[:port]`, e.g. `127.0.0.1:5000` or `docker.io`), found as the module
/// docs say. `Anonymous` when the file does not exist or has no entry.
///
/// Errors: `invalid_argument` ([`RegistryError::DockerConfig`]) when the file
/// is not JSON of that shape or an `auth` is not base64 `user:password`;
/// `failed_precondition` ([`RegistryError::CredentialHelper`]) when a named
/// helper is not installed; `unavailable` when it cannot be run or fails
/// other than with "credentials not found"; `internal` when
/// the file cannot be read.
pub fn credentials_from_docker_config(
    path: &Path,
    registry: &str,
) -> Result<Credentials, RegistryError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Credentials::Anonymous),
        Err(e) => return Err(RegistryError::io("read", path, e)),
    };
    let config: DockerConfig =
        serde_json::from_slice(&bytes).map_err(|e| RegistryError::DockerConfig {
            path: path.to_path_buf(),
            detail: format!("not a docker config.json: {e}"),
        })?;
    let host = canonical_host(registry);

    if let Some((_, helper)) = config
        .cred_helpers
        .iter()
        .find(|(k, _)| key_host(k) == host)
    {
        return run_helper(helper, registry, path);
    }
    // An exact key wins over one that only names the same host.
    let entry = config
        .auths
        .iter()
        .filter(|(k, _)| key_host(k) == host)
        .min_by_key(|(k, _)| usize::from(k.as_str() != registry))
        .map(|(_, e)| e);
    if let Some(entry) = entry {
        if let Some(creds) = entry_credentials(entry, path, registry)? {
            return Ok(creds);
        }
    }
    if let Some(store) = config.creds_store.as_deref().filter(|s| !s.is_empty()) {
        return run_helper(store, registry, path);
    }
    Ok(Credentials::Anonymous)
}

fn entry_credentials(
    e: &AuthEntry,
    path: &Path,
    registry: &str,
) -> Result<Option<Credentials>, RegistryError> {
    let bad = |detail: String| RegistryError::DockerConfig {
        path: path.to_path_buf(),
        detail: format!("auths entry for {registry}: {detail}"),
    };
    if let Some(auth) = e.auth.as_deref().filter(|a| !a.is_empty()) {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .map_err(|err| bad(format!("`auth` is not base64 ({err})")))?;
        let text = String::from_utf8(decoded)
            .map_err(|_| bad("`auth` does not decode to UTF-8 text".into()))?;
        let (user, pass) = text
            .split_once(':')
            .ok_or_else(|| bad("`auth` does not decode to user:password".into()))?;
        return Ok(Some(Credentials::Basic {
            username: user.to_string(),
            password: pass.to_string(),
        }));
    }
    let username = e.username.clone().filter(|u| !u.is_empty());
    if let (Some(u), Some(p)) = (&username, e.password.as_deref().filter(|p| !p.is_empty())) {
        return Ok(Some(Credentials::Basic {
            username: u.clone(),
            password: p.to_string(),
        }));
    }
    if let Some(t) = e.registrytoken.as_deref().filter(|t| !t.is_empty()) {
        return Ok(Some(Credentials::Bearer(t.to_string())));
    }
    if let Some(t) = e.identitytoken.as_deref().filter(|t| !t.is_empty()) {
        return Ok(Some(Credentials::Basic {
            username: username.unwrap_or_else(|| TOKEN_USERNAME.into()),
            password: t.to_string(),
        }));
    }
    Ok(None)
}

/// Runs `docker-credential-NAME get` (docker-credential-helpers protocol).
fn run_helper(name: &str, registry: &str, config: &Path) -> Result<Credentials, RegistryError> {
    let err_of = |installed: bool, detail: String| RegistryError::CredentialHelper {
        helper: name.to_string(),
        installed,
        registry: registry.to_string(),
        config: config.to_path_buf(),
        detail,
    };
    let err = |detail: String| err_of(true, detail);
    let bin = format!("docker-credential-{name}");
    let mut child = Command::new(&bin)
        .arg("get")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            err_of(
                e.kind() != std::io::ErrorKind::NotFound,
                format!("cannot run {bin} ({e}); install it on PATH or remove it from the config"),
            )
        })?;
    let server = helper_server(registry);
    if let Some(mut stdin) = child.stdin.take() {
        // A helper that exits without reading gives EPIPE: its answer tells.
        let _ = stdin.write_all(server.as_bytes());
    }
    let out = child
        .wait_with_output()
        .map_err(|e| err(format!("waiting for {bin}: {e}")))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let msg = format!(
            "{} {}",
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        if msg.to_ascii_lowercase().contains("credentials not found") {
            return Ok(Credentials::Anonymous);
        }
        return Err(err(format!(
            "`{bin} get` for {server} failed ({}): {}; check the helper (try `echo {server} | {bin} get`)",
            out.status,
            msg.trim()
        )));
    }
    let answer: HelperAnswer = serde_json::from_str(stdout.trim()).map_err(|e| {
        err(format!(
            "`{bin} get` answered something that is not {{\"Username\",\"Secret\"}} JSON ({e})"
        ))
    })?;
    if answer.secret.is_empty() {
        return Ok(Credentials::Anonymous);
    }
    Ok(Credentials::Basic {
        username: answer.username,
        password: answer.secret,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn config(dir: &Path, json: &str) -> PathBuf {
        let p = dir.join("config.json");
        std::fs::write(&p, json).unwrap();
        p
    }

    fn basic(u: &str, p: &str) -> Credentials {
        Credentials::Basic {
            username: u.into(),
            password: p.into(),
        }
    }

    #[test]
    fn absent_file_or_entry_is_anonymous() {
        let d = tempfile::tempdir().unwrap();
        let missing = d.path().join("nope.json");
        assert_eq!(
            credentials_from_docker_config(&missing, "r.example:5000").unwrap(),
            Credentials::Anonymous
        );
        let p = config(d.path(), r#"{"auths":{"other.example":{"auth":"dTpw"}}}"#);
        assert_eq!(
            credentials_from_docker_config(&p, "r.example:5000").unwrap(),
            Credentials::Anonymous
        );
        let p = config(d.path(), "{}");
        assert_eq!(
            credentials_from_docker_config(&p, "r.example").unwrap(),
            Credentials::Anonymous
        );
    }

    #[test]
    fn auth_field_and_key_forms() {
        let d = tempfile::tempdir().unwrap();
        // "alice:s3cr:et" — the password may contain ':'.
        let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cr:et");
        let p = config(
            d.path(),
            &format!(r#"{{"auths":{{"https://r.example:5000/v1/":{{"auth":"{auth}"}}}}}}"#),
        );
        assert_eq!(
            credentials_from_docker_config(&p, "r.example:5000").unwrap(),
            basic("alice", "s3cr:et")
        );
        // Another port is another registry.
        assert_eq!(
            credentials_from_docker_config(&p, "r.example:5001").unwrap(),
            Credentials::Anonymous
        );
    }

    #[test]
    fn username_password_tokens_and_docker_hub() {
        let d = tempfile::tempdir().unwrap();
        let p = config(
            d.path(),
            r#"{"auths":{
                "a.example":{"username":"u","password":"p"},
                "b.example":{"registrytoken":"rt"},
                "c.example":{"identitytoken":"it"},
                "https://index.docker.io/v1/":{"auth":"aHViOmh1YnB3"}
            }}"#,
        );
        assert_eq!(
            credentials_from_docker_config(&p, "a.example").unwrap(),
            basic("u", "p")
        );
        assert_eq!(
            credentials_from_docker_config(&p, "b.example").unwrap(),
            Credentials::Bearer("rt".into())
        );
        assert_eq!(
            credentials_from_docker_config(&p, "c.example").unwrap(),
            basic("<token>", "it")
        );
        for hub in ["docker.io", "index.docker.io", "registry-1.docker.io"] {
            assert_eq!(
                credentials_from_docker_config(&p, hub).unwrap(),
                basic("hub", "hubpw"),
                "{hub}"
            );
        }
    }

    #[test]
    fn malformed_config_is_invalid_argument_naming_the_file() {
        let d = tempfile::tempdir().unwrap();
        let p = config(d.path(), "{not json");
        let e = credentials_from_docker_config(&p, "r.example").unwrap_err();
        assert_eq!(e.kind(), layerstack_types::ErrorKind::InvalidArgument);
        assert!(e.to_string().contains(&p.display().to_string()), "{e}");
        let p = config(d.path(), r#"{"auths":{"r.example":{"auth":"!!!"}}}"#);
        let e = credentials_from_docker_config(&p, "r.example").unwrap_err();
        assert!(e.to_string().contains("not base64"), "{e}");
        let no_colon = base64::engine::general_purpose::STANDARD.encode("justuser");
        let p = config(
            d.path(),
            &format!(r#"{{"auths":{{"r.example":{{"auth":"{no_colon}"}}}}}}"#),
        );
        let e = credentials_from_docker_config(&p, "r.example").unwrap_err();
        assert!(e.to_string().contains("user:password"), "{e}");
    }

    fn helper(dir: &Path, name: &str, server: &str, user: &str, secret: &str) {
        layerstack_integration::registry::write_credential_helper(dir, name, server, user, secret)
            .unwrap();
    }

    #[test]
    fn cred_helpers_and_creds_store() {
        let d = tempfile::tempdir().unwrap();
        helper(d.path(), "lstunit", "r.example:5000", "hu", "hs");
        helper(
            d.path(),
            "lststore",
            "https://index.docker.io/v1/",
            "su",
            "ss",
        );
        let path = std::env::var_os("PATH").unwrap_or_default();
        let mut dirs = vec![d.path().to_path_buf()];
        dirs.extend(std::env::split_paths(&path));
        // PATH is process-wide: the helpers have names no other test uses,
        // so another test seeing the longer PATH is harmless.
        std::env::set_var("PATH", std::env::join_paths(dirs).unwrap());
        let p = config(
            d.path(),
            r#"{"auths":{"r.example:5000":{"auth":"dTpw"}},
                "credHelpers":{"r.example:5000":"lstunit","q.example":"lstunit","x.example":"lstmissing"},
                "credsStore":"lststore"}"#,
        );
        // credHelpers wins over auths.
        assert_eq!(
            credentials_from_docker_config(&p, "r.example:5000").unwrap(),
            basic("hu", "hs")
        );
        // The helper says "not found": anonymous.
        assert_eq!(
            credentials_from_docker_config(&p, "q.example").unwrap(),
            Credentials::Anonymous
        );
        // credsStore for the rest; Docker Hub asked by its legacy URL.
        assert_eq!(
            credentials_from_docker_config(&p, "docker.io").unwrap(),
            basic("su", "ss")
        );
        let e = credentials_from_docker_config(&p, "x.example").unwrap_err();
        assert_eq!(e.kind(), layerstack_types::ErrorKind::FailedPrecondition);
        assert!(
            e.to_string().contains("docker-credential-lstmissing"),
            "{e}"
        );
    }

    #[test]
    fn debug_redacts_secrets() {
        let s = format!(
            "{:?} {:?}",
            basic("alice", "hunter2"),
            Credentials::Bearer("tok".into())
        );
        assert!(s.contains("alice"), "{s}");
        assert!(!s.contains("hunter2") && !s.contains("tok\""), "{s}");
    }

    #[test]
    fn config_path_from_env() {
        // Only reads the variables; DOCKER_CONFIG wins over HOME.
        let p = docker_config_path();
        if let Some(dir) = std::env::var_os("DOCKER_CONFIG").filter(|d| !d.is_empty()) {
            assert_eq!(p, Some(PathBuf::from(dir).join("config.json")));
        } else if let Some(home) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
            assert_eq!(p, Some(PathBuf::from(home).join(".docker/config.json")));
        }
    }
}
