//! The tuning table: which kernel, merge placement and CTA target ([`DecodeVariant`]) runs a
//! decode step, and which tiling ([`PrefillStreamTiling`]) runs the streaming prefill, by
//! shape bucket ([`DecodeBucket`]: batch and context, or prompt tokens per request, rounded
//! up to powers of two, for one head geometry, dtype and page size).
//!
//! `pagoda tune` times every candidate of a bucket with cold L2 and stores the winner,
//! but only where it beat the built-in heuristic ([`DecodeVariant::heuristic`]) in the same
//! run. The table is one JSON file in the cache folder, valid for one GPU model, driver and
//! set of kernel sources ([`TableKey`]); a table whose key differs from the running device's
//! is ignored. Buckets the table lacks use the heuristic. Pure host code (tested on the CPU).

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{MergeMode, PagedDecodeKernel, PlanPolicy, PrefillStreamTiling, StreamTiling};

/// What a tuned table is valid for: the GPU's name, the driver's CUDA version and a hash of
/// the tuned kernels' sources.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableKey {
    /// `NVIDIA H200`.
    pub gpu: String,
    /// `cuDriverGetVersion` (1000 x major + 10 x minor).
    pub driver: i32,
    /// FNV-1a of the tuned kernels' sources, hex.
    pub sources: String,
}

impl TableKey {
    /// The key of tables tuned on `gpu` against this build's kernels.
    pub fn of(gpu: &pagoda_cuda::Gpu) -> Self {
        TableKey {
            gpu: gpu.info().name.clone(),
            driver: gpu.info().driver_version,
            sources: tuned_sources_hash(),
        }
    }
}

/// The head geometry, dtype and page size a table row applies to.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DecodeGeometry {
    /// Query heads.
    pub q_heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// KV dtype (`bf16`).
    pub dtype: String,
}

/// A shape bucket: requests and context tokens, each rounded up to a power of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DecodeBucket {
    /// Requests in the step (a power of two).
    pub batch: usize,
    /// The longest request's context (a power of two, at least [`MIN_CONTEXT_BUCKET`]).
    pub context: usize,
}

/// The smallest context bucket (shorter contexts share it).
pub const MIN_CONTEXT_BUCKET: usize = 256;

impl DecodeBucket {
    /// The bucket of a step of `batch` requests whose longest has `context` tokens.
    pub fn of(batch: usize, context: usize) -> Self {
        DecodeBucket {
            batch: batch.max(1).next_power_of_two(),
            context: context.max(MIN_CONTEXT_BUCKET).next_power_of_two(),
        }
    }
}

/// One way to run a decode step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DecodeVariant {
    /// The partial kernel.
    pub kernel: PagedDecodeKernel,
    /// Where the chunks are merged.
    pub merge: MergeMode,
    /// CTAs the plan aims for, in waves of one CTA per SM; 0: the plan is fitted to the CTAs
    /// the GPU holds at once ([`DecodeVariant::resident_ctas`]), minimising waves x chunk
    /// length (`PlanPolicy::resident_ctas`).
    pub waves: usize,
}

/// CTA targets the tuner tries (0: fitted to the resident CTAs), in waves of one CTA per SM.
pub const CANDIDATE_WAVES: [usize; 5] = [0, 1, 2, 4, 8];

impl DecodeVariant {
    /// The built-in choice where no table row applies: the streaming kernel's default tiling
    /// for bf16 at the head sizes it supports, its plan fitted to the resident CTAs (else
    /// CUDA cores aiming for two waves), merged by a second launch (measured on the H200:
    /// `docs/benchmark_results/decode-tuning-h200-2026-12-04.md`).
    pub fn heuristic(bf16: bool, head_dim: usize) -> Self {
        let tiling = StreamTiling::ALL[0];
        let (kernel, waves) = if bf16 && tiling.fits(head_dim) {
            (PagedDecodeKernel::Streaming(tiling), 0)
        } else {
            (PagedDecodeKernel::CudaCore, 2)
        };
        DecodeVariant {
            kernel,
            merge: MergeMode::Separate,
            waves,
        }
    }

    /// The CTAs the GPU holds at once for this variant's kernel at `head_dim` and `group`
    /// on `sm_count` SMs of `smem_per_sm` bytes of shared memory: the streaming kernel's
    /// shared-memory occupancy, else two a SM.
    pub fn resident_ctas(
        &self,
        head_dim: usize,
        group: usize,
        sm_count: usize,
        smem_per_sm: usize,
    ) -> usize {
        let per_sm = match self.kernel {
            PagedDecodeKernel::Streaming(tiling) => {
                tiling.ctas_per_sm(head_dim, group, smem_per_sm)
            }
            _ => 2,
        };
        per_sm * sm_count.max(1)
    }

    /// The plan policy of this variant: `waves` SMs' worth of target CTAs, or (0) a plan
    /// fitted to the resident CTAs; chunks of at least `min_pages` pages.
    pub fn policy(
        &self,
        head_dim: usize,
        group: usize,
        sm_count: usize,
        smem_per_sm: usize,
        min_pages: usize,
    ) -> PlanPolicy {
        let resident = self.resident_ctas(head_dim, group, sm_count, smem_per_sm);
        PlanPolicy {
            target_ctas: if self.waves == 0 {
                resident
            } else {
                self.waves * sm_count.max(1)
            },
            pages_per_chunk: None,
            min_pages_per_chunk: min_pages.max(1),
            resident_ctas: (self.waves == 0).then_some(resident),
        }
    }

    /// Every variant the tuner times for bf16 (or not) at `head_dim`, the heuristic first.
    pub fn candidates(bf16: bool, head_dim: usize) -> Vec<Self> {
        let mut kernels = vec![PagedDecodeKernel::CudaCore];
        if bf16 && super::PAGED_DECODE_MMA_HEAD_DIMS.contains(&head_dim) {
            kernels.push(PagedDecodeKernel::TensorCore);
            let tilings = StreamTiling::ALL.into_iter().filter(|t| t.fits(head_dim));
            kernels.extend(tilings.map(PagedDecodeKernel::Streaming));
        }
        let heuristic = Self::heuristic(bf16, head_dim);
        let mut all = vec![heuristic];
        for kernel in kernels {
            for merge in [MergeMode::Separate, MergeMode::InKernel] {
                for waves in CANDIDATE_WAVES {
                    let variant = DecodeVariant {
                        kernel,
                        merge,
                        waves,
                    };
                    if variant != heuristic {
                        all.push(variant);
                    }
                }
            }
        }
        all
    }

    /// The kernel's name as `pagoda bench attention` and the table spell it.
    pub fn kernel_name(&self) -> String {
        kernel_name(self.kernel)
    }

    /// A small number that tells variants apart (for keys such as a CUDA graph's), below
    /// 2^12: the kernel, then the merge, then the waves (0..=15).
    pub fn code(&self) -> u32 {
        let kernel = match self.kernel {
            PagedDecodeKernel::CudaCore => 0,
            PagedDecodeKernel::TensorCore => 1,
            PagedDecodeKernel::Streaming(tiling) => {
                2 + StreamTiling::ALL
                    .iter()
                    .position(|t| *t == tiling)
                    .unwrap_or(0) as u32
            }
        };
        let merge = u32::from(self.merge == MergeMode::InKernel);
        ((kernel * 2 + merge) << 4) | self.waves.min(15) as u32
    }
}

/// `cuda-core`, `wmma` or `stream-64x2` (the streaming kernel's tile keys and stages).
pub fn kernel_name(kernel: PagedDecodeKernel) -> String {
    match kernel {
        PagedDecodeKernel::CudaCore => "cuda-core".into(),
        PagedDecodeKernel::TensorCore => "wmma".into(),
        PagedDecodeKernel::Streaming(tiling) => tiling.to_string(),
    }
}

/// The kernel of a [`kernel_name`] (`None`: not a kernel this build has).
pub fn parse_kernel(name: &str) -> Option<PagedDecodeKernel> {
    match name {
        "cuda-core" => Some(PagedDecodeKernel::CudaCore),
        "wmma" => Some(PagedDecodeKernel::TensorCore),
        _ => {
            let (keys, stages) = name.strip_prefix("stream-")?.split_once('x')?;
            let (keys, stages): (usize, usize) = (keys.parse().ok()?, stages.parse().ok()?);
            let tiling = StreamTiling::new(keys / 4, stages);
            (keys % 4 == 0 && StreamTiling::ALL.contains(&tiling))
                .then_some(PagedDecodeKernel::Streaming(tiling))
        }
    }
}

impl std::fmt::Display for DecodeVariant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let merge = match self.merge {
            MergeMode::Separate => "separate",
            MergeMode::InKernel => "kernel",
        };
        match self.waves {
            0 => write!(f, "{} {merge} merge, fitted", self.kernel_name()),
            waves => write!(f, "{} {merge} merge, {waves} waves", self.kernel_name()),
        }
    }
}

/// One tuned bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TunedDecode {
    /// The geometry.
    pub geometry: DecodeGeometry,
    /// The bucket.
    pub bucket: DecodeBucket,
    /// The winner's kernel ([`kernel_name`]).
    pub kernel: String,
    /// `separate` or `kernel`.
    pub merge: String,
    /// CTA waves.
    pub waves: usize,
    /// The winner's median, microseconds.
    pub tuned_us: f64,
    /// The heuristic's median in the same run, microseconds.
    pub heuristic_us: f64,
}

impl TunedDecode {
    /// The row's variant (`None`: a kernel or merge this build does not know).
    pub fn variant(&self) -> Option<DecodeVariant> {
        let merge = match self.merge.as_str() {
            "separate" => MergeMode::Separate,
            "kernel" => MergeMode::InKernel,
            _ => return None,
        };
        Some(DecodeVariant {
            kernel: parse_kernel(&self.kernel)?,
            merge,
            waves: self.waves.min(15),
        })
    }

    /// A row for `variant`.
    pub fn new(
        geometry: DecodeGeometry,
        bucket: DecodeBucket,
        variant: DecodeVariant,
        tuned_us: f64,
        heuristic_us: f64,
    ) -> Self {
        TunedDecode {
            geometry,
            bucket,
            kernel: variant.kernel_name(),
            merge: match variant.merge {
                MergeMode::Separate => "separate".into(),
                MergeMode::InKernel => "kernel".into(),
            },
            waves: variant.waves,
            tuned_us,
            heuristic_us,
        }
    }
}

/// One tuned prefill bucket (requests x prompt tokens per request).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TunedPrefill {
    /// The geometry.
    pub geometry: DecodeGeometry,
    /// The bucket: `batch` requests, `context` prompt tokens each (powers of two).
    pub bucket: DecodeBucket,
    /// The winner's tiling (`128x64x2`).
    pub tiling: String,
    /// The winner's median, microseconds.
    pub tuned_us: f64,
    /// The heuristic's median in the same run, microseconds.
    pub heuristic_us: f64,
}

/// The tuning table: its key and the tuned buckets.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TuningTable {
    /// What the rows are valid for.
    pub key: TableKey,
    /// Tuned decode buckets.
    pub decode: Vec<TunedDecode>,
    /// Tuned prefill buckets.
    #[serde(default)]
    pub prefill: Vec<TunedPrefill>,
    /// Tuned sampler splits and linear kernels (`crate::tuned_choices`).
    #[serde(default)]
    pub choices: Vec<crate::tuned_choices::TunedChoice>,
}

impl TuningTable {
    /// An empty table for `key`.
    pub fn new(key: TableKey) -> Self {
        TuningTable {
            key,
            decode: Vec::new(),
            prefill: Vec::new(),
            choices: Vec::new(),
        }
    }

    /// The tuned streaming-prefill tiling of `bucket` at `geometry`, if the table has one.
    pub fn prefill_tiling(
        &self,
        geometry: &DecodeGeometry,
        bucket: DecodeBucket,
    ) -> Option<PrefillStreamTiling> {
        self.prefill
            .iter()
            .find(|row| &row.geometry == geometry && row.bucket == bucket)
            .and_then(|row| PrefillStreamTiling::parse(&row.tiling))
    }

    /// Adds `row`, replacing an earlier row of the same geometry and bucket.
    pub fn insert_prefill(&mut self, row: TunedPrefill) {
        self.prefill
            .retain(|old| !(old.geometry == row.geometry && old.bucket == row.bucket));
        self.prefill.push(row);
        self.prefill.sort_by_key(|row| row.bucket);
    }

    /// The tuned variant of `bucket` at `geometry`, if the table has one.
    pub fn decode_variant(
        &self,
        geometry: &DecodeGeometry,
        bucket: DecodeBucket,
    ) -> Option<DecodeVariant> {
        self.decode
            .iter()
            .find(|row| &row.geometry == geometry && row.bucket == bucket)
            .and_then(TunedDecode::variant)
    }

    /// Adds `row`, replacing an earlier row of the same geometry and bucket.
    pub fn insert(&mut self, row: TunedDecode) {
        self.decode
            .retain(|old| !(old.geometry == row.geometry && old.bucket == row.bucket));
        self.decode.push(row);
        self.decode.sort_by_key(|row| row.bucket);
    }

    /// Reads the table at `path`: `Ok(None)` when there is no file.
    pub fn read(path: &Path) -> Result<Option<Self>, String> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(format!("reading {}: {error}", path.display())),
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|error| format!("{} is not a tuning table: {error}", path.display()))
    }

    /// Writes the table to `path` (creating its folder; through a temporary file, so a
    /// reader never sees half a table).
    pub fn write(&self, path: &Path) -> Result<(), String> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|error| format!("creating {}: {error}", dir.display()))?;
        }
        let text = serde_json::to_string_pretty(self).map_err(|error| error.to_string())?;
        let temporary = path.with_extension("json.tmp");
        std::fs::write(&temporary, text)
            .and_then(|()| std::fs::rename(&temporary, path))
            .map_err(|error| format!("writing {}: {error}", path.display()))
    }
}

/// FNV-1a of the tuned kernels' sources (the fused decode's, the streaming prefill's, the
/// samplers' and the small-batch linear kernel's), hex: a table tuned against other sources
/// is stale.
pub fn tuned_sources_hash() -> String {
    let hashes = [
        super::PAGED_DECODE.source_hash(),
        super::PAGED_DECODE_MMA.source_hash(),
        super::PAGED_DECODE_STREAM.source_hash(),
        super::PREFILL_STREAM.source_hash(),
        crate::sampling::cuda::tuned_sources_hash(),
        crate::linear::cuda::GEMV_SMALL.source_hash(),
    ];
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in hashes.iter().flat_map(|h| h.to_le_bytes()) {
        hash ^= byte as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{hash:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> DecodeGeometry {
        DecodeGeometry {
            q_heads: 32,
            kv_heads: 8,
            head_dim: 128,
            page_size: 16,
            dtype: "bf16".into(),
        }
    }

    #[test]
    fn buckets_round_up_to_powers_of_two() {
        assert_eq!(
            DecodeBucket::of(3, 1000),
            DecodeBucket {
                batch: 4,
                context: 1024
            }
        );
        assert_eq!(
            DecodeBucket::of(0, 1),
            DecodeBucket {
                batch: 1,
                context: 256
            }
        );
        assert_eq!(
            DecodeBucket::of(64, 4096),
            DecodeBucket {
                batch: 64,
                context: 4096
            }
        );
    }

    #[test]
    fn kernel_names_round_trip() {
        for variant in DecodeVariant::candidates(true, 128) {
            assert_eq!(parse_kernel(&variant.kernel_name()), Some(variant.kernel));
        }
        assert_eq!(parse_kernel("stream-64x9"), None);
        assert_eq!(parse_kernel("stream-63x2"), None);
        assert_eq!(parse_kernel("fast"), None);
    }

    #[test]
    fn candidates_start_with_the_heuristic_and_hold_no_duplicates() {
        let all = DecodeVariant::candidates(true, 128);
        let codes: std::collections::HashSet<_> = all.iter().map(DecodeVariant::code).collect();
        assert_eq!(codes.len(), all.len());
        assert!(codes.iter().all(|&code| code < 1 << 12));
        assert_eq!(all[0], DecodeVariant::heuristic(true, 128));
        let unique: std::collections::HashSet<_> = all.iter().collect();
        assert_eq!(unique.len(), all.len());
        // f16 and head sizes without tensor cores: CUDA cores only.
        let f16 = DecodeVariant::candidates(false, 128);
        assert!(f16.iter().all(|v| v.kernel == PagedDecodeKernel::CudaCore));
        assert_eq!(
            DecodeVariant::candidates(true, 32)[0].kernel,
            PagedDecodeKernel::CudaCore
        );
    }

    #[test]
    fn the_table_finds_its_rows_and_survives_a_round_trip() {
        let key = TableKey {
            gpu: "NVIDIA H200".into(),
            driver: 13000,
            sources: tuned_sources_hash(),
        };
        let mut table = TuningTable::new(key);
        let bucket = DecodeBucket::of(4, 4096);
        let variant = DecodeVariant {
            kernel: PagedDecodeKernel::Streaming(StreamTiling::new(16, 3)),
            merge: MergeMode::InKernel,
            waves: 4,
        };
        table.insert(TunedDecode::new(geometry(), bucket, variant, 10.0, 12.0));
        // A second row for the same bucket replaces the first.
        table.insert(TunedDecode::new(geometry(), bucket, variant, 9.0, 12.0));
        assert_eq!(table.decode.len(), 1);
        assert_eq!(table.decode_variant(&geometry(), bucket), Some(variant));
        assert_eq!(
            table.decode_variant(&geometry(), DecodeBucket::of(8, 4096)),
            None
        );
        let other = DecodeGeometry {
            head_dim: 64,
            ..geometry()
        };
        assert_eq!(table.decode_variant(&other, bucket), None);

        let dir = std::env::temp_dir().join(format!("pagoda-tuning-{}", std::process::id()));
        let path = dir.join("tuning.json");
        assert_eq!(TuningTable::read(&path), Ok(None));
        table.write(&path).unwrap();
        assert_eq!(TuningTable::read(&path), Ok(Some(table.clone())));
        // Prefill rows, and tables written before there were any.
        let tiling = PrefillStreamTiling::new(64, 64, 2);
        table.insert_prefill(TunedPrefill {
            geometry: geometry(),
            bucket,
            tiling: tiling.to_string(),
            tuned_us: 5.0,
            heuristic_us: 6.0,
        });
        assert_eq!(table.prefill_tiling(&geometry(), bucket), Some(tiling));
        assert_eq!(table.prefill_tiling(&other, bucket), None);
        table.write(&path).unwrap();
        assert_eq!(TuningTable::read(&path), Ok(Some(table.clone())));
        let mut old: serde_json::Value = serde_json::to_value(&table).unwrap();
        old.as_object_mut().unwrap().remove("prefill");
        std::fs::write(&path, old.to_string()).unwrap();
        let read = TuningTable::read(&path).unwrap().unwrap();
        assert!(read.prefill.is_empty() && read.decode == table.decode);
        std::fs::write(&path, "{").unwrap();
        assert!(TuningTable::read(&path)
            .unwrap_err()
            .contains("not a tuning table"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
