//! The streaming prefill's tiling per step: the configuration's, else the tuning table's row
//! for the step's bucket (requests x prompt tokens per request, powers of two), else the
//! built-in heuristic ([`ops::PrefillStreamTiling::heuristic`]). Each bucket's choice is
//! made once, logged once, and reused by every later step of the bucket (so a step and its
//! counters see the same choice).

use std::collections::HashMap;
use std::sync::Mutex;

use pagoda_ops::cuda::{self as ops, PrefillKernel};

use super::VariantSource;

/// The prefill kernel asked for and how the streaming kernel's tiling is chosen.
pub struct PrefillChoice {
    asked: PrefillKernel,
    forced: Option<ops::PrefillStreamTiling>,
    geometry: ops::DecodeGeometry,
    table: Option<ops::TuningTable>,
    chosen: Mutex<HashMap<ops::DecodeBucket, (PrefillKernel, VariantSource)>>,
}

impl PrefillChoice {
    /// The kernel a step of `requests` requests and `tokens` tokens runs in `T` at
    /// `head_dim`: the choice for its bucket, falling back where it does not run (the
    /// tensor-core kernels run bf16 at their head dims, where they compile: the streaming
    /// kernel falls back to WMMA, head_dim 256, WMMA to the tiled kernel).
    pub fn runnable<T: pagoda_cuda::Element>(
        &self,
        gpu: &pagoda_cuda::Gpu,
        head_dim: usize,
        requests: usize,
        tokens: usize,
    ) -> PrefillKernel {
        let bf16 = T::DTYPE == pagoda_cuda::DType::BF16;
        let mma =
            bf16 && ops::MMA_PREFILL_HEAD_DIMS.contains(&head_dim) && mma_compiles(gpu, head_dim);
        match self.choose(requests, tokens).0 {
            PrefillKernel::Stream(tiling)
                if bf16 && ops::STREAM_PREFILL_HEAD_DIMS.contains(&head_dim) =>
            {
                PrefillKernel::Stream(tiling)
            }
            PrefillKernel::Stream(_) | PrefillKernel::Mma if mma => PrefillKernel::Mma,
            PrefillKernel::Stream(_) | PrefillKernel::Mma => PrefillKernel::Tiled,
            other => other,
        }
    }

    /// `asked` (from the configuration, or the per-token oracle in deterministic mode), the
    /// configured tiling if any, and the tuning table (`None`: none loaded).
    pub fn new(
        asked: PrefillKernel,
        forced: Option<ops::PrefillStreamTiling>,
        geometry: ops::DecodeGeometry,
        table: Option<ops::TuningTable>,
    ) -> Self {
        PrefillChoice {
            asked,
            forced,
            geometry,
            table,
            chosen: Mutex::new(HashMap::new()),
        }
    }

    /// The kernel asked for (the streaming kernel's tiling is chosen per step).
    pub fn asked(&self) -> PrefillKernel {
        self.asked
    }

    /// The kernel of a prefill step of `requests` requests and `tokens` query rows in all,
    /// and where its tiling came from (`Configured` for the non-streaming kernels).
    pub fn choose(&self, requests: usize, tokens: usize) -> (PrefillKernel, VariantSource) {
        if !matches!(self.asked, PrefillKernel::Stream(_)) {
            return (self.asked, VariantSource::Configured);
        }
        let requests = requests.max(1);
        let bucket = ops::DecodeBucket::of(requests, tokens.div_ceil(requests));
        let mut chosen = self.chosen.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&choice) = chosen.get(&bucket) {
            return choice;
        }
        let (tiling, source) = match (self.forced, &self.table) {
            (Some(tiling), _) => (tiling, VariantSource::Configured),
            (None, table) => match table
                .as_ref()
                .and_then(|t| t.prefill_tiling(&self.geometry, bucket))
            {
                Some(tiling) => (tiling, VariantSource::Tuned),
                None => (
                    ops::PrefillStreamTiling::heuristic(bucket.batch, bucket.context),
                    VariantSource::Heuristic,
                ),
            },
        };
        let how = match source {
            VariantSource::Tuned => "tuned",
            VariantSource::Heuristic => "heuristic (no tuned row)",
            VariantSource::Configured => "configured",
        };
        tracing::info!(
            "CUDA streaming prefill, requests <= {} and prompts <= {} tokens: tiling {tiling} \
             ({how})",
            bucket.batch,
            bucket.context
        );
        let choice = (PrefillKernel::Stream(tiling), source);
        chosen.insert(bucket, choice);
        choice
    }
}

/// Whether the tensor-core prefill compiles here (its `<mma.h>` needs the CUDA `crt` headers,
/// which a runtime-only install may lack); a failure is logged once and the tiled kernel runs.
fn mma_compiles(gpu: &pagoda_cuda::Gpu, head_dim: usize) -> bool {
    static CHECKED: Mutex<Option<HashMap<usize, bool>>> = Mutex::new(None);
    let mut checked = CHECKED.lock().unwrap_or_else(|e| e.into_inner());
    *checked
        .get_or_insert_with(HashMap::new)
        .entry(head_dim)
        .or_insert_with(|| {
            let compiled = ops::specialize_prefill_mma(pagoda_cuda::DType::BF16, head_dim)
                .and_then(|spec| gpu.prepare(&spec));
            match compiled {
                Ok(()) => true,
                Err(error) => {
                    tracing::warn!(
                        "tensor-core prefill unavailable ({error}); using the tiled kernel \
                         (install the CUDA crt headers, e.g. the nvidia-cuda-crt wheel, and \
                         point PAGODA_CUDA_INCLUDE at them)"
                    );
                    false
                }
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> ops::DecodeGeometry {
        ops::DecodeGeometry {
            q_heads: 32,
            kv_heads: 8,
            head_dim: 128,
            page_size: 16,
            dtype: "bf16".into(),
        }
    }

    #[test]
    fn configured_then_tuned_then_heuristic() {
        let stream = PrefillKernel::Stream(ops::PrefillStreamTiling::DEFAULT);
        let key = ops::TableKey {
            gpu: "NVIDIA H200".into(),
            driver: 13000,
            sources: ops::tuned_sources_hash(),
        };
        let mut table = ops::TuningTable::new(key);
        let tuned = ops::PrefillStreamTiling::new(64, 32, 2);
        table.insert_prefill(ops::TunedPrefill {
            geometry: geometry(),
            bucket: ops::DecodeBucket::of(4, 8192),
            tiling: tuned.to_string(),
            tuned_us: 1.0,
            heuristic_us: 2.0,
        });
        let choice = PrefillChoice::new(stream, None, geometry(), Some(table.clone()));
        // 4 requests of 8192 tokens (32768 rows): the table's row.
        assert_eq!(
            choice.choose(4, 32768),
            (PrefillKernel::Stream(tuned), VariantSource::Tuned)
        );
        // Three requests of 6000 rows share the bucket (4, 8192).
        assert_eq!(choice.choose(3, 18000).1, VariantSource::Tuned);
        // No row: the heuristic, small and large.
        let small = ops::PrefillStreamTiling::heuristic(1, 512);
        assert_eq!(
            choice.choose(1, 300),
            (PrefillKernel::Stream(small), VariantSource::Heuristic)
        );
        assert_eq!(
            choice.choose(16, 16 * 4096),
            (
                PrefillKernel::Stream(ops::PrefillStreamTiling::DEFAULT),
                VariantSource::Heuristic
            )
        );
        // The configuration wins over the table.
        let forced = ops::PrefillStreamTiling::new(128, 32, 2);
        let choice = PrefillChoice::new(stream, Some(forced), geometry(), Some(table));
        assert_eq!(
            choice.choose(4, 32768),
            (PrefillKernel::Stream(forced), VariantSource::Configured)
        );
        // Another kernel asked for: no tiling to choose.
        let choice = PrefillChoice::new(PrefillKernel::Mma, None, geometry(), None);
        assert_eq!(
            choice.choose(4, 32768),
            (PrefillKernel::Mma, VariantSource::Configured)
        );
    }
}
