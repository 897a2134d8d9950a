//! The three-way merge gate against a real containerd 1.6 + runc and the Debian
//! image (issue 4): three concurrent containers edit the same config file — two
//! in separate hunks, one overlapping — two publish (the first commits, the
//! second merges), the third is rejected whole, and the merged file is byte-exact
//! (CRLF lines and a missing final newline included). A fourth session, made
//! with `ctr snapshots prepare` on the same old lease and edited through its own
//! mount, shows `layerstack publish --dry-run` reporting a merge without
//! changing anything.
//!
//! This test binary has its own private containerd and daemon; it works on the
//! default branch. Without root or containerd it skips (or panics under `CI=true`).

use std::path::Path;

use anyhow::{ensure, Context, Result};
use layerstack_integration::{
    describe, finish_detached, json_strs, layerstack_wait, ls_publish, ls_wait_json,
    remove_container, run_layerstack_scenario, run_sh, start_detached, stdout, CtrRun, TestEnv,
    SNAPSHOTTER,
};

const NS: &str = "lst-merge";
const CONF: &str = "/etc/layerstack-merge.conf";
/// Mixed line endings and no final newline: both must survive the merge.
const BASE: &str = "# layerstack merge test\nkey1 = one\r\nkey2 = two\r\nkey3 = three\nkey4 = four\nkey5 = five\nkey6 = six\nkey7 = seven\nkey8 = eight\nlast = end";

/// What a new `--rm` container `id` on the branch reads from [`CONF`], byte for
/// byte; its own session must end too (`layerstack wait --json` answers).
fn conf_on_branch(env: &TestEnv, id: &str) -> Result<Vec<u8>> {
    let out = CtrRun::sh(NS, id, &format!("cat {CONF}"))
        .rm(true)
        .ok(env)?;
    ls_wait_json(env, NS, id)?;
    Ok(out.stdout)
}

fn paths_with(v: &serde_json::Value, status: &str) -> Vec<String> {
    v["paths"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|p| p["status"] == status)
                .filter_map(|p| p["path"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

fn sed(key: &str, from: &str, to: &str) -> String {
    format!("sleep 2; sed -i 's/^{key} = {from}/{key} = {to}/' {CONF}")
}

/// Mounts the active snapshot `key` (made by `ctr snapshots prepare --mounts`)
/// at `target` with the mounts the snapshotter returned.
fn mount_snapshot(mounts_json: &[u8], target: &Path) -> Result<()> {
    let v: serde_json::Value =
        serde_json::from_slice(mounts_json).context("parsing snapshot mounts")?;
    let m = v
        .as_array()
        .and_then(|a| a.first())
        .context("no mount returned")?;
    ensure!(m["Type"] == "overlay", "expected an overlay mount: {m}");
    let opts = json_strs(&m["Options"], "mount options")?;
    std::fs::create_dir_all(target)?;
    nix::mount::mount(
        Some("overlay"),
        target,
        Some("overlay"),
        nix::mount::MsFlags::empty(),
        Some(opts.join(",").as_str()),
    )
    .with_context(|| format!("mounting the snapshot at {}", target.display()))?;
    Ok(())
}

#[test]
fn three_concurrent_edits_two_publish_one_is_rejected_byte_exact() {
    run_layerstack_scenario(NS, |env| {
        // The base version of the config file, committed to the branch.
        run_sh(
            env,
            NS,
            "m-setup",
            None,
            true,
            &format!("printf '%s' '{BASE}' > {CONF}"),
        )?;
        let setup = ls_wait_json(env, NS, "m-setup")?;
        ensure!(setup["outcome"] == "committed", "setup: {setup:#}");

        // Three containers and one raw snapshot lease the same head.
        start_detached(env, NS, "m-a", None, &sed("key2", "two", "A"))?; // line 3 (CRLF)
        start_detached(env, NS, "m-b", None, &sed("key7", "seven", "B"))?; // line 8, separate hunk
        start_detached(env, NS, "m-c", None, &sed("key2", "two", "C"))?; // overlaps m-a
        let snaps = stdout(&env.ctr_ok(NS, &["snapshots", "--snapshotter", SNAPSHOTTER, "ls"])?);
        let parent = snaps
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.first() == Some(&"m-a"))
            .and_then(|f| f.get(1).map(|s| s.to_string()))
            .with_context(|| format!("no snapshot m-a in:\n{snaps}"))?;
        let prep = env.ctr_ok(
            NS,
            &[
                "snapshots",
                "--snapshotter",
                SNAPSHOTTER,
                "prepare",
                "--mounts",
                "m-dry",
                &parent,
            ],
        )?;

        // Publish in a fixed order: a commits, b merges, c conflicts.
        finish_detached(env, NS, "m-a")?;
        let a = ls_wait_json(env, NS, "m-a")?;
        ensure!(a["outcome"] == "committed", "m-a: {a:#}");
        finish_detached(env, NS, "m-b")?;
        let b = ls_wait_json(env, NS, "m-b")?;
        ensure!(b["outcome"] == "merged", "m-b: {b:#}");
        ensure!(paths_with(&b, "merged") == [CONF], "m-b paths: {b:#}");
        finish_detached(env, NS, "m-c")?;
        let out = layerstack_wait(env, NS, "m-c", &["--json", "--paths"])?;
        ensure!(
            out.status.code() == Some(3),
            "wait on a conflict exits 3: {}",
            describe(&out)
        );
        let c: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        ensure!(c["outcome"] == "conflict", "m-c: {c:#}");
        ensure!(c["state"] == "conflict", "m-c: {c:#}");
        ensure!(paths_with(&c, "conflict") == [CONF], "m-c paths: {c:#}");
        let reason = c["conflicts"][0]["reason"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        ensure!(
            reason.contains("same or adjacent lines"),
            "m-c reason: {reason}"
        );
        for id in ["m-a", "m-b", "m-c"] {
            remove_container(env, NS, id)?;
        }

        // The branch head now holds both merged edits, byte for byte.
        let expected = BASE
            .replace("key2 = two", "key2 = A")
            .replace("key7 = seven", "key7 = B");
        let got = conf_on_branch(env, "m-check")?;
        ensure!(
            got == expected.as_bytes(),
            "merged file:\n{:?}\nexpected:\n{expected:?}",
            String::from_utf8_lossy(&got)
        );

        // The raw snapshot on the old lease: edit a third hunk through its mount,
        // then ask for a dry run.
        let target = env.scratch().join("m-dry");
        mount_snapshot(&prep.stdout, &target)?;
        let file = target.join(CONF.trim_start_matches('/'));
        let edit = (|| -> Result<()> {
            let text = std::fs::read(&file)?;
            ensure!(
                text == BASE.as_bytes(),
                "the old lease shows the base version"
            );
            std::fs::write(&file, BASE.replace("key5 = five", "key5 = D"))?;
            Ok(())
        })();
        nix::mount::umount(&target).context("unmounting the snapshot")?;
        edit?;
        let out = ls_publish(env, NS, "m-dry", &["--dry-run", "--paths"])?;
        let text = stdout(&out);
        ensure!(
            out.status.success(),
            "publish --dry-run: {}",
            describe(&out)
        );
        ensure!(text.lines().next() == Some("merged"), "dry run: {text}");
        ensure!(
            text.contains(&format!("merged {CONF}: three-way merged text")),
            "dry run: {text}"
        );
        ensure!(
            text.contains("dry run, nothing was changed"),
            "dry run: {text}"
        );
        // Nothing changed: the session has no outcome, and publishing for real merges.
        let out = ls_publish(env, NS, "m-dry", &["--json"])?;
        let d: serde_json::Value =
            serde_json::from_slice(&out.stdout).with_context(|| describe(&out))?;
        ensure!(d["outcome"] == "merged", "m-dry: {d:#}");
        let expected = expected.replace("key5 = five", "key5 = D");
        let got = conf_on_branch(env, "m-check2")?;
        ensure!(
            got == expected.as_bytes(),
            "after the third merge: {:?}",
            String::from_utf8_lossy(&got)
        );
        env.ctr_ok(
            NS,
            &["snapshots", "--snapshotter", SNAPSHOTTER, "rm", "m-dry"],
        )?;
        Ok(())
    });
}
