//! `pagoda bench serve --plot FILE.svg`: latency against request rate, as SVG. Three panels,
//! TTFT, TPOT and ITL in milliseconds on a log axis, each with its median and p99 at every rate
//! of the sweep (one point for `--request-rate`), and the SLO (`--slo-ttft`, `--slo-tpot`) as a
//! dashed line. The rates stand evenly spaced in increasing order, labelled with their value
//! (`inf`: all at once), as a sweep's rates usually double. Drawn with `plotters`' SVG backend
//! only: text is written as SVG `<text>` and sized by estimate, so no font is needed.

use std::path::Path;

use anyhow::{bail, Context, Result};
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;

use super::workload::{rate_label, Distribution, Metrics, RatePoint, Slo};

/// The plot's size in pixels.
const SIZE: (u32, u32) = (1500, 520);

/// Refuses a `--plot` file that is not `.svg`.
pub(super) fn check_path(path: &Path) -> Result<()> {
    let svg = path
        .extension()
        .is_some_and(|ext| ext.eq_ignore_ascii_case("svg"));
    if !svg {
        bail!(
            "--plot {}: only SVG is written; give a file name ending in .svg",
            path.display()
        );
    }
    Ok(())
}

/// The plot's title: the server's label, the model and the dataset (a file by its name).
pub(super) fn title(label: &str, model: &str, dataset: &str) -> String {
    let dataset = Path::new(dataset)
        .file_name()
        .map_or(dataset.into(), |name| name.to_string_lossy());
    format!("{label}: latency against request rate, model {model}, dataset {dataset}")
}

/// Writes the plot of `points` to `path` (an `.svg` file).
pub(super) fn write_svg(path: &Path, title: &str, points: &[RatePoint], slo: Slo) -> Result<()> {
    check_path(path)?;
    let mut points: Vec<&RatePoint> = points.iter().collect();
    points.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    draw(path, title, &points, slo).with_context(|| format!("writing the plot {}", path.display()))
}

/// A latency of the plot: its name, where it is in the figures, and its SLO.
type Panel = (&'static str, fn(&Metrics) -> Distribution, Option<f64>);

fn draw(path: &Path, title: &str, points: &[&RatePoint], slo: Slo) -> Result<()> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 22))?;
    let panels: [Panel; 3] = [
        ("TTFT", |m| m.ttft_ms, slo.ttft_ms),
        ("TPOT", |m| m.tpot_ms, slo.tpot_ms),
        ("ITL", |m| m.itl_ms, None),
    ];
    for (area, panel) in root.split_evenly((1, 3)).iter().zip(panels) {
        draw_panel(area, points, panel)?;
    }
    root.present()?;
    Ok(())
}

/// The `y` range of a log axis holding `values` (the positive ones), with some room.
fn log_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| *v > 0.0 && v.is_finite())
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if hi > 0.0 {
        (lo / 2.0, hi * 2.0)
    } else {
        (1.0, 10.0)
    }
}

/// A tick of the log axis: whole milliseconds from 10 up, more digits below.
fn milliseconds(ms: f64) -> String {
    match ms {
        ms if ms >= 10.0 => format!("{ms:.0}"),
        ms if ms >= 1.0 => format!("{ms:.1}"),
        ms => format!("{ms:.2}"),
    }
}

fn draw_panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    points: &[&RatePoint],
    (name, pick, bound): Panel,
) -> Result<()> {
    // A log axis has no 0: a latency that was not measured (0) is left out.
    let series = |stat: fn(Distribution) -> f64| -> Vec<(i32, f64)> {
        points
            .iter()
            .enumerate()
            .map(|(x, p)| (x as i32, stat(pick(&p.metrics))))
            .filter(|&(_, v)| v > 0.0)
            .collect()
    };
    let (median, p99) = (series(|d| d.median), series(|d| d.p99));
    let (lo, hi) = log_range(median.iter().chain(&p99).map(|p| p.1).chain(bound));
    // One empty step left of the first rate and right of the last.
    let count = points.len() as i32;
    let mut chart = ChartBuilder::on(area)
        .caption(format!("{name} (ms, log scale)"), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(-1..count, (lo..hi).log_scale())?;
    let labels: Vec<String> = points.iter().map(|p| rate_label(p.rate)).collect();
    let x_label = |x: &i32| {
        usize::try_from(*x)
            .ok()
            .and_then(|x| labels.get(x).cloned())
            .unwrap_or_default()
    };
    chart
        .configure_mesh()
        .x_labels(points.len() + 2)
        .x_label_formatter(&x_label)
        .y_labels(8)
        .y_label_formatter(&|y| milliseconds(*y))
        .x_desc("offered request rate (req/s)")
        .y_desc("ms")
        .draw()?;
    let legend = |color: RGBColor, width: u32| {
        move |(x, y): (i32, i32)| PathElement::new([(x, y), (x + 24, y)], color.stroke_width(width))
    };
    chart
        .draw_series(LineSeries::new(median, BLUE.stroke_width(2)).point_size(3))?
        .label(format!("{name} median"))
        .legend(legend(BLUE, 2));
    chart
        .draw_series(LineSeries::new(p99, RED.stroke_width(2)).point_size(3))?
        .label(format!("{name} p99"))
        .legend(legend(RED, 2));
    if let Some(bound) = bound {
        let line = [(-1, bound), (count, bound)];
        chart
            .draw_series(DashedLineSeries::new(line, 8, 6, BLACK.stroke_width(1)))?
            .label(format!("SLO {name} <= {bound} ms"))
            .legend(|(x, y)| DashedPathElement::new([(x, y), (x + 24, y)], 6, 4, BLACK));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::workload::within_slo;
    use super::*;

    fn point(rate: f64, ttft: f64, tpot: f64, itl: f64) -> RatePoint {
        let d = |median: f64| Distribution {
            mean: median,
            median,
            p90: median * 2.0,
            p99: median * 3.0,
        };
        let metrics = Metrics {
            completed: 8,
            failed: 0,
            duration_s: 2.0,
            ttft_ms: d(ttft),
            tpot_ms: d(tpot),
            itl_ms: d(itl),
            e2e_ms: d(ttft + 100.0 * tpot),
            request_throughput: 4.0,
            output_token_throughput: 400.0,
            total_token_throughput: 800.0,
            goodput: Some(4.0),
        };
        let slo = Slo {
            ttft_ms: Some(1000.0),
            tpot_ms: Some(50.0),
        };
        RatePoint {
            rate,
            within_slo: within_slo(&metrics, slo),
            metrics,
        }
    }

    #[test]
    fn plot_refuses_other_formats_with_a_clear_error() {
        for bad in ["latency.png", "latency", "latency.svg.txt"] {
            let error = check_path(Path::new(bad)).unwrap_err().to_string();
            assert!(error.contains("only SVG"), "{bad}: {error}");
        }
        check_path(Path::new("out/latency.SVG")).unwrap();
    }

    #[test]
    fn plot_writes_an_svg_with_every_series_and_the_slo_lines() {
        let dir = std::env::temp_dir().join(format!("pagoda-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("sweep.svg");
        // Out of order, all at once among them, and a TPOT of 0 (nothing measured) at rate 1.
        let points = [
            point(4.0, 80.0, 20.0, 18.0),
            point(1.0, 50.0, 0.0, 15.0),
            point(f64::INFINITY, 900.0, 45.0, 40.0),
            point(2.0, 60.0, 15.0, 16.0),
        ];
        let slo = Slo {
            ttft_ms: Some(1000.0),
            tpot_ms: Some(50.0),
        };
        let title = title("pagoda", "smollm2 & co", "prompts/mine.jsonl");
        write_svg(&path, &title, &points, slo).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(svg.trim_start().starts_with("<svg"), "{svg}");
        assert!(svg.trim_end().ends_with("</svg>"));
        // Median and p99 of three latencies, plus two dashed SLO lines (drawn as segments).
        let lines = svg.matches("<polyline").count() + svg.matches("<path").count();
        assert!(lines >= 8, "{lines} lines");
        for text in [
            "TTFT median",
            "TTFT p99",
            "TPOT median",
            "TPOT p99",
            "ITL median",
            "ITL p99",
            "SLO TTFT &lt;= 1000 ms",
            "SLO TPOT &lt;= 50 ms",
            "offered request rate",
            "model smollm2 &amp; co, dataset mine.jsonl",
            "\ninf\n</text>",
        ] {
            assert!(svg.contains(text), "no {text:?} in the plot:\n{svg}");
        }
        // No ITL SLO.
        assert!(!svg.contains("SLO ITL"));
    }

    #[test]
    fn plot_of_one_rate_and_of_nothing_measured_still_draws() {
        let dir = std::env::temp_dir().join(format!("pagoda-plot1-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("one.svg");
        let slo = Slo::default();
        write_svg(&path, "t", &[point(8.0, 0.0, 0.0, 0.0)], slo).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("\n8\n</text>"),
            "{svg}"
        );
        assert!(!svg.contains("SLO"));
    }
}
