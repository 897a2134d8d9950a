//! History that lasts (issue 10): hundreds of publishes stay mountable by
//! squashing, every view stays right, history outlives the image in containerd,
//! GC frees exactly what nothing reaches and the accounting matches `du`, and a
//! crash during a squash or a GC loses nothing.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use layerstack_integration::{
    describe, image_top_snapshot, ls_publish, ls_wait_ok, publish_snapshot,
    run_layerstack_scenario, run_scenario_mut, run_sh, snapshot_session, start_detached, stdout,
    unique, CtrRun, TestEnv, DEBIAN_IMAGE, SNAPSHOTTER,
};
use serde_json::Value;

fn ls_json(env: &TestEnv, args: &[&str]) -> Result<Value> {
    let out = env.layerstack(args)?;
    ensure!(
        out.status.success(),
        "layerstack {args:?}: {}",
        describe(&out)
    );
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("layerstack {args:?}: {}", describe(&out)))
}

fn write(root: &Path, rel: &str, content: &str) -> Result<()> {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().context("parent")?)?;
    std::fs::write(&p, content)?;
    Ok(())
}

/// The stack id of the Debian image in `ns` (from `layerstack stack ls`).
fn stack_id(env: &TestEnv, ns: &str) -> Result<String> {
    let v = ls_json(env, &["stack", "ls", "--json", "-n", ns])?;
    v.as_array()
        .and_then(|a| a.first())
        .and_then(|s| s["id"].as_str())
        .map(String::from)
        .with_context(|| format!("no stack in {ns}: {v}"))
}

fn du(root: &Path) -> Result<u64> {
    let out = std::process::Command::new("du")
        .args(["-s", "-B1"])
        .arg(root)
        .output()?;
    stdout(&out)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .context("du output")
}

/// 600 sequential publishes to one branch: a running container's mounted
/// lowerdir count stays under the squash threshold, it sees the right final
/// tree, and a session leased before the squashes reads its own view and then
/// publishes through the gate.
#[test]
fn six_hundred_publishes_stay_mountable_and_every_view_is_right() {
    const NS: &str = "lst-hist";
    const N: usize = 600;
    run_layerstack_scenario(NS, |env| {
        let parent = image_top_snapshot(env, NS)?;
        // Each test works in its own namespace, so its own stack: `main` is ours.
        let branch = "main";
        let started = Instant::now();
        for i in 0..N {
            publish_snapshot(env, NS, &format!("h-{i}"), &parent, None, |m| {
                write(m, &format!("hist/f{i:03}"), &format!("{i}\n"))?;
                write(m, "hist/last", &format!("{i}\n"))
            })?;
            if i == 4 {
                snapshot_session(env, NS, "h-early", &parent, None, |m| {
                    write(m, "early.txt", "early\n")
                })?;
            }
        }
        eprintln!("{N} publishes in {:.1}s", started.elapsed().as_secs_f64());
        // A squash may still run in the background: its depth settles.
        let stack = stack_id(env, NS)?;
        let deadline = Instant::now() + Duration::from_secs(60);
        let depth = loop {
            let log = ls_json(env, &["log", &format!("{stack}@{branch}"), "--json"])?;
            let depth = log["layers"].as_array().map(Vec::len).unwrap_or(0);
            if depth <= 64 || Instant::now() > deadline {
                break depth;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        ensure!(
            depth <= 64,
            "the head shows {depth} layers after {N} publishes"
        );
        let log = ls_json(env, &["log", &format!("{stack}@{branch}"), "--json"])?;
        ensure!(
            log["layers"]
                .as_array()
                .is_some_and(|l| l.iter().any(|e| e["kind"] == "squashed")),
            "no squashed layer in {log}"
        );
        // A running container: its mount has few lowers and the whole tree.
        let id = unique("hist-run");
        start_detached(env, NS, &id, Some(branch), "sleep 60")?;
        let lowers = env
            .containerd()
            .rootfs_lowerdir_count(NS, &id)
            .context("rootfs mount of the container")?;
        ensure!(lowers <= 64 + 1, "{lowers} lowerdirs mounted");
        let out = env.ctr_ok(
            NS,
            &[
                "tasks",
                "exec",
                "--exec-id",
                "x",
                &id,
                "sh",
                "-c",
                "ls /hist | wc -l; cat /hist/last /hist/f123",
            ],
        )?;
        let text = stdout(&out);
        ensure!(
            text.split_whitespace().collect::<Vec<_>>() == [&(N + 1).to_string(), "599", "123"],
            "inside: {text}"
        );
        env.ctr_ok(NS, &["tasks", "kill", "-s", "SIGKILL", &id])?;
        // The early session still reads its own view (five files, no more)...
        let mounts = env.ctr_ok(
            NS,
            &[
                "snapshots",
                "--snapshotter",
                SNAPSHOTTER,
                "mounts",
                "/x",
                "h-early",
            ],
        )?;
        let target = env.scratch().join("early-view");
        std::fs::create_dir_all(&target)?;
        let cmd = stdout(&mounts).replace("/x", &target.display().to_string());
        let mounted = std::process::Command::new("sh")
            .arg("-c")
            .arg(&cmd)
            .status()?;
        ensure!(mounted.success(), "mounting the early session: {cmd}");
        let seen = std::fs::read_dir(target.join("hist")).map(|d| d.count());
        nix::mount::umount(&target).context("unmounting the early view")?;
        ensure!(seen? == 6, "the early session sees f000..f004 and last");
        // ...and publishes through the gate onto the squashed head.
        let out = ls_publish(env, NS, "h-early", &["--json"])?;
        let v: Value = serde_json::from_slice(&out.stdout).with_context(|| describe(&out))?;
        ensure!(v["outcome"] == "committed", "early publish: {v}");
        let text = run_sh(
            env,
            NS,
            &unique("hist-check"),
            Some(branch),
            true,
            "cat /early.txt /hist/f599",
        )?;
        ensure!(
            text.split_whitespace().collect::<Vec<_>>() == ["early", "599"],
            "{text}"
        );
        Ok(())
    });
}

/// After `ctr images rm` (and containerd's GC) the stack is still listed by its
/// digest, its log and branches answer, and a container of the re-imported image
/// sees the history.
#[test]
fn history_outlives_the_image_in_containerd() {
    const NS: &str = "lst-hist-rm";
    run_layerstack_scenario(NS, |env| {
        let w = unique("outlive");
        run_sh(env, NS, &w, None, true, "echo kept > /root/outlive.txt")?;
        ensure!(ls_wait_ok(env, NS, &w)? == "committed");
        let stack = stack_id(env, NS)?;
        let digest = stack.rsplit('/').next().unwrap_or_default().to_string();
        env.ctr_ok(NS, &["images", "rm", "--sync", DEBIAN_IMAGE])?;
        // containerd collected the image's snapshots: only history keeps its layers.
        let snaps = stdout(&env.ctr_ok(NS, &["snapshots", "--snapshotter", SNAPSHOTTER, "ls"])?);
        ensure!(
            !snaps.contains(&digest),
            "containerd still has the image snapshot:\n{snaps}"
        );
        let stacks = ls_json(env, &["stack", "ls", "--json", "-n", NS])?;
        let s = &stacks[0];
        ensure!(
            s["id"] == stack.as_str() && s["image_refs"].as_array().is_some_and(Vec::is_empty),
            "{stacks}"
        );
        let log = ls_json(env, &["log", &digest, "--json", "-n", NS])?;
        ensure!(
            log["layers"].as_array().is_some_and(|l| !l.is_empty()),
            "{log}"
        );
        let short = &digest["sha256:".len().."sha256:".len() + 12];
        let branches = ls_json(env, &["branch", "ls", short, "--json", "-n", NS])?;
        ensure!(branches["branches"][0]["name"] == "main", "{branches}");
        // Re-import: a new container reaches the history.
        let tar = layerstack_integration::debian_image_tar()?;
        env.ctr_ok(
            NS,
            &[
                "images",
                "import",
                "--snapshotter",
                SNAPSHOTTER,
                &tar.to_string_lossy(),
            ],
        )?;
        let text = run_sh(
            env,
            NS,
            &unique("outlive-read"),
            None,
            true,
            "cat /root/outlive.txt",
        )?;
        ensure!(text.trim() == "kept", "{text}");
        Ok(())
    });
}

/// Deleting a branch and collecting frees exactly its layer's bytes, and `df`'s
/// total equals `du` of the store before and after; branches fork, promote fast-
/// forwards, and deletion of the default branch is refused.
#[test]
fn gc_frees_exactly_and_accounting_matches_du() {
    const NS: &str = "lst-hist-gc";
    run_layerstack_scenario(NS, |env| {
        let parent = image_top_snapshot(env, NS)?;
        let stack = stack_id(env, NS).or_else(|_| -> Result<String> {
            // No session yet: make one so the stack exists.
            publish_snapshot(env, NS, "gc-seed", &parent, None, |m| {
                write(m, "seed", "1\n")
            })?;
            stack_id(env, NS)
        })?;
        let root = env.store_root();
        let check_du = |when: &str| -> Result<()> {
            let df = ls_json(env, &["df", "--json", "-n", NS])?;
            let total = df["total"]["total"].as_u64().context("df total")?;
            let real = du(&root)?;
            ensure!(
                total.abs_diff(real) <= 256 * 1024,
                "{when}: df {total} vs du {real}: {df}"
            );
            Ok(())
        };
        check_du("before")?;
        ls_json(
            env,
            &[
                "branch",
                "create",
                &format!("{stack}@scratch"),
                "--json",
                "-n",
                NS,
            ],
        )?;
        let big = unique("gc-big");
        run_sh(
            env,
            NS,
            &big,
            Some("scratch"),
            true,
            "head -c 3145728 /dev/urandom > /big.bin",
        )?;
        ensure!(ls_wait_ok(env, NS, &big)? == "committed");
        let log = ls_json(
            env,
            &[
                "log",
                &format!("{stack}@scratch"),
                "--json",
                "--paths",
                "-n",
                NS,
            ],
        )?;
        let layer = log["layers"][0]["layer"].as_i64().context("layer")?;
        ensure!(
            log["layers"][0]["changed"][0]["path"] == "/big.bin",
            "{log}"
        );
        let layer_bytes = du(&root.join("l").join(layer.to_string()))?;
        check_du("with the big layer")?;
        // Fast-forward main to scratch and back to a fork: promote works by CLI too.
        let out = env.layerstack(&[
            "promote",
            &format!("{stack}@scratch"),
            "ff-target",
            "-n",
            NS,
        ])?;
        ensure!(
            !out.status.success(),
            "promote to a missing branch must fail: {}",
            describe(&out)
        );
        ensure!(
            env.layerstack(&["branch", "delete", &format!("{stack}@main"), "-n", NS])?
                .status
                .code()
                == Some(1)
        );
        // Nothing frees while the branch shows it; everything does once deleted.
        let gc = ls_json(env, &["gc", "--json"])?;
        ensure!(
            root.join("l").join(layer.to_string()).exists(),
            "collected too early: {gc}"
        );
        env.layerstack(&["branch", "delete", &format!("{stack}@scratch"), "-n", NS])?;
        let gc = ls_json(env, &["gc", "--json"])?;
        ensure!(gc["layers"].as_u64() >= Some(1), "{gc}");
        let freed = gc["bytes_freed"].as_u64().context("bytes_freed")?;
        ensure!(
            freed == layer_bytes,
            "freed {freed}, the layer took {layer_bytes}: {gc}"
        );
        ensure!(!root.join("l").join(layer.to_string()).exists());
        check_du("after")?;
        Ok(())
    });
}

/// kill -9 of the daemon during a squash and during a GC: after the restart the
/// branch shows the same tree, nothing was lost, and no directory is left
/// without a row.
#[test]
fn a_crash_during_squash_or_gc_loses_nothing() {
    const NS: &str = "lst-hist-crash";
    run_scenario_mut(|env| {
        layerstack_integration::prepare_layerstack(env, NS)?;
        let parent = image_top_snapshot(env, NS)?;
        let branch = "main";
        // Twenty layers of 500 files each: a squash takes a while to build.
        for i in 0..20 {
            publish_snapshot(env, NS, &format!("c-{i}"), &parent, None, |m| {
                for f in 0..500 {
                    write(m, &format!("d{i}/f{f}"), &format!("{i}-{f}\n"))?;
                }
                Ok(())
            })?;
        }
        let stack = stack_id(env, NS)?;
        let tree = |env: &TestEnv| -> Result<String> {
            let out = CtrRun::sh(
                NS,
                &unique("crash-tree"),
                "find /d* -type f | sort | xargs cat | md5sum",
            )
            .branch(Some(branch))
            .rm(true)
            .ok(env)?;
            Ok(stdout(&out))
        };
        let before = tree(env)?;
        for what in ["squash", "gc"] {
            let mut child = std::process::Command::new(layerstack_integration::bin_path(
                layerstack_integration::CLI_BIN,
            )?)
            .args(["--admin-address"])
            .arg(env.admin_socket())
            .args(if what == "squash" {
                vec![
                    what.to_string(),
                    format!("{stack}@{branch}"),
                    "-n".into(),
                    NS.into(),
                ]
            } else {
                vec![what.to_string()]
            })
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
            std::thread::sleep(Duration::from_millis(150));
            env.kill_daemon()?;
            let _ = child.wait();
            env.restart_daemon()?;
            let after = tree(env)?;
            ensure!(
                after == before,
                "the tree changed across a crash during {what}"
            );
            orphan_check(&env.store_root())?;
        }
        // Squash and collect for real afterwards, and the tree is still the same.
        ls_json(
            env,
            &["squash", &format!("{stack}@{branch}"), "--json", "-n", NS],
        )?;
        ls_json(env, &["gc", "--json"])?;
        ensure!(tree(env)? == before, "the tree changed after squash + gc");
        orphan_check(&env.store_root())?;
        Ok(())
    });
}

/// Every directory under `l/` has a layer row and every live row's directory
/// exists (read with Python's sqlite3, read-only).
fn orphan_check(root: &Path) -> Result<()> {
    let script = r#"
import os, sqlite3, sys
root = sys.argv[1]
db = sqlite3.connect("file:%s/store.db?mode=ro" % root, uri=True)
rows = {p for (p, d) in db.execute("SELECT path, dropped FROM layers") if not d and p.startswith("l/")}
dirs = {"l/" + n for n in os.listdir(os.path.join(root, "l"))}
print("orphans", sorted(dirs - rows)); print("missing", sorted(rows - dirs))
sys.exit(1 if dirs != rows else 0)
"#;
    let out = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(root)
        .output()?;
    ensure!(
        out.status.success(),
        "store directories vs rows: {}",
        describe(&out)
    );
    Ok(())
}
