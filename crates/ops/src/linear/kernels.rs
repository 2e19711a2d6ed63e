//! Which CPU kernel set the quantized linear layers use, chosen once per process.
//!
//! `PAGODA_CPU_KERNELS=auto|vnni|avx2|scalar|f32`. `vnni`, `avx2` and `scalar` quantize
//! activations to Q8 and use integer dots on weights repacked at load; `auto` is the best of
//! them the CPU runs. `f32` keeps the stored blocks and f32 activations (the fused
//! decode-in-registers path of ADR 0001) and is the default while unset: Q8 activations
//! move one top-5 logprob of the llama.cpp parity test past its 0.6 bound (0.86, see
//! `docs/benchmark_results/cpu-kernels-epyc-2026-11-29.md`), so making them the default is
//! the lead's call. A set the CPU lacks, or an unknown value, falls back to `auto` with a
//! warning.

use std::sync::OnceLock;

use crate::simd::int_dot::IntIsa;

/// A CPU kernel set for quantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuKernels {
    /// Q8 activations, integer dots with AVX-512 VNNI.
    Vnni,
    /// Q8 activations, integer dots with AVX2.
    Avx2,
    /// Q8 activations, portable integer dots.
    Scalar,
    /// f32 activations, weights decoded in registers (exact up to summation order).
    F32,
}

impl CpuKernels {
    /// The best set this CPU supports.
    pub fn best() -> CpuKernels {
        if IntIsa::Vnni.is_supported() {
            CpuKernels::Vnni
        } else if IntIsa::Avx2.is_supported() {
            CpuKernels::Avx2
        } else {
            CpuKernels::Scalar
        }
    }

    /// Parses a `PAGODA_CPU_KERNELS` value (`auto` resolves to [`CpuKernels::best`]).
    pub fn parse(value: &str) -> Result<CpuKernels, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(CpuKernels::best()),
            "vnni" => Ok(CpuKernels::Vnni),
            "avx2" => Ok(CpuKernels::Avx2),
            "scalar" => Ok(CpuKernels::Scalar),
            "f32" => Ok(CpuKernels::F32),
            other => Err(format!(
                "PAGODA_CPU_KERNELS={other:?} is not one of auto, vnni, avx2, scalar, f32"
            )),
        }
    }

    /// Whether this CPU can run the set.
    pub fn is_supported(self) -> bool {
        self.int_isa().is_none_or(IntIsa::is_supported)
    }

    /// The integer instruction set, or `None` for [`CpuKernels::F32`].
    pub fn int_isa(self) -> Option<IntIsa> {
        match self {
            CpuKernels::Vnni => Some(IntIsa::Vnni),
            CpuKernels::Avx2 => Some(IntIsa::Avx2),
            CpuKernels::Scalar => Some(IntIsa::Scalar),
            CpuKernels::F32 => None,
        }
    }

    /// Lower-case name, as `PAGODA_CPU_KERNELS` spells it.
    pub fn name(self) -> &'static str {
        match self {
            CpuKernels::Vnni => "vnni",
            CpuKernels::Avx2 => "avx2",
            CpuKernels::Scalar => "scalar",
            CpuKernels::F32 => "f32",
        }
    }

    /// The process-wide set: `PAGODA_CPU_KERNELS` read once (unset: [`CpuKernels::F32`]),
    /// validated against the CPU, and logged once.
    pub fn selected() -> CpuKernels {
        static SELECTED: OnceLock<CpuKernels> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let requested = std::env::var("PAGODA_CPU_KERNELS").unwrap_or_else(|_| "f32".into());
            let kernels = match CpuKernels::parse(&requested) {
                Ok(kernels) if kernels.is_supported() => kernels,
                Ok(kernels) => {
                    tracing::warn!(
                        "PAGODA_CPU_KERNELS={}: this CPU lacks it, using auto",
                        kernels.name()
                    );
                    CpuKernels::best()
                }
                Err(message) => {
                    tracing::warn!("{message}; using auto");
                    CpuKernels::best()
                }
            };
            let activations = if kernels == CpuKernels::F32 {
                "f32 activations, weights decoded in registers"
            } else {
                "Q8 activations, integer dots on repacked weights"
            };
            tracing::info!("CPU kernels: {} ({activations})", kernels.name());
            kernels
        })
    }
}

/// The name of the process-wide kernel set ([`CpuKernels::selected`]) as
/// `PAGODA_CPU_KERNELS` spells it: `vnni`, `avx2`, `scalar` (Q8 activations, integer dots) or
/// `f32` (f32 activations). For metrics and status pages, e.g. a Prometheus gauge
/// `pagoda_cpu_kernels{set="vnni"} 1`. The first call (from here or from loading a model)
/// reads the environment and logs the choice once; later calls return the same name.
pub fn cpu_kernels_name() -> &'static str {
    CpuKernels::selected().name()
}
