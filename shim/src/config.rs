//! Where the shim's settings come from, most specific first:
//!
//! 1. **Runtime options** of type `runtimeoptions.v1.Options` — what
//!    `ctr run --runtime-config-path FILE` sends, and what containerd's CRI sends
//!    for `[…runtimes.layerstack.options] ConfigPath = "FILE"` (or `ConfigBody`):
//!    a TOML file with the keys of [`FileConfig`]. These options are consumed by the
//!    proxy and never forwarded to `containerd-shim-runc-v2` (it would reject a
//!    type other than runc's).
//! 2. **containerd's environment** (shims inherit it): `LAYERSTACK_ADMIN_ADDRESS`,
//!    `LAYERSTACK_INNER_SHIM`.
//! 3. **Defaults**: admin socket `/run/layerstack/admin.sock`
//!    ([`layerstack_api::DEFAULT_ADMIN_ADDRESS`]), inner shim
//!    `containerd-shim-runc-v2` from `$PATH`, else `/usr/bin/containerd-shim-runc-v2`.
//!
//! The `start` action resolves them once and records the result in the bundle
//! (see [`crate::state`]), so the server and `delete` use the same values.

use std::path::{Path, PathBuf};
use std::time::Duration;

use containerd_shim_protos::protobuf::well_known_types::any::Any;
use containerd_shim_protos::protobuf::Message as _;
use containerd_shim_protos::shim::oci::Options as RuncOptions;
use serde::Deserialize;

/// Env var naming the daemon's admin socket.
pub const ADMIN_ENV: &str = "LAYERSTACK_ADMIN_ADDRESS";
/// Env var naming the inner shim binary.
pub const INNER_SHIM_ENV: &str = "LAYERSTACK_INNER_SHIM";
/// Type URL of containerd's generic runtime options (`runtimeoptions.v1.Options`).
pub const RUNTIME_OPTIONS_TYPE: &str = "runtimeoptions.v1.Options";
/// Type URL of runc's options (`containerd.runc.v1.Options`).
pub const RUNC_OPTIONS_TYPE: &str = "containerd.runc.v1.Options";
/// Name of the inner shim binary.
pub const INNER_SHIM_NAME: &str = "containerd-shim-runc-v2";
/// Default publish timeout: how long task delete waits for an outcome.
pub const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(300);

/// Keys of the shim's TOML config (runtime options `ConfigPath`/`ConfigBody`).
/// Every key is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// The daemon's admin socket.
    pub admin_address: Option<PathBuf>,
    /// The inner shim binary (default `containerd-shim-runc-v2`).
    pub inner_shim: Option<PathBuf>,
    /// runc's state root, passed to the inner shim as runc option `root` when the
    /// container's runtime options carry no runc options of their own.
    pub runc_root: Option<String>,
    /// Seconds task delete waits for the publish outcome (default 300).
    pub publish_timeout_s: Option<u64>,
}

/// The resolved settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShimConfig {
    pub admin_address: PathBuf,
    pub inner_shim: PathBuf,
    pub runc_root: Option<String>,
    pub publish_timeout: Duration,
}

/// Runtime options, decoded from the `Any` containerd sends (stdin of `start`,
/// `CreateTaskRequest.options`).
#[derive(Debug, Clone, PartialEq)]
pub enum RuntimeOptions {
    /// None sent.
    None,
    /// runc's own options: forwarded unchanged.
    Runc(Any),
    /// `runtimeoptions.v1.Options`: ours (a config file path or inline TOML).
    Config { path: String, body: String },
    /// Anything else: dropped (with a warning), runc-v2 could not use it.
    Other(String),
}

/// Errors reading the shim config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("runtime options are not a protobuf Any")]
    Any(#[source] containerd_shim_protos::protobuf::Error),
    #[error("runtime options of type {RUNTIME_OPTIONS_TYPE} do not decode")]
    RuntimeOptions(#[source] prost::DecodeError),
    #[error("cannot read shim config file {0}")]
    Read(PathBuf, #[source] std::io::Error),
    #[error("invalid shim config{}", .0.as_ref().map(|p| format!(" in {}", p.display())).unwrap_or_default())]
    Parse(Option<PathBuf>, #[source] toml::de::Error),
}

/// containerd's `runtimeoptions.v1.Options` (`pkg/runtimeoptions/v1/api.proto`).
#[derive(Clone, PartialEq, prost::Message)]
struct RuntimeOptionsProto {
    #[prost(string, tag = "1")]
    type_url: String,
    #[prost(string, tag = "2")]
    config_path: String,
    #[prost(string, tag = "3")]
    config_body: String,
}

impl RuntimeOptions {
    /// Decode a serialized `Any` (the stdin of `start`); empty input is `None`.
    pub fn from_any_bytes(bytes: &[u8]) -> Result<Self, ConfigError> {
        if bytes.is_empty() {
            return Ok(Self::None);
        }
        Self::from_any(Any::parse_from_bytes(bytes).map_err(ConfigError::Any)?)
    }

    /// Decode an `Any`.
    pub fn from_any(any: Any) -> Result<Self, ConfigError> {
        let name = any
            .type_url
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_string();
        if any.type_url.is_empty() {
            return Ok(Self::None);
        }
        match name.as_str() {
            RUNC_OPTIONS_TYPE => Ok(Self::Runc(any)),
            RUNTIME_OPTIONS_TYPE => {
                let o = <RuntimeOptionsProto as prost::Message>::decode(any.value.as_slice())
                    .map_err(ConfigError::RuntimeOptions)?;
                Ok(Self::Config {
                    path: o.config_path,
                    body: o.config_body,
                })
            }
            _ => Ok(Self::Other(any.type_url)),
        }
    }

    /// The shim config these options carry (`Config` only).
    pub fn file_config(&self) -> Result<Option<FileConfig>, ConfigError> {
        match self {
            Self::Config { body, .. } if !body.trim().is_empty() => {
                parse_toml(body, None).map(Some)
            }
            Self::Config { path, .. } if !path.is_empty() => {
                let p = PathBuf::from(path);
                let text =
                    std::fs::read_to_string(&p).map_err(|e| ConfigError::Read(p.clone(), e))?;
                parse_toml(&text, Some(p)).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The options to hand to `containerd-shim-runc-v2`: runc's own options
    /// unchanged; otherwise runc options with `root = runc_root` if one is
    /// configured; otherwise none.
    pub fn for_inner(&self, runc_root: Option<&str>) -> Option<Any> {
        self.for_inner_with(runc_root, false)
    }

    /// [`RuntimeOptions::for_inner`], also setting runc's `systemd_cgroup` when the
    /// container came without runc options and `systemd_cgroup` is true (see
    /// [`is_systemd_cgroups_path`]).
    pub fn for_inner_with(&self, runc_root: Option<&str>, systemd_cgroup: bool) -> Option<Any> {
        match self {
            Self::Runc(any) => Some(any.clone()),
            _ => default_runc_options(runc_root, systemd_cgroup),
        }
    }
}

/// Whether an OCI `linux.cgroupsPath` is in systemd's `slice:prefix:name` form.
///
/// nerdctl with its default `systemd` cgroup manager writes that form but sends
/// runc options (`SystemdCgroup`) only to `io.containerd.runc.*` runtimes
/// (nerdctl `generateRuntimeCOpts`), so for this runtime the proxy adds
/// `systemd_cgroup = true` itself when no runc options came along; runc with the
/// cgroupfs driver would take the string as a literal path.
pub fn is_systemd_cgroups_path(p: &str) -> bool {
    let parts: Vec<&str> = p.split(':').collect();
    parts.len() == 3 && !p.starts_with('/') && !parts[0].is_empty() && !parts[2].is_empty()
}

/// `linux.cgroupsPath` of the bundle's `config.json`, if any.
pub fn bundle_cgroups_path(bundle: &Path) -> Option<String> {
    let data = std::fs::read(bundle.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&data).ok()?;
    v.get("linux")?
        .get("cgroupsPath")?
        .as_str()
        .map(str::to_string)
}

/// runc options for a container that came without any: `systemd_cgroup` for a
/// systemd-form cgroups path, `root` from the config; `None` when neither applies.
pub fn default_runc_options(runc_root: Option<&str>, systemd_cgroup: bool) -> Option<Any> {
    let root = runc_root.filter(|r| !r.is_empty());
    if root.is_none() && !systemd_cgroup {
        return None;
    }
    let mut o = RuncOptions::new();
    o.root = root.unwrap_or_default().to_string();
    o.systemd_cgroup = systemd_cgroup;
    Some(Any {
        type_url: RUNC_OPTIONS_TYPE.to_string(),
        value: o.write_to_bytes().ok()?,
        ..Default::default()
    })
}

fn parse_toml(text: &str, path: Option<PathBuf>) -> Result<FileConfig, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::Parse(path, e))
}

/// Resolve the settings from the runtime options' config (if any) and the
/// environment (`env(name)`), falling back to the defaults.
pub fn resolve(file: Option<FileConfig>, env: impl Fn(&str) -> Option<String>) -> ShimConfig {
    let file = file.unwrap_or_default();
    let nonempty = |v: Option<String>| v.filter(|s| !s.is_empty());
    let admin_address = file
        .admin_address
        .or_else(|| nonempty(env(ADMIN_ENV)).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(layerstack_api::DEFAULT_ADMIN_ADDRESS));
    let inner_shim = file
        .inner_shim
        .or_else(|| nonempty(env(INNER_SHIM_ENV)).map(PathBuf::from))
        .or_else(|| find_on_path(INNER_SHIM_NAME, env("PATH").as_deref()))
        .unwrap_or_else(|| Path::new("/usr/bin").join(INNER_SHIM_NAME));
    ShimConfig {
        admin_address,
        inner_shim,
        runc_root: file.runc_root.filter(|s| !s.is_empty()),
        publish_timeout: file
            .publish_timeout_s
            .map(Duration::from_secs)
            .unwrap_or(DEFAULT_PUBLISH_TIMEOUT),
    }
}

fn find_on_path(name: &str, path: Option<&str>) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(path?)
        .map(|d| d.join(name))
        .find(|p| {
            p.metadata()
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime_options_any(path: &str, body: &str) -> Any {
        let o = RuntimeOptionsProto {
            type_url: String::new(),
            config_path: path.into(),
            config_body: body.into(),
        };
        Any {
            type_url: RUNTIME_OPTIONS_TYPE.into(),
            value: prost::Message::encode_to_vec(&o),
            ..Default::default()
        }
    }

    #[test]
    fn runtime_options_carry_our_config() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("shim.toml");
        std::fs::write(
            &f,
            "admin_address = \"/x/admin.sock\"\nrunc_root = \"/x/runc\"\n",
        )
        .unwrap();
        let any = runtime_options_any(f.to_str().unwrap(), "");
        let bytes = any.write_to_bytes().unwrap();
        let o = RuntimeOptions::from_any_bytes(&bytes).unwrap();
        let cfg = resolve(o.file_config().unwrap(), |_| None);
        assert_eq!(cfg.admin_address, PathBuf::from("/x/admin.sock"));
        assert_eq!(cfg.runc_root.as_deref(), Some("/x/runc"));
        // Our options never reach runc-v2; runc options with the root do.
        let inner = o.for_inner(cfg.runc_root.as_deref()).unwrap();
        assert_eq!(inner.type_url, RUNC_OPTIONS_TYPE);
        assert_eq!(
            RuncOptions::parse_from_bytes(&inner.value).unwrap().root,
            "/x/runc"
        );
    }

    #[test]
    fn inline_body_and_unknown_keys() {
        let o = RuntimeOptions::from_any(runtime_options_any("", "publish_timeout_s = 7")).unwrap();
        assert_eq!(
            resolve(o.file_config().unwrap(), |_| None).publish_timeout,
            Duration::from_secs(7)
        );
        let bad = RuntimeOptions::from_any(runtime_options_any("", "admin = 1")).unwrap();
        assert!(bad.file_config().is_err(), "a typo must not be ignored");
    }

    #[test]
    fn systemd_cgroups_paths() {
        assert!(is_systemd_cgroups_path("system.slice:nerdctl:0123abcd"));
        assert!(!is_systemd_cgroups_path("/default/0123abcd"));
        assert!(!is_systemd_cgroups_path("/a:b:c"));
        assert!(!is_systemd_cgroups_path("a:b"));
        let o = RuntimeOptions::None.for_inner_with(None, true).unwrap();
        assert!(
            RuncOptions::parse_from_bytes(&o.value)
                .unwrap()
                .systemd_cgroup
        );
        assert_eq!(RuntimeOptions::None.for_inner_with(None, false), None);
    }

    #[test]
    fn env_then_default() {
        let cfg = resolve(None, |k| {
            (k == ADMIN_ENV).then(|| "/e/admin.sock".to_string())
        });
        assert_eq!(cfg.admin_address, PathBuf::from("/e/admin.sock"));
        let cfg = resolve(None, |_| None);
        assert_eq!(
            cfg.admin_address,
            PathBuf::from(layerstack_api::DEFAULT_ADMIN_ADDRESS)
        );
        assert_eq!(cfg.publish_timeout, DEFAULT_PUBLISH_TIMEOUT);
        assert!(cfg.runc_root.is_none());
    }

    #[test]
    fn runc_options_pass_through_and_others_drop() {
        let mut ro = RuncOptions::new();
        ro.systemd_cgroup = true;
        let any = Any {
            type_url: RUNC_OPTIONS_TYPE.into(),
            value: ro.write_to_bytes().unwrap(),
            ..Default::default()
        };
        let o = RuntimeOptions::from_any(any.clone()).unwrap();
        assert_eq!(o.for_inner(Some("/ignored")), Some(any));
        let other = RuntimeOptions::from_any(Any {
            type_url: "example.v1.Other".into(),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(other, RuntimeOptions::Other("example.v1.Other".into()));
        assert_eq!(other.for_inner(None), None);
        assert_eq!(
            RuntimeOptions::from_any_bytes(&[]).unwrap(),
            RuntimeOptions::None
        );
    }
}
