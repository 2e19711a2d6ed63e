//! A GGUF mixture-of-experts model on CUDA with its stacked experts kept in their blocks
//! (`PAGODA_CUDA_MOE_QUANT`: `CudaModel::load_keeping` and `CudaKernels::moe_quant`)
//! against the CPU forward of the same file in f32 (the oracle), beside the same GPU model
//! with the experts dequantized at load. The files come from the folder
//! `PAGODA_GPU_TEST_MOE_GGUFS` names, written on the GPU machine with
//! `scripts/random-gguf.py` (tiny Qwen3-MoE and Mixtral, q4_k_m and q8_0). bf16, graphs on,
//! ragged prefill chunks, mixed steps and batched decode; then again in deterministic mode,
//! and with steps of 16+ rows run from stacks decoded for the dense expert kernels
//! (`CudaKernels::moe_quant_dense_rows`).
//! The quantized experts' logits stay within 5% of each row's peak logit (the dense quantized
//! CUDA test's bound), or within twice the dequantized experts' error where a bf16 near-tied
//! router already moves those more; the expert launches are counted; device memory for weights
//! is within 5% of the file's size.
//!
//! On the GPU machine only (`--include-ignored`, a build with `--features cuda`); elsewhere
//! every test shows as ignored.

mod common;

use std::path::PathBuf;

use common::gpu;
use pagoda_engine::cuda_runner::{CudaCacheOptions, CudaModel, CudaRunner, DType};
use pagoda_models::llama::{AttentionPolicy, KvCache, Model, WeightPrecision};
use pagoda_models::llama_cuda::{CudaKernels, KeepOnDevice};

#[path = "common/schedule.rs"]
mod schedule;
use schedule::{measure, run_schedule, short_workload, NUM_PAGES, PAGE_SIZE};

fn cache_options(moe_quant: bool, deterministic: bool, dense_rows: usize) -> CudaCacheOptions {
    CudaCacheOptions {
        num_pages: NUM_PAGES,
        page_size: PAGE_SIZE,
        max_batch_tokens: 128,
        max_batch_requests: 8,
        max_context: NUM_PAGES * PAGE_SIZE,
        cuda_graphs: true,
        paged_decode: Default::default(),
        kernels: CudaKernels {
            moe_quant,
            moe_quant_dense_rows: dense_rows,
            deterministic,
            ..CudaKernels::default()
        },
    }
}

#[test]
#[ignore = "needs a GPU"]
fn quantized_experts_track_the_cpu_exact_model() {
    let gpu = gpu();
    let Some(dir) = std::env::var_os("PAGODA_GPU_TEST_MOE_GGUFS") else {
        eprintln!("SKIP: PAGODA_GPU_TEST_MOE_GGUFS names no folder of quantized MoE GGUF files");
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
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let file = pagoda_models::formats::gguf::GgufFile::open(&path).unwrap();
        let config = pagoda_models::gguf_model::config_from_gguf(&file).unwrap();
        assert!(
            config.moe.is_some(),
            "{name} is not a mixture-of-experts model"
        );
        let cpu = Model::load(config.clone(), &file, WeightPrecision::F32).unwrap();
        let vocab = config.vocab_size;
        let (prompts, schedule) = short_workload(vocab);
        let mut kv = KvCache::new(config.num_layers, cpu.kv_layout(NUM_PAGES, PAGE_SIZE));
        let expected = run_schedule(&prompts, &schedule, &mut |batch| {
            cpu.forward(batch, &mut kv, AttentionPolicy::Auto)
                .unwrap()
                .logits
        });
        let file_bytes = std::fs::metadata(&path).unwrap().len() as usize;
        let mut dense_relative = 0.0;
        // Last, steps of 16+ rows (the two first) decode the experts for the dense kernels.
        let runs = [
            (false, false, 256),
            (true, false, 256),
            (true, true, 256),
            (true, false, 16),
        ];
        for (quant, deterministic, dense_rows) in runs {
            let loaded = CudaModel::load_keeping(
                config.clone(),
                &file,
                gpu.clone(),
                DType::BF16,
                KeepOnDevice {
                    gguf_blocks: true,
                    fp8: false,
                    moe_experts: quant,
                },
                &mut |_, _| {},
            )
            .unwrap();
            let weight_bytes = loaded.weight_bytes();
            // The counter ticks when a launch is issued or captured: warm-up captures the
            // CUDA graphs that the schedule's steps then replay without counting.
            let launches = pagoda_ops::cuda::moe_quant_launches();
            let decodes = pagoda_ops::cuda::moe_quant_dense_decodes();
            let options = cache_options(quant, deterministic, dense_rows);
            let mut runner = CudaRunner::new(loaded, options).unwrap();
            runner.warm_up(&mut |_| {}).unwrap();
            let got = run_schedule(&prompts, &schedule, &mut |batch| {
                runner.forward(batch).unwrap()
            });
            let launched = pagoda_ops::cuda::moe_quant_launches() - launches;
            let decoded = pagoda_ops::cuda::moe_quant_dense_decodes() - decodes;
            let e = measure(&expected, &got, vocab);
            let (relative, logprob, greedy) = (e.relative, e.logprob, e.greedy_mismatches);
            eprintln!(
                "{name} quantized experts {quant} deterministic {deterministic} dense from \
                 {dense_rows} rows: weights {weight_bytes} B (file {file_bytes}), max relative \
                 logit error {relative:.2e}, top-10 logprob error {logprob:.4}, greedy \
                 mismatches {greedy}, quantized expert launches {launched}, stacks decoded \
                 {decoded}"
            );
            if !quant {
                dense_relative = relative;
                assert_eq!(launched, 0, "{name}");
                continue;
            }
            assert!(launched > 0, "{name}: no quantized expert launch");
            // Steps of 16+ rows exist only below 128 tokens (max_batch_tokens), so only the
            // last run decodes stacks.
            assert_eq!(
                decoded > 0,
                dense_rows == 16,
                "{name}: {decoded} stacks decoded"
            );
            assert!(
                weight_bytes <= file_bytes * 105 / 100,
                "{name}: {weight_bytes} B of weights for a file of {file_bytes} B"
            );
            let bound = 0.05f64.max(2.0 * dense_relative);
            assert!(
                relative < bound,
                "{name} deterministic {deterministic}: {relative} (bound {bound})"
            );
        }
    }
}
