//! The benchmark environment: the integration harness's private containerd
//! (layerstack proxy plugin + the built-in `overlayfs` and `native`
//! snapshotters) and our daemon, plus gRPC clients for containerd's Snapshots,
//! Diff, Leases, Images and Content APIs and for our admin API.
//!
//! Snapshots made here are prepared through containerd (so the proxy sees what
//! a runtime would cause) under a containerd lease per experiment; mounting is
//! done by this process ([`crate::fsutil::mount_all`]), as a runtime would.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{anyhow, bail, ensure, Context, Result};
use containerd_client::services::v1::snapshots::snapshots_client::SnapshotsClient;
use containerd_client::services::v1::snapshots::{
    MountsRequest, PrepareSnapshotRequest, RemoveSnapshotRequest, ViewSnapshotRequest,
};
use containerd_client::services::v1::{
    content_client::ContentClient, diff_client::DiffClient, images_client::ImagesClient,
    leases_client::LeasesClient, CreateRequest as LeaseCreate, DeleteContentRequest,
    DeleteRequest as LeaseDelete, DiffRequest, GetImageRequest, ReadContentRequest,
};
use containerd_client::tonic::transport::Channel as CtdChannel;
use containerd_client::tonic::Request;
use containerd_client::types::{Descriptor, Mount};
use layerstack_integration::{self as harness, TestEnv};
use sha2::{Digest, Sha256};

use crate::profile::Profiler;

/// Snapshotter names as containerd knows them.
pub const LAYERSTACK: &str = harness::SNAPSHOTTER;
pub const OVERLAYFS: &str = "overlayfs";
pub const NATIVE: &str = "native";
/// Runtimes.
pub const RUNC_V2: &str = "io.containerd.runc.v2";
pub const SHIM: &str = harness::SHIM_RUNTIME;
/// Uncompressed layer tar: the cheapest diff containerd's differ can write.
pub const LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";

/// The images the scenarios use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Image {
    /// `make_debian_image.sh`: bookworm minbase, one layer.
    Debian,
    /// `make_source_image.sh`: busybox + a source tree (small in quick mode).
    Source,
    /// `make_busybox_image.sh`: busybox-static and its applets, one small layer.
    Busybox,
}

/// An imported image: its name, the top layer's chainID (the parent of every
/// container snapshot) and, for [`Image::Source`], where its tree is.
#[derive(Debug, Clone)]
pub struct ImageRef {
    pub name: String,
    pub chain_id: String,
    /// Path of the source tree inside the image (`src/linux`, `src/small`).
    pub tree: PathBuf,
    /// A text file inside the image that many sessions may edit (for merges).
    pub shared_text: PathBuf,
}

/// One benchmark run's environment (see the module docs).
pub struct Bench {
    pub env: TestEnv,
    pub rt: tokio::runtime::Runtime,
    pub quick: bool,
    pub profiler: Profiler,
    ctd: CtdChannel,
    admin: layerstack_api::AdminClient<tonic::transport::Channel>,
    mounts: PathBuf,
}

fn insert_header<T>(req: &mut Request<T>, key: &'static str, value: &str) -> Result<()> {
    req.metadata_mut().insert(
        key,
        value
            .parse()
            .map_err(|e| anyhow!("header {key}={value}: {e:?}"))?,
    );
    Ok(())
}

/// A containerd request in namespace `ns`, under lease `lease`.
pub fn ctd_req<T>(ns: &str, lease: Option<&str>, msg: T) -> Result<Request<T>> {
    let mut r = Request::new(msg);
    insert_header(&mut r, "containerd-namespace", ns)?;
    if let Some(l) = lease {
        insert_header(&mut r, "containerd-lease", l)?;
    }
    Ok(r)
}

/// chainID of a list of diffIDs (OCI image spec, config.md "Layer ChainID").
pub fn chain_id(diff_ids: &[String]) -> Option<String> {
    let mut it = diff_ids.iter();
    let mut chain = it.next()?.clone();
    for d in it {
        let h = Sha256::digest(format!("{chain} {d}").as_bytes());
        chain = format!("sha256:{h:x}");
    }
    Some(chain)
}

impl Bench {
    /// Starts the daemon and a private containerd (the harness's [`TestEnv`]),
    /// connects the clients. `bin_dir` holds our built binaries.
    pub fn start(quick: bool, profiler: Profiler) -> Result<Bench> {
        let env = TestEnv::new().context("starting containerd and the layerstack daemon")?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("bench-worker")
            .enable_all()
            .build()?;
        let ctd_sock = env.containerd().socket().to_path_buf();
        let admin_sock = env.admin_socket();
        let (ctd, admin) = rt.block_on(async {
            let ctd = containerd_client::connect(&ctd_sock)
                .await
                .with_context(|| format!("connecting to containerd at {}", ctd_sock.display()))?;
            let admin = layerstack_api::connect(&admin_sock)
                .await
                .with_context(|| format!("connecting to {}", admin_sock.display()))?;
            anyhow::Ok((ctd, admin))
        })?;
        let mounts = env.scratch().join("mnt");
        std::fs::create_dir_all(&mounts)?;
        Ok(Bench {
            env,
            rt,
            quick,
            profiler,
            ctd,
            admin,
            mounts,
        })
    }

    /// Runs `f`, under `perf` when `profile` names the step (see
    /// [`Profiler::record`]): scenarios profile only the timed part of a step.
    pub fn maybe_profiled<T>(
        &self,
        profile: Option<&str>,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<(T, Option<crate::profile::ProfileSummary>)> {
        match profile {
            Some(step) => self.profiler.record(step, f),
            None => Ok((f()?, None)),
        }
    }

    /// A directory for mount points `<scratch>/mnt/<name>`.
    pub fn mount_point(&self, name: &str) -> PathBuf {
        self.mounts.join(name)
    }

    /// containerd's root directory (snapshotter dirs, content, metadata).
    pub fn containerd_root(&self) -> PathBuf {
        self.env.containerd().dir().join("root")
    }

    /// The directories whose allocated bytes a snapshotter adds: its own root
    /// (our store; containerd's `io.containerd.snapshotter.v1.<name>`) and
    /// containerd's metadata database.
    pub fn snapshotter_dirs(&self, snapshotter: &str) -> Vec<PathBuf> {
        let root = self.containerd_root();
        let own = match snapshotter {
            LAYERSTACK => self.env.store_root(),
            s => root.join(format!("io.containerd.snapshotter.v1.{s}")),
        };
        vec![own, root.join("io.containerd.metadata.v1.bolt")]
    }

    /// Imports `image` into `ns` for each of `snapshotters` (once per process)
    /// and resolves its chainID.
    pub fn image(&self, ns: &str, image: Image, snapshotters: &[&str]) -> Result<ImageRef> {
        let (tar, name, tree, shared) = match image {
            Image::Debian => (
                harness::debian_image_tar()?,
                harness::DEBIAN_IMAGE,
                PathBuf::from("etc"),
                PathBuf::from("etc/services"),
            ),
            Image::Source if self.quick => (
                harness::source_image_tar(true)?,
                harness::SMALL_SOURCE_IMAGE,
                PathBuf::from("src/small"),
                PathBuf::from("src/small/shared.txt"),
            ),
            Image::Source => (
                harness::source_image_tar(false)?,
                harness::SOURCE_IMAGE,
                PathBuf::from("src/linux"),
                PathBuf::from("src/linux/Makefile"),
            ),
            Image::Busybox => (
                harness::busybox_image_tar()?,
                harness::BUSYBOX_IMAGE,
                PathBuf::from("etc"),
                PathBuf::from("etc/passwd"),
            ),
        };
        for s in snapshotters {
            let names = self.env.import_image(ns, &tar, s)?;
            ensure!(
                names.iter().any(|n| n == name),
                "{name} not among {names:?}"
            );
        }
        Ok(ImageRef {
            name: name.to_string(),
            chain_id: self.chain_id_of(ns, name)?,
            tree,
            shared_text: shared,
        })
    }

    async fn read_content(&self, ns: &str, digest: &str) -> Result<Vec<u8>> {
        let mut c = ContentClient::new(self.ctd.clone());
        let mut stream = c
            .read(ctd_req(
                ns,
                None,
                ReadContentRequest {
                    digest: digest.to_string(),
                    offset: 0,
                    size: 0,
                },
            )?)
            .await
            .with_context(|| format!("reading content {digest}"))?
            .into_inner();
        let mut data = Vec::new();
        while let Some(chunk) = stream.message().await? {
            data.extend_from_slice(&chunk.data);
        }
        Ok(data)
    }

    /// The chainID of `image`'s top layer: image → manifest (first of an
    /// index) → config → `rootfs.diff_ids`.
    pub fn chain_id_of(&self, ns: &str, image: &str) -> Result<String> {
        self.rt.block_on(async {
            let img = ImagesClient::new(self.ctd.clone())
                .get(ctd_req(
                    ns,
                    None,
                    GetImageRequest {
                        name: image.to_string(),
                    },
                )?)
                .await
                .with_context(|| format!("image {image}"))?
                .into_inner()
                .image
                .context("no image")?;
            let mut desc = img.target.context("image without target")?;
            for _ in 0..3 {
                let data = self.read_content(ns, &desc.digest).await?;
                let v: serde_json::Value = serde_json::from_slice(&data)?;
                if let Some(m) = v["manifests"].as_array().and_then(|m| m.first()) {
                    desc.digest = m["digest"].as_str().context("index entry digest")?.into();
                    continue;
                }
                if let Some(cfg) = v["config"]["digest"].as_str() {
                    let cfg = self.read_content(ns, cfg).await?;
                    let c: serde_json::Value = serde_json::from_slice(&cfg)?;
                    let ids: Vec<String> = c["rootfs"]["diff_ids"]
                        .as_array()
                        .context("config without rootfs.diff_ids")?
                        .iter()
                        .filter_map(|d| d.as_str().map(String::from))
                        .collect();
                    return chain_id(&ids).context("image without layers");
                }
                bail!("{} is neither an index nor a manifest", desc.digest);
            }
            bail!("image {image}: index nesting too deep")
        })
    }

    // -- leases -----------------------------------------------------------

    /// Creates containerd lease `id` in `ns` (snapshots made under it stay
    /// until [`Bench::delete_lease`]).
    pub fn create_lease(&self, ns: &str, id: &str) -> Result<()> {
        self.rt.block_on(async {
            LeasesClient::new(self.ctd.clone())
                .create(ctd_req(
                    ns,
                    None,
                    LeaseCreate {
                        id: id.to_string(),
                        labels: HashMap::new(),
                    },
                )?)
                .await
                .with_context(|| format!("creating lease {id}"))?;
            Ok(())
        })
    }

    /// Deletes lease `id` and waits for containerd's garbage collection
    /// (`sync`), which removes what only the lease held, backends included.
    pub fn delete_lease(&self, ns: &str, id: &str) -> Result<()> {
        self.rt.block_on(async {
            LeasesClient::new(self.ctd.clone())
                .delete(ctd_req(
                    ns,
                    None,
                    LeaseDelete {
                        id: id.to_string(),
                        sync: true,
                    },
                )?)
                .await
                .with_context(|| format!("deleting lease {id}"))?;
            Ok(())
        })
    }

    // -- snapshots --------------------------------------------------------

    /// `Prepare(key, parent)` with `labels`; returns the mounts.
    pub async fn prepare_async(
        ctd: CtdChannel,
        ns: &str,
        lease: &str,
        snapshotter: &str,
        key: &str,
        parent: &str,
        labels: &[(String, String)],
    ) -> Result<Vec<Mount>> {
        let r = SnapshotsClient::new(ctd)
            .prepare(ctd_req(
                ns,
                Some(lease),
                PrepareSnapshotRequest {
                    snapshotter: snapshotter.to_string(),
                    key: key.to_string(),
                    parent: parent.to_string(),
                    labels: labels.iter().cloned().collect(),
                },
            )?)
            .await
            .with_context(|| format!("{snapshotter}: prepare {key}"))?;
        Ok(r.into_inner().mounts)
    }

    /// A clone of the containerd channel (for concurrent work).
    pub fn ctd(&self) -> CtdChannel {
        self.ctd.clone()
    }

    /// A clone of the admin client.
    pub fn admin(&self) -> layerstack_api::AdminClient<tonic::transport::Channel> {
        self.admin.clone()
    }

    /// [`Bench::prepare_async`], blocking.
    pub fn prepare(
        &self,
        ns: &str,
        lease: &str,
        snapshotter: &str,
        key: &str,
        parent: &str,
        labels: &[(String, String)],
    ) -> Result<Vec<Mount>> {
        self.rt.block_on(Self::prepare_async(
            self.ctd(),
            ns,
            lease,
            snapshotter,
            key,
            parent,
            labels,
        ))
    }

    /// `View(key, parent)`: read-only mounts of `parent`.
    pub fn view(
        &self,
        ns: &str,
        lease: &str,
        snapshotter: &str,
        key: &str,
        parent: &str,
    ) -> Result<Vec<Mount>> {
        self.rt.block_on(async {
            let r = SnapshotsClient::new(self.ctd())
                .view(ctd_req(
                    ns,
                    Some(lease),
                    ViewSnapshotRequest {
                        snapshotter: snapshotter.to_string(),
                        key: key.to_string(),
                        parent: parent.to_string(),
                        labels: HashMap::new(),
                    },
                )?)
                .await
                .with_context(|| format!("{snapshotter}: view {key}"))?;
            Ok(r.into_inner().mounts)
        })
    }

    /// `Mounts(key)`.
    pub fn mounts(&self, ns: &str, snapshotter: &str, key: &str) -> Result<Vec<Mount>> {
        self.rt.block_on(async {
            let r = SnapshotsClient::new(self.ctd())
                .mounts(ctd_req(
                    ns,
                    None,
                    MountsRequest {
                        snapshotter: snapshotter.to_string(),
                        key: key.to_string(),
                    },
                )?)
                .await
                .with_context(|| format!("{snapshotter}: mounts {key}"))?;
            Ok(r.into_inner().mounts)
        })
    }

    /// `Remove(key)` (containerd drops its record; the backend removal follows
    /// with the next garbage collection).
    pub fn remove(&self, ns: &str, snapshotter: &str, key: &str) -> Result<()> {
        self.rt.block_on(async {
            SnapshotsClient::new(self.ctd())
                .remove(ctd_req(
                    ns,
                    None,
                    RemoveSnapshotRequest {
                        snapshotter: snapshotter.to_string(),
                        key: key.to_string(),
                    },
                )?)
                .await
                .with_context(|| format!("{snapshotter}: remove {key}"))?;
            Ok(())
        })
    }

    // -- the diff service -------------------------------------------------

    /// containerd's Diff service: a layer (uncompressed tar) of the changes
    /// from `left` to `right`, written to the content store under `lease`.
    pub fn diff(
        &self,
        ns: &str,
        lease: &str,
        left: Vec<Mount>,
        right: Vec<Mount>,
        r#ref: &str,
    ) -> Result<Descriptor> {
        self.rt.block_on(async {
            let r = DiffClient::new(self.ctd())
                .diff(ctd_req(
                    ns,
                    Some(lease),
                    DiffRequest {
                        left,
                        right,
                        media_type: LAYER_TAR.to_string(),
                        r#ref: r#ref.to_string(),
                        labels: HashMap::new(),
                        source_date_epoch: None,
                    },
                )?)
                .await
                .context("containerd diff")?;
            r.into_inner().diff.context("diff without descriptor")
        })
    }

    /// Deletes a content blob (NotFound is fine: the lease's GC may have won).
    pub fn delete_content(&self, ns: &str, digest: &str) -> Result<()> {
        self.rt.block_on(async {
            match ContentClient::new(self.ctd())
                .delete(ctd_req(
                    ns,
                    None,
                    DeleteContentRequest {
                        digest: digest.to_string(),
                    },
                )?)
                .await
            {
                Ok(_) => Ok(()),
                Err(s) if s.code() == containerd_client::tonic::Code::NotFound => Ok(()),
                Err(s) => Err(anyhow!("deleting content {digest}: {s}")),
            }
        })
    }

    // -- our admin API ----------------------------------------------------

    /// `Publish(ns, key)` through the admin API: the session of snapshot `key`.
    pub async fn publish_async(
        mut admin: layerstack_api::AdminClient<tonic::transport::Channel>,
        ns: &str,
        key: &str,
    ) -> Result<layerstack_api::Session> {
        let r = admin
            .publish(layerstack_api::PublishRequest {
                namespace: ns.to_string(),
                container: key.to_string(),
                action: layerstack_api::EndAction::Publish as i32,
                reason: "benchmark".into(),
                has_exit_status: false,
                exit_status: 0,
                ..Default::default()
            })
            .await
            .with_context(|| format!("publish {ns}/{key}"))?;
        Ok(r.into_inner())
    }

    /// [`Bench::publish_async`], blocking.
    pub fn publish(&self, ns: &str, key: &str) -> Result<layerstack_api::Session> {
        self.rt.block_on(Self::publish_async(self.admin(), ns, key))
    }
}

/// The snapshot label that puts a layerstack session on `branch`.
pub fn branch_label(branch: &str) -> Vec<(String, String)> {
    vec![(
        harness::SNAPSHOT_BRANCH_LABEL.to_string(),
        branch.to_string(),
    )]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_ids_follow_the_image_spec() {
        // One layer: the diffID itself.
        assert_eq!(chain_id(&["sha256:a".into()]).unwrap(), "sha256:a");
        // Two: sha256("sha256:a sha256:b").
        let want = format!("sha256:{:x}", Sha256::digest(b"sha256:a sha256:b"));
        assert_eq!(
            chain_id(&["sha256:a".into(), "sha256:b".into()]).unwrap(),
            want
        );
        assert!(chain_id(&[]).is_none());
    }
}
