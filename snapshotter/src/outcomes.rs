//! Follows the engine's outcome events: one `info` line per recorded outcome
//! (publish, no change, conflict, discard, failure) — one per ended run, and one
//! per retryable outcome a later publish or discard follows; a rebase records
//! none — with the session, its owner, stack,
//! branch, outcome, layer, path counts and duration, and the metrics of
//! [`crate::metrics`].
//!
//! The line carries a duration only when the engine recorded the publish's
//! timings (outcomes that gated: committed, merged, conflict); for no-change,
//! discarded and failed runs it records none.

use std::sync::Arc;

use layerstack_engine::store::{escape_path, PathStatus, SessionInfo};
use layerstack_engine::{error_chain, Engine, OutcomeEvent};
use tokio::sync::broadcast::error::RecvError;
use tracing::{info, warn};

use crate::metrics::Metrics;

/// At most this many conflicting paths are named in a line.
const CONFLICTS_IN_LINE: usize = 5;

/// Subscribes to `engine`'s outcomes; call before anything can publish. Runs
/// until the engine is dropped.
pub fn watch(
    engine: &Arc<Engine>,
    metrics: Option<Arc<Metrics>>,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let mut rx = engine.subscribe();
    let engine = engine.clone();
    async move {
        loop {
            match rx.recv().await {
                Ok(ev) => handle(&engine, metrics.as_deref(), ev).await,
                Err(RecvError::Lagged(n)) => {
                    warn!(missed = n, "outcome events missed: their lines and metrics are lost (layerstack session ls still shows the outcomes)");
                    if let Some(m) = &metrics {
                        m.missed(n);
                    }
                }
                Err(RecvError::Closed) => return,
            }
        }
    }
}

async fn handle(engine: &Engine, metrics: Option<&Metrics>, ev: OutcomeEvent) {
    let session = engine.session(ev.session).await;
    // The session may have moved on to a later run: its outcome is then not
    // this event's.
    let outcome = match &session {
        Ok(s) => s.outcome.clone().filter(|o| o.run == ev.run),
        Err(_) => None,
    };
    if let Some(m) = metrics {
        m.outcome(ev.kind, outcome.as_ref().and_then(|o| o.timings.as_ref()));
    }
    let s: &SessionInfo = match &session {
        Ok(s) => s,
        Err(e) => {
            info!(
                session.id = ev.session,
                run = ev.run,
                outcome = ev.kind.as_str(),
                error = %error_chain(e),
                "publish outcome (session no longer readable)"
            );
            return;
        }
    };
    let Some(o) = outcome else {
        info!(
            session.id = ev.session,
            run = ev.run,
            outcome = ev.kind.as_str(),
            owner = %s.owner.display(),
            "publish outcome (the session has started another run since)"
        );
        return;
    };
    let conflicts = if o.counts.conflict > 0 {
        let id = o.id;
        engine
            .outcome_paths(id, None, CONFLICTS_IN_LINE, Some(PathStatus::Conflict))
            .await
            .map(|ps| {
                ps.iter()
                    .map(|p| escape_path(&p.path))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default()
    } else {
        String::new()
    };
    let duration_ms = o.timings.map(|t| t.total_us as f64 / 1000.0);
    info!(
        session.id = s.id,
        run = ev.run,
        owner = %s.owner.display(),
        stack = %s.stack,
        branch = %s.branch,
        outcome = ev.kind.as_str(),
        layer.id = o.layer,
        paths.clean = o.counts.clean,
        paths.merged = o.counts.merged,
        paths.conflict = o.counts.conflict,
        paths.excluded = o.counts.excluded,
        conflicts = (!conflicts.is_empty()).then_some(conflicts.as_str()),
        duration_ms,
        detail = o.message.as_deref(),
        "publish outcome"
    );
}
