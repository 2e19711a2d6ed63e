//! The fused paged decode's geometry limits and the streaming kernel's tile shapes
//! (`paged_decode_stream.cu`): the autotuner's candidates, their shared memory and occupancy.

/// Head sizes the fused decode is instantiated for (`head_dim / 8` a power of two <= 32).
pub const PAGED_DECODE_HEAD_DIMS: [usize; 4] = [32, 64, 128, 256];

/// Largest GQA group (query heads per KV head) one CTA serves.
pub const MAX_DECODE_GROUP: usize = 8;

/// Head sizes of the tensor-core kernels (WMMA and streaming).
pub const PAGED_DECODE_MMA_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// The tile shape of the streaming kernel: keys per warp per tile (16 or 32; a tile is four
/// warps' keys) and the cp.async ring's depth (2..=6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamTiling {
    /// Keys each of the four warps takes from a tile.
    pub keys_per_warp: usize,
    /// Tiles in the cp.async ring.
    pub stages: usize,
}

impl StreamTiling {
    /// The tilings the kernel is instantiated for (the autotuner's candidates), the default
    /// first: 64-key tiles in three stages (two CTAs per SM at head_dim 128) was the fastest
    /// or within a few percent of it in every cell of `pagoda bench attention` on the H200.
    pub const ALL: [StreamTiling; 5] = [
        StreamTiling::new(16, 3),
        StreamTiling::new(16, 2),
        StreamTiling::new(16, 4),
        StreamTiling::new(16, 6),
        StreamTiling::new(32, 3),
    ];

    /// A tiling of `keys_per_warp` keys per warp and `stages` stages.
    pub const fn new(keys_per_warp: usize, stages: usize) -> Self {
        StreamTiling {
            keys_per_warp,
            stages,
        }
    }

    /// Keys per tile.
    pub fn tile_keys(&self) -> usize {
        4 * self.keys_per_warp
    }

    /// Dynamic shared memory at `head_dim` and `group`, as `SMEM_BYTES` in
    /// `paged_decode_stream.cu` computes it.
    pub fn shared_bytes(&self, head_dim: usize, group: usize) -> usize {
        let main = 2 * self.stages * self.tile_keys() * head_dim * 2;
        let epilogue = 4 * group * (head_dim + 4) * 4 + 2 * 4 * group * 4;
        let weights = group * (256 + 3) * 4;
        main.max(epilogue).max(weights)
    }

    /// Dynamic shared memory of the fp8-cache build (`PAGODA_KV_FP8`): the ring holds bytes,
    /// and one bf16 K and V tile the warps widen each tile into.
    pub fn shared_bytes_fp8(&self, head_dim: usize, group: usize) -> usize {
        let keys = self.tile_keys();
        let main = 2 * self.stages * keys * head_dim + 2 * keys * head_dim * 2;
        let epilogue = 4 * group * (head_dim + 4) * 4 + 2 * 4 * group * 4;
        let weights = group * (256 + 3) * 4;
        main.max(epilogue).max(weights)
    }

    /// CTAs an SM of `smem_per_sm` bytes of shared memory holds at `head_dim` and `group`
    /// (1 to 4; the kernel's register budget is fitted to the same count, see `MIN_BLOCKS` in
    /// `paged_decode_stream.cu`; 2 KB a CTA for the reserved and static shared memory).
    pub fn ctas_per_sm(&self, head_dim: usize, group: usize, smem_per_sm: usize) -> usize {
        (smem_per_sm / (self.shared_bytes(head_dim, group) + 2048)).clamp(1, 4)
    }

    /// Whether the kernel exists for this tiling at `head_dim` (its shared memory fits the
    /// 227 KB a CTA may have).
    pub fn fits(&self, head_dim: usize) -> bool {
        Self::ALL.contains(self)
            && PAGED_DECODE_MMA_HEAD_DIMS.contains(&head_dim)
            && self.shared_bytes(head_dim, MAX_DECODE_GROUP) <= 227 * 1024
    }
}

impl std::fmt::Display for StreamTiling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stream-{}x{}", self.tile_keys(), self.stages)
    }
}
