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
