//! `pagoda bench serve`: drive a running OpenAI-compatible server (pagoda's or llama.cpp's
//! `llama-server`) with concurrent streaming clients and report time to first token,
//! inter-token latency and throughput for the standard serving scenarios.
//!
//! Method: every request is a streamed `POST /v1/completions` with greedy sampling,
//! `ignore_eos` (so every request generates exactly `max_tokens` tokens on servers that honour
//! it) and `stream_options.include_usage`. Prompts are built from a seeded word list and are
//! different in every repetition and for every client, so no prefix cache flatters a repeat;
//! the shared-prefix scenario shares one long prefix among the clients of one repetition only.
//! Time to first token (TTFT) is measured from sending the request to the first chunk with
//! text; inter-token latency (ITL) is the gap between consecutive text chunks. Each scenario
//! runs `repetitions` times; the report gives the median over repetitions of each statistic.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use futures::StreamExt;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// Flags of `pagoda bench serve`.
#[derive(Args, Debug)]
pub struct BenchServeArgs {
    /// Base URL of the server (without `/v1`).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// API key sent as `Authorization: Bearer` (also read from PAGODA_API_KEY).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Model name sent in requests. Default: the first model the server lists at /v1/models.
    #[arg(long)]
    pub model: Option<String>,
    /// Scenarios to run, comma-separated: single, batch4, long, shared-prefix.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "single,batch4,long,shared-prefix"
    )]
    pub scenarios: Vec<String>,
    /// Tokens generated per request.
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub generated_tokens: usize,
    /// Approximate prompt length in words for the short-prompt scenarios.
    #[arg(long, default_value_t = 64)]
    pub prompt_words: usize,
    /// Approximate prompt length in words for the long-context scenario.
    #[arg(long, default_value_t = 3000)]
    pub long_prompt_words: usize,
    /// Length of the shared prefix in words for the shared-prefix scenario.
    #[arg(long, default_value_t = 1000)]
    pub shared_prefix_words: usize,
    /// Concurrent clients in the batched and shared-prefix scenarios.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// Repetitions of every scenario.
    #[arg(short = 'r', long = "repetitions", default_value_t = 3)]
    pub repetitions: usize,
    /// A label for the server under test, printed in the report.
    #[arg(long, default_value = "server")]
    pub label: String,
    /// Seed of the prompt generator (change it to get different prompts).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// What one streamed request measured.
#[derive(Debug, Clone)]
struct RequestTiming {
    ttft: Duration,
    inter_token: Vec<Duration>,
    prompt_tokens: Option<u64>,
    completion_tokens: u64,
}

#[derive(Debug, Serialize)]
struct ScenarioResult {
    scenario: String,
    clients: usize,
    prompt_tokens: u64,
    completion_tokens_per_request: u64,
    /// Medians over repetitions.
    ttft_p50_ms: f64,
    ttft_p95_ms: f64,
    itl_p50_ms: f64,
    itl_p95_ms: f64,
    /// Generated tokens of all clients / wall time of the repetition.
    throughput_tokens_per_second: f64,
    throughput_per_repetition: Vec<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    label: String,
    url: String,
    generated_tokens: usize,
    repetitions: usize,
    load_before: String,
    load_after: String,
    results: Vec<ScenarioResult>,
}

/// Runs `pagoda bench serve`.
pub fn run(mut args: BenchServeArgs) -> Result<()> {
    // `--api-key` is merged into the setting (the flag wins over $PAGODA_API_KEY).
    args.api_key = pagoda_config::global()
        .text("PAGODA_API_KEY")
        .map(str::to_owned);
    if args.repetitions == 0 || args.clients == 0 || args.generated_tokens == 0 {
        bail!("--repetitions, --clients and --n-gen must be at least 1");
    }
    for scenario in &args.scenarios {
        if !["single", "batch4", "long", "shared-prefix"].contains(&scenario.as_str()) {
            bail!("unknown scenario '{scenario}'; choose from single, batch4, long, shared-prefix");
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run_async(args))
}

async fn run_async(args: BenchServeArgs) -> Result<()> {
    // A fresh connection per request: some servers close idle keep-alive connections, and a
    // request sent on one that is closing fails with no answer.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(900))
        .build()?;
    let base = args.url.trim_end_matches('/').to_string();
    let listed = check_server(&client, &base, args.api_key.as_deref()).await?;
    let model = args.model.clone().unwrap_or(listed);

    let load_before = super::host::load_average();
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let mut results = Vec::new();
    for scenario in &args.scenarios {
        let (clients, prompt_words, shared_words) = match scenario.as_str() {
            "single" => (1, args.prompt_words, 0),
            "batch4" => (args.clients, args.prompt_words, 0),
            "long" => (1, args.long_prompt_words, 0),
            _ => (args.clients, args.prompt_words, args.shared_prefix_words),
        };
        if !args.json {
            eprintln!("{}: {scenario} ({clients} client(s)) ...", args.label);
        }
        let mut per_rep = Vec::new();
        for _ in 0..args.repetitions {
            let shared = random_words(&mut rng, shared_words);
            let prompts: Vec<String> = (0..clients)
                .map(|_| format!("{shared}{}", random_words(&mut rng, prompt_words)))
                .collect();
            per_rep.push(run_repetition(&client, &base, &args, &model, prompts).await?);
        }
        results.push(summarize(scenario, clients, &per_rep));
    }
    let report = Report {
        label: args.label.clone(),
        url: base,
        generated_tokens: args.generated_tokens,
        repetitions: args.repetitions,
        load_before,
        load_after: super::host::load_average(),
        results,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

/// Checks the server answers `/v1/models` and returns the first model id it lists.
async fn check_server(
    client: &reqwest::Client,
    base: &str,
    api_key: Option<&str>,
) -> Result<String> {
    let mut request = client.get(format!("{base}/v1/models"));
    if let Some(key) = api_key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.with_context(|| {
        format!("cannot reach a server at {base}; start one first (pagoda serve) or pass --url")
    })?;
    if !response.status().is_success() {
        bail!(
            "{base}/v1/models answered {}; check --url and --api-key",
            response.status()
        );
    }
    let models: serde_json::Value = response.json().await.context("reading /v1/models")?;
    models["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| anyhow!("{base}/v1/models lists no model; pass --model"))
}

/// One repetition: all prompts sent at once, each by its own client task.
async fn run_repetition(
    client: &reqwest::Client,
    base: &str,
    args: &BenchServeArgs,
    model: &str,
    prompts: Vec<String>,
) -> Result<(Vec<RequestTiming>, Duration)> {
    let started = Instant::now();
    let tasks: Vec<_> = prompts
        .into_iter()
        .map(|prompt| {
            let client = client.clone();
            let url = format!("{base}/v1/completions");
            let body = serde_json::json!({
                "model": model,
                "prompt": prompt,
                "max_tokens": args.generated_tokens,
                "temperature": 0.0,
                "ignore_eos": true,
                "stream": true,
                "stream_options": {"include_usage": true},
            });
            let api_key = args.api_key.clone();
            tokio::spawn(async move { stream_one(&client, &url, &body, api_key.as_deref()).await })
        })
        .collect();
    let mut timings = Vec::new();
    for task in tasks {
        timings.push(
            task.await
                .map_err(|e| anyhow!("client task failed: {e}"))??,
        );
    }
    Ok((timings, started.elapsed()))
}

async fn stream_one(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
    api_key: Option<&str>,
) -> Result<RequestTiming> {
    let mut request = client.post(url).json(body);
    if let Some(key) = api_key {
        request = request.bearer_auth(key);
    }
    let sent = Instant::now();
    let response = request.send().await.context("sending a request")?;
    if !response.status().is_success() {
        let status = response.status();
        let text = response.text().await.unwrap_or_default();
        bail!("the server answered {status}: {text}");
    }
    let mut stream = response.bytes_stream();
    let mut buffer = Vec::<u8>::new();
    let mut first: Option<Instant> = None;
    let mut last = sent;
    let mut inter_token = Vec::new();
    let mut text_chunks = 0u64;
    let mut usage: Option<(Option<u64>, u64)> = None;
    while let Some(bytes) = stream.next().await {
        let bytes = bytes.context("reading the stream")?;
        let now = Instant::now();
        buffer.extend_from_slice(&bytes);
        while let Some(end) = buffer.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buffer.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                continue;
            }
            let chunk: serde_json::Value = serde_json::from_str(data)
                .with_context(|| format!("a stream chunk is not JSON: {data}"))?;
            if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
                let completion = u["completion_tokens"].as_u64().unwrap_or(0);
                usage = Some((u["prompt_tokens"].as_u64(), completion));
            }
            let has_text = chunk["choices"]
                .as_array()
                .and_then(|c| c.first())
                .and_then(|c| c["text"].as_str())
                .is_some_and(|t| !t.is_empty());
            if has_text {
                text_chunks += 1;
                match first {
                    None => first = Some(now),
                    Some(_) => inter_token.push(now - last),
                }
                last = now;
            }
        }
    }
    let first = first.ok_or_else(|| anyhow!("the stream ended without any text"))?;
    let (prompt_tokens, completion_tokens) = usage.unwrap_or((None, text_chunks));
    Ok(RequestTiming {
        ttft: first - sent,
        inter_token,
        prompt_tokens,
        completion_tokens,
    })
}

fn summarize(
    scenario: &str,
    clients: usize,
    repetitions: &[(Vec<RequestTiming>, Duration)],
) -> ScenarioResult {
    let mut ttft_p50 = Vec::new();
    let mut ttft_p95 = Vec::new();
    let mut itl_p50 = Vec::new();
    let mut itl_p95 = Vec::new();
    let mut throughput = Vec::new();
    for (timings, wall) in repetitions {
        let mut ttfts: Vec<f64> = timings.iter().map(|t| millis(t.ttft)).collect();
        let mut itls: Vec<f64> = timings
            .iter()
            .flat_map(|t| t.inter_token.iter().map(|&d| millis(d)))
            .collect();
        ttft_p50.push(percentile(&mut ttfts, 0.50));
        ttft_p95.push(percentile(&mut ttfts, 0.95));
        itl_p50.push(percentile(&mut itls, 0.50));
        itl_p95.push(percentile(&mut itls, 0.95));
        let generated: u64 = timings.iter().map(|t| t.completion_tokens).sum();
        throughput.push(generated as f64 / wall.as_secs_f64());
    }
    let last = &repetitions.last().expect("at least one repetition").0;
    ScenarioResult {
        scenario: scenario.to_string(),
        clients,
        prompt_tokens: last
            .iter()
            .filter_map(|t| t.prompt_tokens)
            .max()
            .unwrap_or(0),
        completion_tokens_per_request: last.iter().map(|t| t.completion_tokens).max().unwrap_or(0),
        ttft_p50_ms: median(&mut ttft_p50),
        ttft_p95_ms: median(&mut ttft_p95),
        itl_p50_ms: median(&mut itl_p50),
        itl_p95_ms: median(&mut itl_p95),
        throughput_tokens_per_second: median(&mut throughput.clone()),
        throughput_per_repetition: throughput,
    }
}

fn print_table(report: &Report) {
    println!(
        "\n{} at {} ({} tokens per request, {} repetitions; load {} -> {})",
        report.label,
        report.url,
        report.generated_tokens,
        report.repetitions,
        report.load_before,
        report.load_after
    );
    println!("| scenario | clients | prompt tok | gen tok | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms | tok/s (median) |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in &report.results {
        println!(
            "| {} | {} | {} | {} | {:.1} | {:.1} | {:.2} | {:.2} | {:.1} |",
            r.scenario,
            r.clients,
            r.prompt_tokens,
            r.completion_tokens_per_request,
            r.ttft_p50_ms,
            r.ttft_p95_ms,
            r.itl_p50_ms,
            r.itl_p95_ms,
            r.throughput_tokens_per_second
        );
    }
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

/// Nearest-rank percentile (`fraction` in [0, 1]); 0 for an empty list.
fn percentile(values: &mut [f64], fraction: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((fraction * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

fn median(values: &mut [f64]) -> f64 {
    percentile(values, 0.5)
}

/// `count` words drawn from a fixed list, each preceded by a space (about one token each for
/// English BPE vocabularies).
fn random_words(rng: &mut ChaCha8Rng, count: usize) -> String {
    const WORDS: &[&str] = &[
        "the", "river", "stone", "light", "garden", "window", "morning", "quiet", "city", "bridge",
        "music", "paper", "winter", "summer", "forest", "market", "little", "golden", "story",
        "ocean", "mountain", "tower", "letter", "friend", "evening", "silver", "road", "house",
        "field", "cloud", "sound", "table", "street", "school", "water", "fire", "green", "blue",
        "old", "new", "long", "short", "bright", "dark", "soft", "warm", "cold", "open", "close",
        "walk", "read", "write", "sing", "build", "carry", "watch",
    ];
    let mut text = String::with_capacity(count * 7);
    for _ in 0..count {
        text.push(' ');
        text.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_is_nearest_rank() {
        let mut values = vec![5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(percentile(&mut values, 0.5), 3.0);
        assert_eq!(percentile(&mut values, 0.95), 5.0);
        assert_eq!(percentile(&mut values, 0.0), 1.0);
        assert_eq!(percentile(&mut [], 0.5), 0.0);
    }

    #[test]
    fn prompts_differ_between_draws() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let a = random_words(&mut rng, 50);
        let b = random_words(&mut rng, 50);
        assert_ne!(a, b);
        assert_eq!(a.split_whitespace().count(), 50);
    }
}
