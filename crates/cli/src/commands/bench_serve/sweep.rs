//! `pagoda bench serve --sweep RATES` (and its one-rate form, `--request-rate R`): the serving
//! workload of [`super::workload`] once per request rate, in the order given. Every rate sends
//! the same seeded requests (the seed draws the requests before the arrivals, and the Poisson
//! gaps of every rate are the same draws scaled by 1 / rate), so the rates differ only in how
//! fast the requests arrive. Each rate's summary is printed as for one rate, then a row per
//! rate, and the sustained rate: the highest rate whose p99 TTFT and p99 TPOT are within
//! `--slo-ttft` and `--slo-tpot` (those given) with every request answered, as the serving
//! bars of issue 35 are stated. `--json` prints every rate's figures instead; `--plot` draws
//! them ([`super::plot`]).

use anyhow::{bail, Result};
use serde::Serialize;

use super::workload::{
    self, rate_label, within_slo, Distribution, Metrics, Planned, RatePoint, Slo,
};
use super::{plot, BenchServeArgs};

/// `--sweep`'s request rates (requests per second, infinite: all at once), in the order given.
#[derive(Debug, Clone, PartialEq)]
pub struct Rates(pub Vec<f64>);

/// Parses `--sweep`: comma-separated requests per second, each above 0 (`inf`: all at once).
pub fn parse_rates(text: &str) -> Result<Rates, String> {
    let mut rates = Vec::new();
    for piece in text.split(',').map(str::trim) {
        if piece.is_empty() {
            return Err(format!(
                "an empty rate in '{text}': give comma-separated requests per second, \
                 e.g. 2,4,8,inf"
            ));
        }
        let rate: f64 = piece.parse().map_err(|_| {
            format!("'{piece}' is not a request rate (requests per second, or inf: all at once)")
        })?;
        if rate.is_nan() || rate <= 0.0 {
            return Err(format!(
                "the request rate {piece} must be above 0 (inf: all at once)"
            ));
        }
        rates.push(rate);
    }
    Ok(Rates(rates))
}

/// The highest rate within the SLOs (infinite above every finite one); `None` when no rate is.
pub(super) fn sustained_rate(points: &[RatePoint]) -> Option<f64> {
    points
        .iter()
        .filter(|p| p.within_slo == Some(true))
        .map(|p| p.rate)
        .max_by(f64::total_cmp)
}

/// The JSON of a one-rate run (`--request-rate --json`).
#[derive(Debug, Serialize)]
struct WorkloadReport<'a> {
    label: &'a str,
    url: &'a str,
    dataset: &'a str,
    num_prompts: usize,
    /// Requests per second; `null`: all at once.
    request_rate: Option<f64>,
    max_concurrency: Option<usize>,
    slo_ttft_ms: Option<f64>,
    slo_tpot_ms: Option<f64>,
    #[serde(flatten)]
    metrics: &'a Metrics,
}

/// The JSON of a sweep (`--sweep --json`).
#[derive(Debug, Serialize)]
struct SweepReport<'a> {
    label: &'a str,
    url: &'a str,
    model: &'a str,
    dataset: &'a str,
    num_prompts: usize,
    max_concurrency: Option<usize>,
    slo_ttft_ms: Option<f64>,
    slo_tpot_ms: Option<f64>,
    /// The highest rate within the SLOs: requests per second, or `"inf"` (all at once);
    /// `null` when no rate is, or no SLO was given.
    sustained_rate: Option<serde_json::Value>,
    /// Every rate's figures, in the order run.
    rates: &'a [RatePoint],
}

/// Every rate's seeded requests and arrivals: the same lengths at each rate, with other
/// words, so no rate reads another's prompts from the server's prefix cache.
pub(super) fn plan(args: &BenchServeArgs, rates: &[f64]) -> Result<Vec<(f64, Planned)>> {
    (0u64..)
        .zip(rates)
        .map(|(round, &rate)| Ok((rate, workload::plan(args, rate, round)?)))
        .collect()
}

/// Runs the workload at every planned rate and reports (and plots) the figures.
pub(super) async fn run(
    client: &reqwest::Client,
    base: &str,
    args: &BenchServeArgs,
    model: &str,
    planned: Vec<(f64, Planned)>,
) -> Result<()> {
    let slo = Slo {
        ttft_ms: args.slo_ttft,
        tpot_ms: args.slo_tpot,
    };
    let url = format!("{base}/v1/completions");
    let mut points = Vec::with_capacity(planned.len());
    let mut first_error = None;
    for (index, (rate, planned)) in planned.into_iter().enumerate() {
        if !args.json {
            if index > 0 {
                println!();
            }
            eprintln!(
                "{}: {} requests from {}, {} ...",
                args.label,
                args.num_prompts,
                args.dataset,
                rate_text(rate)
            );
        }
        let api_key = args.api_key.as_deref();
        let (outcomes, errors, duration) =
            workload::send(client, &url, model, api_key, planned, args.max_concurrency).await?;
        if let Some(first) = errors.first() {
            if outcomes.is_empty() && args.sweep.is_none() {
                bail!("every request failed; the first: {first}");
            }
            eprintln!(
                "{}: {} of {} requests failed (counted, not timed); the first: {first}",
                args.label,
                errors.len(),
                args.num_prompts
            );
            first_error.get_or_insert_with(|| first.clone());
        }
        let metrics = workload::measure(&outcomes, errors.len(), duration, slo);
        if !args.json {
            workload::print(&args.label, rate, &metrics, slo);
        }
        points.push(RatePoint {
            rate,
            within_slo: within_slo(&metrics, slo),
            metrics,
        });
    }
    if points.iter().all(|p| p.metrics.completed == 0) {
        let first = first_error.unwrap_or_default();
        bail!("every request failed at every rate; the first: {first}");
    }
    report(base, args, model, &points, slo)?;
    if let Some(path) = &args.plot {
        let title = plot::title(&args.label, model, &args.dataset);
        plot::write_svg(path, &title, &points, slo)?;
        if !args.json {
            eprintln!("{}: plot written to {}", args.label, path.display());
        }
    }
    Ok(())
}

/// Prints the run's JSON (`--json`), or the sweep's table (a one-rate run's summary is out).
fn report(
    base: &str,
    args: &BenchServeArgs,
    model: &str,
    points: &[RatePoint],
    slo: Slo,
) -> Result<()> {
    match (args.json, args.sweep.is_some()) {
        (true, false) => {
            let point = &points[0];
            let report = WorkloadReport {
                label: &args.label,
                url: base,
                dataset: &args.dataset,
                num_prompts: args.num_prompts,
                request_rate: point.rate.is_finite().then_some(point.rate),
                max_concurrency: args.max_concurrency,
                slo_ttft_ms: args.slo_ttft,
                slo_tpot_ms: args.slo_tpot,
                metrics: &point.metrics,
            };
            println!("{}", serde_json::to_string_pretty(&report)?);
        }
        (true, true) => {
            let sustained = sustained_rate(points).map(|rate| match rate.is_finite() {
                true => serde_json::json!(rate),
                false => serde_json::json!("inf"),
            });
            let report = SweepReport {
                label: &args.label,
                url: base,
                model,
                dataset: &args.dataset,
                num_prompts: args.num_prompts,
                max_concurrency: args.max_concurrency,
                slo_ttft_ms: args.slo_ttft,
                slo_tpot_ms: args.slo_tpot,
                sustained_rate: sustained,
                rates: points,
            };
            println!("{}", serde_json::to_string_pretty(&report)?);
        }
        (false, true) => print_sweep(&args.label, points, slo),
        (false, false) => {}
    }
    Ok(())
}

/// `8 req/s`, or `all at once`.
fn rate_text(rate: f64) -> String {
    if rate.is_finite() {
        format!("{rate} req/s")
    } else {
        "all at once".to_owned()
    }
}

/// The bounds a sustained rate meets, in words.
fn slo_text(slo: Slo) -> String {
    let mut parts = Vec::new();
    if let Some(bound) = slo.ttft_ms {
        parts.push(format!("p99 TTFT <= {bound} ms"));
    }
    if let Some(bound) = slo.tpot_ms {
        parts.push(format!("p99 TPOT <= {bound} ms"));
    }
    parts.push("no request failed".to_owned());
    parts.join(", ")
}

/// The sweep's table, a row per rate in the order run, and the sustained rate.
fn print_sweep(label: &str, points: &[RatePoint], slo: Slo) {
    println!();
    println!("{label}: sweep over {} request rates", points.len());
    println!(
        "| rate req/s | completed / failed | req/s | output tok/s | TTFT ms median / p99 \
         | TPOT ms median / p99 | ITL ms median / p99 | goodput req/s | within SLOs |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |");
    let pair = |d: Distribution| format!("{:.1} / {:.1}", d.median, d.p99);
    for point in points {
        let m = &point.metrics;
        let within = match point.within_slo {
            Some(true) => "yes",
            Some(false) => "no",
            None => "-",
        };
        println!(
            "| {} | {} / {} | {:.2} | {:.1} | {} | {} | {} | {} | {within} |",
            rate_label(point.rate),
            m.completed,
            m.failed,
            m.request_throughput,
            m.output_token_throughput,
            pair(m.ttft_ms),
            pair(m.tpot_ms),
            pair(m.itl_ms),
            m.goodput.map_or("-".to_owned(), |g| format!("{g:.2}")),
        );
    }
    if slo.ttft_ms.is_none() && slo.tpot_ms.is_none() {
        println!("{label}: sustained rate not named (give --slo-ttft and --slo-tpot)");
        return;
    }
    match sustained_rate(points) {
        Some(rate) => println!(
            "{label}: sustained rate: {} ({})",
            rate_text(rate),
            slo_text(slo)
        ),
        None => println!(
            "{label}: sustained rate: none of the rates ({})",
            slo_text(slo)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rate_gets_the_same_lengths_in_other_words() {
        use clap::Parser;
        #[derive(Parser)]
        struct Flags {
            #[command(flatten)]
            args: BenchServeArgs,
        }
        let flags = Flags::try_parse_from(["bench", "--sweep", "4,8,inf", "--num-prompts", "20"]);
        let args = flags.unwrap().args;
        let planned = plan(&args, &[4.0, 8.0, f64::INFINITY]).unwrap();
        let lengths = |(requests, _): &Planned| -> Vec<(usize, usize)> {
            let words = |r: &workload::Request| r.prompt.split_whitespace().count();
            requests.iter().map(|r| (words(r), r.max_tokens)).collect()
        };
        let first = &planned[0].1;
        for (rate, other) in &planned[1..] {
            assert_eq!(lengths(first), lengths(other), "rate {rate}");
            for (a, b) in first.0.iter().zip(&other.0) {
                // Not even the first words agree: no prompt is another rate's prefix.
                let head = |r: &workload::Request| r.prompt.chars().take(40).collect::<String>();
                assert_ne!(head(a), head(b), "rate {rate}");
            }
        }
        // The same plan again: seeded.
        let again = plan(&args, &[4.0, 8.0, f64::INFINITY]).unwrap();
        assert_eq!(again[1].1 .0[0].prompt, planned[1].1 .0[0].prompt);
    }

    /// Figures whose p99 TTFT and p99 TPOT are `ttft` and `tpot` milliseconds.
    fn metrics(ttft: f64, tpot: f64, failed: usize) -> Metrics {
        let d = |p99: f64| Distribution {
            mean: p99 / 2.0,
            median: p99 / 2.0,
            p90: p99 * 0.9,
            p99,
        };
        Metrics {
            completed: 10,
            failed,
            duration_s: 1.0,
            ttft_ms: d(ttft),
            tpot_ms: d(tpot),
            itl_ms: d(tpot),
            e2e_ms: d(ttft + 100.0 * tpot),
            request_throughput: 10.0,
            output_token_throughput: 1000.0,
            total_token_throughput: 3000.0,
            goodput: Some(10.0),
        }
    }

    fn point(rate: f64, ttft: f64, tpot: f64, failed: usize, slo: Slo) -> RatePoint {
        let metrics = metrics(ttft, tpot, failed);
        RatePoint {
            rate,
            within_slo: within_slo(&metrics, slo),
            metrics,
        }
    }

    const SLO: Slo = Slo {
        ttft_ms: Some(1000.0),
        tpot_ms: Some(50.0),
    };

    #[test]
    fn sweep_rates_parse_in_order_with_inf() {
        let rates = parse_rates("2,4, 8,16,inf").unwrap().0;
        assert_eq!(&rates[..4], &[2.0, 4.0, 8.0, 16.0]);
        assert!(rates[4].is_infinite() && rates[4] > 0.0);
        assert_eq!(parse_rates("0.5").unwrap(), Rates(vec![0.5]));
        // Not sorted: run in the order given.
        assert_eq!(parse_rates("8,2").unwrap(), Rates(vec![8.0, 2.0]));
    }

    #[test]
    fn sweep_rates_refuse_zero_negative_nan_empty_and_words() {
        for bad in [
            "", "2,,4", "4,", "0", "2,0", "-1", "-inf", "nan", "NaN", "fast", "2;4",
        ] {
            let error = parse_rates(bad).expect_err(bad);
            assert!(
                error.contains("rate"),
                "'{bad}' gave an unclear error: {error}"
            );
        }
        assert!(parse_rates("0").unwrap_err().contains("above 0"));
        assert!(parse_rates("2,,4").unwrap_err().contains("empty"));
    }

    #[test]
    fn within_slo_needs_both_p99s_and_no_failure() {
        assert_eq!(within_slo(&metrics(900.0, 40.0, 0), SLO), Some(true));
        assert_eq!(within_slo(&metrics(1100.0, 40.0, 0), SLO), Some(false));
        assert_eq!(within_slo(&metrics(900.0, 60.0, 0), SLO), Some(false));
        assert_eq!(within_slo(&metrics(900.0, 40.0, 1), SLO), Some(false));
        let ttft_only = Slo {
            ttft_ms: Some(1000.0),
            tpot_ms: None,
        };
        assert_eq!(within_slo(&metrics(900.0, 60.0, 0), ttft_only), Some(true));
        assert_eq!(within_slo(&metrics(900.0, 40.0, 0), Slo::default()), None);
    }

    #[test]
    fn sustained_rate_is_the_highest_rate_within_both_slos() {
        let inf = f64::INFINITY;
        // Within at 2, 4 and 16 (a noisy 8 in between), not at all at once.
        let points = [
            point(2.0, 100.0, 20.0, 0, SLO),
            point(4.0, 200.0, 25.0, 0, SLO),
            point(8.0, 1200.0, 30.0, 0, SLO),
            point(16.0, 800.0, 45.0, 0, SLO),
            point(inf, 5000.0, 80.0, 0, SLO),
        ];
        assert_eq!(sustained_rate(&points), Some(16.0));
        // The order of the sweep does not matter, and all at once ranks above every rate.
        let points = [
            point(inf, 100.0, 20.0, 0, SLO),
            point(32.0, 100.0, 20.0, 0, SLO),
        ];
        assert_eq!(sustained_rate(&points), Some(inf));
        // A failed request disqualifies a rate.
        let points = [
            point(2.0, 100.0, 20.0, 0, SLO),
            point(4.0, 100.0, 20.0, 3, SLO),
        ];
        assert_eq!(sustained_rate(&points), Some(2.0));
        // None within, or no SLO given: no sustained rate.
        let points = [
            point(2.0, 1500.0, 20.0, 0, SLO),
            point(4.0, 900.0, 70.0, 0, SLO),
        ];
        assert_eq!(sustained_rate(&points), None);
        let points = [point(2.0, 1.0, 1.0, 0, Slo::default())];
        assert_eq!(sustained_rate(&points), None);
        assert_eq!(sustained_rate(&[]), None);
    }

    #[test]
    fn a_sweep_point_serializes_all_at_once_as_null() {
        let json = serde_json::to_value(point(f64::INFINITY, 1.0, 1.0, 0, SLO)).unwrap();
        assert!(json["request_rate"].is_null(), "{json}");
        assert_eq!(json["within_slo"], true);
        assert_eq!(json["ttft_ms"]["p99"], 1.0);
        let json = serde_json::to_value(point(4.0, 1.0, 1.0, 0, SLO)).unwrap();
        assert_eq!(json["request_rate"], 4.0);
    }
}
