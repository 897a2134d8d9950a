//! Publish policy: paths that are never published (ARCHITECTURE §7, last row).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};

/// Glob patterns of container paths that a publish leaves out: an excluded path is
/// neither validated by the gate nor published (its upper entry, whiteout or
/// directory is removed before the layer is sealed, so the lease's version stays
/// visible on the branch).
///
/// Patterns are absolute container paths in [`globset`] syntax with
/// `literal_separator` on: `*` and `?` never match `/`, `**` matches any number of
/// components (`/tmp/**` matches everything below `/tmp`, not `/tmp` itself),
/// `{a,b}` and `[ab]` as usual. A pattern without a leading `/` is anchored at the
/// root too. Matching is on the path's bytes (non-UTF-8 names work).
///
/// A path is excluded when it **or any ancestor** matches: an excluded directory
/// takes its whole subtree with it.
///
/// ```
/// use layerstack_publisher::ExclusionRules;
/// let p = ExclusionRules::new(["/tmp/**", "/var/cache/**", "**/*.pyc"]).unwrap();
/// assert!(p.is_excluded(b"tmp/x"));
/// assert!(p.is_excluded(b"srv/app/m.pyc/inner"));
/// assert!(!p.is_excluded(b"tmp"));
/// assert!(!p.is_excluded(b"var/cachex/y"));
/// ```
#[derive(Debug, Clone, Default)]
pub struct ExclusionRules {
    set: GlobSet,
    patterns: Vec<String>,
    /// Literal directory prefix of each pattern (components before the first one
    /// with a glob metacharacter), relative, no leading `/`.
    prefixes: Vec<Vec<u8>>,
}

/// An exclusion pattern that does not parse.
#[derive(Debug, thiserror::Error)]
#[error("invalid exclude pattern {pattern:?}")]
pub struct ExclusionError {
    /// The pattern as given.
    pub pattern: String,
    /// The parser's complaint.
    #[source]
    pub source: globset::Error,
}

impl ExclusionRules {
    /// A policy excluding every path matching one of `patterns`.
    ///
    /// # Errors
    /// [`ExclusionError`] for the first pattern that does not parse.
    pub fn new<I, S>(patterns: I) -> Result<ExclusionRules, ExclusionError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut b = GlobSetBuilder::new();
        let mut kept = Vec::new();
        let mut prefixes = Vec::new();
        for p in patterns {
            let p = p.as_ref();
            let anchored = if p.starts_with('/') {
                p.to_string()
            } else {
                format!("/{p}")
            };
            let glob = GlobBuilder::new(&anchored)
                .literal_separator(true)
                .backslash_escape(true)
                .build()
                .map_err(|source| ExclusionError {
                    pattern: p.to_string(),
                    source,
                })?;
            b.add(glob);
            let mut prefix = Vec::new();
            for comp in anchored.trim_start_matches('/').split('/') {
                if comp.contains(['*', '?', '[', '{', '\\']) {
                    break;
                }
                if !prefix.is_empty() {
                    prefix.push(b'/');
                }
                prefix.extend_from_slice(comp.as_bytes());
            }
            prefixes.push(prefix);
            kept.push(p.to_string());
        }
        let set = b.build().map_err(|source| ExclusionError {
            pattern: kept.join(", "),
            source,
        })?;
        Ok(ExclusionRules {
            set,
            patterns: kept,
            prefixes,
        })
    }

    /// The patterns, as given.
    #[must_use]
    pub fn patterns(&self) -> &[String] {
        &self.patterns
    }

    /// True when nothing is excluded.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// The pattern that excludes `rel` itself (not looking at ancestors).
    fn matching(&self, rel: &[u8]) -> Option<&str> {
        if self.patterns.is_empty() || rel.is_empty() {
            return None;
        }
        let mut abs = Vec::with_capacity(rel.len() + 1);
        abs.push(b'/');
        abs.extend_from_slice(rel);
        let path = Path::new(OsStr::from_bytes(&abs));
        self.set
            .matches(path)
            .first()
            .map(|&i| self.patterns[i].as_str())
    }

    /// True when `rel` (relative, no leading `/`) or one of its ancestors matches.
    #[must_use]
    pub fn is_excluded(&self, rel: &[u8]) -> bool {
        self.excluded_by(rel).is_some()
    }

    /// The pattern excluding `rel` or its nearest excluded ancestor, if any.
    #[must_use]
    pub fn excluded_by(&self, rel: &[u8]) -> Option<&str> {
        if self.patterns.is_empty() {
            return None;
        }
        let mut end = 0;
        loop {
            let next = rel[end..].iter().position(|&b| b == b'/').map(|i| end + i);
            let prefix = &rel[..next.unwrap_or(rel.len())];
            if let Some(p) = self.matching(prefix) {
                return Some(p);
            }
            match next {
                Some(i) => end = i + 1,
                None => return None,
            }
        }
    }

    /// True when some path strictly below directory `dir` might be excluded (a
    /// pattern's literal prefix is `dir`, below it, or above it): a conservative test
    /// used to decide whether an opaque directory must be expanded into per-path
    /// whiteouts so that excluded lease paths below it stay visible.
    #[must_use]
    pub fn may_match_below(&self, dir: &[u8]) -> bool {
        self.prefixes.iter().any(|p| {
            p.is_empty()
                || dir.is_empty()
                || p == dir
                || starts_with_dir(p, dir)
                || starts_with_dir(dir, p)
        })
    }
}

/// True when `path` is strictly below `dir`.
fn starts_with_dir(path: &[u8], dir: &[u8]) -> bool {
    path.len() > dir.len() && path.starts_with(dir) && path[dir.len()] == b'/'
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn ancestors_exclude_their_subtree() {
        let p = ExclusionRules::new(["/var/cache", "run/**"]).unwrap();
        assert!(p.is_excluded(b"var/cache"));
        assert!(p.is_excluded(b"var/cache/apt/x"));
        assert!(!p.is_excluded(b"var"));
        assert!(p.is_excluded(b"run/lock"));
        assert!(!p.is_excluded(b"run"));
        assert!(!p.is_excluded(b"running/x"));
        assert_eq!(p.excluded_by(b"run/a/b"), Some("run/**"));
    }

    #[test]
    fn star_does_not_cross_directories_and_bytes_match() {
        let p = ExclusionRules::new(["/tmp/*.log", "/data/caf\u{e9}/**"]).unwrap();
        assert!(p.is_excluded(b"tmp/a.log"));
        assert!(!p.is_excluded(b"tmp/sub/a.log"));
        let p2 = ExclusionRules::new(["/x/*"]).unwrap();
        assert!(p2.is_excluded(b"x/\xff\xfe"), "non-UTF-8 name");
        assert!(p.is_excluded("data/café/f".as_bytes()));
    }

    #[test]
    fn may_match_below_is_conservative() {
        let p = ExclusionRules::new(["/var/cache/**"]).unwrap();
        assert!(p.may_match_below(b"var"));
        assert!(p.may_match_below(b"var/cache"));
        assert!(p.may_match_below(b"var/cache/apt"));
        assert!(!p.may_match_below(b"etc"));
        assert!(!p.may_match_below(b"var/lib"));
        let any = ExclusionRules::new(["**/*.pyc"]).unwrap();
        assert!(any.may_match_below(b"etc"));
        assert!(!ExclusionRules::default().may_match_below(b"etc"));
    }

    #[test]
    fn bad_patterns_are_refused_with_their_text() {
        let e = ExclusionRules::new(["/ok/**", "/bad/[x"]).unwrap_err();
        assert_eq!(e.pattern, "/bad/[x");
    }
}
