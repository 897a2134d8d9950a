//! OCI export (issue 13): a branch head exported with `layerstack export`,
//! packed as a tar, imported with `ctr images import` and run on containerd's
//! **overlayfs** snapshotter shows the same tree as a container on the branch
//! head — compared as a list of every path with its type, mode, owner, link
//! target and sha256 — with edits, a deleted directory, an opaque directory, a
//! non-UTF-8 name, a hardlink pair, a path longer than 100 bytes, a fifo and a
//! user xattr; `--since` leaves out exactly the blobs below a layer and names the
//! same blobs as a full export; a graph node exports the tree it pinned; bad
//! input is refused with what to do. The exported image keeps its base image's
//! runtime config and platform (OCI image-spec `config.md`) and ships the base
//! image's own layer blobs (same digests) while containerd has them — `ctr
//! run` without a command runs the base's Entrypoint/Cmd as its User in its
//! WorkingDir with its Env — and, once the base image is gone from containerd,
//! still exports, with a warning, a defaulted config and re-packed base layers.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use layerstack_integration::{
    busybox_image_tar, configured_image_tar, debian_image_tar, describe, image_top_snapshot,
    ls_wait_ok, publish_policy_label, publish_snapshot, run_layerstack_scenario, run_scenario,
    run_sh, run_with_timeout, start_daemon_and_import, unique, CtrRun, TestEnv, BUSYBOX_IMAGE,
    CMD_TIMEOUT, CONFIGURED_IMAGE, SNAPSHOTTER,
};
use serde_json::Value;

const OVERLAYFS: &str = "overlayfs";

/// Every path of the container's root filesystem (this mount only), one line
/// each: type, mode, uid:gid, path, link target; then every regular file's
/// sha256. Sorted bytewise (names are printed as the raw bytes they are).
const TREE_LIST: &str = "find / -xdev -printf '%y %m %U:%G %p -> %l\\n' | LC_ALL=C sort; \
    find / -xdev -type f -links +1 -printf 'links %n %p\\n' | LC_ALL=C sort; \
    find / -xdev -type f -print0 | xargs -0 sha256sum | LC_ALL=C sort";

/// The changes the first container publishes (through the task-delete path).
const FIRST: &str = r#"set -e
echo edited >> /etc/motd
rm -rf /usr/share/doc
rm -rf /var/lib/apt && mkdir -p /var/lib/apt && echo fresh > /var/lib/apt/fresh
mkdir -p /srv/x
printf 'latin-1 name\n' > "/srv/x/$(printf 'caf\351')"
echo linked > /srv/a && ln /srv/a /srv/b && chown 1234:5678 /srv/a && chmod 0640 /srv/a
long=/srv/$(printf 'd%.0s' $(seq 1 70))/$(printf 'e%.0s' $(seq 1 70))
mkdir -p "$long" && echo deep > "$long/f" && ln -s "$long/f" /srv/to-deep
ln -s /etc/motd /srv/link
mkfifo /srv/fifo
"#;

/// The second container: a whiteout of a file and a link the first one made,
/// and more content.
const SECOND: &str = r#"set -e
echo second > /srv/second
rm /srv/link /srv/x/*
echo again >> /etc/motd
"#;

fn ls_json(env: &TestEnv, ns: &str, args: &[&str]) -> Result<Value> {
    let mut a = vec!["-n", ns];
    a.extend_from_slice(args);
    let out = env.layerstack(&a)?;
    ensure!(out.status.success(), "layerstack {a:?}: {}", describe(&out));
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("layerstack {a:?}: {}", describe(&out)))
}

fn stack_id(env: &TestEnv, ns: &str) -> Result<String> {
    let v = ls_json(env, ns, &["stack", "ls", "--json"])?;
    v.as_array()
        .and_then(|a| a.first())
        .and_then(|s| s["id"].as_str())
        .map(String::from)
        .with_context(|| format!("no stack in {ns}: {v}"))
}

/// `layerstack export` into `dir` with `extra` flags; the `--json` result.
fn export(env: &TestEnv, ns: &str, spec: &str, dir: &Path, extra: &[&str]) -> Result<Value> {
    let d = dir.to_string_lossy();
    let mut a = vec!["export"];
    if !spec.is_empty() {
        a.push(spec);
    }
    a.extend(["--oci-layout", &d, "--json"]);
    a.extend_from_slice(extra);
    ls_json(env, ns, &a)
}

/// A tar of the layout directory, as `ctr images import` takes it.
fn pack(dir: &Path) -> Result<PathBuf> {
    let tar = dir.with_extension("tar");
    let out = run_with_timeout(
        std::process::Command::new("tar")
            .arg("-C")
            .arg(dir)
            .arg("-cf")
            .arg(&tar)
            .arg("."),
        CMD_TIMEOUT,
    )?;
    ensure!(out.status.success(), "tar: {}", describe(&out));
    Ok(tar)
}

fn read_json(p: &Path) -> Result<Value> {
    serde_json::from_slice(&std::fs::read(p).with_context(|| format!("reading {}", p.display()))?)
        .with_context(|| format!("parsing {}", p.display()))
}

fn blob(dir: &Path, digest: &str) -> PathBuf {
    dir.join("blobs")
        .join("sha256")
        .join(digest.trim_start_matches("sha256:"))
}

/// The manifest of the layout's only image.
fn manifest(dir: &Path) -> Result<Value> {
    let index = read_json(&dir.join("index.json"))?;
    let d = index["manifests"][0]["digest"]
        .as_str()
        .with_context(|| format!("index.json: {index}"))?;
    read_json(&blob(dir, d))
}

/// The image config of the layout's only image.
fn config(dir: &Path) -> Result<Value> {
    let m = manifest(dir)?;
    read_json(&blob(
        dir,
        m["config"]["digest"]
            .as_str()
            .with_context(|| format!("manifest without config: {m}"))?,
    ))
}

/// Member `name` of the tar `tar`.
fn tar_member(tar: &Path, name: &str) -> Result<Vec<u8>> {
    let out = run_with_timeout(
        std::process::Command::new("tar")
            .arg("-xOf")
            .arg(tar)
            .arg(name),
        CMD_TIMEOUT,
    )?;
    ensure!(out.status.success(), "tar -xOf {name}: {}", describe(&out));
    Ok(out.stdout)
}

/// The manifest digest, manifest and config of the only image of the OCI
/// archive `tar` (a fixture, as `ctr images import` reads it).
fn archive_image(tar: &Path) -> Result<(String, Value, Value)> {
    let member = |digest: &Value| -> Result<Value> {
        let d = digest.as_str().context("digest")?;
        let path = format!("blobs/sha256/{}", d.trim_start_matches("sha256:"));
        Ok(serde_json::from_slice(&tar_member(tar, &path)?)?)
    };
    let index: Value = serde_json::from_slice(&tar_member(tar, "index.json")?)?;
    let digest = &index["manifests"][0]["digest"];
    let m = member(digest)?;
    let c = member(&m["config"]["digest"])?;
    Ok((digest.as_str().unwrap_or_default().to_string(), m, c))
}

/// The runtime-config fields a test compares between a base and an export.
const RUNTIME_FIELDS: [&str; 9] = [
    "Env",
    "Entrypoint",
    "Cmd",
    "WorkingDir",
    "User",
    "ExposedPorts",
    "Volumes",
    "Labels",
    "StopSignal",
];

fn lines(b: &[u8]) -> Vec<&[u8]> {
    b.split(|&c| c == b'\n').filter(|l| !l.is_empty()).collect()
}

fn has_line(list: &[&[u8]], needle: &[u8]) -> bool {
    list.iter()
        .any(|l| l.windows(needle.len()).any(|w| w == needle))
}

/// The regular file `rel` (raw bytes) in each of containerd's overlayfs
/// snapshot directories that has one.
fn files_in_overlayfs_snapshots(env: &TestEnv, rel: &[u8]) -> Vec<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let snaps = env
        .containerd()
        .dir()
        .join("root")
        .join("io.containerd.snapshotter.v1.overlayfs")
        .join("snapshots");
    let Ok(rd) = std::fs::read_dir(snaps) else {
        return Vec::new();
    };
    rd.flatten()
        .map(|e| e.path().join("fs").join(std::ffi::OsStr::from_bytes(rel)))
        .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_file()))
        .collect()
}

#[test]
fn an_exported_head_runs_on_overlayfs_with_the_same_tree() {
    const NS: &str = "lst-export";
    const OUT_NS: &str = "lst-export-out";
    const TAG: &str = "docker.io/layerstack/export-test:1";
    run_layerstack_scenario(NS, |env| {
        let a = unique("exp-first");
        run_sh(env, NS, &a, None, true, FIRST)?;
        ensure!(ls_wait_ok(env, NS, &a)? == "committed");
        let b = unique("exp-second");
        run_sh(env, NS, &b, None, true, SECOND)?;
        ensure!(ls_wait_ok(env, NS, &b)? == "committed");
        // A user xattr (written through a mounted session: Debian's minbase has
        // no setfattr), if the store's filesystem takes one.
        let parent = image_top_snapshot(env, NS)?;
        let mut xattr_set = false;
        publish_snapshot(env, NS, &unique("exp-xattr"), &parent, None, |m| {
            let f = m.join("srv/xattr-file");
            std::fs::write(&f, "with an xattr\n")?;
            xattr_set = xattr::set(&f, "user.layerstack-note", b"v\x01\xff").is_ok();
            Ok(())
        })?;
        let stack = stack_id(env, NS)?;

        let dir = env.scratch().join(unique("layout"));
        let r = export(env, NS, &format!("{stack}@main"), &dir, &["--tag", TAG])?;
        let layers = r["layers"].as_array().context("layers")?;
        ensure!(
            layers.iter().filter(|l| l["kind"] == "published").count() >= 3
                && layers.iter().any(|l| l["kind"] == "base")
                && layers.iter().all(|l| l["omitted"] == false),
            "export: {r}"
        );
        ensure!(dir.join("oci-layout").is_file(), "no oci-layout file");
        let m = manifest(&dir)?;
        let cfg = read_json(&blob(
            &dir,
            m["config"]["digest"].as_str().context("config")?,
        ))?;
        ensure!(
            cfg["rootfs"]["diff_ids"].as_array().map(Vec::len) == Some(layers.len())
                && cfg["history"].as_array().map(Vec::len) == Some(layers.len())
                && m["layers"].as_array().map(Vec::len) == Some(layers.len()),
            "config {cfg} / manifest {m}"
        );
        let index = read_json(&dir.join("index.json"))?;
        ensure!(
            index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"] == "1"
                && index["manifests"][0]["annotations"]["io.containerd.image.name"] == TAG,
            "index.json: {index}"
        );
        // The base image's runtime config (the fixture sets Env PATH, Cmd
        // /bin/sh, WorkingDir /) and platform carry over, and its one layer is
        // its own blob, not a re-pack.
        let (_, om, oc) = archive_image(&debian_image_tar()?)?;
        ensure!(
            cfg["config"] == oc["config"]
                && cfg["config"]["Cmd"] == serde_json::json!(["/bin/sh"])
                && cfg["architecture"] == oc["architecture"]
                && cfg["os"] == oc["os"],
            "exported config {cfg}\nbase config {oc}"
        );
        ensure!(
            m["layers"][0] == om["layers"][0]
                && cfg["rootfs"]["diff_ids"][0] == oc["rootfs"]["diff_ids"][0]
                && layers[0]["source"] == "containerd",
            "base layer: exported {} / {}, the base image's {}",
            m["layers"][0],
            layers[0],
            om["layers"][0]
        );

        let tar = pack(&dir)?;
        let names = env.import_image(OUT_NS, &tar, OVERLAYFS)?;
        ensure!(
            names.iter().any(|n| n == TAG),
            "images after import: {names:?}"
        );
        let exported = CtrRun::sh(OUT_NS, &unique("exp-ovl"), TREE_LIST)
            .image(TAG)
            .snapshotter(OVERLAYFS)
            .rm(true)
            .ok(env)?
            .stdout;
        let head = CtrRun::sh(NS, &unique("exp-head"), TREE_LIST)
            .snapshotter(SNAPSHOTTER)
            .label(publish_policy_label("never"))
            .rm(true)
            .ok(env)?
            .stdout;
        // No command given: the base image's Cmd (/bin/sh) runs, and ends on
        // the end of its stdin (`--null-io`: ctr never closes a piped stdin).
        CtrRun::new(OUT_NS, &unique("exp-cmd"), &[])
            .image(TAG)
            .snapshotter(OVERLAYFS)
            .extra(&["--null-io"])
            .rm(true)
            .ok(env)
            .context("ctr run of the exported image without a command")?;
        let (el, hl) = (lines(&exported), lines(&head));
        // The list is real: it holds what the containers made and lacks what
        // they deleted.
        let long = format!("/srv/{}/{}/f", "d".repeat(70), "e".repeat(70));
        for want in [
            &b"f 640 1234:5678 /srv/a -> "[..],
            b"f 640 1234:5678 /srv/b -> ",
            b"l 777 0:0 /srv/to-deep -> /srv/ddd",
            b"p 644 0:0 /srv/fifo -> ",
            b"/var/lib/apt/fresh",
            b"links 2 /srv/a",
            b"links 2 /srv/b",
            b"/srv/second",
            long.as_bytes(),
        ] {
            ensure!(
                has_line(&hl, want),
                "the head's list lacks {:?}",
                String::from_utf8_lossy(want)
            );
        }
        for gone in [
            &b"/usr/share/doc/"[..],
            b"/usr/share/doc -> ",
            b"/srv/link ",
            b"/srv/x/caf",
            b"/var/lib/apt/lists",
        ] {
            ensure!(
                !has_line(&hl, gone),
                "the head's list still has {:?}",
                String::from_utf8_lossy(gone)
            );
        }
        ensure!(hl.len() > 1000, "only {} lines listed", hl.len());
        if el != hl {
            let (es, hs): (BTreeSet<_>, BTreeSet<_>) = (el.iter().collect(), hl.iter().collect());
            let only_e: Vec<_> = es
                .difference(&hs)
                .take(20)
                .map(|l| String::from_utf8_lossy(l).into_owned())
                .collect();
            let only_h: Vec<_> = hs
                .difference(&es)
                .take(20)
                .map(|l| String::from_utf8_lossy(l).into_owned())
                .collect();
            anyhow::bail!(
                "the exported image's tree differs from the head's ({} vs {} lines)\nonly in the export: {only_e:#?}\nonly on the head: {only_h:#?}",
                el.len(),
                hl.len()
            );
        }
        // The non-UTF-8 name was unpacked from the first layer's blob (the
        // second layer's whiteout hides it in the tree).
        ensure!(
            files_in_overlayfs_snapshots(env, b"srv/x/caf\xe9")
                .iter()
                .any(|p| std::fs::read(p).is_ok_and(|c| c == b"latin-1 name\n")),
            "no overlayfs snapshot holds the regular file srv/x/caf\\xe9"
        );
        if xattr_set {
            let f = files_in_overlayfs_snapshots(env, b"srv/xattr-file")
                .pop()
                .context("no overlayfs snapshot holds srv/xattr-file")?;
            let v = xattr::get(&f, "user.layerstack-note")?;
            ensure!(
                v.as_deref() == Some(&b"v\x01\xff"[..]),
                "the xattr after import: {v:?}"
            );
        } else {
            eprintln!("the store's filesystem takes no user xattrs: not checked");
        }
        Ok(())
    });
}

#[test]
fn export_since_a_layer_omits_exactly_the_blobs_below_it() {
    const NS: &str = "lst-export-since";
    const OUT_NS: &str = "lst-export-since-out";
    // Busybox: a small base keeps the three exports short.
    run_scenario(|env| {
        start_daemon_and_import(env, NS, &busybox_image_tar()?, BUSYBOX_IMAGE)?;
        let sh = |id: &str, script: &str| -> Result<()> {
            CtrRun::sh(NS, id, script)
                .image(BUSYBOX_IMAGE)
                .rm(true)
                .ok(env)?;
            ensure!(ls_wait_ok(env, NS, id)? == "committed", "{id}");
            Ok(())
        };
        for (i, script) in [
            "echo one > /one",
            "echo two > /two",
            "rm /one; echo three > /three",
        ]
        .iter()
        .enumerate()
        {
            sh(&unique(&format!("since-{i}")), script)?;
        }
        let stack = stack_id(env, NS)?;
        let spec = format!("{stack}@main");
        let full_dir = env.scratch().join(unique("full"));
        let full = export(env, NS, &spec, &full_dir, &["--compression", "zstd"])?;
        let layers = full["layers"].as_array().context("layers")?.clone();
        ensure!(layers.len() >= 4, "{full}");
        // Since the second-newest layer: only the newest blob is written.
        let since = layers[layers.len() - 2]["layer"]
            .as_i64()
            .context("layer id")?;
        let since_dir = env.scratch().join(unique("since"));
        let part = export(
            env,
            NS,
            &spec,
            &since_dir,
            &[
                "--compression",
                "zstd",
                "--since",
                &since.to_string(),
                "--tag",
                "docker.io/layerstack/export-since:1",
            ],
        )?;
        let players = part["layers"].as_array().context("layers")?;
        ensure!(players.len() == layers.len(), "{part}");
        for (i, (f, p)) in layers.iter().zip(players).enumerate() {
            ensure!(
                f["digest"] == p["digest"] && f["diff_id"] == p["diff_id"],
                "layer {i}: a full export names {f}, a --since export {p}"
            );
            let d = p["digest"].as_str().context("digest")?;
            let omitted = i < layers.len() - 1;
            ensure!(p["omitted"] == omitted, "layer {i}: {p}");
            ensure!(
                blob(&since_dir, d).exists() != omitted,
                "layer {i} (omitted {omitted}): blob present {}",
                blob(&since_dir, d).exists()
            );
        }
        let (mf, mp) = (manifest(&full_dir)?, manifest(&since_dir)?);
        ensure!(mf["layers"] == mp["layers"], "manifests: {mf} vs {mp}");
        // --compression applies to the re-packed layers; the base layer is the
        // busybox image's own (uncompressed) blob.
        let n = layers.len();
        ensure!(
            mp["layers"][n - 1]["mediaType"] == "application/vnd.oci.image.layer.v1.tar+zstd"
                && mp["layers"][0]["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
                && layers[0]["source"] == "containerd",
            "{mp}"
        );
        // What a registry would hold from the earlier export completes it.
        for l in &layers[..layers.len() - 1] {
            let d = l["digest"].as_str().context("digest")?;
            std::fs::copy(blob(&full_dir, d), blob(&since_dir, d))?;
        }
        let tar = pack(&since_dir)?;
        let names = env.import_image(OUT_NS, &tar, OVERLAYFS)?;
        ensure!(
            names
                .iter()
                .any(|n| n == "docker.io/layerstack/export-since:1"),
            "{names:?}"
        );
        let out = CtrRun::sh(
            OUT_NS,
            &unique("since-run"),
            "cat /two /three; ls /one 2>&1 || true",
        )
        .image("docker.io/layerstack/export-since:1")
        .snapshotter(OVERLAYFS)
        .rm(true)
        .stdout_ok(env)?;
        ensure!(
            out.starts_with("two\nthree\n") && out.contains("No such file"),
            "inside: {out}"
        );

        // A graph node exports the tree it pinned, not the head that moved on.
        let g = unique("g-export");
        let out = env.layerstack(&["-n", NS, "graph", "create", &g, &spec])?;
        ensure!(out.status.success(), "graph create: {}", describe(&out));
        let root = String::from_utf8_lossy(&out.stdout).trim().to_string();
        sh(&unique("since-later"), "echo later > /later")?;
        let node_dir = env.scratch().join(unique("node"));
        let node = export(
            env,
            NS,
            "",
            &node_dir,
            &["--node", &root, "--compression", "zstd"],
        )?;
        let digests = |v: &Value| -> Vec<Value> {
            v["layers"]
                .as_array()
                .map(|a| a.iter().map(|l| l["digest"].clone()).collect())
                .unwrap_or_default()
        };
        ensure!(
            digests(&node) == digests(&full) && node["node"] == root.as_str(),
            "node {root}: {node}\nthe head when it was made: {full}"
        );

        // Bad input: each refused, naming what was wrong.
        let d = since_dir.to_string_lossy().into_owned();
        let fresh = env
            .scratch()
            .join(unique("bad"))
            .to_string_lossy()
            .into_owned();
        for (args, want) in [
            (vec!["export", &spec, "--oci-layout", &d], "is not empty"),
            (
                vec![
                    "export",
                    &format!("{stack}@no-such-branch"),
                    "--oci-layout",
                    &fresh,
                ],
                "no-such-branch",
            ),
            (
                vec!["export", &spec, "--oci-layout", &fresh, "--since", "999999"],
                "--since 999999",
            ),
            (
                vec!["export", "--node", "no-such-node", "--oci-layout", &fresh],
                "no-such-node",
            ),
            (
                vec![
                    "export",
                    "sha256:000000000000000000",
                    "--oci-layout",
                    &fresh,
                ],
                "stack",
            ),
        ] {
            let mut a = vec!["-n", NS];
            a.extend(args.iter().copied());
            let out = env.layerstack(&a)?;
            let err = String::from_utf8_lossy(&out.stderr);
            ensure!(
                !out.status.success() && err.contains(want),
                "layerstack {a:?} should fail naming {want:?}: {}",
                describe(&out)
            );
            ensure!(
                !Path::new(&fresh).exists(),
                "a refused export left {fresh} behind"
            );
        }
        Ok(())
    });
}

/// The base image's runtime config, platform, history and layer blobs carry
/// over into an export, also one `--since` its base; once containerd no longer
/// has the base image, the export still completes, warns, defaults the runtime
/// config and re-packs the base layers.
#[test]
fn an_export_keeps_the_base_images_config_and_layer_blobs() {
    const NS: &str = "lst-export-base";
    const OUT_NS: &str = "lst-export-base-out";
    const TAG: &str = "docker.io/layerstack/export-base:1";
    const GONE_TAG: &str = "docker.io/layerstack/export-base:gone";
    run_scenario(|env| {
        let tar = configured_image_tar()?;
        start_daemon_and_import(env, NS, &tar, CONFIGURED_IMAGE)?;
        let (base_manifest, om, oc) = archive_image(&tar)?;
        let base_layers = om["layers"].as_array().context("layers")?.clone();
        ensure!(base_layers.len() == 2, "{om}");
        // The base's own command: Entrypoint + Cmd, as its User, in its
        // WorkingDir, with its Env.
        let base_says = CtrRun::new(NS, &unique("base-cmd"), &[])
            .image(CONFIGURED_IMAGE)
            .label(publish_policy_label("never"))
            .rm(true)
            .stdout_ok(env)?;
        ensure!(
            base_says == "configured: hello in /work as 65534:65534\nfrom the base image\n",
            "the base image's command printed {base_says:?}"
        );
        let w = unique("base-write");
        CtrRun::sh(NS, &w, "echo exported > /work/out")
            .image(CONFIGURED_IMAGE)
            .rm(true)
            .ok(env)?;
        ensure!(ls_wait_ok(env, NS, &w)? == "committed");

        // Named by its image reference; no warning.
        let dir = env.scratch().join(unique("base-layout"));
        let d = dir.to_string_lossy().into_owned();
        let out = env.layerstack(&[
            "-n",
            NS,
            "export",
            CONFIGURED_IMAGE,
            "--oci-layout",
            &d,
            "--tag",
            TAG,
            "--json",
        ])?;
        ensure!(out.status.success(), "export: {}", describe(&out));
        ensure!(
            !String::from_utf8_lossy(&out.stderr).contains("warning"),
            "export with the base image present: {}",
            describe(&out)
        );
        let r: Value = serde_json::from_slice(&out.stdout)?;
        let layers = r["layers"].as_array().context("layers")?.clone();
        ensure!(
            layers.len() == 3
                && r["base_image"] == CONFIGURED_IMAGE
                && r["base_manifest"] == base_manifest.as_str(),
            "{r}"
        );
        let (m, cfg) = (manifest(&dir)?, config(&dir)?);
        for (i, want) in base_layers.iter().enumerate() {
            // Same digest, media type (one gzip, one plain tar) and size; the
            // blob is in the layout, byte for byte.
            ensure!(
                m["layers"][i] == *want
                    && layers[i]["source"] == "containerd"
                    && layers[i]["digest"] == want["digest"]
                    && cfg["rootfs"]["diff_ids"][i] == oc["rootfs"]["diff_ids"][i],
                "base layer {i}: exported {} / {}, the base image's {want}",
                m["layers"][i],
                layers[i]
            );
            let digest = want["digest"].as_str().context("digest")?;
            let blob_path = blob(&dir, digest);
            let bytes = std::fs::read(&blob_path)
                .with_context(|| format!("reading {}", blob_path.display()))?;
            ensure!(
                tar_member(
                    &tar,
                    &format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"))
                )? == bytes,
                "blob {digest} differs from the base image's"
            );
        }
        ensure!(
            layers[2]["source"] == "store"
                && m["layers"][2]["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip",
            "{r}\n{m}"
        );
        for f in RUNTIME_FIELDS {
            ensure!(
                !oc["config"][f].is_null() && cfg["config"][f] == oc["config"][f],
                "config field {f}: exported {}, base {}",
                cfg["config"][f],
                oc["config"][f]
            );
        }
        ensure!(
            cfg["config"] == oc["config"]
                && cfg["architecture"] == oc["architecture"]
                && cfg["os"] == oc["os"],
            "exported config {cfg}\nbase config {oc}"
        );
        let h = cfg["history"].as_array().context("history")?;
        ensure!(
            h.len() == 4 && h[..3] == oc["history"].as_array().context("history")?[..],
            "history: exported {}, base {}",
            cfg["history"],
            oc["history"]
        );

        // Imported on overlayfs and run without a command: the base's
        // Entrypoint/Cmd, User, WorkingDir and Env, over the published layer.
        let names = env.import_image(OUT_NS, &pack(&dir)?, OVERLAYFS)?;
        ensure!(names.iter().any(|n| n == TAG), "{names:?}");
        let says = CtrRun::new(OUT_NS, &unique("base-exp"), &[])
            .image(TAG)
            .snapshotter(OVERLAYFS)
            .rm(true)
            .stdout_ok(env)?;
        ensure!(
            says == "configured: hello in /work as 65534:65534\nfrom the base image\nexported\n",
            "the exported image's command printed {says:?}"
        );

        // --since the top base layer: the base blobs are left out but still
        // named by their original digests.
        let since = layers[1]["layer"].as_i64().context("layer")?;
        let since_dir = env.scratch().join(unique("base-since"));
        let part = export(
            env,
            NS,
            CONFIGURED_IMAGE,
            &since_dir,
            &["--since", &since.to_string()],
        )?;
        let players = part["layers"].as_array().context("layers")?;
        for (i, (f, p)) in layers.iter().zip(players).enumerate() {
            let omitted = i < 2;
            let d = p["digest"].as_str().context("digest")?;
            ensure!(
                f["digest"] == p["digest"]
                    && f["diff_id"] == p["diff_id"]
                    && p["omitted"] == omitted
                    && blob(&since_dir, d).exists() != omitted,
                "layer {i}: full export {f}, --since {since} {p}"
            );
        }
        ensure!(
            manifest(&since_dir)?["layers"] == m["layers"],
            "the --since manifest differs"
        );

        // The base image gone from containerd: a warning naming it, a
        // defaulted runtime config, re-packed base layers — and an image.
        let stack = stack_id(env, NS)?;
        env.ctr_ok(NS, &["images", "rm", "--sync", CONFIGURED_IMAGE])?;
        let gone_dir = env.scratch().join(unique("base-gone"));
        let g = gone_dir.to_string_lossy().into_owned();
        let out = env.layerstack(&[
            "-n",
            NS,
            "export",
            &format!("{stack}@main"),
            "--oci-layout",
            &g,
            "--tag",
            GONE_TAG,
            "--json",
        ])?;
        ensure!(
            out.status.success(),
            "export without the base image: {}",
            describe(&out)
        );
        let err = String::from_utf8_lossy(&out.stderr);
        let chain = stack.rsplit('/').next().unwrap_or_default();
        ensure!(
            err.contains("warning")
                && err.contains(&stack)
                && err.contains(chain)
                && err.contains("defaulted")
                && err.contains("Entrypoint")
                && err.contains("Cmd")
                && err.contains("Env"),
            "the warning: {err}"
        );
        let r: Value = serde_json::from_slice(&out.stdout)?;
        let glayers = r["layers"].as_array().context("layers")?;
        ensure!(
            r["base_image"] == "" && glayers.iter().all(|l| l["source"] == "store"),
            "{r}"
        );
        let (gm, gcfg) = (manifest(&gone_dir)?, config(&gone_dir)?);
        for (i, want) in base_layers.iter().enumerate() {
            ensure!(
                gm["layers"][i]["digest"] != want["digest"]
                    && gm["layers"][i]["mediaType"]
                        == "application/vnd.oci.image.layer.v1.tar+gzip",
                "base layer {i} re-packed: {}",
                gm["layers"][i]
            );
        }
        ensure!(
            gcfg["config"]
                == serde_json::json!({
                    "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
                }),
            "defaulted config: {gcfg}"
        );
        let names = env.import_image(OUT_NS, &pack(&gone_dir)?, OVERLAYFS)?;
        ensure!(names.iter().any(|n| n == GONE_TAG), "{names:?}");
        let says = CtrRun::new(
            OUT_NS,
            &unique("base-gone-run"),
            &["cat", "/work/README", "/work/out"],
        )
        .image(GONE_TAG)
        .snapshotter(OVERLAYFS)
        .rm(true)
        .stdout_ok(env)?;
        ensure!(says == "from the base image\nexported\n", "{says:?}");
        Ok(())
    });
}

/// `--since` a member of a squashed layer (as `layerstack log` lists it):
/// everything above that point — the layers below the squash are left out,
/// the squash's blob (new to a registry) is written.
#[test]
fn export_since_a_member_of_a_squash_omits_the_layers_below_the_squash() {
    const NS: &str = "lst-export-since-member";
    run_scenario(|env| {
        start_daemon_and_import(env, NS, &busybox_image_tar()?, BUSYBOX_IMAGE)?;
        for i in 0..10 {
            let id = unique(&format!("member-{i}"));
            CtrRun::sh(NS, &id, &format!("echo {i} > /f{i}"))
                .image(BUSYBOX_IMAGE)
                .rm(true)
                .ok(env)?;
            ensure!(ls_wait_ok(env, NS, &id)? == "committed", "{id}");
        }
        let stack = stack_id(env, NS)?;
        let spec = format!("{stack}@main");
        let sq = ls_json(env, NS, &["squash", &spec, "--json"])?;
        ensure!(sq["squashed"] == true, "{sq}");
        let squash = sq["layer"].as_i64().context("squash id")?;
        let log = ls_json(env, NS, &["log", &spec, "--json"])?;
        let row = log["layers"]
            .as_array()
            .and_then(|l| l.iter().find(|e| e["layer"] == squash))
            .cloned()
            .with_context(|| format!("{log}"))?;
        let oldest = row["members"]
            .as_array()
            .and_then(|m| m.last())
            .and_then(|m| m["layer"].as_i64())
            .with_context(|| format!("{row}"))?;
        let dir = env.scratch().join(unique("since-member"));
        let part = export(env, NS, &spec, &dir, &["--since", &oldest.to_string()])?;
        let layers = part["layers"].as_array().context("layers")?;
        let at = layers
            .iter()
            .position(|l| l["layer"] == squash)
            .with_context(|| format!("{part}"))?;
        for (i, l) in layers.iter().enumerate() {
            ensure!(
                l["omitted"] == (i < at),
                "layer {i} (the squash at {at}): {l}"
            );
        }
        Ok(())
    });
}
