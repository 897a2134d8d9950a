//! Idempotency keys are checked against their arguments: a key names one
//! request. The first call with a key records its canonical arguments
//! ([`KeyArgs`]) in the transaction of its effect; a repeat with the same key
//! and the same arguments gets the first answer, one with the same key and
//! other arguments (another stack, node, branch, options) is refused
//! (`FailedPrecondition`, naming the key and every argument that differs).
//!
//! The arguments live in `graph_ops` (no schema change): one row per key and
//! operation, keyed `\u{1}args\u{1}<op>\u{1}<key>` (no client key starts with
//! U+0001: [`validate_key`]), `op` `args`, `response` the arguments as a JSON
//! object. Values are short (ids, names, flags); a free-form JSON state is
//! recorded as its BLAKE3 digest. A key recorded before arguments were
//! (a store written by an older build) has no such row and is not checked.

use std::collections::BTreeMap;

use rusqlite::{params, Connection, OptionalExtension, Transaction};

use crate::db::Cached;
use crate::error::StoreError;
use crate::now_ns;

/// The canonical arguments of a keyed request: name → value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyArgs(BTreeMap<String, String>);

impl KeyArgs {
    /// No arguments yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// With argument `name` = `value`.
    pub fn with(mut self, name: &str, value: impl ToString) -> Self {
        self.0.insert(name.to_string(), value.to_string());
        self
    }

    /// With argument `name` = the BLAKE3 digest of `value` (`blake3:<hex>`),
    /// for a value that may be large (a node's JSON state).
    pub fn digest(self, name: &str, value: &str) -> Self {
        let d = blake3::hash(value.as_bytes()).to_hex();
        self.with(name, format!("blake3:{d}"))
    }

    /// The arguments as stored: a JSON object (sorted by name).
    fn to_json(&self) -> String {
        serde_json::to_string(&self.0).unwrap_or_else(|_| "{}".into())
    }

    /// `name: first → now` for each argument that differs from `first`.
    fn differences(&self, first: &KeyArgs) -> Vec<String> {
        let mut names: Vec<&String> = first.0.keys().chain(self.0.keys()).collect();
        names.sort();
        names.dedup();
        let none = String::new();
        names
            .into_iter()
            .filter_map(|n| {
                let (a, b) = (
                    first.0.get(n).unwrap_or(&none),
                    self.0.get(n).unwrap_or(&none),
                );
                (a != b).then(|| format!("{n} {a:?} then, {b:?} now"))
            })
            .collect()
    }
}

/// The `graph_ops` key of `op`'s arguments for client key `key`.
fn args_row(op: &str, key: &str) -> String {
    format!("\u{1}args\u{1}{op}\u{1}{key}")
}

/// Forgets the arguments `key` was first used with for `op` (the request
/// failed without an effect: a retry with the key is a first use).
pub(crate) fn forget_args(tx: &Transaction<'_>, op: &str, key: &str) -> Result<(), StoreError> {
    tx.exec("DELETE FROM graph_ops WHERE key = ?1", [args_row(op, key)])?;
    Ok(())
}

/// Refuses a client key the arguments' rows could be mistaken for (one
/// starting with U+0001).
pub(crate) fn validate_key(key: &str) -> Result<(), StoreError> {
    if key.starts_with('\u{1}') {
        return Err(StoreError::InvalidArgument(format!(
            "idempotency key {key:?}: give a key that does not start with U+0001"
        )));
    }
    Ok(())
}

/// Checks `args` against the arguments `key` was first used with for `op`
/// (none recorded: nothing to check).
///
/// Error: `FailedPrecondition` naming the key and what differs.
pub(crate) fn check_args(
    conn: &Connection,
    op: &str,
    key: &str,
    args: &KeyArgs,
) -> Result<(), StoreError> {
    let stored: Option<String> = conn
        .one(
            "SELECT response FROM graph_ops WHERE key = ?1",
            [args_row(op, key)],
            |r| r.get(0),
        )
        .optional()?;
    let Some(stored) = stored else {
        return Ok(());
    };
    let first: BTreeMap<String, String> = serde_json::from_str(&stored).map_err(|e| {
        StoreError::corrupt("graph_ops", 0, format!("arguments of key {key:?}: {e}"))
    })?;
    let diff = args.differences(&KeyArgs(first));
    if diff.is_empty() {
        return Ok(());
    }
    Err(StoreError::FailedPrecondition(format!(
        "idempotency key {key:?} was first used for a {op} with other arguments ({}): a key names one request, its retry repeats the arguments; use a new key for a different request",
        diff.join("; ")
    )))
}

/// Refuses `key` for a sandbox `op` ("session": on a stack's branch;
/// "attempt": on a graph node) when it names a sandbox of the other kind:
/// the two are recorded apart (a session's key, an attempt's), so the same
/// key made one of each. `FailedPrecondition` naming the key and what it
/// first made.
pub(crate) fn refuse_other_sandbox_kind(
    conn: &Connection,
    op: &str,
    key: &str,
) -> Result<(), StoreError> {
    let first = match op {
        "session" => conn
            .one(
                "SELECT 'a sandbox of graph node ' || node || ' (attempt ' || id || ')' FROM graph_attempts WHERE idempotency_key = ?1",
                [key],
                |r| r.get::<_, String>(0),
            )
            .optional()?,
        _ => conn
            .one(
                "SELECT 'a sandbox of stack ' || stack || ', branch ' || branch || ' (session ' || id || ')' FROM sessions WHERE idempotency_key = ?1",
                [key],
                |r| r.get::<_, String>(0),
            )
            .optional()?,
    };
    match first {
        None => Ok(()),
        Some(first) => Err(StoreError::FailedPrecondition(format!(
            "idempotency key {key:?} was first used for {first}: a key names one request, its retry repeats the arguments (the stack and branch, or the node); use a new key for a different request"
        ))),
    }
}

/// Records `args` as the arguments `key` is first used with for `op`, in the
/// transaction of the request's effect.
pub(crate) fn record_args(
    tx: &Transaction<'_>,
    op: &str,
    key: &str,
    args: &KeyArgs,
) -> Result<(), StoreError> {
    tx.exec(
        "INSERT OR REPLACE INTO graph_ops(key, op, response, created_ns) VALUES (?1, 'args', ?2, ?3)",
        params![args_row(op, key), args.to_json(), now_ns()],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn differences_name_each_argument() {
        let a = KeyArgs::new().with("stack", "s1").with("branch", "main");
        let b = KeyArgs::new()
            .with("stack", "s2")
            .with("branch", "main")
            .with("node", "n1");
        assert!(a.differences(&a.clone()).is_empty());
        assert_eq!(
            b.differences(&a),
            vec![
                "node \"\" then, \"n1\" now".to_string(),
                "stack \"s1\" then, \"s2\" now".to_string()
            ]
        );
        let s = KeyArgs::new().digest("state", "{}");
        assert!(s.0["state"].starts_with("blake3:"));
        assert!(validate_key("\u{1}x").is_err());
        assert!(validate_key("k").is_ok());
    }
}
