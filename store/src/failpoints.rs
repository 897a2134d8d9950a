//! Failpoints for tests (issue 22, "every durable step is a crash point"): a
//! named point at each durable step — a write, fsync, rename, link, unlink or
//! transaction commit — of the capture, publish, checkpoint, merge, promote,
//! squash, GC, import, export, session and containerd snapshot paths, and of the
//! startup recovery.
//!
//! Every point is declared once in [`POINTS`] with a one-line description, so
//! the crash suite (`engine/src/tests.rs`, `mod crash`) enumerates them all and
//! fails when one is not exercised; a unit test here fails when a `hit("…")`
//! or `fail("…", …)` in the workspace names an undeclared point or a declared
//! point is never placed.
//!
//! Two actions, armable only with the `failpoints` feature (tests); without it
//! [`hit`] and [`fail`] are empty inline functions and a shipped build has no
//! failpoint:
//! * crash — [`arm`]: the process aborts (SIGABRT, no unwinding, no destructor,
//!   no transaction commits after it) when it reaches the point, as if killed
//!   with SIGKILL between two steps. Process-wide: crash tests run the
//!   operation in a child process.
//! * I/O error — [`arm_io`]: the next [`fail`] of the point under one store
//!   root returns `std::io::Error` with the errno given (EIO, ENOSPC), once.
//!   Scoped by store root, so fault tests run in parallel in one process.
//!   Only points declared with `io: true` take it (they are placed where the
//!   step's own I/O error is handled).

use std::path::Path;

/// One declared failpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Point {
    /// `path.step`, as passed to [`hit`] / [`fail`].
    pub name: &'static str,
    /// What has happened when the point is reached (one line).
    pub what: &'static str,
    /// Placed with [`fail`]: an I/O error can be injected there.
    pub io: bool,
    /// On the startup recovery path (the store's startup sweep, the engine's
    /// recovery): the suite crashes there during the recovery that follows a
    /// first crash.
    pub recovery: bool,
}

macro_rules! points {
    ($( $name:literal $(, $flag:ident)* => $what:literal; )*) => {
        /// Every failpoint, declared once (see the module docs).
        pub const POINTS: &[Point] = &[$(Point {
            name: $name,
            what: $what,
            io: points!(@has io $($flag)*),
            recovery: points!(@has recovery $($flag)*),
        }),*];
    };
    (@has io io $($rest:ident)*) => { true };
    (@has recovery recovery $($rest:ident)*) => { true };
    (@has $want:ident $other:ident $($rest:ident)*) => { points!(@has $want $($rest)*) };
    (@has $want:ident) => { false };
}

points! {
    // Capture and publish (store/src/publish.rs, engine/src/publish.rs).
    "publish.staged", io => "the captured layer's pending rows (layer, path index, outcome) are committed; the upper is untouched";
    "publish.rechecked" => "under the gate, the head was re-read; nothing of the commit is written yet";
    "publish.applied" => "the plan's merged files are written into the upper; the commit transaction has not begun";
    "publish.before_rename", io => "inside the commit transaction, rows written, before the upper is renamed into l/<n>";
    "publish.renamed", io => "inside the commit transaction, the upper renamed into l/<n> (and synced), before the commit";
    "publish.committed" => "the commit transaction committed; the session's fresh upper is not made yet";
    "reap.staged" => "a tree the store let go of (an old workdir, a closed session) is renamed into staging/, not removed yet";
    // Graph: checkpoint, merge, promote (store/src/graph.rs, engine/src/graph.rs, engine/src/history.rs).
    "checkpoint.staged", io => "a checkpoint's layer is staged (pending rows); the attempt is still running";
    "checkpoint.before_rename", io => "inside the checkpoint's transaction, before the upper is renamed into l/<n>";
    "checkpoint.renamed", io => "inside the checkpoint's transaction, the upper renamed into l/<n>, before the commit";
    "checkpoint.committed" => "the checkpoint's node and layer are committed; the session's fresh upper is not made yet";
    "merge.branched" => "a node merge made its working branch";
    "merge.published" => "a node merge published onto its working branch; the merge node is not recorded";
    "merge.branch_dropped" => "a node merge recorded its node and dropped its working branch";
    "promote.started" => "a node promote began; nothing is written";
    "promote.operation_published" => "a promote's operation session published its merge";
    "promote.moved" => "a promote moved the target branch";
    // Squash (engine/src/history.rs, store/src/history.rs).
    "squash.built", io => "a squash's flattened tree is written in staging/; the commit transaction has not begun";
    "squash.before_rename", io => "inside the squash's transaction, rows written, before the tree is renamed into l/<n>";
    "squash.renamed", io => "inside the squash's transaction, the tree renamed into l/<n>, before the commit";
    "squash.committed" => "the squash committed; its members' directories are still on disk";
    // GC (store/src/history.rs).
    "gc.committed" => "GC's transaction deleted the rows of what nothing reaches; no directory is removed yet";
    "gc.removed_one" => "GC removed the first of the directories it freed";
    // Base import (engine/src/import.rs, store/src/import.rs).
    "import.staged", io => "an imported tree is written and digested in staging/; no row is written";
    "import.before_rename", io => "inside the import's transaction, rows written, before the tree is renamed into l/<n>";
    "import.after_rename", io => "inside the import's transaction, the tree renamed into l/<n>, before the commit";
    // Pull: a node of another store adopted (engine/src/pull.rs, store/src/adopt.rs).
    "pull.staged", io => "a pulled node's layers are applied and indexed in staging/; no row is written";
    "adopt.before_rename", io => "inside an adoption's transaction, rows written, before a staged layer is renamed into l/<n>";
    "adopt.renamed", io => "inside an adoption's transaction, the staged layers renamed into l/<n>, before the commit";
    "adopt.committed" => "an adopted node, its layers and its lease are committed";
    // Export (engine/src/export.rs).
    "export.leased" => "an export's lease is committed; nothing is streamed yet";
    // Sessions (store/src/sessions.rs).
    "session.created" => "a session's row and lease are committed; its directories are not made yet";
    "session.dirs", io => "a session's run is committed; its directories are about to be made (mkdir)";
    "session.mkdir", io => "a session's directory and upper are made (mkdir) for a run being readied, started or moved (Prepare, create, attempt, mount, rebranch); its workdir not yet";
    "session.released" => "a session's release is committed; its directories are not removed yet";
    // containerd snapshots (store/src/snapshots.rs).
    "snapshot.mkdir", io => "containerd's Prepare of a plain snapshot over lowers is committed and its directory made; its overlay workdir not yet";
    "snapshot.committed" => "containerd's Commit of an active snapshot is committed; its old workdir is not removed yet";
    "snapshot.removed" => "containerd's Remove is committed; the snapshot's directories are not removed yet";
    // Startup recovery (store/src/sweep.rs, engine/src/graph.rs).
    "sweep.restored", recovery => "the startup sweep moved the upper of a publish interrupted before its commit back to its session";
    "sweep.staged_dropped", recovery => "the startup sweep deleted the rows of staged publishes that never committed";
    "sweep.removed", recovery => "the startup sweep removed the first directory no row keeps";
    "recover.operation_released", recovery => "the engine's recovery released the session of a merge or promote the last daemon left half-done";
    "recover.branch_dropped", recovery => "the engine's recovery dropped the working branch of a merge the last daemon left half-done";
    "recover.started", recovery => "the engine's recovery of interrupted operations begins (the store is open and swept)";
}

/// The declared point `name`, if any.
pub fn point(name: &str) -> Option<&'static Point> {
    POINTS.iter().find(|p| p.name == name)
}

#[cfg(feature = "failpoints")]
mod armed {
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;

    /// Crash points armed in this process.
    pub(super) static CRASH: Mutex<Vec<String>> = Mutex::new(Vec::new());

    pub(super) struct IoArm {
        pub(super) id: u64,
        pub(super) name: String,
        pub(super) scope: PathBuf,
        pub(super) errno: i32,
        pub(super) fired: u64,
    }

    pub(super) static IO: Mutex<Vec<IoArm>> = Mutex::new(Vec::new());
    pub(super) static NEXT: AtomicU64 = AtomicU64::new(1);

    pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn next() -> u64 {
        NEXT.fetch_add(1, Ordering::Relaxed)
    }

    /// Appends `name` to the trace file, if one is named.
    pub(super) fn trace(name: &str) {
        use std::io::Write;
        static FILE: std::sync::OnceLock<Option<Mutex<std::fs::File>>> = std::sync::OnceLock::new();
        let f = FILE.get_or_init(|| {
            let path = std::env::var_os(super::TRACE_FILE_ENV)?;
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .ok()
                .map(Mutex::new)
        });
        if let Some(f) = f {
            let _ = writeln!(lock(f), "{name}");
        }
    }

    pub(super) fn take_io(name: &str, scope: &Path) -> Option<i32> {
        let mut arms = lock(&IO);
        let a = arms
            .iter_mut()
            .find(|a| a.fired == 0 && a.name == name && scope.starts_with(&a.scope))?;
        a.fired += 1;
        Some(a.errno)
    }
}

/// Environment variable naming a file a crashing process writes the name of
/// its point into before it aborts (how the crash suite learns where a child
/// died without reading its log).
pub const HIT_FILE_ENV: &str = "LAYERSTACK_FAILPOINT_HIT_FILE";

/// With this variable set, an armed crash point pauses its thread for good
/// (after writing [`HIT_FILE_ENV`]) instead of aborting: the power-cut test
/// copies the disk at that instant, then kills the process.
pub const PAUSE_ENV: &str = "LAYERSTACK_FAILPOINT_PAUSE";

/// Environment variable naming a file every point reached is appended to (one
/// name a line): how the suite learns which points a workload reaches.
pub const TRACE_FILE_ENV: &str = "LAYERSTACK_FAILPOINT_TRACE_FILE";

/// Arms crash point `name` (process-wide, added to those armed): the next
/// [`hit`] or [`fail`] of it aborts the process. Panics on an undeclared name.
#[cfg(feature = "failpoints")]
pub fn arm(name: &str) {
    assert!(
        point(name).is_some(),
        "failpoint {name:?} is not declared in POINTS"
    );
    armed::lock(&armed::CRASH).push(name.to_string());
}

/// An armed I/O error (see [`arm_io`]); disarmed when dropped.
#[cfg(feature = "failpoints")]
#[derive(Debug)]
pub struct IoFault {
    id: u64,
}

#[cfg(feature = "failpoints")]
impl IoFault {
    /// How often the error was returned (0 or 1).
    pub fn fired(&self) -> u64 {
        armed::lock(&armed::IO)
            .iter()
            .find(|a| a.id == self.id)
            .map_or(0, |a| a.fired)
    }
}

#[cfg(feature = "failpoints")]
impl Drop for IoFault {
    fn drop(&mut self) {
        armed::lock(&armed::IO).retain(|a| a.id != self.id);
    }
}

/// Arms an I/O error at point `name` for the store rooted at `root` (or any
/// path beneath it): the next [`fail`] of it there returns
/// `io::Error::from_raw_os_error(errno)`, once. Panics on an undeclared point
/// or one not declared `io`.
#[cfg(feature = "failpoints")]
pub fn arm_io(name: &str, root: &Path, errno: i32) -> IoFault {
    let p = point(name).unwrap_or_else(|| panic!("failpoint {name:?} is not declared in POINTS"));
    assert!(
        p.io,
        "failpoint {name:?} takes no I/O error (declare it `io` and place it with fail)"
    );
    let id = armed::next();
    armed::lock(&armed::IO).push(armed::IoArm {
        id,
        name: name.to_string(),
        scope: root.to_path_buf(),
        errno,
        fired: 0,
    });
    IoFault { id }
}

/// Crash point `name`: aborts the process (SIGABRT, no unwinding) when it is
/// armed. Panics (with the feature) on an undeclared name.
#[inline(always)]
pub fn hit(name: &str) {
    #[cfg(feature = "failpoints")]
    {
        assert!(
            point(name).is_some(),
            "failpoint {name:?} is not declared in POINTS"
        );
        armed::trace(name);
        let crash = armed::lock(&armed::CRASH).iter().any(|a| a == name);
        if crash {
            if let Some(f) = std::env::var_os(HIT_FILE_ENV) {
                let _ = std::fs::write(f, name);
            }
            if std::env::var_os(PAUSE_ENV).is_some() {
                eprintln!("failpoint {name}: paused");
                loop {
                    std::thread::sleep(std::time::Duration::from_secs(3600));
                }
            }
            eprintln!("failpoint {name}: aborting");
            std::process::abort();
        }
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// Crash point `name` that also takes an I/O error: aborts like [`hit`] when
/// armed to crash; returns the armed error once when an I/O error is armed
/// for a store root that `scope` lies in. Without the feature: `Ok(())`.
///
/// # Errors
/// Only the injected one.
#[inline(always)]
pub fn fail(name: &str, scope: &Path) -> std::io::Result<()> {
    hit(name);
    #[cfg(feature = "failpoints")]
    if let Some(errno) = armed::take_io(name, scope) {
        tracing::warn!(failpoint = name, errno, "injected I/O error");
        return Err(std::io::Error::from_raw_os_error(errno));
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = scope;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Every `hit("…")` / `fail("…"` in the workspace's sources: the name,
    /// whether it is a `fail`, the file.
    fn placed() -> Vec<(String, bool, String)> {
        let ws = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let mut out = Vec::new();
        let mut stack = vec![ws.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let e = e.unwrap();
                let p = e.path();
                let name = e.file_name().to_string_lossy().into_owned();
                if e.file_type().unwrap().is_dir() {
                    if !name.starts_with('.') && name != "target" && name != "node_modules" {
                        stack.push(p);
                    }
                    continue;
                }
                if !name.ends_with(".rs") || p.ends_with("store/src/failpoints.rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&p).unwrap();
                for (pat, io) in [("failpoints::hit(\"", false), ("failpoints::fail(\"", true)] {
                    for (i, _) in text.match_indices(pat) {
                        let rest = &text[i + pat.len()..];
                        let end = rest.find('"').unwrap();
                        out.push((rest[..end].to_string(), io, p.display().to_string()));
                    }
                }
            }
        }
        out
    }

    #[test]
    fn every_placed_failpoint_is_declared_and_every_declared_one_is_placed() {
        let placed = placed();
        let undeclared: Vec<_> = placed
            .iter()
            .filter(|(n, _, _)| point(n).is_none())
            .collect();
        assert!(
            undeclared.is_empty(),
            "placed but not declared in POINTS: {undeclared:?}"
        );
        let names: BTreeSet<&str> = placed.iter().map(|(n, _, _)| n.as_str()).collect();
        let never: Vec<_> = POINTS
            .iter()
            .filter(|p| !names.contains(p.name))
            .map(|p| p.name)
            .collect();
        assert!(never.is_empty(), "declared but never placed: {never:?}");
        let unique: BTreeSet<&str> = POINTS.iter().map(|p| p.name).collect();
        assert_eq!(unique.len(), POINTS.len(), "a point is declared twice");
        // A point declared `io` is placed with `fail` only, any other with `hit`.
        for (n, io, file) in &placed {
            assert_eq!(
                point(n).unwrap().io,
                *io,
                "{n} in {file}: declared io = {}, placed with {}",
                !io,
                if *io { "fail" } else { "hit" }
            );
        }
    }

    #[cfg(feature = "failpoints")]
    #[test]
    fn an_io_error_fires_once_under_its_store_root_only() {
        let a = Path::new("/tmp/fp-test-a");
        let b = Path::new("/tmp/fp-test-b");
        let f = arm_io("publish.renamed", a, libc::ENOSPC);
        assert!(
            fail("publish.renamed", b).is_ok(),
            "another store is not touched"
        );
        let e = fail("publish.renamed", &a.join("l")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        assert!(fail("publish.renamed", a).is_ok(), "once");
        assert_eq!(f.fired(), 1);
    }
}
