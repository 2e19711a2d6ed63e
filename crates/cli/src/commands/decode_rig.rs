//! The attention test rig `pagoda bench attention` and `pagoda tune` share: bf16 KV pools
//! with random contents, a case per (batch, context) whose every request draws its pages at
//! random from a pool larger than any case, R rotating input sets of at least 4x the L2
//! (different page tables and queries), and a path captured in one CUDA graph over all R sets.
//! A replay's time / R is one sample; the L2 never holds a set when its turn comes. A decode
//! case has one query per request; a prefill case queries every token of every request
//! (causal: the whole prompt attends to itself).

use anyhow::{bail, Result};
use half::bf16;
use pagoda_cuda::{view_mut, CapturedGraph, DeviceBuffer, Gpu};
use pagoda_kv::PageTable;
use pagoda_models::llama_cuda::HostFloat;
use pagoda_ops::cuda::{
    self as ops, DecodeVariant, DecodeWorkspace, DevicePageTable, PagedDecodePlan,
    PagedDecodeWorkspace, PagedKv, PlanCapacity, PlanPolicy, PoolLayout, PrefillKernel, Queries,
};
use rand::{Rng, SeedableRng};

/// The L2 of an H200; rotating inputs add up to at least four times this.
pub const L2_BYTES: usize = 60 << 20;

/// The head geometry and page size of the rig (the attention benchmarks' flags).
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct Geometry {
    /// Query heads (Llama-3.1-8B: 32).
    #[arg(long, default_value_t = 32)]
    pub q_heads: usize,
    /// KV heads (Llama-3.1-8B: 8).
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
    /// Elements per head.
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Tokens per page.
    #[arg(long, default_value_t = 16)]
    pub page_size: usize,
}

impl Geometry {
    /// Bytes of one page of one side.
    fn page_bytes(&self) -> usize {
        self.page_size * self.kv_heads * self.head_dim * 2
    }

    /// K and V bytes of `b` requests of `l` tokens.
    pub fn kv_bytes(&self, b: usize, l: usize) -> usize {
        b * l.div_ceil(self.page_size) * self.page_bytes() * 2
    }

    /// The table's geometry.
    pub fn tuning(&self) -> ops::DecodeGeometry {
        ops::DecodeGeometry {
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            page_size: self.page_size,
            dtype: "bf16".into(),
        }
    }
}

/// A path through the attention: the gather decode baseline, a fused decode variant with
/// its plan policy, or a prefill kernel (prefill cases only).
#[derive(Clone, Copy, Debug)]
pub enum DecodePath {
    Gather,
    Fused(DecodeVariant, PlanPolicy),
    Prefill(PrefillKernel),
}

/// The pools and the device.
pub struct Rig {
    pub gpu: Gpu,
    pub geometry: Geometry,
    layout: PoolLayout,
    k_pool: DeviceBuffer<bf16>,
    v_pool: DeviceBuffer<bf16>,
    /// The same pools quantized to e4m3 (`--kv-dtype fp8`): the paths then read these.
    fp8: Option<ops::Fp8KvLayer>,
    rng: rand_chacha::ChaCha8Rng,
}

/// One rotating input set: a page table and queries.
struct InputSet {
    arrays: [DeviceBuffer<u32>; 4],
    q: DeviceBuffer<bf16>,
}

/// What a case's queries are: one per request (decode) or every prompt token (prefill).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueryRows {
    Decode,
    Prefill,
}

/// The inputs of one (batch, context) case.
pub struct Case {
    pub batch: usize,
    pub bytes: usize,
    pub sets: usize,
    /// Query rows per request (1 for decode, the context for prefill).
    pub rows_per_request: usize,
    indptr: Vec<u32>,
    qo_indptr: DeviceBuffer<u32>,
    inputs: Vec<InputSet>,
}

/// A path captured over a case's input sets, with the buffers the graph uses.
pub struct Captured {
    graph: CapturedGraph,
    sets: usize,
    /// The fused plan's chunks and pages per chunk (0 for gather).
    pub chunks: usize,
    pub pages_per_chunk: usize,
    _fused: Option<PagedDecodeWorkspace>,
    _gather: Option<DecodeWorkspace<bf16>>,
    _out: DeviceBuffer<bf16>,
}

impl Captured {
    /// Replays the graph `count` times; microseconds per call (replay time / sets) each.
    pub fn time(&self, gpu: &Gpu, count: usize) -> Result<Vec<f64>> {
        time_replays(gpu, &self.graph, count, self.sets)
    }
}

/// Replays `graph` (which runs `sets` calls) `count` times, each timed with CUDA events:
/// microseconds per call (replay time / `sets`) each.
pub fn time_replays(
    gpu: &Gpu,
    graph: &CapturedGraph,
    count: usize,
    sets: usize,
) -> Result<Vec<f64>> {
    let mut times = Vec::with_capacity(count);
    for _ in 0..count {
        let start = gpu.record_event()?;
        graph.launch()?;
        let end = gpu.record_event()?;
        times.push(start.elapsed_ms(&end)? as f64 * 1e3 / sets as f64);
    }
    Ok(times)
}

impl Rig {
    /// Pools for cases of up to `largest` KV bytes: larger than any case (per side) and at
    /// least 1 GB, so pages rarely repeat.
    pub fn new(geometry: Geometry, largest: usize) -> Result<Self> {
        let gpu = Gpu::new(0).map_err(|e| anyhow::anyhow!("this command needs a CUDA GPU: {e}"))?;
        let layout_for = |num_pages| PoolLayout {
            num_pages,
            page_size: geometry.page_size,
            num_kv_heads: geometry.kv_heads,
            head_dim: geometry.head_dim,
        };
        let dtype = pagoda_cuda::DType::BF16;
        if let Some(reason) = ops::paged_decode_unsupported(dtype, &layout_for(1), geometry.q_heads)
        {
            bail!("the fused decode does not support this shape: {reason}");
        }
        let pool_pages = (largest / 2 + (1 << 30)).div_ceil(geometry.page_bytes());
        let layout = layout_for(pool_pages);
        eprintln!(
            "pool: {pool_pages} pages of {} tokens ({:.1} GB for K and V)",
            geometry.page_size,
            2.0 * (pool_pages * geometry.page_bytes()) as f64 / 1e9
        );
        let k_pool = random_pool(&gpu, layout.pool_len(), 1)?;
        let v_pool = random_pool(&gpu, layout.pool_len(), 2)?;
        Ok(Rig {
            gpu,
            geometry,
            layout,
            k_pool,
            v_pool,
            fp8: None,
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(7),
        })
    }

    /// Makes every later case read an e4m3 copy of the pools (quantized by the fp8 append):
    /// only the CUDA-core fused decode and the tiled prefill read it.
    pub fn use_fp8(&mut self) -> Result<()> {
        let gpu = &self.gpu;
        let mut layer = ops::Fp8KvLayer::new(gpu, &self.layout)?;
        let slots: Vec<i32> = (0..(self.layout.num_pages * self.layout.page_size) as i32).collect();
        let slots = gpu.upload(&slots)?;
        let stride = self.layout.token_stride();
        let new = ops::NewKv {
            k: pagoda_cuda::whole(&self.k_pool),
            v: pagoda_cuda::whole(&self.v_pool),
            row_strides: (stride, stride),
            slots: pagoda_cuda::whole(&slots),
        };
        ops::kv_append_fp8(gpu, &new, &mut layer, &self.layout)?;
        gpu.synchronize()?;
        self.fp8 = Some(layer);
        Ok(())
    }

    /// The bf16 K and V pools and their layout (for rigs of other page tables).
    pub fn pools(&self) -> (&DeviceBuffer<bf16>, &DeviceBuffer<bf16>, PoolLayout) {
        (&self.k_pool, &self.v_pool, self.layout)
    }

    /// The rig's seeded generator.
    pub fn rng(&mut self) -> &mut rand_chacha::ChaCha8Rng {
        &mut self.rng
    }

    /// SMs of the device.
    pub fn sm_count(&self) -> usize {
        self.gpu.info().sm_count as usize
    }

    /// The plan policy of `variant` on this device, chunks of at least `min_pages` pages.
    pub fn policy(&self, variant: &DecodeVariant, min_pages: usize) -> PlanPolicy {
        let g = self.geometry;
        let smem = self.gpu.info().shared_memory_per_sm as usize;
        variant.policy(
            g.head_dim,
            g.q_heads / g.kv_heads,
            self.sm_count(),
            smem,
            min_pages,
        )
    }

    /// The plain fused decode of `b` requests over the row pointer `indptr` (the built-in
    /// heuristic's variant, chunks of at least 64 tokens): its variant, plan policy and
    /// capacity, and workspace with the plan uploaded and the kernel set.
    pub fn plain_decode(
        &self,
        b: usize,
        indptr: &[u32],
    ) -> Result<(
        DecodeVariant,
        PlanPolicy,
        PlanCapacity,
        PagedDecodeWorkspace,
    )> {
        let (g, gpu) = (self.geometry, &self.gpu);
        let variant = DecodeVariant::heuristic(true, g.head_dim);
        let policy = self.policy(&variant, 64usize.div_ceil(g.page_size));
        let capacity = PlanCapacity::for_batch(b, g.kv_heads, policy.target_ctas);
        let plan = PagedDecodePlan::new(indptr, g.kv_heads, policy, capacity)?;
        let mut workspace =
            PagedDecodeWorkspace::new(gpu, capacity, g.q_heads, g.kv_heads, g.head_dim)?;
        workspace.upload_plan(gpu, &plan)?;
        workspace.set_kernel(variant.kernel);
        Ok((variant, policy, capacity, workspace))
    }

    /// The inputs of `b` requests of `l` tokens each, queried as `kind` says.
    pub fn case(&mut self, b: usize, l: usize, kind: QueryRows) -> Result<Case> {
        let g = self.geometry;
        let bytes = match self.fp8 {
            // One byte a value and an f32 scale a head, against bf16's two bytes a value.
            Some(_) => g.kv_bytes(b, l) / 2 / g.head_dim * (g.head_dim + 4),
            None => g.kv_bytes(b, l),
        };
        let rows_per_request = if kind == QueryRows::Prefill { l } else { 1 };
        let q_bytes = b * rows_per_request * g.q_heads * g.head_dim * 2;
        let sets = (4 * L2_BYTES).div_ceil(bytes + q_bytes).clamp(1, 32);
        let pages = l.div_ceil(g.page_size);
        let indptr: Vec<u32> = (0..=b).map(|r| (r * pages) as u32).collect();
        let last = vec![(l - (pages - 1) * g.page_size) as u32; b];
        let mut inputs = Vec::with_capacity(sets);
        for _ in 0..sets {
            let indices: Vec<u32> = (0..b * pages)
                .map(|_| self.rng.random_range(0..self.layout.num_pages) as u32)
                .collect();
            let q: Vec<bf16> = (0..b * rows_per_request * g.q_heads * g.head_dim)
                .map(|_| bf16::from_f32(self.rng.random_range(-2.0..2.0)))
                .collect();
            inputs.push(InputSet {
                arrays: [
                    self.gpu.upload(&indptr)?,
                    self.gpu.upload(&indices)?,
                    self.gpu.upload(&last)?,
                    self.gpu.zeros(b)?,
                ],
                q: self.gpu.upload(&q)?,
            });
        }
        let qo_indptr: Vec<u32> = (0..=b).map(|r| (r * rows_per_request) as u32).collect();
        Ok(Case {
            batch: b,
            bytes,
            sets,
            rows_per_request,
            indptr,
            qo_indptr: self.gpu.upload(&qo_indptr)?,
            inputs,
        })
    }

    /// Captures `path` over every input set of `case` (after one eager run, which compiles
    /// the kernels outside the capture).
    pub fn capture(&self, case: &Case, path: DecodePath) -> Result<Captured> {
        let (gpu, g) = (&self.gpu, self.geometry);
        let b = case.batch;
        let pages = case.indptr[b] as usize;
        let mut out = gpu.zeros::<bf16>(b * case.rows_per_request * g.q_heads * g.head_dim)?;
        let scale = 1.0 / (g.head_dim as f32).sqrt();
        let (mut fused, mut gather, mut plan_shape) = (None, None, (0, 0));
        match path {
            DecodePath::Prefill(_) => {}
            DecodePath::Gather => {
                gather = Some(DecodeWorkspace::<bf16>::new(
                    gpu,
                    &self.layout,
                    g.q_heads,
                    b,
                    pages,
                )?);
            }
            DecodePath::Fused(variant, policy) => {
                let mut capacity = PlanCapacity::for_batch(b, g.kv_heads, policy.target_ctas);
                if let Some(fixed) = policy.pages_per_chunk {
                    let per_request = (pages / b.max(1)).div_ceil(fixed);
                    capacity.max_chunks = capacity.max_chunks.max(b * per_request);
                }
                let plan = PagedDecodePlan::new(&case.indptr, g.kv_heads, policy, capacity)?;
                let mut workspace =
                    PagedDecodeWorkspace::new(gpu, capacity, g.q_heads, g.kv_heads, g.head_dim)?;
                workspace.upload_plan(gpu, &plan)?;
                workspace.set_kernel(variant.kernel);
                plan_shape = (plan.num_chunks(), plan.pages_per_chunk);
                fused = Some(workspace);
            }
        }
        let splits = ops::decode_splits(b, g.kv_heads, self.sm_count());
        let mut record = |gpu: &Gpu| -> Result<(), pagoda_cuda::CudaError> {
            for set in &case.inputs {
                let [a, i, lp, f] = &set.arrays;
                let table = DevicePageTable::new(a, i, lp, f)?;
                let queries = Queries::new(&set.q, g.q_heads, g.q_heads * g.head_dim);
                if let Some(layer) = &self.fp8 {
                    let kv = layer.paged(self.layout, table);
                    let kv = (&kv.0, &kv.1);
                    match (path, fused.as_mut()) {
                        (DecodePath::Fused(variant, _), Some(workspace)) => {
                            let merge = variant.merge;
                            ops::paged_decode_attention_fp8(
                                gpu, &queries, kv, workspace, merge, scale, &mut out,
                            )?
                        }
                        (DecodePath::Prefill(PrefillKernel::Tiled), _) => {
                            let qo = &case.qo_indptr;
                            ops::prefill_attention_tiled_fp8(
                                gpu, &queries, kv, qo, scale, &mut out,
                            )?
                        }
                        (DecodePath::Prefill(PrefillKernel::Stream(tiling)), _) => {
                            let qo = &case.qo_indptr;
                            ops::prefill_attention_stream_fp8(
                                gpu, tiling, &queries, kv, qo, scale, &mut out,
                            )?
                        }
                        _ => {
                            return Err(pagoda_cuda::CudaError::invalid(
                                "--kv-dtype fp8 times the fused CUDA-core and streaming \
                                 decodes (`fused`, `fused-separate`, `stream-*`) and the \
                                 tiled and streaming prefills only",
                            ))
                        }
                    }
                    continue;
                }
                let kv = PagedKv::new(&self.k_pool, &self.v_pool, self.layout, table);
                match (path, gather.as_mut(), fused.as_mut()) {
                    (DecodePath::Gather, Some(workspace), _) => ops::decode_attention_gathered(
                        gpu, &queries, &kv, workspace, splits, scale, &mut out,
                    )?,
                    (DecodePath::Fused(variant, _), _, Some(workspace)) => {
                        let merge = variant.merge;
                        ops::paged_decode_attention(
                            gpu, &queries, &kv, workspace, merge, scale, &mut out,
                        )?
                    }
                    (DecodePath::Prefill(kernel), _, _) => {
                        let qo = &case.qo_indptr;
                        ops::prefill_attention_with(
                            kernel, gpu, &queries, &kv, qo, scale, &mut out,
                        )?
                    }
                    _ => unreachable!("the workspace matches the path"),
                }
            }
            Ok(())
        };
        let graph = warm_capture(gpu, &mut record)?;
        Ok(Captured {
            graph,
            sets: case.sets,
            chunks: plan_shape.0,
            pages_per_chunk: plan_shape.1,
            _fused: fused,
            _gather: gather,
            _out: out,
        })
    }
}

/// Runs `record` once eagerly (compiling and loading its kernels outside the capture),
/// captures it in a graph and replays that once, so timing starts warm.
pub fn warm_capture(
    gpu: &Gpu,
    record: &mut impl FnMut(&Gpu) -> Result<(), pagoda_cuda::CudaError>,
) -> Result<CapturedGraph, pagoda_cuda::CudaError> {
    record(gpu)?;
    gpu.synchronize()?;
    let graph = gpu.capture(record)?;
    graph.launch()?;
    gpu.synchronize()?;
    Ok(graph)
}

/// A pool of `len` bf16 values: [`random_fill`].
pub fn random_pool(gpu: &Gpu, len: usize, seed: u64) -> Result<DeviceBuffer<bf16>> {
    random_fill(gpu, len, seed)
}

/// A buffer of `len` values of `T`: a block of 16M uniform values in [-1, 1) uploaded once and
/// copied over the whole buffer on the device (the timing does not depend on the values, only
/// on them being ordinary numbers).
pub fn random_fill<T: HostFloat>(gpu: &Gpu, len: usize, seed: u64) -> Result<DeviceBuffer<T>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let block_len = (16usize << 20).min(len);
    let block: Vec<T> = (0..block_len)
        .map(|_| T::from_f32(rng.random_range(-1.0..1.0)))
        .collect();
    let block = gpu.upload(&block)?;
    let mut pool = gpu.alloc::<T>(len)?;
    let mut start = 0;
    while start < len {
        let end = (start + block_len).min(len);
        let mut target = view_mut(&mut pool, start..end)?;
        let source = pagoda_cuda::view(&block, 0..end - start)?;
        gpu.copy(&source, &mut target)?;
        start = end;
    }
    gpu.synchronize()?;
    Ok(pool)
}

/// A page table's four device arrays (row pointer, page ids, last-page lengths, first-page
/// offsets), as the benches' sets hold them.
pub fn upload_table(gpu: &Gpu, table: &PageTable) -> Result<[DeviceBuffer<u32>; 4]> {
    Ok([
        gpu.upload(&table.indptr)?,
        gpu.upload(&table.indices)?,
        gpu.upload(&table.last_page_len)?,
        gpu.upload(&table.first_page_offset)?,
    ])
}

/// The device page table over [`upload_table`]'s arrays.
pub fn device_table(
    arrays: &[DeviceBuffer<u32>; 4],
) -> Result<DevicePageTable<'_>, pagoda_cuda::CudaError> {
    let [indptr, indices, last, first] = arrays;
    DevicePageTable::new(indptr, indices, last, first)
}

/// Appends a request of `len` tokens on `pages` (its first page full from row 0) to `table`.
pub fn push_request(
    table: &mut PageTable,
    pages: impl IntoIterator<Item = u32>,
    len: usize,
    page: usize,
) {
    table.indices.extend(pages);
    table.indptr.push(table.indices.len() as u32);
    table.last_page_len.push(((len - 1) % page + 1) as u32);
    table.first_page_offset.push(0);
    table.seq_lens.push(len as u32);
    table.rope_offsets.push(len as u32);
}
