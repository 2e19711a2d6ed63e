//! The CPU matmul kernels of the linear op, one module per kernel, each holding its
//! instruction-set variants (`x86.rs` beside the portable form):
//!
//! - [`kernels`]: which kernel set runs for each weight (`PAGODA_CPU_KERNELS`), chosen once.
//! - [`f32_tile`]: the batch-invariant f32 tile recipe every f32-activation path follows;
//!   [`f32_decode`] its eight-row AVX-512/AVX2 form for one to eight tokens.
//! - [`int_matmul`]: Q8/Q15-activation matmuls on repacked weights, over the per-lane tiles
//!   of [`int_dot`], the row-interleaved records of [`interleaved`] (the `vnni8` set) and
//!   the AMX tiles of [`amx`] (INT8, and BF16 prefills).
//! - [`shared`]: several weights applied to one input with one quantization.
//! - [`prefetch`]: the software-prefetch distance of the integer kernels.
//! - `tasks`: how rows are split into rayon tasks over a token-major output.

pub mod amx;
pub mod f32_decode;
pub mod f32_tile;
pub mod int_dot;
pub mod int_matmul;
pub mod interleaved;
pub mod kernels;
pub mod prefetch;
pub mod shared;
pub(crate) mod tasks;
