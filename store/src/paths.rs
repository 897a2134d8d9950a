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
use std::sync::{Arc, Mutex};

use rusqlite::{params, Connection, Transaction};

use crate::db::Cached;
use crate::db::{digest_col, u32_col};
use crate::error::StoreError;
use crate::stacks::{manifest_layers, manifest_row};
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

/// A `layer_paths` row as stored ([`ENTRY_COLS`]), read by column name.
struct RawEntry {
    path: Vec<u8>,
    layer_id: i64,
    kind: i64,
    digest: Option<Vec<u8>>,
    mode: Option<i64>,
    uid: Option<i64>,
    gid: Option<i64>,
    xattrs: Option<Vec<u8>>,
}

fn raw_entry(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawEntry> {
    Ok(RawEntry {
        path: r.get("path")?,
        layer_id: r.get("layer_id")?,
        kind: r.get("kind")?,
        digest: r.get("digest")?,
        mode: r.get("mode")?,
        uid: r.get("uid")?,
        gid: r.get("gid")?,
        xattrs: r.get("xattrs")?,
    })
}

fn entry_from_raw(raw: RawEntry) -> Result<(LayerId, IndexEntry), StoreError> {
    let RawEntry {
        path,
        layer_id: layer,
        kind,
        digest,
        mode,
        uid,
        gid,
        xattrs,
    } = raw;
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

/// The rows of one path the gate reads, by position in the layers asked about
/// (0 = newest): the newest, and the newest that hides below the path.
#[derive(Default, Clone, Copy)]
struct Pick {
    newest: Option<(usize, LayerId)>,
    hiding: Option<(usize, LayerId)>,
}

impl Pick {
    fn consider(&mut self, pos: usize, layer: LayerId, kind: i64) {
        if self.newest.is_none_or(|(p, _)| pos < p) {
            self.newest = Some((pos, layer));
        }
        // An unknown code is kept as hiding, so the fetch below reports it Corrupt.
        if ChangeKind::from_code(kind).is_none_or(ChangeKind::hides_below)
            && self.hiding.is_none_or(|(p, _)| pos < p)
        {
            self.hiding = Some((pos, layer));
        }
    }

    /// [`Pick::consider`] for a row known to hide below its path.
    fn consider_hiding(&mut self, pos: usize, layer: LayerId, kind: i64) {
        if ChangeKind::from_code(kind).is_none_or(ChangeKind::hides_below)
            && self.hiding.is_none_or(|(p, _)| pos < p)
        {
            self.hiding = Some((pos, layer));
        }
    }

    fn layers(self) -> impl Iterator<Item = LayerId> {
        let newest = self.newest.map(|(_, l)| l);
        let hiding = self.hiding.map(|(_, l)| l).filter(|l| Some(*l) != newest);
        newest.into_iter().chain(hiding)
    }
}

/// For `layers` (newest first), `bound[f]`: the smallest layer id at a position
/// newer than `f` (`i64::MAX` for `f = 0`). Scanning a path's rows by
/// descending layer id with a row at position `f` found, a row whose id is
/// below `bound[f]` — and every row after it — cannot be newer by position, so
/// the scan stops there. Ids are nearly in position order (a publish takes its
/// id when it is staged, and commits in gate order), so the scan usually stops
/// at the row after the one it keeps.
fn newer_bound(layers: &[LayerId]) -> Vec<LayerId> {
    let mut bound = Vec::with_capacity(layers.len());
    let mut min = LayerId::MAX;
    for l in layers {
        bound.push(min);
        min = min.min(*l);
    }
    bound
}

/// The index entries of `layers` (newest first) at the paths `query` asks
/// about, grouped per layer in that order, entries sorted by path — per path only
/// the rows the gate reads (see [`HeadChanges`]): the newest, and the newest
/// hiding one. A directory every publish touches (the shared parent of N
/// sessions' work) thus costs two rows, not one per layer.
///
/// Cost: per exact path two descending index scans that stop as soon as no
/// older row can be newer by position (typically a row or two each, whatever
/// the number of layers with a row there); one range scan per subtree over the
/// rows of layers at least as new as the oldest asked about, reading two integer
/// columns of each; then one primary-key fetch per row kept. Newest means by
/// position in `layers` (the manifest's order), not by layer id: ids are taken
/// when a publish is staged and publishes commit in gate order.
pub(crate) fn query_layers(
    conn: &Connection,
    layers: &[LayerId],
    query: &PathQuery,
) -> Result<HeadChanges, StoreError> {
    if layers.is_empty() || (query.exact.is_empty() && query.below.is_empty()) {
        return Ok(Vec::new());
    }
    let position: HashMap<LayerId, usize> =
        layers.iter().enumerate().map(|(i, l)| (*l, i)).collect();
    let min = layers.iter().copied().min().unwrap_or(0);
    let mut picks: BTreeMap<Vec<u8>, Pick> = BTreeMap::new();
    {
        // Per exact path two descending scans, each stopped as soon as no row
        // left can be newer by position than the one found (`newer_bound`): the
        // newest row among all, and the newest among the hiding ones (the
        // partial index `layer_paths_hiding`). A directory that each of N
        // publishes since the lease wrote costs a row or two, not N.
        let mut all = conn.prepare_cached(
            "SELECT layer_id, kind FROM layer_paths WHERE path = ?1 AND layer_id >= ?2 ORDER BY layer_id DESC",
        )?;
        let mut hiding = conn.prepare_cached(
            "SELECT layer_id, kind FROM layer_paths INDEXED BY layer_paths_hiding WHERE path = ?1 AND layer_id >= ?2 AND kind NOT IN (2, 5) ORDER BY layer_id DESC",
        )?;
        let bound = newer_bound(layers);
        for p in &query.exact {
            let mut pick = Pick::default();
            for (stmt, hiding_only) in [(&mut all, false), (&mut hiding, true)] {
                let mut found: Option<usize> = None;
                let mut rows = stmt.query(params![p, min])?;
                while let Some(r) = rows.next()? {
                    let layer: LayerId = r.get(0)?;
                    if found.is_some_and(|f| layer < bound[f]) {
                        break;
                    }
                    let Some(&pos) = position.get(&layer) else {
                        continue;
                    };
                    let kind = r.get(1)?;
                    if hiding_only {
                        pick.consider_hiding(pos, layer, kind);
                    } else {
                        pick.consider(pos, layer, kind);
                    }
                    if found.is_none_or(|f| pos < f) {
                        found = Some(pos);
                    }
                }
            }
            if pick.newest.is_some() {
                picks.insert(p.clone(), pick);
            }
        }
    }
    {
        let mut stmt = conn.prepare_cached(
            "SELECT path, layer_id, kind FROM layer_paths WHERE path >= ?1 AND path < ?2 AND layer_id >= ?3",
        )?;
        for d in &query.below {
            let (lo, hi) = below_range(d);
            let mut rows = stmt.query(params![lo, hi, min])?;
            while let Some(r) = rows.next()? {
                let layer: LayerId = r.get(1)?;
                let Some(&pos) = position.get(&layer) else {
                    continue;
                };
                let rusqlite::types::ValueRef::Blob(path) = r.get_ref(0)? else {
                    return Err(StoreError::corrupt(
                        "layer_paths",
                        format!("layer {layer}, below {}", crate::escape_path(d)),
                        "a path that is not a blob",
                    ));
                };
                let kind = r.get(2)?;
                match picks.get_mut(path) {
                    Some(pick) => pick.consider(pos, layer, kind),
                    None => {
                        let mut pick = Pick::default();
                        pick.consider(pos, layer, kind);
                        picks.insert(path.to_vec(), pick);
                    }
                }
            }
        }
    }
    let mut found: HashMap<LayerId, Vec<IndexEntry>> = HashMap::new();
    let mut fetch = conn.prepare_cached(&format!(
        "SELECT {ENTRY_COLS} FROM layer_paths WHERE path = ?1 AND layer_id = ?2"
    ))?;
    // `picks` is in path order, so each layer's entries come out sorted.
    for (path, pick) in &picks {
        for layer in pick.layers() {
            let raw = fetch.query_row(params![path, layer], raw_entry)?;
            let (layer, e) = entry_from_raw(raw)?;
            found.entry(layer).or_default().push(e);
        }
    }
    Ok(layers
        .iter()
        .filter_map(|l| found.remove(l).map(|v| (*l, v)))
        .collect())
}

/// The published layers each squashed layer stands for, expanded, newest first.
/// Safe to keep for the life of the process and to share between connections: a
/// squashed layer's members are written with its row and never change, and layer
/// ids are never reused (`AUTOINCREMENT`). Bounded: cleared when it holds more
/// than [`Expansions::MAX`] squashed layers.
#[derive(Default, Clone)]
pub(crate) struct Expansions(Arc<Mutex<HashMap<LayerId, Arc<[LayerId]>>>>);

impl Expansions {
    const MAX: usize = 4096;

    fn get(&self, layer: LayerId) -> Option<Arc<[LayerId]>> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&layer)
            .cloned()
    }

    fn put(&self, layer: LayerId, members: Arc<[LayerId]>) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() >= Self::MAX {
            m.clear();
        }
        m.insert(layer, members);
    }
}

/// `layers` with every squashed layer replaced by its members (recursively),
/// newest first: the layers as published, whose path index rows the gate reads.
/// Reads and fills `cache` (the store's).
pub(crate) fn expand(
    conn: &Connection,
    cache: &Expansions,
    layers: &[LayerId],
) -> Result<Vec<LayerId>, StoreError> {
    let mut out = Vec::with_capacity(layers.len());
    for &l in layers {
        out.extend_from_slice(&expansion(conn, cache, l, 0)?);
    }
    Ok(out)
}

/// The direct members of squashed layer `l`, newest first (empty for any other
/// layer).
pub(crate) fn members(conn: &Connection, l: LayerId) -> Result<Vec<LayerId>, StoreError> {
    let mut stmt = conn
        .prepare_cached("SELECT member_id FROM squash_members WHERE layer_id = ?1 ORDER BY pos")?;
    let rows = stmt.query_map([l], |r| r.get(0))?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// `layers` and every layer their squashes compacted, at any depth (nested
/// squashes and their members included): the rows an expansion of `layers`
/// reads.
pub(crate) fn squash_tree(
    conn: &Connection,
    layers: &[LayerId],
) -> Result<HashSet<LayerId>, StoreError> {
    let mut out: HashSet<LayerId> = layers.iter().copied().collect();
    let mut todo: Vec<LayerId> = layers.to_vec();
    while let Some(l) = todo.pop() {
        for m in members(conn, l)? {
            if out.insert(m) {
                todo.push(m);
            }
        }
    }
    Ok(out)
}

/// What layer `l` stands for: itself, or a squashed layer's members expanded.
pub(crate) fn expansion(
    conn: &Connection,
    cache: &Expansions,
    l: LayerId,
    nesting: usize,
) -> Result<Arc<[LayerId]>, StoreError> {
    if let Some(m) = cache.get(l) {
        return Ok(m);
    }
    // A squash of squashes nests once per compaction of a compaction; a cycle
    // can only be a corrupt row.
    if nesting > 1024 {
        return Err(StoreError::corrupt(
            "squash_members",
            l,
            "squashed layers nest more than 1024 deep (a cycle?)",
        ));
    }
    let members = members(conn, l)?;
    if members.is_empty() {
        return Ok(Arc::from([l]));
    }
    let mut out = Vec::with_capacity(members.len());
    for m in members {
        out.extend_from_slice(&expansion(conn, cache, m, nesting + 1)?);
    }
    let out: Arc<[LayerId]> = out.into();
    cache.put(l, out.clone());
    Ok(out)
}

/// The published layers of `to` that `from` does not have, newest first, with
/// squashed layers seen as the runs they replaced: a lease that had a run does
/// not see its squash as a change.
///
/// Only the layers the two manifests do not share are expanded: a layer in both
/// stands for the same published layers in both (a manifest shows each published
/// layer once), so they cancel. Cost: O(depth of both) rows plus, for a squashed
/// layer not yet in `cache`, its members — or, when `to` is `from` with at
/// most [`PREPENDS_WALKED`] layers prepended (a commit's re-check of the head
/// it planned on, under the gate), one primary-key row per prepend.
pub(crate) fn layers_since(
    conn: &Connection,
    cache: &Expansions,
    from: ManifestId,
    to: ManifestId,
) -> Result<Vec<LayerId>, StoreError> {
    if from == to {
        return Ok(Vec::new());
    }
    if let Some(added) = prepended_since(conn, from, to)? {
        // `to` = `added` + `from`'s layers: nothing of `from` is gone.
        return expand(conn, cache, &added);
    }
    let from_layers = manifest_layers(conn, from)?;
    let to_layers = manifest_layers(conn, to)?;
    let in_from: HashSet<LayerId> = from_layers.iter().copied().collect();
    let in_to: HashSet<LayerId> = to_layers.iter().copied().collect();
    let only_from: Vec<LayerId> = from_layers
        .into_iter()
        .filter(|l| !in_to.contains(l))
        .collect();
    let only_to: Vec<LayerId> = to_layers
        .into_iter()
        .filter(|l| !in_from.contains(l))
        .collect();
    let had: HashSet<LayerId> = expand(conn, cache, &only_from)?.into_iter().collect();
    Ok(expand(conn, cache, &only_to)?
        .into_iter()
        .filter(|l| !had.contains(l))
        .collect())
}

/// The most parent links [`prepended_since`] follows.
pub(crate) const PREPENDS_WALKED: usize = 64;

/// The layers `to`'s parent chain prepended on `from`, newest first, when
/// that chain reaches `from` within [`PREPENDS_WALKED`] links; `None`
/// otherwise (a squash or a promote rewrote the chain, or it is longer).
/// Error: `Corrupt` when a manifest row is missing.
fn prepended_since(
    conn: &Connection,
    from: ManifestId,
    to: ManifestId,
) -> Result<Option<Vec<LayerId>>, StoreError> {
    let from_depth = manifest_row(conn, from)?.depth;
    let mut added = Vec::new();
    let mut m = to;
    while m != from {
        let row = manifest_row(conn, m)?;
        if row.depth <= from_depth || added.len() == PREPENDS_WALKED {
            return Ok(None);
        }
        let (Some(parent), Some(layer)) = (row.parent, row.layer) else {
            return Ok(None);
        };
        added.push(layer);
        m = parent;
    }
    Ok(Some(added))
}

/// See [`Store::path_count`].
pub(crate) fn path_count(
    conn: &Connection,
    cache: &Expansions,
    layers: &[LayerId],
) -> Result<i64, StoreError> {
    let expanded = expand(conn, cache, layers)?;
    if let [one] = expanded.as_slice() {
        let n: i64 = conn.one(
            "SELECT count(*) FROM layer_paths WHERE layer_id = ?1",
            [one],
            |r| r.get(0),
        )?;
        return Ok(n);
    }
    let mut stmt = conn.prepare_cached("SELECT path FROM layer_paths WHERE layer_id = ?1")?;
    let mut seen: HashSet<Vec<u8>> = HashSet::new();
    for l in expanded {
        for p in stmt.query_map([l], |r| r.get::<_, Vec<u8>>(0))? {
            seen.insert(p?);
        }
    }
    Ok(seen.len() as i64)
}

impl Store {
    /// The path index of every layer manifest `to` shows that manifest `from`
    /// does not (what a branch published since a lease, or since a publish
    /// observed the head), restricted to `query`: one `(layer, entries)` per layer
    /// with matches, newest layer first. Per path only the rows the gate reads
    /// are returned: the newest, and the newest that hides what is below it (see
    /// `query_layers`); an older row at the same path is left out.
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
            let layers = layers_since(conn, &self.expansions, from, to)?;
            query_layers(conn, &layers, query)
        })
    }

    /// Every path the published layers `layers` changed (squashed layers are
    /// expanded first), sorted by path, each with whether one of those changes
    /// hid what was below the path ([`ChangeKind::hides_below`]: a deletion, an
    /// opaque directory, a non-directory). The input of
    /// `publisher::copy_paths` for what a branch changed since a merge base.
    /// Cost: every path-index row of those layers. Errors: `Corrupt`.
    pub fn paths_changed(&self, layers: &[LayerId]) -> Result<Vec<(Vec<u8>, bool)>, StoreError> {
        self.db.read(|conn| {
            let mut stmt =
                conn.prepare_cached("SELECT path, kind FROM layer_paths WHERE layer_id = ?1")?;
            let mut out: BTreeMap<Vec<u8>, bool> = BTreeMap::new();
            for l in expand(conn, &self.expansions, layers)? {
                let rows: Vec<(Vec<u8>, i64)> = stmt
                    .query_map([l], |r| Ok((r.get(0)?, r.get(1)?)))?
                    .collect::<Result<_, _>>()?;
                for (path, code) in rows {
                    let kind = ChangeKind::from_code(code).ok_or_else(|| {
                        StoreError::corrupt(
                            "layer_paths",
                            format!("layer {l}, path {}", crate::escape_path(&path)),
                            format!("kind {code}"),
                        )
                    })?;
                    *out.entry(path).or_insert(false) |= kind.hides_below();
                }
            }
            Ok(out.into_iter().collect())
        })
    }

    /// The number of distinct paths the layers `layers` changed (squashed layers
    /// expanded): a path several of them changed counts once — the length of
    /// [`Store::layer_index`] for one layer. Errors: `Corrupt`.
    pub fn path_count(&self, layers: &[LayerId]) -> Result<i64, StoreError> {
        self.db
            .read(|conn| path_count(conn, &self.expansions, layers))
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
            for member in expand(conn, &self.expansions, &[layer])? {
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
