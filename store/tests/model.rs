//! Reference-model tests of the store's history model: branches, manifests,
//! leases and sessions against an in-memory model (`proptest`), and concurrent
//! publishes from N separate store instances (separate connections, like
//! separate processes) on one branch.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use layerstack_store::*;
use proptest::prelude::*;

const STACK: &str = "default/sha256:base";

fn tmp() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("ls-model-")
        .tempdir_in("/var/tmp")
        .unwrap()
}

fn options() -> StoreOptions {
    StoreOptions {
        startup_sweep: false,
        ..Default::default()
    }
}

/// A store holding one stack (a one-layer image, one container session so the
/// stack exists).
fn store_with_stack(dir: &Path) -> Store {
    let s = Store::open(&dir.join("root"), &StoreOptions::default()).unwrap();
    let labels = BTreeMap::from([(SNAPSHOT_REF_LABEL.to_string(), "sha256:base".to_string())]);
    s.prepare("default/1/extract-1 sha256:base", "", labels, false)
        .unwrap();
    s.commit(
        "default/2/sha256:base",
        "default/1/extract-1 sha256:base",
        BTreeMap::new(),
    )
    .unwrap();
    s.prepare(
        "default/3/seed",
        "default/2/sha256:base",
        BTreeMap::new(),
        false,
    )
    .unwrap();
    s
}

/// Content `n` at `path`; `n == 1` is a metadata-only change (a row that does
/// not hide what is below it, so the gate also reads an older hiding row).
fn entry(path: &str, n: u8) -> IndexEntry {
    let (kind, digest) = if n == 1 {
        (ChangeKind::Meta, None)
    } else {
        (ChangeKind::Write, Some([n; 32]))
    };
    IndexEntry {
        path: path.as_bytes().to_vec(),
        kind,
        digest,
        mode: Some(0o644),
        uid: Some(0),
        gid: Some(0),
        xattrs: None,
    }
}

const PATHS: [&str; 4] = ["a", "b", "d/x", "d/y"];
const BRANCHES: [&str; 3] = ["main", "exp", "other"];

#[derive(Debug, Clone)]
enum Op {
    /// A new sandbox session on a branch.
    Create(usize),
    /// Session writes path `PATHS[p]` with content `n`.
    Write(usize, usize, u8),
    /// Publish the session's writes (commit against the head now).
    Publish(usize),
    /// End the run without publishing.
    Discard(usize),
    /// The gate rejected the run (retryable: writes and lease kept).
    Conflict(usize),
    /// Mount: starts a new run when the last one ended.
    Mount(usize),
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..BRANCHES.len()).prop_map(Op::Create),
        4 => (0..8usize, 0..PATHS.len(), 1..5u8).prop_map(|(s, p, n)| Op::Write(s, p, n)),
        3 => (0..8usize).prop_map(Op::Publish),
        1 => (0..8usize).prop_map(Op::Discard),
        1 => (0..8usize).prop_map(Op::Conflict),
        2 => (0..8usize).prop_map(Op::Mount),
    ]
}

#[derive(Debug, Clone, Default)]
struct ModelSession {
    id: SessionId,
    branch: String,
    /// The leased branch's layers at lease time (`None`: no lease).
    lease: Option<Vec<LayerId>>,
    writes: BTreeMap<String, u8>,
    run: i64,
    state: Option<OutcomeKind>,
}

#[derive(Debug, Default)]
struct Model {
    branches: BTreeMap<String, Vec<LayerId>>,
    sessions: Vec<ModelSession>,
    /// Every published layer's index.
    index: BTreeMap<LayerId, Vec<IndexEntry>>,
}

impl Model {
    fn head(&mut self, branch: &str) -> Vec<LayerId> {
        if !self.branches.contains_key(branch) {
            // A new branch forks main's head.
            let main = self.branches.get("main").cloned().unwrap_or_default();
            self.branches.insert(branch.to_string(), main);
        }
        self.branches[branch].clone()
    }
}

fn check(s: &Store, m: &mut Model) {
    for (b, layers) in m.branches.clone() {
        let dirs: Vec<_> = layers.iter().map(|l| s.layer_path(*l)).collect();
        assert_eq!(s.branch_layers(STACK, &b).unwrap(), dirs, "branch {b}");
    }
    let all_paths = PathQuery {
        exact: PATHS.iter().map(|p| p.as_bytes().to_vec()).collect(),
        below: BTreeSet::new(),
    };
    for ms in &m.sessions {
        let info = s.session(ms.id).unwrap();
        assert_eq!(info.run, ms.run, "session {}", ms.id);
        assert_eq!(
            info.outcome.as_ref().map(|o| o.kind),
            ms.state,
            "session {}",
            ms.id
        );
        match &ms.lease {
            None => assert_eq!(info.lease_manifest, None),
            Some(lease) => {
                let manifest = info.lease_manifest.expect("leased");
                assert_eq!(&s.manifest(manifest).unwrap(), lease, "lease of {}", ms.id);
                // What the head published since this lease, at every path.
                let head = s.head_view(ms.id).unwrap().manifest;
                let got = s.changes_between(manifest, head, &all_paths).unwrap();
                let had: BTreeSet<_> = lease.iter().collect();
                // Per path only the rows the gate reads: the newest (by position
                // in the head's manifest) and the newest that hides what is below.
                let mut newest: BTreeSet<Vec<u8>> = BTreeSet::new();
                let mut hiding: BTreeSet<Vec<u8>> = BTreeSet::new();
                let want: Vec<(LayerId, Vec<IndexEntry>)> = m.branches[&ms.branch]
                    .iter()
                    .filter(|l| !had.contains(l))
                    .filter_map(|l| {
                        let e: Vec<IndexEntry> = m.index[l]
                            .iter()
                            .filter(|e| {
                                let first = newest.insert(e.path.clone());
                                let first_hiding =
                                    e.kind.hides_below() && hiding.insert(e.path.clone());
                                first || first_hiding
                            })
                            .cloned()
                            .collect();
                        (!e.is_empty()).then_some((*l, e))
                    })
                    .collect();
                assert_eq!(got, want, "head changes since the lease of {}", ms.id);
            }
        }
    }
}

fn apply(s: &Store, m: &mut Model, op: &Op) {
    let live = |m: &Model, i: usize| (!m.sessions.is_empty()).then(|| i % m.sessions.len());
    match op {
        Op::Create(b) => {
            let branch = BRANCHES[*b];
            let head = m.head(branch);
            let (info, _, created) = s
                .create_session(
                    &Owner::Sandbox {
                        name: format!("s{}", m.sessions.len()),
                    },
                    STACK,
                    &LeaseTarget::Branch(branch.into()),
                    None,
                )
                .unwrap();
            assert!(created);
            m.sessions.push(ModelSession {
                id: info.id,
                branch: branch.into(),
                lease: Some(head),
                writes: BTreeMap::new(),
                run: 1,
                state: None,
            });
        }
        Op::Write(i, p, n) => {
            let Some(i) = live(m, *i) else { return };
            let ms = &mut m.sessions[i];
            if ms.lease.is_none() || ms.state.is_some_and(|k| !k.is_retryable()) {
                return; // not mounted: nothing can write
            }
            ms.writes.insert(PATHS[*p].to_string(), *n);
        }
        Op::Publish(i) => {
            let Some(i) = live(m, *i) else { return };
            let ms = m.sessions[i].clone();
            if ms.lease.is_none() || ms.state.is_some_and(|k| !k.is_retryable()) {
                return;
            }
            let index: Vec<IndexEntry> = ms.writes.iter().map(|(p, n)| entry(p, *n)).collect();
            let staged = s.stage_publish(ms.id, &index, &[]).unwrap();
            let head = s.head_view(ms.id).unwrap().manifest;
            // The session's upper must exist for the rename.
            let p = s
                .commit_publish(ms.id, staged, head, CommitRecord::default())
                .unwrap();
            let mut layers = vec![p.layer];
            layers.extend(m.branches[&ms.branch].clone());
            m.branches.insert(ms.branch.clone(), layers);
            m.index.insert(p.layer, index);
            let ms = &mut m.sessions[i];
            ms.lease = None;
            ms.writes.clear();
            ms.state = Some(OutcomeKind::Committed);
        }
        Op::Discard(i) | Op::Conflict(i) => {
            let Some(i) = live(m, *i) else { return };
            let ms = m.sessions[i].clone();
            if ms.lease.is_none() || ms.state.is_some_and(|k| !k.is_retryable()) {
                return;
            }
            let kind = if matches!(op, Op::Discard(_)) {
                OutcomeKind::Discarded
            } else {
                OutcomeKind::Conflict
            };
            s.record_outcome(ms.id, OutcomeRecord::new(kind, "model"), None)
                .unwrap();
            let ms = &mut m.sessions[i];
            ms.state = Some(kind);
            if kind == OutcomeKind::Discarded {
                ms.lease = None;
                ms.writes.clear();
            }
        }
        Op::Mount(i) => {
            let Some(i) = live(m, *i) else { return };
            let ms = m.sessions[i].clone();
            s.session_mount(ms.id).unwrap();
            let head = m.head(&ms.branch);
            let ms = &mut m.sessions[i];
            if ms.state.is_some() || ms.lease.is_none() {
                ms.run += 1;
                ms.state = None;
            }
            if ms.lease.is_none() {
                ms.lease = Some(head);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, .. ProptestConfig::default() })]

    #[test]
    fn history_matches_the_reference_model(ops in prop::collection::vec(arb_op(), 1..40)) {
        let t = tmp();
        let s = store_with_stack(t.path());
        let mut m = Model::default();
        m.head("main");
        for op in &ops {
            apply(&s, &mut m, op);
            check(&s, &mut m);
        }
        // A second instance (a separate connection) reads the same history.
        let other = Store::open(&t.path().join("root"), &options()).unwrap();
        check(&other, &mut m);
    }
}

/// N store instances publish to one branch at once, each retrying when the
/// head moved under it (optimistic concurrency): every layer lands exactly
/// once, and every manifest is its layer on top of its parent's.
#[test]
fn concurrent_instances_publish_every_layer_exactly_once() {
    let t = tmp();
    drop(store_with_stack(t.path()));
    const THREADS: usize = 4;
    const EACH: usize = 12;
    let handles: Vec<_> = (0..THREADS)
        .map(|th| {
            let root = t.path().join("root");
            std::thread::spawn(move || {
                let s = Store::open(&root, &options()).unwrap();
                let mut mine = Vec::new();
                let mut retries = 0;
                for k in 0..EACH {
                    let (info, _, _) = s
                        .create_session(
                            &Owner::Sandbox {
                                name: format!("t{th}-{k}"),
                            },
                            STACK,
                            &LeaseTarget::Branch("main".into()),
                            None,
                        )
                        .unwrap();
                    let index = vec![entry(&format!("t{th}/f{k}"), 1)];
                    let staged = s.stage_publish(info.id, &index, &[]).unwrap();
                    loop {
                        let head = s.head_view(info.id).unwrap().manifest;
                        match s.commit_publish(info.id, staged, head, CommitRecord::default()) {
                            Ok(p) => {
                                mine.push(p.layer);
                                break;
                            }
                            Err(StoreError::HeadMoved { .. }) => retries += 1,
                            Err(StoreError::Db(e)) => {
                                // SQLITE_BUSY past the timeout would be a bug here.
                                panic!("database error under contention: {e}")
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
                (mine, retries)
            })
        })
        .collect();
    let mut published = BTreeSet::new();
    for h in handles {
        let (mine, _retries) = h.join().unwrap();
        for l in mine {
            assert!(published.insert(l), "layer {l} published twice");
        }
    }
    let s = Store::open(&t.path().join("root"), &options()).unwrap();
    let head: Vec<LayerId> = s
        .log(STACK, "main")
        .unwrap()
        .into_iter()
        .map(|e| e.layer)
        .collect();
    assert_eq!(head.len(), THREADS * EACH);
    assert_eq!(head.iter().copied().collect::<BTreeSet<_>>(), published);
    // Each thread's layers appear in its own order (its publishes were sequential).
    for th in 0..THREADS {
        let own: Vec<LayerId> = head
            .iter()
            .rev()
            .copied()
            .filter(|l| {
                s.layer_index(*l).unwrap()[0]
                    .path
                    .starts_with(format!("t{th}/").as_bytes())
            })
            .collect();
        let mut sorted = own.clone();
        sorted.sort();
        assert_eq!(own, sorted, "thread {th}'s layers in publish order");
    }
}
