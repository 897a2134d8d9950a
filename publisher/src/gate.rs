//! The publication gate, v1: path-level decisions (ARCHITECTURE §7, without the
//! three-way text merge and without the field-by-field metadata merge).
//!
//! A captured [`Changeset`] is compared with everything published on the branch
//! head since the session's lease. The whole changeset is accepted or rejected.
//! Every same-path decision goes through [`resolve_path`], the function a merge step
//! will extend.
//!
//! Rules, per path:
//! * untouched on the head → clean;
//! * same final state on both sides (same type, content digest or symlink target,
//!   mode, uid, gid) → clean. Directories compare by mode/uid/gid and opacity only,
//!   so a directory created on both sides ([`Change::Mkdir`], not opaque) is clean
//!   unless its metadata differs; timestamps never count;
//! * changed on both sides otherwise → conflict.
//!
//! Hierarchy rules, between a directory `D` and paths strictly below it:
//! * one side deleted `D`, replaced it with a non-directory, or made it opaque, and
//!   the other side changed something below `D` → conflict on that path. A deletion
//!   below `D` agrees with the removal of `D` and does not conflict.
//! * v1 treats a captured opaque directory like a removal: any head change below it
//!   conflicts. The finer §7 rule (expand the opaque directory into deletions of what
//!   the lease base had there, never wiping what the head added) is a later issue.
//!
//! Copy-up paths ([`Changeset::unchanged`]) are in the upper and so in a layer built
//! from it: a head change at such a path conflicts unless the head's final state
//! equals the lease's (publishing would revert it), and a head removal of a directory
//! above such a path conflicts (publishing would bring the path back).
//!
//! Cost: `O((n + m) log(n + m) + k)` for `n` captured paths, `m` head changes and
//! `k` reported conflicts: descendants are found with `BTreeMap` range queries
//! (all paths below `D` sort between `D/` and `D0`, since `'0'` follows `'/'`).

use std::collections::BTreeMap;
use std::ops::Bound;

use serde::{Deserialize, Serialize};

use crate::capture::{digest_bytes, Change, Changeset};
use crate::view::FileKind;

/// The kind of one change published on the head, as recorded in a layer's path index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum HeadChangeKind {
    /// [`Change::Write`].
    Write,
    /// [`Change::Symlink`].
    Symlink,
    /// [`Change::Mkdir`] with `opaque: false`.
    Mkdir,
    /// [`Change::Delete`].
    Delete,
    /// [`Change::Mkdir`] with `opaque: true`.
    Opaque,
    /// [`Change::Meta`].
    Meta,
    /// [`Change::Special`].
    Special,
}

impl HeadChangeKind {
    /// True when the change hides everything the lease had below the path.
    fn hides_below(self) -> bool {
        !matches!(self, HeadChangeKind::Mkdir | HeadChangeKind::Meta)
    }

    fn describe(self) -> &'static str {
        match self {
            HeadChangeKind::Write => "file written",
            HeadChangeKind::Symlink => "symlink written",
            HeadChangeKind::Mkdir => "directory created",
            HeadChangeKind::Delete => "deleted",
            HeadChangeKind::Opaque => "directory replaced (opaque)",
            HeadChangeKind::Meta => "directory metadata changed",
            HeadChangeKind::Special => "special file written",
        }
    }
}

/// One path changed on the branch head since a lease: the compact form of a
/// [`Change`] that the daemon stores as each published layer's path index.
///
/// `digest` identifies content: BLAKE3 of the file content ([`HeadChangeKind::Write`]),
/// of the target bytes ([`HeadChangeKind::Symlink`]), or of the file type and device
/// number ([`HeadChangeKind::Special`]); `None` otherwise. `mode` (permission bits
/// incl. setuid/setgid/sticky), `uid` and `gid` are `None` for deletions and `mode`
/// is `None` for symlinks.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HeadChange {
    /// Relative path, bytes (same form as [`Changeset::entries`] keys).
    pub path: Vec<u8>,
    /// What happened.
    pub kind: HeadChangeKind,
    /// Content identity, see above.
    pub digest: Option<[u8; 32]>,
    /// Permission bits.
    pub mode: Option<u32>,
    /// Owner user id.
    pub uid: Option<u32>,
    /// Owner group id.
    pub gid: Option<u32>,
}

impl HeadChange {
    /// The index record of `change` at `path`.
    #[must_use]
    pub fn from_change(path: &[u8], change: &Change) -> HeadChange {
        let (kind, digest, mode, uid, gid) = parts(change);
        HeadChange {
            path: path.to_vec(),
            kind,
            digest,
            mode,
            uid,
            gid,
        }
    }
}

type Parts = (
    HeadChangeKind,
    Option<[u8; 32]>,
    Option<u32>,
    Option<u32>,
    Option<u32>,
);

fn parts(change: &Change) -> Parts {
    use HeadChangeKind as K;
    match change {
        Change::Write {
            mode,
            uid,
            gid,
            digest,
            ..
        } => (K::Write, Some(*digest), Some(*mode), Some(*uid), Some(*gid)),
        Change::Symlink { target, uid, gid } => (
            K::Symlink,
            Some(digest_bytes(target)),
            None,
            Some(*uid),
            Some(*gid),
        ),
        Change::Mkdir {
            mode,
            uid,
            gid,
            opaque,
        } => {
            let kind = if *opaque { K::Opaque } else { K::Mkdir };
            (kind, None, Some(*mode), Some(*uid), Some(*gid))
        }
        Change::Delete => (K::Delete, None, None, None, None),
        Change::Meta { mode, uid, gid } => (K::Meta, None, Some(*mode), Some(*uid), Some(*gid)),
        Change::Special {
            kind,
            mode,
            uid,
            gid,
            rdev,
        } => (
            K::Special,
            Some(special_digest(*kind, *rdev)),
            Some(*mode),
            Some(*uid),
            Some(*gid),
        ),
    }
}

/// Content identity of a special file: its type and device number.
fn special_digest(kind: FileKind, rdev: u64) -> [u8; 32] {
    let tag: u8 = match kind {
        FileKind::Fifo => b'p',
        FileKind::CharDev => b'c',
        FileKind::BlockDev => b'b',
        _ => b'?',
    };
    let mut bytes = b"layerstack-special\0".to_vec();
    bytes.push(tag);
    bytes.extend_from_slice(&rdev.to_le_bytes());
    digest_bytes(&bytes)
}

/// The final state a change leaves at its path, for "same on both sides" checks.
#[derive(Debug, PartialEq, Eq)]
enum Final {
    Absent,
    /// Regular file, symlink or special file: type + content identity + metadata.
    NonDir(
        HeadChangeKind,
        Option<[u8; 32]>,
        Option<u32>,
        Option<u32>,
        Option<u32>,
    ),
    /// Directory: opacity + metadata (content is judged path by path).
    Dir {
        opaque: bool,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
    },
}

fn final_state(p: Parts) -> Final {
    use HeadChangeKind as K;
    let (kind, digest, mode, uid, gid) = p;
    match kind {
        K::Delete => Final::Absent,
        K::Mkdir | K::Meta => Final::Dir {
            opaque: false,
            mode,
            uid,
            gid,
        },
        K::Opaque => Final::Dir {
            opaque: true,
            mode,
            uid,
            gid,
        },
        K::Write | K::Symlink | K::Special => Final::NonDir(kind, digest, mode, uid, gid),
    }
}

/// The decision for one path changed on both sides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathResolution {
    /// Both sides leave the same final state: publish the captured change as is.
    Clean,
    /// The sides disagree.
    Conflict {
        /// Human-readable explanation, lowercase.
        reason: String,
    },
}

/// Decides one path that both the capture and the head changed: clean when both
/// leave the same final state (see the module docs), conflict otherwise.
///
/// `Change::Mkdir { opaque: false }` and `Change::Meta` both leave "a directory with
/// this mode/uid/gid" and so agree with each other when their metadata is equal.
#[must_use]
pub fn resolve_path(captured: &Change, head: &HeadChange) -> PathResolution {
    let mine = parts(captured);
    let theirs = (head.kind, head.digest, head.mode, head.uid, head.gid);
    let (a, b) = (final_state(mine), final_state(theirs));
    if a == b {
        return PathResolution::Clean;
    }
    let reason = match (&a, &b) {
        (Final::NonDir(ka, da, ..), Final::NonDir(kb, db, ..)) if ka == kb && da == db => {
            "both sides wrote the same content with different mode or owner".to_string()
        }
        (Final::NonDir(ka, ..), Final::NonDir(kb, ..)) if ka == kb => {
            "both sides wrote different content".to_string()
        }
        (Final::Dir { opaque: oa, .. }, Final::Dir { opaque: ob, .. }) if oa == ob => {
            "both sides set different directory mode or owner".to_string()
        }
        _ => format!(
            "changed on both sides: session {}, head {}",
            mine.0.describe(),
            head.kind.describe()
        ),
    };
    PathResolution::Conflict { reason }
}

/// One rejected path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConflictPath {
    /// Relative path, bytes.
    pub path: Vec<u8>,
    /// Why, lowercase.
    pub reason: String,
}

/// The gate's verdict on a whole changeset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateDecision {
    /// No path conflicts: the changeset may be published.
    Clean,
    /// At least one path conflicts: the whole changeset is rejected.
    Conflict {
        /// Every conflicting path once, sorted bytewise.
        paths: Vec<ConflictPath>,
    },
}

/// Runs the v1 gate on `captured` against `head_changes`: the changes of all
/// layers published on the branch head since the session's lease, **newest layer
/// first** (the manifest order). A path may appear several times; its first
/// occurrence is the head's final state for the same-path rule, and every
/// occurrence counts for the hierarchy rules. Rules: see the module docs.
#[must_use]
pub fn check_gate(captured: &Changeset, head_changes: &[HeadChange]) -> GateDecision {
    let mut head: BTreeMap<&[u8], &HeadChange> = BTreeMap::new();
    // Directories the head removed, replaced or made opaque (any occurrence).
    let mut head_hiding: BTreeMap<&[u8], HeadChangeKind> = BTreeMap::new();
    for h in head_changes {
        head.entry(h.path.as_slice()).or_insert(h);
        if h.kind.hides_below() {
            head_hiding.entry(h.path.as_slice()).or_insert(h.kind);
        }
    }
    let mut conflicts: BTreeMap<Vec<u8>, String> = BTreeMap::new();
    let mut add = |path: &[u8], reason: String| {
        conflicts.entry(path.to_vec()).or_insert(reason);
    };

    // Same path on both sides.
    for (path, change) in &captured.entries {
        if let Some(h) = head.get(path.as_slice()) {
            if let PathResolution::Conflict { reason } = resolve_path(change, h) {
                add(path, reason);
            }
        }
    }
    for (path, change) in &captured.unchanged {
        if let Some(h) = head.get(path.as_slice()) {
            if let PathResolution::Conflict { .. } = resolve_path(change, h) {
                add(
                    path,
                    format!(
                        "head {} here, and the captured layer holds an unchanged copy-up of the lease's version that would revert it",
                        h.kind.describe()
                    ),
                );
            }
        }
    }

    // The session removed, replaced or made opaque a directory; the head changed below.
    for (dir, change) in &captured.entries {
        let verb = match change {
            Change::Delete => "deleted",
            Change::Mkdir { opaque: true, .. } => "replaced (opaque)",
            Change::Mkdir { .. } | Change::Meta { .. } => continue,
            _ => "replaced with a non-directory",
        };
        for (path, h) in below(&head, dir) {
            if h.kind != HeadChangeKind::Delete {
                add(
                    path,
                    format!(
                        "session {verb} ancestor {}, head {} here",
                        show(dir),
                        h.kind.describe()
                    ),
                );
            }
        }
    }

    // The head removed, replaced or made opaque a directory; the session has something below.
    for (dir, kind) in &head_hiding {
        let what = kind.describe();
        for (path, change) in below(&captured.entries, dir) {
            if *change != Change::Delete {
                add(
                    path,
                    format!(
                        "head {what} ancestor {}, session changed this path",
                        show(dir)
                    ),
                );
            }
        }
        for (path, _) in below(&captured.unchanged, dir) {
            add(
                path,
                format!(
                    "head {what} ancestor {}, and the captured layer holds an unchanged copy-up here that would bring it back",
                    show(dir)
                ),
            );
        }
    }

    if conflicts.is_empty() {
        GateDecision::Clean
    } else {
        GateDecision::Conflict {
            paths: conflicts
                .into_iter()
                .map(|(path, reason)| ConflictPath { path, reason })
                .collect(),
        }
    }
}

/// Entries of `map` strictly below directory `dir`: keys in `[dir + "/", dir + "0")`.
fn below<'m, K, V>(map: &'m BTreeMap<K, V>, dir: &[u8]) -> impl Iterator<Item = (&'m [u8], &'m V)>
where
    K: std::borrow::Borrow<[u8]> + Ord,
{
    let mut lo = dir.to_vec();
    lo.push(b'/');
    let mut hi = dir.to_vec();
    hi.push(b'/' + 1);
    map.range::<[u8], _>((
        Bound::Included(lo.as_slice()),
        Bound::Excluded(hi.as_slice()),
    ))
    .map(|(k, v)| (k.borrow(), v))
}

/// A path for a message (lossy only for display; never written back).
fn show(path: &[u8]) -> String {
    format!("'{}'", String::from_utf8_lossy(path))
}

#[cfg(test)]
mod tests;
