//! P7 Mode B session: create + mount + run `true` + discard through
//! `layerstack session run` (ARCHITECTURE.md §12). Mode B does not exist yet:
//! the scenario reports "not available" (never a stand-in measurement) and
//! says whether the CLI has grown the command since.

use anyhow::Result;

use crate::env::Bench;
use crate::report::{ScenarioReport, Status, Target};

pub fn run(b: &Bench, r: &mut ScenarioReport) -> Result<()> {
    // `layerstack session run --help` succeeds only once Mode B's runner exists.
    let has_runner = b
        .env
        .layerstack(&["session", "run", "--help"])
        .map(|o| o.status.success())
        .unwrap_or(false);
    let reason = if has_runner {
        "`layerstack session run` exists, but this benchmark does not drive it yet \
         (add the measurement to bench/src/scenarios/p7_mode_b.rs)"
    } else {
        "Mode B does not exist yet (`layerstack session run` is not built; ARCHITECTURE.md §12)"
    };
    r.status = Status::NotAvailable(reason.into());
    r.method = "Once Mode B exists: `layerstack session run -- true` with discard, timed \
                from the command's start to its exit (create + mount + run + discard), \
                median of interleaved runs against a plain `unshare -m` + overlay mount."
        .into();
    r.targets.push(Target {
        target: "P7 Mode B session < 10 ms median".into(),
        measured: "not available".into(),
        met: None,
        detail: reason.into(),
    });
    Ok(())
}
