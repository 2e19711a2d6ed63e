//! Builds a [`Tokenizer`] from a Hugging Face `tokenizer.json` (+ `tokenizer_config.json`,
//! `generation_config.json`, `chat_template.jinja`).

use std::collections::BTreeSet;
use std::path::Path;
use std::str::FromStr;

use serde_json::Value;

use super::gguf_vocab::{END_OF_GENERATION_TEXTS, END_OF_TURN_TEXTS};
use super::{
    parse_byte_token, ByteEncoding, SpecialTokens, TokenKind, TokenTable, Tokenizer, TokenizerError,
};

fn read_optional(path: &Path) -> Result<Option<String>, TokenizerError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(file_error(path.display(), e)),
    }
}

fn file_error(path: impl std::fmt::Display, message: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::File {
        path: path.to_string(),
        message: message.to_string(),
    }
}

/// Loads the tokenizer files of a Hugging Face model directory.
pub(crate) fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer_json = read_optional(&tokenizer_path)?
        .ok_or_else(|| file_error(tokenizer_path.display(), "not found"))?;
    let config = read_optional(&dir.join("tokenizer_config.json"))?;
    let generation_config = read_optional(&dir.join("generation_config.json"))?;
    let mut tokenizer = from_json(
        &tokenizer_json,
        config.as_deref(),
        generation_config.as_deref(),
    )
    .map_err(|e| match e {
        TokenizerError::File { path, message } => file_error(dir.join(path).display(), message),
        other => other,
    })?;
    if tokenizer.chat_template.is_none() {
        tokenizer.chat_template = read_optional(&dir.join("chat_template.jinja"))?;
    }
    Ok(tokenizer)
}

/// A special-token entry of `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_content(value: Option<&Value>) -> Option<&str> {
    match value? {
        Value::String(s) => Some(s),
        Value::Object(map) => map.get("content")?.as_str(),
        _ => None,
    }
}

/// `chat_template` as a string, or a list of `{name, template}` (the one named "default",
/// else the first).
fn chat_template_of(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(templates) => {
            let named = |name: &str| {
                templates
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
            };
            named("default")
                .or_else(|| templates.first())
                .and_then(|t| t.get("template")?.as_str())
                .map(str::to_owned)
        }
        _ => None,
    }
}

/// Whether a SentencePiece-style tokenizer.json prepends `▁` to the text (a `Prepend`
/// normalizer, or a `Metaspace` pre-tokenizer not set to "never"), so that decoding drops
/// that space again.
fn adds_space_prefix(raw: &Value, encoding: ByteEncoding) -> bool {
    if encoding != ByteEncoding::SentencePiece {
        return false;
    }
    let normalizer = raw
        .get("normalizer")
        .map(Value::to_string)
        .unwrap_or_default();
    let pre_tokenizer = raw
        .get("pre_tokenizer")
        .map(Value::to_string)
        .unwrap_or_default();
    normalizer.contains("\"Prepend\"")
        || (pre_tokenizer.contains("\"Metaspace\"") && !pre_tokenizer.contains("\"never\""))
}

/// Builds the tokenizer from the JSON texts; a missing config means "no extra settings".
pub(crate) fn from_json(
    tokenizer_json: &str,
    config_json: Option<&str>,
    generation_config_json: Option<&str>,
) -> Result<Tokenizer, TokenizerError> {
    let parse = |name: &str, text: &str| -> Result<Value, TokenizerError> {
        serde_json::from_str(text).map_err(|e| file_error(name, format!("invalid JSON: {e}")))
    };
    let raw = parse("tokenizer.json", tokenizer_json)?;
    let config = config_json
        .map(|text| parse("tokenizer_config.json", text))
        .transpose()?
        .unwrap_or(Value::Null);
    let generation_config = generation_config_json
        .map(|text| parse("generation_config.json", text))
        .transpose()?
        .unwrap_or(Value::Null);
    let tokenizer = tokenizers::Tokenizer::from_str(tokenizer_json)
        .map_err(|e| file_error("tokenizer.json", e))?;

    let is_byte_level = ["decoder", "pre_tokenizer"].iter().any(|key| {
        raw.get(*key)
            .is_some_and(|v| v.to_string().contains("\"ByteLevel\""))
    });
    let encoding = if is_byte_level {
        ByteEncoding::ByteLevel
    } else {
        ByteEncoding::SentencePiece
    };

    // Texts and kinds per id.
    let vocab = tokenizer.get_vocab(true);
    let vocab_size = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
    if vocab_size == 0 {
        return Err(file_error("tokenizer.json", "the vocabulary is empty"));
    }
    let mut texts = vec![String::new(); vocab_size];
    let mut kinds = vec![TokenKind::Unused; vocab_size];
    for (text, &id) in &vocab {
        let kind = if encoding == ByteEncoding::SentencePiece && parse_byte_token(text).is_some() {
            TokenKind::Byte
        } else {
            TokenKind::Normal
        };
        texts[id as usize] = text.clone();
        kinds[id as usize] = kind;
    }
    for (id, added) in tokenizer.get_added_tokens_decoder() {
        if let Some(kind) = kinds.get_mut(id as usize) {
            *kind = if added.special {
                TokenKind::Control
            } else {
                TokenKind::UserDefined
            };
        }
    }

    let id_of = |value: Option<&Value>| token_content(value).and_then(|t| tokenizer.token_to_id(t));
    let bos = id_of(config.get("bos_token"));
    let eos = id_of(config.get("eos_token"));
    let unk = id_of(config.get("unk_token"));
    let pad = id_of(config.get("pad_token"));

    // Llama-style configs state add_bos/add_eos explicitly (transformers then rebuilds the
    // post-processor from them); otherwise the tokenizer.json post-processor decides.
    let config_add_bos = config.get("add_bos_token").and_then(Value::as_bool);
    let config_add_eos = config.get("add_eos_token").and_then(Value::as_bool);
    let post_processor_adds_specials = config_add_bos.is_none() && config_add_eos.is_none();
    let (add_bos, add_eos) = if post_processor_adds_specials {
        let probe = tokenizer
            .encode("a", true)
            .map_err(|e| TokenizerError::Backend(e.to_string()))?;
        let ids = probe.get_ids();
        (
            bos.is_some() && ids.first().copied() == bos,
            eos.is_some() && ids.last().copied() == eos,
        )
    } else {
        (
            config_add_bos.unwrap_or(false),
            config_add_eos.unwrap_or(false),
        )
    };
    if add_bos && bos.is_none() {
        return Err(file_error(
            "tokenizer_config.json",
            "add_bos_token is set but bos_token is missing or not in the vocabulary",
        ));
    }
    if add_eos && eos.is_none() {
        return Err(file_error(
            "tokenizer_config.json",
            "add_eos_token is set but eos_token is missing or not in the vocabulary",
        ));
    }

    let is_special = |id: usize| kinds[id].is_special();
    let eot = texts
        .iter()
        .enumerate()
        .position(|(id, t)| is_special(id) && END_OF_TURN_TEXTS.contains(&t.as_str()))
        .map(|id| id as u32);
    let mut end_of_generation: BTreeSet<u32> = eos.into_iter().chain(eot).collect();
    for (id, text) in texts.iter().enumerate() {
        if is_special(id) && END_OF_GENERATION_TEXTS.contains(&text.as_str()) {
            end_of_generation.insert(id as u32);
        }
    }
    match generation_config.get("eos_token_id") {
        Some(Value::Number(n)) => end_of_generation.extend(n.as_u64().map(|id| id as u32)),
        Some(Value::Array(ids)) => {
            end_of_generation.extend(ids.iter().filter_map(Value::as_u64).map(|id| id as u32))
        }
        _ => {}
    }
    end_of_generation.retain(|&id| (id as usize) < vocab_size);

    let special = SpecialTokens {
        bos,
        eos,
        eot,
        eom: None,
        unk,
        pad,
        add_bos,
        add_eos,
        add_space_prefix: adds_space_prefix(&raw, encoding),
        end_of_generation,
    };
    let chat_template = chat_template_of(&config);
    let table = TokenTable::new(texts, kinds, encoding);
    Ok(Tokenizer::from_parts_hf(
        tokenizer,
        post_processor_adds_specials,
        table,
        special,
        chat_template,
    ))
}
