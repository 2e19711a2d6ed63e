//! `bench --random-weights <ARCH>:fp8`: random weights whose dense projections are FP8 (e4m3)
//! with a factor per row (the engine's `random_fp8_weights.rs` checks their logits). On the CPU
//! they are dequantized at load and the load line says so; a bad format is one error line
//! naming the fix, before anything is allocated.

mod support;

use support::{pagoda, tiny_model};

#[test]
fn bench_runs_fp8_random_weights_and_says_what_became_of_them() {
    let config = tiny_model("tiny-llama").join("config.json");
    let spec = format!("{}:fp8", config.to_str().unwrap());
    let args = [
        "bench",
        "--random-weights",
        &spec,
        "--device",
        "cpu",
        "-p",
        "16",
        "-n",
        "4",
        "-r",
        "1",
        "--json",
    ];
    let out = pagoda(&args, None);
    out.assert_success();
    assert!(
        out.stderr
            .contains("FP8 projections dequantized to f32 at load"),
        "{}",
        out.stderr
    );
    let stdout = out.stdout_text();
    let report: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("bad JSON ({e}):\n{stdout}"));
    assert_eq!(report["fp8_weight_bytes"], 0, "{report}");
    assert!(
        report["model"].as_str().unwrap().ends_with(":fp8"),
        "{report}"
    );
    assert_eq!(report["results"].as_array().unwrap().len(), 2, "{report}");
}

#[test]
fn a_bad_random_weights_format_is_refused_naming_the_fix() {
    let out = pagoda(
        &[
            "bench",
            "--random-weights",
            "llama-3.1-8b:int4",
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
    assert!(
        error.contains("`:int4`") && error.contains("llama-3.1-8b:fp8"),
        "{error}"
    );
}
