//! The element type of a KV pool (llama.cpp's `--cache-type-k/-v`): f32 (the default), f16,
//! or q8_0 (llama.cpp's block: 32 values, one f16 scale `d = max|x| / 127`, int8 quants
//! `round(x / d)`; 34 bytes per 32 values). Blocks run along `head_dim`, so a q8_0 pool needs
//! a `head_dim` that 32 divides and every head row starts a block.
//!
//! [`KvPool`] owns one layer's K (or V) pool; [`KvSlice`] is the read view attention takes.
//! Readers dequantize one head row at a time into a caller's f32 scratch ([`KvSlice::row`]);
//! an f32 pool lends its own slice, so the default path reads exactly what it read before.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::attention::AttentionError;

/// Values per q8_0 block.
pub const Q8_0_BLOCK: usize = 32;

/// One q8_0 block (llama.cpp's `block_q8_0`): `x[i] ≈ d * qs[i]`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// The scale, `max|x| / 127`.
    pub d: f16,
    /// The quants, `round(x / d)`.
    pub qs: [i8; Q8_0_BLOCK],
}

impl BlockQ8_0 {
    /// Quantizes 32 values as llama.cpp's `quantize_row_q8_0_ref` does.
    pub fn quantize(values: &[f32]) -> BlockQ8_0 {
        debug_assert_eq!(values.len(), Q8_0_BLOCK);
        let amax = values
            .iter()
            .fold(0.0f32, |max, value| max.max(value.abs()));
        let d = amax / 127.0;
        let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i8; Q8_0_BLOCK];
        for (quant, value) in qs.iter_mut().zip(values) {
            *quant = (value * inverse).round() as i8;
        }
        BlockQ8_0 {
            d: f16::from_f32(d),
            qs,
        }
    }

    /// Writes the block's 32 values into `out`.
    pub fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (value, &quant) in out.iter_mut().zip(&self.qs) {
            *value = d * quant as f32;
        }
    }
}

/// The element type of a KV pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvType {
    /// 4 bytes per value (the default).
    #[default]
    F32,
    /// 2 bytes per value.
    F16,
    /// 34 bytes per 32 values.
    Q8_0,
    /// e4m3, one byte per value plus one f32 scale per (token, KV head) ([`super::fp8`]):
    /// the CUDA cache only (`-ctk fp8 -ctv fp8`, `--kv-cache-dtype fp8`).
    Fp8,
}

impl KvType {
    /// Every type with its word (llama.cpp's spelling).
    pub const WORDS: [(&'static str, KvType); 4] = [
        ("f32", KvType::F32),
        ("f16", KvType::F16),
        ("q8_0", KvType::Q8_0),
        ("fp8", KvType::Fp8),
    ];

    /// The word of the type: `f32`, `f16`, `q8_0` or `fp8`.
    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
            KvType::Fp8 => "fp8",
        }
    }

    /// Parses llama.cpp's spelling (ASCII case and surrounding spaces ignored); an error
    /// names the accepted words.
    pub fn parse(text: &str) -> Result<KvType, String> {
        let folded = text.trim().to_ascii_lowercase();
        Self::WORDS
            .iter()
            .find(|(word, _)| *word == folded)
            .map(|(_, kv_type)| *kv_type)
            .ok_or_else(|| {
                format!("unknown KV cache type {text:?}: expected one of f32, f16, q8_0, fp8")
            })
    }

    /// Bytes that `elements` values take (`elements` a multiple of 32 for q8_0; fp8 counts
    /// its values only: its scales depend on the head size, [`KvType::head_bytes`]).
    pub fn bytes(self, elements: usize) -> usize {
        match self {
            KvType::Fp8 => elements,
            KvType::F32 => elements * 4,
            KvType::F16 => elements * 2,
            KvType::Q8_0 => elements.div_ceil(Q8_0_BLOCK) * std::mem::size_of::<BlockQ8_0>(),
        }
    }

    /// Bytes of `heads` cached heads of `head_dim` values (fp8: the bytes and one f32 scale
    /// per head).
    pub fn head_bytes(self, heads: usize, head_dim: usize) -> usize {
        match self {
            KvType::Fp8 => heads * (head_dim + 4),
            other => other.bytes(heads * head_dim),
        }
    }

    /// Checks that a host (CPU) pool of this type can hold heads of `head_dim` values; fp8
    /// lives on the GPU only.
    pub fn check_head_dim(self, head_dim: usize) -> Result<(), AttentionError> {
        if self == KvType::Fp8 {
            return Err(AttentionError::Geometry(
                "an fp8 KV cache runs on CUDA only (use --device cuda, or f16 / q8_0 on the CPU)"
                    .into(),
            ));
        }
        if self == KvType::Q8_0 && !head_dim.is_multiple_of(Q8_0_BLOCK) {
            return Err(AttentionError::Geometry(format!(
                "a q8_0 KV cache needs a head_dim that {Q8_0_BLOCK} divides; this model's is \
                 {head_dim} (use f16 or f32)"
            )));
        }
        Ok(())
    }
}

impl std::fmt::Display for KvType {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.name())
    }
}

/// The element types of a KV cache's K and V pools (`-ctk`/`-ctv`); f32 and f32 by default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KvCacheTypes {
    /// The K pools' type.
    pub k: KvType,
    /// The V pools' type.
    pub v: KvType,
}

impl KvCacheTypes {
    /// Whether both are f32 (the default).
    pub fn is_f32(&self) -> bool {
        self.k == KvType::F32 && self.v == KvType::F32
    }

    /// Whether K or V is fp8 (the CUDA e4m3 cache).
    pub fn is_fp8(&self) -> bool {
        self.k == KvType::Fp8 || self.v == KvType::Fp8
    }

    /// Bytes of one token row of K and one of V, `elements` values each.
    pub fn row_bytes(&self, elements: usize) -> usize {
        self.k.bytes(elements) + self.v.bytes(elements)
    }

    /// Checks both types against the model's `head_dim`.
    pub fn check_head_dim(&self, head_dim: usize) -> Result<(), AttentionError> {
        self.k.check_head_dim(head_dim)?;
        self.v.check_head_dim(head_dim)
    }
}

impl std::fmt::Display for KvCacheTypes {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "K {}, V {}", self.k, self.v)
    }
}

/// One layer's K (or V) pool, owned.
#[derive(Clone, Debug, PartialEq)]
pub enum KvPool {
    /// f32 values.
    F32(Vec<f32>),
    /// f16 values.
    F16(Vec<f16>),
    /// q8_0 blocks, `elements / 32` of them.
    Q8_0(Vec<BlockQ8_0>),
}

impl KvPool {
    /// A zero-filled pool of `elements` values (a multiple of 32 for q8_0).
    pub fn zeros(kv_type: KvType, elements: usize) -> KvPool {
        match kv_type {
            KvType::F32 => KvPool::F32(vec![0.0; elements]),
            KvType::F16 => KvPool::F16(vec![f16::ZERO; elements]),
            KvType::Q8_0 => KvPool::Q8_0(vec![BlockQ8_0::default(); elements.div_ceil(Q8_0_BLOCK)]),
            // `check_head_dim` refuses fp8 before any host cache is built.
            KvType::Fp8 => unreachable!("an fp8 KV cache has no host pool (CUDA only)"),
        }
    }

    /// The pool's element type.
    pub fn kv_type(&self) -> KvType {
        self.as_slice().kv_type()
    }

    /// Values held.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether the pool holds no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.kv_type().bytes(self.len())
    }

    /// The read view.
    pub fn as_slice(&self) -> KvSlice<'_> {
        match self {
            KvPool::F32(values) => KvSlice::F32(values),
            KvPool::F16(values) => KvSlice::F16(values),
            KvPool::Q8_0(blocks) => KvSlice::Q8_0(blocks),
        }
    }

    /// Stores `values` at element `offset` (rounding or quantizing them); for q8_0 `offset`
    /// and `values.len()` are multiples of 32. Panics out of range (callers validate).
    pub fn write(&mut self, offset: usize, values: &[f32]) {
        match self {
            KvPool::F32(pool) => pool[offset..offset + values.len()].copy_from_slice(values),
            KvPool::F16(pool) => pool[offset..offset + values.len()].convert_from_f32_slice(values),
            KvPool::Q8_0(pool) => {
                debug_assert!(offset.is_multiple_of(Q8_0_BLOCK));
                let first = offset / Q8_0_BLOCK;
                for (block, chunk) in pool[first..].iter_mut().zip(values.chunks(Q8_0_BLOCK)) {
                    *block = BlockQ8_0::quantize(chunk);
                }
            }
        }
    }
}

/// One layer's K (or V) pool as attention reads it.
#[derive(Clone, Copy, Debug)]
pub enum KvSlice<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// f16 values.
    F16(&'a [f16]),
    /// q8_0 blocks.
    Q8_0(&'a [BlockQ8_0]),
}

impl<'a> From<&'a [f32]> for KvSlice<'a> {
    fn from(values: &'a [f32]) -> Self {
        KvSlice::F32(values)
    }
}

impl<'a> From<&'a Vec<f32>> for KvSlice<'a> {
    fn from(values: &'a Vec<f32>) -> Self {
        KvSlice::F32(values)
    }
}

impl<'a> KvSlice<'a> {
    /// The element type.
    pub fn kv_type(&self) -> KvType {
        match self {
            KvSlice::F32(_) => KvType::F32,
            KvSlice::F16(_) => KvType::F16,
            KvSlice::Q8_0(_) => KvType::Q8_0,
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            KvSlice::F32(values) => values.len(),
            KvSlice::F16(values) => values.len(),
            KvSlice::Q8_0(blocks) => blocks.len() * Q8_0_BLOCK,
        }
    }

    /// Whether the pool holds no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The f32 values, when the pool is f32 (the SIMD kernels' fast path).
    pub fn as_f32(&self) -> Option<&'a [f32]> {
        match self {
            KvSlice::F32(values) => Some(values),
            _ => None,
        }
    }

    /// Writes the values `offset..offset + out.len()` into `out` as f32 (for q8_0 both
    /// multiples of 32). Panics out of range (callers validate).
    pub fn read(&self, offset: usize, out: &mut [f32]) {
        match self {
            KvSlice::F32(values) => out.copy_from_slice(&values[offset..offset + out.len()]),
            KvSlice::F16(values) => values[offset..offset + out.len()].convert_to_f32_slice(out),
            KvSlice::Q8_0(blocks) => {
                let first = offset / Q8_0_BLOCK;
                let blocks = &blocks[first..first + out.len().div_ceil(Q8_0_BLOCK)];
                #[cfg(target_arch = "x86_64")]
                if out.len().is_multiple_of(Q8_0_BLOCK) && avx2() {
                    // SAFETY: the CPU runs AVX2 (detected); `out` holds 32 values per block.
                    return unsafe { dequantize_q8_0_avx2(blocks, out) };
                }
                for (block, chunk) in blocks.iter().zip(out.chunks_mut(Q8_0_BLOCK)) {
                    block.dequantize(chunk);
                }
            }
        }
    }

    /// The `len` values from `offset` as f32: the pool's own slice for f32, otherwise
    /// `scratch` (at least `len` long) filled by [`KvSlice::read`].
    #[inline]
    pub fn row<'s>(&'s self, offset: usize, len: usize, scratch: &'s mut [f32]) -> &'s [f32] {
        match self {
            KvSlice::F32(values) => &values[offset..offset + len],
            _ => {
                let out = &mut scratch[..len];
                self.read(offset, out);
                out
            }
        }
    }

    /// Appends the `len` values from `offset` to `out` as f32.
    pub fn extend_into(&self, offset: usize, len: usize, out: &mut Vec<f32>) {
        match self {
            KvSlice::F32(values) => out.extend_from_slice(&values[offset..offset + len]),
            _ => {
                let start = out.len();
                out.resize(start + len, 0.0);
                self.read(offset, &mut out[start..]);
            }
        }
    }
}

/// Whether the CPU runs AVX2 (detected once).
#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX2.get_or_init(|| is_x86_feature_detected!("avx2"))
}

/// [`BlockQ8_0::dequantize`] of every block into `out` (32 values each), eight lanes at a
/// time: the same products `d * q` (exact in f32), so the same values.
///
/// # Safety
/// The CPU must run AVX2; `out.len() == 32 * blocks.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dequantize_q8_0_avx2(blocks: &[BlockQ8_0], out: &mut [f32]) {
    use std::arch::x86_64::*;
    assert_eq!(out.len(), blocks.len() * Q8_0_BLOCK);
    for (block, chunk) in blocks.iter().zip(out.chunks_exact_mut(Q8_0_BLOCK)) {
        let d = _mm256_set1_ps(block.d.to_f32());
        for lane in 0..Q8_0_BLOCK / 8 {
            // SAFETY: 8 bytes of the block's 32 quants and 8 floats of the chunk's 32.
            unsafe {
                let bytes = _mm_loadl_epi64(block.qs.as_ptr().add(lane * 8) as *const __m128i);
                let values = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
                _mm256_storeu_ps(chunk.as_mut_ptr().add(lane * 8), _mm256_mul_ps(values, d));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(len: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..len).map(|_| rng.random_range(-3.0f32..3.0)).collect()
    }

    #[test]
    fn q8_0_block_is_llama_cpp_sized() {
        assert_eq!(std::mem::size_of::<BlockQ8_0>(), 34);
        assert_eq!(KvType::Q8_0.bytes(128), 4 * 34);
        assert_eq!(KvType::F16.bytes(128), 256);
        assert_eq!(KvType::F32.bytes(128), 512);
    }

    #[test]
    fn q8_0_round_trip_is_within_half_a_step() {
        let values = random(64 * 32, 1);
        let mut pool = KvPool::zeros(KvType::Q8_0, values.len());
        pool.write(0, &values);
        let mut back = vec![0.0; values.len()];
        pool.as_slice().read(0, &mut back);
        for (block, (original, restored)) in values.chunks(32).zip(back.chunks(32)).enumerate() {
            let amax = original.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            // Half a quantization step, plus the f16 rounding of d (2^-11 relative) times 127.
            let bound = 0.5 * d + amax * 2f32.powi(-11) * 1.01;
            for (a, b) in original.iter().zip(restored) {
                assert!(
                    (a - b).abs() <= bound,
                    "block {block}: {a} vs {b} (bound {bound})"
                );
            }
            // The largest magnitude comes back almost exactly (quant ±127).
            let worst = original.iter().zip(restored).map(|(a, b)| (a - b).abs());
            assert!(worst.fold(0.0f32, f32::max) > 0.0 || amax == 0.0);
        }
    }

    #[test]
    fn q8_0_matches_llama_cpp_reference_values() {
        let mut values = [0.0f32; 32];
        values[0] = 127.0;
        values[1] = -63.4;
        values[2] = 0.6;
        let block = BlockQ8_0::quantize(&values);
        assert_eq!(block.d.to_f32(), 1.0);
        assert_eq!(&block.qs[..4], &[127, -63, 1, 0]);
        let zero = BlockQ8_0::quantize(&[0.0; 32]);
        assert_eq!(zero, BlockQ8_0::default());
    }

    #[test]
    fn q8_0_fast_read_equals_block_dequantize() {
        let values = random(8 * 32, 4);
        let mut pool = KvPool::zeros(KvType::Q8_0, values.len());
        pool.write(0, &values);
        let KvPool::Q8_0(blocks) = &pool else {
            unreachable!()
        };
        let mut expected = vec![0.0; values.len()];
        for (block, chunk) in blocks.iter().zip(expected.chunks_mut(32)) {
            block.dequantize(chunk);
        }
        let mut fast = vec![0.0; 64];
        pool.as_slice().read(96, &mut fast);
        assert!(fast
            .iter()
            .zip(&expected[96..160])
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn f16_round_trip_is_within_f16_precision() {
        let values = random(1000, 2);
        let mut pool = KvPool::zeros(KvType::F16, values.len());
        pool.write(0, &values);
        let mut back = vec![0.0; values.len()];
        pool.as_slice().read(0, &mut back);
        for (a, b) in values.iter().zip(&back) {
            assert!(
                (a - b).abs() <= a.abs() * 2f32.powi(-11) + 1e-7,
                "{a} vs {b}"
            );
        }
        assert_ne!(values, back, "f16 rounds");
    }

    #[test]
    fn f32_rows_are_the_pool_itself() {
        let values = random(64, 3);
        let pool = KvPool::F32(values.clone());
        let mut scratch = [0.0f32; 0];
        let view = pool.as_slice();
        let row = view.row(32, 32, &mut scratch);
        assert_eq!(row, &values[32..]);
        let KvPool::F32(inner) = &pool else {
            unreachable!()
        };
        assert_eq!(
            row.as_ptr(),
            inner[32..].as_ptr(),
            "no copy on the f32 path"
        );
    }

    #[test]
    fn parse_takes_llama_cpp_spellings_only() {
        assert_eq!(KvType::parse("Q8_0"), Ok(KvType::Q8_0));
        assert_eq!(KvType::parse(" f16"), Ok(KvType::F16));
        assert_eq!(KvType::parse("f32"), Ok(KvType::F32));
        let error = KvType::parse("q4_0").unwrap_err();
        assert!(
            error.contains("q4_0") && error.contains("f32, f16, q8_0, fp8"),
            "{error}"
        );
        assert!(KvType::Q8_0.check_head_dim(64).is_ok());
        assert!(KvType::Q8_0.check_head_dim(48).is_err());
        assert!(KvType::F16.check_head_dim(48).is_ok());
        // fp8 is the CUDA cache: no host pool of any head size.
        let error = KvType::Fp8.check_head_dim(128).unwrap_err().to_string();
        assert!(
            error.contains("CUDA only") && error.contains("--device cuda"),
            "{error}"
        );
    }

    #[test]
    fn fp8_parses_and_counts_its_scales() {
        assert_eq!(KvType::parse("FP8"), Ok(KvType::Fp8));
        assert_eq!(KvType::Fp8.name(), "fp8");
        // One byte a value and one f32 scale a head: 132 bytes for a head of 128, against
        // bf16's 256 (what the GPU pool sizing counts).
        assert_eq!(KvType::Fp8.head_bytes(1, 128), 132);
        assert_eq!(KvType::Fp8.head_bytes(16 * 8, 128), 16 * 8 * 132);
        assert_eq!(KvType::F16.head_bytes(3, 64), 3 * 128);
        let types = KvCacheTypes {
            k: KvType::Fp8,
            v: KvType::Fp8,
        };
        assert!(types.is_fp8() && !KvCacheTypes::default().is_fp8());
    }
}
