//! The engine's and the store's types in the admin API's wire form
//! (`api/proto/admin.proto`). They live here because the daemon is the only
//! crate that links the engine: `layerstack-api` speaks the vocabulary of
//! `layerstack-types` only, so its clients (the shim, the CLI) link no SQLite
//! (ARCHITECTURE.md §4).

use layerstack_api as api;
use layerstack_engine::store::{
    escape_path, MountSpec, Owner, PathCounts, PathRecord, PathStatus, SessionInfo,
};
use layerstack_engine::EngineError;

/// At most this many conflicts are inlined in an [`api::Session`].
pub const INLINE_CONFLICTS: usize = 100;

/// [`api::status`] of an engine error: its kind's code, the error with its
/// causes as the message.
pub fn engine_status(e: &EngineError) -> tonic::Status {
    api::status(e.kind(), api::error_chain(e))
}

/// The wire form of a path verdict: the path escaped for display, and raw.
pub fn path_verdict(p: &PathRecord) -> api::PathVerdict {
    api::PathVerdict {
        path: escape_path(&p.path),
        status: p.status.as_str().to_string(),
        reason: p.reason.clone(),
        raw_path: p.path.clone(),
    }
}

/// The wire form of verdict counts.
pub fn path_counts(c: &PathCounts) -> api::PathCounts {
    api::PathCounts {
        clean: c.clean,
        merged: c.merged,
        conflict: c.conflict,
        excluded: c.excluded,
    }
}

/// The wire form of a session; `conflicts` are the first conflicting paths of its
/// outcome (the caller reads at most [`INLINE_CONFLICTS`] + 1 to know whether
/// there are more).
pub fn session(s: &SessionInfo, conflicts: &[PathRecord]) -> api::Session {
    let (namespace, container) = match &s.owner {
        Owner::Container { namespace, id } => (namespace.clone(), id.clone()),
        Owner::Sandbox { .. } | Owner::Wasi { .. } | Owner::Operation { .. } => {
            (String::new(), String::new())
        }
    };
    let o = s.outcome.as_ref();
    api::Session {
        id: s.id,
        namespace,
        container,
        key: s.key.clone().unwrap_or_default(),
        stack: s.stack.clone(),
        branch: s.branch.clone(),
        state: s.state.as_str().to_string(),
        outcome: o.map(|o| o.kind.as_str().to_string()).unwrap_or_default(),
        conflicts: conflicts
            .iter()
            .filter(|p| p.status == PathStatus::Conflict)
            .take(INLINE_CONFLICTS)
            .map(|p| api::ConflictPath {
                path: escape_path(&p.path),
                reason: p.reason.clone(),
            })
            .collect(),
        conflicts_truncated: conflicts
            .iter()
            .filter(|p| p.status == PathStatus::Conflict)
            .count()
            > INLINE_CONFLICTS,
        layer: o.and_then(|o| o.layer).unwrap_or(0),
        message: o.and_then(|o| o.message.clone()).unwrap_or_default(),
        released: s.released,
        run: s.run,
        paths: vec![],
        dry_run: false,
        timings: o.and_then(|o| o.timings).map(|t| api::PublishTimings {
            capture_us: t.capture_us,
            gate_wait_us: t.gate_wait_us,
            gate_hold_us: t.gate_hold_us,
            total_us: t.total_us,
            capture_bytes: t.capture_bytes,
        }),
        owner_kind: s.owner.kind().as_str().to_string(),
        owner: s.owner.display(),
        outcome_id: o.map(|o| o.id).unwrap_or(0),
        counts: o.map(|o| path_counts(&o.counts)),
        policy: s.policy.clone().unwrap_or_default(),
        node: o.and_then(|o| o.node.clone()).unwrap_or_default(),
        interrupted_by: o
            .and_then(|o| o.interrupted_by)
            .map(|i| i.as_str().to_string())
            .unwrap_or_default(),
        daemon_owned: s.daemon_owned,
        id_map: s.id_map.map(|m| api::IdMap {
            host_uid: m.host_uid,
            host_gid: m.host_gid,
            size: m.size,
        }),
        limits: None,
        branch_created: s.branch_created,
    }
}

/// The wire form of a mount spec (containerd's `Mount`, without target).
pub fn mounts(spec: &MountSpec) -> Vec<api::Mount> {
    let options = spec.overlay_options();
    match spec {
        MountSpec::Bind { source, .. } => vec![api::Mount {
            r#type: "bind".into(),
            source: source.display().to_string(),
            options,
        }],
        MountSpec::Overlay { .. } => vec![api::Mount {
            r#type: "overlay".into(),
            source: "overlay".into(),
            options,
        }],
    }
}

/// The path status named `s` in a request ("" = any).
///
/// # Errors
/// The message for an `InvalidArgument`, naming the accepted values.
pub fn parse_status(s: &str) -> Result<Option<PathStatus>, String> {
    if s.is_empty() {
        return Ok(None);
    }
    PathStatus::parse(s).map(Some).ok_or_else(|| {
        format!("unknown path status {s:?}: use clean, merged, conflict or excluded")
    })
}
