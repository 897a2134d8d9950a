//! SVG plots (plotters, SVG backend only): one chart per [`PlotSpec`], either
//! grouped bars over categories or lines over a numeric x, each point a median
//! with a min–max whisker. Log axes are drawn as log10 of the values on linear
//! axes, labelled with the values themselves.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;
use serde::Serialize;

/// One point: the median `y` at `x`, with its min (`lo`) and max (`hi`).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Point {
    pub x: f64,
    pub y: f64,
    pub lo: f64,
    pub hi: f64,
}

impl Point {
    pub fn new(x: f64, s: &crate::stats::Summary) -> Point {
        Point {
            x,
            y: s.median,
            lo: s.min,
            hi: s.max,
        }
    }
}

/// A named series of points.
#[derive(Debug, Clone, Serialize)]
pub struct Series {
    pub name: String,
    pub points: Vec<Point>,
}

/// The x axis.
#[derive(Debug, Clone, Serialize)]
pub enum XAxis {
    Log,
    /// Categories: point `x` is the index into the names; drawn as grouped bars.
    Categories(Vec<String>),
}

/// One chart.
#[derive(Debug, Clone, Serialize)]
pub struct PlotSpec {
    /// File name below `bench/` (`p1-start.svg`).
    pub file: String,
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub x: XAxis,
    pub log_y: bool,
    pub series: Vec<Series>,
    /// A horizontal reference line (a target), with its label.
    pub hline: Option<(f64, String)>,
}

const COLORS: [RGBColor; 6] = [
    RGBColor(0x44, 0x77, 0xaa),
    RGBColor(0xee, 0x66, 0x77),
    RGBColor(0x22, 0x88, 0x33),
    RGBColor(0xcc, 0xbb, 0x44),
    RGBColor(0x66, 0xcc, 0xee),
    RGBColor(0xaa, 0x33, 0x77),
];

/// A value with three significant digits, for axis labels.
fn sig3(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let mag = v.abs().log10().floor() as i32;
    let decimals = (2 - mag).max(0) as usize;
    format!("{v:.decimals$}")
}

fn err(e: impl std::fmt::Debug) -> anyhow::Error {
    anyhow!("{e:?}")
}

/// Draws `spec` into the SVG file `path`.
pub fn render(spec: &PlotSpec, path: &Path) -> Result<()> {
    let log_x = matches!(spec.x, XAxis::Log);
    let tx = |x: f64| if log_x { x.max(1e-9).log10() } else { x };
    let ty = |y: f64| {
        if spec.log_y {
            y.max(1e-6).log10()
        } else {
            y
        }
    };
    let pts: Vec<&Point> = spec
        .series
        .iter()
        .flat_map(|s| s.points.iter())
        .filter(|p| p.y.is_finite())
        .collect();
    let (mut x0, mut x1) = match &spec.x {
        XAxis::Categories(c) => (-0.5, c.len() as f64 - 0.5),
        _ => pts.iter().fold((f64::MAX, f64::MIN), |(a, b), p| {
            (a.min(tx(p.x)), b.max(tx(p.x)))
        }),
    };
    if x0.partial_cmp(&x1) != Some(std::cmp::Ordering::Less) {
        x0 -= 1.0;
        x1 += 1.0;
    }
    if !matches!(spec.x, XAxis::Categories(_)) {
        let pad = (x1 - x0) * 0.05;
        x0 -= pad;
        x1 += pad;
    }
    let mut ys: Vec<f64> = pts
        .iter()
        .flat_map(|p| [p.lo, p.y, p.hi])
        .filter(|v| v.is_finite())
        .map(ty)
        .collect();
    if let Some((h, _)) = spec.hline {
        ys.push(ty(h));
    }
    let (mut y0, mut y1) = ys
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(*v), b.max(*v)));
    if ys.is_empty() {
        (y0, y1) = (0.0, 1.0);
    }
    if !spec.log_y {
        y0 = y0.min(0.0);
    }
    if y0.partial_cmp(&y1) != Some(std::cmp::Ordering::Less) {
        y1 = y0 + 1.0;
    }
    let pad = (y1 - y0) * 0.08;
    if spec.log_y {
        y0 -= pad;
    }
    y1 += pad;

    let root = SVGBackend::new(path, (760, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(&spec.title, ("sans-serif", 18))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(err)?;
    let cats = match &spec.x {
        XAxis::Categories(c) => c.clone(),
        _ => Vec::new(),
    };
    let x_fmt = |v: &f64| -> String {
        if !cats.is_empty() {
            let i = v.round();
            if (v - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < cats.len() {
                return cats[i as usize].clone();
            }
            return String::new();
        }
        if log_x {
            sig3(10f64.powf(*v))
        } else {
            sig3(*v)
        }
    };
    let y_fmt = |v: &f64| -> String {
        if spec.log_y {
            sig3(10f64.powf(*v))
        } else {
            sig3(*v)
        }
    };
    let mut mesh = chart.configure_mesh();
    mesh.x_desc(spec.x_label.as_str())
        .y_desc(spec.y_label.as_str())
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .light_line_style(WHITE.mix(0.0));
    if !cats.is_empty() {
        // One label per category: ticks exactly on the integers.
        mesh.x_labels(cats.len() * 2 + 1).disable_x_mesh();
    }
    mesh.draw().map_err(err)?;

    let n_series = spec.series.len().max(1) as f64;
    for (i, s) in spec.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<Point> = s
            .points
            .iter()
            .copied()
            .filter(|p| p.y.is_finite())
            .collect();
        if !cats.is_empty() {
            let w = 0.8 / n_series;
            let off = -0.4 + w * (i as f64 + 0.5);
            let base = if spec.log_y { y0 } else { 0.0 };
            chart
                .draw_series(pts.iter().map(|p| {
                    let cx = p.x + off;
                    Rectangle::new(
                        [(cx - w * 0.45, base), (cx + w * 0.45, ty(p.y))],
                        color.mix(0.8).filled(),
                    )
                }))
                .map_err(err)?
                .label(s.name.as_str())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
                });
            chart
                .draw_series(pts.iter().map(|p| {
                    ErrorBar::new_vertical(
                        p.x + off,
                        ty(p.lo),
                        ty(p.y),
                        ty(p.hi),
                        BLACK.filled(),
                        6,
                    )
                }))
                .map_err(err)?;
        } else {
            chart
                .draw_series(LineSeries::new(
                    pts.iter().map(|p| (tx(p.x), ty(p.y))),
                    color.stroke_width(2),
                ))
                .map_err(err)?
                .label(s.name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 14, y)], color.stroke_width(2))
                });
            chart
                .draw_series(
                    pts.iter()
                        .map(|p| Circle::new((tx(p.x), ty(p.y)), 3, color.filled())),
                )
                .map_err(err)?;
            chart
                .draw_series(pts.iter().map(|p| {
                    ErrorBar::new_vertical(tx(p.x), ty(p.lo), ty(p.y), ty(p.hi), color.filled(), 6)
                }))
                .map_err(err)?;
        }
    }
    if let Some((h, label)) = &spec.hline {
        let h = ty(*h);
        chart
            .draw_series(LineSeries::new(
                vec![(x0, h), (x1, h)],
                BLACK.stroke_width(1),
            ))
            .map_err(err)?
            .label(label.as_str())
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], BLACK.stroke_width(1)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_bars_and_lines() {
        let d = std::env::temp_dir().join(format!("lsb-plot-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = |x: f64, y: f64| Point {
            x,
            y,
            lo: y * 0.9,
            hi: y * 1.1,
        };
        let bars = PlotSpec {
            file: "bars.svg".into(),
            title: "bars".into(),
            x_label: "variant".into(),
            y_label: "ms".into(),
            x: XAxis::Categories(vec!["a".into(), "b".into()]),
            log_y: false,
            series: vec![Series {
                name: "s".into(),
                points: vec![p(0.0, 10.0), p(1.0, 12.0)],
            }],
            hline: Some((11.0, "target".into())),
        };
        render(&bars, &d.join(&bars.file)).unwrap();
        let lines = PlotSpec {
            file: "lines.svg".into(),
            x: XAxis::Log,
            log_y: true,
            series: vec![Series {
                name: "s".into(),
                points: vec![p(1.0, 1.0), p(1024.0, 300.0)],
            }],
            ..bars.clone()
        };
        render(&lines, &d.join(&lines.file)).unwrap();
        let svg = std::fs::read_to_string(d.join("lines.svg")).unwrap();
        assert!(svg.contains("<svg") && svg.contains("polyline"), "{svg}");
        let svg = std::fs::read_to_string(d.join("bars.svg")).unwrap();
        assert!(svg.contains("\na\n</text>"), "category label missing");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
