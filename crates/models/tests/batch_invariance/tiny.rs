//! The tiny random llama, and the tiny random Qwen3-MoE, Mixtral and DeepSeek presets (latent
//! attention and its router), end to end:
//! every request of a mixed schedule built around the threshold against the same request run
//! alone.

use pagoda_kv::{BlockPool, BlockTable};
use pagoda_models::config::{Architecture, ModelConfig, RopeStyle};
use pagoda_models::llama::{AttentionPolicy, KvCache, Model, WeightPrecision};
use pagoda_models::random::{preset, RandomWeights};

use super::{
    assert_runs_equal, chunks_at, sequence, step, Requests, Work, PAGE_SIZE, POLICIES, THRESHOLD,
};

fn tiny_config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        hidden_size: 64,
        num_layers: 2,
        num_attention_heads: 6,
        num_kv_heads: 2,
        head_dim: 16,
        intermediate_size: 96,
        vocab_size: 97,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_dim: 16,
        rope_style: RopeStyle::Halves,
        rope_scaling: None,
        max_position_embeddings: 4096,
        tie_word_embeddings: false,
        moe: None,
        mla: None,
    }
}

/// One request of the tiny model's schedule: its tokens, the chunk lengths it is fed in when
/// batched (one chunk per step from step `first_step`), and the prompt length of its alone
/// run (one prefill, then one decode per remaining token).
struct TinyRequest {
    tokens: Vec<u32>,
    batched_chunks: Vec<usize>,
    first_step: usize,
    alone_prompt: usize,
}

/// The tiny model's requests, built around the threshold `T`:
/// 0. a long prompt cut just before `T - 1`, a 3-row chunk of rows seeing `T - 1 ..= T + 1`
///    tokens, a one-token chunk, the rest; then 6 decodes (alone: one prefill);
/// 1. a long neighbour, prefilled then decoding;
/// 2. decode rows stepping across `T` (seeing `T - 1 ..= T + 5` tokens; alone: those rows
///    are prefill rows of one chunk);
/// 3. a prompt whose last row sees exactly `T` tokens, then a 3-row chunk (alone: decodes);
/// 4. and 5. short requests.
fn tiny_requests(vocab: usize) -> Vec<TinyRequest> {
    let t = THRESHOLD;
    let long_prompt = (t + 600).max(1500);
    let decodes = |prompt: usize, total: usize| {
        let mut cuts: Vec<usize> = (prompt..total).collect();
        cuts.insert(0, prompt);
        cuts
    };
    let request = |seed, total, cuts: Vec<usize>, first_step, alone_prompt| TinyRequest {
        tokens: sequence(seed, total, vocab),
        batched_chunks: chunks_at(total, &cuts),
        first_step,
        alone_prompt,
    };
    let mut long_cuts = vec![t.saturating_sub(2), t + 1, t + 2];
    long_cuts.extend(decodes(long_prompt, long_prompt + 6));
    vec![
        request(0, long_prompt + 6, long_cuts, 0, long_prompt),
        request(1, 1205, decodes(1199, 1205), 0, 1200),
        request(2, t + 5, decodes(t.saturating_sub(2), t + 5), 1, t + 3),
        request(3, t + 3, vec![t], 2, t.saturating_sub(1).max(1)),
        request(4, 41, decodes(39, 41), 0, 30),
        request(5, 31, vec![30], 3, 31),
    ]
}

/// Runs `schedule` (per step: `(request, new token count)`, each request's tokens fed in
/// order) on a fresh cache; returns every request's logits keyed by position.
fn run_schedule(
    model: &Model,
    requests: &[TinyRequest],
    schedule: &[Vec<(usize, usize)>],
    policy: AttentionPolicy,
) -> Vec<Vec<(usize, Vec<f32>)>> {
    let num_pages = 8 + requests
        .iter()
        .map(|r| r.tokens.len().div_ceil(PAGE_SIZE))
        .sum::<usize>();
    let mut kv = KvCache::new(
        model.config().num_layers,
        model.kv_layout(num_pages, PAGE_SIZE),
    );
    let mut pool = BlockPool::new(num_pages, PAGE_SIZE).unwrap();
    let _burned: Vec<_> = (0..5).map(|_| pool.allocate().unwrap()).collect();
    let mut state = Requests {
        pool,
        tables: vec![BlockTable::new(); requests.len()],
    };
    let mut logits = vec![Vec::new(); requests.len()];
    for work in schedule {
        let work: Vec<Work> = work
            .iter()
            .map(|&(r, count)| {
                let first = state.tables[r].num_tokens();
                (r, requests[r].tokens[first..first + count].to_vec())
            })
            .collect();
        let (step_logits, _) = step(model, &mut kv, &mut state, &work, policy);
        for ((request, _), rows) in work.iter().zip(step_logits) {
            logits[*request].extend(rows);
        }
    }
    logits
}

#[test]
fn tiny_model_requests_are_bit_identical_alone_and_batched_end_to_end() {
    requests_are_bit_identical_alone_and_batched(tiny_config());
}

/// The same for mixture-of-experts models: a row's experts, and the order their outputs are
/// summed in, must not depend on the other rows routed with it.
#[test]
fn tiny_moe_requests_are_bit_identical_alone_and_batched_end_to_end() {
    // One DeepSeek preset (its latent attention, q_lora and group-limited, bias-corrected
    // router) keeps the test fast; deepseek-v2-tiny differs only in code the oracle covers.
    for name in ["qwen3-moe-tiny", "mixtral-tiny", "deepseek-v3-tiny"] {
        requests_are_bit_identical_alone_and_batched(preset(name).unwrap());
    }
}

fn requests_are_bit_identical_alone_and_batched(config: ModelConfig) {
    let weights = RandomWeights::new(&config, 5, 1 << 30).unwrap();
    let model = Model::load(config.clone(), &weights, WeightPrecision::AsStored).unwrap();
    let requests = tiny_requests(config.vocab_size);
    let num_steps = requests
        .iter()
        .map(|r| r.first_step + r.batched_chunks.len())
        .max()
        .unwrap();
    // Requests join at their first step and leave after their last chunk; the order inside
    // a step rotates so the long target is not always first.
    let batched: Vec<Vec<(usize, usize)>> = (0..num_steps)
        .map(|s| {
            let mut work: Vec<(usize, usize)> = requests
                .iter()
                .enumerate()
                .filter_map(|(r, req)| {
                    let chunk = s.checked_sub(req.first_step)?;
                    Some((r, *req.batched_chunks.get(chunk)?))
                })
                .collect();
            let len = work.len().max(1);
            work.rotate_left(s % len);
            work
        })
        .collect();
    for policy in POLICIES {
        let got = run_schedule(&model, &requests, &batched, policy);
        for (r, req) in requests.iter().enumerate() {
            let total = req.tokens.len();
            let alone: Vec<Vec<(usize, usize)>> = chunks_at(total, &decode_cuts(req))
                .into_iter()
                .map(|count| vec![(r, count)])
                .collect();
            let expected = run_schedule(&model, &requests, &alone, policy);
            assert_eq!(expected[r].len(), total);
            let context = format!(
                "{policy:?}: tiny {} request {r} (T = {THRESHOLD})",
                config.architecture.name()
            );
            assert_runs_equal(&expected[r], &got[r], &context);
        }
    }
}

/// The alone run's cuts: one prefill of `alone_prompt` tokens, then one token per step.
fn decode_cuts(request: &TinyRequest) -> Vec<usize> {
    (request.alone_prompt..request.tokens.len()).collect()
}
