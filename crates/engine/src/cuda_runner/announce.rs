//! The one-time INFO lines that name the path a CUDA step took (the first step of each).

use std::sync::Once;

/// Logs, once per process, what the step path `path` runs (`graphs`, `eager`, `gather`,
/// `fused`, `latent`, `pieces`, `mixed`, else the prefill kernel).
pub(super) fn announce(path: &'static str) {
    static GRAPHS: Once = Once::new();
    static EAGER: Once = Once::new();
    static GATHER: Once = Once::new();
    static FUSED: Once = Once::new();
    static PREFILL: Once = Once::new();
    static MIXED: Once = Once::new();
    static PIECES: Once = Once::new();
    static LATENT: Once = Once::new();
    let once = match path {
        "latent" => &LATENT,
        "pieces" => &PIECES,
        "mixed" => &MIXED,
        "graphs" => &GRAPHS,
        "eager" => &EAGER,
        "gather" => &GATHER,
        "fused" => &FUSED,
        _ => &PREFILL,
    };
    once.call_once(|| match path {
        "graphs" => tracing::info!(
            "CUDA decode steps: replayed from CUDA graphs per batch bucket (speculative \
             verification steps per batch bucket and rows per request)"
        ),
        "eager" => tracing::info!("CUDA steps: kernels launched from the host (no graph)"),
        "gather" => {
            tracing::info!("CUDA decode attention: gather the pages, then attend (split keys)")
        }
        "fused" => tracing::info!(
            "CUDA decode attention: fused split-KV paged decode (pages read in place, chunks \
             merged in the same launch)"
        ),
        "latent" => tracing::info!(
            "CUDA latent attention (MLA) decode steps: the split-KV absorbed decode, its grid \
             fixed per batch bucket"
        ),
        "pieces" => tracing::info!(
            "CUDA prefill and mixed steps of up to PAGODA_CUDA_PIECEWISE_TOKENS tokens: \
             piecewise graphs per 16-token bucket (attention and the LM head launched between \
             the pieces)"
        ),
        "mixed" => tracing::info!(
            "CUDA mixed steps: decode rows on the fused paged decode, prefill chunks on the \
             prefill kernel (PAGODA_CUDA_MIXED_STEPS=split)"
        ),
        _ => tracing::info!(
            "CUDA attention: ragged prefill kernel over the paged cache (prefill steps, and \
             mixed steps where they are not split)"
        ),
    });
}
