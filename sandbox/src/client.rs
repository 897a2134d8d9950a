//! A blocking client of the mount socket ([`crate::wire`]), for the holder and
//! `session exec`.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;

use crate::sys;
use crate::wire::{self, Reply, Request};

/// One connection to the mount socket.
pub struct MountConn {
    sock: UnixStream,
}

impl MountConn {
    /// Connects to the mount socket at `path`.
    pub fn connect(path: &Path) -> io::Result<MountConn> {
        let sock = UnixStream::connect(path)?;
        Ok(MountConn { sock })
    }

    /// The socket's descriptor (init inherits it and reports "ready" on it).
    pub fn raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    /// Sends `req` and reads one reply line with the descriptors passed with it.
    pub fn request(&mut self, req: &Request) -> io::Result<(Reply, Vec<OwnedFd>)> {
        self.sock.write_all(&wire::line(req))?;
        let mut buf = Vec::with_capacity(256);
        let mut fds = Vec::new();
        let mut chunk = [0u8; 1024];
        loop {
            let r = match sys::recv_msg(self.sock.as_raw_fd(), &mut chunk) {
                Ok(r) => r,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            fds.extend(r.fds);
            if r.len == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the daemon closed the mount socket without an answer",
                ));
            }
            buf.extend_from_slice(&chunk[..r.len]);
            if let Some(i) = buf.iter().position(|&b| b == b'\n') {
                let reply: Reply = serde_json::from_slice(&buf[..i]).map_err(|e| {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("bad reply from the daemon: {e}"),
                    )
                })?;
                return Ok((reply, fds));
            }
        }
    }

    /// Marks the socket so that the messages sent on it carry the sender's
    /// credentials (init's pid reaches the daemon that way).
    pub fn pass_credentials(&self) -> io::Result<()> {
        sys::set_passcred(self.sock.as_raw_fd())
    }
}

/// What [`wait_either`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Woken {
    /// The connection: readable or hung up (the daemon sends nothing unasked,
    /// so either means it is gone).
    Conn,
    /// The stop descriptor.
    Stop,
    /// Neither within the timeout.
    Timeout,
}

/// Waits until `conn` (a connection's descriptor, or none) or `stop` is
/// readable or hung up, at most `timeout_ms` (-1: no limit). Retries on
/// `EINTR`.
pub fn wait_either(conn: Option<RawFd>, stop: RawFd, timeout_ms: i32) -> io::Result<Woken> {
    let ev = libc::POLLIN | libc::POLLRDHUP;
    let mut fds = [
        libc::pollfd {
            fd: stop,
            events: ev,
            revents: 0,
        },
        libc::pollfd {
            fd: conn.unwrap_or(-1),
            events: ev,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: `fds` is an array of two initialised pollfd; a negative fd
        // is ignored by poll.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(if fds[0].revents != 0 {
            Woken::Stop
        } else if fds[1].revents != 0 {
            Woken::Conn
        } else {
            Woken::Timeout
        });
    }
}
