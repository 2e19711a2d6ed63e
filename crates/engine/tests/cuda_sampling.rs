//! `CudaModel::forward_sampled` (tokens drawn on the GPU, only ids downloaded) against the
//! CPU `FusedSampler` (the oracle) on the same logits, seeds and steps; on the GPU machine
//! only.
//!
//! Run there with `--include-ignored` and a binary built with `--features cuda`; elsewhere
//! every test shows as ignored. Two identical random-weight models run the same ragged
//! schedule (prefill chunks mixed with decode tokens, then batched decode through the graph
//! buckets): model A with `forward` (the logits, fed to the CPU samplers), model B with
//! `forward_sampled`. Every device-drawn token must equal the CPU fused sampler's token at the
//! same `(seed, step)`, for greedy, unfiltered (Gumbel-max), top-p, top-k + top-p, min-p and
//! the default chain. A mixed batch leaves some rows on the host: their downloaded logits
//! must equal model A's row bit for bit, and the requests' streams continue across paths.

mod common;

use common::gpu;
use std::sync::Arc;

use pagoda_cuda::Gpu;
use pagoda_engine::cuda_runner::{
    CudaCacheOptions, CudaModel, CudaRunner, DType, SampledRow, SamplingRowParams,
};
use pagoda_kv::{BlockPool, BlockTable, PageTable, Slot};
use pagoda_models::config::ModelConfig;
use pagoda_models::llama::ForwardBatch;
use pagoda_models::random::{preset, RandomWeights};
use pagoda_ops::sampling::{FusedSampler, SamplingParams};

const PAGE_SIZE: usize = 16;
const NUM_PAGES: usize = 96;
const PROMPT_LEN: usize = 40;

/// A small llama with a 32000-token vocabulary (the Gumbel kernels split each row).
fn config() -> ModelConfig {
    ModelConfig {
        num_layers: 2,
        vocab_size: 32000,
        ..preset("smollm2-135m").unwrap()
    }
}

fn load(gpu: &Arc<Gpu>, weights: &RandomWeights, dtype: DType, graphs: bool) -> CudaRunner {
    let model = CudaModel::load(config(), weights, gpu.clone(), dtype, &mut |_, _| {}).unwrap();
    CudaRunner::new(
        model,
        CudaCacheOptions {
            num_pages: NUM_PAGES,
            page_size: PAGE_SIZE,
            max_batch_tokens: 256,
            max_batch_requests: 8,
            max_context: NUM_PAGES * PAGE_SIZE,
            cuda_graphs: graphs,
            paged_decode: Default::default(),
            kernels: Default::default(),
        },
    )
    .unwrap()
}

/// Which sampling path a request's parameters take.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Greedy,
    Unfiltered,
    Filtered,
}

/// One request per chain: greedy, plain sampling at two temperatures, top-p, top-k + top-p,
/// min-p, and the defaults (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8).
fn requests() -> Vec<(SamplingParams, Kind)> {
    let seeded = |params: SamplingParams, index: u64| SamplingParams {
        seed: Some(0x9e37_79b9_0000_0000 + 1000 * index),
        ..params
    };
    let chains = [
        (SamplingParams::greedy(), Kind::Greedy),
        (SamplingParams::unfiltered(0.8), Kind::Unfiltered),
        (SamplingParams::unfiltered(1.5), Kind::Unfiltered),
        (
            SamplingParams {
                top_p: 0.9,
                ..SamplingParams::unfiltered(1.0)
            },
            Kind::Filtered,
        ),
        (
            SamplingParams {
                top_k: 50,
                top_p: 0.9,
                ..SamplingParams::unfiltered(0.7)
            },
            Kind::Filtered,
        ),
        (
            SamplingParams {
                min_p: 0.05,
                ..SamplingParams::unfiltered(1.0)
            },
            Kind::Filtered,
        ),
        (SamplingParams::default(), Kind::Filtered),
    ];
    chains
        .into_iter()
        .enumerate()
        .map(|(index, (params, kind))| (seeded(params, index as u64), kind))
        .collect()
}

/// Ragged prefill chunks (some requests sampling nothing yet), a mixed step, then decode
/// steps of every batch size down to 1 (graph buckets 8, 4, 2, 1).
fn schedule() -> Vec<Vec<usize>> {
    let mut steps = vec![
        vec![17, 40, 0, 5, 12, 9, 3],
        vec![23, 1, 40, 35, 28, 31, 37],
        vec![1, 1, 1, 1, 1, 1, 1],
    ];
    steps.extend((0..6).map(|_| vec![1; 7]));
    steps.extend([
        vec![1, 0, 1, 1, 0, 1, 0],
        vec![0, 1, 0, 0, 1, 0, 0],
        vec![1, 1, 1, 1, 1, 1, 1],
    ]);
    steps
}

/// Builds the steps of `schedule` over fixed prompts (tokens past the prompt repeat it).
/// Returns, per step, the batch inputs and the requests that sample a token (their last
/// token reached the end of the prompt).
struct Driver {
    pool: BlockPool,
    tables: Vec<BlockTable>,
    fed: Vec<usize>,
    prompts: Vec<Vec<u32>>,
}

struct Step {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<Slot>,
    qo_indptr: Vec<u32>,
    logits_for: Vec<usize>,
    page_table: PageTable,
    /// The request of each logits row.
    sampling: Vec<usize>,
}

impl Driver {
    fn new(num_requests: usize, vocab: usize) -> Driver {
        let mut pool = BlockPool::new(NUM_PAGES, PAGE_SIZE).unwrap();
        // Scatter the physical pages.
        for _ in 0..3 {
            pool.allocate().unwrap();
        }
        Driver {
            pool,
            tables: (0..num_requests).map(|_| BlockTable::new()).collect(),
            fed: vec![0; num_requests],
            prompts: (0..num_requests)
                .map(|r| {
                    (0..PROMPT_LEN)
                        .map(|i| ((i * 131 + r * 17 + 5) % vocab) as u32)
                        .collect()
                })
                .collect(),
        }
    }

    fn step(&mut self, counts: &[usize]) -> Step {
        let (mut tokens, mut positions, mut slots, mut qo_indptr, mut logits_for) =
            (vec![], vec![], vec![], vec![0u32], vec![]);
        let (mut active, mut sampling) = (Vec::new(), Vec::new());
        for (request, &count) in counts.iter().enumerate() {
            if count == 0 {
                continue;
            }
            slots.extend(
                self.tables[request]
                    .append_slots(&mut self.pool, count)
                    .unwrap(),
            );
            for i in 0..count {
                let position = self.fed[request] + i;
                let prompt = &self.prompts[request];
                tokens.push(prompt[position % prompt.len()]);
                positions.push(position as u32);
            }
            self.fed[request] += count;
            qo_indptr.push(tokens.len() as u32);
            active.push(request);
            // A request samples once its prompt is consumed.
            if self.fed[request] >= PROMPT_LEN {
                logits_for.push(tokens.len() - 1);
                sampling.push(request);
            }
        }
        let table_refs: Vec<&BlockTable> = active.iter().map(|&r| &self.tables[r]).collect();
        let page_table = PageTable::from_block_tables(&table_refs, &self.pool).unwrap();
        Step {
            tokens,
            positions,
            slots,
            qo_indptr,
            logits_for,
            page_table,
            sampling,
        }
    }
}

impl Step {
    fn batch(&self) -> ForwardBatch<'_> {
        ForwardBatch {
            tokens: &self.tokens,
            positions: &self.positions,
            slots: &self.slots,
            qo_indptr: &self.qo_indptr,
            page_table: &self.page_table,
            logits_for: &self.logits_for,
            sparse: &[],
        }
    }
}

/// The device record of the next draw of `sampler` (the step it would use itself).
fn device_params(sampler: &FusedSampler) -> SamplingRowParams {
    let p = sampler.params();
    SamplingRowParams::new(
        p.temperature,
        p.top_k as u32,
        p.top_p,
        p.min_p,
        sampler.seed(),
        sampler.step(),
    )
    .unwrap()
}

/// Runs the schedule on models A (`forward`) and B (`forward_sampled`, rows left on the host
/// where `host_row(step, request)`), checks every row, and returns (device rows, host rows)
/// and per-kind device row counts.
fn compare(
    gpu: &Arc<Gpu>,
    dtype: DType,
    graphs: bool,
    host_row: &dyn Fn(usize, usize) -> bool,
) -> (usize, usize) {
    let config = config();
    let vocab = config.vocab_size;
    let weights = RandomWeights::new(&config, 23, 4 << 30).unwrap();
    let mut model_a = load(gpu, &weights, dtype, graphs);
    let mut model_b = load(gpu, &weights, dtype, graphs);
    // After the warm-up, no step compiles or loads a kernel, and its steps are not counted.
    model_a.warm_up(&mut |_| {}).unwrap();
    let warmed = model_b.warm_up(&mut |_| {}).unwrap();
    assert_eq!(warmed.steps, 3, "{warmed:?}");
    assert_eq!(model_b.counters().steps_cuda_sampled, 0);
    assert_eq!(model_b.counters().steps_cuda_prefill_kernel, 0);
    let loaded = gpu.loaded_kernels();
    let requests = requests();
    let mut samplers: Vec<FusedSampler> = requests
        .iter()
        .map(|(params, _)| FusedSampler::new(*params).unwrap())
        .collect();
    let mut driver = Driver::new(requests.len(), vocab);
    let (mut device_rows, mut host_rows) = (0, 0);
    let mut by_kind = [0u64; 3];
    let mut sampled_steps = 0;
    for (step_index, counts) in schedule().iter().enumerate() {
        let step = driver.step(counts);
        let logits = model_a.forward(&step.batch()).unwrap();
        assert_eq!(logits.len(), step.sampling.len() * vocab);
        let rows: Vec<Option<SamplingRowParams>> = step
            .sampling
            .iter()
            .map(|&r| (!host_row(step_index, r)).then(|| device_params(&samplers[r])))
            .collect();
        let got = model_b.forward_sampled(&step.batch(), &rows).unwrap();
        sampled_steps += 1;
        assert_eq!(got.len(), rows.len(), "step {step_index}");
        for (row, (&request, result)) in step.sampling.iter().zip(&got).enumerate() {
            let expected_logits = &logits[row * vocab..(row + 1) * vocab];
            let history: &[u32] = &[];
            let context = format!(
                "{dtype} graphs {graphs}: step {step_index} row {row} request {request} ({:?})",
                requests[request]
            );
            match (result, rows[row]) {
                (SampledRow::Token(token), Some(params)) => {
                    assert_eq!(params.step(), samplers[request].step(), "{context}");
                    let expected = samplers[request].sample(expected_logits, history);
                    assert_eq!(*token, expected, "{context}: GPU vs CPU fused sampler");
                    device_rows += 1;
                    by_kind[requests[request].1 as usize] += 1;
                }
                (SampledRow::Logits(host), None) => {
                    assert_eq!(host.len(), vocab, "{context}");
                    let same = host
                        .iter()
                        .zip(expected_logits)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{context}: host row differs from forward's logits");
                    samplers[request].sample(host, history);
                    host_rows += 1;
                }
                (result, params) => panic!("{context}: {params:?} gave {result:?}"),
            }
        }
    }
    let counters = model_b.counters();
    eprintln!(
        "{dtype} graphs {graphs}: {device_rows} device rows, {host_rows} host rows; {counters:?}"
    );
    assert_eq!(counters.steps_cuda_sampled, sampled_steps);
    assert_eq!(counters.cuda_sampled_rows_device, device_rows as u64);
    assert_eq!(counters.cuda_sampled_rows_host, host_rows as u64);
    assert_eq!(counters.gpu_sampler_greedy, by_kind[Kind::Greedy as usize]);
    assert_eq!(
        counters.gpu_sampler_gumbel,
        by_kind[Kind::Unfiltered as usize]
    );
    assert_eq!(
        counters.gpu_sampler_rejection + counters.gpu_sampler_fallbacks,
        by_kind[Kind::Filtered as usize]
    );
    if graphs {
        assert!(counters.steps_cuda_graph > 0, "{counters:?}");
    }
    assert_eq!(model_a.counters().steps_cuda_sampled, 0);
    assert_eq!(
        gpu.loaded_kernels(),
        loaded,
        "{dtype} graphs {graphs}: a kernel was loaded after the warm-up"
    );
    (device_rows, host_rows)
}

#[test]
#[ignore = "needs a GPU"]
fn device_tokens_equal_the_cpu_fused_sampler() {
    let gpu = gpu();
    for (dtype, graphs) in [(DType::F32, true), (DType::BF16, false)] {
        let (device, host) = compare(&gpu, dtype, graphs, &|_, _| false);
        assert!(device > 60 && host == 0, "{device} / {host}");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn mixed_batches_download_the_host_rows() {
    let gpu = gpu();
    // Every third (step, request) pair stays on the host, so requests switch paths and the
    // batches mix device and host runs of several lengths.
    let (device, host) = compare(&gpu, DType::F32, true, &|step, request| {
        (step + request) % 3 == 0
    });
    assert!(device > 30 && host > 15, "{device} / {host}");
    // Every row on the host: no token comes back, the logits do.
    let (device, host) = compare(&gpu, DType::F32, false, &|_, _| true);
    assert!(device == 0 && host > 60, "{device} / {host}");
}

#[test]
#[ignore = "needs a GPU"]
fn bad_rows_are_refused_before_the_step_runs() {
    let gpu = gpu();
    let config = config();
    let weights = RandomWeights::new(&config, 5, 4 << 30).unwrap();
    let mut model = load(&gpu, &weights, DType::F32, true);
    let mut driver = Driver::new(2, config.vocab_size);
    let step = driver.step(&[PROMPT_LEN, PROMPT_LEN]);
    assert_eq!(step.sampling.len(), 2);
    let error = model
        .forward_sampled(&step.batch(), &[None])
        .expect_err("one row for two logits rows")
        .to_string();
    assert!(
        error.contains("1 sampling rows for 2 logits rows"),
        "{error}"
    );
    let bad = SamplingRowParams {
        top_p: 0.0,
        ..SamplingRowParams::greedy()
    };
    let error = model
        .forward_sampled(
            &step.batch(),
            &[Some(SamplingRowParams::greedy()), Some(bad)],
        )
        .expect_err("top_p 0 is outside the sampler's range")
        .to_string();
    assert!(
        error.contains("row 1") && error.contains("top_p"),
        "{error}"
    );
    assert_eq!(
        model.counters().steps_cuda_eager + model.counters().steps_cuda_graph,
        0
    );
    // The same step with valid rows runs.
    let rows = model
        .forward_sampled(&step.batch(), &[Some(SamplingRowParams::greedy()), None])
        .unwrap();
    assert!(rows[0].token().is_some() && rows[1].logits().is_some());
    assert!((rows[0].token().unwrap() as usize) < config.vocab_size);
}

/// Whether token `v` is allowed by the mask of (`step`, `request`): about one id in seven,
/// a different set per step and request.
fn allowed(v: usize, step: usize, request: usize) -> bool {
    (v.wrapping_mul(2_654_435_761) ^ (step * 31 + request * 7)).is_multiple_of(7)
}

fn packed_mask(vocab: usize, step: usize, request: usize) -> Vec<u32> {
    let mut words = vec![0u32; vocab.div_ceil(32)];
    for v in (0..vocab).filter(|&v| allowed(v, step, request)) {
        words[v / 32] |= 1 << (v % 32);
    }
    words
}

/// Structured output's masks on the device: rows given a packed token mask
/// (`forward_sampled_masked`) draw exactly the token the CPU fused sampler draws from the same
/// logits with the disallowed ids at `-inf` (whose masked draws are chi-square tested against
/// the renormalised distribution in `structured_sampling.rs`), for every sampling chain;
/// unmasked rows of the same batches are unaffected.
#[test]
#[ignore = "needs a GPU"]
fn masked_rows_draw_what_the_cpu_sampler_draws_from_masked_logits() {
    use pagoda_engine::cuda_runner::TokenMasks;
    let gpu = gpu();
    let config = config();
    let vocab = config.vocab_size;
    let weights = RandomWeights::new(&config, 29, 4 << 30).unwrap();
    for (dtype, graphs) in [(DType::F32, true), (DType::BF16, false)] {
        let mut model_a = load(&gpu, &weights, dtype, graphs);
        let mut model_b = load(&gpu, &weights, dtype, graphs);
        let requests = requests();
        let mut samplers: Vec<FusedSampler> = requests
            .iter()
            .map(|(params, _)| FusedSampler::new(*params).unwrap())
            .collect();
        let mut driver = Driver::new(requests.len(), vocab);
        let mut masked_rows = 0u64;
        for (step_index, counts) in schedule().iter().enumerate() {
            let step = driver.step(counts);
            let logits = model_a.forward(&step.batch()).unwrap();
            let rows: Vec<Option<SamplingRowParams>> = step
                .sampling
                .iter()
                .map(|&r| Some(device_params(&samplers[r])))
                .collect();
            // Every request but the last is constrained.
            let mut masks = TokenMasks {
                words: vocab.div_ceil(32),
                ..TokenMasks::default()
            };
            for (row, &request) in step.sampling.iter().enumerate() {
                if request + 1 < requests.len() {
                    masks.rows.push(row as u32);
                    masks.bits.extend(packed_mask(vocab, step_index, request));
                }
            }
            masked_rows += masks.rows.len() as u64;
            let source = || masks.clone();
            let got = model_b
                .forward_sampled_masked(&step.batch(), &rows, Some(&source))
                .unwrap();
            for (row, (&request, result)) in step.sampling.iter().zip(&got).enumerate() {
                let mut expected_logits = logits[row * vocab..(row + 1) * vocab].to_vec();
                let constrained = request + 1 < requests.len();
                if constrained {
                    for (v, logit) in expected_logits.iter_mut().enumerate() {
                        if !allowed(v, step_index, request) {
                            *logit = f32::NEG_INFINITY;
                        }
                    }
                }
                let expected = samplers[request].sample(&expected_logits, &[]);
                let context = format!(
                    "{dtype} graphs {graphs}: step {step_index} row {row} request {request} ({:?})",
                    requests[request]
                );
                let SampledRow::Token(token) = result else {
                    panic!("{context}: {result:?}");
                };
                assert_eq!(*token, expected, "{context}: GPU vs CPU on masked logits");
                if constrained {
                    assert!(allowed(*token as usize, step_index, request), "{context}");
                }
            }
        }
        assert!(masked_rows > 50, "{masked_rows}");
        assert_eq!(model_b.counters().cuda_masked_rows, masked_rows);
    }
}
