//! Admin RPCs about history: stacks, branches, log, promote, squash, GC and
//! disk usage. Stacks are named by an image reference (resolved through
//! containerd), a stack id or a base digest — so history stays reachable after
//! `ctr images rm`.

use std::pin::Pin;

use layerstack_api as api;
use layerstack_engine::store::{escape_path, BranchInfo, ChangeKind, StoreError, Usage};
use layerstack_engine::{EngineError, Promoted};
use tonic::Status;

use crate::admin::{engine_status, require, AdminService};

pub type LogStream = Pin<Box<dyn futures::Stream<Item = Result<api::LogReply, Status>> + Send>>;

fn branch(b: &BranchInfo) -> api::Branch {
    api::Branch {
        stack: b.stack.clone(),
        name: b.name.clone(),
        head: b.head,
        depth: b.depth,
        updated_ns: b.updated_ns,
    }
}

fn usage(u: &Usage) -> api::Usage {
    api::Usage {
        hot: u.hot,
        cold: u.cold,
        uppers: u.uppers,
        staging: u.staging,
        metadata: u.metadata,
        snapshots: u.snapshots,
        total: u.total(),
    }
}

fn change_kind(k: ChangeKind) -> &'static str {
    match k {
        ChangeKind::Write => "write",
        ChangeKind::Symlink => "symlink",
        ChangeKind::Mkdir => "mkdir",
        ChangeKind::Delete => "delete",
        ChangeKind::Opaque => "opaque",
        ChangeKind::Meta => "meta",
        ChangeKind::Special => "special",
    }
}

impl AdminService {
    /// The stack `spec` names in `namespace`: a stack id or base digest known to
    /// the store, else an image reference resolved through containerd.
    pub(crate) async fn stack_of(&self, namespace: &str, spec: &str) -> Result<String, Status> {
        require("stack (an image reference, stack id or base digest)", spec)?;
        let (ns, sp) = (namespace.to_string(), spec.to_string());
        if let Some(id) = self
            .engine
            .resolve_stack(&ns, &sp)
            .await
            .map_err(engine_status)?
        {
            return Ok(id);
        }
        // A stack id (`import:sha256:…`, `<namespace>/sha256:…`) names no image:
        // unknown to the store, it is not found — asking containerd would only
        // turn that into UNAVAILABLE while containerd is down.
        // So is a base digest (`sha256:…`: no image name starts so).
        let stack_id_shaped = spec.starts_with(layerstack_engine::types::IMPORT_STACK_PREFIX)
            || spec.starts_with("sha256:")
            || spec
                .split_once('/')
                .is_some_and(|(_, rest)| rest.starts_with("sha256:"));
        if stack_id_shaped {
            return Err(Status::not_found(format!(
                "no stack or base {spec:?} (see `layerstack stack ls`, or ListStacks)"
            )));
        }
        // No containerd socket, and none reached since the daemon started (a
        // daemon run without containerd, as a sandbox service): nothing
        // resolves the name — NOT_FOUND, not UNAVAILABLE, which harnesses
        // retry. A socket gone after containerd was reached is a restart.
        if !self.containerd_address.exists() && !crate::containerd::reached() {
            return Err(Status::not_found(format!(
                "no stack {spec:?}: not a stack id or base digest of the store, and this daemon has no containerd to resolve it as an image reference (no socket at {}; see `layerstack stack ls`, or import a base with `layerstack base import`)",
                self.containerd_address.display()
            )));
        }
        let chain = crate::containerd::resolve_stack(&self.containerd_address, namespace, spec)
            .await
            .map_err(|e| {
                let m = api::error_chain(&e);
                match e {
                    crate::containerd::ContainerdError::ImageNotFound { .. } => Status::not_found(
                        format!("{m}; nor is {spec:?} a stack id or base digest (see `layerstack stack ls`)"),
                    ),
                    crate::containerd::ContainerdError::Connect(..) => Status::unavailable(format!(
                        "{m}; name the stack by its id or base digest (`layerstack stack ls`) while containerd is down"
                    )),
                    _ => Status::internal(m),
                }
            })?;
        Ok(layerstack_engine::store::stack_id(namespace, &chain))
    }

    fn branch_or_default(&self, b: &str) -> String {
        if b.is_empty() {
            self.engine.default_branch().to_string()
        } else {
            b.to_string()
        }
    }

    pub(crate) async fn history_log(&self, r: api::LogRequest) -> Result<LogStream, Status> {
        let stack = self.stack_of(&r.namespace, &r.image).await?;
        let branch = self.branch_or_default(&r.branch);
        let (st, br, image) = (stack.clone(), branch.clone(), r.image.clone());
        let entries = self.engine.log(&st, &br).await.map_err(|e| match e {
            EngineError::Store(StoreError::BranchNotFound { .. }) => Status::not_found(format!(
                "{}: no session of {image:?} has used branch {:?} yet (see `layerstack branch ls`)",
                api::error_chain(&e),
                r.branch
            )),
            other => engine_status(other),
        })?;
        let mut replies = vec![Ok(api::LogReply {
            stack,
            branch,
            ..Default::default()
        })];
        for e in entries {
            let mut entry = self.log_entry(e, r.paths).await?;
            let mut more = Vec::new();
            page_paths(&mut entry, &mut more);
            replies.push(Ok(api::LogReply {
                entry: Some(entry),
                ..Default::default()
            }));
            replies.extend(more.into_iter().map(|m| {
                Ok(api::LogReply {
                    more: Some(m),
                    ..Default::default()
                })
            }));
        }
        Ok(Box::pin(futures::stream::iter(replies)))
    }

    /// `e` for the wire, its members too; with `paths`, what each changed (all
    /// of it: [`page_paths`] splits it for the wire).
    fn log_entry(
        &self,
        e: layerstack_engine::store::LogEntry,
        paths: bool,
    ) -> Pin<Box<dyn std::future::Future<Output = Result<api::LogEntry, Status>> + Send + '_>> {
        Box::pin(async move {
            let changed = if paths {
                let layer = e.layer;
                self.engine
                    .layer_index(layer)
                    .await
                    .map_err(engine_status)?
                    .into_iter()
                    .map(|i| api::PathChange {
                        path: escape_path(&i.path),
                        kind: change_kind(i.kind).to_string(),
                        raw_path: i.path,
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let (namespace, container) = match &e.owner {
                Some(layerstack_engine::store::Owner::Container { namespace, id }) => {
                    (namespace.clone(), id.clone())
                }
                _ => (String::new(), String::new()),
            };
            let mut members = Vec::with_capacity(e.members.len());
            for m in e.members {
                members.push(self.log_entry(m, paths).await?);
            }
            Ok(api::LogEntry {
                layer: e.layer,
                manifest: e.manifest,
                session: e.session.unwrap_or(0),
                namespace,
                container,
                paths: e.paths,
                created_ns: e.created_ns,
                kind: e.kind.as_str().to_string(),
                owner: e.owner.as_ref().map(|o| o.display()).unwrap_or_default(),
                changed,
                members,
            })
        })
    }

    pub(crate) async fn stacks(
        &self,
        r: api::ListStacksRequest,
    ) -> Result<api::ListStacksResponse, Status> {
        let all = self.engine.stacks().await.map_err(engine_status)?;
        let usage_by_stack = if r.usage {
            Some(
                self.engine
                    .disk_usage()
                    .await
                    .map_err(engine_status)?
                    .stacks,
            )
        } else {
            None
        };
        // An imported base belongs to no namespace: listed in every one.
        let all: Vec<_> = all
            .into_iter()
            .filter(|st| match &st.namespace {
                Some(ns) => r.all_namespaces || *ns == r.namespace,
                None => true,
            })
            .collect();
        let (all, next_page_token) = crate::admin::page(
            all,
            |st| st.id.as_bytes().to_vec(),
            r.page_size,
            &r.page_token,
        )?;
        let mut out = Vec::new();
        let mut images: std::collections::HashMap<String, Vec<(String, String)>> =
            Default::default();
        for st in all {
            let image_refs = match &st.namespace {
                Some(ns) => {
                    if !images.contains_key(ns) {
                        // Best effort: containerd may be down; history does not need it.
                        let list =
                            crate::containerd::list_image_chains(&self.containerd_address, ns)
                                .await
                                .unwrap_or_default();
                        images.insert(ns.clone(), list);
                    }
                    images[ns]
                        .iter()
                        .filter(|(_, chain)| *chain == st.base_digest)
                        .map(|(name, _)| name.clone())
                        .collect()
                }
                // An imported base belongs to no namespace: listed in every one,
                // with no image.
                None => Vec::new(),
            };
            let heads: Vec<i64> = st.branches.iter().map(|b| b.head).collect();
            let layers = self.engine.layers_of(heads).await.map_err(engine_status)? as u64;
            out.push(api::Stack {
                usage: usage_by_stack
                    .as_ref()
                    .map(|u| usage(&u.get(&st.id).cloned().unwrap_or_default())),
                id: st.id,
                namespace: st.namespace,
                base_digest: st.base_digest,
                image_refs,
                base_layers: st.base_layers.len() as u64,
                layers,
                branches: st.branches.iter().map(branch).collect(),
            });
        }
        Ok(api::ListStacksResponse {
            stacks: out,
            next_page_token,
        })
    }

    pub(crate) async fn stack_rm(
        &self,
        r: api::RemoveStackRequest,
    ) -> Result<api::GcResponse, Status> {
        let stack = self.stack_of(&r.namespace, &r.stack).await?;
        let c = self
            .engine
            .remove_stack(&stack, r.force)
            .await
            .map_err(engine_status)?;
        Ok(api::GcResponse {
            layers: c.report.layers.len() as u64,
            manifests: c.report.manifests,
            bytes_freed: c.report.bytes_freed,
            uppers_released: c.uppers_released,
        })
    }

    pub(crate) async fn branches(
        &self,
        r: api::ListBranchesRequest,
    ) -> Result<api::ListBranchesResponse, Status> {
        let stack = self.stack_of(&r.namespace, &r.stack).await?;
        let st = stack.clone();
        let list = self.engine.branches(&st).await.map_err(engine_status)?;
        let (list, next_page_token) = crate::admin::page(
            list,
            |b| b.name.as_bytes().to_vec(),
            r.page_size,
            &r.page_token,
        )?;
        Ok(api::ListBranchesResponse {
            stack,
            branches: list.iter().map(branch).collect(),
            next_page_token,
        })
    }

    pub(crate) async fn branch_create(
        &self,
        r: api::CreateBranchRequest,
    ) -> Result<api::Branch, Status> {
        require("name", &r.name)?;
        let stack = self.stack_of(&r.namespace, &r.stack).await?;
        let from = self.branch_or_default(&r.from);
        let at = self.at_layer(&stack, r.at_layer, r.at_base).await?;
        let b = self
            .engine
            .create_branch(&stack, &r.name, &from, at)
            .await
            .map_err(engine_status)?;
        Ok(branch(&b))
    }

    pub(crate) async fn branch_delete(
        &self,
        r: api::DeleteBranchRequest,
    ) -> Result<api::DeleteBranchResponse, Status> {
        require("name", &r.name)?;
        let stack = self.stack_of(&r.namespace, &r.stack).await?;
        self.engine
            .delete_branch(&stack, &r.name)
            .await
            .map_err(engine_status)?;
        Ok(api::DeleteBranchResponse {})
    }

    pub(crate) async fn branch_promote(
        &self,
        r: api::PromoteRequest,
    ) -> Result<api::PromoteResponse, Status> {
        require("from", &r.from)?;
        require("to", &r.to)?;
        let stack = self.stack_of(&r.namespace, &r.stack).await?;
        let to = self.promote_target(&r.namespace, &stack, &r.to).await?;
        let r = api::PromoteRequest { to, ..r };
        let op = if r.operation.is_empty() {
            format!("promote-{}-{}", std::process::id(), now_ms())
        } else {
            r.operation.clone()
        };
        let out = self
            .engine
            .promote(&stack, &r.from, &r.to, &op)
            .await
            .map_err(engine_status)?;
        let (st, to) = (stack.clone(), r.to.clone());
        let head = self
            .engine
            .branch_head(&st, &to)
            .await
            .map_err(engine_status)?;
        Ok(match out {
            Promoted::UpToDate { .. } => api::PromoteResponse {
                result: "up-to-date".into(),
                head,
                session: None,
                message: format!("{} already shows everything {} has", r.to, r.from),
            },
            Promoted::FastForward { .. } => api::PromoteResponse {
                result: "fast-forward".into(),
                head,
                session: None,
                message: format!("{} now points at {}'s head", r.to, r.from),
            },
            Promoted::Merged { session } => api::PromoteResponse {
                result: "merged".into(),
                head,
                message: session
                    .outcome
                    .as_ref()
                    .and_then(|o| o.message.clone())
                    .unwrap_or_default(),
                session: Some(self.to_api(*session).await?),
            },
            Promoted::Conflict { session } => api::PromoteResponse {
                result: "conflict".into(),
                head,
                message: self.refused_promote(&session, &r.from, &r.to).await,
                session: Some(self.to_api(*session).await?),
            },
        })
    }

    /// The layer an `--at` names: `at_layer` (0: none), or with `at_base` the
    /// stack's newest base layer — the image alone, which the store and the
    /// engine accept as the base of any branch's log.
    ///
    /// Errors: `InvalidArgument` when both are given.
    pub(crate) async fn at_layer(
        &self,
        stack: &str,
        at_layer: i64,
        at_base: bool,
    ) -> Result<Option<i64>, Status> {
        match (at_layer, at_base) {
            (0, false) => Ok(None),
            (l, false) => Ok(Some(l)),
            (0, true) => {
                let st = stack.to_string();
                let base = self.engine.base_layers(&st).await.map_err(engine_status)?;
                base.first().copied().map(Some).ok_or_else(|| {
                    Status::failed_precondition(format!("stack {stack} records no base layers"))
                })
            }
            (_, true) => Err(Status::invalid_argument(
                "give a layer or the base (`--at base`), not both",
            )),
        }
    }

    /// The branch a promote's `to` names, as `diff` reads its second side:
    /// `BRANCH`, `@BRANCH`, or `STACK@BRANCH` where STACK (an image reference,
    /// stack id or base digest) is `stack`, the stack FROM is a branch of — a
    /// promote moves a branch within one stack. (Branch names never hold `@`.)
    ///
    /// Errors: `InvalidArgument` when `to` names no branch or another stack;
    /// what [`AdminService::stack_of`] answers for STACK.
    async fn promote_target(
        &self,
        namespace: &str,
        stack: &str,
        to: &str,
    ) -> Result<String, Status> {
        let Some((spec, branch)) = to.rsplit_once('@') else {
            return Ok(to.to_string());
        };
        if branch.is_empty() || branch.contains(':') {
            return Err(Status::invalid_argument(format!(
                "{to:?} names no branch to promote onto: write BRANCH, @BRANCH or STACK@BRANCH"
            )));
        }
        if spec.is_empty() {
            return Ok(branch.to_string());
        }
        let other = self.stack_of(namespace, spec).await?;
        if other != stack {
            return Err(Status::invalid_argument(format!(
                "a promote moves a branch within one stack: the branch promoted is on stack {stack}, {to:?} names stack {other}; name a branch of {stack} (BRANCH or @BRANCH), or carry the history over as an image (`layerstack export`)"
            )));
        }
        Ok(branch.to_string())
    }

    /// The message of a promote refused whole: the conflicting paths (the first
    /// few), that `to` is unchanged and nothing of the promote is kept (its
    /// operation's upper is dropped: `from` still has the changes), and what to
    /// do. A failed merge publish gives its outcome's message.
    /// Up to `named` conflicting paths of the operation `session` ran, and
    /// how many conflicted in all (0 and none when its outcome is no
    /// conflict).
    pub(crate) async fn conflict_paths(
        &self,
        session: &layerstack_engine::store::SessionInfo,
        named: usize,
    ) -> (u64, Vec<String>) {
        let Some(o) = session.outcome.as_ref() else {
            return (0, Vec::new());
        };
        if o.kind != layerstack_engine::store::OutcomeKind::Conflict {
            return (0, Vec::new());
        }
        let paths = self
            .engine
            .outcome_paths(
                o.id,
                None,
                named,
                Some(layerstack_engine::store::PathStatus::Conflict),
            )
            .await
            .map(|ps| ps.iter().map(|p| escape_path(&p.path)).collect::<Vec<_>>())
            .unwrap_or_default();
        (o.counts.conflict, paths)
    }

    pub(crate) async fn refused_promote(
        &self,
        session: &layerstack_engine::store::SessionInfo,
        from: &str,
        to: &str,
    ) -> String {
        const NAMED: usize = 5;
        let Some(o) = session.outcome.as_ref() else {
            return format!("refused whole: {to} is unchanged");
        };
        if o.kind != layerstack_engine::store::OutcomeKind::Conflict {
            return format!(
                "refused whole: the merge publish ended {}: {}",
                o.kind.as_str(),
                o.message.as_deref().unwrap_or("no reason recorded")
            );
        }
        let (n, paths) = self.conflict_paths(session, NAMED).await;
        let more = if n > paths.len() as u64 { ", …" } else { "" };
        format!(
            "refused whole: {n} path(s) conflict with newer work on {to} ({}{more}); {to} is unchanged and nothing of the promote is kept ({from} still has its changes): change those paths on {from} or {to} so that the two no longer overlap, then promote again",
            paths.join(", ")
        )
    }

    pub(crate) async fn branch_squash(
        &self,
        r: api::SquashRequest,
    ) -> Result<api::SquashResponse, Status> {
        let stack = self.stack_of(&r.namespace, &r.stack).await?;
        let branch = self.branch_or_default(&r.branch);
        let (st, br) = (stack.clone(), branch.clone());
        let (_, before) = self
            .engine
            .branch_depth(&st, &br)
            .await
            .map_err(engine_status)?;
        let out = self
            .engine
            .squash(&stack, &branch)
            .await
            .map_err(engine_status)?;
        let (st, br) = (stack.clone(), branch.clone());
        let (head, after) = self
            .engine
            .branch_depth(&st, &br)
            .await
            .map_err(engine_status)?;
        Ok(api::SquashResponse {
            squashed: out.is_some(),
            layer: out.map(|s| s.layer).unwrap_or(0),
            head,
            depth_before: before as i64,
            depth_after: after as i64,
        })
    }

    pub(crate) async fn collect(&self) -> Result<api::GcResponse, Status> {
        let c = self.engine.gc().await.map_err(engine_status)?;
        Ok(api::GcResponse {
            layers: c.report.layers.len() as u64,
            manifests: c.report.manifests,
            bytes_freed: c.report.bytes_freed,
            uppers_released: c.uppers_released,
        })
    }

    pub(crate) async fn usage(
        &self,
        r: api::DiskUsageRequest,
    ) -> Result<api::DiskUsageResponse, Status> {
        let only = if r.stack.is_empty() {
            None
        } else {
            Some(self.stack_of(&r.namespace, &r.stack).await?)
        };
        let u = self.engine.disk_usage().await.map_err(engine_status)?;
        Ok(api::DiskUsageResponse {
            total: Some(usage(&u.total)),
            stacks: u
                .stacks
                .iter()
                .filter(|(id, _)| only.as_ref().is_none_or(|o| o == *id))
                .map(|(id, u)| api::StackUsage {
                    stack: id.clone(),
                    usage: Some(usage(u)),
                })
                .collect(),
        })
    }
}

fn now_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// Paths of one layer per log reply at most ([`api::LogReply`]): 4,096 paths of
/// up to ~1 KiB escaped twice (display + raw) stay far below gRPC's 4 MiB.
pub(crate) const LOG_PATHS_PER_REPLY: usize = 4096;

/// Cuts `entry`'s and its members' `changed` lists to
/// [`LOG_PATHS_PER_REPLY`] each, the rest as [`api::LogPaths`] pages in `more`
/// (in order: a layer's pages follow one another).
pub(crate) fn page_paths(entry: &mut api::LogEntry, more: &mut Vec<api::LogPaths>) {
    if entry.changed.len() > LOG_PATHS_PER_REPLY {
        let rest = entry.changed.split_off(LOG_PATHS_PER_REPLY);
        let mut rest = rest.into_iter().peekable();
        while rest.peek().is_some() {
            more.push(api::LogPaths {
                layer: entry.layer,
                changed: rest.by_ref().take(LOG_PATHS_PER_REPLY).collect(),
            });
        }
    }
    for m in &mut entry.members {
        page_paths(m, more);
    }
}

#[cfg(test)]
mod log_tests {
    use super::*;

    fn entry(layer: i64, n: usize, members: Vec<api::LogEntry>) -> api::LogEntry {
        api::LogEntry {
            layer,
            changed: (0..n)
                .map(|i| api::PathChange {
                    path: format!("/f{i}"),
                    kind: "write".into(),
                    raw_path: format!("f{i}").into_bytes(),
                })
                .collect(),
            members,
            ..Default::default()
        }
    }

    /// A layer's paths past one page go out in pages after the entry; put back
    /// in order, each layer (members too) has exactly what it changed.
    #[test]
    fn a_layers_paths_are_paged_and_reassemble_in_order() {
        let n = LOG_PATHS_PER_REPLY;
        let whole = entry(
            9,
            2 * n + 7,
            vec![entry(8, n + 1, vec![]), entry(7, 3, vec![])],
        );
        let mut e = whole.clone();
        let mut more = Vec::new();
        page_paths(&mut e, &mut more);
        assert_eq!(e.changed.len(), n);
        assert_eq!(e.members[0].changed.len(), n);
        assert_eq!(e.members[1].changed.len(), 3);
        assert_eq!(
            more.iter()
                .map(|m| (m.layer, m.changed.len()))
                .collect::<Vec<_>>(),
            [(9, n), (9, 7), (8, 1)]
        );
        for m in more {
            let target = if m.layer == 9 {
                &mut e
            } else {
                &mut e.members[0]
            };
            target.changed.extend(m.changed);
        }
        assert_eq!(e, whole);
    }
}
