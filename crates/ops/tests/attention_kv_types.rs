//! f16 and q8_0 KV pools (`--cache-type-k/-v`): attention over them, on the gather and the
//! split-KV paths (prefill rows and decode rows), against (a) attention over the f32 pools
//! they were made from, within measured bounds, and (b) attention over f32 pools holding the
//! very values the quantized pools dequantize to, bit for bit (the quantized readers only
//! change where a row's f32 values come from, never the arithmetic).

#[path = "attention_reference.rs"]
mod reference;

use pagoda_ops::attention::{
    append_kv_pool, plan_step, step_attention, KvPool, KvType, PagedKv, SplitKvChunking,
    StepAttentionConfig, StepWorkspace,
};
use reference::{request, Fixture, PageOrder};

/// `(min_split_kv_tokens, path)`: every row gather, or every row split-KV.
const PATHS: [(usize, &str); 2] = [(usize::MAX, "gather"), (0, "split-KV")];

fn fixture(head_dim: usize, seed: u64) -> Fixture {
    let specs = [
        request(300, 0, 1),
        request(77, 0, 12), // a prefill chunk: 12 rows
        request(129, 33, 1),
        request(5, 0, 5),
    ];
    Fixture::new(&specs, 16, 3, 3, head_dim, PageOrder::Random, seed)
}

fn pool(kv_type: KvType, values: &[f32]) -> KvPool {
    let mut pool = KvPool::zeros(kv_type, values.len());
    pool.write(0, values);
    pool
}

fn dequantized(pool: &KvPool) -> Vec<f32> {
    let mut values = vec![0.0; pool.len()];
    pool.as_slice().read(0, &mut values);
    values
}

fn attend(fixture: &Fixture, k: &KvPool, v: &KvPool, min_split_kv_tokens: usize) -> Vec<f32> {
    let kv = PagedKv {
        k_pool: k.as_slice(),
        v_pool: v.as_slice(),
        ..fixture.kv()
    };
    let config = StepAttentionConfig {
        chunking: SplitKvChunking::new(fixture.layout.num_kv_heads, 64),
        min_split_kv_tokens,
    };
    let plan = plan_step(&kv, &fixture.qo_indptr, fixture.num_q_heads, &config).unwrap();
    let mut workspace = StepWorkspace::default();
    let mut out = vec![f32::NAN; fixture.output_len()];
    step_attention(
        &kv,
        &fixture.queries(),
        &plan,
        fixture.scale,
        &mut workspace,
        &mut out,
    )
    .unwrap();
    out
}

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// K/V uniform in [-1, 1]. Measured worst differences from the f32 pools over these fixtures
/// (both paths, head_dim 64 and 128): f16 2.6e-4, q8_0 4.5e-3; bounds about 3x.
#[test]
fn quantized_pools_match_f32_pools_within_bounds_on_both_paths() {
    for (kv_type, bound) in [(KvType::F16, 8e-4f32), (KvType::Q8_0, 1.5e-2)] {
        for head_dim in [64, 128] {
            let fixture = fixture(head_dim, head_dim as u64);
            let (k32, v32) = (
                KvPool::F32(fixture.k_pool.clone()),
                KvPool::F32(fixture.v_pool.clone()),
            );
            let (k, v) = (
                pool(kv_type, &fixture.k_pool),
                pool(kv_type, &fixture.v_pool),
            );
            let (k_back, v_back) = (KvPool::F32(dequantized(&k)), KvPool::F32(dequantized(&v)));
            for (min_split, path) in PATHS {
                let exact = attend(&fixture, &k32, &v32, min_split);
                let quantized = attend(&fixture, &k, &v, min_split);
                let worst = max_difference(&exact, &quantized);
                eprintln!("{kv_type} head_dim {head_dim} {path}: max |diff| vs f32 {worst:e}");
                assert!(worst <= bound, "{kv_type} {path}: {worst} > {bound}");
                assert!(worst > 0.0, "{kv_type} {path}: the pools did round");
                let same_values = attend(&fixture, &k_back, &v_back, min_split);
                assert!(
                    quantized
                        .iter()
                        .zip(&same_values)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{kv_type} {path}: not the f32 path's bits on the dequantized values"
                );
            }
            // K and V of different types.
            let mixed = attend(&fixture, &k32, &v, 0);
            let mixed_reference = attend(&fixture, &k32, &v_back, 0);
            assert!(mixed == mixed_reference, "{kv_type}: f32 K, quantized V");
        }
    }
}

#[test]
fn append_kv_pool_quantizes_rows_at_their_slots() {
    let fixture = fixture(64, 7);
    let layout = fixture.layout;
    let stride = layout.token_stride();
    let slots: Vec<pagoda_kv::Slot> = (0..3)
        .map(|token| pagoda_kv::Slot {
            page: pagoda_kv::PageId(2),
            offset: token as u32 * 5,
        })
        .collect();
    let new: Vec<f32> = (0..3 * stride).map(|i| (i as f32 * 0.37).sin()).collect();
    for kv_type in [KvType::F16, KvType::Q8_0] {
        let mut k = pool(kv_type, &fixture.k_pool);
        let mut v = pool(kv_type, &fixture.v_pool);
        let before = dequantized(&k);
        append_kv_pool(&mut k, &mut v, &layout, &slots, &new, &new).unwrap();
        let after = dequantized(&k);
        let expected = dequantized(&pool(kv_type, &new));
        for (token, slot) in slots.iter().enumerate() {
            let row = slot.physical_index(layout.page_size) * stride;
            assert!(after[row..row + stride] == expected[token * stride..(token + 1) * stride]);
        }
        let untouched = layout.head_offset(0, 0, 0);
        assert!(after[untouched..stride] == before[untouched..stride]);
        let v_after = dequantized(&v);
        let slot_row = slots[1].physical_index(layout.page_size) * stride;
        assert!(v_after[slot_row..slot_row + stride] == expected[stride..2 * stride]);
        let bad = KvPool::zeros(kv_type, layout.pool_len() - 32);
        let mut short = bad.clone();
        let mut other = bad;
        assert!(append_kv_pool(&mut short, &mut other, &layout, &slots, &new, &new).is_err());
    }
    let odd = pagoda_ops::attention::KvLayout {
        head_dim: 48,
        ..layout
    };
    let mut k = KvPool::zeros(KvType::Q8_0, odd.pool_len());
    let mut v = KvPool::zeros(KvType::Q8_0, odd.pool_len());
    let new48 = vec![0.5; 3 * odd.token_stride()];
    let error = append_kv_pool(&mut k, &mut v, &odd, &slots, &new48, &new48).unwrap_err();
    assert!(error.to_string().contains("head_dim"), "{error}");
}
