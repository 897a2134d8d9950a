//! Admin RPC `ImportBase`: a base made without containerd (engine
//! `import_base`; docs/architecture.md "Base import").

use std::path::PathBuf;

use layerstack_api as api;
use layerstack_engine::publisher::ImportKind;
use layerstack_engine::ImportRequest;
use tonic::Status;

use crate::admin::{engine_status, require, AdminService};

impl AdminService {
    pub(crate) async fn base_import(
        &self,
        r: api::ImportBaseRequest,
    ) -> Result<api::ImportBaseResponse, Status> {
        require("path (a directory, a layer tar or an OCI layout)", &r.path)?;
        let path = PathBuf::from(&r.path);
        if !path.is_absolute() {
            return Err(Status::invalid_argument(format!(
                "import path {:?} is relative: the daemon reads it, so give an absolute path (the CLI makes one from its working directory)",
                r.path
            )));
        }
        let kind = ImportKind::parse(&r.kind).ok_or_else(|| {
            Status::invalid_argument(format!(
                "import kind {:?} is none of auto, dir, tar, oci",
                r.kind
            ))
        })?;
        let platform = (!r.platform.is_empty()).then(|| r.platform.clone());
        if let Some(p) = &platform {
            let parts: Vec<&str> = p.split('/').collect();
            if !(2..=3).contains(&parts.len()) || parts.iter().any(|x| x.is_empty()) {
                return Err(Status::invalid_argument(format!(
                    "platform {p:?} is not os/arch[/variant] (e.g. linux/amd64, linux/arm64/v8)"
                )));
            }
        }
        let b = self
            .engine
            .import_base(ImportRequest {
                path,
                kind,
                platform,
            })
            .await
            .map_err(engine_status)?;
        Ok(api::ImportBaseResponse {
            stack: b.stack,
            digest: b.digest,
            layer: b.layer,
            created: b.created,
            bytes: b.bytes,
            kind: b.report.kind.as_str().to_string(),
            files: b.report.files,
            layers: b.report.layers,
            manifest: b.report.manifest.unwrap_or_default(),
            platform: b.report.platform.unwrap_or_default(),
        })
    }
}
