//! Admin RPCs about what is inside the history (issue 10): `Blame`, `Diff`,
//! `ShowConflicts` and `RebaseSession` — thin calls into the engine.

use std::pin::Pin;

use layerstack_api as api;
use layerstack_engine::publisher::FileKind;
use layerstack_engine::store::escape_path;
use layerstack_engine::{DiffChange, DiffEntry, DiffTarget, EntryInfo};
use tonic::Status;

use crate::admin::{engine_status, AdminService};

/// Paths per streamed reply.
const BATCH: usize = 500;

pub type DiffStream = Pin<Box<dyn futures::Stream<Item = Result<api::DiffReply, Status>> + Send>>;
pub type ConflictsStream =
    Pin<Box<dyn futures::Stream<Item = Result<api::ConflictsReply, Status>> + Send>>;

fn kind_name(k: FileKind) -> &'static str {
    match k {
        FileKind::Regular => "file",
        FileKind::Dir => "dir",
        FileKind::Symlink => "symlink",
        FileKind::Fifo => "fifo",
        FileKind::CharDev => "char",
        FileKind::BlockDev => "block",
        FileKind::Socket => "socket",
    }
}

fn diff_entry(e: DiffEntry) -> api::DiffEntry {
    let side = |i: &Option<EntryInfo>| {
        i.map(|i| (kind_name(i.kind).to_string(), i.size, i.mode))
            .unwrap_or_default()
    };
    let (old_kind, old_size, old_mode) = side(&e.old);
    let (new_kind, new_size, new_mode) = side(&e.new);
    api::DiffEntry {
        path: escape_path(&e.path),
        raw_path: e.path,
        change: match e.change {
            DiffChange::Added => "added",
            DiffChange::Modified => "modified",
            DiffChange::Deleted => "deleted",
        }
        .to_string(),
        old_kind,
        new_kind,
        old_size,
        new_size,
        old_mode,
        new_mode,
        patch: e.patch.unwrap_or_default(),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl AdminService {
    fn branch_name(&self, b: &str) -> String {
        if b.is_empty() {
            self.engine.default_branch().to_string()
        } else {
            b.to_string()
        }
    }

    pub(crate) async fn blame_file(
        &self,
        r: api::BlameRequest,
    ) -> Result<api::BlameResponse, Status> {
        if r.path.is_empty() {
            return Err(Status::invalid_argument("path is required"));
        }
        let stack = self.stack_of(&r.namespace, &r.stack).await?;
        let branch = self.branch_name(&r.branch);
        let b = self
            .engine
            .blame(&stack, &branch, &r.path)
            .await
            .map_err(engine_status)?;
        Ok(api::BlameResponse {
            path: escape_path(&b.path),
            digest: hex(&b.digest),
            lines: b.lines as u64,
            layer: b.layer,
            layer_kind: b.layer_kind.as_str().to_string(),
            ranges: b
                .ranges
                .iter()
                .map(|x| api::BlameRange {
                    start: x.start,
                    end: x.end,
                    owner: x.owner.display(),
                    session: x.owner.session().unwrap_or(0),
                })
                .collect(),
            stack: b.stack,
            branch: b.branch,
            manifest: b.manifest,
        })
    }

    pub(crate) async fn diff_stream(&self, r: api::DiffRequest) -> Result<DiffStream, Status> {
        let d = if r.session_id != 0 || !r.container.is_empty() {
            let s = self
                .resolve(r.session_id, &r.namespace, &r.container)
                .await?;
            self.engine
                .diff_session(s.id, r.patch)
                .await
                .map_err(engine_status)?
        } else {
            let stack = self.stack_of(&r.namespace, &r.stack).await?;
            let to = self.branch_name(&r.to);
            let old = match self.at_layer(&stack, r.at_layer, r.at_base).await? {
                Some(layer) => DiffTarget::Layer {
                    branch: to.clone(),
                    layer,
                },
                None => DiffTarget::Branch(self.branch_name(&r.from)),
            };
            self.engine
                .diff(&stack, old, DiffTarget::Branch(to), r.patch)
                .await
                .map_err(engine_status)?
        };
        let mut replies = vec![Ok(api::DiffReply {
            old: d.old,
            new: d.new,
            entries: Vec::new(),
        })];
        let mut entries = d.entries.into_iter().peekable();
        while entries.peek().is_some() {
            replies.push(Ok(api::DiffReply {
                old: String::new(),
                new: String::new(),
                entries: entries.by_ref().take(BATCH).map(diff_entry).collect(),
            }));
        }
        Ok(Box::pin(futures::stream::iter(replies)))
    }

    pub(crate) async fn conflicts_stream(
        &self,
        r: api::ShowConflictsRequest,
    ) -> Result<ConflictsStream, Status> {
        let s = self
            .resolve(r.session_id, &r.namespace, &r.container)
            .await?;
        let views = self.engine.conflicts(s.id).await.map_err(engine_status)?;
        let mut replies = vec![Ok(api::ConflictsReply {
            session: Some(self.to_api(s).await?),
            entries: Vec::new(),
        })];
        let mut views = views.into_iter().peekable();
        while views.peek().is_some() {
            replies.push(Ok(api::ConflictsReply {
                session: None,
                // Three-way views can be large: fewer per reply.
                entries: views
                    .by_ref()
                    .take(BATCH / 10)
                    .map(|v| api::ConflictEntry {
                        path: escape_path(&v.path),
                        raw_path: v.path,
                        reason: v.reason,
                        text: v.text.unwrap_or_default(),
                        blocks: u32::try_from(v.blocks).unwrap_or(u32::MAX),
                        note: v.note.unwrap_or_default(),
                    })
                    .collect(),
            }));
        }
        Ok(Box::pin(futures::stream::iter(replies)))
    }

    pub(crate) async fn rebase(
        &self,
        r: api::RebaseSessionRequest,
    ) -> Result<api::RebaseSessionResponse, Status> {
        let s = self
            .resolve(r.session_id, &r.namespace, &r.container)
            .await?;
        let rb = self.engine.rebase(s.id).await.map_err(engine_status)?;
        Ok(api::RebaseSessionResponse {
            head: rb.manifest,
            merged: rb.merged.iter().map(|p| escape_path(p)).collect(),
            marked: rb
                .marked
                .iter()
                .map(|(p, n)| api::MarkedPath {
                    path: escape_path(p),
                    blocks: u32::try_from(*n).unwrap_or(u32::MAX),
                })
                .collect(),
            session: Some(self.to_api(rb.session).await?),
        })
    }
}
