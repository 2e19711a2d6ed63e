//! Which CPU kernel set the quantized linear layers use, chosen once per process.
//!
//! `PAGODA_CPU_KERNELS=auto|amx|vnni8|vnni|avx2|neon_dotprod|neon|scalar|f32` (unset: `auto`).
//! `amx`, `vnni8`, `vnni`, `avx2`, `neon_dotprod`, `neon` and `scalar` quantize activations to
//! Q8 and use integer dots on weights repacked at load, for every weight. The two aarch64
//! sets (`neon_dotprod` where the CPU has the dotprod extension, `SDOT`; `neon` on any
//! aarch64 CPU) run the scalar kernel's chain bit for bit ([`crate::linear::cpu::int_dot`]);
//! `neon_dotprod` runs its prefill tiles on `SMMLA` where the CPU has i8mm (the same bits). `amx` is `vnni8` with prefills of at least
//! [`crate::linear::cpu::amx::AMX_MIN_TOKENS`] tokens on AMX-INT8 tiles (bit-identical to `vnni8`),
//! where CPUID reports `amx_tile` + `amx_int8` and Linux grants tile data (or, for tests, on
//! emulated tiles: `PAGODA_CPU_AMX_TILES=emulated`, [`crate::linear::cpu::amx::backend`]).
//! `f32` keeps the stored blocks and f32 activations (the fused decode-in-registers path of
//! ADR 0001) for every weight. `auto` is a per-weight policy ([`CpuKernelPolicy`]): the best
//! integer set the CPU runs (`amx`, then `vnni8`, `avx2`; on aarch64 `neon_dotprod`, then
//! `neon`) for every weight, with one
//! exception for `ffn_down`, whose input (the SiLU-gated product) has the widest dynamic range
//! of the model's matmul inputs. With `amx` and `vnni8` it takes Q15 activations
//! (`+q15_ffn_down`: 128 times finer than Q8, two integer dots per block, see
//! [`pagoda_tensor::quant::q8`]); with `avx2`, `neon_dotprod` and `neon` it keeps the f32
//! kernels (`+f32_ffn_down`). Q8
//! there has the widest llama.cpp parity tail of the sets measured (99th percentile 0.534
//! against 0.40-0.46 for Q15 and f32); Q15 matches f32's and, on the Xeon host, halves
//! `ffn_down` in prefill and decode against f32
//! (`docs/benchmark_results/cpu-q15-ffn-down-epyc-h200host-2026-12-01.md`). On an x86 CPU
//! without AVX2 `auto` is `f32` everywhere. A set the CPU lacks, or an unknown value, falls back to
//! `auto` with a warning.

use std::sync::OnceLock;

use crate::kernel_choice::{choose_from_env, KernelChoice};
use crate::linear::cpu::int_dot::IntIsa;

/// A CPU kernel set for quantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuKernels {
    /// Q8 activations, weights interleaved as for [`CpuKernels::Vnni8`]; prefills on AMX-INT8
    /// tiles, the rest with the `vnni8` kernel (the same bits).
    Amx,
    /// Q8 activations, integer dots with AVX-512 VNNI on weights interleaved eight rows at a
    /// time ([`crate::linear::cpu::interleaved`]): one i32 lane per row, each (row, token) pair the
    /// scalar kernel's chain, bit for bit.
    Vnni8,
    /// Q8 activations, integer dots with AVX-512 VNNI.
    Vnni,
    /// Q8 activations, integer dots with AVX2.
    Avx2,
    /// Q8 activations, integer dots with NEON `SDOT` (aarch64 with dotprod), bit-identical to
    /// [`CpuKernels::Scalar`].
    NeonDot,
    /// Q8 activations, integer dots with plain NEON (aarch64 without dotprod), bit-identical
    /// to [`CpuKernels::Scalar`].
    Neon,
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
        } else if IntIsa::NeonDot.is_supported() {
            CpuKernels::NeonDot
        } else if IntIsa::Neon.is_supported() {
            CpuKernels::Neon
        } else {
            CpuKernels::Scalar
        }
    }

    /// Parses a `PAGODA_CPU_KERNELS` value as one set for every weight (`auto` resolves to
    /// [`CpuKernels::best`]; the per-weight meaning of `auto` is [`CpuKernelPolicy::parse`]).
    /// The error names the bad value.
    pub fn parse(value: &str) -> Result<CpuKernels, crate::UnknownChoice> {
        Ok(crate::kernel_choice::parse::<CpuKernelPolicy>(value)?
            .map_or_else(CpuKernels::best, |policy| policy.kernels))
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
            CpuKernels::NeonDot => Some(IntIsa::NeonDot),
            CpuKernels::Neon => Some(IntIsa::Neon),
            CpuKernels::Scalar => Some(IntIsa::Scalar),
            CpuKernels::F32 => None,
        }
    }

    /// Lower-case name, as `PAGODA_CPU_KERNELS` spells it.
    pub fn name(self) -> &'static str {
        crate::kernel_choice::word(CpuKernelPolicy::uniform(self))
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

/// What `ffn_down` weights run, against the policy's set for every other weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnDown {
    /// The policy's set, with its Q8 activations.
    Same,
    /// The f32 kernels (f32 activations).
    F32,
    /// The policy's set with Q15 activations ([`pagoda_tensor::quant::q8`]; the `vnni8` and
    /// `amx` sets only).
    Q15,
}

/// Which kernel set each weight of a model gets: one set for every weight, except that
/// `ffn_down` weights may keep the f32 kernels or take Q15 activations (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuKernelPolicy {
    /// The set of every weight without an exception.
    pub kernels: CpuKernels,
    /// What `*ffn_down.weight` tensors run.
    pub ffn_down: FfnDown,
}

impl CpuKernelPolicy {
    /// The same set for every weight.
    pub const fn uniform(kernels: CpuKernels) -> CpuKernelPolicy {
        CpuKernelPolicy {
            kernels,
            ffn_down: FfnDown::Same,
        }
    }

    /// What `auto` means on this CPU: [`CpuKernels::best`], with `ffn_down` on Q15
    /// activations for the `amx` and `vnni8` sets and on the f32 kernels for `avx2`,
    /// `neon_dotprod` and `neon` (per-row layouts take no Q15 rows); f32
    /// everywhere on a CPU without a SIMD integer set (the portable integer dots are not
    /// faster than the f32 decode path).
    pub fn auto() -> CpuKernelPolicy {
        match CpuKernels::best() {
            CpuKernels::Scalar | CpuKernels::F32 => CpuKernelPolicy::uniform(CpuKernels::F32),
            kernels @ (CpuKernels::Amx | CpuKernels::Vnni8) => CpuKernelPolicy {
                kernels,
                ffn_down: FfnDown::Q15,
            },
            kernels => CpuKernelPolicy {
                kernels,
                ffn_down: FfnDown::F32,
            },
        }
    }

    /// Parses a `PAGODA_CPU_KERNELS` value: `auto` (or empty) is [`CpuKernelPolicy::auto`],
    /// a set name is that set for every weight, `SET+f32_ffn_down` that set with `ffn_down`
    /// on the f32 kernels and `SET+q15_ffn_down` (`amx` or `vnni8`) with `ffn_down` on Q15
    /// activations (the names `auto` logs). The error names the bad value.
    pub fn parse(value: &str) -> Result<CpuKernelPolicy, crate::UnknownChoice> {
        Ok(CpuKernelPolicy::parse_choice(value)?.unwrap_or_else(CpuKernelPolicy::auto))
    }

    /// The set for the weight stored under `name` (a GGUF tensor name).
    pub fn for_tensor(self, name: &str) -> CpuKernels {
        if self.ffn_down == FfnDown::F32 && name.ends_with(FFN_DOWN_SUFFIX) {
            CpuKernels::F32
        } else {
            self.kernels
        }
    }

    /// Whether the weight stored under `name` quantizes its activations to Q15
    /// ([`crate::linear::Weight::with_q15_activations`]).
    pub fn q15_for_tensor(self, name: &str) -> bool {
        self.ffn_down == FfnDown::Q15 && name.ends_with(FFN_DOWN_SUFFIX)
    }

    /// The name for logs and metrics: the set's name (`amx`, `vnni8`, `vnni`, `avx2`,
    /// `neon_dotprod`, `neon`, `scalar`, `f32`), with `+f32_ffn_down` or `+q15_ffn_down` appended for the `ffn_down`
    /// exception (`amx+q15_ffn_down`).
    pub fn name(self) -> &'static str {
        use CpuKernels::*;
        match (self.kernels, self.ffn_down) {
            (kernels, FfnDown::Same) | (kernels @ F32, _) => kernels.name(),
            (Amx, FfnDown::F32) => "amx+f32_ffn_down",
            (Vnni8, FfnDown::F32) => "vnni8+f32_ffn_down",
            (Vnni, FfnDown::F32) => "vnni+f32_ffn_down",
            (Avx2, FfnDown::F32) => "avx2+f32_ffn_down",
            (NeonDot, FfnDown::F32) => "neon_dotprod+f32_ffn_down",
            (Neon, FfnDown::F32) => "neon+f32_ffn_down",
            (Scalar, FfnDown::F32) => "scalar+f32_ffn_down",
            (Amx, FfnDown::Q15) => "amx+q15_ffn_down",
            (Vnni8, FfnDown::Q15) => "vnni8+q15_ffn_down",
            // `parse_choice` builds Q15 only for the interleaved sets.
            (Vnni | Avx2 | NeonDot | Neon | Scalar, FfnDown::Q15) => {
                unreachable!("Q15 needs vnni8 or amx")
            }
        }
    }

    /// The process-wide policy: `PAGODA_CPU_KERNELS` read once (unset: `auto`), validated
    /// against the CPU (a set it lacks, or an unknown value, falls back to `auto` with a
    /// warning), and logged once at INFO.
    pub fn selected() -> CpuKernelPolicy {
        static SELECTED: OnceLock<CpuKernelPolicy> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let policy = choose_from_env::<CpuKernelPolicy>();
            let tiles = match (policy.kernels, crate::linear::cpu::amx::backend()) {
                (CpuKernels::Amx, Some(crate::linear::cpu::amx::TileBackend::Emulated)) => {
                    " (AMX-INT8 tiles, emulated, for multi-row matmuls)"
                }
                (CpuKernels::Amx, _) => " (AMX-INT8 tiles for multi-row matmuls)",
                _ => "",
            };
            let activations = match (policy.kernels, policy.ffn_down) {
                (CpuKernels::F32, _) => "f32 activations, weights decoded in registers".to_string(),
                (_, FfnDown::Same) => {
                    format!("Q8 activations, integer dots on repacked weights{tiles}")
                }
                (_, FfnDown::F32) => format!(
                    "Q8 activations and integer dots on repacked weights{tiles}, except \
                     ffn_down: f32 activations, weights decoded in registers"
                ),
                (_, FfnDown::Q15) => format!(
                    "Q8 activations and integer dots on repacked weights{tiles}, except \
                     ffn_down: Q15 activations, two integer dots per block"
                ),
            };
            tracing::info!("CPU kernels: {} ({activations})", policy.name());
            policy
        })
    }
}

/// The kernel-set switch ([`CpuKernelPolicy::selected`]).
pub const CPU_KERNELS_ENV_VAR: &str = "PAGODA_CPU_KERNELS";

impl KernelChoice for CpuKernelPolicy {
    const ENV_VAR: &'static str = CPU_KERNELS_ENV_VAR;
    const WORDS: &'static [(&'static str, Self)] = &[
        ("amx", CpuKernelPolicy::uniform(CpuKernels::Amx)),
        ("vnni8", CpuKernelPolicy::uniform(CpuKernels::Vnni8)),
        ("vnni", CpuKernelPolicy::uniform(CpuKernels::Vnni)),
        ("avx2", CpuKernelPolicy::uniform(CpuKernels::Avx2)),
        (
            "neon_dotprod",
            CpuKernelPolicy::uniform(CpuKernels::NeonDot),
        ),
        ("neon", CpuKernelPolicy::uniform(CpuKernels::Neon)),
        ("scalar", CpuKernelPolicy::uniform(CpuKernels::Scalar)),
        ("f32", CpuKernelPolicy::uniform(CpuKernels::F32)),
    ];
    fn choice_name(self) -> &'static str {
        self.name()
    }
    fn choice_supported(self) -> bool {
        self.kernels.is_supported()
    }
    fn auto_choice() -> Self {
        CpuKernelPolicy::auto()
    }
    fn parse_choice(text: &str) -> Result<Option<Self>, crate::UnknownChoice> {
        let text = text.trim().to_ascii_lowercase().replace('-', "_");
        // A set with an `ffn_down` exception, as `auto` names its choice.
        for (suffix, ffn_down) in [
            ("+f32_ffn_down", FfnDown::F32),
            ("+q15_ffn_down", FfnDown::Q15),
        ] {
            let Some(set) = text.strip_suffix(suffix) else {
                continue;
            };
            let kernels = crate::kernel_choice::parse::<CpuKernelPolicy>(set)?
                .map_or_else(CpuKernels::best, |policy| policy.kernels);
            let allowed = match ffn_down {
                FfnDown::Q15 => matches!(kernels, CpuKernels::Amx | CpuKernels::Vnni8),
                _ => kernels != CpuKernels::F32,
            };
            if !allowed {
                return Err(crate::UnknownChoice {
                    setting: CPU_KERNELS_ENV_VAR,
                    value: text.clone(),
                    allowed: if ffn_down == FfnDown::Q15 {
                        "SET+q15_ffn_down with SET amx or vnni8".to_string()
                    } else {
                        "SET+f32_ffn_down with an integer SET".to_string()
                    },
                });
            }
            return Ok(Some(CpuKernelPolicy { kernels, ffn_down }));
        }
        crate::kernel_choice::parse(&text)
    }
}

/// The name of the process-wide kernel policy ([`CpuKernelPolicy::selected`]), for metrics
/// and status pages, e.g. a Prometheus gauge `pagoda_cpu_kernels_info{set="amx+q15_ffn_down"} 1`:
/// `amx`, `vnni8`, `vnni`, `avx2`, `scalar` (Q8 activations, integer dots, every weight), `f32`
/// (f32 activations, every weight), or a set with `+q15_ffn_down` or `+f32_ffn_down` (what
/// `auto` selects: `ffn_down` on Q15 or f32 activations). The first call (from here or from loading a model) reads the
/// environment and logs the choice once; later calls return the same name.
pub fn cpu_kernels_name() -> &'static str {
    CpuKernelPolicy::selected().name()
}

#[cfg(test)]
mod tests {
    use super::*;

    const OTHER_WEIGHTS: [&str; 6] = [
        "blk.0.ffn_up.weight",
        "blk.0.ffn_gate.weight",
        "blk.0.attn_q.weight",
        "blk.0.attn_output.weight",
        "token_embd.weight",
        "output.weight",
    ];

    #[test]
    fn the_ffn_down_exception_applies_to_ffn_down_only() {
        for (ffn_down, kernels, q15, name) in [
            (FfnDown::F32, CpuKernels::F32, false, "vnni+f32_ffn_down"),
            (FfnDown::Q15, CpuKernels::Vnni8, true, "vnni8+q15_ffn_down"),
        ] {
            let set = if q15 {
                CpuKernels::Vnni8
            } else {
                CpuKernels::Vnni
            };
            let policy = CpuKernelPolicy {
                kernels: set,
                ffn_down,
            };
            for layer in [0, 7, 29] {
                let tensor = format!("blk.{layer}.ffn_down.weight");
                assert_eq!(policy.for_tensor(&tensor), kernels, "{tensor}");
                assert_eq!(policy.q15_for_tensor(&tensor), q15, "{tensor}");
            }
            for tensor in OTHER_WEIGHTS {
                assert_eq!(policy.for_tensor(tensor), set, "{tensor}");
                assert!(!policy.q15_for_tensor(tensor), "{tensor}");
            }
            assert_eq!(policy.name(), name);
        }
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
            assert!(!policy.q15_for_tensor("blk.3.ffn_down.weight"));
            assert_eq!(policy.name(), kernels.name());
        }
    }

    #[test]
    fn a_set_with_an_ffn_down_exception_parses_from_its_name() {
        for (kernels, ffn_down) in [
            (CpuKernels::Amx, FfnDown::F32),
            (CpuKernels::Vnni8, FfnDown::F32),
            (CpuKernels::Vnni, FfnDown::F32),
            (CpuKernels::Avx2, FfnDown::F32),
            (CpuKernels::Amx, FfnDown::Q15),
            (CpuKernels::Vnni8, FfnDown::Q15),
        ] {
            let policy = CpuKernelPolicy { kernels, ffn_down };
            assert_eq!(CpuKernelPolicy::parse(policy.name()), Ok(policy));
        }
        for bad in [
            "f32+f32_ffn_down",
            "vnni+q15_ffn_down",
            "avx2+q15_ffn_down",
            "f32+q15_ffn_down",
        ] {
            let error = CpuKernelPolicy::parse(bad).unwrap_err().to_string();
            assert!(
                error.contains(bad) && error.contains("ffn_down with"),
                "{error}"
            );
        }
        assert!(CpuKernelPolicy::parse("sse9+f32_ffn_down")
            .unwrap_err()
            .to_string()
            .contains("sse9"));
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
            CpuKernels::Amx | CpuKernels::Vnni8 => {
                assert_eq!(auto.kernels, CpuKernels::best());
                assert_eq!(auto.ffn_down, FfnDown::Q15);
            }
            CpuKernels::Vnni | CpuKernels::Avx2 | CpuKernels::NeonDot | CpuKernels::Neon => {
                assert_eq!(auto.kernels, CpuKernels::best());
                assert_eq!(auto.ffn_down, FfnDown::F32);
            }
            _ => assert_eq!(auto, CpuKernelPolicy::uniform(CpuKernels::F32)),
        }
        let error = CpuKernelPolicy::parse("sse9").unwrap_err().to_string();
        assert!(error.contains("sse9") && error.contains("amx"), "{error}");
    }
}
