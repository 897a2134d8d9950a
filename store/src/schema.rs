//! SQLite schema of a store (format version [`FORMAT_VERSION`]).

/// The on-disk format this build reads and writes. A store of any other version
/// is refused at open (ARCHITECTURE.md §2: never migrated silently).
pub const FORMAT_VERSION: i64 = 2;

pub(crate) const SCHEMA: &str = r#"
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
-- Every directory under l/ (and committed session uppers under s/) has a row.
-- kind: 'active' (an upper containerd is writing, not yet committed), 'base'
-- (committed image layer), 'committed' (committed non-image snapshot),
-- 'published' (a captured session prepended to a branch).
CREATE TABLE layers (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    kind        TEXT NOT NULL,
    path        TEXT NOT NULL UNIQUE,
    stack       TEXT,
    session_id  INTEGER,
    created_ns  INTEGER NOT NULL
);
-- Path index of published layers: what each layer changed, as the publisher's
-- serialized change record. The gate reads it for layers published since a lease.
CREATE TABLE layer_changes (
    layer_id INTEGER NOT NULL REFERENCES layers(id),
    path     BLOB NOT NULL,
    change   TEXT NOT NULL,
    PRIMARY KEY (layer_id, path)
) WITHOUT ROWID;
-- containerd's snapshots, exactly what containerd created (never published layers).
-- kind: 'active' | 'view' | 'committed'. `lowers` is a JSON array of layer ids,
-- newest first, frozen at creation for views and for committed sessions.
CREATE TABLE snapshots (
    key         TEXT PRIMARY KEY,
    kind        TEXT NOT NULL,
    parent      TEXT,
    labels      TEXT NOT NULL,
    created_ns  INTEGER NOT NULL,
    updated_ns  INTEGER NOT NULL,
    layer_id    INTEGER,
    session_id  INTEGER,
    image_layer INTEGER NOT NULL DEFAULT 0,
    lowers      TEXT,
    size        INTEGER,
    inodes      INTEGER
);
CREATE INDEX snapshots_parent ON snapshots(parent);
CREATE TABLE stacks (
    id         TEXT PRIMARY KEY,
    created_ns INTEGER NOT NULL
);
-- Immutable manifests: the published layers a branch head shows, newest first.
-- `layer_id` is the layer this manifest added on top of `parent`.
CREATE TABLE manifests (
    id         INTEGER PRIMARY KEY,
    stack      TEXT NOT NULL REFERENCES stacks(id),
    layers     TEXT NOT NULL,
    parent     INTEGER,
    layer_id   INTEGER,
    created_ns INTEGER NOT NULL
);
CREATE TABLE branches (
    stack       TEXT NOT NULL REFERENCES stacks(id),
    name        TEXT NOT NULL,
    manifest_id INTEGER NOT NULL REFERENCES manifests(id),
    updated_ns  INTEGER NOT NULL,
    PRIMARY KEY (stack, name)
);
CREATE TABLE leases (
    id          INTEGER PRIMARY KEY,
    manifest_id INTEGER NOT NULL REFERENCES manifests(id),
    session_id  INTEGER NOT NULL,
    created_ns  INTEGER NOT NULL,
    released_ns INTEGER
);
CREATE TABLE sessions (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    key         TEXT NOT NULL,
    namespace   TEXT NOT NULL,
    container   TEXT NOT NULL,
    stack       TEXT NOT NULL REFERENCES stacks(id),
    branch      TEXT NOT NULL,
    base_key    TEXT NOT NULL,
    above       TEXT NOT NULL,
    lease_id    INTEGER,
    state       TEXT NOT NULL,
    outcome     TEXT,
    runs        INTEGER NOT NULL DEFAULT 0,
    policy      TEXT,
    released    INTEGER NOT NULL DEFAULT 0,
    created_ns  INTEGER NOT NULL,
    updated_ns  INTEGER NOT NULL
);
CREATE INDEX sessions_container ON sessions(namespace, container);
CREATE TABLE publishes (
    id              INTEGER PRIMARY KEY,
    session_id      INTEGER NOT NULL,
    outcome         TEXT NOT NULL,
    layer_id        INTEGER,
    manifest_before INTEGER,
    manifest_after  INTEGER,
    at_ns           INTEGER NOT NULL
);
"#;
