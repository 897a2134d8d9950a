//! Filesystem helpers: mounting what a snapshotter returns (as a runtime
//! would), allocated bytes on disk, reading a whole tree, choosing files.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use containerd_client::types::Mount;
use nix::mount::{mount, umount2, MntFlags, MsFlags};

/// Linux page size: the limit of mount(2)'s data (ARCHITECTURE.md §5).
const PAGE: usize = 4096;

fn flag(opt: &str) -> Option<(MsFlags, bool)> {
    // (flag, clear) as containerd's mount_linux.go parses them.
    Some(match opt {
        "ro" => (MsFlags::MS_RDONLY, false),
        "rw" => (MsFlags::MS_RDONLY, true),
        "bind" => (MsFlags::MS_BIND, false),
        "rbind" => (MsFlags::MS_BIND | MsFlags::MS_REC, false),
        "nosuid" => (MsFlags::MS_NOSUID, false),
        "suid" => (MsFlags::MS_NOSUID, true),
        "nodev" => (MsFlags::MS_NODEV, false),
        "dev" => (MsFlags::MS_NODEV, true),
        "noexec" => (MsFlags::MS_NOEXEC, false),
        "exec" => (MsFlags::MS_NOEXEC, true),
        "noatime" => (MsFlags::MS_NOATIME, false),
        "relatime" => (MsFlags::MS_RELATIME, false),
        "sync" => (MsFlags::MS_SYNCHRONOUS, false),
        "private" | "rprivate" | "shared" | "rshared" | "slave" | "rslave" => return None,
        _ => return None,
    })
}

/// Splits containerd mount options into mount(2) flags and the data string.
pub fn parse_options(options: &[String]) -> (MsFlags, String) {
    let mut flags = MsFlags::empty();
    let mut data = Vec::new();
    for o in options {
        match flag(o) {
            Some((f, true)) => flags.remove(f),
            Some((f, false)) => flags.insert(f),
            None if matches!(
                o.as_str(),
                "private" | "rprivate" | "shared" | "rshared" | "slave" | "rslave"
            ) => {}
            None => data.push(o.as_str()),
        }
    }
    (flags, data.join(","))
}

/// The directory every lowerdir of an overlay `data` string starts with, and the
/// data string with the lowerdirs relative to it (containerd's
/// `compactLowerdirOption`): for mounts whose data is over one page.
fn compact_lowerdirs(data: &str) -> Option<(PathBuf, String)> {
    let opts: Vec<&str> = data.split(',').collect();
    let lower = opts.iter().find_map(|o| o.strip_prefix("lowerdir="))?;
    let dirs: Vec<&str> = lower.split(':').collect();
    if dirs.len() < 2 {
        return None;
    }
    // Longest common prefix ending in '/'.
    let first = dirs[0];
    let mut end = first.len();
    for d in &dirs[1..] {
        end = end.min(
            first
                .bytes()
                .zip(d.bytes())
                .take_while(|(a, b)| a == b)
                .count(),
        );
    }
    let prefix = &first[..end];
    let cut = prefix.rfind('/')? + 1;
    if cut <= 1 {
        return None;
    }
    let base = &first[..cut];
    let rel: Vec<&str> = dirs.iter().map(|d| &d[cut..]).collect();
    let out: Vec<String> = opts
        .iter()
        .map(|o| {
            if o.starts_with("lowerdir=") {
                format!("lowerdir={}", rel.join(":"))
            } else {
                o.to_string()
            }
        })
        .collect();
    Some((PathBuf::from(base), out.join(",")))
}

/// Mounts what a snapshotter returned at `target` (created if missing), as
/// containerd's mount helper would: overlay with its options as data (lowerdirs
/// made relative to their common directory when the data exceeds a page; the
/// mount then runs on a thread with its own working directory), bind mounts
/// with `MS_BIND`.
pub fn mount_all(mounts: &[Mount], target: &Path) -> Result<()> {
    fs::create_dir_all(target).with_context(|| format!("creating {}", target.display()))?;
    if mounts.len() != 1 {
        bail!("expected one mount, got {mounts:?}");
    }
    let m = &mounts[0];
    let (flags, data) = parse_options(&m.options);
    match m.r#type.as_str() {
        "bind" | "rbind" => {
            let mut f = flags | MsFlags::MS_BIND;
            if m.r#type == "rbind" {
                f |= MsFlags::MS_REC;
            }
            mount(
                Some(m.source.as_str()),
                target,
                None::<&str>,
                f - MsFlags::MS_RDONLY,
                None::<&str>,
            )
            .with_context(|| format!("bind mount {} on {}", m.source, target.display()))?;
            if f.contains(MsFlags::MS_RDONLY) {
                mount(
                    None::<&str>,
                    target,
                    None::<&str>,
                    f | MsFlags::MS_REMOUNT,
                    None::<&str>,
                )
                .context("read-only remount")?;
            }
        }
        "overlay" => {
            if data.len() < PAGE - 1 {
                mount(
                    Some("overlay"),
                    target,
                    Some("overlay"),
                    flags,
                    Some(data.as_str()),
                )
                .with_context(|| {
                    format!(
                        "overlay mount on {} ({} bytes of data)",
                        target.display(),
                        data.len()
                    )
                })?;
            } else {
                let (dir, short) = compact_lowerdirs(&data).with_context(|| {
                    format!(
                        "overlay data is {} bytes and cannot be compacted",
                        data.len()
                    )
                })?;
                if short.len() >= PAGE - 1 {
                    bail!(
                        "overlay data is {} bytes even with relative lowerdirs",
                        short.len()
                    );
                }
                let target = target.to_path_buf();
                std::thread::spawn(move || -> Result<()> {
                    // A private fs context for this thread only: chdir does not
                    // move the rest of the process.
                    nix::sched::unshare(nix::sched::CloneFlags::CLONE_FS)
                        .context("unshare(CLONE_FS)")?;
                    nix::unistd::chdir(&dir).with_context(|| format!("chdir {}", dir.display()))?;
                    mount(
                        Some("overlay"),
                        &target,
                        Some("overlay"),
                        flags,
                        Some(short.as_str()),
                    )
                    .with_context(|| {
                        format!("overlay mount on {} (relative lowerdirs)", target.display())
                    })?;
                    Ok(())
                })
                .join()
                .map_err(|_| anyhow::anyhow!("mount thread panicked"))??;
            }
        }
        t => bail!("mount type {t} not supported here"),
    }
    Ok(())
}

/// Unmounts `target`; retries EBUSY for a second (a forked child may briefly
/// hold it), then detaches.
pub fn unmount(target: &Path) -> Result<()> {
    for _ in 0..50 {
        match umount2(target, MntFlags::empty()) {
            Ok(()) => return Ok(()),
            Err(nix::errno::Errno::EBUSY) => std::thread::sleep(Duration::from_millis(20)),
            Err(nix::errno::Errno::EINVAL) => return Ok(()), // not mounted
            Err(e) => return Err(e).with_context(|| format!("umount {}", target.display())),
        }
    }
    umount2(target, MntFlags::MNT_DETACH).with_context(|| format!("umount -l {}", target.display()))
}

/// Allocated bytes (`st_blocks × 512`) of everything below `paths`, hardlinked
/// files counted once, without crossing into other filesystems (mounts below).
pub fn disk_usage(paths: &[PathBuf]) -> Result<u64> {
    let mut seen = HashSet::new();
    let mut total = 0u64;
    for p in paths {
        let Ok(md) = fs::symlink_metadata(p) else {
            continue;
        };
        let dev = md.dev();
        let mut stack = vec![p.clone()];
        while let Some(path) = stack.pop() {
            let Ok(md) = fs::symlink_metadata(&path) else {
                continue; // removed meanwhile
            };
            if md.dev() != dev {
                continue;
            }
            if md.nlink() > 1 && !md.is_dir() && !seen.insert((md.dev(), md.ino())) {
                continue;
            }
            total += md.blocks() * 512;
            if md.is_dir() {
                if let Ok(rd) = fs::read_dir(&path) {
                    stack.extend(rd.flatten().map(|e| e.path()));
                }
            }
        }
    }
    Ok(total)
}

/// What [`read_tree`] read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TreeRead {
    pub files: u64,
    pub dirs: u64,
    pub bytes: u64,
}

/// `find` + read every file: walks `root` without following symlinks, reads
/// every regular file to its end.
pub fn read_tree(root: &Path) -> Result<TreeRead> {
    let mut r = TreeRead::default();
    let mut buf = vec![0u8; 256 * 1024];
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        r.dirs += 1;
        for e in fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
            let e = e?;
            let ft = e.file_type()?;
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file() {
                let mut f = fs::File::open(e.path())
                    .with_context(|| format!("opening {}", e.path().display()))?;
                loop {
                    let n = f.read(&mut buf)?;
                    if n == 0 {
                        break;
                    }
                    r.bytes += n as u64;
                }
                r.files += 1;
            }
        }
    }
    Ok(r)
}

/// Relative paths of the regular files below `root` (sorted walk), at most
/// `limit` of them, spread evenly over the whole tree.
pub fn pick_files(root: &Path, rel_dir: &Path, limit: usize) -> Result<Vec<PathBuf>> {
    let mut all = Vec::new();
    let mut stack = vec![rel_dir.to_path_buf()];
    while let Some(rel) = stack.pop() {
        let mut entries: Vec<(OsString, fs::FileType)> = fs::read_dir(root.join(&rel))
            .with_context(|| format!("reading {}", root.join(&rel).display()))?
            .map(|e| e.and_then(|e| Ok((e.file_name(), e.file_type()?))))
            .collect::<Result<_, _>>()?;
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, ft) in entries.into_iter().rev() {
            if ft.is_dir() {
                stack.push(rel.join(&name));
            } else if ft.is_file() {
                all.push(rel.join(&name));
            }
        }
    }
    all.sort();
    if all.len() <= limit {
        return Ok(all);
    }
    let step = all.len() as f64 / limit as f64;
    Ok((0..limit)
        .map(|i| all[(i as f64 * step) as usize].clone())
        .collect())
}

/// Appends one line to each of `files` (relative to `root`): a content change
/// that needs a copy-up on an overlay.
pub fn append_line(root: &Path, files: &[PathBuf], line: &str) -> Result<()> {
    for f in files {
        let p = root.join(f);
        let mut h = fs::OpenOptions::new()
            .append(true)
            .open(&p)
            .with_context(|| format!("opening {}", p.display()))?;
        h.write_all(line.as_bytes())?;
    }
    Ok(())
}

/// Writes a file of `size` bytes (a repeated pseudo-random MiB, nothing sparse).
pub fn write_big_file(path: &Path, size: u64) -> Result<()> {
    let mut chunk = vec![0u8; 1 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for b in chunk.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let mut f = fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut left = size;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    Ok(())
}

/// `syncfs` of the filesystem holding `path`.
pub fn syncfs(path: &Path) -> Result<()> {
    let f = fs::File::open(path)?;
    nix::unistd::syncfs(std::os::fd::AsRawFd::as_raw_fd(&f)).context("syncfs")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_split_into_flags_and_data() {
        let (f, d) = parse_options(&[
            "index=off".into(),
            "rw".into(),
            "lowerdir=/a:/b".into(),
            "nosuid".into(),
        ]);
        assert_eq!(f, MsFlags::MS_NOSUID);
        assert_eq!(d, "index=off,lowerdir=/a:/b");
    }

    #[test]
    fn long_lowerdirs_become_relative() {
        let (dir, data) =
            compact_lowerdirs("index=off,lowerdir=/s/l/12:/s/l/3:/s/l/400,upperdir=/s/u").unwrap();
        assert_eq!(dir, PathBuf::from("/s/l/"));
        assert_eq!(data, "index=off,lowerdir=12:3:400,upperdir=/s/u");
        assert!(compact_lowerdirs("lowerdir=/only").is_none());
    }

    #[test]
    fn usage_counts_hardlinks_once_and_files_are_read() {
        let d = std::env::temp_dir().join(format!("lsb-fs-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(d.join("x/y")).unwrap();
        write_big_file(&d.join("x/y/big"), 3 << 20).unwrap();
        fs::hard_link(d.join("x/y/big"), d.join("x/link")).unwrap();
        fs::write(d.join("x/small"), b"hi").unwrap();
        let u = disk_usage(std::slice::from_ref(&d)).unwrap();
        assert!((3 << 20..4 << 20).contains(&u), "{u}");
        let r = read_tree(&d).unwrap();
        assert_eq!((r.files, r.bytes), (3, (6 << 20) + 2));
        let picked = pick_files(&d, Path::new(""), 2).unwrap();
        assert_eq!(picked.len(), 2);
        append_line(&d, &picked, "more\n").unwrap();
        // "x/link" and "x/small"; the link grows "x/y/big" too.
        assert_eq!(read_tree(&d).unwrap().bytes, (6 << 20) + 2 + 15);
        fs::remove_dir_all(&d).unwrap();
    }
}
