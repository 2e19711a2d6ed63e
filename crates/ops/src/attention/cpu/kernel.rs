//! Which instruction set runs the split-KV chunk kernel (the online-softmax pass over one
//! work item: the query heads of one KV head, from one or more query rows, over one chunk),
//! chosen once per process.
//!
//! `PAGODA_CPU_ATTENTION=auto|simd|avx512|avx2|neon|scalar` (unset or empty: `auto`). `auto`
//! and `simd` pick the widest kernel this CPU runs (AVX-512F, else AVX2+FMA; NEON on aarch64;
//! else scalar);
//! `scalar` forces the portable kernel (the oracle of the SIMD ones). A kernel the CPU lacks,
//! or an unknown value, falls back to `auto` with a warning. The choice is logged once at
//! INFO. Every kernel is deterministic for a given row, so batch invariance holds under each
//! of them; they differ from each other by float rounding only (~1e-6 relative).

use std::sync::OnceLock;

use super::chunk::{self, ChunkArgs, HeadTask};
use crate::attention::PagedKv;
use crate::kernel_choice::{choose_from_env, KernelChoice};

/// The environment variable that selects the attention kernel.
pub const ATTENTION_KERNEL_ENV_VAR: &str = "PAGODA_CPU_ATTENTION";

/// An implementation of the split-KV chunk kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionKernel {
    /// Portable Rust (auto-vectorized dot and axpy, libm `exp2` per score): the oracle.
    Scalar,
    /// 8-lane AVX2+FMA: FMA dot products, polynomial `exp2` over 8 scores, FMA V accumulation.
    /// Needs `head_dim % 8 == 0` (otherwise that call runs [`AttentionKernel::Scalar`]).
    Avx2,
    /// 16-lane AVX-512F, same recipe as [`AttentionKernel::Avx2`]. Needs `head_dim % 16 == 0`
    /// (otherwise that call runs the AVX2 kernel, or scalar when `head_dim % 8 != 0`).
    Avx512,
    /// 4-lane NEON (aarch64), same recipe as [`AttentionKernel::Avx2`]. Needs
    /// `head_dim % 4 == 0` (otherwise that call runs [`AttentionKernel::Scalar`]).
    Neon,
}

impl AttentionKernel {
    /// Lower-case name, as [`ATTENTION_KERNEL_ENV_VAR`] spells it: `scalar`, `avx2`, `avx512`,
    /// `neon`.
    pub fn name(self) -> &'static str {
        crate::kernel_choice::word(self)
    }

    /// Whether this CPU can run the kernel (detected once per process).
    pub fn is_supported(self) -> bool {
        match self {
            AttentionKernel::Scalar => true,
            AttentionKernel::Avx2 => cpu_features().0,
            AttentionKernel::Avx512 => cpu_features().1,
            AttentionKernel::Neon => cpu_features().2,
        }
    }

    /// The widest supported kernel: AVX-512F, else AVX2+FMA, else NEON, else scalar.
    pub fn best() -> AttentionKernel {
        [
            AttentionKernel::Avx512,
            AttentionKernel::Avx2,
            AttentionKernel::Neon,
        ]
        .into_iter()
        .find(|kernel| kernel.is_supported())
        .unwrap_or(AttentionKernel::Scalar)
    }

    /// Parses an [`ATTENTION_KERNEL_ENV_VAR`] value (ASCII case and surrounding spaces
    /// ignored): `auto`, `simd` or empty give `Ok(None)` (use [`AttentionKernel::best`]);
    /// `scalar`, `avx2`, `avx512`, `neon` give that kernel; anything else is an error naming the value
    /// and the accepted ones.
    pub fn parse(text: &str) -> Result<Option<AttentionKernel>, crate::UnknownChoice> {
        crate::kernel_choice::parse(text)
    }

    /// The process-wide kernel: [`ATTENTION_KERNEL_ENV_VAR`] read once (unset: `auto`),
    /// validated against the CPU (an unsupported or unknown value falls back to
    /// [`AttentionKernel::best`] with a warning) and logged once at INFO.
    pub fn selected() -> AttentionKernel {
        static SELECTED: OnceLock<AttentionKernel> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let kernel = choose_from_env::<AttentionKernel>();
            tracing::info!(
                "CPU attention kernel: {} (split-KV online softmax over the paged cache)",
                kernel.name()
            );
            kernel
        })
    }
}

impl KernelChoice for AttentionKernel {
    const ENV_VAR: &'static str = ATTENTION_KERNEL_ENV_VAR;
    const WORDS: &'static [(&'static str, Self)] = &[
        ("avx512", AttentionKernel::Avx512),
        ("avx2", AttentionKernel::Avx2),
        ("neon", AttentionKernel::Neon),
        ("scalar", AttentionKernel::Scalar),
    ];
    const AUTO_WORDS: &'static [&'static str] = &["simd"];
    fn choice_supported(self) -> bool {
        self.is_supported()
    }
    fn auto_choice() -> Self {
        AttentionKernel::best()
    }
}

impl std::fmt::Display for AttentionKernel {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.name())
    }
}

/// `(avx2 && fma, avx512f && avx2 && fma, neon)`, detected once.
fn cpu_features() -> (bool, bool, bool) {
    static FEATURES: OnceLock<(bool, bool, bool)> = OnceLock::new();
    *FEATURES.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            (avx2, avx2 && is_x86_feature_detected!("avx512f"), false)
        }
        #[cfg(target_arch = "aarch64")]
        {
            (
                false,
                false,
                std::arch::is_aarch64_feature_detected!("neon"),
            )
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            (false, false, false)
        }
    })
}

/// One split-KV work item on `kernel`: the query heads `tasks`, all reading KV head `kv_head`
/// of `request` from visible token `start` to their own `end`. The heads may come from
/// several query rows (rows of one request share the item's K/V tiles, which is what makes
/// prefill fast); each head's result depends only on its query, its range and the cache,
/// never on the other tasks, so batch invariance holds. A SIMD kernel reads each token's K
/// row once per pass and its V row once per block of heads; the scalar kernel (also used for
/// an unsupported kernel or a `head_dim` the lanes do not divide) runs the tasks one after
/// the other. Callers have validated the pool, the page table and the slice lengths.
pub(crate) fn attend_heads(
    kernel: AttentionKernel,
    kv: &PagedKv<'_>,
    request: usize,
    kv_head: usize,
    start: usize,
    scale: f32,
    tasks: &mut [HeadTask<'_>],
) {
    let head_dim = kv.layout.head_dim;
    let args = ChunkArgs {
        kv,
        request,
        kv_head,
        start,
        scale,
    };
    #[cfg(target_arch = "x86_64")]
    {
        use super::simd::x86::{chunk_avx2, chunk_avx512};
        use super::simd::MAX_HEAD_DIM;
        let (avx2, avx512, _) = cpu_features();
        if head_dim <= MAX_HEAD_DIM {
            match kernel {
                AttentionKernel::Avx512 if avx512 && head_dim.is_multiple_of(16) => {
                    // SAFETY: the CPU supports AVX-512F, AVX2 and FMA (detected above).
                    return unsafe { chunk_avx512(&args, tasks) };
                }
                AttentionKernel::Avx512 | AttentionKernel::Avx2
                    if avx2 && head_dim.is_multiple_of(8) =>
                {
                    // SAFETY: the CPU supports AVX2 and FMA (detected above).
                    return unsafe { chunk_avx2(&args, tasks) };
                }
                _ => {}
            }
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        use super::simd::{neon::chunk_neon, MAX_HEAD_DIM};
        if kernel == AttentionKernel::Neon
            && cpu_features().2
            && head_dim <= MAX_HEAD_DIM
            && head_dim.is_multiple_of(4)
        {
            // SAFETY: the CPU supports NEON (detected above).
            return unsafe { chunk_neon(&args, tasks) };
        }
    }
    let _ = (kernel, head_dim);
    chunk::scalar(&args, tasks);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_accepts_the_documented_values_only() {
        assert_eq!(AttentionKernel::parse(" SIMD "), Ok(None));
        assert_eq!(AttentionKernel::parse(""), Ok(None));
        assert_eq!(
            AttentionKernel::parse("scalar"),
            Ok(Some(AttentionKernel::Scalar))
        );
        assert_eq!(
            AttentionKernel::parse("AVX512"),
            Ok(Some(AttentionKernel::Avx512))
        );
        let error = AttentionKernel::parse("sse").unwrap_err().to_string();
        assert!(error.contains(ATTENTION_KERNEL_ENV_VAR) && error.contains("sse"));
        assert!(AttentionKernel::best().is_supported());
        assert_eq!(AttentionKernel::Avx2.to_string(), "avx2");
    }
}
