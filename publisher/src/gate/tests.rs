#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;

fn write(d: u8) -> Change {
    Change::Write {
        mode: 0o644,
        uid: 0,
        gid: 0,
        size: 1,
        digest: [d; 32],
    }
}

fn mkdir(mode: u32, opaque: bool) -> Change {
    Change::Mkdir {
        mode,
        uid: 0,
        gid: 0,
        opaque,
    }
}

fn meta(mode: u32) -> Change {
    Change::Meta {
        mode,
        uid: 0,
        gid: 0,
    }
}

fn head(path: &str, change: &Change) -> HeadChange {
    HeadChange::from_change(path.as_bytes(), change)
}

fn cs(entries: &[(&str, Change)]) -> Changeset {
    Changeset {
        entries: entries
            .iter()
            .map(|(p, c)| (p.as_bytes().to_vec(), c.clone()))
            .collect(),
        ..Changeset::default()
    }
}

fn conflict_paths(d: &GateDecision) -> Vec<String> {
    match d {
        GateDecision::Clean => vec![],
        GateDecision::Conflict { paths } => paths
            .iter()
            .map(|c| String::from_utf8(c.path.clone()).unwrap())
            .collect(),
    }
}

fn gate(captured: &Changeset, head: &[HeadChange]) -> Vec<String> {
    conflict_paths(&check_gate(captured, head))
}

#[test]
fn untouched_on_head_is_clean() {
    let c = cs(&[
        ("a", write(1)),
        ("d", mkdir(0o755, false)),
        ("x", Change::Delete),
    ]);
    assert_eq!(
        check_gate(&c, &[head("b", &write(2)), head("dd", &Change::Delete)]),
        GateDecision::Clean
    );
    assert_eq!(check_gate(&c, &[]), GateDecision::Clean);
}

#[test]
fn same_final_state_on_both_sides_is_clean() {
    let link = Change::Symlink {
        target: b"/t".to_vec(),
        uid: 0,
        gid: 0,
    };
    let fifo = Change::Special {
        kind: FileKind::Fifo,
        mode: 0o600,
        uid: 0,
        gid: 0,
        rdev: 0,
    };
    let c = cs(&[
        ("f", write(1)),
        ("l", link.clone()),
        ("p", fifo.clone()),
        ("gone", Change::Delete),
        ("m", meta(0o700)),
    ]);
    let h = [
        head("f", &write(1)),
        head("l", &link),
        head("p", &fifo),
        head("gone", &Change::Delete),
        head("m", &meta(0o700)),
    ];
    assert_eq!(check_gate(&c, &h), GateDecision::Clean);
}

#[test]
fn different_content_or_metadata_conflicts() {
    let c = cs(&[("f", write(1))]);
    assert_eq!(gate(&c, &[head("f", &write(2))]), ["f"]);
    let other_mode = Change::Write {
        mode: 0o755,
        uid: 0,
        gid: 0,
        size: 1,
        digest: [1; 32],
    };
    let d = check_gate(&c, &[head("f", &other_mode)]);
    let GateDecision::Conflict { paths } = d else {
        panic!("expected conflict")
    };
    assert!(
        paths[0].reason.contains("mode or owner"),
        "{}",
        paths[0].reason
    );

    let l1 = Change::Symlink {
        target: b"a".to_vec(),
        uid: 0,
        gid: 0,
    };
    let l2 = Change::Symlink {
        target: b"b".to_vec(),
        uid: 0,
        gid: 0,
    };
    assert_eq!(gate(&cs(&[("l", l1)]), &[head("l", &l2)]), ["l"]);

    let chr = |rdev| Change::Special {
        kind: FileKind::CharDev,
        mode: 0o600,
        uid: 0,
        gid: 0,
        rdev,
    };
    let fifo = Change::Special {
        kind: FileKind::Fifo,
        mode: 0o600,
        uid: 0,
        gid: 0,
        rdev: 0,
    };
    assert_eq!(
        gate(&cs(&[("n", chr(0x0103))]), &[head("n", &chr(0x0105))]),
        ["n"]
    );
    assert_eq!(gate(&cs(&[("n", fifo)]), &[head("n", &chr(0))]), ["n"]);
}

#[test]
fn kind_changes_conflict() {
    let pairs = [
        (Change::Delete, write(1)),
        (write(1), Change::Delete),
        (write(1), mkdir(0o755, false)),
        (mkdir(0o755, false), mkdir(0o755, true)),
        (meta(0o755), Change::Delete),
        (
            Change::Symlink {
                target: b"x".to_vec(),
                uid: 0,
                gid: 0,
            },
            write(1),
        ),
    ];
    for (mine, theirs) in pairs {
        assert_eq!(
            gate(&cs(&[("p", mine.clone())]), &[head("p", &theirs)]),
            ["p"],
            "{mine:?} vs {theirs:?}"
        );
    }
}

#[test]
fn directory_created_on_both_sides() {
    let c = cs(&[("d", mkdir(0o755, false)), ("d/mine", write(1))]);
    let h = [head("d", &mkdir(0o755, false)), head("d/theirs", &write(2))];
    assert_eq!(check_gate(&c, &h), GateDecision::Clean);
    let h = [head("d", &mkdir(0o700, false))];
    assert_eq!(gate(&c, &h), ["d"]);
    // Mkdir on one side and Meta on the other both leave the same directory.
    assert_eq!(
        check_gate(&c, &[head("d", &meta(0o755))]),
        GateDecision::Clean
    );
}

#[test]
fn session_removed_directory_conflicts_with_head_changes_below() {
    let h = [
        head("d/x", &write(2)),
        head("d/sub/y", &mkdir(0o755, false)),
        head("d/old", &Change::Delete),
    ];
    for (what, change) in [
        ("delete", Change::Delete),
        ("file", write(1)),
        ("opaque", mkdir(0o755, true)),
    ] {
        let c = cs(&[("d", change)]);
        // A deletion below agrees with the removal: d/old is not reported.
        assert_eq!(gate(&c, &h), ["d/sub/y", "d/x"], "{what}");
    }
    // A plain new directory or a metadata change hides nothing.
    assert_eq!(
        check_gate(&cs(&[("d", meta(0o700))]), &h),
        GateDecision::Clean
    );
}

#[test]
fn head_removed_directory_conflicts_with_session_changes_below() {
    let c = cs(&[
        ("d/x", write(1)),
        ("d/sub", mkdir(0o755, false)),
        ("d/old", Change::Delete),
    ]);
    for (what, change) in [
        ("delete", Change::Delete),
        ("file", write(9)),
        ("opaque", mkdir(0o755, true)),
        (
            "symlink",
            Change::Symlink {
                target: b"elsewhere".to_vec(),
                uid: 0,
                gid: 0,
            },
        ),
    ] {
        assert_eq!(gate(&c, &[head("d", &change)]), ["d/sub", "d/x"], "{what}");
    }
}

#[test]
fn sibling_prefixes_are_not_descendants() {
    // "a-b", "a0", "ab/c" sort around "a/" but are not below "a".
    let c = cs(&[("a", Change::Delete)]);
    let h = [
        head("a-b", &write(1)),
        head("a0", &write(1)),
        head("ab/c", &write(1)),
        head("a.x/y", &write(1)),
    ];
    assert_eq!(check_gate(&c, &h), GateDecision::Clean);
    let c = cs(&[("a-b", write(1)), ("a0", write(1)), ("ab/c", write(1))]);
    assert_eq!(
        check_gate(&c, &[head("a", &Change::Delete)]),
        GateDecision::Clean
    );
}

#[test]
fn unchanged_copy_up_must_not_revert_head() {
    let mut c = cs(&[("d/new", write(1))]);
    c.unchanged.insert(b"d".to_vec(), meta(0o755));
    c.unchanged.insert(b"d/touched".to_vec(), write(5));
    // Untouched on head: clean.
    assert_eq!(check_gate(&c, &[head("e", &write(3))]), GateDecision::Clean);
    // Head rewrote the touched file: the layer's copy would revert it.
    assert_eq!(gate(&c, &[head("d/touched", &write(6))]), ["d/touched"]);
    // Head wrote the same content the lease had: nothing reverts.
    assert_eq!(
        check_gate(&c, &[head("d/touched", &write(5))]),
        GateDecision::Clean
    );
    // Head changed the copy-up parent's mode: the layer's copy would revert it.
    assert_eq!(gate(&c, &[head("d", &meta(0o700))]), ["d"]);
    // Head deleted the parent: the layer would bring back d, d/new and d/touched.
    assert_eq!(
        gate(&c, &[head("d", &Change::Delete)]),
        ["d", "d/new", "d/touched"]
    );
}

#[test]
fn newest_head_occurrence_is_the_final_state() {
    let c = cs(&[("f", write(1))]);
    // Newest first: the head ends at content 1, as the session does.
    assert_eq!(
        check_gate(&c, &[head("f", &write(1)), head("f", &write(2))]),
        GateDecision::Clean
    );
    assert_eq!(
        gate(&c, &[head("f", &write(2)), head("f", &write(1))]),
        ["f"]
    );
    // An older removal of the parent still counts even though the head re-created it.
    let c = cs(&[("d/lease_file", write(1))]);
    let h = [head("d", &mkdir(0o755, false)), head("d", &Change::Delete)];
    assert_eq!(gate(&c, &h), ["d/lease_file"]);
}

#[test]
fn whole_changeset_is_rejected_with_exactly_the_conflicting_paths() {
    let c = cs(&[("a", write(1)), ("b", write(1)), ("c", write(1))]);
    let d = check_gate(&c, &[head("b", &write(2))]);
    let GateDecision::Conflict { paths } = d else {
        panic!("expected conflict")
    };
    assert_eq!(paths.len(), 1);
    assert_eq!(paths[0].path, b"b");
    assert_eq!(paths[0].reason, "both sides wrote different content");
}

#[test]
fn head_change_round_trips_through_serde() {
    let changes = [
        write(7),
        Change::Symlink {
            target: b"\xff/t".to_vec(),
            uid: 1,
            gid: 2,
        },
        mkdir(0o1777, true),
        Change::Delete,
        meta(0o700),
        Change::Special {
            kind: FileKind::BlockDev,
            mode: 0o660,
            uid: 0,
            gid: 6,
            rdev: 0x0801,
        },
    ];
    for change in &changes {
        let h = HeadChange::from_change(b"p\xe9", change);
        let back: HeadChange = serde_json::from_str(&serde_json::to_string(&h).unwrap()).unwrap();
        assert_eq!(back, h);
        assert_eq!(resolve_path(change, &back), PathResolution::Clean);
        let c2: Change = serde_json::from_str(&serde_json::to_string(change).unwrap()).unwrap();
        assert_eq!(&c2, change);
    }
    assert_eq!(
        HeadChange::from_change(b"x", &mkdir(0o755, true)).kind,
        HeadChangeKind::Opaque
    );
    assert_eq!(
        HeadChange::from_change(b"x", &mkdir(0o755, false)).kind,
        HeadChangeKind::Mkdir
    );
}

// ---- reference model: the same rules, pairwise, O(n*m) ----

fn strictly_below(dir: &[u8], path: &[u8]) -> bool {
    path.len() > dir.len() && path.starts_with(dir) && path[dir.len()] == b'/'
}

fn naive(captured: &Changeset, heads: &[HeadChange]) -> BTreeSet<Vec<u8>> {
    let mut out = BTreeSet::new();
    let final_of = |p: &[u8]| heads.iter().find(|h| h.path == p);
    let carried = captured.entries.iter().chain(captured.unchanged.iter());
    for (p, c) in carried {
        if let Some(h) = final_of(p) {
            if resolve_path(c, h) != PathResolution::Clean {
                out.insert(p.clone());
            }
        }
    }
    for (d, c) in &captured.entries {
        if matches!(c, Change::Mkdir { opaque: false, .. } | Change::Meta { .. }) {
            continue;
        }
        for h in heads {
            let newest = final_of(&h.path).unwrap();
            if strictly_below(d, &h.path) && newest.kind != HeadChangeKind::Delete {
                out.insert(h.path.clone());
            }
        }
    }
    for h in heads
        .iter()
        .filter(|h| !matches!(h.kind, HeadChangeKind::Mkdir | HeadChangeKind::Meta))
    {
        for (p, c) in &captured.entries {
            if strictly_below(&h.path, p) && *c != Change::Delete {
                out.insert(p.clone());
            }
        }
        for p in captured.unchanged.keys() {
            if strictly_below(&h.path, p) {
                out.insert(p.clone());
            }
        }
    }
    out
}

fn arb_path() -> impl Strategy<Value = Vec<u8>> {
    let comp = prop::sample::select(vec!["a", "b", "a-", "a0", "a.b"]);
    prop::collection::vec(comp, 1..4).prop_map(|c| c.join("/").into_bytes())
}

fn arb_change() -> impl Strategy<Value = Change> {
    prop_oneof![
        (0u8..2).prop_map(write),
        Just(Change::Delete),
        (prop::sample::select(vec![0o755u32, 0o700]), any::<bool>()).prop_map(|(m, o)| mkdir(m, o)),
        prop::sample::select(vec![0o755u32, 0o700]).prop_map(meta),
        prop::sample::select(vec![&b"x"[..], b"y"]).prop_map(|t| Change::Symlink {
            target: t.to_vec(),
            uid: 0,
            gid: 0
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn range_queries_match_the_pairwise_model(
        entries in prop::collection::btree_map(arb_path(), arb_change(), 0..8),
        unchanged in prop::collection::btree_map(arb_path(), (0u8..2).prop_map(write), 0..4),
        heads in prop::collection::vec((arb_path(), arb_change()), 0..8),
    ) {
        let mut captured = Changeset { entries, ..Changeset::default() };
        captured.unchanged = unchanged.into_iter().filter(|(p, _)| !captured.entries.contains_key(p)).collect();
        let heads: Vec<HeadChange> = heads.iter().map(|(p, c)| HeadChange::from_change(p, c)).collect();
        let got: BTreeSet<Vec<u8>> = match check_gate(&captured, &heads) {
            GateDecision::Clean => BTreeSet::new(),
            GateDecision::Conflict { paths } => {
                prop_assert!(!paths.is_empty());
                prop_assert!(paths.windows(2).all(|w| w[0].path < w[1].path), "sorted, unique");
                paths.into_iter().map(|c| c.path).collect()
            }
        };
        prop_assert_eq!(got, naive(&captured, &heads));
    }
}
