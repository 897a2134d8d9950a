#![allow(clippy::unwrap_used)]

use super::*;
use std::collections::BTreeMap;

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
        Err(SnapshotError::AlreadyExists(_))
    ));
    assert!(matches!(
        s.prepare("ns/6/d", "ns/9/nope", BTreeMap::new(), false),
        Err(SnapshotError::NotFound(_))
    ));
    assert!(matches!(s.stat("nope"), Err(SnapshotError::NotFound(_))));
    // Re-committing an existing name.
    s.prepare("ns/7/x", "", BTreeMap::new(), false).unwrap();
    assert!(matches!(
        s.commit(&top, "ns/7/x", BTreeMap::new()),
        Err(SnapshotError::AlreadyExists(_))
    ));
    // A parent with children cannot be removed.
    assert!(matches!(
        s.remove(&top),
        Err(SnapshotError::FailedPrecondition(_))
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
    let ctx = s.publish_context(sess.id).unwrap();
    let delta = s.head_delta(sess.id, ctx.lease_manifest).unwrap();
    assert!(delta.layers.is_empty());
    let p = s
        .commit_publish(
            sess.id,
            delta.head,
            &[(b"a.txt".to_vec(), "{}".to_string())],
            None,
        )
        .unwrap();
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
        (again.state, again.outcome, again.runs),
        (SessionState::Active, None, 1)
    );

    let log = s.log("default/sha256:bbb", "main").unwrap();
    assert_eq!(log.len(), 1);
    assert_eq!(log[0].layer, p.layer);
    assert_eq!(log[0].container.as_deref(), Some("c1"));
    assert_eq!(log[0].paths, 1);
}

#[test]
fn head_delta_lists_changes_published_since_the_lease() {
    let d = tmp();
    let s = open(d.path());
    let top = unpack(&s, "default");
    s.prepare("default/5/a", &top, BTreeMap::new(), false)
        .unwrap();
    s.prepare("default/6/b", &top, BTreeMap::new(), false)
        .unwrap();
    let a = s.find_session("default", "a").unwrap().unwrap();
    let b = s.find_session("default", "b").unwrap().unwrap();
    let ctx_a = s.publish_context(a.id).unwrap();
    let ctx_b = s.publish_context(b.id).unwrap();
    let head = s.head_delta(a.id, ctx_a.lease_manifest).unwrap().head;
    s.commit_publish(a.id, head, &[(b"etc/x".to_vec(), "X".into())], None)
        .unwrap();
    let delta = s.head_delta(b.id, ctx_b.lease_manifest).unwrap();
    assert_eq!(delta.new_layers.len(), 1);
    let first = delta.new_layers[0];
    assert_eq!(
        delta.layers,
        vec![(first, vec![(b"etc/x".to_vec(), "X".to_string())])]
    );
    // A second publish: its layer comes first, each layer keeps its own paths.
    s.prepare("default/7/c", &top, BTreeMap::new(), false)
        .unwrap();
    let c = s.find_session("default", "c").unwrap().unwrap();
    let ctx_c = s.publish_context(c.id).unwrap();
    s.commit_publish(
        c.id,
        ctx_c.lease_manifest,
        &[
            (b"etc/y".to_vec(), "Y".into()),
            (b"etc/x".to_vec(), "X2".into()),
        ],
        None,
    )
    .unwrap();
    let delta = s.head_delta(b.id, ctx_b.lease_manifest).unwrap();
    assert_eq!(delta.new_layers.len(), 2);
    assert_eq!(
        delta.layers[1],
        (first, vec![(b"etc/x".to_vec(), "X".to_string())])
    );
    assert_eq!(
        delta.layers[0],
        (
            delta.new_layers[0],
            vec![
                (b"etc/x".to_vec(), "X2".to_string()),
                (b"etc/y".to_vec(), "Y".to_string())
            ]
        )
    );
    // Committing against a stale head is refused and keeps the upper.
    std::fs::write(b.upper.join("f"), b"1").unwrap();
    let err = s
        .commit_publish(b.id, ctx_b.lease_manifest, &[], None)
        .unwrap_err();
    assert!(matches!(err, PublishError::HeadMoved { .. }), "{err}");
    assert!(b.upper.join("f").exists());
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
        Outcome {
            kind: OutcomeKind::Conflict,
            layer: None,
            conflicts: vec![ConflictRecord {
                path: "/mine".into(),
                reason: "changed on both sides".into(),
            }],
            paths: vec![],
            message: None,
            at_ns: 1,
            timings: None,
        },
    )
    .unwrap();
    let after = s.session(c.id).unwrap();
    assert_eq!(after.state, SessionState::Conflict);
    assert!(after.lease_manifest.is_some());
    s.remove("default/5/c").unwrap();
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
    let head = s
        .head_delta(m.id, s.publish_context(m.id).unwrap().lease_manifest)
        .unwrap()
        .head;
    std::fs::write(m.upper.join("f"), b"1").unwrap();
    let p = s.commit_publish(m.id, head, &[], None).unwrap();
    let (_, spec) = s
        .prepare(
            "default/6/x",
            &top,
            labels(&[(BRANCH_LABEL, "exp/1")]),
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
            labels(&[(BRANCH_LABEL, "bad name")]),
            false,
        )
        .unwrap_err();
    assert!(
        matches!(err, SnapshotError::InvalidArgument(ref m) if m.contains("invalid branch name")),
        "{err}"
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
    s.remove("default/5/c").unwrap();
    assert!(!s.session_path(c.id).exists());
    let after = s.session(c.id).unwrap();
    assert!(after.released);
    assert_eq!(after.lease_manifest, None);
    // Now the image layers can go, in containerd's GC order.
    s.remove(&top).unwrap();
    s.remove("default/1/sha256:aaa").unwrap();
    assert!(!s.layer_path(1).exists() && !s.layer_path(2).exists());
    assert!(s.list().unwrap().is_empty());
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
    assert!(matches!(err, SnapshotError::InvalidArgument(_)));
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
                let s = Store::open(&root, &StoreOptions::default()).unwrap();
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
    assert_eq!(
        s.stacks().unwrap()["default/sha256:bbb"].len(),
        1,
        "one stack, one main branch"
    );
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
    let ctx = s.publish_context(c.id).unwrap();
    let head = s.head_delta(c.id, ctx.lease_manifest).unwrap().head;
    let p = s
        .commit_publish(c.id, head, &[(b"data".to_vec(), "{}".into())], None)
        .unwrap();
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

    let writer = s.conn();
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
