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
    pub(crate) fn parse(s: &str) -> Self {
        match s {
            "view" => Self::View,
            "active" => Self::Active,
            _ => Self::Committed,
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

/// A session's lifecycle state (CLI `session ls`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SessionState {
    /// Mounted or mountable; writes not yet published.
    Active,
    /// Last run published (or had nothing to publish); upper is fresh and empty.
    Published,
    /// Last run was rejected by the gate; upper and lease kept for inspection.
    Conflict,
    /// Last run's writes were dropped on purpose (or committed as a containerd snapshot).
    Discarded,
}

impl SessionState {
    /// Lowercase name, as printed by the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Active => "active",
            Self::Published => "published",
            Self::Conflict => "conflict",
            Self::Discarded => "discarded",
        }
    }
    pub(crate) fn parse(s: &str) -> Self {
        match s {
            "published" => Self::Published,
            "conflict" => Self::Conflict,
            "discarded" => Self::Discarded,
            _ => Self::Active,
        }
    }
}

/// The kinds of publish outcome (ARCHITECTURE.md §2 "Outcome").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OutcomeKind {
    /// A new layer was prepended to the branch.
    Committed,
    /// A new layer was prepended to the branch, and at least one of its paths was
    /// three-way merged (content) or merged field by field (metadata) with changes
    /// published since the session's lease.
    Merged,
    /// The session changed nothing; no layer was made.
    NoChange,
    /// The whole changeset was rejected; nothing was published.
    Conflict,
    /// The writes were dropped without publishing.
    Discarded,
    /// Publishing failed for a reason other than a conflict; nothing was published.
    Failed,
}

impl OutcomeKind {
    /// Kebab-case name, as printed by the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Committed => "committed",
            Self::Merged => "merged",
            Self::NoChange => "no-change",
            Self::Conflict => "conflict",
            Self::Discarded => "discarded",
            Self::Failed => "failed",
        }
    }
}

/// One path the gate refused, with why. `path` is display-escaped (see [`escape_path`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConflictRecord {
    pub path: String,
    pub reason: String,
}

/// The gate's verdict on one path of a publish. `path` is display-escaped (see
/// [`escape_path`]); `status` is `clean`, `merged`, `conflict` or `excluded`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathRecord {
    pub path: String,
    pub status: String,
    pub reason: String,
}

/// The recorded result of one publish attempt of a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    pub kind: OutcomeKind,
    /// The published layer, for `Committed` and `Merged`.
    pub layer: Option<LayerId>,
    /// Per-path reasons, for `Conflict`.
    #[serde(default)]
    pub conflicts: Vec<ConflictRecord>,
    /// The gate's verdict on every path (clean, merged, conflict, excluded), sorted
    /// by path; empty for outcomes that did not reach the gate.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<PathRecord>,
    /// Human-readable detail (failure cause, counts).
    #[serde(default)]
    pub message: Option<String>,
    /// Nanoseconds since the Unix epoch.
    pub at_ns: i64,
    /// Where the publish spent its time (absent for outcomes that did not publish).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timings: Option<PublishTimings>,
}

/// Where one publish spent its time, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishTimings {
    /// Capture, policy edits and sealing of the upper (outside the gate).
    pub capture_us: u64,
    /// Waiting for the branch's gate.
    pub gate_wait_us: u64,
    /// Holding the gate: head check, planning/merging, applying, commit.
    pub gate_hold_us: u64,
    /// Whole publish, from its start to the recorded outcome.
    pub total_us: u64,
}

/// A session as listed by `layerstack session ls`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    pub id: SessionId,
    /// The container rootfs snapshot key.
    pub key: String,
    pub namespace: String,
    pub container: String,
    pub stack: String,
    pub branch: String,
    pub state: SessionState,
    pub outcome: Option<Outcome>,
    /// The manifest currently leased, if any (none right after a publish).
    pub lease_manifest: Option<ManifestId>,
    /// How many times this session has been (re)mounted after a publish.
    pub runs: i64,
    /// containerd removed the snapshot; the row stays as history.
    pub released: bool,
    /// The container's exit policy (label `layerstack.publish`) recorded by the
    /// runtime shim; `None`: not recorded (on-exit unless the label says otherwise).
    pub policy: Option<String>,
    pub upper: PathBuf,
    pub work: PathBuf,
}

/// One entry of `layerstack log`: a published layer on a branch, newest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    pub layer: LayerId,
    pub manifest: ManifestId,
    pub session: Option<SessionId>,
    pub namespace: Option<String>,
    pub container: Option<String>,
    /// Number of paths the layer changed.
    pub paths: i64,
    pub created_ns: i64,
}

/// Everything the publisher needs to capture and gate one session, read in one
/// read transaction (see [`crate::Store::publish_context`]).
#[derive(Debug, Clone)]
pub struct PublishContext {
    pub session: SessionInfo,
    /// The lease's lower directories, newest first (what the session saw).
    pub lease_lowers: Vec<PathBuf>,
    /// The lease's manifest.
    pub lease_manifest: ManifestId,
}

/// One layer's path index: the layer and its `(path, serialized change)` rows in
/// byte order of path.
pub type LayerIndex = (LayerId, Vec<(Vec<u8>, String)>);

/// What the gate compares against: the head manifest and the serialized path
/// changes of every layer on it that the lease does not have.
#[derive(Debug, Clone)]
pub struct HeadDelta {
    pub head: ManifestId,
    /// The path index of each layer published since the lease, newest layer first:
    /// `(layer, [(path, serialized change)])`, paths in byte order within a layer.
    /// Layer boundaries matter: a newer layer that deleted or replaced a directory
    /// hides an older layer's changes below it.
    pub layers: Vec<LayerIndex>,
    /// Layers on head but not in the lease, newest first.
    pub new_layers: Vec<LayerId>,
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
