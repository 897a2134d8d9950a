//! The admin RPC `Export`: a branch head or a graph node as OCI layer blobs,
//! streamed to the client (`layerstack export`), which writes the image layout.
//!
//! The daemon owns the store, so it reads the layer directories (engine
//! `Export`, fd-relative, no-follow) and holds the export lease; the client owns
//! the layout directory — possibly in another mount namespace than the daemon's
//! — and writes blobs, config, manifest and index there. The lease is taken
//! before the first reply and released when the stream ends, fails, or the
//! client goes away (a send that fails stops the export).
//!
//! The daemon also talks to containerd, so it looks up the stack's base image
//! there ([`crate::base_image`]): its config blob goes to the client in the plan
//! (the client carries its runtime config over), and each base layer whose
//! original blob containerd still has is that blob, read from the content store
//! and sent verbatim instead of re-packed. An unreachable containerd or a base
//! image that is gone is no error: the plan says why (`base_missing`) and the
//! base layers are re-packed. containerd is given [`BASE_LOOKUP_TIMEOUT`] to
//! answer the lookup.

use std::io::{self, Write};
use std::pin::Pin;
use std::time::{Duration, Instant};

use layerstack_api as api;
use layerstack_engine::store::{ExportSource, StoreError};
use layerstack_engine::{Compression, EngineError};
use tokio::sync::mpsc;
use tonic::Status;
use tracing::{info, warn};

use crate::admin::{engine_status, AdminService};
use crate::base_image::{self, BaseBlob, BaseImage, Missing};

pub type ExportStream =
    Pin<Box<dyn futures::Stream<Item = Result<api::ExportReply, Status>> + Send>>;

/// Bytes of blob per `chunk` reply (well under tonic's 4 MiB message limit).
const CHUNK: usize = 256 * 1024;

/// How long containerd may take to list its images and read the base image's
/// manifest and config before the export goes on without them.
const BASE_LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);

/// `ExportLayer.source` of a layer re-packed from its directory.
const SOURCE_STORE: &str = "store";
/// `ExportLayer.source` of a base layer copied from containerd's content store.
const SOURCE_CONTAINERD: &str = "containerd";

/// The stack's base image in containerd, with the channel to read its blobs.
struct Base {
    ch: containerd_client::tonic::transport::Channel,
    namespace: String,
    image: BaseImage,
}

impl Base {
    /// The original blob of base layer `index`, when the export copies it.
    fn blob(&self, index: usize) -> Option<&BaseBlob> {
        self.image.layers.get(index).filter(|b| b.copyable)
    }
}

/// Sends blob `blob` from containerd as `chunk` replies of at most [`CHUNK`]
/// bytes. `Err(None)`: the client went away.
async fn send_base_blob(
    base: &Base,
    blob: &BaseBlob,
    tx: &mpsc::Sender<Result<api::ExportReply, Status>>,
) -> Result<(), Option<Status>> {
    let failed = |e: base_image::CopyError| Some(Status::unavailable(api::error_chain(&e)));
    let mut r = base_image::open_blob(&base.ch, &base.namespace, blob)
        .await
        .map_err(failed)?;
    while let Some(data) = r.next().await.map_err(failed)? {
        for piece in data.chunks(CHUNK) {
            tx.send(Ok(api::ExportReply {
                reply: Some(api::export_reply::Reply::Chunk(piece.to_vec())),
            }))
            .await
            .map_err(|_| None)?;
        }
    }
    Ok(())
}

/// Sends what is written to it as `chunk` replies of [`CHUNK`] bytes.
struct ChunkWriter<'a> {
    tx: &'a mpsc::Sender<Result<api::ExportReply, Status>>,
    buf: Vec<u8>,
}

impl ChunkWriter<'_> {
    fn send(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let data = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK));
        self.tx
            .blocking_send(Ok(api::ExportReply {
                reply: Some(api::export_reply::Reply::Chunk(data)),
            }))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the export's client went away"))
    }
}

impl Write for ChunkWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(buf);
        if self.buf.len() >= CHUNK {
            self.send()?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send()
    }
}

/// The index of the first layer of `layers` (an exported image's, oldest
/// first) whose blob an export `--since since` sends: the one above `since`
/// when it is a layer of the image; when it is a member of one of its squashed
/// layers (at any depth), that squash — everything above that point, and the
/// squash's blob is new to a registry.
fn first_sent(
    engine: &layerstack_engine::Engine,
    layers: &[layerstack_engine::store::ExportLayer],
    since: i64,
) -> Result<usize, Status> {
    if let Some(at) = layers.iter().position(|x| x.id == since) {
        return Ok(at + 1);
    }
    let ids: Vec<i64> = layers.iter().map(|x| x.id).collect();
    let squash = engine
        .compacted_into(&ids, since)
        .map_err(|e| Status::internal(format!("--since {since}: {}", api::error_chain(&e))))?;
    match squash.and_then(|s| ids.iter().position(|x| *x == s)) {
        Some(at) => Ok(at),
        None => Err(Status::invalid_argument(format!(
            "--since {since}: layer {since} is not in the exported image nor a member of one of its squashed layers (its layers: {}); see `layerstack log`",
            ids.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// A layer blob compression by name ("" is gzip), or INVALID_ARGUMENT.
pub(crate) fn compression_of(name: &str) -> Result<Compression, Status> {
    Compression::parse(name).ok_or_else(|| {
        Status::invalid_argument(format!(
            "compression {name:?} is not supported: use gzip or zstd"
        ))
    })
}

impl AdminService {
    /// What an export or a push reads: graph node `node`, else branch
    /// `branch` (default: the daemon's) of stack `stack` (an image reference
    /// of containerd namespace `namespace`, a stack id or a base digest).
    pub(crate) async fn export_source(
        &self,
        node: &str,
        namespace: &str,
        stack: &str,
        branch: &str,
    ) -> Result<ExportSource, Status> {
        if node.is_empty() {
            let stack = self.stack_of(namespace, stack).await?;
            let branch = if branch.is_empty() {
                self.engine.default_branch().to_string()
            } else {
                branch.to_string()
            };
            Ok(ExportSource::Branch { stack, branch })
        } else {
            if !stack.is_empty() || !branch.is_empty() {
                return Err(Status::invalid_argument(
                    "name either STACK[@BRANCH] or a node (--node), not both",
                ));
            }
            Ok(ExportSource::Node(node.to_string()))
        }
    }

    /// The base image of the stack in containerd (namespace `ns`, top chainID
    /// `chain`, `layers` base layers; `prefer`: the reference the export named),
    /// or why not. Never longer than [`BASE_LOOKUP_TIMEOUT`].
    async fn base_image(
        &self,
        ns: Option<&str>,
        chain: &str,
        layers: usize,
        prefer: &str,
    ) -> Result<Base, Missing> {
        let Some(ns) = ns else {
            // `layerstack base import`: no image, no containerd.
            return Err(Missing(format!(
                "{chain} is an imported base (layerstack base import): it has no image in containerd"
            )));
        };
        let lookup = async {
            let ch = crate::containerd::connect(&self.containerd_address)
                .await
                .map_err(|e| Missing(api::error_chain(&e)))?;
            let image = base_image::find(&ch, ns, chain, layers, prefer).await?;
            Ok(Base {
                ch,
                namespace: ns.to_string(),
                image,
            })
        };
        tokio::time::timeout(BASE_LOOKUP_TIMEOUT, lookup)
            .await
            .unwrap_or_else(|_| {
                Err(Missing(format!(
                    "containerd at {} did not answer within {} s",
                    self.containerd_address.display(),
                    BASE_LOOKUP_TIMEOUT.as_secs()
                )))
            })
    }

    pub(crate) async fn export_stream(
        &self,
        r: api::ExportRequest,
    ) -> Result<ExportStream, Status> {
        let compression = compression_of(&r.compression)?;
        let source = self
            .export_source(&r.node, &r.namespace, &r.image, &r.branch)
            .await?;
        let engine = self.engine.clone();
        let since = r.since_layer;
        let image = r.image.clone();
        // Lease and the check of `since` on a blocking thread (an `Export`
        // that is dropped there releases its lease there).
        let (export, first_sent) = tokio::task::spawn_blocking(move || {
            let export = engine
                .begin_export(&source, "layerstack export")
                .map_err(|e| match &e {
                    EngineError::Store(StoreError::BranchNotFound { branch, .. }) => {
                        Status::not_found(format!(
                            "{}: no session of {image:?} has used branch {branch:?} yet (see `layerstack branch ls`)",
                            api::error_chain(&e)
                        ))
                    }
                    EngineError::Store(StoreError::StackNotFound(_)) => Status::not_found(format!(
                        "{} (see `layerstack stack ls`)",
                        api::error_chain(&e)
                    )),
                    _ => engine_status(e),
                })?;
            let l = export.lease();
            let first_sent = if since == 0 {
                0
            } else {
                first_sent(&engine, &l.layers, since)?
            };
            Ok::<_, Status>((export, first_sent))
        })
        .await
        .map_err(|e| Status::internal(format!("export task failed: {e}")))??;
        let l = export.lease();
        let base = self
            .base_image(
                l.namespace.as_deref(),
                &l.base_digest,
                l.base_layers,
                &r.image,
            )
            .await;
        match &base {
            Ok(b) => info!(
                stack = %l.stack,
                image = %b.image.name,
                manifest = %b.image.manifest,
                blobs_copied = l.layers.iter().enumerate().filter(|(i, _)| b.blob(*i).is_some()).count(),
                "export: base image found in containerd"
            ),
            Err(Missing(_)) if l.namespace.is_none() => {
                info!(stack = %l.stack, "export: an imported base: its layer is packed from the store, the runtime config defaulted")
            }
            Err(Missing(why)) => {
                warn!(stack = %l.stack, reason = %why, "export: no base image in containerd; its layers are re-packed, its runtime config defaulted")
            }
        }
        let plan = api::ExportPlan {
            stack: l.stack.clone(),
            branch: l.branch.clone(),
            node: l.node.clone(),
            manifest: l.manifest,
            layers: l
                .layers
                .iter()
                .enumerate()
                .map(|(i, x)| {
                    let original = base.as_ref().ok().and_then(|b| b.blob(i));
                    api::ExportLayer {
                        layer: x.id,
                        kind: x.kind.as_str().to_string(),
                        session: x.session.unwrap_or(0),
                        created_ns: x.created_ns,
                        omitted: i < first_sent,
                        source: if original.is_some() {
                            SOURCE_CONTAINERD
                        } else {
                            SOURCE_STORE
                        }
                        .to_string(),
                        media_type: original.map_or_else(
                            || compression.media_type().to_string(),
                            |b| b.media_type.clone(),
                        ),
                    }
                })
                .collect(),
            compression: compression.as_str().to_string(),
            media_type: compression.media_type().to_string(),
            base_image: base
                .as_ref()
                .map(|b| b.image.name.clone())
                .unwrap_or_default(),
            base_manifest: base
                .as_ref()
                .map(|b| b.image.manifest.clone())
                .unwrap_or_default(),
            base_config: base
                .as_ref()
                .map(|b| b.image.config.clone())
                .unwrap_or_default(),
            base_missing: base.as_ref().err().map(|m| m.0.clone()).unwrap_or_default(),
            base_digest: l.base_digest.clone(),
        };
        let base = base.ok();
        let (tx, rx) = mpsc::channel(8);
        let stack = plan.stack.clone();
        let n = plan.layers.len();
        if tx
            .send(Ok(api::ExportReply {
                reply: Some(api::export_reply::Reply::Plan(plan)),
            }))
            .await
            .is_err()
        {
            // Release the lease where store writes belong.
            let _ = tokio::task::spawn_blocking(move || drop(export)).await;
            return Err(Status::cancelled("the client went away"));
        }
        let rt = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let mut bytes = 0u64;
            for i in 0..n {
                let omitted = i < first_sent;
                let blob = if let Some((base, b)) =
                    base.as_ref().and_then(|base| Some((base, base.blob(i)?)))
                {
                    // The base image's own blob: its descriptor's digest and
                    // size, its diff ID from the config; not decompressed.
                    if !omitted {
                        match rt.block_on(send_base_blob(base, b, &tx)) {
                            Ok(()) => {}
                            Err(Some(st)) => {
                                warn!(stack = %stack, layer.index = i, error = %st.message(), "export failed");
                                let _ = tx.blocking_send(Err(st));
                                return;
                            }
                            Err(None) => {
                                warn!(stack = %stack, "export stopped: the client went away");
                                return;
                            }
                        }
                    }
                    Ok(layerstack_engine::LayerBlob {
                        digest: b.digest.clone(),
                        diff_id: b.diff_id.clone(),
                        size: b.size,
                        uncompressed_size: 0,
                        tar: Default::default(),
                    })
                } else if omitted {
                    export.write_layer(i, compression, io::sink())
                } else {
                    export.write_layer(
                        i,
                        compression,
                        ChunkWriter {
                            tx: &tx,
                            buf: Vec::with_capacity(CHUNK),
                        },
                    )
                };
                let reply = match blob {
                    Ok(b) => {
                        if !omitted {
                            bytes += b.size;
                        }
                        Ok(api::ExportReply {
                            reply: Some(api::export_reply::Reply::Done(api::ExportBlobDone {
                                index: i as u32,
                                digest: b.digest,
                                diff_id: b.diff_id,
                                size: b.size,
                                uncompressed_size: b.uncompressed_size,
                                omitted,
                            })),
                        })
                    }
                    Err(e) => {
                        warn!(stack = %stack, layer.index = i, error = %api::error_chain(&e), "export failed");
                        let _ = tx.blocking_send(Err(engine_status(e)));
                        return;
                    }
                };
                if tx.blocking_send(reply).is_err() {
                    warn!(stack = %stack, "export stopped: the client went away");
                    return;
                }
            }
            info!(
                stack = %stack,
                layers = n,
                layers_sent = n - first_sent,
                bytes,
                duration_ms = started.elapsed().as_millis() as u64,
                "export done"
            );
            drop(export);
        });
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }
}
