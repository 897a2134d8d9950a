//! Reliability (issue 22) against the real daemon with NO containerd:
//!
//! * disk full for real — the store on a small loop-mounted ext4 filled
//!   during a Mode B publish, a squash, a base import and a database-only
//!   write: each ends with a clear outcome naming the full disk (error kind
//!   `no_space`, or a publish's outcome `failed` saying so), nothing is
//!   half-visible (branch heads and logs unchanged, no new stack, staging
//!   empty, `layerstack fsck` clean) and everything works again once space
//!   is freed;
//! * memory is bounded — the daemon's RSS after a 100,000-file session comes
//!   back near its idle figure;
//! * concurrency against a model with publisher *processes* — N separate
//!   processes (this test binary re-executed), each an admin-API client
//!   publishing one random changeset through a daemon-owned session on one
//!   branch head; the history is replayed on the sequential model the
//!   engine's `tests::model` uses (`layerstack_integration::model`).
//!
//! Needs root, `mkfs.ext4`, loop devices (`mount -o loop`) and a static
//! `/bin/busybox`; fails under `CI=true` without them.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use layerstack_integration::*;
use serde_json::{json, Value};

/// A small ext4 filesystem in a sparse file under `/var/tmp`, loop-mounted
/// at a directory. Dropping it unmounts it (lazily when busy) and deletes
/// the file — also when the test failed.
struct LoopExt4 {
    image: PathBuf,
    mnt: PathBuf,
}

impl LoopExt4 {
    /// `truncate -s MIB`, `mkfs.ext4 -m 0` (no blocks reserved for root:
    /// the daemon runs as root), `mount -o loop` at `mnt`.
    fn mount(mnt: &Path, mib: u64) -> Result<LoopExt4> {
        let image = tmp_base().join(format!(
            "lst-diskfull-{}-{}.img",
            std::process::id(),
            Instant::now().elapsed().as_nanos()
        ));
        std::fs::File::create(&image)?.set_len(mib << 20)?;
        let fs = LoopExt4 {
            image,
            mnt: mnt.to_path_buf(),
        };
        ensure_success(
            "mkfs.ext4",
            run_with_timeout(
                Command::new("mkfs.ext4")
                    .args(["-q", "-F", "-m", "0"])
                    .arg(&fs.image),
                CMD_TIMEOUT,
            )?,
        )?;
        std::fs::create_dir_all(mnt)?;
        ensure_success(
            "mount -o loop",
            run_with_timeout(
                Command::new("mount")
                    .args(["-o", "loop"])
                    .arg(&fs.image)
                    .arg(mnt),
                CMD_TIMEOUT,
            )?,
        )?;
        Ok(fs)
    }
}

impl Drop for LoopExt4 {
    fn drop(&mut self) {
        // Whatever is mounted below first (the daemon's overlays), then it.
        unmount_all_under(&self.mnt);
        let _ = nix::mount::umount2(&self.mnt, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_file(&self.image);
    }
}

/// True when this machine can run the disk-full test; otherwise panics
/// under `CI=true` (never a silent skip) or prints why and answers false.
fn can_loop_mount() -> bool {
    if !require_root() {
        return false;
    }
    let mut missing = Vec::new();
    if which("mkfs.ext4").is_none() {
        missing.push("mkfs.ext4 (apt-get install e2fsprogs)");
    }
    if !Path::new("/dev/loop-control").exists() {
        missing.push("loop devices (/dev/loop-control; modprobe loop)");
    }
    if missing.is_empty() {
        return true;
    }
    let msg = format!("the disk-full test needs {}", missing.join(", "));
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true and {msg}");
    }
    eprintln!("SKIPPED: {msg}");
    false
}

/// Fills the filesystem of `path`'s directory: appends to `path` until
/// `ENOSPC`, in 1 MiB then 4 KiB writes. Answers the bytes written.
fn fill(path: &Path) -> Result<u64> {
    let mut f = OpenOptions::new().create(true).append(true).open(path)?;
    let mut total = 0u64;
    for chunk in [1usize << 20, 4096, 512] {
        let buf = vec![0x5au8; chunk];
        loop {
            match f.write(&buf) {
                Ok(0) => break,
                Ok(n) => total += n as u64,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => return Err(e).context(format!("filling {}", path.display())),
            }
        }
    }
    // Data already in the page cache must reach the disk now, not during the
    // operation under test.
    let _ = f.sync_all();
    Ok(total)
}

/// [`fill`], then gives `leave` bytes back (the ballast truncated): the
/// operation under test starts and runs out of space part way.
fn fill_leaving(path: &Path, leave: u64) -> Result<u64> {
    let total = fill(path)?;
    let f = OpenOptions::new().write(true).open(path)?;
    f.set_len(total.saturating_sub(leave))?;
    f.sync_all()?;
    Ok(total.saturating_sub(leave))
}

/// The error kind of a failed `layerstack --error-format json` run.
fn error_kind(o: &Output) -> Option<String> {
    let err = String::from_utf8_lossy(&o.stderr);
    let line = err.lines().rev().find(|l| !l.trim().is_empty())?;
    let v: Value = serde_json::from_str(line).ok()?;
    v["error"]["kind"].as_str().map(str::to_string)
}

fn says_disk_full(o: &Output) -> bool {
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
    .to_lowercase();
    all.contains("no space left on device") && all.contains("free space")
}

/// A clear disk-full refusal: non-zero exit, kind `no_space`, the message
/// naming the full disk and what to do.
fn ensure_no_space(what: &str, o: &Output) -> Result<()> {
    ensure!(
        !o.status.success(),
        "{what} succeeded on a full disk: {}",
        describe(o)
    );
    ensure!(
        error_kind(o).as_deref() == Some("no_space") && says_disk_full(o),
        "{what} on a full disk: want kind no_space naming the full disk and what to do; got {}",
        describe(o)
    );
    eprintln!("{what} on a full disk: {}", describe(o));
    Ok(())
}

struct Store<'a> {
    env: &'a StandaloneDaemon,
}

impl Store<'_> {
    /// `layerstack --error-format json ARGS…`.
    fn ls(&self, args: &[&str]) -> Result<Output> {
        let mut a = vec!["--error-format", "json"];
        a.extend_from_slice(args);
        self.env.layerstack(&a)
    }

    /// `session run STACK -- sh -c SCRIPT` (publishes on exit).
    fn run_sh(&self, stack: &str, script: &str) -> Result<Output> {
        self.ls(&["session", "run", stack, "--", "sh", "-c", script])
    }

    fn ok(&self, what: &str, args: &[&str]) -> Result<Output> {
        ensure_success(what, self.ls(args)?)
    }

    fn json(&self, args: &[&str]) -> Result<Value> {
        let o = self.ok(&args.join(" "), args)?;
        serde_json::from_slice(&o.stdout).with_context(|| describe(&o))
    }

    /// `fsck --json` must find nothing.
    fn fsck_clean(&self, when: &str) -> Result<()> {
        let o = self.ls(&["fsck", "--json"])?;
        ensure!(o.status.success(), "fsck {when}: {}", describe(&o));
        Ok(())
    }

    /// How many live leases `fsck` counts.
    fn leases(&self) -> Result<u64> {
        let v = self.json(&["fsck", "--json"])?;
        v["leases"]
            .as_u64()
            .with_context(|| format!("fsck --json without leases: {v}"))
    }

    /// The stack's branches and its main log: what must not change when an
    /// operation is refused.
    fn visible(&self, stack: &str) -> Result<(Value, Value)> {
        Ok((
            self.json(&["branch", "ls", stack, "--json"])?,
            self.json(&["log", &format!("{stack}@main"), "--json"])?,
        ))
    }
}

const DISK_FULL_TEST: &str =
    "cargo test -p layerstack-integration --test reliability disk_full_during_publish_squash_and_import";

#[test]
fn disk_full_during_publish_squash_and_import() -> Result<()> {
    if !can_loop_mount() {
        return Ok(());
    }
    let mut disk: Option<LoopExt4> = None;
    // Declared after `disk`: the daemon stops before the disk is unmounted.
    let mut env = StandaloneDaemon::start_with(true, |dir| {
        disk = Some(LoopExt4::mount(&dir.join("root"), 64)?);
        Ok(Vec::new())
    })?;
    let disk = disk.context("mounted")?;
    let s = Store { env: &env };
    let ballast = disk.mnt.join("ballast");
    let free_ballast = || -> Result<()> {
        std::fs::remove_file(&ballast)?;
        nix::unistd::sync();
        Ok(())
    };
    let started = Instant::now();
    let mut figures = serde_json::Map::new();

    // A base: busybox (2 MB).
    let src = env.dir().join("rootfs");
    busybox_tree(
        &src,
        &["sh", "echo", "cat", "mkdir", "test", "seq", "sed"],
        &["srv"],
    )?;
    let o = s.ok(
        "base import",
        &["base", "import", src.to_str().context("utf-8")?],
    )?;
    let stack = stdout(&o).trim().to_string();
    let main = format!("{stack}@main");

    // (1) A Mode B session's publish on a full disk.
    let id = stdout(&s.ok("session create", &["session", "create", &main])?)
        .trim()
        .to_string();
    s.ok(
        "session exec",
        &[
            "session",
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "mkdir -p /w && for i in $(seq 1 5000); do echo file $i > /w/f$i; done && cat /bin/busybox > /w/big",
        ],
    )?;
    let before = s.visible(&stack)?;
    figures.insert("ballast_bytes_publish".into(), json!(fill(&ballast)?));
    let o = s.ls(&["session", "close", &id, "--publish"])?;
    ensure!(
        !o.status.success(),
        "a publish on a full disk: {}",
        describe(&o)
    );
    // Outcome `failed` naming the full disk, or — when not even the outcome
    // could be written — error kind no_space and no outcome (the run goes on).
    ensure!(
        says_disk_full(&o)
            && (error_kind(&o).is_none() || error_kind(&o).as_deref() == Some("no_space")),
        "the failed publish names the full disk and what to do: {}",
        describe(&o)
    );
    eprintln!("publish on a full disk: {}", describe(&o));
    figures.insert(
        "publish_on_full_disk".into(),
        json!(if error_kind(&o).is_some() {
            "error no_space"
        } else {
            "outcome failed"
        }),
    );
    ensure!(
        s.visible(&stack)? == before,
        "a failed publish left the branch as it was"
    );
    s.fsck_clean("after a publish on a full disk")?;
    free_ballast()?;
    let o = s.ok(
        "publish again once space is freed",
        &["publish", "--session", &id],
    )?;
    ensure!(
        String::from_utf8_lossy(&o.stdout).contains("committed")
            || String::from_utf8_lossy(&o.stderr).contains("committed"),
        "{}",
        describe(&o)
    );
    let o = s.ok(
        "read the publish",
        &["session", "run", &main, "--", "cat", "/w/f5000"],
    )?;
    ensure!(stdout(&o) == "file 5000\n", "{}", describe(&o));

    // (1b) A publish that runs out of space part way, in its apply step: a
    // 0.9 MB text file of 9,000 lines (under the merge limits: 1 MiB, 10,000
    // lines) both sessions edit on
    // separate lines, so the second publish writes a merged 0.9 MB file into
    // its upper; 256 KiB free (room for the database, none for the merge). It must end with outcome
    // `failed` naming the full disk — not an error with no outcome — keep
    // the upper, leave the branch as it was, and merge once space is freed.
    ensure_success(
        "the big text file",
        s.run_sh(
            &main,
            "seq 1 9000 | sed 's/$/ 012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789/' > /srv/big.txt",
        )?,
    )?;
    let a = stdout(&s.ok("session create a", &["session", "create", &main])?)
        .trim()
        .to_string();
    let b = stdout(&s.ok("session create b", &["session", "create", &main])?)
        .trim()
        .to_string();
    s.ok(
        "a edits line 2",
        &[
            "session",
            "exec",
            &a,
            "--",
            "sh",
            "-c",
            "sed -i '2s/.*/a was here/' /srv/big.txt",
        ],
    )?;
    s.ok(
        "b edits line 8999",
        &[
            "session",
            "exec",
            &b,
            "--",
            "sh",
            "-c",
            "sed -i '8999s/.*/b was here/' /srv/big.txt",
        ],
    )?;
    s.ok("a publishes", &["session", "close", &a, "--publish"])?;
    let before = s.visible(&stack)?;
    figures.insert(
        "ballast_bytes_merge".into(),
        json!(fill_leaving(&ballast, 256 << 10)?),
    );
    let o = s.ls(&["session", "close", &b, "--publish", "--json"])?;
    let v: Value = serde_json::from_slice(&o.stdout).with_context(|| {
        format!(
            "a merge publish on a full disk answers an outcome: {}",
            describe(&o)
        )
    })?;
    ensure!(
        v["outcome"] == "failed"
            && v["message"].as_str().is_some_and(|m| {
                let m = m.to_lowercase();
                m.contains("no space left on device")
                    && m.contains("free space")
                    && m.contains("merged file")
            }),
        "a merge publish that runs out part way — in its merge write — ends `failed` naming the full disk and what to do: {v}"
    );
    eprintln!("merge publish on a full disk: {}", v["message"]);
    figures.insert("merge_publish_on_full_disk".into(), json!("outcome failed"));
    ensure!(
        s.visible(&stack)? == before,
        "a failed merge publish left the branch as it was"
    );
    s.fsck_clean("after a merge publish on a full disk")?;
    free_ballast()?;
    let o = s.ok(
        "the merge publish again once space is freed",
        &["publish", "--session", &b, "--json"],
    )?;
    let v: Value = serde_json::from_slice(&o.stdout).with_context(|| describe(&o))?;
    ensure!(v["outcome"] == "merged", "the kept upper merges: {v}");
    let o = s.ok(
        "read the merge",
        &[
            "session",
            "run",
            &main,
            "--",
            "sed",
            "-n",
            "2p;8999p",
            "/srv/big.txt",
        ],
    )?;
    ensure!(stdout(&o) == "a was here\nb was here\n", "{}", describe(&o));

    // (2) A squash on a full disk: a branch deeper than `squash_keep` (8)
    // first, 200 directories a layer (the squash links files, but makes
    // every directory: ~2 MB of directory blocks), 256 KiB left: it runs out
    // part way.
    for i in 0..10 {
        ensure_success(
            "session run",
            s.run_sh(
                &main,
                &format!(
                    "for j in $(seq 1 200); do mkdir -p /d{i}/$j && echo $j > /d{i}/$j/f; done"
                ),
            )?,
        )?;
    }
    let before = s.visible(&stack)?;
    figures.insert(
        "ballast_bytes_squash".into(),
        json!(fill_leaving(&ballast, 256 << 10)?),
    );
    let o = s.ls(&["squash", &main])?;
    ensure_no_space("squash", &o)?;
    ensure!(
        s.visible(&stack)? == before,
        "a failed squash changed what the branch shows"
    );
    ensure!(
        dir_is_empty(&disk.mnt.join("staging"))?,
        "a failed squash left its staging"
    );
    s.fsck_clean("after a squash on a full disk")?;
    free_ballast()?;
    s.ok("squash once space is freed", &["squash", &main])?;

    // (3) A base import bigger than the free space.
    let big = env.dir().join("big-rootfs");
    busybox_tree(&big, &["sh"], &["data"])?;
    for i in 0..8 {
        std::fs::write(
            big.join(format!("data/blob{i}")),
            vec![i as u8 + 1; 1 << 20],
        )?;
    }
    let stacks = s.json(&["stack", "ls", "--json"])?;
    // 2 MiB free for a 10 MiB tree: the import runs out part way through.
    figures.insert(
        "ballast_bytes_import".into(),
        json!(fill_leaving(&ballast, 2 << 20)?),
    );
    let o = s.ls(&["base", "import", big.to_str().context("utf-8")?])?;
    ensure_no_space("base import", &o)?;
    ensure!(
        s.json(&["stack", "ls", "--json"])? == stacks,
        "a failed import made a stack"
    );
    ensure!(
        dir_is_empty(&disk.mnt.join("staging"))?,
        "a failed import left its staging"
    );
    s.fsck_clean("after an import on a full disk")?;

    fill(&ballast)?;
    // (4) A database-only write with every block taken (SQLITE_FULL): refused
    // as no_space or done, never internal.
    let o = s.ls(&[
        "branch",
        "create",
        &format!("{stack}@full"),
        "--from",
        "main",
    ])?;
    let db_write = if o.status.success() {
        "done (the WAL had room)".to_string()
    } else {
        ensure_no_space("branch create", &o)?;
        "no_space".to_string()
    };
    figures.insert("database_write_on_full_disk".into(), json!(db_write));
    s.fsck_clean("after a database write on a full disk")?;

    // (5) The daemon killed and restarted on the full disk (its store lock,
    // database open, migrations check and startup sweep): it serves.
    let before = s.visible(&stack)?;
    env.kill_daemon()?;
    env.restart_daemon()
        .context("the daemon restarted on a full store filesystem")?;
    let s = Store { env: &env };
    s.fsck_clean("after a restart on a full disk")?;
    ensure!(
        s.visible(&stack)? == before,
        "the restart changed the branch"
    );
    free_ballast()?;
    s.ok(
        "import once space is freed",
        &["base", "import", big.to_str().context("utf-8")?],
    )?;

    // Publishing works again.
    let o = ensure_success("session run", s.run_sh(&main, "echo after > /after")?)?;
    ensure!(
        String::from_utf8_lossy(&o.stderr).contains("committed"),
        "{}",
        describe(&o)
    );
    s.fsck_clean("after publishing again")?;

    // (6) An export whose OCI layout directory is on the full filesystem
    // (~9 MB of blobs, 512 KiB left): it runs out part way through writing a
    // blob, fails with kind no_space naming the directory's full filesystem,
    // and removes what it wrote (the directory it made included); the
    // daemon's export lease is released. Once space is freed it exports.
    let out = disk.mnt.join("export-out");
    let before_export = s.visible(&stack)?;
    let leases = s.leases()?;
    figures.insert(
        "ballast_bytes_export".into(),
        json!(fill_leaving(&ballast, 512 << 10)?),
    );
    let o = s.ls(&[
        "export",
        &main,
        "--oci-layout",
        out.to_str().context("utf-8")?,
    ])?;
    ensure_no_space("export", &o)?;
    ensure!(
        !out.exists(),
        "a failed export left its output directory {}",
        out.display()
    );
    ensure!(
        s.visible(&stack)? == before_export,
        "a failed export changed the branch"
    );
    s.fsck_clean("after an export on a full disk")?;
    // The export's lease goes when the daemon sees the client gone.
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.leases()? != leases && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    ensure!(
        s.leases()? == leases,
        "a failed export kept its lease: {} leases, {leases} before",
        s.leases()?
    );
    figures.insert(
        "export_on_full_disk".into(),
        json!("error no_space, output directory removed"),
    );
    free_ballast()?;
    let o = s.ok(
        "export once space is freed",
        &[
            "export",
            &main,
            "--oci-layout",
            out.to_str().context("utf-8")?,
            "--json",
        ],
    )?;
    let v: Value = serde_json::from_slice(&o.stdout).with_context(|| describe(&o))?;
    ensure!(
        out.join("index.json").is_file(),
        "the export once space is freed wrote no index.json: {v}"
    );
    std::fs::remove_dir_all(&out)?;
    s.fsck_clean("at the end")?;

    figures.insert("filesystem_mib".into(), json!(64));
    figures.insert("operations_refused".into(), json!(4));
    figures.insert("restarts_on_full_disk".into(), json!(1));
    figures.insert(
        "seconds".into(),
        json!((started.elapsed().as_secs_f64() * 10.0).round() / 10.0),
    );
    record(
        "disk-full",
        "On a full store filesystem (64 MiB loop ext4) a publish ends `failed` (or fails with kind no_space when not even that outcome fits) — one that runs out part way, writing a merged file, always ends `failed` with its upper kept and merges once space is freed —, a squash or a base import running out part way fails with kind no_space, as does an export whose output directory is on it, each naming the full disk and what to do; nothing is half-visible (heads, logs, stacks unchanged, staging empty, no export output left, fsck clean), the daemon restarts on the full disk, and all work again once space is freed",
        DISK_FULL_TEST,
        Value::Object(figures),
    )?;
    drop(env);
    drop(disk);
    Ok(())
}

/// Runs `f` while sampling `pid`'s `VmRSS` every 50 ms: its answer and the
/// highest figure seen (KiB, at least `floor`).
fn with_peak<T>(pid: u32, floor: u64, f: impl FnOnce() -> T) -> (T, u64) {
    let peak = AtomicU64::new(floor);
    let done = AtomicBool::new(false);
    let out = std::thread::scope(|sc| {
        sc.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                if let Ok(r) = vm_rss_kib(pid) {
                    peak.fetch_max(r, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let out = f();
        done.store(true, Ordering::Relaxed);
        out
    });
    let last = vm_rss_kib(pid).unwrap_or(0);
    (out, peak.load(Ordering::Relaxed).max(last))
}

/// `pid`'s `VmRSS` (KiB) once it is within [`RSS_SETTLED_KIB`] of `idle`,
/// or after 15 s: the daemon looks at its free heap every 2 s, frees the
/// store's SQLite caches once it wrote nothing for a whole interval, and
/// tokio ends blocking threads idle for 10 s (their stacks).
fn settle(pid: u32, idle: u64) -> Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut rss = vm_rss_kib(pid)?;
    while rss > idle + RSS_SETTLED_KIB && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        rss = vm_rss_kib(pid)?;
    }
    Ok(rss)
}

/// Within this much of idle (KiB), RSS counts as back.
const RSS_SETTLED_KIB: u64 = 8 * 1024;

const MEMORY_TEST: &str = "cargo test -p layerstack-integration --test reliability daemon_rss_returns_near_idle_after_a_100000_file_session";

/// How far above its idle RSS the daemon may stay after the session or the
/// burst, KiB. Measured (debug build): +4.6 MiB after the 100,000-file
/// session, +17 MiB after the burst (its SQLite caches freed; what stays is
/// glibc's fragments and what the 256 sessions' publishes left live); before
/// the daemon returned memory: +101 MiB after the session alone, +52 MiB
/// more after the burst.
const RSS_AFTER_BOUND_KIB: u64 = 32 * 1024;

#[test]
fn daemon_rss_returns_near_idle_after_a_100000_file_session() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let env = StandaloneDaemon::start()?;
    let s = Store { env: &env };
    let src = env.dir().join("rootfs");
    busybox_tree(&src, &["sh", "mkdir", "test"], &[])?;
    let o = s.ok(
        "base import",
        &["base", "import", src.to_str().context("utf-8")?],
    )?;
    let stack = stdout(&o).trim().to_string();
    let pid = env.daemon().pid().context("daemon pid")?;
    // Idle: after a warm-up session, settled.
    s.ok(
        "warm-up",
        &["session", "run", &stack, "--", "test", "-d", "/"],
    )?;
    std::thread::sleep(Duration::from_secs(3));
    let idle = vm_rss_kib(pid)?;

    let started = Instant::now();
    let (o, peak) = with_peak(pid, idle, || {
        s.run_sh(
            &stack,
            "mkdir /w && cd /w && i=0 && while [ $i -lt 100000 ]; do : > f$i; i=$((i+1)); done",
        )
    });
    let o = o?;
    let session_s = started.elapsed().as_secs_f64();
    ensure!(
        o.status.success() && String::from_utf8_lossy(&o.stderr).contains("100001 clean"),
        "the 100,000-file session published: {}",
        describe(&o)
    );
    let at_end = vm_rss_kib(pid)?;
    let limit = idle + RSS_AFTER_BOUND_KIB;
    let after = settle(pid, idle)?;
    eprintln!(
        "daemon VmRSS: idle {idle} KiB, peak {peak} KiB, at the end of the session {at_end} KiB, after {after} KiB (bound idle + {RSS_AFTER_BOUND_KIB} KiB); session {session_s:.1} s"
    );
    ensure!(
        after <= limit,
        "daemon RSS stayed at {after} KiB after the session: idle was {idle} KiB, peak {peak} KiB (bound idle + {RSS_AFTER_BOUND_KIB} KiB)"
    );

    // A burst: 256 sessions, 16 at a time, 200 files each, all publishing
    // on the one branch (many threads, so many glibc arenas).
    let started = Instant::now();
    let (burst, burst_peak) = with_peak(pid, after, || {
        parallel(256, 16, |i| {
            let o = s.run_sh(
                &stack,
                &format!("mkdir /b{i} && i=0 && while [ $i -lt 200 ]; do : > /b{i}/f$i; i=$((i+1)); done"),
            )?;
            ensure!(o.status.success(), "burst session {i}: {}", describe(&o));
            Ok(())
        })
    });
    burst?;
    let burst_s = started.elapsed().as_secs_f64();
    let after_burst = settle(pid, idle)?;
    eprintln!(
        "daemon VmRSS: burst of 256 sessions peak {burst_peak} KiB, after {after_burst} KiB ({burst_s:.1} s)"
    );
    ensure!(
        after_burst <= limit,
        "daemon RSS stayed at {after_burst} KiB after a burst of 256 sessions: idle was {idle} KiB, peak {burst_peak} KiB (bound idle + {RSS_AFTER_BOUND_KIB} KiB)"
    );
    record(
        "memory-bound",
        "After a 100,000-file Mode B session, and after a burst of 256 concurrent sessions, the daemon's RSS returns to within 32 MiB of its idle figure within 15 s",
        MEMORY_TEST,
        json!({
            "build": if bin_path(DAEMON_BIN)?.to_string_lossy().contains("/release/") { "release" } else { "debug" },
            "files": 100000,
            "idle_kib": idle,
            "peak_kib": peak,
            "at_end_kib": at_end,
            "after_kib": after,
            "burst_sessions": 256,
            "burst_peak_kib": burst_peak,
            "after_burst_kib": after_burst,
            "bound_kib": RSS_AFTER_BOUND_KIB,
            "session_seconds": session_s,
            "burst_seconds": burst_s,
        }),
    )?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Concurrency against a model, with publisher processes
// ---------------------------------------------------------------------------

/// Set in a publisher process: `ADMIN_SOCKET|STACK|SEED|INDEX`.
const MODEL_CHILD_ENV: &str = "LAYERSTACK_MODEL_CHILD";
/// The number of publisher processes (default [`MODEL_PROCESSES_CI`]; the
/// full run, scripts/reliability.sh, sets 256).
const MODEL_PROCESSES_ENV: &str = "LAYERSTACK_MODEL_PROCESSES";
const MODEL_PROCESSES_CI: usize = 128;
/// The line of a publisher process's stdout that carries its report.
const MODEL_REPORT: &str = "model-publisher-report ";
/// Where the race's files live in the base (`/m/shared/f3.txt`, `/m/own/p7.txt`).
const MODEL_DIR: &str = "m";
const MODEL_TEST: &str = "cargo test -p layerstack-integration --test reliability publisher_processes_leave_the_history_a_sequential_model_predicts";

type AdminClient = layerstack_api::AdminClient<tonic::transport::Channel>;

/// A daemon-owned sandbox session on `stack`'s main branch, as the SDK's
/// `ls.sandbox(stack)` makes it (waiting for a slot under the daemon's cap).
async fn model_session(c: &mut AdminClient, stack: &str, name: &str) -> Result<i64> {
    let r = c
        .create_session(layerstack_api::CreateSessionRequest {
            stack: stack.into(),
            branch: "main".into(),
            name: name.into(),
            sandbox: Some(Default::default()),
            wait_ms: 120_000,
            ..Default::default()
        })
        .await
        .with_context(|| format!("create session {name}"))?
        .into_inner();
    Ok(r.session.context("no session in the reply")?.id)
}

/// The race's tree as session `id` sees it: the regular files below
/// `/m` (one DownloadTar), paths relative to it.
async fn model_tree(c: &mut AdminClient, id: i64) -> Result<layerstack_integration::model::Tree> {
    let mut s = c
        .download_tar(layerstack_api::DownloadTarRequest {
            session_id: id,
            path: format!("/{MODEL_DIR}"),
        })
        .await?
        .into_inner();
    let mut bytes = Vec::new();
    while let Some(ch) = s.message().await? {
        bytes.extend(ch.data);
    }
    let mut tree = layerstack_integration::model::Tree::new();
    let mut ar = tar::Archive::new(bytes.as_slice());
    for e in ar.entries()? {
        let mut e = e?;
        if e.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        let path = e.path()?.to_string_lossy().into_owned();
        let rel = path
            .strip_prefix(&format!("{MODEL_DIR}/"))
            .with_context(|| format!("{path} outside {MODEL_DIR}/"))?
            .to_string();
        let mut content = Vec::new();
        std::io::Read::read_to_end(&mut e, &mut content)?;
        tree.insert(rel, layerstack_integration::model::lines_of(&content));
    }
    Ok(tree)
}

/// One publisher process's work: waits for the go (its stdin closed), then,
/// after a random stagger, makes a daemon-owned session on main, reads the
/// tree it leased, writes a random changeset over it through the file RPCs,
/// closes the session with PUBLISH, and prints its report (session, outcome,
/// layer, changeset, the tree it leased) as one JSON line.
async fn model_publisher(admin: &str, stack: &str, seed: u64, i: usize) -> Result<()> {
    use layerstack_integration::model::{Changeset, Rng, Write};
    let mut rng = Rng::for_publisher(seed, i);
    let mut c = layerstack_api::connect(admin).await?;
    // The go: all processes are started.
    std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new())?;
    // Stagger the starts so the sessions lease different heads.
    tokio::time::sleep(Duration::from_millis(rng.below(1500) as u64)).await;
    let id = model_session(&mut c, stack, &format!("model-p{i}")).await?;
    let base = model_tree(&mut c, id).await?;
    let cs = Changeset::draw(&mut rng, i, &base);
    for w in cs.writes(&base) {
        match w {
            Write::File(path, data) => {
                let msgs = vec![
                    layerstack_api::WriteFileRequest {
                        header: Some(layerstack_api::WriteFileHeader {
                            session_id: id,
                            path: format!("/{MODEL_DIR}/{path}"),
                            mode: 0o644,
                            make_parents: true,
                            ..Default::default()
                        }),
                        data: Vec::new(),
                    },
                    layerstack_api::WriteFileRequest { header: None, data },
                ];
                c.write_file(tokio_stream::iter(msgs))
                    .await
                    .with_context(|| format!("write {path}"))?;
            }
            Write::Delete(path) => {
                c.remove_path(layerstack_api::RemovePathRequest {
                    session_id: id,
                    path: format!("/{MODEL_DIR}/{path}"),
                    recursive: false,
                })
                .await
                .with_context(|| format!("remove {path}"))?;
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(rng.below(50) as u64)).await;
    let s = c
        .close_session(layerstack_api::CloseSessionRequest {
            session_id: id,
            action: layerstack_api::EndAction::Publish as i32,
            reason: format!("model publisher {i}"),
            ..Default::default()
        })
        .await
        .context("close session --publish")?
        .into_inner();
    let report = json!({
        "index": i,
        "session": s.id,
        "outcome": s.outcome,
        "layer": s.layer,
        "message": s.message,
        "changeset": cs,
        "base": base,
    });
    println!("{MODEL_REPORT}{report}");
    Ok(())
}

/// The publisher process: run by
/// [`publisher_processes_leave_the_history_a_sequential_model_predicts`]
/// (this test binary re-executed with `--ignored --exact`), never alone.
#[test]
#[ignore = "a publisher process of the model test: it runs it, it never runs alone"]
fn model_publisher_process() -> Result<()> {
    let Ok(spec) = std::env::var(MODEL_CHILD_ENV) else {
        eprintln!("model_publisher_process: run by publisher_processes_leave_the_history_a_sequential_model_predicts only ({MODEL_CHILD_ENV} unset); nothing to do");
        return Ok(());
    };
    let f: Vec<&str> = spec.split('|').collect();
    ensure!(f.len() == 4, "{MODEL_CHILD_ENV}={spec}");
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(model_publisher(f[0], f[1], f[2].parse()?, f[3].parse()?))
}

/// The race's sessions as the branch log lists their layers, oldest first,
/// squashes expanded into their members: (session, layer).
fn model_log_order(entries: &[layerstack_api::LogEntry], out: &mut Vec<(i64, i64)>) {
    for e in entries.iter().rev() {
        if e.members.is_empty() {
            if e.session != 0 {
                out.push((e.session, e.layer));
            }
        } else {
            model_log_order(&e.members, out);
        }
    }
}

/// Concurrency against a model (issue 22), with publishers as separate OS
/// processes, each talking to a real daemon over its admin API as an SDK user
/// does: N processes (this test binary re-executed) each make a daemon-owned
/// session on one branch head at about the same time, write a random
/// changeset (line edits of shared text files — overlapping, so some merge
/// and some conflict — deletes, re-creations and a file of its own) and close
/// with publish. The branch log is then replayed on the sequential model
/// (`layerstack_integration::model`, the engine's `tests::model` uses the
/// same): every committed changeset once in log order with the layer its
/// publisher was told, no rejected one; the model's head equals the daemon's
/// head; every tree a session leased is one the model passed through and no
/// later than its own place in the log; every rejection clashes (changes a file differently) with
/// something that landed after its lease, every merge with something that
/// landed between its lease and it, no plain commit does; `fsck --content`
/// clean.
#[test]
fn publisher_processes_leave_the_history_a_sequential_model_predicts() -> Result<()> {
    use layerstack_integration::model::{self as m, Changeset, Ended, Race};
    use std::collections::HashMap;
    if !require_root() {
        return Ok(());
    }
    let seed = m::seed_from_env();
    let n: usize = match std::env::var(MODEL_PROCESSES_ENV) {
        Ok(v) => v
            .parse()
            .with_context(|| format!("{MODEL_PROCESSES_ENV}={v}"))?,
        Err(_) => MODEL_PROCESSES_CI,
    };
    eprintln!("model processes: LAYERSTACK_MODEL_SEED={seed} {MODEL_PROCESSES_ENV}={n}");
    let env = StandaloneDaemon::start()?;
    let s = Store { env: &env };

    // The base: busybox and the shared files.
    let src = env.dir().join("rootfs");
    busybox_tree(&src, &["sh"], &[MODEL_DIR])?;
    let seed_tree = m::seed_tree();
    for (path, lines) in &seed_tree {
        let p = src.join(MODEL_DIR).join(path);
        std::fs::create_dir_all(p.parent().context("parent")?)?;
        std::fs::write(&p, m::text(lines))?;
    }
    let o = s.ok(
        "base import",
        &["base", "import", src.to_str().context("utf-8")?],
    )?;
    let stack = stdout(&o).trim().to_string();
    let admin = env
        .daemon()
        .admin_socket()
        .to_str()
        .context("utf-8")?
        .to_string();

    // The publishers: this binary re-executed, one process each; their
    // stdout and stderr to files (nothing blocks on a full pipe).
    let started = Instant::now();
    let exe = std::env::current_exe()?;
    let out_dir = env.dir().join("publishers");
    std::fs::create_dir_all(&out_dir)?;
    struct Publisher {
        child: std::process::Child,
        out: PathBuf,
        err: PathBuf,
    }
    // Kills (by pid) whatever publisher is still running when the test fails.
    struct Publishers(Vec<Publisher>);
    impl Drop for Publishers {
        fn drop(&mut self) {
            for p in &mut self.0 {
                if p.child.try_wait().ok().flatten().is_none() {
                    let _ = p.child.kill();
                    let _ = p.child.wait();
                }
            }
        }
    }
    let mut ps = Publishers(Vec::with_capacity(n));
    let mut stdins = Vec::with_capacity(n);
    for i in 0..n {
        let out = out_dir.join(format!("p{i}.out"));
        let err = out_dir.join(format!("p{i}.err"));
        let mut child = Command::new(&exe)
            .args([
                "--ignored",
                "--exact",
                "model_publisher_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(MODEL_CHILD_ENV, format!("{admin}|{stack}|{seed}|{i}"))
            .env_remove("RUST_LOG")
            .stdin(std::process::Stdio::piped())
            .stdout(std::fs::File::create(&out)?)
            .stderr(std::fs::File::create(&err)?)
            .spawn()
            .with_context(|| format!("starting publisher process {i}"))?;
        stdins.push(child.stdin.take().context("stdin")?);
        ps.0.push(Publisher { child, out, err });
    }
    let spawned = started.elapsed().as_secs_f64();
    // Go: every publisher's stdin closes at once.
    drop(stdins);
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut race = Race::default();
    let mut bases: HashMap<i64, m::Tree> = HashMap::new();
    let mut layers: HashMap<i64, i64> = HashMap::new();
    for (i, p) in ps.0.iter_mut().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now());
        let status = wait_timeout(&mut p.child, left)?
            .with_context(|| format!("publisher process {i} still runs after 600 s"))?;
        let out = std::fs::read_to_string(&p.out)?;
        let report = out
            .lines()
            // After libtest's `test model_publisher_process ... `.
            .find_map(|l| l.split_once(MODEL_REPORT).map(|(_, r)| r))
            .filter(|_| status.success());
        let Some(report) = report else {
            bail!(
                "publisher process {i} ended {status} without its report:\n{out}\n{}",
                std::fs::read_to_string(&p.err).unwrap_or_default()
            );
        };
        let r: Value = serde_json::from_str(report).with_context(|| report.to_string())?;
        let sid = r["session"].as_i64().context("session")?;
        let cs: Changeset = serde_json::from_value(r["changeset"].clone())?;
        let ended = match r["outcome"].as_str() {
            Some("committed") => Ended::Committed,
            Some("merged") => Ended::Merged,
            Some("conflict") => Ended::Rejected,
            _ => bail!("publisher {i}'s publish ended {r}"),
        };
        if ended != Ended::Rejected {
            layers.insert(sid, r["layer"].as_i64().context("layer")?);
        }
        bases.insert(sid, serde_json::from_value(r["base"].clone())?);
        race.add(sid, cs, ended)
            .map_err(|e| anyhow::anyhow!("{e} (seed {seed})"))?;
    }
    let raced = started.elapsed().as_secs_f64();

    // The branch log, through the API.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (entries, head) = rt.block_on(async {
        let mut c = layerstack_api::connect(&admin).await?;
        let mut st = c
            .log(layerstack_api::LogRequest {
                image: stack.clone(),
                branch: "main".into(),
                ..Default::default()
            })
            .await?
            .into_inner();
        let mut entries = Vec::new();
        while let Some(r) = st.message().await? {
            entries.extend(r.entry);
        }
        // The head's tree, through a fresh session (discarded).
        let id = model_session(&mut c, &stack, "model-head").await?;
        let head = model_tree(&mut c, id).await?;
        c.close_session(layerstack_api::CloseSessionRequest {
            session_id: id,
            action: layerstack_api::EndAction::Discard as i32,
            ..Default::default()
        })
        .await?;
        anyhow::Ok((entries, head))
    })?;
    let mut landed = Vec::new();
    model_log_order(&entries, &mut landed);
    landed.retain(|(sid, _)| race.changesets.contains_key(sid));
    for (sid, layer) in &landed {
        ensure!(
            layers.get(sid) == Some(layer),
            "session {sid}'s layer in the log is {layer}, its publisher was told {:?} (seed {seed})",
            layers.get(sid)
        );
    }
    let order: Vec<i64> = landed.iter().map(|(sid, _)| *sid).collect();

    // Replayed on the model: every committed changeset once, in log order,
    // no rejected one; each tree the model passes through, by its first place.
    // A changeset that changed nothing (a delete of a file another deleted
    // too) leaves the same tree twice: a tree's places are a range.
    let mut states: HashMap<m::Tree, (usize, usize)> = HashMap::new();
    let model = race
        .replay(&order, &seed_tree, |k, t| {
            states.entry(t.clone()).or_insert((k, k)).1 = k;
        })
        .map_err(|e| anyhow::anyhow!("{e} (seed {seed})"))?;
    ensure!(
        head == model,
        "the head differs from the sequential model (seed {seed}): {}",
        m::tree_diff(&head, &model)
    );
    // Every lease is a tree the model passed through (snapshot isolation), no
    // later than the session's own place in the log.
    let mut leased: HashMap<i64, (usize, usize)> = HashMap::new();
    for (sid, base) in &bases {
        let Some(&(first, last)) = states.get(base) else {
            bail!(
                "session {sid} leased a tree the sequential model never passed through (seed {seed})"
            );
        };
        if let Some(at) = order.iter().position(|o| o == sid) {
            ensure!(
                first <= at,
                "session {sid}, {at}th in the log, leased the tree after the {first}th (seed {seed})"
            );
        }
        leased.insert(*sid, (first, last));
    }
    // No false conflict: a rejected changeset shares a file with one that
    // landed after its lease; a merged one with one that landed between its
    // lease and it, a committed one with none.
    let may_follow = |sid: i64, k: usize| k >= leased[&sid].0;
    let surely_follows = |sid: i64, k: usize| k >= leased[&sid].1;
    race.check_rejections(&order, may_follow)
        .map_err(|e| anyhow::anyhow!("{e} (seed {seed})"))?;
    race.check_outcomes(&order, may_follow, surely_follows)
        .map_err(|e| anyhow::anyhow!("{e} (seed {seed})"))?;
    // The path index and the trees agree, content included.
    let report = s.json(&["fsck", "--content", "--json"])?;
    ensure!(
        report["unrepaired"] == 0 && report["problems"].as_array().is_some_and(Vec::is_empty),
        "fsck --content after the race: {report}"
    );
    let (committed, merged, rejected) = (
        race.committed().len(),
        race.merged().len(),
        race.rejected().len(),
    );
    ensure!(
        rejected > 0 && merged > 0,
        "the race exercised too little: {committed} committed ({merged} merged), {rejected} rejected (seed {seed})"
    );
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "model processes: {n} publisher processes (started in {spawned:.1} s, done in {raced:.1} s), {committed} committed ({merged} merged), {rejected} rejected, {secs:.1} s"
    );
    record(
        "concurrency-model-processes",
        "Concurrent publisher processes, each a client of the daemon's admin API (a daemon-owned session on one branch head, its changeset written through the file RPCs, closed with publish), leave exactly the history a sequential model predicts: every committed changeset once in log order with the layer it was told, every rejected one absent, no lost update; each session leased a state the model passed through, and merged or was refused only where a changeset that landed after its lease touched its files",
        MODEL_TEST,
        json!({
            "processes": n,
            "committed": committed,
            "merged": merged,
            "rejected": rejected,
            "seconds": (secs * 10.0).round() / 10.0,
        }),
    )?;
    Ok(())
}

const DISK_FULL_MODE_A_TEST: &str =
    "cargo test -p layerstack-integration --test reliability disk_full_during_a_container_publish";

/// The disk-full test for Mode A: a container run through containerd on the
/// layerstack snapshotter, its store on a 64 MiB loop-mounted ext4, writes
/// 8,000 files and a copy of busybox, then the disk is filled before it
/// exits: its publish ends `failed` naming the full disk (or, when not even
/// that outcome fits, the run keeps no outcome), the branch is unchanged,
/// fsck is clean; once space is freed `layerstack publish` commits it and the
/// next container reads it.
#[test]
fn disk_full_during_a_container_publish() -> Result<()> {
    if !can_loop_mount() || !require_root_and_containerd() {
        return Ok(());
    }
    const NS: &str = "diskfull";
    let mut disk: Option<LoopExt4> = None;
    // Declared after `disk`: containerd and the daemon stop before the disk
    // is unmounted.
    let env = TestEnv::new_with(|dir| {
        disk = Some(LoopExt4::mount(&dir.join("store"), 64)?);
        Ok(())
    })?;
    let _guard = env.guard();
    let disk = disk.context("mounted")?;
    let ballast = disk.mnt.join("ballast");
    let started = Instant::now();
    start_daemon_and_import(&env, NS, &busybox_image_tar()?, BUSYBOX_IMAGE)?;
    let ls = |args: &[&str]| -> Result<Output> {
        let mut a = vec!["--error-format", "json", "-n", NS];
        a.extend_from_slice(args);
        env.layerstack(&a)
    };
    let json_of = |args: &[&str]| -> Result<Value> {
        let o = ensure_success(&args.join(" "), ls(args)?)?;
        serde_json::from_slice(&o.stdout).with_context(|| describe(&o))
    };
    let fsck_clean = |when: &str| -> Result<()> {
        let o = ls(&["fsck", "--json"])?;
        ensure!(o.status.success(), "fsck {when}: {}", describe(&o));
        Ok(())
    };
    // A first container makes the image's stack and its branch main.
    CtrRun::sh(NS, "first", "echo first > /first")
        .image(BUSYBOX_IMAGE)
        .rm(true)
        .ok(&env)?;
    ensure!(
        ls_wait_ok(&env, NS, "first")? == "committed",
        "the first container published"
    );
    let stacks = json_of(&["stack", "ls", "--json"])?;
    let stack = stacks[0]["id"]
        .as_str()
        .with_context(|| format!("no stack: {stacks}"))?
        .to_string();
    let visible = || -> Result<(Value, Value)> {
        Ok((
            json_of(&["branch", "ls", &stack, "--json"])?,
            json_of(&["log", &format!("{stack}@main"), "--json"])?,
        ))
    };

    // The container writes, says so, and waits for SIGTERM to exit 0.
    let id = "writer";
    CtrRun::sh(
        NS,
        id,
        "mkdir -p /w && n=a-file-name-long-enough-that-its-index-rows-outgrow-the-space-sqlite-kept-in-its-wal && for i in $(seq 1 8000); do echo file $i > /w/$n-$i; done && cat /bin/busybox > /w/big && touch /ready && trap 'exit 0' TERM && while :; do sleep 0.2; done",
    )
    .image(BUSYBOX_IMAGE)
    .detached()
    .ok(&env)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = std::fs::read_dir(disk.mnt.join("s"))?
            .flatten()
            .any(|e| e.path().join("upper/ready").exists());
        if ready {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the container did not write its files within 60 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let before = visible()?;
    // Filled twice: ext4 hands back some reserved blocks once the first
    // fill's data is on disk.
    let mut ballast_bytes = fill(&ballast)?;
    nix::unistd::sync();
    std::thread::sleep(Duration::from_millis(300));
    ballast_bytes += fill(&ballast)?;
    env.ctr_ok(NS, &["tasks", "kill", id])?;
    wait_task_stopped(&env, NS, id, Duration::from_secs(60))?;
    delete_task(&env, NS, id)?;
    let o = layerstack_wait(&env, NS, id, &["--json"])?;
    let session: Value = serde_json::from_slice(&o.stdout).unwrap_or(Value::Null);
    let outcome = session["outcome"].as_str().unwrap_or("").to_string();
    let message = session["message"].as_str().unwrap_or("").to_lowercase();
    eprintln!("container publish on a full disk: {}", describe(&o));
    let modea = if outcome == "failed" {
        ensure!(
            message.contains("no space left on device") && message.contains("free space"),
            "the failed publish names the full disk and what to do: {}",
            describe(&o)
        );
        "outcome failed"
    } else {
        // Not even the outcome fitted: the run keeps none, `wait` says so.
        ensure!(
            outcome.is_empty() && !o.status.success(),
            "a container publish on a full disk ended {outcome:?}: {}",
            describe(&o)
        );
        "no outcome (it did not fit)"
    };
    ensure!(
        visible()? == before,
        "a failed container publish changed the branch"
    );
    fsck_clean("after a container publish on a full disk")?;

    // Space freed: the kept upper publishes, the next container reads it.
    std::fs::remove_file(&ballast)?;
    nix::unistd::sync();
    let o = ls_publish(&env, NS, id, &[])?;
    ensure!(
        o.status.success() && first_word(&o) == "committed",
        "publish once space is freed: {}",
        describe(&o)
    );
    let text = CtrRun::sh(NS, "reader", "cat /w/*-8000")
        .image(BUSYBOX_IMAGE)
        .rm(true)
        .stdout_ok(&env)?;
    ensure!(
        text.trim() == "file 8000",
        "the next container read {text:?}"
    );
    remove_container(&env, NS, id)?;
    fsck_clean("at the end")?;
    record(
        "disk-full-containers",
        "On a full store filesystem (64 MiB loop ext4) a container's publish (Mode A, through containerd) ends `failed` naming the full disk and what to do (or keeps no outcome when not even that fits); the branch is unchanged, fsck is clean, and once space is freed `layerstack publish` commits the kept upper",
        DISK_FULL_MODE_A_TEST,
        json!({
            "filesystem_mib": 64,
            "files": 8001,
            "ballast_bytes": ballast_bytes,
            "publish_on_full_disk": modea,
            "seconds": (started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
        }),
    )?;
    Ok(())
}
