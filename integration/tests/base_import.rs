//! `layerstack base import` (issue 19, containerd as an adapter) against the
//! real daemon with NO containerd running: a directory built here becomes a
//! stack, GNU tar's archive of the same tree is the same stack, a Mode B
//! session runs on it (busybox as /bin/sh) and publishes, the branch is
//! exported as an OCI layout whose base layer's diff ID is the import's
//! digest, that layout imported back is a base holding the published write, a
//! SandboxGraph rooted on the import checkpoints an attempt, two concurrent
//! imports of one tarball make one base, and a hostile archive is refused
//! leaving nothing.
//!
//! Needs root (fails under `CI=true` without it), `/bin/busybox` (static) and
//! `tar`; no containerd.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use layerstack_integration::*;
use serde_json::Value;

/// A root filesystem: a static busybox as /bin/sh (and a few applets),
/// /etc/motd, a directory of its own.
fn rootfs(dir: &Path) -> Result<()> {
    busybox_tree(
        dir,
        &["sh", "cat", "echo", "ls", "test"],
        &["etc", "srv/data"],
    )?;
    std::fs::write(dir.join("etc/motd"), "from an import\n")?;
    std::fs::write(dir.join("srv/data/seed.txt"), "seed\n")?;
    Ok(())
}

fn ok(what: &str, o: std::process::Output) -> Result<std::process::Output> {
    ensure_success(what, o)
}

#[test]
fn a_base_imported_without_containerd_runs_sessions_and_exports() -> Result<()> {
    if !require_root() {
        return Ok(());
    }
    let env = StandaloneDaemon::start()?;
    let run = || -> Result<()> {
        let dir = env.dir();
        ensure!(
            !dir.join("s/containerd.sock").exists(),
            "no containerd may run for this test"
        );
        let src = dir.join("rootfs");
        rootfs(&src)?;

        // The directory: a new stack, printed on stdout.
        let o = ok(
            "base import",
            env.layerstack(&["base", "import", src.to_str().context("utf-8")?])?,
        )?;
        let stack = stdout(&o).trim().to_string();
        ensure!(stack.starts_with("import:sha256:"), "stack id: {stack:?}");
        let stderr = String::from_utf8_lossy(&o.stderr);
        ensure!(stderr.contains("imported directory"), "{stderr}");

        // GNU tar's archive of the same tree (another writer entirely): the
        // same content, so the same stack; nothing new.
        let tarball = dir.join("rootfs.tar.gz");
        let t = run_with_timeout(
            Command::new("tar")
                .args(["--numeric-owner", "-czf"])
                .arg(&tarball)
                .arg("-C")
                .arg(&src)
                .arg("."),
            CMD_TIMEOUT,
        )?;
        ok("tar", t)?;
        let o = ok(
            "base import (tar)",
            env.layerstack(&[
                "base",
                "import",
                "--json",
                tarball.to_str().context("utf-8")?,
            ])?,
        )?;
        let v: Value = serde_json::from_slice(&o.stdout)?;
        ensure!(
            v["stack"] == stack.as_str() && v["created"] == false && v["kind"] == "tar",
            "the tar of the same tree is the same stack: {v}"
        );
        let digest = v["digest"].as_str().context("digest")?.to_string();
        ensure!(stack == format!("import:{digest}"), "{stack} vs {digest}");
        let staging = env.daemon().root().join("staging");
        ensure!(
            dir_is_empty(&staging)?,
            "the second import's staged tree was dropped"
        );

        // Mode B on it: the overlay's root is the imported tree.
        let o = ok(
            "session run",
            env.layerstack(&[
                "session",
                "run",
                &stack,
                "--",
                "sh",
                "-c",
                "cat /etc/motd && cat /srv/data/seed.txt && echo written > /srv/data/new.txt",
            ])?,
        )?;
        ensure!(
            stdout(&o) == "from an import\nseed\n",
            "session output: {}",
            describe(&o)
        );
        ensure!(
            String::from_utf8_lossy(&o.stderr).contains("committed"),
            "{}",
            describe(&o)
        );
        let o = ok(
            "session run (next)",
            env.layerstack(&[
                "session",
                "run",
                &format!("{stack}@main"),
                "--",
                "cat",
                "/srv/data/new.txt",
            ])?,
        )?;
        ensure!(stdout(&o) == "written\n", "{}", describe(&o));

        // Export of the branch: the imported base, then the published layer.
        let layout = dir.join("exported");
        let o = ok(
            "export",
            env.layerstack(&[
                "export",
                &format!("{stack}@main"),
                "--oci-layout",
                layout.to_str().context("utf-8")?,
                "--json",
            ])?,
        )?;
        let blob = |d: &str| -> Result<Value> {
            let hex = d.strip_prefix("sha256:").context("digest")?;
            Ok(serde_json::from_slice(&std::fs::read(
                layout.join("blobs/sha256").join(hex),
            )?)?)
        };
        let index: Value = serde_json::from_slice(&std::fs::read(layout.join("index.json"))?)?;
        let manifest = blob(
            index["manifests"][0]["digest"]
                .as_str()
                .context("manifest")?,
        )?;
        let config = blob(manifest["config"]["digest"].as_str().context("config")?)?;
        let diff_ids = config["rootfs"]["diff_ids"]
            .as_array()
            .context("diff_ids")?;
        ensure!(
            diff_ids.len() == 2 && diff_ids[0] == digest.as_str(),
            "the base layer's diff ID is the import's digest: {diff_ids:?} vs {digest} ({})",
            stdout(&o)
        );

        // The exported layout imported back (an OCI layout: its layers
        // flattened in order): a new base holding the published write.
        let o = ok(
            "base import (oci layout)",
            env.layerstack(&[
                "base",
                "import",
                "--json",
                layout.to_str().context("utf-8")?,
            ])?,
        )?;
        let v: Value = serde_json::from_slice(&o.stdout)?;
        ensure!(
            v["kind"] == "oci" && v["created"] == true && v["layers"] == 2,
            "the exported layout is a new base of two flattened layers: {v}"
        );
        let flat = v["stack"].as_str().context("stack")?.to_string();
        ensure!(flat != stack, "a different tree is a different base");
        let o = ok(
            "session run (flattened)",
            env.layerstack(&["session", "run", &flat, "--", "cat", "/srv/data/new.txt"])?,
        )?;
        ensure!(stdout(&o) == "written\n", "{}", describe(&o));

        // A file a session named like an OCI whiteout (overlayfs gives the
        // name no meaning) publishes as a file, but no OCI layer can carry
        // it: the export refuses, naming it, and writes no layout.
        let o = ok(
            "session run (.wh. name)",
            env.layerstack(&[
                "session",
                "run",
                &format!("{stack}@wh"),
                "--",
                "sh",
                "-c",
                "echo kept > /srv/data/.wh.seed.txt",
            ])?,
        )?;
        ensure!(
            String::from_utf8_lossy(&o.stderr).contains("committed"),
            "{}",
            describe(&o)
        );
        let refused = dir.join("refused");
        let o = env.layerstack(&[
            "--error-format",
            "json",
            "export",
            &format!("{stack}@wh"),
            "--oci-layout",
            refused.to_str().context("utf-8")?,
        ])?;
        let err: Value = serde_json::from_slice(&o.stderr)
            .with_context(|| format!("one JSON error line: {}", describe(&o)))?;
        let message = err["error"]["message"].as_str().unwrap_or_default();
        ensure!(
            !o.status.success()
                && err["error"]["kind"] == "failed_precondition"
                && message.contains("srv/data/.wh.seed.txt")
                && message.contains("reserve for whiteouts"),
            "export of a layer holding a `.wh.` file: {}",
            describe(&o)
        );
        ensure!(
            !refused.join("index.json").exists(),
            "a refused export leaves no layout"
        );
        let o = ok(
            "session run (the file is there)",
            env.layerstack(&[
                "session",
                "run",
                &format!("{stack}@wh"),
                "--",
                "cat",
                "/srv/data/.wh.seed.txt",
                "/srv/data/seed.txt",
            ])?,
        )?;
        ensure!(stdout(&o) == "kept\nseed\n", "{}", describe(&o));

        // A SandboxGraph rooted on the imported base: an attempt of the root
        // checkpoints a child node, which sees its own write only.
        let root = stdout(&ok(
            "graph create",
            env.layerstack(&["graph", "create", "g-import", &stack])?,
        )?)
        .trim()
        .to_string();
        ok(
            "attempt",
            env.layerstack(&[
                "session",
                "run",
                "--node",
                &root,
                "--",
                "sh",
                "-c",
                "echo child > /child.txt",
            ])?,
        )?;
        let g: Value = serde_json::from_slice(
            &ok(
                "graph show",
                env.layerstack(&["graph", "show", "g-import", "--json"])?,
            )?
            .stdout,
        )?;
        let child = g["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|n| n["parents"][0] == root.as_str())
            .context("the attempt's checkpoint is a child of the root")?;
        let child = child["id"].as_str().context("node id")?.to_string();
        let o = ok(
            "session run (child)",
            env.layerstack(&[
                "session",
                "run",
                "--node",
                &child,
                "--publish",
                "never",
                "--",
                "sh",
                "-c",
                "cat /child.txt /etc/motd",
            ])?,
        )?;
        ensure!(stdout(&o) == "child\nfrom an import\n", "{}", describe(&o));

        // Two imports of one new tarball at once: one base, made once.
        std::fs::write(src.join("etc/motd"), "twice\n")?;
        let twice = dir.join("twice.tar");
        ok(
            "tar (twice)",
            run_with_timeout(
                Command::new("tar")
                    .args(["--numeric-owner", "-cf"])
                    .arg(&twice)
                    .arg("-C")
                    .arg(&src)
                    .arg("."),
                CMD_TIMEOUT,
            )?,
        )?;
        let path = twice.to_str().context("utf-8")?.to_string();
        let both: Vec<Value> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| -> Result<Value> {
                        let o = ok(
                            "base import (concurrent)",
                            env.layerstack(&["base", "import", "--json", &path])?,
                        )?;
                        Ok(serde_json::from_slice(&o.stdout)?)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .map_err(|_| anyhow::anyhow!("import thread panicked"))?
                })
                .collect::<Result<Vec<_>>>()
        })?;
        ensure!(
            both[0]["stack"] == both[1]["stack"]
                && both.iter().filter(|v| v["created"] == true).count() == 1,
            "two concurrent imports of one tarball make one base: {both:?}"
        );
        ensure!(
            dir_is_empty(&staging)?,
            "the loser's staged tree was dropped"
        );

        // A hostile archive: refused by entry, nothing kept, nothing outside.
        let bad = dir.join("bad.tar");
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(4);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        let name = b"../escaped";
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_cksum();
        b.append(&h, &b"evil"[..])?;
        std::fs::write(&bad, b.into_inner()?)?;
        let o = env.layerstack(&["base", "import", bad.to_str().context("utf-8")?])?;
        let err = String::from_utf8_lossy(&o.stderr);
        ensure!(
            !o.status.success() && err.contains("refused entry ../escaped"),
            "{}",
            describe(&o)
        );
        ensure!(!dir.join("escaped").exists() && !staging.join("../escaped").exists());
        ensure!(
            dir_is_empty(&staging)?,
            "a refused import leaves its staging"
        );
        let o = ok("stack ls", env.layerstack(&["stack", "ls", "--json"])?)?;
        let stacks: Value = serde_json::from_slice(&o.stdout)?;
        ensure!(
            stacks.as_array().map(Vec::len) == Some(3)
                && stacks
                    .as_array()
                    .into_iter()
                    .flatten()
                    .all(|s| s["namespace"].is_null()),
            "{stacks}"
        );
        // The short id `stack ls` prints names the stack.
        let id = stacks[0]["id"].as_str().context("a stack id")?;
        let short = format!(
            "import:{}",
            id.strip_prefix("import:sha256:")
                .and_then(|h| h.get(..12))
                .context("an import stack id")?
        );
        let table = stdout(&ok("stack ls", env.layerstack(&["stack", "ls"])?)?);
        ensure!(table.contains(&short), "{table}");
        let o = ok(
            "branch ls by short id",
            env.layerstack(&["branch", "ls", &short, "--json"])?,
        )?;
        ensure!(stdout(&o).contains("main"), "{}", describe(&o));
        if !env.daemon().root().join("l").is_dir() {
            bail!("no layer directory");
        }
        Ok(())
    };
    let r = run();
    if r.is_err() {
        env.daemon().dump_log();
    }
    r
}
