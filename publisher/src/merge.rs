//! Three-way text merge of one file, with git's semantics and hard limits
//! (ARCHITECTURE §7; design record `docs/merge-rules.md`).
//!
//! The merge is git's: the rules of xdiff's `xdl_merge` at the zealous level
//! that `git merge-file` and `git merge` use, implemented here ([`merge3`]) on
//! line diffs from imara-diff (gitoxide's diff library): Myers by default, as
//! `git merge-file`, or histogram, as `git merge` (merge-ort) ([`DiffAlgorithm`]).
//! (gix-merge implements the same merge, but always slides hunks with imara-diff's
//! indent heuristic, which git's merges never do, so it disagrees with git on
//! indented code.) Lines end after each `\n` and keep their terminator, as in
//! xdiff, so a CRLF line is a different line from its LF twin and a last line
//! without a newline is a different line from the same text with one. The merged
//! bytes are assembled from input lines only: line endings and a missing final
//! newline come out byte for byte as the side that contributed the line had them.
//! As in git:
//! * changes separated by at least one unchanged line merge;
//! * overlapping or adjacent changes (no unchanged line between them), and two
//!   different insertions at the same place, conflict;
//! * identical changes on both sides apply once.
//!
//! Checked against git itself (property tests; rates in docs/merge-rules.md):
//! with Myers, the same verdict and, when clean, the same bytes as `git merge-file`
//! on distinct lines, repeated lines (blank lines, braces) and indented code with
//! block edits. With histogram, imara-diff anchors some texts of repeated lines
//! differently from git's histogram, so rarely the two differ.
//!
//! A publish only reports a conflict, never renders it: a published file never
//! holds conflict markers. [`render_conflict`] writes git's diff3 markers for
//! people (`layerstack conflict show`) and for `layerstack session rebase`, which
//! puts them into a session's upper — and a publish is then refused while they
//! are there ([`conflict_blocks`]).
//!
//! Blame: [`merge_text_traced_within`] is the same merge (the same regions,
//! assembled once more) that also says where every output line comes from
//! ([`LineOrigin`]: base, ours or theirs).
//!
//! Limits ([`MergeOptions`]): inputs over `max_bytes` or `max_lines` are not merged
//! (conflict, with the limit in the reason). The line cap bounds the diff's worst
//! case (Myers is `O((N+M)·D)`; histogram falls back to Myers on highly repeated
//! lines).
//!
//! Time: each merge runs on its own thread and the caller waits at most what is
//! left of a [`MergeBudget`] — one budget (`timeout`) for **all** merges of one
//! publish together. Past it the path conflicts, the budget is used up (no further
//! merge is started) and the thread is abandoned: it finishes on its own, its work
//! bounded by the caps above, and its result is dropped. So one plan abandons at
//! most one thread.

use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The line diff under the three-way merge.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum DiffAlgorithm {
    /// Myers diff, what `git merge-file` uses. The default: whenever a merge is
    /// clean, its bytes are git merge-file's (measured; docs/merge-rules.md).
    #[default]
    Myers,
    /// Histogram diff, what `git merge`, `rebase` and `cherry-pick` use
    /// (merge-ort). imara-diff's histogram anchors repeated lines differently from
    /// git's in rare cases, so a clean merge can differ from `git merge`'s.
    Histogram,
}

impl DiffAlgorithm {
    /// The name in configuration and messages: `histogram` or `myers`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            DiffAlgorithm::Histogram => "histogram",
            DiffAlgorithm::Myers => "myers",
        }
    }

    fn imara(self) -> gix_imara_diff::Algorithm {
        match self {
            DiffAlgorithm::Histogram => gix_imara_diff::Algorithm::Histogram,
            DiffAlgorithm::Myers => gix_imara_diff::Algorithm::Myers,
        }
    }
}

/// How the text merges of one publish run: the diff algorithm, and size and time
/// limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MergeOptions {
    /// Largest input (base, ours or theirs) that is merged, in bytes. Default 1 MiB.
    pub max_bytes: u64,
    /// Most lines an input may have to be merged. Default 10,000 (worst case about
    /// 1.5 s in a debug build, 0.08 s in release: docs/merge-rules.md).
    pub max_lines: usize,
    /// Time budget of **all** merges of one publish together (not per file): the
    /// gate waits at most this long in total. Default 2 s.
    pub timeout: Duration,
    /// The line diff. Default [`DiffAlgorithm::Myers`], as `git merge-file`.
    pub diff_algorithm: DiffAlgorithm,
}

/// Default [`MergeOptions::max_bytes`]: 1 MiB.
pub const DEFAULT_MAX_BYTES: u64 = 1024 * 1024;
/// Default [`MergeOptions::max_lines`].
pub const DEFAULT_MAX_LINES: usize = 10_000;
/// Default [`MergeOptions::timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

impl Default for MergeOptions {
    fn default() -> Self {
        MergeOptions {
            max_bytes: DEFAULT_MAX_BYTES,
            max_lines: DEFAULT_MAX_LINES,
            timeout: DEFAULT_TIMEOUT,
            diff_algorithm: DiffAlgorithm::default(),
        }
    }
}

/// The time left for the text merges of one publish ([`MergeOptions::timeout`] is
/// the total). Every [`merge_text_within`] that runs a diff spends from it; once
/// it is used up, no further merge is started.
#[derive(Debug, Clone)]
pub struct MergeBudget {
    total: Duration,
    spent: Duration,
}

impl MergeBudget {
    /// A budget of `total`.
    #[must_use]
    pub fn new(total: Duration) -> MergeBudget {
        MergeBudget {
            total,
            spent: Duration::ZERO,
        }
    }

    /// The whole budget.
    #[must_use]
    pub fn total(&self) -> Duration {
        self.total
    }

    /// Time spent waiting for merges so far.
    #[must_use]
    pub fn spent(&self) -> Duration {
        self.spent
    }

    /// What is left.
    #[must_use]
    pub fn remaining(&self) -> Duration {
        self.total.saturating_sub(self.spent)
    }

    /// True when nothing is left.
    #[must_use]
    pub fn is_used_up(&self) -> bool {
        self.remaining().is_zero()
    }

    /// Why a merge was not started: the budget is used up.
    pub(crate) fn used_up_reason(&self) -> String {
        format!(
            "not merged: the merge time budget of {} ms for this publish is used up",
            self.total.as_millis()
        )
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

/// One side's change against the base: base lines `base` are replaced by the
/// side's lines `side` (line indices).
#[derive(Debug, Clone)]
struct SideChange {
    base: std::ops::Range<i64>,
    side: std::ops::Range<i64>,
}

/// The changes from the interned `input.before` (the base) to `input.after` (one
/// side): imara-diff's line diff, with the plain slider post-processing — merge
/// adjacent hunks, slide ambiguous ones as far down as they go — that xdiff's
/// `xdl_change_compact` does for a merge. Not the indent heuristic: `git diff`
/// uses it, git's merges do not (it is set only from `diff.c`'s options).
fn side_changes(
    input: &gix_imara_diff::InternedInput<&[u8]>,
    algorithm: DiffAlgorithm,
) -> Vec<SideChange> {
    let mut diff = gix_imara_diff::Diff::compute(algorithm.imara(), input);
    diff.postprocess_no_heuristic(input);
    diff.hunks()
        .map(|h| SideChange {
            base: i64::from(h.before.start)..i64::from(h.before.end),
            side: i64::from(h.after.start)..i64::from(h.after.end),
        })
        .collect()
}

/// What a region of the merge result takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Take {
    Ours,
    Theirs,
    Conflict,
}

/// A region of the merge: ours' lines `[o, o + o_len)` correspond to theirs'
/// `[t, t + t_len)` and to the base's `[b, b + b_len)` (the same stretch of the
/// base); `take` says whose lines the result has there.
#[derive(Debug, Clone, Copy)]
struct Region {
    take: Take,
    o: i64,
    o_len: i64,
    t: i64,
    t_len: i64,
    b: i64,
    b_len: i64,
}

/// Appends `r`, folding it into the previous region when the two touch in ours'
/// or theirs' lines; two folded regions of different sides become one conflict
/// (so changes with no unchanged line between them conflict, as in git).
fn push_region(regions: &mut Vec<Region>, r: Region) {
    if let Some(m) = regions.last_mut() {
        if r.o <= m.o + m.o_len || r.t <= m.t + m.t_len {
            if r.take != m.take {
                m.take = Take::Conflict;
            }
            m.o_len = r.o + r.o_len - m.o;
            m.t_len = r.t + r.t_len - m.t;
            let b_end = (m.b + m.b_len).max(r.b + r.b_len);
            m.b = m.b.min(r.b);
            m.b_len = b_end - m.b;
            return;
        }
    }
    regions.push(r);
}

/// The regions of a three-way merge (steps 1–3 of [`merge3`]) and what is needed
/// to assemble its result: the interned lines of the three inputs, and the
/// stretches where both sides made the same change (left out of the regions).
struct Merge3<'a> {
    /// `before`: the base's lines; `after`: theirs' lines.
    input: gix_imara_diff::InternedInput<&'a [u8]>,
    ours: Vec<gix_imara_diff::Token>,
    ours_changes: Vec<SideChange>,
    theirs_changes: Vec<SideChange>,
    regions: Vec<Region>,
    /// Ours' lines `o` equal theirs' lines `t` because both sides made the same
    /// change there (taken once, from ours).
    same: Vec<(std::ops::Range<i64>, std::ops::Range<i64>)>,
}

impl<'a> Merge3<'a> {
    /// Steps 1–3 of [`merge3`]: both diffs, the walk in base order, the folding.
    fn new(base: &'a [u8], ours: &'a [u8], theirs: &'a [u8], algorithm: DiffAlgorithm) -> Self {
        use gix_imara_diff::sources::byte_lines;
        // One interner for the three, so equal lines are equal tokens on every side.
        let mut input = gix_imara_diff::InternedInput::default();
        input.update_before(byte_lines(base));
        input.update_after(byte_lines(ours));
        let ours_changes = side_changes(&input, algorithm);
        let ours_tokens = std::mem::take(&mut input.after);
        input.update_after(byte_lines(theirs));
        let theirs_changes = side_changes(&input, algorithm);
        let theirs_tokens = &input.after;
        let len = |v: &[gix_imara_diff::Token]| i64::try_from(v.len()).unwrap_or(i64::MAX);
        let (base_len, ours_len, theirs_len) =
            (len(&input.before), len(&ours_tokens), len(theirs_tokens));

        let mut regions: Vec<Region> = Vec::new();
        let mut same = Vec::new();
        let (mut a, mut b) = (
            ours_changes.iter().peekable(),
            theirs_changes.iter().peekable(),
        );
        while let (Some(&x), Some(&y)) = (a.peek(), b.peek()) {
            if x.base.end < y.base.start {
                // Only ours changed here; theirs' lines are the base's, shifted by
                // theirs' offset before its next change.
                let t = y.side.start - y.base.start + x.base.start;
                push_region(
                    &mut regions,
                    Region {
                        take: Take::Ours,
                        o: x.side.start,
                        o_len: x.side.end - x.side.start,
                        t,
                        t_len: x.base.end - x.base.start,
                        b: x.base.start,
                        b_len: x.base.end - x.base.start,
                    },
                );
                a.next();
                continue;
            }
            if y.base.end < x.base.start {
                let o = x.side.start - x.base.start + y.base.start;
                push_region(
                    &mut regions,
                    Region {
                        take: Take::Theirs,
                        o,
                        o_len: y.base.end - y.base.start,
                        t: y.side.start,
                        t_len: y.side.end - y.side.start,
                        b: y.base.start,
                        b_len: y.base.end - y.base.start,
                    },
                );
                b.next();
                continue;
            }
            let same_change = x.base == y.base
                && tokens_of(&ours_tokens, &x.side) == tokens_of(theirs_tokens, &y.side);
            if same_change {
                same.push((x.side.clone(), y.side.clone()));
            } else {
                // One conflict from the lower start to the higher end of both.
                let start = x.base.start.min(y.base.start);
                let end = x.base.end.max(y.base.end);
                let o = x.side.start - (x.base.start - start);
                let t = y.side.start - (y.base.start - start);
                let o_end = x.side.end + (end - x.base.end);
                let t_end = y.side.end + (end - y.base.end);
                push_region(
                    &mut regions,
                    Region {
                        take: Take::Conflict,
                        o,
                        o_len: o_end - o,
                        t,
                        t_len: t_end - t,
                        b: start,
                        b_len: end - start,
                    },
                );
            }
            // Identical changes are left out: the result is ours' lines there.
            let (x_end, y_end) = (x.base.end, y.base.end);
            if x_end >= y_end {
                b.next();
            }
            if y_end >= x_end {
                a.next();
            }
        }
        for x in a {
            push_region(
                &mut regions,
                Region {
                    take: Take::Ours,
                    o: x.side.start,
                    o_len: x.side.end - x.side.start,
                    t: x.base.start + theirs_len - base_len,
                    t_len: x.base.end - x.base.start,
                    b: x.base.start,
                    b_len: x.base.end - x.base.start,
                },
            );
        }
        for y in b {
            push_region(
                &mut regions,
                Region {
                    take: Take::Theirs,
                    o: y.base.start + ours_len - base_len,
                    o_len: y.base.end - y.base.start,
                    t: y.side.start,
                    t_len: y.side.end - y.side.start,
                    b: y.base.start,
                    b_len: y.base.end - y.base.start,
                },
            );
        }
        Merge3 {
            input,
            ours: ours_tokens,
            ours_changes,
            theirs_changes,
            regions,
            same,
        }
    }

    fn ours_len(&self) -> i64 {
        i64::try_from(self.ours.len()).unwrap_or(i64::MAX)
    }

    /// Step 4 of [`merge3`]: what region `r` takes in the end (a conflict whose
    /// two sides wrote the same non-empty lines is ours').
    fn resolve(&self, r: &Region) -> Take {
        match r.take {
            Take::Conflict
                if r.o_len > 0
                    && r.t_len > 0
                    && tokens_of(&self.ours, &(r.o..r.o + r.o_len))
                        == tokens_of(&self.input.after, &(r.t..r.t + r.t_len)) =>
            {
                // Both sides wrote the same lines here.
                Take::Ours
            }
            t => t,
        }
    }

    /// Appends the lines of `tokens[from..from + n]`, as interned (terminators
    /// included).
    fn lines(&self, tokens: &[gix_imara_diff::Token], from: i64, n: i64, out: &mut Vec<u8>) {
        for &t in tokens_of(tokens, &(from..from + n)) {
            out.extend_from_slice(self.input.interner[t]);
        }
    }

    /// The merged bytes: ours' lines with theirs' changes applied; `Err(())` on a
    /// conflict.
    fn assemble(&self, capacity: usize) -> Result<Vec<u8>, ()> {
        let mut out = Vec::with_capacity(capacity);
        let mut at = 0;
        for r in &self.regions {
            let take = self.resolve(r);
            self.lines(&self.ours, at, r.o - at, &mut out);
            match take {
                Take::Ours => self.lines(&self.ours, r.o, r.o_len, &mut out),
                Take::Theirs => self.lines(&self.input.after, r.t, r.t_len, &mut out),
                Take::Conflict => return Err(()),
            }
            at = r.o + r.o_len;
        }
        self.lines(&self.ours, at, self.ours_len() - at, &mut out);
        Ok(out)
    }
}

/// Where one line of a merge result comes from: a line index (from 0) into the
/// base, ours (the session) or theirs (the head).
///
/// A line both sides left as the base had it is [`Base`](LineOrigin::Base); a
/// line one side wrote is that side's; a line **both** sides wrote the same way
/// (an identical change, taken once) is [`Theirs`](LineOrigin::Theirs): the head
/// had it first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LineOrigin {
    /// Line `n` of the base (unchanged on the side it was taken from).
    Base(usize),
    /// Line `n` of ours, written by ours.
    Ours(usize),
    /// Line `n` of theirs, written by theirs (or by both sides the same way).
    Theirs(usize),
}

/// For every line of a side, the base line it is (`Some`) or `None` when the
/// side wrote it (it lies in one of the side's changes).
fn base_lines_of(changes: &[SideChange], side_len: usize) -> Vec<Option<usize>> {
    let mut map = vec![None; side_len];
    let (mut bi, mut si) = (0usize, 0usize);
    let idx = |v: i64| usize::try_from(v).unwrap_or(0);
    for c in changes {
        while si < idx(c.side.start) && si < side_len {
            map[si] = Some(bi);
            si += 1;
            bi += 1;
        }
        si = idx(c.side.end);
        bi = idx(c.base.end);
    }
    while si < side_len {
        map[si] = Some(bi);
        si += 1;
        bi += 1;
    }
    map
}

/// Conflict marker lines as `git merge-file --diff3` writes them, named for
/// LayerStack's sides: ours is the session, the base the lease, theirs the head.
pub const MARKER_OURS: &str = "<<<<<<< session";
/// The base section's marker (see [`MARKER_OURS`]).
pub const MARKER_BASE: &str = "||||||| lease";
/// The separator before the head's lines.
pub const MARKER_SEP: &str = "=======";
/// The marker ending a conflict block.
pub const MARKER_THEIRS: &str = ">>>>>>> head";

impl Merge3<'_> {
    /// [`Merge3::assemble`] with the origin of every output line.
    fn assemble_with_origins(&self, capacity: usize) -> Result<(Vec<u8>, Vec<LineOrigin>), ()> {
        let idx = |v: i64| usize::try_from(v).unwrap_or(0);
        let ours_base = base_lines_of(&self.ours_changes, self.ours.len());
        let theirs_base = base_lines_of(&self.theirs_changes, self.input.after.len());
        // Ours' lines that theirs wrote the same way: identical changes, and
        // conflicts whose two sides are the same lines (step 4).
        let mut same: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
        let mut pair = |o: &std::ops::Range<i64>, t: &std::ops::Range<i64>| {
            for (k, j) in (o.start..o.end).zip(t.start..t.end) {
                same.insert(idx(k), idx(j));
            }
        };
        for (o, t) in &self.same {
            pair(o, t);
        }
        for r in &self.regions {
            if r.take == Take::Conflict && self.resolve(r) == Take::Ours {
                pair(&(r.o..r.o + r.o_len), &(r.t..r.t + r.t_len));
            }
        }
        let ours_origin = |k: usize| match (ours_base[k], same.get(&k)) {
            (Some(b), _) => LineOrigin::Base(b),
            (None, Some(&j)) => match theirs_base.get(j).copied().flatten() {
                Some(b) => LineOrigin::Base(b),
                None => LineOrigin::Theirs(j),
            },
            (None, None) => LineOrigin::Ours(k),
        };
        let theirs_origin = |j: usize| match theirs_base[j] {
            Some(b) => LineOrigin::Base(b),
            None => LineOrigin::Theirs(j),
        };
        let mut origins = Vec::new();
        let push_ours = |from: i64, n: i64, origins: &mut Vec<LineOrigin>| {
            for k in from..from + n {
                origins.push(ours_origin(idx(k)));
            }
        };
        let mut at = 0;
        for r in &self.regions {
            push_ours(at, r.o - at, &mut origins);
            match self.resolve(r) {
                Take::Ours => push_ours(r.o, r.o_len, &mut origins),
                Take::Theirs => {
                    for j in r.t..r.t + r.t_len {
                        origins.push(theirs_origin(idx(j)));
                    }
                }
                Take::Conflict => return Err(()),
            }
            at = r.o + r.o_len;
        }
        push_ours(at, self.ours_len() - at, &mut origins);
        let out = self.assemble(capacity)?;
        Ok((out, origins))
    }

    /// The merge with every conflict written out between markers, as `git
    /// merge-file --diff3` does ([`MARKER_OURS`], [`MARKER_BASE`], [`MARKER_SEP`],
    /// [`MARKER_THEIRS`], each on its own line ending in `\n`; a section whose
    /// last line has no newline gets one before the next marker). Returns the
    /// bytes and the number of conflict blocks.
    fn render_markers(&self, capacity: usize) -> (Vec<u8>, usize) {
        let mut out = Vec::with_capacity(capacity);
        let mut blocks = 0;
        let mut at = 0;
        let marker = |out: &mut Vec<u8>, m: &str| {
            if !out.is_empty() && out.last() != Some(&b'\n') {
                out.push(b'\n');
            }
            out.extend_from_slice(m.as_bytes());
            out.push(b'\n');
        };
        for r in &self.regions {
            self.lines(&self.ours, at, r.o - at, &mut out);
            match self.resolve(r) {
                Take::Ours => self.lines(&self.ours, r.o, r.o_len, &mut out),
                Take::Theirs => self.lines(&self.input.after, r.t, r.t_len, &mut out),
                Take::Conflict => {
                    blocks += 1;
                    marker(&mut out, MARKER_OURS);
                    self.lines(&self.ours, r.o, r.o_len, &mut out);
                    marker(&mut out, MARKER_BASE);
                    self.lines(&self.input.before, r.b, r.b_len, &mut out);
                    marker(&mut out, MARKER_SEP);
                    self.lines(&self.input.after, r.t, r.t_len, &mut out);
                    marker(&mut out, MARKER_THEIRS);
                }
            }
            at = r.o + r.o_len;
        }
        self.lines(&self.ours, at, self.ours_len() - at, &mut out);
        (out, blocks)
    }
}

/// Three-way merge with git's rules (the semantics of xdiff's `xdl_merge` at the
/// `zealous` level that `git merge-file` and `git merge` use; our own code, on
/// imara-diff's line diffs — gix-merge implements the same merge but always slides
/// hunks with the indent heuristic, which git's merges never do, and so
/// disagrees with git on indented code):
///
/// 1. diff base→ours and base→theirs (lines keep their terminators);
/// 2. walk both change lists in base order: a change strictly before the other
///    side's next change (at least one unchanged base line between) is taken from
///    its side; changes that overlap or touch are the same change when both sides
///    replaced the same base lines with the same lines (taken once), otherwise one
///    conflict region spanning both;
/// 3. regions that touch in ours' or theirs' lines fold together (different sides
///    → conflict);
/// 4. a conflict whose two sides wrote the same non-empty lines is no conflict.
///
/// The result is ours' lines with theirs' changes applied; `Err(())` on a conflict.
fn merge3(
    base: &[u8],
    ours: &[u8],
    theirs: &[u8],
    algorithm: DiffAlgorithm,
) -> Result<Vec<u8>, ()> {
    Merge3::new(base, ours, theirs, algorithm).assemble(ours.len().max(theirs.len()))
}

/// The tokens of `v` in `range`.
fn tokens_of<'a>(
    v: &'a [gix_imara_diff::Token],
    range: &std::ops::Range<i64>,
) -> &'a [gix_imara_diff::Token] {
    let start = usize::try_from(range.start).unwrap_or(0);
    let end = usize::try_from(range.end).unwrap_or(0);
    &v[start..end]
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
/// (see the module docs), with a budget of `limits.timeout` for this one merge.
/// Trivial cases (a side equal to the base, or both sides equal) are answered
/// without diffing.
#[must_use]
pub fn merge_text(base: &[u8], ours: &[u8], theirs: &[u8], limits: &MergeOptions) -> TextMerge {
    merge_text_within(
        base,
        ours,
        theirs,
        limits,
        &mut MergeBudget::new(limits.timeout),
    )
}

/// [`merge_text`] spending from `budget`, shared by all merges of one publish:
/// waits at most `budget.remaining()`; a merge that does not finish in it conflicts
/// and uses the budget up (its thread is abandoned); with nothing left, no merge is
/// started and the path conflicts. Trivial cases and inputs over a cap cost nothing.
#[must_use]
pub fn merge_text_within(
    base: &[u8],
    ours: &[u8],
    theirs: &[u8],
    limits: &MergeOptions,
    budget: &mut MergeBudget,
) -> TextMerge {
    match merge_within(base, ours, theirs, limits, budget, false) {
        TracedMerge::Clean { content, .. } => TextMerge::Clean(content),
        TracedMerge::Overlap(reason) | TracedMerge::Conflict(reason) => TextMerge::Conflict(reason),
    }
}

/// The result of [`merge_text_traced_within`]: a text merge that also says where
/// every line of the result comes from, and why it did not merge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TracedMerge {
    /// The merged content (the same bytes [`merge_text_within`] returns), and per
    /// line its [`LineOrigin`] — `None` only for a trivial merge (a side equal to
    /// the base, or both sides equal) over the merge's caps, which is answered
    /// without a diff.
    Clean {
        /// The merged bytes.
        content: Vec<u8>,
        /// One origin per line of `content`.
        origins: Option<Vec<LineOrigin>>,
    },
    /// Both sides changed the same or adjacent lines: the conflict can be written
    /// out with markers ([`render_conflict`]).
    Overlap(String),
    /// Not merged for another reason (binary, a size cap, the time budget).
    Conflict(String),
}

/// The reason of [`TracedMerge::Overlap`] and of the conflict [`merge_text`]
/// reports for it.
pub const OVERLAP_REASON: &str = "both sides changed the same or adjacent lines";

/// [`merge_text_within`], tracing every output line to the base, ours or theirs
/// ([`LineOrigin`]): the same verdict, the same bytes, within the same caps and
/// budget.
#[must_use]
pub fn merge_text_traced_within(
    base: &[u8],
    ours: &[u8],
    theirs: &[u8],
    limits: &MergeOptions,
    budget: &mut MergeBudget,
) -> TracedMerge {
    merge_within(base, ours, theirs, limits, budget, true)
}

/// The origins of `side`'s lines against `base` when the merge result is
/// `side` as a whole: unchanged lines are the base's; changed ones are ours'
/// (`theirs` false) or theirs'.
fn two_way_origins(
    base: &[u8],
    side: &[u8],
    algorithm: DiffAlgorithm,
    theirs: bool,
) -> Vec<LineOrigin> {
    unchanged_lines(base, side, algorithm)
        .into_iter()
        .enumerate()
        .map(|(i, b)| match (b, theirs) {
            (Some(b), _) => LineOrigin::Base(b),
            (None, false) => LineOrigin::Ours(i),
            (None, true) => LineOrigin::Theirs(i),
        })
        .collect()
}

/// For every line of `new`, the line of `old` it is (`Some(index)`, from 0) when
/// a line diff of the two leaves it unchanged, or `None` when `new` wrote it.
/// Lines keep their terminators, as in the merge: a CRLF line differs from its LF
/// twin, a last line without `\n` from the same text with one. No caps: callers
/// bound their inputs.
#[must_use]
pub fn unchanged_lines(old: &[u8], new: &[u8], algorithm: DiffAlgorithm) -> Vec<Option<usize>> {
    use gix_imara_diff::sources::byte_lines;
    let input = gix_imara_diff::InternedInput::new(byte_lines(old), byte_lines(new));
    let changes = side_changes(&input, algorithm);
    base_lines_of(&changes, input.after.len())
}

fn merge_within(
    base: &[u8],
    ours: &[u8],
    theirs: &[u8],
    limits: &MergeOptions,
    budget: &mut MergeBudget,
    traced: bool,
) -> TracedMerge {
    let within_caps = || {
        [base, ours, theirs]
            .iter()
            .all(|d| d.len() as u64 <= limits.max_bytes && line_count(d) <= limits.max_lines)
    };
    if ours == theirs || theirs == base {
        let origins = (traced && within_caps()).then(|| {
            if ours == base {
                (0..line_count(ours)).map(LineOrigin::Base).collect()
            } else {
                // Ours is the result; where theirs equals it, the head had it first.
                two_way_origins(base, ours, limits.diff_algorithm, ours == theirs)
            }
        });
        return TracedMerge::Clean {
            content: ours.to_vec(),
            origins,
        };
    }
    if ours == base {
        let origins = (traced && within_caps())
            .then(|| two_way_origins(base, theirs, limits.diff_algorithm, true));
        return TracedMerge::Clean {
            content: theirs.to_vec(),
            origins,
        };
    }
    for (side, data) in [("base", base), ("session", ours), ("head", theirs)] {
        if data.len() as u64 > limits.max_bytes {
            return TracedMerge::Conflict(format!(
                "not merged: the {side} version is {} bytes, over the merge limit of {} bytes",
                data.len(),
                limits.max_bytes
            ));
        }
    }
    if [base, ours, theirs].iter().any(|d| is_binary(d)) {
        return TracedMerge::Conflict("binary file changed on both sides".into());
    }
    for (side, data) in [("base", base), ("session", ours), ("head", theirs)] {
        let lines = line_count(data);
        if lines > limits.max_lines {
            return TracedMerge::Conflict(format!(
                "not merged: the {side} version has {lines} lines, over the merge limit of {} lines",
                limits.max_lines
            ));
        }
    }
    let remaining = budget.remaining();
    if remaining.is_zero() {
        return TracedMerge::Conflict(budget.used_up_reason());
    }
    let (tx, rx) = mpsc::channel();
    let (b, o, t) = (base.to_vec(), ours.to_vec(), theirs.to_vec());
    let algorithm = limits.diff_algorithm;
    let start = Instant::now();
    let spawned = std::thread::Builder::new()
        .name("layerstack-merge".into())
        .spawn(move || {
            let r = if traced {
                let m = Merge3::new(&b, &o, &t, algorithm);
                m.assemble_with_origins(o.len().max(t.len()))
                    .map(|(c, origins)| (c, Some(origins)))
            } else {
                merge3(&b, &o, &t, algorithm).map(|c| (c, None))
            };
            let _ = tx.send(r);
        });
    if let Err(e) = spawned {
        return TracedMerge::Conflict(format!("not merged: cannot start the merge thread: {e}"));
    }
    let answer = rx.recv_timeout(remaining);
    budget.spent = budget.spent.saturating_add(start.elapsed());
    match answer {
        Ok(Ok((content, origins))) => TracedMerge::Clean { content, origins },
        Ok(Err(())) => TracedMerge::Overlap(OVERLAP_REASON.into()),
        Err(mpsc::RecvTimeoutError::Timeout) => {
            // The thread runs on (bounded by the caps); nothing more is started.
            budget.spent = budget.total;
            TracedMerge::Conflict(format!(
                "not merged: merging took longer than the limit of {} ms (merge.timeout_ms, for all merges of one publish together)",
                budget.total.as_millis()
            ))
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            TracedMerge::Conflict("not merged: the merge thread failed".into())
        }
    }
}

/// The three-way view of a text conflict: the merge of `ours` (the session) and
/// `theirs` (the head) against `base` (the lease), with every conflicting stretch
/// written between git-style diff3 markers ([`MARKER_OURS`] … [`MARKER_THEIRS`]);
/// what merges is merged as [`merge_text`] merges it. Returns the bytes and the
/// number of conflict blocks (0: the three merge cleanly). For display and for
/// `layerstack session rebase` only: a publish never writes markers.
///
/// # Errors
/// The reason when the inputs are not merged at all: binary, or over
/// `limits.max_bytes` / `limits.max_lines` (no time budget: the caps bound it).
pub fn render_conflict(
    base: &[u8],
    ours: &[u8],
    theirs: &[u8],
    limits: &MergeOptions,
) -> Result<(Vec<u8>, usize), String> {
    for (side, data) in [("lease", base), ("session", ours), ("head", theirs)] {
        if is_binary(data) {
            return Err(format!("the {side} version is binary"));
        }
        if data.len() as u64 > limits.max_bytes {
            return Err(format!(
                "the {side} version is {} bytes, over the merge limit of {} bytes",
                data.len(),
                limits.max_bytes
            ));
        }
        let lines = line_count(data);
        if lines > limits.max_lines {
            return Err(format!(
                "the {side} version has {lines} lines, over the merge limit of {} lines",
                limits.max_lines
            ));
        }
    }
    Ok(Merge3::new(base, ours, theirs, limits.diff_algorithm)
        .render_markers(ours.len().max(theirs.len()) + 64))
}

/// The conflict marker blocks `content` holds, by the rule git's own check for
/// unmerged markers follows: byte ranges from the start of a line that is
/// exactly [`MARKER_OURS`] to the end of the next line after it that is exactly
/// [`MARKER_THEIRS`] (its `\n` included), whatever lies between — the
/// [`MARKER_BASE`] and [`MARKER_SEP`] lines [`render_conflict`] writes may have
/// been edited or removed, and the block still counts. Another `MARKER_OURS`
/// line inside an open block belongs to that block. A marker line may end in
/// `\r\n`, and the last line may lack its `\n`. A `MARKER_OURS` line with no
/// `MARKER_THEIRS` line after it is no block.
#[must_use]
pub fn conflict_blocks(content: &[u8]) -> Vec<std::ops::Range<usize>> {
    let is = |line: &[u8], m: &str| {
        let l = line.strip_suffix(b"\n").unwrap_or(line);
        let l = l.strip_suffix(b"\r").unwrap_or(l);
        l == m.as_bytes()
    };
    let mut blocks = Vec::new();
    // The start of the open block.
    let mut open: Option<usize> = None;
    let mut at = 0;
    for line in content.split_inclusive(|&b| b == b'\n') {
        let end = at + line.len();
        match open {
            None if is(line, MARKER_OURS) => open = Some(at),
            Some(start) if is(line, MARKER_THEIRS) => {
                blocks.push(start..end);
                open = None;
            }
            _ => {}
        }
        at = end;
    }
    blocks
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
            &MergeOptions::default(),
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
            &MergeOptions::default(),
        );
        assert_eq!(
            r,
            TextMerge::Conflict("binary file changed on both sides".into())
        );
        // One side unchanged: take the other, binary or not.
        let r = merge_text(&base, &base, b"other\0", &MergeOptions::default());
        assert_eq!(r, TextMerge::Clean(b"other\0".to_vec()));
    }

    #[test]
    fn caps_turn_into_conflicts_with_the_reason() {
        let limits = MergeOptions {
            max_bytes: 10,
            ..MergeOptions::default()
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
        let limits = MergeOptions {
            max_lines: 3,
            ..MergeOptions::default()
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

    /// git's merge of the same three inputs: `(clean, output)`. Myers: `git
    /// merge-file -p` (its default diff). Histogram: `git merge-file -p
    /// --diff-algorithm=histogram` (git 2.44+), or on an older git (Debian
    /// bookworm has 2.39) a real `git merge` of two branches in a scratch
    /// repository, whose merge-ort strategy diffs with histogram. Panics when git
    /// cannot be run (scripts/install-deps.sh installs it).
    fn git_merge_with(
        base: &[u8],
        ours: &[u8],
        theirs: &[u8],
        algorithm: DiffAlgorithm,
    ) -> (bool, Vec<u8>) {
        let dir = crate::testutil::tmp();
        let p = |n: &str| dir.path().join(n);
        std::fs::write(p("base"), base).unwrap();
        std::fs::write(p("ours"), ours).unwrap();
        std::fs::write(p("theirs"), theirs).unwrap();
        let mut args = vec!["merge-file", "-p"];
        if algorithm == DiffAlgorithm::Histogram {
            args.extend(["--diff-algorithm", "histogram"]);
        }
        let out = git(dir.path(), &args, &[p("ours"), p("base"), p("theirs")]);
        match out.status.code() {
            // The exit status is the number of conflicts (capped at 127).
            Some(code) if (0..=127).contains(&code) => (code == 0, out.stdout),
            // 129: an option this git does not know (`--diff-algorithm`).
            Some(129) if algorithm == DiffAlgorithm::Histogram => {
                git_merge_branches(dir.path(), base, ours, theirs)
            }
            _ => panic!(
                "git merge-file failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        }
    }

    /// Runs git in `cwd` without user or system configuration.
    fn git(
        cwd: &std::path::Path,
        args: &[&str],
        paths: &[std::path::PathBuf],
    ) -> std::process::Output {
        let out = std::process::Command::new("git")
            .current_dir(cwd)
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .args([
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@t",
                "-c",
                "init.defaultBranch=ours",
            ])
            .args(args)
            .args(paths)
            .output();
        match out {
            Ok(o) => o,
            Err(e) if std::env::var("CI").as_deref() == Ok("true") => {
                panic!("the merge tests compare with git and CI=true: cannot run git: {e}")
            }
            Err(e) => panic!("cannot run git (install it: apt-get install git): {e}"),
        }
    }

    /// `git merge` of branch `theirs` into `ours`, both forked from `base`:
    /// `(clean, merged file)`.
    fn git_merge_branches(
        dir: &std::path::Path,
        base: &[u8],
        ours: &[u8],
        theirs: &[u8],
    ) -> (bool, Vec<u8>) {
        let repo = dir.join("repo");
        let f = repo.join("f");
        let ok = |args: &[&str]| {
            let out = git(&repo, args, &[]);
            assert!(
                out.status.success(),
                "git {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        std::fs::create_dir(&repo).unwrap();
        ok(&["init", "-q"]);
        std::fs::write(&f, base).unwrap();
        ok(&["add", "f"]);
        ok(&["commit", "-q", "-m", "base"]);
        ok(&["branch", "theirs"]);
        std::fs::write(&f, ours).unwrap();
        ok(&["commit", "-q", "--allow-empty", "-am", "ours"]);
        ok(&["checkout", "-q", "theirs"]);
        std::fs::write(&f, theirs).unwrap();
        ok(&["commit", "-q", "--allow-empty", "-am", "theirs"]);
        ok(&["checkout", "-q", "ours"]);
        let out = git(&repo, &["merge", "-q", "--no-edit", "theirs"], &[]);
        match out.status.code() {
            Some(0) => (true, std::fs::read(&f).unwrap()),
            Some(1) => (false, Vec::new()),
            _ => panic!("git merge failed: {}", String::from_utf8_lossy(&out.stderr)),
        }
    }

    /// [`git_merge_with`] with the default algorithm.
    fn git_merge(base: &[u8], ours: &[u8], theirs: &[u8]) -> (bool, Vec<u8>) {
        git_merge_with(base, ours, theirs, DiffAlgorithm::default())
    }

    /// Applies `(index, op, new line)` edits to `base`, one per index, from the
    /// end so indices stay valid: 0 replaces the line, 1 deletes it, 2 inserts the
    /// new line after it.
    fn apply_edits(base: &[String], mut edits: Vec<(usize, u8, String)>) -> Vec<u8> {
        let mut lines: Vec<String> = base.to_vec();
        edits.sort();
        edits.dedup_by_key(|e| e.0);
        for (i, op, new) in edits.into_iter().rev() {
            if i >= lines.len() {
                continue;
            }
            match op {
                0 => lines[i] = new,
                1 => {
                    lines.remove(i);
                }
                _ => lines.insert(i + 1, new),
            }
        }
        lines.concat().into_bytes()
    }

    /// A side built from `base` by `edits` `(index, op, shared)`: a new line is
    /// tagged with the side, or `s` when `shared` (so both sides can make the
    /// same change).
    fn side(base: &[String], edits: &[(usize, u8, bool)], tag: &str) -> Vec<u8> {
        let edits = edits
            .iter()
            .map(|&(i, op, shared)| {
                let tag = if shared { "s" } else { tag };
                let new = if op == 0 {
                    format!("{tag}{i}")
                } else {
                    format!("{tag}+{i}")
                };
                (i, op, new)
            })
            .collect();
        apply_edits(base, edits)
    }

    /// Lines repeated on purpose, as in real files: blank lines and braces.
    const REPEATED: [&str; 4] = ["\n", "}\n", "{\n", "a\n"];

    /// A side built from `base` by `edits` `(index, op, pick)`; the new line is a
    /// repeated one (`pick` < 4) or a line unique to the side.
    fn side_repeated(base: &[String], edits: &[(usize, u8, usize)], tag: &str) -> Vec<u8> {
        let edits = edits
            .iter()
            .map(|&(i, op, pick)| {
                let new = REPEATED
                    .get(pick)
                    .map_or_else(|| format!("{tag}{i}\n"), |l| (*l).to_string());
                (i, op, new)
            })
            .collect();
        apply_edits(base, edits)
    }

    /// The property every git comparison asserts: `merge_text` with `algorithm`
    /// has git's verdict and, when clean, git's bytes.
    fn same_as_git(
        base: &[u8],
        ours: &[u8],
        theirs: &[u8],
        algorithm: DiffAlgorithm,
    ) -> Result<(), proptest::test_runner::TestCaseError> {
        let (git_clean, git_out) = git_merge_with(base, ours, theirs, algorithm);
        let options = MergeOptions {
            diff_algorithm: algorithm,
            ..MergeOptions::default()
        };
        let why = || {
            format!(
                "{algorithm:?}: base {:?} ours {:?} theirs {:?}",
                String::from_utf8_lossy(base),
                String::from_utf8_lossy(ours),
                String::from_utf8_lossy(theirs)
            )
        };
        match merge_text(base, ours, theirs, &options) {
            TextMerge::Clean(out) => {
                proptest::prop_assert!(git_clean, "we merged, git conflicted: {}", why());
                proptest::prop_assert_eq!(
                    String::from_utf8_lossy(&out),
                    String::from_utf8_lossy(&git_out),
                    "{}",
                    why()
                );
            }
            TextMerge::Conflict(r) => {
                proptest::prop_assert!(!git_clean, "git merged, we: {}: {}", r, why());
            }
        }
        Ok(())
    }

    /// Cases per git property test: 300, or `MERGE_GIT_CASES`.
    fn git_cases() -> u32 {
        std::env::var("MERGE_GIT_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(300)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: git_cases(), ..Default::default() })]

        /// Against git itself, on distinct lines (as in most config files): the
        /// same clean/conflict verdict and, when clean, the same bytes. Endings
        /// mix LF, CRLF and a missing final newline.
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
            for algorithm in [DiffAlgorithm::Histogram, DiffAlgorithm::Myers] {
                same_as_git(&base_b, &o, &t, algorithm)?;
            }
        }

        /// Against git on texts made mostly of repeated lines (blank lines, `{`,
        /// `}`, `a`), where line diffs are ambiguous. Myers (the default): the same
        /// verdict and, when clean, the same bytes as git merge-file. Histogram is
        /// only measured (`MERGE_GIT_STATS=1`): imara-diff's histogram anchors some
        /// of these texts differently from git's, see
        /// [`histogram_can_differ_from_git_when_both_merge`].
        #[test]
        fn agrees_with_git_merge_file_on_repeated_lines(
            base_lines in proptest::collection::vec(0usize..8, 3..14),
            ours_edits in proptest::collection::vec((0usize..14, 0u8..3, 0usize..6), 0..4),
            theirs_edits in proptest::collection::vec((0usize..14, 0u8..3, 0usize..6), 0..4),
        ) {
            // Indices below 4 are repeated lines, the others distinct ones.
            let base: Vec<String> = base_lines
                .iter()
                .enumerate()
                .map(|(i, &k)| REPEATED.get(k).map_or_else(|| format!("line {i}\n"), |l| (*l).to_string()))
                .collect();
            let base_b = base.concat().into_bytes();
            let o = side_repeated(&base, &ours_edits, "o");
            let t = side_repeated(&base, &theirs_edits, "t");
            if std::env::var_os("MERGE_GIT_STATS").is_some() {
                for algorithm in [DiffAlgorithm::Myers, DiffAlgorithm::Histogram] {
                    let (git_clean, git_out) = git_merge_with(&base_b, &o, &t, algorithm);
                    let options = MergeOptions { diff_algorithm: algorithm, ..MergeOptions::default() };
                    let ours = merge_text(&base_b, &o, &t, &options);
                    let we_clean = matches!(ours, TextMerge::Clean(_));
                    let same = matches!(&ours, TextMerge::Clean(b) if git_clean && *b == git_out);
                    eprintln!("GITREP {} git_clean={git_clean} we_clean={we_clean} same_bytes={same}", algorithm.as_str());
                }
                return Ok(());
            }
            same_as_git(&base_b, &o, &t, DiffAlgorithm::Myers)?;
        }
    }

    /// Blocks of indented code for [`agrees_with_git_merge_file_on_indented_blocks`].
    const BLOCKS: [&[&str]; 5] = [
        &["fn f() {\n", "    let a = 1;\n", "}\n", "\n"],
        &["    if x {\n", "        y();\n", "    }\n"],
        &["\n", "    return;\n"],
        &["}\n", "\n"],
        &["    // note\n"],
    ];

    /// A side built from `base` by block edits `(op, at, n, pick)`: 0 duplicates
    /// `n` lines at `at` right after them (copy-paste), 1 deletes `n` lines, 2
    /// rewrites a line keeping its indentation, 3 inserts block `pick`.
    fn side_blocks(base: &[String], edits: &[(u8, usize, usize, usize)], tag: &str) -> Vec<u8> {
        let mut l: Vec<String> = base.to_vec();
        for &(op, at, n, pick) in edits {
            if l.is_empty() {
                break;
            }
            let i = at % l.len();
            match op {
                0 => {
                    let j = (i + n).min(l.len());
                    let copy: Vec<String> = l[i..j].to_vec();
                    for (k, x) in copy.into_iter().enumerate() {
                        l.insert(j + k, x);
                    }
                }
                1 => {
                    for _ in 0..n {
                        if i < l.len() {
                            l.remove(i);
                        }
                    }
                }
                2 => {
                    let indent: String = l[i].chars().take_while(|c| *c == ' ').collect();
                    l[i] = format!("{indent}{tag}_{i}();\n");
                }
                _ => {
                    for (k, x) in BLOCKS[pick % BLOCKS.len()].iter().enumerate() {
                        l.insert(i + k, (*x).to_string());
                    }
                }
            }
        }
        l.concat().into_bytes()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: git_cases(), ..Default::default() })]

        /// Against git on indented code with block edits (copy-paste of a few
        /// lines, deleting a few, rewriting a line, inserting a block) — where a
        /// diff's ambiguous hunks are many and an indent heuristic would slide
        /// them (gix-merge's does; git's merges do not): with Myers, the same
        /// verdict and, when clean, the same bytes as git merge-file.
        #[test]
        fn agrees_with_git_merge_file_on_indented_blocks(
            blocks in proptest::collection::vec(0usize..5, 2..8),
            ours_edits in proptest::collection::vec((0u8..4, 0usize..64, 1usize..6, 0usize..5), 0..3),
            theirs_edits in proptest::collection::vec((0u8..4, 0usize..64, 1usize..6, 0usize..5), 0..3),
        ) {
            let base: Vec<String> = blocks.iter().flat_map(|&k| BLOCKS[k].iter().map(|l| (*l).to_string())).collect();
            let base_b = base.concat().into_bytes();
            let o = side_blocks(&base, &ours_edits, "o");
            let t = side_blocks(&base, &theirs_edits, "t");
            same_as_git(&base_b, &o, &t, DiffAlgorithm::Myers)?;
        }
    }

    /// The reviewer's case (issue 4 review): the head pasted a copy of a block,
    /// the session changed the original's `}`. With an indent heuristic the
    /// session's edit landed in the pasted copy; git and we change the original.
    #[test]
    fn an_edit_next_to_a_pasted_copy_lands_where_git_puts_it() {
        // The default is the algorithm whose clean merges are git's bytes.
        assert_eq!(MergeOptions::default().diff_algorithm, DiffAlgorithm::Myers);
        let base = b"{\n    a;\n}\n\n\n    x\n";
        let ours = b"{\n    a;\nX\n\n\n    x\n";
        let theirs = b"{\n    a;\n}\n\n{\n    a;\n}\n\n\n    x\n";
        let want = b"{\n    a;\nX\n\n{\n    a;\n}\n\n\n    x\n".to_vec();
        assert_eq!(
            git_merge(base, ours, theirs),
            (true, want.clone()),
            "git changed"
        );
        assert_eq!(
            merge_text(base, ours, theirs, &MergeOptions::default()),
            TextMerge::Clean(want)
        );
    }

    /// Texts where the line diff is ambiguous (runs of repeated lines), on which the
    /// previous merge (diffy 0.4's own Myers diff) disagreed with git: now the same
    /// verdict and bytes as git, with both algorithms.
    #[test]
    fn matches_git_where_repeated_lines_make_the_diff_ambiguous() {
        // (base, session, head, git's result: None for a conflict)
        type Case<'a> = (&'a [u8], &'a [u8], &'a [u8], Option<&'a [u8]>);
        let cases: [Case; 2] = [
            // The head's change aligns away from the session's: clean.
            (
                b"a\na\n\na\n",
                b"a\na\na\na\n",
                b"b\na\n\na\n",
                Some(b"b\na\na\na\n"),
            ),
            // The head's deletion of a `}` touches the session's edit: conflict.
            (
                b"}\n}\nx\ny\ny\nz\n",
                b"}\n}\nx\nY\ny\nz\n",
                b"}\nx\ny\nz\n",
                None,
            ),
        ];
        for (base, ours, theirs, want) in cases {
            let got = merge_text(base, ours, theirs, &MergeOptions::default());
            match want {
                Some(w) => assert_eq!(
                    got,
                    TextMerge::Clean(w.to_vec()),
                    "{:?}",
                    String::from_utf8_lossy(base)
                ),
                None => assert!(matches!(got, TextMerge::Conflict(_)), "{got:?}"),
            }
            let (clean, out) = git_merge(base, ours, theirs);
            assert_eq!(clean, want.is_some(), "git changed: update this test");
            if let Some(w) = want {
                assert_eq!(out, w, "git changed: update this test");
            }
        }
    }

    /// Where gix-merge (which always slides hunks with imara-diff's indent
    /// heuristic) conflicted although git merges: an ambiguous hunk — the
    /// session's `}` among blank lines — slid next to the head's insertion. Our
    /// merge slides hunks as xdiff does for a merge (no indent heuristic), so it
    /// merges as git does.
    #[test]
    fn matches_git_where_an_indent_heuristic_would_slide_a_hunk() {
        // (base, session, head, git's clean result)
        type Case<'a> = (&'a [u8], &'a [u8], &'a [u8], &'a [u8]);
        let cases: [Case; 2] = [
            (
                b"\n\n\n\n\n}\n",
                b"\n\n\n\n}\n}\n",
                b"\n\n\n\n\n}\n}\n",
                b"\n\n\n\n}\n}\n}\n",
            ),
            // The session turned the blank line into `}`, the head added a `}`.
            (
                b"x\n}\n\n}\ny\n",
                b"x\n}\n}\n}\ny\n",
                b"x\n}\n\n}\n}\ny\n",
                b"x\n}\n}\n}\n}\ny\n",
            ),
        ];
        for (base, ours, theirs, git_result) in cases {
            for algorithm in [DiffAlgorithm::Histogram, DiffAlgorithm::Myers] {
                let options = MergeOptions {
                    diff_algorithm: algorithm,
                    ..MergeOptions::default()
                };
                assert_eq!(
                    merge_text(base, ours, theirs, &options),
                    TextMerge::Clean(git_result.to_vec()),
                    "{algorithm:?}"
                );
                let (clean, out) = git_merge_with(base, ours, theirs, algorithm);
                assert!(clean, "git conflicts now: update this test");
                assert_eq!(out, git_result);
            }
        }
    }

    /// Histogram's known byte difference: imara-diff trims the common start and
    /// end before its histogram diff, git's histogram does not, so on this text the
    /// two anchor on different braces. The session moved `line 0` below a `}`, the
    /// head deleted a `}`. The text is ambiguous: git's Myers merge keeps two
    /// braces, git's histogram merge three. Ours with Myers (the default) gives
    /// git merge-file's bytes; ours with histogram gives Myers' two braces, not
    /// `git merge`'s three.
    #[test]
    fn histogram_can_differ_from_git_when_both_merge() {
        let (base, ours, theirs) = (
            &b"line 0\n}\n}\n}\nline 4\n"[..],
            &b"}\nline 0\n}\n}\nline 4\n"[..],
            &b"line 0\n}\n}\nline 4\n"[..],
        );
        let two = b"}\nline 0\n}\nline 4\n".to_vec();
        let three = b"}\nline 0\n}\n}\nline 4\n".to_vec();
        assert_eq!(
            git_merge_with(base, ours, theirs, DiffAlgorithm::Myers),
            (true, two.clone()),
            "git changed: update docs/merge-rules.md"
        );
        assert_eq!(
            git_merge_with(base, ours, theirs, DiffAlgorithm::Histogram),
            (true, three),
            "git changed: update docs/merge-rules.md"
        );
        assert_eq!(
            merge_text(base, ours, theirs, &MergeOptions::default()),
            TextMerge::Clean(two.clone())
        );
        let histogram = MergeOptions {
            diff_algorithm: DiffAlgorithm::Histogram,
            ..MergeOptions::default()
        };
        assert_eq!(
            merge_text(base, ours, theirs, &histogram),
            TextMerge::Clean(two),
            "histogram agrees with git now: update docs/merge-rules.md"
        );
    }

    /// Three versions whose merge takes about 0.5 s in a debug build.
    fn slow_merge() -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        use crate::testutil::scrambled;
        (
            scrambled(1, 4_000, 8),
            scrambled(2, 4_000, 8),
            scrambled(3, 4_000, 8),
        )
    }

    /// A merge that does not answer within the budget conflicts at once (a budget
    /// of 1 ns for a merge of scrambled texts).
    #[test]
    fn time_cap_returns_instead_of_hanging() {
        let (base, ours, theirs) = slow_merge();
        let limits = MergeOptions {
            timeout: Duration::from_nanos(1),
            ..MergeOptions::default()
        };
        let r = merge_text(&base, &ours, &theirs, &limits);
        let TextMerge::Conflict(reason) = r else {
            panic!("merged")
        };
        assert!(
            reason.starts_with("not merged: merging took longer than the limit of"),
            "{reason}"
        );
    }

    /// The timeout is one budget for all merges of a publish: once a merge used
    /// it up, the next one is not even started.
    #[test]
    fn budget_is_shared_and_a_used_up_budget_starts_nothing() {
        let (base, ours, theirs) = slow_merge();
        let limits = MergeOptions {
            timeout: Duration::from_nanos(1),
            ..MergeOptions::default()
        };
        let mut budget = MergeBudget::new(limits.timeout);
        let first = merge_text_within(&base, &ours, &theirs, &limits, &mut budget);
        assert!(matches!(first, TextMerge::Conflict(_)));
        assert!(budget.is_used_up());
        let second = merge_text_within(
            BASE.as_bytes(),
            b"1\nTWO\n3\n4\n5\n6\n7\n",
            b"1\n2\n3\nFOUR\n5\n6\n7\n",
            &limits,
            &mut budget,
        );
        assert_eq!(
            second,
            TextMerge::Conflict(
                "not merged: the merge time budget of 0 ms for this publish is used up".into()
            )
        );
        // A budget is spent by every merge: two merges of 2 s each do not fit
        // in one of 3 s, whatever each one took.
        let mut budget = MergeBudget::new(Duration::from_secs(3));
        let ok = merge_text_within(
            BASE.as_bytes(),
            b"1\nTWO\n3\n4\n5\n6\n7\n",
            b"1\n2\n3\nFOUR\n5\n6\n7\n",
            &MergeOptions::default(),
            &mut budget,
        );
        assert!(matches!(ok, TextMerge::Clean(_)));
        assert!(budget.spent() > Duration::ZERO && budget.remaining() < Duration::from_secs(3));
        // Trivial merges cost nothing and never fail on the budget.
        assert_eq!(
            merge_text_within(
                b"x\n",
                b"y\n",
                b"x\n",
                &limits,
                &mut MergeBudget::new(Duration::ZERO)
            ),
            TextMerge::Clean(b"y\n".to_vec())
        );
    }

    /// The defaults bound the worst case (three unrelated inputs at the line cap).
    /// Run with `cargo test -p layerstack-publisher -- --ignored --nocapture
    /// worst_case` (and `--release`) to measure; docs/merge-rules.md has the numbers.
    #[test]
    #[ignore = "measurement, several seconds"]
    fn worst_case_at_the_default_caps() {
        let limits = MergeOptions::default();
        for width in [8usize, 20, 256] {
            let n = limits
                .max_lines
                .min(usize::try_from(limits.max_bytes).unwrap_or(usize::MAX) / width);
            let mk = |p: &str| -> Vec<u8> {
                (0..n)
                    .map(|i| {
                        let mut l = format!("{p}{i} ");
                        while l.len() + 1 < width {
                            l.push('x');
                        }
                        l.push('\n');
                        l
                    })
                    .collect::<String>()
                    .into_bytes()
            };
            let (b, o, t) = (mk("b"), mk("o"), mk("t"));
            assert!(b.len() as u64 <= limits.max_bytes);
            // Also: random lines over a small alphabet (many matches, no structure).
            let (rb, ro, rt) = (
                crate::testutil::scrambled(1, n, width),
                crate::testutil::scrambled(2, n, width),
                crate::testutil::scrambled(3, n, width),
            );
            for algorithm in [DiffAlgorithm::Histogram, DiffAlgorithm::Myers] {
                let start = std::time::Instant::now();
                let _ = merge3(&rb, &ro, &rt, algorithm);
                eprintln!(
                    "worst case, {}, random lines of 16 kinds: {n} lines of {width} bytes: {:?}",
                    algorithm.as_str(),
                    start.elapsed()
                );
            }
            for algorithm in [DiffAlgorithm::Histogram, DiffAlgorithm::Myers] {
                let start = std::time::Instant::now();
                let _ = merge3(&b, &o, &t, algorithm);
                eprintln!(
                    "worst case, {}: {n} lines of {width} bytes ({} bytes each): {:?}",
                    algorithm.as_str(),
                    b.len(),
                    start.elapsed()
                );
            }
        }
    }

    // ---- Line origins (blame) and conflict markers ------------------------

    fn traced(base: &str, ours: &str, theirs: &str) -> (String, Vec<LineOrigin>) {
        match merge_text_traced_within(
            base.as_bytes(),
            ours.as_bytes(),
            theirs.as_bytes(),
            &MergeOptions::default(),
            &mut MergeBudget::new(DEFAULT_TIMEOUT),
        ) {
            TracedMerge::Clean { content, origins } => {
                (String::from_utf8(content).unwrap(), origins.unwrap())
            }
            other => panic!("{other:?}"),
        }
    }

    fn lines_of(b: &[u8]) -> Vec<&[u8]> {
        b.split_inclusive(|&c| c == b'\n').collect()
    }

    /// Every origin names a line with exactly the output line's bytes, and the
    /// traced merge has `merge_text`'s verdict and bytes.
    fn origins_are_consistent(
        base: &[u8],
        ours: &[u8],
        theirs: &[u8],
        algorithm: DiffAlgorithm,
    ) -> Result<(), proptest::test_runner::TestCaseError> {
        let options = MergeOptions {
            diff_algorithm: algorithm,
            ..MergeOptions::default()
        };
        let plain = merge_text(base, ours, theirs, &options);
        let t = merge_text_traced_within(
            base,
            ours,
            theirs,
            &options,
            &mut MergeBudget::new(DEFAULT_TIMEOUT),
        );
        match (plain, t) {
            (TextMerge::Clean(a), TracedMerge::Clean { content, origins }) => {
                proptest::prop_assert_eq!(&a, &content);
                let origins = origins.unwrap();
                let out = lines_of(&content);
                proptest::prop_assert_eq!(out.len(), origins.len());
                let (b, o, th) = (lines_of(base), lines_of(ours), lines_of(theirs));
                for (line, origin) in out.iter().zip(&origins) {
                    let src = match *origin {
                        LineOrigin::Base(i) => b[i],
                        LineOrigin::Ours(i) => o[i],
                        LineOrigin::Theirs(i) => th[i],
                    };
                    proptest::prop_assert_eq!(line, &src, "{:?}", origin);
                }
            }
            (TextMerge::Conflict(r), TracedMerge::Overlap(q) | TracedMerge::Conflict(q)) => {
                proptest::prop_assert_eq!(r, q);
            }
            (a, b) => proptest::prop_assert!(false, "{:?} vs {:?}", a, b),
        }
        Ok(())
    }

    #[test]
    fn origins_name_the_side_that_wrote_each_line() {
        use LineOrigin::{Base, Ours, Theirs};
        let (out, o) = traced(
            BASE,
            "1\nTWO\n3\n4\n5\n6\n7\n",
            "1\n2\n3\nFOUR\n5\n6\n7\nEIGHT\n",
        );
        assert_eq!(out, "1\nTWO\n3\nFOUR\n5\n6\n7\nEIGHT\n");
        assert_eq!(
            o,
            [
                Base(0),
                Ours(1),
                Base(2),
                Theirs(3),
                Base(4),
                Base(5),
                Base(6),
                Theirs(7)
            ]
        );
        // An insertion by ours shifts ours' indices, not the base's.
        let (out, o) = traced(BASE, "0\n1\n2\n3\n4\n5\n6\n7\n", "1\n2\n3\n4\n5\nSIX\n7\n");
        assert_eq!(out, "0\n1\n2\n3\n4\n5\nSIX\n7\n");
        assert_eq!(
            o,
            [
                Ours(0),
                Base(0),
                Base(1),
                Base(2),
                Base(3),
                Base(4),
                Theirs(5),
                Base(6)
            ]
        );
        // The same change on both sides: the head had it first.
        let both = "1\n2\nX\n4\n5\n6\n7\n";
        let (_, o) = traced(BASE, "1\n2\nX\n4\n5\n6\nS\n", both);
        assert_eq!(o[2], Theirs(2));
        assert_eq!(o[6], Ours(6));
        // Trivial merges are traced too.
        let (_, o) = traced(BASE, "1\n2\n3\nX\n5\n6\n7\n", BASE);
        assert_eq!(o[3], Ours(3));
        assert_eq!(o[0], Base(0));
        let (_, o) = traced(BASE, BASE, "1\n2\n3\nX\n5\n6\n7\n");
        assert_eq!(o[3], Theirs(3));
        let (_, o) = traced(BASE, both, both);
        assert_eq!(o[2], Theirs(2));
        assert_eq!(o[3], Base(3));
    }

    #[test]
    fn origins_keep_crlf_and_a_missing_final_newline_apart() {
        use LineOrigin::{Base, Ours, Theirs};
        // CRLF: converting a line's ending is the side's change of that line.
        let base = "a\r\nb\r\nc\r\nd\r\ne\r\n";
        let (out, o) = traced(base, "a\nb\r\nc\r\nd\r\ne\r\n", "a\r\nb\r\nc\r\nd\r\nE\r\n");
        assert_eq!(out, "a\nb\r\nc\r\nd\r\nE\r\n");
        assert_eq!(o, [Ours(0), Base(1), Base(2), Base(3), Theirs(4)]);
        // A last line without "\n": adding the newline is the head's change of it.
        let base = "a\nb\nc\nd\ne";
        let (out, o) = traced(base, "A\nb\nc\nd\ne", "a\nb\nc\nd\ne\n");
        assert_eq!(out, "A\nb\nc\nd\ne\n");
        assert_eq!(o, [Ours(0), Base(1), Base(2), Base(3), Theirs(4)]);
        // Still without a final newline when nobody touched the last line.
        let (out, o) = traced(base, "A\nb\nc\nd\ne", base);
        assert_eq!(out, "A\nb\nc\nd\ne");
        assert_eq!(o[4], Base(4));
    }

    #[test]
    fn unchanged_lines_map_new_lines_to_old_ones() {
        let m = unchanged_lines(b"a\nb\nc\n", b"a\nX\nb\nc", DiffAlgorithm::Myers);
        assert_eq!(m, [Some(0), None, Some(1), None]);
        assert_eq!(unchanged_lines(b"", b"x\n", DiffAlgorithm::Myers), [None]);
        assert!(unchanged_lines(b"x\n", b"", DiffAlgorithm::Myers).is_empty());
    }

    #[test]
    fn conflicts_render_with_diff3_markers_and_are_found_again() {
        let (out, n) = render_conflict(
            b"1\n2\n3\n4\n5\n6\n7\n",
            b"1\nTWO\n3\n4\n5\n6\nseven",
            b"1\nzwei\n3\n4\n5\n6\n7\n",
            &MergeOptions::default(),
        )
        .unwrap();
        assert_eq!(n, 1);
        let text = String::from_utf8(out.clone()).unwrap();
        assert_eq!(
            text,
            "1\n<<<<<<< session\nTWO\n||||||| lease\n2\n=======\nzwei\n>>>>>>> head\n3\n4\n5\n6\nseven"
        );
        let blocks = conflict_blocks(&out);
        assert_eq!(blocks.len(), 1);
        assert_eq!(
            &text[blocks[0].clone()],
            "<<<<<<< session\nTWO\n||||||| lease\n2\n=======\nzwei\n>>>>>>> head\n"
        );
        // A side's last line without a newline gets one before the next marker.
        let (out, n) =
            render_conflict(b"a\nb", b"a\nB", b"a\nbee", &MergeOptions::default()).unwrap();
        assert_eq!(n, 1);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "a\n<<<<<<< session\nB\n||||||| lease\nb\n=======\nbee\n>>>>>>> head\n"
        );
        // Clean merges render as merge_text merges them.
        let (out, n) = render_conflict(
            BASE.as_bytes(),
            b"1\nTWO\n3\n4\n5\n6\n7\n",
            b"1\n2\n3\nFOUR\n5\n6\n7\n",
            &MergeOptions::default(),
        )
        .unwrap();
        assert_eq!((out.as_slice(), n), (&b"1\nTWO\n3\nFOUR\n5\n6\n7\n"[..], 0));
        // Binary and oversized inputs are not rendered.
        assert!(render_conflict(b"a\0", b"b", b"c", &MergeOptions::default()).is_err());
        // A block is `<<<<<<< session` up to the next `>>>>>>> head`, whatever
        // is between (edited sides, a removed base or separator line); marker
        // lines must be exact; CRLF marker lines count.
        assert_eq!(
            conflict_blocks(b"<<<<<<< session\nx\n=======\ny\n>>>>>>> head\n"),
            vec![0..41]
        );
        assert_eq!(
            conflict_blocks(b"a\n<<<<<<< session\nedited\n>>>>>>> head"),
            vec![2..37]
        );
        assert!(
            conflict_blocks(b"<<<<<<< session x\n||||||| lease\n=======\n>>>>>>> head\n")
                .is_empty()
        );
        assert!(
            conflict_blocks(b"<<<<<<< session\n||||||| lease\n=======\n>>>>>>> head!\n").is_empty()
        );
        assert!(conflict_blocks(b">>>>>>> head\n<<<<<<< session\nx\n").is_empty());
        // A second opening line inside a block belongs to it; two blocks count twice.
        let two =
            b"<<<<<<< session\n<<<<<<< session\n>>>>>>> head\nk\n<<<<<<< session\n>>>>>>> head\n";
        assert_eq!(conflict_blocks(two), [0..45, 47..76]);
        let blocks = conflict_blocks(
            b"k\r\n<<<<<<< session\r\n||||||| lease\r\n=======\r\n>>>>>>> head\r\nz",
        );
        assert_eq!((blocks.len(), blocks[0].start, blocks[0].end), (1, 3, 58));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 400, ..Default::default() })]

        /// The traced merge never changes the merge: the same verdict and bytes as
        /// `merge_text`, and every line's origin holds exactly that line; with
        /// mixed endings and a missing final newline, on distinct and on repeated
        /// lines.
        #[test]
        fn traced_merge_is_the_merge_with_true_origins(
            n in 3usize..12,
            crlf in proptest::collection::vec(proptest::bool::ANY, 12),
            no_final_newline in proptest::bool::ANY,
            ours_edits in proptest::collection::vec((0usize..12, 0u8..3, proptest::bool::ANY), 0..4),
            theirs_edits in proptest::collection::vec((0usize..12, 0u8..3, proptest::bool::ANY), 0..4),
            rep_base in proptest::collection::vec(0usize..8, 3..14),
            rep_ours in proptest::collection::vec((0usize..14, 0u8..3, 0usize..6), 0..4),
            rep_theirs in proptest::collection::vec((0usize..14, 0u8..3, 0usize..6), 0..4),
        ) {
            let base: Vec<String> = (0..n)
                .map(|i| {
                    let end = if i + 1 == n && no_final_newline { "" } else if crlf[i] { "\r\n" } else { "\n" };
                    format!("line {i}{end}")
                })
                .collect();
            let base_b = base.concat().into_bytes();
            let o = side(&base, &ours_edits, "o");
            let t = side(&base, &theirs_edits, "t");
            let rb: Vec<String> = rep_base
                .iter()
                .map(|&k| REPEATED.get(k).map_or_else(|| format!("x{k}\n"), |s| s.to_string()))
                .collect();
            let (ro, rt) = (side_repeated(&rb, &rep_ours, "o"), side_repeated(&rb, &rep_theirs, "t"));
            for algorithm in [DiffAlgorithm::Histogram, DiffAlgorithm::Myers] {
                origins_are_consistent(&base_b, &o, &t, algorithm)?;
                origins_are_consistent(&rb.concat().into_bytes(), &ro, &rt, algorithm)?;
                // Markers: a clean merge renders as itself; a conflict has blocks
                // that conflict_blocks finds again.
                let (rendered, blocks) = render_conflict(&base_b, &o, &t, &MergeOptions { diff_algorithm: algorithm, ..MergeOptions::default() }).unwrap();
                match merge3(&base_b, &o, &t, algorithm) {
                    Ok(m) => proptest::prop_assert_eq!((m, 0), (rendered, blocks)),
                    Err(()) => {
                        proptest::prop_assert!(blocks > 0);
                        proptest::prop_assert_eq!(conflict_blocks(&rendered).len(), blocks);
                    }
                }
            }
        }
    }
}
