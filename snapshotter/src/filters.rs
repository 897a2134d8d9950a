//! containerd's filter grammar for `Walk`/`List` (containerd `filters/filter.go`,
//! `parser.go`, `scanner.go`; snapshot fields from `metadata/adaptors.go`):
//!
//! ```text
//! filters   := filter*                       several filters are OR-ed
//! filter    := selector ("," selector)*      selectors are AND-ed
//! selector  := fieldpath [operator value]    no operator: the field is present
//! fieldpath := field ("." field)*
//! field     := [A-Za-z0-9_]+ | quoted
//! operator  := "==" | "!=" | "~="            ~= : the value is a regular expression
//! value     := quoted | run of graphic characters other than "," and space
//! quoted    := "…" (escapes \a \b \f \n \r \t \v \\ \" \ooo \xhh \uhhhh \Uhhhhhhhh)
//!            | /…/ | |…|                     (only the closing quote is escaped)
//! ```
//!
//! Snapshot fields: `kind` (`active`, `view`, `committed`), `name`, `parent`,
//! `labels.<key>`. `!=` also matches an absent field (its value is ""), as in
//! containerd. A filter that does not parse is refused with `InvalidArgument`,
//! as containerd's own `filters.ParseAll` does.

use layerstack_engine::store::{SnapshotInfo, SnapshotKind};
use regex::Regex;

#[derive(Debug)]
enum Op {
    Present,
    Equal(String),
    NotEqual(String),
    Matches(Regex),
}

#[derive(Debug)]
struct Selector {
    path: Vec<String>,
    op: Op,
}

/// A parsed set of filters (OR of ANDs).
#[derive(Debug, Default)]
pub struct Filters(Vec<Vec<Selector>>);

/// Why a filter string does not parse: the filter, the byte offset, what was wrong.
#[derive(Debug, thiserror::Error)]
#[error("invalid filter {filter:?} at byte {at}: {what}")]
pub struct FilterError {
    filter: String,
    at: usize,
    what: String,
}

struct Parser<'a> {
    s: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn err(&self, what: impl Into<String>) -> FilterError {
        FilterError {
            filter: self.s.to_string(),
            at: self.pos,
            what: what.into(),
        }
    }

    fn peek(&self) -> Option<char> {
        self.s[self.pos..].chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    fn skip_space(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.bump();
        }
    }

    fn quoted(&mut self, quote: char) -> Result<String, FilterError> {
        let mut out = String::new();
        loop {
            match self.bump() {
                None | Some('\n') => return Err(self.err("quoted string not terminated")),
                Some(c) if c == quote => return Ok(out),
                Some('\\') if quote != '"' => match self.bump() {
                    Some(c) if c == quote => out.push(c),
                    Some(c) => {
                        out.push('\\');
                        out.push(c);
                    }
                    None => return Err(self.err("quoted string not terminated")),
                },
                Some('\\') => out.push(self.escape()?),
                Some(c) => out.push(c),
            }
        }
    }

    fn escape(&mut self) -> Result<char, FilterError> {
        let c = self.bump().ok_or_else(|| self.err("escape at end"))?;
        let digits = |p: &mut Parser<'_>, first: Option<char>, base: u32, n: usize| {
            let mut v: u32 = 0;
            let mut first = first;
            for _ in 0..n {
                let d = first
                    .take()
                    .or_else(|| p.bump())
                    .and_then(|c| c.to_digit(base))
                    .ok_or_else(|| p.err("illegal character escape"))?;
                v = v * base + d;
            }
            char::from_u32(v).ok_or_else(|| p.err("escape is not a character"))
        };
        Ok(match c {
            'a' => '\x07',
            'b' => '\x08',
            'f' => '\x0c',
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            'v' => '\x0b',
            '\\' => '\\',
            '"' => '"',
            '0'..='7' => digits(self, Some(c), 8, 3)?,
            'x' => digits(self, None, 16, 2)?,
            'u' => digits(self, None, 16, 4)?,
            'U' => digits(self, None, 16, 8)?,
            _ => return Err(self.err(format!("illegal character escape \\{c}"))),
        })
    }

    fn field(&mut self) -> Result<String, FilterError> {
        match self.peek() {
            Some(q @ ('"' | '/' | '|')) => {
                self.bump();
                self.quoted(q)
            }
            Some(c) if c == '_' || c.is_ascii_alphanumeric() => {
                let start = self.pos;
                while self
                    .peek()
                    .is_some_and(|c| c == '_' || c.is_ascii_alphanumeric())
                {
                    self.bump();
                }
                Ok(self.s[start..self.pos].to_string())
            }
            Some(c) => Err(self.err(format!("expected a field name, found {c:?}"))),
            None => Err(self.err("expected a field name, found the end")),
        }
    }

    fn value(&mut self) -> Result<String, FilterError> {
        self.skip_space();
        match self.peek() {
            Some(q @ ('"' | '/' | '|')) => {
                self.bump();
                self.quoted(q)
            }
            Some(_) => {
                let start = self.pos;
                while self
                    .peek()
                    .is_some_and(|c| c != ',' && !c.is_whitespace() && !c.is_control())
                {
                    self.bump();
                }
                if start == self.pos {
                    return Err(self.err("expected a value"));
                }
                Ok(self.s[start..self.pos].to_string())
            }
            None => Err(self.err("expected a value, found the end")),
        }
    }

    fn selector(&mut self) -> Result<Selector, FilterError> {
        self.skip_space();
        let mut path = vec![self.field()?];
        while self.peek() == Some('.') {
            self.bump();
            path.push(self.field()?);
        }
        self.skip_space();
        let op_start = self.pos;
        while self.peek().is_some_and(|c| matches!(c, '=' | '!' | '~')) {
            self.bump();
        }
        let op = match &self.s[op_start..self.pos] {
            "" => Op::Present,
            "==" => Op::Equal(self.value()?),
            "!=" => Op::NotEqual(self.value()?),
            "~=" => {
                let v = self.value()?;
                Op::Matches(
                    Regex::new(&v)
                        .map_err(|e| self.err(format!("bad regular expression {v:?}: {e}")))?,
                )
            }
            other => {
                self.pos = op_start;
                return Err(self.err(format!("unknown operator {other:?}: use ==, != or ~=")));
            }
        };
        Ok(Selector { path, op })
    }

    fn filter(mut self) -> Result<Vec<Selector>, FilterError> {
        let mut out = vec![self.selector()?];
        loop {
            self.skip_space();
            match self.bump() {
                None => return Ok(out),
                Some(',') => out.push(self.selector()?),
                Some(c) => return Err(self.err(format!("expected ',' or the end, found {c:?}"))),
            }
        }
    }
}

impl Filters {
    /// Parses `filters` (each one a filter string; empty strings are ignored, and
    /// no filter at all matches everything).
    pub fn parse(filters: &[String]) -> Result<Filters, FilterError> {
        let mut out = Vec::new();
        for f in filters.iter().filter(|f| !f.trim().is_empty()) {
            out.push(Parser { s: f, pos: 0 }.filter()?);
        }
        Ok(Filters(out))
    }

    /// Whether snapshot `i` matches.
    pub fn matches(&self, i: &SnapshotInfo) -> bool {
        self.0.is_empty()
            || self
                .0
                .iter()
                .any(|all| all.iter().all(|sel| sel.matches(i)))
    }
}

impl Selector {
    fn field<'i>(&self, i: &'i SnapshotInfo) -> Option<&'i str> {
        match self.path.as_slice() {
            [f] if f == "kind" => Some(match i.kind {
                SnapshotKind::Active => "active",
                SnapshotKind::View => "view",
                SnapshotKind::Committed => "committed",
            }),
            [f] if f == "name" => Some(&i.key),
            [f] if f == "parent" => Some(&i.parent),
            [f, k] if f == "labels" => i.labels.get(k).map(String::as_str),
            _ => None,
        }
    }

    fn matches(&self, i: &SnapshotInfo) -> bool {
        let v = self.field(i);
        match &self.op {
            Op::Present => v.is_some(),
            Op::Equal(want) => v == Some(want.as_str()),
            Op::NotEqual(want) => v.unwrap_or("") != want,
            Op::Matches(re) => re.is_match(v.unwrap_or("")),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn info() -> SnapshotInfo {
        SnapshotInfo {
            key: "default/3/sha256:b".into(),
            kind: SnapshotKind::Committed,
            parent: "default/1/sha256:a".into(),
            labels: [
                (
                    "containerd.io/snapshot.ref".to_string(),
                    "sha256:b".to_string(),
                ),
                ("very complex label".to_string(), "x y".to_string()),
            ]
            .into(),
            created_ns: 0,
            updated_ns: 0,
        }
    }

    fn m(filters: &[&str]) -> bool {
        let f: Vec<String> = filters.iter().map(|s| s.to_string()).collect();
        Filters::parse(&f).unwrap().matches(&info())
    }

    #[test]
    fn remote_snapshot_walk_filter_matches_label_and_parent() {
        assert!(m(&[
            r#"labels."containerd.io/snapshot.ref"==sha256:b,parent==default/1/sha256:a"#
        ]));
        assert!(!m(&[
            r#"labels."containerd.io/snapshot.ref"==sha256:c,parent==default/1/sha256:a"#
        ]));
        assert!(!m(&["parent==x"]));
    }

    #[test]
    fn several_filters_are_ored_and_selectors_anded() {
        assert!(m(&["kind==active", "kind==committed"]));
        assert!(!m(&["kind==active", "kind==view"]));
        assert!(!m(&["kind==committed,name==nope"]));
        assert!(m(&[]), "no filter matches everything");
    }

    #[test]
    fn presence_inequality_and_regexp() {
        assert!(m(&[r#"labels."very complex label""#]));
        assert!(!m(&["labels.missing"]));
        assert!(m(&["labels.missing!=x"]), "an absent field is \"\"");
        assert!(!m(&["kind!=committed"]));
        assert!(m(&[r"name~=^default/[0-9]+/sha256:"]));
        assert!(m(&[r"name~=/^default\/3\//"]), "a /-quoted regexp");
        assert!(!m(&["name~=^other"]));
        assert!(m(&[r#"labels."very complex label"=="x y""#]));
        assert!(m(&[" kind == committed , parent~=a$ "]));
    }

    #[test]
    fn bad_filters_are_refused_naming_the_problem() {
        for (f, what) in [
            ("kind=committed", "unknown operator"),
            ("kind==", "expected a value"),
            ("labels.\"open", "not terminated"),
            ("name~=(", "bad regular expression"),
            ("kind==a b", "expected ','"),
        ] {
            let e = Filters::parse(&[f.to_string()]).unwrap_err().to_string();
            assert!(e.contains(what), "{f}: {e}");
        }
    }
}
