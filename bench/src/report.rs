//! The results of one run and how they are written: `benchmarks.md` (machine
//! line, targets table, per scenario its tables, plot, profile line and notes)
//! and the raw `bench/results.json` beside the plots.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::machine::Machine;
use crate::plot::PlotSpec;
use crate::profile::ProfileSummary;

/// How a scenario ended.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "status", content = "reason", rename_all = "kebab-case")]
pub enum Status {
    /// Measured.
    Ok,
    /// An error stopped it (a real failure: the program exits non-zero).
    Failed(String),
}

/// A markdown table.
#[derive(Debug, Clone, Serialize)]
pub struct Table {
    pub title: String,
    pub columns: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(title: &str, columns: &[&str]) -> Table {
        Table {
            title: title.to_string(),
            columns: columns.iter().map(|c| c.to_string()).collect(),
            rows: Vec::new(),
        }
    }
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }
}

/// One target of the issue and where this run stands against it.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    /// The target as the issue states it.
    pub target: String,
    /// What was measured (with its unit or as a ratio).
    pub measured: String,
    /// `Some(true)` met, `Some(false)` missed, `None` not measured in this run.
    pub met: Option<bool>,
    /// By how much and why, for a miss; caveats for a hit.
    pub detail: String,
}

impl Target {
    /// A target with a verdict: met when `value <= limit`; `why` explains a miss.
    pub fn at_most(target: &str, measured: String, value: f64, limit: f64, why: &str) -> Target {
        let met = value.is_finite().then_some(value <= limit);
        let detail = match met {
            Some(true) => String::new(),
            Some(false) => {
                let by = if limit > 0.0 {
                    format!(
                        "missed by {:.0} % ({value:.3} vs {limit})",
                        (value / limit - 1.0) * 100.0
                    )
                } else {
                    format!("missed ({value} vs {limit})")
                };
                if why.is_empty() {
                    by
                } else {
                    format!("{by}: {why}")
                }
            }
            None => "not measured".into(),
        };
        Target {
            target: target.to_string(),
            measured,
            met,
            detail,
        }
    }
}

/// Everything one scenario reports.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioReport {
    /// `p1` … `p8`.
    pub id: String,
    /// Short name used by `--scenario` (`start`, `fan-out`, …).
    pub name: String,
    pub title: String,
    #[serde(flatten)]
    pub status: Status,
    /// How it is measured (one paragraph of markdown).
    pub method: String,
    pub tables: Vec<Table>,
    pub plots: Vec<PlotSpec>,
    pub profile: Option<ProfileSummary>,
    /// One line: where the time of the slowest step goes, and whose it is.
    pub time_goes: String,
    pub notes: Vec<String>,
    pub targets: Vec<Target>,
    /// Raw samples (milliseconds, bytes) for results.json.
    pub raw: serde_json::Value,
    /// Wall time of the scenario, seconds.
    pub elapsed_s: f64,
}

impl ScenarioReport {
    pub fn new(id: &str, name: &str, title: &str) -> ScenarioReport {
        ScenarioReport {
            id: id.into(),
            name: name.into(),
            title: title.into(),
            status: Status::Ok,
            method: String::new(),
            tables: Vec::new(),
            plots: Vec::new(),
            profile: None,
            time_goes: String::new(),
            notes: Vec::new(),
            targets: Vec::new(),
            raw: serde_json::Value::Null,
            elapsed_s: 0.0,
        }
    }
}

/// One run of the program.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub machine: Machine,
    /// `full` or `quick`.
    pub mode: String,
    pub command: String,
    pub started: String,
    pub elapsed_s: f64,
    pub scenarios: Vec<ScenarioReport>,
}

fn verdict(t: &Target) -> &'static str {
    match t.met {
        Some(true) => "met",
        Some(false) => "**missed**",
        None => "not measured",
    }
}

fn escape_cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

fn write_table(out: &mut String, t: &Table) {
    if !t.title.is_empty() {
        let _ = writeln!(out, "**{}**\n", t.title);
    }
    let _ = writeln!(
        out,
        "| {} |",
        t.columns
            .iter()
            .map(|c| escape_cell(c))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let _ = writeln!(out, "|{}", "---|".repeat(t.columns.len()));
    for r in &t.rows {
        let _ = writeln!(
            out,
            "| {} |",
            r.iter()
                .map(|c| escape_cell(c))
                .collect::<Vec<_>>()
                .join(" | ")
        );
    }
    out.push('\n');
}

impl Report {
    /// The markdown page; plots are linked as `plot_dir/<file>`.
    pub fn markdown(&self, plot_dir: &str) -> String {
        let mut o = String::new();
        let m = &self.machine;
        let _ = writeln!(o, "# Benchmarks\n");
        let _ = writeln!(
            o,
            "_Written by `layerstack-bench` ({}); do not edit by hand. \
             Raw samples: [{plot_dir}/results.json]({plot_dir}/results.json)._\n",
            self.command
        );
        let _ = writeln!(o, "**Machine:** {}\n", m.line());
        let _ = writeln!(
            o,
            "**Run:** {} mode, started {}, {:.0} s, commit `{}`, {} build.\n",
            self.mode, self.started, self.elapsed_s, m.commit, m.build
        );
        o.push_str(
            "**Method.** The machine is shared and noisy, so every figure is a ratio against a \
             baseline measured in the same run, interleaved (A B A B …, the order alternating \
             per round): for each round the ratio of the pair is taken, and the tables give the \
             median of those ratios with their min–max. Times are medians with min–max in \
             milliseconds unless a column says otherwise. Everything runs on a private \
             containerd (own root, state and sockets under `/var/tmp/lst-*`) with the \
             layerstack proxy snapshotter and containerd's built-in `overlayfs` and `native` \
             snapshotters; containerd logs at `info`, the daemon at `info` (its WASI runs at `debug`: one line a run). Profiles: `perf \
             record -a -e cpu-clock` (system wide, then only this benchmark's processes \
             counted) during one extra run of the scenario's slowest step; other programs \
             ran on this machine meanwhile, and each profile line says how much CPU they \
             took.\n\n",
        );
        let _ = writeln!(o, "## Targets\n");
        let _ = writeln!(
            o,
            "| scenario | target | measured | verdict | by how much, why |"
        );
        let _ = writeln!(o, "|---|---|---|---|---|");
        for s in &self.scenarios {
            if s.targets.is_empty() {
                let why = match &s.status {
                    Status::Ok => "no target".to_string(),
                    Status::Failed(e) => format!("failed: {e}"),
                };
                let _ = writeln!(
                    o,
                    "| {} {} | – | – | – | {} |",
                    s.id.to_uppercase(),
                    s.name,
                    escape_cell(&why)
                );
            }
            for t in &s.targets {
                let _ = writeln!(
                    o,
                    "| {} {} | {} | {} | {} | {} |",
                    s.id.to_uppercase(),
                    s.name,
                    escape_cell(&t.target),
                    escape_cell(&t.measured),
                    verdict(t),
                    escape_cell(&t.detail)
                );
            }
        }
        o.push('\n');
        for s in &self.scenarios {
            let _ = writeln!(o, "## {} {}\n", s.id.to_uppercase(), s.title);
            match &s.status {
                Status::Ok => {}
                Status::Failed(e) => {
                    let _ = writeln!(o, "**Failed:** `{}`\n", e.replace('`', "'"));
                }
            }
            if !s.method.is_empty() {
                let _ = writeln!(o, "{}\n", s.method);
            }
            for t in &s.tables {
                write_table(&mut o, t);
            }
            for p in &s.plots {
                let _ = writeln!(o, "![{}]({plot_dir}/{})\n", p.title, p.file);
            }
            if let Some(p) = &s.profile {
                let _ = writeln!(o, "**Profile** ({}): {}\n", p.step, p.line());
            }
            if !s.time_goes.is_empty() {
                let _ = writeln!(o, "**Where the time goes:** {}\n", s.time_goes);
            }
            for n in &s.notes {
                let _ = writeln!(o, "- {n}");
            }
            if !s.notes.is_empty() {
                o.push('\n');
            }
            if matches!(s.status, Status::Ok) {
                let _ = writeln!(o, "_{:.0} s._\n", s.elapsed_s);
            }
        }
        o
    }

    /// Writes `<out>/benchmarks.md`, `<out>/bench/results.json` and every plot
    /// as `<out>/bench/<file>.svg`.
    pub fn write(&self, out: &Path) -> Result<()> {
        let dir = out.join("bench");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        for s in &self.scenarios {
            for p in &s.plots {
                crate::plot::render(p, &dir.join(&p.file))
                    .with_context(|| format!("plot {}", p.file))?;
            }
        }
        let json = serde_json::to_string_pretty(self)?;
        std::fs::write(dir.join("results.json"), json + "\n")?;
        std::fs::write(out.join("benchmarks.md"), self.markdown("bench"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_say_by_how_much() {
        let t = Target::at_most("≤ 1.05×", "1.10×".into(), 1.10, 1.05, "the shim");
        assert_eq!(t.met, Some(false));
        assert!(t.detail.starts_with("missed by 5 %"), "{}", t.detail);
        assert!(t.detail.ends_with("the shim"), "{}", t.detail);
        let t = Target::at_most("≤ 1.05×", "1.0×".into(), 1.0, 1.05, "the shim");
        assert_eq!(t.met, Some(true));
        assert_eq!(t.detail, "");
        let t = Target::at_most("≤ 1.05×", "–".into(), f64::NAN, 1.05, "");
        assert_eq!(t.met, None);
    }

    #[test]
    fn tables_escape_pipes() {
        let mut o = String::new();
        let mut t = Table::new("", &["a", "b"]);
        t.row(vec!["x|y".into(), "z".into()]);
        write_table(&mut o, &t);
        assert!(o.contains("x\\|y"), "{o}");
        assert_eq!(o.trim_end().lines().count(), 3, "{o}");
    }
}
