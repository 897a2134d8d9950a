//! LayerStack's core model: one directory plus one SQLite database holding
//! layers, stacks, branches, manifests, leases, sessions and publish outcomes
//! (ARCHITECTURE.md §2, §8).
//!
//! The store speaks containerd's snapshot vocabulary (`key`, `name`, `parent`,
//! active/view/committed) for what containerd creates, and LayerStack's own
//! (stack, branch, manifest, lease, session) for the shared history. Published
//! layers are internal: they never appear as snapshots.
//!
//! On-disk layout (`<root>` is the store root):
//! ```text
//! <root>/store.db          SQLite (WAL). Source of truth.
//! <root>/l/<n>/            layer directories, overlay upper format; short for the mount page
//! <root>/w/<n>/            overlay workdirs of active non-session snapshots
//! <root>/s/<id>/{upper,work}  sessions
//! <root>/staging/          in-flight builds
//! ```
//! Every write follows containerd's order: filesystem work next to one short
//! `IMMEDIATE` transaction; rows are deleted before directories; the startup
//! sweep removes directories without rows.
//!
//! ```no_run
//! use layerstack_store::{Store, StoreOptions};
//! let store = Store::open("/var/lib/layerstack".as_ref(), &StoreOptions::default())?;
//! for s in store.sessions()? {
//!     println!("{} {} {}", s.namespace, s.container, s.state.as_str());
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;
pub mod fs;
mod model;
mod schema;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use rusqlite::{
    params, Connection, OpenFlags, OptionalExtension, Transaction, TransactionBehavior,
};
use tracing::{debug, info, warn};

pub use error::{OpenError, PublishError, SnapshotError, StoreError};
pub use model::*;
pub use schema::FORMAT_VERSION;

/// Label that names the branch a container rootfs session leases
/// (`ctr run --snapshotter-label containerd.io/snapshot/layerstack.branch=NAME`).
pub const BRANCH_LABEL: &str = "containerd.io/snapshot/layerstack.branch";
/// Label containerd's unpacker sets on an image-layer extraction `Prepare`
/// (containerd `unpacker.go`, remote-snapshot protocol).
pub const SNAPSHOT_REF_LABEL: &str = "containerd.io/snapshot.ref";
/// The kernel's overlayfs lower-layer limit (`OVL_MAX_STACK`, fs/overlayfs/params.h).
pub const MAX_LOWERS: usize = 500;

/// Durability profile (ARCHITECTURE.md §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// WAL with `synchronous=OFF`: a daemon crash loses nothing reported committed;
    /// an OS crash may.
    #[default]
    Disposable,
    /// WAL with `synchronous=FULL`.
    Durable,
}

/// Options for [`Store::open`].
#[derive(Debug, Clone)]
pub struct StoreOptions {
    pub durability: Durability,
    /// Branch a session leases when its snapshot names none.
    pub default_branch: String,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            durability: Durability::Disposable,
            default_branch: "main".to_string(),
        }
    }
}

/// What the startup/`Cleanup` sweep did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SweepReport {
    /// Directories removed because no row references them.
    pub removed: Vec<PathBuf>,
    /// Rows whose directory is missing (reported, not repaired).
    pub missing: Vec<PathBuf>,
    /// Published layers whose directory was moved into place after a crash.
    pub rolled_forward: Vec<PathBuf>,
}

/// Result of a committed publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub layer: LayerId,
    pub manifest: ManifestId,
}

/// The LayerStack store. Thread-safe; methods are synchronous (call them from a
/// blocking thread in async code).
///
/// Writes go through one connection, one at a time. Pure reads (`stat`, `list`,
/// `usage`, `sessions`, `session`, `find_session`, `stacks`, `log`) use read-only
/// connections beside it, each in its own read transaction: SQLite's WAL lets them
/// read the last committed state while a write is in progress, so they never wait
/// for the writer (ARCHITECTURE.md §9, "reads never wait").
pub struct Store {
    root: PathBuf,
    conn: Mutex<Connection>,
    readers: Readers,
    default_branch: String,
}

/// Idle read-only connections to `store.db`, opened on demand; at most
/// [`Readers::MAX_IDLE`] are kept between reads.
struct Readers {
    db: PathBuf,
    idle: Mutex<Vec<Connection>>,
}

impl Readers {
    const MAX_IDLE: usize = 4;

    fn take(&self) -> rusqlite::Result<Connection> {
        if let Some(c) = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(c);
        }
        let c = Connection::open_with_flags(
            &self.db,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        c.busy_timeout(std::time::Duration::from_secs(10))?;
        Ok(c)
    }

    fn give_back(&self, c: Connection) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < Self::MAX_IDLE {
            idle.push(c);
        }
    }
}

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

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
fn is_digest(s: &str) -> bool {
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

/// Validate a branch name: 1–128 bytes of `[A-Za-z0-9._/-]`, not starting with `-` or `/`.
pub fn validate_branch(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with(['-', '/'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'/' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "invalid branch name {name:?}: use 1-128 characters of A-Z a-z 0-9 . _ / - not starting with - or /"
        ))
    }
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
    lowers: Option<Vec<LayerId>>,
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

const SNAP_COLS: &str = "key, kind, parent, labels, created_ns, updated_ns, layer_id, session_id, image_layer, lowers, size, inodes";

fn snap_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SnapRow> {
    let labels: String = r.get(3)?;
    let lowers: Option<String> = r.get(9)?;
    Ok(SnapRow {
        key: r.get(0)?,
        kind: SnapshotKind::parse(&r.get::<_, String>(1)?),
        parent: r.get(2)?,
        labels: serde_json::from_str(&labels).unwrap_or_default(),
        created_ns: r.get(4)?,
        updated_ns: r.get(5)?,
        layer_id: r.get(6)?,
        session_id: r.get(7)?,
        image_layer: r.get::<_, i64>(8)? != 0,
        lowers: lowers.and_then(|l| serde_json::from_str(&l).ok()),
        size: r.get(10)?,
        inodes: r.get(11)?,
    })
}

fn get_snap(tx: &Connection, key: &str) -> rusqlite::Result<Option<SnapRow>> {
    tx.query_row(
        &format!("SELECT {SNAP_COLS} FROM snapshots WHERE key = ?1"),
        [key],
        snap_from_row,
    )
    .optional()
}

struct SessRow {
    id: SessionId,
    key: String,
    namespace: String,
    container: String,
    stack: String,
    branch: String,
    base_key: String,
    above: Vec<LayerId>,
    lease_id: Option<i64>,
    state: SessionState,
    outcome: Option<Outcome>,
    runs: i64,
    released: bool,
    policy: Option<String>,
}

const SESS_COLS: &str =
    "id, key, namespace, container, stack, branch, base_key, above, lease_id, state, outcome, runs, released, policy";

fn sess_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SessRow> {
    let above: String = r.get(7)?;
    let outcome: Option<String> = r.get(10)?;
    Ok(SessRow {
        id: r.get(0)?,
        key: r.get(1)?,
        namespace: r.get(2)?,
        container: r.get(3)?,
        stack: r.get(4)?,
        branch: r.get(5)?,
        base_key: r.get(6)?,
        above: serde_json::from_str(&above).unwrap_or_default(),
        lease_id: r.get(8)?,
        state: SessionState::parse(&r.get::<_, String>(9)?),
        outcome: outcome.and_then(|o| serde_json::from_str(&o).ok()),
        runs: r.get(11)?,
        released: r.get::<_, i64>(12)? != 0,
        policy: r.get(13)?,
    })
}

fn get_sess(tx: &Connection, id: SessionId) -> Result<SessRow, StoreError> {
    tx.query_row(
        &format!("SELECT {SESS_COLS} FROM sessions WHERE id = ?1"),
        [id],
        sess_from_row,
    )
    .optional()?
    .ok_or(StoreError::SessionNotFound(id))
}

fn manifest_layers(tx: &Connection, id: ManifestId) -> rusqlite::Result<Vec<LayerId>> {
    let s: String = tx.query_row("SELECT layers FROM manifests WHERE id = ?1", [id], |r| {
        r.get(0)
    })?;
    Ok(serde_json::from_str(&s).unwrap_or_default())
}

fn lease_manifest(tx: &Connection, lease: i64) -> rusqlite::Result<ManifestId> {
    tx.query_row(
        "SELECT manifest_id FROM leases WHERE id = ?1",
        [lease],
        |r| r.get(0),
    )
}

fn branch_head(tx: &Connection, stack: &str, branch: &str) -> rusqlite::Result<Option<ManifestId>> {
    tx.query_row(
        "SELECT manifest_id FROM branches WHERE stack = ?1 AND name = ?2",
        params![stack, branch],
        |r| r.get(0),
    )
    .optional()
}

/// Lower layers of a committed snapshot, newest first.
fn committed_chain(tx: &Connection, key: &str) -> Result<Vec<LayerId>, SnapshotError> {
    let mut out = Vec::new();
    let mut next = Some(key.to_string());
    while let Some(k) = next {
        let row = get_snap(tx, &k)?.ok_or_else(|| SnapshotError::NotFound(k.clone()))?;
        if row.kind != SnapshotKind::Committed {
            return Err(SnapshotError::FailedPrecondition(format!(
                "parent {k} is not a committed snapshot"
            )));
        }
        if let Some(lowers) = row.lowers {
            out.extend(lowers);
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
    tx: &Connection,
    parent: &str,
) -> Result<Option<(SnapRow, Vec<LayerId>)>, SnapshotError> {
    let mut above = Vec::new();
    let mut next = Some(parent.to_string());
    while let Some(k) = next {
        let row = get_snap(tx, &k)?.ok_or_else(|| SnapshotError::NotFound(k.clone()))?;
        if row.kind != SnapshotKind::Committed {
            return Err(SnapshotError::FailedPrecondition(format!(
                "parent {k} is not a committed snapshot"
            )));
        }
        if row.image_layer {
            return Ok(Some((row, above)));
        }
        if let Some(l) = row.layer_id {
            above.push(l);
        }
        next = row.parent.clone();
    }
    Ok(None)
}

/// Stack identity of an image-layer snapshot: its chainID (the extraction's
/// `containerd.io/snapshot.ref` label, else the name part of the key).
fn stack_id_of(base: &SnapRow) -> String {
    base.labels
        .get(SNAPSHOT_REF_LABEL)
        .cloned()
        .or_else(|| split_key(&base.key).map(|(_, n)| n.to_string()))
        .unwrap_or_else(|| base.key.clone())
}

impl Store {
    /// Open (or create) the store at `root`.
    ///
    /// Refuses, before writing anything, a root that is not on local ext4, xfs or
    /// btrfs ([`OpenError::Unsupported`]) and a store of another format version
    /// ([`OpenError::Version`]). Runs the startup sweep.
    pub fn open(root: &Path, opts: &StoreOptions) -> Result<Store, OpenError> {
        match fs::check_supported_fs(root).map_err(|e| OpenError::Io(root.to_path_buf(), e))? {
            Ok(name) => debug!(root = %root.display(), fs = name, "store filesystem supported"),
            Err(found) => {
                return Err(OpenError::Unsupported {
                    root: root.to_path_buf(),
                    fs: found,
                })
            }
        }
        let io = |e| OpenError::Io(root.to_path_buf(), e);
        std::fs::create_dir_all(root).map_err(io)?;
        for d in ["l", "w", "s", "staging"] {
            match fs::mkdir_mode(&root.join(d), 0o700) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io(e)),
            }
        }
        // Layer dirs must be traversable by the container's users through overlay.
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(root.join("l"), std::fs::Permissions::from_mode(0o711))
                .map_err(io)?;
        }
        let db = root.join("store.db");
        let mut conn = Connection::open(&db)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        let sync = match opts.durability {
            Durability::Disposable => "OFF",
            Durability::Durable => "FULL",
        };
        conn.pragma_update(None, "synchronous", sync)?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let has_meta: bool = tx.query_row(
                "SELECT count(*) FROM sqlite_master WHERE type='table' AND name='meta'",
                [],
                |r| r.get::<_, i64>(0).map(|n| n > 0),
            )?;
            if has_meta {
                let v: Option<String> = tx
                    .query_row(
                        "SELECT value FROM meta WHERE key='format_version'",
                        [],
                        |r| r.get(0),
                    )
                    .optional()?;
                let v = v.and_then(|v| v.parse::<i64>().ok()).unwrap_or(-1);
                if v != FORMAT_VERSION {
                    return Err(OpenError::Version {
                        root: root.to_path_buf(),
                        found: v,
                        expected: FORMAT_VERSION,
                    });
                }
            } else {
                let tables: i64 = tx.query_row(
                    "SELECT count(*) FROM sqlite_master WHERE type='table'",
                    [],
                    |r| r.get(0),
                )?;
                if tables > 0 {
                    return Err(OpenError::Version {
                        root: root.to_path_buf(),
                        found: -1,
                        expected: FORMAT_VERSION,
                    });
                }
                tx.execute_batch(schema::SCHEMA)?;
                tx.execute(
                    "INSERT INTO meta(key, value) VALUES ('format_version', ?1)",
                    [FORMAT_VERSION.to_string()],
                )?;
                info!(root = %root.display(), version = FORMAT_VERSION, "created store");
            }
            tx.commit()?;
        }
        let store = Store {
            root: root.to_path_buf(),
            conn: Mutex::new(conn),
            readers: Readers {
                db,
                idle: Mutex::new(Vec::new()),
            },
            default_branch: opts.default_branch.clone(),
        };
        let report = store.sweep().map_err(OpenError::Store)?;
        for p in &report.removed {
            info!(path = %p.display(), "sweep removed directory without a row");
        }
        for p in &report.missing {
            warn!(path = %p.display(), "row references a missing directory");
        }
        Ok(store)
    }

    /// The store root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<root>/l/<id>`: the directory of layer `id`.
    pub fn layer_path(&self, id: LayerId) -> PathBuf {
        self.root.join("l").join(id.to_string())
    }

    fn layer_rel(id: LayerId) -> String {
        format!("l/{id}")
    }

    /// `<root>/w/<id>`: the overlay workdir of an active non-session snapshot.
    pub fn work_path(&self, id: LayerId) -> PathBuf {
        self.root.join("w").join(id.to_string())
    }

    /// `<root>/s/<id>`: a session's directory.
    pub fn session_path(&self, id: SessionId) -> PathBuf {
        self.root.join("s").join(id.to_string())
    }

    /// `<root>/s/<id>/upper`: a session's private overlay upperdir.
    pub fn upper_path(&self, id: SessionId) -> PathBuf {
        self.session_path(id).join("upper")
    }

    /// `<root>/s/<id>/work`: a session's overlay workdir.
    pub fn session_work_path(&self, id: SessionId) -> PathBuf {
        self.session_path(id).join("work")
    }

    /// `<root>/staging`.
    pub fn staging_path(&self) -> PathBuf {
        self.root.join("staging")
    }

    fn conn(&self) -> MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` in a read transaction on a read-only connection (one consistent
    /// snapshot of the last committed state; never waits for the writer).
    fn read<T, E>(&self, f: impl FnOnce(&Connection) -> Result<T, E>) -> Result<T, E>
    where
        E: From<rusqlite::Error>,
    {
        let mut c = self.readers.take()?;
        let result = {
            let tx = c.transaction()?;
            // Dropped without commit: a read transaction ends by rolling back.
            f(&tx)
        };
        self.readers.give_back(c);
        result
    }

    fn layer_dirs(&self, tx: &Connection, ids: &[LayerId]) -> Result<Vec<PathBuf>, StoreError> {
        let mut stmt = tx.prepare_cached("SELECT path FROM layers WHERE id = ?1")?;
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

    /// Lower layers of a session's current lease, newest first:
    /// per-container committed layers, then the leased published layers, then the image.
    fn session_lowers(
        &self,
        tx: &Connection,
        s: &SessRow,
        lease: i64,
    ) -> Result<Vec<LayerId>, SnapshotError> {
        let manifest = lease_manifest(tx, lease)?;
        let mut lowers = s.above.clone();
        lowers.extend(manifest_layers(tx, manifest)?);
        lowers.extend(committed_chain(tx, &s.base_key)?);
        Ok(lowers)
    }

    fn ensure_stack_branch(
        &self,
        tx: &Transaction<'_>,
        stack: &str,
        branch: &str,
    ) -> Result<ManifestId, SnapshotError> {
        let now = now_ns();
        tx.execute(
            "INSERT OR IGNORE INTO stacks(id, created_ns) VALUES (?1, ?2)",
            params![stack, now],
        )?;
        if let Some(m) = branch_head(tx, stack, &self.default_branch)? {
            if branch == self.default_branch {
                return Ok(m);
            }
        } else {
            tx.execute(
                "INSERT INTO manifests(stack, layers, parent, layer_id, created_ns) VALUES (?1, '[]', NULL, NULL, ?2)",
                params![stack, now],
            )?;
            let m = tx.last_insert_rowid();
            tx.execute(
                "INSERT INTO branches(stack, name, manifest_id, updated_ns) VALUES (?1, ?2, ?3, ?4)",
                params![stack, self.default_branch, m, now],
            )?;
            info!(stack, branch = %self.default_branch, "created stack");
        }
        if let Some(m) = branch_head(tx, stack, branch)? {
            return Ok(m);
        }
        // A new branch forks the default branch's head: O(1), one row.
        let m = branch_head(tx, stack, &self.default_branch)?
            .ok_or_else(|| SnapshotError::Internal("default branch vanished".into()))?;
        tx.execute(
            "INSERT INTO branches(stack, name, manifest_id, updated_ns) VALUES (?1, ?2, ?3, ?4)",
            params![stack, branch, m, now],
        )?;
        info!(stack, branch, from = %self.default_branch, "forked branch");
        Ok(m)
    }

    fn new_lease(
        tx: &Transaction<'_>,
        manifest: ManifestId,
        session: SessionId,
    ) -> rusqlite::Result<i64> {
        tx.execute(
            "INSERT INTO leases(manifest_id, session_id, created_ns) VALUES (?1, ?2, ?3)",
            params![manifest, session, now_ns()],
        )?;
        Ok(tx.last_insert_rowid())
    }

    fn release_lease(tx: &Transaction<'_>, lease: Option<i64>) -> rusqlite::Result<()> {
        if let Some(l) = lease {
            tx.execute(
                "UPDATE leases SET released_ns = ?2 WHERE id = ?1 AND released_ns IS NULL",
                params![l, now_ns()],
            )?;
        }
        Ok(())
    }

    /// containerd `Prepare` (`view == false`) or `View` (`view == true`).
    ///
    /// A `Prepare` without [`SNAPSHOT_REF_LABEL`] whose parent chain reaches an image
    /// layer creates a session: a lease on the head of the branch named by
    /// [`BRANCH_LABEL`] (default branch otherwise; a new name forks the default
    /// branch). Errors: `AlreadyExists` (key taken), `NotFound` (parent),
    /// `FailedPrecondition` (parent not committed), `InvalidArgument` (branch label).
    pub fn prepare(
        &self,
        key: &str,
        parent: &str,
        labels: BTreeMap<String, String>,
        view: bool,
    ) -> Result<(SnapshotInfo, MountSpec), SnapshotError> {
        if key.is_empty() {
            return Err(SnapshotError::InvalidArgument(
                "snapshot key is empty".into(),
            ));
        }
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        if get_snap(&tx, key)?.is_some() {
            return Err(SnapshotError::AlreadyExists(key.to_string()));
        }
        let parent_opt = (!parent.is_empty()).then(|| parent.to_string());
        let now = now_ns();
        let labels_json = serde_json::to_string(&labels).unwrap_or_else(|_| "{}".into());
        let is_extract = is_extraction(key, &labels);

        if view {
            let lowers = match &parent_opt {
                Some(p) => committed_chain(&tx, p)?,
                None => Vec::new(),
            };
            let (layer_id, lowers) = if lowers.is_empty() {
                // A view of nothing: an empty read-only directory.
                let id = self.insert_layer(&tx, "active", None, None)?;
                let dir = self.layer_path(id);
                fs::mkdir_mode(&dir, 0o755).map_err(|e| SnapshotError::io(&dir, e))?;
                (Some(id), vec![id])
            } else {
                (None, lowers)
            };
            tx.execute(
                "INSERT INTO snapshots(key, kind, parent, labels, created_ns, updated_ns, layer_id, lowers) VALUES (?1, 'view', ?2, ?3, ?4, ?4, ?5, ?6)",
                params![key, parent_opt, labels_json, now, layer_id, serde_json::to_string(&lowers).unwrap_or_default()],
            )?;
            let dirs = self.layer_dirs(&tx, &lowers)?;
            let info = get_snap(&tx, key)?
                .ok_or_else(|| SnapshotError::NotFound(key.into()))?
                .info();
            tx.commit()?;
            return Ok((info, Self::view_spec(dirs)));
        }

        let base = match (&parent_opt, is_extract) {
            (Some(p), false) => find_base(&tx, p)?,
            _ => None,
        };
        if let Some((base, above)) = base {
            let (ns, container) = split_key(key).unwrap_or(("", key));
            let branch = labels
                .get(BRANCH_LABEL)
                .cloned()
                .unwrap_or_else(|| self.default_branch.clone());
            validate_branch(&branch).map_err(SnapshotError::InvalidArgument)?;
            let stack = stack_id(ns, &stack_id_of(&base));
            let head = self.ensure_stack_branch(&tx, &stack, &branch)?;
            tx.execute(
                "INSERT INTO sessions(key, namespace, container, stack, branch, base_key, above, state, created_ns, updated_ns) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'active', ?8, ?8)",
                params![key, ns, container, stack, branch, base.key, serde_json::to_string(&above).unwrap_or_default(), now],
            )?;
            let sid = tx.last_insert_rowid();
            let lease = Self::new_lease(&tx, head, sid)?;
            tx.execute(
                "UPDATE sessions SET lease_id = ?2 WHERE id = ?1",
                params![sid, lease],
            )?;
            tx.execute(
                "INSERT INTO snapshots(key, kind, parent, labels, created_ns, updated_ns, session_id) VALUES (?1, 'active', ?2, ?3, ?4, ?4, ?5)",
                params![key, parent_opt, labels_json, now, sid],
            )?;
            self.make_session_dirs(sid)?;
            let s = get_sess(&tx, sid)?;
            let lowers = self.session_lowers(&tx, &s, lease)?;
            let spec = self.session_spec(&tx, sid, &lowers)?;
            let info = get_snap(&tx, key)?
                .ok_or_else(|| SnapshotError::NotFound(key.into()))?
                .info();
            tx.commit()?;
            info!(snapshot.key = key, session.id = sid, stack = %stack, branch = %branch, manifest = head, "session created");
            return Ok((info, spec));
        }

        // A plain active snapshot (image extraction, or a parent chain without an image).
        let lowers = match &parent_opt {
            Some(p) => committed_chain(&tx, p)?,
            None => Vec::new(),
        };
        let id = self.insert_layer(&tx, "active", None, None)?;
        let dir = self.layer_path(id);
        let work = self.work_path(id);
        fs::mkdir_mode(&dir, 0o755).map_err(|e| SnapshotError::io(&dir, e))?;
        if !lowers.is_empty() {
            fs::mkdir_mode(&work, 0o700).map_err(|e| SnapshotError::io(&work, e))?;
        }
        tx.execute(
            "INSERT INTO snapshots(key, kind, parent, labels, created_ns, updated_ns, layer_id) VALUES (?1, 'active', ?2, ?3, ?4, ?4, ?5)",
            params![key, parent_opt, labels_json, now, id],
        )?;
        let dirs = self.layer_dirs(&tx, &lowers)?;
        let info = get_snap(&tx, key)?
            .ok_or_else(|| SnapshotError::NotFound(key.into()))?
            .info();
        tx.commit()?;
        debug!(
            snapshot.key = key,
            layer.id = id,
            "active snapshot prepared"
        );
        Ok((info, Self::active_spec(dir, work, dirs)))
    }

    fn insert_layer(
        &self,
        tx: &Transaction<'_>,
        kind: &str,
        stack: Option<&str>,
        session: Option<SessionId>,
    ) -> rusqlite::Result<LayerId> {
        // AUTOINCREMENT: ids are never reused, so a leftover directory can never
        // be mistaken for a new layer's.
        let next: i64 = tx.query_row(
            "SELECT COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'layers'), 0) + 1",
            [],
            |r| r.get(0),
        )?;
        tx.execute(
            "INSERT INTO layers(id, kind, path, stack, session_id, created_ns) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![next, kind, Self::layer_rel(next), stack, session, now_ns()],
        )?;
        Ok(next)
    }

    fn make_session_dirs(&self, sid: SessionId) -> Result<(), SnapshotError> {
        let s = self.session_path(sid);
        for (p, mode) in [
            (s.clone(), 0o700),
            (s.join("upper"), 0o755),
            (s.join("work"), 0o700),
        ] {
            match fs::mkdir_mode(&p, mode) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(SnapshotError::io(&p, e)),
            }
        }
        Ok(())
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

    fn session_spec(
        &self,
        tx: &Connection,
        sid: SessionId,
        lowers: &[LayerId],
    ) -> Result<MountSpec, SnapshotError> {
        if lowers.len() > MAX_LOWERS {
            return Err(SnapshotError::FailedPrecondition(format!(
                "a container on this branch would mount {} lower layers (published history plus image layers); overlayfs allows {MAX_LOWERS} (OVL_MAX_STACK); squashing history is not implemented yet: run new containers on another branch (label {BRANCH_LABEL}) or image",
                lowers.len()
            )));
        }
        let dirs = self.layer_dirs(tx, lowers)?;
        let upper = self.upper_path(sid);
        if let Some(top) = dirs.first() {
            fs::init_upper_root(&upper, top).map_err(|e| SnapshotError::io(&upper, e))?;
        }
        Ok(MountSpec::Overlay {
            lowers: dirs,
            upper: Some((upper, self.session_work_path(sid))),
        })
    }

    /// containerd `Mounts`. For a session whose last run finished (published,
    /// discarded, conflict), this starts a new run: it pins the branch head if the
    /// session holds no lease, clears the outcome and marks the session active.
    pub fn mounts(&self, key: &str) -> Result<MountSpec, SnapshotError> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let row = get_snap(&tx, key)?.ok_or_else(|| SnapshotError::NotFound(key.to_string()))?;
        let spec = match (row.kind, row.session_id) {
            (SnapshotKind::Active, Some(sid)) => {
                let mut s = get_sess(&tx, sid)?;
                if s.lease_id.is_none() {
                    let head = branch_head(&tx, &s.stack, &s.branch)?.ok_or_else(|| {
                        SnapshotError::Internal(format!("branch {} vanished", s.branch))
                    })?;
                    let lease = Self::new_lease(&tx, head, sid)?;
                    tx.execute(
                        "UPDATE sessions SET lease_id = ?2 WHERE id = ?1",
                        params![sid, lease],
                    )?;
                    s.lease_id = Some(lease);
                }
                if s.state != SessionState::Active || s.outcome.is_some() {
                    tx.execute(
                        "UPDATE sessions SET state = 'active', outcome = NULL, runs = runs + 1, updated_ns = ?2 WHERE id = ?1",
                        params![sid, now_ns()],
                    )?;
                }
                self.make_session_dirs(sid)?;
                let lease = s.lease_id.unwrap_or_default();
                let lowers = self.session_lowers(&tx, &s, lease)?;
                self.session_spec(&tx, sid, &lowers)?
            }
            (SnapshotKind::Active, None) => {
                let id = row
                    .layer_id
                    .ok_or_else(|| SnapshotError::Internal(format!("{key} has no layer")))?;
                let lowers = match &row.parent {
                    Some(p) => committed_chain(&tx, p)?,
                    None => Vec::new(),
                };
                let dirs = self.layer_dirs(&tx, &lowers)?;
                Self::active_spec(self.layer_path(id), self.work_path(id), dirs)
            }
            (SnapshotKind::View, _) => {
                let lowers = row.lowers.clone().unwrap_or_default();
                Self::view_spec(self.layer_dirs(&tx, &lowers)?)
            }
            (SnapshotKind::Committed, _) => {
                return Err(SnapshotError::FailedPrecondition(format!(
                    "{key} is a committed snapshot: mount it through View or Prepare"
                )))
            }
        };
        tx.commit()?;
        Ok(spec)
    }

    /// containerd `Commit(name, key)`: turns the active snapshot `key` into the
    /// committed snapshot `name`, without moving any directory (the active one may
    /// still be mounted). An image extraction becomes a base layer. Committing a
    /// session freezes what it saw (its lease's layers plus its upper) and ends the
    /// session without publishing. Errors: `NotFound`, `AlreadyExists` (name),
    /// `FailedPrecondition` (key not active).
    pub fn commit(
        &self,
        name: &str,
        key: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<(), SnapshotError> {
        // Usage is measured outside the transaction (it walks the tree).
        let pre = {
            let conn = self.conn();
            get_snap(&conn, key)?
        };
        let row = pre.ok_or_else(|| SnapshotError::NotFound(key.to_string()))?;
        if row.kind != SnapshotKind::Active {
            return Err(SnapshotError::FailedPrecondition(format!(
                "{key} is not an active snapshot"
            )));
        }
        let dir = match (row.session_id, row.layer_id) {
            (Some(sid), _) => self.upper_path(sid),
            (None, Some(id)) => self.layer_path(id),
            _ => return Err(SnapshotError::Internal(format!("{key} has no directory"))),
        };
        let (size, inodes) = fs::disk_usage(&dir).map_err(|e| SnapshotError::io(&dir, e))?;

        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let row = get_snap(&tx, key)?.ok_or_else(|| SnapshotError::NotFound(key.to_string()))?;
        if get_snap(&tx, name)?.is_some() {
            return Err(SnapshotError::AlreadyExists(name.to_string()));
        }
        let mut all_labels = row.labels.clone();
        all_labels.extend(labels);
        let labels_json = serde_json::to_string(&all_labels).unwrap_or_else(|_| "{}".into());
        let now = now_ns();
        let mut work_to_remove = None;
        match row.session_id {
            Some(sid) => {
                let s = get_sess(&tx, sid)?;
                let lease = s.lease_id.ok_or_else(|| {
                    SnapshotError::FailedPrecondition(format!(
                        "session {sid} holds no lease; mount it first"
                    ))
                })?;
                let lowers = self.session_lowers(&tx, &s, lease)?;
                let layer = {
                    let next = self.insert_layer(&tx, "committed", Some(&s.stack), Some(sid))?;
                    // The upper stays where it is: re-point the row at it.
                    let rel = format!("s/{sid}/upper");
                    tx.execute(
                        "UPDATE layers SET path = ?2 WHERE id = ?1",
                        params![next, rel],
                    )?;
                    next
                };
                let mut frozen = vec![layer];
                frozen.extend(lowers);
                tx.execute(
                    "INSERT INTO snapshots(key, kind, parent, labels, created_ns, updated_ns, layer_id, lowers, size, inodes) VALUES (?1, 'committed', ?2, ?3, ?4, ?4, ?5, ?6, ?7, ?8)",
                    params![name, row.parent, labels_json, now, layer, serde_json::to_string(&frozen).unwrap_or_default(), size, inodes],
                )?;
                let outcome = Outcome {
                    kind: OutcomeKind::Discarded,
                    layer: None,
                    conflicts: vec![],
                    paths: vec![],
                    message: Some(format!(
                        "committed by containerd as snapshot {name}; not published"
                    )),
                    at_ns: now,
                    timings: None,
                };
                tx.execute(
                    "UPDATE sessions SET state = 'discarded', outcome = ?2, released = 1, updated_ns = ?3 WHERE id = ?1",
                    params![sid, serde_json::to_string(&outcome).unwrap_or_default(), now],
                )?;
            }
            None => {
                let id = row
                    .layer_id
                    .ok_or_else(|| SnapshotError::Internal(format!("{key} has no layer")))?;
                let image = is_extraction(key, &row.labels)
                    || split_key(name).is_some_and(|(_, n)| is_digest(n));
                tx.execute(
                    "UPDATE layers SET kind = ?2 WHERE id = ?1",
                    params![id, if image { "base" } else { "committed" }],
                )?;
                tx.execute(
                    "INSERT INTO snapshots(key, kind, parent, labels, created_ns, updated_ns, layer_id, image_layer, size, inodes) VALUES (?1, 'committed', ?2, ?3, ?4, ?4, ?5, ?6, ?7, ?8)",
                    params![name, row.parent, labels_json, now, id, image as i64, size, inodes],
                )?;
                work_to_remove = Some(self.work_path(id));
            }
        }
        tx.execute("DELETE FROM snapshots WHERE key = ?1", [key])?;
        tx.commit()?;
        drop(conn);
        if let Some(w) = work_to_remove {
            if let Err(e) = fs::remove_tree(&w) {
                warn!(path = %w.display(), error = %e, "failed to remove workdir; the sweep will retry");
            }
        }
        info!(snapshot.key = key, name, "committed");
        Ok(())
    }

    /// containerd `Remove` (arrives from containerd's GC). Refuses with
    /// `FailedPrecondition` while children exist. Releases a session's lease; a
    /// session whose last publish conflicted keeps its upper for inspection.
    pub fn remove(&self, key: &str) -> Result<(), SnapshotError> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let row = get_snap(&tx, key)?.ok_or_else(|| SnapshotError::NotFound(key.to_string()))?;
        let children: i64 = tx.query_row(
            "SELECT count(*) FROM snapshots WHERE parent = ?1",
            [key],
            |r| r.get(0),
        )?;
        if children > 0 {
            return Err(SnapshotError::FailedPrecondition(format!(
                "cannot remove snapshot {key}: {children} snapshot(s) use it as parent"
            )));
        }
        let mut dirs = Vec::new();
        if let Some(sid) = row.session_id {
            let s = get_sess(&tx, sid)?;
            Self::release_lease(&tx, s.lease_id)?;
            tx.execute(
                "UPDATE sessions SET released = 1, lease_id = NULL, updated_ns = ?2 WHERE id = ?1",
                params![sid, now_ns()],
            )?;
            if s.state != SessionState::Conflict {
                dirs.push(self.session_path(sid));
            }
        }
        if let (Some(id), None) = (row.layer_id, row.session_id) {
            // Committed session layers live inside the session dir (s/<id>/upper).
            let rel: Option<String> = tx
                .query_row("SELECT path FROM layers WHERE id = ?1", [id], |r| r.get(0))
                .optional()?;
            let in_use: i64 = tx.query_row(
                "SELECT count(*) FROM snapshots WHERE key != ?1 AND layer_id = ?2",
                params![key, id],
                |r| r.get(0),
            )?;
            if in_use == 0 {
                tx.execute("DELETE FROM layers WHERE id = ?1", [id])?;
                if let Some(rel) = rel {
                    let p = self.root.join(&rel);
                    if rel.starts_with("s/") {
                        if let Some(sdir) = p.parent() {
                            dirs.push(sdir.to_path_buf());
                        }
                    } else {
                        dirs.push(p);
                    }
                }
                dirs.push(self.work_path(id));
            }
        }
        tx.execute("DELETE FROM snapshots WHERE key = ?1", [key])?;
        tx.commit()?;
        drop(conn);
        for d in dirs {
            if let Err(e) = fs::remove_tree(&d) {
                warn!(path = %d.display(), error = %e, "failed to remove directory; the sweep will retry");
            }
        }
        info!(snapshot.key = key, "removed");
        Ok(())
    }

    /// containerd `Stat`. Error: `NotFound`.
    pub fn stat(&self, key: &str) -> Result<SnapshotInfo, SnapshotError> {
        self.read(|conn| {
            Ok(get_snap(conn, key)?
                .ok_or_else(|| SnapshotError::NotFound(key.to_string()))?
                .info())
        })
    }

    /// containerd `Update`: only labels change. `fieldpaths` empty replaces all
    /// labels; `labels` replaces all; `labels.K` sets K, or deletes it when absent
    /// from `labels` (containerd sends filtered-out labels as paths without values).
    pub fn update_labels(
        &self,
        key: &str,
        labels: BTreeMap<String, String>,
        fieldpaths: &[String],
    ) -> Result<SnapshotInfo, SnapshotError> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let row = get_snap(&tx, key)?.ok_or_else(|| SnapshotError::NotFound(key.to_string()))?;
        let mut new = row.labels.clone();
        if fieldpaths.is_empty() || fieldpaths.iter().any(|p| p == "labels") {
            new = labels;
        } else {
            for p in fieldpaths {
                let Some(k) = p.strip_prefix("labels.") else {
                    return Err(SnapshotError::InvalidArgument(format!(
                        "cannot update field {p:?} of snapshot {key}: only labels can change"
                    )));
                };
                match labels.get(k) {
                    Some(v) => new.insert(k.to_string(), v.clone()),
                    None => new.remove(k),
                };
            }
        }
        tx.execute(
            "UPDATE snapshots SET labels = ?2, updated_ns = ?3 WHERE key = ?1",
            params![
                key,
                serde_json::to_string(&new).unwrap_or_default(),
                now_ns()
            ],
        )?;
        let info = get_snap(&tx, key)?
            .ok_or_else(|| SnapshotError::NotFound(key.into()))?
            .info();
        tx.commit()?;
        Ok(info)
    }

    /// containerd `List`/`Walk`: every snapshot containerd created, nothing else.
    pub fn list(&self) -> Result<Vec<SnapshotInfo>, SnapshotError> {
        self.read(|conn| {
            let mut stmt =
                conn.prepare(&format!("SELECT {SNAP_COLS} FROM snapshots ORDER BY key"))?;
            let rows = stmt.query_map([], snap_from_row)?;
            let mut out = Vec::new();
            for r in rows {
                out.push(r?.info());
            }
            Ok(out)
        })
    }

    /// containerd `Usage`: `(bytes, inodes)` of the snapshot's own directory; real
    /// allocated bytes. Active snapshots are measured now; committed ones at commit.
    pub fn usage(&self, key: &str) -> Result<(i64, i64), SnapshotError> {
        let row = self.read(|conn| {
            get_snap(conn, key)?.ok_or_else(|| SnapshotError::NotFound(key.to_string()))
        })?;
        match (row.kind, row.size, row.inodes) {
            (SnapshotKind::Committed, Some(s), Some(i)) => Ok((s, i)),
            (SnapshotKind::View, _, _) => Ok((0, 0)),
            _ => {
                let dir = match (row.session_id, row.layer_id) {
                    (Some(sid), _) => self.upper_path(sid),
                    (None, Some(id)) => self.layer_path(id),
                    _ => return Ok((0, 0)),
                };
                fs::disk_usage(&dir).map_err(|e| SnapshotError::io(&dir, e))
            }
        }
    }

    /// Remove directories that no row references (and report rows whose directory
    /// vanished). Runs at open and on containerd's `Cleanup`.
    pub fn sweep(&self) -> Result<SweepReport, StoreError> {
        // Hold the connection and a write transaction for the whole sweep, so no
        // concurrent Prepare (this process or another) can add a row whose
        // directory the scan would then take for an orphan.
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let mut report = SweepReport::default();
        // Roll forward publishes that committed but crashed before their upper
        // was renamed into the layer directory (see `commit_publish_outcome`).
        {
            let mut stmt =
                tx.prepare("SELECT id, path, session_id FROM layers WHERE kind = 'published'")?;
            let rows = stmt.query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, Option<i64>>(2)?,
                ))
            })?;
            for r in rows {
                let (id, path, session) = r?;
                let dst = self.root.join(&path);
                let Some(sid) = session else { continue };
                let upper = self.upper_path(sid);
                if dst.exists() || !upper.exists() {
                    continue;
                }
                std::fs::rename(&upper, &dst).map_err(|e| StoreError::Io(upper.clone(), e))?;
                fs::fsync_dir(&self.root.join("l")).map_err(|e| StoreError::Io(dst.clone(), e))?;
                warn!(
                    layer.id = id,
                    session.id = sid,
                    "rolled forward a publish interrupted by a crash"
                );
                report.rolled_forward.push(dst);
                if let Err(e) = self.make_session_dirs(sid) {
                    warn!(session.id = sid, error = %e, "cannot recreate the session's upper");
                }
            }
        }
        let mut layer_paths: HashSet<String> = HashSet::new();
        let mut active_works: HashSet<String> = HashSet::new();
        {
            let mut stmt = tx.prepare("SELECT id, path, kind FROM layers")?;
            let rows = stmt.query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                ))
            })?;
            for r in rows {
                let (id, path, kind) = r?;
                if kind == "active" {
                    active_works.insert(id.to_string());
                }
                layer_paths.insert(path);
            }
        }
        let mut sessions: HashSet<String> = HashSet::new();
        {
            let mut stmt = tx.prepare("SELECT id, released, state FROM sessions")?;
            let rows = stmt.query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, String>(2)?,
                ))
            })?;
            for r in rows {
                let (id, released, state) = r?;
                if released == 0 || state == "conflict" {
                    sessions.insert(id.to_string());
                }
            }
            // A committed session's upper is a layer: keep its session dir.
            for p in &layer_paths {
                if let Some(rest) = p.strip_prefix("s/") {
                    if let Some((id, _)) = rest.split_once('/') {
                        sessions.insert(id.to_string());
                    }
                }
            }
        }
        let scan = |sub: &str,
                    keep: &dyn Fn(&str) -> bool,
                    report: &mut SweepReport|
         -> Result<(), StoreError> {
            let dir = self.root.join(sub);
            let rd = match std::fs::read_dir(&dir) {
                Ok(rd) => rd,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(StoreError::Io(dir, e)),
            };
            for e in rd {
                let e = e.map_err(|e| StoreError::Io(dir.clone(), e))?;
                let name = e.file_name().to_string_lossy().into_owned();
                if !keep(&name) {
                    let p = e.path();
                    fs::remove_tree(&p).map_err(|err| StoreError::Io(p.clone(), err))?;
                    report.removed.push(p);
                }
            }
            Ok(())
        };
        scan(
            "l",
            &|n| layer_paths.contains(&format!("l/{n}")),
            &mut report,
        )?;
        scan("w", &|n| active_works.contains(n), &mut report)?;
        scan("s", &|n| sessions.contains(n), &mut report)?;
        scan("staging", &|_| false, &mut report)?;
        for p in &layer_paths {
            let full = self.root.join(p);
            if !full.exists() {
                report.missing.push(full);
            }
        }
        tx.commit()?;
        Ok(report)
    }

    // ----- sessions and publishing -----

    fn session_info(&self, tx: &Connection, s: SessRow) -> Result<SessionInfo, StoreError> {
        let lease_manifest = match s.lease_id {
            Some(l) => Some(lease_manifest(tx, l)?),
            None => None,
        };
        Ok(SessionInfo {
            upper: self.upper_path(s.id),
            work: self.session_work_path(s.id),
            id: s.id,
            key: s.key,
            namespace: s.namespace,
            container: s.container,
            stack: s.stack,
            branch: s.branch,
            state: s.state,
            outcome: s.outcome,
            lease_manifest,
            runs: s.runs,
            released: s.released,
            policy: s.policy,
        })
    }

    /// Record the exit policy of `session` (the container label
    /// `layerstack.publish`: `on-exit`, `on-success`, `never`; validated by the
    /// caller). Error: `SessionNotFound`.
    pub fn set_session_policy(
        &self,
        session: SessionId,
        policy: &str,
    ) -> Result<SessionInfo, StoreError> {
        let conn = self.conn();
        let n = conn.execute(
            "UPDATE sessions SET policy = ?2, updated_ns = ?3 WHERE id = ?1",
            params![session, policy, now_ns()],
        )?;
        if n == 0 {
            return Err(StoreError::SessionNotFound(session));
        }
        let s = get_sess(&conn, session)?;
        self.session_info(&conn, s)
    }

    /// All sessions, oldest first.
    pub fn sessions(&self) -> Result<Vec<SessionInfo>, StoreError> {
        self.read(|conn| {
            let mut stmt =
                conn.prepare(&format!("SELECT {SESS_COLS} FROM sessions ORDER BY id"))?;
            let rows: Vec<SessRow> = stmt
                .query_map([], sess_from_row)?
                .collect::<Result<_, _>>()?;
            rows.into_iter()
                .map(|s| self.session_info(conn, s))
                .collect()
        })
    }

    /// One session by id. Error: `SessionNotFound`.
    pub fn session(&self, id: SessionId) -> Result<SessionInfo, StoreError> {
        self.read(|conn| {
            let s = get_sess(conn, id)?;
            self.session_info(conn, s)
        })
    }

    /// The newest session of a container (`namespace`, `container` id = the
    /// rootfs snapshot key's name part), preferring one containerd has not removed.
    pub fn find_session(
        &self,
        namespace: &str,
        container: &str,
    ) -> Result<Option<SessionInfo>, StoreError> {
        self.read(|conn| {
            let s = conn
                .query_row(
                    &format!(
                        "SELECT {SESS_COLS} FROM sessions WHERE namespace = ?1 AND container = ?2 ORDER BY released ASC, id DESC LIMIT 1"
                    ),
                    params![namespace, container],
                    sess_from_row,
                )
                .optional()?;
            match s {
                Some(s) => Ok(Some(self.session_info(conn, s)?)),
                None => Ok(None),
            }
        })
    }

    /// What a publish of `session` reads: its upper and the lease's lower dirs.
    /// Error: `SessionNotFound`, `NoLease` (nothing mounted since the last publish).
    pub fn publish_context(&self, session: SessionId) -> Result<PublishContext, StoreError> {
        let conn = self.conn();
        let s = get_sess(&conn, session)?;
        let lease = s.lease_id.ok_or(StoreError::NoLease(session))?;
        let lowers = self
            .session_lowers(&conn, &s, lease)
            .map_err(StoreError::from_snapshot)?;
        let lease_lowers = self.layer_dirs(&conn, &lowers)?;
        let lease_manifest = lease_manifest(&conn, lease)?;
        let info = self.session_info(&conn, s)?;
        Ok(PublishContext {
            session: info,
            lease_lowers,
            lease_manifest,
        })
    }

    /// The branch head of `session` and the path index of every layer published on
    /// it since the session's lease, newest layer first.
    pub fn head_delta(
        &self,
        session: SessionId,
        lease_manifest: ManifestId,
    ) -> Result<HeadDelta, StoreError> {
        let conn = self.conn();
        let s = get_sess(&conn, session)?;
        let head =
            branch_head(&conn, &s.stack, &s.branch)?.ok_or_else(|| StoreError::BranchNotFound {
                stack: s.stack.clone(),
                branch: s.branch.clone(),
            })?;
        let head_layers = manifest_layers(&conn, head)?;
        let leased: HashSet<LayerId> = manifest_layers(&conn, lease_manifest)?
            .into_iter()
            .collect();
        let new_layers: Vec<LayerId> = head_layers
            .into_iter()
            .filter(|l| !leased.contains(l))
            .collect();
        let mut layers = Vec::with_capacity(new_layers.len());
        let mut stmt = conn.prepare_cached(
            "SELECT path, change FROM layer_changes WHERE layer_id = ?1 ORDER BY path",
        )?;
        for l in &new_layers {
            let rows = stmt.query_map([l], |r| {
                Ok((r.get::<_, Vec<u8>>(0)?, r.get::<_, String>(1)?))
            })?;
            layers.push((*l, rows.collect::<Result<Vec<_>, _>>()?));
        }
        Ok(HeadDelta {
            head,
            layers,
            new_layers,
        })
    }

    /// The lower directories, newest first, of the branch head manifest `head` as
    /// `session` would mount them: the session's per-container committed layers,
    /// the head's published layers, then the image layers (the same composition as
    /// its lease). The gate reads the head's version of a path through them.
    pub fn head_lowers(
        &self,
        session: SessionId,
        head: ManifestId,
    ) -> Result<Vec<PathBuf>, StoreError> {
        let conn = self.conn();
        let s = get_sess(&conn, session)?;
        let mut lowers = s.above.clone();
        lowers.extend(manifest_layers(&conn, head)?);
        lowers.extend(committed_chain(&conn, &s.base_key).map_err(StoreError::from_snapshot)?);
        self.layer_dirs(&conn, &lowers)
    }

    /// Commit a clean publish: the session's (sealed, quiescent) upper becomes
    /// layer `l/<n>` by rename — no data copy — and is prepended to the branch in
    /// one transaction together with its path index, the outcome and the lease
    /// release. Afterwards the session has a fresh empty upper and no lease (the
    /// next mount leases the new head).
    ///
    /// Errors: `HeadMoved` when the branch head is no longer `expected_head`
    /// (the caller must gate again); on any failure the upper is left in place.
    pub fn commit_publish(
        &self,
        session: SessionId,
        expected_head: ManifestId,
        changes: &[(Vec<u8>, String)],
        message: Option<String>,
    ) -> Result<Published, PublishError> {
        self.commit_publish_outcome(
            session,
            expected_head,
            changes,
            OutcomeKind::Committed,
            message,
            Vec::new(),
            None,
        )
    }

    /// [`Store::commit_publish`] recording outcome `kind` (`Committed` or `Merged`)
    /// with the gate's per-path verdicts `paths`.
    pub fn commit_publish_outcome(
        &self,
        session: SessionId,
        expected_head: ManifestId,
        changes: &[(Vec<u8>, String)],
        kind: OutcomeKind,
        message: Option<String>,
        paths: Vec<PathRecord>,
        timings: Option<PublishTimings>,
    ) -> Result<Published, PublishError> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let s = get_sess(&tx, session)?;
        let head = branch_head(&tx, &s.stack, &s.branch)?.ok_or_else(|| {
            PublishError::Store(StoreError::BranchNotFound {
                stack: s.stack.clone(),
                branch: s.branch.clone(),
            })
        })?;
        if head != expected_head {
            return Err(PublishError::HeadMoved {
                expected: expected_head,
                found: head,
            });
        }
        let layer = self.insert_layer(&tx, "published", Some(&s.stack), Some(session))?;
        let upper = self.upper_path(session);
        let dst = self.layer_path(layer);
        {
            let mut ins = tx.prepare_cached(
                "INSERT INTO layer_changes(layer_id, path, change) VALUES (?1, ?2, ?3)",
            )?;
            for (p, c) in changes {
                ins.execute(params![layer, p, c])?;
            }
        }
        let mut layers = vec![layer];
        layers.extend(manifest_layers(&tx, head)?);
        let now = now_ns();
        tx.execute(
            "INSERT INTO manifests(stack, layers, parent, layer_id, created_ns) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![s.stack, serde_json::to_string(&layers).unwrap_or_default(), head, layer, now],
        )?;
        let manifest = tx.last_insert_rowid();
        tx.execute(
            "UPDATE branches SET manifest_id = ?3, updated_ns = ?4 WHERE stack = ?1 AND name = ?2",
            params![s.stack, s.branch, manifest, now],
        )?;
        Self::release_lease(&tx, s.lease_id)?;
        let outcome = Outcome {
            kind,
            layer: Some(layer),
            conflicts: vec![],
            paths,
            message,
            at_ns: now,
            timings,
        };
        let oj = serde_json::to_string(&outcome).unwrap_or_default();
        tx.execute(
            "UPDATE sessions SET state = 'published', outcome = ?2, lease_id = NULL, updated_ns = ?3 WHERE id = ?1",
            params![session, oj, now],
        )?;
        tx.execute(
            "INSERT INTO publishes(session_id, outcome, layer_id, manifest_before, manifest_after, at_ns) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![session, oj, layer, head, manifest, now],
        )?;
        tx.commit()?;
        // The row is committed first and the (sealed, fsynced) upper is renamed into
        // place while this connection is still held, so no other store call sees the
        // row without its directory. A crash in between is rolled forward by the
        // sweep (the upper is still at s/<id>/upper): a committed publish never
        // loses the session's data, and no directory without a row is ever needed.
        let moved = std::fs::rename(&upper, &dst)
            .and_then(|()| fs::fsync_dir(&self.root.join("l")))
            .and_then(|()| fs::fsync_dir(&self.session_path(session)));
        drop(conn);
        if let Err(e) = moved {
            tracing::error!(session.id = session, layer.id = layer, error = %e, "published layer committed but not moved into place; restart the daemon to roll it forward");
            return Err(PublishError::Io(upper, e));
        }
        self.reset_session_dirs(session, false);
        info!(session.id = session, layer.id = layer, stack = %s.stack, branch = %s.branch, manifest, outcome = "committed", "published");
        Ok(Published { layer, manifest })
    }

    /// Record a publish outcome that adds no layer (`NoChange`, `Conflict`,
    /// `Discarded`, `Failed`). `NoChange` and `Discarded` drop the upper and the
    /// lease (the next mount starts fresh on the head); `Conflict` and `Failed`
    /// keep both for inspection.
    pub fn record_outcome(&self, session: SessionId, outcome: Outcome) -> Result<(), StoreError> {
        let (state, reset) = match outcome.kind {
            OutcomeKind::NoChange | OutcomeKind::Committed | OutcomeKind::Merged => {
                (SessionState::Published, true)
            }
            OutcomeKind::Discarded => (SessionState::Discarded, true),
            OutcomeKind::Conflict => (SessionState::Conflict, false),
            OutcomeKind::Failed => (SessionState::Active, false),
        };
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let s = get_sess(&tx, session)?;
        let oj = serde_json::to_string(&outcome).unwrap_or_default();
        if reset {
            Self::release_lease(&tx, s.lease_id)?;
            tx.execute(
                "UPDATE sessions SET state = ?2, outcome = ?3, lease_id = NULL, updated_ns = ?4 WHERE id = ?1",
                params![session, state.as_str(), oj, outcome.at_ns],
            )?;
        } else {
            tx.execute(
                "UPDATE sessions SET state = ?2, outcome = ?3, updated_ns = ?4 WHERE id = ?1",
                params![session, state.as_str(), oj, outcome.at_ns],
            )?;
        }
        tx.execute(
            "INSERT INTO publishes(session_id, outcome, at_ns) VALUES (?1, ?2, ?3)",
            params![session, oj, outcome.at_ns],
        )?;
        tx.commit()?;
        drop(conn);
        if reset && s.released {
            // containerd removed the snapshot already (a kept conflict upper being
            // dropped): nothing will mount this session again.
            let dir = self.session_path(session);
            if let Err(e) = fs::remove_tree(&dir) {
                warn!(path = %dir.display(), error = %e, "failed to remove session directory; the sweep will retry");
            }
        } else if reset {
            self.reset_session_dirs(session, true);
        }
        info!(
            session.id = session,
            outcome = outcome.kind.as_str(),
            "outcome recorded"
        );
        Ok(())
    }

    /// Give a session an empty upper and workdir (after its writes were published
    /// or dropped). Old directories go through staging so a crash never leaves a
    /// half-deleted upper in place.
    fn reset_session_dirs(&self, session: SessionId, drop_upper: bool) {
        let s = self.session_path(session);
        let mut doomed = vec![s.join("work")];
        if drop_upper {
            doomed.push(s.join("upper"));
        }
        for (i, d) in doomed.into_iter().enumerate() {
            if !d.exists() {
                continue;
            }
            let tmp = self
                .staging_path()
                .join(format!("reset-{session}-{i}-{}", now_ns()));
            let target = match std::fs::rename(&d, &tmp) {
                Ok(()) => tmp,
                Err(_) => d,
            };
            if let Err(e) = fs::remove_tree(&target) {
                warn!(path = %target.display(), error = %e, "failed to remove old session directory; the sweep will retry");
            }
        }
        if let Err(e) = self.make_session_dirs(session) {
            warn!(session.id = session, error = %e, "failed to recreate session directories; the next mount retries");
        }
    }

    /// Stacks known to the store, with their branches: `stack -> [(branch, head)]`.
    pub fn stacks(&self) -> Result<BTreeMap<String, Vec<(String, ManifestId)>>, StoreError> {
        self.read(|conn| {
            let mut stmt =
                conn.prepare("SELECT stack, name, manifest_id FROM branches ORDER BY stack, name")?;
            let rows = stmt.query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })?;
            let mut out: BTreeMap<String, Vec<(String, ManifestId)>> = BTreeMap::new();
            for r in rows {
                let (s, b, m) = r?;
                out.entry(s).or_default().push((b, m));
            }
            Ok(out)
        })
    }

    /// The published layers of `branch` on `stack`, newest first, with the session
    /// that made each. Error: `BranchNotFound`.
    pub fn log(&self, stack: &str, branch: &str) -> Result<Vec<LogEntry>, StoreError> {
        self.read(|conn| {
            let head =
                branch_head(conn, stack, branch)?.ok_or_else(|| StoreError::BranchNotFound {
                    stack: stack.to_string(),
                    branch: branch.to_string(),
                })?;
            let mut out = Vec::new();
            let mut next = Some(head);
            let sessions: HashMap<SessionId, (String, String)> = {
                let mut stmt =
                    conn.prepare("SELECT id, namespace, container FROM sessions WHERE stack = ?1")?;
                let rows = stmt.query_map([stack], |r| {
                    Ok((r.get::<_, i64>(0)?, (r.get(1)?, r.get(2)?)))
                })?;
                rows.collect::<Result<_, _>>()?
            };
            while let Some(m) = next {
                let (parent, layer, created): (Option<i64>, Option<i64>, i64) = conn.query_row(
                    "SELECT parent, layer_id, created_ns FROM manifests WHERE id = ?1",
                    [m],
                    |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
                )?;
                if let Some(layer) = layer {
                    let session: Option<i64> = conn
                        .query_row(
                            "SELECT session_id FROM layers WHERE id = ?1",
                            [layer],
                            |r| r.get(0),
                        )
                        .optional()?
                        .flatten();
                    let paths: i64 = conn.query_row(
                        "SELECT count(*) FROM layer_changes WHERE layer_id = ?1",
                        [layer],
                        |r| r.get(0),
                    )?;
                    let who = session.and_then(|s| sessions.get(&s).cloned());
                    out.push(LogEntry {
                        layer,
                        manifest: m,
                        session,
                        namespace: who.as_ref().map(|w| w.0.clone()),
                        container: who.map(|w| w.1),
                        paths,
                        created_ns: created,
                    });
                }
                next = parent;
            }
            Ok(out)
        })
    }

    /// The lower directories, newest first, that a new session on `branch` of
    /// `stack` would read above its image (the branch head's published layers).
    pub fn branch_layers(&self, stack: &str, branch: &str) -> Result<Vec<PathBuf>, StoreError> {
        let conn = self.conn();
        let head =
            branch_head(&conn, stack, branch)?.ok_or_else(|| StoreError::BranchNotFound {
                stack: stack.to_string(),
                branch: branch.to_string(),
            })?;
        let layers = manifest_layers(&conn, head)?;
        self.layer_dirs(&conn, &layers)
    }

    /// Re-points a session whose current run has not been mounted yet to `branch`
    /// (the container label `layerstack.branch`, read by the runtime shim before the
    /// rootfs is mounted; ARCHITECTURE.md §6 step 1): the lease moves to that branch's
    /// head, and a new branch forks the default branch. Returns the session, its
    /// rootfs mount spec now, and whether anything changed: a session already on
    /// `branch`, or whose snapshot carries [`BRANCH_LABEL`] (the snapshot label wins),
    /// is left as it is. The caller checks that the upper is not mounted.
    ///
    /// Errors: `SessionNotFound`; `Snapshot(InvalidArgument)` (branch name);
    /// `Snapshot(FailedPrecondition)` when the run already has an outcome, holds no
    /// lease, was released by containerd, or its upper is not empty.
    pub fn rebranch_session(
        &self,
        session: SessionId,
        branch: &str,
    ) -> Result<(SessionInfo, MountSpec, bool), StoreError> {
        let precondition =
            |m: String| StoreError::from_snapshot(SnapshotError::FailedPrecondition(m));
        validate_branch(branch)
            .map_err(|m| StoreError::from_snapshot(SnapshotError::InvalidArgument(m)))?;
        let upper = self.upper_path(session);
        let upper_empty = match std::fs::read_dir(&upper) {
            Ok(mut d) => d.next().is_none(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
            Err(e) => return Err(StoreError::Io(upper, e)),
        };
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let s = get_sess(&tx, session)?;
        let snap_labels = get_snap(&tx, &s.key)?.map(|r| r.labels).unwrap_or_default();
        let pinned = snap_labels.contains_key(BRANCH_LABEL);
        let mut changed = false;
        if s.branch != branch && !pinned {
            let lease = match (s.outcome.is_some(), s.released, s.lease_id) {
                (false, false, Some(l)) => l,
                _ => {
                    return Err(precondition(format!(
                        "session {session} has no run in progress (outcome recorded, snapshot removed, or no lease): its branch cannot change"
                    )))
                }
            };
            if !upper_empty {
                return Err(precondition(format!(
                    "session {session} has written to its upper already: its branch cannot change"
                )));
            }
            let head = self
                .ensure_stack_branch(&tx, &s.stack, branch)
                .map_err(StoreError::from_snapshot)?;
            Self::release_lease(&tx, Some(lease))?;
            let new_lease = Self::new_lease(&tx, head, session)?;
            tx.execute(
                "UPDATE sessions SET branch = ?2, lease_id = ?3, updated_ns = ?4 WHERE id = ?1",
                params![session, branch, new_lease, now_ns()],
            )?;
            changed = true;
        }
        let s = get_sess(&tx, session)?;
        let lease = s.lease_id.ok_or(StoreError::NoLease(session))?;
        let lowers = self
            .session_lowers(&tx, &s, lease)
            .map_err(StoreError::from_snapshot)?;
        let spec = self
            .session_spec(&tx, session, &lowers)
            .map_err(StoreError::from_snapshot)?;
        let info = self.session_info(&tx, s)?;
        tx.commit()?;
        if changed {
            info!(session.id = session, branch, manifest = ?info.lease_manifest, "session re-pointed to branch");
        }
        Ok((info, spec, changed))
    }
}

#[cfg(test)]
mod tests;
