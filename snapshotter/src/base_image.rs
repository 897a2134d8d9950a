//! A stack's base image as containerd still has it, for `layerstack export`
//! (docs/architecture.md "OCI export").
//!
//! The store records a stack's base as its containerd namespace and the top
//! layer chainID of its image (`stacks.base_digest`), not an image reference:
//! a tag can move or go away while the history stays. [`find`] looks for an
//! image of that namespace whose layers are the stack's base layers — its
//! config's `rootfs.diff_ids` give that chainID (OCI image-spec `config.md`,
//! "Layer ChainID") and there are as many as the stack has base layers — and
//! reads, from containerd's content store, this platform's manifest (an index
//! is followed, as `ctr run` would) and the config blob. The reference the
//! export named is tried first, then every image of the namespace by name.
//!
//! For each of the manifest's layers it records whether the blob is still in
//! the content store, with the descriptor's size, and whether its media type is
//! one a layer tar is shipped as: only then is the export's base layer that
//! blob, copied verbatim ([`open_blob`]), so that a registry holding the base
//! image already holds it. containerd keeps the blobs of an image it pulled or
//! imported unless told to discard them (CRI `discard_unpacked_layers`).
//!
//! Nothing here is an error for the export: an unreachable containerd, an
//! image that is gone, a config that does not parse — each is a [`Missing`]
//! reason, and the export re-packs the base layers and defaults the runtime
//! config (the client warns).

use containerd_client::services::v1::content_client::ContentClient;
use containerd_client::services::v1::images_client::ImagesClient;
use containerd_client::services::v1::{InfoRequest, ListImagesRequest, ReadContentRequest};
use containerd_client::tonic::transport::Channel;
use containerd_client::tonic::Code;
use oci_spec::image as oci;
use sha2::{Digest, Sha256};

use crate::containerd::{chain_id, read_blob, with_ns, ContainerdError};

/// Layer media types whose blob is an (optionally compressed) layer tar that any
/// image consumer unpacks: OCI image-spec `layer.md` and `media-types.md`, and
/// Docker's image manifest v2 schema 2. Anything else (encrypted layers, unknown
/// types) is re-packed.
const LAYER_TYPES: &[&str] = &[
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
];

/// One layer of the base image's manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseBlob {
    /// `sha256:<hex>` of the blob (the manifest's descriptor).
    pub digest: String,
    /// The descriptor's media type, verbatim.
    pub media_type: String,
    /// Bytes of the blob (the descriptor's size).
    pub size: u64,
    /// `sha256:<hex>` of the uncompressed tar (the config's `rootfs.diff_ids`).
    pub diff_id: String,
    /// The content store has the blob at the descriptor's size and its media
    /// type is in [`LAYER_TYPES`]: the export copies it.
    pub copyable: bool,
}

/// The stack's base image as found in containerd.
#[derive(Debug, Clone)]
pub struct BaseImage {
    /// The image reference it was found under.
    pub name: String,
    /// `sha256:<hex>` of this platform's manifest.
    pub manifest: String,
    /// The image config blob, verbatim (OCI image-spec `config.md` JSON).
    pub config: Vec<u8>,
    /// The manifest's layers, oldest first, one per base layer of the stack.
    pub layers: Vec<BaseBlob>,
}

/// Why no base image is used: one sentence for the export's warning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Missing(pub String);

/// The GOARCH name of this machine (what an index's `platform.architecture` says).
fn goarch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

/// The image config and manifest of the image whose target is blob `digest`.
async fn read_image(
    content: &mut ContentClient<Channel>,
    ns: &str,
    name: &str,
    mut digest: String,
) -> Result<(String, oci::ImageManifest, Vec<u8>, oci::ImageConfiguration), ContainerdError> {
    let bad = |m: String| ContainerdError::BadImage(name.to_string(), m);
    // An index (OCI or Docker manifest list) has `manifests`; a manifest has not.
    let manifest = loop {
        let blob = read_blob(content, ns, &digest).await?;
        let v: serde_json::Value = serde_json::from_slice(&blob)
            .map_err(|e| bad(format!("manifest {digest} is not JSON: {e}")))?;
        if v.get("manifests").is_none() {
            break oci::ImageManifest::from_reader(blob.as_slice())
                .map_err(|e| bad(format!("manifest {digest}: {e}")))?;
        }
        let index = oci::ImageIndex::from_reader(blob.as_slice())
            .map_err(|e| bad(format!("index {digest}: {e}")))?;
        let pick = index
            .manifests()
            .iter()
            .find(|m| {
                m.platform().as_ref().is_some_and(|p| {
                    *p.os() == oci::Os::Linux && p.architecture().to_string() == goarch()
                })
            })
            .or_else(|| index.manifests().first())
            .ok_or_else(|| bad(format!("index {digest} lists no manifests")))?;
        digest = pick.digest().to_string();
    };
    let config_digest = manifest.config().digest().to_string();
    let config = read_blob(content, ns, &config_digest).await?;
    let parsed = oci::ImageConfiguration::from_reader(config.as_slice())
        .map_err(|e| bad(format!("config {config_digest}: {e}")))?;
    Ok((digest, manifest, config, parsed))
}

/// Whether the content store has blob `digest` at `size` bytes.
async fn has_blob(
    content: &mut ContentClient<Channel>,
    ns: &str,
    digest: &str,
    size: u64,
) -> Result<bool, ContainerdError> {
    match content
        .info(with_ns(
            ns,
            InfoRequest {
                digest: digest.to_string(),
            },
        ))
        .await
    {
        Ok(r) => Ok(r
            .into_inner()
            .info
            .is_some_and(|i| u64::try_from(i.size).ok() == Some(size))),
        Err(st) if st.code() == Code::NotFound => Ok(false),
        Err(st) => Err(ContainerdError::Rpc(format!("content info {digest}"), st)),
    }
}

/// The base image of a stack: an image of containerd namespace `ns` whose
/// config's diff IDs have top chainID `chain` and number `base_layers` (see the
/// module docs); `prefer` (an image reference, or "") is tried first.
/// `Err(Missing)` says why there is none.
pub async fn find(
    ch: &Channel,
    ns: &str,
    chain: &str,
    base_layers: usize,
    prefer: &str,
) -> Result<BaseImage, Missing> {
    let list = ImagesClient::new(ch.clone())
        .list(with_ns(ns, ListImagesRequest { filters: vec![] }))
        .await
        .map_err(|e| {
            Missing(format!(
                "containerd cannot list the images of namespace {ns:?}: {}",
                e.message()
            ))
        })?
        .into_inner()
        .images;
    let mut images: Vec<_> = list
        .into_iter()
        .filter_map(|i| Some((i.name, i.target?.digest)))
        .collect();
    images.sort_by(|a, b| (a.0 != prefer, &a.0).cmp(&(b.0 != prefer, &b.0)));
    let mut content = ContentClient::new(ch.clone());
    let mut unreadable = Vec::new();
    for (name, target) in images {
        let (manifest_digest, manifest, config, parsed) =
            match read_image(&mut content, ns, &name, target).await {
                Ok(x) => x,
                Err(e) => {
                    unreadable.push(format!("{name}: {}", layerstack_api::error_chain(&e)));
                    continue;
                }
            };
        let diff_ids = parsed.rootfs().diff_ids();
        if diff_ids.len() != base_layers || chain_id(diff_ids).as_deref() != Some(chain) {
            continue;
        }
        let mut layers = Vec::with_capacity(diff_ids.len());
        let descriptors = manifest.layers();
        for (i, diff_id) in diff_ids.iter().enumerate() {
            // A manifest with fewer layers than diff IDs is broken; its blobs are
            // not used (the config still is: the diff IDs are the stack's).
            let (digest, media_type, size) = match descriptors.get(i) {
                Some(d) if descriptors.len() == diff_ids.len() => {
                    (d.digest().to_string(), d.media_type().to_string(), d.size())
                }
                _ => (String::new(), String::new(), 0),
            };
            let copyable = !digest.is_empty()
                && LAYER_TYPES.contains(&media_type.as_str())
                && has_blob(&mut content, ns, &digest, size)
                    .await
                    .unwrap_or(false);
            layers.push(BaseBlob {
                digest,
                media_type,
                size,
                diff_id: diff_id.clone(),
                copyable,
            });
        }
        return Ok(BaseImage {
            name,
            manifest: manifest_digest,
            config,
            layers,
        });
    }
    let mut why = format!(
        "containerd namespace {ns:?} has no image whose layers are the stack's base {chain} (removed since the stack was made?)"
    );
    if !unreadable.is_empty() {
        why.push_str(&format!("; unreadable: {}", unreadable.join("; ")));
    }
    Err(Missing(why))
}

/// Opens blob `blob` of containerd's content store (namespace `ns`) for
/// reading; [`BlobReader::next`] checks its size and sha256 against the
/// descriptor at the end.
///
/// # Errors
/// `CopyError::Read` when containerd refuses the read (the blob went away).
pub async fn open_blob(ch: &Channel, ns: &str, blob: &BaseBlob) -> Result<BlobReader, CopyError> {
    let stream = ContentClient::new(ch.clone())
        .read(with_ns(
            ns,
            ReadContentRequest {
                digest: blob.digest.clone(),
                offset: 0,
                size: 0,
            },
        ))
        .await
        .map_err(|e| read_error(blob, e))?
        .into_inner();
    Ok(BlobReader {
        stream,
        blob: blob.clone(),
        hash: Sha256::new(),
        bytes: 0,
    })
}

fn read_error(blob: &BaseBlob, e: containerd_client::tonic::Status) -> CopyError {
    CopyError::Read(ContainerdError::Rpc(
        format!("read blob {}", blob.digest),
        e,
    ))
}

/// A blob being read from containerd (see [`open_blob`]).
pub struct BlobReader {
    stream:
        containerd_client::tonic::Streaming<containerd_client::services::v1::ReadContentResponse>,
    blob: BaseBlob,
    hash: Sha256,
    bytes: u64,
}

impl BlobReader {
    /// The next bytes of the blob as containerd sends them (≤ 1 MiB each), or
    /// `None` at its end once its digest and size are verified.
    ///
    /// # Errors
    /// `CopyError::Read` when the read fails midway; `CopyError::Mismatch`
    /// when the bytes are not the descriptor's.
    pub async fn next(&mut self) -> Result<Option<Vec<u8>>, CopyError> {
        loop {
            let Some(chunk) = self
                .stream
                .message()
                .await
                .map_err(|e| read_error(&self.blob, e))?
            else {
                let got = format!("sha256:{:x}", self.hash.clone().finalize());
                if got != self.blob.digest || self.bytes != self.blob.size {
                    return Err(CopyError::Mismatch {
                        digest: self.blob.digest.clone(),
                        size: self.blob.size,
                        got,
                        bytes: self.bytes,
                    });
                }
                return Ok(None);
            };
            if chunk.data.is_empty() {
                continue;
            }
            self.hash.update(&chunk.data);
            self.bytes += chunk.data.len() as u64;
            return Ok(Some(chunk.data));
        }
    }
}

/// Why reading a base image's blob failed.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("cannot read the base image's layer blob from containerd")]
    Read(#[source] ContainerdError),
    #[error("containerd's blob {digest} ({size} bytes) read as {bytes} bytes with digest {got}")]
    Mismatch {
        digest: String,
        size: u64,
        got: String,
        bytes: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_layer_tars_are_copied() {
        assert!(LAYER_TYPES.contains(&"application/vnd.docker.image.rootfs.diff.tar.gzip"));
        assert!(!LAYER_TYPES.contains(&"application/vnd.oci.image.layer.v1.tar+gzip+encrypted"));
        assert_eq!(oci::MediaType::ImageLayerZstd.to_string(), LAYER_TYPES[2]);
    }
}
