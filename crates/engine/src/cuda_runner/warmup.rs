//! The warm-up a CUDA runner does before the server says it is ready, so the first request
//! runs as fast as the tenth: (1) compile, or read from the disk cache, every kernel the
//! model can launch ([`ops::model_specializations`]) on every core; (2) capture the decode
//! graph of every batch bucket; (3) run a small prefill and two decode steps whose rows take
//! every sampling path (greedy, temperature, top-k, top-p, min-p, all three; on the device
//! and through downloaded logits), which also creates the GEMM plans and the device
//! sampler's workspace, then a prefill of every piecewise bucket's size twice (its first
//! step runs eagerly, its second captures the pieces), so a serving step never pauses to
//! capture them either. The warm-up steps write only into pages no request holds yet and
//! are not counted as steps.

use std::time::Instant;

use pagoda_cuda::{CudaError, Prepared};
use pagoda_kv::{BlockPool, BlockTable, PageTable};
use pagoda_models::llama::ForwardBatch;
use pagoda_models::llama_cuda::HostFloat;
use pagoda_ops::cuda as ops;

use super::pieces::PIECE_BUCKET_TOKENS;
use super::{CudaRunner, Inner, SamplingRowParams, TypedRunner};

/// The warm-up's stages, in order (for progress lines and `/health`).
pub const WARMUP_STAGES: [&str; 3] = [
    "compiling CUDA kernels",
    "capturing CUDA decode graphs",
    "running warm-up steps",
];

/// What the warm-up did.
#[derive(Clone, Debug, Default)]
pub struct WarmupReport {
    /// The kernels compiled or read from the disk cache.
    pub kernels: Prepared,
    /// Decode graphs captured.
    pub graphs: usize,
    /// Warm-up steps run (0 when the cache is too small for them).
    pub steps: usize,
    /// Piecewise token buckets whose graphs were captured.
    pub piece_buckets: usize,
    /// Seconds of each stage, in [`WARMUP_STAGES`] order.
    pub stage_seconds: [f64; 3],
}

/// The sampling rows of the warm-up steps: every path of the device sampler.
fn warmup_rows() -> Vec<SamplingRowParams> {
    let row = |temperature, top_k, top_p, min_p| {
        SamplingRowParams::new(temperature, top_k, top_p, min_p, 7, 0)
            .expect("the warm-up's sampling rows are valid")
    };
    vec![
        SamplingRowParams::greedy(),
        row(0.8, 0, 1.0, 0.0),
        row(0.8, 40, 1.0, 0.0),
        row(0.8, 0, 0.9, 0.0),
        row(0.8, 0, 1.0, 0.05),
        row(0.8, 40, 0.9, 0.05),
    ]
}

impl CudaRunner {
    /// Runs the warm-up (see the module docs); `progress` hears each stage's index (into
    /// [`WARMUP_STAGES`]) as it starts. The cache keeps its contents: the steps write only
    /// into pages no request holds yet.
    pub fn warm_up(&mut self, progress: &mut dyn FnMut(usize)) -> Result<WarmupReport, CudaError> {
        match &mut self.inner {
            Inner::Bf16(runner) => runner.warm_up(progress),
            Inner::F32(runner) => runner.warm_up(progress),
        }
    }
}

impl<T: HostFloat> TypedRunner<T> {
    fn warm_up(&mut self, progress: &mut dyn FnMut(usize)) -> Result<WarmupReport, CudaError> {
        let mut report = WarmupReport::default();
        let config = self.model.config().clone();
        let gpu = self.model.gpu().clone();

        progress(0);
        let started = Instant::now();
        let specs = ops::model_specializations(T::DTYPE, config.head_dim, config.group_size());
        let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
        report.kernels = gpu.prepare_all(&specs, threads)?;
        if !report.kernels.failed.is_empty() {
            // Paths with a fallback (the tensor-core prefill without the CUDA crt headers)
            // never launch these; any other would fail the same way at its first launch.
            tracing::info!(
                "warm-up: {} kernels did not compile (their paths fall back or are unused), \
                 e.g. {}",
                report.kernels.failed.len(),
                report.kernels.failed[0]
            );
        }
        report.stage_seconds[0] = started.elapsed().as_secs_f64();

        progress(1);
        let started = Instant::now();
        report.graphs = self.capture_decode_graphs()?;
        report.stage_seconds[1] = started.elapsed().as_secs_f64();

        progress(2);
        let started = Instant::now();
        let counted = self.counters.clone();
        report.steps = self.warmup_steps();
        report.piece_buckets = self.warmup_pieces();
        // The warm-up's steps are not the server's: only graphs and kernel loads stay counted.
        let (graphs, pieces) = (
            self.counters.cuda_graphs_captured,
            self.counters.cuda_piece_graphs_captured,
        );
        self.counters = counted;
        self.counters.cuda_graphs_captured = graphs;
        self.counters.cuda_piece_graphs_captured = pieces;
        self.count_kernel_loads();
        report.stage_seconds[2] = started.elapsed().as_secs_f64();
        Ok(report)
    }

    /// A prefill of up to six requests, then two decode steps, each row sampled with a
    /// different path of [`warmup_rows`]; the first two steps sample on the device, the
    /// last downloads its logits. Returns the steps run (0 if the cache cannot hold them;
    /// an error is logged, not returned: a warm-up step that fails would fail a request the
    /// same way, and the server should still come up to report it).
    fn warmup_steps(&mut self) -> usize {
        let Some(options) = self.cache.as_ref().map(|cache| cache.options) else {
            return 0;
        };
        let rows = warmup_rows();
        let requests = rows.len().min(options.max_batch_requests);
        let page_size = options.page_size;
        // Prompt lengths: one spans a page boundary; the rest are short.
        let lengths: Vec<usize> = (0..requests)
            .map(|r| if r == 0 { page_size + 3 } else { 1 + r })
            .collect();
        let prefill_tokens: usize = lengths.iter().sum();
        let pages_needed: usize = lengths.iter().map(|&l| (l + 2).div_ceil(page_size)).sum();
        if requests == 0
            || prefill_tokens > options.max_batch_tokens
            || pages_needed > options.num_pages
        {
            tracing::info!("warm-up: the KV cache is too small for warm-up steps; skipped");
            return 0;
        }
        let Ok(mut pool) = BlockPool::new(options.num_pages, page_size) else {
            return 0;
        };
        let vocab = self.model.config().vocab_size as u32;
        let mut tables: Vec<BlockTable> = (0..requests).map(|_| BlockTable::new()).collect();
        let mut steps = 0;
        for step in 0..3 {
            let feed: Vec<usize> = if step == 0 {
                lengths.clone()
            } else {
                vec![1; requests]
            };
            match self.warmup_step(&mut pool, &mut tables, &feed, vocab, &rows, step) {
                Ok(()) => steps += 1,
                Err(error) => {
                    tracing::warn!("warm-up step {step} failed: {error}");
                    break;
                }
            }
        }
        steps
    }

    fn warmup_step(
        &mut self,
        pool: &mut BlockPool,
        tables: &mut [BlockTable],
        feed: &[usize],
        vocab: u32,
        rows: &[SamplingRowParams],
        step: usize,
    ) -> Result<(), CudaError> {
        let (mut tokens, mut positions, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        let (mut qo_indptr, mut logits_for) = (vec![0u32], Vec::new());
        for (table, &count) in tables.iter_mut().zip(feed) {
            let start = table.num_tokens();
            let new_slots = table
                .append_slots(pool, count)
                .map_err(|error| CudaError::invalid(format!("warm-up pages: {error}")))?;
            slots.extend(new_slots);
            for position in start..start + count {
                tokens.push((position as u32 * 7 + 1) % vocab);
                positions.push(position as u32);
            }
            qo_indptr.push(tokens.len() as u32);
            logits_for.push(tokens.len() - 1);
        }
        let table_refs: Vec<&BlockTable> = tables.iter().collect();
        let page_table = PageTable::from_block_tables(&table_refs, pool)
            .map_err(|error| CudaError::invalid(format!("warm-up page table: {error}")))?;
        let batch = ForwardBatch {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            qo_indptr: &qo_indptr,
            page_table: &page_table,
            logits_for: &logits_for,
            sparse: &[],
        };
        if step == 2 {
            let Some(mut cache) = self.cache.take() else {
                return Ok(());
            };
            let result = self.forward_in(&mut cache, &batch, super::sampling::Output::Logits);
            self.cache = Some(cache);
            return result.map(|_| ());
        }
        let rows: Vec<Option<SamplingRowParams>> = rows
            .iter()
            .take(feed.len())
            .map(|row| Some(row.with_step(step as u64)))
            .collect();
        self.forward_sampled(&batch, &rows, None).map(|_| ())
    }
    /// Captures the piecewise graphs of every token bucket up to
    /// `PAGODA_CUDA_PIECEWISE_TOKENS`: a one-request prefill of the bucket's size, run twice
    /// (eager, then captured) into pages no request holds. Returns the buckets captured.
    fn warmup_pieces(&mut self) -> usize {
        let Some(options) = self.cache.as_ref().map(|cache| cache.options) else {
            return 0;
        };
        let kernels = options.kernels;
        // A latent attention model's prefill steps run eagerly (no pieces).
        if !options.cuda_graphs || kernels.deterministic || self.model.config().mla.is_some() {
            return 0;
        }
        let started = Instant::now();
        let limit = kernels.piecewise_tokens.min(options.max_batch_tokens);
        let buckets = (1..)
            .map(|i| i * PIECE_BUCKET_TOKENS)
            .take_while(|&bucket| bucket <= limit);
        let vocab = self.model.config().vocab_size as u32;
        let mut captured = 0;
        for bucket in buckets {
            let Ok(mut pool) = BlockPool::new(options.num_pages, options.page_size) else {
                break;
            };
            if bucket.div_ceil(options.page_size) > options.num_pages {
                break;
            }
            let mut table = BlockTable::new();
            let Ok(slots) = table.append_slots(&mut pool, bucket) else {
                break;
            };
            let Ok(page_table) = PageTable::from_block_tables(&[&table], &pool) else {
                break;
            };
            let tokens: Vec<u32> = (0..bucket as u32).map(|p| (p * 7 + 1) % vocab).collect();
            let positions: Vec<u32> = (0..bucket as u32).collect();
            let batch = ForwardBatch {
                tokens: &tokens,
                positions: &positions,
                slots: &slots,
                qo_indptr: &[0, bucket as u32],
                page_table: &page_table,
                logits_for: &[bucket - 1],
                sparse: &[],
            };
            let Some(mut cache) = self.cache.take() else {
                return captured;
            };
            let before = self.counters.cuda_piece_graphs_captured;
            let mut outcome = Ok(());
            for _ in 0..2 {
                outcome = self
                    .forward_in(&mut cache, &batch, super::sampling::Output::Logits)
                    .map(|_| ());
                if outcome.is_err() {
                    break;
                }
            }
            self.cache = Some(cache);
            if let Err(error) = outcome {
                tracing::warn!("warm-up: the {bucket}-token piecewise step failed: {error}");
                break;
            }
            captured += usize::from(self.counters.cuda_piece_graphs_captured > before);
        }
        if captured > 0 {
            tracing::info!(
                "CUDA graphs: captured the pieces of {captured} prefill buckets (up to {limit} \
                 tokens) in {:.2} s",
                started.elapsed().as_secs_f64()
            );
        }
        captured
    }
}
