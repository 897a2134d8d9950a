//! `layerstack session run --wasi MODULE.wasm STACK -- ARGS…`: a WASI session
//! (owner kind `wasi`, issue 24) through the admin API alone — no root, no
//! mount socket, no namespaces on the caller's side: `CreateSession` with
//! `wasi`, one `Exec` with the module's bytes, `CloseSession` by the exit
//! policy with the module's exit status. The outcome is reported as for a
//! Mode B run (one line on stderr, `--outcome FILE` as JSON, with a `wasi`
//! object: trap, fuel used, module digest); the exit status is the module's
//! (134 when it trapped: a limit or a wasm trap; 125 when `run` itself failed).

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args;
use layerstack_api as api;
use serde_json::json;

use crate::errors::{failure, with_kind};
use crate::run::{close, outcome_line, NodeInfo, RunArgs};
use crate::Cli;

/// `session run --wasi` options.
#[derive(Debug, Clone, Args)]
pub struct WasiArgs {
    /// Run this WebAssembly module (WASI preview1, a command exporting
    /// `_start`) in a WASI session instead of a Linux command: it sees the
    /// session's tree as its root (`/`); the arguments after `--` are its
    /// arguments. Needs no root on this side. Its stdin is empty (the Python
    /// SDK's `exec(stdin=…)` gives bytes); its stdout and stderr are printed
    /// when it has ended. Exit status: the module's; 134 when a limit or a
    /// wasm trap stopped it (as the wasmtime CLI; `wasi.trap` in --outcome
    /// says which); 125 when `run` itself failed.
    #[arg(long, value_name = "MODULE.wasm")]
    pub wasi: Option<PathBuf>,
    /// With --wasi: fuel of the run (about one unit per wasm instruction)
    /// [default (or 0): the daemon's, 10^10].
    #[arg(long, value_name = "N", requires = "wasi")]
    pub fuel: Option<u64>,
    /// With --wasi: the run's linear memory cap, bytes (wasm32 memories stop
    /// at 4 GiB) [default (or 0): 256 MiB].
    #[arg(long, value_name = "BYTES", requires = "wasi")]
    pub memory_bytes: Option<u64>,
    /// With --wasi: the run's wall-clock limit, milliseconds, also while the
    /// module waits in a host call [default (or 0): 60000].
    #[arg(long, value_name = "MS", requires = "wasi")]
    pub timeout_ms: Option<u32>,
}

/// `session run --wasi`.
pub async fn run(cli: &Cli, a: RunArgs) -> Result<ExitCode> {
    let Some(path) = a.wasi.wasi.clone() else {
        unreachable!("run --wasi without --wasi")
    };
    let s = &a.session;
    if s.mount_at.is_some() {
        return Err(failure(
            api::ErrorKind::InvalidArgument,
            "--mount-at: a WASI module sees the session's tree as its root; drop --mount-at",
        ));
    }
    if a.process.user.is_some() || a.process.workdir.is_some() {
        return Err(failure(
            api::ErrorKind::InvalidArgument,
            "--user and --workdir do not apply to a WASI module (it runs as no user, in its root): drop them",
        ));
    }
    if s.publish == Some(crate::run::EndAction::Checkpoint) && s.node.is_none() {
        return Err(failure(
            api::ErrorKind::InvalidArgument,
            "--publish checkpoint makes a child node of the node the session starts from: give --node ID (layerstack graph show lists nodes), or use on-exit, on-success or never",
        ));
    }
    // At most one byte past the limit is read: a device, a FIFO or a
    // growing file is refused by what it gave, never read whole.
    let module = {
        use std::io::Read as _;
        let mut buf = Vec::new();
        std::fs::File::open(&path)
            .and_then(|f| f.take(api::MAX_WASI_MODULE_BYTES + 1).read_to_end(&mut buf))
            .with_context(|| format!("--wasi {}: cannot read the module", path.display()))
            .map_err(|e| with_kind(api::ErrorKind::InvalidArgument, e))?;
        buf
    };
    if module.is_empty() {
        return Err(failure(
            api::ErrorKind::InvalidArgument,
            format!(
                "--wasi {}: the file is empty: give a WebAssembly module (a .wasm binary built for wasm32-wasi)",
                path.display()
            ),
        ));
    }
    if module.len() as u64 > api::MAX_WASI_MODULE_BYTES {
        // Refused before a session is made for it (the daemon would refuse
        // the Exec; a message over the channel's limit breaks the channel).
        return Err(failure(
            api::ErrorKind::InvalidArgument,
            format!(
                "--wasi {}: the module is more than {} bytes (64 MiB), what a run takes: make it smaller (wasm-opt, strip its debug sections)",
                path.display(),
                api::MAX_WASI_MODULE_BYTES
            ),
        ));
    }
    let env = crate::run::env_pairs(&a.process.env)?;
    // Checked before a session is made (a refusal after would leave it).
    let args = crate::run::api_argv(&a.cmd)?;
    let mut c = crate::connect(&cli.admin_address).await?;
    let created = c
        .create_session(api::CreateSessionRequest {
            wasi: Some(api::WasiOptions {
                fuel: a.wasi.fuel.unwrap_or(0),
                memory_bytes: a.wasi.memory_bytes.unwrap_or(0),
                deadline_ms: a.wasi.timeout_ms.map_or(0, u64::from),
                env,
                output_bytes: 0,
            }),
            ..crate::run::daemon_session_request(cli, s)
        })
        .await?
        .into_inner();
    let session = created.session.context("the daemon answered no session")?;
    crate::run::note_new_branch(&session, false);
    let id = session.id;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "module.wasm".into());
    let mut argv = vec![name];
    argv.extend(args);
    let command = argv.join(" ");
    let ran = exec(&mut c, id, argv, module).await;
    let (exit, reason, policy) = match &ran {
        Ok(x) => (
            x.code,
            if x.trap.is_empty() {
                format!("session run --wasi: module exited with status {}", x.code)
            } else {
                format!(
                    "session run --wasi: module stopped ({}): {}",
                    x.trap,
                    trap_cause(&x.trap_message)
                )
            },
            api::EndAction::Auto,
        ),
        Err(_) => (
            125,
            "session run --wasi: the module could not run".to_string(),
            api::EndAction::Discard,
        ),
    };
    let node = NodeInfo {
        state: a.state.clone(),
        command: Some(command),
    }
    .for_end(policy);
    let mut closed = close(&mut c, id, policy, u32::try_from(exit).ok(), &reason, &node).await;
    if closed
        .as_ref()
        .is_err_and(|e| crate::errors::describe(e).0 == api::ErrorKind::Unavailable.as_str())
    {
        // The channel may be what failed (the Exec broke it): the session
        // this command made is closed on a new one, never left live.
        if let Ok(mut again) = crate::connect(&cli.admin_address).await {
            closed = close(
                &mut again,
                id,
                policy,
                u32::try_from(exit).ok(),
                &reason,
                &node,
            )
            .await;
        }
    }
    let x = ran.map_err(|e| crate::errors::about_session(e, id))?;
    let s = closed.map_err(|e| crate::errors::about_session(e, id))?;
    // (stderr may be closed: the outcome stands, and the file below has it.)
    let _ = writeln!(std::io::stderr(), "{}", outcome_line(&s));
    if let Some(f) = &a.outcome {
        let wasi = json!({
            "trap": x.trap,
            "trap_message": x.trap_message,
            "fuel_used": x.fuel_used,
            "module_digest": x.module_digest,
            "module_compiled": x.module_compiled,
            "duration_ms": x.duration_ms,
            "timed_out": x.timed_out,
            "stdout_truncated": x.stdout_truncated,
            "stderr_truncated": x.stderr_truncated,
        });
        let s = api::Session {
            branch_created: session.branch_created,
            ..s
        };
        crate::run::write_outcome_with(f, &s, Some(exit), Some(("wasi", wasi)))?;
    }
    Ok(ExitCode::from(u8::try_from(exit).unwrap_or(255)))
}

/// The one line of a trap's text that says why: wasmtime's root cause (the
/// first line after `Caused by:`), else its first line.
fn trap_cause(s: &str) -> &str {
    if let Some(after) = s.split("Caused by:").nth(1) {
        if let Some(l) = after.lines().map(str::trim).find(|l| !l.is_empty()) {
            return l;
        }
    }
    s.lines().next().unwrap_or("")
}

/// One Exec of `module` in session `id`: its stdout and stderr copied to
/// ours, its exit.
async fn exec(
    c: &mut api::AdminClient<tonic::transport::Channel>,
    id: i64,
    argv: Vec<String>,
    module: Vec<u8>,
) -> Result<api::ExecExit> {
    let stream = c
        .exec(api::ExecRequest {
            session_id: id,
            argv,
            module,
            ..Default::default()
        })
        .await?
        .into_inner();
    crate::run::copy_exec(stream).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trap_is_summed_up_by_its_cause() {
        let fuel = "error while executing at wasm backtrace:\n    0:    0xaf6 - <unknown>!main\n\nCaused by:\n    wasm trap: all fuel consumed by WebAssembly\n";
        assert_eq!(
            trap_cause(fuel),
            "wasm trap: all fuel consumed by WebAssembly"
        );
        assert_eq!(
            trap_cause("the run's wall-clock deadline passed"),
            "the run's wall-clock deadline passed"
        );
        assert_eq!(trap_cause(""), "");
    }
}
