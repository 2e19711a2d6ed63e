//! Mixture-of-experts models through the binary: `generate` on the tiny Qwen3-MoE GGUF
//! (stacked experts) and the tiny Mixtral HF directory, `bench` on random weights of the tiny
//! presets, DeepSeek's included. Their numbers are checked against the numpy oracle in the
//! engine's `tiny_models.rs`; here they must run end to end, and a DeepSeek model's greedy
//! text must not depend on the file format it came in.

mod support;

use support::{pagoda, throughput_line, tiny_model};

#[test]
fn generate_runs_moe_models_from_gguf_and_hf_directories() {
    let gguf = tiny_model("tiny-qwen3-moe-gguf/model.gguf");
    let mixtral = tiny_model("tiny-mixtral");
    for model in [gguf, mixtral] {
        for extra in [&[][..], &["--exact"][..]] {
            let mut args = vec![
                "generate",
                "-m",
                model.to_str().unwrap(),
                "--device",
                "cpu",
                "-n",
                "6",
                "--temp",
                "0",
                "-p",
                "Hello",
            ];
            args.extend_from_slice(extra);
            let out = pagoda(&args, None);
            out.assert_success();
            let (_, _, decoded, _) = throughput_line(&out.stderr);
            assert!(decoded > 0, "{}: {}", model.display(), out.stderr);
        }
    }
}

#[test]
fn bench_runs_random_moe_presets() {
    for preset in [
        "qwen3-moe-tiny",
        "mixtral-tiny",
        "deepseek-v2-tiny",
        "deepseek-v3-tiny",
        "deepseek-v32-tiny",
    ] {
        let out = pagoda(
            &[
                "bench",
                "--random-weights",
                preset,
                "--device",
                "cpu",
                "-p",
                "16",
                "-n",
                "4",
                "-b",
                "1,2",
                "-r",
                "1",
            ],
            None,
        );
        out.assert_success();
        let table = out.stdout_text();
        for test in ["| pp16 |", "| tg4 |", "| tg4 x2 |"] {
            assert!(table.contains(test), "{preset}: no {test} row in\n{table}");
        }
    }
}

#[test]
fn deepseek_greedy_generation_is_the_same_from_gguf_and_safetensors() {
    for name in ["tiny-deepseek-v2", "tiny-deepseek-v3"] {
        let generate = |model: std::path::PathBuf| {
            let out = pagoda(
                &[
                    "generate",
                    "-m",
                    model.to_str().unwrap(),
                    "--device",
                    "cpu",
                    "-n",
                    "16",
                    "--temp",
                    "0",
                    "-p",
                    "Hello",
                ],
                None,
            );
            out.assert_success();
            let (_, _, decoded, _) = throughput_line(&out.stderr);
            assert!(decoded > 0, "{name}: {}", out.stderr);
            out.stdout
        };
        // The tokenizer is byte-level, so equal bytes are equal token ids.
        let safetensors = generate(tiny_model(name));
        let gguf = generate(tiny_model(&format!("{name}/model.gguf")));
        assert!(!safetensors.is_empty(), "{name}: nothing generated");
        assert_eq!(safetensors, gguf, "{name}: GGUF and safetensors differ");
    }
}

#[test]
fn random_weights_of_a_large_moe_preset_are_refused_with_their_size() {
    let out = pagoda(
        &[
            "bench",
            "--random-weights",
            "qwen3-30b-a3b",
            "--device",
            "cpu",
            "-p",
            "16",
            "-n",
            "0",
        ],
        None,
    );
    let error = out.assert_clean_error();
    assert!(error.contains("GiB"), "{error}");
}
