//! cuBLASLt's FP8 GEMM ([`Gpu::gemm_fp8`]): e4m3 weights with one f32 factor per row against
//! e4m3 activations with one f32 factor per row (token), both given to cuBLASLt as outer
//! vectors (`CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F`), so the factors are applied in the
//! GEMM's epilogue: `out[i, j] = beta * out[i, j] + a_scale[i] * w_scale[j] * sum_k a[i, k]
//! w[j, k]`, f32 accumulation. The same "TN" product as the plain GEMM (module docs of
//! `blas`); plans cached per [`Fp8Key`]. Never batch-invariant: deterministic mode decodes
//! FP8 matrices for the plain GEMM instead.

use std::ffi::c_void;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;

use super::{blas_error, data_type, Blas, Plan};
use crate::error::check_len;
use crate::key::DType;
use crate::memory::{DeviceRead, DeviceWrite};
use crate::{CudaError, Element, Gpu};

/// Identifies a cached FP8 plan: the shape, the output dtype and whether `beta != 0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Fp8Key {
    m: usize,
    n: usize,
    k: usize,
    output: DType,
    accumulate: bool,
}

/// Sets a matmul descriptor attribute of type `V`.
fn set_desc<V>(
    desc: sys::cublasLtMatmulDesc_t,
    attribute: sys::cublasLtMatmulDescAttributes_t,
    value: V,
) -> Result<(), CudaError> {
    // SAFETY: a live descriptor; `V` is the attribute's type (i32 scale mode, a pointer).
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attribute,
            &value as *const V as *const c_void,
            std::mem::size_of::<V>(),
        )
    }
    .map_err(blas_error("cublasLtMatmulDescSetAttribute (FP8 scales)"))
}

/// cuBLASLt's A scale (the weights' factors, its A being the weights) and B scale (the
/// activations').
fn set_scales(
    desc: sys::cublasLtMatmulDesc_t,
    (weights, activations): (u64, u64),
) -> Result<(), CudaError> {
    use sys::cublasLtMatmulDescAttributes_t as Attribute;
    set_desc(
        desc,
        Attribute::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
        weights,
    )?;
    set_desc(
        desc,
        Attribute::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
        activations,
    )
}

impl Blas {
    /// The plan of `key`, its scale pointers set to `scales` (the weights', the activations').
    fn fp8_plan(&mut self, key: Fp8Key, scales: (u64, u64)) -> Result<&Plan, CudaError> {
        if !self.fp8.contains_key(&key) {
            let plan = self.create_fp8_plan(key, scales)?;
            self.fp8.insert(key, plan);
        }
        let plan = &self.fp8[&key];
        set_scales(plan.desc, scales)?;
        Ok(plan)
    }

    /// The heuristic needs the vector scales' pointers set (null ones are an invalid value).
    fn create_fp8_plan(&mut self, key: Fp8Key, scales: (u64, u64)) -> Result<Plan, CudaError> {
        use sys::cublasLtMatmulDescAttributes_t as Attribute;
        let outer = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
        let e4m3 = sys::cudaDataType::CUDA_R_8F_E4M3;
        let (m, n, k) = (key.m as u64, key.n as u64, key.k as u64);
        let desc = self.transposed_desc()?;
        let mut layouts = Vec::with_capacity(3);
        let made = set_desc(
            desc,
            Attribute::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
            outer as i32,
        )
        .and_then(|()| {
            set_desc(
                desc,
                Attribute::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                outer as i32,
            )
        })
        .and_then(|()| set_scales(desc, scales))
        .and_then(|()| {
            let output = data_type(key.output)?;
            for (dtype, rows, cols) in [(e4m3, k, n), (e4m3, k, m), (output, n, m)] {
                let layout = lt::create_matrix_layout(dtype, rows, cols, rows as i64)
                    .map_err(blas_error("FP8 GEMM layout"))?;
                layouts.push(layout);
            }
            self.heuristic(desc, layouts[0], layouts[1], layouts[2])
        });
        match made {
            Ok(algo) => Ok(Plan {
                desc,
                weights_layout: layouts[0],
                activations_layout: layouts[1],
                out_layout: layouts[2],
                algo,
            }),
            Err(error) => {
                // SAFETY: created above, not used after.
                unsafe {
                    for layout in layouts {
                        let _ = lt::destroy_matrix_layout(layout);
                    }
                    let _ = lt::destroy_matmul_desc(desc);
                }
                Err(error)
            }
        }
    }
}

impl Gpu {
    /// Whether [`Gpu::gemm_fp8`] can run here: compute capability 8.9 or later (FP8 tensor
    /// cores).
    pub fn fp8_gemm_supported(&self) -> bool {
        self.info().compute_capability >= (8, 9)
    }

    /// `out[m, n] = beta * out + a_scale[i] * w_scale[j] * (a[m, k] · w[n, k]^T)`: e4m3 codes
    /// (one byte a value, row-major) with an f32 factor per row of each, f32 accumulation, out
    /// bf16 or f32. `k` a multiple of 16 and `n` of 8 (cuBLASLt's FP8 leading dimensions);
    /// operands as allocated (256-byte aligned). The plan is made on the first call per shape
    /// (an error if cuBLASLt has no algorithm for it); then graph-capturable.
    pub fn gemm_fp8<TOut: Element>(
        &self,
        (activations, activation_scales): (&impl DeviceRead<u8>, &impl DeviceRead<f32>),
        (weights, weight_scales): (&impl DeviceRead<u8>, &impl DeviceRead<f32>),
        out: &mut impl DeviceWrite<TOut>,
        (m, n, k): (usize, usize, usize),
        beta: f32,
    ) -> Result<(), CudaError> {
        if !matches!(TOut::DTYPE, DType::BF16 | DType::F32) {
            return Err(CudaError::invalid(format!(
                "FP8 GEMM writes bf16 or f32, not {}",
                TOut::DTYPE
            )));
        }
        if m == 0 || n == 0 || k == 0 || k % 16 != 0 || n % 8 != 0 {
            return Err(CudaError::invalid(format!(
                "FP8 GEMM needs m >= 1, n a multiple of 8 and k of 16, got {m}, {n}, {k}"
            )));
        }
        check_len("FP8 GEMM activations [m, k]", m * k, activations.len())?;
        check_len("FP8 GEMM activation scales [m]", m, activation_scales.len())?;
        check_len("FP8 GEMM weights [n, k]", n * k, weights.len())?;
        check_len("FP8 GEMM weight scales [n]", n, weight_scales.len())?;
        check_len("FP8 GEMM out [m, n]", m * n, out.len())?;
        let key = Fp8Key {
            m,
            n,
            k,
            output: TOut::DTYPE,
            accumulate: beta != 0.0,
        };
        let mut guard = self.lock_blas()?;
        let blas = guard.as_mut().expect("lock_blas initialises it");
        let launch = blas.launch(self);
        let scales = (weight_scales.device_ptr(), activation_scales.device_ptr());
        let plan = blas.fp8_plan(key, scales)?;
        let ptrs = (
            weights.device_ptr(),
            activations.device_ptr(),
            out.device_ptr(),
        );
        // SAFETY: lengths checked; the plan matches these dtypes and shapes, its scale
        // pointers were just set to the live factors.
        unsafe { plan.run(launch, ptrs, beta, "cublasLtMatmul (FP8)") }
    }
}
