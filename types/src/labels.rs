//! Label names, one constant per string (ARCHITECTURE.md §5).
//!
//! containerd hands a label to a LayerStack process along one of two paths, and
//! a name means something only on its own path:
//!
//! * **Snapshot labels** (`SNAPSHOT_*`) arrive with the snapshot call itself
//!   (`Prepare`, `View`, `Commit`). A proxy snapshotter receives only
//!   `containerd.io/snapshot.ref` and labels prefixed `containerd.io/snapshot/`
//!   (containerd `snapshots/proxy`; checked against containerd 1.6.20). Set them
//!   with `ctr run --snapshotter-label containerd.io/snapshot/layerstack.branch=x`
//!   or a CRI container annotation passed through to the snapshotter.
//! * **Container labels** (no prefix) live on containerd's container record
//!   (`nerdctl run --label layerstack.branch=x`, `ctr run --label …`, CRI pod or
//!   container annotations): they never reach the snapshotter. The daemon reads
//!   them through containerd's Containers API (at `Mounts`, and on
//!   `/tasks/delete`); the runtime shim reads them from the container record on
//!   `Create` and `Delete`.
//!
//! Where both name the same thing, the snapshot label is read at `Prepare` and
//! the container label later moves the session (a container label wins over the
//! default branch, a snapshot label wins over the container label).

/// Snapshot label naming the branch a container rootfs session leases
/// (`ctr run --snapshotter-label containerd.io/snapshot/layerstack.branch=NAME`),
/// read at `Prepare`. Without it: [`BRANCH_LABEL`], then the configured default.
pub const SNAPSHOT_BRANCH_LABEL: &str = "containerd.io/snapshot/layerstack.branch";

/// Snapshot label naming a SandboxGraph node: the session is a new attempt of the
/// node and leases its root instead of a branch head (ARCHITECTURE.md §12), read
/// at `Prepare`.
pub const SNAPSHOT_NODE_LABEL: &str = "containerd.io/snapshot/layerstack.node";

/// Snapshot label containerd's unpacker sets on an image-layer extraction
/// `Prepare` (containerd `unpacker.go`, the remote-snapshot protocol): its value
/// is the layer's chainID.
pub const SNAPSHOT_REF_LABEL: &str = "containerd.io/snapshot.ref";

/// Container label naming the target branch (`nerdctl run --label
/// layerstack.branch=NAME`; also a CRI pod or container annotation), used when
/// the snapshot label [`SNAPSHOT_BRANCH_LABEL`] is absent.
pub const BRANCH_LABEL: &str = "layerstack.branch";

/// Container label naming the graph node a container activates (an attempt;
/// ARCHITECTURE.md §12); the snapshot-label twin is [`SNAPSHOT_NODE_LABEL`].
pub const NODE_LABEL: &str = "layerstack.node";

/// Container label choosing the session's exit policy: what happens to its
/// writes when its task exits ([`crate::policy::ExitPolicy`]). There is no snapshot
/// label for it.
pub const PUBLISH_LABEL: &str = "layerstack.publish";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_snapshot_label_reaches_a_proxy_snapshotter_and_no_container_label_claims_to() {
        for l in [SNAPSHOT_BRANCH_LABEL, SNAPSHOT_NODE_LABEL] {
            assert!(l.starts_with("containerd.io/snapshot/"), "{l}");
        }
        for l in [BRANCH_LABEL, NODE_LABEL, PUBLISH_LABEL] {
            assert!(!l.starts_with("containerd.io/"), "{l}");
        }
        assert_eq!(
            SNAPSHOT_BRANCH_LABEL.strip_prefix("containerd.io/snapshot/"),
            Some(BRANCH_LABEL)
        );
        assert_eq!(
            SNAPSHOT_NODE_LABEL.strip_prefix("containerd.io/snapshot/"),
            Some(NODE_LABEL)
        );
    }
}
