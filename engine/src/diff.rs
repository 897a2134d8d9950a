//! Diff: what changed between two trees of a stack — two branch heads, a head
//! and an earlier manifest of its log, or a session's upper and its lease.
//!
//! **Two manifests**: the candidate paths are the path index rows of the layers
//! in the symmetric difference of the two manifests (squashed layers seen as the
//! runs they replaced, so a squash is no change); at each candidate the two
//! merged views ([`publisher::LayerView`]) are compared — type, size, mode,
//! owner, content (digest), symlink target, device number. A directory present
//! on one side only, or replaced on some layer (a whiteout or an opaque
//! directory in the index), is compared below too. The same file seen through
//! the same layer directory on both sides is unchanged without being read.
//!
//! **A session**: a read-only capture of its upper against its lease
//! ([`publisher::capture_with`], never [`publisher::prepare_upper`]: nothing is
//! written), also while its container runs — files may change meanwhile, so a
//! capture that fails is retried a few times. Paths the exclusion policy leaves
//! out of every publish are left out here too.
//!
//! `--patch`: unified diffs ([`publisher::unified_patch`]) of text files up to
//! the merge's size cap on both sides; a binary one reads "binary files differ".

use std::collections::{BTreeMap, BTreeSet, HashSet};

use layerstack_publisher::{self as publisher, Change, FileKind, LayerView};
use layerstack_store::{ChangeKind, LayerId, SessionId, Store, StoreError};

use crate::blame::View;
use crate::{Engine, EngineError};

/// What a diff compares against ([`Engine::diff`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiffTarget {
    /// A branch's head.
    Branch(String),
    /// The view as of layer `layer` of `branch`'s log: a layer of its head, a
    /// member of one of its squashed layers (`Store::log_point`), or a base
    /// (image) layer of the stack: the image alone (no published layer).
    Layer { branch: String, layer: LayerId },
}

/// How a path differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DiffChange {
    Added,
    Modified,
    Deleted,
}

impl DiffChange {
    /// `added`, `modified` or `deleted`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Added => "added",
            Self::Modified => "modified",
            Self::Deleted => "deleted",
        }
    }
}

/// One side of a changed path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryInfo {
    pub kind: FileKind,
    /// Bytes (a symlink: its target's length; a directory: `st_size`).
    pub size: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

impl EntryInfo {
    fn of(e: &publisher::Entry) -> EntryInfo {
        EntryInfo {
            kind: e.kind,
            size: e.size,
            mode: e.mode,
            uid: e.uid,
            gid: e.gid,
        }
    }
}

/// One changed path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiffEntry {
    /// Relative path, bytes, no leading `/`.
    pub path: Vec<u8>,
    pub change: DiffChange,
    pub old: Option<EntryInfo>,
    pub new: Option<EntryInfo>,
    /// With `patch`: a unified diff of a text file (hunks only), or a note.
    pub patch: Option<String>,
}

/// The result of a diff: what the two sides are, and the changed paths in path
/// order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diff {
    /// The old side, for people (`stack@main`, `layer 12 of main`, `lease of
    /// session 7`).
    pub old: String,
    /// The new side.
    pub new: String,
    pub entries: Vec<DiffEntry>,
}

/// Candidate paths of a diff between manifests of layers `old` and `new`
/// (newest first): every path indexed by a layer of one but not the other
/// (squashed layers expanded to their members), and whether some such layer
/// deleted it or made it opaque (then what is below must be compared too).
pub(crate) fn candidates(
    store: &Store,
    old: &[LayerId],
    new: &[LayerId],
) -> Result<BTreeMap<Vec<u8>, bool>, StoreError> {
    let a: HashSet<LayerId> = store.expand_layers(old)?.into_iter().collect();
    let b: HashSet<LayerId> = store.expand_layers(new)?.into_iter().collect();
    let mut out: BTreeMap<Vec<u8>, bool> = BTreeMap::new();
    let mut differ: Vec<LayerId> = a.symmetric_difference(&b).copied().collect();
    differ.sort_unstable();
    for l in differ {
        for e in store.layer_index(l)? {
            let replaced = matches!(e.kind, ChangeKind::Delete | ChangeKind::Opaque);
            *out.entry(e.path).or_default() |= replaced;
        }
    }
    Ok(out)
}

fn read_err(path: &[u8]) -> impl FnOnce(std::io::Error) -> EngineError + '_ {
    move |e| EngineError::Read(layerstack_store::escape_path(path), e)
}

/// `p` is a mountpoint the session's init made, as its close judges it
/// ([`crate::sandbox::drop_root_mountpoints`]): made by this session
/// (`Mkdir`), [`crate::sandbox::init_mountpoint`] against the layers of
/// `lease`, and empty in the upper (a command's writes there are in the
/// filesystem mounted over it).
fn made_mountpoint(upper: &std::path::Path, lease: &View, p: &[u8], change: &Change) -> bool {
    let Ok(name) = std::str::from_utf8(p) else {
        return false;
    };
    matches!(change, Change::Mkdir { .. })
        && crate::sandbox::init_mountpoint(
            upper,
            lease.layers.iter().map(|l| l.dir.as_path()),
            name,
        )
        .unwrap_or(false)
        && std::fs::read_dir(upper.join(name)).is_ok_and(|mut d| d.next().is_none())
}

fn join(dir: &[u8], name: &[u8]) -> Vec<u8> {
    if dir.is_empty() {
        name.to_vec()
    } else {
        let mut p = dir.to_vec();
        p.push(b'/');
        p.extend_from_slice(name);
        p
    }
}

/// Compares two views path by path.
struct Compare<'a> {
    old: &'a LayerView,
    new: &'a LayerView,
    /// Unified diffs of text files up to this many bytes; `None`: no patches.
    patch: Option<u64>,
    out: BTreeMap<Vec<u8>, DiffEntry>,
    /// Directories whose whole subtree was reported already (walked as added
    /// or deleted, or compared deep): a candidate below one is skipped — it
    /// was seen there. Without this a file was visited once per ancestor
    /// directory that was itself a candidate (a new tree of depth d: d times).
    covered: HashSet<Vec<u8>>,
}

impl Compare<'_> {
    fn push(
        &mut self,
        path: &[u8],
        change: DiffChange,
        old: Option<EntryInfo>,
        new: Option<EntryInfo>,
    ) -> Result<(), EngineError> {
        let patch = match self.patch {
            Some(cap) => patch_of(self.old, self.new, path, old, new, cap)?,
            None => None,
        };
        self.out.insert(
            path.to_vec(),
            DiffEntry {
                path: path.to_vec(),
                change,
                old,
                new,
                patch,
            },
        );
        Ok(())
    }

    /// Whether a directory above `p` had its whole subtree reported.
    fn is_covered(&self, p: &[u8]) -> bool {
        !self.covered.is_empty()
            && p.iter()
                .enumerate()
                .any(|(i, &b)| b == b'/' && self.covered.contains(&p[..i]))
    }

    /// Every path below directory `dir` of `view`, reported as `change`. The
    /// entries of one directory are looked up through one [`publisher::Lookups`]
    /// (the directory's layers kept open), not each from the root.
    fn walk(&mut self, new_side: bool, dir: &[u8], change: DiffChange) -> Result<(), EngineError> {
        self.covered.insert(dir.to_vec());
        let view = if new_side { self.new } else { self.old };
        let mut look = view.lookups();
        for name in view.list_dir(dir).map_err(read_err(dir))? {
            let p = join(dir, &name);
            let Some(e) = look.lookup(&p).map_err(read_err(&p))? else {
                continue;
            };
            let info = Some(EntryInfo::of(&e));
            if new_side {
                self.push(&p, change, None, info)?;
            } else {
                self.push(&p, change, info, None)?;
            }
            if e.kind == FileKind::Dir {
                self.walk(new_side, &p, change)?;
            }
        }
        Ok(())
    }

    fn path(&mut self, p: &[u8], deep: bool) -> Result<(), EngineError> {
        let o = self.old.lookup(p).map_err(read_err(p))?;
        let n = self.new.lookup(p).map_err(read_err(p))?;
        match (o, n) {
            (None, None) => {}
            (None, Some(n)) => {
                self.push(p, DiffChange::Added, None, Some(EntryInfo::of(&n)))?;
                if n.kind == FileKind::Dir {
                    self.walk(true, p, DiffChange::Added)?;
                }
            }
            (Some(o), None) => {
                self.push(p, DiffChange::Deleted, Some(EntryInfo::of(&o)), None)?;
                if o.kind == FileKind::Dir {
                    self.walk(false, p, DiffChange::Deleted)?;
                }
            }
            (Some(o), Some(n)) if o.kind != n.kind => {
                let (oi, ni) = (EntryInfo::of(&o), EntryInfo::of(&n));
                self.push(p, DiffChange::Modified, Some(oi), Some(ni))?;
                if o.kind == FileKind::Dir {
                    self.walk(false, p, DiffChange::Deleted)?;
                }
                if n.kind == FileKind::Dir {
                    self.walk(true, p, DiffChange::Added)?;
                }
            }
            (Some(o), Some(n)) => {
                let (oi, ni) = (EntryInfo::of(&o), EntryInfo::of(&n));
                let same_file = o.kind != FileKind::Dir
                    && self.old.layers()[o.layer_index] == self.new.layers()[n.layer_index];
                let meta = (oi.mode, oi.uid, oi.gid) != (ni.mode, ni.uid, ni.gid);
                let differs = !same_file
                    && (meta
                        || match o.kind {
                            FileKind::Dir => false,
                            FileKind::Regular => {
                                oi.size != ni.size
                                    || self.digest(p, false)? != self.digest(p, true)?
                            }
                            FileKind::Symlink => {
                                self.old.read_symlink(p).map_err(read_err(p))?
                                    != self.new.read_symlink(p).map_err(read_err(p))?
                            }
                            _ => o.rdev != n.rdev,
                        });
                if differs {
                    self.push(p, DiffChange::Modified, Some(oi), Some(ni))?;
                }
                if deep && o.kind == FileKind::Dir {
                    self.covered.insert(p.to_vec());
                    let mut names: BTreeSet<Vec<u8>> = self
                        .old
                        .list_dir(p)
                        .map_err(read_err(p))?
                        .into_iter()
                        .collect();
                    names.extend(self.new.list_dir(p).map_err(read_err(p))?);
                    for name in names {
                        self.path(&join(p, &name), true)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn digest(&self, p: &[u8], new_side: bool) -> Result<Option<[u8; 32]>, EngineError> {
        let view = if new_side { self.new } else { self.old };
        match view.open_regular(p).map_err(read_err(p))? {
            Some(f) => publisher::digest_reader(f).map(Some).map_err(read_err(p)),
            None => Ok(None),
        }
    }
}

/// The patch of `path` between `old` and `new` (either may be absent): a
/// unified diff when both present sides are regular text files of at most `cap`
/// bytes; a note otherwise; `None` when there is nothing to show (no regular
/// file on either side).
fn patch_of(
    old_view: &LayerView,
    new_view: &LayerView,
    path: &[u8],
    old: Option<EntryInfo>,
    new: Option<EntryInfo>,
    cap: u64,
) -> Result<Option<String>, EngineError> {
    let regular = |e: &Option<EntryInfo>| e.is_some_and(|e| e.kind == FileKind::Regular);
    if !regular(&old) && !regular(&new) {
        return Ok(None);
    }
    if [old, new]
        .iter()
        .flatten()
        .any(|e| e.kind == FileKind::Regular && e.size > cap)
    {
        return Ok(Some(format!("file over {cap} bytes: no patch")));
    }
    let read = |v: &LayerView, e: &Option<EntryInfo>| -> Result<Vec<u8>, EngineError> {
        if regular(e) {
            Ok(v.read_regular(path)
                .map_err(read_err(path))?
                .unwrap_or_default())
        } else {
            Ok(Vec::new())
        }
    };
    let (a, b) = (read(old_view, &old)?, read(new_view, &new)?);
    if publisher::is_binary(&a) || publisher::is_binary(&b) {
        return Ok(Some("binary files differ".into()));
    }
    Ok(Some(publisher::unified_patch(&a, &b, 3)))
}

impl Engine {
    /// The layers (newest first) of `target` on `stack`, and its label.
    fn target_layers(
        store: &Store,
        stack: &str,
        target: &DiffTarget,
    ) -> Result<(Vec<LayerId>, String), EngineError> {
        match target {
            DiffTarget::Branch(b) => {
                let head = store.branch_head(stack, b)?;
                Ok((store.manifest(head)?, format!("{stack}@{b}")))
            }
            DiffTarget::Layer { branch, layer } => {
                let point = match store.log_point(stack, branch, *layer) {
                    Err(StoreError::InvalidArgument(m)) => {
                        return Err(EngineError::NotFound(format!("{m} (stack {stack})")))
                    }
                    other => other?,
                };
                let label = match point.squash {
                    None if point.layers.is_empty() => format!(
                        "{stack}@{branch} at its base (the image alone; base layer {layer})"
                    ),
                    None => format!("{stack}@{branch} at layer {layer}"),
                    Some(s) => {
                        format!("{stack}@{branch} at layer {layer} (compacted into layer {s})")
                    }
                };
                Ok((point.layers, label))
            }
        }
    }

    /// What changed from `old` to `new` on `stack` (see the module docs); with
    /// `patch`, unified diffs of text files.
    ///
    /// Errors: `BranchNotFound`; [`EngineError::NotFound`] for a layer not in
    /// the branch's log; `FailedPrecondition` for a member of a squash whose
    /// view GC made impossible to build.
    pub async fn diff(
        &self,
        stack: &str,
        old: DiffTarget,
        new: DiffTarget,
        patch: bool,
    ) -> Result<Diff, EngineError> {
        let store = self.store.clone();
        let userxattr = self.settings.userxattr;
        let cap = patch.then_some(self.settings.merge.max_bytes);
        let stack = stack.to_string();
        tokio::task::spawn_blocking(move || -> Result<Diff, EngineError> {
            let (a, old_label) = Self::target_layers(&store, &stack, &old)?;
            let (b, new_label) = Self::target_layers(&store, &stack, &new)?;
            let cands = candidates(&store, &a, &b)?;
            let va = View::new(store.layers_view(&stack, &a)?, userxattr);
            let vb = View::new(store.layers_view(&stack, &b)?, userxattr);
            let mut c = Compare {
                old: &va.view,
                new: &vb.view,
                patch: cap,
                out: BTreeMap::new(),
                covered: HashSet::new(),
            };
            for (p, deep) in &cands {
                if !c.is_covered(p) {
                    c.path(p, *deep)?;
                }
            }
            Ok(Diff {
                old: old_label,
                new: new_label,
                entries: c.out.into_values().collect(),
            })
        })
        .await
        .map_err(|e| EngineError::Join(e.to_string()))?
    }

    /// What session `id` changed against its lease: a read-only capture of its
    /// upper (also while its container runs; see the module docs).
    ///
    /// Errors: `SessionNotFound`; [`EngineError::FailedPrecondition`] when the
    /// session holds no lease (its run ended: nothing is pending).
    pub async fn diff_session(&self, id: SessionId, patch: bool) -> Result<Diff, EngineError> {
        let s = self.session(id).await?;
        let Some(lease) = s.lease_manifest else {
            return Err(EngineError::FailedPrecondition(format!(
                "session {id} holds no lease: its run ended ({}), nothing of it is pending",
                s.outcome.as_ref().map_or("no run yet", |o| o.kind.as_str())
            )));
        };
        let store = self.store.clone();
        let settings = self.settings.clone();
        let cap = patch.then_some(self.settings.merge.max_bytes);
        let root_mode = self.sandbox_is_root_mode(id);
        tokio::task::spawn_blocking(move || -> Result<Diff, EngineError> {
            let lease_view = View::new(store.session_view_layers(id, lease)?, settings.userxattr);
            let upper = LayerView::new(vec![s.upper.clone()]).with_userxattr(settings.userxattr);
            let options = settings.capture_options(&s);
            // The upper of a running container changes under the walk: retry.
            let mut attempt = 0;
            let cs = loop {
                match publisher::capture_with(&s.upper, &lease_view.view, &options) {
                    Ok(cs) => break cs,
                    Err(_) if attempt < 4 => {
                        attempt += 1;
                        std::thread::sleep(std::time::Duration::from_millis(50));
                    }
                    Err(e) => return Err(EngineError::Run(Box::new(crate::RunError::Capture(e)))),
                }
            };
            let mut c = Compare {
                old: &lease_view.view,
                new: &upper,
                patch: cap,
                out: BTreeMap::new(),
                covered: HashSet::new(),
            };
            for (p, change) in &cs.entries {
                let old = lease_view.view.lookup(p).map_err(read_err(p))?;
                // A mountpoint a root-mode sandbox's init made (/proc, /dev,
                // /sys, /run where the base lacks them) is the sandbox's, not
                // a change: its close drops it from the upper.
                if root_mode && old.is_none() && made_mountpoint(&s.upper, &lease_view, p, change) {
                    continue;
                }
                let oi = old.as_ref().map(EntryInfo::of);
                let ni = new_info(change);
                match (change, old) {
                    (Change::Delete, None) => {}
                    (Change::Delete, Some(o)) => {
                        c.push(p, DiffChange::Deleted, oi, None)?;
                        if o.kind == FileKind::Dir {
                            c.walk(false, p, DiffChange::Deleted)?;
                        }
                    }
                    (_, None) => c.push(p, DiffChange::Added, None, ni)?,
                    (ch, Some(o)) => {
                        c.push(p, DiffChange::Modified, oi, ni)?;
                        let opaque = matches!(ch, Change::Mkdir { opaque: true, .. });
                        if o.kind == FileKind::Dir
                            && (opaque || ch.file_kind() != Some(FileKind::Dir))
                        {
                            // What the lease had below is gone, unless written again.
                            for name in lease_view.view.list_dir(p).map_err(read_err(p))? {
                                let q = join(p, &name);
                                if !cs.entries.contains_key(&q) {
                                    let e = lease_view.view.lookup(&q).map_err(read_err(&q))?;
                                    if let Some(e) = e {
                                        c.push(
                                            &q,
                                            DiffChange::Deleted,
                                            Some(EntryInfo::of(&e)),
                                            None,
                                        )?;
                                        if e.kind == FileKind::Dir {
                                            c.walk(false, &q, DiffChange::Deleted)?;
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            Ok(Diff {
                old: format!("lease of session {id} (manifest {lease})"),
                new: format!("upper of session {id} ({})", s.owner.display()),
                entries: c.out.into_values().collect(),
            })
        })
        .await
        .map_err(|e| EngineError::Join(e.to_string()))?
    }
}

/// The state a captured change leaves (`None`: deleted).
fn new_info(c: &Change) -> Option<EntryInfo> {
    let (kind, size, mode, uid, gid) = match c {
        Change::Write {
            mode,
            uid,
            gid,
            size,
            ..
        } => (FileKind::Regular, *size, *mode, *uid, *gid),
        Change::Symlink { target, uid, gid } => {
            (FileKind::Symlink, target.len() as u64, 0o777, *uid, *gid)
        }
        Change::Mkdir { mode, uid, gid, .. } | Change::Meta { mode, uid, gid } => {
            (FileKind::Dir, 0, *mode, *uid, *gid)
        }
        Change::Special {
            kind,
            mode,
            uid,
            gid,
            ..
        } => (*kind, 0, *mode, *uid, *gid),
        Change::Delete => return None,
    };
    Some(EntryInfo {
        kind,
        size,
        mode,
        uid,
        gid,
    })
}
