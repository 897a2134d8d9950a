//! P12 graph scale (issue 21, "Show it works"): a graph of 1,000,000 nodes,
//! most of them pruned or inactive, must not make the daemon's memory grow
//! against a graph of 1,000 — "inactive nodes live on disk only".
//!
//! Two stores are built offline (no daemon running) by this process through
//! the store crate ([`build_store`]): one graph of [`BASELINE_NODES`] nodes and
//! one of N (1,000,000; 20,000 in `--quick`; `LAYERSTACK_GRAPH_SCALE_NODES`
//! overrides either). Then, rounds of: the real daemon
//! (`containerd-layerstack-grpc`, without containerd) started on each store
//! in turn — its start-up time (spawn → both sockets answer) and its VmRSS at
//! rest — and a search's workload over the admin API (GetNodeStats with
//! children of random inner nodes, rollouts on frontier nodes, the whole graph
//! through ShowGraph's pages, a prune of a subtree, GC), VmRSS after it and
//! VmHWM; the daemon stopped. Figures: RSS per size and the ratio N / 1,000
//! (target ≤ [`RATIO_MAX`]).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use layerstack_integration::Daemon;
use layerstack_store::{
    AdoptGroup, AdoptLayer, AdoptNode, ChangeKind, Disposition, IndexEntry, LayerId, LayerSource,
    NodeKind, Owner, PathRecord, PathStatus, Provenance, RolloutBegin, RolloutEnding,
    RolloutResult, SampleKey, Store, StoreOptions,
};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::Digest as _;

use super::p7b_sdk::status_kib;
use crate::env::Bench;
use crate::plot::{PlotSpec, Point, Series, XAxis};
use crate::report::{ScenarioReport, Table, Target};
use crate::stats::{fmt_bytes, pair_ratios, Summary};

/// Nodes of the baseline graph.
pub const BASELINE_NODES: usize = 1_000;
/// The bound checked: the daemon's VmRSS with the large graph at most this
/// many times its VmRSS with the baseline graph (after the workload).
pub const RATIO_MAX: f64 = 1.2;
/// Children per node of the tree.
const FANOUT: usize = 8;
/// Real checkpoint layers per tree level: the bulk nodes' manifests are made
/// of them (one per level, so no manifest holds a layer twice).
const WIDTH: usize = 8;
/// Nodes per `Store::adopt_nodes` transaction.
const BATCH: usize = 5_000;
/// Top-level subtrees (of [`FANOUT`]) pruned at build: 5 of 8, ~62 % of the nodes.
const PRUNED_SUBTREES: usize = 5;
/// The graph's and the run's names.
const GRAPH: &str = "scale";
const RUN: &str = "scale-search";
/// The frontier's holder.
const HOLDER: &str = "mcts";
/// A fixed base digest: every store built here has the same stack id.
const BASE: &str = "sha256:5ca1e00000000000000000000000000000000000000000000000000000000001";

/// What [`build_store`] made, and what the workload touches.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Built {
    /// Nodes in the graph (root, real checkpoints and adopted nodes).
    pub nodes: usize,
    /// Of which pruned.
    pub pruned: usize,
    /// Real checkpoints (their layers are every node's layers).
    pub layers: usize,
    /// Rows of `search_stats` (nodes with visits), from `rollouts` remote
    /// rollouts ended with a backpropagation.
    pub stats_rows: usize,
    pub rollouts: usize,
    /// Frontier leases (holder [`HOLDER`]).
    pub frontier: Vec<String>,
    /// Live inner nodes (with children) that no prune target holds, for
    /// GetNodeStats.
    pub inner: Vec<String>,
    /// Live nodes whose subtree holds no frontier node: one prune per round.
    pub prune_targets: Vec<String>,
    /// Seconds: the whole build, and its parts.
    pub build_s: f64,
    pub adopt_s: f64,
    pub prune_gc_s: f64,
    pub stats_s: f64,
    pub fsck_s: f64,
    /// Bytes: `store.db` (+ WAL) and the whole root, allocated.
    pub db_bytes: u64,
    pub root_bytes: u64,
}

/// SplitMix64: node ids and the workload's choices, reproducible.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Depth of tree index `t` (0: the root) in a [`FANOUT`]-ary tree.
fn depth(mut t: usize) -> usize {
    let mut d = 0;
    while t > 0 {
        t = (t - 1) / FANOUT;
        d += 1;
    }
    d
}

fn parent(t: usize) -> usize {
    (t - 1) / FANOUT
}

/// The top-level subtree (0..FANOUT) tree index `t ≥ 1` is in.
fn top(mut t: usize) -> usize {
    while t > FANOUT {
        t = parent(t);
    }
    t - 1
}

/// Allocated bytes under `p` (`du -s -B1 -x`).
fn du(p: &Path) -> u64 {
    std::process::Command::new("du")
        .args(["-s", "-B1", "-x"])
        .arg(p)
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

/// Checkpoints a child of `node` whose layer holds one file `name`; returns
/// the node's id and its layer.
fn real_checkpoint(s: &Store, node: &str, name: &str) -> Result<(String, LayerId)> {
    let owner = Owner::Sandbox {
        name: format!("build-{name}"),
    };
    let (_, sess, _, _) = s.start_attempt(node, &owner, None)?;
    std::fs::write(sess.upper.join(name), name.as_bytes())?;
    let index = [IndexEntry {
        path: name.as_bytes().to_vec(),
        kind: ChangeKind::Write,
        digest: Some(sha2::Sha256::digest(name.as_bytes()).into()),
        mode: Some(0o644),
        uid: Some(0),
        gid: Some(0),
        xattrs: None,
    }];
    let paths = [PathRecord {
        path: name.as_bytes().to_vec(),
        status: PathStatus::Clean,
        reason: "new".into(),
    }];
    let staged = s.stage_publish(sess.id, &index, &paths)?;
    let layer = staged.layer;
    let prov = Provenance {
        command: Some(format!("write {name}")),
        exit_status: Some(0),
        ..Default::default()
    };
    let n = s.commit_checkpoint(sess.id, staged, "{}", &prov, None, None, None)?;
    Ok((n.id, layer))
}

/// Builds at `root` a store whose graph [`GRAPH`] holds `n` nodes (≥ 100): a
/// [`FANOUT`]-ary tree over one imported base. Real checkpoints, children of
/// the root, make the layers ([`WIDTH`] per level of the tree); every other
/// node is adopted ([`Store::adopt_nodes`], [`BATCH`] per transaction) with a
/// manifest of those layers — one per level down its path, so siblings differ
/// and nodes share layers. Then [`PRUNED_SUBTREES`] of the root's subtrees
/// are pruned and GC runs, `n / 20` remote rollouts (at least 100) of live
/// leaves end with a backpropagation (search statistics up to the root), 16
/// live leaves are leased to frontier [`HOLDER`], and fsck must be clean. The
/// store is closed when this returns.
pub fn build_store(root: &Path, n: usize) -> Result<Built> {
    ensure!(n >= 100, "a graph of {n} nodes: at least 100");
    let t0 = Instant::now();
    let s = Store::open(root, &StoreOptions::default()).context("opening the store")?;
    let (dir, _g) = s.staging_dir("import")?;
    std::fs::create_dir(dir.join("etc"))?;
    std::fs::write(dir.join("etc/motd"), b"graph scale\n")?;
    let stack = s.import_base(&dir, BASE)?.stack;
    let (_, rootn) = s.create_group(GRAPH, &stack, "main", None)?;
    // Tree indices 1..n-1 below the root (index 0); the deepest level decides
    // how many layer levels are needed.
    let levels = depth(n - 1);
    let mut layers: Vec<Vec<LayerId>> = Vec::with_capacity(levels);
    let mut real = 0;
    for d in 0..levels {
        let mut row = Vec::with_capacity(WIDTH);
        for w in 0..WIDTH {
            let (_, l) = real_checkpoint(&s, &rootn.id, &format!("l{d}-{w}"))?;
            row.push(l);
            real += 1;
        }
        layers.push(row);
    }
    // Adopted nodes: tree indices 1..=bulk (the real checkpoints are the rest
    // of the n).
    let bulk = n - 1 - real;
    let id = |t: usize| -> String {
        if t == 0 {
            rootn.id.clone()
        } else {
            format!("n{:016x}", mix(t as u64 ^ 0x5ca1e))
        }
    };
    let node_layers = |t: usize| -> Vec<AdoptLayer> {
        let mut path = Vec::new();
        let mut x = t;
        while x > 0 {
            path.push(x);
            x = parent(x);
        }
        path.reverse();
        path.iter()
            .enumerate()
            .map(|(d, x)| AdoptLayer {
                source: LayerSource::Existing(layers[d][x % WIDTH]),
                diff_id: format!("sha256:{:064x}", layers[d][x % WIDTH]),
                tar_size: None,
                blobs: Vec::new(),
            })
            .collect()
    };
    let group = AdoptGroup {
        name: GRAPH.into(),
        branch: Some("main".into()),
        root: Some(rootn.id.clone()),
    };
    let t_adopt = Instant::now();
    let created0 = rootn.created_ns;
    let mut t = 1;
    while t <= bulk {
        let end = (t + BATCH).min(bulk + 1);
        let batch: Vec<(Vec<AdoptLayer>, AdoptNode)> = (t..end)
            .map(|x| {
                (
                    node_layers(x),
                    AdoptNode {
                        id: id(x),
                        group: group.clone(),
                        kind: NodeKind::Checkpoint,
                        state: format!("{{\"t\":{x}}}"),
                        parents: vec![id(parent(x))],
                        provenance: Provenance {
                            command: Some("step".into()),
                            exit_status: Some(0),
                            ..Default::default()
                        },
                        created_ns: created0 + x as i64,
                    },
                )
            })
            .collect();
        s.adopt_nodes(&stack, &batch)
            .with_context(|| format!("adopting nodes {t}..{end}"))?;
        t = end;
    }
    let adopt_s = t_adopt.elapsed().as_secs_f64();

    // Most nodes pruned: whole top-level subtrees, then GC (their manifests go;
    // their layers are shared with live nodes, so no directory is freed).
    let t_prune = Instant::now();
    let mut pruned = 0;
    for k in 1..=PRUNED_SUBTREES.min(bulk) {
        pruned += s.prune_node(&id(k), None)?.len();
    }
    s.gc(&[])?;
    let prune_gc_s = t_prune.elapsed().as_secs_f64();
    let live = |x: usize| x >= 1 && x <= bulk && top(x) >= PRUNED_SUBTREES;

    // Search statistics: remote rollouts of live leaves ended with a value,
    // each backpropagated to the root.
    let t_stats = Instant::now();
    s.create_run(RUN, GRAPH, &Default::default())?;
    let leaves: Vec<usize> = (1..=bulk)
        .filter(|&x| live(x) && x * FANOUT + 1 > bulk)
        .collect();
    ensure!(!leaves.is_empty(), "no live leaf in a graph of {n} nodes");
    let rollouts = (n / 20).max(100);
    let leaf_of = |i: usize| leaves[(mix(i as u64) % leaves.len() as u64) as usize];
    for i in 0..rollouts {
        let b = RolloutBegin {
            key: SampleKey {
                run: RUN.into(),
                step: 0,
                prompt: "p".into(),
                sample: i as i64,
            },
            attempt: 1,
            node: id(leaf_of(i)),
            policy: "build".into(),
            seed: None,
            worker: Some("builder".into()),
        };
        let a = match s.begin_rollout(&b)? {
            layerstack_store::Begun::Attempt { attempt, .. } => attempt,
            other => anyhow::bail!("rollout {i}: {other:?}"),
        };
        let v = (mix(i as u64 + 7) % 1000) as f64 / 1000.0;
        let end = RolloutEnding {
            result: RolloutResult::Completed {
                reward: v,
                accepted: v > 0.5,
            },
            evaluator: None,
            trajectory: None,
            artifacts: Vec::new(),
            backprop: Some(v),
            message: String::new(),
        };
        s.end_rollout(a.id, &end, Disposition::Keep)?;
    }
    let stats_s = t_stats.elapsed().as_secs_f64();
    // Every node on a rollout's path has a statistics row; the root has one
    // visit per rollout.
    let mut with_stats = std::collections::HashSet::new();
    for i in 0..rollouts {
        let mut x = leaf_of(i);
        while with_stats.insert(x) && x > 0 {
            x = parent(x);
        }
    }
    let stats_rows = with_stats.len();
    let rs = s.node_stats(&rootn.id)?;
    ensure!(
        rs.visits == rollouts as u64,
        "the root has {} visits after {rollouts} backpropagations",
        rs.visits
    );

    // The frontier: 16 live leaves of the last top-level subtree.
    let frontier: Vec<String> = leaves
        .iter()
        .filter(|&&x| top(x) == FANOUT - 1)
        .take(16)
        .map(|&x| id(x))
        .collect();
    ensure!(!frontier.is_empty(), "no frontier in a graph of {n} nodes");
    s.lease_frontier(HOLDER, &frontier)?;
    // Live inner nodes (with children), up to 1,000, spread over the tree.
    // Only in the frontier's top-level subtree, which no round prunes.
    let inner_all: Vec<usize> = (1..=bulk)
        .filter(|&x| live(x) && top(x) == FANOUT - 1 && x * FANOUT < bulk)
        .collect();
    let step = (inner_all.len() / 1000).max(1);
    let inner: Vec<String> = inner_all.iter().step_by(step).map(|&x| id(x)).collect();
    // Prune targets: live nodes two levels above the deepest (a subtree of at
    // most 1 + 8 + 64 nodes whatever the graph's size: the same work in both
    // stores), outside the frontier's top-level subtree.
    let prune_depth = levels.saturating_sub(2).max(2);
    let prune_targets: Vec<String> = (1..=bulk)
        .filter(|&x| live(x) && top(x) < FANOUT - 1 && depth(x) == prune_depth)
        .take(64)
        .map(id)
        .collect();
    ensure!(
        !inner.is_empty() && !prune_targets.is_empty(),
        "a graph of {n} nodes has no live inner node or no prune target"
    );
    let t_fsck = Instant::now();
    let fsck = s.fsck(false)?;
    let fsck_s = t_fsck.elapsed().as_secs_f64();
    ensure!(
        fsck.problems.is_empty(),
        "fsck of the built store: {:?}",
        fsck.problems
    );
    let nodes = 1 + real + bulk;
    drop(s);
    let db_bytes = file_len(&root.join("store.db")) + file_len(&root.join("store.db-wal"));
    Ok(Built {
        nodes,
        pruned,
        layers: real,
        stats_rows,
        rollouts,
        frontier,
        inner,
        prune_targets,
        build_s: t0.elapsed().as_secs_f64(),
        adopt_s,
        prune_gc_s,
        stats_s,
        fsck_s,
        db_bytes,
        root_bytes: du(root),
    })
}

/// One daemon's life on a built store: start-up, rest, workload.
#[derive(Debug, Clone, Default, Serialize)]
struct Life {
    /// ms from spawn to both sockets answering.
    start_ms: f64,
    /// KiB: VmRSS at rest after start-up, after the workload, and VmHWM;
    /// of VmRSS, the anonymous part (heap, stacks) and the file-backed one
    /// (the binary, the shared libraries; no connection maps the database) at the
    /// same moments.
    idle_kib: f64,
    after_kib: f64,
    hwm_kib: f64,
    idle_anon_kib: f64,
    idle_file_kib: f64,
    after_anon_kib: f64,
    after_file_kib: f64,
    /// What the workload did and how long each part took (ms).
    stats_calls: usize,
    stats_ms: f64,
    rollouts: usize,
    rollouts_ms: f64,
    shown_nodes: usize,
    show_pages: usize,
    show_ms: f64,
    pruned: usize,
    prune_ms: f64,
    gc_manifests: u64,
    gc_ms: f64,
    /// KiB: VmHWM at rest after start-up and after each step of the
    /// workload (stats, rollouts, ShowGraph, prune, GC): which step sets the
    /// peak.
    hwm_steps_kib: [f64; 6],
    /// KiB: RssAnon (the daemon's own memory: heap, stacks) at the same
    /// moments, right after each step (before the memory watcher has freed
    /// anything): which step allocates what stays.
    anon_steps_kib: [f64; 6],
}

/// How long the daemon is left alone before its memory is read "at rest":
/// more than three periods of its memory watcher (`snapshotter/src/memory.rs`,
/// `CHECK_EVERY` = 2 s), which frees SQLite's page caches and trims malloc's
/// free heap once the store has written nothing for a whole period.
const REST: Duration = Duration::from_secs(7);

/// VmRSS (KiB) after [`REST`] and once it has stopped moving (a 200 ms step
/// below 1 %, at most 5 s more).
fn rss_at_rest(pid: u32) -> Result<f64> {
    std::thread::sleep(REST);
    let mut last = status_kib(pid, "VmRSS")? as f64;
    for _ in 0..25 {
        std::thread::sleep(Duration::from_millis(200));
        let now = status_kib(pid, "VmRSS")? as f64;
        if (now - last).abs() <= last * 0.01 {
            return Ok(now);
        }
        last = now;
    }
    Ok(last)
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// The daemon on `root` (sockets under `dir/s`), no containerd.
fn start(dir: &Path, root: &Path) -> Result<(Daemon, f64)> {
    let t = Instant::now();
    let d = Daemon::start_at_with(
        &dir.join("s/snapshotter.sock"),
        &dir.join("s/containerd.sock"),
        root,
        &[],
        true,
    )
    .with_context(|| format!("starting the daemon on {}", root.display()))?;
    Ok((d, ms(t)))
}

/// A search's workload (round `round`) over the admin API of `d`.
fn workload(b: &Bench, d: &Daemon, built: &Built, round: usize, life: &mut Life) -> Result<()> {
    use layerstack_api as api;
    let pid = d.pid().context("the daemon's pid")?;
    let hwm = |life: &mut Life, step: usize| -> Result<()> {
        life.hwm_steps_kib[step] = status_kib(pid, "VmHWM")? as f64;
        life.anon_steps_kib[step] = status_kib(pid, "RssAnon")? as f64;
        Ok(())
    };
    let sock = d.admin_socket().to_path_buf();
    b.rt.block_on(async {
        let mut c = api::connect(&sock)
            .await
            .with_context(|| format!("connecting to {}", sock.display()))?;
        // Selection: a node's and its children's statistics, 200 random inner nodes.
        let t = Instant::now();
        for i in 0..200 {
            let k = (mix((round * 1000 + i) as u64) % built.inner.len() as u64) as usize;
            let r = c
                .get_node_stats(api::GetNodeStatsRequest {
                    node: built.inner[k].clone(),
                    children: true,
                })
                .await
                .with_context(|| format!("GetNodeStats {}", built.inner[k]))?
                .into_inner();
            ensure!(
                !r.children.is_empty(),
                "inner node {} answered no children",
                built.inner[k]
            );
            life.stats_calls += 1;
        }
        life.stats_ms = ms(t);
        hwm(life, 1)?;
        // Expansion: a rollout on each of 4 frontier nodes, in a sandbox of
        // this daemon, ended with a reward and a backpropagation.
        let t = Instant::now();
        for i in 0..4 {
            let node = built.frontier[(round * 4 + i) % built.frontier.len()].clone();
            let r = c
                .begin_rollout(api::BeginRolloutRequest {
                    sample: Some(api::SampleKey {
                        run: RUN.into(),
                        step: 1 + round as i64,
                        prompt: "expand".into(),
                        sample: i as i64,
                    }),
                    attempt: 1,
                    node: node.clone(),
                    policy: "bench".into(),
                    wait_ms: 10_000,
                    ..Default::default()
                })
                .await
                .with_context(|| format!("BeginRollout on {node}"))?
                .into_inner();
            let a = r.attempt.context("BeginRollout answered no attempt")?;
            c.end_rollout(api::EndRolloutRequest {
                attempt: a.id,
                status: "completed".into(),
                reward: 0.5,
                accepted: true,
                has_backprop: true,
                backprop: 0.5,
                keep: api::end_rollout_request::Keep::Discard as i32,
                ..Default::default()
            })
            .await
            .with_context(|| format!("EndRollout {}", a.id))?;
            life.rollouts += 1;
        }
        life.rollouts_ms = ms(t);
        hwm(life, 2)?;
        // The whole graph, page by page (ShowGraph's stream).
        let t = Instant::now();
        let mut s = c
            .show_graph(api::ShowGraphRequest { name: GRAPH.into() })
            .await
            .context("ShowGraph")?
            .into_inner();
        while let Some(p) = s.message().await.context("ShowGraph's next page")? {
            life.shown_nodes += p.nodes.len();
            life.show_pages += 1;
        }
        life.show_ms = ms(t);
        hwm(life, 3)?;
        ensure!(
            life.shown_nodes == built.nodes,
            "ShowGraph listed {} nodes of {}",
            life.shown_nodes,
            built.nodes
        );
        // A prune of a subtree, then GC.
        let target = built.prune_targets[round % built.prune_targets.len()].clone();
        let t = Instant::now();
        let r = c
            .prune_node(api::PruneNodeRequest {
                node: target.clone(),
                key: String::new(),
            })
            .await
            .with_context(|| format!("PruneNode {target}"))?
            .into_inner();
        life.pruned = r.pruned.len();
        life.prune_ms = ms(t);
        hwm(life, 4)?;
        let t = Instant::now();
        let g = c.gc(api::GcRequest {}).await.context("Gc")?.into_inner();
        life.gc_manifests = g.manifests;
        life.gc_ms = ms(t);
        hwm(life, 5)?;
        anyhow::Ok(())
    })
}

/// One life of the daemon on `store` (under `dir`): start, rest, workload, stop.
fn life(b: &Bench, dir: &Path, built: &Built, round: usize) -> Result<Life> {
    let root = dir.join("root");
    let (mut d, start_ms) = start(dir, &root)?;
    let pid = d.pid().context("the daemon's pid")?;
    let mut l = Life {
        start_ms,
        ..Default::default()
    };
    let out = (|| {
        l.idle_kib = rss_at_rest(pid)?;
        l.idle_anon_kib = status_kib(pid, "RssAnon")? as f64;
        l.idle_file_kib = status_kib(pid, "RssFile")? as f64;
        l.hwm_steps_kib[0] = status_kib(pid, "VmHWM")? as f64;
        l.anon_steps_kib[0] = l.idle_anon_kib;
        workload(b, &d, built, round, &mut l)?;
        l.after_kib = rss_at_rest(pid)?;
        l.after_anon_kib = status_kib(pid, "RssAnon")? as f64;
        l.after_file_kib = status_kib(pid, "RssFile")? as f64;
        l.hwm_kib = status_kib(pid, "VmHWM")? as f64;
        anyhow::Ok(())
    })();
    if out.is_err() {
        d.dump_log();
    }
    d.stop();
    out.map(|()| l)
}

/// N from `LAYERSTACK_GRAPH_SCALE_NODES`, else 1,000,000 (20,000 quick).
fn large_n(quick: bool) -> Result<usize> {
    match std::env::var("LAYERSTACK_GRAPH_SCALE_NODES") {
        Ok(v) => v
            .replace(['_', ','], "")
            .parse()
            .with_context(|| format!("LAYERSTACK_GRAPH_SCALE_NODES={v:?}: a number of nodes")),
        Err(_) => Ok(if quick { 20_000 } else { 1_000_000 }),
    }
}

fn kib(v: f64) -> String {
    format!("{:.1} MiB", v / 1024.0)
}

pub fn run(b: &Bench, r: &mut ScenarioReport) -> Result<()> {
    let n = large_n(b.quick)?;
    let rounds = if b.quick { 1 } else { 3 };
    let top_dir = b.env.scratch().join("p12");
    let sizes = [BASELINE_NODES, n];
    let names = [format!("{BASELINE_NODES} nodes"), format!("{n} nodes")];
    let dirs: Vec<PathBuf> = sizes
        .iter()
        .map(|k| top_dir.join(format!("g{k}")))
        .collect();
    let mut built = Vec::new();
    for (k, dir) in sizes.iter().zip(&dirs) {
        std::fs::create_dir_all(dir)?;
        let bl = build_store(&dir.join("root"), *k)
            .with_context(|| format!("building a graph of {k} nodes"))?;
        eprintln!(
            "p12: built a graph of {} nodes ({} pruned) in {:.1} s (adopt {:.1} s, prune+gc {:.1} s, {} rollouts {:.1} s, fsck {:.1} s); store.db {}",
            bl.nodes,
            bl.pruned,
            bl.build_s,
            bl.adopt_s,
            bl.prune_gc_s,
            bl.rollouts,
            bl.stats_s,
            bl.fsck_s,
            fmt_bytes(bl.db_bytes as f64)
        );
        built.push(bl);
    }
    // Rounds, the two sizes in rotating order.
    let mut lives: Vec<Vec<Life>> = vec![Vec::new(), Vec::new()];
    super::settle(0.2, Duration::from_secs(30));
    super::interleave(rounds, 2, |round, v| {
        let l = life(b, &dirs[v], &built[v], round)?;
        eprintln!(
            "p12: round {round}, {}: start {:.0} ms, VmRSS idle {} (anon {} file {}) after {} (anon {} file {}) HWM {}; stats {:.0} ms, rollouts {:.0} ms, show {:.0} ms ({} pages), prune {:.0} ms ({} nodes), gc {:.0} ms",
            names[v],
            l.start_ms,
            kib(l.idle_kib),
            kib(l.idle_anon_kib),
            kib(l.idle_file_kib),
            kib(l.after_kib),
            kib(l.after_anon_kib),
            kib(l.after_file_kib),
            kib(l.hwm_kib),
            l.stats_ms,
            l.rollouts_ms,
            l.show_ms,
            l.show_pages,
            l.prune_ms,
            l.pruned,
            l.gc_ms
        );
        lives[v].push(l);
        Ok(0.0)
    })?;
    let col = |v: usize, f: fn(&Life) -> f64| -> Vec<f64> { lives[v].iter().map(f).collect() };
    let idle = [col(0, |l| l.idle_kib), col(1, |l| l.idle_kib)];
    let after = [col(0, |l| l.after_kib), col(1, |l| l.after_kib)];
    let hwm = [col(0, |l| l.hwm_kib), col(1, |l| l.hwm_kib)];
    let start_ms = [col(0, |l| l.start_ms), col(1, |l| l.start_ms)];
    let ratio_idle = Summary::of(&pair_ratios(&idle[0], &idle[1]));
    let ratio_after = Summary::of(&pair_ratios(&after[0], &after[1]));
    let ratio_hwm = Summary::of(&pair_ratios(&hwm[0], &hwm[1]));
    let idle_anon = [col(0, |l| l.idle_anon_kib), col(1, |l| l.idle_anon_kib)];
    let after_anon = [col(0, |l| l.after_anon_kib), col(1, |l| l.after_anon_kib)];
    let after_file = [col(0, |l| l.after_file_kib), col(1, |l| l.after_file_kib)];
    let ratio_anon = Summary::of(&pair_ratios(&after_anon[0], &after_anon[1]));

    let mut t = Table::new(
        "the two stores, built offline",
        &["what", &names[0], &names[1]],
    );
    let row = |t: &mut Table, what: &str, f: &dyn Fn(&Built) -> String| {
        t.row(vec![what.into(), f(&built[0]), f(&built[1])]);
    };
    row(&mut t, "nodes (pruned)", &|x| {
        format!("{} ({})", x.nodes, x.pruned)
    });
    row(
        &mut t,
        "real checkpoint layers (shared by every node)",
        &|x| x.layers.to_string(),
    );
    row(
        &mut t,
        "remote rollouts ended with a backpropagation; search_stats rows",
        &|x| format!("{}; {}", x.rollouts, x.stats_rows),
    );
    row(&mut t, "frontier leases", &|x| x.frontier.len().to_string());
    row(
        &mut t,
        "build time: total (adopt / prune + GC / rollouts / fsck)",
        &|x| {
            format!(
                "{:.1} s ({:.1} / {:.1} / {:.1} / {:.1})",
                x.build_s, x.adopt_s, x.prune_gc_s, x.stats_s, x.fsck_s
            )
        },
    );
    row(&mut t, "store.db (+ WAL); whole root allocated", &|x| {
        format!(
            "{}; {}",
            fmt_bytes(x.db_bytes as f64),
            fmt_bytes(x.root_bytes as f64)
        )
    });
    r.tables.push(t);

    let mut t = Table::new(
        &format!(
            "the daemon on each store, {rounds} rounds (a start, rest, the workload, a stop each)"
        ),
        &[
            "what",
            &names[0],
            &names[1],
            &format!("ratio {n} / {BASELINE_NODES}"),
        ],
    );
    let fmt_kib = |v: &[f64]| {
        let s = Summary::of(v);
        format!("{} ({}–{})", kib(s.median), kib(s.min), kib(s.max))
    };
    t.row(vec![
        "start-up: spawn → both sockets answer, ms median (min–max)".into(),
        Summary::of(&start_ms[0]).fmt(0),
        Summary::of(&start_ms[1]).fmt(0),
        Summary::of(&pair_ratios(&start_ms[0], &start_ms[1])).fmt_ratio(),
    ]);
    t.row(vec![
        "VmRSS at rest after start-up".into(),
        fmt_kib(&idle[0]),
        fmt_kib(&idle[1]),
        ratio_idle.fmt_ratio(),
    ]);
    t.row(vec![
        "VmRSS after the workload".into(),
        fmt_kib(&after[0]),
        fmt_kib(&after[1]),
        ratio_after.fmt_ratio(),
    ]);
    t.row(vec![
        "of which anonymous (RssAnon: heap, stacks) at rest after start-up".into(),
        fmt_kib(&idle_anon[0]),
        fmt_kib(&idle_anon[1]),
        Summary::of(&pair_ratios(&idle_anon[0], &idle_anon[1])).fmt_ratio(),
    ]);
    t.row(vec![
        "of which anonymous (RssAnon) after the workload".into(),
        fmt_kib(&after_anon[0]),
        fmt_kib(&after_anon[1]),
        ratio_anon.fmt_ratio(),
    ]);
    t.row(vec![
        "of which file-backed (RssFile: the binary, the shared libraries) after the workload"
            .into(),
        fmt_kib(&after_file[0]),
        fmt_kib(&after_file[1]),
        Summary::of(&pair_ratios(&after_file[0], &after_file[1])).fmt_ratio(),
    ]);
    t.row(vec![
        "VmHWM (peak) over the daemon's life".into(),
        fmt_kib(&hwm[0]),
        fmt_kib(&hwm[1]),
        ratio_hwm.fmt_ratio(),
    ]);
    let steps = [
        "start-up (at rest)",
        "+ GetNodeStats",
        "+ rollouts",
        "+ ShowGraph",
        "+ PruneNode",
        "+ Gc",
    ];
    type StepOf = fn(&Life, usize) -> f64;
    let per_step: [(&str, StepOf); 2] = [
        ("VmHWM", |l, i| l.hwm_steps_kib[i]),
        ("RssAnon", |l, i| l.anon_steps_kib[i]),
    ];
    for (what, f) in per_step {
        for (i, step) in steps.iter().enumerate() {
            let v = [
                lives[0].iter().map(|l| f(l, i)).collect::<Vec<_>>(),
                lives[1].iter().map(|l| f(l, i)).collect::<Vec<_>>(),
            ];
            t.row(vec![
                format!("{what} after {step}"),
                fmt_kib(&v[0]),
                fmt_kib(&v[1]),
                Summary::of(&pair_ratios(&v[0], &v[1])).fmt_ratio(),
            ]);
        }
    }
    let wl = |f: fn(&Life) -> f64, v: usize| Summary::of(&col(v, f)).fmt(1);
    t.row(vec![
        "workload: 200 GetNodeStats(children), ms".into(),
        wl(|l| l.stats_ms, 0),
        wl(|l| l.stats_ms, 1),
        String::new(),
    ]);
    t.row(vec![
        "workload: 4 rollouts on frontier nodes (BeginRollout + EndRollout), ms".into(),
        wl(|l| l.rollouts_ms, 0),
        wl(|l| l.rollouts_ms, 1),
        String::new(),
    ]);
    t.row(vec![
        "workload: the whole graph through ShowGraph's pages, ms (pages)".into(),
        format!("{} ({})", wl(|l| l.show_ms, 0), lives[0][0].show_pages),
        format!("{} ({})", wl(|l| l.show_ms, 1), lives[1][0].show_pages),
        String::new(),
    ]);
    t.row(vec![
        "workload: PruneNode of a subtree (nodes), ms".into(),
        format!("{} ({})", wl(|l| l.prune_ms, 0), lives[0][0].pruned),
        format!("{} ({})", wl(|l| l.prune_ms, 1), lives[1][0].pruned),
        String::new(),
    ]);
    t.row(vec![
        "workload: Gc, ms".into(),
        wl(|l| l.gc_ms, 0),
        wl(|l| l.gc_ms, 1),
        String::new(),
    ]);
    r.tables.push(t);

    r.targets.push(Target::at_most(
        &format!(
            "P12 daemon memory flat: VmRSS after a search's workload with {n} nodes / with {BASELINE_NODES} ≤ {RATIO_MAX}"
        ),
        format!(
            "{} (at rest after start-up {}; peak {})",
            ratio_after.fmt_ratio(),
            ratio_idle.fmt_ratio(),
            ratio_hwm.fmt_ratio()
        ),
        ratio_after.median.max(ratio_idle.median),
        RATIO_MAX,
        "the larger of the two ratios (at rest, after the workload) is checked",
    ));
    r.targets.push(Target::at_most(
        &format!(
            "P12 daemon's own memory flat: RssAnon after the workload with {n} nodes / with {BASELINE_NODES} ≤ {RATIO_MAX}"
        ),
        ratio_anon.fmt_ratio(),
        ratio_anon.median,
        RATIO_MAX,
        "VmRSS less its file-backed pages (the binary, the shared libraries; no connection maps the database)",
    ));
    r.targets.push(Target::at_most(
        &format!(
            "P12 daemon peak memory (VmHWM) with {n} nodes / with {BASELINE_NODES} ≤ {RATIO_MAX}"
        ),
        ratio_hwm.fmt_ratio(),
        ratio_hwm.median,
        RATIO_MAX,
        "",
    ));
    r.plots.push(PlotSpec {
        file: "p12-graph-scale.svg".into(),
        title: format!(
            "P12: daemon VmRSS with {BASELINE_NODES} vs {n} graph nodes (median, min–max)"
        ),
        x_label: "when".into(),
        y_label: "MiB".into(),
        x: XAxis::Categories(
            [
                "at rest after start-up",
                "after the workload",
                "peak (VmHWM)",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        ),
        log_y: false,
        series: (0..2)
            .map(|v| Series {
                name: names[v].clone(),
                points: [&idle[v], &after[v], &hwm[v]]
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        let mib: Vec<f64> = s.iter().map(|x| x / 1024.0).collect();
                        Point::new(i as f64, &Summary::of(&mib))
                    })
                    .collect(),
            })
            .collect(),
        hline: None,
    });
    r.method = format!(
        "Two stores built offline by this program through the store crate (`build_store` in \
         `bench/src/scenarios/p12_graph_scale.rs`; no daemon): an imported base, graph `{GRAPH}` \
         as a {FANOUT}-ary tree — the root's children include one real checkpoint per layer \
         ({WIDTH} per tree level: a session, a written file, `commit_checkpoint`); every other \
         node adopted with `Store::adopt_nodes` ({BATCH} per transaction; what a pull does per \
         node) with a manifest of those layers, one per level down its path (nodes share \
         layers; siblings differ). Then {PRUNED_SUBTREES} of the root's {FANOUT} subtrees \
         pruned (`prune_node`) and GC run, N/20 remote rollouts of live leaves (at least 100; \
         `begin_rollout` with a worker, `end_rollout` with a value: search statistics up to \
         the root, whose visits are checked), 16 live leaves leased to a frontier, and \
         `fsck` must find nothing. Then {rounds} rounds, the two sizes in rotating order: \
         the daemon (`containerd-layerstack-grpc`, no containerd, its default \
         configuration) started on the store — start-up from spawn to both sockets \
         accepting —, VmRSS at rest (after 7 s: over three periods of the daemon's memory watcher, \
         which frees SQLite's page caches and trims malloc's free heap once the store is \
         idle; then once it stops moving, a 200 ms step below 1 %), then a search's \
         workload over the admin API from this process's tonic client: 200 `GetNodeStats` \
         with children of random live inner nodes, 4 rollouts on frontier nodes \
         (`BeginRollout` — a sandbox of the daemon — and `EndRollout` with a reward, \
         DISCARD and a backpropagation), the whole graph through `ShowGraph`'s stream of \
         pages (the node count checked), a `PruneNode` of a live subtree of at most 73 nodes in both stores (another each \
         round) and `Gc`; VmRSS at rest again and VmHWM; the daemon stopped (SIGTERM). \
         The ratio is the median of the per-round ratios N / {BASELINE_NODES}. N is \
         `LAYERSTACK_GRAPH_SCALE_NODES` when set."
    );
    r.raw = json!({ "built": built, "lives": lives, "n": n, "baseline": BASELINE_NODES });
    Ok(())
}
