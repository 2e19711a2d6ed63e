//! Mixture-of-experts MLP blocks on the GPU (Qwen3-MoE, Mixtral, DeepSeek; ADR 0010): a layer's
//! router, its experts' weights stacked per projection as GGUF stores them (`[num_experts,
//! out, in]` in the model's dtype, one buffer each, the experts addressed by offset inside
//! the kernels; or, with `PAGODA_CUDA_MOE_QUANT`, in the file's blocks, [`ExpertWeights`])
//! and the shared experts' dense MLP; the step buffers a MoE model adds
//! ([`MoeBuffers`], allocated only when the configuration has experts); and the two steps
//! (`route`, `experts`) as functions over them, which `layers.rs` calls from its
//! [`MoeStep`](crate::decoder::MoeStep) implementation.

use pagoda_cuda::{view, view_mut, CudaError, DeviceBuffer, DeviceRead, DeviceViewMut, Gpu};
use pagoda_ops::cuda::{self as ops, DeviceRouter, MoeQ8, MoeWorkspace, QuantExperts};

use super::matrix::{Linear, Matrix};
use super::HostFloat;
use crate::config::{ModelConfig, MoeConfig};
use crate::llama::LoadError;
use crate::weight_plan::{ExpertsPlan, TensorSpec};

/// A MoE layer's weights on the device.
pub(super) struct GpuExperts<T> {
    /// `[num_experts, hidden]`; its logits come out in f32.
    pub router: Matrix<T>,
    /// `[num_experts]`: the sigmoid router's selection bias.
    pub selection_bias: Option<DeviceBuffer<f32>>,
    /// The stacked experts.
    pub weights: ExpertWeights<T>,
    /// The shared experts: gate and up stacked (`[2 * shared_width, hidden]`), then down
    /// (`[hidden, shared_width]`).
    pub shared: Option<[Matrix<T>; 2]>,
}

/// A layer's stacked experts: gate and up `[num_experts, expert_intermediate, hidden]`, down
/// `[num_experts, hidden, expert_intermediate]`.
pub(super) enum ExpertWeights<T> {
    /// In the model's dtype (dequantized or converted at load).
    Dense([DeviceBuffer<T>; 3]),
    /// In the file's GGUF blocks, each projection in its own format (`PAGODA_CUDA_MOE_QUANT`).
    Quantized([QuantExperts; 3]),
}

impl<T> GpuExperts<T> {
    /// The block's matrices the linear layers multiply (the router and the shared experts).
    pub fn matrices(&self) -> impl Iterator<Item = &Matrix<T>> {
        std::iter::once(&self.router).chain(self.shared.iter().flatten())
    }

    /// Bytes of the stacked experts.
    pub fn expert_bytes(&self) -> usize {
        match &self.weights {
            ExpertWeights::Dense(w) => w.iter().map(|b| b.len()).sum::<usize>() * size_of::<T>(),
            ExpertWeights::Quantized(w) => w.iter().map(QuantExperts::bytes).sum(),
        }
    }

    /// The formats of the stacked experts kept in blocks (gate, up, down), if they are.
    pub fn quantized_formats(&self) -> Option<[ops::QuantFormat; 3]> {
        match &self.weights {
            ExpertWeights::Dense(_) => None,
            ExpertWeights::Quantized(w) => Some([w[0].format, w[1].format, w[2].format]),
        }
    }

    /// Bytes of the selection bias.
    pub fn bias_bytes(&self) -> usize {
        self.selection_bias.as_ref().map_or(0, |b| 4 * b.len())
    }
}

/// The device router of `moe` (the CPU's router, group limits included), or why the GPU
/// declines it (more experts, groups or top-k than the device router takes).
pub(super) fn device_router(moe: &MoeConfig) -> Result<DeviceRouter, CudaError> {
    DeviceRouter::from_router(&moe.router())
}

/// Puts a tensor on the device as `U`.
type Upload<'a, U> = &'a dyn Fn(&TensorSpec) -> Result<DeviceBuffer<U>, LoadError>;
/// Builds a linear layer's matrix from its stacked parts.
type MatrixFrom<'a, T> = &'a dyn Fn(&[&TensorSpec]) -> Result<Matrix<T>, LoadError>;
/// Puts stacked experts on the device in their blocks, or `None` where their format is not
/// one the quantized expert kernels read.
pub(super) type QuantFrom<'a> = &'a dyn Fn(&TensorSpec) -> Result<Option<QuantExperts>, LoadError>;

/// Loads a MoE layer's weights: `upload` puts a tensor on the device in `T` (the stacked
/// experts dequantized or converted, whatever the file's type), `matrix` builds a linear
/// layer's matrix from its parts (kept in GGUF blocks where the GPU multiplies them in place);
/// `quantized`, where given (`PAGODA_CUDA_MOE_QUANT`), keeps the stacked experts in their
/// blocks when all three projections' formats allow (else they are uploaded in `T`, with an
/// INFO line).
pub(super) fn load_experts<T: HostFloat>(
    plan: &ExpertsPlan,
    upload: Upload<'_, T>,
    upload_f32: Upload<'_, f32>,
    matrix: MatrixFrom<'_, T>,
    quantized: Option<QuantFrom<'_>>,
) -> Result<GpuExperts<T>, LoadError> {
    let shared = match &plan.shared {
        Some([gate, up, down]) => Some([matrix(&[gate, up])?, matrix(&[down])?]),
        None => None,
    };
    Ok(GpuExperts {
        router: matrix(&[&plan.router])?,
        selection_bias: plan.selection_bias.as_ref().map(upload_f32).transpose()?,
        weights: expert_weights(plan, upload, quantized)?,
        shared,
    })
}

/// The stacked experts of `plan`: in their blocks where `quantized` keeps all three, else in
/// `T`.
fn expert_weights<T: HostFloat>(
    plan: &ExpertsPlan,
    upload: Upload<'_, T>,
    quantized: Option<QuantFrom<'_>>,
) -> Result<ExpertWeights<T>, LoadError> {
    if let Some(quantized) = quantized {
        if let (Some(gate), Some(up), Some(down)) = (
            quantized(&plan.gate)?,
            quantized(&plan.up)?,
            quantized(&plan.down)?,
        ) {
            return Ok(ExpertWeights::Quantized([gate, up, down]));
        }
        static LOGGED: std::sync::Once = std::sync::Once::new();
        LOGGED.call_once(|| {
            tracing::info!(
                "CUDA MoE: the stacked experts of {} are in a format the quantized expert \
                 kernels do not read (they take Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K \
                 in whole blocks): dequantized at load (PAGODA_CUDA_MOE_QUANT)",
                plan.gate.name
            )
        });
    }
    Ok(ExpertWeights::Dense([
        upload(&plan.gate)?,
        upload(&plan.up)?,
        upload(&plan.down)?,
    ]))
}

/// The step buffers of a MoE model's expert blocks, for steps of up to the step buffers'
/// token count.
pub struct MoeBuffers<T> {
    /// `[max_tokens, num_experts]`: the router's logits.
    logits: DeviceBuffer<f32>,
    /// The routing, the intermediates and the expert outputs.
    workspace: MoeWorkspace<T>,
    /// The shared experts' buffers, where the model has them.
    shared: Option<SharedBuffers<T>>,
    router: DeviceRouter,
    /// Steps of many bf16 rows run the experts on tensor cores (`PAGODA_CUDA_MOE_MMA`, off in
    /// deterministic mode): see [`ops::MoePath::choose`].
    tensor_cores: bool,
    /// The q8 activations of quantized experts (`PAGODA_CUDA_MOE_QUANT`).
    q8: Option<MoeQ8>,
    /// Quantized experts, steps of at least `dense_rows` rows: two stacks of
    /// `[num_experts, expert width, hidden]` their blocks are decoded into (gate and up, then
    /// down into the first), for the dense expert kernels (`PAGODA_CUDA_MOE_QUANT_DENSE_ROWS`).
    dense: Option<[DeviceBuffer<T>; 2]>,
    dense_rows: usize,
}

/// The shared experts' activations.
struct SharedBuffers<T> {
    /// `[max_tokens, 2 * shared_width]`.
    gate_up: DeviceBuffer<T>,
    /// `[max_tokens, shared_width]`.
    act: DeviceBuffer<T>,
    /// `[max_tokens, hidden]`, f32: added after the routed experts.
    out: DeviceBuffer<f32>,
    /// `num_shared_experts * expert_intermediate_size`.
    width: usize,
}

impl<T: HostFloat> MoeBuffers<T> {
    /// The buffers for `c`'s expert blocks and steps of up to `max_tokens` tokens, or `None`
    /// for a model without expert layers (nothing allocated; a DeepSeek configuration may
    /// list every layer dense). `tensor_cores`: [`MoeBuffers::tensor_cores`]; `quant`: room for
    /// the q8 activations of experts kept in blocks; `dense_rows`: their steps of this many
    /// rows or more run from decoded stacks (0: never; no stacks unless a step can be that
    /// large).
    pub fn new(
        gpu: &Gpu,
        c: &ModelConfig,
        max_tokens: usize,
        [tensor_cores, quant]: [bool; 2],
        dense_rows: usize,
    ) -> Result<Option<Self>, CudaError> {
        let Some(moe) = c.moe.as_ref().filter(|_| c.has_expert_layers()) else {
            return Ok(None);
        };
        let router = device_router(moe)?;
        let tokens = max_tokens.max(1);
        let inter = moe.expert_intermediate_size;
        let workspace = MoeWorkspace::new(gpu, &router, tokens, c.hidden_size, inter)?;
        let shared_width = moe.num_shared_experts * inter;
        let shared = if shared_width > 0 {
            Some(SharedBuffers {
                gate_up: gpu.zeros(tokens * 2 * shared_width)?,
                act: gpu.zeros(tokens * shared_width)?,
                out: gpu.zeros(tokens * c.hidden_size)?,
                width: shared_width,
            })
        } else {
            None
        };
        static LOGGED: std::sync::Once = std::sync::Once::new();
        LOGGED.call_once(|| {
            tracing::info!(
                "CUDA mixture of experts: router, expert lists and grouped expert MLP on the \
                 device (CUDA cores, {} entries per tile; a warp per row and expert up to {} \
                 rows; no host round trip, graph-capturable); bf16 steps of {}+ rows on tensor \
                 cores: {} (PAGODA_CUDA_MOE_MMA)",
                ops::MOE_TILE_ROWS,
                ops::MOE_PER_ROW_MAX_ROWS,
                ops::MOE_MMA_MIN_ROWS,
                if tensor_cores { "on" } else { "off" }
            )
        });
        let dense_rows = if quant && dense_rows > 0 && dense_rows <= tokens {
            dense_rows
        } else {
            0
        };
        let stack = moe.num_experts * inter * c.hidden_size;
        let dense = match dense_rows {
            0 => None,
            _ => Some([gpu.zeros(stack)?, gpu.zeros(stack)?]),
        };
        Ok(Some(MoeBuffers {
            logits: gpu.zeros(tokens * moe.num_experts)?,
            q8: quant.then(|| MoeQ8::new(gpu, &workspace)).transpose()?,
            dense,
            dense_rows,
            workspace,
            shared,
            router,
            tensor_cores,
        }))
    }
}

/// What the expert steps of one step read besides the layer's weights.
pub(super) struct ExpertStep<'s, 'a, T> {
    pub gpu: &'a Gpu,
    pub linear: Linear<'s, T>,
    pub num_tokens: usize,
    pub hidden: usize,
}

impl<T: HostFloat> ExpertStep<'_, '_, T> {
    /// `logits <- normed · Wrouter^T`, then each row's experts, each expert's rows and the
    /// matmul tiles, on the device.
    pub fn route(
        &mut self,
        experts: &GpuExperts<T>,
        normed: &impl DeviceRead<T>,
        buffers: &mut MoeBuffers<T>,
    ) -> Result<(), CudaError> {
        let n = self.num_tokens;
        let num_experts = buffers.router.num_experts;
        let mut logits = view_mut(&mut buffers.logits, 0..n * num_experts)?;
        let shape = (n, num_experts, self.hidden);
        self.linear
            .run(normed, &experts.router, &mut logits, shape, 0.0)?;
        let (router, bias) = (&buffers.router, experts.selection_bias.as_ref());
        ops::moe_route(self.gpu, &logits, router, bias, &mut buffers.workspace, n)
    }

    /// `x += Σ weight · expert(normed)` over each row's experts in ascending index, plus the
    /// shared experts' MLP where the layer has them.
    pub fn experts(
        &mut self,
        experts: &GpuExperts<T>,
        normed: &impl DeviceRead<T>,
        buffers: &mut MoeBuffers<T>,
        x: &mut DeviceViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        let (gpu, n, hidden) = (self.gpu, self.num_tokens, self.hidden);
        let path = ops::MoePath::choose(n, T::DTYPE, buffers.tensor_cores);
        if let (ExpertWeights::Quantized(w), Some([first, second])) =
            (&experts.weights, buffers.dense.as_mut())
        {
            if buffers.dense_rows > 0 && n >= buffers.dense_rows {
                // A large step: the dense kernels over the decoded stacks beat the
                // quantized GEMVs by more than the decode costs.
                ops::moe_quant_dequantize(gpu, &w[0], first)?;
                ops::moe_quant_dequantize(gpu, &w[1], second)?;
                let workspace = &mut buffers.workspace;
                ops::moe_gate_up_with(gpu, path, normed, [&*first, &*second], workspace, n)?;
                ops::moe_quant_dequantize(gpu, &w[2], first)?;
                let has_shared = self.shared_experts(experts, normed, &mut buffers.shared)?;
                let shared = match (&buffers.shared, has_shared) {
                    (Some(shared), true) => Some(view(&shared.out, 0..n * hidden)?),
                    _ => None,
                };
                let workspace = &mut buffers.workspace;
                return ops::moe_down_combine(gpu, path, first, workspace, shared.as_ref(), x, n);
            }
        }
        let workspace = &mut buffers.workspace;
        match (&experts.weights, buffers.q8.as_mut()) {
            (ExpertWeights::Dense([gate, up, _]), _) => {
                ops::moe_gate_up_with(gpu, path, normed, [gate, up], workspace, n)?
            }
            (ExpertWeights::Quantized(w), Some(q8)) => {
                ops::moe_quant_gate_up(gpu, normed, [&w[0], &w[1]], q8, workspace, n)?
            }
            (ExpertWeights::Quantized(_), None) => return Err(no_q8()),
        }
        let has_shared = self.shared_experts(experts, normed, &mut buffers.shared)?;
        let shared = match (&buffers.shared, has_shared) {
            (Some(shared), true) => Some(view(&shared.out, 0..n * hidden)?),
            _ => None,
        };
        let (workspace, q8) = (&mut buffers.workspace, buffers.q8.as_mut());
        match (&experts.weights, q8) {
            (ExpertWeights::Quantized(w), Some(q8)) => {
                ops::moe_quant_down_combine(gpu, &w[2], q8, workspace, shared.as_ref(), x, n)
            }
            (ExpertWeights::Dense([_, _, down]), _) => {
                ops::moe_down_combine(gpu, path, down, workspace, shared.as_ref(), x, n)
            }
            (ExpertWeights::Quantized(_), None) => Err(no_q8()),
        }
    }

    /// The shared experts' output into `shared.out` (`[num_tokens, hidden]` f32), where the
    /// layer has them (then `true`): the dense MLP's steps into their own buffers.
    fn shared_experts(
        &mut self,
        experts: &GpuExperts<T>,
        normed: &impl DeviceRead<T>,
        shared: &mut Option<SharedBuffers<T>>,
    ) -> Result<bool, CudaError> {
        let (gpu, n, hidden) = (self.gpu, self.num_tokens, self.hidden);
        let (Some([gate_up, shared_down]), Some(shared)) = (&experts.shared, shared) else {
            return Ok(false);
        };
        // The shared experts: the dense MLP's steps into their own buffers.
        let width = shared.width;
        let mut gate_up_out = view_mut(&mut shared.gate_up, 0..n * 2 * width)?;
        self.linear.run(
            normed,
            gate_up,
            &mut gate_up_out,
            (n, 2 * width, hidden),
            0.0,
        )?;
        let gate = view(&shared.gate_up, 0..n * 2 * width)?;
        let up = view(&shared.gate_up, width..n * 2 * width)?;
        let mut act = view_mut(&mut shared.act, 0..n * width)?;
        ops::silu_mul(gpu, &gate, &up, &mut act, width, (2 * width, 2 * width))?;
        let mut out = view_mut(&mut shared.out, 0..n * hidden)?;
        self.linear
            .run(&act, shared_down, &mut out, (n, hidden, width), 0.0)?;
        Ok(true)
    }
}

/// Quantized experts met step buffers made without their q8 activations.
fn no_q8() -> CudaError {
    CudaError::invalid(
        "experts kept in blocks need step buffers made with PAGODA_CUDA_MOE_QUANT on",
    )
}
