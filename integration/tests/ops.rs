//! Operating LayerStack with the tools people already run: the binaries'
//! `--version`/`--help`, systemd readiness (`sd_notify`), the Prometheus
//! endpoint, log format and colour, configuration generated for containerd
//! 1.6 (run by a real containerd), `scripts/install.sh` into a `DESTDIR`, the
//! systemd unit (`systemd-analyze verify`), and `scripts/install-deps.sh` on a
//! systemd host (with stand-ins for apt-get and systemctl).
//!
//! Tests that start a daemon or containerd need root and containerd: they skip
//! without them, except under `CI=true`, where they fail; so does a missing
//! `systemd-analyze`.

#![allow(clippy::unwrap_used)]

use std::ffi::OsString;
use std::fs;
use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{SocketAddr, UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use layerstack_integration::{
    bin_path, busybox_image_tar, describe, ensure_success, ls_wait_ok, make_temp_dir, remove_tree,
    require_root_and_containerd, run_scenario, run_with_timeout, start_daemon_and_import, stdout,
    unique, wait_timeout, which, Containerd, CtrRun, Daemon, TestEnv, BUSYBOX_IMAGE, CLI_BIN,
    DAEMON_BIN, SHIM_BIN, SNAPSHOTTER,
};

/// Namespace of the tests on the shared env.
const NS: &str = "lst-ops";

fn in_ci() -> bool {
    matches!(std::env::var("CI").as_deref(), Ok("true") | Ok("1"))
}

/// The workspace root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("integration/ has a parent")
        .to_path_buf()
}

/// A temp dir below the test tmp base, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<TempDir> {
        Ok(TempDir(make_temp_dir()?))
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        remove_tree(&self.0);
    }
}

/// A daemon this test spawned directly (own env, no readiness wait); SIGTERM and
/// reaped on drop.
struct Spawned {
    child: Child,
    snap: PathBuf,
    admin: PathBuf,
    log: PathBuf,
}

impl Spawned {
    /// `containerd-layerstack-grpc` on `dir/store`, sockets `dir/s.sock` and
    /// `dir/a.sock`, no containerd, metrics on a free port, stderr to `dir/daemon.log`.
    fn start(dir: &Path, env: &[(&str, OsString)], args: &[&str]) -> Result<Spawned> {
        let (snap, admin, log) = (
            dir.join("s.sock"),
            dir.join("a.sock"),
            dir.join("daemon.log"),
        );
        let logf = fs::File::create(&log)?;
        let child = Command::new(bin_path(DAEMON_BIN)?)
            .arg("--root")
            .arg(dir.join("store"))
            .arg("--address")
            .arg(&snap)
            .arg("--admin-address")
            .arg(&admin)
            .arg("--containerd-address")
            .arg(dir.join("no-containerd.sock"))
            .args(args)
            // The config's [log] level applies only without RUST_LOG.
            .env_remove("RUST_LOG")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(logf.try_clone()?)
            .stderr(logf)
            .spawn()
            .context("spawning the daemon")?;
        Ok(Spawned {
            child,
            snap,
            admin,
            log,
        })
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM; the exit status within 20 s.
    fn terminate(&mut self) -> Result<std::process::ExitStatus> {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        wait_timeout(&mut self.child, Duration::from_secs(20))?
            .context("the daemon did not stop within 20 s of SIGTERM")
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Whether an HTTP/2 server answers on the unix socket `path`: our client preface
/// and SETTINGS get the server's SETTINGS frame back. A socket that is only bound
/// (a backlog, no server) never answers.
fn h2_answers(path: &Path, within: Duration) -> bool {
    let Ok(mut s) = UnixStream::connect(path) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(within));
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]); // empty SETTINGS
    if s.write_all(&hello).is_err() {
        return false;
    }
    let mut head = [0u8; 9];
    s.read_exact(&mut head).is_ok() && head[3] == 4
}

/// One datagram from `rx` as text, or None after its read timeout.
fn recv_text(rx: &UnixDatagram) -> Option<String> {
    let mut buf = vec![0u8; 4096];
    let n = rx.recv(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// `layerstack --admin-address ADMIN status --json`.
fn status_json(admin: &Path) -> Result<serde_json::Value> {
    let out = run_with_timeout(
        Command::new(bin_path(CLI_BIN)?)
            .arg("--admin-address")
            .arg(admin)
            .args(["status", "--json"]),
        Duration::from_secs(30),
    )?;
    let out = ensure_success("layerstack status --json", out)?;
    serde_json::from_slice(&out.stdout).context("status --json is not JSON")
}

/// Starts a daemon whose NOTIFY_SOCKET is `notify` (a path, or `@name`), bound by
/// `rx`, and whose servers start `delay` after its sockets are bound (the
/// daemon's test hook); checks that the first datagram is READY=1, that it came
/// no sooner than `delay` after the sockets appeared, and that at that moment
/// both sockets answer at once; then SIGTERM brings STOPPING=1 and a clean exit.
fn ready_then_stopping(
    dir: &Path,
    rx: &UnixDatagram,
    notify: OsString,
    delay: Duration,
) -> Result<()> {
    rx.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut d = Spawned::start(
        dir,
        &[
            ("NOTIFY_SOCKET", notify),
            (
                "LAYERSTACK_TEST_DELAY_SERVE_MS",
                delay.as_millis().to_string().into(),
            ),
        ],
        &["--metrics-address", "127.0.0.1:0"],
    )?;
    // When both sockets are bound (READY must not come before they answer).
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(d.snap.exists() && d.admin.exists()) {
        ensure!(
            Instant::now() < deadline,
            "sockets never appeared:\n{}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let bound = Instant::now();
    let first = recv_text(rx)
        .with_context(|| format!("no datagram within 60 s; daemon log:\n{}", d.log_text()))?;
    let waited = bound.elapsed();
    // At READY both sockets must already answer a request, without delay.
    let quick = Duration::from_millis(500);
    let snap_ok = h2_answers(&d.snap, quick);
    let admin_ok = h2_answers(&d.admin, quick);
    ensure!(
        first.lines().any(|l| l == "READY=1"),
        "first datagram: {first:?}"
    );
    ensure!(
        snap_ok && admin_ok,
        "READY=1 arrived but the sockets did not answer (snapshots {snap_ok}, admin {admin_ok})"
    );
    ensure!(
        waited + Duration::from_millis(100) >= delay,
        "READY=1 came {waited:?} after the sockets were bound, before the servers started ({delay:?})"
    );
    let st = status_json(&d.admin)?;
    ensure!(st["pid"] == d.child.id(), "status of another daemon: {st}");
    let status = d.terminate()?;
    ensure!(status.success(), "exit after SIGTERM: {status}");
    let last = recv_text(rx).context("no STOPPING=1 after SIGTERM")?;
    ensure!(
        last.lines().any(|l| l == "STOPPING=1"),
        "after SIGTERM: {last:?}"
    );
    let log = d.log_text();
    ensure!(
        log.contains("ready: both sockets answer"),
        "daemon log:\n{log}"
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// Binaries
// ---------------------------------------------------------------------------

#[test]
fn ops_binaries_print_version_and_help() {
    let version = env!("CARGO_PKG_VERSION");
    for (bin, name) in [(DAEMON_BIN, DAEMON_BIN), (CLI_BIN, CLI_BIN)] {
        let path = bin_path(bin).expect("binaries are built");
        let out = Command::new(&path).arg("--version").output().unwrap();
        assert!(out.status.success(), "{bin} --version: {}", describe(&out));
        assert_eq!(stdout(&out).trim(), format!("{name} {version}"));
    }
    // The shim: containerd's flag parser must not answer these.
    let shim = bin_path(SHIM_BIN).expect("binaries are built");
    for flag in ["--version", "-v"] {
        let out = Command::new(&shim).arg(flag).output().unwrap();
        assert!(out.status.success(), "shim {flag}: {}", describe(&out));
        assert_eq!(
            stdout(&out).trim(),
            format!("containerd-shim-layerstack-v1 {version}")
        );
    }
    // Run by hand without containerd's flags: a usage line on stderr, exit 2
    // (not the shim library's `Env(NotPresent)`).
    let out = Command::new(&shim).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "shim: {}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Usage: containerd-shim-layerstack-v1")
            && !err.contains("NotPresent")
            && out.stdout.is_empty(),
        "shim: {}",
        describe(&out)
    );
    let out = Command::new(&shim).arg("--help").output().unwrap();
    assert!(out.status.success(), "shim --help: {}", describe(&out));
    assert!(
        stdout(&out).contains("io.containerd.layerstack.v1"),
        "shim --help: {}",
        describe(&out)
    );
    let out = Command::new(bin_path(DAEMON_BIN).unwrap())
        .arg("--help")
        .output()
        .unwrap();
    let help = stdout(&out);
    assert!(out.status.success(), "{}", describe(&out));
    for flag in [
        "--config",
        "--root",
        "--address",
        "--admin-address",
        "--containerd-address",
        "--metrics-address",
        "--log-level",
        "--log-format",
        "--version",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}:\n{help}");
    }
    let out = Command::new(bin_path(CLI_BIN).unwrap())
        .args(["config", "--help"])
        .output()
        .unwrap();
    let help = stdout(&out);
    for what in [
        "containerd",
        "nerdctl",
        "docker",
        "daemon",
        "crio-none",
        "shim",
    ] {
        assert!(help.contains(what), "config --help lacks {what}:\n{help}");
    }
}

// ---------------------------------------------------------------------------
// systemd readiness
// ---------------------------------------------------------------------------

#[test]
fn ops_notify_ready_only_once_both_sockets_answer_then_stopping() {
    if !require_root_and_containerd() {
        return;
    }
    let t = TempDir::new().unwrap();
    // A socket path, as systemd gives it.
    let path = t.path().join("notify");
    let rx = UnixDatagram::bind(&path).unwrap();
    fs::create_dir_all(t.path().join("p")).unwrap();
    // The servers start 1.5 s after the sockets are bound: READY waits for them.
    ready_then_stopping(
        &t.path().join("p"),
        &rx,
        path.into_os_string(),
        Duration::from_millis(1500),
    )
    .unwrap_or_else(|e| panic!("path NOTIFY_SOCKET: {e:#}"));
    // An abstract address (`@name`), as systemd uses in containers.
    let name = format!("layerstack-ops-notify-{}", std::process::id());
    let rx = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
    fs::create_dir_all(t.path().join("a")).unwrap();
    ready_then_stopping(
        &t.path().join("a"),
        &rx,
        format!("@{name}").into(),
        Duration::ZERO,
    )
    .unwrap_or_else(|e| panic!("abstract NOTIFY_SOCKET: {e:#}"));
}

#[test]
fn ops_no_ready_when_the_daemon_cannot_start() {
    if !require_root_and_containerd() {
        return;
    }
    let t = TempDir::new().unwrap();
    let path = t.path().join("notify");
    let rx = UnixDatagram::bind(&path).unwrap();
    // The admin socket's path is taken by a regular file: the daemon refuses.
    fs::write(t.path().join("a.sock"), b"not a socket").unwrap();
    let mut d = Spawned::start(
        t.path(),
        &[("NOTIFY_SOCKET", path.into_os_string())],
        &["--metrics-address", "127.0.0.1:0"],
    )
    .unwrap();
    let status = wait_timeout(&mut d.child, Duration::from_secs(30))
        .unwrap()
        .expect("the daemon exits");
    assert!(!status.success(), "log:\n{}", d.log_text());
    assert!(d.log_text().contains("is not a socket"), "{}", d.log_text());
    rx.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    assert_eq!(recv_text(&rx), None, "nothing may be reported");
}

// ---------------------------------------------------------------------------
// Metrics and logs after a publish
// ---------------------------------------------------------------------------

/// `GET /metrics` on `addr`: (content type, body).
fn scrape(addr: &str) -> Result<(String, String)> {
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
    let ctype = head
        .lines()
        .find_map(|l| l.strip_prefix("content-type: "))
        .unwrap_or("")
        .to_string();
    Ok((ctype, body.to_string()))
}

/// The value of the series `series` (`name{labels}` exactly as exposed), if present.
fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

fn metrics_address(env: &TestEnv) -> Result<String> {
    let st = status_json(&env.admin_socket())?;
    ensure!(
        st["version"] == env!("CARGO_PKG_VERSION"),
        "status --json names the daemon's version: {st}"
    );
    st["metrics_address"]
        .as_str()
        .map(str::to_string)
        .context("status --json has no metrics_address (metrics off?)")
}

#[test]
fn ops_metrics_and_the_publish_log_line_move_after_a_publish() {
    run_scenario(|env| {
        start_daemon_and_import(env, NS, &busybox_image_tar()?, BUSYBOX_IMAGE)?;
        let addr = metrics_address(env)?;
        let (ctype, before) = scrape(&addr)?;
        ensure!(
            ctype.starts_with("application/openmetrics-text"),
            "content type {ctype}"
        );
        let committed = "layerstack_publishes_total{outcome=\"committed\"}";
        let c0 = sample(&before, committed).context("committed series absent")?;
        let d0 = sample(&before, "layerstack_publish_duration_seconds_count").unwrap_or(0.0);
        let h0 = sample(&before, "layerstack_publish_gate_hold_seconds_count").unwrap_or(0.0);
        let b0 = sample(&before, "layerstack_publish_capture_bytes_sum").unwrap_or(0.0);
        let nf = "layerstack_errors_total{api=\"admin\",kind=\"not_found\"}";
        let e0 = sample(&before, nf).unwrap_or(0.0);

        let id = unique("ops-metrics");
        CtrRun::sh(NS, &id, "echo measured > /root/ops.txt")
            .image(BUSYBOX_IMAGE)
            .branch(Some("ops-metrics"))
            .rm(true)
            .ok(env)?;
        let word = ls_wait_ok(env, NS, &id)?;
        ensure!(word == "committed", "outcome {word}");
        // An admin error of kind not_found.
        let out = env.layerstack(&["wait", "--namespace", NS, "ops-no-such-container"])?;
        ensure!(
            !out.status.success(),
            "wait on a missing container: {}",
            describe(&out)
        );

        // The outcome event is handled asynchronously: poll briefly.
        let deadline = Instant::now() + Duration::from_secs(20);
        let after = loop {
            let (_, body) = scrape(&addr)?;
            if sample(&body, committed) == Some(c0 + 1.0) || Instant::now() > deadline {
                break body;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        ensure!(
            sample(&after, committed) == Some(c0 + 1.0),
            "{committed} did not move from {c0}:\n{after}"
        );
        ensure!(
            sample(&after, "layerstack_publish_duration_seconds_count") == Some(d0 + 1.0),
            "publish duration not observed:\n{after}"
        );
        ensure!(
            sample(&after, "layerstack_publish_gate_hold_seconds_count") == Some(h0 + 1.0),
            "gate hold not observed:\n{after}"
        );
        // "measured\n": the one file the container wrote, 9 bytes.
        ensure!(
            sample(&after, "layerstack_publish_capture_bytes_sum") == Some(b0 + 9.0),
            "capture bytes did not move by 9 from {b0}:\n{after}"
        );
        ensure!(
            sample(&after, nf).unwrap_or(0.0) >= e0 + 1.0,
            "{nf} did not move from {e0}:\n{after}"
        );
        ensure!(
            sample(&after, "layerstack_store_up") == Some(1.0),
            "store not read:\n{after}"
        );
        // Two inits made ahead ([sandbox] ready_inits' default), none taken:
        // no daemon-owned session ran on this daemon.
        ensure!(
            sample(&after, "layerstack_sandbox_ready_inits") == Some(2.0),
            "ready inits:\n{after}"
        );
        ensure!(
            sample(&after, "layerstack_sessions{owner_kind=\"container\"}").is_some(),
            "no live-session gauge:\n{after}"
        );
        let depth = after
            .lines()
            .find(|l| {
                l.starts_with("layerstack_branch_depth{")
                    && l.contains(&format!("namespace=\"{NS}\""))
                    && l.contains("branch=\"ops-metrics\"")
            })
            .with_context(|| format!("no depth for branch ops-metrics:\n{after}"))?;
        let depth: f64 = depth.rsplit(' ').next().unwrap_or("").parse()?;
        ensure!(depth >= 1.0, "depth of ops-metrics: {depth}");
        ensure!(
            sample(&after, "layerstack_build_info{version=\"0.1.0\"}") == Some(1.0)
                || env!("CARGO_PKG_VERSION") != "0.1.0",
            "build info:\n{after}"
        );
        ensure!(after.trim_end().ends_with("# EOF"), "OpenMetrics EOF");

        // The log goes to a file: no colour codes anywhere in it.
        let log = fs::read_to_string(env.daemon_log())?;
        ensure!(
            !log.contains("\x1b["),
            "ANSI escape in the daemon log (stderr is a file)"
        );
        // One info line for the publish, with what an operator needs.
        let line = log
            .lines()
            .find(|l| {
                l.contains("publish outcome")
                    && l.contains(&format!("owner=container:{NS}/{id}"))
                    && l.contains("outcome=\"committed\"")
            })
            .with_context(|| format!("no `publish outcome` line for {id}"))?;
        for field in [
            " INFO ",
            "session.id=",
            "branch=ops-metrics",
            "layer.id=",
            "paths.clean=1",
            "paths.conflict=0",
            "duration_ms=",
        ] {
            ensure!(line.contains(field), "{field:?} missing from: {line}");
        }

        // History runs and the store's bytes by accounting class.
        // (Taken at most once a minute: the value may be the first scrape's, when
        // the image was only containerd's snapshots and no stack existed yet.)
        let mut classes = 0.0;
        for class in ["hot", "cold", "uppers", "staging", "metadata", "snapshots"] {
            let series = format!("layerstack_store_bytes{{class=\"{class}\"}}");
            classes += sample(&after, &series).with_context(|| format!("no {series}:\n{after}"))?;
        }
        // HELP texts cite documents users have (docs/…), not the design's.
        let help = after
            .lines()
            .find(|l| l.starts_with("# HELP layerstack_store_bytes "))
            .with_context(|| format!("no HELP of layerstack_store_bytes:\n{after}"))?;
        ensure!(
            help.contains("docs/architecture.md") && help.contains("accounting"),
            "{help}"
        );
        ensure!(
            !after.contains("ARCHITECTURE.md"),
            "a HELP text cites ARCHITECTURE.md, which users do not have:\n{after}"
        );
        let meta = sample(&after, "layerstack_store_bytes{class=\"metadata\"}").unwrap_or(0.0);
        ensure!(
            meta > 0.0 && classes > meta,
            "the store's SQLite files and the imported image hold bytes:\n{after}"
        );
        let gc0 = sample(&after, "layerstack_gc_runs_total").context("no GC-runs counter")?;
        let sq0 = sample(&after, "layerstack_squash_runs_total").context("no squash counter")?;
        let fb0 =
            sample(&after, "layerstack_gc_freed_bytes_total").context("no GC-bytes counter")?;
        // A second publish on the branch, then squash it (with the default keep
        // of newer layers a depth of 2 may be left alone: the counter must not
        // move then) and collect.
        let id2 = unique("ops-metrics");
        CtrRun::sh(NS, &id2, "echo again > /root/ops2.txt")
            .image(BUSYBOX_IMAGE)
            .branch(Some("ops-metrics"))
            .rm(true)
            .ok(env)?;
        ensure!(ls_wait_ok(env, NS, &id2)? == "committed", "second publish");
        let sq = env.layerstack(&[
            "squash",
            "--namespace",
            NS,
            &format!("{BUSYBOX_IMAGE}@ops-metrics"),
            "--json",
        ])?;
        ensure!(sq.status.success(), "squash: {}", describe(&sq));
        let squashed: serde_json::Value = serde_json::from_slice(&sq.stdout)?;
        let gc = env.layerstack(&["gc", "--json"])?;
        ensure!(gc.status.success(), "gc: {}", describe(&gc));
        let freed: serde_json::Value = serde_json::from_slice(&gc.stdout)?;
        let (_, runs) = scrape(&addr)?;
        ensure!(
            sample(&runs, "layerstack_gc_runs_total") == Some(gc0 + 1.0),
            "GC runs did not move from {gc0}:\n{runs}"
        );
        ensure!(
            sample(&runs, "layerstack_gc_freed_bytes_total")
                == freed["bytes_freed"].as_f64().map(|b| fb0 + b),
            "GC freed bytes {freed} vs:\n{runs}"
        );
        let expect = sq0
            + if squashed["squashed"] == true {
                1.0
            } else {
                0.0
            };
        ensure!(
            sample(&runs, "layerstack_squash_runs_total") == Some(expect),
            "squash runs {squashed} from {sq0}:\n{runs}"
        );
        Ok(())
    });
}

#[test]
fn ops_log_keys_of_the_config_file_set_format_and_level() {
    if !require_root_and_containerd() {
        return;
    }
    let t = TempDir::new().unwrap();
    let run = |sub: &str, config: &str| -> String {
        let dir = t.path().join(sub);
        fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("config.toml");
        fs::write(&cfg, config).unwrap();
        let notify = dir.join("notify");
        let rx = UnixDatagram::bind(&notify).unwrap();
        rx.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut d = Spawned::start(
            &dir,
            &[("NOTIFY_SOCKET", notify.into_os_string())],
            &["--config", cfg.to_str().unwrap()],
        )
        .unwrap();
        let ready = recv_text(&rx);
        assert!(
            ready.as_deref().is_some_and(|r| r.contains("READY=1")),
            "{ready:?}\n{}",
            d.log_text()
        );
        let st = status_json(&d.admin).unwrap();
        assert!(st["metrics_address"].is_null(), "metrics are off: {st}");
        assert!(d.terminate().unwrap().success());
        d.log_text()
    };
    let json = run(
        "json",
        "[log]\nformat = \"json\"\nlevel = \"info\"\n[metrics]\nenabled = false\n",
    );
    let lines: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(
        lines
            .iter()
            .any(|v| v["message"] == "serving" && v["level"] == "INFO"),
        "{json}"
    );
    assert!(!json.contains("\x1b["), "ANSI escape in a file log");
    let quiet = run(
        "warn",
        "[log]\nlevel = \"warn\"\n[metrics]\nenabled = false\n",
    );
    assert!(
        !quiet.contains("serving"),
        "info lines at level warn:\n{quiet}"
    );
}

// ---------------------------------------------------------------------------
// Generated containerd configuration, run by containerd 1.6
// ---------------------------------------------------------------------------

#[test]
fn ops_generated_containerd_config_runs_containerd_1_6_with_the_proxy_and_cri() {
    if !require_root_and_containerd() {
        return;
    }
    let t = TempDir::new().unwrap();
    let run = || -> Result<()> {
        let snap = t.path().join("ls").join("snap.sock");
        let ctd_dir = t.path().join("c");
        let _daemon = Daemon::start_at(
            &snap,
            &ctd_dir.join("containerd.sock"),
            &t.path().join("store"),
        )?;
        let out = run_with_timeout(
            Command::new(bin_path(CLI_BIN)?)
                .args(["config", "containerd", "--version", "1.6", "--address"])
                .arg(&snap)
                .arg("--root")
                .arg(t.path().join("store")),
            Duration::from_secs(30),
        )?;
        let generated = stdout(&ensure_success("layerstack config containerd", out)?);
        let config: toml::Table = generated.parse().context("generated TOML")?;
        let ctd = Containerd::start_with_config(&ctd_dir, &snap, config)?;
        let plugins = stdout(&ctd.ctr_ok("default", &["plugins", "ls"])?);
        let status_of = |ty: &str, id: &str| {
            plugins.lines().find_map(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                (cols.first() == Some(&ty) && cols.get(1) == Some(&id))
                    .then(|| cols.last().unwrap_or(&"").to_string())
            })
        };
        ensure!(
            status_of("io.containerd.snapshotter.v1", SNAPSHOTTER).as_deref() == Some("ok"),
            "proxy plugin not ok:\n{plugins}"
        );
        ensure!(
            status_of("io.containerd.grpc.v1", "cri").as_deref() == Some("ok"),
            "CRI plugin not ok with the generated CRI tables:\n{plugins}\n{}",
            fs::read_to_string(ctd.log_path()).unwrap_or_default()
        );
        // containerd parsed the CRI keys into its typed config (unknown keys would
        // be dropped from the dump).
        let dump = run_with_timeout(
            Command::new("containerd")
                .arg("--config")
                .arg(ctd.config_path())
                .args(["config", "dump"]),
            Duration::from_secs(30),
        )?;
        let dump: toml::Table = stdout(&ensure_success("containerd config dump", dump)?).parse()?;
        let cri = &dump["plugins"]["io.containerd.grpc.v1.cri"]["containerd"];
        ensure!(cri["snapshotter"].as_str() == Some(SNAPSHOTTER), "{cri}");
        ensure!(
            cri["runtimes"]["layerstack"]["runtime_type"].as_str()
                == Some("io.containerd.layerstack.v1"),
            "{cri}"
        );
        ensure!(
            cri["runtimes"]["runc"]["runtime_type"].as_str() == Some("io.containerd.runc.v2"),
            "{cri}"
        );
        // The branch annotation passes through to the OCI spec on both handlers.
        for h in ["layerstack", "runc"] {
            for key in ["pod_annotations", "container_annotations"] {
                ensure!(
                    cri["runtimes"][h][key]
                        .as_array()
                        .is_some_and(|a| a.iter().any(|v| v.as_str() == Some("layerstack.branch"))),
                    "{h} {key}: {cri}"
                );
            }
        }
        ensure!(
            dump["proxy_plugins"]["layerstack"]["address"].as_str() == snap.to_str(),
            "{}",
            dump["proxy_plugins"]
        );
        // And the snapshotter answers through it.
        ctd.ctr_ok(
            "lst-ops-gen",
            &[
                "snapshots",
                "--snapshotter",
                SNAPSHOTTER,
                "prepare",
                "ops-probe",
                "",
            ],
        )?;
        let ls = stdout(&ctd.ctr_ok(
            "lst-ops-gen",
            &["snapshots", "--snapshotter", SNAPSHOTTER, "ls"],
        )?);
        ensure!(ls.contains("ops-probe"), "{ls}");
        Ok(())
    };
    run().unwrap_or_else(|e| panic!("{e:#}"));
}

// ---------------------------------------------------------------------------
// Install, systemd unit, install-deps
// ---------------------------------------------------------------------------

/// Every file below `root`, relative, sorted.
fn files_below(root: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        let Ok(rd) = fs::read_dir(dir) else { return };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() && !p.is_symlink() {
                walk(root, &p, out);
            } else if let Ok(rel) = p.strip_prefix(root) {
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

fn install_sh(env: &[(&str, &Path)], args: &[&str]) -> Result<std::process::Output> {
    let bin_dir = bin_path(DAEMON_BIN)?
        .parent()
        .context("bin dir")?
        .to_path_buf();
    let mut cmd = Command::new("bash");
    cmd.arg(repo().join("scripts/install.sh"));
    if !args.contains(&"--uninstall") {
        cmd.arg("--bin-dir").arg(&bin_dir);
    }
    cmd.args(args)
        .env_remove("DESTDIR")
        .env_remove("PREFIX")
        .env_remove("SYSCONFDIR")
        .env_remove("UNITDIR")
        // Never a live systemd host here: no systemctl runs.
        .env("LAYERSTACK_SYSTEMD_RUN_DIR", "/nonexistent/layerstack-test");
    for (k, v) in env {
        cmd.env(k, v);
    }
    run_with_timeout(&mut cmd, Duration::from_secs(120))
}

#[test]
fn ops_install_into_destdir_installs_the_file_list_and_uninstall_removes_it() {
    let t = tempfile::tempdir().unwrap();
    let dest = t.path().join("dest");
    let out = install_sh(&[("DESTDIR", &dest)], &[]).unwrap();
    assert!(out.status.success(), "{}", describe(&out));
    let expected = [
        "etc/layerstack/config.toml",
        "etc/systemd/system/layerstack.service",
        "usr/local/bin/containerd-layerstack-grpc",
        "usr/local/bin/containerd-shim-layerstack-v1",
        "usr/local/bin/layerstack",
        "usr/local/share/doc/layerstack/operations.md",
        "usr/local/share/layerstack/install-manifest",
    ];
    assert_eq!(files_below(&dest), expected);
    for b in [
        "containerd-layerstack-grpc",
        "containerd-shim-layerstack-v1",
        "layerstack",
    ] {
        let mode = fs::metadata(dest.join("usr/local/bin").join(b))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755, "{b}");
    }
    let unit = fs::read_to_string(dest.join("etc/systemd/system/layerstack.service")).unwrap();
    assert!(unit.contains(
        "\nExecStart=/usr/local/bin/containerd-layerstack-grpc --config /etc/layerstack/config.toml\n"
    ));
    assert_eq!(
        fs::read_to_string(dest.join("etc/layerstack/config.toml")).unwrap(),
        fs::read_to_string(repo().join("config/snippets/layerstack.toml")).unwrap()
    );
    let manifest =
        fs::read_to_string(dest.join("usr/local/share/layerstack/install-manifest")).unwrap();
    assert_eq!(manifest.lines().count(), expected.len() - 1, "{manifest}");

    // Uninstall removes exactly that, and LayerStack's own directories.
    let out = install_sh(&[("DESTDIR", &dest)], &["--uninstall"]).unwrap();
    assert!(out.status.success(), "{}", describe(&out));
    assert_eq!(files_below(&dest), Vec::<String>::new());
    for d in [
        "etc/layerstack",
        "usr/local/share/layerstack",
        "usr/local/share/doc/layerstack",
    ] {
        assert!(!dest.join(d).exists(), "{d} left behind");
    }

    // An edited config survives a reinstall and the uninstall; a config that was
    // there before the install is not ours to remove.
    install_sh(&[("DESTDIR", &dest)], &[]).unwrap();
    let cfg = dest.join("etc/layerstack/config.toml");
    fs::write(&cfg, "root = \"/srv/ls\"\n").unwrap();
    let out = install_sh(&[("DESTDIR", &dest)], &[]).unwrap();
    assert!(out.status.success());
    assert_eq!(fs::read_to_string(&cfg).unwrap(), "root = \"/srv/ls\"\n");
    let out = install_sh(&[("DESTDIR", &dest)], &["--uninstall"]).unwrap();
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("kept (changed since install): /etc/layerstack/config.toml"));
    assert_eq!(files_below(&dest), ["etc/layerstack/config.toml"]);
    let out = install_sh(&[("DESTDIR", &dest)], &["--uninstall"]).unwrap();
    assert!(!out.status.success(), "nothing left to uninstall");

    // PREFIX, SYSCONFDIR and UNITDIR move every path, the unit's included.
    let dest2 = t.path().join("dest2");
    let out = install_sh(
        &[
            ("DESTDIR", &dest2),
            ("PREFIX", Path::new("/opt/ls")),
            ("SYSCONFDIR", Path::new("/opt/ls/etc")),
            ("UNITDIR", Path::new("/usr/lib/systemd/system")),
        ],
        &[],
    )
    .unwrap();
    assert!(out.status.success(), "{}", describe(&out));
    let unit = fs::read_to_string(dest2.join("usr/lib/systemd/system/layerstack.service")).unwrap();
    assert!(
        unit.contains("\nExecStart=/opt/ls/bin/containerd-layerstack-grpc --config /opt/ls/etc/layerstack/config.toml\n"),
        "{unit}"
    );
    assert!(unit.contains("Documentation=file:/opt/ls/share/doc/layerstack/operations.md"));
    assert!(dest2.join("opt/ls/bin/layerstack").is_file());
}

/// `systemd-analyze`, or None (skip; a failure under CI=true).
fn systemd_analyze() -> Option<PathBuf> {
    let p = which("systemd-analyze");
    if p.is_none() {
        let msg = "systemd-analyze not on PATH: apt-get install systemd (scripts/install-deps.sh)";
        assert!(!in_ci(), "CI=true and {msg}");
        eprintln!("SKIPPED: {msg}");
    }
    p
}

/// `systemd-analyze verify UNIT`: (success, everything it printed).
fn verify(analyze: &Path, unit: &Path) -> (bool, String) {
    let out = run_with_timeout(
        Command::new(analyze).arg("verify").arg(unit),
        Duration::from_secs(60),
    )
    .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn ops_systemd_unit_verifies_clean() {
    let Some(analyze) = systemd_analyze() else {
        return;
    };
    // A real install (no DESTDIR) into a temp PREFIX, so that ExecStart= names a
    // binary that exists, as verify requires.
    let t = tempfile::tempdir().unwrap();
    let prefix = t.path().join("prefix");
    let units = t.path().join("units");
    let out = install_sh(
        &[
            ("PREFIX", &prefix),
            ("SYSCONFDIR", &t.path().join("etc")),
            ("UNITDIR", &units),
        ],
        &[],
    )
    .unwrap();
    assert!(out.status.success(), "{}", describe(&out));
    let unit = units.join("layerstack.service");
    let text = fs::read_to_string(&unit).unwrap();
    for line in [
        "Type=notify",
        "Before=containerd.service",
        "Restart=on-failure",
        "RuntimeDirectory=layerstack",
        "StateDirectory=layerstack",
        "WantedBy=multi-user.target",
    ] {
        assert!(text.lines().any(|l| l == line), "unit lacks {line}");
    }
    for absent in [
        "PrivateDevices=",
        "DevicePolicy=",
        "RestrictSUIDSGID=",
        "ProtectProc=",
        "ProtectClock=",
    ] {
        assert!(
            !text.lines().any(|l| l.starts_with(absent)),
            "{absent} would break publishing (see the unit's comments)"
        );
    }
    let (ok, said) = verify(&analyze, &unit);
    assert!(
        ok && said.trim().is_empty(),
        "systemd-analyze verify:\n{said}"
    );
    // The check can fail: a broken copy is reported.
    let bad = t.path().join("broken.service");
    fs::write(&bad, text.replace("Type=notify", "Type=notifi")).unwrap();
    let (_, said) = verify(&analyze, &bad);
    assert!(
        said.contains("notifi"),
        "verify did not report a bad Type=: {said:?}"
    );
    // The file the unit's ExecStart= names is installed.
    let cfg = t.path().join("etc/layerstack/config.toml");
    assert!(
        text.contains(&format!("--config {}", cfg.display())),
        "{text}"
    );
    assert!(cfg.is_file());
}

/// A directory of stand-ins for `apt-get`, `dpkg-query` and `systemctl` that
/// log their arguments to `calls`; `dpkg-query` reports every package installed
/// except `missing`.
fn fake_tools(dir: &Path, calls: &Path, missing: &str) {
    let log = calls.display();
    let tools = [
        ("apt-get", format!("#!/bin/sh\necho \"apt-get $*\" >> {log}\n")),
        ("systemctl", format!("#!/bin/sh\necho \"systemctl $*\" >> {log}\ncase \"$1\" in is-active) exit 3;; esac\n")),
        (
            "dpkg-query",
            format!(
                "#!/bin/sh\nfor a; do p=$a; done\nif [ \"$p\" = \"{missing}\" ] && ! grep -q '^apt-get install' {log} 2>/dev/null; then echo -n not-installed; else echo -n installed; fi\n"
            ),
        ),
    ];
    for (name, body) in tools {
        let p = dir.join(name);
        fs::write(&p, body).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
    }
}

/// The index of the first line of `log` that starts with `needle`.
fn line_starting(log: &str, needle: &str) -> usize {
    log.lines()
        .position(|l| l.starts_with(needle))
        .unwrap_or_else(|| panic!("no `{needle}` in:\n{log}"))
}

fn install_deps(fakes: &Path, systemd_dir: &Path) -> std::process::Output {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![fakes.to_path_buf()];
    dirs.extend(std::env::split_paths(&path));
    // cargo must be found (the script checks it); the test runs under cargo.
    if let Some(c) = std::env::var_os("CARGO") {
        dirs.extend(Path::new(&c).parent().map(Path::to_path_buf));
    }
    run_with_timeout(
        Command::new("bash")
            .arg(repo().join("scripts/install-deps.sh"))
            .env("PATH", std::env::join_paths(dirs).unwrap())
            .env("LAYERSTACK_SYSTEMD_RUN_DIR", systemd_dir),
        Duration::from_secs(60),
    )
    .unwrap()
}

#[test]
fn ops_install_deps_leaves_no_system_containerd_running() {
    if !require_root_and_containerd() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let (fakes, systemd) = (t.path().join("bin"), t.path().join("run-systemd-system"));
    fs::create_dir_all(&fakes).unwrap();
    fs::create_dir_all(&systemd).unwrap();

    // A systemd host where the script installs containerd: masked for the
    // install, then unmasked and disabled, in that order.
    let calls = t.path().join("calls-1");
    fake_tools(&fakes, &calls, "containerd");
    let out = install_deps(&fakes, &systemd);
    assert!(out.status.success(), "{}", describe(&out));
    let log = fs::read_to_string(&calls).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    let at = |needle: &str| line_starting(&log, needle);
    let mask = at("systemctl mask --runtime");
    let install = at("apt-get install");
    let unmask = at("systemctl unmask --runtime");
    let disable = at("systemctl disable");
    assert!(
        mask < install && install < unmask && unmask < disable,
        "{log}"
    );
    assert!(
        lines[mask].contains("containerd.service") && lines[disable].contains("containerd.service")
    );
    assert!(lines[install].contains("containerd"), "{log}");

    // The same for the registry package (docker-registry.service).
    let calls = t.path().join("calls-registry");
    fake_tools(&fakes, &calls, "docker-registry");
    let out = install_deps(&fakes, &systemd);
    assert!(out.status.success(), "{}", describe(&out));
    let log = fs::read_to_string(&calls).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    let at = |needle: &str| line_starting(&log, needle);
    let (mask, install, disable) = (
        at("systemctl mask --runtime"),
        at("apt-get install"),
        at("systemctl disable"),
    );
    assert!(mask < install && install < disable, "{log}");
    assert!(
        lines[mask].contains("docker-registry.service")
            && !lines[mask].contains("containerd.service")
            && lines[disable].contains("docker-registry.service"),
        "{log}"
    );

    // containerd already there (only another package missing): never touched.
    let calls = t.path().join("calls-2");
    fake_tools(&fakes, &calls, "git");
    let out = install_deps(&fakes, &systemd);
    assert!(out.status.success(), "{}", describe(&out));
    let log = fs::read_to_string(&calls).unwrap();
    assert!(
        log.contains("apt-get install") && !log.contains("systemctl"),
        "{log}"
    );

    // No systemd: nothing to mask.
    let calls = t.path().join("calls-3");
    fake_tools(&fakes, &calls, "containerd");
    let out = install_deps(&fakes, &t.path().join("no-systemd"));
    assert!(out.status.success(), "{}", describe(&out));
    let log = fs::read_to_string(&calls).unwrap();
    assert!(
        log.contains("apt-get install") && !log.contains("systemctl"),
        "{log}"
    );
}

#[test]
fn ops_scripts_stop_processes_by_pid_only() {
    for script in ["demo.sh", "install.sh", "install-deps.sh", "test.sh"] {
        let text = fs::read_to_string(repo().join("scripts").join(script)).unwrap();
        for word in ["pkill", "killall", "kill 0", "kill -- -"] {
            assert!(
                !text
                    .lines()
                    .filter(|l| !l.trim_start().starts_with('#'))
                    .any(|l| l.contains(word)),
                "scripts/{script} uses `{word}`: stop what was started by its pid"
            );
        }
    }
    let demo = fs::read_to_string(repo().join("scripts/demo.sh")).unwrap();
    assert!(
        demo.contains("shim.pid"),
        "demo.sh stops its shims by their recorded pid"
    );
}
