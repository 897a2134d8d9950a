//! `layerstack fsck [--repair] [--content] [--json]`: the store checked against its
//! filesystem (the `Fsck` RPC; docs/operations.md "fsck"). Exits
//! [`crate::fabric::AUDIT_VIOLATIONS`] (4) when problems remain unrepaired,
//! like `rollout audit` with violations.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Result;
use layerstack_api as api;
use serde_json::json;

use crate::out;
use crate::output::print_table;

/// Runs the check (and the repair) and prints what it found.
pub async fn run(admin: &Path, repair: bool, content: bool, json_out: bool) -> Result<ExitCode> {
    let mut c = crate::connect(admin).await?;
    let r = c
        .fsck(api::FsckRequest { repair, content })
        .await?
        .into_inner();
    if json_out {
        let problems: Vec<_> = r
            .problems
            .iter()
            .map(|p| json!({"kind": p.kind, "subject": p.subject, "detail": p.detail, "repaired": p.repaired}))
            .collect();
        out!(
            "{}",
            json!({
                "layers": r.layers, "manifests": r.manifests, "leases": r.leases,
                "sessions": r.sessions, "paths": r.paths, "runs": r.runs, "outcomes": r.outcomes,
                "problems": problems, "unrepaired": r.unrepaired, "sound": r.unrepaired == 0,
            })
        );
    } else {
        out!(
            "checked {} layer(s), {} manifest(s), {} lease(s), {} session(s), {} path-index row(s), {} outcome(s), {} run(s): {} problem(s), {} unrepaired",
            r.layers,
            r.manifests,
            r.leases,
            r.sessions,
            r.paths,
            r.outcomes,
            r.runs,
            r.problems.len(),
            r.unrepaired
        );
        if !r.problems.is_empty() {
            let mut rows = vec![[
                "KIND".to_string(),
                "SUBJECT".into(),
                "DETAIL".into(),
                "REPAIRED".into(),
            ]];
            for p in &r.problems {
                rows.push([
                    p.kind.clone(),
                    p.subject.clone(),
                    p.detail.clone(),
                    if p.repaired {
                        "yes".into()
                    } else {
                        "no".into()
                    },
                ]);
            }
            print_table(&rows);
        }
    }
    Ok(if r.unrepaired > 0 {
        ExitCode::from(crate::fabric::AUDIT_VIOLATIONS)
    } else {
        ExitCode::SUCCESS
    })
}
