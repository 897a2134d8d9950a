//! A base imported without containerd (`layerstack base import`): a
//! directory tree, a layer tar, or an OCI image layout, flattened into ONE
//! directory — the staged tree that becomes a stack's base layer.
//!
//! * **dir** — copied as it is (`copy.rs`): mode, numeric owner, mtime,
//!   xattrs, symlinks (never followed), hardlinks inside the tree, devices and
//!   fifos; sockets skipped.
//! * **tar** — one layer tar, plain, gzip or zstd by its first bytes
//!   (`tarball.rs`); OCI whiteouts in it apply over nothing and leave nothing.
//! * **oci** — an image layout's manifest (`oci.rs`), its layers applied in
//!   order: layer *k*'s whiteouts and opaque markers remove what layers < *k*
//!   made; the result has no whiteouts.
//!
//! [`apply_layer_tar`] is the other way to apply a layer: one tar kept in
//! overlay upper format (whiteouts as 0:0 devices, opaque directories by
//! xattr), for a layer pulled from a registry into a store.
//!
//! The staged tree is written beneath its root only (`stage.rs`): absolute
//! names, `..`, entries through a symlink an earlier entry planted, hardlinks
//! to outside, overlayfs-private xattrs and 0:0 character devices (a whiteout
//! in overlay format) are refused, naming the entry — never guessed at; so is
//! a directory's entry named `.wh.*`, which a layer tar of the base would
//! turn into a whiteout or an opaque marker. A
//! refusal leaves the staging directory to the caller, who drops it: nothing
//! of a refused input is ever committed.
//!
//! The result is deterministic for a given content — entry metadata and
//! content as given, directory mtimes as given (0 for a directory only
//! implied by an entry below it), the root 0755 0:0 mtime 0 — so that
//! [`write_layer_tar`](crate::write_layer_tar) of it (the digest the engine
//! computes) is the same for the same tree given as a directory, as a tar or
//! as a one-layer OCI layout.

mod copy;
mod oci;
mod stage;
mod tarball;
#[cfg(test)]
mod tests;

use std::io::Read;
use std::path::{Path, PathBuf};

pub use oci::host_platform;

/// What an import reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImportKind {
    /// A directory holding `oci-layout` is an OCI layout, another directory a
    /// tree, a file a tar.
    #[default]
    Auto,
    /// A directory tree.
    Dir,
    /// A layer tar (plain, gzip or zstd).
    Tar,
    /// An OCI image layout directory.
    Oci,
}

impl ImportKind {
    /// `auto`, `dir`, `tar` or `oci`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Dir => "dir",
            Self::Tar => "tar",
            Self::Oci => "oci",
        }
    }

    /// Parses [`ImportKind::as_str`]'s names ("" is `auto`).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "" | "auto" => Some(Self::Auto),
            "dir" => Some(Self::Dir),
            "tar" => Some(Self::Tar),
            "oci" => Some(Self::Oci),
            _ => None,
        }
    }
}

/// Options of [`import_tree`].
#[derive(Debug, Clone, Default)]
pub struct ImportOptions {
    /// What the source is.
    pub kind: ImportKind,
    /// OCI layouts: the manifest's platform, `os/arch[/variant]`; `None`: the
    /// only manifest, else the only one for [`host_platform`].
    pub platform: Option<String>,
    /// `syncfs(2)` the staged tree before returning (the durable profile).
    pub sync: bool,
}

/// What [`import_tree`] made.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImportReport {
    /// The kind read (never `Auto`).
    pub kind: ImportKind,
    /// Layer tars applied (0 for a directory).
    pub layers: u64,
    /// OCI layouts: the manifest applied, `sha256:<hex>`.
    pub manifest: Option<String>,
    /// OCI layouts: its platform, when its descriptor names one.
    pub platform: Option<String>,
    /// Regular files written.
    pub files: u64,
    /// Directory entries applied.
    pub dirs: u64,
    /// Directories made because an entry lay below them.
    pub implied_dirs: u64,
    /// Symlinks made.
    pub symlinks: u64,
    /// Hardlinks made (names of a file written before).
    pub hardlinks: u64,
    /// Devices and fifos.
    pub specials: u64,
    /// Whiteouts applied (they leave nothing).
    pub whiteouts: u64,
    /// Opaque markers applied (they leave nothing).
    pub opaque: u64,
    /// Sockets of a directory, skipped.
    pub sockets_skipped: u64,
    /// Bytes of file content written.
    pub content_bytes: u64,
}

/// Why [`import_tree`] failed. Nothing of the input is kept by the caller.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The source, or a file of it, cannot be read.
    #[error("cannot read {what} {}", path.display())]
    Source {
        /// What it is (`the tar file`, `layer blob`).
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// The system call's error.
        #[source]
        source: std::io::Error,
    },
    /// The source does not exist.
    #[error("{} does not exist: name the path as the daemon sees it (it reads it in its own mount namespace)", .0.display())]
    Missing(PathBuf),
    /// The source is not what its kind needs; the message says what to do.
    #[error("{0}")]
    Invalid(String),
    /// An archive that cannot be read to its end (truncated, corrupt).
    #[error("cannot read {origin}{}: the archive is truncated or corrupt", after.as_ref().map(|a| format!(" after entry {}", stage::show(a))).unwrap_or_default())]
    Archive {
        /// The archive: a path, `layer 2/3 (sha256:…) of <layout>`.
        origin: String,
        /// The last entry read whole.
        after: Option<Vec<u8>>,
        /// The read error.
        #[source]
        source: std::io::Error,
    },
    /// An entry that is unsafe or that a base cannot hold.
    #[error(
        "refused entry {} of {origin}: {reason}; nothing was imported",
        stage::show(entry)
    )]
    Refused {
        /// The input: a path, `layer 2/3 (sha256:…) of <layout>`.
        origin: String,
        /// The entry's name as the input gave it.
        entry: Vec<u8>,
        /// Why, and what to do.
        reason: String,
    },
    /// A blob or a layer whose bytes are not what their descriptor says.
    #[error("{what} of OCI layout {} is not what its descriptor says: expected {expected}, found {found}; the layout is corrupt or was changed (copy it again)", layout.display())]
    Digest {
        /// The blob or layer.
        what: String,
        /// The layout directory.
        layout: PathBuf,
        /// What its descriptor (or the config's diff ID) says.
        expected: String,
        /// What its bytes are.
        found: String,
    },
    /// Writing the staged tree failed (a full disk, …).
    #[error("cannot {what} {} in staging directory {}", stage::show(entry), staging.display())]
    Staging {
        /// The step (`create`, `set the owner of`).
        what: &'static str,
        /// The entry's normalized path (empty: the tree as a whole).
        entry: Vec<u8>,
        /// The staging directory.
        staging: PathBuf,
        /// The system call's error.
        #[source]
        source: std::io::Error,
    },
}

impl ImportError {
    /// Whether the input is at fault (not the staging side).
    pub fn is_input(&self) -> bool {
        !matches!(self, Self::Staging { .. })
    }

    /// Whether the source does not exist.
    pub fn is_not_found(&self) -> bool {
        match self {
            Self::Missing(_) => true,
            Self::Source { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
            _ => false,
        }
    }
}

/// Builds the flattened tree of `source` in `staging`, an existing empty
/// directory (see the module docs).
///
/// # Errors
/// [`ImportError`]; `staging` then holds part of the tree: drop it.
pub fn import_tree(
    source: &Path,
    staging: &Path,
    options: &ImportOptions,
) -> Result<ImportReport, ImportError> {
    let md = std::fs::metadata(source).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            ImportError::Missing(source.to_path_buf())
        } else {
            ImportError::Source {
                what: "the import source",
                path: source.to_path_buf(),
                source: e,
            }
        }
    })?;
    let kind = match options.kind {
        ImportKind::Auto if md.is_dir() => {
            match std::fs::symlink_metadata(source.join("oci-layout")) {
                Ok(m) if m.is_file() => ImportKind::Oci,
                _ => ImportKind::Dir,
            }
        }
        ImportKind::Auto => ImportKind::Tar,
        k => k,
    };
    let wrong = |want: &str| {
        ImportError::Invalid(format!(
            "{} is {}, not {want} (kind {}): name another path, or --kind auto",
            source.display(),
            if md.is_dir() {
                "a directory"
            } else {
                "not a directory"
            },
            kind.as_str()
        ))
    };
    let mut stage = if kind == ImportKind::Dir {
        stage::Stage::untracked(staging)
    } else {
        stage::Stage::new(staging)
    };
    let mut chosen = None;
    match kind {
        ImportKind::Dir | ImportKind::Oci if !md.is_dir() => return Err(wrong("a directory")),
        ImportKind::Tar if !md.is_file() => return Err(wrong("a tar file")),
        ImportKind::Dir => {
            refuse_staging_inside(source, staging)?;
            copy::copy_tree(source, &mut stage)?;
        }
        ImportKind::Tar => {
            let f = std::fs::File::open(source).map_err(|e| ImportError::Source {
                what: "the tar file",
                path: source.to_path_buf(),
                source: e,
            })?;
            let origin = source.display().to_string();
            tarball::apply_file(
                f,
                &mut stage,
                &tarball::ApplyOptions {
                    origin: &origin,
                    refuse_layout: options.kind == ImportKind::Auto,
                    shift: None,
                },
            )?;
        }
        ImportKind::Oci => {
            chosen = Some(oci::import_layout(
                source,
                options.platform.as_deref(),
                &mut stage,
            )?);
        }
        ImportKind::Auto => unreachable!("resolved above"),
    }
    let mut report = stage.finish().map_err(finish_err(staging))?;
    report.kind = kind;
    report.layers = match (&chosen, kind) {
        (Some(c), _) => c.layers,
        (None, ImportKind::Tar) => 1,
        _ => 0,
    };
    if let Some(c) = chosen {
        report.manifest = Some(c.manifest);
        report.platform = c.platform;
    }
    if options.sync {
        crate::layer::sync(staging).map_err(|e| ImportError::Staging {
            what: "sync",
            entry: Vec::new(),
            staging: staging.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        })?;
    }
    Ok(report)
}

/// The error of [`stage::Stage::finish`] on the tree in `staging`.
fn finish_err(staging: &Path) -> impl FnOnce(stage::StageError) -> ImportError + '_ {
    move |e| match e {
        stage::StageError::Refused(r) => ImportError::Invalid(r),
        stage::StageError::Io(what, source) => ImportError::Staging {
            what,
            entry: Vec::new(),
            staging: staging.to_path_buf(),
            source,
        },
        stage::StageError::Read(source) => ImportError::Staging {
            what: "read",
            entry: Vec::new(),
            staging: staging.to_path_buf(),
            source,
        },
    }
}

/// Refuses to copy a directory that holds the staging directory (the store
/// itself, or `/`): the copy would copy itself.
fn refuse_staging_inside(source: &Path, staging: &Path) -> Result<(), ImportError> {
    let (Ok(src), Ok(stg)) = (source.canonicalize(), staging.canonicalize()) else {
        return Ok(());
    };
    if stg.starts_with(&src) {
        return Err(ImportError::Invalid(format!(
            "{} holds the store's staging directory {}: import a directory outside the store",
            source.display(),
            staging.display()
        )));
    }
    Ok(())
}

/// Extracts one tar stream (plain, gzip or zstd) into the existing directory
/// `dir`, which may hold files already: every entry is checked and written as
/// an import's are (see the module docs: absolute names, `..`, writes through
/// a symlink — one that was there before as well as one an entry planted —,
/// hardlinks to outside, overlayfs-private xattrs and 0:0 character devices
/// are refused, naming the entry; so are OCI whiteouts and opaque markers,
/// which have no layer below to hide here). The metadata of `dir` itself is
/// left as it is. `origin` names the stream in messages. For the daemon's `UploadTar`.
///
/// # Errors
/// [`ImportError`]; entries before a refused one stay written.
pub fn extract_tar_into(
    dir: &Path,
    r: impl Read,
    origin: &str,
) -> Result<ImportReport, ImportError> {
    extract_tar_into_shifted(dir, r, origin, None)
}

/// [`extract_tar_into`] with every entry's owner shifted into a uid/gid
/// mapping `(host_uid, host_gid, size)`: uid `u` is written as
/// `host_uid + u` (a session whose processes run in a user namespace with
/// that mapping sees `u`); an owner ≥ `size` refuses the archive
/// ([`ImportError::Refused`]).
pub fn extract_tar_into_shifted(
    dir: &Path,
    r: impl Read,
    origin: &str,
    shift: Option<(u32, u32, u32)>,
) -> Result<ImportReport, ImportError> {
    let mut stage = stage::Stage::untracked(dir);
    stage.keep_root = true;
    stage.live = true;
    if let Some((host_uid, host_gid, _)) = shift {
        // Directories the archive implies are the session's root's.
        stage.implied_owner = (host_uid, host_gid);
    }
    tarball::apply_file(
        r,
        &mut stage,
        &tarball::ApplyOptions {
            origin,
            refuse_layout: false,
            shift,
        },
    )?;
    let mut report = stage.finish().map_err(finish_err(dir))?;
    report.kind = ImportKind::Tar;
    report.layers = 1;
    Ok(report)
}

/// Options of [`apply_layer_tar`].
#[derive(Debug, Clone, Default)]
pub struct LayerApplyOptions {
    /// The store's overlay mounts use `userxattr` (rootless): opaque
    /// directories are marked `user.overlay.opaque`, else
    /// `trusted.overlay.opaque` — as [`TarOptions::userxattr`](crate::TarOptions)
    /// reads them back.
    pub userxattr: bool,
    /// Leave the metadata of `dir` itself as the caller set it (a layer tar
    /// holds no entry for its root; a published layer's root carries the
    /// metadata of the root below it, which the caller knows). Otherwise the
    /// root is 0755, 0:0, mtime 0, no xattrs (an imported base's root).
    pub keep_root: bool,
    /// `syncfs(2)` the directory before returning (the durable profile).
    pub sync: bool,
}

/// What [`apply_layer_tar`] made.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerApplied {
    /// Entries made (`whiteouts`: 0:0 character devices; `opaque`:
    /// directories marked opaque).
    pub report: ImportReport,
    /// `sha256:<hex>` of the uncompressed tar as read, to its very end: the
    /// layer's diff ID (OCI image-spec `config.md`), for the caller to check
    /// against the image config's `rootfs.diff_ids`.
    pub diff_id: String,
    /// Bytes of the uncompressed tar.
    pub tar_bytes: u64,
}

/// Applies ONE layer tar (plain, gzip or zstd, told by its first bytes)
/// onto the existing empty directory `dir`, keeping it in overlay upper
/// format — a layer directory as a publish or a checkpoint leaves it, which
/// a mount can take as a lower layer as it is — instead of flattening it:
/// `.wh.<name>` becomes the whiteout `<name>` (a 0:0 character device, mode
/// 0, the entry's owner and mtime), `.wh..wh..opq` the opaque xattr of its
/// directory (see `stage.rs`, "Overlay mode"). It is the inverse of
/// [`write_layer_tar`](crate::write_layer_tar): a layer written as a tar and
/// applied again is the same tree (times in whole seconds; a whiteout's
/// mode 0), so its tar — and diff ID — is the same. Every entry is checked as
/// an import's (absolute names, `..`, writes through a symlink, hardlinks to
/// outside, overlayfs-private xattrs and 0:0 character devices in the tar are
/// refused, naming the entry); an opaque marker at the root is refused too.
/// `origin` names the tar in messages (`layer 2/5 (sha256:…) of
/// registry/repo:tag`).
///
/// # Errors
/// [`ImportError`]; `dir` then holds part of the layer: drop it.
pub fn apply_layer_tar(
    dir: &Path,
    r: impl Read,
    origin: &str,
    options: &LayerApplyOptions,
) -> Result<LayerApplied, ImportError> {
    let mut stage = stage::Stage::overlay(dir, options.userxattr);
    stage.keep_root = options.keep_root;
    let mut r = std::io::BufReader::with_capacity(256 * 1024, r);
    let c = tarball::sniff(&mut r, origin)?;
    let mut tar =
        oci::Hashing::new(
            tarball::decompressed(r, c).map_err(|e| ImportError::Archive {
                origin: origin.to_string(),
                after: None,
                source: e,
            })?,
        );
    tarball::apply(
        &mut tar,
        &mut stage,
        &tarball::ApplyOptions {
            origin,
            refuse_layout: false,
            shift: None,
        },
    )?;
    let mut report = stage.finish().map_err(finish_err(dir))?;
    report.kind = ImportKind::Tar;
    report.layers = 1;
    if options.sync {
        crate::layer::sync(dir).map_err(|e| ImportError::Staging {
            what: "sync",
            entry: Vec::new(),
            staging: dir.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        })?;
    }
    Ok(LayerApplied {
        report,
        diff_id: tar.digest(),
        tar_bytes: tar.bytes,
    })
}

/// Applies layer tars in order onto `staging` (an existing, empty directory)
/// with OCI whiteouts, as an OCI layout's layers are (see the module docs);
/// `layers` are (name for messages, reader) pairs. For tests and tools that
/// hold layers outside a layout.
///
/// # Errors
/// As [`import_tree`].
pub fn flatten_layer_tars<'a>(
    staging: &Path,
    layers: impl IntoIterator<Item = (String, Box<dyn Read + 'a>)>,
) -> Result<ImportReport, ImportError> {
    let mut stage = stage::Stage::new(staging);
    let mut n = 0;
    for (origin, r) in layers {
        if n > 0 {
            stage.next_layer();
        }
        tarball::apply_file(
            r,
            &mut stage,
            &tarball::ApplyOptions {
                origin: &origin,
                refuse_layout: false,
                shift: None,
            },
        )?;
        n += 1;
    }
    let mut report = stage.finish().map_err(finish_err(staging))?;
    report.kind = if n == 1 {
        ImportKind::Tar
    } else {
        ImportKind::Oci
    };
    report.layers = n;
    Ok(report)
}
