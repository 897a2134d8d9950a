//! Helpers shared by the publisher's integration test binaries.

use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

/// Whether `test` may run: root is needed (overlay mounts, mknod, trusted.* xattrs).
/// Without root it skips, except under `CI=true`, where it fails.
pub fn have_root(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{test} needs root (overlay mount, mknod, trusted.* xattrs) and CI=true: run the suite as root");
    }
    eprintln!("skipping {test}: needs root");
    false
}

/// An overlay mount, unmounted on drop (lazily if a test left it busy).
pub struct Overlay(PathBuf);

impl Overlay {
    /// `mount -t overlay -o data overlay target` (creating `target`).
    pub fn mount(target: &Path, data: &str) -> Overlay {
        std::fs::create_dir_all(target).unwrap();
        mount(
            Some("overlay"),
            target,
            Some("overlay"),
            MsFlags::empty(),
            Some(data),
        )
        .unwrap_or_else(|e| panic!("mount -t overlay -o {data}: {e}"));
        Overlay(target.to_path_buf())
    }

    /// Unmounts now, so that the upper is quiescent. `EBUSY` is retried for up to
    /// 2.5 s, as containerd's `mount.Unmount` does: another test thread's
    /// fork briefly holds the process's descriptors (until its child's exec),
    /// which can include one inside this mount.
    pub fn unmount(self) {
        let mut tries = 0;
        loop {
            match umount2(&self.0, MntFlags::empty()) {
                Ok(()) => break,
                Err(nix::errno::Errno::EBUSY) if tries < 50 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                Err(e) => panic!("umount {}: {e}", self.0.display()),
            }
        }
        std::mem::forget(self);
    }
}

impl Drop for Overlay {
    fn drop(&mut self) {
        let _ = umount2(&self.0, MntFlags::MNT_DETACH);
    }
}
