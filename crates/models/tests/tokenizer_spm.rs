// SentencePiece (GGUF "llama") tokenization on a tiny hand-made vocabulary. The expected ids
// are worked out by hand from llama.cpp's algorithm (bigram merges by highest score, ties to
// the leftmost pair, byte fallback, space prefix at the start and after special tokens);
// each case notes the derivation.

use std::collections::BTreeMap;

use pagoda_models::formats::gguf::MetadataValue;
use pagoda_models::tokenizer::{TokenKind, Tokenizer};

const UNK: u32 = 0;
const BOS: u32 = 1;
const EOS: u32 = 2;
const fn byte(b: u8) -> u32 {
    3 + b as u32
}
const SPACE: u32 = 259; // "▁"
const A: u32 = 260;
const B: u32 = 261;
const C: u32 = 262;
const AB: u32 = 263;
const BC: u32 = 264;
const SPACE_A: u32 = 265; // "▁a"
const ABC: u32 = 266;
const SEPARATOR: u32 = 267; // "<sep>", control
const X: u32 = 268;
const Y: u32 = 269;
const XY: u32 = 270;
const YX: u32 = 271;

/// (text, score, GGUF token type) per id.
fn vocabulary() -> Vec<(String, f32, i32)> {
    let mut vocab = vec![
        ("<unk>".to_owned(), 0.0, 2),
        ("<s>".to_owned(), 0.0, 3),
        ("</s>".to_owned(), 0.0, 3),
    ];
    for b in 0..=255u8 {
        vocab.push((format!("<0x{b:02X}>"), 0.0, 6));
    }
    for (text, score, kind) in [
        ("▁", -1.0, 1),
        ("a", -2.0, 1),
        ("b", -2.0, 1),
        ("c", -2.0, 1),
        ("ab", -0.5, 1),
        ("bc", -0.2, 1),
        ("▁a", -0.3, 1),
        ("abc", -0.1, 1),
        ("<sep>", 0.0, 3),
        ("x", -3.0, 1),
        ("y", -3.0, 1),
        ("xy", -1.0, 1),
        ("yx", -1.0, 1),
    ] {
        vocab.push((text.to_owned(), score, kind));
    }
    vocab
}

fn metadata(extra: &[(&str, MetadataValue)]) -> BTreeMap<String, MetadataValue> {
    let vocab = vocabulary();
    let mut metadata = BTreeMap::new();
    let mut put = |key: &str, value: MetadataValue| {
        metadata.insert(key.to_owned(), value);
    };
    put(
        "tokenizer.ggml.model",
        MetadataValue::String("llama".into()),
    );
    put(
        "tokenizer.ggml.tokens",
        MetadataValue::Array(
            vocab
                .iter()
                .map(|v| MetadataValue::String(v.0.clone()))
                .collect(),
        ),
    );
    put(
        "tokenizer.ggml.scores",
        MetadataValue::Array(vocab.iter().map(|v| MetadataValue::F32(v.1)).collect()),
    );
    put(
        "tokenizer.ggml.token_type",
        MetadataValue::Array(vocab.iter().map(|v| MetadataValue::I32(v.2)).collect()),
    );
    for (key, value) in extra {
        put(key, value.clone());
    }
    metadata
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf_metadata(&metadata(&[])).expect("tiny SPM vocabulary")
}

#[test]
fn defaults_follow_llamacpp_for_spm() {
    let tokenizer = tokenizer();
    assert_eq!(
        (tokenizer.bos_id(), tokenizer.eos_id(), tokenizer.unk_id()),
        (Some(BOS), Some(EOS), Some(UNK))
    );
    assert!(tokenizer.add_bos());
    assert_eq!(tokenizer.end_of_generation_ids(), vec![EOS]);
    assert_eq!(tokenizer.token_kind(byte(0x41)), Some(TokenKind::Byte));
    assert_eq!(tokenizer.token_bytes(byte(0xE2)), vec![0xE2]);
    assert_eq!(tokenizer.token_bytes(SPACE_A), b" a");
    assert_eq!(
        (tokenizer.token_text(A), tokenizer.token_text(BC)),
        (Some("a"), Some("bc"))
    );
}

#[test]
fn highest_score_pair_merges_first() {
    let tokenizer = tokenizer();
    // "▁abc": candidates ▁a (-0.3), ab (-0.5), bc (-0.2). bc wins -> ▁ a bc; then abc
    // (-0.1) -> ▁ abc; "▁abc" is not a token. BOS first (add_bos defaults on).
    assert_eq!(
        tokenizer.encode("abc", true).unwrap(),
        vec![BOS, SPACE, ABC]
    );
    assert_eq!(tokenizer.encode("abc", false).unwrap(), vec![SPACE, ABC]);
    // "▁cab": only ab is a token -> ▁ c ab.
    assert_eq!(tokenizer.encode("cab", false).unwrap(), vec![SPACE, C, AB]);
    // "▁a▁b": ▁a merges, "▁b" is not a token.
    assert_eq!(
        tokenizer.encode("a b", false).unwrap(),
        vec![SPACE_A, SPACE, B]
    );
}

#[test]
fn equal_scores_merge_the_leftmost_pair() {
    let tokenizer = tokenizer();
    // "▁xyx": xy (left 1) and yx (left 2) both score -1: xy first, then "xyx" is no token.
    assert_eq!(tokenizer.encode("xyx", false).unwrap(), vec![SPACE, XY, X]);
    assert_eq!(tokenizer.encode("yxy", false).unwrap(), vec![SPACE, YX, Y]);
}

#[test]
fn unknown_characters_fall_back_to_bytes() {
    let tokenizer = tokenizer();
    // "€" = E2 82 AC is not in the vocabulary.
    assert_eq!(
        tokenizer.encode("a€", false).unwrap(),
        vec![SPACE_A, byte(0xE2), byte(0x82), byte(0xAC)]
    );
    assert_eq!(
        tokenizer.decode(&[SPACE_A, byte(0xE2), byte(0x82), byte(0xAC)]),
        "a€"
    );
}

#[test]
fn special_tokens_split_text_and_restart_the_space_prefix() {
    let tokenizer = tokenizer();
    // "a" -> ▁a; <sep>; "b" after a special token gets a new space prefix -> ▁ b.
    assert_eq!(
        tokenizer.encode("a<sep>b", false).unwrap(),
        vec![SPACE_A, SEPARATOR, SPACE, B]
    );
    assert_eq!(tokenizer.encode("<s>a", false).unwrap(), vec![BOS, SPACE_A]);
    assert_eq!(tokenizer.encode("", true).unwrap(), vec![BOS]);
    assert_eq!(tokenizer.encode("", false).unwrap(), Vec::<u32>::new());
}

#[test]
fn flags_from_metadata_override_defaults() {
    let tokenizer = Tokenizer::from_gguf_metadata(&metadata(&[
        (
            "tokenizer.ggml.add_space_prefix",
            MetadataValue::Bool(false),
        ),
        ("tokenizer.ggml.add_bos_token", MetadataValue::Bool(false)),
        ("tokenizer.ggml.add_eos_token", MetadataValue::Bool(true)),
    ]))
    .unwrap();
    // No space prefix: "abc" -> bc, then abc.
    assert_eq!(tokenizer.encode("abc", true).unwrap(), vec![ABC, EOS]);
    assert_eq!(tokenizer.decode(&[SPACE, ABC]), " abc");
}

#[test]
fn decode_drops_the_added_space_prefix_once() {
    let tokenizer = tokenizer();
    let ids = tokenizer.encode("a b", false).unwrap();
    assert_eq!(tokenizer.decode(&ids), "a b");
    // After BOS the first piece is "<s>", so the space stays (llama.cpp does the same).
    assert_eq!(tokenizer.decode(&[BOS, SPACE, ABC]), "<s> abc");
}

#[test]
fn bad_metadata_gives_clear_errors() {
    let mut broken = metadata(&[]);
    broken.insert(
        "tokenizer.ggml.scores".into(),
        MetadataValue::Array(vec![MetadataValue::F32(0.0)]),
    );
    let error = Tokenizer::from_gguf_metadata(&broken)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("tokenizer.ggml.scores") && error.contains("272"),
        "{error}"
    );

    let mut broken = metadata(&[]);
    broken.insert(
        "tokenizer.ggml.bos_token_id".into(),
        MetadataValue::U32(100_000),
    );
    let error = Tokenizer::from_gguf_metadata(&broken)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("bos_token_id") && error.contains("outside"),
        "{error}"
    );

    let mut broken = metadata(&[]);
    broken.insert(
        "tokenizer.ggml.model".into(),
        MetadataValue::String("bert".into()),
    );
    let error = Tokenizer::from_gguf_metadata(&broken)
        .unwrap_err()
        .to_string();
    assert!(error.contains("bert") && error.contains("gpt2"), "{error}");

    let mut broken = metadata(&[]);
    broken.remove("tokenizer.ggml.tokens");
    let error = Tokenizer::from_gguf_metadata(&broken)
        .unwrap_err()
        .to_string();
    assert!(error.contains("tokenizer.ggml.tokens"), "{error}");

    let mut broken = metadata(&[]);
    broken.insert(
        "tokenizer.ggml.model".into(),
        MetadataValue::String("gpt2".into()),
    );
    broken.insert(
        "tokenizer.ggml.pre".into(),
        MetadataValue::String("mystery".into()),
    );
    broken.insert("tokenizer.ggml.merges".into(), MetadataValue::Array(vec![]));
    let error = Tokenizer::from_gguf_metadata(&broken)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("mystery") && error.contains("smollm") && error.contains("llama-bpe"),
        "{error}"
    );
}
