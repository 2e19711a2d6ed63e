//! DeepSeek's multi-head latent attention (MLA) on CUDA, absorbed form, over the latent paged
//! pool (the device twin of `attention::mla_attention`; ADR 0009).
//!
//! The pool is a [`PoolLayout`] with `num_kv_heads = 1` and `head_dim = latent_dim +
//! rope_dim` (576 in DeepSeek-V2/V3): one row per token, the normed latent `c` then the rotated
//! RoPE key, addressed through the batch's [`DevicePageTable`]. Queries arrive absorbed (per
//! head `[W_UK^T q_nope, q_rope]`, `latent_dim + rope_dim` values); the output is the latent
//! `Σ p c` per head (`latent_dim`), which the model takes through `W_UV` after.
//!
//! - [`mla_append`]: write a step's latent rows into the pool at their slots.
//! - [`mla_decode`]: one query per request, all heads, split into chunks by the fused decode's
//!   [`PagedDecodePlan`] (its "KV heads" are the head tiles, [`mla_head_tiles`]) and merged by
//!   [`merge_attention_partials`] at `head_dim = latent_dim`. Two partial kernels
//!   ([`MlaKernel`]): CUDA cores (every dtype, the f32 exact path) and tensor cores (bf16).
//! - [`mla_prefill`]: causal ragged prefill, one CTA per (query token, head tile), no split.

use super::gathered::{DevicePageTable, PoolLayout, Queries};
pub use super::mla_decode::{mla_decode, MlaDecodeWorkspace};
use super::{MLA_APPEND, MLA_DECODE, MLA_DECODE_MMA};
use crate::cuda_dtypes::check_float;
use pagoda_cuda::{
    check_len, check_min_len, ptr, to_u32, whole, CudaError, DType, DeviceRead, DeviceView,
    DeviceWrite, Element, Gpu, KernelArg, KernelSpec, LaunchDims,
};

/// Latent widths (`kv_lora_rank`) the MLA kernels are instantiated for.
pub const MLA_LATENT_DIMS: [usize; 1] = [512];
/// The decoupled RoPE key width (`qk_rope_head_dim`) the MLA kernels are instantiated for.
pub const MLA_ROPE_DIM: usize = 64;
/// Query heads per CTA (`HEAD_TILE` in `mla_common.cu`): the head count must be a multiple.
pub const MLA_HEAD_TILE: usize = 16;
/// Threads and dynamic shared memory of the CUDA-core kernels (`mla_decode.cu`).
pub(super) const CC_THREADS: u32 = 256;
const CC_TILE_KEYS: usize = 16;
const CC_STAGES: usize = 2;

/// The entry points of the MLA sources.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlaEntry {
    /// `mla_append` (`mla_append.cu`): the latent rows into the pool.
    Append,
    /// `mla_decode_partial`: the split-KV decode on CUDA cores.
    DecodePartial,
    /// `mla_decode_partial_mma`: the same on tensor cores (bf16), `stages` tiles in flight.
    DecodePartialMma {
        /// cp.async pipeline depth (2 or 3).
        stages: usize,
    },
    /// `mla_prefill`: the causal ragged prefill on CUDA cores.
    Prefill,
}

/// Which partial kernel computes the decode chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MlaKernel {
    /// CUDA cores: f32, bf16 and f16 pools.
    CudaCore,
    /// Tensor cores (mma.sync m16n8k16 bf16, f32 accumulation): bf16 pools; the heads are
    /// the MMA rows, each latent tile is loaded once into shared memory for 16 heads.
    TensorCore {
        /// Tiles of 32 latent rows in flight (2: two CTAs per SM; 3: one).
        stages: usize,
    },
}

/// The default pipeline depth of [`MlaKernel::TensorCore`].
pub const MLA_MMA_STAGES: usize = 2;

/// The specialisation of `entry` for pool/query/output `dtype` and the row split
/// `latent_dim + rope_dim`.
pub fn specialize_mla(
    entry: MlaEntry,
    dtype: DType,
    latent_dim: usize,
    rope_dim: usize,
) -> Result<KernelSpec, CudaError> {
    if dtype != DType::F16 {
        check_float("mla", dtype)?;
    }
    if entry == MlaEntry::Append {
        return Ok(KernelSpec {
            source: &MLA_APPEND,
            entry: "mla_append",
            params: vec![],
            dtypes: vec![("T", dtype)],
        });
    }
    if !MLA_LATENT_DIMS.contains(&latent_dim) || rope_dim != MLA_ROPE_DIM {
        return Err(CudaError::invalid(format!(
            "MLA attention runs latent_dim {MLA_LATENT_DIMS:?} with rope_dim {MLA_ROPE_DIM}, \
             not {latent_dim} + {rope_dim}"
        )));
    }
    let dims = |mut params: Vec<(&'static str, i64)>| {
        params.extend([
            ("LATENT_DIM", latent_dim as i64),
            ("ROPE_DIM", rope_dim as i64),
        ]);
        params
    };
    let (source, name, params) = match entry {
        MlaEntry::DecodePartial => (&MLA_DECODE, "mla_decode_partial", dims(vec![])),
        MlaEntry::Prefill => (&MLA_DECODE, "mla_prefill", dims(vec![])),
        MlaEntry::DecodePartialMma { stages } => {
            if dtype != DType::BF16 || !(2..=3).contains(&stages) {
                return Err(CudaError::invalid(format!(
                    "the tensor-core MLA decode runs bf16 with 2 or 3 stages, not {dtype} with {stages}"
                )));
            }
            let params = dims(vec![("STAGES", stages as i64)]);
            (&MLA_DECODE_MMA, "mla_decode_partial_mma", params)
        }
        MlaEntry::Append => unreachable!("returned above"),
    };
    Ok(KernelSpec {
        source,
        entry: name,
        params,
        dtypes: vec![("T", dtype)],
    })
}

/// Every specialisation the MLA launchers can request (and the merge at the latent widths,
/// which `paged_decode` lists).
pub fn specializations() -> Result<Vec<KernelSpec>, CudaError> {
    let mut specs = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        specs.push(specialize_mla(MlaEntry::Append, dtype, 0, 0)?);
        for &latent_dim in &MLA_LATENT_DIMS {
            for entry in [MlaEntry::DecodePartial, MlaEntry::Prefill] {
                specs.push(specialize_mla(entry, dtype, latent_dim, MLA_ROPE_DIM)?);
            }
            if dtype == DType::BF16 {
                for stages in [2, 3] {
                    let entry = MlaEntry::DecodePartialMma { stages };
                    specs.push(specialize_mla(entry, dtype, latent_dim, MLA_ROPE_DIM)?);
                }
            }
        }
    }
    Ok(specs)
}

/// Head tiles of `num_heads` query heads: the "KV heads" of the decode plan (one CTA per
/// chunk and tile).
pub fn mla_head_tiles(num_heads: usize) -> usize {
    num_heads / MLA_HEAD_TILE
}

/// Why the MLA kernels cannot serve this geometry (`None`: they can).
pub fn mla_unsupported(
    dtype: DType,
    layout: &PoolLayout,
    num_heads: usize,
    latent_dim: usize,
) -> Option<String> {
    let rope_dim = layout.head_dim.saturating_sub(latent_dim);
    if !matches!(dtype, DType::BF16 | DType::F16 | DType::F32) {
        Some(format!("dtype {dtype}"))
    } else if layout.num_kv_heads != 1 {
        Some(format!(
            "{} KV heads (a latent pool has one)",
            layout.num_kv_heads
        ))
    } else if !MLA_LATENT_DIMS.contains(&latent_dim) || rope_dim != MLA_ROPE_DIM {
        Some(format!("a latent row of {latent_dim} + {rope_dim}"))
    } else if num_heads == 0 || !num_heads.is_multiple_of(MLA_HEAD_TILE) {
        Some(format!(
            "{num_heads} query heads (a multiple of {MLA_HEAD_TILE})"
        ))
    } else if !layout.page_size.is_power_of_two() {
        Some(format!(
            "page size {} (not a power of two)",
            layout.page_size
        ))
    } else {
        None
    }
}

/// One layer's latent pool as the MLA launchers read it.
#[derive(Clone, Copy, Debug)]
pub struct LatentPool<'a, T> {
    /// `[num_pages, page_size, 1, latent_dim + rope_dim]`.
    pub pool: DeviceView<'a, T>,
    /// The pool's shape (`num_kv_heads` 1, `head_dim = latent_dim + rope_dim`).
    pub layout: PoolLayout,
    /// Which pages each request reads.
    pub page_table: DevicePageTable<'a>,
    /// The latent width (`kv_lora_rank`); the rest of a row is the RoPE key.
    pub latent_dim: usize,
}

impl<'a, T> LatentPool<'a, T> {
    /// Borrows the pool (its length is checked by each launcher against `layout`).
    pub fn new(
        pool: &'a impl DeviceRead<T>,
        layout: PoolLayout,
        page_table: DevicePageTable<'a>,
        latent_dim: usize,
    ) -> Self {
        LatentPool {
            pool: whole(pool),
            layout,
            page_table,
            latent_dim,
        }
    }

    /// Checks the geometry for `num_heads` query heads of dtype `T` and the pool's length.
    pub(super) fn check(&self, num_heads: usize) -> Result<(), CudaError>
    where
        T: Element,
    {
        self.layout.validate()?;
        if let Some(reason) = mla_unsupported(T::DTYPE, &self.layout, num_heads, self.latent_dim) {
            return Err(CudaError::invalid(format!(
                "MLA attention does not support {reason}"
            )));
        }
        check_len(
            "latent pool [num_pages, page_size, 1, latent_dim + rope_dim]",
            self.layout.pool_len(),
            self.pool.len(),
        )
    }
}

/// A step's new latent rows and where they go: token `t`'s latent (`latent_dim` values at
/// `t * latent_row_stride` of `latent`) and rotated RoPE key (`rope_dim` at `t *
/// rope_row_stride` of `k_rope`) become pool row `slots[t]` (`page * page_size + offset`).
#[derive(Clone, Copy, Debug)]
pub struct NewLatent<'a, T> {
    /// The normed latents.
    pub latent: DeviceView<'a, T>,
    /// Elements from one latent row to the next.
    pub latent_row_stride: usize,
    /// The rotated RoPE keys.
    pub k_rope: DeviceView<'a, T>,
    /// Elements from one RoPE key row to the next.
    pub rope_row_stride: usize,
    /// Pool row per token; negative or out-of-pool slots are skipped (padding rows).
    pub slots: DeviceView<'a, i32>,
}

/// Writes the rows of `new` into `pool` (`[num_pages, page_size, 1, latent_dim + rope_dim]`,
/// shaped by `layout`), bit for bit.
pub fn mla_append<T: Element>(
    gpu: &Gpu,
    new: &NewLatent<'_, T>,
    pool: &mut impl DeviceWrite<T>,
    layout: &PoolLayout,
    latent_dim: usize,
) -> Result<(), CudaError> {
    let spec = specialize_mla(MlaEntry::Append, T::DTYPE, latent_dim, 0)?;
    layout.validate()?;
    if layout.num_kv_heads != 1 || latent_dim == 0 || latent_dim >= layout.head_dim {
        return Err(CudaError::invalid(format!(
            "a latent pool has one head of latent_dim + rope_dim values; got {} heads of {}, \
             latent_dim {latent_dim}",
            layout.num_kv_heads, layout.head_dim
        )));
    }
    let rope_dim = layout.head_dim - latent_dim;
    check_len(
        "latent pool [num_pages, page_size, 1, latent_dim + rope_dim]",
        layout.pool_len(),
        pool.len(),
    )?;
    if new.latent_row_stride < latent_dim || new.rope_row_stride < rope_dim {
        return Err(CudaError::invalid(format!(
            "mla_append row strides ({}, {}) must be >= ({latent_dim}, {rope_dim})",
            new.latent_row_stride, new.rope_row_stride
        )));
    }
    let num_tokens = new.slots.len();
    if num_tokens > 0 {
        let last = num_tokens - 1;
        let latent_len = last * new.latent_row_stride + latent_dim;
        check_min_len("mla_append latent", latent_len, new.latent.len())?;
        let rope_len = last * new.rope_row_stride + rope_dim;
        check_min_len("mla_append k_rope", rope_len, new.k_rope.len())?;
    }
    let args = [
        ptr(pool),
        ptr(&new.latent),
        ptr(&new.k_rope),
        ptr(&new.slots),
        KernelArg::U32(to_u32("latent_dim", latent_dim)?),
        KernelArg::U32(to_u32("rope_dim", rope_dim)?),
        KernelArg::U32(to_u32("latent_row_stride", new.latent_row_stride)?),
        KernelArg::U32(to_u32("rope_row_stride", new.rope_row_stride)?),
        KernelArg::I64((layout.num_pages * layout.page_size) as i64),
    ];
    let dims = LaunchDims::new((to_u32("num_tokens", num_tokens)?, 1), 128);
    // SAFETY: arguments match `mla_append`; extents validated, slots bounds-checked on device.
    unsafe { gpu.launch(&spec, dims, &args) }
}

/// Causal ragged absorbed MLA (queries already appended): `q` holds `num_tokens` rows
/// (`row_stride` apart) split by request by `qo_indptr [B + 1]`; query `j` of request `r`
/// attends to visible tokens `0 ..= seq_len - q_len + j`. `out` is `[num_tokens, num_heads,
/// latent_dim]`, fully overwritten (zeros outside `qo_indptr`). CUDA cores, one CTA per
/// (token, head tile): correct at any length, built for short prompts.
pub fn mla_prefill<T: Element>(
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    kv: &LatentPool<'_, T>,
    qo_indptr: &impl DeviceRead<u32>,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let num_heads = queries.num_heads;
    kv.check(num_heads)?;
    let (layout, table, latent_dim) = (&kv.layout, &kv.page_table, kv.latent_dim);
    let spec = specialize_mla(
        MlaEntry::Prefill,
        T::DTYPE,
        latent_dim,
        layout.head_dim - latent_dim,
    )?;
    check_len(
        "qo_indptr [B + 1]",
        table.num_requests() + 1,
        qo_indptr.len(),
    )?;
    let row = num_heads * latent_dim;
    if out.len() % row != 0 {
        return Err(CudaError::invalid(format!(
            "mla prefill out has {} elements, not [T, {num_heads}, {latent_dim}]",
            out.len()
        )));
    }
    let num_tokens = out.len() / row;
    check_query_rows(queries, num_tokens, layout.head_dim)?;
    if num_tokens == 0 {
        return Ok(());
    }
    let args = [
        ptr(&queries.data),
        ptr(&kv.pool),
        ptr(&table.indptr),
        ptr(&table.indices),
        ptr(&table.last_page_len),
        ptr(&table.first_page_offset),
        ptr(qo_indptr),
        ptr(out),
        KernelArg::U32(to_u32("num_requests", table.num_requests())?),
        KernelArg::U32(to_u32("num_heads", num_heads)?),
        KernelArg::U32(layout.page_size.trailing_zeros()),
        KernelArg::U32(to_u32("num_pages", layout.num_pages)?),
        KernelArg::U32(to_u32("q_row_stride", queries.row_stride)?),
        KernelArg::F32(scale * std::f32::consts::LOG2_E),
    ];
    let grid = (
        to_u32("num_tokens", num_tokens)?,
        to_u32("head tiles", mla_head_tiles(num_heads))?,
    );
    let dims = LaunchDims {
        shared_mem_bytes: cuda_core_shared_bytes(std::mem::size_of::<T>(), layout.head_dim) as u32,
        ..LaunchDims::new(grid, CC_THREADS)
    };
    // SAFETY: arguments match `mla_prefill`; pool, q, qo_indptr and out extents validated;
    // page ids >= num_pages are skipped on the device.
    unsafe { gpu.launch(&spec, dims, &args) }
}

/// `rows` query rows of `num_heads` heads of `row_dim` values, `row_stride` apart.
pub(super) fn check_query_rows<T>(
    queries: &Queries<'_, T>,
    rows: usize,
    row_dim: usize,
) -> Result<(), CudaError> {
    let width = queries.num_heads * row_dim;
    if queries.row_stride < width {
        return Err(CudaError::invalid(format!(
            "MLA q row_stride {} < num_heads * (latent_dim + rope_dim) {width}",
            queries.row_stride
        )));
    }
    if rows > 0 {
        let needed = (rows - 1) * queries.row_stride + width;
        check_min_len("MLA q", needed, queries.data.len())?;
    }
    Ok(())
}

/// Dynamic shared memory of the CUDA-core kernels (`CC_SMEM_BYTES` in `mla_decode.cu`).
pub(super) fn cuda_core_shared_bytes(element_bytes: usize, row_dim: usize) -> usize {
    CC_STAGES * CC_TILE_KEYS * row_dim * element_bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn latent_layout(page_size: usize, head_dim: usize) -> PoolLayout {
        PoolLayout {
            num_pages: 8,
            page_size,
            num_kv_heads: 1,
            head_dim,
        }
    }

    #[test]
    fn deepseek_shapes_are_served_and_others_declined_with_a_reason() {
        let bf16 = DType::BF16;
        for heads in [16, 128] {
            assert_eq!(
                mla_unsupported(bf16, &latent_layout(64, 576), heads, 512),
                None
            );
        }
        assert!(mla_unsupported(bf16, &latent_layout(16, 576), 24, 512).is_some());
        assert!(mla_unsupported(bf16, &latent_layout(16, 544), 16, 512).is_some());
        assert!(mla_unsupported(bf16, &latent_layout(12, 576), 16, 512).is_some());
        let two_heads = PoolLayout {
            num_kv_heads: 2,
            ..latent_layout(16, 576)
        };
        assert!(mla_unsupported(bf16, &two_heads, 16, 512).is_some());
        assert!(specialize_mla(
            MlaEntry::DecodePartialMma { stages: 2 },
            DType::F32,
            512,
            64
        )
        .is_err());
    }

    #[test]
    fn the_tensor_core_kernel_fits_two_ctas_per_sm_at_two_stages() {
        use super::super::mla_decode::mma_shared_bytes;
        // 227 KB of shared memory per SM on the H100/H200.
        assert!(2 * (mma_shared_bytes(576, 2) + 1024) <= 227 * 1024);
        assert!(mma_shared_bytes(576, 3) + 1024 <= 227 * 1024);
    }
}
