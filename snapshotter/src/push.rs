//! The admin RPC `Push`: a graph node or a branch head to an OCI registry
//! (issue 23; docs/architecture.md "Push and pull").
//!
//! ```text
//! export lease (engine begin_export: GC keeps every layer listed)
//! per layer, oldest first: the layer's blob (engine write_layer_blob: a
//!   deterministic tar, gzip or zstd) into a staging file, then HEAD in the
//!   registry: present → not sent; missing → one streamed PUT
//! config blob (rootfs.diff_ids, history), then the manifest by tag with the
//!   node's provenance and state in its annotations
//! ```
//!
//! A node's image is a function of the node alone: its config is built from
//! what travels with it (`node_image_config`: stack, node id, creation time,
//! diff IDs — no local layer id, session or layer time) and its annotations
//! from `AdoptNode::of`, whose parents are every parent the node declares,
//! held by this store or not. So a store that pulled a node (before its
//! parents, even) pushes it with the same manifest digest as the store that
//! made it, and the graph spread over stores stays one graph. A branch
//! head's config keeps this store's layer history, as `export` writes it.
//!
//! The blobs are the same bytes an `export` of the same layers writes, so a
//! node pushed after one more layer than an earlier push sends that layer's
//! blob and the config only. The registry's client lives in
//! `layerstack_registry`; credentials come with the request, else from the
//! daemon's `[registry] docker_config`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use layerstack_api as api;
use layerstack_engine::store::AdoptNode;
use layerstack_engine::Compression;
use layerstack_registry::image::{canonical_json, config_layer, image_config, node_image_config};
use layerstack_registry::{
    credentials_from_docker_config, parse_reference, BlobPush, Credentials, Reference,
    RegistryClient, RegistryError, RegistryOptions,
};
use serde_json::json;
use tonic::Status;
use tracing::info;

use crate::admin::{engine_status, AdminService};

/// Annotation keys of a pushed image's manifest (the node's identity,
/// provenance and state: everything a pull needs to rebuild the node).
pub mod annotations {
    /// The graph node's id.
    pub const NODE: &str = "io.layerstack.node";
    /// The node's graph (group) name.
    pub const GRAPH: &str = "io.layerstack.graph";
    /// The branch the graph's root was taken from.
    pub const GRAPH_BRANCH: &str = "io.layerstack.graph.branch";
    /// The graph's root node.
    pub const GRAPH_ROOT: &str = "io.layerstack.graph.root";
    /// The stack id the image's layers are of.
    pub const STACK: &str = "io.layerstack.stack";
    /// The stack's base digest (its base image's top chainID).
    pub const BASE_DIGEST: &str = "io.layerstack.base-digest";
    /// How many of the manifest's layers are the base's.
    pub const BASE_LAYERS: &str = "io.layerstack.base-layers";
    /// The node's kind (root, checkpoint, merge).
    pub const KIND: &str = "io.layerstack.node.kind";
    /// The node's parents, comma-separated, oldest first.
    pub const PARENTS: &str = "io.layerstack.node.parents";
    /// The node's logical state (JSON).
    pub const STATE: &str = "io.layerstack.node.state";
    /// The command that made it (provenance).
    pub const COMMAND: &str = "io.layerstack.node.command";
    /// Its exit status (provenance).
    pub const EXIT_STATUS: &str = "io.layerstack.node.exit-status";
    /// Its free-form labels (JSON object).
    pub const LABELS: &str = "io.layerstack.node.labels";
    /// When it was made, ns since the epoch.
    pub const CREATED_NS: &str = "io.layerstack.node.created-ns";
    /// Bytes its own layers hold that its parent's do not (provenance, as the
    /// store that made it measured them; absent when unknown).
    pub const PRIVATE_BYTES: &str = "io.layerstack.node.private-bytes";
    /// The branch of a pushed branch head.
    pub const BRANCH: &str = "io.layerstack.branch";

    use std::collections::BTreeMap;

    use layerstack_engine::store::{AdoptGroup, AdoptNode, NodeKind, Provenance};

    /// Writes `node` (what a store holds of it: `AdoptNode::of`) into a
    /// manifest's annotations; [`decode`] reads it back.
    pub fn encode(node: &AdoptNode, out: &mut BTreeMap<String, String>) {
        let mut put = |k: &str, v: String| {
            out.insert(k.to_string(), v);
        };
        put(NODE, node.id.clone());
        put(GRAPH, node.group.name.clone());
        if let Some(b) = &node.group.branch {
            put(GRAPH_BRANCH, b.clone());
        }
        if let Some(r) = &node.group.root {
            put(GRAPH_ROOT, r.clone());
        }
        put(KIND, node.kind.as_str().to_string());
        put(PARENTS, node.parents.join(","));
        put(STATE, node.state.clone());
        put(CREATED_NS, node.created_ns.to_string());
        let p = &node.provenance;
        if let Some(c) = &p.command {
            put(COMMAND, c.clone());
        }
        if let Some(x) = p.exit_status {
            put(EXIT_STATUS, x.to_string());
        }
        if let Some(b) = p.private_bytes {
            put(PRIVATE_BYTES, b.to_string());
        }
        if !p.labels.is_empty() {
            put(LABELS, serde_json::to_string(&p.labels).unwrap_or_default());
        }
    }

    /// The node [`encode`] wrote into `a`, or what is missing or malformed
    /// (named by its annotation key).
    pub fn decode(a: &BTreeMap<String, String>) -> Result<AdoptNode, String> {
        let get = |k: &str| a.get(k).cloned().filter(|v| !v.is_empty());
        let id = get(NODE).ok_or_else(|| format!("its manifest has no {NODE} annotation"))?;
        let name = get(GRAPH).ok_or_else(|| format!("its manifest has no {GRAPH} annotation"))?;
        let kind = NodeKind::parse(&get(KIND).unwrap_or_default())
            .ok_or_else(|| format!("{KIND} is not root, checkpoint or merge"))?;
        let labels = match get(LABELS) {
            Some(s) => serde_json::from_str(&s).map_err(|e| format!("{LABELS}: {e}"))?,
            None => BTreeMap::new(),
        };
        let exit_status = match get(EXIT_STATUS) {
            Some(x) => Some(
                x.parse()
                    .map_err(|_| format!("{EXIT_STATUS} {x:?} is not a number"))?,
            ),
            None => None,
        };
        let private_bytes = match get(PRIVATE_BYTES) {
            Some(x) => Some(
                x.parse()
                    .map_err(|_| format!("{PRIVATE_BYTES} {x:?} is not a number"))?,
            ),
            None => None,
        };
        let created_ns = match get(CREATED_NS) {
            Some(x) => x
                .parse()
                .map_err(|_| format!("{CREATED_NS} {x:?} is not a number"))?,
            None => 0,
        };
        Ok(AdoptNode {
            id,
            group: AdoptGroup {
                name,
                branch: get(GRAPH_BRANCH),
                root: get(GRAPH_ROOT),
            },
            kind,
            state: get(STATE).unwrap_or_else(|| "{}".into()),
            parents: get(PARENTS)
                .map(|p| {
                    p.split(',')
                        .filter(|p| !p.is_empty())
                        .map(String::from)
                        .collect()
                })
                .unwrap_or_default(),
            provenance: Provenance {
                command: get(COMMAND),
                labels,
                exit_status,
                private_bytes,
            },
            created_ns,
        })
    }
}

/// The daemon's registry client and where its own credentials are.
pub struct Registries {
    client: RegistryClient,
    docker_config: Option<PathBuf>,
}

impl Registries {
    /// From `[registry]`. Errors: a CA file that cannot be read or parsed, a
    /// retry key out of range (the config crate checks those first).
    pub fn new(cfg: &layerstack_config::RegistryConfig) -> Result<Self, RegistryError> {
        Ok(Self {
            client: RegistryClient::new(RegistryOptions {
                insecure: cfg.insecure.clone(),
                ca_files: cfg.ca_files.clone(),
                retry_attempts: cfg.retry_attempts,
                retry_base_ms: cfg.retry_base_ms,
                retry_max_ms: cfg.retry_max_ms,
                connect_timeout_ms: cfg.connect_timeout_ms,
                read_timeout_ms: cfg.read_timeout_ms,
            })?,
            docker_config: cfg.docker_config.clone(),
        })
    }

    /// The client.
    pub fn client(&self) -> &RegistryClient {
        &self.client
    }

    /// The credentials of a request for `r`: the request's, else the daemon's
    /// docker config's entry for `r`'s registry, else anonymous.
    pub fn credentials(
        &self,
        auth: Option<&api::RegistryAuth>,
        r: &Reference,
    ) -> Result<Credentials, Status> {
        if let Some(a) = auth {
            if !a.token.is_empty() {
                return Ok(Credentials::Bearer(a.token.clone()));
            }
            if !a.username.is_empty() {
                return Ok(Credentials::Basic {
                    username: a.username.clone(),
                    password: a.password.clone(),
                });
            }
        }
        match &self.docker_config {
            Some(p) => {
                credentials_from_docker_config(p, r.registry()).map_err(|e| registry_status(&e))
            }
            None => Ok(Credentials::Anonymous),
        }
    }
}

/// Where the credentials of a request for `registry` come from, in words
/// (never the secret itself).
fn credential_source(
    regs: &Registries,
    auth: Option<&api::RegistryAuth>,
    registry: &str,
) -> String {
    match auth {
        Some(a) if !a.token.is_empty() => "a bearer token from the request".into(),
        Some(a) if !a.username.is_empty() => {
            format!("user {:?} with a password, from the request", a.username)
        }
        _ => match &regs.docker_config {
            Some(p) => format!(
                "the daemon's [registry] docker_config {} (its entry for {registry}; none there: anonymous)",
                p.display()
            ),
            None => "none: the request carried none and the daemon has no [registry] docker_config".into(),
        },
    }
}

/// A `permission_denied` answer of Push or Pull with where its credentials
/// came from appended (the kind and its trailer kept); any other unchanged.
pub(crate) fn with_credential_source(
    admin: &AdminService,
    st: Status,
    auth: Option<&api::RegistryAuth>,
    reference: &str,
) -> Status {
    if st.code() != tonic::Code::PermissionDenied {
        return st;
    }
    let (Ok(regs), Ok(r)) = (registries(admin), parse_reference(reference)) else {
        return st;
    };
    let msg = format!(
        "{}; credentials tried: {}",
        st.message(),
        credential_source(&regs, auth, r.registry())
    );
    Status::with_metadata(st.code(), msg, st.metadata().clone())
}

/// A registry error as a status of its kind.
pub(crate) fn registry_status(e: &RegistryError) -> Status {
    api::status(e.kind(), e.to_string())
}

/// The registry client of `admin`, or why there is none.
pub(crate) fn registries(admin: &AdminService) -> Result<Arc<Registries>, Status> {
    match &admin.registries {
        Some(Ok(r)) => Ok(r.clone()),
        Some(Err(why)) => Err(Status::failed_precondition(format!(
            "this daemon has no registry client: {why}; fix [registry] in its configuration and restart it"
        ))),
        None => Err(Status::failed_precondition(
            "this daemon has no registry client (not configured at its start)",
        )),
    }
}

/// The reference of a push: parsed, with a tag and no digest.
pub(crate) fn push_reference(s: &str) -> Result<Reference, Status> {
    let r = parse_reference(s).map_err(|e| registry_status(&e))?;
    if r.digest().is_some() {
        return Err(Status::invalid_argument(format!(
            "reference {s:?} names a digest: a push names a tag (REGISTRY/REPOSITORY:TAG); the answer carries the manifest's digest"
        )));
    }
    Ok(r)
}

impl AdminService {
    pub(crate) async fn push(&self, r: api::PushRequest) -> Result<api::PushResponse, Status> {
        let compression = crate::export::compression_of(&r.compression)?;
        let reference = push_reference(&r.reference)?;
        let regs = registries(self)?;
        let creds = regs.credentials(r.auth.as_ref(), &reference)?;
        let source = self
            .export_source(&r.node, &r.namespace, &r.stack, &r.branch)
            .await?;
        let node = if r.node.is_empty() {
            None
        } else {
            let n = self.engine.node(&r.node).await.map_err(engine_status)?;
            let g = self
                .engine
                .node_group(&r.node)
                .await
                .map_err(engine_status)?;
            Some(AdoptNode::of(&n, &g))
        };
        let engine = self.engine.clone();
        let holder = format!("push {}", reference.whole());
        let (export, staging, guard) = tokio::task::spawn_blocking(move || {
            let export = engine.begin_export(&source, &holder)?;
            let (dir, guard) = engine.staging_dir("push")?;
            Ok::<_, layerstack_engine::EngineError>((export, dir, guard))
        })
        .await
        .map_err(|e| Status::internal(format!("push task failed: {e}")))?
        .map_err(engine_status)?;
        let export = Arc::new(export);
        let result = self
            .push_layers(
                &regs,
                &reference,
                &creds,
                &export,
                &staging,
                compression,
                node.as_ref(),
            )
            .await;
        // The lease and the staging directory go whatever happened.
        tokio::task::spawn_blocking(move || {
            let _ = std::fs::remove_dir_all(&staging);
            drop(guard);
            drop(export);
        });
        result
    }

    #[allow(clippy::too_many_arguments)]
    async fn push_layers(
        &self,
        regs: &Registries,
        reference: &Reference,
        creds: &Credentials,
        export: &Arc<layerstack_engine::Export>,
        staging: &std::path::Path,
        compression: Compression,
        node: Option<&AdoptNode>,
    ) -> Result<api::PushResponse, Status> {
        let lease = export.lease().clone();
        let mut descriptors = Vec::new();
        let mut diff_ids = Vec::new();
        let (mut sent, mut present, mut bytes_sent) = (0u32, 0u32, 0u64);
        let mut packed = 0u32;
        for i in 0..lease.layers.len() {
            // A blob an earlier export, push or pull recorded for the layer:
            // when the registry has it, nothing is read or compressed.
            let ex = export.clone();
            let recorded = tokio::task::spawn_blocking(move || ex.recorded_blob(i, compression))
                .await
                .map_err(|e| Status::internal(format!("push task failed: {e}")))?
                .map_err(engine_status)?;
            let asked = match &recorded {
                Some(b) => Some(
                    regs.client()
                        .blob_exists(reference, creds, &b.digest)
                        .await
                        .map_err(|e| registry_status(&e))?,
                ),
                None => None,
            };
            let (digest, size, diff_id) = match (recorded, asked) {
                (Some(b), Some(true)) => {
                    present += 1;
                    (b.digest, b.size, b.diff_id)
                }
                (recorded, _) => {
                    packed += 1;
                    let path = staging.join(format!("layer-{i}"));
                    let (ex, p) = (export.clone(), path.clone());
                    let blob = tokio::task::spawn_blocking(move || {
                        let f = std::fs::File::create(&p).map_err(|e| {
                            Status::internal(format!("cannot create {}: {e}", p.display()))
                        })?;
                        ex.write_layer(i, compression, std::io::BufWriter::new(f))
                            .map_err(engine_status)
                    })
                    .await
                    .map_err(|e| Status::internal(format!("layer blob task failed: {e}")))??;
                    // Asked already when its blob was recorded (the same
                    // bytes: the tar is deterministic): the registry lacks it.
                    let sent_now = if recorded.as_ref().is_some_and(|r| r.digest == blob.digest) {
                        regs.client()
                            .upload_blob_file(reference, creds, &path, &blob.digest, blob.size)
                            .await
                            .map(|()| BlobPush::Uploaded)
                    } else {
                        regs.client()
                            .push_blob_file(reference, creds, &path, &blob.digest, blob.size)
                            .await
                    }
                    .map_err(|e| registry_status(&e))?;
                    match sent_now {
                        BlobPush::Uploaded => {
                            sent += 1;
                            bytes_sent += blob.size;
                        }
                        BlobPush::AlreadyPresent => present += 1,
                    }
                    let _ = tokio::fs::remove_file(&path).await;
                    (blob.digest, blob.size, blob.diff_id)
                }
            };
            descriptors.push(json!({
                "mediaType": compression.media_type(),
                "digest": digest,
                "size": size,
            }));
            diff_ids.push(diff_id);
        }
        // A node's config from what travels with it only (the same from
        // every store that holds it); a branch head's from this store's
        // layers, as `export` writes it.
        let cfg = match node {
            Some(n) => node_image_config(
                &lease.stack,
                &n.id,
                n.created_ns,
                lease.base_layers,
                diff_ids.clone(),
            ),
            None => {
                let layers: Vec<_> = lease
                    .layers
                    .iter()
                    .map(|l| {
                        config_layer(l.kind.as_str(), l.id, l.session.unwrap_or(0), l.created_ns)
                    })
                    .collect();
                image_config(None, &lease.stack, &layers, diff_ids.clone())
            }
        }
        .map_err(|e| Status::internal(e.to_string()))?;
        let cfg_bytes = canonical_json(&cfg).map_err(|e| Status::internal(e.to_string()))?;
        let cfg_digest = layerstack_registry::sha256_digest(&cfg_bytes);
        let cfg_path = staging.join("config.json");
        tokio::fs::write(&cfg_path, &cfg_bytes)
            .await
            .map_err(|e| Status::internal(format!("cannot write {}: {e}", cfg_path.display())))?;
        match regs
            .client()
            .push_blob_file(
                reference,
                creds,
                &cfg_path,
                &cfg_digest,
                cfg_bytes.len() as u64,
            )
            .await
            .map_err(|e| registry_status(&e))?
        {
            BlobPush::Uploaded => {
                sent += 1;
                bytes_sent += cfg_bytes.len() as u64;
            }
            BlobPush::AlreadyPresent => present += 1,
        }
        let mut ann: BTreeMap<String, String> = BTreeMap::new();
        ann.insert(annotations::STACK.into(), lease.stack.clone());
        ann.insert(annotations::BASE_DIGEST.into(), lease.base_digest.clone());
        ann.insert(
            annotations::BASE_LAYERS.into(),
            lease.base_layers.to_string(),
        );
        match node {
            Some(n) => annotations::encode(n, &mut ann),
            None => {
                ann.insert(annotations::BRANCH.into(), lease.branch.clone());
            }
        }
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": cfg_digest,
                "size": cfg_bytes.len(),
            },
            "layers": descriptors,
            "annotations": ann,
        });
        let body = serde_json::to_vec(&manifest)
            .map_err(|e| Status::internal(format!("serializing the manifest: {e}")))?;
        let digest = regs
            .client()
            .push_manifest(
                reference,
                creds,
                "application/vnd.oci.image.manifest.v1+json",
                &body,
            )
            .await
            .map_err(|e| registry_status(&e))?;
        info!(
            reference = %reference.whole(),
            manifest = %digest,
            node = node.map(|n| n.id.as_str()).unwrap_or(""),
            layers = lease.layers.len(),
            blobs_sent = sent,
            blobs_present = present,
            layers_packed = packed,
            bytes_sent,
            "pushed"
        );
        Ok(api::PushResponse {
            reference: reference.whole(),
            manifest_digest: digest,
            node: node.map(|n| n.id.clone()).unwrap_or_default(),
            stack: lease.stack.clone(),
            layers: lease.layers.len() as u32,
            blobs_sent: sent,
            blobs_present: present,
            bytes_sent,
            diff_ids,
            layers_packed: packed,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::collections::BTreeMap;

    use layerstack_engine::store::{AdoptGroup, AdoptNode, NodeKind, Provenance};

    use super::annotations::{self, decode, encode};

    fn node() -> AdoptNode {
        AdoptNode {
            id: "n0123456789abcdef".into(),
            group: AdoptGroup {
                name: "g".into(),
                branch: Some("main".into()),
                root: Some("nroot".into()),
            },
            kind: NodeKind::Checkpoint,
            state: r#"{"reward":0.5}"#.into(),
            parents: vec!["na".into(), "nb".into()],
            provenance: Provenance {
                command: Some("make test".into()),
                labels: [("evaluator".to_string(), "unit".to_string())].into(),
                exit_status: Some(3),
                private_bytes: Some(4096),
            },
            created_ns: 42,
        }
    }

    #[test]
    fn a_node_round_trips_through_its_annotations() {
        let mut a = BTreeMap::new();
        encode(&node(), &mut a);
        assert_eq!(decode(&a).unwrap(), node());
        // Optional parts absent: a root with no provenance.
        let mut bare = node();
        bare.kind = NodeKind::Root;
        bare.parents.clear();
        bare.group.branch = None;
        bare.group.root = None;
        bare.provenance = Provenance::default();
        let mut a = BTreeMap::new();
        encode(&bare, &mut a);
        assert_eq!(decode(&a).unwrap(), bare);
    }

    #[test]
    fn a_missing_or_malformed_annotation_is_named() {
        for (key, value) in [
            (annotations::NODE, None),
            (annotations::GRAPH, None),
            (annotations::KIND, Some("leaf")),
            (annotations::EXIT_STATUS, Some("x")),
            (annotations::LABELS, Some("[1]")),
            (annotations::PRIVATE_BYTES, Some("-1")),
        ] {
            let mut a = BTreeMap::new();
            encode(&node(), &mut a);
            match value {
                Some(v) => a.insert(key.to_string(), v.to_string()),
                None => a.remove(key),
            };
            let why = decode(&a).unwrap_err();
            assert!(why.contains(key), "{key}: {why}");
        }
    }
}
