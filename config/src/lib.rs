//! Typed LayerStack configuration (`/etc/layerstack/config.toml`) and the
//! configuration LayerStack generates for the tools around it (containerd,
//! nerdctl, Docker, the runtime shim: [`snippets`]) — the one source of both.
//!
//! Only binaries read configuration; libraries take plain values.
//!
//! ```
//! let c = layerstack_config::Config::from_toml("root = \"/srv/ls\"").unwrap();
//! assert_eq!(c.root.to_str(), Some("/srv/ls"));
//! assert_eq!(c.default_branch, "main");
//! ```

#![forbid(unsafe_code)]

pub mod snippets;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The commented default configuration, as shipped (`config/snippets/layerstack.toml`).
pub const DEFAULT_TOML: &str = include_str!("../snippets/layerstack.toml");
/// Where the packaged daemon reads its configuration (`layerstack.service`).
pub const DEFAULT_CONFIG_PATH: &str = "/etc/layerstack/config.toml";

/// Durability profile (ARCHITECTURE.md §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Durability {
    /// SQLite WAL, `synchronous=OFF`.
    #[default]
    Disposable,
    /// SQLite WAL, `synchronous=FULL`.
    Durable,
}

/// LayerStack daemon configuration. Every field has a default; command-line
/// flags override the file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Store root; must be on local ext4, xfs or btrfs.
    pub root: PathBuf,
    /// Unix socket serving containerd's Snapshots API.
    pub address: PathBuf,
    /// Unix socket serving LayerStack's admin API.
    pub admin_address: PathBuf,
    /// containerd's gRPC socket (event stream, image resolution).
    pub containerd_address: PathBuf,
    /// Branch a session leases when its snapshot labels name none.
    pub default_branch: String,
    /// Store durability profile.
    pub durability: Durability,
    /// Publish a session when containerd reports its task deleted (`/tasks/delete`).
    pub publish_on_task_delete: bool,
    /// Publishes captured, planned and staged at once (the CPU-bound work outside
    /// the branch gate, ARCHITECTURE.md §9); the rest wait their turn in order.
    /// 0: one per CPU. Default 0.
    pub publish_workers: u64,
    /// Container paths that are never published (and never validated by the gate):
    /// absolute glob patterns, `*` stays within one component, `**` spans any
    /// number; a path is excluded when it or an ancestor matches.
    /// Default: `/tmp/**`, `/var/cache/**`, `/run/**`.
    pub exclude: Vec<String>,
    /// Limits of the gate's three-way text merge.
    pub merge: MergeConfig,
    /// Limits of what one session may write to be captured (`[capture]`).
    pub capture: CaptureConfig,
    /// History maintenance: squash, garbage collection, retention.
    pub history: HistoryConfig,
    /// The Prometheus endpoint (`[metrics]`).
    pub metrics: MetricsConfig,
    /// Log filter and format (`[log]`).
    pub log: LogConfig,
    /// Mode B: sandbox sessions without a container.
    pub sandbox: SandboxConfig,
    /// Who may call the admin API; the optional TCP listener (`[api]`).
    pub api: ApiConfig,
    /// OCI registries the daemon pushes nodes to and pulls them from
    /// (`[registry]`).
    pub registry: RegistryConfig,
}

/// `[registry]`: how the daemon reaches OCI registries for `Push` / `Pull`
/// (docs/operations.md "Push and pull"), and how long it keeps trying one
/// that fails transiently (connection refused or reset, timeouts, HTTP 408,
/// 429, 5xx except 501).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RegistryConfig {
    /// Registries (`host` or `host:port`) spoken to over plain HTTP; every
    /// other one over HTTPS only. Default none.
    pub insecure: Vec<String>,
    /// PEM files of CAs trusted besides the system's (a private registry's).
    pub ca_files: Vec<PathBuf>,
    /// A docker `config.json` whose credentials the daemon uses when a request
    /// carries none (`auths`, `credHelpers`, `credsStore`). Default: none —
    /// requests without credentials are anonymous.
    pub docker_config: Option<PathBuf>,
    /// Attempts per registry step (a `HEAD`, a manifest `GET`/`PUT`, a blob
    /// download, a blob upload from a new session), the first included; 1 =
    /// no retry. 1..=[`MAX_REGISTRY_RETRY_ATTEMPTS`]. Default 4.
    pub retry_attempts: u32,
    /// The first retry's delay ceiling, ms, doubled per retry (each delay
    /// drawn between half the ceiling and the ceiling). Default 200.
    pub retry_base_ms: u64,
    /// The longest delay between two attempts, ms: ≥ `retry_base_ms`, ≤
    /// [`MAX_REGISTRY_RETRY_MAX_MS`]. Default 5000.
    pub retry_max_ms: u64,
    /// Longest wait for a connection to a registry, ms (a timeout is a
    /// retried failure). 1..=[`MAX_REGISTRY_TIMEOUT_MS`]. Default 15000.
    pub connect_timeout_ms: u64,
    /// Longest wait for one read from a registry (not a whole blob), ms: a
    /// registry stalled this long is cut off, a retried failure.
    /// 1..=[`MAX_REGISTRY_TIMEOUT_MS`]. Default 120000.
    pub read_timeout_ms: u64,
}

/// The longest `[registry] connect_timeout_ms` / `read_timeout_ms` may be, ms
/// (1 hour; the registry crate's `MAX_TIMEOUT_MS`).
pub const MAX_REGISTRY_TIMEOUT_MS: u64 = 3_600_000;

/// The most `[registry] retry_attempts` may be (the registry crate's
/// `MAX_RETRY_ATTEMPTS`).
pub const MAX_REGISTRY_RETRY_ATTEMPTS: u32 = 100;
/// The longest `[registry] retry_max_ms` may be, ms (10 minutes; the registry
/// crate's `MAX_RETRY_MAX_MS`).
pub const MAX_REGISTRY_RETRY_MAX_MS: u64 = 600_000;

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            insecure: Vec::new(),
            ca_files: Vec::new(),
            docker_config: None,
            retry_attempts: 4,
            retry_base_ms: 200,
            retry_max_ms: 5000,
            connect_timeout_ms: 15_000,
            read_timeout_ms: 120_000,
        }
    }
}

impl RegistryConfig {
    /// The retry keys in their ranges; `Err` names the key.
    fn check(&self) -> Result<(), String> {
        for h in &self.insecure {
            let bare = !h.is_empty()
                && !h.contains("://")
                && !h.contains('/')
                && !h.chars().any(|c| c.is_whitespace() || c == '@');
            if !bare {
                return Err(format!(
                    "[registry] insecure entry {h:?} is not a registry's host or host:port as a reference names it: write e.g. \"127.0.0.1:5000\" (no scheme, no path)"
                ));
            }
        }
        if !(1..=MAX_REGISTRY_RETRY_ATTEMPTS).contains(&self.retry_attempts) {
            return Err(format!(
                "[registry] retry_attempts = {} is out of range: 1..={MAX_REGISTRY_RETRY_ATTEMPTS} (1: no retry)",
                self.retry_attempts
            ));
        }
        if self.retry_max_ms > MAX_REGISTRY_RETRY_MAX_MS {
            return Err(format!(
                "[registry] retry_max_ms = {} is above {MAX_REGISTRY_RETRY_MAX_MS} (10 minutes)",
                self.retry_max_ms
            ));
        }
        for (key, ms) in [
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("read_timeout_ms", self.read_timeout_ms),
        ] {
            if !(1..=MAX_REGISTRY_TIMEOUT_MS).contains(&ms) {
                return Err(format!(
                    "[registry] {key} = {ms} is out of range: 1..={MAX_REGISTRY_TIMEOUT_MS} ms (1 hour)"
                ));
            }
        }
        if self.retry_base_ms > self.retry_max_ms {
            return Err(format!(
                "[registry] retry_base_ms = {} is above retry_max_ms = {}: the first delay cannot exceed the longest",
                self.retry_base_ms, self.retry_max_ms
            ));
        }
        Ok(())
    }
}

/// The Prometheus text endpoint (`[metrics]`): plain HTTP, `GET /metrics`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// Serve the endpoint. Default true.
    pub enabled: bool,
    /// TCP address to listen on; `None`: [`DEFAULT_METRICS_ADDRESS`] (loopback
    /// only: the endpoint has no authentication). Port 0 picks a free port
    /// (`layerstack status` shows which). The default port taken by another
    /// process is a warning and a free port on the same IP instead; an address
    /// given here (or by `--metrics-address`) that cannot be bound stops the
    /// daemon (docs/operations.md "Metrics").
    pub address: Option<SocketAddr>,
}

/// The metrics endpoint when `[metrics] address` is not given: 127.0.0.1:9464.
pub const DEFAULT_METRICS_ADDRESS: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9464);

impl MetricsConfig {
    /// The address to serve on: the configured one, else [`DEFAULT_METRICS_ADDRESS`].
    pub fn address(&self) -> SocketAddr {
        self.address.unwrap_or(DEFAULT_METRICS_ADDRESS)
    }
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            address: None,
        }
    }
}

/// Who may call the admin API (`[api]`; docs/operations.md "Who may call").
///
/// On the unix sockets the caller is the peer the kernel reports
/// (`SO_PEERCRED`: the connecting process's effective uid and gid at
/// `connect`), checked on every connection before any request is answered.
/// Root (uid 0) is always allowed, as on containerd's own socket; everyone
/// else needs their uid in `allowed_uids` or their effective gid in
/// `allowed_gids` (`SO_PEERCRED` carries no supplementary groups).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApiConfig {
    /// uids allowed on the admin socket besides root. Default none.
    pub allowed_uids: Vec<u32>,
    /// Effective gids allowed on the admin socket. Default none.
    pub allowed_gids: Vec<u32>,
    /// The TCP listener for remote clients (`[api.tcp]`); nothing listens on
    /// TCP unless this is given.
    pub tcp: Option<ApiTcpConfig>,
}

/// `[api.tcp]`: the admin API over TCP, TLS only (rustls), each caller
/// authenticated by a client certificate signed by `client_ca`, a bearer token
/// listed in `tokens_file`, or both when both are given.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiTcpConfig {
    /// HOST:PORT to listen on, e.g. `127.0.0.1:7443` (port 0: any free port).
    pub address: SocketAddr,
    /// The server's certificate chain (PEM). Required: plain TCP is refused.
    pub cert: Option<PathBuf>,
    /// The server's private key (PEM: PKCS#8, PKCS#1 or SEC1). Required.
    pub key: Option<PathBuf>,
    /// CA certificates (PEM) that client certificates must chain to; given,
    /// a client without such a certificate cannot complete the TLS handshake.
    pub client_ca: Option<PathBuf>,
    /// Bearer tokens, one per line (blank lines and `#` comments ignored);
    /// given, every request needs `authorization: Bearer <token>` with one of
    /// them (compared in constant time).
    pub tokens_file: Option<PathBuf>,
}

/// Mode B (`[sandbox]`; ARCHITECTURE.md §12).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxConfig {
    /// Live sandbox sessions at most. Default 256.
    pub max_sessions: u64,
    /// New sandbox sessions per second at most, in bursts of at most that
    /// many; beyond it a create waits (within its `wait_ms`) or is refused
    /// `busy`. 0 = unlimited (the default).
    pub create_rate: u32,
    /// The mount socket; `None`: `mount.sock` beside the admin socket.
    pub mount_address: Option<PathBuf>,
    /// The cgroup under which each limited session gets its own, as a path in
    /// the cgroup hierarchy (`/layerstack.slice/sandboxes`); `None`: a
    /// `layerstack-sandboxes` child of the daemon's own cgroup.
    pub cgroup_parent: Option<String>,
    /// A session's CPU limit when CreateSession does not give one, thousandths
    /// of a CPU; 0 = unlimited (the default).
    pub default_cpu_millis: u64,
    /// A session's memory limit when CreateSession does not give one, bytes;
    /// 0 = unlimited (the default).
    pub default_memory_bytes: u64,
    /// A session's process limit when CreateSession does not give one; 0 =
    /// unlimited (the default).
    pub default_pids: u64,
    /// The pool's CPU budget: the CPU limits of the live daemon-owned
    /// sandboxes together at most, thousandths of a CPU; beyond it a create
    /// waits (within its `wait_ms`) or is refused `busy`. 0 = unlimited (the
    /// default). Needs `default_cpu_millis` (a sandbox without a limit would
    /// escape it).
    pub cpu_budget_millis: u64,
    /// The pool's memory budget: their memory limits together at most, bytes
    /// (counted in MiB). 0 = unlimited (the default). Needs
    /// `default_memory_bytes`.
    pub memory_budget_bytes: u64,
    /// After a restart, how long a session of the last daemon whose holder is
    /// gone waits for it to reconnect and close it with the command's exit
    /// status, seconds. Default 60 (more than `layerstack session run
    /// --reconnect-timeout`'s default, 30).
    pub holder_grace_s: u64,
    /// WASI sessions kept ready for each stack and branch a WASI session was
    /// made on lately (at most 8 of them): store rows, lease and overlay made
    /// ahead, so that CreateSession only hands one over (benchmark P11). They
    /// count against `max_sessions` (a request the cap refuses takes the slot
    /// of one), are made again when their branch moves, and are not listed by
    /// `layerstack session ls`. 0 = none. Default 2.
    pub wasi_ready: u32,
    /// Inits of daemon-owned sessions cloned ahead of their sessions (their
    /// namespaces made, `lo` up), so that CreateSession of a sandbox in root
    /// mode without network, limits or id map only hands one its overlay
    /// (benchmarks P7b, P9). Each idle one is a process of ~30 KiB PSS plus
    /// its namespaces. 0 = none. Default 2.
    pub ready_inits: u32,
    /// How long `WriteFile` and `UploadTar` wait for the client's next
    /// chunk, and `ReadFile` and `DownloadTar` for the client to take the
    /// chunks sent, seconds: a stream idle that long is ended
    /// (DEADLINE_EXCEEDED; an upload's partial file dropped, a read's
    /// answer cut after what was sent). Each such call holds a thread of
    /// the daemon's blocking pool while it waits (as containerd's CRI
    /// `stream_idle_timeout` bounds an idle exec stream). 0 = no limit.
    /// Default 60.
    pub file_stream_idle_s: u64,
    /// The uid/gid mapping of a daemon-owned session that gives none
    /// (`SandboxOptions.id_map`), `HOST_UID:HOST_GID:SIZE`
    /// ([`layerstack_types::IdMap`]); `None` (the default): none, the
    /// session's root is the host's root.
    pub id_map: Option<String>,
}

impl SandboxConfig {
    /// [`SandboxConfig::id_map`] parsed (checked at load: never an error
    /// after [`Config::from_toml`] or [`Config::load`]).
    pub fn id_map(&self) -> Option<layerstack_types::IdMap> {
        self.id_map.as_deref().and_then(|m| m.parse().ok())
    }
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            max_sessions: 256,
            create_rate: 0,
            mount_address: None,
            cgroup_parent: None,
            default_cpu_millis: 0,
            default_memory_bytes: 0,
            default_pids: 0,
            cpu_budget_millis: 0,
            memory_budget_bytes: 0,
            holder_grace_s: 60,
            wasi_ready: 2,
            ready_inits: 2,
            file_stream_idle_s: 60,
            id_map: None,
        }
    }
}

/// Log filter and format (`[log]`); `--log-level` and `--log-format` override.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// A level (`error`, `warn`, `info`, `debug`, `trace`) or a tracing directive
    /// list (`info,layerstack_engine=debug`). Default: `$RUST_LOG`, else `info`.
    pub level: Option<String>,
    /// Line format. Default `text`.
    pub format: LogFormat,
}

/// `[log] format`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines; colour only when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line (journald, log shippers).
    Json,
}

impl Config {
    /// The mount socket: `[sandbox] mount_address`, else `mount.sock` in the admin
    /// socket's directory.
    pub fn mount_address(&self) -> PathBuf {
        self.sandbox.mount_address.clone().unwrap_or_else(|| {
            self.admin_address
                .parent()
                .unwrap_or_else(|| Path::new("/"))
                .join("mount.sock")
        })
    }
}

/// History maintenance (`[history]`; ARCHITECTURE.md §2 "Squash", §10).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HistoryConfig {
    /// A branch whose head shows more published layers than this is squashed
    /// after a publish (0: never automatically). Default 64.
    pub squash_threshold: u64,
    /// The newest layers a squash leaves as they are. Default 8.
    pub squash_keep: u64,
    /// Seconds between garbage collections (0: only `layerstack gc`). Default 600.
    pub gc_interval_s: u64,
    /// Hours an upper kept after a conflict (or another retryable outcome) of a
    /// session whose owner is gone is kept before GC drops it. Default 168 (7 days).
    pub kept_upper_retention_h: u64,
}

impl Default for HistoryConfig {
    fn default() -> Self {
        Self {
            squash_threshold: 64,
            squash_keep: 8,
            gc_interval_s: 600,
            kept_upper_retention_h: 168,
        }
    }
}

/// Limits of what one session may write to be captured (`[capture]`): an upper
/// over a limit is not published, checkpointed or diffed — its run ends
/// `failed` naming the limit, its upper is kept (raise the limit and publish
/// again, or discard). Capture stops at the entry that passes the limit, so a
/// million-file upper costs a million-and-one `fstatat(2)`, not an index of it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct CaptureConfig {
    /// Most entries (files, directories, links, whiteouts) an upper may hold;
    /// 0 = unlimited (the default).
    pub max_paths: u64,
    /// Most bytes its regular files may hold, by apparent size (a sparse file
    /// counts its full size: capture reads and hashes every byte); 0 =
    /// unlimited (the default).
    pub max_bytes: u64,
}

/// Limits of the gate's three-way text merge (`[merge]`). A file over a limit is
/// not merged: the path conflicts with the limit in its reason, never hangs.
/// (Same defaults as `layerstack_publisher::MergeOptions`; docs/merge-rules.md.)
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MergeConfig {
    /// Largest version of a file (base, session or head) that is merged, in bytes.
    /// Default 1 MiB (1048576).
    pub max_file_bytes: u64,
    /// Most lines a version may have to be merged. Default 10000 (the worst case
    /// takes about 1.5 s in a debug build, 0.08 s in release; docs/merge-rules.md,
    /// "Limits").
    pub max_lines: u64,
    /// Time budget, in milliseconds, for all merges of one publish together (not
    /// per file): the gate lock is held at most this long for merging. Default 2000.
    pub timeout_ms: u64,
    /// The line diff under the merge: `myers` (default; what `git merge-file`
    /// uses) or `histogram` (what `git merge` uses; docs/merge-rules.md).
    pub diff_algorithm: DiffAlgorithm,
}

/// `[merge] diff_algorithm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DiffAlgorithm {
    /// Myers diff, as `git merge-file`.
    #[default]
    Myers,
    /// Histogram diff, as `git merge` (merge-ort).
    Histogram,
}

impl Default for MergeConfig {
    fn default() -> Self {
        Self {
            max_file_bytes: 1024 * 1024,
            max_lines: 10_000,
            timeout_ms: 2000,
            diff_algorithm: DiffAlgorithm::Myers,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            root: PathBuf::from("/var/lib/layerstack"),
            address: PathBuf::from("/run/layerstack/snapshotter.sock"),
            admin_address: PathBuf::from("/run/layerstack/admin.sock"),
            containerd_address: PathBuf::from("/run/containerd/containerd.sock"),
            default_branch: "main".to_string(),
            durability: Durability::Disposable,
            publish_on_task_delete: true,
            publish_workers: 0,
            exclude: ["/tmp/**", "/var/cache/**", "/run/**"]
                .map(String::from)
                .to_vec(),
            merge: MergeConfig::default(),
            capture: CaptureConfig::default(),
            history: HistoryConfig::default(),
            metrics: MetricsConfig::default(),
            log: LogConfig::default(),
            sandbox: SandboxConfig::default(),
            api: ApiConfig::default(),
            registry: RegistryConfig::default(),
        }
    }
}

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {0}")]
    Read(PathBuf, #[source] std::io::Error),
    #[error("invalid config{}", .0.as_ref().map(|p| format!(" in {}", p.display())).unwrap_or_default())]
    Parse(Option<PathBuf>, #[source] toml::de::Error),
    /// Keys that parse but do not go together.
    #[error("invalid config{}: {1}", .0.as_ref().map(|p| format!(" in {}", p.display())).unwrap_or_default())]
    Invalid(Option<PathBuf>, String),
}

impl Config {
    /// Parse a TOML document. Unknown keys are an error (a typo must not be ignored).
    pub fn from_toml(s: &str) -> Result<Self, ConfigError> {
        let c: Self = toml::from_str(s).map_err(|e| ConfigError::Parse(None, e))?;
        c.check().map_err(|m| ConfigError::Invalid(None, m))?;
        Ok(c)
    }

    /// Keys that must go together.
    fn check(&self) -> Result<(), String> {
        let s = &self.sandbox;
        if s.cpu_budget_millis > 0 && s.default_cpu_millis == 0 {
            return Err("[sandbox] cpu_budget_millis needs default_cpu_millis > 0: a sandbox created without a CPU limit would not count against the budget".into());
        }
        if s.memory_budget_bytes > 0 && s.default_memory_bytes == 0 {
            return Err("[sandbox] memory_budget_bytes needs default_memory_bytes > 0: a sandbox created without a memory limit would not count against the budget".into());
        }
        if let Some(m) = &s.id_map {
            m.parse::<layerstack_types::IdMap>()
                .map_err(|e| format!("[sandbox] id_map: {e}"))?;
        }
        self.registry.check()
    }

    /// Read and parse a TOML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let s =
            std::fs::read_to_string(path).map_err(|e| ConfigError::Read(path.to_path_buf(), e))?;
        let c: Self =
            toml::from_str(&s).map_err(|e| ConfigError::Parse(Some(path.to_path_buf()), e))?;
        c.check()
            .map_err(|m| ConfigError::Invalid(Some(path.to_path_buf()), m))?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn shipped_default_parses_to_the_defaults() {
        assert_eq!(Config::from_toml(DEFAULT_TOML).unwrap(), Config::default());
    }

    #[test]
    fn unknown_keys_are_refused_with_their_name() {
        let e = Config::from_toml("roots = \"/x\"").unwrap_err();
        let chain = format!("{e}: {}", std::error::Error::source(&e).unwrap());
        assert!(chain.contains("roots"), "{chain}");
    }

    #[test]
    fn exclude_and_merge_limits_parse() {
        let c = Config::from_toml(
            "exclude = [\"/scratch/**\"]\n[merge]\nmax_file_bytes = 1024\ntimeout_ms = 5\n",
        )
        .unwrap();
        assert_eq!(c.exclude, vec!["/scratch/**".to_string()]);
        assert_eq!(c.merge.max_file_bytes, 1024);
        assert_eq!(c.merge.max_lines, 10_000, "unset keys keep their default");
        assert_eq!(c.merge.timeout_ms, 5);
        assert_eq!(c.merge.diff_algorithm, DiffAlgorithm::Myers);
        let c = Config::from_toml("[merge]\ndiff_algorithm = \"histogram\"\n").unwrap();
        assert_eq!(c.merge.diff_algorithm, DiffAlgorithm::Histogram);
        let e = Config::from_toml("[merge]\ndiff_algorithm = \"patience\"\n").unwrap_err();
        let chain = format!("{e}: {}", std::error::Error::source(&e).unwrap());
        assert!(
            chain.contains("histogram") && chain.contains("myers"),
            "{chain}"
        );
        assert!(
            Config::from_toml("[merge]\nmax_bytes = 1\n").is_err(),
            "typo refused"
        );
        assert_eq!(
            Config::from_toml("exclude = []").unwrap().exclude,
            Vec::<String>::new()
        );
    }

    #[test]
    fn metrics_and_log_sections_parse() {
        let c = Config::from_toml(
            "[metrics]\nenabled = false\naddress = \"[::1]:9999\"\n[log]\nlevel = \"debug\"\nformat = \"json\"\n",
        )
        .unwrap();
        assert!(!c.metrics.enabled);
        assert_eq!(c.metrics.address(), "[::1]:9999".parse().unwrap());
        assert!(
            c.metrics.address.is_some(),
            "given, so a bind failure is an error"
        );
        assert_eq!(c.log.level.as_deref(), Some("debug"));
        assert_eq!(c.log.format, LogFormat::Json);
        let d = Config::default();
        assert!(d.metrics.enabled);
        assert_eq!(d.metrics.address, None);
        assert_eq!(d.metrics.address().to_string(), "127.0.0.1:9464");
        assert_eq!(d.log, LogConfig::default());
        for bad in [
            "[metrics]\naddress = \"localhost\"\n",
            "[log]\nformat = \"xml\"\n",
            "[metrics]\nport = 1\n",
        ] {
            assert!(Config::from_toml(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_id_map_is_parsed_and_checked_at_load() {
        assert_eq!(Config::default().sandbox.id_map(), None);
        let c = Config::from_toml("[sandbox]\nid_map = \"100000:200000:65536\"\n").unwrap();
        assert_eq!(
            c.sandbox.id_map(),
            Some(layerstack_types::IdMap {
                host_uid: 100000,
                host_gid: 200000,
                size: 65536
            })
        );
        let e = Config::from_toml("[sandbox]\nid_map = \"0:0:65536\"\n").unwrap_err();
        assert!(e.to_string().contains("id_map.host_uid 0"), "{e}");
    }

    #[test]
    fn sandbox_defaults_and_mount_socket_beside_the_admin_socket() {
        let c = Config::default();
        assert_eq!(c.sandbox.max_sessions, 256);
        assert_eq!(
            c.mount_address(),
            PathBuf::from("/run/layerstack/mount.sock")
        );
        let c =
            Config::from_toml("admin_address = \"/x/a.sock\"\n[sandbox]\nmax_sessions = 2048\n")
                .unwrap();
        assert_eq!(c.sandbox.max_sessions, 2048);
        assert_eq!(c.mount_address(), PathBuf::from("/x/mount.sock"));
        let c = Config::from_toml(
            "[sandbox]\ncgroup_parent = \"/ls\"\ndefault_cpu_millis = 500\ndefault_memory_bytes = 1073741824\ndefault_pids = 64\n",
        )
        .unwrap();
        assert_eq!(c.sandbox.cgroup_parent.as_deref(), Some("/ls"));
        assert_eq!(
            (
                c.sandbox.default_cpu_millis,
                c.sandbox.default_memory_bytes,
                c.sandbox.default_pids
            ),
            (500, 1 << 30, 64)
        );
        let c = Config::from_toml("[sandbox]\nmount_address = \"/m.sock\"\n").unwrap();
        assert_eq!(c.mount_address(), PathBuf::from("/m.sock"));
        assert!(
            Config::from_toml("[sandbox]\nmax = 1\n").is_err(),
            "typo refused"
        );
    }

    #[test]
    fn api_section_parses_and_tcp_is_off_by_default() {
        let d = Config::default();
        assert!(d.api.allowed_uids.is_empty() && d.api.allowed_gids.is_empty());
        assert_eq!(d.api.tcp, None, "nothing listens on TCP unless configured");
        let c = Config::from_toml(
            "[api]\nallowed_uids = [1000, 65534]\nallowed_gids = [100]\n[api.tcp]\naddress = \"127.0.0.1:7443\"\ncert = \"/c.pem\"\nkey = \"/k.pem\"\ntokens_file = \"/t\"\n",
        )
        .unwrap();
        assert_eq!(c.api.allowed_uids, vec![1000, 65534]);
        assert_eq!(c.api.allowed_gids, vec![100]);
        let t = c.api.tcp.unwrap();
        assert_eq!(t.address.to_string(), "127.0.0.1:7443");
        assert_eq!(t.cert, Some(PathBuf::from("/c.pem")));
        assert_eq!(t.client_ca, None);
        for bad in [
            "[api]\nallowed_users = [1]\n",
            "[api.tcp]\ncert = \"/c\"\n",
            "[api.tcp]\naddress = \"127.0.0.1:1\"\ntoken = \"x\"\n",
        ] {
            assert!(Config::from_toml(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn registry_retry_keys_parse_and_are_checked() {
        let d = Config::default().registry;
        assert_eq!(
            (d.retry_attempts, d.retry_base_ms, d.retry_max_ms),
            (4, 200, 5000)
        );
        let c = Config::from_toml(
            "[registry]\ninsecure = [\"127.0.0.1:5000\"]\nretry_attempts = 8\nretry_base_ms = 100\nretry_max_ms = 30000\n",
        )
        .unwrap();
        assert_eq!(
            (
                c.registry.retry_attempts,
                c.registry.retry_base_ms,
                c.registry.retry_max_ms
            ),
            (8, 100, 30000)
        );
        assert_eq!(c.registry.insecure, vec!["127.0.0.1:5000".to_string()]);
        assert_eq!((d.connect_timeout_ms, d.read_timeout_ms), (15_000, 120_000));
        let c =
            Config::from_toml("[registry]\nconnect_timeout_ms = 2000\nread_timeout_ms = 30000\n")
                .unwrap();
        assert_eq!(
            (c.registry.connect_timeout_ms, c.registry.read_timeout_ms),
            (2000, 30000)
        );
        let c = Config::from_toml("[registry]\nretry_attempts = 1\n").unwrap();
        assert_eq!(
            c.registry.retry_max_ms, 5000,
            "unset keys keep their default"
        );
        for (bad, key) in [
            ("[registry]\nretry_attempts = 0\n", "retry_attempts"),
            ("[registry]\nretry_attempts = 101\n", "retry_attempts"),
            ("[registry]\nretry_max_ms = 600001\n", "retry_max_ms"),
            ("[registry]\nretry_base_ms = 6000\n", "retry_base_ms"),
            ("[registry]\nconnect_timeout_ms = 0\n", "connect_timeout_ms"),
            ("[registry]\nread_timeout_ms = 3600001\n", "read_timeout_ms"),
            (
                "[registry]\nretry_base_ms = 100\nretry_max_ms = 50\n",
                "retry_base_ms",
            ),
            (
                "[registry]\ninsecure = [\"http://127.0.0.1:5000\"]\n",
                "http://127.0.0.1:5000",
            ),
            (
                "[registry]\ninsecure = [\"reg.local/rl\"]\n",
                "reg.local/rl",
            ),
            ("[registry]\ninsecure = [\"\"]\n", "insecure entry"),
        ] {
            let e = Config::from_toml(bad).unwrap_err();
            assert!(e.to_string().contains(key), "{bad}: {e}");
            assert!(e.to_string().contains("[registry]"), "{bad}: {e}");
        }
        let e = Config::from_toml("[registry]\nretries = 3\n").unwrap_err();
        let chain = format!("{e}: {}", std::error::Error::source(&e).unwrap());
        assert!(chain.contains("retries"), "typo refused: {chain}");
    }

    #[test]
    fn a_budget_needs_a_default_limit() {
        let e = Config::from_toml("[sandbox]\ncpu_budget_millis = 4000\n").unwrap_err();
        assert!(e.to_string().contains("default_cpu_millis"), "{e}");
        let e = Config::from_toml("[sandbox]\nmemory_budget_bytes = 1073741824\n").unwrap_err();
        assert!(e.to_string().contains("default_memory_bytes"), "{e}");
        let c = Config::from_toml(
            "[sandbox]\ncpu_budget_millis = 4000\ndefault_cpu_millis = 500\nholder_grace_s = 5\n",
        )
        .unwrap();
        assert_eq!(
            (c.sandbox.cpu_budget_millis, c.sandbox.holder_grace_s),
            (4000, 5)
        );
    }
}
