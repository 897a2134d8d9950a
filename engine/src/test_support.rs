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

/// A holder stand-in: a process in its own mount namespace that mounts an
/// overlay with `upper` and `work` (an empty lower under `dir`) on a
/// directory under `dir` and keeps it mounted `secs` seconds (what a
/// `runc init` or a `session run` holder does to the engine's census).
pub(crate) fn mount_elsewhere(
    dir: &std::path::Path,
    upper: &std::path::Path,
    work: &std::path::Path,
    secs: f64,
) -> std::process::Child {
    let (lower, target) = (dir.join("lower"), dir.join("mnt"));
    for d in [&lower, &target] {
        std::fs::create_dir_all(d).expect("the holder's lower and mount point");
    }
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    );
    std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(format!(
            "mount -t overlay overlay -o {opts} {} && sleep {secs}",
            target.display()
        ))
        .spawn()
        .expect("unshare (util-linux)")
}
