//! The batch-size buckets decode and verification steps are padded to, each with a CUDA
//! graph of its own (see `step.rs`).

use pagoda_models::llama_cuda::Attention;

/// Smallest graph bucket holding `num_requests` decode rows: powers of two, capped at the
/// step buffers' limit (`max`), which is a bucket of its own.
pub(super) fn graph_bucket(num_requests: usize, max: usize) -> Option<usize> {
    if num_requests == 0 || num_requests > max {
        return None;
    }
    Some(num_requests.next_power_of_two().min(max))
}

/// Most rows a request may bring to a graph-replayed verification step (16 guesses and the
/// pending token).
const MAX_VERIFY_ROWS: usize = 17;

/// The graph shape of a verification step (speculative decoding: every row needs logits, each
/// request brings 1 to `q` rows, some more than one): `(requests, q)`, requests rounded up to
/// a bucket with room for a padding request that holds the padding rows (every padded
/// request's rows but the first padding request's are empty). `None` when it does not fit
/// the step buffers (`max_requests`, `max_tokens`): then the step runs eagerly.
pub(super) fn verify_bucket(
    qo_indptr: &[u32],
    max_requests: usize,
    max_tokens: usize,
) -> Option<(usize, usize)> {
    let requests = qo_indptr.len().checked_sub(1)?;
    let tokens = *qo_indptr.last()? as usize;
    let q = qo_indptr.windows(2).map(|w| (w[1] - w[0]) as usize).max()?;
    if !(2..=MAX_VERIFY_ROWS).contains(&q) {
        return None;
    }
    let mut bucket = graph_bucket(requests, max_requests)?;
    if bucket == requests && tokens < bucket * q {
        bucket = graph_bucket(requests + 1, max_requests)?;
        if bucket == requests {
            return None;
        }
    }
    (bucket * q <= max_tokens).then_some((bucket, q))
}

/// The graph cache's key of a step shape: the bucket for decode steps (one row per
/// request), `(requests << 32) | rows` for verification steps; a fused decode's variant
/// code above both (a bucket holds one graph per variant its steps ran). A latent attention
/// decode's grid is its bucket's ([`Attention::Latent`]): the bucket keys it.
pub(super) fn graph_key(num_requests: usize, num_tokens: usize, attention: &Attention) -> usize {
    let rows = if num_requests == num_tokens {
        num_tokens
    } else {
        (num_requests << 32) | num_tokens
    };
    match attention {
        Attention::Fused { variant, .. } => rows | ((variant.code() as usize) << 48),
        // Cascade steps replay their own graphs: the shared level's tile rows pick its kernel.
        Attention::Cascade {
            variant,
            rows: tile,
            ..
        } => rows | ((variant.code() as usize) << 48) | (1 << 46) | (usize::from(*tile > 64) << 45),
        // Sparse steps too: the selection's grid (`sparse_grid_pages`) is captured.
        Attention::Sparse {
            variant,
            grid_pages,
            ..
        } => {
            let pages = pagoda_models::llama_cuda::sparse_grid_code(*grid_pages);
            rows | ((variant.code() as usize) << 48) | (1 << 47) | (pages << 40)
        }
        _ => rows,
    }
}

/// Every graph bucket up to `max`: the powers of two below it, then `max`.
pub(super) fn graph_buckets(max: usize) -> Vec<usize> {
    let mut buckets: Vec<usize> = (0..usize::BITS)
        .map(|shift| 1usize << shift)
        .take_while(|&bucket| bucket < max)
        .collect();
    if max > 0 {
        buckets.push(max);
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagoda_models::llama_cuda::VariantSource;

    #[test]
    fn verification_steps_pad_to_a_bucket_with_a_padding_request() {
        // Three requests of 5, 3 and 1 rows: 4 requests of 5 rows, the fourth holding the
        // padding.
        assert_eq!(verify_bucket(&[0, 5, 8, 9], 64, 512), Some((4, 5)));
        // Four full requests: no padding request needed.
        assert_eq!(verify_bucket(&[0, 3, 6, 9, 12], 64, 512), Some((4, 3)));
        // Four requests, one short: the bucket grows to make room for the padding.
        assert_eq!(verify_bucket(&[0, 3, 6, 9, 11], 64, 512), Some((8, 3)));
        // Decode rows, too many rows per request, or past the buffers: eager.
        assert_eq!(verify_bucket(&[0, 1, 2], 64, 512), None);
        assert_eq!(verify_bucket(&[0, 18], 64, 512), None);
        assert_eq!(verify_bucket(&[0, 9, 18], 64, 16), None);
        assert_eq!(verify_bucket(&[0, 2, 3, 4, 5], 4, 512), None);
        let prefill = Attention::Prefill;
        assert_ne!(graph_key(4, 20, &prefill), graph_key(20, 20, &prefill));
        let fused = |waves| Attention::Fused {
            source: VariantSource::Heuristic,
            grid_chunks: 64,
            variant: pagoda_ops::cuda::DecodeVariant {
                waves,
                ..pagoda_ops::cuda::DecodeVariant::heuristic(true, 128)
            },
        };
        assert_ne!(graph_key(4, 4, &fused(2)), graph_key(4, 4, &fused(4)));
        assert_ne!(graph_key(4, 4, &fused(2)), graph_key(4, 4, &prefill));
        // Cascade steps have graphs of their own, one per shared tile height.
        let cascade = |rows| Attention::Cascade {
            source: VariantSource::Heuristic,
            grid_chunks: 64,
            variant: pagoda_ops::cuda::DecodeVariant::heuristic(true, 128),
            rows,
        };
        assert_ne!(graph_key(4, 4, &cascade(64)), graph_key(4, 4, &fused(0)));
        assert_ne!(
            graph_key(4, 4, &cascade(64)),
            graph_key(4, 4, &cascade(128))
        );
        // A latent attention decode's grid follows its bucket: the bucket is the key.
        let latent = Attention::Latent { grid_chunks: 40 };
        assert_eq!(graph_key(4, 4, &latent), 4);
        assert_ne!(graph_key(4, 4, &latent), graph_key(8, 8, &latent));
    }

    #[test]
    fn buckets_are_powers_of_two_capped_at_the_limit() {
        assert_eq!(graph_bucket(0, 64), None);
        assert_eq!(graph_bucket(1, 64), Some(1));
        assert_eq!(graph_bucket(3, 64), Some(4));
        assert_eq!(graph_bucket(33, 64), Some(64));
        assert_eq!(graph_bucket(40, 48), Some(48));
        assert_eq!(graph_bucket(49, 48), None);
    }

    #[test]
    fn bucket_list_covers_every_batch_size() {
        assert_eq!(graph_buckets(1), vec![1]);
        assert_eq!(graph_buckets(8), vec![1, 2, 4, 8]);
        assert_eq!(graph_buckets(48), vec![1, 2, 4, 8, 16, 32, 48]);
        for max in 1..100 {
            let buckets = graph_buckets(max);
            for n in 1..=max {
                assert!(
                    buckets.contains(&graph_bucket(n, max).unwrap()),
                    "{n} of {max}"
                );
            }
        }
    }
}
