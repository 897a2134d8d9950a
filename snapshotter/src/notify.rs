//! systemd's readiness protocol (`sd_notify(3)`), for `Type=notify` units: one
//! datagram of newline-separated `KEY=value` assignments to the unix socket named
//! by `$NOTIFY_SOCKET` — a path (`/run/systemd/notify`) or, with a leading `@`,
//! an abstract socket address. Without `$NOTIFY_SOCKET` nothing is sent.
//!
//! The daemon sends `READY=1` once both of its sockets answer a request (not
//! merely once they are bound), and `STOPPING=1` when it begins to shut down.

use std::ffi::OsString;
use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// A connection to the service manager's notification socket, if there is one.
#[derive(Debug)]
pub struct Notifier {
    target: Option<SocketAddr>,
}

impl Notifier {
    /// The notifier for `$NOTIFY_SOCKET` (none when unset or empty).
    ///
    /// # Errors
    /// The variable names an address that is neither a path nor `@abstract`
    /// (e.g. `vsock:`), or one that is too long for a unix socket.
    pub fn from_env() -> io::Result<Notifier> {
        Self::from_value(std::env::var_os("NOTIFY_SOCKET"))
    }

    /// A notifier that sends nothing.
    pub fn disabled() -> Notifier {
        Notifier { target: None }
    }

    fn from_value(v: Option<OsString>) -> io::Result<Notifier> {
        let Some(v) = v.filter(|v| !v.is_empty()) else {
            return Ok(Notifier { target: None });
        };
        let b = v.as_bytes();
        let target = match b.first() {
            Some(b'/') => SocketAddr::from_pathname(&v)?,
            Some(b'@') => SocketAddr::from_abstract_name(&b[1..])?,
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                    "NOTIFY_SOCKET={v:?} is neither a socket path nor an abstract address (@name)"
                ),
                ))
            }
        };
        Ok(Notifier {
            target: Some(target),
        })
    }

    /// Whether a service manager listens.
    pub fn enabled(&self) -> bool {
        self.target.is_some()
    }

    /// Sends `state` (`READY=1`, `STOPPING=1`, `STATUS=…`, lines joined by `\n`)
    /// as one datagram. Nothing happens without a service manager.
    ///
    /// # Errors
    /// The socket cannot be created or the datagram not sent.
    pub fn notify(&self, state: &str) -> io::Result<()> {
        let Some(target) = &self.target else {
            return Ok(());
        };
        let sock = UnixDatagram::unbound()?;
        let n = sock.send_to_addr(state.as_bytes(), target)?;
        if n != state.len() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "short write to NOTIFY_SOCKET",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn unset_or_empty_sends_nothing() {
        let n = Notifier::from_value(None).unwrap();
        assert!(!n.enabled());
        n.notify("READY=1").unwrap();
        assert!(!Notifier::from_value(Some("".into())).unwrap().enabled());
    }

    #[test]
    fn a_path_socket_receives_the_datagram() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("notify");
        let rx = UnixDatagram::bind(&p).unwrap();
        let n = Notifier::from_value(Some(p.into_os_string())).unwrap();
        n.notify("READY=1\nSTATUS=serving").unwrap();
        let mut buf = [0u8; 64];
        let len = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"READY=1\nSTATUS=serving");
    }

    #[test]
    fn an_abstract_socket_receives_the_datagram() {
        let name = format!("layerstack-notify-test-{}", std::process::id());
        let rx = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        let n = Notifier::from_value(Some(format!("@{name}").into())).unwrap();
        n.notify("STOPPING=1").unwrap();
        let mut buf = [0u8; 64];
        let len = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"STOPPING=1");
    }

    #[test]
    fn other_address_kinds_are_refused() {
        let e = Notifier::from_value(Some("vsock:2:1234".into())).unwrap_err();
        assert!(e.to_string().contains("neither"), "{e}");
    }
}
