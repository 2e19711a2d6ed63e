//! The CPU's mixture-of-experts MLP block: its weights (the router and one [`Weight`] per
//! expert, cut from GGUF's stacked `[num_experts, out, in]` tensors in their stored format, so
//! quantized experts run on the quantized kernels) and the expert mix of one step.
//!
//! Reproducibility: the rows of one expert go through its matmuls together, and each row's
//! output is `Σ weight · expert(row)` summed in ascending expert index, into a zeroed buffer
//! then added to the residual. The matmuls keep rows independent (see `pagoda_ops::linear`)
//! and the router decides a row from its own logits, so a row's bits do not depend on which
//! other rows share the step.

use pagoda_ops::activation::silu_mul_in_place;
use pagoda_ops::linear::{matmul_shared, Weight};
use pagoda_ops::moe::{self, ExpertRouting, GroupLimit, GroupScore, Renormalize, Router, Scoring};

use super::{fetch, load_matrix, load_vector, weight_from_bytes, WeightPrecision};
use crate::config::{ExpertScoring, GroupScoring, ModelConfig, MoeConfig, TopKWeights};
use crate::weight_plan::{ExpertsPlan, TensorSpec};
use crate::weights::{names, LoadError, TensorSource};

/// A layer's MLP weights.
// One per layer, built once and never moved on a hot path: boxing the dense variant to even
// out the sizes would only add an indirection.
#[allow(clippy::large_enum_variant)]
pub(super) enum Mlp {
    /// One SiLU-gated MLP.
    Dense {
        gate: Weight,
        up: Weight,
        down: Weight,
    },
    /// A router and its experts.
    Experts(Experts),
}

impl Mlp {
    /// Every matrix of the block.
    pub(super) fn weights(&self) -> Vec<&Weight> {
        match self {
            Mlp::Dense { gate, up, down } => vec![gate, up, down],
            Mlp::Experts(e) => std::iter::once(&e.router)
                .chain(&e.gate)
                .chain(&e.up)
                .chain(&e.down)
                .chain(e.shared.iter().flatten())
                .collect(),
        }
    }

    /// The expected bytes of the experts a step of `rows` rows leaves idle, under uniform
    /// routing (0 for a dense block).
    pub(super) fn idle_expert_bytes(&self, rows: usize) -> f64 {
        let Mlp::Experts(e) = self else {
            return 0.0;
        };
        let experts = e.num_experts() as f64;
        let expert_bytes: usize = [&e.gate, &e.up, &e.down]
            .iter()
            .flat_map(|weights| weights.iter())
            .map(Weight::size_bytes)
            .sum();
        let idle_share = (1.0 - e.top_k as f64 / experts).powi(rows as i32);
        expert_bytes as f64 * idle_share
    }
}

impl MoeConfig {
    /// The router of these blocks, without its selection bias (a per-layer weight): what the
    /// CPU's blocks and CUDA's device router route with.
    pub fn router(&self) -> Router<'static> {
        Router {
            num_experts: self.num_experts,
            top_k: self.experts_per_token,
            scoring: match self.scoring {
                ExpertScoring::Softmax => Scoring::Softmax,
                ExpertScoring::Sigmoid => Scoring::Sigmoid,
            },
            renormalize: match self.top_k_weights {
                TopKWeights::Softmax => Renormalize::No,
                TopKWeights::Normalized => Renormalize::Yes,
            },
            group_limit: self.group_limit.map(|limit| GroupLimit {
                num_groups: limit.num_groups,
                groups_per_row: limit.groups_per_token,
                score: match limit.score {
                    GroupScoring::Max => GroupScore::Max,
                    GroupScoring::TopTwoSum => GroupScore::TopTwoSum,
                },
            }),
            selection_bias: None,
            scale: self.routed_scaling_factor,
        }
    }
}

/// A mixture-of-experts block's weights.
pub(super) struct Experts {
    /// `[num_experts, hidden]`.
    router: Weight,
    /// Per expert `[expert_intermediate, hidden]`.
    gate: Vec<Weight>,
    /// Per expert `[expert_intermediate, hidden]`.
    up: Vec<Weight>,
    /// Per expert `[hidden, expert_intermediate]`.
    down: Vec<Weight>,
    top_k: usize,
    renormalize: Renormalize,
    scoring: Scoring,
    group_limit: Option<GroupLimit>,
    /// `[num_experts]`: DeepSeek-V3's selection bias.
    selection_bias: Option<Vec<f32>>,
    routed_scaling_factor: f32,
    /// The shared experts' gate, up (`[shared_width, hidden]`) and down (`[hidden,
    /// shared_width]`).
    shared: Option<[Weight; 3]>,
}

impl Experts {
    /// Loads the block `plan` lists; the experts keep their stored format (GGUF's stacked
    /// tensors are cut expert by expert) and the kernel policy of the dense role they play.
    pub(super) fn load(
        source: &dyn TensorSource,
        plan: &ExpertsPlan,
        layer: usize,
        config: &ModelConfig,
        precision: WeightPrecision,
    ) -> Result<Experts, LoadError> {
        let moe = config.moe.as_ref().ok_or_else(|| {
            LoadError(format!(
                "layer {layer} has experts but the configuration has no mixture-of-experts settings"
            ))
        })?;
        let stacked = |spec: &TensorSpec, role: &str| {
            load_stacked(source, spec, &names::layer(layer, role), precision)
        };
        let router = &plan.router;
        let matrix = |spec: &TensorSpec| {
            load_matrix(source, &spec.name, spec.rows(), spec.cols(), precision)
        };
        let shared = match &plan.shared {
            Some([gate, up, down]) => Some([matrix(gate)?, matrix(up)?, matrix(down)?]),
            None => None,
        };
        let selection_bias = match &plan.selection_bias {
            Some(spec) => Some(load_vector(source, &spec.name, spec.len())?),
            None => None,
        };
        let settings = moe.router();
        Ok(Experts {
            scoring: settings.scoring,
            group_limit: settings.group_limit,
            selection_bias,
            routed_scaling_factor: moe.routed_scaling_factor,
            shared,
            router: load_matrix(
                source,
                &router.name,
                router.rows(),
                router.cols(),
                precision,
            )?,
            gate: stacked(&plan.gate, names::FFN_GATE)?,
            up: stacked(&plan.up, names::FFN_UP)?,
            down: stacked(&plan.down, names::FFN_DOWN)?,
            top_k: settings.top_k,
            renormalize: settings.renormalize,
        })
    }

    /// Number of experts.
    pub(super) fn num_experts(&self) -> usize {
        self.gate.len()
    }

    /// `logits <- normed · Wrouter^T` (`[num_tokens, num_experts]`), then each row's experts.
    pub(super) fn route(
        &self,
        normed: &[f32],
        num_tokens: usize,
        logits: &mut Vec<f32>,
    ) -> ExpertRouting {
        logits.resize(num_tokens * self.num_experts(), 0.0);
        self.router.matmul(normed, num_tokens, logits);
        let router = Router {
            num_experts: self.num_experts(),
            top_k: self.top_k,
            scoring: self.scoring,
            renormalize: self.renormalize,
            group_limit: self.group_limit,
            selection_bias: self.selection_bias.as_deref(),
            scale: self.routed_scaling_factor,
        };
        moe::route_with(logits, &router)
    }

    /// `mix <- Σ weight · down(silu(gate(normed)) * up(normed))` over each row's experts of
    /// `routing`, experts in ascending index, then `+ shared(normed)` where the block has
    /// shared experts; `normed` and `mix` are `[num_tokens, hidden]`.
    pub(super) fn mix(
        &self,
        normed: &[f32],
        routing: &ExpertRouting,
        scratch: &mut ExpertScratch,
        mix: &mut [f32],
    ) {
        let hidden = self.router.in_features();
        mix.fill(0.0);
        for expert in 0..self.num_experts() {
            let (rows, weights) = routing.rows_of(expert);
            if rows.is_empty() {
                continue;
            }
            let (count, width) = (rows.len(), self.gate[expert].out_features());
            let s = scratch.fit(count, hidden, width);
            for (input, &row) in s.input.chunks_exact_mut(hidden).zip(rows) {
                let row = row as usize;
                input.copy_from_slice(&normed[row * hidden..(row + 1) * hidden]);
            }
            matmul_shared(
                s.input,
                count,
                &mut [
                    (&self.gate[expert], &mut *s.gate),
                    (&self.up[expert], &mut *s.up),
                ],
            );
            silu_mul_in_place(s.gate, s.up);
            self.down[expert].matmul(s.gate, count, s.output);
            for ((output, &row), &weight) in s.output.chunks_exact(hidden).zip(rows).zip(weights) {
                let row = row as usize;
                for (m, o) in mix[row * hidden..(row + 1) * hidden].iter_mut().zip(output) {
                    *m += weight * o;
                }
            }
        }
        // The shared experts: every row, after the routed ones.
        if let Some([gate, up, down]) = &self.shared {
            let num_tokens = normed.len() / hidden;
            let s = scratch.fit(num_tokens, hidden, gate.out_features());
            matmul_shared(
                normed,
                num_tokens,
                &mut [(gate, &mut *s.gate), (up, &mut *s.up)],
            );
            silu_mul_in_place(s.gate, s.up);
            down.matmul(s.gate, num_tokens, s.output);
            mix.iter_mut().zip(&*s.output).for_each(|(m, o)| *m += o);
        }
    }
}

/// The expert mix's buffers, reused by every expert of every layer of a step.
#[derive(Default)]
pub(super) struct ExpertScratch {
    input: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    output: Vec<f32>,
}

/// [`ExpertScratch`]'s buffers cut to one expert's rows.
struct ExpertBuffers<'a> {
    /// `[rows, hidden]`: the rows' normalised inputs.
    input: &'a mut [f32],
    /// `[rows, width]`.
    gate: &'a mut [f32],
    /// `[rows, width]`.
    up: &'a mut [f32],
    /// `[rows, hidden]`: the expert's outputs.
    output: &'a mut [f32],
}

impl ExpertScratch {
    fn fit(&mut self, rows: usize, hidden: usize, width: usize) -> ExpertBuffers<'_> {
        let grow = |buffer: &mut Vec<f32>, len: usize| {
            if buffer.len() < len {
                buffer.resize(len, 0.0);
            }
        };
        grow(&mut self.input, rows * hidden);
        grow(&mut self.gate, rows * width);
        grow(&mut self.up, rows * width);
        grow(&mut self.output, rows * hidden);
        ExpertBuffers {
            input: &mut self.input[..rows * hidden],
            gate: &mut self.gate[..rows * width],
            up: &mut self.up[..rows * width],
            output: &mut self.output[..rows * hidden],
        }
    }
}

/// A stacked `[num_experts, rows, cols]` tensor as one [`Weight`] per expert (or per head:
/// DeepSeek's `attn_k_b` / `attn_v_b`), in its stored format, each with the kernel policy of
/// the tensor named `role` (the dense projection the expert stands in for).
pub(super) fn load_stacked(
    source: &dyn TensorSource,
    spec: &TensorSpec,
    role: &str,
    precision: WeightPrecision,
) -> Result<Vec<Weight>, LoadError> {
    let raw = fetch(source, &spec.name)?;
    if raw.shape != spec.shape {
        return Err(LoadError(format!(
            "tensor {} has shape {:?}, expected {:?}",
            spec.name, raw.shape, spec.shape
        )));
    }
    let &[num_experts, rows, cols] = spec.shape.as_slice() else {
        return Err(LoadError(format!("tensor {} is not 3-D", spec.name)));
    };
    let row_bytes = raw.ty.bytes_for(cols).ok_or_else(|| {
        LoadError(format!(
            "tensor {}: rows of {cols} values are not whole {} blocks",
            spec.name, raw.ty
        ))
    })?;
    let expert_bytes = rows * row_bytes;
    if raw.data.len() != num_experts * expert_bytes {
        return Err(LoadError(format!(
            "tensor {} holds {} bytes, expected {}",
            spec.name,
            raw.data.len(),
            num_experts * expert_bytes
        )));
    }
    raw.data
        .chunks_exact(expert_bytes)
        .enumerate()
        .map(|(expert, bytes)| {
            weight_from_bytes(role, raw.ty, [rows, cols], bytes.to_vec(), precision)
                .map_err(|e| LoadError(format!("{} expert {expert}: {e}", spec.name)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use pagoda_tensor::GgmlType;

    use super::*;
    use crate::weights::RawTensor;

    /// One stacked tensor under `name`.
    struct Stacked(&'static str, GgmlType, Vec<usize>, Vec<u8>);

    impl TensorSource for Stacked {
        fn tensor(&self, name: &str) -> Option<RawTensor<'_>> {
            (name == self.0).then(|| RawTensor {
                ty: self.1,
                shape: self.2.clone(),
                data: Cow::Borrowed(&self.3),
            })
        }
        fn tensor_names(&self) -> Vec<String> {
            vec![self.0.into()]
        }
    }

    /// Q8_0 blocks (f16 scale, 32 int8) whose value `i` of expert `e` is known.
    fn q8_0_experts(experts: usize, rows: usize, cols: usize) -> (Vec<u8>, Vec<Vec<f32>>) {
        let (mut bytes, mut values) = (Vec::new(), vec![Vec::new(); experts]);
        for (e, expert_values) in values.iter_mut().enumerate() {
            let scale = half::f16::from_f32(0.01 * (e + 1) as f32);
            for block in 0..rows * cols / 32 {
                bytes.extend_from_slice(&scale.to_le_bytes());
                for i in 0..32 {
                    let q = ((block * 32 + i + 7 * e) % 255) as i32 - 127;
                    bytes.push(q as i8 as u8);
                    expert_values.push(scale.to_f32() * q as f32);
                }
            }
        }
        (bytes, values)
    }

    #[test]
    fn stacked_quantized_experts_are_cut_expert_by_expert_in_their_format() {
        let (experts, rows, cols) = (3, 4, 64);
        let (bytes, values) = q8_0_experts(experts, rows, cols);
        let name = "blk.0.ffn_up_exps.weight";
        let source = Stacked(name, GgmlType::Q8_0, vec![experts, rows, cols], bytes);
        let spec = TensorSpec {
            name: name.into(),
            shape: vec![experts, rows, cols],
        };
        let role = names::layer(0, names::FFN_UP);
        let weights = load_stacked(&source, &spec, &role, WeightPrecision::AsStored).unwrap();
        assert_eq!(weights.len(), experts);
        for (weight, expected) in weights.iter().zip(&values) {
            assert_eq!(weight.ty(), GgmlType::Q8_0);
            assert_eq!((weight.out_features(), weight.in_features()), (rows, cols));
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                weight.dequantize_row(r, &mut row);
                assert_eq!(row, expected[r * cols..(r + 1) * cols]);
            }
        }
        // A shape that contradicts the plan is refused, naming the tensor.
        let wrong = TensorSpec {
            name: name.into(),
            shape: vec![experts + 1, rows, cols],
        };
        let error = load_stacked(&source, &wrong, &role, WeightPrecision::AsStored).unwrap_err();
        assert!(error.0.contains(name), "{error}");
    }
}
