//! The small-batch linear layer over GGUF blocks in place (`gemv_quant.cu`): the activation
//! rows are quantized to 8 bits per 32 values once ([`quantize_rows_q8`], as ggml's q8_1),
//! then every weight matrix of that input multiplies them as integer dots of four bytes with
//! the blocks' scales applied per group ([`gemv_quant`]), reading each weight byte once per
//! eight rows.

use super::QuantFormat;
use pagoda_cuda::{
    check_len, ptr, to_u32, view, view_mut, CudaError, DType, DeviceBuffer, DeviceRead,
    DeviceWrite, Element, Gpu, KernelArg, KernelSource, KernelSpec, LaunchDims,
};

/// The CUDA source of the quantized small-batch kernels and their activation quantizer.
pub(crate) static GEMV_QUANT: KernelSource = KernelSource::new(
    "gemv_quant.cu",
    concat!(
        include_str!("q8_block.cu"),
        include_str!("quant_decode.cu"),
        include_str!("gemv_quant.cu"),
        include_str!("gemv_quant_units.cu")
    ),
);

/// Activation rows one `gemv_quant` launch takes; more rows run in launches of this many.
pub const QUANT_GEMV_MAX_ROWS: usize = 8;

/// Bytes a quantized weight buffer carries past its last block: the kernel reads whole
/// aligned words around blocks of 18, 22, 34 or 210 bytes, up to 4 bytes past a block's end.
pub const QUANT_PADDING: usize = 16;

/// The layout of the in-place kernel (`PAGODA_CUDA_QUANT_GEMV_KERNEL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantGemvKernel {
    /// `gemv_quant`: a CTA per one or two weight rows, a thread per 32-value group (a K-quant
    /// group loads its header and 32 bytes, of which it uses the 16 of its nibble).
    Groups,
    /// `gemv_quant_units`: a warp per `warp_rows` weight rows (1, 2 or 4; `None`: four from
    /// four activation rows on except for Q6_K, else two), each activation load shared by the
    /// warp's rows; a K-quant lane takes 64 values (both nibbles of the 32 bytes it loads, the
    /// header once), a lane of the 32-value formats one block.
    Units { warp_rows: Option<usize> },
}

impl QuantGemvKernel {
    /// `Units` with its rule for the rows of a warp (the default).
    pub const UNITS: QuantGemvKernel = QuantGemvKernel::Units { warp_rows: None };
}

impl Default for QuantGemvKernel {
    /// `Groups`: measured faster than `Units` end to end (8B Q4_K_M on the H100).
    fn default() -> Self {
        QuantGemvKernel::Groups
    }
}

/// Weight rows a warp of `gemv_quant_units` owns (`WROWS`) for `format` and `m_tile` rows.
fn warp_rows(warp_rows: Option<usize>, format: QuantFormat, m_tile: usize) -> usize {
    match warp_rows {
        Some(rows) => rows,
        None if m_tile >= 4 && format != QuantFormat::Q6K => 4,
        None => 2,
    }
}

/// `(weight rows, threads)` of a CTA of the in-place `kernel` for `format` and `m_tile` rows
/// (`ROWS` and `WARPS * 32` of `gemv_quant`; `UWARPS * WROWS` and `UWARPS * 32` of
/// `gemv_quant_units`).
fn cta_shape(kernel: QuantGemvKernel, format: QuantFormat, m_tile: usize) -> (usize, u32) {
    match kernel {
        QuantGemvKernel::Groups => (if m_tile == 1 { 1 } else { 2 }, 128),
        QuantGemvKernel::Units { warp_rows: rows } => (4 * warp_rows(rows, format, m_tile), 128),
    }
}

/// Activation rows quantized for [`gemv_quant`]: per 32-value block, 32 signed bytes and the
/// pair (scale, scale times the sum of the bytes).
pub struct Q8Rows {
    values: DeviceBuffer<i32>,
    scales: DeviceBuffer<f32>,
    capacity: (usize, usize),
    shape: (usize, usize),
    /// The split-k sums and tickets of the tensor-core kernel (`gemm_quant_mma`), when built
    /// for it ([`Q8Rows::with_splits`]: about 13 MB on a 132-SM GPU).
    pub(super) splits: Option<super::quant_splits::SplitScratch>,
}

impl Q8Rows {
    /// Room for up to `rows` rows of up to `width` values (a multiple of 32), for
    /// [`gemv_quant`] and the MoE's quantized experts.
    pub fn new(gpu: &Gpu, rows: usize, width: usize) -> Result<Q8Rows, CudaError> {
        let width = width.next_multiple_of(32);
        Ok(Q8Rows {
            values: gpu.zeros::<i32>((rows * width / 4).max(1))?,
            scales: gpu.zeros::<f32>((rows * width / 16).max(1))?,
            capacity: (rows, width),
            shape: (0, 0),
            splits: None,
        })
    }

    /// As [`Q8Rows::new`], with the split-k scratch [`super::gemm_quant_mma`] needs.
    pub fn with_splits(gpu: &Gpu, rows: usize, width: usize) -> Result<Q8Rows, CudaError> {
        Ok(Q8Rows {
            splits: Some(super::quant_splits::SplitScratch::new(gpu)?),
            ..Q8Rows::new(gpu, rows, width)?
        })
    }

    /// `(rows, width)` of the activations quantized last.
    pub fn shape(&self) -> (usize, usize) {
        self.shape
    }

    /// The bytes (four a word) and the `(d, d * sum)` pairs of the activations quantized
    /// last, for the kernels that read them besides [`gemv_quant`] (the MoE's quantized
    /// experts).
    pub(crate) fn buffers(&self) -> (&DeviceBuffer<i32>, &DeviceBuffer<f32>) {
        (&self.values, &self.scales)
    }

    /// The buffers a quantizer of `m` rows of `k` values (a multiple of 32) writes (the bytes,
    /// the `(d, d * sum)` pairs), the shape recorded for [`gemv_quant`].
    pub(crate) fn outputs(
        &mut self,
        (m, k): (usize, usize),
    ) -> Result<(&DeviceBuffer<i32>, &DeviceBuffer<f32>), CudaError> {
        if k % 32 != 0 || m > self.capacity.0 || k > self.capacity.1 {
            return Err(CudaError::invalid(format!(
                "q8 activations: [{m}, {k}] needs k a multiple of 32 and at most [{}, {}]",
                self.capacity.0, self.capacity.1
            )));
        }
        self.shape = (m, k);
        Ok((&self.values, &self.scales))
    }
}

/// The `quantize_q8_rows` specialisation for activations of dtype `input`.
pub fn specialize_quantize_q8(input: DType) -> Result<KernelSpec, CudaError> {
    if !matches!(input, DType::F32 | DType::BF16) {
        return Err(CudaError::invalid(format!(
            "q8 activations are quantized from f32 or bf16, not {input}"
        )));
    }
    Ok(KernelSpec {
        source: &GEMV_QUANT,
        entry: "quantize_q8_rows",
        params: vec![("FORMAT", 0), ("M_TILE", 1)],
        dtypes: vec![("T_IN", input), ("T_OUT", DType::F32)],
    })
}

/// The in-place specialisation of `format` for `rows` activation rows (1..=8, rounded up to a
/// power of two) writing `out` (f32 or bf16), in the layout `kernel`.
pub fn specialize_gemv_quant(
    kernel: QuantGemvKernel,
    format: QuantFormat,
    out: DType,
    rows: usize,
) -> Result<KernelSpec, CudaError> {
    check_specialization("quantized linear", out, rows, QUANT_GEMV_MAX_ROWS)?;
    let m_tile = rows.next_power_of_two();
    let mut params = vec![("FORMAT", format.code()), ("M_TILE", m_tile as i64)];
    let entry = match kernel {
        QuantGemvKernel::Groups => "gemv_quant",
        QuantGemvKernel::Units { warp_rows: rows } => {
            let rows = warp_rows(rows, format, m_tile);
            if !matches!(rows, 1 | 2 | 4) {
                return Err(CudaError::invalid(format!(
                    "quantized linear: a warp takes 1, 2 or 4 weight rows, not {rows}"
                )));
            }
            params.push(("WROWS", rows as i64));
            "gemv_quant_units"
        }
    };
    Ok(KernelSpec {
        source: &GEMV_QUANT,
        entry,
        params,
        dtypes: vec![("T_IN", DType::F32), ("T_OUT", out)],
    })
}

/// Quantizes `x [m, k]` (k a multiple of 32) into `q8` for [`gemv_quant`].
pub fn quantize_rows_q8<T: Element>(
    gpu: &Gpu,
    x: &impl DeviceRead<T>,
    q8: &mut Q8Rows,
    (m, k): (usize, usize),
) -> Result<(), CudaError> {
    let spec = specialize_quantize_q8(T::DTYPE)?;
    check_len("q8 activations x [m, k]", m * k, x.len())?;
    let (values, scales) = q8.outputs((m, k))?;
    let blocks = m * k / 32;
    if blocks == 0 {
        return Ok(());
    }
    let args = [
        ptr(x),
        ptr(values),
        ptr(scales),
        KernelArg::U32(to_u32("q8 blocks", blocks)?),
    ];
    let grid = (to_u32("q8 CTAs", blocks.div_ceil(8))?, 1);
    // SAFETY: arguments match `quantize_q8_rows`; the buffers hold m * k bytes and m * k / 16
    // floats (capacity checked above).
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, 256), &args) }
}

/// `out [m, n] = beta * out + x w^T` for the activations last quantized into `q8` (`[m, k]`)
/// against `w`: `n` rows of `k` values in `format`'s blocks, followed by [`QUANT_PADDING`]
/// bytes. Row `i` of the output starts at `i * ldo` (`ldo >= n`: a column slice of a wider
/// output). Launches of up to [`QUANT_GEMV_MAX_ROWS`] rows, each reading the weights once, in
/// the layout `kernel`.
#[allow(clippy::too_many_arguments)]
pub fn gemv_quant<TOut: Element>(
    gpu: &Gpu,
    kernel: QuantGemvKernel,
    format: QuantFormat,
    w: &impl DeviceRead<u8>,
    q8: &Q8Rows,
    out: &mut impl DeviceWrite<TOut>,
    n: usize,
    ldo: usize,
    beta: f32,
) -> Result<(), CudaError> {
    let (m, k) = q8.shape;
    check_quant_linear(&[(format, w.len(), n)], (m, k), ldo, out.len())?;
    for first in (0..m).step_by(QUANT_GEMV_MAX_ROWS) {
        let rows = (m - first).min(QUANT_GEMV_MAX_ROWS);
        let spec = specialize_gemv_quant(kernel, format, TOut::DTYPE, rows)?;
        let (cta_rows, threads) = cta_shape(kernel, format, rows.next_power_of_two());
        let grid = (to_u32("quantized linear CTAs", n.div_ceil(cta_rows))?, 1);
        let values = view(&q8.values, first * k / 4..m * k / 4)?;
        let scales = view(&q8.scales, first * k / 16..m * k / 16)?;
        let o = view_mut(out, first * ldo..(m - 1) * ldo + n)?;
        let args = [
            ptr(w),
            ptr(&values),
            ptr(&scales),
            ptr(&o),
            KernelArg::U32(to_u32("m", rows)?),
            KernelArg::U32(to_u32("n", n)?),
            KernelArg::U32(to_u32("k", k)?),
            KernelArg::U32(to_u32("ldo", ldo)?),
            KernelArg::F32(beta),
        ];
        // SAFETY: arguments match `gemv_quant`; the weights hold n padded rows of k values,
        // the activations `rows` rows of k, the output (rows - 1) * ldo + n values.
        unsafe { gpu.launch(&spec, LaunchDims::new(grid, threads), &args)? };
    }
    Ok(())
}

/// Checks that a quantized kernel (`what`) of at most `max_rows` rows a launch can write
/// `out` (f32 or bf16) for a launch of `rows` rows.
pub(super) fn check_specialization(
    what: &str,
    out: DType,
    rows: usize,
    max_rows: usize,
) -> Result<(), CudaError> {
    if !matches!(out, DType::F32 | DType::BF16) {
        return Err(CudaError::invalid(format!(
            "{what} writes f32 or bf16, not {out}"
        )));
    }
    if !(1..=max_rows).contains(&rows) {
        return Err(CudaError::invalid(format!(
            "{what} takes 1..={max_rows} rows a launch, not {rows}"
        )));
    }
    Ok(())
}

/// Checks a quantized linear layer over the stacked `parts` (format, padded bytes, rows) of
/// `m` activation rows of `k` values into an output of `out_len` values, rows `ldo` apart.
pub(super) fn check_quant_linear(
    parts: &[(QuantFormat, usize, usize)],
    (m, k): (usize, usize),
    ldo: usize,
    out_len: usize,
) -> Result<(), CudaError> {
    let n: usize = parts.iter().map(|p| p.2).sum();
    let names: Vec<String> = parts.iter().map(|p| p.0.to_string()).collect();
    let block = parts.iter().map(|p| p.0.block_values()).max().unwrap_or(32);
    if parts.iter().any(|p| p.2 == 0) || m == 0 || k % block != 0 || ldo < n {
        return Err(CudaError::invalid(format!(
            "quantized linear {}: needs rows in every part, m >= 1, k a multiple of {block} \
             and ldo >= n (have m {m} n {n} k {k} ldo {ldo})",
            names.join(" + ")
        )));
    }
    for (index, &(format, bytes, rows)) in parts.iter().enumerate() {
        check_len(
            &format!("quantized linear part {index} (bytes, padded)"),
            rows * format.row_bytes(k) + QUANT_PADDING,
            bytes,
        )?;
    }
    if out_len < (m - 1) * ldo + n {
        return Err(CudaError::invalid(format!(
            "quantized linear out [{m}, {n}] with row stride {ldo} needs {} elements, has \
             {out_len}",
            (m - 1) * ldo + n
        )));
    }
    Ok(())
}

/// The pairs of formats `gemv_quant_pair` is compiled for (`(first part, second part)`): the
/// stacked QKV of a Q4_K_M or Q5_K_M file, whose v is Q6_K in the layers llama.cpp gives more
/// bits.
pub const QUANT_PAIRS: [(QuantFormat, QuantFormat); 2] = [
    (QuantFormat::Q4K, QuantFormat::Q6K),
    (QuantFormat::Q5K, QuantFormat::Q6K),
];

/// The `gemv_quant_pair` specialisation of parts `(a, b)` (one of [`QUANT_PAIRS`]) for `rows`
/// activation rows writing `out`, in the `Groups` layout.
pub fn specialize_gemv_quant_pair(
    (a, b): (QuantFormat, QuantFormat),
    out: DType,
    rows: usize,
) -> Result<KernelSpec, CudaError> {
    if !QUANT_PAIRS.contains(&(a, b)) {
        return Err(CudaError::invalid(format!(
            "quantized linear: no kernel for the parts {a} then {b} in one launch"
        )));
    }
    let mut spec = specialize_gemv_quant(QuantGemvKernel::Groups, a, out, rows)?;
    spec.entry = "gemv_quant_pair";
    spec.params.push(("FORMAT_B", b.code()));
    Ok(spec)
}

/// One part of a stacked quantized matrix: its format, its blocks (padded by
/// [`QUANT_PADDING`] bytes) and its row count.
pub type QuantPartRef<'a, W> = (QuantFormat, &'a W, usize);

/// [`gemv_quant`] over two stacked parts of the formats of one of [`QUANT_PAIRS`] in one
/// launch per [`QUANT_GEMV_MAX_ROWS`] rows (`Groups` layout): `a`'s rows into output columns
/// `0..n_a`, `b`'s into `n_a..n_a + n_b`, row `i` of the output at `i * ldo`; the same bits as
/// the two launches.
pub fn gemv_quant_pair<TOut: Element, W: DeviceRead<u8>>(
    gpu: &Gpu,
    (format_a, w_a, n_a): QuantPartRef<'_, W>,
    (format_b, w_b, n_b): QuantPartRef<'_, W>,
    q8: &Q8Rows,
    out: &mut impl DeviceWrite<TOut>,
    ldo: usize,
    beta: f32,
) -> Result<(), CudaError> {
    let (m, k) = q8.shape;
    let n = n_a + n_b;
    let parts = [(format_a, w_a.len(), n_a), (format_b, w_b.len(), n_b)];
    check_quant_linear(&parts, (m, k), ldo, out.len())?;
    for first in (0..m).step_by(QUANT_GEMV_MAX_ROWS) {
        let rows = (m - first).min(QUANT_GEMV_MAX_ROWS);
        let spec = specialize_gemv_quant_pair((format_a, format_b), TOut::DTYPE, rows)?;
        let (cta_rows, threads) =
            cta_shape(QuantGemvKernel::Groups, format_a, rows.next_power_of_two());
        let ctas = n_a.div_ceil(cta_rows) + n_b.div_ceil(cta_rows);
        let grid = (to_u32("quantized linear CTAs", ctas)?, 1);
        let values = view(&q8.values, first * k / 4..m * k / 4)?;
        let scales = view(&q8.scales, first * k / 16..m * k / 16)?;
        let o = view_mut(out, first * ldo..(m - 1) * ldo + n)?;
        let args = [
            ptr(w_a),
            ptr(w_b),
            ptr(&values),
            ptr(&scales),
            ptr(&o),
            KernelArg::U32(to_u32("m", rows)?),
            KernelArg::U32(to_u32("n_a", n_a)?),
            KernelArg::U32(to_u32("n_b", n_b)?),
            KernelArg::U32(to_u32("k", k)?),
            KernelArg::U32(to_u32("ldo", ldo)?),
            KernelArg::F32(beta),
        ];
        // SAFETY: arguments match `gemv_quant_pair`; each part holds its padded rows of k
        // values, the activations `rows` rows of k, the output (rows - 1) * ldo + n values.
        unsafe { gpu.launch(&spec, LaunchDims::new(grid, threads), &args)? };
    }
    Ok(())
}

/// The `dequant_groups` specialisation of `format` writing `out` (f32 or bf16).
pub fn specialize_dequant_groups(format: QuantFormat, out: DType) -> Result<KernelSpec, CudaError> {
    let mut spec = specialize_gemv_quant(QuantGemvKernel::Groups, format, out, 1)?;
    spec.entry = "dequant_groups";
    Ok(spec)
}

/// `out [n, k]` decoded from `w`'s `n` rows of `format` blocks (followed by
/// [`QUANT_PADDING`] bytes, or not), for the GEMM of a batch too large for [`gemv_quant`]:
/// one thread per 32 values, each value `dw * q + mw` rounded once to `T` (within one
/// rounding of the bit-exact [`super::dequantize`]).
pub fn dequantize_fast<T: Element>(
    gpu: &Gpu,
    format: QuantFormat,
    w: &impl DeviceRead<u8>,
    out: &mut impl DeviceWrite<T>,
    (n, k): (usize, usize),
) -> Result<(), CudaError> {
    let spec = specialize_dequant_groups(format, T::DTYPE)?;
    if k % format.block_values() != 0 {
        return Err(CudaError::invalid(format!(
            "dequantize {format}: k {k} is not a whole number of {}-value blocks",
            format.block_values()
        )));
    }
    let bytes = n * format.row_bytes(k);
    if w.len() != bytes && w.len() != bytes + QUANT_PADDING {
        check_len("dequantize blocks (bytes)", bytes, w.len())?;
    }
    check_len("dequantize out [n, k]", n * k, out.len())?;
    let groups = n * k / 32;
    if groups == 0 {
        return Ok(());
    }
    let args = [
        ptr(w),
        ptr(out),
        KernelArg::U64(groups as u64),
        KernelArg::U32(to_u32("k", k)?),
    ];
    let grid = (to_u32("dequantize CTAs", groups.div_ceil(256))?, 1);
    // SAFETY: arguments match `dequant_groups`; the blocks hold n rows of k values (checked),
    // the output n * k values.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, 256), &args) }
}

/// Every specialisation the quantized small-batch launchers can request.
pub fn specializations() -> Result<Vec<KernelSpec>, CudaError> {
    let mut specs = vec![
        specialize_quantize_q8(DType::F32)?,
        specialize_quantize_q8(DType::BF16)?,
    ];
    for format in QuantFormat::ALL {
        for out in [DType::F32, DType::BF16] {
            for rows in [1, 2, 4, 8] {
                // (`UNITS` picks one of these.)
                for kernel in [
                    QuantGemvKernel::Groups,
                    QuantGemvKernel::Units { warp_rows: Some(1) },
                    QuantGemvKernel::Units { warp_rows: Some(2) },
                    QuantGemvKernel::Units { warp_rows: Some(4) },
                ] {
                    specs.push(specialize_gemv_quant(kernel, format, out, rows)?);
                }
            }
            specs.push(specialize_dequant_groups(format, out)?);
        }
    }
    for pair in QUANT_PAIRS {
        for out in [DType::F32, DType::BF16] {
            for rows in [1, 2, 4, 8] {
                specs.push(specialize_gemv_quant_pair(pair, out, rows)?);
            }
        }
    }
    Ok(specs)
}
