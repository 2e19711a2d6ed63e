//! Tokenizers from GGUF metadata or a Hugging Face `tokenizer.json`, and streaming
//! detokenization.
//!
//! One [`Tokenizer`] type covers three vocabularies:
//! - GGUF `tokenizer.ggml.model == "gpt2"`: byte-level BPE, pre-tokenized with the regexes
//!   llama.cpp picks from `tokenizer.ggml.pre` (see [`bpe`]), run by the `tokenizers` crate;
//! - GGUF `tokenizer.ggml.model == "llama"`: SentencePiece vocabularies, tokenized like
//!   llama.cpp's SPM tokenizer (bigram merges by highest score, byte fallback; see [`spm`]);
//! - a Hugging Face directory (`tokenizer.json` + `tokenizer_config.json`), run by the
//!   `tokenizers` crate as is (see [`hf_dir`]).
//!
//! In every case the special tokens written in the text (`<|im_start|>`) become their single
//! id, as llama.cpp does with `parse_special = true`. Decoding goes through
//! [`Tokenizer::token_bytes`]: the raw bytes each token stands for, so that a
//! [`StreamDecoder`] can cut text only at UTF-8 character boundaries.

mod bpe;
mod gguf_vocab;
mod hf_dir;
mod metadata;
mod spm;
mod stream;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

use crate::formats::gguf::GgufFile;

pub use bpe::{byte_level_split, pre_tokenize, ByteLevelSplit, SUPPORTED_PRE_TOKENIZERS};
pub use stream::StreamDecoder;

/// Why a tokenizer could not be built or could not encode. The message names the metadata
/// key, file or token that is wrong.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// GGUF metadata is missing a key or holds a value of the wrong type or range.
    #[error("tokenizer metadata: {0}")]
    Metadata(String),
    /// The vocabulary kind or pre-tokenizer is not supported.
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    /// A Hugging Face tokenizer file could not be read or parsed.
    #[error("tokenizer file {path}: {message}")]
    File { path: String, message: String },
    /// The `tokenizers` crate failed while building or encoding.
    #[error("tokenizer: {0}")]
    Backend(String),
}

/// What kind of token an id is, from GGUF `tokenizer.ggml.token_type` (1..=6) or from the
/// added-token table of a `tokenizer.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    /// An ordinary vocabulary entry (type 1).
    Normal,
    /// The unknown token (type 2).
    Unknown,
    /// A control token such as `<|im_start|>` or `</s>` (type 3).
    Control,
    /// A user-defined added token (type 4); matched in text like a control token.
    UserDefined,
    /// A reserved, unused entry (type 5).
    Unused,
    /// A byte-fallback token `<0xXX>` (type 6).
    Byte,
}

impl TokenKind {
    /// The kind for GGUF token type `value`; unknown values count as normal.
    pub fn from_gguf(value: i64) -> TokenKind {
        match value {
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            5 => TokenKind::Unused,
            6 => TokenKind::Byte,
            _ => TokenKind::Normal,
        }
    }

    /// Control and user-defined tokens: the added tokens that are matched literally in
    /// input text (the unknown token's text is matched too, see `is_matched_in_text`).
    pub fn is_special(self) -> bool {
        matches!(self, TokenKind::Control | TokenKind::UserDefined)
    }

    /// Whether this token's text written in the input becomes its id: control,
    /// user-defined and unknown tokens, as llama.cpp's `tokenizer_st_partition` does with
    /// `parse_special = true` (its special-token cache holds all three kinds).
    pub(crate) fn is_matched_in_text(self) -> bool {
        matches!(
            self,
            TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown
        )
    }
}

/// How a normal token's text maps back to bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ByteEncoding {
    /// GPT-2 byte-to-unicode map (`Ġ` for space).
    ByteLevel,
    /// SentencePiece: `▁` stands for a space, `<0xXX>` tokens for raw bytes.
    SentencePiece,
}

/// Per-id token texts and bytes, shared with [`StreamDecoder`]s.
#[derive(Debug)]
pub(crate) struct TokenTable {
    /// The vocabulary text of each id (as stored: `Ġthe`, `▁the`, `<0x0A>`, `<|im_end|>`).
    pub(crate) texts: Vec<String>,
    pub(crate) kinds: Vec<TokenKind>,
    /// The raw bytes each id decodes to (see [`Tokenizer::token_bytes`]).
    pub(crate) bytes: Vec<Vec<u8>>,
}

impl TokenTable {
    /// Builds the table, computing every token's bytes once.
    pub(crate) fn new(texts: Vec<String>, kinds: Vec<TokenKind>, encoding: ByteEncoding) -> Self {
        let bytes = texts
            .iter()
            .zip(&kinds)
            .map(|(text, &kind)| token_text_to_bytes(text, kind, encoding))
            .collect();
        TokenTable {
            texts,
            kinds,
            bytes,
        }
    }
}

/// The raw bytes a token stands for.
fn token_text_to_bytes(text: &str, kind: TokenKind, encoding: ByteEncoding) -> Vec<u8> {
    match kind {
        TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown => {
            text.as_bytes().to_vec()
        }
        TokenKind::Byte => match parse_byte_token(text) {
            Some(byte) => vec![byte],
            None => text.as_bytes().to_vec(),
        },
        TokenKind::Normal | TokenKind::Unused => match encoding {
            ByteEncoding::ByteLevel => bpe::byte_level_decode(text),
            ByteEncoding::SentencePiece => match parse_byte_token(text) {
                Some(byte) => vec![byte],
                None => text.replace('\u{2581}', " ").into_bytes(),
            },
        },
    }
}

/// `<0xAB>` -> `0xAB`.
pub(crate) fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// The tokenizing engine behind a [`Tokenizer`].
enum Backend {
    /// The `tokenizers` crate (GGUF byte-level BPE, or a Hugging Face directory).
    Hf {
        tokenizer: Box<tokenizers::Tokenizer>,
        /// Whether `encode(.., add_special_tokens = true)` is handled by the crate's own
        /// post-processor (Hugging Face directories) rather than by our BOS/EOS flags.
        post_processor_adds_specials: bool,
    },
    /// llama.cpp's SentencePiece emulation.
    Spm(Box<spm::SpmModel>),
}

/// Special token ids and flags shared by every backend.
#[derive(Debug, Clone, Default)]
pub(crate) struct SpecialTokens {
    pub(crate) bos: Option<u32>,
    pub(crate) eos: Option<u32>,
    pub(crate) eot: Option<u32>,
    pub(crate) eom: Option<u32>,
    pub(crate) unk: Option<u32>,
    pub(crate) pad: Option<u32>,
    pub(crate) add_bos: bool,
    pub(crate) add_eos: bool,
    /// SentencePiece: prefix raw text with a space (that becomes `▁`) at the start and after
    /// each special token.
    pub(crate) add_space_prefix: bool,
    /// Ids that end generation (eos, eot, eom and llama.cpp's text heuristics).
    pub(crate) end_of_generation: BTreeSet<u32>,
}

/// A tokenizer: text <-> token ids, plus the model's special tokens and chat template.
///
/// Immutable after construction; `Send + Sync`, share it behind an `Arc`.
pub struct Tokenizer {
    backend: Backend,
    table: Arc<TokenTable>,
    special: SpecialTokens,
    chat_template: Option<String>,
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.*` metadata.
    ///
    /// Supports `tokenizer.ggml.model` `"gpt2"` (byte-level BPE; `tokenizer.ggml.pre` must be
    /// one of [`SUPPORTED_PRE_TOKENIZERS`]) and `"llama"` (SentencePiece). Errors name the
    /// missing or malformed key.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        gguf_vocab::from_metadata(&file.metadata)
    }

    /// Like [`Tokenizer::from_gguf`], from a metadata map (lets tests build vocabularies by
    /// hand).
    pub fn from_gguf_metadata(
        metadata: &std::collections::BTreeMap<String, crate::formats::gguf::MetadataValue>,
    ) -> Result<Tokenizer, TokenizerError> {
        gguf_vocab::from_metadata(metadata)
    }

    /// Loads `dir/tokenizer.json` and, when present, `dir/tokenizer_config.json` (BOS/EOS
    /// texts, `add_bos_token`, `chat_template`) and `dir/generation_config.json`
    /// (`eos_token_id`, one id or a list, added to the end-of-generation set).
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        hf_dir::from_dir(dir)
    }

    /// Like [`Tokenizer::from_hf_dir`] from the JSON texts themselves.
    pub fn from_hf_json(
        tokenizer_json: &str,
        tokenizer_config_json: Option<&str>,
    ) -> Result<Tokenizer, TokenizerError> {
        hf_dir::from_json(tokenizer_json, tokenizer_config_json, None)
    }

    pub(crate) fn from_parts_hf(
        tokenizer: tokenizers::Tokenizer,
        post_processor_adds_specials: bool,
        table: TokenTable,
        special: SpecialTokens,
        chat_template: Option<String>,
    ) -> Tokenizer {
        Tokenizer {
            backend: Backend::Hf {
                tokenizer: Box::new(tokenizer),
                post_processor_adds_specials,
            },
            table: Arc::new(table),
            special,
            chat_template,
        }
    }

    pub(crate) fn from_parts_spm(
        model: spm::SpmModel,
        table: TokenTable,
        special: SpecialTokens,
        chat_template: Option<String>,
    ) -> Tokenizer {
        Tokenizer {
            backend: Backend::Spm(Box::new(model)),
            table: Arc::new(table),
            special,
            chat_template,
        }
    }

    /// Encodes `text` into token ids.
    ///
    /// Special tokens written in the text are always parsed into their ids. With
    /// `add_special_tokens`, BOS is prepended when the model asks for it ([`Self::add_bos`]),
    /// and EOS appended when `tokenizer.ggml.add_eos_token` is set.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        match &self.backend {
            Backend::Hf {
                tokenizer,
                post_processor_adds_specials,
            } => {
                if *post_processor_adds_specials {
                    let encoding = tokenizer
                        .encode(text, add_special_tokens)
                        .map_err(|e| TokenizerError::Backend(e.to_string()))?;
                    return Ok(encoding.get_ids().to_vec());
                }
                let mut ids = Vec::new();
                if add_special_tokens && self.special.add_bos {
                    ids.extend(self.special.bos);
                }
                let encoding = tokenizer
                    .encode(text, false)
                    .map_err(|e| TokenizerError::Backend(e.to_string()))?;
                ids.extend_from_slice(encoding.get_ids());
                if add_special_tokens && self.special.add_eos {
                    ids.extend(self.special.eos);
                }
                Ok(ids)
            }
            Backend::Spm(model) => Ok(model.encode(text, add_special_tokens, &self.special)),
        }
    }

    /// Encodes a prompt rendered by a chat template. BOS is added as [`Self::encode`] would,
    /// except when the template already wrote the BOS text at the start (Llama 3 style
    /// templates do), which would otherwise give two.
    pub fn encode_chat(&self, rendered: &str) -> Result<Vec<u32>, TokenizerError> {
        let template_wrote_bos = self
            .bos_token()
            .is_some_and(|bos| !bos.is_empty() && rendered.starts_with(&bos));
        self.encode(rendered, !template_wrote_bos)
    }

    /// Decodes ids to text: the concatenated [`Self::token_bytes`], invalid UTF-8 replaced
    /// by U+FFFD. Special tokens are rendered as their text. For SentencePiece vocabularies
    /// with `add_space_prefix`, the leading space of the first token is dropped (as
    /// llama.cpp's detokenizer does), so `decode(encode(t)) == t`. Ids outside the
    /// vocabulary decode to nothing.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for (position, &id) in ids.iter().enumerate() {
            let piece = self.token_bytes_ref(id);
            if position == 0 && self.special.add_space_prefix && piece.first() == Some(&b' ') {
                bytes.extend_from_slice(&piece[1..]);
            } else {
                bytes.extend_from_slice(piece);
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The raw bytes token `id` stands for: the GPT-2 byte map undone, `<0xXX>` as the byte,
    /// `▁` as a space, special tokens as their text. Empty for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.token_bytes_ref(id).to_vec()
    }

    fn token_bytes_ref(&self, id: u32) -> &[u8] {
        self.table
            .bytes
            .get(id as usize)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The vocabulary text of `id` as stored (`Ġthe`, `▁the`, `<|im_end|>`), or `None`
    /// outside the vocabulary.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.table.texts.get(id as usize).map(String::as_str)
    }

    /// The kind of token `id`, or `None` outside the vocabulary.
    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        self.table.kinds.get(id as usize).copied()
    }

    /// Number of ids (vocabulary plus added tokens); valid ids are `0..vocab_size`.
    pub fn vocab_size(&self) -> usize {
        self.table.texts.len()
    }

    /// Beginning-of-sequence id, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.special.bos
    }

    /// End-of-sequence id, if the model has one.
    pub fn eos_id(&self) -> Option<u32> {
        self.special.eos
    }

    /// End-of-turn id (`<|eot_id|>`, `<|im_end|>`...), if found.
    pub fn eot_id(&self) -> Option<u32> {
        self.special.eot
    }

    /// Unknown-token id, if any.
    pub fn unk_id(&self) -> Option<u32> {
        self.special.unk
    }

    /// Padding id, if any.
    pub fn pad_id(&self) -> Option<u32> {
        self.special.pad
    }

    /// Whether `encode(.., true)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.special.add_bos
    }

    /// Whether `encode(.., true)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.special.add_eos
    }

    /// Whether generating `id` ends the sequence.
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.special.end_of_generation.contains(&id)
    }

    /// All end-of-generation ids, ascending.
    pub fn end_of_generation_ids(&self) -> Vec<u32> {
        self.special.end_of_generation.iter().copied().collect()
    }

    /// The model's Jinja chat template source, if it ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// BOS text for chat templates (`bos_token` variable).
    pub fn bos_token(&self) -> Option<String> {
        self.special
            .bos
            .and_then(|id| self.token_text(id))
            .map(str::to_owned)
    }

    /// EOS text for chat templates (`eos_token` variable).
    pub fn eos_token(&self) -> Option<String> {
        self.special
            .eos
            .and_then(|id| self.token_text(id))
            .map(str::to_owned)
    }

    /// A fresh streaming detokenizer for one sequence.
    pub fn stream_decoder(&self) -> StreamDecoder {
        StreamDecoder::new(Arc::clone(&self.table))
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let backend = match &self.backend {
            Backend::Hf { .. } => "tokenizers",
            Backend::Spm(_) => "spm",
        };
        f.debug_struct("Tokenizer")
            .field("backend", &backend)
            .field("vocab_size", &self.vocab_size())
            .field("special", &self.special)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_and_stream_decoder_are_thread_safe() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<StreamDecoder>();
    }

    #[test]
    fn byte_tokens_parse_only_exact_hex_pairs() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(10));
        assert_eq!(parse_byte_token("<0xff>"), Some(255));
        assert_eq!(parse_byte_token("<0x0>"), None);
        assert_eq!(parse_byte_token("<0xZZ>"), None);
        assert_eq!(parse_byte_token("0x0A"), None);
    }
}
