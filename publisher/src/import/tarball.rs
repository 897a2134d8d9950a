//! One layer tar (plain, gzip or zstd: told by its first bytes) applied onto
//! the staged tree with OCI whiteouts (see `stage.rs` for the semantics).
//!
//! The archive is read with the `tar` crate (≥ 0.4.46: a PAX `size` record
//! decides where the next header starts, so an entry cannot smuggle headers
//! inside its content — CVE-2025-62518, "TARmageddon"); GNU long names and
//! PAX `path`/`linkpath` records give the names checked here, never the
//! truncated header fields. Every name is normalized and checked before
//! anything is written ([`normalize`]): absolute paths and `..` are refused,
//! and the staged tree is written beneath its root without following a
//! symlink, so an entry cannot land outside it through a symlink an earlier
//! entry planted, nor a hardlink point outside it.

use std::cell::Cell;
use std::io::{self, BufRead, BufReader, Read};
use std::rc::Rc;

use tar::EntryType;

use super::stage::{normalize, show, Meta, Special, Stage, StageError};
use super::ImportError;
use crate::export::{OPAQUE_MARKER, WHITEOUT_PREFIX};

/// A layer's compression, from its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Compression {
    None,
    Gzip,
    Zstd,
}

/// Tells the compression of `r` by its magic number (RFC 1952, RFC 8878);
/// refuses the ones a layer does not use, by name.
pub(crate) fn sniff(r: &mut impl BufRead, origin: &str) -> Result<Compression, ImportError> {
    let head = r.fill_buf().map_err(|e| ImportError::Archive {
        origin: origin.to_string(),
        after: None,
        source: e,
    })?;
    Ok(match head {
        [0x1f, 0x8b, ..] => Compression::Gzip,
        [0x28, 0xb5, 0x2f, 0xfd, ..] => Compression::Zstd,
        [b'B', b'Z', b'h', ..] => return Err(unsupported(origin, "bzip2")),
        [0xfd, b'7', b'z', b'X', b'Z', 0, ..] => return Err(unsupported(origin, "xz")),
        _ => Compression::None,
    })
}

fn unsupported(origin: &str, what: &str) -> ImportError {
    ImportError::Invalid(format!(
        "{origin} is {what}-compressed: a layer tar is read plain, gzip- or zstd-compressed (decompress it first)"
    ))
}

/// `r` decompressed as `c` says.
pub(crate) fn decompressed<'a>(
    r: impl BufRead + 'a,
    c: Compression,
) -> io::Result<Box<dyn Read + 'a>> {
    Ok(match c {
        Compression::None => Box::new(r),
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(r)),
        Compression::Zstd => Box::new(zstd::stream::read::Decoder::with_buffer(r)?),
    })
}

/// Options of one [`apply`].
pub(crate) struct ApplyOptions<'a> {
    /// What the archive is, for messages: a file's path, `layer 2 of …`.
    pub origin: &'a str,
    /// Refuse an archive that holds an OCI image layout (its top level has
    /// `oci-layout`): the kind was guessed, and that guess would be wrong.
    pub refuse_layout: bool,
    /// Shift every entry's owner into a uid/gid mapping: `(host_uid,
    /// host_gid, size)` — an entry's uid `u` is written as `host_uid + u`;
    /// an id ≥ `size` is refused (an extraction into a session whose
    /// processes run in a user namespace with that mapping).
    pub shift: Option<(u32, u32, u32)>,
}

/// Applies the (decompressed) layer tar `r` onto `stage`; reads the archive
/// to its end (its trailing blocks and whatever follows: a digest of the
/// stream counts them). Returns the number of entries.
pub(crate) fn apply(
    r: &mut dyn Read,
    stage: &mut Stage,
    opts: &ApplyOptions<'_>,
) -> Result<u64, ImportError> {
    let origin = opts.origin;
    let pos = Rc::new(Cell::new(0u64));
    let limit = Rc::new(Cell::new(MAX_HEADERS));
    let mut archive = tar::Archive::new(Watched {
        inner: &mut *r,
        seen_eof: false,
        pos: pos.clone(),
        limit: limit.clone(),
    });
    let mut last: Option<Vec<u8>> = None;
    let read_err = |last: &Option<Vec<u8>>| {
        let after = last.clone();
        move |e: io::Error| ImportError::Archive {
            origin: origin.to_string(),
            after,
            source: e,
        }
    };
    let root = stage.root().to_path_buf();
    let mut n = 0u64;
    for entry in archive.entries().map_err(read_err(&last))? {
        let mut entry = entry.map_err(read_err(&last))?;
        // The reader has read up to this entry's data: what it reads until the
        // next entry is this data and at most MAX_HEADERS of headers.
        limit.set(
            pos.get()
                .saturating_add(entry.size().saturating_add(511) & !511)
                .saturating_add(MAX_HEADERS),
        );
        let raw = entry.path_bytes().into_owned();
        let refused = |reason: String| ImportError::Refused {
            origin: origin.to_string(),
            entry: raw.clone(),
            reason,
        };
        let ty = entry.header().entry_type();
        check_framing(&mut entry).map_err(&refused)?;
        if ty == EntryType::XGlobalHeader {
            // Archive-wide PAX defaults (a comment, a charset): nothing of an
            // entry; containerd's unpack ignores them too (check_framing
            // refused the records that would make readers disagree).
            continue;
        }
        n += 1;
        let Some(rel) = normalize(&raw).map_err(&refused)? else {
            // The root's own entry (`./`): the root is normalized instead.
            if ty != EntryType::Directory {
                return Err(refused(
                    "it names the root, which can only be a directory".into(),
                ));
            }
            last = Some(raw.clone());
            continue;
        };
        let mut meta = meta_of(&mut entry).map_err(|e| match e {
            MetaError::Refused(why) => refused(why),
            MetaError::Read(e) => read_err(&last)(e),
        })?;
        if let Some((hu, hg, size)) = opts.shift {
            if meta.uid >= size || meta.gid >= size {
                return Err(refused(format!(
                    "its owner {}:{} is outside the session's uid/gid mapping (ids 0..{size})",
                    meta.uid, meta.gid
                )));
            }
            meta.uid += hu;
            meta.gid += hg;
        }
        let (parent, name) = crate::fsx::split_parent(&rel);
        let parent = parent.to_vec();
        let staged = |e: StageError| match e {
            StageError::Refused(why) => refused(why),
            StageError::Read(e) => read_err(&last)(e),
            StageError::Io(what, source) => ImportError::Staging {
                what,
                entry: rel.clone(),
                staging: root.clone(),
                source,
            },
        };
        if opts.refuse_layout && rel == b"oci-layout" {
            return Err(ImportError::Invalid(format!(
                "{origin} holds an OCI image layout (its top level has oci-layout), not a root filesystem: extract it into a directory and import that directory (--kind oci), or pass --kind tar to import its files as they are"
            )));
        }
        if let Some(wh) = parent
            .split(|&b| b == b'/')
            .find(|c| c.starts_with(WHITEOUT_PREFIX))
        {
            // A directory named as a whiteout: written, it would be read as
            // one when the base is exported and unpacked again.
            return Err(refused(format!(
                "its path passes through {}, a whiteout name (a whiteout is a file, never a directory with entries)",
                show(wh)
            )));
        }
        if !stage.applies_whiteouts()
            && (name == OPAQUE_MARKER || name.starts_with(WHITEOUT_PREFIX))
        {
            // An extraction into a directory (UploadTar) has no layer below:
            // an opaque marker would empty its directory, a whiteout remove
            // what was there before the upload.
            return Err(refused(format!(
                "it is an OCI whiteout or opaque marker (a `{}` name), which an extraction into a directory does not apply: rename the file, or import the archive as a layer",
                show(WHITEOUT_PREFIX)
            )));
        }
        if name == OPAQUE_MARKER {
            stage.opaque(&parent).map_err(staged)?;
        } else if let Some(hidden) = name.strip_prefix(WHITEOUT_PREFIX) {
            if hidden.is_empty()
                || hidden == b"."
                || hidden == b".."
                || hidden.starts_with(WHITEOUT_PREFIX)
            {
                return Err(refused(format!(
                    "it is a whiteout of {:?}, which names no entry (only `.wh.<name>` and `.wh..wh..opq` are whiteouts)",
                    show(hidden)
                )));
            }
            let target = super::stage::join(&parent, hidden);
            stage.whiteout(&target, &meta).map_err(staged)?;
        } else {
            match ty {
                EntryType::Regular | EntryType::Continuous => {
                    stage.file(&rel, &meta, &mut entry).map_err(staged)?;
                }
                EntryType::Directory => stage.dir(&rel, &meta).map_err(staged)?,
                EntryType::Symlink => {
                    let target = entry
                        .link_name_bytes()
                        .map(|t| t.into_owned())
                        .unwrap_or_default();
                    stage.symlink(&rel, &target, &meta).map_err(staged)?;
                }
                EntryType::Link => {
                    let raw_target = entry
                        .link_name_bytes()
                        .map(|t| t.into_owned())
                        .unwrap_or_default();
                    let target = match normalize(&raw_target) {
                        Ok(Some(t)) => t,
                        Ok(None) => {
                            return Err(refused("it is a hardlink to the root".into()))
                        }
                        Err(why) => {
                            return Err(refused(format!(
                                "it is a hardlink to {}, outside the root: {why}",
                                show(&raw_target)
                            )))
                        }
                    };
                    stage.hardlink(&rel, &target, &meta).map_err(staged)?;
                }
                EntryType::Char | EntryType::Block if opts.shift.is_some() => {
                    return Err(refused(
                        "it is a device node, which a session with a uid/gid mapping may not hold (its processes could not make one either)".into(),
                    ));
                }
                EntryType::Char | EntryType::Block => {
                    let h = entry.header();
                    let dev = h
                        .device_major()
                        .and_then(|ma| h.device_minor().map(|mi| (ma, mi)));
                    let Ok((Some(ma), Some(mi))) = dev else {
                        return Err(refused("its device numbers do not parse".into()));
                    };
                    let kind = if ty == EntryType::Char {
                        Special::Char(ma, mi)
                    } else {
                        Special::Block(ma, mi)
                    };
                    stage.special(&rel, kind, &meta).map_err(staged)?;
                }
                EntryType::Fifo => stage.special(&rel, Special::Fifo, &meta).map_err(staged)?,
                other => {
                    return Err(refused(format!(
                        "its tar entry type {:?} ({}) is none an image layer uses (regular file, directory, symlink, hardlink, device, fifo)",
                        other,
                        char::from(other.as_byte())
                    )))
                }
            }
        }
        last = Some(raw.clone());
    }

    limit.set(u64::MAX);
    if archive.into_inner().seen_eof {
        // The input ended where a header should be: the `tar` crate takes
        // that for the end, but a whole archive ends with zero blocks. An
        // archive cut at an entry boundary is refused, not imported in part.
        return Err(read_err(&last)(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "it ends without the end-of-archive zero blocks (an archive cut at an entry boundary): copy it again",
        )));
    }
    // What follows the end-of-archive blocks is part of the stream a digest
    // names.
    io::copy(r, &mut io::sink()).map_err(read_err(&last))?;
    Ok(n)
}

/// The most the `tar` crate may read between one entry's data and the next
/// entry: its headers, PAX records and GNU long names, which it holds in
/// memory whole (a PAX header of gigabytes, from a small gzip stream, would be
/// read into memory otherwise). Real ones are a few KiB: a PAX path is at
/// most PATH_MAX, an xattr value at most 64 KiB.
const MAX_HEADERS: u64 = 4 << 20;

/// The reader under the `tar` crate: notes whether its input ended (a read of
/// a non-empty buffer returned 0: after the last entry, whether the archive
/// ended at its end-of-archive blocks or merely stopped), counts what was
/// read (`pos`), and fails a read past `limit` (see [`MAX_HEADERS`]).
struct Watched<'a> {
    inner: &'a mut dyn Read,
    seen_eof: bool,
    pos: Rc<Cell<u64>>,
    limit: Rc<Cell<u64>>,
}

impl Read for Watched<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let room = self.limit.get().saturating_sub(self.pos.get());
        if room == 0 && !buf.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("its headers before the next entry (PAX records, GNU long names) exceed {MAX_HEADERS} bytes"),
            ));
        }
        let want = buf.len().min(usize::try_from(room).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 && want > 0 {
            self.seen_eof = true;
        }
        self.pos.set(self.pos.get() + n as u64);
        Ok(n)
    }
}

/// The largest size a ustar header's 11 octal digits hold (8 GiB − 1); a
/// writer gives a larger file's size in a PAX `size` record and 0 in the
/// header (Go's archive/tar, Python's tarfile).
const USTAR_SIZE_MAX: u64 = 0o777_7777_7777;

/// Refuses an entry whose framing readers disagree on, before anything of it
/// is used (CVE-2025-62518, "TARmageddon", is the class: a reader that takes
/// another size than the writer meant reads content as headers, or headers as
/// content):
/// * a malformed PAX record (the `tar` crate then ignores every record after
///   it, a `size` among them; Go's archive/tar refuses the archive), or one
///   given twice (the `tar` crate takes the first, GNU tar and Go the last);
/// * a PAX `size`, `uid` or `gid` that is not a decimal number (the `tar`
///   crate ignores it, others do not);
/// * a PAX `size` that disagrees with the header's, except the header's 0
///   for a size its field cannot hold;
/// * data on an entry that has none (a directory, link, device, fifo): Go's
///   archive/tar, containerd's, reads those bytes as the next headers, this
///   reader skips them;
/// * a global PAX header with a record that describes entries (`path`,
///   `linkpath`, `size`, `uid`, `gid`): GNU tar applies it to every entry
///   that follows, Go's archive/tar and this import do not.
///
/// The error is the reason, for [`ImportError::Refused`].
fn check_framing<R: Read>(entry: &mut tar::Entry<'_, R>) -> Result<(), String> {
    let ty = entry.header().entry_type();
    let header_size = entry
        .header()
        .entry_size()
        .map_err(|_| "its header's size does not parse".to_string())?;
    let size = entry.size();
    let global = ty == EntryType::XGlobalHeader;
    if global && size > MAX_HEADERS {
        // Its records are read into memory whole.
        return Err(format!(
            "it is a global PAX header of {size} bytes, over the {MAX_HEADERS}-byte limit of headers"
        ));
    }
    let mut pax_size = None;
    if let Some(records) = entry
        .pax_extensions()
        .map_err(|e| format!("its PAX records cannot be read: {e}"))?
    {
        let mut seen: Vec<&[u8]> = Vec::new();
        for rec in records {
            let rec = rec.map_err(|_| {
                "it has a malformed PAX record (each is `<length> <key>=<value>\\n`, its length counting the whole record; a value cannot hold a newline here); readers disagree on what follows one".to_string()
            })?;
            let key = rec.key_bytes();
            if seen.contains(&key) {
                return Err(format!(
                    "its PAX record {} is given twice; readers disagree on which counts",
                    show(key)
                ));
            }
            seen.push(key);
            if !matches!(key, b"size" | b"uid" | b"gid" | b"path" | b"linkpath") {
                continue;
            }
            if global {
                return Err(format!(
                    "it is a global PAX header with a {} record: GNU tar applies it to every entry that follows, other readers do not; remove it from the archive",
                    show(key)
                ));
            }
            if key == b"path" || key == b"linkpath" {
                continue;
            }
            let v = rec.value_bytes();
            let n = (!v.is_empty() && v.iter().all(u8::is_ascii_digit))
                .then(|| std::str::from_utf8(v).ok()?.parse::<u64>().ok())
                .flatten()
                .ok_or_else(|| {
                    format!(
                        "its PAX {} record {:?} is not a decimal number",
                        show(key),
                        show(v)
                    )
                })?;
            if key == b"size" {
                pax_size = Some(n);
            }
        }
    }
    if global {
        return Ok(());
    }
    if let Some(p) = pax_size {
        if p != size || (p != header_size && !(header_size == 0 && p > USTAR_SIZE_MAX)) {
            return Err(format!(
                "its PAX size record says {p} bytes, its header {header_size}: a reader that takes the header's size reads the data as headers (CVE-2025-62518); fix the archive's writer"
            ));
        }
    }
    let dataless = matches!(
        ty,
        EntryType::Directory
            | EntryType::Symlink
            | EntryType::Link
            | EntryType::Char
            | EntryType::Block
            | EntryType::Fifo
    );
    if dataless && size != 0 {
        return Err(format!(
            "its header gives a {} {size} bytes of data: Go's archive/tar (containerd) reads those bytes as the next headers, this reader would skip them",
            match ty {
                EntryType::Directory => "directory",
                EntryType::Symlink => "symlink",
                EntryType::Link => "hardlink",
                EntryType::Fifo => "fifo",
                _ => "device",
            }
        ));
    }
    Ok(())
}

enum MetaError {
    Refused(String),
    Read(io::Error),
}

/// Mode, owner, mtime and `SCHILY.xattr.*` records of an entry (the `tar`
/// crate applies PAX `uid`/`gid`; PAX `mtime` is read here, its whole
/// seconds).
fn meta_of<R: Read>(entry: &mut tar::Entry<'_, R>) -> Result<Meta, MetaError> {
    let h = entry.header();
    let bad = |what: &str| MetaError::Refused(format!("its header's {what} does not parse"));
    // An empty numeric field (all NUL or spaces) is 0, as GNU tar, Go's
    // archive/tar and Python's tarfile read it.
    let field = |v: io::Result<u64>, raw: &[u8], what: &str| -> Result<u64, MetaError> {
        match v {
            Ok(v) => Ok(v),
            Err(_) if raw.iter().all(|&b| b == 0 || b == b' ') => Ok(0),
            Err(_) => Err(bad(what)),
        }
    };
    let old = h.as_old();
    let mode = field(h.mode().map(u64::from), &old.mode, "mode")? as u32 & 0o7777;
    let id = |v: io::Result<u64>, raw: &[u8], what: &str| -> Result<u32, MetaError> {
        let v = field(v, raw, what)?;
        u32::try_from(v)
            .map_err(|_| MetaError::Refused(format!("its {what} {v} does not fit 32 bits")))
    };
    let uid = id(h.uid(), &old.uid, "uid")?;
    let gid = id(h.gid(), &old.gid, "gid")?;
    let mut mtime = i64::try_from(field(h.mtime(), &old.mtime, "mtime")?).unwrap_or(i64::MAX);
    let mut xattrs = Vec::new();
    if let Some(pax) = entry.pax_extensions().map_err(MetaError::Read)? {
        for rec in pax {
            let rec = rec.map_err(MetaError::Read)?;
            let Ok(key) = rec.key() else { continue };
            if let Some(name) = key.strip_prefix("SCHILY.xattr.") {
                xattrs.push((name.as_bytes().to_vec(), rec.value_bytes().to_vec()));
            } else if key == "mtime" {
                let v = rec.value().map_err(|_| bad("PAX mtime"))?;
                let whole = v.split('.').next().unwrap_or("");
                mtime = whole.parse().map_err(|_| bad("PAX mtime"))?;
            }
        }
    }
    xattrs.sort();
    Ok(Meta {
        mode,
        uid,
        gid,
        mtime,
        xattrs,
    })
}

/// Applies the layer tar file read from `r` (any supported compression).
pub(crate) fn apply_file(
    r: impl Read,
    stage: &mut Stage,
    opts: &ApplyOptions<'_>,
) -> Result<u64, ImportError> {
    let mut r = BufReader::with_capacity(256 * 1024, r);
    let c = sniff(&mut r, opts.origin)?;
    let mut d = decompressed(r, c).map_err(|e| ImportError::Archive {
        origin: opts.origin.to_string(),
        after: None,
        source: e,
    })?;
    apply(&mut d, stage, opts)
}
