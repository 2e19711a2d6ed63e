//! Pairing `F8_E4M3` weights with their factors: DeepSeek's block factors
//! (`<name>_scale_inv`, `[ceil(out / b), ceil(in / b)]`), or the `weight_scale` of vLLM's
//! per-tensor `fp8` and of compressed-tensors (`[out, 1]` or `[out]` per output channel,
//! `[]` or `[1]` per tensor). Every layout is a block grid, so one dequantizer serves all:
//! per channel is blocks of one row, per tensor one block.

use std::path::Path;

use pagoda_tensor::GgmlType;

use super::{fp8, SafetensorsError, SafetensorsWeights};
use crate::weights::Fp8Rows;

/// The weight whose factors the tensor `hf_name` holds, if it is an FP8 scale:
/// `x.weight_scale_inv` and `x.weight_scale` both scale `x.weight`. (An `input_scale`, an
/// activation factor pagoda does not apply, is no weight's scale and is listed unmapped.)
pub(super) fn scaled_weight(hf_name: &str) -> Option<&str> {
    hf_name.strip_suffix("_scale_inv").or_else(|| {
        hf_name
            .strip_suffix("_scale")
            .filter(|weight| weight.ends_with(".weight"))
    })
}

/// A scale tensor's shape as a block grid `[row blocks, column blocks]` for a weight of
/// `rows` rows: a scalar or `[1]` is one block, `[rows]` one block per row.
fn as_grid(scales: &[usize], rows: usize) -> Vec<usize> {
    match scales {
        [] | [1] => vec![1, 1],
        [n] if *n == rows => vec![rows, 1],
        other => other.to_vec(),
    }
}

impl SafetensorsWeights {
    /// Gives every `F8_E4M3` weight its factors, checking that their shape fits a block
    /// size; scales of weights that are not served are listed unmapped. Errors name `path`.
    pub(super) fn pair_fp8_scales(&mut self, path: &Path) -> Result<(), SafetensorsError> {
        let mut scales = std::mem::take(&mut self.fp8_scales);
        let entries = self.tensors.values_mut().chain(
            self.expert_parts
                .values_mut()
                .flat_map(|parts| parts.values_mut()),
        );
        for entry in entries.filter(|entry| entry.fp8) {
            let mut scale = scales.remove(&entry.hf_name).ok_or_else(|| {
                SafetensorsError::new(
                    path,
                    format!(
                        "FP8 tensor `{}` has no `{}_scale_inv` (block) or `{}_scale` \
                         (per-channel or per-tensor) factors",
                        entry.hf_name, entry.hf_name, entry.hf_name
                    ),
                )
            })?;
            let bytes = entry.end - entry.start;
            let fits = entry.shape.iter().product::<usize>() == bytes;
            scale.shape = as_grid(&scale.shape, entry.shape.first().copied().unwrap_or(0));
            fp8::block_shape(&entry.shape, &scale.shape)
                .map_err(|error| error.to_string())
                .and_then(|_| {
                    fits.then_some(())
                        .ok_or_else(|| "not one byte per element".into())
                })
                .map_err(|error| {
                    SafetensorsError::new(path, format!("FP8 tensor `{}`: {error}", entry.hf_name))
                })?;
            entry.fp8_scales = Some(Box::new(scale));
        }
        self.unmapped
            .extend(scales.into_values().map(|scale| scale.hf_name));
        Ok(())
    }

    /// A served (not stacked) FP8 matrix whose factors cover whole rows: its codes and one
    /// factor per row ([`crate::weights::Fp8Rows`]); `None` for block factors narrower
    /// than a row (DeepSeek's 128 x 128) and for anything not FP8.
    pub(super) fn stored_fp8_rows(&self, name: &str) -> Option<Fp8Rows<'_>> {
        let entry = self.tensors.get(name)?;
        let scales = entry.fp8_scales.as_ref()?;
        let [rows, cols] = entry.shape[..] else {
            return None;
        };
        let (block_rows, block_cols) = fp8::block_shape(&entry.shape, &scales.shape).ok()?;
        if block_cols != cols {
            return None;
        }
        let stored = &self.shards[scales.shard].mmap[scales.start..scales.end];
        let width = if scales.ty == GgmlType::F32 { 4 } else { 2 };
        let mut factors = vec![0f32; stored.len() / width];
        pagoda_tensor::quant::dequantize(scales.ty, stored, &mut factors).ok()?;
        let row_scales = (0..rows).map(|r| factors[r / block_rows]).collect();
        let codes = &self.shards[entry.shard].mmap[entry.start..entry.end];
        Some(Fp8Rows {
            codes: codes.into(),
            row_scales,
        })
    }

    /// Bytes of the stored `F8_E4M3` weights (one per element), as the file holds them.
    pub fn fp8_bytes(&self) -> usize {
        let parts = self.stacked.values().flat_map(|stacked| &stacked.parts);
        let entries = self.tensors.values().chain(parts);
        entries.filter(|e| e.fp8).map(|e| e.end - e.start).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_names_and_shapes() {
        let name = "model.layers.0.mlp.up_proj.weight";
        assert_eq!(scaled_weight(&format!("{name}_scale_inv")), Some(name));
        assert_eq!(scaled_weight(&format!("{name}_scale")), Some(name));
        assert_eq!(
            scaled_weight("model.layers.0.mlp.up_proj.input_scale"),
            None
        );
        assert_eq!(scaled_weight("model.layers.0.self_attn.k_scale"), None);
        assert_eq!(as_grid(&[], 96), [1, 1]);
        assert_eq!(as_grid(&[1], 96), [1, 1]);
        assert_eq!(as_grid(&[96], 96), [96, 1]);
        assert_eq!(as_grid(&[96, 1], 96), [96, 1]);
        assert_eq!(
            fp8::block_shape(&[96, 64], &as_grid(&[96, 1], 96)),
            Ok((1, 64))
        );
        assert_eq!(fp8::block_shape(&[96, 64], &as_grid(&[], 96)), Ok((96, 64)));
        assert_eq!(
            fp8::block_shape(&[1, 64], &as_grid(&[1, 1], 1)),
            Ok((1, 64))
        );
    }
}
