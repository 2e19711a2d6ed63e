//! The llama family forward pass (Llama 2/3, SmolLM2, Mistral) and its Qwen2 (q/k/v bias) and
//! Qwen3 (per-head q/k RMSNorm) variants, and their mixture-of-experts forms (Qwen3-MoE,
//! Mixtral: `moe.rs`), on the CPU, over the paged KV cache.
//!
//! One call runs a ragged batch: several requests, each contributing one or more new tokens
//! (prefill chunks and decode tokens alike), all through the same CSR page table.

use pagoda_kv::{PageTable, Slot};
use pagoda_ops::attention::{
    plan_step, record_cascade_step, AttentionError, AttentionPath, CascadeRule, KeySummaries,
    KvLayout, KvPool, KvType, PagedKv, SparseAttention, SplitKvChunking, StepAttentionConfig,
    StepAttentionPlan, DEFAULT_CHUNK_TOKENS,
};
use pagoda_ops::collective::CollectiveError;
use pagoda_ops::linear::Weight;
use pagoda_ops::rope::Rope;

use crate::config::ModelConfig;
use crate::decoder::{deepseek_layers, llama_layers, llama_moe_layers};
use crate::weight_plan::{AttentionPlan, MlpPlan, ModelPlan, TensorSpec};
use crate::weights::TensorSource;

mod group;
mod load;
mod mla;
mod moe;
mod parallel;
pub(crate) use load::rope_for;
use load::{fetch, load_matrix, load_vector, weight_from_bytes};
use parallel::Parallel;
mod policy;
mod step;
use mla::MlaWeights;
use moe::{Experts, Mlp};
pub use policy::{
    cascade_rule, split_kv_chunk_tokens, AttentionPolicy, AUTO_CASCADE_RULE,
    AUTO_MIN_SPLIT_KV_TOKENS, CASCADE_ENV_VAR, SPLIT_KV_CHUNK_ENV_VAR,
};

/// How weights are held in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightPrecision {
    /// As stored in the file (quantized blocks stay quantized; decoded row by row).
    AsStored,
    /// Every weight dequantized to f32 at load (the `--exact` parity mode).
    F32,
}

/// The weights of one decoder layer.
struct Layer {
    attn_norm: Vec<f32>,
    attention: Attention,
    ffn_norm: Vec<f32>,
    mlp: Mlp,
}

/// A layer's attention weights.
// One per layer, built once: boxing a variant to even out the sizes would only add an
// indirection.
#[allow(clippy::large_enum_variant)]
enum Attention {
    /// Grouped-query attention.
    Gqa(GqaWeights),
    /// DeepSeek's multi-head latent attention.
    Mla(MlaWeights),
}

/// Grouped-query attention's weights.
struct GqaWeights {
    wq: Weight,
    wk: Weight,
    wv: Weight,
    wo: Weight,
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
}

impl Attention {
    fn weights(&self) -> Vec<&Weight> {
        match self {
            Attention::Gqa(a) => vec![&a.wq, &a.wk, &a.wv, &a.wo],
            Attention::Mla(m) => m.weights(),
        }
    }
}

/// A loaded model, ready to run forward passes.
pub struct Model {
    config: ModelConfig,
    embedding: Weight,
    layers: Vec<Layer>,
    output_norm: Vec<f32>,
    /// `None` when the LM head is tied to the embedding.
    lm_head: Option<Weight>,
    rope: Rope,
    /// Visible tokens per split-KV chunk (a row's bits depend on it).
    split_kv_chunk_tokens: usize,
    /// Cascade attention's rule (`None`: off): decode rows sharing whole chunks of leading
    /// pages attend to them in one work item (same bits).
    cascade: Option<CascadeRule>,
    /// The tensor-parallel group this model is one rank of (`config` is then the rank's:
    /// its share of the heads and widths); `None` for the whole model.
    parallel: Option<Parallel>,
}

pub use crate::weights::LoadError;

/// The per-layer K/V storage: for each layer, a K pool and a V pool laid out
/// `[num_pages, page_size, num_kv_heads, head_dim]`, each of its [`KvType`] (f32 by default).
pub struct KvCache {
    pub layout: KvLayout,
    k: Vec<KvPool>,
    v: Vec<KvPool>,
    /// Per layer, the key summaries of sparse decode (empty unless
    /// [`KvCache::enable_key_summaries`] ran).
    summaries: Vec<KeySummaries>,
}

impl KvCache {
    /// Zero-filled f32 pools for `num_layers` layers.
    pub fn new(num_layers: usize, layout: KvLayout) -> KvCache {
        Self::with_types(num_layers, layout, KvType::F32, KvType::F32)
            .expect("an f32 KV cache fits any head_dim")
    }

    /// Zero-filled pools of `k_type` (K) and `v_type` (V) for `num_layers` layers; a q8_0
    /// type needs a `head_dim` that 32 divides.
    pub fn with_types(
        num_layers: usize,
        layout: KvLayout,
        k_type: KvType,
        v_type: KvType,
    ) -> Result<KvCache, AttentionError> {
        k_type.check_head_dim(layout.head_dim)?;
        v_type.check_head_dim(layout.head_dim)?;
        let elements = layout.pool_len();
        Ok(KvCache {
            layout,
            k: (0..num_layers)
                .map(|_| KvPool::zeros(k_type, elements))
                .collect(),
            v: (0..num_layers)
                .map(|_| KvPool::zeros(v_type, elements))
                .collect(),
            summaries: Vec::new(),
        })
    }

    /// A latent cache (DeepSeek's MLA): one pool of `k_type` per layer holding one row of
    /// `layout.head_dim` values per token, and no V pools.
    pub fn latent(
        num_layers: usize,
        layout: KvLayout,
        k_type: KvType,
    ) -> Result<KvCache, AttentionError> {
        k_type.check_head_dim(layout.head_dim)?;
        Ok(KvCache {
            layout,
            k: (0..num_layers)
                .map(|_| KvPool::zeros(k_type, layout.pool_len()))
                .collect(),
            v: Vec::new(),
            summaries: Vec::new(),
        })
    }

    /// Allocates the key summaries of sparse decode (per layer and page, the min and max of
    /// each KV head's keys; `2 / page_size` of an f32 K pool), kept up to date by every later
    /// append. A latent cache (no V pools) gets none: sparse decode covers grouped-query
    /// attention. Keys already written are not summarized: call it before the first step.
    pub fn enable_key_summaries(&mut self) {
        if self.summaries.is_empty() && !self.v.is_empty() {
            self.summaries = self
                .k
                .iter()
                .map(|_| KeySummaries::new(&self.layout))
                .collect();
        }
    }

    /// Whether the key summaries of sparse decode are kept.
    pub fn has_key_summaries(&self) -> bool {
        !self.summaries.is_empty()
    }

    /// The element types of the K and V pools.
    pub fn types(&self) -> (KvType, KvType) {
        let first = |pools: &[KvPool]| pools.first().map_or(KvType::F32, KvPool::kv_type);
        (first(&self.k), first(&self.v))
    }

    /// Bytes held by the pools.
    pub fn size_bytes(&self) -> usize {
        self.k
            .iter()
            .chain(&self.v)
            .map(KvPool::size_bytes)
            .sum::<usize>()
            + self
                .summaries
                .iter()
                .map(KeySummaries::size_bytes)
                .sum::<usize>()
    }

    /// Bytes of `num_layers` layers' K and V pools of `layout` with these element types.
    pub fn bytes_for(
        num_layers: usize,
        layout: &KvLayout,
        k_type: KvType,
        v_type: KvType,
    ) -> usize {
        let elements = layout.pool_len();
        num_layers * (k_type.bytes(elements) + v_type.bytes(elements))
    }
}

/// One ragged batch of new tokens.
///
/// Request `r` contributes tokens `qo_indptr[r]..qo_indptr[r+1]`; their K/V go to `slots` (physical
/// token index `page * page_size + offset`), and `page_table` row `r` covers every visible token
/// of the request *including* these new ones.
pub struct ForwardBatch<'a> {
    /// `[num_tokens]` token ids.
    pub tokens: &'a [u32],
    /// `[num_tokens]` absolute positions.
    pub positions: &'a [u32],
    /// `[num_tokens]` KV slots.
    pub slots: &'a [Slot],
    /// `[num_requests + 1]` token ranges per request.
    pub qo_indptr: &'a [u32],
    /// The CSR page table of the requests.
    pub page_table: &'a PageTable,
    /// Indices (into `tokens`) whose logits are returned, in order.
    pub logits_for: &'a [usize],
    /// `[num_requests]` (or empty: all dense): each request's sparse decode settings, used
    /// where the KV cache keeps key summaries ([`KvCache::enable_key_summaries`]).
    pub sparse: &'a [Option<SparseAttention>],
}

impl Model {
    /// Builds the model from canonical tensors. Validates every shape against `config`.
    pub fn load(
        config: ModelConfig,
        source: &dyn TensorSource,
        precision: WeightPrecision,
    ) -> Result<Model, LoadError> {
        Model::load_with_progress(config, source, precision, &mut |_, _| {})
    }

    /// [`Model::load`], calling `progress(layers_done, num_layers + 1)` as it goes.
    pub fn load_with_progress(
        config: ModelConfig,
        source: &dyn TensorSource,
        precision: WeightPrecision,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model, LoadError> {
        Model::load_rank(config, source, precision, progress, None)
    }

    /// The loader of [`Model::load_with_progress`] and of one tensor-parallel rank
    /// ([`Model::load_shard`]: `config` and `source` are then the rank's, and the LM head
    /// keeps the rank's vocabulary rows).
    fn load_rank(
        config: ModelConfig,
        source: &dyn TensorSource,
        precision: WeightPrecision,
        progress: &mut dyn FnMut(usize, usize),
        parallel: Option<Parallel>,
    ) -> Result<Model, LoadError> {
        config.validate().map_err(|e| LoadError(e.to_string()))?;
        let c = &config;
        let plan = ModelPlan::new(c, source)?;
        let matrix = |spec: &TensorSpec| {
            load_matrix(source, &spec.name, spec.rows(), spec.cols(), precision)
        };
        let vector = |spec: &TensorSpec| load_vector(source, &spec.name, spec.len());
        let optional = |spec: &Option<TensorSpec>| spec.as_ref().map(vector).transpose();

        let mut layers = Vec::with_capacity(c.num_layers);
        for (i, l) in plan.layers.iter().enumerate() {
            layers.push(Layer {
                attn_norm: vector(&l.attn_norm)?,
                attention: match &l.attention {
                    AttentionPlan::Gqa(a) => Attention::Gqa(GqaWeights {
                        wq: matrix(&a.q)?,
                        wk: matrix(&a.k)?,
                        wv: matrix(&a.v)?,
                        wo: matrix(&a.attn_output)?,
                        q_bias: optional(&a.q_bias)?,
                        k_bias: optional(&a.k_bias)?,
                        v_bias: optional(&a.v_bias)?,
                        q_norm: optional(&a.q_norm)?,
                        k_norm: optional(&a.k_norm)?,
                    }),
                    AttentionPlan::Mla(m) => {
                        Attention::Mla(MlaWeights::load(source, m, c, precision)?)
                    }
                },
                ffn_norm: vector(&l.ffn_norm)?,
                mlp: match &l.mlp {
                    MlpPlan::Dense { gate, up, down } => Mlp::Dense {
                        gate: matrix(gate)?,
                        up: matrix(up)?,
                        down: matrix(down)?,
                    },
                    MlpPlan::Experts(plan) => {
                        Mlp::Experts(Experts::load(source, plan, i, c, precision)?)
                    }
                },
            });
            progress(i + 1, c.num_layers + 1);
        }
        // The embedding is gathered row by row; keep it as stored unless exact mode asks for f32.
        let embedding = matrix(&plan.embedding)?;
        let lm_head = match &parallel {
            None => plan.lm_head.as_ref().map(matrix).transpose()?,
            Some(parallel) => Some(parallel.load_head(source, &plan, precision)?),
        };
        let rope = rope_for(c, source)?;
        progress(c.num_layers + 1, c.num_layers + 1);
        Ok(Model {
            output_norm: vector(&plan.output_norm)?,
            config,
            embedding,
            layers,
            lm_head,
            rope,
            split_kv_chunk_tokens: DEFAULT_CHUNK_TOKENS,
            cascade: None,
            parallel,
        })
    }

    /// Sets the visible tokens per split-KV chunk (default [`DEFAULT_CHUNK_TOKENS`]; for
    /// measurement: a row's bits depend on it, so it must not change while a KV cache is in
    /// use). `tokens` of 0 counts as 1.
    pub fn set_split_kv_chunk_tokens(&mut self, tokens: usize) {
        self.split_kv_chunk_tokens = tokens.max(1);
    }

    /// Sets cascade attention's rule (`None`, the default: off; see
    /// [`cascade_rule`]). Outputs are the same bits either way.
    pub fn set_cascade(&mut self, rule: Option<CascadeRule>) {
        self.cascade = rule;
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Bytes held by the weights.
    pub fn weight_bytes(&self) -> usize {
        let layer_bytes: usize = self
            .layers
            .iter()
            .map(|l| {
                l.attention
                    .weights()
                    .into_iter()
                    .chain(l.mlp.weights())
                    .map(|w| w.size_bytes())
                    .sum::<usize>()
            })
            .sum();
        layer_bytes
            + self.embedding.size_bytes()
            + self.lm_head.as_ref().map_or(0, |w| w.size_bytes())
    }

    /// Weight bytes a decode step of `rows` rows reads: [`Model::weight_bytes`] less the
    /// experts no row is routed to, for the bandwidth figure of a mixture-of-experts model.
    /// Assumes uniform routing, which is exact for one row (its top-k experts): a layer of
    /// `E` experts, `k` per row, runs `E·(1 − (1 − k/E)^rows)` of them on average.
    pub fn step_weight_bytes(&self, rows: usize) -> f64 {
        let all = self.weight_bytes() as f64;
        let idle: f64 = self
            .layers
            .iter()
            .map(|l| l.mlp.idle_expert_bytes(rows))
            .sum();
        all - idle
    }

    /// An empty KV cache of `num_pages` pages for this model: K and V pools of `k_type` and
    /// `v_type`, or for latent attention one latent pool of `k_type` per layer.
    pub fn new_kv_cache(
        &self,
        num_pages: usize,
        page_size: usize,
        k_type: KvType,
        v_type: KvType,
    ) -> Result<KvCache, AttentionError> {
        let (layers, layout) = (self.config.num_layers, self.kv_layout(num_pages, page_size));
        match self.config.mla {
            Some(_) => KvCache::latent(layers, layout, k_type),
            None => KvCache::with_types(layers, layout, k_type, v_type),
        }
    }

    /// The KV layout this model needs for a pool of `num_pages` pages.
    pub fn kv_layout(&self, num_pages: usize, page_size: usize) -> KvLayout {
        KvLayout {
            num_pages,
            page_size,
            num_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
        }
    }

    /// Runs the batch: writes each new token's K/V into `kv` and returns the logits of the
    /// tokens listed in `batch.logits_for`, `[logits_for.len(), vocab_size]` (a
    /// tensor-parallel rank: `[logits_for.len(), vocab_range().len()]`, its vocabulary slice).
    ///
    /// `policy` picks the attention path (see [`AttentionPolicy`]); the path that ran is
    /// returned.
    pub fn forward(
        &self,
        batch: &ForwardBatch<'_>,
        kv: &mut KvCache,
        policy: AttentionPolicy,
    ) -> Result<ForwardOutput, ForwardError> {
        self.run(batch, kv, policy, step::Head::Logits)
    }

    /// Runs the batch like [`forward`](Self::forward) but stops after the final norm: the
    /// hidden states of the tokens listed in `batch.logits_for`, `[logits_for.len(),
    /// hidden_size]` (what embeddings pool).
    pub fn final_hidden(
        &self,
        batch: &ForwardBatch<'_>,
        kv: &mut KvCache,
        policy: AttentionPolicy,
    ) -> Result<Vec<f32>, ForwardError> {
        Ok(self.run(batch, kv, policy, step::Head::Hidden)?.logits)
    }

    /// One rank's step (the whole model's, without a group).
    fn run_rank(
        &self,
        batch: &ForwardBatch<'_>,
        kv: &mut KvCache,
        policy: AttentionPolicy,
        head: step::Head,
    ) -> Result<ForwardOutput, ForwardError> {
        let c = &self.config;
        let plan = self.choose_attention(batch, kv, policy)?;
        let num_tokens = batch.tokens.len();
        if batch.positions.len() != num_tokens || batch.slots.len() != num_tokens {
            return Err(ForwardError::Batch(
                "tokens, positions and slots differ in length".into(),
            ));
        }
        if let Some(&token) = batch.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(ForwardError::Batch(format!(
                "token {token} is outside the vocabulary ({})",
                c.vocab_size
            )));
        }
        if let Some(&t) = batch.logits_for.iter().find(|&&t| t >= num_tokens) {
            return Err(ForwardError::Batch(format!(
                "logits requested for token {t} of {num_tokens}"
            )));
        }
        let sparse_config = self.sparse_step_config(batch, kv, policy);
        let mut step = step::CpuStep::new(self, batch, kv, &plan, head);
        step.set_sparse(sparse_config);
        if c.mla.is_some() {
            deepseek_layers(&mut step, &self.layers)?;
        } else if c.moe.is_some() {
            llama_moe_layers(&mut step, &self.layers)?;
        } else {
            llama_layers(&mut step, &self.layers)?;
        }
        let logits = self.gather_logits(step.logits, batch.logits_for.len(), head)?;
        Ok(ForwardOutput {
            logits,
            attention_path: plan.path(),
            split_kv_requests: plan.split_kv_requests(),
            gather_requests: plan.gather_requests(),
        })
    }
}

/// Threads of rayon's global pool (the configured `--threads`), read once per process and
/// asked from a thread outside every pool (inside a custom pool, `rayon::current_num_threads`
/// answers for that pool).
pub fn global_pool_threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| {
        if rayon::current_thread_index().is_none() {
            rayon::current_num_threads()
        } else {
            std::thread::spawn(rayon::current_num_threads)
                .join()
                .unwrap_or(1)
        }
    })
}

impl Model {
    /// The routing configuration of a step's sparse layers when any request of `batch` asks
    /// for sparse decode and `kv` keeps key summaries (grouped-query attention only).
    fn sparse_step_config(
        &self,
        batch: &ForwardBatch<'_>,
        kv: &KvCache,
        policy: AttentionPolicy,
    ) -> Option<StepAttentionConfig> {
        let wanted = batch.sparse.iter().any(Option::is_some);
        (wanted && kv.has_key_summaries() && self.config.mla.is_none()).then(|| {
            StepAttentionConfig {
                chunking: SplitKvChunking::new(
                    self.config.num_kv_heads,
                    self.split_kv_chunk_tokens,
                ),
                min_split_kv_tokens: policy.min_split_kv_tokens(),
            }
        })
    }

    /// The step's attention routing (made once per step, reused by every layer). A split-KV
    /// row is cut into chunks of [`Model::set_split_kv_chunk_tokens`] visible tokens from its first one,
    /// a function of position only: a row's logits are the same bits whatever the batch and
    /// whatever pool or thread count runs the step.
    fn choose_attention(
        &self,
        batch: &ForwardBatch<'_>,
        kv: &KvCache,
        policy: AttentionPolicy,
    ) -> Result<StepAttentionPlan, ForwardError> {
        // A latent cache has no V pools; its attention reads the latent rows only.
        let (Some(k_pool), Some(v_pool)) = (kv.k.first(), kv.v.first().or(kv.k.first())) else {
            return Err(ForwardError::Batch("the KV cache has no layers".into()));
        };
        let paged = PagedKv {
            k_pool: k_pool.as_slice(),
            v_pool: v_pool.as_slice(),
            layout: kv.layout,
            page_table: batch.page_table,
        };
        let config = StepAttentionConfig {
            chunking: SplitKvChunking::new(self.config.num_kv_heads, self.split_kv_chunk_tokens),
            // Latent attention has one path (`pagoda_ops::attention::mla_attention`); the plan
            // only routes every row to gather, for the step's report.
            min_split_kv_tokens: match self.config.mla {
                Some(_) => usize::MAX,
                None => policy.min_split_kv_tokens(),
            },
        };
        let num_q_heads = self.config.num_attention_heads;
        let plan = plan_step(&paged, batch.qo_indptr, num_q_heads, &config)?;
        let Some(rule) = self.cascade.filter(|_| self.config.mla.is_none()) else {
            return Ok(plan);
        };
        let plan = plan.with_cascade(batch.page_table, kv.layout.page_size, num_q_heads, &rule);
        // Counted once per step, by the whole model or the group's leader.
        if self.parallel.as_ref().is_none_or(|p| p.workers.is_some()) {
            record_cascade_step(&plan.cascade_stats());
        }
        Ok(plan)
    }
}

/// What a forward pass returns.
pub struct ForwardOutput {
    /// `[logits_for.len(), vocab_size]`.
    pub logits: Vec<f32>,
    /// [`AttentionPath::SplitKv`] when any query row of the step ran split-KV, else
    /// [`AttentionPath::Gather`].
    pub attention_path: AttentionPath,
    /// Requests of the step with at least one query row served by split-KV.
    pub split_kv_requests: usize,
    /// Requests of the step served by gather only; `split_kv_requests + gather_requests` is
    /// the batch size.
    pub gather_requests: usize,
}

/// A forward pass rejected its inputs (a bug in the caller's batch, reported, not panicked).
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("attention: {0}")]
    Attention(#[from] AttentionError),
    #[error("batch: {0}")]
    Batch(String),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
}
