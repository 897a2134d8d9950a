//! Concurrency against a model (issue 22): many publishers with random
//! overlapping and disjoint changesets race on one head; the history they leave
//! is replayed on a sequential model of the tree, which must equal the head
//! exactly: every committed changeset once, in the log's order, every rejected
//! one absent, no update lost (a line edited by a committed publish reads the
//! last committed value, whatever merged around it).
//!
//! The changesets are line edits of shared 16-line text files (so concurrent
//! edits of one file merge when their hunks are apart and conflict when they
//! touch), deletions and re-creations of shared files, and files only their
//! publisher writes (which always commit). Every value written is unique to its
//! publisher, so a rejected publisher's writes cannot hide in the result.
//!
//! Randomness: a xorshift generator seeded from `LAYERSTACK_MODEL_SEED` (or the
//! clock, printed so a failure can be replayed); publishers from
//! `LAYERSTACK_MODEL_PUBLISHERS` (default 256).

use super::*;
use std::collections::{BTreeSet, HashMap};

const FILES: usize = 32;
const LINES: usize = 16;

struct Rng(u64);

impl Rng {
    /// Publisher `i`'s own stream (splitmix64 of the seed and `i`: distinct
    /// publishers never share a stream).
    fn for_publisher(seed: u64, i: usize) -> Rng {
        let mut z = seed.wrapping_add((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

/// One publisher's changeset, as the model applies it.
#[derive(Debug, Default, Clone)]
struct Changeset {
    /// (shared file, line, new value) — the file existed in the session's base.
    edits: Vec<(usize, usize, String)>,
    /// Shared files deleted (existed in the base, not edited by this changeset).
    deletes: Vec<usize>,
    /// Shared files created (absent in the base), with their whole content.
    creates: Vec<(usize, Vec<String>)>,
    /// The publisher's own file, if it wrote one (content = its path's name).
    own: Option<String>,
}

fn shared(k: usize) -> String {
    format!("shared/f{k}.txt")
}

fn text(lines: &[String]) -> Vec<u8> {
    let mut s = String::new();
    for l in lines {
        s.push_str(l);
        s.push('\n');
    }
    s.into_bytes()
}

fn lines_of(bytes: &[u8]) -> Vec<String> {
    String::from_utf8(bytes.to_vec())
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

/// Draws publisher `i`'s changeset over the view its session leased, writes it
/// into the session's upper and returns it.
fn draw(rng: &mut Rng, i: usize, s: &SessionInfo, base: &publisher::LayerView) -> Changeset {
    let mut c = Changeset::default();
    let present: Vec<Option<Vec<String>>> = (0..FILES)
        .map(|k| {
            base.read_regular(shared(k).as_bytes())
                .unwrap()
                .map(|b| lines_of(&b))
        })
        .collect();
    let disjoint_only = rng.chance(10);
    if !disjoint_only {
        let mut edited: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for _ in 0..1 + rng.below(3) {
            let k = rng.below(FILES);
            match &present[k] {
                Some(lines) => {
                    let line = rng.below(LINES);
                    let v = format!("p{i} edits f{k} line {line}");
                    edited.entry(k).or_insert_with(|| lines.clone())[line] = v.clone();
                    c.edits.push((k, line, v));
                }
                None if !c.creates.iter().any(|(ck, _)| *ck == k) => {
                    let lines: Vec<String> = (0..LINES)
                        .map(|l| format!("p{i} creates f{k} line {l}"))
                        .collect();
                    write(&s.upper, &shared(k), &text(&lines));
                    c.creates.push((k, lines));
                }
                None => {}
            }
        }
        for (k, lines) in &edited {
            write(&s.upper, &shared(*k), &text(lines));
        }
        if rng.chance(6) {
            let k = rng.below(FILES);
            if present[k].is_some() && !edited.contains_key(&k) {
                delete_in(s, &shared(k));
                c.deletes.push(k);
            }
        }
    }
    if disjoint_only || rng.chance(20) {
        let path = format!("own/p{i}.txt");
        write(&s.upper, &path, format!("{path}\n").as_bytes());
        c.own = Some(path);
    }
    if c.edits.is_empty() && c.creates.is_empty() && c.deletes.is_empty() && c.own.is_none() {
        let path = format!("own/p{i}.txt");
        write(&s.upper, &path, format!("{path}\n").as_bytes());
        c.own = Some(path);
    }
    c
}

impl Changeset {
    /// The shared files it touches.
    fn files(&self) -> BTreeSet<usize> {
        let e = self.edits.iter().map(|(k, _, _)| *k);
        let c = self.creates.iter().map(|(k, _)| *k);
        e.chain(c).chain(self.deletes.iter().copied()).collect()
    }
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
    let seed: u64 = std::env::var("LAYERSTACK_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
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
    let seed_files: Vec<(String, Vec<u8>)> = (0..FILES)
        .map(|k| {
            let lines: Vec<String> = (0..LINES).map(|l| format!("f{k} line {l}")).collect();
            (shared(k), text(&lines))
        })
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
                let c = draw(&mut rng, i, &s, &base);
                tokio::time::sleep(std::time::Duration::from_millis(rng.below(50) as u64)).await;
                let out = p.publish(s.id, &format!("p{i}")).await.unwrap();
                (s.id, s.lease_manifest.unwrap(), c, out.outcome.unwrap())
            })
        })
        .collect();
    let mut by_session: HashMap<i64, Changeset> = HashMap::new();
    let (mut committed, mut merged, mut rejected) = (BTreeSet::new(), 0usize, BTreeSet::new());
    let mut changesets = Vec::new();
    let mut leases: HashMap<i64, i64> = HashMap::new();
    for t in tasks {
        let (sid, lease, c, out) = t.await.unwrap();
        leases.insert(sid, lease);
        match out.kind {
            OutcomeKind::Committed => {
                committed.insert(sid);
            }
            OutcomeKind::Merged => {
                committed.insert(sid);
                merged += 1;
            }
            OutcomeKind::Conflict => {
                rejected.insert(sid);
                if std::env::var_os("LAYERSTACK_MODEL_VERBOSE").is_some() {
                    eprintln!("rejected {c:?}: {:?} {:?}", out.message, out.counts);
                }
                assert!(
                    c.edits.len() + c.deletes.len() + c.creates.len() > 0,
                    "a changeset of its own files only was rejected: {c:?} {out:?}"
                );
            }
            other => panic!("publish of {c:?} ended {other:?}: {out:?}"),
        }
        changesets.push((sid, c.clone()));
        by_session.insert(sid, c);
    }

    // Every committed changeset once, in the log's order; no rejected one.
    let log = store.log("ns/sha256:aaa", "main").unwrap();
    let mut landed = Vec::new();
    sessions_in_order(&log, &mut landed);
    landed.retain(|(s, _)| by_session.contains_key(s));
    let order: Vec<i64> = landed.iter().map(|(s, _)| *s).collect();
    let once: BTreeSet<i64> = order.iter().copied().collect();
    assert_eq!(
        once.len(),
        order.len(),
        "a changeset appears twice in the log"
    );
    assert_eq!(
        once, committed,
        "the log's changesets are the committed ones"
    );

    // Replay on the model.
    let mut model: BTreeMap<String, Option<Vec<String>>> = seed_files
        .iter()
        .map(|(p, c)| (p.clone(), Some(lines_of(c))))
        .collect();
    for sid in &order {
        let c = &by_session[sid];
        for (k, lines) in &c.creates {
            model.insert(shared(*k), Some(lines.clone()));
        }
        for (k, line, v) in &c.edits {
            let f = model
                .get_mut(&shared(*k))
                .and_then(Option::as_mut)
                .unwrap_or_else(|| panic!("session {sid} edited f{k}, which the model lacks"));
            f[*line] = v.clone();
        }
        for k in &c.deletes {
            model.insert(shared(*k), None);
        }
        if let Some(own) = &c.own {
            model.insert(own.clone(), Some(vec![own.clone()]));
        }
    }
    for (_, c) in changesets.iter().filter(|(s, _)| rejected.contains(s)) {
        if let Some(own) = &c.own {
            model.entry(own.clone()).or_insert(None);
        }
    }
    let view = head_view(&store, "main");
    for (path, want) in &model {
        let got = view.read_regular(path.as_bytes()).unwrap();
        assert_eq!(
            got.as_deref().map(lines_of),
            want.clone(),
            "{path}: the head differs from the sequential model (seed {seed})"
        );
    }
    for dir in ["shared", "own"] {
        let listed: BTreeSet<String> = view
            .list_dir(dir.as_bytes())
            .unwrap_or_default()
            .into_iter()
            .map(|n| format!("{dir}/{}", String::from_utf8(n).unwrap()))
            .collect();
        let want: BTreeSet<String> = model
            .iter()
            .filter(|(p, v)| p.starts_with(&format!("{dir}/")) && v.is_some())
            .map(|(p, _)| p.clone())
            .collect();
        assert_eq!(
            listed, want,
            "{dir}/ lists what the model holds (seed {seed})"
        );
    }
    // No false conflict: a rejected changeset shares a file with one that
    // landed after the manifest it leased.
    for sid in &rejected {
        let mine = by_session[sid].files();
        let raced = landed
            .iter()
            .filter(|(_, m)| *m > leases[sid])
            .any(|(other, _)| !by_session[other].files().is_disjoint(&mine));
        assert!(
            raced,
            "session {sid} was rejected although nothing that landed after its lease touched its files: {:?} (seed {seed})",
            by_session[sid]
        );
    }
    // The path index and the trees agree, content included (merged files, squashes).
    let report = store.fsck_with(false, true).unwrap();
    assert_eq!(report.unrepaired(), 0, "{:?}", report.problems);
    assert!(
        !rejected.is_empty() && merged > 0,
        "the race exercised too little: {} committed ({merged} merged), {} rejected (seed {seed})",
        committed.len(),
        rejected.len()
    );
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "model test: {n} publishers, {} committed ({merged} merged), {} rejected, {secs:.1} s",
        committed.len(),
        rejected.len()
    );
    layerstack_store::reliability::record(
        "concurrency-model",
        "Concurrent publishers on one head leave exactly the history a sequential model predicts: every committed changeset once in log order, every rejected one absent, no lost update (merges and squashes included)",
        "cargo test -p layerstack-engine --lib tests::model",
        &[
            ("publishers", n.into()),
            ("committed", committed.len().into()),
            ("merged", merged.into()),
            ("rejected", rejected.len().into()),
            ("seconds", ((secs * 10.0).round() / 10.0).into()),
        ],
    )
    .expect("the reliability record is written");
}
