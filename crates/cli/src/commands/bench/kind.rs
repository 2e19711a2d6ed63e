//! The benchmark subcommands of `pagoda bench`.

/// The benchmark subcommands of `pagoda bench`.
#[derive(clap::Subcommand, Debug)]
pub enum BenchKind {
    /// Drive a running OpenAI-compatible server with concurrent streaming clients.
    Serve(super::super::bench_serve::BenchServeArgs),
    /// Time the fused sort-free samplers against the sort-based reference.
    Sampling(super::super::bench_sampling::BenchSamplingArgs),
    /// Time the decode attention kernels (gather vs fused) on the GPU, graph-replayed.
    Attention(super::super::bench_attention::BenchAttentionArgs),
    /// Time cascade decode against the plain fused decode behind a shared prefix, on the GPU.
    Cascade(super::super::bench_cascade::BenchCascadeArgs),
    /// Time sparse decode (Quest page selection) against the dense fused decode on the GPU.
    Sparse(super::super::bench_sparse::BenchSparseArgs),
    /// Time the CPU kernels (matmul kernel sets, attention kernels) side by side.
    Kernels(super::super::bench_kernels::BenchKernelsArgs),
    /// Time a mixture-of-experts block's kernels on the GPU, stage by stage, graph-replayed.
    Moe(super::super::bench_moe::BenchMoeArgs),
    /// Time the in-place quantized linear layer on the GPU per layout, format and rows.
    QuantGemv(super::super::bench_quant_gemv::BenchQuantGemvArgs),
}
