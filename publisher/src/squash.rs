//! Squash: compact a run of adjacent layers into one layer that shows exactly
//! what the run shows, above whatever lies below it (ARCHITECTURE.md §2
//! "Squash"; seed `000`, "squash can compact old runs without changing that
//! logical view").
//!
//! [`flatten_layers`] writes, into an empty directory, one overlay-format layer
//! `S` such that for **every** stack of layers `B` below the run `R`,
//! `lowerdir = …:S:B` resolves every path as `…:R…:B` does
//! (kernel rules, `Documentation/filesystems/overlayfs.rst`):
//!
//! * a name whose newest entry in `R` is a file, symlink or special file: `S`
//!   holds that entry — **hardlinked**, not copied (layers are immutable and on
//!   one filesystem: no payload is duplicated; a hardlink limit falls back to a
//!   copy);
//! * a name whose newest entry in `R` is a whiteout: `S` holds a whiteout when
//!   the directory it is in still merges with `B` (otherwise nothing of `B` shows
//!   there anyway);
//! * a directory: `S` holds a directory with the newest entry's mode, owner,
//!   xattrs and times, and it is **opaque** exactly when its merge stops inside
//!   `R` (an opaque marker, or an older whiteout or non-directory of that name in
//!   `R`) — so `B`'s content there stays hidden, as it was.
//!
//! The run is read with fd-relative, no-follow calls (`openat(O_NOFOLLOW)`,
//! `fstatat(AT_SYMLINK_NOFOLLOW)`, `linkat` without `AT_SYMLINK_FOLLOW`); nothing
//! is ever followed.
//!
//! [`tree_digest`] hashes a merged view (every path's type, mode, owner, xattrs
//! and content) — how tests show that a squash changes no view.

use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{fstatat, mkdirat, mknodat, Mode, SFlag};
use nix::sys::time::TimeSpec;
use xattr::FileExt;

use crate::capture::{digest_bytes, hash, is_overlay_private};
use crate::fsx::{self, DirFd};
use crate::view::{is_whiteout, opaque_name, opaque_value, FileKind, LayerView};

/// What [`flatten_layers`] wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlattenReport {
    /// Entries linked (files, symlinks, special files).
    pub linked: u64,
    /// Entries copied because a hardlink was impossible (`EMLINK`, another filesystem).
    pub copied: u64,
    /// Directories created (the opaque ones included).
    pub dirs: u64,
    /// Directories marked opaque.
    pub opaque: u64,
    /// Whiteouts created.
    pub whiteouts: u64,
    /// Whiteouts of the run left out because nothing below the run has the
    /// path ([`flatten_layers_over`]).
    pub whiteouts_dropped: u64,
}

/// Why [`flatten_layers`] failed; `path` is relative to the run.
#[derive(Debug, thiserror::Error)]
#[error("cannot {what} {}", .path.display())]
pub struct SquashError {
    /// What was being done.
    pub what: &'static str,
    /// The path, relative.
    pub path: PathBuf,
    /// The system call error.
    #[source]
    pub source: io::Error,
}

fn err<'a>(what: &'static str, rel: &'a [u8]) -> impl FnOnce(io::Error) -> SquashError + 'a {
    move |source| SquashError {
        what,
        path: PathBuf::from(std::ffi::OsStr::from_bytes(rel)),
        source,
    }
}

const DIR_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);

/// One layer's directory at the path being flattened.
struct Member {
    dir: DirFd,
}

/// The newest entry of a name in the run, and what the older ones do to it.
enum Resolved {
    /// A whiteout is the newest entry.
    Whiteout,
    /// A file, symlink or special file of layer `layer`.
    Leaf { layer: usize },
    /// A directory: the layers merged into it (newest first), and whether the merge
    /// reaches past the run's oldest layer.
    Dir {
        layers: Vec<usize>,
        open_below: bool,
    },
}

/// Writes the squash of `run` (layer directories, newest first) into `out`, an
/// existing empty directory on the same filesystem (see the module docs). The
/// root directory takes the newest layer's metadata. `userxattr`: the layers'
/// opaque marker is `user.overlay.opaque` (rootless) instead of
/// `trusted.overlay.opaque`. Every whiteout the run shows is kept (the layers
/// the result will lie on are not known); see [`flatten_layers_over`].
///
/// # Errors
/// [`SquashError`] naming the path; `out` may then hold part of the layer (the
/// caller builds it in staging and discards it).
pub fn flatten_layers(
    run: &[PathBuf],
    out: &Path,
    userxattr: bool,
) -> Result<FlattenReport, SquashError> {
    flatten(run, None, out, userxattr)
}

/// [`flatten_layers`] for a squash that will lie on `below` (the layers under
/// the run, as the view that holds the run stacks them): a whiteout of the run
/// is written only where `below` shows something to hide.
///
/// Why: overlayfs hides a lower layer's whiteout only in a directory it merges
/// from several layers; in a directory that exists in one layer only it lists
/// the whiteout as a name whose `stat` fails (`ls: x: No such file or
/// directory`). A file added and deleted inside the run leaves, once the run is
/// one layer, a whiteout in a directory the layers below may not have at all.
///
/// # Errors
/// As [`flatten_layers`]; a failed lookup in `below` too.
pub fn flatten_layers_over(
    run: &[PathBuf],
    below: &LayerView,
    out: &Path,
    userxattr: bool,
) -> Result<FlattenReport, SquashError> {
    flatten(run, Some(below), out, userxattr)
}

fn flatten(
    run: &[PathBuf],
    below: Option<&LayerView>,
    out: &Path,
    userxattr: bool,
) -> Result<FlattenReport, SquashError> {
    let mut report = FlattenReport::default();
    let members: Vec<Member> = run
        .iter()
        .map(|p| {
            fsx::open_dir(p)
                .map(|dir| Member { dir })
                .map_err(err("open layer", p.as_os_str().as_bytes()))
        })
        .collect::<Result<_, _>>()?;
    let out_dir = fsx::open_dir(out).map_err(err("open", b""))?;
    if let Some(top) = members.first() {
        copy_dir_meta(&top.dir, &out_dir, &[], userxattr)?;
    }
    let all: Vec<usize> = (0..members.len()).collect();
    let mut rel = Vec::new();
    let mut ctx = Flatten {
        below,
        userxattr,
        report: &mut report,
    };
    flatten_dir(&members, &all, true, &out_dir, &mut rel, &mut ctx)?;
    if let Some(top) = members.first() {
        copy_times(&top.dir, &out_dir, &rel)?;
    }
    Ok(report)
}

/// What every level of [`flatten_dir`] shares.
struct Flatten<'a> {
    below: Option<&'a LayerView>,
    userxattr: bool,
    report: &'a mut FlattenReport,
}

/// One path for [`copy_paths`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyPath {
    /// Relative path, bytes, no leading `/`.
    pub path: Vec<u8>,
    /// The changes being copied replaced or deleted what was at the path (a
    /// deletion, an opaque directory or a non-directory among them): a
    /// directory there is written opaque when `base` has one, so `base`'s
    /// content below it stays hidden.
    pub replaced: bool,
}

/// Writes into `out` (an existing directory on the same filesystem as the
/// layers, e.g. a fresh session upper) an overlay-format layer that, above the
/// layers of `base`, shows at each of `paths` what `view` shows there — the
/// changes that took `base` to `view` at those paths, when `paths` are every
/// path they changed (a path index), and nothing else.
///
/// At each path (in byte order; one below a path written as a non-directory or
/// a whiteout is skipped): what `view` shows is hardlinked (files, symlinks and
/// special files; copied when a link is impossible) or created (a directory,
/// with the view's mode, owner and xattrs, opaque per [`CopyPath::replaced`]);
/// nothing there becomes a whiteout when `base` shows something, and is left
/// out otherwise. Directories above a path that are not themselves among
/// `paths` are created with the view's metadata, never opaque. `out`'s own
/// root directory is left as it is. Unlike [`flatten_layers`], whose run must
/// be whole layers, `view` may hold a squashed layer that compacted both these
/// changes and older ones.
///
/// # Errors
/// [`SquashError`] naming the path: a read of `view` or `base`, or a write
/// into `out`, failed; `out` may then hold part of the changes.
pub fn copy_paths(
    view: &LayerView,
    base: &LayerView,
    paths: &[CopyPath],
    out: &Path,
    userxattr: bool,
) -> Result<FlattenReport, SquashError> {
    let mut report = FlattenReport::default();
    let mut sorted: Vec<&CopyPath> = paths.iter().collect();
    sorted.sort_by(|a, b| a.path.cmp(&b.path));
    sorted.dedup_by(|a, b| a.path == b.path);
    // Paths written as a non-directory or a whiteout: nothing below them.
    let mut leaves: std::collections::BTreeSet<Vec<u8>> = Default::default();
    // Directories made in `out`, with the view's layer they take metadata from.
    let mut made: BTreeMap<Vec<u8>, usize> = BTreeMap::new();
    let mut opaque_dirs: std::collections::BTreeSet<Vec<u8>> = Default::default();
    for cp in sorted {
        let rel = cp.path.as_slice();
        if rel.is_empty() {
            continue;
        }
        let ancestors: Vec<&[u8]> = rel
            .iter()
            .enumerate()
            .filter(|(_, b)| **b == b'/')
            .map(|(i, _)| &rel[..i])
            .collect();
        if ancestors.iter().any(|a| leaves.contains(*a)) {
            continue;
        }
        let entry = view.lookup(rel).map_err(err("look up", rel))?;
        let (parent, name) = fsx::split_parent(rel);
        match entry {
            None => {
                let below_opaque = ancestors.iter().any(|a| opaque_dirs.contains(*a));
                if below_opaque || base.lookup(rel).map_err(err("look up", rel))?.is_none() {
                    continue;
                }
                if !make_parents(view, &ancestors, out, &mut made, userxattr, &mut report)? {
                    continue;
                }
                let dir = fsx::open_beneath(out, parent).map_err(err("open", parent))?;
                let cname =
                    CString::new(name).map_err(|e| err("name", rel)(io::Error::other(e)))?;
                mknodat(
                    Some(dir.as_raw_fd()),
                    cname.as_c_str(),
                    SFlag::S_IFCHR,
                    Mode::empty(),
                    0,
                )
                .map_err(|e| err("create whiteout", rel)(e.into()))?;
                report.whiteouts += 1;
                leaves.insert(rel.to_vec());
            }
            Some(e) => {
                if !make_parents(view, &ancestors, out, &mut made, userxattr, &mut report)? {
                    continue;
                }
                let to = fsx::open_beneath(out, parent).map_err(err("open", parent))?;
                let from = fsx::open_beneath(view.layer(e.layer_index), parent)
                    .map_err(err("open", parent))?;
                let cname =
                    CString::new(name).map_err(|e| err("name", rel)(io::Error::other(e)))?;
                if e.kind == FileKind::Dir {
                    if !made.contains_key(rel) {
                        mkdirat(
                            Some(to.as_raw_fd()),
                            cname.as_c_str(),
                            Mode::from_bits_truncate(0o700),
                        )
                        .map_err(|e| err("create directory", rel)(e.into()))?;
                        report.dirs += 1;
                        made.insert(rel.to_vec(), e.layer_index);
                        let src = fsx::open_dir_at(&from, name).map_err(err("open", rel))?;
                        let dst = fsx::open_dir_at(&to, name).map_err(err("open", rel))?;
                        copy_dir_meta(&src, &dst, rel, userxattr)?;
                    }
                    let base_dir = base
                        .lookup(rel)
                        .map_err(err("look up", rel))?
                        .is_some_and(|b| b.kind == FileKind::Dir);
                    if cp.replaced && base_dir {
                        let dst = fsx::open_dir_at(&to, name).map_err(err("open", rel))?;
                        xattr::set(fsx::proc_path(&dst, b""), opaque_name(userxattr), b"y")
                            .map_err(err("mark opaque", rel))?;
                        report.opaque += 1;
                        opaque_dirs.insert(rel.to_vec());
                    }
                } else {
                    link_or_copy(&from, &to, &cname, rel, &mut report)?;
                    leaves.insert(rel.to_vec());
                }
            }
        }
    }
    // Directory times last: creating their entries moved them. Deepest first.
    for (rel, layer) in made.iter().rev() {
        let src = fsx::open_beneath(view.layer(*layer), rel).map_err(err("open", rel))?;
        let dst = fsx::open_beneath(out, rel).map_err(err("open", rel))?;
        copy_times(&src, &dst, rel)?;
    }
    Ok(report)
}

/// Creates in `out` the directories `ancestors` (outermost first) that are not
/// there yet, each with the metadata `view` shows for it (never opaque).
/// `false` when `view` shows no directory at one of them (nothing to copy
/// below it).
fn make_parents(
    view: &LayerView,
    ancestors: &[&[u8]],
    out: &Path,
    made: &mut BTreeMap<Vec<u8>, usize>,
    userxattr: bool,
    report: &mut FlattenReport,
) -> Result<bool, SquashError> {
    for a in ancestors {
        if made.contains_key(*a) {
            continue;
        }
        let Some(e) = view.lookup(a).map_err(err("look up", a))? else {
            return Ok(false);
        };
        if e.kind != FileKind::Dir {
            return Ok(false);
        }
        let (parent, name) = fsx::split_parent(a);
        let to = fsx::open_beneath(out, parent).map_err(err("open", parent))?;
        match mkdirat(Some(to.as_raw_fd()), name, Mode::from_bits_truncate(0o700)) {
            Ok(()) => report.dirs += 1,
            // Made by an earlier copy into the same `out`.
            Err(nix::errno::Errno::EEXIST) => {}
            Err(e) => return Err(err("create directory", a)(e.into())),
        }
        let src = fsx::open_beneath(view.layer(e.layer_index), a).map_err(err("open", a))?;
        let dst = fsx::open_dir_at(&to, name).map_err(err("open", a))?;
        copy_dir_meta(&src, &dst, a, userxattr)?;
        made.insert(a.to_vec(), e.layer_index);
    }
    Ok(true)
}

/// Flattens the directory `rel`, merged from `layers` (each an open directory of
/// the run at `rel`), into `out` (open at `rel`).
fn flatten_dir(
    members: &[Member],
    layers: &[usize],
    open_below: bool,
    out: &DirFd,
    rel: &mut Vec<u8>,
    ctx: &mut Flatten<'_>,
) -> Result<(), SquashError> {
    let userxattr = ctx.userxattr;
    // Every name of every merged layer here, in byte order, with the layers
    // that hold it (newest first): a name is looked up only where it is, so a
    // directory that each of M members adds names to costs O(names), not
    // O(names × M) lookups.
    let mut names: BTreeMap<Vec<u8>, Vec<usize>> = BTreeMap::new();
    for &i in layers {
        let mut d = nix::dir::Dir::openat(
            Some(members[i].dir.as_raw_fd()),
            ".",
            DIR_FLAGS,
            Mode::empty(),
        )
        .map_err(|e| err("read directory", rel)(e.into()))?;
        for ent in d.iter() {
            let ent = ent.map_err(|e| err("read directory", rel)(e.into()))?;
            let n = ent.file_name().to_bytes();
            if n != b"." && n != b".." {
                names.entry(n.to_vec()).or_default().push(i);
            }
        }
    }
    for (name, holders) in names {
        let len = rel.len();
        if !rel.is_empty() {
            rel.push(b'/');
        }
        rel.extend_from_slice(&name);
        let r = resolve(members, &holders, &name, rel, userxattr)?;
        let cname =
            CString::new(name.clone()).map_err(|e| err("name", rel)(io::Error::other(e)))?;
        match r {
            Resolved::Whiteout => {
                // Below an opaque directory nothing is hidden; nor where the
                // layers under the run have nothing at this path.
                let hides = open_below
                    && match ctx.below {
                        None => true,
                        Some(v) => v.lookup(rel).map_err(err("look up below", rel))?.is_some(),
                    };
                if open_below && !hides {
                    ctx.report.whiteouts_dropped += 1;
                }
                if hides {
                    mknodat(
                        Some(out.as_raw_fd()),
                        cname.as_c_str(),
                        SFlag::S_IFCHR,
                        Mode::empty(),
                        0,
                    )
                    .map_err(|e| err("create whiteout", rel)(e.into()))?;
                    ctx.report.whiteouts += 1;
                }
            }
            Resolved::Leaf { layer } => {
                link_or_copy(&members[layer].dir, out, &cname, rel, ctx.report)?;
            }
            Resolved::Dir {
                layers: sub,
                open_below: child_open,
            } => {
                let child_open = child_open && open_below;
                mkdirat(
                    Some(out.as_raw_fd()),
                    cname.as_c_str(),
                    Mode::from_bits_truncate(0o700),
                )
                .map_err(|e| err("create directory", rel)(e.into()))?;
                ctx.report.dirs += 1;
                let out_child = fsx::open_dir_at(out, &name).map_err(err("open", rel))?;
                let sub_members: Vec<Member> = sub
                    .iter()
                    .map(|&i| {
                        fsx::open_dir_at(&members[i].dir, &name)
                            .map(|dir| Member { dir })
                            .map_err(err("open", rel))
                    })
                    .collect::<Result<_, _>>()?;
                let idx: Vec<usize> = (0..sub_members.len()).collect();
                flatten_dir(&sub_members, &idx, child_open, &out_child, rel, ctx)?;
                copy_dir_meta(&sub_members[0].dir, &out_child, rel, userxattr)?;
                if !child_open {
                    let p = fsx::proc_path(&out_child, b"");
                    xattr::set(&p, opaque_name(userxattr), b"y")
                        .map_err(err("mark opaque", rel))?;
                    ctx.report.opaque += 1;
                }
                copy_times(&sub_members[0].dir, &out_child, rel)?;
            }
        }
        rel.truncate(len);
    }
    Ok(())
}

/// The newest entry of `name` among `layers` (open at its parent; the layers
/// that hold the name, newest first), following the kernel's lookup rules.
fn resolve(
    members: &[Member],
    layers: &[usize],
    name: &[u8],
    rel: &[u8],
    userxattr: bool,
) -> Result<Resolved, SquashError> {
    let mut dirs = Vec::new();
    for (pos, &i) in layers.iter().enumerate() {
        let st = match fstatat(
            Some(members[i].dir.as_raw_fd()),
            name,
            AtFlags::AT_SYMLINK_NOFOLLOW,
        ) {
            Ok(st) => st,
            Err(nix::errno::Errno::ENOENT) => continue,
            Err(e) => return Err(err("stat", rel)(e.into())),
        };
        let mode = st.st_mode;
        #[allow(clippy::useless_conversion)]
        let whiteout = is_whiteout(mode, u64::from(st.st_rdev));
        let is_dir = mode & libc::S_IFMT == libc::S_IFDIR;
        if dirs.is_empty() {
            if whiteout {
                return Ok(Resolved::Whiteout);
            }
            if !is_dir {
                return Ok(Resolved::Leaf { layer: i });
            }
        } else if whiteout || !is_dir {
            // An older whiteout or non-directory ends the merge inside the run.
            return Ok(Resolved::Dir {
                layers: dirs,
                open_below: false,
            });
        }
        dirs.push(i);
        let child = fsx::open_dir_at(&members[i].dir, name).map_err(err("open", rel))?;
        let p = fsx::proc_path(&child, b"");
        if opaque_value(xattr::get(&p, opaque_name(userxattr))).map_err(err("read xattrs", rel))? {
            return Ok(Resolved::Dir {
                layers: dirs,
                open_below: false,
            });
        }
        let _ = pos;
    }
    // The merge ran through the run's oldest layer holding the directory: it goes
    // on below the run only if the parent's merge reached the run's end too (the
    // caller combines that), and no layer below the last holder here hid it.
    Ok(Resolved::Dir {
        layers: dirs,
        open_below: true,
    })
}

/// Hardlinks `name` of `from` into `to` (no follow); copies when a link is
/// impossible.
fn link_or_copy(
    from: &DirFd,
    to: &DirFd,
    name: &CStr,
    rel: &[u8],
    report: &mut FlattenReport,
) -> Result<(), SquashError> {
    match nix::unistd::linkat(
        Some(from.as_raw_fd()),
        name,
        Some(to.as_raw_fd()),
        name,
        AtFlags::empty(),
    ) {
        Ok(()) => {
            report.linked += 1;
            Ok(())
        }
        Err(nix::errno::Errno::EMLINK | nix::errno::Errno::EXDEV) => {
            copy_entry(from, to, name, rel)?;
            report.copied += 1;
            Ok(())
        }
        Err(e) => Err(err("link", rel)(e.into())),
    }
}

/// Copies one file, symlink or special file with its metadata.
fn copy_entry(from: &DirFd, to: &DirFd, name: &CStr, rel: &[u8]) -> Result<(), SquashError> {
    let st = fstatat(Some(from.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW)
        .map_err(|e| err("stat", rel)(e.into()))?;
    let src = fsx::proc_path(from, name.to_bytes());
    let dst = fsx::proc_path(to, name.to_bytes());
    match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => {
            let mut r = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags_nofollow()
                .open(&src)
                .map_err(err("open", rel))?;
            let mut w = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&dst)
                .map_err(err("create", rel))?;
            io::copy(&mut r, &mut w).map_err(err("copy", rel))?;
            w.sync_all().map_err(err("sync", rel))?;
        }
        libc::S_IFLNK => {
            let target = std::fs::read_link(&src).map_err(err("read link", rel))?;
            std::os::unix::fs::symlink(target, &dst).map_err(err("create symlink", rel))?;
        }
        _ => {
            #[allow(clippy::useless_conversion)]
            mknodat(
                Some(to.as_raw_fd()),
                name,
                SFlag::from_bits_truncate(st.st_mode & libc::S_IFMT),
                Mode::from_bits_truncate(st.st_mode & 0o7777),
                st.st_rdev.into(),
            )
            .map_err(|e| err("create special file", rel)(e.into()))?;
        }
    }
    std::os::unix::fs::lchown(&dst, Some(st.st_uid), Some(st.st_gid)).map_err(err("chown", rel))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFLNK {
        nix::sys::stat::fchmodat(
            Some(to.as_raw_fd()),
            name,
            Mode::from_bits_truncate(st.st_mode & 0o7777),
            nix::sys::stat::FchmodatFlags::FollowSymlink,
        )
        .map_err(|e| err("chmod", rel)(e.into()))?;
    }
    for (n, v) in fsx::xattrs_of(&src).map_err(err("read xattrs", rel))? {
        xattr::set(&dst, std::ffi::OsStr::from_bytes(&n), &v).map_err(err("set xattr", rel))?;
    }
    let times = [
        TimeSpec::new(st.st_atime, st.st_atime_nsec),
        TimeSpec::new(st.st_mtime, st.st_mtime_nsec),
    ];
    nix::sys::stat::utimensat(
        Some(to.as_raw_fd()),
        name,
        &times[0],
        &times[1],
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .map_err(|e| err("set times", rel)(e.into()))
}

/// Gives the directory `to` the mode, owner and xattrs of `from` (without the
/// opaque marker, which the caller decides).
fn copy_dir_meta(from: &DirFd, to: &DirFd, rel: &[u8], userxattr: bool) -> Result<(), SquashError> {
    let st = nix::sys::stat::fstat(from.as_raw_fd()).map_err(|e| err("stat", rel)(e.into()))?;
    nix::unistd::fchown(
        to.as_raw_fd(),
        Some(st.st_uid.into()),
        Some(st.st_gid.into()),
    )
    .map_err(|e| err("chown", rel)(e.into()))?;
    nix::sys::stat::fchmod(
        to.as_raw_fd(),
        Mode::from_bits_truncate(st.st_mode & 0o7777),
    )
    .map_err(|e| err("chmod", rel)(e.into()))?;
    let opaque = opaque_name(userxattr).as_bytes();
    for (n, v) in fsx::xattrs_of(&fsx::proc_path(from, b"")).map_err(err("read xattrs", rel))? {
        if n == opaque || is_overlay_private(&n, userxattr) {
            continue;
        }
        to.set_xattr(std::ffi::OsStr::from_bytes(&n), &v)
            .map_err(err("set xattr", rel))?;
    }
    Ok(())
}

/// Gives `to` the access and modification times of `from` (after its entries
/// were created, which moved them).
fn copy_times(from: &DirFd, to: &DirFd, rel: &[u8]) -> Result<(), SquashError> {
    let st = nix::sys::stat::fstat(from.as_raw_fd()).map_err(|e| err("stat", rel)(e.into()))?;
    nix::sys::stat::futimens(
        to.as_raw_fd(),
        &TimeSpec::new(st.st_atime, st.st_atime_nsec),
        &TimeSpec::new(st.st_mtime, st.st_mtime_nsec),
    )
    .map_err(|e| err("set times", rel)(e.into()))
}

trait NoFollow {
    fn custom_flags_nofollow(&mut self) -> &mut Self;
}

impl NoFollow for std::fs::OpenOptions {
    fn custom_flags_nofollow(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.custom_flags(libc::O_NOFOLLOW | libc::O_NOCTTY)
    }
}

/// BLAKE3 over the merged view of `view`: every visible path in byte order with
/// its type, mode, owner, size, device number, xattrs (without overlay-private
/// names and the opaque marker) and content (file bytes, symlink target). Two
/// views with equal digests show the same tree; times are not included.
///
/// # Errors
/// Any read error.
pub fn tree_digest(view: &LayerView) -> io::Result<[u8; 32]> {
    let mut h = blake3::Hasher::new();
    let mut stack = vec![Vec::new()];
    while let Some(dir) = stack.pop() {
        let mut names = view.list_dir(&dir)?;
        names.sort();
        for name in names.into_iter().rev() {
            let rel = crate::view::join_rel(&dir, &name);
            let Some(e) = view.lookup(&rel)? else {
                continue;
            };
            h.update(&(rel.len() as u64).to_le_bytes());
            h.update(&rel);
            h.update(&[e.kind as u8]);
            h.update(&e.mode.to_le_bytes());
            h.update(&e.uid.to_le_bytes());
            h.update(&e.gid.to_le_bytes());
            let layer = view.layer(e.layer_index);
            let at = fsx::at(layer, &rel)?;
            let mut x = fsx::xattrs_of(at.path())?;
            x.retain(|(n, _)| {
                n.as_slice() != TRUSTED_OPAQUE_B
                    && n.as_slice() != USER_OPAQUE_B
                    && !n.starts_with(b"trusted.overlay.")
            });
            for (n, v) in &x {
                h.update(&digest_bytes(n));
                h.update(&digest_bytes(v));
            }
            match e.kind {
                FileKind::Regular => {
                    h.update(&e.size.to_le_bytes());
                    h.update(&hash(fsx::open_read(layer, &rel)?)?);
                }
                FileKind::Symlink => {
                    h.update(&fsx::read_link(layer, &rel)?);
                }
                FileKind::Dir => stack.push(rel.clone()),
                _ => {
                    h.update(&e.rdev.to_le_bytes());
                }
            }
        }
    }
    Ok(*h.finalize().as_bytes())
}

const TRUSTED_OPAQUE_B: &[u8] = b"trusted.overlay.opaque";
const USER_OPAQUE_B: &[u8] = b"user.overlay.opaque";

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::testutil::*;

    /// Every view that stacks the run over some lower, before and after the
    /// squash, has one digest.
    fn same_views(run: &[PathBuf], s: &Path, lowers: &[PathBuf], above: &[PathBuf]) {
        let mut before: Vec<PathBuf> = above.to_vec();
        before.extend_from_slice(run);
        before.extend_from_slice(lowers);
        let mut after: Vec<PathBuf> = above.to_vec();
        after.push(s.to_path_buf());
        after.extend_from_slice(lowers);
        assert_eq!(
            tree_digest(&LayerView::new(before)).unwrap(),
            tree_digest(&LayerView::new(after)).unwrap()
        );
    }

    /// The changes of the newest layers of a squash that also compacted older
    /// ones, copied by their paths: above the older layers they show what the
    /// squash shows, and they hold nothing of the older layers.
    #[test]
    fn copied_paths_are_the_newer_members_changes_and_nothing_older() {
        if !have_root("copied_paths_are_the_newer_members_changes_and_nothing_older") {
            return;
        }
        let t = tmp();
        let l = |n: &str| t.path().join(n);
        write(&l("base"), "etc/a", b"base a\n", 0o644);
        write(&l("base"), "etc/b", b"base b\n", 0o644);
        write(&l("base"), "old", b"old\n", 0o644);
        write(&l("base"), "replaced/y", b"y\n", 0o644);
        // The older (shared) layer: its own changes, an opaque directory.
        write(&l("sh"), "shared/only", b"sh\n", 0o644);
        whiteout(&l("sh"), "old");
        mkdir(&l("sh"), "sd", 0o755);
        xattr::set(l("sh").join("sd"), "trusted.overlay.opaque", b"y").unwrap();
        write(&l("sh"), "sd/s1", b"s1\n", 0o644);
        write(&l("sh"), "sd/s2", b"s2\n", 0o644);
        // The newer ones, oldest (o1) to newest (o0).
        write(&l("o1"), "etc/a", b"o1 a\n", 0o600);
        write(&l("o1"), "shared/new2", b"n2\n", 0o644);
        whiteout(&l("o1"), "etc/b");
        write(&l("o1"), "t", b"tmp\n", 0o644);
        whiteout(&l("o0"), "t");
        whiteout(&l("o0"), "sd/s1");
        mkdir(&l("o0"), "replaced", 0o750);
        xattr::set(l("o0").join("replaced"), "trusted.overlay.opaque", b"y").unwrap();
        write(&l("o0"), "replaced/n", b"n\n", 0o644);
        symlink(&l("o0"), "ln", b"etc/a");
        let x = l("X");
        std::fs::create_dir(&x).unwrap();
        flatten_layers(&[l("o0"), l("o1"), l("sh")], &x, false).unwrap();
        let cp = |p: &str, replaced: bool| CopyPath {
            path: p.as_bytes().to_vec(),
            replaced,
        };
        let paths = [
            cp("etc/a", true),
            cp("shared/new2", true),
            cp("etc/b", true),
            cp("t", true),
            cp("sd/s1", true),
            cp("replaced", true),
            cp("replaced/n", true),
            cp("ln", true),
        ];
        let view = LayerView::new(vec![x.clone(), l("base")]);
        let base = LayerView::new(vec![l("sh"), l("base")]);
        let out = l("out");
        std::fs::create_dir(&out).unwrap();
        copy_paths(&view, &base, &paths, &out, false).unwrap();
        assert_eq!(
            tree_digest(&LayerView::new(vec![out.clone(), l("sh"), l("base")])).unwrap(),
            tree_digest(&view).unwrap(),
            "above the older layers, the copy shows what the squash shows"
        );
        let o = LayerView::new(vec![out.clone()]);
        for absent in ["shared/only", "old", "sd/s2", "t"] {
            assert!(
                std::fs::symlink_metadata(out.join(absent)).is_err(),
                "{absent}: nothing of the older layer, nor a change that cancelled out"
            );
        }
        assert!(o.lookup(b"sd").unwrap().is_some());
        assert!(
            !crate::view::is_opaque_path(&out.join("sd"), false).unwrap(),
            "a directory above a copied path is never opaque"
        );
        assert!(crate::view::is_opaque_path(&out.join("replaced"), false).unwrap());
        use std::os::unix::fs::MetadataExt;
        let sd_s1 = std::fs::symlink_metadata(out.join("sd/s1")).unwrap();
        assert!(
            is_whiteout(sd_s1.mode(), sd_s1.rdev()),
            "deleted below a directory the squash does not merge downwards"
        );
        assert_eq!(
            std::fs::metadata(out.join("etc/a")).unwrap().ino(),
            std::fs::metadata(x.join("etc/a")).unwrap().ino(),
            "files are hardlinks"
        );
    }

    /// A file added and deleted inside the run, in a directory the layers below
    /// do not have: over those layers the squash holds no whiteout for it
    /// (overlayfs would list it in that one-layer directory); where the layers
    /// below have the path, or are not known, the whiteout stays.
    #[test]
    fn a_whiteout_that_hides_nothing_below_is_left_out() {
        if !have_root("a_whiteout_that_hides_nothing_below_is_left_out") {
            return;
        }
        let t = tmp();
        let l = |n: &str| t.path().join(n);
        write(&l("base"), "etc/a", b"a\n", 0o644);
        write(&l("base"), "etc/old", b"old\n", 0o644);
        // r1 adds data/d3/x3 and data/d3/y; r0 deletes x3, and etc/old.
        write(&l("r1"), "data/d3/x3", b"x\n", 0o644);
        write(&l("r1"), "data/d3/y", b"y\n", 0o644);
        mkdir(&l("r0"), "data", 0o755);
        mkdir(&l("r0"), "data/d3", 0o755);
        whiteout(&l("r0"), "data/d3/x3");
        mkdir(&l("r0"), "etc", 0o755);
        whiteout(&l("r0"), "etc/old");
        let run = vec![l("r0"), l("r1")];
        let below = LayerView::new(vec![l("base")]);
        let s = l("S");
        std::fs::create_dir(&s).unwrap();
        let r = flatten_layers_over(&run, &below, &s, false).unwrap();
        assert!(
            std::fs::symlink_metadata(s.join("data/d3/x3")).is_err(),
            "a whiteout of a path nothing below has"
        );
        assert!(s.join("data/d3/y").exists());
        use std::os::unix::fs::MetadataExt;
        let old = std::fs::symlink_metadata(s.join("etc/old")).unwrap();
        assert!(
            is_whiteout(old.mode(), old.rdev()),
            "the whiteout of etc/old hides the base's file"
        );
        assert_eq!((r.whiteouts, r.whiteouts_dropped), (1, 1), "{r:?}");
        same_views(&run, &s, &[l("base")], &[]);
        // Not knowing the layers below, every whiteout stays.
        let k = l("K");
        std::fs::create_dir(&k).unwrap();
        let r = flatten_layers(&run, &k, false).unwrap();
        assert_eq!((r.whiteouts, r.whiteouts_dropped), (2, 0), "{r:?}");
        assert!(std::fs::symlink_metadata(k.join("data/d3/x3")).is_ok());
    }

    #[test]
    fn a_squash_shows_exactly_what_the_run_showed_over_any_lower() {
        if !have_root("a_squash_shows_exactly_what_the_run_showed_over_any_lower") {
            return;
        }
        let t = tmp();
        let l = |n: &str| t.path().join(n);
        // Below the run: a base with content everywhere.
        write(&l("base"), "etc/a", b"base a\n", 0o644);
        write(&l("base"), "etc/b", b"base b\n", 0o644);
        write(&l("base"), "gone/x", b"x\n", 0o644);
        write(&l("base"), "replaced/y", b"y\n", 0o644);
        write(&l("base"), "recreated/z", b"z\n", 0o644);
        write(&l("base"), "kept/w", b"w\n", 0o644);
        // The run, oldest (r2) to newest (r0).
        write(&l("r2"), "etc/a", b"r2 a\n", 0o600);
        whiteout(&l("r2"), "etc/b");
        whiteout(&l("r2"), "gone");
        mkdir(&l("r2"), "replaced", 0o755);
        xattr::set(l("r2").join("replaced"), "trusted.overlay.opaque", b"y").unwrap();
        write(&l("r2"), "replaced/new", b"new\n", 0o644);
        whiteout(&l("r2"), "recreated");
        // r1: recreates `recreated` as a plain directory over the whiteout below it.
        write(&l("r1"), "recreated/fresh", b"fresh\n", 0o644);
        symlink(&l("r1"), "kept/link", b"../etc/a");
        fifo(&l("r1"), "kept/pipe", 0o640);
        write(&l("r1"), "etc/b", b"back\n", 0o644);
        // r0: deletes what r1 added, edits again.
        whiteout(&l("r0"), "kept/pipe");
        write(&l("r0"), "etc/a", b"r0 a\n", 0o644);
        xattr::set(l("r0").join("etc/a"), "user.note", b"1").unwrap();
        let run = vec![l("r0"), l("r1"), l("r2")];
        let s = l("S");
        std::fs::create_dir(&s).unwrap();
        let r = flatten_layers(&run, &s, false).unwrap();
        assert!(r.linked >= 4, "{r:?}");
        same_views(&run, &s, &[l("base")], &[]);
        same_views(&run, &s, &[], &[]);
        // A newer layer above the squash changes nothing either.
        write(&l("top"), "etc/a", b"top\n", 0o644);
        whiteout(&l("top"), "replaced");
        same_views(&run, &s, &[l("base")], &[l("top")]);
        // `recreated` merged with a whiteout inside the run: opaque in S, so the
        // base's z stays hidden.
        let v = LayerView::new(vec![s.clone(), l("base")]);
        assert!(v.lookup(b"recreated/z").unwrap().is_none());
        assert!(v.lookup(b"recreated/fresh").unwrap().is_some());
        assert!(v.lookup(b"gone/x").unwrap().is_none());
        assert!(
            v.lookup(b"kept/w").unwrap().is_some(),
            "an untouched lower file shows through"
        );
        assert!(v.lookup(b"kept/pipe").unwrap().is_none());
        // Files are hardlinks, not copies.
        use std::os::unix::fs::MetadataExt;
        assert_eq!(
            std::fs::metadata(s.join("etc/a")).unwrap().ino(),
            std::fs::metadata(l("r0").join("etc/a")).unwrap().ino()
        );
    }

    /// What one layer holds at a name of a tiny universe.
    #[derive(Debug, Clone)]
    enum Node {
        File(u8),
        Whiteout,
        Dir { opaque: bool },
        Link(u8),
    }

    const NAMES: [&str; 7] = ["a", "d", "d/a", "d/e", "d/e/f", "g", "g/h"];

    fn arb_layer() -> impl proptest::strategy::Strategy<Value = Vec<(usize, Node)>> {
        use proptest::prelude::*;
        let node = prop_oneof![
            (0u8..3).prop_map(Node::File),
            Just(Node::Whiteout),
            any::<bool>().prop_map(|opaque| Node::Dir { opaque }),
            (0u8..2).prop_map(Node::Link),
        ];
        prop::collection::vec((0..NAMES.len(), node), 0..6)
    }

    /// Builds a layer: entries whose parent is not a directory in this layer are
    /// skipped (a layer is a tree); parents are created as plain directories.
    fn build(dir: &Path, entries: &[(usize, Node)]) {
        std::fs::create_dir_all(dir).unwrap();
        for (i, node) in entries {
            let name = NAMES[*i];
            let p = dir.join(name);
            let blocked = p
                .ancestors()
                .skip(1)
                .take_while(|a| a.starts_with(dir) && *a != dir)
                .any(|a| std::fs::symlink_metadata(a).is_ok_and(|m| !m.is_dir()));
            if blocked {
                continue;
            }
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent).unwrap();
            }
            if std::fs::symlink_metadata(&p).is_ok() {
                continue;
            }
            match node {
                Node::File(c) => write(dir, name, &[b'0' + c, b'\n'], 0o644),
                Node::Whiteout => whiteout(dir, name),
                Node::Dir { opaque } => {
                    mkdir(dir, name, 0o755);
                    if *opaque {
                        xattr::set(&p, "trusted.overlay.opaque", b"y").unwrap();
                    }
                }
                Node::Link(t) => symlink(dir, name, format!("t{t}").as_bytes()),
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 200, .. Default::default() })]

        #[test]
        fn squash_matches_the_run_over_random_layers(
            base in arb_layer(),
            run in proptest::collection::vec(arb_layer(), 1..4),
            top in arb_layer(),
        ) {
            if !nix::unistd::geteuid().is_root() {
                assert!(std::env::var("CI").as_deref() != Ok("true"), "needs root under CI=true");
                return Ok(());
            }
            let t = tmp();
            build(&t.path().join("base"), &base);
            build(&t.path().join("top"), &top);
            let dirs: Vec<PathBuf> = run
                .iter()
                .enumerate()
                .map(|(i, l)| {
                    let d = t.path().join(format!("r{i}"));
                    build(&d, l);
                    d
                })
                .collect();
            let s = t.path().join("S");
            std::fs::create_dir(&s).unwrap();
            flatten_layers(&dirs, &s, false).unwrap();
            same_views(&dirs, &s, &[t.path().join("base")], &[t.path().join("top")]);
            same_views(&dirs, &s, &[t.path().join("base")], &[]);
        }
    }
}
