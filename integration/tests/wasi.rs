//! WASI sessions (issue 24): WebAssembly modules the daemon runs over a
//! session's tree publish like any other session.
//!
//! * The same file operations — a new file, an edit, a rename, a deletion of
//!   a lower file, a directory replaced by a file, a renamed new directory, a
//!   directory emptied and made again (opaque), a symlink — run once as a
//!   WASI module (`layerstack session run --wasi`, C built here with clang +
//!   wasi-libc) and once as shell commands in a Mode B session publish the
//!   same layer: every entry with the same kind, mode, owner, content,
//!   symlink target, device number (whiteouts) and overlay xattrs (opaque).
//! * Concurrent WASI sessions on one head go through the gate unchanged:
//!   disjoint writes both commit, overlapping text edits merge, a true
//!   conflict is refused whole.
//! * Limits end runs with a clear trap as a field (deadline, fuel, memory,
//!   cancelled by a close); `..` and absolute symlinks do not leave the tree;
//!   nothing outside the session is read or written. The file RPCs, modules by
//!   digest and by path in the tree, and the owner kind `wasi` in listings.
//!
//! Needs root (fails under `CI=true` without it), `/bin/busybox` (static),
//! clang with the wasm32 target, `wasm-ld` and wasi-libc
//! (`scripts/install-deps.sh`); no containerd.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use layerstack_api as api;
use layerstack_integration::*;
use serde_json::Value;

type Client = api::AdminClient<tonic::transport::Channel>;

/// Whether clang can build WASI modules here; under `CI=true` a missing
/// toolchain is a failure, elsewhere the test is skipped.
fn require_wasi_toolchain(dir: &Path) -> Result<Option<Vec<u8>>> {
    match build_fsops_wasm(&dir.join("fsops.wasm")) {
        Ok(b) => Ok(Some(b)),
        Err(e) if std::env::var("CI").as_deref() == Ok("true") => Err(e),
        Err(e) => {
            eprintln!("skipping: {e:#}");
            Ok(None)
        }
    }
}

/// The lower tree both executors start from.
fn rootfs(dir: &Path) -> Result<()> {
    busybox_tree(
        dir,
        &[
            "sh", "cat", "echo", "printf", "mkdir", "rm", "mv", "ln", "true",
        ],
        &["etc", "srv/dir/sub", "srv/opq", "tmp"],
    )?;
    std::fs::write(dir.join("etc/passwd"), "session-passwd\n")?;
    // An absolute symlink of the lower tree: it must never reach the host's.
    std::os::unix::fs::symlink("/etc/shadow", dir.join("srv/abs-link"))?;
    std::fs::write(dir.join("srv/edit.txt"), "v1\n")?;
    std::fs::write(dir.join("srv/old-name.txt"), "moved\n")?;
    std::fs::write(dir.join("srv/gone.txt"), "gone\n")?;
    std::fs::write(dir.join("srv/dir/a"), "a\n")?;
    std::fs::write(dir.join("srv/dir/sub/b"), "b\n")?;
    std::fs::write(dir.join("srv/opq/old"), "old\n")?;
    let lines: String = (1..=10).map(|i| format!("line {i}\n")).collect();
    std::fs::write(dir.join("srv/text.txt"), lines)?;
    Ok(())
}

/// The operations, as fsops arguments and as a shell script for busybox.
const OPS: &[&[&str]] = &[
    &["write", "/srv/new.txt", "hello\n"],
    &["write", "/srv/edit.txt", "v2\n"],
    &["mv", "/srv/old-name.txt", "/srv/new-name.txt"],
    &["rm", "/srv/gone.txt"],
    &["rmtree", "/srv/dir"],
    &["write", "/srv/dir", "now a file\n"],
    &["mkdir", "/srv/fresh"],
    &["write", "/srv/fresh/f", "f\n"],
    &["mv", "/srv/fresh", "/srv/fresh2"],
    &["rmtree", "/srv/opq"],
    &["mkdir", "/srv/opq"],
    &["write", "/srv/opq/x", "x\n"],
    &["symlink", "../etc/passwd", "/srv/link"],
];

fn shell_script() -> String {
    let q = |s: &str| format!("'{}'", s.replace('\'', "'\\''"));
    OPS.iter()
        .map(|op| match op {
            ["write", p, t] => format!("printf '%s' {} > {}", q(t), q(p)),
            ["mv", a, b] => format!("mv {} {}", q(a), q(b)),
            ["rm", p] => format!("rm {}", q(p)),
            ["rmtree", p] => format!("rm -rf {}", q(p)),
            ["mkdir", p] => format!("mkdir {}", q(p)),
            ["symlink", t, p] => format!("ln -s {} {}", q(t), q(p)),
            other => panic!("no shell form for {other:?}"),
        })
        .collect::<Vec<_>>()
        .join(" && ")
}

fn fsops_args() -> Vec<String> {
    OPS.iter()
        .flat_map(|op| op.iter().map(|s| s.to_string()))
        .collect()
}

/// One entry of a layer directory as the comparison sees it: everything but
/// times (the two runs happen at different moments) and inode numbers.
fn describe(root: &Path) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let mut names: Vec<_> = std::fs::read_dir(&dir)?.collect::<Result<_, _>>()?;
        names.sort_by_key(|e| e.file_name());
        for e in names {
            let p = e.path();
            let rel = p.strip_prefix(root)?.to_string_lossy().into_owned();
            let md = std::fs::symlink_metadata(&p)?;
            let ft = md.file_type();
            let mut xattrs: Vec<String> = xattr::list(&p)?
                .map(|n| n.to_string_lossy().into_owned())
                .filter(|n| n.contains("overlay."))
                .map(|n| {
                    let v = xattr::get(&p, &n).ok().flatten().unwrap_or_default();
                    format!("{n}={}", String::from_utf8_lossy(&v))
                })
                .collect();
            xattrs.sort();
            let what = if ft.is_dir() {
                stack.push(p.clone());
                "dir".to_string()
            } else if ft.is_symlink() {
                format!("symlink -> {}", std::fs::read_link(&p)?.display())
            } else if ft.is_char_device() {
                format!("char {}:{}", libc::major(md.rdev()), libc::minor(md.rdev()))
            } else if ft.is_file() {
                format!("file {:?}", String::from_utf8_lossy(&std::fs::read(&p)?))
            } else {
                "other".to_string()
            };
            out.insert(
                rel,
                format!(
                    "{what} mode {:o} owner {}:{} xattrs [{}]",
                    md.mode() & 0o7777,
                    md.uid(),
                    md.gid(),
                    xattrs.join(", ")
                ),
            );
        }
    }
    Ok(out)
}

fn outcome_json(p: &Path) -> Result<Value> {
    Ok(serde_json::from_str(&std::fs::read_to_string(p)?)?)
}

#[test]
fn a_wasi_module_publishes_the_layer_a_linux_process_does() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = make_temp_dir()?;
    let Some(_) = require_wasi_toolchain(&dir)? else {
        return Ok(());
    };
    let mut d = Daemon::start_at(
        &dir.join("s/snapshotter.sock"),
        &dir.join("s/containerd.sock"),
        &dir.join("root"),
    )?;
    let r = (|| -> Result<()> {
        let src = dir.join("rootfs");
        rootfs(&src)?;
        let o = ensure_success(
            "base import",
            d.layerstack(&["base", "import", src.to_str().context("utf-8")?])?,
        )?;
        let stack = stdout(&o).trim().to_string();
        for b in ["modeb", "wasi"] {
            ensure_success(
                "branch create",
                d.layerstack(&["branch", "create", &format!("{stack}@{b}")])?,
            )?;
        }
        // Mode B: the operations as shell commands.
        let mb_outcome = dir.join("modeb.json");
        let o = d.layerstack(&[
            "session",
            "run",
            &format!("{stack}@modeb"),
            "--publish",
            "on-exit",
            "--net",
            "none",
            "--outcome",
            mb_outcome.to_str().context("utf-8")?,
            "--",
            "/bin/sh",
            "-c",
            &shell_script(),
        ])?;
        ensure!(
            o.status.success(),
            "Mode B run: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let mb = outcome_json(&mb_outcome)?;
        ensure!(mb["outcome"] == "committed", "{mb}");

        // WASI: the same operations as a module.
        let wasm = dir.join("fsops.wasm");
        let w_outcome = dir.join("wasi.json");
        let mut args = vec![
            "session".to_string(),
            "run".into(),
            "--wasi".into(),
            wasm.to_string_lossy().into_owned(),
            format!("{stack}@wasi"),
            "--publish".into(),
            "on-exit".into(),
            "--outcome".into(),
            w_outcome.to_string_lossy().into_owned(),
            "--".into(),
        ];
        args.extend(fsops_args());
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = d.layerstack(&argv)?;
        ensure!(
            o.status.success(),
            "WASI run: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let w = outcome_json(&w_outcome)?;
        ensure!(w["outcome"] == "committed" && w["exit_status"] == 0, "{w}");
        ensure!(w["owner_kind"] == "wasi", "{w}");
        let digest = w["wasi"]["module_digest"]
            .as_str()
            .context("module_digest")?
            .to_string();
        ensure!(digest.starts_with("sha256:") && digest.len() == 71, "{w}");
        ensure!(w["wasi"]["trap"] == "", "{w}");

        // The two published layers, entry by entry.
        let layer = |v: &Value| -> Result<PathBuf> {
            let id = v["layer"]
                .as_i64()
                .filter(|l| *l > 0)
                .context("no layer in the outcome")?;
            Ok(d.root().join("l").join(id.to_string()))
        };
        let (a, b) = (describe(&layer(&mb)?)?, describe(&layer(&w)?)?);
        for k in [
            "srv/gone.txt",
            "srv/old-name.txt",
            "srv/dir",
            "srv/opq",
            "srv/link",
        ] {
            ensure!(a.contains_key(k), "the Mode B layer lacks {k}: {a:#?}");
        }
        ensure!(
            a["srv/gone.txt"].starts_with("char 0:0"),
            "whiteout: {}",
            a["srv/gone.txt"]
        );
        ensure!(
            a["srv/opq"].contains("opaque=y"),
            "opaque: {}",
            a["srv/opq"]
        );
        if a != b {
            let keys: std::collections::BTreeSet<_> = a.keys().chain(b.keys()).collect();
            let diff: Vec<String> = keys
                .into_iter()
                .filter(|k| a.get(*k) != b.get(*k))
                .map(|k| format!("{k}: Mode B {:?} / WASI {:?}", a.get(k), b.get(k)))
                .collect();
            bail!("the layers differ:\n{}", diff.join("\n"));
        }

        // `session run --wasi MODULE STACK@wasi --publish PUBLISH [--outcome
        // F] -- ARGS…`, the arguments of the runs below.
        let target = format!("{stack}@wasi");
        let run_args =
            |module: &Path, publish: &str, outcome: Option<&Path>, args: &[&str]| -> Vec<String> {
                let mut v: Vec<String> = ["session", "run", "--wasi"].map(String::from).to_vec();
                v.push(module.to_string_lossy().into_owned());
                v.extend([target.clone(), "--publish".into(), publish.into()]);
                if let Some(f) = outcome {
                    v.extend(["--outcome".into(), f.to_string_lossy().into_owned()]);
                }
                if !args.is_empty() {
                    v.push("--".into());
                    v.extend(args.iter().map(|a| a.to_string()));
                }
                v
            };
        let run =
            |args: Vec<String>| d.layerstack(&args.iter().map(String::as_str).collect::<Vec<_>>());

        // A second run of the same module is served from the daemon's cache,
        // and a failing module's status is the run's.
        let w2 = dir.join("wasi2.json");
        let o = run(run_args(
            &wasm,
            "on-success",
            Some(&w2),
            &["write", "/srv/late.txt", "late\n", "exit", "7"],
        ))?;
        ensure!(
            o.status.code() == Some(7),
            "exit {:?}: {}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
        let w2 = outcome_json(&w2)?;
        ensure!(
            w2["outcome"] == "discarded"
                && w2["exit_status"] == 7
                && w2["wasi"]["module_compiled"] == false,
            "{w2}"
        );
        // Stdout reaches the caller's stdout.
        let o = run(run_args(&wasm, "never", None, &["cat", "/srv/new.txt"]))?;
        ensure!(o.status.success() && stdout(&o) == "hello\n", "{o:?}");
        // A closed stdout (`| head`) does not decide the run's end: its
        // writes publish by the module's exit, and the outcome says so.
        let (w, r_end) = std::os::unix::net::UnixStream::pair()?;
        drop(r_end);
        let w3 = dir.join("wasi3.json");
        let o = std::process::Command::new(bin_path(CLI_BIN)?)
            .arg("--admin-address")
            .arg(d.admin_socket())
            .args(run_args(
                &wasm,
                "on-success",
                Some(&w3),
                &["write", "/srv/piped.txt", "piped\n", "cat", "/srv/new.txt"],
            ))
            .stdout(std::process::Stdio::from(std::os::fd::OwnedFd::from(w)))
            .stderr(std::process::Stdio::piped())
            .output()?;
        let w3 = outcome_json(&w3)?;
        ensure!(
            o.status.success() && w3["outcome"] == "committed" && w3["exit_status"] == 0,
            "exit {:?}: {} / {w3}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
        // A module over the 64 MiB a run takes is refused before a session
        // is made for it, and a device is not read whole (it would never
        // end): no session is left behind.
        let big = dir.join("big.wasm");
        fs::write(&big, vec![0u8; (api::MAX_WASI_MODULE_BYTES + 1) as usize])?;
        let before = d.layerstack(&["session", "ls", "-A", "--json"])?;
        for module in [big.as_path(), Path::new("/dev/zero")] {
            let o = run(run_args(module, "never", None, &[]))?;
            ensure!(
                !o.status.success()
                    && String::from_utf8_lossy(&o.stderr).contains("more than 67108864"),
                "{}: {o:?}",
                module.display()
            );
        }
        let after = d.layerstack(&["session", "ls", "-A", "--json"])?;
        ensure!(
            stdout(&before) == stdout(&after),
            "a refused module left a session: {}",
            stdout(&after)
        );
        Ok(())
    })();
    if r.is_err() {
        d.dump_log();
    }
    d.stop();
    if std::env::var_os("LAYERSTACK_TEST_KEEP").is_none() {
        remove_tree(&dir);
    }
    r
}

async fn create(
    c: &mut Client,
    stack: &str,
    name: &str,
    wasi: api::WasiOptions,
) -> Result<i64, tonic::Status> {
    let r = c
        .create_session(api::CreateSessionRequest {
            stack: stack.into(),
            name: name.into(),
            wasi: Some(wasi),
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(r.session.map(|s| s.id).unwrap_or_default())
}

#[derive(Debug, Default)]
struct Ran {
    out: Vec<u8>,
    err: Vec<u8>,
    exit: api::ExecExit,
}

async fn run(c: &mut Client, r: api::ExecRequest) -> Result<Ran, tonic::Status> {
    let mut s = c.exec(r).await?.into_inner();
    let mut ran = Ran::default();
    while let Some(m) = s.message().await? {
        match m.kind {
            Some(api::exec_reply::Kind::Stdout(b)) => ran.out.extend(b),
            Some(api::exec_reply::Kind::Stderr(b)) => ran.err.extend(b),
            Some(api::exec_reply::Kind::Exit(x)) => ran.exit = x,
            None => {}
        }
    }
    Ok(ran)
}

fn ops(module: &[u8], id: i64, args: &[&str]) -> api::ExecRequest {
    let mut argv = vec!["fsops".to_string()];
    argv.extend(args.iter().map(|s| s.to_string()));
    api::ExecRequest {
        session_id: id,
        argv,
        module: module.to_vec(),
        ..Default::default()
    }
}

async fn close(c: &mut Client, id: i64, action: api::EndAction) -> Result<api::Session> {
    Ok(c.close_session(api::CloseSessionRequest {
        session_id: id,
        action: action as i32,
        ..Default::default()
    })
    .await?
    .into_inner())
}

async fn grpc_scenario(dir: &Path, d: &Daemon, module: Vec<u8>) -> Result<()> {
    let src = dir.join("rootfs");
    rootfs(&src)?;
    let o = ensure_success(
        "base import",
        d.layerstack(&["base", "import", src.to_str().context("utf-8")?])?,
    )?;
    let stack = stdout(&o).trim().to_string();
    let mut c = api::connect(d.admin_socket()).await?;
    let opts = api::WasiOptions {
        env: vec!["GREETING=hi".into()],
        ..Default::default()
    };

    // The gate, unchanged: disjoint writes both commit...
    let a = create(&mut c, &stack, "a", opts.clone()).await?;
    let b = create(&mut c, &stack, "b", opts.clone()).await?;
    for (id, f) in [(a, "/srv/a.txt"), (b, "/srv/b.txt")] {
        let r = run(&mut c, ops(&module, id, &["write", f, "mine\n"])).await?;
        ensure!(r.exit.code == 0, "{r:?}");
    }
    let (sa, sb) = (
        close(&mut c, a, api::EndAction::Publish).await?,
        close(&mut c, b, api::EndAction::Publish).await?,
    );
    ensure!(
        sa.outcome == "committed" && sb.outcome == "committed",
        "{sa:?} {sb:?}"
    );
    ensure!(sa.owner_kind == "wasi" && sa.owner == "wasi:a", "{sa:?}");
    // ... overlapping text edits merge ...
    let lines = |edit: usize, with: &str| -> String {
        (1..=10)
            .map(|i| {
                if i == edit {
                    format!("{with}\n")
                } else {
                    format!("line {i}\n")
                }
            })
            .collect()
    };
    let a = create(&mut c, &stack, "a", opts.clone()).await?;
    let b = create(&mut c, &stack, "b", opts.clone()).await?;
    run(
        &mut c,
        ops(
            &module,
            a,
            &["write", "/srv/text.txt", &lines(2, "two by a")],
        ),
    )
    .await?;
    run(
        &mut c,
        ops(
            &module,
            b,
            &["write", "/srv/text.txt", &lines(9, "nine by b")],
        ),
    )
    .await?;
    let (sa, sb) = (
        close(&mut c, a, api::EndAction::Publish).await?,
        close(&mut c, b, api::EndAction::Publish).await?,
    );
    ensure!(
        sa.outcome == "committed" && sb.outcome == "merged",
        "{sa:?} {sb:?}"
    );
    // ... a true conflict is refused whole (and its other write with it).
    let a = create(&mut c, &stack, "a", opts.clone()).await?;
    let b = create(&mut c, &stack, "b", opts.clone()).await?;
    run(
        &mut c,
        ops(
            &module,
            a,
            &["write", "/srv/text.txt", &lines(5, "five by a")],
        ),
    )
    .await?;
    run(
        &mut c,
        ops(
            &module,
            b,
            &[
                "write",
                "/srv/text.txt",
                &lines(5, "five by b"),
                "write",
                "/srv/b2.txt",
                "x\n",
            ],
        ),
    )
    .await?;
    let (sa, sb) = (
        close(&mut c, a, api::EndAction::Publish).await?,
        close(&mut c, b, api::EndAction::Publish).await?,
    );
    ensure!(
        sa.outcome == "committed" && sb.outcome == "conflict",
        "{sa:?} {sb:?}"
    );
    ensure!(
        sb.conflicts.iter().any(|p| p.path == "/srv/text.txt"),
        "{sb:?}"
    );
    close(&mut c, b, api::EndAction::Discard).await?;

    // One session: env, stdin-free output, the file RPCs, modules by digest
    // and by path in the tree, the limits.
    let id = create(&mut c, &stack, "one", opts.clone()).await?;
    let r = run(&mut c, ops(&module, id, &["cat", "/etc/passwd"])).await?;
    ensure!(r.out == b"session-passwd\n" && r.exit.code == 0, "{r:?}");
    let digest = r.exit.module_digest.clone();
    ensure!(digest.starts_with("sha256:"), "{r:?}");
    // By digest: no bytes sent, nothing compiled.
    let r = run(
        &mut c,
        api::ExecRequest {
            session_id: id,
            argv: vec![digest.clone(), "cat".into(), "/srv/edit.txt".into()],
            ..Default::default()
        },
    )
    .await?;
    ensure!(r.out == b"v1\n" && !r.exit.module_compiled, "{r:?}");
    // By path in the tree, after WriteFile put it there.
    let mut msgs = vec![api::WriteFileRequest {
        header: Some(api::WriteFileHeader {
            session_id: id,
            path: "/bin/fsops.wasm".into(),
            mode: 0o755,
            ..Default::default()
        }),
        data: Vec::new(),
    }];
    msgs.extend(module.chunks(60_000).map(|ch| api::WriteFileRequest {
        header: None,
        data: ch.to_vec(),
    }));
    c.write_file(tokio_stream::iter(msgs)).await?;
    let r = run(
        &mut c,
        api::ExecRequest {
            session_id: id,
            argv: vec![
                "/bin/fsops.wasm".into(),
                "write".into(),
                "/srv/from-path".into(),
                "p\n".into(),
            ],
            ..Default::default()
        },
    )
    .await?;
    ensure!(r.exit.code == 0, "{r:?}");
    let mut s = c
        .read_file(api::ReadFileRequest {
            session_id: id,
            path: "/srv/from-path".into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut got = Vec::new();
    while let Some(m) = s.message().await? {
        got.extend(m.data);
    }
    ensure!(got == b"p\n", "{got:?}");
    let missing = run(
        &mut c,
        api::ExecRequest {
            session_id: id,
            argv: vec!["/bin/none.wasm".into()],
            ..Default::default()
        },
    )
    .await;
    ensure!(
        matches!(&missing, Err(st) if st.code() == tonic::Code::NotFound),
        "{missing:?}"
    );
    let bad = run(
        &mut c,
        api::ExecRequest {
            session_id: id,
            argv: vec!["x".into()],
            module: b"not wasm".to_vec(),
            ..Default::default()
        },
    )
    .await;
    ensure!(
        matches!(&bad, Err(st) if st.code() == tonic::Code::InvalidArgument && st.message().contains("does not compile")),
        "{bad:?}"
    );

    // Limits: a deadline, fuel, memory; each a trap as a field.
    let t0 = Instant::now();
    let r = run(
        &mut c,
        api::ExecRequest {
            timeout_ms: 300,
            ..ops(&module, id, &["spin"])
        },
    )
    .await?;
    ensure!(
        r.exit.trap == "deadline"
            && r.exit.timed_out
            && r.exit.code == 134
            && t0.elapsed() < Duration::from_secs(10),
        "{r:?}"
    );
    // Also while the module waits in a host call (a 30 s sleep).
    let t0 = Instant::now();
    let r = run(
        &mut c,
        api::ExecRequest {
            timeout_ms: 300,
            ..ops(&module, id, &["sleep", "30000"])
        },
    )
    .await?;
    ensure!(
        r.exit.trap == "deadline" && t0.elapsed() < Duration::from_secs(10),
        "a sleeping module outlived its deadline: {r:?} after {:?}",
        t0.elapsed()
    );
    let small = create(
        &mut c,
        &stack,
        "small",
        api::WasiOptions {
            fuel: 5_000_000,
            ..Default::default()
        },
    )
    .await?;
    let r = run(&mut c, ops(&module, small, &["spin"])).await?;
    ensure!(
        r.exit.trap == "out_of_fuel" && r.exit.fuel_used == 5_000_000 && r.exit.code == 134,
        "{r:?}"
    );
    close(&mut c, small, api::EndAction::Discard).await?;
    let capped = create(
        &mut c,
        &stack,
        "capped",
        api::WasiOptions {
            memory_bytes: 16 << 20,
            output_bytes: 8,
            ..Default::default()
        },
    )
    .await?;
    let r = run(&mut c, ops(&module, capped, &["cat", "/etc/passwd"])).await?;
    ensure!(
        r.out == b"session-" && r.exit.stdout_truncated && !r.exit.stderr_truncated,
        "output past its bound: {r:?}"
    );
    let r = run(&mut c, ops(&module, capped, &["hog"])).await?;
    ensure!(r.exit.trap == "memory_limit" && r.exit.code == 134, "{r:?}");
    close(&mut c, capped, api::EndAction::Discard).await?;

    // Nothing outside the session: `..` stops at its root, an absolute
    // symlink resolves inside it or not at all, nothing is created on the host.
    let marker = format!("ls-wasi-escape-{}", std::process::id());
    let host_file = PathBuf::from("/tmp").join(&marker);
    let up = format!("../../../../../../tmp/{marker}");
    let r = run(
        &mut c,
        ops(
            &module,
            id,
            &[
                "try-read",
                "../../../../../etc/shadow",
                "try-write",
                &up,
                "try-read",
                "/srv/abs-link",
            ],
        ),
    )
    .await?;
    ensure!(r.exit.code == 0, "a module reached outside its tree: {r:?}");
    // A module cannot make an absolute symlink (WASI refuses them).
    let r = run(
        &mut c,
        ops(&module, id, &["symlink", "/etc/shadow", "/srv/evil"]),
    )
    .await?;
    ensure!(
        r.exit.code == 1 && r.err.starts_with(b"fsops: symlink"),
        "{r:?}"
    );
    ensure!(
        !host_file.exists(),
        "{} was created on the host",
        host_file.display()
    );

    // More runs at once than tokio has blocking threads (512), each holding
    // its thread 300 ms, then doing file I/O: they take turns (snapshotter wasi::RUNS_AT_ONCE) instead of
    // starving each other's file calls (a deadlock before the turns).
    let t0 = Instant::now();
    let mut runs = Vec::new();
    for i in 0..600 {
        let mut ci = c.clone();
        let req = api::ExecRequest {
            session_id: id,
            argv: vec![
                digest.clone(),
                "sleep".into(),
                "300".into(),
                "write".into(),
                format!("/srv/many-{i}"),
                format!("{i}\n"),
            ],
            ..Default::default()
        };
        runs.push(tokio::spawn(async move { run(&mut ci, req).await }));
    }
    for (i, h) in runs.into_iter().enumerate() {
        let r = tokio::time::timeout(Duration::from_secs(120), h)
            .await
            .with_context(|| format!("run {i} of 600 did not end within 120 s (deadlock?)"))???;
        ensure!(r.exit.code == 0, "run {i}: {r:?}");
    }
    eprintln!(
        "wasi: 600 concurrent runs with file I/O in {:?}",
        t0.elapsed()
    );
    let listed = c
        .list_dir(api::ListDirRequest {
            session_id: id,
            path: "/srv".into(),
        })
        .await?
        .into_inner();
    let many = listed
        .entries
        .iter()
        .filter(|e| e.name.starts_with("many-"))
        .count();
    ensure!(many == 600, "{many} of 600 files written");

    // A close cancels a running module.
    // (a module waiting in a host call: the close does not wait for it)
    let spin = ops(&module, id, &["sleep", "30000"]);
    let mut c2 = c.clone();
    let running = tokio::spawn(async move { run(&mut c2, spin).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let listed = c
        .list_sessions(api::ListSessionsRequest {
            owner_kind: "wasi".into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(
        listed
            .sessions
            .iter()
            .any(|s| s.id == id && s.owner_kind == "wasi"),
        "{listed:?}"
    );
    let t_close = Instant::now();
    let closed = close(&mut c, id, api::EndAction::Discard).await?;
    ensure!(
        closed.outcome == "discarded" && closed.released,
        "{closed:?}"
    );
    ensure!(
        t_close.elapsed() < Duration::from_secs(5),
        "the close waited {:?} for a sleeping module",
        t_close.elapsed()
    );
    let r = running.await??;
    ensure!(r.exit.trap == "cancelled", "{r:?}");
    let after = run(&mut c, ops(&module, id, &["cat", "/etc/passwd"])).await;
    ensure!(
        matches!(&after, Err(st) if st.code() == tonic::Code::FailedPrecondition),
        "{after:?}"
    );
    ensure!(
        !d.root().join("s").join(id.to_string()).exists(),
        "the discarded session's directories stay"
    );
    Ok(())
}

#[test]
fn wasi_sessions_share_the_gate_and_keep_to_their_tree() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = make_temp_dir()?;
    let Some(module) = require_wasi_toolchain(&dir)? else {
        return Ok(());
    };
    let mut d = Daemon::start_at(
        &dir.join("s/snapshotter.sock"),
        &dir.join("s/containerd.sock"),
        &dir.join("root"),
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let r = rt.block_on(grpc_scenario(&dir, &d, module));
    if r.is_err() {
        d.dump_log();
    }
    d.stop();
    if std::env::var_os("LAYERSTACK_TEST_KEEP").is_none() {
        remove_tree(&dir);
    }
    r
}

/// A WASI session lives in its daemon: after `kill -9` of the daemon the
/// restarted one ends it `interrupted` (`daemon-restart`), never by its exit
/// policy — nothing published — and keeps its writes until discarded.
async fn restart_scenario(dir: &Path, daemon: &mut Option<Daemon>, module: Vec<u8>) -> Result<()> {
    let src = dir.join("rootfs");
    rootfs(&src)?;
    let d = daemon.as_ref().context("daemon")?;
    let o = ensure_success(
        "base import",
        d.layerstack(&["base", "import", src.to_str().context("utf-8")?])?,
    )?;
    let stack = stdout(&o).trim().to_string();
    let admin = d.admin_socket().to_path_buf();
    let mut c = api::connect(&admin).await?;
    let r = c
        .create_session(api::CreateSessionRequest {
            stack: stack.clone(),
            name: "doomed".into(),
            policy: "on-exit".into(),
            idempotency_key: "wasi-restart".into(),
            wasi: Some(api::WasiOptions::default()),
            ..Default::default()
        })
        .await?
        .into_inner();
    let id = r.session.context("session")?.id;
    // A WASI session's mounts are not handed out (the daemon alone mounts
    // its overlay): the upper is where the store keeps a session's.
    ensure!(
        r.mounts.is_empty(),
        "a WASI session's mounts were handed out: {:?}",
        r.mounts
    );
    let upper = d.root().join("s").join(id.to_string()).join("upper");
    ensure!(upper.is_dir(), "no upper at {}", upper.display());
    let w = run(
        &mut c,
        ops(&module, id, &["write", "/srv/half-done", "1\n"]),
    )
    .await?;
    ensure!(w.exit.code == 0, "{w:?}");
    drop(c);
    let pid = d.pid().context("daemon pid")?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::SIGKILL,
    )?;
    let (root_dir, sock) = (d.root().to_path_buf(), d.socket().to_path_buf());
    daemon.take().context("daemon")?.stop();
    *daemon = Some(Daemon::start_at(
        &sock,
        &dir.join("s/containerd.sock"),
        &root_dir,
    )?);
    let mut c = api::connect(&admin).await?;
    let s = c
        .wait(api::WaitRequest {
            session_id: id,
            timeout_ms: 10_000,
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(
        s.outcome == "interrupted" && s.interrupted_by == "daemon-restart" && s.layer == 0,
        "after the restart: {s:?}"
    );
    ensure!(
        upper.join("srv/half-done").exists(),
        "the interrupted run's writes are gone"
    );
    // The same key answers the recorded end; Exec finds nothing live.
    let again = c
        .create_session(api::CreateSessionRequest {
            stack,
            name: "doomed".into(),
            policy: "on-exit".into(),
            idempotency_key: "wasi-restart".into(),
            wasi: Some(api::WasiOptions::default()),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(
        !again.created
            && again
                .session
                .as_ref()
                .is_some_and(|s| s.id == id && s.released),
        "{again:?}"
    );
    let x = run(&mut c, ops(&module, id, &["cat", "/srv/half-done"])).await;
    ensure!(
        matches!(&x, Err(st) if st.code() == tonic::Code::FailedPrecondition),
        "{x:?}"
    );
    // Discarded on request: its directories go.
    c.publish(api::PublishRequest {
        session_id: id,
        action: api::EndAction::Discard as i32,
        ..Default::default()
    })
    .await?;
    ensure!(
        !upper.exists(),
        "{} stays after the discard",
        upper.display()
    );
    Ok(())
}

#[test]
fn a_daemon_kill_interrupts_a_wasi_session_and_publishes_nothing() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = make_temp_dir()?;
    let Some(module) = require_wasi_toolchain(&dir)? else {
        return Ok(());
    };
    let mut daemon = Some(Daemon::start_at(
        &dir.join("s/snapshotter.sock"),
        &dir.join("s/containerd.sock"),
        &dir.join("root"),
    )?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let r = rt.block_on(restart_scenario(&dir, &mut daemon, module));
    if r.is_err() {
        if let Some(d) = &daemon {
            d.dump_log();
        }
    }
    if let Some(mut d) = daemon.take() {
        d.stop();
    }
    if std::env::var_os("LAYERSTACK_TEST_KEEP").is_none() {
        remove_tree(&dir);
    }
    r
}

/// The sessions `Status` counts as live (sandbox and WASI, ready ones
/// included), once it equals `want` (at most 10 s).
async fn live_sessions_reach(c: &mut Client, want: u64) -> Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let s = c.status(api::StatusRequest::default()).await?.into_inner();
        if s.sandbox_sessions == want {
            return Ok(());
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "live sessions stay {} (want {want})",
            s.sandbox_sessions
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Ready sessions (`[sandbox] wasi_ready`): made ahead, claimed by a create,
/// never handed out once their branch moved, not listed, and yielding their
/// slot to a request the cap would refuse.
async fn ready_scenario(dir: &Path, d: &Daemon, module: Vec<u8>) -> Result<()> {
    let src = dir.join("rootfs");
    rootfs(&src)?;
    let o = ensure_success(
        "base import",
        d.layerstack(&["base", "import", src.to_str().context("utf-8")?])?,
    )?;
    let stack = stdout(&o).trim().to_string();
    let mut c = api::connect(d.admin_socket()).await?;
    let claimed = |id: i64| -> Result<bool> {
        let log = fs::read_to_string(d.log_path())?;
        Ok(log.lines().any(|l| {
            l.contains("WASI session claimed") && l.contains(&format!("session.id={id} "))
        }))
    };

    // The first session of the branch is made now; two are made ahead.
    let a = create(&mut c, &stack, "a", Default::default()).await?;
    ensure!(
        !claimed(a)?,
        "session {a} was claimed before any was made ahead"
    );
    close(&mut c, a, api::EndAction::Discard).await?;
    live_sessions_reach(&mut c, 2).await?;
    // Not listed: they are the daemon's, not a caller's.
    let listed = c
        .list_sessions(api::ListSessionsRequest {
            all_namespaces: true,
            owner_kind: "wasi".into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .sessions;
    ensure!(
        listed.iter().all(|s| s.owner != "wasi:(ready)"),
        "ready sessions are listed: {listed:?}"
    );
    // Their name is the daemon's: a caller's session of that name would be
    // handed to the next request.
    let reserved = create(
        &mut c,
        &stack,
        layerstack_store::READY_OWNER,
        Default::default(),
    )
    .await
    .expect_err("a session named like the ready ones");
    ensure!(
        reserved.code() == tonic::Code::InvalidArgument && reserved.message().contains("reserved"),
        "{reserved:?}"
    );

    // The next create claims one: the caller's name, the branch's head.
    let b = create(&mut c, &stack, "b", Default::default()).await?;
    ensure!(
        claimed(b)?,
        "session {b} was made, not claimed from the ready ones"
    );
    let w = run(&mut c, ops(&module, b, &["write", "/srv/after-b", "b\n"])).await?;
    ensure!(w.exit.code == 0, "{w:?}");
    let sb = close(&mut c, b, api::EndAction::Publish).await?;
    ensure!(sb.outcome == "committed" && sb.owner == "wasi:b", "{sb:?}");

    // The branch moved: the sessions made before are stale and never handed
    // out; the next session sees b's file.
    let e = create(&mut c, &stack, "e", Default::default()).await?;
    let r = run(&mut c, ops(&module, e, &["cat", "/srv/after-b"])).await?;
    ensure!(
        r.exit.code == 0 && r.out == b"b\n",
        "session {e} after b's publish does not see it: {r:?}"
    );
    close(&mut c, e, api::EndAction::Discard).await?;
    live_sessions_reach(&mut c, 2).await?;

    // The cap is 3 (the daemon's config): two ready sessions hold two slots;
    // requests that bypass them (a memory limit other than the default) still
    // get all three slots, the ready ones giving theirs up.
    let limited = api::WasiOptions {
        memory_bytes: 1 << 20,
        ..Default::default()
    };
    let mut own = Vec::new();
    for i in 0..3 {
        let id = create(&mut c, &stack, &format!("capped-{i}"), limited.clone())
            .await
            .with_context(|| format!("create {i} under the cap"))?;
        ensure!(
            !claimed(id)?,
            "a session with its own limits was claimed: {id}"
        );
        own.push(id);
    }
    // A live WASI session is ended only by CloseSession.
    let refused = c
        .publish(api::PublishRequest {
            session_id: own[0],
            action: api::EndAction::Publish as i32,
            ..Default::default()
        })
        .await
        .expect_err("Publish of a live WASI session");
    ensure!(
        refused.code() == tonic::Code::FailedPrecondition
            && refused.message().contains("live WASI session"),
        "{refused:?}"
    );
    for id in own {
        close(&mut c, id, api::EndAction::Discard).await?;
    }
    // Ready sessions again, for the restart after this scenario.
    let z = create(&mut c, &stack, "z", Default::default()).await?;
    close(&mut c, z, api::EndAction::Discard).await?;
    live_sessions_reach(&mut c, 2).await?;
    Ok(())
}

#[test]
fn ready_wasi_sessions_are_claimed_and_never_stale() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = make_temp_dir()?;
    let Some(module) = require_wasi_toolchain(&dir)? else {
        return Ok(());
    };
    let config = dir.join("layerstack.toml");
    fs::write(&config, "[sandbox]\nmax_sessions = 3\nwasi_ready = 2\n")?;
    let mut d = Daemon::start_at_with(
        &dir.join("s/snapshotter.sock"),
        &dir.join("s/containerd.sock"),
        &dir.join("root"),
        &["--config", config.to_str().context("utf-8")?],
        true,
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut r = rt.block_on(ready_scenario(&dir, &d, module));
    if r.is_ok() {
        r = (|| -> Result<()> {
            // A kill -9 leaves the ready sessions behind (no list shows them):
            // the next start discards them, their directories included.
            let sessions = dir.join("root/s");
            let dirs = || -> Result<Vec<String>> {
                let mut v: Vec<String> = fs::read_dir(&sessions)?
                    .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
                    .collect::<std::io::Result<_>>()?;
                v.sort();
                Ok(v)
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            while dirs()?.is_empty() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let before = dirs()?;
            ensure!(!before.is_empty(), "no ready session to leave behind");
            d.kill()?;
            d = Daemon::start_at_with(
                &dir.join("s/snapshotter.sock"),
                &dir.join("s/containerd.sock"),
                &dir.join("root"),
                &["--config", config.to_str().context("utf-8")?],
                true,
            )?;
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let left: Vec<String> =
                    dirs()?.into_iter().filter(|x| before.contains(x)).collect();
                if left.is_empty() {
                    return Ok(());
                }
                ensure!(
                    Instant::now() < deadline,
                    "the last daemon's ready sessions {left:?} kept their directories after a restart"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        })();
    }
    if r.is_err() {
        d.dump_log();
    }
    d.stop();
    if std::env::var_os("LAYERSTACK_TEST_KEEP").is_none() {
        remove_tree(&dir);
    }
    r
}

// ---------------------------------------------------------------------------
// The session file calls, fuzzed (issue 22): hostile paths — `..`, absolute
// and escaping symlinks, loops, a FIFO, NUL and control characters, names
// past NAME_MAX — sent to ReadFile, WriteFile, ListDir, StatPath, RemovePath
// and DownloadTar of a live WASI session. Each call answers or is refused
// with a status that names the input (never INTERNAL, UNKNOWN or a dead
// daemon), and nothing outside the session's tree is read or written: a
// host directory an absolute symlink of the tree names stays as it was, and
// no file named after this test's marker appears on the host.

/// The file calls, with their arguments.
#[derive(Debug, Clone)]
enum FileOp {
    Read {
        path: String,
        offset: u64,
        limit: u64,
    },
    Write {
        path: String,
        data: Vec<u8>,
        mode: u32,
        parents: bool,
    },
    List {
        path: String,
    },
    Stat {
        path: String,
    },
    Remove {
        path: String,
        recursive: bool,
    },
    Download {
        path: String,
    },
}

/// A hostile path: pieces of the tree, traversal, and names that trip
/// parsers, with or without a leading `/`.
fn hostile_path(marker: &'static str) -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    let piece = prop_oneof![
        6 => prop::sample::select(vec![
            "srv", "a", "dir", "b", "out", "up", "loop", "rel", "fifo", "etc", "passwd", "new",
        ])
        .prop_map(String::from),
        4 => prop::sample::select(vec![
            "..", ".", "", "proc", "self", "fd", "root", "tmp", "\n", "\u{0}", "\u{7f}", "sp ace",
            "é", "\u{202e}", "*", "~", "\\", "%2e%2e",
        ])
        .prop_map(String::from),
        2 => Just(marker.to_string()),
        1 => (250usize..300).prop_map(|n| "n".repeat(n)),
    ];
    (
        any::<bool>(),
        prop::collection::vec(piece, 0..6),
        any::<bool>(),
    )
        .prop_map(|(abs, parts, double)| {
            let sep = if double { "//" } else { "/" };
            let body = parts.join(sep);
            if abs {
                format!("/{body}")
            } else {
                body
            }
        })
}

fn file_op(marker: &'static str) -> impl proptest::strategy::Strategy<Value = FileOp> {
    use proptest::prelude::*;
    let p = move || hostile_path(marker);
    prop_oneof![
        (p(), 0u64..8, 0u64..8).prop_map(|(path, offset, limit)| FileOp::Read {
            path,
            offset,
            limit
        }),
        (
            p(),
            prop::collection::vec(any::<u8>(), 0..64),
            prop::sample::select(vec![0o644u32, 0o777, 0o4755, 0]),
            any::<bool>()
        )
            .prop_map(|(path, data, mode, parents)| FileOp::Write {
                path,
                data,
                mode,
                parents
            }),
        p().prop_map(|path| FileOp::List { path }),
        p().prop_map(|path| FileOp::Stat { path }),
        (p(), any::<bool>()).prop_map(|(path, recursive)| FileOp::Remove { path, recursive }),
        p().prop_map(|path| FileOp::Download { path }),
    ]
}

/// A status a hostile request may get: a refusal of the input, never the
/// daemon's own failure.
fn refusal_ok(s: &tonic::Status) -> bool {
    use tonic::Code::*;
    matches!(
        s.code(),
        NotFound
            | InvalidArgument
            | FailedPrecondition
            | AlreadyExists
            | PermissionDenied
            | OutOfRange
    ) && !s.message().is_empty()
}

async fn file_call(c: &mut Client, id: i64, op: &FileOp) -> Result<(), tonic::Status> {
    match op.clone() {
        FileOp::Read {
            path,
            offset,
            limit,
        } => {
            let mut s = c
                .read_file(api::ReadFileRequest {
                    session_id: id,
                    path,
                    offset,
                    limit,
                })
                .await?
                .into_inner();
            while s.message().await?.is_some() {}
        }
        FileOp::Write {
            path,
            data,
            mode,
            parents,
        } => {
            let msgs = vec![api::WriteFileRequest {
                header: Some(api::WriteFileHeader {
                    session_id: id,
                    path,
                    mode,
                    make_parents: parents,
                    ..Default::default()
                }),
                data,
            }];
            c.write_file(tokio_stream::iter(msgs)).await?;
        }
        FileOp::List { path } => {
            c.list_dir(api::ListDirRequest {
                session_id: id,
                path,
            })
            .await?;
        }
        FileOp::Stat { path } => {
            c.stat_path(api::StatPathRequest {
                session_id: id,
                path,
            })
            .await?;
        }
        FileOp::Remove { path, recursive } => {
            c.remove_path(api::RemovePathRequest {
                session_id: id,
                path,
                recursive,
            })
            .await?;
        }
        FileOp::Download { path } => {
            let mut s = c
                .download_tar(api::DownloadTarRequest {
                    session_id: id,
                    path,
                })
                .await?
                .into_inner();
            while s.message().await?.is_some() {}
        }
    }
    Ok(())
}

/// Every file under `dir` with its content (symlinks by target), sorted.
fn tree_of(dir: &Path) -> Result<BTreeMap<String, Vec<u8>>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in fs::read_dir(&d)? {
            let e = e?;
            let p = e.path();
            let name = p.strip_prefix(dir)?.to_string_lossy().into_owned();
            let t = e.file_type()?;
            if t.is_symlink() {
                out.insert(
                    name,
                    fs::read_link(&p)?.into_os_string().into_encoded_bytes(),
                );
            } else if t.is_dir() {
                out.insert(name, b"<dir>".to_vec());
                todo.push(p);
            } else {
                out.insert(name, fs::read(&p)?);
            }
        }
    }
    Ok(out)
}

/// What the fuzzed session runs on: a WASI session (its tree is the daemon's
/// view of the layers) or a Linux sandbox (Mode B: an init in its own
/// namespaces, whose root the file calls resolve through).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Executor {
    Wasi,
    Linux,
}

/// Fuzzes the file calls of one session of each executor, then records the
/// guarantee with the sum of both runs' figures.
async fn file_fuzz_scenario(dir: &Path, d: &Daemon) -> Result<()> {
    let mut calls = 0;
    let mut refused = 0;
    let mut per = Vec::new();
    for ex in [Executor::Wasi, Executor::Linux] {
        let (c, r) = file_fuzz_session(&dir.join(format!("{ex:?}")), d, ex)
            .await
            .with_context(|| format!("the {ex:?} session"))?;
        calls += c;
        refused += r;
        per.push((ex, c, r));
    }
    layerstack_store::reliability::record(
        "fuzz-session-files",
        "Hostile paths in the session file calls (ReadFile, WriteFile, ListDir, StatPath, RemovePath, DownloadTar of a live WASI session and of a live Linux sandbox, whose calls resolve through its init's root: `..`, absolute and escaping symlinks, a symlink loop, a FIFO, NUL and control characters, names past NAME_MAX) are answered or refused naming the input, never with an internal error; nothing outside the session's tree is read or written (a host directory an absolute symlink of the tree names is unchanged, no marker file appears on the host); the session then publishes and fsck is clean.",
        "CI=true cargo test -p layerstack-integration --test wasi session_file_calls",
        &[
            ("calls", calls.into()),
            ("refused", refused.into()),
            ("wasi_calls", per[0].1.into()),
            ("linux_sandbox_calls", per[1].1.into()),
            ("bugs found by earlier runs (kept as regression cases)", 0u64.into()),
        ],
    )?;
    Ok(())
}

/// One fuzzed session of executor `ex` under `dir`: (calls, refused).
async fn file_fuzz_session(dir: &Path, d: &Daemon, ex: Executor) -> Result<(u64, u64)> {
    use proptest::test_runner::{Config, TestCaseError, TestRunner};
    // The host side: a directory the tree's absolute symlink names.
    let host = dir.join("host");
    fs::create_dir_all(host.join("sub"))?;
    fs::write(host.join("secret"), "host-secret\n")?;
    fs::write(host.join("sub/keep"), "keep\n")?;
    let host_before = tree_of(&host)?;
    let marker: &'static str =
        Box::leak(format!("lst-fuzz-escape-{}", std::process::id()).into_boxed_str());
    let src = dir.join("rootfs");
    fs::create_dir_all(src.join("srv/dir"))?;
    fs::create_dir_all(src.join("etc"))?;
    fs::write(src.join("srv/a"), "a\n")?;
    fs::write(src.join("srv/dir/b"), "b\n")?;
    fs::write(src.join("etc/passwd"), "session-passwd\n")?;
    std::os::unix::fs::symlink(&host, src.join("srv/out"))?;
    std::os::unix::fs::symlink("../../../../../../..", src.join("srv/up"))?;
    std::os::unix::fs::symlink("loop", src.join("srv/loop"))?;
    std::os::unix::fs::symlink("dir", src.join("srv/rel"))?;
    nix::unistd::mkfifo(
        &src.join("srv/fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o644),
    )?;
    if ex == Executor::Linux {
        // The sandbox's init: busybox's sh sleeping.
        busybox_tree(&src, &["sh", "sleep"], &["tmp"])?;
    }
    let o = ensure_success(
        "base import",
        d.layerstack(&["base", "import", src.to_str().context("utf-8")?])?,
    )?;
    let stack = stdout(&o).trim().to_string();
    let mut c = api::connect(d.admin_socket()).await?;
    let id = match ex {
        Executor::Wasi => create(&mut c, &stack, "fuzz", Default::default()).await?,
        Executor::Linux => {
            c.create_session(api::CreateSessionRequest {
                stack: stack.clone(),
                name: "fuzz-linux".into(),
                sandbox: Some(Default::default()),
                ..Default::default()
            })
            .await?
            .into_inner()
            .session
            .context("the created sandbox's session")?
            .id
        }
    };
    let etc_passwd = fs::read("/etc/passwd")?;
    let escaped = |m: &str| -> Vec<PathBuf> {
        [
            PathBuf::from("/").join(m),
            PathBuf::from("/tmp").join(m),
            PathBuf::from("/var/tmp").join(m),
            PathBuf::from("/etc").join(m),
            host.join(m),
            dir.join(m),
        ]
        .into_iter()
        .filter(|p| p.symlink_metadata().is_ok())
        .collect()
    };

    let calls = std::cell::Cell::new(0u64);
    let refused = std::cell::Cell::new(0u64);
    let rt = tokio::runtime::Handle::current();
    let mut runner = TestRunner::new(Config {
        cases: std::env::var("LAYERSTACK_FUZZ_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(64),
        failure_persistence: None,
        ..Config::default()
    });
    let ops = proptest::collection::vec(file_op(marker), 1..8);
    let result = tokio::task::block_in_place(|| {
        runner.run(&ops, |ops| {
            for op in &ops {
                calls.set(calls.get() + 1);
                // A clone of the channel per call (the runner takes `Fn`).
                if let Err(s) = rt.block_on(file_call(&mut c.clone(), id, op)) {
                    refused.set(refused.get() + 1);
                    if !refusal_ok(&s) {
                        return Err(TestCaseError::fail(format!(
                            "{op:?} answered {:?}: {}",
                            s.code(),
                            s.message()
                        )));
                    }
                }
                let out = escaped(marker);
                if !out.is_empty() {
                    return Err(TestCaseError::fail(format!(
                        "{op:?} reached the host: {out:?}"
                    )));
                }
                let now = tree_of(&host).map_err(|e| TestCaseError::fail(e.to_string()))?;
                if now != host_before {
                    return Err(TestCaseError::fail(format!(
                        "{op:?} changed the host directory the tree's symlink names: {now:?}"
                    )));
                }
            }
            Ok(())
        })
    });
    if let Err(e) = result {
        bail!("session file calls: {e}");
    }
    ensure!(
        fs::read("/etc/passwd")? == etc_passwd,
        "the host's /etc/passwd changed"
    );
    ensure!(
        calls.get() > refused.get(),
        "every call was refused: the fuzzer tested nothing but refusals"
    );
    // The daemon is sound after it: the session closes and publishes (or is
    // refused by name), and fsck finds nothing wrong.
    let s = close(&mut c, id, api::EndAction::Publish).await?;
    ensure!(
        ["committed", "merged", "conflict", "failed"].contains(&s.outcome.as_str()),
        "{s:?}"
    );
    let f = d.layerstack(&["fsck"])?;
    ensure!(
        f.status.success(),
        "fsck after the fuzzed session: {}",
        String::from_utf8_lossy(&f.stdout)
    );
    eprintln!(
        "session file calls fuzzed ({ex:?}): {} calls, {} refused, outcome {}",
        calls.get(),
        refused.get(),
        s.outcome
    );
    Ok((calls.get(), refused.get()))
}

#[test]
fn session_file_calls_with_hostile_paths_stay_in_the_tree() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = make_temp_dir()?;
    let mut d = Daemon::start_at(
        &dir.join("s/snapshotter.sock"),
        &dir.join("s/containerd.sock"),
        &dir.join("root"),
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let r = rt.block_on(file_fuzz_scenario(&dir, &d));
    if r.is_err() {
        d.dump_log();
    }
    d.stop();
    if std::env::var_os("LAYERSTACK_TEST_KEEP").is_none() {
        remove_tree(&dir);
    }
    r
}
