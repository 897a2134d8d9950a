//! LayerStack's history model: one directory plus one SQLite database holding
//! layers, stacks (with their base layers), branches, normalized manifests,
//! leases (with holder kinds), sessions (with owner kinds), the typed path index
//! and publish outcomes (ARCHITECTURE.md §2, §4, §8).
//!
//! Modules by concept: [`db`](crate::db) (connections, transactions, row
//! parsing), `stacks` (stacks, branches, manifests, log), `import` (bases
//! imported without containerd), `leases`, `sessions`,
//! `paths` (the path index), `publish` (staging and committing a publish,
//! outcomes), `sweep` (crash recovery), and [`snapshots`] — containerd's snapshot
//! semantics (keys, kinds, parent chains, extraction, Docker init layers) over
//! the model, the only code that knows containerd's key format.
//!
//! On-disk layout (`<root>` is the store root):
//! ```text
//! <root>/store.db          SQLite (WAL). Source of truth.
//! <root>/l/<n>/            layer directories, overlay upper format; short for the mount page
//! <root>/w/<n>/            overlay workdirs of active non-session snapshots
//! <root>/s/<id>/{upper,work}  sessions
//! <root>/blobs/<hex>       rollout trajectories and artifacts (BLAKE3-addressed)
//! <root>/staging/          in-flight builds (merged files, dropped uppers)
//! ```
//! Every write follows containerd's order: filesystem work next to one short
//! `IMMEDIATE` transaction; rows are deleted before directories, and no
//! directory tree is ever removed inside a transaction; the sweep removes
//! directories without rows (never one that an operation in flight is creating).
//!
//! The store is safe for several instances on one database (each write is one
//! transaction; a publish's commit compares the branch head and swaps it). The
//! directories, however, belong to one owner at a time: the daemon takes
//! [`StoreLock`] before opening the store, so a second daemon is refused.
//!
//! ```no_run
//! use layerstack_store::{Store, StoreOptions};
//! let store = Store::open("/var/lib/layerstack".as_ref(), &StoreOptions::default())?;
//! for s in store.sessions()? {
//!     println!("{} {} {}", s.id, s.owner.display(), s.state.as_str());
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod adopt;
mod blame;
mod blobs;
mod db;
mod error;
mod export;
pub mod failpoints;
pub mod fs;
mod fsck;
mod graph;
mod history;
mod idempotency;
mod import;
mod layers;
mod leases;
mod lock;
mod model;
mod paths;
pub mod priority;
mod publish;
mod reaper;
pub mod reliability;
mod rollout;
mod schema;
mod sessions;
pub mod snapshots;
mod stacks;
mod sweep;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::{debug, info, warn};

pub use adopt::{AdoptGroup, AdoptLayer, AdoptNode, Adopted, AdoptedLayers, BlobRef, LayerSource};
pub use blame::{coalesce, tile, FileBlame, LineOwner, MarkerRecord, OwnerRange, ViewLayer};
pub use blobs::{BlobCompression, LayerBlob};
pub use error::{ErrorKind, OpenError, Result, StoreError};
pub use export::{ExportLayer, ExportLease, ExportSource};
pub use fsck::{FsckReport, Problem};
pub use graph::{
    checkpoint_args, merge_args, validate_state, AttemptInfo, AttemptStatus, GraphDump, GroupInfo,
    NodeInfo, NodeKind, Provenance,
};
pub use history::{DiskUsage, GcReport, LogPoint, MergeBase, RemovedStack, Squashed, Usage};
pub use idempotency::KeyArgs;
pub use import::{import_stack_id, is_imported_stack, ImportedBase, IMPORT_STACK_PREFIX};
pub use lock::StoreLock;
pub use model::*;
pub use publish::{CommitRecord, Published, Recheck, Staged};
pub use rollout::{
    discard_with_node, Artifact, Begun, Disposition, EndKeep, Evaluator, ExecRecord, NodeStats,
    RolloutAttempt, RolloutBegin, RolloutEnding, RolloutResult, RolloutStatus, RunAudit, RunInfo,
    SampleInfo, SampleKey, EXEC_RECORD_KEEP_BYTES,
};
pub use schema::FORMAT_VERSION;
pub use sessions::{Claim, READY_OWNER};
pub use snapshots::{
    is_extraction, split_key, stack_id, SNAPSHOT_BRANCH_LABEL, SNAPSHOT_NODE_LABEL,
    SNAPSHOT_REF_LABEL,
};
pub use sweep::{SweepMode, SweepReport};

/// The kernel's overlayfs lower-layer limit (`OVL_MAX_STACK`, fs/overlayfs/params.h).
pub const MAX_LOWERS: usize = 500;

/// Durability profile (ARCHITECTURE.md §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// WAL with `synchronous=OFF`, no fsync of layers: a daemon crash loses
    /// nothing reported committed (the page cache survives it); an OS crash may.
    #[default]
    Disposable,
    /// WAL with `synchronous=FULL`; layers and directories fsynced before commit.
    Durable,
}

/// Options for [`Store::open`].
#[derive(Debug, Clone)]
pub struct StoreOptions {
    pub durability: Durability,
    /// Branch a session leases when it names none; a new branch forks its head.
    pub default_branch: String,
    /// Run the startup sweep (crash recovery) at open. Only the store's owner may
    /// (the daemon, holding [`StoreLock`]); extra instances on the same store —
    /// tools, tests of concurrent access — open without it.
    pub startup_sweep: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            durability: Durability::Disposable,
            default_branch: "main".to_string(),
            startup_sweep: true,
        }
    }
}

/// The LayerStack store. Thread-safe; methods are synchronous (call them from a
/// blocking thread in async code).
///
/// Writes go through one connection, one transaction at a time. Pure reads use
/// read-only connections beside it, each in its own read transaction: SQLite's
/// WAL lets them read the last committed state while a write is in progress, so
/// they never wait for the writer (ARCHITECTURE.md §9, "reads never wait").
pub struct Store {
    root: PathBuf,
    db: db::Db,
    default_branch: String,
    durability: Durability,
    inflight: InFlight,
    /// Squashed layers' expanded members, for the gate's path-index queries.
    expansions: paths::Expansions,
    /// Removes trees the store let go of, off the paths that wait for an answer.
    reaper: reaper::Reaper,
}

/// Directories an operation in flight is creating or still owns (relative to the
/// root, e.g. `l/12`, `s/7`, `staging/merge-7-…`). The sweep never removes them:
/// their rows may not be committed yet. Holds are counted: a path stays in
/// flight until its last guard is dropped (creating a session holds `s/N` for the
/// transaction and again while making its directories).
#[derive(Default, Clone)]
pub struct InFlight(Arc<Mutex<HashMap<String, usize>>>);

/// Releases one hold of its path in [`InFlight`] when dropped.
pub struct InFlightGuard {
    set: InFlight,
    rel: String,
}

impl InFlight {
    /// Registers `rel` until the guard is dropped.
    pub fn hold(&self, rel: impl Into<String>) -> InFlightGuard {
        let rel = rel.into();
        *self.lock().entry(rel.clone()).or_insert(0) += 1;
        InFlightGuard {
            set: self.clone(),
            rel,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn snapshot(&self) -> HashSet<String> {
        self.lock().keys().cloned().collect()
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        let mut m = self.set.lock();
        if let Some(n) = m.get_mut(&self.rel) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.rel);
            }
        }
    }
}

#[cfg(test)]
mod inflight_tests {
    use super::InFlight;

    #[test]
    fn a_path_stays_in_flight_until_its_last_hold_is_dropped() {
        let f = InFlight::default();
        let outer = f.hold("s/7");
        {
            let _inner = f.hold("s/7");
            assert!(f.snapshot().contains("s/7"));
        }
        assert!(
            f.snapshot().contains("s/7"),
            "the inner hold's drop must not end the outer one"
        );
        drop(outer);
        assert!(!f.snapshot().contains("s/7"));
    }
}

pub(crate) fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// The prefix of the engine's own working branches (`.graph/<graph>/<operation>`
/// of a SandboxGraph merge): created internally, never by a user — a user's
/// name cannot start with `.` ([`validate_branch`]).
pub const INTERNAL_BRANCH_PREFIX: &str = ".graph/";

/// Whether `name` is one of the engine's own working branches
/// ([`INTERNAL_BRANCH_PREFIX`]).
pub fn is_internal_branch(name: &str) -> bool {
    name.starts_with(INTERNAL_BRANCH_PREFIX)
}

/// Validate a branch name a user gives: 1–128 bytes of `[A-Za-z0-9._/-]`,
/// `/`-separated components as git allows them in a ref — none empty (no
/// leading, trailing or doubled `/`), none starting with `.` or ending in
/// `.lock`, no `..` anywhere, not starting with `-`, not ending in `.`. So no
/// space, control character, `~^:?*[\` or `@`. `feature/x` is valid. A
/// branch name is only ever a key in the store, never a path; the rules keep
/// names readable and exportable as git refs.
///
/// # Errors
/// The message names the refused name, what is wrong with it and what is
/// accepted.
pub fn validate_branch(name: &str) -> std::result::Result<(), String> {
    let bad_char = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '/' | '-')));
    let why = if name.is_empty() {
        Some("it is empty".to_string())
    } else if name.len() > 128 {
        Some(format!("it is {} bytes long", name.len()))
    } else if let Some(c) = bad_char {
        Some(format!("it contains {c:?}"))
    } else if name.starts_with('-') {
        Some("it starts with `-`".into())
    } else if name.starts_with('/') || name.ends_with('/') || name.contains("//") {
        Some("it has an empty `/`-separated component".into())
    } else if name.contains("..") {
        Some("it contains `..`".into())
    } else if name.ends_with('.') {
        Some("it ends with `.`".into())
    } else {
        name.split('/')
            .find(|c| c.starts_with('.') || c.ends_with(".lock"))
            .map(|c| format!("its component {c:?} starts with `.` or ends in `.lock`"))
    };
    match why {
        None => Ok(()),
        Some(why) => Err(format!(
            "invalid branch name {name:?}: {why}; use 1-128 characters of A-Z a-z 0-9 . _ / - in `/`-separated components, as in a git branch (`feature/x`): none empty, none starting with `.` or ending in `.lock`, no `..`, not starting with `-` nor ending with `.`"
        )),
    }
}

impl Store {
    /// Open (or create) the store at `root`.
    ///
    /// Refuses, before writing anything, a root that is not on local ext4, xfs or
    /// btrfs ([`OpenError::Unsupported`]) and a store of another format version
    /// ([`OpenError::Version`]). Runs the startup sweep. Does not take the store
    /// lock: a daemon takes [`StoreLock::acquire`] first.
    pub fn open(root: &Path, opts: &StoreOptions) -> std::result::Result<Store, OpenError> {
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
        // Layers are reached through mounts only (overlay resolves its lowers
        // with the mounter's credentials, the daemon's or containerd's), never
        // by their path: `l` is 0700, as containerd's overlayfs snapshotter
        // keeps its `snapshots`. A layer holds what sessions wrote — a
        // set-user-ID file of a session's root is one of the host's root on
        // disk — and must not be executable by the host's other users by
        // its path. Set at every open: a store made before had 0711.
        // The root itself is 0700 too (as containerd's snapshotter roots):
        // the database holds idempotency keys, states, labels and the
        // commands rollouts ran with their output, `blobs/` their
        // trajectories — none for the host's other users. Every client goes
        // through the daemon's sockets, and mounts reach layers by
        // descriptor, never through this path. Set at every open: a store
        // made before was 0755.
        {
            use std::os::unix::fs::PermissionsExt;
            for d in [root, &root.join("l")] {
                std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
            }
        }
        let db = db::Db::open(root, opts.durability)?;
        let store = Store {
            root: root.to_path_buf(),
            db,
            default_branch: opts.default_branch.clone(),
            durability: opts.durability,
            inflight: InFlight::default(),
            expansions: paths::Expansions::default(),
            reaper: reaper::Reaper::new(root.join("staging")),
        };
        if !opts.startup_sweep {
            return Ok(store);
        }
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

    /// How many write transactions (and writer-held steps) the store has
    /// begun since it was opened: unchanged between two looks, the store
    /// wrote nothing in between (the daemon's memory watcher uses it to tell
    /// an idle store).
    pub fn db_writes(&self) -> u64 {
        self.db.writes()
    }

    /// How many transactions, read or write, the store has begun since it
    /// was opened: unchanged between two looks, the database was not used in
    /// between.
    pub fn db_transactions(&self) -> u64 {
        self.db.writes() + self.db.reads()
    }

    /// Frees the SQLite page caches of the writer connection (up to
    /// 64 MiB, `WRITER_CACHE_KIB`) and of the idle read connections (up to
    /// 32 × 2 MiB): what stays allocated after a large publish or a burst
    /// once the heap glibc kept is returned (no connection maps the database
    /// file: `db::MMAP_BYTES`, `db::READER_MMAP_BYTES`). Costs the next
    /// transactions re-reading their pages (from the kernel's page cache or
    /// the WAL); the daemon calls it once the store has been
    /// idle for a while. Answers the
    /// connections released (the writer is skipped while in use).
    pub fn release_db_memory(&self) -> usize {
        self.db.release_memory()
    }

    /// The configured default branch.
    pub fn default_branch(&self) -> &str {
        &self.default_branch
    }

    /// The durability profile the store was opened with.
    pub fn durability(&self) -> Durability {
        self.durability
    }

    /// Directories in flight (see [`InFlight`]); the engine registers its staging
    /// directories here so a concurrent [`Store::sweep`] leaves them alone.
    pub fn inflight(&self) -> &InFlight {
        &self.inflight
    }

    /// `<root>/l/<id>`: the directory of layer `id`.
    pub fn layer_path(&self, id: LayerId) -> PathBuf {
        self.root.join(layer_rel(id))
    }

    /// `<root>/w/<id>`: the overlay workdir of an active non-session snapshot.
    pub fn work_path(&self, id: LayerId) -> PathBuf {
        self.root.join("w").join(id.to_string())
    }

    /// `<root>/s/<id>`: a session's directory.
    pub fn session_path(&self, id: SessionId) -> PathBuf {
        self.root.join(session_rel(id))
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
}

/// `l/<id>`, relative to the root.
pub(crate) fn layer_rel(id: LayerId) -> String {
    format!("l/{id}")
}

/// `s/<id>`, relative to the root.
pub(crate) fn session_rel(id: SessionId) -> String {
    format!("s/{id}")
}

#[cfg(test)]
mod tests;
