//! Between the publisher's gate and the store's path index: conversions, and the
//! [`PathQuery`] a changeset needs answered.

use layerstack_publisher::{self as publisher, Change, Changeset, HeadChange, HeadChangeKind};
use layerstack_store::{ChangeKind, HeadChanges, IndexEntry, PathQuery, PathRecord, PathStatus};

/// The store's copy of a gate index record.
pub(crate) fn to_entry(h: &HeadChange) -> IndexEntry {
    IndexEntry {
        path: h.path.clone(),
        kind: match h.kind {
            HeadChangeKind::Write => ChangeKind::Write,
            HeadChangeKind::Symlink => ChangeKind::Symlink,
            HeadChangeKind::Mkdir => ChangeKind::Mkdir,
            HeadChangeKind::Delete => ChangeKind::Delete,
            HeadChangeKind::Opaque => ChangeKind::Opaque,
            HeadChangeKind::Meta => ChangeKind::Meta,
            HeadChangeKind::Special => ChangeKind::Special,
        },
        digest: h.digest,
        mode: h.mode,
        uid: h.uid,
        gid: h.gid,
        xattrs: h.xattrs,
    }
}

/// The gate's form of a stored index record.
pub(crate) fn to_head_change(e: IndexEntry) -> HeadChange {
    HeadChange {
        kind: match e.kind {
            ChangeKind::Write => HeadChangeKind::Write,
            ChangeKind::Symlink => HeadChangeKind::Symlink,
            ChangeKind::Mkdir => HeadChangeKind::Mkdir,
            ChangeKind::Delete => HeadChangeKind::Delete,
            ChangeKind::Opaque => HeadChangeKind::Opaque,
            ChangeKind::Meta => HeadChangeKind::Meta,
            ChangeKind::Special => HeadChangeKind::Special,
        },
        path: e.path,
        digest: e.digest,
        mode: e.mode,
        uid: e.uid,
        gid: e.gid,
        xattrs: e.xattrs,
    }
}

/// The head changes the gate takes: per-layer index rows, newest layer first,
/// flattened (an older layer's rows below a path a newer one hid are dropped).
pub(crate) fn head_changes(layers: HeadChanges) -> Vec<HeadChange> {
    publisher::flatten_head_layers(
        layers
            .into_iter()
            .map(|(_, entries)| entries.into_iter().map(to_head_change).collect()),
    )
}

/// True when rows the head gained since a plan was made (`delta`, at the plan's
/// query) can change one of its verdicts: any row but a directory's (`Mkdir`,
/// `Meta`) that repeats exactly the state the plan already took as the head's at
/// that path (`planned`: the head changes it was made with, first occurrence =
/// final state). Such a row hides nothing and leaves the head's final state where
/// it was — every publish that creates files in one shared directory adds one —
/// so the plan's verdicts and edits stand.
pub(crate) fn moves_the_plan(delta: HeadChanges, planned: &[HeadChange]) -> bool {
    let mut first: std::collections::HashMap<&[u8], &HeadChange> = std::collections::HashMap::new();
    for h in planned {
        first.entry(h.path.as_slice()).or_insert(h);
    }
    delta.into_iter().flat_map(|(_, es)| es).any(|e| {
        let h = to_head_change(e);
        let repeats = matches!(h.kind, HeadChangeKind::Mkdir | HeadChangeKind::Meta)
            && first.get(h.path.as_slice()).is_some_and(|p| **p == h);
        !repeats
    })
}

/// What the gate may look up in the head for `cs`: every captured path (changes
/// and copy-up noise) and every directory above one (a head deletion or
/// replacement of an ancestor hides it), plus the whole subtree below every path
/// the session deleted, made opaque, or turned into a non-directory (head changes
/// below it conflict). Paths only the head changed elsewhere are never needed:
/// `plan_gate` consults the head only at these paths.
pub(crate) fn query_for(cs: &Changeset) -> PathQuery {
    let mut q = PathQuery::default();
    let add_with_ancestors = |path: &[u8], q: &mut PathQuery| {
        let mut end = path.len();
        q.exact.insert(path.to_vec());
        while let Some(slash) = path[..end].iter().rposition(|&b| b == b'/') {
            if !q.exact.insert(path[..slash].to_vec()) {
                break;
            }
            end = slash;
        }
    };
    for (path, change) in &cs.entries {
        add_with_ancestors(path, &mut q);
        match change {
            Change::Mkdir { opaque: false, .. } | Change::Meta { .. } => {}
            _ => {
                q.below.insert(path.clone());
            }
        }
    }
    for path in cs.unchanged.keys() {
        add_with_ancestors(path, &mut q);
    }
    q
}

/// The store's form of the gate's verdicts.
pub(crate) fn records(plan: &publisher::GatePlan) -> Vec<PathRecord> {
    plan.reports
        .iter()
        .map(|r| PathRecord {
            path: r.path.clone(),
            status: match r.status {
                publisher::PathStatus::Clean => PathStatus::Clean,
                publisher::PathStatus::Merged => PathStatus::Merged,
                publisher::PathStatus::Conflict => PathStatus::Conflict,
                publisher::PathStatus::Excluded => PathStatus::Excluded,
            },
            reason: r.reason.clone(),
        })
        .collect()
}

/// The store's form of the layer index the plan builds.
pub(crate) fn index_of(plan: &publisher::GatePlan) -> Vec<IndexEntry> {
    plan.index.iter().map(to_entry).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_covers_ancestors_and_subtrees_of_what_hides() {
        let mut cs = Changeset::default();
        cs.entries.insert(b"a/b/file".to_vec(), Change::Delete);
        cs.entries.insert(
            b"a/dir".to_vec(),
            Change::Meta {
                mode: 0o755,
                uid: 0,
                gid: 0,
            },
        );
        let q = query_for(&cs);
        let exact: Vec<&[u8]> = q.exact.iter().map(Vec::as_slice).collect();
        assert_eq!(exact, [&b"a"[..], b"a/b", b"a/b/file", b"a/dir"]);
        let below: Vec<&[u8]> = q.below.iter().map(Vec::as_slice).collect();
        assert_eq!(
            below,
            [&b"a/b/file"[..]],
            "a metadata change needs no subtree"
        );
    }

    fn dir(path: &str, kind: ChangeKind, mode: u32) -> IndexEntry {
        IndexEntry {
            path: path.as_bytes().to_vec(),
            kind,
            digest: None,
            mode: Some(mode),
            uid: Some(0),
            gid: Some(0),
            xattrs: None,
        }
    }

    #[test]
    fn only_a_repeated_directory_row_leaves_the_plan_standing() {
        let planned = head_changes(vec![(3, vec![dir("shared", ChangeKind::Mkdir, 0o755)])]);
        let same = || vec![(5, vec![dir("shared", ChangeKind::Mkdir, 0o755)])];
        assert!(!moves_the_plan(same(), &planned), "same directory again");
        assert!(!moves_the_plan(Vec::new(), &planned), "nothing new");
        for (why, delta) in [
            (
                "other mode",
                vec![(5, vec![dir("shared", ChangeKind::Mkdir, 0o700)])],
            ),
            (
                "meta, not mkdir",
                vec![(5, vec![dir("shared", ChangeKind::Meta, 0o755)])],
            ),
            (
                "made opaque",
                vec![(5, vec![dir("shared", ChangeKind::Opaque, 0o755)])],
            ),
            (
                "deleted",
                vec![(5, vec![dir("shared", ChangeKind::Delete, 0o755)])],
            ),
            (
                "not planned against",
                vec![(5, vec![dir("other", ChangeKind::Mkdir, 0o755)])],
            ),
            (
                "a file, even repeated",
                vec![(5, vec![dir("shared", ChangeKind::Write, 0o755)])],
            ),
        ] {
            assert!(moves_the_plan(delta, &planned), "{why}");
        }
        let file = head_changes(vec![(3, vec![dir("f", ChangeKind::Write, 0o644)])]);
        assert!(
            moves_the_plan(vec![(5, vec![dir("f", ChangeKind::Write, 0o644)])], &file),
            "a rewritten file moves the plan even with the same digest"
        );
    }

    #[test]
    fn index_records_round_trip() {
        let h = HeadChange {
            path: b"x/\xff".to_vec(),
            kind: HeadChangeKind::Opaque,
            digest: Some([7; 32]),
            mode: Some(0o4755),
            uid: Some(1),
            gid: Some(2),
            xattrs: Some([9; 32]),
        };
        assert_eq!(to_head_change(to_entry(&h)), h);
    }
}
