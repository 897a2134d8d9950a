//! Commands about history: `log`, `stack ls|rm`, `branch ls|create|delete`,
//! `promote`, `squash`, `gc`, `df`.
//!
//! A stack is named by an image reference, its stack id (`<namespace>/sha256:…`)
//! or its base digest (`sha256:…`, or 12+ hex digits): history stays reachable
//! after the image is removed from containerd. `STACK@BRANCH` names a branch (a
//! digest reference `name@sha256:…` keeps its `@`).

use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, Result};
use clap::Subcommand;
use layerstack_api as api;
use serde_json::json;

use crate::out;
use crate::output::{print_table, short, spinner};

#[derive(Debug, Subcommand)]
pub enum HistoryCmd {
    /// A branch's layers, newest first, with who published each and when:
    /// STACK[@BRANCH]. A squashed layer's members (the layers it compacted)
    /// are listed indented under it, each with its publisher, time and path
    /// count; their ids are accepted wherever a layer of the log is (--at,
    /// --since).
    Log {
        /// STACK[@BRANCH]: an image reference, stack id or base digest.
        stack: String,
        /// List the paths each layer changed.
        #[arg(long)]
        paths: bool,
        /// Print the log as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Stacks: the history on each base.
    Stack {
        #[command(subcommand)]
        cmd: StackCmd,
    },
    /// Branches of a stack: named, movable pointers into its history.
    Branch {
        #[command(subcommand)]
        cmd: BranchCmd,
    },
    /// Advance branch TO to branch FROM's head through the publication gate:
    /// fast-forward when TO's head is an ancestor, a merge publish otherwise,
    /// refused whole on conflict (exit 3).
    Promote {
        /// STACK@FROM.
        from: String,
        /// The branch to advance, of FROM's stack: BRANCH, @BRANCH or
        /// STACK@BRANCH (a STACK naming another stack is refused).
        to: String,
        /// Print the result as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Compact a branch's history now: all but its newest layers become one
    /// squashed layer; nothing any branch or session sees changes.
    Squash {
        /// STACK[@BRANCH].
        stack: String,
        /// Print the result as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Remove layers nothing reaches (no branch head, lease, node or export);
    /// report the bytes freed.
    Gc {
        /// Print the result as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Disk usage in real allocated bytes per accounting class, one column each:
    /// HOT (layers branch heads show), COLD (history only leases reach), UPPERS
    /// (session uppers), STAGING, METADATA and SNAPSHOTS (containerd's own) — per
    /// stack (the last three store-wide only) and in total.
    Df {
        /// Only this stack (an image reference, stack id or base digest).
        stack: Option<String>,
        /// Print the usage as one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum StackCmd {
    /// List the stacks of the namespace (`-n`), or of all (`-A`): id, image,
    /// branches with their depth (`name(depth)`), layers, and with `--usage`
    /// their size. A stack is the history of one image in one namespace: it
    /// appears once a container or session has used the image (after `ctr
    /// images import` or `pull` alone the list is empty); an imported base's
    /// (`layerstack base import`) belongs to no namespace and is listed in
    /// every one.
    Ls {
        /// Stacks of every namespace.
        #[arg(long, short = 'A')]
        all_namespaces: bool,
        /// Measure each stack's real allocated bytes (hot + cold layers and
        /// session uppers, as `layerstack df` counts them): walks every layer,
        /// as slow as `df`. Without it the BYTES column shows `-` and JSON
        /// `usage` is null.
        #[arg(long)]
        usage: bool,
        /// Print the stacks as one JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Remove a stack and its whole history. Refused while a session of it is
    /// live or a node or export lease pins it; `--force` discards those sessions'
    /// writes (never a mounted one's) and releases the leases: their stopped
    /// containers cannot start again (remove them: `ctr containers rm`).
    Rm {
        /// An image reference, stack id or base digest.
        stack: String,
        /// Discard live sessions and release leases.
        #[arg(long)]
        force: bool,
        /// Print the result as one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum BranchCmd {
    /// List the branches of a stack.
    Ls {
        /// An image reference, stack id or base digest.
        stack: String,
        /// Print the branches as one JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Create branch NAME (STACK@NAME) from another branch's head, or from any
    /// layer of its log: O(1), no copy.
    Create {
        /// STACK@NAME.
        branch: String,
        /// The branch to fork [default: the default branch].
        #[arg(long)]
        from: Option<String>,
        /// Fork at this layer of FROM's log instead of its head (a layer id
        /// from `layerstack log`; a member of a squashed layer forks at the view
        /// as of its publish), or at `base`: the image alone, below every
        /// published layer (a base layer's id says the same).
        #[arg(long, value_name = "LAYER|base")]
        at: Option<At>,
        /// Print the branch as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Delete branch NAME (STACK@NAME); its layers stay while anything reaches them.
    Delete {
        /// STACK@NAME.
        branch: String,
    },
}

/// An `--at` value: a layer id, or `base` (the image alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum At {
    /// A layer of the branch's log (or a base layer's id).
    Layer(i64),
    /// The base image alone, below every published layer.
    Base,
}

impl std::str::FromStr for At {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "base" {
            return Ok(At::Base);
        }
        match s.parse::<i64>() {
            Ok(n) if n > 0 => Ok(At::Layer(n)),
            _ => Err(format!(
                "{s:?} is no layer: give a layer id from `layerstack log`, or `base` for the image alone"
            )),
        }
    }
}

impl At {
    /// `(at_layer, at_base)` of the admin requests.
    pub fn wire(at: Option<At>) -> (i64, bool) {
        match at {
            None => (0, false),
            Some(At::Layer(n)) => (n, false),
            Some(At::Base) => (0, true),
        }
    }
}

/// `STACK[@BRANCH]` → (stack, branch or ""). A digest reference
/// (`name@sha256:…`) keeps its `@`.
pub fn split_branch(spec: &str) -> (String, String) {
    match spec.rsplit_once('@') {
        Some((s, b)) if !b.contains(':') && !s.is_empty() => (s.to_string(), b.to_string()),
        _ => (spec.to_string(), String::new()),
    }
}

fn need_branch(spec: &str) -> Result<(String, String)> {
    let (s, b) = split_branch(spec);
    if b.is_empty() {
        bail!("{spec:?} names no branch: write STACK@BRANCH");
    }
    Ok((s, b))
}

/// Bytes for humans: `1.5 GiB`.
fn human(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// `created_ns` as UTC `YYYY-MM-DD HH:MM:SS`.
pub(crate) fn timestamp(ns: i64) -> String {
    let (y, m, d, hh, mm, ss) = api::types::time::civil_utc(ns.div_euclid(1_000_000_000));
    format!("{y:04}-{m:02}-{d:02} {hh:02}:{mm:02}:{ss:02}")
}

/// One log entry as JSON: its fields, `changed` with `paths`, and `members`
/// (a squashed layer's, newest first, each an entry of its own; `[]` for
/// other layers).
fn log_entry_json(e: &api::LogEntry, paths: bool) -> serde_json::Value {
    let mut v = json!({
        "layer": e.layer, "manifest": e.manifest, "kind": e.kind,
        "session": if e.session == 0 { serde_json::Value::Null } else { json!(e.session) },
        "namespace": e.namespace, "container": e.container, "owner": e.owner,
        "paths": e.paths, "created_ns": e.created_ns, "created": timestamp(e.created_ns),
        "members": e.members.iter().map(|m| log_entry_json(m, paths)).collect::<Vec<_>>(),
    });
    if paths {
        v["changed"] = e
            .changed
            .iter()
            .map(|p| json!({"path": p.path, "kind": p.kind}))
            .collect();
    }
    v
}

/// `layerstack log --json`: one object with the stack, the branch and its
/// layers, newest first.
fn log_json(
    stack: &str,
    branch: &str,
    entries: &[api::LogEntry],
    paths: bool,
) -> serde_json::Value {
    json!({
        "stack": stack,
        "branch": branch,
        "layers": entries.iter().map(|e| log_entry_json(e, paths)).collect::<Vec<_>>(),
    })
}

/// `layerstack log` as lines: one row per layer (id, time, kind, publisher,
/// path count), the paths it changed below it (with `--paths`), and a
/// squashed layer's members indented under it, two spaces per level.
fn log_lines(stack: &str, branch: &str, entries: &[api::LogEntry]) -> Vec<String> {
    fn entry(e: &api::LogEntry, depth: usize, out: &mut Vec<String>) {
        let indent = "  ".repeat(depth);
        out.push(format!(
            "{indent}layer {:<6} {}  {:<9} {} ({} {})",
            e.layer,
            timestamp(e.created_ns),
            e.kind,
            if e.owner.is_empty() { "-" } else { &e.owner },
            e.paths,
            if e.paths == 1 { "path" } else { "paths" }
        ));
        for p in &e.changed {
            out.push(format!("{indent}    {:<7} {}", p.kind, p.path));
        }
        for m in &e.members {
            entry(m, depth + 1, out);
        }
    }
    let mut out = vec![format!("stack {stack} branch {branch}")];
    for e in entries {
        entry(e, 0, &mut out);
    }
    out
}

fn usage_json(u: &api::Usage) -> serde_json::Value {
    json!({
        "hot": u.hot, "cold": u.cold, "uppers": u.uppers, "staging": u.staging,
        "metadata": u.metadata, "snapshots": u.snapshots, "total": u.total,
    })
}

fn branch_json(b: &api::Branch) -> serde_json::Value {
    json!({"name": b.name, "head": b.head, "depth": b.depth, "updated_ns": b.updated_ns})
}

/// The entry of layer `layer` in `e`: `e` itself or one of its members (nested).
fn find_layer(e: &mut api::LogEntry, layer: i64) -> Option<&mut api::LogEntry> {
    if e.layer == layer {
        return Some(e);
    }
    e.members.iter_mut().find_map(|m| find_layer(m, layer))
}

/// Runs a history command.
pub async fn run(admin: &Path, ns: &str, cmd: HistoryCmd) -> Result<ExitCode> {
    let mut c = crate::connect(admin).await?;
    let ns = ns.to_string();
    match cmd {
        HistoryCmd::Log { stack, paths, json } => {
            let (image, branch) = split_branch(&stack);
            let mut stream = c
                .log(api::LogRequest {
                    namespace: ns,
                    image,
                    branch,
                    paths,
                })
                .await?
                .into_inner();
            let mut head = None;
            let mut entries = Vec::new();
            while let Some(r) = stream.message().await? {
                match (r.entry, r.more) {
                    (Some(e), _) => entries.push(e),
                    // More paths of the last entry's layer or of one of its members.
                    (None, Some(more)) => {
                        if let Some(e) = entries.last_mut().and_then(|e| find_layer(e, more.layer))
                        {
                            e.changed.extend(more.changed);
                        }
                    }
                    (None, None) => head = Some((r.stack, r.branch)),
                }
            }
            let (stack, branch) = head.unwrap_or_default();
            if json {
                out!("{}", log_json(&stack, &branch, &entries, paths));
            } else {
                for line in log_lines(&stack, &branch, &entries) {
                    out!("{line}");
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        HistoryCmd::Stack {
            cmd:
                StackCmd::Ls {
                    all_namespaces,
                    usage,
                    json,
                },
        } => {
            let (mut stacks, mut page_token) = (Vec::new(), String::new());
            loop {
                let r = c
                    .list_stacks(api::ListStacksRequest {
                        namespace: ns.clone(),
                        all_namespaces,
                        usage,
                        page_size: 0,
                        page_token,
                    })
                    .await?
                    .into_inner();
                stacks.extend(r.stacks);
                if r.next_page_token.is_empty() {
                    break;
                }
                page_token = r.next_page_token;
            }
            if json {
                let v: Vec<_> = stacks
                    .iter()
                    .map(|s| {
                        json!({
                            "id": s.id, "namespace": s.namespace, "base_digest": s.base_digest,
                            "image_refs": s.image_refs, "base_layers": s.base_layers, "layers": s.layers,
                            "branches": s.branches.iter().map(branch_json).collect::<Vec<_>>(),
                            "usage": s.usage.as_ref().map(usage_json),
                        })
                    })
                    .collect();
                out!("{}", serde_json::Value::Array(v));
            } else {
                // Sizes are measured only with --usage (a walk of every layer):
                // the header says how to get them.
                let bytes = if usage { "BYTES" } else { "BYTES(--usage)" };
                let mut rows =
                    vec![["STACK", "NAMESPACE", "IMAGE", "BRANCHES", "LAYERS", bytes]
                        .map(String::from)];
                for s in &stacks {
                    rows.push([
                        short(&s.id).to_string(),
                        s.namespace.clone().unwrap_or_else(|| "-".into()),
                        if s.namespace.is_none() {
                            "(imported)".into()
                        } else if s.image_refs.is_empty() {
                            "-".into()
                        } else {
                            s.image_refs.join(",")
                        },
                        s.branches
                            .iter()
                            .map(|b| format!("{}({})", b.name, b.depth))
                            .collect::<Vec<_>>()
                            .join(","),
                        s.layers.to_string(),
                        s.usage
                            .as_ref()
                            .map(|u| human(u.hot + u.cold + u.uppers))
                            .unwrap_or_else(|| "-".into()),
                    ]);
                }
                print_table(&rows);
            }
            Ok(ExitCode::SUCCESS)
        }
        HistoryCmd::Stack {
            cmd: StackCmd::Rm { stack, force, json },
        } => {
            let r = c
                .remove_stack(api::RemoveStackRequest {
                    namespace: ns,
                    stack: stack.clone(),
                    force,
                })
                .await?
                .into_inner();
            if json {
                out!(
                    "{}",
                    json!({"stack": stack, "layers": r.layers, "bytes_freed": r.bytes_freed})
                );
            } else {
                out!(
                    "removed stack {stack}: {} layer(s), {} freed",
                    r.layers,
                    human(r.bytes_freed)
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        HistoryCmd::Branch {
            cmd: BranchCmd::Ls { stack, json },
        } => {
            let mut r = api::ListBranchesResponse::default();
            loop {
                let page = c
                    .list_branches(api::ListBranchesRequest {
                        namespace: ns.clone(),
                        stack: stack.clone(),
                        page_size: 0,
                        page_token: std::mem::take(&mut r.next_page_token),
                    })
                    .await?
                    .into_inner();
                r.stack = page.stack;
                r.branches.extend(page.branches);
                r.next_page_token = page.next_page_token;
                if r.next_page_token.is_empty() {
                    break;
                }
            }
            if json {
                out!(
                    "{}",
                    json!({"stack": r.stack, "branches": r.branches.iter().map(branch_json).collect::<Vec<_>>()})
                );
            } else {
                let mut rows = vec![["BRANCH", "HEAD", "DEPTH", "UPDATED"].map(String::from)];
                for b in &r.branches {
                    rows.push([
                        b.name.clone(),
                        b.head.to_string(),
                        b.depth.to_string(),
                        timestamp(b.updated_ns),
                    ]);
                }
                print_table(&rows);
            }
            Ok(ExitCode::SUCCESS)
        }
        HistoryCmd::Branch {
            cmd:
                BranchCmd::Create {
                    branch,
                    from,
                    at,
                    json,
                },
        } => {
            let (stack, name) = need_branch(&branch)?;
            let (at_layer, at_base) = At::wire(at);
            let b = c
                .create_branch(api::CreateBranchRequest {
                    namespace: ns,
                    stack,
                    name,
                    from: from.unwrap_or_default(),
                    at_layer,
                    at_base,
                })
                .await?
                .into_inner();
            if json {
                out!("{}", branch_json(&b));
            } else {
                out!(
                    "branch {} at manifest {} ({} layers)",
                    b.name,
                    b.head,
                    b.depth
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        HistoryCmd::Branch {
            cmd: BranchCmd::Delete { branch },
        } => {
            let (stack, name) = need_branch(&branch)?;
            c.delete_branch(api::DeleteBranchRequest {
                namespace: ns,
                stack,
                name: name.clone(),
            })
            .await?;
            out!("deleted branch {name}");
            Ok(ExitCode::SUCCESS)
        }
        HistoryCmd::Promote { from, to, json } => {
            let (stack, from) = need_branch(&from)?;
            let r = c
                .promote(api::PromoteRequest {
                    namespace: ns,
                    stack,
                    from,
                    to,
                    operation: String::new(),
                })
                .await?
                .into_inner();
            if json {
                out!(
                    "{}",
                    json!({
                        "result": r.result, "head": r.head, "message": r.message,
                        "session": r.session.as_ref().map(|s| crate::sessions::session_json(s, None)),
                    })
                );
            } else {
                out!("{}", r.result);
                if let Some(s) = &r.session {
                    for cpath in &s.conflicts {
                        out!("conflict {}: {}", cpath.path, cpath.reason);
                    }
                }
                if !r.message.is_empty() {
                    out!("{}", r.message);
                }
            }
            Ok(if r.result == "conflict" {
                ExitCode::from(3)
            } else {
                ExitCode::SUCCESS
            })
        }
        HistoryCmd::Squash { stack, json } => {
            let (stack, branch) = split_branch(&stack);
            let bar = spinner("squashing");
            let r = c
                .squash(api::SquashRequest {
                    namespace: ns,
                    stack,
                    branch,
                })
                .await;
            bar.finish_and_clear();
            let r = r?.into_inner();
            if json {
                out!(
                    "{}",
                    json!({"squashed": r.squashed, "layer": r.layer, "head": r.head, "depth_before": r.depth_before, "depth_after": r.depth_after})
                );
            } else if r.squashed {
                out!(
                    "squashed into layer {}: depth {} -> {}",
                    r.layer,
                    r.depth_before,
                    r.depth_after
                );
            } else {
                out!("nothing to squash (depth {})", r.depth_before);
            }
            Ok(ExitCode::SUCCESS)
        }
        HistoryCmd::Gc { json } => {
            let bar = spinner("collecting layers nothing reaches");
            let r = c.gc(api::GcRequest {}).await;
            bar.finish_and_clear();
            let r = r?.into_inner();
            if json {
                out!(
                    "{}",
                    json!({"layers": r.layers, "manifests": r.manifests, "bytes_freed": r.bytes_freed, "uppers_released": r.uppers_released})
                );
            } else {
                out!(
                    "freed {} layer(s), {} manifest(s), {} kept upper(s): {}",
                    r.layers,
                    r.manifests,
                    r.uppers_released,
                    human(r.bytes_freed)
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        HistoryCmd::Df { stack, json } => {
            let r = c
                .disk_usage(api::DiskUsageRequest {
                    namespace: ns,
                    stack: stack.clone().unwrap_or_default(),
                })
                .await?
                .into_inner();
            let total = r.total.unwrap_or_default();
            if json {
                out!(
                    "{}",
                    json!({
                        "total": usage_json(&total),
                        "stacks": r.stacks.iter().map(|s| json!({"stack": s.stack, "usage": s.usage.as_ref().map(usage_json)})).collect::<Vec<_>>(),
                    })
                );
            } else {
                // The columns are the accounting classes by their documented
                // names (docs/architecture.md; the metric's `class` label).
                let mut rows = vec![[
                    "STACK",
                    "HOT",
                    "COLD",
                    "UPPERS",
                    "STAGING",
                    "METADATA",
                    "SNAPSHOTS",
                    "TOTAL",
                ]
                .map(String::from)];
                for s in &r.stacks {
                    let u = s.usage.clone().unwrap_or_default();
                    rows.push([
                        short(&s.stack).to_string(),
                        human(u.hot),
                        human(u.cold),
                        human(u.uppers),
                        "-".into(),
                        "-".into(),
                        "-".into(),
                        human(u.hot + u.cold + u.uppers),
                    ]);
                }
                if stack.is_none() {
                    rows.push([
                        "total".into(),
                        human(total.hot),
                        human(total.cold),
                        human(total.uppers),
                        human(total.staging),
                        human(total.metadata),
                        human(total.snapshots),
                        human(total.total),
                    ]);
                }
                print_table(&rows);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stack_specs_split_at_the_branch_but_keep_digest_references() {
        assert_eq!(
            split_branch("debian:bookworm@exp"),
            ("debian:bookworm".into(), "exp".into())
        );
        assert_eq!(
            split_branch("debian@sha256:ab12"),
            ("debian@sha256:ab12".into(), String::new())
        );
        assert_eq!(
            split_branch("sha256:ab12cd34ef56@main"),
            ("sha256:ab12cd34ef56".into(), "main".into())
        );
        assert_eq!(split_branch("debian"), ("debian".into(), String::new()));
        assert!(need_branch("debian").is_err());
    }

    fn entry(layer: i64, kind: &str, owner: &str, paths: i64) -> api::LogEntry {
        api::LogEntry {
            layer,
            kind: kind.into(),
            owner: owner.into(),
            paths,
            session: if owner.is_empty() { 0 } else { layer + 100 },
            created_ns: 1_796_083_200_000_000_000 + layer * 1_000_000_000,
            ..Default::default()
        }
    }

    /// A squashed row shows its merged path count, and its members — nested
    /// squashes nested — sit indented under it with who published each, when,
    /// and how many paths it changed; `--json` gives them as `members`.
    #[test]
    fn the_log_shows_members_under_their_squash() {
        let mut inner = entry(5, "squashed", "", 2);
        inner.members = vec![
            entry(3, "published", "container:default/q2", 1),
            entry(2, "published", "sandbox:w", 2),
        ];
        let mut sq = entry(9, "squashed", "", 3);
        sq.members = vec![entry(7, "published", "container:default/q3", 1), inner];
        sq.changed = vec![api::PathChange {
            path: "/x".into(),
            kind: "write".into(),
            raw_path: b"x".to_vec(),
        }];
        let top = entry(11, "published", "operation:op-1", 1);
        let entries = vec![top, sq];
        assert_eq!(
            log_lines("default/sha256:ab", "main", &entries),
            [
                "stack default/sha256:ab branch main",
                "layer 11     2026-12-01 00:00:11  published operation:op-1 (1 path)",
                "layer 9      2026-12-01 00:00:09  squashed  - (3 paths)",
                "    write   /x",
                "  layer 7      2026-12-01 00:00:07  published container:default/q3 (1 path)",
                "  layer 5      2026-12-01 00:00:05  squashed  - (2 paths)",
                "    layer 3      2026-12-01 00:00:03  published container:default/q2 (1 path)",
                "    layer 2      2026-12-01 00:00:02  published sandbox:w (2 paths)",
            ]
        );
        let v = log_json("s", "main", &entries, false);
        let sq = &v["layers"][1];
        assert_eq!(sq["paths"], 3);
        assert!(sq.get("changed").is_none());
        assert_eq!(sq["members"][0]["layer"], 7);
        assert_eq!(sq["members"][0]["owner"], "container:default/q3");
        assert_eq!(sq["members"][0]["session"], 107);
        assert_eq!(sq["members"][1]["members"][1]["paths"], 2);
        assert_eq!(v["layers"][0]["members"], json!([]));
        let v = log_json("s", "main", &entries, true);
        assert_eq!(v["layers"][1]["changed"][0]["path"], "/x");
    }

    #[test]
    fn at_takes_a_layer_id_or_base() {
        assert_eq!("12".parse::<At>(), Ok(At::Layer(12)));
        assert_eq!("base".parse::<At>(), Ok(At::Base));
        assert!("0".parse::<At>().is_err());
        assert!("head".parse::<At>().is_err_and(|e| e.contains("`base`")));
        assert_eq!(At::wire(Some(At::Base)), (0, true));
        assert_eq!(At::wire(Some(At::Layer(3))), (3, false));
        assert_eq!(At::wire(None), (0, false));
    }

    #[test]
    fn timestamps_and_sizes_read_as_people_write_them() {
        assert_eq!(timestamp(0), "1970-01-01 00:00:00");
        assert_eq!(timestamp(1_796_083_200_000_000_000), "2026-12-01 00:00:00");
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 << 30), "3.0 GiB");
    }
}
