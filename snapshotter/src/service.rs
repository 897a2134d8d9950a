//! containerd Snapshots API adapter: containerd's snapshot calls in, engine
//! verbs out (ARCHITECTURE.md §5; `engine/src/snapshots.rs`).
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
use layerstack_engine::store::{MountSpec, Owner, SessionInfo, SnapshotInfo, SnapshotKind};
use layerstack_engine::{Engine, EngineError};
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
    async fn apply_container_branch(&self, s: &SessionInfo) -> Result<(), Status> {
        let Some(address) = &self.containerd else {
            return Ok(());
        };
        let sid = s.id;
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
            .engine
            .snapshot_branch_label(sid)
            .await
            .map_err(|e| status(&e))?
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
        let (info, _, changed) = match self.engine.rebranch_locked(sid, branch.clone()).await {
            Ok(r) => r,
            // Mounted meanwhile (a runc init's transient copy): it stays.
            Err(EngineError::Mounted(..)) => return Ok(()),
            Err(e) => {
                let e = status(&e);
                return Err(Status::new(
                    e.code(),
                    format!(
                        "{}={branch} on container {namespace}/{id}: {}",
                        policy::BRANCH_LABEL,
                        e.message()
                    ),
                ));
            }
        };
        if changed {
            info!(session.id = sid, container = %format!("{namespace}/{id}"), branch = %info.branch, "session moved to the branch its container names ({})", policy::BRANCH_LABEL);
        }
        Ok(())
    }
}

fn status(e: &EngineError) -> Status {
    crate::wire::engine_status(e)
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
    crate::wire::mounts(&spec)
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
        let i = self
            .engine
            .snapshot_stat(key)
            .await
            .map_err(|e| status(&e))?;
        Ok(to_info(i))
    }

    async fn update(&self, info: Info, fieldpaths: Option<Vec<String>>) -> Result<Info, Status> {
        let key = info.name.clone();
        let labels = to_btree(info.labels);
        let paths = fieldpaths.unwrap_or_default();
        let i = self
            .engine
            .snapshot_update(key, labels, paths)
            .await
            .map_err(|e| status(&e))?;
        Ok(to_info(i))
    }

    async fn usage(&self, key: String) -> Result<Usage, Status> {
        let (size, inodes) = self
            .engine
            .snapshot_usage(key)
            .await
            .map_err(|e| status(&e))?;
        Ok(Usage { inodes, size })
    }

    async fn mounts(&self, key: String) -> Result<Vec<Mount>, Status> {
        debug!(snapshot.key = %key, "mounts");
        let _guard = match self
            .engine
            .snapshot_session_lock(key.clone())
            .await
            .map_err(|e| status(&e))?
        {
            Some((s, g)) => {
                self.apply_container_branch(&s).await?;
                Some(g)
            }
            None => None,
        };
        let spec = self
            .engine
            .snapshot_mounts(key)
            .await
            .map_err(|e| status(&e))?;
        Ok(to_mounts(spec))
    }

    async fn prepare(
        &self,
        key: String,
        parent: String,
        labels: HashMap<String, String>,
    ) -> Result<Vec<Mount>, Status> {
        debug!(snapshot.key = %key, parent = %parent, ?labels, "prepare");
        let spec = self
            .engine
            .snapshot_prepare(key, parent, to_btree(labels), false)
            .await
            .map_err(|e| status(&e))?;
        Ok(to_mounts(spec))
    }

    async fn view(
        &self,
        key: String,
        parent: String,
        labels: HashMap<String, String>,
    ) -> Result<Vec<Mount>, Status> {
        debug!(snapshot.key = %key, parent = %parent, "view");
        let spec = self
            .engine
            .snapshot_prepare(key, parent, to_btree(labels), true)
            .await
            .map_err(|e| status(&e))?;
        Ok(to_mounts(spec))
    }

    async fn commit(
        &self,
        name: String,
        key: String,
        labels: HashMap<String, String>,
    ) -> Result<(), Status> {
        debug!(snapshot.key = %key, name = %name, "commit");
        self.engine
            .snapshot_commit(name, key, to_btree(labels))
            .await
            .map_err(|e| status(&e))
    }

    async fn remove(&self, key: String) -> Result<(), Status> {
        debug!(snapshot.key = %key, "remove");
        self.engine
            .snapshot_remove(key)
            .await
            .map_err(|e| status(&e))
    }

    async fn clear(&self) -> Result<(), Status> {
        let report = self
            .engine
            .snapshot_cleanup()
            .await
            .map_err(|e| status(&e))?;
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
        let all = self.engine.snapshot_list().await.map_err(|e| status(&e))?;
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
