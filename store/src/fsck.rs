//! `fsck`: the store checked against its filesystem (issue 22). Read-only
//! unless asked to repair, and then it repairs only what loses no committed
//! change: directories no row keeps (the sweep's removal), leases whose holder
//! is gone (a session row that no longer exists or was released without
//! keeping its directories, a pruned or missing node).
//!
//! Checks, each a [`Problem`] kind:
//! * `orphan-directory` — an `l/`, `w/`, `s/` or `staging/` entry no row keeps
//!   (what a sweep would remove). Repaired by the sweep.
//! * `layer-missing` — a layer row (not freed by GC) whose directory is gone.
//! * `manifest-layer` — a manifest that a branch or a live lease reaches names a
//!   layer that has no row, was freed by GC, or is still pending.
//! * `dangling-lease` — a live lease whose holder is gone. Repaired (released)
//!   when the holder's row is gone, a session was released without keeping its
//!   directories, or a node was pruned.
//! * `session-upper-missing` — a session in a run (unreleased, holding a
//!   lease) without its upper.
//! * `index-mismatch` — a path-index row of a live published layer whose entry
//!   is missing from the layer's tree or of another type (a write that is not a
//!   regular file, a delete that is not a whiteout, …).
//! * `content-mismatch` — with `content` ([`Store::fsck_with`]): a written
//!   file of a live published layer whose BLAKE3 differs from its index row's
//!   digest (a file torn by a power cut in the `disposable` profile, a disk
//!   that lost a write, a hand edit of a layer). Reads every such file.
//! * `outcome-history` — a publish reported `committed`, `merged` or
//!   `checkpointed` that names no layer or one never sealed (pending, active),
//!   or whose manifest does not have that layer on top; or a `committed` or
//!   `merged` one whose layer is not in the history of its branch's head (its
//!   layers and their squashes' members) while that branch stands — made
//!   before the publish — and the session did not conflict since (a rebranch
//!   may have moved it): an outcome history or the heads do not bear out.
//! * `rollout` — a violation of a run's exactly-once invariants
//!   ([`Store::audit_run`]).

use std::collections::BTreeSet;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::PathBuf;

use rusqlite::{params, OptionalExtension};

use crate::db::Cached;
use crate::error::StoreError;
use crate::stacks::manifest_layers;
use crate::sweep::SweepMode;
use crate::{now_ns, Store};

/// One inconsistency.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// See the module docs: `orphan-directory`, `layer-missing`, …
    pub kind: &'static str,
    /// What it is about (a path, `layer 12`, `lease 7`, `run r`).
    pub subject: String,
    pub detail: String,
    /// `--repair` fixed it.
    pub repaired: bool,
}

/// What [`Store::fsck`] looked at and found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FsckReport {
    pub layers: u64,
    pub manifests: u64,
    pub leases: u64,
    pub sessions: u64,
    /// Path-index rows checked against their trees.
    pub paths: u64,
    /// Committed, merged and checkpointed outcomes checked against history.
    pub outcomes: u64,
    pub runs: u64,
    pub problems: Vec<Problem>,
}

impl FsckReport {
    /// Problems not repaired.
    pub fn unrepaired(&self) -> usize {
        self.problems.iter().filter(|p| !p.repaired).count()
    }
}

impl Store {
    /// Checks the store against its filesystem (see the module docs);
    /// `repair`: fixes what can be fixed without losing a committed change.
    /// Safe while the daemon serves: it reads one consistent snapshot per
    /// check; directories an operation in flight is creating are never
    /// reported (nor removed).
    pub fn fsck(&self, repair: bool) -> Result<FsckReport, StoreError> {
        self.fsck_with(repair, false)
    }

    /// [`Store::fsck`], and with `content` every written file of a live
    /// published layer hashed against its path-index digest (`content-mismatch`;
    /// reads all of them: minutes on a large store).
    ///
    /// # Errors
    /// A database error; a file that cannot be read is a problem, not an error.
    pub fn fsck_with(&self, repair: bool, content: bool) -> Result<FsckReport, StoreError> {
        let mut r = FsckReport::default();
        // Directories: what a sweep would remove, and rows without theirs.
        let sweep = self.sweep_with(if repair {
            SweepMode::Cleanup
        } else {
            SweepMode::Check
        })?;
        for p in sweep.removed {
            r.problems.push(Problem {
                kind: "orphan-directory",
                subject: p.display().to_string(),
                detail: "no row keeps it".into(),
                repaired: repair,
            });
        }
        for p in sweep.would_remove {
            r.problems.push(Problem {
                kind: "orphan-directory",
                subject: p.display().to_string(),
                detail: "no row keeps it (fsck --repair removes it)".into(),
                repaired: false,
            });
        }
        for p in sweep.missing {
            r.problems.push(Problem {
                kind: "layer-missing",
                subject: p.display().to_string(),
                detail: "a layer row's directory is gone".into(),
                repaired: false,
            });
        }
        self.fsck_rows(&mut r, content)?;
        if repair {
            self.fsck_repair_leases(&mut r)?;
        }
        for run in self.runs()? {
            r.runs += 1;
            for v in self.audit_run(&run.name)?.violations {
                r.problems.push(Problem {
                    kind: "rollout",
                    subject: format!("run {}", run.name),
                    detail: v,
                    repaired: false,
                });
            }
        }
        Ok(r)
    }

    fn fsck_rows(&self, r: &mut FsckReport, content: bool) -> Result<(), StoreError> {
        let root = self.root.clone();
        self.db.read(|conn| {
            r.layers = u64::try_from(conn.one("SELECT count(*) FROM layers", [], |x| x.get::<_, i64>(0))?).unwrap_or(0);
            // Manifests a branch or a live lease reaches.
            let reached: BTreeSet<i64> = {
                let mut stmt = conn.prepare_cached(
                    "SELECT manifest_id FROM branches UNION SELECT manifest_id FROM leases WHERE released_ns IS NULL",
                )?;
                let v = stmt.query_map([], |x| x.get(0))?.collect::<Result<_, _>>()?;
                v
            };
            r.manifests = u64::try_from(reached.len()).unwrap_or(0);
            let mut seen_layers = BTreeSet::new();
            for m in &reached {
                for l in manifest_layers(conn, *m)? {
                    if !seen_layers.insert(l) {
                        continue;
                    }
                    let row: Option<(String, i64)> = conn
                        .one("SELECT kind, dropped FROM layers WHERE id = ?1", [l], |x| Ok((x.get(0)?, x.get(1)?)))
                        .optional()?;
                    let bad = match &row {
                        None => Some("has no row".to_string()),
                        Some((_, d)) if *d != 0 => Some("was freed by GC".to_string()),
                        Some((k, _)) if k == "pending" => Some("is still pending".to_string()),
                        _ => None,
                    };
                    if let Some(b) = bad {
                        r.problems.push(Problem {
                            kind: "manifest-layer",
                            subject: format!("manifest {m}"),
                            detail: format!("layer {l} {b}"),
                            repaired: false,
                        });
                    }
                }
            }
            // Leases whose holder is gone.
            let mut stmt = conn.prepare_cached(
                "SELECT l.id, l.holder_kind, l.holder,
                    CASE l.holder_kind
                      WHEN 'session' THEN (SELECT CASE WHEN s.id IS NULL THEN 'gone' WHEN s.lease_id IS l.id THEN 'ok' ELSE 'other' END
                                           FROM (SELECT 1) LEFT JOIN sessions s ON s.id = CAST(l.holder AS INTEGER))
                      WHEN 'node' THEN (SELECT CASE WHEN n.id IS NULL THEN 'gone' WHEN n.pruned = 1 THEN 'pruned' WHEN n.lease_id IS l.id THEN 'ok' ELSE 'other' END
                                        FROM (SELECT 1) LEFT JOIN graph_nodes n ON n.id = l.holder)
                      ELSE 'ok' END AS state
                 FROM leases l WHERE l.released_ns IS NULL",
            )?;
            let rows = stmt.query_map([], |x| {
                Ok((x.get::<_, i64>(0)?, x.get::<_, String>(1)?, x.get::<_, String>(2)?, x.get::<_, String>(3)?))
            })?;
            for row in rows {
                let (id, kind, holder, state) = row?;
                r.leases += 1;
                if state != "ok" {
                    r.problems.push(Problem {
                        kind: "dangling-lease",
                        subject: format!("lease {id}"),
                        detail: format!("its {kind} holder {holder} is {state}"),
                        repaired: false,
                    });
                }
            }
            // Sessions in a run (unreleased, holding a lease) have their upper.
            let mut stmt = conn.prepare_cached(
                "SELECT id FROM sessions WHERE released = 0 AND lease_id IS NOT NULL",
            )?;
            for id in stmt.query_map([], |x| x.get::<_, i64>(0))? {
                let id = id?;
                r.sessions += 1;
                let upper = root.join("s").join(id.to_string()).join("upper");
                if std::fs::symlink_metadata(&upper).is_err() {
                    r.problems.push(Problem {
                        kind: "session-upper-missing",
                        subject: format!("session {id}"),
                        detail: format!("{} is gone", upper.display()),
                        repaired: false,
                    });
                }
            }
            // Outcomes against history: a publish reported committed, merged
            // or checkpointed names a layer that was sealed (its row, while GC
            // has not freed it, is not pending or active), and the manifest it
            // made (while its row lives) has that layer on top.
            //
            // And against heads: a `committed` or `merged` publish moved its
            // session's branch, and nothing moves a branch backwards (promote
            // fast-forwards or merges; a squash keeps its members), so while
            // that branch stands — made before the publish, not deleted and
            // made again since — its head's history holds the layer (among
            // its layers, or a squash's members). Sessions that conflicted
            // after the publish are left out: a conflicted session may be
            // moved to another branch (rebranch), which the row then names.
            let mut stmt = conn.prepare_cached(
                "SELECT p.id, p.session_id, p.outcome, p.layer_id, l.kind, m.id, m.layer_id,
                        CASE WHEN p.outcome IN ('committed', 'merged')
                              AND NOT EXISTS (SELECT 1 FROM publishes q WHERE q.session_id = p.session_id
                                              AND q.id > p.id AND q.outcome = 'conflict')
                             THEN b.manifest_id END,
                        s.stack, s.branch
                 FROM publishes p
                 JOIN sessions s ON s.id = p.session_id
                 LEFT JOIN layers l ON l.id = p.layer_id
                 LEFT JOIN manifests m ON m.id = p.manifest_after
                 LEFT JOIN branches b ON b.stack = s.stack AND b.name = s.branch AND b.created_ns <= p.at_ns
                 WHERE p.outcome IN ('committed', 'merged', 'checkpointed')",
            )?;
            let rows = stmt.query_map([], |x| {
                Ok((
                    (
                        x.get::<_, i64>(0)?,
                        x.get::<_, i64>(1)?,
                        x.get::<_, String>(2)?,
                        x.get::<_, Option<i64>>(3)?,
                        x.get::<_, Option<String>>(4)?,
                        x.get::<_, Option<i64>>(5)?,
                        x.get::<_, Option<i64>>(6)?,
                    ),
                    (
                        x.get::<_, Option<i64>>(7)?,
                        x.get::<_, String>(8)?,
                        x.get::<_, String>(9)?,
                    ),
                ))
            })?;
            // Each branch head's history: its layers and, below them, the
            // members of its squashes.
            let mut histories: std::collections::HashMap<i64, BTreeSet<i64>> = Default::default();
            for row in rows {
                let ((id, session, outcome, layer, kind, after, top), (head, stack, branch)) = row?;
                r.outcomes += 1;
                let off_head = match (layer, head) {
                    (Some(l), Some(h)) => {
                        let history = match histories.entry(h) {
                            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                            std::collections::hash_map::Entry::Vacant(e) => {
                                e.insert(head_history(conn, h)?)
                            }
                        };
                        !history.contains(&l)
                    }
                    _ => false,
                };
                let why = match (layer, kind.as_deref(), after, top) {
                    (None, ..) => Some("names no layer".to_string()),
                    // No row: GC freed it (a deleted branch, a squash's
                    // members), which it may.
                    (Some(_), None, ..) => None,
                    (Some(l), Some(k @ ("pending" | "active")), ..) => {
                        Some(format!("names layer {l}, which is still {k} (never sealed)"))
                    }
                    (Some(l), _, Some(m), t) if t != Some(l) => Some(format!(
                        "names layer {l}, but the manifest {m} it made has {} on top",
                        t.map_or("no layer".to_string(), |t| format!("layer {t}"))
                    )),
                    (Some(l), ..) if off_head => Some(format!(
                        "names layer {l}, which is not in the history of {stack}@{branch}'s head (the branch it moved, standing since before it){}",
                        if kind.is_none() { ", and GC freed it" } else { "" }
                    )),
                    _ => None,
                };
                if let Some(why) = why {
                    r.problems.push(Problem {
                        kind: "outcome-history",
                        subject: format!("session {session} publish {id}"),
                        detail: format!("its outcome {outcome} {why}"),
                        repaired: false,
                    });
                }
            }
            // The path index of live published layers against their trees.
            let mut stmt = conn.prepare_cached(
                "SELECT p.path, p.kind, l.id, l.path, p.digest FROM layer_paths p JOIN layers l ON l.id = p.layer_id
                 WHERE l.kind IN ('published', 'squashed') AND l.dropped = 0",
            )?;
            let rows = stmt.query_map([], |x| {
                Ok((
                    x.get::<_, Vec<u8>>(0)?,
                    x.get::<_, i64>(1)?,
                    x.get::<_, i64>(2)?,
                    x.get::<_, String>(3)?,
                    x.get::<_, Option<Vec<u8>>>(4)?,
                ))
            })?;
            for row in rows {
                let (path, kind, layer, dir, digest) = row?;
                r.paths += 1;
                let p: PathBuf = root.join(&dir).join(std::ffi::OsStr::from_bytes(&path));
                let subject = || format!("layer {layer} {}", crate::escape_path(&path));
                if let Some(why) = index_mismatch(&p, kind) {
                    r.problems.push(Problem {
                        kind: "index-mismatch",
                        subject: subject(),
                        detail: why,
                        repaired: false,
                    });
                } else if let (true, 0, Some(want)) = (content, kind, digest) {
                    if let Some(why) = content_mismatch(&p, &want) {
                        r.problems.push(Problem {
                            kind: "content-mismatch",
                            subject: subject(),
                            detail: why,
                            repaired: false,
                        });
                    }
                }
            }
            Ok(())
        })
    }

    /// Releases leases whose holder is gone for good (the lease problems'
    /// safe subset) and marks those problems repaired.
    fn fsck_repair_leases(&self, r: &mut FsckReport) -> Result<(), StoreError> {
        let released: Vec<i64> = self.db.write(|tx| {
            let mut stmt = tx.prepare_cached(&format!(
                "SELECT l.id FROM leases l WHERE l.released_ns IS NULL AND (
                   (l.holder_kind = 'session' AND NOT EXISTS (SELECT 1 FROM sessions s WHERE s.id = CAST(l.holder AS INTEGER)
                        AND (s.lease_id IS l.id OR s.id IN (SELECT id FROM sessions WHERE {}))))
                   OR (l.holder_kind = 'node' AND NOT EXISTS (SELECT 1 FROM graph_nodes n WHERE n.id = l.holder AND n.pruned = 0)))",
                crate::sessions::KEEPS_DIRS
            ))?;
            let ids: Vec<i64> = stmt.query_map([], |x| x.get(0))?.collect::<Result<_, _>>()?;
            drop(stmt);
            let now = now_ns();
            for id in &ids {
                tx.exec("UPDATE leases SET released_ns = ?2 WHERE id = ?1", params![id, now])?;
            }
            Ok(ids)
        })?;
        for p in &mut r.problems {
            if p.kind == "dangling-lease"
                && released.iter().any(|id| p.subject == format!("lease {id}"))
            {
                p.repaired = true;
            }
        }
        Ok(())
    }
}

/// Why the entry at `p` does not match a path-index row of kind `kind`
/// (`ChangeKind::code`), if it does not.
fn index_mismatch(p: &std::path::Path, kind: i64) -> Option<String> {
    let md = match std::fs::symlink_metadata(p) {
        Ok(md) => md,
        Err(e) => {
            return Some(format!(
                "the index has it ({}), the tree does not: {e}",
                kind_name(kind)
            ))
        }
    };
    let ft = md.file_type();
    let ok = match kind {
        0 => ft.is_file(),
        1 => ft.is_symlink(),
        2 | 4 => ft.is_dir(),
        // A whiteout: a character device 0/0.
        3 => ft.is_char_device() && md.rdev() == 0,
        _ => true,
    };
    (!ok).then(|| format!("the index says {}, the tree has {:?}", kind_name(kind), ft))
}

/// Why the regular file at `p` does not hash to `want` (its index row's
/// BLAKE3), if it does not.
/// The layers of manifest `head` and, below each squashed one, the members it
/// replaced (recursively): every layer whose change the head holds.
fn head_history(conn: &rusqlite::Connection, head: i64) -> Result<BTreeSet<i64>, StoreError> {
    let mut out = BTreeSet::new();
    let mut todo = manifest_layers(conn, head)?;
    let mut stmt =
        conn.prepare_cached("SELECT member_id FROM squash_members WHERE layer_id = ?1")?;
    while let Some(l) = todo.pop() {
        if out.insert(l) {
            for m in stmt.query_map([l], |x| x.get::<_, i64>(0))? {
                todo.push(m?);
            }
        }
    }
    Ok(out)
}

fn content_mismatch(p: &std::path::Path, want: &[u8]) -> Option<String> {
    let mut h = blake3::Hasher::new();
    match std::fs::File::open(p).and_then(|f| h.update_reader(f).map(|_| ())) {
        Err(e) => Some(format!("cannot read it to check its content: {e}")),
        Ok(()) if h.finalize().as_bytes().as_slice() == want => None,
        Ok(()) => Some(format!(
            "its content ({} bytes) is not what the index recorded (BLAKE3 {})",
            std::fs::metadata(p).map(|m| m.len()).unwrap_or(0),
            want.iter().map(|b| format!("{b:02x}")).collect::<String>()
        )),
    }
}

fn kind_name(kind: i64) -> &'static str {
    match kind {
        0 => "a written file",
        1 => "a symlink",
        2 => "a directory",
        3 => "a whiteout",
        4 => "an opaque directory",
        5 => "a metadata change",
        _ => "a special file",
    }
}
