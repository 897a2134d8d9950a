//! Blame: who wrote each line of a published text file (ARCHITECTURE.md §2;
//! seed `000`, "File-operation blame"; rows: `store/src/blame.rs`).
//!
//! **At publish time**, for every regular text file the new layer holds (the
//! binary gate is [`publisher::is_binary`]), the published version's lines get
//! owners, and the rows are staged with the layer — outside the gate; a gate
//! that plans again restages only the paths the head changed:
//!
//! * the head already had exactly this version (both sides wrote the same, or
//!   the session took the head's content) → the head version's owners;
//! * a three-way merge → per line its origin ([`publisher::LineOrigin`]): a
//!   base line keeps the lease version's owner, a head line the head version's,
//!   a session line is the session's;
//! * otherwise a line diff from the lease's version: unchanged lines keep their
//!   owners, the others are the session's (`session:<container id | sandbox
//!   name>`, or `operation:<id>` for an operation's session such as promote).
//!
//! A version's owners come from its recorded rows; a version without rows is
//! `original` when the file comes from a base (image) layer, else unknown. Lines
//! of unknown owner stay unknown (never a guessed owner). Blame is best effort:
//! a file that cannot be read or diffed gets no rows (its lines read `unknown`)
//! and the publish goes on.
//!
//! **Queries** ([`Engine::blame`]): the path's version on a branch head, its
//! rows, tiled over every line and coalesced into ranges.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use layerstack_publisher::{self as publisher, Action, GatePlan, HeadChange, LayerView};
use layerstack_store::{
    coalesce, tile, FileBlame, LayerId, LayerKind, LineOwner, ManifestId, OwnerRange, SessionInfo,
    Store, StoreError, ViewLayer,
};
use tracing::{debug, warn};

use crate::{Engine, EngineError, EngineSettings};

/// A view of layers with what each one is.
pub(crate) struct View {
    pub(crate) view: LayerView,
    pub(crate) layers: Vec<ViewLayer>,
}

impl View {
    pub(crate) fn new(layers: Vec<ViewLayer>, userxattr: bool) -> View {
        View {
            view: LayerView::new(layers.iter().map(|l| l.dir.clone()).collect())
                .with_userxattr(userxattr),
            layers,
        }
    }

    pub(crate) fn ids(&self) -> Vec<LayerId> {
        self.layers.iter().map(|l| l.id).collect()
    }
}

/// A regular file's version in a view: its bytes, per-line owners (`None`:
/// unknown), and the layer it comes from.
pub(crate) struct Version {
    pub(crate) content: Vec<u8>,
    pub(crate) owners: Vec<Option<LineOwner>>,
    pub(crate) layer: ViewLayer,
    /// Over the caller's size limit: not read, no content, no owners.
    pub(crate) skipped: bool,
}

/// Lines of `data`: each ends after `\n`; a last line without one counts.
pub(crate) fn lines(data: &[u8]) -> usize {
    data.split_inclusive(|&b| b == b'\n').count()
}

fn read_err(what: &str, path: &[u8]) -> impl FnOnce(std::io::Error) -> EngineError {
    let what = format!("{what} {}", layerstack_store::escape_path(path));
    move |e| EngineError::Read(what, e)
}

/// The version of `path` in `v` with its owners; `None` when no regular file is
/// visible there. A binary version has no line owners.
pub(crate) fn version(
    store: &Store,
    stack: &str,
    v: &View,
    path: &[u8],
) -> Result<Option<Version>, EngineError> {
    version_in(store, stack, v, &mut v.view.lookups(), path, u64::MAX)
}

/// [`version`] with the lookups of `v` shared with the caller's other paths;
/// a version over `max` bytes is not read ([`Version::skipped`]).
fn version_in(
    store: &Store,
    stack: &str,
    v: &View,
    lookups: &mut publisher::Lookups<'_>,
    path: &[u8],
    max: u64,
) -> Result<Option<Version>, EngineError> {
    let entry = match lookups.lookup(path) {
        Ok(Some(e)) if e.kind == publisher::FileKind::Regular => e,
        Ok(_) => return Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
            return Err(EngineError::InvalidArgument(format!(
                "{} is not a path inside the tree: give it as /dir/file",
                layerstack_store::escape_path(path)
            )))
        }
        Err(e) => return Err(read_err("the layers at", path)(e)),
    };
    let layer = v.layers[entry.layer_index].clone();
    if entry.size > max {
        // Not read: its lines' owners are unknown.
        return Ok(Some(Version {
            content: Vec::new(),
            owners: Vec::new(),
            layer,
            skipped: true,
        }));
    }
    let content = lookups
        .read_entry(path, &entry)
        .map_err(read_err("the layers at", path))?;
    let n = lines(&content);
    if publisher::is_binary(&content) {
        return Ok(Some(Version {
            content,
            owners: vec![None; n],
            layer,
            skipped: false,
        }));
    }
    let digest = publisher::digest_bytes(&content);
    let owners = match store.version_blame(stack, &v.ids(), path, &digest)? {
        Some(ranges) => tile(&ranges, n),
        None if layer.kind == LayerKind::Base => vec![Some(LineOwner::Original); n],
        None => vec![None; n],
    };
    Ok(Some(Version {
        content,
        owners,
        layer,
        skipped: false,
    }))
}

/// One view walked for many paths in a row (a publish's index, in path
/// order): versions over [`BLAME_MAX_BYTES`] are not read.
struct Walk<'v> {
    store: &'v Store,
    stack: &'v str,
    view: &'v View,
    lookups: publisher::Lookups<'v>,
}

impl<'v> Walk<'v> {
    fn new(store: &'v Store, stack: &'v str, view: &'v View) -> Walk<'v> {
        Walk {
            store,
            stack,
            view,
            lookups: view.view.lookups(),
        }
    }

    fn version(&mut self, path: &[u8]) -> Result<Option<Version>, EngineError> {
        version_in(
            self.store,
            self.stack,
            self.view,
            &mut self.lookups,
            path,
            BLAME_MAX_BYTES,
        )
    }
}

/// Files larger than this (bytes) get no blame rows (their lines read
/// `unknown`): reading one whole into memory to diff it costs more than its
/// blame is worth (a 1 GiB build artefact, a dataset). 16 MiB.
pub(crate) const BLAME_MAX_BYTES: u64 = 16 << 20;

/// The published content of `path` after `plan` is applied: the merge's
/// output, the head's content, or the session's (the upper); `None` when
/// nothing regular is there or it is over [`BLAME_MAX_BYTES`].
fn published_content<'v>(
    actions: &HashMap<&[u8], &Action>,
    path: &[u8],
    upper: &mut publisher::Lookups<'v>,
    head: &mut publisher::Lookups<'v>,
) -> Result<Option<Vec<u8>>, EngineError> {
    let (from, what) = match actions.get(path) {
        Some(Action::WriteFile { content, .. }) => {
            return Ok((content.len() as u64 <= BLAME_MAX_BYTES).then(|| content.clone()))
        }
        Some(Action::CopyFile { .. }) => (head, "the head's version of"),
        _ => (upper, "the session's version of"),
    };
    match from.lookup(path).map_err(read_err(what, path))? {
        Some(e) if e.kind == publisher::FileKind::Regular && e.size <= BLAME_MAX_BYTES => from
            .read_entry(path, &e)
            .map(Some)
            .map_err(read_err(what, path)),
        _ => Ok(None),
    }
}

/// The blame of every text file `plan` publishes (see the module docs); with
/// `only`, of those paths only. Files that cannot be blamed are left out (their
/// lines read `unknown`) with a warning.
#[allow(clippy::too_many_arguments)]
pub(crate) fn blame_plan(
    store: &Store,
    settings: &EngineSettings,
    session: &SessionInfo,
    lease: &View,
    head: &View,
    head_changes: &[HeadChange],
    plan: &GatePlan,
    upper: &Path,
    only: Option<&BTreeSet<Vec<u8>>>,
) -> Vec<FileBlame> {
    let me = LineOwner::of_session(&session.owner, session.id);
    let head_at: HashMap<&[u8], &HeadChange> = {
        let mut m = HashMap::new();
        for h in head_changes {
            // The first occurrence is the path's final state on the head.
            m.entry(h.path.as_slice()).or_insert(h);
        }
        m
    };
    let actions: HashMap<&[u8], &Action> = plan
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::WriteFile { path, .. } | Action::CopyFile { path, .. } => {
                Some((path.as_slice(), a))
            }
            _ => None,
        })
        .collect();
    // One walker per view: consecutive paths (the index is in path order)
    // share their directories' lookups.
    let upper_view = LayerView::new(vec![upper.to_path_buf()]);
    let mut upper_lk = upper_view.lookups();
    let mut lease = Walk::new(store, &session.stack, lease);
    let mut head = Walk::new(store, &session.stack, head);
    let mut out = Vec::new();
    for idx in &plan.index {
        if idx.kind != publisher::HeadChangeKind::Write {
            continue;
        }
        let Some(digest) = idx.digest else { continue };
        if only.is_some_and(|o| !o.contains(&idx.path)) {
            continue;
        }
        let path = idx.path.as_slice();
        let r = (|| -> Result<Option<FileBlame>, EngineError> {
            let Some(content) =
                published_content(&actions, path, &mut upper_lk, &mut head.lookups)?
            else {
                return Ok(None);
            };
            let n = lines(&content);
            if n == 0 || publisher::is_binary(&content) {
                // No lines to own (an empty file: most of a big publish's files).
                return Ok(None);
            }
            let on_head = head_at.get(path).and_then(|h| h.digest) == Some(digest);
            let owners: Vec<Option<LineOwner>> = if on_head {
                // The head had exactly this version already.
                match head.version(path)? {
                    Some(v) if v.owners.len() == n => v.owners,
                    _ => vec![None; n],
                }
            } else if let Some(origins) = plan.origins.get(path) {
                let base = lease.version(path)?;
                let theirs = head.version(path)?;
                let pick = |v: &Option<Version>, i: usize| {
                    v.as_ref().and_then(|v| v.owners.get(i).cloned().flatten())
                };
                origins
                    .iter()
                    .map(|o| match *o {
                        publisher::LineOrigin::Base(i) => pick(&base, i),
                        publisher::LineOrigin::Theirs(i) => pick(&theirs, i),
                        publisher::LineOrigin::Ours(_) => Some(me.clone()),
                    })
                    .collect()
            } else {
                match lease.version(path)? {
                    Some(old) if old.skipped => vec![None; n],
                    Some(old) => publisher::unchanged_lines(
                        &old.content,
                        &content,
                        settings.merge.diff_algorithm,
                    )
                    .into_iter()
                    .map(|u| match u {
                        Some(i) => old.owners.get(i).cloned().flatten(),
                        None => Some(me.clone()),
                    })
                    .collect(),
                    None => vec![Some(me.clone()); n],
                }
            };
            Ok(Some(FileBlame {
                path: path.to_vec(),
                digest,
                ranges: coalesce(&owners),
            }))
        })();
        match r {
            Ok(Some(f)) => out.push(f),
            Ok(None) => {}
            Err(e) => warn!(
                session.id = session.id,
                path = %layerstack_store::escape_path(path),
                error = %crate::error_chain(&e),
                "no blame recorded for this file (its lines read unknown)"
            ),
        }
    }
    out
}

/// Computes and stages the blame of `plan` as layer `layer`'s rows (best
/// effort: a failure is logged, the publish goes on).
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage(
    store: &Store,
    settings: &EngineSettings,
    session: &SessionInfo,
    (lease, head): (ManifestId, ManifestId),
    head_changes: &[HeadChange],
    plan: &GatePlan,
    upper: &Path,
    layer: LayerId,
    only: Option<&BTreeSet<Vec<u8>>>,
) {
    let views = (|| -> Result<(View, View), StoreError> {
        Ok((
            View::new(
                store.session_view_layers(session.id, lease)?,
                settings.userxattr,
            ),
            View::new(
                store.session_view_layers(session.id, head)?,
                settings.userxattr,
            ),
        ))
    })();
    let (lease, head) = match views {
        Ok(v) => v,
        Err(e) => {
            warn!(session.id = session.id, error = %crate::error_chain(&e), "no blame recorded for this publish");
            return;
        }
    };
    let files = blame_plan(
        store,
        settings,
        session,
        &lease,
        &head,
        head_changes,
        plan,
        upper,
        only,
    );
    debug!(
        session.id = session.id,
        layer.id = layer,
        files = files.len(),
        "blame staged"
    );
    if let Err(e) = crate::publish::store_write(|| store.stage_blame(&session.stack, layer, &files))
    {
        warn!(session.id = session.id, layer.id = layer, error = %crate::error_chain(&e), "no blame recorded for this publish");
    }
}

/// The blame of one file on a branch head ([`Engine::blame`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blame {
    pub stack: String,
    pub branch: String,
    /// The head's manifest.
    pub manifest: ManifestId,
    /// Relative path, bytes, no leading `/`.
    pub path: Vec<u8>,
    /// BLAKE3 of the content.
    pub digest: [u8; 32],
    /// Number of lines (a last line without `\n` counts).
    pub lines: usize,
    /// The layer the file comes from on the head.
    pub layer: LayerId,
    /// `base`, `published` or `squashed`: the kind of that layer.
    pub layer_kind: LayerKind,
    /// Every line, in coalesced ranges (lines of no recorded owner: `Unknown`).
    pub ranges: Vec<OwnerRange>,
}

/// A path as the CLI gives it (`/etc/app.conf`, `etc/app.conf`): relative bytes.
pub(crate) fn relative(path: &[u8]) -> Vec<u8> {
    let mut p = path;
    while let Some(rest) = p.strip_prefix(b"/") {
        p = rest;
    }
    let mut p = p.to_vec();
    while p.ends_with(b"/") {
        p.pop();
    }
    p
}

impl Engine {
    /// Who wrote each line of the text file `path` on `branch`'s head of
    /// `stack` (see the module docs).
    ///
    /// Errors: `BranchNotFound`; [`EngineError::NotFound`] when no regular file
    /// is there; [`EngineError::FailedPrecondition`] for a binary file;
    /// `InvalidArgument` for a malformed path.
    pub async fn blame(
        &self,
        stack: &str,
        branch: &str,
        path: &[u8],
    ) -> Result<Blame, EngineError> {
        let store = self.store.clone();
        let userxattr = self.settings.userxattr;
        let (stack, branch, path) = (stack.to_string(), branch.to_string(), relative(path));
        tokio::task::spawn_blocking(move || -> Result<Blame, EngineError> {
            let manifest = store.branch_head(&stack, &branch)?;
            let view = View::new(store.manifest_view_layers(&stack, manifest)?, userxattr);
            let shown = layerstack_store::escape_path(&path);
            let v = version(&store, &stack, &view, &path)?.ok_or_else(|| {
                EngineError::NotFound(format!(
                    "no regular file {shown} on the head of branch {branch:?} of {stack}"
                ))
            })?;
            if publisher::is_binary(&v.content) {
                return Err(EngineError::FailedPrecondition(format!(
                    "{shown} is a binary file (a NUL in its first 8 KiB or a UTF-16/32 byte-order mark): blame covers text files"
                )));
            }
            let owners: Vec<Option<LineOwner>> = v
                .owners
                .into_iter()
                .map(|o| Some(o.unwrap_or(LineOwner::Unknown)))
                .collect();
            Ok(Blame {
                digest: publisher::digest_bytes(&v.content),
                lines: owners.len(),
                ranges: coalesce(&owners),
                layer: v.layer.id,
                layer_kind: v.layer.kind,
                stack,
                branch,
                manifest,
                path,
            })
        })
        .await
        .map_err(|e| EngineError::Join(e.to_string()))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_from_the_cli_become_relative() {
        assert_eq!(relative(b"/etc/app.conf"), b"etc/app.conf");
        assert_eq!(relative(b"//etc/x/"), b"etc/x");
        assert_eq!(relative(b"a"), b"a");
        assert_eq!(lines(b""), 0);
        assert_eq!(lines(b"a\nb"), 2);
        assert_eq!(lines(b"a\r\nb\n"), 2);
    }
}
