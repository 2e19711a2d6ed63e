//! AMX-BF16 tiles for prefill matmuls on interleaved integer weights: the weights dequantized
//! and the activations rounded to bf16, products summed in f32 inside the tiles over the
//! whole row. Not bit-identical to the integer kernels (and so not batch-invariant: a row's
//! result depends on whether its batch had [`MIN_TOKENS`] rows).
//!
//! Why: the integer tiles ([`super::matmul`]) keep one exact integer per 32-value block and
//! must leave the tiles after every block for the f32 step (`acc += d d_a int + min s_a`),
//! which costs as much as the tile work; here the block scales are folded into the bf16
//! weights once per chunk and the tiles accumulate across blocks, 32 tokens x 32 rows per
//! pass (four C tiles). The error is of the size of Q8 activations' (bf16 keeps 8 bits of
//! each value, Q8 7 bits of each block's largest).
//!
//! Per task of 32 weight rows: the chunk is dequantized into the thread's B buffer
//! ([`pack::weights`]); then for each pass of 32 tokens, per block: two A loads (the tokens'
//! bf16 rows, in place at row stride `2 k`), two B loads, four `TDPBF16PS`; the four C tiles
//! are stored and written to the task's columns of `y`. Q15 weights (`ffn_down`, the widest
//! input range) take the activations as two bf16 terms, `hi + lo` ([`matmul_split`]: two
//! more A loads and four more dots per block), about 16 significant bits of each value.
//! Tile buffers are whole 64-byte lines: tile rows that straddle two lines load 7x slower.
//!
//! `PAGODA_CPU_AMX_PREFILL=auto|int8|bf16` picks the tiles of the `amx` set's prefills
//! ([`AmxPrefill`]; `auto` is `int8`, the reproducible choice). [`TileBackend::Emulated`] runs the same loops on
//! [`unit::EmulatedBf16`], so layout and loops are tested on any CPU.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use super::{AmxError, TileBackend};
use crate::kernel_choice::{choose_from_env, KernelChoice};
use crate::linear::cpu::interleaved::Interleaved;
use crate::linear::cpu::tasks::{by_row_tasks_in_place, Columns};

pub mod pack;
pub mod unit;

use pack::{TileBuffer, B_TILE, CHUNK_ROWS, PASS_TOKENS};
use unit::{Bf16Unit, EmulatedBf16, FTile, A_FIRST, B_FIRST, C_TILES};

/// Fewest tokens for which the `amx` set's matmuls take the BF16 tiles (fewer run `vnni8`).
/// Kernel harness on the Xeon host (2 threads, the default model's five shapes, three calls):
/// BF16 over `vnni8` 0.57-1.21x at 16 tokens, 1.0-2.1x at 32, 1.4-3.5x from 64
/// (`docs/benchmark_results/cpu-amx-bf16-xeon-h200host-2026-12-02.md`).
pub const MIN_TOKENS: usize = 32;

/// CPUID leaf 7 (subleaf 0) EDX bit of AMX-BF16.
const CPUID_AMX_BF16: u32 = 1 << 22;

/// The environment variable that picks the prefill tiles of the `amx` set.
pub const AMX_PREFILL_ENV_VAR: &str = "PAGODA_CPU_AMX_PREFILL";

/// Which AMX tiles the `amx` set's prefills run: INT8 from [`super::AMX_MIN_TOKENS`] tokens,
/// or BF16 from [`MIN_TOKENS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AmxPrefill {
    /// AMX-INT8 on Q8 activations, bit-identical to `vnni8` ([`super::matmul`]).
    Int8,
    /// AMX-BF16 on bf16 activations and dequantized weights (this module).
    Bf16,
}

impl AmxPrefill {
    /// `int8` or `bf16`.
    pub fn name(self) -> &'static str {
        crate::kernel_choice::word(self)
    }

    /// Parses `auto` (or empty: `None`), `int8`, `bf16`; the error names the bad value.
    pub fn parse(text: &str) -> Result<Option<AmxPrefill>, crate::UnknownChoice> {
        crate::kernel_choice::parse(text)
    }

    /// What `auto` gives: INT8 on every CPU. The BF16 tiles are 1.1-1.2x faster on prefill
    /// (the Xeon host, pp64-pp512) but not bit-identical to the decode kernels, so with them
    /// a request's tokens depend on what shares its step, on preemption and on the prefix
    /// cache; reproducibility is the default, BF16 an opt-in.
    pub fn auto() -> AmxPrefill {
        AmxPrefill::Int8
    }

    /// The process-wide choice ([`AMX_PREFILL_ENV_VAR`] read once, checked against the CPU,
    /// logged once at INFO where AMX runs).
    pub fn selected() -> AmxPrefill {
        static SELECTED: OnceLock<AmxPrefill> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let choice = choose_from_env::<AmxPrefill>();
            if super::backend().is_some() {
                tracing::info!(
                    "AMX prefill tiles: {} ({AMX_PREFILL_ENV_VAR}; bf16 is faster and not \
                     bit-identical to the decode kernels, int8 is)",
                    choice.name()
                );
            }
            choice
        })
    }
}

impl KernelChoice for AmxPrefill {
    const ENV_VAR: &'static str = AMX_PREFILL_ENV_VAR;
    const WORDS: &'static [(&'static str, Self)] =
        &[("int8", AmxPrefill::Int8), ("bf16", AmxPrefill::Bf16)];
    fn choice_supported(self) -> bool {
        match self {
            AmxPrefill::Int8 => true,
            AmxPrefill::Bf16 => tiles_run(),
        }
    }
    fn auto_choice() -> Self {
        AmxPrefill::auto()
    }
}

/// Whether the CPU reports AMX-BF16 beside what [`super::is_available`] checks (AMX-INT8,
/// the tile-data permission, AVX-512), and AVX-512 BF16 for the conversions.
pub fn is_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
            super::is_available() && edx & CPUID_AMX_BF16 != 0 && pack::vector()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = CPUID_AMX_BF16;
            false
        }
    })
}

/// Whether the BF16 tiles run in this process: on the hardware where [`super::backend`] is
/// the hardware and the CPU has AMX-BF16 ([`is_available`]), or on the tile model where the
/// tiles are emulated.
pub fn tiles_run() -> bool {
    match super::backend() {
        Some(TileBackend::Hardware) => is_available(),
        Some(TileBackend::Emulated) => true,
        None => false,
    }
}

/// The environment variable that sends Q15 weights (`ffn_down`) to the BF16 tiles with
/// split activations (`split`, the default) or keeps them on the INT8 tiles (`int8`).
pub const Q15_ENV_VAR: &str = "PAGODA_CPU_AMX_BF16_Q15";

/// Whether Q15 weights run [`matmul_split`] on the BF16 tiles ([`Q15_ENV_VAR`], read once;
/// `auto` or unset: yes). Measured on the Xeon host against the INT8 tiles' Q15 dots: the
/// same speed (pp64-pp512 0.98-1.11x, three rounds), the llama.cpp parity tail lower
/// (chosen token 0.206 against 0.304, 99th percentile 0.404 against 0.448) and the distance
/// from exact math halved (mean 0.020 against 0.045).
pub fn split_q15() -> bool {
    static SPLIT: OnceLock<bool> = OnceLock::new();
    *SPLIT.get_or_init(|| {
        let split = pagoda_config::global().word(Q15_ENV_VAR) != "int8";
        if tiles_run() {
            tracing::info!(
                "AMX-BF16 tiles: Q15 weights (ffn_down) {} ({Q15_ENV_VAR})",
                if split {
                    "on split bf16 activations (hi + lo)"
                } else {
                    "on the INT8 tiles"
                }
            );
        }
        split
    })
}

static MATMULS: AtomicU64 = AtomicU64::new(0);
static EMULATED_MATMULS: AtomicU64 = AtomicU64::new(0);

/// How many matmuls have run on the emulated AMX-BF16 tiles in this process.
pub fn emulated_matmul_count() -> u64 {
    EMULATED_MATMULS.load(Ordering::Relaxed)
}

/// How many matmuls have run on the hardware AMX-BF16 tiles in this process.
pub fn matmul_count() -> u64 {
    MATMULS.load(Ordering::Relaxed)
}

std::thread_local! {
    /// The calling thread's bf16 activation rows, reused across matmuls.
    static ACTIVATIONS: std::cell::RefCell<TileBuffer> = const { std::cell::RefCell::new(TileBuffer::new()) };
    /// Each thread's B buffer of one chunk ([`pack::weights`]), reused across tasks.
    static B_BUFFER: std::cell::RefCell<TileBuffer> = const { std::cell::RefCell::new(TileBuffer::new()) };
    /// The calling thread's remainders of split activations ([`matmul_split`]), reused.
    static REMAINDERS: std::cell::RefCell<TileBuffer> = const { std::cell::RefCell::new(TileBuffer::new()) };
}

/// Runs `f` with the thread-local buffer `key`, or a fresh one if it is in use.
fn with_buffer<T: 'static + Default, R>(
    key: &'static std::thread::LocalKey<std::cell::RefCell<T>>,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buffer) => f(&mut buffer),
        Err(_) => f(&mut T::default()),
    })
}

/// `y[t, r] = dot(weights[r], x[t])` (`x` is `[num_tokens, k]` f32, `y` `[num_tokens, n]`,
/// overwritten) on bf16 tiles. Fails, writing nothing, on weights with sub-scales, a shape
/// mismatch, or [`TileBackend::Hardware`] where [`is_available`] is false.
pub fn matmul(
    backend: TileBackend,
    weights: &Interleaved,
    x: &[f32],
    num_tokens: usize,
    y: &mut [f32],
) -> Result<(), AmxError> {
    matmul_with(backend, weights, x, num_tokens, y, false)
}

/// [`matmul`] with the activations as two bf16 terms, `x = hi + lo` (`lo` the rounded
/// remainder, about 16 significant bits in all): two dots per tile and block. For inputs of
/// a wide range (`ffn_down`).
pub fn matmul_split(
    backend: TileBackend,
    weights: &Interleaved,
    x: &[f32],
    num_tokens: usize,
    y: &mut [f32],
) -> Result<(), AmxError> {
    matmul_with(backend, weights, x, num_tokens, y, true)
}

fn matmul_with(
    backend: TileBackend,
    weights: &Interleaved,
    x: &[f32],
    num_tokens: usize,
    y: &mut [f32],
    split: bool,
) -> Result<(), AmxError> {
    let (n, blocks) = (weights.num_rows(), weights.blocks_per_row());
    let k = blocks * 32;
    if weights.has_sub_scales() {
        return Err(AmxError::SubScales);
    }
    if x.len() != num_tokens * k {
        return Err(AmxError::BlockMismatch {
            weights: blocks,
            activations: x.len() / num_tokens.max(1) / 32,
        });
    }
    if y.len() != n * num_tokens {
        return Err(AmxError::OutputSize {
            got: y.len(),
            expected: n * num_tokens,
        });
    }
    if backend == TileBackend::Hardware {
        if !is_available() {
            return Err(AmxError::NotAvailable);
        }
        static LOGGED: std::sync::Once = std::sync::Once::new();
        LOGGED.call_once(|| {
            tracing::info!("AMX-BF16 tiles in use for prefill matmuls on interleaved weights")
        });
        MATMULS.fetch_add(1, Ordering::Relaxed);
    } else {
        EMULATED_MATMULS.fetch_add(1, Ordering::Relaxed);
    }
    if n == 0 || num_tokens == 0 || blocks == 0 {
        y.fill(0.0);
        return Ok(());
    }
    with_buffer(&ACTIVATIONS, |activations| {
        with_buffer(&REMAINDERS, |lo| {
            pack::activations(x, k, activations, true);
            if split {
                pack::remainders(x, k, activations, lo, true);
            }
            let activations: &[u16] = activations.as_u16();
            let lo: Option<&[u16]> = split.then(|| lo.as_u16());
            by_row_tasks_in_place(n, num_tokens, CHUNK_ROWS, y, |cols, out| {
                let chunk = cols.start / CHUNK_ROWS;
                with_buffer(&B_BUFFER, |tiles| {
                    pack::weights(weights, chunk, tiles, true);
                    let task = Task {
                        tiles: tiles.as_bytes(),
                        activations,
                        lo,
                        k,
                        num_tokens,
                        col: cols.start,
                        rows: cols.len(),
                    };
                    match backend {
                        TileBackend::Emulated => task.run(&mut EmulatedBf16::default(), out),
                        TileBackend::Hardware => hardware(&task, out),
                    }
                })
            });
        })
    });
    Ok(())
}

/// One task's inputs: its chunk's B tiles, every token's bf16 row, and its columns.
struct Task<'a> {
    tiles: &'a [u8],
    /// `[padded tokens][k]` bf16.
    activations: &'a [u16],
    /// Split activations: the remainders `x - hi`, in the same layout.
    lo: Option<&'a [u16]>,
    k: usize,
    num_tokens: usize,
    /// The chunk's first row (column of `y`) and its row count (at most 32).
    col: usize,
    rows: usize,
}

impl Task<'_> {
    /// The tile loops (see the module docs), written to `out` through the task's window.
    #[inline(always)]
    fn run<U: Bf16Unit>(&self, unit: &mut U, out: &mut Columns) {
        let (k, blocks) = (self.k, self.k / 32);
        let bytes: &[u8] = bytemuck::cast_slice(self.activations);
        let stride = 2 * k;
        let padded = self.activations.len() / k;
        let mut c = FTile::default();
        unit.configure();
        for pass in 0..padded / PASS_TOKENS {
            for tile in 0..C_TILES {
                unit.zero(tile);
            }
            for block in 0..blocks {
                for j in 0..2 {
                    let row = pass * PASS_TOKENS + 16 * j;
                    unit.load(A_FIRST + j, &bytes[(row * k + 32 * block) * 2..], stride);
                }
                for h in 0..2 {
                    let at = block * 2 * B_TILE + h * B_TILE;
                    unit.load(B_FIRST + h, &self.tiles[at..at + B_TILE], 64);
                }
                for tile in 0..C_TILES {
                    unit.dot(tile);
                }
                if let Some(lo) = self.lo {
                    let lo: &[u8] = bytemuck::cast_slice(lo);
                    for j in 0..2 {
                        let row = pass * PASS_TOKENS + 16 * j;
                        unit.load(A_FIRST + j, &lo[(row * k + 32 * block) * 2..], stride);
                    }
                    for tile in 0..C_TILES {
                        unit.dot(tile);
                    }
                }
            }
            for tile in 0..C_TILES {
                let (j, h) = (tile / 2, tile % 2);
                let cols = self.rows.saturating_sub(16 * h).min(16);
                if cols == 0 {
                    continue;
                }
                unit.store(tile, &mut c);
                let first = pass * PASS_TOKENS + 16 * j;
                for (m, values) in
                    c.0.iter()
                        .enumerate()
                        .take(self.num_tokens.saturating_sub(first))
                {
                    if cols == 16 {
                        // A whole row: a fixed-length copy (vector moves, no memcpy call).
                        out.put(first + m, self.col + 16 * h, values);
                    } else {
                        out.put(first + m, self.col + 16 * h, &values[..cols]);
                    }
                }
            }
        }
        unit.release();
    }
}

/// [`Task::run`] on the hardware tiles, compiled with the AVX-512 features AMX hosts have.
fn hardware(task: &Task, out: &mut Columns) {
    let mut unit = unit::HardwareBf16::new().expect("AMX-BF16 availability checked by the caller");
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
        fn vectorized(task: &Task, unit: &mut unit::HardwareBf16, out: &mut Columns) {
            task.run(unit, out)
        }
        // SAFETY: the unit exists only where `is_available` confirmed these features.
        unsafe { vectorized(task, &mut unit, out) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (task, &mut unit, out);
        unreachable!("HardwareBf16::new returns None off x86-64");
    }
}
