//! P9 the rollout fabric (issue 21): one RL step of N graded rollouts
//! (`clients/python/examples/rl_step.py`, driven by `bench/python/p9.py`) —
//! each a fork by `BeginRollout`, five execs and a write, a checkpoint, the
//! grade (the project's build and tests) in a clean sandbox over it, and the
//! reward by `EndRollout` — on a busybox base imported with `ImportBase`.
//! Figures: the step's wall time, the store's bytes added, the daemon's peak
//! RSS during it; rollback to a node (`BeginRollout` on an existing node →
//! the first exec answered, median); a grading session's start (median).
//! N = 1,024 (64 in `--quick`).

use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use layerstack_integration::describe;
use serde_json::Value;

use super::p7b_sdk::{python, repo_root, status_kib};
use crate::env::Bench;
use crate::plot::{PlotSpec, Point, Series, XAxis};
use crate::report::{ScenarioReport, Table, Target};
use crate::stats::{percentile, Summary};

/// Rollouts at once (the example's default).
const CONCURRENCY: usize = 64;

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

fn mib(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / (1024.0 * 1024.0))
}

pub fn run(b: &Bench, r: &mut ScenarioReport) -> Result<()> {
    let n = if b.quick { 64 } else { 1024 };
    let probes = if b.quick { 10 } else { 100 };
    let python = python()?;
    let daemon = b.env.daemon_pid().context("the daemon's pid")?;
    let hwm_before = status_kib(daemon, "VmHWM").unwrap_or(0);
    super::settle(0.2, Duration::from_secs(30));
    let script = repo_root().join("bench/python/p9.py");
    let o = Command::new(&python)
        .arg(&script)
        .arg("--admin")
        .arg(b.env.admin_socket())
        .arg("--store")
        .arg(b.env.store_root())
        .args([
            "--daemon-pid",
            &daemon.to_string(),
            "--n",
            &n.to_string(),
            "--concurrency",
            &CONCURRENCY.to_string(),
            "--probes",
            &probes.to_string(),
        ])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("starting {} {}", python.display(), script.display()))?;
    ensure!(o.status.success(), "bench/python/p9.py: {}", describe(&o));
    let line = String::from_utf8_lossy(&o.stdout);
    let s: Value = serde_json::from_str(line.lines().last().unwrap_or_default())
        .with_context(|| format!("p9.py answered {line:?}"))?;
    let audit = &s["audit"];
    ensure!(
        audit["violations"].as_array().is_some_and(Vec::is_empty),
        "the step's audit found exactly-once violations: {audit}"
    );
    ensure!(
        s["samples"].as_u64() == Some(n as u64),
        "the step yielded {} of {n} samples (errors: {})",
        s["samples"],
        s["errors"]
    );
    let wall = s["wall_s"].as_f64().unwrap_or(f64::NAN);
    let added = s["store_bytes_added"].as_f64().unwrap_or(f64::NAN);
    let rss = &s["daemon_rss_kib"];
    let peak = rss["peak"].as_f64().unwrap_or(f64::NAN);

    let mut t = Table::new(
        &format!(
            "one RL step: {n} rollouts, {CONCURRENCY} at once, each graded in a clean sandbox"
        ),
        &["what", "measured"],
    );
    t.row(vec![
        "wall time of the step".into(),
        format!("{wall:.2} s ({:.1} rollouts/s)", n as f64 / wall),
    ]);
    t.row(vec![
        "samples: rewarded / accepted (all tests pass) / task_failed".into(),
        format!(
            "{} / {} / {} (mean reward {:.3})",
            s["rewarded"],
            s["accepted"],
            audit["task_failed"],
            s["mean_reward"].as_f64().unwrap_or(f64::NAN)
        ),
    ]);
    t.row(vec![
        "attempts, infra_failed, backpropagations (audit)".into(),
        format!(
            "{}, {}, {}",
            audit["attempts"],
            audit["infra_failed"]
                .as_object()
                .map(|m| m.values().filter_map(Value::as_u64).sum::<u64>())
                .unwrap_or(0),
            audit["backprops"]
        ),
    ]);
    t.row(vec![
        "store bytes added (allocated, `du` of the store)".into(),
        format!(
            "{} ({:.1} KiB per rollout; kept checkpoints' own layers {})",
            mib(added),
            added / 1024.0 / n as f64,
            mib(s["kept_private_bytes"].as_f64().unwrap_or(f64::NAN))
        ),
    ]);
    t.row(vec![
        "daemon VmRSS before / peak / after (sampled every 50 ms)".into(),
        format!(
            "{} / {} / {} KiB (VmHWM since the daemon started: {} → {} KiB)",
            rss["before"],
            rss["peak"],
            rss["after"],
            hwm_before,
            status_kib(daemon, "VmHWM").unwrap_or(0)
        ),
    ]);
    r.tables.push(t);

    let pr = &s["probes"];
    let rows = [
        (
            "rollback: `BeginRollout` on a kept node → `exec true` answered",
            "rollback_ms",
        ),
        ("… of which `BeginRollout`", "begin_ms"),
        ("… of which the first exec", "first_exec_ms"),
        (
            "grading session start (`CreateSession` on a kept node)",
            "grade_start_ms",
        ),
        (
            "… then the grader's command (build + 4 tests)",
            "grade_command_ms",
        ),
        ("… then its discard", "grade_discard_ms"),
    ];
    let mut t = Table::new(
        &format!("latencies after the step, {probes} sequential probes each (3 untimed first)"),
        &["what", "ms: median (min–max)", "p99 ms"],
    );
    for (what, k) in rows {
        let v = f64s(&pr[k]);
        t.row(vec![
            what.to_string(),
            Summary::of(&v).fmt(2),
            format!("{:.2}", percentile(&v, 99.0)),
        ]);
    }
    r.tables.push(t);
    let rollback = Summary::of(&f64s(&pr["rollback_ms"]));
    let grade = Summary::of(&f64s(&pr["grade_start_ms"]));

    r.targets.push(Target::at_most(
        &format!("P9 one RL step of {n} graded rollouts ≤ 30 s"),
        format!("{wall:.2} s"),
        wall,
        30.0,
        "each rollout is four sandbox lifetimes' worth of daemon work in series on 2 CPUs: \
         the attempt's sandbox (an init forked by the daemon), five execs (two forks each), \
         its checkpoint, the grading sandbox and its exec, the discard, and the end's \
         transaction",
    ));
    r.targets.push(Target {
        target: "P9 bytes added and daemon peak memory during the step reported".into(),
        measured: format!("{} added; peak VmRSS {peak:.0} KiB", mib(added)),
        met: Some(added.is_finite() && peak.is_finite()),
        detail: String::new(),
    });
    r.targets.push(Target::at_most(
        "P9 rollback to a node (`BeginRollout` → first exec answered) ≤ 2 ms median",
        format!("{} ms, p99 {:.2} ms", rollback.fmt(2), rollback.p99),
        rollback.median,
        2.0,
        "a rollback is a new sandbox on the node (session row, overlay mount, an init cloned \
         into new namespaces) plus the attempt's row, and the exec forks twice",
    ));
    r.targets.push(Target::at_most(
        "P9 grading session start ≤ 20 ms median",
        format!("{} ms, p99 {:.2} ms", grade.fmt(2), grade.p99),
        grade.median,
        20.0,
        "",
    ));

    r.plots.push(PlotSpec {
        file: "p9-fabric.svg".into(),
        title: "P9: rollback to a node and grading session start (median, min–max)".into(),
        x_label: "operation".into(),
        y_label: "ms".into(),
        x: XAxis::Categories(
            [
                "rollback → first exec",
                "BeginRollout",
                "grading session start",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        ),
        log_y: true,
        series: vec![Series {
            name: "latency".into(),
            points: ["rollback_ms", "begin_ms", "grade_start_ms"]
                .iter()
                .enumerate()
                .map(|(i, k)| Point::new(i as f64, &Summary::of(&f64s(&pr[*k]))))
                .collect(),
        }],
        hline: Some((2.0, "rollback target: 2 ms".into())),
    });
    r.method = format!(
        "`bench/python/p9.py` (Python {}, the `layerstack` package installed from \
         `clients/python` into a venv) runs `clients/python/examples/rl_step.py`'s step: \
         a busybox tree imported with `ImportBase`, a graph over it, a first sandbox writes a \
         tiny shell project (`lib.sh` with a bug, `build.sh`, `test.sh`) and is checkpointed \
         (the task node); then `fan_out` runs {n} samples, {CONCURRENCY} at once, each \
         `BeginRollout` on the task node, five execs (read, build + test, the scripted edit \
         or a grep after a written edit, build, test) and a file write; an edit that breaks \
         the build ends the attempt `task_failed`, the others are checkpointed and graded \
         by `build.sh && test.sh` in a fresh sandbox over the checkpoint (reward = checks \
         passed / 4, accepted when all pass; accepted checkpoints kept, the others pruned), \
         the reward and backpropagation by `EndRollout`. Wall time from the first begin to \
         the last result; bytes added: `du -s -B1 -x` of the store before and after (the \
         attempts' trajectories and the kept layers; pruned layers may still await the \
         GC); the daemon's VmRSS sampled every 50 ms during the step. The audit of the run \
         must show no exactly-once violation. Then {probes} sequential probes (after 3 \
         untimed) of a rollback — `BeginRollout` of a new sample on one of the kept nodes \
         and `exec true`, timed from the call to the exec's answer, the attempt then ended \
         (reward 0, discard) — and of a grading session's start — `CreateSession` of a \
         sandbox on a kept node, timed to its answer, then the grader's command and the \
         discard timed apart.",
        s["python"].as_str().unwrap_or("?"),
    );
    r.raw = s;
    Ok(())
}
