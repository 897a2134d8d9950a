//! `layerstack-bench`: LayerStack's benchmarks side by side — start (P1),
//! fan-out (P2), publish (P3), read path (P4), gate under fan-out (P5), reset
//! (P6), Mode B session (P7), sandboxes from Python over the API (P7b),
//! apply isolation (P8), the rollout fabric (P9), beyond one machine (P10:
//! checkpoints through a registry, rollouts on Ray), WASI sessions beside
//! Mode B (P11), the daemon's memory with a graph of 1,000,000 nodes against
//! 1,000 (P12) — in one run, each figure a ratio against a
//! baseline measured in the same run, interleaved. Writes `benchmarks.md`, one
//! SVG plot per scenario and the raw `results.json`.
//!
//! Run it through `sudo ./scripts/bench.sh [--quick] [--scenario NAME] [--out DIR]`
//! (root: it starts a private containerd and mounts overlays). Not a test: it
//! fails only on real errors (a scenario that could not run), never on a ratio.

#![cfg_attr(test, allow(clippy::unwrap_used))]

mod env;
mod fsutil;
mod machine;
mod plot;
mod profile;
mod report;
mod scenarios;
mod stats;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;

use crate::report::{Report, ScenarioReport, Status};

/// LayerStack benchmarks (see docs/benchmarks.md).
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    /// Seconds instead of tens of minutes: small tree, few rounds, small N.
    /// Checks that every scenario still runs; its figures are not the published ones.
    #[arg(long)]
    quick: bool,
    /// Run only these scenarios (`p1`…`p12`, `p7b` or `start`, `fan-out`, `publish`,
    /// `read-path`, `gate`, `reset`, `mode-b`, `sdk`, `apply-isolation`, `fabric`, `cluster`,
    /// `wasi`, `graph-scale`);
    /// repeatable, or comma-separated.
    #[arg(long = "scenario", value_delimiter = ',')]
    scenarios: Vec<String>,
    /// Where benchmarks.md and bench/ (plots, results.json) go. Default: the
    /// repository's docs/ for a full run of every scenario, else target/bench.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Skip the perf profiles.
    #[arg(long)]
    no_profile: bool,
    /// List the scenarios and exit.
    #[arg(long)]
    list: bool,
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Environment the harness and the daemon read; set before any thread starts.
fn set_environment() -> Result<String> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .context("binary without a directory")?
        .to_path_buf();
    if std::env::var_os("LAYERSTACK_BIN_DIR").is_none() {
        // Our daemon, CLI and shim were built beside this binary.
        std::env::set_var("LAYERSTACK_BIN_DIR", &dir);
    }
    // Production-like logging: the harness defaults to debug for the tests.
    // The WASI module's debug line (one per run: its wall time) and
    // RunSession's (one per call: the daemon's share by phase) feed P11's
    // phases table.
    if std::env::var_os("RUST_LOG").is_none() {
        std::env::set_var(
            "RUST_LOG",
            "info,containerd_layerstack_grpc::wasi=debug,containerd_layerstack_grpc::run=debug",
        );
    }
    if std::env::var_os("LAYERSTACK_TEST_CONTAINERD_LOG_LEVEL").is_none() {
        std::env::set_var("LAYERSTACK_TEST_CONTAINERD_LOG_LEVEL", "info");
    }
    let bin_dir = PathBuf::from(std::env::var_os("LAYERSTACK_BIN_DIR").unwrap_or_default());
    Ok(match bin_dir.file_name().and_then(|n| n.to_str()) {
        Some("release") => "release".into(),
        Some("debug") => "debug".into(),
        _ => format!("binaries from {}", bin_dir.display()),
    })
}

fn main() {
    match run() {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("layerstack-bench: {e:#}");
            std::process::exit(2);
        }
    }
}

fn run() -> Result<bool> {
    let cli = Cli::parse();
    let all = scenarios::all();
    if cli.list {
        for s in &all {
            println!("{} {:<10} {}", s.id, s.name, s.title);
        }
        return Ok(true);
    }
    let mut selected = Vec::new();
    for want in &cli.scenarios {
        let w = want.trim().to_ascii_lowercase();
        match all.iter().find(|s| s.id == w || s.name == w) {
            Some(s) => selected.push(s.clone()),
            None => bail!(
                "unknown scenario {want:?}; one of: {}",
                all.iter()
                    .map(|s| format!("{}/{}", s.id, s.name))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
    let every = selected.is_empty();
    if every {
        selected = all.clone();
    }
    if !nix::unistd::geteuid().is_root() {
        bail!("run as root (sudo ./scripts/bench.sh): it starts containerd and mounts overlays");
    }
    let out = cli.out.clone().unwrap_or_else(|| {
        if every && !cli.quick {
            repo_root().join("docs")
        } else {
            repo_root().join("target").join("bench")
        }
    });
    let build = set_environment()?;
    let started = Instant::now();
    let started_at = String::from_utf8_lossy(
        &std::process::Command::new("date")
            .args(["-u", "+%Y-%m-%d %H:%M UTC"])
            .output()?
            .stdout,
    )
    .trim()
    .to_string();
    let profiler = profile::Profiler::probe(&layerstack_integration::tmp_base(), !cli.no_profile);
    // P7, P7b and P11 hold 1,024 sessions live at once; the default cap is 256.
    layerstack_integration::set_daemon_args(&["--sandbox-max-sessions", "2048"]);
    let bench = env::Bench::start(cli.quick, profiler)?;
    let machine = machine::Machine::probe(
        &bench.env.store_root(),
        bench.profiler.describe(),
        &build,
        &repo_root(),
    );
    eprintln!("layerstack-bench: {}", machine.line());
    let mut reports = Vec::new();
    for s in &selected {
        eprintln!("layerstack-bench: {} {} …", s.id, s.title);
        let t = Instant::now();
        let mut r = ScenarioReport::new(s.id, s.name, s.title);
        if let Err(e) = (s.run)(&bench, &mut r) {
            eprintln!("layerstack-bench: {} failed: {e:#}", s.id);
            r.status = Status::Failed(format!("{e:#}"));
        }
        r.elapsed_s = t.elapsed().as_secs_f64();
        eprintln!("layerstack-bench: {} done in {:.0} s", s.id, r.elapsed_s);
        for t in &r.targets {
            eprintln!("    {}: {} ({})", t.target, t.measured, t.detail);
        }
        reports.push(r);
    }
    drop(bench);
    let mut command = String::from("scripts/bench.sh");
    if cli.quick {
        command.push_str(" --quick");
    }
    for s in &cli.scenarios {
        command.push_str(&format!(" --scenario {s}"));
    }
    let report = Report {
        machine,
        mode: if cli.quick { "quick" } else { "full" }.into(),
        command,
        started: started_at,
        elapsed_s: started.elapsed().as_secs_f64(),
        scenarios: reports,
    };
    report.write(&out)?;
    eprintln!(
        "layerstack-bench: wrote {}",
        out.join("benchmarks.md").display()
    );
    let failed: Vec<&str> = report
        .scenarios
        .iter()
        .filter(|s| matches!(s.status, Status::Failed(_)))
        .map(|s| s.id.as_str())
        .collect();
    if !failed.is_empty() {
        eprintln!("layerstack-bench: FAILED scenarios: {}", failed.join(", "));
        return Ok(false);
    }
    Ok(true)
}
