//! Plots of a suite run (plotters; PNG and SVG).

use std::path::Path;

use anyhow::{anyhow, Context};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::report::{Cell, Summary};

/// Where the plots' font comes from (Debian's fonts-dejavu-core).
const FONT_PATHS: [&str; 2] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

fn register_font() -> anyhow::Result<()> {
    let path = FONT_PATHS
        .iter()
        .find(|p| Path::new(p).exists())
        .context("no DejaVuSans.ttf: install fonts-dejavu-core (scripts/bench-suite.sh does)")?;
    let bytes: &'static [u8] = Box::leak(std::fs::read(path)?.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow!("{path}: not a usable font"))
}

/// One color per server, in the order servers appear.
const COLORS: [RGBColor; 6] = [
    RGBColor(214, 39, 40),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
];
/// The limits' color.
const LIMIT: RGBColor = RGBColor(100, 100, 100);

/// Draws every plot of `s` into `out` as SVG.
pub fn plots(s: &Summary, out: &Path) -> anyhow::Result<()> {
    register_font()?;
    let (iops, rss, cdf) = (
        out.join("iops.svg"),
        out.join("rss.svg"),
        out.join("latency-cdf.svg"),
    );
    by_length(
        SVGBackend::new(&iops, (900, 560)).into_drawing_area(),
        s,
        Metric::Iops,
    )?;
    by_length(
        SVGBackend::new(&rss, (900, 560)).into_drawing_area(),
        s,
        Metric::Rss,
    )?;
    latency_cdf(SVGBackend::new(&cdf, (900, 560)).into_drawing_area(), s)?;
    Ok(())
}

#[derive(Clone, Copy)]
enum Metric {
    Iops,
    Rss,
}

impl Metric {
    fn value(self, c: &Cell) -> Option<f64> {
        match self {
            Metric::Iops => c.iops_qd32,
            Metric::Rss => c.rss_mib,
        }
    }
    fn caption(self) -> &'static str {
        match self {
            Metric::Iops => "Random 4 KiB reads, queue depth 32",
            Metric::Rss => "Server peak RSS",
        }
    }
    fn y_label(self) -> &'static str {
        match self {
            Metric::Iops => "IOPS (log scale)",
            Metric::Rss => "MiB (log scale)",
        }
    }
}

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plotting: {e:?}")
}

fn by_length<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    s: &Summary,
    metric: Metric,
) -> anyhow::Result<()> {
    root.fill(&WHITE).map_err(err)?;
    let max_len = s.lengths.iter().copied().max().unwrap_or(1) as f64;
    let mut y_max = s
        .cells
        .values()
        .filter_map(|c| metric.value(c))
        .fold(0.0f64, f64::max);
    if let (Metric::Iops, Some(raw)) = (metric, s.raw.iops_qd32) {
        y_max = y_max.max(raw);
    }
    let y_max = if y_max > 0.0 { y_max * 1.1 } else { 1.0 };
    let y_min = s
        .cells
        .values()
        .filter_map(|c| metric.value(c))
        .filter(|v| *v > 0.0)
        .fold(f64::MAX, f64::min);
    let y_min = if y_min < f64::MAX { y_min * 0.5 } else { 1.0 };
    let mut chart = ChartBuilder::on(&root)
        .caption(metric.caption(), ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (0.8f64..max_len * 1.3).log_scale(),
            (y_min..y_max).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("chain length (layers)")
        .y_desc(metric.y_label())
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(err)?;
    for (i, server) in s.servers.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let points: Vec<(f64, f64)> = s
            .lengths
            .iter()
            .filter_map(|&l| {
                s.get(server, l)
                    .and_then(|c| metric.value(c))
                    .map(|v| (l as f64, v))
            })
            .collect();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(server.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(err)?;
    }
    if let (Metric::Iops, Some(raw)) = (metric, s.raw.iops_qd32) {
        let color = LIMIT;
        chart
            .draw_series(LineSeries::new(
                vec![(0.8, raw), (max_len * 1.3, raw)],
                color.stroke_width(1),
            ))
            .map_err(err)?
            .label("raw file, io_uring (limit)")
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(1))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(match metric {
            // Where the lines are not.
            Metric::Iops => SeriesLabelPosition::LowerLeft,
            Metric::Rss => SeriesLabelPosition::UpperLeft,
        })
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

fn latency_cdf<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    s: &Summary,
) -> anyhow::Result<()> {
    root.fill(&WHITE).map_err(err)?;
    let longest = s.lengths.iter().copied().max().unwrap_or(1);
    let mut series: Vec<(String, Vec<f64>)> = s
        .servers
        .iter()
        .filter_map(|srv| {
            s.get(srv, longest)
                .map(|c| (srv.clone(), c.cdf_qd1_us.clone()))
        })
        .filter(|(_, cdf)| !cdf.is_empty())
        .collect();
    if !s.raw.cdf_qd1_us.is_empty() {
        series.push((
            "raw file, io_uring (limit)".into(),
            s.raw.cdf_qd1_us.clone(),
        ));
    }
    let all = series
        .iter()
        .flat_map(|(_, c)| c.iter().copied())
        .filter(|v| *v > 0.0);
    let (lo, hi) = all.fold((f64::MAX, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let (lo, hi) = if hi > 0.0 {
        (lo * 0.8, hi * 1.25)
    } else {
        (1.0, 10.0)
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Latency CDF, random 4 KiB reads at depth 1, {longest} layers"),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("latency (µs)")
        .y_desc("fraction of requests")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(err)?;
    for (name, cdf) in &series {
        // The same color per server as in the other plots.
        let color = s
            .servers
            .iter()
            .position(|srv| srv == name)
            .map_or(LIMIT, |k| COLORS[k % COLORS.len()]);
        let points: Vec<(f64, f64)> = cdf
            .iter()
            .enumerate()
            .filter(|(_, v)| **v > 0.0)
            .map(|(q, &v)| (v, q as f64 / (cdf.len() - 1).max(1) as f64))
            .collect();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}
