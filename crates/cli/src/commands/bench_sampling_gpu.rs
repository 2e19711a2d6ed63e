//! `pagoda bench sampling --device cuda`: the batched GPU sampler
//! ([`pagoda_ops::cuda::sample_rows`]) measured the way the peer anchors were
//! (`shared/anchors/gpu-anchors.md`, table D), next to FlashInfer's numbers for the same cell.
//!
//! Per (vocab V, batch B): `R` rotating input sets of `[B, V]` f32 logits, standard normal
//! times 3 (the anchors' `randn x 3`), generated on the host once and uploaded, `R` the
//! smallest count whose logits add up to at least 4x the GPU's L2 (at most 32, so B = 1 stays
//! L2-resident as in the anchors). Every row has its own seed and every set its own step, so
//! all draws differ. Per configuration (greedy, plain sampling at temperature 1, top-p 0.9,
//! top-k 50 + top-p 0.9, min-p 0.05) one CUDA graph holds the `R` sampler calls; it is
//! replayed `--replays` times back to back, each replay timed with CUDA events; reported: the
//! median and the minimum replay time / R, in microseconds per call.
//!
//! After the timing the sampler's running totals (rows per path, rejection rounds) are read
//! back and must account for exactly the rows sampled on the configuration's path, and every
//! sampled token is checked on the host against the logits (greedy = the argmax; filtered
//! rows inside their top-k / nucleus / min-p set), so the numbers are of a sampler that ran
//! the intended path and drew valid tokens. A failed check fails the command after the table.

use anyhow::{anyhow, bail, Context, Result};
use pagoda_cuda::{CudaError, DeviceBuffer, Gpu};
use pagoda_ops::cuda::{
    encode_row_params, sample_rows_with, sampling_splits, ClusterShape, FilteredSampling,
    SamplingMix, SamplingOptions, SamplingRowParams, SamplingTotals, SamplingWorkspace,
    MAX_SAMPLING_ROWS,
};
use rayon::prelude::*;
use serde::Serialize;

use super::bench_sampling::{
    check_token, median_and_min, randn_rows, BenchSamplingArgs, FilteredArms, OnOff,
};

pub use super::bench_sampling_anchors::{anchor_for, Configuration};

/// Vocabulary sizes measured when `--vocab` is not given (Llama-3 and Qwen2.5, table D).
pub const GPU_VOCAB_SIZES: [usize; 2] = [128256, 151936];
/// Standard deviation of the benchmark logits (the anchors' `randn x 3`).
pub const LOGIT_SCALE: f64 = 3.0;
/// Most rotating input sets per graph (the anchors' R <= 32).
pub const MAX_ROTATING_SETS: usize = 32;
/// The rotating sets add up to at least this many times the L2.
const L2_MULTIPLE: usize = 4;
/// Seed of the first row's request; row `r` of a set uses `ROW_SEED_BASE + r`.
const ROW_SEED_BASE: u64 = 0x5EED_0000;

/// One measured (V, B, configuration) cell.
#[derive(Serialize)]
struct CaseResult {
    vocab: usize,
    batch: usize,
    configuration: &'static str,
    /// The filtered rows' path (`fast` / `exact`; `-` for greedy and plain).
    filtered: &'static str,
    rotating_sets: usize,
    splits: usize,
    median_us: f64,
    min_us: f64,
    /// FlashInfer from logits for the same cell (anchors, table D), if measured; the issue's
    /// bar is a ratio of at least 2.
    anchor: Option<Comparison>,
    /// A second peer number for the same cell.
    second: Option<Comparison>,
    /// The sampler's totals over every launch of this cell (warm-up and replays).
    totals: SamplingTotals,
    /// Rows the launches sampled; the totals must account for exactly these on the path.
    rows_sampled: u64,
    path_ok: bool,
    /// Tokens checked on the host against their logits, and how many failed.
    tokens_checked: usize,
    token_failures: usize,
    first_token_failure: Option<String>,
}

/// A peer's time for a cell and `us / median_us` (> 1: pagoda is faster).
#[derive(Serialize, Clone, Copy)]
struct Comparison {
    name: &'static str,
    us: f64,
    ratio: f64,
}

/// One rotating input set on the device: `[B, V]` logits and the `[B]` tokens drawn from
/// them.
struct InputSet {
    logits: DeviceBuffer<f32>,
    tokens: DeviceBuffer<u32>,
}

/// The geometry of one (V, B) cell.
#[derive(Clone, Copy)]
struct Cell {
    vocab: usize,
    batch: usize,
    /// CTAs per row the sampler picks (reported only).
    splits: usize,
}

/// Runs `pagoda bench sampling --device cuda` with `args` (`--vocab`, `--batch`,
/// `--replays`, `--json`; the CPU-only flags are ignored).
pub fn run(args: &BenchSamplingArgs) -> Result<()> {
    let vocab_sizes = if args.vocab_sizes.is_empty() {
        GPU_VOCAB_SIZES.to_vec()
    } else {
        args.vocab_sizes.clone()
    };
    validate(&vocab_sizes, &args.batch, args.replays)?;
    let gpu = Gpu::new(0)
        .map_err(|error| anyhow!("pagoda bench sampling --device cuda needs a GPU: {error}"))?;
    let device = gpu.info().to_string();
    let l2_bytes = gpu.info().l2_cache_bytes as usize;
    let sm_count = gpu.info().sm_count as usize;
    if !args.json {
        println!("device: {device}");
        println!(
            "logits randn x {LOGIT_SCALE} (f32); rotating sets >= {L2_MULTIPLE}x L2 ({} MiB), \
             R <= {MAX_ROTATING_SETS}; {} graph replays; us per call = replay / R",
            l2_bytes >> 20,
            args.replays
        );
    }
    let max_vocab = vocab_sizes.iter().copied().max().unwrap_or(1);
    let max_batch = args.batch.iter().copied().max().unwrap_or(1);
    let mut workspace = SamplingWorkspace::new(&gpu, max_batch, max_vocab)?;
    let mut cases = Vec::new();
    let mut header = true;
    for &vocab in &vocab_sizes {
        for &batch in &args.batch {
            let set_bytes = batch * vocab * 4;
            let sets = rotating_sets(set_bytes, l2_bytes);
            let host = randn_rows(
                sets * batch,
                vocab,
                LOGIT_SCALE,
                vocab as u64 ^ (batch << 20) as u64,
            );
            let mut inputs = host
                .chunks_exact(batch * vocab)
                .map(|set| {
                    Ok(InputSet {
                        logits: gpu.upload(set)?,
                        tokens: gpu.zeros(batch)?,
                    })
                })
                .collect::<Result<Vec<_>, CudaError>>()
                .with_context(|| format!("uploading {sets} sets of {batch} x {vocab} logits"))?;
            let cell = Cell {
                vocab,
                batch,
                splits: args
                    .splits
                    .unwrap_or_else(|| sampling_splits(batch, vocab, sm_count)),
            };
            let configurations = if args.configurations.is_empty() {
                Configuration::ALL.to_vec()
            } else {
                args.configurations.clone()
            };
            for configuration in configurations {
                let filtered =
                    !matches!(configuration, Configuration::Greedy | Configuration::Plain);
                let arms: &[FilteredSampling] = match (filtered, args.filtered) {
                    (false, _) | (true, FilteredArms::Fast) => &[FilteredSampling::Fast],
                    (true, FilteredArms::Exact) => &[FilteredSampling::Exact],
                    (true, FilteredArms::Both) => {
                        &[FilteredSampling::Fast, FilteredSampling::Exact]
                    }
                };
                for &arm in arms {
                    let options = ArmOptions {
                        filtered: arm,
                        gumbel_max: args.gumbel_max == OnOff::On,
                        list_rounds: args.list_rounds == OnOff::On,
                        cluster: args.cluster == OnOff::On,
                        cluster_shape: args.cluster_shape.unwrap_or_default(),
                        cluster_prefetch: args.prefetch == OnOff::On,
                        fast_rounds: args.fast_rounds,
                        filter_splits: args.filter_splits,
                        splits: args.splits,
                        label: if filtered { arm.name() } else { "-" },
                    };
                    let case = measure(
                        &gpu,
                        &mut workspace,
                        &mut inputs,
                        &host,
                        cell,
                        configuration,
                        options,
                        args.replays,
                    )
                    .with_context(|| {
                        format!(
                            "V {vocab}, B {batch}, {} ({})",
                            configuration.name(),
                            arm.name()
                        )
                    })?;
                    if !args.json {
                        print_row(&case, header);
                        header = false;
                    }
                    cases.push(case);
                }
            }
        }
    }
    let failed = cases
        .iter()
        .filter(|case| !case.path_ok || case.token_failures > 0)
        .count();
    let worst = cases
        .iter()
        .filter_map(|case| case.anchor.map(|a| (a.ratio, case)))
        .min_by(|a, b| a.0.total_cmp(&b.0));
    if let (Some((ratio, case)), false) = (worst, args.json) {
        println!(
            "worst FlashInfer/ours: {ratio:.2}x at V {} B {} {} (the issue's bar: 2x everywhere)",
            case.vocab, case.batch, case.configuration
        );
    }
    if args.json {
        let report =
            serde_json::json!({ "device": device, "replays": args.replays, "cases": cases });
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    if failed > 0 {
        bail!("{failed} case(s) failed their path or token checks (see path_ok / token_failures)");
    }
    Ok(())
}

/// Checks the flags before anything touches the GPU; errors name the flag and value.
fn validate(vocab_sizes: &[usize], batch: &[usize], replays: usize) -> Result<()> {
    if replays == 0 {
        bail!("--replays must be at least 1");
    }
    if batch.is_empty() || vocab_sizes.is_empty() {
        bail!("--batch and --vocab need at least one value");
    }
    if let Some(&bad) = batch.iter().find(|&&b| b == 0 || b > MAX_SAMPLING_ROWS) {
        bail!("--batch {bad} must be in 1..={MAX_SAMPLING_ROWS}");
    }
    if let Some(&bad) = vocab_sizes
        .iter()
        .find(|&&v| v < 2 || v >= u32::MAX as usize)
    {
        bail!("--vocab {bad} must be at least 2 and below 2^32 - 1");
    }
    for &vocab in vocab_sizes {
        for &b in batch {
            match b.checked_mul(vocab).and_then(|n| n.checked_mul(4)) {
                Some(bytes) if bytes <= 16 << 30 => {}
                _ => bail!("--batch {b} x --vocab {vocab} logits exceed 16 GiB per set"),
            }
        }
    }
    Ok(())
}

/// Rotating sets for inputs of `set_bytes` each: the fewest adding up to at least
/// `L2_MULTIPLE` times `l2_bytes`, within `1..=MAX_ROTATING_SETS`.
pub fn rotating_sets(set_bytes: usize, l2_bytes: usize) -> usize {
    (L2_MULTIPLE * l2_bytes)
        .div_ceil(set_bytes.max(1))
        .clamp(1, MAX_ROTATING_SETS)
}

/// The parameters of row `row` of rotating set `set`: the configuration's filters, seed
/// `ROW_SEED_BASE + row`, step `set` (so every row and set draws differently).
fn row_params(configuration: Configuration, row: usize, set: usize) -> Result<SamplingRowParams> {
    let chain = configuration.params();
    let top_k = u32::try_from(chain.top_k).unwrap_or(0);
    Ok(SamplingRowParams::new(
        chain.temperature,
        top_k,
        chain.top_p,
        chain.min_p,
        ROW_SEED_BASE + row as u64,
        set as u64,
    )?)
}

/// The sampler options of one measured arm.
#[derive(Clone, Copy)]
struct ArmOptions {
    filtered: FilteredSampling,
    /// [`SamplingOptions::gumbel_max`].
    gumbel_max: bool,
    /// [`SamplingOptions::list_rounds`].
    list_rounds: bool,
    /// [`SamplingOptions::cluster`].
    cluster: bool,
    /// [`SamplingOptions::cluster_shape`].
    cluster_shape: ClusterShape,
    /// [`SamplingOptions::cluster_prefetch`].
    cluster_prefetch: bool,
    fast_rounds: Option<u32>,
    /// [`SamplingOptions::filter_splits`].
    filter_splits: Option<usize>,
    /// [`SamplingOptions::num_splits`].
    splits: Option<usize>,
    /// The arm's name in the table.
    label: &'static str,
}

/// Times one configuration over the rotating `inputs` (their host logits in `host`, set
/// after set), then checks the totals and every drawn token.
#[allow(clippy::too_many_arguments)]
fn measure(
    gpu: &Gpu,
    workspace: &mut SamplingWorkspace,
    inputs: &mut [InputSet],
    host: &[f32],
    cell: Cell,
    configuration: Configuration,
    arm: ArmOptions,
    replays: usize,
) -> Result<CaseResult> {
    let Cell { vocab, batch, .. } = cell;
    let sets = inputs.len();
    let mut params = Vec::with_capacity(sets);
    let mut mix = None;
    for set in 0..sets {
        let rows = (0..batch)
            .map(|row| row_params(configuration, row, set))
            .collect::<Result<Vec<_>>>()?;
        mix = Some(SamplingMix::of(&rows, vocab));
        params.push(gpu.upload(&encode_row_params(&rows)?)?);
    }
    // The stages this configuration's rows need, as `forward_sampled` launches them.
    let options = SamplingOptions {
        filtered: arm.filtered,
        fast_rounds: arm.fast_rounds,
        gumbel_max: arm.gumbel_max,
        list_rounds: arm.list_rounds,
        cluster: arm.cluster,
        cluster_shape: arm.cluster_shape,
        cluster_prefetch: arm.cluster_prefetch,
        filter_splits: arm.filter_splits,
        num_splits: arm.splits,
        mix: mix.unwrap_or(SamplingMix::ALL),
        ..SamplingOptions::default()
    };
    workspace.reset_totals(gpu)?;
    let mut times = Vec::with_capacity(replays);
    {
        let mut record = |gpu: &Gpu| -> Result<(), CudaError> {
            for (input, set_params) in inputs.iter_mut().zip(&params) {
                sample_rows_with(
                    gpu,
                    &input.logits,
                    vocab,
                    set_params,
                    workspace,
                    &mut input.tokens,
                    options,
                )?;
            }
            Ok(())
        };
        let graph = super::decode_rig::warm_capture(gpu, &mut record)?;
        let mut events = Vec::with_capacity(replays);
        for _ in 0..replays {
            let start = gpu.record_event()?;
            graph.launch()?;
            events.push((start, gpu.record_event()?));
        }
        gpu.synchronize()?;
        for (start, end) in &events {
            times.push(start.elapsed_ms(end)? as f64 * 1e3 / sets as f64);
        }
    }
    let totals = workspace.read_totals(gpu)?;
    // Eager warm-up + one untimed replay + the timed replays, `sets` calls each.
    let rows_sampled = ((replays + 2) * sets * batch) as u64;
    // Plain rows find their maxima in the Gumbel kernel when it is on (no row is filtered).
    let gumbel_max_rows = if arm.gumbel_max && configuration == Configuration::Plain {
        rows_sampled
    } else {
        0
    };
    // Top-k + top-p rows run their rounds on their id list when it is on (the fast path),
    // and no other configuration fills lists.
    let listed = arm.list_rounds
        && arm.filtered == FilteredSampling::Fast
        && configuration == Configuration::TopKTopP;
    // The launches ran the cluster kernel exactly when the sampler's rule says so.
    let clustered = options.runs_cluster(vocab, gpu.info().compute_capability);
    let path_ok = configuration.path_accounts_for(&totals, rows_sampled)
        && totals.gumbel_max_rows == gumbel_max_rows
        && (totals.list_rows > 0) == listed
        && (totals.cluster_rows > 0) == clustered;
    let chain = configuration.params();
    let mut failures = Vec::new();
    for (set, input) in inputs.iter().enumerate() {
        let tokens = gpu.download(&input.tokens)?;
        let set_logits = &host[set * batch * vocab..(set + 1) * batch * vocab];
        let set_failures: Vec<String> = set_logits
            .par_chunks_exact(vocab)
            .zip(tokens.par_iter())
            .enumerate()
            .filter_map(|(row, (logits, &token))| {
                let reason = check_token(&chain, logits, token).err()?;
                Some(format!("set {set} row {row}: {reason}"))
            })
            .collect();
        failures.extend(set_failures);
    }
    let (median_us, min_us) = median_and_min(&mut times);
    let anchor = anchor_for(vocab, batch, configuration);
    let compare = |(name, us): (&'static str, f64)| Comparison {
        name,
        us,
        ratio: us / median_us,
    };
    Ok(CaseResult {
        vocab,
        batch,
        configuration: configuration.name(),
        filtered: arm.label,
        rotating_sets: sets,
        splits: cell.splits,
        median_us,
        min_us,
        anchor: anchor.map(|a| compare(("flashinfer", a.flashinfer_us))),
        second: anchor.and_then(|a| a.second).map(compare),
        totals,
        rows_sampled,
        path_ok,
        tokens_checked: sets * batch,
        token_failures: failures.len(),
        first_token_failure: failures.into_iter().next(),
    })
}

/// A number or a dash.
fn cell(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(|| "-".to_string(), |v| format!("{v:.decimals$}"))
}

fn print_row(case: &CaseResult, header: bool) {
    if header {
        println!(
            "| V | B | R | splits | configuration | filtered | us/call median | min | FI us | \
             FI/ours | >= 2x | 2nd comparison | 2nd us | 2nd/ours | \
             greedy/gumbel/rejection/fallback | fast/exact rows, gumbel-max, cluster, prefetched rows | rounds/filtered row | path | \
             tokens ok |"
        );
        println!(
            "| ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | --- | --- | \
             ---: | ---: | --- | --- | ---: | --- | --- |"
        );
    }
    let totals = &case.totals;
    let filtered = totals.rejection + totals.fallback;
    let rounds = (filtered > 0).then(|| totals.rejection_rounds as f64 / filtered as f64);
    let bar = case
        .anchor
        .map_or("-", |a| if a.ratio >= 2.0 { "yes" } else { "NO" });
    let tokens = match &case.first_token_failure {
        None => format!("{}/{}", case.tokens_checked, case.tokens_checked),
        Some(first) => format!(
            "{} FAILED of {} (first: {first})",
            case.token_failures, case.tokens_checked
        ),
    };
    println!(
        "| {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {} | {} | {} | {} | {} | {} | \
         {}/{}/{}/{} | {}/{}, {}, {}, {} | {} | {} | {} |",
        case.vocab,
        case.batch,
        case.rotating_sets,
        case.splits,
        case.configuration,
        case.filtered,
        case.median_us,
        case.min_us,
        cell(case.anchor.map(|a| a.us), 1),
        cell(case.anchor.map(|a| a.ratio), 2),
        bar,
        case.second.map_or("-", |a| a.name),
        cell(case.second.map(|a| a.us), 1),
        cell(case.second.map(|a| a.ratio), 2),
        totals.greedy,
        totals.gumbel,
        totals.rejection,
        totals.fallback,
        totals.filtered_fast,
        totals.filtered_exact,
        totals.gumbel_max_rows,
        totals.cluster_rows,
        totals.prefetched_rows,
        cell(rounds, 2),
        if case.path_ok { "ok" } else { "MISMATCH" },
        tokens,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchors_are_table_d_sums() {
        let plain = anchor_for(128256, 1, Configuration::Plain).unwrap();
        assert!((plain.flashinfer_us - (33.0 + 22.2)).abs() < 1e-9);
        let top_p = anchor_for(151936, 64, Configuration::TopP).unwrap();
        assert!((top_p.flashinfer_us - (66.2 + 35.3)).abs() < 1e-9);
        assert_eq!(top_p.second, Some(("torch sort top-p", 1238.6)));
        let joint = anchor_for(151936, 16, Configuration::TopKTopP).unwrap();
        assert_eq!(joint.flashinfer_us, 120.9);
        assert_eq!(joint.second, Some(("fi radix top-k", 65.1)));
        let min_p = anchor_for(128256, 16, Configuration::MinP).unwrap();
        assert!((min_p.flashinfer_us - (41.7 + 35.3)).abs() < 1e-9);
        assert_eq!(anchor_for(128256, 1, Configuration::Greedy), None);
        assert_eq!(anchor_for(128256, 8, Configuration::TopP), None);
        assert_eq!(anchor_for(49152, 1, Configuration::TopP), None);
    }

    #[test]
    fn rotating_sets_cover_four_l2s_within_32() {
        let l2 = 60 << 20;
        // B = 1, V = 128256: 0.5 MB per set, capped at 32 (L2-resident, as the anchors).
        assert_eq!(rotating_sets(128256 * 4, l2), 32);
        // B = 64, V = 151936: 38.9 MB per set -> 7 sets = 272 MB >= 251.7 MB.
        let sets = rotating_sets(64 * 151936 * 4, l2);
        assert_eq!(sets, 7);
        assert!(sets * 64 * 151936 * 4 >= 4 * l2);
        assert!((sets - 1) * 64 * 151936 * 4 < 4 * l2);
        assert_eq!(rotating_sets(1 << 40, l2), 1);
    }

    #[test]
    fn row_params_differ_per_row_and_set_and_keep_the_filters() {
        let a = row_params(Configuration::TopKTopP, 0, 0).unwrap();
        let b = row_params(Configuration::TopKTopP, 1, 0).unwrap();
        let c = row_params(Configuration::TopKTopP, 0, 1).unwrap();
        assert_ne!(a.seed(), b.seed());
        assert_eq!(a.step(), b.step());
        assert_ne!(a.step(), c.step());
        assert_eq!(
            (a.temperature, a.top_k, a.top_p, a.min_p),
            (1.0, 50, 0.9, 0.0)
        );
        let greedy = row_params(Configuration::Greedy, 3, 2).unwrap();
        assert_eq!(greedy.temperature, 0.0);
        let min_p = row_params(Configuration::MinP, 0, 0).unwrap();
        assert_eq!((min_p.top_k, min_p.top_p, min_p.min_p), (0, 1.0, 0.05));
    }

    #[test]
    fn totals_must_account_for_every_row_on_the_path() {
        let totals = SamplingTotals {
            greedy: 0,
            gumbel: 0,
            rejection: 90,
            fallback: 10,
            rejection_rounds: 400,
            filtered_fast: 80,
            filtered_exact: 20,
            gumbel_max_rows: 0,
            list_rows: 0,
            cluster_rows: 0,
            prefetched_rows: 0,
        };
        assert!(Configuration::TopP.path_accounts_for(&totals, 100));
        assert!(!Configuration::TopP.path_accounts_for(&totals, 101));
        assert!(!Configuration::Plain.path_accounts_for(&totals, 100));
        let mixed = SamplingTotals {
            gumbel: 100,
            greedy: 1,
            ..totals
        };
        assert!(!Configuration::Plain.path_accounts_for(&mixed, 100));
        let uncounted = SamplingTotals {
            filtered_exact: 19,
            ..totals
        };
        assert!(!Configuration::TopP.path_accounts_for(&uncounted, 100));
    }

    #[test]
    fn flags_are_validated_before_the_gpu() {
        assert!(validate(&[128256], &[1, 64], 10).is_ok());
        let error = validate(&[128256], &[0], 10).unwrap_err().to_string();
        assert!(error.contains("--batch 0"), "{error}");
        let error = validate(&[1], &[1], 10).unwrap_err().to_string();
        assert!(error.contains("--vocab 1"), "{error}");
        assert!(validate(&[128256], &[1], 0).is_err());
        assert!(validate(&[1 << 31], &[60000], 1).is_err());
    }
}
