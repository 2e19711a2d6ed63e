//! Hugging Face tensor names and their canonical (GGUF) equivalents.

use crate::weights::names;

/// The canonical (GGUF) name of a HF llama/mistral/qwen2/qwen3 tensor name, or `None` for a
/// name pagoda does not use. E.g. `model.layers.3.self_attn.q_proj.weight` ->
/// `blk.3.attn_q.weight`.
pub fn canonical_name(hf_name: &str) -> Option<String> {
    match hf_name {
        "model.embed_tokens.weight" => return Some(names::TOKEN_EMBEDDING.to_string()),
        "model.norm.weight" => return Some(names::OUTPUT_NORM.to_string()),
        "lm_head.weight" => return Some(names::OUTPUT.to_string()),
        _ => {}
    }
    let (layer, suffix) = split_index(hf_name.strip_prefix("model.layers.")?)?;
    let canonical_suffix = match suffix {
        "input_layernorm.weight" => names::ATTN_NORM,
        "self_attn.q_proj.weight" => names::ATTN_Q,
        "self_attn.k_proj.weight" => names::ATTN_K,
        "self_attn.v_proj.weight" => names::ATTN_V,
        "self_attn.o_proj.weight" => names::ATTN_OUTPUT,
        "self_attn.q_proj.bias" => names::ATTN_Q_BIAS,
        "self_attn.k_proj.bias" => names::ATTN_K_BIAS,
        "self_attn.v_proj.bias" => names::ATTN_V_BIAS,
        "self_attn.o_proj.bias" => "attn_output.bias",
        "self_attn.q_norm.weight" => names::ATTN_Q_NORM,
        "self_attn.k_norm.weight" => names::ATTN_K_NORM,
        "self_attn.q_a_proj.weight" => names::ATTN_Q_A,
        "self_attn.q_a_layernorm.weight" => names::ATTN_Q_A_NORM,
        "self_attn.q_b_proj.weight" => names::ATTN_Q_B,
        "self_attn.kv_a_proj_with_mqa.weight" => names::ATTN_KV_A_MQA,
        "self_attn.kv_a_layernorm.weight" => names::ATTN_KV_A_NORM,
        "self_attn.kv_b_proj.weight" => names::ATTN_KV_B,
        "self_attn.indexer.wq_b.weight" => names::INDEXER_ATTN_Q_B,
        "self_attn.indexer.wk.weight" => names::INDEXER_ATTN_K,
        "self_attn.indexer.k_norm.weight" => names::INDEXER_K_NORM,
        "self_attn.indexer.k_norm.bias" => names::INDEXER_K_NORM_BIAS,
        "self_attn.indexer.weights_proj.weight" => names::INDEXER_PROJ,
        "mlp.gate.e_score_correction_bias" => names::FFN_EXP_PROBS_B,
        "mlp.shared_experts.gate_proj.weight" => names::FFN_GATE_SHEXP,
        "mlp.shared_experts.up_proj.weight" => names::FFN_UP_SHEXP,
        "mlp.shared_experts.down_proj.weight" => names::FFN_DOWN_SHEXP,
        "post_attention_layernorm.weight" => names::FFN_NORM,
        "mlp.gate_proj.weight" => names::FFN_GATE,
        "mlp.up_proj.weight" => names::FFN_UP,
        "mlp.down_proj.weight" => names::FFN_DOWN,
        // The mixture-of-experts router: Qwen3-MoE's, Mixtral's.
        "mlp.gate.weight" | "block_sparse_moe.gate.weight" => names::FFN_GATE_INP,
        _ => return None,
    };
    Some(names::layer(layer, canonical_suffix))
}

/// The canonical stacked tensor and the expert index of one expert's HF tensor, or `None`:
/// `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight` (Qwen3-MoE) and
/// `model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` (Mixtral: w1 is the gate,
/// w3 the up, w2 the down projection) -> (`blk.{i}.ffn_{gate,up,down}_exps.weight`, e).
pub fn canonical_expert_name(hf_name: &str) -> Option<(String, usize)> {
    let (layer, rest) = split_index(hf_name.strip_prefix("model.layers.")?)?;
    let experts = rest
        .strip_prefix("mlp.experts.")
        .or_else(|| rest.strip_prefix("block_sparse_moe.experts."))?;
    let (expert, suffix) = split_index(experts)?;
    let canonical_suffix = match suffix {
        "gate_proj.weight" | "w1.weight" => names::FFN_GATE_EXPS,
        "up_proj.weight" | "w3.weight" => names::FFN_UP_EXPS,
        "down_proj.weight" | "w2.weight" => names::FFN_DOWN_EXPS,
        _ => return None,
    };
    Some((names::layer(layer, canonical_suffix), expert))
}

/// `"12.rest"` -> `(12, "rest")`; rejects spellings such as `01` or `+1` that would alias
/// another index.
fn split_index(text: &str) -> Option<(usize, &str)> {
    let (index_text, rest) = text.split_once('.')?;
    let index: usize = index_text.parse().ok()?;
    (index.to_string() == index_text).then_some((index, rest))
}

/// An expert part's HF name with its expert index replaced by `*`.
pub(super) fn expert_pattern(hf_name: &str) -> String {
    for marker in [".mlp.experts.", ".block_sparse_moe.experts."] {
        if let Some(at) = hf_name.find(marker) {
            let (head, tail) = hf_name.split_at(at + marker.len());
            if let Some((_, rest)) = tail.split_once('.') {
                return format!("{head}*.{rest}");
            }
        }
    }
    hf_name.to_string()
}
