//! Every kernel call of Mode B, and only those: the new mount API (`fsopen`,
//! `fsconfig`, `fsmount`, `move_mount`), `clone` with namespace flags, `pivot_root`,
//! `mount`/`umount2`, `mknod`, `setns`, pidfds, `SCM_RIGHTS`/`SCM_CREDENTIALS`
//! messages, signals and waiting. Each `unsafe` block names its invariant.
//!
//! Functions marked *child-safe* neither allocate nor take a lock: they may run
//! in a process forked from a multi-threaded one (the holder's init and command
//! processes), where only async-signal-safe calls are allowed (signal-safety(7)).

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

// include/uapi/linux/mount.h
const FSOPEN_CLOEXEC: libc::c_uint = 0x1;
const FSCONFIG_SET_FLAG: libc::c_uint = 0;
const FSCONFIG_SET_STRING: libc::c_uint = 1;
const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
const FSMOUNT_CLOEXEC: libc::c_uint = 0x1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
const FSCONFIG_SET_FD: libc::c_uint = 5;
const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
const MOUNT_ATTR_RDONLY: libc::c_uint = 0x0000_0001;
const MOUNT_ATTR_NOSUID: libc::c_uint = 0x0000_0002;
const MOUNT_ATTR_NODEV: libc::c_uint = 0x0000_0004;
const MOUNT_ATTR_NOEXEC: libc::c_uint = 0x0000_0008;

/// `struct mount_attr` (include/uapi/linux/mount.h, `MOUNT_ATTR_SIZE_VER0`).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// The largest value `fsconfig(FSCONFIG_SET_STRING)` accepts (fs/fsopen.c:
/// `strndup_user(_value, 256)`), terminating NUL included.
pub const FSCONFIG_MAX_VALUE: usize = 255;

fn check(r: libc::c_long) -> io::Result<libc::c_long> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn check_int(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn cstring(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// Why an overlay could not be built, with the step that failed.
#[derive(Debug)]
pub struct OverlayError {
    /// `fsopen`, `fsconfig lowerdir+ <path>`, `fsconfig create`, `fsmount` …
    pub step: String,
    pub source: io::Error,
}

impl std::fmt::Display for OverlayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.step)
    }
}

impl std::error::Error for OverlayError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

fn fsconfig_string(fs: &OwnedFd, key: &CStr, value: &CStr) -> io::Result<()> {
    // SAFETY: `fs` is an open fs context; key and value are NUL-terminated and
    // live across the call; aux is 0 as FSCONFIG_SET_STRING requires.
    check(unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_SET_STRING,
            key.as_ptr(),
            value.as_ptr(),
            0,
        )
    })
    .map(drop)
}

/// `fsopen(fstype, FSOPEN_CLOEXEC)`: a new filesystem context. Child-safe.
fn fsopen(fstype: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: the name is NUL-terminated; FSOPEN_CLOEXEC is a valid flag.
    let fs = check(unsafe { libc::syscall(libc::SYS_fsopen, fstype.as_ptr(), FSOPEN_CLOEXEC) })?;
    // SAFETY: fsopen returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fs as RawFd) })
}

/// `fsconfig(FSCONFIG_CMD_CREATE)`: the context's superblock. Child-safe.
fn fsconfig_create(fs: &OwnedFd) -> io::Result<()> {
    // SAFETY: `fs` is an open fs context; key and value must be NULL for CMD_CREATE.
    check(unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_CMD_CREATE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_void>(),
            0,
        )
    })
    .map(drop)
}

/// `fsmount(fs, FSMOUNT_CLOEXEC, attrs)`: a detached mount of the created
/// superblock. Child-safe.
fn fsmount(fs: &OwnedFd, attrs: libc::c_uint) -> io::Result<OwnedFd> {
    // SAFETY: `fs` holds a created superblock; flags and attributes are valid.
    let m =
        check(unsafe { libc::syscall(libc::SYS_fsmount, fs.as_raw_fd(), FSMOUNT_CLOEXEC, attrs) })?;
    // SAFETY: fsmount returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(m as RawFd) })
}

fn fsconfig_fd(fs: &OwnedFd, key: &CStr, fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: `fs` is an open fs context; the key is NUL-terminated and lives
    // across the call; value NULL and aux the descriptor, as
    // FSCONFIG_SET_FD requires.
    check(unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_SET_FD,
            key.as_ptr(),
            std::ptr::null::<libc::c_char>(),
            fd.as_raw_fd(),
        )
    })
    .map(drop)
}

/// A detached clone of the directory tree at `path` (not recursive), idmapped
/// by user namespace `userns` (`open_tree(OPEN_TREE_CLONE)` then
/// `mount_setattr(MOUNT_ATTR_IDMAP)`; mount_setattr(2)).
pub fn idmapped_tree(path: &CStr, userns: &OwnedFd) -> io::Result<OwnedFd> {
    // SAFETY: the path is NUL-terminated; the flags are valid for open_tree.
    let fd = check(unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            path.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
        )
    })?;
    // SAFETY: open_tree returned a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_IDMAP,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.as_raw_fd() as u64,
    };
    // SAFETY: `fd` is a detached mount; the path is an empty literal with
    // AT_EMPTY_PATH; `attr` lives across the call and its size is passed.
    check(unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            fd.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    })?;
    Ok(fd)
}

fn fsconfig_flag(fs: &OwnedFd, key: &CStr) -> io::Result<()> {
    // SAFETY: `fs` is an open fs context; the key is NUL-terminated and lives
    // across the call; value NULL and aux 0 as FSCONFIG_SET_FLAG requires.
    check(unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_SET_FLAG,
            key.as_ptr(),
            std::ptr::null::<libc::c_char>(),
            0,
        )
    })
    .map(drop)
}

/// A detached overlay mount (`fsmount`): `lowers` newest first, each given as one
/// `lowerdir+` (Linux ≥ 6.8: no page limit on the lower list), `upper` and `work`,
/// with `index=off,redirect_dir=off,metacopy=off` (ARCHITECTURE.md §5), and
/// with `volatile` when asked: the overlay then never syncs its upper — not on
/// `syncfs`, not when it is unmounted (overlayfs.rst, "Volatile mount"; the
/// unmount's sync of the upper filesystem was ~0.6 ms of every Mode B session's
/// end on ext4). A volatile mount leaves `work/incompat/volatile` behind, which
/// refuses a later mount of the same workdir until it is removed. Paths
/// resolve in the caller's mount namespace; the returned fd (close-on-exec) can be
/// attached anywhere with [`attach`], also by another process in another mount
/// namespace that receives it over a unix socket.
///
/// # Errors
/// The step that failed; `fsconfig lowerdir+` failing with `EINVAL` means a kernel
/// older than 6.8.
pub fn overlay_fd(
    lowers: &[PathBuf],
    upper: &Path,
    work: &Path,
    volatile: bool,
) -> Result<OwnedFd, OverlayError> {
    overlay_fd_mapped(lowers, upper, work, volatile, None)
}

/// [`overlay_fd`] whose lowers are idmapped by `userns` (a user namespace
/// with the session's mapping, [`crate::idmap::userns_fd`]): each lower is
/// cloned as a detached mount (`open_tree(OPEN_TREE_CLONE)`), idmapped
/// (`mount_setattr(MOUNT_ATTR_IDMAP)`) and given to overlay by descriptor
/// (`fsconfig(FSCONFIG_SET_FD, "lowerdir+")`, Linux ≥ 6.13). A file a layer
/// stores with uid `u` is then `host_uid + u` to the overlay, so `u` to the
/// session's user namespace. The upper is not idmapped: overlay writes it
/// with the mounter's credentials (its work directory, whiteouts), which
/// an idmapped upper refuses (`EOVERFLOW`); the session's writes land there
/// with host ids, shifted back before capture ([`crate::idmap::shift_back`]).
/// (Documentation/filesystems/overlayfs.rst, "Idmapped layers".)
pub fn overlay_fd_mapped(
    lowers: &[PathBuf],
    upper: &Path,
    work: &Path,
    volatile: bool,
    userns: Option<&OwnedFd>,
) -> Result<OwnedFd, OverlayError> {
    let err = |step: String| move |source| OverlayError { step, source };
    let fs = fsopen(c"overlay").map_err(err("fsopen overlay".into()))?;
    // The idmapped clones live until the superblock is made: closing the
    // last descriptor of a detached mount unmounts it, and overlay clones
    // its layers' mounts at `FSCONFIG_CMD_CREATE`.
    let mut mapped = Vec::new();
    for l in lowers {
        let v = cstring(l).map_err(err(format!("lowerdir {}", l.display())))?;
        match userns {
            None => fsconfig_string(&fs, c"lowerdir+", &v).map_err(err(format!(
                "fsconfig lowerdir+ {} (overlay needs Linux 6.8 or later for lowerdir+)",
                l.display()
            )))?,
            Some(ns) => {
                let m = idmapped_tree(&v, ns)
                    .map_err(err(format!("idmapped mount of lower {}", l.display())))?;
                fsconfig_fd(&fs, c"lowerdir+", &m).map_err(err(format!(
                    "fsconfig lowerdir+ (descriptor) {} (idmapped layers need Linux 6.13 or later)",
                    l.display()
                )))?;
                mapped.push(m);
            }
        }
    }
    for (k, p) in [(c"upperdir", upper), (c"workdir", work)] {
        let v = cstring(p).map_err(err(format!("{} {}", k.to_string_lossy(), p.display())))?;
        fsconfig_string(&fs, k, &v).map_err(err(format!(
            "fsconfig {} {}",
            k.to_string_lossy(),
            p.display()
        )))?;
    }
    for k in [c"index", c"redirect_dir", c"metacopy"] {
        fsconfig_string(&fs, k, c"off")
            .map_err(err(format!("fsconfig {}=off", k.to_string_lossy())))?;
    }
    if volatile {
        fsconfig_flag(&fs, c"volatile").map_err(err("fsconfig volatile".into()))?;
    }
    fsconfig_create(&fs).map_err(err("fsconfig create (overlay superblock)".into()))?;
    drop(mapped);
    // A mapped session's root must not open device nodes of its layers as
    // the host's root would (a layer's 0:0 `c 1 11` is its own through the
    // idmapped lowers): `nodev`.
    let attrs = if userns.is_some() {
        MOUNT_ATTR_NODEV
    } else {
        0
    };
    fsmount(&fs, attrs).map_err(err("fsmount".into()))
}

/// Attaches the detached mount `fd` on `target` in the caller's mount namespace
/// (`move_mount(fd, "", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH)`). Child-safe.
pub fn attach(fd: RawFd, target: &CStr) -> io::Result<()> {
    // SAFETY: both strings are NUL-terminated; `fd` is a mount fd of the caller.
    check(unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            fd,
            c"".as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    })
    .map(drop)
}

/// Leaves the mount tree the caller's namespace was copied with: a new,
/// tiny tmpfs (fsopen/fsmount, 4 KiB, read-only) is attached on `/` and
/// becomes the root (`pivot_root`), the old root is detached, the cwd is
/// `/`. Afterwards the namespace holds no copy of any mount of the host
/// (whatever was mounted there at the clone: another session's overlay a
/// tool mounted for a moment would stay pinned, its upper "still mounted").
/// Needs a private mount namespace. Child-safe.
pub fn empty_root() -> io::Result<()> {
    let fs = fsopen(c"tmpfs")?;
    fsconfig_string(&fs, c"size", c"4k")?;
    fsconfig_create(&fs)?;
    let m = fsmount(
        &fs,
        MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC,
    )?;
    drop(fs);
    attach(m.as_raw_fd(), c"/")?;
    fchdir(m.as_raw_fd())?;
    pivot_root_here()?;
    umount_detach(c".")?;
    chdir(c"/")
}

/// Whether the caller is in the initial user namespace
/// (`/proc/self/ns/user` is `user:[4026531837]`, the kernel's
/// `PROC_USER_INIT_INO`). Child-safe (a stack buffer).
pub fn in_initial_user_ns() -> bool {
    let mut buf = [0u8; 64];
    // SAFETY: NUL-terminated path; the buffer and its length match.
    let n = unsafe {
        libc::readlink(
            c"/proc/self/ns/user".as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    n > 0 && &buf[..n as usize] == b"user:[4026531837]"
}

/// Whether capability `cap` (< 64) is in the caller's effective set
/// (`capget(2)`, version 3). Child-safe.
pub fn has_effective_cap(cap: u32) -> bool {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut h = Header {
        version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
        pid: 0,
    };
    let mut d = [Data {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: header and a two-element data array, as version 3 takes.
    let r = unsafe { libc::syscall(libc::SYS_capget, &mut h as *mut Header, d.as_mut_ptr()) };
    r == 0 && cap < 64 && d[(cap / 32) as usize].effective & (1 << (cap % 32)) != 0
}

/// `mount(2)`. Child-safe.
pub fn mount(
    source: Option<&CStr>,
    target: &CStr,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&CStr>,
) -> io::Result<()> {
    let p = |s: Option<&CStr>| s.map_or(std::ptr::null(), CStr::as_ptr);
    // SAFETY: every pointer is NULL or a NUL-terminated string alive for the call.
    check_int(unsafe {
        libc::mount(
            p(source),
            target.as_ptr(),
            p(fstype),
            flags,
            p(data).cast::<libc::c_void>(),
        )
    })
    .map(drop)
}

/// `umount2(target, MNT_DETACH)`. Child-safe.
pub fn umount_detach(target: &CStr) -> io::Result<()> {
    // SAFETY: NUL-terminated path.
    check_int(unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) }).map(drop)
}

/// `pivot_root(".", ".")`: the working directory becomes the root, the old root
/// is stacked on it (to be detached with [`umount_detach`]`(".")`). Child-safe.
pub fn pivot_root_here() -> io::Result<()> {
    // SAFETY: both arguments are NUL-terminated literals.
    check(unsafe { libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) }).map(drop)
}

/// `mkdir`, an existing entry is fine. Child-safe.
pub fn mkdir_exist_ok(path: &CStr, mode: libc::mode_t) -> io::Result<()> {
    // SAFETY: NUL-terminated path.
    if unsafe { libc::mkdir(path.as_ptr(), mode) } == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EEXIST) {
        Ok(())
    } else {
        Err(e)
    }
}

/// A character device node `path` (`mknod`, then `chmod` past the umask). Child-safe.
pub fn mknod_char(path: &CStr, mode: libc::mode_t, major: u32, minor: u32) -> io::Result<()> {
    let dev = libc::makedev(major, minor);
    // SAFETY: NUL-terminated path; mode and dev are plain values.
    check_int(unsafe { libc::mknod(path.as_ptr(), libc::S_IFCHR | mode, dev) })?;
    // SAFETY: NUL-terminated path.
    check_int(unsafe { libc::chmod(path.as_ptr(), mode) }).map(drop)
}

/// An empty regular file `path` (a bind-mount target). Child-safe.
pub fn touch(path: &CStr) -> io::Result<()> {
    // SAFETY: NUL-terminated path; the returned fd is closed at once.
    let fd = check_int(unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
            0o644 as libc::c_uint,
        )
    })?;
    close(fd);
    Ok(())
}

/// `symlink(target, path)`, an existing entry is fine. Child-safe.
pub fn symlink(target: &CStr, path: &CStr) -> io::Result<()> {
    // SAFETY: both NUL-terminated.
    if unsafe { libc::symlink(target.as_ptr(), path.as_ptr()) } == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EEXIST) {
        Ok(())
    } else {
        Err(e)
    }
}

/// `chdir`. Child-safe.
pub fn chdir(path: &CStr) -> io::Result<()> {
    // SAFETY: NUL-terminated path.
    check_int(unsafe { libc::chdir(path.as_ptr()) }).map(drop)
}

/// `fchdir`. Child-safe.
pub fn fchdir(fd: RawFd) -> io::Result<()> {
    // SAFETY: plain descriptor argument.
    check_int(unsafe { libc::fchdir(fd) }).map(drop)
}

/// `chroot(".")`. Child-safe.
pub fn chroot_here() -> io::Result<()> {
    // SAFETY: NUL-terminated literal.
    check_int(unsafe { libc::chroot(c".".as_ptr()) }).map(drop)
}

/// `close`, errors ignored. Child-safe.
pub fn close(fd: RawFd) {
    // SAFETY: the caller owns `fd` and does not use it afterwards.
    unsafe { libc::close(fd) };
}

/// `sethostname`. Child-safe.
pub fn sethostname(name: &[u8]) -> io::Result<()> {
    // SAFETY: pointer and length describe `name`.
    check_int(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) }).map(drop)
}

/// Brings interface `lo` up in the caller's network namespace. Child-safe.
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: socket() with constant arguments.
    let s = check_int(unsafe {
        libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0)
    })?;
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in ifr.ifr_name.iter_mut().zip(b"lo\0") {
        *d = *s as libc::c_char;
    }
    // SAFETY: `s` is a socket and `ifr` a valid ifreq for SIOCGIFFLAGS.
    let r = unsafe { libc::ioctl(s, libc::SIOCGIFFLAGS, &mut ifr) };
    let r = if r == 0 {
        // SAFETY: the flags member is the active one after SIOCGIFFLAGS.
        unsafe { ifr.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
        // SAFETY: as above, for SIOCSIFFLAGS.
        unsafe { libc::ioctl(s, libc::SIOCSIFFLAGS, &ifr) }
    } else {
        r
    };
    let e = io::Error::last_os_error();
    close(s);
    if r == 0 {
        Ok(())
    } else {
        Err(e)
    }
}

/// `prctl(PR_SET_DUMPABLE, on)`: whether the process may be ptraced (and
/// its `/proc/PID` files read) by processes of its own uid — see
/// ptrace(2), "Ptrace access mode checking". Child-safe.
pub fn set_dumpable(on: bool) -> io::Result<()> {
    // SAFETY: PR_SET_DUMPABLE takes an integer argument.
    check_int(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, libc::c_ulong::from(on), 0, 0, 0) })
        .map(drop)
}

/// `prctl(PR_SET_NAME, name)`: the calling thread's name (`/proc/PID/comm`,
/// what `ps` shows; at most 15 bytes are kept). Child-safe.
pub fn set_name(name: &CStr) {
    // SAFETY: a NUL-terminated string alive for the call; the other
    // arguments are unused by PR_SET_NAME.
    unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr() as libc::c_ulong, 0, 0, 0) };
}

/// The caller's memory area `[start, end)` from fields `first` and
/// `first + 1` of `/proc/self/stat` (proc(5): 48–49 the arguments, 50–51
/// the environment), for rewriting in place. Errors: the file's, or
/// InvalidData when the area is missing.
fn stat_area(first: usize) -> io::Result<&'static mut [u8]> {
    let bad = || {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("/proc/self/stat: no area in fields {first}-{}", first + 1),
        )
    };
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // Fields after the `(comm)`: the 3rd of proc(5) first.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .ok_or_else(bad)?
        .1
        .split_whitespace()
        .collect();
    let at = |n: usize| -> io::Result<usize> {
        fields
            .get(n - 3)
            .and_then(|f| f.parse().ok())
            .ok_or_else(bad)
    };
    let (start, end) = (at(first)?, at(first + 1)?);
    if start == 0 || end <= start {
        return Err(bad());
    }
    // SAFETY: [start, end) is an area of this process's own stack top
    // (its arguments or environment strings), mapped and writable; the
    // callers are single-threaded and hold no Rust reference into it.
    Ok(unsafe { std::slice::from_raw_parts_mut(start as *mut u8, end - start) })
}

/// Rewrites the caller's command line (`/proc/PID/cmdline`, what `ps`
/// shows) to `line` in place, as setproctitle(3) does: `line` and a NUL at
/// the start of the argument area (`arg_start`..`arg_end` of
/// `/proc/self/stat`, proc(5)), the rest of it spaces — the area's last
/// byte is then no NUL, and the kernel reads the line up to its first NUL
/// (`get_mm_proctitle`, fs/proc/base.c). A line longer than the area is cut.
/// `prctl(PR_SET_MM_ARG_START)` would need CAP_SYS_RESOURCE, which
/// containers often drop. Call it single-threaded, before anything reads
/// the process's arguments again (`std::env::args` reads that area).
pub fn set_cmdline(line: &[u8]) -> io::Result<()> {
    let area = stat_area(48)?;
    let n = line.len().min(area.len() - 1);
    area[..n].copy_from_slice(&line[..n]);
    area[n] = 0;
    area[n + 1..].fill(b' ');
    Ok(())
}

/// Empties the caller's environment: `clearenv(3)`, then its environment
/// strings (`env_start`..`env_end` of `/proc/self/stat`, what
/// `/proc/PID/environ` reads) overwritten with NULs — a fork of the daemon
/// shows the daemon's environment there until it execs. Call it
/// single-threaded; nothing may read the environment afterwards but
/// expect it empty.
pub fn clear_environ() -> io::Result<()> {
    // SAFETY: single-threaded (the caller's contract): nothing else reads
    // `environ` meanwhile.
    if unsafe { libc::clearenv() } != 0 {
        return Err(io::Error::last_os_error());
    }
    stat_area(50)?.fill(0);
    Ok(())
}

/// `prctl(PR_SET_PDEATHSIG, SIGKILL)`: the caller dies with its parent. Child-safe.
pub fn die_with_parent() -> io::Result<()> {
    // SAFETY: PR_SET_PDEATHSIG takes a signal number.
    check_int(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) })
        .map(drop)
}

/// `unshare(flags)`: new namespaces for the caller (unshare(2)). Child-safe.
pub fn unshare(flags: libc::c_int) -> io::Result<()> {
    // SAFETY: unshare takes plain flags.
    check_int(unsafe { libc::unshare(flags) }).map(drop)
}

/// Drops supplementary groups and switches to `gid` then `uid`. Child-safe.
pub fn set_ids(uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: an empty group list.
    check_int(unsafe { libc::setgroups(0, std::ptr::null()) })?;
    // SAFETY: plain ids.
    check_int(unsafe { libc::setgid(gid) })?;
    // SAFETY: plain id.
    check_int(unsafe { libc::setuid(uid) }).map(drop)
}

/// Fork-like `clone` with namespace `flags` (`CLONE_NEWNS`, `CLONE_NEWPID`, …):
/// returns 0 in the child, the child's pid in the parent. With `CLONE_NEWPID` the
/// child is pid 1 of the new pid namespace.
///
/// # Safety
/// The child must only make child-safe calls (no allocation, no locks) until it
/// execs or exits with [`exit_now`]: it is a copy of one thread of a process that
/// may have others.
pub unsafe fn clone_fork(flags: libc::c_int) -> io::Result<libc::pid_t> {
    // SAFETY: a NULL stack makes clone behave like fork (the child continues on a
    // copy of the caller's stack); the caller upholds the child's restrictions.
    let r = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (flags | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    check(r).map(|p| p as libc::pid_t)
}

/// `_exit(code)`: no destructors, no atexit handlers. Child-safe.
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit never returns and touches no user-space state.
    unsafe { libc::_exit(code) }
}

/// `execve(path, argv, envp)`; returns only on failure. Child-safe.
///
/// `argv` and `envp` are NULL-terminated arrays of pointers to NUL-terminated
/// strings that outlive the call (see [`CArgs`]).
pub fn execve(path: &CStr, argv: &CArgs, envp: &CArgs) -> io::Error {
    // SAFETY: CArgs guarantees NULL-terminated arrays of valid C strings.
    unsafe { libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
    io::Error::last_os_error()
}

/// A NULL-terminated `char *[]` over owned C strings (argv, envp), built before
/// a fork so the child needs no allocation.
pub struct CArgs {
    _strings: Vec<CString>,
    ptrs: Vec<*const libc::c_char>,
}

// SAFETY: the pointers point into `_strings`, owned by the struct and never
// mutated; sharing them between threads is like sharing `&[CString]`.
unsafe impl Send for CArgs {}
// SAFETY: as above.
unsafe impl Sync for CArgs {}

impl CArgs {
    /// The array over `strings`. Errors: a string contains a NUL byte.
    pub fn new<I: IntoIterator<Item = Vec<u8>>>(strings: I) -> io::Result<CArgs> {
        let strings: Vec<CString> = strings
            .into_iter()
            .map(|s| {
                CString::new(s).map_err(|_| {
                    io::Error::new(io::ErrorKind::InvalidInput, "argument contains a NUL byte")
                })
            })
            .collect::<Result<_, _>>()?;
        let mut ptrs: Vec<*const libc::c_char> = strings.iter().map(|s| s.as_ptr()).collect();
        ptrs.push(std::ptr::null());
        Ok(CArgs {
            _strings: strings,
            ptrs,
        })
    }

    /// The strings, in order.
    pub fn strings(&self) -> &[CString] {
        &self._strings
    }

    fn as_ptr(&self) -> *const *const libc::c_char {
        self.ptrs.as_ptr()
    }
}

/// How a waited-for process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

impl Exit {
    /// A shell's `$?`: the exit code, or 128 + the signal number.
    pub fn shell_status(self) -> i32 {
        match self {
            Exit::Code(c) => c,
            Exit::Signal(s) => 128 + s,
        }
    }

    fn from_raw(st: libc::c_int) -> Option<Exit> {
        if libc::WIFEXITED(st) {
            Some(Exit::Code(libc::WEXITSTATUS(st)))
        } else if libc::WIFSIGNALED(st) {
            Some(Exit::Signal(libc::WTERMSIG(st)))
        } else {
            None
        }
    }
}

/// Waits for child `pid` to end (retrying on `EINTR`). Child-safe.
pub fn wait_pid(pid: libc::pid_t) -> io::Result<Exit> {
    loop {
        let mut st: libc::c_int = 0;
        // SAFETY: `st` is a valid out-pointer.
        let r = unsafe { libc::waitpid(pid, &mut st, 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        if let Some(x) = Exit::from_raw(st) {
            return Ok(x);
        }
    }
}

/// Reaps one ended child without blocking: `Some((pid, exit))`, or `None` when
/// no child has ended (or there is none). Child-safe.
pub fn reap_any() -> Option<(libc::pid_t, Exit)> {
    loop {
        let mut st: libc::c_int = 0;
        // SAFETY: `st` is a valid out-pointer.
        let r = unsafe { libc::waitpid(-1, &mut st, libc::WNOHANG) };
        if r <= 0 {
            return None;
        }
        if let Some(x) = Exit::from_raw(st) {
            return Some((r, x));
        }
    }
}

/// Signals the holder's init forwards to the command.
pub const FORWARDED: [libc::c_int; 8] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGWINCH,
    libc::SIGCONT,
];

/// A signal set of `SIGCHLD` and [`FORWARDED`].
pub fn init_sigset() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initializes it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t.
    unsafe { libc::sigemptyset(&mut set) };
    for s in FORWARDED.iter().chain([libc::SIGCHLD].iter()) {
        // SAFETY: `set` is initialized; `s` is a valid signal number.
        unsafe { libc::sigaddset(&mut set, *s) };
    }
    set
}

/// Blocks (`how` = `SIG_BLOCK`) or unblocks (`SIG_UNBLOCK`) `set`. Child-safe.
pub fn sigmask(how: libc::c_int, set: &libc::sigset_t) {
    // SAFETY: `set` is initialized; the old mask is not wanted.
    unsafe { libc::sigprocmask(how, set, std::ptr::null_mut()) };
}

/// An empty signal set.
pub fn empty_sigset() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initializes it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t.
    unsafe { libc::sigemptyset(&mut set) };
    set
}

/// Blocks `set` in the calling thread and saves its previous mask in `old`
/// (restore it with `sigmask(SIG_SETMASK, old)`).
pub fn sigmask_save(set: &libc::sigset_t, old: &mut libc::sigset_t) {
    // SAFETY: both sets are initialized, valid pointers.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, set, old) };
}

/// Waits for one signal of the blocked `set`. Child-safe.
pub fn sigwait(set: &libc::sigset_t) -> libc::c_int {
    loop {
        // SAFETY: `set` is initialized; no siginfo is wanted.
        let r = unsafe { libc::sigwaitinfo(set, std::ptr::null_mut()) };
        if r > 0 {
            return r;
        }
    }
}

/// [`sigwait`], with the sender: `(signal, si_pid)` — the sender's pid as
/// the caller's pid namespace sees it, 0 for a sender outside it (an
/// ancestor namespace: the daemon, the host) or for the kernel
/// (sigwaitinfo(2), pid_namespaces(7)). Child-safe.
pub fn sigwait_from(set: &libc::sigset_t) -> (libc::c_int, libc::pid_t) {
    loop {
        // SAFETY: zeroed siginfo_t is valid; `set` is initialized.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is writable for the call.
        let r = unsafe { libc::sigwaitinfo(set, &mut info) };
        if r > 0 {
            // SAFETY: si_pid is set for the signals init waits for (kill,
            // sigqueue, SIGCHLD); 0 otherwise, which reads as "outside".
            return (r, unsafe { info.si_pid() });
        }
    }
}

/// `kill(pid, sig)`, errors ignored. Child-safe.
pub fn kill(pid: libc::pid_t, sig: libc::c_int) {
    // SAFETY: plain arguments.
    unsafe { libc::kill(pid, sig) };
}

/// Sets `sig`'s disposition to `handler` (a plain `extern "C" fn(c_int)`),
/// `SIG_IGN` or `SIG_DFL`, with `SA_RESTART`.
pub fn set_handler(sig: libc::c_int, handler: libc::sighandler_t) {
    // SAFETY: sigaction is plain data; zeroed then filled.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = handler;
    sa.sa_flags = libc::SA_RESTART;
    // SAFETY: `sa` is fully initialized; the old action is not wanted.
    unsafe { libc::sigaction(sig, &sa, std::ptr::null_mut()) };
}

/// A pipe, both ends close-on-exec: `(read, write)`.
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors.
    check_int(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: pipe2 returned two new descriptors that nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// `write` all of `buf` (retrying on `EINTR`). Child-safe.
pub fn write_all(fd: RawFd, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: pointer and length describe `buf`.
        let r = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        buf = &buf[r as usize..];
    }
    Ok(())
}

/// `read` into `buf` (retrying on `EINTR`); 0 at end of file. Child-safe.
pub fn read(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        // SAFETY: pointer and length describe `buf`.
        let r = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// Writes `layerstack: <what>: <errno text>\n` to stderr without allocating.
/// Child-safe.
pub fn report(what: &[&[u8]], err: Option<&io::Error>) {
    let mut buf = [0u8; 512];
    let mut n = 0;
    let mut push = |b: &[u8]| {
        let k = b.len().min(buf.len() - n);
        buf[n..n + k].copy_from_slice(&b[..k]);
        n += k;
    };
    push(b"layerstack: ");
    for w in what {
        push(w);
    }
    if let Some(e) = err {
        push(b": ");
        let code = e.raw_os_error().unwrap_or(0);
        // SAFETY: strerror returns a pointer to a static (or thread-local) string
        // for any errno value; it is read before any other call could change it.
        let s = unsafe { CStr::from_ptr(libc::strerror(code)) };
        push(s.to_bytes());
    }
    push(b"\n");
    let _ = write_all(2, &buf[..n]);
}

/// Sends `data` on a stream socket with `fds` (at most 16) attached
/// (`SCM_RIGHTS`); returns the bytes sent (it may be less than `data`: send
/// the rest without fds).
pub fn send_with_fds(sock: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // Room for up to 16 descriptors, aligned for cmsghdr.
    let mut cbuf = [0u64; 16];
    // SAFETY: msghdr is plain data; zeroed then filled below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        assert!(fds.len() <= 16, "at most 16 descriptors per message");
        let len = std::mem::size_of_val(fds) as u32;
        // SAFETY: CMSG_SPACE is arithmetic.
        let space = unsafe { libc::CMSG_SPACE(len) } as usize;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: msg_control points at `cbuf`, large enough for one cmsghdr with
        // `len` bytes of data (space ≤ 16 * 8); CMSG_FIRSTHDR is then non-NULL.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(len) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(c).cast::<RawFd>(),
                fds.len(),
            );
        }
    }
    // SAFETY: `msg` describes live buffers; MSG_NOSIGNAL avoids SIGPIPE.
    let r = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// What [`recv_msg`] received.
#[derive(Debug, Default)]
pub struct Received {
    /// Bytes read into the buffer (0: end of file).
    pub len: usize,
    /// Descriptors passed with them (close-on-exec).
    pub fds: Vec<OwnedFd>,
    /// The sender's pid, in the receiver's pid namespace (`SCM_CREDENTIALS`,
    /// when the socket has `SO_PASSCRED`).
    pub pid: Option<i32>,
}

/// `recvmsg` on a stream socket into `buf`, collecting passed descriptors and
/// credentials. Non-blocking sockets return `WouldBlock` as usual.
pub fn recv_msg(sock: RawFd, buf: &mut [u8]) -> io::Result<Received> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 32];
    // SAFETY: msghdr is plain data; zeroed then filled.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: `msg` describes live buffers.
    let r = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Received {
        len: r as usize,
        ..Default::default()
    };
    // SAFETY: the kernel filled msg_control with msg_controllen bytes of
    // well-formed cmsghdrs; CMSG_* walk within them.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            let data = libc::CMSG_DATA(c);
            let len = (*c).cmsg_len - (data as usize - c as usize);
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let n = len / std::mem::size_of::<RawFd>();
                for i in 0..n {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    out.fds.push(OwnedFd::from_raw_fd(fd));
                }
            } else if (*c).cmsg_level == libc::SOL_SOCKET
                && (*c).cmsg_type == libc::SCM_CREDENTIALS
                && len >= std::mem::size_of::<libc::ucred>()
            {
                let cred = std::ptr::read_unaligned(data.cast::<libc::ucred>());
                if cred.pid > 0 {
                    out.pid = Some(cred.pid);
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(out)
}

/// `recvmsg` of one message into `buf` with at most one descriptor attached
/// (`SCM_RIGHTS`, close-on-exec): the bytes read (0: end of file) and the
/// descriptor, if one came. Blocking; retries on `EINTR`. Child-safe: no
/// allocation (a descriptor beyond the first is closed).
pub fn recv_fd(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<RawFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 8];
    loop {
        // SAFETY: msghdr is plain data; zeroed then filled.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&cbuf);
        // SAFETY: `msg` describes live buffers.
        let r = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        let mut got = None;
        // SAFETY: the kernel filled msg_control with msg_controllen bytes of
        // well-formed cmsghdrs; CMSG_* walk within them.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                let data = libc::CMSG_DATA(c);
                let len = (*c).cmsg_len - (data as usize - c as usize);
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    for i in 0..len / std::mem::size_of::<RawFd>() {
                        let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                        if got.is_none() {
                            got = Some(fd);
                        } else {
                            close(fd);
                        }
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        return Ok((r as usize, got));
    }
}

/// `SO_PASSCRED` on: messages carry the sender's credentials (see [`Received::pid`]);
/// on a sender's socket, its messages always carry them.
pub fn set_passcred(sock: RawFd) -> io::Result<()> {
    let one: libc::c_int = 1;
    // SAFETY: the option value is a c_int of the given size.
    check_int(unsafe {
        libc::setsockopt(
            sock,
            libc::SOL_SOCKET,
            libc::SO_PASSCRED,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// `SO_RCVTIMEO` and `SO_SNDTIMEO` of `sock`: a blocking receive or send
/// that waits longer fails with `WouldBlock` (`EAGAIN`).
pub fn set_timeouts(sock: RawFd, t: std::time::Duration) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: t.as_secs() as libc::time_t,
        tv_usec: libc::suseconds_t::from(t.subsec_micros() as i32),
    };
    for opt in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        // SAFETY: the option value is a timeval of the given size.
        check_int(unsafe {
            libc::setsockopt(
                sock,
                libc::SOL_SOCKET,
                opt,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        })?;
    }
    Ok(())
}

/// The peer of a connected unix socket at connect time: `(pid, uid)`, the pid in
/// the caller's pid namespace.
pub fn peer_cred(sock: RawFd) -> io::Result<(i32, u32)> {
    // SAFETY: ucred is plain data.
    let mut c: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `c` and `len` describe a ucred-sized out-buffer.
    check_int(unsafe {
        libc::getsockopt(
            sock,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut c as *mut libc::ucred).cast(),
            &mut len,
        )
    })?;
    Ok((c.pid, c.uid))
}

/// A pidfd for process `pid` (Linux ≥ 5.3).
pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: plain arguments.
    let fd = check(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) })?;
    // SAFETY: pidfd_open returned a new descriptor (close-on-exec) nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Sends `sig` to the process of `pidfd` (never to a recycled pid).
pub fn pidfd_kill(pidfd: &OwnedFd, sig: libc::c_int) -> io::Result<()> {
    // SAFETY: a pidfd, a signal number, no siginfo, no flags.
    check(unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    })
    .map(drop)
}

/// The name of the kernel-interface filesystem `fd` is on (procfs, sysfs,
/// devpts, cgroup, mqueue, securityfs, debugfs, tracefs, bpf, …:
/// include/uapi/linux/magic.h), or `None` for a filesystem of files
/// (overlay, tmpfs, ext4, …). What a file RPC beneath a session's root must
/// not serve: the daemon would read the kernel's state as host root.
pub fn kernel_fs(fd: &impl AsRawFd) -> io::Result<Option<&'static str>> {
    const KERNEL: [(u64, &str); 18] = [
        (0x9fa0, "proc"),
        (0x6265_6572, "sysfs"),
        (0x1cd1, "devpts"),
        (0x0027_e0eb, "cgroup"),
        (0x6367_7270, "cgroup2"),
        (0x1980_0202, "mqueue"),
        (0x7363_6673, "securityfs"),
        (0x6462_6720, "debugfs"),
        (0x7472_6163, "tracefs"),
        (0xcafe_4a11, "bpf"),
        (0xf97c_ff8c, "selinuxfs"),
        (0x4341_5d53, "smackfs"),
        (0xde5e_81e4, "efivarfs"),
        (0x6165_676c, "pstore"),
        (0x6265_6570, "configfs"),
        (0x6e73_6673, "nsfs"),
        (0x4249_4e4d, "binfmt_misc"),
        (0x6573_5543, "fusectl"),
    ];
    // SAFETY: statfs is plain data; fstatfs fills it for a valid descriptor.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is an open descriptor and `st` a valid statfs to fill.
    check_int(unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) })?;
    #[allow(clippy::unnecessary_cast)]
    let t = (st.f_type as u64) & 0xffff_ffff;
    Ok(KERNEL.iter().find(|(m, _)| *m == t).map(|(_, n)| *n))
}

/// Whether the process of `pidfd` has ended (the pidfd polls readable).
pub fn pidfd_exited(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    r > 0
}

/// Joins the namespaces `flags` of the process of `pidfd` (Linux ≥ 5.8). The
/// caller must be single-threaded (`CLONE_NEWNS`). Child-safe.
pub fn setns_pidfd(pidfd: RawFd, flags: libc::c_int) -> io::Result<()> {
    // SAFETY: plain arguments.
    check_int(unsafe { libc::setns(pidfd, flags) }).map(drop)
}

/// `open(path, O_PATH | O_DIRECTORY | O_CLOEXEC)`.
pub fn open_dir_path(path: &Path) -> io::Result<OwnedFd> {
    let c = cstring(path)?;
    // SAFETY: NUL-terminated path.
    let fd = check_int(unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    })?;
    // SAFETY: open returned a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Clears `FD_CLOEXEC` on `fd` (so a child keeps it across exec) or sets it.
pub fn set_cloexec(fd: RawFd, on: bool) -> io::Result<()> {
    // SAFETY: plain arguments.
    let flags = check_int(unsafe { libc::fcntl(fd, libc::F_GETFD) })?;
    let flags = if on {
        flags | libc::FD_CLOEXEC
    } else {
        flags & !libc::FD_CLOEXEC
    };
    // SAFETY: plain arguments.
    check_int(unsafe { libc::fcntl(fd, libc::F_SETFD, flags) }).map(drop)
}

/// The caller's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// Opens `path` beneath the directory `root` as if `root` were `/`:
/// `openat2(root, path, flags | O_CLOEXEC, mode)` with `RESOLVE_IN_ROOT |
/// RESOLVE_NO_MAGICLINKS` (Linux ≥ 5.6). Absolute paths, absolute symlink
/// targets and `..` resolve inside `root` (a `..` at `root` stays there), and
/// `/proc/<pid>/fd`-style magic links are refused (`ELOOP`): whatever the
/// tree under `root` holds, the result is beneath `root`. Used by the daemon
/// for a session's files, with `root` = the session's root; the last
/// component is followed unless `flags` has `O_NOFOLLOW`.
pub fn openat2_in_root(
    root: &impl AsRawFd,
    path: &CStr,
    flags: libc::c_int,
    mode: libc::mode_t,
) -> io::Result<OwnedFd> {
    // SAFETY: open_how is plain data; all-zero is a valid value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.mode = if flags & (libc::O_CREAT | libc::O_TMPFILE) != 0 {
        u64::from(mode)
    } else {
        0
    };
    how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
    loop {
        // SAFETY: `path` is NUL-terminated, `how` is a valid open_how of the
        // size passed; the result is a new descriptor nothing else owns.
        let r = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                root.as_raw_fd(),
                path.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        match check(r) {
            Ok(fd) => {
                // SAFETY: openat2 returned a new descriptor nothing else owns.
                return Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) });
            }
            // RESOLVE_IN_ROOT answers EAGAIN when a rename raced the lookup.
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {}
            Err(e) => return Err(e),
        }
    }
}

/// Closes every descriptor from 3 up except those in `keep` (at most 8, any
/// order) with `close_range(2)` (Linux ≥ 5.9). Child-safe (no allocation: the
/// list is sorted in a fixed array). For a process cloned from the daemon that
/// does not exec at once (a session's init, an exec's waiter): it must not
/// keep the daemon's sockets, store files or other sessions' mounts open.
pub fn close_fds_except(keep: &[RawFd]) {
    let mut k = [RawFd::MAX; 8];
    let n = keep.len().min(8);
    k[..n].copy_from_slice(&keep[..n]);
    k[..n].sort_unstable();
    let mut from: libc::c_uint = 3;
    for &fd in &k[..n] {
        if fd < 3 {
            continue;
        }
        let fd = fd as libc::c_uint;
        if fd > from {
            // SAFETY: closes descriptors only; nothing in this process uses them.
            unsafe { libc::syscall(libc::SYS_close_range, from, fd - 1, 0) };
        }
        from = fd.saturating_add(1);
    }
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_close_range, from, libc::c_uint::MAX, 0) };
}

/// Moves the calling process into the cgroups whose `cgroup.procs` are open
/// as `fds` (writes "0", the writer, to each). Child-safe: a session's init
/// and an exec'd command call it first thing after their clone.
pub fn join_cgroups(fds: &[RawFd]) -> io::Result<()> {
    for &fd in fds {
        write_all(fd, b"0")?;
    }
    Ok(())
}

/// Sets the calling process's `/proc/self/oom_score_adj` to `value` (ASCII,
/// -1000..=1000; lowering needs CAP_SYS_RESOURCE). Child-safe. A session's
/// init takes -1000 (never the OOM victim): it is a fork of the daemon's
/// process spawner (a fork of the daemon's start), its resident set counts
/// pages it shares with it, so a memory-limited session's OOM kill could
/// otherwise pick init (and end the session) before the command that
/// allocates. An exec's waiter takes 0: the command must not
/// inherit the daemon's protection (the systemd unit's OOMScoreAdjust=-999).
pub fn oom_score_adj(value: &[u8]) -> io::Result<()> {
    // SAFETY: a constant C string; the descriptor is closed below.
    let fd = unsafe {
        libc::open(
            c"/proc/self/oom_score_adj".as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        )
    };
    let fd = check_int(fd)?;
    let r = write_all(fd, value);
    close(fd);
    r
}

/// Reaps the ended child of `pidfd` without blocking (`waitid(P_PIDFD,
/// WEXITED | WNOHANG)`, Linux ≥ 5.4): `Some(exit)` once it ended, `None`
/// while it runs. Errors: `ECHILD` when it is not this process's child or was
/// reaped already.
pub fn reap_pidfd(pidfd: &impl AsRawFd) -> io::Result<Option<Exit>> {
    loop {
        // SAFETY: siginfo_t is plain data; zeroed is valid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is a valid out-pointer; P_PIDFD takes the fd as id.
        let r = unsafe {
            libc::waitid(
                libc::P_PIDFD,
                pidfd.as_raw_fd() as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        // SAFETY: waitid filled `info` (si_pid 0: no child has changed state).
        let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
        if pid == 0 {
            return Ok(None);
        }
        return Ok(Some(if info.si_code == libc::CLD_EXITED {
            Exit::Code(status)
        } else {
            Exit::Signal(status)
        }));
    }
}

/// `setpgid(pid, pgid)`. Child-safe.
pub fn setpgid(pid: libc::pid_t, pgid: libc::pid_t) {
    // SAFETY: plain arguments; a failure (the child exec'd already) is harmless.
    unsafe { libc::setpgid(pid, pgid) };
}

/// `dup2(from, to)` (retrying on `EINTR`). Child-safe.
pub fn dup2(from: RawFd, to: RawFd) -> io::Result<()> {
    loop {
        // SAFETY: plain descriptors.
        let r = unsafe { libc::dup2(from, to) };
        if r >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// Writes `map` as the uid and gid mapping of the new user namespace of
/// child `pid` (`/proc/PID/uid_map`, `/proc/PID/gid_map`: `0 HOST SIZE`;
/// user_namespaces(7), "User and group ID mappings"). The caller is root of
/// the parent user namespace; the mapping is written once.
pub fn write_id_map(pid: libc::pid_t, map: &layerstack_types::IdMap) -> io::Result<()> {
    std::fs::write(
        format!("/proc/{pid}/uid_map"),
        format!("0 {} {}\n", map.host_uid, map.size),
    )?;
    std::fs::write(
        format!("/proc/{pid}/gid_map"),
        format!("0 {} {}\n", map.host_gid, map.size),
    )
}

/// A descriptor of a user namespace with `map` (`/proc/PID/ns/user` of a
/// short-lived child cloned with `CLONE_NEWUSER`, mapped, then ended): what
/// [`overlay_fd_mapped`] idmaps a session's lowers with. The namespace lives
/// as long as the descriptor. Costs a clone of the caller (milliseconds for
/// a large process): the daemon keeps one per mapping.
pub fn userns_fd(map: &layerstack_types::IdMap) -> io::Result<OwnedFd> {
    let (r, w) = pipe()?;
    // SAFETY: the child only reads its pipe and exits (child-safe calls).
    let pid = match unsafe { clone_fork(libc::CLONE_NEWUSER) } {
        Ok(0) => {
            close(w.as_raw_fd());
            let mut b = [0u8; 1];
            let _ = read(r.as_raw_fd(), &mut b);
            exit_now(0)
        }
        Ok(pid) => pid,
        Err(e) => return Err(e),
    };
    drop(r);
    let ns =
        write_id_map(pid, map).and_then(|()| std::fs::File::open(format!("/proc/{pid}/ns/user")));
    drop(w);
    let _ = wait_pid(pid);
    Ok(ns?.into())
}
