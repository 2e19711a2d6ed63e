//! `pagoda bench`'s printed report: the table (or JSON) and the per-op profile.

use anyhow::Result;
use pagoda_engine::Backend;
use pagoda_models::random::{random_format, RandomFormat};

use super::Report;

/// The load line's word on FP8 weights: the bytes of FP8 codes the GPU keeps, or, for a
/// `:fp8` random spec the GPU did not keep so, what its codes were decoded to.
pub(super) fn fp8_note(spec: &str, backend: &Backend) -> String {
    match backend.fp8_weight_bytes() {
        0 if random_format(spec).ok() != Some(RandomFormat::Fp8) => String::new(),
        0 if matches!(backend, Backend::Cpu(_)) => {
            " (FP8 projections dequantized to f32 at load)".to_string()
        }
        0 => " (FP8 projections decoded to the dtype at load: PAGODA_CUDA_FP8_WEIGHTS off)".into(),
        bytes => format!(
            " ({:.2} GiB of FP8 (e4m3) projections kept on the device: PAGODA_CUDA_FP8_WEIGHTS on)",
            bytes as f64 / (1u64 << 30) as f64
        ),
    }
}

pub(super) fn print_report(report: &Report, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
        return Ok(());
    }
    println!("model: {} | device: {}", report.model, report.device);
    println!(
        "cpu kernels: {} ({} matmuls on NEON, {} f32 on NEON tiles, {} on AMX-INT8 tiles, {} on AMX-BF16 tiles \
         (AMX prefill: {}), \
         {} on Q15 activations) | f32 decode matmuls: {} ({} ran eight rows \
         at a time) | integer decode: {} ({} ran 16 rows per register) | integer prefill: {} \
         ({} ran 16 rows per register)",
        report.cpu_kernels,
        report.neon_matmuls,
        report.neon_f32_matmuls,
        report.amx_matmuls,
        report.amx_bf16_matmuls,
        report.amx_prefill,
        report.q15_matmuls,
        report.f32_decode,
        report.f32_wide_matmuls,
        report.int_decode,
        report.int_wide_decodes,
        report.int_prefill,
        report.int_wide_prefills
    );
    println!(
        "weights: {}{} | threads: {} | attention: {} | kv cache: {} | prefetch: {} bytes ahead ({} matmuls) | \
         5-6 bit weights: {} ({} matmuls on planes) | load before: {} | load after: {}",
        report.precision,
        match report.fp8_weight_bytes {
            0 => String::new(),
            bytes => format!(", FP8 (e4m3) {:.2} GiB on the device", bytes as f64 / (1u64 << 30) as f64),
        },
        report.threads,
        report.attention,
        report.kv_cache,
        report.prefetch_bytes,
        report.prefetched_matmuls,
        report.high_bits,
        report.plane_matmuls,
        report.load_before,
        report.load_after
    );
    println!(
        "| test | tok/s (median) | min | max | runs | step ms | GB/s read | steps split-kv/gather |"
    );
    println!("| --- | ---: | ---: | ---: | --- | ---: | ---: | --- |");
    for r in &report.results {
        let runs: Vec<String> = r
            .tokens_per_second
            .iter()
            .map(|v| format!("{v:.1}"))
            .collect();
        let optional = |value: Option<f64>, digits: usize| {
            value.map_or("-".to_string(), |v| format!("{v:.digits$}"))
        };
        println!(
            "| {} | {:.1} | {:.1} | {:.1} | {} | {} | {} | {} |",
            r.test,
            r.median,
            r.min,
            r.max,
            runs.join(" "),
            optional(r.step_ms, 3),
            optional(r.effective_gb_per_s, 0),
            r.steps
        );
    }
    Ok(())
}

/// With `PAGODA_PROFILE=1`: the forward pass's time per op over the test's runs, on stderr
/// (ms per run and share of the timed total).
pub(super) fn print_profile(test: &str, runs: usize) {
    if !pagoda_ops::profile::enabled() {
        return;
    }
    let totals = pagoda_ops::profile::totals();
    let sum: f64 = totals.iter().map(|t| t.1).sum();
    let rows: Vec<String> = totals
        .iter()
        .filter(|t| t.2 > 0)
        .map(|(op, seconds, _)| {
            format!(
                "{} {:.2} ms ({:.1}%)",
                op.name(),
                seconds * 1e3 / runs as f64,
                100.0 * seconds / sum.max(f64::MIN_POSITIVE)
            )
        })
        .collect();
    eprintln!(
        "profile {test}: {:.2} ms per run timed: {}",
        sum * 1e3 / runs as f64,
        rows.join(", ")
    );
}
