//! DeepSeek's latent attention (MLA) on CUDA: its pool is one row of latent + rope key per
//! token (the config's one KV head of `head_dim` = the latent row); its decode steps replay
//! from CUDA graphs per batch bucket, its other steps run eagerly.

use std::sync::Once;

use pagoda_cuda::{CudaError, DType};
use pagoda_models::config::ModelConfig;
use pagoda_ops::cuda::{self as ops, PoolLayout};

/// Checks a latent attention model's pool against the MLA kernels, and says once what runs
/// from graphs when they were asked for: decode steps, per batch bucket (the decode's grid
/// fixed per bucket, its plan uploaded from pinned memory before each replay, ADR 0009);
/// prefill, mixed and verification steps eagerly (no piecewise graphs).
pub(super) fn check_latent_pool(
    c: &ModelConfig,
    dtype: DType,
    layout: &PoolLayout,
    cuda_graphs: bool,
) -> Result<(), CudaError> {
    let Some(mla) = &c.mla else {
        return Ok(());
    };
    let heads = c.num_attention_heads;
    if let Some(reason) = ops::mla_unsupported(dtype, layout, heads, mla.kv_lora_rank) {
        return Err(CudaError::invalid(format!(
            "the CUDA latent attention does not support {reason}"
        )));
    }
    if cuda_graphs {
        static EAGER: Once = Once::new();
        EAGER.call_once(|| {
            tracing::info!(
                "CUDA latent attention (MLA): decode steps replay from CUDA graphs per batch \
                 bucket (the split-KV decode's grid fixed per bucket, its plan uploaded before \
                 each replay); prefill, mixed and verification steps run eagerly (no piecewise \
                 graphs)"
            )
        });
    }
    Ok(())
}
