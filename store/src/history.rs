//! History that lasts: naming stacks, forking and deleting branches, moving a
//! branch by compare-and-swap, committing a squash, collecting garbage and
//! accounting for every byte (ARCHITECTURE.md §2, §8, §10; seed `000`).
//!
//! Reachability is one set of joins over the normalized manifests: a layer is
//! kept while a branch head, a live lease (session, node, export), a pinned
//! manifest (an operation in flight), a stack's base, a containerd snapshot or a
//! session's private layers reach it. A squashed layer's members stay as rows
//! (their path index is what the gate reads) after their directories are freed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;

use rusqlite::{params, Connection, OptionalExtension, Transaction};
use tracing::{info, warn};

use crate::db::write_on;
use crate::db::Cached;
use crate::error::StoreError;
use crate::layers::insert_layer;
use crate::stacks::{branch_head, manifest_layers, prepend_manifest, set_branch};
use crate::{
    fs, now_ns, validate_branch, BranchInfo, Durability, LayerId, LayerKind, ManifestId, Store,
};

/// What [`Store::commit_squash`] made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Squashed {
    /// The new squashed layer.
    pub layer: LayerId,
    /// The branch's new head.
    pub manifest: ManifestId,
}

/// What [`Store::merge_base`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergeBase {
    /// A manifest of the stack that shows exactly the merge base, every layer of
    /// it with its directory on disk: an existing one when there is one, else
    /// one made for it. A session leased on it reads the merge base.
    pub manifest: ManifestId,
    /// The merge base as published layers, newest first: the longest common
    /// suffix of the two manifests with every squashed layer expanded into the
    /// layers it compacted (at any depth).
    pub base: Vec<LayerId>,
    /// What `a` changed since the merge base: the published layers `a` shows
    /// above it, newest first, squashed layers expanded.
    pub a_changes: Vec<LayerId>,
    /// The layers of `a`'s manifest above the merge base, newest first, when
    /// they hold exactly [`a_changes`](Self::a_changes) (whole layers, so they
    /// can be flattened as they are). `None` when a squashed layer of `a`
    /// compacted layers on both sides of the merge base.
    pub a_layers: Option<Vec<LayerId>>,
}

/// What a layer id of a branch's log denotes ([`Store::log_point`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogPoint {
    /// The view as of that layer: layers, newest first, above the stack's base
    /// layers, every one with its directory on disk.
    pub layers: Vec<LayerId>,
    /// A manifest holding exactly [`layers`](Self::layers), when one exists.
    pub manifest: Option<ManifestId>,
    /// The squashed layer of the branch head that compacted the layer asked
    /// about (at any depth), when it is a member of one rather than a layer of
    /// the head itself.
    pub squash: Option<LayerId>,
}

/// A layer whose expansion is the run `start..start + len` of a sequence of
/// published layers (positions newest first).
#[derive(Debug, Clone, Copy)]
struct Piece {
    start: usize,
    len: usize,
    layer: LayerId,
}

/// True when layer `l`'s directory was freed by GC (the row stays for its path
/// index). Error: `Corrupt` for a missing row.
fn is_dropped(conn: &Connection, l: LayerId) -> Result<bool, StoreError> {
    let d: i64 = conn
        .one("SELECT dropped FROM layers WHERE id = ?1", [l], |r| {
            r.get(0)
        })
        .optional()?
        .ok_or_else(|| {
            StoreError::corrupt("layers", l, "a layer of a manifest or squash is missing")
        })?;
    Ok(d != 0)
}

/// The layers that can stand for parts of positions `lo..` of the expansion of
/// `raw` (a manifest's layers, newest first), as pieces relative to `lo`: each
/// layer of `raw` wholly inside, and — below a squashed layer that straddles
/// `lo` or whose directory was freed — its members, at any depth. Only layers
/// whose directories are on disk are pieces.
fn collect_pieces(
    conn: &Connection,
    cache: &crate::paths::Expansions,
    raw: &[LayerId],
    lo: usize,
    out: &mut Vec<Piece>,
) -> Result<(), StoreError> {
    fn walk(
        conn: &Connection,
        cache: &crate::paths::Expansions,
        layer: LayerId,
        offset: usize,
        lo: usize,
        out: &mut Vec<Piece>,
    ) -> Result<usize, StoreError> {
        let len = crate::paths::expansion(conn, cache, layer, 0)?.len();
        if offset + len <= lo {
            return Ok(len);
        }
        if offset >= lo && !is_dropped(conn, layer)? {
            out.push(Piece {
                start: offset - lo,
                len,
                layer,
            });
            return Ok(len);
        }
        let mut o = offset;
        for m in crate::paths::members(conn, layer)? {
            o += walk(conn, cache, m, o, lo, out)?;
        }
        Ok(len)
    }
    let mut offset = 0;
    for &l in raw {
        offset += walk(conn, cache, l, offset, lo, out)?;
    }
    Ok(())
}

/// The fewest pieces that cover positions `0..k` exactly, in order (newest
/// first), or `None` when no such cover exists.
fn cover(pieces: &[Piece], k: usize) -> Option<Vec<LayerId>> {
    let mut by_start: Vec<Vec<Piece>> = vec![Vec::new(); k];
    for p in pieces {
        if p.len > 0 && p.start + p.len <= k {
            by_start[p.start].push(*p);
        }
    }
    // best[i]: the fewest pieces covering i..k, and the first of them.
    let mut best: Vec<Option<(usize, Option<Piece>)>> = vec![None; k + 1];
    best[k] = Some((0, None));
    for i in (0..k).rev() {
        for p in &by_start[i] {
            if let Some((n, _)) = best[i + p.len] {
                if best[i].is_none_or(|(m, _)| n + 1 < m) {
                    best[i] = Some((n + 1, Some(*p)));
                }
            }
        }
    }
    let mut out = Vec::new();
    let mut i = 0;
    while i < k {
        let (_, p) = best[i]?;
        let p = p?;
        out.push(p.layer);
        i += p.len;
    }
    best[0].map(|_| out)
}

/// The layers of `raw` above expansion position `cut` when a layer boundary
/// falls there (`raw[..j]` whose expansion is `cut` long), else `None`.
fn raw_above(
    conn: &Connection,
    cache: &crate::paths::Expansions,
    raw: &[LayerId],
    cut: usize,
) -> Result<Option<Vec<LayerId>>, StoreError> {
    let mut n = 0;
    for (j, &l) in raw.iter().enumerate() {
        if n == cut {
            return Ok(Some(raw[..j].to_vec()));
        }
        if n > cut {
            return Ok(None);
        }
        n += crate::paths::expansion(conn, cache, l, 0)?.len();
    }
    Ok((n == cut).then(|| raw.to_vec()))
}

/// The layer of `raw` that compacted `member` (its own member, or one of a
/// member's, at any depth), with the position in the expansion of `raw` where
/// `member`'s expansion starts. `None` when no layer of `raw` holds it.
fn compacting_layer(
    conn: &Connection,
    cache: &crate::paths::Expansions,
    raw: &[LayerId],
    member: LayerId,
) -> Result<Option<(LayerId, usize)>, StoreError> {
    // Climb from the member to every squash above it (a layer can be a member
    // of squashes on several branches), then find one of them in `raw`.
    let mut above: HashSet<LayerId> = HashSet::new();
    let mut todo = vec![member];
    {
        let mut stmt =
            conn.prepare_cached("SELECT layer_id FROM squash_members WHERE member_id = ?1")?;
        while let Some(l) = todo.pop() {
            let parents: Vec<LayerId> = stmt
                .query_map([l], |r| r.get(0))?
                .collect::<Result<_, _>>()?;
            for p in parents {
                if above.insert(p) {
                    todo.push(p);
                }
            }
        }
    }
    /// The start of `target`'s expansion inside `layer`'s, when it is there.
    fn find(
        conn: &Connection,
        cache: &crate::paths::Expansions,
        layer: LayerId,
        offset: usize,
        target: LayerId,
        above: &HashSet<LayerId>,
    ) -> Result<Option<usize>, StoreError> {
        if layer == target {
            return Ok(Some(offset));
        }
        if !above.contains(&layer) {
            return Ok(None);
        }
        let mut o = offset;
        for m in crate::paths::members(conn, layer)? {
            if let Some(f) = find(conn, cache, m, o, target, above)? {
                return Ok(Some(f));
            }
            o += crate::paths::expansion(conn, cache, m, 0)?.len();
        }
        Ok(None)
    }
    let mut offset = 0;
    for &l in raw {
        if above.contains(&l) {
            if let Some(at) = find(conn, cache, l, offset, member, &above)? {
                return Ok(Some((l, at)));
            }
        }
        offset += crate::paths::expansion(conn, cache, l, 0)?.len();
    }
    Ok(None)
}

/// See [`Store::log_point`]; `head` is the branch's head, `branch` names it in
/// errors.
fn log_point_on(
    conn: &Connection,
    cache: &crate::paths::Expansions,
    stack: &str,
    branch: &str,
    head: ManifestId,
    layer: LayerId,
) -> Result<LogPoint, StoreError> {
    let raw = manifest_layers(conn, head)?;
    if let Some(pos) = raw.iter().position(|l| *l == layer) {
        return Ok(LogPoint {
            layers: raw[pos..].to_vec(),
            manifest: None,
            squash: None,
        });
    }
    // A base (image) layer: the image alone, below every published layer.
    if crate::stacks::stack_base_layers(conn, stack)?.contains(&layer) {
        return Ok(LogPoint {
            layers: Vec::new(),
            manifest: None,
            squash: None,
        });
    }
    let Some((squash, lo)) = compacting_layer(conn, cache, &raw, layer)? else {
        return Err(StoreError::InvalidArgument(format!(
            "layer {layer} is not in the log of branch {branch:?}, nor a member of one of its squashed layers (see `layerstack log`), nor a base layer of stack {stack}; `--at base` names the image alone"
        )));
    };
    let expanded = crate::paths::expand(conn, cache, &raw)?;
    let want = &expanded[lo..];
    // The manifest that was the head right after the layer was published (or,
    // for a nested squash, committed), if it still exists and every layer of it
    // is on disk.
    let candidates: Vec<ManifestId> = {
        let mut stmt = conn.prepare_cached(
            "SELECT id FROM manifests WHERE stack = ?1 AND layer_id = ?2 ORDER BY id",
        )?;
        let rows = stmt.query_map(params![stack, layer], |r| r.get(0))?;
        rows.collect::<Result<_, _>>()?
    };
    for m in candidates {
        let layers = manifest_layers(conn, m)?;
        if crate::paths::expand(conn, cache, &layers)? != want {
            continue;
        }
        let mut on_disk = true;
        for l in &layers {
            if is_dropped(conn, *l)? {
                on_disk = false;
                break;
            }
        }
        if on_disk {
            return Ok(LogPoint {
                layers,
                manifest: Some(m),
                squash: Some(squash),
            });
        }
    }
    // Else the same view from what is on disk: the layers below the squash and
    // its members from this one down (the squash is a compaction).
    let mut pieces = Vec::new();
    collect_pieces(conn, cache, &raw, lo, &mut pieces)?;
    let layers = cover(&pieces, want.len()).ok_or_else(|| {
        StoreError::FailedPrecondition(format!(
            "layer {layer} of branch {branch:?} was compacted into squashed layer {squash} and gc has freed its directory since: the view as of it can no longer be built; use layer {squash} (the view after the whole squash) or a newer layer"
        ))
    })?;
    Ok(LogPoint {
        layers,
        manifest: None,
        squash: Some(squash),
    })
}

/// What a garbage collection did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Layers whose directories were freed.
    pub layers: Vec<LayerId>,
    /// Manifests whose rows were deleted (nothing reaches them).
    pub manifests: u64,
    /// Real allocated bytes freed: blocks of inodes whose every link was in a
    /// freed directory (holes and hardlinks counted once).
    pub bytes_freed: u64,
}

/// What [`Store::remove_stack`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemovedStack {
    pub branches: u64,
    pub sessions: u64,
    pub leases_released: u64,
}

/// Bytes per accounting class (ARCHITECTURE.md §10), real allocated bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    /// `L_hot`: layers a branch head shows (published, squashed, base).
    pub hot: u64,
    /// `H_cold`: layers only leases, nodes or pinned history reach, and freed
    /// layers' leftovers awaiting GC.
    pub cold: u64,
    /// `ΣU_active`: session uppers and workdirs (kept conflict uppers included).
    pub uppers: u64,
    /// `P_staging`: in-flight builds.
    pub staging: u64,
    /// `M`: SQLite files, the lock and the store's own directories.
    pub metadata: u64,
    /// containerd's own snapshots that belong to no stack (extractions in
    /// progress, committed non-image snapshots, views, unused images).
    pub snapshots: u64,
}

impl Usage {
    /// Everything: the sum of the classes.
    pub fn total(&self) -> u64 {
        self.hot + self.cold + self.uppers + self.staging + self.metadata + self.snapshots
    }
}

/// [`Usage`] of the whole store and per stack.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiskUsage {
    pub total: Usage,
    /// Per stack id: its layers and its sessions' uppers (staging, metadata and
    /// containerd's snapshots are store-wide).
    pub stacks: BTreeMap<String, Usage>,
}

/// The manifest in `head`'s parent chain (itself included) with `depth` layers.
fn ancestor_at_depth(
    conn: &Connection,
    head: ManifestId,
    depth: usize,
) -> Result<Option<ManifestId>, StoreError> {
    let mut next = Some(head);
    while let Some(m) = next {
        let row = crate::stacks::manifest_row(conn, m)?;
        let (parent, d) = (row.parent, row.depth);
        if d as usize == depth {
            return Ok(Some(m));
        }
        if (d as usize) < depth {
            return Ok(None);
        }
        next = parent;
    }
    Ok(None)
}

/// The manifest holding exactly `layers` (newest first) on `stack`, built by
/// prepending on the closest ancestor of `head` that is a suffix of it (the
/// stack's root, the empty manifest, at worst).
fn manifest_for(
    tx: &Transaction<'_>,
    stack: &str,
    head: ManifestId,
    layers: &[LayerId],
) -> Result<ManifestId, StoreError> {
    // Longest suffix of `layers` that is an ancestor of `head`.
    for keep in (0..=layers.len()).rev() {
        let suffix = &layers[layers.len() - keep..];
        if let Some(m) = ancestor_at_depth(tx, head, keep)? {
            if manifest_layers(tx, m)? == suffix {
                let mut m = m;
                for l in layers[..layers.len() - keep].iter().rev() {
                    m = prepend_manifest(tx, stack, m, *l)?;
                }
                return Ok(m);
            }
        }
    }
    Err(StoreError::corrupt(
        "manifests",
        format!("stack {stack}"),
        "no root manifest in the chain",
    ))
}

impl Store {
    /// The stack `spec` names in containerd namespace `namespace`: a stack id
    /// (`<namespace>/sha256:…`, `import:sha256:…`) or a base digest
    /// (`sha256:…`, full or a unique prefix of at least 12 hex digits) of a
    /// stack of `namespace` or of an imported base (which belongs to every
    /// namespace). `None` when no stack matches (the caller may then resolve an
    /// image reference through containerd).
    ///
    /// Errors: `InvalidArgument` when a prefix matches several stacks.
    pub fn resolve_stack(&self, namespace: &str, spec: &str) -> Result<Option<String>, StoreError> {
        self.db.read(|conn| {
            let exact: Option<String> = conn
                .one("SELECT id FROM stacks WHERE id = ?1", [spec], |r| r.get(0))
                .optional()?;
            if exact.is_some() {
                return Ok(exact);
            }
            // `import:<hex prefix>` (what `stack ls` prints for an imported
            // base) names imported bases only.
            let (imported, rest) = match spec.strip_prefix(crate::IMPORT_STACK_PREFIX) {
                Some(r) => (true, r),
                None => (false, spec),
            };
            let hex = rest.strip_prefix("sha256:").unwrap_or(rest);
            if hex.len() < 12 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Ok(None);
            }
            let mut stmt = conn.prepare_cached(
                "SELECT id FROM stacks WHERE (namespace = ?1 OR namespace IS NULL) AND base_digest LIKE ?2 AND (?3 = 0 OR id LIKE 'import:%') ORDER BY id",
            )?;
            let found: Vec<String> = stmt
                .query_map(
                    params![namespace, format!("sha256:{hex}%"), imported],
                    |r| r.get(0),
                )?
                .collect::<Result<_, _>>()?;
            match found.len() {
                0 => Ok(None),
                1 => Ok(found.into_iter().next()),
                n => Err(StoreError::InvalidArgument(format!(
                    "digest prefix {spec:?} matches {n} stacks of namespace {namespace:?} and imported bases: give more digits"
                ))),
            }
        })
    }

    /// Creates branch `name` on `stack` pointing at `from`'s head, or — with
    /// `at` — at the view as of layer `at` of `from`'s log (a layer of its head,
    /// or a member of one of its squashed layers: see [`Store::log_point`]), or
    /// at the stack's empty root manifest (the base image alone) when `at` is one
    /// of the stack's base layers. O(1) writes when that manifest exists (one
    /// row, no copy), else O(depth) manifest rows.
    ///
    /// Errors: `InvalidArgument` (name), `SnapshotExists`-like `FailedPrecondition`
    /// when `name` exists, `BranchNotFound` (`from`), `InvalidArgument` when `at`
    /// is neither in `from`'s log nor a base layer of `stack`,
    /// `FailedPrecondition` when `at`'s view can no longer be built (GC freed a
    /// compacted member's directory).
    pub fn create_branch(
        &self,
        stack: &str,
        name: &str,
        from: &str,
        at: Option<LayerId>,
    ) -> Result<BranchInfo, StoreError> {
        validate_branch(name).map_err(StoreError::InvalidArgument)?;
        self.db.write(|tx| {
            if branch_head(tx, stack, name)?.is_some() {
                return Err(StoreError::FailedPrecondition(format!(
                    "branch {name:?} already exists on stack {stack}: delete it first or choose another name"
                )));
            }
            let head = branch_head(tx, stack, from)?.ok_or_else(|| StoreError::BranchNotFound {
                stack: stack.into(),
                branch: from.into(),
            })?;
            let target = match at {
                None => head,
                Some(layer) => {
                    let point = log_point_on(tx, &self.expansions, stack, from, head, layer)?;
                    match point.manifest {
                        Some(m) => m,
                        None => manifest_for(tx, stack, head, &point.layers)?,
                    }
                }
            };
            let now = now_ns();
            tx.exec(
                "INSERT INTO branches(stack, name, manifest_id, created_ns, updated_ns) VALUES (?1, ?2, ?3, ?4, ?4)",
                params![stack, name, target, now],
            )?;
            let depth: i64 =
                tx.one("SELECT depth FROM manifests WHERE id = ?1", [target], |r| r.get(0))?;
            info!(stack, branch = name, from, manifest = target, "created branch");
            Ok(BranchInfo {
                stack: stack.into(),
                name: name.into(),
                head: target,
                depth,
                updated_ns: now,
            })
        })
    }

    /// Deletes branch `name` of `stack`; its layers stay while anything else
    /// reaches them. The default branch cannot be deleted (new sessions lease it).
    /// Errors: `BranchNotFound`, `FailedPrecondition`.
    pub fn delete_branch(&self, stack: &str, name: &str) -> Result<(), StoreError> {
        if name == self.default_branch {
            return Err(StoreError::FailedPrecondition(format!(
                "branch {name:?} is the default branch (new sessions lease it): it cannot be deleted"
            )));
        }
        self.db.write(|tx| {
            let n = tx.exec(
                "DELETE FROM branches WHERE stack = ?1 AND name = ?2",
                params![stack, name],
            )?;
            if n == 0 {
                return Err(StoreError::BranchNotFound {
                    stack: stack.into(),
                    branch: name.into(),
                });
            }
            info!(stack, branch = name, "deleted branch");
            Ok(())
        })
    }

    /// Points branch `name` of `stack` at `to` if it is at `expected` now
    /// (compare-and-swap; a fast-forward of promote). Errors: `HeadMoved`,
    /// `BranchNotFound`, `InvalidArgument` (a manifest of another stack).
    pub fn move_branch(
        &self,
        stack: &str,
        name: &str,
        expected: ManifestId,
        to: ManifestId,
    ) -> Result<(), StoreError> {
        self.db.write(|tx| {
            let head = branch_head(tx, stack, name)?.ok_or_else(|| StoreError::BranchNotFound {
                stack: stack.into(),
                branch: name.into(),
            })?;
            if head != expected {
                return Err(StoreError::HeadMoved {
                    expected,
                    found: head,
                });
            }
            let on: Option<String> = tx
                .one("SELECT stack FROM manifests WHERE id = ?1", [to], |r| {
                    r.get(0)
                })
                .optional()?;
            if on.as_deref() != Some(stack) {
                return Err(StoreError::InvalidArgument(format!(
                    "manifest {to} is not a manifest of stack {stack}"
                )));
            }
            set_branch(tx, stack, name, to)
        })
    }

    /// The head manifest of `branch` on `stack`. Error: `BranchNotFound`.
    pub fn branch_head(&self, stack: &str, branch: &str) -> Result<ManifestId, StoreError> {
        self.db.read(|conn| {
            branch_head(conn, stack, branch)?.ok_or_else(|| StoreError::BranchNotFound {
                stack: stack.into(),
                branch: branch.into(),
            })
        })
    }

    /// The layer directories of manifest `id` above the stack's base, newest
    /// first, then the stack's base layers: a view of that manifest.
    pub fn manifest_view(&self, stack: &str, id: ManifestId) -> Result<Vec<PathBuf>, StoreError> {
        self.db.read(|conn| {
            let mut layers = manifest_layers(conn, id)?;
            layers.extend(crate::stacks::stack_base_layers(conn, stack)?);
            self.layer_dirs(conn, &layers)
        })
    }

    /// The merge base of manifests `a` and `b` of `stack`, and what `a` changed
    /// since (see [`MergeBase`]). Computed on the layers as published: both
    /// manifests with every squashed layer expanded into the layers it compacted
    /// (at any depth), so a squash on either side, or on both, moves neither the
    /// merge base nor what `a` changed. The merge base's manifest is made of
    /// layers on disk: whole layers of either manifest where they fit, and
    /// below a squashed layer that straddles the merge base, members whose
    /// directories GC has not freed (the fewest layers that do). Creates it
    /// when no such manifest exists yet.
    ///
    /// Cost: O(expanded depth of both) plus the members of the squashed layers
    /// that straddle the merge base. Errors: `Corrupt`; `FailedPrecondition`
    /// when the merge base can no longer be built: both sides compacted the
    /// layers they share into squashed layers that also hold their own later
    /// layers, and GC freed those shared layers' directories.
    pub fn merge_base(
        &self,
        stack: &str,
        a: ManifestId,
        b: ManifestId,
    ) -> Result<MergeBase, StoreError> {
        self.db.write(|tx| {
            let cache = &self.expansions;
            let ra = manifest_layers(tx, a)?;
            let rb = manifest_layers(tx, b)?;
            let ea = crate::paths::expand(tx, cache, &ra)?;
            let eb = crate::paths::expand(tx, cache, &rb)?;
            let k = ea
                .iter()
                .rev()
                .zip(eb.iter().rev())
                .take_while(|(x, y)| x == y)
                .count();
            let (cut_a, cut_b) = (ea.len() - k, eb.len() - k);
            let mut pieces = Vec::new();
            collect_pieces(tx, cache, &ra, cut_a, &mut pieces)?;
            collect_pieces(tx, cache, &rb, cut_b, &mut pieces)?;
            let layers = cover(&pieces, k).ok_or_else(|| {
                StoreError::FailedPrecondition(format!(
                    "the merge base of manifests {a} and {b} ({k} published layers) can no longer be built: both compacted the layers they share into squashed layers together with later ones, and gc has freed the shared layers' directories; publish the changes again in a session on the target branch"
                ))
            })?;
            let head = if rb.ends_with(&layers) && !ra.ends_with(&layers) {
                b
            } else {
                a
            };
            let manifest = manifest_for(tx, stack, head, &layers)?;
            Ok(MergeBase {
                manifest,
                base: ea[cut_a..].to_vec(),
                a_changes: ea[..cut_a].to_vec(),
                a_layers: raw_above(tx, cache, &ra, cut_a)?,
            })
        })
    }

    /// What layer `layer` of the log of `branch` of `stack` denotes: the view
    /// as of it (`diff --at`, `branch create --at`). A layer of the head: the
    /// head's layers from it down. A member of a squashed layer of the head (at
    /// any depth, as `layerstack log` lists it): the view as of its publish —
    /// the manifest that was the head right after it, if it still exists, else
    /// the same view built from the layers below the squash and the squash's
    /// members from this one down (the squash is a compaction, so the view is
    /// the same).
    ///
    /// Errors: `BranchNotFound`; `InvalidArgument` when `layer` is neither;
    /// `FailedPrecondition` when the view can no longer be built (GC freed the
    /// directory of a member it needs).
    pub fn log_point(
        &self,
        stack: &str,
        branch: &str,
        layer: LayerId,
    ) -> Result<LogPoint, StoreError> {
        self.db.read(|conn| {
            let head =
                branch_head(conn, stack, branch)?.ok_or_else(|| StoreError::BranchNotFound {
                    stack: stack.into(),
                    branch: branch.into(),
                })?;
            log_point_on(conn, &self.expansions, stack, branch, head, layer)
        })
    }

    /// The layer of `layers` (a manifest's, newest first) that compacted layer
    /// `member` — a squashed layer holding it as a member, at any depth — or
    /// `None` when none does (also when `member` is itself in `layers`).
    /// Errors: `Corrupt`.
    pub fn compacted_into(
        &self,
        layers: &[LayerId],
        member: LayerId,
    ) -> Result<Option<LayerId>, StoreError> {
        if layers.contains(&member) {
            return Ok(None);
        }
        self.db.read(|conn| {
            Ok(compacting_layer(conn, &self.expansions, layers, member)?.map(|(l, _)| l))
        })
    }

    /// Commits a squash of `run` (layers of `branch`'s head, newest first, one
    /// contiguous run) built in `staging_dir`: under the branch's gate, the head is
    /// `expected_head` (CAS); the run is replaced by one `squashed` layer (the
    /// directory is renamed in, inside the transaction); the layers above it are
    /// prepended again. Sessions and other branches keep their manifests.
    ///
    /// Errors: `HeadMoved`; `FailedPrecondition` when `run` is not a contiguous
    /// run of the head any more (another squash, a branch moved by promote).
    pub fn commit_squash(
        &self,
        stack: &str,
        branch: &str,
        expected_head: ManifestId,
        run: &[LayerId],
        staging_dir: &std::path::Path,
    ) -> Result<Squashed, StoreError> {
        let mut conn = self.db.writer();
        let mut dst = PathBuf::new();
        // The new layer's directory appears (by rename) before its row commits:
        // registered in flight so a concurrent Cleanup sweep leaves it alone.
        let mut inflight = None;
        let out = write_on(&mut conn, |tx| {
            let head =
                branch_head(tx, stack, branch)?.ok_or_else(|| StoreError::BranchNotFound {
                    stack: stack.into(),
                    branch: branch.into(),
                })?;
            if head != expected_head {
                return Err(StoreError::HeadMoved {
                    expected: expected_head,
                    found: head,
                });
            }
            let layers = manifest_layers(tx, head)?;
            let k = layers
                .windows(run.len().max(1))
                .position(|w| w == run)
                .filter(|_| !run.is_empty())
                .ok_or_else(|| {
                    StoreError::FailedPrecondition(format!(
                        "the squashed run is no longer on the head of {branch:?}: squash again"
                    ))
                })?;
            let s = insert_layer(tx, LayerKind::Squashed, Some(stack), None)?;
            inflight = Some(self.inflight.hold(crate::layer_rel(s)));
            {
                let mut ins = tx.prepare_cached(
                    "INSERT INTO squash_members(layer_id, pos, member_id) VALUES (?1, ?2, ?3)",
                )?;
                for (pos, m) in run.iter().enumerate() {
                    ins.execute(params![s, pos as i64, m])?;
                }
            }
            let mut new_layers: Vec<LayerId> = layers[..k].to_vec();
            new_layers.push(s);
            new_layers.extend_from_slice(&layers[k + run.len()..]);
            let m = manifest_for(tx, stack, head, &new_layers)?;
            set_branch(tx, stack, branch, m)?;
            dst = self.layer_path(s);
            crate::failpoints::fail("squash.before_rename", &self.root)
                .and_then(|()| std::fs::rename(staging_dir, &dst))
                .and_then(|()| match self.durability {
                    Durability::Durable => fs::fsync_dir(&self.root.join("l")),
                    Durability::Disposable => Ok(()),
                })
                .and_then(|()| crate::failpoints::fail("squash.renamed", &self.root))
                .map_err(|e| StoreError::io(staging_dir, e))?;
            Ok(Squashed {
                layer: s,
                manifest: m,
            })
        });
        drop(conn);
        drop(inflight);
        match out {
            Ok(sq) => {
                crate::failpoints::hit("squash.committed");
                info!(
                    stack,
                    branch,
                    layer.id = sq.layer,
                    manifest = sq.manifest,
                    members = run.len(),
                    "squashed"
                );
                Ok(sq)
            }
            Err(e) => {
                if std::fs::symlink_metadata(&dst).is_ok()
                    && std::fs::symlink_metadata(staging_dir).is_err()
                {
                    let _ = std::fs::rename(&dst, staging_dir);
                }
                Err(e)
            }
        }
    }

    /// Removes what nothing reaches (see the module docs): rows first, in one
    /// transaction, then directories, outside it. `pinned`: manifests operations
    /// in flight still read (their observed heads). Crash-safe: a directory left
    /// behind has no row and the startup sweep removes it.
    pub fn gc(&self, pinned: &[ManifestId]) -> Result<GcReport, StoreError> {
        // It reads every manifest of the store: through a small page cache.
        let (layers, manifests) = self.db.write_lean(|tx| {
            // Live manifests and their ancestors (kept) and the others (dead)
            // in temporary tables of the writer's connection, emptied before
            // and after: their pages go through the temporary database's
            // bounded page cache (spilled to a temporary file beyond it), not
            // through sets in the daemon's heap that grow with the graph (P12:
            // ~4 MiB at 1,000,000 nodes, the daemon's peak). Made once per
            // connection and never dropped: a change of the temporary schema
            // expires every statement the writer has prepared (the gate's
            // commits would parse theirs again). Not cached statements here.
            tx.execute_batch(
                "CREATE TEMP TABLE IF NOT EXISTS gc_pinned(id INTEGER PRIMARY KEY);
                 CREATE TEMP TABLE IF NOT EXISTS gc_keep(id INTEGER PRIMARY KEY);
                 CREATE TEMP TABLE IF NOT EXISTS gc_dead(id INTEGER PRIMARY KEY);
                 DELETE FROM temp.gc_pinned; DELETE FROM temp.gc_keep; DELETE FROM temp.gc_dead;",
            )?;
            {
                let mut ins = tx.prepare("INSERT OR IGNORE INTO temp.gc_pinned(id) VALUES (?1)")?;
                for m in pinned {
                    ins.execute([m])?;
                }
            }
            // Heads, live leases and pins, then parents until a kept one (the
            // UNION stops at rows already reached). `rest` is in the parent
            // chain: kept with its manifest.
            tx.execute(
                "WITH RECURSIVE k(id) AS (
                     SELECT manifest_id FROM branches
                     UNION SELECT manifest_id FROM leases WHERE released_ns IS NULL
                     UNION SELECT id FROM temp.gc_pinned
                     UNION SELECT m.parent FROM manifests m JOIN k ON m.id = k.id
                           WHERE m.parent IS NOT NULL)
                 INSERT OR IGNORE INTO temp.gc_keep(id) SELECT id FROM k",
                [],
            )?;
            tx.execute(
                "INSERT INTO temp.gc_dead(id)
                 SELECT id FROM manifests WHERE id NOT IN (SELECT id FROM temp.gc_keep)",
                [],
            )?;
            // Dead manifests go with their rows and the released leases on
            // them. One statement each: a dead child's reference to its dead
            // parent is gone by the statement's end, when SQLite checks it.
            tx.execute(
                "DELETE FROM leases WHERE released_ns IS NOT NULL
                 AND manifest_id IN (SELECT id FROM temp.gc_dead)",
                [],
            )?;
            tx.execute(
                "DELETE FROM manifest_layers WHERE manifest_id IN (SELECT id FROM temp.gc_dead)",
                [],
            )?;
            let dead_manifests = tx.execute(
                "DELETE FROM manifests WHERE id IN (SELECT id FROM temp.gc_dead)",
                [],
            )?;
            // Reachable layers: a set of layers, not of manifests.
            let mut reach: HashSet<LayerId> = HashSet::new();
            {
                let mut stmt = tx.prepare(&format!(
                    "SELECT layer_id FROM manifest_layers WHERE manifest_id IN (SELECT id FROM temp.gc_keep)
                     UNION SELECT layer_id FROM stack_layers
                     UNION SELECT layer_id FROM snapshots WHERE layer_id IS NOT NULL
                     UNION SELECT layer_id FROM snapshot_lowers
                     UNION SELECT layer_id FROM session_layers WHERE session_id IN (SELECT id FROM sessions WHERE {})
                     UNION SELECT id FROM layers WHERE kind IN ('active', 'committed', 'pending')",
                    crate::sessions::KEEPS_DIRS
                ))?;
                for l in stmt.query_map([], |r| r.get::<_, i64>(0))? {
                    reach.insert(l?);
                }
            }
            tx.execute_batch(
                "DELETE FROM temp.gc_pinned; DELETE FROM temp.gc_keep; DELETE FROM temp.gc_dead;",
            )?;
            // Rows kept for their path index: members of reachable squashes, at
            // any depth — a squash nested in one keeps its members' rows too (its
            // expansion goes through them).
            let reachable: Vec<LayerId> = reach.iter().copied().collect();
            let retained: HashSet<LayerId> = crate::paths::squash_tree(tx, &reachable)?;
            // Layers: free unreachable directories; drop rows nothing needs.
            let mut free = Vec::new();
            let candidates: Vec<(LayerId, String, bool)> = {
                let mut stmt = tx.prepare_cached(
                    "SELECT id, path, dropped FROM layers WHERE kind IN ('published', 'squashed', 'base')",
                )?;
                let v = stmt
                    .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get::<_, i64>(2)? != 0)))?
                    .collect::<Result<Vec<_>, _>>()?;
                v
            };
            for (id, path, dropped) in candidates {
                if reach.contains(&id) {
                    continue;
                }
                if !dropped {
                    free.push((id, self.root.join(path)));
                }
                if retained.contains(&id) {
                    tx.exec("UPDATE layers SET dropped = 1 WHERE id = ?1", [id])?;
                } else {
                    tx.exec("DELETE FROM layer_paths WHERE layer_id = ?1", [id])?;
                    tx.exec("DELETE FROM squash_members WHERE layer_id = ?1", [id])?;
                    let still_member: i64 = tx.one(
                        "SELECT count(*) FROM squash_members WHERE member_id = ?1",
                        [id],
                        |r| r.get(0),
                    )?;
                    if still_member == 0 {
                        tx.exec("DELETE FROM layers WHERE id = ?1", [id])?;
                    } else {
                        tx.exec("UPDATE layers SET dropped = 1 WHERE id = ?1", [id])?;
                    }
                }
            }
            // Blame rows of deleted layers and removed stacks.
            crate::blame::collect_blame(tx)?;
            Ok((free, dead_manifests as u64))
        })?;
        crate::failpoints::hit("gc.committed");
        // Outside the transaction: measure what really frees, then remove.
        let dirs: Vec<PathBuf> = layers.iter().map(|(_, p)| p.clone()).collect();
        let bytes_freed = fs::freed_bytes(&dirs).unwrap_or(0);
        for d in &dirs {
            if let Err(e) = fs::remove_tree(d) {
                warn!(path = %d.display(), error = %e, "cannot remove a collected layer; the startup sweep will");
            }
            crate::failpoints::hit("gc.removed_one");
        }
        let report = GcReport {
            layers: layers.into_iter().map(|(id, _)| id).collect(),
            manifests,
            bytes_freed,
        };
        if !report.layers.is_empty() || report.manifests > 0 {
            info!(
                layers = report.layers.len(),
                manifests = report.manifests,
                bytes = report.bytes_freed,
                "garbage collected"
            );
        }
        Ok(report)
    }

    /// Removes stack `id` and its whole history: branches, manifests, leases,
    /// sessions and outcomes; its layers are then collected by [`Store::gc`].
    /// Refused while a session of it is live or a lease (node, export) pins it,
    /// unless `force`: then live sessions are discarded (the caller checked that
    /// none is mounted) and leases released.
    ///
    /// Errors: `StackNotFound`, `FailedPrecondition` naming what uses it.
    pub fn remove_stack(&self, id: &str, force: bool) -> Result<RemovedStack, StoreError> {
        let (report, dirs) = self.db.write(|tx| {
            let exists: Option<i64> = tx
                .one("SELECT 1 FROM stacks WHERE id = ?1", [id], |r| r.get(0))
                .optional()?;
            if exists.is_none() {
                return Err(StoreError::StackNotFound(id.into()));
            }
            let live_sessions: Vec<i64> = {
                let mut stmt = tx.prepare_cached("SELECT id FROM sessions WHERE stack = ?1 AND released = 0 ORDER BY id")?;
                let v = stmt.query_map([id], |r| r.get(0))?.collect::<Result<Vec<_>, _>>()?;
                v
            };
            let live_leases: i64 = tx.one(
                "SELECT count(*) FROM leases l JOIN manifests m ON m.id = l.manifest_id WHERE m.stack = ?1 AND l.released_ns IS NULL AND l.holder_kind != 'session'",
                [id],
                |r| r.get(0),
            )?;
            if !force && (!live_sessions.is_empty() || live_leases > 0) {
                return Err(StoreError::FailedPrecondition(format!(
                    "stack {id} is in use: {} live session(s) {:?}, {live_leases} lease(s) of nodes or exports; end them first, or pass --force (discards those sessions' writes and releases the leases)",
                    live_sessions.len(),
                    live_sessions
                )));
            }
            let sessions: Vec<i64> = {
                let mut stmt = tx.prepare_cached("SELECT id FROM sessions WHERE stack = ?1")?;
                let v = stmt.query_map([id], |r| r.get(0))?.collect::<Result<Vec<_>, _>>()?;
                v
            };
            let leases_released = tx.exec(
                "UPDATE leases SET released_ns = ?2 WHERE released_ns IS NULL AND manifest_id IN (SELECT id FROM manifests WHERE stack = ?1)",
                params![id, now_ns()],
            )? as u64;
            let mut dirs = Vec::new();
            for s in &sessions {
                tx.exec("DELETE FROM publish_paths WHERE publish_id IN (SELECT id FROM publishes WHERE session_id = ?1)", [s])?;
                tx.exec("DELETE FROM publishes WHERE session_id = ?1", [s])?;
                tx.exec("DELETE FROM session_layers WHERE session_id = ?1", [s])?;
                tx.exec("UPDATE snapshots SET session_id = NULL WHERE session_id = ?1", [s])?;
                dirs.push(self.session_path(*s));
            }
            // The stack's graphs (their nodes' leases were released above).
            tx.exec("DELETE FROM graph_attempts WHERE node IN (SELECT n.id FROM graph_nodes n JOIN graph_groups g ON g.name = n.grp WHERE g.stack = ?1)", [id])?;
            tx.exec("DELETE FROM graph_edges WHERE child IN (SELECT n.id FROM graph_nodes n JOIN graph_groups g ON g.name = n.grp WHERE g.stack = ?1)", [id])?;
            tx.exec("DELETE FROM graph_missing_parents WHERE child IN (SELECT n.id FROM graph_nodes n JOIN graph_groups g ON g.name = n.grp WHERE g.stack = ?1)", [id])?;
            tx.exec("DELETE FROM graph_nodes WHERE grp IN (SELECT name FROM graph_groups WHERE stack = ?1)", [id])?;
            tx.exec("DELETE FROM graph_groups WHERE stack = ?1", [id])?;
            tx.exec("UPDATE sessions SET lease_id = NULL WHERE stack = ?1", [id])?;
            tx.exec("DELETE FROM leases WHERE manifest_id IN (SELECT id FROM manifests WHERE stack = ?1)", [id])?;
            tx.exec("DELETE FROM sessions WHERE stack = ?1", [id])?;
            let branches = tx.exec("DELETE FROM branches WHERE stack = ?1", [id])? as u64;
            tx.exec("DELETE FROM manifest_layers WHERE manifest_id IN (SELECT id FROM manifests WHERE stack = ?1)", [id])?;
            // Children before parents.
            tx.exec("UPDATE manifests SET parent = NULL WHERE stack = ?1", [id])?;
            tx.exec("DELETE FROM manifests WHERE stack = ?1", [id])?;
            tx.exec("DELETE FROM stack_layers WHERE stack = ?1", [id])?;
            tx.exec("DELETE FROM stacks WHERE id = ?1", [id])?;
            // Its blame rows and its sessions' conflict markers.
            crate::blame::collect_blame(tx)?;
            Ok((
                RemovedStack {
                    branches,
                    sessions: sessions.len() as u64,
                    leases_released,
                },
                dirs,
            ))
        })?;
        for d in dirs {
            if let Err(e) = fs::remove_tree(&d) {
                warn!(path = %d.display(), error = %e, "cannot remove a session directory; the sweep will");
            }
        }
        info!(
            stack = id,
            branches = report.branches,
            sessions = report.sessions,
            "removed stack"
        );
        Ok(report)
    }

    /// Real allocated bytes per accounting class, store-wide and per stack
    /// (ARCHITECTURE.md §10): every inode counted once, in the first class that
    /// reaches it (hot, cold, uppers, staging, containerd's snapshots, metadata).
    /// The total equals `du` of the store root within a few blocks (the walks run
    /// while the store may change). Trees handed to the reaper are removed first
    /// (waiting at most 10 s), so a removal in flight is not counted by one
    /// walk and gone for the next.
    pub fn disk_usage(&self) -> Result<DiskUsage, StoreError> {
        self.reaper.settle(std::time::Duration::from_secs(10));
        struct Classes {
            hot: Vec<(String, PathBuf)>,
            cold: Vec<(String, PathBuf)>,
            uppers: Vec<(String, PathBuf)>,
            snapshots: Vec<PathBuf>,
        }
        let c = self.db.read(|conn| {
            let mut hot_ids: HashMap<LayerId, String> = HashMap::new();
            {
                let mut stmt = conn.prepare_cached(
                    "SELECT ml.layer_id, b.stack FROM branches b JOIN manifest_layers ml ON ml.manifest_id = b.manifest_id
                     UNION SELECT ml.layer_id, b.stack FROM branches b JOIN manifests m ON m.id = b.manifest_id
                                                   JOIN manifest_layers ml ON ml.manifest_id = m.rest
                     UNION SELECT layer_id, stack FROM stack_layers",
                )?;
                for r in stmt.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))? {
                    let (l, s) = r?;
                    hot_ids.insert(l, s);
                }
            }
            let mut hot = Vec::new();
            let mut cold = Vec::new();
            let mut snapshots = Vec::new();
            let mut stmt = conn.prepare_cached("SELECT id, path, kind, stack, dropped FROM layers")?;
            let rows = stmt
                .query_map([], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, String>(2)?,
                        r.get::<_, Option<String>>(3)?,
                        r.get::<_, i64>(4)? != 0,
                    ))
                })?
                .collect::<Result<Vec<_>, _>>()?;
            for (id, path, kind, stack, dropped) in rows {
                if dropped || path.starts_with("s/") {
                    continue;
                }
                let dir = self.root.join(&path);
                match (hot_ids.get(&id), kind.as_str()) {
                    (Some(s), _) => hot.push((s.clone(), dir)),
                    (None, "published" | "squashed") => cold.push((stack.unwrap_or_default(), dir)),
                    _ => snapshots.push(dir),
                }
            }
            let mut uppers = Vec::new();
            let mut stmt = conn.prepare_cached("SELECT id, stack FROM sessions")?;
            for r in stmt.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))? {
                let (id, stack) = r?;
                uppers.push((stack, self.session_path(id)));
            }
            Ok(Classes {
                hot,
                cold,
                uppers,
                snapshots,
            })
        })?;
        let mut seen = HashSet::new();
        let mut out = DiskUsage::default();
        let io = |p: &std::path::Path, e| StoreError::io(p, e);
        for (stack, dir) in &c.hot {
            let b = fs::usage_once(dir, &mut seen).map_err(|e| io(dir, e))?;
            out.total.hot += b;
            out.stacks.entry(stack.clone()).or_default().hot += b;
        }
        for (stack, dir) in &c.cold {
            let b = fs::usage_once(dir, &mut seen).map_err(|e| io(dir, e))?;
            out.total.cold += b;
            out.stacks.entry(stack.clone()).or_default().cold += b;
        }
        for (stack, dir) in &c.uppers {
            let b = fs::usage_once(dir, &mut seen).map_err(|e| io(dir, e))?;
            out.total.uppers += b;
            out.stacks.entry(stack.clone()).or_default().uppers += b;
        }
        let staging = self.staging_path();
        out.total.staging = fs::usage_once(&staging, &mut seen).map_err(|e| io(&staging, e))?;
        for dir in &c.snapshots {
            out.total.snapshots += fs::usage_once(dir, &mut seen).map_err(|e| io(dir, e))?;
            out.total.snapshots += fs::usage_once(
                &self
                    .root
                    .join("w")
                    .join(dir.file_name().unwrap_or_default()),
                &mut seen,
            )
            .unwrap_or(0);
        }
        // Everything else under the root: the database, the lock, the store's own
        // directories, and anything no row accounts for (the next sweep removes it).
        out.total.metadata =
            fs::usage_once(&self.root, &mut seen).map_err(|e| io(&self.root, e))?;
        Ok(out)
    }

    /// The layers a squash of `branch` would replace, with the head: when the
    /// head shows more than `threshold` layers, the run below its newest `keep`
    /// — its published layers, and then each older squashed layer that covers at
    /// most twice as many publishes as the run so far (size-tiered, as an LSM
    /// tree compacts: a published layer's files are linked into a new squash
    /// O(log n) times over n publishes, not once per squash; simulated over
    /// 10,000 publishes with the defaults: 22× fewer links than squashing
    /// everything below `keep`, at most 64 layers deep). When that run would be
    /// a single layer, everything below the newest `keep`. `None` when the head
    /// is not deep enough.
    pub fn squash_candidate(
        &self,
        stack: &str,
        branch: &str,
        threshold: usize,
        keep: usize,
    ) -> Result<Option<(ManifestId, Vec<LayerId>)>, StoreError> {
        self.db.read(|conn| {
            let head =
                branch_head(conn, stack, branch)?.ok_or_else(|| StoreError::BranchNotFound {
                    stack: stack.into(),
                    branch: branch.into(),
                })?;
            let layers = manifest_layers(conn, head)?;
            if layers.len() <= threshold || layers.len() <= keep + 1 {
                return Ok(None);
            }
            let below = &layers[keep..];
            let kinds = crate::blame::layer_kinds(conn, below)?;
            let mut covered = 0usize;
            let mut n = 0;
            for (l, kind) in below.iter().zip(&kinds) {
                let weight = match kind {
                    LayerKind::Squashed => {
                        crate::paths::expand(conn, &self.expansions, &[*l])?.len()
                    }
                    _ => 1,
                };
                if *kind == LayerKind::Squashed && weight > 2 * covered {
                    break;
                }
                covered += weight;
                n += 1;
            }
            let run = if n >= 2 { &below[..n] } else { below };
            Ok(Some((head, run.to_vec())))
        })
    }

    /// The directories of `layers` (for building a squash).
    pub fn layer_paths(&self, layers: &[LayerId]) -> Result<Vec<PathBuf>, StoreError> {
        self.db.read(|conn| self.layer_dirs(conn, layers))
    }

    /// A fresh directory under `staging/` for an operation in flight, registered
    /// so no sweep removes it while the guard lives.
    pub fn staging_dir(
        &self,
        purpose: &str,
    ) -> Result<(PathBuf, crate::InFlightGuard), StoreError> {
        let name = format!("{purpose}-{}-{}", std::process::id(), now_ns());
        let guard = self.inflight.hold(format!("staging/{name}"));
        let dir = self.staging_path().join(&name);
        fs::mkdir_mode(&dir, 0o755).map_err(|e| StoreError::io(&dir, e))?;
        Ok((dir, guard))
    }
}
