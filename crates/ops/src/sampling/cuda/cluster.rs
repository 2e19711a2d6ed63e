//! `sampling_cluster`: the geometry of its launch (a thread-block cluster of
//! [`CLUSTER_CTAS`] CTAs per top-p row) and the launch itself.

use std::str::FromStr;

use super::{specialize_sampling, SamplingEntry, SamplingOptions, SamplingWorkspace};
use pagoda_cuda::{
    ptr, CudaError, DeviceRead, DeviceWrite, Gpu, KernelArg, KernelSpec, LaunchDims,
};

/// CTAs of one cluster, which samples one row (`CLUSTER_CTAS` in the kernel).
pub(super) const CLUSTER_CTAS: u32 = 8;
/// Largest row slice (bytes) of one cluster CTA; larger vocabularies take the pipeline.
const CLUSTER_SLICE_BYTES: usize = 200 * 1024;
/// Shared memory of one SM of compute capability 9.0 and 10.0 (bytes); the launch reads the
/// device's own ([`pagoda_cuda::DeviceInfo::shared_memory_per_sm`]: 100 KiB on 12.x).
#[cfg(test)]
const SM_SHARED_BYTES: usize = 228 * 1024;
/// Shared memory the driver reserves per CTA.
const CTA_RESERVED_BYTES: usize = 1024;

/// Shared-memory bytes of one CTA's whole slice of a `vocab`-logit row (the kernels'
/// `split_range` over `CLUSTER_CTAS` splits: whole groups of 4 logits).
pub(super) fn cluster_slice_bytes(vocab: usize) -> usize {
    4 * vocab.div_ceil(4).div_ceil(CLUSTER_CTAS as usize) * 4
}

/// Whether rows of `vocab` logits can take the cluster kernel: a slice of at most 200 KiB.
pub(super) fn cluster_fits(vocab: usize) -> bool {
    cluster_slice_bytes(vocab) <= CLUSTER_SLICE_BYTES
}

/// The CTA shape of `sampling_cluster`: threads per CTA and the CTAs per SM its registers
/// (`__launch_bounds__`) and shared memory are sized for. The kernel keeps as much of each
/// CTA's slice in shared memory as fits that many CTAs on an SM ([`ClusterShape::held`]) and
/// reads the rest from global memory (L2 after the first pass), so a whole batch of rows
/// can be resident at once. Written `512x3` (threads x CTAs per SM). Same tokens for every
/// shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClusterShape {
    /// Threads per CTA: a multiple of 128 in `256..=1024`.
    pub threads: u32,
    /// CTAs per SM: `1..=8`, at most 2048 threads per SM.
    pub ctas_per_sm: u32,
}

impl ClusterShape {
    /// The shape the sampler uses unless told otherwise. Measured on the H200 (`pagoda bench
    /// sampling --device cuda --configurations top-p --batch 1,16,32,48,64 --cluster-shape
    /// S`, V 128256 and 151936): the fastest at batch 16 to 64 (at batch 64 the others took
    /// 7-53% longer, except 384x4 at V 151936, a tie); 1024x1 was 4-6% faster at batch 1
    /// only. More CTAs per SM (held slices, the rest from L2) did not pay: the kernel is
    /// bound by issue and barriers, not by occupancy.
    pub const DEFAULT: ClusterShape = ClusterShape {
        threads: 512,
        ctas_per_sm: 3,
    };

    /// Every shape the runtime may request (the NVRTC check compiles each; `pagoda bench
    /// sampling --cluster-shape` times them).
    pub const CANDIDATES: [ClusterShape; 6] = [
        ClusterShape::DEFAULT,
        ClusterShape::new(1024, 1),
        ClusterShape::new(384, 4),
        ClusterShape::new(512, 4),
        ClusterShape::new(256, 5),
        ClusterShape::new(256, 6),
    ];

    const fn new(threads: u32, ctas_per_sm: u32) -> ClusterShape {
        ClusterShape {
            threads,
            ctas_per_sm,
        }
    }

    /// Logits of a CTA's slice of a `vocab`-logit row kept in shared memory when `rows` rows
    /// run on `sms` SMs of `sm_shared_bytes` shared memory each and the kernel has
    /// `static_bytes` of static shared memory (the driver's count: about 2.2 KiB at 512
    /// threads): the whole slice when it fits the CTA's share of an SM (the SM holding as many
    /// of the launch's CTAs as it must, at most `ctas_per_sm`), else as many as fit (a
    /// multiple of 4).
    pub fn held(&self, vocab: usize, rows: usize, sms: SmBudget, static_bytes: usize) -> usize {
        let needed = (rows * CLUSTER_CTAS as usize).div_ceil(sms.count.max(1));
        let resident = needed.clamp(1, self.ctas_per_sm as usize);
        let share = (sms.shared_bytes / resident).saturating_sub(CTA_RESERVED_BYTES + static_bytes);
        (cluster_slice_bytes(vocab).min(share) / 16) * 4
    }
}

/// The SMs a cluster launch runs on: how many, and the shared memory of each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SmBudget {
    /// Streaming multiprocessors.
    pub count: usize,
    /// Shared memory of one SM, bytes.
    pub shared_bytes: usize,
}

impl Default for ClusterShape {
    fn default() -> Self {
        ClusterShape::DEFAULT
    }
}

impl FromStr for ClusterShape {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let usage = || {
            format!(
                "cluster shape `{text}`: expected THREADSxCTAS, one of {}",
                ClusterShape::CANDIDATES
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        let (threads, ctas) = text.split_once('x').ok_or_else(usage)?;
        let shape = ClusterShape {
            threads: threads.trim().parse().map_err(|_| usage())?,
            ctas_per_sm: ctas.trim().parse().map_err(|_| usage())?,
        };
        if ClusterShape::CANDIDATES.contains(&shape) {
            Ok(shape)
        } else {
            Err(usage())
        }
    }
}

impl std::fmt::Display for ClusterShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.threads, self.ctas_per_sm)
    }
}

/// The specialisation of `sampling_cluster` for `shape`.
pub fn specialize_cluster(shape: ClusterShape) -> KernelSpec {
    KernelSpec {
        params: vec![
            ("CLUSTER_THREADS", shape.threads as i64),
            ("CLUSTER_BLOCKS", shape.ctas_per_sm as i64),
        ],
        ..specialize_sampling(SamplingEntry::Cluster)
    }
}

/// The kernel's `ahead`: with more rows than clusters that can be resident at once, the rows
/// past them start only when a cluster leaves, so each resident row asks L2 for the row
/// `resident` rows on once its pass is done and the memory is idle. 0 (no prefetch) when the
/// whole batch is resident, the driver reported no occupancy, or the prefetch is off.
pub fn prefetch_ahead(rows: u32, resident: u32, prefetch: bool) -> u32 {
    if prefetch && resident > 0 && rows > resident {
        resident
    } else {
        0
    }
}

/// The buffers of one cluster launch.
pub(super) struct ClusterLaunch<'a, L, P, T> {
    pub logits: &'a L,
    pub params: &'a P,
    pub tokens_out: &'a mut T,
    pub workspace: &'a SamplingWorkspace,
}

/// Launches `sampling_cluster` over `rows` rows of `vocab` logits with `shape`.
pub(super) fn launch_cluster<L: DeviceRead<f32>, P: DeviceRead<u32>, T: DeviceWrite<u32>>(
    gpu: &Gpu,
    buffers: ClusterLaunch<'_, L, P, T>,
    vocab: usize,
    (rows, flags): (u32, u32),
    options: &SamplingOptions,
) -> Result<(), CudaError> {
    let (max_rounds, shape) = (options.max_rejection_rounds, options.cluster_shape);
    let prefetch = options.cluster_prefetch;
    let spec = specialize_cluster(shape);
    let sms = SmBudget {
        count: gpu.info().sm_count as usize,
        shared_bytes: gpu.info().shared_memory_per_sm as usize,
    };
    let held = shape.held(vocab, rows as usize, sms, gpu.static_shared_bytes(&spec)?);
    let dims = LaunchDims {
        shared_mem_bytes: (held * 4) as u32,
        prefer_shared: true,
        ..LaunchDims::new((CLUSTER_CTAS, rows), shape.threads)
    };
    let ahead = if prefetch {
        prefetch_ahead(rows, gpu.max_active_clusters(&spec, dims)?, true)
    } else {
        0
    };
    let ws = buffers.workspace;
    let args = [
        ptr(buffers.logits),
        ptr(buffers.params),
        KernelArg::U32(vocab as u32),
        KernelArg::U32(held as u32),
        KernelArg::U32(ahead),
        KernelArg::U32(flags),
        KernelArg::U32(max_rounds),
        ptr(&ws.state),
        ptr(&*buffers.tokens_out),
        ptr(&ws.row_stats),
        ptr(&ws.totals),
    ];
    // SAFETY: the arguments match sampling_cluster's signature in
    // kernels/sampling_cluster.cu; lengths were validated by `plan_sampling`; the grid's x is
    // one whole cluster (the kernel's __cluster_dims__); the kernel reads at most `held`
    // logits of shared memory per CTA.
    unsafe { gpu.launch(&spec, dims, &args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `count` SMs of compute capability 9.0.
    fn h200(count: usize) -> SmBudget {
        SmBudget {
            count,
            shared_bytes: SM_SHARED_BYTES,
        }
    }

    #[test]
    fn a_cta_holds_its_whole_slice_while_its_share_of_the_sm_allows() {
        assert_eq!(cluster_slice_bytes(128_256), 64_128);
        assert_eq!(cluster_slice_bytes(151_936), 75_968);
        // Three CTAs per SM at batch 64 on 132 SMs, 2144 bytes of static shared memory: 74656
        // bytes each, so V 128256 is held whole and V 151936 in part (18664 of 18992 logits);
        // at batch 16 one CTA per SM holds either whole. More static memory, less held.
        let default = ClusterShape::DEFAULT;
        assert_eq!(default.held(128_256, 64, h200(132), 2144), 16_032);
        assert_eq!(default.held(151_936, 64, h200(132), 2144), 18_664);
        assert_eq!(default.held(151_936, 64, h200(132), 6144), 17_664);
        assert_eq!(default.held(151_936, 16, h200(132), 2144), 18_992);
        assert_eq!(default.held(151_936, 33, h200(132), 2144), 18_992);
        assert_eq!(default.held(151_936, 34, h200(0), 2144), 18_664);
        let four = ClusterShape::new(384, 4);
        assert_eq!(four.held(128_256, 64, h200(132), 1760), 13_896);
        assert_eq!(four.held(1_000, 64, h200(132), 1760), 128);
        // An SM of 100 KiB (compute capability 12.x) holds less: a third of it each at
        // batch 64.
        let small = SmBudget {
            count: 84,
            shared_bytes: 100 * 1024,
        };
        assert_eq!(default.held(128_256, 64, small, 2144), 7_740);
        // The launch's CTAs and their reserves fit the SMs that hold them.
        for sms in [h200(132), small] {
            for shape in ClusterShape::CANDIDATES {
                for static_bytes in [0, 2144, 8192] {
                    let held = shape.held(409_600, 1 << 16, sms, static_bytes);
                    let per_cta = held * 4 + CTA_RESERVED_BYTES + static_bytes;
                    assert!(
                        shape.ctas_per_sm as usize * per_cta <= sms.shared_bytes,
                        "{shape}, {static_bytes} static bytes, {sms:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn only_rows_past_the_resident_clusters_are_prefetched() {
        // The H200 holds 45 clusters of the default shape at batch 64.
        assert_eq!(prefetch_ahead(64, 45, true), 45);
        assert_eq!(prefetch_ahead(46, 45, true), 45);
        assert_eq!(prefetch_ahead(45, 45, true), 0);
        assert_eq!(prefetch_ahead(1, 45, true), 0);
        assert_eq!(prefetch_ahead(64, 0, true), 0);
        assert_eq!(prefetch_ahead(64, 45, false), 0);
    }

    #[test]
    fn cluster_shapes_parse_from_threads_x_ctas() {
        for shape in ClusterShape::CANDIDATES {
            assert_eq!(shape.to_string().parse::<ClusterShape>(), Ok(shape));
        }
        assert_eq!("384x4".parse::<ClusterShape>().map(|s| s.threads), Ok(384));
        for bad in ["", "512", "512x", "x3", "100x3", "512x9", "abcx3"] {
            let error = bad.parse::<ClusterShape>().unwrap_err();
            assert!(error.contains("512x3"), "{error}");
        }
    }
}
