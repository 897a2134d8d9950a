//! Commands about sessions and their outcomes: `status`, `session ls`, `wait`,
//! `publish`, `log`.

use std::process::ExitCode;

use anyhow::{Context, Result};
use layerstack_api as api;
use layerstack_api::types::OutcomeKind;
use serde_json::json;

use crate::output::{print_table, short};
use crate::{out, Cli, Cmd, SessionCmd};

fn verdict_json(p: &api::PathVerdict) -> serde_json::Value {
    json!({"path": p.path, "status": p.status, "reason": p.reason})
}

/// A session (or a dry run's answer) as JSON; `paths`: every path's verdict, when
/// they were fetched (`--paths`).
pub(crate) fn session_json(
    s: &api::Session,
    paths: Option<&[api::PathVerdict]>,
) -> serde_json::Value {
    let counts = s.counts.clone().unwrap_or_default();
    let mut v = json!({
        "id": s.id,
        "owner_kind": s.owner_kind,
        "owner": s.owner,
        "namespace": s.namespace,
        "container": s.container,
        "key": s.key,
        "stack": s.stack,
        "branch": s.branch,
        "state": s.state,
        "outcome": if s.outcome.is_empty() { serde_json::Value::Null } else { json!(s.outcome) },
        "outcome_id": if s.outcome_id == 0 { serde_json::Value::Null } else { json!(s.outcome_id) },
        "counts": {"clean": counts.clean, "merged": counts.merged, "conflict": counts.conflict, "excluded": counts.excluded},
        "conflict_paths": s.conflicts.iter().map(|c| c.path.clone()).collect::<Vec<_>>(),
        "conflicts": s.conflicts.iter().map(|c| json!({"path": c.path, "reason": c.reason})).collect::<Vec<_>>(),
        "conflicts_truncated": s.conflicts_truncated,
        "dry_run": s.dry_run,
        "layer": if s.layer == 0 { serde_json::Value::Null } else { json!(s.layer) },
        "node": if s.node.is_empty() { serde_json::Value::Null } else { json!(s.node) },
        "interrupted_by": if s.interrupted_by.is_empty() { serde_json::Value::Null } else { json!(s.interrupted_by) },
        "daemon_owned": s.daemon_owned,
        "branch_created": s.branch_created,
        "message": s.message,
        "released": s.released,
        "run": s.run,
        "policy": if s.policy.is_empty() { serde_json::Value::Null } else { json!(s.policy) },
        "timings": s.timings.as_ref().map(|t| json!({
            "capture_us": t.capture_us,
            "gate_wait_us": t.gate_wait_us,
            "gate_hold_us": t.gate_hold_us,
            "total_us": t.total_us,
            "capture_bytes": t.capture_bytes,
        })),
        "limits": s.limits.as_ref().map(|l| json!({
            "cpu_millis": l.cpu_millis,
            "memory_bytes": l.memory_bytes,
            "pids": l.pids,
            "network": l.network,
        })),
        "id_map": s.id_map.as_ref().map(|m| json!({
            "host_uid": m.host_uid,
            "host_gid": m.host_gid,
            "size": m.size,
        })),
    });
    if let Some(paths) = paths {
        v["paths"] = paths.iter().map(verdict_json).collect();
    }
    v
}

/// The text form of an outcome (or a dry run's would-be outcome): its kind first,
/// or what stands for its absence — never a debug value.
fn outcome_lines(s: &api::Session, paths: Option<&[api::PathVerdict]>) -> Vec<String> {
    let mut lines = Vec::new();
    lines.push(
        match (s.outcome.as_str(), s.dry_run) {
            ("", true) => "nothing to publish",
            ("", false) => "no outcome",
            (kind, _) => kind,
        }
        .to_string(),
    );
    if s.layer != 0 {
        lines.push(format!("layer {}", s.layer));
    }
    if !s.node.is_empty() {
        lines.push(format!("node {}", s.node));
    }
    if !s.interrupted_by.is_empty() {
        lines.push(format!("interrupted by {}", s.interrupted_by));
    }
    match paths {
        Some(paths) => {
            for p in paths {
                lines.push(format!("{} {}: {}", p.status, p.path, p.reason));
            }
        }
        None => {
            if let Some(c) = &s.counts {
                if c.clean + c.merged + c.conflict + c.excluded > 0 {
                    lines.push(format!(
                        "paths: {} clean, {} merged, {} conflict, {} excluded (--paths lists them)",
                        c.clean, c.merged, c.conflict, c.excluded
                    ));
                }
            }
            for c in &s.conflicts {
                lines.push(format!("conflict {}: {}", c.path, c.reason));
            }
            if s.conflicts_truncated {
                let shown = s.conflicts.len() as u64;
                let total = s.counts.as_ref().map(|c| c.conflict).unwrap_or(shown);
                lines.push(format!(
                    "... {} more conflicting path(s): --paths lists them all",
                    total.saturating_sub(shown)
                ));
            }
        }
    }
    // A publish's message is its path counts ("2 path(s): 1 clean, …"),
    // already printed above: not twice.
    let counts_only = paths.is_none()
        && s.counts.is_some()
        && s.message.ends_with(" excluded")
        && s.message
            .split_once(" path(s): ")
            .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    if !s.message.is_empty() && !counts_only {
        lines.push(s.message.clone());
    }
    lines
}

pub(crate) fn print_outcome(
    s: &api::Session,
    paths: Option<&[api::PathVerdict]>,
    as_json: bool,
) -> ExitCode {
    if as_json {
        out!("{}", session_json(s, paths));
    } else {
        for l in outcome_lines(s, paths) {
            out!("{l}");
        }
    }
    ExitCode::from(outcome_status(&s.outcome))
}

/// The CLI's exit status for an outcome: 3 for a conflict; 1 for the other runs
/// that kept their writes unpublished (failed, busy, unsupported, unknown,
/// interrupted); 0
/// otherwise (and for no outcome).
fn outcome_status(outcome: &str) -> u8 {
    match OutcomeKind::parse(outcome) {
        Some(OutcomeKind::Conflict) => 3,
        Some(k) if k.is_retryable() => 1,
        _ => 0,
    }
}

/// Every path verdict of outcome `id`, page by page.
pub(crate) async fn outcome_paths(
    c: &mut api::AdminClient<tonic::transport::Channel>,
    id: i64,
) -> Result<Vec<api::PathVerdict>> {
    let mut out = Vec::new();
    if id == 0 {
        return Ok(out);
    }
    let mut token = String::new();
    loop {
        let r = c
            .list_outcome_paths(api::ListOutcomePathsRequest {
                outcome_id: id,
                status: String::new(),
                page_size: 10_000,
                page_token: token,
            })
            .await?
            .into_inner();
        out.extend(r.paths);
        if r.next_page_token.is_empty() {
            return Ok(out);
        }
        token = r.next_page_token;
    }
}

/// Runs a command that talks to the daemon.
pub async fn run(cli: Cli) -> Result<ExitCode> {
    let mut c = crate::connect(&cli.admin_address).await?;
    let ns = cli.namespace;
    match cli.cmd {
        Cmd::Config(_) => anyhow::bail!("config commands do not talk to the daemon"),
        Cmd::Status { json } => {
            let r = c.status(api::StatusRequest {}).await?.into_inner();
            if json {
                out!(
                    "{}",
                    json!({
                        "version": r.version,
                        "root": r.root,
                        "containerd_address": r.containerd_address,
                        "events_subscribed": r.events_subscribed,
                        "default_branch": r.default_branch,
                        "pid": r.pid,
                        "metrics_address": if r.metrics_address.is_empty() { serde_json::Value::Null } else { json!(r.metrics_address) },
                    })
                );
            } else {
                out!("version             {}", r.version);
                out!("store root          {}", r.root);
                out!("containerd          {}", r.containerd_address);
                out!(
                    "task events         {}",
                    if r.events_subscribed {
                        "subscribed"
                    } else {
                        "not subscribed (containerd unreachable?)"
                    }
                );
                out!("default branch      {}", r.default_branch);
                out!("daemon pid          {}", r.pid);
                out!(
                    "metrics             {}",
                    if r.metrics_address.is_empty() {
                        "off".to_string()
                    } else {
                        format!("http://{}/metrics", r.metrics_address)
                    }
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Session {
            cmd:
                SessionCmd::Ls {
                    all_namespaces,
                    json,
                    owner,
                },
        } => {
            let mut sessions = Vec::new();
            let mut token = String::new();
            loop {
                let r = c
                    .list_sessions(api::ListSessionsRequest {
                        namespace: ns.clone(),
                        all_namespaces,
                        page_size: 0,
                        page_token: token,
                        owner_kind: owner.clone().unwrap_or_default(),
                    })
                    .await?
                    .into_inner();
                sessions.extend(r.sessions);
                if r.next_page_token.is_empty() {
                    break;
                }
                token = r.next_page_token;
            }
            if json {
                let v: Vec<_> = sessions.iter().map(|s| session_json(s, None)).collect();
                out!("{}", serde_json::Value::Array(v));
            } else {
                let mut rows = vec![[
                    "ID", "OWNER", "STACK", "BRANCH", "RUN", "STATE", "OUTCOME", "PATHS",
                ]
                .map(String::from)];
                for s in &sessions {
                    let c = s.counts.clone().unwrap_or_default();
                    rows.push([
                        s.id.to_string(),
                        s.owner.clone(),
                        short(&s.stack).to_string(),
                        s.branch.clone(),
                        s.run.to_string(),
                        // An interrupted sandbox is `active` in the store (its
                        // upper is kept) but nothing runs in it: say so.
                        if s.state == "active" && s.outcome == "interrupted" {
                            "interrupted".into()
                        } else {
                            s.state.clone()
                        },
                        if s.outcome.is_empty() {
                            "-".into()
                        } else {
                            s.outcome.clone()
                        },
                        if s.outcome.is_empty() {
                            "-".into()
                        } else {
                            format!("{}c {}m {}x {}e", c.clean, c.merged, c.conflict, c.excluded)
                        },
                    ]);
                }
                print_table(&rows);
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Wait {
            container,
            session,
            timeout,
            paths,
            json,
        } => {
            let r = c
                .wait(api::WaitRequest {
                    namespace: ns,
                    container: container.unwrap_or_default(),
                    timeout_ms: timeout.saturating_mul(1000),
                    session_id: session.unwrap_or(0),
                })
                .await?
                .into_inner();
            let all = if paths {
                Some(outcome_paths(&mut c, r.outcome_id).await?)
            } else {
                None
            };
            Ok(print_outcome(&r, all.as_deref(), json))
        }
        Cmd::Publish {
            container,
            session,
            paths,
            discard,
            dry_run,
            json,
        } => {
            let policy = if discard {
                api::EndAction::Discard
            } else {
                api::EndAction::Publish
            };
            let req = api::PublishRequest {
                namespace: ns,
                container: container.unwrap_or_default(),
                session_id: session.unwrap_or(0),
                action: policy as i32,
                reason: if discard {
                    "layerstack publish --discard".into()
                } else {
                    "layerstack publish".into()
                },
                ..Default::default()
            };
            if dry_run {
                let mut stream = c.publish_dry_run(req).await?.into_inner();
                let mut head = None;
                let mut all = Vec::new();
                while let Some(reply) = stream.message().await? {
                    if let Some(s) = reply.session {
                        head = Some(s);
                    }
                    if paths {
                        all.extend(reply.paths);
                    }
                }
                let head = head.context("the daemon's dry run sent no summary")?;
                return Ok(print_outcome(&head, paths.then_some(all.as_slice()), json));
            }
            let r = c.publish(req).await?.into_inner();
            let all = if paths {
                Some(outcome_paths(&mut c, r.outcome_id).await?)
            } else {
                None
            };
            Ok(print_outcome(&r, all.as_deref(), json))
        }
        Cmd::Export(_)
        | Cmd::Push(_)
        | Cmd::Pull(_)
        | Cmd::Base { .. }
        | Cmd::History(_)
        | Cmd::Inspect(_)
        | Cmd::Graph(_)
        | Cmd::Fabric(_)
        | Cmd::Fsck { .. }
        | Cmd::Session { .. } => {
            unreachable!(
                "export, base, history, blame/diff/conflict and session commands are dispatched in main"
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exit_status_of_every_outcome() {
        let status: Vec<(&str, u8)> = OutcomeKind::ALL
            .iter()
            .map(|k| (k.as_str(), outcome_status(k.as_str())))
            .collect();
        assert_eq!(
            status,
            [
                ("committed", 0),
                ("checkpointed", 0),
                ("merged", 0),
                ("no-change", 0),
                ("conflict", 3),
                ("discarded", 0),
                ("failed", 1),
                ("busy", 1),
                ("unsupported", 1),
                ("unknown", 1),
                ("interrupted", 1),
            ]
        );
        assert_eq!(outcome_status(""), 0, "no outcome yet");
    }

    #[test]
    fn a_dry_run_with_nothing_to_publish_prints_no_debug_value() {
        let s = api::Session {
            dry_run: true,
            message:
                "nothing to publish: the session's current run already ended with outcome committed"
                    .into(),
            ..Default::default()
        };
        let lines = outcome_lines(&s, None);
        assert_eq!(lines[0], "nothing to publish");
        assert!(
            lines.iter().all(|l| l != "none" && !l.contains("None")),
            "{lines:?}"
        );
        let v = session_json(&s, None);
        assert!(v["outcome"].is_null());
        assert!(v.get("paths").is_none(), "paths only with --paths");
        let s = api::Session::default();
        assert_eq!(outcome_lines(&s, None), ["no outcome"]);
        let s = api::Session {
            outcome: "merged".into(),
            dry_run: true,
            ..Default::default()
        };
        assert_eq!(outcome_lines(&s, None)[0], "merged");
    }

    #[test]
    fn a_publishs_counts_are_printed_once() {
        let s = api::Session {
            outcome: "merged".into(),
            counts: Some(api::PathCounts {
                clean: 1,
                merged: 1,
                ..Default::default()
            }),
            message: "2 path(s): 1 clean, 1 merged, 0 excluded".into(),
            ..Default::default()
        };
        assert_eq!(
            outcome_lines(&s, None),
            [
                "merged",
                "paths: 1 clean, 1 merged, 0 conflict, 0 excluded (--paths lists them)"
            ]
        );
        // Any other message is kept: a dry run's, or any with --paths.
        let dry = api::Session {
            message: "dry run, nothing was changed: 2 path(s): 1 clean, 1 merged, 0 excluded"
                .into(),
            ..s.clone()
        };
        assert_eq!(outcome_lines(&dry, None).len(), 3);
        assert_eq!(
            outcome_lines(&s, Some(&[])).len(),
            2,
            "no counts line with --paths"
        );
        let s = api::Session {
            message: "the session changed nothing publishable (3 path(s) excluded by policy)"
                .into(),
            ..s
        };
        assert_eq!(outcome_lines(&s, None).len(), 3);
    }

    #[test]
    fn many_conflicts_are_summarised_not_printed_whole() {
        let s = api::Session {
            outcome: "conflict".into(),
            counts: Some(api::PathCounts {
                clean: 5,
                conflict: 150,
                ..Default::default()
            }),
            conflicts: (0..100)
                .map(|i| api::ConflictPath {
                    path: format!("/f{i}"),
                    reason: "changed on both sides".into(),
                })
                .collect(),
            conflicts_truncated: true,
            ..Default::default()
        };
        let lines = outcome_lines(&s, None);
        assert!(
            lines.iter().any(|l| l.contains("50 more conflicting")),
            "{lines:?}"
        );
        assert!(
            lines.iter().any(|l| l.starts_with("paths: 5 clean")),
            "{lines:?}"
        );
        let v = session_json(&s, Some(&[]));
        assert_eq!(v["paths"], json!([]));
        assert_eq!(v["counts"]["conflict"], 150);
    }

    #[test]
    fn the_node_a_checkpoint_made_is_a_field() {
        let s = api::Session {
            outcome: "checkpointed".into(),
            layer: 7,
            node: "n-2".into(),
            message: "checkpointed as node n-2".into(),
            ..Default::default()
        };
        let v = session_json(&s, None);
        assert_eq!(v["node"], json!("n-2"));
        assert_eq!(v["layer"], json!(7));
        assert!(
            outcome_lines(&s, None).contains(&"node n-2".to_string()),
            "{:?}",
            outcome_lines(&s, None)
        );
        let none = session_json(
            &api::Session {
                outcome: "committed".into(),
                ..Default::default()
            },
            None,
        );
        assert!(
            none.get("node").is_some_and(serde_json::Value::is_null),
            "the key is always there, null when no node was made: {none}"
        );
    }
}
