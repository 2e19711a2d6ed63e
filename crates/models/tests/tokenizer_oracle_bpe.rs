// Byte-level BPE end to end against the Hugging Face `tokenizers` package (Python): tiny
// vocabularies trained with the Llama 3 and Qwen2 pre-tokenizers (Split with the models'
// original regex + ByteLevel without regex, as their tokenizer.json files do), exported as a
// GGUF would hold them, then built with `Tokenizer::from_gguf_metadata` (model "gpt2",
// `tokenizer.ggml.pre` = "llama-bpe" / "qwen2"). Fixtures:
// tests/data/tokenizer/oracle/bpe_{llama3,qwen2}.json, made by
// scripts/fixtures/tokenizer_oracle_bpe.py.

use std::collections::BTreeMap;
use std::path::PathBuf;

use pagoda_models::formats::gguf::MetadataValue;
use pagoda_models::tokenizer::{TokenKind, Tokenizer};
use serde_json::Value;

fn fixture(stem: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(format!("tests/data/tokenizer/oracle/bpe_{stem}.json"));
    serde_json::from_str(&std::fs::read_to_string(path).expect("BPE fixture"))
        .expect("fixture JSON")
}

fn string_array(value: &Value) -> MetadataValue {
    MetadataValue::Array(
        value
            .as_array()
            .expect("array")
            .iter()
            .map(|v| MetadataValue::String(v.as_str().expect("string").to_owned()))
            .collect(),
    )
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("ids")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
}

/// The GGUF metadata llama.cpp's converter would write for this vocabulary.
fn metadata(fixture: &Value) -> BTreeMap<String, MetadataValue> {
    let tokens = fixture["tokens"].as_array().unwrap();
    let id_of = |text: &Value| tokens.iter().position(|t| t == text).unwrap() as u32;
    let specials = fixture["special_tokens"].as_array().unwrap();
    let mut metadata = BTreeMap::new();
    let mut put = |key: &str, value: MetadataValue| {
        metadata.insert(format!("tokenizer.ggml.{key}"), value);
    };
    put("model", MetadataValue::String("gpt2".into()));
    put(
        "pre",
        MetadataValue::String(fixture["pre"].as_str().unwrap().into()),
    );
    put("tokens", string_array(&fixture["tokens"]));
    put("merges", string_array(&fixture["merges"]));
    put(
        "token_type",
        MetadataValue::Array(
            fixture["token_types"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| MetadataValue::I32(v.as_i64().unwrap() as i32))
                .collect(),
        ),
    );
    put("bos_token_id", MetadataValue::U32(id_of(&specials[0])));
    put("eos_token_id", MetadataValue::U32(id_of(&specials[1])));
    metadata
}

fn check_against_oracle(stem: &str) -> (Tokenizer, Value) {
    let fixture = fixture(stem);
    let tokenizer = Tokenizer::from_gguf_metadata(&metadata(&fixture)).expect("build tokenizer");
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() > 50);
    let mut mismatches = Vec::new();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let expected = ids(&case["ids"]);
        let actual = tokenizer.encode(text, false).expect("encode");
        if actual != expected {
            mismatches.push(format!(
                "{text:?}:\n  pagoda {actual:?}\n  oracle {expected:?}"
            ));
        }
        // Byte-level BPE is lossless: decoding gives the text back, specials included.
        assert_eq!(tokenizer.decode(&expected), text, "decode of {text:?}");
    }
    assert!(
        mismatches.is_empty(),
        "{stem}: {} of {} texts differ:\n{}",
        mismatches.len(),
        cases.len(),
        mismatches.join("\n")
    );
    (tokenizer, fixture)
}

#[test]
fn llama3_bpe_matches_hf_tokenizers() {
    let (tokenizer, fixture) = check_against_oracle("llama3");
    // llama.cpp adds BOS by default for llama3-style pre-tokenizers.
    let bos = tokenizer.bos_id().expect("bos");
    assert!(tokenizer.add_bos());
    let case = &fixture["cases"][1];
    let mut expected = vec![bos];
    expected.extend(ids(&case["ids"]));
    assert_eq!(
        tokenizer
            .encode(case["text"].as_str().unwrap(), true)
            .unwrap(),
        expected
    );
    assert_eq!(tokenizer.token_kind(bos), Some(TokenKind::Control));
    // "<|eot_id|>" ends generation (llama.cpp's text heuristic).
    assert!(tokenizer.is_end_of_generation(tokenizer.eos_id().unwrap()));
}

#[test]
fn qwen2_bpe_matches_hf_tokenizers() {
    let (tokenizer, fixture) = check_against_oracle("qwen2");
    // No BOS by default for qwen2.
    assert!(!tokenizer.add_bos());
    let case = &fixture["cases"][1];
    assert_eq!(
        tokenizer
            .encode(case["text"].as_str().unwrap(), true)
            .unwrap(),
        ids(&case["ids"])
    );
}

#[test]
fn the_oracle_distinguishes_the_two_pre_tokenizers() {
    // The same vocabulary under the other pre-tokenizer must give different ids for
    // multi-digit numbers (runs of three vs one digit at a time): the test can fail.
    let fixture = fixture("llama3");
    let mut metadata = metadata(&fixture);
    metadata.insert(
        "tokenizer.ggml.pre".into(),
        MetadataValue::String("qwen2".into()),
    );
    let tokenizer = Tokenizer::from_gguf_metadata(&metadata).unwrap();
    let case = fixture["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["text"].as_str().unwrap().starts_with("1 12 123"))
        .expect("digits case");
    assert_ne!(
        tokenizer
            .encode(case["text"].as_str().unwrap(), false)
            .unwrap(),
        ids(&case["ids"])
    );
}

/// llama.cpp cuts control, user-defined AND unknown-typed token texts out of the input
/// (`parse_special`); an unknown-typed token (GGUF type 2) written in the text is one id.
#[test]
fn unknown_typed_token_text_is_parsed_like_llamacpp() {
    let fixture = fixture("qwen2");
    let mut metadata = metadata(&fixture);
    let tokens = fixture["tokens"].as_array().unwrap();
    let im_start = tokens.iter().position(|t| t == "<|im_start|>").unwrap();
    // Not the EOS here, or llama.cpp's end-of-generation rule would force it to control.
    metadata.remove("tokenizer.ggml.eos_token_id");
    if let Some(MetadataValue::Array(types)) = metadata.get_mut("tokenizer.ggml.token_type") {
        types[im_start] = MetadataValue::I32(2);
    }
    let tokenizer = Tokenizer::from_gguf_metadata(&metadata).unwrap();
    assert_eq!(
        tokenizer.token_kind(im_start as u32),
        Some(TokenKind::Unknown)
    );
    let ids = tokenizer.encode("<|im_start|>", false).unwrap();
    assert_eq!(ids, vec![im_start as u32]);
}
