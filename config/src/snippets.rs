//! Configuration LayerStack generates for the tools around it: containerd
//! (1.6, 1.7, 2.x), nerdctl, Docker, the runtime shim, and the daemon's own
//! commented defaults. `layerstack config …` prints these; nothing else writes
//! them, so this module is their one source.
//!
//! Every generator takes the [`Endpoints`] to name (socket paths, store root) and
//! returns the document as text. Paths must be UTF-8 (TOML and JSON strings are);
//! anything else is [`SnippetError::NotUtf8`], never a lossy rewrite.
//!
//! Where the table names come from (containerd `docs/cri/config.md`,
//! `docs/PLUGINS.md`, `docs/transfer.md`; nerdctl `docs/config.md`; moby
//! `daemon/config`):
//!
//! | | containerd 1.6 / 1.7 | containerd 2.x |
//! |---|---|---|
//! | config `version` | 2 | 3 (2 is migrated at start) |
//! | proxy snapshotter | `[proxy_plugins.layerstack]` | same |
//! | CRI snapshotter | `[plugins."io.containerd.grpc.v1.cri".containerd] snapshotter` | `[plugins.'io.containerd.cri.v1.images'] snapshotter` |
//! | CRI runtime handler | `[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.<h>]` | `[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.<h>]` |
//! | pull unpacks into a proxy snapshotter | always (client-side unpack) | only when `unpack_config` of `io.containerd.transfer.v1.local` names it |
//! | `proxy_plugins.<n>.exports` | 1.6.32+, 1.7.16+ (older releases ignore it: checked with 1.6.20's `containerd config dump`) | yes |
//!
//! ```
//! use layerstack_config::snippets::{containerd, ContainerdVersion, Endpoints};
//! let text = containerd(ContainerdVersion::V1_6, &Endpoints::default(), "linux/amd64").unwrap();
//! let doc: toml::Table = text.parse().unwrap();
//! assert_eq!(doc["version"].as_integer(), Some(2));
//! assert_eq!(doc["proxy_plugins"]["layerstack"]["address"].as_str(), Some("/run/layerstack/snapshotter.sock"));
//! ```

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::Config;

/// The snapshotter's name in containerd (`proxy_plugins.<name>`, `--snapshotter`).
pub const SNAPSHOTTER: &str = "layerstack";
/// The runtime shim's runtime type (binary `containerd-shim-layerstack-v1`).
pub const RUNTIME_TYPE: &str = "io.containerd.layerstack.v1";
/// The CRI runtime handler (a Kubernetes RuntimeClass's `handler`) and Docker
/// runtime name that select the runtime shim.
pub const RUNTIME_HANDLER: &str = "layerstack";
/// The container label and pod/container annotation that names a session's branch
/// ([`layerstack_types::labels::BRANCH_LABEL`]).
pub const BRANCH_KEY: &str = layerstack_types::labels::BRANCH_LABEL;
/// Where the generated shim settings go when the admin socket is not the default.
pub const DEFAULT_SHIM_CONFIG: &str = "/etc/layerstack/shim.toml";

/// What the generated documents name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoints {
    /// Store root (`root`; containerd `exports.root` for the kubelet's
    /// image-filesystem statistics).
    pub root: PathBuf,
    /// The Snapshots API socket containerd dials.
    pub address: PathBuf,
    /// The admin socket (CLI, runtime shim).
    pub admin_address: PathBuf,
    /// containerd's socket.
    pub containerd_address: PathBuf,
    /// The Prometheus endpoint's address.
    pub metrics_address: SocketAddr,
    /// Where the runtime shim's settings file is installed; named in containerd's
    /// and Docker's runtime options only when the admin socket is not the default
    /// (the shim's default is the default socket).
    pub shim_config: PathBuf,
}

impl Default for Endpoints {
    fn default() -> Self {
        let c = Config::default();
        Self {
            root: c.root,
            address: c.address,
            admin_address: c.admin_address,
            containerd_address: c.containerd_address,
            metrics_address: c.metrics.address(),
            shim_config: PathBuf::from(DEFAULT_SHIM_CONFIG),
        }
    }
}

impl Endpoints {
    /// Whether the runtime shim must be told the admin socket (it is not the
    /// default the shim assumes).
    pub fn shim_needs_config(&self) -> bool {
        self.admin_address != Config::default().admin_address
    }
}

/// Why a document could not be generated.
#[derive(Debug, thiserror::Error)]
pub enum SnippetError {
    /// A path that is not UTF-8 cannot be written into TOML or JSON.
    #[error("path {0:?} is not UTF-8: TOML and JSON cannot name it")]
    NotUtf8(PathBuf),
}

/// A containerd release line: what decides the config format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ContainerdVersion {
    /// containerd 1.6 (Debian bookworm): config version 2.
    V1_6,
    /// containerd 1.7: config version 2; `exports` and per-runtime snapshotters.
    V1_7,
    /// containerd 2.x: config version 3, new CRI plugin ids, transfer service.
    V2,
}

impl ContainerdVersion {
    /// The `version = N` of containerd's config file for this release line.
    pub fn config_version(self) -> u32 {
        match self {
            Self::V1_6 | Self::V1_7 => 2,
            Self::V2 => 3,
        }
    }

    /// The release line of `containerd --version` output, e.g.
    /// `containerd github.com/containerd/containerd 1.6.20~ds1 …` or
    /// `containerd containerd.io v2.0.4 …`. `None` when no version is recognised.
    pub fn from_version_output(out: &str) -> Option<Self> {
        out.split_whitespace()
            .skip(1)
            .find_map(|w| w.strip_prefix('v').unwrap_or(w).parse().ok())
    }
}

impl FromStr for ContainerdVersion {
    type Err = String;

    /// `1.6`, `1.7`, `2` (also `1.6.20`, `v1.7.13`, `2.0`, `2.1.3`, `2.x`).
    fn from_str(s: &str) -> Result<Self, String> {
        let v = s.strip_prefix('v').unwrap_or(s);
        let mut parts = v.split(['.', '~', '-', '+']);
        let major = parts.next().unwrap_or("");
        let minor = parts.next();
        match (major, minor) {
            ("1", Some("6")) => Ok(Self::V1_6),
            ("1", Some("7")) => Ok(Self::V1_7),
            ("2", _) => Ok(Self::V2),
            _ => Err(format!(
                "unsupported containerd version {s:?}: use 1.6, 1.7 or 2 (containerd 1.5 and older cannot run LayerStack's shim or CRI settings)"
            )),
        }
    }
}

/// The host's OCI platform (`linux/amd64`, `linux/arm64`, …), as containerd's
/// `unpack_config` names it.
pub fn host_platform() -> String {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        "loongarch64" => "loong64",
        other => other,
    };
    format!("linux/{arch}")
}

fn utf8(p: &Path) -> Result<&str, SnippetError> {
    p.to_str()
        .ok_or_else(|| SnippetError::NotUtf8(p.to_path_buf()))
}

/// A TOML basic string holding `s`, quoted and escaped.
fn toml_str(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

fn toml_path(p: &Path) -> Result<String, SnippetError> {
    utf8(p).map(toml_str)
}

/// containerd's `config.toml` entries for LayerStack: the proxy snapshotter, the
/// CRI snapshotter and runtime handler `layerstack` (runtime shim), and for 2.x
/// the transfer service's `unpack_config` (without it `ctr image pull` and
/// nerdctl skip unpacking into a proxy snapshotter). `platform` is the
/// `unpack_config` platform (2.x only), e.g. [`host_platform`].
///
/// The result is a complete document (`version` first); to add it to an existing
/// config, merge its keys: TOML allows each table once.
pub fn containerd(
    version: ContainerdVersion,
    e: &Endpoints,
    platform: &str,
) -> Result<String, SnippetError> {
    let address = toml_path(&e.address)?;
    let root = toml_path(&e.root)?;
    let shim_config = toml_path(&e.shim_config)?;
    let platform = toml_str(platform);
    let mut t = String::new();
    let w = &mut t;
    let label = match version {
        ContainerdVersion::V1_6 => "containerd 1.6",
        ContainerdVersion::V1_7 => "containerd 1.7",
        ContainerdVersion::V2 => "containerd 2.x",
    };
    let _ = writeln!(
        w,
        "# LayerStack for {label} (generated by `layerstack config containerd`).\n\
         # Merge into /etc/containerd/config.toml (each table may appear only once in a\n\
         # TOML file), then restart containerd. Start containerd-layerstack-grpc first:\n\
         # layerstack.service is ordered Before=containerd.service."
    );
    let _ = writeln!(w, "version = {}\n", version.config_version());
    let _ = writeln!(
        w,
        "# The snapshotter: `ctr run --snapshotter layerstack`, nerdctl, Docker, CRI.\n\
         [proxy_plugins]\n  [proxy_plugins.{SNAPSHOTTER}]\n    type = \"snapshot\"\n    address = {address}"
    );
    let exports_note = match version {
        ContainerdVersion::V1_6 => "containerd >= 1.6.32 reads `exports` (1.6.20 ignores it)",
        ContainerdVersion::V1_7 => "containerd >= 1.7.16 reads `exports` (older 1.7 ignores it)",
        ContainerdVersion::V2 => "containerd reads `exports`",
    };
    let _ = writeln!(
        w,
        "    # {exports_note}: the kubelet's image-filesystem\n    \
         # statistics use the exported root.\n    \
         [proxy_plugins.{SNAPSHOTTER}.exports]\n      root = {root}"
    );
    if version == ContainerdVersion::V2 {
        let _ = writeln!(
            w,
            "\n# `ctr image pull` and nerdctl pull through the transfer service, which unpacks\n\
             # only into the snapshotters named here. Naming any replaces the defaults, so\n\
             # overlayfs is listed too.\n\
             [[plugins.'io.containerd.transfer.v1.local'.unpack_config]]\n  \
             platform = {platform}\n  snapshotter = \"overlayfs\"\n  differ = \"walking\"\n\
             [[plugins.'io.containerd.transfer.v1.local'.unpack_config]]\n  \
             platform = {platform}\n  snapshotter = \"{SNAPSHOTTER}\""
        );
    }
    let (images, runtimes) = match version {
        ContainerdVersion::V1_6 | ContainerdVersion::V1_7 => (
            "plugins.\"io.containerd.grpc.v1.cri\".containerd",
            "plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes",
        ),
        ContainerdVersion::V2 => (
            "plugins.'io.containerd.cri.v1.images'",
            "plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes",
        ),
    };
    let passthrough = format!(
        "  pod_annotations = [\"{BRANCH_KEY}\"]\n  container_annotations = [\"{BRANCH_KEY}\"]"
    );
    let _ = writeln!(
        w,
        "\n# Kubernetes (CRI): pods' containers on the layerstack snapshotter, and the\n\
         # runtime handler `{RUNTIME_HANDLER}` (RuntimeClass `handler: {RUNTIME_HANDLER}`) for the runtime\n\
         # shim, which publishes a container's writes before its task delete returns.\n\
         [{images}]\n  snapshotter = \"{SNAPSHOTTER}\"\n\
         # Naming any runtime replaces CRI's built-in list: keep runc (the default\n\
         # runtime handler; without it the CRI plugin does not load).\n\
         # `{BRANCH_KEY}` in a pod's (or container's) annotations picks the session's\n\
         # branch: CRI copies only the annotations listed here into the container's\n\
         # OCI spec, where the daemon reads them.\n\
         [{runtimes}.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n\
         {passthrough}\n\
         [{runtimes}.{RUNTIME_HANDLER}]\n  runtime_type = \"{RUNTIME_TYPE}\"\n\
         {passthrough}"
    );
    if version != ContainerdVersion::V1_6 {
        let _ = writeln!(
            w,
            "  # To leave other runtime handlers on their snapshotter, drop the CRI\n  \
             # `snapshotter` line above and set it here instead (containerd >= 1.7):\n  \
             # snapshotter = \"{SNAPSHOTTER}\""
        );
    }
    if e.shim_needs_config() {
        let _ = writeln!(
            w,
            "  # The admin socket is not the default: the shim reads it from this file\n  \
             # (`layerstack config shim --admin-address <path> > {}`).\n  \
             [{runtimes}.{RUNTIME_HANDLER}.options]\n    ConfigPath = {shim_config}",
            utf8(&e.shim_config)?
        );
    }
    Ok(t)
}

/// nerdctl's `/etc/nerdctl/nerdctl.toml`: containerd's socket and the snapshotter.
pub fn nerdctl(e: &Endpoints) -> Result<String, SnippetError> {
    let address = toml_str(&format!("unix://{}", utf8(&e.containerd_address)?));
    Ok(format!(
        "# nerdctl with LayerStack (generated by `layerstack config nerdctl`):\n\
         # /etc/nerdctl/nerdctl.toml (rootful).\n\
         address = {address}\n\
         snapshotter = \"{SNAPSHOTTER}\"\n\
         # nerdctl.toml has no runtime key: to publish a container's writes before\n\
         # `nerdctl run --rm` returns, pass the runtime shim on each run:\n\
         #   nerdctl run --runtime {RUNTIME_TYPE} …\n\
         # nerdctl cannot set snapshot labels; choose a branch with the container label\n\
         # `--label layerstack.branch=NAME` (the daemon reads it when it first mounts the rootfs).\n"
    ))
}

/// Docker's `/etc/docker/daemon.json` (Docker >= 24 with the containerd image
/// store): the snapshotter (`storage-driver` is taken verbatim as the containerd
/// snapshotter's name), the system containerd (whose config registers the
/// snapshotter), and the runtime `layerstack` for the runtime shim.
pub fn docker(e: &Endpoints) -> Result<String, SnippetError> {
    let mut runtime = serde_json::json!({ "runtimeType": RUNTIME_TYPE });
    if e.shim_needs_config() {
        runtime["options"] = serde_json::json!({ "ConfigPath": utf8(&e.shim_config)? });
    }
    let doc = serde_json::json!({
        "features": { "containerd-snapshotter": true },
        "storage-driver": SNAPSHOTTER,
        "containerd": utf8(&e.containerd_address)?,
        "runtimes": { RUNTIME_HANDLER: runtime },
    });
    let mut s = serde_json::to_string_pretty(&doc).unwrap_or_default();
    s.push('\n');
    Ok(s)
}

/// The runtime shim's settings file (runtime options `ConfigPath`): the admin
/// socket it asks for publishes.
pub fn shim(e: &Endpoints) -> Result<String, SnippetError> {
    Ok(format!(
        "# containerd-shim-layerstack-v1 settings (generated by `layerstack config shim`).\n\
         # Named by the runtime options: CRI `[…runtimes.{RUNTIME_HANDLER}.options] ConfigPath`,\n\
         # Docker `runtimes.{RUNTIME_HANDLER}.options.ConfigPath`, `ctr run --runtime-config-path`.\n\
         admin_address = {}\n",
        toml_path(&e.admin_address)?
    ))
}

/// The daemon's commented default configuration ([`crate::DEFAULT_TOML`]) with
/// the endpoints that differ from the defaults set (uncommented).
pub fn daemon(e: &Endpoints) -> Result<String, SnippetError> {
    let d = Endpoints::default();
    let mut sets: Vec<(&str, String)> = Vec::new();
    if e.root != d.root {
        sets.push(("root", toml_path(&e.root)?));
    }
    if e.address != d.address {
        sets.push(("address", toml_path(&e.address)?));
    }
    if e.admin_address != d.admin_address {
        sets.push(("admin_address", toml_path(&e.admin_address)?));
    }
    if e.containerd_address != d.containerd_address {
        sets.push(("containerd_address", toml_path(&e.containerd_address)?));
    }
    let metrics =
        (e.metrics_address != d.metrics_address).then(|| toml_str(&e.metrics_address.to_string()));
    let mut out = String::with_capacity(crate::DEFAULT_TOML.len() + 128);
    let mut in_metrics = false;
    // Top-level keys come before the first section; `address` is also a key
    // of `[metrics]` and `[api.tcp]`.
    let mut in_section = false;
    for line in crate::DEFAULT_TOML.lines() {
        if line.starts_with("# [") || line.starts_with('[') {
            in_section = true;
            in_metrics = line.trim_start_matches("# ") == "[metrics]";
            if in_metrics && metrics.is_some() {
                out.push_str("[metrics]\n");
                continue;
            }
        }
        let key = line
            .strip_prefix("# ")
            .and_then(|l| l.split_once(" = "))
            .map(|(k, _)| k);
        let replaced = match key {
            Some("address") if in_metrics => metrics.as_ref().map(|v| ("address", v.clone())),
            Some(k) if !in_section => sets.iter().find(|(s, _)| *s == k).cloned(),
            _ => None,
        };
        match replaced {
            Some((k, v)) => {
                let _ = writeln!(out, "{k} = {v}");
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    Ok(out)
}

/// What `layerstack config crio-none` prints: CRI-O cannot use LayerStack.
pub const CRIO_UNSUPPORTED: &str = "\
# CRI-O is not supported, and no configuration can make it work.
#
# LayerStack is a containerd snapshotter (a proxy plugin serving containerd's
# Snapshots API) plus a containerd runtime shim (io.containerd.layerstack.v1).
# CRI-O does not use containerd: it stores images and container root filesystems
# with containers/storage (its own graph drivers: overlay, vfs, ...) and runs
# OCI runtimes directly through conmon, so it never calls a containerd snapshotter
# or shim. Kubernetes nodes that want LayerStack run containerd as their CRI
# runtime (`layerstack config containerd`).
";

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn odd() -> Endpoints {
        Endpoints {
            root: "/srv/ls \"root\"".into(),
            address: "/x/snap\\shot.sock".into(),
            admin_address: "/x/admin.sock".into(),
            containerd_address: "/y/c.sock".into(),
            metrics_address: "127.0.0.1:0".parse().unwrap(),
            shim_config: "/etc/ls/shim.toml".into(),
        }
    }

    fn parse(s: &str) -> toml::Table {
        s.parse::<toml::Table>()
            .unwrap_or_else(|e| panic!("{e}\n{s}"))
    }

    #[test]
    fn versions_parse_from_flags_and_version_output() {
        use ContainerdVersion::*;
        for (s, v) in [
            ("1.6", V1_6),
            ("1.6.20", V1_6),
            ("v1.7.13", V1_7),
            ("1.7", V1_7),
            ("2", V2),
            ("2.0", V2),
            ("2.1.3", V2),
            ("2.x", V2),
        ] {
            assert_eq!(s.parse::<ContainerdVersion>().unwrap(), v, "{s}");
        }
        for bad in ["1.5", "1", "3", "", "x"] {
            assert!(bad.parse::<ContainerdVersion>().is_err(), "{bad}");
        }
        assert_eq!(
            ContainerdVersion::from_version_output(
                "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3\n"
            ),
            Some(V1_6)
        );
        assert_eq!(
            ContainerdVersion::from_version_output(
                "containerd containerd.io v2.0.4 1a43cb6a1035441f9aca8f5666a9b3ef9e70ab20"
            ),
            Some(V2)
        );
        assert_eq!(ContainerdVersion::from_version_output("nonsense"), None);
    }

    #[test]
    fn containerd_1x_documents_name_the_cri_v1_tables() {
        for v in [ContainerdVersion::V1_6, ContainerdVersion::V1_7] {
            let s = containerd(v, &Endpoints::default(), "linux/amd64").unwrap();
            let d = parse(&s);
            assert_eq!(d["version"].as_integer(), Some(2));
            let p = &d["proxy_plugins"]["layerstack"];
            assert_eq!(p["type"].as_str(), Some("snapshot"));
            assert_eq!(
                p["address"].as_str(),
                Some("/run/layerstack/snapshotter.sock")
            );
            assert_eq!(p["exports"]["root"].as_str(), Some("/var/lib/layerstack"));
            let cri = &d["plugins"]["io.containerd.grpc.v1.cri"]["containerd"];
            assert_eq!(cri["snapshotter"].as_str(), Some("layerstack"));
            assert_eq!(
                cri["runtimes"]["layerstack"]["runtime_type"].as_str(),
                Some("io.containerd.layerstack.v1")
            );
            assert!(cri["runtimes"]["layerstack"].get("options").is_none());
            for h in ["layerstack", "runc"] {
                for key in ["pod_annotations", "container_annotations"] {
                    assert_eq!(
                        cri["runtimes"][h][key].as_array().map(Vec::as_slice),
                        Some(&[toml::Value::from("layerstack.branch")][..]),
                        "{h} {key}"
                    );
                }
            }
            assert_eq!(
                cri["runtimes"]["runc"]["runtime_type"].as_str(),
                Some("io.containerd.runc.v2"),
                "the default runtime stays (checked against containerd 1.6.20: without it CRI does not load)"
            );
            assert!(d["plugins"]
                .get("io.containerd.transfer.v1.local")
                .is_none());
            assert!(d["plugins"].get("io.containerd.cri.v1.images").is_none());
        }
    }

    #[test]
    fn containerd_2_document_has_version_3_unpack_config_and_cri_v1_plugins() {
        let s = containerd(ContainerdVersion::V2, &Endpoints::default(), "linux/arm64").unwrap();
        let d = parse(&s);
        assert_eq!(d["version"].as_integer(), Some(3));
        assert_eq!(
            d["proxy_plugins"]["layerstack"]["exports"]["root"].as_str(),
            Some("/var/lib/layerstack")
        );
        let unpack = d["plugins"]["io.containerd.transfer.v1.local"]["unpack_config"]
            .as_array()
            .unwrap();
        let snaps: Vec<_> = unpack
            .iter()
            .map(|u| u["snapshotter"].as_str().unwrap())
            .collect();
        assert_eq!(snaps, ["overlayfs", "layerstack"], "the default stays");
        assert!(unpack
            .iter()
            .all(|u| u["platform"].as_str() == Some("linux/arm64")));
        assert_eq!(
            d["plugins"]["io.containerd.cri.v1.images"]["snapshotter"].as_str(),
            Some("layerstack")
        );
        assert_eq!(
            d["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["layerstack"]
                ["runtime_type"]
                .as_str(),
            Some("io.containerd.layerstack.v1")
        );
        assert_eq!(
            d["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["runc"]
                ["runtime_type"]
                .as_str(),
            Some("io.containerd.runc.v2")
        );
        assert!(d["plugins"].get("io.containerd.grpc.v1.cri").is_none());
    }

    #[test]
    fn odd_paths_are_quoted_and_a_custom_admin_socket_names_the_shim_config() {
        let e = odd();
        for v in [
            ContainerdVersion::V1_6,
            ContainerdVersion::V1_7,
            ContainerdVersion::V2,
        ] {
            let d = parse(&containerd(v, &e, "linux/amd64").unwrap());
            assert_eq!(
                d["proxy_plugins"]["layerstack"]["address"].as_str(),
                Some("/x/snap\\shot.sock")
            );
            let rt = if v == ContainerdVersion::V2 {
                &d["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
                    ["layerstack"]
            } else {
                &d["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["layerstack"]
            };
            assert_eq!(
                rt["options"]["ConfigPath"].as_str(),
                Some("/etc/ls/shim.toml")
            );
        }
        let shim = parse(&shim(&e).unwrap());
        assert_eq!(shim["admin_address"].as_str(), Some("/x/admin.sock"));
        let docker: serde_json::Value = serde_json::from_str(&docker(&e).unwrap()).unwrap();
        assert_eq!(
            docker["runtimes"]["layerstack"]["options"]["ConfigPath"],
            "/etc/ls/shim.toml"
        );
        assert_eq!(docker["containerd"], "/y/c.sock");
        let nerd = parse(&nerdctl(&e).unwrap());
        assert_eq!(nerd["address"].as_str(), Some("unix:///y/c.sock"));
    }

    #[test]
    fn docker_and_nerdctl_documents_name_the_snapshotter_and_runtime() {
        let v: serde_json::Value =
            serde_json::from_str(&docker(&Endpoints::default()).unwrap()).unwrap();
        assert_eq!(v["features"]["containerd-snapshotter"], true);
        assert_eq!(v["storage-driver"], "layerstack");
        assert_eq!(v["containerd"], "/run/containerd/containerd.sock");
        assert_eq!(
            v["runtimes"]["layerstack"]["runtimeType"],
            "io.containerd.layerstack.v1"
        );
        assert!(v["runtimes"]["layerstack"].get("options").is_none());
        let n = nerdctl(&Endpoints::default()).unwrap();
        let d = parse(&n);
        assert_eq!(d["snapshotter"].as_str(), Some("layerstack"));
        assert_eq!(
            d["address"].as_str(),
            Some("unix:///run/containerd/containerd.sock")
        );
        assert!(n.contains("--runtime io.containerd.layerstack.v1"), "{n}");
    }

    #[test]
    fn daemon_document_is_the_default_or_sets_what_differs() {
        assert_eq!(
            daemon(&Endpoints::default()).unwrap(),
            crate::DEFAULT_TOML,
            "defaults: the shipped file, byte for byte"
        );
        let e = odd();
        let s = daemon(&e).unwrap();
        let c = Config::from_toml(&s).unwrap_or_else(|err| panic!("{err:?}\n{s}"));
        assert_eq!(c.root, e.root);
        assert_eq!(c.address, e.address);
        assert_eq!(c.admin_address, e.admin_address);
        assert_eq!(c.containerd_address, e.containerd_address);
        assert_eq!(c.metrics.address(), e.metrics_address);
        assert_eq!(
            c.merge,
            crate::MergeConfig::default(),
            "the rest stays default"
        );
        assert_eq!(c.log, crate::LogConfig::default());
    }

    #[test]
    fn non_utf8_paths_are_refused() {
        use std::os::unix::ffi::OsStrExt;
        let e = Endpoints {
            address: PathBuf::from(std::ffi::OsStr::from_bytes(b"/x/\xff.sock")),
            ..Endpoints::default()
        };
        let err = containerd(ContainerdVersion::V1_6, &e, "linux/amd64").unwrap_err();
        assert!(err.to_string().contains("not UTF-8"), "{err}");
    }

    #[test]
    fn crio_text_is_comments_only_and_says_why() {
        assert!(CRIO_UNSUPPORTED.lines().all(|l| l.starts_with('#')));
        assert!(CRIO_UNSUPPORTED.contains("not supported"));
        assert!(CRIO_UNSUPPORTED.contains("containers/storage"));
        assert!(parse(CRIO_UNSUPPORTED).is_empty());
    }
}
