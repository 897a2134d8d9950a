//! OCI export: a branch head or a graph node as the layers of a standard OCI
//! image (ARCHITECTURE.md §11; docs/architecture.md "OCI export").
//!
//! [`Engine::begin_export`] pins what the source shows with a lease of holder
//! kind `export` ([`layerstack_store::Store::lease_export`]) and returns an
//! [`Export`]: the image's layers oldest first (the stack's base layers, then
//! one per published or squashed layer of the manifest). The lease lives as
//! long as the `Export` does — GC keeps every layer it lists — and is released
//! on drop (a daemon that dies mid-export releases it at its next start).
//!
//! [`write_layer_blob`] writes one layer as a compressed OCI layer blob:
//! the tar of [`layerstack_publisher::write_layer_tar`] (deterministic), hashed
//! on its way into the compressor (the layer's **diff ID**, sha256 of the
//! uncompressed tar, what the image config's `rootfs.diff_ids` lists) and hashed
//! again on its way out (the **digest**, sha256 of the blob, what the manifest's
//! layer descriptor names). gzip (flate2, level 6, no name, mtime 0) and zstd
//! (level 3, one thread) give the same bytes for the same layer every time, so
//! an export `--since` a layer names the same blobs a full export does.
//!
//! [`Export::write_layer`] records what it computed (`Store::record_layer_blob`:
//! layer, compression, digest, diff ID, size; store format 13), so a later
//! push names a layer's blob without recompressing it
//! ([`Export::recorded_blob`]) and a pull finds a layer it holds by diff ID.
//!
//! Both run on a blocking thread (they read directories and, on drop, write one
//! row): the daemon runs an export inside `spawn_blocking`.

use std::io::{self, Write};
use std::path::Path;
use std::sync::Arc;

use layerstack_publisher::{write_layer_tar, TarOptions, TarReport};
use layerstack_store::{ExportLease, ExportSource, Store};
use sha2::{Digest, Sha256};
use tracing::{info, warn};

use crate::{Engine, EngineError};

/// A layer blob's compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// gzip (RFC 1952), `application/vnd.oci.image.layer.v1.tar+gzip`.
    #[default]
    Gzip,
    /// zstd (RFC 8878), `application/vnd.oci.image.layer.v1.tar+zstd`
    /// (containerd ≥ 1.5 unpacks it).
    Zstd,
}

impl Compression {
    /// `gzip` or `zstd`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gzip => "gzip",
            Self::Zstd => "zstd",
        }
    }

    /// Parses `gzip` or `zstd` ("" is gzip).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "" | "gzip" => Some(Self::Gzip),
            "zstd" => Some(Self::Zstd),
            _ => None,
        }
    }

    /// The store's name of this compression (`layer_blobs.compression`).
    pub fn stored(self) -> layerstack_store::BlobCompression {
        match self {
            Self::Gzip => layerstack_store::BlobCompression::Gzip,
            Self::Zstd => layerstack_store::BlobCompression::Zstd,
        }
    }

    /// The OCI media type of a layer blob of this compression.
    pub fn media_type(self) -> &'static str {
        match self {
            Self::Gzip => "application/vnd.oci.image.layer.v1.tar+gzip",
            Self::Zstd => "application/vnd.oci.image.layer.v1.tar+zstd",
        }
    }
}

/// What [`write_layer_blob`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerBlob {
    /// `sha256:<hex>` of the compressed blob.
    pub digest: String,
    /// `sha256:<hex>` of the uncompressed tar.
    pub diff_id: String,
    /// Bytes of the compressed blob.
    pub size: u64,
    /// Bytes of the uncompressed tar.
    pub uncompressed_size: u64,
    pub tar: TarReport,
}

/// A writer that hashes (sha256) and counts what passes through it.
pub(crate) struct Digesting<W> {
    inner: W,
    hash: Sha256,
    bytes: u64,
}

impl<W: Write> Digesting<W> {
    pub(crate) fn new(inner: W) -> Self {
        Self {
            inner,
            hash: Sha256::new(),
            bytes: 0,
        }
    }

    pub(crate) fn digest(&self) -> String {
        format!("sha256:{:x}", self.hash.clone().finalize())
    }
}

impl<W: Write> Write for Digesting<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Writes the layer directory `layer` into `out` as a `compression` blob (see
/// the module docs); returns its digests and sizes. `out` is flushed.
///
/// # Errors
/// `EngineError::Export` when the layer cannot be read or `out` refuses a write
/// (a client that went away).
pub fn write_layer_blob<W: Write>(
    layer: &Path,
    compression: Compression,
    options: &TarOptions,
    out: W,
) -> Result<LayerBlob, EngineError> {
    let blob_err = |e: io::Error| EngineError::Read(format!("layer {}", layer.display()), e);
    let outer = Digesting::new(out);
    let (outer, inner, report) = match compression {
        Compression::Gzip => {
            let enc = flate2::write::GzEncoder::new(outer, flate2::Compression::new(6));
            let (raw, report) = write_layer_tar(layer, Digesting::new(enc), options)
                .map_err(|e| EngineError::Export(Box::new(e)))?;
            let inner = (raw.digest(), raw.bytes);
            let outer = raw.inner.finish().map_err(blob_err)?;
            (outer, inner, report)
        }
        Compression::Zstd => {
            let enc = zstd::stream::write::Encoder::new(outer, 3).map_err(blob_err)?;
            let (raw, report) = write_layer_tar(layer, Digesting::new(enc), options)
                .map_err(|e| EngineError::Export(Box::new(e)))?;
            let inner = (raw.digest(), raw.bytes);
            let outer = raw.inner.finish().map_err(blob_err)?;
            (outer, inner, report)
        }
    };
    let mut outer = outer;
    outer.flush().map_err(blob_err)?;
    Ok(LayerBlob {
        digest: outer.digest(),
        diff_id: inner.0,
        size: outer.bytes,
        uncompressed_size: inner.1,
        tar: report,
    })
}

/// A running export: the pinned manifest and the image's layers. Releases its
/// lease on drop (one short write: drop it on a blocking thread).
pub struct Export {
    store: Arc<Store>,
    lease: ExportLease,
    options: TarOptions,
}

impl Export {
    /// The lease and the layers, oldest first.
    pub fn lease(&self) -> &ExportLease {
        &self.lease
    }

    /// Writes layer `index` (of [`ExportLease::layers`]) into `out`.
    ///
    /// # Errors
    /// `InvalidArgument` for an index out of range; see [`write_layer_blob`].
    pub fn write_layer<W: Write>(
        &self,
        index: usize,
        compression: Compression,
        out: W,
    ) -> Result<LayerBlob, EngineError> {
        let l = self.lease.layers.get(index).ok_or_else(|| {
            EngineError::InvalidArgument(format!(
                "layer index {index} out of range ({} layers)",
                self.lease.layers.len()
            ))
        })?;
        let blob = write_layer_blob(&l.path, compression, &self.options, out)?;
        // Remembered for the next push or export of this layer (its digest
        // without recompressing it; a pull's reuse by diff ID). Losing the
        // record costs a recompression later, never the export: warn only.
        let record = layerstack_store::LayerBlob {
            layer: l.id,
            compression: compression.stored(),
            digest: blob.digest.clone(),
            diff_id: blob.diff_id.clone(),
            size: blob.size,
        };
        if let Err(e) = self.store.record_layer_blob(&record) {
            warn!(
                layer.id = l.id,
                error = %crate::error_chain(&e),
                "cannot record the blob a layer was written as; the next export computes it again"
            );
        }
        Ok(blob)
    }

    /// The blob layer `index` (of [`ExportLease::layers`]) was written as in
    /// `compression` by an earlier export or push, if recorded: its digest,
    /// diff ID and size without reading the layer (a push asks the registry
    /// whether it has that digest before compressing anything).
    ///
    /// # Errors
    /// `InvalidArgument` for an index out of range; `Store` on a database error.
    pub fn recorded_blob(
        &self,
        index: usize,
        compression: Compression,
    ) -> Result<Option<layerstack_store::LayerBlob>, EngineError> {
        let l = self.lease.layers.get(index).ok_or_else(|| {
            EngineError::InvalidArgument(format!(
                "layer index {index} out of range ({} layers)",
                self.lease.layers.len()
            ))
        })?;
        Ok(self.store.layer_blob(l.id, compression.stored())?)
    }
}

impl Drop for Export {
    fn drop(&mut self) {
        match self.store.release_export(self.lease.lease) {
            Ok(()) => info!(
                stack = %self.lease.stack,
                manifest = self.lease.manifest,
                lease = self.lease.lease,
                "export lease released"
            ),
            Err(e) => warn!(
                lease = self.lease.lease,
                error = %crate::error_chain(&e),
                "cannot release an export lease; the next start releases it"
            ),
        }
    }
}

impl Engine {
    /// A fresh directory under the store's `staging/` for an operation in
    /// flight (a push's blobs, a pull's layers), kept from the startup sweep
    /// while the guard lives. Blocking.
    ///
    /// # Errors
    /// `Store(Io)` when the directory cannot be made.
    pub fn staging_dir(
        &self,
        purpose: &str,
    ) -> Result<(std::path::PathBuf, layerstack_store::InFlightGuard), EngineError> {
        Ok(self.store().staging_dir(purpose)?)
    }

    /// Records that layer `blob.layer` is the blob `blob` names (a pull that
    /// imported a base from an image's layer knows its digest, diff ID and
    /// size): a later push asks the registry for it before compressing
    /// anything. Blocking.
    ///
    /// # Errors
    /// `Store(…)` (an unknown layer, a malformed digest).
    pub fn record_layer_blob(&self, blob: &layerstack_store::LayerBlob) -> Result<(), EngineError> {
        Ok(self.store().record_layer_blob(blob)?)
    }

    /// Pins what `source` shows for an export (`holder`: who asked, for the
    /// lease row) and lists the image's layers; see the module docs. Blocking.
    ///
    /// # Errors
    /// `Store(StackNotFound | BranchNotFound)`, `Store(InvalidArgument)` for an
    /// unknown node, `Store(Corrupt)`.
    pub fn begin_export(&self, source: &ExportSource, holder: &str) -> Result<Export, EngineError> {
        let lease = self.store().lease_export(source, holder)?;
        layerstack_store::failpoints::hit("export.leased");
        info!(
            stack = %lease.stack,
            branch = %lease.branch,
            node = %lease.node,
            manifest = lease.manifest,
            layers = lease.layers.len(),
            lease = lease.lease,
            "export lease taken"
        );
        Ok(Export {
            store: self.store().clone(),
            lease,
            options: TarOptions {
                userxattr: self.settings().userxattr,
            },
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::io::Read;

    fn sha(b: &[u8]) -> String {
        format!("sha256:{:x}", Sha256::digest(b))
    }

    #[test]
    fn digests_name_the_blob_and_the_uncompressed_tar_and_repeat() {
        let t = tempfile::tempdir().unwrap();
        let l = t.path().join("l");
        std::fs::create_dir_all(l.join("etc")).unwrap();
        std::fs::write(l.join("etc/motd"), "hello\n".repeat(1000)).unwrap();
        for c in [Compression::Gzip, Compression::Zstd] {
            let mut blob = Vec::new();
            let b = write_layer_blob(&l, c, &TarOptions::default(), &mut blob).unwrap();
            assert_eq!(b.digest, sha(&blob), "{c:?}");
            assert_eq!(b.size, blob.len() as u64);
            let mut raw = Vec::new();
            match c {
                Compression::Gzip => {
                    flate2::read::GzDecoder::new(blob.as_slice())
                        .read_to_end(&mut raw)
                        .unwrap();
                }
                Compression::Zstd => raw = zstd::decode_all(blob.as_slice()).unwrap(),
            }
            assert_eq!(b.diff_id, sha(&raw), "{c:?}");
            assert_eq!(b.uncompressed_size, raw.len() as u64);
            assert!(b.size < b.uncompressed_size);
            let mut again = Vec::new();
            let b2 = write_layer_blob(&l, c, &TarOptions::default(), &mut again).unwrap();
            assert_eq!(b, b2, "{c:?}: the same layer gives the same blob");
        }
    }

    #[test]
    fn compression_names_parse() {
        assert_eq!(Compression::parse(""), Some(Compression::Gzip));
        assert_eq!(Compression::parse("zstd"), Some(Compression::Zstd));
        assert_eq!(Compression::parse("xz"), None);
    }
}
