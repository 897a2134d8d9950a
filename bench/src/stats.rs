//! Summaries of repeated measurements: median with min–max, nearest-rank
//! percentiles, and ratios of interleaved pairs.
//!
//! Every figure the benchmarks report is a ratio against a baseline measured in
//! the same run, interleaved (A B A B …): for pair `i`, `ratio_i = b_i / a_i`, and
//! the report gives the median of those ratios with their min–max. A ratio of
//! medians would let a slow minute of the machine land on one side only.

use serde::Serialize;

/// Median, min, max, p99 and count of samples (same unit as the samples).
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    /// Nearest-rank 99th percentile (the max below 100 samples).
    pub p99: f64,
}

impl Summary {
    /// Summary of `samples`; all NaN (n = 0) when there are none.
    pub fn of(samples: &[f64]) -> Summary {
        let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            return Summary {
                n: 0,
                median: f64::NAN,
                min: f64::NAN,
                max: f64::NAN,
                p99: f64::NAN,
            };
        }
        Summary {
            n: v.len(),
            median: median_sorted(&v),
            min: v[0],
            max: v[v.len() - 1],
            p99: percentile_sorted(&v, 99.0),
        }
    }

    /// `median (min–max)` with `digits` decimals.
    pub fn fmt(&self, digits: usize) -> String {
        if self.n == 0 {
            return "–".into();
        }
        if self.n == 1 {
            return format!("{:.*}", digits, self.median);
        }
        format!(
            "{:.*} ({:.*}–{:.*})",
            digits, self.median, digits, self.min, digits, self.max
        )
    }

    /// `median×` with min–max, for ratios.
    pub fn fmt_ratio(&self) -> String {
        if self.n == 0 {
            return "–".into();
        }
        if self.n == 1 {
            return format!("{:.3}×", self.median);
        }
        format!("{:.3}× ({:.2}–{:.2})", self.median, self.min, self.max)
    }
}

fn median_sorted(v: &[f64]) -> f64 {
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Nearest-rank percentile `p` (0–100) of sorted samples.
pub fn percentile_sorted(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// Nearest-rank percentile `p` of unsorted samples.
pub fn percentile(samples: &[f64], p: f64) -> f64 {
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    percentile_sorted(&v, p)
}

/// Pairwise ratios `b[i] / a[i]` of interleaved measurements (`a` the baseline).
pub fn pair_ratios(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter()
        .zip(b)
        .filter(|(x, _)| **x > 0.0)
        .map(|(x, y)| y / x)
        .collect()
}

/// Milliseconds since `t`.
pub fn ms_since(t: std::time::Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// Bytes as `1.23 GiB` / `45.6 MiB` / `789 KiB` / `12 B`.
pub fn fmt_bytes(b: f64) -> String {
    const K: f64 = 1024.0;
    if !b.is_finite() {
        return "–".into();
    }
    let a = b.abs();
    if a >= K * K * K {
        format!("{:.2} GiB", b / (K * K * K))
    } else if a >= K * K {
        format!("{:.1} MiB", b / (K * K))
    } else if a >= K {
        format!("{:.0} KiB", b / K)
    } else {
        format!("{b:.0} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_of_odd_and_even_counts() {
        let s = Summary::of(&[3.0, 1.0, 2.0]);
        assert_eq!((s.n, s.median, s.min, s.max), (3, 2.0, 1.0, 3.0));
        let s = Summary::of(&[4.0, 1.0, 2.0, 3.0]);
        assert_eq!(s.median, 2.5);
        assert_eq!(Summary::of(&[]).n, 0);
        assert_eq!(Summary::of(&[f64::NAN, 1.0]).n, 1);
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[5.0], 99.0), 5.0);
        // Fewer than 100 samples: p99 is the max.
        assert_eq!(percentile(&[1.0, 2.0, 9.0], 99.0), 9.0);
    }

    #[test]
    fn ratios_are_pairwise() {
        assert_eq!(pair_ratios(&[2.0, 4.0], &[3.0, 4.0]), vec![1.5, 1.0]);
        // A zero baseline has no ratio.
        assert_eq!(pair_ratios(&[0.0, 2.0], &[1.0, 1.0]), vec![0.5]);
    }

    #[test]
    fn formats() {
        assert_eq!(fmt_bytes(1536.0), "2 KiB");
        assert_eq!(fmt_bytes(3.0 * 1024.0 * 1024.0 * 1024.0), "3.00 GiB");
        assert_eq!(Summary::of(&[1.0, 2.0, 3.0]).fmt(1), "2.0 (1.0–3.0)");
        assert_eq!(Summary::of(&[1.0, 1.1]).fmt_ratio(), "1.050× (1.00–1.10)");
    }
}
