//! Capture fidelity against the kernel: one fixture per kind of change overlayfs
//! can leave in an upper (issue 4). Each fixture script (`tests/fixtures/make_*.sh`)
//! builds a lower and then mutates it through a real overlay mount
//! (`index=off,redirect_dir=off,metacopy=off`, as LayerStack mounts sessions); the
//! test unmounts, asserts the captured changeset, publishes the upper as a layer
//! (policy edits, seal, gate against an unchanged head, rename) and asserts the
//! published result through a second, read-only overlay mount of layer + lower.
//!
//! Needs root (mount, mknod, trusted.* xattrs, chown); skipped without it, except
//! under `CI=true`, where it fails.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use layerstack_publisher::{
    apply_plan, capture_with, plan_gate, prepare_upper, seal_layer, CaptureOptions, Change,
    Changeset, ExclusionRules, FileKind, FsFiles, GateFiles, HeadChange, LayerView, MergeOptions,
    PathStatus, RootMeta, Side,
};

mod common;
use common::{have_root, Overlay};

struct Fx {
    _t: tempfile::TempDir,
    name: &'static str,
    l: PathBuf,
    u: PathBuf,
    w: PathBuf,
    m: PathBuf,
    layer: PathBuf,
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("make_{name}.sh"))
}

fn run_script(name: &str, phase: &str, dir: &Path) {
    let out = Command::new("bash")
        .arg(script(name))
        .arg(phase)
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "make_{name}.sh {phase}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Fx {
    /// A fixture with its lower built (`pre_upper` may seed the upper before mounting).
    fn new(name: &'static str) -> Fx {
        let t = tempfile::Builder::new()
            .prefix("layerstack-fx-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let dir = |n: &str| {
            let p = t.path().join(n);
            std::fs::create_dir(&p).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
            p
        };
        let (l, u, w, m) = (dir("l"), dir("u"), dir("w"), dir("m"));
        let layer = t.path().join("L");
        run_script(name, "lower", &l);
        Fx {
            _t: t,
            name,
            l,
            u,
            w,
            m,
            layer,
        }
    }

    /// Mounts the session overlay, runs the script's mutate phase and `extra`
    /// inside it, unmounts.
    fn mutate(&self, extra: impl FnOnce(&Path)) {
        let data = format!(
            "lowerdir={},upperdir={},workdir={},index=off,redirect_dir=off,metacopy=off",
            self.l.display(),
            self.u.display(),
            self.w.display()
        );
        let overlay = Overlay::mount(&self.m, &data);
        run_script(self.name, "mutate", &self.m);
        extra(&self.m);
        overlay.unmount();
    }

    fn lease(&self) -> LayerView {
        LayerView::new(vec![self.l.clone()])
    }

    fn capture(&self) -> Changeset {
        capture_with(&self.u, &self.lease(), &CaptureOptions::default()).unwrap()
    }

    /// Publishes the upper as the daemon does with an unchanged head: policy
    /// edits, seal, gate, apply, rename into a layer directory.
    fn publish(&self, cs: &Changeset) {
        prepare_upper(&self.u, cs, false).unwrap();
        seal_layer(&self.u).unwrap();
        let files = FsFiles {
            lease: self.lease(),
            head: self.lease(),
            upper: self.u.clone(),
            userxattr: false,
        };
        let plan = plan_gate(cs, &[], &files, &MergeOptions::default()).unwrap();
        assert!(!plan.is_conflict(), "{:?}", plan.reports);
        apply_plan(&self.u, &plan, &self.scratch()).unwrap();
        std::fs::rename(&self.u, &self.layer).unwrap();
    }

    /// A layer published on the branch head since the lease: `files` (mode 0644,
    /// directories 0755) over the lower. Returns the head's view and path index.
    fn head_layer(&self, files: &[(&str, &[u8])]) -> (LayerView, Vec<HeadChange>) {
        let h = self._t.path().join("H");
        std::fs::create_dir(&h).unwrap();
        std::fs::set_permissions(&h, std::fs::Permissions::from_mode(0o755)).unwrap();
        for (rel, content) in files {
            let p = h.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::set_permissions(p.parent().unwrap(), std::fs::Permissions::from_mode(0o755))
                .unwrap();
            std::fs::write(&p, content).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        let cs = capture_with(&h, &self.lease(), &CaptureOptions::default()).unwrap();
        let head = cs.paths().filter_map(|p| cs.head_change(p)).collect();
        (LayerView::new(vec![h, self.l.clone()]), head)
    }

    /// A scratch directory on the upper's filesystem (the store's `staging/`).
    fn scratch(&self) -> PathBuf {
        let s = self._t.path().join("staging");
        std::fs::create_dir_all(&s).unwrap();
        s
    }

    /// The published branch head as the kernel shows it: layer over lower.
    fn published(&self) -> (PathBuf, Overlay) {
        let v = self._t.path().join("v");
        let overlay = Overlay::mount(
            &v,
            &format!("lowerdir={}:{}", self.layer.display(), self.l.display()),
        );
        (v, overlay)
    }
}

fn keys(m: &BTreeMap<Vec<u8>, Change>) -> Vec<String> {
    m.keys()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect()
}

fn lstat(p: &Path) -> Option<std::fs::Metadata> {
    std::fs::symlink_metadata(p).ok()
}

fn digest(b: &[u8]) -> [u8; 32] {
    *blake3::hash(b).as_bytes()
}

#[test]
fn whiteouts_are_deletions_never_hardlinks() {
    if !have_root("whiteouts_are_deletions_never_hardlinks") {
        return;
    }
    let fx = Fx::new("whiteouts");
    fx.mutate(|_| {});
    // The kernel shares one inode between whiteouts (Linux 5.8+ when the upper fs
    // supports it): note it, capture must not care.
    let nlink = lstat(&fx.u.join("a")).unwrap().nlink();
    eprintln!("whiteout st_nlink = {nlink}");
    let c = fx.capture();
    assert_eq!(keys(&c.entries), ["a", "b", "c", "d", "new-empty"]);
    for p in ["a", "b", "c", "d"] {
        assert_eq!(c.entries[p.as_bytes()], Change::Delete, "{p}");
    }
    assert!(
        matches!(
            c.entries[b"new-empty".as_slice()],
            Change::Write { size: 0, .. }
        ),
        "an empty file is a file"
    );
    assert!(
        c.hardlinks.is_empty(),
        "whiteouts are not hardlinks: {:?}",
        c.hardlinks
    );
    fx.publish(&c);
    let (v, _m) = fx.published();
    for gone in ["a", "b", "c", "d", "d/x"] {
        assert!(lstat(&v.join(gone)).is_none(), "{gone} still visible");
    }
    assert!(lstat(&v.join("empty")).unwrap().is_file());
    assert_eq!(lstat(&v.join("new-empty")).unwrap().len(), 0);
}

#[test]
fn opaque_dirs_and_overlay_xattr_namespaces() {
    if !have_root("opaque_dirs_and_overlay_xattr_namespaces") {
        return;
    }
    let fx = Fx::new("opaque");
    // A directory marked opaque with the value "x" (Linux 6.7+: "holds xattr
    // whiteouts"), seeded in the upper: not opaque.
    std::fs::create_dir(fx.u.join("e")).unwrap();
    std::fs::set_permissions(fx.u.join("e"), std::fs::Permissions::from_mode(0o755)).unwrap();
    xattr::set(fx.u.join("e"), "trusted.overlay.opaque", b"x").unwrap();
    fx.mutate(|m| {
        // Through the mount, trusted.overlay.* names are escaped by the kernel
        // (stored as trusted.overlay.overlay.*, Linux 6.7+); user.overlay.* on a
        // trusted mount is plain data.
        let f = m.join("d/new");
        if let Err(e) = xattr::set(&f, "trusted.overlay.nested", b"1") {
            eprintln!("kernel refuses escaped overlay xattrs ({e}); older than 6.7?");
        }
        xattr::set(&f, "user.overlay.foreign", b"2").unwrap();
        xattr::set(&f, "user.keep", b"3").unwrap();
        // The other namespace's opaque marker: data here, not opacity.
        xattr::set(m.join("uo"), "user.overlay.opaque", b"y").unwrap();
    });
    let raw: Vec<String> = xattr::list(fx.u.join("d/new"))
        .unwrap()
        .map(|n| n.to_string_lossy().into_owned())
        .collect();
    eprintln!("upper xattrs of d/new: {raw:?}");
    assert_eq!(
        xattr::get(fx.u.join("d"), "trusted.overlay.opaque")
            .unwrap()
            .as_deref(),
        Some(&b"y"[..])
    );
    let c = fx.capture();
    assert_eq!(keys(&c.entries), ["d", "d/new", "uo"]);
    assert!(matches!(
        c.entries[b"d".as_slice()],
        Change::Mkdir { opaque: true, .. }
    ));
    assert!(
        matches!(c.entries[b"uo".as_slice()], Change::Meta { .. }),
        "user.overlay.opaque on a trusted mount is an xattr change"
    );
    assert!(c.xattrs.contains_key(b"uo".as_slice()));
    let files = FsFiles {
        lease: fx.lease(),
        head: fx.lease(),
        upper: fx.u.clone(),
        userxattr: false,
    };
    let st = files.stat(Side::Ours, b"uo").unwrap().unwrap();
    assert_eq!(
        st.xattrs,
        vec![(b"user.overlay.opaque".to_vec(), b"y".to_vec())],
        "the gate sees it as data too"
    );
    assert!(
        c.xattrs.contains_key(b"d/new".as_slice()),
        "user and escaped xattrs are data"
    );
    assert!(
        c.unchanged.contains_key(b"e".as_slice()),
        "opaque=x is not opaque"
    );
    fx.publish(&c);
    // Escaped and foreign-namespace names survive sealing.
    let kept: Vec<String> = xattr::list(fx.layer.join("d/new"))
        .unwrap()
        .map(|n| n.to_string_lossy().into_owned())
        .collect();
    assert!(
        kept.contains(&"user.overlay.foreign".to_string()),
        "{kept:?}"
    );
    assert!(kept.contains(&"user.keep".to_string()), "{kept:?}");
    if raw.contains(&"trusted.overlay.overlay.nested".to_string()) {
        assert!(
            kept.contains(&"trusted.overlay.overlay.nested".to_string()),
            "{kept:?}"
        );
    }
    let (v, _m) = fx.published();
    assert!(
        lstat(&v.join("d/x")).is_none(),
        "opaque hides lower children"
    );
    assert!(lstat(&v.join("d/sub/y")).is_none(), "and grandchildren");
    assert_eq!(std::fs::read(v.join("d/new")).unwrap(), b"new\n");
    assert_eq!(
        std::fs::read(v.join("e/z")).unwrap(),
        b"z\n",
        "opaque=x hides nothing"
    );
    assert_eq!(std::fs::read(v.join("uo/w")).unwrap(), b"w\n", "not opaque");
    assert_eq!(
        xattr::get(v.join("uo"), "user.overlay.opaque")
            .unwrap()
            .as_deref(),
        Some(&b"y"[..]),
        "published as data"
    );
}

#[test]
fn overlay_private_xattrs_are_stripped() {
    if !have_root("overlay_private_xattrs_are_stripped") {
        return;
    }
    let fx = Fx::new("private_xattrs");
    fx.mutate(|_| {});
    let private = |root: &Path| -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(p) = stack.pop() {
            for n in xattr::list(&p).unwrap() {
                let n = n.to_string_lossy().into_owned();
                if n.starts_with("trusted.overlay.")
                    && n != "trusted.overlay.opaque"
                    && !n.starts_with("trusted.overlay.overlay.")
                {
                    out.push((p.strip_prefix(root).unwrap().display().to_string(), n));
                }
            }
            if lstat(&p).unwrap().is_dir() {
                for e in std::fs::read_dir(&p).unwrap() {
                    stack.push(e.unwrap().path());
                }
            }
        }
        out.sort();
        out
    };
    let before = private(&fx.u);
    eprintln!("private xattrs left by the kernel: {before:?}");
    let c = fx.capture();
    assert_eq!(
        keys(&c.entries),
        ["dir/deeper/h", "dir/deeper/h2", "dir/g", "dir/new", "f"]
    );
    assert_eq!(c.entries[b"dir/deeper/h".as_slice()], Change::Delete);
    fx.publish(&c);
    assert_eq!(private(&fx.layer), Vec::<(String, String)>::new());
}

#[test]
fn copy_up_noise_is_not_a_change_but_touch_is() {
    if !have_root("copy_up_noise_is_not_a_change_but_touch_is") {
        return;
    }
    let fx = Fx::new("noise");
    fx.mutate(|_| {});
    let c = fx.capture();
    assert_eq!(keys(&c.entries), ["t"], "only touch is a change");
    assert!(matches!(
        c.entries[b"t".as_slice()],
        Change::Write { size: 2, .. }
    ));
    for noise in ["f", "g", "h"] {
        assert!(
            c.unchanged.contains_key(noise.as_bytes()),
            "{noise} is noise: {:?}",
            keys(&c.unchanged)
        );
    }
    fx.publish(&c);
    let (v, _m) = fx.published();
    assert_ne!(
        lstat(&v.join("t")).unwrap().mtime(),
        1_000_000_000,
        "touch published"
    );
    assert_eq!(lstat(&v.join("f")).unwrap().mtime(), 1_000_000_000);
}

/// `security.capability` v2 for CAP_NET_BIND_SERVICE, effective (linux/capability.h).
fn capability() -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&(0x0200_0000u32 | 1).to_le_bytes()); // VFS_CAP_REVISION_2 | EFFECTIVE
    v.extend_from_slice(&(1u32 << 10).to_le_bytes()); // permitted[0]
    v.extend_from_slice(&0u32.to_le_bytes()); // inheritable[0]
    v.extend_from_slice(&0u32.to_le_bytes()); // permitted[1]
    v.extend_from_slice(&0u32.to_le_bytes()); // inheritable[1]
    v
}

#[test]
fn kernel_dropped_setuid_and_capabilities_stay_dropped() {
    if !have_root("kernel_dropped_setuid_and_capabilities_stay_dropped") {
        return;
    }
    let fx = Fx::new("kernel_meta");
    for f in ["chowned", "written"] {
        xattr::set(fx.l.join(f), "security.capability", &capability()).unwrap();
    }
    xattr::set(fx.l.join("userx"), "user.k", b"v").unwrap();
    fx.mutate(|_| {});
    let c = fx.capture();
    assert_eq!(keys(&c.entries), ["chowned", "userx", "written"]);
    let Change::Write { mode, uid, .. } = c.entries[b"chowned".as_slice()] else {
        panic!()
    };
    assert_eq!((mode, uid), (0o755, 1000), "chown cleared setuid");
    assert!(!c.xattrs.contains_key(b"chowned".as_slice()));
    assert!(
        !c.xattrs.contains_key(b"written".as_slice()),
        "write cleared the capability"
    );
    assert!(c.xattrs.contains_key(b"userx".as_slice()));
    fx.publish(&c);
    let (v, _m) = fx.published();
    for f in ["chowned", "written"] {
        assert_eq!(
            xattr::get(v.join(f), "security.capability").unwrap(),
            None,
            "{f}"
        );
    }
    assert_eq!(lstat(&v.join("chowned")).unwrap().mode() & 0o7777, 0o755);
    assert_eq!(
        xattr::get(v.join("userx"), "user.k").unwrap().as_deref(),
        Some(&b"v"[..])
    );
}

#[test]
fn hardlinks_made_in_the_session_stay_linked() {
    if !have_root("hardlinks_made_in_the_session_stay_linked") {
        return;
    }
    let fx = Fx::new("hardlinks");
    fx.mutate(|_| {});
    let c = fx.capture();
    assert_eq!(keys(&c.entries), ["n1", "n2", "p1"]);
    assert_eq!(c.hardlinks.len(), 2, "{:?}", c.hardlinks);
    assert_eq!(c.hardlinks[b"n1".as_slice()], c.hardlinks[b"n2".as_slice()]);
    fx.publish(&c);
    let ino = |p: &str| lstat(&fx.layer.join(p)).unwrap().ino();
    assert_eq!(ino("n1"), ino("n2"), "still one inode in the layer");
    assert!(
        lstat(&fx.layer.join("p2")).is_none(),
        "p2 was never copied up"
    );
    let (v, _m) = fx.published();
    assert_eq!(std::fs::read(v.join("p1")).unwrap(), b"pair\nmore\n");
    assert_eq!(
        std::fs::read(v.join("p2")).unwrap(),
        b"pair\n",
        "copy-up broke the link"
    );
}

#[test]
fn symlinks_are_verbatim_and_never_written_through() {
    if !have_root("symlinks_are_verbatim_and_never_written_through") {
        return;
    }
    let fx = Fx::new("symlinks");
    fx.mutate(|_| {});
    let c = fx.capture();
    let link = |t: &str| Change::Symlink {
        target: t.as_bytes().to_vec(),
        uid: 0,
        gid: 0,
    };
    assert_eq!(c.entries[b"abs".as_slice()], link("/etc/passwd"));
    assert_eq!(c.entries[b"dangling".as_slice()], link("no/such/thing"));
    assert_eq!(
        c.entries[b"escape".as_slice()],
        link("../../../../../../escape")
    );
    assert!(matches!(
        c.entries[b"s".as_slice()],
        Change::Mkdir { opaque: true, .. }
    ));
    // Also expand the directory that replaced the link (as the gate would with
    // head changes there): every edit goes through descriptors, never the link.
    let options = CaptureOptions {
        expand_opaque: [b"s".to_vec()].into(),
        ..Default::default()
    };
    let c = capture_with(&fx.u, &fx.lease(), &options).unwrap();
    assert_eq!(c.edits.unopaque, vec![b"s".to_vec()]);
    assert!(
        c.edits.whiteouts.is_empty(),
        "the lease had no directory at s"
    );
    fx.publish(&c);
    let outside: Vec<_> = std::fs::read_dir(fx.l.join("outside"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        outside,
        vec![std::ffi::OsString::from("f")],
        "nothing written through s"
    );
    assert_eq!(std::fs::read(fx.l.join("outside/f")).unwrap(), b"o\n");
    let (v, _m) = fx.published();
    assert!(lstat(&v.join("s")).unwrap().is_dir());
    assert_eq!(std::fs::read(v.join("s/f")).unwrap(), b"inside\n");
    assert_eq!(
        std::fs::read_link(v.join("escape")).unwrap(),
        Path::new("../../../../../../escape")
    );
}

#[test]
fn specials_are_never_opened_and_sockets_never_published() {
    if !have_root("specials_are_never_opened_and_sockets_never_published") {
        return;
    }
    let fx = Fx::new("specials");
    fx.mutate(|m| {
        drop(std::os::unix::net::UnixListener::bind(m.join("new.sock")).unwrap());
        drop(std::os::unix::net::UnixListener::bind(m.join("victim")).unwrap());
    });
    let c = fx.capture();
    assert_eq!(keys(&c.entries), ["blk", "chr", "pipe", "victim"]);
    assert!(matches!(
        c.entries[b"pipe".as_slice()],
        Change::Special {
            kind: FileKind::Fifo,
            mode: 0o640,
            ..
        }
    ));
    assert!(matches!(
        c.entries[b"chr".as_slice()],
        Change::Special {
            kind: FileKind::CharDev,
            ..
        }
    ));
    assert!(matches!(
        c.entries[b"blk".as_slice()],
        Change::Special {
            kind: FileKind::BlockDev,
            ..
        }
    ));
    assert_eq!(
        c.entries[b"victim".as_slice()],
        Change::Delete,
        "the socket hid a lower file"
    );
    assert_eq!(
        c.skipped,
        vec![
            (b"new.sock".to_vec(), "socket".to_string()),
            (b"victim".to_vec(), "socket".to_string())
        ]
    );
    fx.publish(&c);
    let (v, _m) = fx.published();
    assert!(lstat(&v.join("pipe")).unwrap().file_type().is_fifo());
    let chr = lstat(&v.join("chr")).unwrap();
    assert!(chr.file_type().is_char_device());
    assert_eq!(chr.rdev(), nix::sys::stat::makedev(1, 3));
    assert!(lstat(&v.join("blk")).unwrap().file_type().is_block_device());
    assert!(lstat(&v.join("new.sock")).is_none());
    assert!(
        lstat(&v.join("victim")).is_none(),
        "the lower file stays deleted"
    );
}

#[test]
fn sparse_files_keep_their_holes() {
    if !have_root("sparse_files_keep_their_holes") {
        return;
    }
    let fx = Fx::new("sparse");
    fx.mutate(|_| {});
    let c = fx.capture();
    assert!(matches!(
        c.entries[b"sparse".as_slice()],
        Change::Write {
            size: 104_857_600,
            ..
        }
    ));
    fx.publish(&c);
    let md = lstat(&fx.layer.join("sparse")).unwrap();
    assert_eq!(md.len(), 100 * 1024 * 1024);
    assert!(
        md.blocks() * 512 < 1024 * 1024,
        "{} bytes allocated",
        md.blocks() * 512
    );
}

#[test]
fn long_odd_and_wh_names_are_byte_exact() {
    if !have_root("long_odd_and_wh_names_are_byte_exact") {
        return;
    }
    let fx = Fx::new("names");
    let comp = "p".repeat(200);
    fx.mutate(|m| {
        // ~8 KiB deep, twice PATH_MAX, made with fd-relative calls.
        let mut fd = nix::dir::Dir::open(
            m,
            nix::fcntl::OFlag::O_DIRECTORY,
            nix::sys::stat::Mode::empty(),
        )
        .unwrap();
        for _ in 0..40 {
            use std::os::fd::AsRawFd;
            nix::sys::stat::mkdirat(
                Some(fd.as_raw_fd()),
                comp.as_str(),
                nix::sys::stat::Mode::from_bits_truncate(0o755),
            )
            .unwrap();
            fd = nix::dir::Dir::openat(
                Some(fd.as_raw_fd()),
                comp.as_str(),
                nix::fcntl::OFlag::O_DIRECTORY,
                nix::sys::stat::Mode::empty(),
            )
            .unwrap();
        }
        use std::os::fd::AsRawFd;
        std::fs::write(
            format!("/proc/self/fd/{}/deep.txt", fd.as_raw_fd()),
            b"deep",
        )
        .unwrap();
    });
    let c = fx.capture();
    let long = "n".repeat(255);
    assert!(c.entries.contains_key(long.as_bytes()));
    assert!(matches!(
        c.entries[b"caf\xe9".as_slice()],
        Change::Write { .. }
    ));
    assert!(matches!(
        c.entries[b"\xff\xfe".as_slice()],
        Change::Write { .. }
    ));
    assert!(matches!(
        c.entries[b".wh.user-file".as_slice()],
        Change::Write { .. }
    ));
    assert!(matches!(
        c.entries[b".wh..wh..opq".as_slice()],
        Change::Mkdir { opaque: false, .. }
    ));
    let deep: Vec<&Vec<u8>> = c
        .entries
        .keys()
        .filter(|k| k.ends_with(b"/deep.txt"))
        .collect();
    assert_eq!(deep.len(), 1);
    assert!(deep[0].len() > 4096);
    assert_eq!(
        c.entries[deep[0]],
        Change::Write {
            mode: 0o644,
            uid: 0,
            gid: 0,
            size: 4,
            digest: digest(b"deep")
        }
    );
    fx.publish(&c);
    let (v, _m) = fx.published();
    assert_eq!(std::fs::read(v.join(&long)).unwrap(), b"long\n");
    assert_eq!(
        std::fs::read(v.join(OsStr::from_bytes(b"caf\xe9"))).unwrap(),
        b"latin1\n"
    );
    assert_eq!(
        std::fs::read(v.join(OsStr::from_bytes(b"\xff\xfe"))).unwrap(),
        b"bytes\n"
    );
    assert_eq!(std::fs::read(v.join(".wh.user-file")).unwrap(), b"data\n");
    assert!(lstat(&v.join(".wh..wh..opq")).unwrap().is_dir());
}

#[test]
fn type_changes_between_file_directory_and_symlink() {
    if !have_root("type_changes_between_file_directory_and_symlink") {
        return;
    }
    let fx = Fx::new("type_changes");
    fx.mutate(|_| {});
    let c = fx.capture();
    assert!(matches!(
        c.entries[b"f2d".as_slice()],
        Change::Mkdir { opaque: true, .. }
    ));
    assert!(matches!(c.entries[b"d2f".as_slice()], Change::Write { .. }));
    assert!(matches!(
        c.entries[b"f2l".as_slice()],
        Change::Symlink { .. }
    ));
    assert!(matches!(c.entries[b"l2f".as_slice()], Change::Write { .. }));
    assert!(matches!(
        c.entries[b"d2l".as_slice()],
        Change::Symlink { .. }
    ));
    fx.publish(&c);
    let (v, _m) = fx.published();
    assert_eq!(std::fs::read(v.join("f2d/x")).unwrap(), b"in\n");
    assert_eq!(std::fs::read(v.join("d2f")).unwrap(), b"now-a-file\n");
    assert!(lstat(&v.join("d2f/x")).is_none());
    assert!(lstat(&v.join("f2l")).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::read(v.join("l2f")).unwrap(), b"real\n");
    assert!(lstat(&v.join("d2l")).unwrap().file_type().is_symlink());
    assert!(lstat(&v.join("d2l/y")).is_none());
}

#[test]
fn excluded_paths_and_their_whiteouts_are_not_published() {
    if !have_root("excluded_paths_and_their_whiteouts_are_not_published") {
        return;
    }
    // Reuses the opaque fixture: d is removed and recreated; exclude d/sub/** and e.
    let fx = Fx::new("opaque");
    fx.mutate(|m| {
        std::fs::remove_file(m.join("e/z")).unwrap();
        std::fs::write(m.join("keep"), b"k").unwrap();
    });
    let options = CaptureOptions {
        exclude: ExclusionRules::new(["/e/**", "/d/sub"]).unwrap(),
        ..Default::default()
    };
    let c = capture_with(&fx.u, &fx.lease(), &options).unwrap();
    assert_eq!(
        c.excluded,
        vec![(b"e/z".to_vec(), "/e/**".to_string())],
        "the whiteout e/z is excluded"
    );
    // d is opaque, and the policy may exclude below it: expanded, with no
    // whiteout for the excluded d/sub.
    assert_eq!(c.edits.unopaque, vec![b"d".to_vec()]);
    assert_eq!(c.edits.whiteouts, vec![b"d/x".to_vec()]);
    fx.publish(&c);
    let (v, _m) = fx.published();
    assert_eq!(
        std::fs::read(v.join("e/z")).unwrap(),
        b"z\n",
        "excluded deletion not published"
    );
    assert_eq!(
        std::fs::read(v.join("d/sub/y")).unwrap(),
        b"y\n",
        "excluded path below an opaque dir survives"
    );
    assert!(lstat(&v.join("d/x")).is_none());
    assert_eq!(std::fs::read(v.join("d/new")).unwrap(), b"new\n");
    assert_eq!(std::fs::read(v.join("keep")).unwrap(), b"k");
}

#[test]
fn root_directory_metadata_is_never_published() {
    if !have_root("root_directory_metadata_is_never_published") {
        return;
    }
    let fx = Fx::new("root_meta");
    xattr::set(&fx.l, "user.image", b"1").unwrap();
    // `setfattr -n user.note -v hi /` in the container. The merged root shows the
    // upper root's xattrs only (overlayfs: the root is always an upper directory),
    // so the upper differs from the lease's root in both names.
    fx.mutate(|m| {
        assert_eq!(xattr::get(m, "user.image").unwrap(), None);
        xattr::set(m, "user.note", b"hi").unwrap();
    });
    let md = lstat(&fx.u).unwrap();
    assert_eq!(
        (md.mode() & 0o7777, md.uid(), md.gid()),
        (0o700, 1000, 1000)
    );
    let c = fx.capture();
    assert_eq!(keys(&c.entries), ["g"]);
    assert_eq!(c.skipped.len(), 1, "{:?}", c.skipped);
    assert_eq!(c.skipped[0].0, b"");
    assert!(
        c.skipped[0].1.contains("0700 1000:1000")
            && c.skipped[0].1.contains("0755 0:0")
            && c.skipped[0]
                .1
                .contains("xattrs user.image, user.note differ"),
        "{}",
        c.skipped[0].1
    );
    assert_eq!(
        c.edits.root,
        Some(RootMeta {
            mode: 0o755,
            uid: 0,
            gid: 0,
            xattrs: vec![(b"user.image".to_vec(), b"1".to_vec())],
        })
    );
    // The outcome says so.
    let files = FsFiles {
        lease: fx.lease(),
        head: fx.lease(),
        upper: fx.u.clone(),
        userxattr: false,
    };
    let plan = plan_gate(&c, &[], &files, &MergeOptions::default()).unwrap();
    let root = plan.reports.iter().find(|r| r.path.is_empty()).unwrap();
    assert_eq!(root.status, PathStatus::Excluded);
    assert!(root.reason.ends_with("never published"), "{}", root.reason);
    fx.publish(&c);
    let md = lstat(&fx.layer).unwrap();
    assert_eq!(
        (md.mode() & 0o7777, md.uid(), md.gid()),
        (0o755, 0, 0),
        "the layer's root is the lease's"
    );
    assert_eq!(
        xattr::list(&fx.layer)
            .unwrap()
            .filter(|n| n.as_bytes().starts_with(b"user."))
            .collect::<Vec<_>>(),
        ["user.image"],
        "the layer's root xattrs are the lease's"
    );
    assert_eq!(
        xattr::get(&fx.layer, "user.image").unwrap().as_deref(),
        Some(&b"1"[..])
    );
    let (v, _m) = fx.published();
    let md = lstat(&v).unwrap();
    assert_eq!((md.mode() & 0o7777, md.uid(), md.gid()), (0o755, 0, 0));
    assert_eq!(std::fs::read(v.join("g")).unwrap(), b"new\n");
}

#[test]
fn excluded_links_do_not_block_a_merge_and_merges_use_no_upper_name() {
    if !have_root("excluded_links_do_not_block_a_merge_and_merges_use_no_upper_name") {
        return;
    }
    let fx = Fx::new("merge");
    // The name an older writer used for its temporary file of etc/conf.
    let hex: String = blake3::hash(b"conf").as_bytes()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let old_tmp = format!(".lsm-{hex}");
    fx.mutate(|m| std::fs::write(m.join("etc").join(&old_tmp), b"user data\n").unwrap());
    assert_eq!(lstat(&fx.u.join("etc/conf")).unwrap().nlink(), 2);
    let options = CaptureOptions {
        exclude: ExclusionRules::new(["/tmp/**"]).unwrap(),
        ..Default::default()
    };
    let c = capture_with(&fx.u, &fx.lease(), &options).unwrap();
    assert_eq!(
        c.excluded,
        vec![(b"tmp/backup".to_vec(), "/tmp/**".to_string())]
    );
    assert!(c.hardlinks.is_empty(), "{:?}", c.hardlinks);
    let (head, head_changes) = fx.head_layer(&[("etc/conf", b"1\n2\n3\n4\n5\nSIX\n")]);
    prepare_upper(&fx.u, &c, false).unwrap();
    seal_layer(&fx.u).unwrap();
    let files = FsFiles {
        lease: fx.lease(),
        head,
        upper: fx.u.clone(),
        userxattr: false,
    };
    let plan = plan_gate(&c, &head_changes, &files, &MergeOptions::default()).unwrap();
    assert!(!plan.is_conflict(), "{:#?}", plan.reports);
    let conf = plan.reports.iter().find(|r| r.path == b"etc/conf").unwrap();
    assert_eq!(conf.status, PathStatus::Merged);
    let scratch = fx.scratch();
    apply_plan(&fx.u, &plan, &scratch).unwrap();
    assert_eq!(
        std::fs::read(fx.u.join("etc/conf")).unwrap(),
        b"1\nTWO\n3\n4\n5\nSIX\n"
    );
    assert_eq!(
        std::fs::read(fx.u.join("etc").join(&old_tmp)).unwrap(),
        b"user data\n",
        "a user file is never taken for a temporary one"
    );
    let mut names: Vec<_> = std::fs::read_dir(fx.u.join("etc"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, [old_tmp.clone(), "conf".to_string()]);
    assert_eq!(
        std::fs::read_dir(&scratch).unwrap().count(),
        0,
        "nothing left in scratch"
    );
    // A scratch directory on another filesystem is refused before anything is written.
    let err = apply_plan(&fx.u, &plan, Path::new("/dev/shm")).unwrap_err();
    assert!(err.to_string().contains("scratch"), "{err}");
}
