//! The daemon's process spawner: a small process forked at the very start of
//! the daemon's `main`, before the tokio runtime, any thread or any large
//! allocation, that clones daemon-owned sessions' inits and Exec's waiters on
//! the daemon's behalf (docs/architecture.md "Daemon-owned sessions").
//!
//! Why: `clone` without `CLONE_VM` copies the caller's page tables
//! (`copy_page_range`), which for a daemon with a large heap, many threads and
//! mappings dominated every sandbox's start and every exec (benchmark P7b).
//! A fork of this process copies a few hundred KiB of page tables instead.
//!
//! ```text
//! daemon main()  socketpair(AF_UNIX, SOCK_STREAM), fork  (single-threaded still)
//!   └─ spawner   PR_SET_PDEATHSIG(SIGKILL), every descriptor closed but the
//!                socket and 0/1/2, init's signal set blocked; then one
//!                request at a time:
//!        init    clone(CLONE_PARENT | NEWNS|NEWPID|NEWIPC|NEWUTS[|NEWNET])
//!                  (holder::clone_init): init's parent is the daemon
//!                reply: init's pid, the read end of its ready pipe (and,
//!                with an id map, the write end of its `go` pipe)
//!        exec    clone(CLONE_PARENT) (holder::spawn_joined_with): the waiter's
//!                parent is the daemon; reply: the waiter's pid
//! ```
//!
//! `CLONE_PARENT` makes every init and waiter a child of the daemon, not of
//! the spawner: the daemon reaps them by pidfd (`waitid(P_PIDFD)`) and gets
//! their exact exit, and an init's `PR_SET_PDEATHSIG(SIGKILL)` follows the
//! daemon's thread that forked the spawner — its main thread, which lives as
//! long as the daemon. The spawner dies with the daemon (its own parent-death
//! signal, and end of file on its socket). A spawner that dies while the
//! daemon runs is replaced on the next request that needs it, at most once a
//! second: the daemon runs its own binary again ([`exec`]: a fork of a
//! threaded daemon may not run ordinary code), from a thread that lives as
//! long as the daemon; live inits are not the spawner's children and go on.
//!
//! Wire format, both ways on the stream socket: a request is an 8-byte header
//! (`u32` body length, `u8` kind, `u8` descriptor count, 2 zero bytes; native
//! endian) and the body, with the descriptors (`SCM_RIGHTS`) attached to the
//! header's first byte; a reply is 8 bytes (`i32`: the child's pid, or
//! `-errno`; `u32` descriptor count) with its descriptors attached.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::holder::{self, Command, Hide, Placement, Setup, Stdio};
use crate::sys::{self, CArgs};

/// The command line of the spawner and of the inits and waiters it clones
/// (`/proc/PID/cmdline`): none of the daemon's arguments.
static CMDLINE: &[u8] = b"layerstack-sandbox";

/// The spawner's process name (`/proc/PID/comm`).
pub const SPAWNER_NAME: &std::ffi::CStr = c"ls-spawner";

const KIND_INIT: u8 = 1;
const KIND_EXEC: u8 = 2;
const KIND_READY: u8 = 3;

/// Descriptors one request carries at most: an exec's pidfd, root, stdin,
/// stdout, stderr, status pipe and one `cgroup.procs` per hierarchy.
pub const MAX_FDS: usize = 6 + crate::cgroup::MAX_DIRS;

/// Bytes of a request's header and of a reply.
pub const HEADER_BYTES: usize = 8;

/// The largest request body the spawner accepts, bytes (an exec's argv and
/// environment; Linux refuses more than this to `execve` anyway).
pub const MAX_BODY: usize = 16 << 20;

/// The forked spawner, as the daemon sees it.
pub struct Forked {
    /// The daemon's end of the socket pair (close-on-exec, blocking).
    pub sock: OwnedFd,
    /// The spawner's pid (a child of the daemon: the daemon reaps it).
    pub pid: libc::pid_t,
}

/// Forks the spawner (see the module docs).
///
/// # Safety
/// The calling process must be single-threaded: the child runs ordinary Rust
/// code (it allocates) for the rest of its life.
pub unsafe fn fork() -> io::Result<Forked> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors.
    if unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    } < 0
    {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socketpair returned two new descriptors nothing else owns.
    let (daemon, child) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: getpid has no arguments.
    let daemon_pid = unsafe { libc::getpid() };
    // SAFETY: the caller guarantees a single-threaded process: the child is a
    // full copy and may run any code.
    match unsafe { sys::clone_fork(0) }? {
        0 => {
            drop(daemon);
            serve(child, daemon_pid)
        }
        pid => Ok(Forked { sock: daemon, pid }),
    }
}

/// The first argument with which the daemon's own binary runs as a
/// spawner started by [`exec`] (its socket on descriptor [`EXEC_FD`], the
/// daemon's pid second).
pub const EXEC_FLAG: &str = "--layerstack-internal-spawner";

/// The descriptor an exec'd spawner finds its socket on.
pub const EXEC_FD: RawFd = 3;

/// Starts a spawner by running `exe` — the daemon's own binary
/// (`/proc/self/exe`) — with [`EXEC_FLAG`]: what a daemon with threads does
/// to replace a spawner that died (a fork of a threaded process may not run
/// ordinary code; an exec starts clean). The new spawner serves exactly as a
/// forked one ([`exec_entry`] in the daemon's `main`).
///
/// Its inits' and waiters' parent-death signal follows the calling thread
/// (`CLONE_PARENT` makes the daemon thread that started the spawner their
/// parent): call it from a thread that lives as long as the daemon.
/// Errors: the socket pair, or the exec (`exe` missing).
pub fn exec(exe: &std::path::Path) -> io::Result<Forked> {
    use std::os::unix::process::CommandExt;
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors.
    if unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    } < 0
    {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socketpair returned two new descriptors nothing else owns.
    let (daemon, child) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: getpid has no arguments.
    let daemon_pid = unsafe { libc::getpid() };
    let raw = child.as_raw_fd();
    let mut cmd = std::process::Command::new(exe);
    cmd.arg(EXEC_FLAG)
        .arg(daemon_pid.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null());
    // SAFETY: dup2 and fcntl are async-signal-safe: all the child runs
    // between its fork and its exec.
    unsafe {
        cmd.pre_exec(move || {
            if raw == EXEC_FD {
                // dup2 onto itself keeps close-on-exec: clear it.
                if libc::fcntl(raw, libc::F_SETFD, 0) < 0 {
                    return Err(io::Error::last_os_error());
                }
            } else if libc::dup2(raw, EXEC_FD) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let spawned = cmd.spawn()?;
    let pid = spawned.id() as libc::pid_t;
    // Not waited for here: the daemon reaps it by pidfd.
    drop(spawned);
    drop(child);
    Ok(Forked { sock: daemon, pid })
}

/// In the daemon's `main`, before anything else: when this process was
/// started by [`exec`] (`args` = its arguments after the program name), it
/// serves as the spawner and never returns; otherwise it returns.
pub fn exec_entry(args: &[std::ffi::OsString]) {
    if args.first().and_then(|a| a.to_str()) != Some(EXEC_FLAG) {
        return;
    }
    let daemon_pid = args
        .get(1)
        .and_then(|a| a.to_str())
        .and_then(|a| a.parse::<libc::pid_t>().ok())
        .unwrap_or(0);
    // SAFETY: `exec` left the socket on EXEC_FD, owned by nothing else here.
    serve(unsafe { OwnedFd::from_raw_fd(EXEC_FD) }, daemon_pid)
}

fn serve(sock: OwnedFd, daemon_pid: libc::pid_t) -> ! {
    // The name `ps`, the tests and the benchmarks know it by; its children
    // take their own (holder: `ls-init`, `ls-waiter`).
    sys::set_name(SPAWNER_NAME);
    // Forked from the daemon, it still shows the daemon's arguments (its
    // config, store and socket paths), and so would every init and waiter
    // it clones, to `ps` inside their sandboxes. (It cannot fail but for
    // a /proc/self/stat without the area: then the line stays.)
    let _ = sys::set_cmdline(CMDLINE);
    // Nor the daemon's environment (`/proc/1/environ` of a sandbox: its
    // commands get theirs from the request, by execve).
    let _ = sys::clear_environ();
    if sys::die_with_parent().is_err() {
        sys::exit_now(1);
    }
    // SAFETY: getppid has no arguments.
    if unsafe { libc::getppid() } != daemon_pid {
        // The daemon died before the parent-death signal was armed.
        sys::exit_now(0);
    }
    sys::close_fds_except(&[sock.as_raw_fd()]);
    // A terminal's ^C or systemd's stop signals the daemon's whole process
    // group or cgroup: the daemon shuts down in order, and the spawner goes
    // with it (parent-death signal, end of file), not before it. Children
    // get these back: init and the waiter wait for them blocked (a blocked
    // signal is queued even when ignored), the command's exec sets them to
    // their defaults.
    for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        sys::set_handler(s, libc::SIG_IGN);
    }
    // Inits and waiters are cloned with these blocked (they wait for them
    // with sigwait); the spawner itself waits for no signal.
    sys::sigmask(libc::SIG_BLOCK, &sys::init_sigset());
    let fd = sock.as_raw_fd();
    loop {
        let (kind, body, fds) = match read_request(fd) {
            Ok(Some(r)) => r,
            // The daemon closed its end (it exited): so does the spawner.
            Ok(None) => sys::exit_now(0),
            Err(e) => {
                sys::report(&[b"process spawner: reading a request"], Some(&e));
                sys::exit_now(1)
            }
        };
        let r = match kind {
            KIND_INIT => spawn_init(&body, fds),
            KIND_EXEC => spawn_exec(&body, fds),
            KIND_READY => spawn_ready(&body),
            _ => Err(io::Error::from_raw_os_error(libc::EINVAL)),
        };
        let (code, reply_fds) = match r {
            Ok((pid, fds)) => (pid, fds),
            Err(e) => (-e.raw_os_error().unwrap_or(libc::EIO), Vec::new()),
        };
        let mut b = [0u8; HEADER_BYTES];
        b[..4].copy_from_slice(&code.to_ne_bytes());
        b[4..].copy_from_slice(&(reply_fds.len() as u32).to_ne_bytes());
        let raw: Vec<RawFd> = reply_fds.iter().map(AsRawFd::as_raw_fd).collect();
        if let Err(e) = send_all(fd, &b, &raw) {
            sys::report(&[b"process spawner: answering the daemon"], Some(&e));
            sys::exit_now(1);
        }
    }
}

/// Sends all of `data` on a blocking stream socket, `fds` attached to its
/// first byte.
pub fn send_all(sock: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut sent = 0;
    let mut fds = fds;
    while sent < data.len() {
        match sys::send_with_fds(sock, &data[sent..], fds) {
            Ok(n) => {
                sent += n;
                fds = &[];
            }
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One header (a request's or a reply's) and the descriptors that came with
/// it, from a blocking stream socket: `None` at end of file before its first
/// byte.
fn recv_header(sock: RawFd) -> io::Result<Option<([u8; HEADER_BYTES], Vec<OwnedFd>)>> {
    let mut h = [0u8; HEADER_BYTES];
    let mut got = 0;
    let mut fds = Vec::new();
    while got < HEADER_BYTES {
        match sys::recv_msg(sock, &mut h[got..]) {
            Ok(r) if r.len == 0 => {
                return if got == 0 {
                    Ok(None)
                } else {
                    Err(io::Error::from(io::ErrorKind::UnexpectedEof))
                }
            }
            Ok(r) => {
                got += r.len;
                fds.extend(r.fds);
            }
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Some((h, fds)))
}

/// The spawner's answer to one request: the child's pid (or why it could
/// not clone) and the descriptors that came with it.
pub type Answer = (io::Result<libc::pid_t>, Vec<OwnedFd>);

/// The daemon's side of one exchange on the spawner's (blocking) socket:
/// sends `req`, reads the reply. The inner result is the spawner's answer
/// (the child's pid, or why it could not clone); the outer error means the
/// exchange itself failed (end of file: the spawner is gone; `WouldBlock`:
/// a receive timeout), after which the stream is unusable.
pub fn round_trip(sock: RawFd, req: &Request) -> io::Result<Answer> {
    send_all(sock, &req.bytes, &req.fds)?;
    let (b, fds) = recv_header(sock)?
        .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "it closed its socket"))?;
    let (pid, n) = decode_reply(&b);
    if n != fds.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "a reply announced {n} descriptors and carried {}",
                fds.len()
            ),
        ));
    }
    Ok((pid, fds))
}

/// A request as the spawner reads it: kind, body, descriptors.
type Incoming = (u8, Vec<u8>, Vec<OwnedFd>);

/// One request: `None` at end of file before a header.
fn read_request(sock: RawFd) -> io::Result<Option<Incoming>> {
    let Some((h, fds)) = recv_header(sock)? else {
        return Ok(None);
    };
    let len = u32::from_ne_bytes([h[0], h[1], h[2], h[3]]) as usize;
    if len > MAX_BODY || usize::from(h[5]) != fds.len() {
        return Err(io::Error::from_raw_os_error(libc::EPROTO));
    }
    let mut body = vec![0u8; len];
    let mut got = 0;
    while got < len {
        let n = sys::read(sock, &mut body[got..])?;
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        got += n;
    }
    Ok(Some((h[4], body, fds)))
}

fn decode_init(body: &[u8]) -> io::Result<InitSpec> {
    let mut r = Reader(body);
    let net_none = r.u8()? != 0;
    let placement = match r.u8()? {
        0 => Placement::Root,
        _ => Placement::At(r.cstring()?),
    };
    let hostname = r.bytes()?.to_vec();
    let mut hide = Vec::new();
    for _ in 0..r.u32()? {
        let kind = r.u8()?;
        let p = r.cstring()?;
        hide.push(if kind == 0 {
            Hide::Dir(p)
        } else {
            Hide::File(p)
        });
    }
    let id_map = match r.u8()? {
        0 => None,
        _ => Some(layerstack_types::IdMap {
            host_uid: r.u32()?,
            host_gid: r.u32()?,
            size: r.u32()?,
        }),
    };
    Ok(InitSpec {
        placement,
        net_none,
        hostname,
        hide,
        id_map,
    })
}

fn spawn_init(body: &[u8], fds: Vec<OwnedFd>) -> io::Result<(i32, Vec<OwnedFd>)> {
    let spec = decode_init(body)?;
    let (mount, cgroups) = fds
        .split_first()
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EPROTO))?;
    let setup = Setup {
        placement: spec.placement,
        net_none: spec.net_none,
        hostname: spec.hostname,
        mount_fd: mount.as_raw_fd(),
        holder_sock: None,
        ready_line: Vec::new(),
        die_with_parent: true,
        daemon_owned: true,
        cgroup_procs: cgroups.iter().map(AsRawFd::as_raw_fd).collect(),
        hide: spec.hide,
        id_map: spec.id_map,
        claim: false,
    };
    let (pid, ready, go) = holder::clone_init(&setup, None, libc::CLONE_PARENT)?;
    Ok((pid, [Some(ready), go].into_iter().flatten().collect()))
}

/// A ready init ([`ready_request`]): replies its pid, the read end of its
/// ready pipe and the daemon's end of its claim socket.
fn spawn_ready(body: &[u8]) -> io::Result<(i32, Vec<OwnedFd>)> {
    let mut r = Reader(body);
    let net_none = r.u8()? != 0;
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors.
    if unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    } < 0
    {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socketpair returned two new descriptors nothing else owns.
    let (daemon, child) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let setup = Setup {
        placement: Placement::Root,
        net_none,
        hostname: Vec::new(),
        mount_fd: child.as_raw_fd(),
        holder_sock: None,
        ready_line: Vec::new(),
        die_with_parent: true,
        daemon_owned: true,
        cgroup_procs: Vec::new(),
        hide: Vec::new(),
        id_map: None,
        claim: true,
    };
    let (pid, ready, _) = holder::clone_init(&setup, None, libc::CLONE_PARENT)?;
    drop(child);
    Ok((pid, vec![ready, daemon]))
}

/// The request that clones a *ready init*: the namespaces of a
/// daemon-owned session in root mode (`net_none`: its own network namespace
/// with `lo` up), no cgroup, no uid/gid mapping, made before any session
/// needs it. Its reply carries init's pid, the read end of its ready pipe
/// and a `SOCK_SEQPACKET` socket: [`claim`] it for a session, or close the
/// socket to let it go (it exits 0).
pub fn ready_request(net_none: bool) -> io::Result<Request> {
    let mut w = Writer(Vec::new());
    w.u8(u8::from(net_none));
    request(KIND_READY, w, Vec::new())
}

/// Claims the ready init of `sock` (a [`ready_request`] reply's socket) for
/// a session: sends its `hostname` (at most 64 bytes) with the detached
/// overlay `mount_fd`. Init then sets the session up as any init and writes
/// its ready byte. Errors: the init is gone (`EPIPE`, `ECONNRESET`).
pub fn claim(sock: RawFd, hostname: &[u8], mount_fd: RawFd) -> io::Result<()> {
    if hostname.is_empty() || hostname.len() > 64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a ready init's hostname is 1 to 64 bytes",
        ));
    }
    let n = sys::send_with_fds(sock, hostname, &[mount_fd])?;
    if n != hostname.len() {
        return Err(io::Error::from_raw_os_error(libc::EMSGSIZE));
    }
    Ok(())
}

fn decode_command(body: &[u8]) -> io::Result<Command> {
    let mut r = Reader(body);
    let candidates = r.cstrings()?;
    let argv = CArgs::new(r.list()?)?;
    let envp = CArgs::new(r.list()?)?;
    let name = r.bytes()?.to_vec();
    let ids = match r.u8()? {
        0 => None,
        _ => Some((r.u32()?, r.u32()?)),
    };
    let workdir = r.cstring()?;
    let userns = r.u8()? != 0;
    Ok(Command {
        candidates,
        argv,
        envp,
        name,
        ids,
        workdir,
        userns,
    })
}

fn spawn_exec(body: &[u8], fds: Vec<OwnedFd>) -> io::Result<(i32, Vec<OwnedFd>)> {
    let cmd = decode_command(body)?;
    if fds.len() < 6 {
        return Err(io::Error::from_raw_os_error(libc::EPROTO));
    }
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let stdio = Stdio {
        fds: [raw[2], raw[3], raw[4]],
        status: raw[5],
    };
    let pid = holder::spawn_joined_with(
        &fds[0],
        &fds[1],
        &cmd,
        &stdio,
        &raw[6..],
        libc::CLONE_PARENT,
    )?;
    Ok((pid, Vec::new()))
}

/// A request to the spawner: its bytes (header included) and the descriptors
/// to attach (borrowed: the caller keeps them open until it is sent).
pub struct Request {
    pub bytes: Vec<u8>,
    pub fds: Vec<RawFd>,
}

fn request(kind: u8, w: Writer, fds: Vec<RawFd>) -> io::Result<Request> {
    let body = w.0;
    if body.len() > MAX_BODY {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a spawn request of {} bytes is over {MAX_BODY}", body.len()),
        ));
    }
    if fds.len() > MAX_FDS {
        return Err(io::Error::from_raw_os_error(libc::E2BIG));
    }
    let mut bytes = Vec::with_capacity(HEADER_BYTES + body.len());
    bytes.extend_from_slice(&(body.len() as u32).to_ne_bytes());
    bytes.extend_from_slice(&[kind, fds.len() as u8, 0, 0]);
    bytes.extend_from_slice(&body);
    Ok(Request { bytes, fds })
}

/// A daemon-owned session's init: what the spawner's clone needs besides
/// the descriptors (the detached overlay, the cgroup's `cgroup.procs`).
pub struct InitSpec {
    pub placement: Placement,
    pub net_none: bool,
    pub hostname: Vec<u8>,
    pub hide: Vec<Hide>,
    /// The session's uid/gid mapping ([`Setup::id_map`]).
    pub id_map: Option<layerstack_types::IdMap>,
}

/// The request that clones a daemon-owned session's init with `spec`,
/// attaching `mount_fd` and `cgroup_procs` (init's [`Setup`] has
/// `daemon_owned` and `die_with_parent`). Its reply carries init's pid and
/// the read end of its ready pipe (one byte `r` once set up; end of file
/// without it: setup failed, reap init for its exit status); with
/// `spec.id_map`, also the write end of init's `go` pipe: init writes `u`
/// on its ready pipe first, and the daemon answers with
/// [`holder::map_ids`] (see [`holder::Setup::id_map`]).
pub fn init_request(
    spec: &InitSpec,
    mount_fd: RawFd,
    cgroup_procs: &[RawFd],
) -> io::Result<Request> {
    let mut w = Writer(Vec::new());
    w.u8(u8::from(spec.net_none));
    match &spec.placement {
        Placement::Root => w.u8(0),
        Placement::At(d) => {
            w.u8(1);
            w.bytes(d.as_bytes());
        }
    }
    w.bytes(&spec.hostname);
    w.u32(spec.hide.len() as u32);
    for h in &spec.hide {
        let (k, p) = match h {
            Hide::Dir(p) => (0, p),
            Hide::File(p) => (1, p),
        };
        w.u8(k);
        w.bytes(p.as_bytes());
    }
    match &spec.id_map {
        None => w.u8(0),
        Some(m) => {
            w.u8(1);
            w.u32(m.host_uid);
            w.u32(m.host_gid);
            w.u32(m.size);
        }
    }
    let mut fds = vec![mount_fd];
    fds.extend_from_slice(cgroup_procs);
    request(KIND_INIT, w, fds)
}

/// The request that starts `cmd` in the session of init `pidfd` (its root
/// `root`), as [`holder::spawn_joined`] does; its reply carries the waiter's
/// pid.
pub fn exec_request(
    cmd: &Command,
    pidfd: RawFd,
    root: RawFd,
    stdio: &Stdio,
    cgroup_procs: &[RawFd],
) -> io::Result<Request> {
    let mut w = Writer(Vec::new());
    w.u32(cmd.candidates.len() as u32);
    for c in &cmd.candidates {
        w.bytes(c.as_bytes());
    }
    for a in [&cmd.argv, &cmd.envp] {
        w.u32(a.strings().len() as u32);
        for s in a.strings() {
            w.bytes(s.as_bytes());
        }
    }
    w.bytes(&cmd.name);
    match cmd.ids {
        None => w.u8(0),
        Some((u, g)) => {
            w.u8(1);
            w.u32(u);
            w.u32(g);
        }
    }
    w.bytes(cmd.workdir.as_bytes());
    w.u8(u8::from(cmd.userns));
    let mut fds = vec![
        pidfd,
        root,
        stdio.fds[0],
        stdio.fds[1],
        stdio.fds[2],
        stdio.status,
    ];
    fds.extend_from_slice(cgroup_procs);
    request(KIND_EXEC, w, fds)
}

/// A reply's header decoded: the child's pid, or the error the spawner met,
/// and how many descriptors came with it.
pub fn decode_reply(b: &[u8; HEADER_BYTES]) -> (io::Result<libc::pid_t>, usize) {
    let code = i32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
    let n = u32::from_ne_bytes([b[4], b[5], b[6], b[7]]) as usize;
    if code > 0 {
        (Ok(code), n)
    } else {
        (Err(io::Error::from_raw_os_error(-code)), n)
    }
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_ne_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
    }
}

struct Reader<'a>(&'a [u8]);

fn short() -> io::Error {
    io::Error::from_raw_os_error(libc::EPROTO)
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> io::Result<&[u8]> {
        if self.0.len() < n {
            return Err(short());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> io::Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn bytes(&mut self) -> io::Result<&[u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn cstring(&mut self) -> io::Result<CString> {
        CString::new(self.bytes()?).map_err(|_| short())
    }
    fn list(&mut self) -> io::Result<Vec<Vec<u8>>> {
        let n = self.u32()?;
        let mut v = Vec::new();
        for _ in 0..n {
            v.push(self.bytes()?.to_vec());
        }
        Ok(v)
    }
    fn cstrings(&mut self) -> io::Result<Vec<CString>> {
        let n = self.u32()?;
        let mut v = Vec::new();
        for _ in 0..n {
            v.push(self.cstring()?);
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn strings(a: &CArgs) -> Vec<&[u8]> {
        a.strings().iter().map(|s| s.as_bytes()).collect()
    }

    #[test]
    fn an_exec_request_decodes_to_its_command() {
        let cmd = Command {
            candidates: vec![c"/usr/bin/sh".into(), c"/bin/sh".into()],
            argv: CArgs::new([b"sh".to_vec(), b"-c".to_vec(), vec![b'x'; 100_000]]).unwrap(),
            envp: CArgs::new([b"A=1".to_vec(), b"EMPTY=".to_vec()]).unwrap(),
            name: b"sh".to_vec(),
            ids: Some((1000, 100)),
            workdir: c"/tmp".into(),
            userns: true,
        };
        let stdio = Stdio {
            fds: [10, 11, 12],
            status: 13,
        };
        let req = exec_request(&cmd, 8, 9, &stdio, &[20, 21]).unwrap();
        assert_eq!(req.fds, [8, 9, 10, 11, 12, 13, 20, 21]);
        let len = u32::from_ne_bytes(req.bytes[..4].try_into().unwrap()) as usize;
        assert_eq!(req.bytes.len(), HEADER_BYTES + len);
        assert_eq!(&req.bytes[4..6], &[KIND_EXEC, 8]);
        let back = decode_command(&req.bytes[HEADER_BYTES..]).unwrap();
        assert_eq!(back.candidates, cmd.candidates);
        assert_eq!(strings(&back.argv), strings(&cmd.argv));
        assert_eq!(strings(&back.envp), strings(&cmd.envp));
        assert_eq!(back.name, cmd.name);
        assert_eq!(back.ids, cmd.ids);
        assert_eq!(back.workdir, cmd.workdir);
        assert!(back.userns);
        // A truncated body is refused, not read past.
        let e = decode_command(&req.bytes[HEADER_BYTES..len]).err().unwrap();
        assert_eq!(e.raw_os_error(), Some(libc::EPROTO));
    }

    #[test]
    fn an_init_request_decodes_to_its_spec() {
        let spec = InitSpec {
            placement: Placement::At(c"/work".into()),
            net_none: true,
            hostname: b"box".to_vec(),
            hide: vec![
                Hide::Dir(c"/run/layerstack".into()),
                Hide::File(c"/admin.sock".into()),
            ],
            id_map: Some(layerstack_types::IdMap {
                host_uid: 100000,
                host_gid: 200000,
                size: 65536,
            }),
        };
        let req = init_request(&spec, 7, &[30]).unwrap();
        assert_eq!(req.fds, [7, 30]);
        let back = decode_init(&req.bytes[HEADER_BYTES..]).unwrap();
        assert!(back.net_none);
        assert_eq!(back.hostname, b"box");
        assert_eq!(back.id_map, spec.id_map);
        assert!(matches!(&back.placement, Placement::At(d) if d.as_bytes() == b"/work"));
        assert!(matches!(
            back.hide.as_slice(),
            [Hide::Dir(d), Hide::File(f)] if d.as_bytes() == b"/run/layerstack" && f.as_bytes() == b"/admin.sock"
        ));
        let root = init_request(
            &InitSpec {
                placement: Placement::Root,
                net_none: false,
                hostname: Vec::new(),
                hide: Vec::new(),
                id_map: None,
            },
            7,
            &[],
        )
        .unwrap();
        let back = decode_init(&root.bytes[HEADER_BYTES..]).unwrap();
        assert!(matches!(back.placement, Placement::Root) && !back.net_none);
        assert_eq!(back.id_map, None);
    }

    #[test]
    fn replies_decode() {
        let mut b = [0u8; HEADER_BYTES];
        b[..4].copy_from_slice(&1234i32.to_ne_bytes());
        b[4..].copy_from_slice(&1u32.to_ne_bytes());
        let (pid, n) = decode_reply(&b);
        assert_eq!((pid.unwrap(), n), (1234, 1));
        b[..4].copy_from_slice(&(-libc::EAGAIN).to_ne_bytes());
        b[4..].copy_from_slice(&0u32.to_ne_bytes());
        let (pid, n) = decode_reply(&b);
        assert_eq!(
            (pid.unwrap_err().raw_os_error(), n),
            (Some(libc::EAGAIN), 0)
        );
    }
}
