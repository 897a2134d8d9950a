//! Helpers shared by the publisher's integration test binaries.

/// Whether `test` may run: root is needed (overlay mounts, mknod, trusted.* xattrs).
/// Without root it skips, except under `CI=true`, where it fails.
pub fn have_root(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{test} needs root (overlay mount, mknod, trusted.* xattrs) and CI=true: run the suite as root");
    }
    eprintln!("skipping {test}: needs root");
    false
}
