//! The upper writer: carries out a [`GatePlan`]'s [`Action`]s on a quiescent
//! upper (merged files, the head's version of a file copied in, symlinks,
//! metadata, removals), each a new inode renamed into place (see
//! [`apply_plan`]). The gate plans (`gate.rs`), this writes; the engine runs it
//! under a branch's gate with no store transaction open (ARCHITECTURE §9).

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::fsx;
use crate::gate::{rel_path, Action, GatePlan};
use crate::meta::{set_meta, Meta};

/// Why [`apply_plan`] failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot {what} {}", .path.display())]
pub struct ApplyError {
    /// What was being done.
    pub what: &'static str,
    /// Relative path.
    pub path: PathBuf,
    /// The error.
    #[source]
    pub source: io::Error,
}

/// Carries out the plan's [`Action`]s on the quiescent upper `upper`, then syncs
/// its filesystem (`syncfs`). Refuses (does nothing) for a plan with conflicts.
///
/// A merged file is written as a new inode in `scratch` — a directory on the same
/// filesystem as the upper that is never captured or published (the daemon passes
/// the store's `staging/`, which its sweep empties) — unnamed (`O_TMPFILE`; a
/// unique `O_EXCL` name where unsupported), given the merged owner, mode and xattrs
/// (in that order: `chown` clears setuid), `fsync`ed, linked into `scratch` under a
/// unique name and renamed over the old name. No name in the upper is ever used for
/// a temporary file, so no user file can be clobbered, and a crash leaves either
/// version in the upper (and at most a stray file in `scratch`), never a torn or
/// extra file. Everything in the upper is reached through descriptors, no-follow.
/// The head's version of a file ([`Action::CopyFile`]: head's content, merged
/// metadata) is copied the same way, streamed from its (immutable) layer, never
/// held in memory, holes kept where the filesystem reports them.
///
/// # Errors
/// [`ApplyError`] with the first failing path (also when `scratch` is on another
/// filesystem); earlier actions stay applied.
pub fn apply_plan(upper: &Path, plan: &GatePlan, scratch: &Path) -> Result<(), ApplyError> {
    apply_plan_with(upper, plan, scratch, true)
}

/// [`apply_plan`]; with `sync` false nothing is `fsync`ed — neither each written
/// file nor, at the end, the upper's filesystem (`syncfs`): for a store whose
/// profile syncs nothing it publishes (the daemon's *disposable* profile: a crash
/// of the daemon loses nothing committed, an OS crash may), where a `syncfs`
/// under the branch's gate waited for every dirty page of the filesystem —
/// other sessions' writes included — while every other publish of the branch
/// waited for it.
///
/// # Errors
/// As [`apply_plan`].
pub fn apply_plan_with(
    upper: &Path,
    plan: &GatePlan,
    scratch: &Path,
    sync: bool,
) -> Result<(), ApplyError> {
    if plan.is_conflict() || plan.actions.is_empty() {
        return Ok(());
    }
    let needs_scratch = plan.actions.iter().any(|a| {
        matches!(
            a,
            Action::WriteFile { .. } | Action::CopyFile { .. } | Action::WriteSymlink { .. }
        )
    });
    if needs_scratch {
        let dev = |p: &Path, what| {
            std::fs::symlink_metadata(p)
                .map(|m| m.dev())
                .map_err(|source| ApplyError {
                    what,
                    path: p.to_path_buf(),
                    source,
                })
        };
        if dev(upper, "stat the upper")? != dev(scratch, "stat the scratch directory")? {
            return Err(ApplyError {
                what: "use as scratch directory (it must be on the upper's filesystem)",
                path: scratch.to_path_buf(),
                source: io::Error::from_raw_os_error(libc::EXDEV),
            });
        }
    }
    for action in &plan.actions {
        match action {
            Action::WriteFile {
                path,
                content,
                meta,
            } => write_file(upper, path, Content::Bytes(content), meta, scratch, sync)?,
            Action::CopyFile { path, from, meta } => {
                write_file(upper, path, Content::CopyOf(from), meta, scratch, sync)?;
            }
            Action::WriteSymlink { path, target, meta } => {
                write_symlink(upper, path, target, meta, scratch, plan.userxattr)?;
            }
            Action::SetMeta { path, meta } => {
                let at = fsx::at(upper, path).map_err(apply_err("open", path))?;
                set_meta(at.path(), meta, plan.userxattr)
                    .map_err(apply_err("set metadata of", path))?;
            }
            Action::Remove { path } => {
                crate::layer::remove_tree_at(upper, path).map_err(apply_err("remove", path))?;
            }
        }
    }
    if sync {
        crate::layer::sync(upper).map_err(|e| ApplyError {
            what: "sync",
            path: upper.to_path_buf(),
            source: io::Error::other(e.to_string()),
        })?;
    }
    Ok(())
}

fn apply_err<'p>(what: &'static str, path: &'p [u8]) -> impl FnOnce(io::Error) -> ApplyError + 'p {
    move |source| ApplyError {
        what,
        path: rel_path(path),
        source,
    }
}

/// A fresh name in `scratch` (nothing is created).
fn scratch_name(scratch: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    scratch.join(format!("merge-{}-{nanos}-{n}", std::process::id()))
}

/// A new, empty file (mode 0600) for a merged version, in `scratch`: unnamed
/// (`O_TMPFILE`, so a crash before it is placed leaves nothing at all) where the
/// filesystem supports it, else under a unique name (`O_EXCL`).
enum ScratchFile {
    Unnamed(std::fs::File),
    Named(PathBuf, std::fs::File),
}

impl ScratchFile {
    fn create(scratch: &Path) -> io::Result<ScratchFile> {
        use std::os::unix::fs::OpenOptionsExt;
        let unnamed = std::fs::OpenOptions::new()
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC)
            .open(scratch);
        match unnamed {
            Ok(f) => return Ok(ScratchFile::Unnamed(f)),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EOPNOTSUPP) | Some(libc::EISDIR) | Some(libc::EINVAL)
                ) => {}
            Err(e) => return Err(e),
        }
        loop {
            let tmp = scratch_name(scratch);
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&tmp)
            {
                Ok(f) => return Ok(ScratchFile::Named(tmp, f)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
    }

    fn file(&self) -> &std::fs::File {
        match self {
            ScratchFile::Unnamed(f) | ScratchFile::Named(_, f) => f,
        }
    }

    /// Gives the file a name in `scratch` (an unnamed one is linked in only now,
    /// just before it is renamed away).
    fn name(&self, scratch: &Path) -> io::Result<PathBuf> {
        match self {
            ScratchFile::Named(p, _) => Ok(p.clone()),
            ScratchFile::Unnamed(f) => loop {
                let tmp = scratch_name(scratch);
                let fd = PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()));
                match nix::unistd::linkat(
                    None,
                    fd.as_path(),
                    None,
                    tmp.as_path(),
                    nix::fcntl::AtFlags::AT_SYMLINK_FOLLOW,
                ) {
                    Ok(()) => return Ok(tmp),
                    Err(nix::errno::Errno::EEXIST) => continue,
                    Err(e) => return Err(e.into()),
                }
            },
        }
    }
}

/// The content [`write_file`] gives the new inode.
#[derive(Clone, Copy)]
enum Content<'a> {
    /// These bytes.
    Bytes(&'a [u8]),
    /// The regular file at the same relative path below this directory, streamed.
    CopyOf(&'a Path),
}

/// [`Content`] ready to be written.
enum Opened<'a> {
    Bytes(&'a [u8]),
    File(std::fs::File),
}

/// Copies the regular file `src` into the empty file `dst` without holding it in
/// memory (`std::io::copy`: `copy_file_range` where the kernel can, so a reflink
/// or an in-kernel copy). Only the data extents are copied when the filesystem
/// reports them (`SEEK_DATA`/`SEEK_HOLE`), so holes of a sparse file stay holes;
/// the length is set last. A source that changes length while copied is an error.
fn copy_content(src: &std::fs::File, dst: &std::fs::File) -> io::Result<()> {
    use nix::unistd::{lseek, Whence};
    use std::io::{Read, Seek, SeekFrom};
    let md = src.metadata()?;
    if !md.file_type().is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the version to copy is not a regular file",
        ));
    }
    let len = md.len();
    let short = || io::Error::new(io::ErrorKind::UnexpectedEof, "the file shrank while copied");
    let mut pos: u64 = 0;
    while pos < len {
        let at = i64::try_from(pos).map_err(io::Error::other)?;
        let data = match lseek(src.as_raw_fd(), at, Whence::SeekData) {
            Ok(d) => u64::try_from(d).map_err(io::Error::other)?,
            // No data after `pos`: the rest is a hole.
            Err(nix::errno::Errno::ENXIO) => break,
            // Holes not reported: copy everything that is left.
            Err(nix::errno::Errno::EINVAL | nix::errno::Errno::EOPNOTSUPP) => pos,
            Err(e) => return Err(e.into()),
        };
        let end = match lseek(
            src.as_raw_fd(),
            i64::try_from(data).map_err(io::Error::other)?,
            Whence::SeekHole,
        ) {
            Ok(h) => u64::try_from(h).map_err(io::Error::other)?.min(len),
            Err(nix::errno::Errno::EINVAL | nix::errno::Errno::EOPNOTSUPP) => len,
            Err(e) => return Err(e.into()),
        };
        if end <= data {
            break;
        }
        let (mut r, mut w) = (src, dst);
        r.seek(SeekFrom::Start(data))?;
        w.seek(SeekFrom::Start(data))?;
        let n = io::copy(&mut r.take(end - data), &mut w)?;
        if n != end - data {
            return Err(short());
        }
        pos = end;
    }
    dst.set_len(len)?;
    if src.metadata()?.len() != len {
        return Err(short());
    }
    Ok(())
}

fn write_file(
    upper: &Path,
    path: &[u8],
    content: Content<'_>,
    meta: &Meta,
    scratch: &Path,
    sync: bool,
) -> Result<(), ApplyError> {
    use std::io::Write;
    // The source is opened first: nothing is created when it cannot be read.
    let src = match content {
        Content::Bytes(bytes) => Opened::Bytes(bytes),
        Content::CopyOf(from) => Opened::File(
            fsx::open_read(from, path).map_err(apply_err("open the version to copy of", path))?,
        ),
    };
    let (parent, name) = fsx::split_parent(path);
    let dir = fsx::walk_dir(upper, parent).map_err(apply_err("open the parent of", path))?;
    let sf = ScratchFile::create(scratch).map_err(apply_err("create the merged file for", path))?;
    let mut named: Option<PathBuf> = None;
    let result = (|| -> io::Result<()> {
        let mut f = sf.file();
        match &src {
            Opened::Bytes(bytes) => f.write_all(bytes)?,
            Opened::File(src) => copy_content(src, f)?,
        }
        std::os::unix::fs::fchown(f, Some(meta.uid), Some(meta.gid))?;
        f.set_permissions(std::fs::Permissions::from_mode(meta.mode))?;
        for (n, v) in &meta.xattrs {
            xattr::FileExt::set_xattr(f, std::ffi::OsStr::from_bytes(n), v)?;
        }
        if sync {
            f.sync_all()?;
        }
        let tmp = named.insert(sf.name(scratch)?);
        std::fs::rename(tmp, fsx::proc_path(&dir, name))
    })();
    if let ScratchFile::Named(p, _) = &sf {
        named.get_or_insert_with(|| p.clone());
    }
    if let Err(e) = result {
        if let Some(tmp) = named {
            let _ = std::fs::remove_file(tmp);
        }
        return Err(apply_err("write the merged file", path)(e));
    }
    Ok(())
}

/// Sets owner, mode (not for symlinks) and exactly `meta.xattrs` on the entry at
/// the short path `p`, leaving the overlay's own xattrs (private and opaque, of the
/// mount's namespace: `user.overlay.*` with `userxattr`, else `trusted.overlay.*`)
/// alone.
/// [`Action::WriteSymlink`]: a new symlink under a unique name in `scratch`, its
/// owner and xattrs set, renamed over `path` in the upper (never followed).
fn write_symlink(
    upper: &Path,
    path: &[u8],
    target: &[u8],
    meta: &Meta,
    scratch: &Path,
    userxattr: bool,
) -> Result<(), ApplyError> {
    let (parent, name) = fsx::split_parent(path);
    let dir = fsx::walk_dir(upper, parent).map_err(apply_err("open the parent of", path))?;
    let tmp = loop {
        let tmp = scratch_name(scratch);
        match std::os::unix::fs::symlink(std::ffi::OsStr::from_bytes(target), &tmp) {
            Ok(()) => break tmp,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(apply_err("create the merged symlink for", path)(e)),
        }
    };
    let placed = set_meta(&tmp, meta, userxattr)
        .and_then(|()| std::fs::rename(&tmp, fsx::proc_path(&dir, name)));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(apply_err("write the merged symlink", path)(e));
    }
    Ok(())
}
