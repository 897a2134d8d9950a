//! P1 start: `ctr run --rm IMAGE ID true` on the Debian image, wall time of the
//! `ctr` process (ms), for the layerstack snapshotter with runc-v2 and with the
//! layerstack shim, each against overlayfs + runc-v2, interleaved.

use std::time::Instant;

use anyhow::{Context, Result};
use layerstack_integration::{ls_wait_ok, CtrRun, DEBIAN_IMAGE};
use serde_json::json;

use super::{interleave, ratio_table};
use crate::env::{Bench, Image, LAYERSTACK, OVERLAYFS, RUNC_V2, SHIM};
use crate::plot::{PlotSpec, Point, Series, XAxis};
use crate::report::{ScenarioReport, Target};
use crate::stats::{ms_since, Summary};

const NS: &str = "bench-p1";

/// (label, snapshotter, runtime); the first is the baseline.
const VARIANTS: [(&str, &str, &str); 3] = [
    ("overlayfs + runc-v2", OVERLAYFS, RUNC_V2),
    ("layerstack + runc-v2", LAYERSTACK, RUNC_V2),
    ("layerstack + shim", LAYERSTACK, SHIM),
];

/// Environment variable naming an earlier build of the shim binary to measure
/// beside the current one (before/after of a shim change), as runtime
/// `io.containerd.layerstackbefore.v1`.
pub const SHIM_BEFORE_ENV: &str = "LAYERSTACK_BENCH_SHIM_BEFORE";
const SHIM_BEFORE_RUNTIME: &str = "io.containerd.layerstackbefore.v1";
const SHIM_BEFORE_BIN: &str = "containerd-shim-layerstackbefore-v1";

/// One `ctr run --rm … true`; returns its wall time in ms. With layerstack the
/// end of the run may be asynchronous (the daemon's `/tasks/delete` handler: with
/// runc-v2 always, with the shim when the session wrote nothing): it is awaited
/// after the clock stops, so it does not overlap the next run.
fn run_once(b: &Bench, id: &str, variant: (&str, &str, &str)) -> Result<f64> {
    let (_, snapshotter, runtime) = variant;
    let run = CtrRun::new(NS, id, &["true"])
        .image(DEBIAN_IMAGE)
        .snapshotter(snapshotter)
        .runtime(runtime)
        .rm(true);
    let t = Instant::now();
    run.ok(&b.env)?;
    let ms = ms_since(t);
    if snapshotter == LAYERSTACK {
        ls_wait_ok(&b.env, NS, id)?;
    }
    Ok(ms)
}

/// Installs the earlier shim named by [`SHIM_BEFORE_ENV`] beside ours (our
/// binaries' directory is first on containerd's `PATH`); returns its label
/// and the path to remove afterwards.
fn install_before() -> Result<Option<(String, std::path::PathBuf)>> {
    let Some(src) = std::env::var_os(SHIM_BEFORE_ENV) else {
        return Ok(None);
    };
    let dir = layerstack_integration::bin_path(layerstack_integration::SHIM_BIN)?
        .parent()
        .context("shim without a directory")?
        .to_path_buf();
    let dst = dir.join(SHIM_BEFORE_BIN);
    std::fs::copy(&src, &dst).with_context(|| format!("copying {src:?} to {}", dst.display()))?;
    Ok(Some(("layerstack + shim (earlier build)".to_string(), dst)))
}

pub fn run(b: &Bench, r: &mut ScenarioReport) -> Result<()> {
    b.image(NS, Image::Debian, &[OVERLAYFS, LAYERSTACK])?;
    let rounds = if b.quick { 3 } else { 40 };
    let pid = std::process::id();
    let before = install_before()?;
    let mut variants: Vec<(&str, &str, &str)> = VARIANTS.to_vec();
    if let Some((label, _)) = &before {
        variants.push((label.as_str(), LAYERSTACK, SHIM_BEFORE_RUNTIME));
    }
    let measured = (|| -> Result<Vec<Vec<f64>>> {
        // Warm caches, the image's snapshots and every runtime once.
        for (v, variant) in variants.iter().enumerate() {
            run_once(b, &format!("p1-{pid}-warm-{v}"), *variant)?;
        }
        interleave(rounds, variants.len(), |round, v| {
            run_once(b, &format!("p1-{pid}-{round}-{v}"), variants[v])
        })
    })();
    if let Some((_, path)) = &before {
        let _ = std::fs::remove_file(path);
    }
    let samples = measured?;
    let names: Vec<&str> = variants.iter().map(|v| v.0).collect();
    let (table, ratios) = ratio_table(
        &format!("`ctr run --rm` of `true` on the Debian image, {rounds} interleaved rounds"),
        "ms",
        &names,
        &samples,
    );
    r.method = format!(
        "Each round runs `ctr run --rm {DEBIAN_IMAGE} ID true` once per variant, in rotating \
         order, and times the `ctr` process (so `ctr`'s own start, image resolution, snapshot \
         prepare and mount, the runtime's start, the task, delete and unmount are all in). \
         With layerstack and runc-v2 the daemon publishes asynchronously on `/tasks/delete`; \
         `layerstack wait` runs after the clock stops. With the shim, `ctr run` returns only \
         after the publish step (read-your-writes) — except that a session that wrote nothing, \
         as here, is left to the same asynchronous path (nothing to read back); `layerstack \
         wait` runs after the clock stops for it too. One warm-up run per variant is not \
         counted."
    );
    r.tables.push(table);
    r.plots.push(PlotSpec {
        file: "p1-start.svg".into(),
        title: "P1: ctr run --rm … true (median, min–max)".into(),
        x_label: "variant".into(),
        y_label: "ms".into(),
        x: XAxis::Categories(names.iter().map(|s| s.to_string()).collect()),
        log_y: false,
        series: vec![Series {
            name: "wall time of ctr run".into(),
            points: samples
                .iter()
                .enumerate()
                .map(|(i, s)| Point::new(i as f64, &Summary::of(s)))
                .collect(),
        }],
        hline: Some((
            Summary::of(&samples[0]).median * 1.05,
            "1.05 × overlayfs median".into(),
        )),
    });
    let (_, prof) = b.profiler.record("P1 layerstack + shim, 3 runs", || {
        for i in 0..3 {
            run_once(b, &format!("p1-{pid}-prof-{i}"), VARIANTS[2])?;
        }
        Ok(())
    })?;
    r.profile = prof;
    r.targets.push(Target::at_most(
        "P1 layerstack + runc-v2 ≤ 1.05× overlayfs + runc-v2",
        ratios[1].fmt_ratio(),
        ratios[1].median,
        1.05,
        "",
    ));
    r.targets.push(Target::at_most(
        "P1 layerstack + shim ≤ 1.05× overlayfs + runc-v2",
        ratios[2].fmt_ratio(),
        ratios[2].median,
        1.05,
        SHIM_WHY,
    ));
    if let Some(rb) = ratios.get(3) {
        r.notes.push(format!(
            "Before/after of the shim in this run: the earlier build ({SHIM_BEFORE_ENV}={}) {}, \
             this one {}.",
            std::env::var(SHIM_BEFORE_ENV).unwrap_or_default(),
            rb.fmt_ratio(),
            ratios[2].fmt_ratio()
        ));
    }
    r.time_goes = TIME_GOES.into();
    r.raw = json!({
        "unit": "ms",
        "variants": names,
        "samples": samples,
        "ratios": { "layerstack+runc-v2": ratios[1], "layerstack+shim": ratios[2],
                    "layerstack+shim-before": ratios.get(3) },
    });
    Ok(())
}

/// Why the shim costs what it costs (from the profile and the process timeline).
const SHIM_WHY: &str = "what is left is structural: two more process starts on the path of \
    `ctr run` (the shim's `start` action and its ttrpc server, serialized before runc-v2's \
    `create`; ~4 ms each on this loaded 2-core VM) and one more ttrpc hop per task RPC. Cut \
    here: runc-v2's `delete` action no longer runs after a clean run (containerd 1.6 waits \
    for it), a run that wrote nothing makes no publish round trip, no fsync of bundle state, \
    labels and the inner connection fetched while containerd connects, the /proc scan for \
    runc-v2's pid off the start path. Next cut, not done: start runc-v2's server directly \
    instead of through its `start` action (re-implementing 1.6's socket and grouping rules)";

/// Where the time of a shim run goes (from the profile).
const TIME_GOES: &str = "CPU of a run is containerd, `ctr`, runc, runc-v2 and above all the \
    kernel (~60 %: exec, page faults and page-table teardown of short-lived processes, \
    context switches) — containerd's, runc's and the kernel's; our daemon and shim are ~10 % \
    of it. The shim's extra wall time is not CPU but latency: its two process starts sit \
    in series on the start path (see the P1 target's note).";
