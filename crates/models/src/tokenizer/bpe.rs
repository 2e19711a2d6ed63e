//! Byte-level BPE (GGUF `tokenizer.ggml.model == "gpt2"`) on the `tokenizers` crate.
//!
//! The pre-tokenizer follows llama.cpp (`llama-vocab.cpp`, `llm_tokenizer_bpe`): each
//! `tokenizer.ggml.pre` name selects a list of regexes applied one after the other; every
//! regex splits each current piece into its matches and the text between them (both kept).
//! That is exactly a `tokenizers` `Sequence` of `Split(regex, Isolated)`, followed by the
//! GPT-2 byte-to-unicode map (`ByteLevel` without its own regex). Merges are ranked by
//! their order; llama3-style vocabularies look a whole piece up first (`ignore_merges`).

use std::collections::HashMap;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::Split;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use super::{TokenKind, TokenizerError};

/// The GPT-2 split: contractions, letters, numbers, other symbols, whitespace.
const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's split (case-insensitive contractions spelled out, numbers in runs of 1-3).
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split (like Llama 3, but every number character alone).
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// DeepSeek LLM's (V2, V2-Lite) split list: newlines alone, runs of cased letters (the Latin,
/// Greek, Cyrillic, ... ranges of the original tokenizer, kept as escapes because they hold
/// compatibility characters that editors normalise), ASCII and CJK punctuation, trailing
/// spaces, CJK and Hangul runs, number runs.
const DEEPSEEK_LLM_REGEXES: &[&str] = &[
    "[\r\n]",
    "\\s?[A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+",
    "\\s?[!-/:-~\u{ff01}-\u{ff0f}\u{ff1a}-\u{ff5e}\u{2018}-\u{201f}\u{3000}-\u{3002}]+",
    "\\s+$",
    "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+",
    "\\p{N}+",
];

/// DeepSeek Coder's split list.
const DEEPSEEK_CODER_REGEXES: &[&str] = &[
    "[\r\n]",
    "\\s?\\p{L}+",
    "\\s?\\p{P}+",
    "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+",
    "\\p{N}",
];

/// DeepSeek-V3's split list (numbers in runs of 1-3, CJK and kana runs, then a Llama 3 like
/// split over letters, marks, punctuation and symbols).
const DEEPSEEK_V3_REGEXES: &[&str] = &[
    "\\p{N}{1,3}",
    "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];

/// The `tokenizer.ggml.pre` values this module understands, grouped by the regex family
/// llama.cpp gives them.
pub const SUPPORTED_PRE_TOKENIZERS: &[&str] = &[
    "default",
    "gpt2",
    "gpt-2",
    "phi-2",
    "mpt",
    "olmo",
    "jais",
    "smollm",
    "starcoder",
    "refact",
    "command-r",
    "codeshell",
    "exaone",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "pixtral",
    "dbrx",
    "smaug-bpe",
    "qwen2",
    "deepseek-r1-qwen",
    "stablelm2",
    "megrez",
    "deepseek-llm",
    "deepseek-coder",
    "deepseek-v3",
];

/// The regex list and `ignore_merges` flag llama.cpp uses for pre-tokenizer `pre`.
pub(crate) fn pre_tokenizer_regexes(
    pre: &str,
) -> Result<(Vec<&'static str>, bool), TokenizerError> {
    Ok(match pre {
        "default" | "" => (
            vec![
                r"[\p{P}\$\+<=>\^~\|]+",
                GPT2_REGEX,
                r"\p{N}+",
                r"[0-9][0-9][0-9]",
            ],
            false,
        ),
        "gpt2" | "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" => (vec![GPT2_REGEX], false),
        // Every number character is isolated before the GPT-2 split, so " 12345" becomes
        // " ", "1", "2", "3", "4", "5".
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" => {
            (vec![r"\p{N}", GPT2_REGEX], false)
        }
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => (vec![LLAMA3_REGEX], true),
        "dbrx" | "smaug-bpe" => (vec![LLAMA3_REGEX], false),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" => (vec![QWEN2_REGEX], false),
        "deepseek-llm" => (DEEPSEEK_LLM_REGEXES.to_vec(), false),
        "deepseek-coder" => (DEEPSEEK_CODER_REGEXES.to_vec(), false),
        "deepseek-v3" => (DEEPSEEK_V3_REGEXES.to_vec(), false),
        other => {
            return Err(TokenizerError::Unsupported(format!(
                "pre-tokenizer `tokenizer.ggml.pre` = {other:?}; supported: {}",
                SUPPORTED_PRE_TOKENIZERS.join(", ")
            )))
        }
    })
}

/// A GGUF pre-tokenizer that a Hugging Face `tokenizer.json` can state with its own
/// pre-tokenizers (for tools that write one from a GGUF vocabulary).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ByteLevelSplit {
    /// The GPT-2 byte-level split alone.
    Gpt2,
    /// Every digit isolated, then the GPT-2 split.
    DigitsThenGpt2,
}

/// How pre-tokenizer `pre` splits, if it is one of the [`ByteLevelSplit`] forms; read from
/// the same regex lists the tokenizer runs, so the two cannot disagree.
pub fn byte_level_split(pre: &str) -> Option<ByteLevelSplit> {
    match pre_tokenizer_regexes(pre).ok()?.0.as_slice() {
        [GPT2_REGEX] => Some(ByteLevelSplit::Gpt2),
        [r"\p{N}", GPT2_REGEX] => Some(ByteLevelSplit::DigitsThenGpt2),
        _ => None,
    }
}

/// Whether llama.cpp adds BOS by default for this pre-tokenizer (before
/// `tokenizer.ggml.add_bos_token` overrides it).
pub(crate) fn default_add_bos(pre: &str) -> bool {
    matches!(
        pre,
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral"
    )
}

/// The GPT-2 byte -> printable character table (`bytes_to_unicode`).
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next_extra = 256u32;
    for byte in 0..=255u8 {
        let printable = matches!(byte, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[byte as usize] = if printable {
            char::from(byte)
        } else {
            let c = char::from_u32(next_extra).expect("256..324 are valid chars");
            next_extra += 1;
            c
        };
    }
    table
}

/// Undoes the GPT-2 byte map: `"Ġthe"` -> `b" the"`. Characters outside the map (some
/// converted vocabularies hold raw text) keep their UTF-8 bytes.
pub(crate) fn byte_level_decode(text: &str) -> Vec<u8> {
    thread_local! {
        static CHAR_TO_BYTE: HashMap<char, u8> = byte_to_char_table()
            .iter()
            .enumerate()
            .map(|(byte, &c)| (c, byte as u8))
            .collect();
    }
    CHAR_TO_BYTE.with(|map| {
        let mut bytes = Vec::with_capacity(text.len());
        for c in text.chars() {
            match map.get(&c) {
                Some(&byte) => bytes.push(byte),
                None => {
                    let mut buffer = [0u8; 4];
                    bytes.extend_from_slice(c.encode_utf8(&mut buffer).as_bytes());
                }
            }
        }
        bytes
    })
}

/// Splits a GGUF merge line `"Ġ t"` into its two parts, at the first space after the first
/// character (as llama.cpp does).
fn split_merge(line: &str, index: usize) -> Result<(String, String), TokenizerError> {
    let first_len = line.chars().next().map(char::len_utf8).unwrap_or(0);
    let position = line[first_len..]
        .find(' ')
        .map(|p| p + first_len)
        .ok_or_else(|| {
            TokenizerError::Metadata(format!(
                "`tokenizer.ggml.merges[{index}]` = {line:?} has no space separating two tokens"
            ))
        })?;
    Ok((line[..position].to_owned(), line[position + 1..].to_owned()))
}

/// The pre-tokenizer [`build`] installs: one `Split(regex, Isolated)` per regex, then the
/// GPT-2 byte map (`ByteLevel` without its own regex).
fn byte_level_pre_tokenizer(regexes: &[&str]) -> Result<Sequence, TokenizerError> {
    let mut pre_tokenizers: Vec<PreTokenizerWrapper> = Vec::with_capacity(regexes.len() + 1);
    for &regex in regexes {
        let split = Split::new(
            tokenizers::pre_tokenizers::split::SplitPattern::Regex(regex.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| TokenizerError::Backend(format!("pre-tokenizer regex {regex:?}: {e}")))?;
        pre_tokenizers.push(split.into());
    }
    pre_tokenizers.push(ByteLevel::new(false, false, false).into());
    Ok(Sequence::new(pre_tokenizers))
}

/// Diagnostic / test entry point: the pieces the byte-level BPE pre-tokenizer for
/// `tokenizer.ggml.pre` = `pre` cuts `text` into, before any merge, as plain text (the
/// GPT-2 byte map undone). The pieces concatenate back to `text`; empty text has none.
///
/// Runs exactly the pre-tokenizer that a GGUF `gpt2` vocabulary with this `pre` gets.
/// Errors: [`TokenizerError::Unsupported`] for a `pre` outside
/// [`SUPPORTED_PRE_TOKENIZERS`], [`TokenizerError::Backend`] if the regex engine fails.
pub fn pre_tokenize(pre: &str, text: &str) -> Result<Vec<String>, TokenizerError> {
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    let (regexes, _) = pre_tokenizer_regexes(pre)?;
    let pre_tokenizer = byte_level_pre_tokenizer(&regexes)?;
    let mut pieces = PreTokenizedString::from(text);
    pre_tokenizer
        .pre_tokenize(&mut pieces)
        .map_err(|e| TokenizerError::Backend(format!("pre-tokenizing {text:?}: {e}")))?;
    pieces
        .get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(mapped, _, _)| {
            String::from_utf8(byte_level_decode(mapped)).map_err(|e| {
                TokenizerError::Backend(format!("pre-token {mapped:?} is not UTF-8: {e}"))
            })
        })
        .collect()
}

/// Builds the byte-level BPE tokenizer: vocabulary `tokens` (index = id), ranked `merges`,
/// pre-tokenizer `pre`, and every control / user-defined / unknown token registered as an
/// added token so that it is matched literally in text (as llama.cpp does).
pub(crate) fn build(
    tokens: &[String],
    kinds: &[TokenKind],
    merges: &[String],
    pre: &str,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let (regexes, ignore_merges) = pre_tokenizer_regexes(pre)?;

    let mut vocab = tokenizers::models::bpe::Vocab::default();
    vocab.reserve(tokens.len());
    for (id, text) in tokens.iter().enumerate() {
        vocab.insert(text.clone(), id as u32);
    }
    let merges = merges
        .iter()
        .enumerate()
        .map(|(index, line)| split_merge(line, index))
        .collect::<Result<Vec<_>, _>>()?;

    let model = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| TokenizerError::Metadata(format!("BPE vocabulary/merges: {e}")))?;

    let mut tokenizer = tokenizers::Tokenizer::new(model);
    tokenizer.with_pre_tokenizer(Some(byte_level_pre_tokenizer(&regexes)?));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));

    let added: Vec<AddedToken> = tokens
        .iter()
        .zip(kinds)
        .filter(|(text, kind)| kind.is_matched_in_text() && !text.is_empty())
        .map(|(text, kind)| {
            AddedToken::from(text.clone(), *kind != TokenKind::UserDefined).normalized(false)
        })
        .collect();
    tokenizer
        .add_special_tokens(added)
        .map_err(|e| TokenizerError::Backend(format!("adding special tokens: {e}")))?;
    Ok(tokenizer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_round_trips_every_byte() {
        let table = byte_to_char_table();
        assert_eq!(table[b' ' as usize], '\u{120}'); // Ġ
        assert_eq!(table[b'\n' as usize], '\u{10A}'); // Ċ
        let text: String = table.iter().collect();
        let bytes = byte_level_decode(&text);
        assert_eq!(bytes, (0..=255u8).collect::<Vec<_>>());
    }

    #[test]
    fn unknown_pre_tokenizer_lists_supported_ones() {
        let error = pre_tokenizer_regexes("nonsense").unwrap_err().to_string();
        assert!(
            error.contains("nonsense") && error.contains("smollm"),
            "{error}"
        );
    }

    #[test]
    fn merge_lines_split_after_first_char() {
        assert_eq!(split_merge("Ġ t", 0).unwrap(), ("Ġ".into(), "t".into()));
        assert_eq!(split_merge("  x", 0).unwrap(), (" ".into(), "x".into()));
        assert!(split_merge("abc", 3)
            .unwrap_err()
            .to_string()
            .contains("merges[3]"));
    }

    #[test]
    fn byte_level_splits_follow_the_regex_lists() {
        assert_eq!(byte_level_split("gpt2"), Some(ByteLevelSplit::Gpt2));
        assert_eq!(byte_level_split("olmo"), Some(ByteLevelSplit::Gpt2));
        assert_eq!(
            byte_level_split("smollm"),
            Some(ByteLevelSplit::DigitsThenGpt2)
        );
        assert_eq!(byte_level_split("llama-bpe"), None);
        assert_eq!(byte_level_split("default"), None);
        assert_eq!(byte_level_split("no-such-pre"), None);
    }
}
