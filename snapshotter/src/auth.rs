//! Who may call the daemon (docs/operations.md "Who may call"; config `[api]`).
//!
//! ```text
//! unix sockets   the kernel names the caller: SO_PEERCRED, taken by tonic at
//!                accept (`UdsConnectInfo::peer_cred`, the connecting process's
//!                effective uid and gid at connect(2)); [`PeerPolicy`] checks it
//!                before every request of the connection is served
//! TCP            TLS only (rustls); the caller proves itself by a client
//!                certificate (rustls checks the chain during the handshake) or
//!                a bearer token ([`Tokens`], before every request), or both
//! ```
//!
//! Root (uid 0) is always allowed on the unix sockets, as on containerd's own
//! socket: whoever is root can read the store anyway. The mount socket checks
//! its peer itself (`sandbox.rs`): root only, Mode B needs it.
//!
//! Why per request and not per connection: a tonic server has no hook between
//! accept and HTTP/2 that could answer with a gRPC status; the connection's
//! credentials are fixed at connect, so checking them before each request is
//! the same check with an answer the client can read (`PERMISSION_DENIED`
//! naming its uid, gid and the key to change) instead of a reset connection.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use layerstack_api::ErrorKind;
use tonic::transport::server::UdsConnectInfo;
use tonic::{Request, Status};
use tracing::warn;

/// Which peers a unix socket serves: root, and the listed uids and effective
/// gids.
#[derive(Debug, Clone)]
pub struct PeerPolicy {
    /// The socket's name in messages: "admin", "snapshots".
    socket: &'static str,
    uids: Arc<[u32]>,
    gids: Arc<[u32]>,
    /// What a refused caller is told to change.
    remedy: &'static str,
}

impl PeerPolicy {
    /// The admin socket's: root plus `[api] allowed_uids` / `allowed_gids`.
    pub fn admin(cfg: &layerstack_config::ApiConfig) -> Self {
        Self {
            socket: "admin",
            uids: cfg.allowed_uids.clone().into(),
            gids: cfg.allowed_gids.clone().into(),
            remedy: "add the uid to [api] allowed_uids (or the gid to [api] allowed_gids) in the daemon's config and restart it",
        }
    }

    /// Root only (the snapshots socket: containerd connects as root).
    pub fn root_only(socket: &'static str) -> Self {
        Self {
            socket,
            uids: Arc::from([]),
            gids: Arc::from([]),
            remedy: "only root (containerd) may call it",
        }
    }

    /// Whether the peer `uid`/`gid` may call.
    pub fn allows(&self, uid: u32, gid: u32) -> bool {
        uid == 0 || self.uids.contains(&uid) || self.gids.contains(&gid)
    }

    /// The check of one request: `PERMISSION_DENIED` unless its connection's
    /// peer is allowed. A request without peer credentials (not from a unix
    /// socket, or the kernel would not tell) is refused too.
    #[allow(clippy::result_large_err)]
    pub fn check(&self, req: Request<()>) -> Result<Request<()>, Status> {
        let cred = req
            .extensions()
            .get::<UdsConnectInfo>()
            .and_then(|i| i.peer_cred);
        let Some(cred) = cred else {
            warn!(
                socket = self.socket,
                "refused a request whose peer credentials are unknown"
            );
            return Err(layerstack_api::status(
                ErrorKind::PermissionDenied,
                format!(
                    "permission denied: the {} socket cannot tell who is calling (no SO_PEERCRED)",
                    self.socket
                ),
            ));
        };
        let (uid, gid) = (cred.uid(), cred.gid());
        if self.allows(uid, gid) {
            return Ok(req);
        }
        warn!(
            socket = self.socket,
            uid,
            gid,
            pid = cred.pid(),
            "refused a caller"
        );
        Err(layerstack_api::status(
            ErrorKind::PermissionDenied,
            format!(
                "permission denied: uid {uid} (gid {gid}) may not call the daemon's {} socket: {}",
                self.socket, self.remedy
            ),
        ))
    }

    /// The check as a tonic layer for `Server::builder().layer(…)`.
    pub fn layer(
        self,
    ) -> tonic::service::interceptor::InterceptorLayer<
        impl Fn(Request<()>) -> Result<Request<()>, Status> + Clone,
    > {
        tonic::service::interceptor(move |req| self.check(req))
    }
}

/// The bearer tokens of `[api.tcp] tokens_file`.
#[derive(Clone)]
pub struct Tokens(Arc<[Vec<u8>]>);

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokens({} tokens)", self.0.len())
    }
}

impl Tokens {
    /// Reads `path`: one token per line; blank lines and lines starting with `#`
    /// are ignored, surrounding spaces trimmed.
    ///
    /// # Errors
    /// The file cannot be read, or lists no token.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read [api.tcp] tokens_file {}", path.display()))?;
        let tokens: Vec<Vec<u8>> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(|l| l.as_bytes().to_vec())
            .collect();
        if tokens.is_empty() {
            bail!(
                "[api.tcp] tokens_file {} lists no token: write one token per line",
                path.display()
            );
        }
        Ok(Self(tokens.into()))
    }

    /// Whether `presented` is one of the tokens. Every token is compared, each
    /// in time independent of where the bytes differ (`constant_time_eq`).
    pub fn contains(&self, presented: &[u8]) -> bool {
        self.0.iter().fold(false, |found, t| {
            found | constant_time_eq::constant_time_eq(t, presented)
        })
    }

    /// The check of one request: `UNAUTHENTICATED` unless it carries
    /// `authorization: Bearer <token>` with one of the tokens.
    #[allow(clippy::result_large_err)]
    pub fn check(&self, req: Request<()>) -> Result<Request<()>, Status> {
        let refuse = |why: &str| {
            layerstack_api::status(
                ErrorKind::Unauthenticated,
                format!("unauthenticated: {why}: send `authorization: Bearer <token>` with a token listed in the daemon's [api.tcp] tokens_file"),
            )
        };
        let Some(value) = req.metadata().get("authorization") else {
            return Err(refuse("no bearer token"));
        };
        let token = value
            .as_bytes()
            .strip_prefix(b"Bearer ")
            .ok_or_else(|| refuse("the authorization header is not `Bearer <token>`"))?;
        if self.contains(token) {
            Ok(req)
        } else {
            warn!(
                remote = ?req.remote_addr(),
                "refused a TCP request: wrong bearer token"
            );
            Err(refuse("the bearer token is not one the daemon knows"))
        }
    }
}

/// The TCP listener's TLS settings and token check from `[api.tcp]`.
pub struct TcpSettings {
    pub address: std::net::SocketAddr,
    pub tls: tonic::transport::ServerTlsConfig,
    pub tokens: Option<Tokens>,
}

impl TcpSettings {
    /// Reads the files `[api.tcp]` names.
    ///
    /// # Errors
    /// No certificate or key (plain TCP is refused), neither `client_ca` nor
    /// `tokens_file` (anyone who reaches the port could call), or a file that
    /// cannot be read; each message names the key.
    pub fn load(t: &layerstack_config::ApiTcpConfig) -> Result<Self> {
        let (Some(cert), Some(key)) = (&t.cert, &t.key) else {
            bail!(
                "[api.tcp] address {} has no TLS certificate: plain TCP is refused; set [api.tcp] cert and key (PEM files), or remove [api.tcp]",
                t.address
            );
        };
        if t.client_ca.is_none() && t.tokens_file.is_none() {
            bail!(
                "[api.tcp] address {} authenticates nobody: set [api.tcp] client_ca (client certificates) or tokens_file (bearer tokens), or both",
                t.address
            );
        }
        let read = |key: &str, p: &Path| {
            std::fs::read(p).with_context(|| format!("cannot read [api.tcp] {key} {}", p.display()))
        };
        let identity = tonic::transport::Identity::from_pem(read("cert", cert)?, read("key", key)?);
        let mut tls = tonic::transport::ServerTlsConfig::new().identity(identity);
        if let Some(ca) = &t.client_ca {
            tls = tls.client_ca_root(tonic::transport::Certificate::from_pem(read(
                "client_ca",
                ca,
            )?));
        }
        // rustls parses the files now: a bad certificate or key stops the start
        // before anything is bound.
        tonic::transport::Server::builder()
            .tls_config(tls.clone())
            .with_context(|| {
                format!(
                    "[api.tcp] cert {}, key {} or client_ca: not PEM rustls can use",
                    cert.display(),
                    key.display()
                )
            })?;
        let tokens = t.tokens_file.as_deref().map(Tokens::load).transpose()?;
        Ok(Self {
            address: t.address,
            tls,
            tokens,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn root_is_always_allowed_others_only_when_listed() {
        let none = PeerPolicy::admin(&layerstack_config::ApiConfig::default());
        assert!(none.allows(0, 0));
        assert!(none.allows(0, 1000), "root with any gid");
        assert!(!none.allows(1000, 1000));
        let some = PeerPolicy::admin(&layerstack_config::ApiConfig {
            allowed_uids: vec![1000],
            allowed_gids: vec![2000],
            tcp: None,
        });
        assert!(some.allows(1000, 5));
        assert!(some.allows(7, 2000));
        assert!(!some.allows(7, 5));
    }

    #[test]
    fn a_request_without_peer_credentials_is_refused() {
        let p = PeerPolicy::admin(&layerstack_config::ApiConfig::default());
        let e = p.check(Request::new(())).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
    }

    #[test]
    fn tokens_match_exactly_and_the_file_needs_one() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("tokens");
        std::fs::write(&f, "# ops\n\n  s3cret  \nother\n").unwrap();
        let tokens = Tokens::load(&f).unwrap();
        assert!(tokens.contains(b"s3cret"));
        assert!(tokens.contains(b"other"));
        assert!(!tokens.contains(b"s3cre"));
        assert!(!tokens.contains(b"# ops"));
        assert!(!tokens.contains(b""));
        let req = |v: Option<&str>| {
            let mut r = Request::new(());
            if let Some(v) = v {
                r.metadata_mut().insert("authorization", v.parse().unwrap());
            }
            r
        };
        assert!(tokens.check(req(Some("Bearer s3cret"))).is_ok());
        for bad in [
            None,
            Some("Bearer nope"),
            Some("s3cret"),
            Some("Basic s3cret"),
        ] {
            let e = tokens.check(req(bad)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated, "{bad:?}");
            assert!(e.message().contains("tokens_file"), "{}", e.message());
        }
        std::fs::write(&f, "# only a comment\n").unwrap();
        let e = Tokens::load(&f).unwrap_err().to_string();
        assert!(e.contains("lists no token"), "{e}");
    }

    #[test]
    fn plain_tcp_and_tcp_without_authentication_are_refused() {
        let mut t = layerstack_config::ApiTcpConfig {
            address: "127.0.0.1:7443".parse().unwrap(),
            cert: None,
            key: None,
            client_ca: None,
            tokens_file: Some("/nonexistent".into()),
        };
        let e = TcpSettings::load(&t).err().unwrap().to_string();
        assert!(e.contains("plain TCP is refused"), "{e}");
        t.cert = Some("/c".into());
        t.key = Some("/k".into());
        t.tokens_file = None;
        let e = TcpSettings::load(&t).err().unwrap().to_string();
        assert!(e.contains("authenticates nobody"), "{e}");
    }
}
