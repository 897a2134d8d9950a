//! The rollout fabric's records (ARCHITECTURE.md §12; seed `002` stage 03;
//! docs/fabric.md): runs, samples and their attempts, rewards, search
//! statistics and frontier leases — mutable rows beside the immutable graph.
//!
//! **Exactly once.** A sample (run, step, prompt, sample) is rewarded by the
//! first of its attempts that ends `completed`: the attempt's end, the sample's
//! reward and the attempt's backpropagation are written in one transaction
//! ([`end_rollout_in`]), which also holds the attempt's checkpoint when the
//! attempt ends from its live session ([`Store::commit_checkpoint`] with a
//! [`RolloutEnding`]). An attempt ends once (`status = 'running'` is the
//! guard); a repeated end with the same result answers the recorded end; a
//! sample's reward is set only while it has none (`reward_attempt IS NULL`);
//! a backpropagation is keyed by its attempt (`search_backprops` primary key).
//! So retries, crashes and duplicate calls can add attempts, never a second
//! reward or a second backpropagation.
//!
//! **Never a silent zero.** An attempt ends `completed(reward)`, `task_failed`
//! or `infra_failed(kind)`; an attempt whose sandbox an infrastructure failure
//! ended (a daemon restart, its init gone, its session abandoned) is ended
//! `infra_failed` by [`sync_rollouts_in`], never with a reward.

use std::collections::BTreeMap;
use std::path::PathBuf;

use rusqlite::{params, Connection, OptionalExtension, Transaction};
use tracing::info;

use crate::db::Cached;
use crate::error::StoreError;
use crate::graph::get_node;
use crate::{now_ns, Durability, SessionId, Store};

/// Where an attempt stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RolloutStatus {
    /// Its sandbox may still run; no result yet.
    Running,
    /// It ended with a reward (the evaluator's, or the harness's).
    Completed,
    /// The task failed (the policy's fault: a wrong edit, a failed build);
    /// no reward.
    TaskFailed,
    /// The infrastructure failed (see [`RolloutAttempt::infra_kind`]); no
    /// reward, and the sample may be retried with a new attempt.
    InfraFailed,
}

impl RolloutStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Completed => "completed",
            Self::TaskFailed => "task_failed",
            Self::InfraFailed => "infra_failed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "running" => Self::Running,
            "completed" => Self::Completed,
            "task_failed" => Self::TaskFailed,
            "infra_failed" => Self::InfraFailed,
            _ => return None,
        })
    }
}

/// A sample's coordinates: (run, step, prompt, sample).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct SampleKey {
    pub run: String,
    pub step: i64,
    pub prompt: String,
    pub sample: i64,
}

impl std::fmt::Display for SampleKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}/{}/{}",
            self.run, self.step, self.prompt, self.sample
        )
    }
}

/// A run: the samples of one training run or search, over one graph.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunInfo {
    pub name: String,
    /// The graph (group) whose nodes its samples start from.
    pub graph: String,
    pub labels: BTreeMap<String, String>,
    pub created_ns: i64,
}

/// A versioned evaluator, recorded with the reward it gave.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Evaluator {
    pub name: String,
    pub version: String,
    /// Content digest of the evaluator (e.g. `sha256:…` of its script or image).
    pub digest: String,
}

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq)]
pub enum RolloutResult {
    /// A reward; `accepted`: the evaluator's acceptance (e.g. tests pass).
    Completed {
        reward: f64,
        accepted: bool,
    },
    TaskFailed,
    /// `kind`: what failed (`daemon-restart`, `init-gone`, `abandoned`,
    /// `sandbox-start`, `timeout`, or a harness's own word); never empty.
    InfraFailed {
        kind: String,
    },
}

impl RolloutResult {
    pub fn status(&self) -> RolloutStatus {
        match self {
            Self::Completed { .. } => RolloutStatus::Completed,
            Self::TaskFailed => RolloutStatus::TaskFailed,
            Self::InfraFailed { .. } => RolloutStatus::InfraFailed,
        }
    }
}

/// A named artifact of an attempt: a blob in `<root>/blobs` ([`Store::put_blob`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Artifact {
    pub name: String,
    /// `blake3:<hex>`.
    pub digest: String,
    /// Bytes.
    pub size: u64,
}

/// The end of an attempt, as the harness (or the fabric) reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutEnding {
    pub result: RolloutResult,
    pub evaluator: Option<Evaluator>,
    /// `blake3:<hex>` of the trajectory blob (the attempt's exec records).
    pub trajectory: Option<String>,
    pub artifacts: Vec<Artifact>,
    /// The value to backpropagate from the attempt's leaf (its kept checkpoint,
    /// else its start node) to the graph's root; `None`: no backpropagation.
    /// Refused for `InfraFailed` (an infrastructure failure is not a value).
    pub backprop: Option<f64>,
    pub message: String,
}

/// Bytes of a command's stdout, and of its stderr, that an [`ExecRecord`]
/// keeps (the first ones) — the Python SDK's `AsyncRollout.KEEP_BYTES`.
pub const EXEC_RECORD_KEEP_BYTES: usize = 4096;

/// One command the daemon ran in a running attempt's sandbox (`Exec`), as the
/// attempt's trajectory holds it ([`Store::record_rollout_exec`]). Its JSON is
/// the object the Python SDK's `trajectory_record` writes — `argv`,
/// `exit_code`, `signal`, `timed_out`, `duration_ms` (ms), `stdout` and
/// `stderr` (the first [`EXEC_RECORD_KEEP_BYTES`] bytes of each, decoded
/// as UTF-8 with replacement characters) — plus `error` when the command
/// has no exit (its sandbox ended under it, its caller went away).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExecRecord {
    pub argv: Vec<String>,
    /// `None`: no exit (see `error`).
    pub exit_code: Option<i32>,
    /// The signal that ended it (0: none).
    pub signal: i32,
    pub timed_out: bool,
    pub duration_ms: u64,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    pub error: Option<String>,
}

impl ExecRecord {
    /// A record of `argv`, nothing seen yet.
    #[must_use]
    pub fn new(argv: Vec<String>) -> Self {
        Self {
            argv,
            ..Self::default()
        }
    }

    /// Keeps what of `bytes` (the command's next stdout bytes, or stderr's)
    /// fits in the first [`EXEC_RECORD_KEEP_BYTES`].
    pub fn output(&mut self, stderr: bool, bytes: &[u8]) {
        let kept = if stderr {
            &mut self.stderr
        } else {
            &mut self.stdout
        };
        let room = EXEC_RECORD_KEEP_BYTES.saturating_sub(kept.len());
        kept.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    /// The record's JSON object.
    #[must_use]
    pub fn to_json(&self) -> String {
        let mut v = serde_json::json!({
            "argv": self.argv,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "timed_out": self.timed_out,
            "duration_ms": self.duration_ms,
            "stdout": String::from_utf8_lossy(&self.stdout),
            "stderr": String::from_utf8_lossy(&self.stderr),
        });
        if let Some(e) = &self.error {
            v["error"] = serde_json::Value::from(e.as_str());
        }
        v.to_string()
    }
}

/// One attempt of a sample.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutAttempt {
    pub id: i64,
    pub key: SampleKey,
    /// From 1.
    pub attempt: u32,
    /// The node it started from (its sample's node).
    pub node: String,
    /// The graph attempt of its sandbox session, once there is one.
    pub graph_attempt: Option<i64>,
    /// The worker (e.g. a Ray node id) a remote attempt runs on; `None`: a
    /// local attempt, whose sandbox is this store's (format 14).
    pub worker: Option<String>,
    pub session: Option<SessionId>,
    pub policy: String,
    pub seed: Option<i64>,
    pub status: RolloutStatus,
    pub infra_kind: Option<String>,
    pub reward: Option<f64>,
    pub accepted: Option<bool>,
    /// This attempt's reward is its sample's (exactly one attempt per rewarded
    /// sample).
    pub applied: bool,
    pub evaluator: Option<Evaluator>,
    /// The checkpoint kept for it, if any.
    pub result_node: Option<String>,
    pub trajectory: Option<String>,
    pub artifacts: Vec<Artifact>,
    /// Whether its backpropagation happened (and with which value).
    pub backprop: Option<f64>,
    pub message: String,
    pub created_ns: i64,
    pub ended_ns: Option<i64>,
}

/// A sample and its reward.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleInfo {
    pub key: SampleKey,
    pub node: String,
    pub reward: Option<f64>,
    /// The attempt (number) whose reward was applied.
    pub reward_attempt: Option<u32>,
    pub attempts: u32,
    /// The highest attempt number begun.
    pub max_attempt: u32,
    /// Ids of its attempts still running.
    pub running: Vec<i64>,
    /// The first attempt (number) that ended `task_failed`, if any: the task
    /// itself failed, a result as final as a reward (a fan-out called again
    /// does not run the sample again; `infra_failed` attempts are retried).
    pub task_failed_attempt: Option<u32>,
    pub created_ns: i64,
}

/// What [`Store::begin_rollout`] found or made.
// One per begin, returned and matched at once, never stored in bulk: the
// variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Begun {
    /// A new attempt (`created`), or the same attempt again (a repeated call).
    Attempt {
        attempt: RolloutAttempt,
        created: bool,
    },
    /// The sample has its reward already: no attempt is started.
    Rewarded(SampleInfo),
}

/// What becomes of an attempt's sandbox and checkpoint when
/// [`Store::end_rollout`] ends it outside a checkpoint's transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Keep the checkpoint its session made (a graded attempt), if any.
    Keep,
    /// Prune the checkpoint its session made (a rejected result).
    Prune,
    /// Its live sandbox is discarded right after this end (the caller's next
    /// step): allowed while the sandbox runs. A crash between the two leaves
    /// the attempt ended as reported and the sandbox to the restart, which
    /// ends it.
    Discard,
}

/// What the end of a rollout attempt asked of its sandbox's writes
/// (`EndRolloutRequest.keep`), recorded with the end (`end_keep`, store
/// format 18): a repeated end asking otherwise is refused, since it cannot
/// be what the first end did — a discarded sandbox has no checkpoint to
/// keep, a kept checkpoint is not discarded by a repeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndKeep {
    /// keep CHECKPOINT: the checkpoint its sandbox made (now, or earlier for
    /// grading) is the attempt's.
    Checkpoint,
    /// keep DISCARD: its sandbox's writes are dropped, a grading checkpoint
    /// pruned.
    Discard,
}

impl EndKeep {
    /// The column's spelling, and the wire's in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Checkpoint => "checkpoint",
            Self::Discard => "discard",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "checkpoint" => Some(Self::Checkpoint),
            "discard" => Some(Self::Discard),
            _ => None,
        }
    }
}

/// The refusal of an end that asks to discard its result and names a
/// result node (`InvalidArgument`).
pub fn discard_with_node(id: i64) -> StoreError {
    StoreError::InvalidArgument(format!(
        "rollout attempt {id}: keep DISCARD with a result node: a discarded result keeps no node; omit result_node or keep CHECKPOINT"
    ))
}

impl Disposition {
    /// What the harness asked for, as recorded with the end.
    fn keep(self) -> EndKeep {
        match self {
            Self::Keep => EndKeep::Checkpoint,
            Self::Prune | Self::Discard => EndKeep::Discard,
        }
    }
}

/// What [`Store::begin_rollout`] asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolloutBegin {
    pub key: SampleKey,
    /// From 1; the harness numbers retries (a retry is a new attempt).
    pub attempt: u32,
    pub node: String,
    /// A model checkpoint id (free text, e.g. `step-120`).
    pub policy: String,
    pub seed: Option<i64>,
    /// A remote attempt: it runs on this worker (e.g. a Ray node id), with no
    /// sandbox in this store; it ends with a checkpoint node the caller
    /// pulled here ([`Store::end_remote_rollout`]). `None`: a local attempt.
    pub worker: Option<String>,
}

/// Search statistics of a node (mutable, beside the immutable node).
#[derive(Debug, Clone, PartialEq)]
pub struct NodeStats {
    pub node: String,
    pub visits: u64,
    pub value_sum: f64,
    pub prior: Option<f64>,
    /// Holders of frontier leases on it.
    pub frontier: Vec<String>,
}

/// A run's audit: what an exactly-once claim is checked against.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunAudit {
    pub samples: u64,
    pub rewarded: u64,
    pub attempts: u64,
    pub running: u64,
    pub completed: u64,
    pub task_failed: u64,
    /// By kind.
    pub infra_failed: BTreeMap<String, u64>,
    pub backprops: u64,
    /// Remote attempts by worker (local attempts are not counted here).
    pub by_worker: BTreeMap<String, u64>,
    /// Violations found (empty when every invariant holds): a sample with
    /// more than one applied attempt, a reward that is not its applied
    /// attempt's, an attempt with more than one backpropagation, …
    pub violations: Vec<String>,
}

const ATTEMPT_SQL: &str = "SELECT a.id, a.attempt, a.graph_attempt, a.worker, a.session_id, a.policy, a.seed, a.status, a.infra_kind, a.reward, a.accepted, a.applied, a.evaluator_name, a.evaluator_version, a.evaluator_digest, a.result_node, a.trajectory, a.message, a.created_ns, a.ended_ns, s.run, s.step, s.prompt, s.sample, s.node, b.value AS backprop
     FROM rollout_attempts a JOIN rollout_samples s ON s.id = a.sample_id LEFT JOIN search_backprops b ON b.attempt_id = a.id";

fn attempt_row(conn: &Connection, r: &rusqlite::Row<'_>) -> Result<RolloutAttempt, StoreError> {
    let id: i64 = r.get("id")?;
    let status: String = r.get("status")?;
    let status = RolloutStatus::parse(&status)
        .ok_or_else(|| StoreError::corrupt("rollout_attempts", id, format!("status {status:?}")))?;
    let attempt: i64 = r.get("attempt")?;
    let evaluator = match r.get::<_, Option<String>>("evaluator_name")? {
        Some(name) => Some(Evaluator {
            name,
            version: r
                .get::<_, Option<String>>("evaluator_version")?
                .unwrap_or_default(),
            digest: r
                .get::<_, Option<String>>("evaluator_digest")?
                .unwrap_or_default(),
        }),
        None => None,
    };
    Ok(RolloutAttempt {
        id,
        key: SampleKey {
            run: r.get("run")?,
            step: r.get("step")?,
            prompt: r.get("prompt")?,
            sample: r.get("sample")?,
        },
        attempt: u32::try_from(attempt)
            .map_err(|_| StoreError::corrupt("rollout_attempts", id, "attempt out of range"))?,
        node: r.get("node")?,
        graph_attempt: r.get("graph_attempt")?,
        worker: r.get("worker")?,
        session: r.get("session_id")?,
        policy: r.get("policy")?,
        seed: r.get("seed")?,
        status,
        infra_kind: r.get("infra_kind")?,
        reward: r.get("reward")?,
        accepted: r.get::<_, Option<i64>>("accepted")?.map(|a| a != 0),
        applied: r.get::<_, i64>("applied")? != 0,
        evaluator,
        result_node: r.get("result_node")?,
        trajectory: r.get("trajectory")?,
        artifacts: artifacts(conn, id)?,
        backprop: r.get("backprop")?,
        message: r.get("message")?,
        created_ns: r.get("created_ns")?,
        ended_ns: r.get("ended_ns")?,
    })
}

fn artifacts(conn: &Connection, attempt: i64) -> Result<Vec<Artifact>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT name, digest, size FROM rollout_artifacts WHERE attempt_id = ?1 ORDER BY name",
    )?;
    let v = stmt
        .query_map([attempt], |r| {
            Ok(Artifact {
                name: r.get(0)?,
                digest: r.get(1)?,
                size: u64::try_from(r.get::<_, i64>(2)?).unwrap_or(0),
            })
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(v)
}

fn attempts_where(
    conn: &Connection,
    clause: &str,
    p: impl rusqlite::Params,
) -> Result<Vec<RolloutAttempt>, StoreError> {
    let mut stmt = conn.prepare_cached(&format!("{ATTEMPT_SQL} WHERE {clause}"))?;
    let mut rows = stmt.query(p)?;
    let mut out = Vec::new();
    while let Some(r) = rows.next()? {
        out.push(attempt_row(conn, r)?);
    }
    Ok(out)
}

pub(crate) fn get_rollout(conn: &Connection, id: i64) -> Result<RolloutAttempt, StoreError> {
    attempts_where(conn, "a.id = ?1", [id])?
        .pop()
        .ok_or_else(|| {
            StoreError::NotFound(format!(
                "rollout attempt {id} does not exist (a run's attempts: `layerstack rollout attempts RUN`)"
            ))
        })
}

/// The running rollout attempt of session `sid`, if it is one.
pub(crate) fn rollout_of_session(
    conn: &Connection,
    sid: SessionId,
) -> Result<Option<RolloutAttempt>, StoreError> {
    Ok(attempts_where(conn, "a.session_id = ?1 AND a.status = 'running'", [sid])?.pop())
}

/// Attempt `id`'s recorded commands as a JSON array (`None`: none).
fn recorded_trajectory(conn: &Connection, id: i64) -> Result<Option<Vec<u8>>, StoreError> {
    let mut stmt =
        conn.prepare_cached("SELECT record FROM rollout_execs WHERE attempt_id = ?1 ORDER BY seq")?;
    let records = stmt
        .query_map([id], |r| r.get::<_, String>(0))?
        .collect::<Result<Vec<String>, _>>()?;
    if records.is_empty() {
        return Ok(None);
    }
    Ok(Some(format!("[{}]", records.join(",")).into_bytes()))
}

fn get_run(conn: &Connection, name: &str) -> Result<RunInfo, StoreError> {
    conn.one(
        "SELECT name, grp, labels, created_ns FROM rollout_runs WHERE name = ?1",
        [name],
        |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, String>(2)?, r.get::<_, i64>(3)?)),
    )
    .optional()?
    .map(|(name, graph, labels, created_ns)| {
        let labels = serde_json::from_str(&labels)
            .map_err(|e| StoreError::corrupt("rollout_runs", &name, format!("labels: {e}")))?;
        Ok::<_, StoreError>(RunInfo { name, graph, labels, created_ns })
    })
    .transpose()?
    .ok_or_else(|| {
        StoreError::NotFound(format!(
            "rollout run {name:?} does not exist: create it first (CreateRun, `layerstack rollout create`)"
        ))
    })
}

fn sample_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SampleInfo> {
    Ok(SampleInfo {
        key: SampleKey {
            run: r.get("run")?,
            step: r.get("step")?,
            prompt: r.get("prompt")?,
            sample: r.get("sample")?,
        },
        node: r.get("node")?,
        reward: r.get("reward")?,
        reward_attempt: r
            .get::<_, Option<i64>>("reward_no")?
            .and_then(|n| u32::try_from(n).ok()),
        attempts: u32::try_from(r.get::<_, i64>("attempts")?).unwrap_or(u32::MAX),
        max_attempt: u32::try_from(r.get::<_, i64>("max_attempt")?).unwrap_or(u32::MAX),
        running: r
            .get::<_, Option<String>>("running")?
            .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
            .unwrap_or_default(),
        task_failed_attempt: r
            .get::<_, Option<i64>>("task_failed_no")?
            .and_then(|n| u32::try_from(n).ok()),
        created_ns: r.get("created_ns")?,
    })
}

const SAMPLE_SQL: &str = "SELECT s.run, s.step, s.prompt, s.sample, s.node, s.reward, s.created_ns,
        (SELECT attempt FROM rollout_attempts WHERE id = s.reward_attempt) AS reward_no,
        (SELECT count(*) FROM rollout_attempts WHERE sample_id = s.id) AS attempts,
        (SELECT coalesce(max(attempt), 0) FROM rollout_attempts WHERE sample_id = s.id) AS max_attempt,
        (SELECT group_concat(id) FROM rollout_attempts WHERE sample_id = s.id AND status = 'running') AS running,
        (SELECT min(attempt) FROM rollout_attempts WHERE sample_id = s.id AND status = 'task_failed') AS task_failed_no
     FROM rollout_samples s";

fn validate_key(k: &SampleKey) -> Result<(), StoreError> {
    if k.run.is_empty() || k.prompt.is_empty() {
        return Err(StoreError::InvalidArgument(format!(
            "sample {k}: run and prompt must not be empty"
        )));
    }
    if k.step < 0 || k.sample < 0 {
        return Err(StoreError::InvalidArgument(format!(
            "sample {k}: step and sample are numbers from 0"
        )));
    }
    Ok(())
}

/// Ends running attempts whose sandbox an infrastructure failure ended:
/// their graph attempt ended `interrupted` (kind: the session's
/// `interrupted_by`), `abandoned` or `failed` (a checkpoint that failed), or
/// (`at_start`) they never got a session before the daemon stopped. Returns
/// how many ended. Never gives a reward. A remote attempt (a worker's) is
/// never ended here: nothing of it lived in this daemon; its harness ends it
/// (`infra_failed(node-lost)` when its worker is lost).
pub(crate) fn sync_rollouts_in(tx: &Transaction<'_>, at_start: bool) -> Result<usize, StoreError> {
    let now = now_ns();
    let mut n = tx.exec(
        "UPDATE rollout_attempts SET status = 'infra_failed', ended_ns = ?1,
            infra_kind = (SELECT CASE g.status
                    WHEN 'interrupted' THEN coalesce((SELECT p.interrupted_by FROM sessions s JOIN publishes p ON p.id = s.last_publish WHERE s.id = g.session_id), 'interrupted')
                    WHEN 'failed' THEN 'checkpoint-failed'
                    ELSE 'abandoned' END
                FROM graph_attempts g WHERE g.id = rollout_attempts.graph_attempt),
            message = 'its sandbox ended without the attempt ending: ' || (SELECT coalesce(g.message, g.status) FROM graph_attempts g WHERE g.id = rollout_attempts.graph_attempt)
         WHERE status = 'running' AND graph_attempt IN
            (SELECT id FROM graph_attempts WHERE status IN ('interrupted', 'abandoned', 'failed'))",
        [now],
    )?;
    if at_start {
        n += tx.exec(
            "UPDATE rollout_attempts SET status = 'infra_failed', infra_kind = 'daemon-restart', ended_ns = ?1,
                message = 'the daemon stopped before the attempt had a sandbox'
             WHERE status = 'running' AND session_id IS NULL AND worker IS NULL",
            [now],
        )?;
    }
    Ok(n)
}

/// Ends rollout attempt `id` with `end` inside `tx` (see the module docs):
/// the attempt's end, its sample's reward (when it has none yet) and the
/// backpropagation, in the caller's transaction. `result_node`: the checkpoint
/// kept for it (made in the same transaction, or earlier for grading).
///
/// A repeated end of an ended attempt with the same result answers it as
/// recorded (`Ok`, nothing written); with another result it is refused
/// (`FailedPrecondition`).
pub(crate) fn end_rollout_in(
    tx: &Transaction<'_>,
    id: i64,
    end: &RolloutEnding,
    result_node: Option<&str>,
    keep: EndKeep,
) -> Result<RolloutAttempt, StoreError> {
    let a = get_rollout(tx, id)?;
    if a.status != RolloutStatus::Running {
        let recorded_keep: Option<String> = tx.one(
            "SELECT end_keep FROM rollout_attempts WHERE id = ?1",
            [id],
            |r| r.get(0),
        )?;
        match recorded_keep.as_deref().map(|k| (k, EndKeep::parse(k))) {
            Some((_, Some(k))) if k != keep => {
                return Err(StoreError::FailedPrecondition(format!(
                    "rollout attempt {id} ({} attempt {}) ended already with keep {}{}: an attempt ends once, and a repeated end must ask the same (keep {})",
                    a.key,
                    a.attempt,
                    k.as_str().to_uppercase(),
                    match (k, &a.result_node) {
                        (EndKeep::Discard, _) => " — its sandbox's writes were dropped, so no checkpoint can be kept now".to_string(),
                        (EndKeep::Checkpoint, Some(n)) => format!(" — node {n} is its checkpoint and stays"),
                        (EndKeep::Checkpoint, None) => String::new(),
                    },
                    k.as_str().to_uppercase(),
                )));
            }
            Some((raw, None)) => {
                return Err(StoreError::corrupt(
                    "rollout_attempts",
                    &id.to_string(),
                    format!("end_keep {raw:?} is not checkpoint or discard"),
                ))
            }
            _ => {}
        }
        // A repeat is the same result: status, reward and acceptance,
        // evaluator and backpropagated value (message, trajectory and
        // artifacts are the first end's).
        let evaluator = |e: Option<&Evaluator>| e.filter(|e| **e != Evaluator::default()).cloned();
        let same = a.status == end.result.status()
            && match &end.result {
                RolloutResult::Completed { reward, accepted } => {
                    a.reward == Some(*reward) && a.accepted == Some(*accepted)
                }
                RolloutResult::InfraFailed { kind } => a.infra_kind.as_deref() == Some(kind),
                RolloutResult::TaskFailed => true,
            }
            && evaluator(a.evaluator.as_ref()) == evaluator(end.evaluator.as_ref())
            && a.backprop == end.backprop;
        if same {
            return Ok(a);
        }
        let recorded = match a.status {
            RolloutStatus::Completed => format!(
                "completed (reward {}, {}{}{})",
                a.reward.unwrap_or_default(),
                if a.accepted == Some(false) {
                    "rejected"
                } else {
                    "accepted"
                },
                a.evaluator
                    .as_ref()
                    .map(|e| format!(", evaluator {}:{}", e.name, e.version))
                    .unwrap_or_default(),
                a.backprop
                    .map(|b| format!(", backprop {b}"))
                    .unwrap_or_default(),
            ),
            s => format!(
                "{}{}",
                s.as_str(),
                a.infra_kind
                    .as_ref()
                    .map(|k| format!("({k})"))
                    .unwrap_or_default()
            ),
        };
        return Err(StoreError::FailedPrecondition(format!(
            "rollout attempt {id} ({} attempt {}) ended already as {recorded}: an attempt ends once, and a repeated end must give the same result; another result needs a new attempt of the sample (the sample's reward, once applied, stays)",
            a.key, a.attempt,
        )));
    }
    if let RolloutResult::InfraFailed { kind } = &end.result {
        if kind.is_empty() {
            return Err(StoreError::InvalidArgument(
                "infra_failed needs a kind (e.g. sandbox-start, timeout, node-lost)".into(),
            ));
        }
        if end.backprop.is_some() {
            return Err(StoreError::InvalidArgument(format!(
                "rollout attempt {id}: an infra_failed attempt has no value to backpropagate: end it without backprop"
            )));
        }
    }
    if let RolloutResult::Completed { reward, .. } = &end.result {
        if !reward.is_finite() {
            return Err(StoreError::InvalidArgument(format!(
                "rollout attempt {id}: reward {reward} is not a finite number"
            )));
        }
    }
    if let Some(v) = end.backprop {
        if !v.is_finite() {
            return Err(StoreError::InvalidArgument(format!(
                "rollout attempt {id}: backprop value {v} is not a finite number"
            )));
        }
    }
    let now = now_ns();
    let (reward, accepted, infra) = match &end.result {
        RolloutResult::Completed { reward, accepted } => (Some(*reward), Some(*accepted), None),
        RolloutResult::TaskFailed => (None, None, None),
        RolloutResult::InfraFailed { kind } => (None, None, Some(kind.as_str())),
    };
    let ev = end.evaluator.as_ref();
    tx.exec(
        "UPDATE rollout_attempts SET status = ?2, infra_kind = ?3, reward = ?4, accepted = ?5, evaluator_name = ?6, evaluator_version = ?7, evaluator_digest = ?8, result_node = coalesce(?9, result_node), trajectory = ?10, message = ?11, ended_ns = ?12, end_keep = ?13 WHERE id = ?1 AND status = 'running'",
        params![
            id,
            end.result.status().as_str(),
            infra,
            reward,
            accepted.map(i64::from),
            ev.map(|e| e.name.as_str()),
            ev.map(|e| e.version.as_str()),
            ev.map(|e| e.digest.as_str()),
            result_node,
            end.trajectory,
            end.message,
            now,
            keep.as_str()
        ],
    )?;
    // A trajectory from the harness replaces the daemon's record of its
    // commands. Without one the rows stay: the attempt is no longer
    // running, so no command is added to them, and the fold after the end
    // (`Store::fold_rollout_execs_of`) makes them its trajectory whole —
    // commands that ended while the end ran included.
    if end.trajectory.is_some() {
        tx.exec("DELETE FROM rollout_execs WHERE attempt_id = ?1", [id])?;
    }
    for art in &end.artifacts {
        tx.exec(
            "INSERT INTO rollout_artifacts(attempt_id, name, digest, size) VALUES (?1, ?2, ?3, ?4)",
            params![
                id,
                art.name,
                art.digest,
                i64::try_from(art.size).unwrap_or(i64::MAX)
            ],
        )?;
    }
    if let Some(r) = reward {
        // The sample's reward: once, by the first completed attempt.
        let applied = tx.exec(
            "UPDATE rollout_samples SET reward = ?2, reward_attempt = ?3 WHERE id = (SELECT sample_id FROM rollout_attempts WHERE id = ?1) AND reward_attempt IS NULL",
            params![id, r, id],
        )?;
        if applied == 1 {
            tx.exec(
                "UPDATE rollout_attempts SET applied = 1 WHERE id = ?1",
                [id],
            )?;
        }
    }
    if let Some(v) = end.backprop {
        let leaf = result_node
            .map(str::to_string)
            .or(a.result_node.clone())
            .unwrap_or(a.node.clone());
        let nodes = backpropagate(tx, &leaf, v, now)?;
        tx.exec(
            "INSERT INTO search_backprops(attempt_id, leaf, value, nodes, at_ns) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![id, leaf, v, nodes, now],
        )?;
    }
    get_rollout(tx, id)
}

/// Adds one visit and `value` to `leaf` and each ancestor through first
/// parents up to the graph's root. Returns how many nodes it updated.
fn backpropagate(
    tx: &Transaction<'_>,
    leaf: &str,
    value: f64,
    now: i64,
) -> Result<i64, StoreError> {
    let mut node = Some(leaf.to_string());
    let mut n = 0;
    while let Some(id) = node {
        tx.exec(
            "INSERT INTO search_stats(node, visits, value_sum, updated_ns) VALUES (?1, 1, ?2, ?3)
             ON CONFLICT(node) DO UPDATE SET visits = visits + 1, value_sum = value_sum + excluded.value_sum, updated_ns = excluded.updated_ns",
            params![id, value, now],
        )?;
        n += 1;
        node = tx
            .one(
                "SELECT parent FROM graph_edges WHERE child = ?1 AND pos = 0",
                [&id],
                |r| r.get(0),
            )
            .optional()?;
        if n > 1_000_000 {
            return Err(StoreError::corrupt(
                "graph_edges",
                leaf,
                "a parent chain longer than 10^6 (a cycle?)",
            ));
        }
    }
    Ok(n)
}

/// Holders of frontier leases on `node`, by name (prune refuses while there
/// are any).
pub(crate) fn frontier_holders(conn: &Connection, node: &str) -> Result<Vec<String>, StoreError> {
    let mut stmt =
        conn.prepare_cached("SELECT holder FROM frontier_leases WHERE node = ?1 ORDER BY holder")?;
    let v = stmt
        .query_map([node], |r| r.get(0))?
        .collect::<Result<Vec<String>, _>>()?;
    Ok(v)
}

fn stats_of(conn: &Connection, node: &str) -> Result<NodeStats, StoreError> {
    let (visits, value_sum, prior) = conn
        .one(
            "SELECT visits, value_sum, prior FROM search_stats WHERE node = ?1",
            [node],
            |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, f64>(1)?,
                    r.get::<_, Option<f64>>(2)?,
                ))
            },
        )
        .optional()?
        .unwrap_or((0, 0.0, None));
    Ok(NodeStats {
        node: node.to_string(),
        visits: u64::try_from(visits).unwrap_or(0),
        value_sum,
        prior,
        frontier: frontier_holders(conn, node)?,
    })
}

impl Store {
    /// Creates run `name` over graph `graph`; the same name and graph again
    /// answers the run as it is.
    ///
    /// Errors: `NotFound` (graph), `AlreadyExists` (the name is a run over
    /// another graph), `InvalidArgument` (empty, over 256 bytes, a control
    /// character).
    pub fn create_run(
        &self,
        name: &str,
        graph: &str,
        labels: &BTreeMap<String, String>,
    ) -> Result<(RunInfo, bool), StoreError> {
        if name.is_empty() || name.len() > 256 || name.contains(char::is_control) {
            // Control characters: a name is printed in listings and logs,
            // where an escape sequence would steer the terminal.
            return Err(StoreError::InvalidArgument(format!(
                "run name {name:?}: give 1 to 256 bytes without control characters"
            )));
        }
        self.db.write(|tx| {
            crate::graph::get_group(tx, graph)?;
            if let Ok(r) = get_run(tx, name) {
                if r.graph != graph {
                    return Err(StoreError::AlreadyExists(format!(
                        "rollout run {name:?} exists over graph {:?}, not {graph:?}: choose another run name",
                        r.graph
                    )));
                }
                return Ok((r, false));
            }
            let labels_json = serde_json::to_string(labels)
                .map_err(|e| StoreError::InvalidArgument(format!("labels: {e}")))?;
            tx.exec(
                "INSERT INTO rollout_runs(name, grp, labels, created_ns) VALUES (?1, ?2, ?3, ?4)",
                params![name, graph, labels_json, now_ns()],
            )?;
            Ok((get_run(tx, name)?, true))
        })
    }

    /// Run `name`. Errors: `NotFound`.
    pub fn run(&self, name: &str) -> Result<RunInfo, StoreError> {
        self.db.read(|conn| get_run(conn, name))
    }

    /// Every run, by name.
    pub fn runs(&self) -> Result<Vec<RunInfo>, StoreError> {
        self.db.read(|conn| {
            let names: Vec<String> = {
                let mut stmt =
                    conn.prepare_cached("SELECT name FROM rollout_runs ORDER BY name")?;
                let v = stmt
                    .query_map([], |r| r.get(0))?
                    .collect::<Result<_, _>>()?;
                v
            };
            names.iter().map(|n| get_run(conn, n)).collect()
        })
    }

    /// Starts attempt `b.attempt` of sample `b.key` from node `b.node` — or
    /// answers it again (same arguments), or answers that the sample has its
    /// reward already (no attempt is started then). The attempt's sandbox is
    /// attached afterwards ([`Store::attach_rollout_session`]).
    ///
    /// Errors: `NotFound` (run, node), `FailedPrecondition` (the sample
    /// started from another node, the attempt exists with other arguments,
    /// the node is not in the run's graph), `InvalidArgument`.
    pub fn begin_rollout(&self, b: &RolloutBegin) -> Result<Begun, StoreError> {
        validate_key(&b.key)?;
        if b.attempt == 0 {
            return Err(StoreError::InvalidArgument(format!(
                "sample {}: attempts are numbered from 1",
                b.key
            )));
        }
        if let Some(w) = &b.worker {
            if w.is_empty() || w.len() > 256 || w.contains(char::is_control) {
                return Err(StoreError::InvalidArgument(format!(
                    "worker {w:?}: give 1 to 256 bytes without control characters (e.g. the Ray node id)"
                )));
            }
        }
        self.db.write(|tx| {
            sync_rollouts_in(tx, false)?;
            let run = get_run(tx, &b.key.run)?;
            let node = get_node(tx, &b.node)?;
            if node.group != run.graph {
                return Err(StoreError::FailedPrecondition(format!(
                    "node {} is in graph {:?}, run {:?} is over graph {:?}: start from a node of the run's graph",
                    b.node, node.group, run.name, run.graph
                )));
            }
            if node.pruned {
                return Err(StoreError::FailedPrecondition(format!(
                    "node {} was pruned: start from a node that is not",
                    b.node
                )));
            }
            let k = &b.key;
            tx.exec(
                "INSERT OR IGNORE INTO rollout_samples(run, step, prompt, sample, node, created_ns) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![k.run, k.step, k.prompt, k.sample, b.node, now_ns()],
            )?;
            let (sample_id, sample_node): (i64, String) = tx.one(
                "SELECT id, node FROM rollout_samples WHERE run = ?1 AND step = ?2 AND prompt = ?3 AND sample = ?4",
                params![k.run, k.step, k.prompt, k.sample],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?;
            if sample_node != b.node {
                return Err(StoreError::FailedPrecondition(format!(
                    "sample {k} starts from node {sample_node}, not {}: every attempt of a sample starts from its node",
                    b.node
                )));
            }
            let existing: Option<i64> = tx
                .one(
                    "SELECT id FROM rollout_attempts WHERE sample_id = ?1 AND attempt = ?2",
                    params![sample_id, b.attempt],
                    |r| r.get(0),
                )
                .optional()?;
            if let Some(id) = existing {
                let a = get_rollout(tx, id)?;
                if a.policy != b.policy || a.seed != b.seed {
                    let seed = |s: Option<i64>| s.map_or("none".to_string(), |s| s.to_string());
                    return Err(StoreError::FailedPrecondition(format!(
                        "sample {k} attempt {} exists with policy {:?} seed {}, asked with policy {:?} seed {}: a repeated call names the same attempt; a retry is a new attempt number",
                        b.attempt, a.policy, seed(a.seed), b.policy, seed(b.seed)
                    )));
                }
                if a.worker != b.worker {
                    let on = |w: &Option<String>| match w {
                        Some(w) => format!("on worker {w:?}"),
                        None => "locally (no worker)".to_string(),
                    };
                    return Err(StoreError::FailedPrecondition(format!(
                        "sample {k} attempt {} exists {}, asked {}: a repeated call names the same attempt; a retry on another worker is a new attempt number",
                        b.attempt, on(&a.worker), on(&b.worker)
                    )));
                }
                return Ok(Begun::Attempt { attempt: a, created: false });
            }
            let sample = tx.one(&format!("{SAMPLE_SQL} WHERE s.id = ?1"), [sample_id], sample_row)?;
            if sample.reward.is_some() {
                return Ok(Begun::Rewarded(sample));
            }
            tx.exec(
                "INSERT INTO rollout_attempts(sample_id, attempt, policy, seed, worker, status, created_ns) VALUES (?1, ?2, ?3, ?4, ?5, 'running', ?6)",
                params![sample_id, b.attempt, b.policy, b.seed, b.worker, now_ns()],
            )?;
            let id = tx.last_insert_rowid();
            info!(rollout.attempt = id, sample = %k, attempt = b.attempt, worker = ?b.worker, "rollout attempt begun");
            Ok(Begun::Attempt { attempt: get_rollout(tx, id)?, created: true })
        })
    }

    /// Records the sandbox session (and its graph attempt) of rollout attempt
    /// `id`. Errors: `FailedPrecondition` (another session is recorded, or the
    /// attempt ended).
    pub fn attach_rollout_session(
        &self,
        id: i64,
        sid: SessionId,
        graph_attempt: Option<i64>,
    ) -> Result<RolloutAttempt, StoreError> {
        self.db.write(|tx| {
            let a = get_rollout(tx, id)?;
            if let Some(w) = &a.worker {
                return Err(StoreError::FailedPrecondition(format!(
                    "rollout attempt {id} runs on worker {w:?}: a remote attempt has no sandbox in this store"
                )));
            }
            match a.session {
                Some(s) if s == sid => return Ok(a),
                Some(s) => {
                    return Err(StoreError::FailedPrecondition(format!(
                        "rollout attempt {id} runs in session {s}, not {sid}"
                    )))
                }
                None => {}
            }
            if a.status != RolloutStatus::Running {
                return Err(StoreError::FailedPrecondition(format!(
                    "rollout attempt {id} ended ({}) before its sandbox started",
                    a.status.as_str()
                )));
            }
            tx.exec(
                "UPDATE rollout_attempts SET session_id = ?2, graph_attempt = ?3 WHERE id = ?1",
                params![id, sid, graph_attempt],
            )?;
            get_rollout(tx, id)
        })
    }

    /// Ends rollout attempt `id` outside a checkpoint (its session ended
    /// before — a checkpoint kept for grading, or none —, or is discarded
    /// next: [`Disposition`]), in one transaction: see the module docs.
    /// A checkpoint the attempt made is pruned after it with
    /// [`Disposition::Prune`] (a rejected result).
    ///
    /// Errors: `NotFound`, `FailedPrecondition` (ended otherwise before; its
    /// session still runs and `how` is not `Discard` — end it through the
    /// session so that its checkpoint is part of the same transaction),
    /// `InvalidArgument`.
    pub fn end_rollout(
        &self,
        id: i64,
        end: &RolloutEnding,
        how: Disposition,
    ) -> Result<RolloutAttempt, StoreError> {
        let discard_node = how == Disposition::Prune;
        let out = self.db.write(|tx| {
            sync_rollouts_in(tx, false)?;
            let a = get_rollout(tx, id)?;
            let ga = match a.graph_attempt {
                Some(g) => Some(
                    tx.one(
                        "SELECT status, result_node FROM graph_attempts WHERE id = ?1",
                        [g],
                        |r| Ok((r.get::<_, String>(0)?, r.get::<_, Option<String>>(1)?)),
                    )
                    .optional()?,
                )
                .flatten(),
                None => None,
            };
            if a.status == RolloutStatus::Running {
                if let Some((status, _)) = &ga {
                    if status == "running" && how != Disposition::Discard {
                        return Err(StoreError::FailedPrecondition(format!(
                            "rollout attempt {id}'s sandbox (session {}) still runs: end the attempt through its session (EndRollout with the session's close), or close the session first",
                            a.session.unwrap_or_default()
                        )));
                    }
                }
            }
            if a.status != RolloutStatus::Running {
                // A repeat: it answers the recorded end (or refuses another)
                // and changes nothing — above all, it never prunes the
                // checkpoint the first end kept.
                match (&a.result_node, how) {
                    // (A rejected result's node, pruned by its end: a repeat
                    // of that discard is the same end.)
                    (Some(n), Disposition::Prune | Disposition::Discard)
                        if !get_node(tx, n).is_ok_and(|node| node.pruned) =>
                    {
                        return Err(StoreError::FailedPrecondition(format!(
                            "rollout attempt {id} ({} attempt {}) ended already keeping node {n}: an attempt ends once, and a repeated end must keep it too (keep CHECKPOINT); the node stays",
                            a.key, a.attempt
                        )));
                    }
                    _ => return Ok((end_rollout_in(tx, id, end, None, how.keep())?, None)),
                }
            }
            let node = ga.and_then(|(_, n)| n);
            let kept = if discard_node { None } else { node.clone() };
            let out = end_rollout_in(tx, id, end, kept.as_deref(), how.keep())?;
            Ok((out, if discard_node { node } else { None }))
        })?;
        let (attempt, prune) = out;
        if let Some(n) = prune {
            // A rejected result's checkpoint: no other reference keeps it.
            if let Err(e) = self.prune_node(&n, None) {
                info!(node = %n, error = %e, "a rejected attempt's checkpoint stays (something else reaches it)");
            }
        }
        Ok(attempt)
    }

    /// Ends rollout attempt `id` — a remote one (begun with a worker) — with
    /// `end`, keeping `result_node` as its checkpoint, in one transaction
    /// ([`end_rollout_in`]: the attempt's end, its sample's reward when it
    /// has none, the backpropagation from `result_node`). `result_node` is
    /// the node the worker checkpointed and the caller pulled into this
    /// store (node ids are global): it must exist, not be pruned, and have
    /// the attempt's start node as a parent. A repeated end with the same
    /// result and node answers the recorded end.
    ///
    /// Errors: `NotFound` (attempt, node), `FailedPrecondition` (a local
    /// attempt — its checkpoint is its sandbox's —, a node that is not a
    /// child of the attempt's node or was pruned, an attempt that ended
    /// otherwise or with another node), `InvalidArgument` (a result node
    /// with an `infra_failed` end, or with `keep` [`EndKeep::Discard`]).
    /// `keep` is recorded with the end: a repeat asking otherwise is refused.
    pub fn end_remote_rollout(
        &self,
        id: i64,
        end: &RolloutEnding,
        result_node: Option<&str>,
        keep: EndKeep,
    ) -> Result<RolloutAttempt, StoreError> {
        if result_node.is_some() && keep == EndKeep::Discard {
            return Err(discard_with_node(id));
        }
        self.db.write(|tx| {
            let a = get_rollout(tx, id)?;
            let Some(worker) = a.worker.as_deref() else {
                return Err(StoreError::FailedPrecondition(format!(
                    "rollout attempt {id} is local (it has no worker): its checkpoint is its sandbox's; end it without result_node"
                )));
            };
            let Some(rn) = result_node else {
                return end_rollout_in(tx, id, end, None, keep);
            };
            if matches!(end.result, RolloutResult::InfraFailed { .. }) {
                return Err(StoreError::InvalidArgument(format!(
                    "rollout attempt {id}: an infra_failed attempt keeps no checkpoint: end it without result_node"
                )));
            }
            if a.status != RolloutStatus::Running && a.result_node.as_deref() != Some(rn) {
                return Err(StoreError::FailedPrecondition(format!(
                    "rollout attempt {id} ended already keeping node {}, not {rn}: an attempt ends once",
                    a.result_node.as_deref().unwrap_or("(none)")
                )));
            }
            let node = get_node(tx, rn).map_err(|e| match e {
                StoreError::NotFound(_) => StoreError::NotFound(format!(
                    "result node {rn} of rollout attempt {id} (worker {worker:?}) is not in this store: pull it first (Pull / `layerstack pull` of the reference the worker pushed)"
                )),
                e => e,
            })?;
            if !node.parents.iter().any(|p| p == &a.node) {
                return Err(StoreError::FailedPrecondition(format!(
                    "result node {rn} is not a child of rollout attempt {id}'s node {} (its parents: {}): give the checkpoint the worker made from the attempt's node",
                    a.node,
                    if node.parents.is_empty() { "none".to_string() } else { node.parents.join(", ") }
                )));
            }
            if node.pruned {
                return Err(StoreError::FailedPrecondition(format!(
                    "result node {rn} was pruned: a pruned node cannot be an attempt's checkpoint; pull it again"
                )));
            }
            end_rollout_in(tx, id, end, Some(rn), keep)
        })
    }

    /// Rollout attempt `id`. Errors: `NotFound`.
    pub fn rollout(&self, id: i64) -> Result<RolloutAttempt, StoreError> {
        self.db.read(|conn| get_rollout(conn, id))
    }

    /// The running rollout attempt of session `sid`, if it is one.
    pub fn rollout_of_session(&self, sid: SessionId) -> Result<Option<RolloutAttempt>, StoreError> {
        self.db.read(|conn| rollout_of_session(conn, sid))
    }

    /// The attempts of run `run` (of `step` when given), in (step, prompt,
    /// sample, attempt) order, from after `after` (an attempt id; 0 = from the
    /// start), at most `limit`.
    pub fn rollouts(
        &self,
        run: &str,
        step: Option<i64>,
        after: i64,
        limit: usize,
    ) -> Result<Vec<RolloutAttempt>, StoreError> {
        self.db.read(|conn| {
            get_run(conn, run)?;
            let lim = i64::try_from(limit).unwrap_or(i64::MAX);
            attempts_where(
                conn,
                "s.run = ?1 AND (?2 IS NULL OR s.step = ?2) AND a.id > ?3 ORDER BY a.id LIMIT ?4",
                params![run, step, after, lim],
            )
        })
    }

    /// Sample `key`. Errors: `NotFound`.
    pub fn sample(&self, key: &SampleKey) -> Result<SampleInfo, StoreError> {
        self.db.read(|conn| {
            conn.one(
                &format!("{SAMPLE_SQL} WHERE s.run = ?1 AND s.step = ?2 AND s.prompt = ?3 AND s.sample = ?4"),
                params![key.run, key.step, key.prompt, key.sample],
                sample_row,
            )
            .optional()?
            .ok_or_else(|| StoreError::NotFound(format!("sample {key} has no attempt yet")))
        })
    }

    /// Ends attempts whose sandbox an infrastructure failure ended (at start:
    /// also those that never got one). Returns how many.
    pub fn sync_rollouts(&self, at_start: bool) -> Result<usize, StoreError> {
        self.db.write(|tx| sync_rollouts_in(tx, at_start))
    }

    /// Sandbox sessions of ended rollout attempts that are not released yet
    /// (an attempt an infrastructure failure ended, whose session kept its
    /// upper): the engine discards them, nothing else will.
    pub fn ended_rollout_sessions(&self) -> Result<Vec<SessionId>, StoreError> {
        self.db.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT DISTINCT a.session_id FROM rollout_attempts a JOIN sessions s ON s.id = a.session_id
                 WHERE a.status <> 'running' AND s.released = 0 ORDER BY a.session_id",
            )?;
            let v = stmt.query_map([], |r| r.get(0))?.collect::<Result<Vec<SessionId>, _>>()?;
            Ok(v)
        })
    }

    /// Checks run `run`'s exactly-once invariants and counts its records.
    pub fn audit_run(&self, run: &str) -> Result<RunAudit, StoreError> {
        self.db.read(|conn| {
            get_run(conn, run)?;
            let mut a = RunAudit::default();
            let c = |sql: &str| -> Result<u64, StoreError> {
                Ok(u64::try_from(conn.one(sql, [run], |r| r.get::<_, i64>(0))?).unwrap_or(0))
            };
            a.samples = c("SELECT count(*) FROM rollout_samples WHERE run = ?1")?;
            a.rewarded = c("SELECT count(*) FROM rollout_samples WHERE run = ?1 AND reward IS NOT NULL")?;
            let of = "FROM rollout_attempts a JOIN rollout_samples s ON s.id = a.sample_id WHERE s.run = ?1";
            a.attempts = c(&format!("SELECT count(*) {of}"))?;
            a.running = c(&format!("SELECT count(*) {of} AND a.status = 'running'"))?;
            a.completed = c(&format!("SELECT count(*) {of} AND a.status = 'completed'"))?;
            a.task_failed = c(&format!("SELECT count(*) {of} AND a.status = 'task_failed'"))?;
            a.backprops = c(
                "SELECT count(*) FROM search_backprops b JOIN rollout_attempts a ON a.id = b.attempt_id JOIN rollout_samples s ON s.id = a.sample_id WHERE s.run = ?1",
            )?;
            {
                let mut stmt = conn.prepare_cached(&format!(
                    "SELECT a.infra_kind, count(*) {of} AND a.status = 'infra_failed' GROUP BY a.infra_kind"
                ))?;
                for r in stmt.query_map([run], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))? {
                    let (k, n) = r?;
                    a.infra_failed.insert(k, u64::try_from(n).unwrap_or(0));
                }
            }
            {
                let mut stmt = conn.prepare_cached(&format!(
                    "SELECT a.worker, count(*) {of} AND a.worker IS NOT NULL GROUP BY a.worker"
                ))?;
                for r in stmt.query_map([run], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))? {
                    let (w, n) = r?;
                    a.by_worker.insert(w, u64::try_from(n).unwrap_or(0));
                }
            }
            let mut v = |sql: &str, what: &str| -> Result<(), StoreError> {
                let mut stmt = conn.prepare_cached(sql)?;
                for r in stmt.query_map([run], |r| r.get::<_, String>(0))? {
                    a.violations.push(format!("{what}: {}", r?));
                }
                Ok(())
            };
            v(
                "SELECT s.run || '/' || s.step || '/' || s.prompt || '/' || s.sample FROM rollout_samples s WHERE s.run = ?1 AND (SELECT count(*) FROM rollout_attempts a WHERE a.sample_id = s.id AND a.applied = 1) > 1",
                "a sample with more than one applied reward",
            )?;
            v(
                "SELECT s.run || '/' || s.step || '/' || s.prompt || '/' || s.sample FROM rollout_samples s LEFT JOIN rollout_attempts a ON a.id = s.reward_attempt WHERE s.run = ?1 AND s.reward IS NOT NULL AND (a.id IS NULL OR a.applied = 0 OR a.status <> 'completed' OR a.reward IS NOT s.reward OR a.sample_id <> s.id)",
                "a sample whose reward is not its applied attempt's",
            )?;
            v(
                "SELECT s.run || '/' || s.step || '/' || s.prompt || '/' || s.sample FROM rollout_samples s WHERE s.run = ?1 AND s.reward IS NULL AND EXISTS (SELECT 1 FROM rollout_attempts a WHERE a.sample_id = s.id AND a.status = 'completed')",
                "a sample with a completed attempt and no reward",
            )?;
            v(
                "SELECT a.id FROM rollout_attempts a JOIN rollout_samples s ON s.id = a.sample_id JOIN search_backprops b ON b.attempt_id = a.id WHERE s.run = ?1 AND a.status NOT IN ('completed', 'task_failed')",
                "a backpropagation of an attempt that did not end with a value",
            )?;
            Ok(a)
        })
    }

    /// Search statistics of `node` (zero visits when it has none).
    /// Errors: `NotFound`.
    pub fn node_stats(&self, node: &str) -> Result<NodeStats, StoreError> {
        self.db.read(|conn| {
            get_node(conn, node)?;
            stats_of(conn, node)
        })
    }

    /// Statistics of `node`'s children (nodes whose first parent it is), by id.
    pub fn children_stats(&self, node: &str) -> Result<Vec<NodeStats>, StoreError> {
        self.db.read(|conn| {
            get_node(conn, node)?;
            let kids: Vec<String> = {
                let mut stmt = conn.prepare_cached(
                    "SELECT e.child FROM graph_edges e JOIN graph_nodes n ON n.id = e.child WHERE e.parent = ?1 AND e.pos = 0 AND n.pruned = 0 ORDER BY e.child",
                )?;
                let v = stmt.query_map([node], |r| r.get(0))?.collect::<Result<_, _>>()?;
                v
            };
            kids.iter().map(|k| stats_of(conn, k)).collect()
        })
    }

    /// Sets `node`'s prior (a policy's probability of the action that made it).
    /// Errors: `NotFound`, `InvalidArgument` (not finite).
    pub fn set_prior(&self, node: &str, prior: f64) -> Result<NodeStats, StoreError> {
        if !prior.is_finite() || prior < 0.0 {
            return Err(StoreError::InvalidArgument(format!(
                "prior {prior} is not a finite number of 0 or more: a prior is a policy's probability (PUCT's P), or any non-negative weight"
            )));
        }
        self.db.write(|tx| {
            get_node(tx, node)?;
            tx.exec(
                "INSERT INTO search_stats(node, prior, updated_ns) VALUES (?1, ?2, ?3)
                 ON CONFLICT(node) DO UPDATE SET prior = excluded.prior, updated_ns = excluded.updated_ns",
                params![node, prior, now_ns()],
            )?;
            stats_of(tx, node)
        })
    }

    /// Leases `nodes` to frontier `holder` (idempotent): a leased node is
    /// never pruned, so never collected, until released.
    /// Errors: `NotFound`, `FailedPrecondition` (a pruned node).
    pub fn lease_frontier(&self, holder: &str, nodes: &[String]) -> Result<(), StoreError> {
        if holder.is_empty() {
            return Err(StoreError::InvalidArgument(
                "a frontier lease needs a holder name".into(),
            ));
        }
        self.db.write(|tx| {
            for n in nodes {
                if get_node(tx, n)?.pruned {
                    return Err(StoreError::FailedPrecondition(format!(
                        "node {n} was pruned: it cannot join a frontier"
                    )));
                }
                tx.exec(
                    "INSERT OR IGNORE INTO frontier_leases(node, holder, created_ns) VALUES (?1, ?2, ?3)",
                    params![n, holder, now_ns()],
                )?;
            }
            Ok(())
        })
    }

    /// Releases `holder`'s frontier leases on `nodes` (all of them when
    /// empty). Returns how many were released.
    pub fn release_frontier(&self, holder: &str, nodes: &[String]) -> Result<usize, StoreError> {
        self.db.write(|tx| {
            if nodes.is_empty() {
                return Ok(tx.exec("DELETE FROM frontier_leases WHERE holder = ?1", [holder])?);
            }
            let mut n = 0;
            for node in nodes {
                n += tx.exec(
                    "DELETE FROM frontier_leases WHERE holder = ?1 AND node = ?2",
                    params![holder, node],
                )?;
            }
            Ok(n)
        })
    }

    /// The nodes `holder` leases, by id.
    pub fn frontier(&self, holder: &str) -> Result<Vec<String>, StoreError> {
        self.db.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT node FROM frontier_leases WHERE holder = ?1 ORDER BY node",
            )?;
            let v = stmt
                .query_map([holder], |r| r.get(0))?
                .collect::<Result<Vec<String>, _>>()?;
            Ok(v)
        })
    }

    fn blob_path(&self, digest: &str) -> Result<PathBuf, StoreError> {
        let hex = digest.strip_prefix("blake3:").unwrap_or("");
        if hex.len() != 64
            || !hex
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        {
            return Err(StoreError::InvalidArgument(format!(
                "blob digest {digest:?}: give blake3:<64 lowercase hex digits>"
            )));
        }
        Ok(self.root.join("blobs").join(hex))
    }

    /// The id of the running attempt whose sandbox is session `sid`, if it is
    /// one (a read: the daemon's `Exec` asks it before recording).
    pub fn running_rollout_of_session(&self, sid: SessionId) -> Result<Option<i64>, StoreError> {
        self.db.read(|conn| {
            Ok(conn
                .one(
                    "SELECT id FROM rollout_attempts WHERE session_id = ?1 AND status = 'running'",
                    [sid],
                    |r| r.get(0),
                )
                .optional()?)
        })
    }

    /// Appends `record` to the trajectory of the running attempt whose
    /// sandbox is session `sid` (next `seq`). Returns that attempt's id, or
    /// `None` when the session is no running attempt's (the attempt ended
    /// meanwhile): nothing is written.
    pub fn record_rollout_exec(
        &self,
        sid: SessionId,
        record: &ExecRecord,
    ) -> Result<Option<i64>, StoreError> {
        let json = record.to_json();
        self.db.write(|tx| {
            let Some(id) = tx
                .one(
                    "SELECT id FROM rollout_attempts WHERE session_id = ?1 AND status = 'running'",
                    [sid],
                    |r| r.get::<_, i64>(0),
                )
                .optional()?
            else {
                return Ok(None);
            };
            tx.exec(
                "INSERT INTO rollout_execs(attempt_id, seq, record)
                 VALUES (?1, (SELECT coalesce(max(seq) + 1, 0) FROM rollout_execs WHERE attempt_id = ?1), ?2)",
                params![id, json],
            )?;
            Ok(Some(id))
        })
    }

    /// The commands the daemon recorded for attempt `id` (while it ran), as
    /// trajectory bytes: a JSON array of [`ExecRecord`] objects in order;
    /// `None` when none was recorded.
    pub fn recorded_trajectory(&self, id: i64) -> Result<Option<Vec<u8>>, StoreError> {
        self.db.read(|conn| recorded_trajectory(conn, id))
    }

    /// Attempts that ended while the daemon's record of their commands was
    /// still only rows — ended without a trajectory from their harness, by
    /// it or by an infrastructure failure ([`sync_rollouts_in`]) — get it as
    /// their trajectory ([`Store::fold_rollout_execs_of`] each). Best
    /// effort: an attempt that cannot be folded now (no space for its blob)
    /// is logged and keeps its rows for the next fold. Returns how many got
    /// their trajectory.
    pub fn fold_rollout_execs(&self) -> usize {
        let ended: Vec<i64> = match self.db.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT DISTINCT e.attempt_id FROM rollout_execs e JOIN rollout_attempts a ON a.id = e.attempt_id
                 WHERE a.status <> 'running' ORDER BY e.attempt_id",
            )?;
            let v = stmt.query_map([], |r| r.get(0))?.collect::<Result<Vec<i64>, _>>()?;
            Ok(v)
        }) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the rollout attempts whose commands to fold");
                return 0;
            }
        };
        let mut n = 0;
        for id in ended {
            match self.fold_rollout_execs_of(id) {
                Ok(folded) => n += usize::from(folded),
                Err(e) => {
                    tracing::warn!(rollout.attempt = id, error = %e, "cannot store an ended attempt's recorded commands as its trajectory; the next fold tries again");
                }
            }
        }
        n
    }

    /// Attempt `id`, once ended: the daemon's record of its commands
    /// becomes its trajectory blob if it has none (the blob written first,
    /// outside any transaction), and the rows go. Nothing while it runs.
    /// Returns whether it got its trajectory so.
    pub fn fold_rollout_execs_of(&self, id: i64) -> Result<bool, StoreError> {
        let running = self
            .db
            .read(|conn| Ok(get_rollout(conn, id)?.status == RolloutStatus::Running))?;
        if running {
            return Ok(false);
        }
        let digest = match self.recorded_trajectory(id)? {
            Some(bytes) => Some(self.put_blob(&bytes)?.0),
            None => return Ok(false),
        };
        self.db.write(|tx| {
            let set = tx.exec(
                "UPDATE rollout_attempts SET trajectory = ?2 WHERE id = ?1 AND status <> 'running' AND trajectory IS NULL",
                params![id, digest],
            )?;
            tx.exec("DELETE FROM rollout_execs WHERE attempt_id = ?1", [id])?;
            Ok(set == 1)
        })
    }

    /// Stores `bytes` as a content-addressed blob (`<root>/blobs/<hex>`,
    /// written to a temporary name and renamed; fsynced with the durable
    /// profile). Returns `(blake3:<hex>, size in bytes)`. Idempotent.
    pub fn put_blob(&self, bytes: &[u8]) -> Result<(String, u64), StoreError> {
        let digest = format!("blake3:{}", blake3::hash(bytes).to_hex());
        let path = self.blob_path(&digest)?;
        let size = u64::try_from(bytes.len()).unwrap_or(u64::MAX);
        if path.exists() {
            return Ok((digest, size));
        }
        let dir = self.root.join("blobs");
        std::fs::create_dir_all(&dir).map_err(|e| StoreError::io(&dir, e))?;
        // A name no other writer of this process uses at the same time: two
        // ends storing the same trajectory at once must not share one (the
        // first rename took the second's file away: ENOENT, found by
        // clients/python/tests/test_ray.py under load).
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!(".tmp-{}-{}-{n}", std::process::id(), now_ns()));
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(bytes)?;
            if self.durability == Durability::Durable {
                f.sync_all()?;
            }
            std::fs::rename(&tmp, &path)?;
            if self.durability == Durability::Durable {
                crate::fs::fsync_dir(&dir)?;
            }
            Ok(())
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            StoreError::io(&path, e)
        })?;
        Ok((digest, size))
    }

    /// The bytes of blob `digest`. Errors: `NotFound`, `InvalidArgument`.
    pub fn blob(&self, digest: &str) -> Result<Vec<u8>, StoreError> {
        let path = self.blob_path(digest)?;
        std::fs::read(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                StoreError::NotFound(format!("blob {digest} is not in this store"))
            }
            _ => StoreError::io(&path, e),
        })
    }
}
