//! One forward step on the GPU, and the KV cache and step buffers it runs in.
//!
//! A step stages its inputs (token ids, positions, slots, the CSR page table, the rows that
//! need logits) in pinned host memory, uploads them asynchronously into fixed device
//! buffers, runs the layers, and downloads the logits: one synchronization per step.
//!
//! Decode steps (one new token per request, logits for every row) attend with the fused
//! split-KV paged decode, or the gather baseline (`decode_path`). With CUDA graphs on, they are
//! padded to a batch-size bucket and replayed from a graph captured once per bucket: every
//! count the kernels need is read on the device, padding rows have no pages and a slot of
//! -1; a latent attention (MLA) model's decode steps too (its split-KV decode's grid fixed
//! per bucket as the fused decode's), its other steps eagerly. Prefill steps run the ragged
//! prefill kernel, launched from the host; mixed steps (decode rows first, then chunks) split
//! their rows between the fused decode and the prefill kernel (`PAGODA_CUDA_MIXED_STEPS`).

use pagoda_cuda::{view, CudaError, DeviceRead, GraphCache};
use pagoda_models::llama::ForwardBatch;
use pagoda_models::llama_cuda::{Attention, HostFloat, StepBuffers, StepShape, VariantSource};
use pagoda_ops::cuda::{self as ops, PoolLayout};

use super::announce::announce;
use super::buckets::{graph_bucket, graph_buckets, graph_key, verify_bucket};
use super::latent::check_latent_pool;
use super::pieces::piece_bucket;
use super::sampling::Output;
use super::{CudaCacheOptions, GpuCache, Staging, TypedRunner};

/// How many of a step's requests, from the first, hold one query row each.
fn single_rows(qo_indptr: &[u32]) -> usize {
    qo_indptr
        .windows(2)
        .take_while(|pair| pair[1] - pair[0] == 1)
        .count()
}

impl<T: HostFloat> TypedRunner<T> {
    pub(super) fn prepare(&mut self, options: CudaCacheOptions) -> Result<(), CudaError> {
        let c = self.model.config();
        let layout = PoolLayout {
            num_pages: options.num_pages,
            page_size: options.page_size,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
        };
        layout.validate()?;
        if c.mla.is_some() {
            check_latent_pool(c, T::DTYPE, &layout, options.cuda_graphs)?;
        }
        // Free the old cache (and the graphs holding its addresses) before allocating.
        self.cache = None;
        let gpu = self.model.gpu().as_ref();
        gpu.set_gemm_batch_invariant(options.kernels.deterministic)?;
        if options.kernels.deterministic {
            static LOGGED: std::sync::Once = std::sync::Once::new();
            LOGGED.call_once(|| {
                tracing::info!(
                    "CUDA deterministic mode: batch-invariant GEMMs (one cuBLASLt algorithm per \
                     weight shape, split-K off) and every attention row on the per-token kernel \
                     (PAGODA_DETERMINISTIC / --deterministic)"
                )
            });
        }
        let quantized = self.model.largest_quantized();
        let mut buffers = StepBuffers::new(gpu, c, &options, &layout, quantized)?;
        buffers.quant.pair_matrices = self.model.quant_pair_matrices();
        if self.model.fp8_bytes() > 0 {
            let gemm = options.kernels.fp8_gemm && !options.kernels.deterministic;
            let choice = (gemm, options.kernels.fp8_gemv_rows);
            buffers
                .quant
                .keep_fp8(gpu, options.max_batch_tokens, choice)?;
        }
        let tokens = options.max_batch_tokens.max(1);
        let requests = options.max_batch_requests.max(1);
        let staging = Staging {
            words: gpu
                .alloc_pinned(3 * tokens + 4 * requests + 2 + buffers.scratch.page_indices.len())?,
            slots: gpu.alloc_pinned(tokens)?,
        };
        self.cache = Some(GpuCache {
            options,
            layout,
            buffers,
            staging,
            graphs: GraphCache::new(),
            pieces: Default::default(),
            sampler: None,
        });
        Ok(())
    }

    /// Captures the decode graph of every batch bucket not captured yet (as vLLM does at
    /// start-up; called by the warm-up), so serving never pauses to capture. Each capture
    /// first runs its step eagerly on padding rows only (no pages, slot -1): nothing is
    /// written to the KV cache. Returns the graphs captured now.
    pub(super) fn capture_decode_graphs(&mut self) -> Result<usize, CudaError> {
        let Some(mut cache) = self.cache.take() else {
            return Ok(0);
        };
        if !cache.options.cuda_graphs {
            self.cache = Some(cache);
            return Ok(0);
        }
        let captured_before = cache.graphs.len();
        let started = std::time::Instant::now();
        let gpu = self.model.gpu().clone();
        let sm_count = gpu.info().sm_count as usize;
        let limit = cache
            .options
            .max_batch_requests
            .min(cache.options.max_batch_tokens);
        let empty_table = pagoda_kv::PageTable {
            indptr: vec![0],
            ..Default::default()
        };
        let empty = ForwardBatch {
            tokens: &[],
            positions: &[],
            slots: &[],
            qo_indptr: &[0],
            page_table: &empty_table,
            logits_for: &[],
            sparse: &[],
        };
        let mut outcome = Ok(());
        for bucket in graph_buckets(limit) {
            let attention = self.decode_attention(&cache, bucket, 0, sm_count);
            let key = graph_key(bucket, bucket, &attention);
            if cache.graphs.contains(&key) {
                continue;
            }
            let shape = StepShape {
                num_tokens: bucket,
                num_requests: bucket,
                num_logits: bucket,
                attention,
                hidden_only: false,
            };
            outcome = self.stage(&mut cache, &empty, &shape).and_then(|_| {
                let GpuCache {
                    layout,
                    buffers,
                    graphs,
                    ..
                } = &mut cache;
                let this = &*self;
                graphs
                    .get_or_capture(&gpu, key, |gpu| {
                        this.model.run(gpu, buffers, layout, &shape)
                    })
                    .map(|_| ())
            });
            if outcome.is_err() {
                break;
            }
            self.counters.cuda_graphs_captured += 1;
        }
        let outcome = outcome.and_then(|()| gpu.synchronize());
        let captured = cache.graphs.len() - captured_before;
        tracing::info!(
            "CUDA graphs: captured {captured} decode buckets (up to {limit} requests) in {:.2} s",
            started.elapsed().as_secs_f64()
        );
        self.cache = Some(cache);
        outcome.map(|()| captured)
    }

    /// Mirrors the device's kernel loads (compiled, read from the disk cache) into the
    /// counters.
    pub(super) fn count_kernel_loads(&mut self) {
        let loads = self.model.gpu().kernel_sources();
        self.counters.cuda_kernels_compiled = loads.compiled as u64;
        self.counters.cuda_kernels_from_cache = loads.from_cache as u64;
    }

    /// The attention of a decode step of `requests` rows whose longest request has `context`
    /// tokens: fused when the cache has it (the variant the tuning table or the heuristic
    /// picks for the bucket), else the gather baseline with its split count; a latent
    /// attention model's split-KV MLA decode over the bucket's grid; in deterministic mode
    /// the prefill kernel, as for every other row.
    fn decode_attention(
        &self,
        cache: &GpuCache<T>,
        requests: usize,
        context: usize,
        sm_count: usize,
    ) -> Attention {
        if cache.options.kernels.deterministic {
            return Attention::Prefill;
        }
        if let Some(mla) = &cache.buffers.mla_decode {
            return Attention::Latent {
                grid_chunks: mla.grid_chunks(requests),
            };
        }
        match &cache.buffers.fused {
            Some(fused) => {
                let (variant, source) = fused.variant(requests, context);
                Attention::Fused {
                    grid_chunks: fused.grid_chunks(requests, &variant),
                    variant,
                    source,
                }
            }
            None => Attention::Gather {
                num_splits: ops::decode_splits(
                    requests,
                    self.model.config().num_kv_heads,
                    sm_count,
                ),
            },
        }
    }

    /// The attention of a step that is not all decode rows: a mixed step (one-token rows
    /// first, as the scheduler orders them, then chunks) splits them between the fused
    /// decode and the prefill kernel (`PAGODA_CUDA_MIXED_STEPS=split`); any other step, or
    /// a mixed one without the fused decode or in deterministic mode, runs the prefill
    /// kernel over every row.
    fn mixed_attention(
        &self,
        cache: &GpuCache<T>,
        batch: &ForwardBatch<'_>,
        sm_count: usize,
    ) -> Attention {
        let requests = batch.qo_indptr.len() - 1;
        let decode_rows = single_rows(batch.qo_indptr);
        let kernels = cache.options.kernels;
        if decode_rows == 0
            || decode_rows == requests
            || !kernels.mixed_split
            || kernels.deterministic
            || cache.buffers.fused.is_none()
        {
            return Attention::Prefill;
        }
        let context = batch.page_table.seq_lens[..decode_rows]
            .iter()
            .max()
            .map_or(0, |&l| l as usize);
        match self.decode_attention(cache, decode_rows, context, sm_count) {
            Attention::Fused {
                grid_chunks,
                variant,
                source,
            } => Attention::Mixed {
                decode_rows,
                grid_chunks,
                variant,
                source,
                grid_pages: 0,
            },
            _ => Attention::Prefill,
        }
    }

    pub(super) fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<Vec<f32>, CudaError> {
        self.forward_cached(batch, Output::Logits)
    }

    /// The final-normed hidden states of `batch.logits_for`'s rows, `[rows, hidden_size]`
    /// in f32 (embeddings): the step runs eagerly and stops before the LM head.
    pub(super) fn final_hidden(&mut self, batch: &ForwardBatch<'_>) -> Result<Vec<f32>, CudaError> {
        self.forward_cached(batch, Output::Hidden)
    }

    fn forward_cached(
        &mut self,
        batch: &ForwardBatch<'_>,
        output: Output<'_>,
    ) -> Result<Vec<f32>, CudaError> {
        let Some(mut cache) = self.cache.take() else {
            return Err(CudaError::invalid(
                "the KV cache is not allocated: call prepare first",
            ));
        };
        let result = self.forward_in(&mut cache, batch, output);
        self.cache = Some(cache);
        result
    }

    /// One step in `cache`, returning what `output` asks for: the logits rows; nothing, with
    /// the rows sampled on the device (see `sampling.rs`) into the request's `out`; or the
    /// rows' final hidden states.
    pub(super) fn forward_in(
        &mut self,
        cache: &mut GpuCache<T>,
        batch: &ForwardBatch<'_>,
        output: Output<'_>,
    ) -> Result<Vec<f32>, CudaError> {
        let hidden_only = matches!(output, Output::Hidden);
        let host_started = std::time::Instant::now();
        self.validate(cache, batch)?;
        let gpu = self.model.gpu().clone();
        let options = cache.options;
        let num_tokens = batch.tokens.len();
        let num_requests = batch.qo_indptr.len() - 1;
        let num_logits = batch.logits_for.len();
        let decode_rows = num_tokens == num_requests
            && batch
                .qo_indptr
                .iter()
                .enumerate()
                .all(|(i, &q)| q == i as u32);
        let latent = self.model.config().mla.is_some();
        let fits_decode = options.kernels.deterministic
            || cache.buffers.fused.is_some()
            || cache.buffers.mla_decode.is_some()
            || cache.buffers.decode.as_ref().is_some_and(|workspace| {
                batch.page_table.indices.len() <= workspace.capacity_pages()
            });
        let sm_count = gpu.info().sm_count as usize;
        let bucket = graph_bucket(
            num_requests,
            options.max_batch_requests.min(options.max_batch_tokens),
        );
        let graphs_on = options.cuda_graphs && !hidden_only && num_logits == num_tokens;
        let graph_rows = bucket.filter(|_| graphs_on && decode_rows && fits_decode);
        // A latent attention model's verification, prefill and mixed steps run eagerly.
        let verify_rows = (graphs_on && !decode_rows && !latent)
            .then(|| {
                verify_bucket(
                    batch.qo_indptr,
                    options.max_batch_requests,
                    options.max_batch_tokens,
                )
            })
            .flatten();
        let context = batch
            .page_table
            .seq_lens
            .iter()
            .max()
            .map_or(0, |&l| l as usize);
        // Prefill and mixed steps of a few tokens: piecewise graphs, padded to their bucket.
        let kernels = options.kernels;
        let decode_step = decode_rows && fits_decode;
        let piece_tokens = (options.cuda_graphs
            && !hidden_only
            && !kernels.deterministic
            && !decode_step
            && !latent
            && verify_rows.is_none()
            && num_tokens <= kernels.piecewise_tokens)
            .then(|| piece_bucket(num_tokens, options.max_batch_tokens));
        let mut shape = match (graph_rows, verify_rows) {
            (Some(padded), _) => StepShape {
                num_tokens: padded,
                num_requests: padded,
                num_logits: padded,
                attention: self.decode_attention(cache, padded, context, sm_count),
                hidden_only: false,
            },
            (None, Some((requests, rows))) => StepShape {
                num_tokens: requests * rows,
                num_requests: requests,
                num_logits: requests * rows,
                attention: Attention::Prefill,
                hidden_only: false,
            },
            (None, None) => StepShape {
                num_tokens: piece_tokens.unwrap_or(num_tokens),
                num_requests,
                num_logits,
                hidden_only,
                attention: if decode_rows && fits_decode {
                    self.decode_attention(cache, num_requests, context, sm_count)
                } else {
                    self.mixed_attention(cache, batch, sm_count)
                },
            },
        };
        self.sparse_step(cache, batch, &mut shape)?;
        self.cascade_step(cache, batch, &mut shape)?;
        let graph = graph_rows.is_some() || verify_rows.is_some();
        let started = gpu.record_event()?;
        let planned = host_started.elapsed();
        if self.stage(cache, batch, &shape)? {
            self.counters.steps_cuda_decode_fused_merged += 1;
        }
        let staged = host_started.elapsed();
        match shape.attention {
            Attention::Gather { .. } => {
                announce("gather");
                self.counters.steps_cuda_decode_gather += 1;
            }
            Attention::Fused { source, .. }
            | Attention::Cascade { source, .. }
            | Attention::Sparse { source, .. } => {
                announce("fused");
                self.counters.steps_cuda_decode_fused += 1;
                match source {
                    VariantSource::Tuned => self.counters.steps_cuda_decode_tuned += 1,
                    VariantSource::Heuristic => self.counters.steps_cuda_decode_heuristic += 1,
                    VariantSource::Configured => {}
                }
            }
            Attention::Latent { .. } => {
                // The latent attention's split-KV decode (its chunks merged as the fused
                // decode's).
                announce("latent");
                self.counters.steps_cuda_decode_fused += 1;
            }
            Attention::Mixed {
                decode_rows,
                source,
                ..
            } => {
                announce("mixed");
                self.counters.steps_cuda_mixed_split += 1;
                self.counters.cuda_mixed_decode_rows += decode_rows as u64;
                self.counters.cuda_mixed_prefill_tokens += (num_tokens - decode_rows) as u64;
                self.counters.steps_cuda_prefill_kernel += 1;
                match source {
                    VariantSource::Tuned => self.counters.steps_cuda_decode_tuned += 1,
                    VariantSource::Heuristic => self.counters.steps_cuda_decode_heuristic += 1,
                    VariantSource::Configured => {}
                }
            }
            Attention::Prefill => {
                announce("prefill");
                let leading = single_rows(batch.qo_indptr);
                if leading > 0 && leading < num_requests && !options.kernels.deterministic {
                    self.counters.steps_cuda_mixed_prefill += 1;
                    self.counters.cuda_mixed_decode_rows += leading as u64;
                    self.counters.cuda_mixed_prefill_tokens += (num_tokens - leading) as u64;
                }
                self.counters.steps_cuda_prefill_kernel += 1;
                // The choice the step ran (made once per bucket, cached).
                let prefill = &cache.buffers.prefill;
                match prefill.choose(shape.num_requests, shape.num_tokens).1 {
                    VariantSource::Tuned => self.counters.steps_cuda_prefill_tuned += 1,
                    VariantSource::Heuristic => self.counters.steps_cuda_prefill_heuristic += 1,
                    VariantSource::Configured => {}
                }
            }
        }
        if options.kernels.deterministic {
            self.counters.steps_cuda_deterministic += 1;
        }
        if options.kernels.fused_rope_append {
            self.counters.steps_cuda_fused_rope_append += 1;
        }
        if !cache.buffers.fp8.is_empty() {
            self.counters.steps_cuda_fp8_kv += 1;
        }
        if cache.buffers.gemv && shape.num_tokens <= pagoda_ops::cuda::GEMV_MAX_ROWS {
            self.counters.steps_cuda_gemv += 1;
        }
        if cache.buffers.quant.fp8 {
            if cache.buffers.quant.fp8_in_place(shape.num_tokens) {
                self.counters.steps_cuda_fp8_weights_in_place += 1;
            } else if cache.buffers.quant.fp8_gemm_runs(shape.num_tokens) {
                self.counters.steps_cuda_fp8_weights_gemm += 1;
            } else {
                self.counters.steps_cuda_fp8_weights_decoded += 1;
            }
        } else if cache.buffers.quant.dense.is_some() {
            let (quant, rows) = (&cache.buffers.quant, shape.num_tokens);
            self.counters.steps_cuda_quant_fused_q8 += u64::from(quant.fuses(rows));
            if quant.in_place(rows) {
                self.counters.steps_cuda_quant_in_place += 1;
                self.counters.steps_cuda_quant_pair += u64::from(quant.pairs_in_one_launch());
            } else if quant.mma(rows) {
                self.counters.steps_cuda_quant_mma += 1;
            } else {
                self.counters.steps_cuda_quant_decoded += 1;
            }
        }
        if graph {
            announce("graphs");
            let GpuCache {
                layout,
                buffers,
                graphs,
                ..
            } = cache;
            let before = graphs.len();
            let this = &*self;
            let key = graph_key(shape.num_requests, shape.num_tokens, &shape.attention);
            let replay = graphs.get_or_capture(&gpu, key, |gpu| {
                this.model.run(gpu, buffers, layout, &shape)
            })?;
            replay.launch()?;
            // Decode graphs are captured at prepare (a miss here means the bucket list
            // changed); verification graphs at their first step.
            if graphs.len() > before {
                self.counters.cuda_graphs_captured += 1;
            }
            self.counters.steps_cuda_graph += 1;
            if verify_rows.is_some() {
                self.counters.steps_cuda_verify_graph += 1;
            }
        } else if piece_tokens.is_some() {
            announce("pieces");
            let GpuCache {
                layout,
                buffers,
                pieces,
                ..
            } = cache;
            let counters = &mut self.counters;
            pieces.run(&self.model, &gpu, buffers, layout, &shape, counters)?;
        } else {
            announce("eager");
            self.model
                .run(&gpu, &mut cache.buffers, &cache.layout, &shape)?;
            self.counters.steps_cuda_eager += 1;
        }
        let mut finished = gpu.record_event()?;
        let launched = host_started.elapsed();
        let logits = if num_logits == 0 {
            // A prefill chunk that samples nothing. Wait anyway: the next step rewrites the
            // pinned inputs this step's upload may still be reading.
            gpu.synchronize()?;
            Vec::new()
        } else if let Output::Sampled(request) = output {
            // The sampler's kernels count as GPU time of the step.
            finished = self.sample_on_device(&gpu, cache, num_logits, request)?;
            Vec::new()
        } else if hidden_only {
            let rows = num_logits * self.model.config().hidden_size;
            let states = view(&cache.buffers.scratch.selected_normed, 0..rows)?;
            gpu.download(&states)?
                .into_iter()
                .map(HostFloat::to_f32)
                .collect()
        } else {
            let logits = view(
                &cache.buffers.scratch.logits,
                0..num_logits * self.model.config().vocab_size,
            )?;
            gpu.download(&logits)?
        };
        let gpu_ms = started.elapsed_ms(&finished)?;
        self.counters.cuda_gpu_time_us += (gpu_ms as f64 * 1e3) as u64;
        self.count_kernel_loads();
        tracing::trace!(
            target: "pagoda::step",
            "cuda step {shape:?}: plan {planned:?}, stage {:?}, launch {:?}, wait+download {:?}, gpu {gpu_ms:.3} ms",
            staged - planned,
            launched - staged,
            host_started.elapsed() - launched
        );
        Ok(logits)
    }

    fn validate(&self, cache: &GpuCache<T>, batch: &ForwardBatch<'_>) -> Result<(), CudaError> {
        let c = self.model.config();
        let options = cache.options;
        let num_tokens = batch.tokens.len();
        let num_requests = batch.qo_indptr.len().saturating_sub(1);
        let num_logits = batch.logits_for.len();
        let table = batch.page_table;
        if num_tokens == 0 || num_tokens > options.max_batch_tokens {
            return Err(CudaError::invalid(format!(
                "a step of {num_tokens} tokens (at most {} per step)",
                options.max_batch_tokens
            )));
        }
        if num_requests == 0 || num_requests > options.max_batch_requests || num_logits > num_tokens
        {
            return Err(CudaError::invalid(format!(
                "a step of {num_requests} requests / {num_logits} logit rows exceeds the buffers"
            )));
        }
        if batch.positions.len() != num_tokens || batch.slots.len() != num_tokens {
            return Err(CudaError::invalid(
                "tokens, positions and slots differ in length",
            ));
        }
        if table.indptr.len() != num_requests + 1
            || table.last_page_len.len() != num_requests
            || table.first_page_offset.len() != num_requests
        {
            return Err(CudaError::invalid(
                "the page table does not have one row per request",
            ));
        }
        if let Some(&token) = batch.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(CudaError::invalid(format!(
                "token {token} is outside the vocabulary ({})",
                c.vocab_size
            )));
        }
        if let Some(&row) = batch.logits_for.iter().find(|&&t| t >= num_tokens) {
            return Err(CudaError::invalid(format!(
                "logits requested for token {row} of {num_tokens}"
            )));
        }
        if table.indices.len() > cache.buffers.scratch.page_indices.len() {
            return Err(CudaError::invalid("the page table is larger than the pool"));
        }
        Ok(())
    }
}
