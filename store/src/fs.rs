//! Filesystem helpers: the supported-filesystem check and small durable-write
//! primitives (fsync of files and directories, recursive removal).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use nix::sys::statfs::{statfs, FsType, BTRFS_SUPER_MAGIC, EXT4_SUPER_MAGIC, XFS_SUPER_MAGIC};

/// Filesystems a store root may live on (ARCHITECTURE.md §2 "Store"): local ext4,
/// xfs or btrfs. SQLite's locking and overlayfs upper/work rules are only sound there.
const SUPPORTED: &[(FsType, &str)] = &[
    (EXT4_SUPER_MAGIC, "ext4"),
    (XFS_SUPER_MAGIC, "xfs"),
    (BTRFS_SUPER_MAGIC, "btrfs"),
];

/// Well-known names for filesystems we refuse, so the error says what was found.
fn fs_name(t: FsType) -> String {
    // Magic numbers from linux/magic.h.
    let known: &[(i64, &str)] = &[
        (0x0102_1994, "tmpfs"),
        (0x794c_7630, "overlayfs"),
        (0x6969, "nfs"),
        (0xff53_4d42, "cifs"),
        (0xfe53_4d42, "smb2"),
        (0x6573_5546, "fuse"),
        (0x9fa0, "proc"),
        (0x6265_6572, "sysfs"),
        (0x2fc1_2fc1, "zfs"),
        (0x0102_1997, "9p"),
        (0x5846_5342, "xfs"),
        (0xef53, "ext4"),
        (0x9123_683e, "btrfs"),
    ];
    #[allow(clippy::unnecessary_cast)]
    let raw = t.0 as i64;
    known
        .iter()
        .find(|(m, _)| *m == raw)
        .map(|(_, n)| (*n).to_string())
        .unwrap_or_else(|| format!("filesystem magic {raw:#x}"))
}

/// Result of [`check_supported_fs`]: `Err(name)` names the unsupported filesystem.
pub(crate) fn check_supported_fs(path: &Path) -> io::Result<Result<&'static str, String>> {
    // The root may not exist yet: check the nearest existing ancestor, and create
    // nothing before the check passes.
    let mut probe: PathBuf = path.to_path_buf();
    loop {
        match statfs(&probe) {
            Ok(st) => {
                let t = st.filesystem_type();
                return Ok(SUPPORTED
                    .iter()
                    .find(|(m, _)| *m == t)
                    .map(|(_, n)| *n)
                    .ok_or_else(|| fs_name(t)));
            }
            Err(nix::errno::Errno::ENOENT) => match probe.parent() {
                Some(p) if !p.as_os_str().is_empty() => probe = p.to_path_buf(),
                _ => return Err(io::Error::from(io::ErrorKind::NotFound)),
            },
            Err(e) => return Err(io::Error::from(e)),
        }
    }
}

/// fsync a directory so that renames and creations inside it are durable.
pub fn fsync_dir(path: &Path) -> io::Result<()> {
    fs::File::open(path)?.sync_all()
}

/// Remove a directory tree if it exists; missing is not an error.
///
/// overlayfs leaves `work/work` with mode 000; root removes it regardless.
pub fn remove_tree(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Create a directory with an explicit mode, whatever the process umask is
/// (containerd's snapshotter testsuite checks that an active snapshot's root is 0755).
pub fn mkdir_mode(path: &Path, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::create_dir(path)?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
}

/// Gives an empty session upper the mode, owner and xattrs of `top`, the root of
/// its topmost lower layer. In overlayfs the merged root is always the upper's
/// directory, so its metadata is what a container sees as `/`; without this every
/// container's `/` would be 0755 root:root without xattrs whatever the image says
/// (containerd's overlayfs snapshotter copies the parent's mode and owner to a new
/// upper the same way: `snapshots/overlay/overlay.go`, `createSnapshot`). An upper
/// that holds anything (a container ran in it) is left alone. Overlay-private
/// xattrs (`trusted.overlay.*`, `user.overlay.*`) are not copied; an xattr this
/// process may not set (e.g. a `security.*` name the LSM refuses) is skipped with
/// a warning rather than failing the mount — capture then reports `/` as
/// differing, and the publish resets it.
pub(crate) fn init_upper_root(upper: &Path, top: &Path) -> io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if fs::read_dir(upper)?.next().is_some() {
        return Ok(());
    }
    let md = fs::symlink_metadata(top)?;
    std::os::unix::fs::lchown(upper, Some(md.uid()), Some(md.gid()))?;
    // After chown, which may clear setgid.
    fs::set_permissions(upper, fs::Permissions::from_mode(md.mode() & 0o7777))?;
    let private = |n: &std::ffi::OsStr| {
        let n = n.as_encoded_bytes();
        n.starts_with(b"trusted.overlay.") || n.starts_with(b"user.overlay.")
    };
    let listed = |p: &Path| -> io::Result<Vec<std::ffi::OsString>> {
        match xattr::list(p) {
            Ok(names) => Ok(names.filter(|n| !private(n)).collect()),
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    };
    let wanted = listed(top)?;
    let skip = |what: &str, n: &std::ffi::OsStr, e: io::Error| -> io::Result<()> {
        match e.raw_os_error() {
            Some(libc::EPERM | libc::EACCES | libc::EOPNOTSUPP) => {
                tracing::warn!(upper = %upper.display(), xattr = ?n, error = %e, "cannot {what} an xattr of a new upper's root; left as is");
                Ok(())
            }
            _ => Err(e),
        }
    };
    for n in listed(upper)? {
        if !wanted.contains(&n) {
            xattr::remove(upper, &n).or_else(|e| skip("remove", &n, e))?;
        }
    }
    for n in &wanted {
        if let Some(v) = xattr::get(top, n)? {
            xattr::set(upper, n, &v).or_else(|e| skip("set", n, e))?;
        }
    }
    Ok(())
}

/// Walks the tree at `path` beneath it without following anything, calling `f`
/// with every entry's `lstat` (the root included).
///
/// The walk is fd-relative: every directory is opened with
/// `openat(O_DIRECTORY|O_NOFOLLOW)` relative to its parent and every entry is
/// `fstatat(AT_SYMLINK_NOFOLLOW)`-ed in it, so a container that swaps a
/// directory of its (possibly still mounted) upper for a symlink during the walk
/// can never steer it outside the tree (ARCHITECTURE.md §8). An entry that
/// vanishes meanwhile is skipped; a missing `path` is an empty tree.
fn walk_beneath(path: &Path, f: &mut dyn FnMut(&nix::sys::stat::FileStat)) -> io::Result<()> {
    use std::os::fd::AsRawFd;

    use nix::dir::Dir;
    use nix::fcntl::{AtFlags, OFlag};
    use nix::sys::stat::{fstat, fstatat, Mode};

    const DIR_FLAGS: OFlag = OFlag::O_RDONLY
        .union(OFlag::O_DIRECTORY)
        .union(OFlag::O_NOFOLLOW)
        .union(OFlag::O_CLOEXEC);
    let gone = |e: nix::errno::Errno| matches!(e, nix::errno::Errno::ENOENT);
    let top = match Dir::open(path, DIR_FLAGS, Mode::empty()) {
        Ok(d) => d,
        Err(nix::errno::Errno::ENOTDIR | nix::errno::Errno::ELOOP) => {
            let st = nix::sys::stat::lstat(path).map_err(io::Error::from)?;
            f(&st);
            return Ok(());
        }
        Err(e) if gone(e) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    f(&fstat(top.as_raw_fd()).map_err(io::Error::from)?);
    let mut stack = vec![top];
    while let Some(mut dir) = stack.pop() {
        let fd = dir.as_raw_fd();
        let mut subdirs = Vec::new();
        for ent in dir.iter() {
            let ent = ent.map_err(io::Error::from)?;
            let name = ent.file_name();
            if name.to_bytes() == b"." || name.to_bytes() == b".." {
                continue;
            }
            let st = match fstatat(Some(fd), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(e) if gone(e) => continue,
                Err(e) => return Err(e.into()),
            };
            f(&st);
            if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
                subdirs.push(name.to_owned());
            }
        }
        for name in subdirs {
            match Dir::openat(Some(fd), name.as_c_str(), DIR_FLAGS, Mode::empty()) {
                Ok(d) => stack.push(d),
                // Swapped for something else, or gone, since the stat: not ours to follow.
                Err(nix::errno::Errno::ENOTDIR | nix::errno::Errno::ELOOP) => {}
                Err(e) if gone(e) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}

#[allow(clippy::useless_conversion)]
fn inode_key(st: &nix::sys::stat::FileStat) -> (u64, u64) {
    (u64::from(st.st_dev), u64::from(st.st_ino))
}

#[allow(clippy::useless_conversion)]
fn blocks_bytes(st: &nix::sys::stat::FileStat) -> u64 {
    u64::try_from(i64::from(st.st_blocks)).unwrap_or(0) * 512
}

/// Real allocated bytes and inode count of a tree, without following symlinks;
/// hardlinked inodes are counted once. Shape: `(bytes, inodes)`. See
/// [`walk_beneath`] for how nothing is ever followed.
pub fn disk_usage(path: &Path) -> io::Result<(i64, i64)> {
    let mut seen = std::collections::HashSet::new();
    let (mut bytes, mut inodes) = (0u64, 0i64);
    walk_beneath(path, &mut |st| {
        if seen.insert(inode_key(st)) {
            inodes += 1;
            bytes += blocks_bytes(st);
        }
    })?;
    Ok((i64::try_from(bytes).unwrap_or(i64::MAX), inodes))
}

/// Real allocated bytes of the inodes of the tree at `path` that are not in
/// `seen` yet (they are added): accounting classes that share inodes (a squashed
/// layer hardlinks its members' files) count each inode once.
pub fn usage_once(
    path: &Path,
    seen: &mut std::collections::HashSet<(u64, u64)>,
) -> io::Result<u64> {
    let mut bytes = 0u64;
    walk_beneath(path, &mut |st| {
        if seen.insert(inode_key(st)) {
            bytes += blocks_bytes(st);
        }
    })?;
    Ok(bytes)
}

/// Real allocated bytes that removing the trees `dirs` frees: the blocks of
/// every inode all of whose links are inside them (an inode also linked from
/// elsewhere stays).
pub fn freed_bytes(dirs: &[std::path::PathBuf]) -> io::Result<u64> {
    let mut links: std::collections::HashMap<(u64, u64), (u64, u64, u64)> = Default::default();
    for d in dirs {
        walk_beneath(d, &mut |st| {
            // A directory cannot be hardlinked: its link count counts subdirectories.
            #[allow(clippy::useless_conversion)]
            let nlink = if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
                1
            } else {
                u64::from(st.st_nlink)
            };
            let e = links
                .entry(inode_key(st))
                .or_insert((0, nlink, blocks_bytes(st)));
            e.0 += 1;
        })?;
    }
    Ok(links
        .values()
        .filter(|(found, nlink, _)| found >= nlink || *nlink == 0)
        .map(|(_, _, b)| *b)
        .sum())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn disk_usage_counts_hardlinks_once_and_never_follows_symlinks() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("tree");
        fs::create_dir_all(root.join("a/b")).unwrap();
        fs::write(root.join("a/b/f"), vec![1u8; 8192]).unwrap();
        fs::hard_link(root.join("a/b/f"), root.join("a/g")).unwrap();
        // A big file outside, reachable only through symlinks.
        let outside = t.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("big"), vec![1u8; 1 << 20]).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("escape")).unwrap();
        std::os::unix::fs::symlink("/", root.join("a/root")).unwrap();
        let (bytes, inodes) = disk_usage(&root).unwrap();
        // tree, a, a/b, f (=g), escape, a/root
        assert_eq!(inodes, 6);
        assert!(bytes < 1 << 20, "followed a symlink: {bytes} bytes");
        assert!(bytes >= 8192, "{bytes}");
    }
}
