//! Metadata of an upper entry as the gate decides it ([`Meta`]), and the one
//! function that sets it ([`set_meta`]): used by the upper writer
//! ([`crate::apply`]) and by sealing (`layer.rs`), which depend on it, never the
//! other way round.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::capture::is_overlay_private;
use crate::fsx;
use crate::view::opaque_name;

/// Extended attributes as `(name, value)` pairs, sorted by name.
pub type XattrList = Vec<(Vec<u8>, Vec<u8>)>;

/// Metadata the gate sets on an upper entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    /// Permission bits incl. setuid/setgid/sticky (ignored for symlinks).
    pub mode: u32,
    /// Owner user id.
    pub uid: u32,
    /// Owner group id.
    pub gid: u32,
    /// The complete set of non-private xattrs, sorted by name.
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

/// Sets owner, then mode (not for a symlink), then exactly `meta.xattrs` as the
/// non-private xattrs of the entry at `p` (not followed); overlay-private names and
/// the opaque marker of the mount's namespace stay.
pub(crate) fn set_meta(p: &Path, meta: &Meta, userxattr: bool) -> io::Result<()> {
    let md = std::fs::symlink_metadata(p)?;
    std::os::unix::fs::lchown(p, Some(meta.uid), Some(meta.gid))?;
    if !md.file_type().is_symlink() {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(meta.mode))?;
    }
    let current = fsx::xattrs_of(p)?;
    let wanted: BTreeMap<&[u8], &[u8]> = meta
        .xattrs
        .iter()
        .map(|(n, v)| (n.as_slice(), v.as_slice()))
        .collect();
    let opaque = opaque_name(userxattr).as_bytes();
    for (n, _) in &current {
        let keep =
            wanted.contains_key(n.as_slice()) || n == opaque || is_overlay_private(n, userxattr);
        if !keep {
            xattr::remove(p, std::ffi::OsStr::from_bytes(n))?;
        }
    }
    for (n, v) in &wanted {
        xattr::set(p, std::ffi::OsStr::from_bytes(n), v)?;
    }
    Ok(())
}
