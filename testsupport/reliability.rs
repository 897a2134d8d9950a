//! The reliability record a top-level test writes after its assertions
//! passed (docs/reliability.md, `scripts/reliability.sh`): when
//! `LAYERSTACK_RELIABILITY_OUT` names a directory, `<dir>/<id>.json` holds
//! `{"id", "guarantee", "test", "figures"}`. Included by path
//! (`#[path = "../../testsupport/reliability.rs"] mod reliability;`) into the
//! test crates that need it: only `serde_json`, which they all have.
#![allow(dead_code)]

/// Writes the record `id` (kebab case, unique across the suite) when
/// `LAYERSTACK_RELIABILITY_OUT` is set; `test` is the exact command that runs
/// the test, `figures` its numbers (executions, executions per second,
/// seconds, …). Does nothing when the variable is unset or empty.
///
/// # Panics
/// When the directory cannot be made or the file written: a record asked
/// for and not written is a failed run.
pub fn record(id: &str, guarantee: &str, test: &str, figures: &[(&str, serde_json::Value)]) {
    let Some(dir) = std::env::var_os("LAYERSTACK_RELIABILITY_OUT").filter(|d| !d.is_empty()) else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    let figures: serde_json::Map<String, serde_json::Value> = figures
        .iter()
        .map(|(k, v)| ((*k).to_string(), v.clone()))
        .collect();
    let doc = serde_json::json!({
        "id": id,
        "guarantee": guarantee,
        "test": test,
        "figures": figures,
    });
    let path = dir.join(format!("{id}.json"));
    let write = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&path, serde_json::to_vec_pretty(&doc).unwrap_or_default()));
    if let Err(e) = write {
        panic!("cannot write reliability record {}: {e}", path.display());
    }
}
