//! Unified diffs of text files for `layerstack diff --patch`: imara-diff's line
//! diff (Myers, with the indent heuristic `git diff` uses) and its unified-diff
//! formatter, with a printer over raw bytes (lines are shown lossily as UTF-8:
//! the patch is for reading, never applied by LayerStack) that marks a last line
//! without a newline as git does (`\ No newline at end of file`).

use std::fmt::{self, Write as _};

use gix_imara_diff::{
    sources::byte_lines, Algorithm, Diff, InternedInput, Interner, Token, UnifiedDiffConfig,
    UnifiedDiffPrinter,
};

/// Prints lines of an interner of byte slices.
struct BytePrinter<'a>(&'a Interner<&'a [u8]>);

impl BytePrinter<'_> {
    fn line(&self, mut f: impl fmt::Write, prefix: char, token: Token) -> fmt::Result {
        let line = self.0[token];
        f.write_char(prefix)?;
        f.write_str(&String::from_utf8_lossy(line))?;
        if !line.ends_with(b"\n") {
            f.write_str("\n\\ No newline at end of file\n")?;
        }
        Ok(())
    }
}

/// `start,len` of a hunk header as git writes it: `start` is 1-based, `,len` is
/// left out when it is 1, and an empty side names the line before it.
fn range(start: u32, len: u32) -> String {
    match len {
        0 => format!("{start},0"),
        1 => format!("{}", start + 1),
        n => format!("{},{n}", start + 1),
    }
}

impl UnifiedDiffPrinter for BytePrinter<'_> {
    fn display_header(
        &self,
        mut f: impl fmt::Write,
        start_before: u32,
        start_after: u32,
        len_before: u32,
        len_after: u32,
    ) -> fmt::Result {
        writeln!(
            f,
            "@@ -{} +{} @@",
            range(start_before, len_before),
            range(start_after, len_after)
        )
    }

    fn display_context_token(&self, f: impl fmt::Write, token: Token) -> fmt::Result {
        self.line(f, ' ', token)
    }

    fn display_hunk(
        &self,
        mut f: impl fmt::Write,
        before: &[Token],
        after: &[Token],
    ) -> fmt::Result {
        for &t in before {
            self.line(&mut f, '-', t)?;
        }
        for &t in after {
            self.line(&mut f, '+', t)?;
        }
        Ok(())
    }
}

/// The hunks of a unified diff from `old` to `new` (no `---`/`+++` header; the
/// caller names the files), with `context` unchanged lines around each change.
/// Empty when the two are equal. No caps: callers bound their inputs.
#[must_use]
pub fn unified_patch(old: &[u8], new: &[u8], context: u32) -> String {
    let input = InternedInput::new(byte_lines(old), byte_lines(new));
    let mut diff = Diff::compute(Algorithm::Myers, &input);
    diff.postprocess_lines(&input);
    let mut config = UnifiedDiffConfig::default();
    config.context_len(context);
    let printer = BytePrinter(&input.interner);
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = write!(out, "{}", diff.unified_diff(&printer, config, &input));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patches_look_like_git_diff() {
        let p = unified_patch(b"a\nb\nc\n", b"a\nB\nc\n", 3);
        assert_eq!(p, "@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n");
        let p = unified_patch(b"", b"x\ny\n", 3);
        assert_eq!(p, "@@ -0,0 +1,2 @@\n+x\n+y\n");
        let p = unified_patch(b"one\n", b"one", 3);
        assert_eq!(p, "@@ -1 +1 @@\n-one\n+one\n\\ No newline at end of file\n");
        assert_eq!(unified_patch(b"same\n", b"same\n", 3), "");
        // CRLF lines differ from their LF twins and keep their \r.
        let p = unified_patch(b"a\r\nb\n", b"a\nb\n", 0);
        assert_eq!(p, "@@ -1 +1 @@\n-a\r\n+a\n");
    }
}
