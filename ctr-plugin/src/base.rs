//! `layerstack base import`: a stack from a directory tree, a layer tar or an
//! OCI image layout, made by the daemon without containerd (admin RPC
//! `ImportBase`; docs/architecture.md "Base import").

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use layerstack_api as api;
use serde_json::json;

use crate::out;

#[derive(Debug, Subcommand)]
pub enum BaseCmd {
    /// Make a stack from a directory tree, a layer tar (plain, gzip or zstd)
    /// or an OCI image layout, with no containerd: flattened into one base
    /// layer (OCI whiteouts applied), content-addressed — the same content
    /// imported again is the same stack (`import:sha256:<hex>`, printed on
    /// stdout) with a `main` branch. The daemon reads PATH, in its own mount
    /// namespace. Unsafe entries (absolute or `..` names, writes through a
    /// symlink, hardlinks to outside) are refused and nothing is kept.
    Import(ImportArgs),
}

#[derive(Debug, Clone, Args)]
pub struct ImportArgs {
    /// The directory, tar file or OCI layout directory; a relative path is
    /// made absolute from the working directory.
    pub path: PathBuf,
    /// What PATH is: auto (a directory holding an oci-layout file is an OCI
    /// layout, another directory a tree, a file a tar), dir, tar or oci.
    #[arg(long, default_value = "auto", value_parser = ["auto", "dir", "tar", "oci"])]
    pub kind: String,
    /// OCI layouts: the manifest's platform, os/arch[/variant] [default: the
    /// only manifest, else the one for the daemon's platform].
    #[arg(long, value_name = "OS/ARCH[/VARIANT]")]
    pub platform: Option<String>,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(admin: &Path, cmd: BaseCmd) -> Result<ExitCode> {
    let BaseCmd::Import(a) = cmd;
    let path = std::path::absolute(&a.path)
        .with_context(|| format!("cannot make {} absolute", a.path.display()))?;
    let mut c = crate::connect(admin).await?;
    let spin = crate::output::spinner(&format!("importing {}", path.display()));
    let r = c
        .import_base(api::ImportBaseRequest {
            path: path.to_string_lossy().into_owned(),
            kind: a.kind.clone(),
            platform: a.platform.clone().unwrap_or_default(),
        })
        .await;
    spin.finish_and_clear();
    let r = r?.into_inner();
    if a.json {
        out!(
            "{}",
            json!({
                "stack": r.stack, "digest": r.digest, "layer": r.layer, "created": r.created,
                "bytes": r.bytes, "kind": r.kind, "files": r.files, "layers": r.layers,
                "manifest": r.manifest, "platform": r.platform,
            })
        );
    } else {
        out!("{}", r.stack);
        eprintln!("{}", summary(&path, &r));
    }
    Ok(ExitCode::SUCCESS)
}

/// The line on stderr: what was read and what it made.
fn summary(path: &Path, r: &api::ImportBaseResponse) -> String {
    let what = match r.kind.as_str() {
        "oci" => format!(
            "OCI layout {} (manifest {}{}, {} layer{})",
            path.display(),
            r.manifest,
            if r.platform.is_empty() {
                String::new()
            } else {
                format!(" {}", r.platform)
            },
            r.layers,
            if r.layers == 1 { "" } else { "s" }
        ),
        "tar" => format!("tar {}", path.display()),
        _ => format!("directory {}", path.display()),
    };
    if r.created {
        format!(
            "layerstack: imported {what}: base layer {}, {} file{}, {} bytes; branch main is ready (digest {})",
            r.layer,
            r.files,
            if r.files == 1 { "" } else { "s" },
            r.bytes,
            r.digest
        )
    } else {
        format!(
            "layerstack: {what} holds the same content as stack {} (base layer {}): nothing changed",
            r.stack, r.layer
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_says_what_was_made_or_found() {
        let mut r = api::ImportBaseResponse {
            stack: "import:sha256:ab".into(),
            digest: "sha256:ab".into(),
            layer: 3,
            created: true,
            bytes: 10,
            kind: "oci".into(),
            files: 1,
            layers: 2,
            manifest: "sha256:cd".into(),
            platform: "linux/amd64".into(),
        };
        let s = summary(Path::new("/x"), &r);
        assert!(
            s.contains("OCI layout /x (manifest sha256:cd linux/amd64, 2 layers)")
                && s.contains("base layer 3, 1 file, 10 bytes"),
            "{s}"
        );
        r.created = false;
        r.kind = "dir".into();
        let s = summary(Path::new("/x"), &r);
        assert!(
            s.contains("directory /x holds the same content as stack import:sha256:ab"),
            "{s}"
        );
    }
}
