//! A graph node's logical state (ARCHITECTURE §12: the reward, the step, …):
//! one rule, checked by the store when it records a node and by the CLI and
//! the daemon before anything of a session ends.

/// The largest node state, bytes.
pub const MAX_NODE_STATE_BYTES: usize = 64 * 1024;

/// Checks a node's state: a JSON document of at most
/// [`MAX_NODE_STATE_BYTES`].
///
/// # Errors
/// What is wrong, to follow the name of the field: `is N bytes; at most …`
/// or `is not JSON (…)`.
///
/// ```
/// use layerstack_types::check_node_state;
/// assert!(check_node_state(r#"{"reward": 1}"#).is_ok());
/// assert!(check_node_state("nope").unwrap_err().starts_with("is not JSON"));
/// ```
pub fn check_node_state(state: &str) -> Result<(), String> {
    if state.len() > MAX_NODE_STATE_BYTES {
        return Err(format!(
            "is {} bytes; at most {MAX_NODE_STATE_BYTES} (keep large artifacts in files of the tree)",
            state.len()
        ));
    }
    serde_json::from_str::<serde_json::Value>(state)
        .map(drop)
        .map_err(|e| format!("is not JSON ({e})"))
}
