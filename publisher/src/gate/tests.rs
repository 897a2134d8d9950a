//! Gate tests on in-memory trees: one test per row of ARCHITECTURE.md §7, the
//! hierarchy rules, and a reference-model property test.
//!
//! A [`Case`] holds three whole trees — base (the lease's view), ours (what the
//! session saw at the end) and theirs (the branch head) — and derives from them what
//! the real code paths get: the captured [`Changeset`] (as capture builds it from an
//! upper: changed paths, copy-up parents, touched files as noise, opaque
//! directories for deleted-and-recreated ones, expansion on request) and the head's
//! path index. The plan is applied to an in-memory upper, and the upper is overlaid
//! on the head tree as overlayfs would: that is the published result.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::apply::apply_plan;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use proptest::prelude::*;

use super::*;

#[derive(Debug, Clone, PartialEq, Eq)]
enum N {
    F {
        c: Vec<u8>,
        mode: u32,
        uid: u32,
        x: Xa,
    },
    D {
        mode: u32,
        uid: u32,
        x: Xa,
    },
    L {
        t: Vec<u8>,
        uid: u32,
        x: Xa,
    },
}

/// `user.*` xattrs of a node.
type Xa = BTreeMap<Vec<u8>, Vec<u8>>;

impl N {
    fn uid(&self) -> u32 {
        match self {
            N::F { uid, .. } | N::D { uid, .. } | N::L { uid, .. } => *uid,
        }
    }

    fn x(&self) -> &Xa {
        match self {
            N::F { x, .. } | N::D { x, .. } | N::L { x, .. } => x,
        }
    }

    fn owner_and_xattrs(&mut self) -> (&mut u32, &mut Xa) {
        match self {
            N::F { uid, x, .. } | N::D { uid, x, .. } | N::L { uid, x, .. } => (uid, x),
        }
    }
}

type Tree = BTreeMap<Vec<u8>, N>;

fn l(t: &str) -> N {
    N::L {
        t: t.as_bytes().to_vec(),
        uid: 0,
        x: Xa::new(),
    }
}

fn f(c: &str) -> N {
    N::F {
        c: c.as_bytes().to_vec(),
        mode: 0o644,
        uid: 0,
        x: Xa::new(),
    }
}

fn fm(c: &str, mode: u32) -> N {
    N::F {
        c: c.as_bytes().to_vec(),
        mode,
        uid: 0,
        x: Xa::new(),
    }
}

fn d(mode: u32) -> N {
    N::D {
        mode,
        uid: 0,
        x: Xa::new(),
    }
}

fn tree(entries: &[(&str, N)]) -> Tree {
    entries
        .iter()
        .map(|(p, n)| (p.as_bytes().to_vec(), n.clone()))
        .collect()
}

fn ancestors(p: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    for (i, b) in p.iter().enumerate() {
        if *b == b'/' {
            out.push(&p[..i]);
        }
    }
    out
}

fn change_of(n: &N, opaque: bool) -> Change {
    match n {
        N::F { c, mode, uid, .. } => Change::Write {
            mode: *mode,
            uid: *uid,
            gid: 0,
            size: c.len() as u64,
            digest: digest_bytes(c),
        },
        N::D { mode, uid, .. } => Change::Mkdir {
            mode: *mode,
            uid: *uid,
            gid: 0,
            opaque,
        },
        N::L { t, uid, .. } => Change::Symlink {
            target: t.clone(),
            uid: *uid,
            gid: 0,
        },
    }
}

/// What capture makes of a session that turned `base` into `side`: `recreated`
/// directories were deleted and made again (opaque), `touched` files were copied
/// up unchanged, `expand` directories are expanded.
fn capture_model(
    base: &Tree,
    side: &Tree,
    recreated: &BTreeSet<Vec<u8>>,
    touched: &BTreeSet<Vec<u8>>,
    expand: &BTreeSet<Vec<u8>>,
) -> Changeset {
    let mut cs = Changeset::default();
    let keys: BTreeSet<&Vec<u8>> = base.keys().chain(side.keys()).collect();
    for p in keys {
        let anc = ancestors(p);
        if anc.iter().any(|a| !side.contains_key(*a)) {
            continue; // a whiteout above covers it
        }
        let hidden = anc
            .iter()
            .any(|a| recreated.contains(*a) && !expand.contains(*a));
        let b = if hidden { None } else { base.get(p) };
        match (b, side.get(p)) {
            (None, None) => {}
            (Some(_), None) => {
                cs.entries.insert(p.clone(), Change::Delete);
            }
            (b, Some(o)) => {
                let is_recreated = recreated.contains(p);
                if is_recreated && expand.contains(p) {
                    cs.edits.unopaque.push(p.clone());
                }
                match o {
                    N::D { .. } if is_recreated && !expand.contains(p) => {
                        cs.entries.insert(p.clone(), change_of(o, true));
                    }
                    N::D { mode, uid, .. } => match b {
                        Some(bn) if bn == o => {
                            if is_recreated {
                                cs.unchanged.insert(
                                    p.clone(),
                                    Change::Meta {
                                        mode: *mode,
                                        uid: *uid,
                                        gid: 0,
                                    },
                                );
                            }
                        }
                        Some(N::D { .. }) => {
                            cs.entries.insert(
                                p.clone(),
                                Change::Meta {
                                    mode: *mode,
                                    uid: *uid,
                                    gid: 0,
                                },
                            );
                        }
                        other => {
                            cs.entries.insert(p.clone(), change_of(o, other.is_some()));
                        }
                    },
                    _ => {
                        if b == Some(o) {
                            if touched.contains(p) {
                                cs.unchanged.insert(p.clone(), change_of(o, false));
                            }
                        } else {
                            cs.entries.insert(p.clone(), change_of(o, false));
                        }
                    }
                }
            }
        }
    }
    // Whiteouts of an expanded directory's lease content.
    for p in expand {
        for (q, _) in base.range::<Vec<u8>, _>(p.clone()..) {
            if !strictly_below(p, q) {
                if q.as_slice() > p.as_slice() && !q.starts_with(p) {
                    break;
                }
                continue;
            }
            if !side.contains_key(q)
                && side.contains_key(&q[..q.iter().rposition(|&b| b == b'/').unwrap()])
            {
                cs.entries.insert(q.clone(), Change::Delete);
                cs.edits.whiteouts.push(q.clone());
            }
        }
    }
    // Copy-up parents.
    let upper: Vec<Vec<u8>> = cs
        .entries
        .keys()
        .chain(cs.unchanged.keys())
        .cloned()
        .collect();
    for p in upper {
        for a in ancestors(&p) {
            if cs.entries.contains_key(a) || cs.unchanged.contains_key(a) {
                continue;
            }
            if let Some(N::D { mode, uid, .. }) = side.get(a) {
                cs.unchanged.insert(
                    a.to_vec(),
                    Change::Meta {
                        mode: *mode,
                        uid: *uid,
                        gid: 0,
                    },
                );
            }
        }
    }
    // The xattrs digest of every path in the upper, as capture records it.
    let upper: Vec<Vec<u8>> = cs
        .entries
        .keys()
        .chain(cs.unchanged.keys())
        .cloned()
        .collect();
    for p in upper {
        if let Some(digest) = side.get(&p).and_then(|n| list_digest(&xlist(n.x()))) {
            cs.xattrs.insert(p, digest);
        }
    }
    cs
}

fn xlist(x: &Xa) -> XattrList {
    x.iter().map(|(n, v)| (n.clone(), v.clone())).collect()
}

/// The in-memory upper after the plan, plus the three trees for reads.
struct Mem<'a> {
    base: &'a Tree,
    ours: &'a Tree,
    theirs: &'a Tree,
}

impl GateFiles for Mem<'_> {
    fn stat(&self, side: Side, path: &[u8]) -> io::Result<Option<FileState>> {
        let t = match side {
            Side::Base => self.base,
            Side::Ours => self.ours,
            Side::Theirs => self.theirs,
        };
        Ok(t.get(path).map(|n| {
            let (kind, mode, size) = match n {
                N::F { c, mode, .. } => (FileKind::Regular, *mode, c.len() as u64),
                N::D { mode, .. } => (FileKind::Dir, *mode, 0),
                N::L { t, .. } => (FileKind::Symlink, 0o777, t.len() as u64),
            };
            FileState {
                kind,
                mode,
                uid: n.uid(),
                gid: 0,
                size,
                rdev: 0,
                xattrs: xlist(n.x()),
            }
        }))
    }

    fn read(&self, side: Side, path: &[u8]) -> io::Result<Vec<u8>> {
        let t = match side {
            Side::Base => self.base,
            Side::Ours => self.ours,
            Side::Theirs => self.theirs,
        };
        match t.get(path) {
            Some(N::F { c, .. }) | Some(N::L { t: c, .. }) => Ok(c.clone()),
            _ => Err(io::Error::from(io::ErrorKind::NotFound)),
        }
    }

    /// The head's regular files are "streamed" from [`MEM_HEAD`] ([`overlay`]
    /// reads them from the head tree).
    fn source(&self, side: Side, path: &[u8]) -> io::Result<Option<PathBuf>> {
        Ok(
            (side == Side::Theirs && matches!(self.theirs.get(path), Some(N::F { .. })))
                .then(|| PathBuf::from(MEM_HEAD)),
        )
    }
}

/// The directory [`Mem::source`] names for the head's files.
const MEM_HEAD: &str = "/mem/head";

#[derive(Debug, Clone, Default)]
struct Case {
    base: Tree,
    ours: Tree,
    theirs: Tree,
    recreated: BTreeSet<Vec<u8>>,
    touched: BTreeSet<Vec<u8>>,
    head_recreated: BTreeSet<Vec<u8>>,
    /// The head as published layers, oldest first: each layer's resulting tree and
    /// the directories re-created (opaque) in it. Empty: one layer, `theirs` with
    /// `head_recreated`.
    head_layers: Vec<(Tree, BTreeSet<Vec<u8>>)>,
}

struct Run {
    plan: GatePlan,
    /// The branch head after the publish (`None` on conflict).
    result: Option<Tree>,
}

impl Run {
    fn status(&self, p: &str) -> PathStatus {
        self.plan
            .reports
            .iter()
            .find(|r| r.path == p.as_bytes())
            .unwrap_or_else(|| panic!("no report for {p}: {:#?}", self.plan.reports))
            .status
    }

    fn reason(&self, p: &str) -> String {
        self.plan
            .reports
            .iter()
            .find(|r| r.path == p.as_bytes())
            .unwrap()
            .reason
            .clone()
    }

    fn conflicts(&self) -> Vec<String> {
        self.plan
            .conflicts()
            .map(|r| String::from_utf8(r.path.clone()).unwrap())
            .collect()
    }

    fn result(&self) -> &Tree {
        self.result
            .as_ref()
            .unwrap_or_else(|| panic!("conflict: {:#?}", self.plan.reports))
    }
}

/// The head's path index: every layer's changes, newest layer first.
fn head_changes(c: &Case) -> Vec<HeadChange> {
    let single = [(c.theirs.clone(), c.head_recreated.clone())];
    let layers: &[(Tree, BTreeSet<Vec<u8>>)] = if c.head_layers.is_empty() {
        &single
    } else {
        &c.head_layers
    };
    let none = BTreeSet::new();
    let mut prev = &c.base;
    let mut per_layer = Vec::new();
    for (t, recreated) in layers {
        let hc = capture_model(prev, t, recreated, &none, &none);
        per_layer.push(
            hc.entries
                .iter()
                .map(|(p, ch)| HeadChange::from_change(p, ch).with_xattrs(hc.xattrs_of(p)))
                .collect::<Vec<_>>(),
        );
        prev = t;
    }
    flatten_head_layers(per_layer.into_iter().rev())
}

fn run(c: &Case) -> Run {
    run_limits(c, &MergeOptions::default())
}

fn run_limits(c: &Case, limits: &MergeOptions) -> Run {
    let head = head_changes(c);
    let none = BTreeSet::new();
    let mut cs = capture_model(&c.base, &c.ours, &c.recreated, &c.touched, &none);
    let err = plan_gate(
        &cs,
        &head,
        &Mem {
            base: &c.base,
            ours: &c.ours,
            theirs: &c.theirs,
        },
        limits,
    );
    if let Err(GateError::NeedsExpansion(expand)) = err {
        assert_eq!(expand, opaque_dirs_to_expand(&cs, &head));
        cs = capture_model(&c.base, &c.ours, &c.recreated, &c.touched, &expand);
    }
    let files = Mem {
        base: &c.base,
        ours: &c.ours,
        theirs: &c.theirs,
    };
    let plan = plan_gate(&cs, &head, &files, limits).unwrap();
    let result = (!plan.is_conflict()).then(|| overlay(c, &cs, &plan));
    Run { plan, result }
}

/// A regular file with `content` and the metadata `meta`.
fn file_with(content: &[u8], meta: &Meta) -> N {
    N::F {
        c: content.to_vec(),
        mode: meta.mode,
        uid: meta.uid,
        x: meta.xattrs.iter().cloned().collect(),
    }
}

/// Applies the plan to the upper and lays the upper over the head's tree.
fn overlay(c: &Case, cs: &Changeset, plan: &GatePlan) -> Tree {
    // The upper: every captured path with the session's state.
    let mut upper: BTreeMap<Vec<u8>, Option<(N, bool)>> = BTreeMap::new();
    for (p, ch) in cs.entries.iter().chain(cs.unchanged.iter()) {
        let v = match ch {
            Change::Delete => None,
            Change::Mkdir { opaque, .. } => Some((c.ours[p].clone(), *opaque)),
            _ => Some((c.ours[p].clone(), false)),
        };
        upper.insert(p.clone(), v);
    }
    for a in &plan.actions {
        match a {
            Action::WriteFile {
                path,
                content,
                meta,
            } => {
                upper.insert(path.clone(), Some((file_with(content, meta), false)));
            }
            Action::CopyFile { path, from, meta } => {
                assert_eq!(from, Path::new(MEM_HEAD));
                let Some(N::F { c: content, .. }) = c.theirs.get(path) else {
                    panic!("copy of a head path that is not a file: {path:?}");
                };
                upper.insert(path.clone(), Some((file_with(content, meta), false)));
            }
            Action::WriteSymlink { path, target, meta } => {
                let Some(N::L { t, .. }) = c.theirs.get(path) else {
                    panic!("symlink action for a head path that is not a symlink: {path:?}");
                };
                assert_eq!(t, target, "the target must be the head's");
                upper.insert(
                    path.clone(),
                    Some((
                        N::L {
                            t: target.clone(),
                            uid: meta.uid,
                            x: meta.xattrs.iter().cloned().collect(),
                        },
                        false,
                    )),
                );
            }
            Action::SetMeta { path, meta } => {
                if let Some(Some((n, _))) = upper.get_mut(path) {
                    match n {
                        N::F { mode, .. } | N::D { mode, .. } => *mode = meta.mode,
                        N::L { .. } => {}
                    }
                    let (uid, x) = n.owner_and_xattrs();
                    *uid = meta.uid;
                    *x = meta.xattrs.iter().cloned().collect();
                }
            }
            Action::Remove { path } => {
                upper.retain(|q, _| q != path && !strictly_below(path, q));
            }
        }
    }
    let mut r = c.theirs.clone();
    for (p, v) in upper {
        match v {
            None => r.retain(|q, _| *q != p && !strictly_below(&p, q)),
            Some((n, opaque)) => {
                let is_dir = matches!(n, N::D { .. });
                let was_dir = matches!(r.get(&p), Some(N::D { .. }));
                if !is_dir || opaque || !was_dir {
                    r.retain(|q, _| !strictly_below(&p, q));
                }
                r.insert(p, n);
            }
        }
    }
    r
}

fn set(paths: &[&str]) -> BTreeSet<Vec<u8>> {
    paths.iter().map(|p| p.as_bytes().to_vec()).collect()
}

const TEXT: &str = "1\n2\n3\n4\n5\n6\n";

// ---- ARCHITECTURE.md §7, row by row ----

#[test]
fn row_untouched_on_head_is_clean() {
    let base = tree(&[("etc", d(0o755)), ("etc/a", f("a")), ("etc/b", f("b"))]);
    let mut ours = base.clone();
    ours.insert(b"etc/a".to_vec(), f("A"));
    ours.insert(b"etc/new".to_vec(), f("n"));
    let mut theirs = base.clone();
    theirs.insert(b"etc/b".to_vec(), f("B"));
    let r = run(&Case {
        base,
        ours,
        theirs,
        ..Case::default()
    });
    assert_eq!(r.status("etc/a"), PathStatus::Clean);
    assert_eq!(r.reason("etc/a"), "untouched on head");
    assert_eq!(r.status("etc/new"), PathStatus::Clean);
    let want = tree(&[
        ("etc", d(0o755)),
        ("etc/a", f("A")),
        ("etc/b", f("B")),
        ("etc/new", f("n")),
    ]);
    assert_eq!(r.result(), &want);
    assert!(!r.plan.is_merged());
    assert_eq!(
        r.plan.index.len(),
        2,
        "only the session's changes are indexed"
    );
}

#[test]
fn row_same_final_state_is_clean_without_duplicate() {
    let base = tree(&[("a", f("old")), ("gone", f("x")), ("d", d(0o755))]);
    let mut both = base.clone();
    both.insert(b"a".to_vec(), f("same"));
    both.remove(b"gone".as_slice());
    both.insert(b"d".to_vec(), d(0o700));
    both.insert(b"l".to_vec(), l("/t"));
    let r = run(&Case {
        base,
        ours: both.clone(),
        theirs: both.clone(),
        ..Case::default()
    });
    for p in ["a", "gone", "d", "l"] {
        assert_eq!(r.status(p), PathStatus::Clean, "{p}");
        assert_eq!(r.reason(p), "same change on both sides");
    }
    assert!(r.plan.actions.is_empty());
    assert_eq!(r.result(), &both);
}

#[test]
fn row_text_hunks_separated_by_an_unchanged_line_merge() {
    let base = tree(&[("f", f(TEXT))]);
    let ours = tree(&[("f", f("1\nTWO\n3\n4\n5\n6\n"))]);
    let theirs = tree(&[("f", f("1\n2\n3\nFOUR\n5\n6\n"))]);
    let r = run(&Case {
        base,
        ours,
        theirs,
        ..Case::default()
    });
    assert_eq!(r.status("f"), PathStatus::Merged);
    assert_eq!(r.reason("f"), "three-way merged text");
    assert_eq!(r.result()[&b"f".to_vec()], f("1\nTWO\n3\nFOUR\n5\n6\n"));
    assert!(r.plan.is_merged());
    let idx = &r.plan.index[0];
    assert_eq!(
        idx.digest,
        Some(digest_bytes(b"1\nTWO\n3\nFOUR\n5\n6\n")),
        "index holds the merged content"
    );
}

#[test]
fn row_text_overlapping_or_adjacent_hunks_conflict() {
    let base = tree(&[("f", f(TEXT))]);
    for theirs_text in ["1\n2\nTHREE\n4\n5\n6\n", "1\nzwei\n3\n4\n5\n6\n"] {
        let r = run(&Case {
            base: base.clone(),
            ours: tree(&[("f", f("1\nTWO\n3\n4\n5\n6\n"))]),
            theirs: tree(&[("f", f(theirs_text))]),
            ..Case::default()
        });
        assert_eq!(r.conflicts(), ["f"]);
        assert!(
            r.reason("f").contains("same or adjacent lines"),
            "{}",
            r.reason("f")
        );
        assert!(
            r.plan
                .actions
                .iter()
                .all(|a| !matches!(a, Action::WriteFile { .. })),
            "markers are never written"
        );
    }
}

#[test]
fn row_delete_vs_edit_type_change_vs_edit_binary_vs_binary_conflict() {
    let base = tree(&[("f", f(TEXT)), ("bin", f("a\0b\nc\n"))]);
    // delete vs edit, both ways
    let mut edited = base.clone();
    edited.insert(b"f".to_vec(), f("1\n2\n3\n4\n5\nSIX\n"));
    let mut deleted = base.clone();
    deleted.remove(b"f".as_slice());
    let r = run(&Case {
        base: base.clone(),
        ours: deleted.clone(),
        theirs: edited.clone(),
        ..Case::default()
    });
    assert_eq!(r.conflicts(), ["f"]);
    assert!(
        r.reason("f").starts_with("delete vs edit"),
        "{}",
        r.reason("f")
    );
    let r = run(&Case {
        base: base.clone(),
        ours: edited.clone(),
        theirs: deleted,
        ..Case::default()
    });
    assert_eq!(r.conflicts(), ["f"]);
    // type change vs edit
    let mut linked = base.clone();
    linked.insert(b"f".to_vec(), l("elsewhere"));
    let r = run(&Case {
        base: base.clone(),
        ours: linked,
        theirs: edited,
        ..Case::default()
    });
    assert_eq!(r.conflicts(), ["f"]);
    assert!(
        r.reason("f").starts_with("type change"),
        "{}",
        r.reason("f")
    );
    // binary vs binary
    let mut ob = base.clone();
    ob.insert(b"bin".to_vec(), f("A\0b\nc\n"));
    let mut tb = base.clone();
    tb.insert(b"bin".to_vec(), f("a\0b\nC\n"));
    let r = run(&Case {
        base: base.clone(),
        ours: ob.clone(),
        theirs: tb,
        ..Case::default()
    });
    assert_eq!(r.conflicts(), ["bin"]);
    assert_eq!(r.reason("bin"), "binary file changed on both sides");
    // binary: one side unchanged → the other; identical → once
    let r = run(&Case {
        base: base.clone(),
        ours: ob.clone(),
        theirs: base.clone(),
        ..Case::default()
    });
    assert_eq!(r.result()[&b"bin".to_vec()], f("A\0b\nc\n"));
    let r = run(&Case {
        base,
        ours: ob.clone(),
        theirs: ob,
        ..Case::default()
    });
    assert_eq!(r.status("bin"), PathStatus::Clean);
}

#[test]
fn row_metadata_on_one_side_content_on_the_other_merge_field_by_field() {
    let base = tree(&[
        ("f", fm(TEXT, 0o644)),
        ("g", fm(TEXT, 0o644)),
        ("dir", d(0o755)),
    ]);
    let mut ours = base.clone();
    ours.insert(b"f".to_vec(), fm(TEXT, 0o755)); // chmod
    ours.insert(b"g".to_vec(), fm("1\n2\n3\n4\n5\nsix\n", 0o644)); // content
    ours.insert(b"dir".to_vec(), d(0o700));
    let mut theirs = base.clone();
    theirs.insert(b"f".to_vec(), fm("ONE\n2\n3\n4\n5\n6\n", 0o644)); // content
    theirs.insert(
        b"g".to_vec(),
        N::F {
            c: TEXT.as_bytes().to_vec(),
            mode: 0o600,
            uid: 7,
            x: Xa::new(),
        },
    ); // chmod + chown
    theirs.insert(b"dir".to_vec(), d(0o700));
    let r = run(&Case {
        base,
        ours,
        theirs,
        ..Case::default()
    });
    assert_eq!(r.status("f"), PathStatus::Merged);
    assert_eq!(r.reason("f"), "content from head, metadata from session");
    assert_eq!(r.status("g"), PathStatus::Merged);
    assert_eq!(r.reason("g"), "metadata merged field by field");
    let res = r.result();
    assert_eq!(res[&b"f".to_vec()], fm("ONE\n2\n3\n4\n5\n6\n", 0o755));
    assert_eq!(
        res[&b"g".to_vec()],
        N::F {
            c: b"1\n2\n3\n4\n5\nsix\n".to_vec(),
            mode: 0o600,
            uid: 7,
            x: Xa::new(),
        }
    );
    assert_eq!(r.status("dir"), PathStatus::Clean);
    // The same field changed differently on both sides conflicts.
    let base = tree(&[("f", fm(TEXT, 0o644))]);
    let r = run(&Case {
        base,
        ours: tree(&[("f", fm(TEXT, 0o755))]),
        theirs: tree(&[("f", fm(TEXT, 0o600))]),
        ..Case::default()
    });
    assert_eq!(r.conflicts(), ["f"]);
    assert_eq!(r.reason("f"), "both sides changed mode differently");
    // Directory metadata: mode from one side, nothing else on the other.
    let base = tree(&[("d", d(0o755)), ("d/x", f("x"))]);
    let mut ours = base.clone();
    ours.insert(b"d/x".to_vec(), f("X"));
    let mut theirs = base.clone();
    theirs.insert(b"d".to_vec(), d(0o700));
    let r = run(&Case {
        base,
        ours,
        theirs,
        ..Case::default()
    });
    assert_eq!(
        r.status("d"),
        PathStatus::Clean,
        "copy-up parent takes head's metadata"
    );
    assert_eq!(r.result()[&b"d".to_vec()], d(0o700));
    assert_eq!(r.result()[&b"d/x".to_vec()], f("X"));
}

#[test]
fn row_opaque_dir_expands_to_lease_deletions_and_keeps_head_additions() {
    // Session: rm -rf d; mkdir d; echo > d/mine. Head meanwhile added d/theirs.
    let base = tree(&[
        ("d", d(0o755)),
        ("d/old", f("o")),
        ("d/sub", d(0o755)),
        ("d/sub/deep", f("s")),
    ]);
    let ours = tree(&[("d", d(0o755)), ("d/mine", f("m"))]);
    let mut theirs = base.clone();
    theirs.insert(b"d/theirs".to_vec(), f("t"));
    let r = run(&Case {
        base: base.clone(),
        ours: ours.clone(),
        theirs,
        recreated: set(&["d"]),
        ..Case::default()
    });
    assert_eq!(r.status("d/old"), PathStatus::Clean);
    assert_eq!(r.status("d/sub"), PathStatus::Clean);
    let want = tree(&[("d", d(0o755)), ("d/mine", f("m")), ("d/theirs", f("t"))]);
    assert_eq!(
        r.result(),
        &want,
        "head's addition survives, lease content is gone"
    );
    // Head edited a lease file the session's opaque dir removed: delete vs edit.
    let mut theirs = base.clone();
    theirs.insert(b"d/sub/deep".to_vec(), f("S"));
    let r = run(&Case {
        base: base.clone(),
        ours: ours.clone(),
        theirs,
        recreated: set(&["d"]),
        ..Case::default()
    });
    assert_eq!(r.conflicts(), ["d/sub/deep"]);
    // No head change below: stays opaque (nothing to expand).
    let r = run(&Case {
        base: base.clone(),
        ours,
        theirs: base.clone(),
        recreated: set(&["d"]),
        ..Case::default()
    });
    assert!(r
        .plan
        .index
        .iter()
        .any(|h| h.path == b"d" && h.kind == HeadChangeKind::Opaque));
    assert_eq!(r.result(), &tree(&[("d", d(0o755)), ("d/mine", f("m"))]));
}

#[test]
fn row_excluded_paths_are_reported_and_not_validated() {
    let mut cs = Changeset::default();
    cs.excluded.push((b"tmp/x".to_vec(), "/tmp/**".into()));
    cs.skipped.push((b"run/s.sock".to_vec(), "socket".into()));
    cs.entries.insert(b"a".to_vec(), change_of(&f("a"), false));
    // The head changed tmp/x too: not a conflict, it is not validated.
    let head = [HeadChange::from_change(
        b"tmp/x",
        &change_of(&f("y"), false),
    )];
    let empty = Tree::new();
    let files = Mem {
        base: &empty,
        ours: &empty,
        theirs: &empty,
    };
    let plan = plan_gate(&cs, &head, &files, &MergeOptions::default()).unwrap();
    assert!(!plan.is_conflict());
    let st: Vec<(String, PathStatus)> = plan
        .reports
        .iter()
        .map(|r| (String::from_utf8(r.path.clone()).unwrap(), r.status))
        .collect();
    assert_eq!(
        st,
        [
            ("a".to_string(), PathStatus::Clean),
            ("run/s.sock".to_string(), PathStatus::Excluded),
            ("tmp/x".to_string(), PathStatus::Excluded)
        ]
    );
    assert!(plan.reports[2].reason.contains("/tmp/**"));
    assert_eq!(plan.index.len(), 1);
}

// ---- more gate behaviour ----

#[test]
fn identical_hunks_apply_once_and_crlf_survives() {
    let base = tree(&[("f", f("a\r\nb\r\nc\r\nd\r\ne"))]);
    let ours = tree(&[("f", f("A\r\nb\r\nc\r\nd\r\ne"))]);
    let theirs = tree(&[("f", f("A\r\nb\r\nc\r\nd\r\nE"))]);
    let r = run(&Case {
        base,
        ours,
        theirs,
        ..Case::default()
    });
    assert_eq!(r.result()[&b"f".to_vec()], f("A\r\nb\r\nc\r\nd\r\nE"));
}

#[test]
fn merge_caps_are_conflicts_with_the_reason() {
    let base = tree(&[("f", f(TEXT))]);
    let ours = tree(&[("f", f("1\nTWO\n3\n4\n5\n6\n"))]);
    let theirs = tree(&[("f", f("1\n2\n3\nFOUR\n5\n6\n"))]);
    let limits = MergeOptions {
        max_bytes: 4,
        ..MergeOptions::default()
    };
    let r = run_limits(
        &Case {
            base,
            ours,
            theirs,
            ..Case::default()
        },
        &limits,
    );
    assert_eq!(r.conflicts(), ["f"]);
    assert!(
        r.reason("f").contains("over the merge limit of 4 bytes"),
        "{}",
        r.reason("f")
    );
}

#[test]
fn created_on_both_sides_differently_conflicts() {
    let base = Tree::new();
    let r = run(&Case {
        base,
        ours: tree(&[("n", f("1\n2\n"))]),
        theirs: tree(&[("n", f("1\n3\n"))]),
        ..Case::default()
    });
    assert_eq!(r.conflicts(), ["n"]);
    assert_eq!(
        r.reason("n"),
        "created on both sides with different content"
    );
}

#[test]
fn copy_up_noise_never_conflicts_and_never_reverts_the_head() {
    // Session touched f (copy-up, same content) and wrote g; head rewrote f.
    let base = tree(&[("d", d(0o755)), ("d/f", f("old")), ("g", f("g"))]);
    let mut ours = base.clone();
    ours.insert(b"g".to_vec(), f("G"));
    let mut theirs = base.clone();
    theirs.insert(b"d/f".to_vec(), f("new"));
    let r = run(&Case {
        base: base.clone(),
        ours: ours.clone(),
        theirs: theirs.clone(),
        touched: set(&["d/f"]),
        ..Case::default()
    });
    assert_eq!(r.status("d/f"), PathStatus::Clean);
    assert!(r.reason("d/f").contains("copy-up dropped"));
    assert_eq!(r.result()[&b"d/f".to_vec()], f("new"));
    assert!(r.plan.actions.contains(&Action::Remove {
        path: b"d/f".to_vec()
    }));
    // Head deleted the directory holding only noise: the noise goes with it.
    let mut theirs = base.clone();
    theirs.retain(|p, _| !p.starts_with(b"d"));
    let r = run(&Case {
        base,
        ours,
        theirs,
        touched: set(&["d/f"]),
        ..Case::default()
    });
    assert!(!r.plan.is_conflict(), "{:#?}", r.plan.reports);
    assert!(!r.result().contains_key(b"d".as_slice()));
}

#[test]
fn hardlinked_files_are_never_merged() {
    let base = tree(&[("f", f(TEXT))]);
    let ours = tree(&[("f", f("1\nTWO\n3\n4\n5\n6\n"))]);
    let theirs = tree(&[("f", f("1\n2\n3\nFOUR\n5\n6\n"))]);
    let c = Case {
        base,
        ours,
        theirs,
        ..Case::default()
    };
    let head = head_changes(&c);
    let mut cs = capture_model(
        &c.base,
        &c.ours,
        &BTreeSet::new(),
        &BTreeSet::new(),
        &BTreeSet::new(),
    );
    cs.hardlinks.insert(b"f".to_vec(), 42);
    let files = Mem {
        base: &c.base,
        ours: &c.ours,
        theirs: &c.theirs,
    };
    let plan = plan_gate(&cs, &head, &files, &MergeOptions::default()).unwrap();
    assert!(plan.is_conflict());
    assert!(plan.reports[0].reason.contains("hardlinked"));
}

#[test]
fn session_removed_directory_conflicts_with_head_changes_below() {
    let base = tree(&[("d", d(0o755)), ("d/x", f("x")), ("d/old", f("o"))]);
    let ours = Tree::new();
    let mut theirs = base.clone();
    theirs.insert(b"d/x".to_vec(), f("X"));
    theirs.remove(b"d/old".as_slice());
    theirs.insert(b"d/sub".to_vec(), d(0o755));
    let r = run(&Case {
        base,
        ours,
        theirs,
        ..Case::default()
    });
    // A deletion below agrees with the removal: d/old is not reported.
    assert_eq!(r.conflicts(), ["d/sub", "d/x"]);
}

#[test]
fn head_removed_directory_conflicts_with_session_changes_below() {
    let base = tree(&[("d", d(0o755)), ("d/x", f("x")), ("d/old", f("o"))]);
    let mut ours = base.clone();
    ours.insert(b"d/x".to_vec(), f("X"));
    ours.insert(b"d/sub".to_vec(), d(0o755));
    ours.remove(b"d/old".as_slice());
    let r = run(&Case {
        base,
        ours,
        theirs: Tree::new(),
        ..Case::default()
    });
    assert_eq!(r.conflicts(), ["d", "d/sub", "d/x"]);
}

#[test]
fn head_replaced_directory_keeps_session_additions_of_new_names() {
    // Head: rm -rf d; mkdir d; d/t. Session: added d/new (not in the lease), edited d/x.
    let base = tree(&[("d", d(0o755)), ("d/x", f("x"))]);
    let theirs = tree(&[("d", d(0o755)), ("d/t", f("t"))]);
    let mut ours = base.clone();
    ours.insert(b"d/new".to_vec(), f("n"));
    let c = Case {
        base: base.clone(),
        ours: ours.clone(),
        theirs: theirs.clone(),
        head_recreated: set(&["d"]),
        ..Case::default()
    };
    let r = run(&c);
    assert!(!r.plan.is_conflict(), "{:#?}", r.plan.reports);
    assert_eq!(
        r.result(),
        &tree(&[("d", d(0o755)), ("d/new", f("n")), ("d/t", f("t"))])
    );
    ours.insert(b"d/x".to_vec(), f("X"));
    let r = run(&Case { ours, ..c });
    assert_eq!(r.conflicts(), ["d/x"]);
}

/// The session emptied `d` (`rm -rf d; mkdir d`: an opaque directory with the
/// lease's metadata) and the head deleted `d`. Expanded, the session's `d` is a
/// copy-up parent and its deletions below agree with the head's: the head's
/// deletion wins. Over an empty lease directory the session changed nothing at
/// all; over a non-empty one it only deleted what the head deleted too. (Found by
/// `gate_matches_the_reference_model`; judged whole, the opaque `d` differed from
/// the lease's by its opacity alone and conflicted as delete vs edit.)
#[test]
fn session_emptied_directory_yields_to_a_head_deletion() {
    for base in [
        // The saved proptest case: `rm -rf d; mkdir d; ln -s t0 d/y; rm d/y`.
        tree(&[("d", d(0o755))]),
        tree(&[("d", d(0o755)), ("d/x", f("x")), ("d/sub", d(0o700))]),
    ] {
        let c = Case {
            base: base.clone(),
            ours: tree(&[("d", d(0o755))]),
            theirs: Tree::new(),
            recreated: set(&["d"]),
            ..Case::default()
        };
        let head = head_changes(&c);
        let first = capture_model(&c.base, &c.ours, &c.recreated, &c.touched, &BTreeSet::new());
        assert!(matches!(
            first.entries[b"d".as_slice()],
            Change::Mkdir { opaque: true, .. }
        ));
        assert_eq!(opaque_dirs_to_expand(&first, &head), set(&["d"]));
        let r = run(&c);
        assert!(!r.plan.is_conflict(), "{:#?}", r.plan.reports);
        assert_eq!(r.status("d"), PathStatus::Clean);
        assert_eq!(r.result(), &Tree::new(), "the head's deletion stands");
        assert_eq!(
            r.plan.actions,
            [Action::Remove {
                path: b"d".to_vec()
            }]
        );
        assert!(r.plan.index.is_empty(), "{:?}", r.plan.index);

        // The session changed d's own metadata (`mkdir -m 700 d`): delete vs edit.
        let r = run(&Case {
            ours: tree(&[("d", d(0o700))]),
            ..c.clone()
        });
        assert_eq!(r.conflicts(), ["d"]);
        assert!(
            r.reason("d").starts_with("delete vs edit"),
            "{}",
            r.reason("d")
        );
        // The session put something in it: conflicts below the deleted directory.
        let r = run(&Case {
            ours: tree(&[("d", d(0o755)), ("d/new", f("n"))]),
            ..c.clone()
        });
        assert_eq!(r.conflicts(), ["d", "d/new"]);
    }
}

/// As [`session_emptied_directory_yields_to_a_head_deletion`], one level down: the
/// head deleted or replaced an ancestor of the session's emptied directory.
#[test]
fn session_emptied_directory_yields_to_a_head_removal_of_an_ancestor() {
    let base = tree(&[("a", d(0o755)), ("a/d", d(0o755)), ("a/d/x", f("x"))]);
    let ours = tree(&[("a", d(0o755)), ("a/d", d(0o755))]);
    let c = Case {
        base: base.clone(),
        ours: ours.clone(),
        theirs: Tree::new(),
        recreated: set(&["a/d"]),
        ..Case::default()
    };
    let r = run(&c);
    assert!(!r.plan.is_conflict(), "{:#?}", r.plan.reports);
    assert_eq!(r.result(), &Tree::new());
    // Head: `rm -rf a; mkdir a; echo > a/t`.
    let theirs = tree(&[("a", d(0o755)), ("a/t", f("t"))]);
    let r = run(&Case {
        theirs: theirs.clone(),
        head_recreated: set(&["a"]),
        ..c.clone()
    });
    assert!(!r.plan.is_conflict(), "{:#?}", r.plan.reports);
    assert_eq!(r.result(), &theirs);
    // Only a metadata change of the ancestor hides nothing: no expansion, clean.
    let mut theirs = base.clone();
    theirs.insert(b"a".to_vec(), d(0o700));
    let cs = capture_model(
        &base,
        &ours,
        &set(&["a/d"]),
        &BTreeSet::new(),
        &BTreeSet::new(),
    );
    let head = head_changes(&Case {
        theirs: theirs.clone(),
        ..c.clone()
    });
    assert!(opaque_dirs_to_expand(&cs, &head).is_empty());
    let r = run(&Case { theirs, ..c });
    assert_eq!(r.result(), &tree(&[("a", d(0o700)), ("a/d", d(0o755))]));
}

/// The mirror image is unchanged: the head emptied `d` (`rm -rf d; mkdir d`, an
/// opaque directory in its layer) and the session deleted `d`. A head
/// replacement counts as a change of `d` ("head replaced `d`", merge-rules.md),
/// also over an empty lease directory, so the deletion conflicts.
#[test]
fn session_deletion_of_a_directory_the_head_emptied_conflicts() {
    for base in [
        tree(&[("d", d(0o755))]),
        tree(&[("d", d(0o755)), ("d/x", f("x"))]),
    ] {
        let r = run(&Case {
            base,
            ours: Tree::new(),
            theirs: tree(&[("d", d(0o755))]),
            head_recreated: set(&["d"]),
            ..Case::default()
        });
        assert_eq!(r.conflicts(), ["d"]);
    }
}

#[test]
fn sibling_prefixes_are_not_descendants() {
    let base = tree(&[
        ("a", d(0o755)),
        ("a-b", f("1")),
        ("a0", f("1")),
        ("a.x", d(0o755)),
        ("a.x/y", f("1")),
    ]);
    let mut ours = base.clone();
    ours.remove(b"a".as_slice());
    let mut theirs = base.clone();
    for p in ["a-b", "a0", "a.x/y"] {
        theirs.insert(p.as_bytes().to_vec(), f("2"));
    }
    let r = run(&Case {
        base,
        ours,
        theirs,
        ..Case::default()
    });
    assert!(!r.plan.is_conflict());
}

#[test]
fn newest_head_occurrence_is_the_final_state() {
    let w = |c: &str| change_of(&f(c), false);
    let mut cs = Changeset::default();
    cs.entries.insert(b"f".to_vec(), w("1"));
    let base = tree(&[("f", f("0"))]);
    let files = Mem {
        base: &base,
        ours: &base,
        theirs: &base,
    };
    let lim = MergeOptions::default();
    // Newest first: the head ends at content 1, as the session does.
    let head = [
        HeadChange::from_change(b"f", &w("1")),
        HeadChange::from_change(b"f", &w("2")),
    ];
    assert!(!plan_gate(&cs, &head, &files, &lim).unwrap().is_conflict());
    // An older removal of the parent still counts although the head re-created it:
    // the lease's file is gone on the head (edit vs delete); a name the lease did
    // not have survives, as when `rm -rf d; mkdir d` happens in one layer.
    let base = tree(&[("d", d(0o755)), ("d/lease_file", f("0"))]);
    let files = Mem {
        base: &base,
        ours: &base,
        theirs: &base,
    };
    let mut cs = Changeset::default();
    cs.entries.insert(b"d/lease_file".to_vec(), w("1"));
    cs.entries.insert(b"d/new_file".to_vec(), w("1"));
    let head = [
        HeadChange::from_change(
            b"d",
            &Change::Mkdir {
                mode: 0o755,
                uid: 0,
                gid: 0,
                opaque: false,
            },
        ),
        HeadChange::from_change(b"d", &Change::Delete),
    ];
    let plan = plan_gate(&cs, &head, &files, &lim).unwrap();
    assert_eq!(
        plan.conflicts().map(|r| r.path.clone()).collect::<Vec<_>>(),
        [b"d/lease_file".to_vec()]
    );
}

#[test]
fn head_change_round_trips_through_serde_and_reads_old_records() {
    let h =
        HeadChange::from_change(b"p\xe9", &change_of(&f("x"), false)).with_xattrs(Some([3; 32]));
    let back: HeadChange = serde_json::from_str(&serde_json::to_string(&h).unwrap()).unwrap();
    assert_eq!(back, h);
    // A record written before xattrs were indexed.
    let old = r#"{"path":[97],"kind":"Meta","digest":null,"mode":493,"uid":0,"gid":0}"#;
    let back: HeadChange = serde_json::from_str(old).unwrap();
    assert_eq!(back.xattrs, None);
    assert_eq!(back.kind, HeadChangeKind::Meta);
}

// ---- merge budget, stop at the first conflict, reasons ----

/// [`Mem`] that records every content read.
struct Counting<'a> {
    inner: Mem<'a>,
    reads: std::cell::RefCell<Vec<(Side, Vec<u8>)>>,
}

impl GateFiles for Counting<'_> {
    fn stat(&self, side: Side, path: &[u8]) -> io::Result<Option<FileState>> {
        self.inner.stat(side, path)
    }

    fn read(&self, side: Side, path: &[u8]) -> io::Result<Vec<u8>> {
        self.reads.borrow_mut().push((side, path.to_vec()));
        self.inner.read(side, path)
    }
}

/// Plans `c` (no expansion needed) in `mode` with `limits`, counting reads.
fn plan_counting(
    c: &Case,
    limits: &MergeOptions,
    mode: PlanMode,
) -> (GatePlan, Vec<(Side, Vec<u8>)>) {
    let head = head_changes(c);
    let none = BTreeSet::new();
    let cs = capture_model(&c.base, &c.ours, &none, &none, &none);
    let files = Counting {
        inner: Mem {
            base: &c.base,
            ours: &c.ours,
            theirs: &c.theirs,
        },
        reads: Default::default(),
    };
    let plan = plan_gate_with(&cs, &head, &files, limits, mode).unwrap();
    (plan, files.reads.into_inner())
}

fn report<'p>(plan: &'p GatePlan, p: &str) -> &'p PathReport {
    plan.reports
        .iter()
        .find(|r| r.path == p.as_bytes())
        .unwrap_or_else(|| panic!("no report for {p}: {:#?}", plan.reports))
}

#[test]
fn a_publish_stops_merging_at_the_first_conflict_a_dry_run_does_not() {
    // a: adjacent hunks (conflict); b: separate hunks (would merge).
    let base = tree(&[("a", f(TEXT)), ("b", f(TEXT))]);
    let ours = tree(&[
        ("a", f("1\nTWO\n3\n4\n5\n6\n")),
        ("b", f("1\nTWO\n3\n4\n5\n6\n")),
    ]);
    let theirs = tree(&[
        ("a", f("1\n2\nTHREE\n4\n5\n6\n")),
        ("b", f("1\n2\n3\nFOUR\n5\n6\n")),
    ]);
    let c = Case {
        base,
        ours,
        theirs,
        ..Case::default()
    };
    let limits = MergeOptions::default();
    let (plan, reads) = plan_counting(&c, &limits, PlanMode::Publish);
    assert!(report(&plan, "a").reason.contains("same or adjacent"));
    let b = report(&plan, "b");
    assert_eq!(b.status, PathStatus::Conflict);
    assert!(
        b.reason.starts_with("not evaluated:") && b.reason.contains("conflict at 'a'"),
        "{}",
        b.reason
    );
    assert!(
        !reads.contains(&(Side::Ours, b"b".to_vec())),
        "b was never merged: {reads:?}"
    );
    assert!(plan.actions.is_empty());
    // A merge never runs when any other rule already rejected the changeset.
    let mut c2 = c.clone();
    c2.ours.remove(b"a".as_slice());
    let (plan, reads) = plan_counting(&c2, &limits, PlanMode::Publish);
    assert!(report(&plan, "a").reason.starts_with("delete vs edit"));
    assert!(report(&plan, "b").reason.starts_with("not evaluated:"));
    assert!(!reads.contains(&(Side::Ours, b"b".to_vec())));
    // The dry run evaluates every path.
    let (plan, _) = plan_counting(&c, &limits, PlanMode::DryRun);
    assert_eq!(report(&plan, "a").status, PathStatus::Conflict);
    assert_eq!(report(&plan, "b").status, PathStatus::Merged);
    // plan_gate is the real publish.
    let r = run(&c);
    assert!(r.reason("b").starts_with("not evaluated:"));
}

/// Once the merge time budget is used up, a dry run reports the remaining paths
/// that need a merge as over budget without even reading them.
#[test]
fn a_used_up_budget_reads_no_more_files() {
    // a: a merge of scrambled texts, which cannot finish within the budget of 1 ns.
    let mut base = tree(&[("b", f(TEXT))]);
    let mut ours = tree(&[("b", f("1\nTWO\n3\n4\n5\n6\n"))]);
    let mut theirs = tree(&[("b", f("1\n2\n3\nFOUR\n5\n6\n"))]);
    base.insert(b"a".to_vec(), scrambled_file(1));
    ours.insert(b"a".to_vec(), scrambled_file(2));
    theirs.insert(b"a".to_vec(), scrambled_file(3));
    let c = Case {
        base,
        ours,
        theirs,
        ..Case::default()
    };
    let limits = MergeOptions {
        timeout: Duration::from_nanos(1),
        ..MergeOptions::default()
    };
    let (plan, reads) = plan_counting(&c, &limits, PlanMode::DryRun);
    assert!(
        report(&plan, "a")
            .reason
            .contains("took longer than the limit"),
        "{:?}",
        report(&plan, "a")
    );
    assert!(
        report(&plan, "b")
            .reason
            .contains("budget of 0 ms for this publish is used up"),
        "{:?}",
        report(&plan, "b")
    );
    // (The base version's digest is read before any merge; the session's and the
    // head's versions are read only to merge.)
    assert!(
        !reads.contains(&(Side::Ours, b"b".to_vec()))
            && !reads.contains(&(Side::Theirs, b"b".to_vec())),
        "b was read for a merge after the budget was used up: {reads:?}"
    );
}

/// A text file whose merge with two others of other `seed`s takes about 0.5 s
/// in a debug build ([`crate::testutil::scrambled`]).
fn scrambled_file(seed: u64) -> N {
    f(&String::from_utf8(crate::testutil::scrambled(seed, 4_000, 8)).unwrap())
}

#[test]
fn the_merge_timeout_is_one_budget_for_the_whole_plan() {
    // Four files that each need a merge of scrambled texts. With a budget no
    // merge can meet (1 ns), the first merge times out and uses the budget up,
    // and the three others are never started: one budget for the plan, not one
    // per file.
    let names = ["f1", "f2", "f3", "f4"];
    let side = |seed: u64| -> Tree {
        names
            .iter()
            .enumerate()
            .map(|(k, n)| (n.as_bytes().to_vec(), scrambled_file(seed * 10 + k as u64)))
            .collect()
    };
    let c = Case {
        base: side(1),
        ours: side(2),
        theirs: side(3),
        ..Case::default()
    };
    let limits = MergeOptions {
        timeout: Duration::from_nanos(1),
        ..MergeOptions::default()
    };
    let (plan, _) = plan_counting(&c, &limits, PlanMode::DryRun);
    let reasons: Vec<&str> = names
        .iter()
        .map(|n| report(&plan, n).reason.as_str())
        .collect();
    assert!(names
        .iter()
        .all(|n| report(&plan, n).status == PathStatus::Conflict));
    assert!(
        reasons[0].contains("took longer than the limit"),
        "{reasons:#?}"
    );
    assert!(
        reasons[1..]
            .iter()
            .all(|r| r.contains("budget of 0 ms for this publish is used up")),
        "{reasons:#?}"
    );
}

#[test]
fn a_deletion_is_reported_as_one() {
    let base = tree(&[("a", f("a")), ("b", f("b"))]);
    let ours = tree(&[("b", f("B"))]);
    let r = run(&Case {
        base: base.clone(),
        ours,
        theirs: base,
        ..Case::default()
    });
    assert_eq!(r.status("a"), PathStatus::Clean);
    assert_eq!(r.reason("a"), "deleted; untouched on head");
    assert_eq!(r.reason("b"), "untouched on head");
}

// ---- streaming the head's content ----

/// [`FsFiles`] that records every content read.
struct CountingFs {
    inner: FsFiles,
    reads: std::cell::RefCell<Vec<(Side, Vec<u8>)>>,
}

impl GateFiles for CountingFs {
    fn stat(&self, side: Side, path: &[u8]) -> io::Result<Option<FileState>> {
        self.inner.stat(side, path)
    }

    fn read(&self, side: Side, path: &[u8]) -> io::Result<Vec<u8>> {
        self.reads.borrow_mut().push((side, path.to_vec()));
        self.inner.read(side, path)
    }

    fn digest(&self, side: Side, path: &[u8]) -> io::Result<[u8; 32]> {
        self.inner.digest(side, path)
    }

    fn source(&self, side: Side, path: &[u8]) -> io::Result<Option<PathBuf>> {
        self.inner.source(side, path)
    }
}

#[test]
fn head_content_with_session_metadata_is_streamed_not_read() {
    use std::io::{Seek, SeekFrom, Write};
    let t = tempfile::tempdir().unwrap();
    let dir = |n: &str| {
        let p = t.path().join(n);
        std::fs::create_dir(&p).unwrap();
        p
    };
    let (lease, head, upper, scratch) = (dir("lease"), dir("head"), dir("upper"), dir("scratch"));
    let limits = MergeOptions::default();
    let size = 2 * limits.max_bytes + 12_345; // over the merge byte cap
                                              // Lease: a big file, mode 0644.
    let base: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    std::fs::write(lease.join("big"), &base).unwrap();
    std::fs::set_permissions(lease.join("big"), std::fs::Permissions::from_mode(0o644)).unwrap();
    // Session: chmod only (a copy-up with the lease's bytes).
    std::fs::write(upper.join("big"), &base).unwrap();
    std::fs::set_permissions(upper.join("big"), std::fs::Permissions::from_mode(0o600)).unwrap();
    // Head: new content, sparse in the middle (a hole where the file allows one).
    let hole_at = 64 * 1024;
    let tail_at = size - 4096;
    {
        let mut f = std::fs::File::create(head.join("big")).unwrap();
        f.write_all(&vec![b'h'; hole_at as usize]).unwrap();
        f.seek(SeekFrom::Start(tail_at)).unwrap();
        f.write_all(&vec![b't'; 4096]).unwrap();
    }
    std::fs::set_permissions(head.join("big"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut want = vec![0u8; size as usize];
    want[..hole_at as usize].fill(b'h');
    want[tail_at as usize..].fill(b't');
    let md = std::fs::metadata(upper.join("big")).unwrap();
    let (uid, gid) = (md.uid(), md.gid());

    let mut cs = Changeset::default();
    cs.entries.insert(
        b"big".to_vec(),
        Change::Write {
            mode: 0o600,
            uid,
            gid,
            size,
            digest: digest_bytes(&base),
        },
    );
    let head_changes = [HeadChange::from_change(
        b"big",
        &Change::Write {
            mode: 0o644,
            uid,
            gid,
            size,
            digest: digest_bytes(&want),
        },
    )];
    let files = CountingFs {
        inner: FsFiles {
            lease: LayerView::new(vec![lease.clone()]),
            head: LayerView::new(vec![head.clone(), lease.clone()]),
            upper: upper.clone(),
            userxattr: false,
        },
        reads: Default::default(),
    };
    let plan = plan_gate(&cs, &head_changes, &files, &limits).unwrap();
    assert!(!plan.is_conflict(), "{:#?}", plan.reports);
    assert_eq!(
        report(&plan, "big").reason,
        "content from head, metadata from session"
    );
    // The head's file is copied at apply time, never read into the plan.
    assert!(
        files.reads.borrow().is_empty(),
        "{:?}",
        files.reads.borrow()
    );
    assert_eq!(plan.actions.len(), 1, "{:?}", plan.actions);
    let Action::CopyFile { path, from, meta } = &plan.actions[0] else {
        panic!("not streamed: {:?}", plan.actions[0]);
    };
    assert_eq!(
        (path.as_slice(), from.as_path()),
        (b"big".as_slice(), head.as_path())
    );
    assert_eq!(meta.mode, 0o600);
    assert_eq!(plan.index[0].digest, Some(digest_bytes(&want)));

    apply_plan(&upper, &plan, &scratch).unwrap();
    let got = std::fs::read(upper.join("big")).unwrap();
    assert!(
        got == want,
        "head's bytes ({} vs {} bytes)",
        got.len(),
        want.len()
    );
    let md = std::fs::symlink_metadata(upper.join("big")).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o600, "session's mode");
    assert_eq!((md.uid(), md.gid()), (uid, gid));
    let src_blocks = std::fs::metadata(head.join("big")).unwrap().blocks();
    if src_blocks * 512 < size {
        // The source is sparse here: so is the copy.
        assert!(
            md.blocks() * 512 < size,
            "holes kept: {} blocks",
            md.blocks()
        );
    }
    assert_eq!(std::fs::read_dir(&scratch).unwrap().count(), 0);
    // The head's layer is untouched.
    assert_eq!(
        std::fs::metadata(head.join("big")).unwrap().mode() & 0o7777,
        0o644
    );

    // Without a directory to stream from, the gate falls back to reading.
    let mem_base = tree(&[("f", fm(TEXT, 0o644))]);
    let (plan, reads) = plan_counting(
        &Case {
            base: mem_base,
            ours: tree(&[("f", fm(TEXT, 0o600))]),
            theirs: tree(&[("f", fm("ONE\n", 0o644))]),
            ..Case::default()
        },
        &limits,
        PlanMode::Publish,
    );
    assert!(
        matches!(plan.actions[..], [Action::WriteFile { .. }]),
        "{:?}",
        plan.actions
    );
    assert!(reads.contains(&(Side::Theirs, b"f".to_vec())));
}

/// Found by the reference model: a path below `d` that an older head layer
/// changed is gone when a newer layer deleted `d` or replaced it (`rm -rf d;
/// mkdir d`) without listing the path; the older change must not count as the
/// head's final state ([`flatten_head_layers`]). Base `d/x`; session `rm d/x`;
/// head layer 1 `chown 1 d/x`, layer 2 `rm -rf d` (or `rm -rf d; mkdir d`): both
/// removed `d/x`, clean. The same history with a session that *edited* `d/x`
/// conflicts on the head's removal of `d`, not on the stale chown.
#[test]
fn head_change_below_a_directory_a_newer_layer_hid_is_gone() {
    let base = tree(&[("d", d(0o755)), ("d/x", f(TEXT))]);
    let mut layer1 = base.clone();
    if let Some(n) = layer1.get_mut(b"d/x".as_slice()) {
        *n.owner_and_xattrs().0 = 1;
    }
    for (replaced, layer2) in [(true, tree(&[("d", d(0o755))])), (false, Tree::new())] {
        let case = |ours: Tree| Case {
            base: base.clone(),
            ours,
            theirs: layer2.clone(),
            head_layers: vec![
                (layer1.clone(), BTreeSet::new()),
                (
                    layer2.clone(),
                    if replaced {
                        set(&["d"])
                    } else {
                        BTreeSet::new()
                    },
                ),
            ],
            ..Case::default()
        };
        let r = run(&case(tree(&[("d", d(0o755))])));
        assert_eq!(r.result(), &layer2, "replaced: {replaced}");
        assert_eq!(r.conflicts(), Vec::<String>::new(), "replaced: {replaced}");

        let r = run(&case(tree(&[("d", d(0o755)), ("d/x", f("edited\n"))])));
        assert!(
            r.conflicts().contains(&"d/x".to_string()),
            "replaced: {replaced}"
        );
        let why = r.reason("d/x");
        assert!(
            why.starts_with("head ") && why.contains("ancestor 'd'"),
            "{why}"
        );
    }
}

/// The head replaced `d` across layers — `rm -rf d; mkdir d` then `chmod 700 d`,
/// or `rm -rf d` then `mkdir d` — as it would in one layer: a name the session
/// added below `d` that the lease did not have survives; a lease file the session
/// edited conflicts (the head removed it).
#[test]
fn head_directory_replaced_across_layers_keeps_the_sessions_new_names() {
    let base = tree(&[("d", d(0o755)), ("d/x", f(TEXT))]);
    let ours_new = tree(&[("d", d(0o755)), ("d/x", f(TEXT)), ("d/new", f("n\n"))]);
    let ours_edit = tree(&[("d", d(0o755)), ("d/x", f("edited\n"))]);
    let replaced = tree(&[("d", d(0o755))]);
    let chmodded = tree(&[("d", d(0o700))]);
    let histories: [Vec<(Tree, BTreeSet<Vec<u8>>)>; 2] = [
        vec![
            (replaced.clone(), set(&["d"])),
            (chmodded.clone(), BTreeSet::new()),
        ],
        vec![
            (Tree::new(), BTreeSet::new()),
            (replaced.clone(), BTreeSet::new()),
        ],
    ];
    for layers in histories {
        let theirs = layers.last().unwrap().0.clone();
        let case = |ours: &Tree| Case {
            base: base.clone(),
            ours: ours.clone(),
            theirs: theirs.clone(),
            head_layers: layers.clone(),
            ..Case::default()
        };
        let r = run(&case(&ours_new));
        assert_eq!(r.conflicts(), Vec::<String>::new(), "{:#?}", r.plan.reports);
        let mut want = theirs.clone();
        want.insert(b"d/new".to_vec(), f("n\n"));
        assert_eq!(r.result(), &want);
        let r = run(&case(&ours_edit));
        assert_eq!(r.conflicts(), ["d/x"]);
    }
}

#[test]
fn flatten_head_layers_drops_what_a_newer_layer_hid() {
    let ch = |p: &str, kind: HeadChangeKind| HeadChange {
        path: p.as_bytes().to_vec(),
        kind,
        digest: None,
        mode: None,
        uid: None,
        gid: None,
        xattrs: None,
    };
    use HeadChangeKind as K;
    let newest = vec![
        ch("a", K::Delete),
        ch("b", K::Opaque),
        ch("b/new", K::Write),
        ch("c", K::Write),
    ];
    let older = vec![
        ch("a", K::Meta),
        ch("a/x", K::Write),
        ch("a/y/z", K::Delete),
        ch("ab", K::Write),
        ch("b/new", K::Write),
        ch("b/old", K::Write),
        ch("c/x", K::Write),
        ch("d/x", K::Write),
    ];
    let oldest = vec![
        ch("ab/q", K::Write),
        ch("d", K::Meta),
        ch("d/x", K::Symlink),
    ];
    let got: Vec<(String, K)> = flatten_head_layers([newest, older, oldest])
        .into_iter()
        .map(|h| (String::from_utf8(h.path).unwrap(), h.kind))
        .collect();
    let want: Vec<(String, K)> = [
        ("a", K::Delete),
        ("b", K::Opaque),
        ("b/new", K::Write),
        ("c", K::Write),
        ("a", K::Meta),
        ("ab", K::Write),
        ("d/x", K::Write),
        ("d", K::Meta),
        ("d/x", K::Symlink),
    ]
    .into_iter()
    .map(|(p, k)| (p.to_string(), k))
    .collect();
    assert_eq!(got, want);
}

/// A symlink the head retargeted while the session changed only its owner:
/// field by field, `s -> t1` owned by uid 1 (a new symlink, [`Action::WriteSymlink`]).
#[test]
fn symlink_retargeted_on_head_and_chowned_in_session_merges() {
    let base = tree(&[("s", l("t0"))]);
    let mut ours = base.clone();
    if let Some(n) = ours.get_mut(b"s".as_slice()) {
        *n.owner_and_xattrs().0 = 1;
    }
    let r = run(&Case {
        base,
        ours,
        theirs: tree(&[("s", l("t1"))]),
        ..Case::default()
    });
    assert_eq!(r.reason("s"), "target from head, metadata from session");
    let mut want = tree(&[("s", l("t1"))]);
    if let Some(n) = want.get_mut(b"s".as_slice()) {
        *n.owner_and_xattrs().0 = 1;
    }
    assert_eq!(r.result(), &want);
    assert!(r.plan.is_merged());
}

// ---- reference model ----
//
// Trees over a small universe: text files a, b (six distinct lines), a symlink s,
// directory d with files d/x, d/y. Each side applies a few random operations:
// line edits, chmod, chown, `user.*` xattrs, deletions, creations, symlinks
// (create, retarget, replace a file), and, for the session, copy-up noise. The
// head's operations are split into published layers; on the head, d can also be
// deleted and re-created in a later layer, or replaced in one layer
// (`rm -rf d; mkdir d`: an opaque directory). The model computes the expected head
// after publishing, path by path, from the three trees and what the head's layers
// did to d; the real gate (capture model + plan + apply + overlay) must agree on
// conflict-or-not and, without conflict, on the whole resulting tree.

#[derive(Debug, Clone)]
enum Op {
    /// Replace line `.1` of file `FILES[.0]`.
    Edit(usize, usize, u8),
    /// chmod of a regular file.
    Chmod(usize, u32),
    Delete(usize),
    /// A new text file where nothing is (re-creating d if it is gone).
    Create(usize),
    /// Copy-up without a change (session only).
    Touch(usize),
    /// `rm -rf d`.
    DeleteDir,
    ChmodDir(u32),
    /// `ln -sfn t<v> FILES[.0]`: create or retarget a symlink, or replace a file.
    Link(usize, u8),
    /// chown of `PATHS[.0]`.
    Chown(usize, u32),
    /// `setfattr -n user.<a|b> -v <v> PATHS[.0]`.
    SetX(usize, u8, u8),
    /// `setfattr -x user.<a|b> PATHS[.0]`.
    RmX(usize, u8),
    /// Head only: `rm -rf d; mkdir d` in one layer.
    ReplaceDir,
    /// Head only: the operations after it are the next published layer.
    NextLayer,
}

/// Files and symlinks.
const FILES: [&str; 5] = ["a", "b", "d/x", "d/y", "s"];
/// Everything that can carry metadata.
const PATHS: [&str; 6] = ["a", "b", "d/x", "d/y", "s", "d"];
const XNAMES: [&str; 2] = ["user.a", "user.b"];

fn lines(tag: &str) -> Vec<String> {
    (1..=6).map(|i| format!("{tag}{i}")).collect()
}

fn text(ls: &[String]) -> Vec<u8> {
    ls.iter()
        .map(|l| format!("{l}\n"))
        .collect::<String>()
        .into_bytes()
}

fn file_lines(n: &N) -> Vec<String> {
    let N::F { c, .. } = n else { panic!() };
    String::from_utf8(c.clone())
        .unwrap()
        .lines()
        .map(String::from)
        .collect()
}

struct SideState {
    tree: Tree,
    recreated: BTreeSet<Vec<u8>>,
    touched: BTreeSet<Vec<u8>>,
    /// Published layers, oldest first (the session has one).
    layers: Vec<(Tree, BTreeSet<Vec<u8>>)>,
}

fn apply_ops(base: &Tree, ops: &[Op], who: &str, head: bool) -> SideState {
    let dk = b"d".as_slice();
    let mut t = base.clone();
    let mut layer_start = base.clone();
    let mut layers = Vec::new();
    let mut recreated = BTreeSet::new();
    let mut touched = BTreeSet::new();
    for op in ops {
        match op {
            Op::Edit(fi, li, v) => {
                let p = FILES[*fi].as_bytes().to_vec();
                if let Some(n @ N::F { .. }) = t.get(&p).cloned() {
                    let mut ls = file_lines(&n);
                    ls[*li] = format!("{}{v}", if *v < 2 { "s" } else { who });
                    let N::F { mode, uid, x, .. } = n else {
                        unreachable!()
                    };
                    t.insert(
                        p,
                        N::F {
                            c: text(&ls),
                            mode,
                            uid,
                            x,
                        },
                    );
                }
            }
            Op::Chmod(fi, m) => {
                if let Some(N::F { mode, .. }) = t.get_mut(FILES[*fi].as_bytes()) {
                    *mode = *m;
                }
            }
            Op::Delete(fi) => {
                t.remove(FILES[*fi].as_bytes());
            }
            Op::Touch(fi) => {
                if t.get(FILES[*fi].as_bytes()) == base.get(FILES[*fi].as_bytes())
                    && t.contains_key(FILES[*fi].as_bytes())
                {
                    touched.insert(FILES[*fi].as_bytes().to_vec());
                }
            }
            Op::Create(fi) | Op::Link(fi, _) => {
                let p = FILES[*fi];
                if matches!(op, Op::Create(_)) && t.contains_key(p.as_bytes()) {
                    continue;
                }
                if p.starts_with("d/") && !t.contains_key(dk) {
                    t.insert(dk.to_vec(), d(0o755));
                    if layer_start.contains_key(dk) {
                        recreated.insert(dk.to_vec());
                    }
                }
                let n = match op {
                    Op::Link(_, v) => l(&format!("t{v}")),
                    _ => f(&String::from_utf8(text(&lines(&format!("{who}new")))).unwrap()),
                };
                t.insert(p.as_bytes().to_vec(), n);
            }
            Op::DeleteDir => {
                t.retain(|p, _| !(p == b"d" || p.starts_with(b"d/")));
                recreated.remove(dk);
                touched.retain(|p| !p.starts_with(b"d/"));
            }
            Op::ReplaceDir => {
                if head {
                    t.retain(|p, _| !(p == b"d" || p.starts_with(b"d/")));
                    t.insert(dk.to_vec(), d(0o755));
                    if layer_start.contains_key(dk) {
                        recreated.insert(dk.to_vec());
                    }
                }
            }
            Op::ChmodDir(m) => {
                if let Some(N::D { mode, .. }) = t.get_mut(dk) {
                    *mode = *m;
                }
            }
            Op::Chown(pi, u) => {
                if let Some(n) = t.get_mut(PATHS[*pi].as_bytes()) {
                    *n.owner_and_xattrs().0 = *u;
                }
            }
            Op::SetX(pi, xi, v) => {
                if let Some(n) = t.get_mut(PATHS[*pi].as_bytes()) {
                    n.owner_and_xattrs()
                        .1
                        .insert(XNAMES[usize::from(*xi)].as_bytes().to_vec(), vec![b'0' + v]);
                }
            }
            Op::RmX(pi, xi) => {
                if let Some(n) = t.get_mut(PATHS[*pi].as_bytes()) {
                    n.owner_and_xattrs()
                        .1
                        .remove(XNAMES[usize::from(*xi)].as_bytes());
                }
            }
            Op::NextLayer => {
                if head {
                    layers.push((t.clone(), std::mem::take(&mut recreated)));
                    layer_start = t.clone();
                }
            }
        }
    }
    // A touched file that was changed afterwards is a plain change.
    touched.retain(|p| t.get(p) == base.get(p) && t.contains_key(p));
    layers.push((t.clone(), recreated.clone()));
    SideState {
        tree: t,
        recreated,
        touched,
        layers,
    }
}

/// diff3 on six-line files changed only by line replacement.
fn model_text(b: &[String], o: &[String], t: &[String]) -> Option<Vec<String>> {
    let n = b.len();
    let mut out = Vec::new();
    let mut i = 0;
    while i < n {
        let changed = |j: usize| o[j] != b[j] || t[j] != b[j];
        if !changed(i) {
            out.push(b[i].clone());
            i += 1;
            continue;
        }
        let start = i;
        while i < n && changed(i) {
            i += 1;
        }
        let (or, tr, br) = (&o[start..i], &t[start..i], &b[start..i]);
        if or == tr || tr == br {
            out.extend_from_slice(or);
        } else if or == br {
            out.extend_from_slice(tr);
        } else {
            return None;
        }
    }
    Some(out)
}

fn pick3<T: PartialEq + Clone>(b: &T, o: &T, t: &T) -> Option<T> {
    if o == t || t == b {
        Some(o.clone())
    } else if o == b {
        Some(t.clone())
    } else {
        None
    }
}

/// What the head's layers did to directory d.
#[derive(Debug, Default)]
struct HeadDir {
    /// The newest layer that changed d itself replaced it (`rm -rf d; mkdir d`).
    replaced_last: bool,
    /// Some layer deleted or replaced d.
    hidden: bool,
}

fn head_dir(base: &Tree, layers: &[(Tree, BTreeSet<Vec<u8>>)]) -> HeadDir {
    let dk = b"d".as_slice();
    let mut hd = HeadDir::default();
    let mut prev = base;
    for (t, recreated) in layers {
        let replaced = recreated.contains(dk) && t.contains_key(dk);
        let deleted = prev.contains_key(dk) && !t.contains_key(dk);
        if replaced || prev.get(dk) != t.get(dk) {
            hd.replaced_last = replaced;
        }
        hd.hidden |= replaced || deleted;
        prev = t;
    }
    hd
}

/// The expected head after the publish, or `None` for a conflict.
/// `ours_replaced_d`: the session ran `rm -rf d; mkdir d`.
fn model(
    base: &Tree,
    ours: &Tree,
    theirs: &Tree,
    hd: &HeadDir,
    ours_replaced_d: bool,
) -> Option<Tree> {
    let dk = b"d".as_slice();
    let below_d = || {
        FILES
            .iter()
            .filter(|p| p.starts_with("d/"))
            .map(|p| p.as_bytes())
    };
    // A side's change at p, other than a deletion.
    let edited = |side: &Tree, p: &[u8]| side.get(p) != base.get(p) && side.contains_key(p);
    // The session removed d: any head change at or below d other than a deletion
    // conflicts (a replaced d is a change even with the same metadata).
    if base.contains_key(dk)
        && !ours.contains_key(dk)
        && (edited(theirs, dk)
            || (hd.replaced_last && theirs.contains_key(dk))
            || below_d().any(|p| edited(theirs, p)))
    {
        return None;
    }
    // The head removed or replaced d: session changes below d other than deletions
    // conflict, except, when d is a directory again on the head (replaced, in one
    // layer or across layers), at names the lease did not have there (they
    // survive).
    let d_is_dir_on_head = matches!(theirs.get(dk), Some(N::D { .. }));
    if base.contains_key(dk)
        && hd.hidden
        && below_d().any(|p| edited(ours, p) && (base.contains_key(p) || !d_is_dir_on_head))
    {
        return None;
    }
    // The head replaced d and the session changed d's own metadata (unless the
    // session replaced d too: then d merges field by field).
    if hd.replaced_last && theirs.contains_key(dk) && edited(ours, dk) && !ours_replaced_d {
        return None;
    }
    let mut out = Tree::new();
    let keys: BTreeSet<&Vec<u8>> = base
        .keys()
        .chain(ours.keys())
        .chain(theirs.keys())
        .collect();
    for k in keys {
        let (b, o, t) = (base.get(k), ours.get(k), theirs.get(k));
        let v = if o == t || t == b {
            o.cloned()
        } else if o == b {
            t.cloned()
        } else {
            // Both changed the path: same type throughout, field by field.
            let (bn, on, tn) = (b?, o?, t?);
            let uid = pick3(&bn.uid(), &on.uid(), &tn.uid())?;
            let x = pick3(bn.x(), on.x(), tn.x())?;
            match (bn, on, tn) {
                (N::D { mode: bm, .. }, N::D { mode: om, .. }, N::D { mode: tm, .. }) => {
                    Some(N::D {
                        mode: pick3(bm, om, tm)?,
                        uid,
                        x,
                    })
                }
                (N::F { mode: bm, .. }, N::F { mode: om, .. }, N::F { mode: tm, .. }) => {
                    let mode = pick3(bm, om, tm)?;
                    let ls = model_text(&file_lines(bn), &file_lines(on), &file_lines(tn))?;
                    Some(N::F {
                        c: text(&ls),
                        mode,
                        uid,
                        x,
                    })
                }
                (N::L { t: bt, .. }, N::L { t: ot, .. }, N::L { t: tt, .. }) => {
                    let target = pick3(bt, ot, tt)?;
                    Some(N::L { t: target, uid, x })
                }
                _ => return None,
            }
        };
        if let Some(v) = v {
            out.insert(k.clone(), v);
        }
    }
    Some(out)
}

fn arb_op(head: bool) -> impl Strategy<Value = Op> {
    let fi = 0usize..FILES.len();
    let pi = 0usize..PATHS.len();
    // (The session ignores the head-only operations.)
    let head_only = if head { 2 } else { 1 };
    prop_oneof![
        4 => (fi.clone(), 0usize..6, 0u8..4).prop_map(|(f, l, v)| Op::Edit(f, l, v)),
        1 => (fi.clone(), prop::sample::select(vec![0o644u32, 0o600])).prop_map(|(f, m)| Op::Chmod(f, m)),
        1 => fi.clone().prop_map(Op::Delete),
        1 => fi.clone().prop_map(Op::Create),
        1 => fi.clone().prop_map(Op::Touch),
        1 => Just(Op::DeleteDir),
        1 => prop::sample::select(vec![0o755u32, 0o700]).prop_map(Op::ChmodDir),
        1 => (fi, 0u8..3).prop_map(|(f, v)| Op::Link(f, v)),
        1 => (pi.clone(), 0u32..2).prop_map(|(p, u)| Op::Chown(p, u)),
        1 => (pi.clone(), 0u8..2, 0u8..2).prop_map(|(p, n, v)| Op::SetX(p, n, v)),
        1 => (pi, 0u8..2).prop_map(|(p, n)| Op::RmX(p, n)),
        head_only => Just(Op::ReplaceDir),
        head_only => Just(Op::NextLayer),
    ]
}

fn arb_base() -> impl Strategy<Value = Tree> {
    (
        prop::collection::vec(any::<bool>(), FILES.len()),
        prop::sample::select(vec![0o755u32, 0o700]),
        any::<bool>(),
    )
        .prop_map(|(present, dm, xa)| {
            let mut t = Tree::new();
            t.insert(b"d".to_vec(), d(dm));
            for (i, p) in FILES.iter().enumerate() {
                if present[i] {
                    let mut n = if *p == "s" {
                        l("t0")
                    } else {
                        f(&String::from_utf8(text(&lines(&p.replace('/', "")))).unwrap())
                    };
                    if xa {
                        n.owner_and_xattrs()
                            .1
                            .insert(b"user.a".to_vec(), b"0".to_vec());
                    }
                    t.insert(p.as_bytes().to_vec(), n);
                }
            }
            t
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn gate_matches_the_reference_model(
        base in arb_base(),
        ours_ops in prop::collection::vec(arb_op(false), 0..5),
        theirs_ops in prop::collection::vec(arb_op(true), 0..6),
    ) {
        let o = apply_ops(&base, &ours_ops, "o", false);
        let t = apply_ops(&base, &theirs_ops, "t", true);
        let case = Case {
            base: base.clone(),
            ours: o.tree.clone(),
            theirs: t.tree.clone(),
            recreated: o.recreated.clone(),
            touched: o.touched,
            head_recreated: BTreeSet::new(),
            head_layers: t.layers.clone(),
        };
        let r = run(&case);
        let ours_replaced_d = o.recreated.contains(b"d".as_slice());
        let want = model(&base, &o.tree, &t.tree, &head_dir(&base, &t.layers), ours_replaced_d);
        if std::env::var_os("GATE_MODEL_STATS").is_some() {
            let kind = if r.plan.is_conflict() { "conflict" } else if r.plan.is_merged() { "merged" } else { "clean" };
            eprintln!("MODEL {kind} actions={} layers={}", r.plan.actions.len(), t.layers.len());
        }
        match (&r.result, &want) {
            (None, None) => {}
            (Some(got), Some(want)) => prop_assert_eq!(got, want),
            _ => prop_assert!(false, "gate {:?} vs model {:?}\nreports {:#?}", r.result, want, r.plan.reports),
        }
        // Reports are sorted, unique, and name every captured change.
        prop_assert!(r.plan.reports.windows(2).all(|w| w[0].path < w[1].path));
    }
}

/// On real directories: the head retargeted a symlink, the session chowned it and
/// gave it a `trusted.*` xattr. The upper ends with a new symlink to the head's
/// target with the session's owner and xattr; the head's target was never followed.
#[test]
fn symlink_merge_is_applied_on_real_files() {
    if !crate::testutil::have_root("symlink_merge_is_applied_on_real_files") {
        return;
    }
    let t = crate::testutil::tmp();
    let dir = |n: &str| {
        let p = t.path().join(n);
        std::fs::create_dir(&p).unwrap();
        p
    };
    let (lease, head, upper, scratch) = (dir("lease"), dir("head"), dir("upper"), dir("scratch"));
    crate::testutil::symlink(&lease, "s", b"t0");
    crate::testutil::symlink(&upper, "s", b"t0");
    std::os::unix::fs::lchown(upper.join("s"), Some(1), Some(2)).unwrap();
    xattr::set(upper.join("s"), "trusted.layerstack-test", b"v").unwrap();
    // A head target that exists, to catch a write through the link.
    crate::testutil::symlink(&head, "s", b"victim");
    crate::testutil::write(&upper, "victim", b"untouched", 0o644);

    let view = LayerView::new(vec![lease.clone()]);
    let cs = crate::capture_with(&upper, &view, &crate::CaptureOptions::default()).unwrap();
    let head_cs = crate::capture_with(&head, &view, &crate::CaptureOptions::default()).unwrap();
    let head_changes = vec![head_cs.head_change(b"s").unwrap()];
    let files = FsFiles {
        lease: view,
        head: LayerView::new(vec![head.clone(), lease.clone()]),
        upper: upper.clone(),
        userxattr: false,
    };
    let plan = plan_gate(&cs, &head_changes, &files, &MergeOptions::default()).unwrap();
    assert!(plan.is_merged(), "{:#?}", plan.reports);
    assert!(
        matches!(&plan.actions[..], [Action::WriteSymlink { target, .. }] if target == b"victim"),
        "{:?}",
        plan.actions
    );
    apply_plan(&upper, &plan, &scratch).unwrap();
    let s = upper.join("s");
    assert_eq!(std::fs::read_link(&s).unwrap(), Path::new("victim"));
    let md = std::fs::symlink_metadata(&s).unwrap();
    assert_eq!((md.uid(), md.gid()), (1, 2));
    assert_eq!(
        xattr::get(&s, "trusted.layerstack-test")
            .unwrap()
            .as_deref(),
        Some(&b"v"[..])
    );
    assert_eq!(std::fs::read(upper.join("victim")).unwrap(), b"untouched");
    assert_eq!(
        std::fs::read_dir(&scratch).unwrap().count(),
        0,
        "scratch left clean"
    );
    // The layer's index records the merged state.
    let idx = plan.index.iter().find(|h| h.path == b"s").unwrap();
    assert_eq!(
        (idx.kind, idx.uid, idx.gid),
        (HeadChangeKind::Symlink, Some(1), Some(2))
    );
    assert_eq!(idx.digest, head_changes[0].digest);
}

#[test]
fn merged_texts_carry_line_origins_and_text_conflicts_are_named() {
    use crate::merge::LineOrigin::{Base, Ours, Theirs};
    let base = tree(&[("f", f(TEXT)), ("g", f(TEXT)), ("h", f(TEXT))]);
    let ours = tree(&[
        ("f", f("1\nTWO\n3\n4\n5\n6\n")),
        ("g", f("1\nTWO\n3\n4\n5\n6\n")),
        ("h", f(TEXT)),
    ]);
    let theirs = tree(&[
        ("f", f("1\n2\n3\nFOUR\n5\n6\n")),
        ("g", f("1\nzwei\n3\n4\n5\n6\n")),
        ("h", f(TEXT)),
    ]);
    // Dry run: every merge is attempted, so f merges while g conflicts.
    let c = Case {
        base,
        ours,
        theirs,
        ..Case::default()
    };
    let none = BTreeSet::new();
    let cs = capture_model(&c.base, &c.ours, &none, &none, &none);
    let files = Mem {
        base: &c.base,
        ours: &c.ours,
        theirs: &c.theirs,
    };
    let plan = plan_gate_with(
        &cs,
        &head_changes(&c),
        &files,
        &MergeOptions::default(),
        PlanMode::DryRun,
    )
    .unwrap();
    assert_eq!(
        plan.origins[&b"f".to_vec()],
        [Base(0), Ours(1), Base(2), Theirs(3), Base(4), Base(5)]
    );
    assert!(!plan.origins.contains_key(b"g".as_slice()));
    assert_eq!(
        plan.text_conflicts.iter().collect::<Vec<_>>(),
        [&b"g".to_vec()]
    );
}
