//! The harness itself: backends, the [`OpCase`] contract, the error metric and the driver
//! that runs every case on every backend and prints one line per (case, backend).

use std::panic::{catch_unwind, AssertUnwindSafe};

use half::bf16;
use pagoda_cuda::Gpu;
use pagoda_ops::attention::AttentionKernel;
use pagoda_ops::linear::CpuKernels;

/// The environment variable that keeps only the cases whose op name contains its value
/// (test-backend-ops' `-o`).
pub const FILTER_ENV_VAR: &str = "PAGODA_BACKEND_OPS";

/// Which CPU variants a case runs on. The CPU "backends" are the ops crate's selectable
/// kernels, and each family only applies to its own ops (the linear kernel sets mean nothing
/// to RoPE); the CUDA backends run every case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// The CPU implementation is the reference itself: only the CUDA backends run.
    ReferenceOnly,
    /// Elementwise ops with a CPU production path beside the reference (in place, the
    /// polynomial SiLU, the shared RoPE table): [`Backend::Cpu`].
    Elementwise,
    /// Weights (linear layers, their row decoders): [`Backend::CpuLinear`], one per kernel set.
    Weights,
    /// Paged attention: [`Backend::CpuAttention`], one per split-KV chunk kernel.
    Attention,
}

/// The activation dtype of a CUDA backend (inputs, weights as uploaded, outputs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuDtype {
    F32,
    Bf16,
}

impl GpuDtype {
    /// Rounds values through this dtype (what the GPU stores).
    pub fn round(self, values: &[f32]) -> Vec<f32> {
        match self {
            GpuDtype::F32 => values.to_vec(),
            GpuDtype::Bf16 => values.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
        }
    }

    /// [`crate::gpu_common::TestFloat::TOLERANCE`] of the dtype: ops computed in f32 and
    /// stored in it, against `1 + |expected|`.
    pub fn tolerance(self) -> f64 {
        match self {
            GpuDtype::F32 => 2e-5,
            GpuDtype::Bf16 => 1.6e-2,
        }
    }
}

/// One backend an op can run on.
#[derive(Clone, Copy)]
pub enum Backend<'g> {
    /// The CPU's production paths of the elementwise ops.
    Cpu,
    /// The CPU linear layers with one kernel set (`PAGODA_CPU_KERNELS`).
    CpuLinear(CpuKernels),
    /// The CPU split-KV attention with one chunk kernel (`PAGODA_CPU_ATTENTION`).
    CpuAttention(AttentionKernel),
    /// The CUDA launchers at one activation dtype.
    Cuda(&'g Gpu, GpuDtype),
}

impl Backend<'_> {
    pub fn name(&self) -> String {
        match self {
            Backend::Cpu => "cpu".into(),
            Backend::CpuLinear(set) => format!("cpu-linear-{}", set.name()),
            Backend::CpuAttention(kernel) => format!("cpu-attention-{}", kernel.name()),
            Backend::Cuda(_, GpuDtype::F32) => "cuda-f32".into(),
            Backend::Cuda(_, GpuDtype::Bf16) => "cuda-bf16".into(),
        }
    }

    /// Whether the driver pairs this backend with a case of `family`.
    fn serves(&self, family: Family) -> bool {
        match self {
            Backend::Cpu => family == Family::Elementwise,
            Backend::CpuLinear(_) => family == Family::Weights,
            Backend::CpuAttention(_) => family == Family::Attention,
            Backend::Cuda(..) => true,
        }
    }
}

/// The CPU backends this CPU runs: the elementwise paths, every linear kernel set it supports
/// (`f32`, `scalar`, `avx2`, `vnni`, `vnni8`, `amx`) and every attention chunk kernel it
/// supports (`scalar`, `avx2`, `avx512`).
pub fn cpu_backends() -> Vec<Backend<'static>> {
    let mut backends = vec![Backend::Cpu];
    let sets = [
        CpuKernels::F32,
        CpuKernels::Scalar,
        CpuKernels::Avx2,
        CpuKernels::Vnni,
        CpuKernels::Vnni8,
        CpuKernels::Amx,
    ];
    backends.extend(
        sets.into_iter()
            .filter(|set| set.is_supported())
            .map(Backend::CpuLinear),
    );
    let kernels = [
        AttentionKernel::Scalar,
        AttentionKernel::Avx2,
        AttentionKernel::Avx512,
    ];
    backends.extend(
        kernels
            .into_iter()
            .filter(|kernel| kernel.is_supported())
            .map(Backend::CpuAttention),
    );
    backends
}

/// The CUDA backends of `gpu`: f32 and bf16 activations.
pub fn cuda_backends(gpu: &Gpu) -> Vec<Backend<'_>> {
    vec![
        Backend::Cuda(gpu, GpuDtype::F32),
        Backend::Cuda(gpu, GpuDtype::Bf16),
    ]
}

/// What a backend must produce: the values, and per value the magnitude its error is
/// measured against (`error = max |actual - expected| / scale`, NaN or a length mismatch is
/// an infinite error).
pub struct Expected {
    pub values: Vec<f32>,
    pub scales: Vec<f32>,
}

impl Expected {
    /// Each value's error relative to `1 + |value|` (the GPU tests' `assert_close`).
    pub fn relative(values: Vec<f32>) -> Expected {
        let scales = values.iter().map(|v| 1.0 + v.abs()).collect();
        Expected { values, scales }
    }

    /// Every error relative to the largest `|value|` (at least 1): attention's metric.
    pub fn peak(values: Vec<f32>) -> Expected {
        let peak = values.iter().fold(1f32, |m, v| m.max(v.abs()));
        let scales = vec![peak; values.len()];
        Expected { values, scales }
    }

    /// `(max |actual - expected|, max |actual - expected| / scale)`.
    pub fn errors(&self, actual: &[f32]) -> (f64, f64) {
        if actual.len() != self.values.len() {
            return (f64::INFINITY, f64::INFINITY);
        }
        let mut worst = (0f64, 0f64);
        for ((&a, &e), &scale) in actual.iter().zip(&self.values).zip(&self.scales) {
            let difference = (a as f64 - e as f64).abs();
            let difference = if difference.is_nan() {
                f64::INFINITY
            } else {
                difference
            };
            worst.0 = worst.0.max(difference);
            worst.1 = worst.1.max(difference / scale as f64);
        }
        worst
    }
}

/// One result of a backend: most cases have one (`variant` empty); a backend with several
/// kernels for one op (the CUDA prefill and decode kernels, a GEMM's output dtypes) returns
/// one per kernel, each compared with the same [`Expected`].
pub struct Output {
    pub variant: String,
    pub values: Vec<f32>,
}

/// The single result of a backend.
pub fn one(values: Vec<f32>) -> Option<Vec<Output>> {
    Some(vec![Output {
        variant: String::new(),
        values,
    }])
}

/// One op at one shape (test-backend-ops' `test_case`).
pub trait OpCase {
    /// The op's name (what [`FILTER_ENV_VAR`] matches).
    fn op(&self) -> &'static str;
    /// Shapes, dtypes and parameters, for the report.
    fn shape(&self) -> String;
    /// Which CPU backends apply.
    fn family(&self) -> Family;
    /// The ops crate's CPU reference on the inputs `backend` sees (the same inputs for every
    /// backend, except where a backend rounds them: Q8 activations of the integer kernel
    /// sets, bf16 pools of `cuda-bf16`'s attention).
    fn reference(&self, backend: &Backend<'_>) -> Expected;
    /// Runs the op on `backend`; `None`: the backend does not support it.
    fn run(&self, backend: &Backend<'_>) -> Option<Vec<Output>>;
    /// The largest error (see [`Expected`]) `backend` may show.
    fn tolerance(&self, backend: &Backend<'_>) -> f64;
}

/// What [`run_cases`] saw.
#[derive(Default)]
pub struct Report {
    /// Comparisons made.
    pub checked: usize,
    /// Pairs reported "not supported".
    pub unsupported: usize,
    /// One line per failed comparison.
    pub failures: Vec<String>,
}

/// Runs every case (those [`FILTER_ENV_VAR`] keeps) on every backend that serves its family;
/// prints `op shape backend OK|FAIL max_abs_err ...` per pair, or "not supported". A panic
/// in a case is a failure of that pair, not of the run.
pub fn run_cases(cases: &[Box<dyn OpCase>], backends: &[Backend<'_>]) -> Report {
    let filter = std::env::var(FILTER_ENV_VAR).unwrap_or_default();
    let mut report = Report::default();
    for case in cases.iter().filter(|case| case.op().contains(&filter)) {
        for backend in backends.iter().filter(|b| b.serves(case.family())) {
            let label = format!("{:<17} {:<54}", case.op(), case.shape());
            let backend_name = backend.name();
            let outcome = catch_unwind(AssertUnwindSafe(|| {
                let outputs = case.run(backend)?;
                let expected = case.reference(backend);
                let tolerance = case.tolerance(backend);
                let errors = |output: Output| (output.variant, expected.errors(&output.values));
                Some((
                    outputs.into_iter().map(errors).collect::<Vec<_>>(),
                    tolerance,
                ))
            }));
            match outcome {
                Ok(None) => {
                    report.unsupported += 1;
                    println!("{label} {backend_name:<44} not supported");
                }
                Ok(Some((results, tolerance))) => {
                    for (variant, (max_abs, error)) in results {
                        report.checked += 1;
                        let ok = error <= tolerance;
                        let column = if variant.is_empty() {
                            backend_name.clone()
                        } else {
                            format!("{backend_name} {variant}")
                        };
                        let verdict = if ok { "OK  " } else { "FAIL" };
                        let line = format!(
                            "{label} {column:<44} {verdict} max_abs_err={max_abs:.2e} \
                             err={error:.2e} tol={tolerance:.1e}"
                        );
                        println!("{line}");
                        if !ok {
                            report.failures.push(line);
                        }
                    }
                }
                Err(panic) => {
                    let message = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    let line = format!("{label} {backend_name:<44} FAIL panicked: {message}");
                    println!("{line}");
                    report.failures.push(line);
                }
            }
        }
    }
    report
}

/// Fails listing every failure of `report` (after the run, not at the first); also fails
/// when nothing was compared although no filter was set.
pub fn assert_passed(what: &str, report: &Report) {
    println!(
        "{what}: {} comparisons, {} not supported, {} failed",
        report.checked,
        report.unsupported,
        report.failures.len()
    );
    assert!(
        report.checked > 0 || std::env::var(FILTER_ENV_VAR).is_ok(),
        "{what}: no case ran"
    );
    assert!(
        report.failures.is_empty(),
        "{what}: {} failures:\n{}",
        report.failures.len(),
        report.failures.join("\n")
    );
}

/// `len` values uniform in `[-scale, scale)`, rounded to bf16 so that every backend (the
/// bf16 ones included) sees exactly the reference's inputs.
pub fn random_bf16(rng: &mut rand_chacha::ChaCha8Rng, len: usize, scale: f32) -> Vec<f32> {
    crate::gpu_common::round::<bf16>(&crate::gpu_common::random_vec(rng, len, scale))
}

/// Runs `$body` with the type `$t` standing for the dtype's element type (`f32`, `bf16`).
macro_rules! with_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::framework::GpuDtype::F32 => {
                type $t = f32;
                $body
            }
            $crate::framework::GpuDtype::Bf16 => {
                type $t = half::bf16;
                $body
            }
        }
    };
}
pub(crate) use with_dtype;
