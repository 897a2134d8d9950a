//! P10 beyond one machine (issue 23): how long a checkpoint takes to become
//! runnable on a second worker — `Push` from daemon a to an OCI registry,
//! `Pull` into daemon b, a first sandbox there answering `exec true` — against
//! the size of its diff, beside copying the same bytes locally (`tar c | tar
//! x`) and beside the registry's own floor (one blob of the same size up and
//! down over HTTP); a pull again (copies nothing) and a re-push after one more
//! small layer (sends that layer and the config). Then rollouts per second on
//! a local Ray cluster (`layerstack.ray.fan_out_ray`) with one worker node
//! against two — both on this machine, sharing its cores.
//!
//! Runs its own Debian `docker-registry` on 127.0.0.1 and three daemons with
//! empty stores and no containerd (a coordinator and two workers), driven by
//! `bench/python/p10.py`; the bench's own daemon and containerd are not used.
//! Needs `docker-registry` (scripts/install-deps.sh), `busybox` and Ray in
//! the bench's Python (`./clients/python[ray]` is installed into the venv);
//! fails without them, never skips. Diffs of 64 KiB, 1 MiB, 16 MiB and
//! 64 MiB, 5 rounds; steps of 64 rollouts, 3 rounds (`--quick`: 64 KiB and
//! 1 MiB, 2 rounds; steps of 8, 1 round — about a minute in a debug build,
//! most of it the Ray cluster's start).

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, ensure, Context, Result};
use layerstack_integration::registry::{RegistryKind, TestRegistry, REGISTRY_BIN};
use layerstack_integration::{describe, which, Daemon};
use serde_json::Value;

use super::p7b_sdk::{python_with, repo_root};
use crate::env::Bench;
use crate::plot::{PlotSpec, Point, Series, XAxis};
use crate::report::{ScenarioReport, Table, Target};
use crate::stats::{fmt_bytes, pair_ratios, Summary};

const KIB: u64 = 1024;
const MIB: u64 = 1024 * 1024;

/// Files each diff is split into.
const FILES: usize = 16;

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

fn summary(v: &Value) -> Summary {
    Summary::of(&f64s(v))
}

/// A daemon with an empty store under `dir/name`, no containerd (its socket
/// path names none), the registry `host` named insecure (plain HTTP).
fn daemon(dir: &Path, name: &str, host: &str) -> Result<Daemon> {
    let d = dir.join(name);
    std::fs::create_dir_all(&d)?;
    let cfg = d.join("daemon.toml");
    std::fs::write(&cfg, format!("[registry]\ninsecure = [\"{host}\"]\n"))?;
    Daemon::start_at_with(
        &d.join("s/snapshotter.sock"),
        &d.join("s/containerd.sock"),
        &d.join("root"),
        &[
            "--config",
            cfg.to_str().context("a config path that is not UTF-8")?,
        ],
        true,
    )
    .with_context(|| format!("starting daemon {name}"))
}

/// The last `n` lines of `s`.
fn tail(s: &[u8], n: usize) -> String {
    let s = String::from_utf8_lossy(s);
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

pub fn run(b: &Bench, r: &mut ScenarioReport) -> Result<()> {
    let sizes: &[u64] = if b.quick {
        &[64 * KIB, MIB]
    } else {
        &[64 * KIB, MIB, 16 * MIB, 64 * MIB]
    };
    let rounds = if b.quick { 2 } else { 5 };
    let ray_n = if b.quick { 8 } else { 64 };
    let ray_rounds = if b.quick { 1 } else { 3 };
    if which(REGISTRY_BIN).is_none() {
        bail!("P10 needs `{REGISTRY_BIN}` on PATH (Debian package docker-registry; scripts/install-deps.sh)");
    }
    let python = python_with("[ray]")?;
    let dir = b.env.scratch().join("p10");
    std::fs::create_dir_all(&dir)?;
    let reg = TestRegistry::start(RegistryKind::Plain)?;
    let host = reg.host();
    let daemons = [
        daemon(&dir, "coord", &host)?,
        daemon(&dir, "a", &host)?,
        daemon(&dir, "b", &host)?,
    ];
    let script = repo_root().join("bench/python/p10.py");
    let sizes_arg = sizes
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    super::settle(0.2, std::time::Duration::from_secs(30));
    let o = Command::new(&python)
        .arg(&script)
        .arg("--coordinator")
        .arg(daemons[0].admin_socket())
        .arg("--a")
        .arg(daemons[1].admin_socket())
        .arg("--b")
        .arg(daemons[2].admin_socket())
        .args(["--registry", &host, "--registry-log"])
        .arg(reg.log_path())
        .arg("--scratch")
        .arg(dir.join("files"))
        .args([
            "--sizes",
            &sizes_arg,
            "--files",
            &FILES.to_string(),
            "--rounds",
            &rounds.to_string(),
            "--ray-n",
            &ray_n.to_string(),
            "--ray-rounds",
            &ray_rounds.to_string(),
        ])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("starting {} {}", python.display(), script.display()))?;
    if !o.status.success() {
        for d in &daemons {
            d.dump_log();
        }
        bail!(
            "bench/python/p10.py: {}; its stderr's last lines:\n{}\nregistry log:\n{}",
            o.status,
            tail(&o.stderr, 60),
            reg.log_tail(20)
        );
    }
    drop(daemons);
    drop(reg);
    let line = String::from_utf8_lossy(&o.stdout);
    let s: Value = serde_json::from_str(line.lines().last().unwrap_or_default())
        .with_context(|| format!("p10.py answered {line:?}: {}", describe(&o)))?;

    transfer_report(r, &s["transfer"], rounds)?;
    ray_report(r, &s["ray"])?;

    r.method = format!(
        "`bench/python/p10.py` (Python {}, Ray {}, the `layerstack` package installed from \
         `clients/python` with its `ray` extra) against Debian's `docker-registry` \
         (distribution 2.8, plain HTTP on 127.0.0.1, filesystem storage on the stores' disk) \
         and three daemons started for this scenario with empty stores and no containerd: \
         a and b (the workers) and a coordinator; the base is a busybox tree imported with \
         `ImportBase`. **Runnable elsewhere:** per diff size, {rounds} rounds after an \
         untimed warm-up (the base's blob into the registry and the base into b): {FILES} \
         files of new random bytes are written into a sandbox on a's graph root and \
         checkpointed (untimed); then, in rotating order, (1) the baseline: `tar c -C SRC . \
         | tar x -C DST` of the same files between two host directories on the same disk \
         (no hashing, no compression, no fsync); (2) the registry's floor: one blob of that \
         many random bytes uploaded (`POST` + monolithic `PUT ?digest=`) and downloaded \
         (`GET`) from Python over one HTTP connection; (3) `Push` of the node from a (the \
         layer's tar gzip-compressed at level 6 — random bytes do not compress — and \
         hashed; only the blobs the registry lacks are sent: the layer and the image \
         config), `Pull` of it on b (fetched, verified, unpacked into b's store, the node \
         recorded with its id), and a sandbox on it on b answering `exec [\"true\"]` (a \
         file's size then checked, untimed). Ratios are per round. Then the same pull \
         again on b (the access log must show no `GET` of a layer blob; the manifest and the \
         config blob are read), and once per size a child \
         of the last node with one more 4 KiB file pushed (the access log's completed \
         blob uploads counted). **Rollouts on Ray:** a `ray.cluster_utils.Cluster` of two \
         nodes (one CPU each, custom resources `layerstack-a` / `layerstack-b`), a \
         `layerstack.ray.Worker` pinned to each next to daemon a / b, the run recorded on \
         the coordinator; an untimed warm-up step on both (each worker pulls the task node \
         once); then rounds of three steps of N samples in rotating order — one worker \
         node, two, and one node given the two's slots — through `fan_out_ray` (per \
         sample: `BeginRollout(worker=…)` on the coordinator; on the worker a sandbox on \
         the task node, `echo N > /work/answer`, the checkpoint, the grader `test -s \
         /work/answer` in a clean sandbox over it, the checkpoint pushed; the coordinator \
         pulls it and ends the attempt, the reward applied once). Rate: N / the step's \
         wall time; every sample must be rewarded 1.0 exactly once and the audit clean. \
         **Caveat:** both Ray nodes, all three daemons and the registry share this \
         machine's {} cores, so a second worker node adds slots and processes but no \
         CPU: the ratio shows what a second node costs or gains in coordination here, not \
         the scaling on two machines.",
        s["python"].as_str().unwrap_or("?"),
        s["ray"]["ray"].as_str().unwrap_or("?"),
        s["ray"]["cores"],
    );
    r.raw = s;
    Ok(())
}

fn transfer_report(r: &mut ScenarioReport, t: &Value, rounds: usize) -> Result<()> {
    let rows = t["by_size"].as_array().context("no by_size")?;
    ensure!(!rows.is_empty(), "p10.py measured no diff size");
    let mut main = Table::new(
        &format!(
            "a checkpoint runnable on a second worker: push (a → registry) + pull (registry → b) + \
             first session on b (`exec true`), by diff size ({FILES} files of random bytes), \
             {rounds} interleaved round(s), ms: median (min–max)"
        ),
        &[
            "diff",
            "baseline: `tar c | tar x`",
            "registry floor: one blob up + down",
            "push + pull + first session",
            "ratio vs tar",
            "ratio vs registry floor",
        ],
    );
    let mut phases = Table::new(
        "… its phases, and what the registry saw (ms: median (min–max))",
        &[
            "diff",
            "push",
            "pull",
            "first session",
            "pull again (copies nothing)",
            "re-push after one more 4 KiB layer",
        ],
    );
    let mut series: Vec<Series> = [
        "push + pull + first session",
        "push",
        "pull",
        "first session",
        "baseline: tar c | tar x",
        "registry floor: blob up + down",
    ]
    .iter()
    .map(|n| Series {
        name: n.to_string(),
        points: Vec::new(),
    })
    .collect();
    let mut biggest = (0.0, Summary::of(&[]), Summary::of(&[]));
    for row in rows {
        let bytes = row["bytes"].as_f64().unwrap_or(f64::NAN);
        let total = f64s(&row["total_ms"]);
        let tar = f64s(&row["tar_ms"]);
        let raw = f64s(&row["raw_ms"]);
        let vs_tar = Summary::of(&pair_ratios(&tar, &total));
        let vs_raw = Summary::of(&pair_ratios(&raw, &total));
        let tot = Summary::of(&total);
        main.row(vec![
            fmt_bytes(bytes),
            Summary::of(&tar).fmt(1),
            Summary::of(&raw).fmt(1),
            format!(
                "{} ({:.1} MiB/s)",
                tot.fmt(1),
                bytes / (1024.0 * 1024.0) / (tot.median / 1e3)
            ),
            vs_tar.fmt_ratio(),
            vs_raw.fmt_ratio(),
        ]);
        let rp = &row["repush"];
        let sent = summary(&row["push_bytes_sent"]).median;
        phases.row(vec![
            fmt_bytes(bytes),
            format!(
                "{} ({} sent, 2 blobs: layer + config)",
                summary(&row["push_ms"]).fmt(1),
                fmt_bytes(sent)
            ),
            format!(
                "{} ({} fetched)",
                summary(&row["pull_ms"]).fmt(1),
                fmt_bytes(summary(&row["pull_bytes_fetched"]).median)
            ),
            summary(&row["session_ms"]).fmt(1),
            format!(
                "{} (no layer blob fetched; {} read: the config blob)",
                summary(&row["pull_again_ms"]).fmt(1),
                fmt_bytes(summary(&row["pull_again_bytes_fetched"]).median)
            ),
            format!(
                "{:.1} ({} blob uploads: the new layer + config, {} sent; {} of {} layers' blobs there already)",
                rp["ms"].as_f64().unwrap_or(f64::NAN),
                rp["blob_uploads"],
                fmt_bytes(rp["bytes_sent"].as_f64().unwrap_or(f64::NAN)),
                rp["blobs_present"],
                rp["layers"]
            ),
        ]);
        let x = bytes / 1024.0;
        for (i, k) in [
            "total_ms",
            "push_ms",
            "pull_ms",
            "session_ms",
            "tar_ms",
            "raw_ms",
        ]
        .iter()
        .enumerate()
        {
            series[i].points.push(Point::new(x, &summary(&row[*k])));
        }
        if bytes > biggest.0 {
            biggest = (bytes, tot, vs_tar);
        }
    }
    r.tables.push(main);
    r.tables.push(phases);
    if let Some(big) = rows.last() {
        let total = summary(&big["total_ms"]).median;
        let push = summary(&big["push_ms"]).median;
        let pull = summary(&big["pull_ms"]).median;
        let up = summary(&big["raw_up_ms"]).median;
        let down = summary(&big["raw_down_ms"]).median;
        r.time_goes = format!(
            "not profiled here; from the phases at {}: the push takes {push:.0} ms of the \
             {total:.0} ms ({:.0} %), where the registry takes {up:.0} ms to store a blob of \
             that size sent from Python — the rest is the daemon's packing of the layer (its \
             tar, gzip at level 6 on bytes that do not compress, a sha256 of the tar and of \
             the blob), in one stream on one core; the pull ({pull:.0} ms, the registry's \
             download alone {down:.0} ms) verifies, unpacks and records. The first session on \
             the pulled node does not grow with the diff ({:.1} ms at {}, {:.1} ms at {}).",
            fmt_bytes(big["bytes"].as_f64().unwrap_or(f64::NAN)),
            push / total * 100.0,
            summary(&rows[0]["session_ms"]).median,
            fmt_bytes(rows[0]["bytes"].as_f64().unwrap_or(f64::NAN)),
            summary(&big["session_ms"]).median,
            fmt_bytes(big["bytes"].as_f64().unwrap_or(f64::NAN)),
        );
    }
    let first = &rows[0];
    r.targets.push(Target {
        target: "P10 time to make a checkpoint runnable on a second worker (push + pull + first session) vs its diff's size, reported".into(),
        measured: format!(
            "{} diff: {} ms; {} diff: {} ms ({} of `tar c | tar x`)",
            fmt_bytes(first["bytes"].as_f64().unwrap_or(f64::NAN)),
            summary(&first["total_ms"]).fmt(1),
            fmt_bytes(biggest.0),
            biggest.1.fmt(1),
            biggest.2.fmt_ratio()
        ),
        met: Some(biggest.1.median.is_finite()),
        detail: "no target in the issue: the figure is the ratio against a local copy and the registry's floor".into(),
    });
    r.plots.push(PlotSpec {
        file: "p10-runnable-elsewhere.svg".into(),
        title: "P10: a checkpoint runnable on a second worker, by diff size (median, min–max)"
            .into(),
        x_label: "diff, KiB".into(),
        y_label: "ms".into(),
        x: XAxis::Log,
        log_y: true,
        series,
        hline: None,
    });
    Ok(())
}

fn ray_report(r: &mut ScenarioReport, ray: &Value) -> Result<()> {
    let n = ray["n"].as_u64().unwrap_or(0);
    let slots = ray["slots"].as_u64().unwrap_or(0);
    let variants = [
        ("one", format!("1 worker node, {slots} attempts at once")),
        (
            "two",
            format!("2 worker nodes, {slots} attempts at once each"),
        ),
        (
            "one-wide",
            format!(
                "1 worker node, {} attempts at once (the slots of two)",
                2 * slots
            ),
        ),
    ];
    let rate = |k: &str| -> Vec<f64> {
        ray[k]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x["rate"].as_f64()).collect())
            .unwrap_or_default()
    };
    let wall = |k: &str| -> Vec<f64> {
        ray[k]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x["wall_s"].as_f64()).collect())
            .unwrap_or_default()
    };
    let base = rate("one");
    ensure!(!base.is_empty(), "no step on one worker: {ray}");
    let mut t = Table::new(
        &format!(
            "rollouts on Ray: steps of {n} graded samples through `fan_out_ray`, {} interleaved round(s) \
             (all on this machine's {} cores: see the caveat above)",
            ray["rounds"], ray["cores"]
        ),
        &[
            "workers",
            "step wall, s",
            "rollouts/s",
            "ratio vs 1 worker node",
            "samples per worker (last step)",
        ],
    );
    let mut ratios = Vec::new();
    for (k, name) in &variants {
        let rt = rate(k);
        let ratio = Summary::of(&pair_ratios(&base, &rt));
        t.row(vec![
            name.clone(),
            Summary::of(&wall(k)).fmt(2),
            Summary::of(&rt).fmt(1),
            if *k == "one" {
                "1 (baseline)".into()
            } else {
                ratio.fmt_ratio()
            },
            ray[k]
                .as_array()
                .and_then(|a| a.last())
                .map(|x| x["by_worker"].to_string())
                .unwrap_or_default(),
        ]);
        ratios.push(ratio);
    }
    r.tables.push(t);
    r.notes.push(format!(
        "Ray cluster of two nodes and both workers up in {:.1} s; the warm-up step ({} samples on both workers, \
         each pulling the task node once) took {:.2} s; pulls of the task node per worker over the run: {}.",
        ray["cluster_start_s"].as_f64().unwrap_or(f64::NAN),
        4 * slots,
        ray["warmup"]["wall_s"].as_f64().unwrap_or(f64::NAN),
        ray["pulls"]
    ));
    let one = Summary::of(&base);
    let two = Summary::of(&rate("two"));
    r.targets.push(Target {
        target: "P10 rollouts per second with 1 vs 2 worker nodes on this machine, reported".into(),
        measured: format!(
            "{:.1} vs {:.1} rollouts/s: {} (one node with the slots of two: {})",
            one.median,
            two.median,
            ratios[1].fmt_ratio(),
            ratios[2].fmt_ratio()
        ),
        met: Some(ratios[1].median.is_finite()),
        detail: format!(
            "both Ray nodes, their daemons, the coordinator and the registry share this machine's {} \
             cores: a second node adds slots, not CPU",
            ray["cores"]
        ),
    });
    r.plots.push(PlotSpec {
        file: "p10-ray.svg".into(),
        title: format!("P10: rollouts/s, steps of {n} on a local Ray cluster (median, min–max)"),
        x_label: "workers".into(),
        y_label: "rollouts/s".into(),
        x: XAxis::Categories(
            [
                "1 node".to_string(),
                "2 nodes".to_string(),
                format!("1 node, {} slots", 2 * slots),
            ]
            .to_vec(),
        ),
        log_y: false,
        series: vec![Series {
            name: "rollouts/s".into(),
            points: variants
                .iter()
                .enumerate()
                .map(|(i, (k, _))| Point::new(i as f64, &Summary::of(&rate(k))))
                .collect(),
        }],
        hline: None,
    });
    Ok(())
}
