//! History that lasts (issue 10): hundreds of publishes stay mountable by
//! squashing, every view stays right, history outlives the image in containerd,
//! GC frees exactly what nothing reaches and the accounting matches `du`, and a
//! crash during a squash or a GC loses nothing.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use layerstack_integration::{
    describe, image_top_snapshot, ls_publish, ls_wait_ok, poll, publish_snapshot,
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
        // `df`'s columns are the documented class names.
        let out = env.layerstack(&["df", "-n", NS])?;
        let header: Vec<String> = stdout(&out)
            .lines()
            .next()
            .unwrap_or("")
            .split_whitespace()
            .map(str::to_string)
            .collect();
        ensure!(
            header
                == [
                    "STACK",
                    "HOT",
                    "COLD",
                    "UPPERS",
                    "STAGING",
                    "METADATA",
                    "SNAPSHOTS",
                    "TOTAL"
                ],
            "{}",
            describe(&out)
        );
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
        // `ctr snapshots usage` of a session shows its upper's real bytes.
        snapshot_session(env, NS, "usage-probe", &parent, None, |m| {
            std::fs::write(m.join("big"), vec![7u8; 3 << 20])?;
            Ok(())
        })?;
        let u = env.ctr_ok(
            NS,
            &[
                "snapshots",
                "--snapshotter",
                SNAPSHOTTER,
                "usage",
                "usage-probe",
            ],
        )?;
        let line = stdout(&u)
            .lines()
            .find(|l| l.starts_with("usage-probe"))
            .map(str::to_string)
            .with_context(|| format!("no usage line: {}", describe(&u)))?;
        ensure!(
            line.contains("3.0 MiB") || line.contains("3.0MiB"),
            "a session's usage is its upper's bytes: {line:?}"
        );
        env.ctr_ok(
            NS,
            &[
                "snapshots",
                "--snapshotter",
                SNAPSHOTTER,
                "rm",
                "usage-probe",
            ],
        )?;
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
                "the tree changed across a crash during {what}: {before:?} before, {after:?} after"
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

// ---------------------------------------------------------------------------
// Blame, diff, conflicts (issue 10)
// ---------------------------------------------------------------------------

/// Line ranges with their owner: `(start, end, owner)`.
type Ranges = Vec<(u64, u64, String)>;

/// The ranges of `layerstack blame --json`, and the whole answer.
fn blame_ranges(env: &TestEnv, ns: &str, spec: &str, path: &str) -> Result<(Ranges, Value)> {
    let v = ls_json(env, &["blame", spec, path, "--json", "-n", ns])?;
    let ranges = v["ranges"]
        .as_array()
        .with_context(|| format!("no ranges: {v}"))?
        .iter()
        .map(|r| {
            (
                r["start"].as_u64().unwrap_or(0),
                r["end"].as_u64().unwrap_or(0),
                r["owner"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    Ok((ranges, v))
}

fn lines_of(n: usize, edits: &[(usize, &str)]) -> String {
    (1..=n)
        .map(|i| {
            let l = edits
                .iter()
                .find(|(at, _)| *at == i)
                .map_or_else(|| i.to_string(), |(_, s)| s.to_string());
            format!("{l}\n")
        })
        .collect()
}

/// Blame of a file edited by three sessions — two of them leased on the same
/// head (their hunks merged), one later overwriting other lines — names every
/// line's owner, before and after `layerstack squash` (and a GC); a file of
/// the image is `original`.
#[test]
fn blame_of_a_file_edited_by_three_sessions_survives_squash() {
    const NS: &str = "lst-blame";
    run_layerstack_scenario(NS, |env| {
        let parent = image_top_snapshot(env, NS)?;
        let file = "srv/blame.txt";
        ensure!(
            publish_snapshot(env, NS, "bl-seed", &parent, None, |m| write(
                m,
                file,
                &lines_of(10, &[])
            ))? == "committed"
        );
        // Two sessions on the same head: separate hunks, merged.
        snapshot_session(env, NS, "bl-s1", &parent, None, |m| {
            write(m, file, &lines_of(10, &[(2, "two-s1")]))
        })?;
        snapshot_session(env, NS, "bl-s2", &parent, None, |m| {
            write(m, file, &lines_of(10, &[(8, "eight-s2")]))
        })?;
        for (key, want) in [("bl-s1", "committed"), ("bl-s2", "merged")] {
            let out = ls_publish(env, NS, key, &[])?;
            ensure!(
                layerstack_integration::first_word(&out) == want,
                "{key}: {}",
                describe(&out)
            );
            env.ctr_ok(NS, &["snapshots", "--snapshotter", SNAPSHOTTER, "rm", key])?;
        }
        // A later session overwrites lines 4 and 5.
        ensure!(
            publish_snapshot(env, NS, "bl-s3", &parent, None, |m| write(
                m,
                file,
                &lines_of(
                    10,
                    &[
                        (2, "two-s1"),
                        (4, "four-s3"),
                        (5, "five-s3"),
                        (8, "eight-s2")
                    ]
                )
            ))? == "committed"
        );
        let stack = stack_id(env, NS)?;
        let want: Ranges = [
            (1, 1, "session:bl-seed"),
            (2, 2, "session:bl-s1"),
            (3, 3, "session:bl-seed"),
            (4, 5, "session:bl-s3"),
            (6, 7, "session:bl-seed"),
            (8, 8, "session:bl-s2"),
            (9, 10, "session:bl-seed"),
        ]
        .iter()
        .map(|(a, b, o)| (*a, *b, o.to_string()))
        .collect();
        let spec = format!("{stack}@main");
        let (got, v) = blame_ranges(env, NS, &spec, "/srv/blame.txt")?;
        ensure!(got == want, "before squash: {v}");
        ensure!(v["lines"] == 10 && v["layer_kind"] == "published", "{v}");
        // The text form.
        let out = env.layerstack(&["blame", &spec, "/srv/blame.txt", "-n", NS])?;
        let text = stdout(&out);
        ensure!(
            text.lines()
                .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["4-5", "session:bl-s3"]),
            "{text}"
        );
        // A file of the image.
        let (got, v) = blame_ranges(env, NS, &spec, "/etc/debian_version")?;
        ensure!(
            got.len() == 1 && got[0].2 == "original" && v["layer_kind"] == "base",
            "{v}"
        );
        // Enough layers on top that the squash (keeping the newest 8) takes the
        // three sessions' layers; then collect.
        for i in 0..9 {
            publish_snapshot(env, NS, &format!("bl-fill-{i}"), &parent, None, |m| {
                write(m, &format!("srv/fill-{i}"), "x\n")
            })?;
        }
        let sq = ls_json(env, &["squash", &spec, "--json", "-n", NS])?;
        ensure!(sq["squashed"] == true, "{sq}");
        ls_json(env, &["gc", "--json"])?;
        let (got, v) = blame_ranges(env, NS, &spec, "/srv/blame.txt")?;
        ensure!(got == want, "after squash: {v}");
        ensure!(v["layer_kind"] == "squashed", "{v}");
        // Binary and missing files are refused with a reason.
        let out = env.layerstack(&["blame", &spec, "/srv/none", "-n", NS])?;
        ensure!(out.status.code() == Some(1), "{}", describe(&out));
        Ok(())
    });
}

/// `layerstack diff` between two branch heads (with patches), a head against a
/// layer of its log, and a running container's session (read-only: it keeps
/// running and nothing is published).
#[test]
fn diff_between_heads_and_of_a_running_container() {
    const NS: &str = "lst-diff";
    run_layerstack_scenario(NS, |env| {
        let parent = image_top_snapshot(env, NS)?;
        publish_snapshot(env, NS, "df-seed", &parent, None, |m| {
            write(m, "srv/d/keep.txt", "1\n2\n3\n")?;
            write(m, "srv/d/mode.txt", "m\n")?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(
                m.join("srv/d/mode.txt"),
                std::fs::Permissions::from_mode(0o644),
            )?;
            write(m, "srv/d/gone.txt", "bye\n")
        })?;
        let stack = stack_id(env, NS)?;
        ls_json(
            env,
            &[
                "branch",
                "create",
                &format!("{stack}@feature"),
                "--json",
                "-n",
                NS,
            ],
        )?;
        // (ctr 1.6's `snapshots prepare` sets no labels: a container on the branch.)
        let f1 = unique("df-f1");
        run_sh(
            env,
            NS,
            &f1,
            Some("feature"),
            true,
            "printf '1\\ntwo\\n3\\n' > /srv/d/keep.txt; echo new > /srv/d/new.txt; rm /srv/d/gone.txt; chmod 600 /srv/d/mode.txt",
        )?;
        ensure!(ls_wait_ok(env, NS, &f1)? == "committed");
        let files = |v: &Value| -> Vec<(String, String)> {
            v["entries"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter(|e| e["old"]["kind"] != "dir" && e["new"]["kind"] != "dir")
                        .map(|e| {
                            (
                                e["path"].as_str().unwrap_or("").to_string(),
                                e["change"].as_str().unwrap_or("").to_string(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default()
        };
        let want: Vec<(String, String)> = [
            ("/srv/d/gone.txt", "deleted"),
            ("/srv/d/keep.txt", "modified"),
            ("/srv/d/mode.txt", "modified"),
            ("/srv/d/new.txt", "added"),
        ]
        .iter()
        .map(|(p, c)| (p.to_string(), c.to_string()))
        .collect();
        let v = ls_json(
            env,
            &[
                "diff",
                &format!("{stack}@main"),
                "@feature",
                "--patch",
                "--json",
                "-n",
                NS,
            ],
        )?;
        ensure!(files(&v) == want, "{v}");
        let keep = v["entries"]
            .as_array()
            .and_then(|a| a.iter().find(|e| e["path"] == "/srv/d/keep.txt"))
            .context("keep.txt")?;
        ensure!(
            keep["patch"]
                .as_str()
                .is_some_and(|p| p.contains("-2\n+two\n")),
            "{keep}"
        );
        // The text form with patches.
        let out = env.layerstack(&[
            "diff",
            &format!("{stack}@main"),
            &format!("{stack}@feature"),
            "--patch",
            "-n",
            NS,
        ])?;
        let text = stdout(&out);
        ensure!(
            text.contains("+++ b/srv/d/keep.txt") && text.contains("+two"),
            "{text}"
        );
        // A mode-only change names the modes, with and without --patch.
        let mode_line = |t: &str| {
            t.lines()
                .find(|l| l.contains("/srv/d/mode.txt"))
                .map(str::to_string)
        };
        ensure!(
            mode_line(&text).is_some_and(
                |l| l.starts_with("M ") && l.ends_with("/srv/d/mode.txt  mode 0644 → 0600")
            ),
            "{text}"
        );
        let out = env.layerstack(&["diff", &format!("{stack}@main"), "@feature", "-n", NS])?;
        let text = stdout(&out);
        ensure!(
            mode_line(&text).is_some_and(|l| l.ends_with("mode 0644 → 0600")),
            "{text}"
        );
        // feature's head against its log at the seed's layer: the same changes;
        // at its newest layer: none.
        let log = ls_json(
            env,
            &["log", &format!("{stack}@feature"), "--json", "-n", NS],
        )?;
        let layer = |i: usize| log["layers"][i]["layer"].as_i64().unwrap_or(0).to_string();
        let v = ls_json(
            env,
            &[
                "diff",
                &format!("{stack}@feature"),
                "--at",
                &layer(1),
                "--json",
                "-n",
                NS,
            ],
        )?;
        ensure!(files(&v) == want, "{v}");
        let v = ls_json(
            env,
            &[
                "diff",
                &format!("{stack}@feature"),
                "--at",
                &layer(0),
                "--json",
                "-n",
                NS,
            ],
        )?;
        ensure!(v["entries"].as_array().is_some_and(Vec::is_empty), "{v}");
        // At the base: the image alone against feature's head — everything the
        // seed and feature published, as added; a branch forks there too.
        let v = ls_json(
            env,
            &[
                "diff",
                &format!("{stack}@feature"),
                "--at",
                "base",
                "--json",
                "-n",
                NS,
            ],
        )?;
        let base_want: Vec<(String, String)> =
            ["/srv/d/keep.txt", "/srv/d/mode.txt", "/srv/d/new.txt"]
                .iter()
                .map(|p| (p.to_string(), "added".to_string()))
                .collect();
        ensure!(files(&v) == base_want, "{v}");
        let b = ls_json(
            env,
            &[
                "branch",
                "create",
                &format!("{stack}@pristine"),
                "--from",
                "feature",
                "--at",
                "base",
                "--json",
                "-n",
                NS,
            ],
        )?;
        ensure!(b["depth"] == 0, "{b}");
        let v = ls_json(
            env,
            &[
                "diff",
                &format!("{stack}@pristine"),
                "@main",
                "--json",
                "-n",
                NS,
            ],
        )?;
        let seed: Vec<(String, String)> = ["/srv/d/gone.txt", "/srv/d/keep.txt", "/srv/d/mode.txt"]
            .iter()
            .map(|p| (p.to_string(), "added".to_string()))
            .collect();
        ensure!(files(&v) == seed, "{v}");
        let out = env.layerstack(&[
            "diff",
            &format!("{stack}@feature"),
            "--at",
            "head",
            "-n",
            NS,
        ])?;
        ensure!(
            out.status.code() == Some(2) && String::from_utf8_lossy(&out.stderr).contains("`base`"),
            "{}",
            describe(&out)
        );

        // A running container: its writes show up as they are made.
        let id = unique("df-live");
        start_detached(
            env,
            NS,
            &id,
            None,
            "echo live > /root/live.txt; rm /srv/d/keep.txt; sleep 120",
        )?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let v = loop {
            let v = ls_json(env, &["diff", &id, "--json", "-n", NS])?;
            let f = files(&v);
            if f.contains(&("/root/live.txt".into(), "added".into()))
                && f.contains(&("/srv/d/keep.txt".into(), "deleted".into()))
                || Instant::now() > deadline
            {
                break v;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        let f = files(&v);
        ensure!(
            f.contains(&("/root/live.txt".into(), "added".into()))
                && f.contains(&("/srv/d/keep.txt".into(), "deleted".into())),
            "{v}"
        );
        let (status, _) = layerstack_integration::task_status(env, NS, &id)?;
        ensure!(
            status.as_deref() == Some("RUNNING"),
            "the diff stopped the task: {status:?}"
        );
        let s = layerstack_integration::session(env, NS, &id)?;
        ensure!(s["outcome"].is_null(), "a diff published something: {s}");
        layerstack_integration::kill_task(env, NS, &id)?;
        layerstack_integration::finish_detached(env, NS, &id)?;
        ensure!(ls_wait_ok(env, NS, &id)? == "committed");
        Ok(())
    });
}

/// The conflict flow with a real container: its publish conflicts with the
/// head; `conflict show` gives the reason and the three-way view; `session
/// rebase` merges the head's other change and writes markers; a publish is
/// refused while they are there; the container's next run (same container,
/// `ctr tasks start`) edits a line inside the marker block — still refused,
/// naming the file and the first marker line; the run after that removes the
/// markers, and its publish commits.
#[test]
fn the_conflict_flow_show_rebase_resolve_publish() {
    const NS: &str = "lst-conflict";
    run_layerstack_scenario(NS, |env| {
        let parent = image_top_snapshot(env, NS)?;
        let file = "srv/c/conf.txt";
        publish_snapshot(env, NS, "cf-seed", &parent, None, |m| {
            write(m, file, &lines_of(6, &[]))
        })?;
        // The container edits line 2 and waits; its second run (markers there)
        // edits a line inside the marker block; its third removes the block.
        let id = unique("cf-a");
        let script = "f=/srv/c/conf.txt; \
            if grep -q '^<<<<<<< session$' $f && [ -e /root/edited ]; then \
              sed -i '/^<<<<<<< session$/,/^>>>>>>> head$/c resolved' $f; \
            elif grep -q '^<<<<<<< session$' $f; then \
              sed -i 's/^two-A$/two-A-edited/' $f; touch /root/edited; \
            else sed -i 's/^2$/two-A/' $f; sleep 120; fi";
        start_detached(env, NS, &id, None, script)?;
        // Meanwhile the head changes line 2 (conflict) and line 5 (merges).
        ensure!(
            publish_snapshot(env, NS, "cf-b", &parent, None, |m| write(
                m,
                file,
                &lines_of(6, &[(2, "two-B"), (5, "five-B")])
            ))? == "committed"
        );
        layerstack_integration::kill_task(env, NS, &id)?;
        layerstack_integration::finish_detached(env, NS, &id)?;
        let (word, out) = layerstack_integration::ls_wait(env, NS, &id)?;
        ensure!(word == "conflict", "{}", describe(&out));

        let v = ls_json(env, &["conflict", "show", &id, "--json", "-n", NS])?;
        let p = &v["paths"][0];
        ensure!(
            v["paths"].as_array().map(Vec::len) == Some(1)
                && p["path"] == "/srv/c/conf.txt"
                && p["blocks"] == 1
                && p["reason"].as_str().is_some_and(|r| r.contains("adjacent")),
            "{v}"
        );
        let text = p["text"].as_str().unwrap_or("");
        ensure!(
            text == "1\n<<<<<<< session\ntwo-A\n||||||| lease\n2\n=======\ntwo-B\n>>>>>>> head\n3\n4\nfive-B\n6\n",
            "{text}"
        );
        let out = env.layerstack(&["conflict", "show", &id, "-n", NS])?;
        ensure!(
            stdout(&out).contains("<<<<<<< session"),
            "{}",
            describe(&out)
        );

        // The run's conflict is announced once (one log line, counted once).
        let sid = layerstack_integration::session(env, NS, &id)?["id"]
            .as_i64()
            .context("session id")?;
        let run1 = [
            format!("session.id={sid} run=1 "),
            "outcome=\"conflict\"".into(),
        ];
        let run1: Vec<&str> = run1.iter().map(String::as_str).collect();
        let addr = layerstack_integration::metrics_address(env)?;
        poll(Duration::from_secs(20), || {
            Ok((layerstack_integration::outcome_lines(env, &run1)?.len() == 1).then_some(()))
        })?
        .context("no `publish outcome` line for the conflict")?;
        let conflicts0 = layerstack_integration::publishes_total(&addr, "conflict")?;

        let v = ls_json(env, &["session", "rebase", &id, "--json", "-n", NS])?;
        ensure!(
            v["marked"][0]["path"] == "/srv/c/conf.txt" && v["marked"][0]["blocks"] == 1,
            "{v}"
        );
        // Shown after the rebase: the markers in the session's file, awaiting
        // resolution, counted; not a stale "0 conflict block(s)".
        let v = ls_json(env, &["conflict", "show", &id, "--json", "-n", NS])?;
        let p = &v["paths"][0];
        ensure!(
            p["blocks"] == 1
                && p["reason"]
                    .as_str()
                    .is_some_and(|r| r.starts_with("awaiting resolution"))
                && p["text"].as_str()
                    == Some("1\n<<<<<<< session\ntwo-A\n||||||| lease\n2\n=======\ntwo-B\n>>>>>>> head\n3\n4\nfive-B\n6\n"),
            "{v}"
        );
        let out = env.layerstack(&["conflict", "show", &id, "-n", NS])?;
        let text = stdout(&out);
        ensure!(
            text.contains("1 conflict marker block(s) awaiting resolution")
                && !text.contains("0 conflict block(s)")
                && !text.contains("adjacent"),
            "{}",
            describe(&out)
        );
        // Refused while the markers are there.
        let out = ls_publish(env, NS, &id, &[])?;
        ensure!(
            out.status.code() == Some(3) && stdout(&out).contains("conflict markers"),
            "{}",
            describe(&out)
        );
        // The rebase announced no outcome: the refused publish is the run's
        // second recorded outcome (events are handled in order, so once its
        // line is there a rebase's would be too).
        let lines = poll(Duration::from_secs(20), || {
            let l = layerstack_integration::outcome_lines(env, &run1)?;
            Ok(l.iter()
                .any(|l| l.contains("conflict markers"))
                .then_some(l))
        })?
        .context("no `publish outcome` line for the refused publish")?;
        ensure!(
            lines.len() == 2,
            "one line per recorded outcome:\n{}",
            lines.join("\n")
        );
        let conflicts = layerstack_integration::publishes_total(&addr, "conflict")?;
        ensure!(
            conflicts == conflicts0 + 1.0,
            "conflict outcomes counted {conflicts0} -> {conflicts}: a rebase is not an outcome"
        );
        // The same container runs again: it sees the head under its changes and
        // edits a line inside the block. The block is still there: refused,
        // naming the file and the line of `<<<<<<< session`; a dry run too.
        env.ctr_ok(NS, &["tasks", "start", "-d", &id])?;
        layerstack_integration::finish_detached(env, NS, &id)?;
        let (word, out) = layerstack_integration::ls_wait(env, NS, &id)?;
        ensure!(word == "conflict", "{}", describe(&out));
        let v = layerstack_integration::ls_wait_json(env, NS, &id)?;
        let text = v.to_string();
        ensure!(
            text.contains("/srv/c/conf.txt")
                && text.contains("conflict markers")
                && text.contains("at line 2"),
            "{v}"
        );
        let upper = layerstack_integration::session_upper(
            env,
            &layerstack_integration::session(env, NS, &id)?,
        )?;
        let edited = std::fs::read_to_string(upper.join(file))?;
        ensure!(edited.contains("two-A-edited\n"), "{edited}");
        let out = ls_publish(env, NS, &id, &["--dry-run"])?;
        ensure!(
            out.status.code() == Some(3) && stdout(&out).contains("line 2"),
            "{}",
            describe(&out)
        );
        // The third run removes the block, and its publish goes through the gate.
        env.ctr_ok(NS, &["tasks", "start", "-d", &id])?;
        layerstack_integration::finish_detached(env, NS, &id)?;
        ensure!(ls_wait_ok(env, NS, &id)? == "committed");
        let text = run_sh(
            env,
            NS,
            &unique("cf-check"),
            None,
            true,
            "cat /srv/c/conf.txt",
        )?;
        ensure!(text == "1\nresolved\n3\n4\nfive-B\n6\n", "{text}");
        let stack = stack_id(env, NS)?;
        let (got, v) = blame_ranges(env, NS, &format!("{stack}@main"), "/srv/c/conf.txt")?;
        let owners: Vec<&str> = got.iter().map(|r| r.2.as_str()).collect();
        ensure!(
            got.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>()
                == [(1, 1), (2, 2), (3, 4), (5, 5), (6, 6)]
                && owners
                    == [
                        "session:cf-seed",
                        &format!("session:{id}"),
                        "session:cf-seed",
                        "session:cf-b",
                        "session:cf-seed"
                    ],
            "{v}"
        );
        Ok(())
    });
}

/// The head manifest of `branch` of `stack` (`layerstack branch ls --json`).
fn branch_head(env: &TestEnv, ns: &str, stack: &str, branch: &str) -> Result<i64> {
    let v = ls_json(env, &["branch", "ls", stack, "--json", "-n", ns])?;
    v["branches"]
        .as_array()
        .and_then(|a| a.iter().find(|b| b["name"] == branch))
        .and_then(|b| b["head"].as_i64())
        .with_context(|| format!("no branch {branch}: {v}"))
}

/// A promote refused whole by a conflict: its operation's run has one outcome,
/// `conflict` — one `publish outcome` line, counted once, no `discarded` after
/// it; `session ls` shows the operation's session in conflict, released, its
/// upper gone; the message names the conflicting path and says that main is
/// unchanged and nothing of the promote is kept.
#[test]
fn a_refused_promote_is_one_outcome_and_keeps_nothing() {
    const NS: &str = "lst-promote";
    run_layerstack_scenario(NS, |env| {
        let parent = image_top_snapshot(env, NS)?;
        publish_snapshot(env, NS, "pr-seed", &parent, None, |m| {
            write(m, "srv/p/conf.txt", &lines_of(6, &[]))
        })?;
        let stack = stack_id(env, NS)?;
        ls_json(
            env,
            &[
                "branch",
                "create",
                &format!("{stack}@dev"),
                "--json",
                "-n",
                NS,
            ],
        )?;
        let d = unique("pr-dev");
        run_sh(
            env,
            NS,
            &d,
            Some("dev"),
            true,
            "sed -i 's/^2$/two-dev/' /srv/p/conf.txt",
        )?;
        ensure!(ls_wait_ok(env, NS, &d)? == "committed");
        let m = unique("pr-main");
        run_sh(
            env,
            NS,
            &m,
            None,
            true,
            "sed -i 's/^2$/two-main/' /srv/p/conf.txt",
        )?;
        ensure!(ls_wait_ok(env, NS, &m)? == "committed");

        let addr = layerstack_integration::metrics_address(env)?;
        // The outcomes above are counted asynchronously: let them settle.
        std::thread::sleep(Duration::from_millis(500));
        let conflicts0 = layerstack_integration::publishes_total(&addr, "conflict")?;
        let discarded0 = layerstack_integration::publishes_total(&addr, "discarded")?;
        let main0 = branch_head(env, NS, &stack, "main")?;
        let out = env.layerstack(&[
            "promote",
            &format!("{stack}@dev"),
            "main",
            "--json",
            "-n",
            NS,
        ])?;
        ensure!(out.status.code() == Some(3), "{}", describe(&out));
        let v: Value = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("promote --json: {}", describe(&out)))?;
        let msg = v["message"].as_str().unwrap_or("");
        ensure!(
            v["result"] == "conflict"
                && msg.contains("/srv/p/conf.txt")
                && msg.contains("main is unchanged")
                && msg.contains("nothing of the promote is kept")
                && !msg.contains("upper is kept"),
            "{v}"
        );
        ensure!(branch_head(env, NS, &stack, "main")? == main0, "main moved");
        let s = &v["session"];
        let sid = s["id"].as_i64().context("session id")?;
        ensure!(
            s["outcome"] == "conflict" && s["state"] == "conflict" && s["released"] == true,
            "{v}"
        );
        ensure!(
            !env.store_root().join("s").join(sid.to_string()).exists(),
            "the operation's upper is dropped, as its message says"
        );
        let all = ls_json(
            env,
            &["session", "ls", "-A", "--json", "--owner", "operation"],
        )?;
        let op = all
            .as_array()
            .and_then(|a| a.iter().find(|x| x["id"] == sid))
            .with_context(|| format!("session {sid} not listed: {all}"))?;
        ensure!(
            op["state"] == "conflict"
                && op["outcome"] == "conflict"
                && op["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("nothing is kept") && !m.contains("upper is kept")),
            "{op}"
        );
        // One announcement: the conflict (the run's discard used to follow it).
        let key = format!("session.id={sid} ");
        poll(Duration::from_secs(20), || {
            Ok((!layerstack_integration::outcome_lines(env, &[&key])?.is_empty()).then_some(()))
        })?
        .context("no `publish outcome` line for the promote")?;
        std::thread::sleep(Duration::from_secs(1));
        let lines = layerstack_integration::outcome_lines(env, &[&key])?;
        ensure!(
            lines.len() == 1 && lines[0].contains("outcome=\"conflict\""),
            "one line for the operation's run:\n{}",
            lines.join("\n")
        );
        let conflicts = layerstack_integration::publishes_total(&addr, "conflict")?;
        let discarded = layerstack_integration::publishes_total(&addr, "discarded")?;
        ensure!(
            (conflicts, discarded) == (conflicts0 + 1.0, discarded0),
            "counted conflict {conflicts0} -> {conflicts}, discarded {discarded0} -> {discarded}"
        );

        // Branch names are checked as git checks a ref: `../../etc` is refused,
        // `feature/x` is fine.
        let out = env.layerstack(&["branch", "create", &format!("{stack}@../../etc"), "-n", NS])?;
        ensure!(
            out.status.code() == Some(1) && describe(&out).contains("invalid branch name"),
            "{}",
            describe(&out)
        );
        ls_json(
            env,
            &[
                "branch",
                "create",
                &format!("{stack}@feature/x"),
                "--json",
                "-n",
                NS,
            ],
        )?;
        // TO may be written BRANCH, @BRANCH or STACK@BRANCH (by stack id or
        // image reference), as diff's second side.
        ls_json(
            env,
            &[
                "branch",
                "create",
                &format!("{stack}@ff"),
                "--json",
                "-n",
                NS,
            ],
        )?;
        let from = format!("{stack}@main");
        for to in [
            "ff".to_string(),
            "@ff".to_string(),
            format!("{stack}@ff"),
            format!("{DEBIAN_IMAGE}@ff"),
        ] {
            let v = ls_json(env, &["promote", &from, &to, "--json", "-n", NS])?;
            ensure!(v["result"] == "up-to-date", "promote {from} {to}: {v}");
        }
        // Another stack is refused, naming both.
        layerstack_integration::import_checked(
            env,
            NS,
            &layerstack_integration::busybox_image_tar()?,
            SNAPSHOTTER,
            layerstack_integration::BUSYBOX_IMAGE,
        )?;
        let b = unique("pr-busybox");
        CtrRun::sh(NS, &b, "echo b > /b.txt")
            .image(layerstack_integration::BUSYBOX_IMAGE)
            .rm(true)
            .ok(env)?;
        ensure!(ls_wait_ok(env, NS, &b)? == "committed");
        let all = ls_json(env, &["stack", "ls", "--json", "-n", NS])?;
        let other = all
            .as_array()
            .and_then(|a| {
                a.iter()
                    .filter_map(|s| s["id"].as_str())
                    .find(|id| *id != stack)
            })
            .with_context(|| format!("no second stack: {all}"))?
            .to_string();
        let out = env.layerstack(&["promote", &from, &format!("{other}@main"), "-n", NS])?;
        let text = describe(&out);
        ensure!(
            out.status.code() == Some(1)
                && text.contains("within one stack")
                && text.contains(&stack)
                && text.contains(&other),
            "{text}"
        );
        ensure!(branch_head(env, NS, &stack, "main")? == main0, "main moved");
        Ok(())
    });
}

/// `stack rm --force` of a stack a stopped container still uses: starting the
/// container again is refused as a failed precondition naming its snapshot,
/// the removal and what to do (remove the container), never as a corrupt
/// store; `ctr containers rm` then works.
#[test]
fn a_container_of_a_force_removed_stack_is_refused_by_name() {
    const NS: &str = "lst-stackrm";
    run_layerstack_scenario(NS, |env| {
        let id = unique("rm-k");
        run_sh(env, NS, &id, None, false, "echo kept > /root/k.txt")?;
        ensure!(ls_wait_ok(env, NS, &id)? == "committed");
        let stack = stack_id(env, NS)?;
        // `stack ls` says that its sizes need --usage, and measures with it.
        let out = env.layerstack(&["stack", "ls", "-n", NS])?;
        let text = stdout(&out);
        let row = |t: &str| t.lines().nth(1).unwrap_or("").trim_end().to_string();
        ensure!(
            text.lines()
                .next()
                .is_some_and(|h| h.ends_with("BYTES(--usage)"))
                && row(&text).ends_with(" -"),
            "{}",
            describe(&out)
        );
        let out = env.layerstack(&["stack", "ls", "--usage", "-n", NS])?;
        let text = stdout(&out);
        ensure!(
            text.lines().next().is_some_and(|h| h.ends_with("BYTES")) && row(&text).ends_with("iB"),
            "{}",
            describe(&out)
        );
        let help = stdout(&env.layerstack(&["stack", "ls", "--help"])?);
        ensure!(
            help.contains("--usage")
                && help.contains("`usage` is null")
                && help.contains("appears once a container or session has used the image"),
            "{help}"
        );
        let out = env.layerstack(&["stack", "rm", &stack, "--force", "-n", NS])?;
        ensure!(out.status.success(), "{}", describe(&out));
        let out = env.ctr(NS, &["tasks", "start", &id])?;
        let text = describe(&out);
        ensure!(
            !out.status.success()
                && text.contains(&format!("/{id} is the rootfs of a container"))
                && text.contains("`layerstack stack rm --force`")
                && text.contains(&format!("`ctr -n {NS} containers rm {id}`"))
                && !text.contains("corrupt"),
            "{text}"
        );
        env.ctr_ok(NS, &["containers", "rm", &id])?;
        Ok(())
    });
}

/// The tester's repro: b4 forks, main deletes a file b4's fork point had and
/// edits another, publishes 9 more times, squashes. Promote merges b4's one
/// path (the deleted file stays deleted) and b2's without a conflict; the log
/// lists the squash's members with who published them; a member's id is
/// accepted by `diff --at` and `branch create --at`.
#[test]
fn promote_log_and_at_after_a_squash() {
    const NS: &str = "lst-hist-squash";
    run_layerstack_scenario(NS, |env| {
        let publish = |branch: Option<&str>, script: &str| -> Result<()> {
            let id = unique("sq");
            run_sh(env, NS, &id, branch, true, script)?;
            let word = ls_wait_ok(env, NS, &id)?;
            ensure!(word == "committed", "{script}: {word}");
            Ok(())
        };
        publish(None, "echo new > /root/new.txt; echo g0 > /root/g.txt")?;
        let stack = stack_id(env, NS)?;
        for b in ["b4", "b2"] {
            ls_json(
                env,
                &[
                    "branch",
                    "create",
                    &format!("{stack}@{b}"),
                    "--json",
                    "-n",
                    NS,
                ],
            )?;
        }
        publish(Some("b4"), "echo b4 > /root/b4.txt")?;
        publish(Some("b2"), "echo b2 > /root/b2.txt")?;
        publish(None, "rm /root/new.txt")?;
        publish(None, "echo g1 > /root/g.txt")?;
        for i in 0..9 {
            publish(None, &format!("echo m > /root/m{i}"))?;
        }
        let sq = ls_json(env, &["squash", &stack, "--json", "-n", NS])?;
        ensure!(sq["squashed"] == true, "{sq}");
        let promote = |from: &str| -> Result<Value> {
            ls_json(
                env,
                &[
                    "promote",
                    &format!("{stack}@{from}"),
                    "main",
                    "--json",
                    "-n",
                    NS,
                ],
            )
        };
        let r = promote("b4")?;
        ensure!(r["result"] == "merged", "{r}");
        let msg = r["message"].as_str().unwrap_or_default();
        ensure!(
            msg.starts_with("1 path(s): 1 clean"),
            "b4 changed one path: {r}"
        );
        let r = promote("b2")?;
        ensure!(r["result"] == "merged", "no conflict on g.txt: {r}");
        let text = run_sh(
            env,
            NS,
            &unique("sq-check"),
            None,
            true,
            "ls /root; cat /root/g.txt",
        )?;
        let words: Vec<&str> = text.split_whitespace().collect();
        ensure!(
            !words.contains(&"new.txt") && words.contains(&"b4.txt") && words.contains(&"b2.txt"),
            "the deleted file stays deleted: {text}"
        );
        ensure!(words.last() == Some(&"g1"), "{text}");
        // The squashed row: its merged path count, and its members with who
        // published them.
        let log = ls_json(
            env,
            &[
                "log",
                &format!("{stack}@main"),
                "--json",
                "--paths",
                "-n",
                NS,
            ],
        )?;
        let squashed = log["layers"]
            .as_array()
            .and_then(|l| l.iter().find(|e| e["kind"] == "squashed"))
            .cloned()
            .with_context(|| format!("no squashed layer: {log}"))?;
        let changed = squashed["changed"].as_array().map(Vec::len).unwrap_or(0) as u64;
        ensure!(
            squashed["paths"].as_u64() == Some(changed) && changed > 0,
            "{squashed}"
        );
        let members = squashed["members"].as_array().cloned().unwrap_or_default();
        ensure!(members.len() >= 3, "{squashed}");
        ensure!(
            members.iter().all(|m| m["owner"]
                .as_str()
                .is_some_and(|o| o.starts_with(&format!("container:{NS}/")))
                && m["paths"].as_u64() >= Some(1)),
            "{squashed}"
        );
        let member = members[1]["layer"]
            .as_i64()
            .context("member id")?
            .to_string();
        let text = stdout(&env.layerstack(&["log", &format!("{stack}@main"), "-n", NS])?);
        ensure!(
            text.lines()
                .any(|l| l.starts_with(&format!("  layer {member} "))),
            "members indented under their squash: {text}"
        );
        let v = ls_json(
            env,
            &[
                "diff",
                &format!("{stack}@main"),
                "--at",
                &member,
                "--json",
                "-n",
                NS,
            ],
        )?;
        ensure!(
            v["entries"].as_array().is_some_and(|e| !e.is_empty()),
            "{v}"
        );
        ls_json(
            env,
            &[
                "branch",
                "create",
                &format!("{stack}@at-member"),
                "--at",
                &member,
                "--json",
                "-n",
                NS,
            ],
        )?;
        Ok(())
    });
}
