//! The two services the proxy talks to besides the inner shim: containerd's
//! Containers API (the container's labels) and the LayerStack daemon's admin API
//! (`Publish`, `SetBranch`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use containerd_client::services::v1::containers_client::ContainersClient;
use containerd_client::services::v1::GetContainerRequest;
use layerstack_api as api;

/// containerd's namespace header (`namespaces/grpc.go`).
const NS_HEADER: &str = "containerd-namespace";

/// Failures talking to containerd or the daemon.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("cannot connect to containerd at {0}")]
    ContainerdConnect(
        PathBuf,
        #[source] containerd_client::tonic::transport::Error,
    ),
    #[error("containerd: get container {0}")]
    Containerd(String, #[source] containerd_client::tonic::Status),
    #[error("cannot connect to the layerstack daemon's admin socket {0}")]
    AdminConnect(PathBuf, #[source] tonic::transport::Error),
    #[error("layerstack daemon: {0}")]
    Admin(&'static str, #[source] tonic::Status),
    #[error("{0} did not answer within {1:?}")]
    Timeout(String, Duration),
}

/// The labels of container `id` in `namespace`; `Ok(None)` if containerd has no
/// such container (e.g. `--rm` deleted it already).
pub async fn container_labels(
    containerd: &Path,
    namespace: &str,
    id: &str,
    timeout: Duration,
) -> Result<Option<HashMap<String, String>>, DaemonError> {
    let fut = async {
        let ch = containerd_client::connect(containerd)
            .await
            .map_err(|e| DaemonError::ContainerdConnect(containerd.to_path_buf(), e))?;
        let mut req =
            containerd_client::tonic::Request::new(GetContainerRequest { id: id.to_string() });
        if let Ok(v) = namespace.parse() {
            req.metadata_mut().insert(NS_HEADER, v);
        }
        match ContainersClient::new(ch).get(req).await {
            Ok(r) => Ok(r.into_inner().container.map(|c| c.labels)),
            Err(st) if st.code() == containerd_client::tonic::Code::NotFound => Ok(None),
            Err(st) => Err(DaemonError::Containerd(id.to_string(), st)),
        }
    };
    tokio::time::timeout(timeout, fut).await.map_err(|_| {
        DaemonError::Timeout(format!("containerd at {}", containerd.display()), timeout)
    })?
}

async fn admin(
    path: &Path,
    timeout: Duration,
) -> Result<api::AdminClient<tonic::transport::Channel>, DaemonError> {
    tokio::time::timeout(timeout, api::connect(path))
        .await
        .map_err(|_| DaemonError::Timeout(format!("admin socket {}", path.display()), timeout))?
        .map_err(|e| DaemonError::AdminConnect(path.to_path_buf(), e))
}

/// `Publish` (or discard) the container's session and wait for its outcome.
/// `Ok(None)`: the daemon has no session for the container (not on the
/// layerstack snapshotter).
pub async fn publish(
    admin_path: &Path,
    namespace: &str,
    id: &str,
    action: api::EndAction,
    exit_status: Option<u32>,
    reason: &str,
    timeout: Duration,
) -> Result<Option<api::Session>, DaemonError> {
    let fut = async {
        let mut c = admin(admin_path, timeout).await?;
        let req = api::PublishRequest {
            namespace: namespace.to_string(),
            container: id.to_string(),
            action: action as i32,
            reason: reason.to_string(),
            has_exit_status: exit_status.is_some(),
            exit_status: exit_status.unwrap_or_default(),
            ..Default::default()
        };
        match c.publish(req).await {
            Ok(r) => Ok(Some(r.into_inner())),
            Err(st) if st.code() == tonic::Code::NotFound => Ok(None),
            Err(st) => Err(DaemonError::Admin("publish", st)),
        }
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| DaemonError::Timeout("layerstack publish".into(), timeout))?
}

/// `SetPolicy`: record the container's exit policy (label `layerstack.publish`)
/// on its session, so the daemon's own fallbacks apply it too.
/// `Ok(None)`: the daemon has no session for the container.
pub async fn set_policy(
    admin_path: &Path,
    namespace: &str,
    id: &str,
    policy: &str,
    timeout: Duration,
) -> Result<Option<api::Session>, DaemonError> {
    let fut = async {
        let mut c = admin(admin_path, timeout).await?;
        let req = api::SetPolicyRequest {
            namespace: namespace.to_string(),
            container: id.to_string(),
            policy: policy.to_string(),
        };
        match c.set_policy(req).await {
            Ok(r) => Ok(Some(r.into_inner())),
            Err(st) if st.code() == tonic::Code::NotFound => Ok(None),
            Err(st) => Err(DaemonError::Admin("set policy", st)),
        }
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| DaemonError::Timeout("layerstack set-policy".into(), timeout))?
}

/// `SetBranch`: re-point the container's not-yet-mounted session to `branch`.
/// `Ok(None)`: the daemon has no session for the container.
pub async fn set_branch(
    admin_path: &Path,
    namespace: &str,
    id: &str,
    branch: &str,
    timeout: Duration,
) -> Result<Option<api::SetBranchResponse>, DaemonError> {
    let fut = async {
        let mut c = admin(admin_path, timeout).await?;
        let req = api::SetBranchRequest {
            namespace: namespace.to_string(),
            container: id.to_string(),
            branch: branch.to_string(),
        };
        match c.set_branch(req).await {
            Ok(r) => Ok(Some(r.into_inner())),
            Err(st) if st.code() == tonic::Code::NotFound => Ok(None),
            Err(st) => Err(DaemonError::Admin("set branch", st)),
        }
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| DaemonError::Timeout("layerstack set-branch".into(), timeout))?
}

/// `SetNode`: make the container's not-yet-mounted session an attempt of graph
/// node `node` (its lease moves to the node's root). `Ok(None)`: the daemon has
/// no session for the container.
pub async fn set_node(
    admin_path: &Path,
    namespace: &str,
    id: &str,
    node: &str,
    timeout: Duration,
) -> Result<Option<api::SetBranchResponse>, DaemonError> {
    let fut = async {
        let mut c = admin(admin_path, timeout).await?;
        let req = api::SetNodeRequest {
            namespace: namespace.to_string(),
            container: id.to_string(),
            node: node.to_string(),
            key: String::new(),
        };
        match c.set_node(req).await {
            Ok(r) => Ok(Some(r.into_inner())),
            Err(st) if st.code() == tonic::Code::NotFound => Ok(None),
            Err(st) => Err(DaemonError::Admin("set node", st)),
        }
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| DaemonError::Timeout("layerstack set-node".into(), timeout))?
}

/// Whether the admin socket accepts a connection (a unix `connect`, no RPC: a
/// few µs on the create path). Errors name the address and how to configure it.
pub fn probe_admin(admin_path: &Path) -> Result<(), String> {
    std::os::unix::net::UnixStream::connect(admin_path)
        .map(drop)
        .map_err(|e| {
            format!(
                "cannot reach the layerstack daemon's admin socket {}: {e}. The container's writes could not be published when it stops, so it is not started. Start the daemon (containerd-layerstack-grpc; `systemctl start layerstack`), or point the runtime at its admin socket: `admin_address` in the runtime's config file (runtime options ConfigPath, `layerstack config shim`) or {} in containerd's environment",
                admin_path.display(),
                crate::config::ADMIN_ENV
            )
        })
}

/// One line for the log: "outcome (state) layer N: message".
pub fn describe_session(s: &api::Session) -> String {
    let mut out = format!(
        "session {} branch {:?}: outcome {:?}, state {}",
        s.id, s.branch, s.outcome, s.state
    );
    if s.layer != 0 {
        out.push_str(&format!(", layer {}", s.layer));
    }
    if !s.conflicts.is_empty() {
        let paths: Vec<&str> = s.conflicts.iter().map(|c| c.path.as_str()).collect();
        out.push_str(&format!(", conflicts {paths:?}"));
    }
    if !s.message.is_empty() {
        out.push_str(&format!(": {}", s.message));
    }
    out
}
