//! Random weights in the `:fp8` format (`--random-weights llama-3.1-8b:fp8`): the dense
//! projections as FP8 (e4m3) codes with a power-of-two factor per row. On the CPU they are
//! dequantized at load, and the logits must be those of the same model built from the values
//! the codes stand for (decoded here, apart from the loader), and near the f32 random model's.
//! On the GPU (`--include-ignored`, a build with `--features cuda`) the codes stay FP8 with
//! `PAGODA_CUDA_FP8_WEIGHTS` on and are decoded to bf16 with it off: the same values both
//! ways, both runs near the CPU's.

mod common;
#[path = "common/schedule.rs"]
mod schedule;

use std::borrow::Cow;
use std::path::PathBuf;

use pagoda_engine::{load_random, Backend, LoadOptions};
use pagoda_models::formats::fp8::e4m3_to_f32;
use pagoda_models::llama::{Model, WeightPrecision};
use pagoda_models::random::{random_config, RandomFormat, RandomWeights};
use pagoda_models::weights::{Fp8Rows, RawTensor, TensorSource};
use schedule::{cpu_logits, errors, ragged_workload};

/// The tiny Llama's config.json: 2 layers, hidden 64, 4 heads (2 KV), MLP 128. From the
/// source tree the binary was built in, else from the working directory's (a packed test
/// binary runs at the root of a copy of the repository).
fn tiny_llama_config() -> String {
    let relative = "crates/models/tests/data/tiny/tiny-llama/config.json";
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(relative);
    let path = if built.is_file() {
        built
    } else {
        PathBuf::from(relative)
    };
    path.to_str().unwrap().to_owned()
}

fn cpu_model(spec: &str) -> Model {
    let options = LoadOptions::cpu(WeightPrecision::F32);
    match load_random(spec, 5, options, &mut |_, _| {}) {
        Ok(Backend::Cpu(model)) => model,
        Ok(_) => panic!("{spec}: not on the CPU"),
        Err(error) => panic!("{spec}: {error}"),
    }
}

/// `:fp8` random weights whose FP8 matrices are served as codes (`fp8_rows`) and, by
/// `tensor`, decoded here from those codes rather than by the random source.
struct Decoded(RandomWeights);

impl TensorSource for Decoded {
    fn tensor(&self, name: &str) -> Option<RawTensor<'_>> {
        let raw = self.0.tensor(name)?;
        let Some(rows) = self.0.fp8_rows(name) else {
            return Some(raw);
        };
        let cols = raw.shape[1];
        let data = (rows.codes.iter().enumerate())
            .flat_map(|(i, &code)| (e4m3_to_f32(code) * rows.row_scales[i / cols]).to_le_bytes())
            .collect();
        Some(RawTensor {
            data: Cow::Owned(data),
            ..raw
        })
    }

    fn tensor_names(&self) -> Vec<String> {
        self.0.tensor_names()
    }

    fn fp8_rows(&self, name: &str) -> Option<Fp8Rows<'_>> {
        self.0.fp8_rows(name)
    }
}

#[test]
fn fp8_random_weights_on_the_cpu_give_the_logits_of_their_dequantized_values() {
    let spec = format!("{}:fp8", tiny_llama_config());
    let config = random_config(&spec).unwrap();
    let fp8 = cpu_model(&spec);
    let weights = RandomWeights::new(&config, 5, 1 << 30)
        .unwrap()
        .with_format(RandomFormat::Fp8);
    // 7 projections in each of 2 layers; embeddings and the output head stay f32.
    assert_eq!(
        weights.fp8_matrices(),
        (14, 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64))
    );
    let reference = Model::load(config.clone(), &Decoded(weights), WeightPrecision::F32).unwrap();
    let (prompts, schedule) = ragged_workload(config.vocab_size);
    let got = cpu_logits(&fp8, &prompts, &schedule);
    let want = cpu_logits(&reference, &prompts, &schedule);
    let bits = |steps: &[Vec<f32>]| -> Vec<Vec<u32>> {
        let step = |row: &Vec<f32>| row.iter().map(|v| v.to_bits()).collect();
        steps.iter().map(step).collect()
    };
    assert_eq!(bits(&got), bits(&want), "fp8 vs its dequantized values");
    // The quantization is real and bounded: the f32 random model's logits move (by 0.13 of
    // the peak logit here, 0.13 in top-10 logprob: e4m3 keeps 3 mantissa bits).
    let plain = cpu_logits(&cpu_model(&tiny_llama_config()), &prompts, &schedule);
    let (relative, logprob) = errors(&plain, &got, config.vocab_size);
    eprintln!("fp8 vs f32 random weights: relative {relative:.2e}, top-10 logprob {logprob:.4}");
    assert!(relative > 0.0 && relative < 0.4, "relative {relative}");
    assert!(logprob < 0.4, "logprob {logprob}");
}

#[test]
fn a_bad_random_weights_format_is_one_line_naming_the_fix() {
    let spec = format!("{}:int4", tiny_llama_config());
    let options = LoadOptions::cpu(WeightPrecision::F32);
    let error = match load_random(&spec, 5, options, &mut |_, _| {}) {
        Ok(_) => panic!("{spec} loaded"),
        Err(error) => error.to_string(),
    };
    assert!(
        error.contains("`:int4`") && error.contains("config.json:fp8"),
        "{error}"
    );
    assert!(!error.contains('\n'), "{error}");
    let error = random_config("llama-3.1-8b:fp16").unwrap_err().to_string();
    assert!(error.contains("llama-3.1-8b:fp8"), "{error}");
    assert_eq!(random_config("llama-3.1-8b:fp8").unwrap().hidden_size, 4096);
}

#[test]
#[ignore = "needs a GPU"]
fn fp8_random_weights_on_the_gpu_hold_the_same_values_kept_or_decoded() {
    use pagoda_engine::cuda_runner::{CudaCacheOptions, CudaModel, CudaRunner, DType};
    use pagoda_models::llama_cuda::{CudaKernels, KeepOnDevice};
    let gpu = common::gpu();
    // The tiny Llama widened to a head_dim the CUDA attention runs (32) and rows of 128
    // columns (the in-place FP8 GEMV takes multiples of 16).
    let mut config = random_config(&tiny_llama_config()).unwrap();
    config.hidden_size = 128;
    config.head_dim = 32;
    config.intermediate_size = 256;
    config.rope_dim = 32;
    let weights = RandomWeights::new(&config, 5, 1 << 30)
        .unwrap()
        .with_format(RandomFormat::Fp8);
    let cpu = Model::load(config.clone(), &weights, WeightPrecision::F32).unwrap();
    let (prompts, schedule) = ragged_workload(config.vocab_size);
    let expected = cpu_logits(&cpu, &prompts, &schedule);
    let mut runs = Vec::new();
    for fp8 in [true, false] {
        let keep = KeepOnDevice {
            gguf_blocks: true,
            fp8,
            moe_experts: false,
        };
        let loaded = CudaModel::load_keeping(
            config.clone(),
            &weights,
            gpu.clone(),
            DType::BF16,
            keep,
            &mut |_, _| {},
        )
        .unwrap();
        let codes = if fp8 { weights.fp8_matrices().1 } else { 0 };
        assert_eq!(loaded.fp8_bytes(), codes, "fp8 {fp8}");
        // Large steps decode the matrices (bf16 activations): the weights' values alone
        // are compared here (`cuda_fp8_weights` covers the FP8 GEMM).
        let options = CudaCacheOptions {
            kernels: CudaKernels {
                fp8_gemm: false,
                ..Default::default()
            },
            ..schedule::cache_options()
        };
        let mut model = CudaRunner::new(loaded, options).unwrap();
        model.warm_up(&mut |_| {}).unwrap();
        let got = schedule::run_schedule(&prompts, &schedule, &mut |batch| {
            model.forward(batch).unwrap()
        });
        let (relative, logprob) = errors(&expected, &got, config.vocab_size);
        eprintln!("fp8 {fp8}: relative {relative:.2e}, top-10 logprob {logprob:.4}");
        assert!(logprob < 0.15, "fp8 {fp8}: top-10 logprob error {logprob}");
        let counters = model.counters();
        let fp8_steps =
            counters.steps_cuda_fp8_weights_in_place + counters.steps_cuda_fp8_weights_decoded;
        assert_eq!(fp8_steps > 0, fp8, "{counters:?}");
        runs.push(got);
    }
    // Kept or decoded, the weights are the same values: only the kernels' sums differ.
    let (relative, logprob) = errors(&runs[1], &runs[0], config.vocab_size);
    eprintln!("fp8 kept vs decoded: relative {relative:.2e}, top-10 logprob {logprob:.4}");
    assert!(logprob < 0.15, "kept vs decoded: {logprob}");
}
