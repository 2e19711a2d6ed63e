//! The model card Dynamo's frontend reads: a Hugging Face-shaped directory (config.json,
//! tokenizer.json, tokenizer_config.json with the chat template, generation_config.json).
//!
//! Dynamo 1.6 builds its model card only from such a directory (no GGUF), and its frontend
//! tokenizes and applies the chat template with it. For an HF model pagoda serves, that is the
//! model's own directory; for a GGUF, this module writes one from the GGUF's metadata: the
//! byte-level BPE vocabulary and merges (`tokenizer.ggml.model` = `gpt2`) with the GPT-2 split,
//! and the digit split first for the SmolLM/StarCoder family. Other GGUF tokenizers (SentencePiece,
//! or a BPE with another split regex) need `--model-path` with the model's HF directory.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use pagoda_models::formats::gguf::GgufFile;
use pagoda_models::tokenizer::{byte_level_split, ByteLevelSplit, Tokenizer};
use serde_json::{json, Value};

/// What the card says beyond the tokenizer.
pub struct CardFacts<'a> {
    pub tokenizer: &'a Tokenizer,
    /// The chat template's source (Jinja).
    pub chat_template: Option<&'a str>,
    /// Tokens that end generation.
    pub eos_ids: &'a [u32],
    pub context_length: usize,
}

/// Writes the card of the GGUF at `gguf` into `dir` (created if missing; files replaced
/// atomically, so workers starting together may write the same card).
pub fn write_gguf_card(gguf: &Path, dir: &Path, facts: &CardFacts) -> Result<()> {
    let file = GgufFile::open(gguf).map_err(|e| anyhow::anyhow!("{e}"))?;
    let model = file
        .get_str("tokenizer.ggml.model")
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let pre = file.get_str("tokenizer.ggml.pre").unwrap_or("default");
    let architecture = file.get_str("general.architecture").unwrap_or("llama");
    let merges = file
        .get_string_array("tokenizer.ggml.merges")
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("{}: no BPE merges", gguf.display()));
    let pre_tokenizer = pre_tokenizer(pre);
    let (merges, pre_tokenizer) = match (model, merges, pre_tokenizer) {
        ("gpt2", Ok(merges), Some(pre_tokenizer)) => (merges, pre_tokenizer),
        _ => bail!(
            "cannot write a Hugging Face tokenizer for this GGUF's tokenizer \
             (`{model}`, pre-tokenizer `{pre}`); pass --model-path with the model's Hugging Face \
             directory (config.json, tokenizer.json, tokenizer_config.json)"
        ),
    };
    let tokenizer = tokenizer_json(facts.tokenizer, &merges, pre_tokenizer);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    write_json(&dir.join("tokenizer.json"), &tokenizer)?;
    write_json(&dir.join("tokenizer_config.json"), &tokenizer_config(facts))?;
    let eos = facts.eos_ids;
    let config = json!({
        "architectures": [architecture_class(architecture)],
        "model_type": architecture,
        "vocab_size": facts.tokenizer.vocab_size(),
        "max_position_embeddings": facts.context_length,
        "bos_token_id": facts.tokenizer.bos_id(),
        "eos_token_id": eos,
    });
    write_json(&dir.join("config.json"), &config)?;
    let generation = json!({ "bos_token_id": facts.tokenizer.bos_id(), "eos_token_id": eos });
    write_json(&dir.join("generation_config.json"), &generation)?;
    Ok(())
}

/// Where a GGUF's card goes by default: one directory per model file name under the temp dir.
pub fn default_card_dir(gguf: &Path) -> PathBuf {
    let stem = gguf
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    std::env::temp_dir().join("pagoda-dynamo-cards").join(stem)
}

/// The `pre_tokenizer` of tokenizer.json for GGUF pre-tokenizer `pre`, if it is one we write.
pub fn pre_tokenizer(pre: &str) -> Option<Value> {
    let byte_level = json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
    });
    Some(match byte_level_split(pre)? {
        ByteLevelSplit::Gpt2 => byte_level,
        ByteLevelSplit::DigitsThenGpt2 => json!({
            "type": "Sequence",
            "pretokenizers": [{ "type": "Digits", "individual_digits": true }, byte_level],
        }),
    })
}

/// tokenizer.json: byte-level BPE over the GGUF's vocabulary and merges, its special tokens as
/// added tokens, BOS prepended when the GGUF asks for it.
pub fn tokenizer_json(tokenizer: &Tokenizer, merges: &[&str], pre_tokenizer: Value) -> Value {
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for id in 0..tokenizer.vocab_size() as u32 {
        let Some(text) = tokenizer.token_text(id) else {
            continue;
        };
        vocab.insert(text.to_owned(), json!(id));
        if tokenizer.token_kind(id).is_some_and(|k| k.is_special()) {
            added.push(json!({
                "id": id, "content": text, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true,
            }));
        }
    }
    let post_processor = match (
        tokenizer.add_bos(),
        tokenizer.bos_id(),
        tokenizer.bos_token(),
    ) {
        (true, Some(id), Some(token)) => json!({
            "type": "TemplateProcessing",
            "single": [{ "SpecialToken": { "id": token, "type_id": 0 } },
                       { "Sequence": { "id": "A", "type_id": 0 } }],
            "pair": [{ "SpecialToken": { "id": token, "type_id": 0 } },
                     { "Sequence": { "id": "A", "type_id": 0 } },
                     { "Sequence": { "id": "B", "type_id": 1 } }],
            "special_tokens": { (token.clone()): { "id": token, "ids": [id], "tokens": [token] } },
        }),
        _ => Value::Null,
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true },
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        },
    })
}

fn tokenizer_config(facts: &CardFacts) -> Value {
    let t = facts.tokenizer;
    let mut config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": t.add_bos(),
        "add_eos_token": t.add_eos(),
        "clean_up_tokenization_spaces": false,
        "model_max_length": facts.context_length,
        "bos_token": t.bos_token(),
        "eos_token": t.eos_token(),
    });
    if let Some(template) = facts.chat_template {
        config["chat_template"] = json!(template);
    }
    config
}

/// `LlamaForCausalLM` for `llama`, and so on (what config.json's `architectures` names).
fn architecture_class(architecture: &str) -> String {
    let mut class = String::new();
    for part in architecture.split(['-', '_']) {
        let mut chars = part.chars();
        if let Some(first) = chars.next() {
            class.extend(first.to_uppercase());
            class.push_str(chars.as_str());
        }
    }
    class + "ForCausalLM"
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    let temporary = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&temporary, text).with_context(|| format!("writing {}", path.display()))?;
    std::fs::rename(&temporary, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architecture_names_become_hf_classes() {
        assert_eq!(architecture_class("llama"), "LlamaForCausalLM");
        assert_eq!(architecture_class("qwen2"), "Qwen2ForCausalLM");
    }

    #[test]
    fn pre_tokenizers_we_write_and_those_we_do_not() {
        assert_eq!(pre_tokenizer("gpt2").unwrap()["type"], "ByteLevel");
        let smollm = pre_tokenizer("smollm").unwrap();
        assert_eq!(smollm["pretokenizers"][0]["type"], "Digits");
        assert!(pre_tokenizer("llama-bpe").is_none());
    }
}
