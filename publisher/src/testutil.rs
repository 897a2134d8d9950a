//! Fixture helpers for the unit tests: real files in a temp dir on a disk filesystem.
#![allow(clippy::unwrap_used)]

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use nix::sys::stat::{makedev, mknod, Mode, SFlag};

/// A temp dir under `/var/tmp` (a disk filesystem, like the store; `/tmp` may be tmpfs).
pub fn tmp() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("layerstack-pub-")
        .tempdir_in("/var/tmp")
        .unwrap()
}

/// True when running as root. Without root: panics under `CI=true` (the suite must
/// run as root there), otherwise prints a skip note and returns false.
pub fn have_root(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{test} needs root (mknod, trusted.* xattrs, chown, mount) and CI=true: run the suite as root");
    }
    eprintln!("skipping {test}: needs root");
    false
}

pub fn p(base: &Path, rel: &[u8]) -> PathBuf {
    base.join(OsStr::from_bytes(rel))
}

fn parent_dirs(path: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
}

pub fn write(base: &Path, rel: &str, content: &[u8], mode: u32) {
    write_bytes(base, rel.as_bytes(), content, mode);
}

pub fn write_bytes(base: &Path, rel: &[u8], content: &[u8], mode: u32) {
    let path = p(base, rel);
    parent_dirs(&path);
    std::fs::write(&path, content).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
}

pub fn mkdir(base: &Path, rel: &str, mode: u32) {
    let path = p(base, rel.as_bytes());
    std::fs::create_dir_all(&path).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
}

pub fn symlink(base: &Path, rel: &str, target: &[u8]) {
    let path = p(base, rel.as_bytes());
    parent_dirs(&path);
    std::os::unix::fs::symlink(OsStr::from_bytes(target), &path).unwrap();
}

/// An overlay whiteout: `mknod c 0 0` (needs CAP_MKNOD).
pub fn whiteout(base: &Path, rel: &str) {
    let path = p(base, rel.as_bytes());
    parent_dirs(&path);
    mknod(&path, SFlag::S_IFCHR, Mode::empty(), makedev(0, 0)).unwrap();
}

pub fn fifo(base: &Path, rel: &str, mode: u32) {
    let path = p(base, rel.as_bytes());
    parent_dirs(&path);
    nix::unistd::mkfifo(&path, Mode::from_bits_truncate(mode)).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
}

pub fn socket(base: &Path, rel: &str) {
    let path = p(base, rel.as_bytes());
    parent_dirs(&path);
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
}

pub fn names(list: &[&str]) -> Vec<Vec<u8>> {
    list.iter().map(|s| s.as_bytes().to_vec()).collect()
}

/// Gives `to_base/rel` the mtime of `from_base/rel` (as the kernel's copy-up does).
pub fn copy_mtime(from_base: &Path, to_base: &Path, rel: &[u8]) {
    let m = std::fs::symlink_metadata(p(from_base, rel))
        .unwrap()
        .modified()
        .unwrap();
    let f = std::fs::File::options()
        .write(true)
        .open(p(to_base, rel))
        .unwrap();
    f.set_modified(m).unwrap();
}

/// `lines` pseudo-random lines (`seed`) drawn from 16 kinds, each `width` bytes
/// with its `\n`: three such texts match each other everywhere and nowhere in
/// order, the line diff's worst case (about 0.5 s for 4,000 lines in a debug
/// build, 30 ms in release). Tests that need a merge which cannot finish within
/// a tiny time budget use them.
pub fn scrambled(seed: u64, lines: usize, width: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..lines)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            format!("{:0w$}\n", (state >> 33) % 16, w = width.saturating_sub(1))
        })
        .collect::<String>()
        .into_bytes()
}
