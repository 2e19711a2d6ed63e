//! The e4m3 KV cache's codec on the host: the reference the CUDA append kernels
//! (`cuda/kv_fp8.cu`) are tested against, byte for byte.
//!
//! One cached head (a token's `head_dim` K or V values for one KV head) is stored as
//! `head_dim` e4m3 bytes and one f32 scale: `scale = amax / 448` (amax over the head; 1 when
//! that is 0 or below the smallest normal f32), byte `i = e4m3(x_i / scale)`, rounded to
//! nearest (ties to the even code) and saturated to +-448. e4m3 (OCP FP8, "fn"): 1 sign bit,
//! 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (steps of 2^-9); 0x7f
//! and 0xff are NaN and are never produced. The encoder here searches the table of
//! representable values (independent of the kernel's bit arithmetic).

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The value of an e4m3 byte (NaN for 0x7f and 0xff).
pub fn e4m3_to_f32(byte: u8) -> f32 {
    let magnitude = byte & 0x7f;
    if magnitude == 0x7f {
        return f32::NAN;
    }
    let exponent = i32::from(magnitude >> 3);
    let mantissa = f32::from(magnitude & 7);
    let value = if exponent == 0 {
        mantissa / 512.0
    } else {
        (1.0 + mantissa / 8.0) * 2f32.powi(exponent - 7)
    };
    if byte & 0x80 != 0 {
        -value
    } else {
        value
    }
}

/// The e4m3 byte nearest `x` (ties to the even code), saturated to +-448; NaN saturates
/// to +-448 as well (the kernels never write e4m3's NaN).
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let target = if x.is_nan() {
        E4M3_MAX
    } else {
        x.abs().min(E4M3_MAX)
    };
    // The finite magnitudes 0x00..=0x7e increase with the code: the nearest one from below
    // and the next (a binary search of the table), ties to the even code.
    static MAGNITUDES: std::sync::OnceLock<[f32; 127]> = std::sync::OnceLock::new();
    let table = MAGNITUDES.get_or_init(|| std::array::from_fn(|code| e4m3_to_f32(code as u8)));
    let below = table.partition_point(|&v| v <= target).saturating_sub(1) as u8;
    let code = if below == 0x7e {
        below
    } else {
        let (low, high) = (table[usize::from(below)], table[usize::from(below) + 1]);
        let (down, up) = (target - low, high - target);
        if down < up || (down == up && below.is_multiple_of(2)) {
            below
        } else {
            below + 1
        }
    };
    sign | code
}

/// The scale of a head whose largest magnitude is `amax` (1 for 0 or a subnormal result).
pub fn head_scale(amax: f32) -> f32 {
    let scale = amax / E4M3_MAX;
    if scale >= f32::MIN_POSITIVE {
        scale
    } else {
        1.0
    }
}

/// Quantizes one head: `out[i] = e4m3(values[i] / scale)`; returns the scale.
pub fn quantize_head(values: &[f32], out: &mut [u8]) -> f32 {
    assert_eq!(values.len(), out.len(), "one byte per value");
    let amax = values
        .iter()
        .filter(|v| !v.is_nan())
        .fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = head_scale(amax);
    for (byte, &value) in out.iter_mut().zip(values) {
        *byte = f32_to_e4m3(value / scale);
    }
    scale
}

/// The values a quantized head stands for: `scale * e4m3(byte)`.
pub fn dequantize_head(bytes: &[u8], scale: f32) -> Vec<f32> {
    bytes.iter().map(|&b| scale * e4m3_to_f32(b)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_codes_decode() {
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x30), 0.5);
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
    }

    /// The reference encoder: the nearest of all 127 magnitudes by linear search.
    fn nearest(x: f32) -> u8 {
        let table: Vec<f32> = (0..127u8).map(e4m3_to_f32).collect();
        let target = x.abs().min(E4M3_MAX);
        let mut best = 0;
        for (code, &v) in table.iter().enumerate() {
            let (d, b) = ((v - target).abs(), (table[best] - target).abs());
            if d < b || (d == b && code % 2 == 0) {
                best = code;
            }
        }
        (if x < 0.0 { 0x80 } else { 0 }) | best as u8
    }

    #[test]
    fn encoding_is_the_nearest_code_by_linear_search() {
        // Every code, every midpoint between neighbours, and a sweep of the range.
        for code in 0..127u8 {
            let v = e4m3_to_f32(code);
            assert_eq!(f32_to_e4m3(v), code);
            assert_eq!(f32_to_e4m3(-v) & 0x7f, code);
        }
        for code in 0..126u8 {
            let mid = (e4m3_to_f32(code) + e4m3_to_f32(code + 1)) / 2.0;
            assert_eq!(f32_to_e4m3(mid), nearest(mid), "midpoint {mid}");
        }
        for i in 0..200_000 {
            let x = (i as f32 - 100_000.0) * 0.0047;
            assert_eq!(f32_to_e4m3(x) & 0x7f, nearest(x) & 0x7f, "{x}");
        }
    }

    #[test]
    fn encoding_rounds_to_nearest_even_and_saturates() {
        assert_eq!(f32_to_e4m3(448.0), 0x7e);
        assert_eq!(f32_to_e4m3(1e9), 0x7e);
        assert_eq!(f32_to_e4m3(-1e9), 0xfe);
        assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7e);
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7e);
        assert_eq!(f32_to_e4m3(0.5), 0x30);
        assert_eq!(f32_to_e4m3(-0.5), 0xb0);
        assert_eq!(f32_to_e4m3(1.0), 0x38);
        // 1.0625 lies halfway between 1.0 (0x38, even) and 1.125 (0x39): to 0x38.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        // 1.1875 lies halfway between 1.125 (0x39) and 1.25 (0x3a, even): to 0x3a.
        assert_eq!(f32_to_e4m3(1.1875), 0x3a);
        // 432 is halfway between 416 (0x7d) and 448 (0x7e, even).
        assert_eq!(f32_to_e4m3(432.0), 0x7e);
        assert_eq!(f32_to_e4m3(431.0), 0x7d);
        // Subnormals: steps of 2^-9; half a step rounds to the even code 0.
        assert_eq!(f32_to_e4m3(2f32.powi(-9)), 0x01);
        assert_eq!(f32_to_e4m3(2f32.powi(-10)), 0x00);
        assert_eq!(f32_to_e4m3(3.0 * 2f32.powi(-10)), 0x02);
        assert_eq!(f32_to_e4m3(2f32.powi(-20)), 0x00);
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
        // Every finite code round-trips and NaN is never produced.
        for code in (0..=255u8).filter(|c| c & 0x7f != 0x7f) {
            assert_eq!(f32_to_e4m3(e4m3_to_f32(code)), code, "{code:#x}");
        }
        for i in 0..20_000 {
            let x = (i as f32 - 10_000.0) * 0.0731;
            assert_ne!(f32_to_e4m3(x) & 0x7f, 0x7f, "{x}");
        }
    }

    #[test]
    fn a_head_round_trips_within_half_a_step() {
        let values: Vec<f32> = (0..128)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let mut bytes = vec![0u8; values.len()];
        let scale = quantize_head(&values, &mut bytes);
        assert_eq!(scale, 50.0 * 0.013 / 448.0);
        let back = dequantize_head(&bytes, scale);
        for (x, y) in values.iter().zip(&back) {
            // 3 mantissa bits: relative error at most 2^-4 for normals.
            assert!(
                (x - y).abs() <= x.abs() / 16.0 + scale * 2f32.powi(-10),
                "{x} {y}"
            );
        }
        let mut zeros = vec![0u8; 4];
        assert_eq!(quantize_head(&[0.0; 4], &mut zeros), 1.0);
        assert_eq!(zeros, [0; 4]);
    }
}
