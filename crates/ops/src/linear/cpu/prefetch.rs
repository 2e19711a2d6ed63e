//! Software prefetch of the weight stream in the interleaved (`vnni8`) integer kernels.
//!
//! A decode step reads every weight once (about 96 MB per token for the default model) and
//! is bound by how fast one core can pull memory, which the hardware prefetchers alone do not
//! saturate: the kernels touch each 64-byte line of a weight record once, a few hundred
//! nanoseconds of arithmetic apart. Asking for the line [`distance`] bytes ahead of the one in
//! use keeps more misses in flight. It changes no result, only when the bytes arrive.
//!
//! `PAGODA_CPU_PREFETCH=auto|off|BYTES` (unset or empty: `auto` = [`DEFAULT_BYTES`]).
//! Measured (`docs/benchmark_results/cpu-prefetch-epyc-h200host-2026-12-01.md`), decode
//! (tg128) medians against no prefetch: the Xeon host +33% at two threads (0.82x to 1.08x
//! of the clang/AMX llama.cpp in the same runs) and +19-48% at one; the EPYC +7% at two
//! threads and +24-50% at one. Prefill changed by 0 to +8%.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The environment variable that sets the prefetch distance.
pub const PREFETCH_ENV_VAR: &str = "PAGODA_CPU_PREFETCH";

/// Bytes ahead of the record in use that `auto` prefetches (measured against 4096 and 16384:
/// the best median on both machines).
pub const DEFAULT_BYTES: usize = 8192;

/// Largest distance accepted (farther lines would be evicted before use).
pub const MAX_BYTES: usize = 1 << 20;

static PREFETCHED: AtomicU64 = AtomicU64::new(0);

/// Parses a [`PREFETCH_ENV_VAR`] value (ASCII case and surrounding spaces ignored): `auto` or
/// empty give [`DEFAULT_BYTES`], `off` or `0` give 0 (no prefetch), a byte count up to
/// [`MAX_BYTES`] gives itself; anything else is an error naming the value and the fix.
pub fn parse(text: &str) -> Result<usize, crate::UnknownChoice> {
    match text.trim().to_ascii_lowercase().as_str() {
        "" | "auto" => Ok(DEFAULT_BYTES),
        "off" => Ok(0),
        number => match number.parse::<usize>() {
            Ok(bytes) if bytes <= MAX_BYTES => Ok(bytes),
            _ => Err(crate::UnknownChoice {
                setting: PREFETCH_ENV_VAR,
                value: text.to_string(),
                allowed: format!("auto, off, a byte count up to {MAX_BYTES}"),
            }),
        },
    }
}

/// The process-wide distance in bytes (0: off): the [`PREFETCH_ENV_VAR`] setting, logged once
/// at INFO.
pub fn distance() -> usize {
    static DISTANCE: OnceLock<usize> = OnceLock::new();
    *DISTANCE.get_or_init(|| {
        let value = pagoda_config::global().word(PREFETCH_ENV_VAR);
        let bytes = parse(value).unwrap_or_else(|error| {
            tracing::warn!("{error}; using auto");
            DEFAULT_BYTES
        });
        if bytes == 0 {
            tracing::info!("CPU integer kernels: no software prefetch ({PREFETCH_ENV_VAR}=off)");
        } else {
            tracing::info!(
                "CPU integer kernels: software prefetch {bytes} bytes ahead of the weight \
                 stream ({PREFETCH_ENV_VAR}=off to disable)"
            );
        }
        bytes
    })
}

/// Integer matmuls (or shared decode regions) on a SIMD kernel that prefetches (`vnni8`,
/// and the per-row `vnni`/`avx2` sets; the scalar set does not), since the process started,
/// counted while prefetch is on.
pub fn prefetched_matmul_count() -> u64 {
    PREFETCHED.load(Ordering::Relaxed)
}

/// Counts one matmul (or shared region) for [`prefetched_matmul_count`] when prefetch is on.
pub(crate) fn count_matmul() {
    if distance() > 0 {
        PREFETCHED.fetch_add(1, Ordering::Relaxed);
    }
}

/// Prefetches (to L1) the lines of `bytes` bytes starting `ahead` bytes past `record`, one
/// per 64 bytes. The addresses may lie past the weights: a prefetch never faults.
///
/// # Safety
/// SSE (every x86-64 CPU); `record` may be any pointer (it is only offset, never read).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn lines(record: *const u8, ahead: usize, bytes: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let mut line = 0;
    while line < bytes {
        // SAFETY: prefetch is a hint; `wrapping_add` keeps the address computation defined.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(record.wrapping_add(ahead + line) as *const i8) };
        line += 64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_accepts_auto_off_and_byte_counts_only() {
        assert_eq!(parse(""), Ok(DEFAULT_BYTES));
        assert_eq!(parse(" AUTO "), Ok(DEFAULT_BYTES));
        assert_eq!(parse("off"), Ok(0));
        assert_eq!(parse("0"), Ok(0));
        assert_eq!(parse("4096"), Ok(4096));
        assert_eq!(parse(&MAX_BYTES.to_string()), Ok(MAX_BYTES));
        for bad in ["-1", "4k", "lots", &(MAX_BYTES + 1).to_string()] {
            let error = parse(bad).unwrap_err().to_string();
            assert!(
                error.contains(PREFETCH_ENV_VAR) && error.contains(bad),
                "{error}"
            );
        }
    }
}
