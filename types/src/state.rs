//! A graph node's logical state (ARCHITECTURE §12: the reward, the step, …):
//! one rule, checked by the store when it records a node and by the CLI and
//! the daemon before anything of a session ends.

/// The largest node state, bytes.
pub const MAX_NODE_STATE_BYTES: usize = 64 * 1024;

/// Checks a node's state: a JSON object of at most
/// [`MAX_NODE_STATE_BYTES`] (ARCHITECTURE §12: a node's logical state is
/// named values; the Python SDK reads it as a dict).
///
/// # Errors
/// What is wrong, to follow the name of the field: `is N bytes; at most …`,
/// `is not JSON (…)` or `is JSON but not an object (…)`.
///
/// ```
/// use layerstack_types::check_node_state;
/// assert!(check_node_state(r#"{"reward": 1}"#).is_ok());
/// assert!(check_node_state("nope").unwrap_err().starts_with("is not JSON"));
/// assert!(check_node_state("[1]").unwrap_err().starts_with("is JSON but not an object"));
/// assert!(layerstack_types::check_adopted_node_state("[1]").is_ok());
/// ```
pub fn check_node_state(state: &str) -> Result<(), String> {
    check(state, true)
}

/// Checks the state of a node made elsewhere (a pull, an adoption): a JSON
/// document of at most [`MAX_NODE_STATE_BYTES`], any value — daemons before
/// [`check_node_state`] asked for an object stored arrays, numbers and
/// `null`, and their nodes must still move between stores.
///
/// # Errors
/// As [`check_node_state`], but for `is JSON but not an object`.
pub fn check_adopted_node_state(state: &str) -> Result<(), String> {
    check(state, false)
}

fn check(state: &str, object: bool) -> Result<(), String> {
    if state.len() > MAX_NODE_STATE_BYTES {
        return Err(format!(
            "is {} bytes; at most {MAX_NODE_STATE_BYTES} (keep large artifacts in files of the tree)",
            state.len()
        ));
    }
    match serde_json::from_str::<serde_json::Value>(state) {
        Ok(serde_json::Value::Object(_)) => Ok(()),
        Ok(_) if !object => Ok(()),
        Ok(v) => Err(format!(
            "is JSON but not an object (it is {}): a node's state is an object of named values; wrap the value, e.g. {{\"value\": {}}}",
            kind(&v),
            truncated(state),
        )),
        Err(e) => Err(format!("is not JSON ({e})")),
    }
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// `s` cut to at most 40 bytes (at a character boundary) for a message.
fn truncated(s: &str) -> String {
    let s = s.trim();
    if s.len() <= 40 {
        return s.to_string();
    }
    let mut end = 40;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}
