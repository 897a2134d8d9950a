//! An OCI image layout directory (image-spec `image-layout.md`: `oci-layout`,
//! `index.json`, `blobs/<alg>/<hex>`): one image manifest chosen from its
//! index (nested indexes followed), its layers applied in order onto the
//! staged tree.
//!
//! Which manifest: the one for `--platform` (`os/arch[/variant]`); without it
//! the only one there is (attestation manifests, platform `unknown/unknown`,
//! do not count), else the only one for the daemon's platform (`linux/amd64`
//! on x86-64). Anything else is refused with the list to choose from.
//!
//! Every blob is read beneath the layout without following a symlink, and
//! checked against its descriptor (sha256 digest and size) before any of it
//! is used: a layer is hashed whole first, then applied. While a layer is
//! applied its uncompressed stream is hashed too and compared with the
//! config's `rootfs.diff_ids` when the config lists them.

use std::io::{self, Read};
use std::path::Path;

use oci_spec::image::{Descriptor, ImageIndex, ImageManifest, MediaType};
use sha2::{Digest as _, Sha256};

use super::stage::Stage;
use super::tarball::{apply, decompressed, sniff, ApplyOptions};
use super::ImportError;
use crate::fsx;

/// JSON documents (index, manifest, config) larger than this are refused.
const MAX_JSON: u64 = 16 << 20;
/// Nested indexes followed at most this deep.
const MAX_NESTING: usize = 4;

/// What [`import_layout`] chose and applied.
pub(crate) struct Chosen {
    /// `sha256:<hex>` of the manifest.
    pub manifest: String,
    /// `os/arch[/variant]` of the manifest, when its descriptor names one.
    pub platform: Option<String>,
    pub layers: u64,
}

/// The platform of this build's target, as OCI names it (`linux/amd64`).
pub fn host_platform() -> String {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" if cfg!(target_endian = "little") => "ppc64le",
        "loongarch64" => "loong64",
        a => a,
    };
    format!("linux/{arch}")
}

struct Layout<'a> {
    dir: &'a Path,
}

impl Layout<'_> {
    fn invalid(&self, what: impl std::fmt::Display) -> ImportError {
        ImportError::Invalid(format!("OCI layout {}: {what}", self.dir.display()))
    }

    /// The relative path of a blob, checked: sha256 only (its name is its
    /// digest, 64 lowercase hex digits: nothing else reaches the file system).
    fn blob_rel(&self, d: &Descriptor) -> Result<Vec<u8>, ImportError> {
        let digest = d.digest();
        if digest.algorithm().as_ref() != "sha256" {
            return Err(self.invalid(format!(
                "blob {digest} uses digest algorithm {}; this import reads sha256 blobs only",
                digest.algorithm()
            )));
        }
        let hex = digest.digest();
        if hex.len() != 64
            || !hex
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        {
            return Err(self.invalid(format!("blob digest {digest} is malformed")));
        }
        Ok(format!("blobs/sha256/{hex}").into_bytes())
    }

    fn open(&self, rel: &[u8], what: &'static str) -> Result<std::fs::File, ImportError> {
        fsx::open_read(self.dir, rel).map_err(|e| ImportError::Source {
            what,
            path: self.dir.join(std::str::from_utf8(rel).unwrap_or("?")),
            source: e,
        })
    }

    /// Reads blob `d` whole (a JSON document), checked against `d`.
    fn json_blob(&self, d: &Descriptor, what: &'static str) -> Result<Vec<u8>, ImportError> {
        let rel = self.blob_rel(d)?;
        if d.size() > MAX_JSON {
            return Err(self.invalid(format!(
                "{what} {} is {} bytes, over the {MAX_JSON}-byte limit of a JSON document",
                d.digest(),
                d.size()
            )));
        }
        let mut buf = Vec::new();
        self.open(&rel, what)?
            .take(MAX_JSON + 1)
            .read_to_end(&mut buf)
            .map_err(|e| ImportError::Source {
                what,
                path: self.dir.join(String::from_utf8_lossy(&rel).as_ref()),
                source: e,
            })?;
        self.check(
            d,
            buf.len() as u64,
            &format!("sha256:{:x}", Sha256::digest(&buf)),
            what,
        )?;
        Ok(buf)
    }

    /// Hashes blob `d` whole and compares it with `d`.
    fn verify_blob(&self, d: &Descriptor, what: &'static str) -> Result<(), ImportError> {
        let rel = self.blob_rel(d)?;
        // One byte past its size is enough to tell it is not that blob.
        let mut h = Hashing::new(self.open(&rel, what)?.take(d.size().saturating_add(1)));
        io::copy(&mut h, &mut io::sink()).map_err(|e| ImportError::Source {
            what,
            path: self.dir.join(String::from_utf8_lossy(&rel).as_ref()),
            source: e,
        })?;
        self.check(d, h.bytes, &h.digest(), what)
    }

    fn check(
        &self,
        d: &Descriptor,
        size: u64,
        digest: &str,
        what: &str,
    ) -> Result<(), ImportError> {
        if digest != d.digest().to_string() || size != d.size() {
            return Err(ImportError::Digest {
                what: format!("{what} {}", d.digest()),
                layout: self.dir.to_path_buf(),
                expected: format!("{} ({} bytes)", d.digest(), d.size()),
                found: format!("{digest} ({size} bytes)"),
            });
        }
        Ok(())
    }

    /// The image manifests the index lists, nested indexes followed.
    fn manifests(
        &self,
        index: &ImageIndex,
        depth: usize,
        out: &mut Vec<Descriptor>,
    ) -> Result<(), ImportError> {
        for d in index.manifests() {
            if is_index(d.media_type()) {
                if depth >= MAX_NESTING {
                    return Err(self.invalid(format!("indexes nest more than {MAX_NESTING} deep")));
                }
                let raw = self.json_blob(d, "index")?;
                let nested = ImageIndex::from_reader(raw.as_slice()).map_err(|e| {
                    self.invalid(format!("index {} does not parse: {e}", d.digest()))
                })?;
                self.manifests(&nested, depth + 1, out)?;
            } else {
                out.push(d.clone());
            }
        }
        Ok(())
    }
}

fn is_index(m: &MediaType) -> bool {
    match m {
        MediaType::ImageIndex => true,
        MediaType::Other(s) => s == "application/vnd.docker.distribution.manifest.list.v2+json",
        _ => false,
    }
}

/// `os/arch[/variant]` of a descriptor.
fn platform_of(d: &Descriptor) -> Option<String> {
    let p = d.platform().as_ref()?;
    let mut s = format!("{}/{}", p.os(), p.architecture());
    if let Some(v) = p.variant() {
        s.push('/');
        s.push_str(v);
    }
    Some(s)
}

/// Whether a manifest is a build attestation, not an image.
fn is_attestation(d: &Descriptor) -> bool {
    platform_of(d).is_some_and(|p| p.starts_with("unknown/"))
        || d.annotations().as_ref().is_some_and(|a| {
            a.get("vnd.docker.reference.type")
                .is_some_and(|t| t == "attestation-manifest")
        })
}

/// Whether `have` (`os/arch[/variant]`) is `want`; a `want` without a variant
/// matches any variant.
fn platform_matches(have: &str, want: &str) -> bool {
    have == want
        || have
            .strip_prefix(want)
            .is_some_and(|rest| rest.starts_with('/'))
}

fn describe(list: &[Descriptor]) -> String {
    list.iter()
        .map(|d| {
            format!(
                "{} ({})",
                d.digest(),
                platform_of(d).unwrap_or_else(|| "no platform".into())
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Chooses the manifest (see the module docs).
fn choose(
    layout: &Layout<'_>,
    all: Vec<Descriptor>,
    platform: Option<&str>,
) -> Result<Descriptor, ImportError> {
    let images: Vec<Descriptor> = all.into_iter().filter(|d| !is_attestation(d)).collect();
    if images.is_empty() {
        return Err(layout.invalid("its index lists no image manifest"));
    }
    let pick = |want: &str| -> Vec<Descriptor> {
        images
            .iter()
            .filter(|d| platform_of(d).is_some_and(|p| platform_matches(&p, want)))
            .cloned()
            .collect()
    };
    match platform {
        Some(want) => {
            let mut found = pick(want);
            match found.len() {
                1 => Ok(found.remove(0)),
                0 => Err(layout.invalid(format!(
                    "no manifest for platform {want}; it has {}",
                    describe(&images)
                ))),
                _ => Err(layout.invalid(format!(
                    "several manifests match platform {want}: {}; name the variant too (os/arch/variant)",
                    describe(&found)
                ))),
            }
        }
        None if images.len() == 1 => Ok(images[0].clone()),
        None => {
            let host = host_platform();
            let mut found = pick(&host);
            if found.len() == 1 {
                return Ok(found.remove(0));
            }
            Err(layout.invalid(format!(
                "it has {} manifests ({}) and {} for this host's platform {host}: choose one with --platform os/arch[/variant]",
                images.len(),
                describe(&images),
                if found.is_empty() { "none".to_string() } else { format!("{}", found.len()) }
            )))
        }
    }
}

/// Whether a layer's media type is a layer tar (OCI or Docker; compressed
/// or not: the bytes tell which).
fn is_layer(m: &MediaType) -> bool {
    match m {
        MediaType::ImageLayer
        | MediaType::ImageLayerGzip
        | MediaType::ImageLayerZstd
        | MediaType::ImageLayerNonDistributable
        | MediaType::ImageLayerNonDistributableGzip
        | MediaType::ImageLayerNonDistributableZstd => true,
        MediaType::Other(s) => {
            s.starts_with("application/vnd.docker.image.rootfs.")
                || s.starts_with("application/vnd.oci.image.layer.")
        }
        _ => false,
    }
}

/// Applies the chosen manifest's layers of the layout `dir` onto `stage`.
pub(crate) fn import_layout(
    dir: &Path,
    platform: Option<&str>,
    stage: &mut Stage,
) -> Result<Chosen, ImportError> {
    let layout = Layout { dir };
    let mut marker = Vec::new();
    layout
        .open(b"oci-layout", "the oci-layout file of")?
        .take(MAX_JSON)
        .read_to_end(&mut marker)
        .map_err(|e| ImportError::Source {
            what: "the oci-layout file",
            path: dir.join("oci-layout"),
            source: e,
        })?;
    let v: serde_json::Value = serde_json::from_slice(&marker)
        .map_err(|e| layout.invalid(format!("its oci-layout file does not parse: {e}")))?;
    match v.get("imageLayoutVersion").and_then(|v| v.as_str()) {
        Some(ver) if ver.starts_with("1.") => {}
        other => {
            return Err(layout.invalid(format!(
            "its oci-layout file names imageLayoutVersion {other:?}; this import reads version 1.x"
        )))
        }
    }
    let mut raw = Vec::new();
    layout
        .open(b"index.json", "the index.json of")?
        .take(MAX_JSON + 1)
        .read_to_end(&mut raw)
        .map_err(|e| ImportError::Source {
            what: "the index",
            path: dir.join("index.json"),
            source: e,
        })?;
    let index = ImageIndex::from_reader(raw.as_slice())
        .map_err(|e| layout.invalid(format!("its index.json does not parse: {e}")))?;
    let mut all = Vec::new();
    layout.manifests(&index, 0, &mut all)?;
    let chosen = choose(&layout, all, platform)?;
    let raw = layout.json_blob(&chosen, "manifest")?;
    let manifest = ImageManifest::from_reader(raw.as_slice())
        .map_err(|e| layout.invalid(format!("manifest {} does not parse: {e}", chosen.digest())))?;
    // The config's diff IDs, when it lists them (read leniently: only
    // rootfs.diff_ids matters here).
    let config = layout.json_blob(manifest.config(), "config")?;
    let diff_ids: Option<Vec<String>> = serde_json::from_slice::<serde_json::Value>(&config)
        .ok()
        .and_then(|v| {
            v.get("rootfs")?
                .get("diff_ids")?
                .as_array()?
                .iter()
                .map(|x| x.as_str().map(str::to_string))
                .collect()
        });
    let layers = manifest.layers();
    if let Some(ids) = &diff_ids {
        if ids.len() != layers.len() {
            return Err(layout.invalid(format!(
                "manifest {} lists {} layers, its config {} diff IDs",
                chosen.digest(),
                layers.len(),
                ids.len()
            )));
        }
    }
    for (i, d) in layers.iter().enumerate() {
        let origin = format!(
            "layer {}/{} ({}) of {}",
            i + 1,
            layers.len(),
            d.digest(),
            dir.display()
        );
        if !is_layer(d.media_type()) {
            return Err(ImportError::Invalid(format!(
                "{origin} has media type {}, which is not a layer tar",
                d.media_type()
            )));
        }
        layout.verify_blob(d, "layer blob")?;
        let rel = layout.blob_rel(d)?;
        let mut r = io::BufReader::with_capacity(256 * 1024, layout.open(&rel, "layer blob")?);
        let c = sniff(&mut r, &origin)?;
        let mut tar = Hashing::new(decompressed(r, c).map_err(|e| ImportError::Archive {
            origin: origin.clone(),
            after: None,
            source: e,
        })?);
        if i > 0 {
            stage.next_layer();
        }
        apply(
            &mut tar,
            stage,
            &ApplyOptions {
                origin: &origin,
                refuse_layout: false,
                shift: None,
            },
        )?;
        if let Some(ids) = &diff_ids {
            let found = tar.digest();
            if found != ids[i] {
                return Err(ImportError::Digest {
                    what: format!("the uncompressed {origin}"),
                    layout: dir.to_path_buf(),
                    expected: format!("{} (the config's diff ID)", ids[i]),
                    found,
                });
            }
        }
    }
    Ok(Chosen {
        manifest: chosen.digest().to_string(),
        platform: platform_of(&chosen),
        layers: layers.len() as u64,
    })
}

/// A reader that hashes (sha256) and counts what passes through it.
pub(super) struct Hashing<R> {
    inner: R,
    hash: Sha256,
    pub(super) bytes: u64,
}

impl<R: Read> Hashing<R> {
    pub(super) fn new(inner: R) -> Self {
        Self {
            inner,
            hash: Sha256::new(),
            bytes: 0,
        }
    }

    pub(super) fn digest(&self) -> String {
        format!("sha256:{:x}", self.hash.clone().finalize())
    }
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::platform_matches;

    #[test]
    fn platforms_match_with_or_without_a_variant() {
        assert!(platform_matches("linux/amd64", "linux/amd64"));
        assert!(platform_matches("linux/arm64/v8", "linux/arm64"));
        assert!(!platform_matches("linux/arm64/v8", "linux/arm"));
        assert!(!platform_matches("linux/arm/v7", "linux/arm/v6"));
    }
}
