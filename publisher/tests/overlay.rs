//! Tests against the kernel's overlayfs (need root: mount, mknod, trusted.* xattrs).
//!
//! Without root they are skipped, except under `CI=true`, where they fail loudly.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use layerstack_publisher::{
    apply_plan, capture, capture_with, opaque_dirs_to_expand, plan_gate, prepare_upper, seal_layer,
    Action, CaptureOptions, Change, Changeset, FileKind, FsFiles, HeadChange, LayerView,
    MergeOptions,
};
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

mod common;
use common::{have_root, Overlay};

fn tmp() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("layerstack-pub-")
        .tempdir_in("/var/tmp")
        .unwrap()
}

fn put(base: &Path, rel: &str, content: &[u8], mode: u32) {
    let path = base.join(rel);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, content).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn digest(b: &[u8]) -> [u8; 32] {
    *blake3::hash(b).as_bytes()
}

fn keys(m: &BTreeMap<Vec<u8>, Change>) -> Vec<String> {
    m.keys()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect()
}

fn trusted_overlay_xattrs(root: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        for name in xattr::list(&p).unwrap() {
            let name = name.to_string_lossy().into_owned();
            if name.starts_with("trusted.overlay.") {
                out.push((p.strip_prefix(root).unwrap().to_path_buf(), name));
            }
        }
        if std::fs::symlink_metadata(&p).unwrap().is_dir() {
            for d in std::fs::read_dir(&p).unwrap() {
                stack.push(d.unwrap().path());
            }
        }
    }
    out.sort();
    out
}

/// Writes through a real overlay mount, then captures its upper.
#[test]
fn capture_of_a_real_overlay_upper() {
    if !have_root("capture_of_a_real_overlay_upper") {
        return;
    }
    let t = tmp();
    let (l, u, w, m) = (
        t.path().join("l"),
        t.path().join("u"),
        t.path().join("w"),
        t.path().join("m"),
    );
    for d in [&l, &u, &w] {
        std::fs::create_dir(d).unwrap();
    }
    put(&l, "mod.txt", b"old", 0o644);
    put(&l, "touched.txt", b"same", 0o644);
    put(&l, "owned.txt", b"mine", 0o644);
    put(&l, "gone.txt", b"bye", 0o644);
    put(&l, "tree/a", b"a", 0o644);
    put(&l, "tree/sub/b", b"b", 0o644);
    put(&l, "f2d", b"file becomes dir", 0o644);
    put(&l, "deep/er/existing", b"e", 0o644);
    std::fs::create_dir(l.join("dir")).unwrap();
    for d in ["tree", "tree/sub", "deep", "deep/er", "dir"] {
        std::fs::set_permissions(l.join(d), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::set_permissions(&u, std::fs::Permissions::from_mode(0o755)).unwrap();

    let data = format!(
        "lowerdir={},upperdir={},workdir={},index=off,redirect_dir=off,metacopy=off",
        l.display(),
        u.display(),
        w.display()
    );
    let ov = Overlay::mount(&m, &data);
    std::fs::write(m.join("new.txt"), b"hello").unwrap();
    std::fs::write(m.join("mod.txt"), b"modified").unwrap();
    // Opening for writing copies up without changing anything: noise.
    drop(
        std::fs::OpenOptions::new()
            .append(true)
            .open(m.join("touched.txt"))
            .unwrap(),
    );
    std::os::unix::fs::chown(m.join("owned.txt"), Some(1000), Some(1000)).unwrap();
    std::fs::set_permissions(m.join("dir"), std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::remove_file(m.join("gone.txt")).unwrap();
    std::fs::remove_dir_all(m.join("tree")).unwrap();
    std::fs::create_dir(m.join("tree")).unwrap();
    std::fs::set_permissions(m.join("tree"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(m.join("tree/fresh"), b"f").unwrap();
    std::fs::remove_file(m.join("f2d")).unwrap();
    std::fs::create_dir(m.join("f2d")).unwrap();
    std::fs::set_permissions(m.join("f2d"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(m.join("deep/er/file"), b"deep").unwrap();
    std::os::unix::fs::symlink("/nonexistent/target", m.join("link")).unwrap();
    nix::unistd::mkfifo(&m.join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
    std::fs::set_permissions(m.join("fifo"), std::fs::Permissions::from_mode(0o600)).unwrap();
    drop(std::os::unix::net::UnixListener::bind(m.join("app.sock")).unwrap());
    std::fs::write(m.join(OsStr::from_bytes(b"caf\xe9")), b"latin-1 name").unwrap();
    ov.unmount();

    let lease = LayerView::new(vec![l.clone()]);
    let c = capture(&u, &lease).unwrap();
    let w644 = |content: &[u8]| Change::Write {
        mode: 0o644,
        uid: 0,
        gid: 0,
        size: content.len() as u64,
        digest: digest(content),
    };
    let mut want: BTreeMap<Vec<u8>, Change> = BTreeMap::new();
    let mut add = |p: &[u8], c: Change| {
        want.insert(p.to_vec(), c);
    };
    add(b"new.txt", w644(b"hello"));
    add(b"mod.txt", w644(b"modified"));
    add(
        b"owned.txt",
        Change::Write {
            mode: 0o644,
            uid: 1000,
            gid: 1000,
            size: 4,
            digest: digest(b"mine"),
        },
    );
    add(
        b"dir",
        Change::Meta {
            mode: 0o700,
            uid: 0,
            gid: 0,
        },
    );
    add(b"gone.txt", Change::Delete);
    // rm -rf + mkdir: the kernel creates the directory over a whiteout as opaque.
    add(
        b"tree",
        Change::Mkdir {
            mode: 0o755,
            uid: 0,
            gid: 0,
            opaque: true,
        },
    );
    add(b"tree/fresh", w644(b"f"));
    add(
        b"f2d",
        Change::Mkdir {
            mode: 0o755,
            uid: 0,
            gid: 0,
            opaque: true,
        },
    );
    add(b"deep/er/file", w644(b"deep"));
    add(
        b"link",
        Change::Symlink {
            target: b"/nonexistent/target".to_vec(),
            uid: 0,
            gid: 0,
        },
    );
    add(
        b"fifo",
        Change::Special {
            kind: FileKind::Fifo,
            mode: 0o600,
            uid: 0,
            gid: 0,
            rdev: 0,
        },
    );
    add(b"caf\xe9", w644(b"latin-1 name"));
    assert_eq!(keys(&c.entries), keys(&want));
    assert_eq!(c.entries, want);
    assert_eq!(keys(&c.unchanged), ["deep", "deep/er", "touched.txt"]);
    assert_eq!(
        c.skipped,
        vec![(b"app.sock".to_vec(), "socket".to_string())]
    );

    // Nothing changed on the head since the lease: clean, nothing to do. A head
    // that rewrote the copied-up file wins over that noise: it is dropped.
    let files = FsFiles {
        lease: lease.clone(),
        head: lease.clone(),
        upper: u.clone(),
        userxattr: false,
    };
    let plan = plan_gate(&c, &[], &files, &MergeOptions::default()).unwrap();
    assert!(!plan.is_conflict() && plan.actions.is_empty());
    assert_eq!(plan.index.len(), c.entries.len());
    let head = [HeadChange::from_change(b"touched.txt", &w644(b"other"))];
    let plan = plan_gate(&c, &head, &files, &MergeOptions::default()).unwrap();
    assert!(!plan.is_conflict(), "{:?}", plan.reports);
    assert_eq!(
        plan.actions,
        vec![Action::Remove {
            path: b"touched.txt".to_vec()
        }]
    );

    // Seal: private xattrs go, opaque markers stay, the socket goes.
    seal_layer(&u).unwrap();
    let left = trusted_overlay_xattrs(&u);
    assert_eq!(
        left,
        vec![
            (PathBuf::from("f2d"), "trusted.overlay.opaque".to_string()),
            (PathBuf::from("tree"), "trusted.overlay.opaque".to_string()),
        ]
    );
    assert!(!u.join("app.sock").exists());

    // The sealed upper is now a lower layer: the new head's view shows the session's writes.
    let head_view = LayerView::new(vec![u.clone(), l.clone()]);
    assert_eq!(head_view.lookup(b"gone.txt").unwrap(), None);
    assert_eq!(head_view.lookup(b"tree/a").unwrap(), None);
    assert_eq!(
        head_view.list_dir(b"tree").unwrap(),
        vec![b"fresh".to_vec()]
    );
    assert_eq!(
        head_view.lookup(b"mod.txt").unwrap().unwrap().layer_index,
        0
    );
    assert_eq!(
        head_view
            .lookup(b"deep/er/existing")
            .unwrap()
            .unwrap()
            .layer_index,
        1
    );
    assert_eq!(head_view.lookup(b"dir").unwrap().unwrap().mode, 0o700);

    // And a session on that head, changing nothing, captures nothing.
    let (u2, w2) = (t.path().join("u2"), t.path().join("w2"));
    std::fs::create_dir(&u2).unwrap();
    std::fs::create_dir(&w2).unwrap();
    let data = format!(
        "lowerdir={}:{},upperdir={},workdir={},index=off,redirect_dir=off,metacopy=off",
        u.display(),
        l.display(),
        u2.display(),
        w2.display()
    );
    let ov = Overlay::mount(&m, &data);
    assert_eq!(std::fs::read(m.join("mod.txt")).unwrap(), b"modified");
    assert!(!m.join("tree/a").exists());
    ov.unmount();
    let c2 = capture(&u2, &head_view).unwrap();
    assert_eq!(c2, Changeset::default());
}

/// On real overlay mounts: the session emptied `d` (empty in the lease) and `e`
/// (`rm -rf`, `mkdir`, a file created and removed again), the head deleted both.
/// The opaque directories are expanded, judged as copy-up parents whose deletions
/// below agree with the head's, and dropped from the upper: the published stack
/// shows the head's deletions.
#[test]
fn emptied_directories_yield_to_head_deletions_on_a_real_overlay() {
    if !have_root("emptied_directories_yield_to_head_deletions_on_a_real_overlay") {
        return;
    }
    let t = tmp();
    let dir = |n: &str| {
        let p = t.path().join(n);
        std::fs::create_dir(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    };
    let (l, h, hw, u, w, s, m) = (
        dir("l"),
        dir("h"),
        dir("hw"),
        dir("u"),
        dir("w"),
        dir("scratch"),
        dir("m"),
    );
    for d in ["d", "e", "keep"] {
        std::fs::create_dir(l.join(d)).unwrap();
        std::fs::set_permissions(l.join(d), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    put(&l, "e/x", b"x", 0o644);
    put(&l, "keep/k", b"k", 0o644);
    let opts = |lower: &str, upper: &Path, work: &Path| {
        format!(
            "lowerdir={lower},upperdir={},workdir={},index=off,redirect_dir=off,metacopy=off",
            upper.display(),
            work.display()
        )
    };
    let lease_dirs = l.display().to_string();

    // The head: rm -rf d e.
    let ov = Overlay::mount(&m, &opts(&lease_dirs, &h, &hw));
    std::fs::remove_dir_all(m.join("d")).unwrap();
    std::fs::remove_dir_all(m.join("e")).unwrap();
    ov.unmount();
    let lease = LayerView::new(vec![l.clone()]);
    let head_cs = capture(&h, &lease).unwrap();
    assert_eq!(keys(&head_cs.entries), ["d", "e"]);
    let head: Vec<HeadChange> = head_cs
        .paths()
        .map(|p| head_cs.head_change(p).unwrap())
        .collect();
    seal_layer(&h).unwrap();

    // The session: rm -rf d e; mkdir d e; a file made and removed in each.
    let ov = Overlay::mount(&m, &opts(&lease_dirs, &u, &w));
    for d in ["d", "e"] {
        std::fs::remove_dir_all(m.join(d)).unwrap();
        std::fs::create_dir(m.join(d)).unwrap();
        std::fs::set_permissions(m.join(d), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::symlink("t0", m.join(d).join("y")).unwrap();
        std::fs::remove_file(m.join(d).join("y")).unwrap();
    }
    ov.unmount();
    let first = capture(&u, &lease).unwrap();
    for d in [&b"d"[..], b"e"] {
        assert!(
            matches!(first.entries[d], Change::Mkdir { opaque: true, .. }),
            "{:?}",
            first.entries
        );
    }
    let expand = opaque_dirs_to_expand(&first, &head);
    assert_eq!(expand, BTreeSet::from([b"d".to_vec(), b"e".to_vec()]));
    let options = CaptureOptions {
        expand_opaque: expand,
        ..Default::default()
    };
    let cs = capture_with(&u, &lease, &options).unwrap();
    assert_eq!(keys(&cs.entries), ["e/x"], "the lease's content, deleted");
    assert_eq!(keys(&cs.unchanged), ["d", "e"], "copy-up parents");
    prepare_upper(&u, &cs, false).unwrap();
    seal_layer(&u).unwrap();

    let files = FsFiles {
        lease: lease.clone(),
        head: LayerView::new(vec![h.clone(), l.clone()]),
        upper: u.clone(),
        userxattr: false,
    };
    let plan = plan_gate(&cs, &head, &files, &MergeOptions::default()).unwrap();
    assert!(!plan.is_conflict(), "{:#?}", plan.reports);
    assert_eq!(
        plan.actions,
        [
            Action::Remove {
                path: b"d".to_vec()
            },
            Action::Remove {
                path: b"e".to_vec()
            }
        ]
    );
    assert!(plan.index.is_empty(), "{:?}", plan.index);
    apply_plan(&u, &plan, &s).unwrap();

    // The published stack, read by the kernel: the head's deletions stand.
    let ov = Overlay::mount(
        &m,
        &format!("lowerdir={}:{}:{}", u.display(), h.display(), l.display()),
    );
    assert!(!m.join("d").exists() && !m.join("e").exists());
    assert_eq!(std::fs::read(m.join("keep/k")).unwrap(), b"k");
    ov.unmount();
}

// ---- LayerView against the kernel: random lower stacks, compared path by path ----

const UNIVERSE: [&str; 14] = [
    "a", "b", "a/a", "a/b", "b/a", "b/b", "a/a/a", "a/a/b", "a/b/a", "a/b/b", "b/a/a", "b/a/b",
    "b/b/a", "b/b/b",
];

#[derive(Debug, Clone)]
enum Node {
    Absent,
    File(u8, u32),
    Dir(u32, bool),
    Whiteout,
    Symlink(u8),
}

fn node() -> impl Strategy<Value = Node> {
    prop_oneof![
        3 => Just(Node::Absent),
        2 => (0u8..2, prop::sample::select(vec![0o644u32, 0o600])).prop_map(|(c, m)| Node::File(c, m)),
        3 => (prop::sample::select(vec![0o755u32, 0o700]), prop::bool::weighted(0.3)).prop_map(|(m, o)| Node::Dir(m, o)),
        1 => Just(Node::Whiteout),
        1 => (0u8..2).prop_map(Node::Symlink),
    ]
}

fn build_layer(root: &Path, nodes: &[Node]) {
    std::fs::create_dir(root).unwrap();
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut dirs: BTreeSet<&str> = BTreeSet::new();
    for (rel, node) in UNIVERSE.iter().zip(nodes) {
        if let Some((parent, _)) = rel.rsplit_once('/') {
            if !dirs.contains(parent) {
                continue;
            }
        }
        let path = root.join(rel);
        match node {
            Node::Absent => {}
            Node::File(c, mode) => put(root, rel, &vec![b'x'; usize::from(*c) + 1], *mode),
            Node::Dir(mode, opaque) => {
                std::fs::create_dir(&path).unwrap();
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(*mode)).unwrap();
                if *opaque {
                    xattr::set(&path, "trusted.overlay.opaque", b"y").unwrap();
                }
                dirs.insert(rel);
            }
            Node::Whiteout => mknod(&path, SFlag::S_IFCHR, Mode::empty(), makedev(0, 0)).unwrap(),
            Node::Symlink(t) => std::os::unix::fs::symlink(format!("target{t}"), &path).unwrap(),
        }
    }
}

#[test]
fn layer_view_matches_kernel_overlay() {
    if !have_root("layer_view_matches_kernel_overlay") {
        return;
    }
    let mut runner = TestRunner::new(Config {
        cases: 256,
        failure_persistence: None,
        ..Config::default()
    });
    let stack = prop::collection::vec(prop::collection::vec(node(), UNIVERSE.len()), 3);
    runner
        .run(&stack, |layers| {
            let t = tmp();
            let roots: Vec<PathBuf> = (0..layers.len())
                .map(|i| t.path().join(format!("l{i}")))
                .collect();
            for (root, nodes) in roots.iter().zip(&layers) {
                build_layer(root, nodes);
            }
            let m = t.path().join("m");
            let lowers: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
            let ov = Overlay::mount(
                &m,
                &format!(
                    "lowerdir={},redirect_dir=off,metacopy=off",
                    lowers.join(":")
                ),
            );
            let view = LayerView::new(roots.clone());
            let mut all: Vec<&str> = vec![""];
            all.extend(UNIVERSE);
            for rel in all {
                let got = view.lookup(rel.as_bytes()).unwrap();
                let kernel = std::fs::symlink_metadata(m.join(rel)).ok();
                match (&got, &kernel) {
                    (None, None) => {}
                    (Some(e), Some(md)) => {
                        let kind = if md.is_dir() {
                            FileKind::Dir
                        } else if md.file_type().is_symlink() {
                            FileKind::Symlink
                        } else {
                            FileKind::Regular
                        };
                        prop_assert_eq!(e.kind, kind, "kind of {:?}", rel);
                        prop_assert_eq!(e.mode, md.mode() & 0o7777, "mode of {:?}", rel);
                        prop_assert_eq!((e.uid, e.gid), (md.uid(), md.gid()));
                        if kind != FileKind::Dir {
                            prop_assert_eq!(e.size, md.size(), "size of {:?}", rel);
                        } else {
                            // The kernel's readdir of a directory that is not merged (held by
                            // one layer only) passes the real directory through, whiteouts
                            // included, although lookup hides them. The view follows lookup,
                            // so keep only the names the kernel can look up.
                            let mut names: Vec<Vec<u8>> = std::fs::read_dir(m.join(rel))
                                .unwrap()
                                .map(|d| d.unwrap())
                                .filter(|d| std::fs::symlink_metadata(d.path()).is_ok())
                                .map(|d| d.file_name().as_bytes().to_vec())
                                .collect();
                            names.sort();
                            prop_assert_eq!(
                                view.list_dir(rel.as_bytes()).unwrap(),
                                names,
                                "list of {:?}",
                                rel
                            );
                        }
                    }
                    _ => prop_assert!(
                        false,
                        "{:?}: view {:?}, kernel {:?}",
                        rel,
                        got,
                        kernel.map(|m| m.mode())
                    ),
                }
            }
            ov.unmount();
            Ok(())
        })
        .unwrap();
}
