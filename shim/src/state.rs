//! What the proxy records in the task's bundle directory, so that `delete` can
//! clean up after a proxy that was killed (SIGKILL, OOM) and so that containerd
//! reconnects to the proxy after a restart:
//!
//! - `<bundle>/address` — the proxy's ttrpc address (containerd 1.6 reads it in
//!   `loadShim`). The inner shim writes its own address there first; the proxy
//!   overwrites it.
//! - `<bundle>/layerstack-shim.json` — [`BundleState`].

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// File name of [`BundleState`] in the bundle.
pub const STATE_FILE: &str = "layerstack-shim.json";
/// File containerd reads the shim address from.
pub const ADDRESS_FILE: &str = "address";

/// The proxy's record of one task.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BundleState {
    /// The proxy's own ttrpc address (`unix:///run/containerd/s/<hash>`).
    pub address: String,
    /// Where the proxy receives the inner shim's events (the inner shim's `TTRPC_ADDRESS`).
    pub events_address: String,
    /// The inner shim's ttrpc address.
    pub inner_address: String,
    /// The inner shim server's pid, if found.
    pub inner_pid: Option<i32>,
    /// The inner shim serves other containers too (pod grouping): never kill it.
    pub inner_grouped: bool,
    /// The inner shim binary.
    pub inner_shim: PathBuf,
    /// The daemon's admin socket.
    pub admin_address: PathBuf,
    /// runc root to pass to the inner shim (runc option `root`), if configured.
    pub runc_root: Option<String>,
    /// Milliseconds task delete waits for a publish outcome.
    pub publish_timeout_ms: u64,
    /// The task was created (the inner shim's `Create` succeeded): only then does
    /// `delete` publish for a proxy that died.
    #[serde(default)]
    pub created: bool,
    /// The init process's exit status, recorded by the proxy's `Delete` before it
    /// publishes (a `delete` that takes over uses it for the policy).
    #[serde(default)]
    pub exit_status: Option<u32>,
    /// The init process's publish step has run (through the proxy's `Delete` or
    /// `delete`): a later `delete` does not publish again.
    pub published: bool,
    /// The inner shim's `Delete` of the init process succeeded (runc deleted the
    /// container, the rootfs is unmounted): once the inner server is gone too,
    /// `delete` has nothing left to clean up.
    #[serde(default)]
    pub init_deleted: bool,
}

/// Path of the state file in `bundle`.
pub fn state_path(bundle: &Path) -> PathBuf {
    bundle.join(STATE_FILE)
}

/// Reads the state; `Ok(None)` if there is none.
pub fn load(bundle: &Path) -> std::io::Result<Option<BundleState>> {
    match std::fs::read(state_path(bundle)) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Writes `data` to `bundle/name` atomically (temp file, rename): a reader, or
/// a `delete` after this process was killed, sees the old or the new content,
/// never a partial one. No fsync: the bundle lives in containerd's state
/// directory (`/run/containerd`, a tmpfs in production), whose tasks containerd
/// forgets at boot anyway, and containerd's own shims write the same files
/// without one (runc-v2 `address`); an fsync per write cost ~0.6 ms each, five
/// times per container, on the path of `ctr run`.
pub fn write_atomic(bundle: &Path, name: &str, data: &[u8]) -> std::io::Result<()> {
    let tmp = bundle.join(format!(".{name}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(data)?;
    drop(f);
    std::fs::rename(&tmp, bundle.join(name))
}

/// Writes the state atomically.
pub fn save(bundle: &Path, state: &BundleState) -> std::io::Result<()> {
    let data = serde_json::to_vec_pretty(state)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    write_atomic(bundle, STATE_FILE, &data)
}

/// Applies `f` to the saved state (no-op on a missing state file). Updates in
/// one process are serialized (the server records the inner pid while RPCs
/// record their steps).
pub fn update(bundle: &Path, f: impl FnOnce(&mut BundleState)) -> std::io::Result<()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _held = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    match load(bundle)? {
        Some(mut s) => {
            let before = s.clone();
            f(&mut s);
            if s != before {
                save(bundle, &s)?;
            }
            Ok(())
        }
        None => Ok(()),
    }
}

/// Marks the task created.
pub fn mark_created(bundle: &Path) -> std::io::Result<()> {
    update(bundle, |s| s.created = true)
}

/// Marks the publish step done.
pub fn mark_published(bundle: &Path) -> std::io::Result<()> {
    update(bundle, |s| s.published = true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_mark() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(load(d.path()).unwrap(), None);
        let s = BundleState {
            address: "unix:///run/containerd/s/a".into(),
            inner_address: "unix:///run/containerd/s/b".into(),
            inner_pid: Some(42),
            ..Default::default()
        };
        save(d.path(), &s).unwrap();
        assert_eq!(load(d.path()).unwrap(), Some(s.clone()));
        mark_published(d.path()).unwrap();
        assert!(load(d.path()).unwrap().unwrap().published);
        // Missing state: nothing to mark, no error.
        let e = tempfile::tempdir().unwrap();
        mark_published(e.path()).unwrap();
    }
}
