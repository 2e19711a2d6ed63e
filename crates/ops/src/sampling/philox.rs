//! Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11;
//! the Random123 library) and the open-interval uniforms the fused sampler draws from it.
//!
//! Philox is counter based: every output block is a pure function of a 128-bit counter and a
//! 64-bit key, so a draw can be recomputed anywhere (any thread, any batch order) from the
//! numbers that name it. pagoda's layout ([`draw_counter`]):
//!
//! - key = the request seed, `[seed as u32, (seed >> 32) as u32]` ([`key_from_seed`]);
//! - counter = `[index, step as u32, (step >> 32) as u32, purpose]`, where `step` is the
//!   request's sample-call number, `purpose` a [`DrawPurpose`] tag and `index` the block
//!   number inside that draw (Gumbel noise of element `e` uses block `e / 4`, word `e % 4`;
//!   rejection round `r` uses block `r`).
//!
//! Hence every random number is a pure function of `(seed, step, purpose, element)`.

/// First Philox-4x32 multiplier (Random123 `PHILOX_M4x32_0`).
pub const PHILOX_M4X32_0: u32 = 0xD251_1F53;
/// Second Philox-4x32 multiplier (Random123 `PHILOX_M4x32_1`).
pub const PHILOX_M4X32_1: u32 = 0xCD9E_8D57;
/// Weyl increment of key word 0 between rounds (golden ratio, `PHILOX_W32_0`).
pub const PHILOX_W32_0: u32 = 0x9E37_79B9;
/// Weyl increment of key word 1 between rounds (`sqrt(3) - 1`, `PHILOX_W32_1`).
pub const PHILOX_W32_1: u32 = 0xBB67_AE85;

/// What a block of random words is used for; the tag is counter word 3, so draws for
/// different purposes never share a counter. The values are part of the stream contract:
/// changing one changes every sampled stream at equal seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum DrawPurpose {
    /// Gumbel noise of the unfiltered draw (one word per vocabulary element).
    Gumbel = 1,
    /// The uniform of each dual-pivot rejection round (one 52-bit uniform per round).
    RejectionRound = 2,
    /// The uniform of the counted fallback to the reference chain.
    Fallback = 3,
    /// Reserved: speculative-decoding acceptance uniforms.
    SpeculativeAccept = 4,
    /// Reserved: speculative residual draw.
    SpeculativeResidual = 5,
    /// Reserved: drafter sampling.
    Drafter = 6,
}

/// Philox-4x32 with `rounds` rounds (Random123's `philox4x32_R`): each round multiplies
/// counter words 0 and 2 by the two multipliers (64-bit products split into hi/lo) and mixes
/// in the key; the key is bumped by the Weyl increments before every round but the first.
pub fn philox4x32_rounds(counter: [u32; 4], key: [u32; 2], rounds: u32) -> [u32; 4] {
    let mut counter = counter;
    let mut key = key;
    for round in 0..rounds {
        if round > 0 {
            key[0] = key[0].wrapping_add(PHILOX_W32_0);
            key[1] = key[1].wrapping_add(PHILOX_W32_1);
        }
        let product0 = PHILOX_M4X32_0 as u64 * counter[0] as u64;
        let product1 = PHILOX_M4X32_1 as u64 * counter[2] as u64;
        let (hi0, lo0) = ((product0 >> 32) as u32, product0 as u32);
        let (hi1, lo1) = ((product1 >> 32) as u32, product1 as u32);
        counter = [
            hi1 ^ counter[1] ^ key[0],
            lo1,
            hi0 ^ counter[3] ^ key[1],
            lo0,
        ];
    }
    counter
}

/// Philox-4x32-10, the standard 10-round variant: four random `u32` words per counter.
#[inline]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    philox4x32_rounds(counter, key, 10)
}

/// The Philox key of a request: its 64-bit seed split into `[low word, high word]`.
pub fn key_from_seed(seed: u64) -> [u32; 2] {
    [seed as u32, (seed >> 32) as u32]
}

/// The counter of block `index` of the draw `(step, purpose)`:
/// `[index, step as u32, (step >> 32) as u32, purpose as u32]`.
#[inline]
pub fn draw_counter(step: u64, purpose: DrawPurpose, index: u32) -> [u32; 4] {
    [index, step as u32, (step >> 32) as u32, purpose as u32]
}

/// The four words of block `index` of the draw `(seed key, step, purpose)`.
#[inline]
pub fn draw_block(key: [u32; 2], step: u64, purpose: DrawPurpose, index: u32) -> [u32; 4] {
    philox4x32_10(draw_counter(step, purpose, index), key)
}

/// A uniform in the open interval `(0, 1)` from one word: `(word + 0.5) * 2^-32` in f64.
/// Every value `k + 0.5` (`k < 2^32`) needs at most 33 significant bits, so it is exact in
/// f64: the range is exactly `[2^-33, 1 - 2^-33]` and neither `ln(u)` nor `ln(-ln(u))` can be
/// infinite. Used for the Gumbel noise.
#[inline]
pub fn open_uniform_f64_from_u32(word: u32) -> f64 {
    const SCALE: f64 = 1.0 / (1u64 << 32) as f64;
    (word as f64 + 0.5) * SCALE
}

/// A uniform in the open interval `(0, 1)` from two words: the top 52 bits of
/// `(high << 32) | low`, as `(bits + 0.5) * 2^-52` in f64. `bits + 0.5 < 2^52` needs 53
/// significant bits, exactly f64's precision, so the range is exactly `[2^-53, 1 - 2^-53]`.
/// (With 53 bits, `2^53 - 1 + 0.5` would round up to `2^53` and give exactly 1.0.) Used for
/// the rejection-round and fallback draws.
#[inline]
pub fn open_uniform_f64_from_u64(high: u32, low: u32) -> f64 {
    const SCALE: f64 = 1.0 / (1u64 << 52) as f64;
    let bits = (((high as u64) << 32) | low as u64) >> 12;
    (bits as f64 + 0.5) * SCALE
}

/// A uniform in the open interval `(0, 1)` in f32 (for a future GPU kernel): the top 23 bits,
/// `((word >> 9) + 0.5) * 2^-23`, exactly `[2^-24, 1 - 2^-24]`. The tempting 24-bit form
/// `((word >> 8) + 0.5) * 2^-24` is wrong: `2^24 - 1 + 0.5` is not an f32 and rounds to
/// `2^24`, giving exactly 1.0 (infinite Gumbel noise) once in 2^24 words.
#[inline]
pub fn open_uniform_f32(word: u32) -> f32 {
    const SCALE: f32 = 1.0 / (1u32 << 23) as f32;
    ((word >> 9) as f32 + 0.5) * SCALE
}
