//! End-to-end tests of `pagoda generate`: greedy output against llama.cpp's recorded reference
//! continuation, all modes and prompt sources, seeded sampling, tiny models.

mod support;

use support::{default_model, pagoda, pagoda_in, throughput_line, tiny_model};

const PROMPT: &str = "The capital of France is";

/// llama.cpp's greedy continuation of [`PROMPT`] on the default model's weights dequantized to
/// f32 (f32 KV, exact math): ids [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40,
/// 29, 32, 33, 29, 34, 34, 216, 33, 34, 42, 33, 34, 42, 37, 35, 30] then end-of-text (id 2).
/// Recorded in the project's llama.cpp reference `greedy_llamacpp_f32dequant.json` (prompt
/// `plain_en`).
const GREEDY_FULL: &str = " Paris.\n\nThe answer is: 2018-01-22 12:12:53.";

/// The text of the first 12 of those ids.
const GREEDY_12: &str = " Paris.\n\nThe answer is: 201";

/// The chat question of the reference (`chat` prompt, default system message from the template).
const CHAT_QUESTION: &str = "What is the capital of France? Answer in one sentence.";

/// Both llama.cpp references (Q4_1 and f32-dequantized) answer [`CHAT_QUESTION`] greedily with
/// ids [504, 3575, 282, 4649, 314, 7042, 30] then `<|im_end|>` (id 2).
const CHAT_ANSWER: &str = "The capital of France is Paris.";

fn greedy_12(extra: &[&str]) -> Option<()> {
    let model = default_model()?;
    let model = model.to_str().unwrap();
    let mut args = vec![
        "generate", "-m", model, "--temp", "0", "-n", "12", "-p", PROMPT,
    ];
    args.extend_from_slice(extra);
    let out = pagoda(&args, None);
    out.assert_success();
    assert_eq!(out.stdout_text(), GREEDY_12, "mode {extra:?}");
    let (prompt_tokens, prompt_rate, decode_tokens, decode_rate) = throughput_line(&out.stderr);
    assert_eq!(prompt_tokens, 5, "the reference prompt is 5 tokens");
    assert_eq!(
        decode_tokens, 11,
        "12 generated = 1 from prefill + 11 decoded"
    );
    assert!(prompt_rate > 0.0 && decode_rate > 0.0, "{}", out.stderr);
    Some(())
}

#[test]
fn greedy_default_mode_matches_reference() {
    greedy_12(&[]);
}

/// Tensor parallelism on the CPU: the default model's 9 heads and 3 KV heads over three ranks
/// (threads of the process, `-tp 3`) give the reference's greedy text, in exact mode (with
/// one thread per rank's pool too) and as stored.
#[test]
fn greedy_tensor_parallel_matches_reference() {
    greedy_12(&["--device", "cpu", "-tp", "3", "--exact"]);
    greedy_12(&["--device", "cpu", "-tp", "3", "--exact", "-t", "1"]);
    greedy_12(&["--device", "cpu", "--tensor-parallel-size", "3"]);
    // A model whose heads do not split over the ranks is refused in one line with the
    // numbers, and so is a size of 0.
    let tiny = tiny_model("tiny-qwen2");
    let m = tiny.to_str().unwrap();
    for (size, needle) in [
        ("5", "tensor parallelism over 5 ranks needs"),
        ("0", "--tensor-parallel-size `0` is not"),
    ] {
        let args = [
            "generate", "-m", m, "-p", "hi", "--device", "cpu", "-tp", size,
        ];
        let error = pagoda(&args, None).assert_clean_error();
        assert!(error.contains(needle), "{error}");
        assert_eq!(error.trim().lines().count(), 1, "{error}");
    }
}

#[test]
fn greedy_gather_attention_matches_reference() {
    greedy_12(&["--attention", "gather"]);
}

#[test]
fn greedy_output_independent_of_page_size_and_threads() {
    // One-token pages (every position its own page), 7-token pages (pages split mid-sequence),
    // one page larger than the context, and a single thread must all give the same tokens.
    greedy_12(&["--page-size", "1", "-t", "1"]);
    greedy_12(&["--page-size", "7", "--attention", "gather"]);
    greedy_12(&["--page-size", "1024", "-c", "64"]);
}

#[test]
fn greedy_exact_mode_matches_full_reference_and_stops_at_eos() {
    let Some(model) = default_model() else { return };
    let out = pagoda(
        &[
            "generate",
            "-m",
            model.to_str().unwrap(),
            "--exact",
            "--temp",
            "0",
            "-n",
            "64",
            "-p",
            PROMPT,
        ],
        None,
    );
    out.assert_success();
    assert_eq!(out.stdout_text(), GREEDY_FULL);
    // 29 text tokens + end-of-text: the first comes from prefill, 29 from decode steps.
    let (_, _, decode_tokens, _) = throughput_line(&out.stderr);
    assert_eq!(
        decode_tokens, 29,
        "should stop at end-of-text, not run to -n 64"
    );
}

#[test]
fn default_model_is_used_without_m() {
    if default_model().is_none() {
        return;
    }
    // From the repository root, `models/<default>` is found without -m.
    let out = pagoda(&["generate", "--temp", "0", "-n", "12", "-p", PROMPT], None);
    out.assert_success();
    assert_eq!(out.stdout_text(), GREEDY_12);
    // From elsewhere, it is found next to the binary (target/<profile>/../../models), when the
    // build directory is the repository's own.
    let binary = std::fs::canonicalize(env!("CARGO_BIN_EXE_pagoda")).unwrap();
    if !binary.starts_with(std::fs::canonicalize(support::repo_root()).unwrap()) {
        eprintln!("skipping the run from another directory: the binary is outside the repository");
        return;
    }
    let elsewhere = std::env::temp_dir();
    let out = pagoda_in(
        &elsewhere,
        &["generate", "--temp", "0", "-n", "2", "-p", PROMPT],
        None,
    );
    out.assert_success();
    assert_eq!(out.stdout_text(), " Paris.");
}

#[test]
fn prompt_from_stdin() {
    let Some(model) = default_model() else { return };
    let model = model.to_str().unwrap();
    let out = pagoda(
        &["generate", "-m", model, "--temp", "0", "-n", "12"],
        Some(PROMPT),
    );
    out.assert_success();
    assert_eq!(out.stdout_text(), GREEDY_12);
    // `echo PROMPT | pagoda generate`: the trailing newline is not part of the prompt.
    let out = pagoda(
        &["generate", "-m", model, "--temp", "0", "-n", "12"],
        Some(&format!("{PROMPT}\n")),
    );
    out.assert_success();
    assert_eq!(out.stdout_text(), GREEDY_12);
    assert_eq!(throughput_line(&out.stderr).0, 5);
}

#[test]
fn chat_flag_answers_and_stops_at_end_of_turn() {
    let Some(model) = default_model() else { return };
    let out = pagoda(
        &[
            "generate",
            "-m",
            model.to_str().unwrap(),
            "--chat",
            "--temp",
            "0",
            "-n",
            "64",
            "-p",
            CHAT_QUESTION,
        ],
        None,
    );
    out.assert_success();
    let text = out.stdout_text();
    assert!(text.contains("Paris"), "{text:?}");
    assert!(
        !text.contains("<|im_end|>") && !text.contains("<|im_start|>"),
        "special tokens printed: {text:?}"
    );
    assert_eq!(text, CHAT_ANSWER);
    let (prompt_tokens, _, decode_tokens, _) = throughput_line(&out.stderr);
    // The reference chat prompt is 42 tokens (default system message + question).
    assert_eq!(prompt_tokens, 42);
    assert_eq!(decode_tokens, 7, "7 text tokens + <|im_end|>, then stop");
}

#[test]
fn seeded_sampling_is_reproducible() {
    let Some(model) = default_model() else { return };
    let model = model.to_str().unwrap();
    let sample = |seed: &str| {
        let out = pagoda(
            &[
                "generate",
                "-m",
                model,
                "--temp",
                "1",
                "-s",
                seed,
                "-n",
                "16",
                "-p",
                "Once upon a time",
            ],
            None,
        );
        out.assert_success();
        out.stdout
    };
    let first = sample("42");
    assert!(!first.is_empty());
    assert_eq!(first, sample("42"), "the same seed must give the same text");
    // 16 tokens at temperature 1 with top-k 40: two seeds agreeing on all of them is very unlikely;
    // three more seeds make a false failure practically impossible.
    let others: Vec<Vec<u8>> = ["7", "1234", "99"].iter().map(|s| sample(s)).collect();
    assert!(
        others.iter().any(|o| *o != first),
        "four seeds gave the same text: {:?}",
        String::from_utf8_lossy(&first)
    );
}

#[test]
fn hf_directory_model_runs() {
    let dir = tiny_model("tiny-llama");
    let out = pagoda(
        &[
            "generate",
            "-m",
            dir.to_str().unwrap(),
            "-n",
            "8",
            "-s",
            "1",
            "-p",
            "hello",
        ],
        None,
    );
    out.assert_success();
    assert!(!out.stdout.is_empty());
    throughput_line(&out.stderr);
}

#[test]
fn tiny_qwen2_greedy_token_matches_numpy_oracle() {
    // The fixture's float64 numpy forward gives the logits at every position of "Hello, "; the
    // greedy next token is their argmax at the last position, and the byte-level vocabulary
    // (token id == byte) makes that token's text a single byte.
    let dir = tiny_model("tiny-qwen2");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let tokens: Vec<u8> = expected["tokens"][0]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u8)
        .collect();
    let prompt = String::from_utf8(tokens).unwrap();
    assert_eq!(prompt, "Hello, ");
    let last = expected["logits"][0]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .as_array()
        .unwrap();
    let logits: Vec<f64> = last.iter().map(|v| v.as_f64().unwrap()).collect();
    let argmax = (0..logits.len())
        .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
        .unwrap();
    assert!(
        argmax < 128 && (argmax as u8).is_ascii_graphic(),
        "the oracle token {argmax} should be printable ASCII"
    );
    for extra in [&[][..], &["--exact"][..]] {
        let mut args = vec![
            "generate",
            "-m",
            dir.to_str().unwrap(),
            "--temp",
            "0",
            "-n",
            "1",
            "-p",
            &prompt,
        ];
        args.extend_from_slice(extra);
        let out = pagoda(&args, None);
        out.assert_success();
        assert_eq!(out.stdout, vec![argmax as u8], "{extra:?}");
    }
}

#[test]
fn tiny_gguf_and_qwen3_chat_run() {
    let gguf = tiny_model("tiny-llama-f32.gguf");
    pagoda(
        &[
            "generate",
            "-m",
            gguf.to_str().unwrap(),
            "-n",
            "4",
            "--temp",
            "0",
            "-p",
            "hi",
        ],
        None,
    )
    .assert_success();
    let qwen3 = tiny_model("tiny-qwen3");
    let out = pagoda(
        &[
            "generate",
            "-m",
            qwen3.to_str().unwrap(),
            "--chat",
            "--system",
            "be brief",
            "-n",
            "4",
            "-p",
            "hi",
        ],
        None,
    );
    out.assert_success();
    // The tiny template is `role: content\n` ... `assistant: `.
    assert_eq!(
        throughput_line(&out.stderr).0,
        "system: be brief\nuser: hi\nassistant: ".len()
    );
    // --system implies --chat.
    let out = pagoda(
        &[
            "generate",
            "-m",
            qwen3.to_str().unwrap(),
            "--system",
            "be brief",
            "-n",
            "4",
            "-p",
            "hi",
        ],
        None,
    );
    out.assert_success();
    assert_eq!(
        throughput_line(&out.stderr).0,
        "system: be brief\nuser: hi\nassistant: ".len()
    );
}

#[test]
fn verbose_logs_are_plain_text_when_piped() {
    let gguf = tiny_model("tiny-llama-f32.gguf");
    let out = pagoda(
        &[
            "generate",
            "-v",
            "-m",
            gguf.to_str().unwrap(),
            "-n",
            "2",
            "-s",
            "3",
            "-p",
            "hi",
        ],
        None,
    );
    out.assert_success();
    assert!(out.stderr.contains("sampling seed: 3"), "{}", out.stderr);
    assert!(
        !out.stderr.contains('\u{1b}'),
        "ANSI escapes in piped logs: {:?}",
        out.stderr
    );
}

#[test]
fn closed_stdout_stops_quietly() {
    // `pagoda generate ... | head -c 1`: the reader goes away; no `error: Broken pipe`.
    use std::io::Read;
    use std::process::{Command, Stdio};
    let gguf = tiny_model("tiny-llama-f32.gguf");
    let mut child = Command::new(env!("CARGO_BIN_EXE_pagoda"))
        .args([
            "generate",
            "-m",
            gguf.to_str().unwrap(),
            "--ignore-eos",
            "-n",
            "200",
            "-p",
            "hi",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(
        !stderr.contains("error") && !stderr.contains("panicked"),
        "{stderr}"
    );
    assert_eq!(status.code(), Some(0), "{stderr}");
}

#[test]
fn quantized_kv_caches_keep_the_greedy_reference() {
    // -ctk/-ctv (llama.cpp's short flags): f16 and q8_0 pools give the same 12 greedy tokens
    // on the reference prompt (the engine test `kv_cache_types` bounds the log-probabilities).
    greedy_12(&["-ctk", "q8_0", "-ctv", "q8_0"]);
    greedy_12(&["--cache-type-k", "f16", "--cache-type-v", "f16"]);
}

#[test]
fn kv_cache_types_are_logged_once() {
    let Some(model) = default_model() else { return };
    let args = [
        "generate",
        "-v",
        "-m",
        model.to_str().unwrap(),
        "-ctk",
        "f16",
        "-ctv",
        "q8_0",
        "-n",
        "2",
        "-p",
        "hi",
    ];
    let out = pagoda(&args, None);
    out.assert_success();
    assert_eq!(
        out.stderr.matches("KV cache: K f16, V q8_0").count(),
        1,
        "{}",
        out.stderr
    );
}

#[test]
fn json_schema_and_grammar_constrain_the_output() {
    let Some(model) = default_model() else { return };
    let model = model.to_str().unwrap();
    let schema = r#"{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": false}"#;
    for seed in ["1", "2", "3"] {
        let args = [
            "generate",
            "-m",
            model,
            "--chat",
            "-p",
            "A person, please.",
            "-n",
            "120",
            "--temp",
            "1",
            "-s",
            seed,
            "-j",
            schema,
        ];
        let out = pagoda(&args, None);
        out.assert_success();
        let value: serde_json::Value = serde_json::from_str(out.stdout_text().trim())
            .unwrap_or_else(|e| panic!("seed {seed}: {e}: {:?}", out.stdout_text()));
        let object = value.as_object().expect("an object");
        assert!(object["name"]
            .as_str()
            .is_some_and(|n| n.chars().count() <= 12));
        assert!(object["age"].as_u64().is_some_and(|a| a <= 120), "{value}");
        assert_eq!(object.len(), 2, "{value}");
    }
    let out = pagoda(
        &[
            "generate",
            "-m",
            model,
            "-p",
            "Pick:",
            "-n",
            "10",
            "--grammar",
            r#"root ::= "cat" | "dog""#,
        ],
        None,
    );
    out.assert_success();
    assert!(
        ["cat", "dog"].contains(&out.stdout_text().as_str()),
        "{:?}",
        out.stdout_text()
    );
}

#[test]
fn sparse_attention_where_it_cannot_run_is_refused_at_start() {
    let model = tiny_model("tiny-qwen2");
    let m = model.to_str().unwrap();
    // Tensor parallelism: refused from the flags, before the model loads, by every command.
    for command in [
        &["generate", "-m", m, "-p", "hi", "-n", "2"][..],
        &["serve", "-m", m, "--port", "0"],
        &["bench", "-m", m, "-p", "8", "-n", "2", "-r", "1"],
    ] {
        let mut args = command.to_vec();
        args.extend([
            "--device",
            "cpu",
            "-tp",
            "2",
            "--sparse-attention",
            "budget=64",
        ]);
        let error = pagoda(&args, None).assert_clean_error();
        assert!(
            error.contains("--sparse-attention") && error.contains("use -tp 1"),
            "{args:?}: {error}"
        );
        assert_eq!(error.trim().lines().count(), 1, "{error}");
    }
    // Latent attention (DeepSeek's MLA): refused by the engine, which sees the model.
    let args = [
        "bench",
        "--random-weights",
        "deepseek-v2-tiny",
        "--device",
        "cpu",
        "-p",
        "8",
        "-n",
        "2",
        "-r",
        "1",
        "--sparse-attention",
        "on",
    ];
    let error = pagoda(&args, None).assert_clean_error();
    assert!(
        error.contains("--sparse-attention") && error.contains("latent-attention"),
        "{error}"
    );
    // The same model runs dense, and a grouped-query model runs sparse.
    let mut dense = args.to_vec();
    dense.truncate(args.len() - 2);
    pagoda(&dense, None).assert_success();
    let out = pagoda(
        &[
            "generate", "-m", m, "-p", "hi", "-n", "2", "--device", "cpu",
        ]
        .into_iter()
        .chain(["--sparse-attention", "budget=64"])
        .collect::<Vec<_>>(),
        None,
    );
    out.assert_success();
}
