//! The SandboxGraph's model (ARCHITECTURE.md §12; seed `002`, phase 2): groups
//! of immutable **nodes** (a manifest pinned by the node's lease, a small JSON
//! state, provenance) and **attempts** (one activation of a node in a session).
//!
//! Nothing of the graph lives inside layers. Every mutating operation can carry a
//! client idempotency key: its answer is stored (`graph_ops`) in the same
//! transaction as its effect, so the same key twice gives the same answer and one
//! effect, also across a daemon restart; a crash before that transaction leaves
//! no effect and the retry performs it.

use std::collections::{BTreeMap, BTreeSet};

use rusqlite::{params, Connection, OptionalExtension, Transaction};
use tracing::info;

use crate::db::write_on;
use crate::db::Cached;
use crate::error::StoreError;
use crate::idempotency::{check_args, record_args, validate_key};
use crate::leases::{lease_manifest, new_lease, release_lease};
use crate::sessions::{get_sess, insert_session, session_args};
use crate::stacks::{branch_head, prepend_manifest};
use crate::{
    fs, now_ns, Durability, HolderKind, KeyArgs, LeaseTarget, ManifestId, MountSpec, Owner,
    PublishTimings, SessionId, SessionInfo, SessionOptions, Staged, Store,
};

/// A group: a named graph on one stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupInfo {
    pub name: String,
    pub stack: String,
    /// The branch the root node was taken from (attempts' sessions name it).
    pub branch: String,
    pub root: String,
    pub created_ns: i64,
}

/// How a node came to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeKind {
    /// A branch head when the group was created.
    Root,
    /// An attempt's upper, checkpointed.
    Checkpoint,
    /// A merge of two nodes over their lowest common ancestor.
    Merge,
}

impl NodeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Root => "root",
            Self::Checkpoint => "checkpoint",
            Self::Merge => "merge",
        }
    }

    /// The kind named `s` ([`NodeKind::as_str`]).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "root" => Self::Root,
            "checkpoint" => Self::Checkpoint,
            "merge" => Self::Merge,
            _ => return None,
        })
    }
}

/// An immutable node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    pub id: String,
    pub group: String,
    pub kind: NodeKind,
    /// The immutable root: the layers a session activating the node reads.
    pub manifest: ManifestId,
    /// The logical state: a JSON document given at checkpoint, immutable.
    pub state: String,
    /// Parent nodes this store holds (none for a root; two for a merge), in
    /// declared order: the graph's edges, what walks, prune and GC follow.
    pub parents: Vec<String>,
    /// Every parent the node declares, in order: `parents` and
    /// `missing_parents` at their positions. What a push writes (the same in
    /// every store that holds the node).
    pub declared_parents: Vec<String>,
    /// Declared parents this store does not hold (a node pulled before its
    /// parent, format 15), in declared order; each becomes an edge (moves to
    /// `parents`) when a node of its id arrives here.
    pub missing_parents: Vec<String>,
    /// The attempt that checkpointed it.
    pub attempt: Option<i64>,
    /// Provenance: the command (Mode B) or container labels, the exit status.
    pub command: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub exit_status: Option<i32>,
    /// Real allocated bytes of its own layer (its private delta).
    pub private_bytes: Option<u64>,
    /// The stack's base digest (the base image's top chainID).
    pub base_digest: String,
    /// Pruned: its lease is released; GC may collect what nothing else reaches.
    pub pruned: bool,
    pub created_ns: i64,
}

/// Status of an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptStatus {
    Running,
    Checkpointed,
    /// The task failed: its run ended without a checkpoint by the owner's
    /// decision or its exit policy.
    Failed,
    Abandoned,
    /// An infrastructure failure ended its session (outcome `interrupted`:
    /// the daemon restarted, the init died), not the task: retry the attempt
    /// (format 10).
    Interrupted,
}

impl AttemptStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Checkpointed => "checkpointed",
            Self::Failed => "failed",
            Self::Abandoned => "abandoned",
            Self::Interrupted => "interrupted",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "running" => Self::Running,
            "checkpointed" => Self::Checkpointed,
            "failed" => Self::Failed,
            "abandoned" => Self::Abandoned,
            "interrupted" => Self::Interrupted,
            _ => return None,
        })
    }
}

/// One activation of a node in a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptInfo {
    pub id: i64,
    pub node: String,
    pub session: Option<SessionId>,
    pub status: AttemptStatus,
    pub idempotency_key: Option<String>,
    /// The node it checkpointed into.
    pub result_node: Option<String>,
    pub message: Option<String>,
    pub created_ns: i64,
    pub ended_ns: Option<i64>,
}

/// A group with all its nodes, edges (child, parent) and attempts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphDump {
    pub group: GroupInfo,
    pub nodes: Vec<NodeInfo>,
    pub attempts: Vec<AttemptInfo>,
}

/// Provenance recorded with a checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Provenance {
    pub command: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub exit_status: Option<i32>,
    pub private_bytes: Option<u64>,
}

/// A `graph_nodes` row as stored ([`NODE_COLS`]), read by column name.
struct RawNode {
    id: String,
    grp: String,
    kind: String,
    manifest_id: i64,
    state: String,
    attempt_id: Option<i64>,
    command: Option<String>,
    labels: String,
    exit_status: Option<i32>,
    private_bytes: Option<i64>,
    base_digest: String,
    pruned: i64,
    created_ns: i64,
}

pub(crate) const NODE_COLS: &str = "id, grp, kind, manifest_id, state, attempt_id, command, labels, exit_status, private_bytes, base_digest, pruned, created_ns";

fn raw_node(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawNode> {
    Ok(RawNode {
        id: r.get("id")?,
        grp: r.get("grp")?,
        kind: r.get("kind")?,
        manifest_id: r.get("manifest_id")?,
        state: r.get("state")?,
        attempt_id: r.get("attempt_id")?,
        command: r.get("command")?,
        labels: r.get("labels")?,
        exit_status: r.get("exit_status")?,
        private_bytes: r.get("private_bytes")?,
        base_digest: r.get("base_digest")?,
        pruned: r.get("pruned")?,
        created_ns: r.get("created_ns")?,
    })
}

fn node_from(conn: &Connection, raw: RawNode) -> Result<NodeInfo, StoreError> {
    let RawNode {
        id,
        grp: group,
        kind,
        manifest_id: manifest,
        state,
        attempt_id: attempt,
        command,
        labels,
        exit_status,
        private_bytes: bytes,
        base_digest: base,
        pruned,
        created_ns: created,
    } = raw;
    let kind = NodeKind::parse(&kind)
        .ok_or_else(|| StoreError::corrupt("graph_nodes", &id, format!("kind {kind:?}")))?;
    let labels = serde_json::from_str(&labels)
        .map_err(|e| StoreError::corrupt("graph_nodes", &id, format!("labels: {e}")))?;
    // (position, parent, held) of every declared parent, in order.
    let declared = {
        let mut stmt = conn.prepare_cached(
            "SELECT pos, parent, 1 FROM graph_edges WHERE child = ?1
             UNION ALL SELECT pos, parent, 0 FROM graph_missing_parents WHERE child = ?1
             ORDER BY 1",
        )?;
        let v = stmt
            .query_map([&id], |r| {
                Ok((r.get::<_, String>(1)?, r.get::<_, i64>(2)? != 0))
            })?
            .collect::<Result<Vec<(String, bool)>, _>>()?;
        v
    };
    let parents = declared
        .iter()
        .filter(|(_, held)| *held)
        .map(|(p, _)| p.clone())
        .collect();
    let missing_parents = declared
        .iter()
        .filter(|(_, held)| !*held)
        .map(|(p, _)| p.clone())
        .collect();
    let declared_parents = declared.into_iter().map(|(p, _)| p).collect();
    Ok(NodeInfo {
        id,
        group,
        kind,
        manifest,
        state,
        parents,
        declared_parents,
        missing_parents,
        attempt,
        command,
        labels,
        exit_status,
        private_bytes: bytes.map(|b| u64::try_from(b).unwrap_or(0)),
        base_digest: base,
        pruned: pruned != 0,
        created_ns: created,
    })
}

/// The stack and manifest of node `id`.
pub(crate) fn node_stack_manifest(
    conn: &Connection,
    id: &str,
) -> Result<(String, ManifestId), StoreError> {
    let n = get_node(conn, id)?;
    let g = get_group(conn, &n.group)?;
    Ok((g.stack, n.manifest))
}

pub(crate) fn get_node(conn: &Connection, id: &str) -> Result<NodeInfo, StoreError> {
    let raw = conn
        .one(
            &format!("SELECT {NODE_COLS} FROM graph_nodes WHERE id = ?1"),
            [id],
            raw_node,
        )
        .optional()?
        .ok_or_else(|| {
            StoreError::NotFound(format!(
                "node {id:?} does not exist (see `layerstack graph show`)"
            ))
        })?;
    node_from(conn, raw)
}

/// A `graph_attempts` row as stored ([`ATTEMPT_COLS`]), read by column name.
struct RawAttempt {
    id: i64,
    node: String,
    session_id: Option<i64>,
    status: String,
    idempotency_key: Option<String>,
    result_node: Option<String>,
    message: Option<String>,
    created_ns: i64,
    ended_ns: Option<i64>,
}

const ATTEMPT_COLS: &str =
    "id, node, session_id, status, idempotency_key, result_node, message, created_ns, ended_ns";

fn raw_attempt(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawAttempt> {
    Ok(RawAttempt {
        id: r.get("id")?,
        node: r.get("node")?,
        session_id: r.get("session_id")?,
        status: r.get("status")?,
        idempotency_key: r.get("idempotency_key")?,
        result_node: r.get("result_node")?,
        message: r.get("message")?,
        created_ns: r.get("created_ns")?,
        ended_ns: r.get("ended_ns")?,
    })
}

fn attempt_from(raw: RawAttempt) -> Result<AttemptInfo, StoreError> {
    let RawAttempt {
        id,
        node,
        session_id: session,
        status,
        idempotency_key: key,
        result_node: result,
        message,
        created_ns: created,
        ended_ns: ended,
    } = raw;
    Ok(AttemptInfo {
        id,
        node,
        session,
        status: AttemptStatus::parse(&status).ok_or_else(|| {
            StoreError::corrupt("graph_attempts", id, format!("status {status:?}"))
        })?,
        idempotency_key: key,
        result_node: result,
        message,
        created_ns: created,
        ended_ns: ended,
    })
}

pub(crate) fn get_group(conn: &Connection, name: &str) -> Result<GroupInfo, StoreError> {
    conn.one(
        "SELECT name, stack, branch, root, created_ns FROM graph_groups WHERE name = ?1",
        [name],
        |r| {
            Ok(GroupInfo {
                name: r.get("name")?,
                stack: r.get("stack")?,
                branch: r.get("branch")?,
                root: r.get("root")?,
                created_ns: r.get("created_ns")?,
            })
        },
    )
    .optional()?
    .ok_or_else(|| {
        StoreError::NotFound(format!(
            "graph {name:?} does not exist (see `layerstack graph ls`)"
        ))
    })
}

/// A new node id: `n` + 16 lowercase hex digits, 64 bits from the kernel's
/// random source (`getrandom(2)`), unique across stores — a node pushed to a
/// registry and pulled into another daemon's store keeps its id, so two stores
/// must never mint the same one (the `n<count+1>` of format ≤ 11 did, and could
/// repeat within one store after a stack removal). Ids made before (`n1`,
/// `n2`, …) stay valid: an id is an opaque key, never parsed. An id already
/// taken is drawn again (at 2^32 nodes the chance of one clash is ~1/2^33).
fn next_node_id(tx: &Transaction<'_>) -> Result<String, StoreError> {
    loop {
        let id = random_node_id()?;
        // Nor an id a pulled node names as its parent: that node exists in
        // another store, and a pull of it links the edge.
        let taken: Option<i64> = tx
            .one(
                "SELECT 1 FROM graph_nodes WHERE id = ?1
                 UNION ALL SELECT 1 FROM graph_missing_parents WHERE parent = ?1 LIMIT 1",
                [&id],
                |r| r.get(0),
            )
            .optional()?;
        if taken.is_none() {
            return Ok(id);
        }
    }
}

/// `n` + 16 lowercase hex digits of fresh randomness (see [`next_node_id`]).
pub(crate) fn random_node_id() -> Result<String, StoreError> {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).map_err(|e| {
        StoreError::io(
            std::path::Path::new("getrandom(2)"),
            std::io::Error::other(format!("cannot draw a random node id: {e}")),
        )
    })?;
    Ok(format!("n{:016x}", u64::from_be_bytes(b)))
}

/// Records the answer `response` of operation `op` under client key `key`,
/// with the arguments it was called with ([`crate::idempotency`]), in the
/// transaction of its effect.
fn record_op(
    tx: &Transaction<'_>,
    key: Option<&str>,
    op: &str,
    response: &str,
    args: &KeyArgs,
) -> Result<(), StoreError> {
    if let Some(k) = key {
        validate_key(k)?;
        tx.exec(
            "INSERT INTO graph_ops(key, op, response, created_ns) VALUES (?1, ?2, ?3, ?4)",
            params![k, op, response, now_ns()],
        )?;
        record_args(tx, op, k, args)?;
    }
    Ok(())
}

/// The answer stored for `key` of operation `op`, if any — after checking
/// that `key` was used for `op` with the same arguments `args`.
///
/// Errors: `InvalidArgument` (the key was used for another operation),
/// `FailedPrecondition` (for this one with other arguments).
fn stored_op(
    conn: &Connection,
    key: Option<&str>,
    op: &str,
    args: &KeyArgs,
) -> Result<Option<String>, StoreError> {
    let Some(k) = key else { return Ok(None) };
    let got: Option<(String, String)> = conn
        .one(
            "SELECT op, response FROM graph_ops WHERE key = ?1",
            [k],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()?;
    match got {
        Some((o, r)) if o == op => {
            check_args(conn, op, k, args)?;
            Ok(Some(r))
        }
        Some((o, _)) => Err(StoreError::InvalidArgument(format!(
            "idempotency key {k:?} was used for a {o} operation, not {op}: use a fresh key"
        ))),
        None => Ok(None),
    }
}

/// The arguments of a keyed checkpoint: the session and the node's state.
pub fn checkpoint_args(session: SessionId, state: &str) -> KeyArgs {
    KeyArgs::new()
        .with("session", session)
        .digest("state", state)
}

/// The arguments of a keyed merge: the two nodes (in order) and the state.
pub fn merge_args(parents: &[&str], state: &str) -> KeyArgs {
    KeyArgs::new()
        .with("nodes", parents.join(","))
        .digest("state", state)
}

#[allow(clippy::too_many_arguments)]
fn insert_node(
    tx: &Transaction<'_>,
    group: &GroupInfo,
    kind: NodeKind,
    manifest: ManifestId,
    state: &str,
    parents: &[&str],
    attempt: Option<i64>,
    prov: &Provenance,
) -> Result<String, StoreError> {
    validate_state(state)?;
    let id = next_node_id(tx)?;
    let lease = new_lease(tx, manifest, HolderKind::Node, &id)?;
    let base: String = tx.one(
        "SELECT base_digest FROM stacks WHERE id = ?1",
        [&group.stack],
        |r| r.get(0),
    )?;
    tx.exec(
        &format!("INSERT INTO graph_nodes({NODE_COLS}, lease_id) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, 0, ?12, ?13)"),
        params![
            id,
            group.name,
            kind.as_str(),
            manifest,
            state,
            attempt,
            prov.command,
            serde_json::to_string(&prov.labels).unwrap_or_else(|_| "{}".into()),
            prov.exit_status,
            prov.private_bytes.map(|b| i64::try_from(b).unwrap_or(i64::MAX)),
            base,
            now_ns(),
            lease
        ],
    )?;
    for (pos, p) in parents.iter().enumerate() {
        tx.exec(
            "INSERT INTO graph_edges(child, pos, parent) VALUES (?1, ?2, ?3)",
            params![id, pos as i64, p],
        )?;
    }
    Ok(id)
}

/// A graph's name: 1-128 characters without spaces or control characters.
pub(crate) fn validate_group_name(name: &str) -> Result<(), StoreError> {
    if name.is_empty()
        || name.len() > 128
        || name.contains(|c: char| c.is_whitespace() || c.is_control())
    {
        return Err(StoreError::InvalidArgument(format!(
            "graph name {name:?}: use 1-128 characters without spaces or control characters"
        )));
    }
    Ok(())
}

/// A node's state must be a small JSON document
/// ([`layerstack_types::check_node_state`]).
///
/// Errors: [`StoreError::InvalidArgument`] naming what is wrong.
pub fn validate_state(state: &str) -> Result<(), StoreError> {
    layerstack_types::check_node_state(state)
        .map_err(|e| StoreError::InvalidArgument(format!("node state {e}")))
}

/// The state of a node adopted from elsewhere (a pull): any small JSON
/// document ([`layerstack_types::check_adopted_node_state`]) — nodes an
/// older daemon made may hold a non-object state.
pub(crate) fn validate_adopted_state(state: &str) -> Result<(), StoreError> {
    layerstack_types::check_adopted_node_state(state)
        .map_err(|e| StoreError::InvalidArgument(format!("node state {e}")))
}

impl Store {
    /// Creates graph `name` on `stack`: its root node is the head of `branch`.
    /// Same `key` → the first call's answer. Errors: `InvalidArgument` (a name
    /// taken, a key used for another operation), `BranchNotFound`.
    pub fn create_group(
        &self,
        name: &str,
        stack: &str,
        branch: &str,
        key: Option<&str>,
    ) -> Result<(GroupInfo, NodeInfo), StoreError> {
        validate_group_name(name)?;
        let args = KeyArgs::new()
            .with("name", name)
            .with("stack", stack)
            .with("branch", branch);
        self.db.write(|tx| {
            if let Some(g) = stored_op(tx, key, "graph-create", &args)? {
                let group = get_group(tx, &g)?;
                let root = get_node(tx, &group.root)?;
                return Ok((group, root));
            }
            if tx
                .one("SELECT 1 FROM graph_groups WHERE name = ?1", [name], |r| r.get::<_, i64>(0))
                .optional()?
                .is_some()
            {
                return Err(StoreError::AlreadyExists(format!("graph {name:?} exists already: choose another name, or pass the idempotency key that created it")));
            }
            let head = branch_head(tx, stack, branch)?.ok_or_else(|| StoreError::BranchNotFound {
                stack: stack.into(),
                branch: branch.into(),
            })?;
            let mut group = GroupInfo {
                name: name.into(),
                stack: stack.into(),
                branch: branch.into(),
                root: String::new(),
                created_ns: now_ns(),
            };
            tx.exec(
                "INSERT INTO graph_groups(name, stack, branch, root, created_ns) VALUES (?1, ?2, ?3, '', ?4)",
                params![name, stack, branch, group.created_ns],
            )?;
            let root = insert_node(tx, &group, NodeKind::Root, head, "{}", &[], None, &Provenance::default())?;
            tx.exec("UPDATE graph_groups SET root = ?2 WHERE name = ?1", params![name, root])?;
            group.root = root.clone();
            record_op(tx, key, "graph-create", name, &args)?;
            info!(graph = name, stack, branch, root = %root, "created graph");
            Ok((group, get_node(tx, &root)?))
        })
    }

    /// Every graph.
    pub fn groups(&self) -> Result<Vec<GroupInfo>, StoreError> {
        self.db.read(|conn| {
            let mut stmt = conn.prepare_cached("SELECT name FROM graph_groups ORDER BY name")?;
            let names: Vec<String> = stmt
                .query_map([], |r| r.get(0))?
                .collect::<Result<_, _>>()?;
            names.iter().map(|n| get_group(conn, n)).collect()
        })
    }

    /// Graph `name`'s group. Errors: `NotFound`.
    pub fn group(&self, name: &str) -> Result<GroupInfo, StoreError> {
        self.db.read(|conn| get_group(conn, name))
    }

    /// Graph `name` with its nodes and attempts.
    pub fn graph(&self, name: &str) -> Result<GraphDump, StoreError> {
        self.db.read(|conn| {
            let group = get_group(conn, name)?;
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {NODE_COLS} FROM graph_nodes WHERE grp = ?1 ORDER BY created_ns, id"
            ))?;
            let raws: Vec<RawNode> = stmt.query_map([name], raw_node)?.collect::<Result<_, _>>()?;
            let nodes = raws
                .into_iter()
                .map(|r| node_from(conn, r))
                .collect::<Result<Vec<_>, _>>()?;
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {ATTEMPT_COLS} FROM graph_attempts WHERE node IN (SELECT id FROM graph_nodes WHERE grp = ?1) ORDER BY id"
            ))?;
            let attempts = stmt
                .query_map([name], raw_attempt)?
                .collect::<Result<Vec<_>, _>>()?
                .into_iter()
                .map(attempt_from)
                .collect::<Result<Vec<_>, _>>()?;
            Ok(GraphDump {
                group,
                nodes,
                attempts,
            })
        })
    }

    /// At most `limit` nodes of graph `name` in creation order (the order of
    /// [`Store::graph`]: `created_ns`, then id), those after `after` — the
    /// (`created_ns`, id) of the last node of the previous page; `None`: from
    /// the first. Reads only the page (an index range), so a client can walk
    /// a graph of any size in bounded memory. Errors: `NotFound` (graph).
    pub fn graph_nodes_page(
        &self,
        name: &str,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> Result<Vec<NodeInfo>, StoreError> {
        self.db.read(|conn| {
            get_group(conn, name)?;
            let (ns, id) = after.unwrap_or((i64::MIN, ""));
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {NODE_COLS} FROM graph_nodes INDEXED BY graph_nodes_grp_created
                 WHERE grp = ?1 AND (created_ns, id) > (?2, ?3)
                 ORDER BY created_ns, id LIMIT ?4"
            ))?;
            let raws: Vec<RawNode> = stmt
                .query_map(
                    params![name, ns, id, i64::try_from(limit).unwrap_or(i64::MAX)],
                    raw_node,
                )?
                .collect::<Result<_, _>>()?;
            raws.into_iter().map(|r| node_from(conn, r)).collect()
        })
    }

    /// At most `limit` attempts of graph `name`'s nodes by id, those with an
    /// id above `after` (the last of the previous page; 0: from the first).
    /// Errors: `NotFound` (graph).
    pub fn graph_attempts_page(
        &self,
        name: &str,
        after: i64,
        limit: usize,
    ) -> Result<Vec<AttemptInfo>, StoreError> {
        self.db.read(|conn| {
            get_group(conn, name)?;
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {ATTEMPT_COLS} FROM graph_attempts a
                 WHERE a.id > ?2 AND EXISTS (SELECT 1 FROM graph_nodes n WHERE n.id = a.node AND n.grp = ?1)
                 ORDER BY a.id LIMIT ?3"
            ))?;
            let v = stmt
                .query_map(
                    params![name, after, i64::try_from(limit).unwrap_or(i64::MAX)],
                    raw_attempt,
                )?
                .collect::<Result<Vec<_>, _>>()?
                .into_iter()
                .map(attempt_from)
                .collect();
            v
        })
    }

    /// Node `id`. Error: `InvalidArgument` when there is none.
    pub fn node(&self, id: &str) -> Result<NodeInfo, StoreError> {
        self.db.read(|conn| get_node(conn, id))
    }

    /// The group of node `id`.
    pub fn node_group(&self, id: &str) -> Result<GroupInfo, StoreError> {
        self.db.read(|conn| {
            let n = get_node(conn, id)?;
            get_group(conn, &n.group)
        })
    }

    /// The attempts of node `id`, oldest first.
    pub fn attempts(&self, node: &str) -> Result<Vec<AttemptInfo>, StoreError> {
        self.db.read(|conn| {
            get_node(conn, node)?;
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {ATTEMPT_COLS} FROM graph_attempts WHERE node = ?1 ORDER BY id"
            ))?;
            let v = stmt
                .query_map([node], raw_attempt)?
                .collect::<Result<Vec<_>, _>>()?
                .into_iter()
                .map(attempt_from)
                .collect();
            v
        })
    }

    /// Attempt `id`. Error: `InvalidArgument` when there is none.
    pub fn attempt(&self, id: i64) -> Result<AttemptInfo, StoreError> {
        self.db.read(|conn| {
            let raw = conn
                .one(
                    &format!("SELECT {ATTEMPT_COLS} FROM graph_attempts WHERE id = ?1"),
                    [id],
                    raw_attempt,
                )
                .optional()?
                .ok_or_else(|| {
                    StoreError::NotFound(format!(
                        "attempt {id} does not exist (see `layerstack attempt ls NODE`)"
                    ))
                })?;
            attempt_from(raw)
        })
    }

    /// The running attempt session `sid` carries, if any.
    pub fn attempt_of_session(&self, sid: SessionId) -> Result<Option<AttemptInfo>, StoreError> {
        self.db.read(|conn| attempt_of_session_in(conn, sid))
    }

    /// Starts an attempt of node `node` for `owner`: a session leasing the node's
    /// manifest. Same `key` → the same attempt (and its session's mount now, when
    /// it still runs). Errors: `InvalidArgument` (no such node, pruned).
    pub fn start_attempt(
        &self,
        node: &str,
        owner: &Owner,
        key: Option<&str>,
    ) -> Result<(AttemptInfo, SessionInfo, MountSpec, bool), StoreError> {
        self.start_attempt_with(node, owner, key, &SessionOptions::default())
    }

    /// [`Store::start_attempt`] that records the new attempt's exit policy
    /// (`opts.exit_policy`; `checkpoint` when `None`) and capture options in the same transaction: a
    /// crash between the two can no longer leave a started attempt whose retry
    /// with the same key answers `created = false` without the policy.
    pub fn start_attempt_with(
        &self,
        node: &str,
        owner: &Owner,
        key: Option<&str>,
        opts: &SessionOptions,
    ) -> Result<(AttemptInfo, SessionInfo, MountSpec, bool), StoreError> {
        let mut holds = Vec::new();
        let args = session_args(opts).with("node", node);
        let (a, info, spec, created) = self.db.write(|tx| {
            if let Some(k) = key {
                validate_key(k)?;
                check_args(tx, "attempt", k, &args)?;
                crate::idempotency::refuse_other_sandbox_kind(tx, "attempt", k)?;
                let existing = tx
                    .one(
                        &format!("SELECT {ATTEMPT_COLS} FROM graph_attempts WHERE idempotency_key = ?1"),
                        [k],
                        raw_attempt,
                    )
                    .optional()?;
                if let Some(raw) = existing {
                    let a = attempt_from(raw)?;
                    let sid = a.session.ok_or_else(|| StoreError::corrupt("graph_attempts", a.id, "no session"))?;
                    let s = get_sess(tx, sid)?;
                    let spec = if a.status == AttemptStatus::Running && !s.released {
                        self.start_run(tx, sid)?
                    } else {
                        MountSpec::Overlay {
                            lowers: vec![],
                            upper: None,
                        }
                    };
                    let info = self.session_info(tx, get_sess(tx, sid)?)?;
                    return Ok((a, info, spec, false));
                }
            }
            let n = get_node(tx, node)?;
            if n.pruned {
                return Err(StoreError::InvalidArgument(format!(
                    "node {node} is pruned: start attempts from a live node"
                )));
            }
            let group = get_group(tx, &n.group)?;
            let sid = insert_session(
                self,
                &mut holds,
                tx,
                owner,
                &group.stack,
                &LeaseTarget::Manifest {
                    manifest: n.manifest,
                    branch: group.branch.clone(),
                },
                &[],
                None,
            )?;
            tx.exec(
                "INSERT INTO graph_attempts(node, session_id, status, idempotency_key, created_ns) VALUES (?1, ?2, 'running', ?3, ?4)",
                params![node, sid, key, now_ns()],
            )?;
            let aid = tx.last_insert_rowid();
            match &opts.exit_policy {
                Some(p) => crate::sessions::set_policy(tx, sid, p)?,
                None => default_attempt_policy(tx, sid)?,
            }
            crate::sessions::set_options(tx, sid, opts)?;
            if let Some(k) = key {
                record_args(tx, "attempt", k, &args)?;
            }
            let spec = self.start_run(tx, sid)?;
            let a = attempt_from(tx.one(
                &format!("SELECT {ATTEMPT_COLS} FROM graph_attempts WHERE id = ?1"),
                [aid],
                raw_attempt,
            )?)?;
            let info = self.session_info(tx, get_sess(tx, sid)?)?;
            info!(node, attempt = aid, session.id = sid, "attempt started");
            Ok((a, info, spec, true))
        })?;
        if let Err(e) = self.ready_run(info.id, &spec) {
            if created {
                // As for a session (`Store::create_session_with`): nothing of an
                // attempt that cannot run stays in effect; it ends `abandoned`.
                if let Err(undo) = self.undo_new_session(info.id, "attempt", key, |tx| {
                    tx.exec(
                        "UPDATE graph_attempts SET status = 'abandoned', message = 'its session directories could not be made', idempotency_key = NULL, ended_ns = ?2 WHERE id = ?1",
                        params![a.id, now_ns()],
                    )?;
                    Ok(())
                }) {
                    tracing::warn!(attempt = a.id, session.id = info.id, error = %undo, "cannot undo an attempt whose session directories could not be made; the next start makes them");
                }
            }
            return Err(e);
        }
        Ok((a, info, spec, created))
    }

    /// Marks the running attempt of session `sid` as having an attempt row of
    /// node `node` (a container attempt: its session exists already, created by
    /// containerd's Prepare), moving its lease to the node's manifest. The caller
    /// checked that the session has not been mounted.
    pub fn attach_attempt(
        &self,
        sid: SessionId,
        node: &str,
        key: Option<&str>,
    ) -> Result<(AttemptInfo, SessionInfo, MountSpec), StoreError> {
        let (a, info, spec) = self.db.write(|tx| {
            let (a, spec) = self.attach_attempt_in(tx, sid, node, key)?;
            let info = self.session_info(tx, get_sess(tx, sid)?)?;
            Ok((a, info, spec))
        })?;
        self.ready_run(sid, &spec)?;
        Ok((a, info, spec))
    }

    /// [`Store::attach_attempt`] inside the caller's transaction (containerd's
    /// Prepare with the snapshot label `containerd.io/snapshot/layerstack.node`);
    /// the caller makes the run's directories after the commit
    /// ([`Store::ready_run`]).
    pub(crate) fn attach_attempt_in(
        &self,
        tx: &Transaction<'_>,
        sid: SessionId,
        node: &str,
        key: Option<&str>,
    ) -> Result<(AttemptInfo, MountSpec), StoreError> {
        let n = get_node(tx, node)?;
        if n.pruned {
            return Err(StoreError::InvalidArgument(format!(
                "node {node} is pruned: start attempts from a live node (layerstack graph show)"
            )));
        }
        let s = get_sess(tx, sid)?;
        let group = get_group(tx, &n.group)?;
        if s.stack != group.stack {
            return Err(StoreError::InvalidArgument(format!(
                "node {node} belongs to stack {}, the container's image is stack {}: run the node's image",
                group.stack, s.stack
            )));
        }
        if s.last_publish.is_some() {
            return Err(StoreError::FailedPrecondition(format!(
                "session {sid} has ended its run already: it cannot become an attempt"
            )));
        }
        release_lease(tx, s.lease_id)?;
        let lease = new_lease(tx, n.manifest, HolderKind::Session, &sid.to_string())?;
        tx.exec(
            "UPDATE sessions SET lease_id = ?2, branch = ?3, updated_ns = ?4 WHERE id = ?1",
            params![sid, lease, group.branch, now_ns()],
        )?;
        tx.exec(
            "INSERT INTO graph_attempts(node, session_id, status, idempotency_key, created_ns) VALUES (?1, ?2, 'running', ?3, ?4)",
            params![node, sid, key, now_ns()],
        )?;
        let aid = tx.last_insert_rowid();
        default_attempt_policy(tx, sid)?;
        let spec = self.start_run(tx, sid)?;
        let a = attempt_from(tx.one(
            &format!("SELECT {ATTEMPT_COLS} FROM graph_attempts WHERE id = ?1"),
            [aid],
            raw_attempt,
        )?)?;
        info!(
            node,
            attempt = aid,
            session.id = sid,
            "attempt attached to a container's session"
        );
        Ok((a, spec))
    }

    /// Ends attempt `id` without a node: `Failed`, `Abandoned` or
    /// `Interrupted`, with why.
    pub fn end_attempt(
        &self,
        id: i64,
        status: AttemptStatus,
        message: &str,
    ) -> Result<(), StoreError> {
        self.db.write(|tx| {
            tx.exec(
                "UPDATE graph_attempts SET status = ?2, message = ?3, ended_ns = ?4 WHERE id = ?1 AND status = 'running'",
                params![id, status.as_str(), message, now_ns()],
            )?;
            Ok(())
        })
    }

    /// Running attempts whose session is gone or released without an outcome that
    /// checkpointed: they end `abandoned` (at start, and when their owner lets go).
    /// A session whose release is not complete (`remove_pending`: its run's end
    /// is still to come — a holder's close the last daemon had begun, which the
    /// holder repeats) keeps its attempt running: that end ends it.
    pub fn abandon_orphan_attempts(&self) -> Result<usize, StoreError> {
        self.db.write(|tx| {
            let n = tx.exec(
                "UPDATE graph_attempts SET status = 'abandoned', message = 'its session ended without a checkpoint', ended_ns = ?1
                 WHERE status = 'running' AND (session_id IS NULL OR session_id NOT IN (SELECT id FROM sessions WHERE released = 0 OR remove_pending = 1))",
                [now_ns()],
            )?;
            Ok(n)
        })
    }

    /// The answer stored for idempotency key `key` of operation `op`, if any.
    ///
    /// Errors: `InvalidArgument` (the key was used for another operation),
    /// `FailedPrecondition` (for `op` with arguments other than `args`).
    pub fn graph_op(
        &self,
        key: &str,
        op: &str,
        args: &KeyArgs,
    ) -> Result<Option<String>, StoreError> {
        self.db.read(|conn| stored_op(conn, Some(key), op, args))
    }

    /// Checkpoints the attempt running in session `sid`: its sealed, quiescent
    /// upper becomes the child node's layer by rename (no OCC: a new child never
    /// conflicts; no payload copy), on top of the attempt's node's manifest. The
    /// attempt ends `checkpointed`, the session's run ends (outcome `committed`
    /// with the layer), the node pins its manifest. `staged`: the layer's path
    /// index and verdicts ([`Store::stage_publish`]).
    ///
    /// `rollout`: the session is a rollout attempt's sandbox and the attempt
    /// ends with this checkpoint — its end, its sample's reward and its
    /// backpropagation are written in the same transaction (module `rollout`).
    ///
    /// Errors: `FailedPrecondition` (not a running attempt; `rollout` given
    /// for a session that is no running rollout attempt), `InvalidArgument`
    /// (state not JSON, key reused for another operation).
    #[allow(clippy::too_many_arguments)]
    pub fn commit_checkpoint(
        &self,
        sid: SessionId,
        staged: Staged,
        state: &str,
        prov: &Provenance,
        timings: Option<PublishTimings>,
        key: Option<&str>,
        rollout: Option<&crate::RolloutEnding>,
    ) -> Result<NodeInfo, StoreError> {
        validate_state(state)?;
        let upper = self.upper_path(sid);
        let dst = self.layer_path(staged.layer);
        let _inflight = self.inflight.hold(crate::layer_rel(staged.layer));
        let mut conn = self.db.writer();
        let out = write_on(&mut conn, |tx| {
            let s = get_sess(tx, sid)?;
            let a = tx
                .one(
                    &format!("SELECT {ATTEMPT_COLS} FROM graph_attempts WHERE session_id = ?1 AND status = 'running' ORDER BY id DESC LIMIT 1"),
                    [sid],
                    raw_attempt,
                )
                .optional()?
                .map(attempt_from)
                .transpose()?
                .ok_or_else(|| StoreError::FailedPrecondition(format!(
                    "session {sid} is not a running attempt of a graph node: start it with `session run --node` or the container label layerstack.node"
                )))?;
            let lease = s.lease_id.ok_or(StoreError::NoLease(sid))?;
            let base = lease_manifest(tx, lease)?;
            let parent = get_node(tx, &a.node)?;
            let group = get_group(tx, &parent.group)?;
            let n = tx.exec(
                "UPDATE layers SET kind = 'published' WHERE id = ?1 AND kind = 'pending'",
                [staged.layer],
            )?;
            if n != 1 {
                return Err(StoreError::corrupt(
                    "layers",
                    staged.layer,
                    "a staged layer is not pending any more",
                ));
            }
            let manifest = prepend_manifest(tx, &group.stack, base, staged.layer)?;
            let id = insert_node(
                tx,
                &group,
                NodeKind::Checkpoint,
                manifest,
                state,
                &[&a.node],
                Some(a.id),
                prov,
            )?;
            release_lease(tx, Some(lease))?;
            let now = now_ns();
            let c = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            let t = timings.unwrap_or_default();
            tx.exec(
                "UPDATE publishes SET outcome = 'checkpointed', manifest_before = ?2, manifest_after = ?3, message = ?4, capture_us = ?5, gate_wait_us = 0, gate_hold_us = 0, total_us = ?6, at_ns = ?7, capture_bytes = ?8 WHERE id = ?1",
                params![staged.outcome, base, manifest, format!("checkpointed as node {id}"), c(t.capture_us), c(t.total_us), now, c(t.capture_bytes)],
            )?;
            tx.exec(
                "UPDATE sessions SET state = 'published', last_publish = ?2, lease_id = NULL, updated_ns = ?3 WHERE id = ?1",
                params![sid, staged.outcome, now],
            )?;
            tx.exec(
                "UPDATE graph_attempts SET status = 'checkpointed', result_node = ?2, ended_ns = ?3 WHERE id = ?1",
                params![a.id, id, now],
            )?;
            if let Some(end) = rollout {
                let ra = crate::rollout::rollout_of_session(tx, sid)?.ok_or_else(|| {
                    StoreError::FailedPrecondition(format!(
                        "session {sid} is not the sandbox of a running rollout attempt: end it with CloseSession"
                    ))
                })?;
                crate::rollout::end_rollout_in(
                    tx,
                    ra.id,
                    end,
                    Some(&id),
                    crate::rollout::EndKeep::Checkpoint,
                )?;
            }
            record_op(tx, key, "checkpoint", &id, &checkpoint_args(sid, state))?;
            crate::failpoints::fail("checkpoint.before_rename", &self.root)
                .and_then(|()| std::fs::rename(&upper, &dst))
                .and_then(|()| match self.durability {
                    Durability::Durable => fs::fsync_dir(&self.root.join("l")),
                    Durability::Disposable => Ok(()),
                })
                .and_then(|()| crate::failpoints::fail("checkpoint.renamed", &self.root))
                .map_err(|e| StoreError::io(&upper, e))?;
            get_node(tx, &id)
        });
        if out.is_ok() {
            crate::failpoints::hit("checkpoint.committed");
        }
        drop(conn);
        match out {
            Ok(node) => {
                self.reset_session_dirs(sid, false);
                info!(session.id = sid, node = %node.id, layer.id = staged.layer, "checkpointed");
                Ok(node)
            }
            Err(e) => {
                if std::fs::symlink_metadata(&dst).is_ok()
                    && std::fs::symlink_metadata(&upper).is_err()
                {
                    let _ = std::fs::rename(&dst, &upper);
                }
                Err(e)
            }
        }
    }

    /// Records a merge node of `parents` whose root is `manifest` (a merge the
    /// engine published through the gate). Same `key` → the first answer.
    pub fn add_merge_node(
        &self,
        group: &str,
        manifest: ManifestId,
        parents: &[&str],
        state: &str,
        key: Option<&str>,
    ) -> Result<NodeInfo, StoreError> {
        let args = merge_args(parents, state);
        self.db.write(|tx| {
            if let Some(id) = stored_op(tx, key, "merge", &args)? {
                return get_node(tx, &id);
            }
            let g = get_group(tx, group)?;
            let id = insert_node(
                tx,
                &g,
                NodeKind::Merge,
                manifest,
                state,
                parents,
                None,
                &Provenance::default(),
            )?;
            record_op(tx, key, "merge", &id, &args)?;
            get_node(tx, &id)
        })
    }

    /// Stores the answer of an operation done elsewhere (a promote), keyed,
    /// with the arguments it was called with.
    pub fn record_graph_op(
        &self,
        key: &str,
        op: &str,
        response: &str,
        args: &KeyArgs,
    ) -> Result<(), StoreError> {
        self.db
            .write(|tx| record_op(tx, Some(key), op, response, args))
    }

    /// Prunes node `id` and its subtree: their leases are released, so GC may
    /// collect whatever nothing else reaches. Refused while a running attempt, a
    /// branch head or another live lease (a session's, an export's) reaches a
    /// node of the subtree. Returns the pruned node ids. Same `key` → one effect.
    pub fn prune_node(&self, id: &str, key: Option<&str>) -> Result<Vec<String>, StoreError> {
        let args = KeyArgs::new().with("node", id);
        self.db.write(|tx| {
            if let Some(r) = stored_op(tx, key, "prune", &args)? {
                return Ok(r.split(',').filter(|s| !s.is_empty()).map(String::from).collect());
            }
            get_node(tx, id)?;
            // The subtree: descendants through edges.
            let mut sub: BTreeSet<String> = BTreeSet::new();
            let mut todo = vec![id.to_string()];
            {
                let mut stmt = tx.prepare_cached("SELECT child FROM graph_edges WHERE parent = ?1")?;
                while let Some(n) = todo.pop() {
                    if sub.insert(n.clone()) {
                        for c in stmt.query_map([&n], |r| r.get::<_, String>(0))? {
                            todo.push(c?);
                        }
                    }
                }
            }
            let mut blockers = Vec::new();
            for n in &sub {
                let node = get_node(tx, n)?;
                let running: i64 = tx.one(
                    "SELECT count(*) FROM graph_attempts WHERE node = ?1 AND status = 'running'",
                    [n],
                    |r| r.get(0),
                )?;
                if running > 0 {
                    blockers.push(format!("node {n} has {running} running attempt(s)"));
                }
                let heads: Vec<String> = {
                    let mut stmt = tx.prepare_cached("SELECT name FROM branches WHERE manifest_id = ?1")?;
                    let v = stmt.query_map([node.manifest], |r| r.get(0))?.collect::<Result<_, _>>()?;
                    v
                };
                if !heads.is_empty() {
                    blockers.push(format!("node {n} is the head of branch(es) {}", heads.join(",")));
                }
                let leases: i64 = tx.one(
                    "SELECT count(*) FROM leases WHERE manifest_id = ?1 AND released_ns IS NULL AND NOT (holder_kind = 'node')",
                    [node.manifest],
                    |r| r.get(0),
                )?;
                if leases > 0 {
                    blockers.push(format!("node {n} is leased {leases} time(s) (sessions or exports read it)"));
                }
                let frontier = crate::rollout::frontier_holders(tx, n)?;
                if !frontier.is_empty() {
                    blockers.push(format!(
                        "node {n} is on the frontier of {} (release it: ReleaseFrontier, `layerstack search release`)",
                        frontier.join(",")
                    ));
                }
            }
            if !blockers.is_empty() {
                return Err(StoreError::FailedPrecondition(format!(
                    "node {id} cannot be pruned: {}",
                    blockers.join("; ")
                )));
            }
            for n in &sub {
                let lease: Option<i64> = tx.one("SELECT lease_id FROM graph_nodes WHERE id = ?1", [n], |r| r.get(0))?;
                release_lease(tx, lease)?;
                tx.exec("UPDATE graph_nodes SET pruned = 1, lease_id = NULL WHERE id = ?1", [n])?;
            }
            let pruned: Vec<String> = sub.into_iter().collect();
            record_op(tx, key, "prune", &pruned.join(","), &args)?;
            Ok(pruned)
        })
    }

    /// The manifest a node's root is (for promote, merge, export).
    pub fn node_manifest(&self, id: &str) -> Result<(String, ManifestId), StoreError> {
        self.db.read(|conn| node_stack_manifest(conn, id))
    }

    /// Points a new hidden branch named `name` of `stack` at `manifest` (the
    /// engine's working branch for node merges and promotes).
    pub fn create_branch_at(
        &self,
        stack: &str,
        name: &str,
        manifest: ManifestId,
    ) -> Result<(), StoreError> {
        self.db.write(|tx| {
            let now = now_ns();
            tx.exec(
                "INSERT OR REPLACE INTO branches(stack, name, manifest_id, created_ns, updated_ns) VALUES (?1, ?2, ?3, ?4, ?4)",
                params![stack, name, manifest, now],
            )?;
            Ok(())
        })
    }

    /// Points a new branch `name` of `stack` at `manifest` when `stack` has
    /// no branch of that name (a pull's landing); `false`, nothing written,
    /// when it has one. Errors: `InvalidArgument` (the name), `NotFound`
    /// (the manifest is not one of `stack`).
    pub fn create_branch_if_absent(
        &self,
        stack: &str,
        name: &str,
        manifest: ManifestId,
    ) -> Result<bool, StoreError> {
        crate::validate_branch(name).map_err(StoreError::InvalidArgument)?;
        self.db.write(|tx| {
            let of: Option<String> = tx
                .one("SELECT stack FROM manifests WHERE id = ?1", [manifest], |r| {
                    r.get(0)
                })
                .optional()?;
            if of.as_deref() != Some(stack) {
                return Err(StoreError::NotFound(format!(
                    "manifest {manifest} of stack {stack}"
                )));
            }
            let now = now_ns();
            let n = tx.exec(
                "INSERT OR IGNORE INTO branches(stack, name, manifest_id, created_ns, updated_ns) VALUES (?1, ?2, ?3, ?4, ?4)",
                params![stack, name, manifest, now],
            )?;
            Ok(n == 1)
        })
    }

    /// Deletes a branch without the default-branch check (the engine's working
    /// branches).
    /// The working branches (`.graph/<graph>/<operation>`) of node merges in
    /// flight: (stack, branch). At start, any is a merge the last run left
    /// half-done.
    pub fn graph_work_branches(&self) -> Result<Vec<(String, String)>, StoreError> {
        self.db.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT stack, name FROM branches WHERE name LIKE '.graph/%' ORDER BY stack, name",
            )?;
            let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
            Ok(rows.collect::<Result<_, _>>()?)
        })
    }

    pub fn drop_branch(&self, stack: &str, name: &str) -> Result<(), StoreError> {
        self.db.write(|tx| {
            tx.exec(
                "DELETE FROM branches WHERE stack = ?1 AND name = ?2",
                params![stack, name],
            )?;
            Ok(())
        })
    }
}

/// An attempt's writes become a child node unless its owner chose otherwise: the
/// session's exit policy is `checkpoint` when none is recorded (a recorded one —
/// the shim's `layerstack.publish` label, `session run --publish` — stays).
fn default_attempt_policy(tx: &Transaction<'_>, sid: SessionId) -> Result<(), StoreError> {
    tx.exec(
        "UPDATE sessions SET policy = COALESCE(policy, 'checkpoint') WHERE id = ?1",
        [sid],
    )?;
    Ok(())
}

/// [`Store::attempt_of_session`] on `conn` (in a transaction of the caller's).
pub(crate) fn attempt_of_session_in(
    conn: &Connection,
    sid: SessionId,
) -> Result<Option<AttemptInfo>, StoreError> {
    conn.one(
        &format!("SELECT {ATTEMPT_COLS} FROM graph_attempts WHERE session_id = ?1 ORDER BY id DESC LIMIT 1"),
        [sid],
        raw_attempt,
    )
    .optional()?
    .map(attempt_from)
    .transpose()
}
