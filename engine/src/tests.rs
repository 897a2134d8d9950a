#![allow(clippy::unwrap_used)]

use super::*;
use layerstack_publisher as publisher;
use layerstack_store::{
    MountSpec, OutcomeKind, PathStatus, SessionInfo, Store, StoreOptions, SNAPSHOT_REF_LABEL,
};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::test_support::have_root;

const BASE: &[u8] =
    b"# app\r\nkey1 = 1\r\nkey2 = 2\nkey3 = 3\nkey4 = 4\nkey5 = 5\nkey6 = 6\nlast = 7";

fn write(dir: &Path, rel: &str, content: &[u8]) {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    for d in p.ancestors().skip(1).take(rel.matches('/').count()) {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::write(&p, content).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
}

fn engine(store: &Arc<Store>) -> Arc<Engine> {
    Engine::new(
        store.clone(),
        EngineSettings {
            exclude: publisher::ExclusionRules::new(["/tmp/**"]).unwrap(),
            ..Default::default()
        },
    )
}

fn tmp() -> tempfile::TempDir {
    crate::test_support::tmp_named("engine")
}

/// A store with a one-layer image holding etc/app.conf and three sessions on it.
fn setup(dir: &Path) -> (Arc<Store>, Vec<SessionInfo>) {
    setup_n(dir, 3)
}

/// [`setup`] with `n` sessions (containers `s0`, `s1`, … after `a`, `b`, `c`).
/// containerd's Prepare of extraction snapshot `key` on `parent` for image
/// layer `target`: the directory to write the layer into (0755).
fn prepare_extraction(store: &Store, key: &str, parent: &str, target: &str) -> PathBuf {
    let labels = BTreeMap::from([(SNAPSHOT_REF_LABEL.to_string(), target.to_string())]);
    let (_, spec) = store.prepare(key, parent, labels, false).unwrap();
    let dir = match spec {
        MountSpec::Bind { source, .. } => source,
        MountSpec::Overlay {
            upper: Some((u, _)),
            ..
        } => u,
        other => panic!("{other:?}"),
    };
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

fn setup_n(dir: &Path, n: usize) -> (Arc<Store>, Vec<SessionInfo>) {
    let store = Store::open(&dir.join("root"), &StoreOptions::default()).unwrap();
    let dir = prepare_extraction(&store, "ns/1/extract-1 sha256:aaa", "", "sha256:aaa");
    write(&dir, "etc/app.conf", BASE);
    write(&dir, "tmp/.keep", b"");
    store
        .commit(
            "ns/2/sha256:aaa",
            "ns/1/extract-1 sha256:aaa",
            BTreeMap::new(),
        )
        .unwrap();
    let mut sessions = Vec::new();
    let names: Vec<String> = ["a", "b", "c"]
        .iter()
        .map(|s| s.to_string())
        .chain((0..).map(|i| format!("s{i}")))
        .take(n)
        .collect();
    for (i, c) in names.iter().enumerate() {
        store
            .prepare(
                &format!("ns/{}/{c}", 3 + i),
                "ns/2/sha256:aaa",
                BTreeMap::new(),
                false,
            )
            .unwrap();
        let s = store.find_session("ns", c).unwrap().unwrap();
        std::fs::set_permissions(&s.upper, std::fs::Permissions::from_mode(0o755)).unwrap();
        sessions.push(s);
    }
    (Arc::new(store), sessions)
}

fn edit(line: &str, to: &str) -> Vec<u8> {
    String::from_utf8(BASE.to_vec())
        .unwrap()
        .replace(line, to)
        .into_bytes()
}

#[tokio::test]
async fn merge_dry_run_and_conflict_end_to_end() {
    if !have_root("merge_dry_run_and_conflict_end_to_end") {
        return;
    }
    let t = tmp();
    let (store, s) = setup(t.path());
    // a: line 2; b: line 6 (separate hunk); c: line 3 (adjacent to a's): conflict.
    write(&s[0].upper, "etc/app.conf", &edit("key2 = 2", "key2 = A"));
    write(&s[1].upper, "etc/app.conf", &edit("key6 = 6", "key6 = B"));
    write(&s[1].upper, "tmp/scratch", b"excluded");
    write(&s[2].upper, "etc/app.conf", &edit("key3 = 3", "key3 = C"));
    let p = engine(&store);

    let a = p.publish(s[0].id, "test").await.unwrap();
    assert_eq!(a.outcome.as_ref().unwrap().kind, OutcomeKind::Committed);

    // Dry run of b: says merged, changes nothing.
    let before = std::fs::read(s[1].upper.join("etc/app.conf")).unwrap();
    let d = p.dry_run(s[1].id).await.unwrap();
    assert_eq!(d.kind, Some(OutcomeKind::Merged), "{d:?}");
    let st: Vec<(&[u8], PathStatus)> = d
        .paths
        .iter()
        .map(|r| (r.path.as_slice(), r.status))
        .collect();
    assert_eq!(
        st,
        [
            (&b"etc/app.conf"[..], PathStatus::Merged),
            (&b"tmp/scratch"[..], PathStatus::Excluded)
        ]
    );
    assert!(
        d.message.starts_with("dry run, nothing was changed"),
        "{}",
        d.message
    );
    assert_eq!(
        std::fs::read(s[1].upper.join("etc/app.conf")).unwrap(),
        before
    );
    assert!(
        s[1].upper.join("tmp/scratch").exists(),
        "a dry run applies no policy edits"
    );
    assert!(
        store.session(s[1].id).unwrap().outcome.is_none(),
        "no outcome recorded"
    );

    let b = p.publish(s[1].id, "test").await.unwrap();
    let out = b.outcome.unwrap();
    assert_eq!(out.kind, OutcomeKind::Merged, "{out:?}");
    let recorded = store.outcome_paths(out.id, None, 100, None).unwrap();
    let layer = store.layer_path(out.layer.unwrap());
    let merged = edit("key2 = 2", "key2 = A");
    let merged = String::from_utf8(merged)
        .unwrap()
        .replace("key6 = 6", "key6 = B")
        .into_bytes();
    assert_eq!(
        std::fs::read(layer.join("etc/app.conf")).unwrap(),
        merged,
        "byte-exact: CRLF lines and no final newline"
    );
    assert!(
        !layer.join("tmp/scratch").exists(),
        "excluded path not published"
    );
    let md = std::fs::metadata(layer.join("etc/app.conf")).unwrap();
    assert_eq!(md.permissions().mode() & 0o7777, 0o644);
    assert!(recorded
        .iter()
        .any(|r| r.path == b"tmp/scratch" && r.status == PathStatus::Excluded));

    let c = p.publish(s[2].id, "test").await.unwrap();
    let out = c.outcome.unwrap();
    assert_eq!(out.kind, OutcomeKind::Conflict);
    let conflicts = store
        .outcome_paths(out.id, None, 100, Some(PathStatus::Conflict))
        .unwrap();
    assert_eq!(conflicts.len(), 1);
    assert_eq!(conflicts[0].path, b"etc/app.conf");
    assert!(
        conflicts[0].reason.contains("adjacent"),
        "{}",
        conflicts[0].reason
    );
    assert_eq!(
        std::fs::read(s[2].upper.join("etc/app.conf")).unwrap(),
        edit("key3 = 3", "key3 = C"),
        "a rejected upper is kept as it was"
    );

    // A conflicting run can be published again, so it can be dry-run again.
    let d = p.dry_run(s[2].id).await.unwrap();
    assert_eq!(d.kind, Some(OutcomeKind::Conflict), "{d:?}");
    assert!(d
        .paths
        .iter()
        .any(|r| r.path == b"etc/app.conf" && r.status == PathStatus::Conflict));
    // A finished run cannot: it says why, and reports no outcome kind.
    let d = p.dry_run(s[0].id).await.unwrap();
    assert_eq!(d.kind, None);
    assert!(d.message.starts_with("nothing to publish"), "{}", d.message);
}

#[tokio::test]
async fn opaque_expansion_keeps_excluded_and_skipped_reports() {
    if !have_root("opaque_expansion_keeps_excluded_and_skipped_reports") {
        return;
    }
    let t = tmp();
    let (store, s) = setup(t.path());
    let p = engine(&store);
    // The head adds etc/new.
    write(&s[0].upper, "etc/new", b"from head\n");
    let a = p.publish(s[0].id, "test").await.unwrap();
    assert_eq!(a.outcome.as_ref().unwrap().kind, OutcomeKind::Committed);
    // b, through its real overlay mount: `rm -rf /etc; mkdir /etc` (the kernel
    // makes it opaque), an excluded file and a socket.
    let spec = store.mounts("ns/4/b").unwrap();
    let m = t.path().join("mnt");
    std::fs::create_dir(&m).unwrap();
    nix::mount::mount(
        Some("overlay"),
        &m,
        Some("overlay"),
        nix::mount::MsFlags::empty(),
        Some(spec.overlay_options().join(",").as_str()),
    )
    .unwrap();
    let ops = || -> std::io::Result<()> {
        std::fs::remove_dir_all(m.join("etc"))?;
        std::fs::create_dir(m.join("etc"))?;
        std::fs::set_permissions(m.join("etc"), std::fs::Permissions::from_mode(0o755))?;
        std::fs::write(m.join("etc/mine"), b"mine\n")?;
        std::fs::write(m.join("tmp/scratch"), b"excluded")?;
        drop(std::os::unix::net::UnixListener::bind(m.join("app.sock"))?);
        Ok(())
    };
    let done = ops();
    nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH).unwrap();
    done.unwrap();
    let want = |paths: &[layerstack_store::PathRecord]| {
        let got: Vec<(&[u8], PathStatus)> = paths
            .iter()
            .map(|r| (r.path.as_slice(), r.status))
            .collect();
        assert_eq!(
            got,
            [
                (&b"app.sock"[..], PathStatus::Excluded),
                (&b"etc/app.conf"[..], PathStatus::Clean),
                (&b"etc/mine"[..], PathStatus::Clean),
                (&b"tmp/scratch"[..], PathStatus::Excluded),
            ],
            "{paths:#?}"
        );
    };
    let d = p.dry_run(s[1].id).await.unwrap();
    assert_eq!(d.kind, Some(OutcomeKind::Committed), "{d:?}");
    want(&d.paths);
    let b = p.publish(s[1].id, "test").await.unwrap();
    let out = b.outcome.unwrap();
    assert_eq!(out.kind, OutcomeKind::Committed, "{out:?}");
    let recorded = store.outcome_paths(out.id, None, 100, None).unwrap();
    want(&recorded);
    let deleted = recorded.iter().find(|r| r.path == b"etc/app.conf").unwrap();
    assert_eq!(deleted.reason, "deleted; untouched on head");
    let layer = store.layer_path(out.layer.unwrap());
    assert!(!layer.join("tmp/scratch").exists());
    assert!(!layer.join("app.sock").exists());
    assert_eq!(std::fs::read(layer.join("etc/mine")).unwrap(), b"mine\n");
    // The expanded directory is plain: the head's etc/new shows through it.
    let a_layer = store.layer_path(a.outcome.as_ref().unwrap().layer.unwrap());
    let view = publisher::LayerView::new(vec![layer, a_layer]);
    assert!(view.lookup(b"etc/new").unwrap().is_some());
}

/// N sessions leased on one head, each changing its own files, published at
/// once: all commit, the branch holds each exactly once, the path index is
/// queried only at each publish's paths.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_disjoint_publishes_on_one_head_all_commit() {
    if !have_root("concurrent_disjoint_publishes_on_one_head_all_commit") {
        return;
    }
    let t = tmp();
    let (store, s) = setup_n(t.path(), 24);
    for (i, sess) in s.iter().enumerate() {
        for f in 0..10 {
            write(
                &sess.upper,
                &format!("work/s{i}/f{f}.txt"),
                format!("{i}-{f}\n").as_bytes(),
            );
        }
    }
    let p = engine(&store);
    let tasks: Vec<_> = s
        .iter()
        .map(|sess| {
            let p = p.clone();
            let id = sess.id;
            tokio::spawn(async move { p.publish(id, "test").await.unwrap() })
        })
        .collect();
    for t in tasks {
        let out = t.await.unwrap().outcome.unwrap();
        assert_eq!(out.kind, OutcomeKind::Committed, "{out:?}");
        let timings = out.timings.unwrap();
        assert!(timings.total_us >= timings.gate_hold_us);
    }
    let log = store.log("ns/sha256:aaa", "main").unwrap();
    assert_eq!(log.len(), 24);
    let head = store.branch_layers("ns/sha256:aaa", "main").unwrap();
    let view = publisher::LayerView::new(head);
    for i in 0..24 {
        for f in 0..10 {
            let got = view
                .read_regular(format!("work/s{i}/f{f}.txt").as_bytes())
                .unwrap();
            assert_eq!(got.unwrap(), format!("{i}-{f}\n").as_bytes());
        }
    }
    assert_eq!(p.live_session_locks(), 0, "session locks are pruned");
}

/// The head moves between planning (outside the gate) and the gate, at a path
/// this publish touches: the publish plans again against the real head — a
/// separate hunk merges, an overlapping one is rejected whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_that_moved_at_our_paths_is_planned_again() {
    if !have_root("a_head_that_moved_at_our_paths_is_planned_again") {
        return;
    }
    let t = tmp();
    let (store, s) = setup(t.path());
    write(&s[0].upper, "etc/app.conf", &edit("key2 = 2", "key2 = A"));
    write(&s[1].upper, "etc/app.conf", &edit("key6 = 6", "key6 = B"));
    write(&s[1].upper, "etc/other", b"b\n");
    let p = engine(&store);
    // b plans against the head without a's edit, then waits until a committed.
    let (planned_tx, planned_rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    p.failpoint_after_plan(move |_| {
        planned_tx.send(()).unwrap();
        go_rx.lock().unwrap().recv().unwrap();
    });
    let b = {
        let p = p.clone();
        let id = s[1].id;
        tokio::spawn(async move { p.publish(id, "b").await.unwrap() })
    };
    tokio::task::spawn_blocking(move || planned_rx.recv().unwrap())
        .await
        .unwrap();
    let a = p.publish(s[0].id, "a").await.unwrap();
    assert_eq!(a.outcome.unwrap().kind, OutcomeKind::Committed);
    go_tx.send(()).unwrap();
    let b = b.await.unwrap().outcome.unwrap();
    assert_eq!(
        b.kind,
        OutcomeKind::Merged,
        "re-planned against a's head: {b:?}"
    );
    // The message is the re-plan's, not the first plan's (written outside
    // the gate with the plan it describes).
    assert_eq!(
        b.message.as_deref(),
        Some("2 path(s): 1 clean, 1 merged, 0 excluded"),
        "{b:?}"
    );
    let merged = String::from_utf8(edit("key2 = 2", "key2 = A"))
        .unwrap()
        .replace("key6 = 6", "key6 = B")
        .into_bytes();
    let head = publisher::LayerView::new(store.branch_layers("ns/sha256:aaa", "main").unwrap());
    assert_eq!(head.read_regular(b"etc/app.conf").unwrap().unwrap(), merged);

    // Now c (adjacent to a's edit) races the same way and is rejected whole.
    write(&s[2].upper, "etc/app.conf", &edit("key3 = 3", "key3 = C"));
    write(&s[2].upper, "etc/c-only", b"c\n");
    let before = std::fs::read(s[2].upper.join("etc/app.conf")).unwrap();
    let c = p.publish(s[2].id, "c").await.unwrap().outcome.unwrap();
    assert_eq!(c.kind, OutcomeKind::Conflict);
    assert_eq!(c.counts.conflict, 1);
    assert_eq!(
        std::fs::read(s[2].upper.join("etc/app.conf")).unwrap(),
        before
    );
    let head = publisher::LayerView::new(store.branch_layers("ns/sha256:aaa", "main").unwrap());
    assert!(
        head.lookup(b"etc/c-only").unwrap().is_none(),
        "nothing of c was published"
    );
}

/// A publish whose head keeps moving at its paths before each of its turns at
/// the gate plans again outside the gate `OPTIMISTIC_REPLANS` times, then
/// plans under the gate (where the head cannot move) and lands: it never
/// starves, and it never holds the gate for a re-plan while it may still lose
/// the race outside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_that_keeps_losing_the_race_plans_under_the_gate_at_last() {
    if !have_root("a_publish_that_keeps_losing_the_race_plans_under_the_gate_at_last") {
        return;
    }
    let t = tmp();
    let (store, s) = setup_n(t.path(), 6);
    // Ours edits a line; each mover edits another line (a hunk apart) or the
    // file's owner, moving the head at our path: all of them merge.
    write(&s[0].upper, "etc/app.conf", &edit("key2 = 2", "key2 = X"));
    write(&s[1].upper, "etc/app.conf", &edit("# app", "# app M1"));
    write(&s[2].upper, "etc/app.conf", &edit("key4 = 4", "key4 = M2"));
    write(&s[3].upper, "etc/app.conf", &edit("key6 = 6", "key6 = M3"));
    write(&s[4].upper, "etc/app.conf", BASE);
    std::os::unix::fs::lchown(s[4].upper.join("etc/app.conf"), Some(4), Some(4)).unwrap();
    write(&s[5].upper, "etc/app.conf", BASE);
    std::os::unix::fs::lchown(s[5].upper.join("etc/app.conf"), Some(5), Some(5)).unwrap();
    let p = engine(&store);
    // Before each of ours' turns at the gate, the test publishes the next mover.
    let (turn_tx, turn_rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let done_rx = std::sync::Mutex::new(done_rx);
    let ours = s[0].upper.clone();
    p.failpoint_before_gate(move |upper| {
        if upper == ours {
            turn_tx.send(()).unwrap();
            done_rx.lock().unwrap().recv().unwrap();
        }
    });
    let publish = {
        let p = p.clone();
        let id = s[0].id;
        tokio::spawn(async move { p.publish(id, "ours").await.unwrap() })
    };
    let turn_rx = Arc::new(std::sync::Mutex::new(turn_rx));
    let mut turns = 0;
    loop {
        let rx = turn_rx.clone();
        let turn = tokio::task::spawn_blocking(move || {
            rx.lock()
                .unwrap()
                .recv_timeout(std::time::Duration::from_secs(5))
        })
        .await
        .unwrap();
        if turn.is_err() {
            break; // ours did not come back to the gate: it landed
        }
        turns += 1;
        let mover = p.publish(s[turns].id, "mover").await.unwrap();
        assert!(mover.outcome.unwrap().kind.is_published());
        done_tx.send(()).unwrap();
    }
    let ours = publish.await.unwrap().outcome.unwrap();
    assert_eq!(ours.kind, OutcomeKind::Merged, "{ours:?}");
    assert_eq!(
        turns as u32,
        crate::publish::OPTIMISTIC_REPLANS + 1,
        "three rounds outside the gate, then one planned under it"
    );
    // Every line and the owner the fourth mover gave the file.
    let head = head_view(&store, "main");
    let want = String::from_utf8(edit("key2 = 2", "key2 = X"))
        .unwrap()
        .replace("# app", "# app M1")
        .replace("key4 = 4", "key4 = M2")
        .replace("key6 = 6", "key6 = M3");
    assert_eq!(
        head.read_regular(b"etc/app.conf").unwrap().unwrap(),
        want.as_bytes()
    );
    let layers = store.branch_layers("ns/sha256:aaa", "main").unwrap();
    let top = std::fs::symlink_metadata(layers[0].join("etc/app.conf")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!((top.uid(), top.gid()), (4, 4));
}

/// A hostile upper: symlinks to `/` at every level, and a directory swapped for
/// a symlink to a host directory between planning and applying. Nothing outside
/// the store is read or written; the publish fails and keeps the upper.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_upper_never_steers_the_daemon_outside_the_store() {
    if !have_root("a_hostile_upper_never_steers_the_daemon_outside_the_store") {
        return;
    }
    let t = tmp();
    let (store, s) = setup(t.path());
    // Host sentinels the upper points at.
    let host = t.path().join("host");
    write(&host, "etc/app.conf", b"SENTINEL\n");
    xattr::set(host.join("etc/app.conf"), "user.sentinel", b"1").unwrap();
    let sentinel = || {
        (
            std::fs::read(host.join("etc/app.conf")).unwrap(),
            std::fs::metadata(host.join("etc/app.conf"))
                .unwrap()
                .permissions()
                .mode(),
            xattr::list(host.join("etc/app.conf")).unwrap().count(),
        )
    };
    let before = sentinel();
    // Symlinks to / (and to the host dir) at every level of the upper.
    let up = &s[1].upper;
    std::os::unix::fs::symlink("/", up.join("root-link")).unwrap();
    write(up, "a/b/c/file", b"x\n");
    std::os::unix::fs::symlink("/", up.join("a/up")).unwrap();
    std::os::unix::fs::symlink(&host, up.join("a/b/host")).unwrap();
    std::os::unix::fs::symlink("../../../../..", up.join("a/b/c/dotdot")).unwrap();
    // a: head edits etc/app.conf; b edits another hunk, so b's plan merges it.
    write(&s[0].upper, "etc/app.conf", &edit("key2 = 2", "key2 = A"));
    write(up, "etc/app.conf", &edit("key6 = 6", "key6 = B"));
    let p = engine(&store);
    assert_eq!(
        p.publish(s[0].id, "a").await.unwrap().outcome.unwrap().kind,
        OutcomeKind::Committed
    );
    // Under the gate, before applying: etc becomes a symlink to the host dir.
    let hostetc = host.join("etc");
    p.failpoint_before_apply(move |upper| {
        std::fs::rename(upper.join("etc"), upper.join("etc.moved")).unwrap();
        std::os::unix::fs::symlink(&hostetc, upper.join("etc")).unwrap();
    });
    let out = p.publish(s[1].id, "b").await.unwrap().outcome.unwrap();
    assert_eq!(out.kind, OutcomeKind::Failed, "{out:?}");
    assert_eq!(sentinel(), before, "the host file was not touched");
    assert!(
        std::fs::symlink_metadata(s[1].upper.join("etc"))
            .unwrap()
            .file_type()
            .is_symlink(),
        "upper kept as it was"
    );
    // Usage walks never follow either.
    let (bytes, _) = layerstack_store::fs::disk_usage(&s[1].upper).unwrap();
    assert!(bytes < 1 << 20, "{bytes}");
    assert_eq!(sentinel(), before);
    layerstack_store::reliability::record(
        "hostile-upper",
        "An upper full of symlinks to / and to host paths, and one swapped for a symlink under the gate, never makes the daemon read or write a host path; the publish fails and the upper is kept",
        "cargo test -p layerstack-engine --lib a_hostile_upper_never_steers",
        &[
            ("symlinks planted", 4u64.into()),
            ("swaps under the gate", 1u64.into()),
            ("host sentinel changes", 0u64.into()),
        ],
    )
    .expect("the reliability record is written");
}

/// containerd's Remove of a session whose publish runs returns at once; the
/// session's directories go after the publish, which loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_during_a_publish_returns_at_once_and_completes_after_it() {
    if !have_root("remove_during_a_publish_returns_at_once_and_completes_after_it") {
        return;
    }
    let t = tmp();
    let (store, s) = setup(t.path());
    write(&s[0].upper, "data/precious", b"keep me\n");
    let p = engine(&store);
    let (planned_tx, planned_rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    p.failpoint_after_plan(move |_| {
        planned_tx.send(()).unwrap();
        go_rx.lock().unwrap().recv().unwrap();
    });
    let publishing = {
        let p = p.clone();
        let id = s[0].id;
        tokio::spawn(async move { p.publish(id, "slow").await.unwrap() })
    };
    tokio::task::spawn_blocking(move || planned_rx.recv().unwrap())
        .await
        .unwrap();
    // Remove and Cleanup while the publish is held mid-way.
    let st = store.clone();
    let removed = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        tokio::task::spawn_blocking(move || {
            let r = st.remove("ns/3/a").unwrap();
            st.sweep_with(layerstack_store::SweepMode::Cleanup).unwrap();
            r
        }),
    )
    .await
    .expect("remove and cleanup never wait for a publish")
    .unwrap();
    assert_eq!(
        removed,
        layerstack_store::snapshots::Removed::Session(s[0].id)
    );
    p.session_released(s[0].id);
    assert!(
        s[0].upper.join("data/precious").exists(),
        "nothing deleted under the publish"
    );
    go_tx.send(()).unwrap();
    let out = publishing.await.unwrap().outcome.unwrap();
    assert_eq!(out.kind, OutcomeKind::Committed);
    let layer = store.layer_path(out.layer.unwrap());
    assert_eq!(
        std::fs::read(layer.join("data/precious")).unwrap(),
        b"keep me\n"
    );
    // The release completes after the publish.
    for _ in 0..100 {
        if !store.session_path(s[0].id).exists() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(!store.session_path(s[0].id).exists());
    let after = store.session(s[0].id).unwrap();
    assert!(after.released && !after.remove_pending);
}

/// ARCHITECTURE §9: no write transaction waits for a publish's I/O. A publish
/// held *inside* its apply step (under its branch's gate, a merged file being
/// written) holds no store transaction: containerd's `Prepare` on another
/// branch, a `Remove` of an unrelated snapshot, a `Commit` and `Cleanup` all
/// return while it is held (they waited for the whole apply when it ran inside
/// the commit transaction); then the publish commits its merge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_held_inside_its_apply_step_holds_up_no_other_store_write() {
    if !have_root("a_publish_held_inside_its_apply_step_holds_up_no_other_store_write") {
        return;
    }
    let t = tmp();
    let (store, s) = setup(t.path());
    // a edits line 2 and commits; b edits line 6: b's plan writes a merged file.
    write(&s[0].upper, "etc/app.conf", &edit("key2 = 2", "key2 = A"));
    write(&s[1].upper, "etc/app.conf", &edit("key6 = 6", "key6 = B"));
    let p = engine(&store);
    let a = p.publish(s[0].id, "a").await.unwrap().outcome.unwrap();
    assert_eq!(a.kind, OutcomeKind::Committed);
    store
        .create_branch("ns/sha256:aaa", "other", "main", None)
        .unwrap();
    let (inside_tx, inside_rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    p.failpoint_before_apply(move |_| {
        inside_tx.send(()).unwrap();
        go_rx.lock().unwrap().recv().unwrap();
    });
    let publishing = {
        let p = p.clone();
        let id = s[1].id;
        tokio::spawn(async move { p.publish(id, "held in apply").await.unwrap() })
    };
    tokio::task::spawn_blocking(move || inside_rx.recv().unwrap())
        .await
        .unwrap();
    let st = store.clone();
    let others = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        tokio::task::spawn_blocking(move || {
            let labels = BTreeMap::from([(
                layerstack_store::SNAPSHOT_BRANCH_LABEL.to_string(),
                "other".to_string(),
            )]);
            st.prepare("ns/20/d", "ns/2/sha256:aaa", labels, false)
                .unwrap();
            st.prepare("ns/21/e", "ns/2/sha256:aaa", BTreeMap::new(), false)
                .unwrap();
            st.commit("ns/22/e-committed", "ns/21/e", BTreeMap::new())
                .unwrap();
            let removed = st.remove("ns/5/c").unwrap();
            st.sweep_with(layerstack_store::SweepMode::Cleanup).unwrap();
            removed
        }),
    )
    .await
    .expect("Prepare, Commit, Remove and Cleanup never wait for a publish's apply step")
    .unwrap();
    assert_eq!(
        others,
        layerstack_store::snapshots::Removed::Session(s[2].id)
    );
    let d = store.find_session("ns", "d").unwrap().unwrap();
    assert_eq!(d.branch, "other");
    go_tx.send(()).unwrap();
    let out = publishing.await.unwrap().outcome.unwrap();
    assert_eq!(out.kind, OutcomeKind::Merged, "{out:?}");
    let layer = store.layer_path(out.layer.unwrap());
    let want = edit("key2 = 2", "key2 = A");
    let want = String::from_utf8(want)
        .unwrap()
        .replace("key6 = 6", "key6 = B");
    assert_eq!(
        std::fs::read(layer.join("etc/app.conf")).unwrap(),
        want.as_bytes()
    );
}

/// containerd's `Commit` of an active session ends its run `discarded`; the
/// outcome is the engine's like any other: `Engine::wait` (`layerstack wait`)
/// and subscribers wake (the store recorded it by itself before, and a wait
/// without a timeout hung).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_by_containerd_of_an_active_session_wakes_its_watchers() {
    if !have_root("a_commit_by_containerd_of_an_active_session_wakes_its_watchers") {
        return;
    }
    let t = tmp();
    let (store, s) = setup(t.path());
    write(&s[0].upper, "data/x", b"x\n");
    let p = engine(&store);
    let mut events = p.subscribe();
    let waiting = {
        let p = p.clone();
        let id = s[0].id;
        tokio::spawn(async move { p.wait(id, None).await })
    };
    // The waiter is parked on the outcome watch before the commit.
    tokio::task::yield_now().await;
    p.snapshot_commit("ns/30/frozen".into(), "ns/3/a".into(), BTreeMap::new())
        .await
        .unwrap();
    let woke = tokio::time::timeout(std::time::Duration::from_secs(10), waiting)
        .await
        .expect("wait wakes on the outcome containerd's Commit recorded")
        .unwrap()
        .unwrap()
        .expect("an outcome, not a timeout");
    assert_eq!(woke.outcome.unwrap().kind, OutcomeKind::Discarded);
    let ev = tokio::time::timeout(std::time::Duration::from_secs(10), events.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((ev.session, ev.kind), (s[0].id, OutcomeKind::Discarded));
    // The committed snapshot shows what the session saw.
    assert_eq!(
        p.snapshot_stat("ns/30/frozen".into()).await.unwrap().kind,
        layerstack_store::SnapshotKind::Committed
    );
}

/// A session removed by containerd with unpublished writes and no publish ever
/// started (a missed task-delete event) is published by the release, not lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_session_with_writes_is_published_by_its_policy() {
    if !have_root("a_released_session_with_writes_is_published_by_its_policy") {
        return;
    }
    let t = tmp();
    let (store, s) = setup(t.path());
    write(&s[0].upper, "kept", b"1\n");
    write(&s[1].upper, "dropped", b"1\n");
    store.set_session_policy(s[1].id, "never").unwrap();
    write(&s[2].upper, "refused", b"1\n");
    store.set_session_policy(s[2].id, "sometimes").unwrap();
    let p = engine(&store);
    for (sess, key) in s.iter().zip(["ns/3/a", "ns/4/b", "ns/5/c"]) {
        store.remove(key).unwrap();
        p.session_released(sess.id);
    }
    for sess in &s {
        p.wait(sess.id, Some(std::time::Duration::from_secs(10)))
            .await
            .unwrap()
            .unwrap();
    }
    let kinds: Vec<OutcomeKind> = s
        .iter()
        .map(|x| store.session(x.id).unwrap().outcome.unwrap().kind)
        .collect();
    assert_eq!(
        kinds,
        [
            OutcomeKind::Committed,
            OutcomeKind::Discarded,
            OutcomeKind::Failed
        ]
    );
    let failed = store.session(s[2].id).unwrap().outcome.unwrap();
    assert!(
        failed.message.unwrap().contains("sometimes"),
        "names the invalid policy"
    );
    assert!(
        s[2].upper.join("refused").exists(),
        "an invalid policy keeps the upper"
    );
    let head = publisher::LayerView::new(store.branch_layers("ns/sha256:aaa", "main").unwrap());
    assert!(head.lookup(b"kept").unwrap().is_some());
    assert!(head.lookup(b"dropped").unwrap().is_none());
    assert!(head.lookup(b"refused").unwrap().is_none());
}

/// A session made with `ignore_mtime` (content history only) that rewrote a
/// file with the same content publishes nothing; the same rewrite in a session
/// without it is a change. The option is recorded with the session.
#[tokio::test]
async fn a_session_that_ignores_mtimes_publishes_content_changes_only() {
    if !have_root("a_session_that_ignores_mtimes_publishes_content_changes_only") {
        return;
    }
    let t = tmp();
    // One container session makes the image's stack.
    let (store, _) = setup_n(t.path(), 1);
    let p = engine(&store);
    let make = |name: &str, ignore_mtime: bool| crate::SandboxRequest {
        name: name.into(),
        stack: "ns/sha256:aaa".into(),
        target: layerstack_store::LeaseTarget::Branch("main".into()),
        idempotency_key: None,
        policy: None,
        wait: None,
        node: None,
        ignore_mtime,
        daemon_owned: false,
        wasi: false,
        reserve: Default::default(),
        id_map: None,
    };
    let (quiet, _, _) = p.create_sandbox_session(make("quiet", true)).await.unwrap();
    let (loud, _, _) = p.create_sandbox_session(make("loud", false)).await.unwrap();
    assert!(store.session(quiet.id).unwrap().ignore_mtime);
    assert!(!store.session(loud.id).unwrap().ignore_mtime);
    std::thread::sleep(std::time::Duration::from_millis(10));
    for s in [&quiet, &loud] {
        // `sed -i` that matched nothing: the same bytes, a new mtime.
        write(&s.upper, "etc/app.conf", BASE);
    }
    write(&quiet.upper, "etc/new", b"content\n");
    let q = p.publish(quiet.id, "quiet").await.unwrap().outcome.unwrap();
    assert_eq!(q.kind, OutcomeKind::Committed, "{q:?}");
    assert_eq!(q.counts.clean, 1, "only etc/new is a change: {q:?}");
    let l = p.publish(loud.id, "loud").await.unwrap().outcome.unwrap();
    assert_eq!(
        l.kind,
        OutcomeKind::Committed,
        "an mtime is a change by default: {l:?}"
    );
    let head = publisher::LayerView::new(store.branch_layers("ns/sha256:aaa", "main").unwrap());
    assert!(head.lookup(b"etc/new").unwrap().is_some());
}

/// A removed session that wrote nothing still ends its run with an outcome:
/// a `layerstack wait` on it answers instead of timing out.
#[tokio::test]
async fn a_released_session_without_writes_ends_with_an_outcome() {
    if !have_root("a_released_session_without_writes_ends_with_an_outcome") {
        return;
    }
    let t = tmp();
    let (store, s) = setup_n(t.path(), 1);
    let p = engine(&store);
    store.remove("ns/3/a").unwrap();
    p.session_released(s[0].id);
    let done = p
        .wait(s[0].id, Some(std::time::Duration::from_secs(10)))
        .await
        .unwrap();
    let outcome = done.and_then(|x| x.outcome).map(|o| o.kind);
    assert_eq!(outcome, Some(OutcomeKind::NoChange));
}

/// A run that has ended but whose upper another mount namespace still holds
/// for a moment (a sibling's `runc init` cloned the mount table) is published
/// once that copy is gone, not refused as mounted.
#[tokio::test]
async fn an_ended_run_waits_out_a_transient_mount_in_another_namespace() {
    if !have_root("an_ended_run_waits_out_a_transient_mount_in_another_namespace") {
        return;
    }
    let t = tmp();
    let (store, s) = setup_n(t.path(), 1);
    write(&s[0].upper, "late", b"1\n");
    let mut holder = crate::test_support::mount_elsewhere(t.path(), &s[0].upper, &s[0].work, 0.6);
    let p = engine(&store);
    let t0 = std::time::Instant::now();
    while !p.upper_mounted(&s[0].upper).await.unwrap() {
        assert!(t0.elapsed().as_secs() < 10, "the holder never mounted");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let done = p.finish(s[0].id, None, Some(0), "task deleted").await;
    assert!(holder.wait().unwrap().success());
    let kind = done.unwrap().outcome.map(|o| o.kind);
    assert_eq!(kind, Some(OutcomeKind::Committed));
    let head = publisher::LayerView::new(store.branch_layers("ns/sha256:aaa", "main").unwrap());
    assert!(head.lookup(b"late").unwrap().is_some());
}

#[test]
fn exit_decisions_follow_recorded_policy_then_label() {
    let mut s = SessionInfo {
        id: 1,
        owner: layerstack_store::Owner::Sandbox { name: "x".into() },
        key: None,
        stack: String::new(),
        branch: String::new(),
        state: layerstack_store::SessionState::Active,
        outcome: None,
        lease_manifest: Some(1),
        run: 1,
        released: false,
        remove_pending: false,
        policy: None,
        idempotency_key: None,
        upper: "/u".into(),
        work: "/w".into(),
        created_ns: 0,
        ignore_mtime: false,
        daemon_owned: false,
        id_map: None,
        branch_created: false,
    };
    use crate::policy::{Decision, ExitPolicy};
    assert_eq!(
        exit_decision(&s, None, Some(3)).unwrap().0,
        Decision::Publish
    );
    assert_eq!(
        exit_decision(&s, Some(Ok(ExitPolicy::OnSuccess)), Some(3))
            .unwrap()
            .0,
        Decision::Discard
    );
    assert_eq!(
        exit_decision(&s, Some(Ok(ExitPolicy::OnSuccess)), None)
            .unwrap()
            .0,
        Decision::Discard
    );
    let bad: Result<ExitPolicy, _> = "sometimes".parse();
    let e = exit_decision(&s, Some(bad), Some(0)).unwrap_err();
    assert!(
        e.contains("sometimes") && e.contains("nothing was published"),
        "{e}"
    );
    s.policy = Some("never".into());
    assert_eq!(
        exit_decision(&s, Some(Ok(ExitPolicy::OnExit)), Some(0))
            .unwrap()
            .0,
        Decision::Discard,
        "the recorded policy wins over the label"
    );
}

fn engine_with(store: &Arc<Store>, history: crate::HistorySettings) -> Arc<Engine> {
    Engine::new(
        store.clone(),
        EngineSettings {
            exclude: publisher::ExclusionRules::new(["/tmp/**"]).unwrap(),
            history,
            ..Default::default()
        },
    )
}

/// A new sandbox session on `branch` of the test stack, with `files` written.
async fn session_with(
    p: &Arc<Engine>,
    branch: &str,
    name: &str,
    files: &[(&str, &[u8])],
) -> SessionInfo {
    let (s, _, _) = p
        .create_session(
            layerstack_store::Owner::Sandbox { name: name.into() },
            "ns/sha256:aaa",
            layerstack_store::LeaseTarget::Branch(branch.into()),
            None,
        )
        .await
        .unwrap();
    std::fs::set_permissions(&s.upper, std::fs::Permissions::from_mode(0o755)).unwrap();
    for (path, content) in files {
        write(&s.upper, path, content);
    }
    s
}

fn head_view(store: &Store, branch: &str) -> publisher::LayerView {
    let head = store.branch_head("ns/sha256:aaa", branch).unwrap();
    publisher::LayerView::new(store.manifest_view("ns/sha256:aaa", head).unwrap())
}

/// Many sequential publishes: automatic squashes keep the head shallow, every
/// file stays visible, a session leased early still reads its own view and
/// publishes through the gate against the squashed head (no false conflict), and
/// GC frees the squashed-away layers once nothing reaches them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn squashes_keep_history_shallow_and_every_view_intact() {
    if !have_root("squashes_keep_history_shallow_and_every_view_intact") {
        return;
    }
    let t = tmp();
    let (store, s) = setup_n(t.path(), 1);
    let p = engine_with(
        &store,
        crate::HistorySettings {
            squash_threshold: 10,
            squash_keep: 3,
            ..Default::default()
        },
    );
    // An early session: leased after the 2nd publish, edits a line of app.conf.
    let mut early = None;
    for i in 0..40 {
        let name = format!("f{i:02}");
        let content = format!("{i}\n");
        let sess = session_with(
            &p,
            "main",
            &name,
            &[
                (&format!("work/{name}"), content.as_bytes()),
                ("work/last", content.as_bytes()),
            ],
        )
        .await;
        // A file added (publish 4) and deleted (publish 5) in a directory the
        // base does not have: once both are squashed, no layer may hold a
        // whiteout for it (overlayfs would list it there: see
        // `publisher::flatten_layers_over`).
        if i == 4 {
            write(&sess.upper, "fresh/x", b"x\n");
        }
        if i == 5 {
            std::fs::create_dir_all(sess.upper.join("fresh")).unwrap();
            nix::sys::stat::mknod(
                &sess.upper.join("fresh/x"),
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::empty(),
                0,
            )
            .unwrap();
        }
        if i == 2 {
            early = Some(
                session_with(
                    &p,
                    "main",
                    "early",
                    &[("etc/app.conf", &edit("key4 = 4", "key4 = E"))],
                )
                .await,
            );
        }
        let out = p.publish(sess.id, "seq").await.unwrap().outcome.unwrap();
        assert!(out.kind.is_published(), "{out:?}");
        // Let a background squash finish before checking the depth.
        let _ = p
            .squashes
            .lock(("ns/sha256:aaa".into(), "main".into()))
            .await;
        let depth = store
            .manifest_depth(store.branch_head("ns/sha256:aaa", "main").unwrap())
            .unwrap();
        assert!(depth <= 11, "depth {depth} after publish {i}");
    }
    let log = store.log("ns/sha256:aaa", "main").unwrap();
    assert!(
        log.iter()
            .any(|e| e.kind == layerstack_store::LayerKind::Squashed),
        "{log:?}"
    );
    let head = head_view(&store, "main");
    for i in 0..40 {
        let got = head
            .read_regular(format!("work/f{i:02}").as_bytes())
            .unwrap();
        assert_eq!(got.unwrap(), format!("{i}\n").as_bytes());
    }
    assert_eq!(head.read_regular(b"work/last").unwrap().unwrap(), b"39\n");
    assert!(head.lookup(b"fresh/x").unwrap().is_none());
    let head_id = store.branch_head("ns/sha256:aaa", "main").unwrap();
    for dir in store.manifest_view("ns/sha256:aaa", head_id).unwrap() {
        assert!(
            std::fs::symlink_metadata(dir.join("fresh/x")).is_err(),
            "{} holds fresh/x (a whiteout of nothing)",
            dir.display()
        );
    }
    // GC: the early session's lease still pins its own (unsquashed) view.
    let early = early.unwrap();
    let before = p.gc().await.unwrap();
    assert!(
        !before.report.layers.is_empty(),
        "squashed-away layers are freed"
    );
    let ctx = store.publish_context(early.id).unwrap();
    let view = publisher::LayerView::new(ctx.lease_lowers.clone());
    assert!(view.read_regular(b"work/f00").unwrap().is_some());
    assert!(
        view.read_regular(b"work/f10").unwrap().is_none(),
        "its view is its own"
    );
    // It publishes through the squashed head: its edit merges with nothing.
    let out = p.publish(early.id, "early").await.unwrap().outcome.unwrap();
    assert_eq!(out.kind, OutcomeKind::Committed, "{out:?}");
    let head = head_view(&store, "main");
    assert_eq!(
        head.read_regular(b"etc/app.conf").unwrap().unwrap(),
        edit("key4 = 4", "key4 = E")
    );
    assert_eq!(head.read_regular(b"work/f05").unwrap().unwrap(), b"5\n");
    let _ = s;
}

/// A squash whose build fails (a layer of its run is gone from disk) is an
/// internal error naming the branch, with the path in its cause — not a bad
/// argument of the caller — and moves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_squash_that_cannot_be_built_is_an_internal_error() {
    if !have_root("a_squash_that_cannot_be_built_is_an_internal_error") {
        return;
    }
    let t = tmp();
    let (store, _) = setup_n(t.path(), 1);
    let p = engine_with(
        &store,
        crate::HistorySettings {
            squash_threshold: 0,
            squash_keep: 1,
            ..Default::default()
        },
    );
    let stack = "ns/sha256:aaa";
    let oldest = publish_on(&p, "main", "a", &[("root/a", b"a\n")], &[]).await;
    publish_on(&p, "main", "b", &[("root/b", b"b\n")], &[]).await;
    publish_on(&p, "main", "c", &[("root/c", b"c\n")], &[]).await;
    let head = store.branch_head(stack, "main").unwrap();
    std::fs::remove_dir_all(store.layer_path(oldest)).unwrap();
    let e = p.squash(stack, "main").await.unwrap_err();
    assert!(matches!(e, EngineError::Squash { .. }), "{e:?}");
    assert_eq!(e.kind(), layerstack_store::ErrorKind::Internal);
    let msg = error_chain(&e);
    assert!(
        msg.starts_with(&format!("building the squash of {stack}@main failed: ")),
        "{msg}"
    );
    assert_eq!(
        store.branch_head(stack, "main").unwrap(),
        head,
        "nothing moved"
    );
}

/// Branches: fork at an old layer of the log sees exactly that layer's tree;
/// promote fast-forwards, merges, or is refused whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn branches_fork_at_a_layer_and_promote_fast_forwards_merges_or_refuses() {
    if !have_root("branches_fork_at_a_layer_and_promote_fast_forwards_merges_or_refuses") {
        return;
    }
    let t = tmp();
    let (store, _) = setup_n(t.path(), 1);
    let p = engine_with(&store, Default::default());
    let stack = "ns/sha256:aaa";
    for i in 0..3 {
        let s = session_with(&p, "main", &format!("m{i}"), &[(&format!("m{i}"), b"x\n")]).await;
        p.publish(s.id, "main").await.unwrap();
    }
    let log = store.log(stack, "main").unwrap();
    let second = log[1].layer;
    store
        .create_branch(stack, "old", "main", Some(second))
        .unwrap();
    let old = head_view(&store, "old");
    assert!(old.lookup(b"m1").unwrap().is_some() && old.lookup(b"m2").unwrap().is_none());
    assert!(
        store.create_branch(stack, "old", "main", None).is_err(),
        "exists"
    );

    // Fast-forward: dev forked from main's head, publishes; promote dev → main.
    store.create_branch(stack, "dev", "main", None).unwrap();
    let d = session_with(
        &p,
        "dev",
        "d",
        &[("etc/app.conf", &edit("key2 = 2", "key2 = D"))],
    )
    .await;
    p.publish(d.id, "dev").await.unwrap();
    let r = p.promote(stack, "dev", "main", "op-ff").await.unwrap();
    assert!(matches!(r, crate::Promoted::FastForward { .. }), "{r:?}");
    assert_eq!(
        store.branch_head(stack, "main").unwrap(),
        store.branch_head(stack, "dev").unwrap()
    );
    assert!(matches!(
        p.promote(stack, "dev", "main", "again").await.unwrap(),
        crate::Promoted::UpToDate { .. }
    ));

    // Merge: both moved; separate hunks merge through the gate.
    let d2_text = String::from_utf8(edit("key2 = 2", "key2 = D"))
        .unwrap()
        .replace("key6 = 6", "key6 = D2");
    let d2 = session_with(&p, "dev", "d2", &[("etc/app.conf", d2_text.as_bytes())]).await;
    p.publish(d2.id, "dev").await.unwrap();
    let m = session_with(&p, "main", "m", &[("main-only", b"m\n")]).await;
    p.publish(m.id, "main").await.unwrap();
    let r = p.promote(stack, "dev", "main", "op-merge").await.unwrap();
    let crate::Promoted::Merged { session } = r else {
        panic!("{r:?}")
    };
    assert_eq!(session.owner.display(), "operation:op-merge");
    let head = head_view(&store, "main");
    assert!(head.lookup(b"main-only").unwrap().is_some());
    let text = String::from_utf8(head.read_regular(b"etc/app.conf").unwrap().unwrap()).unwrap();
    assert!(
        text.contains("key2 = D") && text.contains("key6 = D2"),
        "{text}"
    );

    // Conflict: both edit the same line; main is unchanged, the promote refused.
    let d3 = session_with(
        &p,
        "dev",
        "d3",
        &[(
            "etc/app.conf",
            text.replace("last = 7", "last = dev").as_bytes(),
        )],
    )
    .await;
    p.publish(d3.id, "dev").await.unwrap();
    let m2 = session_with(
        &p,
        "main",
        "m2",
        &[(
            "etc/app.conf",
            text.replace("last = 7", "last = main").as_bytes(),
        )],
    )
    .await;
    p.publish(m2.id, "main").await.unwrap();
    let before = store.branch_head(stack, "main").unwrap();
    let mut events = p.subscribe();
    let r = p
        .promote(stack, "dev", "main", "op-conflict")
        .await
        .unwrap();
    let crate::Promoted::Conflict { session } = r else {
        panic!("{r:?}")
    };
    // One outcome for the operation's run, the conflict, announced once; its
    // message says what is true: nothing is kept, main is unchanged.
    let o = session.outcome.clone().unwrap();
    assert_eq!(o.kind, OutcomeKind::Conflict);
    let msg = o.message.unwrap_or_default();
    assert!(
        msg.contains("nothing is kept")
            && msg.contains("main is unchanged")
            && !msg.contains("upper is kept"),
        "{msg}"
    );
    assert!(
        session.released && session.lease_manifest.is_none(),
        "{session:?}"
    );
    assert!(
        !store.session_dir(session.id).exists(),
        "the operation's upper is dropped"
    );
    let now = store.session(session.id).unwrap();
    assert_eq!(
        now.outcome.map(|o| (o.id, o.kind)),
        Some((o.id, OutcomeKind::Conflict))
    );
    let announced: Vec<_> = std::iter::from_fn(|| events.try_recv().ok())
        .filter(|e| e.session == session.id)
        .map(|e| (e.kind, e.run))
        .collect();
    assert_eq!(announced, [(OutcomeKind::Conflict, session.run)]);
    assert_eq!(
        store.branch_head(stack, "main").unwrap(),
        before,
        "refused whole"
    );
    // Branch deletion: the default branch is refused; another goes.
    assert!(store.delete_branch(stack, "main").is_err());
    store.delete_branch(stack, "old").unwrap();
    assert!(store.branch_head(stack, "old").is_err());
}

/// GC frees exactly the bytes of what nothing reaches, and the accounting's
/// total equals `du` of the store root before and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_frees_what_nothing_reaches_and_accounting_matches_du() {
    if !have_root("gc_frees_what_nothing_reaches_and_accounting_matches_du") {
        return;
    }
    let t = tmp();
    let (store, _) = setup_n(t.path(), 1);
    let p = engine_with(&store, Default::default());
    let stack = "ns/sha256:aaa";
    store.create_branch(stack, "tmp", "main", None).unwrap();
    let big = vec![7u8; 1 << 20];
    let s = session_with(&p, "tmp", "big", &[("big.bin", &big)]).await;
    let out = p.publish(s.id, "tmp").await.unwrap().outcome.unwrap();
    let layer_dir = store.layer_path(out.layer.unwrap());
    let (expected, _) = layerstack_store::fs::disk_usage(&layer_dir).unwrap();
    let du = |root: &Path| {
        let o = std::process::Command::new("du")
            .args(["-s", "-B1"])
            .arg(root)
            .output()
            .unwrap();
        String::from_utf8(o.stdout)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    let u = store.disk_usage().unwrap();
    let root_du = du(store.root());
    assert!(
        u.total.total().abs_diff(root_du) <= 64 * 1024,
        "df {} vs du {root_du}: {:?}",
        u.total.total(),
        u.total
    );
    assert!(u.total.hot >= 1 << 20, "{:?}", u.total);
    // Nothing frees while the branch shows the layer.
    assert!(p.gc().await.unwrap().report.layers.is_empty());
    store.delete_branch(stack, "tmp").unwrap();
    let c = p.gc().await.unwrap();
    assert_eq!(c.report.layers, vec![out.layer.unwrap()]);
    assert_eq!(c.report.bytes_freed, u64::try_from(expected).unwrap());
    assert!(!layer_dir.exists());
    let u = store.disk_usage().unwrap();
    let root_du = du(store.root());
    assert!(
        u.total.total().abs_diff(root_du) <= 64 * 1024,
        "after: df {} vs du {root_du}",
        u.total.total()
    );
}

/// Writes `files` into an attempt session's upper.
fn fill(s: &SessionInfo, files: &[(&str, &[u8])]) {
    std::fs::set_permissions(&s.upper, std::fs::Permissions::from_mode(0o755)).unwrap();
    for (p, c) in files {
        write(&s.upper, p, c);
    }
}

fn sandbox(name: &str) -> layerstack_store::Owner {
    layerstack_store::Owner::Sandbox { name: name.into() }
}

/// An attempt is started with its exit policy in one store transaction: the
/// session of a new attempt carries it from its first moment (before, a second
/// call set it, and a kill -9 between the two lost it for good: a retry with the
/// same key answered `created = false`); the same key answers the same attempt
/// with the policy recorded the first time. Without a policy an attempt
/// checkpoints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_starts_with_its_exit_policy_in_one_step() {
    use crate::policy::ExitPolicy;
    if !have_root("an_attempt_starts_with_its_exit_policy_in_one_step") {
        return;
    }
    let t = tmp();
    let (store, _) = setup_n(t.path(), 1);
    let p = engine_with(&store, Default::default());
    let (_, root) = p
        .graph_create("task", "ns/sha256:aaa", "main", None)
        .await
        .unwrap();
    let (a, s, _, created) = p
        .attempt_start(
            &root.id,
            sandbox("a"),
            Some("k".into()),
            Some(ExitPolicy::OnSuccess),
        )
        .await
        .unwrap();
    assert!(created);
    assert_eq!(s.policy.as_deref(), Some("on-success"));
    assert_eq!(
        store.session(s.id).unwrap().policy.as_deref(),
        Some("on-success"),
        "recorded with the attempt"
    );
    let (again, s2, _, created) = p
        .attempt_start(
            &root.id,
            sandbox("a"),
            Some("k".into()),
            Some(ExitPolicy::OnSuccess),
        )
        .await
        .unwrap();
    assert_eq!((again.id, s2.id, created), (a.id, s.id, false));
    assert_eq!(s2.policy.as_deref(), Some("on-success"));
    // The same key with another policy is another request: refused, naming
    // the key and the policy, and nothing changes.
    let e = p
        .attempt_start(
            &root.id,
            sandbox("a"),
            Some("k".into()),
            Some(ExitPolicy::Never),
        )
        .await
        .unwrap_err();
    assert_eq!(
        e.kind(),
        layerstack_store::ErrorKind::FailedPrecondition,
        "{e}"
    );
    let m = crate::error_chain(&e);
    assert!(m.contains("\"k\"") && m.contains("policy"), "{m}");
    assert_eq!(
        store.session(s.id).unwrap().policy.as_deref(),
        Some("on-success")
    );
    let (_, plain, _, _) = p
        .attempt_start(&root.id, sandbox("b"), None, None)
        .await
        .unwrap();
    assert_eq!(plain.policy.as_deref(), Some("checkpoint"));
    let (_, retried, _, _) = p
        .attempt_retry(a.id, sandbox("r"), None, Some(ExitPolicy::Never))
        .await
        .unwrap();
    assert_eq!(retried.policy.as_deref(), Some("never"));
}

/// Sibling attempts never see each other's writes; checkpoints are immutable
/// children; merge (clean, text-merged, conflict), promote (fast-forward, merge,
/// refused), prune (refused while reached, collected after) and retry — each
/// with the same key twice giving one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sandbox_graph_checkpoints_merges_promotes_and_prunes() {
    if !have_root("the_sandbox_graph_checkpoints_merges_promotes_and_prunes") {
        return;
    }
    let t = tmp();
    let (store, _) = setup_n(t.path(), 1);
    let p = engine_with(&store, Default::default());
    let stack = "ns/sha256:aaa";
    let (g, root) = p
        .graph_create("task", stack, "main", Some("k-create".into()))
        .await
        .unwrap();
    let (g2, root2) = p
        .graph_create("task", stack, "main", Some("k-create".into()))
        .await
        .unwrap();
    assert_eq!(
        (g.root.clone(), root.id.clone()),
        (g2.root, root2.id),
        "same key, same graph"
    );
    let taken = p
        .graph_create("task", stack, "main", None)
        .await
        .unwrap_err();
    assert_eq!(
        taken.kind(),
        layerstack_store::ErrorKind::AlreadyExists,
        "the name is taken: {taken}"
    );

    // Two siblings from the root.
    let (a1, s1, _, _) = p
        .attempt_start(&root.id, sandbox("a1"), Some("k-a1".into()), None)
        .await
        .unwrap();
    let (_a2, s2, _, _) = p
        .attempt_start(&root.id, sandbox("a2"), None, None)
        .await
        .unwrap();
    let (a1b, ..) = p
        .attempt_start(&root.id, sandbox("a1"), Some("k-a1".into()), None)
        .await
        .unwrap();
    assert_eq!(a1.id, a1b.id, "same key, same attempt");
    fill(
        &s1,
        &[
            ("one.txt", b"1\n"),
            ("etc/app.conf", &edit("key2 = 2", "key2 = A")),
        ],
    );
    fill(
        &s2,
        &[
            ("two.txt", b"2\n"),
            ("etc/app.conf", &edit("key6 = 6", "key6 = B")),
        ],
    );
    let n1 = p
        .checkpoint(
            s1.id,
            Some(r#"{"score": 0.5}"#.into()),
            Default::default(),
            Some("k-cp1".into()),
        )
        .await
        .unwrap();
    let n1b = p
        .checkpoint(
            s1.id,
            Some(r#"{"score": 0.5}"#.into()),
            Default::default(),
            Some("k-cp1".into()),
        )
        .await
        .unwrap();
    assert_eq!(n1.id, n1b.id, "a checkpoint with the same key is one node");
    // The same key with another state is another request: refused.
    let e = p
        .checkpoint(s1.id, None, Default::default(), Some("k-cp1".into()))
        .await
        .unwrap_err();
    assert_eq!(
        e.kind(),
        layerstack_store::ErrorKind::FailedPrecondition,
        "{e}"
    );
    assert!(crate::error_chain(&e).contains("state"), "{e}");
    // Its outcome says a node was made, not that a branch moved.
    let o = store.session(s1.id).unwrap().outcome.unwrap();
    assert_eq!(o.kind, OutcomeKind::Checkpointed, "{o:?}");
    assert!(!o.kind.is_published() && o.kind.adds_layer());
    // The node it made is a field of the outcome, read from the graph's rows.
    assert_eq!(o.node.as_deref(), Some(n1.id.as_str()), "{o:?}");
    assert_eq!(store.outcome(o.id).unwrap().node, o.node);
    let n2 = p
        .checkpoint(s2.id, None, Default::default(), None)
        .await
        .unwrap();
    assert_eq!(n1.parents, vec![root.id.clone()]);
    assert_eq!(n1.state, r#"{"score": 0.5}"#);
    assert!(n1.private_bytes.unwrap() > 0);
    let view = |m| publisher::LayerView::new(store.manifest_view(stack, m).unwrap());
    assert!(view(n1.manifest).lookup(b"one.txt").unwrap().is_some());
    assert!(
        view(n1.manifest).lookup(b"two.txt").unwrap().is_none(),
        "siblings are isolated"
    );
    assert!(view(n2.manifest).lookup(b"one.txt").unwrap().is_none());
    assert_eq!(
        store.attempt(a1.id).unwrap().status,
        layerstack_store::AttemptStatus::Checkpointed
    );
    assert_eq!(
        store.attempt(a1.id).unwrap().result_node.as_deref(),
        Some(n1.id.as_str())
    );

    // A node merged with itself is refused, naming it: no merge node whose two
    // parents are one node.
    let e = p.node_merge(&n1.id, &n1.id, None, None).await.unwrap_err();
    assert_eq!(e.kind(), layerstack_store::ErrorKind::InvalidArgument);
    assert!(
        e.to_string()
            .contains(&format!("node {} with itself", n1.id)),
        "{e}"
    );
    // Merge: disjoint files and separate hunks merge.
    let m = p
        .node_merge(&n1.id, &n2.id, None, Some("k-merge".into()))
        .await
        .unwrap();
    let crate::NodeMerged::Node(m) = m else {
        panic!("{m:?}")
    };
    let again = p
        .node_merge(&n1.id, &n2.id, None, Some("k-merge".into()))
        .await
        .unwrap();
    assert_eq!(
        again,
        crate::NodeMerged::Node(m.clone()),
        "same key, one merge node"
    );
    assert_eq!(m.parents, vec![n1.id.clone(), n2.id.clone()]);
    let mv = view(m.manifest);
    assert!(mv.lookup(b"one.txt").unwrap().is_some() && mv.lookup(b"two.txt").unwrap().is_some());
    let conf = String::from_utf8(mv.read_regular(b"etc/app.conf").unwrap().unwrap()).unwrap();
    assert!(
        conf.contains("key2 = A") && conf.contains("key6 = B"),
        "{conf}"
    );

    // A conflicting child: same line as n1.
    let (_, s3, _, _) = p
        .attempt_start(&root.id, sandbox("a3"), None, None)
        .await
        .unwrap();
    fill(&s3, &[("etc/app.conf", &edit("key2 = 2", "key2 = C"))]);
    let n3 = p
        .checkpoint(s3.id, None, Default::default(), None)
        .await
        .unwrap();
    let c = p.node_merge(&n1.id, &n3.id, None, None).await.unwrap();
    let crate::NodeMerged::Conflict { session } = &c else {
        panic!("{c:?}")
    };
    let o = session.outcome.as_ref().unwrap();
    assert_eq!(
        (o.kind, o.node.as_deref()),
        (OutcomeKind::Conflict, None),
        "an outcome that made no node names none"
    );
    assert_eq!(
        store.graph("task").unwrap().nodes.len(),
        5,
        "no node for a conflict"
    );
    assert!(
        store
            .branches(stack)
            .unwrap()
            .iter()
            .all(|b| !b.name.starts_with(".graph")),
        "working branch dropped"
    );

    // A branch name that cannot be one is bad input, not a missing branch.
    let bad = p.node_promote(&n1.id, "bad..name", None).await.unwrap_err();
    assert_eq!(
        bad.kind(),
        layerstack_store::ErrorKind::InvalidArgument,
        "{bad}"
    );
    // Promote: fast-forward main to n1, then the merge node (a descendant), then a
    // stale conflicting node is refused whole.
    let r = p
        .node_promote(&n1.id, "main", Some("k-p1".into()))
        .await
        .unwrap();
    assert!(matches!(r, crate::Promoted::FastForward { .. }), "{r:?}");
    let r = p
        .node_promote(&n1.id, "main", Some("k-p1".into()))
        .await
        .unwrap();
    assert!(
        matches!(r, crate::Promoted::FastForward { .. }),
        "same key: the same answer again, {r:?}"
    );
    let r = p.node_promote(&m.id, "main", None).await.unwrap();
    assert!(matches!(r, crate::Promoted::FastForward { .. }), "{r:?}");
    let head = store.branch_head(stack, "main").unwrap();
    let r = p.node_promote(&n3.id, "main", None).await.unwrap();
    assert!(matches!(r, crate::Promoted::Conflict { .. }), "{r:?}");
    assert_eq!(
        store.branch_head(stack, "main").unwrap(),
        head,
        "a stale promote never overwrites"
    );

    // Prune: refused while a running attempt reaches the subtree; then collected.
    let (live, ls, _, _) = p
        .attempt_start(&n2.id, sandbox("live"), None, None)
        .await
        .unwrap();
    let e = p.node_prune(&n2.id, None).await.unwrap_err();
    assert!(
        error_chain(&e).contains("running attempt"),
        "{}",
        error_chain(&e)
    );
    p.discard(ls.id, "give up").await.unwrap();
    assert_eq!(
        store.attempt(live.id).unwrap().status,
        layerstack_store::AttemptStatus::Failed
    );
    // n2 is a parent of the merge node m (main's head): m is not in n2's subtree
    // as a child edge? It is — and main points at it: refused.
    let e = p.node_prune(&n2.id, None).await.unwrap_err();
    assert!(
        error_chain(&e).contains("head of branch"),
        "{}",
        error_chain(&e)
    );
    let pruned = p.node_prune(&n3.id, Some("k-prune".into())).await.unwrap();
    assert_eq!(pruned, vec![n3.id.clone()]);
    assert_eq!(
        p.node_prune(&n3.id, Some("k-prune".into())).await.unwrap(),
        pruned
    );
    let n3_layer = store.manifest(n3.manifest).unwrap()[0];
    p.gc().await.unwrap();
    assert!(
        !store.layer_path(n3_layer).exists(),
        "the pruned node's layer is collected"
    );
    assert!(
        p.attempt_start(&n3.id, sandbox("x"), None, None)
            .await
            .is_err(),
        "pruned nodes are not activated"
    );

    // Retry: a new attempt of the same node.
    let (r1, ..) = p
        .attempt_retry(a1.id, sandbox("retry"), None, None)
        .await
        .unwrap();
    assert_eq!(r1.node, root.id);
    assert_ne!(r1.id, a1.id);
}

/// 100 children of one node add only their own deltas: no lowerdir payload is
/// duplicated (each child's layer holds its own file only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_children_add_only_their_own_deltas() {
    if !have_root("a_hundred_children_add_only_their_own_deltas") {
        return;
    }
    let t = tmp();
    let (store, _) = setup_n(t.path(), 1);
    let p = engine_with(&store, Default::default());
    let (_, root) = p
        .graph_create("fan", "ns/sha256:aaa", "main", None)
        .await
        .unwrap();
    let before = store.disk_usage().unwrap().total;
    let mut own = 0u64;
    for i in 0..100 {
        let (_, s, _, _) = p
            .attempt_start(&root.id, sandbox(&format!("c{i}")), None, None)
            .await
            .unwrap();
        fill(&s, &[(&format!("child-{i}.bin"), &vec![i as u8; 8192])]);
        let n = p
            .checkpoint(s.id, None, Default::default(), None)
            .await
            .unwrap();
        own += n.private_bytes.unwrap();
        let layer = store.manifest(n.manifest).unwrap()[0];
        let names: Vec<_> = std::fs::read_dir(store.layer_path(layer))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names.len(),
            1,
            "child {i}'s layer holds its own file only: {names:?}"
        );
    }
    let after = store.disk_usage().unwrap().total;
    let added = (after.hot + after.cold) - (before.hot + before.cold);
    assert!(
        added <= own + 100 * 4096,
        "100 children added {added} bytes for {own} bytes of their own"
    );
}

/// Attempt 1 of sample `sample` of run "r" (step 0, prompt "p", policy
/// "pi") on `node`, a remote one when `worker` names it.
fn rollout_begin(node: &str, sample: i64, worker: Option<&str>) -> layerstack_store::RolloutBegin {
    layerstack_store::RolloutBegin {
        key: layerstack_store::SampleKey {
            run: "r".into(),
            step: 0,
            prompt: "p".into(),
            sample,
        },
        attempt: 1,
        node: node.to_string(),
        policy: "pi".into(),
        seed: None,
        worker: worker.map(str::to_string),
    }
}

/// A remote attempt (a worker's, on another machine) through the engine: the
/// daemon's start recovery leaves it running (nothing of it lived here), it
/// ends with the checkpoint node the caller pulled — a child of its node —
/// in the reward's transaction, once; a local attempt given a result node and
/// a discard with one are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_attempt_ends_once_with_its_pulled_checkpoint() {
    if !have_root("a_remote_attempt_ends_once_with_its_pulled_checkpoint") {
        return;
    }
    use layerstack_store::{Begun, RolloutResult, RolloutStatus};
    let t = tmp();
    let (store, _) = setup_n(t.path(), 1);
    let p = engine_with(&store, Default::default());
    let (_, root) = p
        .graph_create("remote", "ns/sha256:aaa", "main", None)
        .await
        .unwrap();
    p.create_run("r", "remote", BTreeMap::new()).await.unwrap();
    let begin = |sample: i64, worker: Option<&str>| rollout_begin(&root.id, sample, worker);
    let Begun::Attempt { attempt: a, .. } = p.begin_rollout(begin(0, Some("w-a"))).await.unwrap()
    else {
        panic!("rewarded")
    };
    let Begun::Attempt { attempt: local, .. } = p.begin_rollout(begin(1, None)).await.unwrap()
    else {
        panic!("rewarded")
    };
    assert_eq!(p.recover_rollouts().await.unwrap(), 1, "the local one only");
    assert_eq!(
        p.rollout(a.id).await.unwrap().status,
        RolloutStatus::Running
    );
    assert_eq!(
        p.rollout(local.id).await.unwrap().infra_kind.as_deref(),
        Some("daemon-restart")
    );
    // The worker's checkpoint, as a pull would leave it here.
    let (_, s, _, _) = p
        .attempt_start(&root.id, sandbox("w"), None, None)
        .await
        .unwrap();
    fill(&s, &[("answer.txt", b"42\n")]);
    let child = p
        .checkpoint(s.id, None, Default::default(), None)
        .await
        .unwrap();
    let end = |keep: RolloutKeep, node: Option<&str>| {
        p.end_rollout(
            a.id,
            RolloutResult::Completed {
                reward: 1.0,
                accepted: true,
            },
            None,
            Some(b"[]".to_vec()),
            Vec::new(),
            Some(1.0),
            String::new(),
            keep,
            node.map(str::to_string),
        )
    };
    let keep = RolloutKeep::Checkpoint {
        state: None,
        labels: BTreeMap::new(),
    };
    let err = end(RolloutKeep::Discard, Some(&child.id))
        .await
        .unwrap_err();
    let msg = crate::error_chain(&err);
    assert!(msg.contains("DISCARD"), "{msg}");
    let e = end(keep.clone(), Some(&child.id)).await.unwrap();
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
            Some("w-a")
        )
    );
    assert!(e.trajectory.is_some());
    assert_eq!(end(keep.clone(), Some(&child.id)).await.unwrap(), e);
    let sample = p.sample(a.key.clone()).await.unwrap();
    assert_eq!((sample.reward, sample.reward_attempt), (Some(1.0), Some(1)));
    assert_eq!(p.node_stats(&child.id, false).await.unwrap().0.visits, 1);
    // A local attempt with a result node: refused.
    let Begun::Attempt { attempt: l2, .. } = p.begin_rollout(begin(2, None)).await.unwrap() else {
        panic!("rewarded")
    };
    let err = p
        .end_rollout(
            l2.id,
            RolloutResult::TaskFailed,
            None,
            None,
            Vec::new(),
            None,
            String::new(),
            keep,
            Some(child.id.clone()),
        )
        .await
        .unwrap_err();
    let msg = crate::error_chain(&err);
    assert!(msg.contains("is local"), "{msg}");
    let audit = p.audit_run("r").await.unwrap();
    assert_eq!(audit.violations, Vec::<String>::new());
}

/// Mode B on the graph: a sandbox session started on a node is an attempt of it
/// (under the cap); closing it by its recorded policy `checkpoint` makes a child
/// node with the state and command given at close and releases the session;
/// `EndAction::Checkpoint` checkpoints whatever the policy; a session that is no
/// attempt cannot be checkpointed (the error says how to start one), and its
/// upper is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_sessions_on_nodes_checkpoint_when_closed() {
    if !have_root("sandbox_sessions_on_nodes_checkpoint_when_closed") {
        return;
    }
    use crate::{EndAction, SandboxRequest};
    let t = tmp();
    let (store, _) = setup_n(t.path(), 1);
    let p = engine_with(&store, Default::default());
    let (_, root) = p
        .graph_create("mcts", "ns/sha256:aaa", "main", None)
        .await
        .unwrap();
    let req = |name: &str, policy, node: Option<String>| SandboxRequest {
        name: name.into(),
        stack: "ns/sha256:aaa".into(),
        target: layerstack_store::LeaseTarget::Branch("main".into()),
        idempotency_key: None,
        policy,
        wait: None,
        node,
        ignore_mtime: false,
        daemon_owned: false,
        wasi: false,
        reserve: Default::default(),
        id_map: None,
    };
    let (s, _, created) = p
        .create_sandbox_session(req(
            "expand-1",
            Some(crate::policy::ExitPolicy::Checkpoint),
            Some(root.id.clone()),
        ))
        .await
        .unwrap();
    assert!(created);
    assert_eq!(p.sandbox_load().0, 1, "an attempt counts against the cap");
    let a = store.attempt_of_session(s.id).unwrap().expect("an attempt");
    assert_eq!(a.node, root.id);
    fill(&s, &[("move.txt", b"e2e4\n")]);
    let out = p
        .close_sandbox_session(
            s.id,
            EndAction::Auto {
                exit_status: Some(1),
                state: Some(r#"{"visits": 1}"#.into()),
                command: Some("play e2e4".into()),
                labels: Default::default(),
            },
            "test",
            std::time::Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert!(out.released);
    assert_eq!(p.sandbox_load().0, 0, "the slot is free again");
    let a = store.attempt(a.id).unwrap();
    assert_eq!(a.status, layerstack_store::AttemptStatus::Checkpointed);
    let child = store.node(a.result_node.as_deref().unwrap()).unwrap();
    assert_eq!(child.parents, vec![root.id.clone()]);
    assert_eq!(child.state, r#"{"visits": 1}"#);
    assert_eq!(child.command.as_deref(), Some("play e2e4"));
    assert_eq!(
        child.exit_status,
        Some(1),
        "checkpoint ignores the exit status"
    );
    let view = publisher::LayerView::new(
        store
            .manifest_view("ns/sha256:aaa", child.manifest)
            .unwrap(),
    );
    assert!(view.lookup(b"move.txt").unwrap().is_some());
    assert_eq!(
        store.branch_head("ns/sha256:aaa", "main").unwrap(),
        root.manifest,
        "a checkpoint never moves a branch"
    );

    // Explicit checkpoint of an on-exit attempt from the child.
    let (s2, _, _) = p
        .create_sandbox_session(req("expand-2", None, Some(child.id.clone())))
        .await
        .unwrap();
    fill(&s2, &[("move2.txt", b"e7e5\n")]);
    p.close_sandbox_session(
        s2.id,
        EndAction::Checkpoint {
            exit_status: None,
            state: None,
            command: None,
            labels: [("reward".to_string(), "0.75".to_string())].into(),
            rollout: None,
        },
        "test",
        std::time::Duration::from_secs(5),
    )
    .await
    .unwrap();
    let g = store.graph("mcts").unwrap();
    let grand = g
        .nodes
        .iter()
        .find(|n| n.parents == vec![child.id.clone()])
        .expect("a grandchild");
    assert_eq!(grand.state, "{}");
    assert_eq!(
        grand.labels.get("reward").map(String::as_str),
        Some("0.75"),
        "the close's labels are recorded with the node"
    );

    // A branch session is no attempt: the checkpoint fails, the writes stay.
    let (s3, _, _) = p
        .create_sandbox_session(req("plain", None, None))
        .await
        .unwrap();
    fill(&s3, &[("keep.txt", b"k\n")]);
    let out = p
        .close_sandbox_session(
            s3.id,
            EndAction::Checkpoint {
                exit_status: None,
                state: None,
                command: None,
                labels: Default::default(),
                rollout: None,
            },
            "test",
            std::time::Duration::from_secs(5),
        )
        .await
        .unwrap();
    let o = out.outcome.unwrap();
    assert_eq!(o.kind, layerstack_store::OutcomeKind::Failed);
    assert!(
        o.message.as_deref().unwrap_or("").contains("--node"),
        "{o:?}"
    );
    assert_eq!(
        store.branch_head("ns/sha256:aaa", "main").unwrap(),
        root.manifest,
        "nothing was published"
    );
}

/// kill -9 at each step of checkpoint, merge and promote (ARCHITECTURE.md §12,
/// issue 12 "crash safety"): the operation runs in a child process (this test
/// binary re-executed) that aborts at an armed crash point
/// (`layerstack_store::failpoints`); the parent then restarts the store and the
/// engine as the daemon does and checks that the graph is the one before or the
/// one after — a half-done checkpoint is a node or nothing, nothing written is
/// lost, no orphan layer or row is left — and that the same call with the same
/// idempotency key completes it with one effect.
mod crash {
    use super::*;

    /// The registry-driven suite (its file's header says what it checks).
    mod suite {
        include!("crash_suite.rs");
    }

    const CHILD: &str = "LAYERSTACK_CRASH_CHILD";
    const STACK: &str = "ns/sha256:aaa";

    fn opts() -> StoreOptions {
        StoreOptions {
            startup_sweep: true,
            ..Default::default()
        }
    }

    /// The child half: `op|point|root|args…` in `LAYERSTACK_CRASH_CHILD`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "the child half of the crash tests: they run it, it never runs alone"]
    async fn crash_child() {
        let spec = std::env::var(CHILD).expect("run by the crash tests only");
        let f: Vec<&str> = spec.split('|').collect();
        let (op, point, root) = (f[0], f[1], Path::new(f[2]));
        if op == "recover" {
            // The daemon's restart, crashed at the recovery points armed.
            for p in point.split(',').filter(|p| !p.is_empty()) {
                layerstack_store::failpoints::arm(p);
            }
            restart(root).await;
            std::process::exit(3);
        }
        let store = Arc::new(Store::open(root, &opts()).unwrap());
        let p = engine_with(&store, suite::history());
        for p in point.split(',').filter(|p| !p.is_empty()) {
            layerstack_store::failpoints::arm(p);
        }
        // 3: ran to its end; 5: failed (no armed point was reached).
        match suite::run_op(&store, &p, op, &f[3..]).await {
            Ok(()) => std::process::exit(3),
            Err(e) => {
                eprintln!("{op} failed before reaching {point}: {e}");
                std::process::exit(5);
            }
        }
    }

    /// Runs the child and requires that it died at the crash point.
    fn crash_at(op: &str, point: &str, root: &Path, args: &[&str]) {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        assert_eq!(
            suite::child(op, &[point], root, &args, None),
            suite::End::Crashed(point.to_string()),
            "{op}: the child must die at crash point {point}"
        );
    }

    /// The daemon's restart: open (startup sweep), operations, releases.
    async fn restart(root: &Path) -> (Arc<Store>, Arc<Engine>) {
        let store = Arc::new(Store::open(root, &opts()).unwrap());
        let p = engine_with(&store, Default::default());
        p.recover_operations().await.unwrap();
        p.recover().await.unwrap();
        (store, p)
    }

    /// No orphan layer or row: after a GC, a cleanup sweep finds no directory
    /// without a row and no row without its directory.
    async fn assert_no_orphans(store: &Store, p: &Arc<Engine>, what: &str) {
        p.gc().await.unwrap();
        let r = store
            .sweep_with(layerstack_store::SweepMode::Cleanup)
            .unwrap();
        assert!(
            r.removed.is_empty() && r.missing.is_empty(),
            "{what}: orphans after recovery: {r:?}"
        );
        assert!(
            store.graph_work_branches().unwrap().is_empty(),
            "{what}: a merge's working branch survived"
        );
        assert!(
            store.sessions().unwrap().iter().all(
                |s| s.released || !matches!(s.owner, layerstack_store::Owner::Operation { .. })
            ),
            "{what}: an operation's session survived"
        );
    }

    fn shows(store: &Store, manifest: i64, path: &str) -> bool {
        publisher::LayerView::new(store.manifest_view(STACK, manifest).unwrap())
            .lookup(path.as_bytes())
            .unwrap()
            .is_some()
    }

    /// A graph with its root; `children` checkpointed children of the root,
    /// child i adding `child-i.txt`. Returns the root and the children.
    async fn graph(dir: &Path, children: usize) -> (String, Vec<layerstack_store::NodeInfo>) {
        let (store, _) = setup_n(dir, 1);
        let p = engine_with(&store, Default::default());
        let (_, root) = p.graph_create("g", STACK, "main", None).await.unwrap();
        let mut nodes = Vec::new();
        for i in 0..children {
            let (_, s, _, _) = p
                .attempt_start(&root.id, sandbox(&format!("c{i}")), None, None)
                .await
                .unwrap();
            fill(
                &s,
                &[(&format!("child-{i}.txt"), format!("{i}\n").as_bytes())],
            );
            nodes.push(
                p.checkpoint(s.id, None, Default::default(), None)
                    .await
                    .unwrap(),
            );
        }
        (root.id, nodes)
    }

    /// kill -9 at each step of the publish protocol (store `recheck_head`, the
    /// plan applied with no transaction open, the commit transaction with its
    /// rename): after the restart the branch shows the publish whole or not at
    /// all — never a merged file without its layer — and the session's writes
    /// are in its upper or in the layer; publishing again commits exactly the
    /// merge once, even after a crash left the merged file in the upper.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_crash_at_each_step_of_a_publish_leaves_it_done_or_undone() {
        if !have_root("a_crash_at_each_step_of_a_publish_leaves_it_done_or_undone") {
            return;
        }
        let merged = String::from_utf8(edit("key2 = 2", "key2 = A"))
            .unwrap()
            .replace("key6 = 6", "key6 = B");
        let conf = |store: &Store| {
            let head = store.branch_head(STACK, "main").unwrap();
            publisher::LayerView::new(store.manifest_view(STACK, head).unwrap())
                .read_regular(b"etc/app.conf")
                .unwrap()
                .unwrap()
        };
        for point in [
            "publish.rechecked",
            "publish.applied",
            "publish.before_rename",
            "publish.renamed",
            "publish.committed",
        ] {
            let t = tmp();
            let root_dir = t.path().join("root");
            let (b, depth_before) = {
                let (store, s) = setup(t.path());
                let p = engine_with(&store, Default::default());
                // a lands line 2; b, leased before, edits line 6: its plan
                // writes a merged file into its upper.
                write(&s[0].upper, "etc/app.conf", &edit("key2 = 2", "key2 = A"));
                write(&s[1].upper, "etc/app.conf", &edit("key6 = 6", "key6 = B"));
                let a = p.publish(s[0].id, "a").await.unwrap().outcome.unwrap();
                assert_eq!(a.kind, OutcomeKind::Committed);
                let head = store.branch_head(STACK, "main").unwrap();
                (s[1].clone(), store.manifest(head).unwrap().len())
            };
            crash_at("publish", point, &root_dir, &[&b.id.to_string()]);
            let (store, p) = restart(&root_dir).await;
            let head = store.branch_head(STACK, "main").unwrap();
            let depth = store.manifest(head).unwrap().len();
            let s = store.session(b.id).unwrap();
            if point == "publish.committed" {
                assert_eq!(depth, depth_before + 1, "{point}: the commit stands");
                assert_eq!(conf(&store), merged.as_bytes(), "{point}");
                assert_eq!(
                    s.outcome.as_ref().map(|o| o.kind),
                    Some(OutcomeKind::Merged),
                    "{point}"
                );
            } else {
                assert_eq!(depth, depth_before, "{point}: nothing committed");
                assert_eq!(
                    conf(&store),
                    edit("key2 = 2", "key2 = A"),
                    "{point}: the head shows a's version only"
                );
                assert!(s.outcome.is_none(), "{point}: {:?}", s.outcome);
                let upper = std::fs::read(s.upper.join("etc/app.conf")).unwrap();
                assert!(
                    upper == edit("key6 = 6", "key6 = B") || upper == merged.as_bytes(),
                    "{point}: b's writes are in its upper (as written or merged): {:?}",
                    String::from_utf8_lossy(&upper)
                );
                // Published again: the merge, once (an upper that holds the
                // merged file already has the head's edit: it may plan clean).
                let o = p.publish(b.id, "again").await.unwrap().outcome.unwrap();
                assert!(o.kind.is_published(), "{point}: {o:?}");
                let head = store.branch_head(STACK, "main").unwrap();
                assert_eq!(store.manifest(head).unwrap().len(), depth_before + 1);
                assert_eq!(conf(&store), merged.as_bytes(), "{point}");
            }
            assert_no_orphans(&store, &p, point).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_crash_at_each_step_of_a_checkpoint_leaves_a_node_or_nothing() {
        if !have_root("a_crash_at_each_step_of_a_checkpoint_leaves_a_node_or_nothing") {
            return;
        }
        for point in [
            "checkpoint.staged",
            "checkpoint.before_rename",
            "checkpoint.renamed",
            "checkpoint.committed",
        ] {
            let t = tmp();
            let root_dir = t.path().join("root");
            let (root, _) = graph(t.path(), 0).await;
            let sid = {
                let store = Arc::new(Store::open(&root_dir, &opts()).unwrap());
                let p = engine_with(&store, Default::default());
                let (_, s, _, _) = p
                    .attempt_start(&root, sandbox("a"), None, None)
                    .await
                    .unwrap();
                fill(&s, &[("work.txt", b"precious\n")]);
                s.id
            };
            crash_at("checkpoint", point, &root_dir, &[&sid.to_string()]);
            let (store, p) = restart(&root_dir).await;
            let g = store.graph("g").unwrap();
            let a = store.attempt_of_session(sid).unwrap().unwrap();
            if point == "checkpoint.committed" {
                assert_eq!(
                    g.nodes.len(),
                    2,
                    "{point}: the committed checkpoint is a node"
                );
                assert_eq!(a.status, layerstack_store::AttemptStatus::Checkpointed);
            } else {
                assert_eq!(
                    g.nodes.len(),
                    1,
                    "{point}: an uncommitted checkpoint is nothing"
                );
                assert_eq!(
                    a.status,
                    layerstack_store::AttemptStatus::Running,
                    "{point}"
                );
                let s = store.session(sid).unwrap();
                assert_eq!(
                    std::fs::read(s.upper.join("work.txt")).unwrap(),
                    b"precious\n",
                    "{point}: the attempt's writes are back in its upper"
                );
            }
            assert_no_orphans(&store, &p, point).await;
            // The same call, the same key: one node, the writes in it.
            let n = p
                .checkpoint(
                    sid,
                    Some(r#"{"score": 1}"#.into()),
                    Default::default(),
                    Some("k-cp".into()),
                )
                .await
                .unwrap();
            let again = p
                .checkpoint(
                    sid,
                    Some(r#"{"score": 1}"#.into()),
                    Default::default(),
                    Some("k-cp".into()),
                )
                .await
                .unwrap();
            assert_eq!(n.id, again.id, "{point}: one effect");
            assert_eq!(store.graph("g").unwrap().nodes.len(), 2, "{point}");
            assert!(shows(&store, n.manifest, "work.txt"), "{point}");
            assert_eq!(n.state, r#"{"score": 1}"#);
            assert_no_orphans(&store, &p, point).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_crash_at_each_step_of_a_merge_leaves_the_graph_as_it_was_or_merged() {
        if !have_root("a_crash_at_each_step_of_a_merge_leaves_the_graph_as_it_was_or_merged") {
            return;
        }
        for point in ["merge.branched", "merge.published", "merge.branch_dropped"] {
            let t = tmp();
            let root_dir = t.path().join("root");
            let (_, nodes) = graph(t.path(), 2).await;
            crash_at("merge", point, &root_dir, &[&nodes[0].id, &nodes[1].id]);
            let (store, p) = restart(&root_dir).await;
            assert_eq!(
                store.graph("g").unwrap().nodes.len(),
                3,
                "{point}: a merge interrupted before its node made none"
            );
            assert_no_orphans(&store, &p, point).await;
            let NodeMerged::Node(m) = p
                .node_merge(&nodes[0].id, &nodes[1].id, None, Some("k-m".into()))
                .await
                .unwrap()
            else {
                panic!("{point}: disjoint children merge")
            };
            let NodeMerged::Node(m2) = p
                .node_merge(&nodes[0].id, &nodes[1].id, None, Some("k-m".into()))
                .await
                .unwrap()
            else {
                panic!("{point}")
            };
            assert_eq!(m.id, m2.id, "{point}: one effect");
            assert_eq!(store.graph("g").unwrap().nodes.len(), 4, "{point}");
            assert!(
                shows(&store, m.manifest, "child-0.txt")
                    && shows(&store, m.manifest, "child-1.txt")
            );
            assert_no_orphans(&store, &p, point).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_crash_at_each_step_of_a_promote_loses_no_work_on_the_branch() {
        if !have_root("a_crash_at_each_step_of_a_promote_loses_no_work_on_the_branch") {
            return;
        }
        for point in [
            "promote.started",
            "promote.operation_published",
            "promote.moved",
        ] {
            let t = tmp();
            let root_dir = t.path().join("root");
            let (_, nodes) = graph(t.path(), 1).await;
            // main moves on after the graph was made: the promote must merge.
            let depth_before = {
                let store = Arc::new(Store::open(&root_dir, &opts()).unwrap());
                let p = engine_with(&store, Default::default());
                let s = session_with(&p, "main", "m", &[("main.txt", b"main\n")]).await;
                let out = p.publish(s.id, "test").await.unwrap();
                assert_eq!(out.outcome.unwrap().kind, OutcomeKind::Committed);
                store
                    .manifest_depth(store.branch_head(STACK, "main").unwrap())
                    .unwrap()
            };
            crash_at("promote", point, &root_dir, &[&nodes[0].id]);
            let (store, p) = restart(&root_dir).await;
            let head = store.branch_head(STACK, "main").unwrap();
            assert!(
                shows(&store, head, "main.txt"),
                "{point}: main's own work is never lost"
            );
            let moved = shows(&store, head, "child-0.txt");
            assert_eq!(
                moved,
                point != "promote.started",
                "{point}: main is as it was, or promoted whole"
            );
            assert_no_orphans(&store, &p, point).await;
            p.node_promote(&nodes[0].id, "main", Some("k-p".into()))
                .await
                .unwrap();
            p.node_promote(&nodes[0].id, "main", Some("k-p".into()))
                .await
                .unwrap();
            let head = store.branch_head(STACK, "main").unwrap();
            assert!(
                shows(&store, head, "main.txt") && shows(&store, head, "child-0.txt"),
                "{point}"
            );
            assert_eq!(
                store.manifest_depth(head).unwrap(),
                depth_before + 1,
                "{point}: one merge layer, however often it was called"
            );
            assert_no_orphans(&store, &p, point).await;
        }
    }

    /// A base import killed at each step: after the restart's sweep there is
    /// no stack and nothing in `l/` or `staging/` (the commit is the last
    /// step), and the same import then makes the whole base.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_crash_at_each_step_of_a_base_import_leaves_nothing_or_the_whole_base() {
        if !have_root("a_crash_at_each_step_of_a_base_import_leaves_nothing_or_the_whole_base") {
            return;
        }
        for point in [
            "import.staged",
            "import.before_rename",
            "import.after_rename",
        ] {
            let t = tmp();
            let root_dir = t.path().join("root");
            let src = t.path().join("src");
            write(&src, "etc/motd", b"imported\n");
            crash_at("import", point, &root_dir, &[src.to_str().unwrap()]);
            let (store, p) = restart(&root_dir).await;
            assert!(
                store.stacks().unwrap().is_empty(),
                "{point}: a stack survived"
            );
            for d in ["l", "staging"] {
                let left: Vec<_> = std::fs::read_dir(root_dir.join(d)).unwrap().collect();
                assert!(left.is_empty(), "{point}: {d}/ keeps {left:?}");
            }
            let b = p
                .import_base(crate::ImportRequest {
                    path: src.clone(),
                    kind: Default::default(),
                    platform: None,
                })
                .await
                .unwrap();
            assert!(b.created, "{point}");
            let head = store.branch_head(&b.stack, "main").unwrap();
            let view = publisher::LayerView::new(store.manifest_view(&b.stack, head).unwrap());
            assert_eq!(
                view.read_regular(b"etc/motd").unwrap().unwrap(),
                b"imported\n"
            );
            assert_no_orphans(&store, &p, point).await;
        }
    }
}

/// Deletes `rel` in session `s`'s upper as a container does: an overlay
/// whiteout, its parent directories made as the lease shows them (0755).
fn delete_in(s: &SessionInfo, rel: &str) {
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    let p = s.upper.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    for d in p.ancestors().skip(1).take(rel.matches('/').count()) {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    mknod(&p, SFlag::S_IFCHR, Mode::empty(), makedev(0, 0)).unwrap();
}

/// One publish on `branch` of the test stack: `files` written, `deleted` removed.
async fn publish_on(
    p: &Arc<Engine>,
    branch: &str,
    name: &str,
    files: &[(&str, &[u8])],
    deleted: &[&str],
) -> layerstack_store::LayerId {
    let s = session_with(p, branch, name, files).await;
    for d in deleted {
        delete_in(&s, d);
    }
    let out = p.publish(s.id, name).await.unwrap().outcome.unwrap();
    assert!(out.kind.is_published(), "{name}: {out:?}");
    out.layer.unwrap()
}

fn shows(store: &Store, branch: &str, path: &str) -> Option<Vec<u8>> {
    head_view(store, branch)
        .read_regular(path.as_bytes())
        .unwrap()
}

/// The tester's two cases: main deletes a file that existed when b4 forked
/// (and edits one b2 never touched), publishes 9 more times and squashes — the
/// run straddles both fork points. Promote merges exactly what each branch
/// changed: the deleted file stays deleted, no conflict on the edited one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promote_after_the_target_squashed_merges_only_the_branchs_changes() {
    if !have_root("a_promote_after_the_target_squashed_merges_only_the_branchs_changes") {
        return;
    }
    let t = tmp();
    let (store, _) = setup_n(t.path(), 1);
    let p = engine_with(&store, Default::default());
    let stack = "ns/sha256:aaa";
    let first = publish_on(
        &p,
        "main",
        "m-new",
        &[("root/new.txt", b"new\n"), ("root/g.txt", b"g0\n")],
        &[],
    )
    .await;
    store.create_branch(stack, "b4", "main", None).unwrap();
    store.create_branch(stack, "b2", "main", None).unwrap();
    publish_on(&p, "b4", "q1", &[("root/b4.txt", b"b4\n")], &[]).await;
    publish_on(&p, "b2", "w1", &[("root/b2.txt", b"b2\n")], &[]).await;
    publish_on(&p, "main", "q2", &[], &["root/new.txt"]).await;
    publish_on(&p, "main", "g", &[("root/g.txt", b"g1\n")], &[]).await;
    for i in 0..9 {
        let f = format!("root/m{i}");
        publish_on(&p, "main", &format!("m{i}"), &[(&f, b"m\n")], &[]).await;
    }
    let sq = p.squash(stack, "main").await.unwrap().expect("squashed");
    assert!(
        store.expand_layers(&[sq.layer]).unwrap().contains(&first),
        "the squash straddles the fork points"
    );
    let r = p.promote(stack, "b4", "main", "op-b4").await.unwrap();
    let crate::Promoted::Merged { session } = r else {
        panic!("{r:?}")
    };
    let counts = session.outcome.unwrap().counts;
    assert_eq!(
        counts.clean + counts.merged + counts.conflict,
        1,
        "b4 changed one path: {counts:?}"
    );
    assert_eq!(
        shows(&store, "main", "root/new.txt"),
        None,
        "not resurrected"
    );
    assert_eq!(shows(&store, "main", "root/b4.txt").unwrap(), b"b4\n");
    let r = p.promote(stack, "b2", "main", "op-b2").await.unwrap();
    assert!(matches!(r, crate::Promoted::Merged { .. }), "{r:?}");
    assert_eq!(shows(&store, "main", "root/g.txt").unwrap(), b"g1\n");
    assert_eq!(shows(&store, "main", "root/b2.txt").unwrap(), b"b2\n");
    assert_eq!(shows(&store, "main", "root/new.txt"), None);
    assert_eq!(shows(&store, "main", "root/m8").unwrap(), b"m\n");
}

/// Squashes on both sides, nested, the branch's straddling its fork point, and
/// GC in between (the branch's own layers are then on disk only inside its
/// squash): promote still merges exactly what the branch changed since the
/// merge base — its edits and deletions — and none of main's are undone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promote_from_a_squashed_branch_onto_a_squashed_target_merges_its_changes() {
    if !have_root("a_promote_from_a_squashed_branch_onto_a_squashed_target_merges_its_changes") {
        return;
    }
    let t = tmp();
    let (store, _) = setup_n(t.path(), 1);
    let p = engine_with(
        &store,
        crate::HistorySettings {
            squash_threshold: 0,
            squash_keep: 1,
            ..Default::default()
        },
    );
    let stack = "ns/sha256:aaa";
    for i in 0..4 {
        let f = format!("root/s{i}");
        publish_on(
            &p,
            "main",
            &format!("s{i}"),
            &[(&f, b"s\n"), ("root/old.txt", b"old\n")],
            &[],
        )
        .await;
    }
    store.create_branch(stack, "b", "main", None).unwrap();
    // c keeps the layers both share on disk through GC.
    store.create_branch(stack, "c", "main", None).unwrap();
    for i in 0..5 {
        let f = format!("root/b{i}");
        publish_on(&p, "b", &format!("b{i}"), &[(&f, b"b\n")], &[]).await;
    }
    publish_on(
        &p,
        "b",
        "b-conf",
        &[("etc/app.conf", &edit("key2 = 2", "key2 = B"))],
        &[],
    )
    .await;
    publish_on(&p, "b", "b-del", &[], &["root/s1"]).await;
    publish_on(&p, "b", "b-dir", &[("root/dir/x", b"x\n")], &[]).await;
    p.squash(stack, "b").await.unwrap().expect("squashed");
    // One publish between squashes: the size-tiered run then takes the squash.
    publish_on(&p, "b", "b-later", &[("root/later", b"later\n")], &[]).await;
    p.squash(stack, "b").await.unwrap().expect("squashed again");
    publish_on(
        &p,
        "main",
        "m-conf",
        &[("etc/app.conf", &edit("key6 = 6", "key6 = M"))],
        &[],
    )
    .await;
    publish_on(&p, "main", "m-del", &[], &["root/old.txt"]).await;
    publish_on(&p, "main", "m1", &[("root/m1", b"m\n")], &[]).await;
    p.squash(stack, "main").await.unwrap().expect("squashed");
    publish_on(&p, "main", "m3", &[("root/m3", b"m\n")], &[]).await;
    p.squash(stack, "main")
        .await
        .unwrap()
        .expect("squashed again");
    let kinds = |b: &str| {
        store
            .log(stack, b)
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e.kind,
                    e.members
                        .iter()
                        .any(|m| m.kind == layerstack_store::LayerKind::Squashed),
                )
            })
            .collect::<Vec<_>>()
    };
    assert!(
        kinds("b").iter().any(|(_, nested)| *nested),
        "{:?}",
        kinds("b")
    );
    assert!(
        kinds("main").iter().any(|(_, nested)| *nested),
        "{:?}",
        kinds("main")
    );
    let gc = p.gc().await.unwrap();
    assert!(
        !gc.report.layers.is_empty(),
        "the branch's own layers are freed"
    );
    let r = p.promote(stack, "b", "main", "op-b").await.unwrap();
    let crate::Promoted::Merged { session } = r else {
        panic!("{r:?}")
    };
    let out = session.outcome.unwrap();
    assert_eq!(out.counts.conflict, 0, "{out:?}");
    for i in 0..5 {
        assert_eq!(
            shows(&store, "main", &format!("root/b{i}")).unwrap(),
            b"b\n"
        );
    }
    assert_eq!(shows(&store, "main", "root/later").unwrap(), b"later\n");
    assert_eq!(shows(&store, "main", "root/dir/x").unwrap(), b"x\n");
    assert_eq!(shows(&store, "main", "root/s1"), None, "b's deletion");
    assert_eq!(shows(&store, "main", "root/s2").unwrap(), b"s\n");
    assert_eq!(
        shows(&store, "main", "root/old.txt"),
        None,
        "main's deletion stays"
    );
    assert_eq!(shows(&store, "main", "root/m3").unwrap(), b"m\n");
    let conf = String::from_utf8(shows(&store, "main", "etc/app.conf").unwrap()).unwrap();
    assert!(
        conf.contains("key2 = B") && conf.contains("key6 = M"),
        "{conf}"
    );
    // Without c, GC frees what both compacted: promote is refused, saying why.
    store.delete_branch(stack, "c").unwrap();
    publish_on(&p, "b", "b-again", &[("root/again", b"a\n")], &[]).await;
    p.squash(stack, "b").await.unwrap().expect("squashed");
    p.gc().await.unwrap();
    let before = store.branch_head(stack, "main").unwrap();
    let err = p.promote(stack, "b", "main", "op-b2").await.unwrap_err();
    let msg = crate::error::error_chain(&err);
    assert!(msg.contains("can no longer be built"), "{msg}");
    assert_eq!(store.branch_head(stack, "main").unwrap(), before);
}

/// Ancestry survives a squash: a branch at main's pre-squash head is up to
/// date with main, and one that published on top of it fast-forwards main.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promote_sees_ancestry_through_a_squash() {
    if !have_root("promote_sees_ancestry_through_a_squash") {
        return;
    }
    let t = tmp();
    let (store, _) = setup_n(t.path(), 1);
    let p = engine_with(
        &store,
        crate::HistorySettings {
            squash_threshold: 0,
            squash_keep: 2,
            ..Default::default()
        },
    );
    let stack = "ns/sha256:aaa";
    for i in 0..6 {
        let f = format!("f{i}");
        publish_on(&p, "main", &f, &[(&f, b"f\n")], &[]).await;
    }
    store.create_branch(stack, "u", "main", None).unwrap();
    store.create_branch(stack, "f", "main", None).unwrap();
    p.squash(stack, "main").await.unwrap().expect("squashed");
    publish_on(&p, "f", "on-f", &[("on-f", b"f\n")], &[]).await;
    let r = p.promote(stack, "u", "main", "op-u").await.unwrap();
    assert!(matches!(r, crate::Promoted::UpToDate { .. }), "{r:?}");
    let r = p.promote(stack, "f", "main", "op-f").await.unwrap();
    assert!(matches!(r, crate::Promoted::FastForward { .. }), "{r:?}");
    assert_eq!(
        store.branch_head(stack, "main").unwrap(),
        store.branch_head(stack, "f").unwrap()
    );
    // And the other way: main (squashed) onto f, which has it all.
    p.squash(stack, "main").await.unwrap();
    let r = p.promote(stack, "main", "f", "op-back").await.unwrap();
    assert!(matches!(r, crate::Promoted::UpToDate { .. }), "{r:?}");
}

/// `diff --at` a member of a squash: the view as of its publish against the
/// head, before GC (its old head) and after (built from the squash when it is
/// the newest member; refused, saying what to use, when it needs a freed one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diff_at_a_member_of_a_squash_compares_the_view_as_of_its_publish() {
    if !have_root("diff_at_a_member_of_a_squash_compares_the_view_as_of_its_publish") {
        return;
    }
    let t = tmp();
    let (store, _) = setup_n(t.path(), 1);
    let p = engine_with(
        &store,
        crate::HistorySettings {
            squash_threshold: 0,
            squash_keep: 1,
            ..Default::default()
        },
    );
    let stack = "ns/sha256:aaa";
    let mut layers = Vec::new();
    for i in 0..4 {
        let f = format!("f{i}");
        layers.push(publish_on(&p, "main", &f, &[(&f, b"f\n")], &[]).await);
    }
    let sq = p.squash(stack, "main").await.unwrap().unwrap().layer;
    let at = |layer| crate::DiffTarget::Layer {
        branch: "main".into(),
        layer,
    };
    let head = crate::DiffTarget::Branch("main".into());
    let paths = |d: &crate::Diff| {
        d.entries
            .iter()
            .map(|e| String::from_utf8(e.path.clone()).unwrap())
            .collect::<Vec<_>>()
    };
    let d = p
        .diff(stack, at(layers[1]), head.clone(), false)
        .await
        .unwrap();
    assert_eq!(paths(&d), ["f2", "f3"], "{d:?}");
    assert!(
        d.old.contains(&format!("compacted into layer {sq}")),
        "{}",
        d.old
    );
    p.gc().await.unwrap();
    let d = p
        .diff(stack, at(layers[2]), head.clone(), false)
        .await
        .unwrap();
    assert_eq!(
        paths(&d),
        ["f3"],
        "the newest member: the squash's own view"
    );
    let err = p
        .diff(stack, at(layers[1]), head.clone(), false)
        .await
        .unwrap_err();
    let msg = crate::error::error_chain(&err);
    assert!(msg.contains(&format!("use layer {sq}")), "{msg}");
    let err = p.diff(stack, at(9999), head, false).await.unwrap_err();
    assert!(matches!(err, EngineError::NotFound(_)), "{err:?}");
}

mod hostile;
mod model;
mod powercut;

/// Whether an exec is recorded: a new sandbox, which no running attempt
/// records, is answered from memory, and so is one the store said so of; an
/// attempt attached afterwards is found again (the attach takes the session
/// out of that memory) and its exec recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_remembered_as_unrecorded_is_recorded_once_an_attempt_attaches() {
    if !have_root("an_exec_remembered_as_unrecorded_is_recorded_once_an_attempt_attaches") {
        return;
    }
    use crate::SandboxRequest;
    use layerstack_store::{Begun, ExecRecord};
    let t = tmp();
    let (store, _) = setup_n(t.path(), 1);
    let p = engine_with(&store, Default::default());
    let (_, root) = p
        .graph_create("rec", "ns/sha256:aaa", "main", None)
        .await
        .unwrap();
    p.create_run("r", "rec", BTreeMap::new()).await.unwrap();
    let Begun::Attempt { attempt: a, .. } = p
        .begin_rollout(rollout_begin(&root.id, 0, None))
        .await
        .unwrap()
    else {
        panic!("rewarded")
    };
    let (s, _, _) = p
        .create_sandbox_session(SandboxRequest {
            name: "plain".into(),
            stack: "ns/sha256:aaa".into(),
            target: layerstack_store::LeaseTarget::Branch("main".into()),
            idempotency_key: None,
            policy: None,
            wait: None,
            node: Some(root.id.clone()),
            ignore_mtime: false,
            daemon_owned: true,
            wasi: false,
            reserve: Default::default(),
            id_map: None,
        })
        .await
        .unwrap();
    let rec = |cmd: &str| ExecRecord::new(vec![cmd.to_string()]);
    assert!(
        p.sandboxes.unrecorded().sessions.contains(&s.id),
        "a new sandbox"
    );
    assert_eq!(p.running_rollout_of_session(s.id).await.unwrap(), None);
    // As after a restart: the store answers, and is remembered.
    p.sandboxes.unrecorded().sessions.remove(&s.id);
    assert_eq!(p.running_rollout_of_session(s.id).await.unwrap(), None);
    assert!(
        p.sandboxes.unrecorded().sessions.contains(&s.id),
        "a sandbox no attempt records is remembered as such"
    );
    // An answer asked before an attach began is not remembered after it.
    let before = p.sandboxes.unrecorded().attaches;
    p.sandboxes.unrecorded().sessions.remove(&s.id);
    p.attach_rollout(a.id, s.id).await.unwrap();
    p.sandboxes.remember_unrecorded(s.id, before);
    assert!(!p.sandboxes.unrecorded().sessions.contains(&s.id));
    assert_eq!(
        p.running_rollout_of_session(s.id).await.unwrap(),
        Some(a.id),
        "an exec after the attach is the attempt's"
    );
    assert_eq!(p.record_exec(s.id, rec("after")).await.unwrap(), Some(a.id));
    let t = store.recorded_trajectory(a.id).unwrap().expect("recorded");
    let t = String::from_utf8(t).unwrap();
    assert!(
        t.matches("\"argv\"").count() == 1 && t.contains("\"after\""),
        "the attempt's trajectory holds the exec after its attach only: {t}"
    );
    p.close_sandbox_session(
        s.id,
        crate::EndAction::Discard,
        "test",
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert!(
        !p.sandboxes.unrecorded().sessions.contains(&s.id),
        "forgotten at the release"
    );
}
