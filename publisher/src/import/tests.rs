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
fn an_xattr_too_large_for_the_store_is_refused_by_name_not_blamed_on_staging() {
    // ext4 keeps about 4 KiB of xattrs per inode (ENOSPC past it) and no
    // filesystem more than 64 KiB per value (E2BIG): both are the input's
    // fault. (Found by the import fuzzer.)
    let big = vec![b'v'; 8 << 10];
    let mut l = Layer::default();
    l.pax(&[("SCHILY.xattr.user.big", &big)]).file("f", b"x");
    let s = Scene::new();
    match s.flatten(&[l.done()]) {
        // A filesystem that keeps 8 KiB xattrs (xfs, btrfs) takes it.
        Ok(_) => {}
        Err(e) => {
            let msg = e.to_string();
            assert!(
                matches!(&e, ImportError::Refused { entry, .. } if entry == b"f"),
                "{msg}"
            );
            assert!(
                msg.contains("user.big") && msg.contains("8192-byte"),
                "{msg}"
            );
        }
    }
    let huge = vec![b'v'; 70 << 10];
    let mut l = Layer::default();
    l.pax(&[("SCHILY.xattr.user.huge", &huge)]).file("g", b"x");
    refused(&[l.done()], "g", "user.huge");
    s.outside_untouched();
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

// ---- Overlay mode: a layer tar applied back into overlay upper format ----

/// Sets the mtime of `rel` below `base` without following or opening it
/// (it may be a device).
fn set_mtime(base: &Path, rel: impl AsRef<Path>, secs: i64) {
    let t = rustix::fs::Timespec {
        tv_sec: secs,
        tv_nsec: 0,
    };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        base.join(rel),
        &rustix::fs::Timestamps {
            last_access: t,
            last_modification: t,
        },
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .unwrap();
}

/// A layer in overlay upper format as a publish leaves it, over `lower`
/// (see [`overlay_lower`]): files with xattrs, setuid and an owner, a
/// directory whose metadata changed, a symlink, a hardlink, a fifo, a device,
/// a long non-UTF-8 name, a whiteout of a file and one of a directory (owned
/// 1000:1000 with an mtime of their own), an opaque directory with a new
/// file, and an opaque directory the layer made where a file was.
fn overlay_layer(dir: &Path, userxattr: bool) {
    use crate::testutil::{fifo, mkdir, symlink, whiteout, write, write_bytes};
    use std::os::unix::ffi::OsStrExt;
    let opaque = crate::view::opaque_name(userxattr);
    mkdir(dir, "etc", 0o755);
    write(dir, "etc/conf", b"key = value\n", 0o640);
    std::os::unix::fs::chown(dir.join("etc/conf"), Some(1000), Some(1001)).unwrap();
    xattr::set(dir.join("etc/conf"), "user.note", b"v\x00\xff").unwrap();
    xattr::set(dir.join("etc/conf"), "trusted.label", b"t").unwrap();
    write(dir, "bin/tool", b"#!/bin/sh\necho tool\n", 0o755);
    std::fs::hard_link(dir.join("bin/tool"), dir.join("bin/tool2")).unwrap();
    symlink(dir, "bin/alias", b"tool");
    write(dir, "bin/suid", b"#!/bin/sh\n", 0o755);
    std::fs::set_permissions(
        dir.join("bin/suid"),
        std::fs::Permissions::from_mode(0o4755),
    )
    .unwrap();
    fifo(dir, "run/fifo", 0o600);
    nix::sys::stat::mknod(
        &dir.join("run/null"),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(1, 3),
    )
    .unwrap();
    std::fs::set_permissions(dir.join("run/null"), std::fs::Permissions::from_mode(0o666)).unwrap();
    let long = [b"run/".as_slice(), &[b'x'; 120], b"-caf\xe9"].concat();
    write_bytes(dir, &long, b"long", 0o644);
    // A directory of the lower whose mode and xattrs changed (Meta).
    mkdir(dir, "m", 0o700);
    xattr::set(dir.join("m"), "user.dirnote", b"d").unwrap();
    // Whiteouts of a lower file and a lower directory.
    whiteout(dir, "gone");
    std::os::unix::fs::chown(dir.join("gone"), Some(1000), Some(1000)).unwrap();
    whiteout(dir, "olddir");
    // An opaque directory over the lower's, with a new file.
    write(dir, "o/new", b"new\n", 0o644);
    xattr::set(dir.join("o"), opaque, b"y").unwrap();
    // A directory made where the lower had a file: opaque (rm f; mkdir f).
    write(dir, "f/inside", b"in\n", 0o644);
    xattr::set(dir.join("f"), opaque, b"y").unwrap();
    // Times in whole seconds, directories last.
    for (i, rel) in [
        "etc/conf",
        "bin/tool",
        "bin/suid",
        "bin/alias",
        "run/fifo",
        "run/null",
        "gone",
        "olddir",
        "o/new",
        "f/inside",
    ]
    .iter()
    .enumerate()
    {
        set_mtime(dir, rel, 1_600_000_000 + i as i64);
    }
    set_mtime(dir, std::ffi::OsStr::from_bytes(&long), 1_650_000_000);
    for (i, rel) in ["etc", "bin", "run", "m", "o", "f"].iter().enumerate() {
        set_mtime(dir, rel, 1_700_000_000 + i as i64);
    }
}

/// What [`overlay_layer`]'s whiteouts, opaque and changed directories hide.
fn overlay_lower(dir: &Path) {
    use crate::testutil::{mkdir, write};
    write(dir, "gone", b"old\n", 0o644);
    write(dir, "olddir/x", b"x\n", 0o644);
    write(dir, "o/old", b"old\n", 0o644);
    write(dir, "f", b"a file\n", 0o644);
    mkdir(dir, "m", 0o755);
    write(dir, "etc/base", b"base\n", 0o644);
}

/// Every entry below `dir` (not the root) with everything a layer keeps:
/// type, mode, owner, mtime (whole seconds), device number, every xattr
/// (overlay-private ones too), content, link target, and which names are
/// one inode.
fn listing(dir: &Path) -> Vec<String> {
    use std::os::unix::ffi::OsStrExt;
    fn walk(base: &Path, rel: &Path, out: &mut Vec<String>, inodes: &mut Vec<(u64, String)>) {
        let mut names: Vec<_> = std::fs::read_dir(base.join(rel))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        for n in names {
            let r = rel.join(&n);
            let full = base.join(&r);
            let md = std::fs::symlink_metadata(&full).unwrap();
            let show = String::from_utf8_lossy(r.as_os_str().as_bytes()).into_owned();
            let mut x: Vec<(String, Vec<u8>)> = xattr::list(&full)
                .unwrap()
                .map(|k| {
                    let v = xattr::get(&full, &k).unwrap().unwrap_or_default();
                    (k.to_string_lossy().into_owned(), v)
                })
                .collect();
            x.sort();
            let ft = md.file_type();
            let what = if ft.is_dir() {
                "dir".to_string()
            } else if ft.is_symlink() {
                format!(
                    "symlink {:?}",
                    std::fs::read_link(&full).unwrap().as_os_str()
                )
            } else if ft.is_file() {
                let link = if md.nlink() > 1 {
                    match inodes.iter().find(|(i, _)| *i == md.ino()) {
                        Some((_, first)) => format!(" = {first}"),
                        None => {
                            inodes.push((md.ino(), show.clone()));
                            String::new()
                        }
                    }
                } else {
                    String::new()
                };
                format!(
                    "file {:x}{link}",
                    Sha256::digest(std::fs::read(&full).unwrap())
                )
            } else {
                format!("special {:o} rdev {}", md.mode() & libc::S_IFMT, md.rdev())
            };
            out.push(format!(
                "{show}: {what} mode {:o} {}:{} mtime {} xattrs {x:?}",
                md.mode() & 0o7777,
                md.uid(),
                md.gid(),
                md.mtime()
            ));
            if ft.is_dir() {
                walk(base, &r, out, inodes);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, Path::new(""), &mut out, &mut Vec::new());
    out
}

/// The capture of `layer` over `lower`, as the path index sees it: every
/// record ([`crate::HeadChange`], with its xattrs digest), the copy-up noise,
/// what was skipped, and the hardlinks as groups of names.
fn index_rows(layer: &Path, lower: &Path, userxattr: bool) -> Vec<String> {
    let view = crate::LayerView::new(vec![lower.to_path_buf()]).with_userxattr(userxattr);
    let cs = crate::capture_with(
        layer,
        &view,
        &crate::CaptureOptions {
            userxattr,
            ..Default::default()
        },
    )
    .unwrap();
    let mut rows: Vec<String> = cs
        .entries
        .keys()
        .map(|p| format!("{:?}", cs.head_change(p).unwrap()))
        .collect();
    rows.extend(
        cs.unchanged
            .iter()
            .map(|(p, c)| format!("unchanged {p:?} {c:?}")),
    );
    rows.extend(cs.skipped.iter().map(|s| format!("skipped {s:?}")));
    let mut groups: std::collections::BTreeMap<u64, Vec<&Vec<u8>>> = Default::default();
    for (p, ino) in &cs.hardlinks {
        groups.entry(*ino).or_default().push(p);
    }
    let mut groups: Vec<String> = groups.values().map(|g| format!("link {g:?}")).collect();
    groups.sort();
    rows.extend(groups);
    rows
}

/// A layer written as an OCI layer tar and applied again in overlay mode is
/// the same layer: the same tree (whiteouts as 0:0 devices with their owner
/// and mtime, opaque directories by xattr), the same tar and diff ID, and the
/// same path-index rows over the same lower layer — for both overlay xattr
/// namespaces, and whatever the compression.
#[test]
fn a_layer_tar_applied_in_overlay_mode_is_the_same_layer_again() {
    if !have_root("a_layer_tar_applied_in_overlay_mode_is_the_same_layer_again") {
        return;
    }
    for userxattr in [false, true] {
        let t = tmp();
        let (orig, lower) = (t.path().join("orig"), t.path().join("lower"));
        std::fs::create_dir(&orig).unwrap();
        overlay_layer(&orig, userxattr);
        overlay_lower(&lower);
        let opts = TarOptions { userxattr };
        let (tar1, report1) = write_layer_tar(&orig, Vec::new(), &opts).unwrap();
        assert_eq!((report1.whiteouts, report1.opaque), (2, 2));
        let diff_id = format!("sha256:{:x}", Sha256::digest(&tar1));
        let compressed = [
            ("plain", tar1.clone()),
            ("gzip", gzip(&tar1)),
            ("zstd", zstd::encode_all(tar1.as_slice(), 3).unwrap()),
        ];
        for (how, blob) in compressed {
            let ctx = format!("userxattr={userxattr} {how}");
            let applied = t.path().join(format!("applied-{how}"));
            std::fs::create_dir(&applied).unwrap();
            let got = apply_layer_tar(
                &applied,
                blob.as_slice(),
                "layer 1/1 (test)",
                &LayerApplyOptions {
                    userxattr,
                    ..Default::default()
                },
            )
            .unwrap();
            assert_eq!(got.diff_id, diff_id, "{ctx}: the diff ID of what was read");
            assert_eq!(got.tar_bytes, tar1.len() as u64, "{ctx}");
            assert_eq!(
                (
                    got.report.whiteouts,
                    got.report.opaque,
                    got.report.hardlinks
                ),
                (2, 2, 1),
                "{ctx}"
            );
            assert_eq!(listing(&applied), listing(&orig), "{ctx}: the same tree");
            let (tar2, _) = write_layer_tar(&applied, Vec::new(), &opts).unwrap();
            assert!(tar2 == tar1, "{ctx}: the same tar, so the same diff ID");
            assert_eq!(
                index_rows(&applied, &lower, userxattr),
                index_rows(&orig, &lower, userxattr),
                "{ctx}: the same path-index rows"
            );
            // And the applied layer reads as a lower layer as the original does.
            for l in [&orig, &applied] {
                let view =
                    crate::LayerView::new(vec![l.clone(), lower.clone()]).with_userxattr(userxattr);
                assert!(view.lookup(b"gone").unwrap().is_none(), "{ctx}");
                assert!(view.lookup(b"olddir/x").unwrap().is_none(), "{ctx}");
                assert!(view.lookup(b"o/old").unwrap().is_none(), "{ctx}");
                assert!(view.lookup(b"o/new").unwrap().is_some(), "{ctx}");
                assert!(view.lookup(b"etc/base").unwrap().is_some(), "{ctx}");
            }
        }
        // The other namespace's opaque xattr is data there, never set.
        let other = crate::view::opaque_name(!userxattr);
        let applied = t.path().join("applied-plain");
        assert_eq!(xattr::get(applied.join("o"), other).unwrap(), None);
    }
}

/// Overlay mode's own rules: a whiteout of a directory the layer made, or a
/// directory entry after a whiteout of its name, makes that directory
/// opaque; a marker before its directory's entry still marks it; an opaque
/// root and a 0:0 device in the tar are refused; nothing is written outside.
#[test]
fn overlay_mode_keeps_whiteouts_and_opacity_and_refuses_what_it_cannot_keep() {
    if !have_root("overlay_mode_keeps_whiteouts_and_opacity_and_refuses_what_it_cannot_keep") {
        return;
    }
    let apply = |sc: &Scene, tar: &[u8]| {
        apply_layer_tar(&sc.staging(), tar, "layer x", &LayerApplyOptions::default())
    };
    let opaque = |p: &Path| xattr::get(p, "trusted.overlay.opaque").unwrap();
    let sc = Scene::new();
    let tar = Layer::default()
        .dir("a/")
        .file("a/kept", b"k")
        .file(".wh.a", b"")
        .file(".wh.b", b"")
        .dir("b/")
        .file("b/in", b"i")
        .file("c/.wh..wh..opq", b"")
        .dir("c/")
        .file(".wh.gone", b"")
        .done();
    let got = apply(&sc, &tar).unwrap();
    let st = sc.staging();
    assert_eq!(opaque(&st.join("a")).as_deref(), Some(&b"y"[..]), "a");
    assert_eq!(
        std::fs::read(st.join("a/kept")).unwrap(),
        b"k",
        "what the layer wrote stays"
    );
    assert_eq!(opaque(&st.join("b")).as_deref(), Some(&b"y"[..]), "b");
    assert_eq!(opaque(&st.join("c")).as_deref(), Some(&b"y"[..]), "c");
    let md = std::fs::symlink_metadata(st.join("gone")).unwrap();
    assert!(crate::view::is_whiteout(md.mode(), md.rdev()));
    assert_eq!(
        (md.mode() & 0o7777, md.uid(), md.mtime()),
        (0, 0, 1_600_000_000)
    );
    assert_eq!(got.report.whiteouts, 3);
    sc.outside_untouched();

    for (tar, entry, why) in [
        (
            Layer::default().file(".wh..wh..opq", b"").done(),
            ".wh..wh..opq",
            "root opaque",
        ),
        (
            Layer::default()
                .push(
                    {
                        let mut h = Layer::header(b"dev", EntryType::Char, 0, 0o600);
                        h.set_device_major(0).unwrap();
                        h.set_device_minor(0).unwrap();
                        h
                    },
                    &[],
                )
                .done(),
            "dev",
            "whiteout",
        ),
        (Layer::default().file("../x", b"no").done(), "../x", "`..`"),
        (
            Layer::default()
                .link("l", EntryType::Symlink, b"/")
                .file("l/.wh.etc", b"")
                .done(),
            "l/.wh.etc",
            "symlink",
        ),
    ] {
        let sc = Scene::new();
        let e = apply(&sc, &tar).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("refused entry {entry} of layer x")),
            "{entry}: {msg}"
        );
        assert!(msg.contains(why), "{entry}: {msg}");
        sc.outside_untouched();
    }
}
