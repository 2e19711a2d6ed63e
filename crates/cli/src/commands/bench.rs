//! `pagoda bench`: prefill and decode throughput, repeated, with median and spread.
//!
//! Prompts are pseudo-random token ids drawn afresh for every run (no cache flatters a repeat),
//! sampling is greedy with end-of-generation ignored, the machine load is read before and
//! after, and the attention path that ran is reported from the engine's counters.
//!
//! Unless `--no-warmup`, the first prefill test and the first decode test each run once
//! untimed before their timed repetitions, so first-touch page faults, lazily compiled
//! kernels and graph captures are in no figure. An even count's median is the mean of the
//! two middle ones; the report warns when a test's repetitions differ by more than 2x.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use pagoda_engine::speculation::FixedProposer;
use pagoda_engine::{load_random, Engine, LoadOptions};
use pagoda_models::llama::WeightPrecision;
use pagoda_ops::sampling::SamplingParams;
use serde::Serialize;

use super::stats::{self, Summary};
use super::{bench_sampling::SamplingDevice, host::load_average};
use crate::common::{self, ModelArgs};

mod kind;
mod report;
mod steps;
pub use kind::BenchKind;
use report::{print_profile, print_report};
use steps::{steps_since, StepCounts};

/// Flags of `pagoda bench`: the model benchmark, or one of the benchmark subcommands.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct BenchArgs {
    /// Another benchmark instead of the model's prefill and decode.
    #[command(subcommand)]
    pub kind: Option<BenchKind>,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt lengths to measure prefill at (comma-separated; 0 skips prefill).
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "128,512"
    )]
    pub prompt_lengths: Vec<usize>,
    /// Tokens to decode per run (0 skips decode).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub decode_tokens: usize,
    /// Tokens already in each sequence's KV cache when the decode test starts (its context
    /// depth; the prefill that puts them there is not timed).
    #[arg(
        short = 'd',
        long = "n-depth",
        value_delimiter = ',',
        default_value = "0"
    )]
    pub depth: Vec<usize>,
    /// Sequences decoding together (batched decode over the CSR page table).
    #[arg(
        short = 'b',
        long = "batch",
        value_delimiter = ',',
        default_value = "1"
    )]
    pub batch: Vec<usize>,
    /// Repetitions of every test (after one untimed run of the first prefill and the first
    /// decode test; `--no-warmup` skips it).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub repetitions: usize,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Benchmark random weights of a built-in architecture (llama-3.1-8b, qwen2.5-7b,
    /// smollm2-135m, qwen3-30b-a3b, mixtral-8x7b, qwen3-moe-tiny, mixtral-tiny, deepseek-v2-lite,
    /// deepseek-v2-tiny, deepseek-v3-tiny, deepseek-v32-tiny) or of a
    /// config.json instead of a model file (no tokenizer needed). A `:fp8` suffix
    /// (`llama-3.1-8b:fp8`) makes the dense projections FP8 (e4m3) with a factor per row, as
    /// a per-channel FP8 checkpoint: kept so on CUDA with PAGODA_CUDA_FP8_WEIGHTS=on, else
    /// decoded at load to the same values.
    #[arg(long, value_name = "ARCH[:fp8]|CONFIG[:fp8]")]
    pub random_weights: Option<String>,
    /// Decode tests: every sequence of a batch shares its first `depth` tokens (one
    /// sequence prefills them, the others reuse its pages through the prefix cache), as a
    /// batch behind one long system prompt.
    #[arg(long)]
    pub shared_prefix: bool,
    /// Decode tests sample with temperature 1 and this top-p (seeded) instead of greedily.
    #[arg(long, value_name = "P")]
    pub top_p: Option<f32>,
    /// Also time decode steps in which every request carries K guesses that verification
    /// rejects (one list entry per K, e.g. `--verify 2,4,8`): the cost of a speculative
    /// verification step beside the plain step of the same batch. These tests' tok/s count
    /// one token per request and step, so their step_ms is the verification step's.
    #[arg(long, value_delimiter = ',', value_name = "K")]
    pub verify: Vec<usize>,
}

#[derive(Serialize)]
struct TestResult {
    test: String,
    tokens_per_second: Vec<f64>,
    median: f64,
    min: f64,
    max: f64,
    /// Timed forward steps per path (from the engine's counters: the proof of which path
    /// was measured).
    steps: StepCounts,
    /// Decode tests: milliseconds per step (batch / median tok/s), and the bytes one step
    /// must read (weights + the batch's KV at mid-run) divided by it.
    step_ms: Option<f64>,
    effective_gb_per_s: Option<f64>,
    /// The repetitions' spread when the fastest is more than 2x the slowest; else absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    disagreement: Option<String>,
}

#[derive(Serialize)]
struct Report {
    model: String,
    device: String,
    precision: &'static str,
    threads: usize,
    /// Bytes of FP8 (e4m3) codes the GPU keeps (`PAGODA_CUDA_FP8_WEIGHTS`; 0: none).
    fp8_weight_bytes: usize,
    attention: String,
    /// The KV pools' element types (`-ctk`/`-ctv`), e.g. `K f32, V f32`.
    kv_cache: String,
    /// The CPU matmul kernels (`PAGODA_CPU_KERNELS`) and the f32 kernel of 1-8 token matmuls
    /// (`PAGODA_CPU_F32_DECODE`) with the count of matmuls that ran on the eight-row form.
    cpu_kernels: String,
    f32_decode: String,
    f32_wide_matmuls: u64,
    /// Integer matmuls that ran on the NEON sets (`neon_dotprod`, `neon`; aarch64).
    neon_matmuls: u64,
    /// f32-activation matmuls that ran on the NEON f32 tiles (aarch64).
    neon_f32_matmuls: u64,
    /// Integer matmuls that ran on the AMX-INT8 tiles (`PAGODA_CPU_KERNELS=amx`).
    amx_matmuls: u64,
    /// The AMX prefill tiles (`PAGODA_CPU_AMX_PREFILL`) and the matmuls that ran on the
    /// AMX-BF16 ones.
    amx_prefill: &'static str,
    amx_bf16_matmuls: u64,
    /// Integer matmuls that quantized their activations to Q15 (`+q15_ffn_down`).
    q15_matmuls: u64,
    /// The register width of one-token integer matmuls (`PAGODA_CPU_INT_DECODE`) and the
    /// count of decode matmuls (or shared regions) that ran 16 rows per register.
    int_decode: String,
    int_wide_decodes: u64,
    /// The register width of integer prefills (`PAGODA_CPU_INT_PREFILL`) and the count of
    /// prefill matmuls that ran 16 rows per register.
    int_prefill: String,
    int_wide_prefills: u64,
    /// How far ahead the integer kernels prefetch the weights (`PAGODA_CPU_PREFETCH`, 0: off)
    /// and how many matmuls (or shared decode regions) ran with it.
    prefetch_bytes: usize,
    prefetched_matmuls: u64,
    /// The layout of 5- and 6-bit weights (`PAGODA_CPU_HIGH_BITS`) and how many integer
    /// matmuls (or shared decode regions) ran over bit planes.
    high_bits: String,
    plane_matmuls: u64,
    batch: usize,
    /// Whether the first prefill and decode tests each ran once untimed first.
    warmup: bool,
    load_before: String,
    load_after: String,
    results: Vec<TestResult>,
}

/// Runs `pagoda bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    match args.kind {
        Some(BenchKind::Serve(serve_args)) => return super::bench_serve::run(serve_args),
        Some(BenchKind::Sampling(s)) if s.device == SamplingDevice::Cuda => {
            return super::bench_sampling_gpu::run(&s)
        }
        Some(BenchKind::Sampling(s)) => return super::bench_sampling::run(s),
        Some(BenchKind::Attention(a)) if a.mla => return super::bench_attention_mla::run_args(&a),
        Some(BenchKind::Attention(a)) => return super::bench_attention::run(a),
        Some(BenchKind::Cascade(a)) => return super::bench_cascade::run(&a),
        Some(BenchKind::Sparse(a)) => return super::bench_sparse::run(&a),
        Some(BenchKind::Kernels(kernels_args)) => return super::bench_kernels::run(kernels_args),
        Some(BenchKind::Moe(m)) if m.moe_path == "quant" => return super::bench_moe_quant::run(&m),
        Some(BenchKind::Moe(moe_args)) => return super::bench_moe::run(moe_args),
        Some(BenchKind::QuantGemv(quant_args)) => return super::bench_quant_gemv::run(quant_args),
        None => {}
    }
    let max_batch = args.batch.iter().copied().max().unwrap_or(1);
    let max_depth = args.depth.iter().copied().max().unwrap_or(0);
    if args.repetitions == 0 || args.batch.contains(&0) {
        bail!("--repetitions and --batch must be at least 1");
    }
    if args.prompt_lengths.iter().all(|&l| l == 0) && args.decode_tokens == 0 {
        bail!("nothing to measure: give a prompt length (-p 128) or tokens to decode (-n 128)");
    }
    let load_before = load_average();
    let (backend, model_path, tokenizer) = match &args.random_weights {
        Some(spec) => {
            common::configure_threads(args.model.threads)?;
            let device = common::resolve_device(&args.model)?;
            let precision = WeightPrecision::F32;
            let started = std::time::Instant::now();
            let backend = load_random(spec, 1, LoadOptions { precision, device }, &mut |_, _| {})
                .map_err(anyhow::Error::msg)?;
            eprintln!(
                "random weights for {spec} on {} in {:.1}s{}",
                backend.device_name(),
                started.elapsed().as_secs_f64(),
                report::fp8_note(spec, &backend)
            );
            (backend, format!("random weights: {spec}"), None)
        }
        None => {
            let loaded = common::load(&args.model)?;
            let path = loaded.source.path().display().to_string();
            (loaded.model, path, Some(loaded.tokenizer))
        }
    };
    let (device, fp8_weight_bytes) = (backend.device_name(), backend.fp8_weight_bytes());
    let vocab = backend.config().vocab_size;
    let kv_token_bytes = backend.kv_page_bytes(1, common::kv_cache_types()) as f64;
    let kv_cache = backend.kv_cache_name(common::kv_cache_types());
    let longest_prompt = args.prompt_lengths.iter().copied().max().unwrap_or(0);
    let base_need = longest_prompt.max(max_depth + 1) + args.decode_tokens + 1;
    // Decode tests also hold the tokens the first sequences decode while the last prefill.
    let slack = decode_slack(max_batch, max_depth, common::MAX_BATCH_TOKENS);
    let decode_need = if args.decode_tokens > 0 {
        max_depth + 1 + args.decode_tokens + slack + 1
    } else {
        0
    };
    let needed = base_need.max(decode_need);
    let model_max = backend.config().max_position_embeddings;
    if needed > model_max {
        if needed == base_need {
            bail!(
                "the longest test needs a context of {needed} tokens (prompt {longest_prompt} + {} decoded + 1), \
                 more than the model's {model_max}; lower -p, -d or -n",
                args.decode_tokens
            );
        }
        bail!(
            "the decode tests need a context of {needed} tokens (depth {max_depth} + 1 + {} decoded + {slack} \
             decoded by early sequences while the batch of {max_batch} prefills + 1), more than the model's \
             {model_max}; lower -d, -b or -n",
            args.decode_tokens
        );
    }
    let ctx = match args.model.ctx_size {
        Some(requested) => {
            let ctx = common::checked_context_size(Some(requested), model_max)?;
            if ctx < needed {
                bail!("--ctx-size {ctx} is too small for the longest test, which needs {needed} tokens; raise -c or lower -p/-n");
            }
            ctx
        }
        None => needed.max(16).min(model_max),
    };
    let decode_params = match args.top_p {
        None => SamplingParams::greedy(),
        Some(p) if p > 0.0 && p <= 1.0 => SamplingParams {
            top_p: p,
            seed: Some(42),
            ..SamplingParams::unfiltered(1.0)
        },
        Some(p) => bail!("--top-p {p} is outside (0, 1]"),
    };
    // The weight bytes a decode step of each batch size reads (a mixture-of-experts model
    // leaves its unrouted experts unread).
    let step_weight_bytes: std::collections::BTreeMap<usize, f64> = args
        .batch
        .iter()
        .map(|&batch| (batch, backend.step_weight_bytes(batch)))
        .collect();
    let mut engine = common::engine(backend, &args.model, ctx, max_batch, tokenizer.as_ref())?;
    let warmup = !args.model.no_warmup;
    let mut results = Vec::new();
    // Timed runs count from 1; run 0 seeds the warm-up runs' prompts.
    let mut run_index = 0u64;

    let prefill_lengths: Vec<usize> = args
        .prompt_lengths
        .iter()
        .copied()
        .filter(|&l| l > 0)
        .collect();
    if let Some(&length) = prefill_lengths.first().filter(|_| warmup) {
        timed_prefill(&mut engine, &random_prompt(vocab, length, 0))?;
    }
    for &length in &prefill_lengths {
        let mut rates = Vec::new();
        let before = engine.counters().clone();
        pagoda_ops::profile::reset();
        for repetition in 1..=args.repetitions {
            run_index += 1;
            let seconds = timed_prefill(&mut engine, &random_prompt(vocab, length, run_index))?;
            rates.push(length as f64 / seconds);
            progress(&format!("pp{length}"), repetition, args.repetitions, &rates);
        }
        let steps = steps_since(&engine, &before);
        print_profile(&format!("pp{length}"), args.repetitions);
        results.push(summarize(format!("pp{length}"), rates, steps, None)?);
    }
    let guesses: Vec<usize> = std::iter::once(0)
        .chain(args.verify.iter().copied())
        .collect();
    let decode_tests: Vec<(usize, usize, usize)> = if args.decode_tokens > 0 {
        args.depth
            .iter()
            .flat_map(|&depth| args.batch.iter().map(move |&batch| (depth, batch)))
            .flat_map(|(depth, batch)| guesses.iter().map(move |&k| (depth, batch, k)))
            .collect()
    } else {
        Vec::new()
    };
    if args.verify.contains(&0) {
        bail!("--verify takes guesses per request of at least 1 (plain steps always run)");
    }
    let decode_shape = |(depth, batch, guesses)| DecodeShape {
        per_step: guesses > 0,
        vocab,
        batch,
        depth,
        tokens: args.decode_tokens,
        shared_prefix: args.shared_prefix,
    };
    if let Some(&first) = decode_tests.first().filter(|_| warmup) {
        timed_decode(&mut engine, decode_shape(first), 0, decode_params)?;
    }
    for (depth, batch, guesses) in decode_tests {
        if !args.verify.is_empty() {
            // Plain steps (no drafts at any batch), or K rejected guesses per request.
            engine.set_proposer(Box::new(FixedProposer { vocab }));
            let max_batch = if guesses > 0 { usize::MAX } else { 0 };
            engine.set_speculation_limits(guesses.max(1), max_batch, false);
        }
        let mut name = format!("tg{}", args.decode_tokens);
        if depth > 0 {
            name += &format!(" @ d{depth}");
        }
        if batch > 1 {
            name += &format!(" x{batch}");
            if args.shared_prefix {
                name += " shared";
            }
        }
        if let Some(p) = args.top_p {
            name += &format!(" top-p {p}");
        }
        if guesses > 0 {
            name += &format!(" verify {guesses}");
        }
        let mut rates = Vec::new();
        let mut steps = StepCounts::default();
        pagoda_ops::profile::reset();
        for repetition in 1..=args.repetitions {
            run_index += 1;
            let (tokens, seconds, counts) = timed_decode(
                &mut engine,
                decode_shape((depth, batch, guesses)),
                run_index,
                decode_params,
            )?;
            rates.push(tokens as f64 / seconds);
            steps += counts;
            progress(&name, repetition, args.repetitions, &rates);
        }
        print_profile(&name, args.repetitions);
        let step_bytes = step_weight_bytes[&batch]
            + (batch * (depth + args.decode_tokens / 2)) as f64 * kv_token_bytes;
        results.push(summarize(name, rates, steps, Some((batch, step_bytes)))?);
    }
    let report = Report {
        model: model_path,
        device,
        precision: if args.model.exact {
            "exact (f32)"
        } else {
            "as stored"
        },
        threads: rayon::current_num_threads(),
        fp8_weight_bytes,
        attention: common::policy_name(engine.config().attention).to_string(),
        kv_cache,
        cpu_kernels: pagoda_ops::linear::cpu_kernels_name().to_string(),
        f32_decode: pagoda_ops::linear::cpu::f32_decode::F32Decode::selected()
            .name()
            .to_string(),
        f32_wide_matmuls: pagoda_ops::linear::cpu::f32_decode::wide_matmul_count(),
        neon_matmuls: pagoda_ops::linear::cpu::int_dot::neon_matmul_count(),
        neon_f32_matmuls: pagoda_ops::linear::cpu::f32_tile::neon_matmul_count(),
        amx_matmuls: pagoda_ops::linear::cpu::amx::hardware_matmul_count(),
        amx_prefill: pagoda_ops::linear::cpu::amx::bf16::AmxPrefill::selected().name(),
        amx_bf16_matmuls: pagoda_ops::linear::cpu::amx::bf16::matmul_count(),
        q15_matmuls: pagoda_ops::linear::cpu::int_matmul::q15_matmul_count(),
        int_decode: pagoda_ops::linear::cpu::interleaved::IntDecode::selected()
            .name()
            .to_string(),
        int_wide_decodes: pagoda_ops::linear::cpu::interleaved::wide_decode_count(),
        int_prefill: pagoda_ops::linear::cpu::interleaved::IntPrefill::selected()
            .name()
            .to_string(),
        int_wide_prefills: pagoda_ops::linear::cpu::interleaved::wide_prefill_count(),
        prefetch_bytes: pagoda_ops::linear::cpu::prefetch::distance(),
        prefetched_matmuls: pagoda_ops::linear::cpu::prefetch::prefetched_matmul_count(),
        high_bits: pagoda_ops::linear::cpu::interleaved::planes::HighBits::selected()
            .name()
            .to_string(),
        plane_matmuls: pagoda_ops::linear::cpu::interleaved::planes::plane_matmul_count(),
        batch: max_batch,
        warmup,
        load_before,
        load_after: load_average(),
        results,
    };
    print_report(&report, args.json)?;
    if !args.json {
        for r in report.results.iter() {
            if let Some(line) = &r.disagreement {
                println!(
                    "warning: {}: repetitions differ by more than 2x: {line}",
                    r.test
                );
            }
        }
    }
    Ok(())
}

/// Median and spread of `rates` (one per repetition); for decode tests
/// `decode = (batch, bytes read per step)` adds the step time and the effective read rate.
fn summarize(
    test: String,
    rates: Vec<f64>,
    steps: StepCounts,
    decode: Option<(usize, f64)>,
) -> Result<TestResult> {
    let Some(Summary { median, min, max }) = Summary::of(&rates) else {
        bail!("{test}: no repetitions to summarize");
    };
    let step_seconds = decode.map(|(batch, _)| batch as f64 / median);
    Ok(TestResult {
        disagreement: stats::disagreement("tokens_per_second", &rates),
        test,
        median,
        min,
        max,
        tokens_per_second: rates,
        steps,
        step_ms: step_seconds.map(|s| s * 1e3),
        effective_gb_per_s: decode
            .zip(step_seconds)
            .map(|((_, bytes), seconds)| bytes / seconds / 1e9),
    })
}

/// Seconds to prefill `prompt` (until its first token is sampled).
fn timed_prefill(engine: &mut Engine, prompt: &[u32]) -> Result<f64> {
    engine.add_request(
        prompt.to_vec(),
        SamplingParams::greedy(),
        1,
        Vec::new(),
        false,
    )?;
    let started = Instant::now();
    while engine.num_running() > 0 {
        engine.step()?;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// One decode measurement's shape: `batch` sequences of `depth` context tokens (sharing
/// them when `shared_prefix`) over a `vocab`-token vocabulary, timed for `tokens` steps.
#[derive(Clone, Copy)]
struct DecodeShape {
    vocab: usize,
    batch: usize,
    depth: usize,
    tokens: usize,
    shared_prefix: bool,
    /// Count one token per request and step (`--verify` tests), not the tokens emitted.
    per_step: bool,
}

/// Decode throughput of `batch` sequences with `depth` tokens of context each: returns the
/// tokens sampled and the seconds taken once every sequence has finished its prefill (the
/// prefill steps are not timed).
fn timed_decode(
    engine: &mut Engine,
    shape: DecodeShape,
    run: u64,
    params: SamplingParams,
) -> Result<(usize, f64, StepCounts)> {
    let DecodeShape {
        vocab,
        batch,
        depth,
        tokens,
        shared_prefix,
        per_step,
    } = shape;
    // Sequences that finish their prefill early decode while the others still prefill;
    // the slack keeps every sequence running until `tokens` full-batch steps are timed.
    let slack = decode_slack(batch, depth, engine.config().max_batch_tokens);
    let hits_before = engine.counters().prefix_hit_tokens;
    let mut ids = Vec::with_capacity(batch);
    let mut started_sequences = std::collections::HashSet::new();
    let shared = random_prompt(vocab, depth, run * 1000 + 999);
    for b in 0..batch {
        let mut prompt = random_prompt(vocab, depth + 1, run * 1000 + b as u64);
        if shared_prefix {
            prompt[..depth].copy_from_slice(&shared);
        }
        ids.push(engine.add_request(prompt, params, tokens + slack, Vec::new(), false)?);
        if shared_prefix && b == 0 {
            // The first sequence prefills the prefix; the others find it in the cache.
            while started_sequences.is_empty() && engine.num_running() > 0 {
                for event in engine.step()? {
                    started_sequences.insert(event.request);
                }
            }
        }
    }
    // Prefill until every sequence has sampled its first token.
    while started_sequences.len() < batch && engine.num_running() > 0 {
        for event in engine.step()? {
            started_sequences.insert(event.request);
        }
    }
    // Time `tokens` steps in which every sequence decodes together.
    let before = engine.counters().clone();
    let started = Instant::now();
    // Accepted guesses emit more than one token per request (a speculating engine reaches
    // the tokens in fewer steps); `--verify` tests count one per request and step, so that
    // their step_ms is the verification step's.
    let speculating = engine.speculating() && !per_step;
    let mut sampled = 0;
    for _ in 0..tokens {
        let events = engine.step()?.len();
        if events < batch && !speculating {
            bail!("a decode step of the {batch}-sequence batch sampled {events} tokens");
        }
        sampled += if per_step { batch } else { events };
        if speculating && sampled >= tokens * batch {
            break;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let mut steps = steps_since(engine, &before);
    steps.prefix_hit_tokens = engine.counters().prefix_hit_tokens - hits_before;
    for id in ids {
        engine.cancel(id);
    }
    Ok((sampled, seconds, steps))
}

/// Extra tokens per sequence so none finishes before the batch decodes together: at most
/// one per step of the batch's prefill, whose steps also carry up to `batch` decode tokens.
fn decode_slack(batch: usize, depth: usize, max_batch_tokens: usize) -> usize {
    let prefill_per_step = max_batch_tokens.saturating_sub(batch).max(1);
    (batch * (depth + 1)).div_ceil(prefill_per_step) + 2
}

/// Deterministic pseudo-random ordinary token ids (ids below 256 are avoided: they hold the
/// special and byte tokens in common vocabularies).
fn random_prompt(vocab: usize, length: usize, seed: u64) -> Vec<u32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let low = 256.min(vocab.saturating_sub(1));
    (0..length)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (low + (state as usize) % (vocab - low)) as u32
        })
        .collect()
}

/// One progress line per repetition on stderr (target `pagoda_progress`, shown by default):
/// a long bench is never silent until its table.
fn progress(test: &str, repetition: usize, repetitions: usize, rates: &[f64]) {
    let last = rates.last().copied().unwrap_or(0.0);
    tracing::info!(
        target: "pagoda_progress",
        "{test}: repetition {repetition}/{repetitions}: {last:.1} tok/s"
    );
}
