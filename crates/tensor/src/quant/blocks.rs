//! One-block decoders, bit-exact with ggml's `dequantize_row_*` (ggml-quants.c).
//!
//! Each decoder takes exactly one block's bytes and writes exactly one block's values, so
//! the compiler sees fixed lengths and drops the bounds checks. Floating-point operations
//! happen in the same order as in ggml (e.g. Q6_K computes `(d * scale) * q`), which is what
//! makes the results bit-identical rather than merely close.

/// Values per block of the 32-value formats (`QK4_0`, `QK4_1`, `QK8_0`).
pub const QK: usize = 32;
/// Values per super-block of the K-quants (`QK_K`).
pub const QK_K: usize = 256;

/// Bytes per Q5_0 block.
pub const Q5_0_BYTES: usize = 22;
/// Bytes per Q5_1 block.
pub const Q5_1_BYTES: usize = 24;
/// Bytes per Q8_0 block.
pub const Q8_0_BYTES: usize = 34;
/// Bytes per Q4_0 block.
pub const Q4_0_BYTES: usize = 18;
/// Bytes per Q4_1 block.
pub const Q4_1_BYTES: usize = 20;
/// Bytes per Q2_K super-block.
pub const Q2_K_BYTES: usize = 84;
/// Bytes per Q3_K super-block.
pub const Q3_K_BYTES: usize = 110;
/// Bytes per Q4_K super-block.
pub const Q4_K_BYTES: usize = 144;
/// Bytes per Q5_K super-block.
pub const Q5_K_BYTES: usize = 176;
/// Bytes per Q6_K super-block.
pub const Q6_K_BYTES: usize = 210;

/// The little-endian IEEE half at `bytes[offset..offset + 2]`, widened exactly to `f32`.
#[inline(always)]
pub fn f16_at(bytes: &[u8], offset: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([bytes[offset], bytes[offset + 1]]))
}

/// Exact IEEE half -> single conversion, branch-free so loops over it vectorize (the
/// `half` crate's runtime CPU-feature dispatch does not inline into hot loops).
///
/// Shifting the half's exponent and mantissa into f32 position and multiplying by 2^112
/// rebiases the exponent (127 - 15 = 112) for normals and normalizes subnormals in one
/// exact multiply; infinities and NaNs (exponent all ones) get the f32 all-ones exponent.
#[inline(always)]
pub fn f16_bits_to_f32(bits: u16) -> f32 {
    let bits = bits as u32;
    let sign = (bits & 0x8000) << 16;
    let exponent_mantissa = (bits & 0x7FFF) << 13;
    let two_pow_112 = f32::from_bits((127 + 112) << 23);
    let finite = (f32::from_bits(exponent_mantissa) * two_pow_112).to_bits();
    let magnitude = if exponent_mantissa >= 0x7C00 << 13 {
        exponent_mantissa | 0x7F80_0000
    } else {
        finite
    };
    f32::from_bits(sign | magnitude)
}

/// `block_q8_0 { f16 d; int8 qs[32]; }`: `y = qs * d`.
#[inline(always)]
pub fn q8_0(block: &[u8; Q8_0_BYTES], out: &mut [f32; QK]) {
    let d = f16_at(block, 0);
    for (value, &q) in out.iter_mut().zip(&block[2..]) {
        *value = (q as i8) as f32 * d;
    }
}

/// `block_q4_0 { f16 d; u8 qs[16]; }`: low nibbles are values 0..16, high nibbles 16..32,
/// `y = (nibble - 8) * d`.
#[inline(always)]
pub fn q4_0(block: &[u8; Q4_0_BYTES], out: &mut [f32; QK]) {
    let d = f16_at(block, 0);
    let (low, high) = out.split_at_mut(QK / 2);
    for j in 0..QK / 2 {
        let q = block[2 + j];
        low[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
        high[j] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// `block_q4_1 { f16 d; f16 m; u8 qs[16]; }`: `y = nibble * d + m` (multiply rounded, then add).
#[inline(always)]
pub fn q4_1(block: &[u8; Q4_1_BYTES], out: &mut [f32; QK]) {
    let d = f16_at(block, 0);
    let m = f16_at(block, 2);
    let (low, high) = out.split_at_mut(QK / 2);
    for j in 0..QK / 2 {
        let q = block[4 + j];
        low[j] = (q & 0x0F) as f32 * d + m;
        high[j] = (q >> 4) as f32 * d + m;
    }
}

/// The 5-bit values of a Q5_0/Q5_1 block from its 4 `qh` bytes (little-endian u32) and 16
/// `qs` bytes: value `j < 16` is `qs[j] & 15` with bit `j` of `qh` as bit 4, value `16 + j`
/// is `qs[j] >> 4` with bit `j + 16`.
#[inline(always)]
pub fn q5_values(qh: &[u8], qs: &[u8]) -> [u8; QK] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    std::array::from_fn(|i| {
        let j = i % (QK / 2);
        if i < QK / 2 {
            (qs[j] & 0x0F) | ((((qh >> j) << 4) & 0x10) as u8)
        } else {
            (qs[j] >> 4) | (((qh >> (j + 12)) & 0x10) as u8)
        }
    })
}

/// `block_q5_0 { f16 d; u8 qh[4]; u8 qs[16]; }`: `y = (q - 16) * d` with the 5-bit `q` of
/// [`q5_values`].
#[inline(always)]
pub fn q5_0(block: &[u8; Q5_0_BYTES], out: &mut [f32; QK]) {
    let d = f16_at(block, 0);
    let q = q5_values(&block[2..6], &block[6..]);
    for (value, &q) in out.iter_mut().zip(&q) {
        *value = (q as i32 - 16) as f32 * d;
    }
}

/// `block_q5_1 { f16 d; f16 m; u8 qh[4]; u8 qs[16]; }`: `y = q * d + m` (multiply rounded,
/// then add).
#[inline(always)]
pub fn q5_1(block: &[u8; Q5_1_BYTES], out: &mut [f32; QK]) {
    let d = f16_at(block, 0);
    let m = f16_at(block, 2);
    let q = q5_values(&block[4..8], &block[8..]);
    for (value, &q) in out.iter_mut().zip(&q) {
        *value = q as f32 * d + m;
    }
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8) from the
/// 12 packed bytes of a Q4_K/Q5_K block. Sub-blocks 0..4 use the low 6 bits of bytes
/// `j` and `j + 4`; sub-blocks 4..8 take 4 bits from byte `j + 4` and their top 2 bits from
/// the spare high bits of bytes `j - 4` and `j`.
#[inline(always)]
pub fn scale_min_k4(j: usize, scales: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        let scale = (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4);
        let min = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
        (scale, min)
    }
}

/// `block_q2_K { u8 scales[16]; u8 qs[64]; f16 d; f16 dmin; }`: 16 sub-blocks of 16; block
/// `b` of 32 (`b = 4 n + j`, `n` the half of 128 values) takes the 2 bits at `2 j` of
/// `qs[32 n ..]` (values 0..16 from bytes `l`, 16..32 from `l + 16`); each sub-block's
/// scale byte holds a 4-bit scale and a 4-bit min: `y = (d * sc) * q - (dmin * m)`.
#[inline(always)]
pub fn q2_k(block: &[u8; Q2_K_BYTES], out: &mut [f32; QK_K]) {
    let d = f16_at(block, 80);
    let dmin = f16_at(block, 82);
    for (b, values) in out.chunks_exact_mut(QK).enumerate() {
        let (n, j) = (b / 4, b % 4);
        let q = &block[16 + 32 * n..16 + 32 * n + 32];
        for (half, values) in values.chunks_exact_mut(16).enumerate() {
            let sc = block[2 * b + half];
            let (dl, ml) = (d * (sc & 0x0F) as f32, dmin * (sc >> 4) as f32);
            for (l, value) in values.iter_mut().enumerate() {
                *value = dl * ((q[16 * half + l] >> (2 * j)) & 3) as f32 - ml;
            }
        }
    }
}

/// The 16 signed 6-bit scales of a Q3_K block (`scale - 32`) from its 12 packed bytes, as
/// ggml unpacks them: the low 4 bits of scales `0..8` in the low nibbles of bytes `0..8`,
/// of `8..16` in their high nibbles, the top 2 bits from bytes `8..12`.
#[inline(always)]
pub fn q3_k_scales(packed: &[u8; 12]) -> [i8; 16] {
    std::array::from_fn(|i| {
        let low = if i < 8 {
            packed[i] & 0x0F
        } else {
            packed[i - 8] >> 4
        };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        ((low | (high << 4)) as i32 - 32) as i8
    })
}

/// The 3-bit values of Q3_K block `b` (of 32; `b = 4 n + j`) as `u = q + 4` (0..8): 2 bits
/// at `2 j` of `qs[32 n ..]`, plus 4 when bit `b` of the value's `hmask` byte is set.
#[inline(always)]
pub fn q3_k_values(block: &[u8; Q3_K_BYTES], b: usize) -> [u8; QK] {
    let (n, j) = (b / 4, b % 4);
    let (hmask, qs) = (&block[..32], &block[32 + 32 * n..64 + 32 * n]);
    std::array::from_fn(|l| ((qs[l] >> (2 * j)) & 3) | (((hmask[l] >> b) & 1) << 2))
}

/// `block_q3_K { u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d; }`: 16 sub-blocks of 16;
/// `y = (d * (scale - 32)) * q` with `q = u - 4` of [`q3_k_values`] in `-4..4`.
#[inline(always)]
pub fn q3_k(block: &[u8; Q3_K_BYTES], out: &mut [f32; QK_K]) {
    let d = f16_at(block, 108);
    let scales = q3_k_scales(block[96..108].try_into().unwrap());
    for (b, values) in out.chunks_exact_mut(QK).enumerate() {
        let u = q3_k_values(block, b);
        for (i, value) in values.iter_mut().enumerate() {
            let dl = d * scales[2 * b + i / 16] as f32;
            *value = dl * (u[i] as i32 - 4) as f32;
        }
    }
}

/// `block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; }`: 8 sub-blocks of 32;
/// each 32-byte chunk of `qs` holds two sub-blocks (low nibbles, then high nibbles);
/// `y = (d * scale) * q - (dmin * min)`.
#[inline(always)]
pub fn q4_k(block: &[u8; Q4_K_BYTES], out: &mut [f32; QK_K]) {
    let d = f16_at(block, 0);
    let dmin = f16_at(block, 2);
    let scales: &[u8; 12] = block[4..16].try_into().unwrap();
    let qs = &block[16..];
    for (chunk, (q, values)) in qs
        .chunks_exact(32)
        .zip(out.chunks_exact_mut(64))
        .enumerate()
    {
        let (scale_low, min_low) = scale_min_k4(2 * chunk, scales);
        let (scale_high, min_high) = scale_min_k4(2 * chunk + 1, scales);
        let (d_low, m_low) = (d * scale_low as f32, dmin * min_low as f32);
        let (d_high, m_high) = (d * scale_high as f32, dmin * min_high as f32);
        let (low, high) = values.split_at_mut(32);
        for l in 0..32 {
            low[l] = d_low * (q[l] & 0x0F) as f32 - m_low;
            high[l] = d_high * (q[l] >> 4) as f32 - m_high;
        }
    }
}

/// `block_q5_K { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]; }`: like Q4_K with
/// a fifth bit per value from `qh` (bit `2 * chunk` for the low sub-block, `2 * chunk + 1`
/// for the high one).
#[inline(always)]
pub fn q5_k(block: &[u8; Q5_K_BYTES], out: &mut [f32; QK_K]) {
    let d = f16_at(block, 0);
    let dmin = f16_at(block, 2);
    let scales: &[u8; 12] = block[4..16].try_into().unwrap();
    let qh: &[u8; 32] = block[16..48].try_into().unwrap();
    let qs = &block[48..];
    for (chunk, (q, values)) in qs
        .chunks_exact(32)
        .zip(out.chunks_exact_mut(64))
        .enumerate()
    {
        let (scale_low, min_low) = scale_min_k4(2 * chunk, scales);
        let (scale_high, min_high) = scale_min_k4(2 * chunk + 1, scales);
        let (d_low, m_low) = (d * scale_low as f32, dmin * min_low as f32);
        let (d_high, m_high) = (d * scale_high as f32, dmin * min_high as f32);
        let (shift_low, shift_high) = (2 * chunk, 2 * chunk + 1);
        let (low, high) = values.split_at_mut(32);
        for l in 0..32 {
            let bit_low = ((qh[l] >> shift_low) & 1) << 4;
            let bit_high = ((qh[l] >> shift_high) & 1) << 4;
            low[l] = d_low * ((q[l] & 0x0F) | bit_low) as f32 - m_low;
            high[l] = d_high * ((q[l] >> 4) | bit_high) as f32 - m_high;
        }
    }
}

/// `block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }`: two halves of 128 values;
/// in each, value `l + 32 * k` (k = 0..4) takes 4 low bits from `ql` and 2 high bits from
/// `qh`, minus 32; `y = (d * scale) * q` with one signed scale per 16 values.
#[inline(always)]
pub fn q6_k(block: &[u8; Q6_K_BYTES], out: &mut [f32; QK_K]) {
    let d = f16_at(block, 208);
    let scales = &block[192..208];
    for half in 0..2 {
        let ql: &[u8; 64] = block[64 * half..64 * half + 64].try_into().unwrap();
        let qh: &[u8; 32] = block[128 + 32 * half..160 + 32 * half].try_into().unwrap();
        let sc = &scales[8 * half..8 * half + 8];
        let values: &mut [f32; 128] = (&mut out[128 * half..128 * half + 128]).try_into().unwrap();
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            values[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            values[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            values[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            values[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}
