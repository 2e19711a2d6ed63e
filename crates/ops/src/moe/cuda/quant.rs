//! The routed experts kept in their GGUF blocks (`PAGODA_CUDA_MOE_QUANT`): `moe_quant.cu`'s
//! `moe_quant_gate_up` and `moe_quant_down` over the routing tiles of
//! [`moe_route`](super::moe_route), the weights decoded in registers by the dense quantized
//! GEMV's decoder (`linear/cuda/quant_decode.cu`) against q8 activations
//! ([`quantize_rows_q8`]: the step's rows before gate/up, the intermediates before down); the
//! combine is [`moe_combine`]'s. Steps of up to [`MOE_PER_ROW_MAX_ROWS`] rows run a CTA row
//! per routed entry (`moe_quant_gate_up_rows`, `moe_quant_down_rows`: no CTAs of empty tiles),
//! the same sums. The q8 activations make it differ from the dequantized experts by the dense
//! quantized path's error; no atomics, the same bits run to run and a row's bits whatever its
//! batch.

use std::sync::atomic::{AtomicU64, Ordering};

use pagoda_cuda::{
    check_min_len, ptr, to_u32, view, CudaError, DType, DeviceBuffer, DeviceRead, DeviceWrite,
    Element, Gpu, KernelSource, KernelSpec, LaunchDims,
};

use super::{max_tiles, moe_combine, MoeWorkspace, MOE_PER_ROW_MAX_ROWS};
use crate::cuda_dtypes::{check_float, FLOAT_DTYPES};
use crate::linear::cuda::{quantize_rows_q8, Q8Rows, QuantFormat, QUANT_PADDING};

/// The CUDA source of the quantized expert matmuls.
pub(crate) static QUANT: KernelSource = KernelSource::new(
    "moe_quant.cu",
    concat!(
        include_str!("moe_common.cu"),
        include_str!("../../linear/cuda/quant_decode.cu"),
        include_str!("moe_quant.cu")
    ),
);

/// Output columns a CTA of `moe_quant_gate_up` (`WARPS * GATE_UP_COLS`).
const GATE_UP_COLUMNS: usize = 8;
/// Output columns a CTA of `moe_quant_down` (`WARPS * DOWN_COLS`).
const DOWN_COLUMNS: usize = 16;
/// Threads a CTA (`WARPS * 32`).
const THREADS: u32 = 128;

/// One projection of a layer's routed experts in GGUF blocks: `[num_experts, rows, cols]`
/// values as the file stores them (each expert's `rows` rows of `cols` values, then the
/// next expert's), followed by [`QUANT_PADDING`] bytes.
pub struct QuantExperts {
    /// The blocks' format.
    pub format: QuantFormat,
    /// The blocks, padded.
    pub blocks: DeviceBuffer<u8>,
    /// Experts stacked.
    pub num_experts: usize,
    /// Output values (weight rows) of an expert.
    pub rows: usize,
    /// Input values of a row, a whole number of the format's blocks.
    pub cols: usize,
}

impl QuantExperts {
    /// Uploads `bytes` (`num_experts * rows` rows of `cols` values in `format`'s blocks,
    /// unpadded), checking their length.
    pub fn upload(
        gpu: &Gpu,
        format: QuantFormat,
        bytes: &[u8],
        [num_experts, rows, cols]: [usize; 3],
    ) -> Result<QuantExperts, CudaError> {
        if cols == 0 || !cols.is_multiple_of(format.block_values()) {
            return Err(CudaError::invalid(format!(
                "quantized experts {format}: rows of {cols} values are not whole blocks of {}",
                format.block_values()
            )));
        }
        let expected = num_experts * rows * format.row_bytes(cols);
        if bytes.len() != expected {
            return Err(CudaError::invalid(format!(
                "quantized experts {format} [{num_experts}, {rows}, {cols}]: {} bytes, not \
                 {expected}",
                bytes.len()
            )));
        }
        let mut padded = gpu.zeros::<u8>(expected + QUANT_PADDING)?;
        let mut head = pagoda_cuda::view_mut(&mut padded, 0..expected)?;
        gpu.upload_into(bytes, &mut head)?;
        Ok(QuantExperts {
            format,
            blocks: padded,
            num_experts,
            rows,
            cols,
        })
    }

    /// Bytes on the device (the padding included).
    pub fn bytes(&self) -> usize {
        self.blocks.len()
    }

    fn check(&self, what: &str, [experts, rows, cols]: [usize; 3]) -> Result<(), CudaError> {
        if [self.num_experts, self.rows, self.cols] != [experts, rows, cols]
            || !cols.is_multiple_of(self.format.block_values())
        {
            return Err(CudaError::invalid(format!(
                "moe quantized {what}: [{}, {}, {}] {}, expected [{experts}, {rows}, {cols}] in \
                 whole blocks",
                self.num_experts, self.rows, self.cols, self.format
            )));
        }
        check_min_len(
            "moe quantized experts (bytes, padded)",
            experts * rows * self.format.row_bytes(cols) + QUANT_PADDING,
            self.blocks.len(),
        )
    }
}

/// The q8 activations of a quantized MoE step: the step's rows (`[max_rows, hidden]`) and its
/// intermediates (`[max_rows * top_k, inter]`).
pub struct MoeQ8 {
    x: Q8Rows,
    act: Q8Rows,
}

impl MoeQ8 {
    /// Room for `workspace`'s steps.
    pub fn new<T: Element>(gpu: &Gpu, workspace: &MoeWorkspace<T>) -> Result<MoeQ8, CudaError> {
        let w = workspace;
        Ok(MoeQ8 {
            x: Q8Rows::new(gpu, w.max_rows, w.hidden)?,
            act: Q8Rows::new(gpu, w.max_rows * w.top_k, w.inter)?,
        })
    }
}

/// The entries of `moe_quant.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeQuantEntry {
    /// `moe_quant_gate_up` with gate in the first format, up in the second.
    GateUp(QuantFormat, QuantFormat),
    /// `moe_quant_down`.
    Down(QuantFormat),
    /// `moe_quant_gate_up_rows` (steps of a few rows).
    GateUpRows(QuantFormat, QuantFormat),
    /// `moe_quant_down_rows` (steps of a few rows).
    DownRows(QuantFormat),
}

impl MoeQuantEntry {
    /// The gate/up entry of a step of `num_rows` rows: per routed entry up to
    /// [`MOE_PER_ROW_MAX_ROWS`] rows, per tile above (a function of the row count only).
    pub fn gate_up(num_rows: usize, gate: QuantFormat, up: QuantFormat) -> MoeQuantEntry {
        match num_rows <= MOE_PER_ROW_MAX_ROWS {
            true => MoeQuantEntry::GateUpRows(gate, up),
            false => MoeQuantEntry::GateUp(gate, up),
        }
    }

    /// The down entry of a step of `num_rows` rows (as [`MoeQuantEntry::gate_up`]).
    pub fn down(num_rows: usize, down: QuantFormat) -> MoeQuantEntry {
        match num_rows <= MOE_PER_ROW_MAX_ROWS {
            true => MoeQuantEntry::DownRows(down),
            false => MoeQuantEntry::Down(down),
        }
    }

    fn per_row(self) -> bool {
        matches!(
            self,
            MoeQuantEntry::GateUpRows(..) | MoeQuantEntry::DownRows(_)
        )
    }
}

/// The specialisation of `entry` writing intermediates of `dtype` (f32 or bf16).
pub fn specialize_moe_quant(entry: MoeQuantEntry, dtype: DType) -> Result<KernelSpec, CudaError> {
    check_float("moe quantized experts", dtype)?;
    let (name, a, b) = match entry {
        MoeQuantEntry::GateUp(gate, up) => ("moe_quant_gate_up", gate, up),
        MoeQuantEntry::Down(down) => ("moe_quant_down", down, down),
        MoeQuantEntry::GateUpRows(gate, up) => ("moe_quant_gate_up_rows", gate, up),
        MoeQuantEntry::DownRows(down) => ("moe_quant_down_rows", down, down),
    };
    Ok(KernelSpec {
        source: &QUANT,
        entry: name,
        params: vec![("FORMAT_A", a.code()), ("FORMAT_B", b.code())],
        dtypes: vec![("T", dtype), ("IDS_T", DType::U32)],
    })
}

/// The catalogue's specialisations: down of every format and gate/up with gate and up in one
/// format, per dtype (the files' layout; a gate/up pair of two formats compiles from the same
/// template at its first use). A model's warm-up leaves them out (opt-in, first use).
pub(super) fn specializations() -> Result<Vec<KernelSpec>, CudaError> {
    let mut specs = Vec::new();
    for &dtype in &FLOAT_DTYPES {
        for format in QuantFormat::ALL {
            for rows in [1, MOE_PER_ROW_MAX_ROWS + 1] {
                let down = MoeQuantEntry::down(rows, format);
                specs.push(specialize_moe_quant(down, dtype)?);
                let gate_up = MoeQuantEntry::gate_up(rows, format, format);
                specs.push(specialize_moe_quant(gate_up, dtype)?);
            }
        }
    }
    Ok(specs)
}

/// Steps of at least this many rows decode quantized experts into bf16/f32 stacks and run the
/// dense expert path (`PAGODA_CUDA_MOE_QUANT_DENSE_ROWS`'s default): Qwen3-30B-A3B's block on
/// the H100 (2026-12-06) took 1410 us quantized at 256 rows against 561 us on tensor cores
/// from bf16, which leaves room for the decode (1.2 GB written); at 64 rows 505 against 455,
/// which does not.
pub const MOE_QUANT_DENSE_MIN_ROWS: usize = 256;

/// `out` (`[num_experts, rows, cols]` in `T`) decoded from `experts`' blocks, for a step
/// large enough that the dense expert kernels (tensor cores) beat the quantized ones by more
/// than the decode costs. Counted in [`moe_quant_dense_decodes`].
pub fn moe_quant_dequantize<T: Element>(
    gpu: &Gpu,
    experts: &QuantExperts,
    out: &mut DeviceBuffer<T>,
) -> Result<(), CudaError> {
    let (n, k) = (experts.num_experts * experts.rows, experts.cols);
    let mut out = pagoda_cuda::view_mut(out, 0..n * k)?;
    crate::linear::cuda::dequantize_fast(gpu, experts.format, &experts.blocks, &mut out, (n, k))?;
    static LOGGED: std::sync::Once = std::sync::Once::new();
    LOGGED.call_once(|| {
        tracing::info!(
            "MoE experts kept in blocks: steps of {}+ rows decode them for the dense expert              kernels (PAGODA_CUDA_MOE_QUANT_DENSE_ROWS)",
            MOE_QUANT_DENSE_MIN_ROWS
        )
    });
    DENSE_DECODES.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

static DENSE_DECODES: AtomicU64 = AtomicU64::new(0);

/// How many stacked expert projections have been decoded for a large step in this process
/// (`pagoda_cuda_moe_quant_dense_decodes_total`).
pub fn moe_quant_dense_decodes() -> u64 {
    DENSE_DECODES.load(Ordering::Relaxed)
}

static QUANT_LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// How many quantized expert matmuls (gate/up or down launches) have run in this process
/// (`pagoda_cuda_moe_quant_launches_total`).
pub fn moe_quant_launches() -> u64 {
    QUANT_LAUNCHES.load(Ordering::Relaxed)
}

/// Counts a launch, logging the first.
fn count_launch() {
    static LOGGED: std::sync::Once = std::sync::Once::new();
    LOGGED.call_once(|| {
        tracing::info!(
            "MoE experts kept in their GGUF blocks on the device: grouped quantized GEMVs over \
             q8 activations per routing tile (PAGODA_CUDA_MOE_QUANT)"
        )
    });
    QUANT_LAUNCHES.fetch_add(1, Ordering::Relaxed);
}

/// `workspace.act[p] = silu(gate_e(x[row_p])) * up_e(x[row_p])` for every routed position
/// `p` of expert `e` (the routing [`moe_route`](super::moe_route) left in `workspace`), with
/// `x` (`[num_rows, hidden]`) quantized to q8 into `q8` first. `gate` and `up` are
/// `[num_experts, inter, hidden]` in blocks, each in its own format.
pub fn moe_quant_gate_up<T: Element>(
    gpu: &Gpu,
    x: &impl DeviceRead<T>,
    [gate, up]: [&QuantExperts; 2],
    q8: &mut MoeQ8,
    workspace: &mut MoeWorkspace<T>,
    num_rows: usize,
) -> Result<(), CudaError> {
    workspace.check_rows(num_rows)?;
    let w = &*workspace;
    let (experts, hidden, inter) = (w.num_experts, w.hidden, w.inter);
    gate.check("gate", [experts, inter, hidden])?;
    up.check("up", [experts, inter, hidden])?;
    if num_rows == 0 {
        return Ok(());
    }
    let x = view(x, 0..num_rows * hidden)?;
    quantize_rows_q8(gpu, &x, &mut q8.x, (num_rows, hidden))?;
    let (xq, xds) = q8.x.buffers();
    let entry = MoeQuantEntry::gate_up(num_rows, gate.format, up.format);
    let spec = specialize_moe_quant(entry, T::DTYPE)?;
    let mut args = vec![ptr(xq), ptr(xds), ptr(&gate.blocks), ptr(&up.blocks)];
    let rows = if entry.per_row() {
        args.extend([ptr(&w.experts), ptr(&w.entry_slots), ptr(&w.act)]);
        args.extend(w.row_dims()?);
        to_u32("moe entries", num_rows * w.top_k)?
    } else {
        args.extend([
            ptr(&w.expert_offsets),
            ptr(&w.expert_rows),
            ptr(&w.tile_offsets),
            ptr(&w.tile_experts),
            ptr(&w.tile_starts),
            ptr(&w.act),
        ]);
        args.extend(w.dims()?);
        to_u32("moe tiles", max_tiles(num_rows * w.top_k, experts))?
    };
    let grid = (to_u32("moe CTAs", inter.div_ceil(GATE_UP_COLUMNS))?, rows);
    // SAFETY: arguments match `moe_quant_gate_up` (or `_rows`); the blocks hold [experts,
    // inter, hidden] values in whole blocks and their padding (checked), x was quantized for
    // num_rows rows of hidden values, the routing (entries, tile list) written by `moe_route`
    // for these rows.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, THREADS), &args)? };
    count_launch();
    Ok(())
}

/// `workspace.out[p] = down_e(workspace.act[p])` for every routed position `p`, the
/// intermediates quantized to q8 into `q8` first. `down` is `[num_experts, hidden, inter]` in
/// blocks.
pub fn moe_quant_down<T: Element>(
    gpu: &Gpu,
    down: &QuantExperts,
    q8: &mut MoeQ8,
    workspace: &mut MoeWorkspace<T>,
    num_rows: usize,
) -> Result<(), CudaError> {
    workspace.check_rows(num_rows)?;
    let w = &*workspace;
    let (experts, hidden, inter) = (w.num_experts, w.hidden, w.inter);
    down.check("down", [experts, hidden, inter])?;
    if num_rows == 0 {
        return Ok(());
    }
    let entries = num_rows * w.top_k;
    let act = view(&w.act, 0..entries * inter)?;
    quantize_rows_q8(gpu, &act, &mut q8.act, (entries, inter))?;
    let (aq, ads) = q8.act.buffers();
    let entry = MoeQuantEntry::down(num_rows, down.format);
    let spec = specialize_moe_quant(entry, T::DTYPE)?;
    let mut args = vec![ptr(aq), ptr(ads), ptr(&down.blocks)];
    let rows = if entry.per_row() {
        args.extend([ptr(&w.experts), ptr(&w.entry_slots), ptr(&w.out)]);
        args.extend(w.row_dims()?);
        to_u32("moe entries", entries)?
    } else {
        args.extend([
            ptr(&w.expert_offsets),
            ptr(&w.tile_offsets),
            ptr(&w.tile_experts),
            ptr(&w.tile_starts),
            ptr(&w.out),
        ]);
        args.extend(w.dims()?);
        to_u32("moe tiles", max_tiles(entries, experts))?
    };
    let grid = (to_u32("moe CTAs", hidden.div_ceil(DOWN_COLUMNS))?, rows);
    // SAFETY: arguments match `moe_quant_down` (or `_rows`); the blocks hold [experts, hidden,
    // inter] values in whole blocks and their padding (checked), the intermediates were
    // quantized for the step's entries, the routing (entries, tile list) written by
    // `moe_route` for these rows.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, THREADS), &args)? };
    count_launch();
    Ok(())
}

/// [`moe_quant_down`], then [`moe_combine`]: `x[row] += Σ weight · down_e(act[entry])` over
/// each row's entries in ascending expert index, `+ shared[row]` after them where given.
pub fn moe_quant_down_combine<T: Element>(
    gpu: &Gpu,
    down: &QuantExperts,
    q8: &mut MoeQ8,
    workspace: &mut MoeWorkspace<T>,
    shared: Option<&impl DeviceRead<f32>>,
    x: &mut impl DeviceWrite<f32>,
    num_rows: usize,
) -> Result<(), CudaError> {
    moe_quant_down(gpu, down, q8, workspace, num_rows)?;
    moe_combine(gpu, workspace, shared, x, num_rows)
}
