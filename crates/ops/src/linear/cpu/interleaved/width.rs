//! The register width of the interleaved (`vnni8`) integer kernels: 8 rows per 256-bit
//! register, or two interleaved groups, 16 rows, per 512-bit register ([`super::wide`]).
//! Each lane runs the 8-row kernel's operations either way, so the same bits.
//!
//! - Decode (one-token matmuls): `PAGODA_CPU_INT_DECODE=auto|avx512|avx2` (unset or empty:
//!   `auto`: `avx512` on Intel CPUs, `avx2` elsewhere, see [`IntDecode::best`]);
//!   [`wide_decode_count`] counts the decode matmuls (or shared decode regions) that ran 16
//!   rows per register.
//! - Prefill (matmuls of several tokens, tiles of 4 tokens): `PAGODA_CPU_INT_PREFILL=auto|
//!   avx512|avx2` (unset or empty: `auto` = `avx512` on every CPU that runs the kernel, see
//!   [`IntPrefill::best`]); [`wide_prefill_count`] counts the prefill matmuls that ran it.
//!
//! Both are logged once at INFO.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::kernel_choice::{choose_from_env, KernelChoice};

/// The environment variable that selects the register width of the interleaved decode.
pub const INT_DECODE_ENV_VAR: &str = "PAGODA_CPU_INT_DECODE";

/// The register width of the interleaved integer decode (one-token matmuls).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IntDecode {
    /// One group of 8 rows per 256-bit register: the reference.
    Avx2,
    /// Two groups, 16 rows, per 512-bit register.
    Avx512,
}

impl IntDecode {
    /// Lower-case name, as [`INT_DECODE_ENV_VAR`] spells it.
    pub fn name(self) -> &'static str {
        crate::kernel_choice::word(self)
    }

    /// Whether this CPU runs it (both need what the interleaved kernel needs).
    pub fn is_supported(self) -> bool {
        super::is_supported()
    }

    /// What `auto` picks: [`IntDecode::Avx512`] on Intel CPUs, [`IntDecode::Avx2`] on
    /// others. Measured
    /// (`docs/benchmark_results/cpu-vnni8-wide-decode-epyc-h200host-2026-12-01.md`): on an
    /// Intel Xeon (Emerald Rapids, full-width 512-bit units) the 16-row kernel cut the
    /// integer matmuls' decode time by 20-30%; on an AMD EPYC (Zen 4, which splits 512-bit
    /// operations in two) it decoded 3-9% slower.
    pub fn best() -> IntDecode {
        if intel_cpu() {
            IntDecode::Avx512
        } else {
            IntDecode::Avx2
        }
    }

    /// Parses an [`INT_DECODE_ENV_VAR`] value (ASCII case and surrounding spaces ignored):
    /// `auto` or empty give `Ok(None)`; anything but `avx512` and `avx2` is an error naming
    /// the value and the accepted ones.
    pub fn parse(text: &str) -> Result<Option<IntDecode>, crate::UnknownChoice> {
        crate::kernel_choice::parse(text)
    }

    /// The process-wide width: [`INT_DECODE_ENV_VAR`] read once (unset: `auto`), validated
    /// and logged once at INFO.
    pub fn selected() -> IntDecode {
        static SELECTED: OnceLock<IntDecode> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let width = choose_from_env::<IntDecode>();
            tracing::info!(
                "CPU integer decode (vnni8): {} ({INT_DECODE_ENV_VAR}=auto|avx512|avx2; {} rows \
                 per register)",
                width.name(),
                if width == IntDecode::Avx512 { 16 } else { 8 }
            );
            width
        })
    }
}

impl KernelChoice for IntDecode {
    const ENV_VAR: &'static str = INT_DECODE_ENV_VAR;
    const WORDS: &'static [(&'static str, Self)] =
        &[("avx512", IntDecode::Avx512), ("avx2", IntDecode::Avx2)];
    fn choice_supported(self) -> bool {
        self.is_supported()
    }
    fn auto_choice() -> Self {
        IntDecode::best()
    }
}

/// Whether CPUID names the vendor "GenuineIntel".
fn intel_cpu() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let leaf = std::arch::x86_64::__cpuid(0);
        let mut vendor = [0u8; 12];
        vendor[..4].copy_from_slice(&leaf.ebx.to_le_bytes());
        vendor[4..8].copy_from_slice(&leaf.edx.to_le_bytes());
        vendor[8..].copy_from_slice(&leaf.ecx.to_le_bytes());
        &vendor == b"GenuineIntel"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

static WIDE_DECODES: AtomicU64 = AtomicU64::new(0);

/// Decode matmuls (or shared decode regions) that ran 16 rows per register, since the
/// process started.
pub fn wide_decode_count() -> u64 {
    WIDE_DECODES.load(Ordering::Relaxed)
}

/// Counts one decode region for [`wide_decode_count`] when the wide kernel is selected.
pub(crate) fn count_decode() {
    if IntDecode::selected() == IntDecode::Avx512 {
        WIDE_DECODES.fetch_add(1, Ordering::Relaxed);
    }
}

/// The environment variable that selects the register width of interleaved prefills.
pub const INT_PREFILL_ENV_VAR: &str = "PAGODA_CPU_INT_PREFILL";

/// The register width of interleaved integer prefills (matmuls of several tokens).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IntPrefill {
    /// One group of 8 rows per 256-bit register: the reference.
    Avx2,
    /// Two groups, 16 rows, per 512-bit register.
    Avx512,
}

impl IntPrefill {
    /// Lower-case name, as [`INT_PREFILL_ENV_VAR`] spells it.
    pub fn name(self) -> &'static str {
        crate::kernel_choice::word(self)
    }

    /// What `auto` picks: [`IntPrefill::Avx512`]. Measured
    /// (`docs/benchmark_results/cpu-kquants-epyc-2026-12-01.md`): on the AMD EPYC (Zen 4,
    /// which splits 512-bit operations in two) prefill 1.2-1.6x across Q4_0, Q4_1, Q8_0 and
    /// the K-quants, since a broadcast activation word and the float combine serve 16 rows.
    pub fn best() -> IntPrefill {
        IntPrefill::Avx512
    }

    /// Parses an [`INT_PREFILL_ENV_VAR`] value as [`IntDecode::parse`] does.
    pub fn parse(text: &str) -> Result<Option<IntPrefill>, crate::UnknownChoice> {
        crate::kernel_choice::parse(text)
    }

    /// The process-wide width: [`INT_PREFILL_ENV_VAR`] read once (unset: `auto`), validated
    /// and logged once at INFO.
    pub fn selected() -> IntPrefill {
        static SELECTED: OnceLock<IntPrefill> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let width = choose_from_env::<IntPrefill>();
            tracing::info!(
                "CPU integer prefill (vnni8): {} ({INT_PREFILL_ENV_VAR}=auto|avx512|avx2; {} rows \
                 per register)",
                width.name(),
                if width == IntPrefill::Avx512 { 16 } else { 8 }
            );
            width
        })
    }
}

impl KernelChoice for IntPrefill {
    const ENV_VAR: &'static str = INT_PREFILL_ENV_VAR;
    const WORDS: &'static [(&'static str, Self)] =
        &[("avx512", IntPrefill::Avx512), ("avx2", IntPrefill::Avx2)];
    fn choice_supported(self) -> bool {
        super::is_supported()
    }
    fn auto_choice() -> Self {
        IntPrefill::best()
    }
}

static WIDE_PREFILLS: AtomicU64 = AtomicU64::new(0);

/// Prefill matmuls that ran 16 rows per register since the process started.
pub fn wide_prefill_count() -> u64 {
    WIDE_PREFILLS.load(Ordering::Relaxed)
}

/// Counts one prefill matmul for [`wide_prefill_count`].
pub(crate) fn count_prefill() {
    WIDE_PREFILLS.fetch_add(1, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_accepts_the_documented_values_only() {
        assert_eq!(IntDecode::parse(" AUTO "), Ok(None));
        assert_eq!(IntDecode::parse(""), Ok(None));
        assert_eq!(IntDecode::parse("avx512"), Ok(Some(IntDecode::Avx512)));
        assert_eq!(IntDecode::parse("AVX2"), Ok(Some(IntDecode::Avx2)));
        let error = IntDecode::parse("zmm").unwrap_err().to_string();
        assert!(error.contains(INT_DECODE_ENV_VAR) && error.contains("zmm"));
        assert_eq!(IntDecode::best() == IntDecode::Avx512, intel_cpu());
        assert_eq!(IntPrefill::parse(" Auto "), Ok(None));
        assert_eq!(IntPrefill::parse("avx2"), Ok(Some(IntPrefill::Avx2)));
        assert_eq!(IntPrefill::parse("AVX512"), Ok(Some(IntPrefill::Avx512)));
        let error = IntPrefill::parse("ymm").unwrap_err().to_string();
        assert!(error.contains(INT_PREFILL_ENV_VAR) && error.contains("ymm"));
    }
}
