//! The bit-plane layout of 5- and 6-bit values in the interleaved records (Q5_0, Q5_1, Q5_K,
//! Q6_K), and its switch.
//!
//! Byte records spend 8 bits on values of 5 or 6: a decode step, which reads every weight
//! once and is bound by memory, streams 1.5-1.6 times the bytes the file stores. The plane
//! layout keeps the low 4 bits as a nibble record (the Q4 layout) and each higher bit as a
//! plane: per weight register of the kernel (32 bytes: 8 rows x 4 values) one 32-bit mask,
//! bit `i` the bit of byte `i`. The kernels add 16 (and 32) to the bytes a mask selects
//! (`vpaddb` under an AVX-512 mask register), which rebuilds the bytes exactly, so the
//! results are the byte layout's bits. Q5_K goes from 256 + 16 to 160 + 16 bytes per group
//! and block, Q6_K from 288 to 224.
//!
//! `PAGODA_CPU_HIGH_BITS=auto|planes|bytes` (unset or empty: `auto` = [`HighBits::Planes`]),
//! read once and logged at INFO; [`plane_matmul_count`] counts the integer matmuls (or
//! shared decode regions) that ran over plane records.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::kernel_choice::{choose_from_env, KernelChoice};

/// The environment variable that picks the layout of 5- and 6-bit values.
pub const HIGH_BITS_ENV_VAR: &str = "PAGODA_CPU_HIGH_BITS";

/// How the interleaved records hold values of 5 or 6 bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HighBits {
    /// A byte per value (the reference layout).
    Bytes,
    /// A nibble per value and one bit plane per bit above the fourth.
    Planes,
}

impl HighBits {
    /// Lower-case name, as [`HIGH_BITS_ENV_VAR`] spells it.
    pub fn name(self) -> &'static str {
        crate::kernel_choice::word(self)
    }

    /// Parses a [`HIGH_BITS_ENV_VAR`] value (ASCII case and surrounding spaces ignored):
    /// `auto` or empty give `Ok(None)`; anything but `planes` and `bytes` is an error naming
    /// the value and the accepted ones.
    pub fn parse(text: &str) -> Result<Option<HighBits>, crate::UnknownChoice> {
        crate::kernel_choice::parse(text)
    }

    /// The process-wide layout: [`HIGH_BITS_ENV_VAR`] read once (unset: `auto`), validated
    /// and logged once at INFO.
    pub fn selected() -> HighBits {
        static SELECTED: OnceLock<HighBits> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let layout = choose_from_env::<HighBits>();
            tracing::info!(
                "CPU integer weights of 5 and 6 bits (vnni8): {} ({HIGH_BITS_ENV_VAR}=auto|planes|bytes)",
                layout.name()
            );
            layout
        })
    }
}

impl KernelChoice for HighBits {
    const ENV_VAR: &'static str = HIGH_BITS_ENV_VAR;
    const WORDS: &'static [(&'static str, Self)] =
        &[("planes", HighBits::Planes), ("bytes", HighBits::Bytes)];
    fn choice_supported(self) -> bool {
        true
    }
    fn auto_choice() -> Self {
        HighBits::Planes
    }
}

static PLANE_MATMULS: AtomicU64 = AtomicU64::new(0);

/// Integer matmuls (or shared decode regions) over plane records since the process started.
pub fn plane_matmul_count() -> u64 {
    PLANE_MATMULS.load(Ordering::Relaxed)
}

/// Counts one matmul (or shared region) for [`plane_matmul_count`].
pub(crate) fn count_matmul() {
    PLANE_MATMULS.fetch_add(1, Ordering::Relaxed);
}

/// The plane masks of one block of 8 rows from its values: `values[lane]` the row's 32
/// values (value order), `planes` the bits above the fourth (1 or 2). Returns, per plane,
/// the 8 weight registers' masks (register `r < 4` holds values `4 r .. 4 r + 4` of each
/// row, `r >= 4` values `16 + 4 (r - 4) ..`; bit `4 lane + j` is value `j`'s of row `lane`).
pub(super) fn masks(values: &[[u8; 32]; 8], planes: usize) -> [[u32; 8]; 2] {
    let mut out = [[0u32; 8]; 2];
    for (p, masks) in out.iter_mut().enumerate().take(planes) {
        for (r, mask) in masks.iter_mut().enumerate() {
            for (lane, values) in values.iter().enumerate() {
                for j in 0..4 {
                    let value = values[4 * (r % 4) + j + 16 * (r / 4)];
                    if (value >> (4 + p)) & 1 == 1 {
                        *mask |= 1 << (4 * lane + j);
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_accepts_auto_planes_and_bytes_only() {
        assert_eq!(HighBits::parse(""), Ok(None));
        assert_eq!(HighBits::parse(" Auto "), Ok(None));
        assert_eq!(HighBits::parse("planes"), Ok(Some(HighBits::Planes)));
        assert_eq!(HighBits::parse("BYTES"), Ok(Some(HighBits::Bytes)));
        let error = HighBits::parse("nibbles").unwrap_err().to_string();
        assert!(error.contains(HIGH_BITS_ENV_VAR) && error.contains("nibbles"));
    }

    #[test]
    fn masks_pick_each_values_high_bits() {
        let mut values = [[0u8; 32]; 8];
        values[3][21] = 0b11_0000; // row 3, value 21: register 5 (16 + 4 + 1), byte 13
        values[0][2] = 0b01_0000; // row 0, value 2: register 0, byte 2, plane 0 only
        let m = masks(&values, 2);
        assert_eq!(m[0][5], 1 << 13);
        assert_eq!(m[1][5], 1 << 13);
        assert_eq!(m[0][0], 1 << 2);
        assert_eq!(m[1][0], 0);
        assert_eq!(masks(&values, 1)[1], [0; 8]);
    }
}
