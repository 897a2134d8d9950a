//! Plain data types of the model (ARCHITECTURE.md §2).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Row id of a layer; its directory is `<root>/l/<id>` (see [`crate::Store::layer_path`]).
pub type LayerId = i64;
/// Row id of a session.
pub type SessionId = i64;
/// Row id of an immutable manifest.
pub type ManifestId = i64;

/// containerd's snapshot kinds (containerd `snapshots/snapshotter.go` `Kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotKind {
    /// Read-only snapshot of a parent (`View`).
    View,
    /// Writable snapshot (`Prepare`).
    Active,
    /// Immutable snapshot (`Commit`).
    Committed,
}

impl SnapshotKind {
    /// Lowercase name, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::View => "view",
            Self::Active => "active",
            Self::Committed => "committed",
        }
    }
}

/// What containerd sees of a snapshot (`Stat`/`List`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// containerd's backend key (`<namespace>/<seq>/<key>`) or committed name.
    pub key: String,
    pub kind: SnapshotKind,
    /// Parent's key, empty for none.
    pub parent: String,
    pub labels: BTreeMap<String, String>,
    /// Nanoseconds since the Unix epoch.
    pub created_ns: i64,
    /// Nanoseconds since the Unix epoch.
    pub updated_ns: i64,
}

/// How a snapshot is mounted; the adapter turns it into containerd `Mount`s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MountSpec {
    /// A bind mount of one directory (`rbind`, `rw` or `ro`).
    Bind { source: PathBuf, writable: bool },
    /// An overlay mount. `lowers` newest first; `upper` = `(upperdir, workdir)`
    /// for writable mounts. Every mount carries `index=off,redirect_dir=off,metacopy=off`.
    Overlay {
        lowers: Vec<PathBuf>,
        upper: Option<(PathBuf, PathBuf)>,
    },
}

impl MountSpec {
    /// The overlay options, in containerd's order (`snapshots/overlay/overlay.go`).
    pub fn overlay_options(&self) -> Vec<String> {
        match self {
            Self::Bind { writable, .. } => {
                vec![
                    if *writable { "rw" } else { "ro" }.to_string(),
                    "rbind".to_string(),
                ]
            }
            Self::Overlay { lowers, upper } => {
                let mut o = vec![
                    "index=off".to_string(),
                    "redirect_dir=off".to_string(),
                    "metacopy=off".to_string(),
                ];
                if let Some((u, w)) = upper {
                    o.push(format!("workdir={}", w.display()));
                    o.push(format!("upperdir={}", u.display()));
                }
                let l: Vec<String> = lowers.iter().map(|p| p.display().to_string()).collect();
                o.push(format!("lowerdir={}", l.join(":")));
                o
            }
        }
    }
}

/// The names of the model's states (`as_str`/`parse`, one spelling from the
/// store to the wire) live in the vocabulary crate.
pub use layerstack_types::{Interruption, OutcomeKind, OwnerKind, PathStatus, SessionState};

/// How a path verdict is stored (`publish_paths.status`).
pub(crate) fn path_status_code(s: PathStatus) -> i64 {
    match s {
        PathStatus::Clean => 0,
        PathStatus::Merged => 1,
        PathStatus::Conflict => 2,
        PathStatus::Excluded => 3,
    }
}

/// The inverse of [`path_status_code`].
pub(crate) fn path_status_from_code(c: i64) -> Option<PathStatus> {
    Some(match c {
        0 => PathStatus::Clean,
        1 => PathStatus::Merged,
        2 => PathStatus::Conflict,
        3 => PathStatus::Excluded,
        _ => return None,
    })
}

/// The gate's verdict on one path of a publish, with why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathRecord {
    /// Relative path, bytes (no leading `/`); display it with [`escape_path`].
    pub path: Vec<u8>,
    pub status: PathStatus,
    /// Why, lowercase.
    pub reason: String,
}

/// How many paths of a publish got each verdict.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathCounts {
    pub clean: u64,
    pub merged: u64,
    pub conflict: u64,
    pub excluded: u64,
}

impl PathCounts {
    /// Counts of `paths`.
    pub fn of(paths: &[PathRecord]) -> PathCounts {
        let mut c = PathCounts::default();
        for p in paths {
            match p.status {
                PathStatus::Clean => c.clean += 1,
                PathStatus::Merged => c.merged += 1,
                PathStatus::Conflict => c.conflict += 1,
                PathStatus::Excluded => c.excluded += 1,
            }
        }
        c
    }

    /// All paths.
    pub fn total(&self) -> u64 {
        self.clean + self.merged + self.conflict + self.excluded
    }
}

/// Row id of a publish outcome (table `publishes`).
pub type PublishId = i64;

/// The recorded result of one run of a session (one publish, discard or failure).
/// Per-path verdicts are not held here (a run may touch hundreds of thousands of
/// paths): read them page by page with [`crate::Store::outcome_paths`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The outcome's row id (for [`crate::Store::outcome_paths`]).
    pub id: PublishId,
    pub kind: OutcomeKind,
    /// The run of the session it ended.
    pub run: i64,
    /// The published layer, for `Committed`, `Merged` and `Checkpointed`.
    pub layer: Option<LayerId>,
    /// The graph node this outcome made: the child node of a `Checkpointed`
    /// outcome (its layer is the node's top layer); `None` for every other
    /// outcome. Read from the node's row (the checkpoint's attempt ran in this
    /// session and the node's root is the manifest the outcome made), never
    /// from `message`.
    pub node: Option<String>,
    /// Human-readable detail (failure cause, counts), for people: programs read
    /// the other fields.
    pub message: Option<String>,
    /// Verdict counts over the recorded paths.
    pub counts: PathCounts,
    /// Nanoseconds since the Unix epoch.
    pub at_ns: i64,
    /// Where the publish spent its time (absent for outcomes that did not gate).
    pub timings: Option<PublishTimings>,
    /// Which infrastructure failure ended the run: set exactly for
    /// [`OutcomeKind::Interrupted`] (store format 10, `publishes.interrupted_by`).
    pub interrupted_by: Option<Interruption>,
}

/// An outcome to record: [`Outcome`] before it has a row, with its paths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutcomeRecord {
    pub kind: OutcomeKind,
    pub message: Option<String>,
    /// Per-path verdicts, any order.
    pub paths: Vec<PathRecord>,
    pub timings: Option<PublishTimings>,
    /// [`Outcome::interrupted_by`]: `Some` exactly when `kind` is
    /// [`OutcomeKind::Interrupted`] ([`crate::Store::record_outcome`] refuses
    /// anything else).
    pub interrupted_by: Option<Interruption>,
}

impl OutcomeRecord {
    /// An outcome of `kind` with `message` and no paths.
    pub fn new(kind: OutcomeKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: Some(message.into()),
            paths: Vec::new(),
            timings: None,
            interrupted_by: None,
        }
    }

    /// An [`OutcomeKind::Interrupted`] outcome ended by `by`, with `message`.
    pub fn interrupted(by: Interruption, message: impl Into<String>) -> Self {
        Self {
            interrupted_by: Some(by),
            ..Self::new(OutcomeKind::Interrupted, message)
        }
    }
}

/// Where one publish spent its time, in microseconds, and what it captured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishTimings {
    /// Capture, policy edits, sealing and planning against the observed head
    /// (outside the gate), from when a publish worker took it up (a wait for a
    /// free worker is in `total_us` only).
    pub capture_us: u64,
    /// Waiting for the branch's gate.
    pub gate_wait_us: u64,
    /// Holding the gate: head re-check, re-planning what changed meanwhile,
    /// applying, commit.
    pub gate_hold_us: u64,
    /// Whole publish, from its start to the recorded outcome.
    pub total_us: u64,
    /// Content bytes of the regular files the capture found written (the sum
    /// of their sizes, what it hashed and the layer holds); 0 for an outcome
    /// that captured nothing, and for outcomes recorded before store format 5.
    pub capture_bytes: u64,
}

/// Who a session belongs to (ARCHITECTURE.md §2 "Owner").
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Owner {
    /// Mode A: a container, through containerd (`namespace` + container id).
    Container { namespace: String, id: String },
    /// Mode B: a sandbox session held by a `layerstack session run` holder;
    /// `name` is its label (unique among live sandbox sessions is not required).
    Sandbox { name: String },
    /// A WASI session: the daemon runs WebAssembly modules over the session's
    /// tree (a detached overlay it holds itself); `name` is its label.
    Wasi { name: String },
    /// An engine operation (promote, a graph merge): `id` names it in blame as
    /// `operation:<id>`.
    Operation { id: String },
}

impl Owner {
    /// The owner's kind.
    pub fn kind(&self) -> OwnerKind {
        match self {
            Self::Container { .. } => OwnerKind::Container,
            Self::Sandbox { .. } => OwnerKind::Sandbox,
            Self::Wasi { .. } => OwnerKind::Wasi,
            Self::Operation { .. } => OwnerKind::Operation,
        }
    }

    /// A session with no container: a sandbox (Mode B) or a WASI session.
    /// Both are created and closed through the sandbox calls
    /// (`CreateSession` / `CloseSession`) and end by their exit policy.
    pub fn is_sandbox(&self) -> bool {
        matches!(self, Self::Sandbox { .. } | Self::Wasi { .. })
    }

    /// `container`, `sandbox`, `wasi` or `operation` ([`OwnerKind::as_str`]).
    pub fn kind_str(&self) -> &'static str {
        self.kind().as_str()
    }

    /// The owner's display form: `container:<ns>/<id>`, `sandbox:<name>`,
    /// `wasi:<name>` or `operation:<id>`.
    pub fn display(&self) -> String {
        match self {
            Self::Container { namespace, id } => format!("container:{namespace}/{id}"),
            Self::Sandbox { name } => format!("sandbox:{name}"),
            Self::Wasi { name } => format!("wasi:{name}"),
            Self::Operation { id } => format!("operation:{id}"),
        }
    }

    /// containerd namespace (empty for a sandbox session).
    pub fn namespace(&self) -> &str {
        match self {
            Self::Container { namespace, .. } => namespace,
            Self::Sandbox { .. } | Self::Wasi { .. } | Self::Operation { .. } => "",
        }
    }

    /// The container id or sandbox name.
    pub fn name(&self) -> &str {
        match self {
            Self::Container { id, .. } => id,
            Self::Sandbox { name } | Self::Wasi { name } => name,
            Self::Operation { id } => id,
        }
    }
}

/// A session as listed by `layerstack session ls`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    pub id: SessionId,
    pub owner: Owner,
    /// The containerd snapshot key of a container session while containerd has it.
    pub key: Option<String>,
    pub stack: String,
    pub branch: String,
    pub state: SessionState,
    /// The outcome of the current run, once it has one.
    pub outcome: Option<Outcome>,
    /// The manifest currently leased, if any (none right after an outcome that
    /// ended the run; the next mount leases the head).
    pub lease_manifest: Option<ManifestId>,
    /// The current run, from 1.
    pub run: i64,
    /// The owner let go (containerd removed the snapshot, the sandbox closed);
    /// the row stays as history.
    pub released: bool,
    /// Released while a publish ran: the directories go when it ends.
    pub remove_pending: bool,
    /// The exit policy recorded on the session (`on-exit`, `on-success`, `never`,
    /// or an invalid value recorded as given); `None`: not recorded.
    pub policy: Option<String>,
    pub idempotency_key: Option<String>,
    pub upper: PathBuf,
    pub work: PathBuf,
    /// Nanoseconds since the Unix epoch.
    pub created_ns: i64,
    /// Capture ignores a regular file's mtime ([`SessionOptions::ignore_mtime`]).
    pub ignore_mtime: bool,
    /// The daemon itself started and owns the session's init
    /// ([`SessionOptions::daemon_owned`]).
    pub daemon_owned: bool,
    /// The session's uid/gid mapping ([`SessionOptions::id_map`]).
    pub id_map: Option<layerstack_types::IdMap>,
    /// The call that created this session also created its branch (it did
    /// not exist: forked from the default branch's head, in the same
    /// transaction). Only in the answer of that call
    /// ([`Store::create_session_with`]); false in every later read, and for
    /// sessions on a node or a containerd snapshot. A harness or the CLI
    /// tells a new branch from a misspelt one by it.
    ///
    /// [`Store::create_session_with`]: crate::Store::create_session_with
    pub branch_created: bool,
}

/// What a new session records in the transaction that creates it (so a crash
/// never leaves it without them, and a repeat of its idempotency key answers
/// them as first recorded).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionOptions {
    /// Exit policy, as [`crate::Store::set_session_policy`] takes it (`None`:
    /// none recorded; an attempt records `checkpoint`).
    pub exit_policy: Option<String>,
    /// Capture treats a regular file whose content, mode, owner and xattrs
    /// equal the lease's as unchanged even when its mtime differs (a tool that
    /// rewrites files without changing them: `sed -i` matching nothing). For
    /// harnesses that want content history only; default off (mtime is a
    /// change, as `touch` is).
    pub ignore_mtime: bool,
    /// The daemon starts and owns the session's init (a daemon-owned session,
    /// `CreateSessionRequest.sandbox`), rather than a `layerstack session
    /// run|create` holder process. Recorded so that the next daemon, after a
    /// restart, knows the init died with the last one: such a session ends
    /// [`OutcomeKind::Interrupted`], never by its exit policy (store format 10).
    pub daemon_owned: bool,
    /// The session's processes run in a user namespace with this mapping
    /// (a daemon-owned sandbox's `SandboxOptions.id_map`): its upper holds
    /// the host's ids of its writes, which the engine shifts back to the
    /// session's before any capture (store format 17).
    pub id_map: Option<layerstack_types::IdMap>,
}

impl SessionInfo {
    /// Whether the current run's outcome ends it: recorded and not retryable.
    pub fn run_finished(&self) -> bool {
        self.outcome
            .as_ref()
            .is_some_and(|o| !o.kind.is_retryable())
    }

    /// Whether its release is due to complete ([`Store::complete_release`]):
    /// released by its owner, an outcome recorded, and either a release
    /// pending or a sandbox's run ended. A sandbox session that conflicted
    /// kept its upper and lease (and may have been rebased): a later outcome
    /// that ends its run completes the release (nothing mounts it again). Not
    /// a container's: containerd's Commit may have made its upper a layer in
    /// place.
    pub fn release_due(&self) -> bool {
        self.released
            && self.outcome.is_some()
            && (self.remove_pending || (self.owner.is_sandbox() && self.run_finished()))
    }
}

/// One entry of `layerstack log`: a layer on a branch, newest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    pub layer: LayerId,
    pub kind: LayerKind,
    /// The manifest that added the layer (the oldest that did); for a member of
    /// a squashed layer, 0 when GC removed every such manifest.
    pub manifest: ManifestId,
    pub session: Option<SessionId>,
    /// Who published it (the session's owner), when known.
    pub owner: Option<Owner>,
    /// Number of distinct paths the layer changed (a squashed layer: of its
    /// merged index, a path several members changed counted once).
    pub paths: i64,
    /// When the layer was made (published, or committed as a squash), in
    /// nanoseconds since the Unix epoch.
    pub created_ns: i64,
    /// A squashed layer's members, newest first, each with its own entry (a
    /// member that is itself squashed has its members too); empty otherwise.
    pub members: Vec<LogEntry>,
}

/// Kinds of layer rows (ARCHITECTURE.md §2 "Layer").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// An upper containerd is writing.
    Active,
    /// A committed image layer (`B`).
    Base,
    /// A committed non-image snapshot.
    Committed,
    /// A publish's layer before its commit.
    Pending,
    /// A captured session (`L`).
    Published,
    /// A compaction of a run of layers (`S`).
    Squashed,
}

impl LayerKind {
    /// Lowercase name, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Active => "active",
            Self::Base => "base",
            Self::Committed => "committed",
            Self::Pending => "pending",
            Self::Published => "published",
            Self::Squashed => "squashed",
        }
    }

    /// The kind named `s`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "active" => Self::Active,
            "base" => Self::Base,
            "committed" => Self::Committed,
            "pending" => Self::Pending,
            "published" => Self::Published,
            "squashed" => Self::Squashed,
            _ => return None,
        })
    }
}

/// What one published change was, as the path index records it (the store's copy
/// of the publisher's `HeadChangeKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChangeKind {
    Write,
    Symlink,
    Mkdir,
    Delete,
    Opaque,
    Meta,
    Special,
}

impl ChangeKind {
    pub(crate) fn code(self) -> i64 {
        match self {
            Self::Write => 0,
            Self::Symlink => 1,
            Self::Mkdir => 2,
            Self::Delete => 3,
            Self::Opaque => 4,
            Self::Meta => 5,
            Self::Special => 6,
        }
    }

    /// True when the change hides everything the lease had below the path (a
    /// deletion, an opaque directory, a non-directory): the publisher's
    /// `HeadChangeKind::hides_below`.
    pub fn hides_below(self) -> bool {
        !matches!(self, Self::Mkdir | Self::Meta)
    }

    pub(crate) fn from_code(c: i64) -> Option<Self> {
        Some(match c {
            0 => Self::Write,
            1 => Self::Symlink,
            2 => Self::Mkdir,
            3 => Self::Delete,
            4 => Self::Opaque,
            5 => Self::Meta,
            6 => Self::Special,
            _ => return None,
        })
    }
}

/// One row of the path index: what a layer changed at one path. `digest` is the
/// BLAKE3 of the content (files), target (symlinks) or type+device (specials);
/// `xattrs` the BLAKE3 of the non-private xattrs; `None` where not applicable.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IndexEntry {
    /// Relative path, bytes, no leading `/`.
    pub path: Vec<u8>,
    pub kind: ChangeKind,
    pub digest: Option<[u8; 32]>,
    /// Permission bits incl. setuid/setgid/sticky.
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub xattrs: Option<[u8; 32]>,
}

/// The paths a publish asks the index about: `exact` paths (what it captured and
/// every directory above), and directories whose whole subtree matters (`below`:
/// what it deleted, replaced or made opaque).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PathQuery {
    pub exact: std::collections::BTreeSet<Vec<u8>>,
    pub below: std::collections::BTreeSet<Vec<u8>>,
}

/// The path index of the layers between two manifests, restricted to a
/// [`PathQuery`]: one `(layer, entries sorted by path)` per layer that has any,
/// newest layer first. Per path at most two rows: the newest (the head's final
/// state there) and the newest that hides below the path
/// ([`ChangeKind::hides_below`]), when that is an older one — all the gate's
/// rules read (older rows at a path change no verdict).
pub type HeadChanges = Vec<(LayerId, Vec<IndexEntry>)>;

/// A branch: a named pointer to a manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BranchInfo {
    pub stack: String,
    pub name: String,
    pub head: ManifestId,
    /// Published layers on the head.
    pub depth: i64,
    pub updated_ns: i64,
}

/// A stack: the history on one base.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StackInfo {
    /// `<namespace>/<chainID>`, or `import:sha256:<hex>` for an imported base
    /// ([`crate::import_stack_id`]).
    pub id: String,
    /// The base image's top layer chainID, or an imported base's content
    /// digest.
    pub base_digest: String,
    /// The containerd namespace it belongs to (`None`: an imported base, which
    /// belongs to none and is listed in every one).
    pub namespace: Option<String>,
    /// Base (image) layers, newest first.
    pub base_layers: Vec<LayerId>,
    pub branches: Vec<BranchInfo>,
    pub created_ns: i64,
}

/// What a new session leases: a branch head (created from the default branch's
/// head when missing), or an explicit manifest of the stack whose publishes go to
/// `branch` (a graph node's root, a promote's merge base).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseTarget {
    Branch(String),
    Manifest {
        manifest: ManifestId,
        branch: String,
    },
}

/// Holder kinds of a lease (table `leases`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HolderKind {
    Session,
    Branch,
    Node,
    Export,
}

impl HolderKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Session => "session",
            Self::Branch => "branch",
            Self::Node => "node",
            Self::Export => "export",
        }
    }
}

/// Everything a publish of one session reads before capturing, in one read
/// transaction ([`crate::Store::publish_context`]).
#[derive(Debug, Clone)]
pub struct PublishContext {
    pub session: SessionInfo,
    /// The lease's lower directories, newest first (what the session saw).
    pub lease_lowers: Vec<PathBuf>,
    /// The lease's manifest.
    pub lease_manifest: ManifestId,
}

/// A branch head as a publish observes it: the manifest and the lower
/// directories a session of that branch would mount on it, newest first.
#[derive(Debug, Clone)]
pub struct HeadView {
    pub manifest: ManifestId,
    pub lowers: Vec<PathBuf>,
}

/// Escape a byte path for display, with a leading `/`: printable UTF-8 stays as
/// is; a backslash becomes `\\`; control characters and bytes that are not UTF-8
/// become `\xNN`. Unambiguous (an escaped name never reads as another name),
/// never used to write a name back.
pub fn escape_path(p: &[u8]) -> String {
    let mut out = String::with_capacity(p.len() + 1);
    out.push('/');
    for chunk in p.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                c if c.is_control() => {
                    let mut buf = [0u8; 4];
                    for b in c.encode_utf8(&mut buf).bytes() {
                        out.push_str(&format!("\\x{b:02x}"));
                    }
                }
                c => out.push(c),
            }
        }
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}
