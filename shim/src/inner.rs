//! Driving the inner shim, Debian's `containerd-shim-runc-v2` (containerd 1.6
//! `runtime/v2/runc/manager/manager_linux.go`): its `start` and `delete` actions,
//! finding and stopping its server process, and its ttrpc Task client.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use containerd_shim_protos::protobuf::Message as _;
use containerd_shim_protos::shim::shim::DeleteResponse;
use containerd_shim_protos::shim_async::{Client, TaskClient};
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

/// Failures of the inner shim's actions.
#[derive(Debug, thiserror::Error)]
pub enum InnerError {
    #[error("cannot run {0}")]
    Spawn(PathBuf, #[source] std::io::Error),
    #[error("{bin} {action} failed ({status}): {stderr}")]
    Failed {
        bin: PathBuf,
        action: &'static str,
        status: String,
        stderr: String,
    },
    #[error("{0} {1} did not finish within {2:?}")]
    Timeout(PathBuf, &'static str, Duration),
    #[error("{0} start printed no address")]
    NoAddress(PathBuf),
    #[error("{0} delete printed no valid DeleteResponse")]
    BadDeleteResponse(PathBuf, #[source] containerd_shim_protos::protobuf::Error),
    #[error("cannot connect to the inner shim at {0}")]
    Connect(String, #[source] containerd_shim_protos::ttrpc::Error),
}

/// containerd's flags as the inner shim needs them.
#[derive(Debug, Clone, Default)]
pub struct InnerArgs {
    pub bin: PathBuf,
    pub namespace: String,
    pub id: String,
    /// containerd's gRPC address (`-address`).
    pub address: String,
    pub publish_binary: String,
    pub debug: bool,
}

impl InnerArgs {
    fn command(&self, cwd: &Path) -> Command {
        let mut c = Command::new(&self.bin);
        c.current_dir(cwd)
            .arg("-namespace")
            .arg(&self.namespace)
            .arg("-address")
            .arg(&self.address)
            .arg("-publish-binary")
            .arg(&self.publish_binary)
            .arg("-id")
            .arg(&self.id);
        if self.debug {
            c.arg("-debug");
        }
        c.kill_on_drop(true);
        c
    }
}

async fn run(
    mut cmd: Command,
    stdin: Option<&[u8]>,
    timeout: Duration,
    bin: &Path,
    action: &'static str,
) -> Result<std::process::Output, InnerError> {
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| InnerError::Spawn(bin.to_path_buf(), e))?;
    if let (Some(data), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // The inner `start` reads all of stdin (runtime options) before replying.
        let _ = pipe.write_all(data).await;
        drop(pipe);
    }
    match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(e)) => Err(InnerError::Spawn(bin.to_path_buf(), e)),
        Err(_) => Err(InnerError::Timeout(bin.to_path_buf(), action, timeout)),
    }
}

/// Runs `containerd-shim-runc-v2 … start` in `bundle` with runtime options
/// `options` (a serialized `Any`) on stdin, and `TTRPC_ADDRESS=events_address`
/// so its events come to the proxy. Returns the inner shim's ttrpc address.
pub async fn start(
    args: &InnerArgs,
    bundle: &Path,
    options: Option<&[u8]>,
    events_address: &str,
) -> Result<String, InnerError> {
    let mut cmd = args.command(bundle);
    cmd.arg("start").env(
        "TTRPC_ADDRESS",
        events_address.trim_start_matches("unix://"),
    );
    let out = run(
        cmd,
        Some(options.unwrap_or_default()),
        Duration::from_secs(60),
        &args.bin,
        "start",
    )
    .await?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() {
        return Err(InnerError::Failed {
            bin: args.bin.clone(),
            action: "start",
            status: out.status.to_string(),
            stderr: format!("{text} {}", String::from_utf8_lossy(&out.stderr).trim()),
        });
    }
    if text.is_empty() {
        return Err(InnerError::NoAddress(args.bin.clone()));
    }
    Ok(text)
}

/// Runs `containerd-shim-runc-v2 … -bundle B delete`: `runc delete --force`, unmount
/// the rootfs, exit status 137. Idempotent. Returns its `DeleteResponse` and stderr.
pub async fn delete_action(
    args: &InnerArgs,
    bundle: &Path,
    timeout: Duration,
) -> Result<(DeleteResponse, String), InnerError> {
    let mut cmd = args.command(bundle);
    cmd.arg("-bundle").arg(bundle).arg("delete");
    let out = run(cmd, None, timeout, &args.bin, "delete").await?;
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    if !out.status.success() {
        return Err(InnerError::Failed {
            bin: args.bin.clone(),
            action: "delete",
            status: out.status.to_string(),
            stderr,
        });
    }
    let resp = DeleteResponse::parse_from_bytes(&out.stdout)
        .map_err(|e| InnerError::BadDeleteResponse(args.bin.clone(), e))?;
    Ok((resp, stderr))
}

/// The socket path of a `unix://` address.
pub fn socket_path(address: &str) -> &str {
    address.strip_prefix("unix://").unwrap_or(address)
}

/// Connects a Task client to `address` (`unix://…`).
pub async fn connect(address: &str, timeout: Duration) -> Result<TaskClient, InnerError> {
    let addr = if address.contains("://") {
        address.to_string()
    } else {
        format!("unix://{address}")
    };
    match tokio::time::timeout(timeout, Client::connect(&addr)).await {
        Ok(Ok(c)) => Ok(TaskClient::new(c)),
        Ok(Err(e)) => Err(InnerError::Connect(address.to_string(), e)),
        Err(_) => Err(InnerError::Connect(
            address.to_string(),
            containerd_shim_protos::ttrpc::Error::Others(format!(
                "no connection within {timeout:?}"
            )),
        )),
    }
}

fn cmdline(pid: i32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        raw.split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect(),
    )
}

/// Whether `pid` is the inner shim *server* for (`namespace`, `id`, containerd
/// `address`): argv `<…/containerd-shim-runc-v2> -namespace NS -id ID -address A
/// [-debug]`, no action word. Guards against pid reuse before a kill.
pub fn is_inner_server(pid: i32, bin: &Path, namespace: &str, id: &str, address: &str) -> bool {
    let Some(argv) = cmdline(pid) else {
        return false;
    };
    let Some(exe) = argv.first() else {
        return false;
    };
    let name = bin
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if Path::new(exe)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        != Some(name)
    {
        return false;
    }
    let flag = |f: &str| {
        argv.iter()
            .position(|a| a == f)
            .and_then(|i| argv.get(i + 1))
            .map(String::as_str)
    };
    let has_action = argv.iter().any(|a| a == "start" || a == "delete");
    !has_action
        && flag("-namespace") == Some(namespace)
        && flag("-id") == Some(id)
        && flag("-address") == Some(address)
}

/// Finds the inner shim server process for (`namespace`, `id`) by scanning /proc
/// (containerd 1.6's runc-v2 `start` writes no pid file).
pub fn find_server_pid(bin: &Path, namespace: &str, id: &str, address: &str) -> Option<i32> {
    let rd = std::fs::read_dir("/proc").ok()?;
    rd.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .find(|pid| is_inner_server(*pid, bin, namespace, id, address))
}

/// Whether a process exists (and is not a zombie).
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rfind(')')
            .map(|i| s[i + 1..].trim_start().starts_with('Z'))
            .unwrap_or(false),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_paths() {
        assert_eq!(
            socket_path("unix:///run/containerd/s/ab"),
            "/run/containerd/s/ab"
        );
        assert_eq!(socket_path("/x"), "/x");
    }

    #[test]
    fn this_process_is_no_inner_shim() {
        let me = std::process::id() as i32;
        assert!(alive(me));
        assert!(!is_inner_server(
            me,
            Path::new("/usr/bin/containerd-shim-runc-v2"),
            "ns",
            "id",
            "/a"
        ));
    }
}
