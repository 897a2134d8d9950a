//! OCI image assembly shared by `layerstack export` (the CLI writes an image
//! layout) and the daemon's push (it writes to a registry): the image config
//! of an exported stack (OCI image-spec `config.md`), the config of a pushed
//! graph node (from what travels with the node only:
//! [`node_image_config`]), their canonical bytes, and the platform of this
//! machine.

use oci_spec::image as oci;

/// A layer as the image config's history describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigLayer {
    /// `base`, `published`, `squashed`, `committed`.
    pub kind: String,
    /// The store's layer id.
    pub layer: i64,
    /// The session that published it (0: none).
    pub session: i64,
    /// When it was made, ns since the epoch.
    pub created_ns: i64,
}

/// A [`ConfigLayer`] from its fields.
pub fn config_layer(kind: &str, layer: i64, session: i64, created_ns: i64) -> ConfigLayer {
    ConfigLayer {
        kind: kind.to_string(),
        layer,
        session,
        created_ns,
    }
}

/// An image that cannot be assembled (a builder refused a value, diff IDs
/// that do not match the layers): a bug of the caller, named.
#[derive(Debug, thiserror::Error)]
#[error("cannot assemble the image: {0}")]
pub struct ImageError(pub String);

/// The GOARCH name of this machine (what containerd's platform matcher compares).
pub fn arch() -> oci::Arch {
    match std::env::consts::ARCH {
        "x86_64" => oci::Arch::Amd64,
        "aarch64" => oci::Arch::ARM64,
        "x86" => oci::Arch::i386,
        "arm" => oci::Arch::ARM,
        "powerpc64" => oci::Arch::PowerPC64le,
        "s390x" => oci::Arch::s390x,
        "riscv64" => oci::Arch::RISCV64,
        other => oci::Arch::Other(other.to_string()),
    }
}

/// `ns` since the epoch as RFC 3339 UTC (`2026-12-01T19:43:57Z`).
pub use layerstack_types::time::rfc3339;

/// `PATH` as containerd's and Docker's defaults set it: the only runtime config
/// of an exported image whose base image containerd no longer has.
pub const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The exported image's config (OCI image-spec `config.md`).
///
/// - `rootfs.diff_ids`: `diff_ids`, one per layer of `layers`, oldest first.
/// - `history`: one entry per layer; for the base layers (`kind` base) the base
///   image's own entries instead — its `empty_layer` ones (`ENV`, `CMD`…)
///   included — when its non-empty entries are one per base layer.
/// - `config` (the runtime config: `Env`, `Entrypoint`, `Cmd`, `WorkingDir`,
///   `User`, `ExposedPorts`, `Volumes`, `Labels`, `StopSignal`),
///   `architecture`, `os`, `os.version`, `os.features`, `variant`: the base
///   image's; without `base`, this machine's architecture, `linux`, and a
///   config of `Env` [`DEFAULT_PATH`] only.
/// - `created`: the newest layer's time (RFC 3339 UTC); `author` is not set
///   (the base's author did not make this image).
///
/// Fields oci-spec does not model (Docker's `Healthcheck`, `OnBuild`, `Shell`,
/// `ArgsEscaped`) are not carried over.
///
/// # Errors
/// When `diff_ids` and `layers` differ in length, or a builder refuses a value.
pub fn image_config(
    base: Option<&oci::ImageConfiguration>,
    stack: &str,
    layers: &[ConfigLayer],
    diff_ids: Vec<String>,
) -> Result<oci::ImageConfiguration, ImageError> {
    if diff_ids.len() != layers.len() {
        return Err(ImageError(format!(
            "{} diff IDs for {} layers",
            diff_ids.len(),
            layers.len()
        )));
    }
    let n_base = layers.iter().filter(|l| l.kind == "base").count();
    let base_history = base.and_then(|b| b.history().as_ref()).filter(|h| {
        h.iter()
            .filter(|e| !e.empty_layer().unwrap_or(false))
            .count()
            == n_base
    });
    let mut history = Vec::with_capacity(layers.len());
    if let Some(h) = base_history {
        history.extend(h.iter().cloned());
    }
    for l in layers {
        let by = match l.kind.as_str() {
            "base" if base_history.is_some() => continue,
            "base" => format!("layerstack: base layer {} of stack {stack}", l.layer),
            "published" => format!(
                "layerstack: layer {} published by session {}",
                l.layer, l.session
            ),
            _ => format!("layerstack: layer {} ({})", l.layer, l.kind),
        };
        history.push(
            oci::HistoryBuilder::default()
                .created(rfc3339(l.created_ns))
                .created_by(by)
                .build()
                .map_err(|e| ImageError(format!("building a history entry: {e}")))?,
        );
    }
    let created = layers.iter().map(|l| l.created_ns).max();
    assemble(base, history, diff_ids, created)
}

/// The image config of a pushed graph node (`layerstack push --node`): built
/// only from what travels with the node — its stack id, its id, its
/// creation time, its base layer count and its layers' diff IDs — so every
/// store that holds the node (the one that made it, or one that pulled it,
/// whatever its own layer ids, sessions and times) pushes the same bytes,
/// and a re-push of a pulled node has the original push's manifest digest.
///
/// - `rootfs.diff_ids`: `diff_ids`, oldest first; the first `base_layers`
///   are the stack's base.
/// - `history`: one entry per layer, `created_by` only —
///   `layerstack: base layer <i> of stack <stack>` for the base layers,
///   `layerstack: layer <i> above the base of node <node>` for the others
///   (`i` from 1); no per-layer `created` (a layer's time is local to the
///   store that made it).
/// - `created`: the node's creation time (RFC 3339 UTC).
/// - `architecture`, `os`, `config`: this machine's architecture, `linux`,
///   `Env` [`DEFAULT_PATH`] only (as [`image_config`] without a base).
///
/// # Errors
/// When `base_layers` exceeds the layers, or a builder refuses a value.
pub fn node_image_config(
    stack: &str,
    node: &str,
    created_ns: i64,
    base_layers: usize,
    diff_ids: Vec<String>,
) -> Result<oci::ImageConfiguration, ImageError> {
    if base_layers > diff_ids.len() {
        return Err(ImageError(format!(
            "{base_layers} base layers of {} layers",
            diff_ids.len()
        )));
    }
    let history = (0..diff_ids.len())
        .map(|i| {
            let by = if i < base_layers {
                format!("layerstack: base layer {} of stack {stack}", i + 1)
            } else {
                format!(
                    "layerstack: layer {} above the base of node {node}",
                    i - base_layers + 1
                )
            };
            oci::HistoryBuilder::default()
                .created_by(by)
                .build()
                .map_err(|e| ImageError(format!("building a history entry: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    assemble(None, history, diff_ids, Some(created_ns))
}

/// The config of `base` (or this machine's default) with `history`, the
/// rootfs of `diff_ids` and `created` (ns since the epoch).
fn assemble(
    base: Option<&oci::ImageConfiguration>,
    history: Vec<oci::History>,
    diff_ids: Vec<String>,
    created: Option<i64>,
) -> Result<oci::ImageConfiguration, ImageError> {
    let rootfs = oci::RootFsBuilder::default()
        .typ("layers")
        .diff_ids(diff_ids)
        .build()
        .map_err(|e| ImageError(format!("building rootfs: {e}")))?;
    let mut cfg = match base {
        Some(b) => {
            let mut c = oci::ImageConfiguration::default();
            c.set_architecture(b.architecture().clone());
            c.set_os(b.os().clone());
            c.set_os_version(b.os_version().clone());
            c.set_os_features(b.os_features().clone());
            c.set_variant(b.variant().clone());
            c.set_config(b.config().clone());
            c
        }
        None => oci::ImageConfigurationBuilder::default()
            .architecture(arch())
            .os(oci::Os::Linux)
            .config(
                oci::ConfigBuilder::default()
                    .env(vec![DEFAULT_PATH.to_string()])
                    .build()
                    .map_err(|e| ImageError(format!("building the config: {e}")))?,
            )
            .build()
            .map_err(|e| ImageError(format!("building the image config: {e}")))?,
    };
    cfg.set_rootfs(rootfs);
    cfg.set_history(Some(history));
    cfg.set_created(created.map(rfc3339));
    Ok(cfg)
}

/// `value` as JSON with every object's keys sorted: oci-spec keeps
/// `ExposedPorts`, `Volumes` and `Labels` in hash maps, whose order changes from
/// run to run, and a config's digest must not.
pub fn canonical_json(value: &oci::ImageConfiguration) -> Result<Vec<u8>, ImageError> {
    // serde_json's `Value` keeps object keys in a BTreeMap (no `preserve_order`).
    let v: serde_json::Value =
        serde_json::to_value(value).map_err(|e| ImageError(format!("serializing: {e}")))?;
    serde_json::to_vec(&v).map_err(|e| ImageError(format!("serializing: {e}")))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A node's config is a function of the node alone: the same arguments,
    /// the same bytes; another node id or creation time, other bytes.
    #[test]
    fn a_node_config_depends_only_on_what_travels_with_the_node() {
        let d = |c: char| format!("sha256:{}", c.to_string().repeat(64));
        let make = |node: &str, created: i64| {
            let c = node_image_config("import:x", node, created, 1, vec![d('a'), d('b'), d('c')])
                .unwrap();
            canonical_json(&c).unwrap()
        };
        // (`created` is RFC 3339 in whole seconds.)
        let (t, later) = (5_000_000_000, 6_000_000_000);
        assert_eq!(make("n1", t), make("n1", t));
        assert_ne!(make("n1", t), make("n2", t));
        assert_ne!(make("n1", t), make("n1", later));
        let c = node_image_config("import:x", "n1", 0, 1, vec![d('a'), d('b')]).unwrap();
        let h: Vec<_> = c
            .history()
            .as_ref()
            .unwrap()
            .iter()
            .map(|e| (e.created_by().clone().unwrap(), e.created().clone()))
            .collect();
        assert_eq!(
            h,
            vec![
                (
                    "layerstack: base layer 1 of stack import:x".to_string(),
                    None
                ),
                (
                    "layerstack: layer 1 above the base of node n1".to_string(),
                    None
                ),
            ]
        );
        assert_eq!(c.created().as_deref(), Some("1970-01-01T00:00:00Z"));
        assert_eq!(c.rootfs().diff_ids(), &vec![d('a'), d('b')]);
        assert!(node_image_config("s", "n", 0, 3, vec![d('a')]).is_err());
    }

    #[test]
    fn rfc3339_times() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_796_154_237_000_000_000), "2026-12-01T19:43:57Z");
    }
}
