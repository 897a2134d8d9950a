//! P6 reset: from one container's exit to the next container running on the
//! new head — container A writes a file and prints the time as its last act;
//! the next `ctr run` starts container B, whose first act prints the time (and
//! then reads A's file). Reset = B's time − A's time (ms), for the layerstack
//! shim (B sees A's write: published before `ctr run` of A returned), for
//! layerstack with runc-v2 + `layerstack wait A`, and for a fresh `ctr run` on
//! overlayfs + runc-v2 (the baseline; nothing carries over).

use anyhow::{ensure, Context, Result};
use layerstack_integration::{ls_wait_ok, CtrRun, DEBIAN_IMAGE};
use serde_json::json;

use super::{interleave, ratio_table};
use crate::env::{Bench, Image, LAYERSTACK, OVERLAYFS, RUNC_V2, SHIM};
use crate::plot::{PlotSpec, Point, Series, XAxis};
use crate::report::{ScenarioReport, Target};
use crate::stats::Summary;

const NS: &str = "bench-p6";

/// (label, snapshotter, runtime, branch, wait for the publish between A and B).
const VARIANTS: [(&str, &str, &str, Option<&str>, bool); 3] = [
    (
        "fresh run: overlayfs + runc-v2",
        OVERLAYFS,
        RUNC_V2,
        None,
        false,
    ),
    (
        "layerstack + shim",
        LAYERSTACK,
        SHIM,
        Some("p6-shim"),
        false,
    ),
    (
        "layerstack + runc-v2 + layerstack wait",
        LAYERSTACK,
        RUNC_V2,
        Some("p6-runc"),
        true,
    ),
];

fn ns_stamp(out: &str) -> Result<i128> {
    out.lines()
        .find_map(|l| l.trim().parse::<i128>().ok())
        .with_context(|| format!("no timestamp in {out:?}"))
}

/// One A → B pair; returns the reset time in ms.
fn pair(b: &Bench, v: usize, tag: &str) -> Result<f64> {
    let (_, snapshotter, runtime, branch, wait) = VARIANTS[v];
    let pid = std::process::id();
    let (a, bid) = (format!("p6-{pid}-{tag}-a"), format!("p6-{pid}-{tag}-b"));
    let run = |id: &str, script: &str| {
        CtrRun::sh(NS, id, script)
            .image(DEBIAN_IMAGE)
            .snapshotter(snapshotter)
            .runtime(runtime)
            .branch(branch)
            .rm(true)
            .stdout_ok(&b.env)
    };
    let out_a = run(&a, &format!("echo {tag} > /root/reset.txt; date +%s%N"))?;
    if wait {
        ls_wait_ok(&b.env, NS, &a)?;
    }
    let out_b = run(
        &bid,
        "date +%s%N; cat /root/reset.txt 2>/dev/null || echo none",
    )?;
    let ms = (ns_stamp(&out_b)? - ns_stamp(&out_a)?) as f64 / 1e6;
    let seen = out_b.lines().nth(1).unwrap_or("").trim().to_string();
    if snapshotter == LAYERSTACK {
        ensure!(
            seen == tag,
            "{}: B did not see A's write: {out_b:?}",
            VARIANTS[v].0
        );
        // B's own (unchanged) session ends asynchronously with runc-v2; let it
        // finish outside the clock.
        ls_wait_ok(&b.env, NS, &bid)?;
    }
    Ok(ms)
}

pub fn run(b: &Bench, r: &mut ScenarioReport) -> Result<()> {
    b.image(NS, Image::Debian, &[OVERLAYFS, LAYERSTACK])?;
    let rounds = if b.quick { 2 } else { 30 };
    for v in 0..VARIANTS.len() {
        pair(b, v, &format!("warm{v}"))?;
    }
    let samples = interleave(rounds, VARIANTS.len(), |round, v| {
        pair(b, v, &format!("r{round}v{v}"))
    })?;
    let names: Vec<&str> = VARIANTS.iter().map(|v| v.0).collect();
    let (table, ratios) = ratio_table(
        &format!("A's exit → B running (ms), {rounds} interleaved rounds"),
        "ms",
        &names,
        &samples,
    );
    r.tables.push(table);
    r.plots.push(PlotSpec {
        file: "p6-reset.svg".into(),
        title: "P6: A's exit to B running on the new head (median, min–max)".into(),
        x_label: "variant".into(),
        y_label: "ms".into(),
        x: XAxis::Categories(names.iter().map(|s| s.to_string()).collect()),
        log_y: false,
        series: vec![Series {
            name: "reset".into(),
            points: samples
                .iter()
                .enumerate()
                .map(|(i, s)| Point::new(i as f64, &Summary::of(s)))
                .collect(),
        }],
        hline: Some((
            Summary::of(&samples[0]).median * 1.1,
            "1.1 × fresh run".into(),
        )),
    });
    let (_, prof) = b
        .profiler
        .record("P6 layerstack + shim reset, 2 pairs", || {
            for i in 0..2 {
                pair(b, 1, &format!("prof{i}"))?;
            }
            Ok(())
        })?;
    r.profile = prof;
    r.targets.push(Target::at_most(
        "P6 reset ≤ 1.1× a fresh `ctr run` (layerstack + shim)",
        ratios[1].fmt_ratio(),
        ratios[1].median,
        1.1,
        "A's publish (capture + gate + commit of one file) sits between A's exit and B's start, \
         and the shim adds two process starts to each run (P1)",
    ));
    r.method = "Container A (`sh -c 'echo TAG > /root/reset.txt; date +%s%N'`) runs with \
        `ctr run --rm`; as soon as that returns (and, for runc-v2 on layerstack, `layerstack \
        wait A` has returned), container B runs `date +%s%N; cat /root/reset.txt`. Reset = B's \
        first timestamp − A's last (both the host's clock), so it covers A's teardown (delete, \
        unmount, publish), `ctr` exiting and starting again, and B's create and start. On \
        layerstack B must print A's TAG (it runs on the head A's publish made). The variants \
        rotate per round; one warm-up pair each is not counted."
        .into();
    r.raw = json!({ "unit": "ms", "variants": names, "samples": samples,
                    "ratios": { "shim": ratios[1], "runc-v2+wait": ratios[2] } });
    r.time_goes = TIME_GOES.into();
    Ok(())
}

const TIME_GOES: &str = "as P1 — containerd, runc, `ctr` and the kernel's process \
    lifecycle — plus A's publish (capture + gate + commit of one file, our daemon's ~15 % of \
    the CPU) before B starts, and the shim's two extra process starts on each side.";
