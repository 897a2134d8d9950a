//! Layer rows: one per directory under `l/` (and committed session uppers).

use std::path::PathBuf;

use rusqlite::{params, Connection, OptionalExtension, Transaction};

use crate::db::Cached;
use crate::error::StoreError;
use crate::{layer_rel, now_ns, LayerId, LayerKind, SessionId, Store};

/// Inserts a layer row of `kind` whose directory is `l/<id>`; returns its id.
/// Ids are `AUTOINCREMENT`: never reused, so a leftover directory can never be
/// mistaken for a new layer's.
pub(crate) fn insert_layer(
    tx: &Transaction<'_>,
    kind: LayerKind,
    stack: Option<&str>,
    session: Option<SessionId>,
) -> Result<LayerId, StoreError> {
    let next: i64 = tx.one(
        "SELECT COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'layers'), 0) + 1",
        [],
        |r| r.get(0),
    )?;
    tx.exec(
        "INSERT INTO layers(id, kind, path, stack, session_id, created_ns) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![next, kind.as_str(), layer_rel(next), stack, session, now_ns()],
    )?;
    Ok(next)
}

impl Store {
    /// The directories of layers `ids`, in the same order.
    /// Errors: `LayerNotFound`.
    pub(crate) fn layer_dirs(
        &self,
        conn: &Connection,
        ids: &[LayerId],
    ) -> Result<Vec<PathBuf>, StoreError> {
        let mut stmt = conn.prepare_cached("SELECT path FROM layers WHERE id = ?1")?;
        ids.iter()
            .map(|id| {
                let rel: String = stmt
                    .query_row([id], |r| r.get(0))
                    .optional()?
                    .ok_or(StoreError::LayerNotFound(*id))?;
                Ok(self.root.join(rel))
            })
            .collect()
    }
}
