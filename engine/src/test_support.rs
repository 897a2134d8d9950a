//! Helpers every test module of the engine shares.

/// Root is needed (chown, trusted.* xattrs, the store's sweep, chown of
/// uppers). Without it the test skips, except under `CI=true`, where it fails.
pub(crate) fn have_root(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test} needs root under CI=true"
    );
    eprintln!("skipping {test}: needs root");
    false
}

/// A temporary directory under /var/tmp (where the engine tests have always
/// kept their stores), named `ls-<what>-…`.
pub(crate) fn tmp_named(what: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("ls-{what}-"))
        .tempdir_in("/var/tmp")
        .expect("a temporary directory in /var/tmp")
}
