//! `layerstack export`: a branch head or a graph node as a standard OCI image
//! layout (OCI image-spec `image-layout.md`), which `ctr images import` (as a tar
//! of the directory), skopeo or any registry client takes.
//!
//! The daemon streams each layer's compressed blob with its digest and diff ID
//! (admin RPC `Export`, holding an export lease meanwhile); this side writes
//! `blobs/sha256/<hex>` (verifying each digest over the bytes received), the
//! image config, the manifest, `index.json` (last: a layout without it is
//! incomplete) and `oci-layout`. `--since LAYER` leaves out the blobs of that
//! layer and every layer below it — what a registry that already has the
//! earlier export holds; the manifest and config still list every layer. A
//! member of a squashed layer leaves out the layers below that squash (the
//! squash's blob is new). A failed export removes what it wrote.
//!
//! The image config ([`image_config`]) is the stack's base image's, as the
//! daemon read it from containerd (`ExportPlan.base_config`), with this
//! export's `rootfs` and `history`: the runtime config (`Env`, `Entrypoint`,
//! `Cmd`, `WorkingDir`, `User`, `ExposedPorts`, `Volumes`, `Labels`,
//! `StopSignal`), `architecture`, `os`, `os.version`, `os.features` and
//! `variant` carry over (OCI image-spec `config.md`). When containerd no longer
//! has the base image, the export still completes, with a warning on stderr:
//! the runtime config is defaulted (`Env` PATH only, no command) and the base
//! layers are re-packed. A base layer whose original blob containerd still has
//! is that blob (same digest, media type and size), so the manifest's layer
//! descriptors can carry several media types; `--compression` applies to the
//! re-packed layers.

use std::collections::HashMap;
use std::fs;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::str::FromStr;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use layerstack_api as api;
use oci_spec::image as oci;
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::out;
use layerstack_registry::image::{canonical_json, config_layer, image_config, DEFAULT_PATH};

#[derive(Debug, Clone, Args)]
pub struct ExportArgs {
    /// STACK[@BRANCH]: an image reference, stack id or base digest, and the
    /// branch whose head to export [default: the default branch].
    #[arg(required_unless_present = "node", conflicts_with = "node")]
    pub stack: Option<String>,
    /// Export this graph node's tree instead of a branch head.
    #[arg(long, value_name = "ID")]
    pub node: Option<String>,
    /// The directory to write the OCI image layout into (must be empty or
    /// missing). `tar -C DIR -cf image.tar .` makes an archive for `ctr images
    /// import`.
    #[arg(long, value_name = "DIR")]
    pub oci_layout: PathBuf,
    /// Layer blob compression: gzip or zstd.
    #[arg(long, default_value = "gzip", value_parser = ["gzip", "zstd"])]
    pub compression: String,
    /// The image name: a full reference (`example.com/agents/task:step-42`)
    /// becomes annotation io.containerd.image.name and its tag
    /// org.opencontainers.image.ref.name; a bare tag (`step-42`) only the latter.
    /// `ctr images import` names the image by it.
    #[arg(long, value_name = "NAME")]
    pub tag: Option<String>,
    /// Only write the blobs of layers above LAYER (a layer id from `layerstack
    /// log`, or a base layer's): what a registry holding an earlier export lacks.
    /// The manifest still lists every layer. A member of a squashed layer (as
    /// `layerstack log` lists it) means everything above that point: the blobs
    /// of the layers below the squash are left out, the squash's own is written
    /// (it is a new blob, holding that member's changes and the ones after it).
    #[arg(long, value_name = "LAYER")]
    pub since: Option<i64>,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Removes what a failed export wrote (the directory itself if it made it).
struct Cleanup {
    dir: PathBuf,
    made_dir: bool,
    armed: bool,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if self.made_dir {
            let _ = fs::remove_dir_all(&self.dir);
        } else if let Ok(rd) = fs::read_dir(&self.dir) {
            for e in rd.flatten() {
                let p = e.path();
                if p.is_dir() {
                    let _ = fs::remove_dir_all(&p);
                } else {
                    let _ = fs::remove_file(&p);
                }
            }
        }
    }
}

/// Checks that `dir` is missing or an empty directory and creates it with
/// `blobs/sha256`.
fn prepare_dir(dir: &Path) -> Result<Cleanup> {
    let made_dir = match fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => {
            let mut rd =
                fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))?;
            if rd.next().is_some() {
                bail!(
                    "{} is not empty: export writes a new OCI image layout; name an empty or missing directory",
                    dir.display()
                );
            }
            false
        }
        Ok(_) => bail!(
            "{} exists and is not a directory: name an empty or missing directory for the OCI image layout",
            dir.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Err(e) => return Err(e).with_context(|| format!("cannot inspect {}", dir.display())),
    };
    // Armed before the first mkdir: a directory made before a full disk
    // refused the next one goes too.
    let cleanup = Cleanup {
        dir: dir.to_path_buf(),
        made_dir,
        armed: true,
    };
    let blobs = dir.join("blobs").join("sha256");
    fs::create_dir_all(&blobs).with_context(|| format!("cannot create {}", blobs.display()))?;
    Ok(cleanup)
}

fn sha256_hex(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

/// Writes `bytes` as a blob; returns its descriptor digest `sha256:<hex>`.
fn write_blob(dir: &Path, bytes: &[u8]) -> Result<String> {
    let hex = sha256_hex(bytes);
    let p = dir.join("blobs").join("sha256").join(&hex);
    fs::write(&p, bytes).with_context(|| format!("cannot write {}", p.display()))?;
    Ok(format!("sha256:{hex}"))
}

fn digest(s: &str) -> Result<oci::Digest> {
    oci::Digest::from_str(s).with_context(|| format!("the daemon sent a malformed digest {s:?}"))
}

/// The index annotations for `--tag NAME` (see [`ExportArgs::tag`]).
fn tag_annotations(tag: &str) -> Result<HashMap<String, String>> {
    ensure!(
        !tag.is_empty() && !tag.chars().any(char::is_whitespace),
        "--tag {tag:?}: name a reference like example.com/repo:tag, or a bare tag"
    );
    let mut a = HashMap::new();
    if tag.contains('/') || tag.contains(':') {
        let last = tag.rsplit('/').next().unwrap_or(tag);
        let (full, t) = match last.split_once(':') {
            Some((_, t)) => (tag.to_string(), t.to_string()),
            None => (format!("{tag}:latest"), "latest".to_string()),
        };
        a.insert("io.containerd.image.name".to_string(), full);
        a.insert(oci::ANNOTATION_REF_NAME.to_string(), t);
    } else {
        a.insert(oci::ANNOTATION_REF_NAME.to_string(), tag.to_string());
    }
    Ok(a)
}

/// The base image's config from the plan, or why there is none (the warning's
/// reason).
fn base_config(plan: &api::ExportPlan) -> Result<oci::ImageConfiguration, String> {
    if plan.base_config.is_empty() {
        return Err(if plan.base_missing.is_empty() {
            "the daemon sent no base image config".to_string()
        } else {
            plan.base_missing.clone()
        });
    }
    oci::ImageConfiguration::from_reader(plan.base_config.as_slice()).map_err(|e| {
        format!(
            "the config of base image {} does not parse: {e}",
            plan.base_image
        )
    })
}

/// One layer as received.
struct Received {
    done: api::ExportBlobDone,
}

/// Runs `layerstack export`. A write of the layout that fails for lack of
/// space (ENOSPC, EDQUOT) ends with error kind `no_space` naming the
/// directory's full filesystem and what to do; what the export wrote is
/// removed by then.
pub async fn run(admin: &Path, ns: &str, a: ExportArgs) -> Result<ExitCode> {
    let dir = a.oci_layout.clone();
    export(admin, ns, a).await.map_err(|e| {
        if api::types::is_no_space(e.as_ref()) {
            crate::errors::failure(
                api::ErrorKind::NoSpace,
                format!(
                    "{}: no space left on device (the filesystem holding {} is full): the export wrote nothing there (what it had written was removed); free space on it or name a directory on another filesystem, then export again",
                    api::error_chain(e.as_ref()),
                    dir.display()
                ),
            )
        } else {
            e
        }
    })
}

async fn export(admin: &Path, ns: &str, a: ExportArgs) -> Result<ExitCode> {
    let annotations = a.tag.as_deref().map(tag_annotations).transpose()?;
    let (image, branch) = match &a.stack {
        Some(s) => crate::history::split_branch(s),
        None => (String::new(), String::new()),
    };
    let mut c = crate::connect(admin).await?;
    let dir = a.oci_layout.clone();
    let mut cleanup = prepare_dir(&dir)?;
    let mut stream = c
        .export(api::ExportRequest {
            namespace: ns.to_string(),
            image,
            branch,
            node: a.node.clone().unwrap_or_default(),
            compression: a.compression.clone(),
            since_layer: a.since.unwrap_or(0),
        })
        .await?
        .into_inner();
    let plan = match stream.message().await?.and_then(|r| r.reply) {
        Some(api::export_reply::Reply::Plan(p)) => p,
        other => bail!("the daemon answered the export without a plan: {other:?}"),
    };
    let n = plan.layers.len();
    let bar = if std::io::stderr().is_terminal() {
        let b = ProgressBar::new_spinner();
        b.set_style(
            ProgressStyle::with_template(
                "{spinner} {msg}: {bytes} received ({bytes_per_sec}, {elapsed})",
            )
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        b.enable_steady_tick(std::time::Duration::from_millis(120));
        b
    } else {
        ProgressBar::hidden()
    };
    let label = |i: usize| {
        let l = &plan.layers[i];
        format!(
            "layer {}/{n} ({} {}){}",
            i + 1,
            l.kind,
            l.layer,
            if l.omitted {
                ", omitted: digests only"
            } else {
                ""
            }
        )
    };
    let blobs = dir.join("blobs").join("sha256");
    let mut received: Vec<Received> = Vec::with_capacity(n);
    let mut current: Option<(fs::File, PathBuf, Sha256, u64)> = None;
    if n > 0 {
        bar.set_message(label(0));
    }
    while let Some(r) = stream.message().await? {
        match r.reply {
            Some(api::export_reply::Reply::Chunk(data)) => {
                if current.is_none() {
                    let p = blobs.join(format!(".partial-{}", received.len()));
                    let f = fs::File::create(&p)
                        .with_context(|| format!("cannot create {}", p.display()))?;
                    current = Some((f, p, Sha256::new(), 0));
                }
                if let Some((f, p, h, size)) = current.as_mut() {
                    f.write_all(&data)
                        .with_context(|| format!("cannot write {}", p.display()))?;
                    h.update(&data);
                    *size += data.len() as u64;
                }
                bar.inc(data.len() as u64);
            }
            Some(api::export_reply::Reply::Done(d)) => {
                ensure!(
                    d.index as usize == received.len() && received.len() < n,
                    "the daemon sent layer {} out of order (expected {})",
                    d.index,
                    received.len()
                );
                let got = current.take();
                if d.omitted {
                    ensure!(
                        got.is_none(),
                        "the daemon sent a blob for omitted layer {}",
                        d.index
                    );
                } else {
                    // An empty blob never happens (a tar has at least its end blocks).
                    let (f, p, h, size) =
                        got.with_context(|| format!("no blob received for layer {}", d.index))?;
                    f.sync_all()
                        .with_context(|| format!("cannot sync {}", p.display()))?;
                    let hex = format!("{:x}", h.finalize());
                    ensure!(
                        d.digest == format!("sha256:{hex}") && d.size == size,
                        "layer {}: received {size} bytes with digest sha256:{hex}, the daemon announced {} bytes with {}",
                        d.index,
                        d.size,
                        d.digest
                    );
                    let dst = blobs.join(&hex);
                    fs::rename(&p, &dst).with_context(|| {
                        format!("cannot rename {} to {}", p.display(), dst.display())
                    })?;
                }
                received.push(Received { done: d });
                if received.len() < n {
                    bar.set_message(label(received.len()));
                }
            }
            Some(api::export_reply::Reply::Plan(_)) | None => {
                bail!("the daemon sent a second plan")
            }
        }
    }
    bar.finish_and_clear();
    ensure!(
        received.len() == n,
        "the export stream ended after {} of {n} layers",
        received.len()
    );

    // The image config: the base image's runtime config and platform, this
    // export's diff IDs and history.
    let base = base_config(&plan);
    if base.is_err() && plan.stack.starts_with(api::types::IMPORT_STACK_PREFIX) {
        // No image ever existed: nothing is missing, nothing to warn about.
        eprintln!(
            "layerstack: stack {} has an imported base (layerstack base import), which has no image config: the exported image's runtime config is Env {DEFAULT_PATH} alone, with no command (name one when running it)",
            plan.stack
        );
    } else if let Err(why) = &base {
        let named = match &a.stack {
            Some(s) if *s != plan.stack && !s.starts_with(&format!("{}@", plan.stack)) => {
                format!("{s} (stack {})", plan.stack)
            }
            _ => format!("stack {}", plan.stack),
        };
        eprintln!(
            "layerstack: warning: the base image of {named} (top layer chainID {}) is not available from containerd: {why}. \
             The exported image's runtime config (Entrypoint, Cmd, Env, WorkingDir, User, ExposedPorts, Volumes, Labels, StopSignal) is defaulted \
             (Env {DEFAULT_PATH}, no command: name one when running it) and its base layers are re-packed (new digests). \
             Import or pull the base image again to carry them over.",
            plan.base_digest
        );
    }
    let diff_ids: Vec<String> = received.iter().map(|r| r.done.diff_id.clone()).collect();
    let cfg = image_config(
        base.as_ref().ok(),
        &plan.stack,
        &plan
            .layers
            .iter()
            .map(|l| config_layer(&l.kind, l.layer, l.session, l.created_ns))
            .collect::<Vec<_>>(),
        diff_ids,
    )?;
    let cfg_bytes = canonical_json(&cfg).context("the image config")?;
    let cfg_digest = write_blob(&dir, &cfg_bytes)?;
    let mut layers = Vec::with_capacity(n);
    for (l, r) in plan.layers.iter().zip(&received) {
        let media = if l.media_type.is_empty() {
            &plan.media_type
        } else {
            &l.media_type
        };
        layers.push(oci::Descriptor::new(
            oci::MediaType::from(media.as_str()),
            r.done.size,
            digest(&r.done.digest)?,
        ));
    }
    let manifest = oci::ImageManifestBuilder::default()
        .schema_version(2u32)
        .media_type(oci::MediaType::ImageManifest)
        .config(oci::Descriptor::new(
            oci::MediaType::ImageConfig,
            cfg_bytes.len() as u64,
            digest(&cfg_digest)?,
        ))
        .layers(layers)
        .build()
        .context("building the manifest")?;
    let manifest_bytes = manifest.to_string().context("serializing the manifest")?;
    let manifest_digest = write_blob(&dir, manifest_bytes.as_bytes())?;
    let mut mdesc = oci::Descriptor::new(
        oci::MediaType::ImageManifest,
        manifest_bytes.len() as u64,
        digest(&manifest_digest)?,
    );
    let mut platform = oci::PlatformBuilder::default()
        .architecture(cfg.architecture().clone())
        .os(cfg.os().clone())
        .build()
        .context("building the platform")?;
    platform.set_variant(cfg.variant().clone());
    platform.set_os_version(cfg.os_version().clone());
    platform.set_os_features(cfg.os_features().clone());
    mdesc.set_platform(Some(platform));
    mdesc.set_annotations(annotations.clone());
    let layout = oci::OciLayoutBuilder::default()
        .image_layout_version("1.0.0")
        .build()
        .context("building oci-layout")?;
    let layout_path = dir.join("oci-layout");
    fs::write(
        &layout_path,
        layout.to_string().context("serializing oci-layout")?,
    )
    .with_context(|| format!("cannot write {}", layout_path.display()))?;
    let index = oci::ImageIndexBuilder::default()
        .schema_version(2u32)
        .media_type(oci::MediaType::ImageIndex)
        .manifests(vec![mdesc])
        .build()
        .context("building index.json")?;
    let index_path = dir.join("index.json");
    fs::write(
        &index_path,
        index.to_string().context("serializing index.json")?,
    )
    .with_context(|| format!("cannot write {}", index_path.display()))?;
    cleanup.armed = false;

    let written = received.iter().filter(|r| !r.done.omitted).count();
    let copied = plan
        .layers
        .iter()
        .zip(&received)
        .filter(|(l, r)| l.source == "containerd" && !r.done.omitted)
        .count();
    let what = if plan.node.is_empty() {
        format!("{}@{}", plan.stack, plan.branch)
    } else {
        format!("node {}", plan.node)
    };
    if a.json {
        let v = json!({
            "stack": plan.stack, "branch": plan.branch, "node": plan.node,
            "manifest_id": plan.manifest,
            "oci_layout": dir.display().to_string(),
            "manifest": manifest_digest, "config": cfg_digest,
            "compression": plan.compression,
            "tag": a.tag,
            "base_image": plan.base_image, "base_manifest": plan.base_manifest,
            "base_digest": plan.base_digest,
            "base_config": base.is_ok(),
            "layers": plan.layers.iter().zip(&received).map(|(l, r)| json!({
                "layer": l.layer, "kind": l.kind, "digest": r.done.digest,
                "diff_id": r.done.diff_id, "size": r.done.size,
                "uncompressed_size": r.done.uncompressed_size, "omitted": r.done.omitted,
                "source": l.source, "media_type": l.media_type,
            })).collect::<Vec<_>>(),
        });
        out!("{v}");
    } else {
        out!(
            "exported {what} (manifest {}) to {}: {n} layers, {written} blobs written{}{}; image manifest {manifest_digest}",
            plan.manifest,
            dir.display(),
            if copied > 0 {
                format!(" ({copied} copied from base image {})", plan.base_image)
            } else {
                String::new()
            },
            if written < n {
                format!(", {} omitted (--since {})", n - written, a.since.unwrap_or(0))
            } else {
                String::new()
            }
        );
    }
    if a.tag.is_none() && !a.json {
        eprintln!(
            "layerstack: no --tag: the image has no name; give --tag example.com/repo:tag, or import it with `ctr images import --digests`"
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::Value;

    #[test]
    fn tags_become_the_annotations_ctr_import_reads() {
        let a = tag_annotations("example.com/agents/task:step-42").unwrap();
        assert_eq!(
            a["io.containerd.image.name"],
            "example.com/agents/task:step-42"
        );
        assert_eq!(a[oci::ANNOTATION_REF_NAME], "step-42");
        let a = tag_annotations("localhost:5000/task").unwrap();
        assert_eq!(a["io.containerd.image.name"], "localhost:5000/task:latest");
        let a = tag_annotations("step-42").unwrap();
        assert_eq!(a.len(), 1);
        assert_eq!(a[oci::ANNOTATION_REF_NAME], "step-42");
        assert!(tag_annotations("a b").is_err());
    }

    #[test]
    fn a_non_empty_directory_is_refused_and_left_alone() {
        let t = tempfile::tempdir().unwrap();
        fs::write(t.path().join("keep"), b"x").unwrap();
        let e = prepare_dir(t.path()).err().unwrap();
        assert!(e.to_string().contains("is not empty"), "{e}");
        assert!(t.path().join("keep").exists());
        // A missing directory is created, and removed again by a failed export.
        let d = t.path().join("new");
        let c = prepare_dir(&d).unwrap();
        assert!(d.join("blobs/sha256").is_dir());
        drop(c);
        assert!(!d.exists());
    }

    /// A base image config as a registry serves one (OCI image-spec
    /// `config.md`): every runtime field, a platform variant, and a history
    /// with `empty_layer` entries.
    const BASE_CONFIG: &str = r#"{
        "created": "2024-01-01T00:00:00Z", "author": "someone else",
        "architecture": "arm64", "variant": "v8", "os": "linux",
        "config": {
            "User": "65534:65534",
            "ExposedPorts": {"8080/tcp": {}, "53/udp": {}},
            "Env": ["PATH=/usr/bin:/bin", "GREETING=hello"],
            "Entrypoint": ["/bin/sh", "-c"],
            "Cmd": ["echo $GREETING"],
            "Volumes": {"/data": {}, "/cache": {}},
            "WorkingDir": "/work",
            "Labels": {"a": "1", "b": "2", "c": "3", "d": "4"},
            "StopSignal": "SIGINT"
        },
        "rootfs": {"type": "layers", "diff_ids": ["sha256:aa", "sha256:bb"]},
        "history": [
            {"created_by": "ADD rootfs"},
            {"created_by": "ENV GREETING=hello", "empty_layer": true},
            {"created_by": "COPY work"}
        ]
    }"#;

    fn layer(id: i64, kind: &str, created_ns: i64) -> api::ExportLayer {
        api::ExportLayer {
            layer: id,
            kind: kind.to_string(),
            created_ns,
            ..Default::default()
        }
    }

    fn cl(l: &[api::ExportLayer]) -> Vec<layerstack_registry::image::ConfigLayer> {
        l.iter()
            .map(|l| config_layer(&l.kind, l.layer, l.session, l.created_ns))
            .collect()
    }

    fn layers() -> Vec<api::ExportLayer> {
        vec![
            layer(1, "base", 10),
            layer(2, "base", 20),
            layer(7, "published", 3_000_000_000),
        ]
    }

    fn diff_ids() -> Vec<String> {
        ["sha256:aa", "sha256:bb", "sha256:cc"]
            .map(String::from)
            .to_vec()
    }

    #[test]
    fn the_base_images_runtime_config_and_platform_carry_over() {
        let base = oci::ImageConfiguration::from_reader(BASE_CONFIG.as_bytes()).unwrap();
        let cfg = image_config(Some(&base), "ns/sha256:x", &cl(&layers()), diff_ids()).unwrap();
        // Runtime config and platform: the base's, field for field.
        assert_eq!(cfg.config(), base.config());
        let c = cfg.config().as_ref().unwrap();
        assert_eq!(
            c.entrypoint().as_deref(),
            Some(&["/bin/sh".to_string(), "-c".to_string()][..])
        );
        assert_eq!(
            c.cmd().as_deref(),
            Some(&["echo $GREETING".to_string()][..])
        );
        assert_eq!(c.working_dir().as_deref(), Some("/work"));
        assert_eq!(c.user().as_deref(), Some("65534:65534"));
        assert_eq!(c.stop_signal().as_deref(), Some("SIGINT"));
        assert_eq!(*cfg.architecture(), oci::Arch::ARM64);
        assert_eq!(cfg.variant().as_deref(), Some("v8"));
        assert_eq!(*cfg.os(), oci::Os::Linux);
        // Rootfs, history and time: this export's.
        assert_eq!(cfg.rootfs().diff_ids(), &diff_ids());
        let h = cfg.history().as_ref().unwrap();
        let by: Vec<_> = h.iter().map(|e| e.created_by().clone().unwrap()).collect();
        assert_eq!(
            by,
            [
                "ADD rootfs",
                "ENV GREETING=hello",
                "COPY work",
                "layerstack: layer 7 published by session 0"
            ]
        );
        assert_eq!(cfg.created().as_deref(), Some("1970-01-01T00:00:03Z"));
        assert_eq!(*cfg.author(), None);

        // The bytes are canonical: the same whatever order the hash maps
        // (ports, volumes, labels) iterate in, and what `ctr` reads back.
        let bytes = canonical_json(&cfg).unwrap();
        for _ in 0..8 {
            let again = oci::ImageConfiguration::from_reader(BASE_CONFIG.as_bytes()).unwrap();
            let cfg2 =
                image_config(Some(&again), "ns/sha256:x", &cl(&layers()), diff_ids()).unwrap();
            assert_eq!(canonical_json(&cfg2).unwrap(), bytes);
        }
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        let base_v: Value = serde_json::from_str(BASE_CONFIG).unwrap();
        assert_eq!(v["config"], base_v["config"], "the runtime config as JSON");
        assert_eq!(v["variant"], "v8");
    }

    #[test]
    fn without_the_base_image_the_runtime_config_is_defaulted() {
        let cfg = image_config(None, "ns/sha256:x", &cl(&layers()), diff_ids()).unwrap();
        let c = cfg.config().as_ref().unwrap();
        assert_eq!(c.env().as_deref(), Some(&[DEFAULT_PATH.to_string()][..]));
        assert_eq!(
            (c.cmd(), c.entrypoint(), c.working_dir()),
            (&None, &None, &None)
        );
        assert_eq!(*cfg.architecture(), layerstack_registry::image::arch());
        let h = cfg.history().as_ref().unwrap();
        assert_eq!(h.len(), 3);
        assert_eq!(
            h[0].created_by().as_deref(),
            Some("layerstack: base layer 1 of stack ns/sha256:x")
        );
        // A base history that does not match the base layers is not used.
        let mut base = oci::ImageConfiguration::from_reader(BASE_CONFIG.as_bytes()).unwrap();
        base.set_history(Some(vec![oci::History::default()]));
        let cfg = image_config(Some(&base), "ns/sha256:x", &cl(&layers()), diff_ids()).unwrap();
        assert_eq!(cfg.history().as_ref().unwrap().len(), 3);
        assert_eq!(cfg.config(), base.config());
        // Diff IDs must be one per layer.
        assert!(image_config(None, "s", &cl(&layers()), vec![]).is_err());
    }

    #[test]
    fn the_plans_base_config_or_why_not() {
        let mut plan = api::ExportPlan {
            base_missing: "containerd namespace \"x\" has no image".into(),
            ..Default::default()
        };
        assert!(base_config(&plan).unwrap_err().contains("has no image"));
        plan.base_config = b"{not json".to_vec();
        plan.base_image = "example.com/base:1".into();
        let e = base_config(&plan).unwrap_err();
        assert!(
            e.contains("example.com/base:1") && e.contains("does not parse"),
            "{e}"
        );
        plan.base_config = BASE_CONFIG.as_bytes().to_vec();
        assert_eq!(
            *base_config(&plan).unwrap().architecture(),
            oci::Arch::ARM64
        );
    }
}
