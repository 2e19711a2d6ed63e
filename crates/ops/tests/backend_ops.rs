//! pagoda's `test-backend-ops` (after llama.cpp's `tests/test-backend-ops.cpp`): one list of
//! op cases ([`cases`]), each run on every backend this build and this machine have and
//! compared with the ops crate's CPU reference; one line per (case, backend):
//! `op shape backend [variant] OK|FAIL max_abs_err=.. err=.. tol=..`, "not supported" where a
//! backend lacks the op, and every failure listed at the end (not only the first).
//!
//! Backends ([`framework::Backend`]): the CPU's selectable kernels (the elementwise
//! production paths; each linear kernel set this CPU runs, `PAGODA_CPU_KERNELS`; each
//! split-KV attention chunk kernel it runs, `PAGODA_CPU_ATTENTION`), and `cuda-f32` /
//! `cuda-bf16` (the CUDA launchers at each activation dtype). Inputs are bf16 values, so every
//! backend sees the reference's inputs; where a backend rounds them (Q8 activations, bf16
//! pools) the reference is computed on what it sees.
//!
//! - `cpu_backends_match_the_reference` runs in every `cargo test`.
//! - `cuda_backends_match_the_reference` needs a GPU and a build with `--features cuda`:
//!   `cargo test -p pagoda-ops --features pagoda-ops/cuda --test backend_ops -- --include-ignored --nocapture`;
//!   without either it fails.
//!
//! `PAGODA_BACKEND_OPS=<substring>` keeps only the ops whose name contains it (test-backend-ops'
//! `-o`), e.g. `PAGODA_BACKEND_OPS=attention`.
//!
//! Adding an op: a file in `backend_ops/` with its cases (an [`framework::OpCase`] each) and
//! one line in [`cases`]. Sampling is not here: it is statistical, and its oracle suites
//! (`sampling_*.rs`, `gpu_sampling*.rs`) compare distributions, not values.

#[path = "attention_reference.rs"]
mod attention_reference;
#[path = "common/mod.rs"]
mod common;
#[path = "gpu_common/mod.rs"]
mod gpu_common;

#[path = "backend_ops/framework.rs"]
mod framework;

#[path = "backend_ops/activation.rs"]
mod activation;
#[path = "backend_ops/attention.rs"]
mod attention;
#[path = "backend_ops/attention_cuda.rs"]
mod attention_cuda;
#[path = "backend_ops/embedding.rs"]
mod embedding;
#[path = "backend_ops/linear.rs"]
mod linear;
#[path = "backend_ops/linear_quant.rs"]
mod linear_quant;
#[path = "backend_ops/linear_quant_fused.rs"]
mod linear_quant_fused;
#[path = "backend_ops/linear_quant_pair.rs"]
mod linear_quant_pair;
#[path = "backend_ops/mla.rs"]
mod mla;
#[path = "backend_ops/norm.rs"]
mod norm;
#[path = "backend_ops/rope.rs"]
mod rope;

use framework::{assert_passed, cpu_backends, cuda_backends, run_cases, OpCase};

/// Every case of every op: the registry.
fn cases() -> Vec<Box<dyn OpCase>> {
    let mut cases = Vec::new();
    cases.extend(norm::cases());
    cases.extend(rope::cases());
    cases.extend(activation::cases());
    cases.extend(embedding::cases());
    cases.extend(linear::cases());
    cases.extend(linear_quant::cases());
    cases.extend(linear_quant_fused::cases());
    cases.extend(linear_quant_pair::cases());
    cases.extend(attention::cases());
    cases.extend(mla::cases());
    cases
}

#[test]
fn cpu_backends_match_the_reference() {
    let report = run_cases(&cases(), &cpu_backends());
    assert_passed("CPU backends", &report);
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_backends_match_the_reference() {
    // Panics without a GPU or without the `cuda` feature (the stub's Gpu::new fails).
    let gpu = gpu_common::gpu();
    let report = run_cases(&cases(), &cuda_backends(&gpu));
    assert_passed("CUDA backends", &report);
}
