#![allow(clippy::unwrap_used)]

use super::*;
use std::collections::{BTreeMap, BTreeSet};

use crate::snapshots::Removed;

fn tmp() -> tempfile::TempDir {
    // /var/tmp is on the root filesystem (ext4 here); /tmp may be tmpfs elsewhere.
    tempfile::Builder::new()
        .prefix("ls-store-")
        .tempdir_in("/var/tmp")
        .unwrap()
}

fn open(dir: &Path) -> Store {
    Store::open(&dir.join("root"), &StoreOptions::default()).unwrap()
}

fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A path-index row of a written file with content `n`.
fn write_entry(path: &[u8], n: u8) -> IndexEntry {
    IndexEntry {
        path: path.to_vec(),
        kind: ChangeKind::Write,
        digest: Some([n; 32]),
        mode: Some(0o644),
        uid: Some(0),
        gid: Some(0),
        xattrs: None,
    }
}

fn query(exact: &[&str], below: &[&str]) -> PathQuery {
    PathQuery {
        exact: exact.iter().map(|p| p.as_bytes().to_vec()).collect(),
        below: below.iter().map(|p| p.as_bytes().to_vec()).collect(),
    }
}

/// Publish session `sid` on its branch head now, with path index `index`.
fn publish(s: &Store, sid: SessionId, index: &[IndexEntry]) -> Published {
    let paths: Vec<PathRecord> = index
        .iter()
        .map(|e| PathRecord {
            path: e.path.clone(),
            status: PathStatus::Clean,
            reason: "untouched on head".into(),
        })
        .collect();
    let staged = s.stage_publish(sid, index, &paths).unwrap();
    let head = s.head_view(sid).unwrap().manifest;
    s.commit_publish(sid, staged, head, CommitRecord::default())
        .unwrap()
}

/// Prepares container session `default/<n>/<name>` on the image `top` (its
/// stack's `main`); returns its id.
fn container_session(s: &Store, top: &str, n: usize, name: &str) -> SessionId {
    s.prepare(&format!("default/{n}/{name}"), top, BTreeMap::new(), false)
        .unwrap();
    s.find_session("default", name).unwrap().unwrap().id
}

/// Unpack an image of `chains` (bottom first) in `ns`; returns the top's key.
fn unpack_chain(store: &Store, ns: &str, chains: &[&str]) -> String {
    let mut parent = String::new();
    for (i, c) in chains.iter().enumerate() {
        let ex = format!("{ns}/{}/extract-{i} {c}", 100 + 2 * i);
        store
            .prepare(&ex, &parent, labels(&[(SNAPSHOT_REF_LABEL, c)]), false)
            .unwrap();
        let name = format!("{ns}/{}/{c}", 101 + 2 * i);
        store.commit(&name, &ex, BTreeMap::new()).unwrap();
        parent = name;
    }
    parent
}

/// Unpack a two-layer image the way containerd's unpacker does.
fn unpack(store: &Store, ns: &str) -> String {
    let l1 = format!("{ns}/1/sha256:aaa");
    let l2 = format!("{ns}/3/sha256:bbb");
    store
        .prepare(
            &format!("{ns}/2/extract-1 sha256:aaa"),
            "",
            labels(&[(SNAPSHOT_REF_LABEL, "sha256:aaa")]),
            false,
        )
        .unwrap();
    store
        .commit(
            &l1,
            &format!("{ns}/2/extract-1 sha256:aaa"),
            BTreeMap::new(),
        )
        .unwrap();
    let (_, spec) = store
        .prepare(
            &format!("{ns}/4/extract-2 sha256:bbb"),
            &l1,
            labels(&[(SNAPSHOT_REF_LABEL, "sha256:bbb")]),
            false,
        )
        .unwrap();
    match spec {
        MountSpec::Overlay {
            lowers,
            upper: Some(_),
        } => assert_eq!(lowers.len(), 1),
        other => panic!("extraction on a parent must be an overlay with an upper: {other:?}"),
    }
    store
        .commit(
            &l2,
            &format!("{ns}/4/extract-2 sha256:bbb"),
            BTreeMap::new(),
        )
        .unwrap();
    l2
}

#[test]
fn unpack_then_session_mounts_image_layers_newest_first() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    let (_, spec) = s
        .prepare("default/5/c1", &top, BTreeMap::new(), false)
        .unwrap();
    let MountSpec::Overlay {
        lowers,
        upper: Some((u, _)),
    } = spec
    else {
        panic!("session must be an overlay")
    };
    assert_eq!(lowers, vec![s.layer_path(2), s.layer_path(1)]);
    let sess = s.find_session("default", "c1").unwrap().unwrap();
    assert_eq!(u, sess.upper);
    assert_eq!(sess.stack, "default/sha256:bbb");
    assert_eq!(sess.branch, "main");
    assert_eq!(sess.state, SessionState::Active);
    // Published layers are never listed; everything containerd created is.
    let keys: Vec<String> = s.list().unwrap().into_iter().map(|i| i.key).collect();
    assert_eq!(
        keys,
        vec![
            "default/1/sha256:aaa",
            "default/3/sha256:bbb",
            "default/5/c1"
        ]
    );
}

#[test]
fn already_exists_and_not_found_follow_errdefs() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "ns");
    assert!(s.prepare("ns/5/c", &top, BTreeMap::new(), false).is_ok());
    assert!(matches!(
        s.prepare("ns/5/c", &top, BTreeMap::new(), false),
        Err(StoreError::SnapshotExists(_))
    ));
    assert!(matches!(
        s.prepare("ns/6/d", "ns/9/nope", BTreeMap::new(), false),
        Err(StoreError::SnapshotNotFound(_))
    ));
    assert!(matches!(
        s.stat("nope"),
        Err(StoreError::SnapshotNotFound(_))
    ));
    // Re-committing an existing name.
    s.prepare("ns/7/x", "", BTreeMap::new(), false).unwrap();
    assert!(matches!(
        s.commit(&top, "ns/7/x", BTreeMap::new()),
        Err(StoreError::SnapshotExists(_))
    ));
    // A parent with children cannot be removed.
    assert!(matches!(
        s.remove(&top),
        Err(StoreError::FailedPrecondition(_))
    ));
}

#[test]
fn publish_prepends_layer_and_next_session_sees_it() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/c1", &top, BTreeMap::new(), false)
        .unwrap();
    let sess = s.find_session("default", "c1").unwrap().unwrap();
    std::fs::write(sess.upper.join("a.txt"), b"hello").unwrap();
    let p = publish(&s, sess.id, &[write_entry(b"a.txt", 1)]);
    assert_eq!(
        std::fs::read(s.layer_path(p.layer).join("a.txt")).unwrap(),
        b"hello"
    );
    let after = s.session(sess.id).unwrap();
    assert_eq!(after.state, SessionState::Published);
    assert_eq!(after.outcome.as_ref().unwrap().kind, OutcomeKind::Committed);
    assert_eq!(after.lease_manifest, None);
    assert_eq!(
        std::fs::read_dir(&after.upper).unwrap().count(),
        0,
        "upper must be fresh and empty"
    );

    // A new session leases the new head: the published layer sits above the image.
    let (_, spec) = s
        .prepare("default/6/c2", &top, BTreeMap::new(), false)
        .unwrap();
    let MountSpec::Overlay { lowers, .. } = spec else {
        panic!()
    };
    assert_eq!(
        lowers,
        vec![s.layer_path(p.layer), s.layer_path(2), s.layer_path(1)]
    );
    // Remounting the first session starts a new run on the new head.
    let MountSpec::Overlay { lowers, .. } = s.mounts("default/5/c1").unwrap() else {
        panic!()
    };
    assert_eq!(lowers[0], s.layer_path(p.layer));
    let again = s.session(sess.id).unwrap();
    assert_eq!(
        (again.state, again.outcome, again.run),
        (SessionState::Active, None, 2)
    );

    let log = s.log("default/sha256:bbb", "main").unwrap();
    assert_eq!(log.len(), 1);
    assert_eq!(log[0].layer, p.layer);
    assert_eq!(log[0].kind, LayerKind::Published);
    assert_eq!(
        log[0].owner,
        Some(Owner::Container {
            namespace: "default".into(),
            id: "c1".into()
        })
    );
    assert_eq!(log[0].paths, 1);
}

#[test]
fn changes_between_lists_what_was_published_since_the_lease_at_the_asked_paths() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    for (i, c) in ["a", "b", "c"].iter().enumerate() {
        s.prepare(
            &format!("default/{}/{c}", 5 + i),
            &top,
            BTreeMap::new(),
            false,
        )
        .unwrap();
    }
    let a = s.find_session("default", "a").unwrap().unwrap();
    let b = s.find_session("default", "b").unwrap().unwrap();
    let c = s.find_session("default", "c").unwrap().unwrap();
    let lease_b = s.publish_context(b.id).unwrap().lease_manifest;
    let first = publish(
        &s,
        a.id,
        &[write_entry(b"etc/x", 1), write_entry(b"var/z", 9)],
    );
    let q = query(&["etc/x", "etc"], &[]);
    let head = s.head_view(b.id).unwrap().manifest;
    let got = s.changes_between(lease_b, head, &q).unwrap();
    assert_eq!(
        got,
        vec![(first.layer, vec![write_entry(b"etc/x", 1)])],
        "var/z was not asked"
    );
    // A second publish: its layer comes first, each layer keeps its own entries;
    // at `etc/x` only the newest row (it hides below the path itself, so no older
    // one counts for the gate).
    let second = publish(
        &s,
        c.id,
        &[write_entry(b"etc/x", 2), write_entry(b"etc/y/deep", 3)],
    );
    let head = s.head_view(b.id).unwrap().manifest;
    let got = s
        .changes_between(lease_b, head, &query(&["etc/x"], &["etc"]))
        .unwrap();
    assert_eq!(
        got,
        vec![(
            second.layer,
            vec![write_entry(b"etc/x", 2), write_entry(b"etc/y/deep", 3)]
        ),]
    );
    // Between the first head and now: only the second layer.
    let got = s
        .changes_between(first.manifest, head, &query(&["etc/x"], &[]))
        .unwrap();
    assert_eq!(got, vec![(second.layer, vec![write_entry(b"etc/x", 2)])]);
    assert!(s.changes_between(head, head, &q).unwrap().is_empty());
    // Committing against a stale head is refused and keeps the upper.
    std::fs::write(b.upper.join("f"), b"1").unwrap();
    let staged = s.stage_publish(b.id, &[], &[]).unwrap();
    let err = s
        .commit_publish(b.id, staged, lease_b, CommitRecord::default())
        .unwrap_err();
    assert!(matches!(err, StoreError::HeadMoved { .. }), "{err}");
    assert_eq!(err.kind(), ErrorKind::Conflict);
    assert!(b.upper.join("f").exists());
    s.abandon_staged(staged).unwrap();
    assert_eq!(s.layer_index(staged.layer).unwrap(), vec![]);
}

fn dir_entry(path: &str, kind: ChangeKind, mode: u32) -> IndexEntry {
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
fn changes_between_keeps_per_path_the_newest_and_the_newest_hiding_row_in_manifest_order() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    let n = 8;
    let mut ids = Vec::new();
    for i in 0..=n {
        ids.push(container_session(&s, &top, 10 + i, &format!("c{i}")));
    }
    let reader = ids[n];
    let lease = s.publish_context(reader).unwrap().lease_manifest;
    // Layers 0..4 each create `shared` (as N sessions making files in one
    // directory do), layer 2 deleted it first (a hiding row), layer 5 changes its
    // mode: the head's final state is layer 5's row, the newest hiding one layer 2's.
    let mut layers = Vec::new();
    for (i, &sid) in ids.iter().enumerate().take(6) {
        let shared = match i {
            2 => dir_entry("shared", ChangeKind::Opaque, 0o755),
            5 => dir_entry("shared", ChangeKind::Meta, 0o700),
            _ => dir_entry("shared", ChangeKind::Mkdir, 0o755),
        };
        let file = write_entry(format!("shared/f{i}").as_bytes(), i as u8);
        layers.push(publish(&s, sid, &[shared, file]));
    }
    // Two publishes staged before either commits: the one staged first (lower
    // layer id) commits last, so it is the newer layer of the manifest.
    let first = s
        .stage_publish(
            ids[6],
            &[dir_entry("shared", ChangeKind::Mkdir, 0o711)],
            &[],
        )
        .unwrap();
    let second = s
        .stage_publish(
            ids[7],
            &[dir_entry("shared", ChangeKind::Mkdir, 0o722)],
            &[],
        )
        .unwrap();
    assert!(first.layer < second.layer);
    let head = s.head_view(ids[7]).unwrap().manifest;
    let head = s
        .commit_publish(ids[7], second, head, CommitRecord::default())
        .unwrap()
        .manifest;
    let head = s
        .commit_publish(ids[6], first, head, CommitRecord::default())
        .unwrap()
        .manifest;
    let got = s
        .changes_between(lease, head, &query(&["shared"], &[]))
        .unwrap();
    assert_eq!(
        got,
        vec![
            (
                first.layer,
                vec![dir_entry("shared", ChangeKind::Mkdir, 0o711)]
            ),
            (
                layers[2].layer,
                vec![dir_entry("shared", ChangeKind::Opaque, 0o755)]
            ),
        ],
        "the newest by manifest position (not by id) and the newest hiding row"
    );
    // A subtree query reduces the same way, per path below.
    let got = s
        .changes_between(lease, head, &query(&["shared"], &["shared"]))
        .unwrap();
    let rows: usize = got.iter().map(|(_, es)| es.len()).sum();
    assert_eq!(rows, 2 + 6, "shared twice, each file once: {got:?}");
    // Since a head that already had the hiding row: only the newest.
    let got = s
        .changes_between(layers[3].manifest, head, &query(&["shared"], &[]))
        .unwrap();
    assert_eq!(
        got,
        vec![(
            first.layer,
            vec![dir_entry("shared", ChangeKind::Mkdir, 0o711)]
        )]
    );
}

#[test]
fn conflict_keeps_upper_and_lease_even_after_remove() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/c", &top, BTreeMap::new(), false)
        .unwrap();
    let c = s.find_session("default", "c").unwrap().unwrap();
    std::fs::write(c.upper.join("mine"), b"1").unwrap();
    s.record_outcome(
        c.id,
        OutcomeRecord {
            kind: OutcomeKind::Conflict,
            message: None,
            paths: vec![PathRecord {
                path: b"mine".to_vec(),
                status: PathStatus::Conflict,
                reason: "changed on both sides".into(),
            }],
            timings: None,
            interrupted_by: None,
        },
        None,
    )
    .unwrap();
    let after = s.session(c.id).unwrap();
    assert_eq!(after.state, SessionState::Conflict);
    assert!(after.lease_manifest.is_some());
    assert_eq!(s.remove("default/5/c").unwrap(), Removed::Session(c.id));
    s.complete_release(c.id).unwrap();
    assert!(
        c.upper.join("mine").exists(),
        "a conflicted upper is kept for inspection"
    );
    drop(s);
    // ... and survives the startup sweep.
    let s = open(d.path());
    assert!(c.upper.join("mine").exists());
    assert!(s.session(c.id).unwrap().released);
}

#[test]
fn branch_label_forks_main_and_invalid_names_are_refused() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/m", &top, BTreeMap::new(), false)
        .unwrap();
    let m = s.find_session("default", "m").unwrap().unwrap();
    std::fs::write(m.upper.join("f"), b"1").unwrap();
    let p = publish(&s, m.id, &[write_entry(b"f", 1)]);
    let (_, spec) = s
        .prepare(
            "default/6/x",
            &top,
            labels(&[(SNAPSHOT_BRANCH_LABEL, "exp/1")]),
            false,
        )
        .unwrap();
    let MountSpec::Overlay { lowers, .. } = spec else {
        panic!()
    };
    assert_eq!(
        lowers[0],
        s.layer_path(p.layer),
        "a new branch forks main's head"
    );
    assert_eq!(
        s.find_session("default", "x").unwrap().unwrap().branch,
        "exp/1"
    );
    let err = s
        .prepare(
            "default/7/y",
            &top,
            labels(&[(SNAPSHOT_BRANCH_LABEL, "bad name")]),
            false,
        )
        .unwrap_err();
    assert!(
        matches!(err, StoreError::InvalidArgument(ref m) if m.contains("invalid branch name")),
        "{err}"
    );
    // Names git would refuse as a ref are refused wherever a user names a
    // branch (a snapshot label, `branch create`); `feature/x` is fine.
    for bad in [
        "../../etc",
        "..",
        "a..b",
        ".hidden",
        "feature/.x",
        "x.lock",
        "feature/x.lock/y",
        "a//b",
        "feature/",
        "/abs",
        "-x",
        "x.",
        "a b",
        "a\tb",
        "a~1",
        "a^b",
        "a:b",
        "a?b",
        "a*b",
        "a[b",
        "a\\b",
        "a@b",
        "",
    ] {
        let e = crate::validate_branch(bad).unwrap_err();
        assert!(e.starts_with("invalid branch name"), "{bad:?}: {e}");
        let e = s.create_branch(&m.stack, bad, "main", None).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad:?}: {e}");
    }
    for good in ["main", "feature/x", "exp-1", "v1.2", "a_b/c.d/e"] {
        crate::validate_branch(good).unwrap_or_else(|e| panic!("{good:?}: {e}"));
    }
    s.create_branch(&m.stack, "feature/x", "main", None)
        .unwrap();
    // The engine's own working branches (`.graph/<graph>/<op>`) are not a
    // user's to name, but sessions of the engine lease them.
    let head = s.branch_head(&m.stack, "main").unwrap();
    let work = format!("{}g/merge-1", crate::INTERNAL_BRANCH_PREFIX);
    assert!(crate::validate_branch(&work).is_err());
    s.create_branch_at(&m.stack, &work, head).unwrap();
    let (w, _, _) = s
        .create_session(
            &Owner::Operation {
                id: "merge-1".into(),
            },
            &m.stack,
            &LeaseTarget::Manifest {
                manifest: head,
                branch: work.clone(),
            },
            None,
        )
        .unwrap();
    assert_eq!(w.branch, work);
}

#[test]
fn node_label_makes_the_container_session_an_attempt_of_the_node() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/m", &top, BTreeMap::new(), false)
        .unwrap();
    let m = s.find_session("default", "m").unwrap().unwrap();
    let stack = m.stack.clone();
    let (_, root) = s.create_group("g", &stack, "main", None).unwrap();
    // main moves on after the graph was made: the attempt still sees the root.
    std::fs::write(m.upper.join("f"), b"1").unwrap();
    let p = publish(&s, m.id, &[write_entry(b"f", 1)]);
    let (_, spec) = s
        .prepare(
            "default/6/x",
            &top,
            labels(&[(SNAPSHOT_NODE_LABEL, &root.id)]),
            false,
        )
        .unwrap();
    let MountSpec::Overlay { lowers, .. } = spec else {
        panic!()
    };
    assert!(
        !lowers.contains(&s.layer_path(p.layer)),
        "the attempt leases the node's root, not main's head"
    );
    let x = s.find_session("default", "x").unwrap().unwrap();
    assert_eq!(x.lease_manifest, Some(root.manifest));
    let a = s.attempt_of_session(x.id).unwrap().expect("an attempt");
    assert_eq!(a.node, root.id);
    let err = s
        .prepare(
            "default/7/y",
            &top,
            labels(&[(SNAPSHOT_NODE_LABEL, "no-such-node")]),
            false,
        )
        .unwrap_err();
    assert!(err.to_string().contains("no-such-node"), "{err}");
    assert!(
        s.find_session("default", "y").unwrap().is_none(),
        "a refused Prepare leaves no session"
    );
}

#[test]
fn sweep_removes_dirs_without_rows_and_keeps_the_rest() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/c", &top, BTreeMap::new(), false)
        .unwrap();
    let root = s.root().to_path_buf();
    std::fs::create_dir(root.join("l/999")).unwrap();
    std::fs::create_dir(root.join("staging/half")).unwrap();
    drop(s);
    let s = open(d.path());
    assert!(!root.join("l/999").exists());
    assert!(!root.join("staging/half").exists());
    assert!(s.layer_path(1).exists() && s.layer_path(2).exists());
    assert!(s
        .find_session("default", "c")
        .unwrap()
        .unwrap()
        .upper
        .exists());
}

#[test]
fn remove_session_releases_it_and_deletes_its_dirs() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/c", &top, BTreeMap::new(), false)
        .unwrap();
    let c = s.find_session("default", "c").unwrap().unwrap();
    assert_eq!(s.remove("default/5/c").unwrap(), Removed::Session(c.id));
    // Remove never waits: the session is released, its directories wait for
    // the engine to end its run.
    assert!(s.session_path(c.id).exists());
    assert_eq!(s.pending_releases().unwrap(), vec![c.id]);
    s.complete_release(c.id).unwrap();
    assert!(!s.session_path(c.id).exists());
    let after = s.session(c.id).unwrap();
    assert!(after.released && !after.remove_pending);
    assert_eq!(after.lease_manifest, None);
    // The image snapshots can go, in containerd's GC order; the layers stay:
    // the stack recorded them as its base (history stays reachable).
    s.remove(&top).unwrap();
    s.remove("default/1/sha256:aaa").unwrap();
    assert!(s.list().unwrap().is_empty());
    assert!(s.layer_path(1).exists() && s.layer_path(2).exists());
    let stacks = s.stacks().unwrap();
    assert_eq!(stacks[0].base_layers, vec![2, 1]);
    // An image no session used is not history: its layers go with its snapshots.
    let other = unpack_chain(&s, "default", &["sha256:ccc"]);
    let dir = s.layer_path(3);
    assert!(dir.exists());
    s.remove(&other).unwrap();
    assert!(!dir.exists());
}

#[test]
fn a_container_whose_stack_was_force_removed_is_refused_by_name_not_corrupt() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "nc");
    s.prepare("nc/14/k1", &top, BTreeMap::new(), false).unwrap();
    let stack = s.stacks().unwrap()[0].id.clone();
    s.remove_stack(&stack, true).unwrap();
    // What containerd does next with the container's snapshot: Mounts (a
    // restart), Commit, Usage, Stat, and Remove (`ctr containers rm`).
    for e in [
        s.mounts("nc/14/k1").unwrap_err(),
        s.commit("nc/15/img", "nc/14/k1", BTreeMap::new())
            .unwrap_err(),
    ] {
        assert_eq!(e.kind(), ErrorKind::FailedPrecondition, "{e}");
        let m = e.to_string();
        assert!(
            m.contains("snapshot nc/14/k1")
                && m.contains("`layerstack stack rm --force`")
                && m.contains("`ctr -n nc containers rm k1`")
                && !m.contains("corrupt"),
            "{m}"
        );
    }
    assert_eq!(s.usage("nc/14/k1").unwrap(), (0, 0));
    assert!(s.stat("nc/14/k1").is_ok());
    assert_eq!(s.remove("nc/14/k1").unwrap(), Removed::Plain);
    assert!(s.stat("nc/14/k1").is_err());
}

#[test]
fn a_branch_forks_at_a_base_layer_onto_the_image_alone() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/c", &top, BTreeMap::new(), false)
        .unwrap();
    let c = s.find_session("default", "c").unwrap().unwrap();
    publish(&s, c.id, &[write_entry(b"f", 1)]);
    let stack = c.stack.clone();
    let base = s.base_layers(&stack).unwrap();
    assert_eq!(base, [2, 1]);
    // Every base layer names the image alone: the empty root manifest.
    for at in &base {
        let b = s
            .create_branch(&stack, &format!("pristine-{at}"), "main", Some(*at))
            .unwrap();
        assert_eq!((b.depth, s.manifest(b.head).unwrap()), (0, vec![]));
    }
    let e = s
        .create_branch(&stack, "nowhere", "main", Some(999))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains("`--at base`"), "{e}");
}

#[test]
fn committing_a_session_freezes_what_it_saw() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "moby");
    // Docker's init layer: Prepare(<id>-init-key, chainID), Commit(<id>-init), Prepare(<id>, <id>-init).
    s.prepare("moby/5/c-init-key", &top, BTreeMap::new(), false)
        .unwrap();
    let init = s.find_session("moby", "c-init-key").unwrap().unwrap();
    std::fs::write(init.upper.join("hosts"), b"x").unwrap();
    s.commit("moby/6/c-init", "moby/5/c-init-key", BTreeMap::new())
        .unwrap();
    let (_, spec) = s
        .prepare("moby/7/c", "moby/6/c-init", BTreeMap::new(), false)
        .unwrap();
    let MountSpec::Overlay { lowers, .. } = spec else {
        panic!()
    };
    assert_eq!(lowers.len(), 3);
    assert_eq!(
        lowers[0], init.upper,
        "per-container committed layer sits on top"
    );
    let c = s.find_session("moby", "c").unwrap().unwrap();
    assert_eq!(c.stack, "moby/sha256:bbb");
    // A view of the committed init snapshot shows its upper above the image.
    let (_, spec) = s
        .prepare("moby/8/v", "moby/6/c-init", BTreeMap::new(), true)
        .unwrap();
    assert_eq!(
        spec,
        MountSpec::Overlay {
            lowers: vec![init.upper.clone(), s.layer_path(2), s.layer_path(1)],
            upper: None
        }
    );
}

#[test]
fn labels_update_by_fieldpath() {
    let d = tmp();
    let s = open(d.path());
    s.prepare("n/1/k", "", labels(&[("a", "1"), ("b", "2")]), false)
        .unwrap();
    let info = s
        .update_labels(
            "n/1/k",
            labels(&[("a", "9")]),
            &["labels.a".into(), "labels.b".into()],
        )
        .unwrap();
    assert_eq!(info.labels, labels(&[("a", "9")]));
    let err = s
        .update_labels("n/1/k", BTreeMap::new(), &["kind".into()])
        .unwrap_err();
    assert!(matches!(err, StoreError::InvalidArgument(_)));
}

#[test]
fn layers_and_the_database_are_reached_through_the_daemon_only() {
    use std::os::unix::fs::PermissionsExt;
    let d = tmp();
    let mode = |p: &str| {
        std::fs::metadata(d.path().join(p))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777
    };
    drop(open(d.path()));
    assert_eq!((mode("root"), mode("root/l")), (0o700, 0o700));
    // A store made when `l` was 0711 and the root 0755: closed to others at
    // the next open.
    for (p, m) in [("root/l", 0o711), ("root", 0o755)] {
        std::fs::set_permissions(d.path().join(p), std::fs::Permissions::from_mode(m)).unwrap();
    }
    drop(open(d.path()));
    assert_eq!((mode("root"), mode("root/l")), (0o700, 0o700));
}

#[test]
fn other_format_version_is_refused() {
    let d = tmp();
    drop(open(d.path()));
    let db = rusqlite::Connection::open(d.path().join("root/store.db")).unwrap();
    db.execute(
        "UPDATE meta SET value = '99' WHERE key = 'format_version'",
        [],
    )
    .unwrap();
    drop(db);
    let err = Store::open(&d.path().join("root"), &StoreOptions::default())
        .err()
        .unwrap();
    assert!(matches!(err, OpenError::Version { found: 99, .. }), "{err}");
    // A newer store: run the newer build; nothing suggests removing it.
    let msg = err.to_string();
    assert!(
        msg.contains("written by a newer LayerStack") && !msg.contains("rm -rf"),
        "{msg}"
    );
    // An older one than any migration reaches: a fresh root.
    let db = rusqlite::Connection::open(d.path().join("root/store.db")).unwrap();
    db.execute(
        "UPDATE meta SET value = '2' WHERE key = 'format_version'",
        [],
    )
    .unwrap();
    drop(db);
    let err = Store::open(&d.path().join("root"), &StoreOptions::default())
        .err()
        .unwrap();
    let msg = err.to_string();
    assert!(matches!(err, OpenError::Version { found: 2, .. }), "{msg}");
    assert!(msg.contains("start a fresh store root"), "{msg}");
}

/// The store's format version as recorded in `meta`.
fn format_version(s: &Store) -> String {
    s.db.read(|c| {
        Ok(c.query_row(
            "SELECT value FROM meta WHERE key = 'format_version'",
            [],
            |r| r.get(0),
        )?)
    })
    .unwrap()
}

/// Turns a format 10 store into what format 9 was: no sessions.daemon_owned,
/// no publishes.interrupted_by, attempts without the status `interrupted`
/// (its CHECK cannot be altered: the table is rebuilt, its sequence kept).
pub(crate) const TO_FORMAT_9: &str = "PRAGMA foreign_keys = OFF;
     ALTER TABLE rollout_attempts DROP COLUMN worker;
     ALTER TABLE rollout_attempts DROP COLUMN end_keep;
     ALTER TABLE sessions DROP COLUMN daemon_owned;
     ALTER TABLE publishes DROP COLUMN interrupted_by;
     CREATE TABLE a9 (
         id INTEGER PRIMARY KEY AUTOINCREMENT, node TEXT NOT NULL REFERENCES graph_nodes(id),
         session_id INTEGER,
         status TEXT NOT NULL CHECK (status IN ('running', 'checkpointed', 'failed', 'abandoned')),
         idempotency_key TEXT UNIQUE, result_node TEXT, message TEXT,
         created_ns INTEGER NOT NULL, ended_ns INTEGER);
     INSERT INTO a9 SELECT id, node, session_id, status, idempotency_key, result_node, message, created_ns, ended_ns FROM graph_attempts;
     DELETE FROM sqlite_sequence WHERE name = 'a9';
     INSERT INTO sqlite_sequence(name, seq) SELECT 'a9', seq FROM sqlite_sequence WHERE name = 'graph_attempts';
     DROP TABLE graph_attempts; ALTER TABLE a9 RENAME TO graph_attempts;
     CREATE INDEX graph_attempts_node ON graph_attempts(node);
     CREATE INDEX graph_attempts_session ON graph_attempts(session_id);
     UPDATE meta SET value = '9' WHERE key = 'format_version';";

#[test]
fn a_format_9_store_is_migrated_and_keeps_its_attempts_and_their_ids() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/m", &top, BTreeMap::new(), false)
        .unwrap();
    let stack = s.find_session("default", "m").unwrap().unwrap().stack;
    let (_, root) = s.create_group("g", &stack, "main", None).unwrap();
    let owner = Owner::Sandbox { name: "a".into() };
    let (a1, s1, _, _) = s.start_attempt(&root.id, &owner, None).unwrap();
    let (a2, _, _, _) = s.start_attempt(&root.id, &owner, None).unwrap();
    s.end_attempt(a2.id, AttemptStatus::Failed, "task failed")
        .unwrap();
    // The newest attempt is gone: its id must not be handed out again.
    s.db.write(|tx| Ok(tx.execute("DELETE FROM graph_attempts WHERE id = ?1", [a2.id])?))
        .unwrap();
    drop(s);
    let db = rusqlite::Connection::open(d.path().join("root/store.db")).unwrap();
    db.execute_batch(TO_FORMAT_9).unwrap();
    let old = db.execute(
        "UPDATE graph_attempts SET status = 'interrupted' WHERE id = ?1",
        [a1.id],
    );
    assert!(old.is_err(), "format 9 knew no status interrupted");
    drop(db);
    let s = open(d.path());
    assert!(!s.session(s1.id).unwrap().daemon_owned);
    assert_eq!(s.attempt(a1.id).unwrap().status, AttemptStatus::Running);
    s.end_attempt(a1.id, AttemptStatus::Interrupted, "daemon restart")
        .unwrap();
    assert_eq!(s.attempt(a1.id).unwrap().status, AttemptStatus::Interrupted);
    let (a3, s3, _, _) = s.start_attempt(&root.id, &owner, None).unwrap();
    assert!(a3.id > a2.id, "attempt id {} handed out again", a3.id);
    // Interrupted outcomes record their interruption.
    let rec = OutcomeRecord::interrupted(Interruption::DaemonRestart, "daemon restarted");
    s.record_outcome(s3.id, rec, None).unwrap();
    let o = s.session(s3.id).unwrap().outcome.unwrap();
    assert_eq!(
        (o.kind, o.interrupted_by),
        (OutcomeKind::Interrupted, Some(Interruption::DaemonRestart))
    );
}

/// Turns a current store's `sessions` back into format 11's (no owner kind
/// `wasi`), as an older build left it.
const TO_FORMAT_11: &str = "
     ALTER TABLE sessions DROP COLUMN id_map;
     ALTER TABLE rollout_attempts DROP COLUMN worker;
     ALTER TABLE rollout_attempts DROP COLUMN end_keep;
     CREATE TABLE sessions_old (
        id              INTEGER PRIMARY KEY AUTOINCREMENT,
        owner_kind      TEXT NOT NULL CHECK (owner_kind IN ('container', 'sandbox', 'operation')),
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
     INSERT INTO sessions_old SELECT * FROM sessions;
     DELETE FROM sqlite_sequence WHERE name = 'sessions_old';
     INSERT INTO sqlite_sequence(name, seq) SELECT 'sessions_old', seq FROM sqlite_sequence WHERE name = 'sessions';
     DROP TABLE sessions;
     ALTER TABLE sessions_old RENAME TO sessions;
     CREATE INDEX sessions_owner ON sessions(owner_kind, namespace, owner);
     UPDATE meta SET value = '11' WHERE key = 'format_version';";

#[test]
fn a_format_11_store_is_migrated_and_takes_wasi_sessions_without_reusing_ids() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/m", &top, BTreeMap::new(), false)
        .unwrap();
    let stack = s.find_session("default", "m").unwrap().unwrap().stack;
    let main = LeaseTarget::Branch("main".into());
    let opts = SessionOptions::default();
    let (a, _, _) = s
        .create_session_with(
            &Owner::Sandbox { name: "a".into() },
            &stack,
            &main,
            Some("k-a"),
            &opts,
        )
        .unwrap();
    let (b, _, _) = s
        .create_session_with(
            &Owner::Sandbox { name: "b".into() },
            &stack,
            &main,
            None,
            &opts,
        )
        .unwrap();
    // The newest session row is gone: its id must not be handed out again.
    s.db.write(|tx| Ok(tx.execute("DELETE FROM sessions WHERE id = ?1", [b.id])?))
        .unwrap();
    drop(s);
    let db = rusqlite::Connection::open(d.path().join("root/store.db")).unwrap();
    db.execute_batch("PRAGMA foreign_keys = OFF;").unwrap();
    db.execute_batch(TO_FORMAT_11).unwrap();
    let old = db.execute(
        "UPDATE sessions SET owner_kind = 'wasi' WHERE id = ?1",
        [a.id],
    );
    assert!(old.is_err(), "format 11 knew no owner kind wasi");
    drop(db);
    let s = open(d.path());
    let kept = s.session(a.id).unwrap();
    assert_eq!(kept.owner, Owner::Sandbox { name: "a".into() });
    let (again, _, created) = s
        .create_session_with(
            &Owner::Sandbox { name: "a".into() },
            &stack,
            &main,
            Some("k-a"),
            &opts,
        )
        .unwrap();
    assert_eq!(
        (again.id, created),
        (a.id, false),
        "the idempotency key survives"
    );
    let (w, _, _) = s
        .create_session_with(
            &Owner::Wasi { name: "w".into() },
            &stack,
            &main,
            None,
            &opts,
        )
        .unwrap();
    assert!(w.id > b.id, "session id {} handed out again", w.id);
    assert_eq!(
        s.session(w.id).unwrap().owner,
        Owner::Wasi { name: "w".into() }
    );
    assert_eq!(s.session(w.id).unwrap().owner.kind_str(), "wasi");
}

#[test]
fn an_interrupted_outcome_names_its_interruption_and_keeps_the_upper() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/m", &top, BTreeMap::new(), false)
        .unwrap();
    let stack = s.find_session("default", "m").unwrap().unwrap().stack;
    let opts = SessionOptions {
        daemon_owned: true,
        ..Default::default()
    };
    let (x, _, _) = s
        .create_session_with(
            &Owner::Sandbox { name: "x".into() },
            &stack,
            &LeaseTarget::Branch("main".into()),
            None,
            &opts,
        )
        .unwrap();
    assert!(x.daemon_owned);
    std::fs::write(x.upper.join("half-done"), b"1").unwrap();
    let err = s
        .record_outcome(
            x.id,
            OutcomeRecord::new(OutcomeKind::Interrupted, "?"),
            None,
        )
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let mut bad = OutcomeRecord::new(OutcomeKind::Failed, "?");
    bad.interrupted_by = Some(Interruption::InitGone);
    assert!(s.record_outcome(x.id, bad, None).is_err());
    s.record_outcome(
        x.id,
        OutcomeRecord::interrupted(Interruption::InitGone, "init died"),
        None,
    )
    .unwrap();
    let after = s.session(x.id).unwrap();
    let o = after.outcome.clone().unwrap();
    assert_eq!(o.interrupted_by, Some(Interruption::InitGone));
    assert!(o.kind.is_retryable());
    assert!(after.lease_manifest.is_some(), "the lease is kept");
    assert!(x.upper.join("half-done").exists(), "the upper is kept");
}

#[test]
fn a_format_4_store_is_migrated_at_open_and_keeps_its_outcomes() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/c1", &top, BTreeMap::new(), false)
        .unwrap();
    let sess = s.find_session("default", "c1").unwrap().unwrap();
    std::fs::write(sess.upper.join("a.txt"), b"hello").unwrap();
    let p = publish(&s, sess.id, &[write_entry(b"a.txt", 1)]);
    drop(s);
    // What format 4 was: no capture_bytes column, no index of hiding rows, no
    // manifests.rest (a column in a foreign key cannot be dropped: the table
    // is rebuilt without it), no sessions.ignore_mtime, nothing of format 10.
    let db = rusqlite::Connection::open(d.path().join("root/store.db")).unwrap();
    db.execute_batch(TO_FORMAT_9).unwrap();
    db.execute_batch(
        "ALTER TABLE publishes DROP COLUMN capture_bytes; DROP INDEX layer_paths_hiding;
         PRAGMA foreign_keys = OFF;
         CREATE TABLE m4 (id INTEGER PRIMARY KEY, stack TEXT NOT NULL, parent INTEGER, layer_id INTEGER, depth INTEGER NOT NULL, created_ns INTEGER NOT NULL);
         INSERT INTO m4 SELECT id, stack, parent, layer_id, depth, created_ns FROM manifests;
         DROP TABLE manifests; ALTER TABLE m4 RENAME TO manifests;
         ALTER TABLE sessions DROP COLUMN ignore_mtime;
         UPDATE meta SET value = '4' WHERE key = 'format_version';",
    )
    .unwrap();
    drop(db);
    let s = open(d.path());
    let v = format_version(&s);
    assert_eq!(v, FORMAT_VERSION.to_string());
    let index: i64 =
        s.db.read(|c| {
            Ok(c.query_row(
                "SELECT count(*) FROM sqlite_master WHERE type = 'index' AND name = 'layer_paths_hiding'",
                [],
                |r| r.get(0),
            )?)
        })
        .unwrap();
    assert_eq!(index, 1, "format 6 adds the index of hiding rows");
    // Format 7's manifests.rest: the old manifest reads as before, and a
    // publish on it writes the new shape.
    assert_eq!(
        s.branch_layers("default/sha256:bbb", "main").unwrap(),
        vec![s.layer_path(p.layer)]
    );
    let after = s.session(sess.id).unwrap();
    let o = after.outcome.unwrap();
    assert_eq!((o.kind, o.layer), (OutcomeKind::Committed, Some(p.layer)));
    // New outcomes record their bytes.
    s.prepare("default/6/c2", &top, BTreeMap::new(), false)
        .unwrap();
    let c2 = s.find_session("default", "c2").unwrap().unwrap();
    let t = PublishTimings {
        capture_bytes: 12_345,
        ..Default::default()
    };
    let mut rec = OutcomeRecord::new(OutcomeKind::Discarded, "discarded");
    rec.timings = Some(t);
    s.record_outcome(c2.id, rec, None).unwrap();
    let o = s.session(c2.id).unwrap().outcome.unwrap();
    assert_eq!(o.timings.map(|t| t.capture_bytes), Some(12_345));
    // The whole gate hold, set after the commit, on an outcome with timings only.
    s.record_commit_times(o.id, 777, 888).unwrap();
    let t = s.session(c2.id).unwrap().outcome.unwrap().timings.unwrap();
    assert_eq!(
        (t.gate_hold_us, t.total_us, t.capture_bytes),
        (777, 888, 12_345)
    );
    let first = s.session(sess.id).unwrap().outcome.unwrap();
    s.record_commit_times(first.id, 1, 2).unwrap();
    assert_eq!(
        s.session(sess.id).unwrap().outcome.unwrap().timings,
        None,
        "an outcome recorded without timings keeps none"
    );
}

#[test]
fn the_wal_is_checkpointed_off_the_writers_path() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    let db = d.path().join("root/store.db");
    let before = std::fs::metadata(&db).unwrap().len();
    // Enough write transactions to wake the checkpointer; far fewer pages than
    // the writer's own (backstop) automatic checkpoint needs.
    for i in 0..(2 * crate::db::CHECKPOINT_EVERY) {
        s.prepare(
            &format!("default/{}/w{i}", 10 + i),
            &top,
            BTreeMap::new(),
            false,
        )
        .unwrap();
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let now = std::fs::metadata(&db).unwrap().len();
        if now > before {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "store.db stayed at {before} bytes: nothing checkpointed the WAL"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn tmpfs_root_is_refused_before_anything_is_written() {
    // /dev/shm is a tmpfs on Linux hosts; a root mount is not needed.
    let shm = Path::new("/dev/shm");
    let is_tmpfs = nix::sys::statfs::statfs(shm)
        .map(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
        .unwrap_or(false);
    if !is_tmpfs {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI needs /dev/shm on tmpfs for this test"
        );
        eprintln!("skipping: /dev/shm is not tmpfs here");
        return;
    }
    let root = shm.join(format!("layerstack-test-{}", std::process::id()));
    let err = Store::open(&root, &StoreOptions::default()).err().unwrap();
    assert!(
        matches!(err, OpenError::Unsupported { ref fs, .. } if fs == "tmpfs"),
        "{err}"
    );
    assert!(err.to_string().contains("unsupported"));
    assert!(!root.exists(), "nothing may be written on refusal");
}

#[test]
fn client_side_unpack_without_ref_label_is_an_image_layer() {
    // `ctr images import` unpacks with keys `extract-<nonce> <chainID>` and no labels.
    let d = tmp();
    let s = open(d.path());
    let chain = format!("sha256:{}", "ab".repeat(32));
    let ex = format!("default/1/extract-12-x {chain}");
    s.prepare(&ex, "", BTreeMap::new(), false).unwrap();
    let top = format!("default/2/{chain}");
    s.commit(&top, &ex, BTreeMap::new()).unwrap();
    let ex2 = format!("default/3/extract-13-y sha256:{}", "cd".repeat(32));
    s.prepare(&ex2, &top, BTreeMap::new(), false).unwrap();
    assert!(
        s.sessions().unwrap().is_empty(),
        "an extraction is never a session"
    );
    s.prepare("default/4/c", &top, BTreeMap::new(), false)
        .unwrap();
    assert_eq!(
        s.find_session("default", "c").unwrap().unwrap().stack,
        format!("default/{chain}")
    );
    assert!(!is_extraction(
        "default/5/extract-1 notadigest",
        &BTreeMap::new()
    ));
}

#[test]
fn escape_path_is_lossless_for_display() {
    assert_eq!(escape_path(b"etc/issue"), "/etc/issue");
    assert_eq!(escape_path(b"a/\xffb"), "/a/\\xffb");
    assert_eq!(escape_path(b"a\nb"), "/a\\x0ab");
    assert_eq!(
        escape_path(b"a\\xffb"),
        "/a\\\\xffb",
        "a literal backslash never reads as an escape"
    );
}

#[test]
fn concurrent_store_instances_serialize_session_creation() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    drop(s);
    // Separate connections, like separate processes.
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let root = d.path().join("root");
            let top = top.clone();
            std::thread::spawn(move || {
                let opts = StoreOptions {
                    startup_sweep: false,
                    ..Default::default()
                };
                let s = Store::open(&root, &opts).unwrap();
                s.prepare(
                    &format!("default/{}/c{i}", 10 + i),
                    &top,
                    BTreeMap::new(),
                    false,
                )
                .unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let s = open(d.path());
    assert_eq!(s.sessions().unwrap().len(), 8);
    let stacks = s.stacks().unwrap();
    assert_eq!(stacks.len(), 1, "one stack");
    assert_eq!(stacks[0].branches.len(), 1, "one main branch");
}

#[test]
fn publish_interrupted_after_commit_is_rolled_forward() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/c", &top, BTreeMap::new(), false)
        .unwrap();
    let c = s.find_session("default", "c").unwrap().unwrap();
    std::fs::write(c.upper.join("data"), b"precious").unwrap();
    let p = publish(&s, c.id, &[write_entry(b"data", 1)]);
    drop(s);
    // Simulate a crash between the commit and the rename of the upper.
    std::fs::remove_dir_all(&c.upper).unwrap();
    let layer = d.path().join("root/l").join(p.layer.to_string());
    std::fs::rename(&layer, &c.upper).unwrap();
    let s = open(d.path());
    assert_eq!(
        std::fs::read(s.layer_path(p.layer).join("data")).unwrap(),
        b"precious"
    );
    assert!(c.upper.exists(), "the session gets a fresh upper");
    assert_eq!(std::fs::read_dir(&c.upper).unwrap().count(), 0);
}

/// ARCHITECTURE §9 "reads never wait": while the writer connection is held (as
/// during a commit or a publish), containerd's reads and the admin listings still
/// answer, from the last committed state — including a write in an open, not yet
/// committed transaction, which they must not see.
#[test]
fn reads_do_not_wait_for_the_writer() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/c1", &top, BTreeMap::new(), false)
        .unwrap();
    let sess = s.find_session("default", "c1").unwrap().unwrap();

    let writer = s.db.writer();
    writer
        .execute_batch(&format!(
            "BEGIN IMMEDIATE; UPDATE snapshots SET labels = '{{\"uncommitted\":\"1\"}}' WHERE key = '{top}';"
        ))
        .unwrap();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let r = (|| -> Result<(), String> {
                let info = s.stat(&top).map_err(|e| e.to_string())?;
                if info.labels.contains_key("uncommitted") {
                    return Err("stat saw an uncommitted write".into());
                }
                let n = s.list().map_err(|e| e.to_string())?.len();
                let sessions = s.sessions().map_err(|e| e.to_string())?;
                let one = s.session(sess.id).map_err(|e| e.to_string())?;
                let found = s.find_session("default", "c1").map_err(|e| e.to_string())?;
                let stacks = s.stacks().map_err(|e| e.to_string())?;
                let usage = s.usage(&top).map_err(|e| e.to_string())?;
                if n < 3
                    || sessions.len() != 1
                    || one.id != sess.id
                    || found.is_none()
                    || stacks.is_empty()
                    || usage.1 < 0
                {
                    return Err(format!(
                        "unexpected answers: {n} snapshots, {} sessions",
                        sessions.len()
                    ));
                }
                Ok(())
            })();
            let _ = done_tx.send(r);
        });
        let answer = done_rx.recv_timeout(std::time::Duration::from_secs(5));
        // Let the reader finish in any case before asserting (scope joins it).
        writer.execute_batch("ROLLBACK").unwrap();
        drop(writer);
        match answer {
            Ok(r) => r.unwrap(),
            Err(_) => panic!("reads waited for the writer connection"),
        }
    });
}

/// The container's `/` is the upper's root directory (overlayfs): a fresh upper
/// takes the mode, owner and xattrs of the image's root, as containerd's overlayfs
/// snapshotter does for mode and owner; an upper a container already wrote to is
/// left as it is.
#[test]
fn a_fresh_upper_takes_the_metadata_of_the_lease_root() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    let image_root = s.layer_path(2);
    std::fs::set_permissions(&image_root, std::fs::Permissions::from_mode(0o750)).unwrap();
    let root_user = nix::unistd::geteuid().is_root();
    if root_user {
        std::os::unix::fs::lchown(&image_root, Some(1), Some(2)).unwrap();
    }
    xattr::set(&image_root, "user.image", b"1").unwrap();

    s.prepare("default/5/c1", &top, BTreeMap::new(), false)
        .unwrap();
    let sess = s.find_session("default", "c1").unwrap().unwrap();
    let md = std::fs::metadata(&sess.upper).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o750);
    if root_user {
        assert_eq!((md.uid(), md.gid()), (1, 2));
    }
    assert_eq!(
        xattr::get(&sess.upper, "user.image").unwrap().as_deref(),
        Some(&b"1"[..])
    );

    // A container ran and changed `/`: a remount keeps what it did.
    std::fs::write(sess.upper.join("f"), b"x").unwrap();
    std::fs::set_permissions(&sess.upper, std::fs::Permissions::from_mode(0o700)).unwrap();
    s.mounts("default/5/c1").unwrap();
    let md = std::fs::metadata(&sess.upper).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o700);
}

/// ARCHITECTURE §9: no filesystem work inside a write transaction — a
/// session's and a plain snapshot's directories are made after the commit that
/// recorded their rows. A crash in between leaves rows without directories;
/// the next `Mounts` makes them (with the fresh upper's root metadata), so a
/// container started after the restart still gets its overlay.
#[test]
fn directories_lost_between_a_commit_and_their_mkdir_are_made_by_the_next_mount() {
    use std::os::unix::fs::PermissionsExt;
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    std::fs::set_permissions(s.layer_path(2), std::fs::Permissions::from_mode(0o751)).unwrap();
    s.prepare("default/5/c1", &top, BTreeMap::new(), false)
        .unwrap();
    let sess = s.find_session("default", "c1").unwrap().unwrap();
    let sdir = sess.upper.parent().unwrap().to_path_buf();
    assert!(sess.upper.is_dir() && sdir.join("work").is_dir());
    // A plain active snapshot (no image below: no session).
    s.prepare("default/6/plain", "", BTreeMap::new(), false)
        .unwrap();
    let plain = match s.mounts("default/6/plain").unwrap() {
        MountSpec::Bind {
            source,
            writable: true,
        } => source,
        other => panic!("an active snapshot with no parent is a writable bind: {other:?}"),
    };
    drop(s);
    // The crash: rows committed, directories never made.
    std::fs::remove_dir_all(&sdir).unwrap();
    std::fs::remove_dir_all(&plain).unwrap();

    let s = open(d.path());
    match s.mounts("default/5/c1").unwrap() {
        MountSpec::Overlay {
            upper: Some((upper, work)),
            ..
        } => {
            assert_eq!(upper, sess.upper);
            assert!(upper.is_dir(), "Mounts makes the session's upper again");
            assert!(work.is_dir(), "Mounts makes the session's workdir again");
            let mode = std::fs::metadata(&upper).unwrap().permissions().mode();
            assert_eq!(
                mode & 0o7777,
                0o751,
                "the remade upper takes the image root's mode"
            );
        }
        other => panic!("a session mounts as an overlay with an upper: {other:?}"),
    }
    s.mounts("default/6/plain").unwrap();
    assert!(
        plain.is_dir(),
        "Mounts makes a plain snapshot's directory again"
    );
}

#[test]
fn a_corrupt_manifest_row_is_an_error_naming_it_and_nothing_is_rewritten() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/a", &top, BTreeMap::new(), false)
        .unwrap();
    let a = s.find_session("default", "a").unwrap().unwrap();
    std::fs::write(a.upper.join("f"), b"1").unwrap();
    let p = publish(&s, a.id, &[write_entry(b"f", 1)]);
    // Damage the head manifest: its only position vanishes.
    let db = rusqlite::Connection::open(d.path().join("root/store.db")).unwrap();
    let saved: (i64, i64, i64) = db
        .query_row(
            "SELECT manifest_id, pos, layer_id FROM manifest_layers WHERE manifest_id = ?1",
            [p.manifest],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    db.execute(
        "DELETE FROM manifest_layers WHERE manifest_id = ?1",
        [p.manifest],
    )
    .unwrap();
    let err = s.branch_layers("default/sha256:bbb", "main").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt);
    let msg = err.to_string();
    assert!(
        msg.contains("manifest_layers") && msg.contains(&format!("manifest {}", p.manifest)),
        "{msg}"
    );
    // A new session on the branch is refused, not given an empty history.
    let err = s
        .prepare("default/6/b", &top, BTreeMap::new(), false)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    let n: i64 = db
        .query_row(
            "SELECT count(*) FROM manifest_layers WHERE manifest_id = ?1",
            [p.manifest],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(n, 0, "nothing rewrote the row");
    // Repair the row: the branch is intact.
    db.execute(
        "INSERT INTO manifest_layers(manifest_id, pos, layer_id) VALUES (?1, ?2, ?3)",
        saved_params(saved),
    )
    .unwrap();
    assert_eq!(
        s.branch_layers("default/sha256:bbb", "main").unwrap(),
        vec![s.layer_path(p.layer)]
    );
    s.prepare("default/6/b", &top, BTreeMap::new(), false)
        .unwrap();
    // A session row with an unknown state is corrupt too, named by id.
    db.pragma_update(None, "ignore_check_constraints", true)
        .unwrap();
    db.execute("UPDATE sessions SET state = 'weird' WHERE id = ?1", [a.id])
        .unwrap();
    let err = s.session(a.id).unwrap_err();
    assert!(
        matches!(err, StoreError::Corrupt { table: "sessions", ref key, .. } if *key == a.id.to_string()),
        "{err}"
    );
}

fn saved_params(s: (i64, i64, i64)) -> [i64; 3] {
    [s.0, s.1, s.2]
}

#[test]
fn outcome_paths_are_paged_in_path_order_whatever_their_number() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/a", &top, BTreeMap::new(), false)
        .unwrap();
    let a = s.find_session("default", "a").unwrap().unwrap();
    let paths: Vec<PathRecord> = (0..20_000)
        .map(|i| PathRecord {
            path: format!("node_modules/p{i:05}/index.js").into_bytes(),
            status: if i % 1000 == 7 {
                PathStatus::Conflict
            } else {
                PathStatus::Clean
            },
            reason: "r".into(),
        })
        .collect();
    let o = s
        .record_outcome(
            a.id,
            OutcomeRecord {
                kind: OutcomeKind::Conflict,
                message: Some("m".into()),
                paths: paths.clone(),
                timings: None,
                interrupted_by: None,
            },
            None,
        )
        .unwrap();
    assert_eq!(o.counts.conflict, 20);
    assert_eq!(o.counts.clean, 19_980);
    let mut got = Vec::new();
    let mut after: Option<Vec<u8>> = None;
    loop {
        let page = s.outcome_paths(o.id, after.as_deref(), 3000, None).unwrap();
        if page.is_empty() {
            break;
        }
        after = page.last().map(|p| p.path.clone());
        got.extend(page);
    }
    assert_eq!(got, paths);
    let conflicts = s
        .outcome_paths(o.id, None, 100, Some(PathStatus::Conflict))
        .unwrap();
    assert_eq!(conflicts.len(), 20);
    assert!(conflicts.iter().all(|p| p.status == PathStatus::Conflict));
    // The session's summary carries counts, not paths.
    let sess = s.session(a.id).unwrap();
    assert_eq!(sess.outcome.unwrap().counts.total(), 20_000);
}

#[test]
fn mode_b_sessions_have_a_sandbox_owner_and_idempotent_creation() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/a", &top, BTreeMap::new(), false)
        .unwrap();
    let stack = "default/sha256:bbb";
    let owner = Owner::Sandbox {
        name: "rollout-1".into(),
    };
    let (one, spec, created) = s
        .create_session(
            &owner,
            stack,
            &LeaseTarget::Branch("main".into()),
            Some("k1"),
        )
        .unwrap();
    assert!(created);
    assert_eq!(one.owner, owner);
    assert_eq!(one.key, None, "no containerd snapshot");
    let MountSpec::Overlay {
        lowers,
        upper: Some((u, _)),
    } = spec
    else {
        panic!("{spec:?}")
    };
    assert_eq!(lowers, vec![s.layer_path(2), s.layer_path(1)]);
    assert_eq!(u, one.upper);
    let (again, _, created) = s
        .create_session(
            &owner,
            stack,
            &LeaseTarget::Branch("main".into()),
            Some("k1"),
        )
        .unwrap();
    assert!(!created, "same key, same session");
    assert_eq!(again.id, one.id);
    let err = s
        .create_session(
            &owner,
            "default/sha256:nope",
            &LeaseTarget::Branch("main".into()),
            None,
        )
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    // Container and sandbox sessions side by side.
    let kinds: Vec<bool> = s
        .sessions()
        .unwrap()
        .iter()
        .map(|x| matches!(x.owner, Owner::Sandbox { .. }))
        .collect();
    assert_eq!(kinds, vec![false, true]);
}

#[test]
fn startup_drops_staged_publishes_that_never_committed() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/a", &top, BTreeMap::new(), false)
        .unwrap();
    let a = s.find_session("default", "a").unwrap().unwrap();
    std::fs::write(a.upper.join("f"), b"1").unwrap();
    let staged = s.stage_publish(a.id, &[write_entry(b"f", 1)], &[]).unwrap();
    drop(s);
    let s = open(d.path());
    assert_eq!(s.layer_index(staged.layer).unwrap(), vec![]);
    assert!(
        s.outcome(staged.outcome).is_err(),
        "the pending outcome is gone"
    );
    assert!(a.upper.join("f").exists(), "the upper is untouched");
    assert!(s.session(a.id).unwrap().outcome.is_none());
    // The run publishes normally afterwards.
    let p = publish(&s, a.id, &[write_entry(b"f", 1)]);
    assert!(s.layer_path(p.layer).join("f").exists());
}

#[test]
fn sweep_on_cleanup_never_removes_what_is_in_flight() {
    let d = tmp();
    let s = open(d.path());
    let staging = s.staging_path().join("merge-x");
    std::fs::create_dir(&staging).unwrap();
    let orphan = s.root().join("l/4242");
    std::fs::create_dir(&orphan).unwrap();
    let creating = s.root().join("l/4243");
    std::fs::create_dir(&creating).unwrap();
    let g = s.inflight().hold("l/4243");
    let r = s.sweep_with(SweepMode::Cleanup).unwrap();
    assert_eq!(r.removed, vec![orphan.clone()]);
    assert!(staging.exists(), "staging belongs to operations in flight");
    assert!(creating.exists());
    drop(g);
    s.sweep_with(SweepMode::Cleanup).unwrap();
    assert!(!creating.exists());
}

#[test]
fn a_publish_interrupted_before_its_commit_gets_its_upper_back() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/c", &top, BTreeMap::new(), false)
        .unwrap();
    let c = s.find_session("default", "c").unwrap().unwrap();
    std::fs::write(c.upper.join("data"), b"precious").unwrap();
    let staged = s
        .stage_publish(c.id, &[write_entry(b"data", 1)], &[])
        .unwrap();
    let dir = s.layer_path(staged.layer);
    drop(s);
    // Crash after the rename inside the transaction, before it committed.
    std::fs::rename(&c.upper, &dir).unwrap();
    let s = open(d.path());
    assert_eq!(std::fs::read(c.upper.join("data")).unwrap(), b"precious");
    assert!(!dir.exists());
    assert!(
        s.session(c.id).unwrap().outcome.is_none(),
        "the run is not over"
    );
    let p = publish(&s, c.id, &[write_entry(b"data", 1)]);
    assert_eq!(
        std::fs::read(s.layer_path(p.layer).join("data")).unwrap(),
        b"precious"
    );
}

#[test]
fn an_export_lease_lists_base_then_published_layers_and_the_sweep_releases_it() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/c1", &top, BTreeMap::new(), false)
        .unwrap();
    let sess = s.find_session("default", "c1").unwrap().unwrap();
    std::fs::write(sess.upper.join("a.txt"), b"hello").unwrap();
    let p = publish(&s, sess.id, &[write_entry(b"a.txt", 1)]);
    let stack = "default/sha256:bbb".to_string();
    let src = ExportSource::Branch {
        stack: stack.clone(),
        branch: "main".into(),
    };
    let e = s.lease_export(&src, "test").unwrap();
    let ids: Vec<LayerId> = e.layers.iter().map(|l| l.id).collect();
    assert_eq!(
        ids,
        vec![1, 2, p.layer],
        "oldest first: base, then published"
    );
    assert_eq!(e.base_layers, 2);
    assert_eq!(
        (e.namespace.as_deref(), e.base_digest.as_str()),
        (Some("default"), "sha256:bbb"),
        "where the export finds the base image in containerd"
    );
    assert_eq!(e.layers[2].kind, LayerKind::Published);
    assert_eq!(e.layers[2].path, s.layer_path(p.layer));
    assert_eq!(
        s.live_export_leases().unwrap(),
        vec![(e.lease, "test".into())]
    );
    s.release_export(e.lease).unwrap();
    assert!(s.live_export_leases().unwrap().is_empty());
    // A lease a dead daemon left is released by the startup sweep.
    let e2 = s.lease_export(&src, "test").unwrap();
    assert_eq!(s.sweep().unwrap().released_exports, 1);
    assert!(s.live_export_leases().unwrap().is_empty());
    s.release_export(e2.lease).unwrap();
    // Unknown names are errors naming them.
    let missing = ExportSource::Branch {
        stack: stack.clone(),
        branch: "nope".into(),
    };
    assert!(matches!(
        s.lease_export(&missing, "t"),
        Err(StoreError::BranchNotFound { .. })
    ));
    let missing = ExportSource::Branch {
        stack: "default/sha256:zzz".into(),
        branch: "main".into(),
    };
    assert!(matches!(
        s.lease_export(&missing, "t"),
        Err(StoreError::StackNotFound(_))
    ));
    assert!(s
        .lease_export(&ExportSource::Node("n-x".into()), "t")
        .is_err());
}

/// The automatic squash picks a size-tiered run: the published layers below the
/// newest `keep`, then an older squashed layer only while it covers at most
/// twice the publishes of the run so far — a big squash is not linked again
/// into every new one.
#[test]
fn a_squash_takes_the_new_layers_and_only_the_squashes_that_are_not_much_bigger() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    let mut n = 0;
    let mut publish_one = |s: &Store| {
        n += 1;
        let sid = container_session(s, &top, 1000 + n, &format!("q{n}"));
        publish(s, sid, &[write_entry(format!("f{n}").as_bytes(), 1)]).layer
    };
    publish_one(&s);
    let stack = s.find_session("default", "q1").unwrap().unwrap().stack;
    let squash = |s: &Store, run: &[LayerId]| {
        let head = s.branch_head(&stack, "main").unwrap();
        let (dir, _g) = s.staging_dir("squash").unwrap();
        s.commit_squash(&stack, "main", head, run, &dir)
            .unwrap()
            .layer
    };
    let layers = |s: &Store| {
        s.log(&stack, "main")
            .unwrap()
            .iter()
            .map(|e| e.layer)
            .collect::<Vec<_>>()
    };
    for _ in 1..20 {
        publish_one(&s);
    }
    // One big squash of 17 publishes below the newest 3.
    let all = layers(&s);
    let big = squash(&s, &all[3..]);
    for _ in 0..3 {
        publish_one(&s);
    }
    let now = layers(&s);
    assert_eq!(now.len(), 7);
    let (_, run) = s.squash_candidate(&stack, "main", 5, 3).unwrap().unwrap();
    assert_eq!(run, now[3..6], "the 3 new layers, not the squash of 17");
    // A run of one layer falls back to everything below `keep`.
    let (_, run) = s.squash_candidate(&stack, "main", 5, 5).unwrap().unwrap();
    assert_eq!(run, now[5..], "one new layer and the big squash");
    // A small squash joins the run; the big one still does not.
    let small = squash(&s, &now[3..6]);
    for _ in 0..3 {
        publish_one(&s);
    }
    let now = layers(&s);
    assert_eq!(now[6..], [small, big]);
    let (_, run) = s.squash_candidate(&stack, "main", 5, 3).unwrap().unwrap();
    assert_eq!(run, now[3..7], "3 new layers and the squash of 3");
    // Not deep enough: nothing to do.
    assert!(s.squash_candidate(&stack, "main", 64, 3).unwrap().is_none());
}

/// A path-index row of a deletion.
fn delete_entry(path: &[u8]) -> IndexEntry {
    IndexEntry {
        path: path.to_vec(),
        kind: ChangeKind::Delete,
        digest: None,
        mode: None,
        uid: None,
        gid: None,
        xattrs: None,
    }
}

/// A stack (on [`unpack`]) whose layers are published with index rows only.
struct Hist {
    s: Store,
    top: String,
    stack: String,
    n: usize,
}

impl Hist {
    fn new(dir: &Path) -> Hist {
        let s = open(dir);
        let top = unpack(&s, "default");
        Hist {
            s,
            top,
            stack: "default/sha256:bbb".into(),
            n: 0,
        }
    }

    /// Publishes one layer with `index` on `branch` by container `h<n>`.
    fn publish(&mut self, branch: &str, index: &[IndexEntry]) -> LayerId {
        self.n += 1;
        let name = format!("h{}", self.n);
        self.s
            .prepare(
                &format!("default/{}/{name}", 1000 + self.n),
                &self.top,
                labels(&[(SNAPSHOT_BRANCH_LABEL, branch)]),
                false,
            )
            .unwrap();
        let sid = self.s.find_session("default", &name).unwrap().unwrap().id;
        publish(&self.s, sid, index).layer
    }

    /// Squashes `run` (layers of `branch`'s head) into one layer.
    fn squash(&self, branch: &str, run: &[LayerId]) -> LayerId {
        let head = self.s.branch_head(&self.stack, branch).unwrap();
        let (dir, _g) = self.s.staging_dir("squash").unwrap();
        self.s
            .commit_squash(&self.stack, branch, head, run, &dir)
            .unwrap()
            .layer
    }

    /// Squashes everything below `branch`'s newest `keep` layers.
    fn squash_below(&self, branch: &str, keep: usize) -> LayerId {
        let layers = self.layers(branch);
        self.squash(branch, &layers[keep..])
    }

    fn layers(&self, branch: &str) -> Vec<LayerId> {
        self.s
            .manifest(self.s.branch_head(&self.stack, branch).unwrap())
            .unwrap()
    }

    fn head(&self, branch: &str) -> ManifestId {
        self.s.branch_head(&self.stack, branch).unwrap()
    }

    fn expanded(&self, m: ManifestId) -> Vec<LayerId> {
        self.s.expand_layers(&self.s.manifest(m).unwrap()).unwrap()
    }

    fn merge_base(&self, from: &str, to: &str) -> Result<MergeBase, StoreError> {
        self.s
            .merge_base(&self.stack, self.head(from), self.head(to))
    }

    /// Every layer of manifest `m` has its directory.
    fn on_disk(&self, m: ManifestId) -> bool {
        self.s
            .manifest(m)
            .unwrap()
            .iter()
            .all(|l| self.s.layer_path(*l).is_dir())
    }
}

/// The tester's first case, at the store: main deletes a file that existed when
/// b4 forked, publishes 9 more times and squashes everything below its newest 8
/// (the run straddles the fork point). The merge base of b4 and main is still
/// the fork point — not the empty root — and what b4 changed is its one layer;
/// the path index since the merge base shows main's deletion.
#[test]
fn the_merge_base_survives_a_squash_of_the_target() {
    let d = tmp();
    let mut h = Hist::new(d.path());
    let l1 = h.publish(
        "main",
        &[
            write_entry(b"root/new.txt", 1),
            write_entry(b"root/g.txt", 1),
        ],
    );
    h.s.create_branch(&h.stack, "b4", "main", None).unwrap();
    let b = h.publish("b4", &[write_entry(b"root/b4.txt", 2)]);
    let lr = h.publish("main", &[delete_entry(b"root/new.txt")]);
    for i in 0..9 {
        h.publish("main", &[write_entry(format!("root/m{i}").as_bytes(), 3)]);
    }
    let (_, run) =
        h.s.squash_candidate(&h.stack, "main", 0, 8)
            .unwrap()
            .unwrap();
    assert!(run.contains(&l1) && run.contains(&lr), "{run:?}");
    h.squash("main", &run);
    let mb = h.merge_base("b4", "main").unwrap();
    assert_eq!(mb.base, vec![l1], "the fork point");
    assert_eq!(h.expanded(mb.manifest), vec![l1]);
    assert!(h.on_disk(mb.manifest));
    assert_eq!(mb.a_changes, vec![b], "b4 changed one layer");
    assert_eq!(mb.a_layers, Some(vec![b]));
    let since =
        h.s.changes_between(mb.manifest, h.head("main"), &query(&["root/new.txt"], &[]))
            .unwrap();
    assert_eq!(since.len(), 1, "{since:?}");
    assert_eq!(
        (since[0].0, since[0].1[0].kind),
        (lr, ChangeKind::Delete),
        "main deleted it since the merge base"
    );
    // The other way round: main's changes since the merge base, b4's head whole.
    let back = h.merge_base("main", "b4").unwrap();
    assert_eq!(h.expanded(back.manifest), vec![l1]);
    assert_eq!(back.a_changes.len(), 10);
    assert_eq!(
        back.a_layers, None,
        "main's squash straddles the merge base"
    );
}

/// The tester's second case: b2 forks, main edits g.txt, main squashes
/// everything: g.txt changed on main only since the merge base.
#[test]
fn an_edit_on_the_target_before_its_squash_is_the_targets_change() {
    let d = tmp();
    let mut h = Hist::new(d.path());
    let l1 = h.publish("main", &[write_entry(b"root/g.txt", 1)]);
    h.s.create_branch(&h.stack, "b2", "main", None).unwrap();
    let b = h.publish("b2", &[write_entry(b"root/b2.txt", 2)]);
    let lg = h.publish("main", &[write_entry(b"root/g.txt", 5)]);
    h.squash_below("main", 0);
    assert_eq!(h.layers("main").len(), 1);
    let mb = h.merge_base("b2", "main").unwrap();
    assert_eq!(h.expanded(mb.manifest), vec![l1]);
    assert_eq!(mb.a_changes, vec![b]);
    let since =
        h.s.changes_between(mb.manifest, h.head("main"), &query(&["root/g.txt"], &[]))
            .unwrap();
    assert_eq!(since.len(), 1);
    assert_eq!(
        since[0].0, lg,
        "only main changed g.txt since the merge base"
    );
}

/// Squashes on both sides, one a squash of squashes: the merge base is the
/// layers both show as published, built from layers on disk; once GC freed the
/// shared layers both sides compacted it cannot be built and says so. Squashed
/// on one side only, GC changes nothing.
#[test]
fn the_merge_base_survives_nested_squashes_on_both_sides() {
    let d = tmp();
    let mut h = Hist::new(d.path());
    let mut shared: Vec<LayerId> = (0..4)
        .map(|i| h.publish("main", &[write_entry(format!("s{i}").as_bytes(), 1)]))
        .collect();
    shared.reverse();
    h.s.create_branch(&h.stack, "b", "main", None).unwrap();
    h.s.create_branch(&h.stack, "c", "main", None).unwrap();
    let mut own_b: Vec<LayerId> = (0..3)
        .map(|i| h.publish("b", &[write_entry(format!("b{i}").as_bytes(), 2)]))
        .collect();
    own_b.reverse();
    let mut own_main: Vec<LayerId> = Vec::new();
    for i in 0..3 {
        own_main.insert(
            0,
            h.publish("main", &[write_entry(format!("m{i}").as_bytes(), 3)]),
        );
    }
    // main: a squash straddling the fork point, more publishes, then a squash of
    // that squash with them (nested).
    let s1 = h.squash_below("main", 1);
    for i in 3..5 {
        own_main.insert(
            0,
            h.publish("main", &[write_entry(format!("m{i}").as_bytes(), 3)]),
        );
    }
    let s2 = h.squash_below("main", 1);
    assert_eq!(h.layers("main"), vec![own_main[0], s2]);
    assert!(h.s.expand_layers(&[s2]).unwrap().ends_with(&shared));
    let _ = s1;
    // b: one squash that straddles the fork point too.
    h.squash_below("b", 1);
    let mb = h.merge_base("b", "main").unwrap();
    assert_eq!(mb.base, shared);
    assert_eq!(h.expanded(mb.manifest), shared);
    assert!(
        h.on_disk(mb.manifest),
        "members whose directories are still there"
    );
    assert_eq!(mb.a_changes, own_b);
    assert_eq!(mb.a_layers, None);
    let mb = h.merge_base("main", "b").unwrap();
    assert_eq!(mb.a_changes, own_main);
    // c, unsquashed, keeps the shared layers on disk through GC: both ways work.
    h.s.gc(&[]).unwrap();
    for (from, to) in [("b", "c"), ("c", "b"), ("main", "c"), ("c", "main")] {
        let mb = h.merge_base(from, to).unwrap();
        assert_eq!(h.expanded(mb.manifest), shared, "{from} -> {to}");
        assert!(h.on_disk(mb.manifest), "{from} -> {to}");
    }
    let mb = h.merge_base("b", "main").unwrap();
    assert_eq!(h.expanded(mb.manifest), shared);
    assert!(h.on_disk(mb.manifest));
    // Without c, GC frees the shared layers: b and main both compacted them.
    h.s.delete_branch(&h.stack, "c").unwrap();
    h.s.gc(&[]).unwrap();
    let err = h.merge_base("b", "main").unwrap_err();
    assert!(
        matches!(err, StoreError::FailedPrecondition(ref m) if m.contains("can no longer be built")),
        "{err}"
    );
}

/// A squash keeps who published each layer: the squashed row counts the paths
/// of its merged index once each and lists its members (nested squashes
/// nested) with their publishers and path counts.
#[test]
fn the_log_shows_a_squash_with_its_members_and_its_merged_path_count() {
    let d = tmp();
    let mut h = Hist::new(d.path());
    let a = h.publish("main", &[write_entry(b"x", 1), write_entry(b"y", 1)]);
    let b = h.publish("main", &[write_entry(b"x", 2)]);
    let c = h.publish("main", &[write_entry(b"z", 3)]);
    let s1 = h.squash("main", &[b, a]);
    let top = h.publish("main", &[write_entry(b"w", 4)]);
    let s2 = h.squash("main", &[c, s1]);
    let log = h.s.log(&h.stack, "main").unwrap();
    assert_eq!(log.iter().map(|e| e.layer).collect::<Vec<_>>(), [top, s2]);
    let sq = &log[1];
    assert_eq!(sq.kind, LayerKind::Squashed);
    assert_eq!(sq.paths, 3, "x, y, z: x counted once");
    assert_eq!(sq.paths as usize, h.s.layer_index(s2).unwrap().len());
    assert_eq!(
        sq.members.iter().map(|e| e.layer).collect::<Vec<_>>(),
        [c, s1]
    );
    let nested = &sq.members[1];
    assert_eq!((nested.kind, nested.paths), (LayerKind::Squashed, 2));
    assert_eq!(
        nested
            .members
            .iter()
            .map(|e| (e.layer, e.paths))
            .collect::<Vec<_>>(),
        [(b, 1), (a, 2)]
    );
    let first = &nested.members[1];
    assert_eq!(first.kind, LayerKind::Published);
    assert_eq!(
        first.owner,
        Some(Owner::Container {
            namespace: "default".into(),
            id: "h1".into()
        }),
        "who published it"
    );
    assert!(first.session.is_some() && first.created_ns > 0);
    assert_ne!(first.manifest, 0, "its manifest is still there before GC");
    assert!(log[0].members.is_empty());
}

/// A member of a squash names the view as of its publish: the old head while
/// it exists, else the same view from the layers below the squash and the
/// members from it down; once GC freed what that needs, a clear refusal.
#[test]
fn a_member_layer_names_the_view_as_of_its_publish() {
    let d = tmp();
    let mut h = Hist::new(d.path());
    let a = h.publish("main", &[write_entry(b"x", 1)]);
    let b = h.publish("main", &[write_entry(b"y", 1)]);
    let after_b = h.head("main");
    let c = h.publish("main", &[write_entry(b"z", 1)]);
    let top = h.publish("main", &[write_entry(b"w", 1)]);
    let s = h.squash("main", &[c, b]);
    assert_eq!(h.layers("main"), vec![top, s, a]);
    // A layer of the head: as before.
    let p = h.s.log_point(&h.stack, "main", a).unwrap();
    assert_eq!((p.layers, p.squash), (vec![a], None));
    // A member: the head right after its publish.
    let p = h.s.log_point(&h.stack, "main", b).unwrap();
    assert_eq!(p.manifest, Some(after_b));
    assert_eq!((p.layers.clone(), p.squash), (vec![b, a], Some(s)));
    let br =
        h.s.create_branch(&h.stack, "at-b", "main", Some(b))
            .unwrap();
    assert_eq!(br.head, after_b);
    assert_eq!(h.s.compacted_into(&h.layers("main"), b).unwrap(), Some(s));
    assert_eq!(h.s.compacted_into(&h.layers("main"), a).unwrap(), None);
    h.s.delete_branch(&h.stack, "at-b").unwrap();
    // After GC the old heads are gone: the newest member is the squash's view;
    // an older one's directory is freed.
    h.s.gc(&[]).unwrap();
    let p = h.s.log_point(&h.stack, "main", c).unwrap();
    assert_eq!((p.layers.clone(), p.manifest), (vec![s, a], None));
    let br =
        h.s.create_branch(&h.stack, "at-c", "main", Some(c))
            .unwrap();
    assert_eq!(h.s.manifest(br.head).unwrap(), vec![s, a]);
    let err = h.s.log_point(&h.stack, "main", b).unwrap_err();
    assert!(
        matches!(err, StoreError::FailedPrecondition(ref m) if m.contains(&format!("use layer {s}"))),
        "{err}"
    );
    let err = h.s.log_point(&h.stack, "main", 9999).unwrap_err();
    assert!(matches!(err, StoreError::InvalidArgument(ref m) if m.contains("not in the log")));
}

/// GC keeps the member rows of a squash nested in a reachable one: after a
/// restart (no expansion cache) the outer squash still expands to every layer
/// it compacted, their path index included, and the log lists them.
#[test]
fn gc_keeps_the_members_of_nested_squashes() {
    let d = tmp();
    let mut h = Hist::new(d.path());
    let a = h.publish("main", &[write_entry(b"x", 1)]);
    let b = h.publish("main", &[write_entry(b"y", 1)]);
    let s1 = h.squash("main", &[b, a]);
    let c = h.publish("main", &[write_entry(b"z", 1)]);
    let top = h.publish("main", &[write_entry(b"w", 1)]);
    let s2 = h.squash("main", &[c, s1]);
    assert_eq!(h.layers("main"), vec![top, s2]);
    let report = h.s.gc(&[]).unwrap();
    assert!(report.layers.contains(&s1), "{report:?}");
    let stack = h.stack.clone();
    drop(h);
    let s = open(d.path());
    assert_eq!(s.expand_layers(&[s2]).unwrap(), vec![c, b, a]);
    assert_eq!(s.layer_index(s2).unwrap().len(), 3);
    let log = s.log(&stack, "main").unwrap();
    assert_eq!(
        log[1].members[1]
            .members
            .iter()
            .map(|e| e.layer)
            .collect::<Vec<_>>(),
        [b, a]
    );
}

/// GC keeps a manifest an operation in flight pins (its observed head), with
/// its ancestors and so their layers, and collects them once the pin is gone.
#[test]
fn gc_keeps_a_pinned_manifest_and_its_ancestors_until_unpinned() {
    let d = tmp();
    let mut h = Hist::new(d.path());
    let a = h.publish("main", &[write_entry(b"x", 1)]);
    let b = h.publish("main", &[write_entry(b"y", 1)]);
    let observed = h.s.branch_head(&h.stack, "main").unwrap();
    let s = h.squash("main", &[b, a]);
    assert_eq!(h.layers("main"), vec![s]);

    let pinned = h.s.gc(&[observed]).unwrap();
    assert!(
        !pinned.layers.contains(&a) && !pinned.layers.contains(&b),
        "the pinned head's layers were collected: {pinned:?}"
    );
    assert!(
        h.s.layer_path(a).exists() && h.s.layer_path(b).exists(),
        "the pinned head's layers are gone from disk"
    );

    let unpinned = h.s.gc(&[]).unwrap();
    assert!(
        unpinned.layers.contains(&a) && unpinned.layers.contains(&b),
        "{unpinned:?}"
    );
    assert!(
        unpinned.manifests >= 2,
        "the pinned head and its parent: {unpinned:?}"
    );
    assert!(!h.s.layer_path(a).exists() && !h.s.layer_path(b).exists());
    assert_eq!(h.s.fsck(false).unwrap().problems, Vec::new());
}

/// The gate's two store calls: [`Store::recheck_head`] reads the head and what
/// it added at the plan's paths since the plan (nothing written); the commit
/// that follows is a compare-and-swap from the head the re-check read — it
/// commits on a head that moved elsewhere, and refuses `HeadMoved` (writing
/// nothing, the upper kept) when the head is not the one expected.
#[test]
fn a_recheck_reads_what_the_head_added_at_the_plans_paths_and_the_commit_swaps_from_it() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    for c in ["a", "b", "c", "d"] {
        s.prepare(&format!("default/9/{c}"), &top, BTreeMap::new(), false)
            .unwrap();
    }
    let sess = |c: &str| s.find_session("default", c).unwrap().unwrap();
    let (a, b, c, dd) = (sess("a"), sess("b"), sess("c"), sess("d"));
    let observed = s.head_view(b.id).unwrap().manifest;
    let stage = |sid: SessionId, path: &[u8]| {
        std::fs::write(s.upper_path(sid).join("f"), b"f").unwrap();
        let staged = s.stage_publish(sid, &[write_entry(path, 2)], &[]).unwrap();
        (staged, query(&[std::str::from_utf8(path).unwrap()], &[]))
    };
    let depth = || {
        s.manifest(s.branch_head(&a.stack, "main").unwrap())
            .unwrap()
            .len()
    };
    // Nothing moved: the re-check reads the observed head and no changes.
    let (staged_b, qb) = stage(b.id, b"y");
    let r = s.recheck_head(b.id, observed, &qb).unwrap();
    assert_eq!(
        r,
        Recheck {
            head: observed,
            changes: None
        }
    );
    // `a` lands first, at x.
    publish(&s, a.id, &[write_entry(b"x", 1)]);
    // `b` planned at y on the old head: the head moved, not at y.
    let r = s.recheck_head(b.id, observed, &qb).unwrap();
    assert_ne!(r.head, observed);
    assert_eq!(r.changes, Some(Vec::new()));
    let p = s
        .commit_publish(b.id, staged_b, r.head, CommitRecord::default())
        .unwrap();
    let head = s
        .manifest(s.branch_head(&b.stack, "main").unwrap())
        .unwrap();
    assert_eq!(head[0], p.layer);
    assert_eq!(head.len(), 2, "b on top of a");
    // `c` planned at x on the old head: the re-check shows `a`'s row at x.
    let (staged_c, qc) = stage(c.id, b"x");
    let r = s.recheck_head(c.id, observed, &qc).unwrap();
    let changes = r.changes.expect("the head moved");
    let paths: Vec<&[u8]> = changes
        .iter()
        .flat_map(|(_, rows)| rows.iter().map(|e| e.path.as_slice()))
        .collect();
    assert_eq!(paths, [b"x".as_slice()], "{changes:?}");
    s.abandon_staged(staged_c).unwrap();
    // `dd` swaps from a head that is not the head: nothing written, upper kept.
    let (staged_d, _) = stage(dd.id, b"z");
    let e = s
        .commit_publish(dd.id, staged_d, observed, CommitRecord::default())
        .unwrap_err();
    assert!(matches!(e, StoreError::HeadMoved { .. }), "{e}");
    assert_eq!(depth(), 2);
    assert!(s.upper_path(dd.id).join("f").exists(), "the upper stays");
    assert!(s.session(dd.id).unwrap().outcome.is_none());
    assert!(!s.layer_path(staged_d.layer).exists());
}

/// A head past several [`crate::stacks::OWN_RUN`]s of publishes: every manifest
/// on the way reads as the layers published so far, newest first; a prepend
/// writes at most `OWN_RUN` rows except when it writes the list out whole; and
/// every manifest that refers to a `rest` refers to a complete ancestor.
#[test]
fn a_prepend_writes_a_bounded_run_of_rows_and_every_manifest_reads_whole() {
    use crate::stacks::OWN_RUN;
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    let n = 3 * OWN_RUN as usize + 5;
    let mut published = Vec::new();
    let mut heads = Vec::new();
    for i in 0..n {
        let sid = container_session(&s, &top, 10 + i, &format!("c{i}"));
        let f = format!("f{i}");
        std::fs::write(s.upper_path(sid).join(&f), b"x").unwrap();
        let p = publish(&s, sid, &[write_entry(f.as_bytes(), 1)]);
        published.insert(0, p.layer);
        heads.push((p.manifest, published.clone()));
    }
    let (mut whole, mut bounded) = (0, 0);
    s.db.read(|c| {
        for (m, expect) in &heads {
            assert_eq!(&crate::stacks::manifest_layers(c, *m)?, expect, "manifest {m}");
            let (depth, rest, rows): (i64, Option<i64>, i64) = c.query_row(
                "SELECT depth, rest, (SELECT count(*) FROM manifest_layers WHERE manifest_id = m.id) FROM manifests m WHERE id = ?1",
                [m],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )?;
            match rest {
                None => {
                    assert_eq!(rows, depth);
                    whole += 1;
                }
                Some(r) => {
                    assert!(rows <= OWN_RUN, "manifest {m}: {rows} own rows");
                    let (rd, rr): (i64, Option<i64>) = c.query_row(
                        "SELECT depth, rest FROM manifests WHERE id = ?1",
                        [r],
                        |x| Ok((x.get(0)?, x.get(1)?)),
                    )?;
                    assert_eq!((rd + rows, rr), (depth, None), "manifest {m}'s rest {r}");
                    bounded += 1;
                }
            }
        }
        Ok(())
    })
    .unwrap();
    // One whole list per OWN_RUN prepends (and the first on the empty root).
    assert!(whole <= n / OWN_RUN as usize + 1, "{whole} whole of {n}");
    assert!(
        bounded >= n - n / OWN_RUN as usize - 1,
        "{bounded} bounded of {n}"
    );
    // A new session on the head mounts every published layer, newest first.
    assert_eq!(
        s.branch_layers("default/sha256:bbb", "main").unwrap(),
        published
            .iter()
            .map(|l| s.layer_path(*l))
            .collect::<Vec<_>>()
    );
}

/// A store with graph `g` (root node returned) and run `r` over it.
fn rollout_store(d: &Path) -> (Store, String, NodeInfo) {
    let s = open(d);
    let top = unpack(&s, "default");
    s.prepare("default/5/m", &top, BTreeMap::new(), false)
        .unwrap();
    let stack = s.find_session("default", "m").unwrap().unwrap().stack;
    let (_, root) = s.create_group("g", &stack, "main", None).unwrap();
    let (run, created) = s.create_run("r", "g", &BTreeMap::new()).unwrap();
    assert!(created);
    (s, run.name, root)
}

fn begin(s: &Store, sample: i64, attempt: u32, node: &str) -> Begun {
    begin_with(s, sample, attempt, node, None)
}

/// A remote attempt on `worker`.
fn begin_on(s: &Store, sample: i64, attempt: u32, node: &str, worker: &str) -> Begun {
    begin_with(s, sample, attempt, node, Some(worker))
}

fn begin_with(s: &Store, sample: i64, attempt: u32, node: &str, worker: Option<&str>) -> Begun {
    s.begin_rollout(&RolloutBegin {
        key: SampleKey {
            run: "r".into(),
            step: 0,
            prompt: "p".into(),
            sample,
        },
        attempt,
        node: node.into(),
        policy: "pi-1".into(),
        seed: Some(7),
        worker: worker.map(str::to_string),
    })
    .unwrap()
}

fn begun(b: Begun) -> RolloutAttempt {
    match b {
        Begun::Attempt { attempt, .. } => attempt,
        Begun::Rewarded(s) => panic!("sample rewarded already: {s:?}"),
    }
}

fn completed(reward: f64, backprop: bool) -> RolloutEnding {
    RolloutEnding {
        result: RolloutResult::Completed {
            reward,
            accepted: reward > 0.5,
        },
        evaluator: Some(Evaluator {
            name: "pytest".into(),
            version: "8.0".into(),
            digest: "sha256:ab".into(),
        }),
        trajectory: None,
        artifacts: Vec::new(),
        backprop: backprop.then_some(reward),
        message: String::new(),
    }
}

#[test]
fn a_samples_reward_is_applied_once_whatever_the_retries_and_repeats() {
    let d = tmp();
    let (s, run, root) = rollout_store(d.path());
    // The same attempt twice is one attempt.
    let a1 = begun(begin(&s, 0, 1, &root.id));
    let Begun::Attempt {
        attempt: again,
        created,
    } = begin(&s, 0, 1, &root.id)
    else {
        panic!()
    };
    assert!(!created);
    assert_eq!(again.id, a1.id);
    // Attempt 1 is lost to the infrastructure; attempt 2 is rewarded.
    let infra = RolloutEnding {
        result: RolloutResult::InfraFailed {
            kind: "init-gone".into(),
        },
        evaluator: None,
        trajectory: None,
        artifacts: Vec::new(),
        backprop: None,
        message: "init killed".into(),
    };
    let e1 = s.end_rollout(a1.id, &infra, Disposition::Keep).unwrap();
    assert_eq!(
        (e1.status, e1.reward, e1.applied),
        (RolloutStatus::InfraFailed, None, false)
    );
    let a2 = begun(begin(&s, 0, 2, &root.id));
    // A third attempt races the second (a harness retried too early).
    let a3 = begun(begin(&s, 0, 3, &root.id));
    let e2 = s
        .end_rollout(a2.id, &completed(0.75, true), Disposition::Keep)
        .unwrap();
    assert!(e2.applied);
    // A duplicate end answers the recorded end; a different one is refused.
    let dup = s
        .end_rollout(a2.id, &completed(0.75, true), Disposition::Keep)
        .unwrap();
    assert_eq!(dup, e2);
    let err = s
        .end_rollout(a2.id, &completed(0.1, true), Disposition::Keep)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
    // So is the same reward with another acceptance, evaluator or
    // backpropagated value: each names the recorded end.
    let mut rejected = completed(0.75, true);
    rejected.result = RolloutResult::Completed {
        reward: 0.75,
        accepted: false,
    };
    let mut other_evaluator = completed(0.75, true);
    other_evaluator.evaluator = Some(Evaluator {
        name: "pytest".into(),
        version: "9.0".into(),
        digest: "sha256:cd".into(),
    });
    let mut other_backprop = completed(0.75, true);
    other_backprop.backprop = Some(0.5);
    for other in [
        rejected,
        other_evaluator,
        other_backprop,
        completed(0.75, false),
    ] {
        let err = s.end_rollout(a2.id, &other, Disposition::Keep).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
        assert!(
            err.to_string().contains("ended already as completed (reward 0.75, accepted, evaluator pytest:8.0, backprop 0.75)"),
            "{err}"
        );
    }
    assert_eq!(s.rollout(a2.id).unwrap(), e2);
    // The racing attempt completes but is not applied; no attempt starts now.
    let Begun::Rewarded(sample) = begin(&s, 0, 4, &root.id) else {
        panic!("rewarded sample started again")
    };
    assert_eq!(
        (sample.reward, sample.reward_attempt),
        (Some(0.75), Some(2))
    );
    let e3 = s
        .end_rollout(a3.id, &completed(0.2, true), Disposition::Keep)
        .unwrap();
    assert_eq!((e3.status, e3.applied), (RolloutStatus::Completed, false));
    let sample = s.sample(&a1.key).unwrap();
    assert_eq!(
        (sample.reward, sample.reward_attempt, sample.attempts),
        (Some(0.75), Some(2), 3)
    );
    // Two backpropagations (attempts 2 and 3), each once: the root has 2 visits.
    let st = s.node_stats(&root.id).unwrap();
    assert_eq!((st.visits, st.value_sum), (2, 0.95));
    let audit = s.audit_run(&run).unwrap();
    assert_eq!(audit.violations, Vec::<String>::new());
    assert_eq!(
        (
            audit.samples,
            audit.rewarded,
            audit.attempts,
            audit.completed,
            audit.backprops
        ),
        (1, 1, 3, 2, 2)
    );
    assert_eq!(audit.infra_failed.get("init-gone"), Some(&1));
    // The audit catches a second applied reward (written behind the store's back).
    s.db.write(|tx| {
        Ok(tx.execute(
            "UPDATE rollout_attempts SET applied = 1 WHERE id = ?1",
            [a3.id],
        )?)
    })
    .unwrap();
    let v = s.audit_run(&run).unwrap().violations;
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(
        v[0].starts_with("a sample with more than one applied reward"),
        "{v:?}"
    );
}

#[test]
fn attempts_are_checked_against_their_sample_and_an_infra_failure_has_no_value() {
    let d = tmp();
    let (s, _, root) = rollout_store(d.path());
    let a = begun(begin(&s, 1, 1, &root.id));
    let mut other = RolloutBegin {
        key: a.key.clone(),
        attempt: 1,
        node: root.id.clone(),
        policy: "pi-2".into(),
        seed: Some(7),
        worker: None,
    };
    let err = s.begin_rollout(&other).unwrap_err();
    assert!(err.to_string().contains("pi-1"), "{err}");
    other.attempt = 0;
    assert_eq!(
        s.begin_rollout(&other).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    other.key.run = "no-such-run".into();
    other.attempt = 1;
    assert_eq!(
        s.begin_rollout(&other).unwrap_err().kind(),
        ErrorKind::NotFound
    );
    let bad = RolloutEnding {
        result: RolloutResult::InfraFailed {
            kind: "timeout".into(),
        },
        evaluator: None,
        trajectory: None,
        artifacts: Vec::new(),
        backprop: Some(0.0),
        message: String::new(),
    };
    assert_eq!(
        s.end_rollout(a.id, &bad, Disposition::Keep)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );
    let nan = completed(f64::NAN, false);
    assert_eq!(
        s.end_rollout(a.id, &nan, Disposition::Keep)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        s.rollout(a.id).unwrap().status,
        RolloutStatus::Running,
        "a refused end changes nothing"
    );
}

/// Attempt 1 of sample `sample` running in sandbox `name` on `node`: the
/// attempt, its graph attempt's id and its session.
fn running_attempt(
    s: &Store,
    sample: i64,
    node: &str,
    name: &str,
) -> (RolloutAttempt, i64, SessionInfo) {
    let a = begun(begin(s, sample, 1, node));
    let (ga, sess, _, _) = s
        .start_attempt(node, &Owner::Sandbox { name: name.into() }, None)
        .unwrap();
    s.attach_rollout_session(a.id, sess.id, Some(ga.id))
        .unwrap();
    (a, ga.id, sess)
}

/// What a daemon restart leaves of sandbox session `sid` (graph attempt
/// `ga`): its outcome `interrupted`, its attempt ended so.
fn lose_sandbox(s: &Store, sid: SessionId, ga: i64) {
    s.record_outcome(
        sid,
        OutcomeRecord::interrupted(Interruption::DaemonRestart, "restart"),
        None,
    )
    .unwrap();
    s.end_attempt(ga, AttemptStatus::Interrupted, "daemon restart")
        .unwrap();
}

/// The daemon's record of an attempt's commands: only a running attempt's
/// sandbox records; the record is in order and keeps the first
/// EXEC_RECORD_KEEP_BYTES of output; an attempt an infrastructure failure
/// ended gets it as its trajectory blob (fold), an attempt ended by its
/// harness loses the rows either way (its end took the record or its own).
#[test]
fn the_daemon_records_an_attempts_commands_and_an_infra_failure_keeps_them() {
    let d = tmp();
    let (s, _run, root) = rollout_store(d.path());
    let owner = Owner::Sandbox { name: "a".into() };
    // Not an attempt's sandbox: nothing recorded.
    let (_, plain, _, _) = s.start_attempt(&root.id, &owner, None).unwrap();
    assert_eq!(s.running_rollout_of_session(plain.id).unwrap(), None);
    assert_eq!(
        s.record_rollout_exec(plain.id, &ExecRecord::new(vec!["true".into()]))
            .unwrap(),
        None
    );
    let (a, ga, sess) = running_attempt(&s, 0, &root.id, "b");
    assert_eq!(s.running_rollout_of_session(sess.id).unwrap(), Some(a.id));
    let mut first = ExecRecord::new(vec!["sh".into(), "-c".into(), "make".into()]);
    first.output(false, &[b'x'; 3000]);
    first.output(false, &[b'y'; 3000]);
    first.output(true, b"warn\xff");
    first.exit_code = Some(2);
    first.duration_ms = 17;
    let mut second = ExecRecord::new(vec!["cat".into(), "f".into()]);
    second.error = Some("sandbox gone".into());
    for r in [&first, &second] {
        assert_eq!(s.record_rollout_exec(sess.id, r).unwrap(), Some(a.id));
    }
    let t: serde_json::Value =
        serde_json::from_slice(&s.recorded_trajectory(a.id).unwrap().unwrap()).unwrap();
    let t = t.as_array().unwrap();
    assert_eq!(t.len(), 2);
    assert_eq!(t[0]["argv"], serde_json::json!(["sh", "-c", "make"]));
    assert_eq!(
        (t[0]["exit_code"].as_i64(), t[0]["duration_ms"].as_u64()),
        (Some(2), Some(17))
    );
    let out = t[0]["stdout"].as_str().unwrap();
    assert_eq!(out.len(), EXEC_RECORD_KEEP_BYTES);
    assert_eq!(out.matches('y').count(), EXEC_RECORD_KEEP_BYTES - 3000);
    assert_eq!(t[0]["stderr"], "warn\u{fffd}");
    assert!(t[0].get("error").is_none());
    assert_eq!(
        (t[1]["exit_code"].is_null(), t[1]["error"].as_str()),
        (true, Some("sandbox gone"))
    );
    // Running: nothing folds.
    assert_eq!(s.fold_rollout_execs(), 0);
    // Its sandbox lost: the attempt ends infra_failed, keeping the record.
    lose_sandbox(&s, sess.id, ga);
    assert_eq!(s.sync_rollouts(false).unwrap(), 1);
    assert_eq!(s.rollout(a.id).unwrap().trajectory, None, "not folded yet");
    assert_eq!(
        s.record_rollout_exec(sess.id, &first).unwrap(),
        None,
        "an ended attempt records nothing more"
    );
    assert_eq!(s.fold_rollout_execs(), 1);
    let ended = s.rollout(a.id).unwrap();
    assert_eq!(ended.status, RolloutStatus::InfraFailed);
    let blob = s.blob(ended.trajectory.as_deref().unwrap()).unwrap();
    let kept: serde_json::Value = serde_json::from_slice(&blob).unwrap();
    assert_eq!(kept.as_array().unwrap(), t);
    assert_eq!(s.recorded_trajectory(a.id).unwrap(), None, "the rows went");
    assert_eq!(s.fold_rollout_execs(), 0);
    // Ended by its harness (with a trajectory of its own): the rows go in
    // the end's transaction, the harness's trajectory stays.
    let (b, _, sb) = running_attempt(&s, 1, &root.id, "c");
    s.record_rollout_exec(sb.id, &second).unwrap().unwrap();
    let mut mine = completed(1.0, false);
    mine.trajectory = Some(s.put_blob(b"[]").unwrap().0);
    let e = s.end_rollout(b.id, &mine, Disposition::Discard).unwrap();
    assert_eq!(e.trajectory, mine.trajectory);
    assert_eq!(s.recorded_trajectory(b.id).unwrap(), None);
    // Ended by its harness without one: the rows stay through the end (a
    // command that ended meanwhile is kept), then the fold stores them.
    let (c, _, sc) = running_attempt(&s, 2, &root.id, "d");
    s.record_rollout_exec(sc.id, &first).unwrap().unwrap();
    assert!(
        !s.fold_rollout_execs_of(c.id).unwrap(),
        "running: nothing folds"
    );
    let e = s
        .end_rollout(c.id, &completed(0.5, false), Disposition::Discard)
        .unwrap();
    assert_eq!(e.trajectory, None);
    assert_eq!(s.record_rollout_exec(sc.id, &second).unwrap(), None);
    assert!(s.fold_rollout_execs_of(c.id).unwrap());
    let kept: serde_json::Value = serde_json::from_slice(
        &s.blob(s.rollout(c.id).unwrap().trajectory.as_deref().unwrap())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(kept.as_array().unwrap().len(), 1);
    assert!(!s.fold_rollout_execs_of(c.id).unwrap(), "once");
}

#[test]
fn a_repeated_end_must_ask_the_keep_the_first_end_recorded() {
    let d = tmp();
    let (s, _run, root) = rollout_store(d.path());
    // Discarded with its live sandbox: a repeat asking for the checkpoint is
    // refused by name (nothing could be kept now); the same repeat answers.
    let (a, _, _) = running_attempt(&s, 0, &root.id, "a");
    let first = s
        .end_rollout(a.id, &completed(1.0, true), Disposition::Discard)
        .unwrap();
    let err = s
        .end_rollout(a.id, &completed(1.0, true), Disposition::Keep)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("ended already with keep DISCARD")
            && msg.contains("no checkpoint can be kept"),
        "{msg}"
    );
    let again = s
        .end_rollout(a.id, &completed(1.0, true), Disposition::Prune)
        .unwrap();
    assert_eq!((again.status, again.reward), (first.status, first.reward));
    // Ended asking to keep (a checkpoint made for grading, or none): a
    // repeat asking to discard is refused, the same repeat answered.
    let b = begun(begin(&s, 1, 1, &root.id));
    s.end_rollout(b.id, &completed(0.5, false), Disposition::Keep)
        .unwrap();
    let err = s
        .end_rollout(b.id, &completed(0.5, false), Disposition::Prune)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
    assert!(err.to_string().contains("with keep CHECKPOINT"), "{err}");
    s.end_rollout(b.id, &completed(0.5, false), Disposition::Keep)
        .unwrap();
    // A remote attempt's end records its keep too.
    let c = begun(begin(&s, 2, 1, &root.id));
    let err = s
        .end_remote_rollout(
            c.id,
            &completed(0.5, false),
            Some(&root.id),
            EndKeep::Discard,
        )
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    // An end the daemon made (no keep asked) compares without it.
    let (e, ga, sess) = running_attempt(&s, 3, &root.id, "e");
    lose_sandbox(&s, sess.id, ga);
    assert_eq!(s.sync_rollouts(false).unwrap(), 1);
    let lost = s.rollout(e.id).unwrap();
    let repeat = RolloutEnding {
        result: RolloutResult::InfraFailed {
            kind: lost.infra_kind.clone().unwrap(),
        },
        evaluator: None,
        ..completed(0.0, false)
    };
    for how in [Disposition::Keep, Disposition::Prune] {
        let r = s.end_rollout(e.id, &repeat, how).unwrap();
        assert_eq!(r.status, RolloutStatus::InfraFailed);
    }
}

#[test]
fn an_attempt_whose_sandbox_was_interrupted_ends_infra_failed_never_rewarded() {
    let d = tmp();
    let (s, run, root) = rollout_store(d.path());
    let owner = Owner::Sandbox { name: "a".into() };
    let a = begun(begin(&s, 0, 1, &root.id));
    let (ga, sess, _, _) = s.start_attempt(&root.id, &owner, None).unwrap();
    s.attach_rollout_session(a.id, sess.id, Some(ga.id))
        .unwrap();
    // The sandbox still runs: an end without its session is refused.
    let err = s
        .end_rollout(a.id, &completed(1.0, false), Disposition::Keep)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
    lose_sandbox(&s, sess.id, ga.id);
    // A never-started attempt (no session) ends at the daemon's start.
    // (Every rollout write first ends what an infrastructure failure ended.)
    let b = begun(begin(&s, 1, 1, &root.id));
    assert_eq!(s.rollout(a.id).unwrap().status, RolloutStatus::InfraFailed);
    assert_eq!(s.sync_rollouts(false).unwrap(), 0);
    assert_eq!(s.rollout(b.id).unwrap().status, RolloutStatus::Running);
    assert_eq!(s.sync_rollouts(true).unwrap(), 1);
    let ea = s.rollout(a.id).unwrap();
    assert_eq!(
        (ea.status, ea.infra_kind.as_deref(), ea.reward),
        (RolloutStatus::InfraFailed, Some("daemon-restart"), None)
    );
    assert_eq!(
        s.rollout(b.id).unwrap().infra_kind.as_deref(),
        Some("daemon-restart")
    );
    let audit = s.audit_run(&run).unwrap();
    assert_eq!(
        (
            audit.rewarded,
            audit.running,
            audit.infra_failed.get("daemon-restart")
        ),
        (0, 0, Some(&2))
    );
}

#[test]
fn a_remote_attempt_survives_recovery_and_ends_once_with_a_child_of_its_node() {
    let d = tmp();
    let (s, run, root) = rollout_store(d.path());
    let a = begun(begin_on(&s, 0, 1, &root.id, "ray-node-a"));
    assert_eq!(
        (a.worker.as_deref(), a.session, a.graph_attempt),
        (Some("ray-node-a"), None, None)
    );
    // The same call again is the same attempt; on another worker it is refused
    // naming both; a local begin of it too.
    let Begun::Attempt {
        attempt: again,
        created,
    } = begin_on(&s, 0, 1, &root.id, "ray-node-a")
    else {
        panic!()
    };
    assert_eq!((again.id, created), (a.id, false));
    let mut other = RolloutBegin {
        key: a.key.clone(),
        attempt: 1,
        node: root.id.clone(),
        policy: "pi-1".into(),
        seed: Some(7),
        worker: Some("ray-node-b".into()),
    };
    let err = s.begin_rollout(&other).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("ray-node-a") && msg.contains("ray-node-b"),
        "{msg}"
    );
    other.worker = None;
    let err = s.begin_rollout(&other).unwrap_err();
    assert!(err.to_string().contains("locally"), "{err}");
    other.worker = Some(String::new());
    assert_eq!(
        s.begin_rollout(&other).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    // A remote attempt has no sandbox here: none can be attached.
    let owner = Owner::Sandbox { name: "x".into() };
    let (ga, sess, _, _) = s.start_attempt(&root.id, &owner, None).unwrap();
    let err = s
        .attach_rollout_session(a.id, sess.id, Some(ga.id))
        .unwrap_err();
    assert!(err.to_string().contains("ray-node-a"), "{err}");
    s.end_attempt(ga.id, AttemptStatus::Abandoned, "test")
        .unwrap();
    // The daemon's start recovery ends local attempts without a sandbox,
    // never a remote one.
    let local = begun(begin(&s, 1, 1, &root.id));
    assert_eq!(s.sync_rollouts(true).unwrap(), 1);
    assert_eq!(
        s.rollout(local.id).unwrap().status,
        RolloutStatus::InfraFailed
    );
    assert_eq!(s.rollout(a.id).unwrap().status, RolloutStatus::Running);
    // The worker's checkpoint, pulled here: a child of the attempt's node.
    let child = checkpoint_child(&s, &root.id, "result.txt", "{}");
    let grandchild = checkpoint_child(&s, &child.id, "deeper.txt", "{}");
    // A node that is not a child, one that is not here: refused, nothing ends.
    let err = s
        .end_remote_rollout(
            a.id,
            &completed(0.5, true),
            Some(&grandchild.id),
            EndKeep::Checkpoint,
        )
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
    assert!(
        err.to_string().contains("not a child") && err.to_string().contains(&child.id),
        "{err}"
    );
    let err = s
        .end_remote_rollout(
            a.id,
            &completed(0.5, true),
            Some("n0000000000000000"),
            EndKeep::Checkpoint,
        )
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert!(err.to_string().contains("pull it first"), "{err}");
    assert_eq!(s.rollout(a.id).unwrap().status, RolloutStatus::Running);
    // A local attempt given a result node is refused.
    let local2 = begun(begin(&s, 2, 1, &root.id));
    let err = s
        .end_remote_rollout(
            local2.id,
            &completed(0.5, false),
            Some(&child.id),
            EndKeep::Checkpoint,
        )
        .unwrap_err();
    assert!(err.to_string().contains("is local"), "{err}");
    // Attempt 2 of the same sample on the other worker (a retry that raced
    // the first one's result).
    let b = begun(begin_on(&s, 0, 2, &root.id, "ray-node-b"));
    // The end: reward, kept node and backpropagation from it, once.
    let e = s
        .end_remote_rollout(
            a.id,
            &completed(0.5, true),
            Some(&child.id),
            EndKeep::Checkpoint,
        )
        .unwrap();
    assert_eq!(
        (
            e.status,
            e.applied,
            e.result_node.as_deref(),
            e.worker.as_deref()
        ),
        (
            RolloutStatus::Completed,
            true,
            Some(child.id.as_str()),
            Some("ray-node-a")
        )
    );
    let dup = s
        .end_remote_rollout(
            a.id,
            &completed(0.5, true),
            Some(&child.id),
            EndKeep::Checkpoint,
        )
        .unwrap();
    assert_eq!(dup, e);
    let err = s
        .end_remote_rollout(
            a.id,
            &completed(0.5, true),
            Some(&grandchild.id),
            EndKeep::Checkpoint,
        )
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
    assert_eq!(s.node_stats(&child.id).unwrap().visits, 1);
    assert_eq!(s.node_stats(&root.id).unwrap().visits, 1);
    // The racing attempt completes, never applied.
    let eb = s
        .end_remote_rollout(
            b.id,
            &completed(0.9, false),
            Some(&child.id),
            EndKeep::Checkpoint,
        )
        .unwrap();
    assert_eq!((eb.status, eb.applied), (RolloutStatus::Completed, false));
    // A remote attempt ends infra_failed (node-lost) without a node; with
    // one it is refused.
    let c = begun(begin_on(&s, 3, 1, &root.id, "ray-node-b"));
    let lost = RolloutEnding {
        result: RolloutResult::InfraFailed {
            kind: "node-lost".into(),
        },
        evaluator: None,
        trajectory: None,
        artifacts: Vec::new(),
        backprop: None,
        message: "worker ray-node-b died".into(),
    };
    assert_eq!(
        s.end_remote_rollout(c.id, &lost, Some(&child.id), EndKeep::Checkpoint)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );
    let ec = s
        .end_remote_rollout(c.id, &lost, None, EndKeep::Checkpoint)
        .unwrap();
    assert_eq!(
        (ec.status, ec.infra_kind.as_deref()),
        (RolloutStatus::InfraFailed, Some("node-lost"))
    );
    let sample = s.sample(&a.key).unwrap();
    assert_eq!((sample.reward, sample.reward_attempt), (Some(0.5), Some(1)));
    let audit = s.audit_run(&run).unwrap();
    assert_eq!(audit.violations, Vec::<String>::new());
    assert_eq!(audit.infra_failed.get("node-lost"), Some(&1));
    assert_eq!(
        audit.by_worker,
        BTreeMap::from([("ray-node-a".to_string(), 1), ("ray-node-b".to_string(), 2)])
    );
}

/// Turns a format 14 store into what format 13 was: no `rollout_attempts.worker`.
const TO_FORMAT_13: &str = "ALTER TABLE rollout_attempts DROP COLUMN end_keep;
     ALTER TABLE sessions DROP COLUMN id_map;
     ALTER TABLE rollout_attempts DROP COLUMN worker;
     UPDATE meta SET value = '13' WHERE key = 'format_version';";

#[test]
fn a_format_13_store_is_migrated_and_keeps_its_attempts_local() {
    let d = tmp();
    let (s, _, root) = rollout_store(d.path());
    let a = begun(begin(&s, 0, 1, &root.id));
    drop(s);
    let db = rusqlite::Connection::open(d.path().join("root/store.db")).unwrap();
    db.execute_batch(TO_FORMAT_13).unwrap();
    drop(db);
    let s = open(d.path());
    assert_eq!(format_version(&s), FORMAT_VERSION.to_string());
    assert_eq!(s.rollout(a.id).unwrap().worker, None);
    let b = begun(begin_on(&s, 1, 1, &root.id, "w"));
    assert_eq!(s.rollout(b.id).unwrap().worker.as_deref(), Some("w"));
}

#[test]
fn a_frontier_node_is_never_pruned_until_released_and_priors_sit_beside_it() {
    let d = tmp();
    let (s, _, root) = rollout_store(d.path());
    s.lease_frontier("mcts-1", std::slice::from_ref(&root.id))
        .unwrap();
    s.lease_frontier("mcts-1", std::slice::from_ref(&root.id))
        .unwrap();
    let err = s.prune_node(&root.id, None).unwrap_err();
    assert!(err.to_string().contains("frontier of mcts-1"), "{err}");
    assert_eq!(
        s.node_stats(&root.id).unwrap().frontier,
        vec!["mcts-1".to_string()]
    );
    assert_eq!(s.frontier("mcts-1").unwrap(), vec![root.id.clone()]);
    let st = s.set_prior(&root.id, 0.25).unwrap();
    assert_eq!((st.prior, st.visits), (Some(0.25), 0));
    for bad in [-2.0, f64::NAN, f64::INFINITY] {
        let e = s.set_prior(&root.id, bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    }
    assert_eq!(s.node_stats(&root.id).unwrap().prior, Some(0.25));
    assert_eq!(s.release_frontier("mcts-1", &[]).unwrap(), 1);
    assert!(s.frontier("mcts-1").unwrap().is_empty());
    // Blobs are content-addressed and idempotent.
    let (dg, n) = s.put_blob(b"trajectory").unwrap();
    assert_eq!(
        (s.put_blob(b"trajectory").unwrap(), n),
        ((dg.clone(), 10), 10)
    );
    assert_eq!(s.blob(&dg).unwrap(), b"trajectory");
    assert_eq!(
        s.blob("blake3:../x").unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
}

#[test]
fn fsck_finds_what_disagrees_with_the_filesystem_and_repairs_only_the_safe_part() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/m", &top, BTreeMap::new(), false)
        .unwrap();
    let m = s.find_session("default", "m").unwrap().unwrap();
    std::fs::write(m.upper.join("f"), b"1").unwrap();
    std::fs::write(m.upper.join("g"), b"2").unwrap();
    let p = publish(&s, m.id, &[write_entry(b"f", 1), write_entry(b"g", 2)]);
    let clean = s.fsck(false).unwrap();
    assert_eq!(clean.problems, Vec::new(), "a sound store");
    assert!(
        clean.layers >= 2 && clean.paths >= 2 && clean.manifests >= 1,
        "{clean:?}"
    );
    // Break it: an orphan directory, a file gone from a published layer, a lease
    // whose session never existed.
    std::fs::create_dir_all(s.root().join("l/99999/x")).unwrap();
    std::fs::remove_file(s.layer_path(p.layer).join("g")).unwrap();
    s.db.write(|tx| {
        Ok(tx.execute(
            "INSERT INTO leases(manifest_id, holder_kind, holder, created_ns) SELECT manifest_id, 'session', '424242', 0 FROM branches LIMIT 1",
            [],
        )?)
    })
    .unwrap();
    let r = s.fsck(false).unwrap();
    let kinds: BTreeSet<&str> = r.problems.iter().map(|p| p.kind).collect();
    assert_eq!(
        kinds,
        ["dangling-lease", "index-mismatch", "orphan-directory"].into(),
        "{r:?}"
    );
    assert!(r.problems.iter().all(|p| !p.repaired));
    let g = r
        .problems
        .iter()
        .find(|p| p.kind == "index-mismatch")
        .unwrap();
    assert!(
        g.subject.ends_with("/g") || g.subject.ends_with(" g"),
        "{g:?}"
    );
    assert!(s.root().join("l/99999").exists(), "a check changes nothing");
    // Repair: the orphan goes, the lease is released; the lost file stays reported.
    let fixed = s.fsck(true).unwrap();
    assert_eq!(fixed.unrepaired(), 1, "{fixed:?}");
    assert!(!s.root().join("l/99999").exists());
    let again = s.fsck(false).unwrap();
    assert_eq!(
        again.problems.iter().map(|p| p.kind).collect::<Vec<_>>(),
        vec!["index-mismatch"]
    );
    // An outcome history does not bear out: the committed publish's manifest
    // with another layer on top.
    assert_eq!(again.outcomes, 1, "{again:?}");
    s.db.write(|tx| {
        Ok(tx.execute(
            "UPDATE manifests SET layer_id = NULL WHERE id = (SELECT manifest_after FROM publishes WHERE outcome = 'committed')",
            [],
        )?)
    })
    .unwrap();
    let r = s.fsck(false).unwrap();
    let o = r
        .problems
        .iter()
        .find(|p| p.kind == "outcome-history")
        .unwrap_or_else(|| panic!("{r:?}"));
    assert!(
        o.subject.starts_with(&format!("session {} ", m.id))
            && o.detail.contains(&format!("layer {}", p.layer)),
        "{o:?}"
    );
    // And against heads: the branch moved back past the committed layer (by
    // hand: nothing in LayerStack moves a branch backwards).
    s.db.write(|tx| {
        Ok(tx.execute(
            "UPDATE manifests SET layer_id = ?1 WHERE id = (SELECT manifest_after FROM publishes WHERE outcome = 'committed')",
            [p.layer],
        )?)
    })
    .unwrap();
    assert!(
        !s.fsck(false)
            .unwrap()
            .problems
            .iter()
            .any(|p| p.kind == "outcome-history"),
        "restored"
    );
    s.db.write(|tx| {
        Ok(tx.execute(
            "UPDATE branches SET manifest_id = (SELECT manifest_before FROM publishes WHERE outcome = 'committed')",
            [],
        )?)
    })
    .unwrap();
    let r = s.fsck(false).unwrap();
    let o = r
        .problems
        .iter()
        .find(|p| p.kind == "outcome-history")
        .unwrap_or_else(|| panic!("{r:?}"));
    assert!(
        o.detail.contains("not in the history") && o.detail.contains("@main"),
        "{o:?}"
    );
}

/// A key names one request: the same key with the same arguments answers the
/// first call; with other arguments (another stack target, policy, node,
/// branch, state) it is refused `FailedPrecondition`, naming the key and each
/// argument that differs, and nothing is done.
#[test]
fn idempotency_keys_are_checked_against_their_arguments() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/m", &top, BTreeMap::new(), false)
        .unwrap();
    let stack = s.find_session("default", "m").unwrap().unwrap().stack;
    let owner = Owner::Sandbox { name: "a".into() };
    let main = LeaseTarget::Branch("main".into());
    let opts = SessionOptions {
        exit_policy: Some("never".into()),
        ..Default::default()
    };
    let (first, _, created) = s
        .create_session_with(&owner, &stack, &main, Some("k1"), &opts)
        .unwrap();
    assert!(created);
    // A retry from another process (another default owner name): the same.
    let other_name = Owner::Sandbox { name: "b".into() };
    let (again, _, created) = s
        .create_session_with(&other_name, &stack, &main, Some("k1"), &opts)
        .unwrap();
    assert_eq!((again.id, created), (first.id, false));
    let sessions = s.sessions().unwrap().len();
    for (target, o, differs) in [
        (LeaseTarget::Branch("dev".into()), opts.clone(), "target"),
        (
            main.clone(),
            SessionOptions {
                exit_policy: Some("on-exit".into()),
                ..Default::default()
            },
            "policy",
        ),
        (
            main.clone(),
            SessionOptions {
                ignore_mtime: true,
                ..opts.clone()
            },
            "ignore_mtime",
        ),
    ] {
        let e = s
            .create_session_with(&owner, &stack, &target, Some("k1"), &o)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::FailedPrecondition, "{e}");
        let m = e.to_string();
        assert!(
            m.contains("\"k1\"") && m.contains(differs) && m.contains("new key"),
            "{m}"
        );
    }
    assert_eq!(s.sessions().unwrap().len(), sessions, "nothing was created");

    // Graph operations: create, attempts, prune.
    let (_, root) = s.create_group("g", &stack, "main", Some("g1")).unwrap();
    let (_, again) = s.create_group("g", &stack, "main", Some("g1")).unwrap();
    assert_eq!(again.id, root.id);
    let e = s.create_group("h", &stack, "main", Some("g1")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition, "{e}");
    assert!(e.to_string().contains("name \"g\" then, \"h\" now"), "{e}");
    let (a, _, _, _) = s.start_attempt(&root.id, &owner, Some("a1")).unwrap();
    let (a2, _, _, created) = s.start_attempt(&root.id, &owner, Some("a1")).unwrap();
    assert_eq!((a2.id, created), (a.id, false));
    let e = s
        .start_attempt_with(&root.id, &owner, Some("a1"), &opts)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition, "{e}");
    assert!(e.to_string().contains("policy"), "{e}");
    // A sandbox's key names one kind of sandbox: a stack's session's key
    // does not start a node's attempt, nor the other way round.
    let e = s
        .start_attempt_with(&root.id, &owner, Some("k1"), &opts)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition, "{e}");
    assert!(
        e.to_string().contains(&format!("(session {})", first.id)),
        "{e}"
    );
    let e = s
        .create_session_with(
            &owner,
            &stack,
            &main,
            Some("a1"),
            &SessionOptions::default(),
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition, "{e}");
    assert!(
        e.to_string().contains(&format!("(attempt {})", a.id)),
        "{e}"
    );
    // The key of another operation: refused as before.
    let e = s.prune_node(&root.id, Some("g1")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    // A client key cannot pose as an arguments row.
    let e = s
        .create_session_with(&owner, &stack, &main, Some("\u{1}args\u{1}x"), &opts)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
}

/// Node ids are `n` + 16 random hex digits, so two stores never mint the same
/// one (a pulled node keeps its id); an id of the old shape (`n1`) stays valid.
#[test]
fn node_ids_are_random_unique_across_stores_and_old_ids_stay_valid() {
    let shape = |id: &str| {
        id.len() == 17
            && id.starts_with('n')
            && id[1..]
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let mut seen = BTreeSet::new();
    let (d1, d2) = (tmp(), tmp());
    let mut stores = Vec::new();
    for d in [&d1, &d2] {
        let s = open(d.path());
        let top = unpack(&s, "default");
        s.prepare("default/5/m", &top, BTreeMap::new(), false)
            .unwrap();
        let stack = s.find_session("default", "m").unwrap().unwrap().stack;
        for g in 0..20 {
            let (_, root) = s
                .create_group(&format!("g{g}"), &stack, "main", None)
                .unwrap();
            assert!(shape(&root.id), "{}", root.id);
            assert!(seen.insert(root.id.clone()), "{} minted twice", root.id);
        }
        stores.push((s, stack));
    }
    // A store of format 11 holds ids `n1`, `n2`…: read, activated and
    // listed as before, next to new ones.
    let (s, stack) = &stores[0];
    let mine = s.groups().unwrap()[0].root.clone();
    s.db.write(|tx| {
        tx.execute("UPDATE graph_nodes SET id = 'n1' WHERE id = ?1", [&mine])?;
        tx.execute(
            "UPDATE graph_groups SET root = 'n1' WHERE root = ?1",
            [&mine],
        )?;
        Ok(())
    })
    .unwrap();
    let old = s.node("n1").unwrap();
    let owner = Owner::Sandbox { name: "old".into() };
    let (a, _, _, _) = s.start_attempt(&old.id, &owner, None).unwrap();
    assert_eq!(a.node, "n1");
    let (_, root) = s.create_group("after", stack, "main", None).unwrap();
    assert!(shape(&root.id) && root.id != "n1", "{}", root.id);
}

fn sha(c: char) -> String {
    format!("sha256:{}", c.to_string().repeat(64))
}

/// Layer blob records (format 13): recorded per compression, found by diff
/// ID for reuse, checked, and deleted with their layer.
#[test]
fn layer_blobs_are_recorded_found_by_diff_id_and_go_with_their_layer() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    let stack = "default/sha256:bbb";
    let sid = container_session(&s, &top, 5, "c1");
    let upper = s.session(sid).unwrap().upper;
    std::fs::write(upper.join("a.txt"), b"hello").unwrap();
    let p = publish(&s, sid, &[write_entry(b"a.txt", 1)]);
    let gz = LayerBlob {
        layer: p.layer,
        compression: BlobCompression::Gzip,
        digest: sha('a'),
        diff_id: sha('d'),
        size: 123,
    };
    assert_eq!(s.layer_blob(p.layer, BlobCompression::Gzip).unwrap(), None);
    assert_eq!(s.layer_by_diff_id(&sha('d'), None).unwrap(), None);
    s.record_layer_blob(&gz).unwrap();
    assert_eq!(
        s.layer_blob(p.layer, BlobCompression::Gzip).unwrap(),
        Some(gz.clone())
    );
    assert_eq!(s.layer_blob(p.layer, BlobCompression::Zstd).unwrap(), None);
    assert_eq!(s.layer_by_diff_id(&sha('d'), None).unwrap(), Some(p.layer));
    assert_eq!(
        s.layer_by_diff_id(&sha('d'), Some(stack)).unwrap(),
        Some(p.layer)
    );
    assert_eq!(
        s.layer_by_diff_id(&sha('d'), Some("other/sha256:ccc"))
            .unwrap(),
        None,
        "a layer of another stack is not offered"
    );
    assert_eq!(s.layer_by_diff_id(&sha('e'), None).unwrap(), None);
    // Again, from a newer compressor: the digest and size are replaced.
    let newer = LayerBlob {
        digest: sha('b'),
        size: 120,
        ..gz.clone()
    };
    s.record_layer_blob(&newer).unwrap();
    let zst = LayerBlob {
        compression: BlobCompression::Zstd,
        digest: sha('c'),
        size: 99,
        ..gz.clone()
    };
    s.record_layer_blob(&zst).unwrap();
    assert_eq!(s.layer_blobs(p.layer).unwrap(), vec![newer.clone(), zst]);
    // Refused: another diff ID for the same layer, malformed digests, an
    // uncompressed blob that is not its tar, a layer that is not there.
    let e = s
        .record_layer_blob(&LayerBlob {
            compression: BlobCompression::Zstd,
            diff_id: sha('e'),
            ..gz.clone()
        })
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition, "{e}");
    assert!(e.to_string().contains(&sha('d')), "{e}");
    let e = s
        .record_layer_blob(&LayerBlob {
            digest: "sha256:xyz".into(),
            ..gz.clone()
        })
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let e = s
        .record_layer_blob(&LayerBlob {
            compression: BlobCompression::None,
            ..gz.clone()
        })
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let e = s
        .record_layer_blob(&LayerBlob {
            layer: 9999,
            ..gz.clone()
        })
        .unwrap_err();
    assert!(matches!(e, StoreError::LayerNotFound(9999)), "{e}");
    assert_eq!(s.layer_blobs(p.layer).unwrap().len(), 2, "nothing changed");
    // A base layer is recorded too, and found for its stack.
    let base = s.stacks().unwrap()[0].base_layers[0];
    s.record_layer_blob(&LayerBlob {
        layer: base,
        compression: BlobCompression::None,
        digest: sha('f'),
        diff_id: sha('f'),
        size: 10240,
    })
    .unwrap();
    assert_eq!(
        s.layer_by_diff_id(&sha('f'), Some(stack)).unwrap(),
        Some(base)
    );
    // The stack goes, GC collects its published layer: its rows go with it.
    s.remove_stack(stack, true).unwrap();
    let gc = s.gc(&[]).unwrap();
    assert!(gc.layers.contains(&p.layer), "{gc:?}");
    assert!(s.layer_blobs(p.layer).unwrap().is_empty());
    assert_eq!(s.layer_by_diff_id(&sha('d'), None).unwrap(), None);
}

/// Turns a format 14 store into what format 12 was: no `layer_blobs`, no
/// `rollout_attempts.worker`.
const TO_FORMAT_12: &str = "ALTER TABLE rollout_attempts DROP COLUMN end_keep;
     ALTER TABLE sessions DROP COLUMN id_map;
     ALTER TABLE rollout_attempts DROP COLUMN worker;
     DROP TABLE layer_blobs;
     UPDATE meta SET value = '12' WHERE key = 'format_version';";

#[test]
fn a_format_12_store_is_migrated_and_gets_layer_blobs() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    let sid = container_session(&s, &top, 5, "c1");
    let p = publish(&s, sid, &[write_entry(b"a.txt", 1)]);
    drop(s);
    let db = rusqlite::Connection::open(d.path().join("root/store.db")).unwrap();
    db.execute_batch(TO_FORMAT_12).unwrap();
    drop(db);
    let s = open(d.path());
    assert_eq!(format_version(&s), FORMAT_VERSION.to_string());
    let b = LayerBlob {
        layer: p.layer,
        compression: BlobCompression::Gzip,
        digest: sha('a'),
        diff_id: sha('d'),
        size: 1,
    };
    s.record_layer_blob(&b).unwrap();
    assert_eq!(s.layer_by_diff_id(&sha('d'), None).unwrap(), Some(p.layer));
}

const BASE: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";

/// A store whose only stack is an imported base holding `etc/motd`
/// (the same stack id in every store).
fn imported(d: &Path) -> (Store, String) {
    let s = open(d);
    let (dir, _g) = s.staging_dir("import").unwrap();
    std::fs::create_dir(dir.join("etc")).unwrap();
    std::fs::write(dir.join("etc/motd"), b"hi\n").unwrap();
    let b = s.import_base(&dir, BASE).unwrap();
    (s, b.stack)
}

/// Checkpoints a new child of `node` whose layer holds `file`; returns it.
fn checkpoint_child(s: &Store, node: &str, file: &str, state: &str) -> NodeInfo {
    let owner = Owner::Sandbox {
        name: format!("w-{file}"),
    };
    let (_, sess, _, _) = s.start_attempt(node, &owner, None).unwrap();
    std::fs::write(sess.upper.join(file), file.as_bytes()).unwrap();
    let index = [write_entry(file.as_bytes(), 7)];
    let paths: Vec<PathRecord> = index
        .iter()
        .map(|e| PathRecord {
            path: e.path.clone(),
            status: PathStatus::Clean,
            reason: "new".into(),
        })
        .collect();
    let staged = s.stage_publish(sess.id, &index, &paths).unwrap();
    let prov = Provenance {
        command: Some(format!("write {file}")),
        labels: labels(&[("who", "test")]),
        exit_status: Some(0),
        private_bytes: Some(4096),
    };
    s.commit_checkpoint(sess.id, staged, state, &prov, None, None, None)
        .unwrap()
}

/// `layer`'s directory copied into a fresh staging directory of `to`.
fn stage_copy(to: &Store, layer_dir: &Path) -> PathBuf {
    let (dir, _g) = to.staging_dir("pull").unwrap();
    for e in std::fs::read_dir(layer_dir).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    dir
}

fn adopt_node_of(n: &NodeInfo, g: &GroupInfo) -> AdoptNode {
    AdoptNode::of(n, g)
}

/// Staged pulls left in staging (the reaper's own entries do not count).
fn pulls_staged(s: &Store) -> usize {
    std::fs::read_dir(s.staging_path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("pull-")
        })
        .count()
}

fn count(s: &Store, sql: &str) -> i64 {
    s.db.read(|c| Ok(c.query_row(sql, [], |r| r.get(0))?))
        .unwrap()
}

/// A node made in one store is adopted by another with its id, provenance,
/// layers (renamed in from staging), path index and blob records, in one
/// transaction; adopting it again, or one whose layers are there, copies
/// nothing; another node under the same id, a graph of the same name with
/// another root, and bad input are refused with nothing left behind.
#[test]
fn a_node_of_another_store_is_adopted_once_with_its_id_and_layers() {
    let (da, db) = (tmp(), tmp());
    let (a, stack) = imported(da.path());
    let (b, stack_b) = imported(db.path());
    assert_eq!(stack, stack_b, "one content, one stack id in every store");
    let (ga, root) = a.create_group("task", &stack, "main", None).unwrap();
    let child = checkpoint_child(&a, &root.id, "x.txt", r#"{"score": 0.5}"#);
    let grand = checkpoint_child(&a, &child.id, "y.txt", r#"{"score": 0.9}"#);
    let layer_of = |s: &Store, n: &NodeInfo| -> Vec<LayerId> {
        let mut v =
            s.db.read(|c| crate::stacks::manifest_layers(c, n.manifest))
                .unwrap();
        v.reverse();
        v
    };
    let a_layers = layer_of(&a, &grand);
    assert_eq!(a_layers.len(), 2);
    let diff = |c: char| format!("sha256:{}", c.to_string().repeat(64));
    // A blob's digest: another sha256 than its diff ID.
    let blob_digest = |c: char| format!("sha256:{c}{}", "0".repeat(63));
    let blob = |c: char| BlobRef {
        compression: BlobCompression::Gzip,
        digest: blob_digest(c),
        size: 100,
    };
    let pulled = |to: &Store, layer: LayerId, c: char| AdoptLayer {
        source: LayerSource::Staged {
            dir: stage_copy(to, &a.layer_path(layer)),
            index: a.layer_index(layer).unwrap(),
        },
        diff_id: diff(c),
        tar_size: Some(10240),
        blobs: vec![blob(c)],
    };
    let layers_before = count(&b, "SELECT count(*) FROM layers");
    let manifests_before = count(&b, "SELECT count(*) FROM manifests");

    // The child: one layer, its parent (the origin's root) not here.
    let got = b
        .adopt_node(
            &stack,
            &[pulled(&b, a_layers[0], 'a')],
            &adopt_node_of(&child, &ga),
        )
        .unwrap();
    assert!(got.created);
    assert_eq!(got.node.id, child.id, "the node keeps its id");
    assert_eq!(
        (
            got.node.kind,
            &got.node.state,
            &got.node.command,
            &got.node.labels
        ),
        (
            NodeKind::Checkpoint,
            &child.state,
            &child.command,
            &child.labels
        )
    );
    assert_eq!(
        (
            got.node.exit_status,
            got.node.private_bytes,
            got.node.created_ns
        ),
        (Some(0), Some(4096), child.created_ns)
    );
    assert_eq!(got.missing_parents, vec![root.id.clone()]);
    assert!(got.node.parents.is_empty(), "no edge to a node not here");
    assert_eq!(got.layers, got.new_layers);
    let l1 = got.layers[0];
    assert_eq!(
        std::fs::read(b.layer_path(l1).join("x.txt")).unwrap(),
        b"x.txt"
    );
    assert_eq!(
        b.layer_index(l1).unwrap(),
        a.layer_index(a_layers[0]).unwrap()
    );
    assert_eq!(
        b.layer_blob(l1, BlobCompression::Gzip).unwrap().unwrap(),
        LayerBlob {
            layer: l1,
            compression: BlobCompression::Gzip,
            digest: blob_digest('a'),
            diff_id: diff('a'),
            size: 100
        }
    );
    assert_eq!(
        b.layer_by_diff_id(&diff('a'), Some(&stack)).unwrap(),
        Some(l1)
    );
    let g = b.node_group(&child.id).unwrap();
    assert_eq!(
        (g.name.as_str(), g.root.as_str(), g.stack.as_str()),
        ("task", root.id.as_str(), stack.as_str())
    );
    assert_eq!(pulls_staged(&b), 0, "staging emptied");
    // It runs: an attempt's lowers are its layer over the base.
    let owner = Owner::Sandbox { name: "b1".into() };
    let (_, sess, spec, _) = b.start_attempt(&child.id, &owner, None).unwrap();
    let MountSpec::Overlay { lowers, .. } = spec else {
        panic!("{spec:?}")
    };
    assert_eq!(lowers[0], b.layer_path(l1));
    assert_eq!(lowers.len(), 2);
    b.end_attempt(
        b.attempt_of_session(sess.id).unwrap().unwrap().id,
        AttemptStatus::Abandoned,
        "test",
    )
    .unwrap();
    b.release_session_dropping(sess.id).unwrap();
    assert_eq!(count(&b, "SELECT count(*) FROM layers"), layers_before + 1);

    // Again (a second pull): nothing written, the staged copy dropped.
    let again = b
        .adopt_node(
            &stack,
            &[pulled(&b, a_layers[0], 'a')],
            &adopt_node_of(&child, &ga),
        )
        .unwrap();
    assert!(!again.created);
    assert_eq!(
        (again.node.id.as_str(), again.layers.as_slice()),
        (child.id.as_str(), &[l1][..])
    );
    assert_eq!(count(&b, "SELECT count(*) FROM layers"), layers_before + 1);
    assert_eq!(pulls_staged(&b), 0);
    // And with the layer found by its diff ID: the same.
    let found = AdoptLayer {
        source: LayerSource::Existing(l1),
        diff_id: diff('a'),
        tar_size: None,
        blobs: vec![],
    };
    assert!(
        !b.adopt_node(
            &stack,
            std::slice::from_ref(&found),
            &adopt_node_of(&child, &ga)
        )
        .unwrap()
        .created
    );

    // The grandchild: its first layer is here (nothing copied), its own is
    // staged; its parent is here now: an edge.
    let manifests_mid = count(&b, "SELECT count(*) FROM manifests");
    let got2 = b
        .adopt_node(
            &stack,
            &[found.clone(), pulled(&b, a_layers[1], 'b')],
            &adopt_node_of(&grand, &ga),
        )
        .unwrap();
    assert!(got2.created);
    assert_eq!(got2.node.parents, vec![child.id.clone()]);
    assert_eq!(got2.layers[0], l1);
    assert_eq!(got2.new_layers.len(), 1);
    assert_eq!(
        count(&b, "SELECT count(*) FROM manifests"),
        manifests_mid + 1,
        "the chain reuses the child's manifest"
    );
    assert_eq!(manifests_mid, manifests_before + 1);
    // A node whose layers are all here (a sibling in another graph): no
    // layer, no manifest is added.
    let mut sibling = adopt_node_of(&child, &ga);
    sibling.id = "n00000000000000aa".into();
    sibling.group.name = "elsewhere".into();
    let layers_now = count(&b, "SELECT count(*) FROM layers");
    let manifests_now = count(&b, "SELECT count(*) FROM manifests");
    let s2 = b
        .adopt_node(&stack, std::slice::from_ref(&found), &sibling)
        .unwrap();
    assert!(s2.created && s2.new_layers.is_empty());
    assert_eq!(s2.node.manifest, got.node.manifest);
    assert_eq!(count(&b, "SELECT count(*) FROM layers"), layers_now);
    assert_eq!(count(&b, "SELECT count(*) FROM manifests"), manifests_now);

    // Refused, nothing left: the child's id with another layer…
    let e = b
        .adopt_node(
            &stack,
            &[pulled(&b, a_layers[1], 'c')],
            &adopt_node_of(&child, &ga),
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
    assert!(
        e.to_string().contains(&child.id) && e.to_string().contains(&diff('c')),
        "{e}"
    );
    // …or another state…
    let mut other = adopt_node_of(&child, &ga);
    other.state = r#"{"score": 0.1}"#.into();
    let e = b
        .adopt_node(&stack, std::slice::from_ref(&found), &other)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
    // …a graph of the same name with another root…
    let mut foreign = adopt_node_of(&child, &ga);
    foreign.id = "n00000000000000bb".into();
    foreign.group.root = Some("n0000000000000000".into());
    let e = b
        .adopt_node(&stack, &[pulled(&b, a_layers[0], 'a')], &foreign)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::FailedPrecondition, "{e}");
    assert!(e.to_string().contains("another name"), "{e}");
    // …a stack that is not here, a directory outside staging, a bad digest,
    // a base layer as a manifest layer.
    let e = b
        .adopt_node("import:sha256:nope", std::slice::from_ref(&found), &foreign)
        .unwrap_err();
    assert!(matches!(e, StoreError::StackNotFound(_)), "{e}");
    let outside = db.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let bad = AdoptLayer {
        source: LayerSource::Staged {
            dir: outside.clone(),
            index: vec![],
        },
        diff_id: diff('a'),
        tar_size: Some(10240),
        blobs: vec![],
    };
    foreign.group.root = Some(root.id.clone());
    let e = b.adopt_node(&stack, &[bad], &foreign).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(
        outside.exists(),
        "a directory outside staging is never removed"
    );
    let base = b.stacks().unwrap()[0].base_layers[0];
    let e = b
        .adopt_node(
            &stack,
            &[AdoptLayer {
                source: LayerSource::Existing(base),
                diff_id: diff('e'),
                tar_size: None,
                blobs: vec![],
            }],
            &foreign,
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    // A failure after the rename (a blob digest that is none): rolled back,
    // the directory moved back and dropped, no row.
    let mut late = pulled(&b, a_layers[0], 'd');
    late.blobs[0].digest = "sha256:short".into();
    let e = b.adopt_node(&stack, &[late], &foreign).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(count(&b, "SELECT count(*) FROM layers"), layers_now);
    assert_eq!(pulls_staged(&b), 0);
    let dirs = std::fs::read_dir(b.root().join("l")).unwrap().count() as i64;
    assert_eq!(dirs, layers_now, "no layer directory without a row");
    assert!(b.node(&foreign.id).is_err());
    let f = b.fsck(false).unwrap();
    assert!(f.problems.is_empty(), "{:?}", f.problems);

    // Pruned, the adopted layers are collected with their blob rows.
    b.prune_node(&s2.node.id, None).unwrap();
    b.prune_node(&child.id, None).unwrap();
    let gc = b.gc(&[]).unwrap();
    assert!(
        gc.layers.contains(&l1) && gc.layers.contains(&got2.new_layers[0]),
        "{gc:?}"
    );
    assert!(b.layer_blobs(l1).unwrap().is_empty());
    // Pulled again once pruned and collected: the same node revived with the
    // pulled layer (its manifest and lease anew), or refused with another state.
    let mut changed = adopt_node_of(&child, &ga);
    changed.state = r#"{"score": 0.2}"#.into();
    let e = b
        .adopt_node(&stack, &[pulled(&b, a_layers[0], 'a')], &changed)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
    let back = b
        .adopt_node(
            &stack,
            &[pulled(&b, a_layers[0], 'a')],
            &adopt_node_of(&child, &ga),
        )
        .unwrap();
    assert!(back.created && !back.node.pruned, "{back:?}");
    assert_eq!(
        (back.node.id.as_str(), back.new_layers.len()),
        (child.id.as_str(), 1)
    );
    assert_eq!(
        std::fs::read(b.layer_path(back.layers[0]).join("x.txt")).unwrap(),
        b"x.txt"
    );
    assert!(b.gc(&[]).unwrap().layers.is_empty(), "its lease keeps it");
    let owner = Owner::Sandbox { name: "b2".into() };
    b.start_attempt(&child.id, &owner, None).unwrap();
    assert_eq!(pulls_staged(&b), 0);
    let f = b.fsck(false).unwrap();
    assert!(f.problems.is_empty(), "{:?}", f.problems);
}

/// Concurrent pulls of one node, from threads and from a second store
/// instance on the same root: one adopts it, the others find it and drop
/// their staged copies.
#[test]
fn concurrent_adoptions_of_one_node_make_one_node() {
    let (da, db) = (tmp(), tmp());
    let (a, stack) = imported(da.path());
    let (b, _) = imported(db.path());
    let (ga, root) = a.create_group("task", &stack, "main", None).unwrap();
    let child = checkpoint_child(&a, &root.id, "x.txt", "{}");
    let layer =
        a.db.read(|c| crate::stacks::manifest_layers(c, child.manifest))
            .unwrap()[0];
    let layers_before = count(&b, "SELECT count(*) FROM layers");
    let b = std::sync::Arc::new(b);
    let other = std::sync::Arc::new(
        Store::open(
            &db.path().join("root"),
            &StoreOptions {
                startup_sweep: false,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let n = 6;
    let go = std::sync::Arc::new(std::sync::Barrier::new(n));
    let node = adopt_node_of(&child, &ga);
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let s = if i % 2 == 0 { b.clone() } else { other.clone() };
            let l = AdoptLayer {
                source: LayerSource::Staged {
                    dir: stage_copy(&s, &a.layer_path(layer)),
                    index: a.layer_index(layer).unwrap(),
                },
                diff_id: format!("sha256:{}", "a".repeat(64)),
                tar_size: Some(10240),
                blobs: vec![],
            };
            let (go, node, stack) = (go.clone(), node.clone(), stack.clone());
            std::thread::spawn(move || {
                go.wait();
                s.adopt_node(&stack, &[l], &node).unwrap()
            })
        })
        .collect();
    let got: Vec<Adopted> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(got.iter().filter(|a| a.created).count(), 1);
    assert!(got
        .iter()
        .all(|a| a.layers == got[0].layers && a.node.id == child.id));
    assert_eq!(count(&b, "SELECT count(*) FROM layers"), layers_before + 1);
    assert_eq!(pulls_staged(&b), 0);
    let r = b.sweep_with(SweepMode::Cleanup).unwrap();
    assert!(r.removed.is_empty() && r.missing.is_empty(), "{r:?}");
}

/// A pull that does not know the graph's root and branch (not in the
/// image's annotations): the group is made with the store's default branch
/// and the node as its root, and later nodes join it whatever their root.
#[test]
fn a_node_adopted_without_its_graphs_root_makes_or_joins_the_graph_by_name() {
    let (da, db) = (tmp(), tmp());
    let (a, stack) = imported(da.path());
    let (b, _) = imported(db.path());
    let (ga, root) = a.create_group("task", &stack, "main", None).unwrap();
    let one = checkpoint_child(&a, &root.id, "one.txt", "{}");
    let two = checkpoint_child(&a, &root.id, "two.txt", "{}");
    let staged = |n: &NodeInfo| {
        let l =
            a.db.read(|c| crate::stacks::manifest_layers(c, n.manifest))
                .unwrap()[0];
        AdoptLayer {
            source: LayerSource::Staged {
                dir: stage_copy(&b, &a.layer_path(l)),
                index: a.layer_index(l).unwrap(),
            },
            diff_id: format!("sha256:{}", n.id[1..].repeat(4)),
            tar_size: Some(10240),
            blobs: vec![],
        }
    };
    let unknown = |n: &NodeInfo| {
        let mut x = adopt_node_of(n, &ga);
        x.group.root = None;
        x.group.branch = None;
        x
    };
    let first = b
        .adopt_node(&stack, &[staged(&one)], &unknown(&one))
        .unwrap();
    let g = b.node_group(&one.id).unwrap();
    assert_eq!(
        (g.name.as_str(), g.root.as_str(), g.branch.as_str()),
        ("task", one.id.as_str(), "main")
    );
    assert!(first.created);
    let second = b
        .adopt_node(&stack, &[staged(&two)], &unknown(&two))
        .unwrap();
    assert!(second.created);
    assert_eq!(b.graph("task").unwrap().nodes.len(), 2);
}

/// The one layer of node `n` of store `a`, staged into store `to` as a pull
/// would (diff ID `diff`).
fn staged_layer_of(a: &Store, to: &Store, n: &NodeInfo, diff: char) -> AdoptLayer {
    let l =
        a.db.read(|c| crate::stacks::manifest_layers(c, n.manifest))
            .unwrap()[0];
    AdoptLayer {
        source: LayerSource::Staged {
            dir: stage_copy(to, &a.layer_path(l)),
            index: a.layer_index(l).unwrap(),
        },
        diff_id: format!("sha256:{}", diff.to_string().repeat(64)),
        tar_size: Some(10240),
        blobs: vec![],
    }
}

/// Issue 23: a node pulled before its parents keeps every parent it
/// declares, in order (what a push of it from here writes: the same as from
/// the store that made it); the edge to a parent appears when that parent
/// arrives — in the parent's adoption, not on a pull of the child again; a
/// declared parent is never an edge to a node this store does not hold.
#[test]
fn a_node_pulled_before_its_parent_keeps_it_declared_and_is_linked_when_it_arrives() {
    let (da, db) = (tmp(), tmp());
    let (a, stack) = imported(da.path());
    let (b, _) = imported(db.path());
    let (ga, root) = a.create_group("task", &stack, "main", None).unwrap();
    let child = checkpoint_child(&a, &root.id, "x.txt", "{}");
    let grand = checkpoint_child(&a, &child.id, "y.txt", "{}");
    assert_eq!(
        (&grand.declared_parents, &grand.missing_parents),
        (&vec![child.id.clone()], &vec![]),
        "a node made here declares the parents it holds"
    );

    // The grandchild first: its parent is not here.
    let grand_layer = {
        let mut v =
            a.db.read(|c| crate::stacks::manifest_layers(c, grand.manifest))
                .unwrap();
        v.reverse();
        v
    };
    let staged = |l: LayerId, c: char| AdoptLayer {
        source: LayerSource::Staged {
            dir: stage_copy(&b, &a.layer_path(l)),
            index: a.layer_index(l).unwrap(),
        },
        diff_id: format!("sha256:{}", c.to_string().repeat(64)),
        tar_size: Some(10240),
        blobs: vec![],
    };
    let g = b
        .adopt_node(
            &stack,
            &[staged(grand_layer[0], 'a'), staged(grand_layer[1], 'b')],
            &adopt_node_of(&grand, &ga),
        )
        .unwrap();
    assert_eq!(g.missing_parents, vec![child.id.clone()]);
    assert!(g.linked_children.is_empty());
    let n = b.node(&grand.id).unwrap();
    assert!(n.parents.is_empty(), "no edge to a node not here: {n:?}");
    assert_eq!(n.declared_parents, vec![child.id.clone()]);
    assert_eq!(n.missing_parents, vec![child.id.clone()]);
    // Pushed from here: the same node as the store that made it pushes.
    let bg = b.node_group(&grand.id).unwrap();
    assert_eq!(AdoptNode::of(&n, &bg), adopt_node_of(&grand, &ga));
    // Walks see no edge: the graph's nodes, the children of nothing here.
    assert_eq!(b.graph("task").unwrap().nodes.len(), 1);

    // Its parent arrives (its layer held already): the edge is made in that
    // adoption, the child's missing parent gone; the parent's own parent
    // (the graph's root) is missing in turn.
    let diff_a = format!("sha256:{}", "a".repeat(64));
    let found = AdoptLayer {
        source: LayerSource::Existing(b.layer_by_diff_id(&diff_a, Some(&stack)).unwrap().unwrap()),
        diff_id: diff_a,
        tar_size: None,
        blobs: vec![],
    };
    let c = b
        .adopt_node(
            &stack,
            std::slice::from_ref(&found),
            &adopt_node_of(&child, &ga),
        )
        .unwrap();
    assert!(c.created);
    assert_eq!(c.linked_children, vec![grand.id.clone()]);
    assert_eq!(c.missing_parents, vec![root.id.clone()]);
    let n = b.node(&grand.id).unwrap();
    assert_eq!(
        (&n.parents, &n.declared_parents, &n.missing_parents),
        (&vec![child.id.clone()], &vec![child.id.clone()], &vec![])
    );
    assert_eq!(
        count(
            &b,
            &format!(
                "SELECT count(*) FROM graph_missing_parents WHERE child = '{}'",
                grand.id
            )
        ),
        0
    );
    // Prune follows the new edge: the child's subtree holds the grandchild.
    let pruned = b.prune_node(&child.id, None).unwrap();
    assert!(
        pruned.contains(&grand.id) && pruned.contains(&child.id),
        "{pruned:?}"
    );

    // A merge-like node whose parents are partly here: the order is kept
    // across held and missing positions, and a later arrival fills its slot.
    let mut m = adopt_node_of(&child, &ga);
    m.id = "n00000000000000cc".into();
    m.kind = NodeKind::Merge;
    m.parents = vec![
        "n00000000000000x1".into(),
        child.id.clone(),
        "n00000000000000x2".into(),
    ];
    let mn = b
        .adopt_node(&stack, std::slice::from_ref(&found), &m)
        .unwrap();
    assert_eq!(
        mn.missing_parents,
        vec!["n00000000000000x1".to_string(), "n00000000000000x2".into()]
    );
    assert_eq!(
        (&mn.node.parents, &mn.node.declared_parents),
        (&vec![child.id.clone()], &m.parents)
    );
    let mut x1 = adopt_node_of(&child, &ga);
    x1.id = "n00000000000000x1".into();
    x1.parents = vec![];
    let got = b
        .adopt_node(&stack, std::slice::from_ref(&found), &x1)
        .unwrap();
    assert_eq!(got.linked_children, vec![m.id.clone()]);
    let mn = b.node(&m.id).unwrap();
    assert_eq!(
        (&mn.parents, &mn.declared_parents, &mn.missing_parents),
        (
            &vec!["n00000000000000x1".to_string(), child.id.clone()],
            &m.parents,
            &vec!["n00000000000000x2".to_string()]
        )
    );
    // Pulled again, nothing changes: the same declared parents.
    let again = b
        .adopt_node(&stack, std::slice::from_ref(&found), &m)
        .unwrap();
    assert!(!again.created && again.linked_children.is_empty());
    assert_eq!(again.node.declared_parents, m.parents);
    let f = b.fsck(false).unwrap();
    assert!(f.problems.is_empty(), "{:?}", f.problems);
    // The stack removed with its graphs: the missing-parent rows go too.
    b.remove_stack(&stack, true).unwrap();
    assert_eq!(count(&b, "SELECT count(*) FROM graph_missing_parents"), 0);
}

/// Turns a format 15 store into what format 14 was: no
/// `graph_missing_parents` (a pulled node's absent parents were dropped).
const TO_FORMAT_14: &str = "ALTER TABLE rollout_attempts DROP COLUMN end_keep;
     ALTER TABLE sessions DROP COLUMN id_map;
     DROP TABLE graph_missing_parents;
     UPDATE meta SET value = '14' WHERE key = 'format_version';";

/// A format 14 store is migrated: its nodes keep their edges (every parent
/// it recorded is held), a node pulled there before its parent gets its
/// declared parents back on a pull of it again, and the parent's arrival
/// links it.
#[test]
fn a_format_14_store_is_migrated_and_records_declared_parents_from_then_on() {
    let (da, db) = (tmp(), tmp());
    let (a, stack) = imported(da.path());
    let (b, _) = imported(db.path());
    let (ga, root) = a.create_group("task", &stack, "main", None).unwrap();
    let child = checkpoint_child(&a, &root.id, "x.txt", "{}");
    let grand = checkpoint_child(&a, &child.id, "y.txt", "{}");
    let (_, broot) = b.create_group("local", &stack, "main", None).unwrap();
    let local = checkpoint_child(&b, &broot.id, "z.txt", "{}");
    // What a format 14 store held of a grandchild pulled before its parent:
    // the node, no record of its parent.
    b.adopt_node(
        &stack,
        &[staged_layer_of(&a, &b, &grand, 'b')],
        &adopt_node_of(&grand, &ga),
    )
    .unwrap();
    drop(b);
    let conn = rusqlite::Connection::open(db.path().join("root/store.db")).unwrap();
    conn.execute_batch(TO_FORMAT_14).unwrap();
    drop(conn);
    let b = open(db.path());
    assert_eq!(format_version(&b), FORMAT_VERSION.to_string());
    let l = b.node(&local.id).unwrap();
    assert_eq!(
        (&l.parents, &l.declared_parents, &l.missing_parents),
        (&vec![broot.id.clone()], &vec![broot.id.clone()], &vec![])
    );
    let n = b.node(&grand.id).unwrap();
    assert!(n.declared_parents.is_empty(), "format 14 did not record it");
    // Pulled again: its declared parent recorded; its parent then links it.
    let again = b
        .adopt_node(
            &stack,
            &[staged_layer_of(&a, &b, &grand, 'b')],
            &adopt_node_of(&grand, &ga),
        )
        .unwrap();
    assert!(!again.created);
    assert_eq!(again.node.missing_parents, vec![child.id.clone()]);
    assert_eq!(again.node.declared_parents, vec![child.id.clone()]);
    let c = b
        .adopt_node(
            &stack,
            &[staged_layer_of(&a, &b, &child, 'a')],
            &adopt_node_of(&child, &ga),
        )
        .unwrap();
    assert_eq!(c.linked_children, vec![grand.id.clone()]);
    assert_eq!(b.node(&grand.id).unwrap().parents, vec![child.id.clone()]);
}

/// A format 15 store is migrated: it gets `rollout_execs`, and a running
/// attempt's commands are recorded from then on.
#[test]
fn a_format_16_store_is_migrated_and_records_id_maps() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/m", &top, BTreeMap::new(), false)
        .unwrap();
    let stack = s.find_session("default", "m").unwrap().unwrap().stack;
    let main = LeaseTarget::Branch("main".into());
    let (old, _, _) = s
        .create_session_with(
            &Owner::Sandbox { name: "old".into() },
            &stack,
            &main,
            Some("k-old"),
            &SessionOptions::default(),
        )
        .unwrap();
    drop(s);
    let conn = rusqlite::Connection::open(d.path().join("root/store.db")).unwrap();
    conn.execute_batch(
        "ALTER TABLE rollout_attempts DROP COLUMN end_keep;
         ALTER TABLE sessions DROP COLUMN id_map;
         UPDATE meta SET value = '16' WHERE key = 'format_version';",
    )
    .unwrap();
    drop(conn);
    let s = open(d.path());
    assert_eq!(format_version(&s), FORMAT_VERSION.to_string());
    assert_eq!(s.session(old.id).unwrap().id_map, None);
    // A key recorded before the column still answers its session.
    let (again, _, created) = s
        .create_session_with(
            &Owner::Sandbox { name: "old".into() },
            &stack,
            &main,
            Some("k-old"),
            &SessionOptions::default(),
        )
        .unwrap();
    assert_eq!((again.id, created), (old.id, false));
    let map = Some("100000:100000:65536".parse().unwrap());
    let (new, _, _) = s
        .create_session_with(
            &Owner::Sandbox { name: "new".into() },
            &stack,
            &main,
            None,
            &SessionOptions {
                id_map: map,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(new.id_map, map);
    assert_eq!(s.session(new.id).unwrap().id_map, map);
}

#[test]
fn a_format_15_store_is_migrated_and_records_rollout_commands() {
    let d = tmp();
    let (s, _run, root) = rollout_store(d.path());
    let (a, _, sess) = running_attempt(&s, 0, &root.id, "a");
    drop(s);
    let conn = rusqlite::Connection::open(d.path().join("root/store.db")).unwrap();
    conn.execute_batch(
        "ALTER TABLE rollout_attempts DROP COLUMN end_keep;
         ALTER TABLE sessions DROP COLUMN id_map;
         DROP TABLE rollout_execs;
         UPDATE meta SET value = '15' WHERE key = 'format_version';",
    )
    .unwrap();
    drop(conn);
    let s = open(d.path());
    assert_eq!(format_version(&s), FORMAT_VERSION.to_string());
    assert_eq!(
        s.record_rollout_exec(sess.id, &ExecRecord::new(vec!["true".into()]))
            .unwrap(),
        Some(a.id)
    );
    assert!(s.recorded_trajectory(a.id).unwrap().is_some());
}

/// A format 17 store is migrated: an attempt it ended (no keep recorded)
/// answers a repeat whatever it asks; an end after the migration records
/// its keep.
#[test]
fn a_format_17_store_is_migrated_and_records_each_ends_keep() {
    let d = tmp();
    let (s, _run, root) = rollout_store(d.path());
    let old = begun(begin(&s, 0, 1, &root.id));
    s.end_rollout(old.id, &completed(1.0, true), Disposition::Keep)
        .unwrap();
    let new = begun(begin(&s, 1, 1, &root.id));
    drop(s);
    let conn = rusqlite::Connection::open(d.path().join("root/store.db")).unwrap();
    conn.execute_batch(
        "ALTER TABLE rollout_attempts DROP COLUMN end_keep;
         UPDATE meta SET value = '17' WHERE key = 'format_version';",
    )
    .unwrap();
    drop(conn);
    let s = open(d.path());
    assert_eq!(format_version(&s), FORMAT_VERSION.to_string());
    s.end_rollout(old.id, &completed(1.0, true), Disposition::Prune)
        .unwrap();
    s.end_rollout(new.id, &completed(1.0, true), Disposition::Prune)
        .unwrap();
    let err = s
        .end_rollout(new.id, &completed(1.0, true), Disposition::Keep)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
}

#[test]
fn a_ready_session_is_claimed_once_on_its_head_and_stale_once_the_branch_moved() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/m", &top, BTreeMap::new(), false)
        .unwrap();
    let stack = s.find_session("default", "m").unwrap().unwrap().stack;
    let main = LeaseTarget::Branch("main".into());
    let ready = Owner::Wasi {
        name: READY_OWNER.into(),
    };
    let make = || {
        s.create_session_with(&ready, &stack, &main, None, &SessionOptions::default())
            .unwrap()
            .0
    };
    let (r1, r2, r3) = (make(), make(), make());
    let opts = SessionOptions {
        exit_policy: Some("on-success".into()),
        ignore_mtime: true,
        daemon_owned: true,
        id_map: Some("100000:100000:65536".parse().unwrap()),
    };
    let me = Owner::Wasi { name: "me".into() };
    // Claimed: the caller's owner, key and options; the same lease.
    let Claim::Claimed(c) = s
        .claim_ready_session(r1.id, &me, Some("k-1"), &opts)
        .unwrap()
    else {
        panic!("a ready session on the head was not claimed");
    };
    assert_eq!((c.id, &c.owner), (r1.id, &me));
    assert_eq!(c.lease_manifest, r1.lease_manifest);
    assert!(c.ignore_mtime && c.daemon_owned);
    // Once only.
    assert!(matches!(
        s.claim_ready_session(r1.id, &me, None, &opts).unwrap(),
        Claim::Stale
    ));
    // The key is the caller's now: a create with it answers that session.
    let (again, _, created) = s
        .create_session_with(&me, &stack, &main, Some("k-1"), &opts)
        .unwrap();
    assert_eq!((again.id, created), (r1.id, false));
    assert_eq!(again.id_map, opts.id_map);
    assert_eq!(s.session(r1.id).unwrap().id_map, opts.id_map);
    // The same key with another mapping is refused.
    let remapped = SessionOptions {
        id_map: Some("200000:200000:65536".parse().unwrap()),
        ..opts.clone()
    };
    assert!(s
        .create_session_with(&me, &stack, &main, Some("k-1"), &remapped)
        .is_err());
    assert!(matches!(
        s.claim_ready_session(r2.id, &me, Some("k-1"), &opts)
            .unwrap(),
        Claim::KeyTaken
    ));
    // The same key with other options is refused, as for a create.
    let other = SessionOptions::default();
    assert!(s
        .claim_ready_session(r2.id, &me, Some("k-1"), &other)
        .is_err());
    // A session that is not a ready one is never claimed.
    assert!(matches!(
        s.claim_ready_session(again.id, &me, None, &opts).unwrap(),
        Claim::Stale
    ));
    // The branch moves: the ready sessions made before are stale.
    std::fs::write(c.upper.join("a.txt"), b"hello").unwrap();
    publish(&s, c.id, &[write_entry(b"a.txt", 1)]);
    assert!(matches!(
        s.claim_ready_session(r3.id, &me, None, &opts).unwrap(),
        Claim::Stale
    ));
    assert_eq!(
        s.session(r3.id).unwrap().owner,
        ready,
        "a stale session keeps its owner"
    );
    let fresh = make();
    assert!(matches!(
        s.claim_ready_session(fresh.id, &me, None, &opts).unwrap(),
        Claim::Claimed(_)
    ));
}

#[test]
fn the_same_blob_stored_at_once_by_many_writers_is_stored_once_without_error() {
    let d = tmp();
    let s = std::sync::Arc::new(open(d.path()));
    let threads: Vec<_> = (0..16)
        .map(|_| {
            let s = s.clone();
            std::thread::spawn(move || {
                (0..50)
                    .map(|_| s.put_blob(b"the same trajectory").map(|x| x.0))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for t in threads {
        for r in t.join().unwrap() {
            let digest = r.expect("a concurrent store of the same blob failed");
            assert_eq!(s.blob(&digest).unwrap(), b"the same trajectory");
        }
    }
    let left: Vec<_> = std::fs::read_dir(d.path().join("root/blobs"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().starts_with(".tmp-"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
}

/// `adopt_nodes` makes many nodes in one transaction (a chain here, each
/// naming the one before it in the batch), fsck stays clean, and
/// `graph_nodes_page` walks the graph in pages in `graph`'s order.
#[test]
fn a_batch_of_adopted_nodes_is_one_transaction_and_pages_walk_the_graph_in_order() {
    let d = tmp();
    let (s, stack) = imported(d.path());
    let (g, root) = s.create_group("big", &stack, "main", None).unwrap();
    let layer = {
        let n = checkpoint_child(&s, &root.id, "a.txt", "{}");
        // Newest first: the checkpoint's own layer.
        s.db.read(|c| crate::stacks::manifest_layers(c, n.manifest))
            .unwrap()[0]
    };
    let group = AdoptGroup {
        name: g.name.clone(),
        branch: Some(g.branch.clone()),
        root: Some(g.root.clone()),
    };
    let id = |i: usize| format!("n{:016x}", 0xb00 + i);
    let batch: Vec<(Vec<AdoptLayer>, AdoptNode)> = (0..2_345)
        .map(|i| {
            (
                vec![AdoptLayer {
                    source: LayerSource::Existing(layer),
                    diff_id: format!("sha256:{:064x}", layer),
                    tar_size: None,
                    blobs: Vec::new(),
                }],
                AdoptNode {
                    id: id(i),
                    group: group.clone(),
                    kind: NodeKind::Checkpoint,
                    state: "{}".into(),
                    parents: vec![if i == 0 { root.id.clone() } else { id(i - 1) }],
                    provenance: Provenance::default(),
                    created_ns: root.created_ns + 1 + i as i64,
                },
            )
        })
        .collect();
    // A node an older daemon made with a state that is no object still
    // moves (only new states must be objects).
    let mut batch = batch;
    batch[1].1.state = "[1,2]".into();
    // A bad node at the end undoes the whole batch.
    let mut bad = batch.clone();
    bad.last_mut().unwrap().1.state = "not json".into();
    assert!(s.adopt_nodes(&stack, &bad).is_err());
    assert!(s.node(&id(0)).is_err(), "a failed batch leaves no node");
    let out = s.adopt_nodes(&stack, &batch).unwrap();
    assert_eq!(s.node(&id(1)).unwrap().state, "[1,2]");
    assert_eq!(out.len(), 2_345);
    assert!(out
        .iter()
        .all(|a| a.created && a.missing_parents.is_empty()));
    assert_eq!(s.node(&id(7)).unwrap().parents, vec![id(6)]);
    let report = s.fsck(false).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    // Pages of 1,000 concatenate to the whole graph, in its order.
    let whole: Vec<String> = s
        .graph("big")
        .unwrap()
        .nodes
        .into_iter()
        .map(|n| n.id)
        .collect();
    assert_eq!(whole.len(), 2_347);
    let mut walked = Vec::new();
    let mut after: Option<(i64, String)> = None;
    loop {
        let page = s
            .graph_nodes_page("big", after.as_ref().map(|(t, i)| (*t, i.as_str())), 1_000)
            .unwrap();
        assert!(page.len() <= 1_000);
        let Some(last) = page.last() else { break };
        after = Some((last.created_ns, last.id.clone()));
        walked.extend(page.into_iter().map(|n| n.id));
    }
    assert_eq!(walked, whole);
    assert!(s.graph_nodes_page("nope", None, 10).is_err());
    assert_eq!(s.graph_attempts_page("big", 0, 10).unwrap().len(), 1);
}

/// A session on a branch that did not exist creates it and says so, in the
/// answer of that call only; the default branch, an existing branch, an
/// idempotent repeat and a later read say no.
#[test]
fn only_the_session_that_made_its_branch_says_branch_created() {
    let d = tmp();
    let (s, stack) = imported(d.path());
    let make = |name: &str, branch: &str, key: Option<&str>| {
        s.create_session(
            &Owner::Sandbox { name: name.into() },
            &stack,
            &LeaseTarget::Branch(branch.into()),
            key,
        )
        .unwrap()
        .0
    };
    assert!(!make("a", "main", None).branch_created, "main exists");
    let first = make("b", "feature", Some("k1"));
    assert!(first.branch_created, "feature did not exist");
    assert_eq!(first.branch, "feature");
    assert!(!make("c", "feature", None).branch_created, "it exists now");
    assert!(
        !make("b", "feature", Some("k1")).branch_created,
        "a repeat of the first call made nothing"
    );
    assert!(!s.session(first.id).unwrap().branch_created, "a later read");
}
