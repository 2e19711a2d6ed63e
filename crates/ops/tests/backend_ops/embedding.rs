//! Weight-decoding cases: the row decoders of every weight format (`dequantize`) and the
//! token-embedding gather (`embedding`). Reference: `pagoda_tensor::quant::dequantize`
//! (rounded to the backend's dtype: the GPU's decoders are bit-exact). CPU backends:
//! `Weight::with_kernels(..).dequantize_row` with each kernel set (the repacked and
//! interleaved layouts decode too: the CPU model's embedding rows). CUDA: `ops::dequantize`
//! for the formats it has, and `ops::embedding_gather` over the table as the loader uploads
//! it (f32 and bf16 tables as stored, so f32 -> bf16 and bf16 -> f32 gathers run too), with
//! an out-of-vocabulary id whose row must come back as NaN.

use half::bf16;
use pagoda_cuda::{DeviceBuffer, Gpu};
use pagoda_ops::cuda::{self as ops, QuantFormat};
use pagoda_ops::linear::Weight;
use pagoda_tensor::GgmlType;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::linear::{dequantized, quant_format, upload_weight, weight_bytes, FORMATS};
use crate::framework::{one, with_dtype, Backend, Expected, Family, OpCase, Output};
use crate::gpu_common::{download, poisoned, rng, upload, TestFloat};

pub fn cases() -> Vec<Box<dyn OpCase>> {
    let mut cases: Vec<Box<dyn OpCase>> = Vec::new();
    for (index, ty) in FORMATS.into_iter().enumerate() {
        // 9 rows of 1024: 36 K-quant blocks, 288 blocks of 32 values.
        let seed = 200 + index as u64;
        cases.push(Box::new(Rows::new(
            "dequantize",
            ty,
            (9, 1024),
            vec![],
            seed,
        )));
        // Float tables at a width no block divides.
        let hidden = if ty.is_quantized() { 256 } else { 96 };
        let ids = vec![0, 299, 17, 17, 5];
        let seed = 220 + index as u64;
        cases.push(Box::new(Rows::new(
            "embedding",
            ty,
            (300, hidden),
            ids,
            seed,
        )));
    }
    cases
}

/// Flips the sign of the f16 scales (and mins) of about a third of the blocks of the formats
/// the GPU decodes, so that their decoders see negative scales too.
fn negate_some_scales(ty: GgmlType, bytes: &mut [u8], rng: &mut ChaCha8Rng) {
    let Some(format) = quant_format(ty) else {
        return;
    };
    let half_offsets: &[usize] = match format {
        QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q8_0 => &[0],
        QuantFormat::Q4_1 | QuantFormat::Q5_1 | QuantFormat::Q4K | QuantFormat::Q5K => &[0, 2],
        QuantFormat::Q6K => &[208],
    };
    for block in bytes.chunks_mut(format.block_bytes()) {
        for &offset in half_offsets {
            if rng.random_bool(0.3) {
                block[offset + 1] ^= 0x80;
            }
        }
    }
}

/// The rows `ids` of a `[rows, cols]` weight of `ty` (every row, in order, for
/// "dequantize").
struct Rows {
    op: &'static str,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    ids: Vec<u32>,
    bytes: Vec<u8>,
    values: Vec<f32>,
}

impl Rows {
    fn new(
        op: &'static str,
        ty: GgmlType,
        (rows, cols): (usize, usize),
        ids: Vec<u32>,
        seed: u64,
    ) -> Rows {
        let mut rng = rng(seed);
        let mut bytes = weight_bytes(ty, rows, cols, &mut rng);
        negate_some_scales(ty, &mut bytes, &mut rng);
        let ids = if ids.is_empty() {
            (0..rows as u32).collect()
        } else {
            ids
        };
        Rows {
            op,
            ty,
            rows,
            cols,
            ids,
            values: dequantized(ty, rows, cols, &bytes),
            bytes,
        }
    }

    fn gathered(&self) -> Vec<f32> {
        let row = |&id: &u32| &self.values[id as usize * self.cols..][..self.cols];
        self.ids.iter().flat_map(row).copied().collect()
    }

    /// `embedding_gather` from a `TTable` table into `T` rows, with one more id past the
    /// vocabulary: its row is returned as zeros if it came back as NaN, as itself otherwise.
    fn gather<TTable: TestFloat, T: TestFloat>(
        &self,
        gpu: &Gpu,
        table: &DeviceBuffer<TTable>,
    ) -> Vec<f32> {
        self.gather_with(gpu, |ids, out: &mut DeviceBuffer<T>| {
            ops::embedding_gather(gpu, table, ids, out, self.rows, self.cols).unwrap()
        })
    }

    /// Runs a gather of `self.ids` and one id past the vocabulary into `T` rows (see
    /// [`Rows::gather`]).
    fn gather_with<T: TestFloat>(
        &self,
        gpu: &Gpu,
        gather: impl FnOnce(&DeviceBuffer<u32>, &mut DeviceBuffer<T>),
    ) -> Vec<f32> {
        let mut ids = self.ids.clone();
        ids.push(self.rows as u32 + 100);
        let mut out = poisoned::<T>(gpu, ids.len() * self.cols);
        let ids = gpu.upload(&ids).unwrap();
        gather(&ids, &mut out);
        let mut values = download(gpu, &out);
        let past_vocabulary = &mut values[self.ids.len() * self.cols..];
        if past_vocabulary.iter().all(|v| v.is_nan()) {
            past_vocabulary.fill(0.0);
        }
        values
    }
}

impl OpCase for Rows {
    fn op(&self) -> &'static str {
        self.op
    }

    fn shape(&self) -> String {
        let ids = if self.op == "embedding" {
            format!(" ids {:?}", self.ids)
        } else {
            String::new()
        };
        format!("{} [{}, {}]{ids}", self.ty.name(), self.rows, self.cols)
    }

    fn family(&self) -> Family {
        Family::Weights
    }

    fn reference(&self, backend: &Backend<'_>) -> Expected {
        let mut values = self.gathered();
        if let Backend::Cuda(_, dtype) = backend {
            values = dtype.round(&values);
            if self.op == "embedding" {
                values.extend(vec![0.0; self.cols]);
            }
        }
        Expected::relative(values)
    }

    fn run(&self, backend: &Backend<'_>) -> Option<Vec<Output>> {
        match backend {
            Backend::CpuLinear(set) => {
                let weight =
                    Weight::with_kernels(self.ty, self.rows, self.cols, self.bytes.clone(), *set)
                        .unwrap();
                let mut values = vec![f32::NAN; self.ids.len() * self.cols];
                for (&id, out) in self.ids.iter().zip(values.chunks_mut(self.cols)) {
                    weight.dequantize_row(id as usize, out);
                }
                one(values)
            }
            Backend::Cuda(gpu, dtype) if self.op == "dequantize" => {
                let format = quant_format(self.ty)?;
                with_dtype!(*dtype, T => {
                    let mut out = poisoned::<T>(gpu, self.values.len());
                    let blocks = gpu.upload(&self.bytes).unwrap();
                    ops::dequantize(gpu, format, &blocks, &mut out).unwrap();
                    one(download(gpu, &out))
                })
            }
            Backend::Cuda(gpu, dtype) => with_dtype!(*dtype, T => one(match self.ty {
                GgmlType::F32 => self.gather::<f32, T>(gpu, &upload::<f32>(gpu, &self.values)),
                GgmlType::BF16 => self.gather::<bf16, T>(gpu, &upload::<bf16>(gpu, &self.values)),
                ty => {
                    let table = upload_weight::<T>(gpu, ty, &self.bytes, &self.values);
                    let dense = Output { variant: String::new(), values: self.gather::<T, T>(gpu, &table) };
                    let Some(format) = quant_format(ty) else {
                        return Some(vec![dense]);
                    };
                    // The table kept in its blocks: rows decoded as they are gathered.
                    let blocks = gpu.upload(&self.bytes).unwrap();
                    let gathered = self.gather_with(gpu, |ids, out: &mut DeviceBuffer<T>| {
                        let shape = (self.rows, self.cols);
                        ops::gather_dequantized(gpu, format, &blocks, ids, out, shape).unwrap()
                    });
                    return Some(vec![dense, Output { variant: "blocks".into(), values: gathered }]);
                }
            })),
            _ => None,
        }
    }

    fn tolerance(&self, _: &Backend<'_>) -> f64 {
        // Bit-exact decoders and copies.
        0.0
    }
}
