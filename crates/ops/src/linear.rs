//! Linear layers: `y = W x` for a batch of activation rows, with `W` stored in any supported
//! GGML format.
//!
//! Contract: `x` is `[num_tokens, in_features]` row-major f32, `W` is `[out_features,
//! in_features]` (one stored row per output feature), `y` is `[num_tokens, out_features]`
//! and is overwritten. Work is split over output rows with rayon; each worker decodes a
//! weight row at most once per call, so prefill (many tokens) amortises the decode.
//!
//! Which kernels run is chosen once per process and per weight ([`CpuKernelPolicy::selected`],
//! `PAGODA_CPU_KERNELS`; `auto`, the default, gives every weight the best integer set, with
//! `ffn_down` on Q15 activations or the f32 kernels, see [`kernels`]): with an integer set,
//! Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K weights are repacked when the [`Weight`] is built
//! ([`pagoda_tensor::quant::repack`]) and each matmul quantizes its input rows once to Q8
//! (Q15 for a weight built [`Weight::with_q15_activations`]; [`cpu::int_matmul`]); with `f32` (and for F32/F16/BF16 weights) blocks are decoded to
//! f32 and multiplied with f32 activations: in registers, eight rows at a time, for up to
//! eight tokens ([`crate::linear::cpu::f32_decode`]), or into whole rows per task for more.
//!
//! Batch invariance: row `t` of `y` is bit-identical whatever `num_tokens` is and whatever the
//! other rows of `x` hold, except where prefills run on the AMX-BF16 tiles ([`batch_invariant`]). With f32 activations every element follows the one recipe of
//! [`crate::linear::cpu::f32_tile`] in every tile shape; with Q8 activations each token is quantized
//! on its own and every integer tile runs the same per-(row, token) chain (see
//! [`crate::linear::cpu::int_dot`]).

pub mod cpu;
pub mod cuda;

pub use cpu::kernels::{
    cpu_kernels_name, CpuKernelPolicy, CpuKernels, FfnDown, CPU_KERNELS_ENV_VAR,
};
pub use cpu::shared::matmul_shared;
use cpu::tasks::by_row_tasks;

use pagoda_tensor::quant::repack::repack;
use pagoda_tensor::{quant, GgmlType, UnsupportedType};
use rayon::prelude::*;

use cpu::amx::{self, TileBackend};
use cpu::f32_decode::{self, F32Decode, WIDE_ROWS};
use cpu::f32_tile::{self, quantized_tile, tile};
use cpu::int_dot::IntIsa;
use cpu::int_matmul::{self, IntRows};
use cpu::interleaved::Interleaved;

/// Rows per decode step (one token): each weight row is an independent accumulator chain, so
/// several rows keep the FMA units busy.
const DECODE_ROWS: usize = 2;

/// Token counts up to which f32-activation matmuls decode each row group once in registers
/// for all tokens ([`Weight::matmul_small_batch`]) instead of into memory (the prefill path).
const SMALL_BATCH: usize = 8;

/// Rows per task of the one-token and small-batch f32 paths over `n` rows: about 16 tasks per
/// thread, at least 16 and at most 1024 rows, a multiple of [`WIDE_ROWS`].
fn wide_rows_per_task(n: usize) -> usize {
    (n / (rayon::current_num_threads() * 16))
        .clamp(16, 1024)
        .next_multiple_of(WIDE_ROWS)
}

/// Whether row `t` of every matmul is bit-identical whatever the batch (see the module docs):
/// false only where the `amx` set's prefills run on the AMX-BF16 tiles
/// ([`amx::bf16::AmxPrefill`]), whose sums are not the decode kernels'.
pub fn batch_invariant() -> bool {
    // `selected` gives BF16 only where the tiles run.
    !(CpuKernels::selected() == CpuKernels::Amx
        && amx::bf16::AmxPrefill::selected() == amx::bf16::AmxPrefill::Bf16)
}

/// A weight matrix `[out_features, in_features]` in its storage format.
#[derive(Debug, Clone)]
pub struct Weight {
    ty: GgmlType,
    out_features: usize,
    in_features: usize,
    storage: Storage,
    row_bytes: usize,
    /// Whether the integer matmul quantizes activations to Q15 instead of Q8
    /// ([`Weight::with_q15_activations`]).
    q15: bool,
}

/// The rows as stored: f32 values are kept typed (aligned, no reinterpretation); every other
/// format keeps its raw blocks, `out_features * row_bytes` bytes, or is repacked for the
/// integer kernels of one instruction set.
#[derive(Debug, Clone)]
enum Storage {
    F32(Vec<f32>),
    Blocks(Vec<u8>),
    Repacked(IntRows, IntIsa),
}

/// Why a weight could not be built.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error(transparent)]
    Unsupported(#[from] UnsupportedType),
    #[error("weight of type {ty} has {got} bytes, expected {expected} for [{rows}, {cols}]")]
    Size {
        ty: GgmlType,
        rows: usize,
        cols: usize,
        got: usize,
        expected: usize,
    },
}

impl Weight {
    /// Wraps stored rows for the process-wide kernel set of weights without a per-weight
    /// exception ([`CpuKernels::selected`]); a loader that knows the tensor's name should
    /// call [`Weight::with_kernels`] with [`CpuKernels::for_tensor`]. Fails when the type
    /// cannot be decoded or the byte count is wrong.
    pub fn new(
        ty: GgmlType,
        out_features: usize,
        in_features: usize,
        data: Vec<u8>,
    ) -> Result<Weight, WeightError> {
        Weight::with_kernels(ty, out_features, in_features, data, CpuKernels::selected())
    }

    /// Wraps stored rows for `kernels`: with an integer set the rows are repacked now (the
    /// raw blocks are dropped) when the type has a repacked form; otherwise they are kept as
    /// stored. Fails when the type cannot be decoded or the byte count is wrong.
    pub fn with_kernels(
        ty: GgmlType,
        out_features: usize,
        in_features: usize,
        data: Vec<u8>,
        kernels: CpuKernels,
    ) -> Result<Weight, WeightError> {
        if !ty.is_dequantizable() {
            return Err(UnsupportedType { ty }.into());
        }
        let size_error = || WeightError::Size {
            ty,
            rows: out_features,
            cols: in_features,
            got: data.len(),
            expected: ty
                .bytes_for(in_features)
                .unwrap_or(0)
                .saturating_mul(out_features),
        };
        let row_bytes = ty.bytes_for(in_features).ok_or_else(size_error)?;
        if row_bytes.checked_mul(out_features) != Some(data.len()) {
            return Err(size_error());
        }
        let storage = if ty == GgmlType::F32 {
            Storage::F32(
                data.chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            )
        } else {
            match kernels.int_isa() {
                Some(isa) => match repack(ty, out_features, in_features, &data) {
                    Some(rows) if matches!(kernels, CpuKernels::Vnni8 | CpuKernels::Amx) => {
                        Storage::Repacked(IntRows::Interleaved(Interleaved::new(&rows)), isa)
                    }
                    Some(rows) => Storage::Repacked(IntRows::Rows(rows), isa),
                    None => Storage::Blocks(data),
                },
                None => Storage::Blocks(data),
            }
        };
        Ok(Weight {
            ty,
            out_features,
            in_features,
            storage,
            row_bytes,
            q15: false,
        })
    }

    /// This weight with its activations quantized to Q15 rather than Q8 when `on` and its
    /// kernels take Q15 rows: the interleaved layout of the `vnni8` and `amx` sets (see
    /// [`pagoda_tensor::quant::q8`]: 128 times finer steps, two integer dots per block). Any
    /// other weight is returned unchanged.
    pub fn with_q15_activations(mut self, on: bool) -> Weight {
        self.q15 = on && matches!(self.storage, Storage::Repacked(IntRows::Interleaved(_), _));
        self
    }

    /// The interleaved rows a matmul of `num_tokens` tokens runs on the AMX-BF16 tiles, if it
    /// does: the `amx` set's prefills (at least [`amx::bf16::MIN_TOKENS`] tokens) where those tiles
    /// run and are selected ([`amx::bf16::AmxPrefill`]), except for weights with sub-scales.
    /// Q15 weights (`ffn_down`, whose input has the widest range) take it with split
    /// activations ([`amx::bf16::matmul_split`]) unless `PAGODA_CPU_AMX_BF16_Q15=int8`: with
    /// one bf16 term there, one chosen-token logprob of the llama.cpp parity test moved past
    /// 0.4.
    pub(crate) fn bf16_tiles(&self, num_tokens: usize) -> Option<&Interleaved> {
        match &self.storage {
            Storage::Repacked(IntRows::Interleaved(rows), IntIsa::Amx)
                if num_tokens >= amx::bf16::MIN_TOKENS
                    && (!self.q15 || amx::bf16::split_q15())
                    && !rows.has_sub_scales()
                    && amx::bf16::AmxPrefill::selected() == amx::bf16::AmxPrefill::Bf16 =>
            {
                Some(rows)
            }
            _ => None,
        }
    }

    /// Whether the integer matmul quantizes activations to Q15 ([`Weight::with_q15_activations`]).
    pub fn q15_activations(&self) -> bool {
        self.q15
    }

    /// An f32 weight from values laid out `[out_features, in_features]`.
    pub fn from_f32(out_features: usize, in_features: usize, values: &[f32]) -> Weight {
        assert_eq!(
            values.len(),
            out_features * in_features,
            "weight shape mismatch"
        );
        Weight {
            ty: GgmlType::F32,
            out_features,
            in_features,
            storage: Storage::F32(values.to_vec()),
            row_bytes: in_features * 4,
            q15: false,
        }
    }

    /// The same matrix dequantized to f32 (the exact mode's storage).
    pub fn to_f32(&self) -> Weight {
        if self.ty == GgmlType::F32 {
            return self.clone();
        }
        let mut values = vec![0f32; self.out_features * self.in_features];
        values
            .par_chunks_mut(self.in_features)
            .enumerate()
            .for_each(|(row, out)| self.dequantize_row(row, out));
        Weight::from_f32(self.out_features, self.in_features, &values)
    }

    /// Storage type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// Rows of the matrix.
    pub fn out_features(&self) -> usize {
        self.out_features
    }
    /// Columns of the matrix.
    pub fn in_features(&self) -> usize {
        self.in_features
    }
    /// Bytes held (the repacked layout when the weight was repacked).
    pub fn size_bytes(&self) -> usize {
        match &self.storage {
            Storage::Repacked(rows, _) => rows.size_bytes(),
            _ => self.row_bytes * self.out_features,
        }
    }

    /// The integer instruction set this weight's matmul uses, `None` for f32 activations.
    pub fn int_isa(&self) -> Option<IntIsa> {
        match &self.storage {
            Storage::Repacked(_, isa) => Some(*isa),
            _ => None,
        }
    }

    /// Decodes one row into `out` (`in_features` values).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        match &self.storage {
            Storage::F32(values) => {
                out.copy_from_slice(&values[row * self.in_features..(row + 1) * self.in_features])
            }
            Storage::Blocks(bytes) => {
                let bytes = &bytes[row * self.row_bytes..(row + 1) * self.row_bytes];
                // The eight-row kernel's block decoders where it runs: the values `dequantize`
                // writes, in registers instead of scalar code.
                let fast = self
                    .wide_kernel()
                    .is_some_and(|kernel| f32_decode::decode_row(kernel, self.ty, bytes, out));
                if !fast {
                    quant::dequantize(self.ty, bytes, out).expect("type checked at construction")
                }
            }
            Storage::Repacked(rows, _) => rows.dequantize_row(row, out),
        }
    }

    /// The dot product of row `row` with `x` (`in_features` values) in f32, bit-identical to
    /// element `row` of [`Weight::matmul`] for any token count when the weight takes f32
    /// activations ([`Weight::int_isa`] is `None`); a repacked row is decoded into a
    /// temporary and dotted by the same recipe (the integer matmul quantizes `x` instead).
    #[inline]
    pub fn dot_row(&self, row: usize, x: &[f32]) -> f32 {
        let k = self.in_features;
        match &self.storage {
            Storage::F32(values) => tile([&values[row * k..(row + 1) * k]], [x])[0][0],
            Storage::Blocks(bytes) => quantized_tile(
                self.ty,
                [&bytes[row * self.row_bytes..(row + 1) * self.row_bytes]],
                x,
            )[0],
            Storage::Repacked(rows, _) => {
                let mut values = vec![0f32; k];
                rows.dequantize_row(row, &mut values);
                tile([&values[..]], [x])[0][0]
            }
        }
    }

    /// `DECODE_ROWS` consecutive rows from `row_start` dotted with `x` (see [`Weight::dot_row`]).
    #[inline]
    fn dot_rows(&self, row_start: usize, x: &[f32]) -> [f32; DECODE_ROWS] {
        let k = self.in_features;
        match &self.storage {
            Storage::F32(values) => {
                let w: [&[f32]; DECODE_ROWS] =
                    std::array::from_fn(|r| &values[(row_start + r) * k..(row_start + r + 1) * k]);
                tile(w, [x]).map(|dots| dots[0])
            }
            Storage::Blocks(bytes) => {
                let row_bytes = self.row_bytes;
                let w: [&[u8]; DECODE_ROWS] = std::array::from_fn(|r| {
                    &bytes[(row_start + r) * row_bytes..(row_start + r + 1) * row_bytes]
                });
                quantized_tile(self.ty, w, x)
            }
            Storage::Repacked(..) => std::array::from_fn(|r| self.dot_row(row_start + r, x)),
        }
    }

    /// The eight-row f32 kernel this weight's one-token and small-batch matmuls take, if any:
    /// block storage of a type [`f32_decode::supports`], and a selected kernel other than
    /// `tile` that this CPU runs.
    fn wide_kernel(&self) -> Option<F32Decode> {
        let kernel = F32Decode::selected();
        (matches!(self.storage, Storage::Blocks(_))
            && f32_decode::supports(self.ty)
            && kernel != F32Decode::Tile
            && kernel.is_supported())
        .then_some(kernel)
    }

    /// `WIDE_ROWS` consecutive stored rows from `row_start` dotted with each of the `T`
    /// activation rows by [`f32_decode::rows8`] on `kernel` (the same bits as
    /// [`Weight::dot_row`]). Only with a kernel from [`Weight::wide_kernel`].
    #[inline]
    fn dot_rows_wide<const T: usize>(
        &self,
        kernel: F32Decode,
        row_start: usize,
        x: [&[f32]; T],
    ) -> [[f32; T]; WIDE_ROWS] {
        let Storage::Blocks(bytes) = &self.storage else {
            unreachable!("dot_rows_wide: the caller checked the storage")
        };
        let row_bytes = self.row_bytes;
        let row = |r: usize| &bytes[r * row_bytes..(r + 1) * row_bytes];
        let w: [&[u8]; WIDE_ROWS] = std::array::from_fn(|r| row(row_start + r));
        // Prefetched: the rows two groups on (measured best of 0, 8, 16 and 32 rows ahead).
        let ahead: [&[u8]; WIDE_ROWS] =
            std::array::from_fn(
                |r| row((row_start + r + 2 * WIDE_ROWS).min(self.out_features - 1)),
            );
        f32_decode::rows8(kernel, self.ty, w, ahead, x)
            .expect("dot_rows_wide: the caller checked the kernel")
    }

    /// `y[t, :] = W x[t, :]` for 2..=SMALL_BATCH tokens with the eight-row kernel: each group
    /// of rows is decoded in registers for up to four tokens at a time (again from L1 for the
    /// next four), where the prefill path would decode every row into memory first. Same bits
    /// as every other path.
    fn matmul_small_batch(&self, kernel: F32Decode, x: &[f32], num_tokens: usize, y: &mut [f32]) {
        let (n, k) = (self.out_features, self.in_features);
        let xs: Vec<&[f32]> = x.chunks_exact(k).collect();
        let rows_per_task = wide_rows_per_task(n);
        by_row_tasks(n, num_tokens, rows_per_task, y, |rows| {
            let (row_start, row_end, width) = (rows.start, rows.end, rows.len());
            let mut local = vec![0f32; width * num_tokens];
            let mut row = row_start;
            while row + WIDE_ROWS <= row_end {
                let out = &mut local[row - row_start..];
                for first in (0..num_tokens).step_by(4) {
                    match num_tokens - first {
                        1 => self.wide_group::<1>(kernel, row, &xs, first, out, width),
                        2 => self.wide_group::<2>(kernel, row, &xs, first, out, width),
                        3 => self.wide_group::<3>(kernel, row, &xs, first, out, width),
                        _ => self.wide_group::<4>(kernel, row, &xs, first, out, width),
                    }
                }
                row += WIDE_ROWS;
            }
            for row in row..row_end {
                for (t, x) in xs.iter().enumerate() {
                    local[t * width + row - row_start] = self.dot_row(row, x);
                }
            }
            local
        });
        f32_decode::count_wide_matmul();
    }

    /// The dots of `WIDE_ROWS` rows from `row` with tokens `first..first + T` of `xs`, into
    /// `out` (the task's token-major buffer from this group's first column; `width` values
    /// per token).
    #[inline]
    fn wide_group<const T: usize>(
        &self,
        kernel: F32Decode,
        row: usize,
        xs: &[&[f32]],
        first: usize,
        out: &mut [f32],
        width: usize,
    ) {
        let dots = self.dot_rows_wide::<T>(kernel, row, std::array::from_fn(|j| xs[first + j]));
        for (r, dots) in dots.iter().enumerate() {
            for (j, &value) in dots.iter().enumerate() {
                out[(first + j) * width + r] = value;
            }
        }
    }

    /// `y[t, :] = W x[t, :]` for every token `t`. See the module docs for the layout.
    pub fn matmul(&self, x: &[f32], num_tokens: usize, y: &mut [f32]) {
        let (n, k) = (self.out_features, self.in_features);
        assert_eq!(
            x.len(),
            num_tokens * k,
            "x must be [num_tokens, in_features]"
        );
        assert_eq!(
            y.len(),
            num_tokens * n,
            "y must be [num_tokens, out_features]"
        );
        if num_tokens == 0 {
            return;
        }
        if let Storage::Repacked(rows, isa) = &self.storage {
            if let Some(interleaved) = self.bf16_tiles(num_tokens) {
                // Q15 weights (`ffn_down`) take their wide-range input as two bf16 terms.
                let run = if self.q15 {
                    amx::bf16::matmul_split
                } else {
                    amx::bf16::matmul
                };
                let backend = amx::backend().unwrap_or(TileBackend::Hardware);
                if run(backend, interleaved, x, num_tokens, y).is_ok() {
                    return;
                }
            }
            int_matmul::with_scratch(|activations| {
                if self.q15 {
                    int_matmul::quantize_activations_q15(*isa, x, k, activations);
                    int_matmul::count_q15_matmul();
                } else {
                    int_matmul::quantize_activations(*isa, x, k, activations);
                }
                rows.matmul(*isa, activations, y);
            });
            return;
        }
        f32_tile::count_matmul();
        if num_tokens == 1 {
            // Decode: rows are streamed DECODE_ROWS (or WIDE_ROWS) at a time past the one
            // activation row, decoded block by block in registers (see `f32_tile` and
            // `f32_decode`: the same bits either way).
            let kernel = self.wide_kernel();
            let rows_per_task = wide_rows_per_task(n);
            y.par_chunks_mut(rows_per_task)
                .enumerate()
                .for_each(|(task, out)| {
                    let row_start = task * rows_per_task;
                    let mut done = 0;
                    if let Some(kernel) = kernel {
                        let mut groups = out.chunks_exact_mut(WIDE_ROWS);
                        for values in &mut groups {
                            let dots = self.dot_rows_wide(kernel, row_start + done, [x]);
                            values.copy_from_slice(&dots.map(|dot| dot[0]));
                            done += WIDE_ROWS;
                        }
                    }
                    let mut groups = out[done..].chunks_exact_mut(DECODE_ROWS);
                    for values in &mut groups {
                        values.copy_from_slice(&self.dot_rows(row_start + done, x));
                        done += DECODE_ROWS;
                    }
                    for value in groups.into_remainder() {
                        *value = self.dot_row(row_start + done, x);
                        done += 1;
                    }
                });
            if kernel.is_some() {
                f32_decode::count_wide_matmul();
            }
            return;
        }
        if let Some(kernel) = self.wide_kernel().filter(|_| num_tokens <= SMALL_BATCH) {
            self.matmul_small_batch(kernel, x, num_tokens, y);
            return;
        }
        // Prefill: each task decodes a block of rows once into a local buffer (f32 rows are
        // used in place) and multiplies it with every token, two rows by four tokens at a
        // time. The block is small enough to stay in L2 while the activations stream past it.
        // Every element follows the one recipe of `f32_tile`, so the tiling does not change
        // any bit (see the module docs).
        let rows_per_task = (n / (rayon::current_num_threads() * 8)).clamp(2, 16) & !1;
        // With the `avx512` f32 kernel (`PAGODA_CPU_F32_DECODE`; `avx2` or `tile` turn it
        // off), four rows by four tokens at a time, two tokens' accumulators per 512-bit
        // register (`f32_tile::tile_pairs`, the same bits).
        let pairs = (F32Decode::selected() == F32Decode::Avx512
            && f32_tile::pairs_supported()
            && num_tokens >= 4)
            .then(|| {
                f32_tile::count_pair_matmul();
                f32_tile::TokenPairs::new(x, k)
            });
        by_row_tasks(n, num_tokens, rows_per_task, y, |row_range| {
            let (row_start, rows) = (row_range.start, row_range.len());
            let decoded = match &self.storage {
                Storage::F32(_) => Vec::new(),
                _ => {
                    let mut decoded = vec![0f32; rows * k];
                    for (r, out) in decoded.chunks_exact_mut(k).enumerate() {
                        self.dequantize_row(row_start + r, out);
                    }
                    decoded
                }
            };
            let w = |r: usize| match &self.storage {
                Storage::F32(values) => &values[(row_start + r) * k..(row_start + r + 1) * k],
                _ => &decoded[r * k..(r + 1) * k],
            };
            let xt = |t: usize| &x[t * k..(t + 1) * k];
            let mut local = vec![0f32; rows * num_tokens];
            let full_tokens = num_tokens / 4 * 4;
            let full_rows = rows / 2 * 2;
            // Tokens outer, rows inner: four activation rows stay in L1 while the task's
            // decoded rows (in L2) pass them, instead of all the activations streaming
            // from L3 once per row pair.
            let mut put = |r: usize, t: usize, values: &[f32]| {
                for (j, &value) in values.iter().enumerate() {
                    local[(t + j) * rows + r] = value;
                }
            };
            for t in (0..full_tokens).step_by(4) {
                let xs = [xt(t), xt(t + 1), xt(t + 2), xt(t + 3)];
                let mut r = 0;
                if let Some(pairs) = &pairs {
                    while r + 4 <= rows {
                        let rows4 = [w(r), w(r + 1), w(r + 2), w(r + 3)];
                        let block = f32_tile::tile_pairs(rows4, pairs, t / 2, xs);
                        for (i, values) in block.iter().enumerate() {
                            put(r + i, t, values);
                        }
                        r += 4;
                    }
                }
                for r in (r..full_rows).step_by(2) {
                    let block = tile([w(r), w(r + 1)], xs);
                    put(r, t, &block[0]);
                    put(r + 1, t, &block[1]);
                }
                for r in full_rows..rows {
                    put(r, t, &tile([w(r)], xs)[0]);
                }
            }
            for t in full_tokens..num_tokens {
                for r in (0..full_rows).step_by(2) {
                    let block = tile([w(r), w(r + 1)], [xt(t)]);
                    put(r, t, &block[0]);
                    put(r + 1, t, &block[1]);
                }
                for r in full_rows..rows {
                    put(r, t, &tile([w(r)], [xt(t)])[0]);
                }
            }
            local
        });
    }
}
