//! Records for `docs/reliability.md` (issue 22, "Show it works"): when the
//! environment variable [`OUT_ENV`] names a directory, a reliability test
//! writes one `<id>.json` there — what is guaranteed, the exact command that
//! checks it, and its figures — after its assertions passed. The lead's
//! `scripts/reliability.sh` collects them into the table.

use std::path::{Path, PathBuf};

/// The directory records are written into; unset: no record is written.
pub const OUT_ENV: &str = "LAYERSTACK_RELIABILITY_OUT";

/// One figure of a record: a count, a measure (seconds, rates) or a short text.
#[derive(Debug, Clone, PartialEq)]
pub enum Figure {
    Count(u64),
    Measure(f64),
    Text(String),
}

impl From<u64> for Figure {
    fn from(n: u64) -> Self {
        Figure::Count(n)
    }
}

impl From<usize> for Figure {
    fn from(n: usize) -> Self {
        Figure::Count(n as u64)
    }
}

impl From<f64> for Figure {
    fn from(x: f64) -> Self {
        Figure::Measure(x)
    }
}

impl From<&str> for Figure {
    fn from(s: &str) -> Self {
        Figure::Text(s.to_string())
    }
}

/// Writes `$LAYERSTACK_RELIABILITY_OUT/<id>.json` =
/// `{"id", "guarantee", "test", "figures"}` (`figures`: names to numbers or
/// short strings, in order). Returns the file written, `None` when the
/// variable is unset.
///
/// # Errors
/// The directory cannot be made or the file written.
pub fn record(
    id: &str,
    guarantee: &str,
    test: &str,
    figures: &[(&str, Figure)],
) -> std::io::Result<Option<PathBuf>> {
    let Some(dir) = std::env::var_os(OUT_ENV) else {
        return Ok(None);
    };
    record_in(Path::new(&dir), id, guarantee, test, figures).map(Some)
}

/// [`record`] into directory `dir` (made if missing). Returns the file.
///
/// # Errors
/// The directory cannot be made or the file written.
pub fn record_in(
    dir: &Path,
    id: &str,
    guarantee: &str,
    test: &str,
    figures: &[(&str, Figure)],
) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let figures: serde_json::Map<String, serde_json::Value> = figures
        .iter()
        .map(|(k, f)| {
            let v = match f {
                Figure::Count(n) => serde_json::Value::from(*n),
                Figure::Measure(x) => serde_json::Value::from(*x),
                Figure::Text(t) => serde_json::Value::from(t.as_str()),
            };
            (k.to_string(), v)
        })
        .collect();
    let doc = serde_json::json!({
        "id": id,
        "guarantee": guarantee,
        "test": test,
        "figures": figures,
    });
    let path = dir.join(format!("{id}.json"));
    let text = serde_json::to_string_pretty(&doc).map_err(std::io::Error::other)?;
    std::fs::write(&path, text + "\n")?;
    Ok(path)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_one_json_file_named_by_its_id() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("out");
        let p = record_in(
            &dir,
            "crash-points",
            "what is guaranteed",
            "cargo test x",
            &[
                ("points", 3usize.into()),
                ("seconds", 1.5.into()),
                ("errnos", "EIO".into()),
            ],
        )
        .unwrap();
        assert_eq!(p, dir.join("crash-points.json"));
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert_eq!(v["id"], "crash-points");
        assert_eq!(v["test"], "cargo test x");
        assert_eq!(v["figures"]["points"], 3);
        assert_eq!(v["figures"]["seconds"], 1.5);
        assert_eq!(v["figures"]["errnos"], "EIO");
    }
}
