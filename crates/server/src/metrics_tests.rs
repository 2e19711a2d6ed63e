//! Tests of `metrics.rs`: the Prometheus text it renders.

use super::*;

#[test]
fn histogram_buckets_are_cumulative() {
    let metrics = Metrics::default();
    for seconds in [0.005, 0.02, 0.02, 100.0] {
        metrics.time_to_first_token.observe(seconds);
    }
    let text = metrics.render();
    assert!(text.contains("pagoda_time_to_first_token_seconds_bucket{le=\"0.01\"} 1\n"));
    assert!(text.contains("pagoda_time_to_first_token_seconds_bucket{le=\"0.025\"} 3\n"));
    assert!(text.contains("pagoda_time_to_first_token_seconds_bucket{le=\"60\"} 3\n"));
    assert!(text.contains("pagoda_time_to_first_token_seconds_bucket{le=\"+Inf\"} 4\n"));
    assert!(text.contains("pagoda_time_to_first_token_seconds_count 4\n"));
}

#[test]
fn gauges_follow_the_snapshot() {
    let metrics = Metrics::default();
    let snapshot = EngineSnapshot {
        pages_used: 3,
        pages_total: 10,
        num_running: 2,
        ..EngineSnapshot::default()
    };
    metrics.update_engine(&snapshot, 5);
    metrics.record_request("chat", 200);
    metrics.record_request("chat", 200);
    let text = metrics.render();
    assert!(text.contains("pagoda_kv_pages_used 3\n"));
    assert!(text.contains("pagoda_kv_pages_free 7\n"));
    assert!(text.contains("pagoda_queue_length 5\n"));
    assert!(text.contains("pagoda_requests_total{endpoint=\"chat\",status=\"200\"} 2\n"));
    assert!(text.contains("pagoda_batch_invariant 1\n"));
    assert!(text.contains("pagoda_cpu_kernels_info{set=\""));
    // The AMX counter is rendered from pagoda_ops' process-wide count.
    let amx = text
        .lines()
        .find_map(|line| line.strip_prefix("pagoda_cpu_amx_matmuls_total "))
        .expect("the AMX counter line");
    assert_eq!(
        amx.parse::<u64>().unwrap(),
        pagoda_ops::linear::cpu::amx::hardware_matmul_count()
    );
    assert!(text.contains("# TYPE pagoda_cpu_amx_matmuls_total counter\n"));
    let neon_f32 = text
        .lines()
        .find_map(|line| line.strip_prefix("pagoda_cpu_neon_f32_matmuls_total "))
        .expect("the NEON f32 counter line");
    assert_eq!(
        neon_f32.parse::<u64>().unwrap(),
        pagoda_ops::linear::cpu::f32_tile::neon_matmul_count()
    );
    // DeepSeek-V3.2's sparse attention counters, from pagoda_ops' process-wide counts.
    let sparse_rows = text
        .lines()
        .find_map(|line| line.strip_prefix("pagoda_cpu_sparse_attention_rows_total "))
        .expect("the sparse attention rows line");
    assert!(
        sparse_rows.parse::<u64>().unwrap() <= pagoda_ops::attention::sparse_selection_counts().1
    );
    assert!(text.contains("# TYPE pagoda_cpu_sparse_attention_kept_tokens_total counter\n"));
    assert!(text.contains("pagoda_cpu_sparse_attention_visible_tokens_total "));
    let q15 = text
        .lines()
        .find_map(|line| line.strip_prefix("pagoda_cpu_q15_matmuls_total "))
        .expect("the Q15 counter line");
    assert_eq!(
        q15.parse::<u64>().unwrap(),
        pagoda_ops::linear::cpu::int_matmul::q15_matmul_count()
    );
    let wide = text
        .lines()
        .find_map(|line| line.strip_prefix("pagoda_cpu_f32_wide_matmuls_total "))
        .expect("the wide f32 decode counter line");
    assert_eq!(
        wide.parse::<u64>().unwrap(),
        pagoda_ops::linear::cpu::f32_decode::wide_matmul_count()
    );
    let pairs = text
        .lines()
        .find_map(|line| line.strip_prefix("pagoda_cpu_f32_pair_matmuls_total "))
        .expect("the f32 pair prefill counter line");
    assert_eq!(
        pairs.parse::<u64>().unwrap(),
        pagoda_ops::linear::cpu::f32_tile::pair_matmul_count()
    );
    let wide_decodes = text
        .lines()
        .find_map(|line| line.strip_prefix("pagoda_cpu_int_wide_decodes_total "))
        .expect("the 512-bit integer decode counter line");
    assert_eq!(
        wide_decodes.parse::<u64>().unwrap(),
        pagoda_ops::linear::cpu::interleaved::wide_decode_count()
    );
    let prefetched = text
        .lines()
        .find_map(|line| line.strip_prefix("pagoda_cpu_prefetch_matmuls_total "))
        .expect("the prefetch counter line");
    assert!(
        prefetched.parse::<u64>().unwrap()
            <= pagoda_ops::linear::cpu::prefetch::prefetched_matmul_count()
    );
    assert!(text.contains(&format!(
        "\npagoda_cpu_prefetch_bytes {}\n",
        pagoda_ops::linear::cpu::prefetch::distance()
    )));
    let wide_prefills = text
        .lines()
        .find_map(|line| line.strip_prefix("pagoda_cpu_int_wide_prefills_total "))
        .expect("the 512-bit integer prefill counter line");
    assert!(
        wide_prefills.parse::<u64>().unwrap()
            <= pagoda_ops::linear::cpu::interleaved::wide_prefill_count()
    );
    let planes = text
        .lines()
        .find_map(|line| line.strip_prefix("pagoda_cpu_plane_matmuls_total "))
        .expect("the bit-plane matmul counter line");
    assert!(
        planes.parse::<u64>().unwrap()
            <= pagoda_ops::linear::cpu::interleaved::planes::plane_matmul_count()
    );
    let silu = text
        .lines()
        .find_map(|line| line.strip_prefix("pagoda_cpu_silu_polynomial_calls_total "))
        .expect("the SiLU polynomial counter line");
    assert!(silu.parse::<u64>().unwrap() <= pagoda_ops::activation::silu_polynomial_calls());
    let cascade_steps = pagoda_ops::attention::cascade_counts().0;
    for name in ["steps", "groups", "shared_tokens", "saved_token_reads"] {
        let value = text
            .lines()
            .find_map(|line| line.strip_prefix(&format!("pagoda_cpu_cascade_{name}_total ")))
            .expect("a cascade counter line");
        let value = value.parse::<u64>().unwrap();
        assert!(name != "steps" || value <= cascade_steps);
    }
    let kernel = pagoda_ops::attention::AttentionKernel::selected().name();
    assert!(text.contains(&format!(
        "pagoda_cpu_attention_kernel_info{{kernel=\"{kernel}\"}} 1\n"
    )));
    metrics.update_engine(
        &EngineSnapshot {
            batch_dependent: true,
            counters: EngineCounters {
                steps_cuda_graph: 9,
                sampled_tokens_gpu: 40,
                sampled_tokens_cpu: 2,
                gpu_sampler_fallbacks: 1,
                gpu_sampler_filtered_fast: 30,
                gpu_sampler_filtered_exact: 2,
                gpu_sampler_gumbel_max: 25,
                gpu_sampler_list_rows: 6,
                gpu_sampler_cluster_rows: 11,
                gpu_sampler_prefetched_rows: 4,
                steps_cpu_one_thread: 7,
                cpu_pool_switches: 2,
                ..EngineCounters::default()
            },
            ..snapshot
        },
        0,
    );
    let text = metrics.render();
    assert!(text.contains("pagoda_batch_invariant 0\n"));
    assert!(text.contains("pagoda_cuda_graph_steps_total 9\n"));
    assert!(text.contains("pagoda_sampled_tokens_total{path=\"gpu\"} 40\n"));
    assert!(text.contains("pagoda_sampled_tokens_total{path=\"cpu\"} 2\n"));
    assert!(text.contains("pagoda_gpu_sampling_fallbacks_total 1\n"));
    assert!(text.contains("pagoda_gpu_sampling_filtered_rows_total{path=\"fast\"} 30\n"));
    assert!(text.contains("pagoda_gpu_sampling_filtered_rows_total{path=\"exact\"} 2\n"));
    assert!(text.contains("pagoda_gpu_sampling_gumbel_max_rows_total 25\n"));
    assert!(text.contains("pagoda_gpu_sampling_list_rows_total 6\n"));
    assert!(text.contains("pagoda_gpu_sampling_cluster_rows_total 11\n"));
    assert!(text.contains("pagoda_gpu_sampling_prefetched_rows_total 4\n"));
    assert!(text.contains("pagoda_cpu_steps_total{pool=\"one_thread\"} 7\n"));
    assert!(text.contains("pagoda_cpu_pool_switches_total 2\n"));
}

#[test]
fn every_engine_counter_is_rendered_once_with_help_and_type() {
    let metrics = Metrics::default();
    let counters = EngineCounters {
        steps_split_kv: 1000,
        steps_cpu_all_threads: 1001,
        cpu_pool_switches: 1002,
        ..EngineCounters::default()
    };
    metrics.update_engine(
        &EngineSnapshot {
            counters: counters.clone(),
            ..EngineSnapshot::default()
        },
        0,
    );
    let text = metrics.render();
    for (info, value) in counters.values() {
        let line = match info.label {
            Some((key, label)) => format!("\n{}{{{key}=\"{label}\"}} {value}\n", info.metric),
            None => format!("\n{} {value}\n", info.metric),
        };
        assert_eq!(text.matches(&line).count(), 1, "{line}");
        let help = format!("# HELP {} ", info.metric);
        assert_eq!(text.matches(&help).count(), 1, "{help}");
        let kind = format!("# TYPE {} {}\n", info.metric, info.kind.name());
        assert_eq!(text.matches(&kind).count(), 1, "{kind}");
    }
    assert!(text.contains("\npagoda_attention_split_kv_steps_total 1000\n"));
    assert!(text.contains("\npagoda_cpu_steps_total{pool=\"all_threads\"} 1001\n"));
    assert!(text.contains("\npagoda_cpu_pool_switches_total 1002\n"));
}
