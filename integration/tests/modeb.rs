//! Mode B (issue 11): sessions without a container — `layerstack session run`,
//! `create`/`exec`/`close` — against the real daemon: isolation, the gate shared
//! with containers, sessions run from inside a container holding the admin
//! socket, SIGKILL of a holder, the cap, bad input.
//!
//! Needs root and containerd (fails under `CI=true` without them).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Once;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use layerstack_integration::*;
use serde_json::Value;

const NS: &str = "modeb";

/// The daemon of this test binary allows more live sandbox sessions than the
/// default 256 (the isolation test holds 1,000 at once).
fn scenario(f: impl FnOnce(&TestEnv) -> Result<()>) {
    static ARGS: Once = Once::new();
    ARGS.call_once(|| set_daemon_args(&["--sandbox-max-sessions", "2048"]));
    run_layerstack_scenario(NS, f);
}

fn cli() -> PathBuf {
    bin_path(CLI_BIN).expect("layerstack binary")
}

/// `layerstack --admin-address … -n modeb ARGS…`, stdin closed.
fn ls_cmd(env: &TestEnv, args: &[&str]) -> Command {
    let mut c = Command::new(cli());
    c.arg("--admin-address")
        .arg(env.admin_socket())
        .args(["-n", NS])
        .args(args)
        .stdin(Stdio::null());
    c
}

fn ls(env: &TestEnv, args: &[&str]) -> Result<Output> {
    run_with_timeout(&mut ls_cmd(env, args), CMD_TIMEOUT)
}

/// `session run DEBIAN ARGS… -- sh -c SCRIPT`.
fn run_sh(env: &TestEnv, args: &[&str], script: &str) -> Result<Output> {
    let mut a = vec!["session", "run", DEBIAN_IMAGE];
    a.extend_from_slice(args);
    a.extend_from_slice(&["--", "sh", "-c", script]);
    ls(env, &a)
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

/// The JSON written to `--outcome FILE`.
fn outcome_file(p: &Path) -> Result<Value> {
    let s = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
    serde_json::from_str(&s).with_context(|| format!("outcome JSON {s:?}"))
}

/// Every overlay upperdir in every mount namespace of the machine.
fn all_upperdirs() -> BTreeSet<String> {
    let mut seen_ns = BTreeSet::new();
    let mut out = BTreeSet::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let pid = e.file_name();
        let Some(pid) = pid.to_str().filter(|p| p.bytes().all(|b| b.is_ascii_digit())) else {
            continue;
        };
        let Ok(ns) = std::fs::read_link(format!("/proc/{pid}/ns/mnt")) else { continue };
        if !seen_ns.insert(ns) {
            continue;
        }
        let Ok(mi) = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")) else { continue };
        for l in mi.lines() {
            for opt in l.split([' ', ',']) {
                if let Some(u) = opt.strip_prefix("upperdir=") {
                    out.insert(u.to_string());
                }
            }
        }
    }
    out
}

fn sessions_json(env: &TestEnv, owner: &str) -> Result<Vec<Value>> {
    let out = ls(env, &["session", "ls", "--json", "--owner", owner])?;
    ensure!(out.status.success(), "session ls: {}", describe(&out));
    Ok(serde_json::from_slice::<Vec<Value>>(&out.stdout)?)
}

#[test]
fn run_passes_stdio_and_exit_status_and_publishes_on_exit() {
    scenario(|env| {
        let dir = env.scratch().join("smoke");
        std::fs::create_dir_all(&dir)?;
        let outcome = dir.join("o.json");
        let o = run_sh(
            env,
            &["--outcome", outcome.to_str().context("utf-8")?],
            "echo out; echo err >&2; echo smoke > /smoke-marker; test -d /proc/self && test -c /dev/null && hostname; exit 7",
        )?;
        ensure!(code(&o) == 7, "exit status: {}", describe(&o));
        let out = stdout(&o);
        ensure!(out.starts_with("out\nls-"), "stdout untouched: {out:?}");
        let stderr = String::from_utf8_lossy(&o.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        ensure!(lines.first() == Some(&"err"), "stderr: {stderr:?}");
        ensure!(
            lines.len() == 2 && lines[1].contains("committed"),
            "one outcome line on stderr: {stderr:?}"
        );
        let v = outcome_file(&outcome)?;
        ensure!(v["outcome"] == "committed" && v["exit_status"] == 7, "{v}");
        ensure!(v["owner_kind"] == "sandbox", "{v}");
        // The next session sees it.
        let o = run_sh(env, &[], "cat /smoke-marker")?;
        ensure!(code(&o) == 0 && stdout(&o) == "smoke\n", "{}", describe(&o));
        Ok(())
    });
}
