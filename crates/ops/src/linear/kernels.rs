//! Which CPU kernel set the quantized linear layers use, chosen once per process.
//!
//! `PAGODA_CPU_KERNELS=auto|amx|vnni8|vnni|avx2|scalar|f32` (unset: `auto`). `amx`, `vnni8`,
//! `vnni`, `avx2` and `scalar` quantize activations to Q8 and use integer dots on weights
//! repacked at load, for every weight. `amx` is `vnni8` with prefills of at least
//! [`crate::simd::amx::AMX_MIN_TOKENS`] tokens on AMX-INT8 tiles (bit-identical to `vnni8`),
//! where CPUID reports `amx_tile` + `amx_int8` and Linux grants tile data.
//! `f32` keeps the stored blocks and f32 activations (the fused decode-in-registers path of
//! ADR 0001) for every weight. `auto` is a per-weight policy ([`CpuKernelPolicy`]): the best
//! integer set the CPU runs (`amx`, then `vnni8`, `avx2`) for every weight except `ffn_down`,
//! which keeps the f32 kernels. `ffn_down`'s input, the SiLU-gated product, has
//! the widest dynamic range of the model's matmul inputs, and its Q8 rounding alone moved one
//! top-5 logprob of the llama.cpp parity test past its 0.6 bound (0.659 with Q8 everywhere,
//! 0.561 with `ffn_down` in f32, 0.555 with f32 everywhere). The price is decode speed: on
//! the default model (1 thread, AVX-512 VNNI) `auto` decodes about 1.6x as fast as `f32` and
//! about 0.8x as fast as `vnni`. On a CPU without AVX2 `auto` is `f32` everywhere. A set the
//! CPU lacks, or an unknown value, falls back to `auto` with a warning.

use std::sync::OnceLock;

use crate::kernel_choice::{choose_from_env, KernelChoice};
use crate::simd::int_dot::IntIsa;

/// A CPU kernel set for quantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuKernels {
    /// Q8 activations, weights interleaved as for [`CpuKernels::Vnni8`]; prefills on AMX-INT8
    /// tiles, the rest with the `vnni8` kernel (the same bits).
    Amx,
    /// Q8 activations, integer dots with AVX-512 VNNI on weights interleaved eight rows at a
    /// time ([`crate::simd::interleaved`]): one i32 lane per row, each (row, token) pair the
    /// scalar kernel's chain, bit for bit.
    Vnni8,
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
        if IntIsa::Amx.is_supported() {
            // pp512 1.06-1.44x `vnni8` end to end on the GPU machine's host, same bits.
            CpuKernels::Amx
        } else if IntIsa::Vnni.is_supported() {
            CpuKernels::Vnni8
        } else if IntIsa::Avx2.is_supported() {
            CpuKernels::Avx2
        } else {
            CpuKernels::Scalar
        }
    }

    /// Parses a `PAGODA_CPU_KERNELS` value as one set for every weight (`auto` resolves to
    /// [`CpuKernels::best`]; the per-weight meaning of `auto` is [`CpuKernelPolicy::parse`]).
    /// The error names the bad value.
    pub fn parse(value: &str) -> Result<CpuKernels, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(CpuKernels::best()),
            "amx" => Ok(CpuKernels::Amx),
            "vnni8" => Ok(CpuKernels::Vnni8),
            "vnni" => Ok(CpuKernels::Vnni),
            "avx2" => Ok(CpuKernels::Avx2),
            "scalar" => Ok(CpuKernels::Scalar),
            "f32" => Ok(CpuKernels::F32),
            other => Err(format!(
                "PAGODA_CPU_KERNELS={other:?} is not one of auto, amx, vnni8, vnni, avx2, scalar, f32"
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
            CpuKernels::Amx => Some(IntIsa::Amx),
            CpuKernels::Vnni8 | CpuKernels::Vnni => Some(IntIsa::Vnni),
            CpuKernels::Avx2 => Some(IntIsa::Avx2),
            CpuKernels::Scalar => Some(IntIsa::Scalar),
            CpuKernels::F32 => None,
        }
    }

    /// Lower-case name, as `PAGODA_CPU_KERNELS` spells it.
    pub fn name(self) -> &'static str {
        match self {
            CpuKernels::Amx => "amx",
            CpuKernels::Vnni8 => "vnni8",
            CpuKernels::Vnni => "vnni",
            CpuKernels::Avx2 => "avx2",
            CpuKernels::Scalar => "scalar",
            CpuKernels::F32 => "f32",
        }
    }

    /// The process-wide set for weights without a per-weight exception:
    /// [`CpuKernelPolicy::selected`]'s `kernels` (`PAGODA_CPU_KERNELS` read once, validated
    /// against the CPU, logged once). Model loaders should ask [`CpuKernels::for_tensor`].
    pub fn selected() -> CpuKernels {
        CpuKernelPolicy::selected().kernels
    }

    /// The set the process-wide policy gives the weight stored under `name` (a GGUF tensor
    /// name such as `blk.3.ffn_down.weight`; see [`CpuKernelPolicy::for_tensor`]).
    pub fn for_tensor(name: &str) -> CpuKernels {
        CpuKernelPolicy::selected().for_tensor(name)
    }
}

/// The tensor-name suffix of the MLP down projections, whose input is the SiLU-gated product.
const FFN_DOWN_SUFFIX: &str = "ffn_down.weight";

/// Which kernel set each weight of a model gets: one set for every weight, except that
/// `ffn_down` weights may keep the f32 kernels (what `auto` selects, see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuKernelPolicy {
    /// The set of every weight without an exception.
    pub kernels: CpuKernels,
    /// Whether `*ffn_down.weight` tensors use [`CpuKernels::F32`] instead of `kernels`.
    pub f32_ffn_down: bool,
}

impl CpuKernelPolicy {
    /// The same set for every weight.
    pub fn uniform(kernels: CpuKernels) -> CpuKernelPolicy {
        CpuKernelPolicy {
            kernels,
            f32_ffn_down: false,
        }
    }

    /// What `auto` means on this CPU: [`CpuKernels::best`] with `ffn_down` in f32 when the
    /// CPU has a SIMD integer set (VNNI or AVX2), otherwise f32 everywhere (the portable
    /// integer dots are not faster than the f32 decode path).
    pub fn auto() -> CpuKernelPolicy {
        match CpuKernels::best() {
            CpuKernels::Scalar | CpuKernels::F32 => CpuKernelPolicy::uniform(CpuKernels::F32),
            kernels => CpuKernelPolicy {
                kernels,
                f32_ffn_down: true,
            },
        }
    }

    /// Parses a `PAGODA_CPU_KERNELS` value: `auto` (or empty) is [`CpuKernelPolicy::auto`],
    /// a set name is that set for every weight, and `SET+f32_ffn_down` (the names `auto`
    /// logs, e.g. `vnni+f32_ffn_down`) that set with `ffn_down` on the f32 kernels. The error
    /// names the bad value.
    pub fn parse(value: &str) -> Result<CpuKernelPolicy, String> {
        Ok(CpuKernelPolicy::parse_choice(value)?.unwrap_or_else(CpuKernelPolicy::auto))
    }

    /// The set for the weight stored under `name` (a GGUF tensor name).
    pub fn for_tensor(self, name: &str) -> CpuKernels {
        if self.f32_ffn_down && name.ends_with(FFN_DOWN_SUFFIX) {
            CpuKernels::F32
        } else {
            self.kernels
        }
    }

    /// The name for logs and metrics: the set's name (`amx`, `vnni`, `avx2`, `scalar`, `f32`), with
    /// `+f32_ffn_down` appended when `ffn_down` keeps the f32 kernels (`vnni+f32_ffn_down`).
    pub fn name(self) -> &'static str {
        match (self.kernels, self.f32_ffn_down) {
            (kernels, false) | (kernels @ CpuKernels::F32, true) => kernels.name(),
            (CpuKernels::Amx, true) => "amx+f32_ffn_down",
            (CpuKernels::Vnni8, true) => "vnni8+f32_ffn_down",
            (CpuKernels::Vnni, true) => "vnni+f32_ffn_down",
            (CpuKernels::Avx2, true) => "avx2+f32_ffn_down",
            (CpuKernels::Scalar, true) => "scalar+f32_ffn_down",
        }
    }

    /// The process-wide policy: `PAGODA_CPU_KERNELS` read once (unset: `auto`), validated
    /// against the CPU (a set it lacks, or an unknown value, falls back to `auto` with a
    /// warning), and logged once at INFO.
    pub fn selected() -> CpuKernelPolicy {
        static SELECTED: OnceLock<CpuKernelPolicy> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let policy = choose_from_env::<CpuKernelPolicy>();
            let activations = match (policy.kernels, policy.f32_ffn_down) {
                (CpuKernels::F32, _) => "f32 activations, weights decoded in registers",
                (CpuKernels::Amx, false) => {
                    "Q8 activations, integer dots on repacked weights; AMX-INT8 tiles for \
                     multi-row matmuls"
                }
                (CpuKernels::Amx, true) => {
                    "Q8 activations and integer dots on repacked weights (AMX-INT8 tiles for \
                     multi-row matmuls), except ffn_down: f32 activations, weights decoded \
                     in registers"
                }
                (_, false) => "Q8 activations, integer dots on repacked weights",
                (_, true) => {
                    "Q8 activations and integer dots on repacked weights, except ffn_down: \
                     f32 activations, weights decoded in registers"
                }
            };
            tracing::info!("CPU kernels: {} ({activations})", policy.name());
            policy
        })
    }
}

impl KernelChoice for CpuKernelPolicy {
    const ENV_VAR: &'static str = "PAGODA_CPU_KERNELS";
    fn choice_name(self) -> &'static str {
        self.name()
    }
    fn choice_supported(self) -> bool {
        self.kernels.is_supported()
    }
    fn auto_choice() -> Self {
        CpuKernelPolicy::auto()
    }
    fn parse_choice(text: &str) -> Result<Option<Self>, String> {
        let text = text.trim().to_ascii_lowercase();
        match text.as_str() {
            "" | "auto" => Ok(None),
            other => match other.strip_suffix("+f32_ffn_down") {
                // A set with ffn_down on the f32 kernels, as `auto` names its choice.
                Some(set) if set != "f32" => CpuKernels::parse(set).map(|kernels| {
                    Some(CpuKernelPolicy {
                        kernels,
                        f32_ffn_down: true,
                    })
                }),
                _ => {
                    CpuKernels::parse(other).map(|kernels| Some(CpuKernelPolicy::uniform(kernels)))
                }
            },
        }
    }
}

/// The name of the process-wide kernel policy ([`CpuKernelPolicy::selected`]), for metrics
/// and status pages, e.g. a Prometheus gauge `pagoda_cpu_kernels_info{set="vnni+f32_ffn_down"} 1`:
/// `amx`, `vnni`, `avx2`, `scalar` (Q8 activations, integer dots, every weight), `f32` (f32
/// activations, every weight), or a set with `+f32_ffn_down` (what `auto` selects: `ffn_down`
/// keeps f32 activations). The first call (from here or from loading a model) reads the
/// environment and logs the choice once; later calls return the same name.
pub fn cpu_kernels_name() -> &'static str {
    CpuKernelPolicy::selected().name()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_keeps_ffn_down_on_f32_kernels_only() {
        let policy = CpuKernelPolicy {
            kernels: CpuKernels::Vnni,
            f32_ffn_down: true,
        };
        for layer in [0, 7, 29] {
            let name = format!("blk.{layer}.ffn_down.weight");
            assert_eq!(policy.for_tensor(&name), CpuKernels::F32, "{name}");
        }
        for name in [
            "blk.0.ffn_up.weight",
            "blk.0.ffn_gate.weight",
            "blk.0.attn_q.weight",
            "blk.0.attn_output.weight",
            "token_embd.weight",
            "output.weight",
        ] {
            assert_eq!(policy.for_tensor(name), CpuKernels::Vnni, "{name}");
        }
        assert_eq!(policy.name(), "vnni+f32_ffn_down");
    }

    #[test]
    fn a_named_set_applies_to_every_weight() {
        for (value, kernels) in [
            ("amx", CpuKernels::Amx),
            ("vnni", CpuKernels::Vnni),
            ("AVX2", CpuKernels::Avx2),
            ("scalar", CpuKernels::Scalar),
            ("f32", CpuKernels::F32),
        ] {
            let policy = CpuKernelPolicy::parse(value).unwrap();
            assert_eq!(policy, CpuKernelPolicy::uniform(kernels));
            assert_eq!(policy.for_tensor("blk.3.ffn_down.weight"), kernels);
            assert_eq!(policy.name(), kernels.name());
        }
    }

    #[test]
    fn a_set_with_f32_ffn_down_parses_from_its_name() {
        for kernels in [
            CpuKernels::Amx,
            CpuKernels::Vnni8,
            CpuKernels::Vnni,
            CpuKernels::Avx2,
        ] {
            let policy = CpuKernelPolicy {
                kernels,
                f32_ffn_down: true,
            };
            assert_eq!(CpuKernelPolicy::parse(policy.name()), Ok(policy));
        }
        assert_eq!(
            CpuKernelPolicy::parse("f32+f32_ffn_down").unwrap_err(),
            CpuKernels::parse("f32+f32_ffn_down").unwrap_err()
        );
        assert!(CpuKernelPolicy::parse("sse9+f32_ffn_down").is_err());
    }

    #[test]
    fn auto_parses_to_the_per_weight_policy() {
        for value in ["auto", " Auto ", ""] {
            assert_eq!(
                CpuKernelPolicy::parse(value).unwrap(),
                CpuKernelPolicy::auto()
            );
        }
        let auto = CpuKernelPolicy::auto();
        assert!(auto.kernels.is_supported());
        match CpuKernels::best() {
            CpuKernels::Amx | CpuKernels::Vnni8 | CpuKernels::Vnni | CpuKernels::Avx2 => {
                assert_eq!(auto.kernels, CpuKernels::best());
                assert!(auto.f32_ffn_down);
            }
            _ => assert_eq!(auto, CpuKernelPolicy::uniform(CpuKernels::F32)),
        }
        let error = CpuKernelPolicy::parse("sse9").unwrap_err();
        assert!(error.contains("sse9") && error.contains("amx"), "{error}");
    }
}
