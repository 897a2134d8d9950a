//! The scenarios, one module each, and what they share: interleaved rounds and
//! ratio tables.

use anyhow::Result;

use crate::env::Bench;
use crate::report::{ScenarioReport, Table};
use crate::stats::{pair_ratios, Summary};

mod p10_cluster;
mod p11_wasi;
mod p12_graph_scale;
mod p1_start;
mod p2_fanout;
mod p3_publish;
mod p4_read;
mod p5_gate;
mod p6_reset;
mod p7_mode_b;
mod p7b_sdk;
mod p8_apply;
mod p9_fabric;

/// One scenario: ids, and the function that measures and fills the report.
#[derive(Clone)]
pub struct Def {
    pub id: &'static str,
    pub name: &'static str,
    pub title: &'static str,
    pub run: fn(&Bench, &mut ScenarioReport) -> Result<()>,
}

/// Every scenario, in order.
pub fn all() -> Vec<Def> {
    vec![
        Def {
            id: "p1",
            name: "start",
            title: "start: `ctr run --rm … true`",
            run: p1_start::run,
        },
        Def {
            id: "p2",
            name: "fan-out",
            title: "fan-out: N sessions from one ~1 GiB base",
            run: p2_fanout::run,
        },
        Def {
            id: "p3",
            name: "publish",
            title: "publish: capture + gate + commit vs containerd's diff service",
            run: p3_publish::run,
        },
        Def {
            id: "p4",
            name: "read-path",
            title: "read path: find + read every file at manifest depth d",
            run: p4_read::run,
        },
        Def {
            id: "p5",
            name: "gate",
            title: "gate under fan-out: N sessions on one head published at once",
            run: p5_gate::run,
        },
        Def {
            id: "p6",
            name: "reset",
            title: "reset: one container's exit to the next running on the new head",
            run: p6_reset::run,
        },
        Def {
            id: "p7",
            name: "mode-b",
            title: "Mode B session: create + mount + run `true` + discard",
            run: p7_mode_b::run,
        },
        Def {
            id: "p7b",
            name: "sdk",
            title: "sandboxes from Python over the API: create + exec `true` + discard, exec round trip, 1,024 from one asyncio client",
            run: p7b_sdk::run,
        },
        Def {
            id: "p8",
            name: "apply-isolation",
            title: "apply isolation: `Prepare` + `Remove` on one stack while another branch applies heavy publishes",
            run: p8_apply::run,
        },
        Def {
            id: "p9",
            name: "fabric",
            title: "rollout fabric: one RL step of 1,024 graded rollouts, rollback to a node, grading session start",
            run: p9_fabric::run,
        },
        Def {
            id: "p10",
            name: "cluster",
            title: "beyond one machine: a checkpoint runnable on a second worker (push + pull + first session) by diff size; rollouts/s with 1 vs 2 Ray worker nodes",
            run: p10_cluster::run,
        },
        Def {
            id: "p11",
            name: "wasi",
            title: "WASI sessions beside Mode B: create + run a trivial module + discard, 1,024 writing one file each published on one head",
            run: p11_wasi::run,
        },
        Def {
            id: "p12",
            name: "graph-scale",
            title: "graph scale: the daemon's memory with a graph of 1,000,000 nodes (most pruned or inactive) against 1,000",
            run: p12_graph_scale::run,
        },
    ]
}

/// Runs `rounds` rounds of `n` variants interleaved — round `r` runs the
/// variants starting at `r mod n` (A B C, B C A, C A B, …) so no variant always
/// follows the same one — and returns the samples per variant, in rounds.
pub fn interleave(
    rounds: usize,
    n: usize,
    mut f: impl FnMut(usize, usize) -> Result<f64>,
) -> Result<Vec<Vec<f64>>> {
    let mut out = vec![Vec::with_capacity(rounds); n];
    for r in 0..rounds {
        for k in 0..n {
            let v = (r + k) % n;
            out[v].push(f(r, v)?);
        }
    }
    Ok(out)
}

/// A table of variants against the first (the baseline): per variant the
/// median (min–max) and the median of the per-round ratios (min–max).
pub fn ratio_table(
    title: &str,
    unit: &str,
    names: &[&str],
    samples: &[Vec<f64>],
) -> (Table, Vec<Summary>) {
    let col = format!("{unit}: median (min–max)");
    let mut t = Table::new(
        title,
        &["variant", &col, &format!("ratio vs {}", names[0]), "rounds"],
    );
    let mut ratios = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let s = Summary::of(&samples[i]);
        let r = Summary::of(&pair_ratios(&samples[0], &samples[i]));
        let rs = if i == 0 {
            "1 (baseline)".to_string()
        } else {
            r.fmt_ratio()
        };
        t.row(vec![name.to_string(), s.fmt(1), rs, s.n.to_string()]);
        ratios.push(r);
    }
    (t, ratios)
}

/// Runs `f(0..n)` on `workers` threads (at most `n`); results in index order,
/// or the first error.
pub fn parallel<T: Send>(
    n: usize,
    workers: usize,
    f: impl Fn(usize) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    let next = AtomicUsize::new(0);
    let out: Mutex<Vec<Option<Result<T>>>> = Mutex::new((0..n).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..workers.clamp(1, n.max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= n {
                    break;
                }
                let r = f(i);
                let failed = r.is_err();
                out.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
                if failed {
                    // Stop handing out work.
                    next.store(n, Ordering::SeqCst);
                }
            });
        }
    });
    let mut v = Vec::with_capacity(n);
    for r in out.into_inner().unwrap_or_else(|e| e.into_inner()) {
        match r {
            Some(r) => v.push(r?),
            None => anyhow::bail!("a parallel task did not run (an earlier one failed)"),
        }
    }
    Ok(v)
}

/// Waits until the machine is quiet — less than `busy_max` (0–1) of its CPU
/// time busy over a 250 ms window, from `/proc/stat` — or `max` has passed;
/// returns the time waited. Before a measurement that should not pay for the
/// background work (squashes, directory removals, WAL checkpoints) the
/// previous one left the daemon.
pub fn settle(busy_max: f64, max: std::time::Duration) -> std::time::Duration {
    fn sample() -> Option<(u64, u64)> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let cpu = stat.lines().next()?;
        let v: Vec<u64> = cpu
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal …
        let total: u64 = v.iter().take(8).sum();
        let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
        Some((total, idle))
    }
    let started = std::time::Instant::now();
    while started.elapsed() < max {
        let Some((t0, i0)) = sample() else { break };
        std::thread::sleep(std::time::Duration::from_millis(250));
        let Some((t1, i1)) = sample() else { break };
        let (dt, di) = (t1.saturating_sub(t0), i1.saturating_sub(i0));
        if dt > 0 && (dt - di.min(dt)) as f64 / (dt as f64) < busy_max {
            break;
        }
    }
    started.elapsed()
}

/// Waits until the store's `staging/` directory is empty — the reaper has
/// removed every tree the store let go of (a burst's ended sessions: on ext4
/// mounted with `discard` each removal waits for the device) and no squash is
/// being built — or `max` has passed; returns the time waited.
pub fn drain_staging(
    store_root: &std::path::Path,
    max: std::time::Duration,
) -> std::time::Duration {
    let staging = store_root.join("staging");
    let started = std::time::Instant::now();
    while started.elapsed() < max {
        let busy = std::fs::read_dir(&staging)
            .map(|mut d| d.next().is_some())
            .unwrap_or(false);
        if !busy {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    started.elapsed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaving_rotates_the_order() {
        let mut order = Vec::new();
        let s = interleave(3, 3, |r, v| {
            order.push(v);
            Ok((r * 10 + v) as f64)
        })
        .unwrap();
        assert_eq!(order, vec![0, 1, 2, 1, 2, 0, 2, 0, 1]);
        assert_eq!(s[1], vec![1.0, 11.0, 21.0]);
    }

    #[test]
    fn parallel_keeps_order_and_reports_errors() {
        let v = parallel(10, 3, |i| Ok(i * 2)).unwrap();
        assert_eq!(v, (0..10).map(|i| i * 2).collect::<Vec<_>>());
        let e = parallel(
            10,
            3,
            |i| if i == 4 { anyhow::bail!("four") } else { Ok(i) },
        );
        assert!(e.is_err());
        assert!(parallel(0, 3, Ok).unwrap().is_empty());
    }

    #[test]
    fn ratio_tables_pair_rounds() {
        let (t, r) = ratio_table("", "ms", &["a", "b"], &[vec![10.0, 20.0], vec![11.0, 30.0]]);
        assert_eq!(t.rows.len(), 2);
        assert_eq!(r[1].median, 1.3);
        assert_eq!(t.rows[0][2], "1 (baseline)");
    }
}
