//! The holder side of a Mode B session: the processes `layerstack session run`,
//! `create` and `exec` start, and what each does in the kernel.
//!
//! ```text
//! holder (layerstack, caller's namespaces)      keeps the mount socket open
//!   └─ init  = clone(NEWNS|NEWPID|NEWIPC|NEWUTS[|NEWNET])   pid 1 of the session
//!        │  PR_SET_PDEATHSIG(SIGKILL) (run), mount / rprivate, attach the overlay
//!        │  root mode: overlay on "/", fchdir into it, /proc /dev /sys /run,
//!        │  pivot_root(".", "."), detach the old root; workspace mode: overlay
//!        │  on DIR, a fresh /proc; hostname; lo up (--net none)
//!        │  sends "ready" (its pid reaches the daemon by SCM_CREDENTIALS)
//!        └─ command = fork, drop to --user, chdir --workdir, execve (127: not
//!             found, 126: not executable); init forwards signals to it, reaps
//!             orphans and exits with its status (128 + n for signal n)
//! ```
//! When init exits (pid 1), the kernel kills the rest of the pid namespace; the
//! last process gone takes the mount namespace, and the overlay, with it. The
//! holder then asks the daemon to close the session (census first: the upper is
//! proven unmounted everywhere). A holder killed with SIGKILL takes init with it
//! (parent-death signal); the daemon sees the mount socket close and finishes the
//! session by its recorded policy.
//!
//! Code between a `clone` and the `execve`/`_exit` of that process makes only
//! child-safe calls ([`crate::sys`]): every string it needs is built before.

use std::ffi::{CStr, CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicI32, Ordering};

use crate::sys::{self, CArgs, Exit};

/// Default `PATH` of a root-mode session (containerd's default spec).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Exit status when the session could not be set up (as `docker run`'s 125).
pub const SETUP_FAILED: i32 = 125;

/// The command a session runs.
pub struct Command {
    /// Paths to try in order (a `PATH` search done beforehand, in the session's
    /// root: see [`candidates`]).
    pub candidates: Vec<CString>,
    pub argv: CArgs,
    pub envp: CArgs,
    /// `argv[0]`, for messages.
    pub name: Vec<u8>,
    /// `--user UID:GID`.
    pub ids: Option<(u32, u32)>,
    /// Working directory (absolute, in the session's view).
    pub workdir: CString,
    /// The session has a user namespace of its own (an id map): the waiter
    /// joins it with the other namespaces, and the command runs as `ids` of
    /// that namespace (`0:0` when `ids` is `None`).
    pub userns: bool,
}

/// Where the overlay goes.
pub enum Placement {
    /// The overlay becomes `/` (pivot_root), with /proc, /dev, /sys, /run.
    Root,
    /// The overlay is mounted at this absolute directory; the root stays.
    At(CString),
}

/// A path of the daemon's a workspace-mode session must not reach (its
/// sockets), covered in the session's mount namespace before the overlay is
/// attached.
pub enum Hide {
    /// An empty read-only tmpfs over this directory.
    Dir(CString),
    /// `/dev/null` bind-mounted over this file (a socket in `/`, whose
    /// directory cannot be covered).
    File(CString),
}

/// Everything init needs, built before the clone.
pub struct Setup {
    pub placement: Placement,
    /// A network namespace with only `lo` (`--net none`).
    pub net_none: bool,
    pub hostname: Vec<u8>,
    /// The detached overlay (from the daemon); with `claim`, the socket on
    /// which it arrives.
    pub mount_fd: RawFd,
    /// A ready init (made ahead of its session, `spawner::ready_request`):
    /// once its namespaces are set up (`lo` up, `/` private) it waits on
    /// `mount_fd`, a `SOCK_SEQPACKET` socket, for one message — the
    /// session's hostname (at most 64 bytes) with the detached overlay
    /// attached — and then goes on as any init (`hostname` is not used).
    /// End of file there: the daemon let it go; it exits 0.
    pub claim: bool,
    /// The mount socket connection (init reports "ready" on it); `None` for a
    /// daemon-owned session (the daemon knows init's pid from the clone).
    pub holder_sock: Option<RawFd>,
    /// The "ready" line init sends.
    pub ready_line: Vec<u8>,
    /// Run mode: init dies with the holder. Create mode: init outlives it, on
    /// /dev/null, in its own session.
    pub die_with_parent: bool,
    /// Daemon-owned: init is a child of the daemon, cloned by the daemon's
    /// process spawner ([`crate::spawner`], `CLONE_PARENT`). It closes every
    /// descriptor it was not given (nothing of the spawner's or of other
    /// sessions must live on in it) and sits on /dev/null in its own
    /// session. With `die_with_parent`, the parent-death signal follows the
    /// daemon's thread that forked the spawner (its main thread).
    pub daemon_owned: bool,
    /// `cgroup.procs` descriptors of the session's cgroup
    /// ([`crate::cgroup::SessionCgroup::procs_fds`]): init joins them first
    /// thing after the clone (and makes itself the OOM killer's last choice).
    pub cgroup_procs: Vec<RawFd>,
    /// Workspace mode: what to cover before the overlay is attached.
    pub hide: Vec<Hide>,
    /// The session's uid/gid mapping. Init sets the session up as the
    /// host's root in namespaces the host's user namespace owns (as
    /// bubblewrap does), then unshares a user namespace and a mount
    /// namespace (`unshare(CLONE_NEWUSER | CLONE_NEWNS)`): every mount it
    /// made is then locked with its flags (mount_namespaces(7), "Restrictions
    /// on mount namespaces") — the session's root cannot remount the overlay
    /// `dev`, nor mount procfs or change the hostname. Init writes `u` on its
    /// ready pipe, waits for one byte on the `go` pipe [`clone_init`]
    /// returns — the cloner writes the mapping first
    /// ([`sys::write_id_map`]) — and becomes the namespace's root (`0:0`, the
    /// host's `host_uid:host_gid`). `None`: init runs as the host's root.
    pub id_map: Option<layerstack_types::IdMap>,
}

/// The paths to try for `cmd` with search path `path`, like `execvp`: `cmd`
/// itself when it contains a `/`, else `dir/cmd` for every `PATH` entry (empty
/// entry = current directory).
pub fn candidates(cmd: &OsStr, path: &OsStr) -> io::Result<Vec<CString>> {
    let bad = |_| io::Error::new(io::ErrorKind::InvalidInput, "argument contains a NUL byte");
    let c = cmd.as_bytes();
    if c.contains(&b'/') {
        return Ok(vec![CString::new(c).map_err(bad)?]);
    }
    path.as_bytes()
        .split(|&b| b == b':')
        .map(|d| {
            let mut p = if d.is_empty() {
                b".".to_vec()
            } else {
                d.to_vec()
            };
            p.push(b'/');
            p.extend_from_slice(c);
            CString::new(p).map_err(bad)
        })
        .collect()
}

/// The child of a started session init.
pub struct Init {
    /// Init's pid (in the holder's pid namespace).
    pub pid: libc::pid_t,
}

/// Init's pid, for the holder's signal handler.
static FORWARD_TO: AtomicI32 = AtomicI32::new(0);

extern "C" fn forward(sig: libc::c_int) {
    let pid = FORWARD_TO.load(Ordering::Relaxed);
    if pid > 0 {
        sys::kill(pid, sig);
    }
}

/// Starts the session's init (see the module docs) and waits until it is ready:
/// the overlay is in place and — with `cmd` — the command started. Returns
/// `Err` with init's exit when setup failed (init reported why on stderr).
///
/// In run mode (`cmd` given) the holder then forwards SIGINT, SIGTERM, SIGHUP and
/// SIGQUIT to init until [`Init::wait`].
pub fn start(setup: &Setup, cmd: Option<&Command>) -> io::Result<Result<Init, Exit>> {
    let set = sys::init_sigset();
    // Blocked before the clone: init inherits the mask, so no signal meant for
    // it is lost before it waits for signals.
    sys::sigmask(libc::SIG_BLOCK, &set);
    let (pid, ready_r, go) = match clone_init(setup, cmd, 0) {
        Ok(x) => x,
        Err(e) => {
            sys::sigmask(libc::SIG_UNBLOCK, &set);
            return Err(e);
        }
    };
    if cmd.is_some() {
        FORWARD_TO.store(pid, Ordering::Relaxed);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
            sys::set_handler(
                s,
                forward as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
    }
    sys::sigmask(libc::SIG_UNBLOCK, &set);
    let mut b = [0u8; 1];
    let mut n = sys::read(ready_r.as_raw_fd(), &mut b)?;
    if let (1, b'u', Some(map), Some(go)) = (n, b[0], &setup.id_map, &go) {
        if let Err(e) = map_ids(pid, map, go) {
            sys::kill(pid, libc::SIGKILL);
            let _ = sys::wait_pid(pid);
            return Err(e);
        }
        n = sys::read(ready_r.as_raw_fd(), &mut b)?;
    }
    if n == 1 && b[0] == b'r' {
        return Ok(Ok(Init { pid }));
    }
    // Init ended before it was ready: setup failed.
    let x = sys::wait_pid(pid)?;
    FORWARD_TO.store(0, Ordering::Relaxed);
    Ok(Err(x))
}

/// The data of the tmpfs and devpts mounts of a root-mode session, built
/// before the clone (init cannot allocate). In a session with a uid/gid
/// mapping, init mounts them as the host's root: they are given to the
/// session's root (`uid=`, `gid=` of the host's ids), and `/dev/pts`'s
/// tty group is the session's gid 5 when the mapping has it.
struct MountOpts {
    dev: CString,
    pts: CString,
    shm: CString,
    run: CString,
}

impl MountOpts {
    fn new(map: Option<&layerstack_types::IdMap>) -> MountOpts {
        let owner = map
            .map(|m| format!(",uid={},gid={}", m.host_uid, m.host_gid))
            .unwrap_or_default();
        let tty = match map {
            None => ",gid=5".to_string(),
            Some(m) if m.size > 5 => format!(",gid={}", u64::from(m.host_gid) + 5),
            Some(_) => String::new(),
        };
        let c = |s: String| CString::new(s).unwrap_or_default();
        MountOpts {
            dev: c(format!("mode=755,size=65536k{owner}")),
            pts: c(format!("newinstance,ptmxmode=0666,mode=0620{tty}")),
            shm: c(format!("mode=1777,size=65536k{owner}")),
            run: c(format!("mode=755,size=65536k{owner}")),
        }
    }
}

/// Clones the session's init (see the module docs) without waiting for it:
/// returns its pid and the read end of its ready pipe, on which init writes
/// `r` once it is set up (end of file without it: setup failed, and
/// init's exit status says so). With an id map ([`Setup::id_map`]) also the
/// write end of its `go` pipe: init first writes `u` on its ready pipe,
/// the caller then writes the mapping ([`sys::write_id_map`]) and one byte
/// on `go` ([`map_ids`] does both). `extra` is or-ed into the clone flags
/// (the process spawner's `CLONE_PARENT`). The caller blocks
/// [`sys::init_sigset`] before the call (init inherits the mask and waits
/// for those signals with `sigwait`).
pub fn clone_init(
    setup: &Setup,
    cmd: Option<&Command>,
    extra: libc::c_int,
) -> io::Result<(libc::pid_t, OwnedFd, Option<OwnedFd>)> {
    let (ready_r, ready_w) = sys::pipe()?;
    let mount_opts = MountOpts::new(setup.id_map.as_ref());
    let devnull = if setup.die_with_parent && !setup.daemon_owned {
        None
    } else {
        Some(
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/null")?,
        )
    };
    let set = sys::init_sigset();
    let mut flags = INIT_FLAGS | extra;
    if setup.net_none {
        flags |= libc::CLONE_NEWNET;
    }
    // With an id map: init unshares its user namespace once set up, and
    // waits on `go` until its mapping is written.
    let go = match setup.id_map {
        Some(_) => Some(sys::pipe()?),
        None => None,
    };
    // SAFETY: the child runs only `init_main`, which makes child-safe calls and
    // ends in `_exit`.
    let pid = match unsafe { sys::clone_fork(flags) } {
        Ok(0) => {
            sys::close(ready_r.as_raw_fd());
            let go_r = go.as_ref().map(|(r, w)| {
                sys::close(w.as_raw_fd());
                r.as_raw_fd()
            });
            init_main(
                setup,
                cmd,
                ready_w.as_raw_fd(),
                devnull.as_ref().map(AsRawFd::as_raw_fd),
                go_r,
                &mount_opts,
                &set,
            )
        }
        Ok(pid) => pid,
        Err(e) => return Err(e),
    };
    drop(ready_w);
    drop(devnull);
    Ok((pid, ready_r, go.map(|(_, w)| w)))
}

/// The cloner's part of a mapped init's start ([`Setup::id_map`]), once init
/// wrote `u` on its ready pipe: writes `map` as init's uid/gid mapping and
/// one byte on `go`. Errors: the writes' (init then sees end of file on
/// `go` and fails; the caller kills and reaps it).
pub fn map_ids(pid: libc::pid_t, map: &layerstack_types::IdMap, go: &OwnedFd) -> io::Result<()> {
    sys::write_id_map(pid, map)
        .and_then(|()| sys::write_all(go.as_raw_fd(), b"g"))
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("writing the session's uid/gid mapping {map}: {e}"),
            )
        })
}

impl Init {
    /// Waits for init (and so the command) to end.
    pub fn wait(self) -> io::Result<Exit> {
        let x = sys::wait_pid(self.pid);
        FORWARD_TO.store(0, Ordering::Relaxed);
        x
    }
}

fn fail(step: &[&[u8]], e: &io::Error) -> ! {
    // First: a report to a stderr nobody reads may end us by SIGPIPE.
    not_started();
    sys::report(step, Some(e));
    sys::exit_now(SETUP_FAILED)
}

/// In an Exec's command before its `execve` ([`joined_waiter`]): the write
/// end of the waiter's close-on-exec "start" pipe (−1 elsewhere). A command
/// that cannot be started writes one byte there before it exits
/// ([`not_started`]); one that execs closes it unwritten.
static START_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

/// Tells the waiter that the command was never started (see [`START_FD`]).
/// Child-safe.
fn not_started() {
    let fd = START_FD.load(Ordering::Relaxed);
    if fd >= 0 {
        let _ = sys::write_all(fd, b"n");
    }
}

/// A character device under `dev/` of the new root; bind-mounted from the host's
/// `/dev` when mknod is not allowed (a user namespace, a restricted container).
fn device(rel: &CStr, host: &CStr, major: u32, minor: u32) {
    match sys::mknod_char(rel, 0o666, major, minor) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
        Err(_) => {
            if let Err(e) = sys::touch(rel)
                .and_then(|()| sys::mount(Some(host), rel, None, libc::MS_BIND, None))
            {
                fail(&[b"device ", rel.to_bytes()], &e);
            }
        }
    }
}

/// Mounts under the new root (the working directory), as a container has them
/// (containerd's default spec): /proc, a minimal /dev, /sys read-only, /run.
fn container_mounts(o: &MountOpts) {
    let nse = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    let step = |what: &[u8], r: io::Result<()>| {
        if let Err(e) = r {
            fail(&[what], &e);
        }
    };
    step(b"mkdir /proc", sys::mkdir_exist_ok(c"proc", 0o555));
    step(
        b"mount /proc",
        sys::mount(Some(c"proc"), c"proc", Some(c"proc"), nse, None),
    );
    step(b"mkdir /dev", sys::mkdir_exist_ok(c"dev", 0o755));
    step(
        b"mount /dev",
        sys::mount(
            Some(c"tmpfs"),
            c"dev",
            Some(c"tmpfs"),
            libc::MS_NOSUID | libc::MS_STRICTATIME,
            Some(&o.dev),
        ),
    );
    device(c"dev/null", c"/dev/null", 1, 3);
    device(c"dev/zero", c"/dev/zero", 1, 5);
    device(c"dev/full", c"/dev/full", 1, 7);
    device(c"dev/random", c"/dev/random", 1, 8);
    device(c"dev/urandom", c"/dev/urandom", 1, 9);
    device(c"dev/tty", c"/dev/tty", 5, 0);
    for (target, link) in [
        (c"/proc/self/fd", c"dev/fd"),
        (c"/proc/self/fd/0", c"dev/stdin"),
        (c"/proc/self/fd/1", c"dev/stdout"),
        (c"/proc/self/fd/2", c"dev/stderr"),
        (c"pts/ptmx", c"dev/ptmx"),
    ] {
        step(b"symlink in /dev", sys::symlink(target, link));
    }
    step(b"mkdir /dev/pts", sys::mkdir_exist_ok(c"dev/pts", 0o755));
    // gid 5 (tty) owns the ptys, as in containerd's default spec — when
    // the session's mapping has it.
    step(
        b"mount /dev/pts",
        sys::mount(
            Some(c"devpts"),
            c"dev/pts",
            Some(c"devpts"),
            libc::MS_NOSUID | libc::MS_NOEXEC,
            Some(&o.pts),
        ),
    );
    step(b"mkdir /dev/shm", sys::mkdir_exist_ok(c"dev/shm", 0o1777));
    step(
        b"mount /dev/shm",
        sys::mount(Some(c"shm"), c"dev/shm", Some(c"tmpfs"), nse, Some(&o.shm)),
    );
    step(
        b"mkdir /dev/mqueue",
        sys::mkdir_exist_ok(c"dev/mqueue", 0o755),
    );
    step(
        b"mount /dev/mqueue",
        sys::mount(Some(c"mqueue"), c"dev/mqueue", Some(c"mqueue"), nse, None),
    );
    step(b"mkdir /sys", sys::mkdir_exist_ok(c"sys", 0o555));
    if sys::mount(
        Some(c"sysfs"),
        c"sys",
        Some(c"sysfs"),
        nse | libc::MS_RDONLY,
        None,
    )
    .is_err()
    {
        // sysfs of a network namespace we do not own: bind the host's, read-only.
        step(
            b"bind /sys",
            sys::mount(
                Some(c"/sys"),
                c"sys",
                None,
                libc::MS_BIND | libc::MS_REC,
                None,
            ),
        );
        step(
            b"remount /sys read-only",
            sys::mount(
                None,
                c"sys",
                None,
                libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | nse,
                None,
            ),
        );
    }
    step(b"mkdir /run", sys::mkdir_exist_ok(c"run", 0o755));
    step(
        b"mount /run",
        sys::mount(
            Some(c"tmpfs"),
            c"run",
            Some(c"tmpfs"),
            libc::MS_NOSUID | libc::MS_NODEV,
            Some(&o.run),
        ),
    );
}

/// Covers the daemon's socket directories in the session's mount namespace
/// (workspace mode keeps the daemon's root): an empty read-only tmpfs over
/// each directory, `/dev/null` over a socket whose directory is `/`.
fn hide(what: &[Hide]) {
    let ro = libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    for h in what {
        let (path, r) = match h {
            Hide::Dir(d) => (
                d,
                sys::mount(
                    Some(c"tmpfs"),
                    d,
                    Some(c"tmpfs"),
                    ro,
                    Some(c"mode=755,size=4k"),
                ),
            ),
            Hide::File(f) => (
                f,
                sys::mount(Some(c"/dev/null"), f, None, libc::MS_BIND, None),
            ),
        };
        match r {
            Ok(()) => {}
            // Gone since the daemon listed it: nothing to hide.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => fail(&[b"cover the daemon's socket path ", path.to_bytes()], &e),
        }
    }
}

fn init_main(
    setup: &Setup,
    cmd: Option<&Command>,
    ready_w: RawFd,
    devnull: Option<RawFd>,
    go: Option<RawFd>,
    mount_opts: &MountOpts,
    set: &libc::sigset_t,
) -> ! {
    if !setup.cgroup_procs.is_empty() {
        // Best effort: without CAP_SYS_RESOURCE init stays killable.
        let _ = sys::oom_score_adj(b"-1000");
        if let Err(e) = sys::join_cgroups(&setup.cgroup_procs) {
            fail(&[b"join the session's cgroup"], &e);
        }
    }
    if setup.daemon_owned {
        // Not the spawner's name it was forked with (`ps`, the benchmarks).
        sys::set_name(c"ls-init");
        let mut keep = [setup.mount_fd, ready_w, -1, -1];
        if let Some(n) = devnull {
            keep[2] = n;
        }
        if let Some(g) = go {
            keep[3] = g;
        }
        sys::close_fds_except(&keep);
    }
    if setup.die_with_parent {
        if let Err(e) = sys::die_with_parent() {
            fail(&[b"prctl PR_SET_PDEATHSIG"], &e);
        }
    }
    if let Err(e) = sys::mount(None, c"/", None, libc::MS_REC | libc::MS_PRIVATE, None) {
        fail(&[b"make / private in the session's mount namespace"], &e);
    }
    let mut claimed_name = [0u8; 64];
    let (mount_fd, hostname): (RawFd, &[u8]) = if setup.claim {
        // Made ahead: what does not depend on the session first. It may wait
        // long for its claim: it leaves the copy of the host's mounts its
        // namespace was made with (it would pin whatever was mounted at the
        // clone — another session's overlay — until claimed). Only where
        // its claim needs nothing of the host's tree: in the initial user
        // namespace with CAP_MKNOD, /dev's nodes are made, not bound from
        // the host, and proc and sysfs may be mounted with none visible.
        if sys::in_initial_user_ns() && sys::has_effective_cap(CAP_MKNOD) {
            if let Err(e) = sys::empty_root() {
                fail(&[b"leave the host's mounts (an empty root)"], &e);
            }
        }
        if setup.net_none {
            if let Err(e) = sys::loopback_up() {
                fail(&[b"bring lo up"], &e);
            }
        }
        match sys::recv_fd(setup.mount_fd, &mut claimed_name) {
            // The daemon let it go unused.
            Ok((0, _)) => sys::exit_now(0),
            Ok((n, Some(fd))) => {
                sys::close(setup.mount_fd);
                (fd, &claimed_name[..n])
            }
            Ok((_, None)) => fail(
                &[b"claim a ready init: the message carried no overlay"],
                &io::Error::from_raw_os_error(libc::EPROTO),
            ),
            Err(e) => fail(&[b"claim a ready init"], &e),
        }
    } else {
        (setup.mount_fd, &setup.hostname[..])
    };
    match &setup.placement {
        Placement::Root => {
            if let Err(e) = sys::attach(mount_fd, c"/") {
                fail(&[b"attach the overlay (move_mount)"], &e);
            }
            if let Err(e) = sys::fchdir(mount_fd) {
                fail(&[b"enter the overlay"], &e);
            }
            container_mounts(mount_opts);
            if let Err(e) = sys::pivot_root_here() {
                fail(&[b"pivot_root"], &e);
            }
            if let Err(e) = sys::umount_detach(c".") {
                fail(&[b"detach the old root"], &e);
            }
            if let Err(e) = sys::chdir(c"/") {
                fail(&[b"chdir /"], &e);
            }
        }
        Placement::At(dir) => {
            hide(&setup.hide);
            if let Err(e) = sys::attach(mount_fd, dir) {
                fail(
                    &[b"attach the overlay (move_mount) at ", dir.to_bytes()],
                    &e,
                );
            }
            let nse = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
            if let Err(e) = sys::mount(Some(c"proc"), c"/proc", Some(c"proc"), nse, None) {
                fail(&[b"mount /proc"], &e);
            }
            if let Err(e) = sys::chdir(dir) {
                fail(&[b"chdir ", dir.to_bytes()], &e);
            }
        }
    }
    sys::close(mount_fd);
    if let Err(e) = sys::sethostname(hostname) {
        fail(&[b"sethostname"], &e);
    }
    if setup.net_none && !setup.claim {
        if let Err(e) = sys::loopback_up() {
            fail(&[b"bring lo up"], &e);
        }
    }
    if let Some(go) = go {
        enter_user_namespace(setup, ready_w, go);
    }
    let mut sent = 0;
    while let Some(sock) = setup.holder_sock.filter(|_| sent < setup.ready_line.len()) {
        match sys::send_with_fds(sock, &setup.ready_line[sent..], &[]) {
            Ok(n) => sent += n,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(e) => fail(&[b"report ready to the daemon"], &e),
        }
    }
    if let Some(n) = devnull {
        // Create mode: init outlives the holder; it must not keep the caller's
        // terminal or pipes open, nor share its process group.
        for fd in 0..3 {
            // SAFETY: dup2 onto the standard descriptors; `n` is open.
            unsafe { libc::dup2(n, fd) };
        }
        sys::close(n);
        // SAFETY: setsid has no memory arguments.
        unsafe { libc::setsid() };
    }
    let main = match cmd {
        // SAFETY: the child runs only `exec_command`, child-safe, ending in
        // execve or _exit.
        Some(c) => match unsafe { sys::clone_fork(0) } {
            Ok(0) => {
                sys::close(ready_w);
                if let Some(sock) = setup.holder_sock {
                    sys::close(sock);
                }
                exec_command(c, set)
            }
            Ok(pid) => pid,
            Err(e) => fail(&[b"fork the command"], &e),
        },
        None => 0,
    };
    // Ready: the holder may return (create) or wait (run). A holder that is gone
    // already makes this write fail (and, run mode, PDEATHSIG comes anyway).
    if sys::write_all(ready_w, b"r").is_err() && setup.die_with_parent {
        sys::exit_now(SETUP_FAILED);
    }
    sys::close(ready_w);
    reap_loop(main, set)
}

/// A mapped init's last step of setup ([`Setup::id_map`]): a user namespace
/// and a mount namespace of its own, in which every mount made so far is
/// locked; `u` on the ready pipe, then — once the cloner wrote the mapping
/// and a byte on `go` — root of the new namespace.
fn enter_user_namespace(setup: &Setup, ready_w: RawFd, go: RawFd) {
    if let Err(e) = sys::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS) {
        fail(&[b"unshare the session's user namespace"], &e);
    }
    if let Err(e) = sys::write_all(ready_w, b"u") {
        fail(&[b"ask for the session's uid/gid mapping"], &e);
    }
    let mut b = [0u8; 1];
    match sys::read(go, &mut b) {
        Ok(1) => {}
        Ok(_) => fail(
            &[b"wait for the session's uid/gid mapping"],
            &io::Error::from(io::ErrorKind::UnexpectedEof),
        ),
        Err(e) => fail(&[b"wait for the session's uid/gid mapping"], &e),
    }
    sys::close(go);
    // Root of the new namespace (the host's host_uid:host_gid), with every
    // capability in it and none outside.
    if let Err(e) = sys::set_ids(0, 0) {
        fail(&[b"become root of the session's user namespace"], &e);
    }
    // The change of ids cleared the parent-death signal (prctl(2)).
    if setup.die_with_parent {
        if let Err(e) = sys::die_with_parent() {
            fail(&[b"prctl PR_SET_PDEATHSIG"], &e);
        }
    }
}

/// Init's loop: forward signals to `main`, reap every child; exit with `main`'s
/// status when it ends (create mode, `main` = 0: until SIGKILL, or a SIGTERM
/// from outside the session — one a process of the session sends is
/// ignored, as the kernel ignores its signals to a pid namespace's init
/// without a handler: the session cannot end its own sandbox and have it
/// booked as an infrastructure failure, `init-gone`).
fn reap_loop(main: libc::pid_t, set: &libc::sigset_t) -> ! {
    loop {
        let (sig, from) = sys::sigwait_from(set);
        if sig == libc::SIGCHLD {
            while let Some((pid, x)) = sys::reap_any() {
                if pid == main {
                    sys::exit_now(x.shell_status());
                }
            }
        } else if main > 0 {
            sys::kill(main, sig);
        } else if sig == libc::SIGTERM && from == 0 {
            sys::exit_now(0);
        }
    }
}

/// Drops privileges, enters the working directory and execs the command; never
/// returns (127: not found, 126: found but not executable).
fn exec_command(c: &Command, set: &libc::sigset_t) -> ! {
    // Rust runtimes ignore SIGPIPE; the command gets every default back.
    for s in sys::FORWARDED.iter().chain([libc::SIGPIPE].iter()) {
        sys::set_handler(*s, libc::SIG_DFL);
    }
    sys::sigmask(libc::SIG_UNBLOCK, set);
    if let Some((uid, gid)) = c.ids.or(c.userns.then_some((0, 0))) {
        if let Err(e) = sys::set_ids(uid, gid) {
            fail(&[b"switch to the --user ids"], &e);
        }
    }
    if let Err(e) = sys::chdir(&c.workdir) {
        fail(&[b"chdir ", c.workdir.to_bytes()], &e);
    }
    let mut denied = None;
    for p in &c.candidates {
        let e = sys::execve(p, &c.argv, &c.envp);
        match e.raw_os_error() {
            Some(libc::ENOENT) | Some(libc::ENOTDIR) => {}
            _ => denied = Some(e),
        }
    }
    match denied {
        Some(e) => {
            not_started();
            sys::report(&[&c.name[..]], Some(&e));
            sys::exit_now(126)
        }
        None => {
            not_started();
            sys::report(&[&c.name[..], b": command not found"], None);
            sys::exit_now(127)
        }
    }
}

/// `CAP_MKNOD` (linux/capability.h).
const CAP_MKNOD: u32 = 27;

/// Namespaces every init is cloned into (and `CLONE_NEWNET` for `net_none`).
pub const INIT_FLAGS: libc::c_int =
    libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS;

/// Namespaces `session exec` joins.
pub const JOIN_FLAGS: libc::c_int = libc::CLONE_NEWNS
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWNET;

/// `session exec`: joins the namespaces of the session's init (`pidfd`), takes
/// its root (`root`, an `O_PATH` fd of init's root), and runs `cmd` there as a
/// new process of the session's pid namespace. Returns its exit.
pub fn join_and_run(pidfd: OwnedFd, root: OwnedFd, cmd: &Command) -> io::Result<Exit> {
    let set = sys::init_sigset();
    sys::sigmask(libc::SIG_BLOCK, &set);
    // SAFETY: the child runs only `join_main`, child-safe, ending in _exit.
    let pid = match unsafe { sys::clone_fork(0) } {
        Ok(0) => join_main(pidfd.as_raw_fd(), root.as_raw_fd(), cmd, &set),
        Ok(pid) => pid,
        Err(e) => {
            sys::sigmask(libc::SIG_UNBLOCK, &set);
            return Err(e);
        }
    };
    drop(pidfd);
    drop(root);
    FORWARD_TO.store(pid, Ordering::Relaxed);
    for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
        sys::set_handler(
            s,
            forward as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
    sys::sigmask(libc::SIG_UNBLOCK, &set);
    let x = sys::wait_pid(pid);
    FORWARD_TO.store(0, Ordering::Relaxed);
    x
}

fn join_main(pidfd: RawFd, root: RawFd, cmd: &Command, set: &libc::sigset_t) -> ! {
    // As the daemon's waiter: never ptraceable from the session.
    if let Err(e) = sys::set_dumpable(false) {
        fail(&[b"prctl PR_SET_DUMPABLE"], &e);
    }
    if let Err(e) = sys::setns_pidfd(pidfd, JOIN_FLAGS) {
        fail(&[b"join the session's namespaces (setns)"], &e);
    }
    sys::close(pidfd);
    if let Err(e) = sys::fchdir(root).and_then(|()| sys::chroot_here()) {
        fail(&[b"enter the session's root"], &e);
    }
    sys::close(root);
    // SAFETY: the grandchild runs only `exec_command`.
    let main = match unsafe { sys::clone_fork(0) } {
        Ok(0) => exec_command(cmd, set),
        Ok(pid) => pid,
        Err(e) => fail(&[b"fork the command"], &e),
    };
    loop {
        let sig = sys::sigwait(set);
        if sig == libc::SIGCHLD {
            while let Some((pid, x)) = sys::reap_any() {
                if pid == main {
                    sys::exit_now(x.shell_status());
                }
            }
        } else {
            sys::kill(main, sig);
        }
    }
}

/// The descriptors of a command [`spawn_joined`] starts.
pub struct Stdio {
    /// The command's stdin, stdout and stderr (become its 0, 1, 2).
    pub fds: [RawFd; 3],
    /// Where the waiter writes the command's exit ([`decode_exit`]) before it
    /// exits itself.
    pub status: RawFd,
}

/// Bytes of an exit written to [`Stdio::status`].
pub const EXIT_BYTES: usize = 8;

/// The exit a waiter reported on its status pipe (`kind` 0: code, 1: signal,
/// 2: code of a command that was never started; then the value; both
/// native-endian `i32`).
pub fn decode_exit(b: &[u8; EXIT_BYTES]) -> Exit {
    decode_exit_started(b).0
}

/// [`decode_exit`] and whether the command was started: `false` when it
/// could not be (not found: 127, not executable: 126, its setup — working
/// directory, user — failed: 125; its stderr says why).
pub fn decode_exit_started(b: &[u8; EXIT_BYTES]) -> (Exit, bool) {
    let mut k = [0u8; 4];
    let mut v = [0u8; 4];
    k.copy_from_slice(&b[..4]);
    v.copy_from_slice(&b[4..]);
    let v = i32::from_ne_bytes(v);
    match i32::from_ne_bytes(k) {
        0 => (Exit::Code(v), true),
        2 => (Exit::Code(v), false),
        _ => (Exit::Signal(v), true),
    }
}

/// The daemon's `Exec`: starts `cmd` in the session of init `pidfd` (its
/// namespaces, and its root `root`, an `O_PATH` fd of init's root) without
/// waiting, and returns the pid of the command's *waiter* (a child of the
/// caller, in the caller's pid namespace):
///
/// ```text
/// waiter = clone  stdio on 0/1/2, every other descriptor closed but pidfd,
///   │             root and status; setns(pidfd, JOIN_FLAGS), chroot(root)
///   └─ command = clone  (pid namespace of the session) setpgid(0, 0), --user,
///                       cwd, execve (127 not found, 126 not executable)
/// ```
/// The waiter reaps the command and every orphan it leaves, forwards signals
/// to it, and turns SIGTERM into SIGKILL of the command's whole process group
/// (a timeout: background children in that group die too); when the command
/// ends it writes its exit to `stdio.status` ([`decode_exit`]) and exits with
/// its shell status. The caller reaps the waiter (a pidfd and
/// [`sys::reap_pidfd`]). Unlike [`join_and_run`] it installs no signal
/// handler in the caller, which may be a multi-threaded daemon.
///
/// `cgroup_procs`: the session cgroup's `cgroup.procs` descriptors
/// (at most [`crate::cgroup::MAX_DIRS`]); the command joins them before it
/// execs (the waiter stays in the caller's cgroup).
pub fn spawn_joined(
    pidfd: &OwnedFd,
    root: &OwnedFd,
    cmd: &Command,
    stdio: &Stdio,
    cgroup_procs: &[RawFd],
) -> io::Result<libc::pid_t> {
    spawn_joined_with(pidfd, root, cmd, stdio, cgroup_procs, 0)
}

/// [`spawn_joined`] with `extra` or-ed into the waiter's clone flags: the
/// daemon's process spawner passes `CLONE_PARENT`, so that the waiter is the
/// daemon's child (the daemon reaps it), not the spawner's.
pub fn spawn_joined_with(
    pidfd: &OwnedFd,
    root: &OwnedFd,
    cmd: &Command,
    stdio: &Stdio,
    cgroup_procs: &[RawFd],
    extra: libc::c_int,
) -> io::Result<libc::pid_t> {
    if cgroup_procs.len() > crate::cgroup::MAX_DIRS {
        return Err(io::Error::from_raw_os_error(libc::E2BIG));
    }
    let set = sys::init_sigset();
    // Blocked before the clone, so the waiter loses no signal before it
    // waits; the caller's thread gets its mask back at once.
    let mut old: libc::sigset_t = sys::empty_sigset();
    sys::sigmask_save(&set, &mut old);
    // SAFETY: the child runs only `joined_waiter`, child-safe, ending in _exit.
    let r = unsafe { sys::clone_fork(extra) };
    match r {
        Ok(0) => joined_waiter(
            pidfd.as_raw_fd(),
            root.as_raw_fd(),
            cmd,
            stdio,
            cgroup_procs,
            &set,
        ),
        Ok(pid) => {
            sys::sigmask(libc::SIG_SETMASK, &old);
            Ok(pid)
        }
        Err(e) => {
            sys::sigmask(libc::SIG_SETMASK, &old);
            Err(e)
        }
    }
}

fn joined_waiter(
    pidfd: RawFd,
    root: RawFd,
    cmd: &Command,
    stdio: &Stdio,
    cgroup_procs: &[RawFd],
    set: &libc::sigset_t,
) -> ! {
    sys::set_name(c"ls-waiter");
    // Not dumpable before it joins the session: the session's root must not
    // ptrace the waiter, nor the command before it drops to the session's
    // ids (in a mapped session both are the host's root until then; the
    // command's execve makes it dumpable again).
    if let Err(e) = sys::set_dumpable(false) {
        fail(&[b"prctl PR_SET_DUMPABLE"], &e);
    }
    for (i, &fd) in stdio.fds.iter().enumerate() {
        if let Err(e) = sys::dup2(fd, i as RawFd) {
            fail(&[b"set up the command's stdio"], &e);
        }
    }
    let mut keep = [-1; 3 + crate::cgroup::MAX_DIRS];
    keep[..3].copy_from_slice(&[pidfd, root, stdio.status]);
    keep[3..3 + cgroup_procs.len()].copy_from_slice(cgroup_procs);
    sys::close_fds_except(&keep[..3 + cgroup_procs.len()]);
    // The command inherits this: the OOM killer weighs it as any process,
    // not with the daemon's protection.
    let _ = sys::oom_score_adj(b"0");
    // The namespaces first, as the host's root (the host's user namespace
    // owns all but the mount namespace); then the session's user namespace,
    // in which the waiter has no capability over the others.
    if let Err(e) = sys::setns_pidfd(pidfd, JOIN_FLAGS) {
        fail(&[b"join the session's namespaces (setns)"], &e);
    }
    if cmd.userns {
        if let Err(e) = sys::setns_pidfd(pidfd, libc::CLONE_NEWUSER) {
            fail(&[b"join the session's user namespace (setns)"], &e);
        }
    }
    sys::close(pidfd);
    if let Err(e) = sys::fchdir(root).and_then(|()| sys::chroot_here()) {
        fail(&[b"enter the session's root"], &e);
    }
    sys::close(root);
    // The command writes a byte here when it cannot be started (START_FD).
    let (start_r, start_w) = match sys::pipe() {
        Ok((r, w)) => (r.into_raw_fd(), w.into_raw_fd()),
        Err(e) => fail(&[b"make the command's start pipe"], &e),
    };
    // SAFETY: the grandchild runs only `exec_command`.
    let main = match unsafe { sys::clone_fork(0) } {
        Ok(0) => {
            sys::close(start_r);
            START_FD.store(start_w, Ordering::Relaxed);
            sys::close(stdio.status);
            if let Err(e) = sys::join_cgroups(cgroup_procs) {
                fail(&[b"join the session's cgroup"], &e);
            }
            for &fd in cgroup_procs {
                sys::close(fd);
            }
            sys::setpgid(0, 0);
            exec_command(cmd, set)
        }
        Ok(pid) => pid,
        Err(e) => fail(&[b"fork the command"], &e),
    };
    sys::close(start_w);
    // Both sides set the group: whichever runs first, a kill of the group
    // after this line reaches the command.
    sys::setpgid(main, main);
    loop {
        let sig = sys::sigwait(set);
        if sig == libc::SIGCHLD {
            while let Some((pid, x)) = sys::reap_any() {
                if pid == main {
                    // The command is gone, so is its end of the pipe: one
                    // byte, or end of file (it exec'd).
                    let mut byte = [0u8; 1];
                    let started = !matches!(sys::read(start_r, &mut byte), Ok(1));
                    let (k, v) = match x {
                        Exit::Code(c) if !started => (2i32, c),
                        Exit::Code(c) => (0i32, c),
                        Exit::Signal(n) => (1i32, n),
                    };
                    let mut b = [0u8; EXIT_BYTES];
                    b[..4].copy_from_slice(&k.to_ne_bytes());
                    b[4..].copy_from_slice(&v.to_ne_bytes());
                    let _ = sys::write_all(stdio.status, &b);
                    sys::exit_now(x.shell_status());
                }
            }
        } else if sig == libc::SIGTERM {
            sys::kill(-main, libc::SIGKILL);
        } else {
            sys::kill(main, sig);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn candidates_follow_execvp() {
        let c = candidates(OsStr::new("sh"), OsStr::new("/usr/bin::/bin")).unwrap();
        let c: Vec<&[u8]> = c.iter().map(|s| s.to_bytes()).collect();
        assert_eq!(c, [&b"/usr/bin/sh"[..], b"./sh", b"/bin/sh"]);
        let c = candidates(OsStr::new("./x/y"), OsStr::new("/bin")).unwrap();
        assert_eq!(c[0].to_bytes(), b"./x/y");
        assert_eq!(c.len(), 1);
    }
}
