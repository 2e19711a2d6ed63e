//! The QKV fix-up kernels (`add_bias_rows`, `rms_norm_heads`) against the ops crate's CPU
//! implementations (`pagoda_ops::activation::add_bias`, `pagoda_ops::norm::rms_norm`; run
//! with `--include-ignored` on the GPU machine; ignored elsewhere). Every element
//! outside the written region is checked unchanged, bit for bit.

#[path = "gpu_common/mod.rs"]
mod common;

use common::*;
use half::bf16;
use pagoda_cuda::{view_mut, Gpu, GraphCache};
use pagoda_ops::cuda as ops;

/// The CPU bias add on the first `bias.len()` values of each of `num_rows` rows
/// `row_stride` apart, rounded through `T`.
fn bias_reference<T: TestFloat>(
    x: &[f32],
    bias: &[f32],
    num_rows: usize,
    row_stride: usize,
) -> Vec<f32> {
    let mut out = x.to_vec();
    for row in 0..num_rows {
        let values = &mut out[row * row_stride..row * row_stride + bias.len()];
        pagoda_ops::activation::add_bias(values, bias);
        for value in values {
            *value = T::from_f32(*value).to_f32();
        }
    }
    out
}

/// The CPU RMSNorm of each head slice at `offset + t * row_stride + h * head_dim`, rounded
/// through `T`.
fn heads_reference<T: TestFloat>(
    x: &[f32],
    weight: &[f32],
    offset: usize,
    (num_tokens, num_heads, row_stride): (usize, usize, usize),
    eps: f32,
) -> Vec<f32> {
    let head_dim = weight.len();
    let mut out = x.to_vec();
    for t in 0..num_tokens {
        let start = offset + t * row_stride;
        let heads = &mut out[start..start + num_heads * head_dim];
        pagoda_ops::norm::rms_norm_in_place(heads, weight, eps);
        for value in heads {
            *value = T::from_f32(*value).to_f32();
        }
    }
    out
}

/// Elements whose index is not in `written` must equal the input exactly.
fn assert_untouched(what: &str, actual: &[f32], input: &[f32], written: &dyn Fn(usize) -> bool) {
    for (index, (&a, &e)) in actual.iter().zip(input).enumerate() {
        if !written(index) {
            assert!(
                a.to_bits() == e.to_bits(),
                "{what}: element {index} outside the written region changed: {e} -> {a}"
            );
        }
    }
}

fn check_bias<T: TestFloat>(gpu: &Gpu) {
    let mut rng = rng(21);
    // (num_rows, width, row_stride, trailing elements after the last row).
    let shapes = [
        (1, 64, 64, 0),
        (7, 896 + 2 * 128, 896 + 2 * 128, 0), // Qwen2-0.5B's fused QKV row
        (5, 300, 320, 17),                    // narrower than the stride, ragged width
        (3, 1, 5, 4),
        (70_000, 40, 48, 8), // more rows than one grid's y dimension
    ];
    for (num_rows, width, row_stride, trailing) in shapes {
        let len = (num_rows - 1) * row_stride + width + trailing;
        let x = round::<T>(&random_vec(&mut rng, len, 3.0));
        let bias = round::<T>(&random_vec(&mut rng, width, 1.0));
        let mut x_d = upload::<T>(gpu, &x);
        let bias_d = upload::<T>(gpu, &bias);
        ops::add_bias_rows(gpu, &mut x_d, &bias_d, num_rows, row_stride).unwrap();
        let actual = download(gpu, &x_d);
        let what = format!(
            "add_bias_rows {} rows {num_rows} width {width} stride {row_stride}",
            T::NAME
        );
        let expected = bias_reference::<T>(&x, &bias, num_rows, row_stride);
        assert_close(&what, &actual, &expected, T::TOLERANCE);
        assert_untouched(&what, &actual, &x, &|index| {
            index / row_stride < num_rows && index % row_stride < width
        });
    }
}

#[test]
#[ignore = "needs a GPU"]
fn add_bias_rows_matches_reference() {
    let gpu = gpu();
    check_bias::<f32>(&gpu);
    check_bias::<bf16>(&gpu);
}

fn check_heads<T: TestFloat>(gpu: &Gpu) {
    let mut rng = rng(22);
    // (num_tokens, num_q_heads, num_kv_heads, head_dim): a fused QKV row
    // [q heads | k heads | v heads]; q heads normed at offset 0, k heads at q_dim, v untouched.
    let shapes = [
        (1, 1, 1, 32),
        (5, 8, 2, 64),
        (9, 16, 8, 128), // Qwen3-0.6B/8B geometry
        (3, 4, 4, 96),
        (2, 2, 1, 256),
        (33, 5, 1, 40), // head_dim not a multiple of the warp
    ];
    for (num_tokens, num_q_heads, num_kv_heads, head_dim) in shapes {
        let (q_dim, kv_dim) = (num_q_heads * head_dim, num_kv_heads * head_dim);
        let row_stride = q_dim + 2 * kv_dim;
        let len = num_tokens * row_stride;
        // Rows with very different scales per head (the norm removes the scale).
        let x: Vec<f32> = random_vec(&mut rng, len, 1.0)
            .into_iter()
            .enumerate()
            .map(|(i, v)| v * (1.0 + ((i / head_dim) % 7) as f32 * 3.0))
            .collect();
        let x = round::<T>(&x);
        let q_weight = round::<T>(&random_vec(&mut rng, head_dim, 1.5));
        let k_weight = round::<T>(&random_vec(&mut rng, head_dim, 1.5));
        let eps = 1e-6;
        let mut x_d = upload::<T>(gpu, &x);
        ops::rms_norm_heads(
            gpu,
            &mut x_d,
            &upload::<T>(gpu, &q_weight),
            (num_tokens, num_q_heads, row_stride),
            eps,
        )
        .unwrap();
        {
            let mut k = view_mut(&mut x_d, q_dim..len).unwrap();
            ops::rms_norm_heads(
                gpu,
                &mut k,
                &upload::<T>(gpu, &k_weight),
                (num_tokens, num_kv_heads, row_stride),
                eps,
            )
            .unwrap();
        }
        let actual = download(gpu, &x_d);
        let expected =
            heads_reference::<T>(&x, &q_weight, 0, (num_tokens, num_q_heads, row_stride), eps);
        let expected = heads_reference::<T>(
            &expected,
            &k_weight,
            q_dim,
            (num_tokens, num_kv_heads, row_stride),
            eps,
        );
        let what = format!(
            "rms_norm_heads {} tokens {num_tokens} heads {num_q_heads}/{num_kv_heads} head_dim {head_dim}",
            T::NAME
        );
        assert_close(&what, &actual, &expected, T::TOLERANCE);
        assert_untouched(&what, &actual, &x, &|index| {
            index % row_stride < q_dim + kv_dim
        });
    }
}

#[test]
#[ignore = "needs a GPU"]
fn rms_norm_heads_matches_reference() {
    let gpu = gpu();
    check_heads::<f32>(&gpu);
    check_heads::<bf16>(&gpu);
}

/// A view that does not start at a row boundary and a stride wider than the heads: only the
/// heads inside the view's rows change, the tail after the last head is untouched.
#[test]
#[ignore = "needs a GPU"]
fn rms_norm_heads_respects_a_partial_last_row() {
    let gpu = gpu();
    let mut rng = rng(23);
    let (num_tokens, num_heads, head_dim, row_stride, offset) = (4, 3, 64, 250, 7);
    // The buffer ends right after the last token's heads.
    let len = offset + (num_tokens - 1) * row_stride + num_heads * head_dim;
    let x = random_vec(&mut rng, len, 2.0);
    let weight = random_vec(&mut rng, head_dim, 1.0);
    let mut x_d = upload::<f32>(&gpu, &x);
    {
        let mut part = view_mut(&mut x_d, offset..len).unwrap();
        ops::rms_norm_heads(
            &gpu,
            &mut part,
            &upload::<f32>(&gpu, &weight),
            (num_tokens, num_heads, row_stride),
            1e-5,
        )
        .unwrap();
    }
    let actual = download(&gpu, &x_d);
    let expected = heads_reference::<f32>(
        &x,
        &weight,
        offset,
        (num_tokens, num_heads, row_stride),
        1e-5,
    );
    assert_close("rms_norm_heads partial", &actual, &expected, f32::TOLERANCE);
    assert_untouched("rms_norm_heads partial", &actual, &x, &|index| {
        index >= offset && (index - offset) % row_stride < num_heads * head_dim
    });
}

/// Bad geometry is an error naming the problem, never a launch.
#[test]
#[ignore = "needs a GPU"]
fn qkv_ops_reject_bad_geometry() {
    let gpu = gpu();
    let mut x = gpu.zeros::<f32>(100).unwrap();
    let bias = gpu.zeros::<f32>(30).unwrap();
    let error = ops::add_bias_rows(&gpu, &mut x, &bias, 4, 25).unwrap_err();
    assert!(error.to_string().contains("row_stride"), "{error}");
    let error = ops::add_bias_rows(&gpu, &mut x, &bias, 4, 30).unwrap_err();
    assert!(error.to_string().contains("add_bias_rows x"), "{error}");
    let empty = gpu.zeros::<f32>(0).unwrap();
    assert!(ops::add_bias_rows(&gpu, &mut x, &empty, 1, 10).is_err());

    let weight = gpu.zeros::<f32>(16).unwrap();
    let error = ops::rms_norm_heads(&gpu, &mut x, &weight, (2, 4, 60), 1e-6).unwrap_err();
    assert!(
        error.to_string().contains("num_heads * head_dim"),
        "{error}"
    );
    let error = ops::rms_norm_heads(&gpu, &mut x, &weight, (3, 2, 48), 1e-6).unwrap_err();
    assert!(error.to_string().contains("rms_norm_heads x"), "{error}");
    assert!(ops::rms_norm_heads(&gpu, &mut x, &weight, (1, 2, 48), f32::NAN).is_err());
    // Zero rows is a no-op, not an error.
    ops::add_bias_rows(&gpu, &mut x, &bias, 0, 30).unwrap();
    ops::rms_norm_heads(&gpu, &mut x, &weight, (0, 2, 48), 1e-6).unwrap();
}

/// Both kernels record into a CUDA graph (behind a copy of the pristine input, so every
/// replay computes the same thing) and each replay matches a direct launch bit for bit.
#[test]
#[ignore = "needs a GPU"]
fn qkv_ops_are_graph_capturable() {
    let gpu = gpu();
    let mut rng = rng(24);
    let (num_tokens, num_heads, head_dim) = (6, 4, 64);
    let row_stride = num_heads * head_dim;
    let x = round::<bf16>(&random_vec(&mut rng, num_tokens * row_stride, 2.0));
    let bias = round::<bf16>(&random_vec(&mut rng, row_stride, 0.5));
    let weight = round::<bf16>(&random_vec(&mut rng, head_dim, 1.0));
    let (bias_d, weight_d) = (upload::<bf16>(&gpu, &bias), upload::<bf16>(&gpu, &weight));
    let pristine = upload::<bf16>(&gpu, &x);

    let mut direct = upload::<bf16>(&gpu, &x);
    ops::add_bias_rows(&gpu, &mut direct, &bias_d, num_tokens, row_stride).unwrap();
    ops::rms_norm_heads(
        &gpu,
        &mut direct,
        &weight_d,
        (num_tokens, num_heads, row_stride),
        1e-6,
    )
    .unwrap();
    let expected = download(&gpu, &direct);

    let mut work = poisoned::<bf16>(&gpu, x.len());
    let mut step = |gpu: &Gpu| -> Result<(), pagoda_cuda::CudaError> {
        gpu.copy(&pristine, &mut work)?;
        ops::add_bias_rows(gpu, &mut work, &bias_d, num_tokens, row_stride)?;
        ops::rms_norm_heads(
            gpu,
            &mut work,
            &weight_d,
            (num_tokens, num_heads, row_stride),
            1e-6,
        )
    };
    let mut graphs: GraphCache<usize> = GraphCache::new();
    // The first call runs the step eagerly, then captures it.
    graphs.get_or_capture(&gpu, 0, &mut step).unwrap();
    for _ in 0..3 {
        graphs
            .get_or_capture(&gpu, 0, &mut step)
            .unwrap()
            .launch()
            .unwrap();
    }
    assert_eq!(graphs.len(), 1);
    gpu.synchronize().unwrap();
    let replayed = download(&gpu, &work);
    let (replayed_bits, expected_bits): (Vec<u32>, Vec<u32>) = (
        replayed.iter().map(|v| v.to_bits()).collect(),
        expected.iter().map(|v| v.to_bits()).collect(),
    );
    assert_eq!(
        replayed_bits, expected_bits,
        "graph replay differs from a direct launch"
    );
}
