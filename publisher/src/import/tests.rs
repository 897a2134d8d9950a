//! Tests of the import: layer semantics (whiteouts, opaque directories,
//! order within a layer), hostile archives refused with nothing written
//! outside the staging root, and the same tree given as a directory, a tar
//! and an OCI layout staged the same.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};
use tar::{EntryType, Header};

use super::*;
use crate::testutil::{have_root, tmp};
use crate::{write_layer_tar, TarOptions};

/// A hand-made layer tar: raw headers, so names the `tar` crate's builder
/// would refuse (`..`, absolute) can be written.
#[derive(Default)]
struct Layer(Vec<u8>);

impl Layer {
    fn header(name: &[u8], ty: EntryType, size: u64, mode: u32) -> Header {
        let mut h = Header::new_ustar();
        {
            let u = h.as_ustar_mut().unwrap();
            let n = name.len().min(u.name.len());
            u.name[..n].copy_from_slice(&name[..n]);
        }
        h.set_entry_type(ty);
        h.set_size(size);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_600_000_000);
        h
    }

    fn push(&mut self, mut h: Header, data: &[u8]) -> &mut Self {
        h.set_cksum();
        self.0.extend_from_slice(h.as_bytes());
        self.0.extend_from_slice(data);
        let pad = (512 - data.len() % 512) % 512;
        self.0.extend(std::iter::repeat_n(0u8, pad));
        self
    }

    fn pax(&mut self, records: &[(&str, &[u8])]) -> &mut Self {
        let mut body = Vec::new();
        for (k, v) in records {
            let rest = k.len() + v.len() + 3;
            let mut len = rest + 1;
            while len != rest + len.to_string().len() {
                len = rest + len.to_string().len();
            }
            body.extend_from_slice(format!("{len} {k}=").as_bytes());
            body.extend_from_slice(v);
            body.push(b'\n');
        }
        let h = Self::header(b"PaxHeader", EntryType::XHeader, body.len() as u64, 0o644);
        self.push(h, &body)
    }

    fn file(&mut self, name: &str, data: &[u8]) -> &mut Self {
        self.file_b(name.as_bytes(), data)
    }

    fn file_b(&mut self, name: &[u8], data: &[u8]) -> &mut Self {
        let h = Self::header(name, EntryType::Regular, data.len() as u64, 0o644);
        self.push(h, data)
    }

    fn dir(&mut self, name: &str) -> &mut Self {
        let h = Self::header(name.as_bytes(), EntryType::Directory, 0, 0o755);
        self.push(h, &[])
    }

    fn link(&mut self, name: &str, ty: EntryType, target: &[u8]) -> &mut Self {
        let mut h = Self::header(name.as_bytes(), ty, 0, 0o777);
        {
            let u = h.as_ustar_mut().unwrap();
            u.linkname[..target.len()].copy_from_slice(target);
        }
        self.push(h, &[])
    }

    fn done(&mut self) -> Vec<u8> {
        let mut v = std::mem::take(&mut self.0);
        v.extend(std::iter::repeat_n(0u8, 1024));
        v
    }
}

/// A temp dir with `staging/` (empty) and `outside/sentinel` beside it.
struct Scene {
    _t: tempfile::TempDir,
    base: PathBuf,
}

impl Scene {
    fn new() -> Scene {
        let t = tmp();
        let base = t.path().to_path_buf();
        std::fs::create_dir(base.join("staging")).unwrap();
        std::fs::create_dir(base.join("outside")).unwrap();
        std::fs::write(base.join("outside/sentinel"), b"untouched").unwrap();
        Scene { _t: t, base }
    }

    fn staging(&self) -> PathBuf {
        self.base.join("staging")
    }

    /// Nothing was written beside the staging directory.
    fn outside_untouched(&self) {
        let mut names: Vec<_> = std::fs::read_dir(&self.base)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["outside", "staging"], "written beside staging");
        let inside: Vec<_> = std::fs::read_dir(self.base.join("outside"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(inside.len(), 1, "written into outside/: {inside:?}");
        assert_eq!(
            std::fs::read(self.base.join("outside/sentinel")).unwrap(),
            b"untouched"
        );
    }

    fn flatten(&self, layers: &[Vec<u8>]) -> Result<ImportReport, ImportError> {
        flatten_layer_tars(
            &self.staging(),
            layers.iter().enumerate().map(|(i, l)| {
                (
                    format!("layer {}", i + 1),
                    Box::new(std::io::Cursor::new(l.clone())) as Box<dyn Read>,
                )
            }),
        )
    }
}

/// Every path below `dir`, sorted, directories with a trailing `/`.
fn tree(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, rel: &str, out: &mut Vec<String>) {
        let mut names: Vec<_> = std::fs::read_dir(base.join(rel))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        for n in names {
            let r = if rel.is_empty() {
                n
            } else {
                format!("{rel}/{n}")
            };
            let md = std::fs::symlink_metadata(base.join(&r)).unwrap();
            if md.is_dir() {
                out.push(format!("{r}/"));
                walk(base, &r, out);
            } else {
                out.push(r);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, "", &mut out);
    out
}

#[test]
fn a_whiteout_and_an_opaque_directory_hide_what_earlier_layers_made() {
    if !have_root("a_whiteout_and_an_opaque_directory_hide_what_earlier_layers_made") {
        return;
    }
    let s = Scene::new();
    let first = Layer::default()
        .dir("etc/")
        .file("etc/a", b"a\n")
        .file("etc/b", b"b\n")
        .dir("opt/")
        .file("opt/x", b"x\n")
        .dir("opt/sub/")
        .file("opt/sub/y", b"y\n")
        .file("gone", b"g\n")
        .dir("d/")
        .file("d/lower", b"l\n")
        .done();
    let second = Layer::default()
        .file("etc/.wh.a", b"")
        // The same layer's entry before its directory's opaque marker stays.
        .file("opt/new", b"new\n")
        .file("opt/.wh..wh..opq", b"")
        .dir("opt/sub/")
        .file("opt/sub/z", b"z\n")
        .file(".wh.gone", b"")
        // A whiteout after the same layer's entry hides only what was below.
        .file("d/upper", b"u\n")
        .file(".wh.d", b"")
        // A whiteout of nothing is nothing.
        .file("etc/.wh.never", b"")
        .done();
    let r = s.flatten(&[first, second]).unwrap();
    assert_eq!(
        tree(&s.staging()),
        [
            "d/",
            "d/upper",
            "etc/",
            "etc/b",
            "opt/",
            "opt/new",
            "opt/sub/",
            "opt/sub/z"
        ]
    );
    assert_eq!((r.whiteouts, r.opaque, r.layers), (4, 1, 2));
    assert_eq!(
        std::fs::read(s.staging().join("opt/new")).unwrap(),
        b"new\n"
    );
    // The staged tree is the flattened layer: no whiteouts in it.
    let (bytes, rep) = write_layer_tar(&s.staging(), Vec::new(), &TarOptions::default()).unwrap();
    assert_eq!((rep.whiteouts, rep.opaque), (0, 0));
    assert!(!bytes.is_empty());
    s.outside_untouched();
}

#[test]
fn a_later_layer_replaces_files_by_directories_and_back() {
    if !have_root("a_later_layer_replaces_files_by_directories_and_back") {
        return;
    }
    let s = Scene::new();
    let first = Layer::default()
        .file("x", b"file\n")
        .dir("y/")
        .file("y/inner", b"i\n")
        .done();
    let second = Layer::default()
        .dir("x/")
        .file("x/f", b"f\n")
        .file("y", b"now a file\n")
        .done();
    s.flatten(&[first, second]).unwrap();
    assert_eq!(tree(&s.staging()), ["x/", "x/f", "y"]);
    // Directory mtimes are the entries' even after their content changed.
    let md = std::fs::metadata(s.staging().join("x")).unwrap();
    assert_eq!(md.mtime(), 1_600_000_000);
    let root = std::fs::metadata(s.staging()).unwrap();
    assert_eq!(
        (root.mode() & 0o7777, root.uid(), root.mtime()),
        (0o755, 0, 0)
    );
}

/// One hostile archive: refused naming `entry`, nothing outside staging.
fn refused(layers: &[Vec<u8>], entry: &str, why: &str) {
    let s = Scene::new();
    let e = s.flatten(layers).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(&e, ImportError::Refused { entry: got, .. } if got == entry.as_bytes()),
        "{msg}"
    );
    assert!(msg.contains(entry) && msg.contains(why), "{msg}");
    assert!(!msg.chars().next().unwrap().is_uppercase(), "{msg}");
    s.outside_untouched();
}

#[test]
fn hostile_archives_are_refused_and_nothing_is_written_outside_staging() {
    if !have_root("hostile_archives_are_refused_and_nothing_is_written_outside_staging") {
        return;
    }
    // `..` and absolute names.
    refused(
        &[Layer::default().file("../outside/x", b"x").done()],
        "../outside/x",
        "`..`",
    );
    refused(
        &[Layer::default().file("/etc/x", b"x").done()],
        "/etc/x",
        "absolute",
    );
    refused(
        &[Layer::default().file("a/../../outside/x", b"x").done()],
        "a/../../outside/x",
        "`..`",
    );
    // A symlink to `/`, then an entry through it (to this test's own
    // directory: a broken extractor writes there, not into /etc).
    let s = Scene::new();
    let through = format!("a{}/outside/planted", s.base.display());
    refused(
        &[Layer::default()
            .link("a", EntryType::Symlink, b"/")
            .file(&through, b"x")
            .done()],
        &through,
        "symlink",
    );
    // The same across layers: the symlink from the layer below.
    refused(
        &[
            Layer::default()
                .link("a", EntryType::Symlink, b"../outside")
                .done(),
            Layer::default().file("a/planted", b"x").done(),
        ],
        "a/planted",
        "symlink",
    );
    // A whiteout through a symlink cannot remove what it points at.
    refused(
        &[
            Layer::default()
                .link("a", EntryType::Symlink, b"../outside")
                .done(),
            Layer::default().file("a/.wh.sentinel", b"").done(),
        ],
        "a/.wh.sentinel",
        "symlink",
    );
    // Hardlinks to outside, directly or through a symlink.
    refused(
        &[Layer::default()
            .link("h", EntryType::Link, b"../../etc/passwd")
            .done()],
        "h",
        "outside the root",
    );
    refused(
        &[Layer::default()
            .link("h", EntryType::Link, b"/etc/passwd")
            .done()],
        "h",
        "outside the root",
    );
    refused(
        &[Layer::default()
            .link("a", EntryType::Symlink, b"/")
            .link("h", EntryType::Link, b"a/etc/passwd")
            .done()],
        "h",
        "symlink",
    );
    // Long names: a PAX path and a GNU long name are what is checked, not
    // the innocent header name.
    let mut l = Layer::default();
    l.pax(&[("path", b"../outside/pax")]).file("innocent", b"x");
    refused(&[l.done()], "../outside/pax", "`..`");
    let long = format!("{}/../../../outside/gnu", "d".repeat(120));
    let mut l = Layer::default();
    let mut name = long.clone().into_bytes();
    name.push(0);
    l.push(
        Layer::header(
            b"././@LongLink",
            EntryType::GNULongName,
            name.len() as u64,
            0o644,
        ),
        &name,
    )
    .file("innocent", b"x");
    refused(&[l.done()], &long, "`..`");
    // A 0:0 character device is a whiteout in overlay format.
    let mut l = Layer::default();
    let mut h = Layer::header(b"wh", EntryType::Char, 0, 0o644);
    h.set_device_major(0).unwrap();
    h.set_device_minor(0).unwrap();
    l.push(h, &[]);
    refused(&[l.done()], "wh", "whiteout");
    // An overlayfs-private xattr.
    let mut l = Layer::default();
    l.pax(&[("SCHILY.xattr.trusted.overlay.opaque", b"y")])
        .dir("d/");
    refused(&[l.done()], "d/", "overlayfs-private");
}

#[test]
fn a_pax_size_that_disagrees_with_the_header_is_refused() {
    // CVE-2025-62518 ("TARmageddon"): a reader that takes the ustar size (0)
    // over the PAX size reads the content as headers, and extracts a hidden
    // entry; one that takes the PAX size does not. Readers disagree: the
    // archive is refused, naming the entry, whichever size is right.
    if !have_root("a_pax_size_that_disagrees_with_the_header_is_refused") {
        return;
    }
    let hidden = Layer::default().file("smuggled", b"evil").done();
    let hidden = &hidden[..hidden.len() - 1024];
    let mut l = Layer::default();
    l.pax(&[("size", hidden.len().to_string().as_bytes())]);
    let mut h = Layer::header(b"carrier", EntryType::Regular, 0, 0o644);
    h.set_size(0);
    h.set_cksum();
    l.0.extend_from_slice(h.as_bytes());
    l.0.extend_from_slice(hidden);
    refused(
        &[l.done()],
        "carrier",
        "PAX size record says 1024 bytes, its header 0",
    );
    // A PAX size that agrees with the header is read as it says.
    let s = Scene::new();
    let mut l = Layer::default();
    l.pax(&[("size", b"4")]).file("agrees", b"data");
    s.flatten(&[l.done()]).unwrap();
    assert_eq!(std::fs::read(s.staging().join("agrees")).unwrap(), b"data");
}

/// A tree with every kind of entry a layer holds (and a socket, skipped).
fn sample_tree(dir: &Path) {
    use std::os::unix::fs::symlink;
    std::fs::create_dir_all(dir.join("etc/sub")).unwrap();
    std::fs::write(dir.join("etc/motd"), b"hello\n").unwrap();
    std::fs::write(dir.join("etc/sub/deep"), b"deep\n").unwrap();
    std::fs::hard_link(dir.join("etc/motd"), dir.join("etc/motd.link")).unwrap();
    std::fs::write(dir.join("suid"), b"#!/bin/sh\n").unwrap();
    std::os::unix::fs::chown(dir.join("suid"), Some(1000), Some(1000)).unwrap();
    std::fs::set_permissions(dir.join("suid"), std::fs::Permissions::from_mode(0o4755)).unwrap();
    symlink("/etc/passwd", dir.join("abs-link")).unwrap();
    symlink("../../..", dir.join("etc/sub/up")).unwrap();
    nix::unistd::mkfifo(
        &dir.join("fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    nix::sys::stat::mknod(
        &dir.join("null"),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(1, 3),
    )
    .unwrap();
    std::fs::set_permissions(dir.join("null"), std::fs::Permissions::from_mode(0o666)).unwrap();
    xattr::set(dir.join("etc/motd"), "user.note", b"kept").unwrap();
    xattr::set(dir.join("etc/sub"), "security.test", b"dir-xattr").ok();
    drop(std::os::unix::net::UnixListener::bind(dir.join("sock")).unwrap());
    // Directory mtimes last (making entries changed them).
    for (d, t) in [("etc/sub", 1_500_000_000), ("etc", 1_400_000_000)] {
        let f = std::fs::File::open(dir.join(d)).unwrap();
        f.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(t))
            .unwrap();
    }
}

fn sha(dir: &Path) -> String {
    let (bytes, _) = write_layer_tar(dir, Vec::new(), &TarOptions::default()).unwrap();
    format!("sha256:{:x}", Sha256::digest(&bytes))
}

fn gzip(b: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(b).unwrap();
    e.finish().unwrap()
}

/// Writes a one-manifest OCI layout of `layers` (already compressed or not)
/// into `dir`; `platforms` adds more manifests (same layers) for those.
fn layout(dir: &Path, layers: &[Vec<u8>], diff_ids: &[String], platforms: &[&str]) {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let put = |b: &[u8]| -> (String, usize) {
        let hex = format!("{:x}", Sha256::digest(b));
        std::fs::write(blobs.join(&hex), b).unwrap();
        (format!("sha256:{hex}"), b.len())
    };
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    });
    let (cd, cs) = put(config.to_string().as_bytes());
    let ls: Vec<_> = layers
        .iter()
        .map(|l| {
            let (d, s) = put(l);
            serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d, "size": s})
        })
        .collect();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cs},
        "layers": ls,
    });
    let (md, ms) = put(manifest.to_string().as_bytes());
    let mut manifests = vec![serde_json::json!({
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": ms,
        "platform": {"os": "linux", "architecture": host_platform().split('/').nth(1).unwrap()},
    })];
    for p in platforms {
        let (os, arch) = p.split_once('/').unwrap();
        manifests.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": ms,
            "platform": {"os": os, "architecture": arch},
        }));
    }
    std::fs::write(
        dir.join("oci-layout"),
        br#"{"imageLayoutVersion": "1.0.0"}"#,
    )
    .unwrap();
    let index = serde_json::json!({"schemaVersion": 2, "manifests": manifests});
    std::fs::write(dir.join("index.json"), index.to_string()).unwrap();
}

#[test]
fn one_tree_as_a_directory_a_tar_and_an_oci_layout_is_staged_the_same() {
    if !have_root("one_tree_as_a_directory_a_tar_and_an_oci_layout_is_staged_the_same") {
        return;
    }
    let t = tmp();
    let src = t.path().join("src");
    std::fs::create_dir(&src).unwrap();
    sample_tree(&src);
    let want = sha(&src);
    let stage = |name: &str, source: &Path, kind: ImportKind| -> (PathBuf, ImportReport) {
        let st = t.path().join(name);
        std::fs::create_dir(&st).unwrap();
        let r = import_tree(
            source,
            &st,
            &ImportOptions {
                kind,
                ..Default::default()
            },
        )
        .unwrap();
        (st, r)
    };
    // The directory.
    let (d, r) = stage("as-dir", &src, ImportKind::Auto);
    assert_eq!(r.kind, ImportKind::Dir);
    assert_eq!(
        (r.hardlinks, r.specials, r.symlinks, r.sockets_skipped),
        (1, 2, 2, 1)
    );
    assert_eq!(sha(&d), want);
    let md = std::fs::symlink_metadata(d.join("suid")).unwrap();
    assert_eq!(
        (md.mode() & 0o7777, md.uid(), md.gid()),
        (0o4755, 1000, 1000)
    );
    assert_eq!(
        std::fs::read_link(d.join("abs-link")).unwrap(),
        Path::new("/etc/passwd")
    );
    assert_eq!(
        xattr::get(d.join("etc/motd"), "user.note")
            .unwrap()
            .unwrap(),
        b"kept"
    );
    let (a, b) = (
        std::fs::metadata(d.join("etc/motd")).unwrap(),
        std::fs::metadata(d.join("etc/motd.link")).unwrap(),
    );
    assert_eq!(a.ino(), b.ino(), "the hardlink is kept");
    assert_eq!(
        std::fs::metadata(d.join("null")).unwrap().rdev(),
        nix::sys::stat::makedev(1, 3)
    );
    assert_eq!(
        std::fs::metadata(d.join("etc")).unwrap().mtime(),
        1_400_000_000
    );
    // The same tree as a tar (zstd), and as a one-layer OCI layout (gzip).
    let (plain, _) = write_layer_tar(&src, Vec::new(), &TarOptions::default()).unwrap();
    std::fs::write(
        t.path().join("t.tar.zst"),
        zstd::encode_all(plain.as_slice(), 3).unwrap(),
    )
    .unwrap();
    let (tr, r) = stage("as-tar", &t.path().join("t.tar.zst"), ImportKind::Auto);
    assert_eq!((r.kind, r.layers), (ImportKind::Tar, 1));
    assert_eq!(sha(&tr), want);
    let diff_id = format!("sha256:{:x}", Sha256::digest(&plain));
    layout(&t.path().join("oci"), &[gzip(&plain)], &[diff_id], &[]);
    let (o, r) = stage("as-oci", &t.path().join("oci"), ImportKind::Auto);
    assert_eq!((r.kind, r.layers), (ImportKind::Oci, 1));
    assert!(r.manifest.unwrap().starts_with("sha256:"));
    assert_eq!(sha(&o), want);
}

#[test]
fn a_directory_with_a_whiteout_or_an_overlay_xattr_is_refused() {
    if !have_root("a_directory_with_a_whiteout_or_an_overlay_xattr_is_refused") {
        return;
    }
    let t = tmp();
    let src = t.path().join("src");
    std::fs::create_dir_all(src.join("d")).unwrap();
    crate::testutil::whiteout(&src, "d/gone");
    let st = t.path().join("st");
    std::fs::create_dir(&st).unwrap();
    let e = import_tree(&src, &st, &ImportOptions::default()).unwrap_err();
    assert!(
        e.to_string().contains("refused entry d/gone") && e.to_string().contains("whiteout"),
        "{e}"
    );
    std::fs::remove_file(src.join("d/gone")).unwrap();
    xattr::set(src.join("d"), "trusted.overlay.opaque", b"y").unwrap();
    let st = t.path().join("st2");
    std::fs::create_dir(&st).unwrap();
    let e = import_tree(&src, &st, &ImportOptions::default()).unwrap_err();
    assert!(e.to_string().contains("trusted.overlay.opaque"), "{e}");
    // The store's own staging directory cannot be imported into itself.
    let e = import_tree(t.path(), &st, &ImportOptions::default()).unwrap_err();
    assert!(e.to_string().contains("staging directory"), "{e}");
}

#[test]
fn oci_layouts_are_checked_and_their_manifest_chosen() {
    if !have_root("oci_layouts_are_checked_and_their_manifest_chosen") {
        return;
    }
    let t = tmp();
    let base = Layer::default()
        .dir("etc/")
        .file("etc/a", b"a\n")
        .file("etc/b", b"b\n")
        .done();
    let top = Layer::default()
        .file("etc/.wh.a", b"")
        .file("etc/c", b"c\n")
        .done();
    let ids: Vec<String> = [&base, &top]
        .iter()
        .map(|l| format!("sha256:{:x}", Sha256::digest(l)))
        .collect();
    let import = |dir: &Path, platform: Option<&str>| {
        let st = tempfile::tempdir_in(t.path()).unwrap().keep();
        let r = import_tree(
            dir,
            &st,
            &ImportOptions {
                kind: ImportKind::Oci,
                platform: platform.map(str::to_string),
                sync: false,
            },
        );
        (st, r)
    };
    // Two layers: the second's whiteout removes the first's file.
    let one = t.path().join("one");
    layout(&one, &[gzip(&base), top.clone()], &ids, &[]);
    let (st, r) = import(&one, None);
    let r = r.unwrap();
    assert_eq!(r.layers, 2);
    assert_eq!(tree(&st), ["etc/", "etc/b", "etc/c"]);
    // Several platforms: the host's is taken; --platform picks another; an
    // unknown one is refused with the list.
    let multi = t.path().join("multi");
    layout(&multi, &[gzip(&base), top.clone()], &ids, &["linux/s390x"]);
    assert!(import(&multi, None).1.is_ok());
    assert!(import(&multi, Some("linux/s390x")).1.is_ok());
    let e = import(&multi, Some("windows/amd64"))
        .1
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no manifest for platform windows/amd64") && e.contains("linux/s390x"),
        "{e}"
    );
    // A blob that is not what its digest says is refused before it is applied.
    let bad = t.path().join("bad");
    layout(&bad, &[gzip(&base), top.clone()], &ids, &[]);
    let victim = format!("{:x}", Sha256::digest(&top));
    std::fs::write(bad.join("blobs/sha256").join(&victim), b"tampered").unwrap();
    let (st, r) = import(&bad, None);
    let e = r.unwrap_err();
    assert!(matches!(e, ImportError::Digest { .. }), "{e}");
    assert!(e.to_string().contains(&victim), "{e}");
    assert!(!st.join("etc/c").exists());
    // A diff ID that does not match the uncompressed layer.
    let wrong = t.path().join("wrong");
    layout(
        &wrong,
        &[gzip(&base), top.clone()],
        &[ids[0].clone(), ids[0].clone()],
        &[],
    );
    let e = import(&wrong, None).1.unwrap_err().to_string();
    assert!(e.contains("diff ID"), "{e}");
    // A tar that holds a layout is not taken for a root filesystem by `auto`.
    let mut b = tar::Builder::new(Vec::new());
    b.append_dir_all(".", &one).unwrap();
    std::fs::write(t.path().join("archive.tar"), b.into_inner().unwrap()).unwrap();
    let st = tempfile::tempdir_in(t.path()).unwrap().keep();
    let e = import_tree(
        &t.path().join("archive.tar"),
        &st,
        &ImportOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("holds an OCI image layout") && e.contains("--kind"),
        "{e}"
    );
}
