//! The exit policy (label `layerstack.publish`, ARCHITECTURE.md §2) and the end
//! action it decides, from a container's labels (`nerdctl run --label …`,
//! `ctr run --label …`, read through containerd's Containers API) or a sandbox
//! session's request.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

/// The container labels this module reads (defined in [`crate::labels`]).
pub use crate::labels::{BRANCH_LABEL, NODE_LABEL, PUBLISH_LABEL};

/// An exit policy: the value of [`PUBLISH_LABEL`], of a sandbox session's
/// `--publish`, and what a session records (`on-exit`, `on-success`, `never`,
/// `checkpoint`; [`ExitPolicy::as_str`] and [`str::parse`] are inverse, and the
/// empty string parses as the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExitPolicy {
    /// Publish whenever the task exits, whatever its status (default).
    #[default]
    OnExit,
    /// Publish only on exit status 0; otherwise discard the writes.
    OnSuccess,
    /// Never publish: discard the writes.
    Never,
    /// Turn the writes into a child node of the graph node the session activates
    /// (`layerstack.node`; ARCHITECTURE.md §12), whatever the exit status (the node
    /// records it).
    Checkpoint,
}

impl ExitPolicy {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::OnExit => "on-exit",
            Self::OnSuccess => "on-success",
            Self::Never => "never",
            Self::Checkpoint => "checkpoint",
        }
    }
}

impl fmt::Display for ExitPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A [`PUBLISH_LABEL`] value that is none of `on-exit`, `on-success`, `never`,
/// `checkpoint` (the value, trimmed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("label {PUBLISH_LABEL}={0:?} is not one of on-exit, on-success, never, checkpoint")]
pub struct UnknownExitPolicy(pub String);

impl FromStr for ExitPolicy {
    type Err = UnknownExitPolicy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "" | "on-exit" => Ok(Self::OnExit),
            "on-success" => Ok(Self::OnSuccess),
            "never" => Ok(Self::Never),
            "checkpoint" => Ok(Self::Checkpoint),
            other => Err(UnknownExitPolicy(other.to_string())),
        }
    }
}

/// The policy named by `labels`. Without `layerstack.publish`: [`ExitPolicy::OnExit`],
/// or [`ExitPolicy::Checkpoint`] for a container that names a graph node with
/// `layerstack.node` (an attempt's writes become a child node unless its owner
/// says otherwise; ARCHITECTURE.md §12).
pub fn policy_from_labels(
    labels: &HashMap<String, String>,
) -> Result<ExitPolicy, UnknownExitPolicy> {
    match labels.get(PUBLISH_LABEL) {
        Some(v) => v.parse(),
        None if node_from_labels(labels).is_some() => Ok(ExitPolicy::Checkpoint),
        None => Ok(ExitPolicy::OnExit),
    }
}

/// The node named by `labels`, if any.
pub fn node_from_labels(labels: &HashMap<String, String>) -> Option<&str> {
    labels
        .get(NODE_LABEL)
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
}

/// The branch named by `labels`, if any (empty values are ignored).
pub fn branch_from_labels(labels: &HashMap<String, String>) -> Option<&str> {
    labels
        .get(BRANCH_LABEL)
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
}

/// The end action an exit policy decides (ARCHITECTURE.md §2 "End action"):
/// what to ask the daemon for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Capture, gate, commit or reject.
    Publish,
    /// Drop the writes (outcome `discarded`).
    Discard,
    /// Checkpoint the writes into a child node.
    Checkpoint,
}

/// The decision for a task that exited with `exit_status`, and the reason sent to
/// the daemon (it ends up in the session's outcome message).
pub fn decide(policy: ExitPolicy, exit_status: u32) -> (Decision, String) {
    match policy {
        ExitPolicy::OnExit => (
            Decision::Publish,
            format!("shim: task exited with status {exit_status}"),
        ),
        ExitPolicy::OnSuccess if exit_status == 0 => (
            Decision::Publish,
            format!("shim: task exited with status 0 ({PUBLISH_LABEL}=on-success)"),
        ),
        ExitPolicy::OnSuccess => (
            Decision::Discard,
            format!("exit status {exit_status} with {PUBLISH_LABEL}=on-success"),
        ),
        ExitPolicy::Never => (Decision::Discard, format!("{PUBLISH_LABEL}=never")),
        ExitPolicy::Checkpoint => (
            Decision::Checkpoint,
            format!("exit status {exit_status} with {PUBLISH_LABEL}=checkpoint"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn policy_defaults_to_on_exit() {
        assert_eq!(policy_from_labels(&labels(&[])), Ok(ExitPolicy::OnExit));
        assert_eq!(
            policy_from_labels(&labels(&[(NODE_LABEL, "n3")])),
            Ok(ExitPolicy::Checkpoint),
            "an attempt checkpoints by default"
        );
        assert_eq!(
            policy_from_labels(&labels(&[(NODE_LABEL, "n3"), (PUBLISH_LABEL, "never")])),
            Ok(ExitPolicy::Never),
            "an explicit policy wins"
        );
        assert_eq!(
            policy_from_labels(&labels(&[(PUBLISH_LABEL, "")])),
            Ok(ExitPolicy::OnExit)
        );
        assert_eq!(
            policy_from_labels(&labels(&[(PUBLISH_LABEL, "never")])),
            Ok(ExitPolicy::Never)
        );
        assert_eq!(
            policy_from_labels(&labels(&[(PUBLISH_LABEL, "always")])),
            Err(UnknownExitPolicy("always".into()))
        );
    }

    #[test]
    fn decisions_follow_the_issue_table() {
        assert_eq!(decide(ExitPolicy::OnExit, 137).0, Decision::Publish);
        assert_eq!(decide(ExitPolicy::OnSuccess, 0).0, Decision::Publish);
        assert_eq!(decide(ExitPolicy::OnSuccess, 3).0, Decision::Discard);
        assert_eq!(decide(ExitPolicy::Never, 0).0, Decision::Discard);
        assert!(decide(ExitPolicy::OnSuccess, 3).1.contains("exit status 3"));
    }

    #[test]
    fn branch_label_is_trimmed_and_optional() {
        assert_eq!(
            branch_from_labels(&labels(&[(BRANCH_LABEL, " exp ")])),
            Some("exp")
        );
        assert_eq!(branch_from_labels(&labels(&[(BRANCH_LABEL, "")])), None);
        assert_eq!(branch_from_labels(&labels(&[])), None);
    }
}
