//! The SIMD split-KV chunk kernels (AVX-512F, AVX2+FMA, NEON) against the scalar kernel and against
//! the naive f64 attention of `attention_reference.rs`, over random paged caches: page sizes
//! 16 and 32, partial first and last pages, GQA groups 1/3/4 (and 10, and 50: more than one
//! head pass), head_dim 64/128 (and 40/36, the fallbacks), contexts 1..5000, peaked softmaxes.
//! Every row runs split-KV (`min_split_kv_tokens` 0) with several chunks per row, so the
//! kernels' partial LSEs go through the merge too. A kernel this CPU lacks is skipped with a
//! printed line.

#[path = "attention_reference.rs"]
mod reference;

use pagoda_ops::attention::{
    plan_step, step_attention, AttentionKernel, SplitKvChunking, StepAttentionConfig, StepWorkspace,
};
use reference::{max_relative_error, request, Fixture, PageOrder, RequestSpec};

/// Max error relative to the output peak (at least 1), against either oracle.
const TOLERANCE: f64 = 1e-5;

const SIMD_KERNELS: [AttentionKernel; 3] = [
    AttentionKernel::Avx512,
    AttentionKernel::Avx2,
    AttentionKernel::Neon,
];

/// Every row split-KV, chunks of `chunk_tokens` visible tokens.
fn run(fixture: &Fixture, kernel: AttentionKernel, chunk_tokens: usize) -> Vec<f32> {
    let kv = fixture.kv();
    let config = StepAttentionConfig {
        chunking: SplitKvChunking::new(fixture.layout.num_kv_heads, chunk_tokens),
        min_split_kv_tokens: 0,
    };
    let plan = plan_step(&kv, &fixture.qo_indptr, fixture.num_q_heads, &config)
        .unwrap()
        .with_kernel(kernel);
    assert_eq!(plan.kernel(), kernel);
    let mut out = vec![f32::NAN; fixture.output_len()];
    let mut workspace = StepWorkspace::default();
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

/// Runs every supported SIMD kernel and the scalar kernel on `fixture`, checks each against
/// the f64 reference and the SIMD ones against scalar; returns the worst errors seen.
fn check(name: &str, fixture: &Fixture, chunk_tokens: usize) -> (f64, f64) {
    let (expected, _) = fixture.reference();
    let scalar = run(fixture, AttentionKernel::Scalar, chunk_tokens);
    let scalar_error = max_relative_error(&scalar, &expected);
    assert!(
        scalar_error <= TOLERANCE,
        "{name} scalar vs f64: {scalar_error:e}"
    );
    let mut worst = (0.0f64, 0.0f64);
    for kernel in SIMD_KERNELS {
        if !kernel.is_supported() {
            println!("skip {kernel}: this CPU lacks it");
            continue;
        }
        let out = run(fixture, kernel, chunk_tokens);
        let reference_error = max_relative_error(&out, &expected);
        let scalar_diff = out
            .iter()
            .zip(&scalar)
            .map(|(&a, &b)| (a - b).abs() as f64)
            .fold(0.0, f64::max);
        assert!(
            reference_error <= TOLERANCE,
            "{name} {kernel} vs f64: {reference_error:e}"
        );
        assert!(
            scalar_diff <= TOLERANCE,
            "{name} {kernel} vs scalar: {scalar_diff:e}"
        );
        worst = (worst.0.max(reference_error), worst.1.max(scalar_diff));
    }
    worst
}

#[test]
fn simd_kernels_match_scalar_and_f64_across_geometries() {
    let mut worst = (0.0f64, 0.0f64);
    let mut seed = 100;
    for page_size in [16, 32] {
        for n_rep in [1, 3, 4] {
            for head_dim in [64, 128] {
                // Decode rows of many lengths (partial last pages, a window starting mid-page,
                // single-token and single-page contexts) plus a short prefill chunk.
                let specs = [
                    request(1, 0, 1),
                    request(page_size - 1, 0, 1),
                    request(page_size + 1, 0, 1),
                    request(333, 0, 1),
                    request(1000, 21, 1),
                    request(2 * page_size + 5, 0, 7),
                ];
                seed += 1;
                let fixture = Fixture::new(
                    &specs,
                    page_size,
                    2,
                    n_rep,
                    head_dim,
                    PageOrder::Random,
                    seed,
                );
                let name = format!("page {page_size} n_rep {n_rep} head_dim {head_dim}");
                for chunk_tokens in [48, 1000] {
                    let errors = check(&name, &fixture, chunk_tokens);
                    worst = (worst.0.max(errors.0), worst.1.max(errors.1));
                }
            }
        }
    }
    println!(
        "worst SIMD error: {:.2e} vs f64, {:.2e} vs scalar",
        worst.0, worst.1
    );
}

#[test]
fn long_contexts_up_to_5000_tokens() {
    // The default model's geometry (3 KV heads, 3 query heads each, head_dim 64) at depth,
    // and a head_dim-128 GQA-4 model.
    for (n_rep, head_dim, num_kv_heads) in [(3, 64, 3), (4, 128, 1)] {
        let specs: Vec<RequestSpec> = vec![
            request(5000, 0, 1),
            request(4097, 0, 1),
            request(2049, 3, 1),
        ];
        let fixture = Fixture::new(
            &specs,
            16,
            num_kv_heads,
            n_rep,
            head_dim,
            PageOrder::Reverse,
            7 + head_dim as u64,
        );
        for chunk_tokens in [32, 100] {
            check(
                &format!("long n_rep {n_rep} head_dim {head_dim}"),
                &fixture,
                chunk_tokens,
            );
        }
    }
}

#[test]
fn peaked_softmax_and_large_groups() {
    // A large scale drives most weights below 2^-126 (the vector exp2's flush to zero) and
    // makes the running max jump between tiles; n_rep 10 puts 4 rows in a work item, n_rep 50
    // needs two head passes per work item.
    let specs = [request(700, 0, 1), request(90, 5, 3), request(37, 0, 1)];
    let mut fixture = Fixture::new(&specs, 16, 1, 10, 64, PageOrder::Random, 3);
    fixture.scale = 12.0;
    check("peaked n_rep 10", &fixture, 40);
    let fixture = Fixture::new(&specs, 32, 2, 10, 128, PageOrder::Random, 4);
    check("n_rep 10", &fixture, 1000);
    let fixture = Fixture::new(&specs, 16, 1, 50, 64, PageOrder::Random, 5);
    check("n_rep 50", &fixture, 64);
}

#[test]
fn head_dims_the_lanes_do_not_divide_fall_back() {
    // 40: AVX-512 falls back to AVX2 (40 % 8 == 0); 36: both fall back to scalar.
    let specs = [request(300, 0, 1), request(50, 0, 4)];
    for head_dim in [40, 36] {
        let fixture = Fixture::new(&specs, 16, 2, 3, head_dim, PageOrder::Random, 11);
        check(&format!("head_dim {head_dim}"), &fixture, 48);
    }
}

#[test]
fn simd_kernels_are_deterministic_and_chunking_changes_little() {
    let specs = [request(1500, 0, 1), request(600, 7, 1)];
    let fixture = Fixture::new(&specs, 16, 3, 3, 64, PageOrder::Random, 21);
    let kernel = AttentionKernel::best();
    let first = run(&fixture, kernel, 9);
    let second = run(&fixture, kernel, 9);
    assert!(
        first
            .iter()
            .zip(&second)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{kernel}: two runs of the same plan differ"
    );
    let unsplit = run(&fixture, kernel, 1);
    let (expected, _) = fixture.reference();
    assert!(max_relative_error(&unsplit, &expected) <= TOLERANCE);
}
