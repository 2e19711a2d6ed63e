//! GPU tests of the e4m3 KV cache (ignored without `--include-ignored`: they need a GPU):
//!
//! - the appends (plain and fused with RoPE) write exactly the bytes and scales of the host
//!   quantizer (`pagoda_ops::attention::fp8`, which is unit-tested against known e4m3 values);
//! - the CUDA-core fused decode and the tiled prefill over the fp8 cache match an f64
//!   attention over the dequantized values (tight: the bf16 output's rounding), and the same
//!   kernels over a bf16 cache of the original values within a looser bound (e4m3's 3
//!   mantissa bits; the observed error is printed);
//! - the streaming tensor-core decode over the fp8 cache, every tiling, matches the same f64
//!   attention (batch and context shapes with partial pages, GQA groups 1 to 8, both merges),
//!   and so does the streaming tensor-core prefill at every tiling (head_dim 64 and 128).

#[path = "gpu_common/mod.rs"]
mod common;

use common::decode_batch::{peak_error, Batch};
use common::prefill_batch::{self, Bf16Batch, STANDARD_SHAPES};
use common::*;
use half::bf16;
use pagoda_cuda::{view, Gpu};
use pagoda_ops::attention::fp8;
use pagoda_ops::cuda::{
    self as ops, DevicePageTable, Fp8KvLayer, MergeMode, PagedDecodeKernel, PagedDecodePlan,
    PagedDecodeWorkspace, PagedKv, PlanCapacity, PlanPolicy, PoolLayout, Queries, RopeStyle,
    StreamTiling,
};

const NUM_KV_HEADS: usize = 2;

/// A cache's values quantized on the host: bytes, scales, and what they stand for.
struct HostFp8 {
    k: Vec<u8>,
    v: Vec<u8>,
    k_scale: Vec<f32>,
    v_scale: Vec<f32>,
    k_values: Vec<f32>,
    v_values: Vec<f32>,
}

fn quantize_pool(values: &[f32], head_dim: usize) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let mut bytes = vec![0u8; values.len()];
    let mut scales = Vec::new();
    let mut back = Vec::with_capacity(values.len());
    for (head, out) in values.chunks(head_dim).zip(bytes.chunks_mut(head_dim)) {
        let scale = fp8::quantize_head(head, out);
        back.extend(fp8::dequantize_head(out, scale));
        scales.push(scale);
    }
    (bytes, scales, back)
}

impl HostFp8 {
    fn new(k: &[f32], v: &[f32], head_dim: usize) -> Self {
        let (k, k_scale, k_values) = quantize_pool(k, head_dim);
        let (v, v_scale, v_values) = quantize_pool(v, head_dim);
        HostFp8 {
            k,
            v,
            k_scale,
            v_scale,
            k_values,
            v_values,
        }
    }

    fn upload(&self, gpu: &Gpu) -> Fp8KvLayer {
        Fp8KvLayer {
            k: gpu.upload(&self.k).unwrap(),
            v: gpu.upload(&self.v).unwrap(),
            k_scale: gpu.upload(&self.k_scale).unwrap(),
            v_scale: gpu.upload(&self.v_scale).unwrap(),
        }
    }
}

/// bf16-rounded random values with a few loud heads (x `loud`) and silent ones (zeros):
/// the per-head scales must follow both.
fn kv_values(
    rng: &mut rand_chacha::ChaCha8Rng,
    len: usize,
    head_dim: usize,
    loud: f32,
) -> Vec<f32> {
    let mut values = random_vec(rng, len, 1.0);
    for (index, head) in values.chunks_mut(head_dim).enumerate() {
        match index % 37 {
            5 => head.iter_mut().for_each(|x| *x *= loud),
            11 => head.iter_mut().for_each(|x| *x = 0.0),
            _ => {}
        }
    }
    round::<bf16>(&values)
}

fn assert_layer_equals(gpu: &Gpu, what: &str, layer: &Fp8KvLayer, host: &HostFp8) {
    assert_eq!(gpu.download(&layer.k).unwrap(), host.k, "{what}: K bytes");
    assert_eq!(gpu.download(&layer.v).unwrap(), host.v, "{what}: V bytes");
    let bits = |x: Vec<f32>| x.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    assert_eq!(
        bits(gpu.download(&layer.k_scale).unwrap()),
        bits(host.k_scale.clone()),
        "{what}: K scales"
    );
    assert_eq!(
        bits(gpu.download(&layer.v_scale).unwrap()),
        bits(host.v_scale.clone()),
        "{what}: V scales"
    );
}

#[test]
#[ignore = "needs a GPU"]
fn fp8_appends_write_the_host_quantizers_bytes() {
    let gpu = gpu();
    for head_dim in [64, 128, 256] {
        let mut rng = rng(head_dim as u64);
        let layout = PoolLayout {
            num_pages: 6,
            page_size: 16,
            num_kv_heads: NUM_KV_HEADS,
            head_dim,
        };
        let slots_total = layout.num_pages * layout.page_size;
        let stride = layout.token_stride();
        // Every slot written once, in a scattered order, from rows 3 * stride apart (k and v
        // interleaved with padding as in a QKV buffer), plus two padding rows (slot -1).
        let mut slots: Vec<i32> = (0..slots_total as i32).collect();
        slots.reverse();
        slots.swap(3, 40);
        slots.extend([-1, slots_total as i32]);
        let rows = slots.len();
        let k_rows = kv_values(&mut rng, rows * stride, head_dim, 40.0);
        let v_rows = kv_values(&mut rng, rows * stride, head_dim, 40.0);
        let mut packed = vec![0f32; rows * 3 * stride];
        for t in 0..rows {
            packed[t * 3 * stride..][..stride].copy_from_slice(&k_rows[t * stride..][..stride]);
            packed[t * 3 * stride + stride..][..stride]
                .copy_from_slice(&v_rows[t * stride..][..stride]);
        }
        // The expected pool: slot s holds the row whose slot is s.
        let (mut k_pool, mut v_pool) =
            (vec![0f32; layout.pool_len()], vec![0f32; layout.pool_len()]);
        for (t, &slot) in slots.iter().enumerate() {
            if slot >= 0 && (slot as usize) < slots_total {
                let s = slot as usize;
                k_pool[s * stride..][..stride].copy_from_slice(&k_rows[t * stride..][..stride]);
                v_pool[s * stride..][..stride].copy_from_slice(&v_rows[t * stride..][..stride]);
            }
        }
        let host = HostFp8::new(&k_pool, &v_pool, head_dim);
        let device_rows = upload::<bf16>(&gpu, &packed);
        let device_slots = gpu.upload(&slots).unwrap();
        let new = ops::NewKv {
            k: view(&device_rows, 0..rows * 3 * stride).unwrap(),
            v: view(&device_rows, stride..rows * 3 * stride).unwrap(),
            row_strides: (3 * stride, 3 * stride),
            slots: view(&device_slots, 0..rows).unwrap(),
        };
        let mut layer = Fp8KvLayer::new(&gpu, &layout).unwrap();
        ops::kv_append_fp8(&gpu, &new, &mut layer, &layout).unwrap();
        assert_layer_equals(&gpu, &format!("kv_append_fp8 D{head_dim}"), &layer, &host);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn fused_rope_append_writes_the_bytes_of_rope_then_append() {
    let gpu = gpu();
    for (head_dim, style) in [(64, RopeStyle::Interleaved), (128, RopeStyle::Halves)] {
        let mut rng = rng(7 + head_dim as u64);
        let layout = PoolLayout {
            num_pages: 4,
            page_size: 16,
            num_kv_heads: NUM_KV_HEADS,
            head_dim,
        };
        let num_q_heads = 4 * NUM_KV_HEADS;
        let width = (num_q_heads + 2 * NUM_KV_HEADS) * head_dim;
        let tokens = 37;
        let qkv = kv_values(&mut rng, tokens * width, head_dim, 40.0);
        let positions: Vec<u32> = (0..tokens as u32).map(|t| 3 * t + 1).collect();
        let inv_freq: Vec<f32> = (0..head_dim / 2)
            .map(|i| 10000f32.powf(-2.0 * i as f32 / head_dim as f32))
            .collect();
        let mut slots: Vec<i32> = (0..tokens as i32).map(|t| (t * 5) % 64).collect();
        slots[9] = -1;
        let (positions, inv_freq) = (
            gpu.upload(&positions).unwrap(),
            gpu.upload(&inv_freq).unwrap(),
        );
        let slots = gpu.upload(&slots).unwrap();
        // Fused.
        let mut fused_qkv = upload::<bf16>(&gpu, &qkv);
        let mut fused = Fp8KvLayer::new(&gpu, &layout).unwrap();
        ops::rope_kv_append_fp8(
            &gpu,
            &mut fused_qkv,
            (&positions, &inv_freq, style),
            (num_q_heads, width),
            (&slots, &mut fused),
            &layout,
        )
        .unwrap();
        // RoPE, then the plain fp8 append.
        let mut split_qkv = upload::<bf16>(&gpu, &qkv);
        let heads = (num_q_heads + NUM_KV_HEADS, head_dim, width);
        ops::rope(&gpu, &mut split_qkv, &positions, &inv_freq, heads, style).unwrap();
        let mut split = Fp8KvLayer::new(&gpu, &layout).unwrap();
        let q_dim = num_q_heads * head_dim;
        let new = ops::NewKv {
            k: view(&split_qkv, q_dim..tokens * width).unwrap(),
            v: view(&split_qkv, q_dim + layout.token_stride()..tokens * width).unwrap(),
            row_strides: (width, width),
            slots: view(&slots, 0..tokens).unwrap(),
        };
        ops::kv_append_fp8(&gpu, &new, &mut split, &layout).unwrap();
        assert_eq!(
            download(&gpu, &fused_qkv),
            download(&gpu, &split_qkv),
            "rotated qkv"
        );
        let host = HostFp8 {
            k: gpu.download(&split.k).unwrap(),
            v: gpu.download(&split.v).unwrap(),
            k_scale: gpu.download(&split.k_scale).unwrap(),
            v_scale: gpu.download(&split.v_scale).unwrap(),
            k_values: Vec::new(),
            v_values: Vec::new(),
        };
        assert_layer_equals(
            &gpu,
            &format!("rope_kv_append_fp8 D{head_dim}"),
            &fused,
            &host,
        );
    }
}

/// Runs the fused decode's `kernel` over `kv` (fp8 with its layer, else the bf16 pools).
#[allow(clippy::too_many_arguments)]
fn decode(
    gpu: &Gpu,
    kernel: PagedDecodeKernel,
    (batch, table, layout): (&Batch, &DevicePageTable<'_>, &PoolLayout),
    q: &pagoda_cuda::DeviceBuffer<bf16>,
    num_q_heads: usize,
    pools: Result<
        &Fp8KvLayer,
        (
            &pagoda_cuda::DeviceBuffer<bf16>,
            &pagoda_cuda::DeviceBuffer<bf16>,
        ),
    >,
    (policy, merge, scale): (PlanPolicy, MergeMode, f32),
) -> Vec<f32> {
    let b = batch.num_requests();
    let mut capacity = PlanCapacity::for_batch(b, NUM_KV_HEADS, policy.target_ctas);
    capacity.max_chunks = capacity.max_chunks.max(batch.indices.len() + b);
    let plan = PagedDecodePlan::new(&batch.indptr, NUM_KV_HEADS, policy, capacity).unwrap();
    let mut workspace =
        PagedDecodeWorkspace::new(gpu, capacity, num_q_heads, NUM_KV_HEADS, layout.head_dim)
            .unwrap();
    workspace.upload_plan(gpu, &plan).unwrap();
    workspace.set_kernel(kernel);
    let mut out = poisoned::<bf16>(gpu, b * num_q_heads * layout.head_dim);
    let queries = Queries::new(q, num_q_heads, num_q_heads * layout.head_dim);
    for _ in 0..2 {
        match pools {
            Ok(layer) => {
                let (kv, scales) = layer.paged(*layout, *table);
                let kv = (&kv, &scales);
                ops::paged_decode_attention_fp8(
                    gpu,
                    &queries,
                    kv,
                    &mut workspace,
                    merge,
                    scale,
                    &mut out,
                )
            }
            Err((k, v)) => {
                let kv = PagedKv::new(k, v, *layout, *table);
                ops::paged_decode_attention(
                    gpu,
                    &queries,
                    &kv,
                    &mut workspace,
                    merge,
                    scale,
                    &mut out,
                )
            }
        }
        .unwrap();
    }
    download(gpu, &out)
}

#[test]
#[ignore = "needs a GPU"]
fn fp8_decode_matches_f64_over_the_dequantized_cache() {
    let gpu = gpu();
    let mut worst_vs_bf16 = 0f32;
    for (head_dim, group, page_size) in [(128, 4, 16), (64, 8, 32), (256, 1, 16), (32, 3, 16)] {
        let mut rng = rng((head_dim * 3 + group) as u64);
        let layout = PoolLayout {
            num_pages: 200,
            page_size,
            num_kv_heads: NUM_KV_HEADS,
            head_dim,
        };
        let num_q_heads = NUM_KV_HEADS * group;
        // Loud K heads x4 only: a key's score error grows with its magnitude (e4m3 keeps
        // 3 mantissa bits), and the bf16 comparison below is meant for ordinary scores.
        let k = kv_values(&mut rng, layout.pool_len(), head_dim, 4.0);
        let v = kv_values(&mut rng, layout.pool_len(), head_dim, 40.0);
        let host = HostFp8::new(&k, &v, head_dim);
        let batch = Batch::new(&mut rng, 5, 600, page_size, layout.num_pages, true);
        let q = round::<bf16>(&random_vec(&mut rng, 5 * num_q_heads * head_dim, 2.0));
        let scale = 1.0 / (head_dim as f32).sqrt();
        let expected = batch.reference(
            &layout,
            num_q_heads,
            &q,
            &host.k_values,
            &host.v_values,
            scale,
        );
        let arrays = batch.upload(&gpu);
        let table = DevicePageTable::new(&arrays[0], &arrays[1], &arrays[2], &arrays[3]).unwrap();
        let layer = host.upload(&gpu);
        let (kb, vb, qb) = (
            upload::<bf16>(&gpu, &k),
            upload::<bf16>(&gpu, &v),
            upload::<bf16>(&gpu, &q),
        );
        for ppc in [None, Some(1), Some(3)] {
            let policy = PlanPolicy {
                target_ctas: 264,
                pages_per_chunk: ppc,
                min_pages_per_chunk: 1,
                resident_ctas: None,
            };
            for merge in [MergeMode::InKernel, MergeMode::Separate] {
                let case = (&batch, &table, &layout);
                let actual = decode(
                    &gpu,
                    PagedDecodeKernel::CudaCore,
                    case,
                    &qb,
                    num_q_heads,
                    Ok(&layer),
                    (policy, merge, scale),
                );
                let error = peak_error(&actual, &expected);
                let what = format!("fp8 D{head_dim} G{group} ppc {ppc:?} {merge:?}");
                // bf16 output rounding, as the bf16 cache's own test allows.
                assert!(error <= 1e-2, "{what} vs f64 over dequantized: {error:e}");
                let bf16_cache = decode(
                    &gpu,
                    PagedDecodeKernel::CudaCore,
                    case,
                    &qb,
                    num_q_heads,
                    Err((&kb, &vb)),
                    (policy, merge, scale),
                );
                let error = peak_error(&actual, &bf16_cache);
                worst_vs_bf16 = worst_vs_bf16.max(error);
                // e4m3 keeps 3 mantissa bits (relative step 2^-3): a few percent of the peak.
                assert!(error <= 8e-2, "{what} vs the bf16 cache: {error:e}");
                // The empty last request reads as zeros.
                let row = num_q_heads * head_dim;
                assert!(
                    actual[4 * row..].iter().all(|&x| x == 0.0),
                    "{what}: empty request"
                );
            }
        }
    }
    println!("fp8 decode vs the bf16 cache: worst peak-relative error {worst_vs_bf16:e}");
}

#[test]
#[ignore = "needs a GPU"]
fn fp8_streaming_decode_matches_f64_over_the_dequantized_cache() {
    let gpu = gpu();
    // (head_dim, group, page_size, batch, longest context): partial pages (random lengths and
    // first-page offsets), an empty last request, GQA 1..8, a few tiles to many chunks.
    let shapes: [(usize, usize, usize, usize, usize); 5] = [
        (128, 4, 16, 5, 600),
        (128, 1, 16, 1, 3000),
        (64, 8, 32, 5, 600),
        (256, 2, 16, 3, 900),
        (128, 8, 16, 16, 200),
    ];
    for (head_dim, group, page_size, requests, context) in shapes {
        let mut rng = rng((head_dim * 7 + group * 3 + requests) as u64);
        let layout = PoolLayout {
            num_pages: (requests * context).div_ceil(page_size) + 2 * requests + 8,
            page_size,
            num_kv_heads: NUM_KV_HEADS,
            head_dim,
        };
        let num_q_heads = NUM_KV_HEADS * group;
        let k = kv_values(&mut rng, layout.pool_len(), head_dim, 4.0);
        let v = kv_values(&mut rng, layout.pool_len(), head_dim, 40.0);
        let host = HostFp8::new(&k, &v, head_dim);
        let batch = Batch::new(
            &mut rng,
            requests,
            context,
            page_size,
            layout.num_pages,
            true,
        );
        let q = round::<bf16>(&random_vec(
            &mut rng,
            requests * num_q_heads * head_dim,
            2.0,
        ));
        let scale = 1.0 / (head_dim as f32).sqrt();
        let expected = batch.reference(
            &layout,
            num_q_heads,
            &q,
            &host.k_values,
            &host.v_values,
            scale,
        );
        let arrays = batch.upload(&gpu);
        let table = DevicePageTable::new(&arrays[0], &arrays[1], &arrays[2], &arrays[3]).unwrap();
        let layer = host.upload(&gpu);
        let qb = upload::<bf16>(&gpu, &q);
        for tiling in StreamTiling::ALL.iter().filter(|t| t.fits(head_dim)) {
            for (ppc, merge) in [
                (None, MergeMode::Separate),
                (Some(1), MergeMode::InKernel),
                (Some(4), MergeMode::Separate),
            ] {
                let policy = PlanPolicy {
                    target_ctas: 264,
                    pages_per_chunk: ppc,
                    min_pages_per_chunk: 1,
                    resident_ctas: None,
                };
                let actual = decode(
                    &gpu,
                    PagedDecodeKernel::Streaming(*tiling),
                    (&batch, &table, &layout),
                    &qb,
                    num_q_heads,
                    Ok(&layer),
                    (policy, merge, scale),
                );
                let what = format!(
                    "fp8 {tiling} D{head_dim} G{group} B{requests} L{context} ppc {ppc:?} {merge:?}"
                );
                // P in bf16 on the tensor cores and the bf16 output, as the bf16 cache's
                // streaming test allows.
                let error = peak_error(&actual, &expected);
                assert!(error <= 2e-2, "{what} vs f64 over dequantized: {error:e}");
                let row = num_q_heads * head_dim;
                assert!(
                    requests == 1 || actual[(requests - 1) * row..].iter().all(|&x| x == 0.0),
                    "{what}: empty request"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn fp8_prefill_matches_f64_over_the_dequantized_cache() {
    let gpu = gpu();
    let mut worst_vs_bf16 = 0f32;
    for (head_dim, group, page_size) in [(128, 4, 16), (64, 2, 32), (32, 1, 16), (256, 8, 16)] {
        let mut rng = rng(100 + head_dim as u64);
        let mut batch = prefill_batch::Batch::new::<bf16>(
            &mut rng,
            (page_size, NUM_KV_HEADS, head_dim),
            NUM_KV_HEADS * group,
            &STANDARD_SHAPES,
            (2, 1),
        );
        let device = Bf16Batch::upload(&gpu, &batch);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let bf16_cache = device.run(&gpu, &batch, scale, ops::PrefillKernel::Tiled);
        let host = HostFp8::new(&batch.k_pool, &batch.v_pool, head_dim);
        let layer = host.upload(&gpu);
        let queries = Queries::new(&device.qkv, batch.num_q_heads, batch.qkv_width());
        let (kv, scales) = layer.paged(batch.layout, device.page_table());
        // The tiled kernel, then (at its head sizes) the streaming one at every tiling.
        let mut kernels = vec![None];
        if ops::STREAM_PREFILL_HEAD_DIMS.contains(&head_dim) {
            kernels.extend(ops::PrefillStreamTiling::ALL.map(Some));
        }
        let (k_dequantized, v_dequantized) = (host.k_values.clone(), host.v_values.clone());
        for kernel in kernels {
            let mut out = poisoned::<bf16>(&gpu, batch.num_rows() * batch.row_elems());
            let kv = (&kv, &scales);
            let qo = &device.qo_indptr;
            match kernel {
                None => ops::prefill_attention_tiled_fp8(&gpu, &queries, kv, qo, scale, &mut out),
                Some(tiling) => ops::prefill_attention_stream_fp8(
                    &gpu, tiling, &queries, kv, qo, scale, &mut out,
                ),
            }
            .unwrap();
            let what = match kernel {
                None => format!("tiled fp8 prefill D{head_dim}"),
                Some(tiling) => format!("streaming fp8 prefill {tiling} D{head_dim}"),
            };
            let actual = download(&gpu, &out);
            let row = batch.row_elems();
            let owners = batch.row_owners();
            let error = peak_error(&actual, &bf16_cache);
            worst_vs_bf16 = worst_vs_bf16.max(error);
            assert!(error <= 8e-2, "{what} vs the bf16 cache: {error:e}");
            // The f64 oracle over the dequantized cache, on a sample of rows (P in bf16 on
            // the streaming kernel's tensor cores: its bound is the bf16 streaming test's).
            let bound = if kernel.is_some() { 2e-2 } else { 1.6e-2 };
            let (k_original, v_original) = (
                std::mem::replace(&mut batch.k_pool, k_dequantized.clone()),
                std::mem::replace(&mut batch.v_pool, v_dequantized.clone()),
            );
            for (index, owner) in owners.iter().enumerate() {
                let got = &actual[index * row..][..row];
                match owner {
                    None => assert!(got.iter().all(|&x| x == 0.0), "{what}: padding row {index}"),
                    Some(owner) if index % 11 == 0 => {
                        let expected = batch.reference_row(index, *owner, scale);
                        let error = peak_error(got, &expected);
                        assert!(error <= bound, "{what} row {index}: {error:e}");
                    }
                    Some(_) => {}
                }
            }
            (batch.k_pool, batch.v_pool) = (k_original, v_original);
        }
    }
    println!("fp8 prefill vs the bf16 cache: worst peak-relative error {worst_vs_bf16:e}");
}
