//! Mode B sessions (ARCHITECTURE.md §12): sessions owned by a holder process of
//! `layerstack session run` instead of a container. They share everything with
//! Mode A — the store's session rows, leases, the census, the gate, the exit
//! policy ([`Engine::finish_locked`]) — and add two things:
//!
//! * **A cap** on live sandbox sessions (`[sandbox] max_sessions`, default 256):
//!   a semaphore whose permit a session holds from its creation to its release.
//!   A caller that asked not to wait gets [`EngineError::Busy`] at once when the
//!   cap is reached; one that waits gets it when its deadline passes — never a
//!   hang.
//! * **Closing** ([`Engine::close_sandbox_session`]): once the upper is proven
//!   unmounted in every mount namespace (the census; retried with back-off while
//!   the holder's namespaces are being torn down), the run ends by the request
//!   (publish, discard, or the recorded exit policy applied to the command's exit
//!   status), and the session is released: its directories are removed unless
//!   the outcome is retryable (a conflict keeps the upper for inspection, as for
//!   containers). A holder that vanished without closing (SIGKILL) is closed the
//!   same way with no exit status: `on-exit` publishes, `on-success` discards.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use layerstack_store::{
    Interruption, LeaseTarget, MountSpec, OutcomeKind, Owner, RolloutEnding, SessionId, SessionInfo,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{debug, info, warn};

use crate::error::{error_chain, EngineError};
use crate::policy::ExitPolicy;
use crate::Engine;

/// Mode B limits.
#[derive(Debug, Clone)]
pub struct SandboxSettings {
    /// Live sandbox sessions at most (created, not yet released). Default 256.
    pub max_sessions: usize,
    /// New sandbox sessions per second at most, in bursts of at most that
    /// many (a generic cell-rate limit); 0: unlimited (the default).
    pub create_rate: u32,
    /// After a restart, how long a session of the last daemon whose holder's
    /// namespaces are gone waits for that holder to reconnect and close it
    /// with the command's exit status, before it is finished by its policy
    /// with none. Default 60 s: more than `layerstack session run
    /// --reconnect-timeout`'s default (30 s), counted from the moment this
    /// daemon sees the namespaces gone (the holder's retries started then or
    /// before).
    pub holder_grace: Duration,
    /// The pool's CPU budget (seed 002 stage 03 "a pool bounded by … CPU and
    /// memory budgets"): the sum of the CPU limits of live sandboxes,
    /// thousandths of a CPU ([`Reservation::cpu_millis`]); 0: unlimited.
    pub cpu_budget_millis: u64,
    /// The pool's memory budget: the sum of the memory limits of live
    /// sandboxes, bytes (counted in whole MiB, rounded up); 0: unlimited.
    pub memory_budget_bytes: u64,
}

impl Default for SandboxSettings {
    fn default() -> Self {
        Self {
            max_sessions: 256,
            create_rate: 0,
            holder_grace: Duration::from_secs(60),
            cpu_budget_millis: 0,
            memory_budget_bytes: 0,
        }
    }
}

/// What a sandbox counts against the pool's budgets while it lives: its CPU
/// and memory limits (0: nothing). The daemon passes the limits a
/// daemon-owned sandbox's cgroup gets; a holder's session (`layerstack
/// session run`) has none and counts only against `max_sessions`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reservation {
    /// Thousandths of a CPU.
    pub cpu_millis: u64,
    /// Bytes.
    pub memory_bytes: u64,
}

/// A live sandbox's hold on the pool: its slot under the cap and its share of
/// the budgets, all given back at its release.
struct Slot {
    _session: OwnedSemaphorePermit,
    _cpu: Option<OwnedSemaphorePermit>,
    _memory: Option<OwnedSemaphorePermit>,
}

/// One budget of the pool: a semaphore of `total` units (millis or MiB).
struct Budget {
    key: &'static str,
    unit: &'static str,
    total: u32,
    sem: Arc<Semaphore>,
}

impl Budget {
    fn new(key: &'static str, unit: &'static str, total: u64) -> Option<Self> {
        let total = u32::try_from(total).unwrap_or(u32::MAX);
        (total > 0).then(|| Self {
            key,
            unit,
            total,
            sem: Arc::new(Semaphore::new(total as usize)),
        })
    }

    /// Takes `n` units, waiting at most `wait` (`None`: not at all).
    async fn take(
        &self,
        n: u64,
        wait: Option<Duration>,
    ) -> Result<Option<OwnedSemaphorePermit>, EngineError> {
        if n == 0 {
            return Ok(None);
        }
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        if n > self.total {
            return Err(EngineError::InvalidArgument(format!(
                "the sandbox asks {n} {unit}, more than the pool's whole budget ([sandbox] {key} = {total} {unit}): ask less, or raise the budget",
                unit = self.unit,
                key = self.key,
                total = self.total
            )));
        }
        let full = |waited: Option<Duration>| {
            EngineError::Busy(format!(
                "the live sandboxes hold {} of the pool's {} {unit} ([sandbox] {key}); this one asks {n}{}: close one, ask less, raise the budget, or wait longer",
                self.total as usize - self.sem.available_permits(),
                self.total,
                waited.map(|d| format!("; not enough was freed within {} ms", d.as_millis())).unwrap_or_default(),
                unit = self.unit,
                key = self.key,
            ))
        };
        match wait {
            None => self
                .sem
                .clone()
                .try_acquire_many_owned(n)
                .map(Some)
                .map_err(|_| full(None)),
            Some(d) => {
                match tokio::time::timeout(d, self.sem.clone().acquire_many_owned(n)).await {
                    Ok(Ok(p)) => Ok(Some(p)),
                    _ => Err(full(Some(d))),
                }
            }
        }
    }
}

/// The cap, the permits of live sandbox sessions and the creation rate.
pub(crate) struct Sandboxes {
    max: usize,
    holder_grace: Duration,
    sem: Arc<Semaphore>,
    permits: Mutex<HashMap<SessionId, Slot>>,
    cpu: Option<Budget>,
    memory: Option<Budget>,
    /// Sessions in root mode ([`Engine::sandbox_root_mode`]): their close
    /// drops the mountpoints the session's init made in the upper.
    root_mode: Mutex<HashSet<SessionId>>,
    /// What [`Engine::record_exec`] learnt of which sessions no running
    /// rollout attempt records ([`Unrecorded`]).
    pub(crate) unrecorded: Mutex<Unrecorded>,
    rate: Option<Rate>,
}

/// Sessions whose commands no running rollout attempt records — made by
/// [`Engine::create_sandbox_session`] since the daemon started, or so the
/// store answered [`Engine::running_rollout_of_session`] — whose execs
/// need not ask the store. An attempt's attach ([`Engine::attach_rollout`])
/// counts in `attaches` and takes its session out, before its transaction
/// and again after it: an answer read before the attach committed is
/// remembered only if no attach began since it was asked
/// ([`Sandboxes::remember_unrecorded`]), and one remembered meanwhile is
/// taken out again. Forgotten at the release.
#[derive(Default)]
pub(crate) struct Unrecorded {
    pub(crate) sessions: HashSet<SessionId>,
    pub(crate) attaches: u64,
}

/// A generic cell-rate limit (ITU-T I.371's GCRA, "virtual scheduling"):
/// one creation per `interval`, at most `burst` at once; `tat` is the
/// theoretical arrival time of the next one.
struct Rate {
    per_s: u32,
    interval: Duration,
    tolerance: Duration,
    tat: Mutex<tokio::time::Instant>,
}

impl Rate {
    fn new(per_s: u32) -> Option<Self> {
        (per_s > 0).then(|| {
            let interval = Duration::from_secs(1) / per_s;
            Self {
                per_s,
                interval,
                tolerance: interval * (per_s - 1),
                tat: Mutex::new(tokio::time::Instant::now()),
            }
        })
    }

    /// When the caller may create (now or later), reserving that slot; `None`
    /// (nothing reserved) when that is later than `now + wait`.
    fn reserve(&self, wait: Duration) -> Option<tokio::time::Instant> {
        let now = tokio::time::Instant::now();
        let mut tat = self.tat.lock().unwrap_or_else(|p| p.into_inner());
        let base = (*tat).max(now);
        let at = base.checked_sub(self.tolerance).unwrap_or(now).max(now);
        if at > now + wait {
            return None;
        }
        *tat = base + self.interval;
        Some(at)
    }
}

impl Sandboxes {
    pub(crate) fn new(settings: &SandboxSettings) -> Self {
        Self {
            max: settings.max_sessions,
            holder_grace: settings.holder_grace,
            sem: Arc::new(Semaphore::new(settings.max_sessions)),
            permits: Mutex::new(HashMap::new()),
            cpu: Budget::new(
                "cpu_budget_millis",
                "CPU millis",
                settings.cpu_budget_millis,
            ),
            memory: Budget::new(
                "memory_budget_bytes",
                "MiB of memory",
                settings.memory_budget_bytes.div_ceil(1 << 20),
            ),
            root_mode: Mutex::new(HashSet::new()),
            unrecorded: Mutex::new(Unrecorded::default()),
            rate: Rate::new(settings.create_rate),
        }
    }

    fn permits(&self) -> std::sync::MutexGuard<'_, HashMap<SessionId, Slot>> {
        self.permits.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn root_mode(&self) -> std::sync::MutexGuard<'_, HashSet<SessionId>> {
        self.root_mode.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn unrecorded(&self) -> std::sync::MutexGuard<'_, Unrecorded> {
        self.unrecorded.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Remembers that no running rollout attempt records session `id`'s
    /// commands ([`Unrecorded`]), as learnt when `attaches` was the count:
    /// not if an attach began since, nor for a session released meanwhile
    /// (it holds no slot: checked under the same lock as the insert, so a
    /// release cannot slip between them and leave the entry behind).
    pub(crate) fn remember_unrecorded(&self, id: SessionId, attaches: u64) {
        let mut u = self.unrecorded();
        if u.attaches == attaches && self.permits().contains_key(&id) {
            u.sessions.insert(id);
        }
    }

    fn release(&self, id: SessionId) {
        self.permits().remove(&id);
        self.root_mode().remove(&id);
        self.unrecorded().sessions.remove(&id);
    }
}

/// The directories a root-mode session's init mounts over (`/proc`, `/dev`,
/// `/sys`, `/run`: `layerstack_sandbox::holder`), made in the upper when the
/// session's base lacks them.
pub const ROOT_MOUNTPOINTS: [&str; 4] = ["dev", "proc", "sys", "run"];

/// Whether `name` in `upper` may be a mountpoint the session's init made: a
/// [`ROOT_MOUNTPOINTS`] name, a directory at the top of the upper, with
/// nothing of that name in any of `lowers` (not even a whiteout). Whether it
/// is empty — a command that unmounted the filesystem and wrote there made
/// it its own — is the caller's to see. Errors: stat's, other than NotFound.
pub(crate) fn init_mountpoint<'a>(
    upper: &std::path::Path,
    mut lowers: impl Iterator<Item = &'a std::path::Path>,
    name: &str,
) -> std::io::Result<bool> {
    if !ROOT_MOUNTPOINTS.contains(&name) {
        return Ok(false);
    }
    let dir = match std::fs::symlink_metadata(upper.join(name)) {
        Ok(m) => m.is_dir(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => return Err(e),
    };
    Ok(dir && !lowers.any(|l| l.join(name).symlink_metadata().is_ok()))
}

/// Removes from `upper` the [`ROOT_MOUNTPOINTS`] the session's init made
/// ([`init_mountpoint`]) and left empty. Anything else — a mountpoint the
/// base has, one the command filled — is the session's change and stays.
/// The caller proved the upper unmounted. Returns the names removed.
pub(crate) fn drop_root_mountpoints(
    upper: &std::path::Path,
    lowers: &[std::path::PathBuf],
) -> std::io::Result<Vec<&'static str>> {
    let mut dropped = Vec::new();
    for name in ROOT_MOUNTPOINTS {
        if !init_mountpoint(upper, lowers.iter().map(|l| l.as_path()), name)? {
            continue;
        }
        // Not empty: the command's, it stays.
        match std::fs::remove_dir(upper.join(name)) {
            Ok(()) => dropped.push(name),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY | libc::EEXIST)) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(dropped)
}

/// Shifts the ids of session writes in `upper` back from the host's to the
/// session's (`map`): a session with a uid/gid mapping runs as the host's
/// `host_uid + u`, and overlay writes its upper with those ids (only the
/// lowers are idmapped: `layerstack_sandbox::sys::overlay_fd_mapped`). For
/// every entry (never following a symlink):
/// - an owner whose uid or gid lies in the host range gets `u`/`g` back
///   (`lchown`); one outside it stays — overlay's own whiteouts, made with
///   the daemon's credentials (0);
/// - a set-user-ID or set-group-ID bit the chown cleared is set again;
/// - a file capability (`security.capability`, which a chown removes) is
///   written back; one the session's root set (revision 3, its root id the
///   host's `host_uid`) becomes revision 2 — capabilities of the layer's
///   root, as an image carries them;
/// - POSIX ACL entries (`system.posix_acl_access`, `…_default`) naming a
///   host id of the range name the session's id.
///
/// Host ids lie above the session's (`IdMap::validate`), so a second pass
/// after a crash changes nothing twice. The caller proved the upper
/// unmounted. Returns how many entries changed.
pub(crate) fn shift_back_ids(
    upper: &std::path::Path,
    map: &layerstack_types::IdMap,
) -> std::io::Result<u64> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mut changed = 0u64;
    let mut todo = vec![upper.to_path_buf()];
    while let Some(p) = todo.pop() {
        let md = std::fs::symlink_metadata(&p)?;
        let link = md.file_type().is_symlink();
        let uid = map.uid_from_host(md.uid());
        let gid = map.gid_from_host(md.gid());
        let mut touched = false;
        if uid.is_some() || gid.is_some() {
            let cap = if md.is_file() {
                xattr_of(&p, c"security.capability")?
            } else {
                None
            };
            std::os::unix::fs::lchown(&p, uid, gid)?;
            let special = md.mode() & (libc::S_ISUID | libc::S_ISGID);
            if special != 0 && !link {
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(md.mode() & 0o7777))?;
            }
            if let Some(cap) = cap {
                set_xattr(&p, c"security.capability", &caps_of_layer_root(cap, map))?;
            }
            touched = true;
        }
        if !link {
            for name in [c"system.posix_acl_access", c"system.posix_acl_default"] {
                if let Some(acl) = xattr_of(&p, name)? {
                    if let Some(back) = acl_shifted_back(&acl, map) {
                        set_xattr(&p, name, &back)?;
                        touched = true;
                    }
                }
            }
        }
        changed += u64::from(touched);
        if md.is_dir() {
            for e in std::fs::read_dir(&p)? {
                todo.push(e?.path());
            }
        }
    }
    Ok(changed)
}

fn c_path(p: &std::path::Path) -> std::io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))
}

/// Extended attribute `name` of `p` (not followed); `None` when absent or
/// not supported there.
fn xattr_of(p: &std::path::Path, name: &std::ffi::CStr) -> std::io::Result<Option<Vec<u8>>> {
    let cp = c_path(p)?;
    let mut buf = vec![0u8; 256];
    loop {
        // SAFETY: both strings are NUL-terminated; `buf` is writable for its length.
        let n = unsafe {
            libc::lgetxattr(
                cp.as_ptr(),
                name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if n >= 0 {
            buf.truncate(n as usize);
            return Ok(Some(buf));
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENODATA) | Some(libc::EOPNOTSUPP) => return Ok(None),
            Some(libc::ERANGE) if buf.len() < 1 << 20 => {
                let grown = buf.len() * 4;
                buf.resize(grown, 0);
            }
            _ => return Err(e),
        }
    }
}

fn set_xattr(p: &std::path::Path, name: &std::ffi::CStr, value: &[u8]) -> std::io::Result<()> {
    let cp = c_path(p)?;
    // SAFETY: both strings are NUL-terminated; `value` is readable for its length.
    let r = unsafe {
        libc::lsetxattr(
            cp.as_ptr(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `security.capability` as the layer keeps it: a revision-3 value whose root
/// id is the session's root on the host (what a `setcap` inside the session
/// writes) becomes revision 2 (include/uapi/linux/capability.h,
/// `struct vfs_ns_cap_data`); one whose root id is another host id of the
/// range (a `setcap` in a user namespace nested in the session) keeps
/// revision 3 with that id shifted back; any other value as it was.
fn caps_of_layer_root(cap: Vec<u8>, map: &layerstack_types::IdMap) -> Vec<u8> {
    const REVISION_MASK: u32 = 0xFF00_0000;
    const REVISION_2: u32 = 0x0200_0000;
    const REVISION_3: u32 = 0x0300_0000;
    if cap.len() != 24 {
        return cap;
    }
    let word = |i: usize| u32::from_le_bytes([cap[i], cap[i + 1], cap[i + 2], cap[i + 3]]);
    let magic = word(0);
    if magic & REVISION_MASK != REVISION_3 {
        return cap;
    }
    let rootid = word(20);
    if rootid != map.host_uid {
        return match map.uid_from_host(rootid) {
            Some(inside) => {
                let mut v3 = cap;
                v3[20..].copy_from_slice(&inside.to_le_bytes());
                v3
            }
            None => cap,
        };
    }
    let mut v2 = cap[..20].to_vec();
    v2[..4].copy_from_slice(&((magic & !REVISION_MASK) | REVISION_2).to_le_bytes());
    v2
}

/// A POSIX ACL xattr (`posix_acl_xattr_header` + entries of tag, perm, id;
/// include/uapi/linux/posix_acl_xattr.h) with its named users' and groups'
/// host ids of the range shifted back; `None` when no entry names one.
fn acl_shifted_back(acl: &[u8], map: &layerstack_types::IdMap) -> Option<Vec<u8>> {
    const ACL_USER: u16 = 0x02;
    const ACL_GROUP: u16 = 0x08;
    if acl.len() < 4 || !(acl.len() - 4).is_multiple_of(8) {
        return None;
    }
    let mut out = acl.to_vec();
    let mut any = false;
    for e in out[4..].chunks_exact_mut(8) {
        let tag = u16::from_le_bytes([e[0], e[1]]);
        let id = u32::from_le_bytes([e[4], e[5], e[6], e[7]]);
        let back = match tag {
            ACL_USER => map.uid_from_host(id),
            ACL_GROUP => map.gid_from_host(id),
            _ => None,
        };
        if let Some(b) = back {
            e[4..8].copy_from_slice(&b.to_le_bytes());
            any = true;
        }
    }
    any.then_some(out)
}

/// The owner of a sandbox request's session: `wasi:<name>` or `sandbox:<name>`.
fn owner_of(wasi: bool, name: String) -> Owner {
    if wasi {
        Owner::Wasi { name }
    } else {
        Owner::Sandbox { name }
    }
}

/// A request for a sandbox session.
#[derive(Debug, Clone)]
pub struct SandboxRequest {
    /// Owner label (`sandbox:<name>`).
    pub name: String,
    /// Stack id.
    pub stack: String,
    /// What to lease: a branch head or a manifest.
    pub target: LeaseTarget,
    /// The same key returns the first call's session.
    pub idempotency_key: Option<String>,
    /// Exit policy recorded on the session (`None`: on-exit).
    pub policy: Option<ExitPolicy>,
    /// How long to wait for a free slot under the cap; `None`: do not wait.
    pub wait: Option<Duration>,
    /// Start an attempt of this SandboxGraph node instead (`target` is then
    /// ignored: the session leases the node's root).
    pub node: Option<String>,
    /// Capture ignores a regular file's mtime
    /// ([`layerstack_store::SessionOptions::ignore_mtime`]).
    pub ignore_mtime: bool,
    /// The daemon starts and owns the session's init
    /// ([`layerstack_store::SessionOptions::daemon_owned`]): when that init is
    /// gone without a close, the run ends `interrupted`, not by its policy.
    pub daemon_owned: bool,
    /// A WASI session (owner kind `wasi`): the daemon runs WebAssembly modules
    /// over the session's tree instead of Linux processes. Else a sandbox.
    pub wasi: bool,
    /// What it counts against the pool's CPU and memory budgets while it lives.
    pub reserve: Reservation,
    /// The session's uid/gid mapping
    /// ([`layerstack_store::SessionOptions::id_map`]; a daemon-owned sandbox's).
    pub id_map: Option<layerstack_types::IdMap>,
}

/// How [`Engine::close_sandbox_session`] ends the run.
#[derive(Debug, Clone, PartialEq)]
pub enum EndAction {
    /// The recorded exit policy applied to the exit status (`None`: unknown).
    /// ExitPolicy `checkpoint` makes a child node with `state` (JSON, default `{}`)
    /// and `command` as its provenance.
    /// `labels` are recorded with a checkpoint's node (its free-form state
    /// beside the JSON `state`, e.g. a reward), in the node's transaction.
    Auto {
        exit_status: Option<u32>,
        state: Option<String>,
        command: Option<String>,
        labels: BTreeMap<String, String>,
    },
    Publish,
    Discard,
    /// Checkpoint the attempt into a child node whatever the policy.
    Checkpoint {
        exit_status: Option<u32>,
        state: Option<String>,
        command: Option<String>,
        labels: BTreeMap<String, String>,
        /// The session is a rollout attempt's sandbox: the attempt ends with
        /// the checkpoint, in its transaction.
        rollout: Option<RolloutEnding>,
    },
    /// An infrastructure failure ended the run (outcome `interrupted`, see
    /// [`Engine::interrupt_locked`]): nothing is published, the upper is kept.
    Interrupted(Interruption),
}

impl EndAction {
    /// [`EndAction::Auto`] with only an exit status.
    pub fn auto(exit_status: Option<u32>) -> Self {
        Self::Auto {
            exit_status,
            state: None,
            command: None,
            labels: BTreeMap::new(),
        }
    }
}

/// Back-off between censuses while an upper leaves the mount namespaces
/// (a holder's teardown, a sibling's transient copy): 1 ms doubling to 100 ms.
/// What the caller of [`Engine::close_sandbox_session_with`] knows of the
/// processes that could still write a session's upper.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writers {
    /// Nothing: the census of mount namespaces decides (a holder's session,
    /// a container's).
    Unknown,
    /// A daemon-owned session whose init has exited (its pidfd is
    /// readable): the kernel ends the init of a pid namespace only once
    /// every other process of the namespace has been reaped
    /// (`zap_pid_ns_processes`, kernel/pid_namespace.c), and the overlay
    /// was attached in the init's mount namespace alone. No program of the
    /// session runs any more; a discard reads nothing of the upper.
    Gone,
}

pub(crate) fn backoff(attempt: u32) -> Duration {
    Duration::from_millis((1u64 << attempt.min(7)).min(100))
}

impl Engine {
    /// Live sandbox sessions and the cap.
    pub fn sandbox_load(&self) -> (usize, usize) {
        let live = self.sandboxes.max - self.sandboxes.sem.available_permits();
        (live, self.sandboxes.max)
    }

    /// The sandbox's slot under the cap, its share of the budgets (`reserve`),
    /// then its turn under the creation rate — all within `wait`.
    async fn sandbox_permit(
        &self,
        wait: Option<Duration>,
        reserve: Reservation,
    ) -> Result<Slot, EngineError> {
        let sem = self.sandboxes.sem.clone();
        let full = |waited: Option<Duration>| {
            EngineError::Busy(format!(
                "{} sandbox sessions are live, the cap ([sandbox] max_sessions){}: close one, raise the cap, or wait longer",
                self.sandboxes.max,
                waited.map(|d| format!("; none ended within {} ms", d.as_millis())).unwrap_or_default()
            ))
        };
        let started = tokio::time::Instant::now();
        let permit = match wait {
            None => sem.try_acquire_owned().map_err(|_| full(None))?,
            Some(d) => match tokio::time::timeout(d, sem.acquire_owned()).await {
                Ok(Ok(p)) => p,
                _ => return Err(full(Some(d))),
            },
        };
        let left = || wait.map(|w| w.saturating_sub(started.elapsed()));
        let cpu = match &self.sandboxes.cpu {
            Some(b) => b.take(reserve.cpu_millis, left()).await?,
            None => None,
        };
        let memory = match &self.sandboxes.memory {
            Some(b) => {
                b.take(reserve.memory_bytes.div_ceil(1 << 20), left())
                    .await?
            }
            None => None,
        };
        if let Some(rate) = &self.sandboxes.rate {
            let left = wait.unwrap_or_default().saturating_sub(started.elapsed());
            match rate.reserve(left) {
                Some(at) => tokio::time::sleep_until(at).await,
                None => {
                    return Err(EngineError::Busy(format!(
                        "sandbox sessions are being created at the rate limit ([sandbox] create_rate = {} per second){}: wait longer or raise the rate",
                        rate.per_s,
                        wait.map(|d| format!("; no slot within {} ms", d.as_millis())).unwrap_or_default()
                    )))
                }
            }
        }
        Ok(Slot {
            _session: permit,
            _cpu: cpu,
            _memory: memory,
        })
    }

    /// The mount spec of sandbox session `id`'s current run, for a holder
    /// attaching to it (a new run starts when the last one ended). The caller
    /// holds the session's lock.
    ///
    /// Errors: `InvalidArgument` when the session is not a Mode B sandbox
    /// session (a WASI session's overlay is the daemon's alone);
    /// `FailedPrecondition` when it was closed; `SessionNotFound`.
    pub async fn sandbox_run_spec(&self, id: SessionId) -> Result<MountSpec, EngineError> {
        self.blocking(move |st| {
            let s = st.session(id)?;
            // A WASI session's overlay is the daemon's alone: no holder
            // attaches to it.
            if !matches!(s.owner, Owner::Sandbox { .. }) {
                return Err(layerstack_store::StoreError::InvalidArgument(format!(
                    "session {id} belongs to {}, not to a sandbox holder",
                    s.owner.display()
                )));
            }
            if s.released {
                return Err(layerstack_store::StoreError::FailedPrecondition(format!(
                    "session {id} was closed already"
                )));
            }
            st.session_mount(id)
        })
        .await
    }

    /// Whether the store syncs what it publishes (the `durable` profile).
    pub fn durable(&self) -> bool {
        self.store.durability() == layerstack_store::Durability::Durable
    }

    /// Creates a sandbox session (Mode B) under the cap and records its exit
    /// policy. Returns the session, its mount spec and whether it was created now
    /// (an idempotency key may return an earlier session, then the spec of its
    /// current run).
    ///
    /// A key naming a session that has ended answers it as recorded
    /// (`released`, its outcome; `created` false; an empty spec): a retried
    /// step gets the recorded end, never a second run.
    ///
    /// Errors: [`EngineError::Busy`] (cap reached); `StackNotFound`,
    /// `InvalidArgument`.
    pub async fn create_sandbox_session(
        &self,
        req: SandboxRequest,
    ) -> Result<(SessionInfo, MountSpec, bool), EngineError> {
        let permit = self.sandbox_permit(req.wait, req.reserve).await?;
        let key = req.idempotency_key.clone();
        let attaches = self.sandboxes.unrecorded().attaches;
        let (s, spec, created) = match req.node {
            Some(node) => {
                // One transaction: the attempt, its session and its policy.
                let opts = layerstack_store::SessionOptions {
                    exit_policy: req.policy.map(|p| p.as_str().to_string()),
                    ignore_mtime: req.ignore_mtime,
                    daemon_owned: req.daemon_owned,
                    id_map: req.id_map,
                };
                let (_, s, spec, created) = self
                    .attempt_start_with(
                        &node,
                        owner_of(req.wasi, req.name),
                        req.idempotency_key,
                        opts,
                    )
                    .await?;
                (s, spec, created)
            }
            None => {
                // One transaction: the session and its policy.
                let (stack, target, key) = (req.stack, req.target, req.idempotency_key);
                let opts = layerstack_store::SessionOptions {
                    exit_policy: req.policy.map(|p| p.as_str().to_string()),
                    ignore_mtime: req.ignore_mtime,
                    daemon_owned: req.daemon_owned,
                    id_map: req.id_map,
                };
                let owner = owner_of(req.wasi, req.name);
                // On the caller's worker (no hand-off to the blocking pool and
                // back: each wakes an idle vCPU, 0.1-0.35 ms here).
                self.blocking_here(move |st| {
                    st.create_session_with(&owner, &stack, &target, key.as_deref(), &opts)
                })
                .await?
            }
        };
        if !created && s.released {
            // A retry of a key whose session ended: its end as recorded
            // (`released`, its outcome), nothing mounted, no slot taken.
            drop(permit);
            debug!(session.id = s.id, key = ?key, "idempotency key names an ended session: answered as recorded");
            return Ok((s, spec, false));
        }
        self.sandboxes.permits().entry(s.id).or_insert(permit);
        if created {
            // A new session is no rollout attempt's until one attaches
            // ([`Engine::attach_rollout`] takes it out): its execs need not
            // ask the store.
            self.sandboxes.remember_unrecorded(s.id, attaches);
        }
        Ok((s, spec, created))
    }

    /// Hands ready WASI session `id` — made ahead by
    /// [`Engine::create_sandbox_session`] with the name
    /// [`layerstack_store::READY_OWNER`] on `req`'s stack and branch — to
    /// `req`'s owner: its name, idempotency key, exit policy and
    /// `ignore_mtime` become the session's in one transaction
    /// ([`layerstack_store::Store::claim_ready_session`]). Its slot in the
    /// pool (taken when it was made) stays with it.
    ///
    /// `None`: the session is stale (its branch's head moved since it was
    /// made) or `req`'s key names a session already; create the usual way.
    /// Errors: `InvalidArgument` (`req` is not a WASI request on a branch
    /// without a node, or a bad key), `FailedPrecondition` (the key was used
    /// with other arguments).
    pub async fn claim_ready_session(
        &self,
        id: SessionId,
        req: SandboxRequest,
    ) -> Result<Option<SessionInfo>, EngineError> {
        if !req.wasi || req.node.is_some() || !matches!(req.target, LeaseTarget::Branch(_)) {
            return Err(EngineError::InvalidArgument(
                "only a WASI session on a branch (no node) is made ahead of its request".into(),
            ));
        }
        let opts = layerstack_store::SessionOptions {
            exit_policy: req.policy.map(|p| p.as_str().to_string()),
            ignore_mtime: req.ignore_mtime,
            daemon_owned: req.daemon_owned,
            id_map: req.id_map,
        };
        let owner = owner_of(true, req.name);
        let key = req.idempotency_key;
        let claim = self
            .blocking_here(move |st| st.claim_ready_session(id, &owner, key.as_deref(), &opts))
            .await?;
        Ok(match claim {
            layerstack_store::Claim::Claimed(s) => {
                self.changed();
                Some(*s)
            }
            layerstack_store::Claim::Stale | layerstack_store::Claim::KeyTaken => None,
        })
    }

    /// Ends sandbox session `id` and releases it (see the module docs). Waits at
    /// most `patience` for the upper to be unmounted everywhere. Returns the
    /// session with the outcome of its last run. A session released already is
    /// returned as it is.
    ///
    /// Errors: `SessionNotFound`; `InvalidArgument` for a session that is not a
    /// sandbox's; [`EngineError::Mounted`] when the upper stays mounted.
    pub async fn close_sandbox_session(
        self: &Arc<Self>,
        id: SessionId,
        how: EndAction,
        why: &str,
        patience: Duration,
    ) -> Result<SessionInfo, EngineError> {
        self.close_sandbox_session_with(id, how, why, patience, Writers::Unknown)
            .await
    }

    /// [`Engine::close_sandbox_session`] by a caller that may know more of
    /// the session's processes (`writers`): with [`Writers::Gone`], a
    /// DISCARD of a live daemon-owned session is one store transaction —
    /// the owner's release, the outcome `discarded`, the release completed —
    /// without the census of mount namespaces (as for a WASI session). Any
    /// other close is [`Engine::close_sandbox_session`]'s.
    pub async fn close_sandbox_session_with(
        self: &Arc<Self>,
        id: SessionId,
        how: EndAction,
        why: &str,
        patience: Duration,
        writers: Writers,
    ) -> Result<SessionInfo, EngineError> {
        // A checkpoint's state is checked before anything ends: a bad one
        // refused later would have stopped the session's processes for
        // nothing.
        if let EndAction::Auto {
            state: Some(state), ..
        }
        | EndAction::Checkpoint {
            state: Some(state), ..
        } = &how
        {
            layerstack_store::validate_state(state)?;
        }
        let me = self.clone();
        let why = why.to_string();
        let s = tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + patience;
            let mut attempt = 0;
            loop {
                let _g = me.lock_session(id).await;
                if matches!(how, EndAction::Discard) {
                    if let Some(s) = me.discard_closing(id, &why, writers).await? {
                        me.changed();
                        info!(session.id = id, outcome = ?s.outcome.as_ref().map(|o| o.kind), "sandbox session closed");
                        break Ok(s);
                    }
                }
                // The owner's release is recorded first (one transaction with the
                // owner check): the end of the run then removes the upper rather
                // than making a fresh one for the release to remove.
                let s = me
                    .blocking(move |st| st.release_sandbox_session(id))
                    .await?;
                if !s.remove_pending {
                    // Closed before. An explicit Discard still drops what
                    // the run kept (an interrupted run's upper and lease),
                    // as a Publish(DISCARD) would; a run that ended
                    // otherwise is answered as it is.
                    if matches!(how, EndAction::Discard) {
                        break me.discard_locked(id, &why).await;
                    }
                    break Ok(s);
                }
                // A run an infrastructure failure ended stays ended so: its
                // half-done writes are never published or checkpointed by a
                // close that came after (an explicit Publish of the kept upper
                // still can), the close only releases it.
                let how = match &s.outcome {
                    Some(o)
                        if o.kind == OutcomeKind::Interrupted
                            && o.run == s.run
                            && !matches!(how, EndAction::Discard) =>
                    {
                        EndAction::Interrupted(o.interrupted_by.unwrap_or(Interruption::InitGone))
                    }
                    _ => how.clone(),
                };
                // Dropped first (a mounted upper: retried below, as the
                // action's own census would be).
                let dropped = if !matches!(how, EndAction::Interrupted(_) | EndAction::Discard)
                    && me.sandboxes.root_mode().contains(&id)
                {
                    me.drop_root_mountpoints_of(&s).await
                } else {
                    Ok(())
                };
                let checkpoint = |exit_status: Option<u32>, state: &Option<String>, command: &Option<String>, labels: &BTreeMap<String, String>, rollout: &Option<RolloutEnding>| {
                    let prov = layerstack_store::Provenance {
                        command: command.clone(),
                        exit_status: exit_status.map(|c| i32::try_from(c).unwrap_or(i32::MAX)),
                        labels: labels.clone(),
                        ..Default::default()
                    };
                    me.checkpoint_or_fail_locked(id, state.clone(), prov, rollout.clone())
                };
                let r = match dropped.map(|()| &how) {
                    Err(e) => Err(e),
                    Ok(EndAction::Auto {
                        exit_status,
                        state,
                        command,
                        labels,
                    }) if matches!(
                        crate::publish::exit_decision(&s, None, *exit_status),
                        Ok((crate::policy::Decision::Checkpoint, _))
                    ) =>
                    {
                        checkpoint(*exit_status, state, command, labels, &None).await
                    }
                    Ok(EndAction::Auto { exit_status, .. }) => {
                        me.finish_locked(&s, None, *exit_status, &why).await
                    }
                    Ok(EndAction::Checkpoint {
                        exit_status,
                        state,
                        command,
                        labels,
                        rollout,
                    }) => checkpoint(*exit_status, state, command, labels, rollout).await,
                    Ok(EndAction::Publish) => me.publish_locked(id, &why).await,
                    Ok(EndAction::Discard) => me.discard_locked(id, &why).await,
                    Ok(EndAction::Interrupted(by)) => me.interrupt_locked(id, *by, &why).await,
                };
                match r {
                    Ok(s) => {
                        // The end of the run completed the release; a run that
                        // had ended before (a publish through the admin API) did
                        // not end now: complete it here.
                        let s = if s.remove_pending {
                            me.blocking(move |st| {
                                st.complete_release(id)?;
                                st.session(id)
                            })
                            .await?
                        } else {
                            s
                        };
                        // The outcome was announced when it was recorded: only
                        // waiters on the release are woken (one event per run).
                        me.changed();
                        info!(session.id = id, outcome = ?s.outcome.as_ref().map(|o| o.kind), "sandbox session closed");
                        break Ok(s);
                    }
                    Err(EngineError::Mounted(..)) if tokio::time::Instant::now() < deadline => {
                        drop(_g);
                        tokio::time::sleep(backoff(attempt)).await;
                        attempt += 1;
                    }
                    Err(e) => break Err(e),
                }
            }
        })
        .await
        .map_err(|e| EngineError::Join(e.to_string()))??;
        self.sandboxes.release(id);
        self.after_publish(&s).await;
        Ok(s)
    }

    /// Session `id` runs in root mode: its init made its overlay `/` and
    /// mounted /proc, /dev, /sys and /run on it (the snapshotter says so when
    /// init reports ready, or a holder resumes the session after a restart).
    /// Its close then drops those mountpoints from the upper where the base
    /// lacks them ([`ROOT_MOUNTPOINTS`]): they are the sandbox's, not the
    /// session's changes. Forgotten at the release.
    pub fn sandbox_root_mode(&self, id: SessionId) {
        self.sandboxes.root_mode().insert(id);
    }

    /// Whether session `id` runs in root mode ([`Engine::sandbox_root_mode`]).
    pub(crate) fn sandbox_is_root_mode(&self, id: SessionId) -> bool {
        self.sandboxes.root_mode().contains(&id)
    }

    /// [`drop_root_mountpoints`] of session `s`'s upper against its lease's
    /// lowers, once the upper is unmounted everywhere. Still mounted:
    /// [`EngineError::Mounted`], and the close retries — going on would let
    /// the close's own census, a moment later, find the init's mount gone and
    /// publish the mountpoints (a user saw 5–20 % of quick closes do so).
    async fn drop_root_mountpoints_of(&self, s: &SessionInfo) -> Result<(), EngineError> {
        // The common case, a base that has them all: nothing was made, no census.
        if !ROOT_MOUNTPOINTS.iter().any(|n| s.upper.join(n).is_dir()) {
            return Ok(());
        }
        if self.upper_mounted(&s.upper).await? {
            return Err(EngineError::Mounted(s.id, s.upper.clone()));
        }
        let (id, store) = (s.id, self.store.clone());
        let dropped = tokio::task::spawn_blocking(move || -> Result<_, EngineError> {
            let ctx = store.publish_context(id)?;
            drop_root_mountpoints(&ctx.session.upper, &ctx.lease_lowers).map_err(|e| {
                EngineError::Read(
                    format!("session {id}'s upper {}", ctx.session.upper.display()),
                    e,
                )
            })
        })
        .await
        .map_err(|e| EngineError::Join(e.to_string()))??;
        if !dropped.is_empty() {
            debug!(
                session.id = id,
                ?dropped,
                "mountpoints the sandbox made are not the session's changes"
            );
        }
        Ok(())
    }

    /// The holder of sandbox session `id` is gone without closing it (its mount
    /// socket connection ended): ends the run by the recorded policy with no exit
    /// status, and releases it, once its namespaces are gone. Returns at once.
    pub fn sandbox_holder_gone(self: &Arc<Self>, id: SessionId) {
        let me = self.clone();
        tokio::spawn(async move {
            let r = me
                .close_sandbox_session(
                    id,
                    EndAction::auto(None),
                    "holder gone without closing (killed?)",
                    Duration::from_secs(30),
                )
                .await;
            match r {
                Ok(s) => {
                    info!(session.id = id, outcome = ?s.outcome.as_ref().map(|o| o.kind), "holder gone: session finished by its policy")
                }
                Err(e) => {
                    warn!(session.id = id, error = %error_chain(&e), "holder gone: cannot finish the session yet; it is retried at the next start")
                }
            }
        });
    }

    /// The init of daemon-owned session `id` ended without a CloseSession
    /// (killed from outside, out of memory): the run ends `interrupted`
    /// (`init-gone`), never by its policy, and the session is released with
    /// its upper kept. Returns at once.
    pub fn sandbox_init_gone(self: &Arc<Self>, id: SessionId) {
        let me = self.clone();
        tokio::spawn(async move {
            let r = me
                .close_sandbox_session(
                    id,
                    EndAction::Interrupted(Interruption::InitGone),
                    "the session's init ended without a close",
                    Duration::from_secs(30),
                )
                .await;
            match r {
                Ok(_) => info!(session.id = id, "init gone: session ended interrupted"),
                Err(e) => {
                    warn!(session.id = id, error = %error_chain(&e), "init gone: cannot end the session yet; it is ended at the next start")
                }
            }
        });
    }

    /// At start: live sandbox sessions of the last run take their permits.
    ///
    /// * A **daemon-owned** session's init died with the last daemon (its
    ///   parent-death signal): its run ends `interrupted` (`daemon-restart`)
    ///   and the session is released with its upper kept, before this
    ///   returns — before anything is served, so no close, wait or repeated
    ///   key sees it live, and nothing half-done is published by a policy.
    /// * A session held by a `layerstack session run|create` holder stays the
    ///   holder's: its holder may outlive the daemon, and `session run`
    ///   reconnects (`resume` on the mount socket) to close it with the
    ///   command's exit status — also when the last daemon died during that
    ///   close, after recording the release ([`Engine::recover`] leaves such a
    ///   run to its holder). Nothing ends it while its upper is mounted; once
    ///   the upper is unmounted everywhere (the holder's namespaces gone), it
    ///   waits [`SandboxSettings::holder_grace`] for the holder's close, and
    ///   only then is it finished by its policy with no exit status and
    ///   released.
    ///
    /// Returns how many were live.
    pub async fn recover_sandboxes(self: &Arc<Self>) -> Result<usize, EngineError> {
        let all = self.blocking(|s| s.sessions()).await?;
        // Ready WASI sessions of the last daemon (made ahead, never claimed,
        // in no list): discarded, not interrupted — nobody would ever close
        // them. So are those an older daemon ended interrupted with their
        // upper kept.
        let ready = |s: &SessionInfo| matches!(&s.owner, Owner::Wasi { name } if name == layerstack_store::READY_OWNER);
        for s in all.iter().filter(|s| {
            ready(s)
                && (!s.released
                    || (s.outcome.as_ref().map(|o| o.kind) == Some(OutcomeKind::Interrupted)
                        && s.upper.exists()))
        }) {
            let why = "a ready WASI session of the last daemon, never claimed";
            match self
                .close_sandbox_session(s.id, EndAction::Discard, why, Duration::ZERO)
                .await
            {
                Ok(_) => info!(session.id = s.id, "{why}: discarded"),
                Err(e) => {
                    warn!(session.id = s.id, error = %error_chain(&e), "cannot discard a ready WASI session of the last daemon; retried at the next start")
                }
            }
        }
        let live: Vec<SessionInfo> = all
            .into_iter()
            .filter(|s| {
                !ready(s)
                    && s.owner.is_sandbox()
                    && (!s.released || (s.remove_pending && !s.daemon_owned))
            })
            .collect();
        let why = "the daemon that owned the session's init ended (restart)";
        for s in live.iter().filter(|s| s.daemon_owned) {
            let id = s.id;
            // The outcome first, the release after: until the outcome is
            // recorded the session is live, so its attempt is never taken for
            // an orphan (`recover_graph`) and ends `interrupted`.
            let by = Interruption::DaemonRestart;
            let r = async {
                {
                    let _g = self.lock_session(id).await;
                    self.interrupt_locked(id, by, why).await?;
                }
                self.close_sandbox_session(id, EndAction::Interrupted(by), why, Duration::ZERO)
                    .await
            }
            .await;
            match r {
                Ok(_) => info!(
                    session.id = id,
                    "daemon-owned session ended interrupted: its init died with the last daemon"
                ),
                Err(e) => {
                    warn!(session.id = id, error = %error_chain(&e), "cannot end a daemon-owned session of the last daemon; retried at the next start")
                }
            }
        }
        for s in live.iter().filter(|s| !s.daemon_owned) {
            if !s.released {
                if let Ok(p) = self.sandboxes.sem.clone().try_acquire_owned() {
                    self.sandboxes.permits().insert(
                        s.id,
                        Slot {
                            _session: p,
                            _cpu: None,
                            _memory: None,
                        },
                    );
                }
            }
            let me = self.clone();
            let (id, upper) = (s.id, s.upper.clone());
            tokio::spawn(async move { me.await_holder(id, &upper).await });
        }
        Ok(live.len())
    }

    /// Session `id` of the last daemon, held by a holder process: waits until
    /// its upper is unmounted everywhere, then [`SandboxSettings::holder_grace`]
    /// for the holder's close; finishes it by its policy with no exit status
    /// when none came ([`Engine::sandbox_holder_gone`]).
    async fn await_holder(self: &Arc<Self>, id: SessionId, upper: &std::path::Path) {
        let closed = |s: Result<SessionInfo, EngineError>| {
            s.map(|s| s.released && !s.remove_pending).unwrap_or(true)
        };
        // The store is read only when something changed (a close or a
        // release notifies): a poll that read it every 2 s kept the daemon's
        // memory watcher from ever seeing the store idle (`memory.rs`), so its
        // caches stayed while such a session lived.
        let mut changes = self.generation.subscribe();
        loop {
            match self.upper_mounted(upper).await {
                Ok(false) => break,
                Ok(true) => tokio::time::sleep(Duration::from_secs(2)).await,
                Err(e) => {
                    warn!(session.id = id, error = %error_chain(&e), "census failed");
                    tokio::time::sleep(Duration::from_secs(10)).await;
                }
            }
            if changes.has_changed().unwrap_or(true) {
                changes.borrow_and_update();
                if closed(self.session(id).await) {
                    return;
                }
            }
        }
        let deadline = tokio::time::Instant::now() + self.sandboxes.holder_grace;
        let mut rx = self.generation.subscribe();
        loop {
            rx.borrow_and_update();
            if closed(self.session(id).await) {
                return;
            }
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                break;
            }
        }
        if closed(self.session(id).await) {
            return;
        }
        info!(
            session.id = id,
            grace_s = self.sandboxes.holder_grace.as_secs(),
            "the holder of a session of the last daemon did not come back to close it: finished by its policy with no exit status"
        );
        self.sandbox_holder_gone(id);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::collections::BTreeMap;
    use std::os::unix::fs::PermissionsExt;

    use layerstack_store::{ErrorKind, OutcomeKind, Store, StoreOptions, SNAPSHOT_REF_LABEL};

    use super::*;
    use crate::EngineSettings;

    #[test]
    fn backoff_grows_to_100_ms() {
        assert_eq!(backoff(0).as_millis(), 1);
        assert_eq!(backoff(3).as_millis(), 8);
        assert_eq!(backoff(20).as_millis(), 100);
    }

    use crate::test_support::have_root;

    #[test]
    fn a_mapped_upper_gets_the_sessions_ids_back_once() {
        use std::os::unix::fs::{lchown, MetadataExt};
        if !have_root("a_mapped_upper_gets_the_sessions_ids_back_once") {
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let up = t.path().join("upper");
        std::fs::create_dir_all(up.join("d")).unwrap();
        std::fs::write(up.join("d/suid"), "x").unwrap();
        std::fs::write(up.join("host-root"), "x").unwrap();
        std::os::unix::fs::symlink("d/suid", up.join("link")).unwrap();
        let m: layerstack_types::IdMap = "100000:200000:65536".parse().unwrap();
        for (p, u, g) in [
            ("", 100000, 200000),
            ("d", 101000, 201000),
            ("d/suid", 101000, 200005),
            ("link", 100007, 200007),
            // Overlay's own (a whiteout, made with the daemon's ids): kept.
            ("host-root", 0, 0),
        ] {
            lchown(up.join(p), Some(u), Some(g)).unwrap();
        }
        std::fs::set_permissions(up.join("d/suid"), std::fs::Permissions::from_mode(0o6755))
            .unwrap();
        // What a `setcap cap_net_raw+ep` by the session's root writes: a
        // revision-3 capability of root id 100000.
        let mut cap = Vec::new();
        for w in [0x0300_0001u32, 1 << 13, 0, 0, 0, 100000] {
            cap.extend_from_slice(&w.to_le_bytes());
        }
        set_xattr(&up.join("d/suid"), c"security.capability", &cap).unwrap();
        // An ACL naming user 1000 and group 5 of the session (host ids).
        let mut acl = 2u32.to_le_bytes().to_vec();
        for (tag, perm, id) in [
            (0x01u16, 6u16, u32::MAX),
            (0x02, 7, 101000),
            (0x04, 4, u32::MAX),
            (0x08, 5, 200005),
            (0x10, 7, u32::MAX),
            (0x20, 4, u32::MAX),
        ] {
            acl.extend_from_slice(&tag.to_le_bytes());
            acl.extend_from_slice(&perm.to_le_bytes());
            acl.extend_from_slice(&id.to_le_bytes());
        }
        set_xattr(&up.join("host-root"), c"system.posix_acl_access", &acl).unwrap();
        assert_eq!(shift_back_ids(&up, &m).unwrap(), 5);
        let cap_back = xattr_of(&up.join("d/suid"), c"security.capability")
            .unwrap()
            .expect("the file capability survives the chown");
        assert_eq!(cap_back.len(), 20, "revision 2: {cap_back:?}");
        assert_eq!(cap_back[..4], 0x0200_0001u32.to_le_bytes());
        assert_eq!(cap_back[4..8], (1u32 << 13).to_le_bytes());
        let acl_back = xattr_of(&up.join("host-root"), c"system.posix_acl_access")
            .unwrap()
            .unwrap();
        let ids: Vec<(u16, u32)> = acl_back[4..]
            .chunks(8)
            .map(|e| {
                (
                    u16::from_le_bytes([e[0], e[1]]),
                    u32::from_le_bytes([e[4], e[5], e[6], e[7]]),
                )
            })
            .filter(|(t, _)| matches!(t, 0x02 | 0x08))
            .collect();
        assert_eq!(ids, [(0x02, 1000), (0x08, 5)]);
        let ids = |p: &str| {
            let md = std::fs::symlink_metadata(up.join(p)).unwrap();
            (md.uid(), md.gid(), md.mode() & 0o7777)
        };
        assert_eq!(ids("").0, 0);
        assert_eq!(ids("d"), (1000, 1000, 0o755));
        assert_eq!(
            ids("d/suid"),
            (1000, 5, 0o6755),
            "the chown's cleared bits come back"
        );
        assert_eq!((ids("link").0, ids("link").1), (7, 7));
        assert_eq!((ids("host-root").0, ids("host-root").1), (0, 0));
        // Again (a crash after the first pass): nothing lies in the host range.
        assert_eq!(shift_back_ids(&up, &m).unwrap(), 0);
        assert_eq!(ids("d/suid"), (1000, 5, 0o6755));
    }

    #[test]
    fn file_capabilities_lose_their_host_root_id() {
        let m = layerstack_types::IdMap {
            host_uid: 100000,
            host_gid: 200000,
            size: 65536,
        };
        let v3 = |rootid: u32| {
            let mut cap = Vec::new();
            for w in [0x0300_0001u32, 1 << 13, 0, 0, 0, rootid] {
                cap.extend_from_slice(&w.to_le_bytes());
            }
            cap
        };
        // The session's root: revision 2, no root id.
        let r = caps_of_layer_root(v3(100000), &m);
        assert_eq!(r.len(), 20);
        assert_eq!(r[..4], 0x0200_0001u32.to_le_bytes());
        // A user namespace nested in the session, root 1000 there: revision 3
        // of root id 1000 — no host id left in the layer.
        let r = caps_of_layer_root(v3(101000), &m);
        assert_eq!(r.len(), 24);
        assert_eq!(r[..20], v3(0)[..20]);
        assert_eq!(r[20..], 1000u32.to_le_bytes());
        // Outside the range, and revision 2, as they were.
        assert_eq!(caps_of_layer_root(v3(5), &m), v3(5));
        assert_eq!(caps_of_layer_root(v3(100000 + 65536), &m), v3(165536));
        let v2 = v3(0)[..20].to_vec();
        assert_eq!(caps_of_layer_root(v2.clone(), &m), v2);
    }

    #[test]
    fn only_the_mountpoints_the_sandbox_made_are_dropped() {
        let t = tempfile::tempdir().unwrap();
        let (upper, lower) = (t.path().join("upper"), t.path().join("lower"));
        for d in [
            "upper/dev",
            "upper/proc",
            "upper/sys",
            "upper/run/x",
            "lower/sys",
            "upper/etc",
        ] {
            std::fs::create_dir_all(t.path().join(d)).unwrap();
        }
        let dropped = drop_root_mountpoints(&upper, &[lower]).unwrap();
        // dev and proc: empty, no lower has them. sys: the base's. run: the
        // command wrote into it. etc: not a mountpoint.
        assert_eq!(dropped, ["dev", "proc"]);
        for (d, kept) in [
            ("dev", false),
            ("proc", false),
            ("sys", true),
            ("run/x", true),
            ("etc", true),
        ] {
            assert_eq!(upper.join(d).exists(), kept, "{d}");
        }
        // Without the base's, the empty sys goes too; run still holds a write.
        assert_eq!(drop_root_mountpoints(&upper, &[]).unwrap(), ["sys"]);
    }

    /// A store with stack `ns/sha256:aaa` (one image layer holding etc/a) and an
    /// engine over it with a cap of `max` sandbox sessions.
    fn engine(dir: &std::path::Path, max: usize) -> Arc<Engine> {
        engine_with(
            dir,
            SandboxSettings {
                max_sessions: max,
                ..Default::default()
            },
        )
    }

    /// [`engine`] with the pool's settings `sandbox`.
    fn engine_with(dir: &std::path::Path, sandbox: SandboxSettings) -> Arc<Engine> {
        let store = Store::open(&dir.join("root"), &StoreOptions::default()).unwrap();
        let labels = BTreeMap::from([(SNAPSHOT_REF_LABEL.to_string(), "sha256:aaa".to_string())]);
        let (_, spec) = store
            .prepare("ns/1/extract-1 sha256:aaa", "", labels, false)
            .unwrap();
        let MountSpec::Bind { source, .. } = spec else {
            panic!("{spec:?}")
        };
        std::fs::set_permissions(&source, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::create_dir_all(source.join("etc")).unwrap();
        std::fs::write(source.join("etc/a"), b"a\n").unwrap();
        store
            .commit(
                "ns/2/sha256:aaa",
                "ns/1/extract-1 sha256:aaa",
                BTreeMap::new(),
            )
            .unwrap();
        // The stack exists once a session of the image exists (Mode A's first
        // Prepare) or once Mode B asks for it.
        assert!(store
            .ensure_image_stack("ns", "sha256:aaa")
            .unwrap()
            .is_some());
        Engine::new(
            Arc::new(store),
            EngineSettings {
                sandbox,
                ..Default::default()
            },
        )
    }

    /// The pool's CPU and memory budgets (issue 21): a sandbox whose limits
    /// do not fit what the live ones leave is `busy` (at once, or after its
    /// wait), one that asks more than a whole budget is an invalid argument,
    /// and a close gives its share back to a waiting create.
    #[tokio::test]
    async fn the_budgets_bound_the_pool_by_cpu_and_memory() {
        if !have_root("the_budgets_bound_the_pool_by_cpu_and_memory") {
            return;
        }
        let t = tempfile::Builder::new()
            .prefix("ls-sandbox-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let e = engine_with(
            t.path(),
            SandboxSettings {
                max_sessions: 16,
                cpu_budget_millis: 1000,
                memory_budget_bytes: 64 << 20,
                ..Default::default()
            },
        );
        let with = |name: &str, cpu: u64, mem: u64, wait: Option<Duration>| SandboxRequest {
            reserve: Reservation {
                cpu_millis: cpu,
                memory_bytes: mem,
            },
            ..req(name, None, wait)
        };
        let (a, _, _) = e
            .create_sandbox_session(with("a", 600, 16 << 20, None))
            .await
            .unwrap();
        let err = e
            .create_sandbox_session(with("b", 600, 16 << 20, None))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Busy, "{err}");
        assert!(
            err.to_string().contains("cpu_budget_millis") && err.to_string().contains("600 of"),
            "names the budget and what is held: {err}"
        );
        // Memory: 16 + 56 MiB > 64 MiB (CPU fits).
        let err = e
            .create_sandbox_session(with("c", 100, 56 << 20, None))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Busy, "{err}");
        assert!(err.to_string().contains("memory_budget_bytes"), "{err}");
        // More than a whole budget can never fit.
        let err = e
            .create_sandbox_session(with("d", 2000, 0, Some(Duration::from_secs(5))))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
        // A refused create took nothing: 400 millis and 48 MiB are still free.
        let (small, _, _) = e
            .create_sandbox_session(with("e", 400, 48 << 20, None))
            .await
            .unwrap();
        // A create that waits gets a's share once a closes.
        let e2 = e.clone();
        let waiter = tokio::spawn(async move {
            e2.create_sandbox_session(with("f", 600, 16 << 20, Some(Duration::from_secs(10))))
                .await
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "f waits for CPU");
        e.close_sandbox_session(a.id, EndAction::Discard, "test", Duration::from_secs(1))
            .await
            .unwrap();
        let (f, _, _) = waiter.await.unwrap().unwrap();
        for id in [small.id, f.id] {
            e.close_sandbox_session(id, EndAction::Discard, "test", Duration::from_secs(1))
                .await
                .unwrap();
        }
        // Everything given back: the whole budget fits again.
        let (g, _, _) = e
            .create_sandbox_session(with("g", 1000, 64 << 20, None))
            .await
            .unwrap();
        e.close_sandbox_session(g.id, EndAction::Discard, "test", Duration::from_secs(1))
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn the_creation_rate_lets_a_burst_through_then_spaces_creations() {
        let rate = Rate::new(10).unwrap();
        let now = tokio::time::Instant::now();
        for i in 0..10 {
            let at = rate
                .reserve(Duration::ZERO)
                .unwrap_or_else(|| panic!("creation {i} of the burst refused"));
            assert!(
                at <= now + Duration::from_millis(50),
                "creation {i} of the burst waits"
            );
        }
        assert!(
            rate.reserve(Duration::ZERO).is_none(),
            "the 11th in the same instant must wait"
        );
        let at = rate.reserve(Duration::from_secs(1)).unwrap();
        let waited = at.saturating_duration_since(now);
        assert!(
            waited >= Duration::from_millis(50) && waited <= Duration::from_millis(200),
            "{waited:?}"
        );
        let next = rate.reserve(Duration::from_secs(1)).unwrap();
        assert!(next > at, "each reservation takes the next slot");
        assert!(Rate::new(0).is_none(), "0 is unlimited");
    }

    fn req(name: &str, policy: Option<ExitPolicy>, wait: Option<Duration>) -> SandboxRequest {
        SandboxRequest {
            name: name.into(),
            stack: "ns/sha256:aaa".into(),
            target: LeaseTarget::Branch("main".into()),
            idempotency_key: None,
            policy,
            wait,
            node: None,
            ignore_mtime: false,
            daemon_owned: false,
            wasi: false,
            reserve: Reservation::default(),
            id_map: None,
        }
    }

    /// `Writers::Gone` skips the census for a daemon-owned session only: a
    /// holder's session whose upper is mounted elsewhere is still refused
    /// as mounted, and so is a daemon-owned one whose caller knows nothing;
    /// a daemon-owned one with `Gone` is discarded in one step (released,
    /// `discarded`, its directories handed to the reaper) although mounted.
    #[tokio::test]
    async fn only_a_daemon_owned_session_whose_writers_are_gone_skips_the_census() {
        if !have_root("only_a_daemon_owned_session_whose_writers_are_gone_skips_the_census") {
            return;
        }
        let t = crate::test_support::tmp_named("sandbox");
        let e = engine(t.path(), 4);
        let (held, _, _) = e
            .create_sandbox_session(req("held", None, None))
            .await
            .unwrap();
        let owned_req = |name: &str| SandboxRequest {
            daemon_owned: true,
            ..req(name, None, None)
        };
        let (unknown, _, _) = e
            .create_sandbox_session(owned_req("unknown"))
            .await
            .unwrap();
        let (owned, _, _) = e.create_sandbox_session(owned_req("owned")).await.unwrap();
        let all = [&held, &unknown, &owned];
        let mut holders: Vec<_> = all
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let d = t.path().join(format!("m{i}"));
                crate::test_support::mount_elsewhere(&d, &s.upper, &s.work, 5.0)
            })
            .collect();
        for s in all {
            let t0 = std::time::Instant::now();
            while !e.upper_mounted(&s.upper).await.unwrap() {
                assert!(t0.elapsed().as_secs() < 10, "never mounted");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        let close = |id, writers| {
            e.close_sandbox_session_with(
                id,
                EndAction::Discard,
                "test",
                Duration::from_millis(50),
                writers,
            )
        };
        let err = close(held.id, Writers::Gone).await.unwrap_err();
        assert!(matches!(err, EngineError::Mounted(..)), "{err}");
        let err = close(unknown.id, Writers::Unknown).await.unwrap_err();
        assert!(matches!(err, EngineError::Mounted(..)), "{err}");
        let s = close(owned.id, Writers::Gone).await.unwrap();
        assert!(s.released, "{s:?}");
        assert_eq!(s.outcome.map(|o| o.kind), Some(OutcomeKind::Discarded));
        assert!(!e.store().session(held.id).unwrap().run_finished());
        for h in &mut holders {
            let _ = h.kill();
            let _ = h.wait();
        }
    }

    #[tokio::test]
    async fn the_cap_answers_busy_and_never_hangs() {
        if !have_root("the_cap_answers_busy_and_never_hangs") {
            return;
        }
        let t = tempfile::Builder::new()
            .prefix("ls-sandbox-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let e = engine(t.path(), 2);
        let (a, _, _) = e
            .create_sandbox_session(req("a", None, None))
            .await
            .unwrap();
        let mut keyed = req("b", None, None);
        keyed.idempotency_key = Some("k".into());
        let (b, _, created) = e.create_sandbox_session(keyed.clone()).await.unwrap();
        assert!(created);
        assert_eq!(e.sandbox_load(), (2, 2));
        let err = e
            .create_sandbox_session(req("c", None, None))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Busy, "{err}");
        let t0 = std::time::Instant::now();
        let err = e
            .create_sandbox_session(req("c", None, Some(Duration::from_millis(50))))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Busy);
        assert!(t0.elapsed() < Duration::from_secs(5));
        // The same key is the same session; it does not take another slot once
        // one is free.
        e.close_sandbox_session(a.id, EndAction::Discard, "test", Duration::from_secs(1))
            .await
            .unwrap();
        let (b2, _, created) = e.create_sandbox_session(keyed).await.unwrap();
        assert_eq!((b2.id, created), (b.id, false));
        assert_eq!(e.sandbox_load(), (1, 2));
        // A waiter gets the slot a close frees.
        let e2 = e.clone();
        let waiter = tokio::spawn(async move {
            e2.create_sandbox_session(req("d", None, Some(Duration::from_secs(30))))
                .await
        });
        let _c = e
            .create_sandbox_session(req("c", None, None))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());
        e.close_sandbox_session(b.id, EndAction::Discard, "test", Duration::from_secs(1))
            .await
            .unwrap();
        let (d, _, _) = waiter.await.unwrap().unwrap();
        assert_eq!(d.owner.display(), "sandbox:d");
    }

    /// A restart with daemon-owned sessions live (their inits died with the
    /// last daemon): each ends `interrupted` whatever its policy, before
    /// `recover_sandboxes` returns; nothing published, the upper kept, the
    /// attempt `interrupted`; a later close only answers it. A holder's
    /// session still ends by its policy.
    #[tokio::test]
    async fn a_restart_interrupts_daemon_owned_sessions_and_publishes_nothing() {
        if !have_root("a_restart_interrupts_daemon_owned_sessions_and_publishes_nothing") {
            return;
        }
        let t = tempfile::Builder::new()
            .prefix("ls-sandbox-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let e = engine(t.path(), 8);
        let owned = |name: &str, node: Option<String>| SandboxRequest {
            daemon_owned: true,
            wasi: false,
            reserve: Default::default(),
            id_map: None,
            node,
            ..req(name, Some(ExitPolicy::OnExit), None)
        };
        // The branch exists once a session leased it.
        let (a, _, _) = e.create_sandbox_session(owned("a", None)).await.unwrap();
        let (_, root) = e
            .graph_create("g", "ns/sha256:aaa", "main", None)
            .await
            .unwrap();
        let (b, _, _) = e
            .create_sandbox_session(owned("b", Some(root.id.clone())))
            .await
            .unwrap();
        let (h, _, _) = e
            .create_sandbox_session(req("h", Some(ExitPolicy::OnExit), None))
            .await
            .unwrap();
        assert!(a.daemon_owned && b.daemon_owned && !h.daemon_owned);
        for s in [&a, &b, &h] {
            std::fs::set_permissions(&s.upper, std::fs::Permissions::from_mode(0o755)).unwrap();
            std::fs::write(s.upper.join("half-done"), b"x\n").unwrap();
        }
        // The next daemon over the same store.
        let store = e.store().clone();
        drop(e);
        // A short wait for holders: h's never comes back (it never existed).
        let settings = EngineSettings {
            sandbox: SandboxSettings {
                holder_grace: Duration::from_millis(200),
                ..Default::default()
            },
            ..Default::default()
        };
        let e = Engine::new(store, settings);
        assert_eq!(e.recover_sandboxes().await.unwrap(), 3);
        for s in [&a, &b] {
            let now = e.session(s.id).await.unwrap();
            let o = now.outcome.clone().unwrap();
            assert_eq!(
                (o.kind, o.interrupted_by, o.layer, now.released),
                (
                    OutcomeKind::Interrupted,
                    Some(Interruption::DaemonRestart),
                    None,
                    true
                ),
                "{now:?}"
            );
            assert!(s.upper.join("half-done").exists(), "the upper is kept");
            // A close after the interruption publishes nothing.
            let closed = e
                .close_sandbox_session(s.id, EndAction::Publish, "late", Duration::from_secs(1))
                .await
                .unwrap();
            assert_eq!(
                closed.outcome.map(|o| o.kind),
                Some(OutcomeKind::Interrupted)
            );
        }
        let attempt = e
            .store()
            .attempt_of_session(b.id)
            .unwrap()
            .expect("b's attempt");
        assert_eq!(attempt.status, layerstack_store::AttemptStatus::Interrupted);
        // The holder's session: by its policy once unmounted (it never was).
        let t0 = std::time::Instant::now();
        let held = loop {
            let s = e.session(h.id).await.unwrap();
            if (s.released && s.outcome.is_some()) || t0.elapsed() > Duration::from_secs(10) {
                break s;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(held.outcome.map(|o| o.kind), Some(OutcomeKind::Committed));
        // Only the holder's write reached the branch.
        let (n, spec, _) = e
            .create_sandbox_session(req("n", None, None))
            .await
            .unwrap();
        let MountSpec::Overlay { lowers, .. } = spec else {
            panic!()
        };
        assert_eq!(
            lowers
                .iter()
                .filter(|l| l.join("half-done").exists())
                .count(),
            1
        );
        drop(n);
    }

    /// A restart while a holder's command runs, and one during its close
    /// (the release recorded, the run not ended): the restarted engine ends
    /// neither by itself while the holder may still come back (an attempt's
    /// stays running: not abandoned); the holder's close with the exit status
    /// applies the policy as if there had been no restart (`on-success` with
    /// 0 publishes; `checkpoint` checkpoints).
    #[tokio::test]
    async fn a_restart_leaves_holder_sessions_to_their_holders_close() {
        if !have_root("a_restart_leaves_holder_sessions_to_their_holders_close") {
            return;
        }
        let t = tempfile::Builder::new()
            .prefix("ls-sandbox-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let e = engine(t.path(), 8);
        let on_success = Some(ExitPolicy::OnSuccess);
        let (running, _, _) = e
            .create_sandbox_session(req("r", on_success, None))
            .await
            .unwrap();
        let (closing, _, _) = e
            .create_sandbox_session(req("c", on_success, None))
            .await
            .unwrap();
        // An attempt of a graph node, whose close checkpoints.
        let (_, root) = e
            .graph_create("g", "ns/sha256:aaa", "main", None)
            .await
            .unwrap();
        let (attempt, _, _) = e
            .create_sandbox_session(SandboxRequest {
                node: Some(root.id.clone()),
                ..req("n", Some(ExitPolicy::Checkpoint), None)
            })
            .await
            .unwrap();
        for s in [&running, &closing, &attempt] {
            std::fs::set_permissions(&s.upper, std::fs::Permissions::from_mode(0o755)).unwrap();
            std::fs::write(s.upper.join(format!("w{}", s.id)), b"x\n").unwrap();
        }
        // The last daemon died during the closes of `closing` and `attempt`,
        // after their release.
        for s in [&closing, &attempt] {
            e.store().release_sandbox_session(s.id).unwrap();
        }
        let store = e.store().clone();
        drop(e);
        let e = Engine::new(store, EngineSettings::default());
        e.recover().await.unwrap();
        assert_eq!(e.recover_sandboxes().await.unwrap(), 3);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let a = e.store().attempt_of_session(attempt.id).unwrap().unwrap();
        assert_eq!(
            a.status,
            layerstack_store::AttemptStatus::Running,
            "not abandoned"
        );
        let closed = e
            .close_sandbox_session(
                attempt.id,
                EndAction::auto(Some(0)),
                "holder",
                Duration::from_secs(1),
            )
            .await
            .unwrap();
        let a = e.store().attempt_of_session(attempt.id).unwrap().unwrap();
        assert_eq!(
            a.status,
            layerstack_store::AttemptStatus::Checkpointed,
            "{closed:?}"
        );
        for s in [&running, &closing] {
            let now = e.session(s.id).await.unwrap();
            assert!(now.outcome.is_none(), "ended without its holder: {now:?}");
            let closed = e
                .close_sandbox_session(
                    s.id,
                    EndAction::auto(Some(0)),
                    "holder",
                    Duration::from_secs(1),
                )
                .await
                .unwrap();
            assert_eq!(
                (
                    closed.outcome.map(|o| o.kind),
                    closed.released,
                    closed.remove_pending
                ),
                (Some(OutcomeKind::Committed), true, false),
                "session {}",
                s.id
            );
        }
    }

    /// A holder session re-adopted after a restart whose upper stays
    /// mounted (its holder lives on) is watched through the mount census and
    /// the engine's notifications: the store is not read while nothing
    /// changes, so the daemon's memory watcher sees it idle and frees its
    /// caches (the watcher read it every 2 s before); its close is still
    /// seen at once.
    #[tokio::test]
    async fn a_watched_holder_session_leaves_the_store_idle() {
        if !have_root("a_watched_holder_session_leaves_the_store_idle") {
            return;
        }
        let t = crate::test_support::tmp_named("sandbox");
        let e = engine(t.path(), 8);
        let (s, _, _) = e
            .create_sandbox_session(req("held", Some(ExitPolicy::OnSuccess), None))
            .await
            .unwrap();
        // The holder: its own mount namespace, the overlay mounted for 8 s.
        let mut holder = crate::test_support::mount_elsewhere(t.path(), &s.upper, &s.work, 8.0);
        let store = e.store().clone();
        drop(e);
        let e = Engine::new(store, EngineSettings::default());
        e.recover().await.unwrap();
        let t0 = std::time::Instant::now();
        while !e.upper_mounted(&s.upper).await.unwrap() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the holder never mounted"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(e.recover_sandboxes().await.unwrap(), 1);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let before = e.store().db_transactions();
        tokio::time::sleep(Duration::from_millis(4500)).await;
        assert_eq!(
            e.store().db_transactions(),
            before,
            "the store was read while nothing changed"
        );
        // The holder's close ends it (policy on-success, status 0).
        let closed = e
            .close_sandbox_session(
                s.id,
                EndAction::auto(Some(0)),
                "holder",
                Duration::from_secs(10),
            )
            .await;
        let _ = holder.kill();
        let _ = holder.wait();
        let closed = closed.unwrap();
        assert!(closed.released, "{closed:?}");
    }

    #[tokio::test]
    async fn close_applies_the_recorded_policy_and_releases() {
        if !have_root("close_applies_the_recorded_policy_and_releases") {
            return;
        }
        let t = tempfile::Builder::new()
            .prefix("ls-sandbox-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let e = engine(t.path(), 8);
        let mut events = e.subscribe();
        let write = |s: &SessionInfo, name: &str| {
            std::fs::set_permissions(&s.upper, std::fs::Permissions::from_mode(0o755)).unwrap();
            std::fs::write(s.upper.join(name), b"x\n").unwrap();
        };
        // on-success without an exit status (a killed holder): discarded.
        let (s1, _, _) = e
            .create_sandbox_session(req("k", Some(ExitPolicy::OnSuccess), None))
            .await
            .unwrap();
        assert_eq!(s1.policy.as_deref(), Some("on-success"));
        write(&s1, "lost");
        let dir = e.store().session_dir(s1.id);
        let out = e
            .close_sandbox_session(s1.id, EndAction::auto(None), "gone", Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(out.outcome.map(|o| o.kind), Some(OutcomeKind::Discarded));
        assert!(out.released);
        // One outcome event for the run (metrics and the log line count it once).
        let ev = events.try_recv().unwrap();
        assert_eq!((ev.session, ev.kind), (s1.id, OutcomeKind::Discarded));
        assert!(events.try_recv().is_err(), "a second event for one outcome");
        assert!(
            !dir.exists(),
            "a released session's directories are removed"
        );
        // on-exit with status 3: published.
        let (s2, _, _) = e
            .create_sandbox_session(req("p", Some(ExitPolicy::OnExit), None))
            .await
            .unwrap();
        write(&s2, "kept");
        let out = e
            .close_sandbox_session(
                s2.id,
                EndAction::auto(Some(3)),
                "exit",
                Duration::from_secs(1),
            )
            .await
            .unwrap();
        assert_eq!(out.outcome.map(|o| o.kind), Some(OutcomeKind::Committed));
        // Closing again changes nothing.
        let again = e
            .close_sandbox_session(s2.id, EndAction::Discard, "again", Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(again.outcome.map(|o| o.kind), Some(OutcomeKind::Committed));
        assert_eq!(e.sandbox_load(), (0, 8));
        // The next session sees the published file, not the discarded one.
        let (s3, spec, _) = e
            .create_sandbox_session(req("n", None, None))
            .await
            .unwrap();
        let MountSpec::Overlay { lowers, .. } = spec else {
            panic!()
        };
        assert!(lowers.iter().any(|l| l.join("kept").exists()));
        assert!(!lowers.iter().any(|l| l.join("lost").exists()));
        // A container's session is not closed this way.
        let err = e
            .close_sandbox_session(999, EndAction::Discard, "x", Duration::from_secs(1))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NotFound);
        drop(s3);
    }
}
