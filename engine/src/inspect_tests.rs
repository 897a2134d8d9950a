//! Engine tests of blame, diff and the conflict flow (issue 10), on a real store
//! (root: chown, trusted.* xattrs, whiteouts). Same fixture as `tests.rs`: a
//! one-layer image holding `etc/app.conf` (CRLF lines, no final newline) and
//! container sessions `a`, `b`, `c`, … on it.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use layerstack_store::{
    LineOwner, MountSpec, OutcomeKind, OwnerRange, PathStatus, SessionInfo, Store, StoreOptions,
    SNAPSHOT_REF_LABEL,
};

use crate::{DiffChange, DiffTarget, Engine, EngineError, EngineSettings};
use layerstack_publisher as publisher;

const STACK: &str = "ns/sha256:aaa";

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

/// A whiteout (0:0 character device) at `rel` of an upper.
fn whiteout(dir: &Path, rel: &str) {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    nix::sys::stat::mknod(
        &p,
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o644),
        0,
    )
    .unwrap();
}

fn edit(pairs: &[(&str, &str)]) -> Vec<u8> {
    let mut s = String::from_utf8(BASE.to_vec()).unwrap();
    for (from, to) in pairs {
        assert!(s.contains(from), "{from}");
        s = s.replace(from, to);
    }
    s.into_bytes()
}

fn tmp() -> tempfile::TempDir {
    crate::test_support::tmp_named("inspect")
}

/// The store with the image and `n` container sessions `a`, `b`, … (`s0`… after
/// `c`), and an engine.
fn setup(dir: &Path, n: usize) -> (Arc<Store>, Arc<Engine>, Vec<SessionInfo>) {
    let store = Store::open(&dir.join("root"), &StoreOptions::default()).unwrap();
    let labels = BTreeMap::from([(SNAPSHOT_REF_LABEL.to_string(), "sha256:aaa".to_string())]);
    let (_, spec) = store
        .prepare("ns/1/extract-1 sha256:aaa", "", labels, false)
        .unwrap();
    let dir = match spec {
        MountSpec::Bind { source, .. } => source,
        MountSpec::Overlay {
            upper: Some((u, _)),
            ..
        } => u,
        other => panic!("{other:?}"),
    };
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    write(&dir, "etc/app.conf", BASE);
    write(&dir, "etc/both", b"1\n2\n3\n4\n5\n6\n");
    write(&dir, "etc/old", b"old\n");
    write(&dir, "bin/tool", b"\x7fELF\0\0binary");
    store
        .commit(
            "ns/2/sha256:aaa",
            "ns/1/extract-1 sha256:aaa",
            BTreeMap::new(),
        )
        .unwrap();
    let names: Vec<String> = ["a", "b", "c"]
        .iter()
        .map(|s| s.to_string())
        .chain((0..).map(|i| format!("s{i}")))
        .take(n)
        .collect();
    let mut sessions = Vec::new();
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
    let store = Arc::new(store);
    let engine = Engine::new(
        store.clone(),
        EngineSettings {
            exclude: publisher::ExclusionRules::new(["/tmp/**"]).unwrap(),
            // `squash` compacts every layer of a head.
            history: crate::HistorySettings {
                squash_keep: 0,
                ..Default::default()
            },
            ..Default::default()
        },
    );
    (store, engine, sessions)
}

/// A sandbox session named `name` on `branch`, with `files` written.
async fn sandbox(
    p: &Arc<Engine>,
    branch: &str,
    name: &str,
    files: &[(&str, &[u8])],
) -> SessionInfo {
    let (s, _, _) = p
        .create_session(
            layerstack_store::Owner::Sandbox { name: name.into() },
            STACK,
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

async fn publish(p: &Arc<Engine>, id: i64) -> layerstack_store::Outcome {
    p.publish(id, "test").await.unwrap().outcome.unwrap()
}

/// `(start, end, owner)` of a blame, for comparing.
fn owners(ranges: &[OwnerRange]) -> Vec<(u32, u32, String)> {
    ranges
        .iter()
        .map(|r| (r.start, r.end, r.owner.display()))
        .collect()
}

fn r(start: u32, end: u32, owner: &str) -> (u32, u32, String) {
    (start, end, owner.to_string())
}

/// Blame through a clean write, a three-way merge (with a change both sides
/// made the same way), a later overwrite, a new file and a binary one, before
/// and after a squash and a GC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blame_follows_writes_merges_and_overwrites_through_squash() {
    if !have_root("blame_follows_writes_merges_and_overwrites_through_squash") {
        return;
    }
    let t = tmp();
    let (_store, p, s) = setup(t.path(), 2);
    let conf: &[u8] = b"/etc/app.conf";
    let b0 = p.blame(STACK, "main", conf).await.unwrap();
    assert_eq!(owners(&b0.ranges), [r(1, 8, "original")]);
    assert_eq!(b0.layer_kind, layerstack_store::LayerKind::Base);

    // a: lines 3 and 5 (clean). b, leased before a's publish: line 3 the same
    // way as a, and line 7 (three-way merged).
    write(
        &s[0].upper,
        "etc/app.conf",
        &edit(&[("key2 = 2", "key2 = A"), ("key4 = 4", "key4 = A")]),
    );
    write(
        &s[1].upper,
        "etc/app.conf",
        &edit(&[("key2 = 2", "key2 = A"), ("key6 = 6", "key6 = B")]),
    );
    assert_eq!(publish(&p, s[0].id).await.kind, OutcomeKind::Committed);
    assert_eq!(publish(&p, s[1].id).await.kind, OutcomeKind::Merged);
    let want = [
        r(1, 2, "original"),
        r(3, 3, "session:a"),
        r(4, 4, "original"),
        r(5, 5, "session:a"),
        r(6, 6, "original"),
        r(7, 7, "session:b"),
        r(8, 8, "original"),
    ];
    assert_eq!(
        owners(&p.blame(STACK, "main", conf).await.unwrap().ranges),
        want
    );

    // A later session overwrites lines 3-4, adds a file, a binary one and a
    // text file over the blame limit (not read: its lines read unknown).
    let huge_lines = (crate::blame::BLAME_MAX_BYTES / 7 + 1) as usize;
    let huge = b"a line\n".repeat(huge_lines);
    let late = sandbox(
        &p,
        "main",
        "late",
        &[
            (
                "etc/app.conf",
                &edit(&[
                    ("key2 = 2", "key2 = Z"),
                    ("key3 = 3", "key3 = Z"),
                    ("key4 = 4", "key4 = A"),
                    ("key6 = 6", "key6 = B"),
                ]),
            ),
            ("etc/new", b"one\ntwo\n"),
            ("etc/blob", b"\0\x01"),
            ("var/huge.log", &huge),
        ],
    )
    .await;
    assert_eq!(publish(&p, late.id).await.kind, OutcomeKind::Committed);
    let want = [
        r(1, 2, "original"),
        r(3, 4, "session:late"),
        r(5, 5, "session:a"),
        r(6, 6, "original"),
        r(7, 7, "session:b"),
        r(8, 8, "original"),
    ];
    let got = p.blame(STACK, "main", conf).await.unwrap();
    assert_eq!(owners(&got.ranges), want);
    assert_eq!(got.lines, 8);
    assert!(
        matches!(got.ranges[1].owner, LineOwner::Session { session, .. } if session == late.id)
    );
    assert_eq!(
        owners(&p.blame(STACK, "main", b"etc/new").await.unwrap().ranges),
        [r(1, 2, "session:late")]
    );
    let got = p.blame(STACK, "main", b"var/huge.log").await.unwrap();
    assert_eq!(got.lines, huge_lines);
    assert_eq!(owners(&got.ranges), [r(1, huge_lines as u32, "unknown")]);
    let e = p.blame(STACK, "main", b"etc/blob").await.unwrap_err();
    assert!(matches!(e, EngineError::FailedPrecondition(_)), "{e}");
    let e = p.blame(STACK, "main", b"etc/none").await.unwrap_err();
    assert!(matches!(e, EngineError::NotFound(_)), "{e}");

    // Squash and collect: the same owners.
    let sq = p.squash(STACK, "main").await.unwrap();
    assert!(sq.is_some(), "three layers squash");
    p.gc().await.unwrap();
    let got = p.blame(STACK, "main", conf).await.unwrap();
    assert_eq!(got.layer_kind, layerstack_store::LayerKind::Squashed);
    assert_eq!(owners(&got.ranges), want);

    // A publish onto the squashed head: unchanged lines keep their owners.
    let next = sandbox(
        &p,
        "main",
        "next",
        &[(
            "etc/app.conf",
            &edit(&[
                ("key2 = 2", "key2 = Z"),
                ("key3 = 3", "key3 = Z"),
                ("key4 = 4", "key4 = A"),
                ("key6 = 6", "key6 = B"),
                ("last = 7", "last = 8"),
            ]),
        )],
    )
    .await;
    assert_eq!(publish(&p, next.id).await.kind, OutcomeKind::Committed);
    let mut want = want.to_vec();
    want[5] = r(8, 8, "session:next");
    assert_eq!(
        owners(&p.blame(STACK, "main", conf).await.unwrap().ranges),
        want
    );
}

/// Diffs between two heads (with patches), a head and a layer of its log, two
/// manifests that differ only by a squash (no candidates), and a session
/// against its lease (read-only: the upper is untouched).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diffs_of_heads_layers_squashes_and_sessions() {
    if !have_root("diffs_of_heads_layers_squashes_and_sessions") {
        return;
    }
    let t = tmp();
    let (store, p, _) = setup(t.path(), 1);
    let one = sandbox(&p, "main", "one", &[("etc/one", b"1\n")]).await;
    assert_eq!(publish(&p, one.id).await.kind, OutcomeKind::Committed);
    store.create_branch(STACK, "feature", "main", None).unwrap();
    let f1 = sandbox(
        &p,
        "feature",
        "f1",
        &[
            ("etc/app.conf", &edit(&[("key2 = 2", "key2 = F")])),
            ("srv/x/y", b"y\n"),
        ],
    )
    .await;
    whiteout(&f1.upper, "etc/old");
    assert_eq!(publish(&p, f1.id).await.kind, OutcomeKind::Committed);
    let f2 = sandbox(&p, "feature", "f2", &[("srv/x/z", b"z\n")]).await;
    assert_eq!(publish(&p, f2.id).await.kind, OutcomeKind::Committed);

    let main = DiffTarget::Branch("main".into());
    let feature = DiffTarget::Branch("feature".into());
    let d = p
        .diff(STACK, main.clone(), feature.clone(), true)
        .await
        .unwrap();
    let got: Vec<(String, DiffChange)> = d
        .entries
        .iter()
        .map(|e| (String::from_utf8(e.path.clone()).unwrap(), e.change))
        .collect();
    assert_eq!(
        got,
        [
            ("etc/app.conf".to_string(), DiffChange::Modified),
            ("etc/old".to_string(), DiffChange::Deleted),
            ("srv".to_string(), DiffChange::Added),
            ("srv/x".to_string(), DiffChange::Added),
            ("srv/x/y".to_string(), DiffChange::Added),
            ("srv/x/z".to_string(), DiffChange::Added),
        ]
    );
    let patch = d.entries[0].patch.as_deref().unwrap();
    assert!(patch.contains("-key2 = 2\n+key2 = F\n"), "{patch}");
    assert_eq!(d.entries[4].new.unwrap().size, 2);
    assert_eq!(d.entries[1].old.unwrap().kind, publisher::FileKind::Regular);
    // The other way round, without patches.
    let back = p
        .diff(STACK, feature.clone(), main.clone(), false)
        .await
        .unwrap();
    assert_eq!(back.entries[1].change, DiffChange::Added);
    assert!(back.entries[0].patch.is_none());

    // A head against a layer of its log: what came after that layer.
    let log = store.log(STACK, "feature").unwrap();
    let older = log[1].layer;
    let d = p
        .diff(
            STACK,
            DiffTarget::Layer {
                branch: "feature".into(),
                layer: older,
            },
            feature.clone(),
            false,
        )
        .await
        .unwrap();
    let paths: Vec<&[u8]> = d.entries.iter().map(|e| e.path.as_slice()).collect();
    assert_eq!(paths, [&b"srv/x/z"[..]]);
    let e = p
        .diff(
            STACK,
            DiffTarget::Layer {
                branch: "main".into(),
                layer: older,
            },
            main.clone(),
            false,
        )
        .await
        .unwrap_err();
    assert!(matches!(e, EngineError::NotFound(_)), "{e}");

    // A squash changes no view: its layer expands to the run it replaced.
    store
        .create_branch(STACK, "before", "feature", None)
        .unwrap();
    assert!(p.squash(STACK, "feature").await.unwrap().is_some());
    let sq = store
        .manifest(store.branch_head(STACK, "feature").unwrap())
        .unwrap();
    let before = store
        .manifest(store.branch_head(STACK, "before").unwrap())
        .unwrap();
    assert_ne!(sq, before);
    assert!(crate::diff::candidates(&store, &before, &sq)
        .unwrap()
        .is_empty());
    let d = p
        .diff(
            STACK,
            DiffTarget::Branch("before".into()),
            feature.clone(),
            false,
        )
        .await
        .unwrap();
    assert!(d.entries.is_empty(), "{:?}", d.entries);
    // Candidates are the paths of the layers on one side only.
    let c = crate::diff::candidates(
        &store,
        &store
            .manifest(store.branch_head(STACK, "main").unwrap())
            .unwrap(),
        &sq,
    )
    .unwrap();
    let keys: Vec<&[u8]> = c.keys().map(Vec::as_slice).collect();
    assert_eq!(
        keys,
        [
            &b"etc/app.conf"[..],
            b"etc/old",
            b"srv",
            b"srv/x",
            b"srv/x/y",
            b"srv/x/z"
        ]
    );
    assert!(
        c[&b"etc/old".to_vec()],
        "a deletion marks the path replaced"
    );

    // A session against its lease: added, modified, deleted; nothing written.
    let w = sandbox(
        &p,
        "main",
        "w",
        &[
            ("etc/app.conf", &edit(&[("last = 7", "last = W")])),
            ("etc/added", b"new\n"),
            ("tmp/ignored", b"excluded\n"),
        ],
    )
    .await;
    whiteout(&w.upper, "etc/one");
    let before_upper = std::fs::read(w.upper.join("etc/app.conf")).unwrap();
    let d = p.diff_session(w.id, true).await.unwrap();
    let got: Vec<(String, DiffChange)> = d
        .entries
        .iter()
        .map(|e| (String::from_utf8(e.path.clone()).unwrap(), e.change))
        .collect();
    assert_eq!(
        got,
        [
            ("etc/added".to_string(), DiffChange::Added),
            ("etc/app.conf".to_string(), DiffChange::Modified),
            ("etc/one".to_string(), DiffChange::Deleted),
            // The image has no /tmp: the directory is new (what is below it
            // is excluded from every publish, and so from the diff).
            ("tmp".to_string(), DiffChange::Added),
        ]
    );
    let patch = d.entries[1].patch.as_deref().unwrap();
    assert!(
        patch.contains("-last = 7\n\\ No newline at end of file\n+last = W\n"),
        "{patch}"
    );
    assert_eq!(
        std::fs::read(w.upper.join("etc/app.conf")).unwrap(),
        before_upper
    );
    assert!(
        w.upper.join("tmp/ignored").exists(),
        "a diff never edits the upper"
    );
    assert!(store.session(w.id).unwrap().outcome.is_none());
}

/// The conflict flow: a conflicting session is shown (three-way view with
/// markers), a rebase that markers cannot express is refused, the rebase moves
/// it onto the head (merging what merges, markers where it conflicts), a publish
/// is refused while the markers are there, and once resolved it publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_is_shown_rebased_refused_while_marked_and_published_once_resolved() {
    if !have_root("a_conflict_is_shown_rebased_refused_while_marked_and_published_once_resolved") {
        return;
    }
    let t = tmp();
    let (store, p, s) = setup(t.path(), 4);
    // The head: a changes line 3 of app.conf and line 1 of etc/both.
    write(
        &s[0].upper,
        "etc/app.conf",
        &edit(&[("key2 = 2", "key2 = A")]),
    );
    write(&s[0].upper, "etc/both", b"ONE\n2\n3\n4\n5\n6\n");
    write(&s[0].upper, "etc/old", b"old, edited on head\n");
    assert_eq!(publish(&p, s[0].id).await.kind, OutcomeKind::Committed);
    // c: line 3 differently (conflict), line 7, line 5 of etc/both (merges), a new file.
    let c = &s[2];
    write(
        &c.upper,
        "etc/app.conf",
        &edit(&[("key2 = 2", "key2 = C"), ("key6 = 6", "key6 = C")]),
    );
    write(&c.upper, "etc/both", b"1\n2\n3\n4\nFIVE\n6\n");
    write(&c.upper, "etc/c-only", b"c\n");
    let out = publish(&p, c.id).await;
    assert_eq!(out.kind, OutcomeKind::Conflict);
    // Not a conflict: nothing to show or rebase.
    let e = p.conflicts(s[1].id).await.unwrap_err();
    assert!(matches!(e, EngineError::FailedPrecondition(_)), "{e}");
    let e = p.rebase(s[1].id).await.unwrap_err();
    assert!(matches!(e, EngineError::FailedPrecondition(_)), "{e}");

    let shown = p.conflicts(c.id).await.unwrap();
    assert_eq!(shown.len(), 2, "{shown:?}");
    // etc/both was not evaluated (a publish stops merging at the first
    // conflict): its three-way view has no conflict block.
    assert_eq!(shown[1].path, b"etc/both");
    assert!(
        shown[1].reason.starts_with("not evaluated"),
        "{}",
        shown[1].reason
    );
    assert_eq!(shown[1].blocks, 0);
    assert_eq!(shown[0].path, b"etc/app.conf");
    assert!(shown[0].reason.contains("adjacent"), "{}", shown[0].reason);
    assert_eq!(shown[0].blocks, 1);
    let text = String::from_utf8(shown[0].text.clone().unwrap()).unwrap();
    assert_eq!(
        text,
        "# app\r\nkey1 = 1\r\n<<<<<<< session\nkey2 = C\n||||||| lease\nkey2 = 2\n=======\nkey2 = A\n>>>>>>> head\nkey3 = 3\nkey4 = 4\nkey5 = 5\nkey6 = C\nlast = 7"
    );
    assert_eq!(
        std::fs::read(c.upper.join("etc/app.conf")).unwrap(),
        edit(&[("key2 = 2", "key2 = C"), ("key6 = 6", "key6 = C")]),
        "showing changes nothing"
    );

    // d deleted etc/old, which the head edited: delete vs edit, no markers can
    // show it, so its rebase is refused and nothing changes.
    let d = &s[3];
    whiteout(&d.upper, "etc/old");
    assert_eq!(publish(&p, d.id).await.kind, OutcomeKind::Conflict);
    let lease_before = store.session(d.id).unwrap().lease_manifest;
    let e = p.rebase(d.id).await.unwrap_err();
    assert!(
        e.to_string().contains("etc/old") && e.to_string().contains("delete vs edit"),
        "{e}"
    );
    assert_eq!(store.session(d.id).unwrap().lease_manifest, lease_before);

    // The head moves on meanwhile (b: line 5, elsewhere).
    write(
        &s[1].upper,
        "etc/app.conf",
        &edit(&[("key4 = 4", "key4 = B")]),
    );
    assert_eq!(publish(&p, s[1].id).await.kind, OutcomeKind::Merged);
    let head = store.branch_head(STACK, "main").unwrap();

    let mut events = p.subscribe();
    let rb = p.rebase(c.id).await.unwrap();
    assert!(
        events.try_recv().is_err(),
        "a rebase is not an outcome: nothing is announced"
    );
    assert_eq!(rb.manifest, head);
    assert_eq!(rb.session.lease_manifest, Some(head));
    assert_eq!(
        rb.session.outcome.as_ref().map(|o| o.kind),
        Some(OutcomeKind::Conflict)
    );
    assert_eq!(rb.marked, [(b"etc/app.conf".to_vec(), 1)]);
    assert_eq!(rb.merged, [b"etc/both".to_vec()]);
    let marked = String::from_utf8(std::fs::read(c.upper.join("etc/app.conf")).unwrap()).unwrap();
    assert_eq!(
        marked,
        "# app\r\nkey1 = 1\r\n<<<<<<< session\nkey2 = C\n||||||| lease\nkey2 = 2\n=======\nkey2 = A\n>>>>>>> head\nkey3 = 3\nkey4 = B\nkey5 = 5\nkey6 = C\nlast = 7"
    );
    assert_eq!(
        std::fs::read(c.upper.join("etc/both")).unwrap(),
        b"ONE\n2\n3\n4\nFIVE\n6\n"
    );
    // Shown after the rebase: the marked file as it is, awaiting resolution,
    // its block counted; the merged one has no three-way view.
    let shown = p.conflicts(c.id).await.unwrap();
    assert_eq!(shown.len(), 2, "{shown:?}");
    assert_eq!(shown[0].path, b"etc/app.conf");
    assert_eq!(shown[0].blocks, 1);
    assert!(
        shown[0].reason.starts_with("awaiting resolution") && shown[0].reason.contains("line 3"),
        "{}",
        shown[0].reason
    );
    assert_eq!(shown[0].text.as_deref(), Some(marked.as_bytes()));
    assert_eq!(shown[1].path, b"etc/both");
    assert!(shown[1].reason.contains("merged"), "{}", shown[1].reason);
    assert_eq!((shown[1].blocks, shown[1].text.is_none()), (0, true));
    // A second rebase: already on the head.
    let e = p.rebase(c.id).await.unwrap_err();
    assert!(e.to_string().contains("already"), "{e}");

    // Refused while the markers are there (a dry run says so too).
    let dry = p.dry_run(c.id).await.unwrap();
    assert_eq!(dry.kind, Some(OutcomeKind::Conflict), "{dry:?}");
    let out = publish(&p, c.id).await;
    assert_eq!(out.kind, OutcomeKind::Conflict);
    assert!(
        out.message.as_deref().unwrap().contains("conflict markers"),
        "{out:?}"
    );
    let paths = store
        .outcome_paths(out.id, None, 10, Some(PathStatus::Conflict))
        .unwrap();
    assert_eq!(paths.len(), 1);
    assert!(paths[0].reason.contains("line 3"), "{}", paths[0].reason);
    assert_eq!(
        std::fs::read_to_string(c.upper.join("etc/app.conf")).unwrap(),
        marked,
        "the upper is kept"
    );

    // An edit inside the block (a side's line changed, the lease's section
    // removed) leaves a block from `<<<<<<< session` to `>>>>>>> head`: still
    // refused, naming its first line; a dry run too.
    let edited = marked.replace("key2 = C\n||||||| lease\nkey2 = 2\n", "key2 = CC\n");
    write(&c.upper, "etc/app.conf", edited.as_bytes());
    let dry = p.dry_run(c.id).await.unwrap();
    assert_eq!(dry.kind, Some(OutcomeKind::Conflict), "{dry:?}");
    let out = publish(&p, c.id).await;
    assert_eq!(out.kind, OutcomeKind::Conflict, "{out:?}");
    let paths = store
        .outcome_paths(out.id, None, 10, Some(PathStatus::Conflict))
        .unwrap();
    assert!(paths[0].reason.contains("line 3"), "{}", paths[0].reason);
    let shown = p.conflicts(c.id).await.unwrap();
    assert_eq!(shown.len(), 1, "{shown:?}");
    assert_eq!(shown[0].blocks, 1);
    assert_eq!(shown[0].text.as_deref(), Some(edited.as_bytes()));
    // The head moves on elsewhere and the session is rebased again: the block
    // left is carried onto the new lease, so the publish is still refused.
    let e = sandbox(&p, "main", "e", &[("etc/e-only", b"e\n")]).await;
    assert_eq!(publish(&p, e.id).await.kind, OutcomeKind::Committed);
    let rb = p.rebase(c.id).await.unwrap();
    assert_eq!(rb.marked, [(b"etc/app.conf".to_vec(), 1)]);
    assert_eq!(publish(&p, c.id).await.kind, OutcomeKind::Conflict);

    // Resolved (both values kept on one line): published through the gate.
    let resolved = edited.replace(
        "<<<<<<< session\nkey2 = CC\n=======\nkey2 = A\n>>>>>>> head\n",
        "key2 = A+C\n",
    );
    write(&c.upper, "etc/app.conf", resolved.as_bytes());
    let out = publish(&p, c.id).await;
    assert_eq!(out.kind, OutcomeKind::Committed, "{out:?}");
    let v = publisher::LayerView::new(store.branch_layers(STACK, "main").unwrap());
    assert_eq!(
        v.read_regular(b"etc/app.conf").unwrap().unwrap(),
        resolved.as_bytes()
    );
    assert_eq!(v.read_regular(b"etc/c-only").unwrap().unwrap(), b"c\n");
    let both = publisher::LayerView::new(
        store
            .manifest_view(STACK, store.branch_head(STACK, "main").unwrap())
            .unwrap(),
    );
    assert_eq!(
        both.read_regular(b"etc/both").unwrap().unwrap(),
        b"ONE\n2\n3\n4\nFIVE\n6\n"
    );
    // Blame: the resolution is c's, b's line stays b's, the merged file's lines
    // are the head's (a) and c's.
    assert_eq!(
        owners(
            &p.blame(STACK, "main", b"etc/app.conf")
                .await
                .unwrap()
                .ranges
        ),
        [
            r(1, 2, "original"),
            r(3, 3, "session:c"),
            r(4, 4, "original"),
            r(5, 5, "session:b"),
            r(6, 6, "original"),
            r(7, 7, "session:c"),
            r(8, 8, "original"),
        ]
    );
    assert_eq!(
        owners(&p.blame(STACK, "main", b"etc/both").await.unwrap().ranges),
        [
            r(1, 1, "session:a"),
            r(2, 4, "original"),
            r(5, 5, "session:c"),
            r(6, 6, "original")
        ]
    );
}

/// A version published without blame rows (a blame write that was lost) reads
/// `unknown`, never a guessed owner; a later session's edit of it owns only the
/// lines it changed.
/// A Mode B session whose publish at close conflicted (its holder released
/// it) is rebased like a container's, published again with its markers
/// resolved, and then loses its directories: nothing mounts it again. A
/// container's session in conflict that containerd let go of is refused,
/// saying why and what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_session_that_conflicted_at_close_is_rebased_and_published() {
    if !have_root("a_sandbox_session_that_conflicted_at_close_is_rebased_and_published") {
        return;
    }
    let t = tmp();
    let (store, p, s) = setup(t.path(), 2);
    let x = sandbox(
        &p,
        "main",
        "x",
        &[("etc/app.conf", &edit(&[("key2 = 2", "key2 = X")]))],
    )
    .await;
    write(
        &s[0].upper,
        "etc/app.conf",
        &edit(&[("key2 = 2", "key2 = A")]),
    );
    assert_eq!(publish(&p, s[0].id).await.kind, OutcomeKind::Committed);
    let closed = p
        .close_sandbox_session(
            x.id,
            crate::sandbox::EndAction::Publish,
            "test close",
            std::time::Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(
        closed.outcome.as_ref().map(|o| o.kind),
        Some(OutcomeKind::Conflict)
    );
    assert!(
        closed.released && closed.lease_manifest.is_some(),
        "{closed:?}"
    );

    let rb = p.rebase(x.id).await.unwrap();
    assert_eq!(rb.marked, [(b"etc/app.conf".to_vec(), 1)]);
    assert_eq!(
        Some(rb.manifest),
        store.session(x.id).unwrap().lease_manifest
    );
    let marked = String::from_utf8(std::fs::read(x.upper.join("etc/app.conf")).unwrap()).unwrap();
    assert!(marked.contains("<<<<<<< session\nkey2 = X\n"), "{marked}");
    let resolved = marked.replace(
        "<<<<<<< session\nkey2 = X\n||||||| lease\nkey2 = 2\n=======\nkey2 = A\n>>>>>>> head\n",
        "key2 = A+X\n",
    );
    assert_ne!(resolved, marked);
    write(&x.upper, "etc/app.conf", resolved.as_bytes());
    let out = publish(&p, x.id).await;
    assert_eq!(out.kind, OutcomeKind::Committed, "{out:?}");
    let v = publisher::LayerView::new(store.branch_layers(STACK, "main").unwrap());
    assert_eq!(
        v.read_regular(b"etc/app.conf").unwrap().unwrap(),
        resolved.as_bytes()
    );
    let after = store.session(x.id).unwrap();
    assert!(after.lease_manifest.is_none(), "{after:?}");
    assert!(
        !store.session_dir(x.id).exists(),
        "the released session's directories go once its run ends"
    );

    // A container's session in conflict, released by containerd: refused,
    // naming why (not "is not in conflict").
    let c = &s[1];
    write(&c.upper, "etc/app.conf", &edit(&[("key2 = 2", "key2 = C")]));
    assert_eq!(publish(&p, c.id).await.kind, OutcomeKind::Conflict);
    store.release_session(c.id, false).unwrap();
    let e = p.rebase(c.id).await.unwrap_err();
    assert!(matches!(e, EngineError::FailedPrecondition(_)), "{e}");
    assert!(
        e.to_string().contains("let go") && e.to_string().contains("--discard"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lines_without_rows_are_unknown_never_guessed() {
    if !have_root("lines_without_rows_are_unknown_never_guessed") {
        return;
    }
    let t = tmp();
    let (store, p, _) = setup(t.path(), 1);
    // Published straight through the store: a layer without blame rows.
    let s = sandbox(&p, "main", "lost", &[("etc/lost", b"1\n2\n3\n")]).await;
    let entry = layerstack_store::IndexEntry {
        path: b"etc/lost".to_vec(),
        kind: layerstack_store::ChangeKind::Write,
        digest: Some(publisher::digest_bytes(b"1\n2\n3\n")),
        mode: Some(0o644),
        uid: Some(0),
        gid: Some(0),
        xattrs: None,
    };
    let rec = layerstack_store::PathRecord {
        path: b"etc/lost".to_vec(),
        status: PathStatus::Clean,
        reason: "untouched on head".into(),
    };
    let staged = store.stage_publish(s.id, &[entry], &[rec]).unwrap();
    let head = store.head_view(s.id).unwrap().manifest;
    store
        .commit_publish(
            s.id,
            staged,
            head,
            layerstack_store::CommitRecord::default(),
        )
        .unwrap();
    assert_eq!(
        owners(&p.blame(STACK, "main", b"etc/lost").await.unwrap().ranges),
        [r(1, 3, "unknown")]
    );
    let e = sandbox(&p, "main", "editor", &[("etc/lost", b"1\nTWO\n3\n")]).await;
    assert_eq!(publish(&p, e.id).await.kind, OutcomeKind::Committed);
    assert_eq!(
        owners(&p.blame(STACK, "main", b"etc/lost").await.unwrap().ranges),
        [
            r(1, 1, "unknown"),
            r(2, 2, "session:editor"),
            r(3, 3, "unknown")
        ]
    );
}

/// A checkpoint records blame like a publish: after `node promote` of a node
/// whose attempt edited one line, that line is the attempt's session's and the
/// others keep their owners (every line read `unknown` before: a checkpoint
/// layer had no blame rows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blame_survives_a_checkpoint_and_its_promote() {
    if !have_root("blame_survives_a_checkpoint_and_its_promote") {
        return;
    }
    let t = tmp();
    let (_store, p, _s) = setup(t.path(), 1);
    let conf: &[u8] = b"/etc/app.conf";
    let (_, root) = p.graph_create("g", STACK, "main", None).await.unwrap();
    let owner = layerstack_store::Owner::Sandbox { name: "cp".into() };
    let (_, s, _, _) = p.attempt_start(&root.id, owner, None, None).await.unwrap();
    write(
        &s.upper,
        "etc/app.conf",
        &edit(&[("key2 = 2", "key2 = CP")]),
    );
    let node = p
        .checkpoint(s.id, None, Default::default(), None)
        .await
        .unwrap();
    let promoted = p.node_promote(&node.id, "main", None).await.unwrap();
    assert!(
        matches!(promoted, crate::Promoted::FastForward { .. }),
        "{promoted:?}"
    );
    assert_eq!(
        owners(&p.blame(STACK, "main", conf).await.unwrap().ranges),
        [
            r(1, 2, "original"),
            r(3, 3, "session:cp"),
            r(4, 8, "original")
        ]
    );
}
