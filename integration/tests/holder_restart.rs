//! `layerstack session run` across a kill -9 of the daemon (issue 20): the
//! command's exit status and the session's outcome are not lost because the
//! daemon was briefly away. The holder reconnects, takes its session back and
//! closes it on the restarted daemon, which applies the exit policy as the
//! last one would have — when the command ended while the daemon was down,
//! and when the daemon was killed during the publish. Also: a root-mode
//! session over a base lacking /dev, /proc, /sys and /run does not publish the
//! mountpoints its init made.
//!
//! Needs root (fails under `CI=true` without it) and `/bin/busybox` (static);
//! no containerd (a base imported from a directory).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use layerstack_integration::*;
use serde_json::Value;

/// A daemon and a base of a static busybox (no /dev, /proc, /sys, /run).
fn daemon_and_base() -> Result<(StandaloneDaemon, String)> {
    let env = StandaloneDaemon::start()?;
    let src = env.dir().join("rootfs");
    busybox_tree(
        &src,
        &["sh", "sleep", "echo", "cat", "test", "true", "seq"],
        &[],
    )?;
    std::fs::create_dir_all(src.join("etc"))?;
    std::fs::write(src.join("etc/motd"), "base\n")?;
    let o = ensure_success(
        "base import",
        env.layerstack(&["base", "import", src.to_str().context("utf-8")?])?,
    )?;
    let stack = stdout(&o).trim().to_string();
    Ok((env, stack))
}

/// `layerstack session run STACK --name NAME --publish on-success --outcome
/// FILE -- sh -c SCRIPT`, started in the background.
fn spawn_run(
    env: &StandaloneDaemon,
    stack: &str,
    name: &str,
    outcome: &Path,
    script: &str,
) -> Result<Child> {
    Command::new(bin_path(CLI_BIN)?)
        .arg("--admin-address")
        .arg(env.daemon().admin_socket())
        .args([
            "session",
            "run",
            stack,
            "--name",
            name,
            "--publish",
            "on-success",
        ])
        .arg("--outcome")
        .arg(outcome)
        .args(["--", "sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("spawning layerstack session run")
}

/// The id and upper directory of the live session named `name`.
fn live_session(env: &StandaloneDaemon, name: &str) -> Result<(i64, PathBuf)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let o = env.layerstack(&["session", "ls", "--json", "--owner", "sandbox"])?;
        let listed: Vec<Value> = serde_json::from_slice(&o.stdout).with_context(|| describe(&o))?;
        let found = listed
            .iter()
            .find(|s| s["owner"] == format!("sandbox:{name}") && s["released"] == false);
        if let Some(s) = found {
            let id = s["id"].as_i64().context("id")?;
            let upper = env
                .daemon()
                .root()
                .join("s")
                .join(id.to_string())
                .join("upper");
            if mounted_anywhere(&upper) {
                return Ok((id, upper));
            }
        }
        ensure!(
            Instant::now() < deadline,
            "session {name} never became live: {listed:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for `child` (at most 90 s: longer than the holder's 30 s of retries).
fn finish(mut child: Child) -> Result<Output> {
    let status = wait_timeout(&mut child, Duration::from_secs(90))?;
    ensure!(status.is_some(), "session run did not end");
    child.wait_with_output().context("session run's output")
}

/// What a new session on the branch reads at `path` ("" when absent).
fn read_back(env: &StandaloneDaemon, stack: &str, path: &str) -> Result<String> {
    let o = env.layerstack(&[
        "session",
        "run",
        stack,
        "--publish",
        "never",
        "--",
        "sh",
        "-c",
        &format!("cat {path} 2>/dev/null; true"),
    ])?;
    ensure!(o.status.success(), "{}", describe(&o));
    Ok(stdout(&o))
}

/// Runs `f` on `env`; prints the daemon's log if it fails.
fn with_log(
    env: &mut StandaloneDaemon,
    f: impl FnOnce(&mut StandaloneDaemon) -> Result<()>,
) -> Result<()> {
    let r = f(env);
    if r.is_err() {
        env.daemon().dump_log();
    }
    r
}

/// `child` (a `session run` of session `id`) exits 0 and its outcome file says
/// `committed` with exit status 0; a new session reads `want` at `path`.
/// Returns its stderr.
fn committed(
    env: &StandaloneDaemon,
    stack: &str,
    child: Child,
    outcome: &Path,
    id: i64,
    (path, want): (&str, &str),
) -> Result<String> {
    let o = finish(child)?;
    ensure!(o.status.code() == Some(0), "session run: {}", describe(&o));
    let v = outcome_file(outcome)?;
    ensure!(
        v["outcome"] == "committed" && v["exit_status"] == 0 && v["id"] == id,
        "{v}"
    );
    ensure!(read_back(env, stack, path)? == want, "{path} was published");
    Ok(String::from_utf8_lossy(&o.stderr).into_owned())
}

fn outcome_file(p: &Path) -> Result<Value> {
    let s =
        std::fs::read_to_string(p).with_context(|| format!("no outcome file {}", p.display()))?;
    serde_json::from_str(&s).with_context(|| format!("outcome JSON {s:?}"))
}

/// The command ends (status 0) while the daemon is down: `session run`
/// reconnects to the restarted daemon, which publishes by `on-success` with
/// that status; the outcome file says so and `session run` exits 0.
#[test]
fn the_command_ends_while_the_daemon_is_down() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let (mut env, stack) = daemon_and_base()?;
    with_log(&mut env, |env| {
        let outcome = env.dir().join("down.json");
        let child = spawn_run(
            env,
            &stack,
            "down",
            &outcome,
            "sleep 2; echo kept > /etc/down.txt",
        )?;
        let (id, upper) = live_session(env, "down")?;
        let pid = env.kill_daemon()?;
        eprintln!("killed the daemon (pid {pid}) while session {id}'s command runs");
        // The command ends and the session's namespaces go while it is down.
        let t0 = Instant::now();
        while mounted_anywhere(&upper) {
            ensure!(
                t0.elapsed() < Duration::from_secs(30),
                "the command never ended"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // The systemd unit restarts after 2 s.
        std::thread::sleep(Duration::from_secs(2));
        env.restart_daemon()?;
        let err = committed(
            env,
            &stack,
            child,
            &outcome,
            id,
            ("/etc/down.txt", "kept\n"),
        )?;
        ensure!(err.contains("reconnecting"), "{err}");
        Ok(())
    })
}

/// The daemon is killed during the publish `session run` asked for: the
/// restarted daemon finishes the close with the command's status (or answers
/// what it recorded, if the last one committed before it died), and `session
/// run` gets that outcome — not 125.
#[test]
fn the_daemon_is_killed_during_the_publish() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let (mut env, stack) = daemon_and_base()?;
    with_log(&mut env, |env| {
        let outcome = env.dir().join("mid.json");
        // Thousands of files: a publish that takes a while. The last write
        // tells the test the command is about to exit.
        let script = "mkdir -p /data; for i in $(seq 1 4000); do echo $i > /data/f$i; done; \
                      sleep 1; echo last > /data/last";
        let child = spawn_run(env, &stack, "mid", &outcome, script)?;
        let (id, upper) = live_session(env, "mid")?;
        let t0 = Instant::now();
        while !upper.join("data/last").exists() {
            ensure!(
                t0.elapsed() < Duration::from_secs(60),
                "the command never ended"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        // The command exits, the holder asks for the close: the publish runs.
        while mounted_anywhere(&upper) {
            ensure!(
                t0.elapsed() < Duration::from_secs(60),
                "the session never ended"
            );
        }
        std::thread::sleep(Duration::from_millis(30));
        let pid = env.kill_daemon()?;
        eprintln!("killed the daemon (pid {pid}) during session {id}'s close");
        env.restart_daemon()?;
        committed(env, &stack, child, &outcome, id, ("/data/last", "last\n"))?;
        ensure!(read_back(env, &stack, "/data/f4000")? == "4000\n", "whole");
        Ok(())
    })
}

/// Root mode over a base without /dev, /proc, /sys and /run: init makes those
/// directories in the upper to mount on; they are the sandbox's, not the
/// session's: a command that writes nothing publishes nothing, and one that
/// writes publishes only its write.
#[test]
fn root_mode_mountpoints_are_not_published() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let (env, stack) = daemon_and_base()?;
    let outcome = env.dir().join("mp.json");
    let o = env.layerstack(&[
        "session",
        "run",
        &stack,
        "--outcome",
        outcome.to_str().context("utf-8")?,
        "--",
        "sh",
        "-c",
        "test -d /proc/self && test -c /dev/null && test -d /sys && test -d /run",
    ])?;
    ensure!(o.status.success(), "{}", describe(&o));
    let v = outcome_file(&outcome)?;
    ensure!(v["outcome"] == "no-change", "nothing was written: {v}");
    let o = env.layerstack(&[
        "session",
        "run",
        &stack,
        "--outcome",
        outcome.to_str().context("utf-8")?,
        "--",
        "sh",
        "-c",
        "echo x > /etc/x",
    ])?;
    ensure!(o.status.success(), "{}", describe(&o));
    let v = outcome_file(&outcome)?;
    ensure!(v["outcome"] == "committed", "{v}");
    // What the branch holds beyond the base: the write only.
    let o = ensure_success(
        "diff",
        env.layerstack(&["diff", &format!("{stack}@main"), "--at", "base"])?,
    )?;
    let shown = stdout(&o);
    for m in ["dev", "proc", "sys", "run"] {
        ensure!(
            !shown.split_whitespace().any(|w| w.trim_matches('/') == m),
            "/{m} is published: {shown}"
        );
    }
    ensure!(
        shown.contains("etc/x"),
        "the write is in the layer: {}",
        describe(&o)
    );
    Ok(())
}

/// The daemon restarts while the command runs: `session run` takes its
/// session back at once (`resume` on a new connection), so the restarted
/// daemon holds it as its holder's — the close needs no reconnect, and a
/// holder killed afterwards ends its session by its policy at once (its
/// connection's end), not after the restarted daemon's wait for holders.
#[test]
fn a_restart_while_the_command_runs_gives_the_session_back_to_its_holder() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let (mut env, stack) = daemon_and_base()?;
    with_log(&mut env, |env| {
        let outcome = env.dir().join("live.json");
        let child = spawn_run(
            env,
            &stack,
            "live",
            &outcome,
            "sleep 5; echo kept > /etc/live.txt",
        )?;
        let victim = spawn_run(env, &stack, "victim", &env.dir().join("v.json"), "sleep 60")?;
        let (id, _) = live_session(env, "live")?;
        let (victim_id, _) = live_session(env, "victim")?;
        env.kill_daemon()?;
        env.restart_daemon()?;
        // The holders reconnect with back-off (100 ms doubling).
        std::thread::sleep(Duration::from_secs(3));
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(victim.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )?;
        let o = env.layerstack(&[
            "wait",
            "--session",
            &victim_id.to_string(),
            "--timeout",
            "20",
            "--json",
        ])?;
        let v: Value = serde_json::from_slice(&o.stdout).with_context(|| describe(&o))?;
        ensure!(
            v["outcome"] == "discarded",
            "a killed holder's session (on-success, no exit status) ends at once: {v}"
        );
        let _ = finish(victim);
        let err = committed(
            env,
            &stack,
            child,
            &outcome,
            id,
            ("/etc/live.txt", "kept\n"),
        )?;
        ensure!(
            !err.contains("reconnecting"),
            "the close went over the resumed connection: {err}"
        );
        Ok(())
    })
}
