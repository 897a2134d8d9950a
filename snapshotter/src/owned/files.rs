//! The file RPCs beneath a session's root (`ReadFile`, `WriteFile`,
//! `ListDir`, `StatPath`, `RemovePath`, `UploadTar`, `DownloadTar`): every
//! path resolved by the kernel inside the session (`openat2` with
//! `RESOLVE_IN_ROOT`), never on the daemon's host.

use super::*;

/// A request path, relative to the files root: `..` and NUL refused, empty
/// and `/` are the root (`"."`).
pub(crate) fn rel_path(p: &str) -> Result<Vec<u8>, Status> {
    if p.contains('\0') {
        return Err(Status::invalid_argument(format!(
            "path {p:?} holds a NUL byte"
        )));
    }
    let mut out: Vec<u8> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                return Err(Status::invalid_argument(format!(
                "path {p:?}: a `..` component is refused (name the path from the session's root)"
            )))
            }
            c => {
                if !out.is_empty() {
                    out.push(b'/');
                }
                out.extend_from_slice(c.as_bytes());
            }
        }
    }
    Ok(out)
}

pub(crate) fn cpath(rel: &[u8]) -> CString {
    // rel_path refused NUL bytes.
    CString::new(if rel.is_empty() {
        b".".to_vec()
    } else {
        rel.to_vec()
    })
    .unwrap_or_default()
}

fn split(rel: &[u8]) -> (&[u8], &[u8]) {
    match rel.iter().rposition(|&b| b == b'/') {
        Some(i) => (&rel[..i], &rel[i + 1..]),
        None => (&[], rel),
    }
}

/// Why a file RPC does not serve what a path resolved to (PERMISSION_DENIED):
/// the daemon works as the host's root, and the session decides what its
/// tree holds — symlinks, and mounts made in a namespace of its own.
#[derive(Debug)]
enum NotServed {
    /// On a kernel-interface filesystem ([`sys::kernel_fs`]).
    KernelFs(&'static str),
    /// On another filesystem than the session's root (its /dev, /run, a
    /// bind mount the session made).
    OtherMount,
}

impl std::fmt::Display for NotServed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotServed::KernelFs(name) => write!(
                f,
                "it is on the session's {name} filesystem, a kernel interface: the file RPCs serve the session's files only (read it with Exec inside the session)"
            ),
            NotServed::OtherMount => f.write_str(
                "it lies on another filesystem mounted in the session (its /dev, /run, or a mount the session made): the file RPCs serve the session's root filesystem only (reach it with Exec inside the session)",
            ),
        }
    }
}

impl std::error::Error for NotServed {}

fn not_served(why: NotServed) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, why)
}

fn dev_of(fd: &impl AsRawFd) -> io::Result<u64> {
    nix::sys::stat::fstat(fd.as_raw_fd())
        .map(|st| st.st_dev)
        .map_err(nix_io)
}

/// `fd`, if it lies on the filesystem of the files root `root`: not on a
/// kernel-interface filesystem (procfs, sysfs, …: a symlink of the session
/// may point there), not on any other mount of the session. Checked on the
/// descriptor, after the open: a mount made meanwhile cannot slip in.
/// Errors: [`NotServed`], or fstatfs's and fstat's.
fn on_root_fs(root: &OwnedFd, fd: OwnedFd) -> io::Result<OwnedFd> {
    if let Some(name) = sys::kernel_fs(&fd)? {
        return Err(not_served(NotServed::KernelFs(name)));
    }
    if dev_of(&fd)? != dev_of(root)? {
        return Err(not_served(NotServed::OtherMount));
    }
    Ok(fd)
}

/// `openat2_in_root` ([`sys::openat2_in_root`]) of a file RPC, refused off
/// the root's filesystem ([`on_root_fs`]).
/// A path that does not resolve below a kernel-interface mount of the
/// session (`/proc/self/…`: the magic link names the *daemon's* process,
/// which the session's procfs does not show; `/dev/pts/99`) is refused as
/// [`NotServed::KernelFs`], not answered NOT_FOUND.
fn open_in_root(root: &OwnedFd, path: &std::ffi::CStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    match sys::openat2_in_root(root, path, flags, 0) {
        Ok(fd) => on_root_fs(root, fd),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
            Err(kernel_fs_above(root, path.to_bytes()).unwrap_or(e))
        }
        Err(e) => Err(e),
    }
}

/// [`NotServed::KernelFs`] when the deepest directory of `path` that
/// resolves (`path` itself excluded) is on a kernel-interface filesystem,
/// following the session's symlinks on the way (`/link -> /proc/self/fd/0`).
fn kernel_fs_above(root: &OwnedFd, path: &[u8]) -> Option<io::Error> {
    let deepest = deepest_dir(root, path, 40, &mut 256)?;
    let name = sys::kernel_fs(&deepest).ok()??;
    Some(not_served(NotServed::KernelFs(name)))
}

/// The deepest directory of `path` (below `root`) that resolves, `path`
/// itself excluded. A component that does not resolve but is a symlink is
/// followed by hand (its target with the rest of `path`, at most `links`
/// links): its target may be the part that does not resolve, as the
/// daemon's `/proc/self` does not in the session's procfs. At most `opens`
/// opens in all: a tree of the session's links cannot make a refusal cost
/// more than that.
fn deepest_dir(root: &OwnedFd, path: &[u8], links: u32, opens: &mut u32) -> Option<OwnedFd> {
    let path = path.strip_prefix(b"/").unwrap_or(path);
    let mut deepest = None;
    let ends = path
        .iter()
        .enumerate()
        .filter(|(_, &b)| b == b'/')
        .map(|(i, _)| i)
        .chain(std::iter::once(path.len()));
    for i in ends {
        if *opens < 2 {
            break;
        }
        *opens -= 2;
        let c = CString::new(&path[..i]).ok()?;
        match sys::openat2_in_root(root, &c, libc::O_PATH | libc::O_DIRECTORY, 0) {
            Ok(fd) if i < path.len() => deepest = Some(fd),
            Ok(_) => break,
            Err(_) => {
                if links > 0 {
                    if let Ok(link) =
                        sys::openat2_in_root(root, &c, libc::O_PATH | libc::O_NOFOLLOW, 0)
                    {
                        if let Ok(target) =
                            nix::fcntl::readlinkat(Some(link.as_raw_fd()), OsStr::new(""))
                        {
                            let target = target.as_bytes();
                            // Relative to the link's directory, or to the root.
                            let mut next = if target.starts_with(b"/") {
                                Vec::new()
                            } else {
                                let parent = path[..i].iter().rposition(|&b| b == b'/');
                                let mut p = path[..parent.unwrap_or(0)].to_vec();
                                p.push(b'/');
                                p
                            };
                            next.extend_from_slice(target);
                            next.extend_from_slice(&path[i..]);
                            if next.strip_prefix(b"/").unwrap_or(&next) == path {
                                break; // a link to itself
                            }
                            return deepest_dir(root, &next, links - 1, opens).or(deepest);
                        }
                    }
                }
                break;
            }
        }
    }
    deepest
}

/// The status of a failed file operation on `path`, naming it and the reason.
fn file_status(path: &str, what: &str, e: &io::Error) -> Status {
    let msg = format!("{what} {path:?}: {e}");
    if e.get_ref().is_some_and(|i| i.is::<NotServed>()) {
        return Status::permission_denied(msg);
    }
    match e.raw_os_error() {
        Some(libc::EBUSY) => Status::failed_precondition(format!(
            "{msg}: a mount point of the session (its /proc, /dev, /run…) is no file of the session's tree"
        )),
        Some(libc::ENOENT) => Status::not_found(msg),
        Some(
            libc::ENOTDIR
            | libc::EISDIR
            | libc::ELOOP
            | libc::EXDEV
            | libc::ENOTEMPTY
            | libc::EEXIST
            | libc::EINVAL
            | libc::ENAMETOOLONG,
        ) => Status::invalid_argument(msg),
        Some(libc::EACCES | libc::EPERM | libc::EROFS) => Status::failed_precondition(msg),
        // An idmapped layer's entry whose owner the session's mapping lacks
        // (it shows as 65534 inside): overlay cannot copy it up or hide it.
        Some(libc::EOVERFLOW) => Status::failed_precondition(format!(
            "{msg}: its owner (or its directory's) is outside the session's uid/gid mapping; widen the mapping or change the owner in the layer"
        )),
        _ => Status::internal(msg),
    }
}

fn nix_io(e: nix::Error) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

// nix 0.29 takes raw descriptors: these keep ownership in `OwnedFd`s.

fn at_openat<P: ?Sized + nix::NixPath>(
    dir: &OwnedFd,
    name: &P,
    flags: OFlag,
) -> io::Result<OwnedFd> {
    let fd = nix::fcntl::openat(
        Some(dir.as_raw_fd()),
        name,
        flags | OFlag::O_CLOEXEC,
        NMode::from_bits_truncate(0o600),
    )
    .map_err(nix_io)?;
    // SAFETY: openat returned a new descriptor nothing else owns.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

fn at_fstatat<P: ?Sized + nix::NixPath>(
    dir: &OwnedFd,
    name: &P,
) -> io::Result<nix::sys::stat::FileStat> {
    nix::sys::stat::fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW)
        .map_err(nix_io)
}

fn at_unlinkat<P: ?Sized + nix::NixPath>(dir: &OwnedFd, name: &P, d: bool) -> io::Result<()> {
    let f = if d {
        nix::unistd::UnlinkatFlags::RemoveDir
    } else {
        nix::unistd::UnlinkatFlags::NoRemoveDir
    };
    nix::unistd::unlinkat(Some(dir.as_raw_fd()), name, f).map_err(nix_io)
}

fn dir_names(dir: &OwnedFd) -> io::Result<Vec<Vec<u8>>> {
    use std::os::fd::IntoRawFd;
    let d = nix::dir::Dir::from_fd(dir.try_clone()?.into_raw_fd()).map_err(nix_io)?;
    let mut names = Vec::new();
    for ent in d.into_iter() {
        let ent = ent.map_err(nix_io)?;
        let n = ent.file_name().to_bytes();
        if n != b"." && n != b".." {
            names.push(n.to_vec());
        }
    }
    names.sort();
    Ok(names)
}

fn kind_of(mode: u32) -> &'static str {
    match SFlag::from_bits_truncate(mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFREG => "file",
        SFlag::S_IFDIR => "dir",
        SFlag::S_IFLNK => "symlink",
        SFlag::S_IFIFO => "fifo",
        SFlag::S_IFCHR => "char",
        SFlag::S_IFBLK => "block",
        SFlag::S_IFSOCK => "socket",
        _ => "",
    }
}

fn stat_of(name: &[u8], st: &nix::sys::stat::FileStat, target: Option<Vec<u8>>) -> api::FileStat {
    api::FileStat {
        name: String::from_utf8_lossy(name).into_owned(),
        raw_name: name.to_vec(),
        kind: kind_of(st.st_mode).to_string(),
        size: u64::try_from(st.st_size).unwrap_or(0),
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        mtime_ns: st
            .st_mtime
            .saturating_mul(1_000_000_000)
            .saturating_add(st.st_mtime_nsec),
        link_target: target
            .map(|t| String::from_utf8_lossy(&t).into_owned())
            .unwrap_or_default(),
    }
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)` and, for a symlink, its target.
fn stat_at(dir: &OwnedFd, name: &[u8]) -> io::Result<api::FileStat> {
    let st = at_fstatat(dir, OsStr::from_bytes(name))?;
    let target = if kind_of(st.st_mode) == "symlink" {
        Some(
            nix::fcntl::readlinkat(Some(dir.as_raw_fd()), OsStr::from_bytes(name))
                .map_err(nix_io)?
                .as_bytes()
                .to_vec(),
        )
    } else {
        None
    };
    Ok(stat_of(name, &st, target))
}

/// Opens the parent directory of `rel` beneath `root` (symlinks in it resolve
/// inside the root), making missing directories (0755, owned by `owner`)
/// when `make` is set: below the deepest ancestor that resolves (through
/// the session's symlinks, e.g. Debian's `/lib -> usr/lib`), each made
/// component opened without following a symlink. Returns it and the last
/// component.
fn open_parent<'a>(
    root: &OwnedFd,
    rel: &'a [u8],
    make: bool,
    owner: Option<(u32, u32)>,
) -> io::Result<(OwnedFd, &'a [u8])> {
    let (parent, name) = split(rel);
    let flags = libc::O_PATH | libc::O_DIRECTORY;
    match open_in_root(root, &cpath(parent), flags) {
        Ok(fd) => return Ok((fd, name)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) && make => {}
        Err(e) => return Err(e),
    }
    let comps: Vec<&[u8]> = parent.split(|&b| b == b'/').collect();
    let mut have = comps.len();
    let mut dir = loop {
        have -= 1;
        match open_in_root(root, &cpath(&comps[..have].join(&b'/')), flags) {
            Ok(fd) => break fd,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) && have > 0 => {}
            Err(e) => return Err(e),
        }
    };
    for comp in &comps[have..] {
        let comp: &[u8] = comp;
        let c = OsStr::from_bytes(comp);
        let made = match nix::sys::stat::mkdirat(
            Some(dir.as_raw_fd()),
            c,
            NMode::from_bits_truncate(0o755),
        ) {
            Ok(()) => true,
            Err(nix::Error::EEXIST) => false,
            Err(e) => return Err(nix_io(e)),
        };
        let mut p = b"./".to_vec();
        p.extend_from_slice(comp);
        // Relative to `dir`, never through a symlink; checked on the
        // descriptor, and owned by descriptor: a mount the session puts on
        // the new name meanwhile is refused, never chowned.
        let next = {
            let cp = CString::new(p).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
            on_root_fs(root, openat2_beneath_dir(&dir, root, &cp)?)?
        };
        if let (true, Some((u, g))) = (made, owner) {
            nix::unistd::fchownat(
                Some(next.as_raw_fd()),
                "",
                Some(u.into()),
                Some(g.into()),
                AtFlags::AT_EMPTY_PATH,
            )
            .map_err(nix_io)?;
        }
        dir = next;
    }
    Ok((dir, name))
}

/// Makes a sandbox's working directory `rel` (from [`rel_path`]) beneath
/// `root` when it is missing, with its missing parents — as Docker makes a
/// missing `WORKDIR` (and runc a missing `cwd`) — each 0755 and owned by
/// `owner` (the host's ids; `None`: the daemon's, root): [`open_parent`] of
/// a name below it. An existing directory (or a symlink to one, resolved
/// inside the root) is left as it is. Errors: `ENOTDIR` when it or a
/// component is not a directory (a symlink among the components it makes
/// included); what [`open_in_root`] refuses (a kernel filesystem, another
/// mount).
pub(crate) fn make_workdir(
    root: &OwnedFd,
    rel: &[u8],
    owner: Option<(u32, u32)>,
) -> io::Result<()> {
    let mut below = rel.to_vec();
    if !below.is_empty() {
        below.push(b'/');
    }
    below.push(b'x');
    open_parent(root, &below, true, owner).map(drop)
}

/// Opens `name` (a directory) relative to `dir` while staying inside `root`:
/// a plain `openat(O_NOFOLLOW)` (a component just made or checked by name);
/// a symlink there is resolved through `root` instead, never outside it.
fn openat2_beneath_dir(dir: &OwnedFd, root: &OwnedFd, name: &CString) -> io::Result<OwnedFd> {
    match at_openat(
        dir,
        name.as_c_str(),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
    ) {
        Ok(fd) => Ok(fd),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
            // A symlink: refuse rather than resolve it with a second path
            // walk (the parent chain was made by this call).
            let _ = root;
            Err(io::Error::from_raw_os_error(libc::ENOTDIR))
        }
        Err(e) => Err(e),
    }
}

/// The host ids of what a file RPC creates: the request's owner, else the
/// session's default user; in a session with a uid/gid mapping, that owner
/// (or `0:0`) shifted to the host's ids (INVALID_ARGUMENT outside the
/// mapping).
fn owner_of(l: &Served, has: bool, uid: u32, gid: u32) -> Result<Option<(u32, u32)>, Status> {
    let owner = if has {
        Some((uid, gid))
    } else {
        l.default_user()
    };
    match l.id_map() {
        None => Ok(owner),
        Some(m) => {
            let (u, g) = owner.unwrap_or((0, 0));
            match (m.uid_to_host(u), m.gid_to_host(g)) {
                (Some(hu), Some(hg)) => Ok(Some((hu, hg))),
                _ => Err(Status::invalid_argument(format!(
                    "owner {u}:{g} is outside the session's uid/gid mapping {m} (ids 0..{}): give ids below {}",
                    m.size, m.size
                ))),
            }
        }
    }
}

/// `st`'s ids as the session sees them: with a mapping, the host's ids
/// shifted back (65534, the kernel's overflow id, for one outside it, as
/// the session's processes see it).
fn seen_ids(map: Option<layerstack_engine::IdMap>, mut st: api::FileStat) -> api::FileStat {
    if let Some(m) = map {
        st.uid = m.uid_from_host(st.uid).unwrap_or(OVERFLOW_ID);
        st.gid = m.gid_from_host(st.gid).unwrap_or(OVERFLOW_ID);
    }
    st
}

/// The id an unmapped id shows as inside a user namespace
/// (`/proc/sys/kernel/overflowuid`'s default).
const OVERFLOW_ID: u32 = 65534;

/// `ReadFile`.
pub(crate) async fn read_file(
    admin: &AdminService,
    r: api::ReadFileRequest,
) -> Result<Stream<api::FileChunk>, Status> {
    if i64::try_from(r.offset).is_err() {
        return Err(Status::invalid_argument(format!(
            "offset {} is past the largest file offset (2^63 - 1 bytes)",
            r.offset
        )));
    }
    let (_l, root) = served_root(admin, r.session_id).await?;
    let rel = rel_path(&r.path)?;
    let path = r.path.clone();
    let fd = open_in_root(
        &root,
        &cpath(&rel),
        libc::O_RDONLY | libc::O_NOCTTY | libc::O_NONBLOCK,
    )
    .map_err(|e| file_status(&path, "cannot open", &e))?;
    let st = nix::sys::stat::fstat(fd.as_raw_fd())
        .map_err(|e| file_status(&path, "cannot stat", &nix_io(e)))?;
    if kind_of(st.st_mode) != "file" {
        return Err(Status::invalid_argument(format!(
            "{path:?} is a {}, not a regular file: ReadFile reads regular files (ListDir lists a directory)",
            kind_of(st.st_mode)
        )));
    }
    let (mut tx, rx) = ChunkSender::new(stream_idle(admin), &path);
    let (offset, limit) = (r.offset, r.limit);
    let turn = stream_turn().await?;
    tokio::task::spawn_blocking(move || {
        let _turn = turn;
        let f = std::fs::File::from(fd);
        let mut off = offset;
        let end = if limit == 0 {
            u64::MAX
        } else {
            offset.saturating_add(limit)
        };
        let mut buf = vec![0u8; CHUNK];
        // No read reaches past the largest file offset (2^63 - 1): the
        // kernel refuses one that would (EINVAL), there is nothing there.
        let end = end.min(i64::MAX as u64);
        while off < end {
            let want = usize::try_from((end - off).min(CHUNK as u64)).unwrap_or(CHUNK);
            match std::os::unix::fs::FileExt::read_at(&f, &mut buf[..want], off) {
                Ok(0) => break,
                Ok(n) => {
                    off += n as u64;
                    if tx
                        .send(api::FileChunk {
                            data: buf[..n].to_vec(),
                        })
                        .is_err()
                    {
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tx.fail(file_status(&path, "cannot read", &e));
                    return;
                }
            }
        }
    });
    Ok(rx)
}

/// `WriteFile`: temp file in the target's directory, then rename.
pub(crate) async fn write_file(
    admin: &AdminService,
    s: &mut tonic::Streaming<api::WriteFileRequest>,
) -> Result<api::FileStat, Status> {
    let first = s.message().await?.ok_or_else(|| {
        Status::invalid_argument("empty stream: the first message carries the header")
    })?;
    let h = first.header.clone().ok_or_else(|| {
        Status::invalid_argument("the first message carries no header (session_id, path)")
    })?;
    let (l, root) = served_root(admin, h.session_id).await?;
    let rel = rel_path(&h.path)?;
    if rel.is_empty() {
        return Err(Status::invalid_argument(format!(
            "path {:?} names the root, not a file",
            h.path
        )));
    }
    if h.path.ends_with('/') || h.path.ends_with("/.") {
        return Err(Status::invalid_argument(format!(
            "path {:?} ends in '/', which names a directory: WriteFile writes a regular file (drop the trailing '/')",
            h.path
        )));
    }
    let owner = owner_of(&l, h.has_owner, h.uid, h.gid)?;
    let map = l.id_map();
    if h.mode > 0o7777 {
        return Err(Status::invalid_argument(format!(
            "mode {:#o} of {:?}: give permission bits (at most 0o7777)",
            h.mode, h.path
        )));
    }
    // 0 without has_mode: a client that predates it, meaning the default.
    let mode = if h.mode == 0 && !h.has_mode {
        0o644
    } else {
        h.mode
    };
    let path = h.path.clone();
    let (ctx, mut crx) = mpsc::channel::<Vec<u8>>(4);
    let abort = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let aborted = abort.clone();
    let turn = stream_turn().await?;
    let job = tokio::task::spawn_blocking(move || -> Result<api::FileStat, Status> {
        let _turn = turn;
        let (parent, name) = open_parent(&root, &rel, h.make_parents, owner)
            .map_err(|e| file_status(&path, "cannot open the directory of", &e))?;
        // An O_PATH parent cannot be written through: reopen it as a directory.
        let dir = at_openat(&parent, c".", OFlag::O_RDONLY | OFlag::O_DIRECTORY)
            .map_err(|e| file_status(&path, "cannot open the directory of", &e))?;
        let name = OsStr::from_bytes(name);
        let tmp = format!(".layerstack-write-{}-{}", std::process::id(), rand_suffix());
        let fd = at_openat(
            &dir,
            tmp.as_str(),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW,
        )
        .map_err(|e| file_status(&path, "cannot create a temporary file beside", &e))?;
        let mut f = std::fs::File::from(fd);
        let done = (|| -> io::Result<()> {
            while let Some(chunk) = crx.blocking_recv() {
                f.write_all(&chunk)?;
            }
            if aborted.load(Ordering::Relaxed) {
                return Err(io::Error::new(
                    io::ErrorKind::Interrupted,
                    "the client's stream ended with an error",
                ));
            }
            if let Some((u, g)) = owner {
                nix::unistd::fchown(f.as_raw_fd(), Some(u.into()), Some(g.into()))
                    .map_err(nix_io)?;
            }
            // fchmod on the open file: after chown (which clears setuid bits).
            nix::sys::stat::fchmod(f.as_raw_fd(), NMode::from_bits_truncate(mode))
                .map_err(nix_io)?;
            nix::fcntl::renameat(
                Some(dir.as_raw_fd()),
                tmp.as_str(),
                Some(dir.as_raw_fd()),
                name,
            )
            .map_err(nix_io)
        })();
        if let Err(e) = done {
            let _ = at_unlinkat(&dir, tmp.as_str(), false);
            return Err(file_status(&path, "cannot write", &e));
        }
        stat_at(&dir, name.as_bytes())
            .map(|st| seen_ids(map, st))
            .map_err(|e| file_status(&path, "cannot stat", &e))
    });
    let (fed, ended) = feed(s, &ctx, job, first.data, stream_idle(admin), |m| {
        if m.header.is_some() {
            return Err(Status::invalid_argument(
                "a header after the first message: one file per stream",
            ));
        }
        Ok(m.data)
    })
    .await;
    if let Err(st) = fed {
        // The client's stream broke: the data is incomplete. The blocking
        // side must not rename it over the target: `abort` tells it.
        abort.store(true, Ordering::Relaxed);
        drop(ctx);
        let _ = ended.await;
        return Err(st);
    }
    drop(ctx);
    let out = ended
        .await
        .map_err(|e| Status::internal(format!("write task: {e}")))?;
    kept_if_live(admin, h.session_id, &l, "WriteFile", out).await
}

/// A mutating file RPC's answer `out`, unless daemon-owned session `id`
/// was discarded while it ran (a CloseSession DISCARD does not wait for file
/// RPCs in flight): then FAILED_PRECONDITION saying nothing of the call is
/// kept, with what the call itself saw — not the NOT_FOUND (or OK) of a
/// write into an upper being removed. A session that stopped being live
/// otherwise (a publish or checkpoint, its init gone) answers `out`, an
/// error of it FAILED_PRECONDITION naming the session's end. A WASI
/// session's close waits for the calls in flight (they are in its end).
async fn kept_if_live<T>(
    admin: &AdminService,
    id: SessionId,
    served: &Served,
    call: &str,
    out: Result<T, Status>,
) -> Result<T, Status> {
    if matches!(served, Served::Wasi(_)) || live(admin, id).await.is_ok() {
        return out;
    }
    let s = admin.engine.session(id).await.ok();
    let ended = s.as_ref().and_then(|s| s.outcome.as_ref()).map(|o| o.kind);
    let saw = match &out {
        Ok(_) => String::new(),
        Err(st) => format!("; the call saw: {}", st.message()),
    };
    match ended {
        Some(layerstack_engine::store::OutcomeKind::Discarded) => Err(Status::failed_precondition(
            format!("session {id} was discarded while the {call} ran: nothing of it is kept{saw}"),
        )),
        _ => match out {
            Ok(v) => Ok(v),
            Err(_) => Err(Status::failed_precondition(format!(
                "session {id} ended while the {call} ran ({}){saw}",
                ended.map_or("its end is not recorded yet", |k| k.as_str())
            ))),
        },
    }
}

/// Feeds a client-streaming call's blocking `job` (WriteFile's, UploadTar's)
/// through `ctx` (awaited when the job is behind: a slow disk never blocks
/// a thread of the runtime, as a blocking channel's send did): `first` (the first message's bytes), then the bytes of
/// each further message (`data_of`: a message's bytes, or the refusal of
/// the stream), until the client ends its stream, the job takes no more
/// (its receiver dropped) or the job ends first — a refusal found on the
/// blocking side (the path, the filesystem), answered now rather than at
/// the client's next message. A client that sends nothing for `idle` is
/// refused (DEADLINE_EXCEEDED). Answers how feeding ended (`Err`: the
/// client's stream broke or idled, or `data_of` refused it) and the job's
/// end (a future: awaited or already had).
async fn feed<M, R: Send + 'static>(
    s: &mut tonic::Streaming<M>,
    ctx: &mpsc::Sender<Vec<u8>>,
    mut job: tokio::task::JoinHandle<R>,
    first: Vec<u8>,
    idle: Option<Duration>,
    data_of: impl Fn(M) -> Result<Vec<u8>, Status>,
) -> (
    Result<(), Status>,
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<R, tokio::task::JoinError>> + Send>>,
) {
    let mut early = None;
    let fed = async {
        if !first.is_empty() && ctx.send(first).await.is_err() {
            return Ok(());
        }
        loop {
            let m = tokio::select! {
                m = s.message() => m?,
                r = &mut job => {
                    early = Some(r);
                    break;
                }
                () = tokio::time::sleep(idle.unwrap_or(Duration::from_secs(86_400))), if idle.is_some() => {
                    return Err(Status::deadline_exceeded(format!(
                        "the client sent nothing for {} s: the stream is refused and what it sent dropped ([sandbox] file_stream_idle_s)",
                        idle.unwrap_or_default().as_secs()
                    )));
                }
            };
            let Some(m) = m else { break };
            let data = data_of(m)?;
            if !data.is_empty() && ctx.send(data).await.is_err() {
                break;
            }
        }
        Ok(())
    }
    .await;
    let ended: std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>> = match early {
        Some(r) => Box::pin(std::future::ready(r)),
        None => Box::pin(job),
    };
    (fed, ended)
}

/// `[sandbox] file_stream_idle_s` of the daemon of `admin`.
fn stream_idle(admin: &AdminService) -> Option<Duration> {
    admin.holders.limits.get().and_then(|l| l.file_stream_idle)
}

/// The streaming file RPCs' blocking jobs at once (ReadFile, WriteFile,
/// UploadTar, DownloadTar): each holds a thread of tokio's blocking pool
/// (512, shared with the engine's store calls) for as long as its client
/// streams — a client that pauses included —, so more than this wait
/// (asynchronously) for a turn rather than take the pool.
static STREAM_JOBS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(64);

/// A turn of [`STREAM_JOBS`], moved into the job that holds it.
async fn stream_turn() -> Result<tokio::sync::SemaphorePermit<'static>, Status> {
    STREAM_JOBS
        .acquire()
        .await
        .map_err(|_| Status::internal("the file RPCs' job turns are closed"))
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

/// `ListDir`.
pub(crate) async fn list_dir(
    admin: &AdminService,
    r: api::ListDirRequest,
) -> Result<api::ListDirResponse, Status> {
    let (l, root) = served_root(admin, r.session_id).await?;
    let map = l.id_map();
    let rel = rel_path(&r.path)?;
    let path = r.path.clone();
    tokio::task::spawn_blocking(move || {
        let fd = open_in_root(&root, &cpath(&rel), libc::O_RDONLY | libc::O_DIRECTORY)
            .map_err(|e| file_status(&path, "cannot open the directory", &e))?;
        let names =
            dir_names(&fd).map_err(|e| file_status(&path, "cannot read the directory", &e))?;
        let mut entries = Vec::with_capacity(names.len());
        for n in names {
            match stat_at(&fd, &n) {
                Ok(s) => entries.push(seen_ids(map, s)),
                // Removed meanwhile.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(file_status(&path, "cannot stat an entry of", &e)),
            }
        }
        Ok(api::ListDirResponse { entries })
    })
    .await
    .map_err(|e| Status::internal(format!("list task: {e}")))?
}

/// `StatPath`.
pub(crate) async fn stat_path(
    admin: &AdminService,
    r: api::StatPathRequest,
) -> Result<api::FileStat, Status> {
    let (l, root) = served_root(admin, r.session_id).await?;
    let map = l.id_map();
    let rel = rel_path(&r.path)?;
    let path = r.path;
    if rel.is_empty() {
        let st = nix::sys::stat::fstat(root.as_raw_fd())
            .map_err(|e| file_status(&path, "cannot stat", &nix_io(e)))?;
        return Ok(seen_ids(map, stat_of(b"", &st, None)));
    }
    let (parent, name) =
        open_parent(&root, &rel, false, None).map_err(|e| file_status(&path, "cannot stat", &e))?;
    stat_at(&parent, name)
        .map(|st| seen_ids(map, st))
        .map_err(|e| file_status(&path, "cannot stat", &e))
}

/// Removes `name` in `dir` and, for a directory, everything below it; never
/// follows a symlink (each level is opened `O_NOFOLLOW`). Returns the entries
/// removed.
/// EBUSY when `sub` (opened below `dir`) lies on another filesystem than
/// `dir`: a mount point of the session. The daemon works from another mount
/// namespace, where the kernel's own check (`rmdir /dev` in the session:
/// EBUSY) does not see the session's mounts.
fn refuse_mount_point(dir: &OwnedFd, sub: &OwnedFd) -> io::Result<()> {
    if dev_of(sub)? != dev_of(dir)? {
        return Err(io::Error::from_raw_os_error(libc::EBUSY));
    }
    Ok(())
}

fn remove_tree_at(dir: &OwnedFd, name: &OsStr) -> io::Result<u64> {
    let sub = match at_openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
    ) {
        Ok(fd) => fd,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => {
            at_unlinkat(dir, name, false)?;
            return Ok(1);
        }
        Err(e) => return Err(e),
    };
    // Another filesystem mounted there (the session's /proc, /dev, a mount
    // of its own), checked on the opened descriptor: not descended into —
    // its mount point stays, EBUSY, as `rm --one-file-system` leaves it.
    refuse_mount_point(dir, &sub)?;
    let mut n = 0;
    for c in dir_names(&sub)? {
        n += remove_tree_at(&sub, OsStr::from_bytes(&c))?;
    }
    at_unlinkat(dir, name, true)?;
    Ok(n + 1)
}

/// `RemovePath`.
pub(crate) async fn remove_path(
    admin: &AdminService,
    r: api::RemovePathRequest,
) -> Result<api::RemovePathResponse, Status> {
    let (_l, root) = served_root(admin, r.session_id).await?;
    let rel = rel_path(&r.path)?;
    if rel.is_empty() {
        return Err(Status::invalid_argument(format!(
            "path {:?} names the session's root, which cannot be removed",
            r.path
        )));
    }
    let path = r.path;
    let recursive = r.recursive;
    tokio::task::spawn_blocking(move || {
        let (parent, name) = open_parent(&root, &rel, false, None)
            .map_err(|e| file_status(&path, "cannot remove", &e))?;
        let dir = at_openat(&parent, c".", OFlag::O_RDONLY | OFlag::O_DIRECTORY)
            .map_err(|e| file_status(&path, "cannot remove", &e))?;
        let name = OsStr::from_bytes(name);
        let st =
            stat_at(&dir, name.as_bytes()).map_err(|e| file_status(&path, "cannot remove", &e))?;
        let removed = if st.kind == "dir" {
            if recursive {
                remove_tree_at(&dir, name)
            } else {
                at_openat(
                    &dir,
                    name,
                    OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
                )
                .and_then(|sub| refuse_mount_point(&dir, &sub))
                .and_then(|()| at_unlinkat(&dir, name, true))
                .map(|()| 1)
            }
        } else {
            at_unlinkat(&dir, name, false).map(|()| 1)
        };
        let removed = removed.map_err(|e| {
            if e.raw_os_error() == Some(libc::ENOTEMPTY) {
                Status::failed_precondition(format!(
                    "cannot remove {path:?}: the directory is not empty (set recursive)"
                ))
            } else {
                file_status(&path, "cannot remove", &e)
            }
        })?;
        Ok(api::RemovePathResponse { removed })
    })
    .await
    .map_err(|e| Status::internal(format!("remove task: {e}")))?
}

/// A reader over chunks sent from the async side.
struct ChunkReader {
    rx: mpsc::Receiver<Vec<u8>>,
    cur: Vec<u8>,
    pos: usize,
}

impl Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.cur.len() {
            match self.rx.blocking_recv() {
                Some(c) => {
                    self.cur = c;
                    self.pos = 0;
                }
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.cur.len() - self.pos);
        buf[..n].copy_from_slice(&self.cur[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// `UploadTar`: the publisher's import rules (`extract_tar_into`) beneath the
/// destination directory, opened inside the session's root.
pub(crate) async fn upload_tar(
    admin: &AdminService,
    s: &mut tonic::Streaming<api::UploadTarRequest>,
) -> Result<api::UploadTarResponse, Status> {
    let first = s.message().await?.ok_or_else(|| {
        Status::invalid_argument(
            "empty stream: the first message names the session and the directory",
        )
    })?;
    let (l, root) = served_root(admin, first.session_id).await?;
    let rel = rel_path(&first.path)?;
    let map = l.id_map();
    let owner = match map {
        // Directories the upload makes: the session's root's.
        Some(_) => owner_of(&l, false, 0, 0)?,
        None => l.default_user(),
    };
    let path = first.path.clone();
    let make = first.make_parents;
    let (ctx, crx) = mpsc::channel::<Vec<u8>>(4);
    let turn = stream_turn().await?;
    let job = tokio::task::spawn_blocking(move || -> Result<api::UploadTarResponse, Status> {
        let _turn = turn;
        let dir = if rel.is_empty() {
            open_in_root(&root, c".", libc::O_RDONLY | libc::O_DIRECTORY)
        } else {
            let mut with_self = rel.clone();
            with_self.extend_from_slice(b"/.");
            open_parent(&root, &with_self, make, owner)
                .and_then(|(p, _)| at_openat(&p, c".", OFlag::O_RDONLY | OFlag::O_DIRECTORY))
        }
        .map_err(|e| file_status(&path, "cannot open the upload directory", &e))?;
        // The stage opens its root by path: the resolved directory's own
        // descriptor, through /proc/self/fd (".": its last component is no
        // symlink).
        let base = std::path::PathBuf::from(format!("/proc/self/fd/{}/.", dir.as_raw_fd()));
        let reader = ChunkReader {
            rx: crx,
            cur: Vec::new(),
            pos: 0,
        };
        let shift = map.map(|m| (m.host_uid, m.host_gid, m.size));
        let rep = layerstack_engine::publisher::extract_tar_into_shifted(
            &base,
            reader,
            "the uploaded tar",
            shift,
        )
        .map_err(|e| {
            use layerstack_engine::publisher::ImportError;
            // An upload is not atomic (it writes into the live tree): what
            // came before a refused or unreadable entry stays, and the
            // message says so (the import's own says "nothing was
            // imported", true of a base import's staging only).
            const KEPT: &str = "the entries before it were written and stay (an upload is not atomic: remove them, or discard the sandbox's writes)";
            match &e {
                ImportError::Refused { entry, reason, .. } => Status::invalid_argument(format!(
                    "upload into {path:?}: refused entry {:?} of the uploaded tar: {reason}; {KEPT}",
                    String::from_utf8_lossy(entry)
                )),
                ImportError::Archive { .. } => Status::invalid_argument(format!(
                    "upload into {path:?}: {}; {KEPT}",
                    api::error_chain(&e)
                )),
                ImportError::Invalid(_) => Status::invalid_argument(format!(
                    "upload into {path:?}: {}",
                    api::error_chain(&e)
                )),
                _ => Status::internal(format!("upload into {path:?}: {}", api::error_chain(&e))),
            }
        })?;
        drop(dir);
        Ok(api::UploadTarResponse {
            files: rep.files,
            dirs: rep.dirs + rep.implied_dirs,
            symlinks: rep.symlinks,
            hardlinks: rep.hardlinks,
            bytes: rep.content_bytes,
        })
    });
    let (fed, ended) = feed(s, &ctx, job, first.data, stream_idle(admin), |m| Ok(m.data)).await;
    drop(ctx);
    let out = ended
        .await
        .map_err(|e| Status::internal(format!("upload task: {e}")))?;
    fed?;
    kept_if_live(admin, first.session_id, &l, "UploadTar", out).await
}

/// The blocking side of a streaming read (ReadFile, DownloadTar): sends
/// its chunks to the response stream ([`ChunkSender::new`]'s). A chunk
/// waits at most `idle` (`[sandbox] file_stream_idle_s`) for the client to
/// take the ones before: a client that stops reading then gets
/// DEADLINE_EXCEEDED after what was sent, and its job ends — it held a
/// turn of [`STREAM_JOBS`] and a blocking thread for as long as it liked.
struct ChunkSender {
    tx: mpsc::Sender<Result<api::FileChunk, Status>>,
    idle: Option<Duration>,
    rt: tokio::runtime::Handle,
    /// The status that ends the stream after its chunks (the channel is
    /// full when the client stopped reading).
    trailer: Option<tokio::sync::oneshot::Sender<Status>>,
    path: String,
}

impl ChunkSender {
    /// The sender (for the blocking job) and the response stream: the
    /// chunks, then the trailer's status if one was set. Called on the
    /// runtime.
    fn new(idle: Option<Duration>, path: &str) -> (ChunkSender, Stream<api::FileChunk>) {
        use futures::StreamExt as _;
        let (tx, rx) = mpsc::channel(4);
        let (ttx, trx) = tokio::sync::oneshot::channel::<Status>();
        let stream = ReceiverStream::new(rx)
            .chain(futures::stream::once(trx).filter_map(|t| std::future::ready(t.ok().map(Err))));
        let sender = ChunkSender {
            tx,
            idle,
            rt: tokio::runtime::Handle::current(),
            trailer: Some(ttx),
            path: path.to_string(),
        };
        (sender, Box::pin(stream))
    }

    /// Ends the stream with `st` after the chunks sent (never blocks; a
    /// stream already ended by the idle limit keeps that end).
    fn fail(&mut self, st: Status) {
        if let Some(t) = self.trailer.take() {
            let _ = t.send(st);
        }
    }

    /// Sends `chunk`. Errors: the client went away (BrokenPipe), or did not
    /// take it within `idle` (TimedOut; the stream's end says so).
    fn send(&mut self, chunk: api::FileChunk) -> io::Result<()> {
        let item = Ok(chunk);
        let gone = || io::Error::new(io::ErrorKind::BrokenPipe, "the client went away");
        let Some(idle) = self.idle else {
            return self.tx.blocking_send(item).map_err(|_| gone());
        };
        if self.trailer.is_none() {
            return Err(gone());
        }
        match self
            .rt
            .block_on(tokio::time::timeout(idle, self.tx.send(item)))
        {
            Ok(sent) => sent.map_err(|_| gone()),
            Err(_) => {
                let msg = format!(
                    "{:?}: the client read nothing for {} s ([sandbox] file_stream_idle_s): the stream ends here",
                    self.path,
                    idle.as_secs_f64()
                );
                if let Some(t) = self.trailer.take() {
                    let _ = t.send(Status::deadline_exceeded(msg.clone()));
                }
                Err(io::Error::new(io::ErrorKind::TimedOut, msg))
            }
        }
    }
}

/// A writer that sends what it is given as `FileChunk`s.
struct ChunkWriter {
    tx: ChunkSender,
    buf: Vec<u8>,
}

impl ChunkWriter {
    fn flush_full(&mut self, all: bool) -> io::Result<()> {
        while self.buf.len() >= CHUNK || (all && !self.buf.is_empty()) {
            let n = self.buf.len().min(CHUNK);
            let data: Vec<u8> = self.buf.drain(..n).collect();
            self.tx.send(api::FileChunk { data })?;
        }
        Ok(())
    }
}

impl Write for ChunkWriter {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(b);
        self.flush_full(false)?;
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        self.flush_full(true)
    }
}

fn header_of(st: &nix::sys::stat::FileStat, map: Option<layerstack_engine::IdMap>) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_mode(st.st_mode & 0o7777);
    let (uid, gid) = match map {
        Some(m) => (
            m.uid_from_host(st.st_uid).unwrap_or(OVERFLOW_ID),
            m.gid_from_host(st.st_gid).unwrap_or(OVERFLOW_ID),
        ),
        None => (st.st_uid, st.st_gid),
    };
    h.set_uid(uid.into());
    h.set_gid(gid.into());
    h.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
    h.set_size(0);
    h
}

/// Appends `name` of `dir` (path `at` in the tar) and, for a directory,
/// everything below it, never following a symlink.
fn append_at(
    b: &mut tar::Builder<&mut ChunkWriter>,
    dir: &OwnedFd,
    name: &OsStr,
    at: &std::path::Path,
    map: Option<layerstack_engine::IdMap>,
    dev: u64,
) -> io::Result<()> {
    let st = at_fstatat(dir, name)?;
    let mut h = header_of(&st, map);
    match kind_of(st.st_mode) {
        "file" => {
            let fd = at_openat(
                dir,
                name,
                OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NOCTTY | OFlag::O_NONBLOCK,
            )?;
            // Checked on the descriptor: a file of another filesystem (a
            // bind mount the session made, of a kernel file say) is left out.
            if dev_of(&fd)? != dev {
                return Ok(());
            }
            let f = std::fs::File::from(fd);
            let len = f.metadata()?.len();
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(len);
            b.append_data(&mut h, at, f.take(len))
        }
        "symlink" => {
            let t = nix::fcntl::readlinkat(Some(dir.as_raw_fd()), name).map_err(nix_io)?;
            h.set_entry_type(tar::EntryType::Symlink);
            b.append_link(&mut h, at, std::path::Path::new(&t))
        }
        "dir" => {
            h.set_entry_type(tar::EntryType::Directory);
            b.append_data(&mut h, at, io::empty())?;
            // Another filesystem mounted there (the session's /proc, /dev, a
            // mount of its own), checked on the opened descriptor: its mount
            // point only, as `tar --one-file-system`.
            let sub = at_openat(
                dir,
                name,
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
            )?;
            if dev_of(&sub)? != dev {
                return Ok(());
            }
            for n in dir_names(&sub)? {
                let c = OsStr::from_bytes(&n);
                append_at(b, &sub, c, &at.join(c), map, dev)?;
            }
            Ok(())
        }
        "fifo" => {
            h.set_entry_type(tar::EntryType::Fifo);
            b.append_data(&mut h, at, io::empty())
        }
        "char" | "block" => {
            h.set_entry_type(if kind_of(st.st_mode) == "char" {
                tar::EntryType::Char
            } else {
                tar::EntryType::Block
            });
            h.set_device_major(nix::sys::stat::major(st.st_rdev) as u32)?;
            h.set_device_minor(nix::sys::stat::minor(st.st_rdev) as u32)?;
            b.append_data(&mut h, at, io::empty())
        }
        // Sockets: a tar cannot hold one.
        _ => Ok(()),
    }
}

/// `DownloadTar`.
pub(crate) async fn download_tar(
    admin: &AdminService,
    r: api::DownloadTarRequest,
) -> Result<Stream<api::FileChunk>, Status> {
    let (l, root) = served_root(admin, r.session_id).await?;
    let map = l.id_map();
    let rel = rel_path(&r.path)?;
    let path = r.path;
    let (parent, name) = if rel.is_empty() {
        let fd = open_in_root(&root, c".", libc::O_RDONLY | libc::O_DIRECTORY)
            .map_err(|e| file_status(&path, "cannot open", &e))?;
        (fd, b".".to_vec())
    } else {
        let (p, n) = open_parent(&root, &rel, false, None)
            .map_err(|e| file_status(&path, "cannot open", &e))?;
        let p = at_openat(&p, c".", OFlag::O_RDONLY | OFlag::O_DIRECTORY)
            .map_err(|e| file_status(&path, "cannot open", &e))?;
        (p, n.to_vec())
    };
    // Before the stream starts: a missing path refused, and the path itself
    // (a file or a directory) on the root's filesystem, checked on its
    // descriptor; the archive stays there.
    at_openat(
        &parent,
        OsStr::from_bytes(&name),
        OFlag::O_PATH | OFlag::O_NOFOLLOW,
    )
    .and_then(|fd| on_root_fs(&root, fd))
    .map_err(|e| file_status(&path, "cannot archive", &e))?;
    let dev = dev_of(&root).map_err(|e| file_status(&path, "cannot stat", &e))?;
    let (tx, rx) = ChunkSender::new(stream_idle(admin), &path);
    let turn = stream_turn().await?;
    tokio::task::spawn_blocking(move || {
        let _turn = turn;
        let mut w = ChunkWriter {
            tx,
            buf: Vec::new(),
        };
        let archived = {
            let mut b = tar::Builder::new(&mut w);
            b.follow_symlinks(false);
            let n = OsStr::from_bytes(&name);
            append_at(&mut b, &parent, n, std::path::Path::new(n), map, dev)
                .and_then(|()| b.finish())
        };
        if let Err(e) = archived.and_then(|()| w.flush()) {
            w.tx.fail(file_status(&path, "cannot archive", &e));
        }
    });
    Ok(rx)
}
