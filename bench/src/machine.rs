//! The machine line: CPU, cores, memory, kernel, containerd and runc versions,
//! the filesystem the benchmarks write to, and whether `perf` works here.

use std::path::Path;
use std::process::Command;

use serde::Serialize;

/// What the run ran on.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub mem_gib: f64,
    pub kernel: String,
    pub containerd: String,
    pub runc: String,
    /// Filesystem type and device of the benchmark directory (`ext4 on /dev/vda`).
    pub filesystem: String,
    /// `perf` availability: sampling event used, or why none.
    pub perf: String,
    /// `git rev-parse --short HEAD` of the workspace (with `+dirty`).
    pub commit: String,
    /// `release` or `debug` build of our binaries.
    pub build: String,
}

fn first_line(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_string()
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

fn mem_gib() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0 / 1024.0)
        .unwrap_or(f64::NAN)
}

/// `ext4 on /dev/vda` for the mount holding `dir` (longest mount point prefix).
pub fn filesystem_of(dir: &Path) -> String {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    layerstack_integration::mounts()
        .into_iter()
        .filter(|m| dir.starts_with(&m.mount_point))
        .max_by_key(|m| m.mount_point.as_os_str().len())
        .map(|m| format!("{} on {}", m.fs_type, m.source))
        .unwrap_or_else(|| "unknown".into())
}

impl Machine {
    /// Probes this machine; `bench_dir` is where the benchmarks write.
    pub fn probe(bench_dir: &Path, perf: String, build: &str, repo: &Path) -> Machine {
        let mut commit = first_line(
            "git",
            &[
                "-C",
                &repo.to_string_lossy(),
                "rev-parse",
                "--short",
                "HEAD",
            ],
        );
        let dirty = Command::new("git")
            .args([
                "-C",
                &repo.to_string_lossy(),
                "status",
                "--porcelain",
                "--untracked-files=no",
            ])
            .output()
            .map(|o| !o.stdout.is_empty())
            .unwrap_or(false);
        if dirty {
            commit.push_str("+dirty");
        }
        Machine {
            cpu: cpu_model(),
            cores: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(0),
            mem_gib: mem_gib(),
            kernel: first_line("uname", &["-r"]),
            containerd: first_line("containerd", &["--version"]),
            runc: first_line("runc", &["--version"]),
            filesystem: filesystem_of(bench_dir),
            perf,
            commit,
            build: build.to_string(),
        }
    }

    /// One line for the page.
    pub fn line(&self) -> String {
        format!(
            "{}, {} cores, {:.0} GiB RAM; kernel {}; {}; {}; benchmark files on {}; perf: {}",
            self.cpu,
            self.cores,
            self.mem_gib,
            self.kernel,
            self.containerd,
            self.runc,
            self.filesystem,
            self.perf
        )
    }
}
