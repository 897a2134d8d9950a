//! containerd's snapshot semantics over the history model (ARCHITECTURE.md §5):
//! the only code that knows containerd's key format, snapshot kinds, parent
//! chains, image extraction and Docker's per-container init layer.
//!
//! * Keys arrive as `<namespace>/<seq>/<name>` (containerd
//!   `metadata/snapshot.go`, `createKey`); they are opaque strings here (never
//!   paths).
//! * An image layer is unpacked by `Prepare(extract-…, parent)` + `Commit(name)`;
//!   its directory becomes a `base` layer.
//! * Any other `Prepare` whose parent chain reaches an image layer creates a
//!   **session** owned by the container `<namespace>/<name>`: the stack is the
//!   nearest image ancestor (its base layers are recorded on the stack, so history
//!   outlives containerd's snapshots), the branch comes from the snapshot label
//!   [`SNAPSHOT_BRANCH_LABEL`], and committed non-image snapshots in between (Docker's
//!   `-init`) become the session's private layers above the published ones.
//! * Every snapshot is a manifest of layer ids: `Commit` of an active session
//!   freezes exactly what it saw (its private layers, the lease, its upper) into
//!   `snapshot_lowers`; so does `View`.
//! * Published layers never appear as snapshots (containerd's GC would remove
//!   them); everything containerd created does.

use std::collections::BTreeMap;
use std::path::PathBuf;

use rusqlite::{params, Connection, OptionalExtension, Transaction};
use tracing::{debug, info, warn};

use crate::db::Cached;
use crate::error::StoreError;
use crate::layers::insert_layer;
use crate::leases::lease_manifest;
use crate::publish::insert_outcome;
use crate::sessions::{get_sess, insert_session};
use crate::stacks::ensure_stack;
use crate::{
    fs, layer_rel, now_ns, LayerId, LayerKind, LeaseTarget, MountSpec, OutcomeKind, OutcomeRecord,
    Owner, SessionId, SessionState, SnapshotInfo, SnapshotKind, Store,
};

/// The snapshot labels this module reads (documented in
/// [`layerstack_types::labels`]; containerd passes them with `Prepare`).
pub use layerstack_types::labels::{
    SNAPSHOT_BRANCH_LABEL, SNAPSHOT_NODE_LABEL, SNAPSHOT_REF_LABEL,
};

/// Split a backend key `<namespace>/<seq>/<name>` (containerd `metadata/snapshot.go`
/// `createKey`). Returns `(namespace, name)`.
pub fn split_key(key: &str) -> Option<(&str, &str)> {
    let mut it = key.splitn(3, '/');
    let ns = it.next()?;
    let seq = it.next()?;
    let name = it.next()?;
    if ns.is_empty() || name.is_empty() || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((ns, name))
}

/// The error for an active snapshot with neither a session nor a layer: the
/// rootfs of a container whose stack `layerstack stack rm --force` removed (the
/// only way to get one: the removal drops the session and keeps containerd's
/// snapshot row, which containerd owns). An operator's doing, not corruption:
/// `FailedPrecondition` naming the snapshot, why, and what to do.
fn stack_removed(key: &str) -> StoreError {
    let remove = match split_key(key) {
        Some((ns, name)) => format!("`ctr -n {ns} containers rm {name}`"),
        None => "`ctr containers rm`".to_string(),
    };
    StoreError::FailedPrecondition(format!(
        "snapshot {key} is the rootfs of a container whose stack was removed with `layerstack stack rm --force`: its session and history are gone, so it cannot be mounted or committed again; remove the container ({remove}; containerd then removes the snapshot) and run a new one"
    ))
}

/// The stack id of image `chain_id` (its top layer chainID) in containerd
/// namespace `namespace`: `<namespace>/<chainID>`. A containerd namespace is a
/// tenancy boundary (`default`, `moby`, `k8s.io`), so each has its own history of
/// the same image.
pub fn stack_id(namespace: &str, chain_id: &str) -> String {
    if namespace.is_empty() {
        chain_id.to_string()
    } else {
        format!("{namespace}/{chain_id}")
    }
}

/// `sha256:` followed by 64 lowercase hex digits (a chainID).
pub(crate) fn is_digest(s: &str) -> bool {
    s.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// Whether an active snapshot is an image-layer extraction. containerd's pull
/// unpacker labels it with [`SNAPSHOT_REF_LABEL`]; the client-side unpack of
/// `ctr images import`/`ctr run` (containerd `rootfs/apply.go`) does not, but
/// always uses the key `extract-<nonce> <chainID>`.
pub fn is_extraction(key: &str, labels: &BTreeMap<String, String>) -> bool {
    if labels.contains_key(SNAPSHOT_REF_LABEL) {
        return true;
    }
    let name = split_key(key).map(|(_, n)| n).unwrap_or(key);
    name.strip_prefix("extract-")
        .and_then(|rest| rest.rsplit_once(' '))
        .is_some_and(|(_, chain)| is_digest(chain))
}

/// What [`Store::remove`] removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removed {
    /// A snapshot without a session (its directories are gone unless something
    /// else still uses the layer).
    Plain,
    /// A container's rootfs snapshot: the session is released with its
    /// directories kept until [`Store::complete_release`] (the caller finishes
    /// the run by its policy first when it has unpublished writes).
    Session(SessionId),
}

struct SnapRow {
    key: String,
    kind: SnapshotKind,
    parent: Option<String>,
    labels: BTreeMap<String, String>,
    created_ns: i64,
    updated_ns: i64,
    layer_id: Option<LayerId>,
    session_id: Option<SessionId>,
    image_layer: bool,
    frozen: bool,
    size: Option<i64>,
    inodes: Option<i64>,
}

impl SnapRow {
    fn info(&self) -> SnapshotInfo {
        SnapshotInfo {
            key: self.key.clone(),
            kind: self.kind,
            parent: self.parent.clone().unwrap_or_default(),
            labels: self.labels.clone(),
            created_ns: self.created_ns,
            updated_ns: self.updated_ns,
        }
    }
}

const SNAP_COLS: &str = "key, kind, parent, labels, created_ns, updated_ns, layer_id, session_id, image_layer, frozen, size, inodes";

/// A `snapshots` row as stored ([`SNAP_COLS`]), read by column name.
struct RawSnap {
    key: String,
    kind: String,
    parent: Option<String>,
    labels: String,
    created_ns: i64,
    updated_ns: i64,
    layer_id: Option<i64>,
    session_id: Option<i64>,
    image_layer: i64,
    frozen: i64,
    size: Option<i64>,
    inodes: Option<i64>,
}

fn raw_snap(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawSnap> {
    Ok(RawSnap {
        key: r.get("key")?,
        kind: r.get("kind")?,
        parent: r.get("parent")?,
        labels: r.get("labels")?,
        created_ns: r.get("created_ns")?,
        updated_ns: r.get("updated_ns")?,
        layer_id: r.get("layer_id")?,
        session_id: r.get("session_id")?,
        image_layer: r.get("image_layer")?,
        frozen: r.get("frozen")?,
        size: r.get("size")?,
        inodes: r.get("inodes")?,
    })
}

fn snap_from_raw(raw: RawSnap) -> Result<SnapRow, StoreError> {
    let RawSnap {
        key,
        kind,
        parent,
        labels,
        created_ns,
        updated_ns,
        layer_id,
        session_id,
        image_layer: image,
        frozen,
        size,
        inodes,
    } = raw;
    let kind = match kind.as_str() {
        "view" => SnapshotKind::View,
        "active" => SnapshotKind::Active,
        "committed" => SnapshotKind::Committed,
        other => {
            return Err(StoreError::corrupt(
                "snapshots",
                &key,
                format!("kind {other:?}"),
            ))
        }
    };
    let labels = serde_json::from_str(&labels)
        .map_err(|e| StoreError::corrupt("snapshots", &key, format!("labels: {e}")))?;
    Ok(SnapRow {
        key,
        kind,
        parent,
        labels,
        created_ns,
        updated_ns,
        layer_id,
        session_id,
        image_layer: image != 0,
        frozen: frozen != 0,
        size,
        inodes,
    })
}

fn get_snap(conn: &Connection, key: &str) -> Result<Option<SnapRow>, StoreError> {
    conn.one(
        &format!("SELECT {SNAP_COLS} FROM snapshots WHERE key = ?1"),
        [key],
        raw_snap,
    )
    .optional()?
    .map(snap_from_raw)
    .transpose()
}

fn need_snap(conn: &Connection, key: &str) -> Result<SnapRow, StoreError> {
    get_snap(conn, key)?.ok_or_else(|| StoreError::SnapshotNotFound(key.to_string()))
}

fn frozen_lowers(conn: &Connection, key: &str) -> Result<Vec<LayerId>, StoreError> {
    let mut stmt =
        conn.prepare_cached("SELECT layer_id FROM snapshot_lowers WHERE key = ?1 ORDER BY pos")?;
    let rows = stmt.query_map([key], |r| r.get(0))?;
    Ok(rows.collect::<Result<_, _>>()?)
}

fn freeze(tx: &Transaction<'_>, key: &str, lowers: &[LayerId]) -> Result<(), StoreError> {
    let mut ins =
        tx.prepare_cached("INSERT INTO snapshot_lowers(key, pos, layer_id) VALUES (?1, ?2, ?3)")?;
    for (pos, l) in lowers.iter().enumerate() {
        ins.execute(params![key, pos as i64, l])?;
    }
    Ok(())
}

/// Lower layers of a committed snapshot, newest first.
fn committed_chain(conn: &Connection, key: &str) -> Result<Vec<LayerId>, StoreError> {
    let mut out = Vec::new();
    let mut next = Some(key.to_string());
    while let Some(k) = next {
        let row = need_snap(conn, &k)?;
        if row.kind != SnapshotKind::Committed {
            return Err(StoreError::FailedPrecondition(format!(
                "parent {k} is not a committed snapshot"
            )));
        }
        if row.frozen {
            out.extend(frozen_lowers(conn, &k)?);
            break;
        }
        if let Some(l) = row.layer_id {
            out.push(l);
        }
        next = row.parent;
    }
    Ok(out)
}

/// For a rootfs `Prepare` on `parent`: the nearest image-layer ancestor and the
/// per-container committed layers above it (Docker's `-init` layer), newest first.
/// `None` when no ancestor is an image layer (then the snapshot is a plain active one).
fn find_base(
    conn: &Connection,
    parent: &str,
) -> Result<Option<(SnapRow, Vec<LayerId>)>, StoreError> {
    let mut above = Vec::new();
    let mut next = Some(parent.to_string());
    while let Some(k) = next {
        let row = need_snap(conn, &k)?;
        if row.kind != SnapshotKind::Committed {
            return Err(StoreError::FailedPrecondition(format!(
                "parent {k} is not a committed snapshot"
            )));
        }
        if row.image_layer {
            return Ok(Some((row, above)));
        }
        // A committed non-image snapshot (Docker's -init, a committed session):
        // its own layer sits above the published ones.
        if let Some(l) = row.layer_id {
            above.push(l);
        }
        next = row.parent.clone();
    }
    Ok(None)
}

/// Stack identity of an image-layer snapshot: its chainID (the extraction's
/// `containerd.io/snapshot.ref` label, else the name part of the key).
fn chain_of(base: &SnapRow) -> String {
    base.labels
        .get(SNAPSHOT_REF_LABEL)
        .cloned()
        .or_else(|| split_key(&base.key).map(|(_, n)| n.to_string()))
        .unwrap_or_else(|| base.key.clone())
}

fn view_spec(dirs: Vec<PathBuf>) -> MountSpec {
    if dirs.len() == 1 {
        MountSpec::Bind {
            source: dirs.into_iter().next().unwrap_or_default(),
            writable: false,
        }
    } else {
        MountSpec::Overlay {
            lowers: dirs,
            upper: None,
        }
    }
}

/// The directories a snapshot's mount needs that its transaction recorded but
/// did not make ([`Store::make_dirs`]).
#[derive(Clone)]
enum Dirs {
    None,
    /// A session's run: its directory, upper, workdir ([`Store::ready_run`]).
    Session(SessionId),
    /// A plain active snapshot's (or an empty view's) own layer directory, and
    /// its overlay workdir when it has lowers.
    Layer {
        dir: PathBuf,
        work: Option<PathBuf>,
    },
}

fn active_spec(dir: PathBuf, work: PathBuf, lowers: Vec<PathBuf>) -> MountSpec {
    if lowers.is_empty() {
        MountSpec::Bind {
            source: dir,
            writable: true,
        }
    } else {
        MountSpec::Overlay {
            lowers,
            upper: Some((dir, work)),
        }
    }
}

fn labels_json(labels: &BTreeMap<String, String>) -> String {
    serde_json::to_string(labels).unwrap_or_else(|_| "{}".into())
}

impl Store {
    /// containerd `Prepare` (`view == false`) or `View` (`view == true`).
    ///
    /// A `Prepare` without [`SNAPSHOT_REF_LABEL`] whose parent chain reaches an
    /// image layer creates a session (see the module docs). Errors:
    /// `SnapshotExists` (key taken), `SnapshotNotFound` (parent),
    /// `FailedPrecondition` (parent not committed), `InvalidArgument` (empty key,
    /// branch label).
    pub fn prepare(
        &self,
        key: &str,
        parent: &str,
        labels: BTreeMap<String, String>,
        view: bool,
    ) -> Result<(SnapshotInfo, MountSpec), StoreError> {
        if key.is_empty() {
            return Err(StoreError::InvalidArgument("snapshot key is empty".into()));
        }
        let mut holds = Vec::new();
        let out = self.db.write(|tx| {
            let mut make = Dirs::None;
            if get_snap(tx, key)?.is_some() {
                return Err(StoreError::SnapshotExists(key.to_string()));
            }
            let parent_opt = (!parent.is_empty()).then(|| parent.to_string());
            let now = now_ns();
            let lj = labels_json(&labels);
            let is_extract = is_extraction(key, &labels);

            if view {
                let mut lowers = match &parent_opt {
                    Some(p) => committed_chain(tx, p)?,
                    None => Vec::new(),
                };
                let mut layer_id = None;
                if lowers.is_empty() {
                    // A view of nothing: an empty read-only directory.
                    let id = insert_layer(tx, LayerKind::Active, None, None)?;
                    holds.push(self.inflight.hold(layer_rel(id)));
                    make = Dirs::Layer {
                        dir: self.layer_path(id),
                        work: None,
                    };
                    layer_id = Some(id);
                    lowers = vec![id];
                }
                tx.exec(
                    "INSERT INTO snapshots(key, kind, parent, labels, created_ns, updated_ns, layer_id, frozen) VALUES (?1, 'view', ?2, ?3, ?4, ?4, ?5, 1)",
                    params![key, parent_opt, lj, now, layer_id],
                )?;
                freeze(tx, key, &lowers)?;
                let dirs = self.layer_dirs(tx, &lowers)?;
                return Ok((need_snap(tx, key)?.info(), view_spec(dirs), make));
            }

            let base = match (&parent_opt, is_extract) {
                (Some(p), false) => find_base(tx, p)?,
                _ => None,
            };
            if let Some((base, above)) = base {
                let (ns, container) = split_key(key).unwrap_or(("", key));
                let branch = labels
                    .get(SNAPSHOT_BRANCH_LABEL)
                    .cloned()
                    .unwrap_or_else(|| self.default_branch.clone());
                let chain = chain_of(&base);
                let stack = stack_id(ns, &chain);
                let base_layers = committed_chain(tx, &base.key)?;
                ensure_stack(tx, &stack, &chain, Some(ns), &base_layers)?;
                let owner = Owner::Container {
                    namespace: ns.to_string(),
                    id: container.to_string(),
                };
                let sid = insert_session(
                    self,
                    &mut holds,
                    tx,
                    &owner,
                    &stack,
                    &LeaseTarget::Branch(branch.clone()),
                    &above,
                    None,
                )?;
                tx.exec(
                    "INSERT INTO snapshots(key, kind, parent, labels, created_ns, updated_ns, session_id) VALUES (?1, 'active', ?2, ?3, ?4, ?4, ?5)",
                    params![key, parent_opt, lj, now, sid],
                )?;
                let spec = match labels.get(SNAPSHOT_NODE_LABEL).map(|n| n.trim()).filter(|n| !n.is_empty()) {
                    Some(node) => self.attach_attempt_in(tx, sid, node, None)?.1,
                    None => self.start_run(tx, sid)?,
                };
                info!(snapshot.key = key, session.id = sid, stack = %stack, branch = %branch, "session created");
                return Ok((need_snap(tx, key)?.info(), spec, Dirs::Session(sid)));
            }

            // A plain active snapshot (image extraction, or a chain without an image).
            let lowers = match &parent_opt {
                Some(p) => committed_chain(tx, p)?,
                None => Vec::new(),
            };
            let id = insert_layer(tx, LayerKind::Active, None, None)?;
            holds.push(self.inflight.hold(layer_rel(id)));
            holds.push(self.inflight.hold(format!("w/{id}")));
            let dir = self.layer_path(id);
            let work = self.work_path(id);
            make = Dirs::Layer {
                dir: dir.clone(),
                work: (!lowers.is_empty()).then(|| work.clone()),
            };
            tx.exec(
                "INSERT INTO snapshots(key, kind, parent, labels, created_ns, updated_ns, layer_id) VALUES (?1, 'active', ?2, ?3, ?4, ?4, ?5)",
                params![key, parent_opt, lj, now, id],
            )?;
            let dirs = self.layer_dirs(tx, &lowers)?;
            debug!(snapshot.key = key, layer.id = id, "active snapshot prepared");
            Ok((need_snap(tx, key)?.info(), active_spec(dir, work, dirs), make))
        });
        let out = out.and_then(|(info, spec, make)| {
            if let Err(e) = self.make_dirs(make.clone(), &spec) {
                // A Prepare that fails leaves nothing (containerd does not
                // record the key, and retries it): its rows and what was made
                // of its directories go.
                if let Err(undo) = self.undo_prepare(key, make) {
                    warn!(snapshot.key = key, error = %undo, "cannot undo a snapshot whose directories could not be made; its next Mounts makes them");
                }
                return Err(e);
            }
            Ok((info, spec))
        });
        drop(holds);
        out
    }

    /// Undoes Prepare or View `key` whose directories ([`Dirs`] `make`) could
    /// not be made, after its transaction committed: the snapshot's rows are
    /// deleted; a session's is released with its lease (and an attempt it
    /// started ends `abandoned`), a plain snapshot's own layer row deleted;
    /// then what was made of the directories is removed. The stack and
    /// branch an image's first container made stay (the next container of
    /// the image makes the same).
    fn undo_prepare(&self, key: &str, make: Dirs) -> Result<(), StoreError> {
        let forget = |tx: &Transaction<'_>| -> Result<Option<i64>, StoreError> {
            let layer: Option<i64> = tx
                .one(
                    "SELECT layer_id FROM snapshots WHERE key = ?1",
                    [key],
                    |r| r.get(0),
                )
                .optional()?
                .flatten();
            tx.exec("DELETE FROM snapshot_lowers WHERE key = ?1", [key])?;
            tx.exec("DELETE FROM snapshots WHERE key = ?1", [key])?;
            Ok(layer)
        };
        match make {
            Dirs::None => Ok(()),
            Dirs::Session(sid) => self.undo_new_session(sid, "session", None, |tx| {
                tx.exec(
                    "UPDATE graph_attempts SET status = 'abandoned', message = 'its session directories could not be made', ended_ns = ?2 WHERE session_id = ?1 AND status = 'running'",
                    params![sid, now_ns()],
                )?;
                forget(tx).map(drop)
            }),
            Dirs::Layer { dir, work } => {
                self.db.write(|tx| {
                    if let Some(id) = forget(tx)? {
                        tx.exec("DELETE FROM layers WHERE id = ?1 AND kind = 'active'", [id])?;
                    }
                    Ok(())
                })?;
                for d in work.iter().chain([&dir]) {
                    self.reaper.drop_tree(d, "prepare-undone");
                }
                Ok(())
            }
        }
    }

    /// Makes what [`Dirs`] names, after the transaction that recorded the rows
    /// committed (no filesystem work inside a write transaction, ARCHITECTURE
    /// §9). Idempotent: a crash in between leaves rows whose directories the
    /// next `Mounts` makes. Error: `Io` naming the directory.
    fn make_dirs(&self, make: Dirs, spec: &MountSpec) -> Result<(), StoreError> {
        match make {
            Dirs::None => Ok(()),
            Dirs::Session(sid) => self.ready_run(sid, spec),
            Dirs::Layer { dir, work } => {
                let overlay = work.is_some();
                for (i, (p, mode)) in std::iter::once((dir, 0o755))
                    .chain(work.map(|w| (w, 0o700)))
                    .enumerate()
                {
                    let step = if overlay && i == 1 {
                        // The snapshot's directory made, its workdir not yet.
                        crate::failpoints::fail("snapshot.mkdir", &self.root)
                    } else {
                        Ok(())
                    };
                    match step.and_then(|()| fs::mkdir_mode(&p, mode)) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                        Err(e) => return Err(StoreError::io(&p, e)),
                    }
                }
                Ok(())
            }
        }
    }

    /// The session of containerd snapshot `key`, if it is a live rootfs snapshot.
    pub fn snapshot_session(&self, key: &str) -> Result<Option<SessionId>, StoreError> {
        self.db.read(|conn| {
            Ok(conn
                .one(
                    "SELECT session_id FROM snapshots WHERE key = ?1 AND kind = 'active'",
                    [key],
                    |r| r.get::<_, Option<i64>>(0),
                )
                .optional()?
                .flatten())
        })
    }

    /// The branch named by the snapshot label [`SNAPSHOT_BRANCH_LABEL`] of session `sid`'s
    /// rootfs snapshot, if any (it wins over a container label).
    pub fn snapshot_branch_label(&self, sid: SessionId) -> Result<Option<String>, StoreError> {
        self.db.read(|conn| {
            let key: Option<String> = conn
                .one(
                    "SELECT key FROM snapshots WHERE session_id = ?1 AND kind = 'active'",
                    [sid],
                    |r| r.get(0),
                )
                .optional()?;
            match key {
                Some(k) => Ok(need_snap(conn, &k)?
                    .labels
                    .get(SNAPSHOT_BRANCH_LABEL)
                    .cloned()),
                None => Ok(None),
            }
        })
    }

    /// containerd `Mounts`. For a session whose last run finished, this starts a
    /// new run (see [`Store::session_mount`]).
    pub fn mounts(&self, key: &str) -> Result<MountSpec, StoreError> {
        let (spec, make) = self.db.write(|tx| {
            let row = need_snap(tx, key)?;
            match (row.kind, row.session_id) {
                (SnapshotKind::Active, Some(sid)) => {
                    Ok((self.start_run(tx, sid)?, Dirs::Session(sid)))
                }
                (SnapshotKind::Active, None) => {
                    let id = row.layer_id.ok_or_else(|| stack_removed(key))?;
                    let lowers = match &row.parent {
                        Some(p) => committed_chain(tx, p)?,
                        None => Vec::new(),
                    };
                    let dirs = self.layer_dirs(tx, &lowers)?;
                    let make = Dirs::Layer {
                        dir: self.layer_path(id),
                        work: (!lowers.is_empty()).then(|| self.work_path(id)),
                    };
                    Ok((
                        active_spec(self.layer_path(id), self.work_path(id), dirs),
                        make,
                    ))
                }
                (SnapshotKind::View, _) => {
                    let lowers = frozen_lowers(tx, key)?;
                    // A view of nothing has an empty directory of its own.
                    let make = match row.layer_id {
                        Some(id) => Dirs::Layer {
                            dir: self.layer_path(id),
                            work: None,
                        },
                        None => Dirs::None,
                    };
                    Ok((view_spec(self.layer_dirs(tx, &lowers)?), make))
                }
                (SnapshotKind::Committed, _) => Err(StoreError::FailedPrecondition(format!(
                    "{key} is a committed snapshot: mount it through View or Prepare"
                ))),
            }
        })?;
        self.make_dirs(make, &spec)?;
        Ok(spec)
    }

    /// containerd `Commit(name, key)`: turns the active snapshot `key` into the
    /// committed snapshot `name`, without moving any directory (the active one may
    /// still be mounted). An image extraction becomes a base layer. Committing a
    /// session freezes what it saw (its private layers, lease and upper) and ends
    /// the session without publishing (outcome `discarded`). Returns the
    /// session it ended, if any: its watchers are the caller's to wake.
    /// Errors: `SnapshotNotFound`, `SnapshotExists` (name), `FailedPrecondition`
    /// (key not active).
    pub fn commit(
        &self,
        name: &str,
        key: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<Option<SessionId>, StoreError> {
        // Usage is measured outside the transaction (it walks the tree).
        let row = self.db.read(|conn| need_snap(conn, key))?;
        if row.kind != SnapshotKind::Active {
            return Err(StoreError::FailedPrecondition(format!(
                "{key} is not an active snapshot"
            )));
        }
        let dir = match (row.session_id, row.layer_id) {
            (Some(sid), _) => self.upper_path(sid),
            (None, Some(id)) => self.layer_path(id),
            (None, None) => return Err(stack_removed(key)),
        };
        let (size, inodes) = fs::disk_usage(&dir).map_err(|e| StoreError::io(&dir, e))?;

        let (work_to_remove, ended) = self.db.write(|tx| {
            let row = need_snap(tx, key)?;
            if get_snap(tx, name)?.is_some() {
                return Err(StoreError::SnapshotExists(name.to_string()));
            }
            let mut all_labels = row.labels.clone();
            all_labels.extend(labels);
            let lj = labels_json(&all_labels);
            let now = now_ns();
            let mut work_to_remove = None;
            match row.session_id {
                Some(sid) => {
                    let s = get_sess(tx, sid)?;
                    let lease = s.lease_id.ok_or_else(|| {
                        StoreError::FailedPrecondition(format!(
                            "session {sid} holds no lease; mount it first"
                        ))
                    })?;
                    let manifest = lease_manifest(tx, lease)?;
                    let lowers = self.session_lowers(tx, &s, manifest)?;
                    // The upper stays where it is: the layer row points at it.
                    let layer = insert_layer(tx, LayerKind::Committed, Some(&s.stack), Some(sid))?;
                    tx.exec(
                        "UPDATE layers SET path = ?2 WHERE id = ?1",
                        params![layer, format!("s/{sid}/upper")],
                    )?;
                    let mut frozen = vec![layer];
                    frozen.extend(lowers);
                    tx.exec(
                        "INSERT INTO snapshots(key, kind, parent, labels, created_ns, updated_ns, layer_id, frozen, size, inodes) VALUES (?1, 'committed', ?2, ?3, ?4, ?4, ?5, 1, ?6, ?7)",
                        params![name, row.parent, lj, now, layer, size, inodes],
                    )?;
                    freeze(tx, name, &frozen)?;
                    // The run ends discarded (the outcomes' own writer); the
                    // session is released: containerd holds its upper now.
                    let record = OutcomeRecord::new(
                        OutcomeKind::Discarded,
                        format!("committed by containerd as snapshot {name}; not published"),
                    );
                    insert_outcome(tx, &s, &record, SessionState::Discarded, true)?;
                    tx.exec(
                        "UPDATE sessions SET released = 1 WHERE id = ?1",
                        [sid],
                    )?;
                }
                None => {
                    let id = row.layer_id.ok_or_else(|| stack_removed(key))?;
                    let image = is_extraction(key, &row.labels)
                        || split_key(name).is_some_and(|(_, n)| is_digest(n));
                    tx.exec(
                        "UPDATE layers SET kind = ?2 WHERE id = ?1",
                        params![id, if image { "base" } else { "committed" }],
                    )?;
                    tx.exec(
                        "INSERT INTO snapshots(key, kind, parent, labels, created_ns, updated_ns, layer_id, image_layer, size, inodes) VALUES (?1, 'committed', ?2, ?3, ?4, ?4, ?5, ?6, ?7, ?8)",
                        params![name, row.parent, lj, now, id, image as i64, size, inodes],
                    )?;
                    work_to_remove = Some(self.work_path(id));
                }
            }
            tx.exec("DELETE FROM snapshots WHERE key = ?1", [key])?;
            Ok((work_to_remove, row.session_id))
        })?;
        crate::failpoints::hit("snapshot.committed");
        if let Some(w) = work_to_remove {
            self.reaper.drop_tree(&w, "work");
        }
        info!(snapshot.key = key, name, "committed");
        Ok(ended)
    }

    /// containerd `Remove` (arrives from containerd's GC). Refuses with
    /// `FailedPrecondition` while children exist. Never waits for a publish: a
    /// rootfs snapshot's session is only marked released ([`Removed::Session`]);
    /// the caller ends its run and then calls [`Store::complete_release`]. A layer
    /// still recorded as a stack's base layer, or a session's private layer, is
    /// kept (history needs it); its snapshot row goes.
    pub fn remove(&self, key: &str) -> Result<Removed, StoreError> {
        let (removed, dirs) = self.db.write(|tx| {
            let row = need_snap(tx, key)?;
            let children: i64 = tx.one(
                "SELECT count(*) FROM snapshots WHERE parent = ?1",
                [key],
                |r| r.get(0),
            )?;
            if children > 0 {
                return Err(StoreError::FailedPrecondition(format!(
                    "cannot remove snapshot {key}: {children} snapshot(s) use it as parent"
                )));
            }
            let mut dirs = Vec::new();
            let mut removed = Removed::Plain;
            if let (Some(sid), SnapshotKind::Active) = (row.session_id, row.kind) {
                let s = get_sess(tx, sid)?;
                tx.exec(
                    "UPDATE sessions SET released = 1, remove_pending = 1, updated_ns = ?2 WHERE id = ?1",
                    params![sid, now_ns()],
                )?;
                let _ = s;
                removed = Removed::Session(sid);
            }
            if let Some(id) = row.layer_id {
                let rel: Option<String> = tx
                    .one("SELECT path FROM layers WHERE id = ?1", [id], |r| r.get(0))
                    .optional()?;
                let in_use: i64 = tx.one(
                    &format!("SELECT (SELECT count(*) FROM snapshots WHERE key != ?1 AND layer_id = ?2)
                          + (SELECT count(*) FROM snapshot_lowers WHERE key != ?1 AND layer_id = ?2)
                          + (SELECT count(*) FROM stack_layers WHERE layer_id = ?2)
                          + (SELECT count(*) FROM session_layers
                               WHERE layer_id = ?2 AND session_id IN (SELECT id FROM sessions WHERE {}))
                          + (SELECT count(*) FROM manifest_layers WHERE layer_id = ?2)",
                        crate::sessions::KEEPS_DIRS),
                    params![key, id],
                    |r| r.get(0),
                )?;
                if in_use == 0 {
                    tx.exec("DELETE FROM layers WHERE id = ?1", [id])?;
                    if let Some(rel) = rel {
                        let p = self.root.join(&rel);
                        if rel.starts_with("s/") {
                            // A committed session's upper: its whole session dir.
                            if let Some(sdir) = p.parent() {
                                dirs.push(sdir.to_path_buf());
                            }
                        } else {
                            dirs.push(p);
                        }
                    }
                    dirs.push(self.work_path(id));
                } else {
                    debug!(snapshot.key = key, layer.id = id, "layer kept: history or another snapshot uses it");
                    dirs.push(self.work_path(id));
                }
            }
            tx.exec("DELETE FROM snapshot_lowers WHERE key = ?1", [key])?;
            tx.exec("DELETE FROM snapshots WHERE key = ?1", [key])?;
            Ok((removed, dirs))
        })?;
        crate::failpoints::hit("snapshot.removed");
        for d in dirs {
            self.reaper.drop_tree(&d, "removed");
        }
        info!(snapshot.key = key, "removed");
        Ok(removed)
    }

    /// containerd `Stat`. Error: `SnapshotNotFound`.
    pub fn stat(&self, key: &str) -> Result<SnapshotInfo, StoreError> {
        self.db.read(|conn| Ok(need_snap(conn, key)?.info()))
    }

    /// containerd `Update`: only labels change. `fieldpaths` empty replaces all
    /// labels; `labels` replaces all; `labels.K` sets K, or deletes it when absent
    /// from `labels` (containerd sends filtered-out labels as paths without values).
    pub fn update_labels(
        &self,
        key: &str,
        labels: BTreeMap<String, String>,
        fieldpaths: &[String],
    ) -> Result<SnapshotInfo, StoreError> {
        self.db.write(|tx| {
            let row = need_snap(tx, key)?;
            let mut new = row.labels.clone();
            if fieldpaths.is_empty() || fieldpaths.iter().any(|p| p == "labels") {
                new = labels;
            } else {
                for p in fieldpaths {
                    let Some(k) = p.strip_prefix("labels.") else {
                        return Err(StoreError::InvalidArgument(format!(
                            "cannot update field {p:?} of snapshot {key}: only labels can change"
                        )));
                    };
                    match labels.get(k) {
                        Some(v) => new.insert(k.to_string(), v.clone()),
                        None => new.remove(k),
                    };
                }
            }
            tx.exec(
                "UPDATE snapshots SET labels = ?2, updated_ns = ?3 WHERE key = ?1",
                params![key, labels_json(&new), now_ns()],
            )?;
            Ok(need_snap(tx, key)?.info())
        })
    }

    /// containerd `List`/`Walk`: every snapshot containerd created, nothing else.
    pub fn list(&self) -> Result<Vec<SnapshotInfo>, StoreError> {
        self.db.read(|conn| {
            let mut stmt =
                conn.prepare_cached(&format!("SELECT {SNAP_COLS} FROM snapshots ORDER BY key"))?;
            let raws: Vec<RawSnap> = stmt.query_map([], raw_snap)?.collect::<Result<_, _>>()?;
            raws.into_iter()
                .map(|r| snap_from_raw(r).map(|s| s.info()))
                .collect()
        })
    }

    /// containerd `Usage`: `(bytes, inodes)` of the snapshot's own directory; real
    /// allocated bytes, hardlinks once, walked beneath the directory without
    /// following anything. Active snapshots are measured now; committed ones at
    /// commit; views own nothing.
    pub fn usage(&self, key: &str) -> Result<(i64, i64), StoreError> {
        let row = self.db.read(|conn| need_snap(conn, key))?;
        match (row.kind, row.size, row.inodes) {
            (SnapshotKind::Committed, Some(s), Some(i)) => Ok((s, i)),
            (SnapshotKind::View, _, _) => Ok((0, 0)),
            _ => {
                let dir = match (row.session_id, row.layer_id) {
                    (Some(sid), _) => self.upper_path(sid),
                    (None, Some(id)) => self.layer_path(id),
                    _ => return Ok((0, 0)),
                };
                fs::disk_usage(&dir).map_err(|e| StoreError::io(&dir, e))
            }
        }
    }

    /// Sessions released by containerd whose removal was not completed (the
    /// daemon stopped in between): the engine finishes them at start.
    pub fn pending_releases(&self) -> Result<Vec<SessionId>, StoreError> {
        self.db.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT id FROM sessions WHERE released = 1 AND remove_pending = 1 ORDER BY id",
            )?;
            let rows = stmt.query_map([], |r| r.get(0))?;
            Ok(rows.collect::<Result<_, _>>()?)
        })
    }
}

impl Store {
    /// The stack of the image whose top layer has chainID `chain` in containerd
    /// namespace `namespace`, recorded now (with the image's layers as its base)
    /// if no session of the image has recorded it yet: a Mode B session may be
    /// the image's first. `None` when the image's top layer is not a committed
    /// snapshot of this store (not unpacked for the layerstack snapshotter).
    pub fn ensure_image_stack(
        &self,
        namespace: &str,
        chain: &str,
    ) -> Result<Option<String>, StoreError> {
        let stack = stack_id(namespace, chain);
        let known: Option<String> = self.db.read(|conn| {
            Ok(conn
                .one("SELECT id FROM stacks WHERE id = ?1", [&stack], |r| {
                    r.get(0)
                })
                .optional()?)
        })?;
        if known.is_some() {
            return Ok(known);
        }
        self.db.write(|tx| {
            let keys: Vec<String> = {
                let mut stmt = tx.prepare_cached(
                    "SELECT key FROM snapshots WHERE kind = 'committed' AND image_layer = 1 ORDER BY key",
                )?;
                let rows = stmt.query_map([], |r| r.get(0))?;
                rows.collect::<Result<_, _>>()?
            };
            let Some(key) = keys
                .into_iter()
                .find(|k| split_key(k) == Some((namespace, chain)))
            else {
                return Ok(None);
            };
            let base_layers = committed_chain(tx, &key)?;
            ensure_stack(tx, &stack, chain, Some(namespace), &base_layers)?;
            Ok(Some(stack.clone()))
        })
    }
}
