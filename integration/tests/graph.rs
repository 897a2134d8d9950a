//! The SandboxGraph (issue 12) against the real daemon and containerd: Mode B
//! attempts that checkpoint into nodes, sibling isolation, merge, promote
//! (fast-forward and a stale one refused whole), prune, retry, idempotency keys
//! over the CLI, `graph show --dot`, and container attempts through the shim's
//! `layerstack.node` label and through the snapshot label.
//!
//! Crash safety (kill -9 at each step of checkpoint, merge and promote) is
//! tested in the engine's crash tests (`engine/src/tests.rs`, module `crash`).
//!
//! Needs root and containerd (fails under `CI=true` without them).

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use anyhow::{ensure, Context, Result};
use layerstack_integration::*;
use serde_json::Value;

const NS: &str = "lst-graph";

fn cli() -> PathBuf {
    bin_path(CLI_BIN).expect("layerstack binary")
}

/// `layerstack --admin-address … -n lst-graph ARGS…`.
fn ls(env: &TestEnv, args: &[&str]) -> Result<Output> {
    let mut c = Command::new(cli());
    c.arg("--admin-address")
        .arg(env.admin_socket())
        .args(["-n", NS])
        .args(args)
        .stdin(Stdio::null());
    run_with_timeout(&mut c, CMD_TIMEOUT)
}

/// `ls` that must succeed; its stdout.
fn ls_ok(env: &TestEnv, args: &[&str]) -> Result<String> {
    let o = ls(env, args)?;
    ensure!(
        o.status.success(),
        "layerstack {}: {}",
        args.join(" "),
        describe(&o)
    );
    Ok(stdout(&o).trim().to_string())
}

/// `session run TARGET ARGS… -- sh -c SCRIPT` (TARGET: a stack, or `--node ID`).
fn run_sh(env: &TestEnv, target: &[&str], args: &[&str], script: &str) -> Result<Output> {
    let mut a = vec!["session", "run"];
    a.extend_from_slice(target);
    a.extend_from_slice(args);
    a.extend_from_slice(&["--", "sh", "-c", script]);
    ls(env, &a)
}

fn graph_json(env: &TestEnv, name: &str) -> Result<Value> {
    Ok(serde_json::from_str(&ls_ok(
        env,
        &["graph", "show", name, "--json"],
    )?)?)
}

/// The nodes whose parents are exactly `parents`.
fn children(g: &Value, parents: &[&str]) -> Vec<Value> {
    g["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| {
            n["parents"]
                .as_array()
                .map(|p| p.iter().filter_map(Value::as_str).collect::<Vec<_>>() == parents)
                .unwrap_or(false)
        })
        .cloned()
        .collect()
}

fn node_id(n: &Value) -> Result<String> {
    Ok(n["id"].as_str().context("node id")?.to_string())
}

/// What `sh -c script` prints in a throwaway Mode B session on `target`.
fn look(env: &TestEnv, target: &[&str], script: &str) -> Result<String> {
    let o = run_sh(env, target, &["--publish", "never"], script)?;
    ensure!(o.status.success(), "{}", describe(&o));
    Ok(stdout(&o).trim().to_string())
}

#[test]
fn mode_b_attempts_checkpoint_merge_promote_prune_and_retry() {
    run_layerstack_scenario(NS, |env| {
        let main = format!("{DEBIAN_IMAGE}@g-main");
        // The branch exists once something published on it.
        let o = run_sh(env, &[&main], &[], "echo base > /base.txt")?;
        ensure!(o.status.success(), "{}", describe(&o));
        let root = ls_ok(env, &["graph", "create", "g1", &main, "--key", "k-g1"])?;
        let again = ls_ok(env, &["graph", "create", "g1", &main, "--key", "k-g1"])?;
        ensure!(root == again, "same key, same graph: {root} vs {again}");
        let dup = ls(env, &["graph", "create", "g1", &main])?;
        ensure!(
            !dup.status.success() && String::from_utf8_lossy(&dup.stderr).contains("g1"),
            "a taken name is refused, naming it: {}",
            describe(&dup)
        );

        // Two sibling attempts; the default for an attempt is a checkpoint.
        let o = run_sh(
            env,
            &["--node", &root],
            &["--state", r#"{"score": 0.5}"#],
            "echo a > /a.txt",
        )?;
        ensure!(o.status.success(), "attempt a: {}", describe(&o));
        let o = run_sh(
            env,
            &["--node", &root],
            &["--state", r#"{"score": 0.9}"#],
            "test ! -e /a.txt && echo b > /b.txt",
        )?;
        ensure!(
            o.status.success(),
            "attempt b sees its sibling's writes: {}",
            describe(&o)
        );
        let g = graph_json(env, "g1")?;
        let kids = children(&g, &[&root]);
        ensure!(kids.len() == 2, "two children of the root: {g:#}");
        let by_score = |s: f64| {
            kids.iter()
                .find(|n| n["state"]["score"].as_f64() == Some(s))
                .cloned()
                .context("a child with that score")
        };
        let (a, b) = (node_id(&by_score(0.5)?)?, node_id(&by_score(0.9)?)?);
        ensure!(
            look(
                env,
                &["--node", &a],
                "cat /a.txt /base.txt; test ! -e /b.txt && echo isolated"
            )? == "a\nbase\nisolated",
            "node a shows its own writes on the root only"
        );
        let n: Value = serde_json::from_str(&ls_ok(env, &["node", "show", &a, "--json"])?)?;
        ensure!(
            n["kind"] == "checkpoint"
                && n["exit_status"] == 0
                && n["command"].as_str().unwrap_or("").contains("/a.txt"),
            "provenance: {n:#}"
        );

        // Merge (disjoint) with a key, twice: one node.
        let m = ls_ok(env, &["node", "merge", &a, &b, "--key", "k-m"])?;
        let m2 = ls_ok(env, &["node", "merge", &a, &b, "--key", "k-m"])?;
        ensure!(m == m2, "same key, one merge node: {m} vs {m2}");
        ensure!(
            look(env, &["--node", &m], "cat /a.txt /b.txt")? == "a\nb",
            "the merge node shows both"
        );
        // Promote: main has not moved since the graph was made → fast-forward.
        let p = ls_ok(env, &["node", "promote", &m, &main, "--key", "k-p"])?;
        ensure!(p.starts_with("fast-forward"), "{p}");
        ensure!(look(env, &[&main], "cat /a.txt /b.txt")? == "a\nb");

        // A stale node that conflicts with newer work on main is refused whole.
        // The node its checkpoint made is a field of the outcome (--outcome).
        let dir = env.scratch().join("graph-outcome");
        std::fs::create_dir_all(&dir)?;
        let file = dir.join("c.json");
        let o = run_sh(
            env,
            &["--node", &root],
            &["--outcome", file.to_str().context("utf-8")?],
            "echo node > /base.txt",
        )?;
        ensure!(o.status.success(), "{}", describe(&o));
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&file)?)?;
        let g = graph_json(env, "g1")?;
        let c = children(&g, &[&root])
            .into_iter()
            .find(|n| ![a.as_str(), b.as_str()].contains(&n["id"].as_str().unwrap_or("")))
            .context("the third child")?;
        let c = node_id(&c)?;
        ensure!(
            v["outcome"] == "checkpointed" && v["node"] == c.as_str(),
            "the outcome names node {c}: {v:#}"
        );
        let ls_json: Value = serde_json::from_str(&ls_ok(
            env,
            &["session", "ls", "--json", "--owner", "sandbox"],
        )?)?;
        ensure!(
            ls_json
                .as_array()
                .into_iter()
                .flatten()
                .any(|s| s["id"] == v["id"] && s["node"] == c.as_str()),
            "session ls --json names the node too: {ls_json:#}"
        );
        let o = run_sh(env, &[&main], &[], "echo main > /base.txt")?;
        ensure!(o.status.success(), "{}", describe(&o));
        let o = ls(env, &["node", "promote", &c, &main])?;
        ensure!(
            o.status.code() == Some(3) && stdout(&o).starts_with("conflict"),
            "a stale promote is refused: {}",
            describe(&o)
        );
        ensure!(
            look(env, &[&main], "cat /base.txt")? == "main",
            "main keeps the newer work"
        );
        let o = ls(
            env,
            &["node", "promote", &c, "docker.io/library/other:1@main"],
        )?;
        ensure!(
            !o.status.success(),
            "a promote onto another stack is refused: {}",
            describe(&o)
        );

        // Prune the stale leaf; an attempt of it is refused with the reason.
        let pruned = ls_ok(env, &["node", "prune", &c, "--json"])?;
        ensure!(pruned.contains(&c), "{pruned}");
        let o = run_sh(env, &["--node", &c], &[], "true")?;
        ensure!(
            !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("pruned"),
            "{}",
            describe(&o)
        );
        // The same refusal for a program: exit 125 and one JSON line with its kind.
        let o = ls(
            env,
            &[
                "--error-format",
                "json",
                "session",
                "run",
                "--node",
                &c,
                "--",
                "true",
            ],
        )?;
        let last: Value = serde_json::from_str(
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or_default(),
        )
        .with_context(|| describe(&o))?;
        ensure!(
            o.status.code() == Some(125)
                && last["error"]["kind"] == "invalid_argument"
                && last["error"]["message"]
                    .as_str()
                    .unwrap_or("")
                    .contains("pruned"),
            "{last:#}"
        );

        // Retry: a new attempt of the same node, through the API (a client mounts
        // it itself); closing it discards.
        let list: Value = serde_json::from_str(&ls_ok(env, &["attempt", "ls", &root, "--json"])?)?;
        let first = list
            .as_array()
            .and_then(|l| l.first())
            .context("attempts of the root")?;
        ensure!(first["status"] == "checkpointed", "{first:#}");
        let r: Value = serde_json::from_str(&ls_ok(
            env,
            &[
                "attempt",
                "retry",
                &first["id"].to_string(),
                "--key",
                "k-r",
                "--json",
            ],
        )?)?;
        // Without --json: what to do with it, not its mount.
        let text = ls_ok(
            env,
            &["attempt", "retry", &first["id"].to_string(), "--key", "k-r"],
        )?;
        ensure!(
            text.starts_with(&format!(
                "attempt {} of node {root}: session {}",
                r["attempt"]["id"], r["session"]["id"]
            )) && !text.contains("lowerdir")
                && text.contains("session close"),
            "{text}"
        );
        let r2: Value = serde_json::from_str(&ls_ok(
            env,
            &[
                "attempt",
                "retry",
                &first["id"].to_string(),
                "--key",
                "k-r",
                "--json",
            ],
        )?)?;
        ensure!(
            r["attempt"]["id"] == r2["attempt"]["id"] && r2["created"] == false,
            "same key, one retry: {r:#} {r2:#}"
        );
        ensure!(r["attempt"]["node"] == root.as_str(), "{r:#}");
        let sid = r["session"]["id"].to_string();
        ls_ok(env, &["session", "close", &sid, "--discard"])?;
        let list: Value = serde_json::from_str(&ls_ok(env, &["attempt", "ls", &root, "--json"])?)?;
        let retried = list
            .as_array()
            .into_iter()
            .flatten()
            .find(|x| x["id"] == r["attempt"]["id"])
            .context("the retried attempt")?;
        ensure!(retried["status"] == "failed", "discarded: {retried:#}");

        // The picture.
        let dot = ls_ok(env, &["graph", "show", "g1", "--dot"])?;
        for (parent, child) in [(&root, &a), (&root, &b), (&a, &m), (&b, &m)] {
            ensure!(
                dot.contains(&format!("\"{parent}\" -> \"{child}\"")),
                "edge {parent} -> {child} in {dot}"
            );
        }
        std::fs::write(env.scratch().join("g1.dot"), &dot)?;
        Ok(())
    });
}

#[test]
fn container_attempts_by_shim_label_and_by_snapshot_label() {
    run_layerstack_scenario(NS, |env| {
        bin_path(SHIM_BIN).context("the shim binary must be built")?;
        let main = format!("{DEBIAN_IMAGE}@c-main");
        let o = run_sh(env, &[&main], &[], "echo base > /base.txt")?;
        ensure!(o.status.success(), "{}", describe(&o));
        let root = ls_ok(env, &["graph", "create", "g2", &main])?;

        // Through the shim: the container label names the node; the default
        // exit policy of an attempt checkpoints.
        let id = unique_across_processes("gc1");
        CtrRun::sh(NS, &id, "echo shim > /shim.txt; exit 4")
            .runtime(SHIM_RUNTIME)
            .label(format!("layerstack.node={root}"))
            .rm(true)
            .output(env)?;
        // Without the shim (runc): the snapshot label; the daemon's task-delete
        // event ends the run by the attempt's policy.
        let id2 = unique_across_processes("gc2");
        CtrRun::sh(NS, &id2, "echo snap > /snap.txt")
            .extra(&[
                "--snapshotter-label",
                &format!("containerd.io/snapshot/layerstack.node={root}"),
            ])
            .rm(true)
            .ok(env)?;
        let mut nodes = Vec::new();
        for _ in 0..100 {
            nodes = children(&graph_json(env, "g2")?, &[&root]);
            if nodes.len() == 2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        ensure!(
            nodes.len() == 2,
            "two container attempts checkpointed: {:#}",
            graph_json(env, "g2")?
        );
        let shim_node = nodes
            .iter()
            .find(|n| n["exit_status"] == 4)
            .context("the shim's node carries the exit status")?;
        ensure!(
            look(
                env,
                &["--node", &node_id(shim_node)?],
                "cat /shim.txt; test ! -e /snap.txt && echo alone"
            )? == "shim\nalone"
        );
        let other = nodes
            .iter()
            .find(|n| n["id"] != shim_node["id"])
            .context("the snapshot label's node")?;
        ensure!(look(env, &["--node", &node_id(other)?], "cat /snap.txt")? == "snap");
        ensure!(
            look(
                env,
                &[&main],
                "test ! -e /shim.txt && test ! -e /snap.txt && echo clean"
            )? == "clean",
            "attempts never publish onto the branch"
        );
        // A node of another graph's branch is still fine; an unknown one is
        // refused at create with the reason.
        let id3 = unique_across_processes("gc3");
        let o = CtrRun::sh(NS, &id3, "true")
            .runtime(SHIM_RUNTIME)
            .label("layerstack.node=no-such-node")
            .rm(true)
            .output(env)?;
        ensure!(
            !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("no-such-node"),
            "{}",
            describe(&o)
        );
        Ok(())
    });
}
