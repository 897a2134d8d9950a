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
    /// Stage the session's writes (a pending layer takes its id now) without
    /// committing: a later `Publish` commits it, so layer ids need not follow
    /// the order in which layers land on a branch (as with concurrent publishes,
    /// whose ids are taken when they are staged, outside the gate).
    Stage(usize),
    /// Publish the session's writes (commit against the head now; what was
    /// staged, if anything).
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
        2 => (0..8usize).prop_map(Op::Stage),
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
    /// A staged publish not committed yet, and its index.
    staged: Option<(Staged, Vec<IndexEntry>)>,
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
                staged: None,
            });
        }
        Op::Write(i, p, n) => {
            let Some(i) = live(m, *i) else { return };
            let ms = &mut m.sessions[i];
            if ms.lease.is_none()
                || ms.state.is_some_and(|k| !k.is_retryable())
                || ms.staged.is_some()
            {
                return; // not mounted (or captured already): nothing can write
            }
            ms.writes.insert(PATHS[*p].to_string(), *n);
        }
        Op::Publish(i) => {
            let Some(i) = live(m, *i) else { return };
            let ms = m.sessions[i].clone();
            if ms.lease.is_none() || ms.state.is_some_and(|k| !k.is_retryable()) {
                return;
            }
            let (staged, index) = match ms.staged {
                Some(st) => st,
                None => {
                    let index: Vec<IndexEntry> =
                        ms.writes.iter().map(|(p, n)| entry(p, *n)).collect();
                    (s.stage_publish(ms.id, &index, &[]).unwrap(), index)
                }
            };
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
            ms.staged = None;
            ms.state = Some(OutcomeKind::Committed);
        }
        Op::Stage(i) => {
            let Some(i) = live(m, *i) else { return };
            let ms = &m.sessions[i];
            if ms.lease.is_none()
                || ms.state.is_some_and(|k| !k.is_retryable())
                || ms.staged.is_some()
            {
                return;
            }
            let index: Vec<IndexEntry> = ms.writes.iter().map(|(p, n)| entry(p, *n)).collect();
            let staged = s.stage_publish(ms.id, &index, &[]).unwrap();
            m.sessions[i].staged = Some((staged, index));
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
            // A staged publish that gets another outcome drops its rows.
            s.record_outcome(
                ms.id,
                OutcomeRecord::new(kind, "model"),
                ms.staged.as_ref().map(|(st, _)| *st),
            )
            .unwrap();
            let ms = &mut m.sessions[i];
            ms.staged = None;
            ms.state = Some(kind);
            if kind == OutcomeKind::Discarded {
                ms.lease = None;
                ms.writes.clear();
            }
        }
        Op::Mount(i) => {
            let Some(i) = live(m, *i) else { return };
            let ms = m.sessions[i].clone();
            if ms.staged.is_some() {
                return; // a publish in flight holds the session (the engine's lock)
            }
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

/// A new sandbox session `name` on `main`'s head.
fn sandbox_session(s: &Store, name: &str) -> SessionInfo {
    s.create_session(
        &Owner::Sandbox { name: name.into() },
        STACK,
        &LeaseTarget::Branch("main".into()),
        None,
    )
    .unwrap()
    .0
}

/// Layer ids are taken when a publish is staged, so a layer can land above one
/// with a higher id: the rows the gate reads at a path are the newest by
/// position in the head's manifest, not by id — also for a row that hides what
/// is below the path — however many layers since the lease wrote the path.
#[test]
fn the_newest_row_is_by_position_not_by_id() {
    let t = tmp();
    let s = store_with_stack(t.path());
    let session = |name: &str| sandbox_session(&s, name);
    let reader = session("reader");
    let lease = reader.lease_manifest.unwrap();
    let commit = |id: SessionId, staged: Staged| {
        let head = s.head_view(id).unwrap().manifest;
        s.commit_publish(id, staged, head, CommitRecord::default())
            .unwrap()
            .layer
    };
    // Many publishes in order write `d` (a directory row each) and `d/x`.
    for k in 0..20u8 {
        let w = session(&format!("w{k}"));
        let index = vec![entry("d", 1), entry("d/x", k + 2)];
        let st = s.stage_publish(w.id, &index, &[]).unwrap();
        commit(w.id, st);
    }
    // `late` stages first (lower id) and commits last; `early` in between.
    let late = session("late");
    let early = session("early");
    let late_index = vec![entry("d", 1), entry("d/x", 100)];
    let mut deleted = entry("a", 2);
    deleted.kind = ChangeKind::Delete;
    deleted.digest = None;
    let late_staged = s
        .stage_publish(late.id, &[late_index, vec![deleted]].concat(), &[])
        .unwrap();
    let early_staged = s
        .stage_publish(
            early.id,
            &[entry("d", 1), entry("d/x", 99), entry("a", 7)],
            &[],
        )
        .unwrap();
    let early_layer = commit(early.id, early_staged);
    let late_layer = commit(late.id, late_staged);
    assert!(
        late_layer < early_layer,
        "ids: late {late_layer}, early {early_layer}"
    );
    let head = s.head_view(reader.id).unwrap().manifest;
    let query = PathQuery {
        exact: ["a", "d", "d/x"]
            .iter()
            .map(|p| p.as_bytes().to_vec())
            .collect(),
        below: BTreeSet::new(),
    };
    let got = s.changes_between(lease, head, &query).unwrap();
    // `late` is on top: its rows are the newest at every path (with the
    // content it wrote, not `early`'s), and its deletion of `a` is the newest
    // hiding row there.
    assert_eq!(got[0].0, late_layer);
    let paths: Vec<&[u8]> = got[0].1.iter().map(|e| e.path.as_slice()).collect();
    assert_eq!(paths, [&b"a"[..], b"d", b"d/x"]);
    assert_eq!(got[0].1[2].digest, Some([100; 32]));
    // Nothing below it: `d/x` and `a` were written (a write hides below) and
    // deleted by `late` itself, and no layer made `d` anything but a directory.
    assert_eq!(got.len(), 1, "{got:?}");
}

/// The newest row that hides what is below a path is found however many newer
/// rows there only change its metadata.
#[test]
fn an_old_hiding_row_is_found_below_many_metadata_rows() {
    let t = tmp();
    let s = store_with_stack(t.path());
    let session = |name: &str| sandbox_session(&s, name);
    let reader = session("reader");
    let lease = reader.lease_manifest.unwrap();
    let mut opaque = entry("d", 1);
    opaque.kind = ChangeKind::Opaque;
    let mut layers = Vec::new();
    for k in 0..30u8 {
        let w = session(&format!("w{k}"));
        let index = if k == 3 {
            vec![opaque.clone()]
        } else {
            vec![entry("d", 1), entry(&format!("d/f{k}"), 2)]
        };
        let st = s.stage_publish(w.id, &index, &[]).unwrap();
        let head = s.head_view(w.id).unwrap().manifest;
        layers.push(
            s.commit_publish(w.id, st, head, CommitRecord::default())
                .unwrap()
                .layer,
        );
    }
    let head = s.head_view(reader.id).unwrap().manifest;
    let query = PathQuery {
        exact: BTreeSet::from([b"d".to_vec()]),
        below: BTreeSet::new(),
    };
    let got = s.changes_between(lease, head, &query).unwrap();
    let at: Vec<(LayerId, ChangeKind)> = got.iter().map(|(l, e)| (*l, e[0].kind)).collect();
    assert_eq!(
        at,
        [
            (layers[29], ChangeKind::Meta),
            (layers[3], ChangeKind::Opaque)
        ]
    );
}
