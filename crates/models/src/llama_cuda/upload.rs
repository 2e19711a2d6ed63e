//! Reading a weight tensor from the file and putting it on the GPU: floats converted to `T` on
//! the host, quantized GGUF matrices kept in their blocks or dequantized on the device, parts
//! stacked into one matrix (shared by the layers' loaders, `weights.rs`, `experts.rs` and
//! `mla_weights.rs`).

use pagoda_cuda::{view_mut, CudaError, DeviceBuffer, Gpu};
use pagoda_ops::cuda::{self as ops, QuantFormat};
use pagoda_tensor::GgmlType;
use rayon::prelude::*;

use super::matrix::{Fp8Matrix, Matrix, QuantMatrix, QuantPart};
use super::HostFloat;
use crate::llama::LoadError;
use crate::weight_plan::{gpu_keeps_blocks, TensorSpec};
use crate::weights::TensorSource;

fn gpu_error(context: &str) -> impl Fn(CudaError) -> LoadError + '_ {
    move |e| LoadError(format!("{context}: {e}"))
}

/// The GPU's in-place format of a GGUF type, if it has one (the types of
/// [`crate::weight_plan::GPU_IN_PLACE_FORMATS`]).
fn quant_format(ty: GgmlType) -> Option<QuantFormat> {
    Some(match ty {
        GgmlType::Q4_0 => QuantFormat::Q4_0,
        GgmlType::Q4_1 => QuantFormat::Q4_1,
        GgmlType::Q5_0 => QuantFormat::Q5_0,
        GgmlType::Q5_1 => QuantFormat::Q5_1,
        GgmlType::Q8_0 => QuantFormat::Q8_0,
        GgmlType::Q4K => QuantFormat::Q4K,
        GgmlType::Q5K => QuantFormat::Q5K,
        GgmlType::Q6K => QuantFormat::Q6K,
        _ => return None,
    })
}

/// Which stored matrices stay in their file's bytes on the device (the rest are dense in the
/// model's dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeepOnDevice {
    /// GGUF blocks the GPU multiplies in place (`PAGODA_CUDA_QUANT_WEIGHTS`).
    pub gguf_blocks: bool,
    /// FP8 (e4m3) safetensors matrices with one factor per row (`PAGODA_CUDA_FP8_WEIGHTS`).
    pub fp8: bool,
    /// A GGUF mixture-of-experts model's stacked experts in their blocks
    /// (`PAGODA_CUDA_MOE_QUANT`, with `gguf_blocks`).
    pub moe_experts: bool,
}

/// `parts` stacked into one matrix: FP8 codes and row factors when `keep.fp8` and every part
/// is stored so; kept in their blocks when `keep.gguf_blocks` and every part is in a format
/// the GPU multiplies in place (consecutive parts of one format share a buffer); else dense
/// in `T`.
pub(super) fn matrix<T: HostFloat>(
    gpu: &Gpu,
    source: &dyn TensorSource,
    parts: &[&TensorSpec],
    keep: KeepOnDevice,
) -> Result<Matrix<T>, LoadError> {
    let keep_quantized = keep.gguf_blocks;
    let cols = parts[0].cols();
    if keep.fp8 && cols.is_multiple_of(16) {
        if let Some(fp8) = fp8_matrix(gpu, source, parts, cols)? {
            return Ok(Matrix::Fp8(Box::new(fp8)));
        }
    }
    let raws = parts
        .iter()
        .map(|spec| {
            let raw = source.tensor(&spec.name).ok_or_else(|| {
                LoadError(format!(
                    "tensor {} is missing from the model file",
                    spec.name
                ))
            })?;
            Ok((spec, raw))
        })
        .collect::<Result<Vec<_>, LoadError>>()?;
    let formats: Option<Vec<QuantFormat>> = raws
        .iter()
        .map(|(spec, raw)| {
            quant_format(raw.ty)
                .filter(|_| raw.shape == spec.shape && spec.shape.len() == 2)
                .filter(|_| gpu_keeps_blocks(raw.ty, cols))
        })
        .collect();
    let Some(formats) = formats.filter(|_| keep_quantized) else {
        return stacked::<T>(gpu, source, parts).map(Matrix::Dense);
    };
    let mut quantized = QuantMatrix {
        parts: Vec::new(),
        cols,
    };
    let mut i = 0;
    while i < raws.len() {
        let format = formats[i];
        let mut bytes = Vec::new();
        let mut rows = 0;
        while i < raws.len() && formats[i] == format {
            bytes.extend_from_slice(&raws[i].1.data);
            rows += raws[i].0.rows();
            i += 1;
        }
        if bytes.len() != rows * format.row_bytes(cols) {
            return Err(LoadError(format!(
                "tensor {}: {} bytes of {format} blocks for [{rows}, {cols}]",
                raws[i - 1].0.name,
                bytes.len()
            )));
        }
        bytes.resize(bytes.len() + ops::QUANT_PADDING, 0);
        let blocks = gpu.upload(&bytes).map_err(gpu_error(&raws[i - 1].0.name))?;
        quantized.parts.push(QuantPart {
            format,
            rows,
            blocks,
        });
    }
    Ok(Matrix::Quantized(quantized))
}

/// Stacked experts (`[num_experts, rows, cols]`) kept in their GGUF blocks
/// (`PAGODA_CUDA_MOE_QUANT`), or `None` where their type is not one the quantized expert
/// kernels read in whole blocks (the caller dequantizes them instead).
pub(super) fn quant_experts(
    gpu: &Gpu,
    source: &dyn TensorSource,
    spec: &TensorSpec,
) -> Result<Option<ops::QuantExperts>, LoadError> {
    let name = &spec.name;
    let raw = source
        .tensor(name)
        .ok_or_else(|| LoadError(format!("tensor {name} is missing from the model file")))?;
    let Some(format) = quant_format(raw.ty) else {
        return Ok(None);
    };
    let &[experts, rows, cols] = &spec.shape[..] else {
        return Ok(None);
    };
    if raw.shape != spec.shape || !gpu_keeps_blocks(raw.ty, cols) {
        return Ok(None);
    }
    ops::QuantExperts::upload(gpu, format, &raw.data[..], [experts, rows, cols])
        .map(Some)
        .map_err(gpu_error(name))
}

/// `parts` stacked as FP8 codes and row factors, if every part is stored so with the
/// expected shape ([`TensorSource::fp8_rows`]).
fn fp8_matrix(
    gpu: &Gpu,
    source: &dyn TensorSource,
    parts: &[&TensorSpec],
    cols: usize,
) -> Result<Option<Fp8Matrix>, LoadError> {
    let (mut codes, mut scales) = (Vec::new(), Vec::new());
    for spec in parts {
        let Some(stored) = source.fp8_rows(&spec.name) else {
            return Ok(None);
        };
        let rows = spec.rows();
        if spec.shape.len() != 2 || stored.codes.len() != rows * cols {
            return Ok(None);
        }
        codes.extend_from_slice(&stored.codes);
        scales.extend_from_slice(&stored.row_scales);
    }
    let name = &parts[parts.len() - 1].name;
    Ok(Some(Fp8Matrix {
        codes: gpu.upload(&codes).map_err(gpu_error(name))?,
        scales: gpu.upload(&scales).map_err(gpu_error(name))?,
        rows: scales.len(),
        cols,
    }))
}

/// Uploads one float or quantized tensor as `T`, checking its shape.
pub(super) fn upload_tensor<T: HostFloat>(
    gpu: &Gpu,
    source: &dyn TensorSource,
    name: &str,
    shape: &[usize],
) -> Result<DeviceBuffer<T>, LoadError> {
    let len: usize = shape.iter().product();
    let mut out = gpu.alloc::<T>(len).map_err(gpu_error(name))?;
    upload_tensor_into(gpu, source, name, shape, &mut out)?;
    Ok(out)
}

pub(super) fn upload_tensor_into<T: HostFloat>(
    gpu: &Gpu,
    source: &dyn TensorSource,
    name: &str,
    shape: &[usize],
    out: &mut impl pagoda_cuda::DeviceWrite<T>,
) -> Result<(), LoadError> {
    let raw = source
        .tensor(name)
        .ok_or_else(|| LoadError(format!("tensor {name} is missing from the model file")))?;
    let len: usize = shape.iter().product();
    if raw.shape.iter().product::<usize>() != len || (shape.len() > 1 && raw.shape != shape) {
        return Err(LoadError(format!(
            "tensor {name} has shape {:?}, expected {shape:?}",
            raw.shape
        )));
    }
    let format = match raw.ty {
        ty if quant_format(ty).is_some() => quant_format(ty),
        // No GPU dequantizer: decoded on the CPU (bit-exact) and uploaded as floats.
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q2K | GgmlType::Q3K => None,
        other => {
            return Err(LoadError(format!(
                "tensor {name} has type {other}, which the CUDA backend cannot load yet"
            )))
        }
    };
    match format {
        Some(format) => {
            let blocks = gpu.upload(&raw.data[..]).map_err(gpu_error(name))?;
            ops::dequantize(gpu, format, &blocks, out).map_err(gpu_error(name))
        }
        None if raw.ty == GgmlType::F32 => {
            // Random 8B weights are 32 GB of f32: convert in parallel, straight from the bytes.
            let converted: Vec<T> = raw
                .data
                .par_chunks_exact(4)
                .map(|bytes| {
                    T::from_f32(f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
                })
                .collect();
            gpu.upload_into(&converted, out).map_err(gpu_error(name))
        }
        None => {
            let mut values = vec![0f32; len];
            pagoda_tensor::quant::dequantize(raw.ty, &raw.data, &mut values)
                .map_err(|e| LoadError(format!("tensor {name}: {e}")))?;
            let converted: Vec<T> = values.into_iter().map(T::from_f32).collect();
            gpu.upload_into(&converted, out).map_err(gpu_error(name))
        }
    }
}

/// Several `[rows_i, cols]` matrices stacked into one `[sum rows_i, cols]` buffer.
pub(super) fn stacked<T: HostFloat>(
    gpu: &Gpu,
    source: &dyn TensorSource,
    parts: &[&TensorSpec],
) -> Result<DeviceBuffer<T>, LoadError> {
    let cols = parts[0].cols();
    let total_rows: usize = parts.iter().map(|spec| spec.rows()).sum();
    let mut out = gpu
        .alloc::<T>(total_rows * cols)
        .map_err(gpu_error("weights"))?;
    let mut row = 0;
    for spec in parts {
        let rows = spec.rows();
        let mut part =
            view_mut(&mut out, row * cols..(row + rows) * cols).map_err(gpu_error(&spec.name))?;
        upload_tensor_into(gpu, source, &spec.name, &spec.shape, &mut part)?;
        row += rows;
    }
    Ok(out)
}
