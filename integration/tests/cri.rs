//! Kubernetes through containerd's CRI plugin (issue 13, ARCHITECTURE.md §11).
//!
//! No kubelet runs here: the tests speak the CRI API (`runtime.v1`
//! RuntimeService and ImageService, the `k8s-cri` crate) to a private containerd
//! 1.6 started from `layerstack config containerd --version 1.6` — CRI's
//! `snapshotter = "layerstack"`, the runtime handlers `layerstack` (the runtime
//! shim, what a RuntimeClass `handler: layerstack` selects) and `runc` — plus
//! `sandbox_image` = the locally built pause-like image (no registry is
//! reachable). Pods use the host network namespace, so no CNI plugin is needed.
//!
//! Each scenario, once per runtime handler: a pod whose container writes a file on
//! a branch chosen through CRI → the container exits → StopContainer →
//! RemoveContainer → its session is published on that branch → a container of the
//! next pod, on the same branch, reads the file back (ExecSync), and one on
//! another branch does not see it.
//!
//! How the branch travels (the daemon reads it at the rootfs's first `Mounts`,
//! from containerd's record of the container; the runtime shim applies a
//! container label again at task create):
//! - a pod annotation `layerstack.branch` — what a Kubernetes pod spec can set
//!   (the kubelet sets container labels of its own): CRI copies it into each
//!   container's OCI spec because the generated runtime tables list it in
//!   `pod_annotations` (and `container_annotations`);
//! - the container label `layerstack.branch` (`ContainerConfig.labels`, which CRI
//!   copies into the containerd container's labels);
//! - the container annotation `containerd.io/snapshot/layerstack.branch`, which
//!   containerd 1.6's CRI turns into a label of the rootfs snapshot.
//!
//! Without root or containerd the tests skip (or fail under `CI=true`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use containerd_client::tonic::transport::Channel;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, ContainerState, ContainerStatusRequest,
    CreateContainerRequest, ExecSyncRequest, ImageSpec, ImageStatusRequest, LinuxPodSandboxConfig,
    LinuxSandboxSecurityContext, NamespaceMode, NamespaceOption, PodSandboxConfig,
    PodSandboxMetadata, RemoveContainerRequest, RemovePodSandboxRequest, RunPodSandboxRequest,
    StartContainerRequest, StatusRequest, StopContainerRequest, StopPodSandboxRequest,
};
use layerstack_integration::{
    bin_path, busybox_image_tar, ensure_success, import_checked, labels, ls_wait, ls_wait_ok,
    pause_image_tar, require_root_and_containerd, run_with_timeout, session, set_containerd_config,
    stdout, unique, with_shared_env, EnvLayout, TestEnv, BUSYBOX_IMAGE, CLI_BIN, PAUSE_IMAGE,
    SHIM_BIN, SNAPSHOTTER, SNAPSHOT_BRANCH_LABEL,
};

/// The containerd namespace CRI works in.
const NS: &str = "k8s.io";
/// CRI runtime handler of the runtime shim (RuntimeClass `handler: layerstack`).
const SHIM_HANDLER: &str = "layerstack";
/// CRI's default runtime handler (no shim: the daemon publishes on task delete).
const RUNC_HANDLER: &str = "runc";
/// One CRI call at most.
const RPC_TIMEOUT: Duration = Duration::from_secs(120);

/// runc's state root for CRI's containers, private to the env's containerd (the
/// default, `/run/containerd/runc/k8s.io`, is a system containerd's).
fn runc_root(l: &EnvLayout<'_>) -> PathBuf {
    l.dir.join("c").join("runc-cri")
}

/// The containerd configuration: `layerstack config containerd --version 1.6`
/// for this env's sockets (its CRI tables and the shim settings file it names),
/// plus what a node without a registry needs — `sandbox_image` — runc's state
/// root kept private, and `restrict_oom_score_adj`.
fn cri_config(l: &EnvLayout<'_>) -> Result<toml::Table> {
    let cli = bin_path(CLI_BIN)?;
    let shim_config = l.dir.join("shim.toml");
    let out = run_with_timeout(
        Command::new(&cli)
            .args(["config", "shim", "--admin-address"])
            .arg(l.admin_socket),
        Duration::from_secs(30),
    )?;
    let mut shim = stdout(&ensure_success("layerstack config shim", out)?);
    shim.push_str(&format!(
        "runc_root = {}\n",
        toml::Value::from(runc_root(l).to_string_lossy().into_owned())
    ));
    std::fs::write(&shim_config, shim)?;
    let out = run_with_timeout(
        Command::new(&cli)
            .args(["config", "containerd", "--version", "1.6", "--address"])
            .arg(l.snapshot_socket)
            .arg("--root")
            .arg(l.store_root)
            .arg("--admin-address")
            .arg(l.admin_socket)
            .arg("--shim-config")
            .arg(&shim_config),
        Duration::from_secs(30),
    )?;
    let generated = stdout(&ensure_success("layerstack config containerd", out)?);
    let mut config: toml::Table = generated.parse().context("generated TOML")?;
    let cri = config
        .get_mut("plugins")
        .and_then(|p| p.get_mut("io.containerd.grpc.v1.cri"))
        .and_then(toml::Value::as_table_mut)
        .context("the generated document has no CRI table")?;
    cri.insert("sandbox_image".into(), PAUSE_IMAGE.into());
    // CRI gives a sandbox oom_score_adj -998; lowering a score needs
    // CAP_SYS_RESOURCE, which a test host in a container may not have (runc
    // then fails with "can't get final child's PID from pipe: EOF"). This makes
    // CRI clamp scores to containerd's own.
    cri.insert("restrict_oom_score_adj".into(), true.into());
    let runc = cri
        .get_mut("containerd")
        .and_then(|c| c.get_mut("runtimes"))
        .and_then(|r| r.get_mut(RUNC_HANDLER))
        .and_then(toml::Value::as_table_mut)
        .context("the generated document has no runc runtime")?;
    let mut options = toml::Table::new();
    options.insert(
        "Root".into(),
        runc_root(l).to_string_lossy().into_owned().into(),
    );
    runc.insert("options".into(), options.into());
    Ok(config)
}

// ---------------------------------------------------------------------------
// The CRI client
// ---------------------------------------------------------------------------

/// A blocking CRI client on containerd's socket.
struct Cri {
    rt: tokio::runtime::Runtime,
    runtime: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
}

impl Cri {
    fn connect(socket: &Path) -> Result<Cri> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let ch = rt
            .block_on(containerd_client::connect(socket))
            .with_context(|| format!("connecting to {}", socket.display()))?;
        Ok(Cri {
            rt,
            runtime: RuntimeServiceClient::new(ch.clone()),
            images: ImageServiceClient::new(ch),
        })
    }

    /// Runs one call with [`RPC_TIMEOUT`]; `what` names it in errors.
    fn call<T, F>(&self, what: &str, f: F) -> Result<T>
    where
        F: std::future::Future<
            Output = Result<tonic_response::Response<T>, tonic_response::Status>,
        >,
    {
        match self
            .rt
            .block_on(async { tokio::time::timeout(RPC_TIMEOUT, f).await })
        {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(st)) => bail!("CRI {what}: {:?}: {}", st.code(), st.message()),
            Err(_) => bail!("CRI {what}: no answer in {RPC_TIMEOUT:?}"),
        }
    }

    /// Waits until CRI reports the runtime ready (the network is not: no CNI,
    /// and host-network pods do not need it).
    fn wait_runtime_ready(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut c = self.runtime.clone();
            let st = self.call("Status", c.status(StatusRequest { verbose: false }))?;
            let ready = st
                .status
                .as_ref()
                .map(|s| {
                    s.conditions
                        .iter()
                        .any(|c| c.r#type == "RuntimeReady" && c.status)
                })
                .unwrap_or(false);
            if ready {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("CRI runtime not ready after 60s: {st:?}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits until CRI's image service knows `image` (CRI learns of an image
    /// imported with `ctr` from containerd's image events).
    fn wait_image(&self, image: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut c = self.images.clone();
            let st = self.call(
                "ImageStatus",
                c.image_status(ImageStatusRequest {
                    image: Some(image_spec(image)),
                    verbose: false,
                }),
            )?;
            if st.image.is_some() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("CRI does not list {image} 60s after the import");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// `tonic` as `k8s-cri` and `containerd-client` use it (0.14).
mod tonic_response {
    pub use containerd_client::tonic::{Response, Status};
}

fn image_spec(image: &str) -> ImageSpec {
    ImageSpec {
        image: image.to_string(),
        ..Default::default()
    }
}

/// A pod in the host network namespace (no CNI), each container in its own pid
/// namespace, as the kubelet's defaults.
fn pod_config(
    name: &str,
    log_dir: &Path,
    annotations: HashMap<String, String>,
) -> PodSandboxConfig {
    PodSandboxConfig {
        annotations,
        metadata: Some(PodSandboxMetadata {
            name: name.to_string(),
            uid: format!("uid-{name}"),
            namespace: "default".to_string(),
            attempt: 0,
        }),
        log_directory: log_dir.to_string_lossy().into_owned(),
        linux: Some(LinuxPodSandboxConfig {
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: Some(NamespaceOption {
                    network: NamespaceMode::Node as i32,
                    pid: NamespaceMode::Container as i32,
                    ipc: NamespaceMode::Pod as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A running pod and its containers, removed on drop (best effort).
struct Pod<'a> {
    cri: &'a Cri,
    id: String,
    config: PodSandboxConfig,
    log_dir: PathBuf,
}

impl<'a> Pod<'a> {
    fn run(
        cri: &'a Cri,
        env: &TestEnv,
        name: &str,
        handler: &str,
        annotations: HashMap<String, String>,
    ) -> Result<Pod<'a>> {
        let log_dir = env.scratch().join("pods").join(name);
        std::fs::create_dir_all(&log_dir)?;
        let config = pod_config(name, &log_dir, annotations);
        let mut c = cri.runtime.clone();
        let r = cri.call(
            "RunPodSandbox",
            c.run_pod_sandbox(RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: handler.to_string(),
            }),
        )?;
        Ok(Pod {
            cri,
            id: r.pod_sandbox_id,
            config,
            log_dir,
        })
    }

    /// Creates and starts a busybox container running `sh -c script`.
    fn start_container(&self, name: &str, script: &str, meta: Meta) -> Result<String> {
        let config = ContainerConfig {
            metadata: Some(ContainerMetadata {
                name: name.to_string(),
                attempt: 0,
            }),
            image: Some(image_spec(BUSYBOX_IMAGE)),
            command: vec!["/bin/sh".into(), "-c".into(), script.to_string()],
            labels: meta.labels,
            annotations: meta.annotations,
            log_path: format!("{name}.log"),
            ..Default::default()
        };
        let mut c = self.cri.runtime.clone();
        let id = self
            .cri
            .call(
                "CreateContainer",
                c.create_container(CreateContainerRequest {
                    pod_sandbox_id: self.id.clone(),
                    config: Some(config),
                    sandbox_config: Some(self.config.clone()),
                }),
            )?
            .container_id;
        let mut c = self.cri.runtime.clone();
        self.cri.call(
            "StartContainer",
            c.start_container(StartContainerRequest {
                container_id: id.clone(),
            }),
        )?;
        Ok(id)
    }

    /// Polls ContainerStatus until container `id` (named `name`) is `want`;
    /// returns its exit code.
    fn wait_state(&self, id: &str, name: &str, want: ContainerState) -> Result<i32> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut c = self.cri.runtime.clone();
            let st = self
                .cri
                .call(
                    "ContainerStatus",
                    c.container_status(ContainerStatusRequest {
                        container_id: id.to_string(),
                        verbose: false,
                    }),
                )?
                .status
                .context("ContainerStatus without a status")?;
            if st.state == want as i32 {
                return Ok(st.exit_code);
            }
            if Instant::now() >= deadline {
                bail!(
                    "container {id} not {want:?} after 60s: {st:?}; its log:\n{}",
                    self.container_log(name)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The CRI log of the container named `name` (empty if none).
    fn container_log(&self, name: &str) -> String {
        std::fs::read_to_string(self.log_dir.join(format!("{name}.log"))).unwrap_or_default()
    }

    /// `ExecSync` → (exit code, stdout, stderr).
    fn exec(&self, id: &str, cmd: &[&str]) -> Result<(i32, String, String)> {
        let mut c = self.cri.runtime.clone();
        let r = self.cri.call(
            "ExecSync",
            c.exec_sync(ExecSyncRequest {
                container_id: id.to_string(),
                cmd: cmd.iter().map(|s| s.to_string()).collect(),
                timeout: 30,
            }),
        )?;
        Ok((
            r.exit_code,
            String::from_utf8_lossy(&r.stdout).into_owned(),
            String::from_utf8_lossy(&r.stderr).into_owned(),
        ))
    }

    /// StopContainer (SIGTERM, SIGKILL after `timeout_s`) and RemoveContainer.
    fn stop_and_remove(&self, id: &str, timeout_s: i64) -> Result<()> {
        let mut c = self.cri.runtime.clone();
        self.cri.call(
            "StopContainer",
            c.stop_container(StopContainerRequest {
                container_id: id.to_string(),
                timeout: timeout_s,
            }),
        )?;
        let mut c = self.cri.runtime.clone();
        self.cri.call(
            "RemoveContainer",
            c.remove_container(RemoveContainerRequest {
                container_id: id.to_string(),
            }),
        )?;
        Ok(())
    }

    fn remove(&mut self) -> Result<()> {
        if self.id.is_empty() {
            return Ok(());
        }
        let id = std::mem::take(&mut self.id);
        let mut c = self.cri.runtime.clone();
        self.cri.call(
            "StopPodSandbox",
            c.stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: id.clone(),
            }),
        )?;
        let mut c = self.cri.runtime.clone();
        self.cri.call(
            "RemovePodSandbox",
            c.remove_pod_sandbox(RemovePodSandboxRequest { pod_sandbox_id: id }),
        )?;
        Ok(())
    }
}

impl Drop for Pod<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.remove() {
            eprintln!("removing pod sandbox: {e:#}");
        }
    }
}

// ---------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------

/// Runs `f` with the process-wide env (containerd with CRI) and a CRI client,
/// the images imported into `k8s.io` for the layerstack snapshotter.
fn run_cri(f: impl FnOnce(&TestEnv, &Cri) -> Result<()>) {
    if !require_root_and_containerd() {
        return;
    }
    set_containerd_config(cri_config);
    with_shared_env(|env| {
        let r = (|| {
            bin_path(SHIM_BIN).context("the shim binary must be built")?;
            env.start_daemon()?;
            let cri = Cri::connect(env.containerd().socket())?;
            cri.wait_runtime_ready()?;
            for (tar, image) in [
                (pause_image_tar()?, PAUSE_IMAGE),
                (busybox_image_tar()?, BUSYBOX_IMAGE),
            ] {
                import_checked(env, NS, &tar, SNAPSHOTTER, image)?;
                cri.wait_image(image)?;
            }
            f(env, &cri)
        })();
        if let Err(e) = r {
            panic!("{e:#}");
        }
    });
}

/// A container's labels and annotations (`ContainerConfig`).
#[derive(Default)]
struct Meta {
    labels: HashMap<String, String>,
    annotations: HashMap<String, String>,
}

/// How a scenario names the branch in the pod spec.
#[derive(Clone, Copy)]
enum BranchBy {
    /// The pod's annotation `layerstack.branch` (`metadata.annotations` of a
    /// Kubernetes pod; the kubelet passes them as `PodSandboxConfig.annotations`).
    PodAnnotation,
    /// `ContainerConfig.labels[layerstack.branch]`.
    ContainerLabel,
    /// `ContainerConfig.annotations[containerd.io/snapshot/layerstack.branch]`:
    /// containerd 1.6's CRI copies a container's annotations with the
    /// `containerd.io/snapshot/` prefix into its rootfs snapshot's labels
    /// (`snapshots.FilterInheritedLabels`), checked here.
    SnapshotAnnotation,
}

impl BranchBy {
    fn one(key: &str, branch: &str) -> HashMap<String, String> {
        HashMap::from([(key.to_string(), branch.to_string())])
    }

    fn pod(self, branch: &str) -> HashMap<String, String> {
        match self {
            Self::PodAnnotation => Self::one(labels::BRANCH_LABEL, branch),
            _ => HashMap::new(),
        }
    }

    fn container(self, branch: &str) -> Meta {
        match self {
            Self::PodAnnotation => Meta::default(),
            Self::ContainerLabel => Meta {
                labels: Self::one(labels::BRANCH_LABEL, branch),
                ..Meta::default()
            },
            Self::SnapshotAnnotation => Meta {
                annotations: Self::one(SNAPSHOT_BRANCH_LABEL, branch),
                ..Meta::default()
            },
        }
    }
}

/// The scenario of the module doc on `handler`, the branch named `by`.
fn publish_and_next_pod_sees_it(
    env: &TestEnv,
    cri: &Cri,
    handler: &str,
    by: BranchBy,
) -> Result<()> {
    let branch = unique(&format!("cri-{handler}"));
    let token = format!(
        "{branch}: written by a pod on {handler} (test pid {})",
        std::process::id()
    );
    // 1. A pod whose container writes on `branch`.
    let writer_name = unique("writer");
    let mut pod = Pod::run(cri, env, &unique("pod-w"), handler, by.pod(&branch))?;
    // A path of this scenario's own: a failed scenario that published to main
    // must not fail the next one's "main does not see it".
    let file = format!("/data/{branch}.txt");
    let script = format!("mkdir -p /data && printf '%s\\n' '{token}' > {file}");
    let writer = pod.start_container(&writer_name, &script, by.container(&branch))?;
    let code = pod.wait_state(&writer, &writer_name, ContainerState::ContainerExited)?;
    ensure!(
        code == 0,
        "writer exited {code}; its log:\n{}",
        pod.container_log(&writer_name)
    );
    if handler == SHIM_HANDLER {
        // CRI deletes an exited container's task before it reports it exited, and
        // the shim returns from that delete only with an outcome.
        let s = session(env, NS, &writer)?;
        ensure!(
            s["outcome"] == "committed",
            "the shim's session is not committed when CRI reports the container exited: {s:#}"
        );
    }
    pod.stop_and_remove(&writer, 10)?;
    pod.remove()?;
    ensure!(
        ls_wait_ok(env, NS, &writer)? == "committed",
        "writer's session: {:#}",
        session(env, NS, &writer)?
    );
    let s = session(env, NS, &writer)?;
    ensure!(
        s["branch"] == branch.as_str(),
        "the writer's session is on branch {} (wanted {branch}): {s:#}",
        s["branch"]
    );

    // 2. The next pod: a container on `branch` sees the file, one on main does not
    //    (a pod of its own: a pod annotation names the branch for all of a pod).
    let mut pod = Pod::run(cri, env, &unique("pod-r"), handler, by.pod(&branch))?;
    let reader_name = unique("reader");
    let reader = pod.start_container(&reader_name, "exec sleep 600", by.container(&branch))?;
    pod.wait_state(&reader, &reader_name, ContainerState::ContainerRunning)?;
    let mut main_pod = Pod::run(cri, env, &unique("pod-m"), handler, HashMap::new())?;
    let other_name = unique("other");
    let other = main_pod.start_container(&other_name, "exec sleep 600", Meta::default())?;
    main_pod.wait_state(&other, &other_name, ContainerState::ContainerRunning)?;
    let (code, out, err) = pod.exec(&reader, &["cat", &file])?;
    ensure!(
        code == 0 && out == format!("{token}\n"),
        "the next pod's container on {branch} reads {out:?} (exit {code}, stderr {err:?}), wanted {token:?}"
    );
    let (code, out, _) = main_pod.exec(&other, &["cat", &file])?;
    ensure!(
        code != 0,
        "a container on main sees the file written on {branch}: {out:?}"
    );
    pod.stop_and_remove(&reader, 0)?;
    main_pod.stop_and_remove(&other, 0)?;
    pod.remove()?;
    main_pod.remove()?;
    for (id, on) in [(&reader, branch.as_str()), (&other, "main")] {
        let s = session(env, NS, id)?;
        ensure!(
            s["branch"] == on,
            "a reader's session is on {} (wanted {on}): {s:#}",
            s["branch"]
        );
        // Readers write nothing: `no-change` (also when the snapshot was removed
        // before the asynchronous, runc-handler publish ran) — never a new layer.
        let (word, _) = ls_wait(env, NS, id)?;
        let s = session(env, NS, id)?;
        ensure!(
            word == "no-change",
            "a reader's session ended {word}: {s:#}"
        );
    }
    Ok(())
}

/// The Kubernetes way: RuntimeClass `handler: layerstack`, the branch in a pod
/// annotation.
#[test]
fn cri_shim_handler_branch_by_pod_annotation() {
    run_cri(|env, cri| {
        publish_and_next_pod_sees_it(env, cri, SHIM_HANDLER, BranchBy::PodAnnotation)
    });
}

#[test]
fn cri_shim_handler_branch_by_container_label() {
    run_cri(|env, cri| {
        publish_and_next_pod_sees_it(env, cri, SHIM_HANDLER, BranchBy::ContainerLabel)
    });
}

/// The default runtime handler: no shim, the daemon publishes on task delete.
#[test]
fn cri_runc_handler_branch_by_pod_annotation() {
    run_cri(|env, cri| {
        publish_and_next_pod_sees_it(env, cri, RUNC_HANDLER, BranchBy::PodAnnotation)
    });
}

#[test]
fn cri_runc_handler_branch_by_snapshot_annotation() {
    run_cri(|env, cri| {
        publish_and_next_pod_sees_it(env, cri, RUNC_HANDLER, BranchBy::SnapshotAnnotation)
    });
}
