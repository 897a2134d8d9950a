//! The mount socket's protocol (`<admin dir>/mount.sock`, a unix stream socket
//! beside the admin socket): tonic cannot pass descriptors, this socket can.
//!
//! Each message is one line of JSON. Descriptors travel as `SCM_RIGHTS` with the
//! first byte of a reply line.
//!
//! ```text
//! holder            → {"op":"attach","session":12}
//! daemon            ← {"ok":true}                           + [overlay mount fd]
//! holder's init     → {"op":"ready","mode":"root","workdir":"/"}   (SCM_CREDENTIALS)
//!   … the connection stays open for the session's life: its end without a
//!     CloseSession tells the daemon that every holder process is gone …
//! session exec      → {"op":"join","session":12}             (a new connection)
//! daemon            ← {"ok":true,"mode":"root","workdir":"/"} + [pidfd of init, its root]
//! ```
//!
//! `session run` and `session create` take the session and its overlay in one
//! round trip, and `session run` ends it on the same connection (no admin API
//! connection on its path):
//! ```text
//! holder            → {"op":"start","stack":"…","branch":"main","policy":"never",…}
//! daemon            ← {"ok":true,"session":"<hex>","created":true} + [overlay mount fd]
//!   … ready, the command runs …
//! holder            → {"op":"close","policy":"auto","exit_status":0,…}
//! daemon            ← {"ok":true,"session":"<hex>"}          (the outcome in it)
//! ```
//! A holder whose connection broke (the daemon restarted while the command
//! ran, or during the close) reconnects, takes its session back and closes it
//! on the new connection, within `session run --reconnect-timeout`:
//! ```text
//! holder            → {"op":"resume","session":12,"mode":"root","workdir":"/"}
//! daemon            ← {"ok":true}
//! holder            → {"op":"close","policy":"auto","exit_status":0,…}
//! daemon            ← {"ok":true,"session":"<hex>"}   (or the outcome the
//!                                                       daemon recorded before)
//! ```
//! `session` is the admin API's `Session` message (api/proto/admin.proto),
//! protobuf-encoded, as lowercase hex: the CLI prints and writes exactly what a
//! `CreateSession` / `CloseSession` answer would have carried.
//! An error reply is `{"ok":false,"code":"not_found","message":"…"}`; `code` is an
//! errdefs kind, spelled as everywhere else ([`ErrorKind::as_str`]: `not_found`,
//! `failed_precondition`, `already_exists`, `invalid_argument`, `unsupported`,
//! `internal`, …), or, for an admin API status no kind maps to, the gRPC code's
//! snake-case name (`layerstack_api::kind_name`).

use layerstack_types::ErrorKind;
use serde::{Deserialize, Serialize};

/// The file name of the mount socket in the admin socket's directory.
pub const MOUNT_SOCKET_NAME: &str = "mount.sock";

/// A request line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Request {
    /// Give me session `session`'s overlay as a detached mount; this connection
    /// is its holder from now on.
    Attach { session: i64 },
    /// Sent by the holder's init (pid 1 of the session's namespaces) once the
    /// overlay is in place, on the attaching connection.
    Ready { mode: Mode, workdir: String },
    /// Let me join session `session`'s namespaces (`layerstack session exec`).
    Join { session: i64 },
    /// Create a session (the admin API's `CreateSession`) and attach it on
    /// this connection, as [`Request::Attach`] does.
    Start(Start),
    /// End the session this connection holds (the admin API's `CloseSession`).
    Close(Close),
    /// I am the holder of session `session` (started on an earlier connection
    /// that broke: the daemon restarted); this connection holds it from now on,
    /// as after [`Request::Attach`], without a new overlay. `mode` and
    /// `workdir` are the session's, as its init reported them in
    /// [`Request::Ready`].
    Resume {
        session: i64,
        #[serde(default)]
        mode: Mode,
        #[serde(default)]
        workdir: String,
    },
}

/// The fields of the admin API's `CreateSessionRequest` (same meaning; empty
/// means the default there).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Start {
    #[serde(default)]
    pub namespace: String,
    #[serde(default)]
    pub stack: String,
    #[serde(default)]
    pub branch: String,
    #[serde(default)]
    pub node: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub idempotency_key: String,
    #[serde(default)]
    pub policy: String,
    /// ms to wait for a slot under the cap; 0: answer busy at once.
    #[serde(default)]
    pub wait_ms: u32,
    /// Capture ignores a regular file's mtime (content history only).
    #[serde(default)]
    pub ignore_mtime: bool,
}

/// The fields of the admin API's `CloseSessionRequest` but the session (the
/// one this connection holds).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Close {
    /// `auto` (the recorded exit policy and `exit_status`), `publish`,
    /// `discard` or `checkpoint`.
    pub policy: String,
    #[serde(default)]
    pub reason: String,
    /// The command's exit status; absent: none (a holder that could not run it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_status: Option<u32>,
    /// A checkpoint's node state (JSON object) and command.
    #[serde(default)]
    pub state: String,
    #[serde(default)]
    pub command: String,
}

/// Root mode (the overlay is `/`) or workspace mode (mounted at a directory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Root,
    Workspace,
}

/// A reply line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Reply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub code: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// Join: the session's mode and default working directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub workdir: String,
    /// Start and close: the session (admin API `Session`, protobuf, hex).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub session: String,
    /// Start: false when an idempotency key named an earlier session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<bool>,
}

impl Reply {
    /// A success.
    pub fn ok() -> Reply {
        Reply {
            ok: true,
            ..Default::default()
        }
    }

    /// A failure of kind `kind` (`code` is its name).
    pub fn error(kind: ErrorKind, message: impl Into<String>) -> Reply {
        Reply {
            ok: false,
            code: kind.as_str().to_string(),
            message: message.into(),
            ..Default::default()
        }
    }
}

/// `v` as one JSON line.
pub fn line<T: Serialize>(v: &T) -> Vec<u8> {
    let mut b = serde_json::to_vec(v).unwrap_or_else(|_| b"{}".to_vec());
    b.push(b'\n');
    b
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn lines_round_trip() {
        let r = Request::Attach { session: 7 };
        let l = line(&r);
        assert_eq!(l, b"{\"op\":\"attach\",\"session\":7}\n");
        assert_eq!(serde_json::from_slice::<Request>(&l).unwrap(), r);
        let ready = Request::Ready {
            mode: Mode::Workspace,
            workdir: "/w".into(),
        };
        assert_eq!(
            serde_json::from_slice::<Request>(&line(&ready)).unwrap(),
            ready
        );
        let start = Request::Start(Start {
            stack: "s".into(),
            policy: "never".into(),
            wait_ms: 5,
            ..Default::default()
        });
        let l = line(&start);
        assert!(l.starts_with(b"{\"op\":\"start\",\"namespace\":\"\",\"stack\":\"s\""));
        assert_eq!(serde_json::from_slice::<Request>(&l).unwrap(), start);
        let close = Request::Close(Close {
            policy: "auto".into(),
            exit_status: Some(3),
            ..Default::default()
        });
        assert_eq!(
            serde_json::from_slice::<Request>(&line(&close)).unwrap(),
            close
        );
        let resume = Request::Resume {
            session: 4,
            mode: Mode::Root,
            workdir: "/".into(),
        };
        let l = line(&resume);
        assert_eq!(
            l,
            b"{\"op\":\"resume\",\"session\":4,\"mode\":\"root\",\"workdir\":\"/\"}\n"
        );
        assert_eq!(serde_json::from_slice::<Request>(&l).unwrap(), resume);
        // Fields left out take their defaults.
        assert_eq!(
            serde_json::from_slice::<Request>(b"{\"op\":\"start\",\"stack\":\"x\"}").unwrap(),
            Request::Start(Start {
                stack: "x".into(),
                ..Default::default()
            })
        );
        let e = Reply::error(ErrorKind::NotFound, "no session 3");
        assert_eq!(
            line(&e),
            b"{\"ok\":false,\"code\":\"not_found\",\"message\":\"no session 3\"}\n"
        );
        let back: Reply = serde_json::from_slice(&line(&e)).unwrap();
        assert_eq!(back, e);
        assert_eq!(line(&Reply::ok()), b"{\"ok\":true}\n");
    }
}
