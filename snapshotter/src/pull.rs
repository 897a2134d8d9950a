//! The admin RPC `Pull`: a node another daemon pushed (`crate::push`) becomes
//! a node of this store, with its id, state and provenance (issue 23;
//! docs/architecture.md "Push and pull").
//!
//! ```text
//! manifest (by tag or digest) → its io.layerstack.* annotations: node, graph,
//!   stack, base layers, kind, parents, state, provenance
//! config blob → rootfs.diff_ids (one per layer)
//! stack missing: an imported base (import:<diff ID of its one layer>) is
//!   imported from the base layer's blob; another is refused, named
//! held layers (engine held_layers: same diff ID on this stack) → not fetched
//! the other blobs → staging files (digest and size checked while written)
//! engine adopt_pulled_node: applied in overlay format, diff ID checked, index
//!   captured, then one transaction adopting the node (store adopt_node)
//! ```

use std::collections::BTreeMap;

use layerstack_api as api;
use layerstack_engine::publisher::ImportKind;
use layerstack_engine::store::{AdoptNode, BlobCompression, BlobRef};
use layerstack_engine::{ImportRequest, Landed, Promoted, PulledContent, PulledLayer};
use layerstack_registry::parse_reference;
use serde_json::Value;
use tonic::Status;
use tracing::info;

use crate::admin::{engine_status, AdminService};
use crate::push::{annotations as ann, registries, registry_status};

/// Largest image config a pull reads (bytes).
const MAX_CONFIG_BYTES: u64 = 4 << 20;

/// A layer descriptor of a pulled manifest.
struct Descriptor {
    media_type: String,
    digest: String,
    size: u64,
}

fn bad_image(reference: &str, why: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!(
        "{reference} is not an image `layerstack push` made: {why}"
    ))
}

/// A name for a pull's working branch and operation, unique in this daemon.
fn pull_operation() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    format!(
        "pull-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

/// The compression a layer media type names (OCI's and docker's), or `None`
/// for one this store does not write (its blob is then not recorded).
fn compression_of(media_type: &str) -> Option<BlobCompression> {
    if media_type.ends_with("+zstd") {
        Some(BlobCompression::Zstd)
    } else if media_type.ends_with("+gzip") || media_type.ends_with(".tar.gzip") {
        Some(BlobCompression::Gzip)
    } else if media_type.ends_with(".tar") {
        Some(BlobCompression::None)
    } else {
        None
    }
}

fn descriptors(reference: &str, v: &Value) -> Result<Vec<Descriptor>, Status> {
    let layers = v["layers"]
        .as_array()
        .ok_or_else(|| bad_image(reference, "its manifest has no layers"))?;
    layers
        .iter()
        .map(|l| {
            Ok(Descriptor {
                media_type: l["mediaType"].as_str().unwrap_or_default().to_string(),
                digest: l["digest"]
                    .as_str()
                    .ok_or_else(|| bad_image(reference, "a layer without a digest"))?
                    .to_string(),
                size: l["size"]
                    .as_u64()
                    .ok_or_else(|| bad_image(reference, "a layer without a size"))?,
            })
        })
        .collect()
}

impl AdminService {
    /// For each of `above` (diff IDs above the base), the layer of `stack`
    /// this store holds with that tar; `None` when the stack is not here.
    async fn held(
        &self,
        stack: &str,
        above: &[String],
    ) -> Result<Option<Vec<Option<layerstack_engine::store::LayerId>>>, Status> {
        let engine = self.engine.clone();
        let (st, ab) = (stack.to_string(), above.to_vec());
        match tokio::task::spawn_blocking(move || engine.held_layers(&st, &ab))
            .await
            .map_err(|e| Status::internal(format!("pull task failed: {e}")))?
        {
            Ok(h) => Ok(Some(h)),
            Err(layerstack_engine::EngineError::Store(
                layerstack_engine::store::StoreError::StackNotFound(_),
            )) => Ok(None),
            Err(e) => Err(engine_status(e)),
        }
    }

    pub(crate) async fn pull(&self, r: api::PullRequest) -> Result<api::PullResponse, Status> {
        let reference = parse_reference(&r.reference).map_err(|e| registry_status(&e))?;
        let whole = reference.whole();
        let regs = registries(self)?;
        let creds = regs.credentials(r.auth.as_ref(), &reference)?;
        let client = regs.client();
        let m = client
            .pull_manifest(&reference, &creds)
            .await
            .map_err(|e| registry_status(&e))?;
        let v: Value = serde_json::from_slice(&m.body)
            .map_err(|e| bad_image(&whole, format!("its manifest is not JSON ({e})")))?;
        if v.get("manifests").is_some() {
            return Err(bad_image(&whole, "it is an index, not an image manifest"));
        }
        let a: BTreeMap<String, String> = v["annotations"]
            .as_object()
            .map(|o| {
                o.iter()
                    .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_string())))
                    .collect()
            })
            .unwrap_or_default();
        // A node's image (`push --node`), or a branch head's (`push --stack`:
        // a branch annotation and no node).
        let head_of = a
            .get(ann::BRANCH)
            .filter(|b| !b.is_empty() && !a.contains_key(ann::NODE))
            .cloned();
        let node = match &head_of {
            Some(b) => {
                if !r.graph.is_empty() {
                    return Err(Status::invalid_argument(format!(
                        "{whole} is the head of branch {b}, not a node: it joins no graph, so a graph ({:?}) cannot be given; it lands on a branch (its own, {b}, unless one is named)",
                        r.graph
                    )));
                }
                None
            }
            None => {
                let mut node = ann::decode(&a).map_err(|why| {
                    bad_image(
                        &whole,
                        format!("{why} (nor an {} annotation of a branch head)", ann::BRANCH),
                    )
                })?;
                if !r.graph.is_empty() {
                    node.group.name = r.graph.clone();
                }
                Some(node)
            }
        };
        let branch = match (&r.branch, &head_of) {
            (b, _) if !b.is_empty() => Some(b.clone()),
            (_, Some(b)) => Some(b.clone()),
            _ => None,
        };
        if let Some(b) = &branch {
            layerstack_engine::store::validate_branch(b).map_err(|why| {
                let from = if r.branch.is_empty() {
                    format!(
                        " (the branch the image names, its {} annotation: name another branch to land it on)",
                        ann::BRANCH
                    )
                } else {
                    String::new()
                };
                Status::invalid_argument(format!(
                    "cannot pull {whole} onto branch {b:?}{from}: {why}"
                ))
            })?;
        }
        let stack = a.get(ann::STACK).cloned().unwrap_or_default();
        let base_layers: usize = a
            .get(ann::BASE_LAYERS)
            .and_then(|b| b.parse().ok())
            .ok_or_else(|| {
                bad_image(
                    &whole,
                    "io.layerstack.base-layers is missing or not a number",
                )
            })?;
        let layers = descriptors(&whole, &v)?;
        if stack.is_empty() || base_layers > layers.len() {
            return Err(bad_image(
                &whole,
                "its stack or base layer count is missing or wrong",
            ));
        }

        let engine = self.engine.clone();
        let (staging, guard) =
            tokio::task::spawn_blocking(move || engine.staging_dir("pull-blobs"))
                .await
                .map_err(|e| Status::internal(format!("pull task failed: {e}")))?
                .map_err(engine_status)?;
        let result = self
            .pull_into(
                client,
                &reference,
                &creds,
                &m.digest,
                &v,
                layers,
                base_layers,
                &stack,
                node,
                branch,
                &staging,
            )
            .await;
        tokio::task::spawn_blocking(move || {
            let _ = std::fs::remove_dir_all(&staging);
            drop(guard);
        });
        result
    }

    #[allow(clippy::too_many_arguments)]
    async fn pull_into(
        &self,
        client: &layerstack_registry::RegistryClient,
        reference: &layerstack_registry::Reference,
        creds: &layerstack_registry::Credentials,
        manifest_digest: &str,
        manifest: &Value,
        layers: Vec<Descriptor>,
        base_layers: usize,
        stack: &str,
        node: Option<AdoptNode>,
        branch: Option<String>,
        staging: &std::path::Path,
    ) -> Result<api::PullResponse, Status> {
        let what = match &node {
            Some(n) => format!("node {}", n.id),
            None => "the branch head".to_string(),
        };
        let whole = reference.whole();
        let mut bytes_fetched = 0u64;
        // The config: one diff ID per layer.
        let cfg_digest = manifest["config"]["digest"]
            .as_str()
            .ok_or_else(|| bad_image(&whole, "its manifest has no config"))?;
        let cfg_size = manifest["config"]["size"].as_u64().unwrap_or(0);
        if cfg_size > MAX_CONFIG_BYTES {
            return Err(bad_image(&whole, format!("its config is {cfg_size} bytes")));
        }
        let cfg_path = staging.join("config");
        client
            .pull_blob_to_file(reference, creds, cfg_digest, cfg_size, &cfg_path)
            .await
            .map_err(|e| registry_status(&e))?;
        bytes_fetched += cfg_size;
        let cfg: Value = serde_json::from_slice(
            &tokio::fs::read(&cfg_path)
                .await
                .map_err(|e| Status::internal(format!("reading the pulled config: {e}")))?,
        )
        .map_err(|e| bad_image(&whole, format!("its config is not JSON ({e})")))?;
        let diff_ids: Vec<String> = cfg["rootfs"]["diff_ids"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|d| d.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        if diff_ids.len() != layers.len() {
            return Err(bad_image(
                &whole,
                format!("{} diff IDs for {} layers", diff_ids.len(), layers.len()),
            ));
        }

        // The layers above the base this store holds (by diff ID) — and
        // whether it has the stack at all: else an imported base is made
        // from the image.
        let above: Vec<String> = diff_ids[base_layers..].to_vec();
        let mut held = self.held(stack, &above).await?;
        let mut base_imported = false;
        if held.is_none() {
            let importable = stack.starts_with("import:")
                && base_layers == 1
                && stack.strip_prefix("import:") == Some(diff_ids[0].as_str());
            if !importable {
                return Err(Status::failed_precondition(format!(
                    "stack {stack} of {what} is not in this store: its base image must be here first (unpack it through containerd with the layerstack snapshotter, or `layerstack base import` it), then pull again"
                )));
            }
            let base = &layers[0];
            let path = staging.join("base.tar");
            client
                .pull_blob_to_file(reference, creds, &base.digest, base.size, &path)
                .await
                .map_err(|e| registry_status(&e))?;
            bytes_fetched += base.size;
            let imported = self
                .engine
                .import_base(ImportRequest {
                    path,
                    kind: ImportKind::Tar,
                    platform: None,
                })
                .await
                .map_err(engine_status)?;
            if imported.stack != stack {
                return Err(Status::invalid_argument(format!(
                    "the base layer of {whole} imports as stack {}, not the {stack} its annotations name: the image is not what `layerstack push` made",
                    imported.stack
                )));
            }
            base_imported = true;
            // The base layer is that blob: a push from here finds it recorded.
            if let Some(compression) = compression_of(&base.media_type) {
                let engine = self.engine.clone();
                let blob = layerstack_engine::store::LayerBlob {
                    layer: imported.layer,
                    compression,
                    digest: base.digest.clone(),
                    diff_id: diff_ids[0].clone(),
                    size: base.size,
                };
                tokio::task::spawn_blocking(move || engine.record_layer_blob(&blob))
                    .await
                    .map_err(|e| Status::internal(format!("pull task failed: {e}")))?
                    .map_err(engine_status)?;
            }
            held = self.held(stack, &above).await?;
        }
        let held = held.ok_or_else(|| {
            Status::internal(format!("stack {stack} is missing right after its import"))
        })?;

        // The layers above the base: held here, or fetched.
        let mut pulled = Vec::with_capacity(above.len());
        let (mut fetched, mut reused) = (0u32, 0u32);
        for (i, (d, h)) in layers[base_layers..].iter().zip(&held).enumerate() {
            let diff_id = above[i].clone();
            // Recorded for the layer (a push names it without recompressing)
            // when its media type names a compression this store writes.
            let blobs = compression_of(&d.media_type)
                .map(|compression| BlobRef {
                    compression,
                    digest: d.digest.clone(),
                    size: d.size,
                })
                .into_iter()
                .collect();
            let origin = format!(
                "layer {}/{} ({}) of {whole}",
                base_layers + i + 1,
                layers.len(),
                d.digest
            );
            let content = match h {
                Some(id) => {
                    reused += 1;
                    PulledContent::Held(*id)
                }
                None => {
                    let path = staging.join(format!("layer-{i}"));
                    client
                        .pull_blob_to_file(reference, creds, &d.digest, d.size, &path)
                        .await
                        .map_err(|e| registry_status(&e))?;
                    bytes_fetched += d.size;
                    fetched += 1;
                    let f = std::fs::File::open(&path).map_err(|e| {
                        Status::internal(format!("cannot open {}: {e}", path.display()))
                    })?;
                    PulledContent::Blob(Box::new(std::io::BufReader::new(f)))
                }
            };
            pulled.push(PulledLayer {
                diff_id,
                blobs,
                content,
                origin,
            });
        }
        let engine = self.engine.clone();
        let st = stack.to_string();
        let layer_count = above.len() as u32;
        let mut out = api::PullResponse {
            stack: stack.to_string(),
            manifest_digest: manifest_digest.to_string(),
            base_imported,
            layers: layer_count,
            layers_fetched: fetched,
            layers_reused: reused,
            bytes_fetched,
            ..Default::default()
        };
        let op = pull_operation();
        let (manifest, work) = match node {
            Some(node) => {
                let graph = node.group.name.clone();
                let adopted = tokio::task::spawn_blocking(move || {
                    engine.adopt_pulled_node(&st, pulled, &node)
                })
                .await
                .map_err(|e| Status::internal(format!("pull task failed: {e}")))?
                .map_err(engine_status)?;
                out.node = adopted.node.id.clone();
                // A node already here keeps its graph, whatever was asked.
                out.graph = if adopted.created {
                    graph
                } else {
                    adopted.node.group.clone()
                };
                out.created = adopted.created;
                out.missing_parents = adopted.missing_parents;
                out.linked_children = adopted.linked_children;
                (adopted.node.manifest, None)
            }
            None => {
                let work = format!(".graph/pull/{op}");
                let w = work.clone();
                let adopted =
                    tokio::task::spawn_blocking(move || engine.adopt_pulled_head(&st, pulled, &w))
                        .await
                        .map_err(|e| Status::internal(format!("pull task failed: {e}")))?
                        .map_err(engine_status)?;
                (adopted.manifest, Some(work))
            }
        };
        if let Some(b) = branch {
            let landed = self
                .engine
                .land_on_branch(stack, manifest, &b, work.as_deref(), &op)
                .await
                .map_err(engine_status)?;
            let head = self
                .engine
                .branch_head(stack, &b)
                .await
                .map_err(engine_status)?;
            out.branch = b.clone();
            out.branch_head = head;
            out.branch_result = match landed {
                Landed::Created { .. } => "created",
                Landed::Promoted(Promoted::UpToDate { .. }) => "up-to-date",
                Landed::Promoted(Promoted::FastForward { .. }) => "fast-forward",
                Landed::Promoted(Promoted::Merged { session }) => {
                    out.branch_session = Some(self.to_api(*session).await?);
                    "merged"
                }
                Landed::Promoted(Promoted::Conflict { session }) => {
                    const NAMED: usize = 5;
                    let (n, paths) = self.conflict_paths(&session, NAMED).await;
                    let more = if n > paths.len() as u64 { ", …" } else { "" };
                    // A merge publish that failed (no conflicting path): its
                    // outcome says why.
                    let failed = match session.outcome.as_ref() {
                        Some(o) if n == 0 => format!(
                            "; the merge publish ended {}: {}",
                            o.kind.as_str(),
                            o.message.as_deref().unwrap_or("no reason recorded")
                        ),
                        _ => String::new(),
                    };
                    let what = if out.node.is_empty() {
                        "its layers are left to GC".to_string()
                    } else {
                        format!(
                            "node {} is here now (graph {}), only the branch was refused",
                            out.node, out.graph
                        )
                    };
                    return Err(api::status(
                        api::ErrorKind::Conflict,
                        format!(
                            "{whole} conflicts with newer work on branch {b} here: {n} path(s) ({}{more}){failed}; refused whole, {b} is unchanged ({what}; the merge's verdicts are session {}'s outcome): pull it onto a branch of its own (--branch NAME) and merge the two by hand",
                            paths.join(", "),
                            session.id
                        ),
                    ));
                }
            }
            .to_string();
            if out.node.is_empty() {
                out.created = out.branch_result != "up-to-date";
            }
        }
        info!(
            reference = %whole,
            node = %out.node,
            branch = %out.branch,
            branch_result = %out.branch_result,
            created = out.created,
            layers = layer_count,
            fetched,
            reused,
            base_imported,
            bytes_fetched,
            linked_children = out.linked_children.len(),
            "pulled"
        );
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn layer_media_types_name_their_compression() {
        for (m, c) in [
            (
                "application/vnd.oci.image.layer.v1.tar+gzip",
                BlobCompression::Gzip,
            ),
            (
                "application/vnd.oci.image.layer.v1.tar+zstd",
                BlobCompression::Zstd,
            ),
            (
                "application/vnd.oci.image.layer.v1.tar",
                BlobCompression::None,
            ),
            (
                "application/vnd.docker.image.rootfs.diff.tar.gzip",
                BlobCompression::Gzip,
            ),
        ] {
            assert_eq!(compression_of(m), Some(c), "{m}");
        }
        assert_eq!(compression_of("application/vnd.example.unknown"), None);
    }

    #[test]
    fn a_manifest_without_layer_digests_or_sizes_is_refused_by_name() {
        let ok: Value =
            serde_json::json!({"layers": [{"mediaType": "x", "digest": "sha256:a", "size": 3}]});
        let d = descriptors("r", &ok).unwrap();
        assert_eq!((d[0].digest.as_str(), d[0].size), ("sha256:a", 3));
        for bad in [
            serde_json::json!({}),
            serde_json::json!({"layers": [{"size": 3}]}),
            serde_json::json!({"layers": [{"digest": "sha256:a"}]}),
        ] {
            let e = descriptors("reg/repo:tag", &bad).err().unwrap();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().contains("reg/repo:tag"), "{}", e.message());
        }
    }
}
