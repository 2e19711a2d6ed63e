//! Builds a [`Tokenizer`] from GGUF `tokenizer.*` metadata, with llama.cpp's defaults and
//! its heuristics for end-of-turn and end-of-generation tokens.

use std::collections::BTreeSet;

use super::metadata::{self, Metadata};
use super::{
    bpe, spm, ByteEncoding, SpecialTokens, TokenKind, TokenTable, Tokenizer, TokenizerError,
};

/// Token texts llama.cpp takes as end-of-turn when `tokenizer.ggml.eot_token_id` is absent.
pub(crate) const END_OF_TURN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Token texts that end generation wherever they are in the vocabulary (llama.cpp's
/// `special_eog_ids` heuristic).
pub(crate) const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// Fill-in-the-middle tokens that llama.cpp also counts as end of generation.
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"];
const FIM_REPO_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEPARATOR_TEXTS: &[&str] = &["<|file_sep|>"];

/// The lowest id whose text is one of `candidates`.
fn find_by_text(texts: &[String], candidates: &[&str]) -> Option<u32> {
    texts
        .iter()
        .position(|t| candidates.contains(&t.as_str()))
        .map(|id| id as u32)
}

/// An id from metadata `key`, else the lowest id whose text is in `candidates`.
fn id_or_text(
    metadata: &Metadata,
    key: &str,
    texts: &[String],
    candidates: &[&str],
) -> Result<Option<u32>, TokenizerError> {
    Ok(metadata::token_id(metadata, key, texts.len())?.or_else(|| find_by_text(texts, candidates)))
}

/// Builds the tokenizer from `tokenizer.*` metadata (see [`Tokenizer::from_gguf`]).
pub(crate) fn from_metadata(metadata: &Metadata) -> Result<Tokenizer, TokenizerError> {
    let model = metadata::string(metadata, "tokenizer.ggml.model")?
        .ok_or_else(|| TokenizerError::Metadata("missing `tokenizer.ggml.model`".into()))?
        .to_owned();
    let texts = metadata::string_array(metadata, "tokenizer.ggml.tokens")?
        .ok_or_else(|| TokenizerError::Metadata("missing `tokenizer.ggml.tokens`".into()))?;
    if texts.is_empty() {
        return Err(TokenizerError::Metadata(
            "`tokenizer.ggml.tokens` is empty".into(),
        ));
    }
    let vocab_size = texts.len();
    if vocab_size > u32::MAX as usize {
        return Err(TokenizerError::Metadata(format!(
            "{vocab_size} tokens do not fit u32 ids"
        )));
    }
    let mut kinds = match metadata::int_array(metadata, "tokenizer.ggml.token_type")? {
        None => vec![TokenKind::Normal; vocab_size],
        Some(types) if types.len() == vocab_size => {
            types.into_iter().map(TokenKind::from_gguf).collect()
        }
        Some(types) => {
            return Err(TokenizerError::Metadata(format!(
                "`tokenizer.ggml.token_type` has {} entries but `tokenizer.ggml.tokens` has {vocab_size}",
                types.len()
            )))
        }
    };

    let is_spm = match model.as_str() {
        "gpt2" => false,
        "llama" => true,
        other => {
            return Err(TokenizerError::Unsupported(format!(
                "`tokenizer.ggml.model` = {other:?}; supported: \"gpt2\" (byte-level BPE), \"llama\" (SentencePiece)"
            )))
        }
    };
    let pre = metadata::string(metadata, "tokenizer.ggml.pre")?
        .unwrap_or("default")
        .to_owned();

    let mut special = read_special_tokens(metadata, &texts, is_spm, &pre)?;
    // llama.cpp forces tokens that look like turn / generation ends to control type, which
    // also makes them parse out of text.
    let forced_control = special
        .end_of_generation
        .iter()
        .copied()
        .chain(special.eot)
        .chain(special.eom);
    for id in forced_control.collect::<Vec<_>>() {
        if kinds[id as usize] != TokenKind::Control && kinds[id as usize] != TokenKind::UserDefined
        {
            kinds[id as usize] = TokenKind::Control;
        }
    }
    if let Some(unk) = special.unk {
        if kinds[unk as usize] == TokenKind::Normal && is_spm {
            kinds[unk as usize] = TokenKind::Unknown;
        }
    }
    let chat_template = metadata::string(metadata, "tokenizer.chat_template")?.map(str::to_owned);

    if is_spm {
        let scores = match metadata::float_array(metadata, "tokenizer.ggml.scores")? {
            None => vec![0.0; vocab_size],
            Some(scores) if scores.len() == vocab_size => scores,
            Some(scores) => {
                return Err(TokenizerError::Metadata(format!(
                    "`tokenizer.ggml.scores` has {} entries but `tokenizer.ggml.tokens` has {vocab_size}",
                    scores.len()
                )))
            }
        };
        let model = spm::SpmModel::new(&texts, scores, &kinds);
        let table = TokenTable::new(texts, kinds, ByteEncoding::SentencePiece);
        Ok(Tokenizer::from_parts_spm(
            model,
            table,
            special,
            chat_template,
        ))
    } else {
        let merges =
            metadata::string_array(metadata, "tokenizer.ggml.merges")?.ok_or_else(|| {
                TokenizerError::Metadata(
                    "missing `tokenizer.ggml.merges` (required for gpt2 BPE)".into(),
                )
            })?;
        special.add_space_prefix = false;
        let tokenizer = bpe::build(&texts, &kinds, &merges, &pre)?;
        let table = TokenTable::new(texts, kinds, ByteEncoding::ByteLevel);
        Ok(Tokenizer::from_parts_hf(
            tokenizer,
            false,
            table,
            special,
            chat_template,
        ))
    }
}

/// Special ids, flags and the end-of-generation set, with llama.cpp's defaults: SPM
/// vocabularies default to bos 1, eos 2, unk 0, add BOS and add a space prefix; BPE
/// vocabularies add BOS only for llama3-style pre-tokenizers.
fn read_special_tokens(
    metadata: &Metadata,
    texts: &[String],
    is_spm: bool,
    pre: &str,
) -> Result<SpecialTokens, TokenizerError> {
    let vocab_size = texts.len();
    let spm_default = |id: u32| (is_spm && (id as usize) < vocab_size).then_some(id);
    let key = |name: &str| format!("tokenizer.ggml.{name}");
    let bos = metadata::token_id(metadata, &key("bos_token_id"), vocab_size)?.or(spm_default(1));
    let eos = metadata::token_id(metadata, &key("eos_token_id"), vocab_size)?.or(spm_default(2));
    let unk =
        metadata::token_id(metadata, &key("unknown_token_id"), vocab_size)?.or(spm_default(0));
    let pad = metadata::token_id(metadata, &key("padding_token_id"), vocab_size)?;
    let eot = id_or_text(metadata, &key("eot_token_id"), texts, END_OF_TURN_TEXTS)?;
    let eom = id_or_text(metadata, &key("eom_token_id"), texts, &["<|eom_id|>"])?;
    let fim_pad = id_or_text(metadata, &key("fim_pad_token_id"), texts, FIM_PAD_TEXTS)?;
    let fim_repo = id_or_text(metadata, &key("fim_rep_token_id"), texts, FIM_REPO_TEXTS)?;
    let fim_separator = id_or_text(
        metadata,
        &key("fim_sep_token_id"),
        texts,
        FIM_SEPARATOR_TEXTS,
    )?;

    let add_bos = metadata::boolean(metadata, &key("add_bos_token"))?
        .unwrap_or(is_spm || bpe::default_add_bos(pre));
    let add_eos = metadata::boolean(metadata, &key("add_eos_token"))?.unwrap_or(false);
    let add_space_prefix = metadata::boolean(metadata, &key("add_space_prefix"))?.unwrap_or(is_spm);
    if add_bos && bos.is_none() {
        return Err(TokenizerError::Metadata(
            "`tokenizer.ggml.add_bos_token` is set but there is no `tokenizer.ggml.bos_token_id`"
                .into(),
        ));
    }
    if add_eos && eos.is_none() {
        return Err(TokenizerError::Metadata(
            "`tokenizer.ggml.add_eos_token` is set but there is no `tokenizer.ggml.eos_token_id`"
                .into(),
        ));
    }

    let mut end_of_generation: BTreeSet<u32> = [eos, eot, eom, fim_pad, fim_repo, fim_separator]
        .into_iter()
        .flatten()
        .collect();
    for (id, text) in texts.iter().enumerate() {
        if END_OF_GENERATION_TEXTS.contains(&text.as_str()) {
            end_of_generation.insert(id as u32);
        }
    }
    // gpt-oss (o200k_harmony): `<|end|>` ends a message, not the generation.
    let has = |t: &str| find_by_text(texts, &[t]).is_some_and(|id| end_of_generation.contains(&id));
    if has("<|return|>") && has("<|call|>") {
        if let Some(end) = find_by_text(texts, &["<|end|>"]) {
            end_of_generation.remove(&end);
        }
    }

    Ok(SpecialTokens {
        bos,
        eos,
        eot,
        eom,
        unk,
        pad,
        add_bos,
        add_eos,
        add_space_prefix,
        end_of_generation,
    })
}
