//! Which tensors a model is made of, declared once per architecture for every device: each
//! tensor's canonical name ([`crate::weights::names`]), its row-major shape, and whether the
//! architecture requires it. The CPU model (`llama.rs`) and the CUDA model
//! (`llama_cuda/weights.rs`) load what the plan lists, each in its own layout (the GPU
//! stacks q/k/v and gate/up), so names, shapes and presence rules live here only.
//!
//! Adding an architecture of the llama family's shape is a plan here (which optional tensors
//! it has or requires) plus its layer sequence in `decoder.rs`.

use crate::config::{MlaConfig, ModelConfig};
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
// A plan is built once per load: boxing a variant would only add an indirection.
#[allow(clippy::large_enum_variant)]
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
    /// `[num_experts]`: the selection bias (DeepSeek-V3).
    pub selection_bias: Option<TensorSpec>,
    /// The shared experts' dense MLP (DeepSeek): gate, up `[shared_width, hidden]`, down
    /// `[hidden, shared_width]`.
    pub shared: Option<[TensorSpec; 3]>,
    /// The router, `[num_experts, hidden]`.
    pub router: TensorSpec,
    /// `[num_experts, expert_intermediate, hidden]`.
    pub gate: TensorSpec,
    /// `[num_experts, expert_intermediate, hidden]`.
    pub up: TensorSpec,
    /// `[num_experts, hidden, expert_intermediate]`.
    pub down: TensorSpec,
}

/// A decoder layer's tensors in the llama family's roles.
#[derive(Debug, Clone)]
pub struct LayerPlan {
    pub attn_norm: TensorSpec,
    pub attention: AttentionPlan,
    pub ffn_norm: TensorSpec,
    pub mlp: MlpPlan,
}

/// A layer's attention block: grouped-query or latent.
#[derive(Debug, Clone)]
pub enum AttentionPlan {
    /// Grouped-query attention (the llama family).
    Gqa(GqaPlan),
    /// Multi-head latent attention (DeepSeek).
    Mla(MlaPlan),
}

/// The query path of latent attention.
#[derive(Debug, Clone)]
pub enum MlaQueryPlan {
    /// `q = normed · Wq^T`, `[num_heads * q_head_dim, hidden]` (V2-Lite).
    Direct(TensorSpec),
    /// `q = rms_norm(normed · Wq_a^T) · Wq_b^T`: `q_a` `[q_lora_rank, hidden]`, its norm
    /// `[q_lora_rank]`, `q_b` `[num_heads * q_head_dim, q_lora_rank]`.
    Compressed {
        q_a: TensorSpec,
        q_a_norm: TensorSpec,
        q_b: TensorSpec,
    },
}

/// The key/value up-projection of latent attention, as the file stores it.
#[derive(Debug, Clone)]
pub enum KvUpPlan {
    /// `[num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`: per head its key rows
    /// then its value rows (HF's `kv_b_proj`, GGUF files before llama.cpp's MLA change).
    Joint(TensorSpec),
    /// `k_b` `[num_heads, kv_lora_rank, qk_nope_head_dim]` (transposed key rows) and `v_b`
    /// `[num_heads, v_head_dim, kv_lora_rank]` (newer GGUF files).
    Split { k_b: TensorSpec, v_b: TensorSpec },
}

/// A latent attention block's tensors.
#[derive(Debug, Clone)]
pub struct MlaPlan {
    pub query: MlaQueryPlan,
    /// `[kv_lora_rank + qk_rope_head_dim, hidden]`: the latent then the shared RoPE key.
    pub kv_a: TensorSpec,
    /// `[kv_lora_rank]`.
    pub kv_a_norm: TensorSpec,
    pub kv_up: KvUpPlan,
    /// `[hidden, num_heads * v_head_dim]`.
    pub attn_output: TensorSpec,
    /// DeepSeek-V3.2's sparse-attention indexer.
    pub indexer: Option<IndexerPlan>,
}

/// DeepSeek-V3.2's lightning indexer: `q_b` `[index_n_heads * index_head_dim,
/// q_lora_rank]`, `k` `[index_head_dim, hidden]` with its LayerNorm weight and bias
/// `[index_head_dim]`, `proj` `[index_n_heads, hidden]` (the heads' weights).
#[derive(Debug, Clone)]
pub struct IndexerPlan {
    pub q_b: TensorSpec,
    pub k: TensorSpec,
    pub k_norm: TensorSpec,
    pub k_norm_bias: TensorSpec,
    pub proj: TensorSpec,
}

/// A grouped-query attention block's tensors. Optional tensors are `Some` when the
/// architecture requires them or the model file holds them.
#[derive(Debug, Clone)]
pub struct GqaPlan {
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
                let attention = match &c.mla {
                    Some(mla) => {
                        let split = present(&n(names::ATTN_K_B));
                        AttentionPlan::Mla(mla_plan(c, mla, &spec, split))
                    }
                    None => AttentionPlan::Gqa(GqaPlan {
                        q: spec(names::ATTN_Q, &[q_dim, hidden]),
                        k: spec(names::ATTN_K, &[kv_dim, hidden]),
                        v: spec(names::ATTN_V, &[kv_dim, hidden]),
                        q_bias: optional(names::ATTN_Q_BIAS, &[q_dim]),
                        k_bias: optional(names::ATTN_K_BIAS, &[kv_dim]),
                        v_bias: optional(names::ATTN_V_BIAS, &[kv_dim]),
                        q_norm: optional(names::ATTN_Q_NORM, &[head]),
                        k_norm: optional(names::ATTN_K_NORM, &[head]),
                        attn_output: spec(names::ATTN_OUTPUT, &[hidden, q_dim]),
                    }),
                };
                let layer = LayerPlan {
                    attn_norm: spec(names::ATTN_NORM, &[hidden]),
                    attention,
                    ffn_norm: spec(names::FFN_NORM, &[hidden]),
                    mlp: match &c.moe {
                        Some(moe) if moe.is_moe_layer(i) => {
                            let (experts, expert_inter) =
                                (moe.num_experts, moe.expert_intermediate_size);
                            let shared_width = moe.num_shared_experts * expert_inter;
                            MlpPlan::Experts(ExpertsPlan {
                                selection_bias: moe
                                    .selection_bias
                                    .then(|| spec(names::FFN_EXP_PROBS_B, &[experts])),
                                shared: (shared_width > 0).then(|| {
                                    [
                                        spec(names::FFN_GATE_SHEXP, &[shared_width, hidden]),
                                        spec(names::FFN_UP_SHEXP, &[shared_width, hidden]),
                                        spec(names::FFN_DOWN_SHEXP, &[hidden, shared_width]),
                                    ]
                                }),
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
                let lacks_qk_norm = match &layer.attention {
                    AttentionPlan::Gqa(a) => a.q_norm.is_none() || a.k_norm.is_none(),
                    AttentionPlan::Mla(_) => false,
                };
                if requires_qk_norm && lacks_qk_norm {
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

/// The latent attention tensors of one layer: the query path the config implies, and the
/// split `k_b`/`v_b` up-projections when the file has them (`split`), else the joint `kv_b`.
fn mla_plan(
    c: &ModelConfig,
    mla: &MlaConfig,
    spec: &dyn Fn(&str, &[usize]) -> TensorSpec,
    split: bool,
) -> MlaPlan {
    let (hidden, heads) = (c.hidden_size, c.num_attention_heads);
    let (latent, nope, v) = (mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim);
    let q_rows = heads * mla.q_head_dim();
    MlaPlan {
        query: match mla.q_lora_rank {
            None => MlaQueryPlan::Direct(spec(names::ATTN_Q, &[q_rows, hidden])),
            Some(rank) => MlaQueryPlan::Compressed {
                q_a: spec(names::ATTN_Q_A, &[rank, hidden]),
                q_a_norm: spec(names::ATTN_Q_A_NORM, &[rank]),
                q_b: spec(names::ATTN_Q_B, &[q_rows, rank]),
            },
        },
        kv_a: spec(names::ATTN_KV_A_MQA, &[mla.latent_row(), hidden]),
        kv_a_norm: spec(names::ATTN_KV_A_NORM, &[latent]),
        kv_up: if split {
            KvUpPlan::Split {
                k_b: spec(names::ATTN_K_B, &[heads, latent, nope]),
                v_b: spec(names::ATTN_V_B, &[heads, v, latent]),
            }
        } else {
            KvUpPlan::Joint(spec(names::ATTN_KV_B, &[heads * (nope + v), latent]))
        },
        attn_output: spec(names::ATTN_OUTPUT, &[hidden, heads * v]),
        indexer: mla.indexer.zip(mla.q_lora_rank).map(|(indexer, rank)| {
            let (index_heads, dim) = (indexer.num_heads, indexer.head_dim);
            IndexerPlan {
                q_b: spec(names::INDEXER_ATTN_Q_B, &[index_heads * dim, rank]),
                k: spec(names::INDEXER_ATTN_K, &[dim, hidden]),
                k_norm: spec(names::INDEXER_K_NORM, &[dim]),
                k_norm_bias: spec(names::INDEXER_K_NORM_BIAS, &[dim]),
                proj: spec(names::INDEXER_PROJ, &[index_heads, hidden]),
            }
        }),
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
            specs.extend([&l.attn_norm, &l.ffn_norm]);
            match &l.attention {
                AttentionPlan::Gqa(a) => {
                    specs.extend([&a.q, &a.k, &a.v, &a.attn_output]);
                    let optional = [&a.q_bias, &a.k_bias, &a.v_bias, &a.q_norm, &a.k_norm];
                    specs.extend(optional.into_iter().flatten());
                }
                AttentionPlan::Mla(m) => {
                    specs.extend([&m.kv_a, &m.kv_a_norm, &m.attn_output]);
                    match &m.query {
                        MlaQueryPlan::Direct(q) => specs.push(q),
                        MlaQueryPlan::Compressed { q_a, q_a_norm, q_b } => {
                            specs.extend([q_a, q_a_norm, q_b])
                        }
                    }
                    match &m.kv_up {
                        KvUpPlan::Joint(kv_b) => specs.push(kv_b),
                        KvUpPlan::Split { k_b, v_b } => specs.extend([k_b, v_b]),
                    }
                    if let Some(i) = &m.indexer {
                        specs.extend([&i.q_b, &i.k, &i.k_norm, &i.k_norm_bias, &i.proj]);
                    }
                }
            }
            match &l.mlp {
                MlpPlan::Dense { gate, up, down } => specs.extend([gate, up, down]),
                MlpPlan::Experts(e) => {
                    specs.extend([&e.router, &e.gate, &e.up, &e.down]);
                    specs.extend(e.selection_bias.as_ref());
                    specs.extend(e.shared.iter().flatten());
                }
            }
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
            moe("deepseek-v2-tiny"),
            moe("deepseek-v3-tiny"),
            moe("deepseek-v32-tiny"),
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
