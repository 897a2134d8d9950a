//! WasiRunner against real modules (WAT text compiled by the `wat` crate):
//! file I/O in the preopen, exit codes, captured output, the module cache,
//! fuel / deadline / memory limits, and escapes out of the preopen.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use layerstack_wasi::{Invocation, ModuleRef, TrapKind, WasiLimits, WasiRunner};

/// A WASI command that writes `content` to `path` (relative to the preopen,
/// fd 3), prints "ok\n" to stdout and exits with the errno of the first
/// failing call (0 when all succeed).
fn write_file_module(path: &str, content: &str) -> Vec<u8> {
    let wat = format!(
        r#"(module
  (import "wasi_snapshot_preview1" "path_open"
    (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write"
    (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 100) "{path}")
  (data (i32.const 300) "{content}")
  (data (i32.const 500) "ok\n")
  (func (export "_start")
    (local $err i32)
    ;; path_open(fd 3, follow symlinks, path, O_CREAT|O_TRUNC, all rights) -> fd at 16
    (local.set $err (call $path_open (i32.const 3) (i32.const 1) (i32.const 100) (i32.const {plen})
      (i32.const 9) (i64.const 0x1fffffff) (i64.const 0x1fffffff) (i32.const 0) (i32.const 16)))
    (if (local.get $err) (then (call $proc_exit (local.get $err))))
    ;; iovec at 0: {{ptr 300, len clen}}
    (i32.store (i32.const 0) (i32.const 300))
    (i32.store (i32.const 4) (i32.const {clen}))
    (local.set $err (call $fd_write (i32.load (i32.const 16)) (i32.const 0) (i32.const 1) (i32.const 20)))
    (if (local.get $err) (then (call $proc_exit (local.get $err))))
    (i32.store (i32.const 0) (i32.const 500))
    (i32.store (i32.const 4) (i32.const 3))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 20)))
    (call $proc_exit (i32.const 0))))"#,
        plen = path.len(),
        clen = content.len(),
    );
    wat::parse_str(wat).expect("valid WAT")
}

/// A WASI command that opens `path` for reading and exits with the errno
/// (0 if the open succeeded).
fn open_read_module(path: &str) -> Vec<u8> {
    let wat = format!(
        r#"(module
  (import "wasi_snapshot_preview1" "path_open"
    (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 100) "{path}")
  (func (export "_start")
    (call $proc_exit (call $path_open (i32.const 3) (i32.const 1) (i32.const 100) (i32.const {plen})
      (i32.const 0) (i64.const 0x1fffffff) (i64.const 0x1fffffff) (i32.const 0) (i32.const 16)))))"#,
        plen = path.len(),
    );
    wat::parse_str(wat).expect("valid WAT")
}

fn loop_module() -> Vec<u8> {
    wat::parse_str(
        r#"(module (memory (export "memory") 1) (func (export "_start") (loop $l (br $l))))"#,
    )
    .expect("valid WAT")
}

/// Grows memory by 16 pages (1 MiB) until memory.grow fails, then traps
/// with unreachable (a module that does not check would do the same).
fn grow_module() -> Vec<u8> {
    wat::parse_str(
        r#"(module (memory (export "memory") 1)
  (func (export "_start")
    (loop $l (br_if $l (i32.ne (memory.grow (i32.const 16)) (i32.const -1))))
    unreachable))"#,
    )
    .expect("valid WAT")
}

fn limits() -> WasiLimits {
    WasiLimits {
        fuel: Some(100_000_000),
        deadline_ms: Some(10_000),
        memory_bytes: 64 << 20,
        output_bytes: 4096,
    }
}

#[test]
fn writes_in_the_preopen_and_caches_the_module() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runner = WasiRunner::new().expect("runner");
    let m = write_file_module("hello.txt", "hello from wasm");
    let out = runner
        .run(ModuleRef::Bytes(&m), dir.path(), &[], &[], &limits())
        .expect("run");
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    assert_eq!(out.trap, None);
    assert_eq!(out.stdout, b"ok\n");
    assert!(out.compiled);
    assert!(out.fuel_used > 0);
    assert_eq!(
        std::fs::read_to_string(dir.path().join("hello.txt")).expect("written"),
        "hello from wasm"
    );

    // Second run: same bytes, served from the cache; by digest too.
    let again = runner
        .run(ModuleRef::Bytes(&m), dir.path(), &[], &[], &limits())
        .expect("run");
    assert!(!again.compiled);
    assert_eq!(again.digest, out.digest);
    let by_digest = runner
        .run(
            ModuleRef::Digest(out.digest),
            dir.path(),
            &[],
            &[],
            &limits(),
        )
        .expect("run");
    assert_eq!(by_digest.exit_code, Some(0));
    assert_eq!(runner.compiles(), 1);

    // A digest never seen is refused with a message that says what to do.
    let err = runner
        .run(ModuleRef::Digest([7; 32]), dir.path(), &[], &[], &limits())
        .expect_err("unknown digest");
    assert!(
        err.to_string().contains("run it once by its bytes"),
        "{err}"
    );
}

#[test]
fn fuel_runs_out_on_an_endless_loop() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runner = WasiRunner::new().expect("runner");
    let out = runner
        .run(
            ModuleRef::Bytes(&loop_module()),
            dir.path(),
            &[],
            &[],
            &limits(),
        )
        .expect("run");
    assert_eq!(out.trap, Some(TrapKind::OutOfFuel), "{out:?}");
    assert_eq!(out.exit_code, None);
    assert_eq!(out.fuel_used, 100_000_000);
}

#[test]
fn the_deadline_stops_an_endless_loop_without_fuel() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runner = WasiRunner::new().expect("runner");
    // No fuel limit, and one it never reaches: the deadline ends both, and
    // fuel_used is what they burnt in those 200 ms — far more than a few
    // thousand (an endless loop runs ~10^8 units in tens of ms here).
    for fuel in [None, Some(u64::MAX / 2)] {
        let l = WasiLimits {
            fuel,
            deadline_ms: Some(200),
            ..limits()
        };
        let out = runner
            .run(ModuleRef::Bytes(&loop_module()), dir.path(), &[], &[], &l)
            .expect("run");
        assert_eq!(out.trap, Some(TrapKind::Deadline), "{out:?}");
        assert!(
            out.wall_ms >= 150.0 && out.wall_ms < 5_000.0,
            "{}",
            out.wall_ms
        );
        assert!(
            out.fuel_used > 1_000_000,
            "fuel {fuel:?}: fuel_used {}",
            out.fuel_used
        );
    }
}

/// Sets `flag` from another thread after `ms` milliseconds.
fn set_after(flag: &Arc<AtomicBool>, ms: u64) -> std::thread::JoinHandle<()> {
    let flag = flag.clone();
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(ms));
        flag.store(true, Ordering::Relaxed);
    })
}

/// Copies stdin to stdout (4 KiB at a time) and exits 0.
fn cat_module() -> Vec<u8> {
    wat::parse_str(
        r#"(module
  (import "wasi_snapshot_preview1" "fd_read" (func $fd_read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    (loop $l
      (i32.store (i32.const 0) (i32.const 1024))
      (i32.store (i32.const 4) (i32.const 4096))
      (drop (call $fd_read (i32.const 0) (i32.const 0) (i32.const 1) (i32.const 16)))
      (if (i32.load (i32.const 16))
        (then
          (i32.store (i32.const 4) (i32.load (i32.const 16)))
          (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 20)))
          (br $l))))))"#,
    )
    .expect("valid WAT")
}

#[test]
fn stdin_reaches_the_module_and_a_cancel_flag_stops_a_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runner = WasiRunner::new().expect("runner");
    let inv = Invocation {
        argv0: Some("cat".into()),
        stdin: b"line one\nline two\n".to_vec(),
        limits: limits(),
        ..Default::default()
    };
    let out = runner
        .run_with(ModuleRef::Bytes(&cat_module()), dir.path(), &inv)
        .expect("run");
    assert_eq!((out.exit_code, out.trap), (Some(0), None), "{out:?}");
    assert_eq!(out.stdout, b"line one\nline two\n");

    // An endless loop with no deadline and no fuel ends when its flag is set.
    let cancel = Arc::new(AtomicBool::new(false));
    let inv = Invocation {
        cancel: Some(cancel.clone()),
        limits: WasiLimits {
            fuel: None,
            deadline_ms: None,
            ..limits()
        },
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let setter = set_after(&cancel, 100);
    let out = runner
        .run_with(ModuleRef::Bytes(&loop_module()), dir.path(), &inv)
        .expect("run");
    let ended = started.elapsed();
    setter.join().expect("the setter thread");
    assert_eq!(out.trap, Some(TrapKind::Cancelled), "{out:?}");
    assert_eq!(out.exit_code, None);
    // It ran until the flag was set, not less. (On this test's clock: the
    // run's own, `wall_ms`, starts after the module is compiled, which the
    // setter's 100 ms already include — 88.6 ms in a CI run.)
    assert!(ended >= std::time::Duration::from_millis(100), "{ended:?}");
    assert!(
        out.wall_ms <= ended.as_secs_f64() * 1000.0,
        "{} ms",
        out.wall_ms
    );
}

/// Sleeps 30 s in one host call (`poll_oneoff` on a relative monotonic
/// clock), then exits 0.
fn sleep_module() -> Vec<u8> {
    wat::parse_str(
        r#"(module
  (import "wasi_snapshot_preview1" "poll_oneoff" (func $poll (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    ;; subscription at 0: userdata 0, tag 0 (clock), clock id 1 (monotonic),
    ;; timeout 30 s in ns, precision 0, flags 0 (relative)
    (i32.store8 (i32.const 8) (i32.const 0))
    (i32.store (i32.const 16) (i32.const 1))
    (i64.store (i32.const 24) (i64.const 30000000000))
    (drop (call $poll (i32.const 0) (i32.const 64) (i32.const 1) (i32.const 128)))))"#,
    )
    .expect("valid WAT")
}

#[test]
fn the_deadline_and_a_cancel_stop_a_module_waiting_in_a_host_call() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runner = WasiRunner::new().expect("runner");
    let l = WasiLimits {
        deadline_ms: Some(300),
        ..limits()
    };
    let out = runner
        .run(ModuleRef::Bytes(&sleep_module()), dir.path(), &[], &[], &l)
        .expect("run");
    assert_eq!(out.trap, Some(TrapKind::Deadline), "{out:?}");
    assert!(
        out.wall_ms < 5_000.0,
        "the 30 s sleep ran {} ms",
        out.wall_ms
    );

    let cancel = Arc::new(AtomicBool::new(false));
    let inv = Invocation {
        cancel: Some(cancel.clone()),
        limits: WasiLimits {
            deadline_ms: None,
            ..limits()
        },
        ..Default::default()
    };
    let setter = set_after(&cancel, 200);
    let out = runner
        .run_with(ModuleRef::Bytes(&sleep_module()), dir.path(), &inv)
        .expect("run");
    setter.join().expect("the setter thread");
    assert_eq!(out.trap, Some(TrapKind::Cancelled), "{out:?}");
    assert!(
        out.wall_ms < 5_000.0,
        "the 30 s sleep ran {} ms",
        out.wall_ms
    );
}

/// Two concurrent runs of one session share its memory cap: while one
/// holds 40 of its 64 MiB, the other cannot take 40 more; once both ended,
/// the session's pool is empty again.
#[test]
fn concurrent_runs_share_one_memory_cap() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runner = std::sync::Arc::new(WasiRunner::new().expect("runner"));
    // Grows by 640 pages (40 MiB), then spins until its deadline.
    let hold = wat::parse_str(
        r#"(module (memory (export "memory") 1)
  (func (export "_start")
    (drop (memory.grow (i32.const 640)))
    (loop $l (br $l))))"#,
    )
    .expect("valid WAT");
    let pool = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let inv = |deadline_ms: u64| Invocation {
        limits: WasiLimits {
            fuel: None,
            deadline_ms: Some(deadline_ms),
            ..limits()
        },
        memory_pool: Some(pool.clone()),
        ..Default::default()
    };
    let first = {
        let (runner, module, root, inv) = (
            runner.clone(),
            hold.clone(),
            dir.path().to_path_buf(),
            inv(1500),
        );
        std::thread::spawn(move || runner.run_with(ModuleRef::Bytes(&module), &root, &inv))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while pool.load(std::sync::atomic::Ordering::Relaxed) < 40 << 20 {
        assert!(
            std::time::Instant::now() < deadline,
            "the first run never held its memory"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let second = runner
        .run_with(ModuleRef::Bytes(&grow_module()), dir.path(), &inv(1500))
        .expect("run");
    assert_eq!(second.trap, Some(TrapKind::MemoryLimit), "{second:?}");
    assert!(
        second
            .trap_message
            .as_deref()
            .unwrap_or("")
            .contains("the session's runs hold"),
        "{second:?}"
    );
    let first = first.join().expect("thread").expect("run");
    assert_eq!(first.trap, Some(TrapKind::Deadline), "{first:?}");
    assert_eq!(
        pool.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "memory left counted"
    );
}

/// A grow past the module's own maximum fails (-1) after the limiter let it
/// through: what it counted goes back to the session's pool at once, not
/// at the run's end.
#[test]
fn a_failed_grow_gives_its_share_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runner = std::sync::Arc::new(WasiRunner::new().expect("runner"));
    // Declares at most 2 pages, asks for 900 more (-1), then spins.
    let capped = wat::parse_str(
        r#"(module (memory (export "memory") 1 2)
  (func (export "_start")
    (drop (memory.grow (i32.const 900)))
    (loop $l (br $l))))"#,
    )
    .expect("valid WAT");
    let pool = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let inv = Invocation {
        limits: WasiLimits {
            fuel: None,
            deadline_ms: Some(1000),
            ..limits()
        },
        memory_pool: Some(pool.clone()),
        ..Default::default()
    };
    let first = {
        let (runner, root, inv) = (runner.clone(), dir.path().to_path_buf(), inv.clone());
        std::thread::spawn(move || runner.run_with(ModuleRef::Bytes(&capped), &root, &inv))
    };
    std::thread::sleep(std::time::Duration::from_millis(300));
    // The first run holds its one page only.
    assert_eq!(pool.load(std::sync::atomic::Ordering::Relaxed), 65536);
    let first = first.join().expect("thread").expect("run");
    assert_eq!(first.trap, Some(TrapKind::Deadline), "{first:?}");
    assert_eq!(pool.load(std::sync::atomic::Ordering::Relaxed), 0);
}

#[test]
fn unbounded_allocation_hits_the_memory_cap() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runner = WasiRunner::new().expect("runner");
    let out = runner
        .run(
            ModuleRef::Bytes(&grow_module()),
            dir.path(),
            &[],
            &[],
            &limits(),
        )
        .expect("run");
    assert_eq!(out.trap, Some(TrapKind::MemoryLimit), "{out:?}");
    assert!(
        out.trap_message
            .as_deref()
            .unwrap_or("")
            .contains("memory cap"),
        "{out:?}"
    );
}

#[test]
fn nothing_outside_the_preopen_is_reachable() {
    let outer = tempfile::tempdir().expect("tempdir");
    let root = outer.path().join("root");
    std::fs::create_dir(&root).expect("mkdir");
    std::fs::write(outer.path().join("secret"), "host data").expect("write");
    std::os::unix::fs::symlink("/etc/passwd", root.join("abs-link")).expect("symlink");
    std::os::unix::fs::symlink("../secret", root.join("rel-link")).expect("symlink");
    let runner = WasiRunner::new().expect("runner");
    const ENOENT: i32 = 44;
    const EPERM: i32 = 63;
    const ENOTCAPABLE: i32 = 76;
    for path in [
        "../secret",
        "../../etc/passwd",
        "/etc/passwd",
        "abs-link",
        "rel-link",
    ] {
        let out = runner
            .run(
                ModuleRef::Bytes(&open_read_module(path)),
                &root,
                &[],
                &[],
                &limits(),
            )
            .expect("run");
        let code = out.exit_code.expect("exits");
        assert!(
            [ENOENT, EPERM, ENOTCAPABLE].contains(&code),
            "opening {path} from inside the module gave errno {code}, not ENOENT/EPERM/ENOTCAPABLE"
        );
    }
    // Writing through an escape fails too and leaves the host file intact.
    let out = runner
        .run(
            ModuleRef::Bytes(&write_file_module("../secret", "pwned")),
            &root,
            &[],
            &[],
            &limits(),
        )
        .expect("run");
    assert_ne!(out.exit_code, Some(0));
    assert_eq!(
        std::fs::read_to_string(outer.path().join("secret")).expect("read"),
        "host data"
    );
    // Sanity: the same module opens a file that is inside.
    std::fs::write(root.join("inside"), "x").expect("write");
    let ok = runner
        .run(
            ModuleRef::Bytes(&open_read_module("inside")),
            &root,
            &[],
            &[],
            &limits(),
        )
        .expect("run");
    assert_eq!(ok.exit_code, Some(0));
}

#[test]
fn a_module_that_is_not_wasm_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runner = WasiRunner::new().expect("runner");
    let err = runner
        .run(
            ModuleRef::Bytes(b"not wasm"),
            dir.path(),
            &[],
            &[],
            &limits(),
        )
        .expect_err("refused");
    assert!(
        err.to_string().contains("does not compile") && !err.to_string().contains('\n'),
        "{err}"
    );
    let bad_import =
        wat::parse_str(r#"(module (import "env" "socket" (func)) (func (export "_start")))"#)
            .expect("valid WAT");
    let err = runner
        .run(
            ModuleRef::Bytes(&bad_import),
            dir.path(),
            &[],
            &[],
            &limits(),
        )
        .expect_err("refused");
    assert!(err.to_string().contains("cannot be linked"), "{err}");
}

#[test]
fn output_beyond_its_bound_is_not_kept() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runner = WasiRunner::new().expect("runner");
    let inv = Invocation {
        stdin: vec![b'x'; 100],
        limits: WasiLimits {
            output_bytes: 10,
            ..limits()
        },
        ..Default::default()
    };
    let out = runner
        .run_with(ModuleRef::Bytes(&cat_module()), dir.path(), &inv)
        .expect("run");
    assert_eq!(out.stdout, vec![b'x'; 10]);
    assert!(out.stdout_truncated && !out.stderr_truncated, "{out:?}");
    let whole = runner
        .run_with(
            ModuleRef::Bytes(&cat_module()),
            dir.path(),
            &Invocation {
                stdin: b"short".to_vec(),
                limits: limits(),
                ..Default::default()
            },
        )
        .expect("run");
    assert_eq!(whole.stdout, b"short");
    assert!(!whole.stdout_truncated, "{whole:?}");
}
