//! P11 WASI sessions (issue 24) side by side with Mode B sandboxes (P7b's
//! daemon-owned sessions), in one run, over gRPC from this process's tonic
//! client (no CLI, no Python: the daemon's share of each path).
//!
//! * One session: `CreateSession{wasi}` + `Exec` of a trivial module (WAT
//!   `_start` that returns, named by its `sha256:` digest after one warm-up
//!   run put it in the daemon's cache) + `CloseSession(DISCARD)`, against
//!   `CreateSession{sandbox}` + `Exec` of `true` + discard on the same stack;
//!   interleaved rounds after a pause (as P7/P7b) and back-to-back blocks;
//!   ms, median/p90/p99, ratio WASI / Mode B per pair. Each executor also
//!   in one round trip: `RunSession` (create + exec + DISCARD in the
//!   daemon), the target's figure.
//! * Where the time goes: each phase of the three calls from the client;
//!   the one call's phases inside the daemon (its "RunSession closed" debug
//!   line); and the floor — a `Status` call, which does no work, from the
//!   same client after the same pause and back to back: what the transport
//!   and the two processes' wake-ups cost before the daemon does anything.
//! * Fan-out: N sessions on one branch head created at once, each writing one
//!   distinct file (WASI: `integration/wasm/fsops.c` built with clang,
//!   `write /srv/w-I I`; Mode B: `sh -c 'echo I > /srv/m-I'`), then all closed
//!   with PUBLISH at once; every outcome must be `committed` or `merged`, and
//!   the head (squashed) must hold the N files. s wall, publishes/s, ratio.
//!
//! N = 1,024 (32 in `--quick`).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use layerstack_api as api;
use layerstack_integration::{bin_path, describe, CLI_BIN};
use serde_json::json;

use super::interleave;
use crate::env::{Bench, Image, LAYERSTACK};
use crate::plot::{PlotSpec, Point, Series, XAxis};
use crate::report::{ScenarioReport, Table, Target};
use crate::stats::{ms_since, pair_ratios, percentile, Summary};

const NS: &str = "bench-p11";

/// Pause before each single-session sample: P7's and P7b's.
const SETTLE: Duration = Duration::from_millis(150);

/// Fan-out `Exec` calls in flight at once (every session is created at once
/// and stays live; their runs are admitted this many at a time, the same for
/// both executors). The daemon itself admits `wasi::RUNS_AT_ONCE` (128) WASI
/// runs at once since a first release run of this scenario deadlocked it
/// with 512 (each run then held one of tokio's 512 blocking threads).
const EXECS_AT_ONCE: usize = 256;

/// The single-session variants, in the tables' order: (executor, one
/// `RunSession` call rather than three calls). Mode B's three calls are the
/// baseline.
const VARIANTS: [(Kind, bool); 4] = [
    (Kind::ModeB, false),
    (Kind::Wasi, false),
    (Kind::ModeB, true),
    (Kind::Wasi, true),
];

/// A WASI command that does nothing: `_start` returns (exit 0).
const TRIVIAL_WAT: &str = r#"(module (memory (export "memory") 1) (func (export "_start")))"#;

type Admin = api::AdminClient<tonic::transport::Channel>;

/// Which executor a session runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    ModeB,
    Wasi,
}

/// One create + exec + close, timed by phase (ms), and the exec's exit.
#[derive(Debug, Default, Clone)]
struct Phases {
    create_ms: f64,
    exec_ms: f64,
    close_ms: f64,
    exit: api::ExecExit,
    outcome: String,
}

impl Phases {
    fn total(&self) -> f64 {
        self.create_ms + self.exec_ms + self.close_ms
    }
}

/// A session of `kind` on `stack` (`STACK` or `STACK@BRANCH`).
async fn create(c: &mut Admin, stack: &str, kind: Kind) -> Result<i64> {
    let (s, branch) = stack.rsplit_once('@').unwrap_or((stack, ""));
    let mut req = api::CreateSessionRequest {
        namespace: NS.into(),
        stack: s.into(),
        branch: branch.into(),
        ..Default::default()
    };
    match kind {
        Kind::ModeB => req.sandbox = Some(api::SandboxOptions::default()),
        Kind::Wasi => req.wasi = Some(api::WasiOptions::default()),
    }
    let r = c
        .create_session(req)
        .await
        .with_context(|| format!("CreateSession ({kind:?}) on {stack}"))?
        .into_inner();
    Ok(r.session.context("CreateSession without a session")?.id)
}

/// Runs `req` to its exit; stdout and the exit.
async fn exec(c: &mut Admin, req: api::ExecRequest) -> Result<(Vec<u8>, api::ExecExit)> {
    let argv = req.argv.clone();
    let mut s = c
        .exec(req)
        .await
        .with_context(|| format!("Exec {argv:?}"))?
        .into_inner();
    let (mut out, mut err, mut exit) = (Vec::new(), Vec::new(), None);
    while let Some(m) = s.message().await? {
        match m.kind {
            Some(api::exec_reply::Kind::Stdout(b)) => out.extend(b),
            Some(api::exec_reply::Kind::Stderr(b)) => err.extend(b),
            Some(api::exec_reply::Kind::Exit(x)) => exit = Some(x),
            None => {}
        }
    }
    let exit = exit.with_context(|| format!("Exec {argv:?} ended without an exit"))?;
    ensure!(
        exit.code == 0 && exit.trap.is_empty(),
        "Exec {argv:?} exited {} (trap {:?} {}): {}",
        exit.code,
        exit.trap,
        exit.trap_message,
        String::from_utf8_lossy(&err)
    );
    Ok((out, exit))
}

async fn close(c: &mut Admin, id: i64, action: api::EndAction) -> Result<String> {
    let s = c
        .close_session(api::CloseSessionRequest {
            session_id: id,
            action: action as i32,
            ..Default::default()
        })
        .await
        .with_context(|| format!("CloseSession {id}"))?
        .into_inner();
    Ok(s.outcome)
}

/// One session on `stack`: create, run `argv` (with `module` bytes for WASI
/// when not empty), close with `action`; timed by phase.
async fn one(
    c: &mut Admin,
    stack: &str,
    kind: Kind,
    argv: Vec<String>,
    module: Vec<u8>,
    action: api::EndAction,
) -> Result<Phases> {
    let t = Instant::now();
    let id = create(c, stack, kind).await?;
    let create_ms = ms_since(t);
    let t = Instant::now();
    let (_, exit) = exec(
        c,
        api::ExecRequest {
            session_id: id,
            argv,
            module,
            ..Default::default()
        },
    )
    .await?;
    let exec_ms = ms_since(t);
    let t = Instant::now();
    let outcome = close(c, id, action).await?;
    Ok(Phases {
        create_ms,
        exec_ms,
        close_ms: ms_since(t),
        exit,
        outcome,
    })
}

/// The single-session sample of `kind`: WASI runs the trivial module by
/// `digest`, Mode B runs `true`; both discarded.
fn single(b: &Bench, stack: &str, kind: Kind, digest: &str) -> Result<Phases> {
    let mut c = b.admin();
    let argv = match kind {
        Kind::Wasi => vec![digest.to_string()],
        Kind::ModeB => vec!["true".to_string()],
    };
    let p = b.rt.block_on(one(
        &mut c,
        stack,
        kind,
        argv,
        Vec::new(),
        api::EndAction::Discard,
    ))?;
    ensure!(p.outcome == "discarded", "discard answered {:?}", p.outcome);
    Ok(p)
}

/// One session of `kind` in one round trip (`RunSession`: create + exec +
/// DISCARD in the daemon): WASI runs the trivial module by `digest`, Mode B
/// `true`. ms to the last reply.
fn single_call(b: &Bench, stack: &str, kind: Kind, digest: &str) -> Result<f64> {
    let mut c = b.admin();
    let (s, branch) = stack.rsplit_once('@').unwrap_or((stack, ""));
    let mut create = api::CreateSessionRequest {
        namespace: NS.into(),
        stack: s.into(),
        branch: branch.into(),
        ..Default::default()
    };
    let argv = match kind {
        Kind::ModeB => {
            create.sandbox = Some(api::SandboxOptions::default());
            vec!["true".to_string()]
        }
        Kind::Wasi => {
            create.wasi = Some(api::WasiOptions::default());
            vec![digest.to_string()]
        }
    };
    let req = api::RunSessionRequest {
        create: Some(create),
        exec: Some(api::ExecRequest {
            argv,
            ..Default::default()
        }),
        close: Some(api::CloseSessionRequest {
            action: api::EndAction::Discard as i32,
            ..Default::default()
        }),
    };
    b.rt.block_on(async {
        let t = Instant::now();
        let mut st = c
            .run_session(req)
            .await
            .with_context(|| format!("RunSession ({kind:?}) on {stack}"))?
            .into_inner();
        let (mut exit, mut closed) = (None, None);
        while let Some(m) = st.message().await? {
            match m.kind {
                Some(api::run_session_reply::Kind::Exit(x)) => exit = Some(x),
                Some(api::run_session_reply::Kind::Closed(s)) => closed = Some(s),
                _ => {}
            }
        }
        let took = ms_since(t);
        let exit = exit.context("RunSession answered no exit")?;
        ensure!(exit.code == 0, "RunSession ({kind:?}) exited {exit:?}");
        let closed = closed.context("RunSession answered no end")?;
        ensure!(
            closed.outcome == "discarded",
            "RunSession's discard answered {:?}",
            closed.outcome
        );
        Ok(took)
    })
}

/// `layerstack --admin-address … -n bench-p11 ARGS…`, which must succeed.
fn cli(b: &Bench, args: &[&str]) -> Result<std::process::Output> {
    let o = Command::new(bin_path(CLI_BIN)?)
        .arg("--admin-address")
        .arg(b.env.admin_socket())
        .args(["-n", NS])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("starting layerstack {}", args.join(" ")))?;
    ensure!(
        o.status.success(),
        "layerstack {}: {}",
        args.join(" "),
        describe(&o)
    );
    Ok(o)
}

/// One fan-out: N sessions of `kind` created at once on `head`, each writing
/// `/srv/<prefix>-I`, then all closed with PUBLISH at once.
#[derive(Debug, Default)]
struct Fan {
    /// From the first create to the last exec's exit, s.
    run_s: f64,
    /// From the first close to the last outcome, s.
    publish_s: f64,
    create_ms: Vec<f64>,
    exec_ms: Vec<f64>,
    close_ms: Vec<f64>,
    committed: usize,
    merged: usize,
    /// Files under /srv/ with the prefix on the squashed head.
    found: usize,
}

fn fan_out(b: &Bench, head: &str, kind: Kind, n: usize, fsops_digest: &str) -> Result<Fan> {
    let prefix = match kind {
        Kind::Wasi => "w",
        Kind::ModeB => "m",
    };
    let mut fan = Fan::default();
    let c = b.admin();
    let patience = if b.quick { 60 } else { 600 };
    let slow = |what: &str| {
        anyhow::anyhow!(
            "{kind:?} fan-out: {what} of {n} sessions did not all end within {patience} s \
             (the daemon may be stuck: see its log and its threads' stacks)"
        )
    };
    let runs = std::sync::Arc::new(tokio::sync::Semaphore::new(EXECS_AT_ONCE));
    // Phase 1: create + write, all created at once, EXECS_AT_ONCE runs in flight.
    let ran = b.rt.block_on(async {
        let t = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for i in 0..n {
            let runs = runs.clone();
            let mut c = c.clone();
            let head = head.to_string();
            let argv = match kind {
                Kind::Wasi => vec![
                    fsops_digest.to_string(),
                    "write".into(),
                    format!("/srv/{prefix}-{i}"),
                    format!("{i}\n"),
                ],
                Kind::ModeB => vec![
                    "sh".into(),
                    "-c".into(),
                    format!("echo {i} > /srv/{prefix}-{i}"),
                ],
            };
            set.spawn(async move {
                let t = Instant::now();
                let id = create(&mut c, &head, kind).await?;
                let create_ms = ms_since(t);
                let _run = runs.acquire().await?;
                let t = Instant::now();
                exec(
                    &mut c,
                    api::ExecRequest {
                        session_id: id,
                        argv,
                        ..Default::default()
                    },
                )
                .await?;
                anyhow::Ok((id, create_ms, ms_since(t)))
            });
        }
        let mut v = Vec::with_capacity(n);
        let all = async {
            while let Some(r) = set.join_next().await {
                v.push(r.context("a fan-out task panicked")??);
            }
            anyhow::Ok(())
        };
        tokio::time::timeout(Duration::from_secs(patience), all)
            .await
            .map_err(|_| slow("the create + write"))??;
        anyhow::Ok((t.elapsed().as_secs_f64(), v))
    })?;
    fan.run_s = ran.0;
    let ids: Vec<i64> = ran.1.iter().map(|x| x.0).collect();
    fan.create_ms = ran.1.iter().map(|x| x.1).collect();
    fan.exec_ms = ran.1.iter().map(|x| x.2).collect();
    // Phase 2: every session closed with PUBLISH, all at once.
    let closed = b.rt.block_on(async {
        let t = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for id in ids {
            let mut c = c.clone();
            set.spawn(async move {
                let t = Instant::now();
                let o = close(&mut c, id, api::EndAction::Publish).await?;
                anyhow::Ok((id, o, ms_since(t)))
            });
        }
        let mut v = Vec::with_capacity(n);
        let all = async {
            while let Some(r) = set.join_next().await {
                v.push(r.context("a close task panicked")??);
            }
            anyhow::Ok(())
        };
        tokio::time::timeout(Duration::from_secs(patience), all)
            .await
            .map_err(|_| slow("the publish"))??;
        anyhow::Ok((t.elapsed().as_secs_f64(), v))
    })?;
    fan.publish_s = closed.0;
    fan.close_ms = closed.1.iter().map(|x| x.2).collect();
    fan.committed = closed.1.iter().filter(|x| x.1 == "committed").count();
    fan.merged = closed.1.iter().filter(|x| x.1 == "merged").count();
    if let Some((id, o, _)) = closed
        .1
        .iter()
        .find(|x| x.1 != "committed" && x.1 != "merged")
    {
        bail!(
            "{kind:?} fan-out: {} of {n} sessions committed, {} merged; session {id} ended {o:?}",
            fan.committed,
            fan.merged
        );
    }
    // The head holds every file (squashed first: n layers deep).
    cli(b, &["squash", head])?;
    let mut c = b.admin();
    fan.found = b.rt.block_on(async {
        let id = create(&mut c, head, Kind::ModeB).await?;
        let (out, _) = exec(
            &mut c,
            api::ExecRequest {
                session_id: id,
                argv: vec![
                    "sh".into(),
                    "-c".into(),
                    format!("ls /srv | grep -c '^{prefix}-'"),
                ],
                ..Default::default()
            },
        )
        .await?;
        close(&mut c, id, api::EndAction::Discard).await?;
        let s = String::from_utf8_lossy(&out).trim().to_string();
        s.parse::<usize>()
            .with_context(|| format!("counting the published files answered {s:?}"))
    })?;
    ensure!(
        fan.found == n,
        "{kind:?} fan-out: the head {head} holds {} of the {n} files written",
        fan.found
    );
    Ok(fan)
}

/// The daemon's log lines written between bytes `from` and `to` of its log
/// that hold every one of `markers`.
fn log_lines_between(log: &Path, (from, to): (u64, u64), markers: &[&str]) -> Vec<String> {
    let Ok(s) = std::fs::read(log) else {
        return Vec::new();
    };
    let end = (to as usize).min(s.len());
    let s = String::from_utf8_lossy(s.get(from as usize..end).unwrap_or_default());
    s.lines()
        .filter(|l| markers.iter().all(|m| l.contains(m)))
        .map(str::to_string)
        .collect()
}

/// The number `FIELD=N` of one log line.
fn log_field(line: &str, field: &str) -> Option<f64> {
    let v = line.split(format!(" {field}=").as_str()).nth(1)?;
    let num: String = v
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    num.parse::<f64>().ok()
}

/// The numbers `FIELD=N` of the daemon's log lines holding `marker` logged
/// between bytes `from` and `to` of its log: "WASI session started"
/// `mount_us` (info: the overlay's fsopen … fsmount, µs), "WASI run ended"
/// `wall_ms` (debug: the module's instantiation and run, ms).
fn log_field_between(log: &Path, span: (u64, u64), marker: &str, field: &str) -> Vec<f64> {
    log_lines_between(log, span, &[marker])
        .iter()
        .filter_map(|l| log_field(l, field))
        .collect()
}

/// The daemon's own share of the `RunSession` calls of `executor` ("wasi",
/// "sandbox") between bytes `span` of its log, from its debug line
/// "RunSession closed" (µs since the call arrived: `created_us` when the
/// session was made, `ran_us` when the command's exit was read, `closed_us`
/// when its close returned): ms per phase — create, exec, close, whole.
fn run_session_share(log: &Path, span: (u64, u64), executor: &str) -> [Vec<f64>; 4] {
    let mut out: [Vec<f64>; 4] = Default::default();
    let marker = format!("executor=\"{executor}\"");
    for l in log_lines_between(log, span, &["RunSession closed", &marker]) {
        let (Some(c), Some(r), Some(x)) = (
            log_field(&l, "created_us"),
            log_field(&l, "ran_us"),
            log_field(&l, "closed_us"),
        ) else {
            continue;
        };
        for (i, v) in [c, r - c, x - r, x].into_iter().enumerate() {
            out[i].push(v / 1000.0);
        }
    }
    out
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

fn pcts(s: &[f64]) -> String {
    format!(
        "{:.3} / {:.3} / {:.3}",
        percentile(s, 50.0),
        percentile(s, 90.0),
        percentile(s, 99.0)
    )
}

pub fn run(b: &Bench, r: &mut ScenarioReport) -> Result<()> {
    b.image(NS, Image::Debian, &[LAYERSTACK])?;
    let rounds = if b.quick { 5 } else { 40 };
    let blocks = if b.quick { 2 } else { 5 };
    let per_block = if b.quick { 10 } else { 100 };
    let n = if b.quick { 32 } else { 1024 };
    let stack = super::p7b_sdk::debian_stack(b, NS)?;

    // The modules: warm-up runs put them in the daemon's cache (compiled,
    // linked) and give their digests.
    let trivial = wat::parse_str(TRIVIAL_WAT).context("the trivial module's WAT")?;
    let fsops = layerstack_integration::build_fsops_wasm(&b.env.scratch().join("p11-fsops.wasm"))?;
    let mut c = b.admin();
    let mut warm = |module: Vec<u8>, argv: Vec<String>| -> Result<api::ExecExit> {
        let p = b.rt.block_on(one(
            &mut c,
            &stack,
            Kind::Wasi,
            argv,
            module,
            api::EndAction::Discard,
        ))?;
        ensure!(p.exit.module_digest.starts_with("sha256:"), "{:?}", p.exit);
        Ok(p.exit)
    };
    let trivial_exit = warm(trivial.clone(), vec!["trivial".into()])?;
    let fsops_exit = warm(fsops.clone(), vec!["fsops".into()])?;
    let digest = trivial_exit.module_digest.clone();
    // By digest from now on: nothing sent, nothing compiled.
    let again = single(b, &stack, Kind::Wasi, &digest)?;
    ensure!(
        !again.exit.module_compiled,
        "the trivial module was compiled again when run by its digest: {:?}",
        again.exit
    );
    single(b, &stack, Kind::ModeB, &digest)?;

    // -- one session, paused rounds, interleaved.
    let log = b.env.daemon_log();
    let log_from = file_len(&log);
    let mut phases: [Vec<Phases>; 2] = [Vec::new(), Vec::new()];
    let paused = interleave(rounds, VARIANTS.len(), |_, v| {
        std::thread::sleep(SETTLE);
        let (kind, one_call) = VARIANTS[v];
        if one_call {
            return single_call(b, &stack, kind, &digest);
        }
        let p = single(b, &stack, kind, &digest)?;
        let total = p.total();
        phases[v].push(p);
        Ok(total)
    })?;
    let paused_span = (log_from, file_len(&log));
    let mount_us = log_field_between(&log, paused_span, "WASI session started", "mount_us");
    let run_ms = log_field_between(&log, paused_span, "WASI run ended", "wall_ms");
    let share = [
        run_session_share(&log, paused_span, "sandbox"),
        run_session_share(&log, paused_span, "wasi"),
    ];

    // -- one session, back to back, blocks rotating.
    let mut b2b: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
    let block_medians = interleave(blocks, VARIANTS.len(), |_, v| {
        let (kind, one_call) = VARIANTS[v];
        let mut s = Vec::with_capacity(per_block);
        for _ in 0..per_block {
            s.push(if one_call {
                single_call(b, &stack, kind, &digest)?
            } else {
                single(b, &stack, kind, &digest)?.total()
            });
        }
        let m = Summary::of(&s).median;
        b2b[v].extend(s);
        Ok(m)
    })?;

    // -- the floor: a call that does no work (`Status` answers from memory),
    // from the same client, after the same pause and back to back.
    let mut c = b.admin();
    let mut status = || -> Result<f64> {
        let t = Instant::now();
        b.rt.block_on(c.status(api::StatusRequest {}))
            .context("Status")?;
        Ok(ms_since(t))
    };
    let mut floor_paused = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        std::thread::sleep(SETTLE);
        floor_paused.push(status()?);
    }
    let floor_b2b = (0..per_block)
        .map(|_| status())
        .collect::<Result<Vec<f64>>>()?;

    let names = [
        "Mode B sandbox: `CreateSession{sandbox}` + exec `true` + discard",
        "WASI: `CreateSession{wasi}` + exec trivial module (by digest) + discard",
        "Mode B sandbox, one call: `RunSession{sandbox}` (`true`, DISCARD)",
        "WASI, one call: `RunSession{wasi}` (trivial module by digest, DISCARD)",
    ];
    let mut t = Table::new(
        &format!(
            "one session: create + exec + discard, from this program's tonic client; paused: {rounds} interleaved rounds, each sample after a {} ms pause; back to back: {blocks} blocks × {per_block} per variant, blocks rotating",
            SETTLE.as_millis()
        ),
        &[
            "variant",
            "paused ms: median (min–max)",
            "paused p50 / p90 / p99 ms",
            "paused ratio vs Mode B",
            "back to back p50 / p90 / p99 ms",
            "back to back ratio vs Mode B (block medians)",
        ],
    );
    let mut ratios = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let ratio = Summary::of(&pair_ratios(&paused[0], &paused[i]));
        let bratio = Summary::of(&pair_ratios(&block_medians[0], &block_medians[i]));
        t.row(vec![
            name.to_string(),
            Summary::of(&paused[i]).fmt(3),
            pcts(&paused[i]),
            if i == 0 {
                "1 (baseline)".into()
            } else {
                ratio.fmt_ratio()
            },
            pcts(&b2b[i]),
            if i == 0 {
                "1 (baseline)".into()
            } else {
                bratio.fmt_ratio()
            },
        ]);
        ratios.push((ratio, bratio));
    }
    r.tables.push(t);

    let col = |v: usize, f: fn(&Phases) -> f64| phases[v].iter().map(f).collect::<Vec<f64>>();
    let mut t = Table::new(
        "where one session's time goes (the paused samples above; ms, p50 / p90 / p99)",
        &["phase", "Mode B", "WASI"],
    );
    t.row(vec![
        "create (`CreateSession`)".into(),
        pcts(&col(0, |p| p.create_ms)),
        pcts(&col(1, |p| p.create_ms)),
    ]);
    t.row(vec![
        "exec (`Exec` stream to its exit)".into(),
        pcts(&col(0, |p| p.exec_ms)),
        pcts(&col(1, |p| p.exec_ms)),
    ]);
    t.row(vec![
        "discard (`CloseSession`)".into(),
        pcts(&col(0, |p| p.close_ms)),
        pcts(&col(1, |p| p.close_ms)),
    ]);
    for (i, what) in [
        "create",
        "exec",
        "close",
        "whole call, from its arrival to its close's end",
    ]
    .iter()
    .enumerate()
    {
        t.row(vec![
            format!("one call (`RunSession`), in the daemon: {what} (daemon log \"RunSession closed\", debug)"),
            pcts(&share[0][i]),
            pcts(&share[1][i]),
        ]);
    }
    t.row(vec![
        "the floor: a call that does no work (`Status`, answered from memory) from the same client, after the same pause / back to back".into(),
        format!("{} / {}", pcts(&floor_paused), pcts(&floor_b2b)),
        "(the same)".into(),
    ]);
    t.row(vec![
        "WASI overlays built meanwhile, ready sessions' included (daemon log `mount_us`, info)"
            .into(),
        "–".into(),
        if mount_us.is_empty() {
            "not in the log".into()
        } else {
            let ms: Vec<f64> = mount_us.iter().map(|u| u / 1000.0).collect();
            format!("{} ({} sessions)", pcts(&ms), ms.len())
        },
    ]);
    t.row(vec![
        "of exec: the module's instantiation and run (daemon log `wall_ms`, debug)".into(),
        "–".into(),
        if run_ms.is_empty() {
            "not in the log".into()
        } else {
            format!("{} ({} runs)", pcts(&run_ms), run_ms.len())
        },
    ]);
    t.row(vec![
        "of exec: the command's/module's own wall time (`ExecExit.duration_ms`, whole ms)".into(),
        pcts(&col(0, |p| p.exit.duration_ms as f64)),
        pcts(&col(1, |p| p.exit.duration_ms as f64)),
    ]);
    r.tables.push(t);

    // The target's figure: one call (RunSession), the path a one-shot
    // caller takes; the three calls' beside it.
    let wasi_single = Summary::of(&paused[3]);
    let wasi_b2b = percentile(&b2b[3], 50.0);
    let three = Summary::of(&paused[1]);
    r.targets.push(Target::at_most(
        "P11 WASI session create + run a trivial module + discard ≤ 1 ms median",
        format!(
            "one call (`RunSession`): {} ms after a pause, p99 {:.3} ms; back to back p50 {wasi_b2b:.3} ms ({} / {} of Mode B's three calls); three calls: {} ms after a pause, back to back p50 {:.3} ms",
            wasi_single.fmt(3),
            wasi_single.p99,
            ratios[3].0.fmt_ratio(),
            ratios[3].1.fmt_ratio(),
            three.fmt(3),
            percentile(&b2b[1], 50.0),
        ),
        wasi_single.median,
        1.0,
        &format!(
            "see the phases table: in the daemon the call takes {:.3} ms (p50: create {:.3} — \
             the claim of a ready session, one store transaction —, exec {:.3}, close {:.3} — \
             one store transaction); a call that does no work (`Status`) takes {:.3} ms from \
             the same client after the same pause ({:.3} back to back), the transport's and \
             the two processes' wake-ups before the daemon does anything",
            percentile(&share[1][3], 50.0),
            percentile(&share[1][0], 50.0),
            percentile(&share[1][1], 50.0),
            percentile(&share[1][2], 50.0),
            percentile(&floor_paused, 50.0),
            percentile(&floor_b2b, 50.0),
        ),
    ));
    let (_, prof) = b.profiler.record(
        &format!(
            "P11 WASI session create + trivial module + discard in one call (RunSession), {} runs back to back",
            per_block * 2
        ),
        || {
            for _ in 0..per_block * 2 {
                single_call(b, &stack, Kind::Wasi, &digest)?;
            }
            Ok(())
        },
    )?;
    r.profile = prof;

    // -- fan-out: N on one head, published at once, each executor its branch.
    let mut fans = Vec::new();
    for (kind, branch) in [(Kind::ModeB, "p11-modeb"), (Kind::Wasi, "p11-wasi")] {
        let head = format!("{stack}@{branch}");
        cli(b, &["branch", "create", &head])?;
        super::drain_staging(&b.env.store_root(), Duration::from_secs(60));
        super::settle(0.2, Duration::from_secs(10));
        fans.push(fan_out(b, &head, kind, n, &fsops_exit.module_digest)?);
    }
    let mut t = Table::new(
        &format!(
            "{n} sessions created at once on one head, each writing one file, then all closed with PUBLISH at once (one round each)"
        ),
        &["what", "Mode B", "WASI", "ratio WASI / Mode B"],
    );
    let (m, w) = (&fans[0], &fans[1]);
    let ratio = |a: f64, b: f64| format!("{:.3}×", b / a);
    t.row(vec![
        "create + write, wall until the last exec's exit".into(),
        format!("{:.3} s", m.run_s),
        format!("{:.3} s", w.run_s),
        ratio(m.run_s, w.run_s),
    ]);
    t.row(vec![
        format!("{n} publishes at once, wall"),
        format!("{:.3} s ({:.0}/s)", m.publish_s, n as f64 / m.publish_s),
        format!("{:.3} s ({:.0}/s)", w.publish_s, n as f64 / w.publish_s),
        ratio(m.publish_s, w.publish_s),
    ]);
    t.row(vec![
        "total wall".into(),
        format!("{:.3} s", m.run_s + m.publish_s),
        format!("{:.3} s", w.run_s + w.publish_s),
        ratio(m.run_s + m.publish_s, w.run_s + w.publish_s),
    ]);
    t.row(vec![
        "outcomes: committed / merged; files on the squashed head".into(),
        format!("{} / {}; {}", m.committed, m.merged, m.found),
        format!("{} / {}; {}", w.committed, w.merged, w.found),
        "–".into(),
    ]);
    for (what, pick) in [("create", 0usize), ("exec", 1), ("publish (close)", 2)] {
        let f = |x: &Fan| pcts([&x.create_ms, &x.exec_ms, &x.close_ms][pick]);
        t.row(vec![
            format!("per session: {what} call ms, p50 / p90 / p99"),
            f(m),
            f(w),
            "–".into(),
        ]);
    }
    r.tables.push(t);
    r.targets.push(Target {
        target: format!("P11 {n} concurrent WASI sessions writing one file each, published on one head"),
        measured: format!(
            "{:.2} s to create and run them, {:.2} s to publish ({:.0}/s): {} committed, {} merged, {} files on the head; Mode B {:.2} s + {:.2} s ({:.0}/s)",
            w.run_s,
            w.publish_s,
            n as f64 / w.publish_s,
            w.committed,
            w.merged,
            w.found,
            m.run_s,
            m.publish_s,
            n as f64 / m.publish_s
        ),
        met: Some(w.committed + w.merged == n && w.found == n),
        detail: String::new(),
    });

    r.method = format!(
        "This program's tonic client over the daemon's admin socket (the daemon's share; \
         P7b adds Python's). Stack: the Debian image's, as P7/P7b. Modules: a trivial WASI \
         command (`{TRIVIAL_WAT}`, through the `wat` crate) and \
         `integration/wasm/fsops.c` built with clang for wasm32-wasi; one warm-up run of \
         each sends the bytes (compiled once, cached by digest as a linked InstancePre); \
         every timed run names the module by its `sha256:` digest (checked: \
         `module_compiled` false). One session: `CreateSession` (`wasi` default options / \
         `sandbox` default options), `Exec` (the trivial module / `true`) to its exit, \
         `CloseSession` DISCARD, and the same in one `RunSession` call (create + exec + DISCARD \
         in the daemon); {rounds} rounds of the four in rotating order, each sample \
         after a {} ms pause as in P7/P7b; then {blocks} blocks of {per_block} back to \
         back per variant, rotating. Fan-out: on a new branch per executor, {n} tasks on \
         one HTTP/2 channel each create a session (all {n} at once, all live together) and run one write, at most {EXECS_AT_ONCE} `Exec` calls in flight (`fsops write \
         /srv/w-I I` / `sh -c 'echo I > /srv/m-I'`), then {n} `CloseSession` PUBLISH at \
         once; every outcome must be committed or merged, and a Mode B session on the \
         squashed head must count {n} files, else the scenario fails. Mode B first, \
         staging drained and the machine settled before each.",
        SETTLE.as_millis()
    );
    r.notes.push(format!(
        "The fan-out admits {EXECS_AT_ONCE} `Exec` calls at a time; the daemon runs at most \
         128 WASI modules at once (`RUNS_AT_ONCE` in snapshotter/src/wasi.rs), the rest \
         wait for a turn: a first release run with all {n} at once deadlocked the daemon \
         when each run held one of tokio's 512 blocking threads and waited, inside \
         wasmtime-wasi's preview1 calls, on a blocking task of its own."
    ));
    r.time_goes = TIME_GOES.into();
    r.plots.push(PlotSpec {
        file: "p11-wasi.svg".into(),
        title: "P11: one session, create + exec + discard (median, min–max)".into(),
        x_label: "variant".into(),
        y_label: "ms".into(),
        x: XAxis::Categories(vec!["Mode B (`true`)".into(), "WASI (trivial)".into()]),
        log_y: true,
        series: vec![
            Series {
                name: "after a pause".into(),
                points: paused
                    .iter()
                    .enumerate()
                    .map(|(i, s)| Point::new(i as f64, &Summary::of(s)))
                    .collect(),
            },
            Series {
                name: "back to back".into(),
                points: b2b
                    .iter()
                    .enumerate()
                    .map(|(i, s)| Point::new(i as f64, &Summary::of(s)))
                    .collect(),
            },
        ],
        hline: Some((1.0, "target: 1 ms".into())),
    });
    let ph = |v: usize| -> Vec<[f64; 3]> {
        phases[v]
            .iter()
            .map(|p| [p.create_ms, p.exec_ms, p.close_ms])
            .collect()
    };
    let fan_json = |f: &Fan| {
        json!({ "run_s": f.run_s, "publish_s": f.publish_s, "committed": f.committed,
                "merged": f.merged, "found": f.found, "create_ms": f.create_ms,
                "exec_ms": f.exec_ms, "close_ms": f.close_ms })
    };
    r.raw = json!({
        "unit": "ms",
        "variants": ["mode_b", "wasi"],
        "single": { "paused": paused, "back_to_back": b2b, "block_medians": block_medians,
                    "phases_create_exec_close": [ph(0), ph(1)], "wasi_mount_us": mount_us,
                    "wasi_run_ms": run_ms },
        "modules": { "trivial": trivial_exit.module_digest, "fsops": fsops_exit.module_digest,
                     "trivial_bytes": trivial.len(), "fsops_bytes": fsops.len() },
        "fan_out": { "n": n, "mode_b": fan_json(m), "wasi": fan_json(w) },
    });
    Ok(())
}

const TIME_GOES: &str = "a WASI create claims a session made ahead (`[sandbox] \
    wasi_ready`: its row, lease and detached overlay built in the background after the \
    previous session of the branch closed), so it is one store transaction; a discard \
    is one blocking step of the store's close, the overlay's unmount off its path; no \
    init process, namespaces or pivot_root, and an exec is an instance of a cached, \
    linked module instead of a chain of clones. Mode B makes its session, overlay and \
    init on the create's path. See the phases table and the profile.";
