//! Stacks, branches and manifests (ARCHITECTURE.md §2).
//!
//! A manifest is immutable: one `manifests` row (its parent and the layer it
//! added) and `manifest_layers` rows, newest first. A manifest is either
//! complete (`rest` NULL: one row per position) or holds its newest at most
//! [`OWN_RUN`] positions as its own rows and the rest by reference to one
//! complete manifest in its parent chain (`rest`). A branch moves by pointing
//! at a new manifest; a prepend writes the new layer and copies the parent's
//! own rows (`INSERT … SELECT`), and writes the whole list once every
//! [`OWN_RUN`] prepends: ~`OWN_RUN`/2 + depth/`OWN_RUN` rows on average, not
//! `depth` (a commit under a branch's gate does it: at the depths a lagging
//! squash leaves under a 1,024-publish burst, ~200, a full copy was ~0.8 ms of
//! the hold). Depth stays bounded by squashing. "Which layers does any head or
//! lease reach" is one join over a manifest's own rows and its `rest`'s; as a
//! `rest` is an ancestor, a walk of the parent chains (GC) meets it anyway.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use rusqlite::{params, Connection, OptionalExtension, Transaction};
use tracing::info;

use crate::db::Cached;
use crate::error::StoreError;
use crate::{
    now_ns, BranchInfo, LayerId, LayerKind, LogEntry, ManifestId, Owner, SessionId, StackInfo,
    Store,
};

/// Records stack `id` (base image top chainID `base_digest` in containerd
/// namespace `namespace`, `None` for an imported base) with its base layers,
/// newest first, unless it exists.
/// An existing stack keeps the base layers it recorded first (the history was
/// built on them).
pub(crate) fn ensure_stack(
    tx: &Transaction<'_>,
    id: &str,
    base_digest: &str,
    namespace: Option<&str>,
    base_layers: &[LayerId],
) -> Result<bool, StoreError> {
    let n = tx.exec(
        "INSERT OR IGNORE INTO stacks(id, base_digest, namespace, created_ns) VALUES (?1, ?2, ?3, ?4)",
        params![id, base_digest, namespace, now_ns()],
    )?;
    if n == 0 {
        return Ok(false);
    }
    let mut ins =
        tx.prepare_cached("INSERT INTO stack_layers(stack, pos, layer_id) VALUES (?1, ?2, ?3)")?;
    for (pos, l) in base_layers.iter().enumerate() {
        ins.execute(params![id, pos as i64, l])?;
    }
    info!(stack = id, base_layers = base_layers.len(), "created stack");
    Ok(true)
}

/// The base layers of `stack`, newest first.
pub(crate) fn stack_base_layers(
    conn: &Connection,
    stack: &str,
) -> Result<Vec<LayerId>, StoreError> {
    let mut stmt =
        conn.prepare_cached("SELECT layer_id FROM stack_layers WHERE stack = ?1 ORDER BY pos")?;
    let rows = stmt.query_map([stack], |r| r.get(0))?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// The head manifest of `branch` on `stack`, if the branch exists.
pub(crate) fn branch_head(
    conn: &Connection,
    stack: &str,
    branch: &str,
) -> Result<Option<ManifestId>, StoreError> {
    Ok(conn
        .one(
            "SELECT manifest_id FROM branches WHERE stack = ?1 AND name = ?2",
            params![stack, branch],
            |r| r.get(0),
        )
        .optional()?)
}

/// The head of `branch`, creating the stack's default branch (on an empty root
/// manifest) and `branch` (forked from the default branch's head: one row, O(1))
/// when missing.
pub(crate) fn ensure_branch(
    tx: &Transaction<'_>,
    stack: &str,
    branch: &str,
    default_branch: &str,
) -> Result<ManifestId, StoreError> {
    if let Some(m) = branch_head(tx, stack, branch)? {
        return Ok(m);
    }
    let now = now_ns();
    let default_head = match branch_head(tx, stack, default_branch)? {
        Some(m) => m,
        None => {
            tx.exec(
                "INSERT INTO manifests(stack, parent, layer_id, depth, created_ns) VALUES (?1, NULL, NULL, 0, ?2)",
                params![stack, now],
            )?;
            let m = tx.last_insert_rowid();
            tx.exec(
                "INSERT INTO branches(stack, name, manifest_id, created_ns, updated_ns) VALUES (?1, ?2, ?3, ?4, ?4)",
                params![stack, default_branch, m, now],
            )?;
            info!(stack, branch = default_branch, "created branch");
            m
        }
    };
    if branch == default_branch {
        return Ok(default_head);
    }
    tx.exec(
        "INSERT INTO branches(stack, name, manifest_id, created_ns, updated_ns) VALUES (?1, ?2, ?3, ?4, ?4)",
        params![stack, branch, default_head, now],
    )?;
    info!(stack, branch, from = default_branch, "forked branch");
    Ok(default_head)
}

/// Points `branch` of `stack` at `manifest`.
pub(crate) fn set_branch(
    tx: &Transaction<'_>,
    stack: &str,
    branch: &str,
    manifest: ManifestId,
) -> Result<(), StoreError> {
    let n = tx.exec(
        "UPDATE branches SET manifest_id = ?3, updated_ns = ?4 WHERE stack = ?1 AND name = ?2",
        params![stack, branch, manifest, now_ns()],
    )?;
    if n == 0 {
        return Err(StoreError::BranchNotFound {
            stack: stack.into(),
            branch: branch.into(),
        });
    }
    Ok(())
}

/// The most positions a manifest keeps as its own rows above its `rest`
/// before a prepend writes it out whole (see the module docs).
pub(crate) const OWN_RUN: i64 = 16;

/// The layers of manifest `id`, newest first: its own positions, then its
/// `rest`'s (a manifest whose rows are complete). Errors: `Corrupt` when a
/// manifest row is missing or its positions do not match its depth.
pub(crate) fn manifest_layers(
    conn: &Connection,
    id: ManifestId,
) -> Result<Vec<LayerId>, StoreError> {
    let ManifestRow { depth, rest, .. } = manifest_row(conn, id)?;
    let mut out = Vec::with_capacity(usize::try_from(depth).unwrap_or(0));
    let rest_depth = match rest {
        Some(r) => {
            let below = manifest_row(conn, r)?;
            let d = below.depth;
            if below.rest.is_some() || d >= depth {
                return Err(StoreError::corrupt(
                    "manifests",
                    id,
                    format!("its rest, manifest {r}, is not a complete manifest below it"),
                ));
            }
            d
        }
        None => 0,
    };
    own_rows(conn, id, depth - rest_depth, &mut out)?;
    if let Some(r) = rest {
        own_rows(conn, r, rest_depth, &mut out)?;
    }
    Ok(out)
}

/// One `manifests` row: what the manifest added on top of what, and how.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ManifestRow {
    /// The manifest it was prepended on (`None`: a stack's empty root).
    pub parent: Option<ManifestId>,
    /// The layer it added on top of `parent` (`None`: a stack's empty root).
    pub layer: Option<LayerId>,
    /// The number of layers it shows.
    pub depth: i64,
    /// The complete manifest holding its positions below its own rows
    /// (`None`: its rows are complete).
    pub rest: Option<ManifestId>,
}

/// Manifest `id`'s row. Error: `Corrupt` when it is missing.
pub(crate) fn manifest_row(conn: &Connection, id: ManifestId) -> Result<ManifestRow, StoreError> {
    conn.one(
        "SELECT parent, layer_id, depth, rest FROM manifests WHERE id = ?1",
        [id],
        |r| {
            Ok(ManifestRow {
                parent: r.get(0)?,
                layer: r.get(1)?,
                depth: r.get(2)?,
                rest: r.get(3)?,
            })
        },
    )
    .optional()?
    .ok_or_else(|| StoreError::corrupt("manifests", id, "manifest referenced but missing"))
}

/// Appends manifest `id`'s own rows (positions `0..n`) to `out`. Error:
/// `Corrupt` when they are not exactly those positions.
fn own_rows(
    conn: &Connection,
    id: ManifestId,
    n: i64,
    out: &mut Vec<LayerId>,
) -> Result<(), StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT pos, layer_id FROM manifest_layers WHERE manifest_id = ?1 ORDER BY pos",
    )?;
    let rows = stmt.query_map([id], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))?;
    let mut i = 0i64;
    for r in rows {
        let (pos, layer) = r?;
        if pos != i {
            return Err(StoreError::corrupt(
                "manifest_layers",
                format!("manifest {id} position {i}"),
                format!("found position {pos}"),
            ));
        }
        out.push(layer);
        i += 1;
    }
    if i != n {
        return Err(StoreError::corrupt(
            "manifest_layers",
            format!("manifest {id}"),
            format!("{i} positions where {n} were expected"),
        ));
    }
    Ok(())
}

/// Creates the manifest `[layer] + parent`'s layers on `stack`; returns its id.
///
/// Writes at most [`OWN_RUN`] rows, and the parent's whole depth once every
/// [`OWN_RUN`] prepends (see the module docs). Error: `Corrupt` when the parent
/// or its rows are missing.
pub(crate) fn prepend_manifest(
    tx: &Transaction<'_>,
    stack: &str,
    parent: ManifestId,
    layer: LayerId,
) -> Result<ManifestId, StoreError> {
    let ManifestRow {
        depth,
        rest: parent_rest,
        ..
    } = manifest_row(tx, parent)?;
    // The parent's own rows (all of them when it is complete).
    let (own, anchor) = match parent_rest {
        Some(r) => (depth - manifest_row(tx, r)?.depth, r),
        None => (depth, parent),
    };
    // Above the parent's anchor: [layer] + the parent's own rows (none when the
    // parent is itself the anchor). Past OWN_RUN of them: written out whole.
    let rest = match parent_rest {
        Some(_) if own + 1 > OWN_RUN => None,
        Some(_) => Some(anchor),
        // On the stack's empty root: complete as it is.
        None if depth == 0 => None,
        None => Some(parent),
    };
    tx.exec(
        "INSERT INTO manifests(stack, parent, layer_id, depth, rest, created_ns) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![stack, parent, layer, depth + 1, rest, now_ns()],
    )?;
    let m = tx.last_insert_rowid();
    tx.exec(
        "INSERT INTO manifest_layers(manifest_id, pos, layer_id) VALUES (?1, 0, ?2)",
        params![m, layer],
    )?;
    let copy = |from: ManifestId, shift: i64, n: i64| -> Result<(), StoreError> {
        let copied = tx.exec(
            "INSERT INTO manifest_layers(manifest_id, pos, layer_id) SELECT ?1, pos + ?3, layer_id FROM manifest_layers WHERE manifest_id = ?2",
            params![m, from, shift],
        )?;
        if copied as i64 != n {
            return Err(StoreError::corrupt(
                "manifest_layers",
                format!("manifest {from}"),
                format!("{copied} positions where {n} were expected"),
            ));
        }
        Ok(())
    };
    if parent_rest.is_some() {
        copy(parent, 1, own)?;
        if rest.is_none() {
            copy(anchor, 1 + own, depth - own)?;
        }
    }
    Ok(m)
}

impl Store {
    /// Every stack with its base layers and branches, by id.
    pub fn stacks(&self) -> Result<Vec<StackInfo>, StoreError> {
        self.db.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT id, base_digest, namespace, created_ns FROM stacks ORDER BY id",
            )?;
            let rows = stmt.query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, Option<String>>(2)?,
                    r.get::<_, i64>(3)?,
                ))
            })?;
            let mut out = Vec::new();
            for r in rows {
                let (id, base_digest, namespace, created_ns) = r?;
                out.push(StackInfo {
                    base_layers: stack_base_layers(conn, &id)?,
                    branches: branches_of(conn, &id)?,
                    id,
                    base_digest,
                    namespace,
                    created_ns,
                });
            }
            Ok(out)
        })
    }

    /// The base (image) layers of `stack`, newest first: its image's layers as
    /// its first session recorded them (empty for an unknown stack).
    pub fn base_layers(&self, stack: &str) -> Result<Vec<LayerId>, StoreError> {
        self.db.read(|conn| stack_base_layers(conn, stack))
    }

    /// The branches of `stack`, by name. Error: `StackNotFound`.
    pub fn branches(&self, stack: &str) -> Result<Vec<BranchInfo>, StoreError> {
        self.db.read(|conn| {
            let exists: Option<i64> = conn
                .one("SELECT 1 FROM stacks WHERE id = ?1", [stack], |r| r.get(0))
                .optional()?;
            if exists.is_none() {
                return Err(StoreError::StackNotFound(stack.into()));
            }
            branches_of(conn, stack)
        })
    }

    /// The layers `branch` of `stack` shows, newest first, with who published
    /// each and when. A squashed layer's entry counts the paths of its merged
    /// index (a path several members changed counts once) and lists its members
    /// as entries of their own, newest first, each with its publisher, time and
    /// path count (a member that is itself squashed lists its members too).
    /// Error: `BranchNotFound`.
    pub fn log(&self, stack: &str, branch: &str) -> Result<Vec<LogEntry>, StoreError> {
        self.db.read(|conn| {
            let head =
                branch_head(conn, stack, branch)?.ok_or_else(|| StoreError::BranchNotFound {
                    stack: stack.to_string(),
                    branch: branch.to_string(),
                })?;
            // The manifest that added each layer, for display: the oldest.
            let mut added: HashMap<LayerId, ManifestId> = HashMap::new();
            {
                let mut stmt = conn.prepare_cached(
                    "SELECT layer_id, id FROM manifests WHERE stack = ?1 AND layer_id IS NOT NULL ORDER BY id",
                )?;
                let rows = stmt.query_map([stack], |r| Ok((r.get(0)?, r.get(1)?)))?;
                for r in rows {
                    let (l, m) = r?;
                    added.entry(l).or_insert(m);
                }
            }
            let owners = owners_of_stack(conn, stack)?;
            let mut out = Vec::new();
            for layer in manifest_layers(conn, head)? {
                let mut e = self.log_entry(conn, layer, &added, &owners, 0)?;
                if e.manifest == 0 {
                    e.manifest = head;
                }
                out.push(e);
            }
            Ok(out)
        })
    }

    /// The log entry of `layer` (see [`Store::log`]), `manifest` 0 when no
    /// manifest that added it remains.
    fn log_entry(
        &self,
        conn: &Connection,
        layer: LayerId,
        added: &HashMap<LayerId, ManifestId>,
        owners: &BTreeMap<SessionId, Owner>,
        nesting: usize,
    ) -> Result<LogEntry, StoreError> {
        if nesting > 1024 {
            return Err(StoreError::corrupt(
                "squash_members",
                layer,
                "squashed layers nest more than 1024 deep (a cycle?)",
            ));
        }
        let mut layer_stmt =
            conn.prepare_cached("SELECT kind, session_id, created_ns FROM layers WHERE id = ?1")?;
        let (kind, session, created_ns): (String, Option<SessionId>, i64) = layer_stmt
            .query_row([layer], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .optional()?
            .ok_or(StoreError::LayerNotFound(layer))?;
        let kind = LayerKind::parse(&kind)
            .ok_or_else(|| StoreError::corrupt("layers", layer, format!("kind {kind:?}")))?;
        let members = match kind {
            LayerKind::Squashed => crate::paths::members(conn, layer)?
                .into_iter()
                .map(|m| self.log_entry(conn, m, added, owners, nesting + 1))
                .collect::<Result<Vec<_>, _>>()?,
            _ => Vec::new(),
        };
        Ok(LogEntry {
            layer,
            kind,
            manifest: added.get(&layer).copied().unwrap_or(0),
            session,
            owner: session.and_then(|s| owners.get(&s).cloned()),
            paths: crate::paths::path_count(conn, &self.expansions, &[layer])?,
            created_ns,
            members,
        })
    }

    /// The layer directories, newest first, that a new session on `branch` of
    /// `stack` would read above its image (the head's published layers).
    /// Error: `BranchNotFound`.
    pub fn branch_layers(&self, stack: &str, branch: &str) -> Result<Vec<PathBuf>, StoreError> {
        self.db.read(|conn| {
            let head =
                branch_head(conn, stack, branch)?.ok_or_else(|| StoreError::BranchNotFound {
                    stack: stack.to_string(),
                    branch: branch.to_string(),
                })?;
            let layers = manifest_layers(conn, head)?;
            self.layer_dirs(conn, &layers)
        })
    }

    /// The layers of manifest `id`, newest first.
    /// Errors: `Corrupt` when it is missing or inconsistent.
    pub fn manifest(&self, id: ManifestId) -> Result<Vec<LayerId>, StoreError> {
        self.db.read(|conn| manifest_layers(conn, id))
    }
}

fn branches_of(conn: &Connection, stack: &str) -> Result<Vec<BranchInfo>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT b.name, b.manifest_id, m.depth, b.updated_ns FROM branches b JOIN manifests m ON m.id = b.manifest_id WHERE b.stack = ?1 ORDER BY b.name",
    )?;
    let rows = stmt.query_map([stack], |r| {
        Ok(BranchInfo {
            stack: stack.to_string(),
            name: r.get(0)?,
            head: r.get(1)?,
            depth: r.get(2)?,
            updated_ns: r.get(3)?,
        })
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// The owners of every session of `stack`, by session id.
fn owners_of_stack(
    conn: &Connection,
    stack: &str,
) -> Result<BTreeMap<SessionId, Owner>, StoreError> {
    let mut stmt = conn
        .prepare_cached("SELECT id, owner_kind, namespace, owner FROM sessions WHERE stack = ?1")?;
    let rows = stmt.query_map([stack], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, String>(2)?,
            r.get::<_, String>(3)?,
        ))
    })?;
    let mut out = BTreeMap::new();
    for r in rows {
        let (id, kind, ns, owner) = r?;
        out.insert(id, crate::sessions::owner_from(id, &kind, ns, owner)?);
    }
    Ok(out)
}
