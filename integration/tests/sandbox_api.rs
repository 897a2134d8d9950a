//! Daemon-owned sessions over gRPC (issue 20): a pure admin-API client (the
//! generated Rust client, no CLI, no holder) creates sessions the daemon owns
//! on a base imported without containerd (busybox as /bin/sh), runs commands
//! with streamed stdout/stderr, exit codes, signals and timeouts, reads and
//! writes files beneath the session's root (a symlink to /etc/passwd reads
//! the session's file, never the host's; `..` is refused), round-trips tars,
//! diffs the live session, checkpoints into a node with labels (its id comes
//! back as a field), discards leaving nothing mounted, and survives `kill -9`
//! of the daemon with 16 live sessions: after the restart each is ended
//! `interrupted` (`daemon-restart`; never by its policy: nothing published),
//! its attempt too, its upper kept until discarded, nothing stays mounted;
//! then, the daemon's process spawner killed, creates and execs fail at once
//! naming it while the live session's files and close still work.
//!
//! A second test runs sessions with limits (cgroups: memory, pids, CPU) and
//! shows a workspace-mode session cannot reach the daemon's sockets.
//!
//! Needs root (fails under `CI=true` without it), `/bin/busybox` (static);
//! no containerd. The limits test needs the cpu, memory and pids cgroup
//! controllers (cgroup v2, or v1 hierarchies at /sys/fs/cgroup/<name>) and
//! `/usr/bin/python3`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use layerstack_api as api;
use layerstack_integration::*;
use tonic::Code;

type Client = api::AdminClient<tonic::transport::Channel>;

fn rootfs(dir: &Path) -> Result<()> {
    busybox_tree(
        dir,
        &[
            "sh", "cat", "echo", "ls", "test", "sleep", "true", "ln", "id", "mkdir", "kill", "dd",
            "seq",
        ],
        &["etc", "srv", "tmp"],
    )?;
    std::fs::write(dir.join("etc/passwd"), "session-passwd\n")?;
    Ok(())
}

#[derive(Debug, Default)]
struct Ran {
    out: Vec<u8>,
    err: Vec<u8>,
    /// The order of the chunks: 'o' or 'e'.
    order: String,
    exit: api::ExecExit,
}

async fn exec_req(c: &mut Client, r: api::ExecRequest) -> Result<Ran> {
    let mut s = c.exec(r).await?.into_inner();
    let mut ran = Ran::default();
    let mut exit = None;
    while let Some(m) = s.message().await? {
        match m.kind {
            Some(api::exec_reply::Kind::Stdout(b)) => {
                ran.out.extend(b);
                ran.order.push('o');
            }
            Some(api::exec_reply::Kind::Stderr(b)) => {
                ran.err.extend(b);
                ran.order.push('e');
            }
            Some(api::exec_reply::Kind::Exit(x)) => exit = Some(x),
            None => bail!("an empty exec reply"),
        }
    }
    ran.exit = exit.context("no exit reply")?;
    Ok(ran)
}

async fn exec(c: &mut Client, id: i64, argv: &[&str]) -> Result<Ran> {
    exec_req(
        c,
        api::ExecRequest {
            session_id: id,
            argv: argv.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        },
    )
    .await
}

async fn read(c: &mut Client, id: i64, path: &str) -> Result<Vec<u8>, tonic::Status> {
    let mut s = c
        .read_file(api::ReadFileRequest {
            session_id: id,
            path: path.into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut v = Vec::new();
    while let Some(m) = s.message().await? {
        v.extend(m.data);
    }
    Ok(v)
}

/// `DownloadTar` of `path`: the whole tar.
async fn download(c: &mut Client, id: i64, path: &str) -> Result<Vec<u8>, tonic::Status> {
    let mut s = c
        .download_tar(api::DownloadTarRequest {
            session_id: id,
            path: path.into(),
        })
        .await?
        .into_inner();
    let mut v = Vec::new();
    while let Some(m) = s.message().await? {
        v.extend(m.data);
    }
    Ok(v)
}

async fn write(
    c: &mut Client,
    id: i64,
    path: &str,
    data: &[u8],
    parents: bool,
) -> Result<api::FileStat, tonic::Status> {
    let mut msgs = vec![api::WriteFileRequest {
        header: Some(api::WriteFileHeader {
            session_id: id,
            path: path.into(),
            mode: 0o640,
            make_parents: parents,
            ..Default::default()
        }),
        data: Vec::new(),
    }];
    for ch in data.chunks(3) {
        msgs.push(api::WriteFileRequest {
            header: None,
            data: ch.to_vec(),
        });
    }
    c.write_file(tokio_stream::iter(msgs))
        .await
        .map(|r| r.into_inner())
}

fn sandbox() -> Option<api::SandboxOptions> {
    Some(api::SandboxOptions {
        env: vec!["GREETING=hello".into()],
        ..Default::default()
    })
}

async fn create(c: &mut Client, stack: &str, name: &str) -> Result<(i64, PathBuf)> {
    let r = c
        .create_session(api::CreateSessionRequest {
            stack: stack.into(),
            name: name.into(),
            sandbox: sandbox(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let s = r.session.context("session")?;
    let upper = r
        .mounts
        .iter()
        .flat_map(|m| m.options.iter())
        .find_map(|o| o.strip_prefix("upperdir="))
        .context("no upperdir in the mounts")?;
    Ok((s.id, PathBuf::from(upper)))
}

fn mounted(upper: &Path) -> bool {
    let needle = format!("upperdir={}", upper.display());
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .contains(&needle)
        || mounts()
            .iter()
            .any(|m| m.option("upperdir").as_deref() == Some(&*upper.to_string_lossy()))
}

/// Whether `upper` is the upperdir of an overlay in any process's mount
/// namespace (every `/proc/<pid>/mountinfo`: a daemon-owned session's overlay
/// lives in its init's private namespace, not in ours).
fn code(r: Result<impl Sized, tonic::Status>) -> Code {
    match r {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

async fn scenario(dir: &Path, daemon: &mut Option<Daemon>) -> Result<()> {
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

    ready_inits(&mut c, d, &stack).await?;
    discard_waits_for_the_session(&mut c, &stack).await?;
    write_racing_discard(&mut c, &stack).await?;
    quick_publishes_keep_no_mountpoints(&mut c, &stack).await?;
    let (id, upper) = create(&mut c, &stack, "a").await?;
    ensure!(mounted(&upper) || !upper.as_os_str().is_empty());

    // A name the store does not know, on a daemon with no containerd to
    // resolve it: NOT_FOUND saying why (UNAVAILABLE would be retried).
    for typo in ["busybx", "sha256:0123", "import:sha256:0123"] {
        let r = c
            .create_session(api::CreateSessionRequest {
                stack: typo.into(),
                ..Default::default()
            })
            .await;
        match r {
            Err(e) if e.code() == Code::NotFound && e.message().contains("stack ls") => {}
            other => bail!("CreateSession on stack {typo:?}: {other:?}"),
        }
    }

    // Exec: output, env, exit codes, a signal, a timeout, stdin.
    let r = exec(&mut c, id, &["echo", "hi"]).await?;
    ensure!(
        r.out == b"hi\n" && r.exit.code == 0 && r.exit.signal == 0,
        "{r:?}"
    );
    let r = exec(&mut c, id, &["sh", "-c", "echo $GREETING; id -u"]).await?;
    ensure!(r.out == b"hello\n0\n", "{r:?}");
    let r = exec(
        &mut c,
        id,
        &[
            "sh",
            "-c",
            "echo out1; sleep 0.05; echo err1 >&2; sleep 0.05; echo out2; exit 3",
        ],
    )
    .await?;
    ensure!(
        r.out == b"out1\nout2\n" && r.err == b"err1\n" && r.exit.code == 3,
        "{r:?}"
    );
    ensure!(r.order == "oeo", "interleaved as written: {r:?}");
    // The sandbox's init shows none of the daemon's arguments (its store
    // and socket paths) to `ps` inside.
    let r = exec(&mut c, id, &["cat", "/proc/1/cmdline"]).await?;
    ensure!(
        r.exit.code == 0 && r.out == b"layerstack-sandbox\0",
        "init's command line in the sandbox: {:?}",
        String::from_utf8_lossy(&r.out)
    );
    // Nor the daemon's environment.
    let r = exec(&mut c, id, &["cat", "/proc/1/environ"]).await?;
    ensure!(
        r.exit.code == 0 && r.out.iter().all(|&b| b == 0),
        "init's environment in the sandbox: {:?}",
        String::from_utf8_lossy(&r.out)
    );
    let r = exec(&mut c, id, &["no-such-command"]).await?;
    ensure!(
        r.exit.code == 127
            && r.exit.start_failed
            && String::from_utf8_lossy(&r.err).contains("not found"),
        "{r:?}"
    );
    // Never started, as a field: not found, not executable, a working
    // directory that is not there — and not a script's own `exit 127`.
    exec(&mut c, id, &["sh", "-c", "printf x > /tmp/not-executable"]).await?;
    let r = exec(&mut c, id, &["/tmp/not-executable"]).await?;
    ensure!(r.exit.code == 126 && r.exit.start_failed, "{r:?}");
    let r = exec_req(
        &mut c,
        api::ExecRequest {
            session_id: id,
            argv: vec!["true".into()],
            cwd: "/no/such/dir".into(),
            ..Default::default()
        },
    )
    .await?;
    ensure!(r.exit.code == 125 && r.exit.start_failed, "{r:?}");
    let r = exec(&mut c, id, &["sh", "-c", "exit 127"]).await?;
    ensure!(r.exit.code == 127 && !r.exit.start_failed, "{r:?}");
    let r = exec(&mut c, id, &["true"]).await?;
    ensure!(r.exit.code == 0 && !r.exit.start_failed, "{r:?}");
    let r = exec(&mut c, id, &["sh", "-c", "kill -9 $$"]).await?;
    ensure!(
        r.exit.signal == 9 && r.exit.code == 137 && !r.exit.timed_out,
        "{r:?}"
    );
    let t0 = Instant::now();
    let r = exec_req(
        &mut c,
        api::ExecRequest {
            session_id: id,
            argv: vec!["sh".into(), "-c".into(), "sleep 30 & sleep 30".into()],
            timeout_ms: 300,
            ..Default::default()
        },
    )
    .await?;
    ensure!(
        r.exit.timed_out && r.exit.signal == 9 && t0.elapsed() < Duration::from_secs(10),
        "{r:?} after {:?}",
        t0.elapsed()
    );
    let r = exec_req(
        &mut c,
        api::ExecRequest {
            session_id: id,
            argv: vec!["cat".into()],
            stdin: b"from stdin".to_vec(),
            has_user: true,
            uid: 1000,
            gid: 1000,
            cwd: "/tmp".into(),
            ..Default::default()
        },
    )
    .await?;
    ensure!(r.out == b"from stdin" && r.exit.code == 0, "{r:?}");
    let r = exec_req(
        &mut c,
        api::ExecRequest {
            session_id: id,
            argv: vec!["sh".into(), "-c".into(), "id -u; pwd".into()],
            has_user: true,
            uid: 1000,
            gid: 1000,
            cwd: "/tmp".into(),
            ..Default::default()
        },
    )
    .await?;
    ensure!(r.out == b"1000\n/tmp\n", "{r:?}");
    // Round trips of `true` (logged, not asserted).
    let mut times = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        let r = exec(&mut c, id, &["true"]).await?;
        times.push(t.elapsed());
        ensure!(r.exit.code == 0);
    }
    times.sort();
    eprintln!(
        "sandbox_api: exec `true` round trip over gRPC: median {:?}, p90 {:?}, min {:?} (50 runs)",
        times[25], times[45], times[0]
    );

    // Files.
    let st = write(&mut c, id, "/srv/new/x.txt", b"hello file", true).await?;
    ensure!(
        st.kind == "file" && st.size == 10 && st.mode == 0o640,
        "{st:?}"
    );
    ensure!(read(&mut c, id, "/srv/new/x.txt").await? == b"hello file");
    // A mode beyond the permission bits is refused, not masked (0o77777
    // would have set setuid, setgid and sticky).
    let r = c
        .write_file(tokio_stream::iter([api::WriteFileRequest {
            header: Some(api::WriteFileHeader {
                session_id: id,
                path: "/srv/new/bad-mode".into(),
                mode: 0o77777,
                ..Default::default()
            }),
            data: b"x".to_vec(),
        }]))
        .await;
    ensure!(
        code(r) == Code::InvalidArgument,
        "WriteFile with mode 0o77777"
    );
    let part = {
        let mut s = c
            .read_file(api::ReadFileRequest {
                session_id: id,
                path: "srv/new/x.txt".into(),
                offset: 6,
                limit: 3,
            })
            .await?
            .into_inner();
        let mut v = Vec::new();
        while let Some(m) = s.message().await? {
            v.extend(m.data);
        }
        v
    };
    ensure!(part == b"fil", "{part:?}");
    let r = exec(&mut c, id, &["cat", "/srv/new/x.txt"]).await?;
    ensure!(r.out == b"hello file", "the session sees the write: {r:?}");
    // Replaced atomically: a second write of the same path.
    write(&mut c, id, "/srv/new/x.txt", b"v2", false).await?;
    ensure!(read(&mut c, id, "/srv/new/x.txt").await? == b"v2");
    ensure!(code(write(&mut c, id, "/nope/deeper/y", b"x", false).await) == Code::NotFound);
    // A path naming a directory (a trailing '/') is no file to write.
    for p in ["/srv/new/f/", "/srv/new/g/."] {
        ensure!(
            code(write(&mut c, id, p, b"x", false).await) == Code::InvalidArgument,
            "{p}"
        );
    }
    let ls = c
        .list_dir(api::ListDirRequest {
            session_id: id,
            path: "/srv/new".into(),
        })
        .await?
        .into_inner();
    ensure!(
        ls.entries.len() == 1 && ls.entries[0].name == "x.txt" && ls.entries[0].size == 2,
        "{ls:?}"
    );
    let st = c
        .stat_path(api::StatPathRequest {
            session_id: id,
            path: "/srv/new".into(),
        })
        .await?
        .into_inner();
    ensure!(st.kind == "dir", "{st:?}");
    ensure!(
        code(
            c.stat_path(api::StatPathRequest {
                session_id: id,
                path: "/missing".into(),
            })
            .await
        ) == Code::NotFound
    );

    // Symlinks never lead out of the session.
    let r = exec(
        &mut c,
        id,
        &[
            "sh",
            "-c",
            "ln -s /etc/passwd /link && ln -s ../../../../../etc/passwd /rel && ln -s / /hostroot",
        ],
    )
    .await?;
    ensure!(r.exit.code == 0, "{r:?}");
    ensure!(
        read(&mut c, id, "/link").await? == b"session-passwd\n",
        "an absolute symlink reads the session's /etc/passwd"
    );
    ensure!(read(&mut c, id, "/rel").await? == b"session-passwd\n");
    let st = c
        .stat_path(api::StatPathRequest {
            session_id: id,
            path: "/link".into(),
        })
        .await?
        .into_inner();
    ensure!(
        st.kind == "symlink" && st.link_target == "/etc/passwd",
        "{st:?}"
    );
    let e = write(&mut c, id, "../../x", b"evil", true)
        .await
        .unwrap_err();
    ensure!(
        e.code() == Code::InvalidArgument && e.message().contains("../../x"),
        "{e:?}"
    );
    write(&mut c, id, "/hostroot/srv/through-link", b"inside", false).await?;
    ensure!(
        !Path::new("/srv/through-link").exists(),
        "a write through a symlink to / landed on the host"
    );
    ensure!(read(&mut c, id, "/srv/through-link").await? == b"inside");

    // Remove.
    let e = c
        .remove_path(api::RemovePathRequest {
            session_id: id,
            path: "/srv/new".into(),
            recursive: false,
        })
        .await
        .unwrap_err();
    ensure!(e.code() == Code::FailedPrecondition, "{e:?}");
    let rm = c
        .remove_path(api::RemovePathRequest {
            session_id: id,
            path: "/srv/new".into(),
            recursive: true,
        })
        .await?
        .into_inner();
    ensure!(rm.removed == 2, "{rm:?}");
    let rm = c
        .remove_path(api::RemovePathRequest {
            session_id: id,
            path: "/link".into(),
            recursive: false,
        })
        .await?
        .into_inner();
    ensure!(rm.removed == 1);
    ensure!(
        read(&mut c, id, "/etc/passwd").await? == b"session-passwd\n",
        "the link went, not its target"
    );

    // Tar upload and download.
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Directory);
    h.set_mode(0o755);
    h.set_size(0);
    b.append_data(&mut h, "up", std::io::empty())?;
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_size(5);
    b.append_data(&mut h, "up/a.txt", &b"aaaa\n"[..])?;
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Symlink);
    h.set_size(0);
    b.append_link(&mut h, "up/l", "a.txt")?;
    let good = b.into_inner()?;
    let msgs = vec![
        api::UploadTarRequest {
            session_id: id,
            path: "/data".into(),
            make_parents: true,
            data: Vec::new(),
        },
        api::UploadTarRequest {
            data: good,
            ..Default::default()
        },
    ];
    let up = c.upload_tar(tokio_stream::iter(msgs)).await?.into_inner();
    ensure!(up.files == 1 && up.symlinks == 1, "{up:?}");
    let r = exec(&mut c, id, &["cat", "/data/up/l"]).await?;
    ensure!(r.out == b"aaaa\n", "{r:?}");
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(4);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    let name = b"../escaped";
    h.as_old_mut().name[..name.len()].copy_from_slice(name);
    h.set_cksum();
    b.append(&h, &b"evil"[..])?;
    let msgs = vec![api::UploadTarRequest {
        session_id: id,
        path: "/data".into(),
        make_parents: false,
        data: b.into_inner()?,
    }];
    let e = c.upload_tar(tokio_stream::iter(msgs)).await.unwrap_err();
    ensure!(
        e.code() == Code::InvalidArgument && e.message().contains("../escaped"),
        "{e:?}"
    );
    let tarball = download(&mut c, id, "/data/up").await?;
    let mut names = Vec::new();
    let mut a = tar::Archive::new(&tarball[..]);
    for e in a.entries()? {
        let mut e = e?;
        let p = e.path()?.to_string_lossy().into_owned();
        if p == "up/a.txt" {
            let mut v = String::new();
            std::io::Read::read_to_string(&mut e, &mut v)?;
            ensure!(v == "aaaa\n");
        }
        if p == "up/l" {
            ensure!(
                e.link_name()?.map(|l| l.to_string_lossy().into_owned()) == Some("a.txt".into())
            );
        }
        names.push(p);
    }
    names.sort();
    ensure!(names == ["up", "up/a.txt", "up/l"], "{names:?}");

    // The live session's diff.
    let mut s = c
        .diff(api::DiffRequest {
            session_id: id,
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut changes = Vec::new();
    while let Some(m) = s.message().await? {
        for e in m.entries {
            changes.push((e.path, e.change));
        }
    }
    ensure!(
        changes.contains(&("/data/up/a.txt".into(), "added".into()))
            && changes.contains(&("/srv/through-link".into(), "added".into())),
        "{changes:?}"
    );
    // The base lacks /proc, /dev, /sys and /run: the mountpoints init made
    // for them are the sandbox's, not changes.
    ensure!(
        !changes
            .iter()
            .any(|(p, _)| ["/proc", "/dev", "/sys", "/run"].contains(&p.as_str())),
        "the live diff lists the sandbox's mountpoints: {changes:?}"
    );

    // Discard: nothing mounted, the upper gone — with a process of the
    // session still writing in the background when CloseSession comes
    // (`discard_waits_for_the_session` holds one back from dying).
    let r = exec(
        &mut c,
        id,
        &[
            "sh",
            "-c",
            "(while :; do echo x >> /tmp/bg; sleep 0.01; done) > /dev/null 2>&1 &",
        ],
    )
    .await?;
    ensure!(r.exit.code == 0, "{r:?}");
    let r = exec(&mut c, id, &["sh", "-c", "sleep 0.05; test -s /tmp/bg"]).await?;
    ensure!(r.exit.code == 0, "the background writer runs: {r:?}");
    let s = discard(&mut c, id).await?;
    ensure!(s.outcome == "discarded" && s.released, "{s:?}");
    ensure!(
        !mounted_anywhere(&upper),
        "{} is still mounted",
        upper.display()
    );
    ensure!(!upper.exists(), "{} is left", upper.display());
    let e = c
        .exec(api::ExecRequest {
            session_id: id,
            argv: vec!["true".into()],
            ..Default::default()
        })
        .await
        .err()
        .context("exec on a closed session answered")?;
    ensure!(
        e.code() == Code::FailedPrecondition && e.message().contains(&id.to_string()),
        "exec on a closed session: {e:?}"
    );

    // Checkpoint into a node with labels: its id is a field.
    let g = c
        .create_graph(api::CreateGraphRequest {
            stack: stack.clone(),
            name: "g".into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let root = g.group.context("graph group")?.root;
    let r = c
        .create_session(api::CreateSessionRequest {
            node: root.clone(),
            name: "attempt".into(),
            sandbox: sandbox(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let sid = r.session.context("session")?.id;
    let r = exec(&mut c, sid, &["sh", "-c", "echo step > /srv/step.txt"]).await?;
    ensure!(r.exit.code == 0, "{r:?}");
    let s = c
        .close_session(api::CloseSessionRequest {
            session_id: sid,
            action: api::EndAction::Checkpoint as i32,
            state: r#"{"step": 1}"#.into(),
            labels: [("reward".to_string(), "0.75".to_string())].into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(s.outcome == "checkpointed" && !s.node.is_empty(), "{s:?}");
    let n = c
        .show_node(api::ShowNodeRequest { id: s.node.clone() })
        .await?
        .into_inner();
    ensure!(
        n.parents == [root.clone()]
            && n.labels.get("reward").map(String::as_str) == Some("0.75")
            && n.state.contains("step"),
        "{n:?}"
    );

    // kill -9 of the daemon with 16 live daemon-owned sessions: 14 on the
    // branch (two of them with an idempotency key), 2 attempts of the graph's
    // root node.
    const LIVE: usize = 16;
    let mut live = Vec::new();
    for i in 0..LIVE {
        let attempt = i >= LIVE - 2;
        let r = c
            .create_session(api::CreateSessionRequest {
                stack: if attempt {
                    String::new()
                } else {
                    stack.clone()
                },
                node: if attempt { root.clone() } else { String::new() },
                name: format!("k{i}"),
                idempotency_key: if i % 8 == 0 {
                    format!("k{i}")
                } else {
                    String::new()
                },
                sandbox: sandbox(),
                ..Default::default()
            })
            .await?
            .into_inner();
        let id = r.session.context("session")?.id;
        let upper = r
            .mounts
            .iter()
            .flat_map(|m| m.options.iter())
            .find_map(|o| o.strip_prefix("upperdir="))
            .map(PathBuf::from)
            .context("no upperdir in the mounts")?;
        let r = exec(&mut c, id, &["sh", "-c", &format!("echo {i} > /srv/k{i}")]).await?;
        ensure!(r.exit.code == 0, "{r:?}");
        ensure!(
            mounted_anywhere(&upper),
            "{} is not mounted",
            upper.display()
        );
        live.push((id, upper, i));
    }
    drop(c);
    let pid = d.pid().context("daemon pid")?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::SIGKILL,
    )?;
    let root_dir = d.root().to_path_buf();
    let sock = d.socket().to_path_buf();
    let mut old = daemon.take().context("daemon")?;
    old.stop();
    // The inits die with the daemon: their overlays go.
    let t0 = Instant::now();
    while live.iter().any(|(_, u, _)| mounted_anywhere(u)) {
        ensure!(
            t0.elapsed() < Duration::from_secs(10),
            "overlays outlived their daemon: {:?}",
            live.iter()
                .filter(|(_, u, _)| mounted_anywhere(u))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    *daemon = Some(Daemon::start_at(
        &sock,
        &dir.join("s/containerd.sock"),
        &root_dir,
    )?);
    let mut c = api::connect(&admin).await?;
    // Ended before the restarted daemon serves: no wait needed, no session
    // seen live, nothing published by an exit policy.
    let listed: Vec<api::Session> = c
        .list_sessions(api::ListSessionsRequest {
            all_namespaces: true,
            ..Default::default()
        })
        .await?
        .into_inner()
        .sessions;
    // The CLI's table says they are interrupted (the store keeps them
    // `active`: their uppers are kept until discarded).
    let table = ensure_success(
        "session ls",
        daemon
            .as_ref()
            .context("daemon")?
            .layerstack(&["session", "ls", "--owner", "sandbox"])?,
    )?;
    let table = stdout(&table);
    for (id, _, _) in &live {
        let row: Vec<&str> = table
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.first() == Some(&id.to_string().as_str()))
            .with_context(|| format!("session {id} not in `session ls`:\n{table}"))?;
        ensure!(
            row.windows(2).any(|w| w == ["interrupted", "interrupted"]) && !row.contains(&"active"),
            "`session ls` row of interrupted session {id}: {row:?}"
        );
    }
    for (id, upper, i) in &live {
        let s = listed
            .iter()
            .find(|s| s.id == *id)
            .with_context(|| format!("session {id} not listed"))?;
        ensure!(
            s.released
                && s.outcome == "interrupted"
                && s.interrupted_by == "daemon-restart"
                && s.daemon_owned
                && s.layer == 0
                && s.owner == format!("sandbox:k{i}"),
            "session {id} after the restart: {s:?}"
        );
        let w = c
            .wait(api::WaitRequest {
                session_id: *id,
                timeout_ms: 5_000,
                ..Default::default()
            })
            .await?
            .into_inner();
        ensure!(w.outcome == "interrupted", "wait on {id}: {w:?}");
        // A close after the restart answers the recorded end, publishes
        // nothing; one that asks for a discard drops the kept upper.
        let discard = *i == 1;
        let closed = c
            .close_session(api::CloseSessionRequest {
                session_id: *id,
                action: if discard {
                    api::EndAction::Discard
                } else {
                    api::EndAction::Publish
                } as i32,
                ..Default::default()
            })
            .await?
            .into_inner();
        ensure!(!mounted_anywhere(upper), "{} is mounted", upper.display());
        if discard {
            ensure!(
                closed.outcome == "discarded" && closed.released,
                "close --discard of interrupted {id}: {closed:?}"
            );
            let t0 = Instant::now();
            while upper.exists() {
                ensure!(
                    t0.elapsed() < Duration::from_secs(10),
                    "{} is left after close --discard",
                    upper.display()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            continue;
        }
        ensure!(
            closed.outcome == "interrupted" && closed.released,
            "close of {id}: {closed:?}"
        );
        // Kept for inspection until discarded.
        ensure!(
            upper.join(format!("srv/k{i}")).exists(),
            "{} lost the interrupted run's writes",
            upper.display()
        );
    }
    eprintln!(
        "sandbox_api: after kill -9, {LIVE} sessions ended interrupted (daemon-restart), e.g. {:?}",
        listed
            .iter()
            .find(|s| s.id == live[0].0)
            .map(|s| &s.message)
    );
    // A repeated key answers the ended session as recorded: no second run.
    let again = c
        .create_session(api::CreateSessionRequest {
            stack: stack.clone(),
            name: "k0".into(),
            idempotency_key: "k0".into(),
            sandbox: sandbox(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let s = again.session.clone().context("session")?;
    ensure!(
        !again.created && s.id == live[0].0 && s.released && s.outcome == "interrupted",
        "repeated key after the restart: {again:?}"
    );
    // The same key with other arguments is another request: refused
    // FAILED_PRECONDITION naming the key and what differs, nothing created.
    let refused = match c
        .create_session(api::CreateSessionRequest {
            stack: stack.clone(),
            name: "k0".into(),
            idempotency_key: "k0".into(),
            policy: "never".into(),
            sandbox: sandbox(),
            ..Default::default()
        })
        .await
    {
        Ok(r) => anyhow::bail!("the same key with another policy was answered: {r:?}"),
        Err(st) => st,
    };
    ensure!(
        refused.code() == Code::FailedPrecondition
            && refused.message().contains("\"k0\"")
            && refused.message().contains("policy")
            && refused.message().contains("new key"),
        "{refused:?}"
    );
    // The attempts end `interrupted` (an infrastructure failure, not the
    // task's), and a retry is the way on.
    let attempts = c
        .list_attempts(api::ListAttemptsRequest {
            node: root.clone(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .attempts;
    for (id, _, _) in &live[LIVE - 2..] {
        let a = attempts
            .iter()
            .find(|a| a.session == *id)
            .with_context(|| format!("no attempt of session {id}: {attempts:?}"))?;
        ensure!(
            a.status == "interrupted" && a.ended_ns > 0,
            "attempt of session {id}: {a:?}"
        );
    }
    // Discarding drops the kept upper.
    for (id, upper, _) in &live {
        let s = c
            .publish(api::PublishRequest {
                session_id: *id,
                action: api::EndAction::Discard as i32,
                reason: "test: inspected".into(),
                ..Default::default()
            })
            .await?
            .into_inner();
        ensure!(s.outcome == "discarded", "discard of {id}: {s:?}");
        let t0 = Instant::now();
        while upper.exists() {
            ensure!(
                t0.elapsed() < Duration::from_secs(10),
                "{} is left after the discard",
                upper.display()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // A session made anew works on the restarted daemon and sees none of the
    // interrupted runs' writes.
    let (id, upper) = create(&mut c, &stack, "after").await?;
    let r = exec(&mut c, id, &["sh", "-c", "ls /srv; echo ok"]).await?;
    ensure!(
        r.exit.code == 0
            && r.out.ends_with(b"ok\n")
            && !String::from_utf8_lossy(&r.out).contains("k0"),
        "the interrupted sessions' writes were published: {r:?}"
    );
    workdirs(&mut c, &stack).await?;
    // The session's own processes cannot end its init (and have the sandbox
    // booked `interrupted`, init-gone, an infrastructure failure).
    let term = create_with(&mut c, &stack, "term-1", api::SandboxOptions::default()).await?;
    let r = exec(
        &mut c,
        term,
        &[
            "sh",
            "-c",
            "kill -TERM 1; kill -INT 1; kill -HUP 1; sleep 0.2; echo alive",
        ],
    )
    .await?;
    ensure!(r.exit.code == 0 && r.out == b"alive\n", "{r:?}");
    ensure!(exec(&mut c, term, &["true"]).await?.exit.code == 0);
    // Nor can a file call remove its mount points (the daemon's rmdir, from
    // another mount namespace, is not refused by the kernel).
    for (path, recursive) in [("/dev", false), ("/proc", false), ("/dev", true)] {
        let e = c
            .remove_path(api::RemovePathRequest {
                session_id: term,
                path: path.into(),
                recursive,
            })
            .await
            .err()
            .with_context(|| format!("{path} removed"))?;
        ensure!(
            e.code() == Code::FailedPrecondition && e.message().contains("mount point"),
            "{path}: {e:?}"
        );
    }
    let r = exec(
        &mut c,
        term,
        &["sh", "-c", "echo > /dev/null && test -d /proc/self"],
    )
    .await?;
    ensure!(r.exit.code == 0, "{r:?}");
    ensure!(discard(&mut c, term).await?.outcome == "discarded");
    let d = daemon.as_ref().context("daemon")?;
    cancelled_creates(&mut c, d, &stack).await?;
    spawner_gone(&mut c, d, &stack, id, &upper).await
}

/// The live (unreleased) sessions whose owner holds `name`.
async fn live_named(c: &mut Client, name: &str) -> Result<Vec<i64>> {
    Ok(c.list_sessions(api::ListSessionsRequest {
        all_namespaces: true,
        ..Default::default()
    })
    .await?
    .into_inner()
    .sessions
    .into_iter()
    .filter(|s| s.owner.contains(name) && !s.released)
    .map(|s| s.id)
    .collect())
}

/// A CreateSession whose caller goes away (its future dropped: the call is
/// reset) runs to its end in the daemon: a retry with its idempotency key
/// waits for it and answers the sandbox it made (or makes it), which the
/// caller then discards — the SDK's protocol for a cancelled create. After
/// those discards no sandbox of them is live and no child of the daemon is
/// left unreaped (an init of a create nobody awaited any more).
async fn cancelled_creates(c: &mut Client, d: &Daemon, stack: &str) -> Result<()> {
    let pid = d.pid().context("the daemon's pid")?;
    for (i, after) in [200u64, 500, 1000, 2000, 4000]
        .into_iter()
        .cycle()
        .take(20)
        .enumerate()
    {
        let req = api::CreateSessionRequest {
            stack: stack.into(),
            name: format!("gone-{i}"),
            sandbox: sandbox(),
            idempotency_key: format!("gone-{i}"),
            ..Default::default()
        };
        let mut c2 = c.clone();
        let first =
            tokio::time::timeout(Duration::from_micros(after), c2.create_session(req.clone()))
                .await;
        let answered = match first {
            Ok(r) => r?.into_inner(),
            Err(_) => c.create_session(req).await?.into_inner(),
        };
        let s = answered
            .session
            .context("CreateSession answered no session")?;
        discard(c, s.id).await?;
    }
    let t0 = Instant::now();
    loop {
        let live = live_named(c, "gone-").await?;
        let zombies: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))?
            .flatten()
            .flat_map(|t| {
                std::fs::read_to_string(t.path().join("children"))
                    .unwrap_or_default()
                    .split_whitespace()
                    .map(String::from)
                    .collect::<Vec<_>>()
            })
            .filter(|p| {
                std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|st| {
                    st.rsplit(')')
                        .next()
                        .is_some_and(|r| r.trim_start().starts_with('Z'))
                })
            })
            .collect();
        if live.is_empty() && zombies.is_empty() {
            return Ok(());
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(20),
            "after cancelled creates: live sandboxes {live:?}, zombie children {zombies:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A sandbox's missing working directory is made at its create (as Docker
/// makes a missing WORKDIR), owned by its user; one that is a file refuses
/// the create by name, and no session is left of it.
async fn workdirs(c: &mut Client, stack: &str) -> Result<()> {
    let opts = |w: &str| api::SandboxOptions {
        workdir: w.into(),
        has_user: true,
        uid: 1000,
        gid: 1001,
        ..Default::default()
    };
    let id = create_with(c, stack, "wd", opts("/made/here")).await?;
    let r = exec(c, id, &["sh", "-c", "pwd; echo x > f; ls"]).await?;
    ensure!(r.exit.code == 0 && r.out == b"/made/here\nf\n", "{r:?}");
    // Parents are made below a symlinked directory of the tree, followed
    // inside it (Debian's /lib -> usr/lib).
    let r = exec_req(
        c,
        api::ExecRequest {
            session_id: id,
            argv: ["sh", "-c", "ln -s srv /lnk && ln -s /srv /abs"]
                .map(String::from)
                .to_vec(),
            has_user: true,
            ..Default::default()
        },
    )
    .await?;
    ensure!(r.exit.code == 0, "{r:?}");
    for p in ["/lnk/new/f", "/abs/deeper/still/f"] {
        write(c, id, p, b"y", true).await?;
    }
    let r = exec(c, id, &["sh", "-c", "cat /srv/new/f /srv/deeper/still/f"]).await?;
    ensure!(r.exit.code == 0 && r.out == b"yy", "{r:?}");
    for p in ["/made", "/made/here"] {
        let st = c
            .stat_path(api::StatPathRequest {
                session_id: id,
                path: p.into(),
            })
            .await?
            .into_inner();
        ensure!(
            (st.kind.as_str(), st.uid, st.gid) == ("dir", 1000, 1001),
            "{p}: {st:?}"
        );
    }
    discard(c, id).await?;
    // An existing one is left as it is.
    let id = create_with(c, stack, "wd-srv", opts("/srv")).await?;
    let st = c
        .stat_path(api::StatPathRequest {
            session_id: id,
            path: "/srv".into(),
        })
        .await?
        .into_inner();
    ensure!(st.uid == 0, "{st:?}");
    discard(c, id).await?;
    for bad in ["/etc/passwd", "/etc/passwd/below"] {
        let e = create_with(c, stack, "wd-file", opts(bad))
            .await
            .err()
            .with_context(|| format!("workdir {bad}: created"))?;
        ensure!(
            e.code() == Code::InvalidArgument
                && e.message().contains("sandbox.workdir")
                && e.message().contains(bad),
            "{e:?}"
        );
    }
    // Fields a create cannot run with are refused by name, and leave nothing.
    for (o, field) in [
        (
            api::SandboxOptions {
                hostname: "\0evil".into(),
                ..Default::default()
            },
            "sandbox.hostname",
        ),
        (
            api::SandboxOptions {
                hostname: "a/b\n".into(),
                ..Default::default()
            },
            "sandbox.hostname",
        ),
        (
            api::SandboxOptions {
                hostname: "-bad".into(),
                ..Default::default()
            },
            "sandbox.hostname",
        ),
        (
            api::SandboxOptions {
                hostname: "..".into(),
                ..Default::default()
            },
            "sandbox.hostname",
        ),
        (
            api::SandboxOptions {
                has_user: true,
                uid: u32::MAX,
                ..Default::default()
            },
            "sandbox.uid",
        ),
        (
            api::SandboxOptions {
                pids: Some(5_000_000),
                ..Default::default()
            },
            "sandbox.pids",
        ),
    ] {
        let e = create_with(c, stack, "wd-file", o)
            .await
            .err()
            .with_context(|| format!("{field}: created"))?;
        ensure!(
            e.code() == Code::InvalidArgument && e.message().contains(field),
            "{e:?}"
        );
    }
    // A name a hostname cannot hold gives a cleaned default.
    let id = create_with(
        c,
        stack,
        "a name/with:odd chars",
        api::SandboxOptions::default(),
    )
    .await?;
    let r = exec(
        c,
        id,
        &["sh", "-c", "cat /proc/sys/kernel/hostname; echo $HOSTNAME"],
    )
    .await?;
    ensure!(
        r.out == b"a-name-with-odd-chars\na-name-with-odd-chars\n",
        "{r:?}"
    );
    discard(c, id).await?;
    let left = live_named(c, "wd-file").await?;
    ensure!(
        left.is_empty(),
        "sessions left by refused creates: {left:?}"
    );
    Ok(())
}

#[test]
fn daemon_owned_sessions_over_grpc() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let dir = make_temp_dir()?;
    let mut daemon = Some(Daemon::start_at(
        &dir.join("s/snapshotter.sock"),
        &dir.join("s/containerd.sock"),
        &dir.join("root"),
    )?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let r = rt.block_on(scenario(&dir, &mut daemon));
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

async fn create_with(
    c: &mut Client,
    stack: &str,
    name: &str,
    opts: api::SandboxOptions,
) -> Result<i64, tonic::Status> {
    let r = c
        .create_session(api::CreateSessionRequest {
            stack: stack.into(),
            name: name.into(),
            sandbox: Some(opts),
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(r.session.map(|s| s.id).unwrap_or_default())
}

/// Host pids of processes whose command line is exactly `argv`.
fn pids_of(argv: &[&str]) -> Vec<i32> {
    let want: Vec<u8> = argv.iter().flat_map(|a| a.bytes().chain([0])).collect();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == want))
        .collect()
}

/// CloseSession DISCARD of a daemon-owned session answers only once every
/// process of the session has ended: it kills the init and waits for it,
/// and the kernel ends the init of a pid namespace only after the
/// namespace's last other process (the discard then takes no census of
/// mount namespaces). One process of the session is held frozen (cgroup
/// v1's freezer: a frozen task dies of SIGKILL only once thawed) and thawed
/// 700 ms into the close: the close must not answer before, and nothing may
/// be mounted after. On a host without the v1 freezer (cgroup v2 lets
/// SIGKILL through a freeze) this part is skipped, with a line saying so.
async fn discard_waits_for_the_session(c: &mut Client, stack: &str) -> Result<()> {
    let freezer = Path::new("/sys/fs/cgroup/freezer");
    if !freezer.join("cgroup.procs").exists() {
        eprintln!("sandbox_api: no cgroup v1 freezer here: the discard-waits check is skipped");
        return Ok(());
    }
    let (id, upper) = create(c, stack, "frozen").await?;
    let r = exec(c, id, &["sh", "-c", "sleep 987.25 > /dev/null 2>&1 &"]).await?;
    ensure!(r.exit.code == 0, "{r:?}");
    let pids = pids_of(&["sleep", "987.25"]);
    ensure!(pids.len() == 1, "the session's sleep on the host: {pids:?}");
    let cg = freezer.join(format!("layerstack-test-{}", std::process::id()));
    std::fs::create_dir_all(&cg)?;
    let thaw = |cg: &Path| std::fs::write(cg.join("freezer.state"), "THAWED");
    let checked = async {
        std::fs::write(cg.join("tasks"), pids[0].to_string())?;
        std::fs::write(cg.join("freezer.state"), "FROZEN")?;
        let t0 = Instant::now();
        while std::fs::read_to_string(cg.join("freezer.state"))?.trim() != "FROZEN" {
            ensure!(
                t0.elapsed() < Duration::from_secs(5),
                "the sleep did not freeze"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let cg2 = cg.clone();
        let thawer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(700));
            thaw(&cg2)
        });
        let t0 = Instant::now();
        let s = c
            .close_session(api::CloseSessionRequest {
                session_id: id,
                action: api::EndAction::Discard as i32,
                ..Default::default()
            })
            .await?
            .into_inner();
        let took = t0.elapsed();
        thawer
            .join()
            .map_err(|_| anyhow::anyhow!("thawer panicked"))??;
        ensure!(s.outcome == "discarded" && s.released, "{s:?}");
        ensure!(
            took >= Duration::from_millis(600),
            "CloseSession answered after {took:?}, while a process of the session was frozen"
        );
        ensure!(
            !mounted_anywhere(&upper),
            "{} is still mounted after the discard",
            upper.display()
        );
        ensure!(
            pids_of(&["sleep", "987.25"]).is_empty(),
            "the session's sleep outlived it"
        );
        Ok(())
    }
    .await;
    let _ = thaw(&cg);
    let t0 = Instant::now();
    while std::fs::remove_dir(&cg).is_err() && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    checked
}

/// CloseSession of `id` with `action`: its outcome.
async fn close(c: &mut Client, id: i64, action: api::EndAction) -> Result<api::Session> {
    Ok(c.close_session(api::CloseSessionRequest {
        session_id: id,
        action: action as i32,
        ..Default::default()
    })
    .await?
    .into_inner())
}

/// CloseSession DISCARD of `id`: its outcome.
async fn discard(c: &mut Client, id: i64) -> Result<api::Session> {
    close(c, id, api::EndAction::Discard).await
}

/// The host directories of the cgroups a session's process is in, from its
/// `/proc/self/cgroup`, those beneath `parent` only (the session's own).
fn session_cgroup_dirs(proc_self_cgroup: &str, parent: &str) -> Vec<PathBuf> {
    let unified = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        PathBuf::from("/sys/fs/cgroup")
    } else {
        PathBuf::from("/sys/fs/cgroup/unified")
    };
    proc_self_cgroup
        .lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ':');
            let (_, ctrls, path) = (it.next()?, it.next()?, it.next()?);
            if !path.starts_with(&format!("{parent}/")) || ctrls.contains('=') {
                return None;
            }
            let base = if ctrls.is_empty() {
                unified.clone()
            } else {
                Path::new("/sys/fs/cgroup").join(ctrls.split(',').next()?)
            };
            Some(base.join(path.trim_start_matches('/')))
        })
        .collect()
}

async fn limits_scenario(dir: &Path, d: &Daemon, parent: &str) -> Result<()> {
    let src = dir.join("rootfs");
    rootfs(&src)?;
    let o = ensure_success(
        "base import",
        d.layerstack(&["base", "import", src.to_str().context("utf-8")?])?,
    )?;
    let stack = stdout(&o).trim().to_string();
    let mut c = api::connect(d.admin_socket()).await?;

    // Out of range: INVALID_ARGUMENT naming the field.
    let e = create_with(
        &mut c,
        &stack,
        "tiny",
        api::SandboxOptions {
            memory_bytes: Some(1 << 20),
            ..Default::default()
        },
    )
    .await
    .err()
    .context("1 MiB of memory was accepted")?;
    ensure!(
        e.code() == Code::InvalidArgument && e.message().contains("sandbox.memory_bytes"),
        "{e:?}"
    );

    // Memory: 32 MiB, a command allocating 128 MiB is OOM-killed.
    let id = create_with(
        &mut c,
        &stack,
        "mem",
        api::SandboxOptions {
            memory_bytes: Some(32 << 20),
            ..Default::default()
        },
    )
    .await?;
    let r = exec(&mut c, id, &["cat", "/proc/self/cgroup"]).await?;
    let dirs = session_cgroup_dirs(&String::from_utf8_lossy(&r.out), parent);
    ensure!(
        !dirs.is_empty() && dirs.iter().all(|d| d.is_dir()),
        "the command is in no cgroup beneath {parent}: {r:?} → {dirs:?}"
    );
    let r = exec(
        &mut c,
        id,
        &["dd", "if=/dev/zero", "of=/dev/null", "bs=128M", "count=1"],
    )
    .await?;
    ensure!(
        r.exit.signal == 9 && r.exit.code == 137 && r.exit.oom_killed && !r.exit.timed_out,
        "128 MiB in a 32 MiB session: {r:?}"
    );
    ensure!(
        r.exit.session_memory_peak_bytes > 0 && r.exit.session_memory_peak_bytes <= 33 << 20,
        "peak {} bytes",
        r.exit.session_memory_peak_bytes
    );
    // The daemon and the session survive.
    let r = exec(&mut c, id, &["echo", "alive"]).await?;
    ensure!(r.out == b"alive\n" && !r.exit.oom_killed, "{r:?}");
    discard(&mut c, id).await?;
    let t0 = Instant::now();
    while dirs.iter().any(|d| d.exists()) {
        ensure!(
            t0.elapsed() < Duration::from_secs(15),
            "the session's cgroup outlived it: {dirs:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Pids: 16 at most; a loop starting 100 sleeps gets EAGAIN.
    let id = create_with(
        &mut c,
        &stack,
        "pids",
        api::SandboxOptions {
            pids: Some(16),
            ..Default::default()
        },
    )
    .await?;
    let r = exec(
        &mut c,
        id,
        &["sh", "-c", "for i in $(seq 100); do sleep 5 & done"],
    )
    .await?;
    ensure!(
        String::from_utf8_lossy(&r.err).contains("Resource temporarily unavailable"),
        "100 processes in a 16-process session: {r:?}"
    );
    discard(&mut c, id).await?;

    // CPU: a tenth of a CPU; a busy loop gets CPU time well below its wall time.
    let id = create_with(
        &mut c,
        &stack,
        "cpu",
        api::SandboxOptions {
            cpu_millis: Some(100),
            ..Default::default()
        },
    )
    .await?;
    let before = exec(&mut c, id, &["true"]).await?.exit.session_cpu_usec;
    let r = exec(
        &mut c,
        id,
        &[
            "sh",
            "-c",
            "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done",
        ],
    )
    .await?;
    let used_ms = (r.exit.session_cpu_usec.saturating_sub(before)) / 1000;
    ensure!(
        r.exit.code == 0 && used_ms > 0 && (used_ms as f64) < 0.4 * r.exit.duration_ms as f64,
        "busy loop at 100 millicores: {used_ms} ms of CPU in {} ms: {r:?}",
        r.exit.duration_ms
    );
    eprintln!(
        "sandbox_limits: busy loop at 100 millicores: {used_ms} ms CPU in {} ms wall",
        r.exit.duration_ms
    );
    discard(&mut c, id).await?;

    // Workspace mode: the daemon's socket directory is covered.
    let admin = d.admin_socket().to_path_buf();
    let sock_dir = admin.parent().context("socket dir")?.to_path_buf();
    let ws = dir.join("ws");
    std::fs::create_dir_all(&ws)?;
    let id = create_with(
        &mut c,
        &stack,
        "ws",
        api::SandboxOptions {
            placement: ws.display().to_string(),
            ..Default::default()
        },
    )
    .await?;
    let r = exec(&mut c, id, &["ls", "-A", &sock_dir.display().to_string()]).await?;
    ensure!(
        r.exit.code == 0 && r.out.is_empty(),
        "{}: {r:?}",
        sock_dir.display()
    );
    std::os::unix::net::UnixStream::connect(&admin)
        .with_context(|| format!("the host connects to {}", admin.display()))?;
    let connect = format!(
        "import socket; s = socket.socket(socket.AF_UNIX); s.connect({:?})",
        admin.display().to_string()
    );
    let r = exec(&mut c, id, &["/usr/bin/python3", "-c", &connect]).await?;
    ensure!(
        r.exit.code != 0 && String::from_utf8_lossy(&r.err).contains("No such file"),
        "a workspace session connected to the admin socket: {r:?}"
    );
    // A placement inside the covered directory is refused.
    let e = create_with(
        &mut c,
        &stack,
        "ws-in",
        api::SandboxOptions {
            placement: sock_dir.join("x").display().to_string(),
            ..Default::default()
        },
    )
    .await
    .err()
    .context("a placement in the socket directory was accepted")?;
    ensure!(e.code() == Code::InvalidArgument, "{e:?}");
    discard(&mut c, id).await?;

    // Root mode never had the host's paths.
    let id = create_with(&mut c, &stack, "rootmode", api::SandboxOptions::default()).await?;
    let r = exec(&mut c, id, &["test", "-e", &admin.display().to_string()]).await?;
    ensure!(
        r.exit.code == 1,
        "root mode sees {}: {r:?}",
        admin.display()
    );
    discard(&mut c, id).await?;
    Ok(())
}

#[test]
fn session_limits_and_hidden_sockets() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let parent = format!("/layerstack-test-{}", std::process::id());
    let r = with_configured_daemon(
        &format!("[sandbox]\ncgroup_parent = {parent:?}\n"),
        |dir, d| runtime()?.block_on(limits_scenario(dir, d, &parent)),
    );
    for h in ["unified", "memory", "cpu", "cpuacct", "pids", ""] {
        let _ = std::fs::remove_dir(
            Path::new("/sys/fs/cgroup")
                .join(h)
                .join(parent.trim_start_matches('/')),
        );
    }
    r
}

/// The daemon's process spawner (`ls-spawner`, a child of the daemon that
/// clones inits and exec waiters): its pid, from the daemon's children.
fn spawner_of(daemon: u32) -> Option<i32> {
    children_named(daemon, "ls-spawner").into_iter().next()
}

/// The daemon's children whose name (`/proc/PID/comm`) is `name`.
fn children_named(daemon: u32, name: &str) -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{daemon}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
                .collect::<Vec<_>>()
        })
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == name)
        })
        .collect()
}

/// Ready inits (`[sandbox] ready_inits`, 2 by default): made ahead as the
/// daemon's children, one takes the next root-mode session — its hostname
/// and root are the session's — and the pool is made full again.
async fn ready_inits(c: &mut Client, d: &Daemon, stack: &str) -> Result<()> {
    let daemon = d.pid().context("daemon pid")?;
    let t0 = Instant::now();
    let idle = loop {
        let v = children_named(daemon, "ls-init");
        if v.len() == 2 || t0.elapsed() > Duration::from_secs(10) {
            break v;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    ensure!(idle.len() == 2, "ready inits before any session: {idle:?}");
    // Waiting, they hold no copy of the host's mounts (it would pin an
    // overlay mounted on the host at their clone): one empty root only.
    for p in &idle {
        let mi = std::fs::read_to_string(format!("/proc/{p}/mountinfo"))?;
        ensure!(
            mi.lines().count() == 1 && mi.contains(" tmpfs "),
            "a ready init's mounts: {mi}"
        );
    }
    let (id, _) = create(c, stack, "from-pool").await?;
    let r = exec(c, id, &["sh", "-c", "hostname; echo pooled > /srv/marker"]).await?;
    ensure!(r.out == b"from-pool\n", "{r:?}");
    let took: Vec<_> = idle
        .iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/root/srv/marker")).is_ok_and(|m| m == b"pooled\n")
        })
        .collect();
    ensure!(took.len() == 1, "no ready init took the session: {idle:?}");
    discard(c, id).await?;
    let t0 = Instant::now();
    loop {
        let now = children_named(daemon, "ls-init");
        if now.len() == 2 && !now.contains(took[0]) {
            break;
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(10),
            "the pool was not made full again: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Both ready inits killed while they wait: the next create finds them
    // dead (or claims one as it dies, and gives the overlay to an init it
    // clones), and the pool replaces them (it watches its inits) — full
    // again, none of the dead left.
    let dead = children_named(daemon, "ls-init");
    for p in &dead {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(*p), nix::sys::signal::SIGKILL)?;
    }
    let (id, _) = create(c, stack, "after-kill").await?;
    let r = exec(c, id, &["sh", "-c", "hostname"]).await?;
    ensure!(r.out == b"after-kill\n", "{r:?}");
    discard(c, id).await?;
    let t0 = Instant::now();
    loop {
        let now = children_named(daemon, "ls-init");
        if now.len() == 2 && !now.iter().any(|p| dead.contains(p)) {
            break;
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(10),
            "the pool was not refilled after its inits died: {now:?} (killed {dead:?})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// The daemon's process spawner killed while the daemon runs, with session
/// `id` live: it is replaced on the next request that needs it — a request
/// that reached the dead one fails UNAVAILABLE naming it (retryable), none
/// hangs —; creates and execs work again with a new spawner, and the live
/// session keeps its init, its files answer, and it closes normally.
async fn spawner_gone(
    c: &mut Client,
    d: &Daemon,
    stack: &str,
    id: i64,
    upper: &Path,
) -> Result<()> {
    let r = exec(c, id, &["sh", "-c", "echo up; exit 4"]).await?;
    ensure!(r.out == b"up\n" && r.exit.code == 4, "{r:?}");
    // Inits and waiters are the daemon's children (CLONE_PARENT), not the
    // spawner's: its death leaves them alone.
    let daemon = d.pid().context("daemon pid")?;
    let spawner = spawner_of(daemon).context("no ls-spawner child of the daemon")?;
    let kids = std::fs::read_to_string(format!("/proc/{spawner}/task/{spawner}/children"))?;
    ensure!(kids.trim().is_empty(), "the spawner has children: {kids}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(spawner),
        nix::sys::signal::SIGKILL,
    )?;
    // Creates go on: each either works or — reaching the dead spawner before
    // the daemon saw it gone — fails UNAVAILABLE naming it. Within 10 s one
    // works on a new spawner.
    let t0 = Instant::now();
    let mut refused = Vec::new();
    let new = loop {
        let r = c
            .create_session(api::CreateSessionRequest {
                stack: stack.into(),
                name: "after".into(),
                sandbox: sandbox(),
                ..Default::default()
            })
            .await;
        match r {
            Ok(r) => {
                // A ready init made before the kill may take the session:
                // then its Exec is what reaches the dead spawner.
                let id2 = r.into_inner().session.context("session")?.id;
                match exec(c, id2, &["sh", "-c", "echo again"]).await {
                    Ok(e) => {
                        ensure!(e.out == b"again\n" && e.exit.code == 0, "{e:?}");
                        discard(c, id2).await?;
                        match spawner_of(daemon) {
                            Some(p) if p != spawner => break p,
                            _ => {} // made before the kill landed
                        }
                    }
                    Err(e) => {
                        let s = e
                            .downcast_ref::<tonic::Status>()
                            .filter(|s| {
                                s.code() == Code::Unavailable
                                    && s.message().contains("process spawner")
                            })
                            .with_context(|| format!("exec after the spawner died: {e:#}"))?;
                        refused.push(s.message().to_string());
                        discard(c, id2).await?;
                    }
                }
            }
            Err(s) if s.code() == Code::Unavailable && s.message().contains("process spawner") => {
                refused.push(s.message().to_string());
            }
            Err(s) => bail!("create after the spawner died: {s:?}"),
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(10),
            "no new spawner 10 s after the spawner was killed: {refused:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // The daemon's binary run again (its command line rewritten: see
    // `set_cmdline`), not a fork of the threaded daemon.
    ensure!(
        std::fs::read_link(format!("/proc/{new}/exe"))?
            == std::fs::read_link(format!("/proc/{daemon}/exe"))?
            && std::fs::read(format!("/proc/{new}/cmdline"))? == b"layerstack-sandbox\0",
        "the new spawner {new} is not the daemon's binary run as one"
    );
    // The live session's init is untouched: exec works through the new
    // spawner, its files still answer, and it ends normally, leaving
    // nothing mounted.
    let r = exec(c, id, &["true"]).await?;
    ensure!(r.exit.code == 0, "{r:?}");
    ensure!(read(c, id, "/etc/passwd").await? == b"session-passwd\n");
    discard(c, id).await?;
    ensure!(!mounted_anywhere(upper), "{} is mounted", upper.display());
    eprintln!("sandbox_api: spawner killed, replaced by pid {new}; refused meanwhile: {refused:?}");
    Ok(())
}

/// `layerstack session exec` of a session the daemon owns (made over gRPC):
/// as root (joining it), and as an unprivileged user the daemon's `[api]
/// allowed_uids` admits — through the admin API's Exec, no root and no mount
/// socket: stdin sent, stdout and stderr streamed, the command's exit status
/// returned; an unknown session is refused by name.
#[test]
fn session_exec_from_the_cli_without_root() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    with_configured_daemon(
        "[api]\nallowed_uids = [65534]\n[sandbox]\nfile_stream_idle_s = 2\n",
        exec_cli_scenario,
    )
}

/// `[sandbox] file_stream_idle_s = 2`: a WriteFile whose client sends its
/// header and a chunk and then nothing is refused DEADLINE_EXCEEDED within
/// seconds (not held open, with a blocking thread of the daemon, for as long
/// as the client likes), the partial file is not there, and a write after it
/// works.
async fn idle_upload_refused(c: &mut Client, id: i64) -> Result<()> {
    use tokio_stream::StreamExt as _;
    let msgs = vec![
        api::WriteFileRequest {
            header: Some(api::WriteFileHeader {
                session_id: id,
                path: "/tmp/idle.txt".into(),
                ..Default::default()
            }),
            data: b"part".to_vec(),
        },
        api::WriteFileRequest {
            header: None,
            data: b"ial".to_vec(),
        },
    ];
    let t0 = Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        c.write_file(tokio_stream::iter(msgs).chain(tokio_stream::pending())),
    )
    .await
    .context("an idle WriteFile was still open after 20 s")?;
    let e = r.err().context("an idle WriteFile succeeded")?;
    ensure!(
        e.code() == Code::DeadlineExceeded && e.message().contains("file_stream_idle_s"),
        "{e:?}"
    );
    ensure!(
        t0.elapsed() < Duration::from_secs(10),
        "refused after {:?}",
        t0.elapsed()
    );
    let r = exec(c, id, &["test", "-e", "/tmp/idle.txt"]).await?;
    ensure!(r.exit.code == 1, "the idle write left /tmp/idle.txt: {r:?}");
    write(c, id, "/tmp/after.txt", b"after", false).await?;
    ensure!(read(c, id, "/tmp/after.txt").await? == b"after");
    Ok(())
}

/// `[sandbox] file_stream_idle_s = 2`: a ReadFile or DownloadTar whose
/// client stops reading ends DEADLINE_EXCEEDED after what was sent (its job,
/// which held a blocking thread and a turn of the daemon's 64 streaming
/// jobs, is over), not held open for as long as the client likes.
async fn idle_reader_refused(c: &mut Client, id: i64) -> Result<()> {
    const SIZE: usize = 64 << 20;
    let r = exec(
        c,
        id,
        &[
            "dd",
            "if=/dev/zero",
            "of=/tmp/big",
            "bs=1048576",
            "count=64",
        ],
    )
    .await?;
    ensure!(r.exit.code == 0, "dd: {r:?}");
    for call in ["ReadFile", "DownloadTar"] {
        let mut s = if call == "ReadFile" {
            c.read_file(api::ReadFileRequest {
                session_id: id,
                path: "/tmp/big".into(),
                ..Default::default()
            })
            .await?
            .into_inner()
        } else {
            c.download_tar(api::DownloadTarRequest {
                session_id: id,
                path: "/tmp/big".into(),
            })
            .await?
            .into_inner()
        };
        let mut got = s.message().await?.map_or(0, |m| m.data.len());
        tokio::time::sleep(Duration::from_secs(5)).await;
        let ended = loop {
            match tokio::time::timeout(Duration::from_secs(20), s.message()).await {
                Err(_) => bail!("{call}: the stream was still open 20 s after the client resumed"),
                Ok(Ok(Some(m))) => got += m.data.len(),
                Ok(Ok(None)) => break None,
                Ok(Err(e)) => break Some(e),
            }
        };
        let e = ended
            .with_context(|| format!("{call} of a client that paused 5 s gave all {got} bytes"))?;
        ensure!(
            e.code() == Code::DeadlineExceeded
                && e.message().contains("file_stream_idle_s")
                && got < SIZE,
            "{call} after a 5 s pause ({got} bytes): {e:?}"
        );
    }
    // The daemon serves the next read whole.
    ensure!(read(c, id, "/tmp/big").await?.len() == SIZE);
    c.remove_path(api::RemovePathRequest {
        session_id: id,
        path: "/tmp/big".into(),
        recursive: false,
    })
    .await?;
    Ok(())
}

/// Root-mode sandboxes on a base without /dev, /proc, /sys and /run,
/// published the moment their one write is done: no layer holds the
/// mountpoints their inits made. A close that checked the upper while the
/// killed init's mount was still going away skipped dropping them, and its
/// publish, a moment later, found the mount gone and took them (a user saw
/// 5–20 % of such closes do so).
async fn quick_publishes_keep_no_mountpoints(c: &mut Client, stack: &str) -> Result<()> {
    for i in 0..40 {
        let r = c
            .create_session(api::CreateSessionRequest {
                stack: stack.into(),
                branch: "quick".into(),
                name: format!("quick-{i}"),
                sandbox: sandbox(),
                ..Default::default()
            })
            .await?
            .into_inner();
        let id = r.session.context("session")?.id;
        write(c, id, &format!("/srv/quick-{i}"), b"q", false).await?;
        let s = close(c, id, api::EndAction::Publish).await?;
        ensure!(s.outcome == "committed" || s.outcome == "merged", "{s:?}");
        let paths = c
            .list_outcome_paths(api::ListOutcomePathsRequest {
                outcome_id: s.outcome_id,
                ..Default::default()
            })
            .await?
            .into_inner()
            .paths;
        let names: Vec<&str> = paths.iter().map(|p| p.path.as_str()).collect();
        ensure!(
            !names.iter().any(
                |p| ["/dev", "/proc", "/sys", "/run", "dev", "proc", "sys", "run"].contains(p)
            ),
            "publish {i} took the init's mountpoints: {names:?}"
        );
    }
    Ok(())
}

/// A WriteFile whose stream is still open when its sandbox is discarded
/// (CloseSession DISCARD does not wait for file RPCs) answers
/// FAILED_PRECONDITION saying the session ended and nothing was kept — not
/// the NOT_FOUND (or OK) of a write into an upper being removed.
async fn write_racing_discard(c: &mut Client, stack: &str) -> Result<()> {
    let (id, _) = create(c, stack, "racing").await?;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(api::WriteFileRequest {
        header: Some(api::WriteFileHeader {
            session_id: id,
            path: "/tmp/racing.txt".into(),
            ..Default::default()
        }),
        data: b"before".to_vec(),
    })
    .await?;
    let mut writer = c.clone();
    let call = tokio::spawn(async move {
        writer
            .write_file(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
    });
    // The daemon is writing: its temporary file is in /tmp.
    let t0 = Instant::now();
    loop {
        let r = exec(c, id, &["ls", "-a", "/tmp"]).await?;
        if String::from_utf8_lossy(&r.out).contains(".layerstack-write-") {
            break;
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(10),
            "the WriteFile made no temporary file in 10 s: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let closed = discard(c, id).await?;
    ensure!(closed.outcome == "discarded", "{closed:?}");
    tx.send(api::WriteFileRequest {
        header: None,
        data: b" after".to_vec(),
    })
    .await?;
    drop(tx);
    let r = tokio::time::timeout(Duration::from_secs(20), call)
        .await
        .context("a WriteFile racing a discard was still open after 20 s")??;
    let e = r
        .err()
        .context("a WriteFile into a discarded sandbox succeeded")?;
    ensure!(
        e.code() == Code::FailedPrecondition && e.message().contains("discarded while"),
        "WriteFile racing a discard: {e:?}"
    );
    Ok(())
}

/// Runs `scenario` against a daemon (no containerd) started with the config
/// file `toml` in a fresh temp dir: the daemon's log is printed when it
/// fails; the dir is removed unless `LAYERSTACK_TEST_KEEP` is set.
fn with_configured_daemon(
    toml: &str,
    scenario: impl FnOnce(&Path, &Daemon) -> Result<()>,
) -> Result<()> {
    let dir = make_temp_dir()?;
    let cfg = dir.join("daemon.toml");
    std::fs::write(&cfg, toml)?;
    let mut d = Daemon::start_at_with(
        &dir.join("s/snapshotter.sock"),
        &dir.join("s/containerd.sock"),
        &dir.join("root"),
        &["--config", cfg.to_str().context("utf-8")?],
        true,
    )?;
    let r = scenario(&dir, &d);
    if r.is_err() {
        d.dump_log();
    }
    d.stop();
    if std::env::var_os("LAYERSTACK_TEST_KEEP").is_none() {
        remove_tree(&dir);
    }
    r
}

/// A tokio runtime for a test's async scenario.
fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

fn exec_cli_scenario(dir: &Path, d: &Daemon) -> Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::PermissionsExt as _;
    let src = dir.join("rootfs");
    rootfs(&src)?;
    let stack = stdout(&ensure_success(
        "base import",
        d.layerstack(&["base", "import", src.to_str().context("utf-8")?])?,
    )?)
    .trim()
    .to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let admin = d.admin_socket().to_path_buf();
    let id = rt.block_on(async {
        let mut c = api::connect(&admin).await?;
        let id = create(&mut c, &stack, "cli-exec").await?.0;
        idle_upload_refused(&mut c, id).await?;
        idle_reader_refused(&mut c, id).await?;
        anyhow::Ok(id)
    })?;
    // The socket's directory must be reachable by the unprivileged user.
    for p in [
        dir.to_path_buf(),
        admin.parent().context("dir")?.to_path_buf(),
    ] {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))?;
    }
    let cli = bin_path(CLI_BIN)?;
    let sid = id.to_string();
    let script = "cat; echo out; echo err >&2; exit 3";
    for as_user in [None, Some("65534")] {
        let mut cmd = match as_user {
            None => std::process::Command::new(&cli),
            Some(u) => {
                let mut c = std::process::Command::new("setpriv");
                c.args(["--reuid", u, "--regid", u, "--clear-groups"])
                    .arg(&cli);
                c
            }
        };
        cmd.arg("--admin-address")
            .arg(&admin)
            .args(["session", "exec", &sid, "--", "sh", "-c", script])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn().context("layerstack session exec")?;
        child.stdin.take().context("stdin")?.write_all(b"fed\n")?;
        let o = child.wait_with_output()?;
        ensure!(
            o.status.code() == Some(3)
                && stdout(&o) == "fed\nout\n"
                && String::from_utf8_lossy(&o.stderr) == "err\n",
            "session exec as {as_user:?}: {o:?}"
        );
    }
    let o = d.layerstack(&["session", "exec", "999999", "--", "true"])?;
    ensure!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("999999"),
        "{o:?}"
    );
    // A --state that is no JSON, or that no checkpoint would record, is
    // refused before a session starts (it was ignored, or refused at the
    // close after the command ran).
    for (state, says) in [("nope", "not JSON"), ("{}", "recorded by a checkpoint")] {
        let o = d.layerstack(&[
            "--error-format",
            "json",
            "session",
            "run",
            &stack,
            "--state",
            state,
            "--",
            "true",
        ])?;
        let err = String::from_utf8_lossy(&o.stderr);
        ensure!(
            o.status.code() == Some(125) && err.contains("invalid_argument") && err.contains(says),
            "session run --state {state}: {o:?}"
        );
    }
    sandbox_cli_scenario(d, &cli, &admin, &stack)
}

/// `session create --sandbox` as a user that is not root: a daemon-owned
/// sandbox with the given defaults (env, hostname, workdir, user), network
/// off, exec'd and closed with the CLI; its publish is seen by the next one.
fn sandbox_cli_scenario(d: &Daemon, cli: &Path, admin: &Path, stack: &str) -> Result<()> {
    let as_nobody = |args: &[&str]| -> Result<std::process::Output> {
        Ok(std::process::Command::new("setpriv")
            .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
            .arg(cli)
            .arg("--admin-address")
            .arg(admin)
            .args(args)
            .output()?)
    };
    let o = ensure_success(
        "session create --sandbox",
        as_nobody(&[
            "session",
            "create",
            "--sandbox",
            stack,
            "--name",
            "cli-sb",
            "--env",
            "GREETING=hi",
            "--hostname",
            "box",
            "--workdir",
            "/srv",
            "--pids",
            "64",
            "--memory-bytes",
            "256M",
            "--json",
        ])?,
    )?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    let id = v["id"].as_i64().context("the session's id")?;
    ensure!(
        v["created"] == true && v["owner"].as_str().is_some_and(|o| o.contains("cli-sb")),
        "{v}"
    );
    ensure!(
        v["limits"]["pids"] == 64
            && v["limits"]["memory_bytes"] == 256u64 << 20
            && v["limits"]["network"] == false,
        "the session's limits: {v}"
    );
    ensure!(
        v["branch_created"] == false,
        "the default branch exists: {v}"
    );
    // A branch name that does not exist (a new one, or a typo) makes the
    // branch: said as a field and on stderr, never silently.
    let typo = format!("{stack}@mian");
    let o = ensure_success(
        "session create --sandbox STACK@mian",
        as_nobody(&["session", "create", "--sandbox", &typo, "--json"])?,
    )?;
    let t: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    let stderr = String::from_utf8_lossy(&o.stderr);
    ensure!(
        t["branch_created"] == true && t["branch"] == "mian",
        "a session on a new branch: {t}"
    );
    ensure!(
        stderr.contains("branch \"mian\"") && stderr.contains("did not exist"),
        "the CLI says it made a branch: {stderr}"
    );
    let tid = t["id"].as_i64().context("the session's id")?.to_string();
    ensure_success(
        "session close --discard",
        as_nobody(&["session", "close", &tid, "--discard"])?,
    )?;
    let sid = id.to_string();
    let o = as_nobody(&[
        "session",
        "exec",
        &sid,
        "--",
        "sh",
        "-c",
        "echo $GREETING; hostname; pwd; ls /sys/class/net; echo made > made",
    ])?;
    ensure!(
        o.status.success() && stdout(&o) == "hi\nbox\n/srv\nlo\n",
        "exec in the CLI's sandbox: {o:?}"
    );
    // A state no end of this close would record is refused before
    // anything ends (an AUTO close of a sandbox on no node published it,
    // the state dropped).
    for extra in [&[][..], &["--publish"][..]] {
        let mut args = vec!["session", "close", &sid, "--state", "{\"a\": 1}"];
        args.extend_from_slice(extra);
        let o = as_nobody(&args)?;
        let err = String::from_utf8_lossy(&o.stderr);
        ensure!(
            !o.status.success()
                && (err.contains("cannot checkpoint") || err.contains("recorded by a checkpoint")),
            "session close --state {extra:?}: {o:?}"
        );
    }
    let o = ensure_success(
        "session close --publish",
        as_nobody(&["session", "close", &sid, "--publish", "--json"])?,
    )?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    ensure!(v["outcome"] == "committed", "{v}");
    // Asked again for another end, the close answers the recorded one and
    // says the asked end changed nothing, exit 1.
    for action in ["--discard", "--checkpoint"] {
        let o = as_nobody(&["session", "close", &sid, action])?;
        let err = String::from_utf8_lossy(&o.stderr);
        ensure!(
            o.status.code() == Some(1) && err.contains("had ended committed already (layer"),
            "session close {action} after a publish: {o:?}"
        );
    }
    // The next sandbox sees it; the network asked for is the daemon's.
    let o = ensure_success(
        "session create --sandbox --net host",
        as_nobody(&["session", "create", "--sandbox", stack, "--net", "host"])?,
    )?;
    let sid = stdout(&o).trim().to_string();
    let o = as_nobody(&[
        "session",
        "exec",
        &sid,
        "--",
        "sh",
        "-c",
        "cat /srv/made; ls /sys/class/net | wc -l",
    ])?;
    let out = stdout(&o);
    ensure!(
        o.status.success()
            && out.starts_with("made\n")
            && out
                .trim_end()
                .rsplit('\n')
                .next()
                .is_some_and(|n| n.trim().parse::<u32>().is_ok_and(|n| n >= 1)),
        "{o:?}"
    );
    ensure_success(
        "session close --discard",
        as_nobody(&["session", "close", &sid, "--discard"])?,
    )?;
    // Refusals: a limit out of range names its field; a default without
    // --sandbox is the CLI's usage error.
    let o = as_nobody(&[
        "session",
        "create",
        "--sandbox",
        stack,
        "--memory-bytes",
        "1K",
    ])?;
    ensure!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("memory"),
        "{o:?}"
    );
    let o = d.layerstack(&["session", "create", stack, "--pids", "4"])?;
    ensure!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--sandbox"),
        "{o:?}"
    );
    Ok(())
}

/// The host uid of the process whose command line is exactly `argv`, from
/// `/proc/*/status` (`Uid:` real, effective, saved, fs), if one runs.
fn host_ids_of(argv: &[&str]) -> Option<(String, String)> {
    let want: Vec<u8> = argv
        .iter()
        .flat_map(|a| [a.as_bytes(), b"\0"].concat())
        .collect();
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let p = e.path();
        if std::fs::read(p.join("cmdline")).ok().as_deref() != Some(&want[..]) {
            continue;
        }
        let st = std::fs::read_to_string(p.join("status")).ok()?;
        let field = |k: &str| {
            st.lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
        };
        return Some((field("Uid:")?, field("Gid:")?));
    }
    None
}

/// Files named `name` anywhere below `dir` (not following symlinks).
fn find_named(dir: &Path, name: &str, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if e.file_name() == name {
            out.push(p.clone());
        }
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            find_named(&p, name, out);
        }
    }
}

async fn id_map_scenario(dir: &Path, d: &Daemon) -> Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let src = dir.join("rootfs");
    busybox_tree(
        &src,
        &[
            "sh", "cat", "echo", "id", "stat", "chown", "chmod", "touch", "rm", "mkdir", "sleep",
            "test", "mount", "umount", "hostname", "ln", "rmdir",
        ],
        &["etc", "srv", "tmp"],
    )?;
    std::fs::write(src.join("etc/passwd"), "root:x:0:0::/:/bin/sh\n")?;
    std::fs::write(src.join("srv/owned"), "by 1000\n")?;
    // A device node in the image: /dev/null's numbers.
    nix::sys::stat::mknod(
        &src.join("srv/null"),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(1, 3),
    )?;
    std::os::unix::fs::chown(src.join("srv/owned"), Some(1000), Some(1000))?;
    let o = ensure_success(
        "base import",
        d.layerstack(&["base", "import", src.to_str().context("utf-8")?])?,
    )?;
    let stack = stdout(&o).trim().to_string();
    let mut c = api::connect(d.admin_socket()).await?;
    let sh = |id: i64, script: &str| api::ExecRequest {
        session_id: id,
        argv: vec!["sh".into(), "-c".into(), script.into()],
        ..Default::default()
    };

    // The daemon's [sandbox] id_map applies to a request that gives none.
    let r = c
        .create_session(api::CreateSessionRequest {
            stack: stack.clone(),
            name: "mapped".into(),
            sandbox: Some(api::SandboxOptions::default()),
            ..Default::default()
        })
        .await?
        .into_inner();
    let s = r.session.context("session")?;
    let id = s.id;
    ensure!(
        s.id_map
            == Some(api::IdMap {
                host_uid: 100000,
                host_gid: 100000,
                size: 65536
            }),
        "the daemon's default mapping: {:?}",
        s.id_map
    );
    let r = exec_req(
        &mut c,
        sh(id, "id -u; id -g; cat /proc/self/uid_map /proc/self/gid_map; stat -c %u:%g /etc/passwd /srv/owned /"),
    )
    .await?;
    let out = String::from_utf8_lossy(&r.out);
    let words: Vec<&str> = out.split_whitespace().collect();
    ensure!(
        r.exit.code == 0
            && words
                == [
                    "0",
                    "0",
                    "0",
                    "100000",
                    "65536",
                    "0",
                    "100000",
                    "65536",
                    "0:0",
                    "1000:1000",
                    "0:0"
                ],
        "the session's root is 0:0 in its own namespace, the base's owners unchanged: {r:?}"
    );

    // Its root is the host's 100000, not the host's root.
    let r = exec_req(&mut c, sh(id, "sleep 7.125 >/dev/null 2>&1 &")).await?;
    ensure!(r.exit.code == 0, "{r:?}");
    let mut host = None;
    for _ in 0..50 {
        host = host_ids_of(&["sleep", "7.125"]);
        if host.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (uids, gids) = host.context("the session's sleep is not seen from the host")?;
    ensure!(
        uids == "100000 100000 100000 100000" && gids == "100000 100000 100000 100000",
        "host ids of the session's root: uid {uids}, gid {gids}"
    );
    let r = exec_req(
        &mut c,
        sh(id, "echo x > /proc/sys/kernel/hostname; echo $?"),
    )
    .await?;
    ensure!(
        r.exit.code == 0 && r.out != b"0\n",
        "the session's root wrote the host's kernel hostname: {r:?}"
    );
    // Its mounts are locked as the host's root made them: the root cannot be
    // remounted with devices allowed (then the image's /srv/null would be
    // the host's /dev/null), nor the hostname changed, nor procfs mounted.
    let r = exec_req(
        &mut c,
        sh(
            id,
            "mount -o remount,bind,dev / 2>/dev/null; echo remount $?; echo x 2>/dev/null > /srv/null; echo dev $?; hostname other 2>/dev/null; echo hostname $?; mkdir -p /tmp/p && mount -t proc proc /tmp/p 2>/dev/null; echo proc $?; hostname",
        ),
    )
    .await?;
    let out = String::from_utf8_lossy(&r.out).into_owned();
    ensure!(
        r.exit.code == 0
            && !out.contains("remount 0")
            && !out.contains("dev 0")
            && !out.contains("hostname 0")
            && !out.contains("proc 0"),
        "the session's root changed what the host's root set up:\n{out}"
    );
    // The file RPCs serve files, not the kernel's interfaces: a symlink of
    // the session into its /proc is refused (the daemon reads as the host's
    // root), and an archive of / stops at the session's other mounts.
    let r = exec_req(
        &mut c,
        sh(
            id,
            "ln -s /proc/kallsyms /srv/k && ln -s /proc/self/fd/0 /srv/fd0 && ln -s ../proc/self /srv/me",
        ),
    )
    .await?;
    ensure!(r.exit.code == 0, "{r:?}");
    // `/proc/self` resolves to the daemon's own process, which the
    // session's procfs does not show: refused as the kernel's, not NOT_FOUND.
    for path in [
        "/srv/k",
        "/srv/fd0",
        "/srv/me/status",
        "/proc/kallsyms",
        "/proc/1/status",
        "/proc/self/status",
        "/proc/thread-self/stat",
        "/dev/pts/99",
    ] {
        let e = read(&mut c, id, path)
            .await
            .err()
            .with_context(|| format!("ReadFile {path} answered the kernel's file"))?;
        ensure!(
            e.code() == Code::PermissionDenied
                && (e.message().contains("proc") || e.message().contains("devpts")),
            "ReadFile {path}: {e:?}"
        );
    }
    let r = c
        .list_dir(api::ListDirRequest {
            session_id: id,
            path: "/sys/kernel".into(),
        })
        .await;
    ensure!(code(r) == Code::PermissionDenied, "ListDir /sys/kernel");
    let st = c
        .stat_path(api::StatPathRequest {
            session_id: id,
            path: "/proc".into(),
        })
        .await?
        .into_inner();
    ensure!(
        st.kind == "dir",
        "the mount point itself is stat'ed: {st:?}"
    );
    let tarball = download(&mut c, id, "/").await?;
    let mut names = Vec::new();
    for e in tar::Archive::new(&tarball[..]).entries()? {
        let p = e?.path()?.to_string_lossy().into_owned();
        names.push(p.trim_start_matches("./").trim_end_matches('/').to_string());
    }
    ensure!(
        names.iter().any(|n| n == "proc")
            && names.iter().any(|n| n == "srv/owned")
            && !names
                .iter()
                .any(|n| ["proc/", "sys/", "dev/"].iter().any(|m| n.starts_with(m))),
        "the archive of / crossed into the session's mounts: {names:?}"
    );
    let r = download(&mut c, id, "/proc").await;
    ensure!(code(r) == Code::PermissionDenied, "DownloadTar /proc");
    let r = exec_req(&mut c, sh(id, "rm /srv/k /srv/fd0 /srv/me")).await?;
    ensure!(r.exit.code == 0, "{r:?}");
    // Mounts the session's root makes in its own mount namespace (a tmpfs,
    // a bind mount of a kernel file): the file RPCs, which run as the
    // host's root, neither read nor write nor remove on them.
    let r = exec_req(
        &mut c,
        sh(
            id,
            "mkdir -p /srv/m && mount -t tmpfs none /srv/m && echo secret > /srv/m/f && touch /srv/b && mount --bind /proc/version /srv/b && echo mounted",
        ),
    )
    .await?;
    ensure!(r.exit.code == 0 && r.out == b"mounted\n", "{r:?}");
    for path in ["/srv/m/f", "/srv/b"] {
        let e = read(&mut c, id, path)
            .await
            .err()
            .with_context(|| format!("ReadFile {path} answered a file of another mount"))?;
        ensure!(e.code() == Code::PermissionDenied, "ReadFile {path}: {e:?}");
    }
    let r = write(&mut c, id, "/srv/m/g", b"by the daemon", false).await;
    ensure!(
        code(r) == Code::PermissionDenied,
        "WriteFile into the session's tmpfs"
    );
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Directory);
    h.set_mode(0o777);
    h.set_size(0);
    b.append_data(&mut h, "m", &b""[..])?;
    let e = c
        .upload_tar(tokio_stream::iter(vec![api::UploadTarRequest {
            session_id: id,
            path: "/srv".into(),
            data: b.into_inner()?,
            ..Default::default()
        }]))
        .await
        .err()
        .context("an upload over the session's tmpfs was accepted")?;
    ensure!(
        e.code() == Code::InvalidArgument && e.message().contains("mount point"),
        "{e:?}"
    );
    let r = c
        .remove_path(api::RemovePathRequest {
            session_id: id,
            path: "/srv/m".into(),
            recursive: true,
        })
        .await;
    ensure!(
        code(r) == Code::FailedPrecondition,
        "RemovePath of the session's tmpfs"
    );
    let mut names = Vec::new();
    for e in tar::Archive::new(&download(&mut c, id, "/srv").await?[..]).entries()? {
        names.push(
            e?.path()?
                .to_string_lossy()
                .trim_end_matches('/')
                .to_string(),
        );
    }
    ensure!(
        names.iter().any(|n| n == "srv/m") && !names.iter().any(|n| n == "srv/m/f" || n == "srv/b"),
        "DownloadTar /srv crossed into the session's mounts: {names:?}"
    );
    let r = exec_req(
        &mut c,
        sh(
            id,
            "stat -c '%a' /srv/m; cat /srv/m/f; umount /srv/b /srv/m && rmdir /srv/m && rm /srv/b && echo unmounted",
        ),
    )
    .await?;
    ensure!(
        r.exit.code == 0 && r.out == b"1777\nsecret\nunmounted\n",
        "the session's tmpfs after the refused calls: {r:?}"
    );

    // Writes: a new file, a directory given to 1000, a set-user-ID bit, an
    // edit of a lower file owned by 1000 (copy-up keeps its owner), a
    // deletion; then a command as 1000.
    let r = exec_req(
        &mut c,
        sh(
            id,
            "touch /etc/new && mkdir /d && echo x > /d/f && chown 1000:1000 /d /d/f && chmod 4755 /d/f && echo more >> /srv/owned && rm /etc/passwd",
        ),
    )
    .await?;
    ensure!(r.exit.code == 0, "{r:?}");
    let r = exec_req(
        &mut c,
        api::ExecRequest {
            has_user: true,
            uid: 1000,
            gid: 1000,
            ..sh(id, "id -u; echo by-user > /d/g")
        },
    )
    .await?;
    ensure!(r.exit.code == 0 && r.out == b"1000\n", "{r:?}");
    let e = exec_req(
        &mut c,
        api::ExecRequest {
            has_user: true,
            uid: 70000,
            gid: 0,
            ..sh(id, "true")
        },
    )
    .await
    .err()
    .context("an exec as 70000 (outside the mapping) ran")?;
    ensure!(
        e.to_string().contains("outside"),
        "exec outside the mapping: {e:#}"
    );

    // The file RPCs speak the session's ids.
    let mut msgs = vec![api::WriteFileRequest {
        header: Some(api::WriteFileHeader {
            session_id: id,
            path: "/d/api".into(),
            mode: 0o600,
            has_owner: true,
            uid: 1000,
            gid: 1000,
            ..Default::default()
        }),
        data: b"api".to_vec(),
    }];
    let st = c
        .write_file(tokio_stream::iter(msgs.clone()))
        .await?
        .into_inner();
    ensure!((st.uid, st.gid) == (1000, 1000), "{st:?}");
    if let Some(h) = msgs[0].header.as_mut() {
        h.uid = 70000;
    }
    let e = c
        .write_file(tokio_stream::iter(msgs))
        .await
        .err()
        .context("a write owned by 70000 was accepted")?;
    ensure!(e.code() == Code::InvalidArgument, "{e:?}");
    let st = write(&mut c, id, "/d/root-owned", b"r", false).await?;
    ensure!((st.uid, st.gid) == (0, 0), "a write with no owner: {st:?}");
    let st = c
        .stat_path(api::StatPathRequest {
            session_id: id,
            path: "/srv/owned".into(),
        })
        .await?
        .into_inner();
    ensure!((st.uid, st.gid) == (1000, 1000), "{st:?}");
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_uid(1000);
    h.set_gid(1000);
    h.set_size(3);
    b.append_data(&mut h, "t.txt", &b"tar"[..])?;
    // Its parents implied (no entry of their own): the session's root's.
    b.append_data(&mut h, "deep/er/t.txt", &b"tar"[..])?;
    let up = c
        .upload_tar(tokio_stream::iter(vec![api::UploadTarRequest {
            session_id: id,
            path: "/up".into(),
            make_parents: true,
            data: b.into_inner()?,
        }]))
        .await?
        .into_inner();
    ensure!(up.files == 2, "{up:?}");
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_uid(70000);
    h.set_size(1);
    b.append_data(&mut h, "bad.txt", &b"b"[..])?;
    let e = c
        .upload_tar(tokio_stream::iter(vec![api::UploadTarRequest {
            session_id: id,
            path: "/up".into(),
            make_parents: true,
            data: b.into_inner()?,
        }]))
        .await
        .err()
        .context("a tar entry owned by 70000 was accepted")?;
    ensure!(e.code() == Code::InvalidArgument, "{e:?}");
    let r = exec_req(
        &mut c,
        sh(id, "stat -c '%n %u:%g %a' /d /d/f /d/g /d/api /d/root-owned /up /up/t.txt /up/deep /up/deep/er/t.txt /etc/new /srv/owned"),
    )
    .await?;
    let seen = String::from_utf8_lossy(&r.out).into_owned();
    let expect = "/d 1000:1000 755\n/d/f 1000:1000 4755\n/d/g 1000:1000 644\n/d/api 1000:1000 600\n/d/root-owned 0:0 640\n/up 0:0 755\n/up/t.txt 1000:1000 644\n/up/deep 0:0 755\n/up/deep/er/t.txt 1000:1000 644\n/etc/new 0:0 644\n/srv/owned 1000:1000 644\n";
    ensure!(
        seen == expect,
        "the session's view:\n{seen}\nexpected:\n{expect}"
    );

    // The live diff compares the session's ids with the base's: a copied-up
    // directory whose owner is the same is no change.
    let mut st = c
        .diff(api::DiffRequest {
            session_id: id,
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut changes = Vec::new();
    while let Some(m) = st.message().await? {
        for e in m.entries {
            changes.push(format!("{} {}", e.change, e.path));
        }
    }
    // The mountpoints init made in a base without them are dropped at the
    // close, not from a live diff.
    changes.retain(|c| {
        !["added /dev", "added /proc", "added /run", "added /sys"].contains(&c.as_str())
    });
    changes.sort();
    ensure!(
        changes
            == [
                "added /d",
                "added /d/api",
                "added /d/f",
                "added /d/g",
                "added /d/root-owned",
                "added /etc/new",
                "added /up",
                "added /up/deep",
                "added /up/deep/er",
                "added /up/deep/er/t.txt",
                "added /up/t.txt",
                "deleted /etc/passwd",
                "modified /srv/owned",
            ],
        "the live diff: {changes:?}"
    );

    // Published: the layer holds the session's ids, not the host's.
    let s = c
        .close_session(api::CloseSessionRequest {
            session_id: id,
            action: api::EndAction::Publish as i32,
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(s.outcome == "committed", "{s:?}");
    let mut found = Vec::new();
    for n in ["f", "g", "api", "root-owned", "t.txt", "new", "owned"] {
        find_named(&dir.join("root"), n, &mut found);
    }
    let layered: Vec<_> = found
        .iter()
        .filter(|p| !p.starts_with(&src))
        .filter_map(|p| std::fs::symlink_metadata(p).ok().map(|m| (p.clone(), m)))
        .collect();
    ensure!(
        layered.len() >= 7,
        "the published files on disk: {layered:?}"
    );
    for (p, m) in &layered {
        ensure!(
            m.uid() < 65536 && m.gid() < 65536,
            "{} is stored with host ids {}:{}",
            p.display(),
            m.uid(),
            m.gid()
        );
        if p.ends_with("d/f") {
            ensure!(
                m.uid() == 1000 && m.permissions().mode() & 0o7777 == 0o4755,
                "{}: {}:{} {:o}",
                p.display(),
                m.uid(),
                m.gid(),
                m.permissions().mode()
            );
        }
    }

    // Another session with its own mapping sees the same owners.
    let r = c
        .create_session(api::CreateSessionRequest {
            stack: stack.clone(),
            name: "remapped".into(),
            sandbox: Some(api::SandboxOptions {
                id_map: Some(api::IdMap {
                    host_uid: 200000,
                    host_gid: 300000,
                    size: 65536,
                }),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await?
        .into_inner();
    let id2 = r.session.context("session")?.id;
    let r = exec_req(
        &mut c,
        sh(id2, "cat /proc/self/uid_map /proc/self/gid_map; stat -c '%n %u:%g %a' /d/f /srv/owned /etc/new; test -e /etc/passwd || echo passwd-gone"),
    )
    .await?;
    let seen = String::from_utf8_lossy(&r.out);
    let words: Vec<&str> = seen.split_whitespace().collect();
    ensure!(
        words
            == [
                "0",
                "200000",
                "65536",
                "0",
                "300000",
                "65536",
                "/d/f",
                "1000:1000",
                "4755",
                "/srv/owned",
                "1000:1000",
                "644",
                "/etc/new",
                "0:0",
                "644",
                "passwd-gone"
            ],
        "{r:?}"
    );
    discard(&mut c, id2).await?;

    // The CLI: `session create --sandbox --id-map`, the mapping as a field.
    let o = ensure_success(
        "session create --sandbox --id-map",
        d.layerstack(&[
            "session",
            "create",
            "--sandbox",
            &stack,
            "--id-map",
            "300000:300000:65536",
            "--json",
        ])?,
    )?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    ensure!(
        v["id_map"]["host_uid"] == 300000 && v["id_map"]["size"] == 65536,
        "{v}"
    );
    let cid = v["id"].as_i64().context("the session's id")?;
    let r = exec(&mut c, cid, &["cat", "/proc/self/uid_map"]).await?;
    ensure!(
        String::from_utf8_lossy(&r.out)
            .split_whitespace()
            .collect::<Vec<_>>()
            == ["0", "300000", "65536"],
        "{r:?}"
    );
    // `session exec` as root does not join a mapped session through the
    // mount socket (it would run as the host's root there): it falls back to
    // Exec, in the session's user namespace.
    let o = ensure_success(
        "session exec (root) of a mapped session",
        d.layerstack(&[
            "session",
            "exec",
            &cid.to_string(),
            "--",
            "sh",
            "-c",
            "id -u; cat /proc/self/uid_map",
        ])?,
    )?;
    ensure!(
        stdout(&o).split_whitespace().collect::<Vec<_>>() == ["0", "0", "300000", "65536"],
        "session exec as root: {o:?}"
    );
    // Device nodes of its layers do not open (nodev); an upload of one is
    // refused.
    let r = exec(&mut c, cid, &["sh", "-c", "echo x > /srv/null"]).await?;
    ensure!(
        r.exit.code != 0 && String::from_utf8_lossy(&r.err).contains("denied"),
        "a layer's device node opened in a mapped session: {r:?}"
    );
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Char);
    h.set_mode(0o666);
    h.set_size(0);
    h.set_device_major(1)?;
    h.set_device_minor(11)?;
    b.append_data(&mut h, "kmsg", std::io::empty())?;
    let e = c
        .upload_tar(tokio_stream::iter(vec![api::UploadTarRequest {
            session_id: cid,
            path: "/up".into(),
            make_parents: true,
            data: b.into_inner()?,
        }]))
        .await
        .err()
        .context("a device node was uploaded into a mapped session")?;
    ensure!(
        e.code() == Code::InvalidArgument && e.message().contains("device node"),
        "{e:?}"
    );
    discard(&mut c, cid).await?;
    // A mapping of one id (root only) starts too (no tty group 5 to give
    // /dev/pts).
    let one = create_with(
        &mut c,
        &stack,
        "root-only",
        api::SandboxOptions {
            id_map: Some(api::IdMap {
                host_uid: 400000,
                host_gid: 400000,
                size: 1,
            }),
            ..Default::default()
        },
    )
    .await?;
    let r = exec(&mut c, one, &["cat", "/proc/self/uid_map"]).await?;
    ensure!(
        String::from_utf8_lossy(&r.out)
            .split_whitespace()
            .collect::<Vec<_>>()
            == ["0", "400000", "1"],
        "{r:?}"
    );
    discard(&mut c, one).await?;
    let o = d.layerstack(&[
        "session",
        "create",
        "--sandbox",
        &stack,
        "--id-map",
        "0:0:65536",
    ])?;
    ensure!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("id_map.host_uid 0"),
        "a mapping onto the host's root: {o:?}"
    );

    // Bad mappings are refused by name.
    for (m, placement, says) in [
        (
            api::IdMap {
                host_uid: 10,
                host_gid: 100000,
                size: 65536,
            },
            "",
            "id_map.host_uid 10",
        ),
        (
            api::IdMap {
                host_uid: 100000,
                host_gid: 100000,
                size: 0,
            },
            "",
            "id_map.size is 0",
        ),
        (
            api::IdMap {
                host_uid: 100000,
                host_gid: 100000,
                size: 65536,
            },
            "/tmp",
            "placement",
        ),
    ] {
        let e = create_with(
            &mut c,
            &stack,
            "bad",
            api::SandboxOptions {
                id_map: Some(m.clone()),
                placement: placement.into(),
                ..Default::default()
            },
        )
        .await
        .err()
        .with_context(|| format!("id map {m:?} with placement {placement:?} was accepted"))?;
        ensure!(
            e.code() == Code::InvalidArgument && e.message().contains(says),
            "{e:?}"
        );
    }
    Ok(())
}

#[test]
fn uid_gid_mapping() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    with_configured_daemon("[sandbox]\nid_map = \"100000:100000:65536\"\n", |dir, d| {
        runtime()?.block_on(id_map_scenario(dir, d))
    })
}
