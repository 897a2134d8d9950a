//! LayerStack's admin API: generated gRPC types (`proto/admin.proto`), a
//! unix-socket client connector, and the container-label publish policy shared by
//! the daemon and the shim.
//!
//! ```no_run
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! let mut c = layerstack_api::connect("/run/layerstack/admin.sock").await?;
//! let r = c.list_sessions(layerstack_api::ListSessionsRequest {}).await?;
//! println!("{} sessions", r.into_inner().sessions.len());
//! # Ok(()) }
//! ```

#![allow(clippy::unwrap_used)]

pub mod policy;

/// Generated code of package `layerstack.admin.v1`.
pub mod v1 {
    tonic::include_proto!("layerstack.admin.v1");
}

pub use v1::admin_client::AdminClient;
pub use v1::admin_server::{Admin, AdminServer};
pub use v1::*;

use std::path::PathBuf;
use tonic::transport::{Channel, Endpoint, Uri};

/// Render an error with its source chain, "outer: inner: root cause", for
/// messages that leave the process (gRPC status messages, log lines). Errors in
/// this workspace do not repeat their source in their own message.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// Default admin socket path (ARCHITECTURE.md §3).
pub const DEFAULT_ADMIN_ADDRESS: &str = "/run/layerstack/admin.sock";

/// Connect to the admin API on the unix socket `path`.
///
/// Errors: the transport error when the socket does not exist or refuses.
pub async fn connect(
    path: impl Into<PathBuf>,
) -> Result<AdminClient<Channel>, tonic::transport::Error> {
    let path: PathBuf = path.into();
    // The URI is a placeholder: the connector below dials the socket.
    let ch = Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = path.clone();
            async move { tokio::net::UnixStream::connect(p).await }
        }))
        .await?;
    Ok(AdminClient::new(ch))
}
