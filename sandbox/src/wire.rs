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
//! An error reply is `{"ok":false,"code":"not-found","message":"…"}`; `code` is an
//! errdefs kind as the admin API maps them (`not-found`, `failed-precondition`,
//! `already-exists`, `invalid-argument`, `unsupported`, `internal`, …).

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
}

impl Reply {
    /// A success.
    pub fn ok() -> Reply {
        Reply {
            ok: true,
            ..Default::default()
        }
    }

    /// A failure of kind `code` (errdefs, kebab case).
    pub fn error(code: &str, message: impl Into<String>) -> Reply {
        Reply {
            ok: false,
            code: code.to_string(),
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
        let e = Reply::error("not-found", "no session 3");
        let back: Reply = serde_json::from_slice(&line(&e)).unwrap();
        assert_eq!(back, e);
        assert_eq!(line(&Reply::ok()), b"{\"ok\":true}\n");
    }
}
