//! The device memory one step of the model reads and writes ([`StepBuffers`]: the KV pools,
//! the activations, the step inputs and the decode workspaces), allocated once at their
//! largest sizes, and the shape a step is launched with ([`StepShape`]). The GPU runner
//! (`pagoda-engine`) owns them, stages each step's inputs into them and hands them to
//! [`GpuModel::run`](super::GpuModel::run).

use pagoda_cuda::{CudaError, DeviceBuffer, Gpu};
use pagoda_ops::cuda::{self as ops, DecodeWorkspace, PoolLayout};

use super::decode_path::{load_table, tuning_geometry, FusedDecode};
use super::experts::MoeBuffers;
use super::matrix::QuantScratch;
use super::mla_decode::MlaDecode;
use super::prefill_path::PrefillChoice;
use super::sparse_path::SparseDecode;
use super::{CudaCacheOptions, HostFloat};
use crate::config::ModelConfig;

/// How a step's attention runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// The ragged causal prefill kernel over the paged cache (any batch).
    Prefill,
    /// The baseline decode: one query per request, keys cut into `num_splits` ranges.
    Gather { num_splits: usize },
    /// The fused decode's `variant`, with a grid of `grid_chunks` chunks (the plan is staged
    /// per step).
    Fused {
        grid_chunks: usize,
        variant: pagoda_ops::cuda::DecodeVariant,
        /// Where the variant came from (the step counters read it).
        source: super::VariantSource,
    },
    /// A fused decode step whose requests share leading pages, run as cascade
    /// (`cascade_path.rs`): the shared level in tiles of `rows` query rows, the fused decode
    /// (`variant`) over the requests' own pages on a grid of `grid_chunks` chunks (the plain
    /// grid plus the shared slots), both merged; the plan is staged per step.
    Cascade {
        grid_chunks: usize,
        variant: pagoda_ops::cuda::DecodeVariant,
        source: super::VariantSource,
        rows: usize,
    },
    /// A fused decode step some of whose requests attend to a shorter page list that each
    /// layer selects on the device (`sparse_path.rs`): the selection's grid covers
    /// `grid_pages` pages a request; the fused decode (`variant`, `grid_chunks`) then runs on
    /// the shortened table, its plan staged per step.
    Sparse {
        grid_chunks: usize,
        variant: pagoda_ops::cuda::DecodeVariant,
        source: super::VariantSource,
        grid_pages: usize,
    },
    /// A latent attention (MLA) decode step: the split-KV MLA decode over a grid of
    /// `grid_chunks` chunks, fixed per batch bucket (the plan is staged per step by
    /// [`MlaDecode::stage`](super::MlaDecode::stage); chunks past it exit at once).
    Latent { grid_chunks: usize },
    /// A mixed step (`PAGODA_CUDA_MIXED_STEPS=split`): its first `decode_rows` requests hold
    /// one query each and attend through the fused decode (`grid_chunks`, `variant`, as
    /// [`Attention::Fused`]); the chunks after them through the prefill kernel. With
    /// `grid_pages` > 0 the decode rows attend as [`Attention::Sparse`].
    Mixed {
        decode_rows: usize,
        grid_chunks: usize,
        variant: pagoda_ops::cuda::DecodeVariant,
        source: super::VariantSource,
        grid_pages: usize,
    },
}

/// The sizes a step's kernels are launched with (padded for a graph bucket).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    pub num_tokens: usize,
    pub num_requests: usize,
    pub num_logits: usize,
    pub attention: Attention,
    /// Stop after the final norm: `selected_normed` holds the `num_logits` rows' hidden
    /// states and the LM head does not run (embeddings).
    pub hidden_only: bool,
}

/// Device memory a step reads and writes (the addresses a captured graph holds).
pub struct StepBuffers<T> {
    /// The KV pools in the model's dtype (empty with an fp8 cache).
    pub k_pools: Vec<DeviceBuffer<T>>,
    pub v_pools: Vec<DeviceBuffer<T>>,
    /// The e4m3 KV cache, one entry per layer (`-ctk fp8 -ctv fp8`; empty otherwise).
    pub fp8: Vec<ops::Fp8KvLayer>,
    pub scratch: Scratch<T>,
    /// The gather decode's workspace (absent when every decode step runs fused).
    pub decode: Option<DecodeWorkspace<T>>,
    /// The fused decode (absent when the mode or the geometry selects gather, and for a
    /// latent attention model).
    pub fused: Option<FusedDecode>,
    /// The latent attention's decode (a DeepSeek model outside deterministic mode).
    pub mla_decode: Option<MlaDecode>,
    /// The prefill attention kernel asked for and the streaming kernel's tiling per step
    /// (`Stream` falls back to `Mma`, `Mma` to `Tiled`, where they do not apply).
    pub prefill: PrefillChoice,
    /// RoPE and the KV append in one launch (`PAGODA_CUDA_FUSED_ROPE_APPEND`).
    pub fused_rope_append: bool,
    /// Linear layers of at most `ops::GEMV_MAX_ROWS` rows on the small-batch kernel
    /// (`PAGODA_CUDA_GEMV`; off in deterministic mode, whose GEMMs are batch-invariant).
    pub gemv: bool,
    /// The quantized matrices' activations and dense scratch (empty for a dense model).
    pub quant: QuantScratch<T>,
    /// The mixture-of-experts blocks' router logits, routing and expert activations (`None`
    /// for a dense model).
    pub moe: Option<MoeBuffers<T>>,
    /// Sparse decode's summaries and selection (`None` unless `--sparse-attention`).
    pub sparse: Option<SparseDecode<T>>,
}

impl<T: HostFloat> StepBuffers<T> {
    /// The KV pools of `layout` (one K and one V per layer, zeroed), the activations and
    /// inputs for `options`' largest step, and the decode workspace its path needs: the
    /// fused decode's, or, where that is off, the gather baseline's (large: every request's
    /// pages at full context); and, for a model whose largest quantized matrix holds
    /// `largest_quantized` values, the quantized linear layers' scratch.
    pub fn new(
        gpu: &Gpu,
        c: &ModelConfig,
        options: &CudaCacheOptions,
        layout: &PoolLayout,
        largest_quantized: usize,
    ) -> Result<Self, CudaError> {
        // A latent attention model caches one latent row per token in its K pool, no V.
        let latent = c.mla.is_some();
        let kv_fp8 = options.kernels.kv_fp8;
        if kv_fp8 {
            check_fp8(c, options, layout, T::DTYPE)?;
        }
        let mut k_pools = Vec::with_capacity(c.num_layers);
        let mut v_pools = Vec::with_capacity(c.num_layers);
        let mut fp8 = Vec::new();
        for _ in 0..c.num_layers {
            if kv_fp8 {
                fp8.push(ops::Fp8KvLayer::new(gpu, layout)?);
                continue;
            }
            k_pools.push(gpu.zeros(layout.pool_len())?);
            if !latent {
                v_pools.push(gpu.zeros(layout.pool_len())?);
            }
        }
        let scratch = Scratch::new(gpu, c, options)?;
        // Deterministic steps decode every quantized matrix for the batch-invariant GEMM.
        let (gemv_rows, mma_rows) = if options.kernels.deterministic {
            (0, 0)
        } else {
            (
                options.kernels.quant_gemv_rows,
                options.kernels.quant_mma_rows,
            )
        };
        let shared_experts = c.moe.as_ref().map_or(0, |moe| {
            moe.num_shared_experts * moe.expert_intermediate_size
        });
        let width = c
            .hidden_size
            .max(c.intermediate_size)
            .max(c.num_attention_heads * c.head_dim)
            .max(shared_experts);
        let kernel = options.kernels.quant_gemv_kernel;
        let (fused_q8, pair) = (options.kernels.quant_fused_q8, options.kernels.quant_pair);
        let scratch_choice = (kernel, fused_q8, pair);
        let rows = (gemv_rows, mma_rows);
        let quant = QuantScratch::new(gpu, largest_quantized, width, rows, scratch_choice)?;
        if largest_quantized > 0 {
            static QUANT: std::sync::Once = std::sync::Once::new();
            QUANT.call_once(|| {
                tracing::info!(
                    "CUDA quantized linear layers: 1-{gemv_rows} rows on the in-place kernel \
                     (q8 activations, {kernel:?} layout: PAGODA_CUDA_QUANT_GEMV_KERNEL), up to \
                     {mma_rows} on the tensor cores in place (PAGODA_CUDA_QUANT_MMA_ROWS), more \
                     decoded for cuBLAS (PAGODA_CUDA_QUANT_GEMV_ROWS)"
                );
                let how = match fused_q8 && gemv_rows.max(mma_rows) > 0 {
                    true => "written by their producer (RMSNorm, SiLU x up) in its launch",
                    false => "quantized by a launch of their own",
                };
                tracing::info!(
                    "CUDA quantized linear layers' q8 activations: {how} \
                     (PAGODA_CUDA_QUANT_FUSED_Q8)"
                );
                let pairs = match pair && gemv_rows > 0 && kernel == ops::QuantGemvKernel::Groups {
                    true => "one launch",
                    false => "a launch a part",
                };
                tracing::info!(
                    "CUDA quantized matrices of two formats (Q4_K/Q5_K then Q6_K) in place: \
                     {pairs} (PAGODA_CUDA_QUANT_PAIR)"
                )
            });
        }
        let geometry = tuning_geometry(c, options, T::DTYPE);
        // Deterministic steps run one attention kernel and consult no table.
        let table = if options.kernels.deterministic || latent {
            None
        } else {
            load_table(gpu, &geometry)
        };
        let (fused, mla_decode) = match latent {
            false => (
                FusedDecode::new(gpu, c, options, T::DTYPE, table.as_ref())?,
                None,
            ),
            // Deterministic steps attend every row with the MLA prefill kernel.
            true if options.kernels.deterministic => (None, None),
            true => (None, MlaDecode::new(gpu, c, options, T::DTYPE)?),
        };
        // Deterministic steps attend every row with the per-token kernel: no decode workspace.
        let decode = if fused.is_none() && !options.kernels.deterministic && !latent {
            Some(DecodeWorkspace::new(
                gpu,
                layout,
                c.num_attention_heads,
                options.max_batch_requests.max(1),
                decode_capacity_pages(options),
            )?)
        } else {
            None
        };
        let prefill = if options.kernels.deterministic {
            ops::PrefillKernel::PerToken
        } else if latent {
            // A latent attention model attends with the MLA kernels (logged by `MlaDecode`).
            ops::PrefillKernel::Tiled
        } else if kv_fp8 {
            options.kernels.prefill.reading_fp8(c.head_dim)
        } else {
            options.kernels.prefill
        };
        static LOGGED: std::sync::Once = std::sync::Once::new();
        LOGGED.call_once(|| match prefill {
            _ if latent => {}
            ops::PrefillKernel::Stream(_) => tracing::info!(
                "CUDA prefill attention: the streaming kernel, its tiling chosen per bucket"
            ),
            other => tracing::info!("CUDA prefill attention: {other:?}"),
        });
        let prefill = PrefillChoice::new(prefill, options.kernels.prefill_tiling, geometry, table);
        static FUSED: std::sync::Once = std::sync::Once::new();
        FUSED.call_once(|| {
            let how = if options.kernels.fused_rope_append {
                "one launch"
            } else {
                "two launches"
            };
            tracing::info!("CUDA RoPE and KV append: {how} (PAGODA_CUDA_FUSED_ROPE_APPEND)");
            let gemv = options.kernels.gemv && !options.kernels.deterministic;
            tracing::info!(
                "CUDA linear layers of 1-{} rows: {} (PAGODA_CUDA_GEMV)",
                ops::GEMV_MAX_ROWS,
                if gemv {
                    "the small-batch kernel"
                } else {
                    "cuBLAS"
                }
            );
        });
        if kv_fp8 {
            static FP8: std::sync::Once = std::sync::Once::new();
            FP8.call_once(|| {
                tracing::info!(
                    "CUDA KV cache: fp8 (e4m3, one f32 scale per token and KV head); decode on \
                     the streaming tensor-core or the CUDA-core fused kernel (logged per \
                     bucket), prefill on the streaming tensor-core or the tiled kernel (logged \
                     above)"
                )
            });
        }
        let max_indices = pagoda_cuda::DeviceRead::len(&scratch.page_indices);
        // Sparse decode shortens the fused decode's table (none: the flag is refused).
        let sparse = match fused.is_some() {
            true => SparseDecode::new(gpu, c, options, layout, max_indices)?,
            false => None,
        };
        Ok(StepBuffers {
            k_pools,
            v_pools,
            fp8,
            scratch,
            decode,
            fused,
            mla_decode,
            prefill,
            fused_rope_append: options.kernels.fused_rope_append,
            gemv: options.kernels.gemv && !options.kernels.deterministic,
            sparse,
            quant,
            moe: MoeBuffers::new(
                gpu,
                c,
                options.max_batch_tokens,
                [
                    options.kernels.moe_mma && !options.kernels.deterministic,
                    options.kernels.moe_quant,
                ],
                match options.kernels.deterministic {
                    true => 0,
                    false => options.kernels.moe_quant_dense_rows,
                },
            )?,
        })
    }
}

/// Refuses an fp8 KV cache where no kernel reads it: a latent (MLA) cache, f32 activations,
/// deterministic mode (its per-token kernel reads the model's dtype), the gather decode, a
/// geometry the fp8 kernels are not built for.
fn check_fp8(
    c: &ModelConfig,
    options: &CudaCacheOptions,
    layout: &PoolLayout,
    dtype: pagoda_cuda::DType,
) -> Result<(), CudaError> {
    let reason = if c.mla.is_some() {
        Some("a latent (MLA) cache".to_string())
    } else if options.kernels.deterministic {
        Some("--deterministic".to_string())
    } else if options.paged_decode == super::PagedDecodeMode::Gather {
        Some("--paged-decode gather".to_string())
    } else {
        ops::fp8_kv_unsupported(dtype, layout, c.num_attention_heads)
    };
    match reason {
        Some(reason) => Err(CudaError::invalid(format!(
            "-ctk/-ctv fp8: the CUDA fp8 KV cache does not support {reason}; drop -ctk/-ctv \
             (or --kv-cache-dtype)"
        ))),
        None => Ok(()),
    }
}

impl<T: pagoda_cuda::Element> StepBuffers<T> {
    /// Device bytes of the KV cache (pools and, for fp8, scales).
    pub fn kv_bytes(&self) -> usize {
        use pagoda_cuda::DeviceRead;
        let element = std::mem::size_of::<T>();
        let pools: usize = self
            .k_pools
            .iter()
            .chain(&self.v_pools)
            .map(|p| p.len())
            .sum();
        pools * element + self.fp8.iter().map(ops::Fp8KvLayer::bytes).sum::<usize>()
    }
}

/// Per-step buffers, allocated once at their maximum sizes.
pub struct Scratch<T> {
    /// The residual stream, always f32: rounding it to bf16 after each of the 2 * num_layers
    /// adds is what moves a bf16 model furthest from f32 (0.2 logprob on SmolLM2).
    pub x: DeviceBuffer<f32>,
    pub normed: DeviceBuffer<T>,
    pub qkv: DeviceBuffer<T>,
    pub attn: DeviceBuffer<T>,
    pub gate_up: DeviceBuffer<T>,
    pub act: DeviceBuffer<T>,
    pub selected: DeviceBuffer<f32>,
    pub selected_normed: DeviceBuffer<T>,
    pub logits: DeviceBuffer<f32>,
    pub tokens: DeviceBuffer<u32>,
    pub positions: DeviceBuffer<u32>,
    pub slots: DeviceBuffer<i32>,
    pub qo_indptr: DeviceBuffer<u32>,
    pub page_indptr: DeviceBuffer<u32>,
    pub page_indices: DeviceBuffer<u32>,
    pub last_page_len: DeviceBuffer<u32>,
    pub first_page_offset: DeviceBuffer<u32>,
    pub logits_rows: DeviceBuffer<u32>,
    /// A latent attention model's activations besides the shared ones (its absorbed queries
    /// live in `qkv`, its latent rows after them, its latent outputs in `attn`).
    pub mla: Option<MlaScratch<T>>,
}

/// A latent attention step's own activations, for its largest step.
pub struct MlaScratch<T> {
    /// `[T, q_lora_rank]`: the compressed query (when the model compresses it).
    pub q_compressed: Option<DeviceBuffer<T>>,
    /// `[T, heads * (rope + nope)]`.
    pub q: DeviceBuffer<T>,
    /// `[T, heads * v_head_dim]`.
    pub values: DeviceBuffer<T>,
}

/// Page-table positions the decode's gather workspace holds: every request's pages once
/// (`max_context` rounded up, plus a partial first page), bounded by twice the pool (pages
/// shared between requests are listed once per request).
fn decode_capacity_pages(options: &CudaCacheOptions) -> usize {
    let page_size = options.page_size.max(1);
    let per_request = options.max_context.div_ceil(page_size) + 1;
    let requests = options.max_batch_requests.max(1);
    (requests * per_request).min(2 * options.num_pages + requests)
}

impl<T: HostFloat> Scratch<T> {
    fn new(gpu: &Gpu, c: &ModelConfig, o: &CudaCacheOptions) -> Result<Self, CudaError> {
        let tokens = o.max_batch_tokens.max(1);
        let requests = o.max_batch_requests.max(1);
        let q_dim = c.num_attention_heads * c.head_dim;
        let kv_dim = c.num_kv_heads * c.head_dim;
        // Shared prefix pages appear once per request that holds them.
        let table_pages =
            o.num_pages.max(1) + requests * o.max_context.div_ceil(o.page_size.max(1));
        Ok(Scratch {
            x: gpu.zeros(tokens * c.hidden_size)?,
            normed: gpu.zeros(tokens * c.hidden_size)?,
            qkv: gpu.zeros(tokens * (q_dim + 2 * kv_dim))?,
            attn: gpu.zeros(tokens * q_dim)?,
            gate_up: gpu.zeros(tokens * 2 * c.intermediate_size)?,
            act: gpu.zeros(tokens * c.intermediate_size)?,
            selected: gpu.zeros(tokens * c.hidden_size)?,
            selected_normed: gpu.zeros(tokens * c.hidden_size)?,
            logits: gpu.zeros(tokens * c.vocab_size)?,
            tokens: gpu.zeros(tokens)?,
            positions: gpu.zeros(tokens)?,
            slots: gpu.zeros(tokens)?,
            qo_indptr: gpu.zeros(requests + 1)?,
            page_indptr: gpu.zeros(requests + 1)?,
            page_indices: gpu.zeros(table_pages)?,
            last_page_len: gpu.zeros(requests)?,
            first_page_offset: gpu.zeros(requests)?,
            logits_rows: gpu.zeros(tokens)?,
            mla: match &c.mla {
                Some(m) => Some(MlaScratch {
                    q_compressed: m.q_lora_rank.map(|r| gpu.zeros(tokens * r)).transpose()?,
                    q: gpu.zeros(tokens * c.num_attention_heads * m.q_head_dim())?,
                    values: gpu.zeros(tokens * c.num_attention_heads * m.v_head_dim)?,
                }),
                None => None,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_capacity_covers_every_request_at_full_context() {
        let options = CudaCacheOptions {
            num_pages: 1000,
            page_size: 16,
            max_batch_tokens: 64,
            max_batch_requests: 4,
            max_context: 100,
            cuda_graphs: true,
            paged_decode: Default::default(),
            kernels: Default::default(),
        };
        // 100 tokens from a mid-page start span at most 8 pages.
        assert_eq!(decode_capacity_pages(&options), 4 * 8);
        let small_pool = CudaCacheOptions {
            num_pages: 10,
            ..options
        };
        assert_eq!(decode_capacity_pages(&small_pool), 24);
    }
}
