//! Profiling one step with `perf` (Debian `linux-perf`), system wide, with the
//! software `cpu-clock` event: the hardware `instructions`/`cycles` counters
//! are often missing in a VM (`perf stat -e instructions true` says
//! `<not supported>`), and a system-wide sample shows containerd, runc, the
//! shims and the kernel next to our daemon. Only this benchmark's processes
//! count (this process and its descendants, from perf's task events: the
//! daemon, containerd, shims, runc, `ctr`, containers — not other programs on
//! a shared machine, nor kernel threads doing work for them, such as writeback);
//! their samples are the 100 %.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};
use serde::Serialize;

/// Where one step's CPU time went.
#[derive(Debug, Clone, Serialize)]
pub struct ProfileSummary {
    /// The step that was profiled.
    pub step: String,
    /// Samples outside idle.
    pub samples: u64,
    /// CPU this benchmark's processes used over the step: samples /
    /// (duration × frequency × cores), %.
    pub busy_pct: f64,
    /// CPU other programs on the machine used meanwhile (not in the shares), %.
    pub others_pct: f64,
    /// Share of busy samples per process name (comm), %, largest first.
    pub by_process: Vec<(String, f64)>,
    /// Share per binary or library (perf's dso), %, largest first.
    pub by_binary: Vec<(String, f64)>,
    /// Hottest symbols, `comm dso symbol`, %.
    pub top_symbols: Vec<(String, f64)>,
}

fn fmt_shares(v: &[(String, f64)], n: usize) -> String {
    v.iter()
        .take(n)
        .map(|(k, p)| format!("{k} {p:.0} %"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl ProfileSummary {
    /// One line for the page.
    pub fn line(&self) -> String {
        format!(
            "{} samples of this benchmark's processes (CPU {:.0} % of the machine; other \
             programs {:.0} %); by process: {}; by binary: {}; hottest: {}",
            self.samples,
            self.busy_pct,
            self.others_pct,
            fmt_shares(&self.by_process, 6),
            fmt_shares(&self.by_binary, 6),
            self.top_symbols
                .iter()
                .take(5)
                .map(|(k, p)| format!("`{k}` {p:.1} %"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
}

/// Runs `perf record` around steps, when perf works here.
pub struct Profiler {
    dir: PathBuf,
    /// None: usable; Some(reason): not.
    unavailable: Option<String>,
    hw_counters: bool,
}

const FREQ: u32 = 499;

impl Profiler {
    /// Probes perf; `enabled` false (`--no-profile`) turns it off.
    pub fn probe(dir: &Path, enabled: bool) -> Profiler {
        let mut p = Profiler {
            dir: dir.to_path_buf(),
            unavailable: None,
            hw_counters: false,
        };
        if !enabled {
            p.unavailable = Some("off (--no-profile)".into());
            return p;
        }
        if layerstack_integration::which("perf").is_none() {
            p.unavailable = Some("not installed (Debian package linux-perf)".into());
            return p;
        }
        let stat = Command::new("perf")
            .args(["stat", "-x,", "-e", "instructions", "true"])
            .stdout(Stdio::null())
            .output();
        p.hw_counters = matches!(&stat, Ok(o) if o.status.success()
            && !String::from_utf8_lossy(&o.stderr).contains("not supported"));
        let data = dir.join("probe.perf");
        let rec = Command::new("perf")
            .args(["record", "-q", "-e", "cpu-clock", "-o"])
            .arg(&data)
            .args(["--", "true"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_file(&data);
        if !matches!(rec, Ok(s) if s.success()) {
            p.unavailable = Some("perf record -e cpu-clock fails here".into());
        }
        p
    }

    /// For the machine line.
    pub fn describe(&self) -> String {
        match &self.unavailable {
            Some(r) => format!("none ({r})"),
            None if self.hw_counters => "cpu-clock sampling; hardware counters available".into(),
            None => "cpu-clock sampling (hardware counters such as `instructions` are \
                     not supported on this machine)"
                .into(),
        }
    }

    pub fn available(&self) -> bool {
        self.unavailable.is_none()
    }

    /// Runs `f` under `perf record -a`; returns its result and the summary (None
    /// when perf is unavailable or its report failed — the step's own result
    /// still counts).
    pub fn record<T>(
        &self,
        step: &str,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<(T, Option<ProfileSummary>)> {
        if !self.available() {
            return Ok((f()?, None));
        }
        std::fs::create_dir_all(&self.dir)?;
        let data = self.dir.join(format!(
            "{}.perf",
            step.replace(|c: char| !c.is_ascii_alphanumeric(), "-")
        ));
        let recording = std::time::Instant::now();
        let mut child = Command::new("perf")
            .args(["record", "-q", "-a", "-e", "cpu-clock", "-F"])
            .arg(FREQ.to_string())
            .arg("-o")
            .arg(&data)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("spawning perf record")?;
        // perf needs a moment to open its events on every CPU.
        std::thread::sleep(Duration::from_millis(400));
        let r = f();
        // Shares are of the whole recording (it starts a little before the step).
        let secs = recording.elapsed().as_secs_f64();
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGINT,
        );
        let _ = layerstack_integration::wait_timeout(&mut child, Duration::from_secs(30));
        let _ = child.kill();
        let _ = child.wait();
        let value = r?;
        let summary = match summarize(&data, step, secs) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("layerstack-bench: perf report for {step}: {e:#}");
                None
            }
        };
        let _ = std::fs::remove_file(&data);
        Ok((value, summary))
    }
}

fn sorted_shares(m: BTreeMap<String, f64>, total: f64) -> Vec<(String, f64)> {
    let mut v: Vec<(String, f64)> = m
        .into_iter()
        .map(|(k, n)| (k, if total > 0.0 { n * 100.0 / total } else { 0.0 }))
        .collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v
}

/// Short name of a dso path (`/usr/bin/containerd` → `containerd`).
fn short_dso(d: &str) -> String {
    let d = d.trim();
    if d.starts_with('[') {
        return d
            .trim_matches(|c| c == '[' || c == ']')
            .replace(".kallsyms", "")
            .to_string();
    }
    Path::new(d)
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_else(|| d.to_string())
}

/// Parent of each process that appears in `perf script --show-task-events`
/// (perf synthesizes a FORK record with the parent for every task alive at the
/// start, and records the real ones): `(child, parent)` for new processes.
fn parse_forks(text: &str) -> Vec<(i32, i32)> {
    let mut v = Vec::new();
    for line in text.lines() {
        // "... PERF_RECORD_FORK(123:123):(45:47)"
        let Some(rest) = line.split("PERF_RECORD_FORK(").nth(1) else {
            continue;
        };
        let nums: Vec<i32> = rest
            .split(|c: char| !c.is_ascii_digit())
            .filter(|t| !t.is_empty())
            .take(4)
            .filter_map(|t| t.parse().ok())
            .collect();
        if let [child, _, parent, _] = nums[..] {
            if child != parent {
                v.push((child, parent));
            }
        }
    }
    v
}

/// `root` and every process that descends from it.
fn descendants(forks: &[(i32, i32)], root: i32) -> Vec<i32> {
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        for (c, par) in forks {
            if *par == p && !out.contains(c) {
                out.push(*c);
            }
        }
        i += 1;
    }
    out
}

/// The processes of this benchmark in the recording: this process and all it
/// started (the daemon, containerd, shims, runc, `ctr`, containers).
fn our_pids(data: &Path) -> Result<Vec<i32>> {
    let out = Command::new("perf")
        .args(["script", "--show-task-events", "-F", "pid,tid,comm", "-i"])
        .arg(data)
        .output()
        .context("running perf script")?;
    Ok(descendants(
        &parse_forks(&String::from_utf8_lossy(&out.stdout)),
        std::process::id() as i32,
    ))
}

/// Busy (non-idle) samples of the whole machine.
fn all_busy_samples(data: &Path) -> Result<f64> {
    let out = Command::new("perf")
        .args([
            "report", "--stdio", "-q", "-n", "-t", "|", "--sort", "comm", "-i",
        ])
        .arg(data)
        .output()
        .context("running perf report")?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split('|').collect();
            (f.len() >= 3 && !matches!(f[2].trim(), "swapper" | "perf"))
                .then(|| f[1].trim().parse::<f64>().ok())
                .flatten()
        })
        .sum())
}

/// Parses `perf report --stdio -t '|' --sort comm,dso,sym` of this
/// benchmark's processes and aggregates.
fn summarize(data: &Path, step: &str, secs: f64) -> Result<ProfileSummary> {
    let pids = our_pids(data)?;
    let machine_busy = all_busy_samples(data)?;
    let out = Command::new("perf")
        .args([
            "report",
            "--stdio",
            "-q",
            "-n",
            "-t",
            "|",
            "--sort",
            "comm,dso,sym",
            "-i",
        ])
        .arg(data)
        .arg(format!(
            "--pid={}",
            pids.iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(",")
        ))
        .output()
        .context("running perf report")?;
    anyhow::ensure!(
        out.status.success(),
        "perf report: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let mut by_comm = BTreeMap::new();
    let mut by_dso = BTreeMap::new();
    let mut syms = BTreeMap::new();
    let mut total = 0.0;
    for line in text.lines() {
        // "  12.34%|567|comm|dso|[.] symbol"
        let f: Vec<&str> = line.split('|').collect();
        if f.len() < 5 {
            continue;
        }
        let Ok(n) = f[1].trim().parse::<f64>() else {
            continue;
        };
        let comm = f[2].trim();
        if comm == "swapper" || comm == "perf" {
            continue;
        }
        let dso = short_dso(f[3]);
        let sym = f[4]
            .trim()
            .trim_start_matches("[.]")
            .trim_start_matches("[k]")
            .trim();
        total += n;
        *by_comm.entry(comm.to_string()).or_insert(0.0) += n;
        *by_dso.entry(dso.clone()).or_insert(0.0) += n;
        *syms.entry(format!("{comm} {dso} {sym}")).or_insert(0.0) += n;
    }
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1) as f64;
    let capacity = (secs * f64::from(FREQ) * cores).max(1.0);
    Ok(ProfileSummary {
        step: step.to_string(),
        samples: total as u64,
        busy_pct: total * 100.0 / capacity,
        others_pct: (machine_busy - total).max(0.0) * 100.0 / capacity,
        by_process: sorted_shares(by_comm, total),
        by_binary: sorted_shares(by_dso, total),
        top_symbols: sorted_shares(syms, total).into_iter().take(12).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descendants_follow_forks_not_threads() {
        let text = "sh 10/10 PERF_RECORD_FORK(11:11):(10:10)\n\
                    x 11/11 PERF_RECORD_FORK(11:12):(11:11)\n\
                    y 11/11 PERF_RECORD_FORK(13:13):(11:12)\n\
                    z 99/99 PERF_RECORD_FORK(98:98):(99:99)\n\
                    sample line without a fork\n";
        let f = parse_forks(text);
        assert_eq!(f, vec![(11, 10), (13, 11), (98, 99)]);
        assert_eq!(descendants(&f, 10), vec![10, 11, 13]);
    }

    #[test]
    fn dso_names_are_short() {
        assert_eq!(short_dso("/usr/bin/containerd"), "containerd");
        assert_eq!(short_dso("[kernel.kallsyms]"), "kernel");
        assert_eq!(short_dso(" libc.so.6 "), "libc.so.6");
    }
}
