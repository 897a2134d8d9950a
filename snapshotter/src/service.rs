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
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use containerd_snapshots::api::types::Mount;
use containerd_snapshots::{Info, Kind, Snapshotter, Usage};
use layerstack_engine::store::{
    snapshots::Removed, MountSpec, SnapshotInfo, SnapshotKind, Store, StoreError, SweepMode,
};
use layerstack_engine::Engine;
use tonic::Status;
use tracing::debug;

use crate::filters::Filters;

/// The proxy snapshotter served to containerd.
pub struct LayerStackSnapshotter {
    engine: Arc<Engine>,
}

impl LayerStackSnapshotter {
    pub fn new(engine: Arc<Engine>) -> Self {
        Self { engine }
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
            Some(sid) => Some(self.engine.lock_session(sid).await),
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
