//! Absorbed MLA (`pagoda_ops::attention::mla_attention` over a latent paged cache) against
//! the expanded form in float64: per head, keys `[W_UK_h c, k_rope]` and values `W_UV_h c`
//! decompressed from the same latents, plain causal softmax attention, then `W_UV` applied
//! to the absorbed output. The two forms are the same function; they must agree to f32 noise.

use pagoda_kv::{PageId, PageTable, PageTableRequest, Slot};
use pagoda_ops::attention::{append_latent, mla_attention, KvLayout, KvPool, KvType, LatentKv};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const HEADS: usize = 4;
const LATENT: usize = 32;
const ROPE: usize = 8;
const NOPE: usize = 16;
const V_DIM: usize = 12;
const ROW: usize = LATENT + ROPE;

fn random(len: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

#[test]
fn absorbed_mla_equals_the_expanded_form() {
    let mut rng = ChaCha8Rng::seed_from_u64(907);
    let page_size = 4;
    let num_pages = 16;
    // Two requests: one prefilling 7 tokens over 3 cached, one decoding 1 over 9 cached.
    let lens = [10usize, 10];
    let q_lens = [7usize, 1];
    let pages: [Vec<PageId>; 2] = [
        vec![PageId(9), PageId(2), PageId(14)],
        vec![PageId(5), PageId(0), PageId(11)],
    ];
    let w_uk = random(HEADS * NOPE * LATENT, &mut rng); // [H, NOPE, LATENT]
    let w_uv = random(HEADS * V_DIM * LATENT, &mut rng); // [H, V_DIM, LATENT]
    let rows: Vec<Vec<f32>> = lens.iter().map(|&n| random(n * ROW, &mut rng)).collect();
    let layout = KvLayout {
        num_pages,
        page_size,
        num_kv_heads: 1,
        head_dim: ROW,
    };
    let mut pool = KvPool::zeros(KvType::F32, layout.pool_len());
    for (request, rows) in rows.iter().enumerate() {
        let slots: Vec<Slot> = (0..lens[request])
            .map(|t| Slot {
                page: pages[request][t / page_size],
                offset: (t % page_size) as u32,
            })
            .collect();
        append_latent(&mut pool, &layout, &slots, rows).unwrap();
    }
    let requests: Vec<PageTableRequest<'_>> = (0..2)
        .map(|r| PageTableRequest {
            pages: &pages[r],
            num_tokens: lens[r],
            logical_start: 0,
        })
        .collect();
    let table = PageTable::build(&requests, num_pages, page_size).unwrap();
    let num_queries: usize = q_lens.iter().sum();
    let q_nope = random(num_queries * HEADS * NOPE, &mut rng);
    let q_rope = random(num_queries * HEADS * ROPE, &mut rng);
    let scale = 1.0 / ((NOPE + ROPE) as f32).sqrt() * 1.3;

    // Absorbed: q_latent = W_UK_h^T q_nope_h, then W_UV_h on the latent output.
    let mut q = vec![0f32; num_queries * HEADS * ROW];
    for t in 0..num_queries {
        for h in 0..HEADS {
            let out = &mut q[(t * HEADS + h) * ROW..][..ROW];
            for l in 0..LATENT {
                out[l] = (0..NOPE)
                    .map(|d| q_nope[(t * HEADS + h) * NOPE + d] * w_uk[(h * NOPE + d) * LATENT + l])
                    .sum();
            }
            out[LATENT..].copy_from_slice(&q_rope[(t * HEADS + h) * ROPE..][..ROPE]);
        }
    }
    let qo_indptr = [0u32, q_lens[0] as u32, num_queries as u32];
    let mut latent_out = vec![0f32; num_queries * HEADS * LATENT];
    let kv = LatentKv {
        pool: pool.as_slice(),
        layout,
        page_table: &table,
    };
    mla_attention(&kv, &q, &qo_indptr, HEADS, LATENT, scale, &mut latent_out).unwrap();

    let mut worst = 0f64;
    let mut query = 0;
    for (request, rows) in rows.iter().enumerate() {
        for j in 0..q_lens[request] {
            let visible = lens[request] - q_lens[request] + j + 1;
            for h in 0..HEADS {
                // Expanded keys and values of this head, in f64.
                let latent = |t: usize| &rows[t * ROW..t * ROW + LATENT];
                let up = |w: &[f32], dims: usize, t: usize| -> Vec<f64> {
                    (0..dims)
                        .map(|d| {
                            (0..LATENT)
                                .map(|l| {
                                    w[(h * dims + d) * LATENT + l] as f64 * latent(t)[l] as f64
                                })
                                .sum()
                        })
                        .collect()
                };
                let scores: Vec<f64> = (0..visible)
                    .map(|t| {
                        let k_nope = up(&w_uk, NOPE, t);
                        let nope: f64 = (0..NOPE)
                            .map(|d| q_nope[(query * HEADS + h) * NOPE + d] as f64 * k_nope[d])
                            .sum();
                        let rope: f64 = (0..ROPE)
                            .map(|d| {
                                q_rope[(query * HEADS + h) * ROPE + d] as f64
                                    * rows[t * ROW + LATENT + d] as f64
                            })
                            .sum();
                        (nope + rope) * scale as f64
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                let mut expected = [0f64; V_DIM];
                for (t, s) in scores.iter().enumerate() {
                    let p = (s - max).exp() / total;
                    for (e, v) in expected.iter_mut().zip(up(&w_uv, V_DIM, t)) {
                        *e += p * v;
                    }
                }
                let out = &latent_out[(query * HEADS + h) * LATENT..][..LATENT];
                for (d, want) in expected.iter().enumerate() {
                    let got: f64 = (0..LATENT)
                        .map(|l| w_uv[(h * V_DIM + d) * LATENT + l] as f64 * out[l] as f64)
                        .sum();
                    worst = worst.max((got - want).abs() / want.abs().max(1.0));
                }
            }
            query += 1;
        }
    }
    assert!(
        worst < 2e-5,
        "absorbed vs expanded: worst relative error {worst}"
    );
}

#[test]
fn a_latent_cache_with_other_geometry_is_refused() {
    let layout = KvLayout {
        num_pages: 1,
        page_size: 4,
        num_kv_heads: 2,
        head_dim: ROW,
    };
    let pool = KvPool::zeros(KvType::F32, layout.pool_len());
    let table = PageTable::build(&[], 1, 4).unwrap();
    let kv = LatentKv {
        pool: pool.as_slice(),
        layout,
        page_table: &table,
    };
    let error = mla_attention(&kv, &[], &[0], HEADS, LATENT, 1.0, &mut []).unwrap_err();
    assert!(error.to_string().contains("one head"), "{error}");
}

#[test]
fn an_f16_latent_pool_attends_like_the_f32_one_to_its_rounding() {
    let mut rng = ChaCha8Rng::seed_from_u64(37);
    let (page_size, num_pages, len) = (4, 4, 11);
    let layout = KvLayout {
        num_pages,
        page_size,
        num_kv_heads: 1,
        head_dim: ROW,
    };
    let pages = [PageId(3), PageId(1), PageId(0)];
    let slots: Vec<Slot> = (0..len)
        .map(|t| Slot {
            page: pages[t / page_size],
            offset: (t % page_size) as u32,
        })
        .collect();
    let rows = random(len * ROW, &mut rng);
    let table = PageTable::build(
        &[PageTableRequest {
            pages: &pages,
            num_tokens: len,
            logical_start: 0,
        }],
        num_pages,
        page_size,
    )
    .unwrap();
    let q = random(HEADS * ROW, &mut rng);
    let mut outputs = Vec::new();
    for kv_type in [KvType::F32, KvType::F16] {
        let mut pool = KvPool::zeros(kv_type, layout.pool_len());
        append_latent(&mut pool, &layout, &slots, &rows).unwrap();
        let kv = LatentKv {
            pool: pool.as_slice(),
            layout,
            page_table: &table,
        };
        let mut out = vec![0f32; HEADS * LATENT];
        mla_attention(&kv, &q, &[0, 1], HEADS, LATENT, 0.2, &mut out).unwrap();
        outputs.push(out);
    }
    let worst = outputs[0]
        .iter()
        .zip(&outputs[1])
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    // f16 keeps 11 bits: values in [-1, 1) move by at most 2^-11.
    assert!(worst < 4e-3, "f16 latent pool off by {worst}");
    assert!(worst > 0.0, "the f16 pool did not round anything");
}
