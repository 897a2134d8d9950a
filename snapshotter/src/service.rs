//! containerd Snapshots API adapter: maps containerd's snapshot calls onto the
//! LayerStack store (ARCHITECTURE.md §5).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use containerd_snapshots::api::types::Mount;
use containerd_snapshots::{Info, Kind, Snapshotter, Usage};
use layerstack_store::{split_key, MountSpec, SnapshotError, SnapshotInfo, SnapshotKind, Store};
use tonic::Status;
use tracing::{debug, warn};

use crate::publish::Publisher;

/// The proxy snapshotter served to containerd.
pub struct LayerStackSnapshotter {
    store: Arc<Store>,
    publisher: Arc<Publisher>,
}

impl LayerStackSnapshotter {
    pub fn new(store: Arc<Store>, publisher: Arc<Publisher>) -> Self {
        Self { store, publisher }
    }

    /// The live session whose container rootfs snapshot is `key`, if any.
    async fn session_of(&self, key: &str) -> Result<Option<layerstack_store::SessionInfo>, Status> {
        let Some((ns, name)) = split_key(key) else {
            return Ok(None);
        };
        let (ns, name, key) = (ns.to_string(), name.to_string(), key.to_string());
        let store = self.store.clone();
        let found = tokio::task::spawn_blocking(move || store.find_session(&ns, &name))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(|e| Status::internal(error_chain(&e)))?;
        Ok(found.filter(|s| s.key == key && !s.released))
    }

    async fn blocking<T, F>(&self, f: F) -> Result<T, Status>
    where
        T: Send + 'static,
        F: FnOnce(&Store) -> Result<T, SnapshotError> + Send + 'static,
    {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(|e| Status::internal(format!("store task failed: {e}")))?
            .map_err(to_status)
    }
}

/// errdefs mapping (containerd `errdefs/grpc.go`): containerd's unpacker relies on
/// AlreadyExists, GC on FailedPrecondition.
pub fn to_status(e: SnapshotError) -> Status {
    let msg = error_chain(&e);
    match e {
        SnapshotError::NotFound(_) => Status::not_found(msg),
        SnapshotError::AlreadyExists(_) => Status::already_exists(msg),
        SnapshotError::FailedPrecondition(_) => Status::failed_precondition(msg),
        SnapshotError::InvalidArgument(_) => Status::invalid_argument(msg),
        _ => Status::internal(msg),
    }
}

pub use layerstack_api::error_chain;

fn to_time(ns: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(ns.max(0) as u64)
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
    let options = spec.overlay_options();
    match spec {
        MountSpec::Bind { source, .. } => vec![Mount {
            r#type: "bind".into(),
            source: source.display().to_string(),
            target: String::new(),
            options,
        }],
        MountSpec::Overlay { .. } => vec![Mount {
            r#type: "overlay".into(),
            source: "overlay".into(),
            target: String::new(),
            options,
        }],
    }
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
        // A session's Mounts starts a new run (fresh upper, new lease after a
        // publish): it waits behind a publish of the previous run, so the new run
        // never mounts an upper that is being captured or renamed into a layer.
        let _guard = match self.session_of(&key).await? {
            Some(sess) => Some(self.publisher.lock_session(sess.id).await),
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
        // Remove comes from containerd's GC, possibly while the task-delete
        // publish of this session still runs (`ctr run --rm`): wait behind it, and
        // publish first if nothing did (a missed event must not lose writes).
        if let Some(sess) = self.session_of(&key).await? {
            let guard = self.publisher.lock_session(sess.id).await;
            if crate::publish::upper_is_mounted(&sess.upper) {
                // `ctr snapshots rm` on a running container: containerd only drops
                // its record; its GC retries the Remove after the task is gone.
                return Err(Status::failed_precondition(format!(
                    "snapshot {key} is mounted (session {}, upper {}): remove it after its task is deleted",
                    sess.id,
                    sess.upper.display()
                )));
            }
            if let Err(e) = self
                .publisher
                .finish_locked(&sess, None, None, "snapshot remove")
                .await
            {
                warn!(session.id = sess.id, error = %e, "publish before remove did not complete");
            }
            let r = self.blocking(move |s| s.remove(&key)).await;
            drop(guard);
            return r;
        }
        self.blocking(move |s| s.remove(&key)).await
    }

    async fn clear(&self) -> Result<(), Status> {
        let store = self.store.clone();
        let report = tokio::task::spawn_blocking(move || store.sweep())
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(|e| Status::internal(error_chain(&e)))?;
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
        // containerd re-checks filters itself on the one filtered call it makes
        // (remote-snapshot AlreadyExists path); GC passes none. Only the
        // `parent==` and `labels."k"==v` forms are honoured here.
        let all = self.blocking(|s| s.list()).await?;
        let items: Vec<Result<Info, Status>> = all
            .into_iter()
            .filter(|i| filters.iter().all(|f| filter_matches(f, i)))
            .map(|i| Ok(to_info(i)))
            .collect();
        Ok(futures::stream::iter(items))
    }
}

/// A subset of containerd's filter grammar (`filters/parser.go`): comma-separated
/// conjunctions of `field==value` over `name`, `parent`, `kind` and `labels."k"`.
/// Unknown forms match (containerd filters again on its side).
fn filter_matches(filter: &str, i: &SnapshotInfo) -> bool {
    filter.split(',').all(|clause| {
        let Some((field, value)) = clause.split_once("==") else {
            return true;
        };
        let value = value.trim().trim_matches('"');
        let field = field.trim();
        match field {
            "name" => i.key == value,
            "parent" => i.parent == value,
            "kind" => i.kind.as_str() == value,
            f => match f.strip_prefix("labels.") {
                Some(k) => i.labels.get(k.trim_matches('"')).map(String::as_str) == Some(value),
                None => true,
            },
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> SnapshotInfo {
        SnapshotInfo {
            key: "default/3/sha256:b".into(),
            kind: SnapshotKind::Committed,
            parent: "default/1/sha256:a".into(),
            labels: [(
                "containerd.io/snapshot.ref".to_string(),
                "sha256:b".to_string(),
            )]
            .into(),
            created_ns: 0,
            updated_ns: 0,
        }
    }

    #[test]
    fn remote_snapshot_walk_filter_matches_label_and_parent() {
        let f = r#"labels."containerd.io/snapshot.ref"==sha256:b,parent==default/1/sha256:a"#;
        assert!(filter_matches(f, &info()));
        let g = r#"labels."containerd.io/snapshot.ref"==sha256:c,parent==default/1/sha256:a"#;
        assert!(!filter_matches(g, &info()));
        assert!(!filter_matches("parent==x", &info()));
    }

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
