//! End-to-end tests of `pagoda inspect` and `pagoda bench` (`bench serve` against a
//! `pagoda serve` of a tiny model).

mod support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::{default_model, pagoda, repo_root, tiny_model};

/// The value after `prefix` on the line that starts with it.
fn line_after<'a>(text: &'a str, prefix: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no line starting with {prefix:?} in:\n{text}"))
}

#[test]
fn inspect_default_model() {
    let Some(model) = default_model() else { return };
    let out = pagoda(&["inspect", "-m", model.to_str().unwrap()], None);
    out.assert_success();
    let text = out.stdout_text();
    // Oracle: the GGUF metadata of SmolLM2-135M-Instruct Q4_1 (llama.cpp's gguf dump): 30 blocks,
    // 576 wide, 9/3 heads, FFN 1536, vocab 49152, context 8192; 272 tensors, of which 61 F32
    // (norms), 210 Q4_1, and the Q8_0 token embedding; 134,515,008 parameters.
    assert!(text.contains("format: GGUF v3"), "{text}");
    assert_eq!(line_after(&text, "architecture: "), "Llama");
    assert_eq!(
        line_after(&text, "shape: "),
        "30 layers, hidden 576, 9 heads / 3 KV heads x 64, FFN 1536, vocab 49152, context 8192"
    );
    assert_eq!(
        line_after(&text, "tensors: "),
        "272 (61 F32, 210 Q4_1, 1 Q8_0)"
    );
    assert!(
        line_after(&text, "parameters: ").starts_with("134515008 "),
        "{text}"
    );
    assert!(
        text.contains("  general.architecture = \"llama\""),
        "{text}"
    );
    // KV per token: 2 (K and V) x 30 layers x 3 KV heads x 64 x 4 bytes = 46080.
    assert!(
        line_after(&text, "KV cache (f32): ").starts_with("46080 bytes per token"),
        "{text}"
    );
    assert!(
        text.contains("for a context of 4096"),
        "default context min(8192, 4096)"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("memory for context 4096: ")),
        "{text}"
    );
    assert!(
        !text.contains("token_embd.weight"),
        "tensors are listed only with --tensors"
    );

    let out = pagoda(
        &[
            "inspect",
            "-m",
            model.to_str().unwrap(),
            "--tensors",
            "-c",
            "512",
        ],
        None,
    );
    out.assert_success();
    let text = out.stdout_text();
    assert!(text.contains("for a context of 512"));
    let listed: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("  ") && l.ends_with(" bytes"))
        .collect();
    assert_eq!(listed.len(), 272, "{text}");
    let embedding = listed
        .iter()
        .find(|l| l.trim_start().starts_with("token_embd.weight "))
        .expect("token_embd listed");
    // Q8_0 [49152, 576]: 34 bytes per 32 values.
    assert!(
        embedding.contains("Q8_0") && embedding.contains("[49152, 576]"),
        "{embedding}"
    );
    assert!(
        embedding.ends_with(&format!(" {} bytes", 49152 * 576 / 32 * 34)),
        "{embedding}"
    );
}

#[test]
fn inspect_tiny_gguf_and_hf_directory() {
    // tiny-llama: hidden 64, 4/2 heads x 16, FFN 128, 2 layers, vocab 256, untied output.
    // Parameters: 2 x 256 x 64 (embedding + output) + 64 (final norm)
    //   + 2 layers x (64x64 q + 2 x 32x64 k,v + 64x64 o + 3 x 128x64 MLP + 2 x 64 norms) = 106816;
    // the GGUF adds the 8-value `rope_freqs` tensor.
    let layer = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64 + 2 * 64;
    let hf_parameters = 2 * 256 * 64 + 64 + 2 * layer;
    for (name, format, tensors, parameters) in [
        (
            "tiny-llama-f32.gguf",
            "GGUF v3",
            "22 (22 F32)",
            hf_parameters + 8,
        ),
        (
            "tiny-llama",
            "Hugging Face directory",
            "21 (21 BF16)",
            hf_parameters,
        ),
    ] {
        let path = tiny_model(name);
        let out = pagoda(
            &["inspect", "-m", path.to_str().unwrap(), "--tensors"],
            None,
        );
        out.assert_success();
        let text = out.stdout_text();
        assert!(line_after(&text, "format: ").starts_with(format), "{text}");
        assert_eq!(line_after(&text, "architecture: "), "Llama");
        assert_eq!(
            line_after(&text, "shape: "),
            "2 layers, hidden 64, 4 heads / 2 KV heads x 16, FFN 128, vocab 256, context 256"
        );
        assert_eq!(line_after(&text, "tensors: "), tensors);
        assert_eq!(
            line_after(&text, "parameters: "),
            format!("{parameters} ({:.1} K)", parameters as f64 / 1e3)
        );
        // The default context is the model's own (256), not more.
        assert!(text.contains("for a context of 256"), "{text}");
        assert!(
            text.lines()
                .any(|l| l.trim_start().starts_with("blk.1.ffn_down.weight ")),
            "{text}"
        );
    }
    let out = pagoda(
        &["inspect", "-m", tiny_model("tiny-qwen3").to_str().unwrap()],
        None,
    );
    out.assert_success();
    assert_eq!(line_after(&out.stdout_text(), "architecture: "), "Qwen3");
}

/// Parses the JSON report and checks its tests: name -> all rates positive and finite, the
/// median the middle rate (the mean of the two middle ones for an even count). Returns the
/// report.
fn check_json_report(
    stdout: &str,
    expected_tests: &[&str],
    repetitions: usize,
    batch: u64,
) -> serde_json::Value {
    let report: serde_json::Value =
        serde_json::from_str(stdout).unwrap_or_else(|e| panic!("bad JSON ({e}):\n{stdout}"));
    assert_eq!(report["batch"].as_u64(), Some(batch));
    assert!(report["threads"].as_u64().unwrap() >= 1);
    let results = report["results"].as_array().expect("results array");
    let names: Vec<&str> = results
        .iter()
        .map(|r| r["test"].as_str().unwrap())
        .collect();
    assert_eq!(names, expected_tests);
    for result in results {
        let rates: Vec<f64> = result["tokens_per_second"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(rates.len(), repetitions);
        assert!(rates.iter().all(|r| r.is_finite() && *r > 0.0), "{result}");
        let (min, median, max) = (
            result["min"].as_f64().unwrap(),
            result["median"].as_f64().unwrap(),
            result["max"].as_f64().unwrap(),
        );
        assert!(min > 0.0 && min <= median && median <= max, "{result}");
        assert_eq!(min, rates.iter().copied().fold(f64::INFINITY, f64::min));
        assert_eq!(max, rates.iter().copied().fold(0.0, f64::max));
        let mut sorted = rates.clone();
        sorted.sort_by(f64::total_cmp);
        let middle = sorted.len() / 2;
        let expected = if sorted.len() % 2 == 1 {
            sorted[middle]
        } else {
            (sorted[middle - 1] + sorted[middle]) / 2.0
        };
        assert!((median - expected).abs() <= 1e-9 * expected, "{result}");
        // Present only when the repetitions differ by more than 2x.
        if let Some(line) = result.get("disagreement") {
            assert!(max > 2.0 * min, "{result}");
            assert!(line.as_str().unwrap().starts_with("tokens_per_second: "));
        }
    }
    report
}

#[test]
fn bench_table_and_json() {
    let Some(model) = default_model() else { return };
    let model = model.to_str().unwrap();
    let out = pagoda(
        &["bench", "-m", model, "-p", "16", "-n", "4", "-r", "2"],
        None,
    );
    out.assert_success();
    let text = out.stdout_text();
    for test in ["pp16", "tg4"] {
        let row = text
            .lines()
            .find(|l| l.starts_with(&format!("| {test} |")))
            .unwrap_or_else(|| panic!("no {test} row:\n{text}"));
        let cells: Vec<&str> = row
            .split('|')
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .collect();
        let median: f64 = cells[1].parse().unwrap();
        assert!(median > 0.0, "{row}");
        assert_eq!(cells[4].split_whitespace().count(), 2, "two runs: {row}");
    }

    let out = pagoda(
        &[
            "bench", "-m", model, "-p", "16", "-n", "4", "-r", "2", "--json",
        ],
        None,
    );
    out.assert_success();
    check_json_report(&out.stdout_text(), &["pp16", "tg4"], 2, 1);

    let out = pagoda(
        &[
            "bench", "-m", model, "-p", "16", "-n", "4", "-r", "1", "-b", "2", "--json",
        ],
        None,
    );
    out.assert_success();
    check_json_report(&out.stdout_text(), &["pp16", "tg4 x2"], 1, 2);
}

#[test]
fn bench_tiny_model_several_prompt_lengths() {
    let dir = tiny_model("tiny-qwen2");
    let out = pagoda(
        &[
            "bench",
            "-m",
            dir.to_str().unwrap(),
            "-p",
            "8,32",
            "-n",
            "0",
            "-r",
            "3",
            "--json",
        ],
        None,
    );
    out.assert_success();
    let report = check_json_report(&out.stdout_text(), &["pp8", "pp32"], 3, 1);
    assert_eq!(report["warmup"], true);
}

#[test]
fn bench_without_warmup_and_even_repetitions() {
    let dir = tiny_model("tiny-qwen2");
    let out = pagoda(
        &[
            "bench",
            "-m",
            dir.to_str().unwrap(),
            "-p",
            "8",
            "-n",
            "4",
            "-r",
            "4",
            "--no-warmup",
            "--json",
        ],
        None,
    );
    out.assert_success();
    let report = check_json_report(&out.stdout_text(), &["pp8", "tg4"], 4, 1);
    assert_eq!(report["warmup"], false);
}

/// A `pagoda serve` of a model on a free port of 127.0.0.1, killed when dropped.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start(model: &Path) -> Server {
        Server::start_with(model, &[])
    }

    /// A server of `model` with more flags.
    fn start_with(model: &Path, flags: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_pagoda"))
            .args(["serve", "-m", model.to_str().unwrap(), "--port", "0"])
            .args(flags)
            .current_dir(repo_root())
            .env_remove("PAGODA_MODEL")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting pagoda serve");
        let stderr = child.stderr.take().expect("stderr pipe");
        let (sender, receiver) = std::sync::mpsc::channel();
        // Reads stderr to its end, so the server never blocks on a full pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.strip_prefix("listening on ") {
                    let url = rest.split_whitespace().next().unwrap_or_default();
                    let _ = sender.send(url.to_owned());
                }
            }
        });
        let mut server = Server {
            child,
            url: String::new(),
        };
        server.url = receiver
            .recv_timeout(Duration::from_secs(60))
            .expect("pagoda serve did not say where it listens within 60 s");
        server
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `serve --random-weights`: random weights of a config.json's shapes, served with the model's
/// tokenizer under the name `random-<folder>` (a wrong name is refused by the server), answer
/// streamed completions of exactly the tokens asked for; with `:FP8` under `random-<folder>:fp8`.
#[test]
fn serve_random_weights_answers_under_its_own_name() {
    let dir = tiny_model("tiny-qwen2");
    let config = dir.join("config.json");
    let server = Server::start_with(&dir, &["--random-weights", config.to_str().unwrap()]);
    let bench = |url: &str, model: &str| {
        let mut args = vec!["bench", "serve", "--url", url, "--model", model];
        args.extend("--scenarios single -n 4 -r 1 --prompt-words 4 --json --no-warmup".split(' '));
        pagoda(&args, None)
    };
    let out = bench(&server.url, "random-tiny-qwen2");
    out.assert_success();
    let stdout = out.stdout_text();
    let report: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("bad JSON ({e}):\n{stdout}"));
    assert_eq!(
        report["results"][0]["repetitions"][0]["completion_tokens"], 4,
        "{report}"
    );
    // The tokenizer's file is not the served model.
    assert_ne!(bench(&server.url, "tiny-qwen2").code, Some(0));
    drop(server);
    // A format suffix in any case the loader takes keeps its canonical name at the end.
    let spec = format!("{}:FP8", config.to_str().unwrap());
    let server = Server::start_with(&dir, &["--random-weights", &spec]);
    bench(&server.url, "random-tiny-qwen2:fp8").assert_success();
    assert_ne!(bench(&server.url, "random-tiny-qwen2").code, Some(0));
}

/// `bench serve --request-rate`: a seeded Poisson workload of ShareGPT-like requests against a
/// real server; every request completes, and the figures are consistent with their
/// definitions (request throughput = completed / duration, percentiles ordered, goodput only
/// with an SLO, and at most the request throughput).
#[test]
fn bench_serve_runs_a_poisson_workload_with_goodput() {
    let server = Server::start(&tiny_model("tiny-qwen2"));
    // The user's prompts (three, used in turn): the tiny model's context is short.
    let dataset = std::env::temp_dir().join(format!("pagoda-prompts-{}.jsonl", std::process::id()));
    let lines = [
        r#"{"prompt": "the river and the stone", "max_tokens": 3}"#,
        r#"{"prompt": "a quiet morning in the city"}"#,
        r#"{"prompt": "winter light", "max_tokens": 5}"#,
    ];
    std::fs::write(
        &dataset,
        lines.join(
            "
",
        ),
    )
    .unwrap();
    let out = pagoda(
        &[
            "bench",
            "serve",
            "--url",
            &server.url,
            "--request-rate",
            "20",
            "--num-prompts",
            "12",
            "--dataset",
            dataset.to_str().unwrap(),
            "-n",
            "4",
            "--max-concurrency",
            "4",
            "--slo-ttft",
            "60000",
            "--slo-tpot",
            "60000",
            "--json",
            "--no-warmup",
        ],
        None,
    );
    let _ = std::fs::remove_file(&dataset);
    out.assert_success();
    let stdout = out.stdout_text();
    let report: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("bad JSON ({e}):\n{stdout}"));
    assert_eq!(
        (&report["completed"], &report["failed"]),
        (&12.into(), &0.into()),
        "{report}"
    );
    assert_eq!(report["request_rate"], 20.0);
    let number = |key: &str| {
        report[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key}: {report}"))
    };
    let throughput = number("request_throughput");
    assert!((throughput - 12.0 / number("duration_s")).abs() < 1e-6 * throughput);
    for metric in ["ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"] {
        let d = &report[metric];
        let (median, p90, p99) = (
            d["median"].as_f64().unwrap(),
            d["p90"].as_f64().unwrap(),
            d["p99"].as_f64().unwrap(),
        );
        assert!(
            0.0 <= median && median <= p90 && p90 <= p99,
            "{metric}: {d}"
        );
    }
    // Generous bounds: every request is good.
    assert!(
        (number("goodput") - throughput).abs() < 1e-9 * throughput,
        "{report}"
    );
    // 4 times each of 3, 4 (--n-gen) and 5 tokens.
    let output = number("output_token_throughput") * number("duration_s");
    assert!((output - 48.0).abs() < 1e-6, "{report}");
}

/// `bench serve --sweep 4,inf --plot`: the workload at each rate, every rate's figures in the
/// JSON with the sustained rate (all at once, under generous SLOs), and the SVG plot; bad
/// sweeps and plot files are refused before any server is contacted.
#[test]
fn bench_serve_sweeps_rates_and_plots_them() {
    let server = Server::start(&tiny_model("tiny-qwen2"));
    let plot = std::env::temp_dir().join(format!("pagoda-sweep-{}.svg", std::process::id()));
    let plot_arg = plot.to_str().unwrap();
    let mut args = vec!["bench", "serve", "--url", &server.url, "--dataset", "fixed"];
    args.extend(["--prompt-words", "4", "-n", "3", "--num-prompts", "4"]);
    args.extend(["--slo-ttft", "60000", "--slo-tpot", "60000", "--no-warmup"]);
    let bad = |extra: &[&str], says: &str| {
        let out = pagoda(&[&args[..], extra].concat(), None);
        let error = out.assert_clean_error();
        assert!(error.contains(says), "{extra:?}: {error}");
    };
    bad(&["--sweep", "4,0"], "above 0");
    bad(&["--sweep", "4,,8"], "empty");
    bad(
        &["--sweep", "4", "--request-rate", "4"],
        "cannot be used with",
    );
    bad(&["--sweep", "4", "--plot", "latency.png"], "only SVG");
    let out = pagoda(
        &[
            &args[..],
            &["--sweep", "4,inf", "--plot", plot_arg, "--json"],
        ]
        .concat(),
        None,
    );
    out.assert_success();
    let stdout = out.stdout_text();
    let report: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("bad JSON ({e}):\n{stdout}"));
    let rates = report["rates"].as_array().expect("rates array");
    assert_eq!(rates.len(), 2, "{report}");
    assert_eq!(rates[0]["request_rate"], 4.0);
    assert!(rates[1]["request_rate"].is_null(), "all at once: {report}");
    for rate in rates {
        assert_eq!(
            (&rate["completed"], &rate["failed"]),
            (&4.into(), &0.into())
        );
        assert_eq!(rate["within_slo"], true, "{rate}");
        assert!(rate["ttft_ms"]["p99"].as_f64().unwrap() > 0.0, "{rate}");
    }
    assert_eq!(report["sustained_rate"], "inf", "{report}");
    let svg = std::fs::read_to_string(&plot).expect("the plot was written");
    let _ = std::fs::remove_file(&plot);
    assert!(
        svg.starts_with("<svg") && svg.contains("<polyline"),
        "{svg}"
    );
    assert!(svg.contains("SLO TTFT"), "{svg}");
}

#[test]
fn bench_serve_reports_every_repetition() {
    let server = Server::start(&tiny_model("tiny-qwen2"));
    let mut args = vec![
        "bench",
        "serve",
        "--url",
        &server.url,
        "--scenarios",
        "single,batch4",
        "--clients",
        "2",
        "-n",
        "4",
        "-r",
        "2",
        "--prompt-words",
        "4",
        "--json",
    ];
    let out = pagoda(&args, None);
    out.assert_success();
    let stdout = out.stdout_text();
    let report: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("bad JSON ({e}):\n{stdout}"));
    assert_eq!(report["warmup"], true);
    assert_eq!(report["repetitions"], 2);
    let results = report["results"].as_array().expect("results array");
    assert_eq!(results.len(), 2);
    for (result, clients) in results.iter().zip([1u64, 2]) {
        assert_eq!(result["clients"], clients, "{result}");
        let repetitions = result["repetitions"].as_array().expect("repetitions array");
        assert_eq!(repetitions.len(), 2, "{result}");
        for repetition in repetitions {
            for metric in [
                "ttft_p50_ms",
                "ttft_p95_ms",
                "itl_p50_ms",
                "itl_p95_ms",
                "throughput_tokens_per_second",
                "wall_ms",
            ] {
                let value = repetition[metric].as_f64().unwrap();
                assert!(value.is_finite() && value >= 0.0, "{metric}: {result}");
            }
            // `ignore_eos`: every client generates exactly -n tokens.
            assert_eq!(repetition["completion_tokens"], 4 * clients, "{result}");
        }
        // The median of two repetitions is their mean.
        let throughput =
            |r: &serde_json::Value| r["throughput_tokens_per_second"].as_f64().unwrap();
        let mean = (throughput(&repetitions[0]) + throughput(&repetitions[1])) / 2.0;
        assert!((throughput(result) - mean).abs() <= 1e-9 * mean, "{result}");
        assert!(result["disagreement"].is_array(), "{result}");
    }

    args.push("--no-warmup");
    let out = pagoda(&args, None);
    out.assert_success();
    let report: serde_json::Value = serde_json::from_str(&out.stdout_text()).unwrap();
    assert_eq!(report["warmup"], false);
}
