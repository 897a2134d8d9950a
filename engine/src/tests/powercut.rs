//! Unsynced data loss (issue 22): a power cut right after each publish was
//! reported committed. The store lives on ext4 on a loop device over a file;
//! a child process (this test binary re-executed) publishes one session at a
//! time and, after each outcome it reports, stops until the parent has copied
//! the loop device's backing file. The copy is the disk as the power cut leaves
//! it: what the filesystem wrote out (fsync'd or written back), without the
//! dirty pages still in the page cache — LazyFS's model, at the block layer
//! (this kernel has no device-mapper for `dm-log-writes`, and LazyFS is not
//! packaged). Each copy is then mounted (ext4 replays its journal), the store
//! opened as the daemon does (startup sweep, engine recovery) and checked:
//!
//! * `durable` profile: every publish reported before the cut is there;
//! * `disposable` (default): what is there is a prefix of what was reported —
//!   the newest publishes may be missing, or there with files whose data never
//!   reached the disk (torn: empty or short); nothing older is missing while a
//!   newer one is there; `fsck --content` flags exactly the torn files (the
//!   numbers are recorded);
//! * `durable`: `fsck --content` finds nothing.
//!
//! And in the durable profile, cuts *inside* a publish, a squash, a GC and a
//! base import: at each failpoint the operation reaches
//! (`layerstack_store::failpoints`, paused there while the disk is copied) the
//! operation is whole or absent after the restart, and right after it was
//! reported it is there.
//!
//! Writeback during the copy is possible (the kernel's flusher runs on its own
//! clock); it only makes a copy newer, never inconsistent beyond what a real
//! power cut with a volatile disk cache allows, which ext4's journal handles.

use super::*;
use std::collections::BTreeSet;
use std::process::Command;

const CHILD: &str = "LAYERSTACK_POWERCUT_CHILD";
const STACK: &str = "ns/sha256:aaa";

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// A loop-mounted ext4 image, unmounted and detached on drop.
struct Disk {
    dev: String,
    mnt: std::path::PathBuf,
}

impl Disk {
    fn format(image: &Path, bytes: u64) {
        std::fs::File::create(image)
            .unwrap()
            .set_len(bytes)
            .unwrap();
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(image));
    }

    fn mount(image: &Path, mnt: &Path) -> Disk {
        std::fs::create_dir_all(mnt).unwrap();
        let dev = run(Command::new("losetup").args(["-f", "--show"]).arg(image));
        run(Command::new("mount").arg(&dev).arg(mnt));
        Disk {
            dev,
            mnt: mnt.to_path_buf(),
        }
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mnt).status();
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
    }
}

fn options(durable: bool) -> StoreOptions {
    StoreOptions {
        durability: if durable {
            layerstack_store::Durability::Durable
        } else {
            layerstack_store::Durability::Disposable
        },
        startup_sweep: true,
        ..Default::default()
    }
}

fn marker(k: usize) -> String {
    format!("published/{k}.txt")
}

/// The operations a power cut lands inside (besides a publish): each runs
/// after the child's publishes, on the branch they made.
const OPS: &[&str] = &["publish", "squash", "gc", "import"];

/// The engine's history settings in the child: a squash takes all but the
/// newest layer.
fn history() -> crate::HistorySettings {
    crate::HistorySettings {
        squash_keep: 1,
        ..Default::default()
    }
}

/// The child half: `root|durable|publishes|control dir|pause at|operation`.
/// It publishes `publishes` sessions, reporting each (`reported-K`, then waits
/// for `go-K`); with an operation other than `publish` it then runs that
/// operation and reports it the same way (`reported-op`, holding what the
/// operation made; `go-op`). The pause point is armed, and the trace begun,
/// for the last operation only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child half of the power-cut test: it runs it, it never runs alone"]
async fn powercut_child() {
    let spec = std::env::var(CHILD).expect("run by the power-cut test only");
    let f: Vec<&str> = spec.split('|').collect();
    let (root, durable, n, ctl) = (
        Path::new(f[0]),
        f[1] == "1",
        f[2].parse::<usize>().unwrap(),
        Path::new(f[3]),
    );
    // A point to pause at during the last operation (the per-point cuts).
    let pause_at = f.get(4).filter(|p| !p.is_empty()).copied();
    let op = f
        .get(5)
        .filter(|p| !p.is_empty())
        .copied()
        .unwrap_or("publish");
    let store = Arc::new(Store::open(root, &options(durable)).unwrap());
    let p = engine_with(&store, history());
    // The traced run: the points of the last operation only (not the open's
    // recovery points, nor the publishes before it).
    let begin_last = || {
        if let Some(t) = std::env::var_os(layerstack_store::failpoints::TRACE_FILE_ENV) {
            std::fs::write(t, b"").unwrap();
        }
        if let Some(point) = pause_at {
            layerstack_store::failpoints::arm(point);
        }
    };
    let reported = |what: &str, made: &str| {
        std::fs::write(ctl.join(format!("reported-{what}")), made).unwrap();
        let go = ctl.join(format!("go-{what}"));
        while !go.exists() {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    };
    for k in 1..=n {
        if k == n && op == "publish" {
            begin_last();
        }
        let body = format!("publish {k}\n").repeat(64);
        let s = session_with(
            &p,
            "main",
            &format!("pc{k}"),
            &[(marker(k).as_str(), body.as_bytes())],
        )
        .await;
        let out = p.publish(s.id, "power cut").await.unwrap().outcome.unwrap();
        assert!(out.kind.is_published(), "{out:?}");
        // Reported: the parent cuts the power now, then lets us go on.
        reported(&k.to_string(), "");
    }
    if op == "publish" {
        std::process::exit(0);
    }
    if op == "gc" {
        // Something to free: a deleted branch's layer and a squash's members.
        store.create_branch(STACK, "tmp", "main", None).unwrap();
        let s = session_with(&p, "tmp", "tmp", &[("tmp.txt", b"tmp\n")]).await;
        let out = p.publish(s.id, "tmp").await.unwrap().outcome.unwrap();
        assert!(out.kind.is_published(), "{out:?}");
        store.delete_branch(STACK, "tmp").unwrap();
        p.squash(STACK, "main").await.unwrap().expect("squashed");
    }
    let src = ctl.join("import-src");
    if op == "import" {
        for i in 0..16 {
            write(&src, &format!("data/{i}.txt"), imported(i).as_bytes());
        }
    }
    begin_last();
    let made = match op {
        "squash" => {
            p.squash(STACK, "main").await.unwrap().expect("squashed");
            format!("depth {}", depth(&store))
        }
        "gc" => {
            let c = p.gc().await.unwrap();
            assert!(!c.report.layers.is_empty(), "the gc freed nothing");
            format!("depth {}", depth(&store))
        }
        "import" => {
            let b = p
                .import_base(crate::ImportRequest {
                    path: src.clone(),
                    kind: Default::default(),
                    platform: None,
                })
                .await
                .unwrap();
            assert!(b.created);
            b.stack
        }
        other => panic!("no operation {other}"),
    };
    reported("op", &made);
    std::process::exit(0);
}

/// The content of the imported base's file `i`.
fn imported(i: usize) -> String {
    format!("imported {i}\n").repeat(256)
}

/// The depth of the child's branch `main`.
fn depth(store: &Store) -> usize {
    store
        .branches(STACK)
        .unwrap()
        .into_iter()
        .find(|b| b.name == "main")
        .expect("branch main")
        .depth as usize
}

/// Runs `publishes` publishes in a child on a fresh loop-mounted store and
/// cuts the power after each; returns, per cut, (publishes reported, of them
/// whole after the restart), and the number of torn files seen over all cuts.
async fn cut_after_each_publish(durable: bool, publishes: usize) -> (Vec<(usize, usize)>, usize) {
    let t = tmp();
    let image = t.path().join("disk.img");
    Disk::format(&image, 256 << 20);
    let ctl = t.path().join("ctl");
    std::fs::create_dir_all(&ctl).unwrap();
    let disk = Disk::mount(&image, &t.path().join("mnt"));
    // The stack, made and synced before the cuts begin.
    {
        let (store, _) = setup_n(&disk.mnt, 1);
        drop(store);
    }
    run(Command::new("sync").arg("-f").arg(&disk.mnt));
    let root = disk.mnt.join("root");
    let mut child = child(&root, durable, publishes, &ctl, "", "publish")
        .spawn()
        .unwrap();
    let mut cuts = Vec::new();
    for k in 1..=publishes {
        let reported = ctl.join(format!("reported-{k}"));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while !reported.exists() {
            if let Some(st) = child.try_wait().unwrap() {
                panic!("the publishing child ended early: {st:?}");
            }
            assert!(
                std::time::Instant::now() < deadline,
                "publish {k} never reported"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // The power cut: the disk as it is, page cache not flushed.
        let cut = t.path().join(format!("cut-{k}.img"));
        run(Command::new("cp")
            .arg("--sparse=always")
            .arg(&image)
            .arg(&cut));
        cuts.push(cut);
        std::fs::write(ctl.join(format!("go-{k}")), b"").unwrap();
    }
    let st = child.wait().unwrap();
    assert!(st.success(), "the publishing child failed: {st:?}");
    drop(disk);

    let mut found = Vec::new();
    let mut torn = 0;
    for (i, cut) in cuts.iter().enumerate() {
        let reported = i + 1;
        let disk = Disk::mount(cut, &t.path().join(format!("m{reported}")));
        let root = disk.mnt.join("root");
        let store = Arc::new(Store::open(&root, &options(durable)).unwrap());
        let p = engine_with(&store, Default::default());
        p.recover_operations().await.unwrap();
        p.recover().await.unwrap();
        let view = head_view(&store, "main");
        // Each reported publish: whole, torn (there, content not what was
        // written: its data was still in the page cache) or absent.
        let state: Vec<State> = (1..=reported)
            .map(|k| match view.read_regular(marker(k).as_bytes()).unwrap() {
                Some(b) if b == format!("publish {k}\n").repeat(64).into_bytes() => State::Whole,
                Some(_) => State::Torn,
                None => State::Absent,
            })
            .collect();
        let shown = state.iter().take_while(|s| **s != State::Absent).count();
        assert!(
            state[shown..].iter().all(|s| *s == State::Absent),
            "cut {reported}: a newer publish survived an older one: {state:?}"
        );
        let report = store.fsck_with(false, true).unwrap();
        if durable {
            assert!(
                state.iter().all(|s| *s == State::Whole),
                "durable profile, cut after publish {reported} was reported: {state:?}"
            );
            assert_eq!(
                report.unrepaired(),
                0,
                "cut {reported}: fsck after the power cut: {:?}",
                report.problems
            );
        } else {
            // fsck --content finds every torn file, and nothing else.
            let flagged: BTreeSet<usize> = report
                .problems
                .iter()
                .map(|pr| {
                    (1..=reported)
                        .find(|k| {
                            pr.subject.ends_with(&format!("/{}", marker(*k)))
                                && matches!(pr.kind, "content-mismatch" | "index-mismatch")
                        })
                        .unwrap_or_else(|| {
                            panic!("cut {reported}: fsck problem beyond a torn file: {pr:?}")
                        })
                })
                .collect();
            let torn_here: BTreeSet<usize> = (1..=reported)
                .filter(|k| state[k - 1] == State::Torn)
                .collect();
            assert_eq!(
                flagged, torn_here,
                "cut {reported}: fsck --content flags exactly the torn files"
            );
            torn += torn_here.len();
        }
        drop(p);
        drop(store);
        drop(disk);
        let whole = state.iter().filter(|s| **s == State::Whole).count();
        found.push((reported, whole));
    }
    (found, torn)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Whole,
    Torn,
    Absent,
}

/// A power cut *inside* an operation — a publish, a squash, a GC, a base
/// import — at each failpoint the durable profile's operation reaches
/// (`layerstack_store::failpoints`; the child pauses there, the parent copies
/// the disk, then kills it), and right after the operation was reported: the
/// publishes reported before are all there, the operation cut is there whole
/// or not at all (a reported one is there), and `fsck --content` finds
/// nothing after the restart. Returns, per operation, the points cut.
async fn cut_inside_each_operation() -> Vec<(&'static str, Vec<String>)> {
    let mut all = Vec::new();
    for op in OPS {
        all.push((*op, cut_inside(op).await));
    }
    all
}

/// A fresh loop-mounted durable store with the stack made and synced: the
/// disk, its image, the control directory.
fn fresh_disk(t: &Path) -> (Disk, std::path::PathBuf, std::path::PathBuf) {
    let image = t.join("disk.img");
    Disk::format(&image, 128 << 20);
    let ctl = t.join("ctl");
    std::fs::create_dir_all(&ctl).unwrap();
    let disk = Disk::mount(&image, &t.join("mnt"));
    drop(setup_n(&disk.mnt, 1));
    run(Command::new("sync").arg("-f").arg(&disk.mnt));
    (disk, image, ctl)
}

/// Waits for `file` to appear while `child` runs (`what`: for the message).
fn await_file(child: &mut std::process::Child, file: &Path, what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !file.exists() {
        if let Some(st) = child.try_wait().unwrap() {
            panic!("{what}: the child ended first: {st:?}");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: never reached"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Cuts checked right after a squash, GC or import was reported.
static AFTER_REPORTED_CUTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The cuts inside `op` (see [`cut_inside_each_operation`]).
async fn cut_inside(op: &str) -> Vec<String> {
    const N: usize = 3;
    // The publishes before `op`: the last one is `op` itself for "publish".
    let before = if op == "publish" { N - 1 } else { N };
    // Which points the operation reaches: one traced run, whose disk is also
    // cut right after the operation was reported (not for "publish": the
    // cuts after each reported publish are the other half of the test).
    let points: Vec<String> = {
        let t = tmp();
        let (disk, image, ctl) = fresh_disk(t.path());
        for k in 1..=N {
            std::fs::write(ctl.join(format!("go-{k}")), b"").unwrap();
        }
        let trace = t.path().join("trace");
        let mut c = Killed(
            child(&disk.mnt.join("root"), true, N, &ctl, "", op)
                .env(layerstack_store::failpoints::TRACE_FILE_ENV, &trace)
                .spawn()
                .unwrap(),
        );
        let mut after = None;
        if op != "publish" {
            let reported = ctl.join("reported-op");
            await_file(&mut c.0, &reported, &format!("{op} reported"));
            let copy = t.path().join("after.img");
            run(Command::new("cp")
                .arg("--sparse=always")
                .arg(&image)
                .arg(&copy));
            after = Some((copy, std::fs::read_to_string(&reported).unwrap()));
            std::fs::write(ctl.join("go-op"), b"").unwrap();
        }
        let st = c.0.wait().unwrap();
        assert!(st.success(), "{op}: the traced child failed: {st:?}");
        let mut v: Vec<String> = std::fs::read_to_string(&trace)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect();
        v.sort();
        v.dedup();
        drop(disk);
        if let Some((copy, made)) = after {
            AFTER_REPORTED_CUTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            check_cut(
                t.path(),
                &copy,
                op,
                N,
                N,
                Some(&made),
                "after it was reported",
            )
            .await;
        }
        v
    };
    assert!(
        !points.is_empty(),
        "the traced {op} reached no failpoint: nothing to cut at"
    );
    for point in &points {
        let t = tmp();
        let (disk, image, ctl) = fresh_disk(t.path());
        for k in 1..=before {
            std::fs::write(ctl.join(format!("go-{k}")), b"").unwrap();
        }
        let hit = t.path().join("hit");
        let mut c = Killed(
            child(&disk.mnt.join("root"), true, N, &ctl, point, op)
                .env(layerstack_store::failpoints::HIT_FILE_ENV, &hit)
                .env(layerstack_store::failpoints::PAUSE_ENV, "1")
                .spawn()
                .unwrap(),
        );
        await_file(&mut c.0, &hit, &format!("{op} at {point}"));
        let copy = t.path().join("cut.img");
        run(Command::new("cp")
            .arg("--sparse=always")
            .arg(&image)
            .arg(&copy));
        drop(c);
        drop(disk);
        check_cut(t.path(), &copy, op, N, before, None, point).await;
    }
    points
}

/// Mounts the cut disk `image`, restarts the store on it as the daemon does
/// and checks it: the `reported` publishes whole (of `n`, the rest whole or
/// absent), `op` whole or absent — there as `made` says when it was reported
/// — and `fsck --content` clean with no staged publish left.
async fn check_cut(
    t: &Path,
    image: &Path,
    op: &str,
    n: usize,
    reported: usize,
    made: Option<&str>,
    at: &str,
) {
    let disk = Disk::mount(image, &t.join("m"));
    let store = Arc::new(Store::open(&disk.mnt.join("root"), &options(true)).unwrap());
    let p = engine_with(&store, history());
    p.recover_operations().await.unwrap();
    p.recover().await.unwrap();
    let view = head_view(&store, "main");
    for k in 1..=n {
        let got = view.read_regular(marker(k).as_bytes()).unwrap();
        let whole = got.as_deref() == Some(format!("publish {k}\n").repeat(64).as_bytes());
        if k <= reported {
            assert!(
                whole,
                "{op} cut {at}: publish {k}, reported before the cut, is not whole: {got:?}"
            );
        } else {
            assert!(
                whole || got.is_none(),
                "{op} cut {at}: the publish cut there is half there: {got:?}"
            );
        }
    }
    match (op, made) {
        ("squash" | "gc", Some(m)) => assert_eq!(
            format!("depth {}", depth(&store)),
            m,
            "{op} cut {at}: the reported {op}'s branch is not there"
        ),
        ("import", _) => {
            let bases: Vec<String> = store
                .stacks()
                .unwrap()
                .into_iter()
                .map(|s| s.id)
                .filter(|id| id != STACK)
                .collect();
            if let Some(m) = made {
                assert_eq!(bases, [m], "{op} cut {at}: the reported base is not there");
            }
            assert!(bases.len() <= 1, "{op} cut {at}: two bases: {bases:?}");
            for b in &bases {
                let head = store.branch_head(b, "main").unwrap();
                let view = publisher::LayerView::new(store.manifest_view(b, head).unwrap());
                for i in 0..16 {
                    let got = view
                        .read_regular(format!("data/{i}.txt").as_bytes())
                        .unwrap();
                    assert_eq!(
                        got.as_deref(),
                        Some(imported(i).as_bytes()),
                        "{op} cut {at}: the imported base is there, but not whole"
                    );
                }
            }
        }
        _ => {}
    }
    let report = store.fsck_with(false, true).unwrap();
    assert_eq!(
        report.unrepaired(),
        0,
        "{op} cut {at}: {:?}",
        report.problems
    );
    assert_eq!(
        store.staged_publishes().unwrap(),
        0,
        "{op} cut {at}: a staged publish was left behind"
    );
    drop(p);
    drop(store);
    drop(disk);
}

/// A child process killed (SIGKILL) and reaped when dropped — also when the
/// test fails while the child is paused at a failpoint.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The publishing child: `publishes` publishes on the store at `root`, each
/// reported in `ctl`, then `op` unless it is `publish`; `pause_at`: a
/// failpoint armed for the last operation.
fn child(
    root: &Path,
    durable: bool,
    publishes: usize,
    ctl: &Path,
    pause_at: &str,
    op: &str,
) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        "--ignored",
        "--exact",
        "tests::powercut::powercut_child",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(
        CHILD,
        format!(
            "{}|{}|{publishes}|{}|{pause_at}|{op}",
            root.display(),
            u8::from(durable),
            ctl.display()
        ),
    )
    .env_remove("RUST_LOG");
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_after_a_reported_publish_loses_nothing_in_the_durable_profile() {
    if !have_root("a_power_cut_after_a_reported_publish_loses_nothing_in_the_durable_profile") {
        return;
    }
    let n = 6;
    let started = std::time::Instant::now();
    let (durable, _) = cut_after_each_publish(true, n).await;
    let (disposable, torn) = cut_after_each_publish(false, n).await;
    let inside = cut_inside_each_operation().await;
    let lost: usize = disposable.iter().map(|(r, s)| r - s).sum();
    let worst = disposable.iter().map(|(r, s)| r - s).max().unwrap_or(0);
    eprintln!("power cuts: durable {durable:?}, disposable {disposable:?}, torn {torn}; inside durable operations at {inside:?}");
    let mut figures: Vec<(String, layerstack_store::reliability::Figure)> = vec![
        ("cuts per profile after reported publishes".into(), n.into()),
        (
            "durable: reported publishes lost".into(),
            durable.iter().map(|(r, s)| r - s).sum::<usize>().into(),
        ),
        (
            "disposable: reported publishes lost (sum over cuts)".into(),
            lost.into(),
        ),
        ("disposable: most lost at one cut".into(), worst.into()),
        (
            "disposable: torn files (all flagged by fsck --content)".into(),
            torn.into(),
        ),
    ];
    for (op, points) in &inside {
        figures.push((
            format!("durable: cuts inside a {op} (one per failpoint it reaches)"),
            points.len().into(),
        ));
    }
    figures.push((
        "durable: cuts right after a reported squash, gc, import".into(),
        AFTER_REPORTED_CUTS
            .load(std::sync::atomic::Ordering::Relaxed)
            .into(),
    ));
    figures.push((
        "seconds".into(),
        ((started.elapsed().as_secs_f64() * 10.0).round() / 10.0).into(),
    ));
    let figures: Vec<(&str, layerstack_store::reliability::Figure)> = figures
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    layerstack_store::reliability::record(
        "power-cut",
        "A power cut (the loop device's disk without the page cache) right after a publish was reported, or inside a durable publish, squash, GC or base import at each failpoint it reaches (and right after each was reported), loses nothing reported in the durable profile and leaves the cut operation whole or absent; in the default profile only a prefix of what was reported survives and its newest files can be torn, which fsck --content flags exactly",
        "cargo test -p layerstack-engine --lib tests::powercut",
        &figures,
    )
    .expect("the reliability record is written");
}
