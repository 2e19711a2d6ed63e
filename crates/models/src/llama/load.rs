//! Loading the CPU model's tensors: matrices in their stored formats (with the CPU kernel
//! policy's kernels), float vectors, and the rotary embedding.

use pagoda_ops::linear::{CpuKernelPolicy, Weight};
use pagoda_ops::rope::{Llama3Scaling, Rope, RopePairing};
use pagoda_tensor::GgmlType;

use super::WeightPrecision;
use crate::config::{ModelConfig, RopeStyle};
use crate::weights::{LoadError, RawTensor, TensorSource};

/// The rotary embedding of `config`: llama3 scaling from the config, or the per-pair factors
/// of GGUF's `rope_freqs.weight` when the file has them.
pub(crate) fn rope_for(c: &ModelConfig, source: &dyn TensorSource) -> Result<Rope, LoadError> {
    let yarn = c.mla.as_ref().and_then(|mla| mla.yarn);
    let frequency_factors = match source.tensor("rope_freqs.weight") {
        Some(_) => Some(load_vector(source, "rope_freqs.weight", c.rope_dim / 2)?),
        None if yarn.is_some() => yarn.map(|y| y.frequency_factors(c.rope_theta, c.rope_dim)),
        None => c.rope_scaling.map(|s| {
            Llama3Scaling {
                factor: s.factor,
                low_freq_factor: s.low_freq_factor,
                high_freq_factor: s.high_freq_factor,
                original_max_position_embeddings: s.original_max_position_embeddings,
            }
            .frequency_factors(c.rope_theta, c.rope_dim)
        }),
    };
    let pairing = match c.rope_style {
        RopeStyle::Interleaved => RopePairing::Interleaved,
        RopeStyle::Halves => RopePairing::Halves,
    };
    Ok(Rope::new(
        c.rope_theta,
        c.rope_dim,
        frequency_factors.as_deref(),
        pairing,
    ))
}

pub(crate) fn fetch<'a>(
    source: &'a dyn TensorSource,
    name: &str,
) -> Result<RawTensor<'a>, LoadError> {
    source
        .tensor(name)
        .ok_or_else(|| LoadError(format!("tensor {name} is missing from the model file")))
}

pub(crate) fn load_matrix(
    source: &dyn TensorSource,
    name: &str,
    rows: usize,
    cols: usize,
    precision: WeightPrecision,
) -> Result<Weight, LoadError> {
    let raw = fetch(source, name)?;
    if raw.shape != [rows, cols] {
        return Err(LoadError(format!(
            "tensor {name} has shape {:?}, expected [{rows}, {cols}]",
            raw.shape
        )));
    }
    weight_from_bytes(name, raw.ty, [rows, cols], raw.data.into_owned(), precision)
        .map_err(|e| LoadError(format!("tensor {name}: {e}")))
}

/// A `[rows, cols]` matrix of `ty` from its stored bytes, with the kernels the CPU kernel
/// policy gives the tensor named `name` (an expert gets its dense role's name).
pub(crate) fn weight_from_bytes(
    name: &str,
    ty: GgmlType,
    [rows, cols]: [usize; 2],
    data: Vec<u8>,
    precision: WeightPrecision,
) -> Result<Weight, String> {
    // The per-weight kernel policy (`auto`: ffn_down on Q15 or f32 activations, see
    // `pagoda_ops::linear::cpu::kernels`); exact mode then decodes every weight to f32 anyway.
    let policy = CpuKernelPolicy::selected();
    let weight = Weight::with_kernels(ty, rows, cols, data, policy.for_tensor(name))
        .map_err(|e| e.to_string())?
        .with_q15_activations(policy.q15_for_tensor(name));
    Ok(match precision {
        WeightPrecision::AsStored => weight,
        WeightPrecision::F32 => weight.to_f32(),
    })
}

pub(crate) fn load_vector(
    source: &dyn TensorSource,
    name: &str,
    len: usize,
) -> Result<Vec<f32>, LoadError> {
    let raw = fetch(source, name)?;
    if raw.shape.iter().product::<usize>() != len {
        return Err(LoadError(format!(
            "tensor {name} has shape {:?}, expected [{len}]",
            raw.shape
        )));
    }
    let mut out = vec![0f32; len];
    if !matches!(raw.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
        return Err(LoadError(format!(
            "tensor {name} has type {}, expected a float type",
            raw.ty
        )));
    }
    pagoda_tensor::quant::dequantize(raw.ty, &raw.data, &mut out)
        .map_err(|e| LoadError(format!("tensor {name}: {e}")))?;
    Ok(out)
}
