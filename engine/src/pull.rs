//! The local half of a pull (issue 23): a graph node another store pushed to
//! an OCI registry becomes a node of this store, with its id, its provenance
//! and its layers' digests. The registry transport (`layerstack-registry`)
//! fetches the manifest, the config and the blobs; this module is what
//! happens to them here. Blocking, like the export: the daemon runs it inside
//! `spawn_blocking`.
//!
//! | step | where | what |
//! |---|---|---|
//! | what is here | [`Engine::held_layers`] | for each layer's diff ID (the config's `rootfs.diff_ids` above the base), a published or squashed layer of the stack with that tar, recorded by an export, a push or an earlier pull: those blobs are never downloaded |
//! | stage | [`Engine::adopt_pulled_node`], no lock | each blob not held, oldest first, applied into `staging/pull-…` in overlay format (`publisher::apply_layer_tar`: whiteouts as 0:0 devices, opaque directories by xattr), its tar's sha256 checked against the diff ID; its path index captured over the layers below it and planned against no head (what a checkpoint records); its root directory given the metadata of the root below it (the capture's root edit, as a publish's upper gets), then sealed (synced in the durable profile) as a publish's layer is |
//! | commit | `Store::adopt_node` | one write transaction: the node with its id (nothing written when it is there already with the same layers and state), the staged layers renamed into `l/<n>`, the manifest, the group, the lease, edges to the parents this store holds (the others kept as its missing parents), edges from every node here that was waiting for this one as its parent |
//!
//! A failure before the commit drops every staged directory: nothing of the
//! pull is kept. A layer that is the same tar as one the store holds is not
//! unpacked again, so pulling a node whose layers are all here writes rows
//! only, and pulling it again writes nothing.

use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;

use layerstack_publisher::{self as publisher, LayerApplyOptions, LayerView};

use layerstack_store::{
    AdoptLayer, AdoptNode, Adopted, AdoptedLayers, BlobRef, LayerId, LayerSource, ManifestId, Store,
};
use tracing::info;

use crate::index::index_of;
use crate::{Engine, EngineError, Promoted, RunError};

/// Where a pulled layer's content is.
pub enum PulledContent {
    /// A layer of the stack this store holds ([`Engine::held_layers`]).
    Held(LayerId),
    /// The layer's blob as the registry serves it (gzip, zstd or a plain
    /// tar: told by its first bytes), e.g. a file the transport downloaded
    /// and checked against the descriptor's digest.
    Blob(Box<dyn Read + Send>),
}

/// One layer of a pulled node's image above the stack's base.
pub struct PulledLayer {
    /// `sha256:<hex>` of its tar: the config's `rootfs.diff_ids` entry.
    pub diff_id: String,
    /// The blobs it is in the registry (its manifest descriptor), recorded
    /// for the layer so a push names them without recompressing.
    pub blobs: Vec<BlobRef>,
    pub content: PulledContent,
    /// The layer in messages: `layer 2/5 (sha256:…) of registry/repo:tag`.
    pub origin: String,
}

impl Engine {
    /// For each of `diff_ids` (the layers above `stack`'s base, any order),
    /// the published or squashed layer of `stack` this store holds with that
    /// tar, if any: a pull need not download those blobs. Blocking.
    ///
    /// # Errors
    /// `Store(StackNotFound)`, `Store(…)`.
    pub fn held_layers(
        &self,
        stack: &str,
        diff_ids: &[String],
    ) -> Result<Vec<Option<LayerId>>, EngineError> {
        let base = base_layers(self.store(), stack)?;
        diff_ids
            .iter()
            .map(|d| {
                Ok(self
                    .store()
                    .layer_by_diff_id(d, Some(stack))?
                    .filter(|l| !base.contains(l)))
            })
            .collect()
    }

    /// Adopts `node`, pulled from a registry, on `stack` (which must be
    /// here: its base imported or unpacked) with `layers` — its image's
    /// layers above the base, oldest first — see the module docs. Blocking.
    ///
    /// # Errors
    /// `Store(StackNotFound)`; `Pull` for a blob that is no layer tar this
    /// store can hold (hostile or malformed entries, a truncated stream:
    /// `InvalidArgument`) or that cannot be staged; `InvalidArgument` when a
    /// blob's tar is not its diff ID; `Run` when its path index cannot be
    /// captured; `Store(AlreadyExists)` for a node of this id with other
    /// content, and what `Store::adopt_node` refuses. Nothing is kept. A
    /// layer [`Engine::held_layers`] found that GC collects before the commit
    /// (nothing pinned it) fails it too (`Store(LayerNotFound)`,
    /// `Store(FailedPrecondition)`): ask again and pull that blob.
    pub fn adopt_pulled_node(
        &self,
        stack: &str,
        layers: Vec<PulledLayer>,
        node: &AdoptNode,
    ) -> Result<Adopted, EngineError> {
        let started = std::time::Instant::now();
        let staged = self.stage_pulled(stack, layers)?;
        // Consumes the staged directories: renamed into l/, or removed.
        let out = self.store().adopt_node(stack, &staged.adopt, node)?;
        drop(staged.guards);
        info!(
            node = %out.node.id,
            stack,
            created = out.created,
            layers = out.layers.len(),
            unpacked = staged.unpacked,
            ms = started.elapsed().as_millis() as u64,
            "pulled node adopted"
        );
        Ok(out)
    }

    /// Adopts `layers` — a pulled branch head's image above `stack`'s base,
    /// oldest first — as a manifest of `stack` that the new hidden branch
    /// `work` (`.graph/pull/…`) points at, staged as
    /// [`Engine::adopt_pulled_node`] stages a node's; then
    /// [`Engine::land_on_branch`] moves a real branch to it. Blocking.
    ///
    /// # Errors
    /// As [`Engine::adopt_pulled_node`], and what `Store::adopt_layers`
    /// refuses. Nothing is kept.
    pub fn adopt_pulled_head(
        &self,
        stack: &str,
        layers: Vec<PulledLayer>,
        work: &str,
    ) -> Result<AdoptedLayers, EngineError> {
        let started = std::time::Instant::now();
        let staged = self.stage_pulled(stack, layers)?;
        let out = self.store().adopt_layers(stack, &staged.adopt, work)?;
        drop(staged.guards);
        info!(
            stack,
            manifest = out.manifest,
            layers = out.layers.len(),
            unpacked = staged.unpacked,
            ms = started.elapsed().as_millis() as u64,
            "pulled head adopted"
        );
        Ok(out)
    }

    /// Each of `layers` held or applied into a staging directory (no lock),
    /// in order; on failure every staged directory is removed.
    fn stage_pulled(&self, stack: &str, layers: Vec<PulledLayer>) -> Result<Staged, EngineError> {
        let store = self.store();
        let userxattr = self.settings().userxattr;
        // The view below the next layer, newest first.
        let mut below: Vec<PathBuf> = store.layer_paths(&base_layers(store, stack)?)?;
        let mut staged: Vec<PathBuf> = Vec::new();
        let mut guards = Vec::new();
        let drop_staged = |staged: &[PathBuf]| {
            for d in staged {
                let _ = layerstack_store::fs::remove_tree(d);
            }
        };
        let mut adopt = Vec::with_capacity(layers.len());
        for l in layers {
            let PulledLayer {
                diff_id,
                blobs,
                content,
                origin,
            } = l;
            let (source, tar_size, dir) = match content {
                PulledContent::Held(id) => {
                    let dir = store.layer_paths(&[id])?.remove(0);
                    (LayerSource::Existing(id), None, dir)
                }
                PulledContent::Blob(blob) => {
                    let (dir, guard) = store.staging_dir("pull").inspect_err(|_| {
                        drop_staged(&staged);
                    })?;
                    guards.push(guard);
                    staged.push(dir.clone());
                    let made = stage_layer(store, &dir, &below, blob, &origin, &diff_id, userxattr)
                        .inspect_err(|_| drop_staged(&staged))?;
                    (
                        LayerSource::Staged {
                            dir: dir.clone(),
                            index: made.0,
                        },
                        Some(made.1),
                        dir,
                    )
                }
            };
            below.insert(0, dir);
            adopt.push(AdoptLayer {
                source,
                diff_id,
                tar_size,
                blobs,
            });
        }
        if let Err(e) = layerstack_store::failpoints::fail("pull.staged", store.root()) {
            drop_staged(&staged);
            return Err(layerstack_store::StoreError::Io(store.staging_path(), e).into());
        }
        Ok(Staged {
            adopt,
            unpacked: staged.len(),
            guards,
        })
    }

    /// Points `branch` of `stack` at `manifest` (a pulled head's, a pulled
    /// node's root): created there when `stack` has no such branch;
    /// otherwise a promote ([`Engine::promote_manifest`]: up to date,
    /// fast-forward, or a merge through `branch`'s gate, refused whole on a
    /// conflict). `work`, the hidden branch that kept `manifest` alive, is
    /// dropped whatever happened.
    ///
    /// # Errors
    /// `InvalidArgument` (a branch name that is not one); what a promote
    /// returns.
    pub async fn land_on_branch(
        self: &Arc<Self>,
        stack: &str,
        manifest: ManifestId,
        branch: &str,
        work: Option<&str>,
        operation: &str,
    ) -> Result<Landed, EngineError> {
        let out = self.land_inner(stack, manifest, branch, operation).await;
        if let Some(w) = work {
            let (s, w) = (stack.to_string(), w.to_string());
            if let Err(e) = self.blocking(move |st| st.drop_branch(&s, &w)).await {
                // The startup recovery drops it.
                tracing::warn!(stack, error = %crate::error_chain(&e), "cannot drop a pull's working branch");
            }
        }
        out
    }

    async fn land_inner(
        self: &Arc<Self>,
        stack: &str,
        manifest: ManifestId,
        branch: &str,
        operation: &str,
    ) -> Result<Landed, EngineError> {
        layerstack_store::validate_branch(branch).map_err(|why| {
            EngineError::InvalidArgument(format!("cannot pull onto branch {branch:?}: {why}"))
        })?;
        let (s, b) = (stack.to_string(), branch.to_string());
        if self
            .blocking(move |st| st.create_branch_if_absent(&s, &b, manifest))
            .await?
        {
            info!(stack, branch, manifest, "branch created by a pull");
            return Ok(Landed::Created { head: manifest });
        }
        let p = self
            .promote_manifest(stack, manifest, branch, operation, None)
            .await?;
        Ok(Landed::Promoted(p))
    }
}

/// What [`Engine::land_on_branch`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Landed {
    /// The branch was not there: made at the manifest.
    Created { head: ManifestId },
    /// The branch was there: promoted onto (see [`Promoted`]).
    Promoted(Promoted),
}

/// What [`Engine::stage_pulled`] made.
struct Staged {
    adopt: Vec<AdoptLayer>,
    /// Layers applied from blobs.
    unpacked: usize,
    guards: Vec<layerstack_store::InFlightGuard>,
}

/// The base layers of `stack`, newest first.
/// (A stack has at least one base layer; none: no such stack here.)
fn base_layers(store: &Store, stack: &str) -> Result<Vec<LayerId>, EngineError> {
    let base = store.base_layers(stack)?;
    if base.is_empty() {
        return Err(layerstack_store::StoreError::StackNotFound(stack.into()).into());
    }
    Ok(base)
}

/// Applies `blob` into the empty staging directory `dir` over `below` (the
/// layers under it, newest first) and returns its path index and tar size.
fn stage_layer(
    store: &Store,
    dir: &std::path::Path,
    below: &[PathBuf],
    blob: Box<dyn Read + Send>,
    origin: &str,
    diff_id: &str,
    userxattr: bool,
) -> Result<(Vec<layerstack_store::IndexEntry>, u64), EngineError> {
    let applied = publisher::apply_layer_tar(
        dir,
        blob,
        origin,
        &LayerApplyOptions {
            userxattr,
            // Synced below, once its root is set.
            ..Default::default()
        },
    )
    .map_err(|e| EngineError::Pull {
        origin: origin.to_string(),
        source: Box::new(e),
    })?;
    if applied.diff_id != diff_id {
        return Err(EngineError::InvalidArgument(format!(
            "{origin}: its tar is {}, the image config's diff ID is {diff_id}: the blob is corrupt or of another image; nothing was pulled",
            applied.diff_id
        )));
    }
    // What a checkpoint of this layer over the same lowers records: the
    // capture, planned against no head change.
    let view = LayerView::new(below.to_vec()).with_userxattr(userxattr);
    let run = || -> Result<Vec<layerstack_store::IndexEntry>, RunError> {
        let cs = publisher::capture_with(
            dir,
            &view,
            &publisher::CaptureOptions {
                userxattr,
                ..Default::default()
            },
        )?;
        // The root as the root below it, as a publish resets its upper's
        // (the topmost layer's root is what a mount shows as `/`; a layer tar
        // holds none) — that edit only: the tree is the tar's.
        if let Some(root) = &cs.edits.root {
            let only_root = publisher::Changeset {
                edits: publisher::UpperEdits {
                    root: Some(root.clone()),
                    ..Default::default()
                },
                ..Default::default()
            };
            publisher::prepare_upper(dir, &only_root, userxattr)?;
        }
        crate::publish::seal(store, dir, userxattr)?;
        let files = publisher::FsFiles {
            lease: view.clone(),
            head: view.clone(),
            upper: dir.to_path_buf(),
            userxattr,
        };
        let plan = publisher::plan_gate(&cs, &[], &files, &Default::default())?;
        Ok(index_of(&plan))
    };
    let index = run().map_err(|e| EngineError::Run(Box::new(e)))?;
    Ok((index, applied.tar_bytes))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;
    use std::sync::Arc;

    use layerstack_publisher::ImportKind;
    use layerstack_store::{
        BlobCompression, ErrorKind, ExportSource, NodeInfo, Owner, Provenance, StoreOptions,
    };

    use super::*;
    use crate::test_support::{have_root, tmp_named};
    use crate::{Compression, EngineSettings, ImportRequest};

    /// An engine on a fresh store under `dir` whose stack is the base
    /// imported from `src` (the same stack id in every store).
    async fn engine_on(dir: &Path, src: &Path) -> (Arc<Engine>, String) {
        let store = Arc::new(Store::open(&dir.join("root"), &StoreOptions::default()).unwrap());
        let e = Engine::new(store, EngineSettings::default());
        let b = e
            .import_base(ImportRequest {
                path: src.to_path_buf(),
                kind: ImportKind::Dir,
                platform: None,
            })
            .await
            .unwrap();
        (e, b.stack)
    }

    /// A checkpointed child of `node`: `edit` writes its upper.
    async fn child(
        e: &Arc<Engine>,
        node: &str,
        name: &str,
        state: &str,
        edit: impl FnOnce(&Path),
    ) -> NodeInfo {
        let owner = Owner::Sandbox { name: name.into() };
        let (_, s, _, _) = e.attempt_start(node, owner, None, None).await.unwrap();
        std::fs::set_permissions(&s.upper, std::fs::Permissions::from_mode(0o755)).unwrap();
        edit(&s.upper);
        let prov = Provenance {
            command: Some(format!("edit {name}")),
            ..Default::default()
        };
        e.checkpoint(s.id, Some(state.into()), prov, None)
            .await
            .unwrap()
    }

    /// What a push of `node` sends: per layer above the base, its diff ID, its
    /// gzip blob and the blob's descriptor.
    fn push(e: &Engine, node: &str) -> Vec<(String, Vec<u8>, BlobRef)> {
        let x = e
            .begin_export(&ExportSource::Node(node.into()), "push")
            .unwrap();
        (x.lease().base_layers..x.lease().layers.len())
            .map(|i| {
                let mut blob = Vec::new();
                let b = x.write_layer(i, Compression::Gzip, &mut blob).unwrap();
                let d = BlobRef {
                    compression: BlobCompression::Gzip,
                    digest: b.digest,
                    size: b.size,
                };
                (b.diff_id, blob, d)
            })
            .collect()
    }

    fn pulled(pushed: &[(String, Vec<u8>, BlobRef)], held: &[Option<LayerId>]) -> Vec<PulledLayer> {
        pushed
            .iter()
            .zip(held)
            .enumerate()
            .map(|(i, ((diff, blob, d), h))| PulledLayer {
                diff_id: diff.clone(),
                blobs: vec![d.clone()],
                content: match h {
                    Some(l) => PulledContent::Held(*l),
                    None => PulledContent::Blob(Box::new(std::io::Cursor::new(blob.clone()))),
                },
                origin: format!("layer {}/{} ({}) of test", i + 1, pushed.len(), d.digest),
            })
            .collect()
    }

    fn staged_pulls(e: &Engine) -> usize {
        std::fs::read_dir(e.store().staging_path())
            .unwrap()
            .filter(|d| {
                d.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with("pull-")
            })
            .count()
    }

    /// A node checkpointed on one engine (a whiteout, an opaque directory,
    /// edits) and pushed as gzip blobs is pulled into another engine's store:
    /// same id, same diff IDs and blob digests when exported again, same path
    /// index, runnable; pulled again it copies nothing; its parent pulled
    /// after it reuses its layer; a blob that is not its diff ID is refused
    /// with nothing kept.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pushed_node_pulled_into_another_store_keeps_its_id_digests_and_index() {
        if !have_root("a_pushed_node_pulled_into_another_store_keeps_its_id_digests_and_index") {
            return;
        }
        let t = tmp_named("pull");
        let src = t.path().join("src");
        std::fs::create_dir_all(src.join("etc")).unwrap();
        std::fs::create_dir_all(src.join("d")).unwrap();
        std::fs::write(src.join("etc/motd"), b"base\n").unwrap();
        std::fs::write(src.join("etc/conf"), b"a = 1\n").unwrap();
        std::fs::write(src.join("d/old"), b"old\n").unwrap();
        std::fs::write(src.join("f"), b"gone soon\n").unwrap();
        std::fs::create_dir(t.path().join("a")).unwrap();
        std::fs::create_dir(t.path().join("b")).unwrap();
        let (a, stack) = engine_on(&t.path().join("a"), &src).await;
        let (b, stack_b) = engine_on(&t.path().join("b"), &src).await;
        assert_eq!(stack, stack_b);

        let (g, root) = a.graph_create("task", &stack, "main", None).await.unwrap();
        let c1 = child(&a, &root.id, "c1", r#"{"score": 0.5}"#, |u| {
            std::fs::create_dir(u.join("etc")).unwrap();
            std::fs::write(u.join("etc/conf"), b"a = 2\n").unwrap();
            std::fs::write(u.join("x.txt"), b"x\n").unwrap();
            // rm f; rm -rf d; mkdir d; echo > d/new — as overlayfs writes it.
            nix::sys::stat::mknod(
                &u.join("f"),
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::empty(),
                0,
            )
            .unwrap();
            std::fs::create_dir(u.join("d")).unwrap();
            xattr::set(u.join("d"), "trusted.overlay.opaque", b"y").unwrap();
            std::fs::write(u.join("d/new"), b"new\n").unwrap();
        })
        .await;
        let c2 = child(&a, &c1.id, "c2", r#"{"score": 0.9}"#, |u| {
            std::fs::write(u.join("y.txt"), b"y\n").unwrap();
        })
        .await;
        let pushed = push(&a, &c2.id);
        assert_eq!(pushed.len(), 2);
        let diffs: Vec<String> = pushed.iter().map(|p| p.0.clone()).collect();

        // Nothing is here yet: both blobs are applied.
        let held = b.held_layers(&stack, &diffs).unwrap();
        assert_eq!(held, vec![None, None]);
        let got = b
            .adopt_pulled_node(&stack, pulled(&pushed, &held), &AdoptNode::of(&c2, &g))
            .unwrap();
        assert!(got.created);
        assert_eq!(got.node.id, c2.id, "the node keeps its id");
        assert_eq!(got.new_layers.len(), 2);
        assert_eq!(got.missing_parents, vec![c1.id.clone()]);
        assert_eq!(
            (got.node.state.as_str(), &got.node.command),
            (c2.state.as_str(), &c2.command)
        );
        assert_eq!(staged_pulls(&b), 0);
        // The same layers: index rows, and the same blobs when exported again.
        let a_layers = {
            let x = a
                .begin_export(&ExportSource::Node(c2.id.clone()), "t")
                .unwrap();
            x.lease().layers[x.lease().base_layers..]
                .iter()
                .map(|l| l.id)
                .collect::<Vec<_>>()
        };
        for (la, lb) in a_layers.iter().zip(&got.layers) {
            assert_eq!(
                b.store().layer_index(*lb).unwrap(),
                a.store().layer_index(*la).unwrap(),
                "the path index of layer {la} (here {lb})"
            );
            // The root (no tar holds it) is as the origin's: what `/` shows.
            let root = |e: &Engine, l: LayerId| {
                use std::os::unix::fs::MetadataExt;
                let m = std::fs::metadata(e.store().layer_path(l)).unwrap();
                (m.mode(), m.uid(), m.gid())
            };
            assert_eq!(root(&b, *lb), root(&a, *la), "the root of layer {la}");
        }
        let again = push(&b, &c2.id);
        for (x, y) in pushed.iter().zip(&again) {
            assert_eq!((&x.0, &x.2), (&y.0, &y.2), "same diff ID and blob digest");
        }
        // It reads as it did where it was made, and runs.
        let view = |e: &Engine, n: &NodeInfo| {
            LayerView::new(e.store().manifest_view(&stack, n.manifest).unwrap())
        };
        let vb = view(&b, &got.node);
        assert_eq!(vb.read_regular(b"etc/conf").unwrap().unwrap(), b"a = 2\n");
        assert_eq!(vb.read_regular(b"etc/motd").unwrap().unwrap(), b"base\n");
        assert!(vb.lookup(b"f").unwrap().is_none(), "the whiteout hides f");
        assert!(vb.lookup(b"d/old").unwrap().is_none(), "d is opaque");
        assert_eq!(vb.read_regular(b"d/new").unwrap().unwrap(), b"new\n");
        assert_eq!(vb.read_regular(b"y.txt").unwrap().unwrap(), b"y\n");
        // Promoted onto a branch, its layers are that branch's history.
        match b.node_promote(&c2.id, "main", None).await.unwrap() {
            crate::Promoted::FastForward { .. } => {}
            other => panic!("{other:?}"),
        }
        let log = b.store().log(&stack, "main").unwrap();
        assert_eq!(
            log.iter().map(|e| e.layer).collect::<Vec<_>>(),
            got.layers.iter().rev().copied().collect::<Vec<_>>()
        );
        let c3 = child(&b, &c2.id, "c3", "{}", |u| {
            std::fs::write(u.join("z.txt"), b"z\n").unwrap();
        })
        .await;
        assert_eq!(c3.parents, vec![c2.id.clone()]);
        assert!(view(&b, &c3).lookup(b"x.txt").unwrap().is_some());

        // Pulled again: every layer is here; nothing is copied or written.
        let held = b.held_layers(&stack, &diffs).unwrap();
        assert_eq!(
            held,
            got.layers.iter().copied().map(Some).collect::<Vec<_>>()
        );
        let layers_dir = |e: &Engine| {
            std::fs::read_dir(e.store().root().join("l"))
                .unwrap()
                .count()
        };
        let before = layers_dir(&b);
        let again = b
            .adopt_pulled_node(&stack, pulled(&pushed, &held), &AdoptNode::of(&c2, &g))
            .unwrap();
        assert!(!again.created && again.new_layers.is_empty());
        // Even given the blobs again: they are applied, found equal, dropped.
        let again = b
            .adopt_pulled_node(
                &stack,
                pulled(&pushed, &[None, None]),
                &AdoptNode::of(&c2, &g),
            )
            .unwrap();
        assert!(!again.created);
        assert_eq!((layers_dir(&b), staged_pulls(&b)), (before, 0));
        // Its parent, pulled after it: its one layer is here, nothing copied.
        let p1 = push(&a, &c1.id);
        let held1 = b.held_layers(&stack, &[p1[0].0.clone()]).unwrap();
        assert_eq!(held1, vec![Some(got.layers[0])]);
        let parent = b
            .adopt_pulled_node(&stack, pulled(&p1, &held1), &AdoptNode::of(&c1, &g))
            .unwrap();
        assert!(parent.created && parent.new_layers.is_empty());
        assert_eq!(layers_dir(&b), before);

        // A blob that is not the layer its diff ID names: refused, nothing kept.
        let mut wrong = pulled(&pushed, &[None, None]);
        wrong[1].diff_id = diffs[0].clone();
        let mut other = AdoptNode::of(&c2, &g);
        other.id = "n00000000000000ff".into();
        let e = b.adopt_pulled_node(&stack, wrong, &other).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("diff ID"), "{e}");
        assert_eq!((layers_dir(&b), staged_pulls(&b)), (before, 0));
        assert!(b.store().node(&other.id).is_err());
        // A blob that is no tar: refused as the input's fault.
        let mut junk = pulled(&pushed, &[None, None]);
        junk[0].content = PulledContent::Blob(Box::new(std::io::Cursor::new(vec![7u8; 1000])));
        let e = b.adopt_pulled_node(&stack, junk, &other).unwrap_err();
        assert_eq!(
            e.kind(),
            ErrorKind::InvalidArgument,
            "{}",
            crate::error_chain(&e)
        );
        assert_eq!((layers_dir(&b), staged_pulls(&b)), (before, 0));
        let f = b.store().fsck(false).unwrap();
        assert!(f.problems.is_empty(), "{:?}", f.problems);
    }
}
