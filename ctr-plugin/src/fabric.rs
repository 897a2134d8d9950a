//! The rollout fabric's commands (issue 21; ARCHITECTURE.md §12):
//! `rollout create|ls|attempts|sample|audit|begin|end|blob` and
//! `search stats|prior|lease|release`.
//!
//! A run groups the samples (run, step, prompt, sample) of one training run or
//! search over a graph; `rollout begin` starts attempt N of a sample in a
//! daemon-owned sandbox on a node, `rollout end` ends it once —
//! completed(reward), task_failed or infra_failed(kind) — applying the
//! sample's reward once (the first completed attempt's) and backpropagating
//! once, whatever the retries and repeated calls (store/src/rollout.rs). The
//! same begin or end again answers the recorded one; another end of an ended
//! attempt is refused (`failed_precondition`).
//!
//! Exit codes: 0 success; 1 error (a refusal's kind with `--error-format
//! json`); 2 usage; 4 `rollout audit` found violations of the exactly-once
//! invariants ([`AUDIT_VIOLATIONS`]).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{ArgGroup, Subcommand};
use layerstack_api as api;
use layerstack_api::ErrorKind;
use serde_json::{json, Value};

use crate::errors::failure;
use crate::history::timestamp;
use crate::out;
use crate::output::print_table;

/// Exit status of `rollout audit` when the audit reports violations.
pub const AUDIT_VIOLATIONS: u8 = 4;

#[derive(Debug, Subcommand)]
pub enum FabricCmd {
    /// The rollout fabric: runs over a graph, attempts of samples (run, step,
    /// prompt, sample) in daemon-owned sandboxes, rewards applied once.
    Rollout {
        #[command(subcommand)]
        cmd: RolloutSub,
    },
    /// Search statistics beside the graph's nodes (visits, value sum, prior)
    /// and frontier leases that keep nodes from being pruned.
    Search {
        #[command(subcommand)]
        cmd: SearchSub,
    },
}

#[derive(Debug, Subcommand)]
pub enum RolloutSub {
    /// Create run RUN over graph G (the same name and graph again answers the
    /// existing run).
    Create {
        /// The run's name (unique).
        run: String,
        /// The graph whose nodes the run's samples start from (`graph ls`).
        #[arg(long, value_name = "G")]
        graph: String,
        /// A label K=V of the run (repeatable).
        #[arg(long = "label", value_name = "K=V")]
        labels: Vec<String>,
        /// Print the run as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// List the runs.
    Ls {
        /// Print the runs as one JSON array.
        #[arg(long)]
        json: bool,
    },
    /// The attempts of a run (of one step with --step), oldest first.
    Attempts {
        run: String,
        /// Only the attempts of this step.
        #[arg(long, value_name = "N")]
        step: Option<i64>,
        /// Print the attempts as one JSON array.
        #[arg(long)]
        json: bool,
    },
    /// One sample: its reward (and which attempt's), its attempts, those
    /// still running.
    Sample {
        run: String,
        /// The step, from 0.
        step: i64,
        /// The prompt (the task's id).
        prompt: String,
        /// The sample, from 0.
        sample: i64,
        /// Print the sample as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Audit a run's exactly-once invariants: counts and violations. Exits 4
    /// when there are violations.
    Audit {
        run: String,
        /// Print the audit as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Begin attempt N of sample (RUN, STEP, PROMPT, SAMPLE) in a new
    /// daemon-owned sandbox on --node (the same call again answers the same
    /// attempt and sandbox; a sample rewarded already starts nothing). Prints
    /// the attempt's id and its sandbox's session id.
    Begin {
        run: String,
        /// The step, from 0.
        step: i64,
        /// The prompt (the task's id).
        prompt: String,
        /// The sample, from 0.
        sample: i64,
        /// The attempt's number, from 1; a retry of the sample is the next
        /// number.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        attempt: u32,
        /// The node every attempt of the sample starts from.
        #[arg(long, value_name = "ID")]
        node: String,
        /// The policy (model checkpoint id) that acts in the attempt.
        #[arg(long, value_name = "P", default_value = "policy")]
        policy: String,
        /// The attempt's seed.
        #[arg(long, value_name = "S", allow_negative_numbers = true)]
        seed: Option<i64>,
        /// Share the daemon's network namespace [default: a namespace of its
        /// own with only `lo`].
        #[arg(long)]
        network: bool,
        /// Wait at most this many seconds for a free sandbox slot (0: fail at
        /// once with kind busy).
        #[arg(long, value_name = "SECS", default_value_t = 60)]
        wait_timeout: u32,
        /// A remote attempt: it runs on worker NAME (e.g. a Ray node id) and
        /// is only recorded here, with no sandbox here; end it with
        /// `rollout end --result-node` (docs/fabric.md "Remote attempts").
        #[arg(long, value_name = "NAME", conflicts_with = "network")]
        worker: Option<String>,
        /// Print the result as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// End rollout attempt ATTEMPT once: --reward R (completed), --task-failed
    /// or --infra-failed KIND. Its sandbox's writes become a child node
    /// (unless --discard); the first completed attempt's reward is the
    /// sample's; --backprop V adds V along the node's path to the root once.
    #[command(group(ArgGroup::new("result").required(true).args(["reward", "task_failed", "infra_failed"])))]
    End {
        /// The attempt's id (`rollout begin` printed it).
        attempt: i64,
        /// Completed with reward R (a finite number).
        #[arg(long, value_name = "R", allow_negative_numbers = true)]
        reward: Option<f64>,
        /// With --reward: the evaluator rejected the result.
        #[arg(long, conflicts_with_all = ["task_failed", "infra_failed"])]
        rejected: bool,
        /// The task failed (the policy's fault); no reward.
        #[arg(long)]
        task_failed: bool,
        /// The infrastructure failed (KIND: timeout, sandbox-lost, …); no
        /// reward; retry the sample with a new attempt.
        #[arg(long, value_name = "KIND")]
        infra_failed: Option<String>,
        /// Drop the sandbox's writes instead of making them a child node.
        #[arg(long)]
        discard: bool,
        /// Backpropagate value V from the attempt's node to the root (not
        /// with --infra-failed).
        #[arg(long, value_name = "V", allow_negative_numbers = true)]
        backprop: Option<f64>,
        /// The evaluator that gave the reward, versioned (DIGEST e.g.
        /// sha256:… of its script or image).
        #[arg(long, value_name = "NAME:VERSION[:DIGEST]")]
        evaluator: Option<String>,
        /// The child node's logical state, a JSON object [default: {}].
        #[arg(long, value_name = "JSON", conflicts_with = "discard")]
        state: Option<String>,
        /// A note recorded with the end.
        #[arg(long, value_name = "TEXT")]
        message: Option<String>,
        /// Store FILE's bytes as the attempt's trajectory (a blob; `rollout
        /// blob` reads it back). Without it (or with an empty file), the
        /// trajectory is the daemon's record of the commands run in the
        /// attempt's sandbox (a JSON array: argv, exit_code, signal,
        /// timed_out, duration_ms, the first 4 KiB of stdout and stderr).
        #[arg(long, value_name = "FILE")]
        trajectory: Option<PathBuf>,
        /// A remote attempt's checkpoint: node ID, pulled into this store,
        /// a child of the attempt's node (not with --infra-failed or
        /// --discard).
        #[arg(long, value_name = "ID", conflicts_with_all = ["infra_failed", "discard"])]
        result_node: Option<String>,
        /// Print the ended attempt as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Write a rollout blob (a trajectory, an artifact; `rollout attempts
    /// --json` names their digests) to stdout or a file.
    Blob {
        /// The blob's digest (blake3:<hex>).
        digest: String,
        /// Write it to FILE (whole, or not at all) instead of stdout.
        #[arg(long, short = 'o', value_name = "FILE")]
        output: Option<PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
pub enum SearchSub {
    /// A node's search statistics: visits, value sum, mean, prior, frontier
    /// holders (and its children's with --children).
    Stats {
        node: String,
        /// Also the statistics of its children (unpruned, first parent NODE).
        #[arg(long)]
        children: bool,
        /// Print the statistics as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Set a node's prior P (the policy's probability of the action that
    /// made it, for PUCT).
    Prior {
        node: String,
        /// The prior, a finite number.
        #[arg(allow_negative_numbers = true)]
        prior: f64,
        /// Print the node's statistics as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Lease NODEs for frontier HOLDER: a leased node is never pruned until
    /// every holder releases it (leases survive daemon restarts). Prints the
    /// holder's leased nodes.
    Lease {
        holder: String,
        /// The nodes to lease.
        #[arg(required = true)]
        nodes: Vec<String>,
        /// Print the holder's leased nodes as one JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Release HOLDER's leases on NODEs (every lease of HOLDER without NODEs).
    /// Prints the nodes it still leases.
    Release {
        holder: String,
        /// The nodes to release [default: all of HOLDER's].
        nodes: Vec<String>,
        /// Print the holder's remaining leased nodes as one JSON array.
        #[arg(long)]
        json: bool,
    },
}

fn invalid(message: String) -> anyhow::Error {
    failure(ErrorKind::InvalidArgument, message)
}

/// `--label K=V` values as a map; a value without `=` or with an empty key is
/// refused naming it.
fn parse_labels(labels: &[String]) -> Result<std::collections::HashMap<String, String>> {
    labels
        .iter()
        .map(|l| match l.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(invalid(format!(
                "--label {l:?} is not K=V: give a key, '=' and a value, e.g. --label team=search"
            ))),
        })
        .collect()
}

/// `--evaluator NAME:VERSION[:DIGEST]` (the digest may hold ':' itself).
fn parse_evaluator(s: &str) -> Result<api::Evaluator> {
    let mut parts = s.splitn(3, ':');
    let (name, version, digest) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    if name.is_empty() || version.is_empty() {
        return Err(invalid(format!(
            "--evaluator {s:?} is not NAME:VERSION[:DIGEST]: give the evaluator's name and version, e.g. --evaluator unit-tests:3 or unit-tests:3:sha256:…"
        )));
    }
    Ok(api::Evaluator {
        name: name.to_string(),
        version: version.to_string(),
        digest: digest.to_string(),
    })
}

/// Refusals of `rollout end` that need no daemon — made here because the
/// daemon stops a live sandbox before it reads the state, so a bad state would
/// cost the attempt its sandbox.
fn check_end(infra_failed: Option<&str>, backprop: Option<f64>, state: Option<&str>) -> Result<()> {
    if let Some(k) = infra_failed {
        if k.trim().is_empty() {
            return Err(invalid(
                "--infra-failed needs a KIND naming what failed (e.g. timeout, sandbox-lost)"
                    .into(),
            ));
        }
        if backprop.is_some() {
            return Err(invalid(
                "an infra_failed attempt has no value to backpropagate: drop --backprop".into(),
            ));
        }
    }
    crate::check_state(state)
}

fn key_json(k: &api::SampleKey) -> Value {
    json!({"run": k.run, "step": k.step, "prompt": k.prompt, "sample": k.sample})
}

/// `run/step/prompt/sample`, as the daemon's messages write a sample.
fn key_text(k: &api::SampleKey) -> String {
    format!("{}/{}/{}/{}", k.run, k.step, k.prompt, k.sample)
}

fn run_json(r: &api::Run) -> Value {
    json!({"name": r.name, "graph": r.graph, "labels": r.labels, "created_ns": r.created_ns})
}

fn nonempty(s: &str) -> Value {
    if s.is_empty() {
        Value::Null
    } else {
        json!(s)
    }
}

/// A rollout attempt as JSON: `id` (the attempt's id, for `rollout end`),
/// `session` (its sandbox's session id, null when none), `node` (where it
/// started), `reward` (null without one), `applied`, `result_node`, `worker`
/// (a remote attempt's worker, null for a local one).
pub(crate) fn rollout_json(a: &api::RolloutAttempt) -> Value {
    json!({
        "id": a.id,
        "sample": a.sample.as_ref().map(key_json),
        "attempt": a.attempt,
        "node": a.node,
        "session": if a.session == 0 { Value::Null } else { json!(a.session) },
        "graph_attempt": if a.graph_attempt == 0 { Value::Null } else { json!(a.graph_attempt) },
        "policy": a.policy,
        "seed": if a.has_seed { json!(a.seed) } else { Value::Null },
        "status": a.status,
        "infra_kind": nonempty(&a.infra_kind),
        "reward": if a.has_reward { json!(a.reward) } else { Value::Null },
        "accepted": a.accepted,
        "applied": a.applied,
        "evaluator": a.evaluator.as_ref().map(|e| json!({"name": e.name, "version": e.version, "digest": nonempty(&e.digest)})),
        "result_node": nonempty(&a.result_node),
        "trajectory": nonempty(&a.trajectory),
        "artifacts": a.artifacts.iter().map(|x| json!({"name": x.name, "digest": x.digest, "size": x.size})).collect::<Vec<_>>(),
        "backpropagated": a.backpropagated,
        "backprop": if a.backpropagated { json!(a.backprop) } else { Value::Null },
        "message": a.message,
        "created_ns": a.created_ns,
        "ended_ns": if a.ended_ns == 0 { Value::Null } else { json!(a.ended_ns) },
        "worker": nonempty(&a.worker),
    })
}

fn sample_json(s: &api::Sample) -> Value {
    let mut v = s.key.as_ref().map(key_json).unwrap_or_else(|| json!({}));
    v["node"] = json!(s.node);
    v["reward"] = if s.has_reward {
        json!(s.reward)
    } else {
        Value::Null
    };
    v["reward_attempt"] = if s.reward_attempt == 0 {
        Value::Null
    } else {
        json!(s.reward_attempt)
    };
    v["attempts"] = json!(s.attempts);
    v["max_attempt"] = json!(s.max_attempt);
    v["running"] = json!(s.running);
    v["task_failed_attempt"] = if s.task_failed_attempt == 0 {
        Value::Null
    } else {
        json!(s.task_failed_attempt)
    };
    v
}

fn audit_json(a: &api::RunAudit) -> Value {
    json!({
        "samples": a.samples, "rewarded": a.rewarded, "attempts": a.attempts,
        "running": a.running, "completed": a.completed, "task_failed": a.task_failed,
        "infra_failed": a.infra_failed, "backprops": a.backprops, "by_worker": a.by_worker,
        "violations": a.violations, "sound": a.violations.is_empty(),
    })
}

/// The mean value (value sum / visits), none before the first visit.
fn mean(s: &api::NodeStats) -> Option<f64> {
    (s.visits > 0).then(|| s.value_sum / s.visits as f64)
}

fn stats_json(s: &api::NodeStats) -> Value {
    json!({
        "node": s.node, "visits": s.visits, "value_sum": s.value_sum, "mean": mean(s),
        "prior": if s.has_prior { json!(s.prior) } else { Value::Null },
        "frontier": s.frontier,
    })
}

fn dash(s: &str) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s.to_string()
    }
}

fn stats_row(id: String, s: &api::NodeStats) -> [String; 6] {
    [
        id,
        s.visits.to_string(),
        s.value_sum.to_string(),
        mean(s)
            .map(|m| format!("{m:.4}"))
            .unwrap_or_else(|| "-".into()),
        if s.has_prior {
            s.prior.to_string()
        } else {
            "-".into()
        },
        dash(&s.frontier.join(",")),
    ]
}

/// The text lines of an attempt `rollout begin` answered.
fn begin_lines(r: &api::BeginRolloutResponse) -> Vec<String> {
    let sample = r.sample.clone().unwrap_or_default();
    let key = sample.key.as_ref().map(key_text).unwrap_or_default();
    let Some(a) = r.attempt.as_ref().filter(|_| !r.rewarded) else {
        return vec![format!(
            "sample {key} has its reward {} (attempt {}): nothing started",
            sample.reward, sample.reward_attempt
        )];
    };
    let mut lines = vec![format!(
        "attempt {} ({key} attempt {}) on node {}: {}{}",
        a.id,
        a.attempt,
        a.node,
        if !a.worker.is_empty() {
            format!("remote, on worker {}", a.worker)
        } else if a.session == 0 {
            "no sandbox".to_string()
        } else {
            format!("sandbox session {}", a.session)
        },
        if r.created { "" } else { " (existing)" }
    )];
    if a.status == "running" {
        lines.push(format!(
            "  end it: layerstack rollout end {} --reward R | --task-failed | --infra-failed KIND",
            a.id
        ));
    } else {
        lines.push(format!(
            "  it ended already: {}; begin the next attempt (--attempt {}) to retry the sample",
            a.status,
            sample.max_attempt + 1
        ));
    }
    lines
}

/// The text line of an ended attempt.
fn end_line(a: &api::RolloutAttempt) -> String {
    let mut s = format!("attempt {} {}", a.id, a.status);
    if !a.infra_kind.is_empty() {
        s.push_str(&format!(" ({})", a.infra_kind));
    }
    if a.has_reward {
        s.push_str(&format!(": reward {}", a.reward));
        if !a.accepted {
            s.push_str(" (rejected)");
        }
        s.push_str(if a.applied {
            ", applied to its sample"
        } else {
            ", not applied (its sample had a reward already)"
        });
    }
    if a.backpropagated {
        s.push_str(&format!("; backpropagated {}", a.backprop));
    }
    if !a.result_node.is_empty() {
        s.push_str(&format!("; node {}", a.result_node));
    }
    s
}

/// Leases (`lease`) or releases `nodes` for frontier `holder`; prints the
/// nodes it leases after.
async fn frontier(
    c: &mut api::AdminClient<tonic::transport::Channel>,
    lease: bool,
    holder: String,
    nodes: Vec<String>,
    as_json: bool,
) -> Result<()> {
    let req = api::FrontierRequest {
        holder: holder.clone(),
        nodes,
    };
    let leased = if lease {
        c.lease_frontier(req).await
    } else {
        c.release_frontier(req).await
    }?
    .into_inner()
    .nodes;
    if as_json {
        out!("{}", json!(leased));
    } else if leased.is_empty() {
        out!("holder {holder} leases no nodes");
    } else {
        out!("holder {holder} leases {}", leased.join(" "));
    }
    Ok(())
}

/// Writes ReadBlob's chunks to `out` (a file written whole by rename, or
/// stdout).
async fn read_blob(
    c: &mut api::AdminClient<tonic::transport::Channel>,
    digest: String,
    output: Option<PathBuf>,
) -> Result<()> {
    let mut stream = c
        .read_blob(api::ReadBlobRequest { digest })
        .await?
        .into_inner();
    let Some(path) = output else {
        let mut so = std::io::stdout().lock();
        while let Some(chunk) = stream.message().await? {
            if let Err(e) = so.write_all(&chunk.data) {
                if e.kind() == std::io::ErrorKind::BrokenPipe {
                    std::process::exit(141);
                }
                return Err(e).context("cannot write the blob to stdout");
            }
        }
        return so.flush().context("cannot write the blob to stdout");
    };
    let name = path
        .file_name()
        .with_context(|| format!("-o {}: name a file", path.display()))?;
    let mut tmp_name = name.to_os_string();
    tmp_name.push(".partial");
    let tmp = path.with_file_name(tmp_name);
    let write = async {
        let mut f = std::fs::File::create(&tmp)
            .with_context(|| format!("cannot create {}", tmp.display()))?;
        while let Some(chunk) = stream.message().await? {
            f.write_all(&chunk.data)
                .with_context(|| format!("cannot write {}", tmp.display()))?;
        }
        f.sync_all()
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, &path)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))
    };
    let r: Result<()> = write.await;
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// Runs a `rollout` or `search` command.
pub async fn run(admin: &Path, cmd: FabricCmd) -> Result<ExitCode> {
    // Refusals that need no daemon come before the connection.
    let mut labels = Default::default();
    let mut evaluator = None;
    let mut trajectory = Vec::new();
    match &cmd {
        FabricCmd::Rollout {
            cmd: RolloutSub::Create { labels: l, .. },
        } => labels = parse_labels(l)?,
        FabricCmd::Rollout {
            cmd:
                RolloutSub::End {
                    infra_failed,
                    backprop,
                    evaluator: ev,
                    state,
                    trajectory: t,
                    ..
                },
        } => {
            check_end(infra_failed.as_deref(), *backprop, state.as_deref())?;
            evaluator = ev.as_deref().map(parse_evaluator).transpose()?;
            if let Some(t) = t {
                trajectory = std::fs::read(t).map_err(|e| {
                    invalid(format!(
                        "--trajectory {}: cannot read it ({e}): name a readable file",
                        t.display()
                    ))
                })?;
            }
        }
        _ => {}
    }
    let mut c = crate::connect(admin).await?;
    match cmd {
        FabricCmd::Rollout { cmd } => match cmd {
            RolloutSub::Create {
                run, graph, json, ..
            } => {
                let r = c
                    .create_run(api::CreateRunRequest {
                        name: run,
                        graph,
                        labels,
                    })
                    .await?
                    .into_inner();
                let run = r.run.unwrap_or_default();
                if json {
                    let mut v = run_json(&run);
                    v["created"] = json!(r.created);
                    out!("{v}");
                } else {
                    out!(
                        "run {} over graph {}{}",
                        run.name,
                        run.graph,
                        if r.created { "" } else { " (existing)" }
                    );
                }
            }
            RolloutSub::Ls { json } => {
                let runs = c
                    .list_runs(api::ListRunsRequest {})
                    .await?
                    .into_inner()
                    .runs;
                if json {
                    out!("{}", Value::Array(runs.iter().map(run_json).collect()));
                } else {
                    let mut rows = vec![["RUN", "GRAPH", "LABELS", "CREATED"].map(String::from)];
                    for r in &runs {
                        let mut labels: Vec<_> =
                            r.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                        labels.sort();
                        rows.push([
                            r.name.clone(),
                            r.graph.clone(),
                            dash(&labels.join(",")),
                            timestamp(r.created_ns),
                        ]);
                    }
                    print_table(&rows);
                }
            }
            RolloutSub::Attempts { run, step, json } => {
                let (mut list, mut page_token) = (Vec::new(), String::new());
                loop {
                    let r = c
                        .list_rollouts(api::ListRolloutsRequest {
                            run: run.clone(),
                            has_step: step.is_some(),
                            step: step.unwrap_or(0),
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
                    out!("{}", Value::Array(list.iter().map(rollout_json).collect()));
                } else {
                    let mut rows = vec![[
                        "ID", "SAMPLE", "ATTEMPT", "STATUS", "INFRA", "REWARD", "APPLIED", "NODE",
                        "WORKER", "RESULT",
                    ]
                    .map(String::from)];
                    for a in &list {
                        rows.push([
                            a.id.to_string(),
                            a.sample.as_ref().map(key_text).unwrap_or_default(),
                            a.attempt.to_string(),
                            a.status.clone(),
                            dash(&a.infra_kind),
                            if a.has_reward {
                                a.reward.to_string()
                            } else {
                                "-".into()
                            },
                            if a.applied { "yes" } else { "no" }.into(),
                            a.node.clone(),
                            dash(&a.worker),
                            dash(&a.result_node),
                        ]);
                    }
                    print_table(&rows);
                }
            }
            RolloutSub::Sample {
                run,
                step,
                prompt,
                sample,
                json,
            } => {
                let s = c
                    .get_sample(api::SampleKey {
                        run,
                        step,
                        prompt,
                        sample,
                    })
                    .await?
                    .into_inner();
                if json {
                    out!("{}", sample_json(&s));
                } else {
                    let key = s.key.as_ref().map(key_text).unwrap_or_default();
                    out!("sample {key} from node {}", s.node);
                    if s.has_reward {
                        out!("  reward {} (attempt {})", s.reward, s.reward_attempt);
                    } else if s.task_failed_attempt != 0 {
                        out!(
                            "  task failed (attempt {}): final, no reward",
                            s.task_failed_attempt
                        );
                    } else {
                        out!("  no reward yet");
                    }
                    out!(
                        "  {} attempt(s) begun, highest number {}",
                        s.attempts,
                        s.max_attempt
                    );
                    if !s.running.is_empty() {
                        let ids: Vec<_> = s.running.iter().map(i64::to_string).collect();
                        out!("  running: {}", ids.join(", "));
                    }
                }
            }
            RolloutSub::Audit { run, json } => {
                let a = c
                    .audit_run(api::AuditRunRequest { run: run.clone() })
                    .await?
                    .into_inner();
                if json {
                    out!("{}", audit_json(&a));
                } else {
                    out!(
                        "run {run}: {} sample(s), {} rewarded; {} attempt(s): {} running, {} completed, {} task_failed, {} infra_failed; {} backpropagation(s)",
                        a.samples,
                        a.rewarded,
                        a.attempts,
                        a.running,
                        a.completed,
                        a.task_failed,
                        a.infra_failed.values().sum::<u64>(),
                        a.backprops
                    );
                    let mut kinds: Vec<_> = a.infra_failed.iter().collect();
                    kinds.sort();
                    for (k, n) in kinds {
                        out!("  infra_failed {k}: {n}");
                    }
                    let mut workers: Vec<_> = a.by_worker.iter().collect();
                    workers.sort();
                    for (w, n) in workers {
                        out!("  worker {w}: {n} attempt(s)");
                    }
                    for v in &a.violations {
                        out!("  violation: {v}");
                    }
                }
                if !a.violations.is_empty() {
                    eprintln!(
                        "layerstack: run {run}'s audit found {} violation(s) of the exactly-once invariants",
                        a.violations.len()
                    );
                    return Ok(ExitCode::from(AUDIT_VIOLATIONS));
                }
            }
            RolloutSub::Begin {
                run,
                step,
                prompt,
                sample,
                attempt,
                node,
                policy,
                seed,
                network,
                wait_timeout,
                worker,
                json,
            } => {
                let r = c
                    .begin_rollout(api::BeginRolloutRequest {
                        sample: Some(api::SampleKey {
                            run,
                            step,
                            prompt,
                            sample,
                        }),
                        attempt,
                        node,
                        policy,
                        has_seed: seed.is_some(),
                        seed: seed.unwrap_or(0),
                        sandbox: Some(api::SandboxOptions {
                            network,
                            ..Default::default()
                        }),
                        wasi: None,
                        wait_ms: wait_timeout.saturating_mul(1000),
                        worker: worker.unwrap_or_default(),
                    })
                    .await?
                    .into_inner();
                if json {
                    let a = r.attempt.as_ref();
                    out!(
                        "{}",
                        json!({
                            "attempt": a.map(|a| a.id),
                            "session": a.filter(|a| a.session != 0).map(|a| a.session),
                            "node": a.map(|a| a.node.clone()),
                            "created": r.created,
                            "rewarded": r.rewarded,
                            "rollout": a.map(rollout_json),
                            "sample": r.sample.as_ref().map(sample_json),
                        })
                    );
                } else {
                    for l in begin_lines(&r) {
                        out!("{l}");
                    }
                }
            }
            RolloutSub::End {
                attempt,
                reward,
                rejected,
                task_failed,
                infra_failed,
                discard,
                backprop,
                state,
                message,
                result_node,
                json,
                ..
            } => {
                let status = if reward.is_some() {
                    "completed"
                } else if task_failed {
                    "task_failed"
                } else {
                    "infra_failed"
                };
                let keep = if discard {
                    api::end_rollout_request::Keep::Discard
                } else {
                    api::end_rollout_request::Keep::Checkpoint
                };
                let a = c
                    .end_rollout(api::EndRolloutRequest {
                        attempt,
                        status: status.into(),
                        reward: reward.unwrap_or(0.0),
                        accepted: !rejected,
                        infra_kind: infra_failed.unwrap_or_default(),
                        evaluator,
                        has_backprop: backprop.is_some(),
                        backprop: backprop.unwrap_or(0.0),
                        message: message.unwrap_or_default(),
                        keep: keep as i32,
                        state: state.unwrap_or_default(),
                        trajectory,
                        result_node: result_node.unwrap_or_default(),
                        ..Default::default()
                    })
                    .await?
                    .into_inner();
                if json {
                    out!("{}", rollout_json(&a));
                } else {
                    out!("{}", end_line(&a));
                }
            }
            RolloutSub::Blob { digest, output } => read_blob(&mut c, digest, output).await?,
        },
        FabricCmd::Search { cmd } => match cmd {
            SearchSub::Stats {
                node,
                children,
                json,
            } => {
                let r = c
                    .get_node_stats(api::GetNodeStatsRequest { node, children })
                    .await?
                    .into_inner();
                let me = r.node.unwrap_or_default();
                if json {
                    out!(
                        "{}",
                        json!({
                            "node": stats_json(&me),
                            "children": children.then(|| r.children.iter().map(stats_json).collect::<Vec<_>>()),
                        })
                    );
                } else {
                    let mut rows =
                        vec![["NODE", "VISITS", "VALUE_SUM", "MEAN", "PRIOR", "FRONTIER"]
                            .map(String::from)];
                    rows.push(stats_row(me.node.clone(), &me));
                    for k in &r.children {
                        rows.push(stats_row(format!("  {}", k.node), k));
                    }
                    print_table(&rows);
                }
            }
            SearchSub::Prior { node, prior, json } => {
                let s = c
                    .set_prior(api::SetPriorRequest { node, prior })
                    .await?
                    .into_inner();
                if json {
                    out!("{}", stats_json(&s));
                } else {
                    out!("node {}: prior {}", s.node, s.prior);
                }
            }
            SearchSub::Lease {
                holder,
                nodes,
                json,
            } => frontier(&mut c, true, holder, nodes, json).await?,
            SearchSub::Release {
                holder,
                nodes,
                json,
            } => frontier(&mut c, false, holder, nodes, json).await?,
        },
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::errors::{render, ErrorFormat};

    fn kind_and_message(e: &anyhow::Error) -> (String, String) {
        crate::errors::describe(e)
    }

    #[test]
    fn bad_flags_are_refused_naming_the_flag_and_the_fix() {
        let e = parse_labels(&["team".into()]).unwrap_err();
        let (kind, msg) = kind_and_message(&e);
        assert_eq!(kind, "invalid_argument");
        assert!(
            msg.contains("--label \"team\"") && msg.contains("K=V"),
            "{msg}"
        );
        assert!(parse_labels(&["=x".into()]).is_err());
        let l = parse_labels(&["a=b=c".into(), "e=".into()]).unwrap();
        assert_eq!((l["a"].as_str(), l["e"].as_str()), ("b=c", ""));

        let ev = parse_evaluator("tests:3:sha256:abc").unwrap();
        assert_eq!(
            (ev.name.as_str(), ev.version.as_str(), ev.digest.as_str()),
            ("tests", "3", "sha256:abc")
        );
        assert_eq!(parse_evaluator("tests:3").unwrap().digest, "");
        let e = parse_evaluator("tests").unwrap_err();
        assert!(
            render(ErrorFormat::Text, &e).contains("NAME:VERSION[:DIGEST]"),
            "{e}"
        );

        let e = check_end(None, None, Some("{reward: 1")).unwrap_err();
        let (kind, msg) = kind_and_message(&e);
        assert_eq!(kind, "invalid_argument");
        assert!(msg.starts_with("--state is not JSON"), "{msg}");
        assert!(check_end(Some("timeout"), Some(0.0), None).is_err());
        assert!(check_end(Some(" "), None, None).is_err());
        check_end(Some("timeout"), None, Some("{\"a\": [1]}")).unwrap();
        assert!(
            check_end(Some("timeout"), None, Some("[1]")).is_err(),
            "an array is no object"
        );
    }

    #[test]
    fn the_end_needs_exactly_one_result() {
        use clap::Parser;
        let parse = |args: &[&str]| {
            crate::Cli::try_parse_from(
                ["layerstack", "rollout", "end", "7"]
                    .iter()
                    .chain(args)
                    .copied(),
            )
        };
        assert!(parse(&[]).is_err(), "no result");
        assert!(parse(&["--reward", "1", "--task-failed"]).is_err());
        assert!(parse(&["--rejected", "--task-failed"]).is_err());
        assert!(parse(&["--discard", "--state", "{}", "--reward", "1"]).is_err());
        parse(&["--reward", "-0.5", "--backprop", "-0.5", "--rejected"]).unwrap();
        parse(&["--infra-failed", "timeout", "--discard"]).unwrap();
        parse(&["--reward", "1", "--result-node", "n1"]).unwrap();
        assert!(parse(&["--infra-failed", "node-lost", "--result-node", "n1"]).is_err());
        assert!(parse(&["--reward", "1", "--discard", "--result-node", "n1"]).is_err());
        let e = crate::Cli::try_parse_from([
            "layerstack",
            "rollout",
            "begin",
            "r",
            "0",
            "p",
            "0",
            "--attempt",
            "0",
            "--node",
            "n",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("--attempt"), "{e}");
    }

    #[test]
    fn json_carries_every_id_and_the_reward_as_fields() {
        let a = api::RolloutAttempt {
            id: 12,
            sample: Some(api::SampleKey {
                run: "r".into(),
                step: 0,
                prompt: "p".into(),
                sample: 3,
            }),
            attempt: 2,
            node: "n-root".into(),
            session: 34,
            status: "completed".into(),
            has_reward: true,
            reward: 0.5,
            accepted: true,
            applied: true,
            result_node: "n-kid".into(),
            backpropagated: true,
            backprop: 0.5,
            ..Default::default()
        };
        let v = rollout_json(&a);
        assert_eq!(
            (
                &v["id"],
                &v["session"],
                &v["node"],
                &v["reward"],
                &v["result_node"]
            ),
            (
                &json!(12),
                &json!(34),
                &json!("n-root"),
                &json!(0.5),
                &json!("n-kid")
            )
        );
        assert_eq!(
            v["sample"],
            json!({"run": "r", "step": 0, "prompt": "p", "sample": 3})
        );
        assert_eq!(
            (&v["infra_kind"], &v["seed"], &v["worker"]),
            (&Value::Null, &Value::Null, &Value::Null)
        );
        let remote = api::RolloutAttempt {
            worker: "ray-node-a".into(),
            ..a.clone()
        };
        assert_eq!(rollout_json(&remote)["worker"], json!("ray-node-a"));
        assert_eq!(
            end_line(&a),
            "attempt 12 completed: reward 0.5, applied to its sample; backpropagated 0.5; node n-kid"
        );
        let s = api::NodeStats {
            node: "n".into(),
            visits: 4,
            value_sum: 2.0,
            ..Default::default()
        };
        let v = stats_json(&s);
        assert_eq!((&v["mean"], &v["prior"]), (&json!(0.5), &Value::Null));
        assert_eq!(stats_json(&api::NodeStats::default())["mean"], Value::Null);
    }

    #[test]
    fn a_rewarded_sample_says_nothing_started() {
        let r = api::BeginRolloutResponse {
            rewarded: true,
            sample: Some(api::Sample {
                key: Some(api::SampleKey {
                    run: "r".into(),
                    step: 1,
                    prompt: "p".into(),
                    sample: 0,
                }),
                has_reward: true,
                reward: 1.0,
                reward_attempt: 1,
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(
            begin_lines(&r),
            ["sample r/1/p/0 has its reward 1 (attempt 1): nothing started"]
        );
    }
}
