//! Adopting a node made by another store (a pull from an OCI registry, issue
//! 23): its layers, its manifest and the node itself, with the node's own id,
//! in ONE write transaction ([`Store::adopt_node`]).
//!
//! The engine stages every layer the store does not hold yet — the layer tar
//! applied in overlay format under `staging/`, its path index captured over
//! the layers below it — and finds the others by diff ID
//! ([`Store::layer_by_diff_id`]). Then, under one write transaction:
//!
//! | step | what |
//! |---|---|
//! | node there? | a node with this id: the same stack, the same layers (by diff ID, or the very layer rows) and the same state → nothing is written, `created: false` (a second pull, or two at once); anything else → `AlreadyExists`, naming the difference. A pruned one (lease released, layers perhaps collected) with the same stack and state is revived: it takes the pulled layers' manifest and a new lease |
//! | layers | each staged layer: a row (kind `published`, no session), its path index, its blob records (the blobs it came as, and its tar as the `none` blob: its diff ID); its directory renamed from `staging/` into `l/<n>` (held in flight until the commit, as an import's and a squash's) — the only filesystem steps inside the transaction |
//! | manifest | the chain from the stack's empty root manifest up, reusing a manifest that already prepends the same layer on the same parent (a node pulled back into the store it came from adds no manifest) |
//! | node | its group (made with the given branch and root when missing: the root may be a node this store does not hold), the node row with its id, kind, state, provenance and creation time, its lease; edges to the parents this store holds, at their positions; the others recorded as its missing parents (`graph_missing_parents`) |
//! | waiting children | every node here that declared this node as a parent it lacked (pulled before it) gets its edge, at its position |
//!
//! So a graph spread over stores stays one graph: a node keeps every parent
//! it declares, held or not ([`NodeInfo::declared_parents`]: what a push of
//! it writes, the same from every store), and the edges appear in whichever
//! order the nodes arrive.
//!
//! Crash story: before the commit, directories under `staging/` or `l/<n>`
//! without rows, both removed by the startup sweep; after it, the whole node.
//! A failed transaction moves every renamed directory back, and the staged
//! directories are removed (they are consumed, as [`Store::import_base`]'s).

use std::path::PathBuf;

use rusqlite::{params, OptionalExtension, Transaction};
use tracing::{info, warn};

use crate::blobs::{record_layer_blob_in, BlobCompression, LayerBlob};
use crate::db::{write_on, Cached};
use crate::error::StoreError;
use crate::graph::{get_group, get_node, validate_adopted_state, NODE_COLS};
use crate::layers::insert_layer;
use crate::leases::new_lease;
use crate::paths::insert_index;
use crate::snapshots::is_digest;
use crate::stacks::{manifest_layers, prepend_manifest};
use crate::{
    fs, now_ns, Durability, GroupInfo, HolderKind, IndexEntry, LayerId, LayerKind, ManifestId,
    NodeInfo, NodeKind, Provenance, Store,
};

/// One blob a layer came as (a registry's layer descriptor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlobRef {
    pub compression: BlobCompression,
    /// `sha256:<64 hex>` of the blob.
    pub digest: String,
    /// Bytes of the blob.
    pub size: u64,
}

/// Where an adopted layer's directory comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerSource {
    /// A published or squashed layer of the stack this store holds already
    /// (found by its diff ID): nothing is copied.
    Existing(LayerId),
    /// A layer directory in overlay upper format directly under
    /// [`Store::staging_path`], and its path index (the capture of it over the
    /// layers below it).
    Staged {
        dir: PathBuf,
        index: Vec<IndexEntry>,
    },
}

/// One layer of an adopted node's manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdoptLayer {
    pub source: LayerSource,
    /// `sha256:<64 hex>` of the layer's tar (its diff ID).
    pub diff_id: String,
    /// Bytes of the layer's tar, when it was read (a staged layer). With the
    /// diff ID it is recorded as the layer's uncompressed blob (compression
    /// `none`), so every staged layer's diff ID is known — to a later pull of
    /// the same node, which compares by it, and to [`Store::layer_by_diff_id`].
    pub tar_size: Option<u64>,
    /// The blobs it came as, recorded for the layer ([`Store::layer_blob`]).
    pub blobs: Vec<BlobRef>,
}

/// The group an adopted node belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdoptGroup {
    pub name: String,
    /// The branch its root was taken from (attempts' sessions name it);
    /// `None`: the store's default branch, when the group is made here.
    pub branch: Option<String>,
    /// Its root node's id (in the store the node came from; this store may
    /// not hold it). Given, a group of this name here must have this root;
    /// `None`: any group of this name on the stack is the node's, and one
    /// made here has the node itself as its root.
    pub root: Option<String>,
}

/// A node made by another store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdoptNode {
    /// Its id, kept (`n` + 16 hex digits for nodes of format ≥ 12 stores).
    pub id: String,
    pub group: AdoptGroup,
    pub kind: NodeKind,
    /// Its JSON state.
    pub state: String,
    /// Its parents, in order: every one it declares. Those this store does
    /// not hold get no edge; they are kept as its missing parents and linked
    /// when they arrive.
    pub parents: Vec<String>,
    pub provenance: Provenance,
    /// When it was made (ns since the epoch), in the store it came from.
    pub created_ns: i64,
}

impl AdoptNode {
    /// `node` of `group` as a store holds it: what a push carries (in the
    /// image's annotations) for a pull to adopt. Its parents are the ones it
    /// declares (held here or not), so a store that pulled it before its
    /// parents pushes the same parents as the store that made it.
    pub fn of(node: &NodeInfo, group: &GroupInfo) -> AdoptNode {
        AdoptNode {
            id: node.id.clone(),
            group: AdoptGroup {
                name: group.name.clone(),
                branch: Some(group.branch.clone()),
                root: Some(group.root.clone()),
            },
            kind: node.kind,
            state: node.state.clone(),
            parents: node.declared_parents.clone(),
            provenance: Provenance {
                command: node.command.clone(),
                labels: node.labels.clone(),
                exit_status: node.exit_status,
                private_bytes: node.private_bytes,
            },
            created_ns: node.created_ns,
        }
    }
}

/// What [`Store::adopt_node`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adopted {
    pub node: NodeInfo,
    /// `false`: the node was there already with the same content; nothing
    /// was written and the staged directories were removed. `true` also when
    /// a pruned node of this id was revived (its manifest and lease anew).
    pub created: bool,
    /// The layers of its manifest, oldest first (above the stack's base).
    pub layers: Vec<LayerId>,
    /// The layers this adoption added (from staged directories).
    pub new_layers: Vec<LayerId>,
    /// Parents it names that this store does not hold (no edge was made;
    /// they are its [`NodeInfo::missing_parents`], linked when they arrive).
    pub missing_parents: Vec<String>,
    /// Nodes here that named this node as a parent they lacked (pulled
    /// before it): each got its edge in this transaction. Empty when the
    /// node was here already.
    pub linked_children: Vec<String>,
}

/// What [`Store::adopt_layers`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdoptedLayers {
    /// The manifest of the layers (its working branch points at it).
    pub manifest: ManifestId,
    /// Its layers above the stack's base, oldest first.
    pub layers: Vec<LayerId>,
    /// The layers this adoption added (from staged directories).
    pub new_layers: Vec<LayerId>,
}

/// `StackNotFound` unless `stack` is a stack of the store.
fn require_stack(tx: &Transaction<'_>, stack: &str) -> Result<(), StoreError> {
    let exists: Option<i64> = tx
        .one("SELECT 1 FROM stacks WHERE id = ?1", [stack], |r| r.get(0))
        .optional()?;
    match exists {
        Some(_) => Ok(()),
        None => Err(StoreError::StackNotFound(stack.into())),
    }
}

/// A rolled-back adoption: every directory renamed into `l/` goes back
/// where the cleanup finds it.
fn move_back(moved: &[(PathBuf, PathBuf)]) {
    for (from, to) in moved.iter().rev() {
        if std::fs::symlink_metadata(to).is_ok() && std::fs::symlink_metadata(from).is_err() {
            let _ = std::fs::rename(to, from);
        }
    }
}

/// Node `child`'s declared `parents`: an edge to each this store holds (at
/// its position), a missing-parent row for each other; a position that has
/// either already is kept as it is (a node's parents never change). Returns
/// the parents it does not hold.
fn link_parents(
    tx: &rusqlite::Transaction<'_>,
    child: &str,
    parents: &[String],
) -> Result<Vec<String>, StoreError> {
    let mut missing = Vec::new();
    for (pos, p) in parents.iter().enumerate() {
        let here: Option<i64> = tx
            .one("SELECT 1 FROM graph_nodes WHERE id = ?1", [p], |r| r.get(0))
            .optional()?;
        let linked: Option<i64> = tx
            .one(
                "SELECT 1 FROM graph_edges WHERE child = ?1 AND pos = ?2",
                params![child, pos as i64],
                |r| r.get(0),
            )
            .optional()?;
        if linked.is_some() {
            continue;
        }
        if here.is_none() {
            missing.push(p.clone());
            tx.exec(
                "INSERT OR IGNORE INTO graph_missing_parents(child, pos, parent) VALUES (?1, ?2, ?3)",
                params![child, pos as i64, p],
            )?;
            continue;
        }
        tx.exec(
            "DELETE FROM graph_missing_parents WHERE child = ?1 AND pos = ?2",
            params![child, pos as i64],
        )?;
        tx.exec(
            "INSERT INTO graph_edges(child, pos, parent) VALUES (?1, ?2, ?3)",
            params![child, pos as i64, p],
        )?;
    }
    Ok(missing)
}

/// Node `parent` is here now: every node that declared it as a parent it
/// lacked gets its edge (at the declared position), its missing-parent row
/// removed. Returns those children, sorted.
pub(crate) fn link_waiting_children(
    tx: &rusqlite::Transaction<'_>,
    parent: &str,
) -> Result<Vec<String>, StoreError> {
    let waiting: Vec<(String, i64)> = {
        let mut stmt = tx.prepare_cached(
            "SELECT child, pos FROM graph_missing_parents WHERE parent = ?1 ORDER BY child, pos",
        )?;
        let v = stmt
            .query_map([parent], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<_, _>>()?;
        v
    };
    let mut children = Vec::new();
    for (child, pos) in waiting {
        tx.exec(
            "INSERT OR IGNORE INTO graph_edges(child, pos, parent) VALUES (?1, ?2, ?3)",
            params![child, pos, parent],
        )?;
        if children.last() != Some(&child) {
            children.push(child);
        }
    }
    tx.exec(
        "DELETE FROM graph_missing_parents WHERE parent = ?1",
        [parent],
    )?;
    Ok(children)
}

/// A node id: 1–128 bytes, no whitespace or control characters (ids are
/// opaque: `n1` of an older store, `n` + 16 hex digits since format 12).
fn validate_node_id(id: &str) -> Result<(), StoreError> {
    if id.is_empty() || id.len() > 128 || id.contains(|c: char| c.is_whitespace() || c.is_control())
    {
        return Err(StoreError::InvalidArgument(format!(
            "node id {id:?}: use 1-128 characters without spaces or control characters"
        )));
    }
    Ok(())
}

/// The diff IDs recorded for `layer` (one per layer; empty when none).
fn recorded_diff_id(tx: &Transaction<'_>, layer: LayerId) -> Result<Option<String>, StoreError> {
    Ok(tx
        .one(
            "SELECT diff_id FROM layer_blobs WHERE layer_id = ?1 LIMIT 1",
            [layer],
            |r| r.get(0),
        )
        .optional()?)
}

/// Why the existing node `existing` is not the one being adopted, if it is not.
fn differs(
    tx: &Transaction<'_>,
    existing: &NodeInfo,
    stack: &str,
    layers: &[AdoptLayer],
    state: &str,
) -> Result<Option<String>, StoreError> {
    let group = get_group(tx, &existing.group)?;
    if group.stack != stack {
        return Ok(Some(format!(
            "it is on stack {}, the pulled one on {stack}",
            group.stack
        )));
    }
    let mut have = manifest_layers(tx, existing.manifest)?;
    have.reverse();
    if have.len() != layers.len() {
        return Ok(Some(format!(
            "it has {} layers above its base, the pulled one {}",
            have.len(),
            layers.len()
        )));
    }
    for (i, (h, a)) in have.iter().zip(layers).enumerate() {
        if a.source == LayerSource::Existing(*h) {
            continue;
        }
        match recorded_diff_id(tx, *h)? {
            Some(d) if d == a.diff_id => {}
            Some(d) => {
                return Ok(Some(format!(
                    "its layer {} (layer {h}) has diff ID {d}, the pulled one {}",
                    i + 1,
                    a.diff_id
                )))
            }
            None => {
                return Err(StoreError::FailedPrecondition(format!(
                    "node {} exists here and its layer {} (layer {h}) has no recorded diff ID to compare with the pulled {}: export or push the node once (which records it), then pull again",
                    existing.id,
                    i + 1,
                    a.diff_id
                )))
            }
        }
    }
    Ok(state_differs(existing, state))
}

/// Whether `existing`'s state is another JSON document than `state`.
fn state_differs(existing: &NodeInfo, state: &str) -> Option<String> {
    let same = match (
        serde_json::from_str::<serde_json::Value>(&existing.state),
        serde_json::from_str::<serde_json::Value>(state),
    ) {
        (Ok(x), Ok(y)) => x == y,
        _ => existing.state == state,
    };
    (!same).then(|| "its state differs".to_string())
}

/// The stack's empty root manifest (made when GC collected it).
fn root_manifest(tx: &Transaction<'_>, stack: &str) -> Result<ManifestId, StoreError> {
    if let Some(m) = tx
        .one(
            "SELECT id FROM manifests WHERE stack = ?1 AND depth = 0 ORDER BY id LIMIT 1",
            [stack],
            |r| r.get(0),
        )
        .optional()?
    {
        return Ok(m);
    }
    tx.exec(
        "INSERT INTO manifests(stack, parent, layer_id, depth, created_ns) VALUES (?1, NULL, NULL, 0, ?2)",
        params![stack, now_ns()],
    )?;
    Ok(tx.last_insert_rowid())
}

/// The manifest of `layers` (oldest first) on `stack`, reusing each step a
/// manifest already takes.
fn chain(tx: &Transaction<'_>, stack: &str, layers: &[LayerId]) -> Result<ManifestId, StoreError> {
    let mut m = root_manifest(tx, stack)?;
    for l in layers {
        let reuse: Option<ManifestId> = tx
            .one(
                "SELECT id FROM manifests WHERE stack = ?1 AND parent = ?2 AND layer_id = ?3 ORDER BY id LIMIT 1",
                params![stack, m, l],
                |r| r.get(0),
            )
            .optional()?;
        m = match reuse {
            Some(r) => r,
            None => prepend_manifest(tx, stack, m, *l)?,
        };
    }
    Ok(m)
}

/// Checks an existing layer: a published or squashed layer of `stack` whose
/// directory is there.
fn check_existing(tx: &Transaction<'_>, stack: &str, layer: LayerId) -> Result<(), StoreError> {
    let row: Option<(String, Option<String>, i64)> = tx
        .one(
            "SELECT kind, stack, dropped FROM layers WHERE id = ?1",
            [layer],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()?;
    let Some((kind, of, dropped)) = row else {
        return Err(StoreError::LayerNotFound(layer));
    };
    if kind != "published" && kind != "squashed" {
        return Err(StoreError::InvalidArgument(format!(
            "layer {layer} is a {kind} layer: a node's manifest holds only published and squashed layers above its stack's base"
        )));
    }
    if of.as_deref() != Some(stack) {
        return Err(StoreError::InvalidArgument(format!(
            "layer {layer} belongs to stack {}, not {stack}",
            of.unwrap_or_default()
        )));
    }
    if dropped != 0 {
        return Err(StoreError::FailedPrecondition(format!(
            "layer {layer}'s directory was freed by GC: stage the layer again"
        )));
    }
    Ok(())
}

impl Store {
    /// Adopts `layers` (a pulled branch head's image above `stack`'s base,
    /// oldest first) as a manifest of `stack`, and points the new hidden
    /// branch `work` at it in the same transaction, so GC keeps it until the
    /// caller has moved a real branch to it and dropped `work` (a `.graph/…`
    /// name: the startup recovery drops one a crash left). The layers are
    /// adopted as [`Store::adopt_node`] adopts a node's (staged ones renamed
    /// into `l/<n>`, existing ones checked, every blob recorded); the
    /// manifest chain reuses the manifests the store has. Staged directories
    /// are consumed as there.
    ///
    /// Errors: `StackNotFound`; `InvalidArgument` (a digest or staged
    /// directory that is not one; an existing layer of another stack or
    /// kind; `work` not under `.graph/`); `LayerNotFound`;
    /// `FailedPrecondition` (an existing layer GC freed; `work` exists);
    /// `Io`, `Db`.
    pub fn adopt_layers(
        &self,
        stack: &str,
        layers: &[AdoptLayer],
        work: &str,
    ) -> Result<AdoptedLayers, StoreError> {
        let out = self.adopt_layers_inner(stack, layers, work);
        self.consume_staged(layers);
        out
    }

    fn adopt_layers_inner(
        &self,
        stack: &str,
        layers: &[AdoptLayer],
        work: &str,
    ) -> Result<AdoptedLayers, StoreError> {
        if !work.starts_with(".graph/") {
            return Err(StoreError::InvalidArgument(format!(
                "working branch {work:?} is not under .graph/"
            )));
        }
        self.check_adopt_layers(layers)?;
        let mut conn = self.db.writer();
        let mut moved: Vec<(PathBuf, PathBuf)> = Vec::new();
        let mut inflight = Vec::new();
        let out = write_on(&mut conn, |tx| {
            moved.clear();
            require_stack(tx, stack)?;
            if crate::stacks::branch_head(tx, stack, work)?.is_some() {
                return Err(StoreError::FailedPrecondition(format!(
                    "working branch {work:?} of stack {stack} exists already"
                )));
            }
            let (ids, new_layers) =
                self.adopt_layers_in(tx, stack, layers, &mut moved, &mut inflight)?;
            self.sync_renamed(&moved)?;
            let manifest = chain(tx, stack, &ids)?;
            let now = now_ns();
            tx.exec(
                "INSERT INTO branches(stack, name, manifest_id, created_ns, updated_ns) VALUES (?1, ?2, ?3, ?4, ?4)",
                params![stack, work, manifest, now],
            )?;
            Ok(AdoptedLayers {
                manifest,
                layers: ids,
                new_layers,
            })
        });
        drop(conn);
        drop(inflight);
        match out {
            Ok(a) => {
                info!(
                    stack,
                    manifest = a.manifest,
                    layers = a.layers.len(),
                    new_layers = a.new_layers.len(),
                    work,
                    "adopted layers"
                );
                Ok(a)
            }
            Err(e) => {
                move_back(&moved);
                Err(e)
            }
        }
    }

    /// Refuses a layer whose diff ID is no digest or whose staged directory
    /// is not directly under staging.
    fn check_adopt_layers(&self, layers: &[AdoptLayer]) -> Result<(), StoreError> {
        let staging = self.staging_path();
        for l in layers {
            if !is_digest(&l.diff_id) {
                return Err(StoreError::InvalidArgument(format!(
                    "diff ID {:?} is not sha256:<64 lowercase hex digits>",
                    l.diff_id
                )));
            }
            if let LayerSource::Staged { dir, .. } = &l.source {
                if dir.parent() != Some(staging.as_path()) {
                    return Err(StoreError::InvalidArgument(format!(
                        "{} is not a directory of the store's staging directory {}",
                        dir.display(),
                        staging.display()
                    )));
                }
            }
        }
        Ok(())
    }

    /// Removes the staged directories of `layers` that are still there
    /// (never one outside staging: refused, not consumed).
    fn consume_staged(&self, layers: &[AdoptLayer]) {
        let staging = self.staging_path();
        for l in layers {
            if let LayerSource::Staged { dir, .. } = &l.source {
                if dir.parent() == Some(staging.as_path()) && std::fs::symlink_metadata(dir).is_ok()
                {
                    if let Err(e) = fs::remove_tree(dir) {
                        warn!(path = %dir.display(), error = %e, "cannot remove a staged layer; the startup sweep will");
                    }
                }
            }
        }
    }

    /// After renames into `l/`: `l/` synced (durable profile).
    fn sync_renamed(&self, moved: &[(PathBuf, PathBuf)]) -> Result<(), StoreError> {
        if moved.is_empty() {
            return Ok(());
        }
        let l = self.root.join("l");
        match self.durability {
            Durability::Durable => fs::fsync_dir(&l),
            Durability::Disposable => Ok(()),
        }
        .and_then(|()| crate::failpoints::fail("adopt.renamed", &self.root))
        .map_err(|e| StoreError::io(&l, e))
    }

    /// The layer rows of `layers` on `stack` (oldest first) in `tx`: each
    /// staged one inserted (kind `published`, its index, its directory
    /// renamed from staging into `l/<n>` and recorded in `moved`, held in
    /// flight in `inflight` until the commit), each existing one checked;
    /// every layer's blobs recorded. Returns (the layers, the new ones).
    fn adopt_layers_in(
        &self,
        tx: &Transaction<'_>,
        stack: &str,
        layers: &[AdoptLayer],
        moved: &mut Vec<(PathBuf, PathBuf)>,
        inflight: &mut Vec<crate::InFlightGuard>,
    ) -> Result<(Vec<LayerId>, Vec<LayerId>), StoreError> {
        let mut ids = Vec::with_capacity(layers.len());
        let mut new_layers = Vec::new();
        for l in layers {
            let id = match &l.source {
                LayerSource::Existing(id) => {
                    check_existing(tx, stack, *id)?;
                    *id
                }
                LayerSource::Staged { dir, index } => {
                    let id = insert_layer(tx, LayerKind::Published, Some(stack), None)?;
                    inflight.push(self.inflight.hold(crate::layer_rel(id)));
                    insert_index(tx, id, index)?;
                    let to = self.layer_path(id);
                    crate::failpoints::fail("adopt.before_rename", &self.root)
                        .and_then(|()| std::fs::rename(dir, &to))
                        .map_err(|e| StoreError::io(dir, e))?;
                    moved.push((dir.clone(), to));
                    new_layers.push(id);
                    id
                }
            };
            let tar = l.tar_size.map(|size| BlobRef {
                compression: BlobCompression::None,
                digest: l.diff_id.clone(),
                size,
            });
            for b in l.blobs.iter().chain(tar.as_ref()) {
                record_layer_blob_in(
                    tx,
                    &LayerBlob {
                        layer: id,
                        compression: b.compression,
                        digest: b.digest.clone(),
                        diff_id: l.diff_id.clone(),
                        size: b.size,
                    },
                )?;
            }
            ids.push(id);
        }
        Ok((ids, new_layers))
    }

    /// Adopts `node`, made by another store, on `stack` with `layers` (its
    /// manifest above the stack's base, oldest first) — see the module docs.
    /// Staged directories are consumed: renamed into `l/<n>` when used,
    /// removed otherwise (a node already there, an error) — except one that
    /// is not directly under staging, which is refused and left alone.
    ///
    /// Errors: `StackNotFound`; `InvalidArgument` (a node id, state, digest or
    /// staged directory that is not one; an existing layer of another stack
    /// or kind); `LayerNotFound`; `AlreadyExists` (a node with this id and
    /// other content); `FailedPrecondition` (a group of this name on another
    /// stack or with another root; a node with this id whose layers cannot be
    /// compared; an existing layer GC freed); `Io`, `Db`.
    pub fn adopt_node(
        &self,
        stack: &str,
        layers: &[AdoptLayer],
        node: &AdoptNode,
    ) -> Result<Adopted, StoreError> {
        let out = self.adopt_node_inner(stack, layers, node);
        self.consume_staged(layers);
        out
    }

    /// Adopts many nodes on `stack` in one transaction: each `(layers, node)`
    /// as [`Store::adopt_node`] adopts it, in order (a node may name an
    /// earlier one of the batch as its parent), all or none. What a pull of a
    /// whole subtree, or a tool that builds a large graph, uses instead of one
    /// transaction per node. Answers one [`Adopted`] per node, in order.
    /// Staged directories are consumed as there. Errors: those of
    /// [`Store::adopt_node`] (the first node that fails undoes the batch).
    pub fn adopt_nodes(
        &self,
        stack: &str,
        batch: &[(Vec<AdoptLayer>, AdoptNode)],
    ) -> Result<Vec<Adopted>, StoreError> {
        let out = self.adopt_nodes_inner(stack, batch);
        for (layers, _) in batch {
            self.consume_staged(layers);
        }
        out
    }

    fn adopt_nodes_inner(
        &self,
        stack: &str,
        batch: &[(Vec<AdoptLayer>, AdoptNode)],
    ) -> Result<Vec<Adopted>, StoreError> {
        for (layers, _) in batch {
            self.check_adopt_layers(layers)?;
        }
        let mut conn = self.db.writer();
        let mut moved: Vec<(PathBuf, PathBuf)> = Vec::new();
        let mut inflight = Vec::new();
        let out = write_on(&mut conn, |tx| {
            moved.clear();
            batch
                .iter()
                .map(|(layers, node)| {
                    self.adopt_in(tx, stack, layers, node, &mut moved, &mut inflight)
                })
                .collect::<Result<Vec<_>, _>>()
        });
        if out.as_ref().is_ok_and(|v| v.iter().any(|a| a.created)) {
            crate::failpoints::hit("adopt.committed");
        }
        drop(conn);
        drop(inflight);
        match out {
            Ok(v) => {
                info!(
                    stack,
                    nodes = v.len(),
                    created = v.iter().filter(|a| a.created).count(),
                    new_layers = v.iter().map(|a| a.new_layers.len()).sum::<usize>(),
                    "adopted nodes"
                );
                Ok(v)
            }
            Err(e) => {
                move_back(&moved);
                Err(e)
            }
        }
    }

    fn adopt_node_inner(
        &self,
        stack: &str,
        layers: &[AdoptLayer],
        node: &AdoptNode,
    ) -> Result<Adopted, StoreError> {
        validate_node_id(&node.id)?;
        validate_adopted_state(&node.state)?;
        self.check_adopt_layers(layers)?;
        let mut conn = self.db.writer();
        // (staged dir, its layer dir) renamed so far, to move back on failure.
        let mut moved: Vec<(PathBuf, PathBuf)> = Vec::new();
        let mut inflight = Vec::new();
        let out = write_on(&mut conn, |tx| {
            moved.clear();
            self.adopt_in(tx, stack, layers, node, &mut moved, &mut inflight)
        });
        if out.as_ref().is_ok_and(|a| a.created) {
            crate::failpoints::hit("adopt.committed");
        }
        drop(conn);
        drop(inflight);
        match out {
            Ok(a) => {
                info!(
                    node = %a.node.id,
                    graph = %a.node.group,
                    stack,
                    created = a.created,
                    layers = a.layers.len(),
                    new_layers = a.new_layers.len(),
                    missing_parents = a.missing_parents.len(),
                    linked_children = a.linked_children.len(),
                    "adopted node"
                );
                Ok(a)
            }
            Err(e) => {
                move_back(&moved);
                Err(e)
            }
        }
    }

    /// One node's adoption in `tx` ([`Store::adopt_node`] and
    /// [`Store::adopt_nodes`]): staged directories renamed into `l/` are
    /// recorded in `moved`, their layers held in `inflight` until the commit.
    fn adopt_in(
        &self,
        tx: &Transaction<'_>,
        stack: &str,
        layers: &[AdoptLayer],
        node: &AdoptNode,
        moved: &mut Vec<(PathBuf, PathBuf)>,
        inflight: &mut Vec<crate::InFlightGuard>,
    ) -> Result<Adopted, StoreError> {
        validate_node_id(&node.id)?;
        validate_adopted_state(&node.state)?;
        require_stack(tx, stack)?;
        let there: Option<i64> = tx
            .one("SELECT 1 FROM graph_nodes WHERE id = ?1", [&node.id], |r| {
                r.get(0)
            })
            .optional()?;
        // A pruned node of this id (its lease released, its layers perhaps
        // collected): revived with the pulled layers if it is the same
        // node as far as what is left tells (stack, state).
        let mut revive: Option<NodeInfo> = None;
        if there.is_some() {
            let existing = get_node(tx, &node.id)?;
            if existing.pruned {
                let g = get_group(tx, &existing.group)?;
                let why = if g.stack != stack {
                    Some(format!(
                        "it is on stack {}, the pulled one on {stack}",
                        g.stack
                    ))
                } else {
                    state_differs(&existing, &node.state)
                };
                if let Some(why) = why {
                    return Err(StoreError::AlreadyExists(format!(
                        "node {} exists here (pruned) with other content: {why}; a node id names one node",
                        node.id
                    )));
                }
                revive = Some(existing);
            }
        }
        if there.is_some() && revive.is_none() {
            let existing = get_node(tx, &node.id)?;
            if let Some(why) = differs(tx, &existing, stack, layers, &node.state)? {
                return Err(StoreError::AlreadyExists(format!(
                    "node {} exists here with other content: {why}; a node id names one node (pull it into another store, or prune and remove this one first)",
                    node.id
                )));
            }
            let mut ids = manifest_layers(tx, existing.manifest)?;
            ids.reverse();
            // Parents it declares that an older store (format < 15) did
            // not record, or that arrived outside a pull: recorded now.
            let missing = link_parents(tx, &node.id, &node.parents)?;
            return Ok(Adopted {
                node: get_node(tx, &node.id)?,
                created: false,
                layers: ids,
                new_layers: Vec::new(),
                missing_parents: missing,
                linked_children: Vec::new(),
            });
        }
        // The group: the same graph (stack and root), or a new one (a
        // revived node keeps its own).
        match get_group(tx, &node.group.name) {
            _ if revive.is_some() => {}
            Ok(g) if g.stack != stack || node.group.root.as_ref().is_some_and(|r| *r != g.root) => {
                return Err(StoreError::FailedPrecondition(format!(
                    "graph {:?} exists here on stack {} with root {}, the pulled node's graph is on stack {stack} with root {}: pull it into a graph of another name (layerstack pull --graph NAME; Python pull(graph=NAME))",
                    g.name,
                    g.stack,
                    g.root,
                    node.group.root.as_deref().unwrap_or("(not given)")
                )));
            }
            Ok(_) => {}
            Err(StoreError::NotFound(_)) => {
                crate::graph::validate_group_name(&node.group.name)?;
                tx.exec(
                    "INSERT INTO graph_groups(name, stack, branch, root, created_ns) VALUES (?1, ?2, ?3, ?4, ?5)",
                    params![
                        node.group.name,
                        stack,
                        node.group.branch.as_deref().unwrap_or(&self.default_branch),
                        node.group.root.as_deref().unwrap_or(&node.id),
                        now_ns()
                    ],
                )?;
            }
            Err(e) => return Err(e),
        }
        let (ids, new_layers) = self.adopt_layers_in(tx, stack, layers, moved, inflight)?;
        self.sync_renamed(moved)?;
        let manifest = chain(tx, stack, &ids)?;
        let lease = new_lease(tx, manifest, HolderKind::Node, &node.id)?;
        let base: String = tx.one(
            "SELECT base_digest FROM stacks WHERE id = ?1",
            [stack],
            |r| r.get(0),
        )?;
        let prov = &node.provenance;
        if revive.is_some() {
            tx.exec(
                "UPDATE graph_nodes SET manifest_id = ?2, lease_id = ?3, pruned = 0 WHERE id = ?1",
                params![node.id, manifest, lease],
            )?;
            let missing = link_parents(tx, &node.id, &node.parents)?;
            let linked_children = link_waiting_children(tx, &node.id)?;
            return Ok(Adopted {
                node: get_node(tx, &node.id)?,
                created: true,
                layers: ids,
                new_layers,
                missing_parents: missing,
                linked_children,
            });
        }
        tx.exec(
            &format!("INSERT INTO graph_nodes({NODE_COLS}, lease_id) VALUES (?1, ?2, ?3, ?4, ?5, NULL, ?6, ?7, ?8, ?9, ?10, 0, ?11, ?12)"),
            params![
                node.id,
                node.group.name,
                node.kind.as_str(),
                manifest,
                node.state,
                prov.command,
                serde_json::to_string(&prov.labels).unwrap_or_else(|_| "{}".into()),
                prov.exit_status,
                prov.private_bytes.map(|b| i64::try_from(b).unwrap_or(i64::MAX)),
                base,
                node.created_ns,
                lease
            ],
        )?;
        let missing = link_parents(tx, &node.id, &node.parents)?;
        let linked_children = link_waiting_children(tx, &node.id)?;
        Ok(Adopted {
            node: get_node(tx, &node.id)?,
            created: true,
            layers: ids,
            new_layers,
            missing_parents: missing,
            linked_children,
        })
    }
}
