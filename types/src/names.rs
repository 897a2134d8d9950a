//! Names of the model's states that cross the wire as strings: publish
//! outcomes, path verdicts, session states, owner kinds (ARCHITECTURE.md §2). Each
//! `as_str` is the spelling the store records, the admin API carries, the CLI
//! prints and the Python client compares; each `parse` is its inverse.

/// Declares a name enum's `as_str`, `parse` and `ALL` from one table.
macro_rules! names {
    ($ty:ident { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            /// Every value, in declaration order.
            pub const ALL: &'static [$ty] = &[$(Self::$variant),+];

            /// The name (see the module docs).
            #[must_use]
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $name),+
                }
            }

            /// The value named `s`, exactly as [`Self::as_str`] spells it; `None`
            /// for anything else.
            #[must_use]
            pub fn parse(s: &str) -> Option<Self> {
                match s {
                    $($name => Some(Self::$variant),)+
                    _ => None,
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

/// The kinds of publish outcome (ARCHITECTURE.md §2 "Outcome"), kebab case:
/// `committed`, `checkpointed`, `merged`, `no-change`, `conflict`, `discarded`,
/// `failed`, `busy`, `unsupported`, `unknown`, `interrupted`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "kebab-case")
)]
pub enum OutcomeKind {
    /// A new layer was prepended to the branch.
    Committed,
    /// The writes became a new checkpoint node of a SandboxGraph (a layer on the
    /// attempt's node, ARCHITECTURE.md §12): no branch moved.
    Checkpointed,
    /// A new layer was prepended to the branch, and at least one of its paths was
    /// three-way merged (content) or merged field by field (metadata) with changes
    /// published since the session's lease.
    Merged,
    /// The session changed nothing; no layer was made.
    NoChange,
    /// The whole changeset was rejected; nothing was published.
    Conflict,
    /// The writes were dropped without publishing.
    Discarded,
    /// Publishing failed for a reason other than a conflict; nothing was published.
    Failed,
    /// Refused because a limit was reached (the caller asked not to wait); nothing
    /// was published, the upper is kept.
    Busy,
    /// Refused by design (e.g. an invalid exit policy); nothing was published, the
    /// upper is kept.
    Unsupported,
    /// The daemon cannot tell whether the publish happened (it ended while one was
    /// in flight); look before acting again (ARCHITECTURE §2: nothing is retried
    /// silently).
    Unknown,
    /// An infrastructure failure ended the run before its owner did (ARCHITECTURE
    /// §12 "infra_failed(kind)"): the daemon that owned the session's init went
    /// away (kill -9, an upgrade) or the init died without being asked to. The
    /// command's exit status is unknown; nothing was published or checkpointed;
    /// the upper is kept for inspection until discarded. Which failure:
    /// [`Interruption`]. Not the owner's decision, so never the exit policy's.
    Interrupted,
}

names!(OutcomeKind {
    Committed => "committed",
    Checkpointed => "checkpointed",
    Merged => "merged",
    NoChange => "no-change",
    Conflict => "conflict",
    Discarded => "discarded",
    Failed => "failed",
    Busy => "busy",
    Unsupported => "unsupported",
    Unknown => "unknown",
    Interrupted => "interrupted",
});

impl OutcomeKind {
    /// Whether a run that ended with this outcome may be published again (gated
    /// anew) or discarded: the writes are still in the upper, nothing was published.
    #[must_use]
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            Self::Conflict
                | Self::Failed
                | Self::Busy
                | Self::Unsupported
                | Self::Unknown
                | Self::Interrupted
        )
    }

    /// Whether this outcome moved a branch (prepended a layer to it).
    #[must_use]
    pub fn is_published(self) -> bool {
        matches!(self, Self::Committed | Self::Merged)
    }

    /// Whether this outcome made a layer: a publish, or a checkpoint node.
    #[must_use]
    pub fn adds_layer(self) -> bool {
        self.is_published() || self == Self::Checkpointed
    }
}

/// Which infrastructure failure ended a run [`OutcomeKind::Interrupted`]
/// (the `kind` of ARCHITECTURE's `infra_failed(kind)`): `daemon-restart`,
/// `init-gone`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "kebab-case")
)]
pub enum Interruption {
    /// The daemon that owned the session's init ended (kill -9, a crash, an
    /// upgrade): the parent-death signal killed init with it, and the next
    /// daemon found the session without one.
    DaemonRestart,
    /// The session's init died while the daemon ran, without a CloseSession
    /// (killed from outside, out of memory).
    InitGone,
}

names!(Interruption {
    DaemonRestart => "daemon-restart",
    InitGone => "init-gone",
});

/// The gate's verdict on one path (ARCHITECTURE.md §7): `clean`, `merged`,
/// `conflict`, `excluded`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum PathStatus {
    /// Published as captured.
    Clean,
    /// Published as a three-way or field-by-field merge.
    Merged,
    /// Rejected; the whole changeset is rejected with it.
    Conflict,
    /// Left out by the exclusion rules (or never publishable, like a socket).
    Excluded,
}

names!(PathStatus {
    Clean => "clean",
    Merged => "merged",
    Conflict => "conflict",
    Excluded => "excluded",
});

/// A session's lifecycle state (CLI `session ls`): `active`, `published`,
/// `conflict`, `discarded`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum SessionState {
    /// Mounted or mountable; writes not yet published.
    Active,
    /// Last run published (or had nothing to publish); upper is fresh and empty.
    Published,
    /// Last run was rejected by the gate; upper and lease kept for inspection.
    Conflict,
    /// Last run's writes were dropped on purpose (or committed as a containerd snapshot).
    Discarded,
}

names!(SessionState {
    Active => "active",
    Published => "published",
    Conflict => "conflict",
    Discarded => "discarded",
});

/// Who a session belongs to, by kind (ARCHITECTURE.md §2 "Owner"): `container`
/// (Mode A), `sandbox` (Mode B), `wasi` (a WASI session: WebAssembly modules
/// the daemon runs over the session's tree), `operation` (an engine
/// operation: promote, a graph merge). The admin API's `Session.owner_kind` and `session ls --owner`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OwnerKind {
    /// A container, through containerd.
    Container,
    /// A sandbox session held by a `layerstack session run|create` holder.
    Sandbox,
    /// A WASI session: the daemon runs WebAssembly modules (wasmtime) with the
    /// session's tree as their root; it holds the overlay itself.
    Wasi,
    /// An engine operation.
    Operation,
}

names!(OwnerKind {
    Container => "container",
    Sandbox => "sandbox",
    Wasi => "wasi",
    Operation => "operation",
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back_and_nothing_else_does() {
        fn check<T: Copy + PartialEq + std::fmt::Debug>(
            all: &[T],
            as_str: fn(T) -> &'static str,
            parse: fn(&str) -> Option<T>,
        ) {
            let mut seen = std::collections::HashSet::new();
            for &v in all {
                assert!(seen.insert(as_str(v)), "{v:?}: its name is taken");
                assert_eq!(parse(as_str(v)), Some(v));
                assert_eq!(parse(&as_str(v).to_uppercase()), None);
            }
            assert_eq!(parse(""), None);
        }
        check(OutcomeKind::ALL, OutcomeKind::as_str, OutcomeKind::parse);
        check(PathStatus::ALL, PathStatus::as_str, PathStatus::parse);
        check(SessionState::ALL, SessionState::as_str, SessionState::parse);
        check(OwnerKind::ALL, OwnerKind::as_str, OwnerKind::parse);
        check(Interruption::ALL, Interruption::as_str, Interruption::parse);
        assert_eq!(OutcomeKind::ALL.len(), 11);
        assert!(OutcomeKind::Interrupted.is_retryable());
        assert_eq!(OutcomeKind::NoChange.to_string(), "no-change");
    }

    #[test]
    fn retryable_outcomes_kept_their_writes_and_published_ones_made_a_layer() {
        for &k in OutcomeKind::ALL {
            assert!(!(k.is_retryable() && k.adds_layer()), "{k}");
            assert!(!k.is_published() || k.adds_layer(), "{k}");
        }
        assert!(
            OutcomeKind::Checkpointed.adds_layer() && !OutcomeKind::Checkpointed.is_published()
        );
    }
}
