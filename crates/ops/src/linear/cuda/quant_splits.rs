//! The split-k bookkeeping of the tensor-core quantized kernel (`gemm_quant_mma`): how many
//! splits of its groups a matrix of few row tiles takes, and the scratch of their sums and
//! tickets that a [`super::Q8Rows`] built for it ([`super::Q8Rows::with_splits`]) carries.

use pagoda_cuda::{CudaError, DeviceBuffer, DeviceRead, Gpu};

/// Activation rows one `gemm_quant_mma` launch takes; more rows run in launches of this many.
pub const QUANT_MMA_MAX_ROWS: usize = 64;

/// Weight rows a CTA of `gemm_quant_mma` owns (`ROWS`: 16 a warp).
pub(super) const CTA_ROWS: usize = 64;
/// Groups a split takes at least (four of the CTA's iterations of `STEP` groups).
const SPLIT_MIN_GROUPS: usize = 16;
/// CTAs per SM a launch aims for: a matrix of fewer row tiles splits its groups.
const CTAS_PER_SM: usize = 6;

/// The split-k scratch of [`super::gemm_quant_mma`]: the splits' sums and a ticket per row tile
/// (zero between launches: the last CTA of a tile resets it).
pub(crate) struct SplitScratch {
    partials: DeviceBuffer<f32>,
    tickets: DeviceBuffer<u32>,
    target_ctas: usize,
}

impl SplitScratch {
    pub(crate) fn new(gpu: &Gpu) -> Result<SplitScratch, CudaError> {
        let target_ctas = CTAS_PER_SM * (gpu.info().sm_count as usize).max(1);
        Ok(SplitScratch {
            // A part splits only with fewer tiles than the target, into at most
            // ceil(target / tiles) splits; a pair's larger count times its tiles fits twice
            // the target in most of the models' shapes (else `plan` does not split): about
            // 26 MB on a 132-SM GPU.
            partials: gpu.zeros::<f32>(2 * target_ctas * CTA_ROWS * QUANT_MMA_MAX_ROWS)?,
            tickets: gpu.zeros::<u32>(2 * target_ctas)?,
            target_ctas,
        })
    }

    pub(super) fn partials(&self) -> &DeviceBuffer<f32> {
        &self.partials
    }

    pub(super) fn tickets(&self) -> &DeviceBuffer<u32> {
        &self.tickets
    }

    /// The splits of each part (`tiles` row tiles each) for a launch of `m_tile` rows: one
    /// each where the sums of the grid's larger count would not fit.
    pub(super) fn plan(&self, tiles: &[usize], groups: usize, m_tile: usize) -> Vec<usize> {
        let splits: Vec<usize> = tiles
            .iter()
            .map(|&t| split_count(self.target_ctas, t, groups))
            .collect();
        let most = splits.iter().copied().max().unwrap_or(1);
        let sums = most * tiles.iter().sum::<usize>() * CTA_ROWS * m_tile;
        let fits = sums <= self.partials.len() && tiles.iter().sum::<usize>() <= self.tickets.len();
        match most == 1 || fits {
            true => splits,
            false => vec![1; tiles.len()],
        }
    }
}

/// Splits of the groups of a part of `tiles` row tiles of `groups` groups for a grid of about
/// `target_ctas` CTAs: none when the tiles fill it, else enough to, each split at least
/// [`SPLIT_MIN_GROUPS`] groups.
fn split_count(target_ctas: usize, tiles: usize, groups: usize) -> usize {
    if tiles >= target_ctas {
        return 1;
    }
    target_ctas
        .div_ceil(tiles)
        .min(groups / SPLIT_MIN_GROUPS)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_row_tiles_split_their_groups_to_fill_the_gpu() {
        // Six CTAs an SM of the H100's 132; Llama-3.1-8B's shapes (k 4096: 128 groups).
        let target = 6 * 132;
        assert_eq!(split_count(target, 4096 / 64, 128), 8); // o: at least 16 groups a split
        assert_eq!(split_count(target, 28672 / 64, 128), 2); // gate/up: 896 CTAs
        assert_eq!(split_count(target, 1024 / 64, 128), 8);
        assert_eq!(split_count(target, 4096 / 64, 448), 13); // down, k 14336: 832 CTAs
        assert_eq!(split_count(target, 1, 296), 18);
        assert_eq!(split_count(target, 3, 8), 1); // fewer groups than a split takes
    }
}
