//! FP8 (e4m3) weights with one factor per row kept on the GPU (`PAGODA_CUDA_FP8_WEIGHTS`;
//! here through `CudaModel::load_keeping`), on the GPU machine only (`--include-ignored`, a
//! build with `--features cuda`). A random SmolLM2-geometry model whose seven projections a
//! layer are quantized per channel by the test serves them both ways, as compressed-tensors
//! checkpoints do: dequantized (the CPU oracle's F32 weights) and as codes and factors (the
//! GPU's). The GPU in bf16, graphs on and off, must match the CPU within the bounds of the
//! other bf16 forward tests, decode steps multiplying in place (`gemv_fp8`) and prefill steps
//! decoding for cuBLAS, with device memory for the projections their codes' size; with the
//! prefill steps on the FP8 GEMM (`PAGODA_CUDA_FP8_GEMM`, e4m3 activations) within a wider
//! bound.

mod common;
#[path = "common/schedule.rs"]
mod schedule;

use std::borrow::Cow;
use std::collections::BTreeMap;

use common::gpu;
use pagoda_engine::cuda_runner::{CudaCacheOptions, CudaModel, CudaRunner, DType};
use pagoda_models::config::ModelConfig;
use pagoda_models::formats::fp8::e4m3_to_f32;
use pagoda_models::llama::{Model, WeightPrecision};
use pagoda_models::llama_cuda::{CudaKernels, KeepOnDevice};
use pagoda_models::random::{preset, RandomWeights};
use pagoda_models::weights::{Fp8Rows, RawTensor, TensorSource};
use schedule::{cache_options, cpu_logits, errors, ragged_workload, run_schedule};

/// One matrix's codes, row factors and dequantized F32 bytes.
type Quantized = (Vec<u8>, Vec<f32>, Vec<u8>);

/// Random weights whose projections are FP8 with a factor per row.
struct Fp8Source {
    inner: RandomWeights,
    /// Codes, factors and the dequantized F32 bytes, by canonical name.
    fp8: BTreeMap<String, Quantized>,
}

impl Fp8Source {
    fn new(config: &ModelConfig) -> Fp8Source {
        let inner = RandomWeights::new(config, 11, 4 << 30).unwrap();
        let positives: Vec<f32> = (0u8..0x7f).map(e4m3_to_f32).collect();
        let encode = |a: f32| -> u8 {
            let i = positives
                .partition_point(|&v| v < a)
                .min(positives.len() - 1);
            let below = i.saturating_sub(1);
            let nearer = if (positives[i] - a).abs() < (a - positives[below]).abs() {
                i
            } else {
                below
            };
            nearer as u8
        };
        let mut fp8 = BTreeMap::new();
        for name in inner.tensor_names() {
            let projection = ["attn_q.", "attn_k.", "attn_v.", "attn_output.", "ffn_"]
                .iter()
                .any(|p| name.contains(p));
            let raw = inner.tensor(&name).unwrap();
            // Projections only: `ffn_` also names the 1-D FFN norm.
            if !projection || !name.ends_with(".weight") || raw.shape.len() != 2 {
                continue;
            }
            // Random weights are F32.
            assert_eq!(raw.data.len(), 4 * raw.shape.iter().product::<usize>());
            let cols = raw.shape[1];
            let values: Vec<f32> = (raw.data.chunks_exact(4))
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let (mut codes, mut scales, mut dequantized) = (Vec::new(), Vec::new(), Vec::new());
            for row in values.chunks(cols) {
                let scale = row.iter().fold(1e-12f32, |m, v| m.max(v.abs())) / 448.0;
                for &v in row {
                    let code =
                        encode((v.abs() / scale).min(448.0)) | if v < 0.0 { 0x80 } else { 0 };
                    codes.push(code);
                    dequantized.extend_from_slice(&(e4m3_to_f32(code) * scale).to_le_bytes());
                }
                scales.push(scale);
            }
            fp8.insert(name, (codes, scales, dequantized));
        }
        Fp8Source { inner, fp8 }
    }

    fn code_bytes(&self) -> usize {
        self.fp8.values().map(|f| f.0.len()).sum()
    }
}

impl TensorSource for Fp8Source {
    fn tensor(&self, name: &str) -> Option<RawTensor<'_>> {
        let raw = self.inner.tensor(name)?;
        match self.fp8.get(name) {
            Some((_, _, dequantized)) => Some(RawTensor {
                data: Cow::Borrowed(dequantized),
                ..raw
            }),
            None => Some(raw),
        }
    }

    fn tensor_names(&self) -> Vec<String> {
        self.inner.tensor_names()
    }

    fn fp8_rows(&self, name: &str) -> Option<Fp8Rows<'_>> {
        self.fp8.get(name).map(|(codes, scales, _)| Fp8Rows {
            codes: Cow::Borrowed(codes),
            row_scales: scales.clone(),
        })
    }
}

#[test]
#[ignore = "needs a GPU"]
fn fp8_weights_on_the_gpu_match_the_cpu_on_their_dequantized_values() {
    let gpu = gpu();
    let config = ModelConfig {
        num_layers: 4,
        vocab_size: 3000,
        ..preset("smollm2-135m").unwrap()
    };
    let source = Fp8Source::new(&config);
    let cpu = Model::load(config.clone(), &source, WeightPrecision::F32).unwrap();
    let (prompts, schedule) = ragged_workload(config.vocab_size);
    let expected = cpu_logits(&cpu, &prompts, &schedule);
    let keep = KeepOnDevice {
        gguf_blocks: true,
        fp8: true,
        moe_experts: false,
    };
    // Prefill and mixed steps on the FP8 GEMM (activations quantized per token), graphs on
    // and off; then decoded for cuBLAS (bf16 activations, the CPU's arithmetic but bf16).
    for (cuda_graphs, fp8_gemm) in [(true, true), (false, true), (true, false)] {
        let loaded = CudaModel::load_keeping(
            config.clone(),
            &source,
            gpu.clone(),
            DType::BF16,
            keep,
            &mut |_, _| {},
        )
        .unwrap();
        assert_eq!(loaded.fp8_bytes(), source.code_bytes());
        let mut model = CudaRunner::new(
            loaded,
            CudaCacheOptions {
                cuda_graphs,
                // Every decode step in place (the default takes 2 rows), as counted below.
                kernels: CudaKernels {
                    fp8_gemm,
                    fp8_gemv_rows: 16,
                    ..Default::default()
                },
                ..cache_options()
            },
        )
        .unwrap();
        model.warm_up(&mut |_| {}).unwrap();
        let got = run_schedule(&prompts, &schedule, &mut |batch| {
            model.forward(batch).unwrap()
        });
        let (relative, logprob) = errors(&expected, &got, config.vocab_size);
        let counters = model.counters();
        eprintln!("bf16 fp8 weights, graphs {cuda_graphs}, fp8 gemm {fp8_gemm}: max relative logit error {relative:.2e}, max top-10 logprob error {logprob:.4}");
        // e4m3 activations carry up to 2^-4 relative rounding each (bf16's 2^-9).
        let bound = if fp8_gemm { 0.4 } else { 0.15 };
        assert!(
            logprob < bound,
            "graphs {cuda_graphs}, fp8 gemm {fp8_gemm}: top-10 logprob error {logprob}"
        );
        // 10 decode steps of at most 3 rows in place; the prefill and mixed steps on the FP8
        // GEMM or decoded.
        let (gemm, decoded) = if fp8_gemm { (5, 0) } else { (0, 5) };
        assert_eq!(counters.steps_cuda_fp8_weights_in_place, 10, "{counters:?}");
        assert_eq!(counters.steps_cuda_fp8_weights_gemm, gemm, "{counters:?}");
        assert_eq!(
            counters.steps_cuda_fp8_weights_decoded, decoded,
            "{counters:?}"
        );
    }
    // The same model with the switch off: dense bf16, no FP8 step.
    let off = KeepOnDevice {
        gguf_blocks: true,
        fp8: false,
        moe_experts: false,
    };
    let loaded =
        CudaModel::load_keeping(config, &source, gpu, DType::BF16, off, &mut |_, _| {}).unwrap();
    assert_eq!(loaded.fp8_bytes(), 0);
}
