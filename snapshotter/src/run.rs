//! `RunSession`: a session that runs one command, in one round trip —
//! `CreateSession`, `Exec` and `CloseSession` composed in the daemon (the
//! proto's comment is the contract). What a grader's clean session and a
//! one-shot tool run need, without two more round trips of the caller's.
//!
//! The command's end decides nothing by itself: the request's close does
//! (AUTO reads the command's exit code unless the request gives an exit
//! status). A caller that goes away before the command ends gets no say any
//! more: the command is stopped (Exec's rule for a vanished caller) and the
//! session discarded — never a publish of a run nobody saw end.

use futures::StreamExt;
use layerstack_api as api;
use tokio::sync::mpsc;
use tonic::Status;
use tracing::{debug, warn};

use crate::admin::AdminService;
use crate::owned::Stream;

fn reply(kind: api::run_session_reply::Kind) -> Result<api::RunSessionReply, Status> {
    Ok(api::RunSessionReply { kind: Some(kind) })
}

/// How a run ended before the close.
enum Ran {
    /// The command's exit (code as ExecExit.code: 128 + signal for a signal).
    Exit(i32),
    /// The command did not start, or its exec failed: the error to answer.
    Failed(Status),
    /// The caller went away before the command ended.
    Abandoned,
}

/// `RunSession`: the first reply (the created session) is queued before this
/// returns; the rest comes from a task that ends the session whatever the
/// caller does.
pub(crate) async fn run_session(
    admin: &AdminService,
    r: api::RunSessionRequest,
) -> Result<Stream<api::RunSessionReply>, Status> {
    let create = r.create.ok_or_else(|| {
        Status::invalid_argument(
            "create is required: the session (CreateSessionRequest with wasi or sandbox)",
        )
    })?;
    if create.wasi.is_none() && create.sandbox.is_none() {
        return Err(Status::invalid_argument(
            "create: RunSession runs a WASI (create.wasi) or daemon-owned (create.sandbox) session; a holder's session runs by `layerstack session run`",
        ));
    }
    let mut exec = r
        .exec
        .ok_or_else(|| Status::invalid_argument("exec is required: the command to run"))?;
    let mut close = r.close.unwrap_or_default();
    if api::EndAction::from_i32(close.action).is_none() {
        return Err(Status::invalid_argument(format!(
            "close.action {} is not an end action: use PUBLISH, DISCARD, AUTO or CHECKPOINT",
            close.action
        )));
    }
    // What the close would refuse is refused now, before a session exists
    // (refused at the end, it would leave the sandbox live).
    crate::sandbox::check_close_state(&close)?;
    if close.action == api::EndAction::Checkpoint as i32 && create.node.is_empty() {
        return Err(Status::failed_precondition(
            "close.action CHECKPOINT needs a session on a graph node (create.node): only an attempt of a node can be checkpointed; publish or discard this one",
        ));
    }
    if close.action == api::EndAction::Auto as i32
        && create.node.is_empty()
        && (!close.state.is_empty() || !close.labels.is_empty())
    {
        return Err(Status::failed_precondition(
            "close.state and close.labels are recorded by a checkpoint, which a session on no graph node cannot make (its AUTO close would drop them): give create.node, or leave them out",
        ));
    }
    let key = create.idempotency_key.clone();
    let executor = if create.wasi.is_some() {
        "wasi"
    } else {
        "sandbox"
    };
    let started = std::time::Instant::now();
    let made = admin.sandbox_create(create).await?;
    let created_us = started.elapsed().as_micros() as u64;
    let session = made
        .session
        .clone()
        .ok_or_else(|| Status::internal("CreateSession answered no session"))?;
    let id = session.id;
    let (tx, rx) = mpsc::channel(16);
    // A fresh channel of 16 holds the first reply without waiting.
    let _ = tx.try_send(reply(api::run_session_reply::Kind::Session(made.clone())));
    if !made.created {
        // A retry of the key: its end as recorded, nothing run again.
        if session.released || !session.outcome.is_empty() {
            let _ = tx.try_send(reply(api::run_session_reply::Kind::Closed(session)));
            return Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)));
        }
        return Err(Status::aborted(format!(
            "session {id} of idempotency key {key:?} is live: a first RunSession is still running it; wait for its end (Wait) rather than running it twice"
        )));
    }
    let admin = admin.clone();
    tokio::spawn(async move {
        exec.session_id = id;
        let ran = match crate::owned::exec(&admin, exec).await {
            Err(e) => Ran::Failed(e),
            Ok(mut replies) => {
                let mut ran =
                    Ran::Failed(Status::internal("the command's exec ended without an exit"));
                loop {
                    let next = tokio::select! {
                        next = replies.next() => next,
                        () = tx.closed() => {
                            ran = Ran::Abandoned;
                            break;
                        }
                    };
                    use api::exec_reply::Kind as E;
                    use api::run_session_reply::Kind as R;
                    let kind = match next {
                        None => break,
                        Some(Err(e)) => {
                            ran = Ran::Failed(e);
                            break;
                        }
                        Some(Ok(api::ExecReply { kind: None })) => continue,
                        Some(Ok(api::ExecReply { kind: Some(k) })) => match k {
                            E::Stdout(b) => R::Stdout(b),
                            E::Stderr(b) => R::Stderr(b),
                            E::Exit(x) => {
                                ran = Ran::Exit(x.code);
                                R::Exit(x)
                            }
                        },
                    };
                    if tx.send(reply(kind)).await.is_err() && !matches!(ran, Ran::Exit(_)) {
                        ran = Ran::Abandoned;
                        break;
                    }
                }
                ran
            }
        };
        // Dropping the exec's stream (on an early break) stops its command.
        let ran_us = started.elapsed().as_micros() as u64;
        close.session_id = id;
        let failed = match ran {
            Ran::Exit(code) => {
                if !close.has_exit_status {
                    close.has_exit_status = true;
                    close.exit_status = u32::try_from(code).unwrap_or(255);
                }
                None
            }
            Ran::Failed(e) => {
                as_discard(
                    &mut close,
                    format!("the command did not run: {}", e.message()),
                );
                Some(e)
            }
            Ran::Abandoned => {
                as_discard(
                    &mut close,
                    "the RunSession caller went away before the command ended".into(),
                );
                None
            }
        };
        let end = admin.sandbox_close(close.clone()).await;
        if end.is_err() && close.action != api::EndAction::Discard as i32 {
            // A close refused while the session lives (checked up front, but
            // the session may have changed meanwhile): it must not outlive
            // this call. The refusal is what the caller gets.
            as_discard(&mut close, "RunSession: its close was refused".into());
            if let Err(e) = admin.sandbox_close(close).await {
                warn!(session.id = id, error = %e.message(), "RunSession: the discard after a refused close failed");
            }
        }
        debug!(
            session.id = id,
            ok = end.is_ok(),
            executor,
            created_us,
            ran_us,
            closed_us = started.elapsed().as_micros() as u64,
            "RunSession closed"
        );
        let last = match (end, failed) {
            (Ok(_), Some(e)) | (Err(e), _) => Err(e),
            (Ok(s), None) => reply(api::run_session_reply::Kind::Closed(s)),
        };
        let _ = tx.send(last).await;
    });
    Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
}

/// `close` turned into a DISCARD for `reason`: without the state, labels and
/// command a checkpoint would have recorded (a discard records none, and a
/// close that carries them is refused: `check_close_state`).
fn as_discard(close: &mut api::CloseSessionRequest, reason: String) {
    close.action = api::EndAction::Discard as i32;
    close.reason = reason;
    close.state.clear();
    close.labels.clear();
    close.command.clear();
}
