//! Three-way text merge of one file, with git's semantics and hard limits
//! (ARCHITECTURE §7; design record `docs/merge-rules.md`).
//!
//! The merge itself is [`diffy::merge_bytes`] (Myers diff of base→ours and
//! base→theirs, then diff3): lines are split after each `\n` **with** their
//! terminator, so a CRLF line is a different line from its LF twin and a last line
//! without a newline is a different line from the same text with one — exactly as
//! git's xdiff compares them. The merged bytes are therefore assembled only from
//! input lines: line endings and a missing final newline come out byte for byte as
//! the side that contributed the line had them. Like `git merge-file`:
//! * changes separated by at least one unchanged line merge;
//! * overlapping or adjacent changes (no unchanged line between them), and two
//!   different insertions at the same place, conflict;
//! * identical changes on both sides apply once.
//!
//! A conflict is only reported, never rendered: conflict markers are never written
//! anywhere.
//!
//! Limits ([`MergeLimits`]): inputs over `max_bytes` or `max_lines` are not merged
//! (conflict, with the limit in the reason) — that also bounds the diff's
//! worst case, `O((N+M)·D)` time in linear space. The merge runs on its own thread
//! and the caller waits at most `timeout`; past it the path conflicts and the
//! thread is abandoned (it finishes on its own, bounded by the size limits, and
//! its result is dropped).

use std::sync::mpsc;
use std::time::Duration;

/// Size and time limits of one file merge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MergeLimits {
    /// Largest input (base, ours or theirs) that is merged, in bytes. Default 8 MiB.
    pub max_bytes: u64,
    /// Most lines an input may have to be merged. Default 200,000.
    pub max_lines: usize,
    /// Longest wait for one file's merge. Default 2 s.
    pub timeout: Duration,
}

impl Default for MergeLimits {
    fn default() -> Self {
        MergeLimits {
            max_bytes: 8 * 1024 * 1024,
            max_lines: 200_000,
            timeout: Duration::from_secs(2),
        }
    }
}

/// How many leading bytes the binary test looks at (git's `FIRST_FEW_BYTES`, 8000,
/// rounded up to 8 KiB).
pub const BINARY_SNIFF_BYTES: usize = 8192;

/// True when `data` is treated as binary: a NUL byte in its first 8 KiB, or a
/// UTF-16 or UTF-32 byte-order mark at its start (`FF FE`, `FE FF`,
/// `FF FE 00 00`, `00 00 FE FF`). A UTF-8 BOM is text.
#[must_use]
pub fn is_binary(data: &[u8]) -> bool {
    if data.starts_with(&[0xFF, 0xFE])
        || data.starts_with(&[0xFE, 0xFF])
        || data.starts_with(&[0, 0, 0xFE, 0xFF])
    {
        return true;
    }
    data[..data.len().min(BINARY_SNIFF_BYTES)].contains(&0)
}

/// The result of [`merge_text`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextMerge {
    /// The merged content.
    Clean(Vec<u8>),
    /// No merge; why, lowercase.
    Conflict(String),
}

fn line_count(data: &[u8]) -> usize {
    let nl = data.iter().filter(|&&b| b == b'\n').count();
    nl + usize::from(!data.is_empty() && data.last() != Some(&b'\n'))
}

/// Three-way merges `ours` and `theirs` against their common ancestor `base`
/// (see the module docs). Trivial cases (a side equal to the base, or both sides
/// equal) are answered without diffing.
#[must_use]
pub fn merge_text(base: &[u8], ours: &[u8], theirs: &[u8], limits: &MergeLimits) -> TextMerge {
    if ours == theirs || theirs == base {
        return TextMerge::Clean(ours.to_vec());
    }
    if ours == base {
        return TextMerge::Clean(theirs.to_vec());
    }
    for (side, data) in [("base", base), ("session", ours), ("head", theirs)] {
        if data.len() as u64 > limits.max_bytes {
            return TextMerge::Conflict(format!(
                "not merged: the {side} version is {} bytes, over the merge limit of {} bytes",
                data.len(),
                limits.max_bytes
            ));
        }
    }
    if [base, ours, theirs].iter().any(|d| is_binary(d)) {
        return TextMerge::Conflict("binary file changed on both sides".into());
    }
    for (side, data) in [("base", base), ("session", ours), ("head", theirs)] {
        let lines = line_count(data);
        if lines > limits.max_lines {
            return TextMerge::Conflict(format!(
                "not merged: the {side} version has {lines} lines, over the merge limit of {} lines",
                limits.max_lines
            ));
        }
    }
    let (tx, rx) = mpsc::channel();
    let (b, o, t) = (base.to_vec(), ours.to_vec(), theirs.to_vec());
    let spawned = std::thread::Builder::new()
        .name("layerstack-merge".into())
        .spawn(move || {
            let r = diffy::merge_bytes(&b, &o, &t);
            let _ = tx.send(r);
        });
    if let Err(e) = spawned {
        return TextMerge::Conflict(format!("not merged: cannot start the merge thread: {e}"));
    }
    match rx.recv_timeout(limits.timeout) {
        Ok(Ok(merged)) => TextMerge::Clean(merged),
        Ok(Err(_with_markers)) => {
            TextMerge::Conflict("both sides changed the same or adjacent lines".into())
        }
        Err(mpsc::RecvTimeoutError::Timeout) => TextMerge::Conflict(format!(
            "not merged: the merge took longer than the limit of {} ms",
            limits.timeout.as_millis()
        )),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            TextMerge::Conflict("not merged: the merge thread failed".into())
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn m(base: &str, ours: &str, theirs: &str) -> TextMerge {
        merge_text(
            base.as_bytes(),
            ours.as_bytes(),
            theirs.as_bytes(),
            &MergeLimits::default(),
        )
    }

    fn clean(t: TextMerge) -> String {
        match t {
            TextMerge::Clean(v) => String::from_utf8(v).unwrap(),
            TextMerge::Conflict(r) => panic!("conflict: {r}"),
        }
    }

    fn conflict(t: TextMerge) -> String {
        match t {
            TextMerge::Clean(v) => panic!("merged: {:?}", String::from_utf8_lossy(&v)),
            TextMerge::Conflict(r) => r,
        }
    }

    const BASE: &str = "1\n2\n3\n4\n5\n6\n7\n";

    #[test]
    fn hunks_separated_by_one_unchanged_line_merge() {
        let got = clean(m(
            BASE,
            "1\nTWO\n3\n4\n5\n6\n7\n",
            "1\n2\n3\nFOUR\n5\n6\n7\n",
        ));
        assert_eq!(got, "1\nTWO\n3\nFOUR\n5\n6\n7\n");
    }

    #[test]
    fn adjacent_and_overlapping_hunks_conflict() {
        let r = conflict(m(
            BASE,
            "1\nTWO\n3\n4\n5\n6\n7\n",
            "1\n2\nTHREE\n4\n5\n6\n7\n",
        ));
        assert!(r.contains("adjacent"), "{r}");
        conflict(m(
            BASE,
            "1\nTWO\nTHREE\n4\n5\n6\n7\n",
            "1\n2\nthree\n4\n5\n6\n7\n",
        ));
        // Different insertions at the same place.
        conflict(m(
            BASE,
            "0a\n1\n2\n3\n4\n5\n6\n7\n",
            "0b\n1\n2\n3\n4\n5\n6\n7\n",
        ));
        // An insertion right next to a changed line.
        conflict(m(
            BASE,
            "1\n2\nnew\n3\n4\n5\n6\n7\n",
            "1\n2\nTHREE\n4\n5\n6\n7\n",
        ));
    }

    #[test]
    fn identical_changes_apply_once() {
        let both = "1\n2\nX\n4\n5\n6\n7\nend\n";
        assert_eq!(clean(m(BASE, both, both)), both);
        let ours = "1\n2\nX\n4\n5\nSIX\n7\n";
        let theirs = "1\n2\nX\n4\n5\n6\n7\n";
        assert_eq!(clean(m(BASE, ours, theirs)), ours);
        // Both deleted the same line, one also changed another one.
        assert_eq!(
            clean(m(BASE, "1\n3\n4\n5\n6\nSEVEN\n", "1\n3\n4\n5\n6\n7\n")),
            "1\n3\n4\n5\n6\nSEVEN\n"
        );
    }

    #[test]
    fn crlf_is_preserved_byte_for_byte() {
        let base = "a\r\nb\r\nc\r\nd\r\ne\r\n";
        let got = clean(m(
            base,
            "A\r\nb\r\nc\r\nd\r\ne\r\n",
            "a\r\nb\r\nc\r\nd\r\nE\r\n",
        ));
        assert_eq!(got, "A\r\nb\r\nc\r\nd\r\nE\r\n");
        // Mixed endings: each line keeps the ending of the side that wrote it.
        let got = clean(m(
            base,
            "A\nb\r\nc\r\nd\r\ne\r\n",
            "a\r\nb\r\nc\r\nd\r\nE\n",
        ));
        assert_eq!(got, "A\nb\r\nc\r\nd\r\nE\n");
        // Converting a line's ending is a change of that line.
        conflict(m(
            base,
            "a\nb\r\nc\r\nd\r\ne\r\n",
            "A\r\nb\r\nc\r\nd\r\ne\r\n",
        ));
    }

    #[test]
    fn missing_final_newline_is_preserved() {
        let base = "a\nb\nc\nd\ne";
        assert_eq!(
            clean(m(base, "A\nb\nc\nd\ne", "a\nb\nc\nd\nE")),
            "A\nb\nc\nd\nE"
        );
        assert_eq!(
            clean(m(base, "A\nb\nc\nd\ne", "a\nb\nc\nd\ne\nf\n")),
            "A\nb\nc\nd\ne\nf\n"
        );
        // Adding the final newline changes the last line.
        assert_eq!(
            clean(m(base, "A\nb\nc\nd\ne", "a\nb\nc\nd\ne\n")),
            "A\nb\nc\nd\ne\n"
        );
        conflict(m(base, "a\nb\nc\nd\nE", "a\nb\nc\nd\ne\n"));
        // Empty files.
        assert_eq!(clean(m("", "x", "")), "x");
        assert_eq!(clean(m("x\n", "", "x\n")), "");
    }

    #[test]
    fn binary_files_never_merge() {
        assert!(is_binary(b"ab\0cd"));
        assert!(is_binary(b"\xff\xfeh\0i\0"));
        assert!(is_binary(b"\xfe\xff\0h"));
        assert!(is_binary(b"\0\0\xfe\xff"));
        assert!(!is_binary(b"\xef\xbb\xbfutf-8 with bom\n"));
        let mut late = vec![b'x'; BINARY_SNIFF_BYTES];
        late.push(0);
        assert!(!is_binary(&late), "NUL after the first 8 KiB");
        let base = b"1\n2\n3\n4\n\0".to_vec();
        let r = merge_text(
            &base,
            b"X\n2\n3\n4\n\0",
            b"1\n2\n3\nY\n\0",
            &MergeLimits::default(),
        );
        assert_eq!(
            r,
            TextMerge::Conflict("binary file changed on both sides".into())
        );
        // One side unchanged: take the other, binary or not.
        let r = merge_text(&base, &base, b"other\0", &MergeLimits::default());
        assert_eq!(r, TextMerge::Clean(b"other\0".to_vec()));
    }

    #[test]
    fn caps_turn_into_conflicts_with_the_reason() {
        let limits = MergeLimits {
            max_bytes: 10,
            ..MergeLimits::default()
        };
        let r = merge_text(
            b"1\n2\n3\n",
            b"1\n2\n3\n4\n5\n6\n",
            b"0\n1\n2\n3\n",
            &limits,
        );
        let TextMerge::Conflict(reason) = r else {
            panic!()
        };
        assert!(
            reason.contains("over the merge limit of 10 bytes"),
            "{reason}"
        );
        let limits = MergeLimits {
            max_lines: 3,
            ..MergeLimits::default()
        };
        let r = merge_text(b"1\n2\n3\n", b"1\n2\n3\n4\n", b"0\n1\n2\n3\n", &limits);
        let TextMerge::Conflict(reason) = r else {
            panic!()
        };
        assert!(
            reason.contains("4 lines, over the merge limit of 3 lines"),
            "{reason}"
        );
    }

    /// `git merge-file -p` on the same three inputs: `(clean, output)`; `None`
    /// without git.
    fn git_merge(base: &[u8], ours: &[u8], theirs: &[u8]) -> Option<(bool, Vec<u8>)> {
        let dir = crate::testutil::tmp();
        let p = |n: &str| dir.path().join(n);
        std::fs::write(p("base"), base).unwrap();
        std::fs::write(p("ours"), ours).unwrap();
        std::fs::write(p("theirs"), theirs).unwrap();
        let out = std::process::Command::new("git")
            .args(["merge-file", "-p"])
            .arg(p("ours"))
            .arg(p("base"))
            .arg(p("theirs"))
            .output()
            .ok()?;
        let code = out.status.code()?;
        assert!(code >= 0, "git merge-file failed: {out:?}");
        Some((code == 0, out.stdout))
    }

    fn side(base: &[String], edits: &[(usize, u8, bool)], tag: &str) -> Vec<u8> {
        let mut lines: Vec<String> = base.to_vec();
        // Apply from the end so indices stay valid: 0 replace, 1 delete, 2 insert after.
        let mut edits = edits.to_vec();
        edits.sort();
        edits.dedup_by_key(|e| e.0);
        for (i, op, shared) in edits.into_iter().rev() {
            if i >= lines.len() {
                continue;
            }
            let tag = if shared { "s" } else { tag };
            match op {
                0 => lines[i] = format!("{tag}{i}"),
                1 => {
                    lines.remove(i);
                }
                _ => lines.insert(i + 1, format!("{tag}+{i}")),
            }
        }
        lines.concat().into_bytes()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 300, ..Default::default() })]

        /// Against git itself: same clean/conflict verdict and, when clean, the
        /// same bytes. Lines are distinct (as in real config files), endings mix
        /// LF, CRLF and a missing final newline.
        #[test]
        fn agrees_with_git_merge_file(
            n in 3usize..12,
            crlf in proptest::collection::vec(proptest::bool::ANY, 12),
            no_final_newline in proptest::bool::ANY,
            ours_edits in proptest::collection::vec((0usize..12, 0u8..3, proptest::bool::ANY), 0..4),
            theirs_edits in proptest::collection::vec((0usize..12, 0u8..3, proptest::bool::ANY), 0..4),
        ) {
            let base: Vec<String> = (0..n)
                .map(|i| {
                    let end = if i + 1 == n && no_final_newline { "" } else if crlf[i] { "\r\n" } else { "\n" };
                    format!("line {i}{end}")
                })
                .collect();
            let fix = |mut v: Vec<String>| {
                // Keep every line terminated except possibly the file's last one.
                let k = v.len();
                for (j, l) in v.iter_mut().enumerate() {
                    if !l.ends_with('\n') && (j + 1 < k || !no_final_newline) {
                        l.push('\n');
                    }
                }
                v
            };
            // An edit flagged shared writes the same text on whichever side makes it,
            // so identical changes on both sides occur.
            let base_b = base.concat().into_bytes();
            let o = side(&fix(base.clone()), &ours_edits, "o");
            let t = side(&fix(base.clone()), &theirs_edits, "t");
            let Some((git_clean, git_out)) = git_merge(&base_b, &o, &t) else { return Ok(()) };
            if std::env::var_os("MERGE_GIT_STATS").is_some() {
                eprintln!("GIT clean={git_clean}");
            }
            match merge_text(&base_b, &o, &t, &MergeLimits::default()) {
                TextMerge::Clean(ours_out) => {
                    proptest::prop_assert!(git_clean, "we merged, git conflicted: {:?}", String::from_utf8_lossy(&ours_out));
                    proptest::prop_assert_eq!(String::from_utf8_lossy(&ours_out), String::from_utf8_lossy(&git_out));
                }
                TextMerge::Conflict(r) => proptest::prop_assert!(!git_clean, "git merged {:?}, we: {}", String::from_utf8_lossy(&git_out), r),
            }
        }
    }

    #[test]
    fn time_cap_returns_instead_of_hanging() {
        // Two unrelated 8,000-line texts: Myers' worst case (D = N + M).
        let base: String = (0..8_000).map(|i| format!("b{i}\n")).collect();
        let ours: String = (0..8_000).map(|i| format!("o{i}\n")).collect();
        let theirs: String = (0..8_000).map(|i| format!("t{i}\n")).collect();
        let limits = MergeLimits {
            timeout: Duration::from_millis(50),
            ..MergeLimits::default()
        };
        let start = std::time::Instant::now();
        let r = merge_text(base.as_bytes(), ours.as_bytes(), theirs.as_bytes(), &limits);
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        let TextMerge::Conflict(reason) = r else {
            panic!("merged")
        };
        assert!(
            reason.contains("longer than the limit of 50 ms")
                || reason.contains("same or adjacent"),
            "{reason}"
        );
    }
}
