//! `pagoda tune`: the shape-bucketed autotuner of the fused decode attention, the
//! streaming prefill attention and the GPU samplers' split counts (`tune_sampling.rs`).
//!
//! For every bucket (batch x context, powers of two) of one model's head geometry, every
//! candidate variant (decode: partial kernel and tiling, merge placement, CTA target in waves;
//! prefill: the tiling, for batch x prompt tokens per request) is captured in a CUDA graph
//! over rotating inputs of at least 4x the L2 (cold L2: a set's pages are never cached when
//! its turn comes), and the candidates are replayed in alternating rounds, so drift hits them
//! alike. The fastest median wins the bucket, unless it is not at least 1% faster than the
//! built-in heuristic measured in the same rounds: then nothing is stored and the heuristic
//! keeps the bucket. The table is written to the cache folder, keyed by GPU name, driver and a
//! hash of the kernel sources; `serve`, `generate` and `bench` load it at start.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use pagoda_cuda::Gpu;
use pagoda_ops::cuda::{
    self as ops, DecodeBucket, DecodeVariant, PrefillKernel, PrefillStreamTiling, TableKey,
    TunedDecode, TunedPrefill, TuningTable,
};

use pagoda_ops::tuned_choices::ChoiceFamily;

use super::decode_rig::{DecodePath, Geometry, QueryRows, Rig};
use super::tune_race::{race, winner_label};

/// Flags of `pagoda tune`.
#[derive(Args, Debug)]
pub struct TuneArgs {
    /// The model whose attention geometry to tune (GGUF file or Hugging Face folder).
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    /// Or a random-weights preset or config.json of the shapes (default: llama-3.1-8b).
    #[arg(long, conflicts_with = "model")]
    pub random_weights: Option<String>,
    /// Tokens per KV page (the server's `--page-size`).
    #[arg(long, default_value_t = 16)]
    pub page_size: usize,
    /// Batch buckets to tune (powers of two).
    #[arg(
        short = 'b',
        long = "batch",
        value_delimiter = ',',
        default_value = "1,2,4,8,16,32,64"
    )]
    pub batch: Vec<usize>,
    /// Context buckets to tune (powers of two, at least 256).
    #[arg(
        short = 'l',
        long = "context",
        value_delimiter = ',',
        default_value = "512,1024,2048,4096,8192,16384,32768"
    )]
    pub context: Vec<usize>,
    /// What to tune: `decode`, `prefill`, `sampling` (the GPU samplers' CTAs per row), any
    /// of them comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "decode,prefill,sampling")]
    pub kernels: Vec<TunedKernel>,
    /// Sampler rows buckets (powers of two, at most 256).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,2,4,8,16,32,64,128,256"
    )]
    pub sampling_rows: Vec<usize>,
    /// Prefill batch buckets (requests, powers of two).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub prefill_batch: Vec<usize>,
    /// Prefill prompt buckets (tokens per request, powers of two, at least 256).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "512,1024,2048,4096,8192,16384"
    )]
    pub prefill_context: Vec<usize>,
    /// Alternating rounds over the candidates.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Graph replays per candidate per round.
    #[arg(long, default_value_t = 4)]
    pub replays: usize,
    /// Where to write the table (default: the tuning table path `serve` reads).
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Measure and print, but write nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// A kernel `pagoda tune` tunes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TunedKernel {
    /// The fused paged decode.
    Decode,
    /// The streaming prefill.
    Prefill,
    /// The GPU samplers' split counts (Gumbel-max and filtered).
    Sampling,
}

/// The table `serve` would load on `gpu` (an empty one when there is none, or it is stale).
pub fn load_table(gpu: &Gpu) -> Result<TuningTable> {
    let key = TableKey::of(gpu);
    let Some(path) = pagoda_cuda::tuning_table_path(&key.gpu) else {
        return Ok(TuningTable::new(key));
    };
    match TuningTable::read(&path).map_err(anyhow::Error::msg)? {
        Some(table) if table.key == key => Ok(table),
        _ => Ok(TuningTable::new(key)),
    }
}

/// The variant `table` (or the heuristic) picks for `b` requests of `l` tokens.
pub fn table_variant(
    table: Option<&TuningTable>,
    geometry: &Geometry,
    b: usize,
    l: usize,
) -> DecodeVariant {
    let bucket = DecodeBucket::of(b, l);
    table
        .and_then(|table| table.decode_variant(&geometry.tuning(), bucket))
        .unwrap_or_else(|| DecodeVariant::heuristic(true, geometry.head_dim))
}

fn geometry(args: &TuneArgs) -> Result<(Geometry, usize)> {
    let config = match (&args.model, &args.random_weights) {
        (Some(path), _) if path.is_dir() => {
            pagoda_models::hf::HfModelDir::open(path)
                .with_context(|| format!("reading {}", path.display()))?
                .config
        }
        (Some(path), _) => {
            let file = pagoda_models::formats::gguf::GgufFile::open(path)
                .with_context(|| format!("reading {}", path.display()))?;
            pagoda_models::gguf_model::config_from_gguf(&file).map_err(anyhow::Error::msg)?
        }
        (None, spec) => {
            pagoda_models::random::random_config(spec.as_deref().unwrap_or("llama-3.1-8b"))
                .map_err(|e| anyhow::anyhow!("{e}"))?
        }
    };
    let geometry = Geometry {
        q_heads: config.num_attention_heads,
        kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
        page_size: args.page_size,
    };
    Ok((geometry, config.vocab_size))
}

/// Runs `pagoda tune`.
pub fn run(args: TuneArgs) -> Result<()> {
    if args.rounds == 0 || args.replays == 0 {
        bail!("--rounds and --replays must be at least 1");
    }
    let buckets = args.batch.iter().chain(&args.context);
    for &n in buckets
        .chain(&args.prefill_batch)
        .chain(&args.prefill_context)
        .chain(&args.sampling_rows)
    {
        if !n.is_power_of_two() {
            bail!(
                "--batch, --context, the --prefill- buckets and --sampling-rows take powers of \
                 two, not {n}"
            );
        }
    }
    if let Some(&rows) = args
        .sampling_rows
        .iter()
        .find(|&&r| r > ops::MAX_SAMPLING_ROWS)
    {
        bail!(
            "--sampling-rows: {rows} is more than the sampler's {} rows",
            ops::MAX_SAMPLING_ROWS
        );
    }
    if args
        .context
        .iter()
        .chain(&args.prefill_context)
        .any(|&l| l < ops::MIN_CONTEXT_BUCKET)
    {
        bail!("--context buckets start at {}", ops::MIN_CONTEXT_BUCKET);
    }
    let decode = args.kernels.contains(&TunedKernel::Decode);
    let prefill = args.kernels.contains(&TunedKernel::Prefill);
    let sampling = args.kernels.contains(&TunedKernel::Sampling);
    if !args.page_size.is_power_of_two() {
        bail!("--page-size must be a power of two, not {}", args.page_size);
    }
    let (geometry, vocab) = geometry(&args)?;
    let decode_cases = args
        .batch
        .iter()
        .flat_map(|&b| args.context.iter().map(move |&l| (b, l)));
    let prefill_cases = (args.prefill_batch.iter())
        .flat_map(|&b| args.prefill_context.iter().map(move |&l| (b, l)));
    let largest = (decode_cases.filter(|_| decode))
        .chain(prefill_cases.filter(|_| prefill))
        .map(|(b, l)| geometry.kv_bytes(b, l))
        .max()
        .unwrap_or(0);
    let mut rig = Rig::new(geometry, largest)?;
    let key = TableKey::of(&rig.gpu);
    let path = match &args.output {
        Some(path) => path.clone(),
        None => pagoda_cuda::tuning_table_path(&key.gpu).context(
            "no cache folder for the tuning table (set HOME, XDG_CACHE_HOME or \
             PAGODA_TUNING_TABLE, or pass --output)",
        )?,
    };
    let mut table = match TuningTable::read(&path).map_err(anyhow::Error::msg)? {
        Some(table) if table.key == key => table,
        Some(_) => {
            eprintln!(
                "{}: tuned for another GPU, driver or kernels; starting afresh",
                path.display()
            );
            TuningTable::new(key)
        }
        None => TuningTable::new(key),
    };
    if decode {
        tune_decode(&args, &mut rig, &mut table)?;
    }
    if prefill {
        tune_prefill(&args, &mut rig, &mut table)?;
    }
    if sampling {
        super::tune_sampling::tune_sampling(
            &rig.gpu,
            vocab,
            &args.sampling_rows,
            (args.rounds, args.replays),
            &mut table,
        )?;
    }
    if args.dry_run {
        eprintln!("dry run: the table was not written");
    } else {
        table.write(&path).map_err(anyhow::Error::msg)?;
        eprintln!(
            "wrote {} ({} decode, {} prefill and {} sampler buckets tuned)",
            path.display(),
            table.decode.len(),
            table.prefill.len(),
            table.count_choices(ChoiceFamily::SamplingSplits)
                + table.count_choices(ChoiceFamily::FilterSplits)
        );
    }
    Ok(())
}

/// Times every decode candidate per bucket and stores the winners that beat the heuristic.
fn tune_decode(args: &TuneArgs, rig: &mut Rig, table: &mut TuningTable) -> Result<()> {
    let geometry = rig.geometry;
    let candidates = DecodeVariant::candidates(true, geometry.head_dim);
    eprintln!(
        "tuning {} candidates over {} buckets ({} query heads, {} KV heads, head_dim {}, page {})",
        candidates.len(),
        args.batch.len() * args.context.len(),
        geometry.q_heads,
        geometry.kv_heads,
        geometry.head_dim,
        geometry.page_size
    );
    println!(
        "{:>3} {:>6} {:>12} {:>10} {:>8}  winner",
        "B", "L", "heuristic us", "tuned us", "speedup"
    );
    for &b in &args.batch {
        for &l in &args.context {
            let case = rig.case(b, l, QueryRows::Decode)?;
            let captured = candidates
                .iter()
                .map(|&variant| {
                    let policy = rig.policy(&variant, 64usize.div_ceil(geometry.page_size));
                    rig.capture(&case, DecodePath::Fused(variant, policy))
                })
                .collect::<Result<Vec<_>>>()?;
            // candidates[0] is the heuristic.
            let verdict = race(&rig.gpu, &captured, args.rounds, args.replays)?;
            let (best, best_us, heuristic_us) =
                (verdict.best, verdict.best_us, verdict.heuristic_us);
            let stored = verdict.stored;
            let bucket = DecodeBucket::of(b, l);
            let winner = candidates[best];
            if stored {
                table.insert(TunedDecode::new(
                    geometry.tuning(),
                    bucket,
                    winner,
                    best_us,
                    heuristic_us,
                ));
            }
            println!(
                "{b:>3} {l:>6} {heuristic_us:>12.1} {best_us:>10.1} {:>7.3}x  {}",
                heuristic_us / best_us,
                winner_label(best, stored, "the heuristic".into(), winner.to_string())
            );
        }
    }
    Ok(())
}

/// Times every streaming-prefill tiling per bucket (batch x prompt tokens per request) and
/// stores the winners that beat the heuristic.
fn tune_prefill(args: &TuneArgs, rig: &mut Rig, table: &mut TuningTable) -> Result<()> {
    let geometry = rig.geometry;
    if !ops::STREAM_PREFILL_HEAD_DIMS.contains(&geometry.head_dim) {
        eprintln!(
            "prefill: no streaming prefill at head_dim {} (the WMMA kernel runs); nothing to tune",
            geometry.head_dim
        );
        return Ok(());
    }
    eprintln!(
        "tuning {} prefill tilings over {} buckets",
        PrefillStreamTiling::ALL.len(),
        args.prefill_batch.len() * args.prefill_context.len()
    );
    println!(
        "{:>3} {:>6} {:>12} {:>10} {:>8}  winner (prefill)",
        "B", "L", "heuristic us", "tuned us", "speedup"
    );
    for &b in &args.prefill_batch {
        for &l in &args.prefill_context {
            let heuristic = PrefillStreamTiling::heuristic(b, l);
            // The heuristic first, then the other tilings.
            let candidates: Vec<PrefillStreamTiling> = std::iter::once(heuristic)
                .chain(
                    PrefillStreamTiling::ALL
                        .into_iter()
                        .filter(|t| *t != heuristic),
                )
                .collect();
            let case = rig.case(b, l, QueryRows::Prefill)?;
            let captured = candidates
                .iter()
                .map(|&tiling| {
                    rig.capture(&case, DecodePath::Prefill(PrefillKernel::Stream(tiling)))
                })
                .collect::<Result<Vec<_>>>()?;
            let verdict = race(&rig.gpu, &captured, args.rounds, args.replays)?;
            let (best, best_us, heuristic_us) =
                (verdict.best, verdict.best_us, verdict.heuristic_us);
            let stored = verdict.stored;
            if stored {
                table.insert_prefill(TunedPrefill {
                    geometry: geometry.tuning(),
                    bucket: DecodeBucket::of(b, l),
                    tiling: candidates[best].to_string(),
                    tuned_us: best_us,
                    heuristic_us,
                });
            }
            println!(
                "{b:>3} {l:>6} {heuristic_us:>12.1} {best_us:>10.1} {:>7.3}x  {}",
                heuristic_us / best_us,
                winner_label(
                    best,
                    stored,
                    format!("the heuristic ({heuristic})"),
                    candidates[best].to_string()
                )
            );
        }
    }
    Ok(())
}
