//! cuBLASLt GEMM for the model's linear layers, with one plan (descriptors + heuristic
//! algorithm) cached per shape.
//!
//! Batch-invariant mode ([`Gpu::set_gemm_batch_invariant`]): cuBLASLt's heuristic picks a
//! different kernel (tile, split-K) for a different `m`, so a row's bits would depend on how
//! many rows share the GEMM. In this mode every `m` of one `(n, k)` runs the one algorithm
//! the heuristic picks for [`BATCH_INVARIANT_REFERENCE_M`] rows, with split-K off: each
//! output element is reduced over `k` in the same order whatever `m` is.
//!
//! Row-major `out[m, n] = activations[m, k] · weights[n, k]^T (+ beta · out)` is computed
//! as the column-major "TN" product `D[n, m] = op_T(W)[n, k] · X[k, m]`, f32 accumulation.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, DevicePtr};

use super::{driver_error, Element, Gpu};
use crate::error::check_len;
use crate::key::DType;
use crate::memory::{DeviceRead, DeviceWrite};
use crate::CudaError;

mod batched;
mod fp8;

/// Identifies a cached GEMM plan: the shape, the dtypes and whether `beta != 0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmPlanKey {
    /// Rows of activations and output.
    pub m: usize,
    /// Rows of weights = columns of output.
    pub n: usize,
    /// Shared inner dimension.
    pub k: usize,
    /// Dtype of activations and weights.
    pub input: DType,
    /// Dtype of the output.
    pub output: DType,
    /// `beta != 0`: the output is read and accumulated into.
    pub accumulate: bool,
}

/// The `m` whose heuristic algorithm every `m` runs in batch-invariant mode: a decode batch
/// size (GEMMs are bandwidth-bound up to at least 64 rows on the H200), so decode keeps its
/// speed and long prefills pay.
pub const BATCH_INVARIANT_REFERENCE_M: usize = 64;

/// The algorithm of one weight shape in batch-invariant mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct FixedKey {
    n: usize,
    k: usize,
    input: DType,
    output: DType,
    accumulate: bool,
}

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    weights_layout: sys::cublasLtMatrixLayout_t,
    activations_layout: sys::cublasLtMatrixLayout_t,
    out_layout: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

/// Where a plan runs: the handle, the workspace and the stream.
#[derive(Clone, Copy)]
struct Launch {
    handle: sys::cublasLtHandle_t,
    workspace: (u64, usize),
    stream: sys::cudaStream_t,
}

impl Plan {
    /// `out = op_T(weights) · activations + beta · out` (device pointers) by this plan, alpha
    /// 1, on `launch`'s stream; `context` names a failure.
    ///
    /// # Safety
    /// The pointers hold live buffers of the plan's layouts.
    unsafe fn run(
        &self,
        launch: Launch,
        (weights, activations, out): (u64, u64, u64),
        beta: f32,
        context: &str,
    ) -> Result<(), CudaError> {
        let alpha = 1.0f32;
        // SAFETY: the caller's contract; the scalars live across the call.
        unsafe {
            lt::matmul(
                launch.handle,
                self.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                weights as *const c_void,
                self.weights_layout,
                activations as *const c_void,
                self.activations_layout,
                out as *const c_void,
                self.out_layout,
                out as *mut c_void,
                self.out_layout,
                &self.algo,
                launch.workspace.0 as *mut c_void,
                launch.workspace.1,
                launch.stream,
            )
        }
        .map_err(blas_error(context))
    }
}

pub(crate) struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    workspace_ptr: u64,
    plans: HashMap<GemmPlanKey, Plan>,
    /// Strided batched plans ([`Gpu::gemm_batched`]).
    batched: HashMap<batched::BatchedKey, Plan>,
    /// FP8 plans ([`Gpu::gemm_fp8`]).
    fp8: HashMap<fp8::Fp8Key, Plan>,
    /// Batch-invariant mode: the one algorithm per weight shape.
    batch_invariant: bool,
    fixed: HashMap<FixedKey, sys::cublasLtMatmulAlgo_t>,
}

// SAFETY: the handle and descriptors are only used under the Gpu's mutex.
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        self.clear_plans();
        // SAFETY: created by us, destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
        let _ = &self.workspace;
    }
}

impl Blas {
    fn clear_plans(&mut self) {
        let batched = self.batched.drain().map(|(_, plan)| plan);
        let fp8 = self.fp8.drain().map(|(_, plan)| plan);
        let plans = self.plans.drain().map(|(_, plan)| plan);
        for plan in plans.chain(batched).chain(fp8) {
            // SAFETY: created by us, destroyed once.
            unsafe {
                let _ = lt::destroy_matrix_layout(plan.weights_layout);
                let _ = lt::destroy_matrix_layout(plan.activations_layout);
                let _ = lt::destroy_matrix_layout(plan.out_layout);
                let _ = lt::destroy_matmul_desc(plan.desc);
            }
        }
        self.fixed.clear();
    }
}

fn blas_error(context: &str) -> impl FnOnce(lt::CublasError) -> CudaError + '_ {
    move |error| CudaError::Blas {
        context: context.to_string(),
        message: format!("{error:?}"),
    }
}

fn data_type(dtype: DType) -> Result<sys::cudaDataType, CudaError> {
    match dtype {
        DType::F32 => Ok(sys::cudaDataType::CUDA_R_32F),
        DType::BF16 => Ok(sys::cudaDataType::CUDA_R_16BF),
        DType::F16 => Ok(sys::cudaDataType::CUDA_R_16F),
        other => Err(CudaError::invalid(format!(
            "gemm does not support dtype {other}"
        ))),
    }
}

impl Blas {
    /// Where this state's plans run on `gpu`'s stream.
    fn launch(&self, gpu: &Gpu) -> Launch {
        Launch {
            handle: self.handle,
            workspace: (self.workspace_ptr, self.workspace.len()),
            stream: gpu.stream.cu_stream() as sys::cudaStream_t,
        }
    }

    fn new(gpu: &Gpu) -> Result<Blas, CudaError> {
        let handle = lt::create_handle().map_err(blas_error("cublasLtCreate"))?;
        let size = if gpu.info().compute_capability.0 >= 9 {
            32 << 20
        } else {
            4 << 20
        };
        // SAFETY: scratch memory, never read by the host.
        let workspace = unsafe { gpu.stream.alloc::<u8>(size) }
            .map_err(driver_error("allocating the cuBLASLt workspace"))?;
        let workspace_ptr = workspace.device_ptr(&gpu.stream).0;
        Ok(Blas {
            handle,
            workspace,
            workspace_ptr,
            plans: HashMap::new(),
            batched: HashMap::new(),
            fp8: HashMap::new(),
            batch_invariant: false,
            fixed: HashMap::new(),
        })
    }

    fn plan(&mut self, key: GemmPlanKey) -> Result<&Plan, CudaError> {
        if !self.plans.contains_key(&key) {
            let plan = self.create_plan(key)?;
            self.plans.insert(key, plan);
        }
        Ok(&self.plans[&key])
    }

    fn create_plan(&mut self, key: GemmPlanKey) -> Result<Plan, CudaError> {
        let input = data_type(key.input)?;
        let output = data_type(key.output)?;
        let (m, n, k) = (key.m as u64, key.n as u64, key.k as u64);
        let desc = self.transposed_desc()?;
        let weights_layout = lt::create_matrix_layout(input, k, n, k as i64)
            .map_err(blas_error("weights layout"))?;
        let activations_layout = lt::create_matrix_layout(input, k, m, k as i64)
            .map_err(blas_error("activations layout"))?;
        let out_layout = lt::create_matrix_layout(output, n, m, n as i64)
            .map_err(blas_error("output layout"))?;
        let algo = if self.batch_invariant {
            self.fixed_algorithm(key, desc, weights_layout, activations_layout, out_layout)
        } else {
            self.heuristic(desc, weights_layout, activations_layout, out_layout)
        };
        let algo = match algo {
            Ok(algo) => algo,
            Err(error) => {
                // SAFETY: created above, not used after.
                unsafe {
                    let _ = lt::destroy_matrix_layout(weights_layout);
                    let _ = lt::destroy_matrix_layout(activations_layout);
                    let _ = lt::destroy_matrix_layout(out_layout);
                    let _ = lt::destroy_matmul_desc(desc);
                }
                return Err(error);
            }
        };
        Ok(Plan {
            desc,
            weights_layout,
            activations_layout,
            out_layout,
            algo,
        })
    }

    /// A matmul descriptor of f32 compute with the weights transposed (`op_T(W)`).
    fn transposed_desc(&self) -> Result<sys::cublasLtMatmulDesc_t, CudaError> {
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(blas_error("cublasLtMatmulDescCreate"))?;
        let transpose: i32 = 1;
        // SAFETY: desc is live; the attribute is an i32 (cublasOperation_t).
        unsafe {
            lt::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &transpose as *const i32 as *const c_void,
                std::mem::size_of::<i32>(),
            )
        }
        .map_err(|error| {
            // SAFETY: created above, not used after.
            let _ = unsafe { lt::destroy_matmul_desc(desc) };
            blas_error("CUBLASLT_MATMUL_DESC_TRANSA")(error)
        })?;
        Ok(desc)
    }

    /// The heuristic's first algorithm for these descriptors.
    fn heuristic(
        &self,
        desc: sys::cublasLtMatmulDesc_t,
        weights_layout: sys::cublasLtMatrixLayout_t,
        activations_layout: sys::cublasLtMatrixLayout_t,
        out_layout: sys::cublasLtMatrixLayout_t,
    ) -> Result<sys::cublasLtMatmulAlgo_t, CudaError> {
        let layouts = (weights_layout, activations_layout, out_layout);
        self.heuristic_aligned(desc, layouts, None)
    }

    /// [`Blas::heuristic`], its algorithms limited to operands aligned to `alignment` bytes
    /// where given (cuBLASLt assumes 256 otherwise).
    fn heuristic_aligned(
        &self,
        desc: sys::cublasLtMatmulDesc_t,
        (weights_layout, activations_layout, out_layout): (
            sys::cublasLtMatrixLayout_t,
            sys::cublasLtMatrixLayout_t,
            sys::cublasLtMatrixLayout_t,
        ),
        alignment: Option<u32>,
    ) -> Result<sys::cublasLtMatmulAlgo_t, CudaError> {
        let preference =
            lt::create_matmul_pref().map_err(blas_error("cublasLtMatmulPreferenceCreate"))?;
        let workspace_size = self.workspace.len();
        use sys::cublasLtMatmulPreferenceAttributes_t as Preference;
        let aligned = [
            Preference::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            Preference::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            Preference::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            Preference::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
        ];
        let set_alignment = |bytes: u32| {
            aligned.iter().try_for_each(|&attribute| {
                // SAFETY: live preference; the alignment attributes are u32.
                unsafe {
                    lt::set_matmul_pref_attribute(
                        preference,
                        attribute,
                        &bytes as *const u32 as *const c_void,
                        std::mem::size_of::<u32>(),
                    )
                }
                .map_err(blas_error("CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT"))
            })
        };
        // SAFETY: live preference; the attribute is a usize.
        let result = unsafe {
            lt::set_matmul_pref_attribute(
                preference,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &workspace_size as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            )
            .map_err(blas_error("CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES"))
            .and_then(|()| alignment.map_or(Ok(()), set_alignment))
            .and_then(|()| {
                lt::get_matmul_algo_heuristic(
                    self.handle,
                    desc,
                    weights_layout,
                    activations_layout,
                    out_layout,
                    out_layout,
                    preference,
                )
                .map_err(blas_error(
                    "cublasLtMatmulAlgoGetHeuristic (no algorithm for this shape/dtype)",
                ))
            })
        };
        // SAFETY: created above.
        let _ = unsafe { lt::destroy_matmul_pref(preference) };
        Ok(result?.algo)
    }

    /// Batch-invariant mode: the algorithm of `key`'s weight shape (chosen at the reference
    /// `m` on first use, split-K off), checked against `key`'s own `m`.
    fn fixed_algorithm(
        &mut self,
        key: GemmPlanKey,
        desc: sys::cublasLtMatmulDesc_t,
        weights_layout: sys::cublasLtMatrixLayout_t,
        activations_layout: sys::cublasLtMatrixLayout_t,
        out_layout: sys::cublasLtMatrixLayout_t,
    ) -> Result<sys::cublasLtMatmulAlgo_t, CudaError> {
        let fixed_key = FixedKey {
            n: key.n,
            k: key.k,
            input: key.input,
            output: key.output,
            accumulate: key.accumulate,
        };
        let algo = match self.fixed.get(&fixed_key) {
            Some(algo) => *algo,
            None => {
                let reference_m = BATCH_INVARIANT_REFERENCE_M as u64;
                let (n, k) = (key.n as u64, key.k as u64);
                let activations =
                    lt::create_matrix_layout(data_type(key.input)?, k, reference_m, k as i64)
                        .map_err(blas_error("activations layout"))?;
                let out =
                    lt::create_matrix_layout(data_type(key.output)?, n, reference_m, n as i64);
                let out = match out {
                    Ok(out) => out,
                    Err(error) => {
                        // SAFETY: created above.
                        let _ = unsafe { lt::destroy_matrix_layout(activations) };
                        return Err(blas_error("output layout")(error));
                    }
                };
                let algo = self.heuristic(desc, weights_layout, activations, out);
                // SAFETY: created above.
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
                self.fixed.insert(fixed_key, algo);
                algo
            }
        };
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
        .map_err(|error| CudaError::Blas {
            context: format!(
                "batch-invariant GEMM: the algorithm of m={BATCH_INVARIANT_REFERENCE_M} does not \
                 run m={} (n={}, k={})",
                key.m, key.n, key.k
            ),
            message: format!("{error:?}"),
        })?;
        Ok(algo)
    }
}

/// Sets a `u32` attribute of an algorithm's configuration.
fn set_algo_config(
    algo: &mut sys::cublasLtMatmulAlgo_t,
    attribute: sys::cublasLtMatmulAlgoConfigAttributes_t,
    value: u32,
) -> Result<(), CudaError> {
    // SAFETY: a live algorithm struct; the attributes set here are u32.
    unsafe {
        sys::cublasLtMatmulAlgoConfigSetAttribute(
            algo,
            attribute,
            &value as *const u32 as *const c_void,
            std::mem::size_of::<u32>(),
        )
        .result()
    }
    .map_err(|error| CudaError::Blas {
        context: format!("{attribute:?}"),
        message: format!("{error:?}"),
    })
}

impl Gpu {
    /// `out[m, n] = activations[m, k] · weights[n, k]^T + beta · out`, all row-major, f32
    /// accumulation (cuBLASLt, `CUBLAS_COMPUTE_32F`, no TF32). Supported dtypes
    /// (input -> output): bf16 -> bf16, bf16 -> f32, f16 -> f16, f32 -> f32. The plan is
    /// created on the first call per [`GemmPlanKey`] and reused; the call is graph-capturable
    /// once the plan exists. Lengths must be exactly `m*k`, `n*k` and `m*n`.
    pub fn gemm<TIn: Element, TOut: Element>(
        &self,
        activations: &impl DeviceRead<TIn>,
        weights: &impl DeviceRead<TIn>,
        out: &mut impl DeviceWrite<TOut>,
        (m, n, k): (usize, usize, usize),
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
                "gemm {} -> {} is not supported (bf16->bf16, bf16->f32, f16->f16, f32->f32)",
                combination.0, combination.1
            )));
        }
        if m == 0 || n == 0 || k == 0 {
            return Err(CudaError::invalid(format!(
                "gemm needs m, n, k >= 1, got {m}, {n}, {k}"
            )));
        }
        check_len("gemm activations [m, k]", m * k, activations.len())?;
        check_len("gemm weights [n, k]", n * k, weights.len())?;
        check_len("gemm out [m, n]", m * n, out.len())?;
        let key = GemmPlanKey {
            m,
            n,
            k,
            input: TIn::DTYPE,
            output: TOut::DTYPE,
            accumulate: beta != 0.0,
        };
        let mut guard = self.lock_blas()?;
        let blas = guard.as_mut().expect("lock_blas initialises it");
        let launch = blas.launch(self);
        let plan = blas.plan(key)?;
        let ptrs = (
            weights.device_ptr(),
            activations.device_ptr(),
            out.device_ptr(),
        );
        // SAFETY: lengths checked; the plan matches these dtypes and shapes.
        unsafe { plan.run(launch, ptrs, beta, "cublasLtMatmul") }
    }

    /// Batch-invariant GEMMs (`on`): every `m` of a weight shape runs one algorithm with
    /// split-K off, so a row's output does not depend on the other rows of the GEMM (see the
    /// module docs). Switching drops the cached plans. Not while a graph is being captured.
    pub fn set_gemm_batch_invariant(&self, on: bool) -> Result<(), CudaError> {
        let mut guard = self.lock_blas()?;
        let blas = guard.as_mut().expect("lock_blas initialises it");
        if blas.batch_invariant != on {
            blas.clear_plans();
            blas.batch_invariant = on;
        }
        Ok(())
    }

    /// The cuBLASLt state, made on first use (a handle, a workspace, the plan cache).
    fn lock_blas(&self) -> Result<std::sync::MutexGuard<'_, Option<Blas>>, CudaError> {
        let mut guard = self
            .blas
            .lock()
            .map_err(|_| CudaError::invalid("cuBLASLt lock poisoned"))?;
        if guard.is_none() {
            *guard = Some(Blas::new(self)?);
        }
        Ok(guard)
    }

    /// Number of cached GEMM plans.
    pub fn gemm_plans(&self) -> usize {
        self.blas
            .lock()
            .ok()
            .and_then(|guard| guard.as_ref().map(|blas| blas.plans.len()))
            .unwrap_or(0)
    }
}
