//! The sampling kernels' source, their entry points and the specialisations the launchers
//! can request.

use pagoda_cuda::{DType, KernelSource, KernelSpec};

use super::cluster::{specialize_cluster, ClusterShape};

/// The CUDA source of the sampling kernels (one module: the entries share device helpers).
pub(crate) static SAMPLING: KernelSource = KernelSource::new(
    "sampling.cu",
    concat!(
        include_str!("sampling_common.cu"),
        include_str!("sampling_walk.cu"),
        include_str!("sampling_gumbel.cu"),
        include_str!("sampling_fast.cu"),
        include_str!("sampling_list.cu"),
        include_str!("sampling_cluster_steps.cu"),
        include_str!("sampling_cluster.cu"),
        include_str!("sampling_rejection.cu"),
        include_str!("sampling_mask.cu")
    ),
);

/// The entry points of the sampling kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SamplingEntry {
    /// `sampling_row_max`: per-split row maxima and the rows' filter state.
    RowMax,
    /// `sampling_top_k_digit`: one radix digit of the top-k threshold.
    TopKDigit,
    /// `sampling_gumbel`: per-split Gumbel-max partials of unfiltered rows.
    Gumbel,
    /// `sampling_pass`: the filtered rows' masses and first candidate.
    Pass,
    /// `sampling_pass_listed`: `sampling_pass` that also fills the rows' id lists.
    PassListed,
    /// `sampling_list_rounds`: the rounds of rows with a short proposal, on its id list.
    ListRounds,
    /// `sampling_round`: one dual-pivot round of the fast filtered path.
    Round,
    /// `sampling_cluster`: row maxima, filter state and the whole fast filtered path of
    /// launches without top-k rows, a thread-block cluster per row (sm_90+; replaces
    /// `sampling_row_max`, the pass and the rounds).
    Cluster,
    /// `sampling_finish`: greedy / Gumbel tokens and the exact filtered kernel.
    Finish,
    /// `sampling_token_mask`: structured output's packed token masks applied to the logits
    /// (disallowed ids become NaN) before the other entries run.
    TokenMask,
}

impl SamplingEntry {
    /// Every entry, in launch order.
    pub const ALL: [SamplingEntry; 10] = [
        SamplingEntry::TokenMask,
        SamplingEntry::RowMax,
        SamplingEntry::Cluster,
        SamplingEntry::TopKDigit,
        SamplingEntry::Gumbel,
        SamplingEntry::Pass,
        SamplingEntry::PassListed,
        SamplingEntry::ListRounds,
        SamplingEntry::Round,
        SamplingEntry::Finish,
    ];
}

/// The specialisation of `entry` (f32 logits, u32 ids and parameter words).
pub fn specialize_sampling(entry: SamplingEntry) -> KernelSpec {
    let name = match entry {
        SamplingEntry::RowMax => "sampling_row_max",
        SamplingEntry::TopKDigit => "sampling_top_k_digit",
        SamplingEntry::Gumbel => "sampling_gumbel",
        SamplingEntry::Pass => "sampling_pass",
        SamplingEntry::PassListed => "sampling_pass_listed",
        SamplingEntry::ListRounds => "sampling_list_rounds",
        SamplingEntry::Round => "sampling_round",
        SamplingEntry::Cluster => "sampling_cluster",
        SamplingEntry::Finish => "sampling_finish",
        SamplingEntry::TokenMask => "sampling_token_mask",
    };
    KernelSpec {
        source: &SAMPLING,
        entry: name,
        params: vec![],
        dtypes: vec![("LOGITS_T", DType::F32), ("IDS_T", DType::U32)],
    }
}

/// Every specialisation the sampling launchers can request (the cluster kernel in its
/// candidate shapes only).
pub fn specializations() -> Vec<KernelSpec> {
    let entries = SamplingEntry::ALL.into_iter();
    let plain = entries.filter(|&entry| entry != SamplingEntry::Cluster);
    let plain = plain.map(specialize_sampling);
    plain
        .chain(ClusterShape::CANDIDATES.into_iter().map(specialize_cluster))
        .collect()
}
