//! The GPU forward pass against the CPU model (the oracle), on the GPU machine only.
//!
//! Run there with `--include-ignored` and a binary built with `--features cuda`; elsewhere
//! every test shows as ignored. Covered: random-weight llama geometries (SmolLM2's
//! halves RoPE with head_dim 64; a Llama-3-like block with head_dim 128, GQA 4 and llama3
//! RoPE scaling) through ragged batches that mix prefill chunks and decode tokens over
//! scattered pages, in f32 (tight) and bf16 (logprob tolerance); and, when the default
//! model file is present, greedy ids of the CPU's exact mode against the GPU in f32.

mod common;

use common::gpu;
use std::path::PathBuf;
use std::sync::Arc;

use pagoda_cuda::Gpu;
use pagoda_engine::cuda_runner::{CudaCacheOptions, CudaModel, CudaRunner, DType, PagedDecodeMode};
use pagoda_kv::{BlockPool, BlockTable, PageTable};
use pagoda_models::config::{Llama3RopeScaling, ModelConfig};
use pagoda_models::llama::{AttentionPolicy, ForwardBatch, KvCache, Model, WeightPrecision};
use pagoda_models::random::{preset, RandomWeights};
use pagoda_models::weights::TensorSource;
use pagoda_ops::cuda::QuantGemvKernel;

#[path = "common/schedule.rs"]
mod schedule;
use schedule::{
    cache_options, cpu_logits, errors, log_softmax, ragged_workload, run_schedule, Schedule,
    NUM_PAGES, PAGE_SIZE,
};

fn compare(gpu: &Arc<Gpu>, config: ModelConfig) -> (f64, f64) {
    let weights = RandomWeights::new(&config, 11, 4 << 30).unwrap();
    let cpu = Model::load(config.clone(), &weights, WeightPrecision::F32).unwrap();
    let vocab = config.vocab_size;
    let (prompts, schedule) = ragged_workload(vocab);
    let expected = cpu_logits(&cpu, &prompts, &schedule);
    let mut results = Vec::new();
    for (dtype, cuda_graphs, paged_decode) in [
        (DType::F32, true, PagedDecodeMode::Fused),
        (DType::F32, true, PagedDecodeMode::Gather),
        (DType::F32, false, PagedDecodeMode::Fused),
        (DType::BF16, true, PagedDecodeMode::Fused),
        (DType::BF16, false, PagedDecodeMode::Gather),
        (DType::BF16, true, PagedDecodeMode::Gather),
    ] {
        let loaded =
            CudaModel::load(config.clone(), &weights, gpu.clone(), dtype, &mut |_, _| {}).unwrap();
        let mut model = CudaRunner::new(
            loaded,
            CudaCacheOptions {
                cuda_graphs,
                paged_decode,
                ..cache_options()
            },
        )
        .unwrap();
        // The warm-up's steps write into the cache's pages; the schedule below must not see
        // them (every logit is still compared with the CPU), nor load another kernel.
        let warmed = model.warm_up(&mut |_| {}).unwrap();
        assert_eq!(warmed.steps, 3, "{warmed:?}");
        // Every 16-token bucket up to the step buffers' 256 tokens: its pieces captured.
        let piece_buckets = if cuda_graphs { 256 / 16 } else { 0 };
        assert_eq!(warmed.piece_buckets, piece_buckets, "{warmed:?}");
        let loaded = gpu.loaded_kernels();
        let got = run_schedule(&prompts, &schedule, &mut |batch| {
            model.forward(batch).unwrap()
        });
        assert_eq!(
            gpu.loaded_kernels(),
            loaded,
            "a kernel was loaded after the warm-up"
        );
        let (worst_relative, worst_logprob) = errors(&expected, &got, vocab);
        let counters = model.counters();
        eprintln!("{dtype} graphs {cuda_graphs} {paged_decode}: max relative logit error {worst_relative:.2e}, max top-10 logprob error {worst_logprob:.4}; {counters:?}");
        // The decode steps took the path asked for, replayed from graphs when on.
        let (fused, gathered) = match paged_decode {
            PagedDecodeMode::Gather => (0, 10),
            _ => (10, 0),
        };
        assert_eq!(counters.steps_cuda_decode_fused, fused, "{counters:?}");
        assert_eq!(counters.steps_cuda_decode_gather, gathered, "{counters:?}");
        // The mixed steps split their rows between the fused decode and the prefill kernel
        // where the fused decode runs (PAGODA_CUDA_MIXED_STEPS=split, the default).
        let (split, unsplit) = match paged_decode {
            PagedDecodeMode::Gather => (0, 4),
            _ => (4, 0),
        };
        assert_eq!(counters.steps_cuda_mixed_split, split, "{counters:?}");
        assert_eq!(counters.steps_cuda_mixed_prefill, unsplit, "{counters:?}");
        assert_eq!(counters.cuda_mixed_decode_rows, 7, "{counters:?}");
        assert_eq!(
            counters.cuda_mixed_prefill_tokens,
            20 + 19 + 30 + 20 + 18,
            "{counters:?}"
        );
        // The prefill and mixed steps replayed piecewise graphs the warm-up captured where
        // graphs are on, else ran eagerly.
        let layers = config.num_layers as u64;
        if cuda_graphs {
            assert_eq!(counters.steps_cuda_piecewise, 5, "{counters:?}");
            assert_eq!(counters.steps_cuda_eager, 0, "{counters:?}");
            assert_eq!(
                counters.cuda_piece_graphs_captured,
                piece_buckets as u64 * (layers + 1),
                "{counters:?}"
            );
        } else {
            assert_eq!(counters.steps_cuda_piecewise, 0, "{counters:?}");
            assert_eq!(counters.steps_cuda_eager, 15, "{counters:?}");
        }
        if cuda_graphs {
            assert_eq!(counters.steps_cuda_graph, 10, "{counters:?}");
            assert_eq!(
                counters.cuda_graphs_captured, 4,
                "buckets 1, 2, 4 and 8, captured by the warm-up: {counters:?}"
            );
        } else {
            assert_eq!(counters.steps_cuda_graph, 0, "{counters:?}");
        }
        results.push((dtype, worst_relative, worst_logprob));
    }
    let f32_error = results
        .iter()
        .filter(|r| r.0 == DType::F32)
        .fold(0f64, |a, r| a.max(r.1));
    let bf16_error = results
        .iter()
        .filter(|r| r.0 == DType::BF16)
        .fold(0f64, |a, r| a.max(r.2));
    (f32_error, bf16_error)
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_forward_matches_cpu_smollm2_geometry() {
    let gpu = gpu();
    let config = ModelConfig {
        num_layers: 4,
        vocab_size: 3000,
        ..preset("smollm2-135m").unwrap()
    };
    let (f32_error, bf16_error) = compare(&gpu, config);
    assert!(f32_error < 2e-3, "f32 relative logit error {f32_error}");
    assert!(bf16_error < 0.15, "bf16 top-10 logprob error {bf16_error}");
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_forward_matches_cpu_llama3_geometry() {
    let gpu = gpu();
    let base = preset("llama-3.1-8b").unwrap();
    let config = ModelConfig {
        hidden_size: 1024,
        num_layers: 3,
        num_attention_heads: 8,
        num_kv_heads: 2,
        head_dim: 128,
        intermediate_size: 2048,
        vocab_size: 4096,
        rope_scaling: Some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        }),
        ..base
    };
    let (f32_error, bf16_error) = compare(&gpu, config);
    assert!(f32_error < 2e-3, "f32 relative logit error {f32_error}");
    assert!(bf16_error < 0.15, "bf16 top-10 logprob error {bf16_error}");
}

fn default_model() -> Option<PathBuf> {
    let path = std::env::var_os("PAGODA_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    path.is_file().then_some(path)
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_f32_greedy_ids_equal_cpu_exact_on_the_default_model() {
    let gpu = gpu();
    let Some(path) = default_model() else {
        eprintln!("SKIP: the default model file is not here");
        return;
    };
    let file = pagoda_models::formats::gguf::GgufFile::open(&path).unwrap();
    let config = pagoda_models::gguf_model::config_from_gguf(&file).unwrap();
    let source: &dyn TensorSource = &file;
    let cpu = Model::load(config.clone(), source, WeightPrecision::F32).unwrap();
    let mut worst_bf16 = 0f64;
    let mut worst_top5 = 0f64;
    // f32 through both decode paths: both must give the CPU's greedy ids (so each other's).
    for (dtype, paged_decode) in [
        (DType::F32, PagedDecodeMode::Fused),
        (DType::F32, PagedDecodeMode::Gather),
        (DType::BF16, PagedDecodeMode::Fused),
    ] {
        // Dense weights: the quantized path has its own test (q8 activations are not exact).
        let loaded = CudaModel::load_with(
            config.clone(),
            source,
            gpu.clone(),
            dtype,
            false,
            &mut |_, _| {},
        )
        .unwrap();
        let mut model = CudaRunner::new(
            loaded,
            CudaCacheOptions {
                paged_decode,
                ..cache_options()
            },
        )
        .unwrap();
        // Prompts as token ids (a tokenizer is not needed for parity).
        for prompt in [
            vec![504u32, 3458, 282, 4649, 314],
            vec![1, 9690, 198, 2683, 359, 253],
        ] {
            let vocab = config.vocab_size;
            // A fresh cache per prompt.
            model
                .prepare(CudaCacheOptions {
                    paged_decode,
                    ..cache_options()
                })
                .unwrap();
            let mut cpu_kv = KvCache::new(config.num_layers, cpu.kv_layout(NUM_PAGES, PAGE_SIZE));
            // Greedy on the CPU; the GPU is teacher-forced on the CPU's sequence.
            let mut sequence = prompt.clone();
            let mut schedule: Schedule = vec![vec![prompt.len()]];
            schedule.extend((0..16).map(|_| vec![1]));
            let mut cpu_rows = Vec::new();
            {
                let mut pool = BlockPool::new(NUM_PAGES, PAGE_SIZE).unwrap();
                let mut table = BlockTable::new();
                let mut fed = 0;
                for step in &schedule {
                    let count = step[0];
                    let slots = table.append_slots(&mut pool, count).unwrap();
                    let page_table = PageTable::from_block_tables(&[&table], &pool).unwrap();
                    let positions: Vec<u32> = (fed..fed + count).map(|p| p as u32).collect();
                    let batch = ForwardBatch {
                        tokens: &sequence[fed..fed + count],
                        positions: &positions,
                        slots: &slots,
                        qo_indptr: &[0, count as u32],
                        page_table: &page_table,
                        logits_for: &[count - 1],
                        sparse: &[],
                    };
                    let logits = cpu
                        .forward(&batch, &mut cpu_kv, AttentionPolicy::Auto)
                        .unwrap()
                        .logits;
                    fed += count;
                    let next = pagoda_ops::sampling::argmax(&logits);
                    sequence.push(next);
                    cpu_rows.push(logits);
                }
            }
            let gpu_rows = run_schedule(&[sequence.clone()], &schedule, &mut |batch| {
                model.forward(batch).unwrap()
            });
            for (step, (c_row, g_row)) in cpu_rows.iter().zip(&gpu_rows).enumerate() {
                assert_eq!(g_row.len(), vocab);
                if dtype == DType::F32 {
                    assert_eq!(
                        pagoda_ops::sampling::argmax(g_row),
                        pagoda_ops::sampling::argmax(c_row),
                        "f32 {paged_decode} greedy id differs at step {step} of prompt {prompt:?}"
                    );
                } else {
                    let (lc, lg) = (log_softmax(c_row), log_softmax(g_row));
                    let mut order: Vec<usize> = (0..vocab).collect();
                    order.sort_by(|&a, &b| lc[b].total_cmp(&lc[a]));
                    let errors: Vec<f64> =
                        order[..5].iter().map(|&i| (lc[i] - lg[i]).abs()).collect();
                    eprintln!(
                        "bf16 step {step}: top-5 logprobs {:?} errors {:?}",
                        order[..5]
                            .iter()
                            .map(|&i| (lc[i] * 100.0).round() / 100.0)
                            .collect::<Vec<_>>(),
                        errors
                            .iter()
                            .map(|e| (e * 1000.0).round() / 1000.0)
                            .collect::<Vec<_>>()
                    );
                    worst_bf16 = worst_bf16.max(errors[0]);
                    worst_top5 = worst_top5.max(errors.iter().cloned().fold(0.0, f64::max));
                }
            }
        }
    }
    eprintln!(
        "bf16 vs CPU exact: chosen token max logprob error {worst_bf16:.4}, top-5 {worst_top5:.4}"
    );
    assert!(worst_bf16 < 0.1, "bf16 top-5 logprob error {worst_bf16}");
}

/// GGUF files of quantized random weights (`scripts/random-gguf.py --preset tiny --type ...`,
/// written on the GPU machine into the folder `PAGODA_GPU_TEST_GGUFS` names): the GPU with the
/// blocks kept on the device (bf16; decode rows multiplied in place, in both layouts of the
/// in-place kernel, prefill chunks decoded for cuBLAS; or every step decoded, `quant_gemv_rows`
/// 0; or steps of 3 to 32 rows on the tensor-core kernel, `quant_mma_rows`, with all three
/// routes in one run) against the CPU's exact f32 model
/// on the ragged workload, beside the GPU with the weights dequantized at load. The in-place
/// steps run with the producers writing the q8 activations (`quant_fused_q8`) and a QKV of two
/// formats (a q4_k_m file's Q6_K v) in one launch (`quant_pair`), both on, and once
/// without each, which must give the same logits bit for bit. The in-place
/// path quantizes activations to 8 bits: its logits stay within 5% of the peak logit (a wrong
/// decoder moves them by the peak itself), and device memory for weights is the file's size.
#[test]
#[ignore = "needs a GPU"]
fn gpu_quantized_weights_track_the_cpu_exact_model() {
    let gpu = gpu();
    let Some(dir) = std::env::var_os("PAGODA_GPU_TEST_GGUFS") else {
        eprintln!("SKIP: PAGODA_GPU_TEST_GGUFS names no folder of quantized GGUF files");
        return;
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no .gguf file in {dir:?}");
    for path in files {
        let file = pagoda_models::formats::gguf::GgufFile::open(&path).unwrap();
        let config = pagoda_models::gguf_model::config_from_gguf(&file).unwrap();
        let cpu = Model::load(config.clone(), &file, WeightPrecision::F32).unwrap();
        let (prompts, schedule) = ragged_workload(config.vocab_size);
        let expected = cpu_logits(&cpu, &prompts, &schedule);
        let file_bytes = std::fs::metadata(&path).unwrap().len() as usize;
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let mut dense_error = 0.0;
        let (groups, units) = (QuantGemvKernel::Groups, QuantGemvKernel::UNITS);
        // (keep, rows in place, rows on the tensor cores, layout, (fused q8, pair)).
        let runs = [
            (false, 16, 0, units, (true, true)),
            (true, 16, 0, groups, (true, true)),
            (true, 16, 0, groups, (false, true)),
            (true, 16, 0, groups, (true, false)),
            (true, 16, 0, units, (true, true)),
            (true, 0, 0, units, (true, true)),
            (true, 2, 32, groups, (true, true)),
        ];
        let mut fused_logits: Option<Vec<Vec<f32>>> = None;
        for (keep, gemv_rows, mma_rows, kernel, (fused_q8, pair)) in runs {
            let loaded = CudaModel::load_with(
                config.clone(),
                &file,
                gpu.clone(),
                DType::BF16,
                keep,
                &mut |_, _| {},
            )
            .unwrap();
            let weight_bytes = loaded.weight_bytes();
            let pair_matrices = loaded.quant_pair_matrices();
            let mut options = cache_options();
            options.kernels.quant_gemv_rows = gemv_rows;
            options.kernels.quant_mma_rows = mma_rows;
            options.kernels.quant_gemv_kernel = kernel;
            options.kernels.quant_fused_q8 = fused_q8;
            options.kernels.quant_pair = pair;
            let mut model = CudaRunner::new(loaded, options).unwrap();
            model.warm_up(&mut |_| {}).unwrap();
            let before = model.counters().clone();
            let got = run_schedule(&prompts, &schedule, &mut |batch| {
                model.forward(batch).unwrap()
            });
            let (relative, logprob) = errors(&expected, &got, config.vocab_size);
            let counters = model.counters();
            let in_place = counters.steps_cuda_quant_in_place - before.steps_cuda_quant_in_place;
            let decoded = counters.steps_cuda_quant_decoded - before.steps_cuda_quant_decoded;
            let mma = counters.steps_cuda_quant_mma - before.steps_cuda_quant_mma;
            let fused = counters.steps_cuda_quant_fused_q8 - before.steps_cuda_quant_fused_q8;
            let paired = counters.steps_cuda_quant_pair - before.steps_cuda_quant_pair;
            eprintln!(
                "{name} keep {keep} rows {gemv_rows} mma {mma_rows} {kernel:?} fused q8 \
                 {fused_q8} pair {pair} \
                 ({pair_matrices} matrices): weights \
                 {weight_bytes} B (file {file_bytes}), max relative logit error {relative:.2e}, \
                 top-10 logprob error {logprob:.4}, steps in place {in_place} mma {mma} \
                 decoded {decoded} \
                 fused {fused} paired {paired}"
            );
            let fusing = keep && gemv_rows.max(mma_rows) > 0 && fused_q8;
            assert_eq!(fused, if fusing { in_place + mma } else { 0 }, "{name}");
            let pairing = keep && pair && kernel == groups && pair_matrices > 0;
            assert_eq!(paired, if pairing { in_place } else { 0 }, "{name}");
            if keep && gemv_rows == 16 && kernel == groups {
                // The defaults first, then each fusion off: the same bits.
                match &fused_logits {
                    None => fused_logits = Some(got.clone()),
                    Some(fused) => assert!(
                        same_bits(fused, &got),
                        "{name}: logits with fused q8 {fused_q8} pair {pair} differ from the \
                         defaults'"
                    ),
                }
            }
            match (keep, gemv_rows, mma_rows) {
                (false, ..) => {
                    dense_error = relative;
                    assert_eq!((in_place, mma, decoded), (0, 0, 0));
                }
                // 3-row decode steps and the chunks of 32, 22 and 20 rows on the tensor cores.
                (true, 2, 32) => assert_eq!((in_place, mma, decoded), (2, 11, 2), "{name}"),
                (true, 16, _) => {
                    assert!(
                        weight_bytes <= file_bytes * 105 / 100,
                        "{name}: {weight_bytes} B"
                    );
                    // The 10 decode steps in place; the 5 steps with prefill chunks decoded.
                    assert_eq!((in_place, decoded), (10, 5), "{name}");
                }
                _ => assert_eq!((in_place, mma, decoded), (0, 0, 15), "{name}"),
            }
            assert!(
                relative < 0.05,
                "{name} keep {keep} rows {gemv_rows} {kernel:?}: {relative}"
            );
        }
        assert!(dense_error < 0.05, "{name}: dense bf16 {dense_error}");
    }
}

/// Whether two runs' logits are the same bits.
fn same_bits(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    let bits =
        |rows: &[Vec<f32>]| -> Vec<u32> { rows.iter().flatten().map(|v| v.to_bits()).collect() };
    bits(a) == bits(b)
}
