//! Publishing a session and recording outcomes (ARCHITECTURE.md §6 steps 5–6, §8, §9).
//!
//! A publish writes in steps so that the serialized part stays short and no
//! write transaction waits for filesystem work:
//!
//! 1. [`Store::stage_publish`], outside the gate: a `pending` layer row with the
//!    layer's path index, and a `pending` outcome row with every path's verdict.
//!    Nothing refers to them yet; the upper stays where it is.
//! 2. Under the branch's gate, [`Store::recheck_head`]: the head now, and what
//!    it added at the plan's paths since the plan (reads only). The caller then
//!    applies its plan to the upper — merged files, copies, removals — with no
//!    transaction open: another branch, a containerd `Prepare` or `Remove`
//!    never waits for that I/O.
//! 3. [`Store::commit_publish`], still under the gate: one short `IMMEDIATE`
//!    transaction of rows, a compare-and-swap of the head (`HeadMoved` unless
//!    it is the head step 2 read), replaces the index and verdicts when the
//!    gate re-planned, turns the layer `published`, prepends it to a new
//!    manifest, moves the branch, releases the lease and points the session at
//!    its outcome; last, inside the transaction, the sealed upper is renamed
//!    into `l/<id>` — no data copy, the one filesystem step a write
//!    transaction takes — and the transaction commits (a failed commit renames
//!    it back).
//!
//! Crash story: before step 3 commits, the pending rows are garbage: the sweep
//! at the next start deletes them, after moving an upper already renamed into
//! `l/<id>` back to `s/<sid>/upper`; the run is published again (its upper may
//! hold the plan's edits by then: merged files are the session's writes
//! rebased on the head, which normally plan again as a clean merge). Once step 3
//! commits, the layer directory is in place. So a publish never loses the
//! session's data, and no reader — of this or any other store instance — ever
//! sees a committed row whose directory is missing.

use std::path::PathBuf;

use rusqlite::{params, Connection, OptionalExtension, Transaction};
use tracing::{debug, warn};

use crate::db::write_on;
use crate::db::Cached;
use crate::error::StoreError;
use crate::leases::{lease_manifest, release_lease};
use crate::paths::{insert_index, layers_since, query_layers};
use crate::sessions::{get_sess, SessRow};
use crate::stacks::{branch_head, prepend_manifest, set_branch};
use crate::{
    fs, now_ns, Durability, HeadChanges, HeadView, IndexEntry, LayerId, LayerKind, ManifestId,
    Outcome, OutcomeKind, OutcomeRecord, PathCounts, PathQuery, PathRecord, PathStatus,
    PublishContext, PublishId, PublishTimings, SessionId, SessionState, Store,
};

/// A committed publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub layer: LayerId,
    pub manifest: ManifestId,
    pub outcome: PublishId,
}

/// What a commit records besides the staged rows ([`Store::commit_publish`]).
#[derive(Debug, Clone, Default)]
pub struct CommitRecord<'a> {
    /// `Committed` or `Merged`.
    pub kind: Option<OutcomeKind>,
    pub message: Option<String>,
    pub timings: Option<PublishTimings>,
    /// The index and verdicts the gate computed again because the head moved
    /// (replacing the staged ones).
    pub replanned: Option<(&'a [IndexEntry], &'a [PathRecord])>,
    /// The caller gives the session its fresh upper and workdir itself, with
    /// [`Store::renew_session_dirs`], once it has released what it holds (a
    /// branch's gate); otherwise the commit does, before it returns.
    pub renew_later: bool,
}

/// What [`Store::recheck_head`] found: the branch head now and, when it moved
/// since the head a plan was made against, what the layers it added hold at
/// the plan's paths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recheck {
    /// The head now: the `expected_head` of the [`Store::commit_publish`] that follows.
    pub head: ManifestId,
    /// `None` when the head did not move; otherwise `Store::changes_between`'s
    /// answer from the observed head to [`Recheck::head`].
    pub changes: Option<HeadChanges>,
}

/// Rows written by [`Store::stage_publish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Staged {
    /// The pending layer (its directory is still the session's upper).
    pub layer: LayerId,
    /// The pending outcome row.
    pub outcome: PublishId,
}

fn insert_paths(
    tx: &Transaction<'_>,
    pid: PublishId,
    paths: &[PathRecord],
) -> Result<(), StoreError> {
    let mut ins = tx.prepare_cached(
        "INSERT OR REPLACE INTO publish_paths(publish_id, path, status, reason) VALUES (?1, ?2, ?3, ?4)",
    )?;
    for p in paths {
        ins.execute(params![
            pid,
            p.path,
            crate::model::path_status_code(p.status),
            p.reason
        ])?;
    }
    Ok(())
}

/// Writes outcome `record` of session `s`'s current run (its per-path verdicts
/// included) and moves the session to `state`, pointing at it; `ends`: the run
/// is over, its lease released. Rows only, in the caller's transaction: the
/// caller owns the session's directories. Every outcome that adds no layer is
/// written here, whoever records it ([`Store::record_outcome`], containerd's
/// `Commit` of a session). Returns the outcome's id.
pub(crate) fn insert_outcome(
    tx: &Transaction<'_>,
    s: &SessRow,
    record: &OutcomeRecord,
    state: SessionState,
    ends: bool,
) -> Result<PublishId, StoreError> {
    let now = now_ns();
    let c = PathCounts::of(&record.paths);
    let [cu, gw, gh, tu, cb] = micros(record.timings);
    tx.exec(
        "INSERT INTO publishes(session_id, run, outcome, message, clean, merged, conflict, excluded, capture_us, gate_wait_us, gate_hold_us, total_us, capture_bytes, at_ns, interrupted_by) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)",
        params![s.id, s.run, record.kind.as_str(), record.message, c.clean as i64, c.merged as i64, c.conflict as i64, c.excluded as i64, cu, gw, gh, tu, cb, now, record.interrupted_by.map(|i| i.as_str())],
    )?;
    let pid = tx.last_insert_rowid();
    insert_paths(tx, pid, &record.paths)?;
    if ends {
        release_lease(tx, s.lease_id)?;
        tx.exec(
            "UPDATE sessions SET state = ?2, last_publish = ?3, lease_id = NULL, updated_ns = ?4 WHERE id = ?1",
            params![s.id, state.as_str(), pid, now],
        )?;
    } else {
        tx.exec(
            "UPDATE sessions SET state = ?2, last_publish = ?3, updated_ns = ?4 WHERE id = ?1",
            params![s.id, state.as_str(), pid, now],
        )?;
    }
    Ok(pid)
}

/// The `publishes` columns of `t`: capture_us, gate_wait_us, gate_hold_us,
/// total_us, capture_bytes.
fn micros(t: Option<PublishTimings>) -> [Option<i64>; 5] {
    let c = |v: u64| Some(i64::try_from(v).unwrap_or(i64::MAX));
    match t {
        Some(t) => [
            c(t.capture_us),
            c(t.gate_wait_us),
            c(t.gate_hold_us),
            c(t.total_us),
            c(t.capture_bytes),
        ],
        None => [None; 5],
    }
}

/// Outcome row `pid`. Errors: `Corrupt` when it is missing or does not parse.
pub(crate) fn read_outcome(conn: &Connection, pid: PublishId) -> Result<Outcome, StoreError> {
    /// A `publishes` row as stored, read by column name.
    struct Raw {
        run: i64,
        outcome: String,
        layer_id: Option<i64>,
        node: Option<String>,
        message: Option<String>,
        counts: [i64; 4],
        /// capture_us, gate_wait_us, gate_hold_us, total_us, capture_bytes.
        timings: [Option<i64>; 5],
        at_ns: i64,
        interrupted_by: Option<String>,
    }
    let raw: Option<Raw> = conn
        .one(
            // The node a checkpoint made: the result node of an attempt that ran
            // in this session, whose root is the manifest this outcome made
            // (`Store::commit_checkpoint` writes both in one transaction). By
            // the session index and the node's key: no scan of the graph.
            "SELECT p.run, p.outcome, p.layer_id, p.message, p.clean, p.merged, p.conflict, p.excluded, p.capture_us, p.gate_wait_us, p.gate_hold_us, p.total_us, p.capture_bytes, p.at_ns, p.interrupted_by,
                    (SELECT n.id FROM graph_attempts a JOIN graph_nodes n ON n.id = a.result_node
                      WHERE p.outcome = 'checkpointed' AND a.session_id = p.session_id
                        AND n.manifest_id = p.manifest_after
                      LIMIT 1) AS node
               FROM publishes p WHERE p.id = ?1",
            [pid],
            |r| {
                Ok(Raw {
                    run: r.get("run")?,
                    outcome: r.get("outcome")?,
                    layer_id: r.get("layer_id")?,
                    node: r.get("node")?,
                    message: r.get("message")?,
                    counts: [
                        r.get("clean")?,
                        r.get("merged")?,
                        r.get("conflict")?,
                        r.get("excluded")?,
                    ],
                    timings: [
                        r.get("capture_us")?,
                        r.get("gate_wait_us")?,
                        r.get("gate_hold_us")?,
                        r.get("total_us")?,
                        r.get("capture_bytes")?,
                    ],
                    at_ns: r.get("at_ns")?,
                    interrupted_by: r.get("interrupted_by")?,
                })
            },
        )
        .optional()?;
    let Raw {
        run,
        outcome: kind,
        layer_id: layer,
        node,
        message,
        counts,
        timings: t,
        at_ns,
        interrupted_by,
    } = raw.ok_or_else(|| {
        StoreError::corrupt(
            "publishes",
            pid,
            "outcome referenced by a session is missing",
        )
    })?;
    let kind = OutcomeKind::parse(&kind)
        .ok_or_else(|| StoreError::corrupt("publishes", pid, format!("outcome {kind:?}")))?;
    let interrupted_by = interrupted_by
        .map(|i| {
            crate::Interruption::parse(&i).ok_or_else(|| {
                StoreError::corrupt("publishes", pid, format!("interrupted_by {i:?}"))
            })
        })
        .transpose()?;
    let u = |v: i64| u64::try_from(v).unwrap_or(0);
    let timings = match t {
        [Some(a), Some(b), Some(c), Some(d), bytes] => Some(PublishTimings {
            capture_us: u(a),
            gate_wait_us: u(b),
            gate_hold_us: u(c),
            total_us: u(d),
            capture_bytes: bytes.map_or(0, u),
        }),
        _ => None,
    };
    Ok(Outcome {
        id: pid,
        kind,
        run,
        layer,
        node,
        message,
        counts: PathCounts {
            clean: u(counts[0]),
            merged: u(counts[1]),
            conflict: u(counts[2]),
            excluded: u(counts[3]),
        },
        at_ns,
        timings,
        interrupted_by,
    })
}

impl Store {
    /// What a publish of `session` reads before capturing: its upper, the lease's
    /// manifest and lower directories. Errors: `SessionNotFound`, `NoLease`.
    pub fn publish_context(&self, session: SessionId) -> Result<PublishContext, StoreError> {
        self.db.read(|conn| {
            let s = get_sess(conn, session)?;
            let lease = s.lease_id.ok_or(StoreError::NoLease(session))?;
            let manifest = lease_manifest(conn, lease)?;
            let lowers = self.session_lowers(conn, &s, manifest)?;
            let lease_lowers = self.layer_dirs(conn, &lowers)?;
            let info = self.session_info(conn, s)?;
            Ok(PublishContext {
                session: info,
                lease_lowers,
                lease_manifest: manifest,
            })
        })
    }

    /// The head of session `session`'s branch now, with the lower directories a
    /// session of that branch would mount on it (its private layers, the head's
    /// layers, the base). Errors: `SessionNotFound`, `BranchNotFound`.
    pub fn head_view(&self, session: SessionId) -> Result<HeadView, StoreError> {
        self.db.read(|conn| {
            let s = get_sess(conn, session)?;
            let head = branch_head(conn, &s.stack, &s.branch)?.ok_or_else(|| {
                StoreError::BranchNotFound {
                    stack: s.stack.clone(),
                    branch: s.branch.clone(),
                }
            })?;
            let lowers = self.session_lowers(conn, &s, head)?;
            Ok(HeadView {
                manifest: head,
                lowers: self.layer_dirs(conn, &lowers)?,
            })
        })
    }

    /// Step 1 of a publish (see the module docs): records a pending layer for
    /// `session` with its path index `index`, and a pending outcome with every
    /// path's verdict. Error: `SessionNotFound`.
    pub fn stage_publish(
        &self,
        session: SessionId,
        index: &[IndexEntry],
        paths: &[PathRecord],
    ) -> Result<Staged, StoreError> {
        let staged = self.db.write(|tx| {
            let s = get_sess(tx, session)?;
            let layer = crate::layers::insert_layer(tx, LayerKind::Pending, Some(&s.stack), Some(session))?;
            let c = PathCounts::of(paths);
            tx.exec(
                "INSERT INTO publishes(session_id, run, outcome, layer_id, clean, merged, conflict, excluded, at_ns) VALUES (?1, ?2, 'pending', ?3, ?4, ?5, ?6, ?7, ?8)",
                params![session, s.run, layer, c.clean as i64, c.merged as i64, c.conflict as i64, c.excluded as i64, now_ns()],
            )?;
            let outcome = tx.last_insert_rowid();
            Ok(Staged { layer, outcome })
        })?;
        // The rows, in transactions that give the writer to a commit under a
        // gate between two rows (`Db::write_each`): invisible until the
        // layer is committed, dropped with it otherwise (here, by the caller's
        // `abandon_staged`, or by the startup sweep after a crash).
        let rows = self
            .db
            .write_each(index, |tx, e| {
                insert_index(tx, staged.layer, std::slice::from_ref(e))
            })
            .and_then(|()| {
                self.db.write_each(paths, |tx, p| {
                    insert_paths(tx, staged.outcome, std::slice::from_ref(p))
                })
            })
            .and_then(|()| {
                crate::failpoints::fail("publish.staged", &self.root)
                    .map_err(|e| StoreError::io(&self.upper_path(session), e))
            });
        if let Err(e) = rows {
            if let Err(again) = self.abandon_staged(staged) {
                tracing::warn!(layer.id = staged.layer, error = %again, "cannot drop a partly staged publish; the startup sweep drops it");
            }
            return Err(e);
        }
        Ok(staged)
    }

    /// How many publishes (and checkpoints) are staged and not committed: in
    /// flight, or left by a failure that did not drop them (the startup sweep
    /// does). Error: `Sqlite`.
    pub fn staged_publishes(&self) -> Result<u64, StoreError> {
        self.db.read(|conn| {
            Ok(conn.one(
                "SELECT (SELECT count(*) FROM publishes WHERE outcome = 'pending') + (SELECT count(*) FROM layers WHERE kind = 'pending')",
                [],
                |r| r.get::<_, i64>(0),
            )? as u64)
        })
    }

    /// Drops the rows of a staged publish that will not be committed.
    pub fn abandon_staged(&self, staged: Staged) -> Result<(), StoreError> {
        self.db.write(|tx| {
            delete_staged(tx, staged)?;
            Ok(())
        })
    }

    /// Step 3 of a publish (see the module docs): the compare-and-swap of the
    /// branch head from `expected_head` (what [`Store::recheck_head`] read) to a
    /// manifest with the staged layer prepended.
    ///
    /// Errors: `HeadMoved` when the branch head is not `expected_head` (plan
    /// again); `NoLease`; on any failure nothing changes and the upper stays.
    pub fn commit_publish(
        &self,
        session: SessionId,
        staged: Staged,
        expected_head: ManifestId,
        record: CommitRecord<'_>,
    ) -> Result<Published, StoreError> {
        self.commit_in(session, staged, expected_head, record)
    }

    /// Under a branch's gate, before its plan is applied: the head of
    /// `session`'s branch now and, if it is no longer `observed`, what the
    /// layers it added since hold at `query`'s paths. Reads only, on the
    /// writer's connection (first in line, [`crate::db::Db::writer_first`]): no
    /// wait for a read connection on the gate holder's path, and no write lock.
    ///
    /// Errors: `SessionNotFound`, `BranchNotFound`, `Corrupt`.
    pub fn recheck_head(
        &self,
        session: SessionId,
        observed: ManifestId,
        query: &PathQuery,
    ) -> Result<Recheck, StoreError> {
        let mut conn = self.db.writer_first();
        let tx = conn.transaction()?;
        let s = get_sess(&tx, session)?;
        let head =
            branch_head(&tx, &s.stack, &s.branch)?.ok_or_else(|| StoreError::BranchNotFound {
                stack: s.stack.clone(),
                branch: s.branch.clone(),
            })?;
        let changes = if head == observed {
            None
        } else {
            let layers = layers_since(&tx, &self.expansions, observed, head)?;
            Some(query_layers(&tx, &layers, query)?)
        };
        // Dropped without commit: a read transaction ends by rolling back.
        Ok(Recheck { head, changes })
    }

    fn commit_in(
        &self,
        session: SessionId,
        staged: Staged,
        expected_head: ManifestId,
        record: CommitRecord<'_>,
    ) -> Result<Published, StoreError> {
        let CommitRecord {
            kind,
            message,
            timings,
            replanned,
            renew_later,
        } = record;
        let kind = kind.unwrap_or(OutcomeKind::Committed);
        let upper = self.upper_path(session);
        let dst = self.layer_path(staged.layer);
        let _inflight = self.inflight.hold(crate::layer_rel(staged.layer));
        let asked = std::time::Instant::now();
        // Under the gate: ahead of other publishes' staging transactions.
        let mut conn = self.db.writer_first();
        // Diagnostics of the gate hold (debug line below): waiting for the writer
        // (another transaction) vs this one.
        let writer_wait = asked.elapsed();
        let published = write_on(&mut conn, |tx| {
            let s = get_sess(tx, session)?;
            if s.lease_id.is_none() {
                return Err(StoreError::NoLease(session));
            }
            let head = branch_head(tx, &s.stack, &s.branch)?.ok_or_else(|| {
                StoreError::BranchNotFound {
                    stack: s.stack.clone(),
                    branch: s.branch.clone(),
                }
            })?;
            // The compare-and-swap: rows only from here on, and the one rename.
            if head != expected_head {
                return Err(StoreError::HeadMoved {
                    expected: expected_head,
                    found: head,
                });
            }
            if let Some((index, paths)) = replanned {
                tx.exec(
                    "DELETE FROM layer_paths WHERE layer_id = ?1",
                    [staged.layer],
                )?;
                insert_index(tx, staged.layer, index)?;
                tx.exec(
                    "DELETE FROM publish_paths WHERE publish_id = ?1",
                    [staged.outcome],
                )?;
                insert_paths(tx, staged.outcome, paths)?;
                let c = PathCounts::of(paths);
                tx.exec(
                    "UPDATE publishes SET clean = ?2, merged = ?3, conflict = ?4, excluded = ?5 WHERE id = ?1",
                    params![staged.outcome, c.clean as i64, c.merged as i64, c.conflict as i64, c.excluded as i64],
                )?;
            }
            let n = tx.exec(
                "UPDATE layers SET kind = 'published' WHERE id = ?1 AND kind = 'pending'",
                [staged.layer],
            )?;
            if n != 1 {
                return Err(StoreError::corrupt(
                    "layers",
                    staged.layer,
                    "a staged layer is not pending any more",
                ));
            }
            let manifest = prepend_manifest(tx, &s.stack, head, staged.layer)?;
            set_branch(tx, &s.stack, &s.branch, manifest)?;
            release_lease(tx, s.lease_id)?;
            let now = now_ns();
            let [cu, gw, gh, tu, cb] = micros(timings);
            tx.exec(
                "UPDATE publishes SET outcome = ?2, manifest_before = ?3, manifest_after = ?4, message = ?5, capture_us = ?6, gate_wait_us = ?7, gate_hold_us = ?8, total_us = ?9, at_ns = ?10, capture_bytes = ?11 WHERE id = ?1",
                params![staged.outcome, kind.as_str(), head, manifest, message, cu, gw, gh, tu, now, cb],
            )?;
            tx.exec(
                "UPDATE sessions SET state = 'published', last_publish = ?2, lease_id = NULL, updated_ns = ?3 WHERE id = ?1",
                params![session, staged.outcome, now],
            )?;
            // The (sealed, quiescent) upper becomes the layer directory inside the
            // transaction, just before it commits: no reader of any store instance
            // ever sees the row without its directory. If the commit fails, the
            // rename is undone below.
            crate::failpoints::fail("publish.before_rename", &self.root)
                .and_then(|()| std::fs::rename(&upper, &dst))
                .and_then(|()| match self.durability {
                    Durability::Durable => fs::fsync_dir(&self.root.join("l"))
                        .and_then(|()| fs::fsync_dir(&self.session_path(session))),
                    Durability::Disposable => Ok(()),
                })
                .and_then(|()| crate::failpoints::fail("publish.renamed", &self.root))
                .map_err(|e| StoreError::io(&upper, e))?;
            Ok((
                Published {
                    layer: staged.layer,
                    manifest,
                    outcome: staged.outcome,
                },
                s.stack,
                s.branch,
            ))
        });
        drop(conn);
        if published.is_ok() {
            crate::failpoints::hit("publish.committed");
        }
        let transaction = asked.elapsed().saturating_sub(writer_wait);
        let (published, stack, branch) = match published {
            Ok(p) => p,
            Err(e) => {
                // Not committed: put the upper back if it was moved.
                if std::fs::symlink_metadata(&dst).is_ok()
                    && std::fs::symlink_metadata(&upper).is_err()
                {
                    if let Err(back) = std::fs::rename(&dst, &upper) {
                        tracing::error!(session.id = session, layer.id = staged.layer, error = %back, "a publish that did not commit left the upper in the layer directory; the startup sweep moves it back");
                    }
                }
                return Err(e);
            }
        };
        if !renew_later {
            self.reset_session_dirs(session, false);
        }
        debug!(session.id = session, layer.id = published.layer, stack = %stack, branch = %branch, manifest = published.manifest, outcome = kind.as_str(), writer_wait_us = writer_wait.as_micros() as u64, transaction_us = transaction.as_micros() as u64, "published");
        Ok(published)
    }

    /// Sets the gate hold and total time (µs) of committed outcome `outcome`,
    /// measured once the commit itself was done (the commit's row is written
    /// before its transaction, rename and fresh upper ran). Errors: `Sqlite`.
    pub fn record_commit_times(
        &self,
        outcome: PublishId,
        gate_hold_us: u64,
        total_us: u64,
    ) -> Result<(), StoreError> {
        let c = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.db.write(|tx| {
            tx.exec(
                "UPDATE publishes SET gate_hold_us = ?2, total_us = ?3 WHERE id = ?1 AND gate_hold_us IS NOT NULL",
                params![outcome, c(gate_hold_us), c(total_us)],
            )?;
            Ok(())
        })
    }

    /// Records an outcome that adds no layer. `NoChange` and `Discarded` end the
    /// run: the lease is released and the upper dropped (the next mount starts
    /// fresh on the head). Retryable outcomes (`Conflict`, `Failed`, `Busy`,
    /// `Unsupported`, `Unknown`, `Interrupted`) keep both for inspection and
    /// another attempt.
    /// A session released by its owner loses its directories once the run ends.
    /// `staged`: rows of a publish that got this outcome instead (dropped).
    ///
    /// Errors: `SessionNotFound`; `InvalidArgument` for `Committed`/`Merged`
    /// (use [`Store::commit_publish`]), and for `interrupted_by` given with any
    /// kind but `Interrupted` or missing with it.
    pub fn record_outcome(
        &self,
        session: SessionId,
        record: OutcomeRecord,
        staged: Option<Staged>,
    ) -> Result<Outcome, StoreError> {
        if (record.kind == OutcomeKind::Interrupted) != record.interrupted_by.is_some() {
            return Err(StoreError::InvalidArgument(format!(
                "outcome {} with interrupted_by {:?}: an interrupted outcome names its interruption, no other outcome has one",
                record.kind.as_str(),
                record.interrupted_by.map(|i| i.as_str())
            )));
        }
        let (state, ends) = match record.kind {
            OutcomeKind::NoChange => (SessionState::Published, true),
            OutcomeKind::Discarded => (SessionState::Discarded, true),
            OutcomeKind::Conflict => (SessionState::Conflict, false),
            OutcomeKind::Failed
            | OutcomeKind::Busy
            | OutcomeKind::Unsupported
            | OutcomeKind::Unknown
            | OutcomeKind::Interrupted => (SessionState::Active, false),
            OutcomeKind::Committed | OutcomeKind::Merged | OutcomeKind::Checkpointed => {
                return Err(StoreError::InvalidArgument(format!(
                    "outcome {} adds a layer: commit the publish (or the checkpoint) instead",
                    record.kind.as_str()
                )))
            }
        };
        let (outcome, released) = self.db.write(|tx| {
            let s = get_sess(tx, session)?;
            if let Some(st) = staged {
                delete_staged(tx, st)?;
            }
            let pid = insert_outcome(tx, &s, &record, state, ends)?;
            Ok((read_outcome(tx, pid)?, s.released))
        })?;
        if ends && released {
            // The owner let go already (a kept conflict upper being dropped, or a
            // run ended after containerd removed the snapshot): nothing mounts
            // this session again.
            self.reaper
                .drop_tree(&self.session_path(session), &format!("s{session}"));
        } else if ends {
            self.reset_session_dirs(session, true);
        }
        debug!(
            session.id = session,
            outcome = record.kind.as_str(),
            "outcome recorded"
        );
        Ok(outcome)
    }

    /// Outcome `id`. Errors: `Corrupt` when missing.
    pub fn outcome(&self, id: PublishId) -> Result<Outcome, StoreError> {
        self.db.read(|conn| read_outcome(conn, id))
    }

    /// The per-path verdicts of outcome `id` in path order, a page at a time:
    /// at most `limit` paths after `after` (exclusive; `None` from the start),
    /// only `status` when given. Errors: `Corrupt`.
    pub fn outcome_paths(
        &self,
        id: PublishId,
        after: Option<&[u8]>,
        limit: usize,
        status: Option<PathStatus>,
    ) -> Result<Vec<PathRecord>, StoreError> {
        self.db.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT path, status, reason FROM publish_paths WHERE publish_id = ?1 AND path > ?2 AND (?3 IS NULL OR status = ?3) ORDER BY path LIMIT ?4",
            )?;
            let rows = stmt.query_map(
                params![
                    id,
                    after.unwrap_or(&[]),
                    status.map(crate::model::path_status_code),
                    i64::try_from(limit).unwrap_or(i64::MAX)
                ],
                |r| Ok((r.get::<_, Vec<u8>>(0)?, r.get::<_, i64>(1)?, r.get::<_, String>(2)?)),
            )?;
            let mut out = Vec::new();
            for r in rows {
                let (path, st, reason) = r?;
                let status = crate::model::path_status_from_code(st).ok_or_else(|| {
                    StoreError::corrupt(
                        "publish_paths",
                        format!("outcome {id}, path {}", crate::escape_path(&path)),
                        format!("status {st}"),
                    )
                })?;
                out.push(PathRecord {
                    path,
                    status,
                    reason,
                });
            }
            Ok(out)
        })
    }

    /// The number of layers manifest `id` shows (its `depth` column: one row,
    /// read after every publish to decide on an automatic squash). Error:
    /// `Corrupt` when the manifest is missing.
    pub fn manifest_depth(&self, id: ManifestId) -> Result<usize, StoreError> {
        self.db.read(|conn| {
            let d = crate::stacks::manifest_row(conn, id)?.depth;
            Ok(usize::try_from(d).unwrap_or(0))
        })
    }

    /// Gives session `session` an empty upper and workdir after a commit that
    /// left that to its caller ([`CommitRecord::renew_later`]). Failures are
    /// logged; the next mount creates what is missing.
    pub fn renew_session_dirs(&self, session: SessionId) {
        self.reset_session_dirs(session, false);
    }

    /// Give a session an empty upper and workdir (after its writes were published
    /// or dropped). Old directories go through staging so a crash never leaves a
    /// half-deleted upper in place.
    pub(crate) fn reset_session_dirs(&self, session: SessionId, drop_upper: bool) {
        let s = self.session_path(session);
        let mut doomed: Vec<PathBuf> = vec![s.join("work")];
        if drop_upper {
            doomed.push(s.join("upper"));
        }
        for d in doomed {
            self.reaper.drop_tree(&d, &format!("s{session}-reset"));
        }
        if let Err(e) = self.make_session_dirs(session) {
            warn!(session.id = session, error = %e, "failed to recreate session directories; the next mount retries");
        }
    }
}

fn delete_staged(tx: &Transaction<'_>, staged: Staged) -> Result<(), StoreError> {
    crate::blame::delete_staged_blame(tx, staged.layer)?;
    tx.exec(
        "DELETE FROM layer_paths WHERE layer_id = ?1",
        [staged.layer],
    )?;
    tx.exec(
        "DELETE FROM layers WHERE id = ?1 AND kind = 'pending'",
        [staged.layer],
    )?;
    tx.exec(
        "DELETE FROM publish_paths WHERE publish_id = ?1",
        [staged.outcome],
    )?;
    tx.exec(
        "DELETE FROM publishes WHERE id = ?1 AND outcome = 'pending'",
        [staged.outcome],
    )?;
    Ok(())
}
