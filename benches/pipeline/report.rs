//! Summaries over repeated runs, and the two pictures.

use std::path::Path;

use plotters::prelude::*;
use serde::Serialize;

use crate::BenchResult;

/// Min, median and max of repeated runs.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Spread {
    /// The spread of `v` (NaN for an empty `v`).
    pub fn of(v: &[f64]) -> Spread {
        let mut v: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            return Spread {
                min: f64::NAN,
                median: f64::NAN,
                max: f64::NAN,
            };
        }
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Spread {
            min: v[0],
            median,
            max: v[n - 1],
        }
    }
}

/// Points of an empirical CDF of sorted latencies: (milliseconds, fraction).
pub fn cdf_points(sorted_us: &[u32]) -> Vec<(f64, f64)> {
    let n = sorted_us.len();
    if n == 0 {
        return Vec::new();
    }
    // Even steps over the body, finer ones in the tail.
    let mut qs: Vec<f64> = (1..=200).map(|k| f64::from(k) / 200.0).collect();
    qs.extend((0..=100).map(|k| 0.99 + f64::from(k) / 10_000.0));
    qs.sort_by(f64::total_cmp);
    qs.dedup();
    qs.into_iter()
        .map(|q| {
            let i = ((q * n as f64).ceil() as usize).clamp(1, n) - 1;
            (f64::from(sorted_us[i]) / 1000.0, q)
        })
        .collect()
}

/// The colour of a mode in both pictures.
pub fn mode_colour(mode: &str) -> RGBColor {
    match mode {
        "guarded" => RGBColor(0x1b, 0x9e, 0x77),
        "at-least-once" => RGBColor(0x4c, 0x72, 0xb0),
        _ => RGBColor(0xd9, 0x5f, 0x02),
    }
}

/// One bar group of the throughput chart.
pub struct BarGroup {
    pub label: String,
    /// (mode, spread of records/s).
    pub bars: Vec<(String, Spread)>,
}

/// Grouped bars (median) with min-max whiskers.
pub fn throughput_chart(path: &Path, title: &str, groups: &[BarGroup]) -> BenchResult {
    let root = SVGBackend::new(path, (760, 440)).into_drawing_area();
    root.fill(&WHITE)?;
    let top = groups
        .iter()
        .flat_map(|g| g.bars.iter().map(|(_, s)| s.max))
        .fold(1.0, f64::max)
        * 1.4;
    let n = groups.len().max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 17))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(72)
        .build_cartesian_2d(0f64..n as f64, 0f64..top)?;
    let labels: Vec<String> = groups.iter().map(|g| g.label.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(2 * n + 1)
        .x_label_formatter(&|x| {
            let centre = x - x.floor();
            if (centre - 0.5).abs() < 1e-6 {
                labels.get(x.floor() as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("records/s (median; whiskers min-max)")
        .y_label_formatter(&|y| format!("{:.0}k", y / 1000.0))
        .draw()?;
    let modes: Vec<String> = groups
        .first()
        .map(|g| g.bars.iter().map(|(m, _)| m.clone()).collect())
        .unwrap_or_default();
    let width = 0.8 / modes.len().max(1) as f64;
    for (i, mode) in modes.iter().enumerate() {
        let colour = mode_colour(mode);
        let mut bars = Vec::new();
        let mut marks = Vec::new();
        for (g, group) in groups.iter().enumerate() {
            let Some((_, s)) = group.bars.iter().find(|(m, _)| m == mode) else {
                continue;
            };
            let x0 = g as f64 + 0.1 + i as f64 * width;
            let mid = x0 + width * 0.45;
            bars.push(Rectangle::new(
                [(x0, 0.0), (x0 + width * 0.9, s.median)],
                colour.filled(),
            ));
            marks.push((mid, *s));
        }
        chart
            .draw_series(bars)?
            .label(mode.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled()));
        for (mid, s) in marks {
            chart.draw_series(std::iter::once(PathElement::new(
                vec![(mid, s.min), (mid, s.max)],
                BLACK.stroke_width(1),
            )))?;
            chart.draw_series(std::iter::once(Text::new(
                format!("{:.0}k", s.median / 1000.0),
                (mid - width * 0.3, s.max + top * 0.03),
                ("sans-serif", 12),
            )))?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// One panel of the latency chart: a CDF per mode.
pub struct CdfPanel {
    pub title: String,
    /// (mode, points from [`cdf_points`]).
    pub lines: Vec<(String, Vec<(f64, f64)>)>,
}

/// Latency CDFs on a log scale, one panel per checkpoint interval.
pub fn latency_chart(path: &Path, panels: &[CdfPanel]) -> BenchResult {
    let width = 520 * panels.len().max(1) as u32;
    let root = SVGBackend::new(path, (width, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let areas = root.split_evenly((1, panels.len().max(1)));
    for (panel, area) in panels.iter().zip(areas.iter()) {
        let all = panel
            .lines
            .iter()
            .flat_map(|(_, pts)| pts.iter().map(|p| p.0));
        let lo = all.clone().fold(f64::INFINITY, f64::min).max(0.1) / 1.5;
        let hi = all.fold(1.0, f64::max) * 1.5;
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(48)
            .build_cartesian_2d((lo..hi).log_scale(), 0f64..1f64)?;
        chart
            .configure_mesh()
            .x_desc("produce to visible, ms (log)")
            .y_desc("fraction of records")
            .x_label_formatter(&|x| {
                if *x >= 10.0 {
                    format!("{x:.0}")
                } else {
                    format!("{x:.1}")
                }
            })
            .draw()?;
        for (mode, pts) in &panel.lines {
            let colour = mode_colour(mode);
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), colour.stroke_width(2)))?
                .label(mode.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
