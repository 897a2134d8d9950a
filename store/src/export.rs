//! Export leases: what an OCI export reads, pinned while it runs
//! (ARCHITECTURE.md §2 "Lease", §11; docs/architecture.md "OCI export").
//!
//! [`Store::lease_export`] pins, in one write transaction, the manifest a branch
//! head or a graph node shows with a lease of holder kind `export`, and returns
//! every layer the exported image holds, oldest first: the stack's base layers,
//! then the manifest's published and squashed layers. While the lease is live GC
//! keeps those layers (`Store::gc` treats every unreleased lease as a root), and
//! a squash never rewrites a manifest, so the directories stay as listed.
//! [`Store::release_export`] releases it; the startup sweep releases every export
//! lease left by a daemon that died mid-export (no export survives a restart).

use std::path::PathBuf;

use rusqlite::{params, OptionalExtension};

use crate::db::Cached;
use crate::error::StoreError;
use crate::leases::{new_lease, release_lease};
use crate::stacks::{branch_head, manifest_layers, stack_base_layers};
use crate::{HolderKind, LayerId, LayerKind, ManifestId, SessionId, Store};

/// What an export reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExportSource {
    /// The head of branch `branch` of stack `stack`.
    Branch { stack: String, branch: String },
    /// Graph node `id`'s manifest.
    Node(String),
}

/// One layer of an exported image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportLayer {
    pub id: LayerId,
    /// `Base`, `Published` or `Squashed`.
    pub kind: LayerKind,
    /// The layer's directory (overlay upper format).
    pub path: PathBuf,
    /// The session that published it (published layers).
    pub session: Option<SessionId>,
    pub created_ns: i64,
}

/// A pinned export: the lease and the image's layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportLease {
    /// The lease (holder kind `export`); release it with [`Store::release_export`].
    pub lease: i64,
    pub stack: String,
    /// The stack's containerd namespace (where its base image lives); `None`
    /// for an imported base (no image in containerd).
    pub namespace: Option<String>,
    /// The stack's base: the top layer chainID of its image (`sha256:<hex>`;
    /// OCI image-spec `config.md` "Layer ChainID").
    pub base_digest: String,
    /// The branch exported ("" for a node).
    pub branch: String,
    /// The node exported ("" for a branch).
    pub node: String,
    /// The manifest pinned.
    pub manifest: ManifestId,
    /// Every layer of the image, oldest first: base layers, then the manifest's.
    pub layers: Vec<ExportLayer>,
    /// How many of `layers` are base layers.
    pub base_layers: usize,
}

impl Store {
    /// Pins what `source` shows for an export named `holder` (free text, for
    /// `leases.holder`); see the module docs. Errors: `StackNotFound`,
    /// `BranchNotFound`, a node's not-found error, `Corrupt` for a layer row or
    /// directory that is not there.
    pub fn lease_export(
        &self,
        source: &ExportSource,
        holder: &str,
    ) -> Result<ExportLease, StoreError> {
        self.db.write(|tx| {
            let stack_row = |stack: &str| -> Result<(Option<String>, String), StoreError> {
                tx.one(
                    "SELECT namespace, base_digest FROM stacks WHERE id = ?1",
                    [stack],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .optional()?
                .ok_or_else(|| StoreError::StackNotFound(stack.to_string()))
            };
            let (stack, branch, node, manifest) = match source {
                ExportSource::Branch { stack, branch } => {
                    stack_row(stack)?;
                    let m = branch_head(tx, stack, branch)?.ok_or_else(|| {
                        StoreError::BranchNotFound {
                            stack: stack.clone(),
                            branch: branch.clone(),
                        }
                    })?;
                    (stack.clone(), branch.clone(), String::new(), m)
                }
                ExportSource::Node(id) => {
                    let (stack, m) = crate::graph::node_stack_manifest(tx, id)?;
                    (stack, String::new(), id.clone(), m)
                }
            };
            let (namespace, base_digest) = stack_row(&stack)?;
            let base = stack_base_layers(tx, &stack)?;
            let top = manifest_layers(tx, manifest)?;
            let mut stmt = tx.prepare_cached(
                "SELECT kind, path, session_id, created_ns, dropped FROM layers WHERE id = ?1",
            )?;
            let mut layers = Vec::with_capacity(base.len() + top.len());
            for id in base.iter().rev().chain(top.iter().rev()) {
                let (kind, path, session, created_ns, dropped): (
                    String,
                    String,
                    Option<SessionId>,
                    i64,
                    i64,
                ) = stmt
                    .query_row([id], |r| {
                        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
                    })
                    .optional()?
                    .ok_or_else(|| {
                        StoreError::corrupt("layers", id, "layer of a manifest or stack is missing")
                    })?;
                let kind = LayerKind::parse(&kind)
                    .ok_or_else(|| StoreError::corrupt("layers", id, format!("kind {kind:?}")))?;
                if dropped != 0 {
                    return Err(StoreError::corrupt(
                        "layers",
                        id,
                        "a reachable layer's directory was freed",
                    ));
                }
                layers.push(ExportLayer {
                    id: *id,
                    kind,
                    path: self.root.join(path),
                    session,
                    created_ns,
                });
            }
            let lease = new_lease(tx, manifest, HolderKind::Export, holder)?;
            Ok(ExportLease {
                lease,
                stack,
                namespace,
                base_digest,
                branch,
                node,
                manifest,
                layers,
                base_layers: base.len(),
            })
        })
    }

    /// Releases export lease `lease` (a no-op when released already).
    pub fn release_export(&self, lease: i64) -> Result<(), StoreError> {
        self.db.write(|tx| {
            tx.exec(
                "UPDATE leases SET released_ns = ?2 WHERE id = ?1 AND holder_kind = 'export' AND released_ns IS NULL",
                params![lease, crate::now_ns()],
            )?;
            Ok(())
        })
    }

    /// The export leases not released, as `(lease, holder)`.
    pub fn live_export_leases(&self) -> Result<Vec<(i64, String)>, StoreError> {
        self.db.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT id, holder FROM leases WHERE holder_kind = 'export' AND released_ns IS NULL ORDER BY id",
            )?;
            let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
            Ok(rows.collect::<Result<_, _>>()?)
        })
    }

    /// At start: releases every export lease (their exports died with the
    /// daemon that ran them). Returns how many.
    pub(crate) fn release_stale_exports(&self) -> Result<usize, StoreError> {
        let live = self.live_export_leases()?;
        self.db.write(|tx| {
            for (l, _) in &live {
                release_lease(tx, Some(*l))?;
            }
            Ok(live.len())
        })
    }
}
