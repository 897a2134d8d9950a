//! A way out of a conflict (issue 10): show why a session conflicts, with the
//! three-way view of its text files, and rebase it onto the branch head so that
//! its owner can resolve the conflict and publish again.
//!
//! **Show** ([`Engine::conflicts`]): per conflicting path of the session's last
//! outcome, the gate's reason and — for a regular text file on all three sides
//! — the merge of the session's version and the head's against the lease's,
//! conflicts written out with git's diff3 markers (`<<<<<<< session`,
//! `||||||| lease`, `=======`, `>>>>>>> head`). Output only: nothing is written.
//! After a rebase, a file it wrote markers into that still holds a block is
//! shown as it is, its blocks counted by the publish's rule below ("awaiting
//! resolution"); the outcome's other paths, while the session leases the head
//! it was rebased onto, read as merged by the rebase.
//!
//! **Rebase** ([`Engine::rebase`]): a session whose run ended in conflict keeps
//! its upper and lease. With its container stopped (the upper quiescent), the
//! upper is planned against the current head as a dry run does (every merge
//! attempted). Refused, changing nothing, when a path conflicts in a way markers
//! cannot show (delete vs edit, a type change, binary files, metadata changed
//! differently, a merge cap). Otherwise, in this order: the conflict blocks'
//! digests are recorded under the old lease; the plan's edits (merged files,
//! head metadata, dropped copy-up noise) and the files with markers are written
//! into the upper (each a new inode, renamed in); the lease moves to the head
//! and the blocks are recorded under the new lease (one transaction). The
//! outcome stays `conflict`; the container's next run mounts the new head under
//! its upper. A Mode B (sandbox) session in conflict is rebased the same way:
//! its holder released it when it closed, but its upper and lease are kept;
//! it is published again with `layerstack publish --session ID`, after which
//! its directories go (the holder is gone: nothing mounts it again). Like a publish, the rebase applies the exclusion policy to the
//! upper (excluded paths are removed).
//!
//! **Refusal**: while the session holds the lease a rebase recorded marker
//! rows under, a publish (and a dry run) is refused — outcome `conflict`, each
//! path's reason naming the first `<<<<<<< session` line — as long as a file
//! the rebase wrote markers into still holds a marker block: a line exactly
//! `<<<<<<< session` followed later by a line exactly `>>>>>>> head`, whatever
//! is between ([`publisher::conflict_blocks`], git's rule for unmerged
//! markers). Editing inside a block does not resolve it; editing the marker
//! lines away, or deleting the file, does, and the publish then goes through
//! the gate like any other. Only those paths are checked: a marker block in
//! another file is content like any other. A second rebase carries the rows of
//! files still holding a block onto the new lease.

use std::collections::BTreeSet;
use std::sync::Arc;

use layerstack_publisher::{self as publisher, Action, GateFiles, LayerView, Side};
use layerstack_store::{
    ManifestId, MarkerRecord, OutcomeKind, OutcomeRecord, PathRecord, PathStatus, SessionId,
    SessionInfo, Store, StoreError,
};
use tracing::info;

use crate::blame::View;
use crate::publish::{files, gate_input};
use crate::{Engine, EngineError};

/// One conflicting path of a session ([`Engine::conflicts`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConflictView {
    /// Relative path, bytes, no leading `/`.
    pub path: Vec<u8>,
    /// The gate's reason; after a rebase, where the path stands now (its
    /// markers awaiting resolution, resolved, or merged by the rebase).
    pub reason: String,
    /// The three-way view with markers (text files on all three sides); after
    /// a rebase, the session's file with the markers as it is now.
    pub text: Option<Vec<u8>>,
    /// Conflict marker blocks in `text` (`<<<<<<< session` … `>>>>>>> head`).
    pub blocks: usize,
    /// Why there is no three-way view (also when `text` is the session's file).
    pub note: Option<String>,
}

/// What [`Engine::rebase`] did.
#[derive(Debug, Clone)]
pub struct Rebased {
    /// The session now (lease on `manifest`, outcome still `conflict`).
    pub session: SessionInfo,
    /// The head manifest the session was moved onto.
    pub manifest: ManifestId,
    /// Paths the head changed that were merged into the upper.
    pub merged: Vec<Vec<u8>>,
    /// Files that now hold conflict markers, with their number of blocks.
    pub marked: Vec<(Vec<u8>, usize)>,
}

/// The line (from 1) where byte `at` of `content` is.
fn line_at(content: &[u8], at: usize) -> u32 {
    let n = content[..at.min(content.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count();
    u32::try_from(n + 1).unwrap_or(u32::MAX)
}

/// The marker blocks of `content` as records of `path`.
fn marker_records(path: &[u8], content: &[u8]) -> Vec<MarkerRecord> {
    publisher::conflict_blocks(content)
        .into_iter()
        .map(|b| MarkerRecord {
            path: path.to_vec(),
            digest: publisher::digest_bytes(&content[b.clone()]),
            line: line_at(content, b.start),
        })
        .collect()
}

/// The marker blocks left in one file: how many, and the line (from 1) of the
/// first one's `<<<<<<< session`.
type BlocksLeft = (usize, u32);

/// [`BlocksLeft`] of `content` (see [`publisher::conflict_blocks`]); `None`
/// when it holds no block.
fn blocks_left(content: &[u8]) -> Option<BlocksLeft> {
    let blocks = publisher::conflict_blocks(content);
    let first = blocks.first()?;
    Some((blocks.len(), line_at(content, first.start)))
}

/// A path a rebase wrote markers into, and what its file holds now.
struct Marked {
    path: Vec<u8>,
    /// `None` when the markers were edited away or the file is gone.
    left: Option<BlocksLeft>,
}

/// The paths session `id`'s current lease has marker rows for, each with what
/// its file in `upper` holds now. Empty when the session was never rebased
/// onto its current lease.
fn marked_paths(
    store: &Store,
    id: SessionId,
    upper: &std::path::Path,
    userxattr: bool,
) -> Result<Vec<Marked>, StoreError> {
    let paths: BTreeSet<Vec<u8>> = store
        .session_markers(id)?
        .into_iter()
        .map(|m| m.path)
        .collect();
    if paths.is_empty() {
        return Ok(Vec::new());
    }
    let upper_view = LayerView::new(vec![upper.to_path_buf()]).with_userxattr(userxattr);
    paths
        .into_iter()
        .map(|path| {
            let content = upper_view.read_regular(&path).map_err(|e| {
                use std::os::unix::ffi::OsStrExt;
                StoreError::Io(upper.join(std::ffi::OsStr::from_bytes(&path)), e)
            })?;
            let left = content.as_deref().and_then(blocks_left);
            Ok(Marked { path, left })
        })
        .collect()
}

/// The outcome that refuses a publish of session `id` whose upper still holds
/// a conflict marker block in a file `layerstack session rebase` wrote markers
/// into (see the module docs); `None` when none is left (or the session was
/// never rebased onto its current lease).
pub(crate) fn markers_left(
    store: &Store,
    id: SessionId,
    upper: &std::path::Path,
    userxattr: bool,
) -> Result<Option<OutcomeRecord>, StoreError> {
    let paths: Vec<PathRecord> = marked_paths(store, id, upper, userxattr)?
        .into_iter()
        .filter_map(|Marked { path, left }| {
            let (blocks, first) = left?;
            Some(PathRecord {
                path,
                status: PathStatus::Conflict,
                reason: format!(
                    "still holds {blocks} conflict marker block(s) (`<<<<<<< session` … `>>>>>>> head`; the first `<<<<<<< session` at line {first}) where `layerstack session rebase` wrote markers: edit the markers away (or delete the file) and publish again, or discard"
                ),
            })
        })
        .collect();
    if paths.is_empty() {
        return Ok(None);
    }
    let list: Vec<String> = paths
        .iter()
        .take(10)
        .map(|p| layerstack_store::escape_path(&p.path))
        .collect();
    Ok(Some(OutcomeRecord {
        kind: OutcomeKind::Conflict,
        message: Some(format!(
            "{} file(s) still hold conflict markers where `layerstack session rebase` wrote them ({}{}); nothing of this session was published; its upper is kept",
            paths.len(),
            list.join(", "),
            if paths.len() > 10 { ", …" } else { "" }
        )),
        paths,
        timings: None,
        interrupted_by: None,
    }))
}

/// Three-way choice of one metadata field (the gate's `pick`): the side that
/// changed it; ours when both did (the gate refused such a path already).
fn pick<T: PartialEq + Clone>(base: Option<&T>, ours: &T, theirs: &T) -> T {
    if base == Some(ours) {
        theirs.clone()
    } else {
        ours.clone()
    }
}

/// The view of a file a rebase wrote markers into that still holds a block:
/// the file as it is, its blocks counted by the rule of the publish's guard.
fn awaiting_view(path: Vec<u8>, content: Vec<u8>, (blocks, first): BlocksLeft) -> ConflictView {
    ConflictView {
        path,
        reason: format!(
            "awaiting resolution: {blocks} conflict marker block(s) `layerstack session rebase` wrote are in the session's file (the first `<<<<<<< session` at line {first}); edit the marker lines away (or delete the file), then publish"
        ),
        text: Some(content),
        blocks,
        note: Some(
            "no three-way view: the rebase moved the session onto the head and wrote the markers into its file, shown as it is now".into(),
        ),
    }
}

/// Everything the conflict commands read, outside the gate (no lock needed:
/// layers are immutable and the session's upper is quiescent or only read).
///
/// After a rebase (marker rows under the current lease), a file that still
/// holds a marker block is shown as it is ([`awaiting_view`]), whatever the
/// recorded reason said; while the session still leases the head it was
/// rebased onto, the other paths of the outcome were merged into its upper (or
/// their markers removed) and have no three-way view.
fn conflict_views(
    store: &Store,
    settings: &crate::EngineSettings,
    s: &SessionInfo,
    lease: ManifestId,
) -> Result<Vec<ConflictView>, EngineError> {
    let outcome = s.outcome.as_ref().ok_or_else(|| not_in_conflict(s))?;
    let head = store.branch_head(&s.stack, &s.branch)?;
    let lease_view = View::new(store.session_view_layers(s.id, lease)?, settings.userxattr);
    let head_view = View::new(store.session_view_layers(s.id, head)?, settings.userxattr);
    let upper = LayerView::new(vec![s.upper.clone()]).with_userxattr(settings.userxattr);
    let mut marked: std::collections::BTreeMap<Vec<u8>, Option<BlocksLeft>> =
        marked_paths(store, s.id, &s.upper, settings.userxattr)?
            .into_iter()
            .map(|m| (m.path, m.left))
            .collect();
    let rebased_on_head = !marked.is_empty() && lease == head;
    let read_upper = |path: &[u8]| -> Result<Vec<u8>, EngineError> {
        Ok(upper
            .read_regular(path)
            .map_err(|e| EngineError::Read(layerstack_store::escape_path(path), e))?
            .unwrap_or_default())
    };
    let mut out = Vec::new();
    let mut after: Option<Vec<u8>> = None;
    loop {
        let page = store.outcome_paths(
            outcome.id,
            after.as_deref(),
            1000,
            Some(PathStatus::Conflict),
        )?;
        let Some(last) = page.last() else { break };
        after = Some(last.path.clone());
        for r in page {
            match marked.remove(&r.path) {
                Some(Some(left)) => {
                    let content = read_upper(&r.path)?;
                    out.push(awaiting_view(r.path, content, left));
                    continue;
                }
                Some(None) if rebased_on_head => {
                    out.push(ConflictView {
                        path: r.path,
                        reason: "resolved: the conflict markers `layerstack session rebase` wrote were removed; publish again".into(),
                        text: None,
                        blocks: 0,
                        note: Some("no three-way view: the session leases the head it was rebased onto".into()),
                    });
                    continue;
                }
                None if rebased_on_head => {
                    out.push(ConflictView {
                        path: r.path,
                        reason: "merged into the session's file by `layerstack session rebase` (no markers); publish again".into(),
                        text: None,
                        blocks: 0,
                        note: Some("no three-way view: the session leases the head it was rebased onto".into()),
                    });
                    continue;
                }
                _ => {}
            }
            let read = |v: &LayerView| -> Result<Option<Vec<u8>>, EngineError> {
                v.read_regular(&r.path)
                    .map_err(|e| EngineError::Read(layerstack_store::escape_path(&r.path), e))
            };
            let (b, o, t) = (
                read(&lease_view.view)?,
                read(&upper)?,
                read(&head_view.view)?,
            );
            let (text, blocks, note) = match (b, o, t) {
                (Some(b), Some(o), Some(t)) => {
                    match publisher::render_conflict(&b, &o, &t, &settings.merge) {
                        Ok((text, n)) => (Some(text), n, None),
                        Err(why) => (None, 0, Some(format!("no three-way view: {why}"))),
                    }
                }
                (b, o, t) => {
                    let what = |v: &Option<Vec<u8>>| {
                        if v.is_some() {
                            "a file"
                        } else {
                            "no regular file"
                        }
                    };
                    (
                        None,
                        0,
                        Some(format!(
                            "no three-way view: the session has {}, the lease {}, the head {}",
                            what(&o),
                            what(&b),
                            what(&t)
                        )),
                    )
                }
            };
            out.push(ConflictView {
                path: r.path,
                reason: r.reason,
                text,
                blocks,
                note,
            });
        }
    }
    // Marked files still holding a block that the outcome does not list (the
    // rebase met a newer head than the publish did).
    for (path, left) in marked {
        if let Some(left) = left {
            let content = read_upper(&path)?;
            out.push(awaiting_view(path, content, left));
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

fn not_in_conflict(s: &SessionInfo) -> EngineError {
    EngineError::FailedPrecondition(format!(
        "session {} ({}) is not in conflict: its last outcome is {}",
        s.id,
        s.owner.display(),
        s.outcome.as_ref().map_or("none yet", |o| o.kind.as_str())
    ))
}

/// Why session `s` cannot be rebased, if it cannot: its last outcome is not a
/// conflict, its conflicting writes are gone (no lease), or a container that
/// let go of it (containerd removed the snapshot) owned it. A sandbox session
/// in conflict is released by its holder when it closes and keeps its upper
/// and lease for this (its next publish is `layerstack publish --session`).
fn cannot_rebase(s: &SessionInfo) -> Option<EngineError> {
    if s.outcome.as_ref().map(|o| o.kind) != Some(OutcomeKind::Conflict) {
        return Some(not_in_conflict(s));
    }
    if s.lease_manifest.is_none() {
        return Some(EngineError::FailedPrecondition(format!(
            "session {} ({}) conflicted, but its writes were dropped since (it holds no lease): nothing to rebase",
            s.id,
            s.owner.display()
        )));
    }
    if s.released && !s.owner.is_sandbox() {
        return Some(EngineError::FailedPrecondition(format!(
            "session {} ({}) conflicted and its owner let go of it (the container's snapshot was removed): its writes are kept for inspection only; discard them with `layerstack publish --discard --session {}`",
            s.id,
            s.owner.display(),
            s.id
        )));
    }
    None
}

impl Engine {
    /// The conflicting paths of session `id`'s last outcome with their
    /// three-way views (see the module docs). Changes nothing.
    ///
    /// Errors: `SessionNotFound`; [`EngineError::FailedPrecondition`] when the
    /// last outcome is not a conflict or the session holds no lease.
    pub async fn conflicts(&self, id: SessionId) -> Result<Vec<ConflictView>, EngineError> {
        let s = self.session(id).await?;
        if s.outcome.as_ref().map(|o| o.kind) != Some(OutcomeKind::Conflict) {
            return Err(not_in_conflict(&s));
        }
        let lease = s.lease_manifest.ok_or_else(|| not_in_conflict(&s))?;
        let store = self.store.clone();
        let settings = self.settings.clone();
        tokio::task::spawn_blocking(move || conflict_views(&store, &settings, &s, lease))
            .await
            .map_err(|e| EngineError::Join(e.to_string()))?
    }

    /// Moves conflicting session `id` onto its branch's head (see the module
    /// docs). Takes the session lock; its upper must not be mounted anywhere.
    ///
    /// Errors: `SessionNotFound`; [`EngineError::Mounted`];
    /// [`EngineError::FailedPrecondition`] when the session is not in conflict,
    /// is already on the head, or conflicts in a way markers cannot show (the
    /// message lists the paths); [`EngineError::Run`] when capturing, planning
    /// or writing failed (the upper may then hold merged files; the lease and
    /// markers are unchanged — rebase again).
    pub async fn rebase(self: &Arc<Self>, id: SessionId) -> Result<Rebased, EngineError> {
        let _g = self.lock_session(id).await;
        let s = self.session(id).await?;
        if let Some(e) = cannot_rebase(&s) {
            return Err(e);
        }
        self.ensure_quiescent(&s).await?;
        let store = self.store.clone();
        let settings = self.settings.clone();
        let pins = self.pins.clone();
        let r = tokio::task::spawn_blocking(move || -> Result<Rebased, EngineError> {
            let run = |e: crate::RunError| EngineError::Run(Box::new(e));
            let ctx = store.publish_context(id)?;
            let upper = ctx.session.upper.clone();
            let head = store.head_view(id)?;
            let _pin = pins.pin(head.manifest);
            if head.manifest == ctx.lease_manifest {
                return Err(EngineError::FailedPrecondition(format!(
                    "session {id} already leases its branch's head (manifest {}): nothing to rebase; publish it again",
                    head.manifest
                )));
            }
            let view = LayerView::new(ctx.lease_lowers.clone()).with_userxattr(settings.userxattr);
            let cs = publisher::capture_with(&upper, &view, &settings.capture_options(&ctx.session))
                .map_err(|e| run(e.into()))?;
            if !cs.edits.is_empty() {
                publisher::prepare_upper(&upper, &cs, settings.userxattr)
                    .map_err(|e| run(e.into()))?;
            }
            // Files an earlier rebase wrote markers into that still hold a block:
            // the guard follows them onto the new lease.
            let carried: Vec<Vec<u8>> = marked_paths(&store, id, &upper, settings.userxattr)?
                .into_iter()
                .filter(|m| m.left.is_some())
                .map(|m| m.path)
                .collect();
            let input = gate_input(
                &store,
                &settings,
                &upper,
                &view,
                &ctx.session,
                cs,
                (ctx.lease_manifest, head.manifest),
                true,
            )
            .map_err(run)?;
            let f = files(&settings, &view, &head, upper.clone());
            let plan = publisher::plan_gate_with(
                &input.cs,
                &input.head,
                &f,
                &settings.merge,
                publisher::PlanMode::DryRun,
            )
            .map_err(|e| run(e.into()))?;
            let hard: Vec<String> = plan
                .conflicts()
                .filter(|r| !plan.text_conflicts.contains(&r.path))
                .map(|r| format!("{} ({})", layerstack_store::escape_path(&r.path), r.reason))
                .collect();
            if !hard.is_empty() {
                return Err(EngineError::FailedPrecondition(format!(
                    "cannot rebase session {id}: {} path(s) conflict in a way conflict markers cannot show: {}{}; discard the session (layerstack publish --discard) or change those paths and publish again",
                    hard.len(),
                    hard.iter().take(10).cloned().collect::<Vec<_>>().join("; "),
                    if hard.len() > 10 { "; …" } else { "" }
                )));
            }
            let mut actions = plan.actions.clone();
            let mut markers = Vec::new();
            let mut marked = Vec::new();
            for path in &plan.text_conflicts {
                let read = |side: Side| {
                    f.read(side, path)
                        .map_err(|e| EngineError::Read(layerstack_store::escape_path(path), e))
                };
                let (b, o, t) = (read(Side::Base)?, read(Side::Ours)?, read(Side::Theirs)?);
                let (text, n) = publisher::render_conflict(&b, &o, &t, &settings.merge)
                    .map_err(|why| {
                        EngineError::FailedPrecondition(format!(
                            "cannot rebase session {id}: {}: {why}",
                            layerstack_store::escape_path(path)
                        ))
                    })?;
                let stat = |side: Side| {
                    f.stat(side, path)
                        .map_err(|e| EngineError::Read(layerstack_store::escape_path(path), e))
                };
                let (sb, so, st) = (stat(Side::Base)?, stat(Side::Ours)?, stat(Side::Theirs)?);
                let (Some(so), Some(st)) = (so, st) else {
                    return Err(EngineError::FailedPrecondition(format!(
                        "cannot rebase session {id}: {} changed meanwhile",
                        layerstack_store::escape_path(path)
                    )));
                };
                let meta = publisher::Meta {
                    mode: pick(sb.as_ref().map(|b| &b.mode), &so.mode, &st.mode),
                    uid: pick(sb.as_ref().map(|b| &b.uid), &so.uid, &st.uid),
                    gid: pick(sb.as_ref().map(|b| &b.gid), &so.gid, &st.gid),
                    xattrs: pick(sb.as_ref().map(|b| &b.xattrs), &so.xattrs, &st.xattrs),
                };
                markers.extend(marker_records(path, &text));
                marked.push((path.clone(), n));
                actions.push(Action::WriteFile {
                    path: path.clone(),
                    content: text,
                    meta,
                });
            }
            // Markers first (a crash after the edit cannot publish them on the
            // old lease), then the upper, then the lease and markers together.
            store.stage_markers(id, ctx.lease_manifest, &markers)?;
            let edit = publisher::GatePlan {
                actions,
                userxattr: plan.userxattr,
                ..Default::default()
            };
            let durable = store.durability() == layerstack_store::Durability::Durable;
            publisher::apply_plan_with(&upper, &edit, &store.staging_path(), durable)
                .map_err(|e| run(e.into()))?;
            let upper_view = LayerView::new(vec![upper.clone()]).with_userxattr(settings.userxattr);
            for path in carried {
                if plan.text_conflicts.contains(&path) {
                    continue;
                }
                let content = upper_view
                    .read_regular(&path)
                    .map_err(|e| EngineError::Read(layerstack_store::escape_path(&path), e))?
                    .unwrap_or_default();
                let left = marker_records(&path, &content);
                if !left.is_empty() {
                    marked.push((path, left.len()));
                    markers.extend(left);
                }
            }
            marked.sort();
            let session = store.rebase_session(id, ctx.lease_manifest, head.manifest, &markers)?;
            let merged = plan
                .reports
                .iter()
                .filter(|r| r.status == publisher::PathStatus::Merged)
                .map(|r| r.path.clone())
                .collect();
            Ok(Rebased {
                session,
                manifest: head.manifest,
                merged,
                marked,
            })
        })
        .await
        .map_err(|e| EngineError::Join(e.to_string()))??;
        info!(
            session.id = id,
            manifest = r.manifest,
            merged = r.merged.len(),
            marked = r.marked.len(),
            "rebased onto the head"
        );
        // Not an outcome (the run's stays `conflict`, announced once when it was
        // recorded): only waiters are woken.
        self.changed();
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marker_records_name_their_line() {
        let (text, n) = publisher::render_conflict(
            b"a\nb\nc\n",
            b"a\nB\nc\n",
            b"a\nbee\nc\n",
            &publisher::MergeOptions::default(),
        )
        .unwrap_or_default();
        assert_eq!(n, 1);
        let m = marker_records(b"f", &text);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].line, 2);
        assert_eq!(line_at(b"x\ny\n", 2), 2);
        assert_eq!(pick(Some(&1), &1, &2), 2);
        assert_eq!(pick(Some(&1), &3, &1), 3);
        assert_eq!(pick(None, &3, &4), 3);
    }
}
