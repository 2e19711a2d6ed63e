//! Which tensors a model is made of, declared once per architecture for every device: each
//! tensor's canonical name ([`crate::weights::names`]), its row-major shape, and whether the
//! architecture requires it. The CPU model (`llama.rs`) and the CUDA model
//! (`llama_cuda/weights.rs`) load what the plan lists, each in its own layout (the GPU
//! stacks q/k/v and gate/up), so names, shapes and presence rules live here only.
//!
//! Adding an architecture of the llama family's shape is a plan here (which optional tensors
//! it has or requires) plus its layer sequence in `decoder.rs`.

use crate::config::ModelConfig;
use crate::weights::{names, LoadError, TensorSource};

/// One tensor the model reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// The canonical name.
    pub name: String,
    /// Row-major shape, outermost first (`[out, in]` for a linear weight).
    pub shape: Vec<usize>,
}

impl TensorSpec {
    fn new(name: impl Into<String>, shape: &[usize]) -> Self {
        TensorSpec {
            name: name.into(),
            shape: shape.to_vec(),
        }
    }

    /// Elements in the tensor.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows of a matrix (`shape[0]`).
    pub fn rows(&self) -> usize {
        self.shape[0]
    }

    /// Columns of a matrix (`shape[1]`; 1 for a vector).
    pub fn cols(&self) -> usize {
        self.shape.get(1).copied().unwrap_or(1)
    }
}

/// A layer's MLP block: dense, or a mixture of experts.
#[derive(Debug, Clone)]
pub enum MlpPlan {
    /// One SiLU-gated MLP: gate and up `[intermediate, hidden]`, down `[hidden, intermediate]`.
    Dense {
        gate: TensorSpec,
        up: TensorSpec,
        down: TensorSpec,
    },
    /// A router and stacked experts.
    Experts(ExpertsPlan),
}

/// A mixture-of-experts MLP block's tensors (GGUF's stacked layout; a safetensors
/// checkpoint's per-expert tensors are served stacked).
#[derive(Debug, Clone)]
pub struct ExpertsPlan {
    /// The router, `[num_experts, hidden]`.
    pub router: TensorSpec,
    /// `[num_experts, expert_intermediate, hidden]`.
    pub gate: TensorSpec,
    /// `[num_experts, expert_intermediate, hidden]`.
    pub up: TensorSpec,
    /// `[num_experts, hidden, expert_intermediate]`.
    pub down: TensorSpec,
}

/// A decoder layer's tensors in the llama family's roles. Optional tensors are `Some` when
/// the architecture requires them or the model file holds them.
#[derive(Debug, Clone)]
pub struct LayerPlan {
    pub attn_norm: TensorSpec,
    pub q: TensorSpec,
    pub k: TensorSpec,
    pub v: TensorSpec,
    /// Qwen2's projection biases (any model file may carry them).
    pub q_bias: Option<TensorSpec>,
    pub k_bias: Option<TensorSpec>,
    pub v_bias: Option<TensorSpec>,
    /// Qwen3's per-head RMSNorm weights of q and k.
    pub q_norm: Option<TensorSpec>,
    pub k_norm: Option<TensorSpec>,
    pub attn_output: TensorSpec,
    pub ffn_norm: TensorSpec,
    pub mlp: MlpPlan,
}

/// Every tensor of a model, in load order.
#[derive(Debug, Clone)]
pub struct ModelPlan {
    pub layers: Vec<LayerPlan>,
    pub embedding: TensorSpec,
    /// The LM head; `None` when the embedding is tied and the file has no `output.weight`.
    pub lm_head: Option<TensorSpec>,
    pub output_norm: TensorSpec,
}

impl ModelPlan {
    /// The plan of `config`'s architecture over the tensors `source` holds. A tensor the
    /// architecture requires but the file lacks is an error naming it and the layer; the
    /// shapes are checked when each device loads the tensor.
    pub fn new(config: &ModelConfig, source: &dyn TensorSource) -> Result<ModelPlan, LoadError> {
        let c = config;
        let (hidden, inter, head) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let q_dim = c.num_attention_heads * head;
        let kv_dim = c.num_kv_heads * head;
        let requires_qk_norm = c.architecture.has_qk_norm();
        let present = |name: &str| source.tensor(name).is_some();
        let layers = (0..c.num_layers)
            .map(|i| {
                let n = |suffix: &str| names::layer(i, suffix);
                let spec = |suffix: &str, shape: &[usize]| TensorSpec::new(n(suffix), shape);
                let optional = |suffix: &str, shape: &[usize]| {
                    present(&n(suffix)).then(|| spec(suffix, shape))
                };
                let layer = LayerPlan {
                    attn_norm: spec(names::ATTN_NORM, &[hidden]),
                    q: spec(names::ATTN_Q, &[q_dim, hidden]),
                    k: spec(names::ATTN_K, &[kv_dim, hidden]),
                    v: spec(names::ATTN_V, &[kv_dim, hidden]),
                    q_bias: optional(names::ATTN_Q_BIAS, &[q_dim]),
                    k_bias: optional(names::ATTN_K_BIAS, &[kv_dim]),
                    v_bias: optional(names::ATTN_V_BIAS, &[kv_dim]),
                    q_norm: optional(names::ATTN_Q_NORM, &[head]),
                    k_norm: optional(names::ATTN_K_NORM, &[head]),
                    attn_output: spec(names::ATTN_OUTPUT, &[hidden, q_dim]),
                    ffn_norm: spec(names::FFN_NORM, &[hidden]),
                    mlp: match &c.moe {
                        Some(moe) if moe.is_moe_layer(i) => {
                            let (experts, expert_inter) =
                                (moe.num_experts, moe.expert_intermediate_size);
                            MlpPlan::Experts(ExpertsPlan {
                                router: spec(names::FFN_GATE_INP, &[experts, hidden]),
                                gate: spec(names::FFN_GATE_EXPS, &[experts, expert_inter, hidden]),
                                up: spec(names::FFN_UP_EXPS, &[experts, expert_inter, hidden]),
                                down: spec(names::FFN_DOWN_EXPS, &[experts, hidden, expert_inter]),
                            })
                        }
                        _ => MlpPlan::Dense {
                            gate: spec(names::FFN_GATE, &[inter, hidden]),
                            up: spec(names::FFN_UP, &[inter, hidden]),
                            down: spec(names::FFN_DOWN, &[hidden, inter]),
                        },
                    },
                };
                if requires_qk_norm && (layer.q_norm.is_none() || layer.k_norm.is_none()) {
                    return Err(LoadError(format!(
                        "{} layer {i} lacks attn_q_norm/attn_k_norm",
                        c.architecture.name()
                    )));
                }
                Ok(layer)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let vocab = [c.vocab_size, hidden];
        let tied = c.tie_word_embeddings && !present(names::OUTPUT);
        Ok(ModelPlan {
            layers,
            embedding: TensorSpec::new(names::TOKEN_EMBEDDING, &vocab),
            lm_head: (!tied).then(|| TensorSpec::new(names::OUTPUT, &vocab)),
            output_norm: TensorSpec::new(names::OUTPUT_NORM, &[hidden]),
        })
    }
}

/// GGUF block formats the CUDA model keeps in device memory and multiplies in place
/// (`PAGODA_CUDA_QUANT_WEIGHTS`); any other format is dequantized to the model's dtype at load.
pub const GPU_IN_PLACE_FORMATS: [pagoda_tensor::GgmlType; 8] = {
    use pagoda_tensor::GgmlType as T;
    [
        T::Q4_0,
        T::Q4_1,
        T::Q5_0,
        T::Q5_1,
        T::Q8_0,
        T::Q4K,
        T::Q5K,
        T::Q6K,
    ]
};

/// Whether the CUDA model keeps a `[rows, cols]` matrix of `ty` in its blocks: a format of
/// [`GPU_IN_PLACE_FORMATS`] whose blocks tile each row.
pub fn gpu_keeps_blocks(ty: pagoda_tensor::GgmlType, cols: usize) -> bool {
    GPU_IN_PLACE_FORMATS.contains(&ty) && ty.block_size().is_some_and(|b| cols.is_multiple_of(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Architecture;
    use crate::random::{preset, tensor_shapes, RandomWeights};
    use crate::weights::RawTensor;

    fn small(architecture: Architecture) -> ModelConfig {
        ModelConfig {
            architecture,
            num_layers: 2,
            vocab_size: 512,
            ..preset("smollm2-135m").unwrap()
        }
    }

    fn listed(plan: &ModelPlan) -> Vec<&TensorSpec> {
        let mut specs = vec![&plan.embedding, &plan.output_norm];
        specs.extend(plan.lm_head.as_ref());
        for l in &plan.layers {
            specs.extend([&l.attn_norm, &l.q, &l.k, &l.v, &l.attn_output, &l.ffn_norm]);
            match &l.mlp {
                MlpPlan::Dense { gate, up, down } => specs.extend([gate, up, down]),
                MlpPlan::Experts(e) => specs.extend([&e.router, &e.gate, &e.up, &e.down]),
            }
            let optional = [&l.q_bias, &l.k_bias, &l.v_bias, &l.q_norm, &l.k_norm];
            specs.extend(optional.into_iter().flatten());
        }
        specs
    }

    /// The plan lists exactly the tensors the random-weight generator (its own table of
    /// names and shapes) makes for each architecture, with the same shapes.
    #[test]
    fn plans_list_every_tensor_of_each_architecture_with_its_shape() {
        let moe = |name: &str| ModelConfig {
            vocab_size: 512,
            ..preset(name).unwrap()
        };
        let configs = [
            small(Architecture::Llama),
            small(Architecture::Qwen2),
            small(Architecture::Qwen3),
            moe("qwen3-moe-tiny"),
            moe("mixtral-tiny"),
        ];
        for config in configs {
            let architecture = config.architecture;
            let weights = RandomWeights::new(&config, 1, 1 << 30).unwrap();
            let plan = ModelPlan::new(&config, &weights).unwrap();
            let mut got: Vec<(String, Vec<usize>)> = listed(&plan)
                .into_iter()
                .map(|spec| (spec.name.clone(), spec.shape.clone()))
                .collect();
            let mut expected: Vec<(String, Vec<usize>)> = tensor_shapes(&config)
                .into_iter()
                .map(|(name, shape)| match shape.as_slice() {
                    // Vectors are `[len]` in the plan.
                    [len] => (name, vec![*len]),
                    _ => (name, shape),
                })
                .collect();
            got.sort();
            expected.sort();
            assert_eq!(got, expected, "{architecture:?}");
        }
    }

    struct Without<'a>(&'a dyn TensorSource, &'static str);

    impl TensorSource for Without<'_> {
        fn tensor(&self, name: &str) -> Option<RawTensor<'_>> {
            (!name.ends_with(self.1))
                .then(|| self.0.tensor(name))
                .flatten()
        }
        fn tensor_names(&self) -> Vec<String> {
            self.0.tensor_names()
        }
    }

    #[test]
    fn qwen3_requires_its_qk_norms_and_tied_heads_have_no_lm_head() {
        let config = small(Architecture::Qwen3);
        let weights = RandomWeights::new(&config, 1, 1 << 30).unwrap();
        let error = ModelPlan::new(&config, &Without(&weights, names::ATTN_K_NORM)).unwrap_err();
        assert!(error.0.contains("qwen3 layer 0 lacks"), "{error}");
        let tied = ModelConfig {
            tie_word_embeddings: true,
            ..small(Architecture::Llama)
        };
        let weights = RandomWeights::new(&tied, 1, 1 << 30).unwrap();
        let plan = ModelPlan::new(&tied, &Without(&weights, names::OUTPUT)).unwrap();
        assert!(plan.lm_head.is_none());
        let untied = ModelConfig {
            tie_word_embeddings: false,
            ..small(Architecture::Llama)
        };
        let weights = RandomWeights::new(&untied, 1, 1 << 30).unwrap();
        let plan = ModelPlan::new(&untied, &weights).unwrap();
        assert_eq!(plan.lm_head.unwrap().shape, [512, 576]);
    }

    #[test]
    fn the_gpu_keeps_its_block_formats_when_blocks_tile_the_rows() {
        use pagoda_tensor::GgmlType;
        assert!(gpu_keeps_blocks(GgmlType::Q4K, 4096));
        assert!(gpu_keeps_blocks(GgmlType::Q4_1, 576));
        // A K-quant row of 576 values is not a whole number of 256-value blocks.
        assert!(!gpu_keeps_blocks(GgmlType::Q6K, 576));
        assert!(!gpu_keeps_blocks(GgmlType::Q3K, 4096));
        assert!(!gpu_keeps_blocks(GgmlType::F16, 4096));
    }
}
