//! SQLite schema of a store (format version [`FORMAT_VERSION`]).
//!
//! Everything that is queried is a typed column: manifests are one row per
//! position (`manifest_layers`), the path index one row per (path, layer) with the
//! change's fields as columns (`layer_paths`), per-path verdicts of a publish one
//! row each (`publish_paths`). The only JSON left is containerd's free-form
//! snapshot labels, which are filtered in memory.

/// The on-disk format this build reads and writes. A store of any other version
/// is refused at open (ARCHITECTURE.md §2: never migrated silently).
///
/// History: 1 and 2 kept manifests, path-index entries and outcomes as JSON text;
/// 3 normalized them and separated the history model from containerd's snapshots;
/// 4 added squashed layers' members, freed ("dropped") layer directories and
/// operation-owned sessions (and, before its release, blame rows and the
/// conflict markers of rebased sessions); 5 added `publishes.capture_bytes`;
/// 6 added the index of hiding path rows (`layer_paths_hiding`); 7 lets a
/// manifest hold only its newest positions and refer to a complete one for
/// the rest (`manifests.rest`); 8 lets a stack belong to no containerd
/// namespace (`stacks.namespace` NULL: an imported base, which used to be
/// `''`); 9 added `sessions.ignore_mtime`; 10 added `sessions.daemon_owned`,
/// `publishes.interrupted_by` and the attempt status `interrupted`; 11 added the
/// rollout fabric's tables (`rollout_*`, `search_*`, `frontier_leases`); 12
/// added the session owner kind `wasi`; 13 added the OCI blobs a layer was
/// written as (`layer_blobs`, module `blobs`); 14 added the worker of a remote
/// rollout attempt (`rollout_attempts.worker`: recorded here, run on another
/// machine); 15 added the parents a node declares that the store does not
/// hold (`graph_missing_parents`: a node pulled before its parent, issue 23);
/// 16 added the commands the daemon ran in a rollout attempt's sandbox
/// (`rollout_execs`: its trajectory as the daemon saw it); 17 added a
/// sandbox session's uid/gid mapping (`sessions.id_map`).
/// Formats 4 to 16 are migrated at open ([`MIGRATIONS`]).
pub const FORMAT_VERSION: i64 = 18;

/// The daemon's record of a running attempt's commands (format 16), in
/// [`SCHEMA`] and in the migration from format 15 (`IF NOT EXISTS`: a test
/// that turns a current store back into an older format keeps it).
macro_rules! rollout_execs_table {
    () => {
        r#"
-- A command the daemon ran (`Exec`) in a running rollout attempt's sandbox, in
-- order (`seq` from 0): `record` is a JSON object (argv, exit_code, signal,
-- timed_out, duration_ms, the first bytes of stdout and stderr). When the
-- attempt ends without a trajectory from its harness, these become its
-- trajectory blob; the rows go once the attempt ended (rollout.rs).
CREATE TABLE IF NOT EXISTS rollout_execs (
    attempt_id INTEGER NOT NULL REFERENCES rollout_attempts(id),
    seq        INTEGER NOT NULL CHECK (seq >= 0),
    record     TEXT NOT NULL,
    PRIMARY KEY (attempt_id, seq)
) WITHOUT ROWID;
"#
    };
}

/// The parents a node declares that this store does not hold (format 15), in
/// [`SCHEMA`] and in the migration from format 14 (`IF NOT EXISTS`: a test
/// that turns a current store back into an older format keeps it).
macro_rules! graph_missing_parents_table {
    () => {
        r#"
-- A parent node `child` declares at position `pos` that this store does not
-- hold (no graph_nodes row: a node pulled before its parent). The node's
-- declared parents are its graph_edges and these rows, by position; a
-- position is in one of the two. When a node of id `parent` arrives (a pull
-- adopts it), each row naming it becomes an edge in that transaction.
CREATE TABLE IF NOT EXISTS graph_missing_parents (
    child  TEXT NOT NULL REFERENCES graph_nodes(id),
    pos    INTEGER NOT NULL CHECK (pos >= 0),
    parent TEXT NOT NULL,
    PRIMARY KEY (child, pos)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS graph_missing_parents_parent ON graph_missing_parents(parent);
"#
    };
}

/// The worker column of rollout attempts (format 14), in [`SCHEMA`] after
/// [`rollout_tables`] and in the migration from format 13.
macro_rules! rollout_worker_column {
    () => {
        r#"
-- The worker (e.g. a Ray node id) a remote attempt runs on: the attempt is
-- recorded here with no sandbox here; NULL: a local attempt.
ALTER TABLE rollout_attempts ADD COLUMN worker TEXT CHECK (worker IS NULL OR worker <> '');
"#
    };
}

/// What an ended rollout attempt's end asked of its sandbox's writes (format
/// 18), in [`SCHEMA`] and in the migration from format 17.
macro_rules! rollout_end_keep_column {
    () => {
        r#"
-- EndRolloutRequest.keep of the attempt's end: 'checkpoint' or 'discard'.
-- A repeated end must ask the same. NULL: running, ended by the daemon (an
-- infrastructure failure), or ended by an older daemon.
ALTER TABLE rollout_attempts ADD COLUMN end_keep TEXT CHECK (end_keep IS NULL OR end_keep IN ('checkpoint', 'discard'));
"#
    };
}

/// The OCI blobs a layer was written as (format 13; module `blobs`), in
/// [`SCHEMA`] and in the migration from format 12 (`IF NOT EXISTS`: a test
/// that turns a current store back into an older format keeps it).
macro_rules! layer_blobs_table {
    () => {
        r#"
-- One row per (layer, compression): digest = sha256 of the blob, diff_id =
-- sha256 of the uncompressed tar (the same for every compression of a layer),
-- size = bytes of the blob. Deleted with its layer (ON DELETE CASCADE).
CREATE TABLE IF NOT EXISTS layer_blobs (
    layer_id    INTEGER NOT NULL REFERENCES layers(id) ON DELETE CASCADE,
    compression TEXT NOT NULL CHECK (compression IN ('gzip', 'zstd', 'none')),
    digest      TEXT NOT NULL,
    diff_id     TEXT NOT NULL,
    size        INTEGER NOT NULL CHECK (size >= 0),
    PRIMARY KEY (layer_id, compression)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS layer_blobs_diff_id ON layer_blobs(diff_id);
"#
    };
}

/// The rollout fabric's tables (format 11; ARCHITECTURE.md §12, docs/fabric.md):
/// mutable records beside the immutable graph, in [`SCHEMA`] and in the
/// migration from format 10 (new tables only, `IF NOT EXISTS`: a test that
/// turns a current store back into an older format keeps them).
macro_rules! rollout_tables {
    () => {
        r#"
-- A run: the samples of one training run or one search, over one graph.
CREATE TABLE IF NOT EXISTS rollout_runs (
    name       TEXT PRIMARY KEY,
    grp        TEXT NOT NULL REFERENCES graph_groups(name),
    labels     TEXT NOT NULL DEFAULT '{}',
    created_ns INTEGER NOT NULL
);
-- A sample (run, step, prompt, sample): every attempt of it starts from `node`.
-- Its reward is applied once: `reward_attempt` (the attempt whose completed
-- reward it is) is set once, in the transaction that ends that attempt, and
-- never changed.
CREATE TABLE IF NOT EXISTS rollout_samples (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    run            TEXT NOT NULL REFERENCES rollout_runs(name),
    step           INTEGER NOT NULL CHECK (step >= 0),
    prompt         TEXT NOT NULL,
    sample         INTEGER NOT NULL CHECK (sample >= 0),
    node           TEXT NOT NULL REFERENCES graph_nodes(id),
    reward         REAL,
    reward_attempt INTEGER,
    created_ns     INTEGER NOT NULL,
    UNIQUE (run, step, prompt, sample),
    CHECK ((reward IS NULL) = (reward_attempt IS NULL))
);
-- An attempt of a sample (from 1). status: running | completed (reward set) |
-- task_failed | infra_failed (infra_kind set). `applied`: this attempt's reward
-- is its sample's. `result_node`: the checkpoint kept (NULL: discarded or none).
CREATE TABLE IF NOT EXISTS rollout_attempts (
    id                INTEGER PRIMARY KEY AUTOINCREMENT,
    sample_id         INTEGER NOT NULL REFERENCES rollout_samples(id),
    attempt           INTEGER NOT NULL CHECK (attempt >= 1),
    graph_attempt     INTEGER REFERENCES graph_attempts(id),
    session_id        INTEGER,
    policy            TEXT NOT NULL,
    seed              INTEGER,
    status            TEXT NOT NULL CHECK (status IN ('running', 'completed', 'task_failed', 'infra_failed')),
    infra_kind        TEXT CHECK ((status = 'infra_failed') = (infra_kind IS NOT NULL)),
    reward            REAL CHECK ((status = 'completed') = (reward IS NOT NULL)),
    accepted          INTEGER,
    applied           INTEGER NOT NULL DEFAULT 0,
    evaluator_name    TEXT,
    evaluator_version TEXT,
    evaluator_digest  TEXT,
    result_node       TEXT,
    trajectory        TEXT,
    message           TEXT NOT NULL DEFAULT '',
    created_ns        INTEGER NOT NULL,
    ended_ns          INTEGER,
    UNIQUE (sample_id, attempt)
);
CREATE INDEX IF NOT EXISTS rollout_attempts_session ON rollout_attempts(session_id);
CREATE INDEX IF NOT EXISTS rollout_attempts_running ON rollout_attempts(status) WHERE status = 'running';
-- Named content-addressed blobs of an attempt (its artifacts), in <root>/blobs.
CREATE TABLE IF NOT EXISTS rollout_artifacts (
    attempt_id INTEGER NOT NULL REFERENCES rollout_attempts(id),
    name       TEXT NOT NULL,
    digest     TEXT NOT NULL,
    size       INTEGER NOT NULL,
    PRIMARY KEY (attempt_id, name)
) WITHOUT ROWID;
-- Search statistics: mutable, beside the immutable nodes (never in layers).
CREATE TABLE IF NOT EXISTS search_stats (
    node       TEXT PRIMARY KEY REFERENCES graph_nodes(id),
    visits     INTEGER NOT NULL DEFAULT 0,
    value_sum  REAL NOT NULL DEFAULT 0,
    prior      REAL,
    updated_ns INTEGER NOT NULL
) WITHOUT ROWID;
-- One backpropagation per attempt (the primary key makes a second impossible):
-- the value and how many nodes it updated, from `leaf` to the graph's root.
CREATE TABLE IF NOT EXISTS search_backprops (
    attempt_id INTEGER PRIMARY KEY REFERENCES rollout_attempts(id),
    leaf       TEXT NOT NULL,
    value      REAL NOT NULL,
    nodes      INTEGER NOT NULL,
    at_ns      INTEGER NOT NULL
);
-- Frontier leases: nodes a search will expand. A leased node is never pruned
-- (so never collected) until every holder releases it.
CREATE TABLE IF NOT EXISTS frontier_leases (
    node       TEXT NOT NULL REFERENCES graph_nodes(id),
    holder     TEXT NOT NULL,
    created_ns INTEGER NOT NULL,
    PRIMARY KEY (node, holder)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS frontier_leases_holder ON frontier_leases(holder);
"#
    };
}

/// Indexes added to format 15 after its release, made at every open
/// (`IF NOT EXISTS`: once per store) and with a new store's [`SCHEMA`]:
/// additive, so a build without them reads the store as before.
///
/// Without them, work grew with the square of the graph (P12: a graph of
/// 20,000 nodes took 42 s to pull in and 99 s to prune and collect):
/// - `leases_manifest`: GC deletes the released leases of each manifest it
///   collects; `leases_live` covers only unreleased ones, so each delete
///   scanned the whole table.
/// - `manifests_parent`, `manifests_rest`, `graph_nodes_lease`,
///   `sessions_lease`: foreign keys' child columns. Deleting a manifest
///   (GC) or a lease made SQLite look for rows referring to it by a scan of
///   the whole child table; and an adoption's manifest chain
///   (`adopt::chain`: the manifest of `parent` + `layer`) scanned every
///   manifest for each layer of each node pulled.
/// - `graph_nodes_grp_created`: `ShowGraph` reads a graph in pages in
///   creation order ([`crate::Store::graph_nodes_page`]) instead of the
///   whole graph at once; each page starts where the last ended in it.
pub(crate) const FORMAT_INDEXES: &str =
    "CREATE INDEX IF NOT EXISTS leases_manifest ON leases(manifest_id);
     CREATE INDEX IF NOT EXISTS manifests_parent ON manifests(parent, layer_id);
     CREATE INDEX IF NOT EXISTS manifests_rest ON manifests(rest);
     CREATE INDEX IF NOT EXISTS graph_nodes_lease ON graph_nodes(lease_id);
     CREATE INDEX IF NOT EXISTS sessions_lease ON sessions(lease_id);
     CREATE INDEX IF NOT EXISTS graph_nodes_grp_created ON graph_nodes(grp, created_ns, id);";

/// The steps that bring an older store to [`FORMAT_VERSION`], each
/// `(from, what it does, SQL)`, applied in order in the open's transaction and
/// logged. Only lossless, additive steps are migrations; any other version is
/// refused.
pub(crate) const MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        4,
        "publishes.capture_bytes",
        "ALTER TABLE publishes ADD COLUMN capture_bytes INTEGER;",
    ),
    (
        5,
        "index layer_paths_hiding",
        "CREATE INDEX IF NOT EXISTS layer_paths_hiding ON layer_paths(path, layer_id) WHERE kind NOT IN (2, 5);",
    ),
    (
        6,
        "manifests.rest",
        // Every manifest of an older store is complete: NULL.
        "ALTER TABLE manifests ADD COLUMN rest INTEGER REFERENCES manifests(id);",
    ),
    (
        7,
        "stacks.namespace nullable",
        // SQLite cannot drop a NOT NULL constraint: the table is rebuilt
        // (sqlite.org/lang_altertable.html "Making Other Kinds Of Table Schema
        // Changes"; the open runs migrations with foreign_keys off and checks
        // them before its commit). Other tables refer to `stacks` by name,
        // which the rename gives back.
        "CREATE TABLE stacks_v8 (
            id          TEXT PRIMARY KEY,
            base_digest TEXT NOT NULL,
            namespace   TEXT CHECK (namespace <> ''),
            created_ns  INTEGER NOT NULL
        );
        INSERT INTO stacks_v8(id, base_digest, namespace, created_ns)
            SELECT id, base_digest, NULLIF(namespace, ''), created_ns FROM stacks;
        DROP TABLE stacks;
        ALTER TABLE stacks_v8 RENAME TO stacks;",
    ),
    (
        8,
        "sessions.ignore_mtime",
        "ALTER TABLE sessions ADD COLUMN ignore_mtime INTEGER NOT NULL DEFAULT 0;",
    ),
    (
        9,
        "sessions.daemon_owned, publishes.interrupted_by, attempt status interrupted",
        // Every session of an older store was held by a holder process (a
        // daemon-owned session could not survive its daemon before format 10
        // recorded it): 0. The attempts' CHECK gains a status: the table is
        // rebuilt (as stacks was for format 8), its AUTOINCREMENT sequence
        // carried over so that no attempt id is handed out twice.
        "ALTER TABLE sessions ADD COLUMN daemon_owned INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE publishes ADD COLUMN interrupted_by TEXT;
        CREATE TABLE graph_attempts_v10 (
            id              INTEGER PRIMARY KEY AUTOINCREMENT,
            node            TEXT NOT NULL REFERENCES graph_nodes(id),
            session_id      INTEGER,
            status          TEXT NOT NULL CHECK (status IN ('running', 'checkpointed', 'failed', 'abandoned', 'interrupted')),
            idempotency_key TEXT UNIQUE,
            result_node     TEXT,
            message         TEXT,
            created_ns      INTEGER NOT NULL,
            ended_ns        INTEGER
        );
        INSERT INTO graph_attempts_v10(id, node, session_id, status, idempotency_key, result_node, message, created_ns, ended_ns)
            SELECT id, node, session_id, status, idempotency_key, result_node, message, created_ns, ended_ns FROM graph_attempts;
        DELETE FROM sqlite_sequence WHERE name = 'graph_attempts_v10';
        INSERT INTO sqlite_sequence(name, seq)
            SELECT 'graph_attempts_v10', seq FROM sqlite_sequence WHERE name = 'graph_attempts';
        DROP TABLE graph_attempts;
        ALTER TABLE graph_attempts_v10 RENAME TO graph_attempts;
        CREATE INDEX graph_attempts_node ON graph_attempts(node);
        CREATE INDEX graph_attempts_session ON graph_attempts(session_id);",
    ),
    (10, "rollout fabric tables", rollout_tables!()),
    (
        11,
        "session owner kind wasi",
        // The CHECK gains a kind: the table is rebuilt (as graph_attempts was
        // for format 10), its AUTOINCREMENT sequence carried over so that no
        // session id is handed out twice.
        "CREATE TABLE sessions_v12 (
            id              INTEGER PRIMARY KEY AUTOINCREMENT,
            owner_kind      TEXT NOT NULL CHECK (owner_kind IN ('container', 'sandbox', 'wasi', 'operation')),
            namespace       TEXT NOT NULL,
            owner           TEXT NOT NULL,
            stack           TEXT NOT NULL REFERENCES stacks(id),
            branch          TEXT NOT NULL,
            lease_id        INTEGER REFERENCES leases(id),
            state           TEXT NOT NULL CHECK (state IN ('active', 'published', 'conflict', 'discarded')),
            run             INTEGER NOT NULL DEFAULT 1,
            policy          TEXT,
            last_publish    INTEGER,
            released        INTEGER NOT NULL DEFAULT 0,
            remove_pending  INTEGER NOT NULL DEFAULT 0,
            idempotency_key TEXT UNIQUE,
            created_ns      INTEGER NOT NULL,
            updated_ns      INTEGER NOT NULL,
            ignore_mtime    INTEGER NOT NULL DEFAULT 0,
            daemon_owned    INTEGER NOT NULL DEFAULT 0
        );
        INSERT INTO sessions_v12(id, owner_kind, namespace, owner, stack, branch, lease_id, state, run, policy, last_publish, released, remove_pending, idempotency_key, created_ns, updated_ns, ignore_mtime, daemon_owned)
            SELECT id, owner_kind, namespace, owner, stack, branch, lease_id, state, run, policy, last_publish, released, remove_pending, idempotency_key, created_ns, updated_ns, ignore_mtime, daemon_owned FROM sessions;
        DELETE FROM sqlite_sequence WHERE name = 'sessions_v12';
        INSERT INTO sqlite_sequence(name, seq)
            SELECT 'sessions_v12', max(seq) FROM sqlite_sequence WHERE name = 'sessions' HAVING count(*) > 0;
        DROP TABLE sessions;
        ALTER TABLE sessions_v12 RENAME TO sessions;
        CREATE INDEX sessions_owner ON sessions(owner_kind, namespace, owner);",
    ),
    (12, "layer_blobs", layer_blobs_table!()),
    (13, "rollout_attempts.worker", rollout_worker_column!()),
    // Additive: a node of an older store declared no parent it lacked (the
    // pull dropped it); a pull of that node again records it.
    (14, "graph_missing_parents", graph_missing_parents_table!()),
    (15, "rollout_execs", rollout_execs_table!()),
    // Additive: no session of an older store had a mapping.
    (
        16,
        "sessions.id_map",
        "ALTER TABLE sessions ADD COLUMN id_map TEXT;",
    ),
    // Additive: an older store's ended attempts recorded no keep (a repeat
    // of their end is compared without it).
    (17, "rollout_attempts.end_keep", rollout_end_keep_column!()),
];

pub(crate) const SCHEMA: &str = concat!(
    r#"
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

-- Every directory under l/ (and a committed session upper under s/) has a row.
--   active     an upper containerd is writing (image extraction, plain snapshot)
--   base       a committed image layer (unpacked by containerd)
--   committed  a committed non-image snapshot (Docker's -init layer, ctr commit)
--   pending    a publish's layer between planning and its commit (no directory
--              under l/ yet: the session's upper is renamed there at commit)
--   published  a captured session prepended to a branch
--   squashed   a compaction of a run of layers (its members in squash_members)
-- `dropped`: the directory was freed by GC; the row stays because a squashed
-- layer that is still reachable lists it as a member (the gate reads members'
-- path index rows).
CREATE TABLE layers (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    kind        TEXT NOT NULL CHECK (kind IN ('active', 'base', 'committed', 'pending', 'published', 'squashed')),
    path        TEXT NOT NULL UNIQUE,
    stack       TEXT,
    session_id  INTEGER,
    dropped     INTEGER NOT NULL DEFAULT 0,
    created_ns  INTEGER NOT NULL
);
-- The run a squashed layer replaced, newest first.
CREATE TABLE squash_members (
    layer_id  INTEGER NOT NULL REFERENCES layers(id),
    pos       INTEGER NOT NULL,
    member_id INTEGER NOT NULL REFERENCES layers(id),
    PRIMARY KEY (layer_id, pos)
) WITHOUT ROWID;
CREATE INDEX squash_members_member ON squash_members(member_id);

-- The path index: what each published layer changed, one row per path. The gate
-- reads it for the paths a publish touches (and the directories above them), in
-- the layers published since the publish's lease.
--   kind: 0 write, 1 symlink, 2 mkdir, 3 delete, 4 opaque, 5 meta, 6 special
CREATE TABLE layer_paths (
    path     BLOB NOT NULL,
    layer_id INTEGER NOT NULL REFERENCES layers(id),
    kind     INTEGER NOT NULL CHECK (kind BETWEEN 0 AND 6),
    digest   BLOB CHECK (digest IS NULL OR length(digest) = 32),
    mode     INTEGER,
    uid      INTEGER,
    gid      INTEGER,
    xattrs   BLOB CHECK (xattrs IS NULL OR length(xattrs) = 32),
    PRIMARY KEY (path, layer_id)
) WITHOUT ROWID;
CREATE INDEX layer_paths_layer ON layer_paths(layer_id);
-- The rows that hide what is below their path (every kind but mkdir and meta):
-- the gate asks for the newest of them at a path without reading the rows of a
-- directory that every publish touches (format 6).
CREATE INDEX layer_paths_hiding ON layer_paths(path, layer_id) WHERE kind NOT IN (2, 5);

-- A stack: the history that grows on one base (ARCHITECTURE.md §2). Its base
-- layers are recorded here, so history stays reachable after containerd removes
-- the image's snapshots. `namespace` is the containerd namespace of a stack
-- made from an image; an imported base (module import: `import:sha256:…`, no
-- containerd) has none (NULL) and its content digest as base_digest.
CREATE TABLE stacks (
    id          TEXT PRIMARY KEY,
    base_digest TEXT NOT NULL,
    namespace   TEXT CHECK (namespace <> ''),
    created_ns  INTEGER NOT NULL
);
-- The base layers of a stack, newest (top) first.
CREATE TABLE stack_layers (
    stack    TEXT NOT NULL REFERENCES stacks(id),
    pos      INTEGER NOT NULL,
    layer_id INTEGER NOT NULL REFERENCES layers(id),
    PRIMARY KEY (stack, pos)
) WITHOUT ROWID;
CREATE INDEX stack_layers_layer ON stack_layers(layer_id);

-- Immutable manifests: the published layers a head shows, newest first.
-- `layer_id` is the layer this manifest added on top of `parent` (NULL for a
-- stack's empty root manifest); `depth` its length. With `rest` NULL the
-- manifest is complete: one manifest_layers row per position. Otherwise its rows
-- are its newest depth − depth(rest) positions and `rest`, a complete manifest
-- in its parent chain, holds the others (stacks.rs: a prepend writes ≤ 16 rows
-- but once every 16).
CREATE TABLE manifests (
    id         INTEGER PRIMARY KEY,
    stack      TEXT NOT NULL REFERENCES stacks(id),
    parent     INTEGER REFERENCES manifests(id),
    layer_id   INTEGER REFERENCES layers(id),
    depth      INTEGER NOT NULL,
    created_ns INTEGER NOT NULL,
    rest       INTEGER REFERENCES manifests(id)
);
CREATE TABLE manifest_layers (
    manifest_id INTEGER NOT NULL REFERENCES manifests(id),
    pos         INTEGER NOT NULL,
    layer_id    INTEGER NOT NULL REFERENCES layers(id),
    PRIMARY KEY (manifest_id, pos)
) WITHOUT ROWID;
CREATE INDEX manifest_layers_layer ON manifest_layers(layer_id);

CREATE TABLE branches (
    stack       TEXT NOT NULL REFERENCES stacks(id),
    name        TEXT NOT NULL,
    manifest_id INTEGER NOT NULL REFERENCES manifests(id),
    created_ns  INTEGER NOT NULL,
    updated_ns  INTEGER NOT NULL,
    PRIMARY KEY (stack, name)
);

-- A pinned manifest. holder_kind says who holds it; holder names it (a session
-- id, a branch name, a node id, an export id).
CREATE TABLE leases (
    id          INTEGER PRIMARY KEY,
    manifest_id INTEGER NOT NULL REFERENCES manifests(id),
    holder_kind TEXT NOT NULL CHECK (holder_kind IN ('session', 'branch', 'node', 'export')),
    holder      TEXT NOT NULL,
    created_ns  INTEGER NOT NULL,
    released_ns INTEGER
);
CREATE INDEX leases_live ON leases(manifest_id) WHERE released_ns IS NULL;

-- A session: one private upper on a lease. owner_kind 'container' (Mode A:
-- namespace + container id), 'sandbox' (Mode B: a holder process; owner is its
-- name), 'wasi' (WebAssembly modules the daemon runs; owner is its name,
-- format 12) or 'operation' (an engine operation such as promote; owner is its id). `run` counts runs (a new run starts after every outcome). `released`:
-- the owner let go (containerd removed the snapshot, the sandbox closed); the row
-- stays as history. `remove_pending`: released while a publish was running; the
-- directories go when it ends. `daemon_owned`: the daemon started and owns the
-- session's init (format 10): after a restart such a session ends
-- 'interrupted', never by its policy. `id_map`: the session's uid/gid mapping
-- as `HOST_UID:HOST_GID:SIZE` (format 17; NULL: none): its upper holds host
-- ids until they are shifted back before capture.
CREATE TABLE sessions (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    owner_kind      TEXT NOT NULL CHECK (owner_kind IN ('container', 'sandbox', 'wasi', 'operation')),
    namespace       TEXT NOT NULL,
    owner           TEXT NOT NULL,
    stack           TEXT NOT NULL REFERENCES stacks(id),
    branch          TEXT NOT NULL,
    lease_id        INTEGER REFERENCES leases(id),
    state           TEXT NOT NULL CHECK (state IN ('active', 'published', 'conflict', 'discarded')),
    run             INTEGER NOT NULL DEFAULT 1,
    policy          TEXT,
    last_publish    INTEGER,
    released        INTEGER NOT NULL DEFAULT 0,
    remove_pending  INTEGER NOT NULL DEFAULT 0,
    idempotency_key TEXT UNIQUE,
    created_ns      INTEGER NOT NULL,
    updated_ns      INTEGER NOT NULL,
    ignore_mtime    INTEGER NOT NULL DEFAULT 0,
    daemon_owned    INTEGER NOT NULL DEFAULT 0,
    id_map          TEXT
);
CREATE INDEX sessions_owner ON sessions(owner_kind, namespace, owner);
-- Private read-only layers a session sees above its lease, newest first
-- (Docker's per-container -init layer).
CREATE TABLE session_layers (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    pos        INTEGER NOT NULL,
    layer_id   INTEGER NOT NULL REFERENCES layers(id),
    PRIMARY KEY (session_id, pos)
) WITHOUT ROWID;

-- Outcomes, one row per ended run (or attempt). outcome: committed | merged |
-- checkpointed | no-change | conflict | discarded | failed | busy | unsupported |
-- unknown | interrupted. interrupted_by: which infrastructure failure ended an
-- 'interrupted' run (daemon-restart | init-gone; format 10), NULL otherwise.
CREATE TABLE publishes (
    id              INTEGER PRIMARY KEY,
    session_id      INTEGER NOT NULL REFERENCES sessions(id),
    run             INTEGER NOT NULL,
    outcome         TEXT NOT NULL,
    layer_id        INTEGER,
    manifest_before INTEGER,
    manifest_after  INTEGER,
    message         TEXT,
    clean           INTEGER NOT NULL DEFAULT 0,
    merged          INTEGER NOT NULL DEFAULT 0,
    conflict        INTEGER NOT NULL DEFAULT 0,
    excluded        INTEGER NOT NULL DEFAULT 0,
    capture_us      INTEGER,
    gate_wait_us    INTEGER,
    gate_hold_us    INTEGER,
    total_us        INTEGER,
    at_ns           INTEGER NOT NULL,
    -- Content bytes of the files the capture found written (format 5).
    capture_bytes   INTEGER,
    interrupted_by  TEXT
);
CREATE INDEX publishes_session ON publishes(session_id);
-- The gate's verdict per path of a publish. status: 0 clean, 1 merged,
-- 2 conflict, 3 excluded.
CREATE TABLE publish_paths (
    publish_id INTEGER NOT NULL REFERENCES publishes(id),
    path       BLOB NOT NULL,
    status     INTEGER NOT NULL CHECK (status BETWEEN 0 AND 3),
    reason     TEXT NOT NULL,
    PRIMARY KEY (publish_id, path)
) WITHOUT ROWID;

-- containerd's snapshots, exactly what containerd created (never published
-- layers): the snapshots module. kind: 'active' | 'view' | 'committed'.
-- A view's and a committed session's lowers are frozen in snapshot_lowers.
CREATE TABLE snapshots (
    key         TEXT PRIMARY KEY,
    kind        TEXT NOT NULL CHECK (kind IN ('active', 'view', 'committed')),
    parent      TEXT,
    labels      TEXT NOT NULL,
    created_ns  INTEGER NOT NULL,
    updated_ns  INTEGER NOT NULL,
    layer_id    INTEGER,
    session_id  INTEGER,
    image_layer INTEGER NOT NULL DEFAULT 0,
    frozen      INTEGER NOT NULL DEFAULT 0,
    size        INTEGER,
    inodes      INTEGER
);
CREATE INDEX snapshots_parent ON snapshots(parent);
CREATE INDEX snapshots_session ON snapshots(session_id);
CREATE INDEX snapshots_layer ON snapshots(layer_id);
CREATE TABLE snapshot_lowers (
    key      TEXT NOT NULL,
    pos      INTEGER NOT NULL,
    layer_id INTEGER NOT NULL REFERENCES layers(id),
    PRIMARY KEY (key, pos)
) WITHOUT ROWID;
CREATE INDEX snapshot_lowers_layer ON snapshot_lowers(layer_id);

-- The SandboxGraph (ARCHITECTURE.md §12): groups of immutable nodes, each an
-- immutable root (a manifest, pinned by the node's lease) + a small logical state
-- (JSON, immutable) + provenance; attempts activate a node in a session.
CREATE TABLE graph_groups (
    name       TEXT PRIMARY KEY,
    stack      TEXT NOT NULL REFERENCES stacks(id),
    branch     TEXT NOT NULL,
    root       TEXT NOT NULL,
    created_ns INTEGER NOT NULL
);
-- kind: 'root' (a branch head), 'checkpoint' (an attempt's upper), 'merge'.
CREATE TABLE graph_nodes (
    id          TEXT PRIMARY KEY,
    grp         TEXT NOT NULL REFERENCES graph_groups(name),
    kind        TEXT NOT NULL CHECK (kind IN ('root', 'checkpoint', 'merge')),
    -- No foreign key: a pruned node's root may be collected (its row stays as
    -- history; the node cannot be activated any more).
    manifest_id INTEGER NOT NULL,
    lease_id    INTEGER REFERENCES leases(id),
    state       TEXT NOT NULL,
    attempt_id  INTEGER,
    command     TEXT,
    labels      TEXT NOT NULL DEFAULT '{}',
    exit_status INTEGER,
    private_bytes INTEGER,
    base_digest TEXT NOT NULL,
    pruned      INTEGER NOT NULL DEFAULT 0,
    created_ns  INTEGER NOT NULL
);
CREATE INDEX graph_nodes_grp ON graph_nodes(grp);
CREATE TABLE graph_edges (
    child  TEXT NOT NULL REFERENCES graph_nodes(id),
    pos    INTEGER NOT NULL,
    parent TEXT NOT NULL REFERENCES graph_nodes(id),
    PRIMARY KEY (child, pos)
) WITHOUT ROWID;
CREATE INDEX graph_edges_parent ON graph_edges(parent);
-- status: running | checkpointed | failed | abandoned | interrupted (its
-- session ended by an infrastructure failure, not by the task; format 10).
CREATE TABLE graph_attempts (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    node            TEXT NOT NULL REFERENCES graph_nodes(id),
    session_id      INTEGER,
    status          TEXT NOT NULL CHECK (status IN ('running', 'checkpointed', 'failed', 'abandoned', 'interrupted')),
    idempotency_key TEXT UNIQUE,
    result_node     TEXT,
    message         TEXT,
    created_ns      INTEGER NOT NULL,
    ended_ns        INTEGER
);
CREATE INDEX graph_attempts_node ON graph_attempts(node);
CREATE INDEX graph_attempts_session ON graph_attempts(session_id);
-- Idempotency: the answer of a mutating graph operation, by the client's key,
-- written in the same transaction as the operation's effect.
CREATE TABLE graph_ops (
    key        TEXT PRIMARY KEY,
    op         TEXT NOT NULL,
    response   TEXT NOT NULL,
    created_ns INTEGER NOT NULL
);
-- Blame (module blame): who wrote each line of a published text file version,
-- outside the layers. Keyed by the version (stack, path, content digest) and the
-- layer whose publish recorded it; coalesced ranges of lines (from 1, inclusive).
-- owner_kind 'original' (from the base image; owner NULL), 'session' (owner: the
-- container id or sandbox name; session_id its session) or 'operation' (owner:
-- the operation id). Lines no row covers are unknown. No foreign keys: rows of a
-- layer GC deleted are collected with it.
CREATE TABLE blame_ranges (
    stack      TEXT NOT NULL,
    path       BLOB NOT NULL,
    digest     BLOB NOT NULL CHECK (length(digest) = 32),
    layer_id   INTEGER NOT NULL,
    start_line INTEGER NOT NULL CHECK (start_line >= 1),
    end_line   INTEGER NOT NULL CHECK (end_line >= start_line),
    owner_kind TEXT NOT NULL CHECK (owner_kind IN ('original', 'session', 'operation')),
    owner      TEXT CHECK ((owner_kind = 'original') = (owner IS NULL)),
    session_id INTEGER,
    PRIMARY KEY (stack, path, digest, layer_id, start_line)
) WITHOUT ROWID;
CREATE INDEX blame_ranges_layer ON blame_ranges(layer_id);
-- Conflict blocks `layerstack session rebase` wrote into a session's upper: while
-- the session holds lease `lease_id`, a publish is refused as long as the file at
-- `path` still holds a block with BLAKE3 `digest`.
CREATE TABLE session_markers (
    session_id INTEGER NOT NULL,
    lease_id   INTEGER NOT NULL,
    path       BLOB NOT NULL,
    digest     BLOB NOT NULL CHECK (length(digest) = 32),
    start_line INTEGER NOT NULL,
    PRIMARY KEY (session_id, lease_id, path, digest)
) WITHOUT ROWID;
"#,
    rollout_tables!(),
    layer_blobs_table!(),
    rollout_worker_column!(),
    graph_missing_parents_table!(),
    rollout_execs_table!(),
    rollout_end_keep_column!()
);
