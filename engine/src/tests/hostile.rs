//! Hostile uppers beyond the symlink case (issue 22): a process racing the
//! capture (renaming directories, swapping a directory for a symlink to a host
//! directory), and uppers over the capture limits — a million files (20,000 by
//! default here, 1,000,000 in `scripts/reliability.sh`:
//! `LAYERSTACK_HOSTILE_FILES`), a 100 GiB sparse file. Host paths are sentinels
//! that must stay as they were; a limit gives a clear outcome that names it,
//! keeps the upper and lets the session publish once raised.

use super::*;
use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, Ordering};

/// A host directory with one file whose content, mode and entries must never change.
struct Sentinel {
    dir: std::path::PathBuf,
}

impl Sentinel {
    const CONTENT: &'static [u8] = b"HOST SENTINEL - never copied into a layer\n";

    fn new(dir: std::path::PathBuf) -> Sentinel {
        write(&dir, "etc/app.conf", Self::CONTENT);
        write(&dir, "etc/shadow", Self::CONTENT);
        Sentinel { dir }
    }

    fn state(&self) -> Vec<(String, Vec<u8>, u32)> {
        let mut out = Vec::new();
        let mut stack = vec![self.dir.clone()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let e = e.unwrap();
                let md = std::fs::symlink_metadata(e.path()).unwrap();
                let content = if md.is_file() {
                    std::fs::read(e.path()).unwrap()
                } else {
                    Vec::new()
                };
                if md.is_dir() {
                    stack.push(e.path());
                }
                out.push((e.path().display().to_string(), content, md.mode()));
            }
        }
        out.sort();
        out
    }
}

/// Every regular file of `view` below `rel`, read whole.
fn files_of(view: &publisher::LayerView, rel: &[u8], out: &mut Vec<(Vec<u8>, Vec<u8>)>) {
    for name in view.list_dir(rel).unwrap_or_default() {
        let child = if rel.is_empty() {
            name
        } else {
            [rel, b"/", &name].concat()
        };
        match view.lookup(&child).unwrap() {
            Some(e) if e.kind == publisher::FileKind::Dir => files_of(view, &child, out),
            Some(e) if e.kind == publisher::FileKind::Regular => {
                let data = view.read_entry(&child, &e).unwrap();
                out.push((child, data));
            }
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_racing_the_capture_never_leads_it_outside_the_store() {
    if !have_root("a_process_racing_the_capture_never_leads_it_outside_the_store") {
        return;
    }
    let t = tmp();
    let (store, _) = setup_n(t.path(), 1);
    let host = Sentinel::new(t.path().join("host"));
    let before = host.state();
    let p = engine_with(&store, Default::default());
    let rounds = 24usize;
    let (mut published, mut failed) = (0usize, 0usize);
    let mut raced = Vec::new();
    for round in 0..rounds {
        let s = session_with(&p, "main", &format!("race{round}"), &[]).await;
        for d in 0..8 {
            for f in 0..32 {
                write(
                    &s.upper,
                    &format!("work/d{d}/f{f}.txt"),
                    format!("round {round} d{d} f{f}\n").as_bytes(),
                );
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let racer = {
            let (stop, upper, hostdir) = (stop.clone(), s.upper.clone(), host.dir.join("etc"));
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let d = n % 8;
                    let a = upper.join(format!("work/d{d}"));
                    let b = upper.join(format!("work/moved{d}"));
                    // Rename a directory away and back; swap it for a symlink
                    // to the host's directory in between. Errors are expected
                    // (capture may have renamed the upper already).
                    let _ = std::fs::rename(&a, &b);
                    let _ = std::os::unix::fs::symlink(&hostdir, &a);
                    std::thread::yield_now();
                    let _ = std::fs::remove_file(&a);
                    let _ = std::fs::rename(&b, &a);
                    n += 1;
                }
                n
            })
        };
        let out = p.publish(s.id, "race").await.unwrap().outcome.unwrap();
        stop.store(true, Ordering::Relaxed);
        let swaps = racer.join().unwrap();
        match out.kind {
            OutcomeKind::Committed | OutcomeKind::Merged => {
                published += 1;
                raced.push(out.layer.unwrap());
            }
            OutcomeKind::Failed => {
                assert!(
                    out.message.as_deref().is_some_and(|m| !m.is_empty()),
                    "a failed publish says why: {out:?}"
                );
                failed += 1;
                p.discard(s.id, "race test").await.unwrap();
            }
            other => panic!("round {round} ({swaps} swaps): unexpected outcome {other:?}: {out:?}"),
        }
        assert_eq!(host.state(), before, "round {round}: a host path changed");
    }
    // Nothing of the host ever entered a layer.
    let mut files = Vec::new();
    files_of(&head_view(&store, "main"), b"", &mut files);
    for (path, data) in &files {
        assert!(
            data != Sentinel::CONTENT,
            "{}: the host's file was copied into a layer",
            String::from_utf8_lossy(path)
        );
    }
    // What a racer can damage is its own layer: its index and its tree may
    // disagree (fsck reports it); nothing else. Capture assumes a quiescent
    // upper — the census (no mount of it anywhere) and a sandbox's dead pid
    // namespace give it that; this racer writes into the upper directly, as
    // only a process holding a descriptor into it from outside a mount could.
    let own: BTreeSet<String> = raced.iter().map(|l| format!("layer {l} ")).collect();
    let clean = publish_on(&p, "main", "after", &[("after/ok.txt", b"ok\n")], &[]).await;
    let report = store.fsck(false).unwrap();
    let damaged: BTreeSet<String> = report
        .problems
        .iter()
        .filter_map(|pr| {
            own.iter()
                .find(|o| pr.subject.starts_with(o.as_str()))
                .cloned()
        })
        .collect();
    let elsewhere: Vec<_> = report
        .problems
        .iter()
        .filter(|pr| !own.iter().any(|o| pr.subject.starts_with(o.as_str())))
        .collect();
    assert!(
        elsewhere.is_empty(),
        "fsck found damage outside the raced sessions' own layers (clean layer {clean}): {elsewhere:?}"
    );
    eprintln!(
        "capture race: {rounds} rounds, {published} published ({} with an index fsck finds off), {failed} failed cleanly",
        damaged.len()
    );
    layerstack_store::reliability::record(
        "capture-race",
        "A process racing the capture (renaming directories, swapping one for a symlink to a host directory) never makes the daemon read or write a host path, nor copies a host file into a layer; each publish fails cleanly or commits, and what a racer can damage is its own layer (where its index and its tree disagree, which fsck names), nothing else — capture assumes a quiescent upper, which a sandbox's ended pid namespace and the census give it",
        "cargo test -p layerstack-engine --lib tests::hostile",
        &[
            ("rounds", rounds.into()),
            ("published", published.into()),
            ("failed cleanly", failed.into()),
            ("own layers fsck flags", damaged.len().into()),
            ("host sentinel changes", 0u64.into()),
        ],
    )
    .expect("the reliability record is written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upper_over_a_capture_limit_fails_naming_it_and_keeps_the_upper() {
    if !have_root("an_upper_over_a_capture_limit_fails_naming_it_and_keeps_the_upper") {
        return;
    }
    let files: u64 = std::env::var("LAYERSTACK_HOSTILE_FILES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let started = std::time::Instant::now();
    let t = tmp();
    let (store, _) = setup_n(t.path(), 1);
    let limited = |paths: u64, bytes: u64| {
        Engine::new(
            store.clone(),
            EngineSettings {
                max_capture_paths: paths,
                max_capture_bytes: bytes,
                ..Default::default()
            },
        )
    };
    let head = store.branch_head("ns/sha256:aaa", "main").unwrap();

    // `files` files against a limit of half as many paths.
    let p = limited(files / 2, 0);
    let s = session_with(&p, "main", "many", &[]).await;
    for i in 0..files {
        let d = s.upper.join(format!("many/{}", i / 1000));
        if i % 1000 == 0 {
            std::fs::create_dir_all(&d).unwrap();
        }
        std::fs::write(d.join(i.to_string()), b"").unwrap();
    }
    let out = p.publish(s.id, "many").await.unwrap().outcome.unwrap();
    assert_eq!(out.kind, OutcomeKind::Failed, "{out:?}");
    let msg = out.message.clone().unwrap_or_default();
    assert!(
        msg.contains("max_paths") && msg.contains(&(files / 2).to_string()),
        "the outcome names the limit: {msg}"
    );
    assert_eq!(
        store.branch_head("ns/sha256:aaa", "main").unwrap(),
        head,
        "nothing was published"
    );
    assert!(s.upper.join("many/0/0").exists(), "the upper is kept");
    // Raised: the same session publishes.
    let raised = limited(files + files / 1000 + 2, 0);
    let out = raised.publish(s.id, "many").await.unwrap().outcome.unwrap();
    assert_eq!(out.kind, OutcomeKind::Committed, "{out:?}");
    assert!(head_view(&store, "main")
        .lookup(format!("many/{}/{}", (files - 1) / 1000, files - 1).as_bytes())
        .unwrap()
        .is_some());

    // A 100 GiB sparse file against a 1 GiB byte limit: refused at its stat,
    // before a byte of it is read.
    let p = limited(0, 1 << 30);
    let s = session_with(&p, "main", "sparse", &[]).await;
    std::fs::create_dir_all(s.upper.join("big")).unwrap();
    std::fs::File::create(s.upper.join("big/sparse.img"))
        .unwrap()
        .set_len(100 << 30)
        .unwrap();
    let out = p.publish(s.id, "sparse").await.unwrap().outcome.unwrap();
    assert_eq!(out.kind, OutcomeKind::Failed, "{out:?}");
    let msg = out.message.clone().unwrap_or_default();
    assert!(
        msg.contains("max_bytes") && msg.contains("big/sparse.img"),
        "the outcome names the limit and the file: {msg}"
    );
    assert_eq!(
        std::fs::metadata(s.upper.join("big/sparse.img"))
            .unwrap()
            .len(),
        100 << 30,
        "the upper is kept"
    );
    p.discard(s.id, "test").await.unwrap();
    let report = store.fsck(false).unwrap();
    assert_eq!(report.unrepaired(), 0, "{:?}", report.problems);
    let secs = started.elapsed().as_secs_f64();
    layerstack_store::reliability::record(
        "capture-limits",
        "An upper over the capture limits ([capture] max_paths, max_bytes) ends its run failed naming the limit and the entry, publishes nothing, keeps the upper, and publishes once the limit is raised",
        "cargo test -p layerstack-engine --lib tests::hostile",
        &[
            ("files in the upper", files.into()),
            ("sparse file bytes", (100u64 << 30).into()),
            ("seconds", ((secs * 10.0).round() / 10.0).into()),
        ],
    )
    .expect("the reliability record is written");
}
