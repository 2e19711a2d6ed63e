//! DeepSeek's latent attention (MLA) on CUDA: its pool is one row of latent + rope key per
//! token (the config's one KV head of `head_dim` = the latent row), and its steps run eagerly.

use std::sync::Once;

use pagoda_cuda::{CudaError, DType};
use pagoda_models::config::ModelConfig;
use pagoda_ops::cuda::{self as ops, PoolLayout};

/// Checks a latent attention model's pool against the MLA kernels, and says once that its steps
/// run eagerly when graphs were asked for (its decode plan is uploaded from the host per step,
/// ADR 0009; no decode or piecewise graphs yet).
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
                "CUDA latent attention (MLA): every step runs eagerly (its decode plan is \
                 uploaded from the host per step; no decode or piecewise graphs yet)"
            )
        });
    }
    Ok(())
}
