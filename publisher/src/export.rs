//! One layer directory as an OCI layer tar (OCI image-spec `layer.md`,
//! "Representing Changes" and "Whiteouts").
//!
//! A layer (base, published or squashed) is stored in overlay upper format;
//! [`write_layer_tar`] turns it into the changeset tar an OCI layout carries:
//!
//! * a 0:0 character device (an overlayfs whiteout) becomes an empty regular file
//!   `.wh.<name>` in its directory;
//! * a directory whose `trusted.overlay.opaque` (`user.overlay.opaque` with
//!   `userxattr`) is `y` is followed by the entry `<dir>/.wh..wh..opq`;
//! * a file with more than one link inside the layer is written once, the other
//!   names as tar hardlinks to the first (byte order); links to inodes outside
//!   the layer (a squash links its members' files) are ordinary files;
//! * every xattr but the overlay's private ones (`trusted.overlay.*`,
//!   `user.overlay.*` with `userxattr`) is kept as a PAX record
//!   `SCHILY.xattr.<name>` (what containerd's and Go's `archive/tar` read);
//! * a path or link target longer than 100 bytes or not plain ASCII, an owner id
//!   above the ustar limit (2^21 − 1) and a size of 8 GiB or more are PAX records
//!   (`path`, `linkpath`, `uid`, `gid`, `size`; values are the raw bytes, as
//!   `archive/tar` reads them), so names are never converted through UTF-8.
//!
//! The root directory's own entry is not written (its metadata is never
//! published). Sockets are skipped and counted. Entries come in byte order of
//! their names, directories before what they hold, with mode, owner, mtime
//! (seconds) and nothing else (no atime, ctime, user or group names), so the
//! same layer always gives the same bytes — and so the same digests.
//!
//! The layer is read with fd-relative, no-follow calls only
//! (`openat(O_DIRECTORY|O_NOFOLLOW)` per directory, `fstatat(AT_SYMLINK_NOFOLLOW)`,
//! `openat(O_NOFOLLOW)` for content, `readlinkat`, `l*xattr` through the parent's
//! descriptor): nothing a container wrote into a layer can steer the read to a
//! host path (ARCHITECTURE.md §8).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{fstatat, Mode};
use tar::{EntryType, Header};

use crate::capture::{fd_xattrs, is_overlay_private, FileFd};
use crate::fsx::{self, DirFd};
use crate::view::{is_whiteout, opaque_name};

/// The OCI whiteout prefix (image-spec `layer.md`).
pub const WHITEOUT_PREFIX: &[u8] = b".wh.";
/// The OCI opaque-directory marker's name.
pub const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";

/// Options of [`write_layer_tar`].
#[derive(Debug, Clone, Copy, Default)]
pub struct TarOptions {
    /// The layer marks opaque directories with `user.overlay.opaque` (rootless
    /// overlay) rather than `trusted.overlay.opaque`.
    pub userxattr: bool,
}

/// What [`write_layer_tar`] wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TarReport {
    /// Entries written (whiteouts and opaque markers included).
    pub entries: u64,
    /// Bytes of file content written.
    pub content_bytes: u64,
    /// `.wh.<name>` entries.
    pub whiteouts: u64,
    /// `.wh..wh..opq` entries.
    pub opaque: u64,
    /// Tar hardlink entries.
    pub hardlinks: u64,
    /// Sockets skipped (a tar cannot hold one).
    pub sockets_skipped: u64,
}

/// Why [`write_layer_tar`] failed; `path` is relative to the layer.
#[derive(Debug, thiserror::Error)]
#[error("cannot {what} {}layer {}", if path.as_os_str().is_empty() { String::new() } else { format!("{} of ", path.display()) }, .layer.display())]
pub struct TarError {
    /// What was being done.
    pub what: &'static str,
    /// The layer directory.
    pub layer: PathBuf,
    /// The path inside it (empty: the layer itself).
    pub path: PathBuf,
    /// The system call error.
    #[source]
    pub source: io::Error,
}

/// [`TarError::what`] of a file whose name OCI reserves (`.wh.` prefix).
const RESERVED_NAME: &str = "export";

impl TarError {
    /// Whether the layer holds a file named with the OCI whiteout prefix
    /// (`.wh.`), which no OCI layer can carry as a file: the layer's content,
    /// not an I/O failure, is what stops the export.
    #[must_use]
    pub fn is_reserved_name(&self) -> bool {
        self.what == RESERVED_NAME && self.source.kind() == io::ErrorKind::InvalidData
    }
}

/// The ustar limit of the 8-byte octal uid and gid fields.
const MAX_USTAR_ID: u64 = 0o7_777_777;
/// The ustar limit of the 12-byte octal size field.
const MAX_USTAR_SIZE: u64 = 0o77_777_777_777;

/// Writes the layer directory `layer` as an OCI layer tar into `out` (see the
/// module docs) and finishes the archive; returns `out`.
///
/// # Errors
/// [`TarError`] naming the path that could not be read, or the write that failed.
pub fn write_layer_tar<W: Write>(
    layer: &Path,
    out: W,
    options: &TarOptions,
) -> Result<(W, TarReport), TarError> {
    let mut w = Writer {
        layer,
        tar: tar::Builder::new(out),
        options: *options,
        links: HashMap::new(),
        report: TarReport::default(),
    };
    let root = fsx::open_dir(layer).map_err(w.err("open", b""))?;
    let mut rel = Vec::new();
    w.walk(&root, &mut rel)?;
    let report = std::mem::take(&mut w.report);
    let finish = w.err("finish the tar of", b"");
    let out = w.tar.into_inner().map_err(finish)?;
    Ok((out, report))
}

struct Writer<'a, W: Write> {
    layer: &'a Path,
    tar: tar::Builder<W>,
    options: TarOptions,
    /// (device, inode) → the first path written for it.
    links: HashMap<(u64, u64), Vec<u8>>,
    report: TarReport,
}

impl<W: Write> Writer<'_, W> {
    fn err<'b>(
        &self,
        what: &'static str,
        rel: &'b [u8],
    ) -> impl FnOnce(io::Error) -> TarError + 'b {
        let layer = self.layer.to_path_buf();
        move |source| TarError {
            what,
            layer,
            path: PathBuf::from(std::ffi::OsStr::from_bytes(rel)),
            source,
        }
    }

    /// Writes the entries of directory `dir` (open at `rel`).
    fn walk(&mut self, dir: &DirFd, rel: &mut Vec<u8>) -> Result<(), TarError> {
        let names = fsx::names_of(dir).map_err(self.err("read directory", rel))?;
        for name in names {
            let len = rel.len();
            if !rel.is_empty() {
                rel.push(b'/');
            }
            rel.extend_from_slice(&name);
            let r = self.entry(dir, &name, rel);
            rel.truncate(len);
            r?;
        }
        Ok(())
    }

    /// Writes the entry `name` of `dir` (its path `rel`), and below it.
    fn entry(&mut self, dir: &DirFd, name: &[u8], rel: &mut Vec<u8>) -> Result<(), TarError> {
        let st = fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(|e| self.err("stat", rel)(e.into()))?;
        let mode = st.st_mode;
        let fmt = mode & libc::S_IFMT;
        let mut h = Header::new_ustar();
        h.set_mode(mode & 0o7777);
        h.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
        let mut pax = Pax::default();
        pax.ids(&mut h, u64::from(st.st_uid), u64::from(st.st_gid));
        if is_whiteout(mode, st.st_rdev) {
            let (parent, base) = fsx::split_parent(rel);
            let mut wh = parent.to_vec();
            if !wh.is_empty() {
                wh.push(b'/');
            }
            wh.extend_from_slice(WHITEOUT_PREFIX);
            wh.extend_from_slice(base);
            h.set_mode(0o644);
            h.set_entry_type(EntryType::Regular);
            h.set_size(0);
            pax.path(&mut h, &wh);
            self.append(&pax, &mut h, io::empty(), rel)?;
            self.report.whiteouts += 1;
            return Ok(());
        }
        if name.starts_with(WHITEOUT_PREFIX) {
            // A file a container made under this name (the kernel's overlay
            // gives `.wh.` no meaning): as a tar entry it would be read as a
            // whiteout or an opaque marker by whoever applies the layer.
            let (_, base) = fsx::split_parent(rel);
            let hidden = String::from_utf8_lossy(&base[WHITEOUT_PREFIX.len()..]).into_owned();
            return Err(self.err(RESERVED_NAME, rel)(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "its name begins with `.wh.`, which OCI layers reserve for whiteouts (image-spec layer.md): as a tar entry it would delete `{hidden}` (or mark its directory opaque) wherever the layer is applied; rename or remove it in a session, publish, and export again"
                ),
            )));
        }
        match fmt {
            libc::S_IFDIR => {
                let sub = fsx::open_dir_at(dir, name).map_err(self.err("open directory", rel))?;
                let xattrs = fd_xattrs(&sub).map_err(self.err("read xattrs of", rel))?;
                let opaque_key = opaque_name(self.options.userxattr).as_bytes();
                let opaque = xattrs
                    .iter()
                    .any(|(n, v)| n.as_slice() == opaque_key && v.as_slice() == b"y");
                self.xattrs(&mut pax, &xattrs, rel)?;
                let mut p = rel.clone();
                p.push(b'/');
                h.set_entry_type(EntryType::Directory);
                h.set_size(0);
                pax.path(&mut h, &p);
                self.append(&pax, &mut h, io::empty(), rel)?;
                if opaque {
                    let mut m = rel.clone();
                    m.push(b'/');
                    m.extend_from_slice(OPAQUE_MARKER);
                    let mut mh = Header::new_ustar();
                    mh.set_mode(0o644);
                    mh.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
                    mh.set_entry_type(EntryType::Regular);
                    mh.set_size(0);
                    let mut mp = Pax::default();
                    mp.ids(&mut mh, 0, 0);
                    mp.path(&mut mh, &m);
                    self.append(&mp, &mut mh, io::empty(), rel)?;
                    self.report.opaque += 1;
                }
                self.walk(&sub, rel)
            }
            libc::S_IFSOCK => {
                self.report.sockets_skipped += 1;
                Ok(())
            }
            _ => {
                pax.path(&mut h, rel);
                if st.st_nlink > 1 {
                    let key = (st.st_dev, st.st_ino);
                    if let Some(first) = self.links.get(&key).cloned() {
                        h.set_entry_type(EntryType::Link);
                        h.set_size(0);
                        pax.link(&mut h, &first);
                        self.append(&pax, &mut h, io::empty(), rel)?;
                        self.report.hardlinks += 1;
                        return Ok(());
                    }
                    self.links.insert(key, rel.clone());
                }
                match fmt {
                    libc::S_IFREG => {
                        let flags = OFlag::O_RDONLY
                            | OFlag::O_NOFOLLOW
                            | OFlag::O_CLOEXEC
                            | OFlag::O_NOCTTY;
                        let fd =
                            nix::fcntl::openat(Some(dir.as_raw_fd()), name, flags, Mode::empty())
                                .map(FileFd)
                                .map_err(|e| self.err("open", rel)(e.into()))?;
                        let xattrs = fd_xattrs(&fd).map_err(self.err("read xattrs of", rel))?;
                        self.xattrs(&mut pax, &xattrs, rel)?;
                        let size = u64::try_from(st.st_size).unwrap_or(0);
                        h.set_entry_type(EntryType::Regular);
                        pax.size(&mut h, size);
                        // Exactly `size` bytes: a file that changed size under us
                        // (it cannot: layers are immutable) would fail the read.
                        let data = Exact {
                            inner: fd,
                            left: size,
                        };
                        self.append(&pax, &mut h, data, rel)?;
                        self.report.content_bytes += size;
                        Ok(())
                    }
                    libc::S_IFLNK => {
                        let target = nix::fcntl::readlinkat(Some(dir.as_raw_fd()), name)
                            .map_err(|e| self.err("read link", rel)(e.into()))?
                            .into_vec();
                        let xattrs = fsx::xattrs_of(&fsx::proc_path(dir, name))
                            .map_err(self.err("read xattrs of", rel))?;
                        self.xattrs(&mut pax, &xattrs, rel)?;
                        h.set_entry_type(EntryType::Symlink);
                        h.set_size(0);
                        pax.link(&mut h, &target);
                        self.append(&pax, &mut h, io::empty(), rel)
                    }
                    libc::S_IFIFO | libc::S_IFCHR | libc::S_IFBLK => {
                        let xattrs = fsx::xattrs_of(&fsx::proc_path(dir, name))
                            .map_err(self.err("read xattrs of", rel))?;
                        self.xattrs(&mut pax, &xattrs, rel)?;
                        h.set_entry_type(match fmt {
                            libc::S_IFIFO => EntryType::Fifo,
                            libc::S_IFCHR => EntryType::Char,
                            _ => EntryType::Block,
                        });
                        h.set_size(0);
                        if fmt != libc::S_IFIFO {
                            let (major, minor) = (libc::major(st.st_rdev), libc::minor(st.st_rdev));
                            h.set_device_major(major)
                                .and_then(|()| h.set_device_minor(minor))
                                .map_err(self.err("write device numbers of", rel))?;
                        }
                        self.append(&pax, &mut h, io::empty(), rel)
                    }
                    _ => Err(self.err("export", rel)(io::Error::other(format!(
                        "unknown file type {fmt:#o}"
                    )))),
                }
            }
        }
    }

    /// Adds the exportable xattrs of `rel` to `pax`.
    fn xattrs(
        &self,
        pax: &mut Pax,
        list: &[(Vec<u8>, Vec<u8>)],
        rel: &[u8],
    ) -> Result<(), TarError> {
        for (name, value) in list {
            if is_overlay_private(name, self.options.userxattr) {
                continue;
            }
            // PAX keywords are UTF-8 (POSIX pax "keyword"); xattr names are
            // ASCII in every namespace the kernel knows.
            let name = std::str::from_utf8(name).map_err(|_| {
                self.err("export", rel)(io::Error::other(format!(
                    "xattr name {} is not UTF-8 and cannot be a PAX keyword",
                    String::from_utf8_lossy(name)
                )))
            })?;
            pax.record(&format!("SCHILY.xattr.{name}"), value);
        }
        Ok(())
    }

    /// Appends the PAX header (if any) and the entry.
    fn append(
        &mut self,
        pax: &Pax,
        h: &mut Header,
        data: impl Read,
        rel: &[u8],
    ) -> Result<(), TarError> {
        if !pax.0.is_empty() {
            let mut ph = Header::new_ustar();
            let name = b"PaxHeader";
            if let Some(u) = ph.as_ustar_mut() {
                u.name[..name.len()].copy_from_slice(name);
            }
            ph.set_entry_type(EntryType::XHeader);
            ph.set_mode(0o644);
            ph.set_size(pax.0.len() as u64);
            ph.set_cksum();
            self.tar
                .append(&ph, pax.0.as_slice())
                .map_err(self.err("write", rel))?;
            self.report.entries += 1;
        }
        h.set_cksum();
        self.tar.append(h, data).map_err(self.err("write", rel))?;
        self.report.entries += 1;
        Ok(())
    }
}

/// PAX extended-header records of one entry (POSIX `pax`, "extended header").
#[derive(Default)]
struct Pax(Vec<u8>);

impl Pax {
    /// One record `"<len> <key>=<value>\n"`; `len` counts the whole record.
    fn record(&mut self, key: &str, value: &[u8]) {
        let body = key.len() + value.len() + 3; // ' ', '=', '\n'
        let mut len = body + 1;
        while len != body + len.to_string().len() {
            len = body + len.to_string().len();
        }
        self.0.extend_from_slice(len.to_string().as_bytes());
        self.0.push(b' ');
        self.0.extend_from_slice(key.as_bytes());
        self.0.push(b'=');
        self.0.extend_from_slice(value);
        self.0.push(b'\n');
    }

    /// The entry's name: in the header when it fits (≤ 100 bytes, ASCII without
    /// NUL), else a PAX `path` record and a truncated header name.
    fn path(&mut self, h: &mut Header, p: &[u8]) {
        if !fits(p) {
            self.record("path", p);
        }
        if let Some(u) = h.as_ustar_mut() {
            let n = p.len().min(u.name.len());
            u.name[..n].copy_from_slice(&p[..n]);
        }
    }

    /// A symlink's target or a hardlink's first name, as [`Pax::path`].
    fn link(&mut self, h: &mut Header, p: &[u8]) {
        if !fits(p) {
            self.record("linkpath", p);
        }
        if let Some(u) = h.as_ustar_mut() {
            let n = p.len().min(u.linkname.len());
            u.linkname[..n].copy_from_slice(&p[..n]);
        }
    }

    fn ids(&mut self, h: &mut Header, uid: u64, gid: u64) {
        if uid > MAX_USTAR_ID {
            self.record("uid", uid.to_string().as_bytes());
            h.set_uid(0);
        } else {
            h.set_uid(uid);
        }
        if gid > MAX_USTAR_ID {
            self.record("gid", gid.to_string().as_bytes());
            h.set_gid(0);
        } else {
            h.set_gid(gid);
        }
    }

    fn size(&mut self, h: &mut Header, size: u64) {
        if size > MAX_USTAR_SIZE {
            self.record("size", size.to_string().as_bytes());
        }
        h.set_size(size);
    }
}

/// True when `p` fits a ustar name field as is.
fn fits(p: &[u8]) -> bool {
    p.len() <= 100 && p.iter().all(|&b| b != 0 && b.is_ascii())
}

/// Reads exactly `left` bytes of `inner`: fewer is an error (the file shrank),
/// more are not read.
struct Exact<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            return Ok(0);
        }
        let max = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..max])?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the file shrank while it was exported",
            ));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::{symlink, MetadataExt};

    /// (path, type, link name, content, xattrs) of one archive entry.
    type Listed = (Vec<u8>, EntryType, Vec<u8>, Vec<u8>, Vec<(String, Vec<u8>)>);

    fn entries(bytes: &[u8]) -> Vec<Listed> {
        let mut a = tar::Archive::new(bytes);
        let mut out = Vec::new();
        for e in a.entries().unwrap() {
            let mut e = e.unwrap();
            let path = e.path_bytes().into_owned();
            let ty = e.header().entry_type();
            let link = e
                .link_name_bytes()
                .map(|l| l.into_owned())
                .unwrap_or_default();
            let mut x = Vec::new();
            if let Some(p) = e.pax_extensions().unwrap() {
                for r in p {
                    let r = r.unwrap();
                    if let Some(n) = r.key().unwrap().strip_prefix("SCHILY.xattr.") {
                        x.push((n.to_string(), r.value_bytes().to_vec()));
                    }
                }
            }
            let mut data = Vec::new();
            e.read_to_end(&mut data).unwrap();
            out.push((path, ty, link, data, x));
        }
        out
    }

    #[test]
    fn names_links_and_order_survive_a_round_trip() {
        let t = tempfile::tempdir().unwrap();
        let l = t.path().join("layer");
        std::fs::create_dir_all(l.join("d/sub")).unwrap();
        std::fs::write(l.join("d/a"), b"hello").unwrap();
        std::fs::hard_link(l.join("d/a"), l.join("d/b")).unwrap();
        symlink("../../etc/passwd", l.join("d/link")).unwrap();
        let bad = std::ffi::OsStr::from_bytes(b"caf\xe9");
        std::fs::write(l.join(bad), b"x").unwrap();
        let long = "n".repeat(150);
        std::fs::write(l.join("d/sub").join(&long), b"long").unwrap();
        let (bytes, report) = write_layer_tar(&l, Vec::new(), &TarOptions::default()).unwrap();
        let e = entries(&bytes);
        let names: Vec<Vec<u8>> = e.iter().map(|x| x.0.clone()).collect();
        let long_path = format!("d/sub/{long}").into_bytes();
        assert_eq!(
            names,
            vec![
                b"caf\xe9".to_vec(),
                b"d/".to_vec(),
                b"d/a".to_vec(),
                b"d/b".to_vec(),
                b"d/link".to_vec(),
                b"d/sub/".to_vec(),
                long_path,
            ]
        );
        assert_eq!(e[2].3, b"hello");
        assert_eq!(e[3].1, EntryType::Link);
        assert_eq!(e[3].2, b"d/a");
        assert_eq!(e[4].1, EntryType::Symlink);
        assert_eq!(e[4].2, b"../../etc/passwd");
        assert_eq!(e[6].3, b"long");
        assert_eq!(report.hardlinks, 1);
        // Deterministic: the same layer gives the same bytes.
        let (again, _) = write_layer_tar(&l, Vec::new(), &TarOptions::default()).unwrap();
        assert_eq!(bytes, again);
        // Mode and owner come from the inode.
        let md = std::fs::symlink_metadata(l.join("d/a")).unwrap();
        let mut a = tar::Archive::new(bytes.as_slice());
        let first_file = a
            .entries()
            .unwrap()
            .map(|e| e.unwrap())
            .find(|e| e.path_bytes().as_ref() == b"d/a")
            .unwrap();
        assert_eq!(first_file.header().mode().unwrap(), md.mode() & 0o7777);
        assert_eq!(first_file.header().uid().unwrap(), u64::from(md.uid()));
    }

    #[test]
    fn user_xattrs_are_kept_and_overlay_private_ones_dropped() {
        let t = tempfile::tempdir().unwrap();
        let l = t.path().join("layer");
        std::fs::create_dir_all(l.join("d")).unwrap();
        std::fs::write(l.join("d/f"), b"x").unwrap();
        if xattr::set(l.join("d/f"), "user.note", b"v\x00\xff").is_err() {
            eprintln!("skipped: the filesystem has no user xattrs");
            return;
        }
        // With userxattr the overlay's private namespace is user.overlay.*.
        xattr::set(l.join("d"), "user.overlay.opaque", b"y").unwrap();
        xattr::set(l.join("d"), "user.overlay.origin", b"z").unwrap();
        let opts = TarOptions { userxattr: true };
        let (bytes, report) = write_layer_tar(&l, Vec::new(), &opts).unwrap();
        let e = entries(&bytes);
        let names: Vec<&[u8]> = e.iter().map(|x| x.0.as_slice()).collect();
        assert_eq!(names, [&b"d/"[..], b"d/.wh..wh..opq", b"d/f"]);
        assert!(e[0].4.is_empty(), "{:?}", e[0].4);
        assert_eq!(
            e[2].4,
            vec![("user.note".to_string(), b"v\x00\xff".to_vec())]
        );
        assert_eq!(report.opaque, 1);
    }

    #[test]
    fn whiteouts_become_wh_entries() {
        let t = tempfile::tempdir().unwrap();
        let l = t.path().join("layer");
        std::fs::create_dir_all(l.join("d")).unwrap();
        match nix::sys::stat::mknod(
            &l.join("d/gone"),
            nix::sys::stat::SFlag::S_IFCHR,
            Mode::empty(),
            0,
        ) {
            Ok(()) => {}
            Err(e) => {
                eprintln!("skipped: mknod needs CAP_MKNOD ({e})");
                return;
            }
        }
        let (bytes, report) = write_layer_tar(&l, Vec::new(), &TarOptions::default()).unwrap();
        let e = entries(&bytes);
        let names: Vec<&[u8]> = e.iter().map(|x| x.0.as_slice()).collect();
        assert_eq!(names, [&b"d/"[..], b"d/.wh.gone"]);
        assert_eq!(e[1].1, EntryType::Regular);
        assert_eq!(report.whiteouts, 1);
    }

    #[test]
    fn a_file_named_like_a_whiteout_is_refused_by_name() {
        for name in [&b".wh.etc"[..], b".wh..wh..opq"] {
            let t = tempfile::tempdir().unwrap();
            let l = t.path().join("layer");
            std::fs::create_dir_all(l.join("d")).unwrap();
            std::fs::write(l.join("d").join(std::ffi::OsStr::from_bytes(name)), b"x").unwrap();
            let e = write_layer_tar(&l, Vec::new(), &TarOptions::default()).unwrap_err();
            assert!(e.is_reserved_name(), "{e:?}");
            let mut want = b"d/".to_vec();
            want.extend_from_slice(name);
            assert_eq!(e.path.as_os_str().as_bytes(), want);
            let why = e.source.to_string();
            assert!(why.contains("reserve for whiteouts"), "{why}");
        }
        // A name with `.wh.` inside it is an ordinary file.
        let t = tempfile::tempdir().unwrap();
        let l = t.path().join("layer");
        std::fs::create_dir_all(&l).unwrap();
        std::fs::write(l.join("a.wh.b"), b"x").unwrap();
        let (bytes, _) = write_layer_tar(&l, Vec::new(), &TarOptions::default()).unwrap();
        assert_eq!(entries(&bytes)[0].0, b"a.wh.b");
    }

    #[test]
    fn a_symlinked_layer_root_is_refused() {
        let t = tempfile::tempdir().unwrap();
        symlink("/etc", t.path().join("layer")).unwrap();
        let e = write_layer_tar(&t.path().join("layer"), Vec::new(), &TarOptions::default())
            .unwrap_err();
        assert!(
            matches!(e.source.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            format!("cannot open layer {}", t.path().join("layer").display())
        );
    }

    #[test]
    fn pax_record_lengths_count_themselves() {
        let mut p = Pax::default();
        p.record("path", &[b'a'; 93]);
        // 3 + 1 + 4 + 1 + 93 + 1 = 103 with a 3-digit length.
        assert!(
            p.0.starts_with(b"103 path="),
            "{:?}",
            String::from_utf8_lossy(&p.0)
        );
        assert_eq!(p.0.len(), 103);
        let mut q = Pax::default();
        q.record("path", &[b'a'; 2]);
        assert_eq!(q.0, b"11 path=aa\n");
    }
}
