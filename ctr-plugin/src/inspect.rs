//! Commands about what is inside the history (issue 10): `blame`, `diff`,
//! `conflict show`, and `session rebase` (dispatched from `session`).
//!
//! Stacks are named as in the history commands: an image reference, a stack
//! id or a base digest, `STACK@BRANCH` for a branch.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use layerstack_api as api;
use serde_json::json;

use crate::history::{split_branch, At};
use crate::out;
use crate::output::print_table;
use crate::sessions::session_json;

#[derive(Debug, Subcommand)]
pub enum InspectCmd {
    /// Who wrote each line of a text file on a branch head: line ranges with
    /// their owner — `original` (from the image), `session:<container id or
    /// sandbox name>`, `operation:<id>` (promote), or `unknown` (no record).
    Blame {
        /// STACK[@BRANCH]: an image reference, stack id or base digest.
        stack: String,
        /// The file, e.g. /etc/app.conf.
        path: OsString,
        /// Print the blame as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// What changed: `diff STACK@A STACK@B` (two branch heads; the second may be
    /// written `@B`), `diff STACK@B --at LAYER` (B's head against the manifest of
    /// its log at LAYER; `--at base`: against the image alone), `diff
    /// CONTAINER` or `diff --session ID` (a session's
    /// writes against its lease, also while its container runs; nothing is
    /// changed). Lists added (A), modified (M) and deleted (D) paths with kind
    /// and size, and a changed mode (`mode 0644 → 0600`).
    Diff {
        /// STACK@A [STACK@B], STACK@B with --at, or a container name.
        #[arg(num_args = 0..=2)]
        specs: Vec<String>,
        /// With one STACK@BRANCH: compare the branch's log at this layer with its
        /// head (a member of a squashed layer: the view as of its publish);
        /// `base`: the image alone (below every published layer) with its head.
        #[arg(long, value_name = "LAYER|base")]
        at: Option<At>,
        /// A session id (any owner kind) instead of a container.
        #[arg(long, conflicts_with_all = ["at"])]
        session: Option<i64>,
        /// Print unified diffs of text files.
        #[arg(long)]
        patch: bool,
        /// Print the diff as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Conflicts of a session's last publish.
    Conflict {
        #[command(subcommand)]
        cmd: ConflictCmd,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConflictCmd {
    /// Why each path of a session's last outcome conflicts and, for text files,
    /// the three-way view with git-style markers (`<<<<<<< session`, `|||||||
    /// lease`, `=======`, `>>>>>>> head`). Output only: nothing is written.
    Show {
        /// The container whose session to show (`-n` namespace).
        #[arg(required_unless_present = "session")]
        container: Option<String>,
        /// The session id instead of a container.
        #[arg(long, conflicts_with = "container")]
        session: Option<i64>,
        /// Print as one JSON object.
        #[arg(long)]
        json: bool,
    },
}

/// Runs `blame`, `diff` or `conflict`.
pub async fn run(admin: &Path, ns: &str, cmd: InspectCmd) -> Result<ExitCode> {
    let mut c = crate::connect(admin).await?;
    let ns = ns.to_string();
    match cmd {
        InspectCmd::Blame { stack, path, json } => {
            let (stack, branch) = split_branch(&stack);
            let b = c
                .blame(api::BlameRequest {
                    namespace: ns,
                    stack,
                    branch,
                    path: path.into_vec(),
                })
                .await?
                .into_inner();
            if json {
                out!(
                    "{}",
                    json!({
                        "stack": b.stack, "branch": b.branch, "manifest": b.manifest,
                        "path": b.path, "digest": b.digest, "lines": b.lines,
                        "layer": b.layer, "layer_kind": b.layer_kind,
                        "ranges": b.ranges.iter().map(|r| json!({
                            "start": r.start, "end": r.end, "owner": r.owner,
                            "session": if r.session == 0 { serde_json::Value::Null } else { json!(r.session) },
                        })).collect::<Vec<_>>(),
                    })
                );
            } else {
                let mut rows = vec![["LINES".to_string(), "OWNER".to_string()]];
                for r in &b.ranges {
                    let lines = if r.start == r.end {
                        r.start.to_string()
                    } else {
                        format!("{}-{}", r.start, r.end)
                    };
                    rows.push([lines, r.owner.clone()]);
                }
                print_table(&rows);
            }
            Ok(ExitCode::SUCCESS)
        }
        InspectCmd::Diff {
            specs,
            at,
            session,
            patch,
            json,
        } => {
            let mut req = api::DiffRequest {
                namespace: ns,
                patch,
                ..Default::default()
            };
            match (session, at, specs.as_slice()) {
                (Some(id), _, []) => req.session_id = id,
                (Some(_), _, _) => bail!("--session takes no other argument"),
                (None, Some(at), [one]) => {
                    let (stack, branch) = split_branch(one);
                    req.stack = stack;
                    req.to = branch;
                    (req.at_layer, req.at_base) = At::wire(Some(at));
                }
                (None, Some(_), _) => bail!("--at takes one STACK@BRANCH"),
                (None, None, [a, b]) => {
                    let (stack, from) = split_branch(a);
                    let (other, to) = match b.strip_prefix('@') {
                        Some(to) => (stack.clone(), to.to_string()),
                        None => split_branch(b),
                    };
                    if other != stack {
                        bail!("both sides of a diff are branches of one stack: {a:?} and {b:?}");
                    }
                    if to.is_empty() {
                        bail!("{b:?} names no branch: write STACK@BRANCH or @BRANCH");
                    }
                    req.stack = stack;
                    req.from = from;
                    req.to = to;
                }
                (None, None, [one]) if one.contains('@') => bail!(
                    "give two branches (STACK@A STACK@B), or STACK@BRANCH --at LAYER; a single argument names a container"
                ),
                (None, None, [container]) => req.container = container.clone(),
                (None, None, _) => {
                    bail!("nothing to diff: give STACK@A STACK@B, STACK@B --at LAYER, a container or --session ID")
                }
            }
            // The daemon compares the trees before it answers: a spinner on a
            // terminal meanwhile, then the count of entries received.
            let bar = crate::output::spinner("comparing");
            let mut stream = c.diff(req).await?.into_inner();
            let mut sides = None;
            let mut entries = Vec::new();
            while let Some(r) = stream.message().await? {
                if sides.is_none() {
                    sides = Some((r.old.clone(), r.new.clone()));
                }
                entries.extend(r.entries);
                bar.set_message(format!("received {} changed paths", entries.len()));
            }
            bar.finish_and_clear();
            let (old, new) = sides.context("the daemon's diff sent no header")?;
            if json {
                let side = |kind: &str, size: u64, mode: u32| {
                    if kind.is_empty() {
                        serde_json::Value::Null
                    } else {
                        json!({"kind": kind, "size": size, "mode": format!("{mode:04o}")})
                    }
                };
                out!(
                    "{}",
                    json!({
                        "old": old, "new": new,
                        "entries": entries.iter().map(|e| {
                            let mut v = json!({
                                "path": e.path, "change": e.change,
                                "old": side(&e.old_kind, e.old_size, e.old_mode),
                                "new": side(&e.new_kind, e.new_size, e.new_mode),
                            });
                            if patch {
                                v["patch"] = json!(e.patch);
                            }
                            v
                        }).collect::<Vec<_>>(),
                    })
                );
                return Ok(ExitCode::SUCCESS);
            }
            out!("--- {old}");
            out!("+++ {new}");
            let mut rows = Vec::new();
            for e in &entries {
                // A mode change of the same kind (a mode-only change shows only
                // here), as `--json` has it.
                let mode = if e.change == "modified"
                    && e.old_kind == e.new_kind
                    && e.old_mode != e.new_mode
                {
                    format!("mode {:04o} → {:04o}", e.old_mode, e.new_mode)
                } else {
                    String::new()
                };
                let (flag, kind, size) = match e.change.as_str() {
                    "added" => ("A", e.new_kind.clone(), e.new_size.to_string()),
                    "deleted" => ("D", e.old_kind.clone(), e.old_size.to_string()),
                    _ if e.old_kind != e.new_kind => (
                        "M",
                        format!("{}->{}", e.old_kind, e.new_kind),
                        format!("{}->{}", e.old_size, e.new_size),
                    ),
                    _ if e.old_size != e.new_size => (
                        "M",
                        e.new_kind.clone(),
                        format!("{}->{}", e.old_size, e.new_size),
                    ),
                    _ => ("M", e.new_kind.clone(), e.new_size.to_string()),
                };
                rows.push([flag.to_string(), kind, size, e.path.clone(), mode]);
            }
            if !patch {
                print_table(&rows);
                return Ok(ExitCode::SUCCESS);
            }
            for (row, e) in rows.iter().zip(&entries) {
                print_table(std::slice::from_ref(row));
                if e.patch.is_empty() {
                    continue;
                }
                if e.patch.starts_with("@@") {
                    let rel = e.path.trim_start_matches('/');
                    out!(
                        "--- {}",
                        if e.old_kind.is_empty() {
                            "/dev/null".into()
                        } else {
                            format!("a/{rel}")
                        }
                    );
                    out!(
                        "+++ {}",
                        if e.new_kind.is_empty() {
                            "/dev/null".into()
                        } else {
                            format!("b/{rel}")
                        }
                    );
                    out!("{}", e.patch.trim_end_matches('\n'));
                } else {
                    out!("  ({})", e.patch);
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        InspectCmd::Conflict {
            cmd:
                ConflictCmd::Show {
                    container,
                    session,
                    json,
                },
        } => {
            let mut stream = c
                .show_conflicts(api::ShowConflictsRequest {
                    namespace: ns,
                    container: container.unwrap_or_default(),
                    session_id: session.unwrap_or(0),
                })
                .await?
                .into_inner();
            let mut head = None;
            let mut entries = Vec::new();
            while let Some(r) = stream.message().await? {
                if let Some(s) = r.session {
                    head = Some(s);
                }
                entries.extend(r.entries);
            }
            let s = head.context("the daemon sent no session")?;
            if json {
                out!(
                    "{}",
                    json!({
                        "session": session_json(&s, None),
                        "paths": entries.iter().map(|e| json!({
                            "path": e.path, "reason": e.reason, "blocks": e.blocks,
                            "text": if e.text.is_empty() && !e.note.is_empty() { serde_json::Value::Null } else { json!(String::from_utf8_lossy(&e.text)) },
                            "note": if e.note.is_empty() { serde_json::Value::Null } else { json!(e.note) },
                        })).collect::<Vec<_>>(),
                    })
                );
                return Ok(ExitCode::SUCCESS);
            }
            out!(
                "session {} ({}) on {}@{}: {} conflicting path(s)",
                s.id,
                s.owner,
                s.stack,
                s.branch,
                entries.len()
            );
            for e in &entries {
                out!("");
                out!("conflict {}: {}", e.path, e.reason);
                if e.note.is_empty() {
                    out!(
                        "  three-way view, {} conflict block(s) (<<<<<<< session, ||||||| lease, =======, >>>>>>> head):",
                        e.blocks
                    );
                } else if e.text.is_empty() {
                    out!("  ({})", e.note);
                    continue;
                } else {
                    // After `session rebase`: the session's file, markers in it.
                    out!(
                        "  the session's file now, {} conflict marker block(s) awaiting resolution:",
                        e.blocks
                    );
                }
                let text = String::from_utf8_lossy(&e.text);
                out!("{}", text.strip_suffix('\n').unwrap_or(&text));
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `layerstack session rebase`.
pub async fn rebase(
    admin: &Path,
    ns: &str,
    container: Option<String>,
    session: Option<i64>,
    json: bool,
) -> Result<ExitCode> {
    let mut c = crate::connect(admin).await?;
    let r = c
        .rebase_session(api::RebaseSessionRequest {
            namespace: ns.to_string(),
            container: container.unwrap_or_default(),
            session_id: session.unwrap_or(0),
        })
        .await?
        .into_inner();
    let s = r.session.clone().unwrap_or_default();
    if json {
        out!(
            "{}",
            json!({
                "session": session_json(&s, None),
                "head": r.head,
                "merged": r.merged,
                "marked": r.marked.iter().map(|m| json!({"path": m.path, "blocks": m.blocks})).collect::<Vec<_>>(),
            })
        );
        return Ok(ExitCode::SUCCESS);
    }
    out!(
        "session {} ({}) rebased onto manifest {} of {}@{}; its outcome stays conflict",
        s.id,
        s.owner,
        r.head,
        s.stack,
        s.branch
    );
    for p in &r.merged {
        out!("merged   {p}");
    }
    for m in &r.marked {
        out!("markers  {} ({} block(s))", m.path, m.blocks);
    }
    if r.marked.is_empty() {
        out!("no conflict markers: publish it again");
    } else {
        out!("resolve the markers in the container (its next run sees the head under its changes), then publish; a publish is refused while one of these files still holds a block from a `<<<<<<< session` line to a `>>>>>>> head` line, whatever is between: remove the marker lines, or the file");
    }
    Ok(ExitCode::SUCCESS)
}
