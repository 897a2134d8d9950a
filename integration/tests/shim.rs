//! The runtime shim `containerd-shim-layerstack-v1` (runtime
//! `io.containerd.layerstack.v1`) against a real containerd 1.6 + runc, with the
//! layerstack snapshotter and the Debian fixture image (issue 3, list 1–6).
//!
//! All tests share one private containerd and one daemon per test process
//! (`with_shared_env`), one test at a time. The harness starts containerd with
//! our binary directory first on its `PATH` and `LAYERSTACK_ADMIN_ADDRESS` set
//! (`containerd_env`), so containerd finds the shim and the shim finds the daemon.
//! Each scenario works on its own branch, chosen with the container label
//! `layerstack.branch` (which the shim applies through the daemon's `SetBranch`).
//!
//! Nothing here waits for a publish (`layerstack wait`): the point of the shim is
//! that the outcome exists when `ctr` returns.
//!
//! Without root or containerd the tests skip (or fail under `CI=true`).

use std::path::Path;
use std::process::Output;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use layerstack_integration::{
    bin_path, container_branch_label, delete_task, describe, dir_is_empty, kill_task,
    layerstack_wait, ls_wait, prepare_layerstack, publish_policy_label, remove_container,
    require_root_and_containerd, run_scenario, run_scenario_mut, run_with_timeout, session_upper,
    snapshot_branch_label, stdout, task_status, unique_across_processes as unique,
    wait_task_running, wait_task_stopped, wait_task_stopped_or_gone, CtrRun, TestEnv, SHIM_BIN,
    SHIM_RUNTIME,
};

/// Namespace of every container here (runc keeps the state of containers run
/// through this runtime under `/run/containerd/runc/<namespace>`, since `ctr`
/// passes `--runc-root` to `io.containerd.runc.v2` only).
const NS: &str = "lst-shim";

fn prepare(env: &TestEnv) -> Result<()> {
    bin_path(SHIM_BIN).context("the shim binary must be built")?;
    prepare_layerstack(env, NS)
}

fn run_shim_test(f: impl FnOnce(&TestEnv) -> Result<()>) {
    run_scenario(|env| prepare(env).and_then(|()| f(env)));
}

fn run_shim_test_mut(f: impl FnOnce(&mut TestEnv) -> Result<()>) {
    run_scenario_mut(|env| prepare(env).and_then(|()| f(env)));
}

// ---------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------

/// `ctr run --rm --runtime io.containerd.layerstack.v1` of `sh -c script` in
/// container `id`, on `branch` (chosen through the container label).
fn shim_run(id: &str, branch: &str, script: &str) -> CtrRun {
    CtrRun::sh(NS, id, script)
        .runtime(SHIM_RUNTIME)
        .rm(true)
        .label(container_branch_label(branch))
}

/// `layerstack session ls --json`: the newest session of `container`.
fn session(env: &TestEnv, container: &str) -> Result<serde_json::Value> {
    layerstack_integration::session(env, NS, container)
}

/// The session's outcome right now ("" if none yet). No waiting: the shim
/// returns only after the outcome exists.
fn outcome(env: &TestEnv, container: &str) -> Result<String> {
    Ok(session(env, container)?["outcome"]
        .as_str()
        .unwrap_or("")
        .to_string())
}

/// Polls `ctr tasks ls` until task `id` is RUNNING (60 s at most).
fn wait_running(env: &TestEnv, id: &str) -> Result<()> {
    wait_task_running(env, NS, id, Duration::from_secs(60))
}

/// [`shim_run`] detached; returns once the task runs.
fn start_running(env: &TestEnv, id: &str, branch: &str, script: &str) -> Result<()> {
    shim_run(id, branch, script).detached().ok(env)?;
    wait_running(env, id)
}

/// SIGKILLs task `id` and waits until it is STOPPED (it must not vanish).
fn kill_and_wait_stopped(env: &TestEnv, id: &str) -> Result<()> {
    kill_task(env, NS, id)?;
    ensure!(
        wait_task_stopped_or_gone(env, NS, id, Duration::from_secs(30))?,
        "task {id} vanished"
    );
    Ok(())
}

/// Deletes the stopped task `id`: the shim publishes before `ctr` returns, so
/// the session must be committed right after. Then deletes the container.
/// `context` goes into the error messages.
fn delete_task_committed(env: &TestEnv, id: &str, context: &str) -> Result<()> {
    delete_task(env, NS, id).context(context.to_string())?;
    ensure!(
        outcome(env, id)? == "committed",
        "{context}: not committed after task delete: {:#}",
        session(env, id)?
    );
    remove_container(env, NS, id)
}

/// Live (not zombie) processes: `(pid, argv)`.
fn live_processes() -> Vec<(i32, Vec<String>)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let argv: Vec<String> = raw
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                s.rfind(')')
                    .map(|i| s[i + 1..].trim_start().starts_with('Z'))
                    .unwrap_or(false)
            })
            .unwrap_or(true);
        if !zombie {
            out.push((pid, argv));
        }
    }
    out
}

/// Processes whose command line names a containerd shim, container `id` and
/// this env's containerd socket: "pid cmdline".
fn shim_processes(env: &TestEnv, id: &str) -> Vec<String> {
    let sock = env.containerd().socket().to_string_lossy().into_owned();
    live_processes()
        .into_iter()
        .filter(|(_, argv)| {
            argv.first().is_some_and(|a| a.contains("containerd-shim"))
                && argv.windows(2).any(|w| w[0] == "-id" && w[1] == id)
                && argv.iter().any(|a| a == &sock)
        })
        .map(|(pid, argv)| format!("{pid} {}", argv.join(" ")))
        .collect()
}

fn cleanup_container(env: &TestEnv, id: &str) {
    let _ = env.ctr(NS, &["tasks", "kill", "--signal", "SIGKILL", id]);
    let _ = env.ctr(NS, &["tasks", "delete", "--force", id]);
    let _ = env.ctr(NS, &["containers", "delete", id]);
}

/// Runs `f`; if it fails, removes container `id` whatever its state, so later
/// tests start clean.
fn cleaning_up_on_error<T>(env: &TestEnv, id: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let r = f();
    if r.is_err() {
        cleanup_container(env, id);
    }
    r
}

// ---------------------------------------------------------------------------
// 1. read-your-writes, 20 times in a row
// ---------------------------------------------------------------------------

/// Issue 3, item 1: 20 sequential `ctr run --rm --runtime io.containerd.layerstack.v1`
/// each append a line; each run, started right after the previous one returned
/// (no sleep, no `layerstack wait`), sees every earlier line.
#[test]
fn shim1_twenty_sequential_runs_read_their_writes() {
    run_shim_test(|env| {
        let branch = "shim-append";
        let mut ids = Vec::new();
        let started = Instant::now();
        for i in 1..=20usize {
            let id = unique("s1");
            let script = format!("n=$(cat /root/log.txt 2>/dev/null | wc -l); echo $n; echo line-{i} >> /root/log.txt");
            let text = shim_run(&id, branch, &script).stdout_ok(env)?;
            let seen: usize = text
                .trim()
                .parse()
                .with_context(|| format!("run {i} printed {text:?}"))?;
            ensure!(
                seen == i - 1,
                "run {i} ({id}) saw {seen} earlier lines, want {}",
                i - 1
            );
            ids.push(id);
        }
        eprintln!(
            "shim: 20 sequential append runs in {:.2}s",
            started.elapsed().as_secs_f64()
        );
        let id = unique("s1-read");
        let text = shim_run(&id, branch, "cat /root/log.txt").stdout_ok(env)?;
        let want: Vec<String> = (1..=20).map(|i| format!("line-{i}")).collect();
        ensure!(
            text.lines().collect::<Vec<_>>() == want,
            "final read: {text:?}"
        );
        for id in &ids {
            let s = session(env, id)?;
            ensure!(s["outcome"] == "committed", "session of {id}: {s:#}");
            ensure!(
                s["branch"] == branch,
                "container label did not choose the branch: {s:#}"
            );
        }
        // main never saw any of it.
        let id = unique("s1-main");
        let text = shim_run(
            &id,
            "main",
            "test -e /root/log.txt && echo LEAKED || echo CLEAN",
        )
        .stdout_ok(env)?;
        ensure!(
            text.trim() == "CLEAN",
            "main sees the branch's writes: {text}"
        );
        Ok(())
    });
}

/// A run that writes nothing: the shim leaves its end to the daemon's
/// `/tasks/delete` handler (no publish round trip on the path of `ctr run`),
/// and the session still gets its outcome — `no-change`, or `discarded` under
/// `never` — while a run that writes is still published before `ctr` returns.
/// No shim process is left behind (the `delete` action's short path).
#[test]
fn shim_run_that_writes_nothing_ends_through_the_daemon() {
    run_shim_test(|env| {
        let branch = "shim-nothing";
        let a = unique("s9-true");
        shim_run(&a, branch, "true").ok(env)?;
        let (word, out) = ls_wait(env, NS, &a)?;
        ensure!(word == "no-change", "{a}: {}", describe(&out));
        let b = unique("s9-never");
        shim_run(&b, branch, "true")
            .label(publish_policy_label("never"))
            .ok(env)?;
        let (word, out) = ls_wait(env, NS, &b)?;
        ensure!(word == "discarded", "{b}: {}", describe(&out));
        let c = unique("s9-write");
        shim_run(&c, branch, "echo x > /root/s9.txt").ok(env)?;
        ensure!(
            outcome(env, &c)? == "committed",
            "a write must be published before ctr returns: {:#}",
            session(env, &c)?
        );
        for id in [&a, &b, &c] {
            ensure!(
                shim_processes(env, id).is_empty(),
                "shims left for {id}: {:#?}",
                shim_processes(env, id)
            );
        }
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// 2. exit codes and policies
// ---------------------------------------------------------------------------

/// Issue 3, item 2: exit codes 0, 3 and 137 reach `ctr`; `on-success` publishes
/// nothing for exit 3; `never` publishes nothing and discards the upper.
#[test]
fn shim2_exit_codes_and_publish_policies() {
    run_shim_test(|env| {
        let branch = "shim-policy";
        // Exit 0 and 3 with the default policy (on-exit): both publish.
        let a = unique("s2-exit0");
        let out = shim_run(&a, branch, "echo zero > /root/exit0.txt; exit 0").output(env)?;
        ensure!(out.status.code() == Some(0), "exit 0: {}", describe(&out));
        ensure!(
            outcome(env, &a)? == "committed",
            "{a}: {:#}",
            session(env, &a)?
        );

        let b = unique("s2-exit3");
        let out = shim_run(&b, branch, "echo three > /root/exit3.txt; exit 3").output(env)?;
        ensure!(
            out.status.code() == Some(3),
            "exit 3 must reach ctr: {}",
            describe(&out)
        );
        ensure!(
            outcome(env, &b)? == "committed",
            "on-exit publishes exit 3: {:#}",
            session(env, &b)?
        );

        // Killed: 137.
        let c = unique("s2-kill");
        let child = shim_run(&c, branch, "echo killed > /root/killed.txt; sleep 600").spawn(env)?;
        let out = cleaning_up_on_error(env, &c, || -> Result<Output> {
            wait_running(env, &c)?;
            // The write happens first thing; give sh a moment to get there.
            thread::sleep(Duration::from_millis(300));
            kill_task(env, NS, &c)?;
            Ok(child.wait_with_output()?)
        })?;
        ensure!(
            out.status.code() == Some(137),
            "SIGKILL must reach ctr as 137: {}",
            describe(&out)
        );
        ensure!(
            outcome(env, &c)? == "committed",
            "on-exit publishes a killed task: {:#}",
            session(env, &c)?
        );

        // on-success with exit 3: nothing published.
        let d = unique("s2-onsuccess-fail");
        let out = shim_run(&d, branch, "echo no > /root/onsuccess-fail.txt; exit 3")
            .label(publish_policy_label("on-success"))
            .output(env)?;
        ensure!(out.status.code() == Some(3), "exit 3: {}", describe(&out));
        let s = session(env, &d)?;
        ensure!(s["outcome"] == "discarded", "on-success + exit 3: {s:#}");

        // on-success with exit 0: published.
        let e = unique("s2-onsuccess-ok");
        let out = shim_run(&e, branch, "echo yes > /root/onsuccess-ok.txt")
            .label(publish_policy_label("on-success"))
            .output(env)?;
        ensure!(out.status.success(), "{}", describe(&out));
        ensure!(
            outcome(env, &e)? == "committed",
            "on-success + exit 0: {:#}",
            session(env, &e)?
        );

        // never: nothing published, upper discarded. Not --rm, so the session's
        // directory is still there to look at.
        let f = unique("s2-never");
        let out = shim_run(&f, branch, "echo never > /root/never.txt; exit 0")
            .label(publish_policy_label("never"))
            .rm(false)
            .output(env)?;
        ensure!(out.status.success(), "{}", describe(&out));
        let s = session(env, &f)?;
        ensure!(s["outcome"] == "discarded", "never: {s:#}");
        let upper = session_upper(env, &s)?;
        ensure!(
            dir_is_empty(&upper).unwrap_or(true),
            "never: upper {} still holds {:?}",
            upper.display(),
            std::fs::read_dir(&upper)
                .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
        );
        remove_container(env, NS, &f)?;

        // Invalid policy: the task is refused at create.
        let g = unique("s2-bad-policy");
        let out = shim_run(&g, branch, "true")
            .label(publish_policy_label("sometimes"))
            .output(env)?;
        ensure!(
            !out.status.success(),
            "an unknown policy must be refused: {}",
            describe(&out)
        );
        ensure!(
            String::from_utf8_lossy(&out.stderr).contains("layerstack.publish"),
            "refusal names the label: {}",
            describe(&out)
        );
        cleanup_container(env, &g);

        // What the branch shows now.
        let h = unique("s2-check");
        let text = shim_run(
            &h,
            branch,
            "for f in exit0 exit3 killed onsuccess-fail onsuccess-ok never; do \
               if [ -e /root/$f.txt ]; then echo $f:yes; else echo $f:no; fi; done",
        )
        .stdout_ok(env)?;
        let want =
            "exit0:yes\nexit3:yes\nkilled:yes\nonsuccess-fail:no\nonsuccess-ok:yes\nnever:no\n";
        ensure!(text == want, "branch content: {text:?}, want {want:?}");
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// 3. exec with a TTY, then kill + delete publishes
// ---------------------------------------------------------------------------

/// Issue 3, item 3: `ctr task exec -t` into a detached container works; `ctr task
/// kill` then `ctr task delete` publishes (before `task delete` returns).
#[test]
fn shim3_exec_tty_then_kill_and_delete_publishes() {
    run_shim_test(|env| {
        let branch = "shim-exec";
        let id = unique("s3");
        cleaning_up_on_error(env, &id, || {
            start_running(env, &id, branch, "sleep 600")?;
            // ctr needs a terminal for -t: run it under script(1).
            let ctr = format!(
                "ctr --address {} --namespace {NS} tasks exec -t --exec-id e1 {id} sh -c 'tty; echo from-exec > /root/exec.txt'",
                env.containerd().socket().display()
            );
            let out = run_with_timeout(
                std::process::Command::new("script").args(["-qec", &ctr, "/dev/null"]),
                Duration::from_secs(60),
            )?;
            let text = stdout(&out);
            ensure!(out.status.success(), "exec -t: {}", describe(&out));
            ensure!(text.contains("/dev/pts/"), "exec -t has no tty: {text:?}");
            // Plain exec too.
            let out = env.ctr(
                NS,
                &[
                    "tasks",
                    "exec",
                    "--exec-id",
                    "e2",
                    &id,
                    "cat",
                    "/root/exec.txt",
                ],
            )?;
            ensure!(
                out.status.success() && stdout(&out).trim() == "from-exec",
                "exec: {}",
                describe(&out)
            );

            kill_and_wait_stopped(env, &id)?;
            let s = session(env, &id)?;
            ensure!(
                s["outcome"].is_null(),
                "published before the task was deleted: {s:#}"
            );
            delete_task_committed(env, &id, "after exec")?;

            let check = unique("s3-check");
            let text = shim_run(&check, branch, "cat /root/exec.txt").stdout_ok(env)?;
            ensure!(text.trim() == "from-exec", "next container sees {text:?}");
            Ok(())
        })
    });
}

// ---------------------------------------------------------------------------
// 4. the proxy killed with SIGKILL
// ---------------------------------------------------------------------------

/// Issue 3, item 4: kill -9 the proxy shim mid-run: the container is cleaned up,
/// no shim process remains, the session ends `discarded` or published, never stuck.
#[test]
fn shim4_sigkill_of_the_proxy_cleans_up() {
    run_shim_test(|env| {
        let branch = "shim-sigkill";
        let id = unique("s4");
        cleaning_up_on_error(env, &id, || {
            start_running(
                env,
                &id,
                branch,
                "echo before-kill > /root/k9.txt; sleep 600",
            )?;
            thread::sleep(Duration::from_millis(300));
            let procs = shim_processes(env, &id);
            let proxy: Vec<&String> = procs.iter().filter(|p| p.contains(SHIM_BIN)).collect();
            let inner: Vec<&String> = procs
                .iter()
                .filter(|p| p.contains("containerd-shim-runc-v2"))
                .collect();
            ensure!(
                proxy.len() == 1 && inner.len() == 1,
                "expected one proxy and one runc-v2 shim: {procs:#?}"
            );
            let pid: i32 = proxy[0].split_whitespace().next().context("pid")?.parse()?;
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            )?;

            // containerd notices, runs our `delete`, which stops runc-v2 and publishes.
            let deadline = Instant::now() + Duration::from_secs(60);
            let s = loop {
                let left = shim_processes(env, &id);
                let s = session(env, &id)?;
                let mounted = env.containerd().rootfs_mount(NS, &id).is_some();
                if left.is_empty() && !s["outcome"].is_null() && !mounted {
                    break s;
                }
                ensure!(
                    Instant::now() < deadline,
                    "60s after SIGKILL of the proxy: shims {left:#?}, rootfs mounted {mounted}, session {s:#}"
                );
                thread::sleep(Duration::from_millis(200));
            };
            let state = s["state"].as_str().unwrap_or("");
            ensure!(
                state == "published" || state == "discarded",
                "session after SIGKILL: {s:#}"
            );
            eprintln!(
                "shim: after SIGKILL of the proxy the session ended {state} ({})",
                s["outcome"]
            );

            // The task is gone or stopped; both deletes work.
            let _ = env.ctr(NS, &["tasks", "delete", &id]);
            remove_container(env, NS, &id)?;
            ensure!(
                shim_processes(env, &id).is_empty(),
                "shim processes left: {:#?}",
                shim_processes(env, &id)
            );
            let runc_state = Path::new("/run/containerd/runc").join(NS).join(&id);
            ensure!(
                !runc_state.exists(),
                "runc state left at {}",
                runc_state.display()
            );
            let check = unique("s4-check");
            let text = shim_run(
                &check,
                branch,
                "cat /root/k9.txt 2>/dev/null || echo ABSENT",
            )
            .stdout_ok(env)?;
            let want = if state == "published" {
                "before-kill"
            } else {
                "ABSENT"
            };
            ensure!(
                text.trim() == want,
                "after a {state} session the branch shows {text:?}"
            );
            Ok(())
        })
    });
}

// ---------------------------------------------------------------------------
// 5. containerd restart under a running container
// ---------------------------------------------------------------------------

/// Issue 3, item 5: restart containerd while a container runs: exec and publish
/// still work afterwards (containerd reconnects through `<bundle>/address`).
#[test]
fn shim5_containerd_restart_keeps_exec_and_publish() {
    run_shim_test_mut(|env| {
        let branch = "shim-restart";
        let id = unique("s5");
        start_running(
            env,
            &id,
            branch,
            "echo before > /root/restart.txt; sleep 600",
        )?;
        let before = shim_processes(env, &id);
        env.restart_containerd()?;
        cleaning_up_on_error(env, &id, || {
            ensure!(
                shim_processes(env, &id) == before,
                "shims changed across the restart: {before:#?}"
            );
            wait_running(env, &id)?;
            let out = env.ctr(
                NS,
                &[
                    "tasks",
                    "exec",
                    "--exec-id",
                    "after",
                    &id,
                    "sh",
                    "-c",
                    "echo after >> /root/restart.txt; cat /root/restart.txt",
                ],
            )?;
            ensure!(
                out.status.success(),
                "exec after restart: {}",
                describe(&out)
            );
            ensure!(
                stdout(&out) == "before\nafter\n",
                "exec output: {}",
                describe(&out)
            );
            kill_and_wait_stopped(env, &id)?;
            delete_task_committed(env, &id, "after the containerd restart")?;
            let check = unique("s5-check");
            let text = shim_run(&check, branch, "cat /root/restart.txt").stdout_ok(env)?;
            ensure!(text == "before\nafter\n", "next container sees {text:?}");
            // The shims of the deleted task are gone.
            let deadline = Instant::now() + Duration::from_secs(20);
            while !shim_processes(env, &id).is_empty() {
                ensure!(
                    Instant::now() < deadline,
                    "shims left: {:#?}",
                    shim_processes(env, &id)
                );
                thread::sleep(Duration::from_millis(100));
            }
            Ok(())
        })
    });
}

// ---------------------------------------------------------------------------
// Runtime options and the `delete` action
// ---------------------------------------------------------------------------

/// The shim's settings can come from runtime options (`ctr run
/// --runtime-config-path FILE`): here the admin socket and a runc root.
#[test]
fn shim_runtime_config_file() {
    run_shim_test(|env| {
        let cfg = env.scratch().join("shim-config.toml");
        let runc_root = env.scratch().join("runc-from-config");
        std::fs::write(
            &cfg,
            format!(
                "admin_address = {:?}\nrunc_root = {:?}\npublish_timeout_s = 60\n",
                env.admin_socket().to_string_lossy(),
                runc_root.to_string_lossy()
            ),
        )?;
        let id = unique("s7");
        shim_run(&id, "shim-config", "echo cfg > /root/cfg.txt")
            .extra(&["--runtime-config-path", &cfg.to_string_lossy()])
            .ok(env)?;
        ensure!(
            outcome(env, &id)? == "committed",
            "{:#}",
            session(env, &id)?
        );
        ensure!(
            runc_root.join(NS).is_dir(),
            "runc did not use the configured root {}",
            runc_root.display()
        );
        Ok(())
    });
}

/// `delete` with nothing to clean up (no bundle, no state) still answers with a
/// protobuf reply on stdout and exit 0, every time.
#[test]
fn shim_delete_action_is_idempotent() {
    if !require_root_and_containerd() {
        return;
    }
    let bin = bin_path(SHIM_BIN).expect("the shim binary must be built");
    let dir = tempfile::tempdir().expect("temp dir");
    let bundle = dir.path().join("no-such-bundle");
    for _ in 0..2 {
        let out = run_with_timeout(
            std::process::Command::new(&bin)
                .current_dir(dir.path())
                .env("TTRPC_ADDRESS", dir.path().join("none.sock"))
                .args(["-namespace", NS, "-address"])
                .arg(dir.path().join("none.sock"))
                .args(["-id", "nothing-here", "-bundle"])
                .arg(&bundle)
                .arg("delete"),
            Duration::from_secs(30),
        )
        .expect("running delete");
        assert!(out.status.success(), "delete failed: {}", describe(&out));
        assert!(
            !out.stdout.is_empty(),
            "delete printed no reply: {}",
            describe(&out)
        );
        // Field 2 (exit_status) = 137, varint: 0x10 0x89 0x01.
        assert!(
            out.stdout.windows(3).any(|w| w == [0x10, 0x89, 0x01]),
            "reply: {:?}",
            out.stdout
        );
    }
}

/// A shim that cannot reach the daemon (here: its config names an admin socket
/// that does not exist) refuses the task's create, naming the address it tried
/// and how to configure it: the container's writes could never be published, so
/// it must not run (issue 9: no silent fallback). Nothing runs, nothing is
/// published, no shim stays behind. (A daemon lost *after* create keeps the exit
/// status: `shim_daemon_down_at_delete…` below.)
#[test]
fn shim_refuses_create_without_the_daemon() {
    run_shim_test(|env| {
        let cfg = env.scratch().join("shim-bad-admin.toml");
        let bad = env.scratch().join("no-such-admin.sock");
        std::fs::write(
            &cfg,
            format!("admin_address = {:?}\n", bad.to_string_lossy()),
        )?;
        let id = unique("s8");
        let out = CtrRun::sh(NS, &id, "echo x > /root/nodaemon.txt; exit 5")
            .runtime(SHIM_RUNTIME)
            .rm(true)
            .extra(&[
                "--runtime-config-path",
                &cfg.to_string_lossy(),
                "--snapshotter-label",
                &snapshot_branch_label("shim-nodaemon"),
            ])
            .output(env)?;
        ensure!(
            !out.status.success() && out.status.code() != Some(5),
            "the task ran without the daemon: {}",
            describe(&out)
        );
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(
            err.contains(&*bad.to_string_lossy())
                && err.contains("admin_address")
                && err.contains("LAYERSTACK_ADMIN_ADDRESS"),
            "the refusal must name the address tried and how to configure it: {}",
            describe(&out)
        );
        // containerd stops the refused task's shim after `ctr run` returns
        // (its shutdown is asynchronous): none stays, within seconds.
        let t0 = std::time::Instant::now();
        while !shim_processes(env, &id).is_empty()
            && t0.elapsed() < std::time::Duration::from_secs(10)
        {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        ensure!(
            shim_processes(env, &id).is_empty(),
            "shims left 10 s after the refused create: {:#?}",
            shim_processes(env, &id)
        );
        // Nothing was published: the session (if containerd's Prepare made one
        // before the create failed) never committed.
        if let Ok(sess) = session(env, &id) {
            ensure!(
                !matches!(sess["outcome"].as_str(), Some("committed" | "merged")),
                "a layer was published without a running task: {sess:#}"
            );
        }
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// The recorded exit policy on the paths without the shim's own publish, and the
// death of the inner shim
// ---------------------------------------------------------------------------

/// Waits (at most `timeout`) for the spawned `ctr` to exit and collects its
/// output; kills it and fails if it is still running then.
fn wait_ctr(mut child: std::process::Child, timeout: Duration, what: &str) -> Result<Output> {
    match layerstack_integration::wait_timeout(&mut child, timeout)? {
        Some(_) => Ok(child.wait_with_output()?),
        None => {
            let _ = child.kill();
            let out = child.wait_with_output()?;
            anyhow::bail!("{what} still running after {timeout:?}: {}", describe(&out))
        }
    }
}

/// The pid of the one shim process of container `id` whose command line
/// contains `needle` (the proxy: [`SHIM_BIN`]; the inner shim:
/// `containerd-shim-runc-v2`).
fn the_shim_pid(env: &TestEnv, id: &str, needle: &str) -> Result<i32> {
    let procs = shim_processes(env, id);
    let found: Vec<&String> = procs.iter().filter(|p| p.contains(needle)).collect();
    ensure!(
        found.len() == 1,
        "expected one {needle} process for {id}: {procs:#?}"
    );
    Ok(found[0].split_whitespace().next().context("pid")?.parse()?)
}

fn sigkill(pid: i32) -> Result<()> {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    Ok(())
}

/// Live (not zombie) processes whose command line is exactly `argv`: "pid cmdline".
fn processes_with_argv(argv: &[&str]) -> Vec<String> {
    live_processes()
        .into_iter()
        .filter(|(_, a)| a.len() == argv.len() && a.iter().zip(argv).all(|(x, y)| x == y))
        .map(|(pid, a)| format!("{pid} {}", a.join(" ")))
        .collect()
}

/// The PID column of task `id` in `ctr tasks ls`.
fn task_pid(env: &TestEnv, id: &str) -> Result<i32> {
    let text = stdout(&env.ctr_ok(NS, &["tasks", "ls"])?);
    let line = text
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.first() == Some(&id))
        .with_context(|| format!("no task {id}:\n{text}"))?;
    Ok(line.get(1).context("pid column")?.parse()?)
}

/// `layerstack wait <id> --timeout 60` → its outcome word, which must be `want`.
fn wait_outcome(env: &TestEnv, id: &str, want: &str) -> Result<()> {
    let t = Instant::now();
    let w = layerstack_wait(env, NS, id, &[])?;
    let word = stdout(&w).lines().next().unwrap_or("").trim().to_string();
    eprintln!(
        "shim: layerstack wait {id} → {word:?} in {:.2}s",
        t.elapsed().as_secs_f64()
    );
    ensure!(
        word == want,
        "layerstack wait {id}: want {want}: {}; session {:#}",
        describe(&w),
        session(env, id)?
    );
    Ok(())
}

/// The proxy is SIGKILLed under a `layerstack.publish=never` container: the
/// shim's `delete` action (EndAction AUTO) applies the recorded `never`, so
/// nothing reaches the branch.
#[test]
fn shim_sigkill_with_policy_never_discards() {
    run_shim_test(|env| {
        let branch = "shim-sigkill-never";
        let id = unique("s9");
        let child = shim_run(
            &id,
            branch,
            &format!("echo secret > /root/{id}.txt; sleep 30"),
        )
        .label(publish_policy_label("never"))
        .spawn(env)?;
        cleaning_up_on_error(env, &id, || {
            wait_running(env, &id)?;
            thread::sleep(Duration::from_millis(300));
            let pid = the_shim_pid(env, &id, SHIM_BIN)?;
            let t = Instant::now();
            sigkill(pid)?;
            let out = wait_ctr(
                child,
                Duration::from_secs(60),
                "ctr run after SIGKILL of the proxy",
            )?;
            eprintln!(
                "shim: ctr run returned {:.2}s after SIGKILL of the proxy: {}",
                t.elapsed().as_secs_f64(),
                describe(&out)
            );
            wait_outcome(env, &id, "discarded")?;
            let _ = env.ctr(NS, &["tasks", "delete", &id]);
            let _ = env.ctr(NS, &["containers", "delete", &id]);
            let check = unique("s9-check");
            let text = shim_run(
                &check,
                branch,
                &format!("cat /root/{id}.txt 2>/dev/null || echo ABSENT"),
            )
            .stdout_ok(env)?;
            ensure!(
                text.trim() == "ABSENT",
                "never + SIGKILL of the proxy: the branch shows {text:?}"
            );
            Ok(())
        })
    });
}

/// The daemon is down when the task is deleted: the shim's publish fails, the
/// exit status still reaches `ctr`, and after the restart reconcile applies the
/// recorded `never`.
#[test]
fn shim_daemon_down_at_delete_keeps_policy_never() {
    run_shim_test(|env| {
        let branch = "shim-daemon-down-never";
        let id = unique("s10");
        shim_run(
            &id,
            branch,
            &format!("echo secret > /root/{id}.txt; sleep 3; exit 7"),
        )
        .label(publish_policy_label("never"))
        .detached()
        .ok(env)?;
        let r = (|| -> Result<()> {
            env.kill_daemon()?;
            wait_task_stopped(env, NS, &id, Duration::from_secs(60))?;
            let t = Instant::now();
            let out = env.ctr(NS, &["tasks", "delete", &id])?;
            let took = t.elapsed();
            eprintln!(
                "shim: ctr tasks delete with the daemon down took {:.2}s: {}",
                took.as_secs_f64(),
                describe(&out)
            );
            // ctr 1.6 `tasks delete` exits 0 and warns with the task's exit code.
            ensure!(
                out.status.success()
                    && String::from_utf8_lossy(&out.stderr).contains("non-zero exit code 7"),
                "exit status lost with the daemon down: {}",
                describe(&out)
            );
            let (status, text) = task_status(env, NS, &id)?;
            ensure!(status.is_none(), "task still listed after delete:\n{text}");
            Ok(())
        })();
        // The daemon must come back whatever happened, for the other tests.
        let t = Instant::now();
        let restarted = env.restart_daemon();
        eprintln!(
            "shim: daemon restarted in {:.2}s",
            t.elapsed().as_secs_f64()
        );
        cleaning_up_on_error(env, &id, || {
            r?;
            restarted?;
            wait_outcome(env, &id, "discarded")?;
            remove_container(env, NS, &id)?;
            let check = unique("s10-check");
            let text = shim_run(
                &check,
                branch,
                &format!("cat /root/{id}.txt 2>/dev/null || echo ABSENT"),
            )
            .stdout_ok(env)?;
            ensure!(
                text.trim() == "ABSENT",
                "never + daemon down at delete: the branch shows {text:?}"
            );
            Ok(())
        })
    });
}

/// The inner containerd-shim-runc-v2 dies under a running container: the proxy
/// exits, containerd runs the shim's `delete` action, which kills and deletes the
/// container and ends the run (on-exit: committed).
#[test]
fn shim_inner_shim_death_cleans_up() {
    run_shim_test(|env| {
        let branch = "shim-inner-death";
        let id = unique("s11");
        // A sleep argument no other test uses, to find the container's process.
        let nap = "60.0417";
        start_running(
            env,
            &id,
            branch,
            &format!("echo inner > /root/{id}.txt; sleep {nap}"),
        )?;
        cleaning_up_on_error(env, &id, || {
            thread::sleep(Duration::from_millis(300));
            let init = task_pid(env, &id)?;
            ensure!(
                !processes_with_argv(&["sleep", nap]).is_empty(),
                "no `sleep {nap}` in the container"
            );
            let inner = the_shim_pid(env, &id, "containerd-shim-runc-v2")?;
            let t = Instant::now();
            sigkill(inner)?;

            // Within ~15 s: the task is gone or STOPPED.
            let deadline = t + Duration::from_secs(15);
            let status = loop {
                let (status, text) = task_status(env, NS, &id)?;
                match status.as_deref() {
                    None | Some("STOPPED") => break status,
                    _ if Instant::now() >= deadline => {
                        anyhow::bail!(
                            "15s after SIGKILL of the inner shim: task {id} {status:?}\n{text}\nshims {:#?}\nsleep {:#?}",
                            shim_processes(env, &id),
                            processes_with_argv(&["sleep", nap])
                        )
                    }
                    _ => thread::sleep(Duration::from_millis(100)),
                }
            };
            eprintln!(
                "shim: task {id} {} {:.2}s after SIGKILL of the inner shim",
                status.as_deref().unwrap_or("gone"),
                t.elapsed().as_secs_f64()
            );
            if status.is_some() {
                let out = env.ctr(NS, &["tasks", "delete", &id])?;
                if !out.status.success() {
                    eprintln!("shim: ctr tasks delete failed: {}", describe(&out));
                    let out = env.ctr(NS, &["tasks", "rm", "-f", &id])?;
                    ensure!(out.status.success(), "ctr tasks rm -f: {}", describe(&out));
                }
                let (status, text) = task_status(env, NS, &id)?;
                ensure!(status.is_none(), "task still listed after delete:\n{text}");
            }

            // No process of the container, no shim for it.
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let sleeps = processes_with_argv(&["sleep", nap]);
                let init_alive = std::fs::read_to_string(format!("/proc/{init}/stat"))
                    .map(|s| {
                        s.rfind(')')
                            .map(|i| !s[i + 1..].trim_start().starts_with('Z'))
                            .unwrap_or(true)
                    })
                    .unwrap_or(false);
                let shims = shim_processes(env, &id);
                if sleeps.is_empty() && !init_alive && shims.is_empty() {
                    break;
                }
                ensure!(
                    Instant::now() < deadline,
                    "after the task is gone: container processes {sleeps:#?} (init {init} alive: {init_alive}), shims {shims:#?}"
                );
                thread::sleep(Duration::from_millis(100));
            }
            let mounted = env.containerd().rootfs_mount(NS, &id).is_some();
            ensure!(!mounted, "rootfs of {id} still mounted");

            wait_outcome(env, &id, "committed")?;
            remove_container(env, NS, &id)?;
            let check = unique("s11-check");
            let text = shim_run(
                &check,
                branch,
                &format!("cat /root/{id}.txt 2>/dev/null || echo ABSENT"),
            )
            .stdout_ok(env)?;
            ensure!(
                text.trim() == "inner",
                "after the inner shim died the branch shows {text:?}"
            );
            Ok(())
        })
    });
}
