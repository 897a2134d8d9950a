//! The admin RPC `Export`: a branch head or a graph node as OCI layer blobs,
//! streamed to the client (`layerstack export`), which writes the image layout.
//!
//! The daemon owns the store, so it reads the layer directories (engine
//! `Export`, fd-relative, no-follow) and holds the export lease; the client owns
//! the layout directory — possibly in another mount namespace than the daemon's
//! — and writes blobs, config, manifest and index there. The lease is taken
//! before the first reply and released when the stream ends, fails, or the
//! client goes away (a send that fails stops the export).

use std::io::{self, Write};
use std::pin::Pin;
use std::time::Instant;

use layerstack_api as api;
use layerstack_engine::store::{ExportSource, StoreError};
use layerstack_engine::{Compression, EngineError};
use tokio::sync::mpsc;
use tonic::Status;
use tracing::{info, warn};

use crate::admin::{engine_status, AdminService};

pub type ExportStream =
    Pin<Box<dyn futures::Stream<Item = Result<api::ExportReply, Status>> + Send>>;

/// Bytes of blob per `chunk` reply (well under tonic's 4 MiB message limit).
const CHUNK: usize = 256 * 1024;

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

impl AdminService {
    pub(crate) async fn export_stream(
        &self,
        r: api::ExportRequest,
    ) -> Result<ExportStream, Status> {
        let compression = Compression::parse(&r.compression).ok_or_else(|| {
            Status::invalid_argument(format!(
                "compression {:?} is not supported: use gzip or zstd",
                r.compression
            ))
        })?;
        let source = if r.node.is_empty() {
            let stack = self.stack_of(&r.namespace, &r.image).await?;
            let branch = if r.branch.is_empty() {
                self.engine.store().default_branch().to_string()
            } else {
                r.branch.clone()
            };
            ExportSource::Branch { stack, branch }
        } else {
            if !r.image.is_empty() || !r.branch.is_empty() {
                return Err(Status::invalid_argument(
                    "name either STACK[@BRANCH] or a node (--node), not both",
                ));
            }
            ExportSource::Node(r.node.clone())
        };
        let engine = self.engine.clone();
        let since = r.since_layer;
        let image = r.image.clone();
        // Lease, plan and the check of `since` on a blocking thread (an
        // `Export` that is dropped there releases its lease there).
        let (export, plan, first_sent) = tokio::task::spawn_blocking(move || {
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
                let at = l.layers.iter().position(|x| x.id == since).ok_or_else(|| {
                    Status::invalid_argument(format!(
                        "--since {since}: layer {since} is not in the exported image (its layers: {}); see `layerstack log`",
                        l.layers
                            .iter()
                            .map(|x| x.id.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                })?;
                at + 1
            };
            let plan = api::ExportPlan {
                stack: l.stack.clone(),
                branch: l.branch.clone(),
                node: l.node.clone(),
                manifest: l.manifest,
                layers: l
                    .layers
                    .iter()
                    .enumerate()
                    .map(|(i, x)| api::ExportLayer {
                        layer: x.id,
                        kind: x.kind.as_str().to_string(),
                        session: x.session.unwrap_or(0),
                        created_ns: x.created_ns,
                        omitted: i < first_sent,
                    })
                    .collect(),
                compression: compression.as_str().to_string(),
                media_type: compression.media_type().to_string(),
            };
            Ok::<_, Status>((export, plan, first_sent))
        })
        .await
        .map_err(|e| Status::internal(format!("export task failed: {e}")))??;
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
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let mut bytes = 0u64;
            for i in 0..n {
                let omitted = i < first_sent;
                let blob = if omitted {
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
