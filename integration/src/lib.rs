//! Test harness for LayerStack's integration tests: a private containerd, our
//! snapshotter daemon, the `layerstack` CLI, and fixture images.
//!
//! Everything a [`TestEnv`] starts lives under one temp dir below
//! `$LAYERSTACK_TEST_TMP` (default `/var/tmp`, which must be a local ext4, xfs
//! or btrfs, not tmpfs): containerd's root, state and sockets, the daemon's
//! store and sockets, logs. Teardown kills only processes this harness started
//! (by pid) or whose command line names that temp dir (shims and their
//! children), unmounts whatever is still mounted below the temp dir, and
//! removes it. It never touches another containerd. A temp dir left behind by
//! a test process that was killed outright is swept by the next [`TestEnv`].
//!
//! The harness needs root, `containerd`, `ctr`, `runc` and
//! `containerd-shim-runc-v2` (see [`require_root_and_containerd`]).

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

pub mod model;
pub mod registry;
pub mod scenario;
pub use scenario::*;

/// Snapshotter name under which containerd sees our daemon.
pub const SNAPSHOTTER: &str = "layerstack";
/// The label names (snapshot labels and container labels).
pub use layerstack_types::labels;
/// Snapshot label that selects a session's branch.
pub use layerstack_types::labels::SNAPSHOT_BRANCH_LABEL;
/// Name of the Debian fixture image after import.
pub const DEBIAN_IMAGE: &str = "docker.io/layerstack/debian:bookworm";
/// Name of the full source-tree fixture image after import ([`source_image_tar`]).
pub const SOURCE_IMAGE: &str = "docker.io/layerstack/source:linux";
/// Name of the small source-tree fixture image after import ([`source_image_tar`]).
pub const SMALL_SOURCE_IMAGE: &str = "docker.io/layerstack/source:small";
/// Name of the busybox fixture image after import.
pub const BUSYBOX_IMAGE: &str = "docker.io/layerstack/busybox:test";
/// Name of the busybox image with a full runtime config (two layers, gzip and
/// plain; User, Env, Entrypoint, Cmd, WorkingDir, …) after import
/// ([`configured_image_tar`]).
pub const CONFIGURED_IMAGE: &str = "docker.io/layerstack/busybox:configured";
/// Name of the pod sandbox (pause-like) fixture image after import
/// ([`pause_image_tar`]).
pub const PAUSE_IMAGE: &str = "docker.io/layerstack/pause:test";
/// The daemon binary.
pub const DAEMON_BIN: &str = "containerd-layerstack-grpc";
/// The operator CLI binary.
pub const CLI_BIN: &str = "layerstack";

/// Default timeout for one `ctr` / `layerstack` invocation.
pub const CMD_TIMEOUT: Duration = Duration::from_secs(180);
const TMP_PREFIX: &str = "lst-";
const LOG_TAIL_LINES: usize = 80;

// ---------------------------------------------------------------------------
// Environment checks and paths
// ---------------------------------------------------------------------------

fn in_ci() -> bool {
    std::env::var("CI")
        .map(|v| v == "true" || v == "1")
        .unwrap_or(false)
}

/// Finds `name` on `$PATH`.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| {
            p.metadata()
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

/// True when this process can run the integration tests: root, and
/// containerd, ctr, runc and containerd-shim-runc-v2 on `$PATH`. Otherwise,
/// with `CI=true` it panics with the reason (CI must never skip silently),
/// else it prints the reason to stderr and returns false (skip).
pub fn require_root_and_containerd() -> bool {
    let mut missing = Vec::new();
    if !nix::unistd::geteuid().is_root() {
        missing.push("root (euid 0)".to_string());
    }
    for bin in ["containerd", "ctr", "runc", "containerd-shim-runc-v2"] {
        if which(bin).is_none() {
            missing.push(format!("`{bin}` on PATH"));
        }
    }
    if missing.is_empty() {
        return true;
    }
    skip(&format!(
        "integration tests need {}; run scripts/install-deps.sh as root",
        missing.join(", ")
    ))
}

/// A test that cannot run here: with `CI=true` panics with `msg` (CI must
/// never skip silently), else prints `SKIPPED: msg` to stderr and returns
/// false.
pub(crate) fn skip(msg: &str) -> bool {
    if in_ci() {
        panic!("CI=true and {msg}");
    }
    eprintln!("SKIPPED: {msg}");
    false
}

/// True when this process can run the tests that need root but no
/// containerd (the daemon alone: `base import`, Mode B on an imported base).
/// Otherwise, with `CI=true` it panics with the reason, else it prints it to
/// stderr and returns false (skip).
pub fn require_root() -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    skip("this test needs root (euid 0): the daemon mounts overlays and chowns")
}

/// Directory below which test temp dirs are created: `$LAYERSTACK_TEST_TMP`,
/// default `/var/tmp` (on disk; `/tmp` may be tmpfs, which the store refuses).
pub fn tmp_base() -> PathBuf {
    std::env::var_os("LAYERSTACK_TEST_TMP")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp"))
}

/// Cache for fixture images: `$LAYERSTACK_TEST_CACHE`, default
/// `/var/cache/layerstack-test` (the same default the fixture scripts use).
pub fn cache_dir() -> PathBuf {
    std::env::var_os("LAYERSTACK_TEST_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/layerstack-test"))
}

/// containerd's log level: `$LAYERSTACK_TEST_CONTAINERD_LOG_LEVEL`, default
/// `debug` (the tests dump its log on failure; the benchmarks use `info`, as
/// a production containerd would run).
pub fn containerd_log_level() -> String {
    std::env::var("LAYERSTACK_TEST_CONTAINERD_LOG_LEVEL").unwrap_or_else(|_| "debug".into())
}

/// `integration/fixtures`.
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// Candidate directories for our binaries, most specific first:
/// `$LAYERSTACK_BIN_DIR`; the profile dir this test binary was built into
/// (`<target>/debug` from `<target>/debug/deps/<test>`); `$CARGO_TARGET_DIR/debug`
/// (at run time, then at build time); `<workspace>/target/debug`.
pub fn bin_dir_candidates() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("LAYERSTACK_BIN_DIR") {
        dirs.push(PathBuf::from(d));
    }
    if let Ok(exe) = std::env::current_exe() {
        if let Some(profile) = exe.parent().and_then(Path::parent) {
            dirs.push(profile.to_path_buf());
        }
    }
    if let Some(d) = std::env::var_os("CARGO_TARGET_DIR") {
        dirs.push(PathBuf::from(d).join("debug"));
    }
    if let Some(d) = option_env!("CARGO_TARGET_DIR") {
        dirs.push(PathBuf::from(d).join("debug"));
    }
    dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug"));
    dirs
}

/// Path of one of our binaries (see [`bin_dir_candidates`]). With
/// `$LAYERSTACK_BIN_DIR` set, only that directory is used.
pub fn bin_path(name: &str) -> Result<PathBuf> {
    let dirs = match std::env::var_os("LAYERSTACK_BIN_DIR") {
        Some(d) => vec![PathBuf::from(d)],
        None => bin_dir_candidates(),
    };
    for d in &dirs {
        let p = d.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!(
        "binary `{name}` not found in {:?}; build it first (`cargo build --workspace --bins`) \
         or set LAYERSTACK_BIN_DIR",
        dirs
    )
}

// ---------------------------------------------------------------------------
// Running commands
// ---------------------------------------------------------------------------

/// Runs `cmd` to completion with stdin closed, capturing stdout and stderr.
/// Kills it (SIGKILL) and returns an error after `timeout`.
pub fn run_with_timeout(cmd: &mut Command, timeout: Duration) -> Result<Output> {
    let desc = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {desc}"))?;
    let mut out_pipe = child.stdout.take().context("stdout pipe")?;
    let mut err_pipe = child.stderr.take().context("stderr pipe")?;
    let out_t = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out_pipe.read_to_end(&mut v);
        v
    });
    let err_t = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err_pipe.read_to_end(&mut v);
        v
    });
    let status = match wait_timeout(&mut child, timeout)? {
        Some(st) => st,
        None => {
            let _ = child.kill();
            let _ = child.wait();
            let out = out_t.join().unwrap_or_default();
            let err = err_t.join().unwrap_or_default();
            bail!(
                "timed out after {timeout:?}: {desc}\nstdout: {}\nstderr: {}",
                String::from_utf8_lossy(&out),
                String::from_utf8_lossy(&err)
            );
        }
    };
    Ok(Output {
        status,
        stdout: out_t.join().unwrap_or_default(),
        stderr: err_t.join().unwrap_or_default(),
    })
}

/// Polls `child` until it exits or `timeout` passes (then `None`).
pub fn wait_timeout(child: &mut Child, timeout: Duration) -> Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(st) = child.try_wait()? {
            return Ok(Some(st));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Human-readable summary of an [`Output`] for assertion messages.
pub fn describe(out: &Output) -> String {
    format!(
        "{}\n--- stdout ---\n{}--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// stdout as a String.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `out` if it exited 0, else an error naming `what` with its output.
pub fn ensure_success(what: &str, out: Output) -> Result<Output> {
    if out.status.success() {
        Ok(out)
    } else {
        bail!("{what} failed: {}", describe(&out))
    }
}

/// Last `n` lines of a file ("" if unreadable).
pub fn tail_file(path: &Path, n: usize) -> String {
    let Ok(bytes) = fs::read(path) else {
        return String::new();
    };
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn wait_for_socket(path: &Path, child: &mut Child, log: &Path, what: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if UnixStream::connect(path).is_ok() {
            return Ok(());
        }
        if let Some(st) = child.try_wait()? {
            bail!(
                "{what} exited ({st}) before {} accepted connections; last log lines:\n{}",
                path.display(),
                tail_file(log, LOG_TAIL_LINES)
            );
        }
        if Instant::now() >= deadline {
            bail!(
                "{what}: {} not ready after 30s; last log lines:\n{}",
                path.display(),
                tail_file(log, LOG_TAIL_LINES)
            );
        }
        thread::sleep(Duration::from_millis(50));
    }
}

// ---------------------------------------------------------------------------
// Processes and mounts
// ---------------------------------------------------------------------------

/// (pid, ppid, cmdline with NULs as spaces) for every process.
fn processes() -> Vec<(i32, i32, String)> {
    let mut v = Vec::new();
    let Ok(rd) = fs::read_dir("/proc") else {
        return v;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ..." — comm may contain spaces and ')'.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let ppid = rest
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let cmdline = fs::read(format!("/proc/{pid}/cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default();
        v.push((pid, ppid, cmdline));
    }
    v
}

fn pid_alive(pid: i32) -> bool {
    // A zombie still has /proc/<pid>; treat it as dead.
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rfind(')')
            .map(|i| s[i + 1..].trim_start().starts_with('Z'))
            .unwrap_or(false),
        Err(_) => false,
    }
}

/// Kills (SIGKILL) every process whose command line contains `needle`, and all
/// their descendants. Returns the victims as "pid cmdline".
pub fn kill_processes_mentioning(needle: &str) -> Vec<String> {
    kill_process_trees(|cmd| cmd.contains(needle))
}

/// Kills (SIGKILL) every process whose command line satisfies `select`, and
/// all their descendants (container processes under a shim). Never this
/// process. Returns the victims as "pid cmdline".
pub fn kill_process_trees(select: impl Fn(&str) -> bool) -> Vec<String> {
    let me = std::process::id() as i32;
    let procs = processes();
    let mut victims: BTreeSet<i32> = procs
        .iter()
        .filter(|(pid, _, cmd)| *pid != me && select(cmd))
        .map(|(pid, _, _)| *pid)
        .collect();
    loop {
        let before = victims.len();
        for (pid, ppid, _) in &procs {
            if *pid != me && victims.contains(ppid) {
                victims.insert(*pid);
            }
        }
        if victims.len() == before {
            break;
        }
    }
    let mut killed = Vec::new();
    for (pid, _, cmd) in procs.iter().filter(|(pid, _, _)| victims.contains(pid)) {
        let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
        killed.push(format!("{pid} {}", cmd.trim()));
    }
    killed
}

/// Merges `over` into `base`: tables key by key (recursively), any other value
/// of `over` replaces `base`'s.
pub fn merge_toml(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge_toml(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// SIGTERM, wait up to `grace`, then SIGKILL; reaps the child.
fn terminate(child: &mut Child, grace: Duration) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
    if let Ok(Some(_)) = wait_timeout(child, grace) {
        return;
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn unescape_mountinfo(s: &str) -> String {
    // Octal escapes: \040 space, \011 tab, \012 newline, \134 backslash.
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() {
            let oct = &b[i + 1..i + 4];
            if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = oct
                    .iter()
                    .fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
                if let Ok(v) = u8::try_from(v) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One line of /proc/self/mountinfo.
#[derive(Debug, Clone)]
pub struct MountInfo {
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// Filesystem type (`overlay`, `tmpfs`, …).
    pub fs_type: String,
    /// Mount source.
    pub source: String,
    /// Superblock options (`lowerdir=…,upperdir=…` for overlay).
    pub super_options: String,
}

impl MountInfo {
    /// Value of one superblock option (`lowerdir`, `upperdir`, …).
    pub fn option(&self, key: &str) -> Option<String> {
        split_mount_options(&self.super_options)
            .into_iter()
            .find_map(|o| o.strip_prefix(&format!("{key}=")).map(str::to_string))
    }

    /// Overlay lower directories, top first (empty if not an overlay).
    pub fn lowerdirs(&self) -> Vec<String> {
        self.option("lowerdir")
            .map(|v| split_unescaped(&v, ':'))
            .unwrap_or_default()
    }
}

fn split_unescaped(s: &str, sep: char) -> Vec<String> {
    let mut parts = Vec::new();
    let mut cur = String::new();
    let mut escaped = false;
    for c in s.chars() {
        if escaped {
            cur.push(c);
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == sep {
            parts.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
    }
    parts.push(cur);
    parts.into_iter().filter(|p| !p.is_empty()).collect()
}

fn split_mount_options(s: &str) -> Vec<&str> {
    s.split(',').collect()
}

/// Parses /proc/self/mountinfo.
pub fn mounts() -> Vec<MountInfo> {
    let Ok(text) = fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|line| {
            let (pre, post) = line.split_once(" - ")?;
            let pre: Vec<&str> = pre.split(' ').collect();
            let post: Vec<&str> = post.splitn(3, ' ').collect();
            Some(MountInfo {
                mount_point: PathBuf::from(unescape_mountinfo(pre.get(4)?)),
                fs_type: post.first()?.to_string(),
                source: unescape_mountinfo(post.get(1).unwrap_or(&"")),
                super_options: unescape_mountinfo(post.get(2).unwrap_or(&"")),
            })
        })
        .collect()
}

/// Mounts at or below `dir`, deepest first.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = mounts()
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(dir))
        .collect();
    v.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    v.dedup();
    v
}

/// Lazily unmounts everything at or below `dir` (repeatedly, for stacked
/// mounts). Returns mount points that are still there afterwards.
pub fn unmount_all_under(dir: &Path) -> Vec<PathBuf> {
    for _ in 0..8 {
        let ms = mounts_under(dir);
        if ms.is_empty() {
            return ms;
        }
        for m in ms {
            if let Err(e) = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH) {
                eprintln!("layerstack-integration: umount {}: {e}", m.display());
            }
        }
    }
    mounts_under(dir)
}

/// Removes `dir` after making sure nothing is mounted below it (a remaining
/// mount means the tree is left in place and reported).
pub fn remove_tree(dir: &Path) {
    let left = unmount_all_under(dir);
    if !left.is_empty() {
        eprintln!(
            "layerstack-integration: not removing {}: still mounted: {left:?}",
            dir.display()
        );
        return;
    }
    if let Err(e) = fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            eprintln!("layerstack-integration: removing {}: {e}", dir.display());
        }
    }
}

/// The overlay mounted as a container's rootfs (containerd runtime v2 mounts
/// it at `<state>/io.containerd.runtime.v2.task/<ns>/<id>/rootfs`), if mounted.
pub fn rootfs_mount(state_dir: &Path, ns: &str, id: &str) -> Option<MountInfo> {
    let target = state_dir
        .join("io.containerd.runtime.v2.task")
        .join(ns)
        .join(id)
        .join("rootfs");
    mounts().into_iter().rev().find(|m| m.mount_point == target)
}

// ---------------------------------------------------------------------------
// Stale temp dirs from killed test processes
// ---------------------------------------------------------------------------

/// Cleans up temp dirs under [`tmp_base`] left by test processes that no
/// longer run (killed by SIGKILL, say): kills processes naming the dir,
/// unmounts, removes. Dirs of live processes are left alone.
pub fn sweep_stale() {
    let Ok(rd) = fs::read_dir(tmp_base()) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(TMP_PREFIX) {
            continue;
        }
        let dir = e.path();
        let owner = fs::read_to_string(dir.join("owner.pid"))
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok());
        match owner {
            Some(pid) if pid_alive(pid) => continue,
            // Being created right now, or not ours: leave it.
            None => continue,
            Some(_) => {}
        }
        eprintln!("layerstack-integration: sweeping stale {}", dir.display());
        let needle = dir.to_string_lossy().into_owned();
        kill_processes_mentioning(&needle);
        thread::sleep(Duration::from_millis(200));
        remove_tree(&dir);
    }
}

/// A root filesystem for a base import at `dir`: the host's static busybox as
/// `/bin/busybox`, `applets` as symlinks to it in `/bin`, and the directories
/// `dirs`. Errors: busybox is not installed (`apt-get install busybox-static`).
pub fn busybox_tree(dir: &Path, applets: &[&str], dirs: &[&str]) -> Result<()> {
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.is_file())
        .context("busybox is not installed (apt-get install busybox-static)")?;
    for d in ["bin"].iter().chain(dirs) {
        std::fs::create_dir_all(dir.join(d))?;
    }
    std::fs::copy(busybox, dir.join("bin/busybox"))?;
    for applet in applets {
        std::os::unix::fs::symlink("busybox", dir.join("bin").join(applet))?;
    }
    Ok(())
}

/// A fresh temp dir `<tmp_base>/lst-XXXXXX` with an `owner.pid` file.
pub fn make_temp_dir() -> Result<PathBuf> {
    let base = tmp_base();
    fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    let dir = tempfile::Builder::new()
        .prefix(TMP_PREFIX)
        .tempdir_in(&base)
        .with_context(|| format!("temp dir in {}", base.display()))?
        .keep();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755))?;
    fs::write(dir.join("owner.pid"), std::process::id().to_string())?;
    Ok(dir)
}

// ---------------------------------------------------------------------------
// Fixture images
// ---------------------------------------------------------------------------

fn build_fixture(script: &str, args: &[&str], out_name: &str) -> Result<PathBuf> {
    let cache = cache_dir();
    fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let out = cache.join(out_name);
    let script_path = fixtures_dir().join(script);
    let start = Instant::now();
    let output = run_with_timeout(
        Command::new("bash")
            .arg(&script_path)
            .args(args)
            .arg(&out)
            .env("LAYERSTACK_TEST_CACHE", &cache),
        Duration::from_secs(1200),
    )?;
    let output = ensure_success(&format!("{}", script_path.display()), output)?;
    eprintln!(
        "layerstack-integration: fixture {out_name} ready in {:.1}s: {}",
        start.elapsed().as_secs_f64(),
        String::from_utf8_lossy(&output.stderr).trim()
    );
    Ok(out)
}

fn fixture_once(
    cell: &'static OnceLock<Result<PathBuf, String>>,
    script: &str,
    args: &[&str],
    out: &str,
) -> Result<PathBuf> {
    cell.get_or_init(|| build_fixture(script, args, out).map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow!(e))
}

/// OCI archive of [`BUSYBOX_IMAGE`], built once per process (cached on disk).
pub fn busybox_image_tar() -> Result<PathBuf> {
    static CELL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    fixture_once(&CELL, "make_busybox_image.sh", &[], "busybox-image.tar")
}

/// OCI archive of [`CONFIGURED_IMAGE`] (from the busybox fixture's), built once
/// per process (`make_configured_image.sh`, a second).
pub fn configured_image_tar() -> Result<PathBuf> {
    static CELL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let busybox = busybox_image_tar()?;
    fixture_once(
        &CELL,
        "make_configured_image.sh",
        &[&busybox.to_string_lossy()],
        "configured-image.tar",
    )
}

/// OCI archive of [`PAUSE_IMAGE`] (busybox sleeping until killed: containerd's
/// CRI `sandbox_image` in the CRI tests), built once per process (cached on disk).
pub fn pause_image_tar() -> Result<PathBuf> {
    static CELL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    fixture_once(&CELL, "make_pause_image.sh", &[], "pause-image.tar")
}

/// OCI archive of [`DEBIAN_IMAGE`], built once per process (cached on disk;
/// the first build runs debootstrap and takes a minute or more).
pub fn debian_image_tar() -> Result<PathBuf> {
    static CELL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    fixture_once(&CELL, "make_debian_image.sh", &[], "debian-image.tar")
}

/// OCI archive of the benchmarks' source-tree image, built once per process
/// (cached on disk): [`SOURCE_IMAGE`] (Debian's linux-source tree, ~1.3 GB; the
/// first build downloads ~140 MB with `apt-get download`), or with `small`
/// [`SMALL_SOURCE_IMAGE`] (a generated ~10 MB tree). `make_source_image.sh`.
pub fn source_image_tar(small: bool) -> Result<PathBuf> {
    static FULL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    static SMALL: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    if small {
        fixture_once(
            &SMALL,
            "make_source_image.sh",
            &["--small"],
            "source-small-image.tar",
        )
    } else {
        fixture_once(&FULL, "make_source_image.sh", &[], "source-linux-image.tar")
    }
}

// ---------------------------------------------------------------------------
// containerd
// ---------------------------------------------------------------------------

/// A private containerd: own root, state, sockets and config, below its own
/// directory. Stopped (and its shims, containers and mounts cleaned up) on drop.
pub struct Containerd {
    dir: PathBuf,
    owns_dir: bool,
    child: Option<Child>,
    socket: PathBuf,
    layerstack_socket: PathBuf,
    log: PathBuf,
    imported: Mutex<BTreeSet<(String, String, String)>>,
}

impl Containerd {
    /// Starts containerd in a new temp dir (removed on drop), with the
    /// `layerstack` proxy snapshotter pointing at `layerstack_socket`
    /// (containerd dials it lazily, so the daemon may start later).
    pub fn start(layerstack_socket: &Path) -> Result<Containerd> {
        let dir = make_temp_dir()?;
        let mut c = Self::start_in(&dir, layerstack_socket);
        match &mut c {
            Ok(c) => c.owns_dir = true,
            Err(_) => remove_tree(&dir),
        }
        c
    }

    /// Starts containerd with everything below `dir` (kept on drop).
    pub fn start_in(dir: &Path, layerstack_socket: &Path) -> Result<Containerd> {
        let mut config = toml::Table::new();
        let mut proxy = toml::Table::new();
        proxy.insert("type".into(), "snapshot".into());
        proxy.insert(
            "address".into(),
            layerstack_socket.to_string_lossy().into_owned().into(),
        );
        let mut proxies = toml::Table::new();
        proxies.insert(SNAPSHOTTER.into(), proxy.into());
        config.insert("proxy_plugins".into(), proxies.into());
        Self::start_with_config(dir, layerstack_socket, config)
    }

    /// Starts containerd with everything below `dir` (kept on drop), from
    /// `config` (a containerd config version 2 document, e.g. the output of
    /// `layerstack config containerd --version 1.6`) merged with this harness's
    /// private settings, which win: `root`, `state`, `grpc.address`,
    /// `ttrpc.address`, debug logging. The CRI plugin is disabled unless `config`
    /// configures it; then its CNI directories are private too (CRI would
    /// otherwise create `/etc/cni/net.d`), and its streaming server listens on a
    /// free port (not 10010, which a system containerd may hold).
    pub fn start_with_config(
        dir: &Path,
        layerstack_socket: &Path,
        config: toml::Table,
    ) -> Result<Containerd> {
        let dir = dir.to_path_buf();
        fs::create_dir_all(&dir)?;
        let socket = dir.join("containerd.sock");
        if socket.as_os_str().len() >= 100 {
            bail!(
                "socket path too long for a unix socket: {}",
                socket.display()
            );
        }
        let log = dir.join("containerd.log");
        let config_path = dir.join("containerd.toml");
        let s = |p: PathBuf| toml::Value::from(p.to_string_lossy().into_owned());
        let mut private = toml::Table::new();
        private.insert("version".into(), 2.into());
        private.insert("root".into(), s(dir.join("root")));
        private.insert("state".into(), s(dir.join("state")));
        let mut grpc = toml::Table::new();
        grpc.insert("address".into(), s(socket.clone()));
        private.insert("grpc".into(), grpc.into());
        let mut ttrpc = toml::Table::new();
        ttrpc.insert("address".into(), s(dir.join("containerd.sock.ttrpc")));
        private.insert("ttrpc".into(), ttrpc.into());
        let mut debug = toml::Table::new();
        debug.insert("level".into(), containerd_log_level().into());
        private.insert("debug".into(), debug.into());
        let cri_configured = config
            .get("plugins")
            .and_then(|p| p.get("io.containerd.grpc.v1.cri"))
            .is_some();
        if cri_configured {
            let mut cni = toml::Table::new();
            cni.insert("conf_dir".into(), s(dir.join("cni").join("conf")));
            cni.insert("bin_dir".into(), s(dir.join("cni").join("bin")));
            let mut cri = toml::Table::new();
            cri.insert("cni".into(), cni.into());
            cri.insert("stream_server_port".into(), "0".into());
            let mut plugins = toml::Table::new();
            plugins.insert("io.containerd.grpc.v1.cri".into(), cri.into());
            private.insert("plugins".into(), plugins.into());
        } else {
            private.insert(
                "disabled_plugins".into(),
                toml::Value::Array(vec!["io.containerd.grpc.v1.cri".into()]),
            );
        }
        let mut merged = config;
        merge_toml(&mut merged, private);
        fs::write(&config_path, toml::to_string(&merged)?)?;
        let logf = File::create(&log)?;
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&config_path)
            .arg("--log-level")
            .arg(containerd_log_level())
            .envs(containerd_env(layerstack_socket))
            .stdin(Stdio::null())
            .stdout(logf.try_clone()?)
            .stderr(logf)
            .spawn()
            .context("spawning containerd (apt-get install containerd)")?;
        fs::write(dir.join("containerd.pid"), child.id().to_string())?;
        let mut c = Containerd {
            dir,
            owns_dir: false,
            child: Some(child),
            socket,
            layerstack_socket: layerstack_socket.to_path_buf(),
            log,
            imported: Mutex::new(BTreeSet::new()),
        };
        c.wait_ready()?;
        Ok(c)
    }

    /// containerd's config file (as merged by [`Containerd::start_with_config`]).
    pub fn config_path(&self) -> PathBuf {
        self.dir.join("containerd.toml")
    }

    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let child = self.child.as_mut().context("containerd not running")?;
            if let Some(st) = child.try_wait()? {
                bail!(
                    "containerd exited ({st}) during startup; last log lines:\n{}",
                    tail_file(&self.log, LOG_TAIL_LINES)
                );
            }
            if self.socket.exists() {
                let out = run_with_timeout(
                    Command::new("ctr")
                        .arg("--address")
                        .arg(&self.socket)
                        .arg("version"),
                    Duration::from_secs(10),
                );
                if matches!(&out, Ok(o) if o.status.success()) {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                bail!(
                    "containerd not answering on {} after 30s; last log lines:\n{}",
                    self.socket.display(),
                    tail_file(&self.log, LOG_TAIL_LINES)
                );
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// containerd's directory (root, state, sockets, log).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// containerd's gRPC socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
    /// Where containerd expects the layerstack snapshotter.
    pub fn layerstack_socket(&self) -> &Path {
        &self.layerstack_socket
    }
    /// containerd's state dir (container rootfs mounts live below it).
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }
    /// containerd's debug log.
    pub fn log_path(&self) -> &Path {
        &self.log
    }
    /// runc state root for containers started through [`Containerd::ctr`],
    /// private to this containerd.
    pub fn runc_root(&self) -> PathBuf {
        self.dir.join("runc")
    }
    /// containerd's pid.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn ctr_command(&self, ns: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address")
            .arg(&self.socket)
            .arg("--namespace")
            .arg(ns);
        // Containers get a runc root below our dir, so a namespace/id can never
        // collide with another containerd's runc state in /run/containerd/runc.
        let runc_root = self.runc_root();
        let mut injected = false;
        for (i, a) in args.iter().enumerate() {
            cmd.arg(a);
            let creates = (i == 0 && *a == "run")
                || (i == 1
                    && *a == "create"
                    && matches!(args[0], "c" | "container" | "containers"));
            if creates && !injected {
                cmd.arg("--runc-root").arg(&runc_root);
                injected = true;
            }
        }
        cmd
    }

    /// Runs `ctr --address SOCK --namespace NS ARGS…` (timeout
    /// [`CMD_TIMEOUT`]). For `run` and `containers create`, `--runc-root` is
    /// added right after the subcommand. Does not check the exit status.
    pub fn ctr(&self, ns: &str, args: &[&str]) -> Result<Output> {
        self.ctr_timeout(ns, args, CMD_TIMEOUT)
    }

    /// [`Containerd::ctr`] with an explicit timeout.
    pub fn ctr_timeout(&self, ns: &str, args: &[&str], timeout: Duration) -> Result<Output> {
        run_with_timeout(&mut self.ctr_command(ns, args), timeout)
    }

    /// [`Containerd::ctr`], failing on a non-zero exit.
    pub fn ctr_ok(&self, ns: &str, args: &[&str]) -> Result<Output> {
        ensure_success(
            &format!("ctr -n {ns} {}", args.join(" ")),
            self.ctr(ns, args)?,
        )
    }

    /// Spawns `ctr` without waiting (stdout/stderr piped), e.g. a blocking
    /// `ctr run` that must overlap another one. Collect with
    /// [`Child::wait_with_output`].
    pub fn ctr_spawn(&self, ns: &str, args: &[&str]) -> Result<Child> {
        self.ctr_command(ns, args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("spawning ctr")
    }

    /// Imports an OCI archive into `ns` and unpacks it for `snapshotter`.
    /// Idempotent per (ns, tar, snapshotter) within this containerd. Returns
    /// the image names `ctr images ls -q` shows afterwards.
    pub fn import_image(&self, ns: &str, tar: &Path, snapshotter: &str) -> Result<Vec<String>> {
        let key = (
            ns.to_string(),
            tar.to_string_lossy().into_owned(),
            snapshotter.to_string(),
        );
        let mut done = self.imported.lock().unwrap_or_else(|e| e.into_inner());
        if !done.contains(&key) {
            let tar_s = tar.to_string_lossy();
            let start = Instant::now();
            self.ctr_ok(
                ns,
                &["images", "import", "--snapshotter", snapshotter, &tar_s],
            )?;
            eprintln!(
                "layerstack-integration: imported {} into {ns} ({snapshotter}) in {:.1}s",
                tar.display(),
                start.elapsed().as_secs_f64()
            );
            done.insert(key);
        }
        drop(done);
        let out = self.ctr_ok(ns, &["images", "ls", "-q"])?;
        Ok(stdout(&out).lines().map(str::to_string).collect())
    }

    /// The overlay mounted as container `id`'s rootfs, if mounted now.
    pub fn rootfs_mount(&self, ns: &str, id: &str) -> Option<MountInfo> {
        rootfs_mount(&self.state_dir(), ns, id)
    }

    /// Number of overlay lowerdirs of container `id`'s mounted rootfs.
    pub fn rootfs_lowerdir_count(&self, ns: &str, id: &str) -> Option<usize> {
        self.rootfs_mount(ns, id).map(|m| m.lowerdirs().len())
    }

    /// Prints the last lines of containerd's log to stderr.
    pub fn dump_log(&self) {
        eprintln!(
            "===== containerd log (last {LOG_TAIL_LINES} lines) {} =====\n{}\n===== end containerd log =====",
            self.log.display(),
            tail_file(&self.log, LOG_TAIL_LINES)
        );
    }

    /// Best effort: kill and delete every task this containerd knows, so the
    /// shims clean up their mounts while containerd is still there.
    fn kill_all_tasks(&self) {
        let t = Duration::from_secs(20);
        let Ok(nss) = self.ctr_timeout("default", &["namespaces", "ls", "-q"], t) else {
            return;
        };
        for ns in stdout(&nss)
            .lines()
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            let Ok(tasks) = self.ctr_timeout(ns, &["tasks", "ls", "-q"], t) else {
                continue;
            };
            for id in stdout(&tasks)
                .lines()
                .map(str::trim)
                .filter(|s| !s.is_empty())
            {
                let _ = self.ctr_timeout(
                    ns,
                    &["tasks", "kill", "--all", "--signal", "SIGKILL", id],
                    t,
                );
                let _ = self.ctr_timeout(ns, &["tasks", "delete", "--force", id], t);
            }
        }
    }

    /// Stops containerd and cleans up after it. Idempotent.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(None) = child.try_wait() {
            self.kill_all_tasks();
        }
        terminate(&mut child, Duration::from_secs(10));
        // Shims outlive containerd; their cmdline names our socket
        // (`-address <sock>`). Kill them and their children (the container
        // processes). Our daemon also names the socket: not a shim, left alone.
        let sock = self.socket.to_string_lossy().into_owned();
        let killed =
            kill_process_trees(|cmd| cmd.contains("containerd-shim") && cmd.contains(&sock));
        if !killed.is_empty() {
            eprintln!("layerstack-integration: killed leftover shim processes {killed:?}");
            thread::sleep(Duration::from_millis(200));
        }
        let left = unmount_all_under(&self.dir);
        if !left.is_empty() {
            eprintln!("layerstack-integration: still mounted after teardown: {left:?}");
        }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if thread::panicking() && self.child.is_some() {
            self.dump_log();
        }
        self.stop();
        if self.owns_dir {
            remove_tree(&self.dir);
        }
    }
}

// ---------------------------------------------------------------------------
// Our daemon
// ---------------------------------------------------------------------------

static DAEMON_ARGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Extra arguments for every daemon this process starts from now on (e.g.
/// `--sandbox-max-sessions 2048`); a test binary sets them before its first env.
pub fn set_daemon_args(args: &[&str]) {
    *DAEMON_ARGS.lock().unwrap_or_else(|e| e.into_inner()) =
        args.iter().map(|s| s.to_string()).collect();
}

/// `containerd-layerstack-grpc`, serving the snapshot socket containerd was
/// configured with and an admin socket beside it.
pub struct Daemon {
    child: Option<Child>,
    root: PathBuf,
    socket: PathBuf,
    admin_socket: PathBuf,
    log: PathBuf,
}

impl Daemon {
    /// Admin socket path used for a given snapshot socket: same directory,
    /// `admin.sock`.
    pub fn admin_socket_for(snapshot_socket: &Path) -> PathBuf {
        snapshot_socket
            .parent()
            .unwrap_or_else(|| Path::new("/"))
            .join("admin.sock")
    }

    /// Starts the daemon with store root `root` (must be on ext4/xfs/btrfs),
    /// serving `containerd.layerstack_socket()` and an admin socket beside it,
    /// logging to `<root's parent>/daemon.log`. Waits until both sockets accept
    /// connections.
    pub fn start(containerd: &Containerd, root: &Path) -> Result<Daemon> {
        Self::start_at(containerd.layerstack_socket(), containerd.socket(), root)
    }

    /// Like [`Daemon::start`], before containerd exists: serve `socket` and talk to
    /// containerd at `containerd_socket` once it appears (the production order,
    /// `Before=containerd.service`).
    pub fn start_at(socket: &Path, containerd_socket: &Path, root: &Path) -> Result<Daemon> {
        Self::start_at_with(socket, containerd_socket, root, &[], true)
    }

    /// [`Daemon::start_at`] with `extra` arguments (after those of
    /// [`set_daemon_args`]). `any_metrics_port`: pass `--metrics-address
    /// 127.0.0.1:0` (false: the daemon's own default, 127.0.0.1:9464 or a free
    /// port when that is taken).
    pub fn start_at_with(
        socket: &Path,
        containerd_socket: &Path,
        root: &Path,
        extra: &[&str],
        any_metrics_port: bool,
    ) -> Result<Daemon> {
        let socket = socket.to_path_buf();
        let admin_socket = Self::admin_socket_for(&socket);
        for s in [&socket, &admin_socket] {
            if s.as_os_str().len() >= 100 {
                bail!("socket path too long for a unix socket: {}", s.display());
            }
            if let Some(p) = s.parent() {
                fs::create_dir_all(p)?;
            }
            let _ = fs::remove_file(s);
        }
        fs::create_dir_all(root)?;
        let log = root
            .parent()
            .unwrap_or_else(|| Path::new("/var/tmp"))
            .join("daemon.log");
        let bin = bin_path(DAEMON_BIN)?;
        let logf = OpenOptions::new().create(true).append(true).open(&log)?;
        let mut cmd = Command::new(&bin);
        cmd.arg("--root")
            .arg(root)
            .arg("--address")
            .arg(&socket)
            .arg("--admin-address")
            .arg(&admin_socket)
            .arg("--containerd-address")
            .arg(containerd_socket);
        if any_metrics_port {
            // Any free port: never the default 9464, which another daemon (a
            // parallel test, a system one) may hold.
            cmd.arg("--metrics-address").arg("127.0.0.1:0");
        }
        let mut child = cmd
            .args(DAEMON_ARGS.lock().unwrap_or_else(|e| e.into_inner()).iter())
            .args(extra)
            .env(
                "RUST_LOG",
                // Ours at debug; the gRPC transport's per-frame debug lines
                // would fill the log tail a failing test dumps.
                std::env::var("RUST_LOG").unwrap_or_else(|_| {
                    "debug,h2=info,hyper=info,hyper_util=info,tower=info,rustls=info".into()
                }),
            )
            .env("RUST_BACKTRACE", "1")
            .stdin(Stdio::null())
            .stdout(logf.try_clone()?)
            .stderr(logf)
            .spawn()
            .with_context(|| format!("spawning {}", bin.display()))?;
        let ready = wait_for_socket(&socket, &mut child, &log, DAEMON_BIN)
            .and_then(|()| wait_for_socket(&admin_socket, &mut child, &log, DAEMON_BIN));
        if let Err(e) = ready {
            terminate(&mut child, Duration::from_secs(5));
            return Err(e);
        }
        if let Some(p) = root.parent() {
            let _ = fs::write(p.join("daemon.pid"), child.id().to_string());
        }
        Ok(Daemon {
            child: Some(child),
            root: root.to_path_buf(),
            socket,
            admin_socket,
            log,
        })
    }

    /// Store root.
    pub fn root(&self) -> &Path {
        &self.root
    }
    /// Snapshot API socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
    /// Admin API socket.
    pub fn admin_socket(&self) -> &Path {
        &self.admin_socket
    }
    /// Daemon log (stdout + stderr).
    pub fn log_path(&self) -> &Path {
        &self.log
    }
    /// The daemon's pid while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
    /// Whether the daemon process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(Child::try_wait), Some(Ok(None)))
    }

    /// Runs `layerstack --admin-address ADMIN ARGS…` (timeout [`CMD_TIMEOUT`]).
    /// Does not check the exit status.
    pub fn layerstack(&self, args: &[&str]) -> Result<Output> {
        let bin = bin_path(CLI_BIN)?;
        run_with_timeout(
            Command::new(bin)
                .arg("--admin-address")
                .arg(&self.admin_socket)
                .args(args),
            CMD_TIMEOUT,
        )
    }

    /// Prints the last lines of the daemon log to stderr.
    pub fn dump_log(&self) {
        eprintln!(
            "===== {DAEMON_BIN} log (last {LOG_TAIL_LINES} lines) {} =====\n{}\n===== end daemon log =====",
            self.log.display(),
            tail_file(&self.log, LOG_TAIL_LINES)
        );
    }

    /// SIGKILLs the daemon (a crash or an OOM kill: no shutdown of any kind)
    /// and reaps it; its sockets and store stay as they are. Returns its pid.
    /// Errors if it is not running.
    pub fn kill(&mut self) -> Result<u32> {
        let child = self
            .child
            .as_mut()
            .context("the daemon is stopped already")?;
        if child.try_wait()?.is_some() {
            bail!("the daemon had exited already");
        }
        let pid = child.id();
        kill(Pid::from_raw(pid as i32), Signal::SIGKILL).context("SIGKILL to the daemon")?;
        child.wait().context("reaping the daemon")?;
        self.child = None;
        Ok(pid)
    }

    /// SIGTERM, then SIGKILL after 10 s. Idempotent.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            terminate(&mut child, Duration::from_secs(10));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if thread::panicking() && self.child.is_some() {
            self.dump_log();
        }
        self.stop();
    }
}

/// Whether an overlay with upperdir `upper` is mounted in any process's mount
/// namespace on the machine.
pub fn mounted_anywhere(upper: &Path) -> bool {
    let needle = format!("upperdir={}", upper.display());
    let Ok(procs) = fs::read_dir("/proc") else {
        return false;
    };
    procs.flatten().any(|p| {
        p.file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
            && fs::read_to_string(p.path().join("mountinfo"))
                .is_ok_and(|m| m.lines().any(|l| l.contains(&needle)))
    })
}

/// The daemon alone, with no containerd anywhere: a fresh temp dir (see
/// [`make_temp_dir`]) holding its store (`root/`), sockets (`s/`) and log;
/// the containerd address it is given (`s/containerd.sock`) never exists.
/// Dropping it stops the daemon (by its pid) and removes the temp dir (kept
/// with `LAYERSTACK_TEST_KEEP`).
pub struct StandaloneDaemon {
    dir: PathBuf,
    daemon: Option<Daemon>,
    /// What it was started with, for [`StandaloneDaemon::restart_daemon`].
    extra: Vec<String>,
    any_metrics_port: bool,
}

impl StandaloneDaemon {
    /// Starts the daemon; waits until its sockets answer.
    pub fn start() -> Result<StandaloneDaemon> {
        Self::start_with(true, |_| Ok(Vec::new()))
    }

    /// [`StandaloneDaemon::start`] with extra daemon arguments
    /// ([`Daemon::start_at_with`]): `prepare` gets the temp dir (to write a
    /// config file there) and answers the arguments.
    pub fn start_with(
        any_metrics_port: bool,
        prepare: impl FnOnce(&Path) -> Result<Vec<String>>,
    ) -> Result<StandaloneDaemon> {
        let dir = make_temp_dir()?;
        let daemon = prepare(&dir).and_then(|extra| {
            let d = Self::daemon_at(&dir, &extra, any_metrics_port)?;
            Ok((d, extra))
        });
        match daemon {
            Ok((d, extra)) => Ok(StandaloneDaemon {
                dir,
                daemon: Some(d),
                extra,
                any_metrics_port,
            }),
            Err(e) => {
                remove_tree(&dir);
                Err(e)
            }
        }
    }

    fn daemon_at(dir: &Path, extra: &[String], any_metrics_port: bool) -> Result<Daemon> {
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        Daemon::start_at_with(
            &dir.join("s/snapshotter.sock"),
            &dir.join("s/containerd.sock"),
            &dir.join("root"),
            &extra,
            any_metrics_port,
        )
    }

    /// SIGKILLs the daemon (a crash: no shutdown of any kind) and reaps it;
    /// its store, sockets and log stay. Returns its pid. Restart it with
    /// [`StandaloneDaemon::restart_daemon`].
    pub fn kill_daemon(&mut self) -> Result<u32> {
        self.daemon.as_mut().context("no daemon")?.kill()
    }

    /// Starts a new daemon on the same store, sockets and log (with the same
    /// arguments) after [`StandaloneDaemon::kill_daemon`]; waits until its
    /// sockets answer.
    pub fn restart_daemon(&mut self) -> Result<()> {
        if let Some(d) = self.daemon.as_mut() {
            if d.is_running() {
                bail!(
                    "restart_daemon: the daemon is still running (pid {:?})",
                    d.pid()
                );
            }
        }
        self.daemon = None;
        self.daemon = Some(Self::daemon_at(
            &self.dir,
            &self.extra,
            self.any_metrics_port,
        )?);
        Ok(())
    }

    /// The temp dir.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The daemon.
    pub fn daemon(&self) -> &Daemon {
        self.daemon.as_ref().expect("running until dropped")
    }

    /// Runs `layerstack --admin-address ADMIN ARGS…` ([`Daemon::layerstack`]).
    pub fn layerstack(&self, args: &[&str]) -> Result<Output> {
        self.daemon().layerstack(args)
    }
}

impl Drop for StandaloneDaemon {
    fn drop(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            if thread::panicking() {
                d.dump_log();
            }
            d.stop();
        }
        if std::env::var_os("LAYERSTACK_TEST_KEEP").is_some() {
            unmount_all_under(&self.dir);
            eprintln!(
                "layerstack-integration: LAYERSTACK_TEST_KEEP set, keeping {}",
                self.dir.display()
            );
        } else {
            remove_tree(&self.dir);
        }
    }
}

// ---------------------------------------------------------------------------
// TestEnv: one temp dir, one containerd, (optionally) one daemon
// ---------------------------------------------------------------------------

/// Where a [`TestEnv`] puts things, for a containerd configuration made before
/// containerd starts ([`set_containerd_config`]).
pub struct EnvLayout<'a> {
    /// The env's temp dir (containerd's is `c/` below it).
    pub dir: &'a Path,
    /// The daemon's snapshot socket (containerd's `proxy_plugins.layerstack`).
    pub snapshot_socket: &'a Path,
    /// The daemon's admin socket.
    pub admin_socket: &'a Path,
    /// The daemon's store root.
    pub store_root: &'a Path,
}

/// Makes a containerd configuration for [`Containerd::start_with_config`].
pub type ContainerdConfigFn = fn(&EnvLayout<'_>) -> Result<toml::Table>;

static CONTAINERD_CONFIG: Mutex<Option<ContainerdConfigFn>> = Mutex::new(None);

/// Every [`TestEnv`] this process starts from now on runs containerd from the
/// configuration `make` returns (merged with the harness's private settings by
/// [`Containerd::start_with_config`]) instead of the plain proxy-plugin one; a
/// test binary sets it before its first env (e.g. `tests/cri.rs`: the generated
/// configuration with the CRI plugin enabled).
pub fn set_containerd_config(make: ContainerdConfigFn) {
    *CONTAINERD_CONFIG.lock().unwrap_or_else(|e| e.into_inner()) = Some(make);
}

/// One temp dir with our daemon (started first) and a private containerd:
///
/// ```text
/// <tmp>/lst-XXXXXX/
///   owner.pid               test process (for the stale sweep)
///   c/                      containerd: root/, state/, runc/, containerd.sock, containerd.log
///   ls/snap.sock            daemon snapshot socket (containerd's proxy plugin address)
///   ls/admin.sock           daemon admin socket
///   daemon.log
///   store/                  daemon store root
///   scratch/                for tests (e.g. a tmpfs mount)
/// ```
pub struct TestEnv {
    dir: PathBuf,
    daemon: Mutex<Option<Daemon>>,
    containerd: Option<Containerd>,
    failed: std::sync::atomic::AtomicBool,
}

impl TestEnv {
    /// The daemon, then containerd (the daemon must be serving before containerd dials it).
    pub fn new() -> Result<TestEnv> {
        Self::new_with(|_| Ok(()))
    }

    /// [`TestEnv::new`] with `prepare` run on the env's temp dir before the
    /// daemon starts (e.g. to mount a small filesystem at its `store/`).
    pub fn new_with(prepare: impl FnOnce(&Path) -> Result<()>) -> Result<TestEnv> {
        sweep_stale();
        let dir = make_temp_dir()?;
        let snap = dir.join("ls").join("snap.sock");
        fs::create_dir_all(dir.join("ls"))?;
        fs::create_dir_all(dir.join("scratch"))?;
        if let Err(e) = prepare(&dir) {
            remove_tree(&dir);
            return Err(e);
        }
        // The daemon first, as systemd orders them: containerd 1.6 dials the proxy
        // socket at startup, and a failed first dial leaves it in gRPC backoff.
        let daemon = match Daemon::start_at(
            &snap,
            &dir.join("c").join("containerd.sock"),
            &dir.join("store"),
        ) {
            Ok(d) => d,
            Err(e) => {
                remove_tree(&dir);
                return Err(e);
            }
        };
        let custom = *CONTAINERD_CONFIG.lock().unwrap_or_else(|e| e.into_inner());
        let started = match custom {
            Some(make) => {
                let layout = EnvLayout {
                    dir: &dir,
                    snapshot_socket: &snap,
                    admin_socket: &Daemon::admin_socket_for(&snap),
                    store_root: &dir.join("store"),
                };
                make(&layout)
                    .and_then(|config| Containerd::start_with_config(&dir.join("c"), &snap, config))
            }
            None => Containerd::start_in(&dir.join("c"), &snap),
        };
        let containerd = match started {
            Ok(c) => c,
            Err(e) => {
                remove_tree(&dir);
                return Err(e);
            }
        };
        let env = TestEnv {
            dir,
            daemon: Mutex::new(Some(daemon)),
            containerd: Some(containerd),
            failed: std::sync::atomic::AtomicBool::new(false),
        };
        env.wait_events_subscribed()?;
        Ok(env)
    }

    /// Waits until the daemon is subscribed to containerd's task events
    /// (`layerstack status`), so a task deleted from now on publishes through the
    /// event path rather than through the later reconcile.
    pub fn wait_events_subscribed(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = self.layerstack(&["status", "--json"])?;
            if out.status.success() {
                let v: serde_json::Value =
                    serde_json::from_slice(&out.stdout).with_context(|| {
                        format!(
                            "layerstack status --json: {}",
                            String::from_utf8_lossy(&out.stdout)
                        )
                    })?;
                if v["events_subscribed"] == serde_json::Value::Bool(true) {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                self.dump_logs();
                bail!("the daemon did not subscribe to containerd's events within 30s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Containerd and the daemon.
    pub fn with_daemon() -> Result<TestEnv> {
        let env = Self::new()?;
        env.start_daemon()?;
        Ok(env)
    }

    /// Starts the daemon if it is not running yet (idempotent, thread-safe).
    pub fn start_daemon(&self) -> Result<()> {
        let mut d = self.daemon.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(daemon) = d.as_mut() {
            if daemon.is_running() {
                return Ok(());
            }
            daemon.dump_log();
            bail!("{DAEMON_BIN} died; see its log above");
        }
        let daemon = Daemon::start(self.containerd(), &self.store_root())?;
        *d = Some(daemon);
        drop(d);
        self.wait_snapshotter_reachable()
    }

    /// Waits until containerd reaches the daemon through its proxy plugin.
    /// containerd 1.6 dials the proxy socket at startup, before the daemon
    /// exists; the failed dial leaves the connection in gRPC backoff, and RPCs
    /// fail with `unavailable … dial unix …: timeout` until it reconnects.
    pub fn wait_snapshotter_reachable(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = self.containerd().ctr_timeout(
                "default",
                &["snapshots", "--snapshotter", SNAPSHOTTER, "ls"],
                Duration::from_secs(20),
            )?;
            if out.status.success() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.dump_logs();
                bail!(
                    "containerd cannot reach the {SNAPSHOTTER} snapshotter after 30s: {}",
                    describe(&out)
                );
            }
            thread::sleep(Duration::from_millis(250));
        }
    }

    /// The env's top temp dir.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// A directory tests may use freely.
    pub fn scratch(&self) -> PathBuf {
        self.dir.join("scratch")
    }
    /// The daemon's store root.
    pub fn store_root(&self) -> PathBuf {
        self.dir.join("store")
    }
    /// The daemon's admin socket.
    pub fn admin_socket(&self) -> PathBuf {
        Daemon::admin_socket_for(self.containerd().layerstack_socket())
    }
    /// The private containerd.
    pub fn containerd(&self) -> &Containerd {
        self.containerd
            .as_ref()
            .expect("containerd present until drop")
    }

    /// See [`Containerd::ctr`].
    pub fn ctr(&self, ns: &str, args: &[&str]) -> Result<Output> {
        self.containerd().ctr(ns, args)
    }
    /// See [`Containerd::ctr_ok`].
    pub fn ctr_ok(&self, ns: &str, args: &[&str]) -> Result<Output> {
        self.containerd().ctr_ok(ns, args)
    }
    /// See [`Containerd::ctr_spawn`].
    pub fn ctr_spawn(&self, ns: &str, args: &[&str]) -> Result<Child> {
        self.containerd().ctr_spawn(ns, args)
    }
    /// See [`Containerd::import_image`].
    pub fn import_image(&self, ns: &str, tar: &Path, snapshotter: &str) -> Result<Vec<String>> {
        self.containerd().import_image(ns, tar, snapshotter)
    }

    /// Runs `layerstack --admin-address ADMIN ARGS…` (does not check the exit
    /// status). Works whether or not the daemon was started by this env.
    pub fn layerstack(&self, args: &[&str]) -> Result<Output> {
        let bin = bin_path(CLI_BIN)?;
        run_with_timeout(
            Command::new(bin)
                .arg("--admin-address")
                .arg(self.admin_socket())
                .args(args),
            CMD_TIMEOUT,
        )
    }

    /// Path of the daemon log.
    pub fn daemon_log(&self) -> PathBuf {
        self.dir.join("daemon.log")
    }

    /// Marks the env as having seen a failure (logs are dumped at teardown),
    /// and dumps the logs now.
    pub fn mark_failed(&self) {
        self.failed.store(true, std::sync::atomic::Ordering::SeqCst);
        self.dump_logs();
    }

    /// Prints the last lines of containerd's and the daemon's logs.
    pub fn dump_logs(&self) {
        if let Some(c) = &self.containerd {
            c.dump_log();
        }
        let log = self.daemon_log();
        if log.exists() {
            eprintln!(
                "===== {DAEMON_BIN} log (last {LOG_TAIL_LINES} lines) {} =====\n{}\n===== end daemon log =====",
                log.display(),
                tail_file(&log, LOG_TAIL_LINES)
            );
        }
    }

    /// A guard for one test: if the test panics while the guard lives, the
    /// logs are dumped and the env is marked failed.
    pub fn guard(&self) -> FailureGuard<'_> {
        FailureGuard { env: self }
    }

    /// Stops everything and removes the temp dir. Idempotent; also run by Drop.
    pub fn teardown(&mut self) {
        if let Some(c) = self.containerd.as_mut() {
            // Tasks first (while containerd and the daemon still answer).
            c.stop();
        }
        if let Some(mut daemon) = self.daemon.lock().unwrap_or_else(|e| e.into_inner()).take() {
            daemon.stop();
        }
        // Both are stopped now, so their Drops neither dump logs nor wait.
        self.containerd.take();
        // Anything else still naming our dir (a daemon child, a stray ctr).
        let needle = self.dir.to_string_lossy().into_owned();
        let killed = kill_processes_mentioning(&needle);
        if !killed.is_empty() {
            eprintln!("layerstack-integration: killed leftover processes {killed:?}");
            thread::sleep(Duration::from_millis(200));
        }
        if std::env::var_os("LAYERSTACK_TEST_KEEP").is_some() {
            unmount_all_under(&self.dir);
            eprintln!(
                "layerstack-integration: LAYERSTACK_TEST_KEEP set, keeping {}",
                self.dir.display()
            );
        } else {
            remove_tree(&self.dir);
        }
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        if thread::panicking() {
            self.dump_logs();
        }
        if self.failed.load(std::sync::atomic::Ordering::SeqCst) {
            eprintln!(
                "layerstack-integration: a test failed; set LAYERSTACK_TEST_KEEP=1 to keep {}",
                self.dir.display()
            );
        }
        self.teardown();
    }
}

/// See [`TestEnv::guard`].
pub struct FailureGuard<'a> {
    env: &'a TestEnv,
}

impl Drop for FailureGuard<'_> {
    fn drop(&mut self) {
        if thread::panicking() {
            self.env.mark_failed();
        }
    }
}

// ---------------------------------------------------------------------------
// A process-wide shared env with guaranteed teardown
// ---------------------------------------------------------------------------

static SHARED: OnceLock<Mutex<Option<TestEnv>>> = OnceLock::new();
static SHARED_INIT: Mutex<()> = Mutex::new(());
static SHARED_ERR: OnceLock<String> = OnceLock::new();

extern "C" fn shared_teardown() {
    if let Some(m) = SHARED.get() {
        let env = m.lock().unwrap_or_else(|e| e.into_inner()).take();
        drop(env);
    }
}

/// Runs `f` with the process-wide [`TestEnv`] (created on first use; torn
/// down at process exit through an `atexit` hook). Calls are serialized: one
/// test uses the env at a time. A panic inside `f` dumps the logs and is
/// re-raised.
pub fn with_shared_env<R>(f: impl FnOnce(&TestEnv) -> R) -> R {
    {
        let _init = SHARED_INIT.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = SHARED_ERR.get() {
            panic!("shared test env failed to start earlier: {e}");
        }
        if SHARED.get().is_none() {
            match TestEnv::new() {
                Ok(env) => {
                    let _ = SHARED.set(Mutex::new(Some(env)));
                    // SAFETY: registering a plain `extern "C" fn()` with no
                    // captured state; libc calls it once at process exit.
                    let rc = unsafe { libc::atexit(shared_teardown) };
                    assert_eq!(rc, 0, "atexit registration failed");
                }
                Err(e) => {
                    let msg = format!("{e:#}");
                    let _ = SHARED_ERR.set(msg.clone());
                    panic!("starting the shared test env: {msg}");
                }
            }
        }
    }
    let cell = SHARED.get().expect("initialized above");
    let guard = cell.lock().unwrap_or_else(|e| e.into_inner());
    let env = guard.as_ref().expect("shared env torn down already");
    let _fail = env.guard();
    f(env)
}

/// True if `s` contains `needle`, ignoring ASCII case.
pub fn contains_ci(s: &str, needle: &str) -> bool {
    s.to_ascii_lowercase()
        .contains(&needle.to_ascii_lowercase())
}

/// Whether `path` is an empty directory.
pub fn dir_is_empty(path: &Path) -> Result<bool> {
    Ok(fs::read_dir(path)?.next().is_none())
}

// ---------------------------------------------------------------------------
// Runtime shim support (tests/shim.rs)
// ---------------------------------------------------------------------------

/// The runtime shim binary.
pub const SHIM_BIN: &str = "containerd-shim-layerstack-v1";
/// The runtime name containerd maps to [`SHIM_BIN`].
pub const SHIM_RUNTIME: &str = "io.containerd.layerstack.v1";

/// Extra environment of every containerd the harness starts (shims inherit
/// containerd's environment): `PATH` with the directory of our built
/// [`SHIM_BIN`] first, so `--runtime io.containerd.layerstack.v1` finds it (when
/// it is built), and `LAYERSTACK_ADMIN_ADDRESS` = the daemon's admin socket beside
/// `layerstack_socket`, where the shim asks for publishes.
pub fn containerd_env(layerstack_socket: &Path) -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
    let mut env = vec![(
        "LAYERSTACK_ADMIN_ADDRESS".into(),
        Daemon::admin_socket_for(layerstack_socket).into_os_string(),
    )];
    if let Ok(shim) = bin_path(SHIM_BIN) {
        if let Some(dir) = shim.parent() {
            let mut dirs = vec![dir.to_path_buf()];
            if let Some(p) = std::env::var_os("PATH") {
                dirs.extend(std::env::split_paths(&p));
            }
            if let Ok(path) = std::env::join_paths(dirs) {
                env.push(("PATH".into(), path));
            }
        }
    }
    env
}

impl Containerd {
    /// Restarts containerd in place: SIGTERM (SIGKILL after 10 s) to containerd
    /// only — shims and containers keep running, as in a `systemctl restart
    /// containerd` — then starts it again with the same config and environment,
    /// and waits until it answers.
    pub fn restart(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            terminate(&mut child, Duration::from_secs(10));
        }
        let logf = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new("containerd")
            .arg("--config")
            .arg(self.dir.join("containerd.toml"))
            .arg("--log-level")
            .arg(containerd_log_level())
            .envs(containerd_env(&self.layerstack_socket))
            .stdin(Stdio::null())
            .stdout(logf.try_clone()?)
            .stderr(logf)
            .spawn()
            .context("restarting containerd")?;
        fs::write(self.dir.join("containerd.pid"), child.id().to_string())?;
        self.child = Some(child);
        self.wait_ready()
    }
}

impl TestEnv {
    /// [`Containerd::restart`], then waits until containerd reaches the daemon.
    pub fn restart_containerd(&mut self) -> Result<()> {
        self.containerd
            .as_mut()
            .context("containerd stopped")?
            .restart()?;
        if self
            .daemon
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            self.wait_snapshotter_reachable()?;
        }
        Ok(())
    }
}

/// [`with_shared_env`] with mutable access (e.g. to restart containerd). A panic
/// inside `f` dumps the logs and is re-raised.
pub fn with_shared_env_mut<R>(f: impl FnOnce(&mut TestEnv) -> R) -> R {
    with_shared_env(|_| ());
    let cell = SHARED.get().expect("initialized by with_shared_env");
    let mut guard = cell.lock().unwrap_or_else(|e| e.into_inner());
    let env = guard.as_mut().expect("shared env torn down already");
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut *env))) {
        Ok(r) => r,
        Err(p) => {
            env.mark_failed();
            std::panic::resume_unwind(p)
        }
    }
}

// ---------------------------------------------------------------------------
// Killing and restarting the daemon (tests/containerd.rs)
// ---------------------------------------------------------------------------

impl TestEnv {
    /// The pid of the daemon this env started, while it runs.
    pub fn daemon_pid(&self) -> Option<u32> {
        let mut d = self.daemon.lock().unwrap_or_else(|e| e.into_inner());
        let daemon = d.as_mut()?;
        if daemon.is_running() {
            daemon.pid()
        } else {
            None
        }
    }

    /// SIGKILLs the daemon (no shutdown of any kind, as in a crash or an OOM
    /// kill) and reaps it. Its sockets and store stay as they are. Errors if no
    /// daemon runs. Restart it with [`TestEnv::restart_daemon`].
    pub fn kill_daemon(&self) -> Result<u32> {
        let mut d = self.daemon.lock().unwrap_or_else(|e| e.into_inner());
        d.as_mut().context("no daemon was started")?.kill()
    }

    /// Starts a new daemon on the same store root, sockets and log after
    /// [`TestEnv::kill_daemon`] (or a crash), and waits until containerd reaches
    /// it and it is subscribed to containerd's task events.
    pub fn restart_daemon(&self) -> Result<()> {
        {
            let mut d = self.daemon.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(daemon) = d.as_mut() {
                if daemon.is_running() {
                    bail!(
                        "restart_daemon: the daemon is still running (pid {:?})",
                        daemon.pid()
                    );
                }
            }
            // Dropping a stopped Daemon does nothing more.
            d.take();
        }
        self.start_daemon()?;
        self.wait_events_subscribed()?;
        self.wait_snapshotter_backend_reachable()
    }

    /// Waits until containerd's proxy connection to the daemon carries RPCs
    /// again. containerd 1.6's `snapshots ls` ([`TestEnv::wait_snapshotter_reachable`])
    /// is answered from containerd's own metadata and never reaches the proxy, so
    /// after the daemon restarts that probe passes while containerd's gRPC channel
    /// is still in reconnect backoff (up to 3 s) and fails fast with `connection
    /// refused`. `ctr snapshots usage` calls the snapshotter's `Usage` for every
    /// snapshot of a namespace; this polls it in every namespace until it succeeds
    /// in all of them (vacuous if no namespace has a layerstack snapshot).
    pub fn wait_snapshotter_backend_reachable(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let t = Duration::from_secs(20);
        loop {
            let nss = self
                .containerd()
                .ctr_timeout("default", &["namespaces", "ls", "-q"], t)?;
            let nss = ensure_success("ctr namespaces ls", nss)?;
            let mut failure = None;
            for ns in stdout(&nss)
                .lines()
                .map(str::trim)
                .filter(|s| !s.is_empty())
            {
                let out = self.containerd().ctr_timeout(
                    ns,
                    &["snapshots", "--snapshotter", SNAPSHOTTER, "usage"],
                    t,
                )?;
                if !out.status.success() {
                    failure = Some(format!("ctr -n {ns} snapshots usage: {}", describe(&out)));
                    break;
                }
            }
            let Some(failure) = failure else {
                return Ok(());
            };
            if Instant::now() >= deadline {
                self.dump_logs();
                bail!("containerd cannot reach the {SNAPSHOTTER} snapshotter after 30s: {failure}");
            }
            thread::sleep(Duration::from_millis(100));
        }
    }
}

// ---------------------------------------------------------------------------
// Fan-out helpers (tests and the benchmark program)
// ---------------------------------------------------------------------------

/// Runs `f(i)` for `i` in `0..n` on `threads` threads; the results in index
/// order. Errors: the first failed `f(i)` in index order.
pub fn parallel<T: Send>(
    n: usize,
    threads: usize,
    f: impl Fn(usize) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<Result<T>>>> =
        (0..n).map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= n {
                    break;
                }
                let r = f(i);
                *results[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            });
        }
    });
    results
        .into_iter()
        .map(|m| {
            m.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .unwrap_or_else(|| bail!("not run"))
        })
        .collect()
}

/// The resident set of process `pid` in KiB (`VmRSS` of `/proc/PID/status`,
/// proc(5)). Errors: the process is gone, or the line is missing.
pub fn vm_rss_kib(pid: u32) -> Result<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let l = s
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS in /proc/PID/status")?;
    Ok(l.split_whitespace()
        .nth(1)
        .context("VmRSS without a value")?
        .parse()?)
}

/// Writes the reliability record of a suite's top-level test
/// (`docs/reliability.md`, `scripts/reliability.sh`): when
/// `$LAYERSTACK_RELIABILITY_OUT` names a directory, `<dir>/<id>.json` holds
/// `{"id", "guarantee", "test", "figures"}`; otherwise nothing. Call it only
/// after the test's assertions passed. `test` is the exact command that runs
/// the test; `figures` a JSON object of numbers or short strings.
/// Errors: the directory cannot be written.
pub fn record(id: &str, guarantee: &str, test: &str, figures: serde_json::Value) -> Result<()> {
    let Some(dir) = std::env::var_os("LAYERSTACK_RELIABILITY_OUT") else {
        return Ok(());
    };
    let dir = PathBuf::from(dir);
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let v = serde_json::json!({"id": id, "guarantee": guarantee, "test": test, "figures": figures});
    let p = dir.join(format!("{id}.json"));
    fs::write(&p, serde_json::to_vec_pretty(&v)?)
        .with_context(|| format!("writing {}", p.display()))
}

/// Builds `integration/wasm/fsops.c` (a WASI command that runs file
/// operations given as arguments: `write PATH TEXT`, `mkdir PATH`, `cat
/// PATH`, …) into `out` with Debian's clang for wasm32-wasi, `-O2`; the
/// module's bytes. Errors: clang missing or failing (the message names the
/// packages `scripts/install-deps.sh` installs: clang lld-14 wasi-libc
/// libclang-rt-14-dev-wasm32), `out` unreadable.
pub fn build_fsops_wasm(out: &Path) -> Result<Vec<u8>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("wasm/fsops.c");
    let o = Command::new("clang")
        .args([
            "--target=wasm32-wasi",
            "--sysroot=/usr",
            "-fuse-ld=lld",
            "-O2",
            "-o",
        ])
        .arg(out)
        .arg(&src)
        .stdin(Stdio::null())
        .output()
        .context(
            "running clang (apt-get install clang lld-14 wasi-libc libclang-rt-14-dev-wasm32)",
        )?;
    anyhow::ensure!(
        o.status.success(),
        "clang could not build {} for wasm32-wasi (apt-get install clang lld-14 wasi-libc libclang-rt-14-dev-wasm32): {}",
        src.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    fs::read(out).with_context(|| format!("reading {}", out.display()))
}
