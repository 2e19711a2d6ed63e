//! The `:fp8` format of random weights (`llama-3.1-8b:fp8`): the dense projections of every
//! layer (attention q, k, v and output; the MLP's gate, up and down, shared experts' too) as
//! FP8 (e4m3) codes with one f32 factor per row, the form a per-channel FP8 safetensors
//! checkpoint (compressed-tensors, `weight_scale` of shape `[out, 1]`) is read in
//! ([`crate::weights::Fp8Rows`]), so `PAGODA_CUDA_FP8_WEIGHTS` can be measured without one.
//! Embeddings, the output head, norms, routers, stacked experts and latent-attention
//! matrices stay f32.
//!
//! Each row is the f32 format's row quantized: factor = the smallest power of two at least
//! `amax / 448`, code = the e4m3 value nearest `x / factor` (ties to the even code). With a
//! power-of-two factor every value `code * factor` is exact in f32 and in bf16 (e4m3 has 4
//! significant bits), so the CPU's f32 weights, the GPU's bf16 decode of them
//! (`PAGODA_CUDA_FP8_WEIGHTS=off`) and the GPU's FP8 kernels (`=on`) hold the same values.

use rayon::prelude::*;

use pagoda_ops::attention::fp8::{f32_to_e4m3, E4M3_MAX};

use crate::formats::fp8::e4m3_to_f32;
use crate::weights::names;

/// How random weights store the dense projections (a spec's suffix: `llama-3.1-8b:fp8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RandomFormat {
    /// Every tensor f32 (no suffix, or `:f32`).
    #[default]
    F32,
    /// The dense projections FP8 (e4m3) with one factor per row (`:fp8`; module docs).
    Fp8,
}

/// Layer tensors (`blk.{i}.<suffix>`) the `:fp8` format stores as FP8.
const FP8_SUFFIXES: [&str; 10] = [
    names::ATTN_Q,
    names::ATTN_K,
    names::ATTN_V,
    names::ATTN_OUTPUT,
    names::FFN_GATE,
    names::FFN_UP,
    names::FFN_DOWN,
    names::FFN_GATE_SHEXP,
    names::FFN_UP_SHEXP,
    names::FFN_DOWN_SHEXP,
];

/// `spec` without its format suffix, and the format: `llama-3.1-8b:fp8` is `llama-3.1-8b`
/// in FP8. A spec that `known` accepts whole (a preset, an existing file) has no suffix. An
/// unknown suffix on a known base is an error that names the fix; anything else is returned
/// whole, for the caller's "unknown configuration" error.
pub(super) fn split_spec(
    spec: &str,
    known: impl Fn(&str) -> bool,
) -> Result<(&str, RandomFormat), String> {
    if known(spec) {
        return Ok((spec, RandomFormat::F32));
    }
    let Some((base, suffix)) = spec.rsplit_once(':') else {
        return Ok((spec, RandomFormat::F32));
    };
    match suffix.to_ascii_lowercase().as_str() {
        "fp8" | "fp8_e4m3" => Ok((base, RandomFormat::Fp8)),
        "f32" => Ok((base, RandomFormat::F32)),
        _ if known(base) => Err(format!(
            "unknown random-weights format `:{suffix}` in `{spec}`: give `{base}:fp8` (FP8 e4m3 \
             projections with a factor per row) or `{base}` (f32)"
        )),
        _ => Ok((spec, RandomFormat::F32)),
    }
}

/// Whether the `:fp8` format stores tensor `name` of `shape` as FP8.
pub(super) fn is_fp8_projection(name: &str, shape: &[usize]) -> bool {
    let suffix = name
        .strip_prefix("blk.")
        .and_then(|rest| rest.split_once('.'))
        .map(|(_, suffix)| suffix);
    shape.len() == 2 && suffix.is_some_and(|suffix| FP8_SUFFIXES.contains(&suffix))
}

/// A row's factor: the smallest power of two at least `amax / 448` (1 for a zero row).
fn row_scale(amax: f32) -> f32 {
    let scale = amax / E4M3_MAX;
    if !(f32::MIN_POSITIVE..=f32::MAX / 2.0).contains(&scale) {
        return 1.0;
    }
    let floor = f32::from_bits(scale.to_bits() & 0x7f80_0000);
    if floor == scale {
        scale
    } else {
        2.0 * floor
    }
}

/// `[rows, cols]` row-major values as e4m3 codes and one factor per row.
pub(super) fn quantize(values: &[f32], cols: usize) -> (Vec<u8>, Vec<f32>) {
    let mut codes = vec![0u8; values.len()];
    let mut scales = vec![0f32; values.len() / cols.max(1)];
    codes
        .par_chunks_mut(cols)
        .zip(scales.par_iter_mut())
        .zip(values.par_chunks(cols))
        .for_each(|((codes, scale), row)| {
            *scale = row_scale(row.iter().fold(0f32, |m, v| m.max(v.abs())));
            for (code, &value) in codes.iter_mut().zip(row) {
                // Exact: the factor is a power of two.
                *code = f32_to_e4m3(value / *scale);
            }
        });
    (codes, scales)
}

/// The values codes and row factors stand for, as little-endian f32 bytes (`code * factor`,
/// as the safetensors loader serves an FP8 matrix).
pub(super) fn dequantize(codes: &[u8], scales: &[f32], cols: usize) -> Vec<u8> {
    let table: Vec<f32> = (0..=255u8).map(e4m3_to_f32).collect();
    let mut out = vec![0u8; codes.len() * 4];
    out.par_chunks_mut(4 * cols)
        .zip(codes.par_chunks(cols))
        .zip(scales.par_iter())
        .for_each(|((out, codes), &scale)| {
            for (bytes, &code) in out.chunks_exact_mut(4).zip(codes) {
                let value = table[usize::from(code)] * scale;
                bytes.copy_from_slice(&value.to_le_bytes());
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_factors_are_powers_of_two_covering_the_row() {
        assert_eq!(row_scale(448.0), 1.0);
        assert_eq!(row_scale(449.0), 2.0);
        assert_eq!(row_scale(0.0), 1.0);
        let scale = row_scale(0.0156);
        assert_eq!(scale, 2f32.powi(-14));
        assert!(0.0156 / scale <= 448.0 && 0.0156 / scale > 224.0);
        // Values decode exactly, and their bf16 rounding is themselves.
        let row: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 0.0013).collect();
        let (codes, scales) = quantize(&row, 32);
        assert_eq!(scales.len(), 2);
        let bytes = dequantize(&codes, &scales, 32);
        for (i, b) in bytes.chunks_exact(4).enumerate() {
            let v = f32::from_le_bytes(b.try_into().unwrap());
            assert_eq!(v, e4m3_to_f32(codes[i]) * scales[i / 32]);
            assert_eq!(half::bf16::from_f32(v).to_f32(), v);
            assert!((v - row[i]).abs() <= row[i].abs() / 16.0 + scales[i / 32] / 512.0);
        }
    }

    #[test]
    fn specs_take_a_format_suffix() {
        let known = |s: &str| s == "llama-3.1-8b" || s == "dir:odd/config.json";
        assert_eq!(
            split_spec("llama-3.1-8b", known),
            Ok(("llama-3.1-8b", RandomFormat::F32))
        );
        assert_eq!(
            split_spec("llama-3.1-8b:fp8", known),
            Ok(("llama-3.1-8b", RandomFormat::Fp8))
        );
        assert_eq!(
            split_spec("llama-3.1-8b:FP8", known),
            Ok(("llama-3.1-8b", RandomFormat::Fp8))
        );
        assert_eq!(
            split_spec("dir:odd/config.json", known),
            Ok(("dir:odd/config.json", RandomFormat::F32))
        );
        assert_eq!(
            split_spec("gpt-5:int4", known),
            Ok(("gpt-5:int4", RandomFormat::F32))
        );
        let error = split_spec("llama-3.1-8b:int4", known).unwrap_err();
        assert!(error.contains("`:int4`") && error.contains("llama-3.1-8b:fp8"));
        assert!(!error.contains('\n'));
    }

    #[test]
    fn fp8_random_weights_serve_codes_and_the_values_they_stand_for() {
        use crate::random::{preset, RandomWeights};
        use crate::weights::TensorSource;
        let config = crate::config::ModelConfig {
            num_layers: 2,
            hidden_size: 128,
            num_attention_heads: 2,
            num_kv_heads: 1,
            head_dim: 64,
            rope_dim: 64,
            intermediate_size: 256,
            vocab_size: 512,
            ..preset("smollm2-135m").unwrap()
        };
        let plain = RandomWeights::new(&config, 7, 1 << 30).unwrap();
        let fp8 = RandomWeights::new(&config, 7, 1 << 30)
            .unwrap()
            .with_format(RandomFormat::Fp8);
        assert_eq!(plain.fp8_matrices(), (0, 0));
        let (matrices, bytes) = fp8.fp8_matrices();
        assert_eq!(matrices, 2 * 7);
        let (mut seen, mut codes_seen) = (0, 0);
        for name in fp8.tensor_names() {
            let (want, got) = (plain.tensor(&name).unwrap(), fp8.tensor(&name).unwrap());
            assert_eq!((want.ty, &want.shape), (got.ty, &got.shape), "{name}");
            assert!(plain.fp8_rows(&name).is_none());
            let Some(rows) = fp8.fp8_rows(&name) else {
                assert_eq!(want.data, got.data, "{name}");
                continue;
            };
            let cols = got.shape[1];
            assert_eq!(rows.row_scales.len(), got.shape[0], "{name}");
            let f32s = |bytes: &[u8]| -> Vec<f32> {
                let values = bytes.chunks_exact(4);
                values
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect()
            };
            let (want, got) = (f32s(&want.data), f32s(&got.data));
            for (i, (&w, &g)) in want.iter().zip(&got).enumerate() {
                let scale = rows.row_scales[i / cols];
                assert_eq!(g.to_bits(), (e4m3_to_f32(rows.codes[i]) * scale).to_bits());
                assert!(
                    (g - w).abs() <= w.abs() / 16.0 + scale / 512.0,
                    "{name} {i}"
                );
            }
            assert_ne!(want, got, "{name}: nothing was rounded");
            seen += 1;
            codes_seen += rows.codes.len();
        }
        assert_eq!((seen, codes_seen), (matrices, bytes));
    }

    #[test]
    fn only_dense_projections_are_fp8() {
        assert!(is_fp8_projection("blk.3.attn_q.weight", &[64, 64]));
        assert!(is_fp8_projection("blk.0.ffn_down.weight", &[64, 96]));
        assert!(is_fp8_projection("blk.0.ffn_up_shexp.weight", &[96, 64]));
        assert!(!is_fp8_projection("blk.0.ffn_up_exps.weight", &[4, 96, 64]));
        assert!(!is_fp8_projection("blk.0.ffn_gate_inp.weight", &[4, 64]));
        assert!(!is_fp8_projection("blk.0.ffn_norm.weight", &[64]));
        assert!(!is_fp8_projection("blk.0.indexer.attn_k.weight", &[16, 64]));
        assert!(!is_fp8_projection("output.weight", &[512, 64]));
        assert!(!is_fp8_projection("token_embd.weight", &[512, 64]));
    }
}
