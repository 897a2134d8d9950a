//! Proof that an upper is quiescent: no overlay mount in **any** mount namespace
//! uses it as `upperdir` (ARCHITECTURE.md §8). Looking only at the daemon's own
//! `/proc/self/mountinfo` misses a container's or a Mode B holder's private
//! namespace.
//!
//! A census reads `/proc/<pid>/ns/mnt` of every process, and the `mountinfo` of
//! one process per distinct mount namespace, collecting the `upperdir=` option of
//! every overlay. Censuses are shared: a caller that asks at time `t` is answered
//! by the first census that *started* after `t` (concurrent publishes of a
//! thousand sessions cost a handful of censuses, not a thousand).
//!
//! Limit: a mount namespace kept alive with no process in it (a bind-mounted
//! `/proc/<pid>/ns/mnt`, as `ip netns` does for network namespaces) is not seen.

use std::collections::HashSet;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::Mutex;

/// The upperdirs of every overlay mount of every mount namespace with a process.
///
/// # Errors
/// Reading `/proc` itself failed (a process that exits meanwhile is skipped).
pub fn scan_upperdirs() -> io::Result<HashSet<PathBuf>> {
    let mut namespaces: HashSet<Vec<u8>> = HashSet::new();
    let mut uppers = HashSet::new();
    for ent in std::fs::read_dir("/proc")? {
        let Ok(ent) = ent else { continue };
        let name = ent.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let ns = match std::fs::read_link(format!("/proc/{pid}/ns/mnt")) {
            Ok(l) => l.into_os_string().into_encoded_bytes(),
            Err(_) => continue,
        };
        if !namespaces.insert(ns) {
            continue;
        }
        let Ok(info) = std::fs::read(format!("/proc/{pid}/mountinfo")) else {
            // Exited meanwhile: another process of the namespace (if any) is read
            // when the namespace is seen again.
            continue;
        };
        collect_upperdirs(&info, &mut uppers);
    }
    Ok(uppers)
}

/// Adds the `upperdir=` of every overlay line of a `mountinfo` to `out`.
/// Fields (proc(5)): `… - fstype source superoptions`; paths escape space, tab,
/// newline and backslash as octal (`\040`).
fn collect_upperdirs(info: &[u8], out: &mut HashSet<PathBuf>) {
    for line in info.split(|&b| b == b'\n') {
        let Some(sep) = find(line, b" - ") else {
            continue;
        };
        let mut rest = line[sep + 3..].split(|&b| b == b' ');
        if rest.next() != Some(b"overlay") {
            continue;
        }
        let _source = rest.next();
        let Some(opts) = rest.next() else { continue };
        for opt in opts.split(|&b| b == b',') {
            if let Some(v) = opt.strip_prefix(b"upperdir=") {
                use std::os::unix::ffi::OsStringExt;
                out.insert(PathBuf::from(std::ffi::OsString::from_vec(unescape(v))));
            }
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Undoes mountinfo's octal escapes (`\040` → space).
fn unescape(v: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len());
    let mut i = 0;
    while i < v.len() {
        if v[i] == b'\\'
            && i + 4 <= v.len()
            && v[i + 1..i + 4].iter().all(|b| (b'0'..=b'7').contains(b))
        {
            let n = u16::from(v[i + 1] - b'0') * 64
                + u16::from(v[i + 2] - b'0') * 8
                + u16::from(v[i + 3] - b'0');
            out.push(u8::try_from(n).unwrap_or(b'?'));
            i += 4;
            continue;
        }
        out.push(v[i]);
        i += 1;
    }
    out
}

/// Shared censuses (see the module docs).
pub(crate) struct Census {
    last: Mutex<Option<(Instant, Arc<HashSet<PathBuf>>)>>,
}

impl Census {
    pub(crate) fn new() -> Self {
        Self {
            last: Mutex::new(None),
        }
    }

    /// Whether `upper` is an overlay upperdir anywhere, by a census that started
    /// after this call.
    pub(crate) async fn is_mounted(&self, upper: &Path) -> io::Result<bool> {
        let asked = Instant::now();
        let mut last = self.last.lock().await;
        if let Some((started, set)) = last.as_ref() {
            if *started >= asked {
                return Ok(set.contains(upper));
            }
        }
        let started = Instant::now();
        let set = tokio::task::spawn_blocking(scan_upperdirs)
            .await
            .map_err(io::Error::other)??;
        let set = Arc::new(set);
        *last = Some((started, set.clone()));
        Ok(set.contains(upper))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upperdirs_are_read_from_overlay_lines_only() {
        let info = b"22 1 0:21 / / rw shared:1 - ext4 /dev/vda rw\n\
            101 22 0:50 / /run/c/rootfs rw,relatime - overlay overlay rw,lowerdir=/s/l/2:/s/l/1,upperdir=/s/s/7/upper,workdir=/s/s/7/work,index=off\n\
            102 22 0:51 / /mnt/x rw - overlay overlay rw,lowerdir=/a,upperdir=/with\\040space/u,workdir=/w\n\
            103 22 0:52 / /mnt/y rw - tmpfs upperdir=/not/an/overlay rw\n";
        let mut out = HashSet::new();
        collect_upperdirs(info, &mut out);
        let want: HashSet<PathBuf> = ["/s/s/7/upper", "/with space/u"]
            .iter()
            .map(PathBuf::from)
            .collect();
        assert_eq!(out, want);
    }

    #[test]
    fn the_census_sees_this_process_namespace() {
        // Every process has a mount namespace; the scan must at least succeed.
        assert!(scan_upperdirs().is_ok());
    }
}
