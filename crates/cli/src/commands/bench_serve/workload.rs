//! `pagoda bench serve --request-rate R`: a serving workload as `vllm bench serve` and
//! SGLang's `bench_serving` run one. `--num-prompts` requests whose lengths come from a dataset
//! (`--dataset`: a built-in generator of ShareGPT-like lengths, fixed lengths, or the user's
//! JSONL prompts) arrive as a Poisson process at R requests per second (`inf`: all at once),
//! at most `--max-concurrency` in flight. Reported: time to first token (TTFT), time per
//! output token after the first (TPOT, per request), inter-token latency (ITL, every gap) and
//! end-to-end latency, each as mean, median, p90 and p99; request and token throughput over the
//! run's duration; and goodput, the requests per second that met `--slo-ttft` and
//! `--slo-tpot`. Seeded: the same flags give the same prompts, lengths and arrival times.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Serialize, Serializer};

use super::{completion_body, random_words, stream_one, BenchServeArgs, RequestTiming};
use crate::commands::stats;

/// One request of the workload.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Request {
    pub prompt: String,
    pub max_tokens: usize,
}

/// Where the requests come from (`--dataset`).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Dataset {
    /// Log-normal lengths shaped like ShareGPT's ([`sharegpt_like_lengths`]).
    ShareGptLike,
    /// `--prompt-words` words in, `--n-gen` tokens out, every request.
    Fixed,
    /// One JSON object a line: `{"prompt": "...", "max_tokens": N}` (`max_tokens` optional:
    /// `--n-gen`).
    File(PathBuf),
}

impl Dataset {
    pub fn parse(text: &str) -> Dataset {
        match text {
            "sharegpt-like" => Dataset::ShareGptLike,
            "fixed" => Dataset::Fixed,
            path => Dataset::File(path.into()),
        }
    }
}

/// A standard normal draw (Box-Muller).
fn normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = rng.random_range(f64::EPSILON..1.0);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// `(input, output)` lengths in tokens, shaped like the ShareGPT conversations `vllm bench
/// serve` samples (no such dataset ships on PyPI): log-normal with medians 120 and 110 and
/// sigma 1 (means near 200 and 180, long-tailed), clamped to [4, 2048] and [1, 1024].
pub(super) fn sharegpt_like_lengths(rng: &mut ChaCha8Rng, count: usize) -> Vec<(usize, usize)> {
    let draw = |rng: &mut ChaCha8Rng, median: f64, max: f64, min: f64| {
        (median * normal(rng).exp()).round().clamp(min, max) as usize
    };
    (0..count)
        .map(|_| (draw(rng, 120.0, 2048.0, 4.0), draw(rng, 110.0, 1024.0, 1.0)))
        .collect()
}

/// Mixed into `--seed` (times the round) for the generated prompts' words.
const WORDS_SEED: u64 = 0x9E37_79B9_7F4A_7C15;

/// The workload's `count` requests: lengths drawn from `rng`, the generated prompts' words
/// from `words`.
pub(super) fn requests(
    dataset: &Dataset,
    args: &BenchServeArgs,
    rng: &mut ChaCha8Rng,
    words: &mut ChaCha8Rng,
    count: usize,
) -> Result<Vec<Request>> {
    Ok(match dataset {
        Dataset::ShareGptLike => sharegpt_like_lengths(rng, count)
            .into_iter()
            .map(|(input, output)| Request {
                prompt: random_words(words, input),
                max_tokens: output,
            })
            .collect(),
        Dataset::Fixed => (0..count)
            .map(|_| Request {
                prompt: random_words(words, args.prompt_words),
                max_tokens: args.generated_tokens,
            })
            .collect(),
        Dataset::File(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("--dataset {}", path.display()))?;
            let mut read = Vec::new();
            for (index, line) in text
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
            {
                let bad = |why: &str| {
                    anyhow!(
                        "--dataset {} line {}: {why} (each line: {{\"prompt\": \"...\", \
                         \"max_tokens\": N}})",
                        path.display(),
                        index + 1
                    )
                };
                let value: serde_json::Value =
                    serde_json::from_str(line).map_err(|e| bad(&e.to_string()))?;
                let prompt = value["prompt"]
                    .as_str()
                    .ok_or_else(|| bad("no \"prompt\" text"))?;
                let max_tokens = match value.get("max_tokens") {
                    None => args.generated_tokens,
                    Some(n) => n
                        .as_u64()
                        .filter(|&n| n >= 1)
                        .ok_or_else(|| bad("\"max_tokens\" must be a whole number >= 1"))?
                        as usize,
                };
                read.push(Request {
                    prompt: prompt.to_owned(),
                    max_tokens,
                });
            }
            if read.is_empty() {
                bail!("--dataset {} holds no request", path.display());
            }
            // The file's requests in order, again from the start when it has fewer.
            read.iter().cycle().take(count).cloned().collect()
        }
    })
}

/// Arrival offsets from the start: a Poisson process at `rate` requests per second
/// (exponential gaps), all at 0 for an infinite rate.
pub(super) fn arrivals(rng: &mut ChaCha8Rng, count: usize, rate: f64) -> Vec<Duration> {
    let mut at = 0.0f64;
    (0..count)
        .map(|_| {
            if rate.is_finite() {
                let u: f64 = rng.random_range(f64::EPSILON..1.0);
                at += -u.ln() / rate;
            }
            Duration::from_secs_f64(at)
        })
        .collect()
}

/// Mean, median, p90 and p99 of a latency, in milliseconds (0 when nothing was measured).
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub(super) struct Distribution {
    pub mean: f64,
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Distribution {
    fn of(values: &[f64]) -> Distribution {
        let at = |f| stats::percentile(values, f).unwrap_or(0.0);
        let mean = if values.is_empty() {
            0.0
        } else {
            values.iter().sum::<f64>() / values.len() as f64
        };
        Distribution {
            mean,
            median: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
        }
    }
}

/// What one request measured, and its end-to-end latency.
#[derive(Debug, Clone)]
pub(super) struct Outcome {
    pub timing: RequestTiming,
    pub e2e: Duration,
}

impl Outcome {
    /// Time per output token after the first, when it generated more than one.
    fn tpot_ms(&self) -> Option<f64> {
        let after_first = self
            .timing
            .completion_tokens
            .checked_sub(1)
            .filter(|&n| n > 0)?;
        Some(millis(self.e2e.saturating_sub(self.timing.ttft)) / after_first as f64)
    }
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The service-level objectives goodput counts against (milliseconds; `None`: no bound).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Slo {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
}

/// The workload's figures.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Metrics {
    pub completed: usize,
    /// Requests the server refused or broke off (a 429 from a full queue, a dropped stream):
    /// in no other figure.
    pub failed: usize,
    pub duration_s: f64,
    pub ttft_ms: Distribution,
    pub tpot_ms: Distribution,
    pub itl_ms: Distribution,
    pub e2e_ms: Distribution,
    pub request_throughput: f64,
    pub output_token_throughput: f64,
    /// Prompt and generated tokens per second (prompt tokens as the server counted them).
    pub total_token_throughput: f64,
    /// Requests per second within every given SLO (`None` without one).
    pub goodput: Option<f64>,
}

/// The figures of `outcomes` (and `failed` requests), which took `duration` from the first
/// arrival to the last answer.
pub(super) fn measure(
    outcomes: &[Outcome],
    failed: usize,
    duration: Duration,
    slo: Slo,
) -> Metrics {
    let seconds = duration.as_secs_f64().max(1e-9);
    let ttfts: Vec<f64> = outcomes.iter().map(|o| millis(o.timing.ttft)).collect();
    let tpots: Vec<f64> = outcomes.iter().filter_map(Outcome::tpot_ms).collect();
    let itls: Vec<f64> = outcomes
        .iter()
        .flat_map(|o| o.timing.inter_token.iter().map(|&d| millis(d)))
        .collect();
    let e2es: Vec<f64> = outcomes.iter().map(|o| millis(o.e2e)).collect();
    let output: u64 = outcomes.iter().map(|o| o.timing.completion_tokens).sum();
    let prompt: u64 = outcomes.iter().filter_map(|o| o.timing.prompt_tokens).sum();
    let good = outcomes
        .iter()
        .filter(|o| {
            slo.ttft_ms
                .is_none_or(|bound| millis(o.timing.ttft) <= bound)
                && slo
                    .tpot_ms
                    .is_none_or(|bound| o.tpot_ms().is_none_or(|tpot| tpot <= bound))
        })
        .count();
    let any_slo = slo.ttft_ms.is_some() || slo.tpot_ms.is_some();
    Metrics {
        completed: outcomes.len(),
        failed,
        duration_s: seconds,
        ttft_ms: Distribution::of(&ttfts),
        tpot_ms: Distribution::of(&tpots),
        itl_ms: Distribution::of(&itls),
        e2e_ms: Distribution::of(&e2es),
        request_throughput: outcomes.len() as f64 / seconds,
        output_token_throughput: output as f64 / seconds,
        total_token_throughput: (output + prompt) as f64 / seconds,
        goodput: any_slo.then(|| good as f64 / seconds),
    }
}

/// What a workload's requests gave: the completed ones' measurements, the failed ones' errors,
/// and the time from the start to the last answer.
pub(super) type Sent = (Vec<Outcome>, Vec<String>, Duration);

/// Sends `requests` at their `arrivals` (at most `max_concurrency` in flight); a request the
/// server refuses or breaks off is counted, not fatal.
pub(super) async fn send(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    api_key: Option<&str>,
    (requests, arrivals): Planned,
    max_concurrency: Option<usize>,
) -> Result<Sent> {
    let permits = max_concurrency.unwrap_or(tokio::sync::Semaphore::MAX_PERMITS);
    let gate = Arc::new(tokio::sync::Semaphore::new(permits));
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(requests.len());
    for (request, at) in requests.into_iter().zip(arrivals) {
        tokio::time::sleep_until(start + at).await;
        let permit = gate.clone().acquire_owned().await?;
        let (client, url) = (client.clone(), url.to_owned());
        let body = completion_body(model, &request.prompt, request.max_tokens);
        let api_key = api_key.map(str::to_owned);
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            let timing = stream_one(&client, &url, &body, api_key.as_deref()).await;
            drop(permit);
            timing.map(|timing| Outcome {
                timing,
                e2e: sent.elapsed(),
            })
        }));
    }
    let (mut outcomes, mut errors) = (Vec::with_capacity(tasks.len()), Vec::new());
    for task in tasks {
        match task.await.map_err(|e| anyhow!("client task failed: {e}"))? {
            Ok(outcome) => outcomes.push(outcome),
            Err(error) => errors.push(format!("{error:#}")),
        }
    }
    Ok((outcomes, errors, start.elapsed()))
}

/// A workload's requests and their arrival offsets.
pub(super) type Planned = (Vec<Request>, Vec<Duration>);

/// The seeded requests and arrival times of `args`' workload.
///
/// `round` (a sweep's rate index) seeds the generated prompts' words only: every round has
/// the same lengths and arrival draws, but no prompt of one round is a prefix of another's, so
/// the server's prefix cache does not flatter the later rates of a sweep (a `--dataset` file's
/// prompts are the file's in every round).
pub(super) fn plan(args: &BenchServeArgs, rate: f64, round: u64) -> Result<Planned> {
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let mut words = ChaCha8Rng::seed_from_u64(args.seed ^ WORDS_SEED.wrapping_mul(round + 1));
    let requests = requests(
        &Dataset::parse(&args.dataset),
        args,
        &mut rng,
        &mut words,
        args.num_prompts,
    )?;
    let arrivals = arrivals(&mut rng, requests.len(), rate);
    Ok((requests, arrivals))
}

/// A rate as a table or plot shows it: `2`, `0.5`, `inf`.
pub(super) fn rate_label(rate: f64) -> String {
    if rate.is_finite() {
        format!("{rate}")
    } else {
        "inf".to_owned()
    }
}

/// What one rate of the sweep measured.
#[derive(Debug, Clone, Serialize)]
pub(super) struct RatePoint {
    /// Requests per second offered; in JSON `request_rate`, `null` for all at once.
    #[serde(rename = "request_rate", serialize_with = "finite_or_null")]
    pub rate: f64,
    /// Whether p99 TTFT and p99 TPOT are within the SLOs given, with at least one request
    /// completed and none failed; `None` without any SLO.
    pub within_slo: Option<bool>,
    #[serde(flatten)]
    pub metrics: Metrics,
}

fn finite_or_null<S: Serializer>(rate: &f64, serializer: S) -> Result<S::Ok, S::Error> {
    rate.is_finite().then_some(*rate).serialize(serializer)
}

/// Whether `m` is within `slo` ([`RatePoint::within_slo`]).
pub(super) fn within_slo(m: &Metrics, slo: Slo) -> Option<bool> {
    if slo.ttft_ms.is_none() && slo.tpot_ms.is_none() {
        return None;
    }
    let meets = |bound: Option<f64>, p99: f64| bound.is_none_or(|bound| p99 <= bound);
    Some(
        m.completed > 0
            && m.failed == 0
            && meets(slo.ttft_ms, m.ttft_ms.p99)
            && meets(slo.tpot_ms, m.tpot_ms.p99),
    )
}

/// The table of one workload run.
pub(super) fn print(label: &str, rate: f64, m: &Metrics, slo: Slo) {
    let rate = if rate.is_finite() {
        format!("{rate} req/s")
    } else {
        "all at once".to_owned()
    };
    println!(
        "{label}: {} requests completed, {} failed, {rate}, {:.2} s",
        m.completed, m.failed, m.duration_s
    );
    println!("| metric | mean | median | p90 | p99 |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for (name, d) in [
        ("TTFT ms", m.ttft_ms),
        ("TPOT ms", m.tpot_ms),
        ("ITL ms", m.itl_ms),
        ("E2E ms", m.e2e_ms),
    ] {
        println!(
            "| {name} | {:.1} | {:.1} | {:.1} | {:.1} |",
            d.mean, d.median, d.p90, d.p99
        );
    }
    println!(
        "requests/s {:.2}, output tok/s {:.1}, total tok/s {:.1}",
        m.request_throughput, m.output_token_throughput, m.total_token_throughput
    );
    if let Some(goodput) = m.goodput {
        let bound = |b: Option<f64>| b.map_or("-".to_owned(), |b| format!("{b} ms"));
        println!(
            "goodput {goodput:.2} req/s (TTFT <= {}, TPOT <= {})",
            bound(slo.ttft_ms),
            bound(slo.tpot_ms)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(ttft_ms: u64, gaps_ms: &[u64], tokens: u64) -> RequestTiming {
        RequestTiming {
            ttft: Duration::from_millis(ttft_ms),
            inter_token: gaps_ms.iter().map(|&g| Duration::from_millis(g)).collect(),
            prompt_tokens: Some(10),
            completion_tokens: tokens,
        }
    }

    #[test]
    fn sharegpt_like_lengths_have_the_published_means_and_a_long_tail() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let lengths = sharegpt_like_lengths(&mut rng, 20_000);
        let mean = |f: fn(&(usize, usize)) -> usize| {
            lengths.iter().map(f).sum::<usize>() as f64 / lengths.len() as f64
        };
        let (input, output) = (mean(|l| l.0), mean(|l| l.1));
        assert!((180.0..220.0).contains(&input), "input mean {input}");
        assert!((160.0..200.0).contains(&output), "output mean {output}");
        // Long-tailed: the 99th percentile is several times the median.
        let mut inputs: Vec<f64> = lengths.iter().map(|l| l.0 as f64).collect();
        inputs.sort_by(f64::total_cmp);
        let p = |f| stats::percentile(&inputs, f).unwrap();
        assert!(p(0.99) > 5.0 * p(0.5), "p99 {} median {}", p(0.99), p(0.5));
    }

    #[test]
    fn arrivals_are_poisson_at_the_rate_or_all_at_once() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let times = arrivals(&mut rng, 10_000, 4.0);
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
        let rate = times.len() as f64 / times.last().unwrap().as_secs_f64();
        assert!((3.8..4.2).contains(&rate), "rate {rate}");
        // Exponential gaps: their standard deviation equals their mean.
        let gaps: Vec<f64> = times
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64())
            .collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        assert!(
            (var.sqrt() / mean - 1.0).abs() < 0.05,
            "cv {}",
            var.sqrt() / mean
        );
        let at_once = arrivals(&mut rng, 5, f64::INFINITY);
        assert!(at_once.iter().all(|t| t.is_zero()));
    }

    #[test]
    fn metrics_and_goodput_follow_their_definitions() {
        // TTFT 100 ms, 4 tokens in 400 ms end to end: TPOT (400 - 100) / 3 = 100 ms.
        let a = Outcome {
            timing: timing(100, &[100, 100, 100], 4),
            e2e: Duration::from_millis(400),
        };
        // TTFT 300 ms, 2 tokens in 350 ms: TPOT 50 ms.
        let b = Outcome {
            timing: timing(300, &[50], 2),
            e2e: Duration::from_millis(350),
        };
        // One token: no TPOT, counts as within a TPOT bound.
        let c = Outcome {
            timing: timing(50, &[], 1),
            e2e: Duration::from_millis(50),
        };
        let outcomes = [a, b, c];
        let slo = Slo {
            ttft_ms: Some(200.0),
            tpot_ms: Some(80.0),
        };
        let m = measure(&outcomes, 1, Duration::from_secs(2), slo);
        assert_eq!((m.completed, m.failed), (3, 1));
        assert!((m.tpot_ms.mean - 75.0).abs() < 1e-9, "{:?}", m.tpot_ms);
        assert!((m.ttft_ms.median - 100.0).abs() < 1e-9);
        assert!((m.itl_ms.mean - 87.5).abs() < 1e-9);
        assert!((m.request_throughput - 1.5).abs() < 1e-9);
        assert!((m.output_token_throughput - 3.5).abs() < 1e-9);
        assert!((m.total_token_throughput - 18.5).abs() < 1e-9);
        // a fails TPOT (100 > 80), b fails TTFT (300 > 200), c meets both.
        assert_eq!(m.goodput, Some(0.5));
        let no_slo = measure(&outcomes, 0, Duration::from_secs(2), Slo::default());
        assert_eq!(no_slo.goodput, None);
    }
}
