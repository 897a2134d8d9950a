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
fn mb_sh(env: &TestEnv, args: &[&str], script: &str) -> Result<Output> {
    mb_sh_on(env, DEBIAN_IMAGE, args, script)
}

/// `session run STACK ARGS… -- sh -c SCRIPT`.
fn mb_sh_on(env: &TestEnv, stack: &str, args: &[&str], script: &str) -> Result<Output> {
    let mut a = vec!["session", "run", stack];
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
        let Some(pid) = pid
            .to_str()
            .filter(|p| p.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(ns) = std::fs::read_link(format!("/proc/{pid}/ns/mnt")) else {
            continue;
        };
        if !seen_ns.insert(ns) {
            continue;
        }
        let Ok(mi) = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")) else {
            continue;
        };
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
        let o = mb_sh(
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
        let o = mb_sh(env, &[], "cat /smoke-marker")?;
        ensure!(code(&o) == 0 && stdout(&o) == "smoke\n", "{}", describe(&o));
        Ok(())
    });
}

/// Starts `session create` and returns the session id.
fn create(env: &TestEnv, args: &[&str]) -> Result<i64> {
    create_on(env, DEBIAN_IMAGE, args)
}

fn create_on(env: &TestEnv, stack: &str, args: &[&str]) -> Result<i64> {
    let mut a = vec!["session", "create", stack];
    a.extend_from_slice(args);
    let o = ls(env, &a)?;
    ensure!(o.status.success(), "session create: {}", describe(&o));
    stdout(&o)
        .trim()
        .parse()
        .with_context(|| format!("session id in {:?}", stdout(&o)))
}

fn exec_sh(env: &TestEnv, id: i64, script: &str) -> Result<Output> {
    ls(
        env,
        &["session", "exec", &id.to_string(), "--", "sh", "-c", script],
    )
}

fn close(env: &TestEnv, id: i64, args: &[&str]) -> Result<Value> {
    let sid = id.to_string();
    let mut a = vec!["session", "close", &sid, "--json"];
    a.extend_from_slice(args);
    let o = ls(env, &a)?;
    ensure!(
        code(&o) == 0 || code(&o) == 3,
        "session close {id}: {}",
        describe(&o)
    );
    Ok(serde_json::from_slice(&o.stdout)?)
}

/// The upper of session `id` (a sandbox session's directory in the store).
fn upper_of(env: &TestEnv, id: i64) -> String {
    env.store_root()
        .join("s")
        .join(id.to_string())
        .join("upper")
        .display()
        .to_string()
}

#[test]
fn exit_statuses_policies_and_refusals() {
    scenario(|env| {
        let o = ls(
            env,
            &["session", "run", DEBIAN_IMAGE, "--", "no-such-command-x"],
        )?;
        ensure!(code(&o) == 127, "not found: {}", describe(&o));
        ensure!(
            contains_ci(&String::from_utf8_lossy(&o.stderr), "not found"),
            "{}",
            describe(&o)
        );
        let o = mb_sh(env, &[], "kill -9 $$")?;
        ensure!(code(&o) == 137, "killed by SIGKILL: {}", describe(&o));
        let o = ls(env, &["session", "run", DEBIAN_IMAGE, "--", "/etc/passwd"])?;
        ensure!(code(&o) == 126, "not executable: {}", describe(&o));
        // on-success with a failing command discards; never discards.
        let dir = env.scratch().join("policies");
        std::fs::create_dir_all(&dir)?;
        let f = dir.join("o.json");
        let fs = f.to_str().context("utf-8")?;
        let o = mb_sh(
            env,
            &["--publish", "on-success", "--outcome", fs],
            "echo x > /on-success-failed; exit 1",
        )?;
        ensure!(code(&o) == 1, "{}", describe(&o));
        ensure!(
            outcome_file(&f)?["outcome"] == "discarded",
            "{}",
            outcome_file(&f)?
        );
        let o = mb_sh(
            env,
            &["--publish", "never", "--outcome", fs],
            "echo x > /never",
        )?;
        ensure!(
            code(&o) == 0 && outcome_file(&f)?["outcome"] == "discarded",
            "{}",
            describe(&o)
        );
        let o = mb_sh(env, &[], "ls /on-success-failed /never 2>&1; true")?;
        ensure!(
            stdout(&o).matches("No such file").count() == 2,
            "{}",
            describe(&o)
        );
        // A checkpoint needs the node it makes a child of; an unknown node is
        // named in the refusal (the SandboxGraph tests cover real nodes).
        let o = mb_sh(env, &["--publish", "checkpoint"], "true")?;
        ensure!(
            code(&o) == 125 && contains_ci(&String::from_utf8_lossy(&o.stderr), "give --node"),
            "{}",
            describe(&o)
        );
        let o = ls(env, &["session", "run", "--node", "n1", "--", "true"])?;
        ensure!(
            code(&o) == 125
                && contains_ci(&String::from_utf8_lossy(&o.stderr), "\"n1\" does not exist"),
            "{}",
            describe(&o)
        );
        // Unknown image, bad --user.
        let o = ls(
            env,
            &["session", "run", "docker.io/library/nope:1", "--", "true"],
        )?;
        ensure!(code(&o) == 125, "{}", describe(&o));
        // Non-root callers are refused with a clear message.
        let o = run_with_timeout(
            Command::new("setpriv")
                .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
                .arg(cli())
                .arg("--admin-address")
                .arg(env.admin_socket())
                .args(["session", "run", DEBIAN_IMAGE, "--", "true"]),
            CMD_TIMEOUT,
        )?;
        ensure!(
            code(&o) == 125 && contains_ci(&String::from_utf8_lossy(&o.stderr), "needs root"),
            "{}",
            describe(&o)
        );
        Ok(())
    });
}

#[test]
fn workspace_mode_user_and_network() {
    scenario(|env| {
        // --net none: only lo, up; --user; the container's /proc /dev /sys.
        let o = mb_sh(
            env,
            &["--net", "none", "--user", "1000:1000", "--workdir", "/tmp", "--env", "K=v"],
            "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '; id -u; id -g; pwd; echo $K; \
             grep -c . /proc/self/mountinfo >/dev/null; touch /sys/x 2>/dev/null || echo sys-ro; ls /proc/1/exe >/dev/null 2>&1; echo pid1=$(cat /proc/1/comm)",
        )?;
        let out = stdout(&o);
        ensure!(code(&o) == 0, "{}", describe(&o));
        ensure!(
            out.starts_with("lo\n1000\n1000\n/tmp\nv\nsys-ro\n"),
            "{out:?}"
        );
        // Workspace mode: the caller's root and tools, the session at DIR; the
        // mount is private to the session.
        let ws = env.scratch().join("ws");
        std::fs::create_dir_all(&ws)?;
        let wss = ws.to_str().context("utf-8")?;
        let o = ls(
            env,
            &["session", "run", DEBIAN_IMAGE, "--mount-at", wss, "--", "sh", "-c",
              "cat etc/debian_version >/dev/null && pwd && echo ws > ws-marker && test -x /usr/bin/cargo -o -d /work && echo host-root"],
        )?;
        ensure!(code(&o) == 0, "{}", describe(&o));
        ensure!(
            stdout(&o) == format!("{wss}\nhost-root\n"),
            "{}",
            describe(&o)
        );
        ensure!(
            dir_is_empty(&ws)?,
            "the session's mount never shows in the caller's namespace"
        );
        let o = mb_sh(env, &[], "cat /ws-marker")?;
        ensure!(
            stdout(&o) == "ws\n",
            "published from workspace mode: {}",
            describe(&o)
        );
        Ok(())
    });
}

#[test]
fn create_exec_close_keep_one_session_mounted() {
    scenario(|env| {
        let id = create(env, &["--publish", "on-success", "--name", "harness"])?;
        let o = exec_sh(env, id, "echo one > /step1; hostname")?;
        ensure!(
            code(&o) == 0 && stdout(&o) == format!("ls-{id}\n"),
            "{}",
            describe(&o)
        );
        let o = exec_sh(env, id, "cat /step1; echo two >> /step1; exit 4")?;
        ensure!(code(&o) == 4 && stdout(&o) == "one\n", "{}", describe(&o));
        // Another session does not see it.
        let o = mb_sh(env, &[], "cat /step1 2>/dev/null || echo absent")?;
        ensure!(stdout(&o) == "absent\n", "{}", describe(&o));
        let listed = sessions_json(env, "sandbox")?;
        ensure!(
            listed.iter().any(|s| s["id"] == id
                && s["owner"] == "sandbox:harness"
                && s["policy"] == "on-success"),
            "{listed:?}"
        );
        let upper = upper_of(env, id);
        ensure!(all_upperdirs().contains(&upper), "mounted between commands");
        let v = close(env, id, &["--exit-status", "0"])?;
        ensure!(v["outcome"] == "committed" && v["released"] == true, "{v}");
        ensure!(
            !all_upperdirs().contains(&upper),
            "no mount left in any namespace"
        );
        let o = exec_sh(env, id, "true")?;
        ensure!(
            o.status.code() == Some(125),
            "exec after close fails (125: exec's own failure): {}",
            describe(&o)
        );
        // For a program: one JSON line, the kind a closed session is.
        let o = ls(
            env,
            &[
                "--error-format",
                "json",
                "session",
                "exec",
                &id.to_string(),
                "--",
                "true",
            ],
        )?;
        let err: Value = serde_json::from_slice(&o.stderr).with_context(|| describe(&o))?;
        ensure!(
            o.status.code() == Some(125)
                && err["error"]["kind"] == "failed_precondition"
                && err["error"]["message"]
                    .as_str()
                    .unwrap_or("")
                    .contains("closed"),
            "{err:#}"
        );
        let o = mb_sh(env, &[], "cat /step1")?;
        ensure!(stdout(&o) == "one\ntwo\n", "{}", describe(&o));
        Ok(())
    });
}

/// SIGKILL of a holder mid-write: the daemon finishes the session by its policy
/// (on-exit publishes what the upper holds, whole; on-success discards: there is
/// no exit status), and no mount is left in any namespace.
#[test]
fn sigkill_of_a_holder_mid_write() {
    scenario(|env| {
        for (policy, want) in [("on-exit", "committed"), ("on-success", "discarded")] {
            let marker = format!("/killed-{policy}");
            let script = format!(
                "echo start > {marker}.start; i=0; while true; do echo line-$i >> {marker}; i=$((i+1)); done"
            );
            let mut child = ls_cmd(
                env,
                &[
                    "session",
                    "run",
                    DEBIAN_IMAGE,
                    "--publish",
                    policy,
                    "--name",
                    "victim",
                    "--",
                    "sh",
                    "-c",
                    &script,
                ],
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
            // Wait until the session writes.
            let deadline = Instant::now() + Duration::from_secs(60);
            let id = loop {
                let listed = sessions_json(env, "sandbox")?;
                let live = listed
                    .iter()
                    .find(|s| s["owner"] == "sandbox:victim" && s["released"] == false);
                if let Some(s) = live {
                    let id = s["id"].as_i64().context("id")?;
                    let upper = PathBuf::from(upper_of(env, id));
                    if upper.join(&marker[1..]).exists() {
                        break id;
                    }
                }
                ensure!(Instant::now() < deadline, "the session never wrote");
                std::thread::sleep(Duration::from_millis(20));
            };
            std::thread::sleep(Duration::from_millis(200));
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGKILL,
            )?;
            child.wait()?;
            let o = ls(
                env,
                &[
                    "wait",
                    "--session",
                    &id.to_string(),
                    "--timeout",
                    "60",
                    "--json",
                ],
            )?;
            let v: Value = serde_json::from_slice(&o.stdout).with_context(|| describe(&o))?;
            ensure!(v["outcome"] == want, "{policy}: {v}");
            // Released: the directories go (a published upper became a layer).
            let deadline = Instant::now() + Duration::from_secs(30);
            while env.store_root().join("s").join(id.to_string()).exists() {
                ensure!(Instant::now() < deadline, "session {id} not released");
                std::thread::sleep(Duration::from_millis(20));
            }
            ensure!(
                !all_upperdirs().contains(&upper_of(env, id)),
                "a mount is left behind"
            );
            let o = mb_sh(
                env,
                &[],
                &format!("test -e {marker}.start && wc -l < {marker} || echo absent"),
            )?;
            let seen = stdout(&o);
            match want {
                "committed" => ensure!(
                    seen.trim().parse::<u64>().unwrap_or(0) > 0,
                    "published whole: {seen:?}"
                ),
                _ => ensure!(seen == "absent\n", "nothing published: {seen:?}"),
            }
        }
        Ok(())
    });
}

/// The gate is the same for both modes: Mode B sessions and containers publish to
/// one branch — disjoint changes land, overlapping text merges, true conflicts
/// are rejected whole, whoever publishes.
#[test]
fn mode_b_and_containers_share_one_gate() {
    scenario(|env| {
        let stack = format!("{DEBIAN_IMAGE}@gate");
        let o = mb_sh_on(
            env,
            &stack,
            &[],
            "for i in 1 2 3 4 5 6 7 8 9 10; do echo line-$i; done > /gate.txt",
        )?;
        ensure!(code(&o) == 0, "{}", describe(&o));
        let a = create_on(env, &stack, &[])?;
        let b = create_on(env, &stack, &[])?;
        // A container leased now, publishing last (it waits for /sig/go).
        let sig = env.scratch().join("gate-sig");
        std::fs::create_dir_all(&sig)?;
        let mount = format!("type=bind,src={},dst=/sig,options=rbind:rw", sig.display());
        CtrRun::sh(NS, "gate-c3", "while [ ! -e /sig/go ]; do sleep 0.05; done; sed -i 's/^line-8$/c3-line-8/' /gate.txt; echo > /c3-only")
            .branch(Some("gate"))
            .extra(&["--mount", &mount])
            .detached()
            .ok(env)?;
        // A container publishes first: line 2 and a file of its own.
        CtrRun::sh(
            NS,
            "gate-c1",
            "sed -i 's/^line-2$/c1-line-2/' /gate.txt; echo > /c1-only",
        )
        .branch(Some("gate"))
        .rm(true)
        .ok(env)?;
        let c1 = ls_wait_json(env, NS, "gate-c1")?;
        ensure!(c1["outcome"] == "committed", "{c1}");
        // Mode B A: line 8 (separate hunk: merged) and a file of its own.
        let o = exec_sh(
            env,
            a,
            "sed -i 's/^line-8$/a-line-8/' /gate.txt; echo > /a-only",
        )?;
        ensure!(code(&o) == 0, "{}", describe(&o));
        let va = close(env, a, &["--exit-status", "0"])?;
        ensure!(va["outcome"] == "merged", "{va}");
        // Mode B B: line 2 against the container's line 2: conflict, nothing of B lands.
        let o = exec_sh(
            env,
            b,
            "sed -i 's/^line-2$/b-line-2/' /gate.txt; echo > /b-only",
        )?;
        ensure!(code(&o) == 0, "{}", describe(&o));
        let vb = close(env, b, &["--exit-status", "0"])?;
        ensure!(vb["outcome"] == "conflict", "{vb}");
        ensure!(
            vb["conflict_paths"] == serde_json::json!(["/gate.txt"]),
            "{vb}"
        );
        // The container against Mode B A's line 8: conflict.
        std::fs::write(sig.join("go"), b"")?;
        finish_detached(env, NS, "gate-c3")?;
        let c3 = ls_wait_json(env, NS, "gate-c3")?;
        ensure!(c3["outcome"] == "conflict", "{c3}");
        remove_container(env, NS, "gate-c3")?;
        let o = mb_sh_on(env, &stack, &[], "cat /gate.txt; for f in c1-only a-only b-only c3-only; do test -e /$f && echo has-$f; done; true")?;
        let want = "line-1\nc1-line-2\nline-3\nline-4\nline-5\nline-6\nline-7\na-line-8\nline-9\nline-10\nhas-c1-only\nhas-a-only\n";
        ensure!(stdout(&o) == want, "the branch head: {}", describe(&o));
        // B, closed in conflict, is rebased onto the head (its holder is gone,
        // its upper kept), resolved in its upper and published again.
        let rb = ls(
            env,
            &["session", "rebase", "--session", &b.to_string(), "--json"],
        )?;
        ensure!(
            rb.status.success(),
            "rebase of a closed Mode B session: {}",
            describe(&rb)
        );
        let gate = std::path::Path::new(&upper_of(env, b)).join("gate.txt");
        let marked = std::fs::read_to_string(&gate)?;
        ensure!(
            marked.contains("<<<<<<< session\nb-line-2\n") && marked.contains("a-line-8"),
            "{marked}"
        );
        let resolved =
            "line-1\nb-line-2\nline-3\nline-4\nline-5\nline-6\nline-7\na-line-8\nline-9\nline-10\n";
        std::fs::write(&gate, resolved)?;
        let o = ls(env, &["publish", "--session", &b.to_string(), "--json"])?;
        let v: Value = serde_json::from_slice(&o.stdout).with_context(|| describe(&o))?;
        ensure!(v["outcome"] == "committed", "{v}");
        ensure!(
            !std::path::Path::new(&upper_of(env, b)).exists(),
            "its upper goes once published"
        );
        let o = mb_sh_on(
            env,
            &stack,
            &[],
            "cat /gate.txt; test -e /b-only && echo has-b-only",
        )?;
        ensure!(
            stdout(&o) == format!("{resolved}has-b-only\n"),
            "{}",
            describe(&o)
        );
        // Both kinds side by side in one listing.
        let out = ls(env, &["session", "ls", "--json", "-A"])?;
        let all: Vec<Value> = serde_json::from_slice(&out.stdout)?;
        let kinds: BTreeSet<&str> = all
            .iter()
            .filter(|s| s["branch"] == "gate")
            .filter_map(|s| s["owner_kind"].as_str())
            .collect();
        ensure!(
            kinds == BTreeSet::from(["container", "sandbox"]),
            "{kinds:?}"
        );
        Ok(())
    });
}

/// The seed's "N sessions in one sandbox": a privileged container holding the
/// admin socket's directory (and a layerstack binary) runs 16 sessions at once,
/// all publishing to one branch. (A session started after another published
/// sees that marker: it leases the head as it is; isolation of live sessions is
/// `isolation_of_a_thousand_live_sessions`.)
#[test]
fn sixteen_sessions_inside_one_container_holding_the_admin_socket() {
    scenario(|env| {
        let sockdir = env
            .admin_socket()
            .parent()
            .context("socket dir")?
            .to_path_buf();
        let bin = cli();
        let script = format!(
            "for i in $(seq 1 16); do (layerstack -n {NS} session run {DEBIAN_IMAGE}@incontainer --name in-ctr-$i -- sh -c \"echo $i > /in-ctr-$i; cat /in-ctr-$i\" > /tmp/out-$i 2>/tmp/err-$i; echo $? > /tmp/rc-$i) & done; wait; \
             for i in $(seq 1 16); do echo \"$(cat /tmp/rc-$i) $(cat /tmp/out-$i)\"; cat /tmp/err-$i >&2; done"
        );
        let out = CtrRun::sh(NS, "sandbox-16", &script)
            .rm(true)
            .extra(&[
                "--privileged",
                "--mount",
                &format!(
                    "type=bind,src={},dst=/run/layerstack,options=rbind:rw",
                    sockdir.display()
                ),
                "--mount",
                &format!(
                    "type=bind,src={},dst=/usr/local/bin/layerstack,options=rbind:ro",
                    bin.display()
                ),
            ])
            .output(env)?;
        ensure!(out.status.success(), "{}", describe(&out));
        let lines: Vec<String> = stdout(&out).lines().map(String::from).collect();
        ensure!(
            lines.len() == 16
                && lines
                    .iter()
                    .enumerate()
                    .all(|(i, l)| *l == format!("0 {}", i + 1)),
            "each session exits 0 and reads its own marker: {}",
            describe(&out)
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(stderr.matches("committed").count() == 16, "{stderr}");
        let o = mb_sh_on(
            env,
            &format!("{DEBIAN_IMAGE}@incontainer"),
            &[],
            "ls / | grep -c '^in-ctr-'",
        )?;
        ensure!(
            stdout(&o) == "16\n",
            "all 16 published on one branch: {}",
            describe(&o)
        );
        ensure!(
            sessions_json(env, "sandbox")?
                .iter()
                .filter(|s| s["owner"]
                    .as_str()
                    .is_some_and(|o| o.starts_with("sandbox:in-ctr-")))
                .count()
                == 16,
            "listed by the daemon"
        );
        Ok(())
    });
}

/// Isolation: 1,000 sessions alive at once, each writing a unique marker; none
/// sees another's — before or after unrelated sessions publish on the same
/// branch (checked inside each session). Reports the daemon's memory.
#[test]
fn isolation_of_a_thousand_live_sessions() {
    scenario(|env| {
        let n: usize = std::env::var("LAYERSTACK_MODEB_ISOLATION_N")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000);
        let stack = format!("{DEBIAN_IMAGE}@iso");
        let o = mb_sh_on(env, &stack, &[], "echo base > /iso-base")?;
        ensure!(code(&o) == 0, "{}", describe(&o));
        let pid = env.daemon_pid().context("daemon pid")?;
        let rss0 = vm_rss_kib(pid)?;
        let t = Instant::now();
        let ids = parallel(n, 8, |i| {
            create_on(
                env,
                &stack,
                &["--publish", "never", "--name", &format!("iso-{i}")],
            )
        })?;
        let created = t.elapsed();
        let rss = vm_rss_kib(pid)?;
        eprintln!("modeb: {n} live sandbox sessions created in {created:?}; daemon VmRSS {rss0} KiB before, {rss} KiB with them live");
        let live = all_upperdirs();
        ensure!(
            ids.iter().all(|id| live.contains(&upper_of(env, *id))),
            "every session is mounted (in its own namespace)"
        );
        let t = Instant::now();
        parallel(n, 8, |i| {
            let o = exec_sh(
                env,
                ids[i],
                &format!(
                    "echo {i} > /iso-marker-{i}; ls / | grep -c '^iso-marker-'; cat /iso-base"
                ),
            )?;
            ensure!(
                stdout(&o) == "1\nbase\n",
                "session {} (#{i}) before: {}",
                ids[i],
                describe(&o)
            );
            Ok(())
        })?;
        eprintln!(
            "modeb: {n} markers written and checked in {:?}",
            t.elapsed()
        );
        for k in 0..3 {
            let o = mb_sh_on(env, &stack, &[], &format!("echo {k} > /unrelated-{k}"))?;
            ensure!(
                String::from_utf8_lossy(&o.stderr).contains("committed"),
                "{}",
                describe(&o)
            );
        }
        parallel(n, 8, |i| {
            let o = exec_sh(
                env,
                ids[i],
                &format!("ls / | grep -c '^iso-marker-\\|^unrelated-'; cat /iso-marker-{i}"),
            )?;
            ensure!(
                stdout(&o) == format!("1\n{i}\n"),
                "session {} (#{i}) after: {}",
                ids[i],
                describe(&o)
            );
            Ok(())
        })?;
        let t = Instant::now();
        parallel(n, 8, |i| {
            let v = close(env, ids[i], &[])?;
            ensure!(v["outcome"] == "discarded" && v["released"] == true, "{v}");
            Ok(())
        })?;
        eprintln!("modeb: {n} sessions closed in {:?}", t.elapsed());
        let left = all_upperdirs();
        ensure!(
            ids.iter().all(|id| !left.contains(&upper_of(env, *id))),
            "no mount left in any namespace"
        );
        let o = mb_sh_on(
            env,
            &stack,
            &[],
            "ls / | grep -c '^iso-marker-'; ls / | grep -c '^unrelated-'",
        )?;
        ensure!(stdout(&o) == "0\n3\n", "{}", describe(&o));
        Ok(())
    });
}

// ---------------------------------------------------------------------------
// Benchmarks (docs/benchmarks.md): `cargo test -p layerstack-integration --test
// modeb -- --ignored bench --nocapture --test-threads 1`, with
// LAYERSTACK_BIN_DIR=target/release for release binaries.
// ---------------------------------------------------------------------------

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Runs `c` to completion and times it (a blocking wait: `run_with_timeout`
/// polls, which would quantize the times).
fn timed(mut c: Command) -> Result<(Duration, Output)> {
    let t = Instant::now();
    let o = c.stdin(Stdio::null()).output()?;
    Ok((t.elapsed(), o))
}

/// P7: create + mount + run `true` + discard, one session at a time, against a
/// `ctr run --rm … true` measured in the same run.
#[test]
#[ignore = "benchmark"]
fn bench_p7_session_run_true() {
    scenario(|env| {
        let n: usize = std::env::var("LAYERSTACK_BENCH_N")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(50);
        // The stack id, as a harness that resolved its image once would pass it.
        let o = mb_sh(
            env,
            &["--publish", "never", "--outcome", "/dev/stdout"],
            "true",
        )?;
        let v: Value = serde_json::from_slice(&o.stdout).with_context(|| describe(&o))?;
        let stack = v["stack"].as_str().context("stack")?.to_string();
        for (label, spec) in [
            ("stack id", stack.as_str()),
            ("image reference", DEBIAN_IMAGE),
        ] {
            let mut t = Vec::new();
            for _ in 0..n {
                let (d, o) = timed(ls_cmd(
                    env,
                    &["session", "run", spec, "--publish", "never", "--", "true"],
                ))?;
                ensure!(
                    o.status.success() && String::from_utf8_lossy(&o.stderr).contains("discarded"),
                    "{}",
                    describe(&o)
                );
                t.push(d);
            }
            let mut s = t.clone();
            s.sort();
            eprintln!(
                "P7 layerstack session run {label} --publish never -- true: n={n} median {:.2} ms, p10 {:.2} ms, p90 {:.2} ms",
                median(t).as_secs_f64() * 1e3,
                s[n / 10].as_secs_f64() * 1e3,
                s[n * 9 / 10].as_secs_f64() * 1e3
            );
        }
        // Where the time goes: the CLI alone, create (session + init ready), close.
        let (mut st, mut cr, mut cl) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..n.min(20) {
            st.push(timed(ls_cmd(env, &["status"]))?.0);
            let (d, o) = timed(ls_cmd(
                env,
                &["session", "create", &stack, "--publish", "never"],
            ))?;
            cr.push(d);
            let id = stdout(&o).trim().to_string();
            let (d, o) = timed(ls_cmd(env, &["session", "close", &id]))?;
            ensure!(o.status.success(), "{}", describe(&o));
            cl.push(d);
        }
        eprintln!(
            "P7 parts: layerstack status {:.2} ms, session create {:.2} ms, session close {:.2} ms (medians)",
            median(st).as_secs_f64() * 1e3,
            median(cr).as_secs_f64() * 1e3,
            median(cl).as_secs_f64() * 1e3
        );
        let m = n.min(20);
        let mut t = Vec::new();
        for i in 0..m {
            let id = unique(&format!("p7-{i}"));
            let args = CtrRun::new(NS, &id, &["true"]).rm(true).ctr_args();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let mut c = Command::new("ctr");
            c.arg("--address")
                .arg(env.containerd().socket())
                .args(["-n", NS])
                .args(&args);
            let (d, o) = timed(c)?;
            t.push(d);
            ensure!(o.status.success(), "{}", describe(&o));
        }
        eprintln!(
            "P7 baseline ctr run --rm --snapshotter layerstack … true: n={m} median {:.2} ms",
            median(t).as_secs_f64() * 1e3
        );
        Ok(())
    });
}

/// Spawns `n` `session run` at once; returns the wall time until all ended.
fn fan_out(
    env: &TestEnv,
    n: usize,
    stack: &str,
    publish: &str,
    script: &str,
) -> Result<(Duration, Vec<Output>)> {
    let t = Instant::now();
    let children: Vec<std::process::Child> = (0..n)
        .map(|i| {
            let s = script.replace("$I", &i.to_string());
            ls_cmd(
                env,
                &[
                    "session",
                    "run",
                    stack,
                    "--publish",
                    publish,
                    "--name",
                    &format!("fan-{i}"),
                    "--",
                    "sh",
                    "-c",
                    &s,
                ],
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("spawn")
        })
        .collect::<Result<_>>()?;
    let outs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().context("wait"))
        .collect::<Result<_>>()?;
    Ok((t.elapsed(), outs))
}

/// 1,024 concurrent sessions each writing one file, all discarded; then 1,024
/// sessions each changing 100 files, all published on one head (P5 without
/// containers); and the daemon's memory with 1,024 sessions live.
#[test]
#[ignore = "benchmark"]
fn bench_fan_out_1024() {
    scenario(|env| {
        let n: usize = std::env::var("LAYERSTACK_BENCH_FAN")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1024);
        let (d, outs) = fan_out(
            env,
            n,
            &format!("{DEBIAN_IMAGE}@fan"),
            "never",
            "echo $I > /one-file",
        )?;
        let bad = outs
            .iter()
            .filter(|o| {
                !o.status.success() || !String::from_utf8_lossy(&o.stderr).contains("discarded")
            })
            .count();
        eprintln!("fan-out: {n} concurrent sessions each writing one file, all discarded: {:.2} s wall ({bad} failed)", d.as_secs_f64());
        if let Some(o) = outs.iter().find(|o| !o.status.success()) {
            bail!("a session failed: {}", describe(o));
        }
        let (d, outs) = fan_out(
            env,
            n,
            &format!("{DEBIAN_IMAGE}@p5"),
            "on-exit",
            "mkdir -p /p5/s$I && cd /p5/s$I && for f in $(seq 1 100); do echo $f > f$f; done",
        )?;
        let committed = outs
            .iter()
            .filter(|o| String::from_utf8_lossy(&o.stderr).contains("committed"))
            .count();
        eprintln!("P5 without containers: {n} sessions x 100 files, all published on one head: {:.2} s wall, {committed} committed", d.as_secs_f64());
        ensure!(
            committed == n,
            "{}",
            outs.iter()
                .find(|o| !String::from_utf8_lossy(&o.stderr).contains("committed"))
                .map(describe)
                .unwrap_or_default()
        );
        // 1,024 layers on one head: compact them before mounting the head (the
        // automatic squash after each publish may still be catching up).
        let o = ls(env, &["squash", &format!("{DEBIAN_IMAGE}@p5")])?;
        ensure!(o.status.success(), "{}", describe(&o));
        let o = mb_sh_on(
            env,
            &format!("{DEBIAN_IMAGE}@p5"),
            &[],
            "find /p5 -type f | wc -l",
        )?;
        ensure!(
            stdout(&o).trim() == (n * 100).to_string(),
            "{}",
            describe(&o)
        );
        // Memory with n sessions live.
        let pid = env.daemon_pid().context("daemon pid")?;
        let before = vm_rss_kib(pid)?;
        let t = Instant::now();
        let ids = parallel(n, 8, |i| {
            create_on(
                env,
                &format!("{DEBIAN_IMAGE}@mem"),
                &["--publish", "never", "--name", &format!("mem-{i}")],
            )
        })?;
        let live = vm_rss_kib(pid)?;
        eprintln!("daemon VmRSS: {before} KiB idle, {live} KiB with {n} sandbox sessions live (created in {:.1} s)", t.elapsed().as_secs_f64());
        parallel(n, 8, |i| close(env, ids[i], &[]).map(drop))?;
        Ok(())
    });
}

/// Debug aid: one `session run … true` under strace (LAYERSTACK_STRACE_OUT).
#[test]
#[ignore = "debug aid"]
fn trace_one_session_run() {
    scenario(|env| {
        let Some(out) = std::env::var_os("LAYERSTACK_STRACE_OUT") else {
            return Ok(());
        };
        let _ = ls(
            env,
            &[
                "session",
                "run",
                DEBIAN_IMAGE,
                "--publish",
                "never",
                "--",
                "true",
            ],
        )?;
        let mut c = Command::new("strace");
        c.arg("-f")
            .arg("-tt")
            .arg("-T")
            .arg("-o")
            .arg(&out)
            .arg(cli())
            .arg("--admin-address")
            .arg(env.admin_socket())
            .args([
                "-n",
                NS,
                "session",
                "run",
                DEBIAN_IMAGE,
                "--publish",
                "never",
                "--",
                "true",
            ]);
        let o = run_with_timeout(&mut c, CMD_TIMEOUT)?;
        eprintln!("{}", describe(&o));
        if let Some(pid) = env.daemon_pid() {
            let mut c = Command::new("strace");
            c.arg("-f")
                .arg("-tt")
                .arg("-T")
                .arg("-p")
                .arg(pid.to_string())
                .arg("-o")
                .arg(format!("{}.daemon", out.to_string_lossy()));
            let mut st = c.spawn()?;
            std::thread::sleep(Duration::from_millis(500));
            let _ = ls(
                env,
                &[
                    "session",
                    "run",
                    DEBIAN_IMAGE,
                    "--publish",
                    "never",
                    "--",
                    "true",
                ],
            )?;
            std::thread::sleep(Duration::from_millis(200));
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(st.id() as i32),
                nix::sys::signal::Signal::SIGINT,
            )?;
            st.wait()?;
        }
        Ok(())
    });
}
