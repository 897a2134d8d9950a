//! `Exec`: a command in a session's namespaces and root, its output streamed
//! (see the parent module's docs for the waiter/command shape).

use super::*;
use layerstack_engine::store::ExecRecord;

fn command(l: &Live, r: &api::ExecRequest) -> Result<Command, Status> {
    let first = r.argv.first().filter(|a| !a.is_empty()).ok_or_else(|| {
        Status::invalid_argument("argv is required (the command and its arguments)")
    })?;
    let d = l.owned.clone().unwrap_or_default();
    let ids = if r.has_user {
        check_ids("", r.uid, r.gid)?;
        Some((r.uid, r.gid))
    } else {
        d.user
    };
    if let (Some((u, g)), Some(m)) = (ids, d.id_map) {
        if u >= m.size || g >= m.size {
            return Err(Status::invalid_argument(format!(
                "user {u}:{g} is outside session {}'s uid/gid mapping {m} (ids 0..{}): give ids below {}",
                r.session_id, m.size, m.size
            )));
        }
    }
    let uid = ids.map_or(0, |(u, _)| u);
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), DEFAULT_PATH.into()),
        ("HOSTNAME".into(), d.hostname.clone()),
        ("HOME".into(), if uid == 0 { "/root" } else { "/" }.into()),
    ];
    for (k, v) in d.env.iter().cloned().chain(parse_env("env", &r.env)?) {
        env.retain(|(ek, _)| *ek != k);
        env.push((k, v));
    }
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| DEFAULT_PATH.into());
    let cwd = if r.cwd.is_empty() {
        l.workdir.clone()
    } else {
        absolute("cwd", &r.cwd)?;
        r.cwd.clone()
    };
    let nul = |what: &str| Status::invalid_argument(format!("{what} holds a NUL byte"));
    Ok(Command {
        candidates: holder::candidates(OsStr::new(first), OsStr::new(&path))
            .map_err(|_| nul("argv[0]"))?,
        argv: CArgs::new(r.argv.iter().map(|a| a.clone().into_bytes())).map_err(|_| nul("argv"))?,
        envp: CArgs::new(
            env.into_iter()
                .map(|(k, v)| format!("{k}={v}").into_bytes()),
        )
        .map_err(|_| nul("env"))?,
        name: first.as_bytes().to_vec(),
        ids,
        workdir: CString::new(cwd).map_err(|_| nul("cwd"))?,
        userns: d.id_map.is_some(),
    })
}

fn exit_reply(x: Exit, timed_out: bool, started: Instant) -> api::ExecReply {
    let (code, signal) = match x {
        Exit::Code(c) => (c, 0),
        Exit::Signal(s) => (128 + s, s),
    };
    api::ExecReply {
        kind: Some(api::exec_reply::Kind::Exit(api::ExecExit {
            code,
            signal,
            timed_out,
            duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            ..Default::default()
        })),
    }
}

/// `Exec`: see the module docs and `holder::spawn_joined` (the waiter is
/// cloned by the daemon's process spawner). In the sandbox of a running
/// rollout attempt the command is recorded in the attempt's trajectory
/// ([`recorded`]).
pub(crate) async fn exec(
    admin: &AdminService,
    r: api::ExecRequest,
) -> Result<Stream<api::ExecReply>, Status> {
    let id = r.session_id;
    let attempt = if id == 0 {
        None
    } else {
        // A store that cannot answer does not stop the command: it runs
        // unrecorded.
        admin
            .engine
            .running_rollout_of_session(id)
            .await
            .unwrap_or_else(|e| {
                warn!(session.id = id, error = %layerstack_engine::error_chain(&e), "cannot tell whether the session is a rollout attempt's: its command is not recorded");
                None
            })
    };
    let argv = attempt.map(|_| r.argv.clone());
    match (run(admin, r).await, argv) {
        (Ok(replies), Some(argv)) => Ok(recorded(admin.engine.clone(), id, argv, replies)),
        (Ok(replies), None) => Ok(replies),
        (Err(s), Some(argv)) => {
            // It never started (or a WASI run failed as a whole): recorded
            // with its error.
            let mut rec = ExecRecord::new(argv);
            rec.error = Some(s.message().to_string());
            keep(&admin.engine, id, rec).await;
            Err(s)
        }
        (Err(s), None) => Err(s),
    }
}

/// `replies` of a command run in session `id`, the sandbox of a running
/// rollout attempt, passed on as they come; its exit (or the error that
/// ends them, or the caller's going away) is recorded in the attempt's
/// trajectory (`Engine::record_exec`: argv, exit, the first bytes of its
/// output) **before** the exit is passed on — a harness that saw the exit
/// and then crashed leaves it recorded.
fn recorded(
    engine: Arc<layerstack_engine::Engine>,
    id: SessionId,
    argv: Vec<String>,
    mut replies: Stream<api::ExecReply>,
) -> Stream<api::ExecReply> {
    use api::exec_reply::Kind;
    use tokio_stream::StreamExt;
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        let mut rec = ExecRecord::new(argv);
        let mut done = false;
        loop {
            let reply = tokio::select! {
                r = replies.next() => match r {
                    Some(r) => r,
                    None => break,
                },
                () = tx.closed() => {
                    // The caller went away: dropping `replies` ends the
                    // command (its producer kills it once its channel is
                    // closed).
                    rec.error = Some("the caller went away before the command ended: it was killed".into());
                    keep(&engine, id, rec.clone()).await;
                    done = true;
                    break;
                }
            };
            match &reply {
                Ok(api::ExecReply {
                    kind: Some(Kind::Stdout(b)),
                }) => rec.output(false, b),
                Ok(api::ExecReply {
                    kind: Some(Kind::Stderr(b)),
                }) => rec.output(true, b),
                Ok(api::ExecReply {
                    kind: Some(Kind::Exit(e)),
                }) => {
                    rec.exit_code = Some(e.code);
                    rec.signal = e.signal;
                    rec.timed_out = e.timed_out;
                    rec.duration_ms = e.duration_ms;
                    done = true;
                }
                Ok(_) => {}
                Err(s) => {
                    rec.error = Some(s.message().to_string());
                    done = true;
                }
            }
            if done {
                keep(&engine, id, rec.clone()).await;
            }
            if tx.send(reply).await.is_err() {
                // The caller went away: dropping `replies` ends the command
                // (its producer kills it when its send fails).
                if !done {
                    rec.error =
                        Some("the caller went away before the command ended: it was killed".into());
                    keep(&engine, id, rec.clone()).await;
                    done = true;
                }
                break;
            }
            if done {
                break;
            }
        }
        if !done {
            rec.error = Some("the command's replies ended without its exit".into());
            keep(&engine, id, rec).await;
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

/// Records `rec` for session `id` (a failure is logged: the command's result
/// still reaches its caller).
async fn keep(engine: &layerstack_engine::Engine, id: SessionId, rec: ExecRecord) {
    match engine.record_exec(id, rec).await {
        Ok(Some(attempt)) => debug!(
            session.id = id,
            rollout.attempt = attempt,
            "exec recorded in the attempt's trajectory"
        ),
        Ok(None) => debug!(
            session.id = id,
            "exec not recorded: the session's attempt ended"
        ),
        Err(e) => {
            warn!(session.id = id, error = %layerstack_engine::error_chain(&e), "cannot record an exec in its attempt's trajectory")
        }
    }
}

/// `Exec` itself (Linux or WASI session), unrecorded.
async fn run(admin: &AdminService, r: api::ExecRequest) -> Result<Stream<api::ExecReply>, Status> {
    let id = r.session_id;
    if id != 0 {
        if let Some(w) = crate::wasi::live(admin, id) {
            return crate::wasi::exec(w, id, r).await;
        }
    }
    if !r.module.is_empty() && id != 0 {
        let s = admin
            .engine
            .session(id)
            .await
            .map_err(crate::admin::engine_status)?;
        return Err(
            if matches!(s.owner, layerstack_engine::store::Owner::Wasi { .. }) {
                Status::failed_precondition(format!(
                "WASI session {id} is not live: it was closed, or the daemon that ran it restarted (its run ended interrupted); create another"
            ))
            } else {
                Status::invalid_argument(format!(
                "module: session {id} is not a WASI session (CreateSession.wasi); run a program of its tree by argv"
            ))
            },
        );
    }
    // The phases of the exec, µs since here, in its debug line: the waiter
    // cloned, the waiter ended with the output's end, its status read.
    let t0 = Instant::now();
    let l = live(admin, id).await?;
    let cmd = command(&l, &r)?;
    let root = open_root(&l, id)?;
    let (in_r, in_w) = sys::pipe().map_err(|e| io_status("pipe", &e))?;
    let (out_r, out_w) = sys::pipe().map_err(|e| io_status("pipe", &e))?;
    let (err_r, err_w) = sys::pipe().map_err(|e| io_status("pipe", &e))?;
    let (st_r, st_w) = sys::pipe().map_err(|e| io_status("pipe", &e))?;
    let stdio = holder::Stdio {
        fds: [in_r.as_raw_fd(), out_w.as_raw_fd(), err_w.as_raw_fd()],
        status: st_w.as_raw_fd(),
    };
    let cgroup = l.owned.as_ref().and_then(|d| d.cgroup.clone());
    let procs = cgroup.as_ref().map(|c| c.procs_fds()).unwrap_or_default();
    let oom_before = cgroup.as_ref().map_or(0, |c| c.usage().oom_kills);
    let started = Instant::now();
    let req = spawner::exec_request(&cmd, l.pidfd.as_raw_fd(), root.as_raw_fd(), &stdio, &procs)
        .map_err(|e| io_status("the command's spawn request", &e))?;
    let (pid, _) = super::spawner(&admin.holders)?.spawn("the command's process", &req)?;
    drop((in_r, out_w, err_w, st_w, root));
    let spawned_us = t0.elapsed().as_micros() as u64;
    let waiter =
        sys::pidfd_open(pid).map_err(|e| io_status("pidfd of the command's waiter", &e))?;
    let (tx, rx) = mpsc::channel(16);
    let stdin = r.stdin;
    let init = l.pidfd.clone();
    let timeout = (r.timeout_ms > 0).then(|| Duration::from_millis(r.timeout_ms.into()));
    tokio::spawn(async move {
        let run = async {
            let mut w = tokio::net::unix::pipe::Sender::from_owned_fd(in_w)?;
            let mut out = tokio::net::unix::pipe::Receiver::from_owned_fd(out_r)?;
            let mut err = tokio::net::unix::pipe::Receiver::from_owned_fd(err_r)?;
            let feed = async move {
                // A command that does not read its stdin closes the pipe: EPIPE
                // is not an error of the exec.
                let _ = w.write_all(&stdin).await;
                drop(w);
            };
            tokio::spawn(feed);
            let waiter2 = waiter.try_clone()?;
            let mut ended = Box::pin(wait_pidfd(&waiter2));
            let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
            let sleep =
                tokio::time::sleep_until(deadline.unwrap_or_else(|| {
                    tokio::time::Instant::now() + Duration::from_secs(86400 * 365)
                }));
            tokio::pin!(sleep);
            let (mut bo, mut be) = (vec![0u8; CHUNK], vec![0u8; CHUNK]);
            let (mut out_open, mut err_open) = (true, true);
            let mut timed_out = false;
            let mut killed_at: Option<tokio::time::Instant> = None;
            let mut waiter_exit: Option<io::Result<Exit>> = None;
            let mut drain_until: Option<tokio::time::Instant> = None;
            let mut caller_gone = false;
            loop {
                if waiter_exit.is_some() && !out_open && !err_open {
                    break;
                }
                let drain = async {
                    match drain_until {
                        Some(t) => tokio::time::sleep_until(t).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    // The caller went away (its stream dropped): the command
                    // ends now, not at its next output.
                    () = tx.closed(), if !caller_gone && waiter_exit.is_none() => {
                        caller_gone = true;
                        kill_group(&waiter);
                    },
                    n = out.read(&mut bo), if out_open => match n {
                        Ok(0) | Err(_) => out_open = false,
                        Ok(n) => {
                            if tx.send(Ok(api::ExecReply { kind: Some(api::exec_reply::Kind::Stdout(bo[..n].to_vec())) })).await.is_err() {
                                kill_group(&waiter);
                            }
                        }
                    },
                    n = err.read(&mut be), if err_open => match n {
                        Ok(0) | Err(_) => err_open = false,
                        Ok(n) => {
                            if tx.send(Ok(api::ExecReply { kind: Some(api::exec_reply::Kind::Stderr(be[..n].to_vec())) })).await.is_err() {
                                kill_group(&waiter);
                            }
                        }
                    },
                    x = &mut ended, if waiter_exit.is_none() => {
                        waiter_exit = Some(x);
                        drain_until = Some(tokio::time::Instant::now() + DRAIN);
                    },
                    () = &mut sleep, if deadline.is_some() && waiter_exit.is_none() && (!timed_out || killed_at.is_some()) => {
                        if timed_out {
                            // The waiter did not end within 2 s of the kill: end it.
                            let _ = sys::pidfd_kill(&waiter, libc::SIGKILL);
                            killed_at = None;
                        } else {
                            timed_out = true;
                            kill_group(&waiter);
                            killed_at = Some(tokio::time::Instant::now());
                            sleep.as_mut().reset(tokio::time::Instant::now() + Duration::from_secs(2));
                        }
                    },
                    () = drain => {
                        // A process the command left behind may hold the pipes
                        // open: stop waiting for EOF, but send what they hold
                        // — the timer may have fired while this task waited
                        // for a CPU with the command's last output unread.
                        for (pipe, open, buf, stdout) in [(&out, &mut out_open, &mut bo, true), (&err, &mut err_open, &mut be, false)] {
                            while *open {
                                match pipe.try_read(buf) {
                                    Ok(n) if n > 0 => {
                                        let data = buf[..n].to_vec();
                                        let kind = if stdout { api::exec_reply::Kind::Stdout(data) } else { api::exec_reply::Kind::Stderr(data) };
                                        if tx.send(Ok(api::ExecReply { kind: Some(kind) })).await.is_err() {
                                            *open = false;
                                        }
                                    }
                                    _ => *open = false,
                                }
                            }
                        }
                    },
                }
            }
            let elapsed_from = started;
            let ended_us = t0.elapsed().as_micros() as u64;
            // The waiter wrote the command's exact exit before it exited.
            let mut st = tokio::net::unix::pipe::Receiver::from_owned_fd(st_r)?;
            let mut b = [0u8; holder::EXIT_BYTES];
            let mut start_failed = false;
            let x = match st.read_exact(&mut b).await {
                Ok(_) => {
                    let (x, started) = holder::decode_exit_started(&b);
                    start_failed = !started;
                    x
                }
                // No exit of the command: it was never started. With the
                // sandbox's init gone (killed, OOM), that is the sandbox's
                // loss, not the command's result — an error, never an exit
                // code a grader could score as the task's.
                Err(_) if sys::pidfd_exited(&init) => return Ok(None),
                Err(_) => waiter_exit.unwrap_or(Ok(Exit::Code(holder::SETUP_FAILED)))?,
            };
            debug!(
                session.id = id,
                spawned_us,
                ended_us,
                status_us = t0.elapsed().as_micros() as u64,
                "Exec ended"
            );
            let mut reply = exit_reply(x, timed_out, elapsed_from);
            if let Some(api::exec_reply::Kind::Exit(e)) = &mut reply.kind {
                e.start_failed = start_failed;
            }
            if let (Some(cg), Some(api::exec_reply::Kind::Exit(e))) = (&cgroup, &mut reply.kind) {
                let u = cg.usage();
                e.oom_killed = u.oom_kills > oom_before && x == Exit::Signal(libc::SIGKILL);
                e.session_memory_peak_bytes = u.memory_peak_bytes;
                e.session_cpu_usec = u.cpu_usec;
            }
            Ok::<_, io::Error>(Some(reply))
        };
        let last = match run.await {
            Ok(Some(reply)) => Ok(reply),
            Ok(None) => Err(api::status(
                ErrorKind::Unavailable,
                format!(
                    "session {id}'s sandbox is gone (its init ended): the command could not be started; create another sandbox"
                ),
            )),
            Err(e) => Err(io_status("exec", &e)),
        };
        let _ = tx.send(last).await;
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// Asks the waiter to SIGKILL the command's process group (SIGTERM to the
/// waiter means exactly that: `holder::spawn_joined`).
fn kill_group(waiter: &OwnedFd) {
    if let Err(e) = sys::pidfd_kill(waiter, libc::SIGTERM) {
        debug!(error = %e, "signalling an exec's waiter");
    }
}
