//! Per-session resource limits (CPU, memory, pids) through cgroups: one cgroup
//! per limited session under a parent the daemon prepares once at start.
//!
//! ```text
//! daemon start  probe(): cgroup2 at /sys/fs/cgroup (or /sys/fs/cgroup/unified,
//!               a hybrid host); parent P = [sandbox] cgroup_parent, else the
//!               daemon's own cgroup (/proc/self/cgroup) + /layerstack-sandboxes;
//!               +cpu +memory +pids written to cgroup.subtree_control of every
//!               level from the root down to P. The no-internal-process rule:
//!               a non-root cgroup with processes cannot enable controllers for
//!               its children (EBUSY); when that cgroup is the daemon's own and
//!               holds only the daemon (and its process spawner), the daemon
//!               moves them into a leaf child (`layerstack-daemon`), as containerd and systemd
//!               services with Delegate=yes do, and enables them then.
//!               A controller cgroup v2 cannot have (bound to a cgroup v1
//!               hierarchy on a hybrid host) is taken from its v1 hierarchy at
//!               /sys/fs/cgroup/<controller> instead; one neither has is
//!               unavailable, with the reason kept for the session that asks.
//!               Leftover session cgroups of this daemon's store are removed.
//! session       create(): P/<tag>-<id> in every hierarchy a limit needs;
//!               limits written; `cgroup.procs` opened O_WRONLY. The session's
//!               init and every exec'd command write "0" to each of those
//!               descriptors as their first act after the clone (the writer
//!               joins), before they mount or exec anything.
//! session end   remove(): rmdir each directory once its processes are gone
//!               (init's exit kills the session's pid namespace).
//! ```
//! Files (kernel Documentation/admin-guide/cgroup-v2.rst; v1: cgroup-v1/):
//! v2 `cpu.max` "QUOTA 100000" (µs per 100 ms period), `memory.max` and
//! `memory.swap.max` 0, `pids.max`; v1 `cpu.cfs_quota_us`/`cpu.cfs_period_us`,
//! `memory.limit_in_bytes` and `memory.memsw.limit_in_bytes` (the same value:
//! no swap beyond it), `pids.max`. Usage: v2 `memory.peak`, `cpu.stat`
//! `usage_usec`, `memory.events` `oom_kill`; v1 `memory.max_usage_in_bytes`,
//! `cpuacct.usage` (ns), `memory.oom_control` `oom_kill`.

use std::fs;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Where cgroup file systems are mounted.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// The default parent's name, beneath the daemon's own cgroup.
pub const DEFAULT_PARENT_NAME: &str = "layerstack-sandboxes";
/// The leaf the daemon moves itself into when its own cgroup must enable
/// controllers for children (the no-internal-process rule).
pub const DAEMON_LEAF: &str = "layerstack-daemon";
/// Period of the CPU quota, microseconds (the kernel's default).
pub const CPU_PERIOD_US: u64 = 100_000;
/// Most cgroup directories one session joins (v2, or v1 cpu, cpuacct,
/// memory, pids).
pub const MAX_DIRS: usize = 5;

const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
const CGROUP_SUPER_MAGIC: i64 = 0x0027_e0eb;

/// Limits of one session; 0 = unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// CPU time per wall time, in thousandths of one CPU (500 = half a CPU).
    pub cpu_millis: u64,
    /// Memory (anonymous, page cache, kernel) the session's processes may
    /// hold together, bytes; no swap beyond it.
    pub memory_bytes: u64,
    /// Processes (and threads) the session may hold at once, init included.
    pub pids: u64,
}

/// Smallest CPU limit: 1 ms of quota per 100 ms period (the kernel's least).
pub const MIN_CPU_MILLIS: u64 = 10;
/// Largest CPU limit: 1,000 CPUs.
pub const MAX_CPU_MILLIS: u64 = 1_000_000;
/// Smallest memory limit: the session's init and a shell need a few MiB.
pub const MIN_MEMORY_BYTES: u64 = 4 << 20;
/// Smallest pids limit: init and one command.
pub const MIN_PIDS: u64 = 2;

/// The highest `pids.max` the kernel takes: `PID_MAX_LIMIT` (4 Mi, on 64-bit;
/// include/linux/threads.h, kernel/cgroup/pids.c).
pub const MAX_PIDS: u64 = 4 << 20;

impl Limits {
    /// No limit asked.
    pub fn is_empty(&self) -> bool {
        *self == Limits::default()
    }

    /// Checks each limit; the error names the key (`prefix` + field name, e.g.
    /// `sandbox.` or `[sandbox] default_`) and the accepted range.
    pub fn validate(&self, prefix: &str) -> Result<(), String> {
        let c = self.cpu_millis;
        if c != 0 && !(MIN_CPU_MILLIS..=MAX_CPU_MILLIS).contains(&c) {
            return Err(format!(
                "{prefix}cpu_millis = {c} is out of range: give 0 (no limit) or {MIN_CPU_MILLIS}..={MAX_CPU_MILLIS} thousandths of a CPU (1000 = one CPU; the kernel's smallest quota is 1 ms per 100 ms)"
            ));
        }
        let m = self.memory_bytes;
        if m != 0 && m < MIN_MEMORY_BYTES {
            return Err(format!(
                "{prefix}memory_bytes = {m} is below {MIN_MEMORY_BYTES} (4 MiB, what a session's init and a shell need): give 0 (no limit) or more"
            ));
        }
        let p = self.pids;
        if p != 0 && p < MIN_PIDS {
            return Err(format!(
                "{prefix}pids = {p} is below {MIN_PIDS} (the session's init and one command): give 0 (no limit) or more"
            ));
        }
        if p > MAX_PIDS {
            return Err(format!(
                "{prefix}pids = {p} is above {MAX_PIDS} (the kernel's PID_MAX_LIMIT, the most pids.max takes): give 0 (no limit) or {MIN_PIDS}..={MAX_PIDS}"
            ));
        }
        Ok(())
    }
}

/// A controller a limit needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Controller {
    Cpu,
    Memory,
    Pids,
}

impl Controller {
    pub const ALL: [Controller; 3] = [Controller::Cpu, Controller::Memory, Controller::Pids];

    /// The kernel's name (`cgroup.controllers`, `/proc/self/cgroup`).
    pub fn name(self) -> &'static str {
        match self {
            Controller::Cpu => "cpu",
            Controller::Memory => "memory",
            Controller::Pids => "pids",
        }
    }
}

/// Why a session's cgroup could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// The machine's cgroup setup lacks a controller a limit needs.
    #[error("cgroup controller {} is not available for session limits: {reason}", controller.name())]
    Unavailable {
        controller: Controller,
        reason: String,
    },
    /// A cgroup file could not be written or made.
    #[error("{what} {}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CgroupError + 'a {
    move |source| CgroupError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Where a controller's session cgroups go.
#[derive(Debug, Clone)]
enum Place {
    /// In the unified hierarchy (the session parent is [`Cgroups::v2_parent`]).
    V2,
    /// In a cgroup v1 hierarchy: the session parent there.
    V1(PathBuf),
}

/// The machine's cgroup setup, probed once at the daemon's start.
#[derive(Debug)]
pub struct Cgroups {
    v2_parent: Option<PathBuf>,
    places: Vec<(Controller, Result<Place, String>)>,
    /// v1 `cpuacct`'s session parent, for the CPU usage of a v1 `cpu` limit.
    cpuacct: Option<PathBuf>,
    /// Prefix of this daemon's session cgroups' names.
    tag: String,
    /// What the probe did or found, for the daemon's log.
    pub notes: Vec<String>,
}

/// `/proc/self/cgroup`: the unified path (`0::/x`) and the v1 paths by
/// controller (`4:memory:/y`, `2:cpu,cpuacct:/z`).
pub fn parse_proc_cgroup(s: &str) -> (Option<String>, Vec<(String, String)>) {
    let mut v2 = None;
    let mut v1 = Vec::new();
    for line in s.lines() {
        let mut it = line.splitn(3, ':');
        let (Some(id), Some(ctrls), Some(path)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        if id == "0" && ctrls.is_empty() {
            v2 = Some(path.to_string());
        } else {
            for c in ctrls.split(',') {
                v1.push((c.to_string(), path.to_string()));
            }
        }
    }
    (v2, v1)
}

fn fs_magic(p: &Path) -> Option<i64> {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statfs writes into the zeroed struct; `c` is a valid C string.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let r = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    (r == 0).then_some(st.f_type as i64)
}

/// `base` joined with a cgroup path (`/a/b`, absolute in the hierarchy).
fn under(base: &Path, cg: &str) -> PathBuf {
    let rel = cg.trim_start_matches('/');
    if rel.is_empty() {
        base.to_path_buf()
    } else {
        base.join(rel)
    }
}

fn read_words(p: &Path) -> Vec<String> {
    fs::read_to_string(p)
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

fn write_file(p: &Path, v: &str) -> io::Result<()> {
    let mut f = fs::OpenOptions::new().write(true).open(p)?;
    f.write_all(v.as_bytes())
}

/// The value of `key` in a flat-keyed file (`cpu.stat`, `memory.events`).
pub fn keyed(s: &str, key: &str) -> Option<u64> {
    s.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

impl Cgroups {
    /// Probes the machine and prepares the session parents (see the module
    /// docs). `parent`: a cgroup path (`/layerstack.slice/sandboxes`), the
    /// same in every hierarchy; `None` = the daemon's own + `/layerstack-sandboxes`.
    /// `tag` names this daemon's session cgroups (stable across restarts,
    /// distinct between daemons: leftovers with it are removed here).
    /// `companions`: the daemon's own helper processes (its process spawner)
    /// that share its cgroup and move into the leaf with it. Never fails:
    /// what is missing is recorded per controller.
    pub fn probe(parent: Option<&str>, tag: &str, companions: &[u32]) -> Cgroups {
        let mut notes = Vec::new();
        let (own_v2, own_v1) =
            parse_proc_cgroup(&fs::read_to_string("/proc/self/cgroup").unwrap_or_default());
        let root = Path::new(CGROUP_ROOT);
        let unified = [root.to_path_buf(), root.join("unified")]
            .into_iter()
            .find(|p| fs_magic(p) == Some(CGROUP2_SUPER_MAGIC));
        let mut places: Vec<(Controller, Result<Place, String>)> = Vec::new();
        let mut v2_parent = None;
        let mut v2_reason: Vec<(Controller, String)> = Vec::new();
        match (&unified, &own_v2) {
            (Some(m), Some(own)) => {
                let p = match parent {
                    Some(p) => p.to_string(),
                    None => format!("{}/{DEFAULT_PARENT_NAME}", own.trim_end_matches('/')),
                };
                let (dir, reasons) =
                    prepare_v2(m, own, &p, parent.is_some(), companions, &mut notes);
                v2_reason = reasons;
                v2_parent = dir;
            }
            (None, _) => notes.push(format!(
                "cgroup2 is not mounted at {CGROUP_ROOT} nor {CGROUP_ROOT}/unified"
            )),
            (Some(_), None) => notes.push("/proc/self/cgroup has no cgroup2 line (0::)".into()),
        }
        let mut cpuacct = None;
        for c in Controller::ALL {
            let v2_ok = v2_parent.as_ref().is_some_and(|d: &PathBuf| {
                read_words(&d.join("cgroup.subtree_control"))
                    .iter()
                    .any(|w| w == c.name())
            });
            if v2_ok {
                places.push((c, Ok(Place::V2)));
                continue;
            }
            let mut why = v2_reason
                .iter()
                .find(|(x, _)| *x == c)
                .map(|(_, r)| r.clone())
                .unwrap_or_else(|| {
                    "cgroup2 does not offer it (on a hybrid host it is bound to a cgroup v1 hierarchy)"
                        .to_string()
                });
            match prepare_v1(c.name(), parent, &own_v1) {
                Ok(d) => {
                    if c == Controller::Cpu {
                        cpuacct = prepare_v1("cpuacct", parent, &own_v1).ok();
                    }
                    notes.push(format!("{}: cgroup v1 at {}", c.name(), d.display()));
                    places.push((c, Ok(Place::V1(d))));
                }
                Err(v1) => {
                    why = format!(
                        "{why}; and {v1}. Enable it for cgroup v2 (the daemon's parent cgroup's cgroup.subtree_control; systemd: Delegate=yes in the daemon's unit) or set [sandbox] cgroup_parent to a cgroup where it is enabled"
                    );
                    places.push((c, Err(why)));
                }
            }
        }
        let cg = Cgroups {
            v2_parent,
            places,
            cpuacct,
            tag: tag.to_string(),
            notes,
        };
        cg.sweep();
        cg
    }

    /// Each controller: `Ok(where)` or `Err(why it is unavailable)`, for the log.
    pub fn summary(&self) -> Vec<(Controller, Result<String, String>)> {
        self.places
            .iter()
            .map(|(c, p)| {
                (
                    *c,
                    match p {
                        Ok(Place::V2) => Ok(self
                            .v2_parent
                            .as_ref()
                            .map(|d| d.display().to_string())
                            .unwrap_or_default()),
                        Ok(Place::V1(d)) => Ok(d.display().to_string()),
                        Err(e) => Err(e.clone()),
                    },
                )
            })
            .collect()
    }

    fn parents(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = self.v2_parent.iter().cloned().collect();
        for (_, p) in &self.places {
            if let Ok(Place::V1(d)) = p {
                v.push(d.clone());
            }
        }
        v.extend(self.cpuacct.iter().cloned());
        v.sort();
        v.dedup();
        v
    }

    /// Removes this daemon's leftover session cgroups (a crash: the sessions'
    /// processes died with their inits, their directories stayed). A
    /// directory still populated is left alone.
    fn sweep(&self) {
        let prefix = format!("{}-", self.tag);
        for p in self.parents() {
            let Ok(rd) = fs::read_dir(&p) else { continue };
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().starts_with(&prefix) {
                    let _ = fs::remove_dir(e.path());
                }
            }
        }
    }

    /// The name of session `id`'s cgroup (in every hierarchy).
    pub fn name(&self, id: i64) -> String {
        format!("{}-{id}", self.tag)
    }

    /// Whether every controller `limits` needs is available
    /// ([`CgroupError::Unavailable`] naming the first that is not).
    pub fn check(&self, limits: &Limits) -> Result<(), CgroupError> {
        for (c, v) in [
            (Controller::Cpu, limits.cpu_millis),
            (Controller::Memory, limits.memory_bytes),
            (Controller::Pids, limits.pids),
        ] {
            if v == 0 {
                continue;
            }
            match self.places.iter().find(|(x, _)| *x == c) {
                Some((_, Ok(_))) => {}
                Some((_, Err(reason))) => {
                    return Err(CgroupError::Unavailable {
                        controller: c,
                        reason: reason.clone(),
                    })
                }
                None => {
                    return Err(CgroupError::Unavailable {
                        controller: c,
                        reason: "not probed".into(),
                    })
                }
            }
        }
        Ok(())
    }

    /// Makes session `id`'s cgroup with `limits`, or `None` when no limit is
    /// asked (then nothing cgroup-related happens). Errors: a controller a
    /// limit needs is unavailable ([`CgroupError::Unavailable`]), a cgroup file
    /// could not be made or written ([`CgroupError::Io`]; what was made is
    /// removed).
    pub fn create(&self, id: i64, limits: &Limits) -> Result<Option<SessionCgroup>, CgroupError> {
        if limits.is_empty() {
            return Ok(None);
        }
        let name = self.name(id);
        let mut asked = Vec::new();
        for (c, v) in [
            (Controller::Cpu, limits.cpu_millis),
            (Controller::Memory, limits.memory_bytes),
            (Controller::Pids, limits.pids),
        ] {
            if v == 0 {
                continue;
            }
            let place = self
                .places
                .iter()
                .find(|(x, _)| *x == c)
                .map(|(_, p)| p.clone())
                .unwrap_or_else(|| Err("not probed".into()))
                .map_err(|reason| CgroupError::Unavailable {
                    controller: c,
                    reason,
                })?;
            let dir = match &place {
                Place::V2 => self
                    .v2_parent
                    .as_ref()
                    .map(|p| p.join(&name))
                    .ok_or_else(|| CgroupError::Unavailable {
                        controller: c,
                        reason: "no cgroup2 parent".into(),
                    })?,
                Place::V1(p) => p.join(&name),
            };
            asked.push((c, v, matches!(place, Place::V2), dir));
        }
        let mut cg = SessionCgroup::default();
        let r = (|| {
            for (c, v, v2, dir) in &asked {
                cg.add_dir(dir)?;
                write_limit(*c, *v, *v2, dir)?;
                match c {
                    Controller::Memory => cg.memory = Some((dir.clone(), *v2)),
                    Controller::Cpu if *v2 => cg.cpu = Some((dir.join("cpu.stat"), true)),
                    Controller::Cpu => {
                        if let Some(acct) = &self.cpuacct {
                            let d = acct.join(&name);
                            if cg.add_dir(&d).is_ok() {
                                cg.cpu = Some((d.join("cpuacct.usage"), false));
                            }
                        }
                    }
                    Controller::Pids => {}
                }
            }
            if cg.cpu.is_none() {
                // cpu.stat's usage_usec is in every v2 cgroup.
                if let Some((_, _, _, d)) = asked.iter().find(|a| a.2) {
                    cg.cpu = Some((d.join("cpu.stat"), true));
                }
            }
            Ok(())
        })();
        match r {
            Ok(()) => Ok(Some(cg)),
            Err(e) => {
                cg.remove_now();
                Err(e)
            }
        }
    }
}

fn write_limit(c: Controller, v: u64, v2: bool, dir: &Path) -> Result<(), CgroupError> {
    let w = |file: &str, val: String| -> Result<(), CgroupError> {
        let p = dir.join(file);
        write_file(&p, &val).map_err(io_err("cannot write the limit to", &p))
    };
    match (c, v2) {
        (Controller::Cpu, true) => w("cpu.max", format!("{} {CPU_PERIOD_US}", v * 100)),
        (Controller::Cpu, false) => {
            w("cpu.cfs_period_us", CPU_PERIOD_US.to_string())?;
            w("cpu.cfs_quota_us", (v * 100).to_string())
        }
        (Controller::Memory, true) => {
            w("memory.max", v.to_string())?;
            // Absent without swap accounting (then there is nothing to cap).
            let sw = dir.join("memory.swap.max");
            if sw.exists() {
                w("memory.swap.max", "0".into())?;
            }
            Ok(())
        }
        (Controller::Memory, false) => {
            w("memory.limit_in_bytes", v.to_string())?;
            let sw = dir.join("memory.memsw.limit_in_bytes");
            if sw.exists() {
                w("memory.memsw.limit_in_bytes", v.to_string())?;
            }
            Ok(())
        }
        (Controller::Pids, _) => w("pids.max", v.to_string()),
    }
}

/// Makes `dirs` (a cgroup path under a hierarchy's mount), each level.
fn mkdirs(p: &Path) -> io::Result<()> {
    fs::create_dir_all(p)
}

/// cgroup2: enable cpu, memory, pids from the root down to `parent` (see the
/// module docs). Returns the parent directory (if made) and why a controller
/// could not be enabled.
fn prepare_v2(
    mount: &Path,
    own: &str,
    parent: &str,
    configured: bool,
    companions: &[u32],
    notes: &mut Vec<String>,
) -> (Option<PathBuf>, Vec<(Controller, String)>) {
    let mut reasons = Vec::new();
    let pdir = under(mount, parent);
    if let Err(e) = mkdirs(&pdir) {
        let r = format!("cannot make the cgroup {}: {e}", pdir.display());
        return (
            None,
            Controller::ALL.iter().map(|c| (*c, r.clone())).collect(),
        );
    }
    // Levels whose subtree_control must list the controller: the hierarchy's
    // root and every ancestor of the parent, then the parent itself.
    let comps: Vec<&str> = parent.split('/').filter(|s| !s.is_empty()).collect();
    let mut levels = Vec::new();
    let mut cur = String::new();
    levels.push(cur.clone());
    for c in &comps {
        cur = format!("{cur}/{c}");
        levels.push(cur.clone());
    }
    for c in Controller::ALL {
        for lv in &levels {
            let dir = under(mount, lv);
            if !read_words(&dir.join("cgroup.controllers"))
                .iter()
                .any(|w| w == c.name())
            {
                reasons.push((
                    c,
                    format!(
                        "cgroup2 does not offer it at {} (not in its cgroup.controllers: the level above does not enable it, or it is bound to a cgroup v1 hierarchy)",
                        dir.display()
                    ),
                ));
                break;
            }
            if read_words(&dir.join("cgroup.subtree_control"))
                .iter()
                .any(|w| w == c.name())
            {
                continue;
            }
            let sc = dir.join("cgroup.subtree_control");
            // Above the daemon's own cgroup the tree is the service manager's:
            // only a configured parent lets the daemon write there.
            if !configured && lv.len() < own.trim_end_matches('/').len() {
                reasons.push((
                    c,
                    format!(
                        "{} does not enable it for the daemon's cgroup (systemd: Delegate=yes in the daemon's unit)",
                        sc.display()
                    ),
                ));
                break;
            }
            let mut r = write_file(&sc, &format!("+{}", c.name()));
            if r.as_ref().err().and_then(io::Error::raw_os_error) == Some(libc::EBUSY)
                && lv.trim_end_matches('/') == own.trim_end_matches('/')
                && move_self_to_leaf(&dir, companions, notes)
            {
                r = write_file(&sc, &format!("+{}", c.name()));
            }
            if let Err(e) = r {
                let why = if e.raw_os_error() == Some(libc::EBUSY) {
                    format!(
                        "cannot enable it in {}: the cgroup has processes (the no-internal-process rule){}",
                        sc.display(),
                        if lv.trim_end_matches('/') == own.trim_end_matches('/') {
                            " besides the daemon, which therefore did not move itself into a leaf"
                        } else {
                            ""
                        }
                    )
                } else {
                    format!("cannot enable it in {}: {e}", sc.display())
                };
                reasons.push((c, why));
                break;
            }
            notes.push(format!("enabled {} in {}", c.name(), sc.display()));
        }
    }
    (Some(pdir), reasons)
}

/// Moves the daemon (every thread) and its `companions` into
/// `dir/layerstack-daemon` when they are the only processes of `dir`.
fn move_self_to_leaf(dir: &Path, companions: &[u32], notes: &mut Vec<String>) -> bool {
    let ours: Vec<String> = std::iter::once(std::process::id())
        .chain(companions.iter().copied())
        .map(|p| p.to_string())
        .collect();
    let procs = read_words(&dir.join("cgroup.procs"));
    if procs.iter().any(|p| !ours.contains(p)) {
        return false;
    }
    let leaf = dir.join(DAEMON_LEAF);
    if mkdirs(&leaf).is_err() {
        return false;
    }
    for p in ours.iter().filter(|p| procs.contains(p) || **p == ours[0]) {
        if write_file(&leaf.join("cgroup.procs"), p).is_err() {
            return false;
        }
    }
    notes.push(format!(
        "moved the daemon into {} so that its cgroup may enable controllers for session cgroups",
        leaf.display()
    ));
    true
}

/// cgroup v1: the session parent in the hierarchy of `ctrl` (mounted at
/// /sys/fs/cgroup/<ctrl>, alone or co-mounted).
fn prepare_v1(
    ctrl: &str,
    parent: Option<&str>,
    own_v1: &[(String, String)],
) -> Result<PathBuf, String> {
    let mount = Path::new(CGROUP_ROOT).join(ctrl);
    if fs_magic(&mount) != Some(CGROUP_SUPER_MAGIC) {
        return Err(format!(
            "no cgroup v1 hierarchy of {ctrl} at {}",
            mount.display()
        ));
    }
    let p = match parent {
        Some(p) => p.to_string(),
        None => {
            let own = own_v1
                .iter()
                .find(|(c, _)| c == ctrl)
                .map(|(_, p)| p.as_str())
                .unwrap_or("/");
            format!("{}/{DEFAULT_PARENT_NAME}", own.trim_end_matches('/'))
        }
    };
    let dir = under(&mount, &p);
    mkdirs(&dir).map_err(|e| format!("cannot make the cgroup v1 {}: {e}", dir.display()))?;
    Ok(dir)
}

/// What a session's cgroup measured so far (0: not measured).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Highest memory use of the session, bytes (v2 `memory.peak`, v1
    /// `memory.max_usage_in_bytes`; with a memory limit only).
    pub memory_peak_bytes: u64,
    /// CPU time of the session's processes, microseconds.
    pub cpu_usec: u64,
    /// Processes the kernel's OOM killer ended in the session (with a memory
    /// limit only).
    pub oom_kills: u64,
}

/// One session's cgroup: its directories and their `cgroup.procs`.
#[derive(Debug, Default)]
pub struct SessionCgroup {
    dirs: Vec<PathBuf>,
    procs: Vec<OwnedFd>,
    /// The memory controller's directory and whether it is v2.
    memory: Option<(PathBuf, bool)>,
    /// The CPU usage file and whether it is v2's `cpu.stat` (else v1
    /// `cpuacct.usage`, nanoseconds).
    cpu: Option<(PathBuf, bool)>,
}

impl SessionCgroup {
    fn add_dir(&mut self, d: &Path) -> Result<(), CgroupError> {
        if self.dirs.iter().any(|x| x == d) {
            return Ok(());
        }
        if self.dirs.len() == MAX_DIRS {
            return Err(CgroupError::Io {
                what: "too many cgroup hierarchies for",
                path: d.to_path_buf(),
                source: io::Error::from_raw_os_error(libc::E2BIG),
            });
        }
        match fs::create_dir(d) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_err("cannot make the cgroup", d)(e)),
        }
        self.dirs.push(d.to_path_buf());
        let p = d.join("cgroup.procs");
        let f = fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&p)
            .map_err(io_err("cannot open", &p))?;
        self.procs.push(f.into());
        Ok(())
    }

    /// The directories (one per hierarchy).
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Descriptors of each directory's `cgroup.procs`: a process joins the
    /// session's cgroup by writing "0" to each ([`crate::sys::join_cgroups`]).
    pub fn procs_fds(&self) -> Vec<RawFd> {
        self.procs.iter().map(AsRawFd::as_raw_fd).collect()
    }

    /// What the cgroup measured so far; a file that cannot be read counts 0.
    pub fn usage(&self) -> Usage {
        let mut u = Usage::default();
        if let Some((d, v2)) = &self.memory {
            let rd = |f: &str| fs::read_to_string(d.join(f)).unwrap_or_default();
            if *v2 {
                u.memory_peak_bytes = rd("memory.peak").trim().parse().unwrap_or(0);
                u.oom_kills = keyed(&rd("memory.events"), "oom_kill").unwrap_or(0);
            } else {
                u.memory_peak_bytes = rd("memory.max_usage_in_bytes").trim().parse().unwrap_or(0);
                u.oom_kills = keyed(&rd("memory.oom_control"), "oom_kill").unwrap_or(0);
            }
        }
        if let Some((p, v2)) = &self.cpu {
            let s = fs::read_to_string(p).unwrap_or_default();
            u.cpu_usec = if *v2 {
                keyed(&s, "usage_usec").unwrap_or(0)
            } else {
                s.trim().parse::<u64>().unwrap_or(0) / 1000
            };
        }
        u
    }

    /// Removes the directories; `Err` with the first that is still busy (a
    /// process in it: retry once the session's processes are gone).
    pub fn remove(&self) -> io::Result<()> {
        let mut first = None;
        for d in &self.dirs {
            match fs::remove_dir(d) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    first.get_or_insert(io::Error::new(
                        e.kind(),
                        format!("cannot remove the cgroup {}: {e}", d.display()),
                    ));
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    fn remove_now(&self) {
        let _ = self.remove();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn proc_self_cgroup_hybrid_and_unified() {
        let (v2, v1) = parse_proc_cgroup("4:memory:/a/b\n2:cpu,cpuacct:/c\n0::/u/v\n");
        assert_eq!(v2.as_deref(), Some("/u/v"));
        assert_eq!(
            v1,
            [
                ("memory".to_string(), "/a/b".to_string()),
                ("cpu".into(), "/c".into()),
                ("cpuacct".into(), "/c".into())
            ]
        );
        let (v2, v1) = parse_proc_cgroup("0::/\n");
        assert_eq!(v2.as_deref(), Some("/"));
        assert!(v1.is_empty());
    }

    #[test]
    fn limits_are_checked_with_their_key_and_range() {
        assert!(Limits::default().validate("sandbox.").is_ok());
        let e = Limits {
            cpu_millis: 5,
            ..Default::default()
        }
        .validate("sandbox.")
        .unwrap_err();
        assert!(
            e.starts_with("sandbox.cpu_millis = 5 is out of range"),
            "{e}"
        );
        let e = Limits {
            memory_bytes: 1 << 20,
            ..Default::default()
        }
        .validate("[sandbox] default_")
        .unwrap_err();
        assert!(
            e.starts_with("[sandbox] default_memory_bytes = 1048576"),
            "{e}"
        );
        let e = Limits {
            pids: 1,
            ..Default::default()
        }
        .validate("sandbox.")
        .unwrap_err();
        assert!(e.contains("pids = 1 is below 2"), "{e}");
        let e = Limits {
            pids: MAX_PIDS + 1,
            ..Default::default()
        }
        .validate("sandbox.")
        .unwrap_err();
        assert!(e.contains("pids = 4194305 is above 4194304"), "{e}");
        assert!(Limits {
            pids: MAX_PIDS,
            ..Default::default()
        }
        .validate("x")
        .is_ok());
        assert!(Limits {
            cpu_millis: 10,
            memory_bytes: 4 << 20,
            pids: 2
        }
        .validate("x")
        .is_ok());
    }

    #[test]
    fn keyed_files_and_paths() {
        assert_eq!(
            keyed("usage_usec 1234\nuser_usec 1\n", "usage_usec"),
            Some(1234)
        );
        assert_eq!(keyed("oom 1\noom_kill 2\n", "oom_kill"), Some(2));
        assert_eq!(keyed("oom 1\n", "oom_kill"), None);
        assert_eq!(under(Path::new("/m"), "/"), PathBuf::from("/m"));
        assert_eq!(under(Path::new("/m"), "/a/b"), PathBuf::from("/m/a/b"));
    }

    #[test]
    fn no_limit_makes_no_cgroup() {
        let cg = Cgroups {
            v2_parent: None,
            places: Vec::new(),
            cpuacct: None,
            tag: "t".into(),
            notes: Vec::new(),
        };
        assert!(cg.create(1, &Limits::default()).unwrap().is_none());
        let e = cg
            .create(
                1,
                &Limits {
                    memory_bytes: 64 << 20,
                    ..Default::default()
                },
            )
            .unwrap_err();
        assert!(matches!(
            e,
            CgroupError::Unavailable {
                controller: Controller::Memory,
                ..
            }
        ));
    }
}
