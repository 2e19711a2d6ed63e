//! The only unsafe code of the AMX path: CPUID, the Linux tile-data permission, and the
//! tile instruction wrappers (stable inline `asm!`; the AMX intrinsics are unstable).
//!
//! [`HardwareTiles`] implements [`TileUnit`] with the real instructions. It can only be built
//! where [`super::detect::is_available`] holds, and it checks every slice against the configured tile shape
//! before an instruction touches memory, so its methods are safe to call.

use super::kernel::Activations;
use super::tiles::{CTile, TileConfig, TileUnit};
#[cfg(target_arch = "x86_64")]
use super::{
    kernel,
    tiles::{span, SLOTS, TILE_A, TILE_B, TILE_C},
};
use crate::linear::cpu::interleaved::Interleaved;

/// The hardware tile unit; exists only where [`super::detect::is_available`] is true.
// Off x86-64 the unit is never built (`new` gives `None`): its state goes unread.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub struct HardwareTiles {
    config: Option<TileConfig>,
}

impl HardwareTiles {
    /// A unit, or `None` when this CPU/OS lacks AMX-INT8.
    pub fn new() -> Option<HardwareTiles> {
        super::detect::is_available().then_some(HardwareTiles { config: None })
    }

    /// The configuration [`TileUnit::configure`] validated (every slot's dot shapes).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn configured(&self) -> &TileConfig {
        self.config
            .as_ref()
            .expect("tile instruction before LDTILECFG")
    }

    /// Bytes a load of tile `tile` reads at `stride` (its shape was validated at configure).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn load_span(&self, tile: usize, stride: usize) -> usize {
        let config = self.configured();
        span(
            config.rows[tile] as usize,
            config.colsb[tile] as usize,
            stride,
        )
    }
}

/// One tile instruction per slot register: `$slot` 0 uses the first register, 1 the second.
#[cfg(target_arch = "x86_64")]
macro_rules! per_slot {
    ($slot:expr, $first:literal, $second:literal, $($rest:tt)*) => {
        match $slot {
            0 => std::arch::asm!($first, $($rest)*),
            1 => std::arch::asm!($second, $($rest)*),
            other => panic!("tile slot {other} out of range"),
        }
    };
}

#[cfg(target_arch = "x86_64")]
impl TileUnit for HardwareTiles {
    // `detect` requires AVX-512F/VL beside AMX.
    const AVX512: bool = true;

    fn configure(&mut self, config: &TileConfig) {
        for slot in 0..SLOTS {
            config.check_dot(TILE_C[slot], TILE_A[slot], TILE_B[slot]);
        }
        let image = config.to_bytes();
        // SAFETY: AMX-TILE is present and permitted (`new`); `image` is a valid palette-1
        // configuration of 64 readable bytes (shapes checked above, reserved bytes zero).
        unsafe {
            std::arch::asm!("ldtilecfg [{0}]", in(reg) image.as_ptr(), options(nostack, readonly));
        }
        self.config = Some(*config);
    }

    #[inline(always)]
    fn zero_c(&mut self, slot: usize) {
        self.configured();
        // SAFETY: AMX is permitted and the slot's C is configured (`configure` validated every
        // slot's shapes).
        unsafe {
            per_slot!(
                slot,
                "tilezero tmm0",
                "tilezero tmm3",
                options(nostack, nomem)
            )
        };
    }

    #[inline(always)]
    fn load_a(&mut self, slot: usize, src: &[u8], stride: usize) {
        assert!(
            src.len() >= self.load_span(TILE_A[slot], stride),
            "A tile source too short"
        );
        // SAFETY: the slot's A is configured as rows x colsb, and `src` holds the
        // (rows - 1) * stride + colsb bytes the load reads (checked above).
        unsafe {
            per_slot!(
                slot,
                "tileloadd tmm1, [{base} + {stride} * 1]",
                "tileloadd tmm5, [{base} + {stride} * 1]",
                base = in(reg) src.as_ptr(),
                stride = in(reg) stride,
                options(nostack, readonly)
            );
        }
    }

    #[inline(always)]
    fn load_b(&mut self, slot: usize, src: &[u8], stride: usize) {
        assert!(
            src.len() >= self.load_span(TILE_B[slot], stride),
            "B tile source too short"
        );
        // SAFETY: as `load_a`, for the slot's B.
        unsafe {
            per_slot!(
                slot,
                "tileloadd tmm2, [{base} + {stride} * 1]",
                "tileloadd tmm4, [{base} + {stride} * 1]",
                base = in(reg) src.as_ptr(),
                stride = in(reg) stride,
                options(nostack, readonly)
            );
        }
    }

    #[inline(always)]
    fn dot_bsud(&mut self, slot: usize) {
        self.configured();
        // SAFETY: AMX-INT8 is present and permitted; the slot's three tiles are configured
        // with compatible shapes (`configure` checked every slot's dot), so the instruction
        // cannot fault.
        unsafe {
            per_slot!(
                slot,
                "tdpbsud tmm0, tmm1, tmm2",
                "tdpbsud tmm3, tmm5, tmm4",
                options(nostack, nomem)
            )
        };
    }

    #[inline(always)]
    fn store_c(&mut self, slot: usize, dst: &mut CTile) {
        // A configured C has at most 16 rows of 64 bytes: within `dst` at stride 64.
        self.configured();
        let stride = std::mem::size_of_val(&dst.0[0]);
        // SAFETY: the slot's C is configured (checked above) and `dst` holds 16 rows of 64
        // bytes, all a store of at most 16 x 64 at stride 64 writes.
        unsafe {
            per_slot!(
                slot,
                "tilestored [{base} + {stride} * 1], tmm0",
                "tilestored [{base} + {stride} * 1], tmm3",
                base = in(reg) dst.0.as_mut_ptr(),
                stride = in(reg) stride,
                options(nostack)
            );
        }
    }

    fn release(&mut self) {
        if self.config.take().is_some() {
            // SAFETY: AMX is permitted; TILERELEASE only returns the tile state to INIT.
            unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for HardwareTiles {
    fn drop(&mut self) {
        // A panic between configure and release must not leave the tiles configured.
        self.release();
    }
}

/// [`super::kernel::row_chunk`] on the hardware tiles, its f32 combine compiled with AVX-512 (present
/// wherever AMX is). Panics if AMX is unavailable (the caller checks).
pub fn row_chunk(weights: &Interleaved, activations: &Activations, chunk: usize, out: &mut [f32]) {
    let mut unit = HardwareTiles::new().expect("AMX-INT8 availability checked by the caller");
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
        fn vectorized(
            unit: &mut HardwareTiles,
            weights: &Interleaved,
            activations: &Activations,
            tiles: &mut kernel::WeightTiles,
            chunk: usize,
            out: &mut [f32],
        ) {
            kernel::row_chunk(unit, weights, activations, tiles, chunk, out)
        }
        // The thread's B-tile buffers are borrowed out here: a closure inside `vectorized`
        // would be compiled without its features and not inlined.
        kernel::with_weight_tiles(|tiles| {
            // SAFETY: `unit` exists only where `detect` confirmed AVX2, FMA, F16C and
            // AVX-512F/VL/BW.
            unsafe { vectorized(&mut unit, weights, activations, tiles, chunk, out) }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (&mut unit, weights, activations, chunk, out);
        unreachable!("HardwareTiles::new returns None off x86-64");
    }
}

#[cfg(not(target_arch = "x86_64"))]
impl TileUnit for HardwareTiles {
    const AVX512: bool = false;
    fn configure(&mut self, _: &TileConfig) {
        unreachable!("no AMX off x86-64")
    }
    fn zero_c(&mut self, _: usize) {}
    fn load_a(&mut self, _: usize, _: &[u8], _: usize) {}
    fn load_b(&mut self, _: usize, _: &[u8], _: usize) {}
    fn dot_bsud(&mut self, _: usize) {}
    fn store_c(&mut self, _: usize, _: &mut CTile) {}
    fn release(&mut self) {}
}
