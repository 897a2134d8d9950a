//! The daemon's view of containerd: the task-delete event stream that triggers
//! publishing, start-up reconciliation, and image → stack resolution.
//!
//! containerd may come up after us (the daemon starts `Before=containerd.service`),
//! so everything here retries with backoff and never blocks snapshot serving.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use containerd_client::services::v1::containers_client::ContainersClient;
use containerd_client::services::v1::content_client::ContentClient;
use containerd_client::services::v1::GetContainerRequest;
use containerd_client::services::v1::{
    events_client::EventsClient, images_client::ImagesClient, tasks_client::TasksClient,
    GetImageRequest, GetRequest, PublishRequest, ReadContentRequest, SubscribeRequest,
};
use containerd_client::tonic::transport::Channel;
use containerd_client::tonic::{Code, Request};
use layerstack_api::policy;
use layerstack_engine::store::SessionState;
use layerstack_engine::{error_chain, Engine};
use prost::Message;
use sha2::{Digest, Sha256};
use tracing::{debug, info, warn};

const NS_HEADER: &str = "containerd-namespace";

pub(crate) fn with_ns<T>(ns: &str, msg: T) -> Request<T> {
    let mut r = Request::new(msg);
    if let Ok(v) = ns.parse() {
        r.metadata_mut().insert(NS_HEADER, v);
    }
    r
}

/// Errors talking to containerd.
#[derive(Debug, thiserror::Error)]
pub enum ContainerdError {
    #[error("cannot connect to containerd at {0}")]
    Connect(
        PathBuf,
        #[source] containerd_client::tonic::transport::Error,
    ),
    #[error("containerd {0}")]
    Rpc(String, #[source] containerd_client::tonic::Status),
    #[error("image {image:?} not found in containerd namespace {namespace:?}")]
    ImageNotFound { namespace: String, image: String },
    #[error("image {0}: {1}")]
    BadImage(String, String),
}

/// Whether this daemon has connected to containerd since it started
/// ([`reached`]).
static REACHED: AtomicBool = AtomicBool::new(false);

/// Connect to containerd's gRPC socket.
pub async fn connect(path: &std::path::Path) -> Result<Channel, ContainerdError> {
    let ch = containerd_client::connect(path)
        .await
        .map_err(|e| ContainerdError::Connect(path.to_path_buf(), e))?;
    REACHED.store(true, Ordering::Relaxed);
    Ok(ch)
}

/// Whether this daemon has reached a containerd since it started: a socket
/// missing after that is a containerd restarting (UNAVAILABLE), before it
/// a host with no containerd.
pub(crate) fn reached() -> bool {
    REACHED.load(Ordering::Relaxed)
}

/// Watch containerd's `/tasks/delete` events forever and publish the session of
/// each deleted init task; reconcile on every (re)connect so a missed event is
/// not a lost publish. The event path is asynchronous by nature.
pub async fn watch_events(address: PathBuf, engine: Arc<Engine>, subscribed_flag: Arc<AtomicBool>) {
    let mut backoff = Duration::from_millis(200);
    loop {
        match connect(&address).await {
            Ok(ch) => {
                backoff = Duration::from_millis(200);
                let mut events = EventsClient::new(ch.clone());
                let req = SubscribeRequest {
                    filters: vec![
                        r#"topic=="/tasks/delete""#.to_string(),
                        format!(r#"topic=="{SYNC_TOPIC}""#),
                    ],
                };
                let sub = events.subscribe(req);
                tokio::pin!(sub);
                // containerd sends a subscription's response headers only with its
                // first event, so the call does not return on an idle host. Publish
                // sync events until it does: the first one to arrive proves the
                // subscription is registered, and the reconcile below cannot miss
                // a task delete.
                let subscribed = loop {
                    tokio::select! {
                        r = &mut sub => break r,
                        _ = tokio::time::sleep(Duration::from_millis(100)) => {
                            if let Err(e) = publish_sync(&ch).await {
                                debug!(error = %e, "cannot publish a sync event yet");
                            }
                        }
                    }
                };
                match subscribed {
                    Ok(stream) => {
                        info!(address = %address.display(), "subscribed to containerd task events");
                        // Subscribe first, then reconcile: nothing falls in between.
                        reconcile(&ch, &engine).await;
                        subscribed_flag.store(true, Ordering::SeqCst);
                        let mut stream = stream.into_inner();
                        loop {
                            match stream.message().await {
                                Ok(Some(env)) => handle_envelope(env, &ch, &engine).await,
                                Ok(None) => {
                                    subscribed_flag.store(false, Ordering::SeqCst);
                                    warn!("containerd event stream ended; reconnecting");
                                    break;
                                }
                                Err(e) => {
                                    subscribed_flag.store(false, Ordering::SeqCst);
                                    warn!(error = %e, "containerd event stream failed; reconnecting");
                                    break;
                                }
                            }
                        }
                    }
                    Err(e) => warn!(error = %e, "cannot subscribe to containerd events"),
                }
            }
            Err(e) => debug!(error = %e, "containerd not reachable yet"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// Topic of the events the daemon publishes to itself to learn that its
/// subscription is live (see [`watch_events`]).
const SYNC_TOPIC: &str = "/layerstack/sync";

async fn publish_sync(ch: &Channel) -> Result<(), containerd_client::tonic::Status> {
    let event = containerd_client::to_any(&containerd_client::events::TaskDelete::default());
    EventsClient::new(ch.clone())
        .publish(with_ns(
            "layerstack",
            PublishRequest {
                topic: SYNC_TOPIC.to_string(),
                event: Some(event),
            },
        ))
        .await
        .map(|_| ())
}

async fn handle_envelope(
    env: containerd_client::types::Envelope,
    ch: &Channel,
    engine: &Arc<Engine>,
) {
    if env.topic != "/tasks/delete" {
        return;
    }
    let Some(any) = env.event else { return };
    let Ok(ev) = containerd_client::events::TaskDelete::decode(any.value.as_slice()) else {
        warn!(topic = %env.topic, "undecodable task event");
        return;
    };
    // Exec processes have their own id; only the init process's delete means the
    // rootfs was unmounted.
    if !ev.id.is_empty() && ev.id != ev.container_id {
        return;
    }
    let ns = env.namespace.clone();
    let engine = engine.clone();
    let ch = ch.clone();
    tokio::spawn(async move {
        let s = match engine.find(&ns, &ev.container_id).await {
            Ok(s) => s,
            Err(e) => {
                debug!(namespace = %ns, container = %ev.container_id, error = %e, "task deleted without a session");
                return;
            }
        };
        if s.outcome.is_some() || s.lease_manifest.is_none() {
            return;
        }
        // The container's own exit policy (`layerstack.publish` label), when
        // its record is still there; `ctr run --rm` may have deleted it already,
        // and then the default (on-exit) applies.
        // The session's recorded policy (from the runtime shim) wins; else the
        // container's label while its record exists (`ctr run --rm` may have
        // deleted it already); else on-exit.
        let label = label_policy(&ch, &ns, &ev.container_id, s.id).await;
        // The event can come while the rootfs still shows up in some mount
        // namespace for a moment (a sibling's `runc init` cloned the mount
        // table): `finish` waits that out (`SETTLE_AFTER_EXIT`) before it
        // refuses; the snapshot's Remove finishes the run otherwise.
        let r = engine
            .finish(s.id, label, Some(ev.exit_status), "task deleted")
            .await;
        if let Err(e) = r {
            warn!(session.id = s.id, error = %error_chain(&e), "publish on task delete failed");
        }
    });
}

/// The policy named by a container's `layerstack.publish` label, if its record
/// is readable: an invalid value is returned as such, and such a run is never
/// published (the engine ends it `failed`, upper kept).
async fn label_policy(
    ch: &Channel,
    ns: &str,
    id: &str,
    session: i64,
) -> Option<Result<policy::ExitPolicy, policy::UnknownExitPolicy>> {
    let labels = container_labels(ch, ns, id).await?;
    let p = policy::policy_from_labels(&labels);
    if let Err(e) = &p {
        warn!(session.id = session, error = %e, "invalid exit policy label: the run will not be published");
    }
    Some(p)
}

/// A container's labels through containerd's Containers API; `None` if its
/// record is gone or not readable.
async fn container_labels(
    ch: &Channel,
    ns: &str,
    id: &str,
) -> Option<std::collections::HashMap<String, String>> {
    match container_record(ch, ns, id).await {
        Ok(c) => c.map(|c| c.labels),
        Err(e) => {
            debug!(namespace = %ns, container = %id, error = %e, "container record not readable");
            None
        }
    }
}

/// Container `ns`/`id`'s record (containerd Containers API `Get`); `Ok(None)`
/// when it is gone.
async fn container_record(
    ch: &Channel,
    ns: &str,
    id: &str,
) -> Result<Option<containerd_client::services::v1::Container>, ContainerdError> {
    let mut c = ContainersClient::new(ch.clone());
    match c
        .get(with_ns(ns, GetContainerRequest { id: id.to_string() }))
        .await
    {
        Ok(r) => Ok(r.into_inner().container),
        Err(st) if st.code() == Code::NotFound => Ok(None),
        Err(st) => Err(ContainerdError::Rpc(format!("get container {ns}/{id}"), st)),
    }
}

/// The branch container `id`'s record names, read when its session's rootfs is
/// about to be mounted for the first time (the daemon's `Mounts`; ARCHITECTURE.md
/// §6 step 1): its label `layerstack.branch` (`ctr run --label`, `nerdctl run
/// --label`, CRI's `ContainerConfig.labels`), else the annotation of that name in
/// its OCI spec — where containerd's CRI copies the pod's and the container's
/// annotations that the runtime handler lists in `pod_annotations` /
/// `container_annotations` (containerd `pkg/cri/server/container_create_linux.go`,
/// `getPassthroughAnnotations`). A Kubernetes pod spec reaches CRI container
/// metadata only through its annotations: the kubelet sets container labels of its
/// own. `Ok(None)` when the record names no branch or is gone.
pub async fn container_branch(
    ch: &Channel,
    ns: &str,
    id: &str,
) -> Result<Option<String>, ContainerdError> {
    let Some(container) = container_record(ch, ns, id).await? else {
        return Ok(None);
    };
    if let Some(b) = policy::branch_from_labels(&container.labels) {
        return Ok(Some(b.to_string()));
    }
    let annotations = container
        .spec
        .as_ref()
        .and_then(|any| spec_annotations(&any.value))
        .unwrap_or_default();
    Ok(policy::branch_from_labels(&annotations).map(str::to_string))
}

/// `annotations` of an OCI runtime spec (the JSON containerd keeps in a
/// container's record); `None` if it does not parse.
fn spec_annotations(spec: &[u8]) -> Option<std::collections::HashMap<String, String>> {
    #[derive(serde::Deserialize)]
    struct Spec {
        #[serde(default)]
        annotations: std::collections::HashMap<String, String>,
    }
    serde_json::from_slice::<Spec>(spec)
        .ok()
        .map(|s| s.annotations)
}

/// Publish sessions whose task is gone but that were never published (the daemon
/// was down when their task was deleted). Sessions with an empty upper are left
/// alone: they may belong to a container being created right now.
async fn reconcile(ch: &Channel, engine: &Arc<Engine>) {
    let Ok(sessions) = engine.sessions().await else {
        warn!("reconcile: cannot list sessions");
        return;
    };
    let mut tasks = TasksClient::new(ch.clone());
    for s in sessions {
        let layerstack_engine::store::Owner::Container { namespace, id } = s.owner.clone() else {
            continue;
        };
        if s.released
            || s.state != SessionState::Active
            || s.outcome.is_some()
            || s.lease_manifest.is_none()
        {
            continue;
        }
        let empty = std::fs::read_dir(&s.upper)
            .map(|mut d| d.next().is_none())
            .unwrap_or(true);
        if empty || engine.upper_mounted(&s.upper).await.unwrap_or(true) {
            continue;
        }
        let req = with_ns(
            &namespace,
            GetRequest {
                container_id: id.clone(),
                exec_id: String::new(),
            },
        );
        match tasks.get(req).await {
            Err(st) if st.code() == Code::NotFound => {
                // The exit status died with the task: `on-success` cannot be
                // shown to hold, so it publishes nothing (as for a failed exit).
                let label = label_policy(ch, &namespace, &id, s.id).await;
                info!(session.id = s.id, container = %id, "reconcile: task gone");
                // Each in its own task: a large session must not hold up the
                // subscription (`layerstack wait` answers when it is done).
                let engine = engine.clone();
                let sid = s.id;
                tokio::spawn(async move {
                    if let Err(e) = engine
                        .finish(sid, label, None, "reconcile: task gone")
                        .await
                    {
                        warn!(session.id = sid, error = %error_chain(&e), "reconcile publish failed");
                    }
                });
            }
            Err(st) => warn!(session.id = s.id, error = %st, "reconcile: cannot query task"),
            Ok(_) => {}
        }
    }
}

pub(crate) async fn read_blob(
    content: &mut ContentClient<Channel>,
    ns: &str,
    digest: &str,
) -> Result<Vec<u8>, ContainerdError> {
    let req = with_ns(
        ns,
        ReadContentRequest {
            digest: digest.to_string(),
            offset: 0,
            size: 0,
        },
    );
    let mut stream = content
        .read(req)
        .await
        .map_err(|e| ContainerdError::Rpc(format!("read blob {digest}"), e))?
        .into_inner();
    let mut out = Vec::new();
    while let Some(chunk) = stream
        .message()
        .await
        .map_err(|e| ContainerdError::Rpc(format!("read blob {digest}"), e))?
    {
        out.extend_from_slice(&chunk.data);
    }
    Ok(out)
}

/// Resolve an image reference to its top layer chainID (the LayerStack stack id),
/// following an index to this platform's manifest (OCI image-spec `config.md`
/// "Layer ChainID").
pub async fn resolve_stack(
    address: &std::path::Path,
    namespace: &str,
    image: &str,
) -> Result<String, ContainerdError> {
    let ch = connect(address).await?;
    let mut images = ImagesClient::new(ch.clone());
    let img = match images
        .get(with_ns(
            namespace,
            GetImageRequest {
                name: image.to_string(),
            },
        ))
        .await
    {
        Ok(r) => r.into_inner().image,
        Err(st) if st.code() == Code::NotFound => None,
        Err(st) => return Err(ContainerdError::Rpc(format!("get image {image}"), st)),
    };
    let target = img
        .and_then(|i| i.target)
        .ok_or_else(|| ContainerdError::ImageNotFound {
            namespace: namespace.to_string(),
            image: image.to_string(),
        })?;
    image_chain(&ch, namespace, image, target.digest).await
}

/// Every image of `namespace` with its top layer chainID; images whose content
/// is incomplete are left out.
pub async fn list_image_chains(
    address: &std::path::Path,
    namespace: &str,
) -> Result<Vec<(String, String)>, ContainerdError> {
    let ch = connect(address).await?;
    let list = ImagesClient::new(ch.clone())
        .list(with_ns(
            namespace,
            containerd_client::services::v1::ListImagesRequest { filters: vec![] },
        ))
        .await
        .map_err(|e| ContainerdError::Rpc("list images".into(), e))?
        .into_inner()
        .images;
    let mut out = Vec::new();
    for img in list {
        let Some(t) = img.target else { continue };
        match image_chain(&ch, namespace, &img.name, t.digest).await {
            Ok(chain) => out.push((img.name, chain)),
            Err(e) => debug!(image = %img.name, error = %e, "image skipped"),
        }
    }
    Ok(out)
}

/// The top chainID of the image whose manifest (or index) is blob `digest`.
async fn image_chain(
    ch: &Channel,
    namespace: &str,
    image: &str,
    mut digest: String,
) -> Result<String, ContainerdError> {
    let mut content = ContentClient::new(ch.clone());
    let bad = |m: &str| ContainerdError::BadImage(image.to_string(), m.to_string());
    let mut doc: serde_json::Value;
    loop {
        let blob = read_blob(&mut content, namespace, &digest).await?;
        doc = serde_json::from_slice(&blob)
            .map_err(|e| bad(&format!("manifest {digest} is not JSON: {e}")))?;
        let Some(manifests) = doc.get("manifests").and_then(|m| m.as_array()) else {
            break;
        };
        let pick = manifests
            .iter()
            .find(|m| {
                let p = &m["platform"];
                p["os"] == "linux"
                    && p["architecture"] == std::env::consts::ARCH.replace("x86_64", "amd64")
            })
            .or_else(|| manifests.first())
            .ok_or_else(|| bad("index lists no manifests"))?;
        digest = pick["digest"]
            .as_str()
            .ok_or_else(|| bad("index entry without digest"))?
            .to_string();
    }
    let config = doc["config"]["digest"]
        .as_str()
        .ok_or_else(|| bad("manifest has no config digest"))?
        .to_string();
    let cfg: serde_json::Value =
        serde_json::from_slice(&read_blob(&mut content, namespace, &config).await?)
            .map_err(|e| bad(&format!("config is not JSON: {e}")))?;
    let diff_ids: Vec<String> = cfg["rootfs"]["diff_ids"]
        .as_array()
        .ok_or_else(|| bad("config has no rootfs.diff_ids"))?
        .iter()
        .filter_map(|d| d.as_str().map(str::to_string))
        .collect();
    chain_id(&diff_ids).ok_or_else(|| bad("image has no layers"))
}

/// ChainID(L0) = DiffID(L0); ChainID(Ln) = sha256(ChainID(Ln-1) + " " + DiffID(Ln)).
pub fn chain_id(diff_ids: &[String]) -> Option<String> {
    let mut it = diff_ids.iter();
    let mut chain = it.next()?.clone();
    for d in it {
        let h = Sha256::digest(format!("{chain} {d}").as_bytes());
        chain = format!(
            "sha256:{}",
            h.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
    }
    Some(chain)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_id_follows_the_image_spec() {
        // Two layers: sha256("sha256:a sha256:b").
        let a = "sha256:a".to_string();
        let b = "sha256:b".to_string();
        assert_eq!(chain_id(std::slice::from_ref(&a)), Some(a.clone()));
        let expect = format!("sha256:{:x}", Sha256::digest(b"sha256:a sha256:b"));
        assert_eq!(chain_id(&[a, b]), Some(expect));
        assert_eq!(chain_id(&[]), None);
    }

    #[test]
    fn spec_annotations_are_read_from_an_oci_spec() {
        // As containerd's CRI writes a container's spec: the pod annotation passed
        // through (`pod_annotations`) beside CRI's own.
        let spec = br#"{"ociVersion":"1.0.2-dev","process":{"args":["sh"]},
            "annotations":{"io.kubernetes.cri.container-type":"container",
            "layerstack.branch":" exp-7 "}}"#;
        let a = spec_annotations(spec).expect("a spec");
        assert_eq!(policy::branch_from_labels(&a), Some("exp-7"));
        // No annotations, or not a spec: nothing.
        let none = spec_annotations(br#"{"ociVersion":"1.0.2"}"#).expect("a spec");
        assert_eq!(policy::branch_from_labels(&none), None);
        assert!(spec_annotations(b"not json").is_none());
    }
}
