//! Bad input: every case must end with one `error: ...` line on stderr saying what is wrong and
//! what to do, and a non-zero exit code; never a panic or a hang.

mod support;

use std::path::PathBuf;

use support::{default_model, pagoda, tiny_model};

/// A fresh scratch directory under the system temp dir.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pagoda-cli-errors-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `pagoda args` (stdin closed) and returns its error line, checking it holds every needle.
fn error_of(args: &[&str], needles: &[&str]) -> String {
    let out = pagoda(args, None);
    let error = out.assert_clean_error();
    for needle in needles {
        assert!(
            error.contains(needle),
            "pagoda {args:?}: error {error:?} should mention {needle:?}"
        );
    }
    error
}

#[test]
fn bad_model_paths() {
    let dir = scratch_dir("paths");
    let missing = dir.join("missing.gguf");
    error_of(
        &["generate", "-m", missing.to_str().unwrap(), "-p", "hi"],
        &["does not exist", "pass a .gguf file"],
    );
    error_of(
        &["inspect", "-m", missing.to_str().unwrap()],
        &["does not exist"],
    );

    // A directory that is not a model.
    let not_a_model = dir.join("not-a-model");
    std::fs::create_dir_all(&not_a_model).unwrap();
    std::fs::write(not_a_model.join("notes.txt"), "hello").unwrap();
    error_of(
        &["generate", "-m", not_a_model.to_str().unwrap(), "-p", "hi"],
        &["not a Hugging Face model directory", "config.json"],
    );

    // Garbage, empty and truncated GGUF files.
    let garbage = dir.join("garbage.gguf");
    std::fs::write(&garbage, b"this is not a model file at all\n").unwrap();
    error_of(
        &["generate", "-m", garbage.to_str().unwrap(), "-p", "hi"],
        &["not a GGUF file"],
    );
    error_of(
        &["inspect", "-m", garbage.to_str().unwrap()],
        &["not a GGUF file"],
    );
    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    error_of(
        &["generate", "-m", empty.to_str().unwrap(), "-p", "hi"],
        &["too short"],
    );
    let tiny_gguf = std::fs::read(tiny_model("tiny-llama-f32.gguf")).unwrap();
    for keep in [6, 100, tiny_gguf.len() / 2, tiny_gguf.len() - 1] {
        let truncated = dir.join(format!("truncated-{keep}.gguf"));
        std::fs::write(&truncated, &tiny_gguf[..keep]).unwrap();
        let error = error_of(
            &["generate", "-m", truncated.to_str().unwrap(), "-p", "hi"],
            &[],
        );
        assert!(
            error.contains("truncated") || error.contains("too short"),
            "{keep} bytes: {error}"
        );
        error_of(&["inspect", "-m", truncated.to_str().unwrap()], &[]);
    }

    // A file from inside a Hugging Face directory: point at the directory instead.
    let hf = tiny_model("tiny-llama");
    error_of(
        &[
            "generate",
            "-m",
            hf.join("model.safetensors").to_str().unwrap(),
            "-p",
            "hi",
        ],
        &["pass the directory"],
    );
    // An HF directory without a tokenizer.
    error_of(
        &[
            "generate",
            "-m",
            tiny_model("tiny-llama-sharded").to_str().unwrap(),
            "-p",
            "hi",
        ],
        &["tokenizer.json"],
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_generation_flags() {
    let model = tiny_model("tiny-qwen2");
    let m = model.to_str().unwrap();
    let cases: &[(&[&str], &[&str])] = &[
        (&["-n", "0"], &["-n 0", "at least 1", "or -1"]),
        (&["--temp", "-1"], &["temperature", "-1"]),
        (&["--temp", "nan"], &["temperature"]),
        (&["--top-p", "0"], &["top_p", "(0, 1]"]),
        (&["--top-p", "2"], &["top_p", "(0, 1]"]),
        (&["--min-p", "1.5"], &["min_p"]),
        (&["--repeat-penalty", "0"], &["repetition_penalty"]),
        (&["-c", "0"], &["--ctx-size must be at least 1"]),
        (
            &["-c", "100000"],
            &["exceeds the model's context length 128", "-c 128"],
        ),
        (
            &["--page-size", "0"],
            &["--page-size must be between 1 and 1024"],
        ),
        (&["--threads", "0"], &["--threads must be at least 1"]),
        (
            &["--attention", "bogus"],
            &["bogus", "auto, split-kv, gather"],
        ),
        (&["-n", "-3"], &["-n -3", "or -1"]),
        (&["-s", "-2"], &["-2", "-1 (random)"]),
        (&["--bogus-flag"], &["--bogus-flag"]),
        (&["-j", "{bad"], &["--json-schema", "not a JSON schema"]),
        (
            &["-j", r#"{"type": "object", "not": {}}"#],
            &["--json-schema", "unsupported", "not"],
        ),
        (
            &["--grammar", "root ::= missing"],
            &["--grammar", "undefined rule `missing`"],
        ),
        (
            &["-j", "{}", "--grammar", "root ::= \"a\""],
            &["--grammar", "cannot be used with"],
        ),
    ];
    for (flags, needles) in cases {
        let mut args = vec!["generate", "-m", m, "-p", "hi"];
        args.extend_from_slice(flags);
        error_of(&args, needles);
    }
}

#[test]
fn bad_prompts() {
    let model = tiny_model("tiny-qwen2");
    let m = model.to_str().unwrap();
    // Empty prompt: on the command line, on stdin, or only a newline on stdin.
    error_of(
        &["generate", "-m", m, "-p", ""],
        &["prompt is empty", "-p PROMPT"],
    );
    for stdin in ["", "\n"] {
        let out = pagoda(&["generate", "-m", m], Some(stdin));
        let error = out.assert_clean_error();
        assert!(
            error.contains("empty") && error.contains("-p PROMPT"),
            "{stdin:?}: {error}"
        );
    }
    // A prompt that does not fit the context (byte-level tokenizer: 1 token per byte).
    let long_prompt = "a long prompt that cannot fit in eight tokens";
    error_of(
        &["generate", "-m", m, "-c", "8", "-p", long_prompt],
        &[
            "45 tokens",
            "context of 8",
            "shorten the prompt",
            "raise -c",
        ],
    );
    // A prompt that fits only without the explicit -n.
    error_of(
        &["generate", "-m", m, "-c", "8", "-n", "20", "-p", "hi"],
        &["-n 20", "lower -n to 6"],
    );
    let out = pagoda(
        &["generate", "-m", m, "-c", "8", "--ignore-eos", "-p", "hi"],
        None,
    );
    out.assert_success();
    assert_eq!(
        support::throughput_line(&out.stderr).2,
        5,
        "without -n: the 6 tokens the context leaves"
    );
}

#[test]
fn bad_prompt_on_default_model() {
    let Some(model) = default_model() else { return };
    let long_prompt =
        "The capital of France is Paris, and the capital of Germany is Berlin. ".repeat(3);
    error_of(
        &[
            "generate",
            "-m",
            model.to_str().unwrap(),
            "-c",
            "8",
            "-p",
            &long_prompt,
        ],
        &["context of 8", "shorten the prompt"],
    );
    error_of(
        &[
            "generate",
            "-m",
            model.to_str().unwrap(),
            "-c",
            "9000",
            "-p",
            "hi",
        ],
        &["8192"],
    );
}

#[test]
fn llama_cpp_minus_one_means_random_seed_and_fill_the_context() {
    let model = tiny_model("tiny-qwen2");
    let m = model.to_str().unwrap();
    let args = [
        "generate",
        "-m",
        m,
        "-p",
        "hi",
        "-c",
        "12",
        "-n",
        "-1",
        "-s",
        "-1",
        "--ignore-eos",
    ];
    let out = pagoda(&args, None);
    out.assert_success();
    // "prompt: P tokens, ... | decode: D tokens, ...": the first token comes with the
    // prompt's step, so P + 1 + D fills the 12-token context.
    let count = |label: &str| -> usize {
        let at = out.stderr.find(label).expect(label) + label.len();
        let digits: String = out.stderr[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().unwrap()
    };
    assert_eq!(
        count("prompt: ") + 1 + count("decode: "),
        12,
        "{}",
        out.stderr
    );
}

#[test]
fn bad_chat_inspect_and_bench_flags() {
    let model = tiny_model("tiny-qwen2");
    let m = model.to_str().unwrap();
    let out = pagoda(&["chat", "-m", m, "-n", "0"], Some("hi\n"));
    assert!(out.assert_clean_error().contains("at least 1"));
    let out = pagoda(&["chat", "-m", m, "--top-p", "2"], Some("hi\n"));
    assert!(out.assert_clean_error().contains("top_p"));
    error_of(
        &["inspect", "-m", m, "-c", "0"],
        &["--ctx-size must be at least 1"],
    );
    error_of(&["bench", "-m", m, "-r", "0"], &["--repetitions"]);
    error_of(&["bench", "-m", m, "-b", "0"], &["--batch"]);
    error_of(
        &["bench", "-m", m, "-p", "0", "-n", "0"],
        &["nothing to measure"],
    );
    // tiny-qwen2's context is 128 tokens.
    error_of(
        &["bench", "-m", m, "-p", "200", "-n", "4"],
        &["needs a context of 205", "128", "lower -p, -d or -n"],
    );
    error_of(
        &["bench", "-m", m, "-p", "16", "-n", "4", "-c", "8"],
        &["too small", "21"],
    );
    error_of(&["bench", "-m", m, "-p", "abc"], &["abc"]);
}

#[test]
fn bad_tune_and_attention_bench_flags() {
    // Checked before any GPU is touched: the same lines with or without one.
    error_of(&["tune", "-b", "3"], &["powers of two", "3"]);
    error_of(&["tune", "-l", "128"], &["start at 256"]);
    error_of(&["tune", "--rounds", "0"], &["--rounds"]);
    error_of(&["tune", "--page-size", "12"], &["--page-size", "12"]);
    error_of(
        &["tune", "--random-weights", "no-such-architecture"],
        &["no-such-architecture"],
    );
    error_of(
        &["bench", "attention", "--paths", "stream-64x9"],
        &["unknown path `stream-64x9`", "stream-64x3"],
    );
    error_of(
        &["bench", "attention", "--paths", "prefill-mma"],
        &["prefill path", "--prefill"],
    );
    error_of(
        &["bench", "attention", "--prefill", "--paths", "stream-64x3"],
        &["prefill-mma or prefill-tiled", "stream-64x3"],
    );
}

#[test]
fn moe_bench_needs_a_gpu_and_good_flags() {
    // Without a visible GPU (none here, or hidden by CUDA_VISIBLE_DEVICES on a GPU machine),
    // or without the cuda feature: one line that says so.
    let hidden = [("CUDA_VISIBLE_DEVICES", "")];
    let out = support::pagoda_with_env(
        &support::repo_root(),
        &["bench", "moe", "-b", "1"],
        None,
        &hidden,
    );
    let error = out.assert_clean_error();
    assert!(error.contains("needs a CUDA GPU"), "{error}");
    // Checked before any GPU is touched.
    error_of(&["bench", "moe", "-b", "0"], &["--batch"]);
    error_of(&["bench", "moe", "-n", "0"], &["--replays"]);
    error_of(
        &["bench", "moe", "--experts", "4", "--top-k", "8"],
        &["--top-k", "top-8 of 4"],
    );
    error_of(&["bench", "moe", "--experts", "1024"], &["1024"]);
    error_of(&["bench", "moe", "--dtype", "q8"], &["bf16 or f32", "q8"]);
    error_of(&["bench", "moe", "--hidden", "100"], &["--hidden", "8"]);
    error_of(
        &["bench", "moe", "--shape", "llama-3.1-8b"],
        &["llama-3.1-8b", "qwen3-30b-a3b"],
    );
    error_of(&["bench", "moe", "--copy-tb-s", "0"], &["--copy-tb-s"]);
}

#[test]
fn bad_serve_security_flags() {
    let model = tiny_model("tiny-qwen2");
    let m = model.to_str().unwrap();
    let dir = scratch_dir("serve-security");
    error_of(
        &["serve", "-m", m, "--api-key", ""],
        &["--api-key is empty"],
    );
    error_of(
        &["serve", "-m", m, "--api-key", "  "],
        &["--api-key is empty"],
    );
    let missing = dir.join("keys.txt");
    error_of(
        &[
            "serve",
            "-m",
            m,
            "--api-key-file",
            missing.to_str().unwrap(),
        ],
        &["--api-key-file", "keys.txt"],
    );
    let comments_only = dir.join("comments.txt");
    std::fs::write(&comments_only, "# no keys yet\n\n").unwrap();
    error_of(
        &[
            "serve",
            "-m",
            m,
            "--api-key-file",
            comments_only.to_str().unwrap(),
        ],
        &["holds no key"],
    );
    let cert = dir.join("cert.pem");
    std::fs::write(&cert, "not a certificate").unwrap();
    // Either file alone is a usage error naming the other.
    let out = pagoda(
        &["serve", "-m", m, "--ssl-cert-file", cert.to_str().unwrap()],
        None,
    );
    assert_ne!(out.code, Some(0));
    assert!(out.stderr.contains("--ssl-key-file"), "{}", out.stderr);
    error_of(
        &[
            "serve",
            "-m",
            m,
            "--ssl-cert-file",
            cert.to_str().unwrap(),
            "--ssl-key-file",
            cert.to_str().unwrap(),
        ],
        &["--ssl-cert-file", "holds no certificate"],
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_speculation_flags() {
    let tiny = tiny_model("tiny-llama-f32.gguf");
    let m = tiny.to_str().unwrap();
    error_of(
        &["generate", "-m", m, "-p", "hi", "--spec", "draft"],
        &["--spec draft needs a draft model", "--model-draft"],
    );
    error_of(
        &["generate", "-m", m, "-p", "hi", "-md", m, "--spec", "ngram"],
        &["--model-draft", "speculation is ngram", "--spec draft"],
    );
    error_of(
        &["generate", "-m", m, "-p", "hi", "--spec-rule", "sideways"],
        &["--spec-rule `sideways` is not one of invariant, leviathan"],
    );
    error_of(
        &["generate", "-m", m, "-p", "hi", "--draft-p-min", "2"],
        &["--draft-p-min `2`", "a number from 0 to 1"],
    );
    // A draft model of another vocabulary is refused at load, naming the difference.
    if let Some(default) = default_model() {
        error_of(
            &[
                "generate",
                "-m",
                m,
                "-p",
                "hi",
                "-md",
                default.to_str().unwrap(),
            ],
            &[
                "--model-draft",
                "has 49152 tokens and the model's 256",
                "same family",
            ],
        );
    }
}

#[test]
fn bad_settings_and_llama_short_flags() {
    let model = tiny_model("tiny-qwen2");
    let m = model.to_str().unwrap();
    let root = support::repo_root();
    // A bad setting stops every command at start, naming the allowed values.
    for args in [&["generate", "-m", m, "-p", "hi"][..], &["config"]] {
        let out = support::pagoda_with_env(&root, args, None, &[("PAGODA_CPU_SILU", "fast")]);
        let error = out.assert_clean_error();
        assert!(
            error.contains("PAGODA_CPU_SILU=`fast` is not one of auto, polynomial, libm"),
            "{error}"
        );
    }
    error_of(
        &["generate", "-m", m, "-p", "hi", "--attention", "sideways"],
        &["--attention `sideways` is not one of auto, split-kv, gather"],
    );
    // llama.cpp's short flags: -np works, the ones pagoda lacks say why.
    error_of(
        &["serve", "-m", m, "-np", "0"],
        &["--parallel must be at least 1"],
    );
    error_of(
        &["serve", "-m", m, "-ctk", "q4_0"],
        &["--cache-type-k `q4_0` is not one of f32, f16, q8_0, fp8"],
    );
    error_of(
        &["generate", "-m", m, "-p", "hi", "-ctv", "bf16"],
        &["--cache-type-v `bf16` is not one of f32, f16, q8_0, fp8"],
    );
    error_of(
        &["serve", "-m", m, "--kv-cache-dtype", "fp8_e5m2"],
        &["--kv-cache-dtype `fp8_e5m2` is not one of auto, fp8, fp8_e4m3"],
    );
    // fp8 is the CUDA cache: the CPU refuses it in one line naming the flags and the device,
    // spelled either way.
    for flags in [
        &["-ctk", "fp8", "-ctv", "fp8"][..],
        &["--kv-cache-dtype", "fp8"],
    ] {
        let mut args = vec!["generate", "-m", m, "-p", "hi", "--device", "cpu"];
        args.extend_from_slice(flags);
        let line = error_of(
            &args,
            &["-ctk/-ctv (K fp8, V fp8)", "CUDA only", "--device cuda"],
        );
        assert_eq!(line.trim().lines().count(), 1, "{line}");
    }
    // q8_0 blocks run along head_dim: tiny-llama's 16 is refused in one line.
    let tiny = tiny_model("tiny-llama-f32.gguf");
    let line = error_of(
        &[
            "generate",
            "-m",
            tiny.to_str().unwrap(),
            "-p",
            "hi",
            "-ctk",
            "q8_0",
        ],
        &[
            "-ctk/-ctv (K q8_0, V f32)",
            "head_dim that 32 divides",
            "is 16",
        ],
    );
    assert_eq!(line.trim().lines().count(), 1, "{line}");
    let out = pagoda(&["serve", "-m", m, "-n", "8"], None);
    assert_ne!(out.code, Some(0));
    assert!(out.stderr.contains("'-n'"), "{}", out.stderr);
    // A KV reservation the memory cannot hold is refused with the numbers, before the pool
    // is allocated (ten million contexts of tiny-qwen2 take 305 GiB).
    error_of(
        &["serve", "-m", m, "-np", "10000000"],
        &["needs 305.2 GiB", "are free on the cpu", "lower -np or -c"],
    );
    error_of(
        &["serve", "-m", m, "--kv-pages", "100000000000"],
        &["--kv-pages 100000000000 needs", "GiB"],
    );
    // More threads than cores: it runs, with a warning saying why it is slow.
    let over = (std::thread::available_parallelism().map_or(1, |n| n.get()) + 1).to_string();
    let out = pagoda(
        &["generate", "-m", m, "-p", "hi", "-n", "2", "-t", &over],
        None,
    );
    out.assert_success();
    let expected = format!("warning: --threads {over} is more than");
    assert!(out.stderr.contains(&expected), "{}", out.stderr);
}

#[test]
fn config_shows_values_and_their_sources_and_hides_keys() {
    let root = support::repo_root();
    let out = support::pagoda_with_env(
        &root,
        &["config"],
        None,
        &[
            ("PAGODA_SAMPLER", " Reference "),
            ("PAGODA_API_KEY", "sesame-key"),
            ("PAGODA_CPU_KERNEL", "vnni8"),
        ],
    );
    out.assert_success();
    let stdout = out.stdout_text();
    assert!(
        stdout.contains("PAGODA_SAMPLER") && stdout.contains("reference  (environment)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("PAGODA_API_KEY") && stdout.contains("(set)"),
        "{stdout}"
    );
    assert!(
        !stdout.contains("sesame") && !out.stderr.contains("sesame"),
        "{stdout}"
    );
    assert!(
        out.stderr.contains("did you mean PAGODA_CPU_KERNELS?"),
        "{}",
        out.stderr
    );
    let all = pagoda(&["config", "--all"], None);
    assert!(all
        .assert_success()
        .stdout_text()
        .contains("PAGODA_CPU_PREFETCH"));
    let markdown = pagoda(&["config", "--markdown"], None);
    assert!(markdown
        .assert_success()
        .stdout_text()
        .starts_with("# Configuration"));
}
