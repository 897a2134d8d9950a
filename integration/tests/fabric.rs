//! The rollout fabric's CLI (issue 21) against the real daemon with no
//! containerd: a graph on an imported busybox base, a run, `rollout begin`
//! (a daemon-owned sandbox) → `rollout end --reward 1 --backprop 1` once (the
//! same end again answers the recorded end; another reward is refused
//! `failed_precondition` naming the attempt), `rollout attempts|sample|audit`,
//! a task failure with a trajectory read back by `rollout blob`, `search
//! stats|prior|lease|release` (a leased node is not pruned), a remote attempt
//! (`rollout begin --worker`, `rollout end --result-node`: no sandbox here, a
//! node that is not a child refused, the worker in `attempts` and `audit`),
//! and refusals of bad flags before the daemon is asked.
//!
//! Needs root (fails under `CI=true` without it) and `/bin/busybox` (static);
//! no containerd.

use std::process::Output;

use anyhow::{ensure, Context, Result};
use layerstack_integration::*;
use serde_json::{json, Value};

/// `layerstack --error-format json ARGS…` on `env`'s daemon.
fn ls(env: &StandaloneDaemon, args: &[&str]) -> Result<Output> {
    let mut a = vec!["--error-format", "json"];
    a.extend_from_slice(args);
    env.layerstack(&a)
}

/// `ls` that must succeed; its stdout as JSON.
fn ls_json(env: &StandaloneDaemon, args: &[&str]) -> Result<Value> {
    let o = ensure_success(&args.join(" "), ls(env, args)?)?;
    serde_json::from_slice(&o.stdout)
        .with_context(|| format!("layerstack {}: not JSON: {}", args.join(" "), describe(&o)))
}

/// `ls` that must fail with exit status 1; its error (`kind`, `message`).
fn ls_refused(env: &StandaloneDaemon, args: &[&str]) -> Result<(String, String)> {
    let o = ls(env, args)?;
    ensure!(
        o.status.code() == Some(1),
        "layerstack {} should fail with exit 1: {}",
        args.join(" "),
        describe(&o)
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    let last = stderr.lines().last().context("no error on stderr")?;
    let v: Value = serde_json::from_str(last).with_context(|| format!("not JSON: {last}"))?;
    Ok((
        v["error"]["kind"].as_str().unwrap_or_default().to_string(),
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    ))
}

/// `rollout begin run1 0 p SAMPLE --attempt N --node NODE --seed 5 --json`.
fn begin(env: &StandaloneDaemon, sample: &str, attempt: &str, node: &str) -> Result<Value> {
    ls_json(
        env,
        &[
            "rollout",
            "begin",
            "run1",
            "0",
            "p",
            sample,
            "--attempt",
            attempt,
            "--node",
            node,
            "--seed",
            "5",
            "--json",
        ],
    )
}

fn scenario(env: &StandaloneDaemon) -> Result<()> {
    let dir = env.dir();
    let src = dir.join("rootfs");
    busybox_tree(&src, &["sh", "echo", "true", "cat"], &["etc", "work"])?;
    let o = ensure_success(
        "base import",
        env.layerstack(&["base", "import", src.to_str().context("utf-8")?])?,
    )?;
    let stack = stdout(&o).trim().to_string();
    let g = ls_json(env, &["graph", "create", "gf", &stack, "--json"])?;
    let root = g["root"].as_str().context("root")?.to_string();

    // A run over the graph; the same name and graph again is the same run.
    let r = ls_json(
        env,
        &[
            "rollout", "create", "run1", "--graph", "gf", "--label", "team=cli", "--json",
        ],
    )?;
    ensure!(
        r["name"] == "run1" && r["graph"] == "gf" && r["created"] == true,
        "{r}"
    );
    ensure!(r["labels"] == json!({"team": "cli"}), "{r}");
    let again = ls_json(
        env,
        &["rollout", "create", "run1", "--graph", "gf", "--json"],
    )?;
    ensure!(again["created"] == false, "{again}");
    let (kind, msg) = ls_refused(
        env,
        &[
            "rollout", "create", "run2", "--graph", "gf", "--label", "team",
        ],
    )?;
    ensure!(
        kind == "invalid_argument" && msg.contains("--label \"team\"") && msg.contains("K=V"),
        "{kind}: {msg}"
    );
    let runs = ls_json(env, &["rollout", "ls", "--json"])?;
    ensure!(
        runs.as_array().map(Vec::len) == Some(1) && runs[0]["name"] == "run1",
        "{runs}"
    );

    // Begin: the attempt's id and its sandbox's session id are fields; the
    // same begin again answers the same attempt and sandbox.
    let b = begin(env, "0", "1", &root)?;
    let attempt = b["attempt"].as_i64().context("attempt id")?;
    let session = b["session"].as_i64().context("session id")?;
    ensure!(
        b["created"] == true && b["rewarded"] == false && b["node"] == root.as_str(),
        "{b}"
    );
    ensure!(
        b["rollout"]["status"] == "running" && b["rollout"]["seed"] == 5,
        "{b}"
    );
    let b2 = begin(env, "0", "1", &root)?;
    ensure!(
        b2["attempt"] == attempt && b2["session"] == session && b2["created"] == false,
        "a repeated begin answers the same attempt: {b2} vs {b}"
    );

    // A bad state is refused before the daemon (which would stop the
    // sandbox first) is asked: the attempt still runs.
    let id = attempt.to_string();
    let (kind, msg) = ls_refused(
        env,
        &["rollout", "end", &id, "--reward", "1", "--state", "{x"],
    )?;
    ensure!(
        kind == "invalid_argument" && msg.starts_with("--state is not JSON"),
        "{kind}: {msg}"
    );

    // End once: completed, applied, backpropagated, its writes a child node.
    let end = [
        "rollout",
        "end",
        &id,
        "--reward",
        "1",
        "--backprop",
        "1",
        "--evaluator",
        "unit-tests:3:sha256:abc",
        "--state",
        r#"{"reward": 1}"#,
        "--json",
    ];
    let e = ls_json(env, &end)?;
    ensure!(
        e["id"] == attempt
            && e["status"] == "completed"
            && e["reward"] == 1.0
            && e["applied"] == true
            && e["backpropagated"] == true
            && e["session"] == session,
        "{e}"
    );
    ensure!(
        e["evaluator"] == json!({"name": "unit-tests", "version": "3", "digest": "sha256:abc"}),
        "{e}"
    );
    let child = e["result_node"]
        .as_str()
        .context("result_node")?
        .to_string();
    let again = ls_json(env, &end)?;
    ensure!(
        again == e,
        "the same end answers the recorded end: {again} vs {e}"
    );
    let (kind, msg) = ls_refused(env, &["rollout", "end", &id, "--reward", "0.5"])?;
    ensure!(
        kind == "failed_precondition" && msg.contains(&format!("rollout attempt {attempt} ")),
        "another end is refused naming the attempt: {kind}: {msg}"
    );
    let (kind, _) = ls_refused(env, &["rollout", "end", "999999", "--task-failed"])?;
    ensure!(kind == "not_found", "{kind}");

    // The sample is rewarded: a next attempt starts nothing.
    let b3 = begin(env, "0", "2", &root)?;
    ensure!(
        b3["rewarded"] == true && b3["attempt"].is_null() && b3["sample"]["reward"] == 1.0,
        "{b3}"
    );

    // A second sample fails its task, discarding its writes, with a
    // trajectory that `rollout blob` reads back.
    let b = begin(env, "1", "1", &root)?;
    let failed = b["attempt"].as_i64().context("attempt id")?.to_string();
    let traj = dir.join("trajectory.json");
    std::fs::write(&traj, br#"[{"argv": ["make"], "code": 2}]"#)?;
    let f = ls_json(
        env,
        &[
            "rollout",
            "end",
            &failed,
            "--task-failed",
            "--discard",
            "--trajectory",
            traj.to_str().context("utf-8")?,
            "--json",
        ],
    )?;
    ensure!(
        f["status"] == "task_failed" && f["reward"].is_null() && f["result_node"].is_null(),
        "{f}"
    );
    let digest = f["trajectory"].as_str().context("trajectory digest")?;
    let o = ensure_success("rollout blob", ls(env, &["rollout", "blob", digest])?)?;
    ensure!(o.stdout == std::fs::read(&traj)?, "{}", describe(&o));
    let copy = dir.join("copy.json");
    ensure_success(
        "rollout blob -o",
        ls(
            env,
            &[
                "rollout",
                "blob",
                digest,
                "-o",
                copy.to_str().context("utf-8")?,
            ],
        )?,
    )?;
    ensure!(std::fs::read(&copy)? == std::fs::read(&traj)?);

    // The attempts, the sample, the audit.
    let list = ls_json(env, &["rollout", "attempts", "run1", "--json"])?;
    let list = list.as_array().context("array")?;
    ensure!(list.len() == 2, "{list:?}");
    ensure!(
        list[0]["id"] == attempt
            && list[0]["status"] == "completed"
            && list[0]["applied"] == true
            && list[0]["reward"] == 1.0
            && list[0]["sample"] == json!({"run": "run1", "step": 0, "prompt": "p", "sample": 0}),
        "{:?}",
        list[0]
    );
    ensure!(list[1]["status"] == "task_failed", "{:?}", list[1]);
    let o = ensure_success(
        "rollout attempts",
        ls(env, &["rollout", "attempts", "run1", "--step", "0"])?,
    )?;
    let text = stdout(&o);
    ensure!(
        text.starts_with("ID") && text.contains("run1/0/p/0") && text.contains("completed"),
        "{text}"
    );
    let s = ls_json(env, &["rollout", "sample", "run1", "0", "p", "0", "--json"])?;
    ensure!(
        s["reward"] == 1.0
            && s["reward_attempt"] == 1
            && s["attempts"] == 1
            && s["node"] == root.as_str(),
        "{s}"
    );
    let a = ls_json(env, &["rollout", "audit", "run1", "--json"])?;
    ensure!(
        a["sound"] == true
            && a["violations"] == json!([])
            && a["rewarded"] == 1
            && a["completed"] == 1
            && a["task_failed"] == 1
            && a["backprops"] == 1,
        "{a}"
    );
    ensure_success("rollout audit", ls(env, &["rollout", "audit", "run1"])?)?;

    // Search statistics: one visit of value 1 at the root and at the child.
    let st = ls_json(env, &["search", "stats", &root, "--children", "--json"])?;
    ensure!(
        st["node"]["node"] == root.as_str()
            && st["node"]["visits"] == 1
            && st["node"]["value_sum"] == 1.0
            && st["node"]["mean"] == 1.0,
        "{st}"
    );
    let kids = st["children"].as_array().context("children")?;
    ensure!(
        kids.len() == 1 && kids[0]["node"] == child.as_str() && kids[0]["visits"] == 1,
        "{st}"
    );
    let p = ls_json(env, &["search", "prior", &child, "0.25", "--json"])?;
    ensure!(p["prior"] == 0.25, "{p}");

    // A remote attempt (a worker's, docs/fabric.md "Remote attempts"): no
    // sandbox here; it ends with a node in this store that is a child of its
    // node — the child above stands for a checkpoint a worker pushed and this
    // daemon pulled.
    let remote = |worker: &str| -> Vec<String> {
        [
            "rollout",
            "begin",
            "run1",
            "0",
            "p",
            "9",
            "--attempt",
            "1",
            "--node",
            &root,
            "--worker",
            worker,
            "--json",
        ]
        .map(String::from)
        .to_vec()
    };
    let args = remote("w1");
    let b = ls_json(env, &args.iter().map(String::as_str).collect::<Vec<_>>())?;
    let rid = b["attempt"].as_i64().context("attempt id")?.to_string();
    ensure!(
        b["session"].is_null() && b["rollout"]["worker"] == "w1" && b["created"] == true,
        "{b}"
    );
    let args = remote("w2");
    let (kind, msg) = ls_refused(env, &args.iter().map(String::as_str).collect::<Vec<_>>())?;
    ensure!(
        kind == "failed_precondition" && msg.contains("\"w1\"") && msg.contains("\"w2\""),
        "{kind}: {msg}"
    );
    let (kind, msg) = ls_refused(
        env,
        &[
            "rollout",
            "end",
            &rid,
            "--reward",
            "1",
            "--result-node",
            &root,
        ],
    )?;
    ensure!(
        kind == "failed_precondition" && msg.contains("not a child"),
        "{kind}: {msg}"
    );
    let e = ls_json(
        env,
        &[
            "rollout",
            "end",
            &rid,
            "--reward",
            "1",
            "--result-node",
            &child,
            "--json",
        ],
    )?;
    ensure!(
        e["status"] == "completed"
            && e["applied"] == true
            && e["result_node"] == child.as_str()
            && e["worker"] == "w1",
        "{e}"
    );
    let o = ensure_success(
        "rollout attempts",
        ls(env, &["rollout", "attempts", "run1"])?,
    )?;
    let text = stdout(&o);
    ensure!(text.contains("WORKER") && text.contains("w1"), "{text}");
    let a = ls_json(env, &["rollout", "audit", "run1", "--json"])?;
    ensure!(
        a["sound"] == true && a["by_worker"] == json!({"w1": 1}),
        "{a}"
    );

    // A frontier lease holds the child against a prune until released.
    let l = ls_json(env, &["search", "lease", "h1", &child, "--json"])?;
    ensure!(l == json!([child]), "{l}");
    let st = ls_json(env, &["search", "stats", &child, "--json"])?;
    ensure!(st["node"]["frontier"] == json!(["h1"]), "{st}");
    let (kind, msg) = ls_refused(env, &["node", "prune", &child])?;
    ensure!(
        kind == "failed_precondition" && msg.contains("h1"),
        "{kind}: {msg}"
    );
    let r = ls_json(env, &["search", "release", "h1", "--json"])?;
    ensure!(r == json!([]), "{r}");
    ensure_success("node prune", ls(env, &["node", "prune", &child])?)?;

    // fsck: sound after all of it; an orphan directory is found (exit 4) and
    // repaired.
    let f = ls_json(env, &["fsck", "--json"])?;
    ensure!(
        f["sound"] == true && f["runs"] == 1 && f["layers"].as_u64() > Some(0),
        "{f}"
    );
    let orphan = env.dir().join("root/l/987654");
    std::fs::create_dir_all(&orphan)?;
    let out = ls(env, &["fsck", "--json"])?;
    ensure!(
        out.status.code() == Some(4),
        "fsck with a problem exits 4: {out:?}"
    );
    let f: Value = serde_json::from_slice(&out.stdout)?;
    ensure!(
        f["problems"][0]["kind"] == "orphan-directory" && f["unrepaired"] == 1,
        "{f}"
    );
    let f = ls_json(env, &["fsck", "--repair", "--json"])?;
    ensure!(
        f["unrepaired"] == 0 && f["problems"][0]["repaired"] == true,
        "{f}"
    );
    ensure!(
        !orphan.exists(),
        "fsck --repair removed the orphan directory"
    );
    Ok(())
}

#[test]
fn rollouts_end_once_and_search_statistics_over_the_cli() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let env = StandaloneDaemon::start()?;
    scenario(&env)
}
