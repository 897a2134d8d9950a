//! LayerStack against a real containerd 1.6 + runc.
//!
//! All tests share one private containerd (and, for the layerstack tests, one
//! `containerd-layerstack-grpc`) per test process, created on first use and
//! torn down at exit (see `with_shared_env`). Tests run one at a time on it.
//! Every layerstack scenario works on its own branch (snapshot label
//! `containerd.io/snapshot/layerstack.branch=<name>`, forked from `main`),
//! except scenario 1, which uses `main`.
//!
//! Without root or containerd the tests skip (or panic under `CI=true`).

use std::path::Path;
use std::process::Output;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use layerstack_integration::{
    bin_path, busybox_image_tar, contains_ci, debian_image_tar, describe,
    require_root_and_containerd, run_with_timeout, stdout, with_shared_env, TestEnv, BRANCH_LABEL,
    BUSYBOX_IMAGE, CLI_BIN, DAEMON_BIN, DEBIAN_IMAGE, SNAPSHOTTER,
};

/// Namespace for the overlayfs (containerd builtin) tests.
const NS_OVL: &str = "lst-overlayfs";
/// Namespace for the layerstack scenarios.
const NS: &str = "lst";

fn run_test(f: impl FnOnce(&TestEnv) -> Result<()>) {
    if !require_root_and_containerd() {
        return;
    }
    with_shared_env(|env| {
        if let Err(e) = f(env) {
            panic!("{e:#}");
        }
    });
}

/// Like `run_test`, with the daemon running and the Debian image imported
/// into `NS` for the layerstack snapshotter.
fn run_layerstack_test(f: impl FnOnce(&TestEnv) -> Result<()>) {
    run_test(|env| {
        let tar = debian_image_tar()?;
        env.start_daemon()
            .context("starting the layerstack daemon")?;
        let names = env.import_image(NS, &tar, SNAPSHOTTER)?;
        ensure!(
            names.iter().any(|n| n == DEBIAN_IMAGE),
            "image names after import: {names:?}"
        );
        f(env)
    });
}

// ---------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------

fn branch_label(branch: &str) -> String {
    format!("{BRANCH_LABEL}={branch}")
}

/// Blocking `ctr run` of `sh -c script` on the Debian image with the
/// layerstack snapshotter, on `branch` (None: default branch). Fails on a
/// non-zero exit; returns stdout.
fn run_sh(env: &TestEnv, id: &str, branch: Option<&str>, rm: bool, script: &str) -> Result<String> {
    run_sh_in(env, NS, id, branch, rm, script)
}

/// [`run_sh`] in namespace `ns`.
fn run_sh_in(env: &TestEnv, ns: &str, id: &str, branch: Option<&str>, rm: bool, script: &str) -> Result<String> {
    let args = run_args(id, branch, rm, false, script);
    let out = env.ctr(ns, &strs(&args))?;
    ensure!(out.status.success(), "ctr -n {ns} run {id}: {}", describe(&out));
    Ok(stdout(&out))
}

/// `ctr run` arguments for `sh -c script` on the Debian image.
fn run_args(id: &str, branch: Option<&str>, rm: bool, detach: bool, script: &str) -> Vec<String> {
    let mut args: Vec<String> = vec!["run".into(), "--snapshotter".into(), SNAPSHOTTER.into()];
    if let Some(b) = branch {
        args.push("--snapshotter-label".into());
        args.push(branch_label(b));
    }
    if rm {
        args.push("--rm".into());
    }
    if detach {
        args.push("-d".into());
    }
    args.extend([DEBIAN_IMAGE, id, "sh", "-c", script].map(String::from));
    args
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// `ctr run -d`: starts the container and returns once it runs.
fn start_detached(env: &TestEnv, id: &str, branch: Option<&str>, script: &str) -> Result<()> {
    let args = run_args(id, branch, false, true, script);
    let out = env.ctr(NS, &strs(&args))?;
    ensure!(out.status.success(), "ctr run -d {id}: {}", describe(&out));
    Ok(())
}

/// Waits for a detached task to stop, then deletes the task (checking its
/// exit status), which makes containerd emit /tasks/delete: the publish
/// trigger. ctr 1.6 has no `tasks wait`, so this polls `tasks ls`.
fn finish_detached(env: &TestEnv, id: &str) -> Result<()> {
    wait_task_stopped(env, NS, id, Duration::from_secs(60))?;
    let out = env.ctr(NS, &["tasks", "delete", id])?;
    ensure!(
        out.status.success(),
        "ctr task delete {id}: {}",
        describe(&out)
    );
    Ok(())
}

/// Polls `ctr tasks ls` until task `id` is STOPPED.
fn wait_task_stopped(env: &TestEnv, ns: &str, id: &str, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let out = env.ctr_ok(ns, &["tasks", "ls"])?;
        let text = stdout(&out);
        // TASK  PID  STATUS
        let status = text
            .lines()
            .skip(1)
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.first() == Some(&id))
            .and_then(|f| f.get(2).map(|s| s.to_string()));
        match status.as_deref() {
            Some("STOPPED") => return Ok(()),
            None => bail!("no task {id} in `ctr tasks ls`:\n{text}"),
            Some(_) if Instant::now() >= deadline => {
                bail!("task {id} still running after {timeout:?}:\n{text}")
            }
            Some(_) => thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// `layerstack wait ID --timeout 60 --namespace NS` → (outcome word, output).
fn ls_wait(env: &TestEnv, id: &str) -> Result<(String, Output)> {
    ls_wait_in(env, NS, id)
}

/// [`ls_wait`] in namespace `ns`.
fn ls_wait_in(env: &TestEnv, ns: &str, id: &str) -> Result<(String, Output)> {
    let out = env.layerstack(&["wait", id, "--timeout", "60", "--namespace", ns])?;
    let word = stdout(&out).lines().next().unwrap_or("").trim().to_string();
    Ok((word, out))
}

/// `layerstack wait` that must succeed; returns the outcome word.
fn ls_wait_ok(env: &TestEnv, id: &str) -> Result<String> {
    ls_wait_ok_in(env, NS, id)
}

/// [`ls_wait_ok`] in namespace `ns`.
fn ls_wait_ok_in(env: &TestEnv, ns: &str, id: &str) -> Result<String> {
    let (word, out) = ls_wait_in(env, ns, id)?;
    ensure!(
        out.status.success(),
        "layerstack wait -n {ns} {id}: {}",
        describe(&out)
    );
    Ok(word)
}

fn remove_container(env: &TestEnv, id: &str) -> Result<()> {
    env.ctr_ok(NS, &["containers", "delete", id])?;
    Ok(())
}

/// `layerstack session ls --json`.
fn sessions(env: &TestEnv) -> Result<Vec<serde_json::Value>> {
    sessions_in(env, NS)
}

/// [`sessions`] with `--namespace ns`.
fn sessions_in(env: &TestEnv, ns: &str) -> Result<Vec<serde_json::Value>> {
    let out = env.layerstack(&["session", "ls", "--json", "--namespace", ns])?;
    ensure!(
        out.status.success(),
        "layerstack session ls --json: {}",
        describe(&out)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("parsing session ls --json output: {}", stdout(&out)))?;
    match v {
        serde_json::Value::Array(a) => Ok(a),
        other => bail!("session ls --json is not an array: {other}"),
    }
}

fn session_of<'a>(all: &'a [serde_json::Value], container: &str) -> Result<&'a serde_json::Value> {
    session_of_in(all, NS, container)
}

/// [`session_of`] in namespace `ns`.
fn session_of_in<'a>(all: &'a [serde_json::Value], ns: &str, container: &str) -> Result<&'a serde_json::Value> {
    all.iter()
        .rev()
        .find(|s| s["namespace"] == ns && s["container"] == container)
        .with_context(|| format!("no session for container {container} in {all:#?}"))
}

/// A container id not used before in this process (containerd is private to
/// the process, so that is enough).
fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("{prefix}-{}", N.fetch_add(1, Ordering::SeqCst))
}

/// Relative paths of everything below `dir`.
fn list_tree(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            let p = e.path();
            out.push(p.strip_prefix(base).unwrap_or(&p).display().to_string());
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                walk(base, &p, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

// ---------------------------------------------------------------------------
// containerd's builtin overlayfs snapshotter: the harness and images work
// ---------------------------------------------------------------------------

#[test]
fn overlayfs_busybox_import_and_run() {
    run_test(|env| {
        let tar = busybox_image_tar()?;
        let start = Instant::now();
        let names = env.import_image(NS_OVL, &tar, "overlayfs")?;
        eprintln!("busybox import: {:.2}s", start.elapsed().as_secs_f64());
        ensure!(
            names.iter().any(|n| n == BUSYBOX_IMAGE),
            "image names: {names:?}"
        );

        let id = unique("ovl-bb");
        let out = env.ctr(
            NS_OVL,
            &[
                "run",
                "--rm",
                "--snapshotter",
                "overlayfs",
                BUSYBOX_IMAGE,
                &id,
                "sh",
                "-c",
                "echo hi; cat /etc/issue; test -d /root && test -d /tmp && echo dirs-ok",
            ],
        )?;
        ensure!(out.status.success(), "ctr run: {}", describe(&out));
        let text = stdout(&out);
        ensure!(
            text.lines().next() == Some("hi"),
            "unexpected output: {text}"
        );
        ensure!(
            text.contains("LayerStack busybox test image"),
            "no /etc/issue: {text}"
        );
        ensure!(text.contains("dirs-ok"), "missing dirs: {text}");

        // Note: never run the image's default Cmd (/bin/sh) this way: ctr 1.6
        // does not forward EOF of its stdin to the task, so the shell never exits.
        Ok(())
    });
}

#[test]
fn overlayfs_debian_import_and_run() {
    run_test(|env| {
        let tar = debian_image_tar()?;
        let start = Instant::now();
        let names = env.import_image(NS_OVL, &tar, "overlayfs")?;
        eprintln!("debian import: {:.2}s", start.elapsed().as_secs_f64());
        ensure!(
            names.iter().any(|n| n == DEBIAN_IMAGE),
            "image names: {names:?}"
        );

        // A detached container, to see the mounted overlay's lowerdirs.
        let id = unique("ovl-deb");
        let out = env.ctr(
            NS_OVL,
            &[
                "run",
                "-d",
                "--snapshotter",
                "overlayfs",
                DEBIAN_IMAGE,
                &id,
                "sleep",
                "30",
            ],
        )?;
        ensure!(out.status.success(), "ctr run -d: {}", describe(&out));
        let mount = env.containerd().rootfs_mount(NS_OVL, &id);
        let lowers = mount.as_ref().map(|m| m.lowerdirs().len());
        // runc must not write into the upper of a container that writes
        // nothing (a "no-change" session relies on this).
        let upper_entries = mount
            .as_ref()
            .and_then(|m| m.option("upperdir"))
            .map(|u| list_tree(Path::new(&u)));
        let kill = env.ctr(NS_OVL, &["tasks", "kill", "--signal", "SIGKILL", &id]);
        let stopped = wait_task_stopped(env, NS_OVL, &id, Duration::from_secs(30));
        let del = env.ctr(NS_OVL, &["tasks", "delete", &id]);
        let _ = env.ctr(NS_OVL, &["containers", "delete", &id]);
        ensure!(kill?.status.success(), "task kill failed");
        stopped?;
        ensure!(del?.status.success(), "task delete failed");
        ensure!(
            lowers == Some(1),
            "expected one lowerdir for a one-layer image, got {lowers:?}"
        );
        ensure!(
            upper_entries == Some(vec![]),
            "upper of an idle container is not empty: {upper_entries:?}"
        );
        ensure!(
            env.containerd().rootfs_mount(NS_OVL, &id).is_none(),
            "rootfs still mounted after task delete"
        );

        let id = unique("ovl-deb-rm");
        let out = env.ctr(
            NS_OVL,
            &[
                "run",
                "--rm",
                "--snapshotter",
                "overlayfs",
                DEBIAN_IMAGE,
                &id,
                "sh",
                "-c",
                ". /etc/os-release; echo $VERSION_CODENAME; cat /etc/issue; \
                 rm /etc/issue; test -e /etc/issue || echo deleted; dpkg -s bash | head -n 2",
            ],
        )?;
        ensure!(out.status.success(), "ctr run: {}", describe(&out));
        let text = stdout(&out);
        ensure!(
            text.lines().next() == Some("bookworm"),
            "unexpected output: {text}"
        );
        ensure!(
            text.contains("Debian GNU/Linux 12"),
            "no /etc/issue: {text}"
        );
        ensure!(
            text.contains("deleted") && text.contains("Package: bash"),
            "unexpected: {text}"
        );
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// layerstack
// ---------------------------------------------------------------------------

#[test]
fn layerstack_busybox_smoke() {
    run_test(|env| {
        let tar = busybox_image_tar()?;
        env.start_daemon()
            .context("starting the layerstack daemon")?;
        let names = env.import_image(NS, &tar, SNAPSHOTTER)?;
        ensure!(
            names.iter().any(|n| n == BUSYBOX_IMAGE),
            "image names: {names:?}"
        );
        let id = unique("bb-smoke");
        let label = branch_label("smoke-busybox");
        let out = env.ctr(
            NS,
            &[
                "run",
                "--rm",
                "--snapshotter",
                SNAPSHOTTER,
                "--snapshotter-label",
                &label,
                BUSYBOX_IMAGE,
                &id,
                "echo",
                "hi",
            ],
        )?;
        ensure!(out.status.success(), "ctr run: {}", describe(&out));
        ensure!(
            stdout(&out).trim() == "hi",
            "unexpected output: {}",
            describe(&out)
        );
        // Nothing was written: runc must leave no trace in the upper (the
        // image has every mount point the default spec needs).
        let word = ls_wait_ok(env, &id)?;
        ensure!(word == "no-change", "outcome of `echo hi`: {word}");
        Ok(())
    });
}

/// Scenario 1: A write is visible to the next container (default branch `main`).
#[test]
fn scenario1_write_then_read_on_main() {
    run_layerstack_test(|env| {
        let w = unique("s1-write");
        let content = format!("hello from {w}");
        run_sh(
            env,
            &w,
            None,
            true,
            &format!("echo '{content}' > /root/a.txt"),
        )?;
        let word = ls_wait_ok(env, &w)?;
        ensure!(word == "committed", "outcome of {w}: {word}");

        let r = unique("s1-read");
        let text = run_sh(env, &r, None, false, "cat /root/a.txt")?;
        ensure!(
            text.trim() == content,
            "next container read {text:?}, want {content:?}"
        );
        let word = ls_wait_ok(env, &r)?;
        ensure!(word == "no-change", "read-only container outcome: {word}");
        remove_container(env, &r)?;
        Ok(())
    });
}

/// Scenario 2: Deletes and directory replacement publish as such.
#[test]
fn scenario2_delete_and_replace_dir() {
    run_layerstack_test(|env| {
        let br = "s2-delete";
        let a = unique("s2-rm");
        run_sh(
            env,
            &a,
            Some(br),
            true,
            "test -e /etc/issue && rm /etc/issue",
        )?;
        ensure!(ls_wait_ok(env, &a)? == "committed", "delete not committed");

        let b = unique("s2-check");
        let text = run_sh(
            env,
            &b,
            Some(br),
            true,
            "test -e /etc/issue && echo PRESENT || echo GONE",
        )?;
        ensure!(text.trim() == "GONE", "/etc/issue after delete: {text}");
        ls_wait_ok(env, &b)?;

        // Replace /etc/skel (.bashrc, .profile, .bash_logout in the image).
        let c = unique("s2-replace");
        let old = run_sh(
            env,
            &c,
            Some(br),
            false,
            "ls -A /etc/skel; rm -rf /etc/skel && mkdir /etc/skel && echo new > /etc/skel/f",
        )?;
        let old_entries: Vec<&str> = old
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        ensure!(
            old_entries.contains(&".bashrc"),
            "expected /etc/skel/.bashrc in the image: {old_entries:?}"
        );
        ensure!(
            ls_wait_ok(env, &c)? == "committed",
            "dir replacement not committed"
        );
        remove_container(env, &c)?;

        let d = unique("s2-check-dir");
        let text = run_sh(
            env,
            &d,
            Some(br),
            true,
            "ls -A /etc/skel; echo ---; cat /etc/skel/f",
        )?;
        let (listing, content) = text.split_once("---").context("no separator")?;
        let now: Vec<&str> = listing
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        ensure!(
            now == ["f"],
            "/etc/skel after replacement: {now:?} (old: {old_entries:?})"
        );
        ensure!(content.trim() == "new", "/etc/skel/f: {content:?}");
        ls_wait_ok(env, &d)?;

        // main is untouched.
        let e = unique("s2-main");
        let text = run_sh(
            env,
            &e,
            None,
            true,
            "test -e /etc/issue && echo PRESENT; ls -A /etc/skel",
        )?;
        ensure!(
            text.contains("PRESENT") && text.contains(".bashrc"),
            "main changed: {text}"
        );
        ls_wait_ok(env, &e)?;
        Ok(())
    });
}

/// Scenario 3: Two concurrent containers from the same head edit different files:
/// both commit, and a third container sees both.
#[test]
fn scenario3_concurrent_disjoint_edits() {
    run_layerstack_test(|env| {
        let br = "s3-disjoint";
        let a = unique("s3-a");
        let b = unique("s3-b");
        start_detached(env, &a, Some(br), "sleep 2; echo from-a > /root/f1")?;
        start_detached(env, &b, Some(br), "sleep 2; echo from-b > /root/f2")?;
        finish_detached(env, &a)?;
        finish_detached(env, &b)?;
        let wa = ls_wait_ok(env, &a)?;
        let wb = ls_wait_ok(env, &b)?;
        ensure!(
            wa == "committed" && wb == "committed",
            "outcomes: {a}={wa} {b}={wb}"
        );
        remove_container(env, &a)?;
        remove_container(env, &b)?;

        let c = unique("s3-c");
        let text = run_sh(env, &c, Some(br), true, "cat /root/f1 /root/f2")?;
        ensure!(text == "from-a\nfrom-b\n", "third container sees: {text:?}");
        ls_wait_ok(env, &c)?;
        Ok(())
    });
}

/// Scenario 4: Two concurrent containers edit the same file: the first to finish
/// commits, the second is a conflict and none of its changes are published.
#[test]
fn scenario4_conflict_publishes_nothing() {
    run_layerstack_test(|env| {
        let br = "s4-conflict";
        let setup = unique("s4-setup");
        run_sh(env, &setup, Some(br), true, "echo base > /root/shared.txt")?;
        ensure!(
            ls_wait_ok(env, &setup)? == "committed",
            "setup not committed"
        );

        let a = unique("s4-a");
        let b = unique("s4-b");
        start_detached(env, &a, Some(br), "echo A > /root/shared.txt")?;
        start_detached(
            env,
            &b,
            Some(br),
            "echo B > /root/shared.txt; echo unique > /root/only-b.txt; sleep 3",
        )?;
        finish_detached(env, &a)?;
        let wa = ls_wait_ok(env, &a)?;
        ensure!(wa == "committed", "first finisher {a}: {wa}");

        finish_detached(env, &b)?;
        let (wb, out) = ls_wait(env, &b)?;
        ensure!(
            !out.status.success(),
            "layerstack wait {b} must fail on conflict: {}",
            describe(&out)
        );
        ensure!(wb == "conflict", "second finisher {b}: {}", describe(&out));

        let all = sessions(env)?;
        let s = session_of(&all, &b)?;
        ensure!(s["state"] == "conflict", "session state: {s:#}");
        let paths: Vec<&str> = s["conflict_paths"]
            .as_array()
            .context("conflict_paths not an array")?
            .iter()
            .filter_map(|p| p.as_str())
            .collect();
        ensure!(
            paths
                .iter()
                .any(|p| p.trim_start_matches('/') == "root/shared.txt"),
            "conflict_paths: {paths:?}"
        );
        ensure!(
            !paths.iter().any(|p| p.ends_with("only-b.txt")),
            "only-b.txt is not a conflict: {paths:?}"
        );
        let sa = session_of(&all, &a)?;
        ensure!(sa["state"] == "published", "first session state: {sa:#}");
        remove_container(env, &a)?;
        remove_container(env, &b)?;

        let c = unique("s4-check");
        let text = run_sh(
            env,
            &c,
            Some(br),
            true,
            "cat /root/shared.txt; test -e /root/only-b.txt && echo LEAKED || echo ABSENT",
        )?;
        ensure!(text == "A\nABSENT\n", "after conflict: {text:?}");
        ls_wait_ok(env, &c)?;
        Ok(())
    });
}

/// Scenario 5: Running sessions are isolated from each other.
#[test]
fn scenario5_sessions_isolated_while_running() {
    run_layerstack_test(|env| {
        let br = "s5-isolation";
        let a = unique("s5-a");
        let b = unique("s5-b");
        let script = |mine: &str, other: &str| {
            format!(
                "echo {mine} > /root/marker-{mine}; \
                 for i in 1 2 3 4 5 6 7 8 9 10; do \
                   if [ -e /root/marker-{other} ]; then echo FOUND; exit 0; fi; sleep 0.3; \
                 done; echo NOTFOUND"
            )
        };
        let (sa, sb) = (script("a", "b"), script("b", "a"));
        let args_a = run_args(&a, Some(br), true, false, &sa);
        let args_b = run_args(&b, Some(br), true, false, &sb);
        let ca = env.ctr_spawn(NS, &strs(&args_a))?;
        let cb = env.ctr_spawn(NS, &strs(&args_b))?;
        let (oa, ob) = thread::scope(|s| {
            let ta = s.spawn(move || ca.wait_with_output());
            let tb = s.spawn(move || cb.wait_with_output());
            (ta.join(), tb.join())
        });
        let oa = oa.map_err(|_| anyhow::anyhow!("thread panicked"))??;
        let ob = ob.map_err(|_| anyhow::anyhow!("thread panicked"))??;
        ensure!(oa.status.success(), "{a}: {}", describe(&oa));
        ensure!(ob.status.success(), "{b}: {}", describe(&ob));
        ensure!(
            stdout(&oa).trim() == "NOTFOUND",
            "{a} saw b's marker: {}",
            describe(&oa)
        );
        ensure!(
            stdout(&ob).trim() == "NOTFOUND",
            "{b} saw a's marker: {}",
            describe(&ob)
        );
        let wa = ls_wait_ok(env, &a)?;
        let wb = ls_wait_ok(env, &b)?;
        ensure!(
            wa == "committed" && wb == "committed",
            "outcomes: {wa} {wb}"
        );

        let c = unique("s5-check");
        let text = run_sh(env, &c, Some(br), true, "cat /root/marker-a /root/marker-b")?;
        ensure!(text == "a\nb\n", "after both: {text:?}");
        ls_wait_ok(env, &c)?;
        Ok(())
    });
}

/// Scenario 6: A store root on tmpfs is refused before anything is written.
#[test]
fn scenario6_tmpfs_root_refused() {
    run_test(|env| {
        let bin = bin_path(DAEMON_BIN)?;
        let dir = env.scratch().join("tmpfs-root");
        std::fs::create_dir_all(&dir)?;
        nix::mount::mount(
            Some("tmpfs"),
            &dir,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=16m,mode=0755"),
        )
        .context("mounting tmpfs")?;
        let result = check_tmpfs_refused(env, &bin, &dir);
        let umount = nix::mount::umount2(&dir, nix::mount::MntFlags::MNT_DETACH);
        result?;
        umount.context("unmounting tmpfs")?;
        Ok(())
    });
}

fn check_tmpfs_refused(env: &TestEnv, bin: &Path, dir: &Path) -> Result<()> {
    let sock = env.scratch().join("t.sock");
    let admin = env.scratch().join("ta.sock");
    let out = run_with_timeout(
        std::process::Command::new(bin)
            .arg("--root")
            .arg(dir)
            .arg("--address")
            .arg(&sock)
            .arg("--admin-address")
            .arg(&admin)
            .arg("--containerd-address")
            .arg(env.containerd().socket()),
        Duration::from_secs(30),
    )
    .context("the daemon must exit on a tmpfs root, not serve")?;
    ensure!(
        !out.status.success(),
        "daemon accepted a tmpfs root: {}",
        describe(&out)
    );
    let text = format!("{}{}", stdout(&out), String::from_utf8_lossy(&out.stderr));
    ensure!(
        contains_ci(&text, "tmpfs") && contains_ci(&text, "unsupported"),
        "refusal must name tmpfs and say unsupported: {}",
        describe(&out)
    );
    let left: Vec<_> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.file_name())
        .collect();
    ensure!(
        left.is_empty(),
        "daemon wrote into the refused root: {left:?}"
    );
    Ok(())
}

/// Without the shim, the daemon's task-delete path honours the container's
/// `layerstack.publish` label while the container record exists.
#[test]
fn event_path_honours_publish_label() {
    run_layerstack_test(|env| {
        let br = "lbl-policy";
        let cases = [
            ("never", "exit 0", "discarded", false),
            ("on-success", "exit 3", "discarded", false),
            ("on-success", "exit 0", "committed", true),
        ];
        for (policy, exit, want, visible) in cases {
            let id = unique("lbl");
            let file = format!("/root/{id}.txt");
            let mut args: Vec<String> = vec!["run".into(), "--snapshotter".into(), SNAPSHOTTER.into()];
            args.extend(["--snapshotter-label".to_string(), branch_label(br)]);
            args.extend(["--label".to_string(), format!("layerstack.publish={policy}"), "-d".to_string()]);
            args.extend([DEBIAN_IMAGE, &id, "sh", "-c", &format!("echo x > {file}; {exit}")].map(String::from));
            let out = env.ctr(NS, &strs(&args))?;
            ensure!(out.status.success(), "ctr run -d {id}: {}", describe(&out));
            wait_task_stopped(env, NS, &id, Duration::from_secs(60))?;
            let out = env.ctr(NS, &["tasks", "delete", &id])?;
            ensure!(out.status.success(), "ctr tasks delete {id}: {}", describe(&out));
            let (got, _) = ls_wait(env, &id)?;
            ensure!(got == want, "{policy} with {exit}: outcome {got}, want {want}");
            remove_container(env, &id)?;
            let probe = unique("lbl-probe");
            let seen = run_sh(env, &probe, Some(br), true, &format!("test -e {file} && echo yes || echo no"))?;
            ls_wait_ok(env, &probe)?;
            ensure!(
                seen.trim() == if visible { "yes" } else { "no" },
                "{policy} with {exit}: next container sees {file}: {seen:?}"
            );
        }
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// Restarts, daemon crashes, snapshot removal, the CLI, namespaces
// ---------------------------------------------------------------------------

/// Spawns `layerstack wait ID --timeout T --namespace NS` without waiting for it
/// (collect with `wait_with_output`; it ends by itself after `timeout_s`).
fn spawn_ls_wait(env: &TestEnv, ns: &str, id: &str, timeout_s: u32) -> Result<std::process::Child> {
    std::process::Command::new(bin_path(CLI_BIN)?)
        .arg("--admin-address")
        .arg(env.admin_socket())
        .args(["wait", id, "--timeout", &timeout_s.to_string(), "--namespace", ns])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("spawning layerstack wait")
}

/// `layerstack log IMAGE@BRANCH --json --namespace NS` (exit status not checked).
fn ls_log(env: &TestEnv, ns: &str, branch: &str) -> Result<Output> {
    let image = format!("{DEBIAN_IMAGE}@{branch}");
    env.layerstack(&["log", &image, "--json", "--namespace", ns])
}

/// The `layers` array of a successful `layerstack log --json`.
fn ls_log_layers(env: &TestEnv, ns: &str, branch: &str) -> Result<Vec<serde_json::Value>> {
    let out = ls_log(env, ns, branch)?;
    ensure!(out.status.success(), "layerstack log @{branch}: {}", describe(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("parsing layerstack log --json: {}", stdout(&out)))?;
    v["layers"]
        .as_array()
        .cloned()
        .with_context(|| format!("layerstack log --json has no `layers` array: {v}"))
}

/// Layer directories `<store>/l/<n>` in which `rel` exists (not following a
/// final symlink), sorted by `n`.
fn layers_containing(store: &Path, rel: &str) -> Vec<(u64, std::path::PathBuf)> {
    let mut v: Vec<(u64, std::path::PathBuf)> = std::fs::read_dir(store.join("l"))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| {
                    let n = e.file_name().to_str()?.parse::<u64>().ok()?;
                    let dir = e.path();
                    std::fs::symlink_metadata(dir.join(rel)).ok()?;
                    Some((n, dir))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Polls until `path` exists (a container's write reached its upper).
fn wait_path(path: &Path, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while std::fs::symlink_metadata(path).is_err() {
        ensure!(
            Instant::now() < deadline,
            "{} did not appear within {timeout:?}",
            path.display()
        );
        thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// The session's `runs` from `session ls --json`.
fn runs_of(s: &serde_json::Value) -> Result<i64> {
    s["runs"].as_i64().with_context(|| format!("session has no numeric `runs`: {s:#}"))
}

/// A container created without `--rm` runs again through `ctr tasks start` right
/// after its first task is deleted. The second run must start on the branch head
/// that includes the first run's published layer (never on the first run's
/// upper while it is being published): it sees the first run's marker, and
/// each run publishes its own layer.
#[test]
fn restart_sees_published_writes_and_gets_fresh_upper() {
    run_layerstack_test(|env| {
        let br = "restart-fresh";
        let id = unique("rs");
        let script = "if [ ! -e /root/marker ]; then \
                        mkdir -p /root/many && cd /root/many && i=0; \
                        while [ $i -lt 5000 ]; do echo $i > f$i; i=$((i+1)); done; \
                        echo one > /root/marker; echo first-run; \
                      else touch /root/second; echo second-run; fi";
        // `ctr run` without --rm: ctr deletes the task on exit, keeps the container.
        let first = run_sh(env, &id, Some(br), false, script)?;
        ensure!(first.trim() == "first-run", "first run printed {first:?}");
        // No wait: the first run's publish is in flight (5000 files) while the
        // second run's task is created.
        let mut first_wait = spawn_ls_wait(env, NS, &id, 120)?;
        let second = env.ctr(NS, &["tasks", "start", &id]);
        let first_wait_out = {
            let second_ok = second.as_ref().map(|o| o.status.success()).unwrap_or(false);
            if !second_ok {
                let _ = first_wait.kill();
            }
            first_wait.wait_with_output()?
        };
        let second = second?;
        ensure!(second.status.success(), "ctr tasks start {id}: {}", describe(&second));
        ensure!(
            stdout(&second).trim() == "second-run",
            "the second run did not see /root/marker from the first run: {}",
            describe(&second)
        );
        let first_word = stdout(&first_wait_out).lines().next().unwrap_or("").trim().to_string();
        ensure!(
            first_wait_out.status.success() && first_word == "committed",
            "layerstack wait for the first run: {}",
            describe(&first_wait_out)
        );
        let word = ls_wait_ok(env, &id)?;
        ensure!(word == "committed", "outcome of the second run: {word}");

        let c = unique("rs-check");
        let text = run_sh(
            env,
            &c,
            Some(br),
            true,
            "cat /root/marker; test -e /root/second && echo SECOND; ls /root/many | wc -l",
        )?;
        ensure!(text == "one\nSECOND\n5000\n", "third container sees: {text:?}");
        ls_wait_ok(env, &c)?;

        // Each run published its own layer.
        let store = env.store_root();
        let with_marker = layers_containing(&store, "root/marker");
        let with_second = layers_containing(&store, "root/second");
        ensure!(
            with_marker.len() == 1 && with_second.len() == 1,
            "layers with root/marker: {with_marker:?}; with root/second: {with_second:?}"
        );
        ensure!(
            with_marker[0].0 != with_second[0].0,
            "both runs' writes are in one layer {:?}: the second run reused the first run's upper",
            with_marker[0].1
        );
        ensure!(
            with_marker[0].0 < with_second[0].0,
            "the second run's layer {:?} is older than the first's {:?}",
            with_second[0].1,
            with_marker[0].1
        );
        let many = std::fs::read_dir(with_marker[0].1.join("root/many"))
            .map(|rd| rd.count())
            .unwrap_or(0);
        ensure!(many == 5000, "the first run's layer holds {many} of 5000 files under root/many");

        let layers = ls_log_layers(env, NS, br)?;
        let ours: Vec<i64> = layers
            .iter()
            .filter(|l| l["container"] == id.as_str())
            .filter_map(|l| l["layer"].as_i64())
            .collect();
        ensure!(
            ours == [with_second[0].0 as i64, with_marker[0].0 as i64],
            "layerstack log @{br}: layers of {id} {ours:?}, want [{}, {}] (newest first): {layers:#?}",
            with_second[0].0,
            with_marker[0].0
        );

        let all = sessions(env)?;
        let runs = runs_of(session_of(&all, &id)?)?;
        let single = runs_of(session_of(&all, &c)?)?;
        ensure!(
            runs == single + 1,
            "session of {id} ran twice: runs = {runs}; a session that ran once has runs = {single}"
        );
        remove_container(env, &id)?;
        Ok(())
    });
}

/// The daemon is SIGKILLed while two containers run; their tasks stop and are
/// deleted while it is down (the /tasks/delete events are missed). A new daemon
/// on the same store reconciles: both sessions are published.
#[test]
fn daemon_killed_while_tasks_run_then_reconciled() {
    run_layerstack_test(|env| {
        let br = "daemon-kill";
        let a = unique("dk-a");
        let b = unique("dk-b");
        start_detached(env, &a, Some(br), "sleep 2; echo from-a > /root/dk-a.txt")?;
        start_detached(env, &b, Some(br), "sleep 2; echo from-b > /root/dk-b.txt")?;
        let pid = env.kill_daemon()?;
        eprintln!("killed {DAEMON_BIN} (pid {pid}) while {a} and {b} run");
        // While it is down: both tasks stop and are deleted. Restart the daemon
        // whatever happens, so later tests find one.
        let while_down = (|| -> Result<()> {
            for id in [&a, &b] {
                wait_task_stopped(env, NS, id, Duration::from_secs(60))?;
            }
            for id in [&a, &b] {
                let out = env.ctr(NS, &["tasks", "delete", id])?;
                ensure!(
                    out.status.success(),
                    "ctr tasks delete {id} with the snapshotter down: {}",
                    describe(&out)
                );
            }
            Ok(())
        })();
        let restarted = env.restart_daemon();
        while_down?;
        restarted.context("restarting the daemon")?;

        for id in [&a, &b] {
            let (word, out) = ls_wait(env, id)?;
            ensure!(
                out.status.success() && word == "committed",
                "after the restart, layerstack wait {id}: {}",
                describe(&out)
            );
        }
        remove_container(env, &a)?;
        remove_container(env, &b)?;
        let c = unique("dk-check");
        let text = run_sh(env, &c, Some(br), true, "cat /root/dk-a.txt /root/dk-b.txt")?;
        ensure!(text == "from-a\nfrom-b\n", "after reconcile a new container sees {text:?}");
        ls_wait_ok(env, &c)?;
        Ok(())
    });
}

/// containerd forgets a running container's snapshot (`ctr snapshots rm`) and its
/// GC asks the daemon to Remove it while it is still mounted: the daemon refuses
/// (FailedPrecondition, which containerd's GC logs and retries later), and the
/// container's writes are published when its task is deleted.
#[test]
fn remove_of_a_running_containers_snapshot_is_refused() {
    run_layerstack_test(|env| {
        let br = "rm-running";
        let id = unique("rmrun");
        let file = format!("root/{id}.txt");
        start_detached(env, &id, Some(br), &format!("echo kept > /{file}; sleep 600"))?;
        let all = sessions(env)?;
        let sid = session_of(&all, &id)?["id"]
            .as_i64()
            .context("session id")?;
        let upper = env.store_root().join("s").join(sid.to_string()).join("upper");
        wait_path(&upper.join(&file), Duration::from_secs(30))?;

        let out = env.ctr(NS, &["snapshots", "--snapshotter", SNAPSHOTTER, "rm", &id])?;
        eprintln!("ctr snapshots rm {id} while running: {}", describe(&out));
        ensure!(out.status.success(), "ctr snapshots rm {id}: {}", describe(&out));
        // Force a synchronous GC: it Removes the now unreferenced snapshot from
        // the daemon while the container still runs on it.
        let lease = format!("gc-{id}");
        env.ctr_ok(NS, &["leases", "create", "--id", &lease])?;
        let out = env.containerd().ctr_timeout(
            NS,
            &["leases", "delete", "--sync", &lease],
            Duration::from_secs(60),
        )?;
        ensure!(out.status.success(), "ctr leases delete --sync: {}", describe(&out));
        let log = std::fs::read_to_string(env.containerd().log_path()).unwrap_or_default();
        let about_ours: Vec<&str> = log
            .lines()
            .filter(|l| {
                l.split_whitespace().any(|t| {
                    t.strip_prefix("key=")
                        .map(|k| k.trim_matches('"').ends_with(&format!("/{id}")))
                        .unwrap_or(false)
                })
            })
            .collect();
        ensure!(
            about_ours.iter().any(|l| l.contains("failed to remove snapshot") && contains_ci(l, "mounted")),
            "containerd's GC did not log a refused Remove of {id} (FailedPrecondition, \"mounted\"); \
             its log lines about the key:\n{}",
            about_ours.join("\n")
        );
        ensure!(
            upper.join(&file).exists(),
            "the running container's write {} vanished after containerd's GC Remove",
            upper.join(&file).display()
        );

        let out = env.ctr(NS, &["tasks", "kill", "--signal", "SIGKILL", &id])?;
        ensure!(out.status.success(), "ctr tasks kill {id}: {}", describe(&out));
        finish_detached(env, &id)?;
        let (word, out) = ls_wait(env, &id)?;
        ensure!(
            out.status.success() && word == "committed",
            "the write of {id} was lost: layerstack wait: {}",
            describe(&out)
        );
        let out = env.ctr(NS, &["containers", "delete", &id])?;
        eprintln!("ctr containers delete {id} (snapshot record gone): {}", describe(&out));

        let c = unique("rmrun-check");
        let text = run_sh(env, &c, Some(br), true, &format!("cat /{file}"))?;
        ensure!(text == "kept\n", "a new container sees {text:?}");
        ls_wait_ok(env, &c)?;
        Ok(())
    });
}

/// `layerstack publish` of a stopped but still mounted container fails; `log`
/// lists the branch's layers with the session that made each; unknown branches
/// and containers fail clearly.
#[test]
fn publish_and_log_cli() {
    run_layerstack_test(|env| {
        let br = "cli-log";
        // What `cli-log` inherits when it forks `main` (nothing if `main` has no
        // head yet).
        let main_before: Vec<i64> = match ls_log(env, NS, "main")? {
            out if out.status.success() => ls_log_layers(env, NS, "main")?
                .iter()
                .filter_map(|l| l["layer"].as_i64())
                .collect(),
            _ => Vec::new(),
        };

        let id = unique("cli");
        start_detached(env, &id, Some(br), "echo cli > /root/cli.txt")?;
        wait_task_stopped(env, NS, &id, Duration::from_secs(60))?;
        // Stopped, not deleted: runc-v2 unmounts the rootfs on task delete only.
        let out = env.layerstack(&["publish", &id, "--namespace", NS])?;
        ensure!(
            out.status.code() == Some(1),
            "layerstack publish of a mounted container must exit 1: {}",
            describe(&out)
        );
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(
            contains_ci(&err, "still mounted"),
            "layerstack publish of a mounted container must say \"still mounted\": {}",
            describe(&out)
        );
        let out = env.ctr(NS, &["tasks", "delete", &id])?;
        ensure!(out.status.success(), "ctr tasks delete {id}: {}", describe(&out));
        let word = ls_wait_ok(env, &id)?;
        ensure!(word == "committed", "outcome of {id} after the refused publish: {word}");

        let layers = ls_log_layers(env, NS, br)?;
        let first = layers.first().with_context(|| format!("layerstack log @{br} is empty"))?;
        ensure!(
            first["container"] == id.as_str() && first["namespace"] == NS,
            "newest layer of {br} is not {id}'s: {layers:#?}"
        );
        ensure!(
            first["paths"].as_i64().unwrap_or(0) >= 1,
            "{id}'s layer has no paths: {first:#}"
        );
        ensure!(
            layers.iter().filter(|l| l["container"] == id.as_str()).count() == 1,
            "{id} appears more than once: {layers:#?}"
        );
        let rest: Vec<i64> = layers[1..].iter().filter_map(|l| l["layer"].as_i64()).collect();
        ensure!(
            rest == main_before,
            "below {id}'s layer, {br} must show main's layers at the fork {main_before:?}: {layers:#?}"
        );

        let out = ls_log(env, NS, "no-such-branch")?;
        ensure!(!out.status.success(), "log of an unknown branch succeeded: {}", describe(&out));
        ensure!(
            contains_ci(&String::from_utf8_lossy(&out.stderr), "no-such-branch"),
            "log of an unknown branch must name it: {}",
            describe(&out)
        );
        let out = env.layerstack(&["wait", "no-such-container", "--timeout", "5", "--namespace", NS])?;
        ensure!(!out.status.success(), "wait for an unknown container succeeded: {}", describe(&out));
        ensure!(
            contains_ci(&String::from_utf8_lossy(&out.stderr), "no-such-container"),
            "wait for an unknown container must name it: {}",
            describe(&out)
        );
        remove_container(env, &id)?;
        Ok(())
    });
}

/// A container whose publish conflicted is discarded by the operator and run
/// again: the new run starts on a fresh upper over the current head (the
/// winner's version) and commits.
#[test]
fn conflicted_session_can_be_discarded_and_restarted() {
    run_layerstack_test(|env| {
        let br = "discard-restart";
        let setup = unique("dr-setup");
        run_sh(env, &setup, Some(br), true, "echo base > /root/shared.txt")?;
        ensure!(ls_wait_ok(env, &setup)? == "committed", "setup not committed");

        let a = unique("dr-a");
        let b = unique("dr-b");
        start_detached(env, &a, Some(br), "echo A > /root/shared.txt")?;
        // First run (sees base): conflicting edit. A later run (sees anything
        // else): records what it saw.
        start_detached(
            env,
            &b,
            Some(br),
            "v=$(cat /root/shared.txt); \
             if [ \"$v\" = base ]; then \
               echo B > /root/shared.txt; echo unique > /root/only-b.txt; sleep 3; \
             else echo \"saw:$v\"; echo \"$v\" > /root/b-rerun.txt; fi",
        )?;
        finish_detached(env, &a)?;
        ensure!(ls_wait_ok(env, &a)? == "committed", "first finisher {a} not committed");
        finish_detached(env, &b)?;
        let (wb, out) = ls_wait(env, &b)?;
        ensure!(wb == "conflict", "second finisher {b}: {}", describe(&out));

        let out = env.layerstack(&["publish", "--discard", &b, "--namespace", NS])?;
        let word = stdout(&out).lines().next().unwrap_or("").trim().to_string();
        ensure!(
            out.status.success() && word == "discarded",
            "layerstack publish --discard {b}: {}",
            describe(&out)
        );
        let all = sessions(env)?;
        let s = session_of(&all, &b)?;
        ensure!(s["state"] == "discarded", "session after discard: {s:#}");

        let out = env.ctr(NS, &["tasks", "start", &b])?;
        ensure!(out.status.success(), "ctr tasks start {b}: {}", describe(&out));
        ensure!(
            stdout(&out).trim() == "saw:A",
            "the rerun of {b} must start on a fresh upper over the head (A): {}",
            describe(&out)
        );
        let word = ls_wait_ok(env, &b)?;
        ensure!(word == "committed", "outcome of {b}'s rerun: {word}");
        remove_container(env, &a)?;
        remove_container(env, &b)?;

        let c = unique("dr-check");
        let text = run_sh(
            env,
            &c,
            Some(br),
            true,
            "cat /root/shared.txt /root/b-rerun.txt; \
             test -e /root/only-b.txt && echo LEAKED || echo ABSENT",
        )?;
        ensure!(text == "A\nA\nABSENT\n", "after discard and rerun: {text:?}");
        ls_wait_ok(env, &c)?;
        Ok(())
    });
}

/// Two containerd namespaces with the same image have separate histories: a
/// write published on `main` in one is not seen on `main` in the other.
#[test]
fn namespaces_do_not_share_history() {
    run_layerstack_test(|env| {
        let (ns_a, ns_b) = ("lst-ns-a", "lst-ns-b");
        let tar = debian_image_tar()?;
        for ns in [ns_a, ns_b] {
            let names = env.import_image(ns, &tar, SNAPSHOTTER)?;
            ensure!(
                names.iter().any(|n| n == DEBIAN_IMAGE),
                "image names in {ns}: {names:?}"
            );
        }
        let w = unique("ns-a-write");
        run_sh_in(env, ns_a, &w, None, true, "echo from-a > /root/ns-a.txt")?;
        let word = ls_wait_ok_in(env, ns_a, &w)?;
        ensure!(word == "committed", "outcome of {w} in {ns_a}: {word}");

        let ra = unique("ns-a-read");
        let text = run_sh_in(env, ns_a, &ra, None, true, "cat /root/ns-a.txt")?;
        ensure!(text == "from-a\n", "{ns_a} does not see its own write: {text:?}");
        ls_wait_ok_in(env, ns_a, &ra)?;

        let rb = unique("ns-b-read");
        let text = run_sh_in(
            env,
            ns_b,
            &rb,
            None,
            true,
            "test -e /root/ns-a.txt && echo LEAKED || echo ABSENT",
        )?;
        ensure!(text == "ABSENT\n", "{ns_b} sees {ns_a}'s write: {text:?}");
        ls_wait_ok_in(env, ns_b, &rb)?;

        let layers = ls_log_layers(env, ns_b, "main")?;
        ensure!(
            !layers.iter().any(|l| l["namespace"] == ns_a),
            "layerstack log -n {ns_b} @main lists {ns_a}'s layers: {layers:#?}"
        );
        Ok(())
    });
}
