//! Tensor parallelism's partition of a model: which rank holds which slice of each tensor.
//!
//! Megatron's split, declared per canonical tensor name ([`split_of`]):
//!
//! | tensor | split | after it |
//! | --- | --- | --- |
//! | q, k, v (and their biases), MLA's q / q_b / kv_b / k_b / v_b | by head (output rows) | |
//! | gate, up; shared experts' gate, up; experts' gate, up | column-parallel (output rows) | |
//! | attention output, down; shared and routed experts' down | row-parallel (input columns) | all-reduce |
//! | LM head (or the tied embedding) | vocabulary-parallel (rows, chunks of `ceil(V / world)`) | argmax all-reduce |
//! | embedding, norms, router, selection bias, MLA's kv_a / q_a, V3.2's indexer | replicated | |
//!
//! Each rank then runs the unchanged layer sequence on a *rank config*
//! ([`ShardSpec::rank_config`]): its share of the heads, KV heads and MLP widths. Each rank's
//! paged KV holds only its KV heads; a latent cache (MLA) is on every rank whole.
//! [`ShardedSource`] serves each rank's slices under the canonical names, so loading a shard
//! is loading a smaller model.
//!
//! Quantized tensors are cut on block boundaries: a column split must cut every row at a
//! multiple of the block size, else the load fails and says so (rows always split whole).
//! KV heads are not replicated: a world larger than the KV heads is refused.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Mutex;

use crate::config::ModelConfig;
use crate::weights::{names, LoadError, RawTensor, TensorSource};

/// One rank of a tensor-parallel group of `world` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSpec {
    pub rank: usize,
    pub world: usize,
}

/// How a tensor is cut across the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds it whole.
    Replicated,
    /// Rank `r` holds the `r`-th of `world` equal parts of axis `0` (outermost) ... of the
    /// tensor's shape.
    Axis(usize),
}

/// The split of the tensor of canonical name `name` (see the module's table). The LM head is
/// [`Split::Replicated`] here: the model cuts its vocabulary rows itself (uneven chunks).
pub fn split_of(name: &str) -> Split {
    let Some(suffix) = layer_suffix(name) else {
        return Split::Replicated;
    };
    match suffix {
        names::ATTN_Q
        | names::ATTN_K
        | names::ATTN_V
        | names::ATTN_Q_BIAS
        | names::ATTN_K_BIAS
        | names::ATTN_V_BIAS
        | names::ATTN_Q_B
        | names::ATTN_KV_B
        | names::ATTN_K_B
        | names::ATTN_V_B
        | names::FFN_GATE
        | names::FFN_UP
        | names::FFN_GATE_SHEXP
        | names::FFN_UP_SHEXP => Split::Axis(0),
        // `[num_experts, expert_intermediate, hidden]`: each expert's rows.
        names::FFN_GATE_EXPS | names::FFN_UP_EXPS => Split::Axis(1),
        names::ATTN_OUTPUT | names::FFN_DOWN | names::FFN_DOWN_SHEXP => Split::Axis(1),
        // `[num_experts, hidden, expert_intermediate]`: each expert's columns.
        names::FFN_DOWN_EXPS => Split::Axis(2),
        _ => Split::Replicated,
    }
}

/// `suffix` of `blk.{layer}.{suffix}`.
fn layer_suffix(name: &str) -> Option<&str> {
    let rest = name.strip_prefix("blk.")?;
    let dot = rest.find('.')?;
    rest[..dot]
        .bytes()
        .all(|b| b.is_ascii_digit())
        .then(|| &rest[dot + 1..])
}

impl ShardSpec {
    /// The single rank of an unsplit model.
    pub const WHOLE: ShardSpec = ShardSpec { rank: 0, world: 1 };

    /// The configuration rank `rank` runs: its share of the attention heads, KV heads, MLP
    /// and expert widths, or why `config` does not split over `world` ranks.
    pub fn rank_config(&self, config: &ModelConfig) -> Result<ModelConfig, LoadError> {
        let world = self.world;
        if world == 0 || self.rank >= world {
            return Err(LoadError(format!(
                "rank {} of a tensor-parallel group of {world}",
                self.rank
            )));
        }
        let split = |what: &str, value: usize| {
            if value.is_multiple_of(world) {
                Ok(value / world)
            } else {
                Err(LoadError(format!(
                    "tensor parallelism over {world} ranks needs {what} ({value}) divisible by {world}"
                )))
            }
        };
        let mut rank = config.clone();
        rank.num_attention_heads = split("the attention heads", config.num_attention_heads)?;
        if config.mla.is_none() {
            if world > config.num_kv_heads {
                return Err(LoadError(format!(
                    "tensor parallelism over {world} ranks needs at least {world} KV heads (the model has {}); replicating KV heads is not supported",
                    config.num_kv_heads
                )));
            }
            rank.num_kv_heads = split("the KV heads", config.num_kv_heads)?;
        }
        let any_dense = (0..config.num_layers).any(|layer| !config.is_moe_layer(layer));
        if any_dense {
            rank.intermediate_size = split("the MLP width", config.intermediate_size)?;
        }
        if let (Some(moe), Some(rank_moe)) = (&config.moe, rank.moe.as_mut()) {
            rank_moe.expert_intermediate_size =
                split("the expert width", moe.expert_intermediate_size)?;
        }
        Ok(rank)
    }

    /// The LM head rows (vocabulary ids) this rank holds.
    pub fn vocab_range(&self, vocab_size: usize) -> Range<usize> {
        pagoda_ops::collective::chunk_range(vocab_size, self.rank, self.world)
    }
}

/// A [`TensorSource`] serving one rank's slices of another source's tensors, under the same
/// names ([`split_of`]). A slice that cannot be cut (a quantized block split, a shape that
/// does not divide) is reported as missing and its reason kept in [`ShardedSource::error`].
pub struct ShardedSource<'a> {
    inner: &'a dyn TensorSource,
    spec: ShardSpec,
    error: Mutex<Option<String>>,
}

impl<'a> ShardedSource<'a> {
    /// Rank `spec.rank`'s view of `inner`.
    pub fn new(inner: &'a dyn TensorSource, spec: ShardSpec) -> Self {
        ShardedSource {
            inner,
            spec,
            error: Mutex::new(None),
        }
    }

    /// Why the first slice that failed could not be cut, if one failed.
    pub fn error(&self) -> Option<String> {
        self.error.lock().ok().and_then(|error| error.clone())
    }
}

impl TensorSource for ShardedSource<'_> {
    fn tensor(&self, name: &str) -> Option<RawTensor<'_>> {
        let raw = self.inner.tensor(name)?;
        let Split::Axis(axis) = split_of(name) else {
            return Some(raw);
        };
        let (rank, world) = (self.spec.rank, self.spec.world);
        let sliced = match raw.shape.get(axis) {
            Some(&len) if len.is_multiple_of(world) => {
                let part = len / world;
                slice_axis(&raw, axis, rank * part..(rank + 1) * part)
            }
            _ => Err(format!(
                "shape {:?} does not split over {world} ranks along axis {axis}",
                raw.shape
            )),
        };
        match sliced {
            Ok(tensor) => Some(tensor),
            Err(why) => {
                if let Ok(mut error) = self.error.lock() {
                    error.get_or_insert(format!("tensor {name}: {why}"));
                }
                None
            }
        }
    }

    fn tensor_names(&self) -> Vec<String> {
        self.inner.tensor_names()
    }
}

/// The elements `range` of axis `axis` of `raw` (every index of the other axes), in the
/// stored format: whole quantized blocks only.
pub fn slice_axis(
    raw: &RawTensor<'_>,
    axis: usize,
    range: Range<usize>,
) -> Result<RawTensor<'static>, String> {
    let shape = &raw.shape;
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let ty = raw.ty;
    let bytes = |elements: usize| {
        ty.bytes_for(elements).ok_or_else(|| {
            format!(
                "cutting {elements} values would split a {ty} block of {} values; choose a tensor-parallel size that keeps the cut on block boundaries",
                ty.block_size().unwrap_or(1)
            )
        })
    };
    let skip = bytes(range.start * inner)?;
    let take = bytes(range.len() * inner)?;
    let stride = bytes(shape[axis] * inner)?;
    if raw.data.len() != outer * stride {
        return Err(format!(
            "holds {} bytes, expected {}",
            raw.data.len(),
            outer * stride
        ));
    }
    let mut data = Vec::with_capacity(outer * take);
    for block in raw.data.chunks_exact(stride) {
        data.extend_from_slice(&block[skip..skip + take]);
    }
    let mut sliced_shape = shape.clone();
    sliced_shape[axis] = range.len();
    Ok(RawTensor {
        ty,
        shape: sliced_shape,
        data: Cow::Owned(data),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagoda_tensor::GgmlType;

    #[test]
    fn names_split_as_the_table_says() {
        assert_eq!(split_of("blk.3.attn_q.weight"), Split::Axis(0));
        assert_eq!(split_of("blk.3.attn_output.weight"), Split::Axis(1));
        assert_eq!(split_of("blk.0.ffn_down_exps.weight"), Split::Axis(2));
        assert_eq!(split_of("blk.0.ffn_gate_exps.weight"), Split::Axis(1));
        assert_eq!(split_of("blk.1.indexer.attn_q_b.weight"), Split::Replicated);
        assert_eq!(split_of("blk.1.attn_norm.weight"), Split::Replicated);
        assert_eq!(split_of("token_embd.weight"), Split::Replicated);
        assert_eq!(split_of("output.weight"), Split::Replicated);
    }

    #[test]
    fn slices_f32_rows_and_columns() {
        let values: Vec<f32> = (0..24).map(|v| v as f32).collect();
        let raw = RawTensor {
            ty: GgmlType::F32,
            shape: vec![2, 3, 4],
            data: Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        };
        let read = |t: RawTensor<'_>| -> Vec<f32> {
            t.data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect()
        };
        let middle = slice_axis(&raw, 1, 1..2).unwrap();
        assert_eq!(middle.shape, [2, 1, 4]);
        assert_eq!(read(middle), [4.0, 5.0, 6.0, 7.0, 16.0, 17.0, 18.0, 19.0]);
        let last = slice_axis(&raw, 2, 2..4).unwrap();
        assert_eq!(read(last)[..4], [2.0, 3.0, 6.0, 7.0]);
    }

    #[test]
    fn refuses_to_cut_a_quantized_block() {
        // Two rows of 64 q8_0 values (two blocks of 32 per row).
        let row_bytes = GgmlType::Q8_0.bytes_for(64).unwrap();
        let raw = RawTensor {
            ty: GgmlType::Q8_0,
            shape: vec![2, 64],
            data: Cow::Owned(vec![0; 2 * row_bytes]),
        };
        assert!(slice_axis(&raw, 1, 32..64).is_ok());
        assert!(slice_axis(&raw, 0, 1..2).is_ok());
        let error = slice_axis(&raw, 1, 16..32).unwrap_err();
        assert!(error.contains("block"), "{error}");
    }
}
