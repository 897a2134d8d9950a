//! Building blocks the test files share: running a scenario on the shared
//! [`TestEnv`], `ctr run` ([`CtrRun`]), polling `ctr tasks ls`, `layerstack
//! wait` / `publish`, `layerstack session ls --json`, and container ids.
//!
//! Everything that talks to containerd or the daemon takes the containerd
//! namespace explicitly: each test file works in its own.

use std::path::{Path, PathBuf};
use std::process::{Child, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

use crate::{
    debian_image_tar, describe, require_root_and_containerd, stdout, with_shared_env,
    with_shared_env_mut, TestEnv, DEBIAN_IMAGE, SNAPSHOTTER, SNAPSHOT_BRANCH_LABEL,
};

// ---------------------------------------------------------------------------
// Running a scenario
// ---------------------------------------------------------------------------

/// Runs `f` on the process-wide env ([`with_shared_env`]) and panics with the
/// error chain if it fails. Without root or containerd it skips (see
/// [`require_root_and_containerd`]).
pub fn run_scenario(f: impl FnOnce(&TestEnv) -> Result<()>) {
    if !require_root_and_containerd() {
        return;
    }
    with_shared_env(|env| {
        if let Err(e) = f(env) {
            panic!("{e:#}");
        }
    });
}

/// [`run_scenario`] with mutable access to the env ([`with_shared_env_mut`]).
pub fn run_scenario_mut(f: impl FnOnce(&mut TestEnv) -> Result<()>) {
    if !require_root_and_containerd() {
        return;
    }
    with_shared_env_mut(|env| {
        if let Err(e) = f(env) {
            panic!("{e:#}");
        }
    });
}

/// [`run_scenario`] after [`prepare_layerstack`]`(env, ns)`.
pub fn run_layerstack_scenario(ns: &str, f: impl FnOnce(&TestEnv) -> Result<()>) {
    run_scenario(|env| {
        prepare_layerstack(env, ns)?;
        f(env)
    });
}

/// Imports the OCI archive `tar` into `ns` for `snapshotter`; `image` must be
/// among the image names afterwards.
pub fn import_checked(
    env: &TestEnv,
    ns: &str,
    tar: &Path,
    snapshotter: &str,
    image: &str,
) -> Result<()> {
    let names = env.import_image(ns, tar, snapshotter)?;
    ensure!(
        names.iter().any(|n| n == image),
        "image names after import into {ns}: {names:?}"
    );
    Ok(())
}

/// Starts the daemon (if it does not run yet) and imports `tar` into `ns` for
/// the layerstack snapshotter ([`import_checked`]).
pub fn start_daemon_and_import(env: &TestEnv, ns: &str, tar: &Path, image: &str) -> Result<()> {
    env.start_daemon()
        .context("starting the layerstack daemon")?;
    import_checked(env, ns, tar, SNAPSHOTTER, image)
}

/// [`start_daemon_and_import`] of the Debian fixture image.
pub fn prepare_layerstack(env: &TestEnv, ns: &str) -> Result<()> {
    let tar = debian_image_tar()?;
    start_daemon_and_import(env, ns, &tar, DEBIAN_IMAGE)
}

// ---------------------------------------------------------------------------
// Ids and labels
// ---------------------------------------------------------------------------

static UNIQUE: AtomicUsize = AtomicUsize::new(0);

/// A container id not used before in this process, `PREFIX-N` (enough where
/// containerd and runc keep their state below the process's private dir).
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", UNIQUE.fetch_add(1, Ordering::SeqCst))
}

/// `PREFIX-PID-N`: unique across test processes too, for state outside the
/// private dir (runc keeps the state of containers of the runtime shim under
/// `/run/containerd/runc/<namespace>`).
pub fn unique_across_processes(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        UNIQUE.fetch_add(1, Ordering::SeqCst)
    )
}

/// Snapshot label (`ctr run --snapshotter-label`) that puts a container's
/// session on `branch`.
pub fn snapshot_branch_label(branch: &str) -> String {
    format!("{SNAPSHOT_BRANCH_LABEL}={branch}")
}

/// Container label (`ctr run --label`) through which the runtime shim chooses
/// the branch.
pub fn container_branch_label(branch: &str) -> String {
    format!("{}={branch}", crate::labels::BRANCH_LABEL)
}

/// Container label with the publish policy (`never`, `on-success`, …).
pub fn publish_policy_label(policy: &str) -> String {
    format!("{}={policy}", crate::labels::PUBLISH_LABEL)
}

// ---------------------------------------------------------------------------
// ctr run
// ---------------------------------------------------------------------------

/// One `ctr -n NS run …`: by default the Debian image on the layerstack
/// snapshotter with containerd's default runtime, neither `--rm` nor `-d`.
/// The arguments are `run [--runtime R] --snapshotter S
/// [--snapshotter-label L]… [--rm] [-d] [--label L]… EXTRA… IMAGE ID CMD…`.
#[derive(Clone, Debug)]
pub struct CtrRun {
    ns: String,
    id: String,
    image: String,
    snapshotter: String,
    runtime: Option<String>,
    snapshot_labels: Vec<String>,
    rm: bool,
    detach: bool,
    labels: Vec<String>,
    extra: Vec<String>,
    cmd: Vec<String>,
}

impl CtrRun {
    /// `cmd` in a new container `id` of namespace `ns`.
    pub fn new(ns: &str, id: &str, cmd: &[&str]) -> Self {
        CtrRun {
            ns: ns.to_string(),
            id: id.to_string(),
            image: DEBIAN_IMAGE.to_string(),
            snapshotter: SNAPSHOTTER.to_string(),
            runtime: None,
            snapshot_labels: Vec::new(),
            rm: false,
            detach: false,
            labels: Vec::new(),
            extra: Vec::new(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
        }
    }
    /// `sh -c script` in a new container `id` of namespace `ns`.
    pub fn sh(ns: &str, id: &str, script: &str) -> Self {
        Self::new(ns, id, &["sh", "-c", script])
    }
    /// Runs `image` instead of the Debian image.
    pub fn image(mut self, image: &str) -> Self {
        self.image = image.to_string();
        self
    }
    /// Uses `snapshotter` instead of the layerstack one.
    pub fn snapshotter(mut self, snapshotter: &str) -> Self {
        self.snapshotter = snapshotter.to_string();
        self
    }
    /// `--runtime runtime`.
    pub fn runtime(mut self, runtime: &str) -> Self {
        self.runtime = Some(runtime.to_string());
        self
    }
    /// The session's branch through the snapshot label (None: the default
    /// branch).
    pub fn branch(mut self, branch: Option<&str>) -> Self {
        self.snapshot_labels
            .extend(branch.map(snapshot_branch_label));
        self
    }
    /// `--rm` or not.
    pub fn rm(mut self, rm: bool) -> Self {
        self.rm = rm;
        self
    }
    /// `-d` (and no `--rm`): `ctr` returns once the task runs.
    pub fn detached(mut self) -> Self {
        self.rm = false;
        self.detach = true;
        self
    }
    /// A container label (`--label`).
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.labels.push(label.into());
        self
    }
    /// More arguments, right before the image.
    pub fn extra(mut self, args: &[&str]) -> Self {
        self.extra.extend(args.iter().map(|s| s.to_string()));
        self
    }
    /// The command run in the container.
    pub fn cmd(mut self, cmd: &[&str]) -> Self {
        self.cmd = cmd.iter().map(|s| s.to_string()).collect();
        self
    }

    /// The `ctr` arguments (after `--namespace NS`).
    pub fn ctr_args(&self) -> Vec<String> {
        let mut a: Vec<String> = vec!["run".into()];
        if let Some(r) = &self.runtime {
            a.extend(["--runtime".into(), r.clone()]);
        }
        a.extend(["--snapshotter".into(), self.snapshotter.clone()]);
        for l in &self.snapshot_labels {
            a.extend(["--snapshotter-label".into(), l.clone()]);
        }
        if self.rm {
            a.push("--rm".into());
        }
        if self.detach {
            a.push("-d".into());
        }
        for l in &self.labels {
            a.extend(["--label".into(), l.clone()]);
        }
        a.extend(self.extra.iter().cloned());
        a.extend([self.image.clone(), self.id.clone()]);
        a.extend(self.cmd.iter().cloned());
        a
    }

    /// Runs `ctr` (exit status not checked).
    pub fn output(&self, env: &TestEnv) -> Result<Output> {
        let args = self.ctr_args();
        env.ctr(
            &self.ns,
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
        )
    }

    /// Runs `ctr`, which must exit 0.
    pub fn ok(&self, env: &TestEnv) -> Result<Output> {
        let out = self.output(env)?;
        ensure!(
            out.status.success(),
            "ctr -n {} run{} {}: {}",
            self.ns,
            if self.detach { " -d" } else { "" },
            self.id,
            describe(&out)
        );
        Ok(out)
    }

    /// [`CtrRun::ok`], returning stdout.
    pub fn stdout_ok(&self, env: &TestEnv) -> Result<String> {
        Ok(stdout(&self.ok(env)?))
    }

    /// Spawns `ctr` without waiting for it (see [`TestEnv::ctr_spawn`]).
    pub fn spawn(&self, env: &TestEnv) -> Result<Child> {
        let args = self.ctr_args();
        env.ctr_spawn(
            &self.ns,
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
        )
    }
}

/// Blocking `ctr run` of `sh -c script` on the Debian image with the layerstack
/// snapshotter, on `branch` (None: the default branch). Fails on a non-zero
/// exit; returns stdout.
pub fn run_sh(
    env: &TestEnv,
    ns: &str,
    id: &str,
    branch: Option<&str>,
    rm: bool,
    script: &str,
) -> Result<String> {
    CtrRun::sh(ns, id, script)
        .branch(branch)
        .rm(rm)
        .stdout_ok(env)
}

/// `ctr run -d` of `sh -c script` (as [`run_sh`]): returns once the task runs.
pub fn start_detached(
    env: &TestEnv,
    ns: &str,
    id: &str,
    branch: Option<&str>,
    script: &str,
) -> Result<()> {
    CtrRun::sh(ns, id, script)
        .branch(branch)
        .detached()
        .ok(env)?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Tasks and containers
// ---------------------------------------------------------------------------

/// The STATUS column of task `id` in `ctr tasks ls` (None: not listed), and
/// the whole listing.
pub fn task_status(env: &TestEnv, ns: &str, id: &str) -> Result<(Option<String>, String)> {
    let text = stdout(&env.ctr_ok(ns, &["tasks", "ls"])?);
    // TASK  PID  STATUS
    let status = text
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.first() == Some(&id))
        .and_then(|f| f.get(2).map(|s| s.to_string()));
    Ok((status, text))
}

/// Polls `ctr tasks ls` until task `id` is STOPPED (`Ok(None)`) or not listed
/// (`Ok(Some(listing))`); fails once it still runs after `timeout`.
fn poll_task_stopped(
    env: &TestEnv,
    ns: &str,
    id: &str,
    timeout: Duration,
) -> Result<Option<String>> {
    let deadline = Instant::now() + timeout;
    loop {
        let (status, text) = task_status(env, ns, id)?;
        match status.as_deref() {
            Some("STOPPED") => return Ok(None),
            None => return Ok(Some(text)),
            Some(_) if Instant::now() >= deadline => {
                bail!("task {id} still running after {timeout:?}:\n{text}")
            }
            Some(_) => thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// Polls `ctr tasks ls` until task `id` is STOPPED; fails if it is not
/// listed, or still runs after `timeout`. (ctr 1.6 has no `tasks wait`.)
pub fn wait_task_stopped(env: &TestEnv, ns: &str, id: &str, timeout: Duration) -> Result<()> {
    match poll_task_stopped(env, ns, id, timeout)? {
        None => Ok(()),
        Some(text) => bail!("no task {id} in `ctr tasks ls`:\n{text}"),
    }
}

/// Polls `ctr tasks ls` until task `id` is STOPPED (`Ok(true)`) or gone
/// (`Ok(false)`); fails if it still runs after `timeout`.
pub fn wait_task_stopped_or_gone(
    env: &TestEnv,
    ns: &str,
    id: &str,
    timeout: Duration,
) -> Result<bool> {
    Ok(poll_task_stopped(env, ns, id, timeout)?.is_none())
}

/// Polls `ctr tasks ls` until task `id` is RUNNING; fails after `timeout`.
pub fn wait_task_running(env: &TestEnv, ns: &str, id: &str, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let (status, text) = task_status(env, ns, id)?;
        if status.as_deref() == Some("RUNNING") {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "task {id} not running:\n{text}");
        thread::sleep(Duration::from_millis(100));
    }
}

/// Waits (up to 60 s) for the detached task `id` to stop, then deletes the
/// task, which must succeed. With runc-v2 that makes containerd emit
/// /tasks/delete: the daemon's publish trigger.
pub fn finish_detached(env: &TestEnv, ns: &str, id: &str) -> Result<()> {
    wait_task_stopped(env, ns, id, Duration::from_secs(60))?;
    delete_task(env, ns, id)
}

/// `ctr tasks delete id`, which must succeed.
pub fn delete_task(env: &TestEnv, ns: &str, id: &str) -> Result<()> {
    let out = env.ctr(ns, &["tasks", "delete", id])?;
    ensure!(
        out.status.success(),
        "ctr tasks delete {id}: {}",
        describe(&out)
    );
    Ok(())
}

/// `ctr tasks kill --signal SIGKILL id`, which must succeed.
pub fn kill_task(env: &TestEnv, ns: &str, id: &str) -> Result<()> {
    env.ctr_ok(ns, &["tasks", "kill", "--signal", "SIGKILL", id])?;
    Ok(())
}

/// `ctr containers delete id`, which must succeed.
pub fn remove_container(env: &TestEnv, ns: &str, id: &str) -> Result<()> {
    env.ctr_ok(ns, &["containers", "delete", id])?;
    Ok(())
}

// ---------------------------------------------------------------------------
// layerstack wait / publish / session ls
// ---------------------------------------------------------------------------

/// The first line of stdout, trimmed: the outcome word of `layerstack wait`
/// and `layerstack publish`.
pub fn first_word(out: &Output) -> String {
    stdout(out).lines().next().unwrap_or("").trim().to_string()
}

/// `layerstack wait ID --timeout 60 --namespace NS EXTRA…` (exit status not
/// checked).
pub fn layerstack_wait(env: &TestEnv, ns: &str, id: &str, extra: &[&str]) -> Result<Output> {
    let mut args = vec!["wait", id, "--timeout", "60", "--namespace", ns];
    args.extend_from_slice(extra);
    env.layerstack(&args)
}

/// [`layerstack_wait`] → (outcome word, output).
pub fn ls_wait(env: &TestEnv, ns: &str, id: &str) -> Result<(String, Output)> {
    let out = layerstack_wait(env, ns, id, &[])?;
    Ok((first_word(&out), out))
}

/// [`ls_wait`] that must succeed; returns the outcome word.
pub fn ls_wait_ok(env: &TestEnv, ns: &str, id: &str) -> Result<String> {
    let (word, out) = ls_wait(env, ns, id)?;
    ensure!(
        out.status.success(),
        "layerstack wait -n {ns} {id}: {}",
        describe(&out)
    );
    Ok(word)
}

/// `layerstack wait … --json --paths`: the session as JSON, with every path's
/// verdict (exit status not checked).
pub fn ls_wait_json(env: &TestEnv, ns: &str, id: &str) -> Result<Value> {
    let out = layerstack_wait(env, ns, id, &["--json", "--paths"])?;
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("layerstack wait {id}: {}", describe(&out)))
}

/// `layerstack publish FLAGS… ID --namespace NS` (exit status not checked).
pub fn ls_publish(env: &TestEnv, ns: &str, id: &str, flags: &[&str]) -> Result<Output> {
    let mut args = vec!["publish"];
    args.extend_from_slice(flags);
    args.extend([id, "--namespace", ns]);
    env.layerstack(&args)
}

/// `layerstack session ls --json --namespace NS`, which must succeed.
pub fn sessions(env: &TestEnv, ns: &str) -> Result<Vec<Value>> {
    let out = env.layerstack(&["session", "ls", "--json", "--namespace", ns])?;
    ensure!(
        out.status.success(),
        "layerstack session ls --json: {}",
        describe(&out)
    );
    let v: Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("parsing session ls --json output: {}", stdout(&out)))?;
    match v {
        Value::Array(a) => Ok(a),
        other => bail!("session ls --json is not an array: {other}"),
    }
}

/// The newest session of `container` in namespace `ns` among `all`.
pub fn session_of<'a>(all: &'a [Value], ns: &str, container: &str) -> Result<&'a Value> {
    all.iter()
        .rev()
        .find(|s| s["namespace"] == ns && s["container"] == container)
        .with_context(|| format!("no session for container {container} in {all:#?}"))
}

/// The newest session of `container` from [`sessions`].
pub fn session(env: &TestEnv, ns: &str, container: &str) -> Result<Value> {
    session_of(&sessions(env, ns)?, ns, container).cloned()
}

/// The strings in the JSON array `v` (other elements are skipped); fails if
/// `v` is not an array.
pub fn json_strs<'a>(v: &'a Value, what: &str) -> Result<Vec<&'a str>> {
    Ok(v.as_array()
        .with_context(|| format!("{what} not an array: {v}"))?
        .iter()
        .filter_map(Value::as_str)
        .collect())
}

/// Directory of a session's upper in the daemon's store (`<root>/s/<id>/upper`,
/// ARCHITECTURE.md §8).
pub fn session_upper(env: &TestEnv, session: &Value) -> Result<PathBuf> {
    let id = session["id"].as_i64().context("session id")?;
    Ok(env
        .store_root()
        .join("s")
        .join(id.to_string())
        .join("upper"))
}

/// `describe` without megabytes of stdout.
pub fn describe_short(out: &Output) -> String {
    format!(
        "exit {:?}, {} bytes of stdout, stderr: {}",
        out.status.code(),
        out.stdout.len(),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The committed top snapshot of the Debian image on the layerstack
/// snapshotter in `ns` (`ctr snapshots ls`).
pub fn image_top_snapshot(env: &TestEnv, ns: &str) -> Result<String> {
    let snaps = stdout(&env.ctr_ok(ns, &["snapshots", "--snapshotter", SNAPSHOTTER, "ls"])?);
    snaps
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| {
            f.first().is_some_and(|k| k.starts_with("sha256:")) && f.last() == Some(&"Committed")
        })
        .map(|f| f[0].to_string())
        .with_context(|| format!("no committed image snapshot in:\n{snaps}"))
}

/// Mounts the overlay that `ctr snapshots prepare --mounts` printed at `target`.
pub fn mount_snapshot_json(mounts_json: &[u8], target: &Path) -> Result<()> {
    let v: Value = serde_json::from_slice(mounts_json).context("parsing mounts")?;
    let m = v
        .as_array()
        .and_then(|a| a.first())
        .context("no mount returned")?;
    let opts = json_strs(&m["Options"], "mount options")?;
    std::fs::create_dir_all(target)?;
    nix::mount::mount(
        Some("overlay"),
        target,
        Some("overlay"),
        nix::mount::MsFlags::empty(),
        Some(opts.join(",").as_str()),
    )
    .with_context(|| format!("mounting at {}", target.display()))
}

/// A session without a container: `ctr snapshots prepare KEY PARENT` on the
/// layerstack snapshotter (with the branch label), mounted at a scratch
/// directory while `write` changes it, unmounted. Returns the key.
pub fn snapshot_session(
    env: &TestEnv,
    ns: &str,
    key: &str,
    parent: &str,
    branch: Option<&str>,
    write: impl FnOnce(&Path) -> Result<()>,
) -> Result<String> {
    let mut args = vec![
        "snapshots",
        "--snapshotter",
        SNAPSHOTTER,
        "prepare",
        "--mounts",
    ];
    if let Some(b) = branch {
        anyhow::bail!(
            "snapshot_session on branch {b:?}: `ctr snapshots prepare` of containerd 1.6 has no --label; run a container with `CtrRun::branch` instead"
        );
    }
    args.extend([key, parent]);
    let prep = env.ctr_ok(ns, &args)?;
    let target = env.scratch().join(format!("mnt-{key}"));
    mount_snapshot_json(&prep.stdout, &target)?;
    let r = write(&target);
    nix::mount::umount(&target).context("unmounting the snapshot")?;
    r?;
    Ok(key.to_string())
}

/// [`snapshot_session`] and publish it at once (`layerstack publish KEY`); the
/// snapshot is then removed. Returns the outcome word.
pub fn publish_snapshot(
    env: &TestEnv,
    ns: &str,
    key: &str,
    parent: &str,
    branch: Option<&str>,
    write: impl FnOnce(&Path) -> Result<()>,
) -> Result<String> {
    snapshot_session(env, ns, key, parent, branch, write)?;
    let out = ls_publish(env, ns, key, &[])?;
    ensure!(
        out.status.success(),
        "layerstack publish {key}: {}",
        describe(&out)
    );
    env.ctr_ok(ns, &["snapshots", "--snapshotter", SNAPSHOTTER, "rm", key])?;
    Ok(first_word(&out))
}

// ---------------------------------------------------------------------------
// Metrics and the daemon's log
// ---------------------------------------------------------------------------

/// The daemon's metrics address (`layerstack status --json`, `metrics_address`).
pub fn metrics_address(env: &TestEnv) -> Result<String> {
    let out = env.layerstack(&["status", "--json"])?;
    ensure!(
        out.status.success(),
        "layerstack status: {}",
        describe(&out)
    );
    let st: Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("status --json: {}", describe(&out)))?;
    st["metrics_address"]
        .as_str()
        .map(str::to_string)
        .context("status --json has no metrics_address (metrics off?)")
}

/// The body of `GET /metrics` on `addr`.
pub fn scrape_metrics(addr: &str) -> Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).with_context(|| format!("connect {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let (head, body) = text.split_once("\r\n\r\n").context("no HTTP header end")?;
    ensure!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    Ok(body.to_string())
}

/// The value of the series `series` (`name{labels}` exactly as exposed) in a
/// scrape's `body`, if present.
pub fn metric_sample(body: &str, series: &str) -> Option<f64> {
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// `layerstack_publishes_total{outcome="KIND"}` now (0 when absent).
pub fn publishes_total(addr: &str, kind: &str) -> Result<f64> {
    let body = scrape_metrics(addr)?;
    Ok(metric_sample(
        &body,
        &format!("layerstack_publishes_total{{outcome=\"{kind}\"}}"),
    )
    .unwrap_or(0.0))
}

/// The daemon's `publish outcome` log lines that contain every one of `with`.
pub fn outcome_lines(env: &TestEnv, with: &[&str]) -> Result<Vec<String>> {
    let log = std::fs::read_to_string(env.daemon_log())?;
    Ok(log
        .lines()
        .filter(|l| l.contains("publish outcome") && with.iter().all(|w| l.contains(w)))
        .map(str::to_string)
        .collect())
}

/// Polls `f` every 100 ms until it returns `Some`, at most `within`.
pub fn poll<T>(within: Duration, mut f: impl FnMut() -> Result<Option<T>>) -> Result<Option<T>> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f()? {
            return Ok(Some(v));
        }
        if Instant::now() > deadline {
            return Ok(None);
        }
        thread::sleep(Duration::from_millis(100));
    }
}
