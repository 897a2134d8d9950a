//! Sessions: one private upper on a lease, owned by a container (Mode A) or a
//! sandbox session (Mode B) (ARCHITECTURE.md §2, §6, §12).
//!
//! A session lives through runs: a run starts when the session is mounted with
//! no lease or after an outcome (the lease moves to the branch head and the
//! outcome is cleared), and ends with an outcome. An ending outcome (committed,
//! merged, no-change, discarded) releases the lease and gives the session a fresh
//! upper; a retryable one (conflict, failed, busy, unsupported, unknown) keeps
//! both, so the run may be published again or discarded.

use std::path::PathBuf;

use rusqlite::{params, Connection, OptionalExtension, Transaction};
use tracing::{info, warn};

use crate::db::Cached;
use crate::error::StoreError;
use crate::idempotency::{check_args, record_args, validate_key};
use crate::leases::{lease_manifest, new_lease, release_lease};
use crate::stacks::{branch_head, ensure_branch, manifest_layers, stack_base_layers};
use crate::{
    fs, now_ns, session_rel, validate_branch, HolderKind, KeyArgs, LayerId, LeaseTarget,
    ManifestId, MountSpec, Owner, SessionId, SessionInfo, SessionOptions, SessionState, Store,
    MAX_LOWERS,
};

/// A `sessions` row.
pub(crate) struct SessRow {
    pub(crate) id: SessionId,
    pub(crate) owner: Owner,
    pub(crate) stack: String,
    pub(crate) branch: String,
    pub(crate) lease_id: Option<i64>,
    pub(crate) state: SessionState,
    pub(crate) run: i64,
    pub(crate) policy: Option<String>,
    pub(crate) last_publish: Option<i64>,
    pub(crate) released: bool,
    pub(crate) remove_pending: bool,
    pub(crate) idempotency_key: Option<String>,
    pub(crate) created_ns: i64,
    pub(crate) ignore_mtime: bool,
    pub(crate) daemon_owned: bool,
    pub(crate) id_map: Option<layerstack_types::IdMap>,
}

/// SQL condition on `sessions` columns: the session still needs its directories
/// (live, being released, or its run's writes kept after a retryable outcome).
pub(crate) const KEEPS_DIRS: &str = "(released = 0 OR remove_pending = 1 OR last_publish IN (SELECT id FROM publishes WHERE outcome IN ('conflict', 'failed', 'busy', 'unsupported', 'unknown', 'interrupted')))";

/// The owner name (kind `wasi`) of a session made ahead of its request and
/// not yet claimed ([`Store::claim_ready_session`]): `wasi:(ready)` in lists.
/// Parentheses keep it apart from a name a daemon gives a request's session.
pub const READY_OWNER: &str = "(ready)";

/// The answer of [`Store::claim_ready_session`].
#[derive(Debug)]
pub enum Claim {
    /// The session, now the caller's.
    Claimed(Box<SessionInfo>),
    /// Not a ready session on its branch's current head (any more).
    Stale,
    /// The idempotency key names a session already.
    KeyTaken,
}

pub(crate) const SESS_COLS: &str = "id, owner_kind, namespace, owner, stack, branch, lease_id, state, run, policy, last_publish, released, remove_pending, idempotency_key, created_ns, ignore_mtime, daemon_owned, id_map";

/// The owner of session `id` from its columns. Errors: `Corrupt`.
pub(crate) fn owner_from(
    id: SessionId,
    kind: &str,
    namespace: String,
    owner: String,
) -> Result<Owner, StoreError> {
    match kind {
        "container" => Ok(Owner::Container {
            namespace,
            id: owner,
        }),
        "sandbox" => Ok(Owner::Sandbox { name: owner }),
        "wasi" => Ok(Owner::Wasi { name: owner }),
        "operation" => Ok(Owner::Operation { id: owner }),
        other => Err(StoreError::corrupt(
            "sessions",
            id,
            format!("owner_kind {other:?}"),
        )),
    }
}

/// A `sessions` row as stored ([`SESS_COLS`]), read by column name; parsed
/// by [`sess_from_raw`].
struct RawSess {
    id: i64,
    owner_kind: String,
    namespace: String,
    owner: String,
    stack: String,
    branch: String,
    lease_id: Option<i64>,
    state: String,
    run: i64,
    policy: Option<String>,
    last_publish: Option<i64>,
    released: i64,
    remove_pending: i64,
    idempotency_key: Option<String>,
    created_ns: i64,
    ignore_mtime: i64,
    daemon_owned: i64,
    id_map: Option<String>,
}

fn raw_sess(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawSess> {
    Ok(RawSess {
        id: r.get("id")?,
        owner_kind: r.get("owner_kind")?,
        namespace: r.get("namespace")?,
        owner: r.get("owner")?,
        stack: r.get("stack")?,
        branch: r.get("branch")?,
        lease_id: r.get("lease_id")?,
        state: r.get("state")?,
        run: r.get("run")?,
        policy: r.get("policy")?,
        last_publish: r.get("last_publish")?,
        released: r.get("released")?,
        remove_pending: r.get("remove_pending")?,
        idempotency_key: r.get("idempotency_key")?,
        created_ns: r.get("created_ns")?,
        ignore_mtime: r.get("ignore_mtime")?,
        daemon_owned: r.get("daemon_owned")?,
        id_map: r.get("id_map")?,
    })
}

fn sess_from_raw(raw: RawSess) -> Result<SessRow, StoreError> {
    let id = raw.id;
    let state = raw.state;
    Ok(SessRow {
        id,
        owner: owner_from(id, &raw.owner_kind, raw.namespace, raw.owner)?,
        stack: raw.stack,
        branch: raw.branch,
        lease_id: raw.lease_id,
        state: SessionState::parse(&state)
            .ok_or_else(|| StoreError::corrupt("sessions", id, format!("state {state:?}")))?,
        run: raw.run,
        policy: raw.policy,
        last_publish: raw.last_publish,
        released: raw.released != 0,
        remove_pending: raw.remove_pending != 0,
        idempotency_key: raw.idempotency_key,
        created_ns: raw.created_ns,
        ignore_mtime: raw.ignore_mtime != 0,
        daemon_owned: raw.daemon_owned != 0,
        id_map: raw
            .id_map
            .map(|m| {
                m.parse()
                    .map_err(|e| StoreError::corrupt("sessions", id, format!("id_map: {e}")))
            })
            .transpose()?,
    })
}

/// Session `id`. Errors: `SessionNotFound`, `Corrupt`.
pub(crate) fn get_sess(conn: &Connection, id: SessionId) -> Result<SessRow, StoreError> {
    let raw = conn
        .one(
            &format!("SELECT {SESS_COLS} FROM sessions WHERE id = ?1"),
            [id],
            raw_sess,
        )
        .optional()?
        .ok_or(StoreError::SessionNotFound(id))?;
    sess_from_raw(raw)
}

/// Every session matching `where_sql` (with `params`), by id.
fn query_sessions(
    conn: &Connection,
    where_sql: &str,
    params: impl rusqlite::Params,
) -> Result<Vec<SessRow>, StoreError> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {SESS_COLS} FROM sessions {where_sql} ORDER BY id"
    ))?;
    let raws: Vec<RawSess> = stmt
        .query_map(params, raw_sess)?
        .collect::<Result<_, _>>()?;
    raws.into_iter().map(sess_from_raw).collect()
}

/// A new session row for `owner` on `stack`, leasing `target`, with private
/// read-only layers `above` (newest first). Creates its directories, registered
/// in flight in `holds` until the caller's transaction commits (a concurrent
/// Cleanup sweep must not take them for orphans). Returns the session id.
#[allow(clippy::too_many_arguments)]
pub(crate) fn insert_session(
    store: &Store,
    holds: &mut Vec<crate::InFlightGuard>,
    tx: &Transaction<'_>,
    owner: &Owner,
    stack: &str,
    target: &LeaseTarget,
    above: &[LayerId],
    idempotency_key: Option<&str>,
) -> Result<SessionId, StoreError> {
    let (branch, head) = match target {
        LeaseTarget::Branch(b) => {
            validate_branch(b).map_err(StoreError::InvalidArgument)?;
            (
                b.clone(),
                ensure_branch(tx, stack, b, &store.default_branch)?,
            )
        }
        LeaseTarget::Manifest {
            manifest: m,
            branch,
        } => {
            // The engine's own working branches (a graph merge's) are named
            // outside what users may write.
            if !crate::is_internal_branch(branch) {
                validate_branch(branch).map_err(StoreError::InvalidArgument)?;
            }
            let on: Option<String> = tx
                .one("SELECT stack FROM manifests WHERE id = ?1", [m], |r| {
                    r.get(0)
                })
                .optional()?;
            match on {
                Some(s) if s == stack => {}
                Some(s) => {
                    return Err(StoreError::InvalidArgument(format!(
                        "manifest {m} belongs to stack {s}, not {stack}"
                    )))
                }
                None => {
                    return Err(StoreError::InvalidArgument(format!(
                        "manifest {m} does not exist"
                    )))
                }
            }
            ensure_branch(tx, stack, branch, &store.default_branch)?;
            (branch.clone(), *m)
        }
    };
    let now = now_ns();
    let (ns, name) = (owner.namespace(), owner.name());
    tx.exec(
        "INSERT INTO sessions(owner_kind, namespace, owner, stack, branch, state, idempotency_key, created_ns, updated_ns) VALUES (?1, ?2, ?3, ?4, ?5, 'active', ?6, ?7, ?7)",
        params![owner.kind_str(), ns, name, stack, branch, idempotency_key, now],
    )?;
    let sid = tx.last_insert_rowid();
    let lease = new_lease(tx, head, HolderKind::Session, &sid.to_string())?;
    tx.exec(
        "UPDATE sessions SET lease_id = ?2 WHERE id = ?1",
        params![sid, lease],
    )?;
    {
        let mut ins = tx.prepare_cached(
            "INSERT INTO session_layers(session_id, pos, layer_id) VALUES (?1, ?2, ?3)",
        )?;
        for (pos, l) in above.iter().enumerate() {
            ins.execute(params![sid, pos as i64, l])?;
        }
    }
    holds.push(store.inflight.hold(session_rel(sid)));
    Ok(sid)
}

/// Gives the fresh upper of run `spec` (directories already made: by
/// [`Store::ready_run`], or before the run's transaction by
/// [`Store::with_session_dirs`]) the metadata of the lease's root
/// ([`fs::init_upper_root`]; an upper already written is left as is).
/// Error: `Io` naming the upper (`NotFound` when its directory was removed
/// since it was made).
fn init_run_upper(spec: &MountSpec) -> Result<(), StoreError> {
    let MountSpec::Overlay {
        lowers,
        upper: Some((upper, _)),
    } = spec
    else {
        return Ok(());
    };
    match lowers.first() {
        Some(top) => fs::init_upper_root(upper, top).map_err(|e| StoreError::io(upper, e)),
        None => Ok(()),
    }
}

impl Store {
    /// Makes what is missing of session `sid`'s directory, upper and
    /// workdir (a session whose fresh upper could not be made after its last
    /// run keeps none; the next mount makes them). Nothing half-made stays: on
    /// an error it removes, newest first, what this call made, and answers
    /// `Io` naming the directory it could not make.
    pub(crate) fn make_session_dirs(&self, sid: SessionId) -> Result<(), StoreError> {
        self.make_session_dirs_for(sid, false).map(drop)
    }

    /// [`Store::make_session_dirs`] answering what it made (for the caller to
    /// remove with [`Store::unmake_session_dirs`] when its next step fails).
    /// `run`: the directories of a run being readied or started (Prepare, a
    /// session or attempt created, a mount, a rebranch) — the failpoint
    /// `session.mkdir` is on that path only (a publish's renewal of the
    /// upper logs its failure and goes on).
    fn make_session_dirs_for(&self, sid: SessionId, run: bool) -> Result<Vec<PathBuf>, StoreError> {
        let s = self.session_path(sid);
        let _g = self.inflight.hold(session_rel(sid));
        let mut made = Vec::new();
        for (p, mode) in [
            (s.clone(), 0o700),
            (s.join("upper"), 0o755),
            (s.join("work"), 0o700),
        ] {
            let step = if run && p.ends_with("work") {
                // The session's directory and upper made (now or before), its
                // workdir not: where an error leaves the most to undo.
                crate::failpoints::fail("session.mkdir", &self.root)
            } else {
                Ok(())
            };
            match step.and_then(|()| fs::mkdir_mode(&p, mode)) {
                Ok(()) => made.push(p),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    self.unmake_session_dirs(sid, &made);
                    return Err(StoreError::io(&p, e));
                }
            }
        }
        Ok(made)
    }

    /// Removes the (empty) directories `made` of session `sid` that
    /// [`Store::make_session_dirs_for`] made, newest first.
    fn unmake_session_dirs(&self, sid: SessionId, made: &[PathBuf]) {
        let _g = self.inflight.hold(session_rel(sid));
        for d in made.iter().rev() {
            if let Err(e) = std::fs::remove_dir(d) {
                warn!(session.id = sid, path = %d.display(), error = %e, "cannot remove a session directory made by a step that failed");
            }
        }
    }

    /// Makes what is missing of session `sid`'s directories *before* `step`,
    /// a transaction that starts or moves its run (a mount, a rebranch), so
    /// that a full disk (ENOSPC) or an I/O error while making them fails the
    /// call with nothing changed; when `step` fails, removes what was made
    /// for it.
    fn with_session_dirs<T>(
        &self,
        sid: SessionId,
        step: impl FnOnce() -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let made = self.make_session_dirs_for(sid, true)?;
        step().inspect_err(|_| self.unmake_session_dirs(sid, &made))
    }

    pub(crate) fn session_info(
        &self,
        conn: &Connection,
        s: SessRow,
    ) -> Result<SessionInfo, StoreError> {
        let lease_manifest = match s.lease_id {
            Some(l) => Some(lease_manifest(conn, l)?),
            None => None,
        };
        let outcome = match s.last_publish {
            Some(p) => Some(crate::publish::read_outcome(conn, p)?),
            None => None,
        };
        let key: Option<String> = match s.owner {
            Owner::Container { .. } => conn
                .one(
                    "SELECT key FROM snapshots WHERE session_id = ?1 AND kind = 'active'",
                    [s.id],
                    |r| r.get(0),
                )
                .optional()?,
            Owner::Sandbox { .. } | Owner::Wasi { .. } | Owner::Operation { .. } => None,
        };
        Ok(SessionInfo {
            upper: self.upper_path(s.id),
            work: self.session_work_path(s.id),
            id: s.id,
            owner: s.owner,
            key,
            stack: s.stack,
            branch: s.branch,
            state: s.state,
            outcome,
            lease_manifest,
            run: s.run,
            released: s.released,
            remove_pending: s.remove_pending,
            policy: s.policy,
            idempotency_key: s.idempotency_key,
            created_ns: s.created_ns,
            ignore_mtime: s.ignore_mtime,
            daemon_owned: s.daemon_owned,
            id_map: s.id_map,
            branch_created: false,
        })
    }

    /// Lower layers of session `s` on lease `lease`, newest first: its private
    /// layers, the leased manifest's layers, then the stack's base layers.
    pub(crate) fn session_lowers(
        &self,
        conn: &Connection,
        s: &SessRow,
        manifest: ManifestId,
    ) -> Result<Vec<LayerId>, StoreError> {
        let mut lowers: Vec<LayerId> = {
            let mut stmt = conn.prepare_cached(
                "SELECT layer_id FROM session_layers WHERE session_id = ?1 ORDER BY pos",
            )?;
            let rows = stmt.query_map([s.id], |r| r.get(0))?;
            rows.collect::<Result<_, _>>()?
        };
        lowers.extend(manifest_layers(conn, manifest)?);
        lowers.extend(stack_base_layers(conn, &s.stack)?);
        Ok(lowers)
    }

    /// The overlay of session `sid` over `lowers`: refuses more than
    /// [`MAX_LOWERS`], and gives a fresh upper the lease root's metadata.
    pub(crate) fn session_spec(
        &self,
        conn: &Connection,
        sid: SessionId,
        lowers: &[LayerId],
    ) -> Result<MountSpec, StoreError> {
        if lowers.len() > MAX_LOWERS {
            return Err(StoreError::FailedPrecondition(format!(
                "a session on this branch would mount {} lower layers (published history plus image layers); overlayfs allows {MAX_LOWERS} (OVL_MAX_STACK); squash the branch's history or use another branch",
                lowers.len()
            )));
        }
        let dirs = self.layer_dirs(conn, lowers)?;
        Ok(MountSpec::Overlay {
            lowers: dirs,
            upper: Some((self.upper_path(sid), self.session_work_path(sid))),
        })
    }

    /// Makes the directories of session `sid`'s run `spec` (as [`Store::start_run`]
    /// returned it): the session's directory, upper and workdir, and a fresh
    /// upper's root given the lease root's metadata ([`fs::init_upper_root`]).
    /// Called after the transaction that returned `spec` committed — no
    /// filesystem work runs inside a write transaction (ARCHITECTURE §9) — and
    /// idempotent: a crash between that commit and this call leaves a session
    /// row without directories, which the next mount of the session makes.
    /// Error: `Io` naming the directory.
    pub(crate) fn ready_run(&self, sid: SessionId, spec: &MountSpec) -> Result<(), StoreError> {
        let MountSpec::Overlay {
            upper: Some((upper, _)),
            ..
        } = spec
        else {
            return Ok(());
        };
        crate::failpoints::fail("session.dirs", &self.root)
            .map_err(|e| StoreError::io(upper, e))?;
        self.make_session_dirs_for(sid, true)?;
        init_run_upper(spec)
    }

    /// Starts a run of session `sid` if none is in progress (no lease, or the
    /// last run has an outcome): leases the branch head, clears the outcome,
    /// counts the run. Returns the mount spec of the current run; its
    /// directories are the caller's to make once the transaction committed
    /// ([`Store::ready_run`]).
    pub(crate) fn start_run(
        &self,
        tx: &Transaction<'_>,
        sid: SessionId,
    ) -> Result<MountSpec, StoreError> {
        let mut s = get_sess(tx, sid)?;
        if s.released {
            return Err(StoreError::FailedPrecondition(format!(
                "session {sid} was released by its owner; it cannot be mounted again"
            )));
        }
        if s.lease_id.is_none() {
            let head = branch_head(tx, &s.stack, &s.branch)?.ok_or_else(|| {
                StoreError::BranchNotFound {
                    stack: s.stack.clone(),
                    branch: s.branch.clone(),
                }
            })?;
            let lease = new_lease(tx, head, HolderKind::Session, &sid.to_string())?;
            tx.exec(
                "UPDATE sessions SET lease_id = ?2 WHERE id = ?1",
                params![sid, lease],
            )?;
            s.lease_id = Some(lease);
        }
        if s.last_publish.is_some() || s.state != SessionState::Active {
            tx.exec(
                "UPDATE sessions SET state = 'active', last_publish = NULL, run = run + 1, updated_ns = ?2 WHERE id = ?1",
                params![sid, now_ns()],
            )?;
        }
        let lease = s.lease_id.unwrap_or_default();
        let manifest = lease_manifest(tx, lease)?;
        let lowers = self.session_lowers(tx, &s, manifest)?;
        self.session_spec(tx, sid, &lowers)
    }

    /// Creates a session for `owner` on `stack` leasing `target` (a branch head,
    /// created from the default branch when missing, or a manifest of the stack).
    /// With `idempotency_key`, a second call with the same key returns the first
    /// call's session (and its mount spec now) instead of creating another.
    ///
    /// Errors: `StackNotFound`, `InvalidArgument` (branch name, manifest of
    /// another stack), `FailedPrecondition` (too many lowers).
    pub fn create_session(
        &self,
        owner: &Owner,
        stack: &str,
        target: &LeaseTarget,
        idempotency_key: Option<&str>,
    ) -> Result<(SessionInfo, MountSpec, bool), StoreError> {
        self.create_session_with(
            owner,
            stack,
            target,
            idempotency_key,
            &SessionOptions::default(),
        )
    }

    /// [`Store::create_session`] that records the new session's options (its
    /// exit policy, as [`Store::set_session_policy`] takes it; capture's
    /// `ignore_mtime`) in the same transaction: a crash never leaves the
    /// session without them, and a repeat of the idempotency key answers the
    /// first call's session with its options as recorded then.
    pub fn create_session_with(
        &self,
        owner: &Owner,
        stack: &str,
        target: &LeaseTarget,
        idempotency_key: Option<&str>,
        opts: &SessionOptions,
    ) -> Result<(SessionInfo, MountSpec, bool), StoreError> {
        let mut holds = Vec::new();
        let target_arg = match target {
            LeaseTarget::Branch(b) => format!("branch {b}"),
            LeaseTarget::Manifest { manifest, branch } => {
                format!("manifest {manifest} of branch {branch}")
            }
        };
        let args = session_args(opts)
            .with("stack", stack)
            .with("target", target_arg);
        let (info, spec, created) = self.db.write(|tx| {
            if let Some(k) = idempotency_key {
                validate_key(k)?;
                check_args(tx, "session", k, &args)?;
                crate::idempotency::refuse_other_sandbox_kind(tx, "session", k)?;
                let existing: Option<i64> = tx
                    .one(
                        "SELECT id FROM sessions WHERE idempotency_key = ?1",
                        [k],
                        |r| r.get(0),
                    )
                    .optional()?;
                if let Some(sid) = existing {
                    let s = get_sess(tx, sid)?;
                    let spec = match s.released {
                        true => MountSpec::Overlay {
                            lowers: vec![],
                            upper: None,
                        },
                        false => self.start_run(tx, sid)?,
                    };
                    let info = self.session_info(tx, get_sess(tx, sid)?)?;
                    return Ok((info, spec, false));
                }
            }
            let exists: Option<i64> = tx
                .one("SELECT 1 FROM stacks WHERE id = ?1", [stack], |r| r.get(0))
                .optional()?;
            if exists.is_none() {
                return Err(StoreError::StackNotFound(stack.into()));
            }
            // Read in the transaction that may create it: exact, whoever races.
            let branch_created = match target {
                LeaseTarget::Branch(b) => branch_head(tx, stack, b)?.is_none(),
                LeaseTarget::Manifest { .. } => false,
            };
            let sid = insert_session(self, &mut holds, tx, owner, stack, target, &[], idempotency_key)?;
            if let Some(p) = &opts.exit_policy {
                set_policy(tx, sid, p)?;
            }
            set_options(tx, sid, opts)?;
            if let Some(k) = idempotency_key {
                record_args(tx, "session", k, &args)?;
            }
            let spec = self.start_run(tx, sid)?;
            let info = SessionInfo {
                branch_created,
                ..self.session_info(tx, get_sess(tx, sid)?)?
            };
            info!(session.id = sid, owner = %owner.display(), stack, branch = %info.branch, branch_created, "session created");
            Ok((info, spec, true))
        })?;
        crate::failpoints::hit("session.created");
        if let Err(e) = self.ready_run(info.id, &spec) {
            if created {
                // Nothing of a session that cannot be used stays in effect: its
                // lease released, the session released, its key free again.
                if let Err(undo) =
                    self.undo_new_session(info.id, "session", idempotency_key, |_| Ok(()))
                {
                    warn!(session.id = info.id, error = %undo, "cannot undo a session whose directories could not be made; the next start makes them");
                }
            }
            return Err(e);
        }
        Ok((info, spec, created))
    }

    /// Hands ready session `sid` (made ahead by
    /// [`Store::create_session_with`] with owner `wasi:`[`READY_OWNER`]) to
    /// `owner`, in one transaction: its owner, idempotency key and options
    /// become the caller's, as if [`Store::create_session_with`] had made it
    /// now for (its stack, `branch {its branch}`, `idempotency_key`, `opts`).
    /// Nothing is mounted or made here: the session's directories and lease
    /// are its own already.
    ///
    /// Answers [`Claim::Stale`] when the session is no longer a ready one on
    /// its branch's current head (the head moved since it was made, or it was
    /// claimed or ended), [`Claim::KeyTaken`] when `idempotency_key` names a
    /// session already: the caller then creates the usual way (which answers
    /// that key's session). Errors: `InvalidArgument` (a bad key),
    /// `FailedPrecondition` (the key was used with other arguments).
    pub fn claim_ready_session(
        &self,
        sid: SessionId,
        owner: &Owner,
        idempotency_key: Option<&str>,
        opts: &SessionOptions,
    ) -> Result<Claim, StoreError> {
        self.db.write(|tx| {
            let Ok(s) = get_sess(tx, sid) else {
                return Ok(Claim::Stale);
            };
            let ready = matches!(&s.owner, Owner::Wasi { name } if name == READY_OWNER)
                && !s.released
                && s.state == SessionState::Active
                && s.last_publish.is_none();
            let leased = match s.lease_id {
                Some(l) => Some(lease_manifest(tx, l)?),
                None => None,
            };
            if !ready || leased.is_none() || leased != branch_head(tx, &s.stack, &s.branch)? {
                return Ok(Claim::Stale);
            }
            if let Some(k) = idempotency_key {
                validate_key(k)?;
                let args = session_args(opts)
                    .with("stack", s.stack.as_str())
                    .with("target", format!("branch {}", s.branch));
                check_args(tx, "session", k, &args)?;
                crate::idempotency::refuse_other_sandbox_kind(tx, "session", k)?;
                let taken: Option<i64> = tx
                    .one(
                        "SELECT id FROM sessions WHERE idempotency_key = ?1",
                        [k],
                        |r| r.get(0),
                    )
                    .optional()?;
                if taken.is_some() {
                    return Ok(Claim::KeyTaken);
                }
                record_args(tx, "session", k, &args)?;
            }
            tx.exec(
                "UPDATE sessions SET owner_kind = ?2, namespace = ?3, owner = ?4, idempotency_key = ?5, updated_ns = ?6 WHERE id = ?1",
                params![sid, owner.kind_str(), owner.namespace(), owner.name(), idempotency_key, now_ns()],
            )?;
            if let Some(p) = &opts.exit_policy {
                set_policy(tx, sid, p)?;
            }
            set_options(tx, sid, opts)?;
            let info = self.session_info(tx, get_sess(tx, sid)?)?;
            tracing::debug!(session.id = sid, owner = %owner.display(), stack = %info.stack, branch = %info.branch, "ready session claimed");
            Ok(Claim::Claimed(Box::new(info)))
        })
    }

    /// Undoes session `sid` just created whose directories could not be made:
    /// releases it and its lease, frees its idempotency key `key` (of
    /// operation `op`: `session`, `attempt`), runs `more` in the same
    /// transaction, removes what was made of its directories.
    pub(crate) fn undo_new_session(
        &self,
        sid: SessionId,
        op: &str,
        key: Option<&str>,
        more: impl FnOnce(&Transaction<'_>) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        self.db.write(|tx| {
            let s = get_sess(tx, sid)?;
            release_lease(tx, s.lease_id)?;
            tx.exec(
                "UPDATE sessions SET released = 1, remove_pending = 0, lease_id = NULL, idempotency_key = NULL, updated_ns = ?2 WHERE id = ?1",
                params![sid, now_ns()],
            )?;
            if let Some(k) = key {
                crate::idempotency::forget_args(tx, op, k)?;
            }
            more(tx)
        })?;
        self.drop_session_dirs(sid);
        Ok(())
    }

    /// The mount spec of session `sid`'s current run, starting a new run when the
    /// last one has an outcome (see the module docs). Error: `SessionNotFound`,
    /// `FailedPrecondition` (released, too many lowers).
    ///
    /// The directories are made first when missing (a full disk or an I/O
    /// error then fails the mount with no run started and nothing made).
    pub fn session_mount(&self, sid: SessionId) -> Result<MountSpec, StoreError> {
        let spec = self.with_session_dirs(sid, || self.db.write(|tx| self.start_run(tx, sid)))?;
        init_run_upper(&spec)?;
        Ok(spec)
    }

    /// Record the exit policy of `session` as given (`on-exit`, `on-success`,
    /// `never`; an invalid value is recorded too, so that the run is refused
    /// rather than published). Error: `SessionNotFound`.
    pub fn set_session_policy(
        &self,
        session: SessionId,
        policy: &str,
    ) -> Result<SessionInfo, StoreError> {
        self.db.write(|tx| {
            set_policy(tx, session, policy)?;
            self.session_info(tx, get_sess(tx, session)?)
        })
    }

    /// All sessions, oldest first.
    pub fn sessions(&self) -> Result<Vec<SessionInfo>, StoreError> {
        self.db.read(|conn| {
            query_sessions(conn, "", [])?
                .into_iter()
                .map(|s| self.session_info(conn, s))
                .collect()
        })
    }

    /// One session by id. Error: `SessionNotFound`.
    pub fn session(&self, id: SessionId) -> Result<SessionInfo, StoreError> {
        self.db.read(|conn| {
            let s = get_sess(conn, id)?;
            self.session_info(conn, s)
        })
    }

    /// The newest session of a container (`namespace`, container `id` = the
    /// rootfs snapshot key's name part), preferring one containerd has not removed.
    pub fn find_session(
        &self,
        namespace: &str,
        container: &str,
    ) -> Result<Option<SessionInfo>, StoreError> {
        self.db.read(|conn| {
            let raw = conn
                .one(
                    &format!(
                        "SELECT {SESS_COLS} FROM sessions WHERE owner_kind = 'container' AND namespace = ?1 AND owner = ?2 ORDER BY released ASC, id DESC LIMIT 1"
                    ),
                    params![namespace, container],
                    raw_sess,
                )
                .optional()?;
            match raw {
                Some(r) => Ok(Some(self.session_info(conn, sess_from_raw(r)?)?)),
                None => Ok(None),
            }
        })
    }

    /// Marks session `sid` released by its owner (containerd removed its
    /// snapshot; the sandbox session closed). With `defer`, the directories and
    /// lease stay until [`Store::complete_release`] (a publish may still need
    /// them); otherwise they go now. A session whose run ended with a retryable
    /// outcome (conflict, failed) keeps its upper and lease for inspection either
    /// way (until discarded).
    pub fn release_session(&self, sid: SessionId, defer: bool) -> Result<(), StoreError> {
        // Released and completed in one transaction unless deferred.
        let drop_dirs = self.db.write(|tx| {
            let s = get_sess(tx, sid)?;
            if !s.released || s.remove_pending {
                tx.exec(
                    "UPDATE sessions SET released = 1, remove_pending = 1, updated_ns = ?2 WHERE id = ?1",
                    params![sid, now_ns()],
                )?;
            }
            if defer {
                return Ok(false);
            }
            complete_release_in(tx, sid)
        })?;
        if drop_dirs {
            crate::failpoints::hit("session.released");
            self.drop_session_dirs(sid);
        }
        Ok(())
    }

    /// The first step of closing sandbox session `sid`, in one transaction: checks
    /// that a sandbox holder owns it and marks it released by that owner, with
    /// its directories and lease kept until its run has ended
    /// ([`Store::complete_release`], which the end of the run triggers). Marking
    /// it first means the run's end removes the upper instead of giving the
    /// session a fresh one that the release would remove again. A session
    /// released and completed already (`remove_pending` false) is returned as it
    /// is.
    ///
    /// Errors: `SessionNotFound`; `InvalidArgument` when a container or an
    /// operation owns the session (it ends with its owner).
    pub fn release_sandbox_session(&self, sid: SessionId) -> Result<SessionInfo, StoreError> {
        self.db.write(|tx| {
            release_sandbox_in(tx, sid)?;
            self.session_info(tx, get_sess(tx, sid)?)
        })
    }

    /// A discard in one write transaction, on the writer connection (whose
    /// page cache no other writer invalidates: a reader's first read after
    /// other connections wrote costs a reload): with `accept` content with the
    /// session as it is and its run running with a lease, the owner's release
    /// when `release` (a sandbox's: the close of a live WASI session), the
    /// outcome `record` (kind `discarded`), and — the session released and
    /// its run ended — the release completed (lease released). Directories
    /// after the commit: a released session's dropped, another's upper made
    /// fresh. What [`Store::release_sandbox_session`],
    /// [`Store::record_outcome`] and [`Store::complete_release`] do in three.
    ///
    /// Returns the session after it and its graph attempt, or `Err(session)`
    /// unchanged when `accept` refused it or its run has ended or holds no
    /// lease. Errors: `SessionNotFound`; `InvalidArgument` for another kind
    /// than `discarded`, and for `release` of a session no sandbox owns.
    #[allow(clippy::type_complexity)]
    pub fn discard_session(
        &self,
        sid: SessionId,
        record: crate::OutcomeRecord,
        release: bool,
        accept: impl FnOnce(&SessionInfo) -> bool,
    ) -> Result<Result<(SessionInfo, Option<crate::AttemptInfo>), SessionInfo>, StoreError> {
        if record.kind != crate::OutcomeKind::Discarded {
            return Err(StoreError::InvalidArgument(format!(
                "discard_session records outcome discarded, not {}",
                record.kind.as_str()
            )));
        }
        let done = self.db.write(|tx| {
            let before = self.session_info(tx, get_sess(tx, sid)?)?;
            if !accept(&before) || before.run_finished() || before.lease_manifest.is_none() {
                return Ok(Err(before));
            }
            if release {
                release_sandbox_in(tx, sid)?;
            }
            let row = get_sess(tx, sid)?;
            let released = row.released;
            crate::publish::insert_outcome(tx, &row, &record, SessionState::Discarded, true)?;
            if self.session_info(tx, get_sess(tx, sid)?)?.release_due() {
                complete_release_in(tx, sid)?;
            }
            let after = self.session_info(tx, get_sess(tx, sid)?)?;
            let attempt = crate::graph::attempt_of_session_in(tx, sid)?;
            Ok(Ok((after, attempt, released)))
        })?;
        Ok(match done {
            Err(s) => Err(s),
            Ok((after, attempt, released)) => {
                if released {
                    self.drop_session_dirs(sid);
                } else {
                    self.reset_session_dirs(sid, true);
                }
                Ok((after, attempt))
            }
        })
    }

    /// Releases session `sid` and drops what it keeps, whatever its last outcome:
    /// its lease is released and its directories are removed; its outcome stays
    /// as recorded — no new outcome row. For an operation's session (promote,
    /// node merge) whose run ended in `conflict` or `failed`: what it flattened
    /// can be built again from the branch it came from, so nothing is kept for
    /// inspection (the outcome's message says so). Error: `SessionNotFound`.
    pub fn release_session_dropping(&self, sid: SessionId) -> Result<(), StoreError> {
        self.db.write(|tx| {
            let s = get_sess(tx, sid)?;
            release_lease(tx, s.lease_id)?;
            tx.exec(
                "UPDATE sessions SET released = 1, remove_pending = 0, lease_id = NULL, updated_ns = ?2 WHERE id = ?1",
                params![sid, now_ns()],
            )?;
            Ok(())
        })?;
        self.drop_session_dirs(sid);
        Ok(())
    }

    /// Finishes the release of a released session: clears `remove_pending`, and
    /// unless its run ended with a retryable outcome (conflict, failed, …: the
    /// writes are kept for inspection until discarded) releases the lease and
    /// removes the directories (row first, directories after, outside the
    /// transaction).
    pub fn complete_release(&self, sid: SessionId) -> Result<(), StoreError> {
        if self.db.write(|tx| complete_release_in(tx, sid))? {
            self.drop_session_dirs(sid);
        }
        Ok(())
    }

    fn drop_session_dirs(&self, sid: SessionId) {
        self.reaper
            .drop_tree(&self.session_path(sid), &format!("s{sid}"));
    }

    /// Re-points a session whose current run has not been mounted yet to `branch`
    /// (the container label `layerstack.branch`, read by the runtime shim before the
    /// rootfs is mounted; ARCHITECTURE.md §6 step 1): the lease moves to that branch's
    /// head, and a new branch forks the default branch. Returns the session, its
    /// mount spec now, and whether anything changed: a session already on
    /// `branch`, or `pinned` (its snapshot label names a branch, which wins), is
    /// left as it is. The caller checks that the upper is not mounted.
    ///
    /// Errors: `SessionNotFound`; `InvalidArgument` (branch name);
    /// `FailedPrecondition` when the run already has an outcome, holds no lease,
    /// was released, or its upper is not empty.
    pub fn rebranch_session(
        &self,
        session: SessionId,
        branch: &str,
        pinned: bool,
    ) -> Result<(SessionInfo, MountSpec, bool), StoreError> {
        validate_branch(branch).map_err(StoreError::InvalidArgument)?;
        // The directories first, when missing: a full disk fails the rebranch
        // before the lease moves (never a branch changed by a call that failed).
        let (info, spec, changed) =
            self.with_session_dirs(session, || self.rebranch_in(session, branch, pinned))?;
        init_run_upper(&spec)?;
        if changed {
            info!(session.id = session, branch, manifest = ?info.lease_manifest, "session re-pointed to branch");
        }
        Ok((info, spec, changed))
    }

    /// [`Store::rebranch_session`]'s check of the upper and its transaction.
    fn rebranch_in(
        &self,
        session: SessionId,
        branch: &str,
        pinned: bool,
    ) -> Result<(SessionInfo, MountSpec, bool), StoreError> {
        let upper = self.upper_path(session);
        let upper_empty = match std::fs::read_dir(&upper) {
            Ok(mut d) => d.next().is_none(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
            Err(e) => return Err(StoreError::io(&upper, e)),
        };
        self.db.write(|tx| {
            let s = get_sess(tx, session)?;
            let mut changed = false;
            if s.branch != branch && !pinned {
                let lease = match (s.last_publish.is_some(), s.released, s.lease_id) {
                    (false, false, Some(l)) => l,
                    _ => {
                        return Err(StoreError::FailedPrecondition(format!(
                            "session {session} has no run in progress (outcome recorded, released, or no lease): its branch cannot change"
                        )))
                    }
                };
                if !upper_empty {
                    return Err(StoreError::FailedPrecondition(format!(
                        "session {session} has written to its upper already: its branch cannot change"
                    )));
                }
                let head = ensure_branch(tx, &s.stack, branch, &self.default_branch)?;
                release_lease(tx, Some(lease))?;
                let new = new_lease(tx, head, HolderKind::Session, &session.to_string())?;
                tx.exec(
                    "UPDATE sessions SET branch = ?2, lease_id = ?3, updated_ns = ?4 WHERE id = ?1",
                    params![session, branch, new, now_ns()],
                )?;
                changed = true;
            }
            let s = get_sess(tx, session)?;
            let lease = s.lease_id.ok_or(StoreError::NoLease(session))?;
            let manifest = lease_manifest(tx, lease)?;
            let lowers = self.session_lowers(tx, &s, manifest)?;
            let spec = self.session_spec(tx, session, &lowers)?;
            let info = self.session_info(tx, s)?;
            Ok((info, spec, changed))
        })
    }

    /// Whether `sid`'s upper holds anything.
    pub fn upper_is_empty(&self, sid: SessionId) -> Result<bool, StoreError> {
        let upper = self.upper_path(sid);
        match std::fs::read_dir(&upper) {
            Ok(mut d) => Ok(d.next().is_none()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
            Err(e) => Err(StoreError::io(&upper, e)),
        }
    }

    /// The directory holding session `sid` (for callers that list them).
    pub fn session_dir(&self, sid: SessionId) -> PathBuf {
        self.session_path(sid)
    }
}

/// The rows of [`Store::complete_release`]; true when the session's
/// directories are to be removed.
/// The owner's release of sandbox session `sid` (released, its removal
/// pending), once: [`Store::release_sandbox_session`]'s step. Errors:
/// `SessionNotFound`; `InvalidArgument` when a container or an operation owns
/// it (it ends with its owner).
fn release_sandbox_in(tx: &rusqlite::Transaction<'_>, sid: SessionId) -> Result<(), StoreError> {
    let s = get_sess(tx, sid)?;
    if !s.owner.is_sandbox() {
        return Err(StoreError::InvalidArgument(format!(
            "session {sid} belongs to {}, not to a sandbox holder: it ends with its owner",
            s.owner.display()
        )));
    }
    if !s.released {
        tx.exec(
            "UPDATE sessions SET released = 1, remove_pending = 1, updated_ns = ?2 WHERE id = ?1",
            params![sid, now_ns()],
        )?;
    }
    Ok(())
}

fn complete_release_in(tx: &rusqlite::Transaction<'_>, sid: SessionId) -> Result<bool, StoreError> {
    let s = get_sess(tx, sid)?;
    if !s.released {
        return Ok(false);
    }
    let keep = match s.last_publish {
        Some(p) => crate::publish::read_outcome(tx, p)?.kind.is_retryable(),
        None => false,
    };
    if !keep {
        release_lease(tx, s.lease_id)?;
    }
    tx.exec(
        &format!(
            "UPDATE sessions SET remove_pending = 0, {} updated_ns = ?2 WHERE id = ?1",
            if keep { "" } else { "lease_id = NULL," }
        ),
        params![sid, now_ns()],
    )?;
    Ok(!keep)
}

/// The options of a keyed session or attempt its key is checked against
/// ([`crate::idempotency`]): exit policy, capture's `ignore_mtime`, who owns
/// the init. The owner's name is not one: it is a label, and a retry from
/// another process may carry another default name.
pub(crate) fn session_args(opts: &SessionOptions) -> KeyArgs {
    let args = KeyArgs::new()
        .with("policy", opts.exit_policy.as_deref().unwrap_or(""))
        .with("ignore_mtime", opts.ignore_mtime)
        .with("daemon_owned", opts.daemon_owned);
    // Only when set: a key recorded before format 17 still matches.
    match opts.id_map {
        Some(m) => args.with("id_map", m),
        None => args,
    }
}

/// Records capture's `ignore_mtime` and `daemon_owned` on session `sid`
/// ([`SessionOptions`]; the exit policy is the caller's, [`set_policy`]).
pub(crate) fn set_options(
    tx: &Transaction<'_>,
    sid: SessionId,
    opts: &SessionOptions,
) -> Result<(), StoreError> {
    tx.exec(
        "UPDATE sessions SET ignore_mtime = ?2, daemon_owned = ?3, id_map = ?4 WHERE id = ?1",
        params![
            sid,
            opts.ignore_mtime as i64,
            opts.daemon_owned as i64,
            opts.id_map.map(|m| m.to_string())
        ],
    )?;
    Ok(())
}

/// Records session `sid`'s exit policy. Error: `SessionNotFound`.
pub(crate) fn set_policy(
    tx: &Transaction<'_>,
    sid: SessionId,
    policy: &str,
) -> Result<(), StoreError> {
    let n = tx.exec(
        "UPDATE sessions SET policy = ?2, updated_ns = ?3 WHERE id = ?1",
        params![sid, policy, now_ns()],
    )?;
    if n == 0 {
        return Err(StoreError::SessionNotFound(sid));
    }
    Ok(())
}
