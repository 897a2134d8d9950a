//! Hostile input, fuzzed (issue 22): layer tars as `layerstack base import`
//! reads them (`import_tree`), as an OCI layout's layers are flattened
//! (`flatten_layer_tars`, whiteouts and opaque markers over a layer below) and
//! as the daemon's `UploadTar` extracts them into an existing directory
//! (`extract_tar_into`); OCI image layouts (index, nested indexes, manifest,
//! config, blobs); directory trees as `base import DIR` copies them (every
//! file type, hostile names, owners, modes, xattrs, hardlinks in and out:
//! staged exactly as they are, or refused by the documented rules).
//!
//! The generators are structured (proptest): archives built header by header
//! from pools of hostile names (`..`, absolute, NUL, long GNU and PAX names,
//! `.wh.` encodings), symlinks to `/` and to the sentinel beside the staging
//! directory, hardlinks out, devices (0:0 among them), PAX records (sizes that
//! agree and disagree, malformed and repeated records, overlayfs-private
//! xattrs), headers whose size lies, global headers, missing end blocks —
//! then raw mutations of the bytes (truncations, flipped bytes, rewritten size
//! fields with a valid checksum, duplicated blocks, gzip).
//!
//! Properties, per case, not just "no panic":
//! * nothing is written outside the staging directory: a sentinel directory
//!   beside it is untouched, nothing new appears beside it;
//! * an import either succeeds or fails with an input error that names the
//!   entry (a refusal) or the last entry read whole (a corrupt archive);
//! * a success staged a tree with no whiteout, no opaque marker, no 0:0
//!   character device and no overlayfs-private xattr, and — for an archive
//!   whose framing is intact — applied every entry of it (none skipped: the
//!   report's counts add up to the entries written);
//! * an archive holding an entry that must be refused (`..`, absolute,
//!   hardlink out, 0:0 device, overlay xattr, PAX size disagreeing with the
//!   header, malformed or repeated PAX record, data on a directory or link,
//!   an unknown entry type, a missing end-of-archive) is refused, never
//!   imported with the entry skipped;
//! * a truncated archive (plain or gzip) is refused.
//!
//! Cases: `LAYERSTACK_FUZZ_CASES` per target (default: a short run for CI).
//! The checked-in corpus (`tests/fuzz-corpus/`) is replayed first: `ok-*`
//! seeds must import, `refuse-*` seeds must be refused (each bug the fuzzing
//! found keeps its case there).
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use layerstack_publisher::{
    extract_tar_into, flatten_layer_tars, import_tree, ImportError, ImportKind, ImportOptions,
    ImportReport,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use sha2::{Digest as _, Sha256};
use tar::{EntryType, Header};

// Only `have_root` of the shared helpers is used here.
#[allow(dead_code)]
mod common;
use common::have_root;

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fuzz-corpus");

/// Cases per target: `LAYERSTACK_FUZZ_CASES`, else `default`.
fn cases(default: u32) -> u32 {
    std::env::var("LAYERSTACK_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

// ---------------------------------------------------------------------------
// The scene: staging/ beside outside/ (a sentinel).

struct Scene {
    _t: tempfile::TempDir,
    base: PathBuf,
}

impl Scene {
    fn new() -> Scene {
        let t = tempfile::Builder::new()
            .prefix("layerstack-fuzz-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let base = t.path().to_path_buf();
        std::fs::create_dir(base.join("staging")).unwrap();
        std::fs::create_dir(base.join("outside")).unwrap();
        std::fs::write(base.join("outside/sentinel"), b"untouched").unwrap();
        std::fs::set_permissions(
            base.join("outside/sentinel"),
            std::os::unix::fs::PermissionsExt::from_mode(0o644),
        )
        .unwrap();
        Scene { _t: t, base }
    }

    fn staging(&self) -> PathBuf {
        self.base.join("staging")
    }

    fn outside(&self) -> PathBuf {
        self.base.join("outside")
    }

    /// Nothing was written beside the staging directory nor into outside/.
    fn untouched(&self) -> Result<(), String> {
        let mut names: Vec<_> = std::fs::read_dir(&self.base)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        if names != ["outside", "staging"] {
            return Err(format!("written beside staging: {names:?}"));
        }
        let inside: Vec<_> = std::fs::read_dir(self.outside())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        if inside.len() != 1 {
            return Err(format!("written into outside/: {inside:?}"));
        }
        let md = std::fs::symlink_metadata(self.outside().join("sentinel")).unwrap();
        if std::fs::read(self.outside().join("sentinel")).unwrap() != b"untouched"
            || md.nlink() != 1
            || md.mode() & 0o7777 != 0o644
        {
            return Err(format!(
                "the sentinel changed: nlink {} mode {:o}",
                md.nlink(),
                md.mode()
            ));
        }
        Ok(())
    }
}

/// What a staged tree must never hold: whiteouts, opaque markers, 0:0
/// character devices, overlayfs-private xattrs; and every entry is below
/// the root (walked without following symlinks).
fn staged_tree_is_clean(root: &Path) -> Result<usize, String> {
    let mut n = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))? {
            let e = e.unwrap();
            let p = e.path();
            n += 1;
            let name = e.file_name();
            if name.as_bytes().starts_with(b".wh.") {
                return Err(format!(
                    "a whiteout or opaque marker was staged: {}",
                    p.display()
                ));
            }
            let md = std::fs::symlink_metadata(&p).unwrap();
            if md.file_type().is_char_device() && md.rdev() == 0 {
                return Err(format!(
                    "a 0:0 character device was staged: {}",
                    p.display()
                ));
            }
            for x in xattr::list(&p).into_iter().flatten() {
                let x = x.as_bytes();
                if x.starts_with(b"trusted.overlay.") || x.starts_with(b"user.overlay.") {
                    return Err(format!(
                        "overlay xattr {} staged on {}",
                        String::from_utf8_lossy(x),
                        p.display()
                    ));
                }
            }
            if md.is_dir() {
                stack.push(p);
            }
        }
    }
    Ok(n)
}

/// An import error must be an input error that names what it is about.
fn error_is_clear(e: &ImportError) -> Result<(), String> {
    let msg = e.to_string();
    if msg.is_empty() {
        return Err("an empty error message".into());
    }
    match e {
        ImportError::Refused { entry, reason, .. } => {
            if reason.is_empty() {
                return Err(format!("a refusal without a reason: {msg}"));
            }
            let shown = String::from_utf8_lossy(entry);
            if !msg.contains(shown.as_ref()) {
                return Err(format!("the refusal does not name its entry: {msg}"));
            }
        }
        ImportError::Archive { .. } | ImportError::Invalid(_) | ImportError::Digest { .. } => {}
        ImportError::Staging { entry, source, .. } => {
            // Only an input the staging side cannot hold (a name over
            // NAME_MAX), naming the entry; a corrupt input is never blamed on
            // the staging side (a truncated gzip read as a write error was).
            if entry.is_empty() || source.raw_os_error() != Some(libc::ENAMETOOLONG) {
                return Err(format!("a staging error for an input error: {msg}"));
            }
        }
        ImportError::Source { .. } | ImportError::Missing(_) => {
            return Err(format!("the source itself failed: {msg}"))
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Hostile archives, built header by header.

/// `@OUT` in a name or target is replaced by the scene's outside directory.
const OUT: &[u8] = b"@OUT";

#[derive(Debug, Clone)]
enum Kind {
    File(Vec<u8>),
    Dir,
    Symlink(Vec<u8>),
    Hardlink(Vec<u8>),
    Char(u32, u32),
    Block(u32, u32),
    Fifo,
    /// An entry type no layer uses (a GNU dump dir, a volume label, …).
    Other(u8),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum LongName {
    /// The name in the ustar header (truncated at 100 bytes).
    Header,
    /// A GNU `././@LongLink` entry before it.
    Gnu,
    /// A PAX `path` record.
    Pax,
}

#[derive(Debug, Clone)]
enum Pax {
    Rec(String, Vec<u8>),
    /// `size` with the entry's true data length.
    TrueSize,
    /// A record that does not parse.
    Malformed(Vec<u8>),
}

#[derive(Debug, Clone)]
struct Ent {
    name: Vec<u8>,
    kind: Kind,
    mode: u32,
    uid: u64,
    long: LongName,
    pax: Vec<Pax>,
    /// The header's size field says this, not the data's length.
    size_lie: Option<u64>,
}

#[derive(Debug, Clone)]
struct Archive {
    global: Vec<Pax>,
    entries: Vec<Ent>,
    /// 2: the two zero blocks; 1: one; 0: none (truncated at an entry boundary).
    end_blocks: u8,
}

#[derive(Debug, Clone)]
enum Mutation {
    None,
    /// Keep this fraction (per mille) of the bytes.
    Truncate(u32),
    /// XOR the byte at this fraction (per mille) with a mask.
    Flip(u32, u8),
    /// Rewrite the size field of the header block at this fraction with a
    /// valid checksum.
    SetSize(u32, u64),
    /// Repeat the 512-byte block at this fraction.
    DupBlock(u32),
}

fn pax_record(k: &str, v: &[u8]) -> Vec<u8> {
    let rest = k.len() + v.len() + 3;
    let mut len = rest + 1;
    while len != rest + len.to_string().len() {
        len = rest + len.to_string().len();
    }
    let mut out = format!("{len} {k}=").into_bytes();
    out.extend_from_slice(v);
    out.push(b'\n');
    out
}

fn subst(b: &[u8], out: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(OUT) {
            v.extend_from_slice(out);
            i += OUT.len();
        } else {
            v.push(b[i]);
            i += 1;
        }
    }
    v
}

fn header(name: &[u8], ty: EntryType, size: u64, mode: u32, uid: u64) -> Header {
    let mut h = Header::new_ustar();
    {
        let u = h.as_ustar_mut().unwrap();
        let n = name.len().min(u.name.len());
        u.name[..n].copy_from_slice(&name[..n]);
    }
    h.set_entry_type(ty);
    h.set_size(size);
    h.set_mode(mode);
    h.set_uid(uid);
    h.set_gid(0);
    h.set_mtime(1_600_000_000);
    h
}

fn push(out: &mut Vec<u8>, mut h: Header, data: &[u8]) {
    h.set_cksum();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(data);
    out.extend(std::iter::repeat_n(0u8, (512 - data.len() % 512) % 512));
}

/// What the builder knows of an archive it wrote.
struct Built {
    bytes: Vec<u8>,
    /// Entries the reader will apply (the root's own directory entry not
    /// counted), when the framing is intact (no size lie).
    applied: Option<u64>,
    /// Why the archive must be refused, if it must.
    must_refuse: Option<String>,
}

fn is_overlay_xattr(key: &str) -> bool {
    key.starts_with("SCHILY.xattr.trusted.overlay.")
        || key.starts_with("SCHILY.xattr.user.overlay.")
}

/// The normalized path, `None` for the root, `Err` for one that must be refused.
fn norm(name: &[u8]) -> Result<Option<Vec<u8>>, &'static str> {
    if name.contains(&0) {
        return Err("NUL");
    }
    if name.first() == Some(&b'/') {
        return Err("absolute");
    }
    let mut out: Vec<&[u8]> = Vec::new();
    for c in name.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err(".."),
            c => out.push(c),
        }
    }
    Ok((!out.is_empty()).then(|| out.join(&b'/')))
}

impl Archive {
    fn build(&self, out_dir: &[u8]) -> Built {
        let mut b = Vec::new();
        let mut applied = Some(0u64);
        let mut must: Option<String> = None;
        let flag = |why: String, must: &mut Option<String>| {
            if must.is_none() {
                *must = Some(why);
            }
        };
        if !self.global.is_empty() {
            let mut body = Vec::new();
            let mut keys = BTreeSet::new();
            for p in &self.global {
                match p {
                    Pax::Rec(k, v) => {
                        if !keys.insert(k.clone()) {
                            flag(format!("global record {k} twice"), &mut must);
                        }
                        if matches!(k.as_str(), "path" | "linkpath" | "size" | "uid" | "gid") {
                            flag(format!("global record {k}"), &mut must);
                        }
                        body.extend(pax_record(k, &subst(v, out_dir)));
                    }
                    Pax::TrueSize => {}
                    Pax::Malformed(m) => {
                        flag("malformed global record".into(), &mut must);
                        body.extend_from_slice(m);
                    }
                }
            }
            let h = header(
                b"pax_global_header",
                EntryType::XGlobalHeader,
                body.len() as u64,
                0o644,
                0,
            );
            push(&mut b, h, &body);
        }
        let mut intact = true;
        for e in &self.entries {
            let name = subst(&e.name, out_dir);
            let (ty, data, link): (EntryType, &[u8], Option<Vec<u8>>) = match &e.kind {
                Kind::File(d) => (EntryType::Regular, d, None),
                Kind::Dir => (EntryType::Directory, &[], None),
                Kind::Symlink(t) => (EntryType::Symlink, &[], Some(subst(t, out_dir))),
                Kind::Hardlink(t) => (EntryType::Link, &[], Some(subst(t, out_dir))),
                Kind::Char(..) => (EntryType::Char, &[], None),
                Kind::Block(..) => (EntryType::Block, &[], None),
                Kind::Fifo => (EntryType::Fifo, &[], None),
                Kind::Other(t) => (EntryType::new(*t), &[], None),
            };
            // A "lie" that is the truth is none.
            let size_lie = e.size_lie.filter(|&v| v != data.len() as u64);
            // PAX records of this entry.
            let mut body = Vec::new();
            let mut keys = BTreeSet::new();
            let mut pax_size = None;
            let mut pax_path = None;
            let mut why = None::<String>;
            let mut note = |w: String| {
                if why.is_none() {
                    why = Some(w);
                }
            };
            // Refusals of the metadata: only for an entry that is written
            // (not the root's own, not a whiteout).
            let mut meta_why = None::<String>;
            let mut records: Vec<Pax> = e.pax.clone();
            if e.long == LongName::Pax {
                records.insert(0, Pax::Rec("path".into(), e.name.clone()));
            }
            for p in &records {
                match p {
                    Pax::Rec(k, v) => {
                        let v = subst(v, out_dir);
                        if !keys.insert(k.clone()) {
                            note(format!("PAX {k} twice"));
                        }
                        match k.as_str() {
                            "size" => {
                                let n = std::str::from_utf8(&v)
                                    .ok()
                                    .filter(|s| {
                                        !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit())
                                    })
                                    .and_then(|s| s.parse::<u64>().ok());
                                match n {
                                    Some(n) if n == data.len() as u64 && size_lie.is_none() => {
                                        pax_size = Some(n)
                                    }
                                    Some(n) => {
                                        pax_size = Some(n);
                                        note(format!("PAX size {n} disagrees"));
                                        intact = false;
                                    }
                                    None => {
                                        note("PAX size not a number".into());
                                    }
                                }
                            }
                            "uid" | "gid" => {
                                if v.is_empty() || !v.iter().all(u8::is_ascii_digit) {
                                    note(format!("PAX {k} not a number"));
                                } else if let Ok(n) =
                                    std::str::from_utf8(&v).unwrap().parse::<u64>()
                                {
                                    if n >= u64::from(u32::MAX) {
                                        meta_why.get_or_insert(format!("{k} {n}"));
                                    }
                                }
                            }
                            "path" => pax_path = Some(v.clone()),
                            k if k.starts_with("SCHILY.xattr.user.")
                                && matches!(
                                    e.kind,
                                    Kind::Symlink(_)
                                        | Kind::Char(..)
                                        | Kind::Block(..)
                                        | Kind::Fifo
                                ) =>
                            {
                                meta_why.get_or_insert("user xattr on a special".into());
                            }
                            k if is_overlay_xattr(k) => {
                                meta_why.get_or_insert("overlay xattr".into());
                            }
                            _ => {}
                        }
                        if v.contains(&b'\n') {
                            note("newline in a PAX value".into());
                        }
                        body.extend(pax_record(k, &v));
                    }
                    Pax::TrueSize => {
                        if !keys.insert("size".into()) {
                            note("PAX size twice".into());
                        }
                        body.extend(pax_record("size", data.len().to_string().as_bytes()));
                        pax_size = Some(data.len() as u64);
                        if size_lie.is_some() {
                            note("PAX size disagrees with the header".into());
                        }
                    }
                    Pax::Malformed(m) => {
                        note("malformed PAX record".into());
                        body.extend_from_slice(m);
                    }
                }
            }
            if !body.is_empty() {
                let h = header(
                    b"PaxHeader",
                    EntryType::XHeader,
                    body.len() as u64,
                    0o644,
                    0,
                );
                push(&mut b, h, &body);
            }
            if e.long == LongName::Gnu {
                let mut n = name.clone();
                n.push(0);
                let h = header(
                    b"././@LongLink",
                    EntryType::GNULongName,
                    n.len() as u64,
                    0o644,
                    0,
                );
                push(&mut b, h, &n);
            }
            // The name the reader sees: the GNU long name, else the PAX path,
            // else the header's (truncated) name.
            let seen: Vec<u8> = match e.long {
                LongName::Gnu => name.clone(),
                _ => match &pax_path {
                    Some(p) => p.clone(),
                    // A header field ends at its first NUL.
                    None => name[..name.len().min(100)]
                        .split(|&c| c == 0)
                        .next()
                        .unwrap_or_default()
                        .to_vec(),
                },
            };
            let header_size = size_lie.unwrap_or(data.len() as u64);
            let mut h = header(&name, ty, header_size, e.mode, e.uid);
            if let Some(t) = &link {
                let u = h.as_ustar_mut().unwrap();
                let n = t.len().min(100);
                u.linkname[..n].copy_from_slice(&t[..n]);
            }
            match &e.kind {
                Kind::Char(ma, mi) | Kind::Block(ma, mi) => {
                    h.set_device_major(*ma).unwrap();
                    h.set_device_minor(*mi).unwrap();
                }
                _ => {}
            }
            push(&mut b, h, data);
            if size_lie.is_some() && pax_size.is_none() {
                // The reader takes the lie: what follows is misread.
                intact = false;
            }
            if !intact {
                // Past a broken frame nothing is predictable.
                if let Some(w) = why {
                    flag(w, &mut must);
                }
                applied = None;
                break;
            }
            if e.uid == u64::from(u32::MAX) && !keys.contains("uid") {
                meta_why.get_or_insert("uid -1".into());
            }
            // The verdict on the name and kind.
            match norm(&seen) {
                Err(w) => note(format!("name {w}")),
                Ok(None) if !matches!(e.kind, Kind::Dir) => note("root not a dir".into()),
                Ok(None) => {}
                Ok(Some(p)) => {
                    let last = p.rsplit(|&c| c == b'/').next().unwrap_or(&[]).to_vec();
                    let whiteout = last.starts_with(b".wh.");
                    if p.split(|&c| c == b'/')
                        .rev()
                        .skip(1)
                        .any(|c| c.starts_with(b".wh."))
                    {
                        note("through a whiteout-named directory".into());
                    }
                    if whiteout && last != b".wh..wh..opq" {
                        let hidden = &last[4..];
                        if hidden.is_empty()
                            || hidden == b"."
                            || hidden == b".."
                            || hidden.starts_with(b".wh.")
                        {
                            note("bad whiteout".into());
                        }
                    }
                    if !whiteout {
                        if let Some(w) = meta_why.take() {
                            note(w);
                        }
                        match &e.kind {
                            Kind::Char(0, 0) => note("0:0 char".into()),
                            Kind::Other(_) => note("unknown type".into()),
                            Kind::Hardlink(t) => {
                                let t = if t.len() > 100 { &t[..100] } else { &t[..] };
                                let t = subst(t, out_dir);
                                if !matches!(norm(&t), Ok(Some(_))) {
                                    note("hardlink out".into());
                                }
                            }
                            _ => {}
                        }
                    }
                }
            }
            if let Some(w) = why {
                flag(w, &mut must);
            }
            if !matches!(norm(&seen), Ok(None)) {
                applied = applied.map(|a| a + 1);
            }
        }
        if intact {
            match self.end_blocks {
                0 => flag("no end-of-archive blocks".into(), &mut must),
                n => b.extend(std::iter::repeat_n(0u8, 512 * n as usize)),
            }
        }
        Built {
            bytes: b,
            applied,
            must_refuse: must,
        }
    }
}

fn mutate(bytes: &[u8], m: &Mutation) -> Vec<u8> {
    let mut b = bytes.to_vec();
    let at = |pm: u32, len: usize| (len as u64 * u64::from(pm) / 1000) as usize;
    match m {
        Mutation::None => {}
        Mutation::Truncate(pm) => b.truncate(at(*pm, b.len())),
        Mutation::Flip(pm, mask) => {
            if !b.is_empty() {
                let i = at(*pm, b.len()).min(b.len() - 1);
                b[i] ^= mask.max(&1);
            }
        }
        Mutation::SetSize(pm, v) => {
            let blocks = b.len() / 512;
            if blocks > 0 {
                let i = at(*pm, blocks).min(blocks - 1) * 512;
                let mut h = Header::new_old();
                h.as_mut_bytes().copy_from_slice(&b[i..i + 512]);
                h.set_size(*v);
                h.set_cksum();
                b[i..i + 512].copy_from_slice(h.as_bytes());
            }
        }
        Mutation::DupBlock(pm) => {
            let blocks = b.len() / 512;
            if blocks > 0 {
                let i = at(*pm, blocks).min(blocks - 1) * 512;
                let blk = b[i..i + 512].to_vec();
                b.splice(i..i, blk);
            }
        }
    }
    b
}

fn gzip(b: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(b).unwrap();
    e.finish().unwrap()
}

// Generators.

fn component() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => prop::sample::select(vec!["a", "b", "c", "d", "etc", "bin"]).prop_map(|s| s.as_bytes().to_vec()),
        1 => prop::sample::select(vec!["..", ".", ""]).prop_map(|s| s.as_bytes().to_vec()),
        1 => prop::sample::select(vec![".wh.a", ".wh.b", ".wh..wh..opq", ".wh.", ".wh..", ".wh..wh.x"]).prop_map(|s| s.as_bytes().to_vec()),
        1 => prop::sample::select(vec!["@OUT", "x\0y", "é", "a b"]).prop_map(|s| s.as_bytes().to_vec()),
        1 => (90usize..140).prop_map(|n| vec![b'l'; n]),
    ]
}

fn name() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::sample::select(vec!["", "", "", "./", "/"]),
        prop::collection::vec(component(), 1..4),
        any::<bool>(),
    )
        .prop_map(|(pre, comps, slash)| {
            let mut n = pre.as_bytes().to_vec();
            n.extend(comps.join(&b'/'));
            if slash {
                n.push(b'/');
            }
            n
        })
}

fn target() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        2 => name(),
        1 => prop::sample::select(vec!["/", "..", "../..", "../outside", "@OUT", "@OUT/sentinel", "../outside/sentinel", "/etc/passwd", ""])
            .prop_map(|s| s.as_bytes().to_vec()),
    ]
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        4 => prop::collection::vec(any::<u8>(), 0..700).prop_map(Kind::File),
        3 => Just(Kind::Dir),
        2 => target().prop_map(Kind::Symlink),
        2 => target().prop_map(Kind::Hardlink),
        1 => (0u32..3, 0u32..3).prop_map(|(a, b)| Kind::Char(a, b)),
        1 => (0u32..3, 0u32..3).prop_map(|(a, b)| Kind::Block(a, b)),
        1 => Just(Kind::Fifo),
        1 => prop::sample::select(vec![b'D', b'V', b'M', b'N', b'9', b'S']).prop_map(Kind::Other),
    ]
}

fn pax() -> impl Strategy<Value = Pax> {
    let rec = |k: &'static str, vs: Vec<&'static str>| {
        prop::sample::select(vs).prop_map(move |v| Pax::Rec(k.to_string(), v.as_bytes().to_vec()))
    };
    prop_oneof![
        3 => Just(Pax::TrueSize),
        2 => rec("size", vec!["0", "1", "512", "1024", "99999999999", "abc", "+1", "", "-1"]),
        2 => name().prop_map(|n| Pax::Rec("path".into(), n)),
        1 => target().prop_map(|n| Pax::Rec("linkpath".into(), n)),
        1 => rec("uid", vec!["0", "1000", "4294967295", "x", "99999999999"]),
        1 => rec("gid", vec!["0", "7", "y"]),
        1 => rec("mtime", vec!["1.5", "-1", "1600000000.000000001"]),
        2 => rec("SCHILY.xattr.user.k", vec!["v", "", "a=b", "line\nbreak"]),
        1 => rec("SCHILY.xattr.trusted.overlay.opaque", vec!["y"]),
        1 => rec("SCHILY.xattr.user.overlay.redirect", vec!["/x"]),
        1 => rec("comment", vec!["hello"]),
        2 => prop::sample::select(vec![
            "5 a=b\n", "xx size=1\n", "3 \n", "12 nokey\n", "999 size=1\n", "6 size\n", "0 =\n"
        ]).prop_map(|s| Pax::Malformed(s.as_bytes().to_vec())),
    ]
}

fn ent() -> impl Strategy<Value = Ent> {
    (
        name(),
        kind(),
        prop::sample::select(vec![0o644u32, 0o755, 0o4755, 0o7777, 0]),
        prop::sample::select(vec![0u64, 1000, u64::from(u32::MAX)]),
        prop::sample::select(vec![
            LongName::Header,
            LongName::Header,
            LongName::Gnu,
            LongName::Pax,
        ]),
        prop::collection::vec(pax(), 0..3),
        prop::option::weighted(
            0.1,
            prop::sample::select(vec![0u64, 1, 511, 512, 513, 4096]),
        ),
    )
        .prop_map(|(name, kind, mode, uid, long, pax, size_lie)| Ent {
            name,
            kind,
            mode,
            uid,
            long,
            pax,
            size_lie,
        })
}

/// A well-formed entry: safe names, kinds and records (most archives then
/// import, and the "every entry applied" property is exercised).
fn benign_ent() -> impl Strategy<Value = Ent> {
    let comp = prop_oneof![
        5 => prop::sample::select(vec!["a", "b", "c", "d", "etc", "bin"]).prop_map(|s| s.as_bytes().to_vec()),
        1 => (90usize..140).prop_map(|n| vec![b'l'; n]),
    ];
    let name = prop::collection::vec(comp, 1..4).prop_map(|c| c.join(&b'/'));
    (
        name,
        prop_oneof![
            4 => prop::collection::vec(any::<u8>(), 0..700).prop_map(Kind::File),
            3 => Just(Kind::Dir),
            1 => prop::sample::select(vec!["a", "../b", "/etc/passwd", "c/d"]).prop_map(|t| Kind::Symlink(t.as_bytes().to_vec())),
            1 => Just(Kind::Fifo),
            1 => (1u32..3, 0u32..3).prop_map(|(a, b)| Kind::Char(a, b)),
        ],
        prop::sample::select(vec![LongName::Header, LongName::Gnu, LongName::Pax]),
        prop::collection::vec(
            prop_oneof![
                Just(Pax::TrueSize),
                Just(Pax::Rec("mtime".into(), b"1600000000.5".to_vec())),
                Just(Pax::Rec("SCHILY.xattr.trusted.k".into(), b"v".to_vec())),
            ],
            0..2,
        ),
    )
        .prop_map(|(name, kind, long, pax)| Ent {
            name,
            kind,
            mode: 0o644,
            uid: 1000,
            long,
            pax,
            size_lie: None,
        })
}

fn archive() -> impl Strategy<Value = Archive> {
    prop_oneof![
        3 => hostile_archive(),
        1 => prop::collection::vec(benign_ent(), 0..8).prop_map(|entries| Archive {
            global: Vec::new(),
            entries,
            end_blocks: 2,
        }),
    ]
}

fn hostile_archive() -> impl Strategy<Value = Archive> {
    (
        prop::collection::vec(pax(), 0..2).prop_map(|g| if g.len() == 1 { Vec::new() } else { g }),
        prop::collection::vec(ent(), 0..8),
        prop::sample::select(vec![2u8, 2, 2, 1, 0]),
    )
        .prop_map(|(global, entries, end_blocks)| Archive {
            global,
            entries,
            end_blocks,
        })
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        6 => Just(Mutation::None),
        2 => (0u32..1000).prop_map(Mutation::Truncate),
        2 => (0u32..1000, any::<u8>()).prop_map(|(a, m)| Mutation::Flip(a, m)),
        1 => (0u32..1000, prop::sample::select(vec![0u64, 1, 100, 512, 1 << 20, 1 << 40])).prop_map(|(a, v)| Mutation::SetSize(a, v)),
        1 => (0u32..1000).prop_map(Mutation::DupBlock),
    ]
}

#[derive(Debug, Clone, Copy)]
enum Target {
    Import,
    /// Over a first layer with a symlink to outside/ and files to hide.
    Flatten,
    /// Into a directory that holds a symlink to outside/ already.
    Extract,
}

fn target_kind() -> impl Strategy<Value = Target> {
    prop::sample::select(vec![Target::Import, Target::Flatten, Target::Extract])
}

/// Runs one archive against one target and checks the properties.
fn run_case(
    s: &Scene,
    bytes: &[u8],
    gz: bool,
    t: Target,
    applied: Option<u64>,
    must_refuse: Option<&str>,
) -> Result<Option<ImportReport>, String> {
    let bytes = if gz { gzip(bytes) } else { bytes.to_vec() };
    let out: Result<ImportReport, ImportError> = match t {
        Target::Import => {
            let src = s.base.join("staging/../layer.tar");
            // The source lives beside staging: it is moved away before the
            // checks (it is no write of the import).
            std::fs::write(&src, &bytes).unwrap();
            let r = import_tree(
                &src,
                &s.staging(),
                &ImportOptions {
                    kind: ImportKind::Tar,
                    ..Default::default()
                },
            );
            std::fs::remove_file(&src).unwrap();
            r
        }
        Target::Flatten => {
            let mut first = Vec::new();
            push(
                &mut first,
                header(b"a", EntryType::Regular, 2, 0o644, 0),
                b"a\n",
            );
            push(
                &mut first,
                header(b"d", EntryType::Directory, 0, 0o755, 0),
                &[],
            );
            push(
                &mut first,
                header(b"d/x", EntryType::Regular, 2, 0o644, 0),
                b"x\n",
            );
            let mut h = header(b"out", EntryType::Symlink, 0, 0o777, 0);
            h.set_link_name("../outside").unwrap();
            push(&mut first, h, &[]);
            first.extend(std::iter::repeat_n(0u8, 1024));
            flatten_layer_tars(
                &s.staging(),
                [
                    (
                        "layer 1".to_string(),
                        Box::new(std::io::Cursor::new(first)) as Box<dyn Read>,
                    ),
                    ("layer 2".to_string(), Box::new(std::io::Cursor::new(bytes))),
                ],
            )
        }
        Target::Extract => {
            std::os::unix::fs::symlink("../outside", s.staging().join("pre")).unwrap();
            std::os::unix::fs::symlink("/", s.staging().join("root")).unwrap();
            extract_tar_into(&s.staging(), std::io::Cursor::new(bytes), "upload")
        }
    };
    s.untouched()?;
    match out {
        Ok(r) => {
            if let Some(why) = must_refuse {
                return Err(format!(
                    "imported an archive that must be refused ({why}): {r:?}"
                ));
            }
            staged_tree_is_clean(&s.staging())?;
            if let (Some(n), Target::Import) = (applied, t) {
                let got = r.files
                    + r.dirs
                    + r.symlinks
                    + r.hardlinks
                    + r.specials
                    + r.whiteouts
                    + r.opaque;
                if got != n {
                    return Err(format!("{n} entries written, {got} applied: {r:?}"));
                }
            }
            Ok(Some(r))
        }
        Err(e) => {
            error_is_clear(&e)?;
            Ok(None)
        }
    }
}

/// Keeps a failing case for the corpus: `target/fuzz-failures/<sha>.tar`.
fn keep_failure(bytes: &[u8]) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/fuzz-failures");
    std::fs::create_dir_all(&dir).unwrap();
    let hex = format!("{:x}", Sha256::digest(bytes));
    let p = dir.join(format!("{}.tar", &hex[..16]));
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Replays the corpus: `ok-*` must import, `refuse-*` must be refused, each
/// through every target (gzip-compressed as well). Returns executions.
fn replay_corpus() -> u64 {
    let mut n = 0;
    let mut names: Vec<_> = std::fs::read_dir(CORPUS)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "tar"))
        .collect();
    names.sort();
    assert!(names.len() >= 10, "the corpus {CORPUS} is missing");
    for p in names {
        let bytes = std::fs::read(&p).unwrap();
        let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
        // `refuse-upload-*`: refused by an upload only, imported as a layer.
        let upload_only = stem.starts_with("refuse-upload-");
        assert!(
            stem.starts_with("ok-") || stem.starts_with("refuse-"),
            "corpus seed {stem}: name it ok-*, refuse-* or refuse-upload-*"
        );
        for t in [Target::Import, Target::Flatten, Target::Extract] {
            let want_ok = stem.starts_with("ok-") || (upload_only && !matches!(t, Target::Extract));
            for gz in [false, true] {
                let must = (!want_ok).then_some("a refuse-* seed");
                let r = run_case(&Scene::new(), &bytes, gz, t, None, must)
                    .unwrap_or_else(|e| panic!("corpus seed {stem} ({t:?}, gzip {gz}): {e}"));
                // An upload extracts files, not layer whiteouts: it may refuse
                // an `ok-*` seed that holds them.
                if want_ok && !matches!(t, Target::Extract) {
                    assert!(
                        r.is_some(),
                        "corpus seed {stem} ({t:?}, gzip {gz}) was refused"
                    );
                }
                n += 1;
            }
        }
    }
    n
}

#[test]
fn fuzz_layer_tars() {
    if !have_root("fuzz_layer_tars") {
        return;
    }
    let started = Instant::now();
    let replayed = replay_corpus();
    let mut runner = TestRunner::new(Config {
        cases: cases(1500),
        failure_persistence: None,
        ..Config::default()
    });
    let execs = std::sync::atomic::AtomicU64::new(0);
    let refused = std::sync::atomic::AtomicU64::new(0);
    let strategy = (archive(), mutation(), any::<bool>(), target_kind());
    let result = runner.run(&strategy, |(a, m, gz, t)| {
        execs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // `@OUT` in names and targets is this scene's outside/.
        let scene = Scene::new();
        let built = a.build(scene.outside().as_os_str().as_bytes());
        let bytes = mutate(&built.bytes, &m);
        let intact = matches!(m, Mutation::None);
        let truncated = matches!(m, Mutation::Truncate(_)) && bytes.len() < built.bytes.len();
        let must = if intact {
            built.must_refuse.clone()
        } else if truncated
            && built.must_refuse.is_none()
            && built.applied.is_some()
            && a.end_blocks > 0
        {
            // A cut before the end blocks are whole is a truncated archive.
            let end = built.bytes.len() - 512 * a.end_blocks as usize;
            (bytes.len() < end + 512).then(|| "truncated".to_string())
        } else {
            None
        };
        let applied = if intact { built.applied } else { None };
        match run_case(&scene, &bytes, gz, t, applied, must.as_deref()) {
            Ok(None) => {
                refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(())
            }
            Ok(Some(_)) => Ok(()),
            Err(e) => {
                let kept = keep_failure(&bytes);
                Err(TestCaseError::fail(format!(
                    "{e} (archive kept as {})",
                    kept.display()
                )))
            }
        }
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let secs = started.elapsed().as_secs_f64();
    let n = execs.into_inner() + replayed;
    eprintln!(
        "fuzz_layer_tars: {n} executions ({replayed} corpus replays) in {secs:.1} s, {:.0}/s, {} refused",
        n as f64 / secs,
        refused.into_inner()
    );
    layerstack_store::reliability::record(
        "fuzz-import",
        "A hostile layer tar (plain or gzip; as a base import, as a layer over another, as an upload into a session) is imported whole with every entry inside the root, or refused naming the entry; nothing is written outside the staging directory; PAX/ustar size disagreements, malformed or repeated PAX records, `..`, absolute names, hardlinks out, 0:0 devices, overlay xattrs and truncated archives are refused, never skipped.",
        "cargo test -p layerstack-publisher --test fuzz_import fuzz_layer_tars",
        &[
            ("executions", n.into()),
            ("corpus_replays", replayed.into()),
            ("executions_per_s", ((n as f64 / secs).round() as u64).into()),
            ("seconds", ((secs * 10.0).round() / 10.0).into()),
            ("bugs found by earlier runs (kept as regression cases)", corpus_regressions().into()),
        ],
    )
    .expect("the reliability record is written");
}

/// The corpus seeds that are regressions of bugs the fuzzing found
/// (`*-found-*`).
fn corpus_regressions() -> u64 {
    std::fs::read_dir(CORPUS)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains("-found-")
        })
        .count() as u64
}

// ---------------------------------------------------------------------------
// OCI image layouts: index, nested indexes, manifest, config, blobs.

/// One change to a valid layout.
#[derive(Debug, Clone)]
enum LayoutMutation {
    None,
    /// Set a JSON pointer of index.json / the manifest / the config to a value
    /// (the documents a pointer names are rewritten, and the digests of the
    /// documents above them are NOT updated unless `rehash`).
    Set {
        doc: Doc,
        pointer: &'static str,
        value: serde_json::Value,
        rehash: bool,
    },
    /// XOR a byte of a document (per mille of its length).
    Flip(Doc, u32, u8),
    /// Replace a blob by something that is not a regular file.
    BlobIs(BlobKind, Doc),
    /// The index lists itself as a nested index (a loop).
    SelfNested,
    /// oci-layout says this.
    Marker(&'static str),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Doc {
    Index,
    Manifest,
    Config,
    Layer,
}

#[derive(Debug, Clone, Copy)]
enum BlobKind {
    SymlinkOut,
    Fifo,
    DevZero,
    Dir,
    Missing,
}

fn doc() -> impl Strategy<Value = Doc> {
    prop::sample::select(vec![Doc::Index, Doc::Manifest, Doc::Config, Doc::Layer])
}

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::json;
    prop::sample::select(vec![
        json!(null),
        json!(-1),
        json!(0),
        json!(1u64 << 62),
        json!(""),
        json!("sha256:../../outside/sentinel"),
        json!("sha256:0000000000000000000000000000000000000000000000000000000000000000"),
        json!("sha256:ABCDEF0000000000000000000000000000000000000000000000000000000000"),
        json!("sha512:00"),
        json!("md5:00"),
        json!("application/vnd.oci.image.index.v1+json"),
        json!("application/vnd.oci.image.manifest.v1+json"),
        json!("application/vnd.docker.distribution.manifest.list.v2+json"),
        json!("application/x-evil"),
        json!({"os": "linux", "architecture": "amd64"}),
        json!({"os": "unknown", "architecture": "unknown"}),
        json!({"os": "", "architecture": "../.."}),
        json!([]),
        json!([{}]),
        json!(["sha256:0000000000000000000000000000000000000000000000000000000000000000"]),
        json!({"a": {"b": {"c": [[[[[[[[[[[[1]]]]]]]]]]]]}}}),
    ])
}

fn layout_mutation() -> impl Strategy<Value = LayoutMutation> {
    let pointer = prop::sample::select(vec![
        "/manifests/0/digest",
        "/manifests/0/size",
        "/manifests/0/mediaType",
        "/manifests/0/platform",
        "/manifests",
        "/schemaVersion",
        "/config/digest",
        "/config/size",
        "/config/mediaType",
        "/layers/0/digest",
        "/layers/0/size",
        "/layers/0/mediaType",
        "/layers",
        "/rootfs/diff_ids",
        "/rootfs/diff_ids/0",
        "/rootfs",
    ]);
    prop_oneof![
        2 => Just(LayoutMutation::None),
        6 => (doc(), pointer, json_value(), any::<bool>()).prop_map(|(doc, pointer, value, rehash)| {
            LayoutMutation::Set { doc, pointer, value, rehash }
        }),
        2 => (doc(), 0u32..1000, any::<u8>()).prop_map(|(d, a, m)| LayoutMutation::Flip(d, a, m)),
        2 => (prop::sample::select(vec![BlobKind::SymlinkOut, BlobKind::Fifo, BlobKind::DevZero, BlobKind::Dir, BlobKind::Missing]), doc())
            .prop_map(|(k, d)| LayoutMutation::BlobIs(k, d)),
        1 => Just(LayoutMutation::SelfNested),
        1 => prop::sample::select(vec!["", "{}", r#"{"imageLayoutVersion": "2.0.0"}"#, r#"{"imageLayoutVersion": 1}"#, "[", "\u{0}"])
            .prop_map(LayoutMutation::Marker),
    ]
}

fn sha(b: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(b))
}

/// Writes a layout of `layers` (uncompressed layer tars) in `dir`, then
/// applies `m`. Returns whether `m` changed anything a valid layout has.
fn write_layout(dir: &Path, outside: &Path, layers: &[Vec<u8>], m: &LayoutMutation) -> bool {
    use serde_json::json;
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let put = |b: &[u8]| -> (String, usize) {
        let d = sha(b);
        std::fs::write(blobs.join(&d[7..]), b).unwrap();
        (d, b.len())
    };
    let diff_ids: Vec<String> = layers.iter().map(|l| sha(l)).collect();
    let mut config = json!({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": diff_ids}});
    let layer_descs: Vec<_> = layers
        .iter()
        .map(|l| {
            let (d, s) = put(l);
            json!({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": s})
        })
        .collect();
    let set = |v: &mut serde_json::Value, d: Doc| {
        if let LayoutMutation::Set {
            doc,
            pointer,
            value,
            ..
        } = m
        {
            if *doc == d {
                if let Some(slot) = v.pointer_mut(pointer) {
                    *slot = value.clone();
                }
            }
        }
    };
    let rehash = matches!(m, LayoutMutation::Set { rehash: true, .. });
    let flip = |b: &mut Vec<u8>, d: Doc| {
        if let LayoutMutation::Flip(doc, at, mask) = m {
            if *doc == d && !b.is_empty() {
                let i = ((b.len() as u64 * u64::from(*at) / 1000) as usize).min(b.len() - 1);
                b[i] ^= (*mask).max(1);
            }
        }
    };
    set(&mut config, Doc::Config);
    let mut cbytes = config.to_string().into_bytes();
    let (cd, cs) = put(&cbytes);
    flip(&mut cbytes, Doc::Config);
    if rehash || matches!(m, LayoutMutation::Flip(..)) {
        std::fs::write(blobs.join(&cd[7..]), &cbytes).unwrap();
    }
    let (cd, cs) = if rehash { put(&cbytes) } else { (cd, cs) };
    let mut manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cs},
        "layers": layer_descs,
    });
    set(&mut manifest, Doc::Manifest);
    let mut mbytes = manifest.to_string().into_bytes();
    let (md, ms) = put(&mbytes);
    flip(&mut mbytes, Doc::Manifest);
    std::fs::write(blobs.join(&md[7..]), &mbytes).unwrap();
    let (md, ms) = if rehash { put(&mbytes) } else { (md, ms) };
    let mut index = json!({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": ms,
         "platform": {"os": "linux", "architecture": "amd64"}},
    ]});
    if let LayoutMutation::SelfNested = m {
        let ib = index.to_string();
        let (id, is) = put(ib.as_bytes());
        // A nested index that lists itself.
        let nested = json!({"schemaVersion": 2, "manifests": [
            {"mediaType": "application/vnd.oci.image.index.v1+json", "digest": id, "size": is}]});
        let nb = nested.to_string();
        std::fs::write(blobs.join(&id[7..]), &nb).unwrap();
        let real = sha(nb.as_bytes());
        std::fs::write(blobs.join(&real[7..]), &nb).unwrap();
        index = json!({"schemaVersion": 2, "manifests": [
            {"mediaType": "application/vnd.oci.image.index.v1+json", "digest": real, "size": nb.len()}]});
        // The nested one names `id`, whose content is itself: rewrite it so.
        let selfref = json!({"schemaVersion": 2, "manifests": [
            {"mediaType": "application/vnd.oci.image.index.v1+json", "digest": real, "size": nb.len()}]});
        std::fs::write(blobs.join(&id[7..]), selfref.to_string()).unwrap();
    }
    set(&mut index, Doc::Index);
    let mut ibytes = index.to_string().into_bytes();
    flip(&mut ibytes, Doc::Index);
    std::fs::write(dir.join("index.json"), &ibytes).unwrap();
    let marker = match m {
        LayoutMutation::Marker(s) => s.to_string(),
        _ => r#"{"imageLayoutVersion": "1.0.0"}"#.to_string(),
    };
    std::fs::write(dir.join("oci-layout"), marker).unwrap();
    if let LayoutMutation::BlobIs(kind, d) = m {
        let path = match d {
            Doc::Index => dir.join("index.json"),
            Doc::Manifest => blobs.join(&md[7..]),
            Doc::Config => blobs.join(&cd[7..]),
            Doc::Layer => match layers.first() {
                Some(l) => blobs.join(&sha(l)[7..]),
                // No layer to replace: the layout is valid.
                None => return false,
            },
        };
        let _ = std::fs::remove_file(&path);
        match kind {
            BlobKind::SymlinkOut => {
                std::os::unix::fs::symlink(outside.join("sentinel"), &path).unwrap()
            }
            BlobKind::Fifo => {
                nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap()
            }
            BlobKind::DevZero => nix::sys::stat::mknod(
                &path,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o644),
                nix::sys::stat::makedev(1, 5),
            )
            .unwrap(),
            BlobKind::Dir => std::fs::create_dir(&path).unwrap(),
            BlobKind::Missing => {}
        }
    }
    true
}

/// A clean small layer (a file, a directory, a whiteout of a lower file).
fn clean_layer() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        (
            prop::sample::select(vec!["a", "b", "d/c", ".wh.a", "d/.wh..wh..opq"]),
            prop::collection::vec(any::<u8>(), 0..64),
        ),
        0..4,
    )
    .prop_map(|files| {
        let mut b = Vec::new();
        for (n, data) in files {
            let data = if n.contains(".wh.") { Vec::new() } else { data };
            push(
                &mut b,
                header(
                    n.as_bytes(),
                    EntryType::Regular,
                    data.len() as u64,
                    0o644,
                    0,
                ),
                &data,
            );
        }
        b.extend(std::iter::repeat_n(0u8, 1024));
        b
    })
}

#[test]
fn fuzz_oci_layouts() {
    if !have_root("fuzz_oci_layouts") {
        return;
    }
    let started = Instant::now();
    let mut runner = TestRunner::new(Config {
        cases: cases(400),
        failure_persistence: None,
        ..Config::default()
    });
    let execs = std::sync::atomic::AtomicU64::new(0);
    let ok = std::sync::atomic::AtomicU64::new(0);
    let strategy = (
        prop::collection::vec(clean_layer(), 0..3),
        layout_mutation(),
    );
    let result = runner.run(&strategy, |(layers, m)| {
        execs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let s = Scene::new();
        let src = s.base.join("layout");
        let m = if write_layout(&src, &s.outside(), &layers, &m) {
            m
        } else {
            LayoutMutation::None
        };
        // The import runs in a thread: a blob that blocks (a fifo) must not
        // hang it.
        let (tx, rx) = std::sync::mpsc::channel();
        let (src2, staging) = (src.clone(), s.staging());
        std::thread::spawn(move || {
            let r = import_tree(
                &src2,
                &staging,
                &ImportOptions {
                    kind: ImportKind::Oci,
                    ..Default::default()
                },
            );
            let _ = tx.send(r);
        });
        let r = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .map_err(|_| TestCaseError::fail(format!("the import of a layout hung ({m:?})")))?;
        std::fs::remove_dir_all(&src).unwrap();
        s.untouched().map_err(TestCaseError::fail)?;
        match (&m, r) {
            (_, Ok(rep)) => {
                staged_tree_is_clean(&s.staging()).map_err(TestCaseError::fail)?;
                prop_assert!(
                    !matches!(
                        m,
                        LayoutMutation::BlobIs(..)
                            | LayoutMutation::SelfNested
                            | LayoutMutation::Marker(_)
                    ),
                    "a layout with {m:?} was imported: {rep:?}"
                );
                ok.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            (LayoutMutation::None, Err(e)) => {
                return Err(TestCaseError::fail(format!(
                    "a valid layout was refused: {e}"
                )))
            }
            (_, Err(e)) => {
                // Never the staging side, and a clear message.
                let msg = e.to_string();
                prop_assert!(
                    !msg.is_empty() && !matches!(e, ImportError::Staging { .. }),
                    "{msg}"
                );
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let secs = started.elapsed().as_secs_f64();
    let n = execs.into_inner();
    eprintln!(
        "fuzz_oci_layouts: {n} executions in {secs:.1} s, {:.0}/s, {} imported",
        n as f64 / secs,
        ok.into_inner()
    );
    layerstack_store::reliability::record(
        "fuzz-oci-layout",
        "A hostile OCI image layout (mutated index, nested index loops, manifest, config and blob descriptors; blobs that are symlinks out, fifos, devices, directories or missing) is imported as its descriptors say or refused with a clear error; it never hangs, and nothing is written outside the staging directory.",
        "cargo test -p layerstack-publisher --test fuzz_import fuzz_oci_layouts",
        &[
            ("executions", n.into()),
            ("executions_per_s", ((n as f64 / secs).round() as u64).into()),
            ("seconds", ((secs * 10.0).round() / 10.0).into()),
            ("bugs found by earlier runs (kept as regression cases)", 1u64.into()),
        ],
    )
    .expect("the reliability record is written");
}

/// The layout cases the fuzzing found, replayed: a blob or `index.json` that
/// is a fifo hung the import (the open blocked for a writer); a device such as
/// `/dev/zero` would have been read without end. Every non-regular blob is
/// refused, whatever document it stands for.
#[test]
fn layout_blobs_that_are_not_regular_files_are_refused() {
    if !have_root("layout_blobs_that_are_not_regular_files_are_refused") {
        return;
    }
    let layer = {
        let mut b = Vec::new();
        push(&mut b, header(b"a", EntryType::Regular, 1, 0o644, 0), b"a");
        b.extend(std::iter::repeat_n(0u8, 1024));
        b
    };
    for kind in [
        BlobKind::SymlinkOut,
        BlobKind::Fifo,
        BlobKind::DevZero,
        BlobKind::Dir,
        BlobKind::Missing,
    ] {
        for d in [Doc::Index, Doc::Manifest, Doc::Config, Doc::Layer] {
            let s = Scene::new();
            let src = s.base.join("layout");
            assert!(write_layout(
                &src,
                &s.outside(),
                std::slice::from_ref(&layer),
                &LayoutMutation::BlobIs(kind, d)
            ));
            let (tx, rx) = std::sync::mpsc::channel();
            let (src2, staging) = (src.clone(), s.staging());
            std::thread::spawn(move || {
                let _ = tx.send(import_tree(
                    &src2,
                    &staging,
                    &ImportOptions {
                        kind: ImportKind::Oci,
                        ..Default::default()
                    },
                ));
            });
            let r = rx
                .recv_timeout(std::time::Duration::from_secs(20))
                .unwrap_or_else(|_| panic!("the import of a layout whose {d:?} is {kind:?} hung"));
            let e = r.expect_err("imported");
            assert!(
                matches!(e, ImportError::Source { .. } | ImportError::Invalid(_)),
                "{kind:?} {d:?}: {e}"
            );
            std::fs::remove_dir_all(&src).unwrap();
            s.untouched().unwrap();
        }
    }
}

/// The `tar` crate reads a PAX header or GNU long name into memory whole: a
/// small gzip stream could make it read gigabytes. The reader under it stops
/// at 4 MiB of headers between two entries' data; a large file's data is not
/// headers and passes.
#[test]
fn headers_are_read_up_to_a_limit() {
    if !have_root("headers_are_read_up_to_a_limit") {
        return;
    }
    const BIG: usize = 64 << 20;
    for ty in [
        EntryType::XHeader,
        EntryType::GNULongName,
        EntryType::XGlobalHeader,
    ] {
        let mut b = Vec::new();
        push(
            &mut b,
            header(b"PaxHeader", ty, BIG as u64, 0o644, 0),
            &vec![b'a'; BIG],
        );
        push(&mut b, header(b"f", EntryType::Regular, 1, 0o644, 0), b"x");
        b.extend(std::iter::repeat_n(0u8, 1024));
        let s = Scene::new();
        let e = extract_tar_into(&s.staging(), std::io::Cursor::new(gzip(&b)), "big")
            .expect_err("a 64 MiB header was read");
        let msg = e.to_string() + &format!("{:?}", e);
        assert!(
            msg.contains("exceed") || msg.contains("over the"),
            "{ty:?}: {msg}"
        );
        s.untouched().unwrap();
    }
    // A 64 MiB file is data, not headers.
    let mut b = Vec::new();
    push(
        &mut b,
        header(b"big", EntryType::Regular, BIG as u64, 0o644, 0),
        &vec![b'a'; BIG],
    );
    b.extend(std::iter::repeat_n(0u8, 1024));
    let s = Scene::new();
    let r = extract_tar_into(&s.staging(), std::io::Cursor::new(gzip(&b)), "big").unwrap();
    assert_eq!(r.content_bytes, BIG as u64);
}

/// An upload into a live session's tree sets a symlink's xattrs nowhere:
/// Linux sets them by name only, and the session may swap the name for a
/// host file meanwhile. Refused, naming why; the same xattr on a file, a
/// fifo's metadata, and an import (no live tree) are applied.
#[test]
fn an_upload_sets_no_xattrs_on_symlinks() {
    if !have_root("an_upload_sets_no_xattrs_on_symlinks") {
        return;
    }
    let with_xattr = |ty: EntryType, name: &[u8]| {
        let mut b = Vec::new();
        let rec = pax_record("SCHILY.xattr.trusted.t", b"v");
        push(
            &mut b,
            header(b"PaxHeader", EntryType::XHeader, rec.len() as u64, 0o644, 0),
            &rec,
        );
        let mut h = header(name, ty, 0, 0o640, 7);
        if ty == EntryType::Symlink {
            h.set_link_name("target").unwrap();
        }
        push(&mut b, h, b"");
        b.extend(std::iter::repeat_n(0u8, 1024));
        b
    };
    let s = Scene::new();
    let e = extract_tar_into(
        &s.staging(),
        std::io::Cursor::new(with_xattr(EntryType::Symlink, b"l")),
        "upload",
    )
    .expect_err("a symlink's xattr was set in a live tree");
    assert!(format!("{e:?}").contains("symlink with xattrs"), "{e:?}");
    for (ty, name) in [(EntryType::Regular, &b"f"[..]), (EntryType::Fifo, b"p")] {
        let s = Scene::new();
        extract_tar_into(
            &s.staging(),
            std::io::Cursor::new(with_xattr(ty, name)),
            "upload",
        )
        .unwrap();
        let p = s.staging().join(std::str::from_utf8(name).unwrap());
        let md = std::fs::symlink_metadata(&p).unwrap();
        assert_eq!((md.uid(), md.mode() & 0o7777), (7, 0o640), "{ty:?}");
        assert_eq!(
            xattr::get(&p, "trusted.t").unwrap().as_deref(),
            Some(&b"v"[..]),
            "{ty:?}"
        );
    }
}

// ---------------------------------------------------------------------------
// Hostile directory trees, as `layerstack base import DIR` reads them.

/// One entry of a generated source tree.
#[derive(Debug, Clone)]
enum DirKind {
    File(Vec<u8>),
    Dir,
    /// `@OUT` is replaced by the scene's outside directory.
    Symlink(Vec<u8>),
    Fifo,
    Char(u32, u32),
    Block(u32, u32),
    Socket,
    /// A second link to the n-th regular file made before (mod their count).
    Hardlink(usize),
    /// A link to a file whose other link is outside the tree.
    HardlinkFromOutside,
}

#[derive(Debug, Clone)]
struct DirEnt {
    /// Index of the directory it goes in, among those made before (mod).
    parent: usize,
    name: Vec<u8>,
    kind: DirKind,
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: i64,
    xattrs: Vec<(String, Vec<u8>)>,
}

/// Names a directory entry can have: control characters, a newline, non-UTF-8
/// bytes, NAME_MAX bytes, OCI whiteout and opaque spellings.
fn dir_name() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        16 => prop::sample::select(vec![
            b"a".to_vec(),
            b"b".to_vec(),
            b"dir".to_vec(),
            b"x y".to_vec(),
            "é".as_bytes().to_vec(),
            b"\x01ctl".to_vec(),
            b"new\nline".to_vec(),
            b"-".to_vec(),
            b"...".to_vec(),
            b".hidden".to_vec(),
            vec![0xff, 0xfe],
            vec![b'n'; 255],
        ]),
        1 => prop::sample::select(vec![
            b".wh.a".to_vec(),
            b".wh..wh..opq".to_vec(),
            b".wh..wh.plnk".to_vec(),
        ]),
        8 => "[a-z]{1,6}".prop_map(String::into_bytes),
    ]
}

fn dir_kind() -> impl Strategy<Value = DirKind> {
    prop_oneof![
        6 => prop::collection::vec(any::<u8>(), 0..300).prop_map(DirKind::File),
        4 => Just(DirKind::Dir),
        3 => prop::sample::select(vec![
            b"@OUT".to_vec(),
            b"@OUT/sentinel".to_vec(),
            b"/".to_vec(),
            b"/etc/passwd".to_vec(),
            b"../../../../../..".to_vec(),
            b"a".to_vec(),
            b"loop".to_vec(),
            b"\x01".to_vec(),
            vec![b'l'; 4095],
        ])
        .prop_map(DirKind::Symlink),
        1 => Just(DirKind::Fifo),
        1 => prop::sample::select(vec![(0u32, 0u32), (1, 3), (5, 1)])
            .prop_map(|(a, b)| DirKind::Char(a, b)),
        1 => Just(DirKind::Block(7, 0)),
        1 => Just(DirKind::Socket),
        2 => any::<usize>().prop_map(DirKind::Hardlink),
        1 => Just(DirKind::HardlinkFromOutside),
    ]
}

fn dir_ent() -> impl Strategy<Value = DirEnt> {
    let xattr = prop_oneof![
        24 => Just(("user.note".to_string(), b"v".to_vec())),
        4 => Just(("user.big".to_string(), vec![b'x'; 3000])),
        4 => Just(("trusted.tag".to_string(), b"t".to_vec())),
        1 => Just(("trusted.overlay.opaque".to_string(), b"y".to_vec())),
        1 => Just(("user.overlay.redirect".to_string(), b"/x".to_vec())),
    ];
    (
        any::<usize>(),
        dir_name(),
        dir_kind(),
        prop::sample::select(vec![0o644u32, 0o755, 0o600, 0o4755, 0o1777, 0o000]),
        prop::sample::select(vec![0u32, 1000, 65534, 4_000_000_000]),
        prop::sample::select(vec![0u32, 100, 65534]),
        prop::sample::select(vec![0i64, 1, 1_700_000_000, 4_102_444_800]),
        prop::collection::vec(xattr, 0..2),
    )
        .prop_map(
            |(parent, name, kind, mode, uid, gid, mtime, xattrs)| DirEnt {
                parent,
                name,
                kind,
                mode,
                uid,
                gid,
                mtime,
                xattrs,
            },
        )
}

/// Makes the tree of `ents` at `src` (entries whose place is taken, or that
/// the kernel refuses, are left out); `far` holds the other links of
/// [`DirKind::HardlinkFromOutside`].
fn make_tree(src: &Path, far: &Path, outside: &Path, ents: &[DirEnt]) {
    use rustix::fs as rfs;
    std::fs::create_dir_all(src).unwrap();
    std::fs::create_dir_all(far).unwrap();
    let mut dirs = vec![src.to_path_buf()];
    let mut files: Vec<PathBuf> = Vec::new();
    for (i, e) in ents.iter().enumerate() {
        let p = dirs[e.parent % dirs.len()].join(std::ffi::OsStr::from_bytes(&e.name));
        if p.symlink_metadata().is_ok() {
            continue;
        }
        let made = match &e.kind {
            DirKind::File(c) => std::fs::write(&p, c).is_ok(),
            DirKind::Dir => std::fs::create_dir(&p).is_ok(),
            DirKind::Symlink(t) => {
                let t = subst(t, outside.as_os_str().as_bytes());
                std::os::unix::fs::symlink(std::ffi::OsStr::from_bytes(&t), &p).is_ok()
            }
            DirKind::Fifo => rfs::mknodat(
                rfs::CWD,
                &p,
                rfs::FileType::Fifo,
                rfs::Mode::from_raw_mode(0o644),
                0,
            )
            .is_ok(),
            DirKind::Char(a, b) | DirKind::Block(a, b) => rfs::mknodat(
                rfs::CWD,
                &p,
                if matches!(e.kind, DirKind::Char(..)) {
                    rfs::FileType::CharacterDevice
                } else {
                    rfs::FileType::BlockDevice
                },
                rfs::Mode::from_raw_mode(0o644),
                rfs::makedev(*a, *b),
            )
            .is_ok(),
            DirKind::Socket => std::os::unix::net::UnixListener::bind(&p).is_ok(),
            DirKind::Hardlink(n) => {
                !files.is_empty() && std::fs::hard_link(&files[n % files.len()], &p).is_ok()
            }
            DirKind::HardlinkFromOutside => {
                let f = far.join(format!("f{i}"));
                std::fs::write(&f, b"far\n").unwrap();
                std::fs::hard_link(&f, &p).is_ok()
            }
        };
        if !made {
            continue;
        }
        let md = p.symlink_metadata().unwrap();
        let ft = md.file_type();
        // Owner, xattrs, mode, then the mtime (chown and chmod keep it).
        let _ = rfs::chownat(
            rfs::CWD,
            &p,
            Some(rfs::Uid::from_raw(e.uid)),
            Some(rfs::Gid::from_raw(e.gid)),
            rfs::AtFlags::SYMLINK_NOFOLLOW,
        );
        for (k, v) in &e.xattrs {
            let _ = rfs::lsetxattr(&p, k.as_str(), v, rfs::XattrFlags::empty());
        }
        if !ft.is_symlink() {
            let _ =
                std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(e.mode));
        }
        let t = rfs::Timespec {
            tv_sec: e.mtime,
            tv_nsec: 0,
        };
        let _ = rfs::utimensat(
            rfs::CWD,
            &p,
            &rfs::Timestamps {
                last_access: t,
                last_modification: t,
            },
            rfs::AtFlags::SYMLINK_NOFOLLOW,
        );
        if ft.is_dir() {
            dirs.push(p);
        } else if ft.is_file() {
            files.push(p);
        }
    }
}

/// One entry of a tree as the tests compare it: type, mode, owner, rdev,
/// content or target, xattrs, mtime (not of directories: their entries move
/// it), and the index of its inode (hardlinks share one).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    kind: &'static str,
    mode: u32,
    uid: u32,
    gid: u32,
    rdev: u64,
    data: Vec<u8>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    mtime: i64,
    inode: usize,
}

/// Every entry below `root` (not following symlinks), sockets left out.
fn seen_tree(root: &Path) -> std::collections::BTreeMap<Vec<u8>, Seen> {
    let mut out = std::collections::BTreeMap::new();
    let mut inodes: Vec<u64> = Vec::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let md = p.symlink_metadata().unwrap();
            let ft = md.file_type();
            if ft.is_socket() {
                continue;
            }
            let (kind, data) = if ft.is_dir() {
                todo.push(p.clone());
                ("dir", Vec::new())
            } else if ft.is_symlink() {
                (
                    "symlink",
                    std::fs::read_link(&p)
                        .unwrap()
                        .as_os_str()
                        .as_bytes()
                        .to_vec(),
                )
            } else if ft.is_file() {
                ("file", std::fs::read(&p).unwrap())
            } else if ft.is_fifo() {
                ("fifo", Vec::new())
            } else if ft.is_char_device() {
                ("char", Vec::new())
            } else {
                ("block", Vec::new())
            };
            let mut xattrs: Vec<(Vec<u8>, Vec<u8>)> = xattr::list(&p)
                .into_iter()
                .flatten()
                .map(|k| {
                    let v = xattr::get(&p, &k).ok().flatten().unwrap_or_default();
                    (k.as_bytes().to_vec(), v)
                })
                .collect();
            xattrs.sort();
            let inode = match inodes.iter().position(|&i| i == md.ino()) {
                Some(i) => i,
                None => {
                    inodes.push(md.ino());
                    inodes.len() - 1
                }
            };
            let rel = p
                .strip_prefix(root)
                .unwrap()
                .as_os_str()
                .as_bytes()
                .to_vec();
            out.insert(
                rel,
                Seen {
                    kind,
                    mode: if ft.is_symlink() {
                        0
                    } else {
                        md.mode() & 0o7777
                    },
                    uid: md.uid(),
                    gid: md.gid(),
                    rdev: md.rdev(),
                    data,
                    xattrs,
                    mtime: if ft.is_dir() { 0 } else { md.mtime() },
                    inode: usize::MAX,
                },
            );
            out.get_mut(
                &p.strip_prefix(root)
                    .unwrap()
                    .as_os_str()
                    .as_bytes()
                    .to_vec(),
            )
            .unwrap()
            .inode = inode;
        }
    }
    out
}

/// Why a source tree must be refused, by the rules in the import module's
/// docs: a 0:0 character device (overlayfs's whiteout), an overlayfs-private
/// xattr, a name an OCI layer tar reads as a whiteout (`.wh.*`); `None`: it
/// must be imported.
fn dir_must_refuse(tree: &std::collections::BTreeMap<Vec<u8>, Seen>) -> Option<String> {
    tree.iter().find_map(|(rel, s)| {
        if rel.split(|&b| b == b'/').any(|c| c.starts_with(b".wh.")) {
            return Some(format!("{}: a whiteout name", String::from_utf8_lossy(rel)));
        }
        let rel = String::from_utf8_lossy(rel);
        if s.kind == "char" && s.rdev == 0 {
            return Some(format!("{rel}: a 0:0 character device"));
        }
        s.xattrs
            .iter()
            .find(|(k, _)| k.starts_with(b"trusted.overlay.") || k.starts_with(b"user.overlay."))
            .map(|(k, _)| format!("{rel}: xattr {}", String::from_utf8_lossy(k)))
    })
}

/// The hardlink structure of a tree: which entries share an inode.
fn link_groups(tree: &std::collections::BTreeMap<Vec<u8>, Seen>) -> BTreeSet<Vec<Vec<u8>>> {
    let mut by: std::collections::BTreeMap<usize, Vec<Vec<u8>>> = Default::default();
    for (rel, s) in tree {
        by.entry(s.inode).or_default().push(rel.clone());
    }
    by.into_values().filter(|g| g.len() > 1).collect()
}

#[test]
fn fuzz_directories() {
    if !have_root("fuzz_directories") {
        return;
    }
    let started = Instant::now();
    let mut runner = TestRunner::new(Config {
        cases: cases(300),
        failure_persistence: None,
        ..Config::default()
    });
    let execs = std::sync::atomic::AtomicU64::new(0);
    let refused = std::sync::atomic::AtomicU64::new(0);
    let result = runner.run(&prop::collection::vec(dir_ent(), 1..16), |ents| {
        execs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let scene = Scene::new();
        // The source and the far side of its outside links: in a directory of
        // their own, on the same filesystem (hardlinks), not beside staging.
        let srcs = tempfile::Builder::new()
            .prefix("layerstack-fuzz-src-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let src = srcs.path().join("tree");
        make_tree(&src, &srcs.path().join("far"), &scene.outside(), &ents);
        let before = seen_tree(&src);
        let must = dir_must_refuse(&before);
        let r = import_tree(
            &src,
            &scene.staging(),
            &ImportOptions {
                kind: ImportKind::Dir,
                ..Default::default()
            },
        );
        let fail = |m: String| TestCaseError::fail(format!("{m}\nsource tree: {before:#?}"));
        scene.untouched().map_err(fail)?;
        if seen_tree(&src) != before {
            return Err(fail("the import changed its source".into()));
        }
        match r {
            Ok(report) => {
                if let Some(why) = must {
                    return Err(fail(format!(
                        "imported a tree that must be refused ({why}): {report:?}"
                    )));
                }
                staged_tree_is_clean(&scene.staging()).map_err(fail)?;
                let staged = seen_tree(&scene.staging());
                if staged.keys().collect::<Vec<_>>() != before.keys().collect::<Vec<_>>() {
                    return Err(fail(format!(
                        "staged entries differ from the source's: staged {:?}",
                        staged
                            .keys()
                            .map(|k| String::from_utf8_lossy(k))
                            .collect::<Vec<_>>()
                    )));
                }
                for (rel, want) in &before {
                    let got = &staged[rel];
                    let (mut g, mut w) = (got.clone(), want.clone());
                    g.inode = 0;
                    w.inode = 0;
                    if g != w {
                        return Err(fail(format!(
                            "{} staged as {got:?}, the source holds {want:?}",
                            String::from_utf8_lossy(rel)
                        )));
                    }
                }
                if link_groups(&staged) != link_groups(&before) {
                    return Err(fail(format!(
                        "hardlinks staged {:?}, the source's {:?}",
                        link_groups(&staged),
                        link_groups(&before)
                    )));
                }
            }
            Err(e) => {
                error_is_clear(&e).map_err(fail)?;
                if must.is_none() {
                    return Err(fail(format!("refused a tree the rules accept: {e}")));
                }
                refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let secs = started.elapsed().as_secs_f64();
    let n = execs.into_inner();
    let refused = refused.into_inner();
    eprintln!(
        "fuzz_directories: {n} executions in {secs:.1} s, {:.0}/s, {refused} refused",
        n as f64 / secs,
    );
    assert!(
        refused < n,
        "every tree was refused: the fuzzer tested nothing but refusals"
    );
    layerstack_store::reliability::record(
        "fuzz-import-dirs",
        "A hostile directory tree given to `base import` (control, newline, non-UTF-8 and NAME_MAX names, symlinks to / and out of the tree and 4095-byte targets, fifos, devices, sockets, hardlinks inside and from outside the tree, setuid and 0000 modes, foreign owners, user and trusted xattrs) is staged exactly as it is — type, content or target, mode, owner, device, xattrs, mtime, hardlinks — sockets left out, or refused naming the entry when it holds what a base cannot (a 0:0 character device, an overlayfs-private xattr, a `.wh.*` name); the source is never changed and nothing is written outside the staging directory.",
        "cargo test -p layerstack-publisher --test fuzz_import fuzz_directories",
        &[
            ("executions", n.into()),
            ("refused", refused.into()),
            ("executions_per_s", ((n as f64 / secs).round() as u64).into()),
            ("seconds", ((secs * 10.0).round() / 10.0).into()),
            // `.wh.*` names were staged as plain entries, which a layer tar
            // of the base reads as whiteouts.
            ("bugs found by earlier runs (kept as regression cases)", 1u64.into()),
        ],
    )
    .expect("the reliability record is written");
}
