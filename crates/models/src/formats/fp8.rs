//! Block-scaled FP8 weights, as DeepSeek-V3/R1 and other models ship them in safetensors:
//! each linear weight is stored as `F8_E4M3` with a companion `<name>_scale_inv` tensor of
//! F32 (or BF16) factors, one per block of `block_rows x block_cols` weights (128 x 128 in
//! DeepSeek-V3, `quantization_config.weight_block_size`); a weight is its e4m3 value times
//! its block's factor. The loader serves such a weight dequantized to F32 (exact up to the
//! f32 rounding of the product), and the model then stores it in its own precision.

/// Why a block-scaled FP8 tensor cannot be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Fp8Error {
    /// The weight is not 2-D or its bytes do not match its shape.
    #[error("an FP8 weight must be 2-D with one byte per element; got shape {shape:?} and {bytes} bytes")]
    Shape { shape: Vec<usize>, bytes: usize },
    /// The scale tensor's shape fits no power-of-two block size.
    #[error(
        "scale shape {scales:?} fits no power-of-two block size for a weight of shape {weight:?}"
    )]
    Scales {
        weight: Vec<usize>,
        scales: Vec<usize>,
    },
}

/// The value of one OCP `E4M3FN` byte: 1 sign, 4 exponent (bias 7) and 3 mantissa bits, no
/// infinities, `S.1111.111` is NaN; exponent 0 holds the subnormals (m / 8 x 2^-6).
pub fn e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let exponent = i32::from((byte >> 3) & 0x0f);
    let mantissa = f32::from(byte & 0x07);
    if exponent == 0x0f && byte & 0x07 == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exponent == 0 {
        mantissa / 8.0 * (-6f32).exp2()
    } else {
        (1.0 + mantissa / 8.0) * ((exponent - 7) as f32).exp2()
    };
    sign * magnitude
}

/// The block size along one dimension of `len` elements that `blocks` scales cover: the
/// power of two `b` with `(blocks - 1) * b < len <= blocks * b` (unique when `blocks > 1`;
/// one block covers the whole dimension).
fn block_size(len: usize, blocks: usize) -> Option<usize> {
    match blocks {
        0 => None,
        1 => Some(len.max(1)),
        _ => (0..usize::BITS)
            .map(|shift| 1usize << shift)
            .take_while(|&b| b < len)
            .find(|&b| (blocks - 1) * b < len && len <= blocks * b),
    }
}

/// The block sizes `(rows, cols)` of a weight of `weight` shape scaled by `scales` shape.
pub fn block_shape(weight: &[usize], scales: &[usize]) -> Result<(usize, usize), Fp8Error> {
    let error = || Fp8Error::Scales {
        weight: weight.to_vec(),
        scales: scales.to_vec(),
    };
    match (weight, scales) {
        ([rows, cols], [scale_rows, scale_cols]) => Ok((
            block_size(*rows, *scale_rows).ok_or_else(error)?,
            block_size(*cols, *scale_cols).ok_or_else(error)?,
        )),
        _ => Err(error()),
    }
}

/// Dequantizes a `[rows, cols]` e4m3 weight with its `[ceil(rows / br), ceil(cols / bc)]`
/// block factors into little-endian F32 bytes.
pub fn dequantize(
    weight: &[u8],
    shape: &[usize],
    scales: &[f32],
    scale_shape: &[usize],
) -> Result<Vec<u8>, Fp8Error> {
    let [rows, cols] = shape else {
        return Err(Fp8Error::Shape {
            shape: shape.to_vec(),
            bytes: weight.len(),
        });
    };
    if rows * cols != weight.len() {
        return Err(Fp8Error::Shape {
            shape: shape.to_vec(),
            bytes: weight.len(),
        });
    }
    let (block_rows, block_cols) = block_shape(shape, scale_shape)?;
    let scale_cols = scale_shape[1];
    let table: Vec<f32> = (0..=255u8).map(e4m3_to_f32).collect();
    let mut out = Vec::with_capacity(weight.len() * 4);
    for (row, bytes) in weight.chunks_exact(*cols).enumerate() {
        let factors = &scales[(row / block_rows) * scale_cols..][..scale_cols];
        for (col, &byte) in bytes.iter().enumerate() {
            let value = table[usize::from(byte)] * factors[col / block_cols];
            out.extend_from_slice(&value.to_le_bytes());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_values_follow_the_ocp_table() {
        // Points from the OCP 8-bit floating point specification (E4M3).
        let cases = [
            (0x00, 0.0),
            (0x38, 1.0),
            (0xb8, -1.0),
            (0x7e, 448.0),
            (0xfe, -448.0),
            (0x08, 2f32.powi(-6)),
            (0x07, 0.875 * 2f32.powi(-6)),
            (0x01, 2f32.powi(-9)),
            (0x3c, 1.5),
            (0x40, 2.0),
            (0x4b, 5.5),
        ];
        for (byte, value) in cases {
            assert_eq!(e4m3_to_f32(byte), value, "{byte:#04x}");
        }
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
        // Every finite positive code is larger than the one before (a monotone encoding).
        let positives: Vec<f32> = (0..0x7f).map(e4m3_to_f32).collect();
        assert!(positives.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn block_sizes_are_the_unique_power_of_two() {
        assert_eq!(block_shape(&[7168, 18432], &[56, 144]), Ok((128, 128)));
        assert_eq!(block_shape(&[576, 7168], &[5, 56]), Ok((128, 128)));
        assert_eq!(block_shape(&[40, 64], &[3, 4]), Ok((16, 16)));
        assert_eq!(block_shape(&[40, 64], &[1, 1]), Ok((40, 64)));
        assert!(block_shape(&[40, 64], &[40, 3]).is_err());
        assert!(block_shape(&[40, 64], &[0, 1]).is_err());
        assert!(block_shape(&[40], &[1]).is_err());
    }

    #[test]
    fn dequantize_multiplies_each_block_by_its_factor() {
        // A 3 x 5 weight in blocks of 2 x 4: factors [[1, 10], [100, 1000]].
        let weight = vec![0x38u8; 15]; // every value 1.0
        let out = dequantize(&weight, &[3, 5], &[1.0, 10.0, 100.0, 1000.0], &[2, 2]).unwrap();
        let values: Vec<f32> = out
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(
            values,
            [
                1.0, 1.0, 1.0, 1.0, 10.0, //
                1.0, 1.0, 1.0, 1.0, 10.0, //
                100.0, 100.0, 100.0, 100.0, 1000.0
            ]
        );
        assert!(dequantize(&weight, &[3, 4], &[1.0; 4], &[2, 2]).is_err());
    }
}
