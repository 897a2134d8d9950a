//! Blame rows, views for diff and blame, and the conflict markers of a rebased
//! session (ARCHITECTURE.md §2 "Blame"; seed `000`, "File-operation blame").
//!
//! **Blame** is recorded at publish time, outside the layers, in
//! `blame_ranges`: per published text file version — `(stack, path, content
//! digest)` — and the layer whose publish wrote it, the coalesced line ranges
//! with their owner (`original`, `session:<id>`, `operation:<id>`). Lines whose
//! owner is unknown are simply not covered (a reader shows them as `unknown`),
//! so a dropped or failed blame write never names a wrong owner. A squash keeps
//! its members' rows (their path index stays, and so do these), and the content
//! and digests are the same; GC drops the rows of layers it deletes.
//!
//! Which rows describe a version: those of the newest layer of the view (squashed
//! layers seen as their members) that has rows for `(path, digest)`; failing
//! that, rows any committed layer of the stack wrote for the same `(path,
//! digest)` (the same bytes at the same path); failing that, nothing — the
//! caller decides between `original` (the file comes from a base layer) and
//! `unknown`.
//!
//! **Markers**: `layerstack session rebase` writes conflict blocks into a
//! session's upper and records a row per block in `session_markers` (its path,
//! digest and first line), keyed by the lease it moved the session to. While
//! the session holds that lease, a publish is refused as long as a file with
//! rows still holds a marker block (`<<<<<<< session` … `>>>>>>> head`; the
//! engine's rule, whatever the block now contains).

use std::collections::HashMap;
use std::path::PathBuf;

use rusqlite::{params, Connection, OptionalExtension, Transaction};
use tracing::info;

use crate::db::digest_col;
use crate::db::Cached;
use crate::error::StoreError;
use crate::leases::{lease_manifest, new_lease, release_lease};
use crate::sessions::get_sess;
use crate::stacks::{manifest_layers, stack_base_layers};
use crate::{
    HolderKind, LayerId, LayerKind, ManifestId, OutcomeKind, Owner, SessionId, SessionInfo, Store,
};

/// Who wrote a line of a published text file.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LineOwner {
    /// The line came with the base image.
    Original,
    /// A container session (its container id; a snapshot session: its key) or a
    /// sandbox session (its name) — shown `session:<name>`.
    Session { name: String, session: SessionId },
    /// An engine operation such as promote — shown `operation:<id>`.
    Operation { id: String, session: SessionId },
    /// No row says (never stored: a gap in the ranges).
    Unknown,
}

impl LineOwner {
    /// The owner of lines session `id` (owned by `owner`) writes.
    pub fn of_session(owner: &Owner, id: SessionId) -> LineOwner {
        match owner {
            Owner::Container { id: name, .. } | Owner::Sandbox { name } | Owner::Wasi { name } => {
                LineOwner::Session {
                    name: name.clone(),
                    session: id,
                }
            }
            Owner::Operation { id: op } => LineOwner::Operation {
                id: op.clone(),
                session: id,
            },
        }
    }

    /// `original`, `session:<name>`, `operation:<id>` or `unknown`.
    pub fn display(&self) -> String {
        match self {
            Self::Original => "original".into(),
            Self::Session { name, .. } => format!("session:{name}"),
            Self::Operation { id, .. } => format!("operation:{id}"),
            Self::Unknown => "unknown".into(),
        }
    }

    /// The session that wrote the line, if a session did.
    pub fn session(&self) -> Option<SessionId> {
        match self {
            Self::Session { session, .. } | Self::Operation { session, .. } => Some(*session),
            Self::Original | Self::Unknown => None,
        }
    }

    fn columns(&self) -> (&'static str, Option<&str>) {
        match self {
            Self::Original | Self::Unknown => ("original", None),
            Self::Session { name, .. } => ("session", Some(name)),
            Self::Operation { id, .. } => ("operation", Some(id)),
        }
    }
}

/// Lines `start..=end` (from 1) of a file belong to `owner`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerRange {
    pub start: u32,
    pub end: u32,
    pub owner: LineOwner,
}

/// The blame of one published text file version, as a publish stages it:
/// ranges of known owners only (what is not covered is unknown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileBlame {
    /// Relative path, bytes, no leading `/`.
    pub path: Vec<u8>,
    /// BLAKE3 of the content (the path index's digest).
    pub digest: [u8; 32],
    pub ranges: Vec<OwnerRange>,
}

/// Coalesces per-line owners (`None`: unknown) into ranges of known owners.
pub fn coalesce(owners: &[Option<LineOwner>]) -> Vec<OwnerRange> {
    let mut out: Vec<OwnerRange> = Vec::new();
    for (i, o) in owners.iter().enumerate() {
        let line = u32::try_from(i + 1).unwrap_or(u32::MAX);
        let Some(o) = o else { continue };
        match out.last_mut() {
            Some(r) if r.owner == *o && r.end + 1 == line => r.end = line,
            _ => out.push(OwnerRange {
                start: line,
                end: line,
                owner: o.clone(),
            }),
        }
    }
    out
}

/// Per-line owners of a file of `lines` lines from `ranges` (gaps: `None`).
pub fn tile(ranges: &[OwnerRange], lines: usize) -> Vec<Option<LineOwner>> {
    let mut out = vec![None; lines];
    for r in ranges {
        for l in r.start..=r.end {
            if let Some(slot) = usize::try_from(l).ok().and_then(|l| out.get_mut(l - 1)) {
                *slot = Some(r.owner.clone());
            }
        }
    }
    out
}

/// One layer of a view, newest first: what a reader needs to tell where a file
/// came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewLayer {
    pub id: LayerId,
    pub kind: LayerKind,
    pub dir: PathBuf,
}

/// A conflict block `layerstack session rebase` wrote (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkerRecord {
    pub path: Vec<u8>,
    /// BLAKE3 of the block's bytes, marker lines included.
    pub digest: [u8; 32],
    /// First line of the block when it was written (from 1), for messages.
    pub line: u32,
}

/// Deletes blame rows nothing can read any more: rows of layers that no longer
/// exist (GC deleted them, or a pending publish was dropped) and of removed
/// stacks; markers of deleted sessions. Called inside GC's and stack removal's
/// transactions.
pub(crate) fn collect_blame(tx: &Transaction<'_>) -> Result<(), StoreError> {
    tx.exec(
        "DELETE FROM blame_ranges WHERE layer_id NOT IN (SELECT id FROM layers) OR stack NOT IN (SELECT id FROM stacks)",
        [],
    )?;
    tx.exec(
        "DELETE FROM session_markers WHERE session_id NOT IN (SELECT id FROM sessions)",
        [],
    )?;
    Ok(())
}

/// Deletes the blame rows a staged (never committed) layer wrote.
pub(crate) fn delete_staged_blame(tx: &Transaction<'_>, layer: LayerId) -> Result<(), StoreError> {
    tx.exec("DELETE FROM blame_ranges WHERE layer_id = ?1", [layer])?;
    Ok(())
}

pub(crate) fn layer_kinds(
    conn: &Connection,
    ids: &[LayerId],
) -> Result<Vec<LayerKind>, StoreError> {
    let mut stmt = conn.prepare_cached("SELECT kind FROM layers WHERE id = ?1")?;
    ids.iter()
        .map(|id| {
            let k: String = stmt
                .query_row([id], |r| r.get(0))
                .optional()?
                .ok_or(StoreError::LayerNotFound(*id))?;
            LayerKind::parse(&k)
                .ok_or_else(|| StoreError::corrupt("layers", id, format!("kind {k:?}")))
        })
        .collect()
}

type RawRange = (i64, i64, i64, String, Option<String>, Option<i64>);

fn owner_from(kind: &str, owner: Option<String>, session: Option<i64>) -> Option<LineOwner> {
    match (kind, owner) {
        ("original", _) => Some(LineOwner::Original),
        ("session", Some(name)) => Some(LineOwner::Session {
            name,
            session: session.unwrap_or(0),
        }),
        ("operation", Some(id)) => Some(LineOwner::Operation {
            id,
            session: session.unwrap_or(0),
        }),
        _ => None,
    }
}

impl Store {
    /// Records the blame of the text files a staged publish writes, as layer
    /// `layer`'s rows (replacing rows it already has at those paths, so a gate
    /// that planned again can restage what changed). Invisible to readers until
    /// the layer is committed; dropped with it otherwise. Error: `Corrupt`.
    pub fn stage_blame(
        &self,
        stack: &str,
        layer: LayerId,
        files: &[FileBlame],
    ) -> Result<(), StoreError> {
        if files.is_empty() {
            return Ok(());
        }
        // One file per step: a commit under a gate waits for at most one
        // file's rows (`Db::write_each`).
        self.db.write_each(files, |tx, f| {
            let mut del = tx.prepare_cached(
                "DELETE FROM blame_ranges WHERE layer_id = ?1 AND stack = ?2 AND path = ?3",
            )?;
            let mut ins = tx.prepare_cached(
                "INSERT OR REPLACE INTO blame_ranges(stack, path, digest, layer_id, start_line, end_line, owner_kind, owner, session_id) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            )?;
            del.execute(params![layer, stack, f.path])?;
            for r in &f.ranges {
                if r.owner == LineOwner::Unknown {
                    continue;
                }
                let (kind, owner) = r.owner.columns();
                ins.execute(params![
                    stack,
                    f.path,
                    f.digest.to_vec(),
                    layer,
                    r.start,
                    r.end,
                    kind,
                    owner,
                    r.owner.session()
                ])?;
            }
            Ok(())
        })
    }

    /// The recorded blame of the version of `path` with content `digest` in a
    /// view whose layers are `layers` (newest first; see the module docs for
    /// which rows win). `None` when no committed layer recorded any.
    pub fn version_blame(
        &self,
        stack: &str,
        layers: &[LayerId],
        path: &[u8],
        digest: &[u8; 32],
    ) -> Result<Option<Vec<OwnerRange>>, StoreError> {
        self.db.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT b.layer_id, b.start_line, b.end_line, b.owner_kind, b.owner, b.session_id
                 FROM blame_ranges b JOIN layers l ON l.id = b.layer_id
                 WHERE b.stack = ?1 AND b.path = ?2 AND b.digest = ?3 AND l.kind IN ('published', 'squashed')
                 ORDER BY b.layer_id, b.start_line",
            )?;
            let rows: Vec<RawRange> = stmt
                .query_map(params![stack, path, digest.to_vec()], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?))
                })?
                .collect::<Result<_, _>>()?;
            if rows.is_empty() {
                return Ok(None);
            }
            let mut by_layer: HashMap<LayerId, Vec<OwnerRange>> = HashMap::new();
            for (layer, start, end, kind, owner, session) in rows {
                let owner = owner_from(&kind, owner, session).ok_or_else(|| {
                    StoreError::corrupt(
                        "blame_ranges",
                        format!("layer {layer}, path {}", crate::escape_path(path)),
                        format!("owner kind {kind:?} without an owner"),
                    )
                })?;
                let line = |v: i64| u32::try_from(v).unwrap_or(0);
                by_layer.entry(layer).or_default().push(OwnerRange {
                    start: line(start),
                    end: line(end),
                    owner,
                });
            }
            let expanded = crate::paths::expand(conn, &self.expansions, layers)?;
            if let Some(l) = expanded.iter().find(|l| by_layer.contains_key(l)) {
                return Ok(by_layer.remove(l));
            }
            // The same bytes at the same path, recorded by another layer.
            let newest = by_layer.keys().copied().max();
            Ok(newest.and_then(|l| by_layer.remove(&l)))
        })
    }

    /// The layers of manifest `manifest` of `stack` then the stack's base
    /// layers, newest first: a view of that head as a new session would mount it
    /// (without per-container layers). Errors: `Corrupt`, `LayerNotFound`.
    pub fn manifest_view_layers(
        &self,
        stack: &str,
        manifest: ManifestId,
    ) -> Result<Vec<ViewLayer>, StoreError> {
        self.db.read(|conn| {
            let mut ids = manifest_layers(conn, manifest)?;
            ids.extend(stack_base_layers(conn, stack)?);
            self.view_layers_of(conn, &ids)
        })
    }

    /// `layers` (newest first, published or squashed layers of `stack`) then the
    /// stack's base layers: the view of a manifest holding exactly those layers.
    pub fn layers_view(
        &self,
        stack: &str,
        layers: &[LayerId],
    ) -> Result<Vec<ViewLayer>, StoreError> {
        self.db.read(|conn| {
            let mut ids = layers.to_vec();
            ids.extend(stack_base_layers(conn, stack)?);
            self.view_layers_of(conn, &ids)
        })
    }

    /// The layers session `session` reads on manifest `manifest`: its private
    /// layers, the manifest's, the stack's base — in the order of the lower
    /// directories of [`Store::publish_context`] and [`Store::head_view`].
    pub fn session_view_layers(
        &self,
        session: SessionId,
        manifest: ManifestId,
    ) -> Result<Vec<ViewLayer>, StoreError> {
        self.db.read(|conn| {
            let s = get_sess(conn, session)?;
            let ids = self.session_lowers(conn, &s, manifest)?;
            self.view_layers_of(conn, &ids)
        })
    }

    fn view_layers_of(
        &self,
        conn: &Connection,
        ids: &[LayerId],
    ) -> Result<Vec<ViewLayer>, StoreError> {
        let kinds = layer_kinds(conn, ids)?;
        let dirs = self.layer_dirs(conn, ids)?;
        Ok(ids
            .iter()
            .zip(kinds)
            .zip(dirs)
            .map(|((&id, kind), dir)| ViewLayer { id, kind, dir })
            .collect())
    }

    /// `layers` with every squashed layer replaced by its members (recursively),
    /// newest first: the layers as published, whose path index rows are kept.
    pub fn expand_layers(&self, layers: &[LayerId]) -> Result<Vec<LayerId>, StoreError> {
        self.db
            .read(|conn| crate::paths::expand(conn, &self.expansions, layers))
    }

    /// Moves session `session`, whose run ended in conflict with its upper and
    /// lease kept, onto manifest `to` (a head of its stack): the lease on
    /// `expected` is released and a new one taken on `to`; `markers` records the
    /// conflict blocks written into its upper (see the module docs). The outcome
    /// stays `conflict` (the run is published again through the gate).
    ///
    /// Errors: `SessionNotFound`; `FailedPrecondition` when the session's last
    /// outcome is not a conflict, it holds no lease, a container let go of it
    /// (a sandbox session in conflict is released by its holder and rebased
    /// all the same), its lease is not on `expected` any more (it changed
    /// meanwhile), or `to` is another stack's.
    pub fn rebase_session(
        &self,
        session: SessionId,
        expected: ManifestId,
        to: ManifestId,
        markers: &[MarkerRecord],
    ) -> Result<SessionInfo, StoreError> {
        let info = self.db.write(|tx| {
            let s = get_sess(tx, session)?;
            let lease = s.lease_id.ok_or_else(|| {
                StoreError::FailedPrecondition(format!(
                    "session {session} holds no lease (its run ended): nothing to rebase"
                ))
            })?;
            let outcome: Option<String> = match s.last_publish {
                Some(p) => tx
                    .one("SELECT outcome FROM publishes WHERE id = ?1", [p], |r| {
                        r.get(0)
                    })
                    .optional()?,
                None => None,
            };
            if outcome.as_deref() != Some(OutcomeKind::Conflict.as_str()) {
                return Err(StoreError::FailedPrecondition(format!(
                    "session {session}'s last outcome is {}, not conflict: only a conflicting session is rebased",
                    outcome.as_deref().unwrap_or("none"),
                )));
            }
            // A sandbox holder releases its session when it closes; the
            // conflicting writes stay for a rebase. A container that let go of
            // its session (containerd removed the snapshot) ended it.
            if s.released && !s.owner.is_sandbox() {
                return Err(StoreError::FailedPrecondition(format!(
                    "session {session} conflicted and its owner ({}) let go of it: its writes are kept for inspection only; discard them",
                    s.owner.display()
                )));
            }
            if lease_manifest(tx, lease)? != expected {
                return Err(StoreError::FailedPrecondition(format!(
                    "session {session}'s lease changed while it was being rebased: rebase again"
                )));
            }
            let on: Option<String> = tx
                .one("SELECT stack FROM manifests WHERE id = ?1", [to], |r| {
                    r.get(0)
                })
                .optional()?;
            if on.as_deref() != Some(s.stack.as_str()) {
                return Err(StoreError::FailedPrecondition(format!(
                    "manifest {to} is not a manifest of stack {}",
                    s.stack
                )));
            }
            release_lease(tx, Some(lease))?;
            let new = new_lease(tx, to, HolderKind::Session, &session.to_string())?;
            tx.exec(
                "UPDATE sessions SET lease_id = ?2, updated_ns = ?3 WHERE id = ?1",
                params![session, new, crate::now_ns()],
            )?;
            let mut ins = tx.prepare_cached(
                "INSERT OR REPLACE INTO session_markers(session_id, lease_id, path, digest, start_line) VALUES (?1, ?2, ?3, ?4, ?5)",
            )?;
            for m in markers {
                ins.execute(params![session, new, m.path, m.digest.to_vec(), m.line])?;
            }
            self.session_info(tx, get_sess(tx, session)?)
        })?;
        info!(
            session.id = session,
            from = expected,
            to,
            markers = markers.len(),
            "session rebased"
        );
        Ok(info)
    }

    /// Records `markers` for session `session`'s current lease, which must be on
    /// `expected`: written before a rebase edits the upper, so that a crash
    /// between the edit and [`Store::rebase_session`] cannot let the markers be
    /// published on the old lease either. Errors: `SessionNotFound`,
    /// `FailedPrecondition` (no lease, or not on `expected`).
    pub fn stage_markers(
        &self,
        session: SessionId,
        expected: ManifestId,
        markers: &[MarkerRecord],
    ) -> Result<(), StoreError> {
        self.db.write(|tx| {
            let s = get_sess(tx, session)?;
            let lease = s
                .lease_id
                .filter(|l| lease_manifest(tx, *l).ok() == Some(expected))
                .ok_or_else(|| {
                    StoreError::FailedPrecondition(format!(
                        "session {session}'s lease changed while it was being rebased: rebase again"
                    ))
                })?;
            let mut ins = tx.prepare_cached(
                "INSERT OR REPLACE INTO session_markers(session_id, lease_id, path, digest, start_line) VALUES (?1, ?2, ?3, ?4, ?5)",
            )?;
            for m in markers {
                ins.execute(params![session, lease, m.path, m.digest.to_vec(), m.line])?;
            }
            Ok(())
        })
    }

    /// The conflict blocks recorded for session `session`'s current lease (empty
    /// when it holds none or was never rebased), by path.
    pub fn session_markers(&self, session: SessionId) -> Result<Vec<MarkerRecord>, StoreError> {
        self.db.read(|conn| {
            let s = get_sess(conn, session)?;
            let Some(lease) = s.lease_id else {
                return Ok(Vec::new());
            };
            let mut stmt = conn.prepare_cached(
                "SELECT path, digest, start_line FROM session_markers WHERE session_id = ?1 AND lease_id = ?2 ORDER BY path, start_line",
            )?;
            let rows: Vec<(Vec<u8>, Option<Vec<u8>>, i64)> = stmt
                .query_map(params![session, lease], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                })?
                .collect::<Result<_, _>>()?;
            rows.into_iter()
                .map(|(path, digest, line)| {
                    let key = || format!("session {session}, path {}", crate::escape_path(&path));
                    let digest = digest_col(digest, "session_markers", &key)?
                        .ok_or_else(|| StoreError::corrupt("session_markers", key(), "no digest"))?;
                    Ok(MarkerRecord {
                        path,
                        digest,
                        line: u32::try_from(line).unwrap_or(0),
                    })
                })
                .collect()
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn s(name: &str) -> LineOwner {
        LineOwner::Session {
            name: name.into(),
            session: 1,
        }
    }

    #[test]
    fn coalesce_and_tile_round_trip_with_gaps() {
        let owners = vec![
            Some(LineOwner::Original),
            Some(LineOwner::Original),
            Some(s("a")),
            None,
            Some(s("a")),
            Some(s("a")),
        ];
        let r = coalesce(&owners);
        assert_eq!(
            r,
            [
                OwnerRange {
                    start: 1,
                    end: 2,
                    owner: LineOwner::Original
                },
                OwnerRange {
                    start: 3,
                    end: 3,
                    owner: s("a")
                },
                OwnerRange {
                    start: 5,
                    end: 6,
                    owner: s("a")
                },
            ]
        );
        assert_eq!(tile(&r, 6), owners);
        // Rows beyond the file are ignored, missing lines are unknown.
        assert_eq!(tile(&r, 4), owners[..4]);
        assert_eq!(tile(&r, 8)[6..], [None, None]);
        assert_eq!(s("x").display(), "session:x");
        assert_eq!(
            LineOwner::of_session(
                &Owner::Operation {
                    id: "req-91".into()
                },
                4
            )
            .display(),
            "operation:req-91"
        );
        assert_eq!(
            LineOwner::of_session(
                &Owner::Container {
                    namespace: "ns".into(),
                    id: "c1".into()
                },
                4
            )
            .display(),
            "session:c1"
        );
    }

    // ---- Against a real store ------------------------------------------

    use crate::{
        ChangeKind, CommitRecord, IndexEntry, OutcomeRecord, PathRecord, PathStatus,
        SNAPSHOT_REF_LABEL,
    };
    use std::collections::BTreeMap;

    fn store() -> (tempfile::TempDir, Store, String) {
        let dir = tempfile::Builder::new()
            .prefix("ls-blame-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let st = Store::open(&dir.path().join("root"), &crate::StoreOptions::default()).unwrap();
        let labels = BTreeMap::from([(SNAPSHOT_REF_LABEL.to_string(), "sha256:aaa".to_string())]);
        st.prepare("ns/1/extract-1 sha256:aaa", "", labels, false)
            .unwrap();
        st.commit(
            "ns/2/sha256:aaa",
            "ns/1/extract-1 sha256:aaa",
            BTreeMap::new(),
        )
        .unwrap();
        (dir, st, "ns/sha256:aaa".to_string())
    }

    fn session(st: &Store, n: u32) -> SessionId {
        st.prepare(
            &format!("ns/{}/c{n}", 10 + n),
            "ns/2/sha256:aaa",
            BTreeMap::new(),
            false,
        )
        .unwrap();
        st.find_session("ns", &format!("c{n}")).unwrap().unwrap().id
    }

    fn entry(path: &str, d: u8) -> IndexEntry {
        IndexEntry {
            path: path.as_bytes().to_vec(),
            kind: ChangeKind::Write,
            digest: Some([d; 32]),
            mode: Some(0o644),
            uid: Some(0),
            gid: Some(0),
            xattrs: None,
        }
    }

    fn file(path: &str, d: u8, owners: &[Option<LineOwner>]) -> FileBlame {
        FileBlame {
            path: path.as_bytes().to_vec(),
            digest: [d; 32],
            ranges: coalesce(owners),
        }
    }

    /// Stages and (unless `commit` is false) commits a publish of `sid` with
    /// `files` as its blame; returns the layer.
    fn publish(
        st: &Store,
        stack: &str,
        sid: SessionId,
        files: &[FileBlame],
        commit: bool,
    ) -> LayerId {
        let index: Vec<IndexEntry> = files
            .iter()
            .map(|f| entry(std::str::from_utf8(&f.path).unwrap(), f.digest[0]))
            .collect();
        let paths: Vec<PathRecord> = index
            .iter()
            .map(|e| PathRecord {
                path: e.path.clone(),
                status: PathStatus::Clean,
                reason: "untouched on head".into(),
            })
            .collect();
        let staged = st.stage_publish(sid, &index, &paths).unwrap();
        st.stage_blame(stack, staged.layer, files).unwrap();
        if commit {
            let head = st.head_view(sid).unwrap().manifest;
            st.commit_publish(sid, staged, head, CommitRecord::default())
                .unwrap();
        } else {
            st.abandon_staged(staged).unwrap();
        }
        staged.layer
    }

    fn rows(st: &Store) -> i64 {
        st.db
            .read(|c| Ok(c.one("SELECT count(*) FROM blame_ranges", [], |r| r.get(0))?))
            .unwrap()
    }

    fn head_layers(st: &Store, stack: &str) -> Vec<LayerId> {
        st.manifest(st.branch_head(stack, "main").unwrap()).unwrap()
    }

    #[test]
    fn rows_are_read_only_once_committed_and_the_view_picks_its_version() {
        let (_d, st, stack) = store();
        let a = session(&st, 1);
        let a_owner = LineOwner::of_session(
            &Owner::Container {
                namespace: "ns".into(),
                id: "c1".into(),
            },
            a,
        );
        // A staged publish that is abandoned leaves nothing.
        let f = file("f", 7, &[Some(a_owner.clone()), None]);
        publish(&st, &stack, a, std::slice::from_ref(&f), false);
        assert_eq!(rows(&st), 0);
        let l1 = publish(&st, &stack, a, std::slice::from_ref(&f), true);
        let view = head_layers(&st, &stack);
        assert_eq!(view, [l1]);
        let got = st
            .version_blame(&stack, &view, b"f", &[7; 32])
            .unwrap()
            .unwrap();
        assert_eq!(tile(&got, 2), [Some(a_owner.clone()), None]);
        assert_eq!(
            st.version_blame(&stack, &view, b"f", &[8; 32]).unwrap(),
            None
        );
        assert_eq!(
            st.version_blame(&stack, &view, b"g", &[7; 32]).unwrap(),
            None
        );
        // Another session publishes the same bytes at the same path later (a
        // revert): that head's version is its own rows; an older view keeps the
        // first layer's; a view without either falls back to the newest rows.
        let b = session(&st, 2);
        let b_owner = LineOwner::of_session(&Owner::Sandbox { name: "sb".into() }, b);
        let l2 = publish(
            &st,
            &stack,
            b,
            &[file(
                "f",
                7,
                &[Some(b_owner.clone()), Some(b_owner.clone())],
            )],
            true,
        );
        let now = head_layers(&st, &stack);
        assert_eq!(now, [l2, l1]);
        let got = st
            .version_blame(&stack, &now, b"f", &[7; 32])
            .unwrap()
            .unwrap();
        assert_eq!(
            tile(&got, 2),
            [Some(b_owner.clone()), Some(b_owner.clone())]
        );
        let got = st
            .version_blame(&stack, &[l1], b"f", &[7; 32])
            .unwrap()
            .unwrap();
        assert_eq!(tile(&got, 2), [Some(a_owner), None]);
        let got = st
            .version_blame(&stack, &[], b"f", &[7; 32])
            .unwrap()
            .unwrap();
        assert_eq!(got[0].owner, b_owner);
        // Another stack never reads them.
        assert_eq!(
            st.version_blame("ns/sha256:zzz", &now, b"f", &[7; 32])
                .unwrap(),
            None
        );
    }

    #[test]
    fn rows_survive_squash_and_go_with_gc_and_stack_removal() {
        let (_d, st, stack) = store();
        let mut layers = Vec::new();
        for n in 1..=3u8 {
            let sid = session(&st, u32::from(n));
            let owner = LineOwner::of_session(
                &Owner::Container {
                    namespace: "ns".into(),
                    id: format!("c{n}"),
                },
                sid,
            );
            layers.push(publish(
                &st,
                &stack,
                sid,
                &[file(&format!("f{n}"), n, &[Some(owner)])],
                true,
            ));
        }
        let head = st.branch_head(&stack, "main").unwrap();
        let run = head_layers(&st, &stack);
        let (dir, _g) = st.staging_dir("squash").unwrap();
        let sq = st.commit_squash(&stack, "main", head, &run, &dir).unwrap();
        let view = head_layers(&st, &stack);
        assert_eq!(view, [sq.layer]);
        for n in 1..=3u8 {
            let got = st
                .version_blame(&stack, &view, format!("f{n}").as_bytes(), &[n; 32])
                .unwrap()
                .unwrap();
            assert_eq!(got[0].owner.display(), format!("session:c{n}"));
        }
        // GC frees the members' directories but keeps their rows (the squash
        // lists them), so blame still answers.
        st.gc(&[]).unwrap();
        assert_eq!(rows(&st), 3);
        assert!(st
            .version_blame(&stack, &view, b"f2", &[2; 32])
            .unwrap()
            .is_some());
        // A removed stack loses its rows; its layers go with the next GC.
        for s in st.sessions().unwrap() {
            st.release_session(s.id, false).unwrap();
        }
        st.remove_stack(&stack, true).unwrap();
        assert_eq!(rows(&st), 0);
        st.gc(&[]).unwrap();
        assert_eq!(rows(&st), 0);
    }

    #[test]
    fn a_conflicting_session_is_rebased_with_its_markers() {
        let (_d, st, stack) = store();
        let a = session(&st, 1);
        let b = session(&st, 2);
        let lease = st.session(a).unwrap().lease_manifest.unwrap();
        publish(&st, &stack, b, &[file("f", 1, &[])], true);
        let head = st.branch_head(&stack, "main").unwrap();
        let marker = MarkerRecord {
            path: b"f".to_vec(),
            digest: [9; 32],
            line: 2,
        };
        // Not in conflict yet: refused.
        let e = st
            .rebase_session(a, lease, head, std::slice::from_ref(&marker))
            .unwrap_err();
        assert!(e.to_string().contains("not conflict"), "{e}");
        st.record_outcome(a, OutcomeRecord::new(OutcomeKind::Conflict, "c"), None)
            .unwrap();
        // A stale expectation is refused; the right one moves the lease.
        let e = st.rebase_session(a, head, head, &[]).unwrap_err();
        assert!(e.to_string().contains("changed"), "{e}");
        assert!(st.session_markers(a).unwrap().is_empty());
        let s = st
            .rebase_session(a, lease, head, std::slice::from_ref(&marker))
            .unwrap();
        assert_eq!(s.lease_manifest, Some(head));
        assert_eq!(s.outcome.map(|o| o.kind), Some(OutcomeKind::Conflict));
        assert_eq!(st.session_markers(a).unwrap(), [marker]);
        // Once the run ends (here: discarded), the markers no longer apply.
        st.record_outcome(a, OutcomeRecord::new(OutcomeKind::Discarded, "d"), None)
            .unwrap();
        assert!(st.session_markers(a).unwrap().is_empty());
    }
}
