//! Concurrency against a model (issue 22): many publishers with random
//! overlapping and disjoint changesets race on one head; the history they leave
//! is replayed on a sequential model of the tree, which must equal the head
//! exactly: every committed changeset once, in the log's order, every rejected
//! one absent, no update lost (a line edited by a committed publish reads the
//! last committed value, whatever merged around it).
//!
//! The changesets, the model and its checks are `layerstack_integration::model`
//! (shared with the integration test that races publisher *processes* through
//! a daemon). Here the publishers are tasks of one engine, writing their
//! sessions' uppers directly.
//!
//! Randomness: a xorshift generator seeded from `LAYERSTACK_MODEL_SEED` (or the
//! clock, printed so a failure can be replayed); publishers from
//! `LAYERSTACK_MODEL_PUBLISHERS` (default 256).

use super::*;
use layerstack_integration::model::{self as m, Changeset, Ended, Race, Rng, Tree};
use std::collections::HashMap;

/// The shared and own files of a view, as the model's tree.
fn tree_of(view: &publisher::LayerView) -> Tree {
    let mut t = Tree::new();
    for dir in ["shared", "own"] {
        for name in view.list_dir(dir.as_bytes()).unwrap_or_default() {
            let path = format!("{dir}/{}", String::from_utf8(name).unwrap());
            if let Some(b) = view.read_regular(path.as_bytes()).unwrap() {
                t.insert(path, m::lines_of(&b));
            }
        }
    }
    t
}

/// The log's published layers, oldest first, squashes expanded into their
/// members: (session, the manifest that added its layer).
fn sessions_in_order(entries: &[layerstack_store::LogEntry], out: &mut Vec<(i64, i64)>) {
    for e in entries.iter().rev() {
        if e.members.is_empty() {
            if let Some(s) = e.session {
                out.push((s, e.manifest));
            }
        } else {
            sessions_in_order(&e.members, out);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_publishers_leave_the_history_a_sequential_model_predicts() {
    if !have_root("concurrent_publishers_leave_the_history_a_sequential_model_predicts") {
        return;
    }
    let seed = m::seed_from_env();
    let n: usize = std::env::var("LAYERSTACK_MODEL_PUBLISHERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(256);
    eprintln!("model test: LAYERSTACK_MODEL_SEED={seed} LAYERSTACK_MODEL_PUBLISHERS={n}");
    let started = std::time::Instant::now();
    let t = tmp();
    let (store, _) = setup_n(t.path(), 1);
    let p = engine_with(&store, Default::default());

    // The shared files every publisher may edit.
    let seed_tree = m::seed_tree();
    let seed_files: Vec<(String, Vec<u8>)> = seed_tree
        .iter()
        .map(|(p, lines)| (p.clone(), m::text(lines)))
        .collect();
    let files: Vec<(&str, &[u8])> = seed_files
        .iter()
        .map(|(p, c)| (p.as_str(), c.as_slice()))
        .collect();
    publish_on(&p, "main", "seed", &files, &[]).await;

    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let p = p.clone();
            let store = store.clone();
            let mut rng = Rng::for_publisher(seed, i);
            tokio::spawn(async move {
                // Stagger the starts so the sessions lease different heads.
                tokio::time::sleep(std::time::Duration::from_millis(rng.below(1500) as u64)).await;
                let s = session_with(&p, "main", &format!("p{i}"), &[]).await;
                let base = publisher::LayerView::new(
                    store
                        .manifest_view("ns/sha256:aaa", s.lease_manifest.unwrap())
                        .unwrap(),
                );
                let base = tree_of(&base);
                let c = Changeset::draw(&mut rng, i, &base);
                for w in c.writes(&base) {
                    match w {
                        m::Write::File(path, bytes) => write(&s.upper, &path, &bytes),
                        m::Write::Delete(path) => delete_in(&s, &path),
                    }
                }
                tokio::time::sleep(std::time::Duration::from_millis(rng.below(50) as u64)).await;
                let out = p.publish(s.id, &format!("p{i}")).await.unwrap();
                (s.id, s.lease_manifest.unwrap(), c, out.outcome.unwrap())
            })
        })
        .collect();
    let mut race = Race::default();
    let mut leases: HashMap<i64, i64> = HashMap::new();
    for t in tasks {
        let (sid, lease, c, out) = t.await.unwrap();
        leases.insert(sid, lease);
        let ended = match out.kind {
            OutcomeKind::Committed => Ended::Committed,
            OutcomeKind::Merged => Ended::Merged,
            OutcomeKind::Conflict => {
                if std::env::var_os("LAYERSTACK_MODEL_VERBOSE").is_some() {
                    eprintln!("rejected {c:?}: {:?} {:?}", out.message, out.counts);
                }
                Ended::Rejected
            }
            other => panic!("publish of {c:?} ended {other:?}: {out:?}"),
        };
        race.add(sid, c, ended)
            .unwrap_or_else(|e| panic!("{e}: {out:?} (seed {seed})"));
    }

    // Every committed changeset once, in the log's order; no rejected one;
    // replayed on the model, the head.
    let log = store.log("ns/sha256:aaa", "main").unwrap();
    let mut landed = Vec::new();
    sessions_in_order(&log, &mut landed);
    landed.retain(|(s, _)| race.changesets.contains_key(s));
    let order: Vec<i64> = landed.iter().map(|(s, _)| *s).collect();
    let model = race
        .replay(&order, &seed_tree, |_, _| {})
        .unwrap_or_else(|e| panic!("{e} (seed {seed})"));
    let head = tree_of(&head_view(&store, "main"));
    assert!(
        head == model,
        "the head differs from the sequential model (seed {seed}): {}",
        m::tree_diff(&head, &model)
    );
    // No false conflict: a rejected changeset shares a file with one that
    // landed after the manifest it leased.
    let follows = |sid: i64, k: usize| landed[k].1 > leases[&sid];
    race.check_rejections(&order, follows)
        .unwrap_or_else(|e| panic!("{e} (seed {seed})"));
    // A merged changeset shares a file with one that landed between its lease
    // and it; a committed one with none.
    race.check_outcomes(&order, follows, follows)
        .unwrap_or_else(|e| panic!("{e} (seed {seed})"));
    // The path index and the trees agree, content included (merged files, squashes).
    let report = store.fsck_with(false, true).unwrap();
    assert_eq!(report.unrepaired(), 0, "{:?}", report.problems);
    let (committed, merged, rejected) = (
        race.committed().len(),
        race.merged().len(),
        race.rejected().len(),
    );
    // Squashes the history made meanwhile (the branch outgrew its
    // threshold): the log above was read through them.
    let squashes = log.iter().filter(|e| !e.members.is_empty()).count();
    assert!(
        rejected > 0 && merged > 0 && squashes > 0,
        "the race exercised too little: {committed} committed ({merged} merged), {rejected} rejected, {squashes} squashes (seed {seed})"
    );
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "model test: {n} publishers, {committed} committed ({merged} merged), {rejected} rejected, {secs:.1} s"
    );
    layerstack_store::reliability::record(
        "concurrency-model",
        "Concurrent publishers on one head leave exactly the history a sequential model predicts: every committed changeset once in log order, every rejected one absent, no lost update (merges and squashes included)",
        "cargo test -p layerstack-engine --lib tests::model",
        &[
            ("publishers", n.into()),
            ("committed", committed.into()),
            ("merged", merged.into()),
            ("rejected", rejected.into()),
            ("squashes", squashes.into()),
            ("seconds", ((secs * 10.0).round() / 10.0).into()),
        ],
    )
    .expect("the reliability record is written");
}
