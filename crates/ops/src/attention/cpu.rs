//! The CPU implementation of attention (f32): K/V append, the gather baseline, split-KV
//! decode with its LSE merge, the batch-invariant step with its cascade items over shared
//! prefix pages, and the chunk kernels (scalar,
//! AVX2, AVX-512, NEON) chosen by [`kernel::AttentionKernel`].

pub(crate) mod append;
pub(crate) mod cascade;
mod chunk;
pub(crate) mod decode;
pub(crate) mod gather;
pub(crate) mod kernel;
mod math;
pub(crate) mod merge;
pub(crate) mod mla;
pub(crate) mod mla_sparse;
pub(crate) mod selection;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod simd;
pub(crate) mod sparse;
pub(crate) mod sparse_params;
pub(crate) mod step;
mod step_cascade;
