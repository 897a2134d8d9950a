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
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use layerstack_integration::{
    bin_path, busybox_image_tar, contains_ci, debian_image_tar, delete_task, describe,
    describe_short, finish_detached, first_word, image_top_snapshot, import_checked, json_strs,
    kill_task, layerstack_wait, ls_publish, ls_wait, ls_wait_ok, mount_snapshot_json,
    publish_policy_label, remove_container, run_layerstack_scenario, run_scenario, run_sh,
    run_with_timeout, session, session_of, session_upper, sessions, start_daemon_and_import,
    start_detached, stdout, unique, wait_task_stopped, CtrRun, TestEnv, BUSYBOX_IMAGE, CLI_BIN,
    DAEMON_BIN, DEBIAN_IMAGE, SNAPSHOTTER,
};

/// Namespace for the overlayfs (containerd builtin) tests.
const NS_OVL: &str = "lst-overlayfs";
/// containerd's builtin snapshotter.
const OVERLAYFS: &str = "overlayfs";
/// Namespace for the layerstack scenarios.
const NS: &str = "lst";

// ---------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------

/// A fresh `--rm` container `PREFIX-N` in `ns` on `branch` runs `sh -c
/// script`, which must exit 0, and its session must end (`layerstack wait`
/// succeeds). Returns its stdout.
fn read_back(
    env: &TestEnv,
    ns: &str,
    prefix: &str,
    branch: Option<&str>,
    script: &str,
) -> Result<String> {
    let id = unique(prefix);
    let text = run_sh(env, ns, &id, branch, true, script)?;
    ls_wait_ok(env, ns, &id)?;
    Ok(text)
}

/// The race of scenario 4 on branch `br`: `PREFIX-setup` commits `base` to
/// /root/shared.txt; `PREFIX-a` (writes `A` there) and `PREFIX-b` (runs
/// `b_script`) then start detached from that head. a's task is deleted first
/// and a must commit; then b's. Returns (a, b, b's outcome word, b's `layerstack
/// wait` output).
fn race_on_shared_file(
    env: &TestEnv,
    br: &str,
    prefix: &str,
    b_script: &str,
) -> Result<(String, String, String, Output)> {
    let setup = unique(&format!("{prefix}-setup"));
    run_sh(
        env,
        NS,
        &setup,
        Some(br),
        true,
        "echo base > /root/shared.txt",
    )?;
    ensure!(
        ls_wait_ok(env, NS, &setup)? == "committed",
        "setup not committed"
    );

    let a = unique(&format!("{prefix}-a"));
    let b = unique(&format!("{prefix}-b"));
    start_detached(env, NS, &a, Some(br), "echo A > /root/shared.txt")?;
    start_detached(env, NS, &b, Some(br), b_script)?;
    finish_detached(env, NS, &a)?;
    let wa = ls_wait_ok(env, NS, &a)?;
    ensure!(wa == "committed", "first finisher {a}: {wa}");

    finish_detached(env, NS, &b)?;
    let (wb, out) = ls_wait(env, NS, &b)?;
    Ok((a, b, wb, out))
}

/// The trimmed non-empty lines of `text`.
fn non_empty_lines(text: &str) -> Vec<&str> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect()
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

/// Imports `tar` into `NS_OVL` for containerd's overlayfs snapshotter (timed);
/// `image` must be among the names.
fn overlayfs_import(env: &TestEnv, tar: &Path, image: &str) -> Result<()> {
    let start = Instant::now();
    import_checked(env, NS_OVL, tar, OVERLAYFS, image)?;
    eprintln!("{image} import: {:.2}s", start.elapsed().as_secs_f64());
    Ok(())
}

/// `ctr run --rm` of `sh -c script` on `image` with overlayfs, as `PREFIX-N`;
/// it must exit 0. The script makes its own checks and exits non-zero (after
/// a line on stderr) when one fails: the runc shim of containerd 1.6 waits at
/// most 2 s for a task's output before it deletes the task
/// (`pkg/process/init.go`, `waitTimeout(ctx, &p.wg, 2*time.Second)`), so on
/// a loaded machine the last line a short task prints can be lost (a CI run
/// lost `dirs-ok`), while its exit status never is.
fn overlayfs_run_checks(env: &TestEnv, image: &str, prefix: &str, script: &str) -> Result<()> {
    let id = unique(prefix);
    CtrRun::sh(NS_OVL, &id, script)
        .image(image)
        .snapshotter(OVERLAYFS)
        .rm(true)
        .ok(env)?;
    Ok(())
}

#[test]
fn overlayfs_busybox_import_and_run() {
    run_scenario(|env| {
        overlayfs_import(env, &busybox_image_tar()?, BUSYBOX_IMAGE)?;
        overlayfs_run_checks(
            env,
            BUSYBOX_IMAGE,
            "ovl-bb",
            "grep -q 'LayerStack busybox test image' /etc/issue \
               || { echo 'no /etc/issue of the test image' >&2; exit 3; }; \
             test -d /root && test -d /tmp || { echo 'no /root or /tmp' >&2; exit 4; }",
        )?;

        // Note: never run the image's default Cmd (/bin/sh) this way: ctr 1.6
        // does not forward EOF of its stdin to the task, so the shell never exits.
        Ok(())
    });
}

#[test]
fn overlayfs_debian_import_and_run() {
    run_scenario(|env| {
        overlayfs_import(env, &debian_image_tar()?, DEBIAN_IMAGE)?;

        // A detached container, to see the mounted overlay's lowerdirs.
        let id = unique("ovl-deb");
        CtrRun::new(NS_OVL, &id, &["sleep", "30"])
            .snapshotter(OVERLAYFS)
            .detached()
            .ok(env)?;
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

        overlayfs_run_checks(
            env,
            DEBIAN_IMAGE,
            "ovl-deb-rm",
            ". /etc/os-release; test \"$VERSION_CODENAME\" = bookworm \
               || { echo \"codename $VERSION_CODENAME\" >&2; exit 3; }; \
             grep -q 'Debian GNU/Linux 12' /etc/issue || { echo 'no Debian /etc/issue' >&2; exit 4; }; \
             rm /etc/issue && ! test -e /etc/issue || { echo 'rm of a lower file failed' >&2; exit 5; }; \
             dpkg -s bash | grep -qx 'Package: bash' || { echo 'dpkg does not know bash' >&2; exit 6; }",
        )?;
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// layerstack
// ---------------------------------------------------------------------------

#[test]
fn layerstack_busybox_smoke() {
    run_scenario(|env| {
        start_daemon_and_import(env, NS, &busybox_image_tar()?, BUSYBOX_IMAGE)?;
        let id = unique("bb-smoke");
        let out = CtrRun::new(NS, &id, &["echo", "hi"])
            .image(BUSYBOX_IMAGE)
            .branch(Some("smoke-busybox"))
            .rm(true)
            .ok(env)?;
        ensure!(
            stdout(&out).trim() == "hi",
            "unexpected output: {}",
            describe(&out)
        );
        // Nothing was written: runc must leave no trace in the upper (the
        // image has every mount point the default spec needs).
        let word = ls_wait_ok(env, NS, &id)?;
        ensure!(word == "no-change", "outcome of `echo hi`: {word}");
        Ok(())
    });
}

/// Scenario 1: A write is visible to the next container (default branch `main`).
#[test]
fn scenario1_write_then_read_on_main() {
    run_layerstack_scenario(NS, |env| {
        let w = unique("s1-write");
        let content = format!("hello from {w}");
        run_sh(
            env,
            NS,
            &w,
            None,
            true,
            &format!("echo '{content}' > /root/a.txt"),
        )?;
        let word = ls_wait_ok(env, NS, &w)?;
        ensure!(word == "committed", "outcome of {w}: {word}");

        let r = unique("s1-read");
        let text = run_sh(env, NS, &r, None, false, "cat /root/a.txt")?;
        ensure!(
            text.trim() == content,
            "next container read {text:?}, want {content:?}"
        );
        let word = ls_wait_ok(env, NS, &r)?;
        ensure!(word == "no-change", "read-only container outcome: {word}");
        remove_container(env, NS, &r)?;
        Ok(())
    });
}

/// Scenario 2: Deletes and directory replacement publish as such.
#[test]
fn scenario2_delete_and_replace_dir() {
    run_layerstack_scenario(NS, |env| {
        let br = "s2-delete";
        let a = unique("s2-rm");
        run_sh(
            env,
            NS,
            &a,
            Some(br),
            true,
            "test -e /etc/issue && rm /etc/issue",
        )?;
        ensure!(
            ls_wait_ok(env, NS, &a)? == "committed",
            "delete not committed"
        );

        let text = read_back(
            env,
            NS,
            "s2-check",
            Some(br),
            "test -e /etc/issue && echo PRESENT || echo GONE",
        )?;
        ensure!(text.trim() == "GONE", "/etc/issue after delete: {text}");

        // Replace /etc/skel (.bashrc, .profile, .bash_logout in the image).
        let c = unique("s2-replace");
        let script =
            "ls -A /etc/skel; rm -rf /etc/skel && mkdir /etc/skel && echo new > /etc/skel/f";
        let old = run_sh(env, NS, &c, Some(br), false, script)?;
        let old_entries = non_empty_lines(&old);
        ensure!(
            old_entries.contains(&".bashrc"),
            "expected /etc/skel/.bashrc in the image: {old_entries:?}"
        );
        ensure!(
            ls_wait_ok(env, NS, &c)? == "committed",
            "dir replacement not committed"
        );
        remove_container(env, NS, &c)?;

        let text = read_back(
            env,
            NS,
            "s2-check-dir",
            Some(br),
            "ls -A /etc/skel; echo ---; cat /etc/skel/f",
        )?;
        let (listing, content) = text.split_once("---").context("no separator")?;
        let now = non_empty_lines(listing);
        ensure!(
            now == ["f"],
            "/etc/skel after replacement: {now:?} (old: {old_entries:?})"
        );
        ensure!(content.trim() == "new", "/etc/skel/f: {content:?}");

        // main is untouched.
        let text = read_back(
            env,
            NS,
            "s2-main",
            None,
            "test -e /etc/issue && echo PRESENT; ls -A /etc/skel",
        )?;
        ensure!(
            text.contains("PRESENT") && text.contains(".bashrc"),
            "main changed: {text}"
        );
        Ok(())
    });
}

/// Scenario 3: Two concurrent containers from the same head edit different files:
/// both commit, and a third container sees both.
#[test]
fn scenario3_concurrent_disjoint_edits() {
    run_layerstack_scenario(NS, |env| {
        let br = "s3-disjoint";
        let a = unique("s3-a");
        let b = unique("s3-b");
        start_detached(env, NS, &a, Some(br), "sleep 2; echo from-a > /root/f1")?;
        start_detached(env, NS, &b, Some(br), "sleep 2; echo from-b > /root/f2")?;
        finish_detached(env, NS, &a)?;
        finish_detached(env, NS, &b)?;
        let wa = ls_wait_ok(env, NS, &a)?;
        let wb = ls_wait_ok(env, NS, &b)?;
        ensure!(
            wa == "committed" && wb == "committed",
            "outcomes: {a}={wa} {b}={wb}"
        );
        remove_container(env, NS, &a)?;
        remove_container(env, NS, &b)?;

        let text = read_back(env, NS, "s3-c", Some(br), "cat /root/f1 /root/f2")?;
        ensure!(text == "from-a\nfrom-b\n", "third container sees: {text:?}");
        Ok(())
    });
}

/// Scenario 4: Two concurrent containers edit the same file: the first to finish
/// commits, the second is a conflict and none of its changes are published.
#[test]
fn scenario4_conflict_publishes_nothing() {
    run_layerstack_scenario(NS, |env| {
        let br = "s4-conflict";
        let (a, b, wb, out) = race_on_shared_file(
            env,
            br,
            "s4",
            "echo B > /root/shared.txt; echo unique > /root/only-b.txt; sleep 3",
        )?;
        ensure!(
            !out.status.success(),
            "layerstack wait {b} must fail on conflict: {}",
            describe(&out)
        );
        ensure!(wb == "conflict", "second finisher {b}: {}", describe(&out));

        let all = sessions(env, NS)?;
        let s = session_of(&all, NS, &b)?;
        ensure!(s["state"] == "conflict", "session state: {s:#}");
        let paths = json_strs(&s["conflict_paths"], "conflict_paths")?;
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
        let sa = session_of(&all, NS, &a)?;
        ensure!(sa["state"] == "published", "first session state: {sa:#}");
        remove_container(env, NS, &a)?;
        remove_container(env, NS, &b)?;

        let script = "cat /root/shared.txt; test -e /root/only-b.txt && echo LEAKED || echo ABSENT";
        let text = read_back(env, NS, "s4-check", Some(br), script)?;
        ensure!(text == "A\nABSENT\n", "after conflict: {text:?}");
        Ok(())
    });
}

/// Scenario 5: Running sessions are isolated from each other.
#[test]
fn scenario5_sessions_isolated_while_running() {
    run_layerstack_scenario(NS, |env| {
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
        let ca = CtrRun::sh(NS, &a, &sa)
            .branch(Some(br))
            .rm(true)
            .spawn(env)?;
        let cb = CtrRun::sh(NS, &b, &sb)
            .branch(Some(br))
            .rm(true)
            .spawn(env)?;
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
        let wa = ls_wait_ok(env, NS, &a)?;
        let wb = ls_wait_ok(env, NS, &b)?;
        ensure!(
            wa == "committed" && wb == "committed",
            "outcomes: {wa} {wb}"
        );

        let text = read_back(
            env,
            NS,
            "s5-check",
            Some(br),
            "cat /root/marker-a /root/marker-b",
        )?;
        ensure!(text == "a\nb\n", "after both: {text:?}");
        Ok(())
    });
}

/// Scenario 6: A store root on tmpfs is refused before anything is written.
#[test]
fn scenario6_tmpfs_root_refused() {
    run_scenario(|env| {
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
            .arg(env.containerd().socket())
            .arg("--metrics-address")
            .arg("127.0.0.1:0"),
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
    run_layerstack_scenario(NS, |env| {
        let br = "lbl-policy";
        let cases = [
            ("never", "exit 0", "discarded", false),
            ("on-success", "exit 3", "discarded", false),
            ("on-success", "exit 0", "committed", true),
        ];
        for (policy, exit, want, visible) in cases {
            let id = unique("lbl");
            let file = format!("/root/{id}.txt");
            CtrRun::sh(NS, &id, &format!("echo x > {file}; {exit}"))
                .branch(Some(br))
                .label(publish_policy_label(policy))
                .detached()
                .ok(env)?;
            finish_detached(env, NS, &id)?;
            let (got, _) = ls_wait(env, NS, &id)?;
            ensure!(
                got == want,
                "{policy} with {exit}: outcome {got}, want {want}"
            );
            remove_container(env, NS, &id)?;
            let seen = read_back(
                env,
                NS,
                "lbl-probe",
                Some(br),
                &format!("test -e {file} && echo yes || echo no"),
            )?;
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
        .args([
            "wait",
            id,
            "--timeout",
            &timeout_s.to_string(),
            "--namespace",
            ns,
        ])
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
    ensure!(
        out.status.success(),
        "layerstack log @{branch}: {}",
        describe(&out)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("parsing layerstack log --json: {}", stdout(&out)))?;
    v["layers"]
        .as_array()
        .cloned()
        .with_context(|| format!("layerstack log --json has no `layers` array: {v}"))
}

/// `out`, of a command about the unknown `name`, must fail and name it on stderr.
fn ensure_fails_naming(out: &Output, what: &str, name: &str) -> Result<()> {
    ensure!(!out.status.success(), "{what} succeeded: {}", describe(out));
    ensure!(
        contains_ci(&String::from_utf8_lossy(&out.stderr), name),
        "{what} must name it: {}",
        describe(out)
    );
    Ok(())
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

/// The session's current `run` from `session ls --json`.
fn runs_of(s: &serde_json::Value) -> Result<i64> {
    s["run"]
        .as_i64()
        .with_context(|| format!("session has no numeric `run`: {s:#}"))
}

/// A container created without `--rm` runs again through `ctr tasks start` right
/// after its first task is deleted. The second run must start on the branch head
/// that includes the first run's published layer (never on the first run's
/// upper while it is being published): it sees the first run's marker, and
/// each run publishes its own layer.
#[test]
fn restart_sees_published_writes_and_gets_fresh_upper() {
    run_layerstack_scenario(NS, |env| {
        let br = "restart-fresh";
        let id = unique("rs");
        let script = "if [ ! -e /root/marker ]; then \
                        mkdir -p /root/many && cd /root/many && i=0; \
                        while [ $i -lt 5000 ]; do echo $i > f$i; i=$((i+1)); done; \
                        echo one > /root/marker; echo first-run; \
                      else touch /root/second; echo second-run; fi";
        // `ctr run` without --rm: ctr deletes the task on exit, keeps the container.
        let first = run_sh(env, NS, &id, Some(br), false, script)?;
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
        ensure!(
            second.status.success(),
            "ctr tasks start {id}: {}",
            describe(&second)
        );
        ensure!(
            stdout(&second).trim() == "second-run",
            "the second run did not see /root/marker from the first run: {}",
            describe(&second)
        );
        let first_outcome = first_word(&first_wait_out);
        ensure!(
            first_wait_out.status.success() && first_outcome == "committed",
            "layerstack wait for the first run: {}",
            describe(&first_wait_out)
        );
        let word = ls_wait_ok(env, NS, &id)?;
        ensure!(word == "committed", "outcome of the second run: {word}");

        let c = unique("rs-check");
        let script = "cat /root/marker; test -e /root/second && echo SECOND; ls /root/many | wc -l";
        let text = run_sh(env, NS, &c, Some(br), true, script)?;
        ensure!(
            text == "one\nSECOND\n5000\n",
            "third container sees: {text:?}"
        );
        ls_wait_ok(env, NS, &c)?;

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
        ensure!(
            many == 5000,
            "the first run's layer holds {many} of 5000 files under root/many"
        );

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

        let all = sessions(env, NS)?;
        let runs = runs_of(session_of(&all, NS, &id)?)?;
        let single = runs_of(session_of(&all, NS, &c)?)?;
        ensure!(
            runs == single + 1,
            "session of {id} ran twice: runs = {runs}; a session that ran once has runs = {single}"
        );
        remove_container(env, NS, &id)?;
        Ok(())
    });
}

/// The daemon is SIGKILLed while two containers run; their tasks stop and are
/// deleted while it is down (the /tasks/delete events are missed). A new daemon
/// on the same store reconciles: both sessions are published.
#[test]
fn daemon_killed_while_tasks_run_then_reconciled() {
    run_layerstack_scenario(NS, |env| {
        let br = "daemon-kill";
        let a = unique("dk-a");
        let b = unique("dk-b");
        start_detached(
            env,
            NS,
            &a,
            Some(br),
            "sleep 2; echo from-a > /root/dk-a.txt",
        )?;
        start_detached(
            env,
            NS,
            &b,
            Some(br),
            "sleep 2; echo from-b > /root/dk-b.txt",
        )?;
        let pid = env.kill_daemon()?;
        eprintln!("killed {DAEMON_BIN} (pid {pid}) while {a} and {b} run");
        // While it is down: both tasks stop and are deleted. Restart the daemon
        // whatever happens, so later tests find one.
        let while_down = (|| -> Result<()> {
            for id in [&a, &b] {
                wait_task_stopped(env, NS, id, Duration::from_secs(60))?;
            }
            for id in [&a, &b] {
                delete_task(env, NS, id).context("with the snapshotter down")?;
            }
            Ok(())
        })();
        let restarted = env.restart_daemon();
        while_down?;
        restarted.context("restarting the daemon")?;

        for id in [&a, &b] {
            let (word, out) = ls_wait(env, NS, id)?;
            ensure!(
                out.status.success() && word == "committed",
                "after the restart, layerstack wait {id}: {}",
                describe(&out)
            );
        }
        remove_container(env, NS, &a)?;
        remove_container(env, NS, &b)?;
        let text = read_back(
            env,
            NS,
            "dk-check",
            Some(br),
            "cat /root/dk-a.txt /root/dk-b.txt",
        )?;
        ensure!(
            text == "from-a\nfrom-b\n",
            "after reconcile a new container sees {text:?}"
        );
        Ok(())
    });
}

/// containerd forgets a running container's snapshot (`ctr snapshots rm`) and its
/// GC asks the daemon to Remove it while it is still mounted: the daemon refuses
/// (FailedPrecondition, which containerd's GC logs and retries later), and the
/// container's writes are published when its task is deleted.
#[test]
fn remove_of_a_running_containers_snapshot_is_refused() {
    run_layerstack_scenario(NS, |env| {
        let br = "rm-running";
        let id = unique("rmrun");
        let file = format!("root/{id}.txt");
        start_detached(
            env,
            NS,
            &id,
            Some(br),
            &format!("echo kept > /{file}; sleep 600"),
        )?;
        let upper = session_upper(env, &session(env, NS, &id)?)?;
        wait_path(&upper.join(&file), Duration::from_secs(30))?;

        let out = env.ctr(NS, &["snapshots", "--snapshotter", SNAPSHOTTER, "rm", &id])?;
        eprintln!("ctr snapshots rm {id} while running: {}", describe(&out));
        ensure!(
            out.status.success(),
            "ctr snapshots rm {id}: {}",
            describe(&out)
        );
        // Force a synchronous GC: it Removes the now unreferenced snapshot from
        // the daemon while the container still runs on it.
        let lease = format!("gc-{id}");
        env.ctr_ok(NS, &["leases", "create", "--id", &lease])?;
        let out = env.containerd().ctr_timeout(
            NS,
            &["leases", "delete", "--sync", &lease],
            Duration::from_secs(60),
        )?;
        ensure!(
            out.status.success(),
            "ctr leases delete --sync: {}",
            describe(&out)
        );
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

        kill_task(env, NS, &id)?;
        finish_detached(env, NS, &id)?;
        let (word, out) = ls_wait(env, NS, &id)?;
        ensure!(
            out.status.success() && word == "committed",
            "the write of {id} was lost: layerstack wait: {}",
            describe(&out)
        );
        let out = env.ctr(NS, &["containers", "delete", &id])?;
        eprintln!(
            "ctr containers delete {id} (snapshot record gone): {}",
            describe(&out)
        );

        let text = read_back(env, NS, "rmrun-check", Some(br), &format!("cat /{file}"))?;
        ensure!(text == "kept\n", "a new container sees {text:?}");
        Ok(())
    });
}

/// `layerstack publish` of a stopped but still mounted container fails; `log`
/// lists the branch's layers with the session that made each; unknown branches
/// and containers fail clearly.
#[test]
fn publish_and_log_cli() {
    run_layerstack_scenario(NS, |env| {
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
        start_detached(env, NS, &id, Some(br), "echo cli > /root/cli.txt")?;
        wait_task_stopped(env, NS, &id, Duration::from_secs(60))?;
        // Stopped, not deleted: runc-v2 unmounts the rootfs on task delete only.
        let out = ls_publish(env, NS, &id, &[])?;
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
        delete_task(env, NS, &id)?;
        let word = ls_wait_ok(env, NS, &id)?;
        ensure!(
            word == "committed",
            "outcome of {id} after the refused publish: {word}"
        );

        let layers = ls_log_layers(env, NS, br)?;
        let first = layers
            .first()
            .with_context(|| format!("layerstack log @{br} is empty"))?;
        ensure!(
            first["container"] == id.as_str() && first["namespace"] == NS,
            "newest layer of {br} is not {id}'s: {layers:#?}"
        );
        ensure!(
            first["paths"].as_i64().unwrap_or(0) >= 1,
            "{id}'s layer has no paths: {first:#}"
        );
        ensure!(
            layers
                .iter()
                .filter(|l| l["container"] == id.as_str())
                .count()
                == 1,
            "{id} appears more than once: {layers:#?}"
        );
        let rest: Vec<i64> = layers[1..]
            .iter()
            .filter_map(|l| l["layer"].as_i64())
            .collect();
        ensure!(
            rest == main_before,
            "below {id}'s layer, {br} must show main's layers at the fork {main_before:?}: {layers:#?}"
        );

        let out = ls_log(env, NS, "no-such-branch")?;
        ensure_fails_naming(&out, "log of an unknown branch", "no-such-branch")?;
        let out = env.layerstack(&[
            "wait",
            "no-such-container",
            "--timeout",
            "5",
            "--namespace",
            NS,
        ])?;
        ensure_fails_naming(&out, "wait for an unknown container", "no-such-container")?;
        remove_container(env, NS, &id)?;
        Ok(())
    });
}

/// A container whose publish conflicted is discarded by the operator and run
/// again: the new run starts on a fresh upper over the current head (the
/// winner's version) and commits.
#[test]
fn conflicted_session_can_be_discarded_and_restarted() {
    run_layerstack_scenario(NS, |env| {
        let br = "discard-restart";
        // b's first run (sees base): conflicting edit. A later run (sees
        // anything else): records what it saw.
        let (a, b, wb, out) = race_on_shared_file(
            env,
            br,
            "dr",
            "v=$(cat /root/shared.txt); \
             if [ \"$v\" = base ]; then \
               echo B > /root/shared.txt; echo unique > /root/only-b.txt; sleep 3; \
             else echo \"saw:$v\"; echo \"$v\" > /root/b-rerun.txt; fi",
        )?;
        ensure!(wb == "conflict", "second finisher {b}: {}", describe(&out));

        let out = ls_publish(env, NS, &b, &["--discard"])?;
        let word = first_word(&out);
        ensure!(
            out.status.success() && word == "discarded",
            "layerstack publish --discard {b}: {}",
            describe(&out)
        );
        let s = session(env, NS, &b)?;
        ensure!(s["state"] == "discarded", "session after discard: {s:#}");

        let out = env.ctr(NS, &["tasks", "start", &b])?;
        ensure!(
            out.status.success(),
            "ctr tasks start {b}: {}",
            describe(&out)
        );
        ensure!(
            stdout(&out).trim() == "saw:A",
            "the rerun of {b} must start on a fresh upper over the head (A): {}",
            describe(&out)
        );
        let word = ls_wait_ok(env, NS, &b)?;
        ensure!(word == "committed", "outcome of {b}'s rerun: {word}");
        remove_container(env, NS, &a)?;
        remove_container(env, NS, &b)?;

        let script = "cat /root/shared.txt /root/b-rerun.txt; \
                      test -e /root/only-b.txt && echo LEAKED || echo ABSENT";
        let text = read_back(env, NS, "dr-check", Some(br), script)?;
        ensure!(
            text == "A\nA\nABSENT\n",
            "after discard and rerun: {text:?}"
        );
        Ok(())
    });
}

/// Two containerd namespaces with the same image have separate histories: a
/// write published on `main` in one is not seen on `main` in the other.
#[test]
fn namespaces_do_not_share_history() {
    run_layerstack_scenario(NS, |env| {
        let (ns_a, ns_b) = ("lst-ns-a", "lst-ns-b");
        let tar = debian_image_tar()?;
        for ns in [ns_a, ns_b] {
            import_checked(env, ns, &tar, SNAPSHOTTER, DEBIAN_IMAGE)?;
        }
        let w = unique("ns-a-write");
        run_sh(env, ns_a, &w, None, true, "echo from-a > /root/ns-a.txt")?;
        let word = ls_wait_ok(env, ns_a, &w)?;
        ensure!(word == "committed", "outcome of {w} in {ns_a}: {word}");

        let text = read_back(env, ns_a, "ns-a-read", None, "cat /root/ns-a.txt")?;
        ensure!(
            text == "from-a\n",
            "{ns_a} does not see its own write: {text:?}"
        );

        let text = read_back(
            env,
            ns_b,
            "ns-b-read",
            None,
            "test -e /root/ns-a.txt && echo LEAKED || echo ABSENT",
        )?;
        ensure!(text == "ABSENT\n", "{ns_b} sees {ns_a}'s write: {text:?}");

        let layers = ls_log_layers(env, ns_b, "main")?;
        ensure!(
            !layers.iter().any(|l| l["namespace"] == ns_a),
            "layerstack log -n {ns_b} @main lists {ns_a}'s layers: {layers:#?}"
        );

        // `session ls` lists `-n`'s sessions only; `-A` lists every namespace's.
        let listed = sessions(env, ns_b)?;
        ensure!(
            !listed.is_empty() && listed.iter().all(|s| s["namespace"] == ns_b),
            "layerstack session ls -n {ns_b}: {listed:#?}"
        );
        let out = env.layerstack(&["session", "ls", "--json", "-A"])?;
        ensure!(out.status.success(), "session ls -A: {}", describe(&out));
        let all: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)?;
        for ns in [ns_a, ns_b] {
            ensure!(
                all.iter().any(|s| s["namespace"] == ns),
                "layerstack session ls -A lacks {ns}: {all:#?}"
            );
        }
        Ok(())
    });
}

/// A second daemon on the same store root is refused at start, naming the first
/// one's pid; the first keeps serving and its sockets are untouched. A daemon
/// whose socket path another live daemon serves is refused too.
#[test]
fn a_second_daemon_on_the_same_root_is_refused() {
    run_layerstack_scenario(NS, |env| {
        let first_pid = env.daemon_pid().context("first daemon pid")?;
        let bin = bin_path(DAEMON_BIN)?;
        let start = |root: &Path, sock: &Path, admin: &Path| {
            run_with_timeout(
                std::process::Command::new(&bin)
                    .arg("--root")
                    .arg(root)
                    .arg("--address")
                    .arg(sock)
                    .arg("--admin-address")
                    .arg(admin)
                    .arg("--containerd-address")
                    .arg(env.containerd().socket())
                    .arg("--metrics-address")
                    .arg("127.0.0.1:0"),
                Duration::from_secs(30),
            )
        };
        let sock2 = env.scratch().join("second.sock");
        let admin2 = env.scratch().join("second-admin.sock");
        let out = start(&env.store_root(), &sock2, &admin2)
            .context("a second daemon on the root must exit, not serve")?;
        ensure!(
            !out.status.success(),
            "second daemon ran: {}",
            describe(&out)
        );
        let text = String::from_utf8_lossy(&out.stderr).to_string();
        ensure!(
            text.contains("in use by another daemon") && text.contains(&format!("pid {first_pid}")),
            "refusal must name the holder's pid {first_pid}: {text}"
        );
        ensure!(
            !sock2.exists() && !admin2.exists(),
            "the refused daemon bound nothing"
        );
        // Another root, but the first daemon's admin socket: refused, socket kept.
        let other_root = env.scratch().join("other-root");
        let out = start(&other_root, &sock2, &env.admin_socket())
            .context("a daemon on a live socket must exit")?;
        ensure!(
            !out.status.success(),
            "daemon took a live socket: {}",
            describe(&out)
        );
        ensure!(
            contains_ci(
                &String::from_utf8_lossy(&out.stderr),
                "served by another live process"
            ),
            "{}",
            describe(&out)
        );
        ensure!(
            env.admin_socket().exists(),
            "the live admin socket was not unlinked"
        );
        // The first daemon still serves both APIs.
        let status = env.layerstack(&["status", "--json"])?;
        ensure!(
            status.status.success(),
            "first daemon: {}",
            describe(&status)
        );
        let v: serde_json::Value = serde_json::from_slice(&status.stdout)?;
        ensure!(v["pid"] == first_pid, "status from the first daemon: {v}");
        let id = unique("second-daemon");
        run_sh(
            env,
            NS,
            &id,
            None,
            true,
            "echo ok > /root/second-daemon.txt",
        )?;
        ensure!(ls_wait_ok(env, NS, &id)? == "committed");
        Ok(())
    });
}

/// A session that changed 150,000 files (an `npm install`) publishes, and every
/// answer about it stays small: `wait --json` and `session ls` carry counts,
/// `--paths` pages through every verdict, a dry run streams them.
#[test]
fn a_session_of_150000_files_publishes_and_its_verdicts_are_paged() {
    run_layerstack_scenario(NS, |env| {
        const N: usize = 150_000;
        let script = "mkdir -p /srv/npm && cd /srv/npm && seq -f 'pkg%06g' 1 150000 | xargs touch";
        let id = unique("npm-install");
        run_sh(env, NS, &id, Some("npm"), true, script)?;
        // Capture and sealing of 150,000 files take ~30 s on a quiet 2-core
        // machine (debug build) and well over the usual 60 s wait on a loaded one.
        let out =
            env.layerstack(&["wait", &id, "--timeout", "170", "--namespace", NS, "--json"])?;
        ensure!(
            out.status.success(),
            "wait --json: {}",
            describe_short(&out)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        ensure!(v["outcome"] == "committed", "{v:#}");
        ensure!(
            v["counts"]["clean"].as_u64() == Some(N as u64 + 1),
            "counts: {}",
            v["counts"]
        );
        ensure!(
            out.stdout.len() < 64 * 1024,
            "a summary, not {} bytes",
            out.stdout.len()
        );
        let ls = env.layerstack(&["session", "ls", "--json", "-n", NS])?;
        ensure!(ls.status.success(), "session ls: {}", describe_short(&ls));
        let out = layerstack_wait(env, NS, &id, &["--json", "--paths"])?;
        ensure!(
            out.status.success(),
            "wait --paths: {}",
            describe_short(&out)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let paths = v["paths"].as_array().context("paths")?;
        ensure!(paths.len() == N + 1, "{} verdicts", paths.len());
        ensure!(paths[1]["path"] == "/srv/npm/pkg000001", "{}", paths[1]);

        // A dry run of an unpublished session of the same size, on a raw snapshot.
        let parent = image_top_snapshot(env, NS)?;
        let prep = env.ctr_ok(
            NS,
            &[
                "snapshots",
                "--snapshotter",
                SNAPSHOTTER,
                "prepare",
                "--mounts",
                "npm-dry",
                &parent,
            ],
        )?;
        let target = env.scratch().join("npm-dry");
        mount_snapshot_json(&prep.stdout, &target)?;
        let made = std::process::Command::new("sh")
            .arg("-c")
            .arg("mkdir -p srv/npm && cd srv/npm && seq -f 'pkg%06g' 1 150000 | xargs touch")
            .current_dir(&target)
            .status();
        nix::mount::umount(&target).context("unmounting the snapshot")?;
        ensure!(made?.success(), "creating files in the snapshot");
        let out = ls_publish(env, NS, "npm-dry", &["--dry-run", "--json", "--paths"])?;
        ensure!(out.status.success(), "dry run: {}", describe_short(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        ensure!(
            v["dry_run"] == true && v["outcome"] == "committed",
            "{}",
            v["message"]
        );
        ensure!(
            v["paths"].as_array().map(Vec::len) == Some(N + 1),
            "dry-run verdicts"
        );
        env.ctr_ok(
            NS,
            &["snapshots", "--snapshotter", SNAPSHOTTER, "rm", "npm-dry"],
        )?;
        Ok(())
    });
}
