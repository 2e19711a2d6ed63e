//! The vector lanes of the split-KV kernels: 8 (AVX2+FMA) or 16 (AVX-512F) f32 lanes on
//! x86-64 (`super::x86`), 4 (NEON) on aarch64 (`super::neon`), with the operations the kernel
//! body needs, a vector `exp2`, a register transpose and a prefetch hint.

/// A vector of f32 lanes. Every method is `unsafe` because it executes instructions of the
/// implementor's instruction set: call them only on a CPU that has it. The impls carry
/// `#[target_feature]` (not `#[inline(always)]` wrappers around intrinsics), so once inlined
/// into the kernel entry points the vectors stay in registers.
pub(crate) trait Lanes: Copy {
    const LANES: usize;
    /// Vector registers of the instruction set (sizes the register blocks).
    const REGISTERS: usize;
    unsafe fn splat(value: f32) -> Self;
    /// Reads `LANES` floats at `pointer`.
    unsafe fn load(pointer: *const f32) -> Self;
    /// Writes `LANES` floats at `pointer`.
    unsafe fn store(self, pointer: *mut f32);
    unsafe fn add(self, other: Self) -> Self;
    unsafe fn sub(self, other: Self) -> Self;
    unsafe fn mul(self, other: Self) -> Self;
    /// `self * factor + addend`, fused.
    unsafe fn mul_add(self, factor: Self, addend: Self) -> Self;
    /// Lane-wise max; a NaN lane of `self` yields `other`'s lane (as `f32::max` ignores NaN).
    unsafe fn max(self, other: Self) -> Self;
    unsafe fn reduce_add(self) -> f32;
    unsafe fn reduce_max(self) -> f32;
    /// `2^x` per lane for `x <= 0` (the softmax case): Cephes' degree-6 polynomial on the
    /// fraction after rounding to the nearest integer (relative error ~2e-7); lanes below
    /// -126 (including `-inf`) give exactly 0.
    unsafe fn exp2(self) -> Self;
    /// Transposes a `LANES x LANES` block: reads `LANES` floats at `rows[i] + column` for
    /// each of the `LANES` row pointers and writes float `j` of row `i` to
    /// `out[j * stride + i]`.
    unsafe fn transpose(rows: &[*const f32], column: usize, out: *mut f32, stride: usize);
    /// Asks for the cache line holding `pointer` (any address: a prefetch never faults).
    unsafe fn prefetch(pointer: *const f32);
}

/// Cephes `exp2f` coefficients, highest degree first: `2^f = 1 + f * P(f)`, `|f| <= 0.5`.
pub(crate) const EXP2_POLY: [f32; 6] = [
    1.535_336_2e-4,
    1.339_887_4e-3,
    9.618_437e-3,
    5.550_332_5e-2,
    2.402_264_8e-1,
    6.931_472e-1,
];
