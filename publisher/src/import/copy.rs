//! A directory tree copied into the staged tree as it is, never following a
//! symlink in it: one open directory per level (`openat(O_DIRECTORY |
//! O_NOFOLLOW)`), `fstatat(AT_SYMLINK_NOFOLLOW)`, content through
//! `openat(O_NOFOLLOW)` and the metadata of what was opened. Kept: mode,
//! numeric owner, mtime, xattrs, symlinks (their targets verbatim), hardlinks
//! between names inside the tree (by device and inode), devices and fifos as
//! they are — what containerd's unpack of the same tree would make. Sockets
//! are skipped and counted (a tar, and so a layer, cannot hold one).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags, Stat};

use super::stage::{join, Meta, Special, Stage, StageError};
use super::ImportError;
use crate::capture::fd_xattrs;
use crate::export::WHITEOUT_PREFIX;
use crate::fsx;

const DIR: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

/// Copies the tree `source` (a directory; the path itself may be a symlink,
/// nothing below it is followed) into `stage`.
pub(crate) fn copy_tree(source: &Path, stage: &mut Stage) -> Result<(), ImportError> {
    let root = rfs::openat(
        rfs::CWD,
        source,
        DIR.difference(OFlags::NOFOLLOW),
        Mode::empty(),
    )
    .map(File::from)
    .map_err(|e| ImportError::Source {
        what: "the directory",
        path: source.to_path_buf(),
        source: e.into(),
    })?;
    let mut c = Copy {
        source,
        stage,
        links: HashMap::new(),
    };
    c.walk(&root, &[])
}

struct Copy<'a> {
    source: &'a Path,
    stage: &'a mut Stage,
    /// (device, inode) → the first path copied for it.
    links: HashMap<(u64, u64), Vec<u8>>,
}

impl Copy<'_> {
    fn read_err(&self, rel: &[u8]) -> impl FnOnce(io::Error) -> ImportError {
        let path = self.source.join(OsStr::from_bytes(rel));
        move |e| ImportError::Source {
            what: "the entry",
            path,
            source: e,
        }
    }

    fn errno(&self, rel: &[u8]) -> impl FnOnce(rustix::io::Errno) -> ImportError {
        let f = self.read_err(rel);
        move |e| f(e.into())
    }

    fn staged(&self, rel: &[u8]) -> impl FnOnce(StageError) -> ImportError {
        let origin = self.source.display().to_string();
        let staging = self.stage.root().to_path_buf();
        let entry = rel.to_vec();
        let source_path = self.source.join(OsStr::from_bytes(rel));
        move |e| match e {
            StageError::Refused(reason) => ImportError::Refused {
                origin,
                entry,
                reason,
            },
            StageError::Io(what, source) => ImportError::Staging {
                what,
                entry,
                staging,
                source,
            },
            StageError::Read(source) => ImportError::Source {
                what: "the entry",
                path: source_path,
                source,
            },
        }
    }

    fn walk(&mut self, dir: &File, rel: &[u8]) -> Result<(), ImportError> {
        let names = fsx::names_of(dir).map_err(self.read_err(rel))?;
        for name in names {
            let child = join(rel, &name);
            self.entry(dir, &name, &child)?;
        }
        Ok(())
    }

    fn entry(&mut self, dir: &File, name: &[u8], rel: &[u8]) -> Result<(), ImportError> {
        let n = OsStr::from_bytes(name);
        let st = rfs::statat(dir, n, AtFlags::SYMLINK_NOFOLLOW).map_err(self.errno(rel))?;
        let ft = FileType::from_raw_mode(st.st_mode);
        if ft == FileType::Socket {
            self.stage.report.sockets_skipped += 1;
            return Ok(());
        }
        if name.starts_with(WHITEOUT_PREFIX) {
            // Staged, it would be a plain entry of the base; written into a
            // layer tar (export, push, the base's digest) it would be read
            // as a whiteout or an opaque marker and take other entries along.
            return Err(self.staged(rel)(StageError::Refused(format!(
                "its name begins with {}, which an OCI layer tar reads as a whiteout or an opaque marker: exported or pushed, the base would lose it and what it names. Rename it, or give the base as a layer tar in which it is a whiteout",
                String::from_utf8_lossy(WHITEOUT_PREFIX)
            ))));
        }
        if ft == FileType::Directory {
            let sub = rfs::openat(dir, n, DIR, Mode::empty())
                .map(File::from)
                .map_err(self.errno(rel))?;
            let st = rfs::fstat(&sub).map_err(self.errno(rel))?;
            let xattrs = fd_xattrs(&sub).map_err(self.read_err(rel))?;
            self.stage
                .dir(rel, &meta_of(&st, xattrs))
                .map_err(self.staged(rel))?;
            return self.walk(&sub, rel);
        }
        if st.st_nlink > 1 {
            let key = (st.st_dev, st.st_ino);
            if let Some(first) = self.links.get(&key).cloned() {
                return self
                    .stage
                    .hardlink(rel, &first, &Default::default())
                    .map_err(self.staged(rel));
            }
            self.links.insert(key, rel.to_vec());
        }
        match ft {
            FileType::RegularFile => {
                let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NOCTTY;
                let mut f = rfs::openat(dir, n, flags, Mode::empty())
                    .map(File::from)
                    .map_err(self.errno(rel))?;
                let st = rfs::fstat(&f).map_err(self.errno(rel))?;
                let xattrs = fd_xattrs(&f).map_err(self.read_err(rel))?;
                self.stage
                    .file(rel, &meta_of(&st, xattrs), &mut f)
                    .map_err(self.staged(rel))?;
            }
            FileType::Symlink => {
                let target = rfs::readlinkat(dir, n, Vec::new()).map_err(self.errno(rel))?;
                let xattrs =
                    fsx::xattrs_of(&fsx::proc_path(dir, name)).map_err(self.read_err(rel))?;
                self.stage
                    .symlink(rel, target.as_bytes(), &meta_of(&st, xattrs))
                    .map_err(self.staged(rel))?;
            }
            FileType::CharacterDevice | FileType::BlockDevice | FileType::Fifo => {
                let xattrs =
                    fsx::xattrs_of(&fsx::proc_path(dir, name)).map_err(self.read_err(rel))?;
                let (ma, mi) = (rfs::major(st.st_rdev), rfs::minor(st.st_rdev));
                let kind = match ft {
                    FileType::CharacterDevice => Special::Char(ma, mi),
                    FileType::BlockDevice => Special::Block(ma, mi),
                    _ => Special::Fifo,
                };
                self.stage
                    .special(rel, kind, &meta_of(&st, xattrs))
                    .map_err(self.staged(rel))?;
            }
            other => {
                return Err(self.staged(rel)(StageError::Refused(format!(
                    "its file type {other:?} is unknown"
                ))))
            }
        }
        Ok(())
    }
}

fn meta_of(st: &Stat, xattrs: Vec<(Vec<u8>, Vec<u8>)>) -> Meta {
    Meta {
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        mtime: st.st_mtime,
        xattrs,
    }
}
