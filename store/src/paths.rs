//! The path index: what each published layer changed, one typed row per
//! (path, layer) (ARCHITECTURE.md §9).
//!
//! A publish never loads the index whole: it asks for the paths it touches and
//! the directories above them ([`PathQuery::exact`]) and for the subtrees of what
//! it deleted or replaced ([`PathQuery::below`]), restricted to the layers a head
//! has that its lease does not. The primary key `(path, layer_id)` makes each
//! exact path one index seek and each subtree one range scan; a lower bound on
//! the layer id (the oldest layer asked about) keeps a path edited by every
//! publish from costing its whole history.

use std::collections::{BTreeMap, HashMap, HashSet};

use rusqlite::{params, Connection, Transaction};

use crate::db::{digest_col, u32_col};
use crate::error::StoreError;
use crate::stacks::manifest_layers;
use crate::{ChangeKind, HeadChanges, IndexEntry, LayerId, ManifestId, PathQuery, Store};

/// Inserts `entries` as layer `layer`'s path index.
pub(crate) fn insert_index(
    tx: &Transaction<'_>,
    layer: LayerId,
    entries: &[IndexEntry],
) -> Result<(), StoreError> {
    let mut ins = tx.prepare_cached(
        "INSERT OR REPLACE INTO layer_paths(path, layer_id, kind, digest, mode, uid, gid, xattrs) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?;
    for e in entries {
        ins.execute(params![
            e.path,
            layer,
            e.kind.code(),
            e.digest.map(|d| d.to_vec()),
            e.mode,
            e.uid,
            e.gid,
            e.xattrs.map(|d| d.to_vec()),
        ])?;
    }
    Ok(())
}

/// The end (exclusive) of the key range of paths strictly below `dir`:
/// `dir/` ≤ path < `dir0` (`'0'` is `'/'` + 1).
fn below_range(dir: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let mut lo = dir.to_vec();
    lo.push(b'/');
    let mut hi = dir.to_vec();
    hi.push(b'0');
    (lo, hi)
}

type RawEntry = (
    Vec<u8>,
    i64,
    i64,
    Option<Vec<u8>>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<Vec<u8>>,
);

fn raw_entry(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawEntry> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        r.get(6)?,
        r.get(7)?,
    ))
}

fn entry_from_raw(raw: RawEntry) -> Result<(LayerId, IndexEntry), StoreError> {
    let (path, layer, kind, digest, mode, uid, gid, xattrs) = raw;
    let key = || format!("layer {layer}, path {}", crate::escape_path(&path));
    let kind = ChangeKind::from_code(kind)
        .ok_or_else(|| StoreError::corrupt("layer_paths", key(), format!("kind {kind}")))?;
    let entry = IndexEntry {
        kind,
        digest: digest_col(digest, "layer_paths", &key)?,
        mode: u32_col(mode, "layer_paths", &key)?,
        uid: u32_col(uid, "layer_paths", &key)?,
        gid: u32_col(gid, "layer_paths", &key)?,
        xattrs: digest_col(xattrs, "layer_paths", &key)?,
        path,
    };
    Ok((layer, entry))
}

const ENTRY_COLS: &str = "path, layer_id, kind, digest, mode, uid, gid, xattrs";

/// The index entries of `layers` (newest first) at the paths `query` asks
/// about, grouped per layer in that order, entries sorted by path.
pub(crate) fn query_layers(
    conn: &Connection,
    layers: &[LayerId],
    query: &PathQuery,
) -> Result<HeadChanges, StoreError> {
    if layers.is_empty() || (query.exact.is_empty() && query.below.is_empty()) {
        return Ok(Vec::new());
    }
    let wanted: HashSet<LayerId> = layers.iter().copied().collect();
    let min = layers.iter().copied().min().unwrap_or(0);
    let mut found: HashMap<LayerId, BTreeMap<Vec<u8>, IndexEntry>> = HashMap::new();
    let mut keep = |raw: RawEntry| -> Result<(), StoreError> {
        if !wanted.contains(&raw.1) {
            return Ok(());
        }
        let (layer, e) = entry_from_raw(raw)?;
        found.entry(layer).or_default().insert(e.path.clone(), e);
        Ok(())
    };
    {
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {ENTRY_COLS} FROM layer_paths WHERE path = ?1 AND layer_id >= ?2"
        ))?;
        for p in &query.exact {
            for raw in stmt.query_map(params![p, min], raw_entry)? {
                keep(raw?)?;
            }
        }
    }
    {
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {ENTRY_COLS} FROM layer_paths WHERE path >= ?1 AND path < ?2 AND layer_id >= ?3"
        ))?;
        for d in &query.below {
            let (lo, hi) = below_range(d);
            for raw in stmt.query_map(params![lo, hi, min], raw_entry)? {
                keep(raw?)?;
            }
        }
    }
    Ok(layers
        .iter()
        .filter_map(|l| {
            found
                .remove(l)
                .map(|m| (*l, m.into_values().collect::<Vec<_>>()))
        })
        .collect())
}

/// `layers` with every squashed layer replaced by its members (recursively),
/// newest first: the layers as published, whose path index rows the gate reads.
pub(crate) fn expand(conn: &Connection, layers: &[LayerId]) -> Result<Vec<LayerId>, StoreError> {
    let mut stmt = conn
        .prepare_cached("SELECT member_id FROM squash_members WHERE layer_id = ?1 ORDER BY pos")?;
    let mut out = Vec::with_capacity(layers.len());
    let mut todo: Vec<LayerId> = layers.iter().rev().copied().collect();
    while let Some(l) = todo.pop() {
        let members: Vec<LayerId> = stmt
            .query_map([l], |r| r.get(0))?
            .collect::<Result<_, _>>()?;
        if members.is_empty() {
            out.push(l);
        } else {
            todo.extend(members.into_iter().rev());
        }
    }
    Ok(out)
}

/// The published layers of `to` that `from` does not have, newest first, with
/// squashed layers seen as the runs they replaced: a lease that had a run does
/// not see its squash as a change.
pub(crate) fn layers_since(
    conn: &Connection,
    from: ManifestId,
    to: ManifestId,
) -> Result<Vec<LayerId>, StoreError> {
    if from == to {
        return Ok(Vec::new());
    }
    let had: HashSet<LayerId> = expand(conn, &manifest_layers(conn, from)?)?
        .into_iter()
        .collect();
    Ok(expand(conn, &manifest_layers(conn, to)?)?
        .into_iter()
        .filter(|l| !had.contains(l))
        .collect())
}

impl Store {
    /// The path index of every layer manifest `to` shows that manifest `from`
    /// does not (what a branch published since a lease, or since a publish
    /// observed the head), restricted to `query`: one `(layer, entries)` per layer
    /// with matches, newest layer first.
    ///
    /// Cost: O(depth) to diff the manifests, one index seek per exact path and
    /// one range scan per subtree, reading only rows of layers at least as new as
    /// the oldest layer asked about. Errors: `Corrupt`.
    pub fn changes_between(
        &self,
        from: ManifestId,
        to: ManifestId,
        query: &PathQuery,
    ) -> Result<HeadChanges, StoreError> {
        self.db.read(|conn| {
            let layers = layers_since(conn, from, to)?;
            query_layers(conn, &layers, query)
        })
    }

    /// The whole path index of layer `layer`, sorted by path (for `log --paths`
    /// and diffs). A squashed layer's index is its members' merged: per path, the
    /// newest member's entry. Errors: `Corrupt`.
    pub fn layer_index(&self, layer: LayerId) -> Result<Vec<IndexEntry>, StoreError> {
        self.db.read(|conn| {
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {ENTRY_COLS} FROM layer_paths WHERE layer_id = ?1 ORDER BY path"
            ))?;
            let mut merged: BTreeMap<Vec<u8>, IndexEntry> = BTreeMap::new();
            for member in expand(conn, &[layer])? {
                let raws: Vec<RawEntry> = stmt
                    .query_map([member], raw_entry)?
                    .collect::<Result<_, _>>()?;
                for r in raws {
                    let (_, e) = entry_from_raw(r)?;
                    merged.entry(e.path.clone()).or_insert(e);
                }
            }
            Ok(merged.into_values().collect())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_range_covers_exactly_the_subtree() {
        let (lo, hi) = below_range(b"a/b");
        let inside = [&b"a/b/c"[..], b"a/b/\xff", b"a/b/"];
        let outside = [&b"a/b"[..], b"a/bc", b"a/b.d", b"a/b0", b"a/c"];
        for p in inside {
            assert!(p >= lo.as_slice() && p < hi.as_slice(), "{p:?}");
        }
        for p in outside {
            assert!(!(p >= lo.as_slice() && p < hi.as_slice()), "{p:?}");
        }
    }
}
