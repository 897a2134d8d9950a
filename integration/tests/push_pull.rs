//! Checkpoints through an OCI registry (issue 23): a graph node pushed to
//! Debian's `docker-registry` (distribution 2.8, started privately on
//! 127.0.0.1 by the test) by `layerstack push`; its image is a real OCI image
//! (manifest, config with one diff ID per layer, the node's provenance and
//! state in the annotations); a second push after one more layer sends only
//! that layer's blob (and the new config), counted in the registry's access
//! log. A second daemon with an empty store pulls the node: the imported base
//! comes from the image, the node keeps its id, state and graph, a session
//! on it sees its files; pushed again from there (its parent not pulled) it
//! is the same image (manifest digest, parents annotation); a pull again
//! copies nothing; a pull of its parent reuses the layer it already holds and
//! links the node to it; a child made there and pushed sends only its own
//! layer — the pulled layers are the same blobs.
//!
//! Needs root (fails under `CI=true` without it), `/bin/busybox` (static) and
//! `docker-registry` (scripts/install-deps.sh); no containerd.

use std::path::Path;

use anyhow::{ensure, Context, Result};
use layerstack_integration::registry::{require_docker_registry, RegistryKind, TestRegistry};
use layerstack_integration::*;
use serde_json::Value;

fn rootfs(dir: &Path) -> Result<()> {
    busybox_tree(
        dir,
        &["sh", "cat", "echo", "printf", "mkdir", "rm"],
        &["etc", "srv"],
    )?;
    std::fs::write(dir.join("etc/motd"), "base\n")?;
    Ok(())
}

fn json_of(o: &std::process::Output) -> Result<Value> {
    serde_json::from_str(stdout(o).trim()).with_context(|| format!("not JSON: {:?}", stdout(o)))
}

/// A child node of `node`: a Mode B session on it runs `script`, checkpointed.
fn checkpoint(d: &Daemon, dir: &Path, node: &str, script: &str) -> Result<String> {
    let out = dir.join(format!("outcome-{node}.json"));
    let o = d.layerstack(&[
        "session",
        "run",
        "--node",
        node,
        "--publish",
        "checkpoint",
        "--net",
        "none",
        "--state",
        r#"{"reward":0.5}"#,
        "--outcome",
        out.to_str().context("utf-8")?,
        "--",
        "/bin/sh",
        "-c",
        script,
    ])?;
    ensure!(
        o.status.success(),
        "session run: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out)?)?;
    v["node"]
        .as_str()
        .filter(|n| !n.is_empty())
        .map(String::from)
        .with_context(|| format!("no node in {v}"))
}

fn push(d: &Daemon, reference: &str, node: &str) -> Result<Value> {
    let o = d.layerstack(&["push", reference, "--node", node, "--json"])?;
    ensure!(
        o.status.success(),
        "push: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    json_of(&o)
}

/// The manifest at `reference`, read through the registry's API.
fn manifest_at(reg: &TestRegistry, reference: &str) -> Result<Value> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let m = rt.block_on(async {
        let c = layerstack_registry::RegistryClient::new(layerstack_registry::RegistryOptions {
            insecure: vec![reg.host()],
            ..Default::default()
        })?;
        let r = layerstack_registry::parse_reference(reference)?;
        c.pull_manifest(&r, &layerstack_registry::Credentials::Anonymous)
            .await
    })?;
    Ok(serde_json::from_slice(&m.body)?)
}

/// Node `id` of graph `g` as `graph show --json` on `d` lists it.
fn graph_node(d: &Daemon, g: &str, id: &str) -> Result<Value> {
    let shown = json_of(&ensure_success(
        "graph show",
        d.layerstack(&["graph", "show", g, "--json"])?,
    )?)?;
    shown["nodes"]
        .as_array()
        .and_then(|ns| ns.iter().find(|n| n["id"] == id))
        .cloned()
        .with_context(|| format!("no node {id} in {shown}"))
}

fn config_toml(dir: &Path, reg: &TestRegistry) -> Result<std::path::PathBuf> {
    let p = dir.join("daemon.toml");
    std::fs::write(&p, format!("[registry]\ninsecure = [\"{}\"]\n", reg.host()))?;
    Ok(p)
}

fn scenario(dir: &Path, reg: &TestRegistry, auth: &TestRegistry, d: &Daemon) -> Result<()> {
    let src = dir.join("rootfs");
    rootfs(&src)?;
    let o = ensure_success(
        "base import",
        d.layerstack(&["base", "import", src.to_str().context("utf-8")?])?,
    )?;
    let stack = stdout(&o).trim().to_string();
    let root = stdout(&ensure_success(
        "graph create",
        d.layerstack(&["graph", "create", "g", &stack])?,
    )?)
    .trim()
    .to_string();
    let n1 = checkpoint(d, dir, &root, "echo one > /srv/one && rm /etc/motd")?;
    let n2 = checkpoint(d, dir, &n1, "echo two > /srv/two")?;

    // The first push sends every blob: the base layer, n1's, the config.
    let reference = format!("{}/layerstack/task:n1", reg.host());
    let before = reg.blob_uploads_completed()?;
    let p1 = push(d, &reference, &n1)?;
    ensure!(p1["node"] == n1.as_str() && p1["layers"] == 2, "{p1}");
    ensure!(p1["blobs_sent"] == 3 && p1["blobs_present"] == 0, "{p1}");
    let after1 = reg.blob_uploads_completed()?;
    ensure!(
        after1 - before == 3,
        "registry saw {} blob uploads",
        after1 - before
    );
    ensure!(
        p1["manifest_digest"]
            .as_str()
            .is_some_and(|d| d.starts_with("sha256:")),
        "{p1}"
    );

    // The same node again: nothing new is sent.
    let again = push(d, &reference, &n1)?;
    ensure!(
        again["blobs_sent"] == 0 && again["blobs_present"] == 3 && again["layers_packed"] == 0,
        "{again}"
    );
    ensure!(
        again["manifest_digest"] == p1["manifest_digest"],
        "the same node, the same image: {again} / {p1}"
    );
    ensure!(reg.blob_uploads_completed()? == after1);

    // One more layer: only its blob and the new config are sent.
    let p2 = push(d, &format!("{}/layerstack/task:n2", reg.host()), &n2)?;
    ensure!(
        p2["layers"] == 3
            && p2["blobs_sent"] == 2
            && p2["blobs_present"] == 2
            && p2["layers_packed"] == 1,
        "{p2}"
    );
    let after2 = reg.blob_uploads_completed()?;
    ensure!(
        after2 - after1 == 2,
        "registry saw {} uploads for one more layer",
        after2 - after1
    );
    ensure!(
        p2["diff_ids"][0] == p1["diff_ids"][0] && p2["diff_ids"][1] == p1["diff_ids"][1],
        "{p2}"
    );

    // A real OCI image: skopeo-free check of the manifest by the registry's
    // own API through our client crate.
    let mv = manifest_at(reg, &format!("{}/layerstack/task:n2", reg.host()))?;
    let ann = &mv["annotations"];
    ensure!(
        ann["io.layerstack.node"] == n2.as_str()
            && ann["io.layerstack.node.parents"] == n1.as_str()
            && ann["io.layerstack.node.kind"] == "checkpoint"
            && ann["io.layerstack.graph"] == "g"
            && ann["io.layerstack.stack"] == stack.as_str()
            && ann["io.layerstack.base-layers"] == "1",
        "{mv}"
    );
    let state: Value =
        serde_json::from_str(ann["io.layerstack.node.state"].as_str().unwrap_or("null"))?;
    ensure!(state["reward"] == 0.5, "{ann}");
    let on_a = graph_node(d, "g", &n2)?;
    ensure!(
        on_a["private_bytes"].as_u64().is_some_and(|b| b > 0)
            && ann["io.layerstack.node.private-bytes"].as_str()
                == Some(on_a["private_bytes"].to_string().as_str()),
        "private_bytes {} and its annotation {ann}",
        on_a["private_bytes"]
    );
    ensure!(mv["layers"].as_array().map(Vec::len) == Some(3), "{mv}");

    // A second daemon, an empty store: pull n2.
    let dir_b = dir.join("b");
    std::fs::create_dir_all(&dir_b)?;
    let cfg = config_toml(&dir_b, reg)?;
    let mut b = Daemon::start_at_with(
        &dir_b.join("s/snapshotter.sock"),
        &dir_b.join("s/containerd.sock"),
        &dir_b.join("root"),
        &["--config", cfg.to_str().context("utf-8")?],
        true,
    )?;
    let r = pulled_elsewhere(dir, &dir_b, reg, &b, &stack, &n1, &n2, &p2);
    if r.is_err() {
        b.dump_log();
    }
    b.stop();
    r?;

    // Refusals name what is wrong.
    let o = d.layerstack(&[
        "push",
        &format!("{}/x@sha256:{}", reg.host(), "0".repeat(64)),
        "--node",
        &n1,
    ])?;
    ensure!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("names a digest"),
        "{o:?}"
    );
    let o = d.layerstack(&[
        "push",
        &format!("{}/x:y", reg.host()),
        "--node",
        "n-no-such",
    ])?;
    ensure!(!o.status.success(), "{o:?}");

    // A registry that wants credentials: the refusal is permission_denied
    // and says where the credentials tried came from (never the secret).
    let target = format!("{}/layerstack/task:denied", auth.host());
    for (extra, says) in [
        (
            vec!["--registry-token", "not-a-token"],
            "a bearer token from the request",
        ),
        (
            vec![],
            "the request carried none and the daemon has no [registry] docker_config",
        ),
    ] {
        let mut args = vec!["push", target.as_str(), "--node", n1.as_str(), "--json"];
        args.extend(extra);
        let o = d.layerstack(&args)?;
        let stderr = String::from_utf8_lossy(&o.stderr);
        let err: Value = serde_json::from_str(stderr.trim())
            .with_context(|| format!("the failure is not JSON on stderr: {o:?}"))?;
        ensure!(
            !o.status.success()
                && err["error"]["kind"] == "permission_denied"
                && err["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("credentials tried: ") && m.contains(says))
                && !stderr.contains("not-a-token"),
            "{o:?}"
        );
    }
    Ok(())
}

fn pull(d: &Daemon, reference: &str) -> Result<Value> {
    let o = d.layerstack(&["pull", reference, "--json"])?;
    ensure!(
        o.status.success(),
        "pull {reference}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    json_of(&o)
}

#[allow(clippy::too_many_arguments)]
fn pulled_elsewhere(
    _dir: &Path,
    dir_b: &Path,
    reg: &TestRegistry,
    b: &Daemon,
    stack: &str,
    n1: &str,
    n2: &str,
    p2: &Value,
) -> Result<()> {
    let r2 = format!("{}/layerstack/task:n2", reg.host());
    let got = pull(b, &r2)?;
    ensure!(
        got["node"] == n2 && got["created"] == true && got["base_imported"] == true,
        "{got}"
    );
    ensure!(got["stack"] == stack && got["graph"] == "g", "{got}");
    ensure!(
        got["layers"] == 2 && got["layers_fetched"] == 2 && got["layers_reused"] == 0,
        "{got}"
    );
    ensure!(got["manifest_digest"] == p2["manifest_digest"], "{got}");
    ensure!(got["missing_parents"] == serde_json::json!([n1]), "{got}");
    // The node as the first store made it: its state, its files.
    let shown = json_of(&ensure_success(
        "node show",
        b.layerstack(&["node", "show", n2, "--json"])?,
    )?)?;
    ensure!(
        shown["state"]["reward"] == 0.5 && shown["kind"] == "checkpoint",
        "{shown}"
    );
    // Its size as the store that made it measured it travels too (the
    // annotation is checked against the first store in `scenario`).
    ensure!(
        shown["private_bytes"].as_u64().is_some_and(|b| b > 0),
        "{shown}"
    );
    let out = dir_b.join("run.json");
    let o = b.layerstack(&[
        "session",
        "run",
        "--node",
        n2,
        "--publish",
        "never",
        "--net",
        "none",
        "--outcome",
        out.to_str().context("utf-8")?,
        "--",
        "/bin/sh",
        "-c",
        "cat /srv/one /srv/two && test ! -e /etc/motd",
    ])?;
    ensure!(
        o.status.success() && stdout(&o) == "one\ntwo\n",
        "a session on the pulled node: {o:?}"
    );
    // Issue 23: pushed again from here, where its parent is not, n2 is the
    // same image — the same manifest digest, every blob (the config too)
    // present, its parent declared — and the graph knows the parent is
    // missing, not that there is none.
    let shown = graph_node(b, "g", n2)?;
    ensure!(
        shown["parents"] == serde_json::json!([])
            && shown["missing_parents"] == serde_json::json!([n1])
            && shown["declared_parents"] == serde_json::json!([n1]),
        "{shown}"
    );
    // The text table shows the missing parent, marked.
    let table = stdout(&ensure_success(
        "graph show",
        b.layerstack(&["graph", "show", "g"])?,
    )?);
    ensure!(
        table
            .lines()
            .any(|l| l.starts_with(n2) && l.contains(&format!("{n1}(missing)"))),
        "graph show's table hides n2's missing parent:\n{table}"
    );
    let from_b = format!("{}/layerstack/task:n2-from-b", reg.host());
    let pb2 = push(b, &from_b, n2)?;
    ensure!(
        pb2["manifest_digest"] == p2["manifest_digest"],
        "a re-push of the pulled node is another image: {pb2} / {p2}"
    );
    ensure!(
        pb2["blobs_sent"] == 0 && pb2["blobs_present"] == 4 && pb2["diff_ids"] == p2["diff_ids"],
        "{pb2}"
    );
    let ann = manifest_at(reg, &from_b)?["annotations"].clone();
    ensure!(
        ann["io.layerstack.node.parents"] == n1 && ann["io.layerstack.node"] == n2,
        "{ann}"
    );
    // Again: nothing is fetched, nothing changes.
    let again = pull(b, &r2)?;
    ensure!(
        again["created"] == false
            && again["layers_fetched"] == 0
            && again["base_imported"] == false,
        "{again}"
    );
    // A node already here keeps its graph, whatever graph a pull names.
    let kept = json_of(&ensure_success(
        "pull --graph",
        b.layerstack(&["pull", &r2, "--graph", "elsewhere", "--json"])?,
    )?)?;
    ensure!(kept["created"] == false && kept["graph"] == "g", "{kept}");
    // Its parent: the layer it shares with n2 is held already, and n2
    // (pulled before it) gets its edge in this pull — not on a pull of n2
    // again.
    let p1 = pull(b, &format!("{}/layerstack/task:n1", reg.host()))?;
    ensure!(
        p1["node"] == n1
            && p1["created"] == true
            && p1["layers_fetched"] == 0
            && p1["layers_reused"] == 1,
        "{p1}"
    );
    ensure!(p1["linked_children"] == serde_json::json!([n2]), "{p1}");
    let shown = graph_node(b, "g", n2)?;
    ensure!(
        shown["parents"] == serde_json::json!([n1])
            && shown["missing_parents"] == serde_json::json!([]),
        "{shown}"
    );
    let shown = json_of(&ensure_success(
        "node show",
        b.layerstack(&["node", "show", n2, "--json"])?,
    )?)?;
    ensure!(shown["parents"] == serde_json::json!([n1]), "{shown}");
    let relinked = pull(b, &r2)?;
    ensure!(
        relinked["created"] == false && relinked["missing_parents"] == serde_json::json!([]),
        "{relinked}"
    );
    // A node's image onto a branch: made at the node's root.
    let o = ensure_success(
        "pull --branch",
        b.layerstack(&["pull", &r2, "--branch", "from-n2", "--json"])?,
    )?;
    let on = json_of(&o)?;
    ensure!(
        on["node"] == n2 && on["branch"] == "from-n2" && on["branch_result"] == "created",
        "{on}"
    );
    ensure!(
        run_on(
            b,
            &format!("{stack}@from-n2"),
            "never",
            "cat /srv/one /srv/two"
        )? == "one\ntwo\n",
        "a session on the branch made at n2"
    );
    // A child made here and pushed: only its own layer is new to the registry.
    let n3 = checkpoint(b, dir_b, n2, "echo three > /srv/three")?;
    let before = reg.blob_uploads_completed()?;
    let p3 = push(b, &format!("{}/layerstack/task:n3", reg.host()), &n3)?;
    ensure!(
        p3["blobs_sent"] == 2 && p3["blobs_present"] == 3 && p3["layers_packed"] == 1,
        "{p3}"
    );
    ensure!(reg.blob_uploads_completed()? - before == 2);
    // An image that is not a node's is refused by name.
    let o = b.layerstack(&["pull", &format!("{}/layerstack/none:x", reg.host())])?;
    ensure!(!o.status.success(), "{o:?}");
    Ok(())
}

#[test]
fn push_sends_only_missing_blobs_and_annotates_the_node() -> Result<()> {
    if !require_root()
        || !require_docker_registry(RegistryKind::Plain)
        || !require_docker_registry(RegistryKind::TlsBasicAuth)
    {
        return Ok(());
    }
    let dir = make_temp_dir()?;
    let reg = TestRegistry::start(RegistryKind::Plain)?;
    let auth = TestRegistry::start(RegistryKind::TlsBasicAuth)?;
    let cfg = dir.join("daemon.toml");
    std::fs::write(
        &cfg,
        format!(
            "[registry]\ninsecure = [\"{}\"]\nca_files = [\"{}\"]\n",
            reg.host(),
            auth.ca_pem().context("the auth registry's CA")?.display()
        ),
    )?;
    let mut d = Daemon::start_at_with(
        &dir.join("s/snapshotter.sock"),
        &dir.join("s/containerd.sock"),
        &dir.join("root"),
        &["--config", cfg.to_str().context("utf-8")?],
        true,
    )?;
    let r = scenario(&dir, &reg, &auth, &d);
    if r.is_err() {
        d.dump_log();
        eprintln!("registry log:\n{}", reg.log_tail(40));
    }
    d.stop();
    if std::env::var_os("LAYERSTACK_TEST_KEEP").is_none() {
        remove_tree(&dir);
    }
    r
}

/// A Mode B session on `at` (STACK@BRANCH) runs `script`; its writes are
/// published on success. Returns its stdout.
fn run_on(d: &Daemon, at: &str, publish: &str, script: &str) -> Result<String> {
    let o = d.layerstack(&[
        "session",
        "run",
        at,
        "--publish",
        publish,
        "--net",
        "none",
        "--",
        "/bin/sh",
        "-c",
        script,
    ])?;
    ensure!(
        o.status.success(),
        "session run on {at}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(stdout(&o))
}

fn push_head(d: &Daemon, reference: &str, at: &str) -> Result<Value> {
    let o = d.layerstack(&["push", reference, "--stack", at, "--json"])?;
    ensure!(
        o.status.success(),
        "push --stack: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    json_of(&o)
}

/// Issue 23: a branch head pushed from one store lands on a branch of
/// another — created (here: fast-forwarded from the imported base), up to
/// date when pulled again, fast-forwarded by one fetched layer, merged with
/// the branch's own disjoint work through the gate, refused whole on a
/// conflict (kind conflict, the branch unchanged), or put on a branch of
/// its own.
fn branch_heads(dir: &Path, reg: &TestRegistry, a: &Daemon, b: &Daemon) -> Result<()> {
    let src = dir.join("rootfs");
    rootfs(&src)?;
    let stack = stdout(&ensure_success(
        "base import",
        a.layerstack(&["base", "import", src.to_str().context("utf-8")?])?,
    )?)
    .trim()
    .to_string();
    let main = format!("{stack}@main");
    let r = format!("{}/layerstack/head:main", reg.host());
    run_on(a, &main, "on-success", "echo one > /srv/one")?;
    let p1 = push_head(a, &r, &main)?;
    ensure!(p1["node"] == "" && p1["layers"] == 2, "{p1}");
    ensure!(
        manifest_at(reg, &r)?["annotations"]["io.layerstack.branch"] == "main",
        "the image names its branch"
    );

    // An empty store: the base comes from the image, main moves to the head.
    let got = pull(b, &r)?;
    ensure!(
        got["node"] == ""
            && got["graph"] == ""
            && got["stack"] == stack.as_str()
            && got["base_imported"] == true
            && got["created"] == true
            && got["branch"] == "main"
            && got["branch_result"] == "fast-forward"
            && got["layers"] == 1
            && got["layers_fetched"] == 1,
        "{got}"
    );
    ensure!(run_on(b, &main, "never", "cat /srv/one")? == "one\n");
    let again = pull(b, &r)?;
    ensure!(
        again["branch_result"] == "up-to-date"
            && again["created"] == false
            && again["layers_fetched"] == 0
            && again["branch_head"] == got["branch_head"],
        "{again}"
    );

    // One more layer there: one blob fetched, main fast-forwarded.
    run_on(a, &main, "on-success", "echo two > /srv/two")?;
    push_head(a, &r, &main)?;
    let ff = pull(b, &r)?;
    ensure!(
        ff["branch_result"] == "fast-forward"
            && ff["layers"] == 2
            && ff["layers_fetched"] == 1
            && ff["layers_reused"] == 1,
        "{ff}"
    );

    // Both sides move: disjoint changes merge through main's gate here.
    run_on(b, &main, "on-success", "echo b > /srv/b")?;
    run_on(a, &main, "on-success", "echo three > /srv/three")?;
    push_head(a, &r, &main)?;
    let merged = pull(b, &r)?;
    ensure!(
        merged["branch_result"] == "merged"
            && merged["branch_session"].as_i64().is_some_and(|s| s > 0)
            && merged["layers_fetched"] == 1,
        "{merged}"
    );
    ensure!(
        run_on(b, &main, "never", "cat /srv/one /srv/two /srv/three /srv/b")?
            == "one\ntwo\nthree\nb\n"
    );

    // The same new file on both sides, other bytes: refused whole.
    run_on(b, &main, "on-success", "echo mine > /srv/c")?;
    run_on(a, &main, "on-success", "echo theirs > /srv/c")?;
    push_head(a, &r, &main)?;
    let o = b.layerstack(&["pull", &r, "--json"])?;
    let err: Value = serde_json::from_str(String::from_utf8_lossy(&o.stderr).trim())
        .with_context(|| format!("the failure is not JSON on stderr: {o:?}"))?;
    ensure!(
        !o.status.success()
            && err["error"]["kind"] == "conflict"
            && err["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("/srv/c") && m.contains("--branch")),
        "{o:?}"
    );
    ensure!(run_on(b, &main, "never", "cat /srv/c")? == "mine\n");

    // On a branch of its own instead: made at the pulled head.
    let own = json_of(&ensure_success(
        "pull --branch",
        b.layerstack(&["pull", &r, "--branch", "theirs", "--json"])?,
    )?)?;
    ensure!(
        own["branch"] == "theirs" && own["branch_result"] == "created" && own["created"] == true,
        "{own}"
    );
    ensure!(run_on(b, &format!("{stack}@theirs"), "never", "cat /srv/c")? == "theirs\n");

    // A branch head joins no graph; a branch name is checked first.
    for (extra, says) in [
        (["--graph", "g"], "not a node"),
        (["--branch", "bad..name"], "bad..name"),
    ] {
        let mut args = vec!["pull", r.as_str(), "--json"];
        args.extend(extra);
        let o = b.layerstack(&args)?;
        let err: Value = serde_json::from_str(String::from_utf8_lossy(&o.stderr).trim())
            .with_context(|| format!("the failure is not JSON on stderr: {o:?}"))?;
        ensure!(
            !o.status.success()
                && err["error"]["kind"] == "invalid_argument"
                && err["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(says)),
            "{o:?}"
        );
    }
    // Nothing of the refused pulls is left: fsck finds the store clean.
    let f = json_of(&ensure_success("fsck", b.layerstack(&["fsck", "--json"])?)?)?;
    ensure!(
        f["problems"].as_array().is_some_and(|p| p.is_empty()),
        "{f}"
    );
    Ok(())
}

#[test]
fn a_pushed_branch_head_lands_on_a_branch_of_another_store() -> Result<()> {
    if !require_root() || !require_docker_registry(RegistryKind::Plain) {
        return Ok(());
    }
    let dir = make_temp_dir()?;
    let reg = TestRegistry::start(RegistryKind::Plain)?;
    let start = |name: &str| -> Result<Daemon> {
        let d = dir.join(name);
        std::fs::create_dir_all(&d)?;
        let cfg = config_toml(&d, &reg)?;
        Daemon::start_at_with(
            &d.join("s/snapshotter.sock"),
            &d.join("s/containerd.sock"),
            &d.join("root"),
            &["--config", cfg.to_str().context("utf-8")?],
            true,
        )
    };
    let mut a = start("a")?;
    let mut b = start("b")?;
    let r = branch_heads(&dir, &reg, &a, &b);
    if r.is_err() {
        a.dump_log();
        b.dump_log();
        eprintln!("registry log:\n{}", reg.log_tail(40));
    }
    a.stop();
    b.stop();
    if std::env::var_os("LAYERSTACK_TEST_KEEP").is_none() {
        remove_tree(&dir);
    }
    r
}
