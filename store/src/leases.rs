//! Leases: pinned manifests, each with a holder (ARCHITECTURE.md §2 "Lease").

use rusqlite::{params, Connection, OptionalExtension, Transaction};

use crate::db::Cached;
use crate::error::StoreError;
use crate::{now_ns, HolderKind, ManifestId};

/// Pins `manifest` for `holder` of `kind`; returns the lease id.
pub(crate) fn new_lease(
    tx: &Transaction<'_>,
    manifest: ManifestId,
    kind: HolderKind,
    holder: &str,
) -> Result<i64, StoreError> {
    tx.exec(
        "INSERT INTO leases(manifest_id, holder_kind, holder, created_ns) VALUES (?1, ?2, ?3, ?4)",
        params![manifest, kind.as_str(), holder, now_ns()],
    )?;
    Ok(tx.last_insert_rowid())
}

/// Releases lease `lease` (no-op for `None` or one released already).
pub(crate) fn release_lease(tx: &Transaction<'_>, lease: Option<i64>) -> Result<(), StoreError> {
    if let Some(l) = lease {
        tx.exec(
            "UPDATE leases SET released_ns = ?2 WHERE id = ?1 AND released_ns IS NULL",
            params![l, now_ns()],
        )?;
    }
    Ok(())
}

/// The manifest lease `lease` pins. Errors: `Corrupt` when the lease row is gone.
pub(crate) fn lease_manifest(conn: &Connection, lease: i64) -> Result<ManifestId, StoreError> {
    conn.one(
        "SELECT manifest_id FROM leases WHERE id = ?1",
        [lease],
        |r| r.get(0),
    )
    .optional()?
    .ok_or_else(|| StoreError::corrupt("leases", lease, "lease referenced by a session is missing"))
}
