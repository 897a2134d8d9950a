//! containerd Snapshots API adapter: containerd's snapshot calls in, store and
//! engine calls out (ARCHITECTURE.md §5).
//!
//! `Prepare`, `Remove` and `Cleanup` never wait behind a publish: containerd's
//! GC holds its metadata lock across a proxy `Remove` (upstream
//! containerd#13798 wedged whole nodes that way). A `Remove` of a session only
//! marks it released; the engine ends its run and removes its directories after
//! any publish in flight. `Mounts` of a session (a restart) does wait behind a
//! publish of the previous run, so a new run never mounts an upper that is being
//! captured or renamed.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use containerd_client::tonic::transport::Channel;
use containerd_snapshots::api::types::Mount;
use containerd_snapshots::{Info, Kind, Snapshotter, Usage};
use layerstack_api::policy;
use layerstack_engine::store::{
    snapshots::Removed, MountSpec, Owner, SnapshotInfo, SnapshotKind, Store, StoreError, SweepMode,
};
use layerstack_engine::Engine;
use tonic::Status;
use tracing::{debug, info, warn};

use crate::filters::Filters;

/// How long `Mounts` waits for containerd's container record (the branch it names)
/// before mounting the session where it is.
const CONTAINER_BRANCH_TIMEOUT: Duration = Duration::from_secs(5);

/// The proxy snapshotter served to containerd.
pub struct LayerStackSnapshotter {
    engine: Arc<Engine>,
    /// containerd's socket, where `Mounts` reads a container's branch; `None`: never.
    containerd: Option<PathBuf>,
    channel: tokio::sync::Mutex<Option<Channel>>,
}

impl LayerStackSnapshotter {
    /// `containerd`: containerd's socket, for the container label or OCI annotation
    /// `layerstack.branch` of a session about to be mounted the first time
    /// ([`crate::containerd::container_branch`]).
    pub fn new(engine: Arc<Engine>, containerd: Option<PathBuf>) -> Self {
        Self {
            engine,
            containerd,
            channel: tokio::sync::Mutex::new(None),
        }
    }

    /// Moves session `sid` to the branch its container's record names, if the run
    /// was never mounted, leases a head, and no snapshot label pins its branch —
    /// the runtime shim's `SetBranch` done by the daemon, so that a container label
    /// or (through CRI) a pod annotation chooses the branch without the shim too.
    /// containerd unreachable or slow: logged, the session stays where it is.
    async fn apply_container_branch(&self, sid: i64) -> Result<(), Status> {
        let Some(address) = &self.containerd else {
            return Ok(());
        };
        let s = self.blocking(move |st| st.session(sid)).await?;
        let Owner::Container { namespace, id } = &s.owner else {
            return Ok(());
        };
        if s.outcome.is_some() || s.lease_manifest.is_none() || s.released {
            return Ok(());
        }
        let empty = std::fs::read_dir(&s.upper)
            .map(|mut d| d.next().is_none())
            .unwrap_or(false);
        if !empty {
            return Ok(());
        }
        if self
            .blocking(move |st| st.snapshot_branch_label(sid))
            .await?
            .is_some()
        {
            return Ok(());
        }
        let looked_up = tokio::time::timeout(CONTAINER_BRANCH_TIMEOUT, async {
            // The lock only hands out the (cloneable) channel: lookups of many
            // sessions run side by side.
            let ch = {
                let mut cached = self.channel.lock().await;
                match cached.as_ref() {
                    Some(ch) => ch.clone(),
                    None => {
                        let ch = crate::containerd::connect(address).await?;
                        *cached = Some(ch.clone());
                        ch
                    }
                }
            };
            crate::containerd::container_branch(&ch, namespace, id).await
        })
        .await;
        let branch = match looked_up {
            Ok(Ok(Some(b))) => b,
            Ok(Ok(None)) => return Ok(()),
            Ok(Err(e)) => {
                warn!(session.id = sid, error = %layerstack_engine::error_chain(&e), "cannot read the container's branch label or annotation; mounting the session on its branch");
                *self.channel.lock().await = None;
                return Ok(());
            }
            Err(_) => {
                warn!(session.id = sid, "containerd did not answer for the container's branch label or annotation in {CONTAINER_BRANCH_TIMEOUT:?}; mounting the session on its branch");
                return Ok(());
            }
        };
        if branch == s.branch {
            return Ok(());
        }
        if self
            .engine
            .upper_mounted(&s.upper)
            .await
            .map_err(|e| layerstack_api::engine_status(&e))?
        {
            return Ok(());
        }
        let b = branch.clone();
        let (info, _, changed) = self
            .blocking(move |st| st.rebranch_session(sid, &b, false))
            .await
            .map_err(|e| {
                Status::new(
                    e.code(),
                    format!(
                        "{}={branch} on container {namespace}/{id}: {}",
                        policy::BRANCH_LABEL,
                        e.message()
                    ),
                )
            })?;
        if changed {
            info!(session.id = sid, container = %format!("{namespace}/{id}"), branch = %info.branch, "session moved to the branch its container names ({})", policy::BRANCH_LABEL);
        }
        Ok(())
    }

    async fn blocking<T, F>(&self, f: F) -> Result<T, Status>
    where
        T: Send + 'static,
        F: FnOnce(&Store) -> Result<T, StoreError> + Send + 'static,
    {
        let store = self.engine.store().clone();
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(|e| Status::internal(format!("store task failed: {e}")))?
            .map_err(|e| layerstack_api::store_status(&e))
    }
}

fn to_time(ns: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(u64::try_from(ns).unwrap_or(0))
}

fn to_info(i: SnapshotInfo) -> Info {
    Info {
        kind: match i.kind {
            SnapshotKind::View => Kind::View,
            SnapshotKind::Active => Kind::Active,
            SnapshotKind::Committed => Kind::Committed,
        },
        name: i.key,
        parent: i.parent,
        labels: i.labels.into_iter().collect(),
        created_at: to_time(i.created_ns),
        updated_at: to_time(i.updated_ns),
    }
}

fn to_mounts(spec: MountSpec) -> Vec<Mount> {
    layerstack_api::mounts(&spec)
        .into_iter()
        .map(|m| Mount {
            r#type: m.r#type,
            source: m.source,
            target: String::new(),
            options: m.options,
        })
        .collect()
}

fn to_btree(labels: HashMap<String, String>) -> BTreeMap<String, String> {
    labels.into_iter().collect()
}

#[tonic::async_trait]
impl Snapshotter for LayerStackSnapshotter {
    type Error = Status;
    type InfoStream = futures::stream::Iter<std::vec::IntoIter<Result<Info, Status>>>;

    async fn stat(&self, key: String) -> Result<Info, Status> {
        self.blocking(move |s| s.stat(&key)).await.map(to_info)
    }

    async fn update(&self, info: Info, fieldpaths: Option<Vec<String>>) -> Result<Info, Status> {
        let key = info.name.clone();
        let labels = to_btree(info.labels);
        let paths = fieldpaths.unwrap_or_default();
        self.blocking(move |s| s.update_labels(&key, labels, &paths))
            .await
            .map(to_info)
    }

    async fn usage(&self, key: String) -> Result<Usage, Status> {
        let (size, inodes) = self.blocking(move |s| s.usage(&key)).await?;
        Ok(Usage { inodes, size })
    }

    async fn mounts(&self, key: String) -> Result<Vec<Mount>, Status> {
        debug!(snapshot.key = %key, "mounts");
        let k = key.clone();
        let _guard = match self.blocking(move |s| s.snapshot_session(&k)).await? {
            Some(sid) => {
                let g = self.engine.lock_session(sid).await;
                self.apply_container_branch(sid).await?;
                Some(g)
            }
            None => None,
        };
        self.blocking(move |s| s.mounts(&key)).await.map(to_mounts)
    }

    async fn prepare(
        &self,
        key: String,
        parent: String,
        labels: HashMap<String, String>,
    ) -> Result<Vec<Mount>, Status> {
        debug!(snapshot.key = %key, parent = %parent, ?labels, "prepare");
        let labels = to_btree(labels);
        let (_, spec) = self
            .blocking(move |s| s.prepare(&key, &parent, labels, false))
            .await?;
        Ok(to_mounts(spec))
    }

    async fn view(
        &self,
        key: String,
        parent: String,
        labels: HashMap<String, String>,
    ) -> Result<Vec<Mount>, Status> {
        debug!(snapshot.key = %key, parent = %parent, "view");
        let labels = to_btree(labels);
        let (_, spec) = self
            .blocking(move |s| s.prepare(&key, &parent, labels, true))
            .await?;
        Ok(to_mounts(spec))
    }

    async fn commit(
        &self,
        name: String,
        key: String,
        labels: HashMap<String, String>,
    ) -> Result<(), Status> {
        debug!(snapshot.key = %key, name = %name, "commit");
        let labels = to_btree(labels);
        self.blocking(move |s| s.commit(&name, &key, labels)).await
    }

    async fn remove(&self, key: String) -> Result<(), Status> {
        debug!(snapshot.key = %key, "remove");
        let k = key.clone();
        if let Some(sid) = self.blocking(move |s| s.snapshot_session(&k)).await? {
            // `ctr snapshots rm` of a running container: containerd only drops its
            // record; its GC retries the Remove after the task is gone.
            let upper = self.engine.store().upper_path(sid);
            let mounted = self
                .engine
                .upper_mounted(&upper)
                .await
                .map_err(|e| layerstack_api::engine_status(&e))?;
            if mounted {
                return Err(Status::failed_precondition(format!(
                    "snapshot {key} is mounted (session {sid}, upper {}): remove it after its task is deleted",
                    upper.display()
                )));
            }
        }
        match self.blocking(move |s| s.remove(&key)).await? {
            Removed::Session(sid) => self.engine.session_released(sid),
            Removed::Plain => {}
        }
        Ok(())
    }

    async fn clear(&self) -> Result<(), Status> {
        let report = self.blocking(|s| s.sweep_with(SweepMode::Cleanup)).await?;
        for p in report.removed {
            debug!(path = %p.display(), "cleanup removed directory without a row");
        }
        Ok(())
    }

    async fn list(
        &self,
        _snapshotter: String,
        filters: Vec<String>,
    ) -> Result<Self::InfoStream, Status> {
        let filters =
            Filters::parse(&filters).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let all = self.blocking(|s| s.list()).await?;
        let items: Vec<Result<Info, Status>> = all
            .into_iter()
            .filter(|i| filters.matches(i))
            .map(|i| Ok(to_info(i)))
            .collect();
        Ok(futures::stream::iter(items))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_mount_carries_fixed_options() {
        let m = to_mounts(MountSpec::Overlay {
            lowers: vec!["/r/l/2".into(), "/r/l/1".into()],
            upper: Some(("/r/s/1/upper".into(), "/r/s/1/work".into())),
        });
        assert_eq!(m[0].r#type, "overlay");
        assert_eq!(
            m[0].options,
            vec![
                "index=off",
                "redirect_dir=off",
                "metacopy=off",
                "workdir=/r/s/1/work",
                "upperdir=/r/s/1/upper",
                "lowerdir=/r/l/2:/r/l/1"
            ]
        );
    }
}
