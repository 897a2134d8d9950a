// The failpoint suite (issue 22, "every durable step is a crash point"),
// driven by the registry `layerstack_store::failpoints::POINTS`, not by a hand
// list: a point the suite cannot reach fails it.
//
// * Trace: each workload runs once in a child process that names every point
//   it reaches; a declared point no workload reaches fails the suite.
// * Crash pass: for every workload and every point it reaches, the workload
//   runs in a child process (this test binary re-executed) armed to abort
//   there. The recovery that follows is crashed again at every recovery point
//   it reaches (one child per point, until a recovery runs to its end); then
//   the parent restarts the store and the engine as the daemon does and
//   checks: `fsck` finds no problem and no staged publish is left; the work
//   committed before the crash is visible; what is visible (branch heads and
//   what they show, graph nodes, stacks, containerd snapshots, live export
//   leases) is the state before the operation or the state after the same
//   operation run again (done whole or not at all, never half); the run again
//   succeeds; no orphan directory or row.
// * I/O-error pass: for every workload and every point it reaches that takes
//   one, EIO and then ENOSPC is injected, scoped to the case's own store root
//   (the other tests of the process run beside it untouched): the operation
//   returns an error naming it, changes nothing visible, `fsck` is clean, and
//   the same operation then succeeds.

use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;
use std::time::Instant;

use layerstack_store::failpoints::{self, POINTS};
use layerstack_store::reliability::Figure;

use super::*;

/// The operations [`run_op`] runs.
pub(super) const OPS: &[&str] = &[
    "publish",
    "checkpoint",
    "merge",
    "promote",
    "import",
    "squash",
    "gc",
    "session",
    "attempt",
    "export",
    "pull",
    "snapshot-commit",
    "snapshot-remove",
    "snapshot-prepare",
    "snapshot-extract",
    "rebranch",
    "mount",
];

/// The containerd keys of the snapshot workloads: an image layer extracted on
/// the test image's, committed under its name.
const EXTRACT: &str = "ns/9/extract-9 sha256:bbb";
const IMAGE: &str = "ns/10/sha256:bbb";

/// The containerd keys of the Prepare workloads: a container's rootfs on the
/// image (a session), a second image layer extracted on it (a plain snapshot
/// over lowers), and the container that ran the image first (its stack and
/// branch made).
const CONTAINER: &str = "ns/12/ctr";
const EXTRACT2: &str = "ns/13/extract-13 sha256:ccc";
const FIRST: &str = "ns/11/first";

/// containerd's Prepare of the extraction and the layer's content written.
fn extract(store: &Store) {
    let dir = prepare_extraction(store, EXTRACT, "ns/2/sha256:aaa", "sha256:bbb");
    write(&dir, "layer.txt", b"layer\n");
}

/// containerd's Prepare of `key` on the image, or its answer that `key` was
/// prepared (the crash came after the commit).
fn prepare_on_image(
    store: &Store,
    key: &str,
    labels: BTreeMap<String, String>,
) -> Result<(), String> {
    match store.prepare(key, IMAGE, labels, false) {
        Ok(_) => Ok(()),
        Err(layerstack_store::StoreError::SnapshotExists(_)) => Ok(()),
        Err(e) => Err(crate::error::error_chain(&e)),
    }
}

/// The engine's history settings in the suite: a squash takes all but the
/// newest layer (no automatic squash).
pub(super) fn history() -> crate::HistorySettings {
    crate::HistorySettings {
        squash_keep: 1,
        ..Default::default()
    }
}

/// The daemon's restart ([`restart`]) with the suite's settings.
async fn restart_suite(root: &Path) -> (Arc<Store>, Arc<Engine>) {
    let store = Arc::new(Store::open(root, &opts()).unwrap());
    let p = engine_with(&store, history());
    p.recover_operations().await.unwrap();
    p.recover().await.unwrap();
    (store, p)
}

/// A prepared store for `op`, under `t`: the root and the child's arguments.
/// Every setup commits `committed.txt` on main first: the work a crash must
/// never lose.
async fn prepare(t: &Path, op: &str) -> (PathBuf, Vec<String>) {
    let root_dir = t.join("root");
    let graphs = matches!(op, "checkpoint" | "merge" | "promote" | "attempt");
    let nodes = match op {
        "merge" => 2,
        "promote" => 1,
        _ => 0,
    };
    let (store, node_ids, root_node) = if graphs {
        let (root, nodes) = graph(t, nodes).await;
        let store = Arc::new(Store::open(&root_dir, &opts()).unwrap());
        (store, nodes.into_iter().map(|n| n.id).collect(), root)
    } else {
        let (store, _) = setup_n(t, 2);
        (store, Vec::new(), String::new())
    };
    let p = engine_with(&store, history());
    let c = session_with(&p, "main", "committed", &[("committed.txt", b"committed\n")]).await;
    let o = p.publish(c.id, "committed").await.unwrap().outcome.unwrap();
    assert!(o.kind.is_published(), "{o:?}");
    let args = match op {
        "publish" => {
            // a lands line 2; b, leased before, edits line 6: its plan writes a
            // merged file into its upper (publish.applied is reached).
            let a = session_with(&p, "main", "a", &[]).await;
            let b = session_with(&p, "main", "b", &[]).await;
            write(&a.upper, "etc/app.conf", &edit("key2 = 2", "key2 = A"));
            write(&b.upper, "etc/app.conf", &edit("key6 = 6", "key6 = B"));
            let o = p.publish(a.id, "a").await.unwrap().outcome.unwrap();
            assert_eq!(o.kind, OutcomeKind::Committed);
            vec![b.id.to_string()]
        }
        "checkpoint" => {
            let (_, s, _, _) = p
                .attempt_start(&root_node, sandbox("a"), None, None)
                .await
                .unwrap();
            fill(&s, &[("work.txt", b"precious\n")]);
            vec![s.id.to_string()]
        }
        "merge" => node_ids,
        "attempt" => vec![root_node],
        "promote" => {
            let s = session_with(&p, "main", "m", &[("main.txt", b"main\n")]).await;
            let o = p.publish(s.id, "main").await.unwrap().outcome.unwrap();
            assert_eq!(o.kind, OutcomeKind::Committed);
            node_ids
        }
        "import" => {
            let src = t.join("src");
            write(&src, "etc/motd", b"imported\n");
            vec![src.display().to_string()]
        }
        "squash" | "gc" => {
            for i in 0..4 {
                let f = format!("f{i}");
                let s = session_with(&p, "main", &f, &[(&f, b"f\n")]).await;
                p.publish(s.id, &f).await.unwrap();
            }
            if op == "gc" {
                // Something to free: a deleted branch's layer, a squash's members.
                store.create_branch(STACK, "tmp", "main", None).unwrap();
                let s = session_with(&p, "tmp", "tmp", &[("tmp.txt", b"tmp\n")]).await;
                p.publish(s.id, "tmp").await.unwrap();
                store.delete_branch(STACK, "tmp").unwrap();
                p.squash(STACK, "main").await.unwrap().expect("squashed");
            }
            vec![]
        }
        "snapshot-commit" => {
            extract(&store);
            vec![]
        }
        "snapshot-remove" | "snapshot-extract" => {
            extract(&store);
            store.commit(IMAGE, EXTRACT, BTreeMap::new()).unwrap();
            vec![]
        }
        "snapshot-prepare" | "rebranch" => {
            extract(&store);
            store.commit(IMAGE, EXTRACT, BTreeMap::new()).unwrap();
            let (_, spec) = store.prepare(FIRST, IMAGE, BTreeMap::new(), false).unwrap();
            assert!(matches!(spec, MountSpec::Overlay { upper: Some(_), .. }), "{spec:?}");
            let sid = store.snapshot_session(FIRST).unwrap().expect("a session");
            vec![sid.to_string()]
        }
        "mount" => {
            // A sandbox session whose run published: its mount starts a new run.
            let s = session_with(&p, "main", "m", &[("mounted.txt", b"m\n")]).await;
            let o = p.publish(s.id, "m").await.unwrap().outcome.unwrap();
            assert!(o.kind.is_published(), "{o:?}");
            // Its fresh upper could not be made (a full disk after the
            // publish): the mount makes all its directories, or none.
            std::fs::remove_dir_all(store.session_dir(s.id)).unwrap();
            vec![s.id.to_string()]
        }
        "pull" => {
            // A layer another store pushed: one file, as a gzip blob.
            let layer = t.join("pushed");
            write(&layer, "pulled.txt", b"pulled\n");
            let blob = t.join("blob.tar.gz");
            let b = crate::write_layer_blob(
                &layer,
                crate::Compression::Gzip,
                &Default::default(),
                std::fs::File::create(&blob).unwrap(),
            )
            .unwrap();
            vec![blob.display().to_string(), b.diff_id]
        }
        "session" | "export" => vec![],
        other => panic!("no workload {other}"),
    };
    (root_dir, args)
}

/// Runs workload `op` on `p` with `args` once (the child's half, and the run
/// again). Err: the operation failed, its error chain.
pub(super) async fn run_op(
    store: &Arc<Store>,
    p: &Arc<Engine>,
    op: &str,
    args: &[&str],
) -> Result<(), String> {
    let chain = |e: EngineError| crate::error::error_chain(&e);
    match op {
        "publish" => {
            let s = p.publish(args[0].parse().unwrap(), "crash test").await.map_err(chain)?;
            match s.outcome {
                // NoChange: published before (the crash came after the commit).
                Some(o) if o.kind.is_published() || o.kind == OutcomeKind::NoChange => Ok(()),
                _ => Err(ended("publish", &s)),
            }
        }
        "checkpoint" => p
            .checkpoint(
                args[0].parse().unwrap(),
                Some(r#"{"score": 1}"#.into()),
                Default::default(),
                Some("k-cp".into()),
            )
            .await
            .map(drop)
            .map_err(chain),
        "merge" => match p
            .node_merge(args[0], args[1], None, Some("k-m".into()))
            .await
            .map_err(chain)?
        {
            crate::NodeMerged::Node(_) => Ok(()),
            crate::NodeMerged::Conflict { session } => Err(ended("merge", &session)),
        },
        "promote" => match p
            .node_promote(args[0], "main", Some("k-p".into()))
            .await
            .map_err(chain)?
        {
            crate::Promoted::Conflict { session } => Err(ended("promote", &session)),
            _ => Ok(()),
        },
        "import" => p
            .import_base(crate::ImportRequest {
                path: args[0].into(),
                kind: Default::default(),
                platform: None,
            })
            .await
            .map(drop)
            .map_err(chain),
        "squash" => p.squash(STACK, "main").await.map(drop).map_err(chain),
        "gc" => p.gc().await.map(drop).map_err(chain),
        "session" => {
            let (s, _, _) = p
                .create_session(
                    sandbox("sx"),
                    STACK,
                    layerstack_store::LeaseTarget::Branch("main".into()),
                    Some("k-s".into()),
                )
                .await
                .map_err(chain)?;
            store.release_session(s.id, false).map_err(|e| e.to_string())
        }
        "attempt" => p
            .attempt_start(args[0], sandbox("at"), Some("k-a".into()), None)
            .await
            .map(drop)
            .map_err(chain),
        "export" => {
            let e = p
                .begin_export(
                    &layerstack_store::ExportSource::Branch {
                        stack: STACK.into(),
                        branch: "main".into(),
                    },
                    "crash test",
                )
                .map_err(chain)?;
            drop(e);
            Ok(())
        }
        "pull" => {
            let node = layerstack_store::AdoptNode {
                id: "n0123456789abcdef".into(),
                group: layerstack_store::AdoptGroup {
                    name: "pulled".into(),
                    branch: None,
                    root: None,
                },
                kind: layerstack_store::NodeKind::Checkpoint,
                state: "{}".into(),
                parents: vec![],
                provenance: Default::default(),
                created_ns: 1,
            };
            let layer = crate::PulledLayer {
                diff_id: args[1].to_string(),
                blobs: vec![],
                content: crate::PulledContent::Blob(Box::new(
                    std::fs::File::open(args[0]).unwrap(),
                )),
                origin: "layer 1/1 of the crash test".into(),
            };
            let p = p.clone();
            tokio::task::spawn_blocking(move || p.adopt_pulled_node(STACK, vec![layer], &node))
                .await
                .unwrap()
                .map(drop)
                .map_err(chain)
        }
        // containerd's calls: the same call again answers that it was done.
        "snapshot-commit" => match store.commit(IMAGE, EXTRACT, BTreeMap::new()) {
            Ok(_) => Ok(()),
            Err(_) if store.stat(IMAGE).is_ok() && store.stat(EXTRACT).is_err() => Ok(()),
            Err(e) => Err(e.to_string()),
        },
        "snapshot-remove" => match store.remove(IMAGE) {
            Ok(_) => Ok(()),
            Err(layerstack_store::StoreError::SnapshotNotFound(_)) => Ok(()),
            Err(e) => Err(e.to_string()),
        },
        "snapshot-prepare" => prepare_on_image(store, CONTAINER, BTreeMap::new()),
        "snapshot-extract" => prepare_on_image(
            store,
            EXTRACT2,
            BTreeMap::from([(SNAPSHOT_REF_LABEL.to_string(), "sha256:ccc".to_string())]),
        ),
        // The shim's rebranch of the first container before its start: the
        // same call again finds it on the branch.
        "rebranch" => store
            .rebranch_session(args[0].parse().unwrap(), "other", false)
            .map(drop)
            .map_err(|e| crate::error::error_chain(&e)),
        "mount" => store
            .session_mount(args[0].parse().unwrap())
            .map(drop)
            .map_err(|e| crate::error::error_chain(&e)),
        other => panic!("unknown operation {other}"),
    }
}

/// An operation whose session did not publish: its outcome, as an error.
fn ended(op: &str, s: &SessionInfo) -> String {
    match &s.outcome {
        Some(o) => format!(
            "{op} ended {}: {}",
            o.kind.as_str(),
            o.message.as_deref().unwrap_or_default()
        ),
        None => format!("{op} ended without an outcome"),
    }
}

/// What a client can see: every stack, each branch's depth and what its head
/// shows at the paths the workloads write, the graph's nodes, live export
/// leases. A crash leaves it as before the operation or as after it.
fn visible(store: &Store) -> String {
    const PROBES: &[&str] = &[
        "committed.txt",
        "etc/app.conf",
        "etc/motd",
        "work.txt",
        "child-0.txt",
        "child-1.txt",
        "main.txt",
        "f0",
        "f3",
        "tmp.txt",
        "layer.txt",
    ];
    let mut out = String::new();
    for s in store.stacks().unwrap() {
        for b in store.branches(&s.id).unwrap() {
            let view = publisher::LayerView::new(store.manifest_view(&s.id, b.head).unwrap());
            out.push_str(&format!("{} {} depth {}:", s.id, b.name, b.depth));
            for path in PROBES {
                if let Some(c) = view.read_regular(path.as_bytes()).unwrap() {
                    out.push_str(&format!(" {path}={:?}", String::from_utf8_lossy(&c)));
                }
            }
            out.push('\n');
        }
    }
    if let Ok(g) = store.graph("g") {
        out.push_str(&format!("graph g: {} nodes\n", g.nodes.len()));
    }
    if let Ok(g) = store.graph("pulled") {
        for n in &g.nodes {
            let view = publisher::LayerView::new(store.manifest_view(STACK, n.manifest).unwrap());
            let c = view.read_regular(b"pulled.txt").unwrap();
            out.push_str(&format!("pulled node {}: {c:?}\n", n.id));
        }
    }
    let snaps: Vec<String> = store
        .list()
        .unwrap()
        .into_iter()
        .map(|s| format!("{}({:?})", s.key, s.kind))
        .collect();
    out.push_str(&format!("snapshots: {snaps:?}\n"));
    out.push_str(&format!(
        "export leases: {}\n",
        store.live_export_leases().unwrap().len()
    ));
    out
}

/// fsck finds nothing, and no staged publish is left behind (with no
/// operation in flight, every one was committed or dropped).
fn assert_fsck_clean(store: &Store, what: &str) {
    let r = store.fsck(false).unwrap();
    assert!(r.problems.is_empty(), "{what}: fsck finds {:#?}", r.problems);
    assert_eq!(
        store.staged_publishes().unwrap(),
        0,
        "{what}: a staged publish was left behind"
    );
}

/// No session directory is left half-made by a failed mkdir: each `s/<n>`
/// has both its upper and its workdir.
fn assert_no_half_made_session(root: &Path, what: &str) {
    let Ok(rd) = std::fs::read_dir(root.join("s")) else {
        return;
    };
    for e in rd.flatten() {
        let d = e.path();
        let has = |n: &str| d.join(n).symlink_metadata().is_ok();
        assert!(
            has("upper") && has("work"),
            "{what}: session directory {} is half-made (upper {}, work {})",
            d.display(),
            has("upper"),
            has("work")
        );
    }
}

fn assert_committed_kept(store: &Store, what: &str) {
    let head = store.branch_head(STACK, "main").unwrap();
    let view = publisher::LayerView::new(store.manifest_view(STACK, head).unwrap());
    assert_eq!(
        view.read_regular(b"committed.txt").unwrap().as_deref(),
        Some(&b"committed\n"[..]),
        "{what}: work committed before the crash is lost"
    );
}

/// How a child ended.
#[derive(Debug, PartialEq)]
pub(super) enum End {
    /// Aborted at this point.
    Crashed(String),
    /// Ran to its end; `ok`: the operation succeeded.
    Finished { ok: bool },
}

/// Runs this test binary as a child: `op` with `args` on the store at `root`
/// with crash points `armed` (`recover`: the daemon's restart), optionally
/// tracing the points it reaches into `trace`.
pub(super) fn child(
    op: &str,
    armed: &[&str],
    root: &Path,
    args: &[String],
    trace: Option<&Path>,
) -> End {
    let mut spec = format!("{op}|{}|{}", armed.join(","), root.display());
    for a in args {
        spec.push('|');
        spec.push_str(a);
    }
    let hit = root.with_extension("hit");
    let _ = std::fs::remove_file(&hit);
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--ignored",
        "--exact",
        "tests::crash::crash_child",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD, spec)
    .env(failpoints::HIT_FILE_ENV, &hit)
    .env_remove(failpoints::TRACE_FILE_ENV)
    .env_remove("RUST_LOG")
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null());
    if let Some(t) = trace {
        cmd.env(failpoints::TRACE_FILE_ENV, t);
    }
    let st = cmd.status().unwrap();
    if st.signal() == Some(libc::SIGABRT) {
        let name = std::fs::read_to_string(&hit)
            .unwrap_or_else(|e| panic!("{op}: the child aborted without naming its point: {e}"));
        return End::Crashed(name);
    }
    match st.code() {
        Some(3) => End::Finished { ok: true },
        Some(5) => End::Finished { ok: false },
        _ => panic!("{op} armed at {armed:?}: the child must abort at a point or run to its end ({st:?})"),
    }
}

/// The points (not of the recovery) that workload `op` reaches, in the order
/// first reached: the workload run whole in a child that traces them.
async fn reached(op: &str) -> Vec<String> {
    let t = tmp();
    let (root_dir, args) = prepare(t.path(), op).await;
    let trace = root_dir.with_extension("trace");
    assert_eq!(
        child(op, &[], &root_dir, &args, Some(&trace)),
        End::Finished { ok: true },
        "{op} must succeed when nothing is armed"
    );
    let text = std::fs::read_to_string(&trace).unwrap_or_default();
    let mut seen = BTreeSet::new();
    text.lines()
        .filter(|n| failpoints::point(n).is_some_and(|p| !p.recovery))
        .filter(|n| seen.insert(n.to_string()))
        .map(str::to_string)
        .collect()
}

/// Every workload with the points it reaches; fails when a declared point is
/// reached by none (neither a workload nor, for a recovery point, a recovery).
async fn trace_all() -> Vec<(&'static str, Vec<String>)> {
    let mut out = Vec::new();
    for op in OPS {
        out.push((*op, reached(op).await));
    }
    let unreached: Vec<&str> = POINTS
        .iter()
        .filter(|p| !p.recovery && !out.iter().any(|(_, pts)| pts.iter().any(|x| x == p.name)))
        .map(|p| p.name)
        .collect();
    assert!(
        unreached.is_empty(),
        "declared points no workload of the suite reaches: {unreached:?} (add a workload in crash_suite.rs)"
    );
    out
}

/// Figures of one pass, for the reliability record.
#[derive(Default)]
struct Tally {
    crashed: BTreeSet<String>,
    recrashed: BTreeSet<String>,
    recrashes: u64,
}

/// Workload `op` at one point it reaches: crash there, crash the recovery at every recovery point
/// it reaches, recover, check.
async fn crash_and_recover(point: &str, op: &str) -> Tally {
    let t = tmp();
    let (root_dir, args) = prepare(t.path(), op).await;
    let before = {
        let store = Store::open(&root_dir, &opts()).unwrap();
        visible(&store)
    };
    let died = child(op, &[point], &root_dir, &args, None);
    assert_eq!(died, End::Crashed(point.to_string()), "{op} must reach {point}");
    eprintln!("crashed at {point} ({op})");
    let mut tally = Tally::default();
    tally.crashed.insert(point.to_string());
    // The recovery, crashed at each recovery point it reaches in turn.
    let mut left: Vec<&str> = POINTS
        .iter()
        .filter(|p| p.recovery)
        .map(|p| p.name)
        .collect();
    while let End::Crashed(r) = child("recover", &left, &root_dir, &[], None) {
        tally.recrashes += 1;
        left.retain(|x| *x != r);
        tally.recrashed.insert(r);
    }
    let what = format!("crash at {point} ({op})");
    let (store, p) = restart_suite(&root_dir).await;
    assert_fsck_clean(&store, &what);
    assert_committed_kept(&store, &what);
    let after_crash = visible(&store);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    run_op(&store, &p, op, &argv)
        .await
        .unwrap_or_else(|e| panic!("{what}: the operation run again fails: {e}"));
    let again = visible(&store);
    assert!(
        after_crash == before || after_crash == again,
        "{what}: half applied — before:\n{before}after the crash:\n{after_crash}after running it again:\n{again}"
    );
    assert_committed_kept(&store, &what);
    assert_no_orphans(&store, &p, &what).await;
    assert_fsck_clean(&store, &what);
    tally
}

fn record(id: &str, guarantee: &str, test: &str, figures: &[(&str, Figure)]) {
    layerstack_store::reliability::record(id, guarantee, test, figures).unwrap();
}

fn seconds(since: Instant) -> f64 {
    (since.elapsed().as_secs_f64() * 10.0).round() / 10.0
}

/// Every declared point crashed, its recovery crashed again, recovered clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_registered_failpoint_is_crashed_and_recovered_and_so_is_its_recovery() {
    if !have_root("every_registered_failpoint_is_crashed_and_recovered_and_so_is_its_recovery") {
        return;
    }
    let started = Instant::now();
    let traced = trace_all().await;
    let mut all = Tally::default();
    let mut pairs = 0u64;
    for (op, points) in &traced {
        for point in points {
            let t = crash_and_recover(point, op).await;
            pairs += 1;
            all.crashed.extend(t.crashed);
            all.recrashed.extend(t.recrashed);
            all.recrashes += t.recrashes;
        }
    }
    let never: Vec<&str> = POINTS
        .iter()
        .filter(|p| !(all.crashed.contains(p.name) || all.recrashed.contains(p.name)))
        .map(|p| p.name)
        .collect();
    assert!(never.is_empty(), "declared points the suite never crashed at: {never:?}");
    record(
        "crash-points",
        "A crash (abort, as kill -9) at any declared durable step of capture, publish, checkpoint, merge, promote, squash, GC, import, export, sessions and containerd snapshots — and again during the recovery that follows — loses nothing committed, leaves the operation done whole or not at all, and fsck finds the store clean after the restart.",
        "cargo test -p layerstack-engine --lib tests::crash::suite::every_registered_failpoint_is_crashed_and_recovered_and_so_is_its_recovery",
        &[
            ("points_registered", POINTS.len().into()),
            ("workloads", OPS.len().into()),
            ("workload_point_crashes", pairs.into()),
            ("points_crashed", (all.crashed.len() + all.recrashed.len()).into()),
            ("operation_points_crashed", all.crashed.len().into()),
            ("recovery_points_crashed", all.recrashed.len().into()),
            ("recovery_re_crashes", all.recrashes.into()),
            ("seconds", seconds(started).into()),
        ],
    );
}

/// Every point that takes an I/O error: EIO, then ENOSPC (a fresh store each),
/// the operation fails naming it and changes nothing visible; fsck is clean;
/// the same operation then succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_io_error_at_each_point_fails_the_operation_cleanly_and_the_next_one_works() {
    if !have_root("an_io_error_at_each_point_fails_the_operation_cleanly_and_the_next_one_works") {
        return;
    }
    let started = Instant::now();
    let traced = trace_all().await;
    let mut io_points = BTreeSet::new();
    let mut injected = 0u64;
    for (op, points) in &traced {
        for p in points.iter().filter(|p| failpoints::point(p).is_some_and(|p| p.io)) {
        io_points.insert(p.clone());
        for errno in [libc::EIO, libc::ENOSPC] {
            let what = format!("{} at {p} ({op})", std::io::Error::from_raw_os_error(errno));
            let t = tmp();
            let (root_dir, args) = prepare(t.path(), op).await;
            let argv: Vec<&str> = args.iter().map(String::as_str).collect();
            let (store, e) = restart_suite(&root_dir).await;
            let before = visible(&store);
            let fault = failpoints::arm_io(p, &root_dir, errno);
            let err = run_op(&store, &e, op, &argv)
                .await
                .expect_err(&format!("{what}: the operation must fail"));
            assert_eq!(fault.fired(), 1, "{what}: the point was not reached");
            drop(fault);
            injected += 1;
            let said = std::io::Error::from_raw_os_error(errno).to_string();
            assert!(err.contains(&said), "{what}: the error does not say it: {err}");
            assert_eq!(visible(&store), before, "{what}: a failed operation changed what is visible");
            assert_fsck_clean(&store, &what);
            assert_no_half_made_session(&root_dir, &what);
            run_op(&store, &e, op, &argv)
                .await
                .unwrap_or_else(|e| panic!("{what}: the same operation afterwards fails: {e}"));
            if !matches!(*op, "session" | "attempt" | "export" | "gc" | "mount") {
                // (Those leave nothing visible behind when they succeed.)
                assert_ne!(
                    visible(&store),
                    before,
                    "{what}: the operation afterwards did nothing"
                );
            }
            assert_committed_kept(&store, &what);
            assert_no_orphans(&store, &e, &what).await;
            assert_fsck_clean(&store, &what);
        }
        }
    }
    let never: Vec<&str> = POINTS
        .iter()
        .filter(|p| p.io && !io_points.contains(p.name))
        .map(|p| p.name)
        .collect();
    assert!(never.is_empty(), "io points no workload reaches: {never:?}");
    record(
        "io-errors",
        "An I/O error (EIO, ENOSPC) at any declared durable step that can fail with one makes the operation return an error naming it, with nothing visible changed and fsck clean; the same operation then succeeds.",
        "cargo test -p layerstack-engine --lib tests::crash::suite::an_io_error_at_each_point_fails_the_operation_cleanly_and_the_next_one_works",
        &[
            ("points_registered", POINTS.len().into()),
            ("io_points", io_points.len().into()),
            ("io_errors_injected", injected.into()),
            ("errnos", "EIO, ENOSPC".into()),
            ("seconds", seconds(started).into()),
        ],
    );
}
