//! SandboxGraph commands (ARCHITECTURE.md §12): `graph create|ls|show`,
//! `node show|checkpoint|merge|promote|prune`, `attempt start|ls|retry`.
//!
//! A graph is a group of immutable nodes over one stack: its root node is a
//! branch head; a checkpoint turns an attempt's writes into a child node; a
//! merge combines two nodes through the publication gate; a promote moves a
//! branch to a node. Every mutating command takes `--key`: the same key twice
//! gives the same answer and one effect, also across a daemon restart.

use std::fmt::Write as _;
use std::path::Path;
use std::process::ExitCode;

use anyhow::Result;
use clap::Subcommand;
use layerstack_api as api;
use serde_json::json;

use crate::history::{split_branch, timestamp};
use crate::out;
use crate::output::print_table;
use crate::sessions::session_json;

#[derive(Debug, Subcommand)]
pub enum GraphCmd {
    /// SandboxGraphs: trees of immutable filesystem states for search and
    /// rollouts.
    Graph {
        #[command(subcommand)]
        cmd: GraphSub,
    },
    /// Nodes of a SandboxGraph: immutable roots with a logical state.
    Node {
        #[command(subcommand)]
        cmd: NodeSub,
    },
    /// Attempts: runs activating a node in a session.
    Attempt {
        #[command(subcommand)]
        cmd: AttemptSub,
    },
}

#[derive(Debug, Subcommand)]
pub enum GraphSub {
    /// Create graph NAME whose root node is STACK[@BRANCH]'s head; prints the
    /// root node's id.
    Create {
        /// The graph's name (unique).
        name: String,
        /// STACK[@BRANCH]: an image reference, stack id or base digest.
        stack: String,
        /// Idempotency key: the same key returns the first call's graph.
        #[arg(long)]
        key: Option<String>,
        /// Print the graph as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// List the graphs.
    Ls {
        /// Print the graphs as one JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Show a graph: its nodes (with parents, state, provenance) and attempts.
    Show {
        name: String,
        /// Print the graph as one JSON object.
        #[arg(long, conflicts_with = "dot")]
        json: bool,
        /// Print the graph in Graphviz dot (`| dot -Tsvg > graph.svg`).
        #[arg(long)]
        dot: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum NodeSub {
    /// Show one node.
    Show {
        id: String,
        /// Print the node as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Turn a stopped attempt's writes into a child node (no gate: a new child
    /// never conflicts; nothing is copied). CONTAINER, or --session ID.
    Checkpoint {
        /// The container whose session is the attempt (`-n` namespace).
        #[arg(required_unless_present = "session")]
        container: Option<String>,
        /// The session id instead of a container.
        #[arg(long, conflicts_with = "container")]
        session: Option<i64>,
        /// The child's logical state, a JSON object [default: {}].
        #[arg(long, value_name = "JSON")]
        state: Option<String>,
        /// Idempotency key.
        #[arg(long)]
        key: Option<String>,
        /// Print the node as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Merge node B into node A over their lowest common ancestor, through the
    /// gate: disjoint changes and clean text merges make a merge node; a
    /// conflict makes none and exits 3.
    Merge {
        a: String,
        b: String,
        /// The merge node's logical state, a JSON object [default: {}].
        #[arg(long, value_name = "JSON")]
        state: Option<String>,
        /// Idempotency key.
        #[arg(long)]
        key: Option<String>,
        /// Print the result as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Move a branch to a node's root: fast-forward, a merge publish, or refused
    /// whole (exit 3) when newer work on the branch conflicts.
    Promote {
        id: String,
        /// [STACK@]BRANCH: the branch to move [default: the branch the graph was
        /// created on]; a STACK must be the node's.
        target: Option<String>,
        /// Idempotency key.
        #[arg(long)]
        key: Option<String>,
        /// Print the result as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Prune a node's subtree: its roots become collectable unless a running
    /// attempt or another live reference reaches them.
    Prune {
        id: String,
        /// Idempotency key.
        #[arg(long)]
        key: Option<String>,
        /// Print the pruned node ids as one JSON array.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum AttemptSub {
    /// Start an attempt of NODE in a new session leasing its root, for a client
    /// that mounts it itself (prints the session and its mounts). `session run
    /// --node` does this and runs a command.
    Start {
        node: String,
        /// Exit policy recorded on the session: on-exit, on-success, never,
        /// checkpoint [default: checkpoint].
        #[arg(long)]
        policy: Option<String>,
        /// The session's owner name (`sandbox:NAME`).
        #[arg(long)]
        name: Option<String>,
        /// Idempotency key.
        #[arg(long)]
        key: Option<String>,
        /// Print the result as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// The attempts of a node.
    Ls {
        node: String,
        /// Print the attempts as one JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Retry an attempt: a new attempt of the same node.
    Retry {
        /// The attempt to retry (`attempt ls NODE` lists them).
        attempt: i64,
        /// Exit policy recorded on the new session: on-exit, on-success, never,
        /// checkpoint [default: checkpoint].
        #[arg(long)]
        policy: Option<String>,
        /// The new session's owner name (`sandbox:NAME`).
        #[arg(long)]
        name: Option<String>,
        /// Idempotency key: the same key returns the first retry.
        #[arg(long)]
        key: Option<String>,
        /// Print the result as one JSON object.
        #[arg(long)]
        json: bool,
    },
}

pub(crate) fn node_json(n: &api::Node) -> serde_json::Value {
    let state: serde_json::Value =
        serde_json::from_str(&n.state).unwrap_or_else(|_| json!(n.state));
    json!({
        "id": n.id, "graph": n.group, "kind": n.kind, "manifest": n.manifest,
        "state": state, "parents": n.parents, "missing_parents": n.missing_parents,
        "declared_parents": n.declared_parents,
        "attempt": if n.attempt == 0 { serde_json::Value::Null } else { json!(n.attempt) },
        "command": if n.command.is_empty() { serde_json::Value::Null } else { json!(n.command) },
        "labels": n.labels,
        "exit_status": if n.has_exit_status { json!(n.exit_status) } else { serde_json::Value::Null },
        "private_bytes": n.private_bytes, "base_digest": n.base_digest, "pruned": n.pruned,
        "created_ns": n.created_ns,
    })
}

pub(crate) fn attempt_json(a: &api::Attempt) -> serde_json::Value {
    json!({
        "id": a.id, "node": a.node,
        "session": if a.session == 0 { serde_json::Value::Null } else { json!(a.session) },
        "status": a.status, "key": a.key,
        "result_node": if a.result_node.is_empty() { serde_json::Value::Null } else { json!(a.result_node) },
        "message": a.message, "created_ns": a.created_ns,
        "ended_ns": if a.ended_ns == 0 { serde_json::Value::Null } else { json!(a.ended_ns) },
    })
}

fn group_json(g: &api::GraphGroup) -> serde_json::Value {
    json!({"name": g.name, "stack": g.stack, "branch": g.branch, "root": g.root, "created_ns": g.created_ns})
}

fn graph_json(g: &api::Graph) -> serde_json::Value {
    let mut v = g
        .group
        .as_ref()
        .map(group_json)
        .unwrap_or_else(|| json!({}));
    v["nodes"] = g.nodes.iter().map(node_json).collect();
    v["attempts"] = g.attempts.iter().map(attempt_json).collect();
    v
}

/// A dot string literal.
fn dot_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            c if c.is_control() => {}
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// The graph in Graphviz dot: nodes (kind, state, exit status), parent → child
/// edges, running attempts as dashed leaves.
pub(crate) fn dot(g: &api::Graph) -> String {
    let name = g.group.as_ref().map(|g| g.name.as_str()).unwrap_or("graph");
    let mut o = String::new();
    let _ = writeln!(o, "digraph {} {{", dot_str(name));
    let _ = writeln!(o, "  rankdir=TB;");
    let _ = writeln!(
        o,
        "  node [shape=box, fontname=\"monospace\", fontsize=10];"
    );
    for n in &g.nodes {
        let mut label = format!("{}\n{}", n.id, n.kind);
        if n.state != "{}" && !n.state.is_empty() {
            let st: String = n.state.chars().take(60).collect();
            let _ = write!(label, "\n{st}");
        }
        if n.has_exit_status {
            let _ = write!(label, "\nexit {}", n.exit_status);
        }
        let style = match (n.pruned, n.kind.as_str()) {
            (true, _) => ", style=dashed, color=gray, fontcolor=gray",
            (false, "root") => ", style=bold",
            (false, "merge") => ", shape=diamond",
            _ => "",
        };
        let _ = writeln!(
            o,
            "  {} [label={}{style}];",
            dot_str(&n.id),
            dot_str(&label)
        );
    }
    for n in &g.nodes {
        for p in &n.parents {
            let _ = writeln!(o, "  {} -> {};", dot_str(p), dot_str(&n.id));
        }
    }
    for a in g.attempts.iter().filter(|a| a.status == "running") {
        let id = format!("attempt-{}", a.id);
        let _ = writeln!(
            o,
            "  {} [label={}, shape=ellipse, style=dashed];",
            dot_str(&id),
            dot_str(&format!("attempt {}\nsession {}", a.id, a.session))
        );
        let _ = writeln!(
            o,
            "  {} -> {} [style=dashed];",
            dot_str(&a.node),
            dot_str(&id)
        );
    }
    o.push_str("}\n");
    o
}

fn print_node(n: &api::Node, as_json: bool) {
    if as_json {
        out!("{}", node_json(n));
        return;
    }
    out!("node {} ({}) of graph {}", n.id, n.kind, n.group);
    out!(
        "  manifest {}  parents {}",
        n.manifest,
        if n.parents.is_empty() {
            "-".into()
        } else {
            n.parents.join(", ")
        }
    );
    if !n.missing_parents.is_empty() {
        out!(
            "  parents not in this store {} (linked when pulled)",
            n.missing_parents.join(", ")
        );
    }
    out!("  state {}", n.state);
    if n.attempt != 0 {
        out!("  from attempt {}", n.attempt);
    }
    if !n.command.is_empty() {
        out!("  command {}", n.command);
    }
    if n.has_exit_status {
        out!("  exit status {}", n.exit_status);
    }
    if n.pruned {
        out!("  pruned");
    }
    out!("  created {}", timestamp(n.created_ns));
}

/// The text form of a started (or retried) attempt: what a user needs to use
/// it — its ids, where its writes go, how to end it, how to run a command
/// instead. The overlay mount itself (dozens of lowerdirs) is only in `--json`.
fn attempt_lines(r: &api::AttemptResponse) -> Vec<String> {
    let a = r.attempt.clone().unwrap_or_default();
    let s = r.session.clone().unwrap_or_default();
    let mut lines = vec![format!(
        "attempt {} of node {}: session {}{}{}",
        a.id,
        a.node,
        s.id,
        if s.policy.is_empty() {
            String::new()
        } else {
            format!(", policy {}", s.policy)
        },
        if r.created { "" } else { " (existing)" }
    )];
    let upper = r
        .mounts
        .iter()
        .flat_map(|m| m.options.iter())
        .find_map(|o| o.strip_prefix("upperdir="));
    if let Some(u) = upper {
        lines.push(format!(
            "  no process runs in it: write its files under {u}, or mount it yourself (--json lists the overlay mount)"
        ));
    }
    lines.push(format!(
        "  end it: layerstack session close {} (by its policy; --checkpoint --state JSON, --publish or --discard)",
        s.id
    ));
    lines.push(format!(
        "  to run a command in a new attempt instead: layerstack session run --node {} -- CMD",
        a.node
    ));
    lines
}

fn print_attempt(r: &api::AttemptResponse, as_json: bool) {
    if as_json {
        let a = r.attempt.clone().unwrap_or_default();
        out!(
            "{}",
            json!({
                "attempt": attempt_json(&a),
                "session": r.session.as_ref().map(|s| session_json(s, None)),
                "mounts": r.mounts.iter().map(|m| json!({"type": m.r#type, "source": m.source, "options": m.options})).collect::<Vec<_>>(),
                "created": r.created,
            })
        );
    } else {
        for l in attempt_lines(r) {
            out!("{l}");
        }
    }
}

fn key(k: Option<String>) -> String {
    k.unwrap_or_default()
}

/// Runs a graph, node or attempt command.
pub async fn run(admin: &Path, ns: &str, cmd: GraphCmd) -> Result<ExitCode> {
    let mut c = crate::connect(admin).await?;
    match cmd {
        GraphCmd::Graph { cmd } => match cmd {
            GraphSub::Create {
                name,
                stack,
                key: k,
                json,
            } => {
                let (stack, branch) = split_branch(&stack);
                let g = c
                    .create_graph(api::CreateGraphRequest {
                        namespace: ns.to_string(),
                        stack,
                        branch,
                        name,
                        key: key(k),
                    })
                    .await?
                    .into_inner();
                if json {
                    out!("{}", graph_json(&g));
                } else {
                    out!("{}", g.group.map(|g| g.root).unwrap_or_default());
                }
            }
            GraphSub::Ls { json } => {
                let (mut gs, mut page_token) = (Vec::new(), String::new());
                loop {
                    let r = c
                        .list_graphs(api::ListGraphsRequest {
                            page_size: 0,
                            page_token,
                        })
                        .await?
                        .into_inner();
                    gs.extend(r.graphs);
                    if r.next_page_token.is_empty() {
                        break;
                    }
                    page_token = r.next_page_token;
                }
                if json {
                    out!(
                        "{}",
                        serde_json::Value::Array(gs.iter().map(group_json).collect())
                    );
                } else {
                    let mut rows =
                        vec![["NAME", "STACK", "BRANCH", "ROOT", "CREATED"].map(String::from)];
                    for g in &gs {
                        rows.push([
                            g.name.clone(),
                            g.stack.clone(),
                            g.branch.clone(),
                            g.root.clone(),
                            timestamp(g.created_ns),
                        ]);
                    }
                    print_table(&rows);
                }
            }
            GraphSub::Show {
                name,
                json,
                dot: as_dot,
            } => {
                let mut pages = c
                    .show_graph(api::ShowGraphRequest { name })
                    .await?
                    .into_inner();
                let mut g = api::Graph::default();
                while let Some(p) = pages.message().await? {
                    g.group = g.group.or(p.group);
                    g.nodes.extend(p.nodes);
                    g.attempts.extend(p.attempts);
                }
                if json {
                    out!("{}", graph_json(&g));
                } else if as_dot {
                    print!("{}", dot(&g));
                } else {
                    if let Some(gr) = &g.group {
                        out!(
                            "graph {} on {}@{} (root {})",
                            gr.name,
                            gr.stack,
                            gr.branch,
                            gr.root
                        );
                    }
                    let mut rows =
                        vec![["NODE", "KIND", "PARENTS", "ATTEMPT", "EXIT", "STATE"]
                            .map(String::from)];
                    for n in &g.nodes {
                        rows.push([
                            if n.pruned {
                                format!("{} (pruned)", n.id)
                            } else {
                                n.id.clone()
                            },
                            n.kind.clone(),
                            // Parents this store lacks (pulled before them) are
                            // shown too, marked: `n1,n7(missing)`.
                            n.parents
                                .iter()
                                .cloned()
                                .chain(n.missing_parents.iter().map(|p| format!("{p}(missing)")))
                                .collect::<Vec<_>>()
                                .join(","),
                            if n.attempt == 0 {
                                "-".into()
                            } else {
                                n.attempt.to_string()
                            },
                            if n.has_exit_status {
                                n.exit_status.to_string()
                            } else {
                                "-".into()
                            },
                            n.state.clone(),
                        ]);
                    }
                    print_table(&rows);
                    let running: Vec<_> = g
                        .attempts
                        .iter()
                        .filter(|a| a.status == "running")
                        .collect();
                    if !running.is_empty() {
                        out!("running attempts:");
                        for a in running {
                            out!(
                                "  attempt {} of node {} in session {}",
                                a.id,
                                a.node,
                                a.session
                            );
                        }
                    }
                }
            }
        },
        GraphCmd::Node { cmd } => match cmd {
            NodeSub::Show { id, json } => {
                let n = c.show_node(api::ShowNodeRequest { id }).await?.into_inner();
                print_node(&n, json);
            }
            NodeSub::Checkpoint {
                container,
                session,
                state,
                key: k,
                json,
            } => {
                let n = c
                    .checkpoint(api::CheckpointRequest {
                        session_id: session.unwrap_or(0),
                        namespace: ns.to_string(),
                        container: container.unwrap_or_default(),
                        state: state.unwrap_or_default(),
                        key: key(k),
                        ..Default::default()
                    })
                    .await?
                    .into_inner();
                if json {
                    out!("{}", node_json(&n));
                } else {
                    out!("{}", n.id);
                }
            }
            NodeSub::Merge {
                a,
                b,
                state,
                key: k,
                json,
            } => {
                let r = c
                    .merge_nodes(api::MergeNodesRequest {
                        a,
                        b,
                        state: state.unwrap_or_default(),
                        key: key(k),
                    })
                    .await?
                    .into_inner();
                if json {
                    out!(
                        "{}",
                        json!({
                            "node": r.node.as_ref().map(node_json),
                            "session": r.session.as_ref().map(|s| session_json(s, None)),
                        })
                    );
                } else if let Some(n) = &r.node {
                    out!("{}", n.id);
                } else if let Some(s) = &r.session {
                    eprintln!(
                        "layerstack: the nodes conflict; no merge node was made: {} (session {}: layerstack publish --session {} --dry-run --paths shows each path)",
                        s.message, s.id, s.id
                    );
                }
                return Ok(if r.node.is_some() {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(3)
                });
            }
            NodeSub::Promote {
                id,
                target,
                key: k,
                json,
            } => {
                let (stack, branch) = match target.as_deref() {
                    None => (String::new(), String::new()),
                    Some(t) if t.contains('@') => split_branch(t),
                    Some(t) => (String::new(), t.to_string()),
                };
                let r = c
                    .promote_node(api::PromoteNodeRequest {
                        node: id,
                        branch,
                        key: key(k),
                        stack,
                        namespace: ns.to_string(),
                    })
                    .await?
                    .into_inner();
                if json {
                    out!(
                        "{}",
                        json!({
                            "result": r.result, "head": r.head, "message": r.message,
                            "session": r.session.as_ref().map(|s| session_json(s, None)),
                        })
                    );
                } else {
                    out!("{}: {}", r.result, r.message);
                }
                return Ok(if r.result == "conflict" {
                    ExitCode::from(3)
                } else {
                    ExitCode::SUCCESS
                });
            }
            NodeSub::Prune { id, key: k, json } => {
                let r = c
                    .prune_node(api::PruneNodeRequest {
                        node: id,
                        key: key(k),
                    })
                    .await?
                    .into_inner();
                if json {
                    out!("{}", json!(r.pruned));
                } else {
                    for p in &r.pruned {
                        out!("{p}");
                    }
                }
            }
        },
        GraphCmd::Attempt { cmd } => match cmd {
            AttemptSub::Start {
                node,
                policy,
                name,
                key: k,
                json,
            } => {
                let r = c
                    .start_attempt(api::StartAttemptRequest {
                        node,
                        owner: name.unwrap_or_default(),
                        key: key(k),
                        policy: policy.unwrap_or_default(),
                    })
                    .await?
                    .into_inner();
                print_attempt(&r, json);
            }
            AttemptSub::Ls { node, json } => {
                let (mut list, mut page_token) = (Vec::new(), String::new());
                loop {
                    let r = c
                        .list_attempts(api::ListAttemptsRequest {
                            node: node.clone(),
                            page_size: 0,
                            page_token,
                        })
                        .await?
                        .into_inner();
                    list.extend(r.attempts);
                    if r.next_page_token.is_empty() {
                        break;
                    }
                    page_token = r.next_page_token;
                }
                if json {
                    out!(
                        "{}",
                        serde_json::Value::Array(list.iter().map(attempt_json).collect())
                    );
                } else {
                    let mut rows = vec![
                        ["ATTEMPT", "STATUS", "SESSION", "RESULT", "MESSAGE"].map(String::from)
                    ];
                    for a in &list {
                        rows.push([
                            a.id.to_string(),
                            a.status.clone(),
                            if a.session == 0 {
                                "-".into()
                            } else {
                                a.session.to_string()
                            },
                            if a.result_node.is_empty() {
                                "-".into()
                            } else {
                                a.result_node.clone()
                            },
                            a.message.clone(),
                        ]);
                    }
                    print_table(&rows);
                }
            }
            AttemptSub::Retry {
                attempt,
                policy,
                name,
                key: k,
                json,
            } => {
                let r = c
                    .retry_attempt(api::RetryAttemptRequest {
                        attempt,
                        owner: name.unwrap_or_default(),
                        key: key(k),
                        policy: policy.unwrap_or_default(),
                    })
                    .await?
                    .into_inner();
                print_attempt(&r, json);
            }
        },
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn an_attempt_prints_what_to_do_with_it_not_its_mount() {
        let r = api::AttemptResponse {
            attempt: Some(api::Attempt {
                id: 12,
                node: "n-abc".into(),
                session: 34,
                status: "running".into(),
                ..Default::default()
            }),
            session: Some(api::Session {
                id: 34,
                policy: "checkpoint".into(),
                ..Default::default()
            }),
            mounts: vec![api::Mount {
                r#type: "overlay".into(),
                source: "overlay".into(),
                options: vec![
                    format!(
                        "lowerdir={}",
                        (1..=57)
                            .map(|i| format!("/var/lib/ls/l/{i}"))
                            .collect::<Vec<_>>()
                            .join(":")
                    ),
                    "upperdir=/var/lib/ls/s/34/upper".into(),
                    "workdir=/var/lib/ls/s/34/work".into(),
                ],
            }],
            created: false,
        };
        let lines = attempt_lines(&r);
        assert_eq!(
            lines[0],
            "attempt 12 of node n-abc: session 34, policy checkpoint (existing)"
        );
        let text = lines.join("\n");
        assert!(
            !text.contains("lowerdir") && !text.contains("mount -t"),
            "{text}"
        );
        assert!(text.contains("under /var/lib/ls/s/34/upper"), "{text}");
        assert!(text.contains("layerstack session close 34"), "{text}");
        assert!(text.contains("session run --node n-abc"), "{text}");
    }

    #[test]
    fn dot_quotes_and_draws_edges_and_running_attempts() {
        let g = api::Graph {
            group: Some(api::GraphGroup {
                name: "g\"1".into(),
                ..Default::default()
            }),
            nodes: vec![
                api::Node {
                    id: "n1".into(),
                    kind: "root".into(),
                    state: "{}".into(),
                    ..Default::default()
                },
                api::Node {
                    id: "n2".into(),
                    kind: "checkpoint".into(),
                    state: "{\"reward\":1}".into(),
                    parents: vec!["n1".into()],
                    has_exit_status: true,
                    exit_status: 0,
                    ..Default::default()
                },
            ],
            attempts: vec![
                api::Attempt {
                    id: 7,
                    node: "n2".into(),
                    session: 9,
                    status: "running".into(),
                    ..Default::default()
                },
                api::Attempt {
                    id: 6,
                    node: "n1".into(),
                    status: "checkpointed".into(),
                    ..Default::default()
                },
            ],
        };
        let d = dot(&g);
        assert!(d.starts_with("digraph \"g\\\"1\" {"), "{d}");
        assert!(d.contains("\"n1\" -> \"n2\";"), "{d}");
        assert!(d.contains("{\\\"reward\\\":1}"), "{d}");
        assert!(d.contains("\"n2\" -> \"attempt-7\" [style=dashed];"), "{d}");
        assert!(!d.contains("attempt-6"), "{d}");
        assert!(d.contains("exit 0"), "{d}");
        assert!(d.trim_end().ends_with('}'));
    }
}
