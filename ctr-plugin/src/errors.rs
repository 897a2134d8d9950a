//! How the CLI reports the error it ends with: its kind and its message.
//!
//! Every error has one kind, spelled as everywhere else
//! ([`ErrorKind::as_str`], `layerstack_types`): a daemon's answer carries it
//! as its gRPC code (the admin API, [`api::kind_name`]) or by name (the mount
//! socket's `code`); the CLI's own refusals name theirs ([`Failure`]): bad flags
//! are `invalid_argument`, a daemon that cannot be reached `unavailable`, a
//! command run without root `failed_precondition`; anything else is
//! `internal`.
//!
//! `--error-format text` (the default) prints `layerstack: MESSAGE` on stderr;
//! `--error-format json` (or `LAYERSTACK_ERROR_FORMAT=json`) prints one line
//! `{"error":{"kind":"not_found","message":"…"}}` instead, the last line on
//! stderr, for programs (the Python client maps `kind` to its exception
//! classes, as it maps the admin API's codes).

use clap::ValueEnum;
use layerstack_api as api;
use layerstack_api::ErrorKind;
use serde_json::json;

/// `--error-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum ErrorFormat {
    /// `layerstack: MESSAGE`.
    #[default]
    Text,
    /// One JSON object: `{"error":{"kind":KIND,"message":MESSAGE}}`.
    Json,
}

/// A failure the CLI names the kind of: its own refusals, and refusals the
/// daemon sent on the mount socket (`kind` is the reply's `code`: an error
/// kind's name, or a gRPC code's for a status no kind maps to).
#[derive(Debug)]
pub struct Failure {
    pub kind: String,
    pub message: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Failure {}

/// An error of kind `kind` with `message`.
pub fn failure(kind: ErrorKind, message: impl Into<String>) -> anyhow::Error {
    Failure {
        kind: kind.as_str().to_string(),
        message: message.into(),
    }
    .into()
}

/// `e` with kind `kind`, its message `e` with its causes (for errors whose
/// kind only the caller knows: a socket that cannot be reached).
pub fn with_kind(kind: ErrorKind, e: anyhow::Error) -> anyhow::Error {
    failure(kind, api::error_chain(e.as_ref()))
}

/// `e` (its kind and message, [`describe`]) as the error of a call about
/// session `id`: the message names it, and a hint's `--session ID` becomes
/// its id — a harness that lost the daemon mid-run knows what to wait for.
pub fn about_session(e: anyhow::Error, id: i64) -> anyhow::Error {
    let (kind, message) = describe(&e);
    Failure {
        kind,
        message: format!(
            "session {id}: {}",
            message.replace("--session ID", &format!("--session {id}"))
        ),
    }
    .into()
}

/// The kind and message of `e`: the first [`Failure`] or gRPC status in its
/// chain names the kind (`internal` when none does).
pub fn describe(e: &anyhow::Error) -> (String, String) {
    for cause in e.chain() {
        if let Some(f) = cause.downcast_ref::<Failure>() {
            return (f.kind.clone(), f.message.clone());
        }
        if let Some(st) = cause.downcast_ref::<tonic::Status>() {
            if is_broken_call(st) {
                // tonic's word for a connection that broke under the call:
                // say what it means and what to do.
                return (
                    ErrorKind::Unavailable.as_str().to_string(),
                    format!(
                        "the connection to the daemon broke during the call ({}): the daemon stopped or restarted. What the call did before, if anything, is recorded there: once `layerstack status` answers, ask again (a session's outcome: `layerstack wait --session ID`; a create or begin with an idempotency key: the same call again)",
                        st.message()
                    ),
                );
            }
            let message = if st.message().is_empty() {
                format!(
                    "the daemon answered {:?} without a message (is --admin-address the admin socket, not the snapshots socket?)",
                    st.code()
                )
            } else {
                st.message().to_string()
            };
            return (api::status_kind(st).to_string(), message);
        }
    }
    // Not anyhow's `{:#}`: it would repeat a cause that an error of a
    // dependency already prints (hyper's connect errors).
    (
        ErrorKind::Internal.as_str().to_string(),
        api::error_chain(e.as_ref()),
    )
}

/// Whether `st` is the transport's own failure of a call under way (the
/// connection reset or closed), not an answer of the daemon.
fn is_broken_call(st: &tonic::Status) -> bool {
    matches!(st.code(), tonic::Code::Unknown | tonic::Code::Unavailable)
        && (st.message() == "transport error"
            || st.message().starts_with("h2 protocol error")
            || st.message().contains("connection reset")
            || st.message().contains("broken pipe"))
}

/// What the CLI prints on stderr for `e` in `format` (one line, no newline).
pub fn render(format: ErrorFormat, e: &anyhow::Error) -> String {
    let (kind, message) = describe(e);
    match format {
        ErrorFormat::Text => format!("layerstack: {message}"),
        ErrorFormat::Json => json!({"error": {"kind": kind, "message": message}}).to_string(),
    }
}

/// The error format of a parsed command line: `--error-format` (or
/// `LAYERSTACK_ERROR_FORMAT`) when given; otherwise json when the command
/// asked for JSON output (`--json`: a program reading a command's output
/// reads its failure the same way), else text.
pub fn effective_format(matches: &clap::ArgMatches, parsed: ErrorFormat) -> ErrorFormat {
    let given = matches
        .value_source("error_format")
        .is_some_and(|s| s != clap::parser::ValueSource::DefaultValue);
    if given {
        return parsed;
    }
    let mut m = matches;
    loop {
        let json = m
            .try_get_one::<bool>("json")
            .ok()
            .flatten()
            .copied()
            .unwrap_or(false);
        if json {
            return ErrorFormat::Json;
        }
        match m.subcommand() {
            Some((_, sub)) => m = sub,
            None => return parsed,
        }
    }
}

/// Prints `e` on stderr in `format`.
pub fn report(format: ErrorFormat, e: &anyhow::Error) {
    eprintln!("{}", render(format, e));
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use anyhow::Context;

    fn parsed(e: &anyhow::Error) -> serde_json::Value {
        serde_json::from_str(&render(ErrorFormat::Json, e)).unwrap()
    }

    #[test]
    fn a_call_about_a_session_names_it_in_its_hint() {
        let broken =
            anyhow::Error::new(tonic::Status::new(tonic::Code::Unknown, "transport error"));
        let v = parsed(&about_session(broken, 57));
        assert_eq!(v["error"]["kind"], "unavailable");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(
            m.starts_with("session 57: the connection to the daemon broke")
                && m.contains("`layerstack wait --session 57`"),
            "{m}"
        );
        let refused = anyhow::Error::new(api::status(ErrorKind::NotFound, "no module".into()));
        assert_eq!(
            parsed(&about_session(refused, 3))["error"],
            json!({"kind": "not_found", "message": "session 3: no module"})
        );
    }

    #[test]
    fn a_status_keeps_its_kind_through_context() {
        for kind in ErrorKind::ALL {
            let e = Err::<(), _>(api::status(kind, "no node n-1".into()))
                .context("starting")
                .unwrap_err();
            let v = parsed(&e);
            assert_eq!(v["error"]["kind"], kind.as_str());
            // `no_space` (which shares busy's gRPC code) comes with what to do.
            let msg = if kind == ErrorKind::NoSpace {
                format!("no node n-1; {}", api::NO_SPACE_ADVICE)
            } else {
                "no node n-1".to_string()
            };
            assert_eq!(v["error"]["message"], msg.as_str());
            assert_eq!(render(ErrorFormat::Text, &e), format!("layerstack: {msg}"));
        }
        let e = anyhow::Error::new(tonic::Status::new(tonic::Code::DeadlineExceeded, "late"));
        assert_eq!(parsed(&e)["error"]["kind"], "deadline_exceeded");
    }

    #[test]
    fn a_call_the_transport_broke_says_what_happened_and_what_to_do() {
        let e = anyhow::Error::new(tonic::Status::new(tonic::Code::Unknown, "transport error"))
            .context("publishing");
        let v = parsed(&e);
        assert_eq!(v["error"]["kind"], "unavailable");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(
            m.contains("broke during the call") && m.contains("layerstack wait --session"),
            "{m}"
        );
        // The daemon's own answers keep their words.
        let e = anyhow::Error::new(api::status(
            ErrorKind::Unavailable,
            "the spawner is gone".into(),
        ));
        assert_eq!(parsed(&e)["error"]["message"], "the spawner is gone");
    }

    #[test]
    fn own_failures_and_other_errors() {
        let e = failure(ErrorKind::InvalidArgument, "--user \"bob\": give UID");
        assert_eq!(
            parsed(&e),
            json!({"error": {"kind": "invalid_argument", "message": "--user \"bob\": give UID"}})
        );
        let e = with_kind(
            ErrorKind::Unavailable,
            anyhow::Error::new(std::io::Error::from_raw_os_error(2)).context("cannot reach x"),
        );
        let v = parsed(&e);
        assert_eq!(v["error"]["kind"], "unavailable");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("cannot reach x: "),
            "{v}"
        );
        let e = anyhow::anyhow!("disk on fire");
        assert_eq!(parsed(&e)["error"]["kind"], "internal");
        assert!(
            !render(ErrorFormat::Json, &e).contains('\n'),
            "one line, the last on stderr"
        );
    }
}
