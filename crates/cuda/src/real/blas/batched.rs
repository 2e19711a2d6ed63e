//! Strided batched GEMM ([`Gpu::gemm_batched`]): `batch` products of one shape in one
//! cuBLASLt call, each product's activations and output at a fixed offset of one buffer with
//! strided rows, the weights `[batch, n, k]` contiguous. DeepSeek's latent attention runs
//! its per-head up-projections this way (one weight per head over the head's columns of a
//! `[tokens, heads, width]` activation). Plans are cached per [`BatchedKey`] as the plain
//! GEMM's are; in batch-invariant mode the algorithm is the one the heuristic picks at
//! [`BATCH_INVARIANT_REFERENCE_M`] rows with split-K off, checked at the call's `m`.

use std::ffi::c_void;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;

use super::{blas_error, data_type, set_algo_config, Blas, Plan, BATCH_INVARIANT_REFERENCE_M};
use crate::error::check_min_len;
use crate::key::DType;
use crate::memory::{DeviceRead, DeviceWrite};
use crate::{CudaError, Element, GemmBatch, Gpu};

/// Identifies a cached batched plan: shape, layout, dtypes and whether `beta != 0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct BatchedKey {
    m: usize,
    n: usize,
    k: usize,
    layout: GemmBatch,
    input: DType,
    output: DType,
    accumulate: bool,
}

/// Sets an attribute of a matrix layout.
fn set_layout<V>(
    layout: sys::cublasLtMatrixLayout_t,
    attribute: sys::cublasLtMatrixLayoutAttribute_t,
    value: V,
) -> Result<(), CudaError> {
    // SAFETY: a live layout; `V` is the attribute's type (i32 batch count, i64 offset).
    unsafe {
        lt::set_matrix_layout_attribute(
            layout,
            attribute,
            &value as *const V as *const c_void,
            std::mem::size_of::<V>(),
        )
    }
    .map_err(blas_error("cublasLtMatrixLayoutSetAttribute"))
}

/// A column-major `[rows, cols]` layout with leading dimension `ld`, `batch` of them
/// `batch_stride` elements apart.
fn batched_layout(
    dtype: DType,
    (rows, cols, ld): (usize, usize, usize),
    batch: usize,
    batch_stride: usize,
) -> Result<sys::cublasLtMatrixLayout_t, CudaError> {
    let layout = lt::create_matrix_layout(data_type(dtype)?, rows as u64, cols as u64, ld as i64)
        .map_err(blas_error("batched layout"))?;
    use sys::cublasLtMatrixLayoutAttribute_t as Attribute;
    let set = set_layout(
        layout,
        Attribute::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
        batch as i32,
    )
    .and_then(|()| {
        set_layout(
            layout,
            Attribute::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
            batch_stride as i64,
        )
    });
    if let Err(error) = set {
        // SAFETY: created above, not used after.
        let _ = unsafe { lt::destroy_matrix_layout(layout) };
        return Err(error);
    }
    Ok(layout)
}

/// The operands' alignment in bytes the algorithm may assume: the largest power of two up
/// to 256 dividing every product's offset and row stride (the buffers themselves are
/// allocated 256-byte aligned).
fn alignment(key: &BatchedKey) -> u32 {
    let l = key.layout;
    let bytes = |elements: usize, dtype: DType| elements * dtype.size_bytes();
    [
        bytes(l.activations_row_stride, key.input),
        bytes(l.activations_batch_stride, key.input),
        bytes(key.n * key.k, key.input),
        bytes(l.out_row_stride, key.output),
        bytes(l.out_batch_stride, key.output),
    ]
    .into_iter()
    .fold(256usize, |alignment, stride| {
        alignment.min(1 << stride.trailing_zeros().min(8))
    }) as u32
}

/// The activations and output layouts of `key` at `m` rows.
fn row_layouts(
    key: &BatchedKey,
    m: usize,
) -> Result<(sys::cublasLtMatrixLayout_t, sys::cublasLtMatrixLayout_t), CudaError> {
    let l = key.layout;
    let activations = batched_layout(
        key.input,
        (key.k, m, l.activations_row_stride),
        l.batch,
        l.activations_batch_stride,
    )?;
    let out = batched_layout(
        key.output,
        (key.n, m, l.out_row_stride),
        l.batch,
        l.out_batch_stride,
    );
    match out {
        Ok(out) => Ok((activations, out)),
        Err(error) => {
            // SAFETY: created above, not used after.
            let _ = unsafe { lt::destroy_matrix_layout(activations) };
            Err(error)
        }
    }
}

impl Blas {
    pub(super) fn batched_plan(&mut self, key: BatchedKey) -> Result<&Plan, CudaError> {
        if !self.batched.contains_key(&key) {
            let plan = self.create_batched_plan(key)?;
            self.batched.insert(key, plan);
        }
        Ok(&self.batched[&key])
    }

    fn create_batched_plan(&mut self, key: BatchedKey) -> Result<Plan, CudaError> {
        let desc = self.transposed_desc()?;
        let l = key.layout;
        let weights_layout =
            batched_layout(key.input, (key.k, key.n, key.k), l.batch, key.n * key.k);
        let weights_layout = match weights_layout {
            Ok(layout) => layout,
            Err(error) => {
                // SAFETY: created above, not used after.
                let _ = unsafe { lt::destroy_matmul_desc(desc) };
                return Err(error);
            }
        };
        let (activations_layout, out_layout) = match row_layouts(&key, key.m) {
            Ok(layouts) => layouts,
            Err(error) => {
                // SAFETY: created above, not used after.
                unsafe {
                    let _ = lt::destroy_matrix_layout(weights_layout);
                    let _ = lt::destroy_matmul_desc(desc);
                }
                return Err(error);
            }
        };
        let layouts = (weights_layout, activations_layout, out_layout);
        let algo = if self.batch_invariant {
            self.batched_fixed_algorithm(&key, desc, layouts)
        } else {
            self.heuristic_aligned(desc, layouts, Some(alignment(&key)))
        };
        let plan = |algo| Plan {
            desc,
            weights_layout,
            activations_layout,
            out_layout,
            algo,
        };
        match algo {
            Ok(algo) => Ok(plan(algo)),
            Err(error) => {
                // SAFETY: created above, not used after.
                unsafe {
                    let _ = lt::destroy_matrix_layout(weights_layout);
                    let _ = lt::destroy_matrix_layout(activations_layout);
                    let _ = lt::destroy_matrix_layout(out_layout);
                    let _ = lt::destroy_matmul_desc(desc);
                }
                Err(error)
            }
        }
    }

    /// Batch-invariant mode: the heuristic's algorithm at the reference `m`, split-K off,
    /// checked against the plan's own layouts.
    fn batched_fixed_algorithm(
        &self,
        key: &BatchedKey,
        desc: sys::cublasLtMatmulDesc_t,
        (weights_layout, activations_layout, out_layout): (
            sys::cublasLtMatrixLayout_t,
            sys::cublasLtMatrixLayout_t,
            sys::cublasLtMatrixLayout_t,
        ),
    ) -> Result<sys::cublasLtMatmulAlgo_t, CudaError> {
        let (activations, out) = row_layouts(key, BATCH_INVARIANT_REFERENCE_M)?;
        let reference = (weights_layout, activations, out);
        let algo = self.heuristic_aligned(desc, reference, Some(alignment(key)));
        // SAFETY: created above, not used after.
        unsafe {
            let _ = lt::destroy_matrix_layout(activations);
            let _ = lt::destroy_matrix_layout(out);
        }
        let mut algo = algo?;
        use sys::cublasLtMatmulAlgoConfigAttributes_t as Config;
        let none = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_NONE as u32;
        set_algo_config(&mut algo, Config::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 1)?;
        set_algo_config(
            &mut algo,
            Config::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
            none,
        )?;
        let mut result = std::mem::MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::uninit();
        // SAFETY: live descriptors and algorithm; `result` is written by the call.
        unsafe {
            sys::cublasLtMatmulAlgoCheck(
                self.handle,
                desc,
                weights_layout,
                activations_layout,
                out_layout,
                out_layout,
                &algo,
                result.as_mut_ptr(),
            )
            .result()
        }
        .map_err(blas_error(
            "batch-invariant batched GEMM (cublasLtMatmulAlgoCheck)",
        ))?;
        Ok(algo)
    }
}

impl Gpu {
    /// For `b < layout.batch`: `out_b[m, n] = activations_b[m, k] · weights_b[n, k]^T + beta ·
    /// out_b`, row-major, f32 accumulation, where `activations_b` starts at `b *
    /// activations_batch_stride` of `activations` (rows `activations_row_stride` apart),
    /// `out_b` likewise in `out`, and `weights_b` is `weights[b * n * k..][..n * k]`. The
    /// dtypes of [`Gpu::gemm`]; elements of `out` outside the products are untouched. Strides
    /// and offsets must keep cuBLASLt's 16-byte alignment (multiples of 8 bf16 or 4 f32
    /// values). Graph-capturable once the plan exists.
    pub fn gemm_batched<TIn: Element, TOut: Element>(
        &self,
        activations: &impl DeviceRead<TIn>,
        weights: &impl DeviceRead<TIn>,
        out: &mut impl DeviceWrite<TOut>,
        (m, n, k): (usize, usize, usize),
        layout: GemmBatch,
        beta: f32,
    ) -> Result<(), CudaError> {
        let combination = (TIn::DTYPE, TOut::DTYPE);
        if !matches!(
            combination,
            (DType::BF16, DType::BF16)
                | (DType::BF16, DType::F32)
                | (DType::F16, DType::F16)
                | (DType::F32, DType::F32)
        ) {
            return Err(CudaError::invalid(format!(
                "gemm_batched {} -> {} is not supported (bf16->bf16, bf16->f32, f16->f16, f32->f32)",
                combination.0, combination.1
            )));
        }
        if m == 0 || n == 0 || k == 0 || layout.batch == 0 {
            return Err(CudaError::invalid(format!(
                "gemm_batched needs m, n, k, batch >= 1, got {m}, {n}, {k}, {}",
                layout.batch
            )));
        }
        if layout.activations_row_stride < k || layout.out_row_stride < n {
            return Err(CudaError::invalid(format!(
                "gemm_batched row strides ({}, {}) must be >= (k {k}, n {n})",
                layout.activations_row_stride, layout.out_row_stride
            )));
        }
        check_min_len(
            "gemm_batched activations",
            layout.activations_len(m, k),
            activations.len(),
        )?;
        check_min_len(
            "gemm_batched weights [batch, n, k]",
            layout.batch * n * k,
            weights.len(),
        )?;
        check_min_len("gemm_batched out", layout.out_len(m, n), out.len())?;
        let key = BatchedKey {
            m,
            n,
            k,
            layout,
            input: TIn::DTYPE,
            output: TOut::DTYPE,
            accumulate: beta != 0.0,
        };
        let mut guard = self.lock_blas()?;
        let blas = guard.as_mut().expect("lock_blas initialises it");
        let launch = blas.launch(self);
        let plan = blas.batched_plan(key)?;
        let ptrs = (
            weights.device_ptr(),
            activations.device_ptr(),
            out.device_ptr(),
        );
        // SAFETY: extents checked; the plan matches these dtypes, shapes and strides.
        unsafe { plan.run(launch, ptrs, beta, "cublasLtMatmul (batched)") }
    }
}
