//! The reliability suite's records (issue 22, `docs/reliability.md`): when
//! `LAYERSTACK_RELIABILITY_OUT` names a directory, a test of a guarantee writes
//! `<dir>/<id>.json` after its assertions passed —
//! `{"id", "guarantee", "test", "figures": {name: value}}` —
//! and `scripts/reliability.sh` renders the table from those files. Without the
//! variable nothing is written. Used by tests only; it is here so the store's,
//! the engine's and the integration tests share one format.

use std::path::PathBuf;

/// Writes the record of guarantee `id` (short, kebab-case, unique across the
/// suite). `test` is the exact command that checks it; `figures` are name →
/// value pairs, a value that parses as a number written as a JSON number.
///
/// # Panics
/// When the directory is named but the file cannot be written: a suite run
/// that means to record must not silently lose a row.
pub fn record(id: &str, guarantee: &str, test: &str, figures: &[(&str, String)]) {
    let Some(dir) = std::env::var_os("LAYERSTACK_RELIABILITY_OUT").map(PathBuf::from) else {
        return;
    };
    let figures: serde_json::Map<String, serde_json::Value> = figures
        .iter()
        .map(|(k, v)| {
            let value = v
                .parse::<f64>()
                .ok()
                .and_then(|_| serde_json::from_str::<serde_json::Number>(v).ok())
                .map(serde_json::Value::Number)
                .unwrap_or_else(|| serde_json::Value::String(v.clone()));
            (k.to_string(), value)
        })
        .collect();
    let doc = serde_json::json!({
        "id": id,
        "guarantee": guarantee,
        "test": test,
        "figures": figures,
    });
    std::fs::create_dir_all(&dir)
        .and_then(|()| {
            std::fs::write(
                dir.join(format!("{id}.json")),
                serde_json::to_vec_pretty(&doc).unwrap_or_default(),
            )
        })
        .unwrap_or_else(|e| {
            panic!(
                "cannot write reliability record {id} in {}: {e}",
                dir.display()
            )
        });
}
