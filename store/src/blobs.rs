//! Layer blob records (format 13): the OCI blobs a layer was written as — its
//! digest (sha256 of the compressed blob), its diff ID (sha256 of the
//! uncompressed tar) and the blob's size — one row per compression
//! (`layer_blobs`; OCI image-spec `descriptor.md`, `config.md` "rootfs").
//!
//! A layer directory never changes once committed and its tar is
//! deterministic (`publisher::write_layer_tar`), so what an export or a push
//! computed once stays true: a second push of the same layer knows which blob
//! to name (and ask the registry for) without reading and compressing the
//! layer again, and a pull finds a layer it already holds by the diff ID a
//! manifest's config lists ([`Store::layer_by_diff_id`]) instead of unpacking
//! it again.
//!
//! Rows go with their layer: the foreign key is `ON DELETE CASCADE`, so
//! whichever path deletes a layer row (GC, containerd's `Remove`, a dropped
//! pending layer) deletes its blob rows in the same transaction. A layer whose
//! directory GC freed (`dropped`) keeps its rows while its row stays, but is
//! never offered for reuse.

use rusqlite::{params, Connection, OptionalExtension};

use crate::db::Cached;
use crate::error::StoreError;
use crate::snapshots::is_digest;
use crate::{LayerId, Store};

/// A layer blob's compression (`layer_blobs.compression`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BlobCompression {
    /// gzip, `application/vnd.oci.image.layer.v1.tar+gzip`.
    Gzip,
    /// zstd, `application/vnd.oci.image.layer.v1.tar+zstd`.
    Zstd,
    /// The tar itself, `application/vnd.oci.image.layer.v1.tar`: its digest
    /// is its diff ID.
    None,
}

impl BlobCompression {
    /// `gzip`, `zstd` or `none`, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gzip => "gzip",
            Self::Zstd => "zstd",
            Self::None => "none",
        }
    }

    /// The compression named `s` ([`BlobCompression::as_str`]).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "gzip" => Self::Gzip,
            "zstd" => Self::Zstd,
            "none" => Self::None,
            _ => return None,
        })
    }
}

/// One blob of a layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerBlob {
    /// The layer it was written from.
    pub layer: LayerId,
    pub compression: BlobCompression,
    /// `sha256:<64 hex>` of the blob (what a manifest's layer descriptor names).
    pub digest: String,
    /// `sha256:<64 hex>` of the uncompressed tar (what a config's
    /// `rootfs.diff_ids` lists); the same for every compression of a layer.
    pub diff_id: String,
    /// Bytes of the blob.
    pub size: u64,
}

fn blob_from(r: &rusqlite::Row<'_>) -> rusqlite::Result<(LayerId, String, String, String, i64)> {
    Ok((
        r.get("layer_id")?,
        r.get("compression")?,
        r.get("digest")?,
        r.get("diff_id")?,
        r.get("size")?,
    ))
}

fn to_blob(
    (layer, compression, digest, diff_id, size): (LayerId, String, String, String, i64),
) -> Result<LayerBlob, StoreError> {
    let c = BlobCompression::parse(&compression).ok_or_else(|| {
        StoreError::corrupt("layer_blobs", layer, format!("compression {compression:?}"))
    })?;
    Ok(LayerBlob {
        layer,
        compression: c,
        digest,
        diff_id,
        size: u64::try_from(size).unwrap_or(0),
    })
}

/// The blob of `layer` in `compression`, if one was recorded.
pub(crate) fn layer_blob_in(
    conn: &Connection,
    layer: LayerId,
    compression: BlobCompression,
) -> Result<Option<LayerBlob>, StoreError> {
    conn.one(
        "SELECT layer_id, compression, digest, diff_id, size FROM layer_blobs WHERE layer_id = ?1 AND compression = ?2",
        params![layer, compression.as_str()],
        blob_from,
    )
    .optional()?
    .map(to_blob)
    .transpose()
}

/// Records `blob` in the caller's transaction (see [`Store::record_layer_blob`]).
pub(crate) fn record_layer_blob_in(
    tx: &rusqlite::Transaction<'_>,
    blob: &LayerBlob,
) -> Result<(), StoreError> {
    for (what, d) in [("digest", &blob.digest), ("diff ID", &blob.diff_id)] {
        if !is_digest(d) {
            return Err(StoreError::InvalidArgument(format!(
                "blob {what} {d:?} of layer {} is not sha256:<64 lowercase hex digits>",
                blob.layer
            )));
        }
    }
    if blob.compression == BlobCompression::None && blob.digest != blob.diff_id {
        return Err(StoreError::InvalidArgument(format!(
            "an uncompressed blob of layer {} is its tar: its digest {} must be its diff ID {}",
            blob.layer, blob.digest, blob.diff_id
        )));
    }
    let size = i64::try_from(blob.size).map_err(|_| {
        StoreError::InvalidArgument(format!("blob size {} is out of range", blob.size))
    })?;
    let kind: Option<String> = tx
        .one("SELECT kind FROM layers WHERE id = ?1", [blob.layer], |r| {
            r.get(0)
        })
        .optional()?;
    match kind.as_deref() {
        Some("base" | "published" | "squashed") => {}
        Some(k) => {
            return Err(StoreError::FailedPrecondition(format!(
                "layer {} is {k}: only a committed image, published or squashed layer is written as a blob",
                blob.layer
            )))
        }
        None => return Err(StoreError::LayerNotFound(blob.layer)),
    }
    // One tar per layer: every compression of it names the same diff ID.
    let other: Option<(String, String)> = tx
        .one(
            "SELECT compression, diff_id FROM layer_blobs WHERE layer_id = ?1 AND diff_id <> ?2 LIMIT 1",
            params![blob.layer, blob.diff_id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()?;
    if let Some((c, d)) = other {
        return Err(StoreError::FailedPrecondition(format!(
            "layer {} was recorded with diff ID {d} ({c} blob), now {}: a layer's tar never changes, so its directory or the tar writer did; check the layer (layerstack fsck) before pushing it",
            blob.layer, blob.diff_id
        )));
    }
    tx.exec(
        "INSERT INTO layer_blobs(layer_id, compression, digest, diff_id, size) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT(layer_id, compression) DO UPDATE SET digest = excluded.digest, size = excluded.size",
        params![blob.layer, blob.compression.as_str(), blob.digest, blob.diff_id, size],
    )?;
    Ok(())
}

impl Store {
    /// Records that layer `blob.layer` was written as `blob` (an export or a
    /// push computed it). The same layer and compression again replaces the
    /// digest and size (a newer compressor may write other bytes for the same
    /// tar); the diff ID must stay.
    ///
    /// Errors: `InvalidArgument` (a digest or diff ID that is not
    /// `sha256:<64 hex>`; an uncompressed blob whose digest is not its diff
    /// ID), `LayerNotFound`, `FailedPrecondition` (a layer that is not a
    /// committed image, published or squashed layer; a diff ID other than one
    /// recorded before for the layer).
    pub fn record_layer_blob(&self, blob: &LayerBlob) -> Result<(), StoreError> {
        self.db.write(|tx| record_layer_blob_in(tx, blob))
    }

    /// The blob of `layer` recorded for `compression`, if any.
    pub fn layer_blob(
        &self,
        layer: LayerId,
        compression: BlobCompression,
    ) -> Result<Option<LayerBlob>, StoreError> {
        self.db.read(|conn| layer_blob_in(conn, layer, compression))
    }

    /// Every blob recorded for `layer`, by compression.
    pub fn layer_blobs(&self, layer: LayerId) -> Result<Vec<LayerBlob>, StoreError> {
        self.db.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT layer_id, compression, digest, diff_id, size FROM layer_blobs WHERE layer_id = ?1 ORDER BY compression",
            )?;
            let rows = stmt
                .query_map([layer], blob_from)?
                .collect::<Result<Vec<_>, _>>()?;
            rows.into_iter().map(to_blob).collect()
        })
    }

    /// A layer this store holds whose tar has diff ID `diff_id`
    /// (`sha256:<hex>`) — a committed image, published or squashed layer
    /// whose directory is there (not freed by GC) — for a pull to reuse
    /// instead of unpacking the blob again. With `stack`, only a layer of
    /// that stack (its own published or squashed layer, or one of its base
    /// layers). The oldest such layer when several hold the same tar.
    ///
    /// Only layers some export or push recorded are found: a layer never
    /// written as a blob has no diff ID yet.
    pub fn layer_by_diff_id(
        &self,
        diff_id: &str,
        stack: Option<&str>,
    ) -> Result<Option<LayerId>, StoreError> {
        self.db.read(|conn| {
            Ok(conn
                .one(
                    "SELECT l.id FROM layer_blobs b JOIN layers l ON l.id = b.layer_id
                     WHERE b.diff_id = ?1 AND l.dropped = 0
                       AND l.kind IN ('base', 'published', 'squashed')
                       AND (?2 IS NULL OR l.stack = ?2
                            OR l.id IN (SELECT layer_id FROM stack_layers WHERE stack = ?2))
                     ORDER BY l.id LIMIT 1",
                    params![diff_id, stack],
                    |r| r.get(0),
                )
                .optional()?)
        })
    }
}
